"""Quantized expert weights, stacked over experts and kept packed in device memory.

Parameter names are the checkpoints' per-expert names with the expert index folded into a leading
axis: ModelOpt NVFP4 `gate_proj.{weight (uint8 nibbles), weight_scale (e4m3 per 16),
weight_scale_2 (fp32), input_scale (fp32)}`, compressed-tensors FP8 `{weight (e4m3),
weight_scale ([out, 1] fp32)}`, ModelOpt FP8 `{weight, weight_scale (fp32), input_scale}`.

`dequantize_experts` is the reference path: it expands one layer's experts to the compute dtype
inside the jitted step (a temporary that lives for that layer only); the grouped-GEMM kernels
(`packed_expert_weights`) replace it by decoding in registers.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from beam_jax.quant import FP8Weight, NVFP4Weight, dequantize_fp8, dequantize_nvfp4
from pallas_kernels.moe_gemm import ExpertWeights

NVFP4_GROUP = 16


class QuantizedExpertLinear(nnx.Module):
    """One projection of every expert (`[E, out, in]` logically) in a quantized format."""

    def __init__(self, experts: int, out_features: int, in_features: int, expert_format: str):
        self.expert_format = expert_format
        if expert_format == "nvfp4":
            if in_features % NVFP4_GROUP:
                raise ValueError(f"NVFP4 needs in_features divisible by {NVFP4_GROUP}, got {in_features}")
            self.weight = nnx.Param(jnp.zeros((experts, out_features, in_features // 2), jnp.uint8))
            groups = in_features // NVFP4_GROUP
            self.weight_scale = nnx.Param(jnp.zeros((experts, out_features, groups), jnp.float8_e4m3fn))
            self.weight_scale_2 = nnx.Param(jnp.zeros((experts,), jnp.float32))
            self.input_scale = nnx.Param(jnp.zeros((experts,), jnp.float32))
        elif expert_format == "fp8_channel":
            self.weight = nnx.Param(jnp.zeros((experts, out_features, in_features), jnp.float8_e4m3fn))
            self.weight_scale = nnx.Param(jnp.zeros((experts, out_features, 1), jnp.float32))
        elif expert_format == "fp8_tensor":
            self.weight = nnx.Param(jnp.zeros((experts, out_features, in_features), jnp.float8_e4m3fn))
            self.weight_scale = nnx.Param(jnp.zeros((experts,), jnp.float32))
            self.input_scale = nnx.Param(jnp.zeros((experts,), jnp.float32))
        else:
            raise ValueError(f"unknown quantized expert format {expert_format!r}")


# Functions of one projection's arrays by suffix (`{"weight": ..., "weight_scale": ...}`) rather
# than methods, so that the sharded path runs them on the slices each device holds
# (`beam_jax.sharding.experts_on_mesh`).
def dequantize_experts(arrays: dict[str, Array], expert_format: str, dtype) -> Float[Array, "experts out in"]:
    """The reference path: one layer's experts expanded to `dtype` inside the jitted step."""
    if expert_format == "nvfp4":
        return dequantize_nvfp4(NVFP4Weight(arrays["weight"], arrays["weight_scale"], arrays["weight_scale_2"]), dtype)
    return dequantize_fp8(FP8Weight(arrays["weight"], arrays["weight_scale"]), dtype)


def packed_expert_weights(arrays: dict[str, Array], expert_format: str) -> ExpertWeights:
    """The packed parameters as the grouped-GEMM kernel takes them (no dequantization)."""
    if expert_format == "nvfp4":
        return ExpertWeights(arrays["weight"], arrays["weight_scale"], arrays["weight_scale_2"], format="nvfp4")
    if expert_format == "fp8_channel":
        scale = arrays["weight_scale"]
        return ExpertWeights(arrays["weight"], scale.reshape(scale.shape[:2]), format="fp8_channel")
    return ExpertWeights(arrays["weight"], arrays["weight_scale"], format="fp8_tensor")
