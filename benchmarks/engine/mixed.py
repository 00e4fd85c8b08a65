"""Mixed batching (issue 6): while 4 requests decode, a prompt 100x the prefill chunk arrives. The
scheduler runs it one chunk per step beside the decodes, so no decode waits for the whole prompt.
Prints the longest gap between two tokens of a decoding request against the median step time.

Usage: python benchmarks/engine/mixed.py [--model beam-tiny] [--chunk 16] [--out mixed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from serving.engine import EngineConfig, LLMEngine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402


def measure(engine: LLMEngine, chunk: int, decoders: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=100 * chunk, ignore_eos=True)
    for i in range(decoders):
        engine.add_request(f"d{i}", rng.integers(16, vocab, 8).tolist(), params)
    for _ in range(3):
        engine.step()
    engine.add_request("long", rng.integers(16, vocab, 100 * chunk).tolist(), SamplingParams(max_tokens=1))
    last, gaps, steps = {}, [], []
    while any(r.request_id == "long" for r in engine.scheduler.running + engine.scheduler.waiting):
        started = time.monotonic()
        outputs = engine.step()
        now = time.monotonic()
        steps.append(now - started)
        for out in outputs:
            if out.request_id.startswith("d") and out.new_token_ids:
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for i in range(decoders):
        engine.abort_request(f"d{i}")
    return {"steps_while_prefilling": len(steps), "decode_tokens": len(gaps) + len(last),
            "longest_gap_s": max(gaps), "median_step_s": float(np.median(steps)),
            "longest_gap_in_steps": max(gaps) / float(np.median(steps))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="beam-tiny")
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = LLMEngine(args.model, config=EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=args.chunk + 4, max_prefill_chunk=args.chunk,
        max_model_len=args.max_model_len))
    engine.warmup()
    result = measure(engine, args.chunk) | {"args": vars(args)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
