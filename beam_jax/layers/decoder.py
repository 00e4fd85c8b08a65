"""One Beam decoder layer: sandwich norms around attention and the MLP, depth-scaled residuals."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig
from beam_jax.kv_cache import KVCache
from beam_jax.layers.attention import Attention
from beam_jax.layers.mlp import DenseMLP
from beam_jax.layers.moe import MoE
from beam_jax.layers.norm import RMSNorm
from beam_jax.paged_cache import PagedKVCache


def depth_scaled_residual(
    update: Float[Array, "... d"], residual: Float[Array, "... d"], add_index: int
) -> Float[Array, "... d"]:
    """`update/sqrt(n) + residual*sqrt((n-1)/n)`: the n-th residual addition keeps unit variance.
    Rounded as the reference rounds: each scaled term, then their sum (fp32 arithmetic, exact
    scalars; a bf16 scalar would be off by up to 0.4%)."""
    dtype = residual.dtype
    scaled_update = (update.astype(jnp.float32) * (1.0 / math.sqrt(add_index))).astype(dtype)
    scaled_residual = (residual.astype(jnp.float32) * math.sqrt((add_index - 1) / add_index)).astype(dtype)
    return (scaled_update.astype(jnp.float32) + scaled_residual.astype(jnp.float32)).astype(dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, config: BeamConfig, layer: int, *, dtype):
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sparse = config.is_sparse(layer)
        self.self_attn = Attention(config, layer, dtype=dtype)
        if self.is_sparse:
            self.mlp = MoE(config, dtype=dtype)
        else:
            self.mlp = DenseMLP(hidden, config.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.attn_add_index = 2 * (layer + 1)
        self.mlp_add_index = 2 * (layer + 1) + 1

    def __call__(
        self, x: Float[Array, "batch t hidden"], positions: Int[Array, "batch t"], cache: KVCache | None
    ) -> tuple[Float[Array, "batch t hidden"], KVCache | None, Int[Array, "tokens k"] | None]:
        attn_out, cache = self.self_attn(self.input_layernorm(x), positions, cache)
        x = depth_scaled_residual(self.post_attention_layernorm(attn_out), x, self.attn_add_index)

        h = self.pre_feedforward_layernorm(x)
        if self.is_sparse:
            # A paged step's tokens past query_start[-1] are its bucket's padding: no expert for them. Its
            # routing kernel's state and MoE kernel's counters go on to the next layer.
            batch = cache.batch if isinstance(cache, PagedKVCache) else None
            real, states = (None, ()) if batch is None else (batch.query_start[-1],
                                                             (batch.routing_state, batch.moe_counters))
            mlp_out, expert_indices, *next_states = self.mlp(h, real, *states)
            if next_states:
                cache = cache.with_kernel_states(*next_states)
        else:
            mlp_out, expert_indices = self.mlp(h), None
        x = depth_scaled_residual(self.post_feedforward_layernorm(mlp_out), x, self.mlp_add_index)
        return x, cache, expert_indices
