"""Runs one scheduled step on the device: packs the step's sequences into one flat ragged batch,
calls ONE compiled program (model forward on the paged cache + sampling) and returns the tokens.

Shapes are bucketed so that steady state never recompiles: the flat token count is padded to a
power of two (at least `min_token_bucket`, at most the token budget rounded up; buckets below 16 only
for steps of decodes alone), the number of rows to
min(token bucket, max_num_seqs) (a step never has more sequences than tokens), page tables to a
fixed width (`max_model_len` / page size), and the sampling widths are pinned: 20 top logprobs
always, and one of two penalty widths (`penalty_widths`): a narrow one (16 distinct tokens: in
practice the steps without penalized requests) and one that holds any request's history (its
distinct tokens are at most the context, and the vocabulary). The wide one costs
`[rows, max_model_len]` ids and counts per step, which is why it is not used for every step. So two
programs per token bucket, both compiled by `warmup`; `compilations` counts traces (a test asserts
it stops growing after warm-up).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from beam_jax.config import BeamConfig
from beam_jax.drafter import DrafterConfig
from beam_jax.model import Params, forward
from beam_jax.paged_cache import PagedBatch, PagedKVCache
from beam_jax.sharding import attention_head_axes, constrain_cache, replicate, shard_params, sharded_cache
from serving import transfer
from serving.kv_cache import KVPool
from serving.sampling import MAX_LOGPROBS, PENALTY_WIDTH_MIN, SamplerOutput, SamplingBatch, bucket, sample
from serving.scheduler import ScheduledRequest
from serving.speculative_step import SpecInputs, SpecOutput, Speculation, speculative_step

MIN_TOKEN_BUCKET = 16  # the smallest token bucket off the GPU (`default_min_token_bucket`)


def default_min_token_bucket() -> int:
    """The smallest token bucket: 1 on a GPU, where a padded step's kernels are sized by the bucket (at
    batch 1 the bf16 experts took 95 us a layer at the 16-token bucket, the T = 1 path 25;
    benchmarks/engine/RESULTS.md), so small decode batches get their own programs; 16 elsewhere, where
    the programs' compile time counts more than their padding."""
    return 1 if jax.default_backend() == "gpu" else MIN_TOKEN_BUCKET


def _decodes_only(scheduled: Sequence[ScheduledRequest]) -> bool:
    """Whether a step holds decodes alone (one token per sequence)."""
    return all(item.num_tokens == 1 for item in scheduled)


def layer_groups(pool: KVPool, num_layers: int, num_drafter_layers: int = 0) -> tuple[int, ...]:
    """Cache group of each target layer, then of each drafter layer, from the planner's layer labels
    (`L{i}`, `D{j}`)."""
    by_label = {label: g for g, group in enumerate(pool.groups) for label in group.labels}
    labels = [f"L{i}" for i in range(num_layers)] + [f"D{j}" for j in range(num_drafter_layers)]
    return tuple(by_label[label] for label in labels)


def token_buckets(max_num_batched_tokens: int, smallest: int = MIN_TOKEN_BUCKET) -> list[int]:
    if smallest < 1 or smallest & (smallest - 1):
        raise ValueError(f"the smallest token bucket must be a power of two >= 1, got {smallest}")
    buckets = [smallest]
    while buckets[-1] < max_num_batched_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


