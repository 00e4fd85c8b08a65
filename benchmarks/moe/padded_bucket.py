"""The MoE layer and routing at a 16-token step with `R` real tokens: the engine's smallest bucket off
the GPU and for steps that prefill (`serving.runner.MIN_TOKEN_BUCKET`; on a GPU, steps of decodes
alone take buckets from 1 since session 14, which is the "alone" row below). Since session 13 the
model gives the padding expert -1 (`MoE(num_tokens=)`); before, the padding tokens (all alike in a
step: token 0 at position 0) were routed and computed like real ones, all to the same 8 experts.

Per format and R, in one run (Beam's TP8 per-GPU shape, `bench.py`'s random weights and tokens):
  padded : T = 16, the padding's pairs on one shared random selection of 8 experts (before)
  masked : T = 16, the padding's pairs on expert -1 (now)
  alone  : T = R, no padding (the shape the benchmarks of issue 4 time)
with the floor of the experts the real tokens touch. The layers are the model's GPU paths:
`moe_gemm` for bf16 (the Triton kernel; XLA's gather at one token) and the Mosaic `moe_nvfp4` for
NVFP4. Routing: `routing(x, num_tokens=R)` at T = 16 against `routing(x)` at T = 16 and at T = R.
`--check` compares masked against alone on the real tokens.

Usage (GPU): python3 benchmarks/moe/padded_bucket.py [--real 1,8] [--formats bf16,nvfp4] [--check] [--out f.json]
Smoke (CPU): python3 benchmarks/moe/padded_bucket.py --smoke   (bf16 on the reference path, small shapes,
             the check only: no timing)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from pallas_kernels import moe_gemm as mg  # noqa: E402
from pallas_kernels import routing as rt  # noqa: E402

BUCKET = 16


def step_inputs(real: int, repeats: int, key):
    """(padded, masked, alone) inputs `(x, weights, ids)` stacked over repeats: the same real tokens."""
    x, w, ids = bench.make_tokens(BUCKET, repeats, key)
    shared = ids[:, :1]  # one random selection per repeat, for every padding token
    padded_ids = ids.at[:, real:].set(jnp.broadcast_to(shared, ids[:, real:].shape))
    masked_ids = ids.at[:, real:].set(-1)
    return (x, w, padded_ids), (x, w, masked_ids), (x[:, :real], w[:, :real], ids[:, :real])


def layer_op(fmt: str, weights):
    """(op(x, w, ids, *layer_weights), layer_weights): the weights are arguments, not constants that
    jit would fold into the program (GBs of them: its compilation did not end in minutes)."""
    if fmt == "nvfp4":
        from pallas_kernels import nvfp4_moe_mgpu as nmm

        return (lambda x, w, ids, gate_up, down: nmm.moe_nvfp4(x, w, ids, gate_up, down)), bench.mosaic_layout(*weights)
    return (lambda x, w, ids, *layer: mg.moe_gemm(x, w, ids, *layer)), tuple(weights)


def floor_us(ids, real: int, weights) -> float:
    """Mean over repeats of the real tokens' distinct experts' bytes at 4.2 TB/s."""
    distinct = np.mean([len(np.unique(np.asarray(r[:real]))) for r in ids])
    return float(distinct * bench.expert_bytes(*weights) / bench.HBM_BPS * 1e6)


def check(op, layer, masked, alone, real):
    got = np.asarray(jax.jit(op)(*(a[0] for a in masked), *layer), np.float32)[:real]
    want = np.asarray(jax.jit(op)(*(a[0] for a in alone), *layer), np.float32)
    error = float(np.abs(got - want).max())
    assert error <= 4 * 2.0**-7 * np.abs(want).max(), (error, np.abs(want).max())
    return error


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--real", default="1,8")
    p.add_argument("--formats", default="bf16,nvfp4")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--check", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:  # small experts, bf16, CPU reference path: the inputs and the check, no timing
        bench.E, bench.H, bench.I = 16, 64, 32
        args.formats, args.repeats, args.check = "bf16", 2, True
    key = jax.random.key(0)
    rows = []
    for fmt in args.formats.split(","):
        weights = bench.make_weights(fmt, jax.random.fold_in(key, 1))
        op, layer = layer_op(fmt, weights)
        for real in (int(r) for r in args.real.split(",")):
            padded, masked, alone = step_inputs(real, args.repeats, jax.random.fold_in(key, real))
            row = {"format": fmt, "real": real, "bucket": BUCKET, "floor_us": floor_us(masked[2], real, weights)}
            if args.check:
                row["masked_vs_alone_max_error"] = check(op, layer, masked, alone, real)
            if not args.smoke:
                for name, inputs in (("padded", padded), ("masked", masked), ("alone", alone)):
                    us, kernels, _ = bench.time_calls(op, inputs, *layer)
                    row[f"{name}_us"], row[f"{name}_kernels"] = us, kernels
            rows.append(row)
            print({k: v for k, v in row.items() if not k.endswith("_kernels")}, flush=True)
    if not args.smoke:  # routing at the bucket, with and without the real count, and alone
        router = jax.random.normal(jax.random.fold_in(key, 2), (bench.E, bench.H), jnp.float32) * 0.02
        bias = jnp.zeros((bench.E,), jnp.float32)
        kwargs = dict(num_groups=bench.GROUPS, groups_kept=bench.GROUPS_KEPT, top_k=bench.TOP_K, scaling=bench.SCALING)
        for real in (int(r) for r in args.real.split(",")):
            x = bench.make_tokens(BUCKET, args.repeats, jax.random.fold_in(key, 3))[0]
            n = jnp.int32(real)
            row = {"format": "routing", "real": real, "bucket": BUCKET}
            for name, op, inputs in (
                ("padded", lambda x, r, b: rt.routing(x, r, b, **kwargs), (x,)),
                ("masked", lambda x, r, b: rt.routing(x, r, b, num_tokens=n, **kwargs), (x,)),
                ("alone", lambda x, r, b: rt.routing(x, r, b, **kwargs), (x[:, :real],)),
            ):
                row[f"{name}_us"] = bench.time_calls(op, inputs, router, bias)[0]
            rows.append(row)
            print(row, flush=True)
    print(f"\n{'format':>8} {'real':>4} {'floor_us':>9} {'padded_us':>10} {'masked_us':>10} {'alone_us':>9}")
    for r in rows:
        cells = [f"{r[k]:>10.1f}" if k in r else f"{'-':>10}" for k in ("padded_us", "masked_us", "alone_us")]
        floor = f"{r['floor_us']:>9.1f}" if "floor_us" in r else f"{'-':>9}"
        print(f"{r['format']:>8} {r['real']:>4} {floor} {' '.join(cells)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f)


if __name__ == "__main__":
    main()
