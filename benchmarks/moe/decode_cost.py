"""What the NVFP4 GEMM's register decode costs on the GPU (session 15, run E of RESULTS.md).

The kernel's decode body (`nvfp4_mgpu._decode_tile`) is swapped for cheaper ones that keep the
kernel's memory traffic and everything else:
  full       the kernel as committed;
  no_scales  the bit extraction and the fma, with constant scales (no scale conversion or loads);
  raw        each packed word used as the bf16 registers as it is (no decode instruction at all);
  const      constant registers, no load of the weight words either: the wgmma alone on the pipeline;
  copy       raw, and no wgmma either: what is left is the pipeline (its copies, barriers and waits), the
             memory side's ceiling for this kernel's access pattern (session 17: the GEMMs moved with no
             change of their compute, so is the down GEMM's ~60 % of its floor the pattern's own limit?).
The values are wrong in the last three; only their time matters. Shapes are the layer's defaults at
T = 1, 8 and 64 (`nvfp4_moe_mgpu.default_config`), timed by `mgpu_probe.time_kernel` (CUPTI).

Usage (GPU): OUT=dir python3 -u benchmarks/moe/decode_cost.py
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mgpu_probe as probe  # noqa: E402
from pallas_kernels import nvfp4_mgpu as nm  # noqa: E402

SHAPES = {  # label: (N, K, blocks, block_t, tile_k, splits, stages, tile_n, other grouped_matmul options)
    "T1 gate/up": (640, 5120, 8, 8, 256, 4, 2, 64, dict(decode_chunks=2)),
    "T1 down": (5120, 320, 8, 8, 64, 1, 4, 64, {}),
    "T8 gate/up": (640, 5120, 57, 8, 256, 1, 2, 64, dict(decode_chunks=2)),
    "T8 down": (5120, 320, 57, 8, 64, 1, 4, 128, {}),
    "T64 gate/up": (640, 5120, 223, 8, 256, 1, 2, 64, {}),
    "T64 down": (5120, 320, 223, 8, 64, 1, 4, 256, {})}


def cheap_decode(mode: str):
    """A stand-in for `nm._decode_tile` (same signature): "no_scales", "raw" or "const" (the module doc)."""

    def make(tile_n: int, tile_k: int, line_box: bool = False, chunk: int = 0, chunks: int = 1, row_chunk: int = 0,
             row_chunks: int = 1, chunk_staged: bool = False):
        del chunk_staged  # (the stand-ins read no scales)
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils

        def body(ctx, packed, _):  # the staged scales are not read
            del ctx
            i32, bf16 = ir.IntegerType.get_signless(32), ir.BF16Type.get()
            tiles = tile_n // 64 // row_chunks
            out = np.empty(fa.WGMMA_LAYOUT.registers_shape((64 * tiles, tile_k // chunks)), dtype=object)
            groups = tile_k // 32 // chunks
            ones = utils.c(0x3F803F80, i32)  # bf16x2 (1.0, 1.0) in place of the block scales
            word_at = nm.weight_words(packed, tile_k, line_box)
            for m in range(tiles):
                for half in range(2):
                    for c in range(groups):
                        word = ones if mode == "const" else word_at(row_chunk * tiles + m, chunk * groups + c, half)
                        for pair in range(4):
                            reg = word if mode in ("raw", "const") else llvm.inline_asm(
                                i32, [word, ones], nm._decode_pair_asm(pair), "=r,r,r")
                            out[m, 4 * c + pair, 0, 0, half, 0, 0, 0, 0] = utils.bitcast(
                                reg, ir.VectorType.get((2,), bf16))
            return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

        return body

    return make


@contextlib.contextmanager
def stand_in(mode: str):
    """The kernel with its decode (and for "copy" its wgmma) swapped as `mode` says, within the block."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    saved = nm._decode_tile, nm._stage_scales, plgpu.wgmma, plgpu.wgmma_wait
    try:
        if mode != "full":  # the stand-ins read no scales: nothing to stage
            nm._decode_tile = cheap_decode("raw" if mode == "copy" else mode)
            nm._stage_scales = lambda *shape, **options: lambda ctx, *refs: None
        if mode == "copy":
            plgpu.wgmma = plgpu.wgmma_wait = lambda *args, **kwargs: None
        yield
    finally:
        nm._decode_tile, nm._stage_scales, plgpu.wgmma, plgpu.wgmma_wait = saved


def main():
    rows = []
    rng = np.random.default_rng(0)
    for label, (n, k, blocks, block_t, tile_k, splits, stages, tile_n, options) in SHAPES.items():
        for mode in ("full", "no_scales", "raw", "copy", "full"):  # full twice: the run's spread
            with stand_in(mode):
                row = dict(probe.time_kernel(rng, n, k, blocks, block_t, tile_k, splits, stages, tile_n,
                                                     **options),
                           label=label, mode=mode)
            rows.append(row)
            print(f"{label:12s} {mode:10s} {row['us']:7.1f} us  {row['pct_floor']:5.1f} % of "
                  f"{row['floor_us']:.1f}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode-cost.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
