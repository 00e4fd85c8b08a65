"""What the Mosaic GPU kernels (`bf16_moe_mgpu`, `decode_attention_mgpu`, the NVFP4 kernels) share: the
GPUs they are written for, shared-memory tile layouts, and a timer stamp for diagnostics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

HOPPER = "9.0"  # jax's compute_capability of the GPUs the kernels are written for (wgmma is sm_90 only)


def is_hopper(device) -> bool:
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == HOPPER


def device_kind() -> str:
    """The default device's kind as the driver names it ("NVIDIA H100 80GB HBM3", "NVIDIA H200"; "" off a GPU):
    where an H100 and an H200 timed a setting differently, the kernels' defaults follow the card."""
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else ""


def is_h100(kind: str) -> bool:
    """The H100 that benchmarks/moe timed (SXM, 80 GB HBM3: "NVIDIA H100 80GB HBM3"). Other H100s (PCIe, NVL), never
    timed, keep the defaults of the H200, on which they were set."""
    return "H100" in kind and "HBM3" in kind


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H100/H200 SXM, and when lowering on a CPU)."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 132


def interpret_params(interpret: bool):
    """A kernel's `interpret=`: Mosaic GPU's interpret mode (a simulated GPU on the CPU: shared memory, TMA,
    barriers) or none."""
    return plgpu.InterpretGPUParams() if interpret else None


def smem_transforms(cols: int, dtype) -> tuple:
    """TMA/wgmma tiling and swizzle of a shared-memory tile whose rows hold `cols` values."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def stamp(stamps, p, column, value=None, *, register: str = "%globaltimer_lo") -> None:
    """A diagnostic: writes `value` (an int32), or the PTX special `register` once every thread got here (by default
    the warpgroup's `%globaltimer_lo`, ns, 32 bits; `%smid`: the SM it runs on), to `stamps[p, column]` (an int32
    gmem ref; `column` an int or a traced int32), from one thread."""
    splat = plgpu.Layout.WG_SPLAT(())
    timed = value is None  # decided here: inside `store`, its own argument is never None

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), splat, splat, splat))
    def store(ctx, stamps, p, column, given):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, memref
        from jax.experimental.mosaic.gpu import utils
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        if timed:
            utils.warpgroup_barrier()
            time = utils.inline_ptx(f"mov.u32 $0, {register};", result_types=i32, has_side_effects=True)
        else:
            time = given.registers.item()
        as_index = lambda v: arith.index_cast(index, v.registers.item())  # noqa: E731
        with utils.single_thread(scope=utils.ThreadSubset.WARPGROUP):
            memref.store(time, stamps, [as_index(p), as_index(column)])

    store(stamps, jnp.asarray(p, jnp.int32), jnp.asarray(column, jnp.int32),
          jnp.asarray(0 if value is None else value, jnp.int32))
