"""Runs in a subprocess with 8 CPU devices (the rest of the suite runs on one, in one process, and
XLA's device count is fixed when JAX starts): `python -m tests.beam_jax.sharding_worker CHECK ...`.
Prints one JSON line of results, which tests/beam_jax/test_sharding.py asserts on.

The model is beam-tiny with 16 query / 8 KV heads (so KV heads split 8 ways) and expert
intermediate 128 (so NVFP4 down_proj keeps whole 16-value groups under TP8), fp32 with random
norms and biases.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import sys

LAYOUTS = {"tp8": (8, 1), "ep8": (1, 8), "tp2xep4": (2, 4)}  # name: (tp, ep)
XLA_FLAGS = "--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"


def tiny_8kv():
    from beam_jax.config import preset

    return preset("beam-tiny").replace(num_attention_heads=16, num_key_value_heads=8, moe_intermediate_size=128)


def model(expert_format: str, config=None, seed: int = 0):
    from beam_jax.quant.convert import quantize_params
    from tests.beam_jax.random_params import randomized_fp32_params

    config = config or tiny_8kv()
    params = randomized_fp32_params(config, seed)
    if expert_format != "bf16":
        config, params = quantize_params(config, params, expert_format)
    return config, params


COLLECTIVE = r" (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
PROMPT_LENGTHS = (5, 21, 37)  # longer than the sliding window (16) and than one prefill chunk


def prompts(config, seed: int = 1) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(7, config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def engine_greedy(config, model, tp: int, ep: int, max_tokens: int = 8, attention_kernel=None) -> list[list[int]]:
    """Greedy outputs of the serving engine (chunked prefill over the paged cache, then decode) for
    `model`: params (fp32), or a checkpoint directory (then the engine loads it onto its mesh).
    `attention_kernel`: the engine's attention path (the kernels run in interpret mode on CPU)."""
    from beam_jax.api import Beam
    from beam_jax.tokenizer import load_tokenizer
    from serving.engine import LLM
    from serving.sampling import SamplingParams

    model = model if isinstance(model, str) else Beam(config, model, load_tokenizer())
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, tp=tp, ep=ep, dtype="float32",
              attention_kernel=attention_kernel)
    outs = llm.generate(prompts(config), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def check_equivalence(expert_format: str) -> dict:
    """Logits (forward with a contiguous KV cache) and the engine's greedy tokens on one device and
    under each layout."""
    import jax.numpy as jnp
    import numpy as np

    from beam_jax import sharding
    from beam_jax.kv_cache import KVCache
    from beam_jax.model import jit_forward

    config, params = model(expert_format)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 24)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), tokens.shape)
    create_cache = lambda: KVCache.create(config, 2, 32, jnp.float32)
    want = np.asarray(jit_forward(params, tokens, positions, create_cache(), config=config).logits)
    results = {"one_device": {"tokens": engine_greedy(config, params, 1, 1)}}
    for name, (tp, ep) in LAYOUTS.items():
        mesh = sharding.make_mesh(tp=tp, ep=ep)
        sharded = sharding.shard_params(params, mesh, config)
        cache = sharding.sharded_cache(create_cache, mesh, config)
        run = sharding.sharded_forward(mesh, config)
        out = run(sharded, tokens, positions, cache)
        got = np.asarray(out.logits)
        program = run.lower(sharded, tokens, positions, out.cache).compile().as_text()  # the same program
        results[name] = {
            "logits_rel_err": float(np.abs(got - want).max() / np.abs(want).max()),
            "kv_shards": len({s.index for s in out.cache.keys[0].addressable_shards}),
            "collectives": dict(collections.Counter(re.findall(COLLECTIVE, program))),
            "tokens": engine_greedy(config, params, tp, ep),
        }
    return results


def check_attention_kernels() -> dict:
    """The engine's greedy tokens with the decode attention kernel (and its fused prologues and
    gate) running per device on the mesh, against one device on plain jnp."""
    config, params = model("bf16")
    greedy = functools.partial(engine_greedy, config, params, max_tokens=4)
    return {"one_device_plain": greedy(1, 1, attention_kernel=False),
            "tp2xep4": greedy(*LAYOUTS["tp2xep4"], attention_kernel="decode")}


