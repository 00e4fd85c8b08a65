"""Where the NVFP4 layer's down GEMM spends the time its stand-alone timing does not (session 22's question).

Session 20's `decode_cost.py` timed the down GEMM alone at ~64 us at T = 64: 205 MB of weights and 36 MB of
fp32 rows, ~3.8 TB/s of traffic. Inside the layer it takes ~70 us for about the same weights and 5 MB of bf16
rows, ~3.0 TB/s (RESULTS.md, session 22): its blocks (idle slots included) or its epilogue cost the
difference. This times the down GEMM alone on the layer's own blocks (built from routed ids as the layer builds
them: opened slots, plain or compact, or compare-and-count) with each of its output paths:
  sums        fp32 rows of every block (the stand-alone timing's path);
  scaled      bf16 rows times the global scales, whole blocks (`global_scale=`);
  pair_order  the layer's path: scaled rows stored one at a time to their pair's row (`row_destination=`),
              also with each `decode_cost.stand_in` mode of `--modes` (e.g. "copy": no decode and no wgmma).
The floor is the bytes of the distinct experts' weights (values and one-byte scales) at 4.2 TB/s.
`--gemm gate_up` times the gate/up GEMM the same way on its one path, the layer's (`swiglu`: global scales
and SwiGLU in the epilogue), so that its time splits by decode stand-in too.

Usage (GPU): OUT=dir python3 -u benchmarks/moe/down_epilogue_cost.py [--tokens 16,32,48,64] [--gemm gate_up]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import decode_cost  # noqa: E402
from mgpu_probe import HBM_BYTES_PER_S  # noqa: E402
from pallas_kernels import nvfp4_mgpu as nm  # noqa: E402
from pallas_kernels import nvfp4_moe_mgpu as nmm  # noqa: E402
from pallas_kernels import row_gather as rg  # noqa: E402

BLOCK_T = 8  # decode blocks of 8 rows
# Beam's TP8 projections per GPU: (N, K, tile_k, output paths; the last is the layer's).
GEMMS = {"down": (bench.H, 320, 64, ("sums", "scaled", "pair_order")),
         "gate_up": (2 * 320, bench.H, 256, ("swiglu",))}


def layer_blocks(ids, builder: str):
    """(expert of each block, pair of each row) as the layer builds them from `ids [T, top_k]`."""
    if builder in ("opened", "opened-compact"):
        return rg.opened_blocks_reference(ids.reshape(-1), num_experts=bench.E, block_t=BLOCK_T,
                                          compact=builder == "opened-compact")
    _, block_expert, row_pair = nmm._blocks_by_comparison(ids, bench.E, BLOCK_T)
    return block_expert, row_pair


def gemm_weights(key, gemm: str = "down"):
    """Random bytes, block scales and global scales in the kernel's layouts (timing needs no known values)."""
    n, k, tile_k, _ = GEMMS[gemm]
    kp, ks, kg = jax.random.split(key, 3)
    packed = jax.random.bits(kp, (bench.E, k // tile_k, n, tile_k // 2), jnp.uint8)
    scales = jax.random.bits(ks, (bench.E, k // tile_k, n, tile_k // 64), jnp.uint32)
    return packed, scales, jax.random.uniform(kg, (bench.E, n), jnp.float32, 0.5, 2.0)


def path_op(path: str, tokens: int, tile_n: int, stages: int, global_scale, row_chunks: int = 1, k_chunks: int = 1,
            gemm: str = "down"):
    """The GEMM with `path`'s output: a function of (activations, block experts, row pairs, packed, scales)."""
    matmul = functools.partial(nm.grouped_matmul, block_t=BLOCK_T, tile_k=GEMMS[gemm][2], stages=stages,
                               tile_n=tile_n, decode_row_chunks=row_chunks, decode_chunks=k_chunks)

    def op(act, block_expert, row_pair, packed, scales):
        if path == "sums":
            return matmul(act, block_expert, packed, scales)
        if path in ("scaled", "swiglu"):
            return matmul(act, block_expert, packed, scales, global_scale=global_scale, swiglu=path == "swiglu")
        return matmul(act, block_expert, packed, scales, global_scale=global_scale,
                      row_destination=row_pair.reshape(-1, BLOCK_T), out_rows=tokens * bench.TOP_K)

    return op


def variants(modes, gemm: str = "down"):
    """(path, decode mode) pairs to time: every path with the full kernel, then the layer's path (the last)
    with each other `decode_cost.stand_in` mode."""
    paths = GEMMS[gemm][3]
    return [(path, "full") for path in paths] + [(paths[-1], mode) for mode in modes if mode != "full"]


def time_paths(tokens: int, builder: str, modes, *, tile_n: int = 256, stages: int = 2, row_chunks: int = 1,
               k_chunks: int = 1, gemm: str = "down", repeats: int = 4):
    """One row per (path, mode): µs per call, % of the floor, and the block count the grid runs."""
    n, k, _, _ = GEMMS[gemm]
    _, _, ids = bench.make_tokens(tokens, repeats, jax.random.key(tokens))
    block_expert, row_pair = jax.vmap(functools.partial(layer_blocks, builder=builder))(ids)
    act = jax.random.normal(jax.random.key(1), (repeats, block_expert.shape[1] * BLOCK_T, k), jnp.bfloat16)
    packed, scales, global_scale = gemm_weights(jax.random.key(2), gemm)
    distinct = np.mean([len(np.unique(np.asarray(i))) for i in ids])
    floor_us = distinct * n * k * (1 / 2 + 1 / 16) / HBM_BYTES_PER_S * 1e6
    shape = f"{tile_n}x{stages}x{row_chunks}x{k_chunks}"
    rows = []
    for path, mode in variants(modes, gemm):
        with decode_cost.stand_in(mode):
            op = path_op(path, tokens, tile_n, stages, global_scale, row_chunks, k_chunks, gemm)
            us, kernels, _ = bench.time_calls(op, (act, block_expert, row_pair), packed, scales)
        rows.append(dict(kind=f"{gemm}_path", t=tokens, builder=builder, path=path, mode=mode, tile_n=tile_n,
                         stages=stages, row_chunks=row_chunks, k_chunks=k_chunks, blocks=int(block_expert.shape[1]),
                         us=us, floor_us=floor_us, pct_floor=100 * floor_us / us, kernels=kernels))
        print(f"SUMMARY T={tokens} {gemm} {builder:7s} {path:10s} {mode:9s} {shape} {us:7.1f} us "
              f"({rows[-1]['pct_floor']:5.1f} % of {floor_us:.1f}) blocks {rows[-1]['blocks']}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="16,32,48,64")
    parser.add_argument("--builders", default="opened,compare",
                        help="opened, opened-compact (the layer's blocks at 9-39 and 40-64 tokens) or compare")
    parser.add_argument("--modes", default="full,copy", help="decode_cost.stand_in modes for the layer's path")
    parser.add_argument("--gemm", default="down", choices=sorted(GEMMS))
    parser.add_argument("--shapes", default=None, help="tile_n x stages [x decode_row_chunks [x decode_chunks]], "
                                                       "comma-separated (default: the layer's, 256x2x4 / 64x2)")
    args = parser.parse_args()
    shapes = args.shapes or ("256x2x4" if args.gemm == "down" else "64x2")
    modes = args.modes.split(",")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for builder in args.builders.split(","):
            for shape in shapes.split(","):
                tile_n, stages, row_chunks, k_chunks = (*(int(v) for v in shape.split("x")), 1, 1)[:4]
                rows += time_paths(tokens, builder, modes, tile_n=tile_n, stages=stages, row_chunks=row_chunks,
                                   k_chunks=k_chunks, gemm=args.gemm)
    with open(os.path.join(os.environ.get("OUT", "."), f"{args.gemm.replace('_', '-')}-cost.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
