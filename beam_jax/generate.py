"""Greedy generation over the contiguous KV cache (offline use and parity tests; the serving
engine has its own batched loop)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from beam_jax.config import BeamConfig
from beam_jax.kv_cache import KVCache
from beam_jax.model import Params, forward

CACHE_BUCKET = 64  # cache lengths are rounded up to this so that nearby lengths share a compile


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _greedy_step(params: Params, tokens, positions, last_index, cache: KVCache, *, config: BeamConfig):
    """One forward over `tokens`; returns each row's argmax at `last_index` and the cache."""
    out = forward(params, tokens, positions, cache, config=config)
    last_logits = jnp.take_along_axis(out.logits, last_index[:, None, None], axis=1)[:, 0]
    return jnp.argmax(last_logits, axis=-1).astype(jnp.int32), out.cache


def greedy_generate(
    params: Params,
    config: BeamConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy continuations of a batch of prompts (token id lists of any lengths).

    Each row stops after emitting a stop token (which is included) or `max_new_tokens` tokens.
    Prompts are right-padded: a padded slot writes its keys at a position past the row's end,
    which no query of that row sees before a real token overwrites it.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if bad := sorted({t for p in prompts for t in p if not 0 <= t < config.vocab_size}):
        raise ValueError(f"token ids {bad[:10]} are outside the vocabulary [0, {config.vocab_size})")
    lengths = np.array([len(p) for p in prompts], np.int32)
    needed = int(lengths.max()) + max_new_tokens
    if needed > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({lengths.max()} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    if max_new_tokens == 0:
        return [[] for _ in prompts]

    batch, width = len(prompts), int(lengths.max())
    tokens = np.zeros((batch, width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (batch, width))
    dtype = params["model"]["embed_tokens"]["weight"][...].dtype
    cache = KVCache.create(config, batch, -(-needed // CACHE_BUCKET) * CACHE_BUCKET, dtype)

    next_tokens, cache = _greedy_step(params, tokens, positions, jnp.asarray(lengths - 1), cache, config=config)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    stop = set(stop_token_ids)
    for step in range(max_new_tokens):
        emitted = np.asarray(next_tokens)
        for row in np.flatnonzero(~done):
            outputs[row].append(int(emitted[row]))
            done[row] = emitted[row] in stop
        if done.all() or step == max_new_tokens - 1:
            break
        step_positions = jnp.asarray(lengths + step)[:, None]
        next_tokens, cache = _greedy_step(
            params, next_tokens[:, None], step_positions, jnp.zeros(batch, jnp.int32), cache, config=config
        )
    return outputs
