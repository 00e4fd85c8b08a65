"""Speculative decoding: verify a drafted block with the target, inside the compiled step.

One step, per row: the target ran on the block `[t0, d_1, ..., d_K]` (t0 the last emitted token, d the
drafts), giving logits `[K+1, vocab]`; the logits at block index j are the target's next-token
distribution after `t0, d_1..d_j`, so draft `d_{j+1}` (`draft_tokens[:, j]`) is checked against
position j, and position K gives the bonus token when every draft is accepted.

- Greedy rows (temperature 0): accept the longest prefix where `d_{j+1} == argmax(logits_j)`; the
  emitted token after it is the argmax at the first mismatch (or at position K): exactly the tokens
  step-by-step greedy decoding gives.
- Sampling rows: speculative sampling (Leviathan et al. 2023; Chen et al. 2023). `p_j` is the target's
  distribution after temperature, top-k, min-p and top-p (serving/sampling.py's `filter_mask`, the
  distribution `sample` draws from) and `q_j` the distribution the drafter drew `d_{j+1}` from. Draft
  x is accepted with probability `min(1, p_j(x) / q_j(x))`; at the first rejection the emitted token
  is drawn from the residual `max(p_j - q_j, 0)` (normalized); if all are accepted, the bonus is drawn
  from `p_K`. Each emitted token is then distributed exactly as `p` (for any q), so the output equals
  non-speculative sampling in distribution. Drafts proposed greedily are `q = one_hot(draft)`
  (`draft_probs=None`).

Per-row lengths: `num_draft_tokens[b]` drafts are real (the rest of the row is padding): a row with 0
drafts (a padding row, or a request not speculating this step) just samples one token from position 0.

Randomness: every draw is keyed by the request's key (`SamplingBatch.rng_key_data`) and the output
index it decides, `s = steps + j`, so results do not depend on the batch around a row:
  - the emitted (bonus / correction) token at index s: Gumbel noise from `fold_in(key, s)`, the same
    noise `sampling.sample` uses at step s, so a row without drafts gives `sample`'s token;
  - the acceptance uniform at s: `fold_in(fold_in(key, s), ACCEPT_STREAM)`;
  - the drafter's own draws (not made here) must use another stream, `DRAFT_STREAM`
    (`stream_key_data`), or they would correlate with the acceptance test.

What `verify` does not apply: penalties, min_tokens suppression and grammar masks. They depend on the
tokens accepted earlier in the block, so the caller either applies them per position to
`target_logits` (and to the drafter's q) or does not speculate for such rows.

KV of rejected drafts: the verify step wrote K/V for the whole block (positions L .. L+K of a row
whose context was L tokens, drafter layers included, as they are cache-group members), but only
`t0, d_1..d_a` (a = `num_accepted`) are context now; the emitted token is the next block's anchor.
So the caller rolls each row back with `serving.kv_cache.KVPool.truncate(seq, L + a + 1)`, which
frees the pages holding only rejected positions (every group) and leaves the rest of the kept last
page to be overwritten by the next step before anything can see it.

Memory: the sampling path holds a few `[B, K+1, vocab]` fp32 arrays (p, the residual, noise); it runs
only when some row samples (`lax.cond`), as in `sampling.sample`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32

from serving.sampling import NO_TOKEN, filter_mask

ACCEPT_STREAM = 1  # fold_in tag of the acceptance uniforms
DRAFT_STREAM = 2  # fold_in tag reserved for the drafter's draws


class SamplingRows(Protocol):
    """The per-row fields `verify` reads: a `serving.sampling.SamplingBatch` has them."""

    temperature: Float[Array, " batch"]  # 0: greedy
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]
    min_p: Float[Array, " batch"]
    rng_key_data: UInt32[Array, "batch 2"]
    steps: Int[Array, " batch"]  # tokens the request has produced so far (the index of the next one)


class VerifyOutput(NamedTuple):
    # Emitted tokens of each row: the accepted drafts, then one target token (the correction at the
    # first rejection, or the bonus), then NO_TOKEN padding. `num_accepted + 1` of them are real.
    tokens: Int[Array, "batch k1"]
    num_accepted: Int[Array, " batch"]  # drafts accepted, in [0, num_draft_tokens]


def request_keys(key_data: UInt32[Array, "batch 2"], steps: Int[Array, "batch n"], stream: int | None = None):
    """Typed threefry keys `fold_in(request key, step)` (then `fold_in(., stream)` if given),
    `[batch, n]`. One flat vmap: nested vmaps of threefry compile markedly slower on CPU."""
    batch, n = steps.shape
    base = jax.random.wrap_key_data(jnp.repeat(key_data, n, axis=0), impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(base, steps.reshape(-1))
    if stream is not None:
        keys = jax.vmap(lambda key: jax.random.fold_in(key, stream))(keys)
    return keys.reshape(batch, n)


def stream_key_data(
    rng_key_data: UInt32[Array, "batch 2"], steps: Int[Array, "batch n"], stream: int
) -> UInt32[Array, "batch n 2"]:
    """Key data of `fold_in(fold_in(request key, step), stream)` for each row and output index: the
    acceptance uniforms use `ACCEPT_STREAM`; a drafter sampling draft j should use `DRAFT_STREAM` at
    index `steps + j`."""
    return jax.random.key_data(request_keys(rng_key_data, steps, stream))


def _draw(keys, draw):
    """`draw(key)` for each key of a `[batch, n]` array of keys, flat (see `_keys`)."""
    batch, n = keys.shape
    out = jax.vmap(draw)(keys.reshape(-1))
    return out.reshape(batch, n, *out.shape[1:])


def target_probs(
    logits: Float[Array, "batch k1 vocab"], rows: SamplingRows
) -> tuple[Float[Array, "batch k1 vocab"], Float[Array, "batch k1 vocab"]]:
    """The target's sampling distribution at each block position: `(p, kept_scaled)` where
    `kept_scaled` is `logits / temperature` with the tokens top-k / min-p / top-p drop set to -inf
    (what `sampling.sample` takes its Gumbel-max over) and `p = softmax(kept_scaled)`. Greedy rows
    are scaled by 1 (their p is unused)."""
    batch, k1, vocab = logits.shape
    greedy = rows.temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, rows.temperature)[:, None, None]
    filters = ((rows.top_k > 0) & (rows.top_k < vocab)) | (rows.top_p < 1) | (rows.min_p > 0)

    def filtered():
        per_position = lambda x: jnp.repeat(x, k1)
        keep = filter_mask(
            scaled.reshape(batch * k1, vocab), per_position(rows.top_k), per_position(rows.top_p),
            per_position(rows.min_p),
        )
        return jnp.where(keep.reshape(scaled.shape), scaled, -jnp.inf)

    # The sort inside filter_mask is the expensive part: skip it when no row filters (as `sample`).
    kept = jax.lax.cond(jnp.any(filters), filtered, lambda: scaled)
    return jax.nn.softmax(kept, axis=-1), kept


def residual_distribution(
    p: Float[Array, "... vocab"], q: Float[Array, "... vocab"]
) -> Float[Array, "... vocab"]:
    """What to draw from after rejecting a draft: `max(p - q, 0)`, unnormalized (Gumbel-max over its
    log needs no normalization)."""
    return jnp.maximum(p - q, 0.0)


def draft_probs_from_logits(
    draft_logits: Float[Array, "batch k vocab"], temperature: Float[Array, " batch"]
) -> Float[Array, "batch k vocab"]:
    """q of a drafter that sampled `softmax(logits / temperature)` (-inf logits: never proposed)."""
    scale = jnp.where(temperature == 0, 1.0, temperature)[:, None, None]
    return jax.nn.softmax(draft_logits.astype(jnp.float32) / scale, axis=-1)


def _accepted_count(accept: Bool[Array, "batch k"]) -> Int[Array, " batch"]:
    """Length of the all-True prefix of each row."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def emit_tokens(
    draft_tokens: Int[Array, "batch k"], target_tokens: Int[Array, "batch k1"], num_accepted: Int[Array, " batch"]
) -> Int[Array, "batch k1"]:
    """Accepted drafts, then the target's token at index `num_accepted`, then padding."""
    index = jnp.arange(target_tokens.shape[1])[None, :]
    accepted = num_accepted[:, None]
    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
    tokens = jnp.where(index < accepted, drafts, jnp.take_along_axis(target_tokens, accepted, axis=1))
    return jnp.where(index <= accepted, tokens, NO_TOKEN).astype(jnp.int32)


