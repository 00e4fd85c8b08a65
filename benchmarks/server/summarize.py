"""One markdown summary of a `run_aiperf.sh` results directory: AIPerf's figures of the completions
run, the server's own TTFT and inter-token latency of each run (the difference between the /metrics
snapshots taken around it), and the machine's load average.

    python benchmarks/server/summarize.py benchmarks/server/results/<run>  > <run>/summary.md
"""

from __future__ import annotations

import json
import pathlib
import sys


def server_figures(path: pathlib.Path) -> list[str]:
    values: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        tag, name, value = line.split()
        values[tag, name] = float(value)
    rows = []
    def delta(before: str, after: str, name: str) -> float:
        return values[after, name] - values[before, name]

    for before, after, run in (("before", "after-chat", "chat"), ("after-chat", "after-completions", "completions")):
        ttft_sum, ttft_count, itl_sum, itl_count, finished, generated = (delta(before, after, name) for name in (
            "beam_time_to_first_token_seconds_sum", "beam_time_to_first_token_seconds_count",
            "beam_inter_token_latency_seconds_sum", "beam_inter_token_latency_seconds_count",
            "beam_requests_finished_total", "beam_generated_tokens_total"))
        ttft, itl = ttft_sum / max(ttft_count, 1), itl_sum / max(itl_count, 1)
        rows.append(f"| {run} | {finished:.0f} | {generated:.0f} | {ttft * 1000:,.0f} | {itl * 1000:,.0f} |")
    return ["| run | requests (warm-up included) | tokens generated | mean TTFT (ms) | mean inter-token (ms) |",
            "|---|---|---|---|---|", *rows]


def aiperf_figures(path: pathlib.Path) -> list[str]:
    data = json.loads(path.read_text())
    out = ["| metric | avg | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for key, label in (("time_to_first_token", "TTFT (ms)"), ("inter_token_latency", "inter-token latency (ms)"),
                       ("request_latency", "request latency (ms)"),
                       ("output_token_throughput_per_user", "output tokens/s per user")):
        m = data[key]
        out.append(f"| {label} | {m['avg']:,.1f} | {m['p50']:,.1f} | {m['p90']:,.1f} | {m['p99']:,.1f} |")
    out += ["", "| throughput | value |", "|---|---|",
            f"| output tokens/s | {data['output_token_throughput']['avg']:.2f} |",
            f"| requests/s | {data['request_throughput']['avg']:.3f} |",
            f"| requests succeeded | {data['request_count']['avg']:.0f} |",
            f"| requests failed | {(data.get('error_request_count') or {}).get('avg', 0):.0f} "
            f"({len(data.get('error_summary') or [])} error kinds) |",
            f"| benchmark duration (s) | {data['benchmark_duration']['avg']:.1f} |"]
    return out


def main(run: str) -> None:
    run_dir = pathlib.Path(run)
    machine = (run_dir / "machine.txt").read_text().strip()
    # Runs from before run_aiperf.sh took MODEL have no "beam-serve --model" line: they were beam-tiny.
    first = machine.splitlines()[0]
    model = first.split()[2].rstrip(";") if first.startswith("beam-serve --model") else "beam-tiny"
    lines = [f"# AIPerf against beam-serve {model}: {run_dir.name}", "",
             "Machine (model, date, arch, cores, CPU, load average at the start and the end):", "",
             "```", machine, "```", ""]
    for name in ("completions", "chat"):
        report = run_dir / f"{name}-profile_export_aiperf.json"
        if report.exists():
            lines += [f"## AIPerf, streamed {name}", "", *aiperf_figures(report), ""]
        errors = run_dir / f"{name}-errors.txt"
        if errors.exists():
            lines += [f"Requests of the {name} run by outcome (warm-up included):", "",
                      "```", errors.read_text().rstrip(), "```", ""]
    lines += ["## The server's /metrics, per run", "", *server_figures(run_dir / "server-metrics.txt"), ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
