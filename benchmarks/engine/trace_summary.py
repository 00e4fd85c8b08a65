"""Where an engine step's wall time goes, from a JAX profiler trace (Perfetto JSON, as
`step_kernels.py --trace-dir` writes it): per `engine_step` annotation, the host's phases on the
stepping thread (the engine's Python before the jit call, input puts, the executable's launch, output
fetches) and the GPU's kernels (time busy, and the span from the first kernel to the last).

Usage: python benchmarks/engine/trace_summary.py TRACE.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys

# Host events on the stepping thread, by name prefix -> phase (first match wins).
HOST_PHASES = (
    ("DevicePut", "input puts (DevicePut)"),
    ("cuGraphLaunch", "CUDA graph launch"),
    ("PjRtCApiLoadedExecutable::Execute", "executable (launch and set-up)"),
    ("np.asarray(jax.Array)", "output fetches (np.asarray)"),
)


def load_events(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def gpu_pids(events: list[dict]) -> set:
    return {e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"].get("name", "")}


def summarize(events: list[dict]) -> list[dict]:
    """One dict per `engine_step` event (µs): wall, host phases (total duration and count), GPU kernel
    busy time and span, and the start of the first kernel relative to the step."""
    gpus = gpu_pids(events)
    complete = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in complete if e["name"] == "engine_step"), key=lambda e: e["ts"])
    rows = []
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in complete if start <= e["ts"] <= end]
        host = [e for e in inside if e["tid"] == step["tid"] and e["pid"] == step["pid"]]
        row = {"wall_us": step["dur"]}
        for prefix, phase in HOST_PHASES:
            hits = [e for e in host if e["name"].startswith(prefix)]
            row[phase] = (sum(e["dur"] for e in hits), len(hits))
        kernels = [e for e in inside if e["pid"] in gpus and "Memcpy" not in e.get("name", "")
                   and "memcpy" not in e.get("name", "").lower()]
        if kernels:
            first = min(e["ts"] for e in kernels)
            last = max(e["ts"] + e["dur"] for e in kernels)
            row.update(gpu_busy_us=sum(e["dur"] for e in kernels), gpu_span_us=last - first,
                       gpu_first_kernel_at_us=first - start, gpu_kernels=len(kernels))
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    phases = ", ".join(f"{phase} {row[phase][0]:.0f} us ({row[phase][1]})" for _, phase in HOST_PHASES if row[phase][1])
    gpu = "no GPU"
    if "gpu_busy_us" in row:
        gpu = (f"GPU busy {row['gpu_busy_us']:.0f} us in a {row['gpu_span_us']:.0f} us span from "
               f"{row['gpu_first_kernel_at_us']:.0f} us ({row['gpu_kernels']} kernels)")
    return f"wall {row['wall_us']:.0f} us; {gpu}; host: {phases or '-'}"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = summarize(load_events(sys.argv[1]))
    if not rows:
        sys.exit("no engine_step events in the trace (record it with step_kernels.py --trace-dir)")
    for i, row in enumerate(rows):
        print(f"step {i}: {describe(row)}")


if __name__ == "__main__":
    main()
