"""Beam's MoE block: fp32 sigmoid routing with a correction bias and group-limited top-k, routed
experts with fp32 SwiGLU, and the routed scaling factor applied after aggregation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig
from beam_jax.layers.linear import matmul_precision
from beam_jax.layers.mlp import swiglu
from beam_jax.layers.quantized import QuantizedExpertLinear
from pallas_kernels.moe_gemm import ExpertWeights, moe_gemm
from pallas_kernels.routing import routing as route  # fp32 routing (reference unless asked for the kernel)


def experts_reference(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    indices: Int[Array, "tokens k"],
    gate_up_proj: Float[Array, "experts two_i hidden"],
    down_proj: Float[Array, "experts hidden i"],
) -> Float[Array, "tokens hidden"]:
    """Weighted sum of each token's experts, in plain jnp: the (token, expert) pairs are sorted by
    expert and run as two ragged matmuls. As in the reference, each weighted expert output is
    rounded to the input dtype and a token's outputs are added in increasing expert order, each
    addition rounded (in bf16 the order changes the result)."""
    tokens, top_k = indices.shape
    num_experts = gate_up_proj.shape[0]
    flat_experts = indices.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    token_of_pair = order // top_k
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    precision = matmul_precision(gate_up_proj.dtype)
    # Weights are [out, in] (HF layout): contract the lhs feature dim with the rhs dim 2.
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    gate_up = jax.lax.ragged_dot_general(x[token_of_pair], gate_up_proj, group_sizes, dims, precision=precision)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jax.lax.ragged_dot_general(swiglu(gate, up), down_proj, group_sizes, dims, precision=precision)
    pair_weights = weights.reshape(-1)[order][:, None]
    weighted = (out.astype(jnp.float32) * pair_weights).astype(x.dtype)
    # Back to [tokens, k] with each token's experts in increasing expert order: the sort was
    # stable by expert, so pair j of a token in sorted order lands in slot rank(j).
    slot_in_token = jnp.argsort(jnp.argsort(indices, axis=1, stable=True), axis=1).reshape(-1)[order]
    per_token = jnp.zeros((tokens, top_k, x.shape[1]), x.dtype).at[token_of_pair, slot_in_token].set(weighted)
    total = per_token[:, 0]
    for slot in range(1, top_k):
        total = (total.astype(jnp.float32) + per_token[:, slot].astype(jnp.float32)).astype(x.dtype)
    return total


class Router(nnx.Module):
    """`mlp.gate`: fp32 weight and correction bias, whatever the model's dtype."""

    def __init__(self, config: BeamConfig):
        self.weight = nnx.Param(jnp.zeros((config.num_experts, config.hidden_size), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
        self.num_groups = config.num_groups
        self.groups_kept = config.groups_kept
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob

    def __call__(self, x: Float[Array, "tokens hidden"]):
        return route(
            x,
            self.weight[...],
            self.e_score_correction_bias[...],
            num_groups=self.num_groups,
            groups_kept=self.groups_kept,
            top_k=self.top_k,
            normalize=self.normalize,
        )


class Experts(nnx.Module):
    """bf16 experts fused as in the reference: `gate_up_proj [E, 2I, H]` (gate rows first),
    `down_proj [E, H, I]`. Quantized experts keep `gate_proj`, `up_proj`, `down_proj` apart, each
    packed in its checkpoint format (`QuantizedExpertLinear`), since each has its own scales."""

    def __init__(self, config: BeamConfig, *, dtype):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.expert_format = config.expert_format
        if self.expert_format == "bf16":
            self.gate_up_proj = nnx.Param(jnp.zeros((e, 2 * i, h), dtype))
            self.down_proj = nnx.Param(jnp.zeros((e, h, i), dtype))
        else:
            self.gate_proj = QuantizedExpertLinear(e, i, h, self.expert_format)
            self.up_proj = QuantizedExpertLinear(e, i, h, self.expert_format)
            self.down_proj = QuantizedExpertLinear(e, h, i, self.expert_format)

    def expert_weights(self) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
        """gate, up, down as the grouped-GEMM kernel takes them (packed weights stay packed)."""
        if self.expert_format == "bf16":
            gate_up, intermediate = self.gate_up_proj[...], self.down_proj.shape[2]
            return (
                ExpertWeights(gate_up, rows=intermediate),
                ExpertWeights(gate_up, row_offset=intermediate, rows=intermediate),
                ExpertWeights(self.down_proj[...]),
            )
        return self.gate_proj.expert_weights(), self.up_proj.expert_weights(), self.down_proj.expert_weights()

    def __call__(self, x, weights, indices):
        if jax.default_backend() == "gpu":  # the Pallas kernels; CPU keeps the reference below
            return moe_gemm(x, weights, indices, *self.expert_weights(), use_kernel=True)
        if self.expert_format == "bf16":
            gate_up, down = self.gate_up_proj[...], self.down_proj[...]
        else:
            gate = self.gate_proj.dequantize(x.dtype)
            gate_up = jnp.concatenate([gate, self.up_proj.dequantize(x.dtype)], axis=1)
            down = self.down_proj.dequantize(x.dtype)
        return experts_reference(x, weights, indices, gate_up, down)


class MoE(nnx.Module):
    def __init__(self, config: BeamConfig, *, dtype):
        self.gate = Router(config)
        self.experts = Experts(config, dtype=dtype)
        self.routed_scaling_factor = config.routed_scaling_factor

    def __call__(self, x: Float[Array, "... hidden"]) -> tuple[Float[Array, "... hidden"], Int[Array, "tokens k"]]:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        out = self.experts(flat, weights, indices).astype(jnp.float32) * self.routed_scaling_factor
        return out.astype(x.dtype).reshape(x.shape), indices
