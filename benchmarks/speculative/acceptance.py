"""Real acceptance in the engine (issue 8): beam-tiny-code with its shipped DFlash drafter
(`beam-tiny-code-dflash`) decoding greedily after held-out code prompts (files never trained on),
as `beam-serve --speculative dflash --draft-model beam-tiny-code-dflash` would. Prints the engine's
acceptance statistics: mean accept length (tokens per verified block) and the rate by position.

Usage: python benchmarks/speculative/acceptance.py [--prompts 16] [--new-tokens 64] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax.numpy as jnp

import beam_jax
from beam_jax.train import data
from serving.engine import EngineConfig, LLMEngine
from serving.sampling import SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    beam = beam_jax.load("beam-tiny-code", dtype=jnp.float32)
    heldout = data.load_heldout_tokens(beam.tokenizer)
    starts = np.random.default_rng(args.seed).integers(0, len(heldout) - args.prompt_len, args.prompts)
    engine = LLMEngine(beam, config=EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=128, max_model_len=args.prompt_len + args.new_tokens + 8,
        speculative="dflash", draft_model="beam-tiny-code-dflash"))
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    started = time.monotonic()
    for i, start in enumerate(starts):
        engine.add_request(str(i), heldout[start : start + args.prompt_len].tolist(), params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = {k: v for k, v in engine.stats().items() if k.startswith("spec")}
    print(json.dumps({"args": vars(args), "seconds": time.monotonic() - started} | stats, indent=1))


if __name__ == "__main__":
    main()