class ModelRunner:
    def __init__(
        self,
        config: BeamConfig,
        params: Params,
        pool: KVPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        dtype=jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
        attention_kernel: bool | str | None = None,
        drafter: tuple[DrafterConfig, Params] | None = None,
        num_speculative_tokens: int | None = None,
        simulated_accept_length: float | None = None,
        min_token_bucket: int | None = None,
    ):
        """With a `mesh` (beam_jax.sharding.make_mesh), the parameters and the KV pages are split
        over it and the step runs as one SPMD program on all its devices (of every process).
        `attention_kernel`: the attention path (`ragged_paged_attention`'s `use_kernel`); None: the
        backend's default, also on a mesh whose devices each hold their own query and KV heads
        (`beam_jax.sharding.attention_head_axes`), else plain jnp.
        `drafter` (its config and parameters): every step is the speculative program
        (serving/speculative_step.py) with `num_speculative_tokens` drafts per block (default: the
        drafter's block size - 1); the pool must have the drafter's layers (`D{j}` labels).
        `min_token_bucket`: the smallest token bucket (default: `default_min_token_bucket()`)."""
        self.config = config
        self.mesh = mesh
        self.params = params if mesh is None else shard_params(params, mesh, config)
        self.pool = pool
        self.page_tokens = pool.page_tokens
        self.max_num_seqs = max_num_seqs
        self.max_pages = -(-max_model_len // pool.page_tokens)
        smallest = default_min_token_bucket() if min_token_bucket is None else min_token_bucket
        self.buckets = token_buckets(max_num_batched_tokens, smallest)
        self.smallest_mixed_bucket = min(MIN_TOKEN_BUCKET, self.buckets[-1])  # see `bucket`
        self.speculation = None if drafter is None else self._speculation(drafter[0], num_speculative_tokens, simulated_accept_length)
        self.drafter_params = None if drafter is None else drafter[1]
        if drafter is not None and mesh is not None:  # small beside the target: every device holds it whole
            self.drafter_params = jax.device_put(self.drafter_params, NamedSharding(mesh, P()))
        # The program takes the parameters as flat leaves: flattening an nnx.State (a Python pytree)
        # on every call costs host time that a list of arrays does not.
        self._param_leaves, self._param_tree = jax.tree.flatten(self.params)
        self._drafter_leaves, self._drafter_tree = jax.tree.flatten(self.drafter_params)
        self.layer_group = layer_groups(pool, config.num_hidden_layers, 0 if drafter is None else drafter[0].num_hidden_layers)
        # A penalty history holds distinct tokens of one sequence: at most max_model_len, and the vocabulary.
        widest = bucket(min(max_model_len, config.vocab_size), PENALTY_WIDTH_MIN)
        self.penalty_widths = tuple(sorted({PENALTY_WIDTH_MIN, widest}))

        # The attention path by default: the backend's (the decode kernel on GPU, plain jnp on CPU). On a
        # mesh the kernels run per device under shard_map when query and KV heads split alike; else plain jnp.
        use_kernel = attention_kernel
        if use_kernel is None and mesh is not None:
            heads_split = attention_head_axes(config.num_attention_heads, config.num_key_value_heads, mesh)
            use_kernel = None if heads_split is not None else False

        def create_cache():
            return PagedKVCache.create(
                config, pool.num_pages, pool.page_tokens, self.layer_group, dtype, use_kernel=use_kernel
            )

        self.cache = create_cache() if mesh is None else sharded_cache(create_cache, mesh, config)
        # With a decode kernel, a step of decodes only is its own program (no plain-jnp pass at all).
        self.decode_only_programs = bool(self.cache.use_kernel)
        self.compilations = 0
        # A step's inputs and outputs travel as one int32 array each way (serving/transfer.py); the
        # layout of the inputs is static, that of the outputs is recorded when the program is traced.
        self._step = jax.jit(self._packed_step, donate_argnums=(1,), static_argnames=("layout",))
        self._spec_step = jax.jit(self._packed_spec_step, donate_argnums=(2,), static_argnames=("layout",))
        self._out_layouts: dict[transfer.Layout, transfer.Layout] = {}

    def _speculation(self, drafter: DrafterConfig, num_drafts: int | None, simulated: float | None) -> Speculation:
        num_drafts = drafter.num_drafts if num_drafts is None else num_drafts
        if not 1 <= num_drafts <= drafter.num_drafts:
            raise ValueError(f"num_speculative_tokens must be in [1, {drafter.num_drafts}] (the drafter's block), got {num_drafts}")
        if simulated is not None and not 1 <= simulated <= num_drafts + 1:
            raise ValueError(f"a simulated accept length must be in [1, {num_drafts + 1}], got {simulated}")
        windows = {drafter.window(i) for i in range(drafter.num_hidden_layers)}
        # The drafter reads keys with q - k < window for queries up to anchor + K: the pages holding
        # the window before the anchor (all of the table when a layer keeps the full history).
        pages = self.max_pages if None in windows else min(self.max_pages, -(-max(windows) // self.page_tokens) + 1)
        return Speculation(drafter, num_drafts, self.config.num_hidden_layers, pages, simulated)

    def _packed_step(self, params, cache, words, layout: transfer.Layout):
        cache, out = self._step_impl(params, cache, *transfer.unpack(words, layout))
        return cache, self._pack_outputs(out, layout)

    def _packed_spec_step(self, params, drafter_params, cache, words, layout: transfer.Layout):
        cache, out = self._spec_step_impl(params, drafter_params, cache, *transfer.unpack(words, layout))
        return cache, self._pack_outputs(out, layout)

    def _pack_outputs(self, out, layout: transfer.Layout):
        words, self._out_layouts[layout] = transfer.pack_traced(out)
        return words

    def _spec_step_impl(self, params, drafter_params, cache, tokens, positions, batch, logits_at, sampling, spec_inputs):
        self.compilations += 1
        params, drafter_params = self._param_tree.unflatten(params), self._drafter_tree.unflatten(drafter_params)
        cache, out = speculative_step(
            params, drafter_params, cache, tokens, positions, batch, logits_at, sampling, spec_inputs,
            config=self.config, spec=self.speculation,
        )
        if self.mesh is not None:
            cache, out = constrain_cache(cache, self.config), replicate(out)
        return cache, out

    def _step_impl(self, params, cache, tokens, positions, batch, logits_at, sampling):
        self.compilations += 1  # runs only when jit traces: one per new shape bucket
        params = self._param_tree.unflatten(params)
        out = forward(params, tokens, positions, cache.with_batch(batch), config=self.config, logits_at=logits_at)
        cache, sampled = out.cache.with_batch(None), sample(out.logits[0], sampling)
        if self.mesh is not None:  # the cache stays split by KV head; every process reads the samples
            cache, sampled = constrain_cache(cache, self.config), replicate(sampled)
        return cache, sampled

    def bucket(self, num_tokens: int, *, decodes_only: bool = False) -> int:
        """The smallest token bucket that holds a step. Buckets below `MIN_TOKEN_BUCKET` take steps of
        decodes only, where the padding costs latency; a step that prefills a few tokens pads to 16,
        which spares compiling every small bucket twice (the mixed and the decode-only program)."""
        for size in self.buckets:
            if size >= num_tokens and (decodes_only or size >= self.smallest_mixed_bucket):
                return size
        raise ValueError(f"a step of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")

    def step_bucket(self, scheduled: Sequence[ScheduledRequest]) -> int:
        """The bucket `execute` runs `scheduled` in."""
        return self.bucket(sum(s.num_tokens for s in scheduled), decodes_only=_decodes_only(scheduled))

    def rows_for(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    def execute(
        self, scheduled: Sequence[ScheduledRequest], sampling: SamplingBatch, *, num_tokens: int | None = None,
        decode_only: bool | None = None,
    ) -> SamplerOutput | SpecOutput:
        """Runs the step; row i of the result belongs to `scheduled[i]` (rows past it are padding).
        `sampling` must have `rows_for(bucket(tokens))` rows and pinned widths (`sampling_widths`).
        `num_tokens` pads the step to at least that many tokens (warm-up). `decode_only` (default:
        whether every sequence has one token) picks the decode-only program where there is one.
        With a drafter the result is a `SpecOutput` (a speculating item's drafts are the request's
        `draft_tokens[:item.num_drafts]`, computed after its last token)."""
        total = max(sum(s.num_tokens for s in scheduled), num_tokens or 0)
        decodes_only = _decodes_only(scheduled) if decode_only is None else decode_only
        size = self.bucket(total, decodes_only=decodes_only)
        rows = self.rows_for(size)
        if len(scheduled) > rows:
            raise ValueError(f"{len(scheduled)} sequences in a step of at most {rows}")
        groups = len(self.pool.groups)
        block = 1 if self.speculation is None else self.speculation.block
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        slots = np.full((groups, size), -1, np.int32)
        query_start = np.zeros(rows + 1, np.int32)
        seq_lens = np.zeros(rows, np.int32)
        logits_at = np.zeros((rows, block), np.int32)
        draft_tokens = np.full((rows, block - 1), -1, np.int32)
        num_drafts = np.zeros(rows, np.int32)
        tables = [np.full((rows, self.max_pages), -1, np.int32) for _ in range(groups)]
        at = 0
        for row, item in enumerate(scheduled):
            request, start, count, drafts = item.request, item.start, item.num_tokens, item.num_drafts
            span = slice(at, at + count)
            known = count - drafts  # tokens of the request; the rest of the span is its drafts
            tokens[at : at + known] = request.token_span(start, start + known)
            tokens[at + known : at + count] = request.draft_tokens[:drafts]
            positions[span] = np.arange(start, start + count)
            for g in range(groups):
                table = self.pool.page_table(request.seq_id, g)
                tables[g][row, : len(table)] = table
                slots[g, span] = table[positions[span] // self.page_tokens] * self.page_tokens + (
                    positions[span] % self.page_tokens
                )
            # A speculating row's logits at t0 and each draft; any row's last index fills the rest.
            logits_at[row] = at + count - 1
            logits_at[row, : drafts + 1] = np.arange(at + known - 1, at + count)
            draft_tokens[row, :drafts] = request.draft_tokens[:drafts]
            num_drafts[row] = drafts
            at += count
            query_start[row + 1 :] = at
            seq_lens[row] = start + count
        batch = PagedBatch(
            query_start=query_start,
            seq_lens=seq_lens,
            page_tables=tuple(tables),
            slot_mappings=tuple(slots),
            decode_only=self.decode_only_programs and decodes_only,
        )
        # Host arrays stay numpy: `call_step` packs them into one array, moved in one transfer.
        flat = tokens[None], positions[None], batch
        if self.speculation is None:
            return self.call_step((*flat, logits_at[:, 0].copy(), sampling))
        return self.call_step((*flat, logits_at, sampling, SpecInputs(draft_tokens, num_drafts)))

    def call_step(self, inputs: tuple):
        """The one compiled call of a step: `inputs` are the program's arguments after the
        parameters and the cache (a pytree of host arrays; static flags in its structure). Returns
        the outputs as numpy arrays. Every compiled call goes through here, so that on several
        processes rank 0 can hand the same inputs to the others (serving/multihost.py replaces this
        on rank 0 and calls it on the rest)."""
        words, layout = transfer.pack(inputs)
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            if self.speculation is None:
                self.cache, out = self._step(self._param_leaves, self.cache, words, layout=layout)
            else:
                self.cache, out = self._spec_step(self._param_leaves, self._drafter_leaves, self.cache, words,
                                                  layout=layout)
        out.copy_to_host_async()  # queued behind the step on the device, not when the host asks for it
        return transfer.unpack_host(np.asarray(out), self._out_layouts[layout])

    def warmup(self) -> None:
        """Compiles every token bucket at every penalty width (and, with a decode kernel, as a mixed
        and a decode-only step; the buckets below 16 take decode-only steps alone) with an all-padding
        step (nothing is written to the cache)."""
        for size in self.buckets:
            kinds = (False, True) if self.decode_only_programs else (False,)
            if size < self.smallest_mixed_bucket:
                kinds = (True,)
            for width in self.penalty_widths:
                for decode_only in kinds:
                    empty = SamplingBatch.build(
                        [],
                        request_ids=[],
                        num_output_tokens=[],
                        vocab_size=self.config.vocab_size,
                        pad_to=self.rows_for(size),
                        **self.sampling_widths(width),
                    )
                    self.execute([], empty, num_tokens=size, decode_only=decode_only)

    def sampling_widths(self, penalty_history: int = 0) -> dict:
        """The pinned widths (`SamplingBatch.build` kwargs) of a step whose longest penalty history
        has `penalty_history` distinct tokens: the narrowest penalty width that holds it."""
        for width in self.penalty_widths:
            if penalty_history <= width:
                return {"penalty_width": width, "num_top_logprobs": MAX_LOGPROBS}
        raise ValueError(f"a penalty history of {penalty_history} tokens exceeds the widest {self.penalty_widths[-1]}")
