"""Decode attention for one layer (issue 5): the Pallas ragged paged-attention kernel against a plain
XLA gather implementation and against the HBM floor (KV bytes read at 4.2 TB/s).

Every sequence decodes one token at position ctx - 1 (seq_len = ctx). Shapes:
  tp8  : Beam's per-GPU TP8 shape, 6 query heads per 1 KV head, head_dim 128, bf16, page_size 64
  full : the whole model's shape, 48 query heads / 8 KV heads (a few points only)
Kinds:
  full    : every page of the context is mapped and read
  sliding : window 512; only the pages holding in-window keys are allocated, the rest of the page
            table is -1 (released), as the serving cache does; so memory and cost do not grow with ctx

Variants:
  kernel : pallas_kernels.paged_attention.ragged_paged_attention_kernel (compiled through Triton);
           it visits pages first_page .. last_page of the window/context only
  xla    : written here; gathers the sequence's pages through the page table (full: all max_pages;
           sliding: ONLY the window's ceil(512/64)+1 = 9 logical pages) into a dense [B, S, kvh, d]
           array, then masked dense attention with the module's rounding points, jitted

Timing: one jitted function runs the op `n` times in a lax.fori_loop (n is a traced argument, so
one compile serves every n); each iteration's output becomes the next iteration's queries and a
data-dependent zero is added to the page table, so XLA cannot hoist the op or the gather out of the
loop. Per-iteration time = median over repeats of wall time(n iterations) / n, with n chosen so one
repeat lasts ~target ms (host dispatch, 55-95 us, is amortized over n).

Usage (GPU):  python benchmarks/attention/decode.py --out decode.json
              python benchmarks/attention/decode.py --quick --out decode.json   (fewer points)
Smoke (CPU):  python benchmarks/attention/decode.py --smoke   (tiny shapes, interpret=True)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from pallas_kernels import paged_attention as pa  # noqa: E402

HBM_BPS = 4.2e12  # read-only streaming floor measured on the H200 (shared/GPU.md)
WINDOW = 512

SHAPES = {
    "tp8": dict(heads=6, kv_heads=1, head_dim=128),
    "full": dict(heads=48, kv_heads=8, head_dim=128),
}


# --------------------------------------------------------------------------------------------------
# XLA baseline
# --------------------------------------------------------------------------------------------------


def xla_decode_attention(queries, k_pages, v_pages, seq_lens, page_table, *, window=None):
    """Decode only (one query token per sequence, token b belongs to sequence b, at seq_len - 1).
    Gathers pages through the page table (sliding: only the window's pages), then dense masked
    attention with the reference's rounding points."""
    batch, heads, head_dim = queries.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = heads // kv_heads
    scale = head_dim**-0.5
    q_pos = seq_lens - 1  # [B]

    if window is None:
        logical = jnp.broadcast_to(jnp.arange(max_pages, dtype=jnp.int32), (batch, max_pages))
    else:
        n_win = min(pl_cdiv(window - 1, page_size) + 1, max_pages)
        first = jnp.maximum(q_pos - window + 1, 0) // page_size
        first = jnp.minimum(first, max_pages - n_win)
        logical = first[:, None] + jnp.arange(n_win, dtype=jnp.int32)[None, :]
    physical = jnp.take_along_axis(page_table, logical, axis=1)  # [B, P]
    n_pages = logical.shape[1]
    span = n_pages * page_size
    idx = jnp.maximum(physical, 0)
    keys = k_pages[idx].reshape(batch, span, kv_heads, head_dim)
    values = v_pages[idx].reshape(batch, span, kv_heads, head_dim)

    k_pos = (logical[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)).reshape(batch, span)
    mapped = jnp.repeat(physical >= 0, page_size, axis=1)
    distance = q_pos[:, None] - k_pos
    visible = (distance >= 0) & mapped
    if window is not None:
        visible &= distance < window

    q = queries.reshape(batch, kv_heads, group, head_dim)
    scores = jnp.einsum("bhgd,bkhd->bhgk", q, keys, preferred_element_type=jnp.float32)
    scores = (scores.astype(q.dtype).astype(jnp.float32) * scale).astype(q.dtype).astype(jnp.float32)
    mask = visible[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(-1, keepdims=True), probs, 0.0).astype(v_pages.dtype)
    out = jnp.einsum("bhgk,bkhd->bhgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(batch, heads, head_dim).astype(v_pages.dtype), n_pages


def pl_cdiv(a, b):
    return -(-a // b)


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def make_inputs(ctx, batch, shape, kind, page_size, dtype, seed=0):
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    max_pages = pl_cdiv(ctx, page_size)
    rng = np.random.default_rng(seed)
    if kind == "full":
        live = np.arange(max_pages)
    else:
        first_key = max(ctx - WINDOW, 0)
        live = np.arange(first_key // page_size, (ctx - 1) // page_size + 1)
    num_pages = batch * len(live)
    perm = rng.permutation(num_pages).astype(np.int32)  # scattered physical pages
    table = np.full((batch, max_pages), -1, np.int32)
    for b in range(batch):
        table[b, live] = perm[b * len(live):(b + 1) * len(live)]
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    pshape = (num_pages, page_size, kv_heads, head_dim)
    k_pages = jax.random.normal(kk, pshape, dtype)
    v_pages = jax.random.normal(kv, pshape, dtype)
    queries = jax.random.normal(kq, (batch, heads, head_dim), dtype)
    query_start = jnp.arange(batch + 1, dtype=jnp.int32)
    seq_lens = jnp.full((batch,), ctx, jnp.int32)
    return queries, k_pages, v_pages, query_start, seq_lens, jnp.asarray(table), len(live)


def kernel_pages_visited(ctx, kind, page_size):
    """Pages the kernel's loop visits per (sequence, kv head) for one decode token at ctx - 1."""
    first_key = 0 if kind == "full" else max(ctx - WINDOW, 0)
    return (ctx - 1) // page_size + 1 - first_key // page_size


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def make_loop(step):
    """step(q, page_table, *rest) -> out, out.shape == q.shape. Returns jitted loop(n, q, page_table, *rest).
    Arrays are passed as arguments (not closed over) so they are not baked into the executable."""

    @jax.jit
    def loop(n, q, page_table, *rest):
        def body(_, carry):
            q, z = carry
            out = step(q, page_table + z, *rest)
            # z is always 0 (outputs are convex combinations of N(0,1) values) but XLA cannot prove it.
            z = (jnp.abs(out[0, 0, 0].astype(jnp.float32)) > 1e30).astype(jnp.int32)
            return out, z

        out, z = lax.fori_loop(0, n, body, (q, jnp.zeros((), jnp.int32)))
        return out, z

    return loop


def time_loop(loop, q, page_table, rest, *, target_ms, repeats, max_iters):
    jax.block_until_ready(loop(1, q, page_table, *rest))  # compile + warm-up
    jax.block_until_ready(loop(2, q, page_table, *rest))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(4, q, page_table, *rest))
    est = max((time.perf_counter() - t0) / 4, 1e-6)
    n = int(min(max(target_ms * 1e-3 / est, 4), max_iters))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(n, q, page_table, *rest))
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times)) * 1e6, n


