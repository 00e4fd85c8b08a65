"""The model on the paged KV cache gives the contiguous-cache model's logits (fp32, random weights).

Three layers: sliding (window 8) dense, full sparse, sliding sparse. The serving pool splits the two
sliding layers into two cache groups (split limit = one full layer), so the three layers live in
three groups with their own page tables. Pages hold 8 tokens; prompts of 50 and 23 tokens cross the
window many times. A run feeds each prompt in chunks of a fixed size (one chunk, 7, 1), packs all
sequences into one flat ragged step padded to a fixed number of tokens, and takes page tables and
slot mappings from `serving.kv_cache.KVPool`, which releases out-of-window sliding pages (-1 entries)
and hands them out again. The page arrays start as large random garbage so that a read of a page
the step should not see shows. Ground truth: `forward` with the contiguous `KVCache`, one prefill.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig
from beam_jax.kv_cache import KVCache
from beam_jax.model import forward
from beam_jax.paged_cache import PagedBatch, PagedKVCache
from serving.kv_cache import KVPool
from serving.runner import layer_groups
from tests.beam_jax.random_params import randomized_fp32_params

CONFIG = BeamConfig(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=8,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    layer_types=(SLIDING, FULL, SLIDING),
    mlp_layer_types=(DENSE, SPARSE, SPARSE),
    max_position_embeddings=128,
    initializer_range=0.2,
)
PAGE = 8
NUM_PAGES = 32  # 7 + 3 pages per group at most: sliding pages must be released and reused
MAX_PAGES = 8  # page-table width (64 tokens)
CACHE_LEN = 64
LENGTHS = (50, 23)
TOLERANCE = 1e-5

FORWARD = jax.jit(forward, static_argnames=("config", "hidden_layers", "return_routing"))


@pytest.fixture(scope="module")
def params():
    return randomized_fp32_params(CONFIG)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, CONFIG.vocab_size, length).astype(np.int32) for length in LENGTHS]


@pytest.fixture(scope="module")
def truth(params, prompts):
    """Contiguous-cache logits `[length, vocab]` of each prompt, one prefill each."""
    out = []
    for prompt in prompts:
        cache = KVCache.create(CONFIG, 1, CACHE_LEN, jnp.float32)
        positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
        logits = FORWARD(params, jnp.asarray(prompt)[None], positions, cache, config=CONFIG).logits
        out.append(np.asarray(logits)[0])
    return out


def garbage_cache(groups: tuple[int, ...], use_kernel=False, fused=True) -> PagedKVCache:
    cache = PagedKVCache.create(
        CONFIG, NUM_PAGES, PAGE, groups, jnp.float32, use_kernel=use_kernel, interpret=bool(use_kernel), fused=fused
    )
    rng = np.random.default_rng(2)
    noise = lambda pages: jnp.asarray(10 * rng.standard_normal(pages.shape), jnp.float32)
    return dataclasses.replace(cache, k_pages=noise(cache.k_pages), v_pages=noise(cache.v_pages))


def run_paged(params, prompts, chunk: int | tuple[int, ...], step_tokens: int, use_kernel=False, fused=True):
    """Feed prompt s `chunk[s]` tokens per step (an int: the same for all), all sequences in one
    ragged step padded to `step_tokens` flat tokens. With `use_kernel` (interpret mode), a step whose
    sequences all have one token or none is marked `decode_only`, and `fused` picks whether the layers
    hand their per-head work to the kernels (`PagedKVCache.fuses_attention`). Returns each prompt's
    logits `[length, vocab]` and the number of released (-1) page-table entries seen before a live entry."""
    chunks = (chunk,) * len(prompts) if isinstance(chunk, int) else chunk
    pool = KVPool.from_config(CONFIG, NUM_PAGES, page_tokens=PAGE)
    groups = layer_groups(pool, CONFIG.num_hidden_layers)
    seq_ids = list(range(len(prompts)))
    cache = garbage_cache(groups, use_kernel, fused)
    done = [0] * len(prompts)
    logits = [[] for _ in prompts]
    holes = 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        q_lens = [min(c, len(p) - d) for c, d, p in zip(chunks, done, prompts)]
        for s, (d, q) in enumerate(zip(done, q_lens)):
            pool.allocate(s, d + q)
        pool.check_invariants()
        tokens = np.zeros(step_tokens, np.int32)
        positions = np.zeros(step_tokens, np.int32)
        slots = np.full((len(pool.groups), step_tokens), -1, np.int32)
        query_start = np.zeros(len(prompts) + 1, np.int32)
        at = 0
        for s, (d, q) in enumerate(zip(done, q_lens)):
            pos = np.arange(d, d + q)
            tokens[at : at + q] = prompts[s][d : d + q]
            positions[at : at + q] = pos
            for g in range(len(pool.groups)):
                table = pool.page_table(s, g)
                assert (table[pos // PAGE] >= 0).all()
                slots[g, at : at + q] = table[pos // PAGE] * PAGE + pos % PAGE
            at += q
            query_start[s + 1] = at
        assert at <= step_tokens
        tables = tuple(pool.page_tables(seq_ids, g, max_pages=MAX_PAGES) for g in range(len(pool.groups)))
        for table in tables:
            for row in table:
                live = np.flatnonzero(row >= 0)
                holes += int((row[: live[0]] < 0).sum()) if len(live) else 0
        batch = PagedBatch(
            query_start=jnp.asarray(query_start),
            seq_lens=jnp.asarray([d + q for d, q in zip(done, q_lens)], jnp.int32),
            page_tables=tuple(jnp.asarray(t) for t in tables),
            slot_mappings=tuple(jnp.asarray(s) for s in slots),
            decode_only=bool(use_kernel) and max(q_lens) <= 1,
        )
        tokens, positions = jnp.asarray(tokens)[None], jnp.asarray(positions)[None]
        out = FORWARD(params, tokens, positions, cache.with_batch(batch), config=CONFIG)
        cache = out.cache
        step_logits = np.asarray(out.logits)[0]
        for s in seq_ids:
            logits[s].append(step_logits[query_start[s] : query_start[s + 1]])
            done[s] += q_lens[s]
    return [np.concatenate(parts) for parts in logits], holes


def assert_logits_match(actual, expected, what: str):
    """Relative error at every position: max |diff| over the vocabulary / max |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    error = np.abs(actual - expected).max(-1) / np.abs(expected).max(-1)
    assert error.max() <= TOLERANCE, f"{what}: rel err {error.max():.2e} at position {error.argmax()}"


