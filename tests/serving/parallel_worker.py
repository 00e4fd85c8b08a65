"""Runs in a subprocess with 8 CPU devices (XLA fixes the device count when JAX starts; the rest of
the suite runs on one): `python -m tests.serving.parallel_worker TP[,TP...] BEAM_SERVE_FLAGS...`
builds the engine as `beam-serve BEAM_SERVE_FLAGS --tp TP` does, for each TP, and prints one JSON
line: per TP the greedy tokens of fixed prompts and the devices the parameters and KV pages span."""

from __future__ import annotations

import json
import os
import sys

PROMPT_LENGTHS = (5, 21, 37)  # longer than beam-tiny's sliding window (16) and than one prefill chunk


def greedy(engine, max_tokens: int = 8) -> list[list[int]]:
    import numpy as np

    from serving.sampling import SamplingParams

    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, n in enumerate(PROMPT_LENGTHS):
        engine.add_request(f"r{i}", rng.integers(16, engine.vocab_size, n).tolist(), params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(PROMPT_LENGTHS))]


def run(tp: str, flags: list[str]) -> dict:
    import jax

    from serving.cli import build_engine, parser

    engine = build_engine(parser().parse_args([*flags, "--tp", tp]))
    span = lambda tree: max(len(leaf.sharding.device_set) for leaf in jax.tree.leaves(tree))
    return {
        "tokens": greedy(engine),
        "param_devices": span(engine.runner.params),
        "cache_devices": span(engine.runner.cache),
        "expert_format": engine.beam.config.expert_format,
    }


if __name__ == "__main__":
    assert "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""), "run through test_cli.py"
    tps, *flags = sys.argv[1:]
    print(json.dumps({tp: run(tp, flags) for tp in tps.split(",")}))
