"""A 65,600-token prompt plus 32 decode steps on fp32 beam-tiny (random weights) through the engine,
on CPU, in a pool with only the pages the sequence needs once sliding pages are released (issue 5:
"a long sequence (>= 64K tokens) runs on beam-tiny on CPU with sliding pages released").

The prompt is prefilled in chunks of 4,096 tokens, so each step's sliding-layer queries reach back a
window (16) from the chunk's first token: a sliding group holds the pages straddled by
`[first query - 15, last query]`, the same 257 pages (of 16 tokens) at 8K tokens as at 64K, and at
most 2 pages while decoding. The full-attention group holds the whole history, growing linearly.
Were sliding pages kept, the pool would run out at 40% of the prompt and the request would end
with "length" before producing a token.

Attention past the reference's gather limit runs the blocked jnp form (pallas_kernels/
paged_attention.py), which visits only the pages a query block can see: the reference would gather
68 GiB of keys and values per layer for one 4,096-token chunk over this 70K-token page table.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np
import pytest

from beam_jax.api import Beam
from beam_jax.config import preset
from beam_jax.memory_plan import ceil_div
from beam_jax.model import init_params
from beam_jax.tokenizer import load_tokenizer
from serving.engine import EngineConfig, LLMEngine
from serving.kv_cache import KVPool, sliding_groups
from serving.sampling import SamplingParams

CONFIG = dataclasses.replace(preset("beam-tiny"), max_position_embeddings=70_000)
PROMPT_TOKENS = 65_600
DECODE_TOKENS = 32
CHUNK = 4096
PAGE = 16


@pytest.mark.slow
def test_65k_token_sequence_runs_with_sliding_pages_released():
    window = CONFIG.sliding_window
    groups = KVPool.from_config(CONFIG, 0, page_tokens=PAGE).groups
    sliding = sliding_groups(groups)
    full = [g for g in range(len(groups)) if g not in sliding]
    assert len(full) == 1 and len(sliding) == 2
    total = PROMPT_TOKENS + DECODE_TOKENS - 1  # the last sampled token is never fed back
    # Exactly the sequence's peak with release: the full history plus a window and a chunk per group.
    num_pages = KVPool(groups, 0, page_tokens=PAGE).pages_for_sequence(total, chunk_tokens=CHUNK)
    assert num_pages == ceil_div(total, PAGE) + 2 * (ceil_div(window + CHUNK - 2, PAGE) + 1)
    assert num_pages < 0.4 * len(groups) * ceil_div(PROMPT_TOKENS, PAGE)  # what the prompt needs without release

    beam = Beam(CONFIG, init_params(CONFIG, seed=0, dtype=jnp.float32), load_tokenizer())
    settings = EngineConfig(
        max_num_seqs=1,
        max_num_batched_tokens=CHUNK,
        max_model_len=CONFIG.max_position_embeddings,
        page_tokens=PAGE,
        num_pages=num_pages,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(beam, config=settings)
    pool = engine.pool
    assert pool.groups == groups and pool.num_pages == num_pages
    prompt = np.random.default_rng(0).integers(16, CONFIG.vocab_size, PROMPT_TOKENS).tolist()
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True))
    [request] = engine.scheduler.waiting

    started = time.perf_counter()
    steps, outputs = [], []  # steps: (first query, tokens in KV, pages held per group, seconds)
    while engine.has_unfinished_requests():
        first_query, step_start = request.num_computed, time.perf_counter()
        outputs += engine.step()
        if request.seq_id in pool:
            pool.check_invariants()
            used = pool.used_pages_per_group.tolist()
            steps.append((first_query, request.num_computed, used, time.perf_counter() - step_start))
    elapsed = time.perf_counter() - started

    [final] = [out for out in outputs if out.finished]
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == DECODE_TOKENS
    assert np.isfinite(final.outputs[0].logprobs).all()
    prefill = [s for s in steps if s[1] - s[0] > 1]
    decode = [s for s in steps if s[1] - s[0] == 1]
    assert len(prefill) == ceil_div(PROMPT_TOKENS, CHUNK) and len(decode) == DECODE_TOKENS - 2  # the last frees
    for first_query, tokens, used, _ in steps:
        # Full history: linear in the length.
        assert used[full[0]] == ceil_div(tokens, PAGE)
        # Sliding: the pages straddled by the step's queries' windows, whatever the length.
        span_pages = (tokens - 1) // PAGE - max(0, first_query - window + 1) // PAGE + 1
        assert [used[g] for g in sliding] == [span_pages] * 2, (first_query, tokens, used)
    # Flat: every full chunk after the first holds the same 257 pages per sliding group.
    assert {tuple(used[g] for g in sliding) for first, tokens, used, _ in prefill[1:-1]} == {(257, 257)}
    assert all(used[g] <= 2 for _, _, used, _ in decode for g in sliding)
    peak = pool.peak_pages_per_group
    assert peak[full[0]] == ceil_div(total, PAGE) and peak[sliding].tolist() == [257, 257]
    assert pool.num_used == 0

    print(
        f"\n{PROMPT_TOKENS} + {DECODE_TOKENS} tokens in {elapsed:.1f} s: "
        f"prefill steps {sum(s[3] for s in prefill):.1f} s (last chunk {prefill[-2][3]:.1f} s), "
        f"decode {np.mean([s[3] for s in decode]) * 1e3:.0f} ms/token; peak pages {peak.tolist()} of {num_pages}"
    )
