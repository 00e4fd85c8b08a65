"""The engine's speculative step: verify the previous block, extend the drafter's context, propose
the next block, all in ONE compiled program (the runner calls it instead of the plain step).

Per row of the ragged batch (serving/runner.py packs it):
  - a speculating decode row computes `[t0, d_1..d_n]` at positions `L..L+n` (t0 the last emitted
    token, d the drafts proposed by the previous step, n <= K = `Speculation.num_drafts`);
  - any other row (a prefill chunk, a decode without drafts) computes its tokens as in a plain step.
The target runs once over all of them (its K/V written to the pages), also returning its residual
stream after the drafter's `target_layer_ids`. Then:
  1. verify (serving/speculative.py): speculating rows accept a prefix of their drafts and emit one
     target token; the other rows sample their last position with `sampling.sample` (penalties,
     grammar masks and logprobs apply there: rows that need them never speculate);
  2. the drafter's context K/V of every computed token goes into the drafter layers' pages (they are
     cache-group members of the same pool): rejected positions are written too, but the caller
     truncates the sequence after them and the drafter never reads at or past its anchor;
  3. each row's emitted last token is the anchor of a new block at position `P = L + a + 1` (a
     accepted), and the drafter proposes K drafts after it from the paged context.

Drafts are proposed greedily (the drafter's argmax, or the selector's best walk), also for sampling
rows: verify then takes q = one_hot(draft), which keeps sampling exact (any q does).

Simulated acceptance (`Speculation.simulated_accept_length`, for throughput benchmarks at a fixed
accept length, as the SGLang report does): each speculating row accepts `m - 1` drafts on average
(m the set accept length; a per-row draw between floor and ceil keeps the mean) regardless of what the
target says, and emits the target's greedy token after them. The text is then NOT the target's:
the engine labels such runs, and the acceptance metrics report the simulated figure as such.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from beam_jax import drafter as D
from beam_jax.config import BeamConfig
from beam_jax.memory_plan import DrafterSpec
from beam_jax.model import Params, flat_params, forward
from beam_jax.paged_cache import PagedBatch, PagedKVCache
from serving.sampling import NO_TOKEN, SamplerOutput, SamplingBatch, sample
from serving.speculative import emit_tokens, request_keys, verify

SIMULATE_STREAM = 3  # fold_in tag of the simulated-acceptance draws


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Static settings of the speculative program (hashable: part of the jit key)."""

    drafter: D.DrafterConfig
    num_drafts: int  # K: drafts per block (<= the drafter's block size - 1)
    first_layer: int  # the cache layer index of drafter layer 0 (the target's layer count)
    context_pages: int  # pages of context the drafter reads per row (its window, or the whole table)
    simulated_accept_length: float | None = None

    @property
    def block(self) -> int:
        return self.num_drafts + 1


class SpecInputs(NamedTuple):
    draft_tokens: Int[Array, "rows k"]  # the drafts being verified (-1 padding)
    num_drafts: Int[Array, " rows"]  # real drafts per row (0: the row does not speculate this step)


class SpecOutput(NamedTuple):
    tokens: Int[Array, "rows k1"]  # emitted: accepted drafts then one target token, NO_TOKEN padding
    num_accepted: Int[Array, " rows"]
    logprobs: Float[Array, "rows k1"]  # of each emitted token under the target (raw logits)
    sampled: SamplerOutput  # the plain sample at each row's last logit (what non-speculating rows emit)
    drafts: Int[Array, "rows k"]  # the next block's drafts, after each row's last emitted token


def target_embedding_and_head(params: Params, config: BeamConfig) -> tuple[jax.Array, jax.Array]:
    """The target's embedding and lm_head weights (the embedding twice when tied): the drafter's."""
    flat = flat_params(params)
    embed = flat["model.embed_tokens.weight"]
    return embed, embed if config.tie_word_embeddings else flat["lm_head.weight"]


def _simulated_accepts(spec: Speculation, sampling: SamplingBatch, num_drafts) -> Int[Array, " rows"]:
    """floor or ceil of `m - 1` per row (Bernoulli on the fraction, keyed by request and step)."""
    target = spec.simulated_accept_length - 1.0
    base = jnp.floor(target)
    keys = request_keys(sampling.rng_key_data, sampling.steps[:, None], SIMULATE_STREAM)[:, 0]
    uniform = jax.vmap(jax.random.uniform)(keys)
    return jnp.minimum((base + (uniform < target - base)).astype(jnp.int32), num_drafts)


