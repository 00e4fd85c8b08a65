"""Shared-memory tile layouts of the Mosaic GPU kernels (`bf16_moe_mgpu`, `decode_attention_mgpu`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def smem_transforms(cols: int, dtype) -> tuple:
    """TMA/wgmma tiling and swizzle of a shared-memory tile whose rows hold `cols` values."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)
