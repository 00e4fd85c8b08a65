"""What a Mosaic GPU pipeline of TMA copies alone reads per second, by step box and program length (session 18).

The NVFP4 down GEMM's copies alone reach 65-71 % of its floor (RESULTS.md, session 18 run A): steps of
128 rows x 32 bytes, five a program. Gate/up's (64 rows x 128 bytes, 20 a program) reach 90-98 %. This
kernel does nothing but `emit_pipeline` over `steps` boxes of `rows x cols` bytes per program (the weight
tiles' transforms: 8-row tiling, swizzle = cols), so it separates the box shape from the program length
from the bytes in flight. Each call reads a different part of a buffer, 200 MB from the last read of its
bytes (weights come from HBM, not L2). XLA's own reduction over the same bytes is the same run's baseline.

Usage (GPU): OUT=dir python3 -u benchmarks/moe/copy_ceiling.py [--totals 14680064,23068672]
    [--configs '[[64, 128, 4, 2, "plain"]]']   (bytes per call; (rows, cols, steps, stages, variant) as CONFIGS)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

HBM_BYTES_PER_S = 4.2e12  # the floor rate of benchmarks/moe (RESULTS.md)
L2_CLEAR_BYTES = 200 * 2**20  # a call's bytes were last read this many bytes of other calls ago (H200's L2: 50 MB)

# (rows, cols bytes, steps a program, stages, variant): the down GEMM's today, then one change at a time.
# Variants: "plain" (one warpgroup, `emit_pipeline`), "ws" (`emit_pipeline_warp_specialized`: a memory
# warpgroup issues the copies, a compute warpgroup waits for them), "smem28" (plain with the down GEMM's
# ~28 KB of shared memory a program, so ~7 programs an SM as in the kernel, not as many as fit).
CONFIGS = [(128, 32, 5, 4, "plain"), (128, 32, 5, 4, "smem28"), (128, 32, 20, 4, "plain"), (128, 32, 70, 4, "plain"),
           (128, 32, 20, 8, "plain"), (128, 32, 5, 4, "ws"), (128, 32, 20, 4, "ws"), (128, 32, 70, 6, "ws"),
           (32, 128, 5, 4, "plain"), (32, 128, 5, 4, "smem28"), (32, 128, 20, 4, "plain"), (32, 128, 70, 4, "plain"),
           (64, 64, 5, 4, "plain"), (256, 32, 5, 4, "plain"), (128, 64, 5, 4, "plain"), (128, 128, 5, 4, "plain"),
           (64, 128, 5, 4, "plain"), (64, 128, 20, 2, "plain"), (64, 128, 20, 4, "plain")]
TOTALS = (52_428_800, 209_715_200)  # about the down GEMM's bytes at T = 8 and T = 64


def repeats_for(total: int) -> int:
    """Calls timed, each on its own part of the buffer: at least 4, and enough that L2 holds none of a call's bytes."""
    return max(4, -(-L2_CLEAR_BYTES // total))


def copy_kernel(programs: int, steps: int, rows: int, cols: int, stages: int, variant: str = "plain"):
    """`(offset [1] int32, data [repeats * programs, steps, rows, cols] uint8) -> unused [1] int32`: program p
    copies steps boxes of `data[offset + p]` into shared memory, and does nothing with them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    transforms = (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(cols))

    def step(*_):
        pass

    def kernel(offset_gmem, data_gmem, out_gmem, **scratch):
        del out_gmem, scratch
        program = offset_gmem[0] + jax.lax.axis_index("p")
        spec = plgpu.BlockSpec((None, None, rows, cols), lambda s: (program, s, 0, 0), transforms=transforms)
        if variant == "ws":
            plgpu.emit_pipeline_warp_specialized(step, grid=(steps,), memory_registers=40, in_specs=[spec],
                                                 max_concurrent_steps=stages, wg_axis="wg",
                                                 num_compute_wgs=1)(data_gmem)
        else:
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec], max_concurrent_steps=stages)(data_gmem)

    extra = dict(num_threads=2, thread_name="wg") if variant == "ws" else {}
    if variant == "smem28":
        extra["scratch_types"] = dict(pad=plgpu.SMEM((28 * 1024 - stages * rows * cols,), jnp.uint8))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(programs,), grid_names=("p",),
                        **extra)


def time_config(rows, cols, steps, stages, variant, total):
    programs = max(1, round(total / (rows * cols * steps)))
    repeats = repeats_for(total)
    data = jax.random.bits(jax.random.key(rows * cols + steps), (repeats * programs, steps, rows, cols), jnp.uint8)
    offsets = jnp.arange(repeats, dtype=jnp.int32)[:, None] * programs
    us, _, _ = bench.time_calls(copy_kernel(programs, steps, rows, cols, stages, variant), (offsets,), data)
    read = programs * steps * rows * cols
    return dict(kind="copy", rows=rows, cols=cols, steps=steps, stages=stages, variant=variant, programs=programs, bytes=read,
                us=us, tb_per_s=read / us / 1e6, pct_floor=100 * read / HBM_BYTES_PER_S / (us * 1e-6))


def time_xla(total):
    """XLA reading the same bytes: a sum of uint32 words (one reduction kernel)."""
    words = total // 4
    repeats = repeats_for(total)
    data = jax.random.bits(jax.random.key(7), (repeats * words,), jnp.uint32)
    offsets = jnp.arange(repeats, dtype=jnp.int32)[:, None] * words

    def op(offset, data):
        return jax.lax.dynamic_slice(data, offset, (words,)).sum()

    us, kernels, _ = bench.time_calls(op, (offsets,), data)
    return dict(kind="xla_sum", bytes=total, us=us, kernels=kernels, tb_per_s=total / us / 1e6,
                pct_floor=100 * total / HBM_BYTES_PER_S / (us * 1e-6))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--totals", default=",".join(map(str, TOTALS)), help="bytes a call reads, comma-separated")
    parser.add_argument("--configs", default=None, help="JSON list of (rows, cols, steps, stages, variant)")
    args = parser.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    rows_out = []
    for total in map(int, args.totals.split(",")):
        for label, fn in [("xla sum", lambda: time_xla(total))] + [
                (f"{r:3d} x {c:3d} B, {s:2d} steps, {st} stages, {v}", lambda cfg=(r, c, s, st, v): time_config(*cfg, total))
                for r, c, s, st, v in configs]:
            try:
                row = fn()
            except Exception as e:  # noqa: BLE001 - report and go on
                row = dict(kind="error", label=label, error=repr(e)[:1500])
                print(f"{total / 2**20:5.0f} MB  {label:42s} ERROR {row['error'][:300]}", flush=True)
                rows_out.append(row)
                continue
            row.update(label=label, total=total)
            rows_out.append(row)
            print(f"{total / 2**20:5.0f} MB  {label:42s} {row['us']:7.1f} us  {row['tb_per_s']:5.2f} TB/s  "
                  f"{row['pct_floor']:5.1f} %", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "copy-ceiling.json"), "w") as f:
        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