def _verify_greedy(logits, draft_tokens, valid):
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # ties to the lowest id, as `sample`
    num_accepted = _accepted_count(valid & (draft_tokens == best[:, :-1]))
    return best, num_accepted


def _verify_sampled(logits, draft_tokens, valid, rows, draft_probs):
    _, k1, vocab = logits.shape
    p, kept = target_probs(logits, rows)
    q = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.float32) if draft_probs is None else draft_probs
    q = q.astype(jnp.float32)
    p_draft = jnp.take_along_axis(p[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]

    steps = rows.steps[:, None] + jnp.arange(k1)[None, :]
    uniform = _draw(request_keys(rows.rng_key_data, steps[:, :-1], ACCEPT_STREAM), lambda key: jax.random.uniform(key))
    # u < p/q without dividing: q(x) = 0 < p(x) accepts, p(x) = 0 always rejects.
    num_accepted = _accepted_count(valid & (uniform * q_draft < p_draft))

    noise = _draw(request_keys(rows.rng_key_data, steps), lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))
    residual = residual_distribution(p[:, :-1], q)
    # A residual with no mass (p == q up to rounding) cannot be reached by a real rejection: use p.
    residual_log = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, jnp.log(residual), kept[:, :-1])
    # At a rejection (index < drafts of the row) the residual; at the bonus position p itself, drawn
    # exactly as `sample` draws (Gumbel-max over the kept scaled logits with step s's noise).
    scores = jnp.concatenate([jnp.where(valid[..., None], residual_log, kept[:, :-1]), kept[:, -1:]], axis=1)
    return jnp.argmax(scores + noise, axis=-1).astype(jnp.int32), num_accepted


