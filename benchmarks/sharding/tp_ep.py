"""Decode-step time of one GPU vs tensor parallel vs expert parallel, and TP/EP logits vs one GPU.

    python benchmarks/sharding/tp_ep.py --layers 4 --batches 1,32,128 --out tp_ep.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sharding/tp_ep.py --smoke

`beam-tp8-slice` with `--layers` layers (3 dense + the rest MoE: 256 experts 320 wide), bf16
random weights drawn on the device (router fp32). One step = the forward of B sequences of one
token each, without a KV cache (attention sees only that token), so it times what TP and EP
split: the weights. On one GPU the MoE is the Pallas kernel; on a mesh every device runs the
plain-jnp reference on its share (`beam_jax.sharding.experts_on_mesh`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np

from beam_jax.config import preset
from beam_jax.model import abstract_flat, jit_forward, params_from_flat
from beam_jax.sharding import make_mesh, shard_params, sharded_forward


def random_params(config, dtype, seed=0):
    arrays = {}
    for i, (name, leaf) in enumerate(abstract_flat(config, dtype).items()):
        if name.endswith("norm.weight"):
            arrays[name] = jnp.ones(leaf.shape, leaf.dtype)
        elif name.endswith(("bias", "e_score_correction_bias")):
            arrays[name] = jnp.zeros(leaf.shape, leaf.dtype)
        else:
            key = jax.random.fold_in(jax.random.key(seed), i)
            arrays[name] = (0.02 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)
    return params_from_flat(config, arrays)


def time_steps(fn, params, tokens, positions, iters):
    out = fn(params, tokens, positions).logits.block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(params, tokens, positions).logits
    out.block_until_ready()
    return (time.perf_counter() - start) / iters, np.asarray(out[:, -1], np.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="beam-tiny, CPU devices")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="float32: exact-math comparison (XLA matmuls at HIGHEST precision, not TF32)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    if dtype == jnp.float32:
        jax.config.update("jax_default_matmul_precision", "highest")  # the Pallas kernels use it for fp32 already
    if args.smoke:
        config, dtype = preset("beam-tiny").replace(num_key_value_heads=4, num_attention_heads=8), jnp.float32
    else:
        config = preset("beam-tp8-slice", num_hidden_layers=args.layers)
    params = random_params(config, dtype)
    n = len(jax.devices())
    layouts = {"1 device": None, f"tp{min(n, 2)}": make_mesh(tp=min(n, 2)), f"ep{min(n, 2)}": make_mesh(ep=min(n, 2))}
    rows = []
    for batch in map(int, args.batches.split(",")):
        tokens = jnp.asarray(np.random.default_rng(batch).integers(16, config.vocab_size, (batch, 1)), jnp.int32)
        positions = jnp.zeros((batch, 1), jnp.int32)
        reference = None
        for name, mesh in layouts.items():
            if mesh is None:
                fn = lambda p, t, q: jit_forward(p, t, q, config=config)
                placed = params
            else:
                fn, placed = sharded_forward(mesh, config), shard_params(params, mesh, config)
            seconds, logits = time_steps(fn, placed, tokens, positions, args.iters)
            if reference is None:
                reference = logits
            rel = float(np.abs(logits - reference).max() / np.abs(reference).max())
            same_argmax = float((logits.argmax(-1) == reference.argmax(-1)).mean())
            rows.append({"batch": batch, "layout": name, "step_ms": seconds * 1e3, "logits_rel_err_vs_1": rel,
                         "argmax_agreement_vs_1": same_argmax})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| batch | layout | step ms | logits rel. err vs 1 device | argmax agreement |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['layout']} | {r['step_ms']:.2f} | {r['logits_rel_err_vs_1']:.2e} | "
              f"{r['argmax_agreement_vs_1']:.3f} |")
    if args.out:
        meta = {"devices": [d.device_kind for d in jax.devices()], "jax": jax.__version__, "layers": args.layers,
                "dtype": dtype.name}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