def test_layers_live_in_three_groups():
    pool = KVPool.from_config(CONFIG, NUM_PAGES, page_tokens=PAGE)
    assert len(pool.groups) == 3
    assert sorted(layer_groups(pool, CONFIG.num_hidden_layers)) == [0, 1, 2]


@pytest.mark.parametrize("chunk", [50, 7, 1], ids=["one_chunk", "chunks_of_7", "decode"])
def test_single_sequence(params, prompts, truth, chunk):
    step_tokens = 56 if chunk == 50 else chunk
    (logits,), holes = run_paged(params, prompts[:1], chunk, step_tokens)
    assert_logits_match(logits, truth[0], f"chunk {chunk}")
    if chunk < 50:
        assert holes > 0, "the pool should have released sliding pages"


@pytest.mark.parametrize("chunk", [7, 1, 64], ids=["chunks_of_7", "decode", "one_chunk"])
def test_two_sequences_in_one_ragged_batch(params, prompts, truth, chunk):
    step_tokens = 80 if chunk == 64 else 2 * chunk + 3  # padding tokens at the end of every step
    (first, second), holes = run_paged(params, prompts, chunk, step_tokens)
    assert_logits_match(first, truth[0], f"sequence 0, chunk {chunk}")
    assert_logits_match(second, truth[1], f"sequence 1, chunk {chunk}")
    if chunk < 64:
        assert holes > 0