# --------------------------------------------------------------------------------------------------
# One configuration
# --------------------------------------------------------------------------------------------------


def run_config(ctx, batch, shape_name, kind, args, interpret):
    shape = SHAPES[shape_name]
    page_size = args.page_size
    dtype = jnp.bfloat16
    window = None if kind == "full" else WINDOW
    q, k_pages, v_pages, query_start, seq_lens, table, live = make_inputs(ctx, batch, shape, kind, page_size, dtype)
    kvh, d = shape["kv_heads"], shape["head_dim"]
    page_bytes = page_size * kvh * d * jnp.dtype(dtype).itemsize * 2  # K and V
    kernel_bytes = batch * kernel_pages_visited(ctx, kind, page_size) * page_bytes
    floor_us = kernel_bytes / HBM_BPS * 1e6

    def kernel_step(qq, pt, k_pages, v_pages, query_start, seq_lens):
        return pa.ragged_paged_attention_kernel(
            qq, k_pages, v_pages, query_start, seq_lens, pt, window=window,
            block_q=args.block_q, num_warps=args.num_warps, num_stages=args.num_stages, interpret=interpret,
        )

    def xla_step(qq, pt, k_pages, v_pages, query_start, seq_lens):
        return xla_decode_attention(qq, k_pages, v_pages, seq_lens, pt, window=window)[0]

    max_pages = table.shape[1]
    n_xla_pages = max_pages if window is None else min(pl_cdiv(window - 1, page_size) + 1, max_pages)
    xla_bytes = batch * n_xla_pages * page_bytes

    row = dict(context=ctx, batch=batch, shape=shape_name, heads=shape["heads"], kv_heads=kvh, head_dim=d,
               kind=kind, page_size=page_size, block_q=args.block_q, kernel_pages_per_seq=kernel_pages_visited(ctx, kind, page_size),
               xla_pages_per_seq=n_xla_pages, kv_bytes_kernel=kernel_bytes, kv_bytes_xla=xla_bytes,
               floor_us=floor_us)

    # Correctness: one iteration of each timing loop (the same executables that are timed).
    rest = (k_pages, v_pages, query_start, seq_lens)
    xla_loop, kernel_loop = make_loop(xla_step), make_loop(kernel_step)
    xla_out = jax.block_until_ready(xla_loop(1, q, table, *rest)[0])
    try:
        ker_out = jax.block_until_ready(kernel_loop(1, q, table, *rest)[0])
        row["max_abs_diff"] = float(jnp.max(jnp.abs(ker_out.astype(jnp.float32) - xla_out.astype(jnp.float32))))
    except Exception as e:  # noqa: BLE001
        row["kernel_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    if args.smoke:  # also check the XLA baseline itself against the module's reference
        ref = pa.ragged_paged_attention_reference(q, k_pages, v_pages, query_start, seq_lens, table, window=window)
        row["xla_vs_reference"] = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - xla_out.astype(jnp.float32))))

    tkw = dict(target_ms=args.target_ms, repeats=args.repeats, max_iters=args.max_iters)
    try:
        row["xla_us"], row["xla_iters"] = time_loop(xla_loop, q, table, rest, **tkw)
    except Exception as e:  # noqa: BLE001
        row["xla_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    if "kernel_error" not in row:
        try:
            row["kernel_us"], row["kernel_iters"] = time_loop(kernel_loop, q, table, rest, **tkw)
        except Exception as e:  # noqa: BLE001
            row["kernel_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
    for v in ("kernel", "xla"):
        if f"{v}_us" in row:
            row[f"{v}_pct_floor"] = 100.0 * floor_us / row[f"{v}_us"]
    if "kernel_us" in row and "xla_us" in row:
        row["speedup"] = row["xla_us"] / row["kernel_us"]
    del q, k_pages, v_pages, xla_out, rest
    return row


def fmt(row):
    def g(k, f="{:.1f}"):
        return f.format(row[k]) if k in row else "ERR"

    return (f"{row['context']:>7} {row['batch']:>5} {row['shape']:>5} {row['kind']:>8} "
            f"{g('kernel_us'):>10} {g('xla_us'):>10} {row['kv_bytes_kernel'] / 1e6:>10.2f} "
            f"{row['kv_bytes_xla'] / 1e6:>9.2f} {row['floor_us']:>9.1f} {g('kernel_pct_floor'):>7} "
            f"{g('xla_pct_floor'):>7} {g('speedup', '{:.2f}'):>7} {g('max_abs_diff', '{:.2e}'):>9}")


HEADER = (f"{'context':>7} {'batch':>5} {'shape':>5} {'kind':>8} {'kernel_us':>10} {'xla_us':>10} "
          f"{'KV_MB_ker':>10} {'KV_MB_xla':>9} {'floor_us':>9} {'ker%fl':>7} {'xla%fl':>7} {'speedup':>7} {'maxdiff':>9}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--quick", action="store_true", help="fewer points")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret=True (CPU check)")
    p.add_argument("--contexts", default=None, help="comma list, overrides the default")
    p.add_argument("--batches", default=None, help="comma list, overrides the default")
    p.add_argument("--kinds", default="full,sliding")
    p.add_argument("--no-full-shape", action="store_true", help="skip the 48/8-head points")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--block-q", type=int, default=2, help="decode: 2 tokens x 8 padded heads = 16 rows, Triton's minimum")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--target-ms", type=float, default=30.0, help="wall time of one timed repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--max-kv-gb", type=float, default=20.0, help="skip configs whose K+V exceeds this")
    p.add_argument("--time-budget-s", type=float, default=220.0, help="stop starting new configs after this")
    args = p.parse_args()

    interpret = args.smoke
    if args.smoke:
        contexts, batches = [100, 700], [1, 3]
        args.page_size = 16
        args.target_ms, args.repeats, args.max_iters = 1.0, 1, 2
        full_points = [(700, 2)]
    elif args.quick:
        contexts, batches = [1024, 8192, 32768, 131072], [1, 32]
        full_points = [(8192, 8)]
    else:
        contexts, batches = [1024, 8192, 32768, 131072], [1, 8, 32]
        full_points = [(8192, 8), (32768, 32), (131072, 1)]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    kinds = args.kinds.split(",")
    if args.no_full_shape:
        full_points = []
    if args.smoke:
        global WINDOW
        WINDOW = 40  # small window so sliding actually releases pages at smoke sizes
        SHAPES["tp8"] = dict(heads=6, kv_heads=1, head_dim=32)
        SHAPES["full"] = dict(heads=8, kv_heads=2, head_dim=32)

    # Most important points first, so a spent time budget drops the least important ones:
    # batch 1 and the largest batch at every context, then the other batches, then the 48/8 shape.
    first = [b for b in batches if b in (min(batches), max(batches))]
    order = first + [b for b in batches if b not in first]
    configs = [(c, b, "tp8", k) for b in order[:len(first)] for c in contexts for k in kinds]
    configs += [(c, b, "tp8", k) for b in order[len(first):] for c in contexts for k in kinds]
    configs += [(c, b, "full", k) for (c, b) in full_points for k in kinds]

    print(f"jax {jax.__version__} devices {jax.devices()} interpret={interpret}", flush=True)
    print(f"window {WINDOW}, page_size {args.page_size}, block_q {args.block_q}, floor at {HBM_BPS / 1e12} TB/s; "
          "XLA sliding gathers only the window's pages", flush=True)
    start = time.perf_counter()
    rows = []
    for ctx, batch, shape_name, kind in configs:
        sh = SHAPES[shape_name]
        kv_gb = 2 * batch * ctx * sh["kv_heads"] * sh["head_dim"] * 2 / 1e9 if kind == "full" else 0.0
        label = f"ctx={ctx} batch={batch} shape={shape_name} kind={kind}"
        if kv_gb > args.max_kv_gb:
            print(f"skip {label}: K+V {kv_gb:.1f} GB > {args.max_kv_gb}", flush=True)
            continue
        if time.perf_counter() - start > args.time_budget_s:
            print(f"skip {label}: time budget {args.time_budget_s}s spent", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            row = run_config(ctx, batch, shape_name, kind, args, interpret)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = dict(context=ctx, batch=batch, shape=shape_name, kind=kind, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(f"FAILED {label}: {row['error']}", flush=True)
            rows.append(row)
            continue
        row["config_wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"done {label} in {row['config_wall_s']:.1f}s: kernel {row.get('kernel_us', 'ERR')} us, "
              f"xla {row.get('xla_us', 'ERR')} us, floor {row['floor_us']:.1f} us, diff {row.get('max_abs_diff', 'ERR')}"
              + (f", xla_vs_reference {row['xla_vs_reference']:.2e}" if "xla_vs_reference" in row else ""), flush=True)
        if args.out:  # keep partial results if the run is cut short
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    print(f"\ntotal {time.perf_counter() - start:.1f}s\n")
    print(HEADER)
    for row in rows:
        if "error" in row:
            print(f"{row['context']:>7} {row['batch']:>5} {row['shape']:>5} {row['kind']:>8} FAILED {row['error'][:80]}")
        else:
            print(fmt(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"rows written to {args.out}")


if __name__ == "__main__":
    main()