def _verify_rows(logits, spec_inputs: SpecInputs, sampling: SamplingBatch, spec: Speculation):
    """Emitted tokens and accepted counts of every row: verify for speculating rows, `sample`'s token
    for the rest."""
    sampled = sample(logits[:, 0], sampling)
    draft_tokens, num_drafts = spec_inputs.draft_tokens, spec_inputs.num_drafts
    if spec.simulated_accept_length is None:
        verified = verify(logits, draft_tokens, sampling, num_draft_tokens=num_drafts)
        tokens, accepted = verified.tokens, verified.num_accepted
    else:
        accepted = _simulated_accepts(spec, sampling, num_drafts)
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens = emit_tokens(jnp.where(draft_tokens >= 0, draft_tokens, 0), greedy, accepted)
    speculating = num_drafts > 0
    plain = jnp.full(tokens.shape, NO_TOKEN, jnp.int32).at[:, 0].set(sampled.tokens)
    tokens = jnp.where(speculating[:, None], tokens, plain)
    accepted = jnp.where(speculating, accepted, 0)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), jnp.maximum(tokens, 0)[..., None], axis=-1)
    logprobs = jnp.where(speculating[:, None], logprobs[..., 0], sampled.logprobs[:, None])
    return tokens, accepted, logprobs, sampled


def _drafter_context(cache: PagedKVCache, spec: Speculation, anchor_positions) -> D.DraftContext:
    """Every drafter layer's paged context before each row's anchor, contiguous (one gather)."""
    layers = [
        cache.window_context(spec.first_layer + i, anchor_positions, spec.context_pages)
        for i in range(spec.drafter.num_hidden_layers)
    ]
    return D.DraftContext(
        jnp.stack([k for k, _, _ in layers]), jnp.stack([v for _, v, _ in layers]), layers[0][2]
    )


def speculative_step(
    params: Params,
    drafter_params: Params,
    cache: PagedKVCache,
    tokens: Int[Array, "1 t"],
    positions: Int[Array, "1 t"],
    batch: PagedBatch,
    logits_at: Int[Array, "rows k1"],
    sampling: SamplingBatch,
    spec_inputs: SpecInputs,
    *,
    config: BeamConfig,
    spec: Speculation,
) -> tuple[PagedKVCache, SpecOutput]:
    """See the module docstring. `logits_at[r, j]`: the flat index of row r's block position j (for a
    speculating row `t0, d_1..d_n`, then its last index repeated; for any other row its last token's
    index everywhere, so that position 0 is the token it samples)."""
    rows, k1 = logits_at.shape
    drafter = spec.drafter
    out = forward(
        params, tokens, positions, cache.with_batch(batch), config=config, logits_at=logits_at.reshape(-1),
        hidden_layers=drafter.target_layer_ids,
    )
    logits = out.logits[0].reshape(rows, k1, -1).astype(jnp.float32)
    emitted, accepted, logprobs, sampled = _verify_rows(logits, spec_inputs, sampling, spec)

    # 2. the drafter's context K/V of this step's tokens, into its layers' pages
    cache = out.cache
    context = D.context_kv(drafter_params, jnp.concatenate(out.hidden_states, -1), positions, config=drafter)
    for i in range(drafter.num_hidden_layers):
        cache = cache.write(spec.first_layer + i, context.keys[i][0], context.values[i][0])

    # 3. propose after each row's last emitted token (padding rows: harmless, ignored by the caller)
    anchor_positions = batch.seq_lens - spec_inputs.num_drafts + accepted
    anchors = jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
    embed, head = target_embedding_and_head(params, config)
    proposal = D.propose(
        drafter_params, jnp.maximum(anchors, 0), anchor_positions, _drafter_context(cache, spec, anchor_positions),
        embed_weight=embed, lm_head_weight=head, config=drafter, num_drafts=spec.num_drafts,
    )
    return cache.with_batch(None), SpecOutput(emitted, accepted, logprobs, sampled, proposal.tokens)


SPECULATIVE_METHODS = ("dflash",)  # DFlash and DFlash2 checkpoints alike (beam_jax/drafter.py)


def check_drafter(drafter: D.DrafterConfig, target: BeamConfig) -> None:
    """Whether `drafter` can draft for `target` in this engine; every problem in one ValueError."""
    problems = []
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.vocab_size} != the target's {target.vocab_size}")
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {drafter.hidden_size} != the target's {target.hidden_size} (shared embedding)")
    if bad := [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]:
        problems.append(f"target_layer_ids {bad} are not layers of the {target.num_hidden_layers}-layer target")
    # Its K/V lives in the target's page arrays: the same shape per token.
    if (drafter.num_key_value_heads, drafter.head_dim) != (target.num_key_value_heads, target.head_dim):
        problems.append(
            f"KV heads x head_dim {drafter.num_key_value_heads}x{drafter.head_dim} != the target's "
            f"{target.num_key_value_heads}x{target.head_dim} (drafter KV shares the target's pages)"
        )
    if drafter.mask_token_id is None:
        problems.append("no mask_token_id in dflash_config")
    if len(set(drafter.layer_types)) > 1:
        problems.append("mixed sliding and full layers (its layers form one cache group)")
    if problems:
        raise ValueError("the draft model cannot draft for this model: " + "; ".join(problems))


def drafter_memory_spec(drafter: D.DrafterConfig, params: Params) -> DrafterSpec:
    """The drafter as the pool planner counts it: its layers (one window) and its parameters."""
    return DrafterSpec(
        name="draft-model", num_layers=drafter.num_hidden_layers, window=drafter.window(0),
        num_key_value_heads=drafter.num_key_value_heads, head_dim=drafter.head_dim,
        num_params=sum(int(a.size) for a in flat_params(params).values()),
    )