@pytest.fixture(scope="module")
def decode_path(params, prompts):
    """`run_paged` on the GPU's attention path, each (chunks, step_tokens, fused) run once per module."""
    runs = {}

    def run(chunks, step_tokens, fused=True):
        if (chunks, step_tokens, fused) not in runs:
            runs[chunks, step_tokens, fused] = run_paged(
                params, prompts, chunks, step_tokens, use_kernel="decode", fused=fused
            )
        return runs[chunks, step_tokens, fused]

    return run


@pytest.mark.parametrize(
    "chunks, step_tokens",
    [((7, 1), 11), ((1, 1), 5), ((64, 64), 80)],
    ids=["prefill_chunks_beside_decodes", "decodes_only", "one_chunk_each"],
)
def test_decode_kernel_path_matches_contiguous_cache(decode_path, truth, chunks, step_tokens):
    """The GPU's attention path (`use_kernel="decode"`: decode tokens on the split decode kernel, in
    interpret mode here, with the q/k norms, RoPE / SSMax and the output gate fused into the kernels;
    prefill chunks in plain jnp) gives the contiguous cache's logits. Chunks (7, 1): sequence 0 (50
    tokens) runs in chunks of 7 beside sequence 1 (23 tokens) fed one token per step: 7 mixed steps,
    then decode-only steps (sequence 0's last token, then its row empty)."""
    (first, second), holes = decode_path(chunks, step_tokens)
    assert_logits_match(first, truth[0], f"sequence 0, chunks {chunks}")
    assert_logits_match(second, truth[1], f"sequence 1, chunks {chunks}")
    if chunks[0] < 64:
        assert holes > 0


def test_fused_attention_gives_the_unfused_logits(decode_path):
    """On the decode kernel path, the layers handing raw projections to the kernels (q norm + RoPE /
    SSMax in the decode kernel, k norm + RoPE in the page write, the gate in the combine) give the
    logits of the layers doing that work in plain jnp around the same kernels: mixed and decode-only
    steps, sliding and full layers. The same rounding points, so only fp32 summation-order noise (a
    norm's sum in another order flips last bits; fp32 eps is 1.2e-7), well inside the paged-vs-contiguous
    tolerance."""
    fused, _ = decode_path((7, 1), 11, fused=True)
    unfused, _ = decode_path((7, 1), 11, fused=False)
    for s, (got, want) in enumerate(zip(fused, unfused)):
        error = np.abs(got - want).max(-1) / np.abs(want).max(-1)
        assert error.max() <= TOLERANCE / 4, f"sequence {s}: rel err {error.max():.2e} at position {error.argmax()}"


def test_truth_is_not_trivial(truth):
    assert np.isfinite(truth[0]).all()
    assert np.abs(truth[0]).max() > 1.0
    assert len({int(a) for a in truth[0].argmax(-1)}) > 5


def test_cache_holds_what_the_pool_budgets():
    """One slot per layer of the largest group per page: the device cache is the planner's pool."""
    from beam_jax.config import preset

    config = preset("beam-tiny")
    pool = KVPool.from_config(config, 10, page_tokens=16)
    groups = layer_groups(pool, config.num_hidden_layers)
    cache = PagedKVCache.create(config, 10, 16, groups, jnp.bfloat16)
    assert cache.k_pages.nbytes + cache.v_pages.nbytes == pool.page_bytes * 10
    assert len(set(groups)) > 1 and cache.slots < config.num_hidden_layers


