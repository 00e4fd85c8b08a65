"""Decode attention for one layer (issue 5): the split decode kernel (flash-decoding), the general
Pallas ragged paged-attention kernel and a plain XLA gather implementation, against the HBM floor
(KV bytes read at 4.2 TB/s).

Every sequence decodes one token at position ctx - 1 (seq_len = ctx). Shapes:
  tp8  : Beam's per-GPU TP8 shape, 6 query heads per 1 KV head, head_dim 128, bf16, page_size 64
  full : the whole model's shape, 48 query heads / 8 KV heads
Kinds:
  full    : every page of the context is mapped and read
  sliding : window 512; only the pages holding in-window keys are allocated, the rest of the page
            table is -1 (released), as the serving cache does; so memory and cost do not grow with ctx

Variants:
  decode-<config> : ragged_paged_attention(use_kernel=True, decode_only=True), i.e.
           paged_decode_attention_kernel (split kernel + combine kernel), one variant per
           --decode-configs entry (and per --sweep-configs entry at the --sweep-points). A config is
           "auto" (decode_blocks' tuned choice, what the model runs) or letters with numbers that
           override it: p pages per step, s splits, t programs per SM the split aims for, m minimum
           steps per split, w warps, n stages (split kernel), d the combine's head_dim block, r its
           warps (run 5's k was another, removed knob), l1 the Mosaic split kernel as a dependent launch
           (`DecodeBlocks.mosaic_dependent_launch`: only after the K/V write, --layer), g1 the
           Mosaic GPU split kernel (`decode_attention_mgpu`; n is then its TMA pipeline depth, by
           default `DECODE_MOSAIC_STAGES`), g0 the Triton one; e.g. "p2t2m1w4n1" or "s32n3g1".
           "auto" is what the model runs (`default_decode_blocks`: Mosaic on Hopper wherever it fits). The
           step's DecodeMetadata is built once, outside the timed loop, as the engine builds it once per
           step for all layers. (Run 6's letters f and c chose a one-launch
           path and its merge fan-in; it was slower at every shape and is removed.)
  old    : with --baseline-module FILE (e.g. `git show <commit>:pallas_kernels/paged_attention.py`),
           that file's decode kernels with their own default blocks: the previous kernel, same run. A
           decode_attention_mgpu.py instead (it defines `split_decode`): today's paged_attention with that
           file's Mosaic split kernel.
  kernel : ragged_paged_attention_kernel, the general kernel (one program per (query block, kv head)
           walking every visible page), block_q 2
  xla    : written here; gathers the sequence's pages through the page table (full: all max_pages;
           sliding: ONLY the window's ceil(512/64)+1 = 9 logical pages) into a dense [B, S, kvh, d]
           array, then masked dense attention with the module's rounding points, jitted

Layer mode (--layer): one attention layer's decode from the projections on, at the tp8 shape: raw
q / k / v / gate projections of the step's decode tokens in, gated attention output out, the new
token's K/V written to its page (the position of the decode) each iteration.
  layer_unfused : what the model ran before the fusion: q and k RMSNorm + RoPE (sliding) or
           + SSMax (full, q only) in plain jnp (XLA), XLA's scatter of K/V into the pages, the split
           decode kernels (the first --decode-configs entry) on the normalized q, the output gate in
           plain jnp
  layer_fused   : the model's GPU path (PagedKVCache.fuses_attention): write_kv_kernel (k norm +
           RoPE + both page rows, one Pallas call), the split decode kernel with the q norm + RoPE /
           SSMax in its prologue (for the Mosaic split kernel, the write kernel applies it instead),
           the combine with the output gate in its epilogue; on the first config, and as
           layer_fused-<config> on each further one (e.g. "g0,g1": Triton, Mosaic)
  The cos/sin tables and SSMax scale are built once per step outside the loop (the model builds them
  once per step for all layers). Also reported: the compiled step's top-level XLA ops (fusions,
  scatters, custom calls: about one launch each). Timed with the loop and, with the CUPTI timer, as
  device time too (the column "us"): there each call donates the pages to the next, as the model's
  step does, so the K/V write stays in place.

Timing (--timer): "cupti" (the default) is device time: the durations of the kernels one call
launches, summed, as CUPTI records them (jax.experimental.mosaic.gpu.profiler's collector), median
over --repeats calls, each after a 256 MiB read that evicts the 50 MB L2 (each layer's KV is cold
in a real step: the other layers and the MoE weights pass through L2 in between). Launch gaps and
host dispatch are not in it. Per-kernel times (split, combine) are kept in the rows.
"loop" (also "both"): one jitted function runs the op `n` times in a lax.fori_loop (n is a traced argument, so
one compile serves every n); each iteration's output becomes the next iteration's queries and a
data-dependent zero is added to the page table, so XLA cannot hoist the op or the gather out of the
loop. Per-iteration time = median over repeats of wall time(n iterations) / n, with n chosen so one
repeat lasts ~target ms (host dispatch, 55-95 us, is amortized over n). It includes the while loop's
own per-iteration cost on the GPU (the "loop_overhead" row: an op that only adds a constant) and a
warm L2 (KV that fits in 50 MB stays there). --time-budget-s stops
starting new configurations once spent (most important first: batch 1 and the largest batch).

Usage (GPU):  python benchmarks/attention/decode.py --time-budget-s 200 --out decode.json
Smoke (CPU):  python benchmarks/attention/decode.py --smoke   (tiny shapes, interpret=True; with a g1 config,
              pages of 64 and head_dim 128, the Mosaic kernel's smallest)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import re
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


def make_layer_inputs(ctx, batch, kind, page_size, dtype, seed=0):
    """The tp8 pages of `make_inputs` plus one decode token's raw projections per sequence, the layer's
    prologues (norm weights; RoPE tables or the SSMax scale at position ctx - 1) and the output gate."""
    shape = SHAPES["tp8"]
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q, k_pages, v_pages, query_start, seq_lens, table, live = make_inputs(ctx, batch, shape, kind, page_size, dtype, seed)
    keys = jax.random.split(jax.random.key(seed + 1), 6)
    new_k = jax.random.normal(keys[0], (batch, kv_heads, head_dim), dtype)
    new_v = jax.random.normal(keys[1], (batch, kv_heads, head_dim), dtype)
    gate = pa.OutputGate(jax.random.normal(keys[2], (batch, heads, head_dim), dtype),
                         jax.random.normal(keys[3], (heads,), dtype))
    q_weight = (1 + 0.1 * jax.random.normal(keys[4], (head_dim,))).astype(dtype)
    k_weight = (1 + 0.1 * jax.random.normal(keys[5], (head_dim,))).astype(dtype)
    position = ctx - 1
    if kind == "sliding":
        inv_freq = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
        angles = np.concatenate([position * inv_freq] * 2).astype(np.float32)
        cos = jnp.broadcast_to(jnp.cos(jnp.asarray(angles)), (batch, head_dim))
        sin = jnp.broadcast_to(jnp.sin(jnp.asarray(angles)), (batch, head_dim))
        query = pa.HeadPrologue(q_weight, 1e-6, rope_cos=cos, rope_sin=sin)
        key = pa.HeadPrologue(k_weight, 1e-6, rope_cos=cos, rope_sin=sin)
    else:
        scale = jnp.full((batch,), (1 + (position + 1) / 2048.0) ** 0.1, jnp.float32)
        query, key = pa.HeadPrologue(q_weight, 1e-6, ssmax_scale=scale), pa.HeadPrologue(k_weight, 1e-6)
    # Each sequence's decode token goes to position ctx - 1: its page's slot.
    page = np.asarray(table)[:, position // page_size]
    slots = jnp.asarray(page * page_size + position % page_size, jnp.int32)
    return q, k_pages, v_pages, query_start, seq_lens, table, live, new_k, new_v, slots, query, key, gate


def layer_step(fused, window, blocks, interpret):
    """One layer's decode (see the module docstring): (q, page_table, k_pages, v_pages, ...) -> (out, pages)."""

    def step(q, page_table, k_pages, v_pages, new_k, new_v, slots, query_start, seq_lens, metadata, query, key, gate):
        if fused:  # as PagedKVCache.attend (with the Mosaic kernel the write applies the query prologue)
            k_pages, v_pages, q, query = pa.write_kv_before_decode(k_pages, v_pages, new_k, new_v, slots, q,
                                                                   key_prologue=key, query_prologue=query,
                                                                   blocks=blocks, interpret=interpret)
        else:
            k_pages, v_pages = pa.write_kv(k_pages, v_pages, new_k, new_v, slots, key_prologue=key,
                                           interpret=interpret)
        kw = {"window": window, "use_kernel": True, "decode_only": True, "decode": metadata,
              "decode_block_sizes": blocks, "interpret": interpret}
        if fused:
            out = pa.ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, page_table,
                                            query_prologue=query, output_gate=gate, **kw)
        else:
            normed = pa.head_prologue_reference(q, query)
            out = pa.output_gate_reference(
                pa.ragged_paged_attention(normed, k_pages, v_pages, query_start, seq_lens, page_table, **kw), gate
            )
        return out, k_pages, v_pages

    return step


