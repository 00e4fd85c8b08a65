"""Speculative decoding speed (issue 8): decode tokens/s of the engine at batch 1 and 8, without a
drafter and with a DFlash2 drafter at its measured acceptance and at simulated accept lengths
(`EngineConfig.simulated_accept_length`: the SGLang report's way to show throughput at a fixed
accept length; its text is not the model's), all in one run over the same target weights.

Each run: `batch` requests with `--prompt` random prompt tokens (greedy, eos ignored), timed in
steady state: from the step after every request has its first token until each has `--tokens` more
(prefill, admission and finishing are left out): decode tokens / seconds. Before each timed run an identical short run compiles
the programs it uses. Random weights (target and drafter) are drawn on the device.

Usage: python benchmarks/speculative/decode.py [--model beam-tp8-slice] [--layers 8] [--batch 1,8]
           [--simulated 3.4,6.8] [--prompt 256] [--tokens 128] [--out decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "engine"))
import jax
import jax.numpy as jnp
from mixed import random_beam

from beam_jax import drafter as D
from beam_jax.api import default_dtype
from beam_jax.config import BeamConfig
from serving.engine import EngineConfig, LLMEngine
from serving.sampling import SamplingParams


def drafter_for(target: BeamConfig) -> D.DrafterConfig:
    """DFlash2's shape for the target's width (block 8, 5 sliding layers over 4096 tokens), with the
    target's KV heads (its K/V shares the target's pages) and features from 5 spread target layers."""
    layers = target.num_hidden_layers
    heads = max(1, target.num_attention_heads * 5 // 6)  # DFlash2: 40 query heads beside Beam's 48
    return D.DrafterConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=5, num_attention_heads=heads - heads % target.num_key_value_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        target_layer_ids=tuple(sorted({round(i * (layers - 1) / 4) for i in range(5)})), mask_token_id=8,
        conv_group_size=128 if target.hidden_size % 128 == 0 else target.hidden_size,
        selector_rank=None, selector_top_k=None,
    )


def random_drafter(config: D.DrafterConfig, seed: int = 1):
    key, arrays = jax.random.key(seed), {}
    for i, (name, leaf) in enumerate(sorted(D.abstract_flat(config, default_dtype()).items())):
        if name.endswith("norm.weight"):
            arrays[name] = jnp.ones(leaf.shape, leaf.dtype)
        else:
            value = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32) * config.initializer_range
            if name.endswith("base_kernel"):
                value = value.at[:, 0].add(1.0)
            arrays[name] = value.astype(leaf.dtype)
    return config, D.params_from_flat(config, arrays)


def decode_run(engine: LLMEngine, batch: int, prompt: int, tokens: int, seed: int) -> dict:
    """Steady-state decode: timed from the step after every request has its first token until each
    has `tokens` more (no request finishes or starts inside the window, so every timed step is one
    program at one shape); then the requests are aborted."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, ignore_eos=True)  # runs until aborted (or the context ends)
    ids = [f"r{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(16, engine.vocab_size, prompt).tolist(), params)
    requests = lambda: engine.scheduler.running + engine.scheduler.waiting
    while any(not r.output_ids for r in requests()):
        engine.step()
    start_counts = {r.request_id: len(r.output_ids) for r in requests()}
    before = engine.metrics.generated_tokens
    spec_before = engine.metrics.spec.snapshot() if engine.metrics.spec else None
    steps, started = 0, time.monotonic()
    while min(len(r.output_ids) - start_counts[r.request_id] for r in requests()) < tokens:
        if any(out.finished for out in engine.step()):
            raise RuntimeError("a request finished inside the timed window: raise --max-model-len")
        steps += 1
    seconds = time.monotonic() - started
    generated = engine.metrics.generated_tokens - before
    for request_id in ids:
        engine.abort_request(request_id)
    run = {"decode_tokens": generated, "decode_s": seconds, "steps": steps, "tokens_per_s": generated / seconds,
           "step_ms": 1e3 * seconds / steps}
    if spec_before is not None:
        after = engine.metrics.spec.snapshot()
        blocks = after["spec_blocks"] - spec_before["spec_blocks"]
        accepted = after["spec_accepted_tokens"] - spec_before["spec_accepted_tokens"]
        run |= {"accept_length": (accepted + blocks) / blocks if blocks else 0.0, "simulated": after["spec_simulated"]}
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="beam-tp8-slice")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--simulated", default="3.4,6.8")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.monotonic()
    target = random_beam(args.model, args.layers)
    drafter = random_drafter(drafter_for(target.config))
    jax.block_until_ready(drafter[1])
    result = {"args": vars(args), "device": str(jax.devices()[0]), "jax": jax.__version__,
              "weights_s": time.monotonic() - started, "drafter": drafter[0].to_hf_dict(), "runs": []}
    print(f"weights in {result['weights_s']:.1f} s on {result['device']}", flush=True)
    variants = [("plain", None), ("dflash", None)] + [("dflash-simulated", float(m)) for m in args.simulated.split(",") if m]
    for batch in (int(b) for b in args.batch.split(",")):
        baseline = None
        for name, simulated in variants:
            spec = {} if name == "plain" else {"speculative": "dflash", "simulated_accept_length": simulated}
            budget = batch * drafter[0].block_size
            engine = LLMEngine(target, config=EngineConfig(
                max_num_seqs=batch, max_num_batched_tokens=max(budget, 64), max_model_len=args.prompt + 16 * args.tokens,
                **spec), drafter=drafter if spec else None)
            compile_started = time.monotonic()
            decode_run(engine, batch, args.prompt, 24, seed=1)  # compiles what the timed run uses
            run = {"batch": batch, "variant": name, "simulated_accept_length": simulated,
                   "compile_s": time.monotonic() - compile_started}
            run |= decode_run(engine, batch, args.prompt, args.tokens, seed=2)
            baseline = baseline or run["tokens_per_s"]
            run["speedup_vs_plain"] = run["tokens_per_s"] / baseline
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
            del engine
            if args.out:  # written after every run, so a timeout keeps what finished
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(f"{'batch':>5} {'variant':>18} {'accept':>7} {'tok/s':>9} {'step ms':>8} {'speedup':>8}")
    for r in result["runs"]:
        accept = r.get("accept_length", 1.0)
        print(f"{r['batch']:>5} {r['variant'] + (f' {r['simulated_accept_length']}' if r['simulated_accept_length'] else ''):>18} "
              f"{accept:>7.2f} {r['tokens_per_s']:>9.1f} {r['step_ms']:>8.2f} {r['speedup_vs_plain']:>8.2f}")


if __name__ == "__main__":
    main()
