"""MoE layer and routing at Beam's TP8 per-GPU shape (issue 4): our Pallas kernels against XLA
`ragged_dot`, a gather+einsum path and JAX's `ragged_dot_mgpu`, in one run, with the HBM floor.

Shape: 256 experts, hidden 5120, expert intermediate 320 (Beam's 2560 / TP8), top-8 of 8 groups
keeping 4, routed scaling 2.5. Weights are random, generated on the device:
  bf16        gate_up [256, 640, 5120] + down [256, 5120, 320]
  fp8         e4m3 values + fp32 per-channel scales
  nvfp4       packed uint8 nibbles + e4m3 block scales (per 16) + fp32 global scale
Tokens pick 8 distinct random experts each (fresh ids for every repeat, so L2 holds no experts).

Variants (MoE layer = both GEMMs, SwiGLU, routing-weight combine; routing excluded):
  pallas      pallas_kernels.moe_gemm.moe_gemm_kernel (block sizes from choose_blocks unless swept)
  pallas_packed, pallas_packed[n..,k..,dn..,dk..,s..]
              nvfp4 only: the same kernels with the "packed" NVFP4 decode (PTX, permuted activations,
              block scales once per 16 values), with choose_blocks' sizes for it and, at T <= 64, two
              alternatives (gate/up N and K block, down N and K block, K splits)
  ragged_dot  XLA: pairs sorted by expert, lax.ragged_dot_general twice; quantized formats are
              dequantized to bf16 first (the model's reference path)
  gather      XLA: every pair gathers its expert's (dequantized) weights, then einsum (T <= 64)
  mgpu        JAX's Mosaic GPU ragged_dot_mgpu for both GEMMs (bf16 only), pairs sorted in XLA
  mosaic      nvfp4: pallas_kernels.nvfp4_moe_mgpu.moe_nvfp4 (our Mosaic GPU GEMM, weights decoded
              in the wgmma registers; weights repacked once before timing, as at load time);
              bf16 at T >= 512: pallas_kernels.bf16_moe_mgpu.moe_bf16 (TMA + wgmma prefill GEMM);
              mosaic_sort (1 < T <= 64): the same with sorted blocks instead of its default ones (shared
              rows up to 8 tokens, opened by the pairs up to 64). Timed by `time_calls`
              (no wall time); with `--timer spans`, where the layer is the one-launch kernel (1-7 tokens; 8 on an H100),
              also mosaic_counters_passed: its counters passed from call to call, as the model's layers
              pass them (`PagedBatch.moe_counters`; a lone call zeroes fresh ones first)
Routing: pallas_kernels.routing.routing_kernel against the jitted plain-jnp reference; with `--timer spans` also
`pallas_state_passed`, the fused kernel with its state passed from call to call as the model's layers pass it (a
lone call fills a fresh one first).

Timing (`--timer cupti`, the default): each variant runs R times on R different inputs inside one jitted
function; the figure is the sum of its kernels' device times per call measured with CUPTI
(jax.experimental.mosaic.gpu.profiler.measure), i.e. without host dispatch and launch gaps. The
wall time of the same jitted chain divided by R is printed beside it (it includes launch gaps and
~1/R of one host dispatch). CUPTI's sum counts a programmatic dependent launch's waiting (the NVFP4
layer's GEMMs at 9-64 tokens) and leaves out the gaps between kernels: `--timer spans` times every
variant and routing as the span of a call's kernels on the device instead (`time_spans`; no wall time,
no separate per-kernel breakdown: each row's `kernels_us` comes from the span's trace).
Floor: bytes of the touched experts' weights (and scales) / 4.2 TB/s (read streaming, GPU.md);
at T=8192 the compute floor at 676 TFLOP/s (bf16 dense, GPU.md) is shown too.

Usage (GPU): python3 benchmarks/moe/bench.py --out moe.json [--tokens 1,8,64] [--formats bf16,nvfp4]
             [--sweep] [--check] [--timer spans]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from pallas_kernels import moe_gemm as mg  # noqa: E402
from pallas_kernels import routing as rt  # noqa: E402

HBM_BPS = 4.2e12
START = time.time()
DEADLINE_S = [float("inf")]
SPANS = [False]  # --timer spans


def past_deadline() -> bool:
    return time.time() - START > DEADLINE_S[0]

BF16_FLOPS = 676e12
E, H, I, TOP_K, GROUPS, GROUPS_KEPT, SCALING = 256, 5120, 320, 8, 8, 4, 2.5


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def make_weights(fmt: str, key):
    kg, kd, ks, kt = jax.random.split(key, 4)
    if fmt == "bf16":
        gate_up = (jax.random.normal(kg, (E, 2 * I, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
        down = (jax.random.normal(kd, (E, H, I), jnp.float32) * 0.02).astype(jnp.bfloat16)
        return (mg.ExpertWeights(gate_up, rows=I), mg.ExpertWeights(gate_up, row_offset=I, rows=I),
                mg.ExpertWeights(down))

    def one(k, n, kk):
        k1, k2, k3 = jax.random.split(k, 3)
        if fmt == "fp8":
            values = jnp.clip(jax.random.normal(k1, (E, n, kk), jnp.float32) * 100, -448, 448).astype(jnp.float8_e4m3fn)
            scale = jax.random.uniform(k2, (E, n), jnp.float32, 1e-4, 3e-4)
            return mg.ExpertWeights(values, scale, format="fp8_channel")
        packed = jax.random.bits(k1, (E, n, kk // 2), jnp.uint8)
        block = jax.random.uniform(k2, (E, n, kk // 16), jnp.float32, 0.5, 4).astype(jnp.float8_e4m3fn)
        return mg.ExpertWeights(packed, block, jax.random.uniform(k3, (E,), jnp.float32, 1e-3, 2e-3), format="nvfp4")

    return one(kg, I, H), one(ks, I, H), one(kd, H, I)


def expert_bytes(gate, up, down) -> float:
    """Bytes of ONE expert's three projections (values + scales)."""
    return sum(sum(a.nbytes for a in w.arrays()) / E * (w.num_rows / w.values.shape[1]) for w in (gate, up, down))


