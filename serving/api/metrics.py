"""Prometheus text exposition of the server's and the engine's figures (no client library needed)."""

from __future__ import annotations

import dataclasses

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class Histogram:
    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * len(_BUCKETS))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(_BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(_BUCKETS, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return out


@dataclasses.dataclass
class Metrics:
    ttft: Histogram = dataclasses.field(default_factory=Histogram)
    inter_token: Histogram = dataclasses.field(default_factory=Histogram)
    requests_started: int = 0
    requests_finished: int = 0

    def render(self, engine_stats: dict) -> str:
        lines = self.ttft.lines("beam_time_to_first_token_seconds", "Time from request to its first token.")
        lines += self.inter_token.lines("beam_inter_token_latency_seconds", "Time between two tokens of a request.")
        gauges = {
            "beam_requests_running": ("Requests in the running batch.", engine_stats["running"]),
            "beam_requests_waiting": ("Requests waiting to be scheduled.", engine_stats["waiting"]),
            "beam_kv_pool_usage": ("Fraction of KV pages in use (prefix cache included).", engine_stats["pool_usage"]),
            "beam_prefix_cache_hit_rate": ("Prompt tokens served by the prefix cache / prompt tokens.",
                                           engine_stats["prefix_hit_rate"]),
            "beam_spec_decode_acceptance_rate": ("Accepted / proposed draft tokens (0 without a drafter).",
                                                 engine_stats.get("spec_acceptance_rate", 0.0)),
            "beam_spec_decode_mean_accept_length": ("Tokens emitted per verified block (0 without a drafter).",
                                                    engine_stats.get("spec_mean_accept_length", 0.0)),
            "beam_spec_decode_simulated": ("1 if acceptance is simulated (benchmark mode, not the drafter's).",
                                           int(engine_stats.get("spec_simulated", False))),
        }
        counters = {
            "beam_requests_started_total": ("Requests received.", self.requests_started),
            "beam_requests_finished_total": ("Requests finished or aborted.", self.requests_finished),
            "beam_generated_tokens_total": ("Tokens generated.", engine_stats["generated_tokens"]),
            "beam_preemptions_total": ("Requests preempted for lack of KV pages.", engine_stats["preemptions"]),
        }
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, (help_text, value) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        if by_position := engine_stats.get("spec_acceptance_by_position"):
            name = "beam_spec_decode_acceptance_by_position"
            lines += [f"# HELP {name} Fraction of blocks whose draft at this position was accepted.", f"# TYPE {name} gauge"]
            lines += [f'{name}{{position="{j}"}} {rate}' for j, rate in enumerate(by_position)]
        return "\n".join(lines) + "\n"
