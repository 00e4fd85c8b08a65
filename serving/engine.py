"""The engine: requests in, tokens and text out, many at once.

    from serving.engine import LLM
    from serving.sampling import SamplingParams
    llm = LLM("beam-tiny")
    [out] = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=16))
    print(out.outputs[0].text)

`LLMEngine` is the synchronous core (`add_request`, `abort_request`, `step`); each step asks the
scheduler what to run, runs it as one compiled program (`ModelRunner`), then turns sampled tokens
into text deltas and finished requests. `AsyncEngine` (serving/async_engine.py) drives it from a
background thread for the server; `LLM` is the offline batch API for notebooks and scripts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh

import beam_jax
from beam_jax.api import SHIPPED_DRAFTERS, Beam, checkpoint_dir, convert_experts, quantize, quantized_expert_format
from beam_jax.config import PRESETS, BeamConfig, preset
from beam_jax.drafter import DrafterConfig, load_drafter
from beam_jax.model import Params, flat_params
from beam_jax.quant.convert import quantization_config_for
from beam_jax.sharding import AXES, check_mesh, make_mesh
from serving.grammar import GrammarBackend, Matcher
from serving.kv_cache import KVPool
from serving.prefix_cache import PrefixCache
from serving.runner import ModelRunner, token_buckets
from serving.sampling import SamplerOutput, SamplingBatch, SamplingParams, StopChecker, TokenHistory, full_bitmask
from serving.scheduler import Request, Scheduler, SchedulerOutput
from serving.speculative_step import SPECULATIVE_METHODS, SpecOutput, check_drafter, drafter_memory_spec

log = logging.getLogger(__name__)


def default_page_tokens() -> int:
    """Tokens per KV page when the config names none: 64 on a GPU, where the decode kernels are tuned
    for pages of 64 and the Mosaic GPU one takes only multiples of 64
    (`pallas_kernels.paged_attention.use_mosaic_split`); 16 elsewhere (plain jnp: finer prefix-cache
    hits and less of a last page unused)."""
    return 64 if jax.default_backend() == "gpu" else 16


@dataclasses.dataclass
class EngineConfig:
    """Engine settings, named as vLLM's flags."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_prefill_chunk: int | None = None  # default: the token budget
    max_model_len: int | None = None  # default: min(config.max_position_embeddings, 4096)
    page_tokens: int | None = None  # default: `default_page_tokens()` (64 on a GPU, 16 elsewhere)
    num_pages: int | None = None  # default: every sequence can reach max_model_len
    # The smallest token bucket (a power of two). None: `serving.runner.default_min_token_bucket()`
    # (1 on a GPU, 16 elsewhere).
    min_token_bucket: int | None = None
    enable_prefix_caching: bool = True
    # Tensor / expert parallelism over the first tp*ep devices (beam_jax.sharding): 1, 1 is one device.
    # `check_parallelism` says what a model and the devices need for it.
    tp: int = 1
    ep: int = 1
    # "fp8" or "nvfp4": quantize a bf16 model's experts as it loads (beam_jax.api.quantize); None: as stored.
    quantization: str | None = None
    # NVFP4 experts on the Mosaic GPU kernel, repacked at load time (`beam_jax.api.convert_experts`):
    # "auto" (on Hopper GPUs where the shapes fit), "mosaic" (always; refused where they do not), "triton".
    expert_kernel: str = "auto"
    # The attention path, `pallas_kernels.paged_attention.ragged_paged_attention`'s `use_kernel`: False
    # (plain jnp), "decode" (decode tokens on the split decode kernel), True (all kernels). None: the
    # backend's default (`default_use_kernel`: "decode" on GPU, plain jnp on CPU; on a mesh as `ModelRunner` says).
    attention_kernel: bool | str | None = None
    # Speculative decoding (serving/speculative_step.py): "dflash" with a DFlash / DFlash2 drafter
    # checkpoint (`draft_model`, a directory or a shipped name) verifying `num_speculative_tokens`
    # drafts per step (default: the drafter's block size - 1). `simulated_accept_length` (benchmarks
    # only) accepts that many tokens per step on average whatever the target says: its text is not
    # the model's, and its acceptance is reported as simulated.
    speculative: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int | None = None
    simulated_accept_length: float | None = None