def paged_step(params, cache, pool, items, step_tokens: int = 32):
    """One ragged step: `items` are `(seq_id, tokens)`, each appended at the sequence's current
    length (`pool.allocate` grows it first). Returns the cache and each item's logits."""
    starts = [pool.num_tokens(s) if s in pool else 0 for s, _ in items]
    for (seq, tokens), start in zip(items, starts):
        pool.allocate(seq, start + len(tokens))
    pool.check_invariants()
    flat_tokens = np.zeros(step_tokens, np.int32)
    positions = np.zeros(step_tokens, np.int32)
    slots = np.full((len(pool.groups), step_tokens), -1, np.int32)
    query_start, at = [0], 0
    for (seq, tokens), start in zip(items, starts):
        pos = np.arange(start, start + len(tokens))
        flat_tokens[at : at + len(tokens)] = tokens
        positions[at : at + len(tokens)] = pos
        for g in range(len(pool.groups)):
            slots[g, at : at + len(tokens)] = pool.page_table(seq, g)[pos // PAGE] * PAGE + pos % PAGE
        at += len(tokens)
        query_start.append(at)
    seq_ids = [seq for seq, _ in items]
    tables = [pool.page_tables(seq_ids, g, max_pages=MAX_PAGES) for g in range(len(pool.groups))]
    batch = PagedBatch(
        query_start=jnp.asarray(query_start, jnp.int32),
        seq_lens=jnp.asarray([start + len(tokens) for (_, tokens), start in zip(items, starts)], jnp.int32),
        page_tables=tuple(jnp.asarray(t) for t in tables),
        slot_mappings=tuple(jnp.asarray(s) for s in slots),
    )
    tokens, positions = jnp.asarray(flat_tokens)[None], jnp.asarray(positions)[None]
    out = FORWARD(params, tokens, positions, cache.with_batch(batch), config=CONFIG)
    logits = np.asarray(out.logits)[0]
    return out.cache, [logits[query_start[i] : query_start[i + 1]] for i in range(len(items))]


@pytest.mark.parametrize("accepted", [3, 0, 12], ids=["accept_3_of_13", "reject_all", "accept_12_of_13"])
def test_rejected_drafts_are_rolled_back(params, prompts, truth, accepted):
    """Speculative decoding on the paged cache: after 30 tokens, a verify block writes K/V for 13 more
    (the first `accepted` true, the rest wrong), the pool rolls the sequence back to the accepted
    length (`KVPool.truncate`), another sequence takes the freed pages and writes its own K/V there,
    then the true tokens go in one at a time. Every logit equals the contiguous-cache run of the true
    tokens: the rejected K/V, in freed pages and in the kept page's later slots, is never seen."""
    prompt, start, block = prompts[0], 30, 13
    pool = KVPool.from_config(CONFIG, NUM_PAGES, page_tokens=PAGE)
    cache = garbage_cache(layer_groups(pool, CONFIG.num_hidden_layers))
    cache, (logits,) = paged_step(params, cache, pool, [(0, prompt[:start])])
    assert_logits_match(logits, truth[0][:start], "prefix")

    rng = np.random.default_rng(3)
    wrong = (prompt[start : start + block] + rng.integers(1, CONFIG.vocab_size, block)) % CONFIG.vocab_size
    drafts = np.concatenate([prompt[start : start + accepted], wrong[accepted:]]).astype(np.int32)
    cache, (logits,) = paged_step(params, cache, pool, [(0, drafts)])
    # Logits of the accepted drafts' positions are right; the rejected ones' are not the truth's.
    if accepted:
        assert_logits_match(logits[:accepted], truth[0][start : start + accepted], "accepted drafts")
    assert np.abs(logits[accepted:] - truth[0][start + accepted : start + block]).max(-1).min() > 1e-2

    kept = start + accepted
    held = pool.num_used
    freed = pool.truncate(0, kept)
    pool.check_invariants()
    expected_freed = len(pool.groups) * (-(-(start + block) // PAGE) - -(-kept // PAGE))
    assert freed == expected_freed and pool.num_used == held - freed
    if freed:
        # The freed pages are the next ones handed out: sequence 1 writes its own K/V into them.
        released = set(pool._free[pool._num_free - freed : pool._num_free].tolist())
        other = rng.integers(0, CONFIG.vocab_size, freed // len(pool.groups) * PAGE).astype(np.int32)
        cache, _ = paged_step(params, cache, pool, [(1, other)])
        assert {int(page) for g in range(len(pool.groups)) for page in pool.page_table(1, g)} == released

    got = []
    for position in range(kept, len(prompt)):
        items = [(0, prompt[position : position + 1])] + ([(1, other[:1])] if freed else [])
        cache, (logits, *_) = paged_step(params, cache, pool, items)
        got.append(logits)
    assert_logits_match(np.concatenate(got), truth[0][kept:], f"after rolling back to {kept}")


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_mosaic_decode_takes_its_query_prologue_from_the_write_kernel(monkeypatch, kind):
    """When the decode kernel is the Mosaic GPU one, `attend` has the K/V write kernel apply the query
    prologue too (one launch less) and passes finished queries on. Forced here in interpret mode (the
    model picks it on Hopper only): the output and pages equal the Triton kernel's path, which fuses the
    prologue in its split kernel. bf16, head_dim 128, pages of 64 (the Mosaic kernel's smallest)."""
    from beam_jax import paged_cache
    from pallas_kernels import paged_attention as pa
    from tests.pallas_kernels.test_fused_decode_attention import assert_same_rounding

    config = dataclasses.replace(CONFIG, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                                 num_hidden_layers=1, layer_types=(FULL,), mlp_layer_types=(DENSE,))
    rng = np.random.default_rng(8)
    seq_lens = np.array([130, 64, 200], np.int32)  # decodes at a page's start, end and middle
    batch_size, tokens, page, max_pages = 3, 4, 64, 4  # one padding token
    table = np.full((batch_size, max_pages), -1, np.int32)
    table[0, :3], table[1, :1], table[2, :4] = [5, 1, 7], [3], [0, 2, 4, 6]
    window = None if kind == "full" else 100
    if window:
        table[2, 0] = -1  # out of the window: released
    slots = np.array([table[b, (n - 1) // page] * page + (n - 1) % page for b, n in enumerate(seq_lens)] + [-1])
    batch = PagedBatch(jnp.array([0, 1, 2, 3], jnp.int32), jnp.asarray(seq_lens), (jnp.asarray(table),),
                       (jnp.asarray(slots, jnp.int32),), decode_only=True)
    cache = PagedKVCache.create(config, 8, page, (0,), jnp.bfloat16, use_kernel="decode", interpret=True)
    cache = dataclasses.replace(cache, k_pages=jnp.asarray(rng.standard_normal(cache.k_pages.shape), jnp.bfloat16),
                                v_pages=jnp.asarray(rng.standard_normal(cache.v_pages.shape), jnp.bfloat16))
    cache = cache.with_batch(batch)
    q = jnp.asarray(3 * rng.standard_normal((tokens, 12, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(3 * rng.standard_normal((tokens, 2, 128)), jnp.bfloat16) for _ in range(2))
    positions = np.append(seq_lens - 1, 0).astype(np.float32)
    norm = lambda: jnp.asarray(1 + 0.3 * rng.standard_normal(128), jnp.float32)
    if window:  # RoPE on both
        angles = positions[:, None] / 10000.0 ** (np.arange(0, 128, 2) / 128)[None, :]
        cos, sin = (jnp.asarray(np.tile(f(angles), 2), jnp.float32) for f in (np.cos, np.sin))
        query, key = (pa.HeadPrologue(norm(), 1e-6, rope_cos=cos, rope_sin=sin) for _ in range(2))
    else:  # SSMax on q
        ssmax = jnp.asarray((1 + (positions + 1) / 2048) ** 0.1, jnp.float32)
        query, key = pa.HeadPrologue(norm(), 1e-6, ssmax_scale=ssmax), pa.HeadPrologue(norm(), 1e-6)
    gate = pa.OutputGate(jnp.asarray(rng.standard_normal((tokens, 12, 128)), jnp.bfloat16),
                         jnp.asarray(rng.standard_normal(12), jnp.bfloat16))
    def attend(c):  # traced afresh on each call: the patches below change what it traces
        return jax.jit(lambda c: c.attend(0, q, k, v, window, query_prologue=query, key_prologue=key,
                                          output_gate=gate))(c)

    triton_out, triton_cache = attend(cache)
    default_blocks = pa.default_decode_blocks
    monkeypatch.setattr(paged_cache, "default_decode_blocks", lambda *a, **kw: dataclasses.replace(
        default_blocks(*a, **kw), mosaic_split=True))
    monkeypatch.setattr(pa, "write_kv_kernel", spy := _Spy(pa.write_kv_kernel))
    mosaic_out, mosaic_cache = attend(cache)
    assert spy.with_queries == 1
    # On a GPU, XLA compiles the two interpreted prologues differently: a query one ulp apart moved one
    # output of 4608 by two ulps (H200, run 11).
    assert_same_rounding(mosaic_out[:3], triton_out[:3], jnp.bfloat16, gpu_ulps=2)
    np.testing.assert_array_equal(np.asarray(mosaic_out[3], np.float32), 0.0)  # the padding token
    for got, want in ((mosaic_cache.k_pages, triton_cache.k_pages), (mosaic_cache.v_pages, triton_cache.v_pages)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


class _Spy:
    """Wraps a function and counts the calls that pass `queries`."""

    def __init__(self, fn):
        self.fn, self.with_queries = fn, 0

    def __call__(self, *args, **kwargs):
        self.with_queries += kwargs.get("queries") is not None
        return self.fn(*args, **kwargs)


def test_kernel_states_go_from_layer_to_layer(params, monkeypatch):
    """A paged step makes the routing kernel's state and the one-launch MoE kernel's counters once (`with_batch`),
    and every sparse layer gets the ones the layer before returned (`PagedBatch.routing_state`, `.moe_counters`): a
    routing and experts that return theirs plus one leave the step's batch with one count per sparse layer (the
    real kernels return the state as they found it and the counters an epoch further)."""
    from beam_jax.layers import moe as moe_module
    from pallas_kernels import nvfp4_fused_moe as nfm
    from pallas_kernels import routing as rt

    seen_states, seen_counters = [], []
    compute = moe_module.compute_experts

    def counting_route(*args, state=None, **kwargs):
        seen_states.append(state)
        return (*rt.routing(*args, use_kernel=False, **kwargs), state + 1)

    def counting_experts(*args, counters=None, **kwargs):
        seen_counters.append(counters)
        return compute(*args, **kwargs), counters + 1

    monkeypatch.setattr(moe_module, "route", counting_route)
    monkeypatch.setattr(moe_module, "compute_experts", counting_experts)
    pool = KVPool.from_config(CONFIG, NUM_PAGES, page_tokens=PAGE)
    pool.allocate(0, 3)
    cache = PagedKVCache.create(CONFIG, NUM_PAGES, PAGE, layer_groups(pool, CONFIG.num_hidden_layers), jnp.float32)
    batch = PagedBatch(query_start=jnp.array([0, 3], jnp.int32), seq_lens=jnp.array([3], jnp.int32),
                       page_tables=tuple(jnp.asarray(pool.page_tables([0], g, max_pages=MAX_PAGES))
                                         for g in range(len(pool.groups))),
                       slot_mappings=tuple(jnp.asarray(pool.page_table(0, g)[0] * PAGE + np.arange(3), jnp.int32)
                                           for g in range(len(pool.groups))))
    # A function of its own: jit's trace cache keys on the function, and a trace with these patches must not
    # serve other tests (nor theirs this one).
    out = jax.jit(lambda *args, **kwargs: forward(*args, **kwargs), static_argnames="config")(
        params, jnp.array([[5, 6, 7]]), jnp.array([[0, 1, 2]]), cache.with_batch(batch), config=CONFIG)
    sparse_layers = CONFIG.mlp_layer_types.count(SPARSE)
    assert len(seen_states) == len(seen_counters) == sparse_layers
    assert all(s.shape == (rt.STATE_SLOTS,) for s in seen_states)
    assert all(c.shape == (nfm.COUNTER_SLOTS,) for c in seen_counters)
    np.testing.assert_array_equal(np.asarray(out.cache.batch.routing_state), rt.UNWRITTEN + sparse_layers)
    np.testing.assert_array_equal(np.asarray(out.cache.batch.moe_counters), sparse_layers)
