"""Mixed batching (issue 6): while 4 requests decode, a prompt `--prompt-chunks` x the prefill chunk
arrives. The scheduler runs it one chunk per step beside the decodes, so no decode waits for the
whole prompt. Prints the longest gap between two tokens of a decoding request against the median
step time, for each attention path asked for (`--attention`: "decode" = decode tokens on the split
decode kernel and the prefill chunks in plain jnp, the GPU default; "jnp" = plain jnp for all; "all"
= the decode kernel and the general kernel), each in its own engine over the same weights.

Before each measured run a short run (2 chunks, other tokens) compiles the programs the run uses
(engine.warmup() would compile every bucket: minutes for a large model on the GPU). A preset's
random weights are drawn on the device (jax.random), which takes seconds where numpy on the host
takes minutes for beam-tp8-slice.

Usage: python benchmarks/engine/mixed.py [--model beam-tiny] [--layers N] [--chunk 16]
           [--prompt-chunks 100] [--attention decode,jnp] [--out mixed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from beam_jax.api import Beam, default_dtype  # noqa: E402
from beam_jax.config import PRESETS, preset  # noqa: E402
from beam_jax.model import abstract_flat, params_from_flat  # noqa: E402
from beam_jax.tokenizer import load_tokenizer  # noqa: E402
from serving.engine import EngineConfig, LLMEngine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

ATTENTION = {"decode": "decode", "jnp": False, "all": True}  # --attention name -> EngineConfig.attention_kernel


def measure(engine: LLMEngine, chunk: int, prompt_chunks: int = 100, decoders: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=prompt_chunks * chunk + 16, ignore_eos=True)
    for i in range(decoders):
        engine.add_request(f"d{i}", rng.integers(16, vocab, 8).tolist(), params)
    decode_steps = []
    for _ in range(3):
        started = time.monotonic()
        engine.step()
        decode_steps.append(time.monotonic() - started)
    engine.add_request("long", rng.integers(16, vocab, prompt_chunks * chunk).tolist(), SamplingParams(max_tokens=1))
    last, gaps, steps = {}, [], []
    began = time.monotonic()
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
    total = time.monotonic() - began
    for i in range(decoders):
        engine.abort_request(f"d{i}")
    return {"steps_while_prefilling": len(steps), "prefill_s": total, "decode_tokens": len(gaps) + len(last),
            "longest_gap_s": max(gaps), "median_step_s": float(np.median(steps)),
            "mean_step_s": float(np.mean(steps)), "min_step_s": float(np.min(steps)),
            "longest_gap_in_steps": max(gaps) / float(np.median(steps)),
            "decode_only_step_s": float(np.median(decode_steps[1:]))}


def random_beam(name: str, layers: int | None, seed: int = 0) -> Beam:
    """A preset with random weights drawn on the device: normal(0, initializer_range) for matrices,
    ones for norms, zeros for biases (as beam_jax.model.init_params, which draws them with numpy)."""
    config = preset(name, **({"num_hidden_layers": layers} if layers else {}))
    key, arrays = jax.random.key(seed), {}
    for i, (path, leaf) in enumerate(sorted(abstract_flat(config, default_dtype()).items())):
        if path.endswith("norm.weight"):
            arrays[path] = jnp.ones(leaf.shape, leaf.dtype)
        elif path.endswith(("bias", "e_score_correction_bias")):
            arrays[path] = jnp.zeros(leaf.shape, leaf.dtype)
        else:
            noise = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)
            arrays[path] = (noise * config.initializer_range).astype(leaf.dtype)
    jax.block_until_ready(arrays)
    return Beam(config, params_from_flat(config, arrays), load_tokenizer())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="beam-tiny")
    parser.add_argument("--layers", type=int, default=None, help="layer count of a preset (beam-tp8-slice: 8)")
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--prompt-chunks", type=int, default=100)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--attention", default="default", help="comma-separated: decode, jnp, all, default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.monotonic()
    model = random_beam(args.model, args.layers) if args.model in PRESETS else args.model
    result = {"args": vars(args), "device": str(jax.devices()[0]), "jax": jax.__version__,
              "weights_s": time.monotonic() - started, "runs": {}}
    print(f"weights in {result['weights_s']:.1f} s on {result['device']}", flush=True)
    for attention in args.attention.split(","):
        started = time.monotonic()
        engine = LLMEngine(model, config=EngineConfig(
            max_num_seqs=8, max_num_batched_tokens=args.chunk + 4, max_prefill_chunk=args.chunk,
            max_model_len=args.max_model_len, attention_kernel=ATTENTION.get(attention)))
        measure(engine, args.chunk, prompt_chunks=2, seed=1)  # compiles the programs the run uses
        compiled_s = time.monotonic() - started
        run = measure(engine, args.chunk, args.prompt_chunks) | {
            "use_kernel": engine.runner.cache.use_kernel, "compile_and_warmup_s": compiled_s,
            "compilations": engine.runner.compilations}
        result["runs"][attention] = run
        print(attention, json.dumps(run), flush=True)
        del engine
        if args.out:  # written after every run, so a timeout keeps what finished
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