def make_tokens(t: int, repeats: int, key):
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (repeats, t, H), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ki, (repeats, t, E)), axis=-1)[..., :TOP_K].astype(jnp.int32)
    w = jax.random.uniform(kw, (repeats, t, TOP_K), jnp.float32, 0.1, 1.0)
    return x, w / w.sum(-1, keepdims=True) * SCALING, ids


# --------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------


def _sorted_pairs(ids):
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=E).astype(jnp.int32)


def _combine(out_sorted, order, weights, tokens):
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
    out = out.astype(jnp.float32) * weights.reshape(-1, 1)
    return out.reshape(tokens, TOP_K, -1).sum(1).astype(jnp.bfloat16)


def ragged_dot_layer(x, weights, ids, gate, up, down):
    g, u, d = gate.dequantize(x.dtype), up.dequantize(x.dtype), down.dequantize(x.dtype)
    order, sizes = _sorted_pairs(ids)
    xs = x[order // TOP_K]
    dims = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    gu = lax.ragged_dot_general(xs, jnp.concatenate([g, u], 1) if gate.format != "bf16" else gate.values, sizes, dims)
    act = mg._swiglu(gu[:, :I], gu[:, I:]).astype(x.dtype)
    return _combine(lax.ragged_dot_general(act, d, sizes, dims), order, weights, x.shape[0])


def mgpu_layer(x, weights, ids, gate, up, down, *, block_m=64, block_n=128, block_k=64):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    order, sizes = _sorted_pairs(ids)
    xs = x[order // TOP_K]
    rd = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, block_m=block_m, block_n=block_n,
                           block_k=block_k, max_concurrent_steps=2, grid_block_n=1, transpose_rhs=True)
    gu = rd(xs, gate.values)  # gate.values is the fused [E, 2I, H]
    act = mg._swiglu(gu[:, :I], gu[:, I:]).astype(x.dtype)
    return _combine(rd(act, down.values), order, weights, x.shape[0])


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def chain(op):
    """jit(f(stacked inputs, *rest)) running op once per leading index, returning every output. A Pallas kernel's
    sliced input is first copied by XLA inside the jit (a `memcpy` kernel), which leaves it in L2 for the kernel:
    the routing kernel's 5 MB router so (5.66 µs against 6.5 read from HBM, H200 session 32 run 2). `time_spans`
    slices outside the jit."""

    def run(stacked, *rest):
        outs = []
        for r in range(jax.tree_util.tree_leaves(stacked)[0].shape[0]):
            outs.append(op(*jax.tree_util.tree_map(lambda a: a[r], stacked), *rest))
        return outs

    return jax.jit(run)


def time_chain(fn, stacked, *rest, repeats: int, wall: bool = True):
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(stacked, *rest))
    walls = []
    for _ in range(3 if wall else 0):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(stacked, *rest))
        walls.append(time.perf_counter() - t0)
    flush_l2()
    _, kernel_ms = profiler.measure(fn)(stacked, *rest)
    return kernel_ms * 1e3 / repeats, (min(walls) * 1e6 / repeats if walls else float("nan"))


def time_variant(op, stacked, *rest, repeats: int, wall: bool = True, carry=None):
    """(µs per call, wall µs or NaN, the first call's kernels as (name, µs) or None) of `op(*stacked[r], *rest)`
    over the leading index r: `time_chain` of an unrolled chain, or with `--timer spans` `time_spans` (which
    alone takes a `carry`)."""
    if SPANS[0]:
        us, kernels, _ = time_spans(op, stacked, *rest, carry=carry)
        return us, float("nan"), [(name, kernel_us) for name, kernel_us, _ in kernels]
    if carry is not None:
        raise ValueError("a carry passed from call to call needs --timer spans")
    return (*time_chain(chain(op), stacked, *rest, repeats=repeats, wall=wall), None)


BF16_MOSAIC_MIN_TOKENS = 512  # the bf16 Mosaic layer is a prefill kernel (blocks of 128 rows)


