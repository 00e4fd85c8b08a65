"""Where the one-launch NVFP4 decode layer's time goes (`nvfp4_fused_moe.fused_decode_moe`), from Mosaic GPU's
profiler: each program's named scopes (gate/up K loop and write; down wait, SwiGLU, K loop, write) timed on the
device, summarized as the spread of their start and end times across the programs of each kind.

    OUT=dir python3 -u benchmarks/moe/fused_timeline.py [--tokens 8] [--settings '{"down_tile_n": 128}'] [--stamps]

The ids and weights of `--tokens` tokens go in as they are (a block per pair), as in the layer.

Times are µs from the first program's start. A program's start is the GPU's global timer; its scopes are SM clock
cycles after that, converted at `--clock-ghz` (the H200's SM clock under load: `nvidia-smi -q -d CLOCK`). The
profiler's own cost (a shared-memory store per event) is small against these scopes but not zero; the profiled kernel
runs ~2 us longer, and its programs' starts mislead: at one token its trace had the non-resident down programs starting
~11 us in, where the unprofiled kernel starts them at 5.7-7 us (H200, benchmarks/moe/RESULTS.md, session 35 run 9).

`--stamps` runs the kernel unprofiled instead (`fused_decode_moe(stamps=True)`: each program's `%globaltimer` at its
start and end and past its phases, the counters passed from call to call) and prints, per kind of program, where
starts and ends fall and how long its phases take (`PHASES`: a down program's wait for its block, SwiGLU fill, K loop
and write; a gate/up program's K loop, store and signal, and when its first K steps began), per block when its last
gate/up and last down program ended, the spread of the SMs' last gate/up ends by how many gate/up programs an SM ran,
and it saves every call's raw stamps to `$OUT/fused-stamps-t{tokens}.npy`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(__file__))
import bench  # noqa: E402

from pallas_kernels import nvfp4_fused_moe as nfm  # noqa: E402


def run(tokens: int, settings: dict, profile_dir: str):
    """Profiled calls of the fused layer on `tokens` tokens and Beam's TP8 NVFP4 experts; returns the last call's
    trace file."""
    gate, up, down = bench.make_weights("nvfp4", jax.random.key(0))
    gate_up, down_k = bench.mosaic_layout(gate, up, down)
    x, w, ids = bench.make_tokens(tokens, 3, jax.random.key(1))
    os.makedirs(profile_dir, exist_ok=True)
    params = plgpu.CompilerParams(profile_space=32, profile_dir=profile_dir)

    @jax.jit
    def layer(x, w, ids, gate_up, down_k):
        return nfm.fused_decode_moe(x, ids.reshape(-1), w.reshape(-1), gate_up.packed, gate_up.scales,
                                    gate_up.global_scale, down_k.packed, down_k.scales, down_k.global_scale,
                                    gate_up_tile_k=gate_up.tile_k, down_tile_k=down_k.tile_k, compiler_params=params,
                                    **settings)

    for r in range(3):
        jax.block_until_ready(layer(x[r], w[r], ids[r], gate_up, down_k))
    return max(glob.glob(os.path.join(profile_dir, "*.json")), key=os.path.getmtime)


def run_stamps(tokens: int, settings: dict, calls: int = 6) -> list:
    """`calls` unprofiled calls of the fused layer with stamps; returns each call's stamps
    `[programs, len(nfm.STAMPS)]`."""
    gate, up, down = bench.make_weights("nvfp4", jax.random.key(0))
    gate_up, down_k = bench.mosaic_layout(gate, up, down)
    x, w, ids = bench.make_tokens(tokens, calls, jax.random.key(1))

    @jax.jit
    def layer(x, w, ids, gate_up, down_k, counters):
        (_, counters), stamps = nfm.fused_decode_moe(
            x, ids.reshape(-1), w.reshape(-1), gate_up.packed, gate_up.scales, gate_up.global_scale, down_k.packed,
            down_k.scales, down_k.global_scale, gate_up_tile_k=gate_up.tile_k, down_tile_k=down_k.tile_k,
            counters=counters, stamps=True, **settings)
        return counters, stamps

    counters, stamped = nfm.fresh_counters(), []
    for r in range(calls):
        counters, stamps = layer(x[r], w[r], ids[r], gate_up, down_k, counters)
        stamped.append(np.asarray(stamps))
    return stamped


# Per kind of program, its phases: (name, from column, to column) of `nfm.STAMPS`.
PHASES = {"gate_up": (("k_loop", "start", "multiplied"), ("store", "multiplied", "stored"), ("signal", "stored", "end"),
                      *[(f"step{k}", "start", f"step{k}") for k in range(nfm.STAMPED_STEPS)]),
          "down": (("wait", "start", "ready"), ("fill", "ready", "filled"), ("k_loop", "filled", "multiplied"),
                   ("write", "multiplied", "end"))}


def stamp_summary(stamps) -> dict:
    """One call's stamps `[programs, len(nfm.STAMPS)]` (`%globaltimer_lo`, ns modulo 2^32; the kind and the block;
    0: a phase the program did not reach) -> the kernel's length; per kind, percentiles 0 / 10 / 50 / 90 / 100 over
    its programs of its stamps (µs from the first start) and of its phases' lengths (µs; over the programs that
    reached both ends); per block, when its last gate/up program and its last down program ended."""
    stamps = np.asarray(stamps).astype(np.int64)
    column = {name: i for i, name in enumerate(nfm.STAMPS)}
    reached = stamps != 0
    # Differences modulo 2^32 read as signed: right across the timer's wrap-around (a kernel is far under 2 s).
    times = (stamps - stamps[0, column["start"]] + 2**31) % 2**32 - 2**31
    times = (times - times[:, column["start"]].min()) / 1e3
    percentiles = lambda a: [round(float(np.percentile(a, q)), 2) for q in (0, 10, 50, 90, 100)]  # noqa: E731
    summary = dict(kernel_us=round(float(times[:, column["end"]].max()), 2))
    for kind, name in enumerate(("gate_up", "down")):
        mine = stamps[:, column["kind"]] == kind
        at = lambda c: times[mine & reached[:, column[c]], column[c]]  # noqa: E731, B023
        summary[name] = dict(programs=int(mine.sum()), start=percentiles(at("start")), end=percentiles(at("end")))
        for phase, first, last in PHASES[name]:
            both = mine & reached[:, column[first]] & reached[:, column[last]]
            if both.any():
                summary[name][phase] = percentiles(times[both, column[last]] - times[both, column[first]])
    # Per block (pair), in block order: when its last gate/up program ended (the block ready) and its last down
    # program ended: whether blocks finish one after another or all together.
    kinds, blocks = stamps[:, column["kind"]], stamps[:, column["block"]]

    def last_end(kind, block):
        ended = (kinds == kind) & (blocks == block) & reached[:, column["end"]]
        return round(float(times[ended, column["end"]].max()), 2) if ended.any() else None

    ids = np.unique(blocks)
    summary["blocks"] = dict(ready=[last_end(0, b) for b in ids], done=[last_end(1, b) for b in ids])
    # Per SM: how many gate/up programs it ran, and the spread over SMs of their last end, by that count (whether
    # the late gate/up programs are those of SMs that ran more of them).
    sms, gate_up = stamps[:, column["sm"]], kinds == 0
    by_count: dict[int, list] = {}
    for sm in np.unique(sms):
        here = gate_up & (sms == sm)
        if here.any():
            by_count.setdefault(int(here.sum()), []).append(float(times[here, column["end"]].max()))
    summary["sm_gate_up_last_end"] = {count: dict(sms=len(ends), last_end=percentiles(ends))
                                      for count, ends in sorted(by_count.items())}
    return summary


def summarize(trace_file: str, clock_ghz: float) -> dict:
    """Per scope name: (programs, first / median / last begin, first / median / last end), µs from the first
    program's start."""
    events = json.load(open(trace_file))["traceEvents"]
    by_program: dict[int, list] = {}
    for event in events:
        by_program.setdefault(event["tid"], []).append(event)
    spans: dict[str, list] = {}
    program_starts = []
    for program_events in by_program.values():
        start_us = program_events[0]["ts"]  # the program's global timer; later events add clock cycles
        program_starts.append(start_us)
        at = lambda e: start_us + (e["ts"] - start_us) / clock_ghz  # noqa: E731, B023 (cycles / 1e3 -> µs)
        open_events = {}
        for event in program_events:
            if event["ph"] == "B":
                open_events[event["name"]] = at(event)
            else:
                spans.setdefault(event["name"], []).append((open_events.pop(event["name"]), at(event)))
    origin = min(program_starts)
    summary = {}
    for name, pairs in sorted(spans.items()):
        begins, ends = (np.array([p[i] for p in pairs]) - origin for i in (0, 1))
        summary[name] = dict(programs=len(pairs), begin=[round(float(np.min(begins)), 2),
                                                         round(float(np.median(begins)), 2),
                                                         round(float(np.max(begins)), 2)],
                             end=[round(float(np.min(ends)), 2), round(float(np.median(ends)), 2),
                                  round(float(np.max(ends)), 2)],
                             median_length=round(float(np.median(ends - begins)), 2))
    summary["last_program_start"] = round(max(program_starts) - origin, 2)
    return summary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--settings", default="{}", help="fused_decode_moe settings (JSON)")
    parser.add_argument("--clock-ghz", type=float, default=1.98)
    parser.add_argument("--stamps", action="store_true", help="unprofiled, with each program's globaltimer stamps")
    args = parser.parse_args()
    out = os.environ.get("OUT", ".")
    settings = json.loads(args.settings)
    if args.stamps:
        stamped = run_stamps(args.tokens, settings)
        np.save(os.path.join(out, f"fused-stamps-t{args.tokens}.npy"), np.stack(stamped))  # for other summaries
        calls = [stamp_summary(stamps) for stamps in stamped]
        for call in calls:
            print(json.dumps(call))
        with open(os.path.join(out, "fused-stamps.json"), "a") as f:
            f.write(json.dumps(dict(tokens=args.tokens, settings=settings, calls=calls)) + "\n")
        return
    trace = run(args.tokens, settings, os.path.join(out, "fused-profile"))
    summary = dict(tokens=args.tokens, settings=settings, clock_ghz=args.clock_ghz, trace=os.path.basename(trace),
                   scopes=summarize(trace, args.clock_ghz))
    print(json.dumps(summary, indent=1))
    with open(os.path.join(out, "fused-timeline.json"), "a") as f:
        f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
