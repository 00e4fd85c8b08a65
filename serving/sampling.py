"""Sampling inside the compiled step: one program for a batch of rows, each row a request with its
own parameters (greedy and random rows mixed), plus the host-side pieces around it.

Per step, on the device (`sample`), for logits `[B, vocab]`:
  1. penalties (repetition over prompt+output tokens, presence/frequency over output tokens), as
     vLLM applies them: repetition first (divide a positive logit, multiply a negative one), then
     `logit -= frequency * count + presence * (count > 0)`;
  2. token mask: -inf on the tokens the row's packed bitmask disallows (`token_bitmask`, int32
     `[B, ceil(vocab / 32)]`, bit t % 32 of word t // 32 for token t; all ones for unconstrained rows,
     so the shape never changes). The host fills it from the request's grammar matcher
     (serving/grammar.py) and clears the bits of suppressed ids: rows that have not yet produced
     `min_tokens` tokens may not end, so eos and their stop token ids are masked (not in grammar
     rows: their grammar decides when they may end);
  3. logprobs: `log_softmax` of these logits (the model's distribution after penalties, before
     temperature / top-k / top-p / min-p, as vLLM reports by default): what the model thinks, not
     what the sampler's truncated distribution happened to be (a grammar is part of the model's
     distribution here, as in vLLM, so a logprob is never -inf for a token the grammar allowed);
  4. greedy rows (temperature 0): `argmax`, ties to the lowest id;
     random rows: logits / temperature, then top-k, min-p (both relative to the best token, so
     they commute), then top-p over the distribution renormalized to what top-k and min-p kept
     (vLLM's order), then a Gumbel-max draw, which samples exactly from the kept distribution.

Reproducibility: each row's noise comes from its own key, `fold_in(request key, step)` where step is
the number of tokens the request has produced so far. The request key is the user's seed (or, without
one, a hash of the request id), so the same seed and prompt give the same output whatever else is in
the batch and wherever the row sits; threefry is counter-based, so a row's noise depends on its key only.

Static shapes: everything is `[B]` or `[B, width]`; the one width that depends on the requests, the
penalty width S, is a power-of-two bucket of what the rows need (or pinned by the runner: a narrow
width and one that holds any history, both compiled at warm-up), so steady state compiles one
program per batch bucket and penalty width. Penalty state is sparse: per row the distinct tokens
seen (prompt and output) with their output counts, `[B, S]`, not a dense `[B, vocab]` count array:
at vocab 152K and 256 rows a dense int32 array is 155 MB to build and copy every step, while S
(distinct tokens in the history) is usually thousands, and rows without penalties are all padding.
The step gathers those S logits, penalizes them and scatters them back. min_tokens needs no width of
its own: its ids are cleared in the token mask, which always has the vocabulary's width.

On the host: `SamplingParams` (the user's request), `TokenHistory` (incremental penalty state of one
request), `SamplingBatch.build` (numpy, O(batch + distinct tokens of penalized rows)), and
`StopChecker` (stop strings across token boundaries, stop ids, eos, max/min tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from serving.grammar import Grammar

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit)
GREEDY_EPSILON = 1e-5  # temperatures below this are greedy (as vLLM): dividing by them only overflows
PENALTY_WIDTH_MIN = 16  # smallest bucket of the [B, S] penalty arrays
# Limits that keep the float32 sampling step finite (the one place for them: the HTTP layer's request
# models use these too). A repetition penalty divides or multiplies logits: a tiny one (subnormal in
# float32) overflows them to inf and makes NaNs. A top_p below MIN_TOP_P keeps only the most likely
# token, as MIN_TOP_P does (its probability is at least 1 / vocabulary size), so it is raised to it;
# smaller ones round to 0 in float32 and would keep no token at all.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MIN_TOP_P = 1e-8
FLOAT32_MAX = float(np.finfo(np.float32).max)  # a temperature above this is inf in the step
NO_TOKEN = -1  # padding in the id arrays
_MASK64 = (1 << 64) - 1


# ---- user parameters ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples (vLLM's fields and semantics, without `n`). Defaults turn every
    feature off except temperature 1."""

    temperature: float = 1.0  # 0 (or < 1e-5): greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # in (0, 1]; 1: off; values below MIN_TOP_P are raised to it
    min_p: float = 0.0  # in [0, 1]; 0: off
    repetition_penalty: float = 1.0  # in [0.01, 100]; 1: off; over prompt and output tokens
    presence_penalty: float = 0.0  # in [-2, 2]; over output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; over output tokens
    seed: int | None = None
    max_tokens: int | None = None  # None: until eos / stop / the context limit (the engine's)
    min_tokens: int = 0  # eos and stop token ids are suppressed, stop strings unchecked, below this
    stop: tuple[str, ...] = ()  # a str or list is accepted and stored as a tuple
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k (k <= 20)
    grammar: Grammar | None = None  # constrained decoding (serving/grammar.py); ends when it completes

    def __post_init__(self):
        # Normalize sequences to tuples (the dataclass is frozen, hence object.__setattr__).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

        def fail(field: str, why: str):
            raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        def is_int(x) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_real(x) -> bool:
            return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_real(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            fail("temperature", "must be a finite number >= 0 (and finite in float32)")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be an int >= 1, or 0 / -1 for off")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        object.__setattr__(self, "top_p", max(self.top_p, MIN_TOP_P))
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not is_real(self.repetition_penalty) or not (
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            fail("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]")
        for field in ("presence_penalty", "frequency_penalty"):
            if not is_real(getattr(self, field)) or not -2 <= getattr(self, field) <= 2:
                fail(field, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an int or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an int >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be ints >= 0")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "must be a bool")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            fail("grammar", "must be a serving.grammar.Grammar or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


# ---- per-request host state -----------------------------------------------------------------------
class TokenHistory:
    """The tokens penalties look at, for one request: every distinct token of prompt and output with
    its count in the output (0 for prompt-only tokens). Kept incrementally in a dict, so the prompt is
    scanned once and a batch row costs O(distinct tokens), not O(context), per step."""

    def __init__(self, prompt_token_ids: Iterable[int] = ()):
        prompt = np.unique(np.fromiter(prompt_token_ids, np.int64))
        self.output_counts: dict[int, int] = dict.fromkeys(prompt.tolist(), 0)

    def append(self, token_ids: int | Iterable[int]) -> None:
        for token in [token_ids] if isinstance(token_ids, (int, np.integer)) else token_ids:
            token = int(token)
            self.output_counts[token] = self.output_counts.get(token, 0) + 1

    def __len__(self) -> int:
        return len(self.output_counts)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct token ids, their output counts), int32, in insertion order."""
        n = len(self.output_counts)
        return (np.fromiter(self.output_counts.keys(), np.int32, n),
                np.fromiter(self.output_counts.values(), np.int32, n))


def request_key_data(seed: int | None, request_id: int) -> np.ndarray:
    """uint32 [2] threefry key data of a request. A seed maps as `jax.random.PRNGKey(seed)` does
    (high and low 32 bits); without one, a splitmix64 hash of the request id, so unseeded requests
    get unrelated streams rather than neighbouring counters."""
    if seed is not None:
        value = int(seed) & _MASK64
    else:
        value = (int(request_id) + 0x9E3779B97F4A7C15) & _MASK64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
        value ^= value >> 31
    return np.array([value >> 32, value & 0xFFFFFFFF], dtype=np.uint32)


def bucket(n: int, minimum: int) -> int:
    """The power-of-two width bucket (at least `minimum`) holding n."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


# ---- packed token masks (xgrammar's layout) -------------------------------------------------------
def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def full_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """int32 [batch, words], every token allowed."""
    return np.full((batch, bitmask_words(vocab_size)), -1, np.int32)


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """bool [batch, vocab] -> int32 [batch, ceil(vocab / 32)]: bit t % 32 of word t // 32 is token t."""
    batch, vocab = allowed.shape
    padded = np.zeros((batch, bitmask_words(vocab) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def clear_bits(bitmask: np.ndarray, row_tokens: Sequence[tuple[int, int]]) -> None:
    """Disallows token t in row r for each (r, t), in place."""
    rows, tokens = np.asarray(row_tokens, np.int64).reshape(-1, 2).T
    words = bitmask.view(np.uint32)  # bit 31 as an unsigned mask
    np.bitwise_and.at(words, (rows, tokens // 32), ~(np.uint32(1) << (tokens % 32).astype(np.uint32)))


def unpack_bitmask(bitmask: Int[Array, "batch words"], vocab_size: int) -> Bool[Array, "batch vocab"]:
    """The inverse of `pack_bitmask`, in jnp (inside the compiled step)."""
    words = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


# ---- the device batch -----------------------------------------------------------------------------
@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=(
        "temperature", "top_k", "top_p", "min_p",
        "repetition_penalty", "presence_penalty", "frequency_penalty",
        "rng_key_data", "steps",
        "penalty_token_ids", "penalty_output_counts", "token_bitmask", "wants_top_logprobs",
    ),
    meta_fields=("num_top_logprobs",),
)
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step. Padding rows are greedy with nothing to penalize."""

    temperature: Float[Array, " batch"]  # 0: greedy
    top_k: Int[Array, " batch"]  # 0: off
    top_p: Float[Array, " batch"]
    min_p: Float[Array, " batch"]
    repetition_penalty: Float[Array, " batch"]
    presence_penalty: Float[Array, " batch"]
    frequency_penalty: Float[Array, " batch"]
    rng_key_data: UInt32[Array, "batch 2"]  # threefry key data of each request (`request_key_data`)
    steps: Int[Array, " batch"]  # tokens the request has produced so far: folded into its key
    penalty_token_ids: Int[Array, "batch penalty_width"]  # distinct seen tokens; -1 pads
    penalty_output_counts: Int[Array, "batch penalty_width"]  # their counts in the output
    token_bitmask: Int[Array, "batch words"]  # packed allowed tokens (`pack_bitmask`); -1 words: all
    wants_top_logprobs: Bool[Array, " batch"]  # rows that asked for top logprobs (`logprobs` >= 1)
    num_top_logprobs: int = MAX_LOGPROBS  # static: width of the top-logprobs output

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        request_ids: Sequence[int],
        num_output_tokens: Sequence[int],
        histories: Sequence[TokenHistory | None] | None = None,
        vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        pad_to: int | None = None,
        penalty_width: int | None = None,
        num_top_logprobs: int = MAX_LOGPROBS,
        token_bitmask: np.ndarray | None = None,
    ) -> SamplingBatch:
        """The batch for rows `params[i]` (request `request_ids[i]`, which has produced
        `num_output_tokens[i]` tokens; `histories[i]` is required where the row has penalties),
        padded to `pad_to` rows. The penalty width defaults to the power-of-two bucket of what the
        rows need; pass a fixed one to pin the compiled shape. `token_bitmask` (int32
        [pad_to, ceil(vocab / 32)], filled by the grammar matchers; default: all allowed; not
        modified: min_tokens suppression clears bits in a copy). Arrays are numpy; jit moves them to
        the device."""
        rows = len(params)
        batch = rows if pad_to is None else pad_to
        if not len(request_ids) == len(num_output_tokens) == rows:
            raise ValueError(f"{rows} params but {len(request_ids)} request ids and {len(num_output_tokens)} counts")
        if batch < rows:
            raise ValueError(f"pad_to={pad_to} is smaller than the {rows} rows")
        if histories is None:
            histories = [None] * rows
        eos = tuple(int(t) for t in eos_token_ids)
        for t in (*eos, *(t for p in params for t in p.stop_token_ids)):
            if not 0 <= t < vocab_size:
                raise ValueError(f"token id {t} is outside the vocabulary of {vocab_size}")
        if not 0 <= num_top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"num_top_logprobs must be in [0, {MAX_LOGPROBS}], got {num_top_logprobs}")
        if any(p.logprobs is not None and p.logprobs > num_top_logprobs for p in params):
            raise ValueError(f"a row asks for more than num_top_logprobs={num_top_logprobs} top logprobs")

        def column(dtype, fill, values):
            out = np.full(batch, fill, dtype)
            out[:rows] = values
            return out

        greedy = [p.greedy for p in params]
        # Greedy rows get neutral filters too, so that `sample` can skip the sort when no row filters.
        temperature = column(np.float32, 0.0, [0.0 if g else p.temperature for p, g in zip(params, greedy)])
        top_k = column(np.int32, 0, [0 if g else min(max(p.top_k, 0), vocab_size) for p, g in zip(params, greedy)])
        top_p = column(np.float32, 1.0, [1.0 if g else p.top_p for p, g in zip(params, greedy)])
        min_p = column(np.float32, 0.0, [0.0 if g else p.min_p for p, g in zip(params, greedy)])

        # Penalty rows: distinct seen tokens. Without a repetition penalty prompt-only tokens
        # (count 0) change nothing, but are kept: simpler than a second dict, and harmless.
        penalty_rows = {}
        for i, p in enumerate(params):
            if p.has_penalties:
                if histories[i] is None:
                    raise ValueError(f"row {i} has penalties but no TokenHistory")
                penalty_rows[i] = histories[i].arrays()
        needed = max((len(ids) for ids, _ in penalty_rows.values()), default=0)
        penalty_width = bucket(needed, PENALTY_WIDTH_MIN) if penalty_width is None else penalty_width
        if needed > penalty_width:
            raise ValueError(f"penalty_width={penalty_width} is narrower than a history of {needed} distinct tokens")
        penalty_token_ids = np.full((batch, penalty_width), NO_TOKEN, np.int32)
        penalty_output_counts = np.zeros((batch, penalty_width), np.int32)
        for i, (ids, counts) in penalty_rows.items():
            penalty_token_ids[i, : len(ids)] = ids
            penalty_output_counts[i, : len(ids)] = counts

        # min_tokens: the token about to be sampled may not end the request (vLLM's rule). Not for
        # grammar rows: a complete grammar allows only stop tokens, and suppressing them leaves nothing.
        suppressed = [
            (() if p.ignore_eos else eos) + p.stop_token_ids if n < p.min_tokens and p.grammar is None else ()
            for p, n in zip(params, num_output_tokens)
        ]
        if token_bitmask is None:
            token_bitmask = full_bitmask(batch, vocab_size)
        elif token_bitmask.shape != (batch, bitmask_words(vocab_size)) or token_bitmask.dtype != np.int32:
            raise ValueError(f"token_bitmask must be int32 [{batch}, {bitmask_words(vocab_size)}], got "
                             f"{token_bitmask.dtype} {token_bitmask.shape}")
        elif any(suppressed):
            token_bitmask = token_bitmask.copy()  # the caller's stays as it was
        if any(suppressed):
            clear_bits(token_bitmask, [(row, t) for row, ids in enumerate(suppressed) for t in ids])

        rng_key_data = np.zeros((batch, 2), np.uint32)
        for i, (p, request_id) in enumerate(zip(params, request_ids)):
            rng_key_data[i] = request_key_data(p.seed, request_id)

        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=column(np.float32, 1.0, [p.repetition_penalty for p in params]),
            presence_penalty=column(np.float32, 0.0, [p.presence_penalty for p in params]),
            frequency_penalty=column(np.float32, 0.0, [p.frequency_penalty for p in params]),
            rng_key_data=rng_key_data,
            steps=column(np.int32, 0, num_output_tokens),
            penalty_token_ids=penalty_token_ids,
            penalty_output_counts=penalty_output_counts,
            token_bitmask=token_bitmask,
            wants_top_logprobs=column(bool, False, [bool(p.logprobs) for p in params]),
            num_top_logprobs=num_top_logprobs,
        )


# ---- the device side ------------------------------------------------------------------------------
class SamplerOutput(NamedTuple):
    tokens: Int[Array, " batch"]
    logprobs: Float[Array, " batch"]  # of the chosen token, in the model's (penalized) distribution
    # k = min(num_top_logprobs, vocab), best first (ties: lower id first). Computed for every row when
    # a row asked (`wants_top_logprobs`), else left out: ids -1, logprobs -inf.
    top_token_ids: Int[Array, "batch k"]
    top_logprobs: Float[Array, "batch k"]


def _scatter_ids(ids: Int[Array, "batch width"], vocab: int) -> Int[Array, "batch width"]:
    """Padding (-1) sent out of range, so that `mode="drop"` scatters skip it (-1 would wrap)."""
    return jnp.where(ids >= 0, ids, vocab)


def apply_penalties(logits: Float[Array, "batch vocab"], batch: SamplingBatch) -> Float[Array, "batch vocab"]:
    """Repetition, then frequency and presence penalties, on the seen tokens only (gather, penalize,
    scatter). The ids of a row are distinct, so the scatter has no conflicting writes."""
    vocab = logits.shape[-1]
    ids = batch.penalty_token_ids
    seen = jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=1)
    repetition = batch.repetition_penalty[:, None]
    seen = jnp.where(seen > 0, seen / repetition, seen * repetition)
    counts = batch.penalty_output_counts
    seen = seen - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, _scatter_ids(ids, vocab)].set(seen, mode="drop")


def filter_mask(
    scaled: Float[Array, "batch vocab"],
    top_k: Int[Array, " batch"],
    top_p: Float[Array, " batch"],
    min_p: Float[Array, " batch"],
) -> Bool[Array, "batch vocab"]:
    """Which tokens survive top-k, min-p and top-p, given temperature-scaled logits. Each filter keeps
    a prefix of the tokens sorted best first (ties: lower id first), so one sort serves all three.
    Top-p keeps the minimal prefix whose mass reaches top_p (a token stays if the mass before it is
    < top_p), over the distribution renormalized to what top-k and min-p kept."""
    batch, vocab = scaled.shape
    rank = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    neg_sorted, order = jax.lax.sort((-scaled, rank), dimension=1, num_keys=1, is_stable=True)
    sorted_logits = -neg_sorted
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    keep = rank < k[:, None]
    # p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p): no softmax needed (log 0 = -inf keeps all).
    keep &= sorted_logits - sorted_logits[:, :1] >= jnp.log(min_p)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p = 1 is off outright: rounding could push the mass before a tail token to 1.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    rows = jnp.arange(batch)[:, None]
    return jnp.zeros(scaled.shape, bool).at[rows, order].set(keep)


def _gumbel_noise(batch: SamplingBatch, vocab: int) -> Float[Array, "batch vocab"]:
    def row(key_data, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    return jax.vmap(row)(batch.rng_key_data, batch.steps)


def _random_tokens(logits: Float[Array, "batch vocab"], batch: SamplingBatch) -> Int[Array, " batch"]:
    greedy = batch.temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, batch.temperature)[:, None]
    vocab = logits.shape[-1]
    filters = ((batch.top_k > 0) & (batch.top_k < vocab)) | (batch.top_p < 1) | (batch.min_p > 0)
    # The sort is the expensive part: skip it at run time when no row filters.
    keep = jax.lax.cond(
        jnp.any(filters),
        lambda: filter_mask(scaled, batch.top_k, batch.top_p, batch.min_p),
        lambda: jnp.ones(scaled.shape, bool),
    )
    # Gumbel-max: argmax(l/T + G) is an exact draw from softmax(l/T) restricted to `keep`.
    return jnp.argmax(jnp.where(keep, scaled + _gumbel_noise(batch, vocab), -jnp.inf), axis=-1).astype(jnp.int32)


def sample(logits: Float[Array, "batch vocab"], batch: SamplingBatch) -> SamplerOutput:
    """One token per row (see the module docstring for the order of operations). Pure and jittable;
    the program depends only on the shapes and `batch.num_top_logprobs`."""
    if logits.shape[0] != batch.batch_size:
        raise ValueError(f"logits have {logits.shape[0]} rows but the sampling batch {batch.batch_size}")
    logits = logits.astype(jnp.float32)
    logits = apply_penalties(logits, batch)
    logits = jnp.where(unpack_bitmask(batch.token_bitmask, logits.shape[-1]), logits, -jnp.inf)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = batch.temperature == 0
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # first maximum: ties to the lowest id
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: greedy_tokens,
        lambda: jnp.where(greedy, greedy_tokens, _random_tokens(logits, batch)),
    )
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    k = min(batch.num_top_logprobs, logits.shape[-1])
    # XLA's top-k over the vocabulary is a sort (86 us a step for 8 rows of 152K on the H200,
    # benchmarks/engine/RESULTS.md): only when a row asked.
    top_logprobs, top_token_ids = jax.lax.cond(
        jnp.any(batch.wants_top_logprobs),
        lambda: tuple(jax.lax.top_k(logprobs, k)),
        lambda: (jnp.full((logits.shape[0], k), -jnp.inf), jnp.full((logits.shape[0], k), -1, jnp.int32)),
    )
    return SamplerOutput(tokens, chosen, top_token_ids.astype(jnp.int32), top_logprobs)


# ---- stopping (host) ------------------------------------------------------------------------------
def find_stop_string(text: str, new_start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends in the new part `text[new_start:]` (so spans over
    token boundaries are found, and older text is not searched again): (its index, the string)."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, new_start - len(stop) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string: text a stream
    must hold back, since the next token may complete the stop string."""
    longest = max(map(len, stops), default=1) - 1
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(len(stop) > n and stop.startswith(tail) for stop in stops):
            return n
    return 0


class StopChecker:
    """Decides when one request is done and what text is safe to stream. Feed it every sampled token
    with its newly detokenized text (possibly "", e.g. mid UTF-8 character); `append` returns the
    text delta to send. On a stop string the text is cut before it (excluded, as OpenAI); eos and stop
    token ids end it without adding their text. `finish_reason` is then "stop" (with `stop_reason`
    the string or token id matched, None for eos) or "length" (max_tokens). Below `min_tokens`
    nothing stops it but max_tokens (vLLM's rule; the sampler already suppresses eos and stop ids).
    When the engine ends a request itself (context limit, abort), `finish` releases the held text."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()):
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.text = ""  # the output text, cut at the stop string once one matched
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._emitted = 0  # characters of `text` already returned

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str) -> str:
        """End the request for a reason outside the checker (the context limit: "length"; an abort);
        returns the held-back text, now safe to send."""
        if self.finished:
            raise RuntimeError(f"the request already finished ({self.finish_reason})")
        self.finish_reason = reason
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def append(self, token_id: int, new_text: str) -> str:
        if self.finished:
            raise RuntimeError(f"the request already finished ({self.finish_reason})")
        self.num_tokens += 1
        can_stop = self.num_tokens >= self.params.min_tokens
        token_id = int(token_id)
        if can_stop and (token_id in self.stop_token_ids or token_id in self.eos_token_ids):
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in self.stop_token_ids else None
        else:
            start = len(self.text)
            self.text += new_text
            match = find_stop_string(self.text, start, self.params.stop) if can_stop else None
            if match is not None:
                self.text = self.text[: match[0]]
                self.finish_reason, self.stop_reason = "stop", match[1]
            elif self.params.max_tokens is not None and self.num_tokens >= self.params.max_tokens:
                self.finish_reason = "length"
        # Hold back a possible start of a stop string (also below min_tokens, so that a stop string
        # completed later never starts inside text already sent); flush everything once finished.
        end = len(self.text) if self.finished else len(self.text) - partial_stop_length(self.text, self.params.stop)
        delta = self.text[self._emitted : max(end, self._emitted)]
        self._emitted = max(end, self._emitted)
        return delta
