"""The device kernels of one engine decode step, as the server runs it: which kernels a step launches,
in order, and how long each takes (CUPTI), for each page size asked for. A view of the whole model's
step where the other benchmarks time one layer or one kernel.

Each engine (`--page-sizes`, default 64 and 16: the GPU default, which takes the Mosaic decode kernel
for long full-attention contexts, and the Triton kernel's smallest) gets `--batch` requests of
`--context` random prompt tokens, prefills them, and runs decode steps; the last one is recorded
(no L2 flush: the state a real step finds). The kernels are listed per category (attention, MoE,
routing, XLA glue, ...) with their count and total device time, then one by one with `--list`.

Usage (GPU): python benchmarks/engine/step_kernels.py [--model beam-tp8-slice] [--batch 8] [--context 8192]
                 [--page-sizes 64,16] [--min-token-buckets 1,16] [--list] [--out step.json]
Smoke (CPU): python benchmarks/engine/step_kernels.py --smoke   (beam-tiny, short prompts, wall time only)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402

import trace_summary  # noqa: E402
from mixed import random_beam  # noqa: E402
from serving.engine import EngineConfig, LLMEngine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

# Kernel name fragments -> category, first match wins (Pallas kernels carry their names; XLA's are
# fusions, gemms and copies).
CATEGORIES = (
    ("write_kv", "attention: K/V write"),
    ("paged_decode_split", "attention: split (Triton)"),
    ("kernel_mosaic_gpu", "Mosaic GPU kernel (attention split or MoE GEMM)"),
    ("paged_decode_combine", "attention: combine"),
    ("ragged_paged", "attention: general kernel"),
    ("routing", "routing"),
    ("moe", "MoE (Triton)"),
    ("row_gather", "MoE: row gather"),
    ("gemm", "XLA GEMM (cuBLAS / Triton GEMM)"),
    ("cutlass", "XLA GEMM (cuBLAS / Triton GEMM)"),
    ("sort", "XLA sort"),
    ("fusion", "XLA fusion"),
)


def category(name: str) -> str:
    return next((label for fragment, label in CATEGORIES if fragment in name), "other")


def record_step(engine: LLMEngine):
    """One engine step with CUPTI on: ([(kernel, µs)], wall seconds)."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    started = time.perf_counter()
    try:
        engine.step()
    finally:
        wall = time.perf_counter() - started
        timings = ext._cupti_get_timings(False)
    return [(name, ms * 1e3) for name, ms in timings or []], wall


def host_profile(engine: LLMEngine, steps: int, top: int = 25) -> str:
    """cProfile of `steps` decode steps: where the host spends a step (functions by own time)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def trace_steps(engine: LLMEngine, steps: int, directory: str) -> str:
    """A JAX profiler trace (host threads and GPU streams) of `steps` decode steps, each annotated
    `engine_step`: where a step's wall time goes when the device is idle. Returns the Perfetto JSON's
    path, copied to `directory` itself (the profiler nests it five folders down)."""
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            with jax.profiler.TraceAnnotation("engine_step"):
                engine.step()
    [found] = glob.glob(os.path.join(directory, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    path = directory.rstrip("/") + ".json.gz"
    shutil.copyfile(found, path)
    return path


def measure(beam, page_size: int, min_bucket: int | None, batch: int, context: int, chunk: int, cupti: bool,
            profile_steps: int = 0, trace_dir: str | None = None) -> dict:
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=chunk, max_model_len=context + 64,
                          page_tokens=page_size, min_token_bucket=min_bucket, enable_prefix_caching=False)
    engine = LLMEngine(beam, config=config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=64 + profile_steps + 5 * bool(trace_dir), ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(16, engine.vocab_size, context).tolist(), params)
    started = time.perf_counter()
    produced = defaultdict(int)
    while min(produced.values(), default=0) < 3 or len(produced) < batch:  # prefilled, then decoding
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    setup_s = time.perf_counter() - started
    walls = []
    for _ in range(10):  # steady decode steps (the median: one step can stall on the host)
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    row = {"page_size": page_size, "min_token_bucket": engine.runner.buckets[0], "batch": batch, "context": context,
           "setup_s": setup_s, "decode_step_wall_ms": 1e3 * float(np.median(walls))}
    if profile_steps:
        row["host_profile"] = host_profile(engine, profile_steps)
    if trace_dir:
        path = trace_steps(engine, 5, os.path.join(trace_dir, f"page{page_size}-bucket{engine.runner.buckets[0]}"))
        row["trace"] = {"path": path, "steps": trace_summary.summarize(trace_summary.load_events(path))}
    if cupti:
        kernels, wall = record_step(engine)
        totals, counts = defaultdict(float), defaultdict(int)
        for name, us in kernels:
            totals[category(name)] += us
            counts[category(name)] += 1
        row.update(kernels=kernels, recorded_step_wall_ms=wall * 1e3, device_us=sum(us for _, us in kernels),
                   by_category={c: {"count": counts[c], "us": totals[c]} for c in sorted(totals, key=totals.get,
                                                                                    reverse=True)})
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="beam-tp8-slice")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=4096, help="the step's token budget (prefill chunks)")
    p.add_argument("--page-sizes", default="64,16")
    p.add_argument("--min-token-buckets", default="default",
                   help="smallest token buckets to compare, e.g. 1,16 (default: the engine's)")
    p.add_argument("--list", action="store_true", help="print every kernel of the recorded step")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="also print a cProfile of this many decode steps (the host's share of a step)")
    p.add_argument("--trace-dir", default=None, help="also write a JAX profiler trace of 5 decode steps there")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.model, args.batch, args.context, args.chunk = "beam-tiny", 2, 40, 64
    cupti = jax.default_backend() == "gpu"
    beam = random_beam(args.model, args.layers)
    rows = []
    buckets = [None if x == "default" else int(x) for x in args.min_token_buckets.split(",")]
    for page_size, min_bucket in ((int(p), b) for p in args.page_sizes.split(",") for b in buckets):
        row = measure(beam, page_size, min_bucket, args.batch, args.context, args.chunk, cupti, args.host_profile,
                      args.trace_dir)
        rows.append(row)
        print(f"\npages of {page_size}, buckets from {row['min_token_bucket']}: decode step "
              f"{row['decode_step_wall_ms']:.2f} ms wall (batch {args.batch}, "
              f"context {args.context}; setup {row['setup_s']:.0f} s)", flush=True)
        if args.host_profile:
            print(row["host_profile"])
        if args.trace_dir:
            print(f"  trace: {row['trace']['path']}")
            for i, step in enumerate(row["trace"]["steps"]):
                print(f"    step {i}: {trace_summary.describe(step)}")
        if not cupti:
            continue
        print(f"  recorded step: {len(row['kernels'])} kernels, {row['device_us']:.1f} us of device time, "
              f"{row['recorded_step_wall_ms']:.2f} ms wall")
        for label, c in row["by_category"].items():
            print(f"  {label:<48} {c['count']:>4} kernels {c['us']:>9.1f} us")
        if args.list:
            for name, us in row["kernels"]:
                print(f"    {us:8.1f}  {name[:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f)


if __name__ == "__main__":
    main()
