"""AsyncEngine: concurrent async streams give the synchronous engine's tokens; a stream closed
early (a client disconnect) aborts its request and frees its pages."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest

import beam_jax
from serving.async_engine import AsyncEngine
from serving.engine import LLM, EngineConfig, LLMEngine
from serving.sampling import SamplingParams

CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=32, max_model_len=256)


@pytest.fixture(scope="module")
def beam():
    return beam_jax.load("beam-tiny", dtype=jnp.float32, seed=4)


def test_streams_match_offline_generate_and_disconnects_free_pages(beam):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(16, 8192, n).tolist() for n in (5, 40, 90, 12)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(beam, **CONFIG.__dict__).generate(prompts, params)]

    engine = AsyncEngine(LLMEngine(beam, config=CONFIG))

    async def stream(i):
        tokens = []
        async for out in engine.generate(f"r{i}", prompts[i], params):
            tokens += out.new_token_ids
        return tokens

    async def disconnect(i):
        async for out in engine.generate(f"gone{i}", prompts[i], SamplingParams(max_tokens=200, ignore_eos=True)):
            if out.new_token_ids:
                break  # leaving the loop closes the generator: the request is aborted

    async def main():
        results = await asyncio.gather(*(stream(i) for i in range(4)), *(disconnect(i) for i in range(4)))
        return results[:4]

    try:
        assert asyncio.run(main()) == expected
        stats = engine.stats()
        assert stats["running"] == stats["waiting"] == 0
        with engine._lock:
            engine.engine.prefix_cache.reset()
            assert engine.engine.pool.num_free == engine.engine.pool.num_pages
    finally:
        engine.shutdown()


def test_bad_request_raises_and_engine_keeps_serving(beam):
    engine = AsyncEngine(LLMEngine(beam, config=CONFIG))

    async def main():
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("bad", [], SamplingParams()):
                pass
        return [out async for out in engine.generate("ok", [20, 30], SamplingParams(max_tokens=3, ignore_eos=True))]

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()