LOADING_CASES = {"bf16": ("bf16", "per_expert"), "bf16_fused": ("bf16", "fused"), "nvfp4": ("nvfp4", "per_expert")}


def check_loading(directory: str) -> dict:
    """`load_case` for each checkpoint kind, one directory each."""
    from pathlib import Path

    return {case: load_case(*args, str(Path(directory) / case)) for case, args in LOADING_CASES.items()}


def load_case(expert_format: str, expert_layout: str, directory: str) -> dict:
    """Save a checkpoint (with experts large enough that a block is much bigger than Python's
    constant overheads), load it onto the TP2xEP4 mesh, and compare with the plain load. Every
    block the reader builds is measured with tracemalloc (numpy's buffers are traced; the memory
    map's pages are not: they are the page cache): the peak while it is read, against the block
    and against the whole parameter."""
    import math
    import tracemalloc

    import numpy as np

    import beam_jax.checkpoint.sharded as sharded_module
    from beam_jax import sharding
    from beam_jax.checkpoint import load_checkpoint, save_checkpoint
    from beam_jax.model import flat_params

    config, params = model(expert_format, tiny_8kv().replace(hidden_size=256, moe_intermediate_size=512))
    save_checkpoint(directory, config, params, expert_layout=expert_layout)
    _, want = load_checkpoint(directory, progress=False)
    want = {name: np.asarray(a) for name, a in flat_params(want).items()}

    reads = []  # (expert parameter?, whole parameter bytes, block bytes, traced peak while reading it)
    read_block = sharded_module.read_block

    def measured(checkpoint, sources, param_shape, dtype, layout_shape, index):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        block = read_block(checkpoint, sources, param_shape, dtype, layout_shape, index)
        peak = tracemalloc.get_traced_memory()[1] - before
        whole = math.prod(param_shape) * np.dtype(dtype).itemsize
        reads.append((".experts." in sources[0][0], whole, block.nbytes, peak))
        return block

    sharded_module.read_block = measured
    tracemalloc.start()
    mesh = sharding.make_mesh(tp=2, ep=4)
    try:
        _, got = load_checkpoint(directory, mesh=mesh, progress=False)
    finally:
        tracemalloc.stop()
        sharded_module.read_block = read_block

    mismatched, misplaced = [], []
    for name, array in flat_params(got).items():
        if not np.array_equal(np.asarray(array).reshape(want[name].shape), want[name]):
            mismatched.append(name)
        if array.sharding.spec != sharding.param_spec(name, config, mesh):
            misplaced.append(name)
    big_experts = [(whole, block, peak) for expert, whole, block, peak in reads if expert and whole >= 2**20]
    return {
        "mismatched": mismatched,
        "misplaced": misplaced,
        "reads": len(reads),
        "max_peak_over_block": max(peak - block for _, _, block, peak in reads),
        "big_expert_tensors": len(big_experts),
        "max_expert_block_fraction": max(block / whole for whole, block, _ in big_experts),
        "max_expert_peak_fraction": max(peak / whole for whole, _, peak in big_experts),
    }


def check_two_processes(coordinator: str, process_id: str, directory: str, tp: str, ep: str) -> dict:
    """One of two processes (4 CPU devices each) of a `jax.distributed` run: the engine loads the
    checkpoint onto the 8-device mesh (each process reading its devices' slices) and every process
    drives the same steps; then the same engine on this process's first device alone."""
    import jax

    from beam_jax.checkpoint import read_config

    jax.distributed.initialize(coordinator, num_processes=2, process_id=int(process_id))
    assert (jax.device_count(), jax.local_device_count()) == (8, 4)
    config = read_config(directory)
    return {
        "process": jax.process_index(),
        "sharded": engine_greedy(config, directory, int(tp), int(ep)),
        "one_device": engine_greedy(config, directory, 1, 1),
    }


CHECKS = {"equivalence": check_equivalence, "attention_kernels": check_attention_kernels, "loading": check_loading, "two_processes": check_two_processes}

if __name__ == "__main__":
    check, *args = sys.argv[1:]
    assert "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""), "run through test_sharding.py"
    print(json.dumps(CHECKS[check](*args)))