def top_level_ops(step, *args) -> int:
    """Top-level ops of the compiled step that launch work (fusions, custom calls, scatters, copies...):
    about the kernel launches of one call."""
    text = jax.jit(step).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    passive = ("parameter(", "constant(", "tuple(", "get-tuple-element(", "bitcast(")
    return sum(1 for line in entry.splitlines()[1:] if " = " in line and not any(op in line for op in passive))


def make_layer_loop(step):
    """Like `make_loop`, with the pages carried through the loop (the write updates them in place)."""

    @jax.jit
    def loop(n, q, page_table, k_pages, v_pages, *rest):
        def body(_, carry):
            q, k_pages, v_pages, z = carry
            out, k_pages, v_pages = step(q, page_table + z, k_pages, v_pages, *rest)
            z = (jnp.abs(out[0, 0, 0].astype(jnp.float32)) > 1e30).astype(jnp.int32)
            return out, k_pages, v_pages, z

        out, _, _, z = lax.fori_loop(0, n, body, (q, k_pages, v_pages, jnp.zeros((), jnp.int32)))
        return out, z

    return loop


def layer_variants(args) -> list[tuple[str, bool, str]]:
    """(name, fused, decode config): the unfused layer on the first config, the fused one on each."""
    first = args.decode_configs[0]
    return [("layer_unfused", False, first)] + [
        ("layer_fused" if spec == first else f"layer_fused-{spec}", True, spec) for spec in args.decode_configs]


