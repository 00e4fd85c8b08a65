"""Where the NVFP4 MoE kernel's time goes (run I in RESULTS.md): the default kernels against copies
with parts of the work replaced, at Beam's TP8 expert shape, per kernel, CUPTI device time.

  cheap_decode    the E2M1 PTX replaced by 2 bit operations per 4 values (wrong values, same loads)
  no_scale        block scales neither loaded nor converted (a constant stands in; wrong values)
  cheap_no_scale  both
  warps8          the default blocks with 8 warps
  (bf16: the default blocks, for the same-run baseline)

Usage (GPU): OUT=dir python3 benchmarks/moe/decode_probe.py  (rows to $OUT/decode_probe.json)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import profiler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as b  # noqa: E402
from bench import E, H, I, TOP_K, mg  # noqa: E402
# 2 bit operations per 4 values instead of the decode's 10 (wrong values: a timing probe only)
CHEAP = """{
.reg .b32 t;
prmt.b32 t, $2, 0, 0x4140;
and.b32 $0, t, $3;
prmt.b32 t, $2, 0, 0x4342;
and.b32 $1, t, $4;
}"""


def acc_noscale(acc, x_ref, token_rows, row_ok, op, refs, expert, n_idx, n_ok, chunk, block_k):
    """`mg._accumulate_packed_nvfp4` with a constant in place of the block scales (no masks: Beam's
    TP8 shape has no tails at the default blocks)."""
    from jax.experimental.pallas import triton as plgpu
    half = block_k // 2
    block_n = n_idx.shape[0]
    w_rows = (op.row_offset + n_idx)[:, None]
    byte_cols = chunk * half + lax.iota(jnp.int32, half)
    packed = plgpu.load(refs[0].at[expert, w_rows, byte_cols[None, :]])
    scale = jnp.full((block_n, half), 2.0**119, jnp.bfloat16)
    low, high = mg._e2m1_times_scale(packed, scale, emulated=False)
    dtype = x_ref.dtype
    cols = chunk * block_k + lax.iota(jnp.int32, half)
    x_even = plgpu.load(x_ref.at[token_rows[:, None], cols[None, :]], mask=row_ok[:, None], other=0)
    x_odd = plgpu.load(x_ref.at[token_rows[:, None], half + cols[None, :]], mask=row_ok[:, None], other=0)
    return acc + mg._dot(x_even, low.astype(dtype), dtype) + mg._dot(x_odd, high.astype(dtype), dtype)


@contextlib.contextmanager
def patched(cheap=False, noscale=False):
    saved = (mg._E2M1_PTX_LOW, mg._E2M1_PTX_HIGH, mg._accumulate_packed_nvfp4)
    if cheap:
        mg._E2M1_PTX_LOW = mg._E2M1_PTX_HIGH = CHEAP
    if noscale:
        mg._accumulate_packed_nvfp4 = acc_noscale
    try:
        yield
    finally:
        mg._E2M1_PTX_LOW, mg._E2M1_PTX_HIGH, mg._accumulate_packed_nvfp4 = saved


def error(blocks, x, w, ids, weights) -> dict:
    want = mg.moe_gemm_reference(x[0], w[0], ids[0], *weights).astype(jnp.float32)
    got = jax.jit(functools.partial(mg.moe_gemm_kernel, blocks=blocks))(x[0], w[0], ids[0], *weights)
    return dict(max_err=float(jnp.abs(got.astype(jnp.float32) - want).max()), max_ref=float(jnp.abs(want).max()))


def main():
    rows = []
    out = os.environ.get("OUT", ".")
    log = open(f"{out}/decode_probe.jsonl", "a")
    for fmt in ("nvfp4", "bf16"):
        weights = b.make_weights(fmt, jax.random.key(0))
        per_expert = b.expert_bytes(*weights)
        for t in (8, 64, 1):
            R = 4
            x, w, ids = b.make_tokens(t, R, jax.random.key(t))
            touched = sum(len(set(map(int, ids[r].reshape(-1)))) for r in range(R)) / R
            floor = touched * per_expert / b.HBM_BPS * 1e6
            d = mg.choose_blocks(t, TOP_K, E, H, I, weights[0].format)
            variants = {"default": (d, {})}
            if fmt == "nvfp4":
                variants.update({
                    "cheap_decode": (d, dict(cheap=True)),
                    "no_scale": (d, dict(noscale=True)),
                    "cheap_no_scale": (d, dict(cheap=True, noscale=True)),
                    "warps8": (dataclasses.replace(d, num_warps=8), {}),
                })
            for name, (blocks, patch) in variants.items():
                try:
                    with patched(**patch):
                        f = b.chain(functools.partial(mg.moe_gemm_kernel, blocks=blocks))
                        jax.block_until_ready(f((x, w, ids), *weights))
                        _, per = profiler.measure(f, aggregate=False)((x, w, ids), *weights)
                    by = {}
                    for n, ms in per:
                        k = "gate_up" if "gate_up" in n else "down" if "down" in n else "other"
                        by[k] = by.get(k, 0) + ms * 1e3 / R
                    total = sum(by.values())
                    row = dict(format=fmt, tokens=t, variant=name, us=total, floor_us=floor, pct_floor=100 * floor / total,
                               **{f"{k}_us": v for k, v in by.items()})
                    if name == "default":
                        row.update(error(blocks, x, w, ids, weights))
                except Exception as e:  # noqa: BLE001 - report and go on
                    row = dict(format=fmt, tokens=t, variant=name, error=f"{type(e).__name__}: {e}"[:400])
                rows.append(row)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
                log.write(json.dumps(row) + "\n")
                log.flush()
    json.dump(rows, open(f"{out}/decode_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main()