def check_parallelism(model_config: BeamConfig, tp: int, ep: int, num_devices: int) -> None:
    """Whether `model_config` can be served on a (tp, ep) mesh of `num_devices` devices; every problem
    in one ValueError. The mesh needs tp*ep devices (the first ones are used, so it need not use them
    all); the query heads must split evenly over tp (beam_jax.sharding would otherwise replicate them,
    and every device would compute every head: no speed-up); the experts must divide as
    `beam_jax.sharding.check_mesh` requires. KV heads, the dense MLP and the vocabulary need nothing:
    whatever does not split evenly is replicated."""
    for name, size in (("tp", tp), ("ep", ep)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
    problems = []
    if tp * ep > num_devices:
        hint = ""
        if jax.default_backend() == "cpu":
            hint = f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tp * ep} makes that many)"
        problems.append(f"tp={tp} x ep={ep} needs {tp * ep} devices, JAX sees {num_devices}{hint}")
    if model_config.num_attention_heads % tp:
        problems.append(f"num_attention_heads ({model_config.num_attention_heads}) is not divisible by tp={tp}")
    try:
        check_mesh(model_config, AbstractMesh((ep, tp), AXES))
    except ValueError as error:
        problems.append(str(error))
    if problems:
        raise ValueError(f"cannot serve on tp={tp}, ep={ep}: " + "; ".join(problems))


def _served_config(model: str | Beam, quantization: str | None) -> BeamConfig | None:
    """The config of the model that `beam_jax.load(model, quantization=...)` gives, read without
    loading it (None where `load` will fail anyway, with its own error). A quantization that the
    checkpoint cannot take fails here."""
    from beam_jax.checkpoint import read_config

    if isinstance(model, Beam):
        config = model.config
    elif str(model) in PRESETS:
        config = preset(str(model))
    elif (path := checkpoint_dir(model)) is not None and (path / "config.json").is_file():
        config = read_config(path)
    else:
        return None
    expert_format = quantized_expert_format(config, quantization)
    if expert_format == config.expert_format:
        return config
    return config.replace(quantization_config=quantization_config_for(config, expert_format))


@dataclasses.dataclass
class CompletionOutput:
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # of each chosen token
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: everything so far plus this step's delta."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_text: str = ""
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache


class _Detokenizer:
    """Incremental detokenization: decodes a short window of recent tokens and emits the new text
    once it no longer ends in an incomplete UTF-8 character (byte-level BPE splits characters)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""


@dataclasses.dataclass
class _Tracked:
    request: Request
    stop: StopChecker
    detokenizer: _Detokenizer
    history: TokenHistory | None
    completion: CompletionOutput
    arrival_time: float
    first_token_time: float | None = None
    # Host-side sequence number for unseeded sampling keys (stable across preemptions).
    key_id: int = 0
    matcher: Matcher | None = None  # the request's grammar (SamplingParams.grammar)


@dataclasses.dataclass
class SpecMetrics:
    """Speculative decoding acceptance: per verified block, and per draft position."""

    simulated: bool = False  # the figures are the simulated acceptance (benchmark mode), not the drafter's
    blocks: int = 0  # verify blocks (speculating rows of steps)
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    proposed_at: list[int] = dataclasses.field(default_factory=list)  # blocks with a draft at position j
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # ... whose draft j was accepted

    def record(self, num_drafts: int, num_accepted: int) -> None:
        grow = max(0, num_drafts - len(self.proposed_at))
        self.proposed_at += [0] * grow
        self.accepted_at += [0] * grow
        self.blocks += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def snapshot(self) -> dict:
        return {
            "spec_simulated": self.simulated,
            "spec_blocks": self.blocks,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # Tokens emitted per verify block: accepted drafts plus the target's own token.
            "spec_mean_accept_length": (self.accepted_tokens + self.blocks) / self.blocks if self.blocks else 0.0,
            "spec_acceptance_by_position": [a / p for a, p in zip(self.accepted_at, self.proposed_at)],
        }


@dataclasses.dataclass
class EngineMetrics:
    steps: int = 0
    prompt_tokens: int = 0  # computed (not served by the cache)
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    spec: SpecMetrics | None = None  # with a drafter

    def snapshot(self, engine: LLMEngine) -> dict:
        pool = engine.pool
        cache = engine.prefix_cache
        return {
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "pool_pages_used": pool.num_used,
            "pool_pages_total": pool.num_pages,
            "pool_usage": pool.num_used / max(pool.num_pages, 1),
            "prefix_hit_rate": cache.stats.hit_rate if cache is not None else 0.0,
            "preemptions": engine.scheduler.num_preemptions,
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": (self.generated_tokens + self.prompt_tokens) / self.busy_seconds if self.busy_seconds else 0.0,
            "compilations": engine.runner.compilations,
        } | (self.spec.snapshot() if self.spec is not None else {})


class LLMEngine:
    def __init__(
        self, model: str | Beam = "beam-tiny", *, config: EngineConfig | None = None, dtype=None, seed: int = 0,
        drafter: tuple[DrafterConfig, Params] | None = None,
    ):
        """`drafter`: a drafter already in memory (its config and parameters), for
        `config.speculative` instead of a `config.draft_model` checkpoint."""
        config = config or EngineConfig()
        if config.min_token_bucket is not None:
            token_buckets(config.max_num_batched_tokens, config.min_token_bucket)  # refuses a bad one before loading
        served = _served_config(model, config.quantization)  # refuses what cannot be served before loading
        if (config.tp, config.ep) != (1, 1) and served is not None:
            check_parallelism(served, config.tp, config.ep, jax.device_count())
        mesh = make_mesh(tp=config.tp, ep=config.ep) if config.tp * config.ep > 1 else None
        if isinstance(model, Beam):
            self.beam = quantize(model, config.quantization)
            # The caller's own experts are left alone (converting copies them); ones quantized here are replaced.
            self.beam = convert_experts(self.beam, config.expert_kernel, mesh, own_params=self.beam is not model)
        else:
            self.beam = beam_jax.load(model, dtype=dtype, seed=seed, mesh=mesh, quantization=config.quantization,
                                      expert_kernel=config.expert_kernel)
        if config.page_tokens is None:
            config = dataclasses.replace(config, page_tokens=default_page_tokens())
        self.config = config
        model_config = self.beam.config
        self.max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 4096)
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's {model_config.max_position_embeddings} positions"
            )
        compute_dtype = flat_params(self.beam.params)["model.embed_tokens.weight"].dtype
        drafter = self._load_drafter(config, model_config, compute_dtype, drafter)
        drafter_spec = None if drafter is None else drafter_memory_spec(*drafter)
        pages_per_seq = -(-self.max_model_len // config.page_tokens)
        num_pages = config.num_pages or config.max_num_seqs * pages_per_seq * len(
            KVPool.from_config(model_config, 0, page_tokens=config.page_tokens, drafter=drafter_spec).groups
        )
        self.pool = KVPool.from_config(model_config, num_pages, page_tokens=config.page_tokens, drafter=drafter_spec)
        self.prefix_cache = PrefixCache(self.pool) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_chunk=config.max_prefill_chunk,
            prefix_cache=self.prefix_cache,
        )
        self.runner = ModelRunner(
            model_config, self.beam.params, self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            dtype=compute_dtype,
            mesh=mesh,
            attention_kernel=config.attention_kernel,
            drafter=drafter,
            num_speculative_tokens=config.num_speculative_tokens,
            simulated_accept_length=config.simulated_accept_length,
            min_token_bucket=config.min_token_bucket,
        )
        self.tokenizer = self.beam.tokenizer
        self.eos_token_ids = tuple(self.beam.stop_token_ids)
        self.vocab_size = model_config.vocab_size
        self._tracked: dict[str, _Tracked] = {}
        self._key_ids = 0
        self.metrics = EngineMetrics()
        if drafter is not None:
            self.metrics.spec = SpecMetrics(simulated=config.simulated_accept_length is not None)
        self._grammar_backend: GrammarBackend | None = None

    @staticmethod
    def _load_drafter(config: EngineConfig, model_config: BeamConfig, dtype, drafter):
        """The drafter (config, params) that `config` asks for, checked against the model; None without."""
        if config.speculative is None:
            for name in ("draft_model", "num_speculative_tokens", "simulated_accept_length"):
                if getattr(config, name) is not None:
                    raise ValueError(f"{name} is set but speculative decoding is not (speculative='dflash')")
            if drafter is not None:
                raise ValueError("a drafter is given but speculative decoding is not (speculative='dflash')")
            return None
        if config.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {config.speculative!r}; known: {', '.join(SPECULATIVE_METHODS)}")
        if (config.draft_model is None) == (drafter is None):
            raise ValueError(f"speculative={config.speculative!r} needs a draft_model (a drafter checkpoint directory)"
                             " or an in-memory drafter, not both")
        if drafter is None:
            path = SHIPPED_DRAFTERS.get(config.draft_model) or checkpoint_dir(config.draft_model)
            if path is None:
                names = ", ".join(SHIPPED_DRAFTERS)
                raise FileNotFoundError(f"draft model {config.draft_model!r} is neither a shipped drafter ({names}) nor a directory")
            drafter = load_drafter(path, dtype=dtype)
        check_drafter(drafter[0], model_config)
        return drafter

    @property
    def grammar_backend(self) -> GrammarBackend:
        """Compiles request grammars; made on first use (xgrammar imports torch: seconds)."""
        if self._grammar_backend is None:
            self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_backend

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if bad := [t for t in prompt_ids if not 0 <= t < self.vocab_size]:
            raise ValueError(f"prompt token ids outside the vocabulary of {self.vocab_size}: {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len} "
                "(prompt plus at least one new token must fit)"
            )
        for t in params.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary of {self.vocab_size}")
        request = self.scheduler.add(request_id, prompt_ids, params)
        matcher = self.grammar_backend.matcher(params.grammar) if params.grammar is not None else None  # ValueError
        history = TokenHistory(prompt_ids) if params.has_penalties else None
        self._key_ids += 1
        self._tracked[request_id] = _Tracked(
            request, StopChecker(params, self.eos_token_ids), _Detokenizer(self.tokenizer), history,
            CompletionOutput(), time.monotonic(), key_id=self._key_ids, matcher=matcher,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is (waiting, mid-prefill, mid-decode) and frees its pages."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort(tracked.request)
        tracked.completion.finish_reason = "abort"
        return self._output(tracked, "", [])

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        plan = self.scheduler.schedule()
        outputs = [self._finish(self._tracked.pop(r.request_id), "length") for r in plan.finished]
        if plan.scheduled:
            result = self.runner.execute(plan.scheduled, self._sampling_batch(plan))
            self.scheduler.update(plan, getattr(result, "num_accepted", None))
            outputs += self._consume(plan, result)
            self.metrics.steps += 1
            self.metrics.prompt_tokens += sum(s.num_tokens for s in plan.scheduled if not s.samples or s.num_tokens > 1)
        self.metrics.busy_seconds += time.monotonic() - started
        return outputs

    def _sampling_batch(self, plan: SchedulerOutput) -> SamplingBatch:
        rows = self.runner.rows_for(self.runner.step_bucket(plan.scheduled))
        tracked = [self._tracked[s.request.request_id] for s in plan.scheduled]
        return SamplingBatch.build(
            [t.request.params for t in tracked],
            request_ids=[t.key_id for t in tracked],
            num_output_tokens=[len(t.request.output_ids) for t in tracked],
            histories=[t.history for t in tracked],
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            pad_to=rows,
            **self.runner.sampling_widths(max((len(t.history) for t in tracked if t.history is not None), default=0)),
            token_bitmask=self._token_bitmask(plan, tracked, rows),
        )

    def _token_bitmask(self, plan: SchedulerOutput, tracked: list[_Tracked], rows: int):
        """The rows' allowed tokens from their grammars (None: no row has one). O(constrained rows)."""
        if all(t.matcher is None for t in tracked):
            return None
        bitmask = full_bitmask(rows, self.vocab_size)
        for row, (item, t) in enumerate(zip(plan.scheduled, tracked)):
            if t.matcher is not None and item.samples:
                t.matcher.fill(bitmask, row)
        return bitmask

    def _consume(self, plan: SchedulerOutput, result: SamplerOutput | SpecOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for row, item in enumerate(plan.scheduled):
            tracked = self._tracked.get(item.request.request_id)
            if tracked is None or not item.samples:
                continue
            if tracked.first_token_time is None:
                tracked.first_token_time = now
            if isinstance(result, SpecOutput) and item.num_drafts:
                self.metrics.spec.record(item.num_drafts, int(result.num_accepted[row]))
            delta, new_ids = "", []
            for token, logprob, top in self._emitted(result, row, item):
                new_ids.append(token)
                delta += self._append_token(tracked, token, logprob, top)
                if tracked.stop.finished:  # a stop inside a block: the tokens after it are dropped
                    break
            request, completion = tracked.request, tracked.completion
            if tracked.stop.finished:
                self._tracked.pop(request.request_id)
                self.scheduler.finish(request, tracked.stop.finish_reason)
                completion.finish_reason, completion.stop_reason = tracked.stop.finish_reason, tracked.stop.stop_reason
            elif isinstance(result, SpecOutput):
                request.draft_tokens = self._next_drafts(tracked, result.drafts[row])
            completion.text += delta
            outputs.append(self._output(tracked, delta, new_ids))
        return outputs

    def _emitted(self, result: SamplerOutput | SpecOutput, row: int, item) -> list[tuple[int, float, list | None]]:
        """The row's new tokens with their logprobs (and top logprobs, for rows that asked: those
        never speculate)."""
        sampled = result.sampled if isinstance(result, SpecOutput) else result
        top = None
        if item.request.params.logprobs is not None:
            top = [(int(i), float(v)) for i, v in zip(sampled.top_token_ids[row], sampled.top_logprobs[row])]
        if not isinstance(result, SpecOutput) or not item.num_drafts:
            return [(int(sampled.tokens[row]), float(sampled.logprobs[row]), top)]
        accepted = int(result.num_accepted[row])
        return [(int(result.tokens[row, j]), float(result.logprobs[row, j]), None) for j in range(accepted + 1)]

    def _append_token(self, tracked: _Tracked, token: int, logprob: float, top: list | None) -> str:
        """One new token of a request: its output, history, grammar and stop checks. The new text."""
        request, completion = tracked.request, tracked.completion
        request.output_ids.append(token)
        self.metrics.generated_tokens += 1
        if tracked.history is not None:
            tracked.history.append(token)
        completion.token_ids.append(token)
        completion.logprobs.append(logprob)
        if (k := request.params.logprobs) is not None:
            completion.top_logprobs.append(top[:k])
        delta = tracked.stop.append(token, tracked.detokenizer.add(token))
        if tracked.matcher is not None and not tracked.stop.finished and self._grammar_done(tracked, token):
            delta += tracked.stop.finish("stop")
        if not tracked.stop.finished and request.num_tokens >= self.max_model_len:
            delta += tracked.stop.finish("length")
        return delta

    def _next_drafts(self, tracked: _Tracked, drafts) -> list[int]:
        """The drafts the request verifies next step: none for rows that need the full sampler
        (penalties, grammar, logprobs, min_tokens still pending), and no more than it can use (its
        max_tokens, the context)."""
        request, params = tracked.request, tracked.request.params
        if params.has_penalties or tracked.matcher is not None or params.logprobs is not None:
            return []
        if len(request.output_ids) < params.min_tokens:
            return []
        room = self.max_model_len - request.num_tokens  # positions left after the next block's anchor
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(request.output_ids) - 1)
        return [int(t) for t in drafts[: max(room, 0)]]

    @staticmethod
    def _grammar_done(tracked: _Tracked, token: int) -> bool:
        """Feeds the token to the request's grammar: True once the grammar has ended (it accepted a
        stop token; the stop checker normally ended the request on it already)."""
        if not tracked.matcher.accept(token):
            # The mask allowed the token but the matcher refuses it (a grammar engine bug): the output
            # cannot be kept on the grammar, so end it here rather than continue unconstrained.
            log.warning("request %s: grammar rejected sampled token %d; ending it", tracked.request.request_id, token)
            return True
        return tracked.matcher.terminated

    def _finish(self, tracked: _Tracked, reason: str) -> RequestOutput:
        delta = tracked.stop.finish(reason)
        tracked.completion.text += delta
        tracked.completion.finish_reason = reason
        return self._output(tracked, delta, [])

    def _output(self, tracked: _Tracked, delta: str, new_ids: list[int]) -> RequestOutput:
        request = tracked.request
        return RequestOutput(
            request.request_id, request.prompt_ids, [tracked.completion], tracked.completion.finish_reason is not None,
            delta, new_ids, request.num_cached_prompt_tokens,
        )

    def stats(self) -> dict:
        return self.metrics.snapshot(self)

    def warmup(self) -> None:
        """Compiles the step for every token bucket now, so that no request waits for a compile."""
        self.runner.warmup()


class LLM:
    """Offline generation (vLLM's `LLM`): all prompts go in at once and run as one continuous batch."""

    def __init__(self, model: str | Beam = "beam-tiny", **kwargs):
        config_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        config = EngineConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in config_fields})
        self.engine = LLMEngine(model, config=config, **kwargs)

    def generate(
        self, prompts: str | Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