def time_layer_on_device(timer, step, q, table, k_pages, v_pages, rest, repeats):
    """CUPTI device time of one layer call: the pages are donated and passed on from call to call, as the
    model's step does (the K/V write is in place; without donation XLA would copy the pages first)."""
    jitted = jax.jit(step, donate_argnums=(2, 3))
    pages = [jnp.copy(k_pages), jnp.copy(v_pages)]

    def call():
        out, pages[0], pages[1] = jitted(q, table, *pages, *rest)
        return out

    return timer.time(call, repeats)


def run_layer_config(ctx, batch, kind, args, interpret, timer=None):
    page_size, dtype = args.page_size, jnp.bfloat16
    window = None if kind == "full" else WINDOW
    (q, k_pages, v_pages, query_start, seq_lens, table, _, new_k, new_v, slots, query, key,
     gate) = make_layer_inputs(ctx, batch, kind, page_size, dtype)
    metadata = pa.decode_metadata(query_start, q.shape[0])
    page_bytes = page_size * 128 * jnp.dtype(dtype).itemsize * 2
    floor_us = batch * kernel_pages_visited(ctx, kind, page_size) * page_bytes / HBM_BPS * 1e6
    row = {"mode": "layer", "context": ctx, "batch": batch, "shape": "tp8", "kind": kind, "page_size": page_size,
           "floor_us": floor_us, "decode_blocks": {}}
    rest = (new_k, new_v, slots, query_start, seq_lens, metadata, query, key, gate)
    outs = {}
    for name, fused, spec in layer_variants(args):
        try:
            blocks = make_decode_blocks(spec, batch, 1, table.shape[1], page_size, window, (q, k_pages, v_pages),
                                        after_write=fused)
            row["decode_blocks"][name] = vars(blocks)
            step = layer_step(fused, window, blocks, interpret)
            row[f"{name}_ops"] = top_level_ops(step, q, table, k_pages, v_pages, *rest)
            loop = make_layer_loop(step)
            outs[name] = jax.block_until_ready(loop(1, q, table, k_pages, v_pages, *rest)[0])
            row[f"{name}_loop_us"], row[f"{name}_iters"] = time_loop(
                loop, q, table, (k_pages, v_pages, *rest), target_ms=args.target_ms, repeats=args.repeats,
                max_iters=args.max_iters,
            )
            if timer is not None:
                row[f"{name}_us"], row[f"{name}_kernels"] = time_layer_on_device(
                    timer, step, q, table, k_pages, v_pages, rest, args.repeats)
            else:
                row[f"{name}_us"] = row[f"{name}_loop_us"]
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
    for name in outs:
        if name != "layer_unfused" and "layer_unfused" in outs:
            diff = jnp.abs(outs[name].astype(jnp.float32) - outs["layer_unfused"].astype(jnp.float32))
            row[f"{name}_max_abs_diff"] = float(jnp.max(diff))
            row[f"{name}_mismatch_fraction"] = float(jnp.mean(diff > 0))
            if f"{name}_us" in row and "layer_unfused_us" in row:
                row[f"{name}_speedup"] = row["layer_unfused_us"] / row[f"{name}_us"]
    return row