def mosaic_layout(gate, up, down):
    """NVFP4 gate/up and down in the Mosaic kernel's layouts (`KernelNvfp4`), repacked by one jitted
    call (op by op it would compile a hundred small programs)."""
    from pallas_kernels import nvfp4_moe_mgpu as nmm

    return jax.jit(nmm.kernel_experts)(gate, up, down)


def time_calls(op, stacked, *rest):
    """CUPTI device time of `jit(op)` called once per leading index of `stacked` (different inputs, so
    weights come from HBM): (mean µs per call, the first call's kernels as (name, µs), the first call's
    output). Unlike `chain`, the function is compiled once: an unrolled chain compiles every call site
    of a Mosaic or Triton kernel on its own (a minute or more per variant), and a scan adds slicing
    kernels that CUPTI counts. Uses the CUPTI hooks behind `profiler.measure`, which calls with the same
    inputs each time."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    fn = jax.jit(op)
    repeats = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    calls = [jax.tree_util.tree_map(lambda a, r=r: a[r], stacked) for r in range(repeats)]
    first = jax.block_until_ready(fn(*calls[0], *rest))  # compile and warm up
    flush_l2()
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        jax.block_until_ready([fn(*args, *rest) for args in calls])
    finally:
        timings = ext._cupti_get_timings(True)
    per_call = len(timings) // len(calls)
    if per_call * len(calls) != len(timings):
        raise RuntimeError(f"{len(timings)} kernel launches for {len(calls)} calls")
    mean_us = sum(ms for _, ms in timings) * 1e3 / len(calls)
    return mean_us, [(name, ms * 1e3) for name, ms in timings[:per_call]], first


def _traced_device_kernels(run) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of the device's kernels (and copies) while `run()` runs, from a profiler trace,
    sorted by start."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
        gpus = [plane for plane in data.planes if plane.name.startswith("/device:GPU")]
        events = [(e.start_ns, e.end_ns, e.name) for plane in gpus for line in plane.lines
                  if line.name.startswith("Stream") for e in line.events]
        if not events:
            raise RuntimeError(f"no kernels on a stream line: planes {[p.name for p in data.planes]}, "
                               f"GPU lines {[line.name for plane in gpus for line in plane.lines]}")
    return sorted(events)


SEPARATOR_ITERATIONS = 400_000  # a dependent FMA chain; at ~4 cycles a step ~1 ms (an estimate: not timed)


def _spin_kernel(seed_ref, out_ref, *, iterations: int):
    out_ref[...] = lax.fori_loop(0, iterations, lambda _, v: v * 0.999 + 0.001, seed_ref[...])[None, :]


def separator(seed, iterations: int = SEPARATOR_ITERATIONS, interpret: bool = False):
    """What `time_spans` queues before each timed call: one kernel named `spans_separator` that spins in registers
    (no memory traffic, so L2 keeps what the calls left there; the name no layer's kernel has: a matmul separator
    was also the name of cuBLAS GEMMs and memsets inside the T = 512 and 8192 layers, session 28).
    `seed [128] f32`. (A separator that streamed memory instead, so that each call found the HBM busy, made the
    routing kernel no faster and let the next call's first XLA kernel start during its tail: H200, session 31.)"""
    from jax.experimental.pallas import triton as plgpu

    return pl.pallas_call(
        functools.partial(_spin_kernel, iterations=iterations), grid=(132,),
        in_specs=[pl.BlockSpec((128,), lambda i: (0,))], out_specs=pl.BlockSpec((1, 128), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((132, 128), jnp.float32), name="spans_separator",
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1), interpret=interpret)(seed)


L2_FLUSH_BYTES = 1 << 28  # 256 MiB read: more than the H200's 50 MB L2


def flush_l2():
    """Reads more bytes than L2 holds, so that no input of a timed call is left there from the warm-up call (until
    session 31 the first timed call of `time_spans` and `time_calls` found them there: at one token the NVFP4
    layer's 22 MB and the routing kernel's 5 MB router, so its kernels, which rows show, were an L2-warm call's,
    and so was 1 / repeats of the mean). A read, not a write, as benchmarks/attention's flush: written lines would
    be left dirty in L2 for the first call to write back (session 31's runs 3-6 wrote 128 MiB so); the buffer is
    made once, so no fill writes it before each read."""
    jax.block_until_ready(_max(_flush_buffer()))


@functools.cache
def _flush_buffer():
    return jax.block_until_ready(jnp.ones((L2_FLUSH_BYTES // 4,), jnp.float32))


_max = jax.jit(jnp.max)


def jitted_caller(op, num_args: int, rest, carry=None):
    """`call(args)`: `jit(op)(*args, *rest)`; with a `carry`, `op`'s last argument and last output, passed from
    call to call (donated: no call copies it) and left off the outputs."""
    if carry is None:
        fn = jax.jit(op)
        return lambda args: fn(*args, *rest)
    fn, state = jax.jit(op, donate_argnums=num_args + len(rest)), [carry]

    def call(args):
        *out, state[0] = fn(*args, *rest, state[0])
        return out

    return call


def time_spans(op, stacked, *rest, carry=None):
    """Device time of `jit(op)` per call as the span of its kernels, first start to last end, from a profiler
    trace: unlike `time_calls` (CUPTI's summed kernel durations) it counts the gaps between a call's kernels
    and counts kernels that overlap (programmatic dependent launch) once. Each call is queued behind
    `separator`, so its kernels wait on the device, not on the host's launches; `flush_l2` before the first.
    Returns (mean span µs, the first call's kernels as (name, µs, start µs after the call's first kernel), the
    first call's output), as `time_calls` does. Not in a process that has used `time_calls`: the two CUPTI users
    clash (H200 session 26: "activity records were dropped").
    `carry`: state passed from call to call, as a model passes it from layer to layer (the routing kernel's
    state): `op(*stacked[r], *rest, carry)` returns its outputs and the next carry last; the carry is
    donated, so no call copies it."""
    a, busy = jnp.ones((128,), jnp.float32), jax.jit(separator)
    repeats = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    calls = [jax.tree_util.tree_map(lambda a, r=r: a[r], stacked) for r in range(repeats)]
    call = jitted_caller(op, len(calls[0]), rest, carry)
    output = jax.block_until_ready(call(calls[0]))  # compile and warm up
    jax.block_until_ready(busy(a))
    busy_names = {name for _, _, name in _traced_device_kernels(lambda: jax.block_until_ready(busy(a)))
                  if "spans_separator" in name}
    if not busy_names:
        raise RuntimeError("no spans_separator kernel in the separator's trace")
    flush_l2()

    def run():
        jax.block_until_ready([(busy(a), call(args)) for args in calls])

    mean_us, kernels = call_spans(_traced_device_kernels(run), busy_names, repeats)
    return mean_us, kernels, output


def call_spans(events, separators, calls: int):
    """`time_spans`' arithmetic: `events` (start ns, end ns, name) sorted by start, the calls' kernels between
    kernels named in `separators` -> (mean span µs, the first call's kernels as (name, µs, start µs))."""
    groups, current = [], []
    for start, end, name in [*events, (None, None, None)]:
        if name is None or name in separators:
            if current:
                groups.append(current)
            current = []
        else:
            current.append((start, end, name))
    if len(groups) != calls:
        raise RuntimeError(f"{len(groups)} groups of kernels for {calls} calls: {[len(g) for g in groups]}, "
                           f"separated by {sorted(separators)}")
    mean_us = sum(max(e for _, e, _ in g) - min(b for b, _, _ in g) for g in groups) / len(groups) / 1e3
    first = groups[0][0][0]
    return mean_us, [(name, (e - b) / 1e3, (b - first) / 1e3) for b, e, name in groups[0]]


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def decodes(fmt):
    """The NVFP4 decodes to check and time (None: choose_blocks' default)."""
    return {"pallas": None, "pallas_packed": "packed"} if fmt == "nvfp4" else {"pallas": None}


def check_moe(fmt, weights, key, rows):
    gate = weights[0]
    for t in (1, 5, 16, 64, 300):
        x, w, ids = make_tokens(t, 1, jax.random.fold_in(key, t))
        want = jax.jit(mg.moe_gemm_reference)(x[0], w[0], ids[0], *weights)
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        checked = {name: mg.choose_blocks(t, TOP_K, E, H, I, gate.format, nvfp4_decode=decode)
                   for name, decode in decodes(fmt).items()}
        for name, blocks in checked.items():
            try:
                got = jax.jit(functools.partial(mg.moe_gemm_kernel, blocks=blocks))(x[0], w[0], ids[0], *weights)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"check moe {fmt} T={t} {name}: {type(e).__name__}: {e}"[:600], flush=True)
                continue
            err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
            rows.append(dict(kind="check_moe", format=fmt, tokens=t, variant=name, max_abs_err=err, max_abs_ref=scale))
            print(f"check moe {fmt:6s} {name:14s} T={t:4d} max|err|={err:.3g} max|ref|={scale:.3g}", flush=True)


def packed_alternatives(t, default: mg.MoEBlocks):
    """Two other block shapes for the packed NVFP4 decode at decode sizes (splits as choose_blocks)."""
    if t > 64:
        return {}
    used = min(E, t * TOP_K)
    out = {}
    for n1, k1, n2, k2 in ((32, 256, 64, 128), (64, 128, 128, 64)):
        splits = max(1, min(pl_cdiv(H, k1) // 2, mg._TARGET_PROGRAMS // (used * pl_cdiv(I, n1))))
        cfg = dataclasses.replace(default, gate_up_n=n1, gate_up_k=k1, gate_up_splits=splits, down_n=n2, down_k=k2)
        out[f"pallas_packed[n{n1},k{k1},dn{n2},dk{k2},s{splits}]"] = cfg
    return out


def pl_cdiv(a, b):
    return -(-a // b)


def check_routing(rows, tokens=100_000):
    """Selections on `tokens` random tokens. Exact-grid inputs make the logits exact in fp32 in any
    summation order, so the kernel must agree bit for bit; plain random inputs are reported too."""
    key = jax.random.key(7)
    kx, kw, kb = jax.random.split(key, 3)
    kw_args = dict(num_groups=GROUPS, groups_kept=GROUPS_KEPT, top_k=TOP_K, scaling=SCALING)
    cases = {
        "exact_grid": (
            (jax.random.randint(kx, (tokens, H), -8, 9) / 16).astype(jnp.bfloat16),
            jax.random.randint(kw, (E, H), -128, 129).astype(jnp.float32) / 2.0**16,
            jax.random.randint(kb, (E,), -64, 65).astype(jnp.float32) / 2.0**10,
        ),
        "random": (
            jax.random.normal(kx, (tokens, H), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(kw, (E, H), jnp.float32) * 0.02,
            jax.random.normal(kb, (E,), jnp.float32) * 0.1,
        ),
    }
    for name, (x, w, b) in cases.items():
        logits = jax.jit(functools.partial(rt.routing_kernel, logits_only=True, **kw_args))(x, w, b)
        want = jnp.einsum("th,eh->te", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
        logit_err = float(jnp.abs(logits - want).max())
        ref_w, ref_i = jax.jit(functools.partial(rt.routing_reference, **kw_args))(x, w, b)
        for fused in (False, True):
            got_w, got_i = jax.jit(functools.partial(rt.routing_kernel, fused=fused, **kw_args))(x, w, b)
            differ = int(jnp.any(got_i != ref_i, axis=1).sum())
            werr = float(jnp.abs(got_w - ref_w).max())
            rows.append(dict(kind="check_routing", inputs=name, fused=fused, tokens=tokens, tokens_differing=differ,
                             max_weight_err=werr, max_logit_err=logit_err))
            print(f"check routing {name} fused={fused}: {differ} of {tokens} tokens select differently; "
                  f"max|w err|={werr:.3g}; max|logit err|={logit_err:.3g}", flush=True)
            for t in (1, 3):  # the GEMV path (the 100k tokens above take the dot path)
                got_w, got_i = jax.jit(functools.partial(rt.routing_kernel, fused=fused, **kw_args))(x[:t], w, b)
                differ = int(jnp.any(got_i != ref_i[:t], axis=1).sum())
                rows.append(dict(kind="check_routing", inputs=name, fused=fused, tokens=t, tokens_differing=differ))
                print(f"check routing {name} fused={fused} T={t}: {differ} of {t} tokens select differently",
                      flush=True)


def _routing_state_passed(x, router_weight, correction_bias, state, **kw_args):
    """The fused routing kernel with its state passed in and back (`routing_kernel(state=)`), as the model's layers
    pass it on (`PagedBatch.routing_state`): no call fills a fresh one."""
    return rt.routing_kernel(x, router_weight, correction_bias, state=state, **kw_args)


def bench_routing(token_counts, rows, *, sweep: bool, repeats=16):
    from jax.experimental.mosaic.gpu import profiler

    kw_args = dict(num_groups=GROUPS, groups_kept=GROUPS_KEPT, top_k=TOP_K, scaling=SCALING)
    key = jax.random.key(3)
    weights = jax.random.normal(key, (repeats, E, H), jnp.float32) * 0.02  # 16 x 5 MB: not in L2
    bias = jax.random.normal(key, (E,), jnp.float32) * 0.1
    for t in token_counts:
        if past_deadline():
            continue
        variants = {"pallas": rt.routing_kernel, "xla": rt.routing_reference,
                    "pallas_two_kernels": functools.partial(rt.routing_kernel, fused=False),
                    **{f"pallas_fused[w{w}]": functools.partial(rt.routing_kernel, fused=True, num_warps=w)
                       for w in (1, 2, 4)}}
        if sweep and t == 1:  # the fused kernel's logits tiles: (experts, K block, K splits, stages, warps); the
            # tiles of one or two warps a program (the last program's selection in fewer warps) were slower (H200,
            # session 32 run 1: 6.67-8.77 against 6.47 us, with the ticket counter the kernel had then)
            for block_e, block_k, splits, stages, warps in (
                    (4, 1024, 5, 1, 4), (4, 1024, 5, 2, 4), (4, 1024, 5, 1, 2), (4, 1024, 5, 1, 8), (2, 1024, 5, 1, 4),
                    (4, 512, 10, 1, 4), (8, 512, 10, 1, 4), (2, 2048, 3, 1, 4), (8, 256, None, 2, 4),
                    (2, 1024, 5, 1, 1), (2, 1024, 5, 1, 2), (2, 512, 10, 1, 1), (1, 1024, 5, 1, 1), (1, 512, 10, 1, 1),
                    (2, 256, 20, 1, 1)):
                tile = dict(fused=True, block_e=block_e, block_k=block_k, splits=splits, num_stages=stages,
                            num_warps=warps)
                name = f"[e{block_e},k{block_k},s{splits},st{stages},w{warps}]"
                variants[f"pallas_fused{name}"] = functools.partial(rt.routing_kernel, **tile)
                if SPANS[0]:
                    variants[f"pallas_state_passed{name}"] = functools.partial(_routing_state_passed, **tile)
        if sweep:  # tiles of the logits kernel (token block, expert block, programs, K splits)
            tilings = ([(1, 1, 256, 1), (1, 2, 128, 1), (1, 4, 64, 1), (1, 4, 256, None), (1, 8, 256, None),
                        (1, 8, 512, None), (1, 16, 256, None)] if t == 1 else
                       [(bt, be, 256, None) for bt in (2, 4, 8) for be in (8, 16) if bt <= mg._next_pow2(t)]
                       + [(16, 32, 256, None), (16, 16, 512, None)])
            for block_t, block_e, programs, splits in tilings:
                variants[f"pallas[t{block_t},e{block_e},p{programs},s{splits}]"] = functools.partial(
                    rt.routing_kernel, block_t=block_t, block_e=block_e, target_programs=programs, splits=splits)
        if SPANS[0] and t <= rt.KERNEL_MAX_TOKENS:  # as the model calls it: the state passed on, never filled
            variants["pallas_state_passed"] = _routing_state_passed
        x = jax.random.normal(jax.random.fold_in(key, t), (repeats, t, H), jnp.float32).astype(jnp.bfloat16)
        res = {}
        breakdown = {}
        for name, op in [("warm-up", rt.routing_kernel), *variants.items()]:  # (the first timing runs slow)
            carry = rt.routing_state() if name.startswith("pallas_state_passed") else None
            try:
                *res[name], kernels = time_variant(functools.partial(op, **kw_args), (x, weights), bias,
                                                   repeats=repeats, wall=not sweep, carry=carry)
                if kernels is not None and name in ("pallas", "pallas_state_passed", "xla"):
                    breakdown[f"{name}_kernels_us"] = [(n[:40], round(us, 2)) for n, us in kernels]
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"routing {name} T={t}: {type(e).__name__}: {e}"[:400], flush=True)
        for name in ("pallas", "xla") if not SPANS[0] else ():  # per-kernel device times (CUPTI) of one call
            single = jax.jit(functools.partial(variants[name], **kw_args))
            _, kernels = profiler.measure(single, aggregate=False)(x[0], weights[0], bias)
            breakdown[f"{name}_kernels_us"] = [(n[:40], round(ms * 1e3, 2)) for n, ms in kernels]
        floor = (E * H * 4 + t * H * 2) / HBM_BPS * 1e6
        res.pop("warm-up", None)
        row = dict(kind="routing", tokens=t, floor_us=floor, **{f"{k}_us": v[0] for k, v in res.items()},
                   **{f"{k}_wall_us": v[1] for k, v in res.items()}, **breakdown)
        rows.append(row)
        print(json.dumps(row), flush=True)


def sweep_configs(t, default: mg.MoEBlocks):
    """A few block-size variants around the default for one token count."""
    if default.nvfp4_decode == "packed":
        yield from packed_sweep_configs(t, default)
        return

    def cfg(source, bm, n1, k1, splits, n2, warps=4, stages=3):
        return mg.MoEBlocks(source, bm, n1, k1, splits, n2, 64, warps, stages)

    a = default.gate_up_splits
    if t <= 64:
        sources = ([("ids", max(16, mg._next_pow2(t)))] if t <= 32 else []) + ([("sorted", 16)] if t >= 8 else [])
        if t == 64:
            sources.append(("sorted", 32))
        for source, bm in sources:
            yield cfg(source, bm, 32, 64, a, 64)
            yield cfg(source, bm, 64, 64, max(1, a // 2), 64)
            yield cfg(source, bm, 32, 128, max(1, a // 2), 64)
            yield cfg(source, bm, 32, 64, 2 * a, 128)
            if t <= 8:
                yield cfg(source, bm, 16, 64, a, 64)
                yield cfg(source, bm, 32, 64, max(1, a // 2), 32)
    elif t <= 1024:
        for bm, n1, n2 in ((32, 64, 64), (64, 64, 64), (64, 128, 128), (64, 64, 128)):
            yield cfg("sorted", bm, n1, 64, 1, n2)
    else:
        for bm, n1, n2, warps in ((64, 64, 64, 4), (128, 64, 64, 4), (128, 128, 128, 8), (64, 128, 128, 4)):
            yield cfg("sorted", bm, n1, 64, 1, n2, warps)


def packed_sweep_configs(t, default: mg.MoEBlocks):
    """The packed NVFP4 decode around its default: fewer / more K splits (at decode sizes the
    default's programs run as few as 2 K steps), pipeline depths, and other tile shapes. Every tile
    holds >= 512 bytes (the PTX takes 4 bytes per thread at 4 warps)."""
    packed = functools.partial(dataclasses.replace, default)
    if t > 64:
        shapes = ((64, 128, 64, 128, 3), (128, 128, 128, 64, 3), (64, 256, 128, 128, 2))
        configs = [packed(gate_up_n=n1, gate_up_k=k1, down_n=n2, down_k=k2, num_stages=stages)
                   for n1, k1, n2, k2, stages in shapes]
    else:
        a = default.gate_up_splits
        configs = [packed(gate_up_splits=splits) for splits in (max(1, a // 4), max(1, a // 2), 2 * a)]
        configs += [packed(num_stages=stages) for stages in (1, 2, 4)]
        configs.append(packed(gate_up_splits=max(1, a // 2), num_stages=2))
        for n1, k1, n2, k2 in ((32, 256, 64, 128), (128, 64, 256, 32), (64, 256, 128, 128)):
            splits = max(1, min(pl_cdiv(H, k1) // 2, mg._TARGET_PROGRAMS // (min(E, t * TOP_K) * pl_cdiv(I, n1))))
            configs.append(packed(gate_up_n=n1, gate_up_k=k1, gate_up_splits=splits, down_n=n2, down_k=k2))
    yield from (c for c in dict.fromkeys(configs) if c != default)


def bench_moe(fmt, weights, token_counts, rows, *, sweep: bool, baselines: bool):
    from jax.experimental.mosaic.gpu import profiler

    gate, up, down = weights
    per_expert = expert_bytes(gate, up, down)
    mosaic_weights = None
    if fmt == "nvfp4":  # the Mosaic GPU layer takes its weights repacked once (load time)
        from pallas_kernels import nvfp4_fused_moe as nfm
        from pallas_kernels import nvfp4_moe_mgpu as nmm

        mosaic_weights = mosaic_layout(gate, up, down)
    elif fmt == "bf16":  # the prefill layer takes the fused gate_up [E, 2I, H] and down as they are
        from pallas_kernels import bf16_moe_mgpu as bm

        mosaic_weights = (gate.values, down.values)
    for t in token_counts:
        if past_deadline():
            print(f"moe {fmt} T={t}: skipped (deadline)", flush=True)
            continue
        repeats = 2 if t >= 512 else 4
        x, w, ids = make_tokens(t, repeats, jax.random.key(t))
        touched = float(np.mean([len(np.unique(np.asarray(ids[r]))) for r in range(repeats)]))
        floor = touched * per_expert / HBM_BPS * 1e6
        flops = 2 * t * TOP_K * 3 * H * I
        default = mg.choose_blocks(t, TOP_K, E, H, I, gate.format)
        kernel_blocks = {name: mg.choose_blocks(t, TOP_K, E, H, I, gate.format, nvfp4_decode=decode)
                         for name, decode in decodes(fmt).items()}
        if "pallas_packed" in kernel_blocks:
            kernel_blocks.update(packed_alternatives(t, kernel_blocks["pallas_packed"]))
        variants = {name: functools.partial(mg.moe_gemm_kernel, blocks=b) for name, b in kernel_blocks.items()}
        if sweep:
            for cfg in sweep_configs(t, default):
                variants[f"pallas[{cfg.source},m{cfg.block_m},n{cfg.gate_up_n},k{cfg.gate_up_k},s{cfg.gate_up_splits},"
                         f"dn{cfg.down_n},dk{cfg.down_k},w{cfg.num_warps},st{cfg.num_stages}]"] = functools.partial(
                    mg.moe_gemm_kernel, blocks=cfg)
        if fmt == "bf16" and t >= BF16_MOSAIC_MIN_TOKENS:
            variants["mosaic"] = lambda xx, ww, ii, mw: bm.moe_bf16(xx, ww, ii, *mw)
        if fmt == "nvfp4":  # these take the kernel-layout weights (timed by `time_calls`)
            variants["mosaic"] = lambda xx, ww, ii, mw: nmm.moe_nvfp4(xx, ww, ii, *mw)
            if SPANS[0] and nmm.default_config(t)["fused"]:
                variants["mosaic_counters_passed"] = (
                    lambda xx, ww, ii, mw, counters: nmm.moe_nvfp4(xx, ww, ii, *mw, counters=counters))
            if 1 < t <= 64:
                variants["mosaic_sort"] = lambda xx, ww, ii, mw: nmm.moe_nvfp4(xx, ww, ii, *mw, block_builder="sort")
        if baselines:
            variants["ragged_dot"] = ragged_dot_layer
            if t <= 64:
                variants["gather"] = mg.moe_gemm_reference
            if fmt == "bf16":
                variants["mgpu"] = mgpu_layer
        res, breakdowns = {}, {}
        for name, op in variants.items():
            try:
                if name.startswith("mosaic") and not SPANS[0]:
                    res[name] = (time_calls(op, (x, w, ids), mosaic_weights)[0], float("nan"))
                else:
                    rest = (mosaic_weights,) if name.startswith("mosaic") else (gate, up, down)
                    carry = nfm.fresh_counters() if name == "mosaic_counters_passed" else None
                    *res[name], kernels = time_variant(op, (x, w, ids), *rest, repeats=repeats, wall=not sweep,
                                                       carry=carry)
                    if kernels is not None:
                        breakdowns[name] = kernels
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"moe {fmt} T={t} {name}: {type(e).__name__}: {e}"[:600], flush=True)
        for name in decodes(fmt):  # per-kernel device times (CUPTI) of one call of each decode's default blocks
            if name not in res or SPANS[0]:
                continue
            try:
                single = jax.jit(functools.partial(mg.moe_gemm_kernel, blocks=kernel_blocks[name]))
                _, kernels = profiler.measure(single, aggregate=False)(x[0], w[0], ids[0], gate, up, down)
                breakdowns[name] = [(n, ms * 1e3) for n, ms in kernels]
            except Exception as e:  # noqa: BLE001
                print(f"breakdown {name}: {type(e).__name__}: {e}"[:300], flush=True)
        for name, (kernel_us, wall_us) in res.items():
            row = dict(kind="moe", format=fmt, tokens=t, variant=name, kernel_us=kernel_us, wall_us=wall_us,
                       floor_us=floor, pct_floor=100 * floor / kernel_us, touched_experts=touched,
                       tflops=flops / kernel_us / 1e6,
                       speedup_vs_ragged_dot=res["ragged_dot"][0] / kernel_us if "ragged_dot" in res else None)
            if name in kernel_blocks:
                row["blocks"] = kernel_blocks[name].__dict__
            if name in breakdowns:
                row["kernels_us"] = [(n, round(us, 2)) for n, us in breakdowns[name]]
            rows.append(row)
        pallas = {k: v[0] for k, v in res.items() if k.startswith("pallas")}
        best = min(pallas, key=pallas.get) if pallas else None
        print(f"moe {fmt} T={t}: floor {floor:.1f} us; " + "; ".join(
            f"{k} {v[0]:.1f}" for k, v in res.items() if not k.startswith("pallas[")) +
            (f"; best {best} {pallas[best]:.1f}" if best else "") + "".join(
            f"; kernels {name} {[(n[:40], round(us, 1)) for n, us in b]}" for name, b in breakdowns.items()),
            flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,8,16,32,64,512,8192")
    parser.add_argument("--formats", default="bf16,fp8,nvfp4")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--no-routing", action="store_true")
    parser.add_argument("--routing-sweep", action="store_true", help="routing tile variants (without --sweep)")
    parser.add_argument("--no-timing", default="", help="formats to check but not time")
    parser.add_argument("--routing-tokens", default="", help="token counts of the routing table (default --tokens)")
    parser.add_argument("--out", default="moe.json")
    parser.add_argument("--deadline-s", type=float, default=float("inf"), help="skip what would start later")
    parser.add_argument("--timer", choices=("cupti", "spans"), default="cupti",
                        help="cupti: summed kernel times (and wall times); spans: each call's kernels' span")
    args = parser.parse_args()
    DEADLINE_S[0] = args.deadline_s
    SPANS[0] = args.timer == "spans"
    token_counts = [int(t) for t in args.tokens.split(",")]
    args.routing_tokens = [int(t) for t in args.routing_tokens.split(",") if t]
    rows = [dict(kind="meta", device=str(jax.devices()[0]), jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                 argv=sys.argv[1:], timer=args.timer)]
    def stage(fn, *a, **k):
        if past_deadline():
            print(f"{fn.__name__}: skipped (deadline)", flush=True)
            return
        try:
            fn(*a, **k)
        except Exception:  # noqa: BLE001 - keep what was measured, go on with the next stage
            traceback.print_exc(limit=3)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)

    if args.check and not args.no_routing:
        stage(check_routing, rows)
    if not args.no_routing:
        stage(bench_routing, args.routing_tokens or token_counts, rows, sweep=args.sweep or args.routing_sweep)
    for fmt in filter(None, args.formats.split(",")):
        weights = make_weights(fmt, jax.random.key(11))
        if args.check:
            stage(check_moe, fmt, weights, jax.random.key(5), rows)
        if fmt in args.no_timing.split(","):
            continue
        stage(bench_moe, fmt, weights, token_counts, rows, sweep=args.sweep, baselines=not args.no_baselines)
        del weights
    print_table(rows)


def print_table(rows):
    bf16 = {r["tokens"]: r["kernel_us"] for r in rows
            if r["kind"] == "moe" and r["format"] == "bf16" and r["variant"] == "pallas"}
    print("\n| format | T | variant | kernel µs | wall µs | floor µs | % floor | TFLOP/s | × vs ragged_dot "
          "| × vs bf16 pallas |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "moe" and not r["variant"].startswith("pallas["):
            sp = r["speedup_vs_ragged_dot"] or float("nan")
            vs_bf16 = bf16[r["tokens"]] / r["kernel_us"] if r["tokens"] in bf16 else float("nan")
            print(f"| {r['format']} | {r['tokens']} | {r['variant']} | {r['kernel_us']:.1f} | {r['wall_us']:.1f} | "
                  f"{r['floor_us']:.1f} | {r['pct_floor']:.0f} | {r['tflops']:.0f} | {sp:.1f} | {vs_bf16:.2f} |")
    for r in rows:
        if r["kind"] == "check_moe":
            print(f"check {r['format']} {r.get('variant', 'pallas')} T={r['tokens']}: "
                  f"max|err| {r['max_abs_err']:.3g} / max|ref| {r['max_abs_ref']:.3g}")
    for r in rows:
        if r["kind"] == "routing":
            print(r)


if __name__ == "__main__":
    main()
