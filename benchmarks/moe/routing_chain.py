"""Routing at one token across layers: the fused kernel's state passed from layer to layer
(`routing_kernel(state=)`, as `PagedBatch.routing_state` does in the model) against a fresh state filled for
every call (the kernel's default), timed as spans (`bench.time_spans`).

Each timed call routes `--layers` tokens, one per layer, each with its own router (fp32 [256, 5120]),
in one jitted function; the figure is µs per layer. Both variants check their selections against the
plain-jnp reference. Each layer's token and router are sliced out of stacked arrays inside the jitted call,
which adds copies to both variants (H200, session 28: a 2.5-4 µs `memcpy128` a layer): compare the two
variants, not a layer's figure with the model's.

Usage (GPU): python3 benchmarks/moe/routing_chain.py [--layers 4] [--out routing-chain.json]
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
import bench  # noqa: E402 (puts the repository on the path)
from pallas_kernels import routing as rt  # noqa: E402

KW_ARGS = dict(num_groups=bench.GROUPS, groups_kept=bench.GROUPS_KEPT, top_k=bench.TOP_K, scaling=bench.SCALING)


def layers_copied(xs, ws, bias):
    """Every layer's routing with its own fresh state (filled per call)."""
    return [rt.routing_kernel(x, w, bias, **KW_ARGS) for x, w in zip(xs, ws)]


def layers_chained(xs, ws, bias):
    """The state made once and passed from layer to layer."""
    state, out = rt.routing_state(), []
    for x, w in zip(xs, ws):
        weights, ids, state = rt.routing_kernel(x, w, bias, state=state, **KW_ARGS)
        out.append((weights, ids))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", default="routing-chain.json")
    args = parser.parse_args()
    bench.SPANS[0] = True
    key = jax.random.key(5)
    shape = (args.repeats, args.layers)
    ws = jax.random.normal(key, (*shape, bench.E, bench.H), jnp.float32) * 0.02  # 20 MB a call: not in L2
    xs = jax.random.normal(jax.random.fold_in(key, 1), (*shape, 1, bench.H), jnp.float32).astype(jnp.bfloat16)
    bias = jax.random.normal(jax.random.fold_in(key, 2), (bench.E,), jnp.float32) * 0.1
    reference = jax.jit(functools.partial(rt.routing_reference, **KW_ARGS))
    rows = []
    for name, op in (("copied", layers_copied), ("chained", layers_chained), ("copied again", layers_copied)):
        us, kernels, out = bench.time_spans(op, (xs, ws), bias)
        for layer, (weights, ids) in enumerate(out):
            want_w, want_i = reference(xs[0, layer], ws[0, layer], bias)
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_i))
            np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-6, atol=1e-7)
        row = dict(variant=name, layers=args.layers, us_per_call=us, us_per_layer=us / args.layers,
                   kernels=[(n[:40], round(k_us, 2), round(start, 2)) for n, k_us, start in kernels])
        rows.append(row)
        print(f"{name}: {us:.2f} us for {args.layers} layers ({us / args.layers:.2f} a layer); kernels "
              f"{[(n[:14], round(k_us, 2)) for n, k_us, _ in kernels]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
