"""The host-side KV page pool: group layout from the planner, page-boundary allocation, sliding
release against a brute-force visibility definition, random workloads with the invariant checked
after every operation, atomic failure, speculative rollback, a 64K-token sequence on beam-tiny, and
1M-token admission."""

from __future__ import annotations

import numpy as np
import pytest

from beam_jax.config import preset
from beam_jax.memory_plan import CacheGroup, CacheLayer, ceil_div, plan_memory
from serving.kv_cache import NO_PAGE, KVPool, PoolExhausted, cache_groups, sliding_groups

ONE_MIB_CONTEXT = 1_048_576


def toy_groups(windows: list[int | None]) -> tuple[CacheGroup, ...]:
    """One single-layer group per window (the pool does not care how many layers a group has)."""
    return tuple(CacheGroup(w, (CacheLayer(f"L{i}", w, 64),)) for i, w in enumerate(windows))


def visible_pages(old_tokens: int, new_tokens: int, window: int | None, page_tokens: int) -> set[int]:
    """Brute force, slot by slot: the logical pages the sequence must still hold after a step that
    brings it from `old_tokens` to `new_tokens`. A slot is needed if it is still to be written
    (a page is released only once all its tokens left the window, not before it is full), or if
    it holds a key that some query at `q >= old_tokens` can see (`0 <= q - k < window`); the
    step's first query is at `old_tokens`, and a query can always be placed at `k + window - 1`."""
    first_query = old_tokens
    live = set()
    for k in range(ceil_div(new_tokens, page_tokens) * page_tokens):
        unwritten = k >= new_tokens
        seen = window is None or any(0 <= q - k < window for q in range(max(first_query, k), k + window))
        if unwritten or seen:
            live.add(k // page_tokens)
    return live


def held_pages(pool: KVPool, seq_id: int, group: int) -> set[int]:
    table = pool.page_table(seq_id, group)
    return {int(j) for j in np.flatnonzero(table != NO_PAGE)}


def state_of(pool: KVPool) -> tuple:
    """Everything that defines the pool's state, for comparing before and after a failed call."""
    seqs = {
        seq: (
            st.num_tokens,
            tuple(st.first_live),
            tuple(pool.page_table(seq, g).tobytes() for g in range(len(pool.groups))),
        )
        for seq, st in pool._seqs.items()
    }
    return (
        pool._free[: pool._num_free].tobytes(),
        pool._refcount.tobytes(),
        pool._external_refs.tobytes(),
        pool._owner_group.tobytes(),
        pool._owner_logical.tobytes(),
        pool._used.tobytes(),
        pool._peak.tobytes(),
        seqs,
    )


# ---- the group layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter, full_layers", [(True, 14), (False, 9)])
def test_groups_for_beam_501b_match_the_planner(drafter: bool, full_layers: int):
    plan = plan_memory(preset("beam-501b"), tp=8, quant="nvfp4", drafter=drafter)
    groups = cache_groups(preset("beam-501b"), tp=8, drafter=drafter)
    assert groups == plan.cache_groups
    assert [g.window for g in groups] == [None] + [512] * 5
    assert [len(g.layers) for g in groups] == [full_layers, 9, 9, 9, 8, 8]
    pool = KVPool.from_plan(plan)
    assert pool.groups == plan.cache_groups and pool.num_pages == plan.pool_pages
    assert pool.page_bytes == plan.page_bytes
    # Sizing from the same budget by hand gives the planner's page count.
    assert KVPool.from_budget(groups, plan.usable_kv_bytes).num_pages == plan.pool_pages
    budget = plan.hbm_bytes - plan.weights.total - plan.drafter_weight_bytes - plan.reserve_bytes
    assert KVPool.from_budget(groups, budget, mem_fraction=0.5).num_pages == int(budget * 0.5) // plan.page_bytes


def test_one_mib_sequence_is_admitted_on_the_planned_pool():
    plan = plan_memory(preset("beam-501b"), tp=8, quant="nvfp4", drafter=True)
    pool = KVPool.from_plan(plan)
    # 16,384 full-history pages plus 9 per sliding group (a 512-token window straddles 9 pages).
    assert pool.pages_for_sequence(ONE_MIB_CONTEXT) == plan.pages_per_session == 16_384 + 5 * 9
    assert pool.can_admit(ONE_MIB_CONTEXT)
    # Fill the pool with sequences until fewer pages than that remain: admission flips.
    # Fill the pool (64K-token prompts in one chunk hold 1,024 pages in each of the 6 groups)
    # until fewer pages than that remain: admission flips.
    seq = 0
    while pool.num_free >= plan.pages_per_session + 6 * 1024:
        pool.allocate(seq, 64 * 1024)
        seq += 1
    pool.allocate(seq, 64 * ((pool.num_free - plan.pages_per_session) // 6 + 1))
    pool.check_invariants()
    assert 0 <= pool.num_free < plan.pages_per_session
    assert not pool.can_admit(ONE_MIB_CONTEXT)
    # The longest sequence that still fits: every free page but the 45 of the sliding groups.
    longest = 64 * (pool.num_free - 5 * 9)
    assert pool.can_admit(longest) and not pool.can_admit(longest + 1)


# ---- allocation across page boundaries ---------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 63, 64, 65, 127, 128, 129, 511, 512, 513, 575, 576, 577, 1000, 4096])
def test_allocation_covers_exactly_the_pages_of_the_tokens(length: int):
    pool = KVPool.from_config(preset("beam-501b"), num_pages=1000, tp=8, drafter=True)
    pool.allocate(7, length)
    pool.check_invariants()
    pages = ceil_div(length, 64)
    # A fresh sequence's first step has queries at every position from 0: nothing is released.
    for g in range(len(pool.groups)):
        assert len(pool.page_table(7, g)) == pages and held_pages(pool, 7, g) == set(range(pages))
    assert pool.used_pages_per_group.tolist() == [pages] * 6
    tables = np.stack([pool.page_table(7, g) for g in range(6)])
    assert len(np.unique(tables)) == tables.size  # every slot a distinct page
    # One more token: a new page exactly when `length` was a multiple of 64.
    pool.allocate(7, length + 1)
    pool.check_invariants()
    assert ceil_div(length + 1, 64) == pages + (length % 64 == 0)
    for g, group in enumerate(pool.groups):
        assert held_pages(pool, 7, g) == visible_pages(length, length + 1, group.window, 64)
    held = pool.num_used
    assert pool.free(7) == held and 7 not in pool
    pool.check_invariants()
    assert pool.num_free == pool.num_pages


def test_token_by_token_growth_crosses_page_boundaries():
    pool = KVPool(toy_groups([None, 512]), num_pages=64)
    for total in range(1, 700):
        pool.allocate(0, total)
        assert pool.used_pages_per_group[0] == ceil_div(total, 64)
        # Decoding: a window of 512 keys ending at the next query straddles at most 9 pages.
        assert pool.used_pages_per_group[1] == len(visible_pages(total - 1, total, 512, 64)) <= 9
    pool.check_invariants()
    assert pool.peak_pages_per_group.tolist() == [11, 9]


# ---- sliding release, page by page -------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_sliding_pages_are_released_exactly_when_their_tokens_leave_the_window(seed: int):
    rng = np.random.default_rng(seed)
    page_tokens = int(rng.choice([1, 4, 8, 16]))
    windows = [None, *(int(w) for w in rng.integers(1, 40, size=3)), int(page_tokens), int(page_tokens + 1)]
    pool = KVPool(toy_groups(windows), num_pages=6 * 400, page_tokens=page_tokens)
    total = 0
    while total < 300:
        old = total
        total += int(rng.choice([0, 1, 1, 1, 2, rng.integers(1, 3 * page_tokens + 40)]))
        pool.allocate(3, total)
        pool.check_invariants()
        for g, window in enumerate(windows):
            assert held_pages(pool, 3, g) == visible_pages(old, total, window, page_tokens), (g, window, old, total)
        if rng.random() < 0.2:
            # An explicit release at the next query's position: the same definition, no query added.
            pool.release_out_of_window(3, total)
            pool.check_invariants()
            for g, window in enumerate(windows):
                assert held_pages(pool, 3, g) == visible_pages(total, total, window, page_tokens)
    assert sliding_groups(pool.groups) == [1, 2, 3, 4, 5]
    pool.free(3)
    pool.check_invariants()
    assert pool.num_free == pool.num_pages and pool.used_pages_per_group.sum() == 0


# ---- random workloads ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_exact_accounting_and_leaks_nothing(seed: int):
    rng = np.random.default_rng(100 + seed)
    page_tokens = int(rng.choice([4, 16, 64]))
    groups = toy_groups([None, None, 3 * page_tokens, 5 * page_tokens + 3, int(rng.integers(1, 8 * page_tokens))])
    pool = KVPool(groups, num_pages=int(rng.integers(60, 400)), page_tokens=page_tokens)
    next_id, failures = 0, 0
    for _ in range(600):
        live = pool.seq_ids
        op = rng.random()
        is_new = not live or op < 0.15
        if is_new:
            seq, total = next_id, int(rng.integers(1, 6 * page_tokens))
            next_id += 1
        elif op < 0.3:
            seq = int(rng.choice(live))
            pool.free(seq)
            assert seq not in pool
            pool.check_invariants()
            continue
        else:
            seq = int(rng.choice(live))
            step = 1 if op < 0.7 else int(rng.integers(0, 3 * page_tokens))
            total = pool.num_tokens(seq) + step
        before = state_of(pool)
        try:
            pool.allocate(seq, total)
        except PoolExhausted as error:
            failures += 1
            assert state_of(pool) == before and (seq in pool) == (not is_new)
            assert error.pages_needed > error.pages_free + error.pages_released
        pool.check_invariants()
        assert pool.num_used == pool.used_pages_per_group.sum() <= pool.peak_pages
    assert failures > 0, "the pool was never exhausted: the test is too lenient"
    for seq in pool.seq_ids:
        pool.free(seq)
        pool.check_invariants()
    assert pool.num_free == pool.num_pages and pool.used_pages_per_group.sum() == 0
    assert sorted(pool._free.tolist()) == list(range(pool.num_pages))


def test_exhausted_pool_fails_atomically_and_counts_released_pages():
    page_tokens = 4
    pool = KVPool(toy_groups([None, 8]), num_pages=10, page_tokens=page_tokens)
    pool.allocate(0, 16)  # 4 pages per group: 8 held, 2 free
    pool.check_invariants()
    before = state_of(pool)
    with pytest.raises(PoolExhausted, match="needs 6 new pages but only 2 are free") as caught:
        pool.allocate(0, 28)  # 3 more pages per group; query 16 sees keys 9.., releasing pages 0 and 1
    assert (caught.value.pages_needed, caught.value.pages_free, caught.value.pages_released) == (6, 2, 2)
    assert state_of(pool) == before
    pool.check_invariants()
    with pytest.raises(PoolExhausted):
        pool.allocate(1, 12)  # a new sequence: nothing changes, and it is not created
    assert 1 not in pool and state_of(pool) == before
    # 2 free + 2 released cover 2 more pages per group.
    pool.allocate(0, 24)
    pool.check_invariants()
    assert pool.num_free == 0 and pool.page_table(0, 1).tolist()[:2] == [NO_PAGE, NO_PAGE]
    with pytest.raises(ValueError, match="cannot shrink"):
        pool.allocate(0, 10)


# ---- speculative rollback ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_truncate_drops_rejected_drafts_in_every_group(seed: int):
    """Speculative steps: grow by a verify block of k+1 tokens, keep the accepted j+1 (j <= k), as
    serving.speculative's caller does. After each rollback the sequence holds exactly the pages a plain
    step from the old length to the kept one would have left it (brute force), in full and sliding
    groups; the pages of rejected positions are free and handed out again."""
    rng = np.random.default_rng(200 + seed)
    page_tokens = (1, 4, 8, 16)[seed]
    windows = [None, int(page_tokens), int(rng.integers(1, 30)), 3 * page_tokens + 1]
    pool = KVPool(toy_groups(windows), num_pages=4 * 200, page_tokens=page_tokens)
    length = int(rng.integers(1, 20))
    pool.allocate(5, length)
    freed_total = 0
    while length < 400:
        drafts = int(rng.integers(1, 17))
        pool.allocate(5, length + drafts + 1)
        held = pool.num_used
        accepted = int(rng.integers(0, drafts + 1))
        kept = length + accepted + 1
        freed = pool.truncate(5, kept)
        pool.check_invariants()
        assert pool.num_tokens(5) == kept and pool.num_used == held - freed
        for g, window in enumerate(windows):
            assert held_pages(pool, 5, g) == visible_pages(length, kept, window, page_tokens), (g, length, kept)
        freed_total += freed
        length = kept
    assert freed_total > 0, "no rollback crossed a page: the test is too lenient"
    # A block of two pages rejected whole: its pages are free and the next ones handed out.
    first_rejected = ceil_div(length, page_tokens)
    pool.allocate(5, first_rejected * page_tokens + 2 * page_tokens)
    rejected = {int(page) for g in range(4) for page in pool.page_table(5, g)[first_rejected:]}
    assert len(rejected) == 8 and pool.truncate(5, length) == 8
    assert all(len(pool.page_table(5, g)) == first_rejected for g in range(4))
    pool.allocate(6, 2 * page_tokens)
    assert {int(page) for g in range(4) for page in pool.page_table(6, g)} == rejected
    pool.check_invariants()
    pool.free(5)
    pool.free(6)
    pool.check_invariants()
    assert pool.num_free == pool.num_pages


def test_truncate_refuses_what_it_cannot_undo():
    page_tokens = 4
    pool = KVPool(toy_groups([None, 8]), num_pages=40, page_tokens=page_tokens)
    pool.allocate(0, 12)
    pool.allocate(0, 30)  # released at 12: query 12 sees keys 5.., so logical page 0 is gone
    assert pool.page_table(0, 1)[0] == NO_PAGE
    before = state_of(pool)
    with pytest.raises(ValueError, match="released pages a query at 4 sees"):
        pool.truncate(0, 4)  # query 4 would need keys 0..3 back
    with pytest.raises(ValueError, match="cannot truncate"):
        pool.truncate(0, 31)
    assert state_of(pool) == before
    assert pool.truncate(0, 12) == 2 * (ceil_div(30, 4) - 3)  # back to where the release happened
    pool.check_invariants()
    # A cached prefix is read-only: rolling back into its last page would write into a shared page.
    pool.add_refs(pool.page_table(0, 0)[:3])
    pool.add_refs(pool.page_table(0, 1)[1:3])
    pool.share_prefix(1, [pool.page_table(0, 0)[:3], pool.page_table(0, 1)[:3]], 12)
    pool.allocate(1, 16)
    before = state_of(pool)
    with pytest.raises(ValueError, match="shared page"):
        pool.truncate(1, 11)
    assert state_of(pool) == before
    assert pool.truncate(1, 12) == 2  # to the page boundary: its own page goes, the shared ones stay
    pool.check_invariants()
    assert pool.free(0) == 0  # every page of sequence 0 is also the cache's and sequence 1's
    pool.check_invariants()


# ---- long sequences --------------------------------------------------------------------------------
def test_long_sequence_on_beam_tiny_keeps_sliding_pages_flat():
    config = preset("beam-tiny")  # window 16, 2 full and 4 sliding layers -> 1 full + 2 sliding groups
    pool = KVPool.from_config(config, num_pages=1200)
    assert [g.window for g in pool.groups] == [None, 16, 16]
    sliding = sliding_groups(pool.groups)
    rng = np.random.default_rng(7)
    total, max_chunk, full_usage = 0, 1100, []
    while total < 65_536 + 1000:
        old, total = total, total + int(rng.integers(900, max_chunk + 1))
        pool.allocate(0, total)
        pool.check_invariants()
        full_usage.append((total, int(pool.used_pages_per_group[0])))
        for g in sliding:
            # The step's queries reach 15 tokens back from `old`: the span [old - 15, total - 1].
            span_pages = (total - 1) // 64 - max(0, old - 15) // 64 + 1
            assert pool.used_pages_per_group[g] == span_pages
    assert all(used == ceil_div(tokens, 64) for tokens, used in full_usage)  # linear in length
    # A chunked prefill holds a window plus a chunk: the same bound at 8K tokens as at 64K.
    bound = pool.pages_for_sequence(total, chunk_tokens=max_chunk) - ceil_div(total, 64)
    assert pool.peak_pages_per_group[sliding].sum() <= bound == 2 * (ceil_div(16 + max_chunk - 2, 64) + 1)
    assert pool.peak_pages_per_group[0] == ceil_div(total, 64) >= 1024
    # Then decode token by token: each sliding group holds at most ceil(15 / 64) + 1 = 2 pages.
    for step in range(300):
        total += 1
        pool.allocate(0, total)
        if step == 0:
            pool.reset_peak()  # from here on only decode steps
        span_pages = (total - 1) // 64 - (total - 1 - 15) // 64 + 1
        assert pool.used_pages_per_group[sliding].tolist() == [span_pages] * 2
    pool.check_invariants()
    assert pool.peak_pages_per_group[sliding].tolist() == [2, 2]
    assert pool.pages_for_sequence(total) == ceil_div(total, 64) + 2 * 2


def test_page_tables_are_padded_int32_for_the_runner():
    pool = KVPool(toy_groups([None, 8]), num_pages=40, page_tokens=4)
    pool.allocate(10, 5)
    pool.allocate(11, 30)
    pool.allocate(11, 31)
    full = pool.page_tables([11, 10], 0)
    assert full.dtype == np.int32 and full.shape == (2, 8)
    assert full[1, 2:].tolist() == [NO_PAGE] * 6 and np.all(full[1, :2] >= 0) and np.all(full[0] >= 0)
    window = pool.page_tables([10, 11], 1, max_pages=16)
    assert window.shape == (2, 16)
    # Query 30 sees keys 23..30: logical pages 5..7 live, 0..4 released.
    assert np.flatnonzero(window[1] != NO_PAGE).tolist() == [5, 6, 7]
    assert pool.page_tables([], 1).shape == (0, 0)
    with pytest.raises(ValueError, match="shorter"):
        pool.page_tables([11], 0, max_pages=4)