def layer_main(args, contexts, batches, kinds, interpret, timer):
    print(f"jax {jax.__version__} devices {jax.devices()} interpret={interpret}; layer mode, tp8 shape, "
          f"window {WINDOW}, page_size {args.page_size}, decode configs {args.decode_configs}, "
          f"timer {'cupti' if timer else 'loop'}", flush=True)
    start, rows = time.perf_counter(), []
    for batch in batches:
        for ctx in contexts:
            for kind in kinds:
                label = f"ctx={ctx} batch={batch} kind={kind}"
                if time.perf_counter() - start > args.time_budget_s:
                    print(f"skip {label}: time budget {args.time_budget_s}s spent", flush=True)
                    continue
                t0 = time.perf_counter()
                row = run_layer_config(ctx, batch, kind, args, interpret, timer)
                row["config_wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print(f"done {label} in {row['config_wall_s']:.1f}s: {row}", flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    print(f"\ntotal {time.perf_counter() - start:.1f}s\n")
    print("us = microseconds per layer call (median; device time with the CUPTI timer, else the loop's); ops = "
          "top-level XLA ops of one compiled call; speedup, maxdiff and mismatch are against the unfused layer")
    print(f"{'context':>7} {'batch':>5} {'kind':>8} {'floor_us':>8} {'variant':>24} {'us':>8} {'loop_us':>8} "
          f"{'ops':>4} {'speedup':>7} {'maxdiff':>9} {'mismatch':>8}")
    for r in rows:
        for name, _, _ in layer_variants(args):
            def g(k, f="{:.1f}", r=r, name=name):
                return f.format(r[f"{name}_{k}"]) if f"{name}_{k}" in r else "-"

            print(f"{r['context']:>7} {r['batch']:>5} {r['kind']:>8} {r['floor_us']:>8.1f} {name:>24} {g('us'):>8} "
                  f"{g('loop_us'):>8} {g('ops', '{}'):>4} {g('speedup', '{:.2f}'):>7} {g('max_abs_diff', '{:.2e}'):>9} "
                  f"{g('mismatch_fraction', '{:.1e}'):>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"rows written to {args.out}")


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


CONFIG_LETTERS = {"p": "pages_per_step", "s": "num_splits", "t": "programs_per_sm", "m": "min_steps_per_split",
                  "w": "num_warps", "n": "num_stages", "d": "combine_block_d", "r": "combine_num_warps",
                  "g": "mosaic_split", "l": "mosaic_dependent_launch"}


_CONFIG_FLAGS = ("mosaic_split", "mosaic_dependent_launch")  # g, l: 0 or 1
# Blocks `decode_blocks` does not choose: set on the blocks it returns.
_CONFIG_AFTER = ("combine_block_d", "combine_num_warps", "mosaic_dependent_launch")


def parse_decode_config(spec: str) -> dict:
    """"auto" -> {}; "p1t2w4n2" -> {"pages_per_step": 1, "programs_per_sm": 2, ...} (see the docstring)."""
    if spec == "auto":
        return {}
    parts = re.fullmatch(r"(?:[a-z]\d+)+", spec) and re.findall(r"([a-z])(\d+)", spec)
    if not parts or any(letter not in CONFIG_LETTERS for letter, _ in parts):
        raise ValueError(f"bad decode config {spec!r}: 'auto' or letters {sorted(CONFIG_LETTERS)} with numbers")
    config = {CONFIG_LETTERS[letter]: int(number) for letter, number in parts}
    return {name: bool(value) if name in _CONFIG_FLAGS else value for name, value in config.items()}


def make_decode_blocks(spec: str, batch, kv_heads, max_pages, page_size, window, arrays=None, after_write=False):
    """`arrays` (queries, k_pages, v_pages): "auto" is then what the model runs (`default_decode_blocks`; with
    `after_write`, as right after the K/V write kernel)."""
    if spec == "auto" and arrays is not None:
        return pa.default_decode_blocks(*arrays, batch, max_pages, window, after_write=after_write)
    kwargs = parse_decode_config(spec)
    after = {name: kwargs.pop(name) for name in _CONFIG_AFTER if name in kwargs}
    blocks = pa.decode_blocks(batch, kv_heads, max_pages, page_size, window, **kwargs)
    return dataclasses.replace(blocks, **after)


def decode_config_name(spec):
    return f"decode-{spec}"


def _load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_baseline_module(path):
    """The 'old' paged_attention: the file at `path`, or, for a decode_attention_mgpu.py, a fresh copy of today's
    paged_attention that runs that file's split kernel."""
    module = _load_module(path, "baseline_paged_attention")
    if hasattr(module, "split_decode"):  # a split kernel: a copy of today's paged_attention around it
        if "dependent_launch" not in inspect.signature(module.split_decode).parameters:  # older than 6a667fe
            split_decode = module.split_decode

            def without_dependent_launch(*args, dependent_launch=False, **kwargs):
                if dependent_launch:
                    raise ValueError(f"{path}'s split_decode has no dependent launch")
                return split_decode(*args, **kwargs)

            module.split_decode = without_dependent_launch
        paged_attention = _load_module(pa.__file__, "baseline_paged_attention")
        paged_attention.decode_attention_mgpu = module
        return paged_attention
    return module


class CuptiTimer:
    """Device time of one call: its kernels' durations summed (CUPTI activity records, through the
    collector jax.experimental.mosaic.gpu.profiler uses), each call after an L2-evicting read."""

    def __init__(self, flush_bytes=256 * 2**20):
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        self.ext = mosaic_gpu_lib._mosaic_gpu_ext
        # A read, not a write: a written buffer would leave 50 MB of dirty lines in L2 for the timed
        # kernels to write back.
        self.buffer = jnp.ones((flush_bytes // 4,), jnp.float32)
        self.flush = jax.jit(jnp.max)
        self.sink = jax.block_until_ready(self.flush(self.buffer))
        self._record(lambda: None, 1)
        t0 = time.perf_counter()
        flush = self._record(lambda: None, 1)  # a second session: they must chain
        self.flush_kernels, self.flush_us = len(flush), sum(ms for _, ms in flush) * 1e3
        print(f"CUPTI timer: the L2 flush is {self.flush_kernels} kernel(s), {self.flush_us:.1f} us; one session "
              f"took {time.perf_counter() - t0:.3f}s", flush=True)

    def _record(self, call, repeats):
        self.ext._cupti_init()
        try:
            out = None
            for _ in range(repeats):
                self.sink = self.flush(self.buffer)
                out = call()
            jax.block_until_ready((out, self.sink))
        finally:
            timings = self.ext._cupti_get_timings(False)  # stay attached: the next session starts cheaper
        return list(timings or [])

    def time(self, call, repeats):
        """-> (median µs of the call's kernels, [(kernel, µs), ...] of the median call)."""
        jax.block_until_ready(call())  # compile + warm-up
        timings = self._record(call, repeats)
        per_call = len(timings) // repeats
        if per_call * repeats != len(timings) or per_call <= self.flush_kernels:  # odd record: the mean
            total = sum(ms for _, ms in timings) * 1e3 / repeats - self.flush_us
            return total, [(f"unsplit ({len(timings)} kernels)", total)]
        calls = [timings[i * per_call + self.flush_kernels:(i + 1) * per_call] for i in range(repeats)]
        totals = [sum(ms for _, ms in c) * 1e3 for c in calls]
        median = sorted(range(repeats), key=lambda i: totals[i])[repeats // 2]
        return float(np.median(totals)), [(name, ms * 1e3) for name, ms in calls[median]]


def run_config(ctx, batch, shape_name, kind, args, interpret, timer=None, baseline=None):
    shape = SHAPES[shape_name]
    page_size = args.page_size
    dtype = jnp.bfloat16
    window = None if kind == "full" else WINDOW
    q, k_pages, v_pages, query_start, seq_lens, table, live = make_inputs(ctx, batch, shape, kind, page_size, dtype)
    kvh, d = shape["kv_heads"], shape["head_dim"]
    page_bytes = page_size * kvh * d * jnp.dtype(dtype).itemsize * 2  # K and V
    kernel_bytes = batch * kernel_pages_visited(ctx, kind, page_size) * page_bytes
    floor_us = kernel_bytes / HBM_BPS * 1e6
    max_pages = table.shape[1]
    # Built once per step by the engine and shared by every layer: outside the timed loop here too.
    metadata = pa.decode_metadata(query_start, q.shape[0])

    specs = list(args.decode_configs)
    sweep = kind == "full" and (ctx, batch) in args.sweep_points
    if sweep:
        specs += [c for c in args.sweep_configs if c not in specs]
    steps = {}
    for spec in specs:
        blocks = make_decode_blocks(spec, batch, kvh, max_pages, page_size, window, (q, k_pages, v_pages))

        def decode_step(qq, pt, k_pages, v_pages, query_start, seq_lens, metadata, blocks=blocks):
            return pa.ragged_paged_attention(
                qq, k_pages, v_pages, query_start, seq_lens, pt, window=window, use_kernel=True, decode_only=True,
                decode=metadata, decode_block_sizes=blocks, interpret=interpret,
            )

        name = decode_config_name(spec)
        if any(b == blocks for _, b in steps.values()):  # same blocks as an earlier config: time once
            continue
        steps[name] = (decode_step, blocks)

    if baseline is not None:
        old_metadata = baseline.decode_metadata(query_start, q.shape[0])

        def old_step(qq, pt, k_pages, v_pages, query_start, seq_lens, metadata):
            return baseline.ragged_paged_attention(
                qq, k_pages, v_pages, query_start, seq_lens, pt, window=window, use_kernel=True, decode_only=True,
                decode=old_metadata, interpret=interpret,
            )

        steps["old"] = (old_step, None)
        for spec in args.baseline_configs if sweep else []:  # the old kernel with the new configs' blocks
            b = make_decode_blocks(spec, batch, kvh, max_pages, page_size, window)
            # The fields the old DecodeBlocks has (an older one may lack `mosaic_split`).
            old_blocks = baseline.DecodeBlocks(**{f.name: getattr(b, f.name)
                                                  for f in dataclasses.fields(baseline.DecodeBlocks)})

            def old_config_step(qq, pt, k_pages, v_pages, query_start, seq_lens, metadata, old_blocks=old_blocks):
                return baseline.ragged_paged_attention(
                    qq, k_pages, v_pages, query_start, seq_lens, pt, window=window, use_kernel=True,
                    decode_only=True, decode=old_metadata, decode_block_sizes=old_blocks, interpret=interpret,
                )

            steps[f"old-{spec}"] = (old_config_step, None)

    def kernel_step(qq, pt, k_pages, v_pages, query_start, seq_lens, metadata):
        return pa.ragged_paged_attention_kernel(
            qq, k_pages, v_pages, query_start, seq_lens, pt, window=window,
            block_q=args.block_q, num_warps=4, num_stages=2, interpret=interpret,
        )

    def xla_step(qq, pt, k_pages, v_pages, query_start, seq_lens, metadata):
        return xla_decode_attention(qq, k_pages, v_pages, seq_lens, pt, window=window)[0]

    if "kernel" in args.variants:
        steps["kernel"] = (kernel_step, None)
    steps["xla"] = (xla_step, None)  # always: the correctness baseline

    n_xla_pages = max_pages if window is None else min(pl_cdiv(window - 1, page_size) + 1, max_pages)
    row = dict(context=ctx, batch=batch, shape=shape_name, heads=shape["heads"], kv_heads=kvh, head_dim=d,
               kind=kind, page_size=page_size, block_q=args.block_q, timer=args.timer,
               kernel_pages_per_seq=kernel_pages_visited(ctx, kind, page_size), xla_pages_per_seq=n_xla_pages,
               kv_bytes_kernel=kernel_bytes, kv_bytes_xla=batch * n_xla_pages * page_bytes, floor_us=floor_us,
               decode_blocks={name: vars(b) for name, (_, b) in steps.items() if b is not None})

    rest = (k_pages, v_pages, query_start, seq_lens, metadata)
    jitted = {name: jax.jit(step) for name, (step, _) in steps.items()}
    xla_out = jax.block_until_ready(jitted["xla"](q, table, *rest))
    if args.smoke:  # also check the XLA baseline itself against the module's reference
        ref = pa.ragged_paged_attention_reference(q, k_pages, v_pages, query_start, seq_lens, table, window=window)
        row["xla_vs_reference"] = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - xla_out.astype(jnp.float32))))
    tkw = dict(target_ms=args.target_ms, repeats=args.repeats, max_iters=args.max_iters)
    for name, (step, _) in steps.items():
        try:
            if name != "xla":
                out = jax.block_until_ready(jitted[name](q, table, *rest))
                diff = jnp.abs(out.astype(jnp.float32) - xla_out.astype(jnp.float32))
                row[f"{name}_max_abs_diff"] = float(jnp.max(diff))
            if timer is not None:
                us, kernels = timer.time(lambda f=jitted[name]: f(q, table, *rest), args.repeats)
                row[f"{name}_us"], row[f"{name}_kernels"] = us, kernels
            if args.timer in ("loop", "both"):
                key = f"{name}_us" if timer is None else f"{name}_loop_us"
                row[key], row[f"{name}_iters"] = time_loop(make_loop(step), q, table, rest, **tkw)
                row[key.replace("_us", "_pct_floor")] = 100.0 * floor_us / row[key]
            row[f"{name}_pct_floor"] = 100.0 * floor_us / row[f"{name}_us"]
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
    decodes = [n for n in steps if n.startswith("decode") and f"{n}_us" in row]
    if decodes:
        best = min(decodes, key=lambda n: row[f"{n}_us"])
        row["decode_best"], row["decode_us"] = best, row[f"{best}_us"]
        row["decode_pct_floor"] = row[f"{best}_pct_floor"]
        if "xla_us" in row:
            row["decode_speedup_vs_xla"] = row["xla_us"] / row["decode_us"]
        if "old_us" in row:
            row["decode_speedup_vs_old"] = row["old_us"] / row["decode_us"]
        if "kernel_us" in row:
            row["decode_speedup_vs_kernel"] = row["kernel_us"] / row["decode_us"]
    del q, k_pages, v_pages, xla_out, rest
    return row


def fmt(row, names):
    def g(k, f="{:.1f}"):
        return f.format(row[k]) if k in row else "-"

    cells = "".join(f" {g(n + '_us'):>10} {g(n + '_pct_floor'):>6}" for n in names)
    worst_diff = max((row[k] for k in row if k.endswith("_max_abs_diff")), default=float("nan"))
    return (f"{row['context']:>7} {row['batch']:>5} {row['shape']:>5} {row['kind']:>8} {row['floor_us']:>8.1f}"
            f"{cells} {row.get('decode_best', '-')[7:]:>14} {g('decode_speedup_vs_xla', '{:.2f}'):>7}"
            f" {g('decode_speedup_vs_old', '{:.2f}'):>7} {worst_diff:>9.2e}")


def header(names):
    cells = "".join(f" {n + '_us':>10} {'%fl':>6}" for n in names)
    return (f"{'context':>7} {'batch':>5} {'shape':>5} {'kind':>8} {'floor_us':>8}{cells} {'best':>14} "
            f"{'dec/xla':>7} {'dec/old':>7} {'maxdiff':>9}")


def kernel_split(row, name):
    """'split+combine' µs of a decode variant (from the CUPTI per-kernel record)."""
    kernels = row.get(f"{name}_kernels")
    if not kernels:
        return "-"
    return "+".join(f"{us:.1f}" for _, us in kernels)


def print_sweep(rows):
    for row in rows:
        variants = sorted((n[:-3] for n in row if n.startswith(("decode-", "old-")) and n.endswith("_us")
                           and not n.endswith("_loop_us")), key=lambda n: row[n + "_us"])
        if len(variants) <= 3:
            continue
        print(f"\nsweep ctx={row['context']} batch={row['batch']} {row['shape']} {row['kind']}: floor {row['floor_us']:.1f} us"
              + "".join(f", {n} {row[n + '_us']:.1f} us ({kernel_split(row, n)})" for n in ("old", "xla") if n + "_us" in row))
        for n in variants:
            b = row["decode_blocks"].get(n.replace("old-", "decode-"), {})
            print(f"  {n:>22} {row[n + '_us']:8.1f} us {row[n + '_pct_floor']:5.1f} %  kernels {kernel_split(row, n):>14}"
                  f"  pps {b.get('pages_per_step')} splits {b.get('num_splits')} warps {b.get('num_warps')}"
                  f" stages {b.get('num_stages')} combine_d {b.get('combine_block_d')}"
                  f" combine_warps {b.get('combine_num_warps')}"
                  f"  maxdiff {row.get(n + '_max_abs_diff', float('nan')):.1e}")


def loop_overhead_row(args):
    """The timing loop's own per-iteration cost on this machine: an op that adds a constant to q."""
    q = jnp.zeros((32, 6, 128), jnp.bfloat16)
    us, iters = time_loop(make_loop(lambda qq, pt: qq + 1), q, jnp.zeros((1, 1), jnp.int32), (),
                          target_ms=args.target_ms, repeats=args.repeats, max_iters=args.max_iters)
    return {"mode": "loop_overhead", "loop_us": us, "iters": iters}


def main():
    global WINDOW
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--quick", action="store_true", help="fewer points")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret=True (CPU check)")
    p.add_argument("--contexts", default=None, help="comma list, overrides the default")
    p.add_argument("--batches", default=None, help="comma list, overrides the default")
    p.add_argument("--points", default=None, help="tp8 points CTXxBATCH, comma list: overrides contexts x batches")
    p.add_argument("--full-points", default=None, help="48/8-head points CTXxBATCH, comma list ('' for none)")
    p.add_argument("--kinds", default="full,sliding")
    p.add_argument("--no-full-shape", action="store_true", help="skip the 48/8-head points")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--block-q", type=int, default=2, help="general kernel: 2 tokens x 8 padded heads = 16 rows, Triton's minimum")
    p.add_argument("--decode-configs", default="auto", help="decode kernel configs to time, comma list (see the docstring)")
    p.add_argument("--sweep-points", default="", help="full-attention points CTXxBATCH (both shapes) that also time --sweep-configs")
    p.add_argument("--sweep-configs", default="", help="more decode configs, timed at --sweep-points only")
    p.add_argument("--baseline-module", default=None, help="a paged_attention.py whose decode kernels are timed as 'old'")
    p.add_argument("--baseline-configs", default="", help="decode configs the 'old' kernel also runs with (as old-<config>)")
    p.add_argument("--variants", default="", help="besides decode and xla: 'kernel' (the general kernel) or ''")
    p.add_argument("--timer", default="cupti", choices=["cupti", "loop", "both"])
    p.add_argument("--target-ms", type=float, default=30.0, help="loop timer: wall time of one timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--max-kv-gb", type=float, default=20.0, help="skip configs whose K+V exceeds this")
    p.add_argument("--time-budget-s", type=float, default=220.0, help="stop starting new configs after this")
    p.add_argument("--layer", action="store_true",
                   help="one attention layer's decode, fused vs unfused prologue/gate (tp8; default contexts "
                        "8192,32768, batches 1,8)")
    args = p.parse_args()
    args.decode_configs = args.decode_configs.split(",")
    args.sweep_configs = [c for c in args.sweep_configs.split(",") if c]
    args.baseline_configs = [c for c in args.baseline_configs.split(",") if c]
    for spec in args.decode_configs + args.sweep_configs:
        parse_decode_config(spec)
    points = lambda text: [tuple(int(x) for x in pt.split("x")) for pt in text.split(",") if pt]
    args.sweep_points = points(args.sweep_points)
    args.variants = [v for v in args.variants.split(",") if v]
    baseline = load_baseline_module(args.baseline_module) if args.baseline_module else None

    interpret = args.smoke
    # The Mosaic GPU kernel takes pages and heads of multiples of 64 only: smoke runs keep Beam's there.
    mosaic = any(parse_decode_config(spec).get("mosaic_split") for spec in args.decode_configs + args.sweep_configs)
    if args.smoke:
        contexts, batches = [100, 700], [1, 3]
        args.page_size = 64 if mosaic else 16
        args.target_ms, args.repeats, args.max_iters = 1.0, 1, 2
        args.timer = "loop"
        full_points = [(700, 2)]
    elif args.quick:
        contexts, batches = [1024, 8192, 32768, 131072], [1, 32]
        full_points = [(c, b) for b in batches for c in contexts]
    else:
        contexts, batches = [1024, 8192, 32768, 131072], [1, 8, 32]
        full_points = [(c, b) for b in (1, 32, 8) for c in contexts]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    kinds = args.kinds.split(",")
    timer = None
    if args.timer != "loop":
        try:
            timer = CuptiTimer()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print("CUPTI timer unavailable: timing with the loop instead", flush=True)
            args.timer = "loop"
    if args.layer:
        if not args.contexts:
            contexts = [100, 700] if args.smoke else [8192, 32768]
        if not args.batches:
            batches = [1, 3] if args.smoke else [1, 8]
        if args.smoke:
            WINDOW = 40
        return layer_main(args, contexts, batches, kinds, interpret, timer)
    if args.no_full_shape:
        full_points = []
    if args.full_points is not None:
        full_points = points(args.full_points)
    if args.smoke:
        full_points = [(700, 2), (100, 3)]
        WINDOW = 40  # small window so sliding actually releases pages at smoke sizes
        if not mosaic:
            SHAPES["tp8"] = dict(heads=6, kv_heads=1, head_dim=32)
            SHAPES["full"] = dict(heads=8, kv_heads=2, head_dim=32)

    if args.points:
        # In the order given; the sweep points (if listed) first.
        tp8_points = points(args.points)
        tp8_points = [pt for pt in tp8_points if pt in args.sweep_points] + [pt for pt in tp8_points if pt not in args.sweep_points]
        configs = [(c, b, "tp8", k) for c, b in tp8_points for k in kinds]
        configs += [(c, b, "full", k) for c, b in full_points for k in kinds]
    else:
        # Most important points first, so a spent time budget drops the least important ones:
        # batch 1 and the largest batch at every context, then the other batches, then the 48/8 shape.
        first = [b for b in batches if b in (min(batches), max(batches))]
        order = first + [b for b in batches if b not in first]
        configs = [(c, b, "tp8", k) for b in order[:len(first)] for c in contexts for k in kinds]
        configs += [(c, b, "full", k) for (c, b) in full_points if b in first for k in kinds]
        configs += [(c, b, "tp8", k) for b in order[len(first):] for c in contexts for k in kinds]
        configs += [(c, b, "full", k) for (c, b) in full_points if b not in first for k in kinds]

    print(f"jax {jax.__version__} devices {jax.devices()} interpret={interpret} timer={args.timer}", flush=True)
    print(f"window {WINDOW}, page_size {args.page_size}, block_q {args.block_q}, floor at {HBM_BPS / 1e12} TB/s; "
          "XLA sliding gathers only the window's pages", flush=True)
    names = [decode_config_name(c) for c in args.decode_configs] + (["old"] if baseline else []) + args.variants + ["xla"]
    start = time.perf_counter()
    rows = []
    if args.timer in ("loop", "both") and not args.smoke:
        rows.append(loop_overhead_row(args))
        print(f"loop overhead: {rows[-1]['loop_us']:.1f} us per iteration", flush=True)
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
            row = run_config(ctx, batch, shape_name, kind, args, interpret, timer=timer, baseline=baseline)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = dict(context=ctx, batch=batch, shape=shape_name, kind=kind, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(f"FAILED {label}: {row['error']}", flush=True)
            rows.append(row)
            continue
        row["config_wall_s"] = time.perf_counter() - t0
        rows.append(row)
        times = ", ".join(f"{k[:-3]} {row[k]:.1f}" for k in row if k.endswith("_us") and k not in ("floor_us", "decode_us"))
        diffs = max((row[k] for k in row if k.endswith("_max_abs_diff")), default=float("nan"))
        errors = [k for k in row if k.endswith("_error")]
        print(f"done {label} in {row['config_wall_s']:.1f}s: floor {row['floor_us']:.1f} us; {times}; "
              f"worst diff vs xla {diffs:.1e}" + (f"; ERRORS {errors}" if errors else "")
              + (f", xla_vs_reference {row['xla_vs_reference']:.2e}" if "xla_vs_reference" in row else ""), flush=True)
        if args.out:  # keep partial results if the run is cut short
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    print(f"\ntotal {time.perf_counter() - start:.1f}s")
    print_sweep([r for r in rows if "floor_us" in r and "error" not in r])
    print(f"\nus = microseconds per call ({args.timer}); %fl = % of the HBM floor; best = fastest decode config; "
          "dec/xla, dec/old = its speed-up")
    print(header(names))
    for row in rows:
        if "error" in row:
            print(f"{row['context']:>7} {row['batch']:>5} {row['shape']:>5} {row['kind']:>8} FAILED {row['error'][:80]}")
        elif "floor_us" in row:
            print(fmt(row, names))
    if args.timer == "both":
        print("\nloop timer (us per iteration, % floor):")
        for row in rows:
            if "floor_us" in row:
                print(f"{row['context']:>7} {row['batch']:>5} {row['shape']:>5} {row['kind']:>8}" + "".join(
                    f" {n} {row[n + '_loop_us']:.1f} ({row[n + '_loop_pct_floor']:.0f}%)" for n in names if n + "_loop_us" in row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"rows written to {args.out}")


if __name__ == "__main__":
    main()
