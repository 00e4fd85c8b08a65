"""What the Mosaic GPU kernels (`bf16_moe_mgpu`, `decode_attention_mgpu`, the NVFP4 kernels) share: the
GPUs they are written for, and shared-memory tile layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

HOPPER = "9.0"  # jax's compute_capability of the GPUs the kernels are written for (wgmma is sm_90 only)


def is_hopper(device) -> bool:
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == HOPPER


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H100/H200 SXM, and when lowering on a CPU)."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 132


def smem_transforms(cols: int, dtype) -> tuple:
    """TMA/wgmma tiling and swizzle of a shared-memory tile whose rows hold `cols` values."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)
