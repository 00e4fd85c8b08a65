"""Beam's gated GQA attention: q/k RMSNorm per head, RoPE on sliding layers, SSMax on full layers,
a sliding-window or causal mask over absolute positions, and a per-head-biased sigmoid output gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from beam_jax.config import BeamConfig
from beam_jax.kv_cache import KVCache
from beam_jax.layers.linear import Linear, matmul_precision
from beam_jax.layers.norm import RMSNorm
from beam_jax.layers.rope import apply_rope, apply_ssmax, rope_cos_sin, ssmax_scale
from beam_jax.paged_cache import PagedKVCache
from pallas_kernels.paged_attention import HeadPrologue, OutputGate


def visibility_mask(
    q_positions: Int[Array, "batch tq"], k_positions: Int[Array, "batch tk"], window: int | None
) -> Bool[Array, "batch tq tk"]:
    """A key is visible iff it is not in the future and, on sliding layers, `q_pos - k_pos < window`.
    Negative key positions mark empty slots."""
    distance = q_positions[:, :, None] - k_positions[:, None, :]
    visible = (distance >= 0) & (k_positions[:, None, :] >= 0)
    if window is not None:
        visible &= distance < window
    return visible


def attend(
    q: Float[Array, "batch tq heads d"],
    k: Float[Array, "batch tk kv_heads d"],
    v: Float[Array, "batch tk kv_heads d"],
    mask: Bool[Array, "batch tq tk"],
) -> Float[Array, "batch tq heads d"]:
    """Plain-jnp GQA softmax attention with the reference's rounding points: scores rounded to the
    input dtype, scaled, then softmax in fp32 and probabilities rounded to the input dtype."""
    batch, tq, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, tq, kv_heads, heads // kv_heads, d)
    precision = matmul_precision(q.dtype)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=precision, preferred_element_type=jnp.float32)
    scores = (scores.astype(q.dtype).astype(jnp.float32) * d**-0.5).astype(q.dtype).astype(jnp.float32)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A query with no visible key (only padding) gets zeros rather than NaN.
    probs = jnp.where(mask[:, None, None].any(-1, keepdims=True), probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, precision=precision, preferred_element_type=jnp.float32)
    return out.reshape(batch, tq, heads, d).astype(v.dtype)


class Attention(nnx.Module):
    def __init__(self, config: BeamConfig, layer: int, *, dtype):
        hidden, heads, kv_heads, d = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.layer = layer
        self.head_dim = d
        self.window = config.window(layer)
        self.rope_theta = config.rope_theta(config.layer_types[layer])
        self.q_proj = Linear(hidden, heads * d, dtype=dtype, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * d, dtype=dtype, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * d, dtype=dtype, bias=bias)
        self.o_proj = Linear(heads * d, hidden, dtype=dtype, bias=bias)
        self.gate_proj = Linear(hidden, heads * d, dtype=dtype)
        self.gate_bias = nnx.Param(jnp.zeros((heads,), dtype))
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)

    def __call__(
        self,
        h: Float[Array, "batch t hidden"],
        positions: Int[Array, "batch t"],
        cache: KVCache | PagedKVCache | None,
    ) -> tuple[Float[Array, "batch t hidden"], KVCache | PagedKVCache | None]:
        """With a `PagedKVCache`, `h` is one flat ragged batch `[1, total_tokens, hidden]` described
        by the cache's `PagedBatch`; otherwise rows are sequences."""
        batch, t, _ = h.shape
        if isinstance(cache, PagedKVCache) and cache.fuses_attention:
            out, cache = self._fused_paged_attention(h, positions, cache)
            return self.o_proj(out.reshape(batch, t, -1)), cache
        q = self.q_norm(self.q_proj(h).reshape(batch, t, -1, self.head_dim))
        k = self.k_norm(self.k_proj(h).reshape(batch, t, -1, self.head_dim))
        v = self.v_proj(h).reshape(batch, t, -1, self.head_dim)
        if self.rope_theta is not None:
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            q = apply_ssmax(q, positions)

        if isinstance(cache, PagedKVCache):
            if batch != 1:
                raise ValueError(f"the paged path takes one flat ragged row [1, tokens], got batch {batch}")
            out, cache = cache.attend(self.layer, q[0], k[0], v[0], self.window)
            out = out[None]
        else:
            if cache is None:
                keys, values, k_positions = k, v, positions
            else:
                cache = cache.write(self.layer, positions, k, v)
                keys, values = cache.keys[self.layer], cache.values[self.layer]
                k_positions = jnp.broadcast_to(jnp.arange(cache.max_len), (batch, cache.max_len))
            out = attend(q, keys, values, visibility_mask(positions, k_positions, self.window))

        # The output gate, rounded where the reference rounds: biased logits, sigmoid, product.
        dtype = h.dtype
        gate = self.gate_proj(h).reshape(batch, t, -1, self.head_dim).astype(jnp.float32)
        gate = (gate + self.gate_bias[...].astype(jnp.float32)[:, None]).astype(dtype)
        gate = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype)
        out = (out.astype(jnp.float32) * gate.astype(jnp.float32)).astype(dtype)
        return self.o_proj(out.reshape(batch, t, -1)), cache

    def _fused_paged_attention(
        self, h: Float[Array, "1 t hidden"], positions: Int[Array, "1 t"], cache: PagedKVCache
    ) -> tuple[Float[Array, "t heads d"], PagedKVCache]:
        """The same layer with the per-head work handed to the cache's kernels (GPU decode path): raw
        q/k/gate projections go in; the decode kernel normalizes and rotates (or SSMax-scales) q in its
        prologue and gates its output in the combine, the page write normalizes and rotates k. Each
        step is the unfused math with the same rounding points (`pallas_kernels.paged_attention`'s
        references), so only launches change. Position data is per token, shared by all layers."""
        batch, t, _ = h.shape
        if batch != 1:
            raise ValueError(f"the paged path takes one flat ragged row [1, tokens], got batch {batch}")
        d = self.head_dim
        q = self.q_proj(h)[0].reshape(t, -1, d)
        k = self.k_proj(h)[0].reshape(t, -1, d)
        v = self.v_proj(h)[0].reshape(t, -1, d)
        gate = OutputGate(self.gate_proj(h)[0].reshape(t, -1, d).astype(h.dtype), self.gate_bias[...])
        q_weight, k_weight = self.q_norm.weight[...], self.k_norm.weight[...]
        if self.rope_theta is not None:
            cos, sin = rope_cos_sin(positions[0], d, self.rope_theta)
            query = HeadPrologue(q_weight, self.q_norm.eps, rope_cos=cos, rope_sin=sin)
            key = HeadPrologue(k_weight, self.k_norm.eps, rope_cos=cos, rope_sin=sin)
        else:  # SSMax scales queries only
            query = HeadPrologue(q_weight, self.q_norm.eps, ssmax_scale=ssmax_scale(positions[0]))
            key = HeadPrologue(k_weight, self.k_norm.eps)
        return cache.attend(self.layer, q, k, v, self.window, query_prologue=query, key_prologue=key, output_gate=gate)