def verify(
    target_logits: Float[Array, "batch k1 vocab"],
    draft_tokens: Int[Array, "batch k"],
    rows: SamplingRows,
    *,
    draft_probs: Float[Array, "batch k vocab"] | None = None,
    num_draft_tokens: Int[Array, " batch"] | None = None,
) -> VerifyOutput:
    """Accept or reject each row's drafts (see the module docstring). `draft_probs` is q, the
    distribution each draft was drawn from (rows of it need only be right for sampling rows; None:
    drafts were chosen deterministically). `num_draft_tokens` (default K for every row) marks the
    real drafts; entries past it are ignored. Pure and jittable; the program depends on shapes only."""
    batch, k1, _ = target_logits.shape
    if draft_tokens.shape != (batch, k1 - 1):
        raise ValueError(f"draft_tokens {draft_tokens.shape} do not match target logits {target_logits.shape}")
    logits = target_logits.astype(jnp.float32)
    draft_tokens = draft_tokens.astype(jnp.int32)
    if num_draft_tokens is None:
        num_draft_tokens = jnp.full((batch,), k1 - 1, jnp.int32)
    valid = jnp.arange(k1 - 1)[None, :] < num_draft_tokens[:, None]
    # Padding drafts (possibly -1) index nothing.
    draft_tokens = jnp.where(valid, draft_tokens, 0)

    greedy_final, greedy_accepted = _verify_greedy(logits, draft_tokens, valid)
    greedy = rows.temperature == 0

    def mixed():
        final, accepted = _verify_sampled(logits, draft_tokens, valid, rows, draft_probs)
        return (jnp.where(greedy[:, None], greedy_final, final), jnp.where(greedy, greedy_accepted, accepted))

    final, num_accepted = jax.lax.cond(jnp.all(greedy), lambda: (greedy_final, greedy_accepted), mixed)
    return VerifyOutput(emit_tokens(draft_tokens, final, num_accepted), num_accepted.astype(jnp.int32))
