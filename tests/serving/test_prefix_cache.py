"""Prefix caching over the KV pool: matches against a brute-force reference (token-level window
visibility, the union of what was inserted), the content of every matched page (the tokens its KV
was computed from), shared-page reference counts, LRU eviction that never touches pages in use,
eviction from inside `allocate`, atomic failure, and random workloads that must leak nothing."""

from __future__ import annotations

import numpy as np
import pytest

from beam_jax.config import preset
from beam_jax.memory_plan import ceil_div
from serving.kv_cache import NO_PAGE, KVPool, PoolExhausted
from serving.prefix_cache import PrefixCache, PrefixMatch
from tests.serving.test_kv_cache import state_of, toy_groups

VOCAB = 8192


def visible(page: int, num_tokens: int, window: int | None, page_tokens: int) -> bool:
    """Brute force: does a query at `num_tokens` (the first token to compute) see any key of
    logical page `page`? A key at `k` is visible iff `0 <= q - k < window`."""
    keys = range(page * page_tokens, (page + 1) * page_tokens)
    return window is None or any(0 <= num_tokens - k < window for k in keys)


class Engine:
    """A stand-in for the scheduler and runner: starts sequences on cached prefixes, "computes"
    tokens by allocating, and records for every page it writes the tokens that page's KV depends
    on (the whole prefix through the page's last written slot), so a match can be checked by
    content rather than by page ids. `inserted` lists what went into the cache (for the reference
    match; meaningless once something is evicted)."""

    def __init__(self, pool: KVPool, seed: int = 0):
        self.pool, self.cache = pool, PrefixCache(pool)
        self.rng = np.random.default_rng(seed)
        self.tokens: dict[int, np.ndarray] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        self.inserted: list[tuple[np.ndarray, list[np.ndarray]]] = []

    @property
    def page_tokens(self) -> int:
        return self.pool.page_tokens

    def start(self, seq: int, prompt: np.ndarray) -> PrefixMatch:
        match = self.cache.match(prompt)
        self.check_match(prompt, match)
        self.pool.share_prefix(seq, match.pages_per_group, match.num_tokens)
        self.tokens[seq] = np.asarray(prompt)
        for g in range(len(self.pool.groups)):
            assert np.array_equal(self.pool.page_table(seq, g), match.pages_per_group[g])
        return match

    def compute(self, seq: int, new_total: int) -> None:
        """Allocate up to `new_total` tokens (sampling new ones past the prompt) and write them."""
        old = self.pool.num_tokens(seq)
        extra = new_total - len(self.tokens[seq])
        self.pool.allocate(seq, new_total)
        if extra > 0:
            self.tokens[seq] = np.concatenate([self.tokens[seq], self.rng.integers(0, VOCAB, extra)])
        P = self.page_tokens
        for g in range(len(self.pool.groups)):
            written = self.pool.page_table(seq, g)[old // P : ceil_div(new_total, P)]
            assert np.all(self.pool.refcount(written) == 1), "a sequence writes only its own pages"
            for j, page in enumerate(written, start=old // P):
                self.content[int(page)] = tuple(self.tokens[seq][: min((j + 1) * P, new_total)].tolist())

    def prefill(self, seq: int, prompt: np.ndarray, chunk: int) -> PrefixMatch:
        match = self.start(seq, prompt)
        for total in range(match.num_tokens + chunk, len(prompt) + chunk, chunk):
            self.compute(seq, min(total, len(prompt)))
        return match

    def insert(self, seq: int, num_tokens: int | None = None) -> int:
        tokens = self.tokens[seq][: self.pool.num_tokens(seq) if num_tokens is None else num_tokens]
        full = len(tokens) // self.page_tokens
        self.inserted.append((tokens, [self.pool.page_table(seq, g)[:full] for g in range(len(self.pool.groups))]))
        return self.cache.insert(seq, tokens)

    def check_match(self, prompt: np.ndarray, match: PrefixMatch) -> None:
        """Sound: whole pages, not the whole prompt, and in every group exactly the pages the next
        query can see, each holding the KV of this prompt's own prefix."""
        P, length = self.page_tokens, match.num_tokens // self.page_tokens
        assert match.num_tokens % P == 0 and (match.num_tokens == 0 or match.num_tokens < len(prompt))
        for g, group in enumerate(self.pool.groups):
            table = match.pages_per_group[g]
            assert table.dtype == np.int32 and table.shape == (length,)
            for j, page in enumerate(table):
                if not visible(j, match.num_tokens, group.window, P):
                    assert page == NO_PAGE, (g, j)
                else:
                    assert page != NO_PAGE and self.content[int(page)] == tuple(prompt[: (j + 1) * P].tolist()), (g, j)

    def reference_match(self, prompt: np.ndarray) -> int:
        """The longest whole-page prefix, short of the whole prompt, for which every group has a
        page inserted under the same tokens wherever the next query can see a key."""
        P = self.page_tokens

        def cached(g: int, j: int) -> bool:
            prefix = prompt[: (j + 1) * P]
            return any(len(tokens) >= len(prefix) and np.array_equal(tokens[: len(prefix)], prefix)
                       and tables[g][j] != NO_PAGE for tokens, tables in self.inserted)

        for length in range(max(0, len(prompt) - 1) // P, -1, -1):
            if all(cached(g, j) for g, group in enumerate(self.pool.groups) for j in range(length)
                   if visible(j, length * P, group.window, P)):
                return length * P
        return 0


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n)


def cache_state(cache: PrefixCache) -> tuple:
    """The tree and the statistics, for comparing before and after a call that must change nothing."""
    return cache.stats, sorted((node.key, node.pages.tobytes(), node.last_access) for node in cache._nodes())


# ---- matching --------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_tokens", [1, 4, 8, 16])
def test_match_takes_whole_pages_and_never_the_whole_prompt(page_tokens: int):
    rng = np.random.default_rng(page_tokens)
    P = page_tokens
    engine = Engine(KVPool(toy_groups([None, None]), num_pages=400, page_tokens=P))
    cached = random_tokens(rng, 5 * P)
    engine.prefill(0, cached, chunk=3)
    assert engine.insert(0) == 2 * 5  # five full pages in each of two groups
    cases = {
        5 * P: 4 * P,  # the whole cached prompt: its last page is recomputed for the logits
        5 * P + 1: 5 * P,  # one more token: every cached page is used
        4 * P + 1: 4 * P,
        4 * P: 3 * P,
        1: 0,
        0: 0,
    }
    for length, expected in cases.items():
        prompt = np.concatenate([cached, random_tokens(rng, 3)])[:length]
        match = engine.cache.match(prompt)
        assert match.num_tokens == expected == engine.reference_match(prompt), length
        engine.check_match(prompt, match)
    # A partial last page never matches, even when its tokens agree as far as they go.
    prompt = np.concatenate([cached[: 3 * P + P // 2], random_tokens(rng, 1)])
    assert engine.cache.match(prompt).num_tokens == 3 * P


@pytest.mark.parametrize("seed", range(6))
def test_match_equals_the_reference_for_random_prompts_sharing_random_prefixes(seed: int):
    """beam-tiny's groups (full, and two with a 16-token window) with random page sizes: writers
    prefill prompts that share random prefixes of one document, in random chunks (so they release
    different sliding pages), some from a cached prefix; queries are random cuts and extensions."""
    rng = np.random.default_rng(seed)
    P = int(rng.choice([2, 4, 8, 16]))
    engine = Engine(KVPool.from_config(preset("beam-tiny"), num_pages=3000, page_tokens=P), seed)
    assert [g.window for g in engine.pool.groups] == [None, 16, 16]
    document = random_tokens(rng, 30 * P)
    prompts = []
    for seq in range(8):
        prefix = document[: rng.integers(0, len(document))]
        prompt = np.concatenate([prefix, random_tokens(rng, rng.integers(1, 6 * P))])
        prompts.append(prompt)
        engine.prefill(seq, prompt, chunk=int(rng.integers(1, 4 * P)))
        engine.compute(seq, len(prompt) + int(rng.integers(0, 3 * P)))  # some decoding
        engine.insert(seq, int(rng.integers(0, engine.pool.num_tokens(seq) + 1)) if seq % 3 == 0 else None)
        if rng.random() < 0.5:
            engine.pool.free(seq)
        engine.cache.check_invariants()
    hits = 0
    for _ in range(60):
        if rng.random() < 0.5:  # near the end of something inserted, where its sliding pages are kept
            base = engine.inserted[rng.integers(len(engine.inserted))][0]
            cut = len(base) - int(rng.integers(0, 2 * P))
        else:  # anywhere: mostly where chunked prefills released the sliding pages
            base = prompts[rng.integers(len(prompts))] if rng.random() < 0.7 else document
            cut = int(rng.integers(0, len(base) + 1))
        prompt = np.concatenate([base[: max(0, cut)], random_tokens(rng, rng.integers(0, 3 * P))])
        match = engine.cache.match(prompt)
        assert match.num_tokens == engine.reference_match(prompt)
        engine.check_match(prompt, match)
        hits += match.num_tokens > 0
    assert hits > 10


def test_sliding_groups_match_a_long_prefix_from_the_last_window_alone():
    """A long prompt prefilled in chunks keeps only its last window's sliding pages; it still matches
    in full. A prompt that leaves it where the sliding pages are gone falls back to the longest
    length whose window is cached, and a later writer that still holds them fills those holes."""
    rng = np.random.default_rng(11)
    P, window = 4, 16
    engine = Engine(KVPool.from_config(preset("beam-tiny"), num_pages=600, page_tokens=P))
    long_prompt = random_tokens(rng, 200)
    engine.prefill(0, long_prompt, chunk=8)
    # The last chunk's queries start at 192 and see keys from 177: logical pages 44..49 remain.
    for g in (1, 2):
        assert np.flatnonzero(engine.pool.page_table(0, g) != NO_PAGE).tolist() == list(range(44, 50))
    assert engine.insert(0) == 50 + 2 * 6

    def matched(common: int) -> int:
        prompt = np.concatenate([long_prompt[:common], random_tokens(rng, 9)])
        match = engine.cache.match(prompt)
        engine.check_match(prompt, match)
        assert match.num_tokens == engine.reference_match(prompt)
        return match.num_tokens

    assert matched(200) == 200  # the query at 200 sees keys 185.. (pages 46..49): all cached
    assert matched(196) == 196  # sees pages 45..48
    assert matched(180) == 0  # would need pages 41..44 of the sliding groups; 41..43 were released
    assert matched(120) == 0
    # A second writer prefills the first 120 tokens in one chunk, so it holds every sliding page.
    engine.prefill(1, long_prompt[:120], chunk=120)
    assert engine.insert(1) == 2 * 30  # only the sliding holes: its full-group pages are duplicates
    assert matched(120) == 120
    assert matched(180) == 120  # pages 41..43 are still missing: shortened to the longest usable
    assert matched(200) == 200

    # A sequence started on the long prefix maps only the window in its sliding tables.
    match = engine.start(2, np.concatenate([long_prompt, random_tokens(rng, 5)]))
    assert match.num_tokens == 200
    first_seen = (200 - window + 1) // P  # 46
    for g in (1, 2):
        assert np.flatnonzero(engine.pool.page_table(2, g) != NO_PAGE).tolist() == list(range(first_seen, 50))
    shared = np.stack([engine.pool.page_table(2, g)[first_seen:] for g in (1, 2)])
    engine.pool.free(0)
    engine.compute(2, 205)
    for total in range(206, 240):
        engine.compute(2, total)  # decoding lets go of the shared sliding pages as the window moves on
    assert np.all(engine.pool.page_table(2, 1)[:50] == NO_PAGE)
    assert np.all(engine.pool.refcount(shared) == 1)  # the cache keeps them: the prefix still matches
    assert matched(200) == 200
    engine.cache.check_invariants()


# ---- shared pages ------------------------------------------------------------------------------
def test_shared_pages_are_counted_and_return_to_the_pool_after_every_holder():
    rng = np.random.default_rng(3)
    P = 4
    pool = KVPool.from_config(preset("beam-tiny"), num_pages=200, page_tokens=P)
    engine = Engine(pool)
    prompt = random_tokens(rng, 23)  # 5 full pages and a partial one
    engine.prefill(0, prompt, chunk=23)
    assert engine.insert(0) == 3 * 5
    writer = [pool.page_table(0, g) for g in range(3)]
    assert np.all(pool.refcount(np.concatenate([t[:5] for t in writer])) == 2)  # writer + cache
    assert np.all(pool.refcount(np.stack(writer)[:, 5]) == 1)  # the partial page is not cached

    match = engine.start(1, np.concatenate([prompt, random_tokens(rng, 7)]))
    assert match.num_tokens == 20
    assert pool.refcount(writer[0][:5]).tolist() == [3] * 5
    # The query at 20 sees keys 5..: sliding page 0 is not shared, pages 1..4 are.
    for g in (1, 2):
        assert pool.refcount(writer[g][:5]).tolist() == [2, 3, 3, 3, 3]
    engine.compute(1, 30)
    for g in range(3):
        assert pool.page_table(1, g)[5] not in writer[g]  # its own tokens went to fresh pages
    engine.cache.check_invariants()

    free_before = pool.num_free
    assert pool.free(0) == 3  # only its partial pages: everything else has other holders
    assert pool.num_free == free_before + 3
    engine.cache.check_invariants()
    pool.free(1)
    engine.cache.check_invariants()
    assert np.all(pool.refcount(np.concatenate([t[:5] for t in writer])) == 1)  # the cache alone
    assert engine.cache.stats.cached_pages == 15 == pool.num_used
    assert engine.cache.evict(pool.num_pages) == 15
    engine.cache.check_invariants()
    assert pool.num_free == pool.num_pages and sorted(pool._free.tolist()) == list(range(pool.num_pages))


def test_a_duplicate_insert_leaves_the_sequence_its_own_pages():
    rng = np.random.default_rng(4)
    pool = KVPool(toy_groups([None, 8]), num_pages=100, page_tokens=4)
    engine = Engine(pool)
    prompt = random_tokens(rng, 16)
    for seq in (0, 1):  # the same prompt computed twice, before either was cached
        engine.prefill(seq, prompt, chunk=16)
    assert engine.insert(0) == 8
    assert engine.insert(1) == 0  # nothing new: its pages stay its own
    assert np.all(pool.refcount(pool.page_table(1, 0)) == 1)
    assert pool.free(1) == 8
    engine.cache.check_invariants()
    match = engine.cache.match(np.concatenate([prompt, [1]]))
    assert np.array_equal(match.pages_per_group[0], pool.page_table(0, 0))


def test_a_write_into_a_shared_page_is_refused():
    pool = KVPool(toy_groups([None, 8]), num_pages=20, page_tokens=4)
    pool.allocate(0, 6)
    partial = np.array([pool.page_table(0, g)[1] for g in range(2)])
    pool.add_refs(partial)  # as if someone had cached the half-written page
    with pytest.raises(AssertionError, match="shared page"):
        pool.allocate(0, 7)
    pool.drop_refs(partial)
    pool.allocate(0, 7)
    pool.check_invariants()


def test_share_prefix_rejects_what_it_cannot_share_and_changes_nothing():
    pool = KVPool(toy_groups([None, 8]), num_pages=40, page_tokens=4)
    pool.allocate(0, 16)  # pages for logical 0..3 in both groups
    full, sliding = pool.page_table(0, 0), pool.page_table(0, 1)
    window_only = sliding.copy()
    window_only[:2] = NO_PAGE  # a query at 16 sees keys 9..: pages 2 and 3
    before = state_of(pool)
    bad_calls = {
        "whole pages": ([full[:3], window_only[:3]], 10),
        "expected 2 page tables": ([full], 16),
        "expected 4 pages": ([full[:3], window_only], 16),
        "before the window": ([full, sliding], 16),
        "missing or free": ([np.array([full[0], full[1], full[2], 39]), window_only], 16),
        "another group or position": ([full[[1, 0, 2, 3]], window_only], 16),
    }
    for message, (tables, num_tokens) in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            pool.share_prefix(1, tables, num_tokens)
        assert 1 not in pool and state_of(pool) == before
    with pytest.raises(ValueError, match="exists already"):
        pool.share_prefix(0, [full, window_only], 16)
    pool.share_prefix(1, [full, window_only], 16)
    pool.check_invariants()
    with pytest.raises(ValueError, match="free one"):
        pool.add_refs(np.array([39]))
    with pytest.raises(ValueError, match="never taken"):
        pool.drop_refs(full[:1])


# ---- eviction ----------------------------------------------------------------------------------
def test_eviction_is_least_recently_used_leaf_first():
    rng = np.random.default_rng(5)
    P = 4
    engine = Engine(KVPool(toy_groups([None]), num_pages=60, page_tokens=P))
    cache = engine.cache
    prompts = {name: random_tokens(rng, 3 * P) for name in "abc"}
    for seq, name in enumerate("abc"):
        engine.prefill(seq, prompts[name], chunk=5)
        engine.insert(seq)
        engine.pool.free(seq)
    # "d" shares a's first two pages and adds a third of its own.
    prompts["d"] = np.concatenate([prompts["a"][: 2 * P], random_tokens(rng, P)])
    engine.prefill(3, prompts["d"], chunk=P)
    engine.insert(3)
    engine.pool.free(3)
    assert cache.stats.cached_pages == 10

    def cached_tokens(name: str) -> int:
        return cache.match(np.concatenate([prompts[name], [7]])).num_tokens

    assert cached_tokens("a") == 3 * P  # touches a's pages: b is now the oldest
    assert cache.evict(3) == 3  # b's leaf, then its parents as they become leaves
    assert [cached_tokens(n) for n in "abcd"] == [3 * P, 0, 3 * P, 3 * P]
    assert cache.evict(1) == 1  # the oldest leaf now: a's (touched before c and d just now)
    assert [cached_tokens(n) for n in "abcd"] == [2 * P, 0, 3 * P, 3 * P]
    assert cache.evict(3) == 3  # c's leaf, c's parents... then c is gone and nothing more is taken
    assert [cached_tokens(n) for n in "abcd"] == [2 * P, 0, 0, 3 * P]
    # The shared pages go last: a's and d's first two pages are d's parents.
    assert cache.evict(1) == 1 and [cached_tokens(n) for n in "ad"] == [2 * P, 2 * P]
    assert cache.evict(100) == 2 and cache.stats.cached_pages == 0
    assert cache.stats.evicted_pages == 10
    cache.check_invariants()
    assert engine.pool.num_free == engine.pool.num_pages


def test_pages_in_use_are_never_evicted():
    rng = np.random.default_rng(6)
    P = 4
    pool = KVPool(toy_groups([None, 2 * P]), num_pages=60, page_tokens=P)
    engine = Engine(pool)
    prompt = random_tokens(rng, 4 * P)
    engine.prefill(0, prompt, chunk=4 * P)
    engine.insert(0)
    pool.free(0)
    engine.start(1, prompt[: 3 * P + 1])  # shares pages 0..2 of the full group, 1..2 of the sliding one
    # Only the last node is free to go: the shared path is in use (node 0's sliding page is not,
    # but a node goes only as a whole and only as a leaf).
    assert engine.cache.evict(100) == 2
    assert engine.cache.stats.cached_pages == 6
    assert engine.cache.evict(100) == 0
    engine.cache.check_invariants()
    pool.free(1)
    assert engine.cache.evict(100) == 6
    assert pool.num_free == pool.num_pages
    engine.cache.check_invariants()


def test_allocation_evicts_cached_pages_when_the_free_list_runs_short():
    rng = np.random.default_rng(7)
    P = 4
    pool = KVPool(toy_groups([None, 2 * P]), num_pages=12, page_tokens=P)
    engine = Engine(pool)
    cached = random_tokens(rng, 4 * P)
    engine.prefill(0, cached, chunk=4 * P)
    engine.insert(0)
    pool.free(0)
    assert pool.num_free == 4 and engine.cache.stats.cached_pages == 8
    engine.start(1, random_tokens(rng, 3 * P))  # no hit: needs 6 pages, 4 are free
    engine.compute(1, 3 * P)
    assert engine.cache.stats.evicted_pages == 2 and pool.num_free == 0
    # The deepest (least recently used leaf) page went; the three before it still match.
    assert engine.cache.match(np.concatenate([cached, [1]])).num_tokens == 3 * P
    engine.cache.check_invariants()


def test_an_allocation_the_cache_cannot_cover_changes_nothing():
    rng = np.random.default_rng(8)
    P = 4
    pool = KVPool(toy_groups([None]), num_pages=10, page_tokens=P)
    engine = Engine(pool)
    cached = random_tokens(rng, 4 * P)
    engine.prefill(0, cached, chunk=P)
    engine.insert(0)
    pool.free(0)
    engine.start(1, cached[: 2 * P + 1])  # shares 2 pages; 2 more are evictable; 6 are free
    before, cache_before = state_of(pool), cache_state(engine.cache)
    with pytest.raises(PoolExhausted):
        engine.compute(1, 2 * P + 9 * P)  # 9 new pages > 6 free + 2 evictable
    assert state_of(pool) == before and cache_state(engine.cache) == cache_before
    assert engine.cache.evict(3, all_or_nothing=True) == 0 and cache_state(engine.cache) == cache_before
    engine.compute(1, 2 * P + 8 * P)  # exactly enough with both evicted
    assert engine.cache.stats.evicted_pages == 2 and pool.num_free == 0
    engine.cache.check_invariants()


# ---- statistics and reset ------------------------------------------------------------------------
def test_stats_and_reset():
    rng = np.random.default_rng(9)
    P = 4
    pool = KVPool(toy_groups([None, 8]), num_pages=100, page_tokens=P)
    engine = Engine(pool)
    prompt = random_tokens(rng, 10 * P)
    engine.prefill(0, prompt, chunk=7)  # the last chunk's queries start at 35: sliding pages 7..9 kept
    engine.insert(0)
    engine.start(1, np.concatenate([prompt, random_tokens(rng, 2 * P)]))  # 40 of 48 tokens
    engine.cache.match(random_tokens(rng, 8))  # 0 of 8
    stats = engine.cache.stats
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (3, 40 + 48 + 8, 40)
    assert stats.hit_rate == pytest.approx(40 / 96)
    assert stats.cached_pages == 10 + 3  # the sliding group kept the pages of its last window
    pool.free(0)
    assert pool.num_used == 13
    engine.cache.reset()
    engine.cache.check_invariants()
    # The page only the cache held is free; the ones sequence 1 shares (10 full, sliding 8 and 9)
    # stay with it.
    assert pool.num_used == 10 + 2 == pool.used_pages_per_group.sum()
    assert engine.cache.stats == type(stats)(0, 0, 0, 0, 0) and engine.cache.stats.hit_rate == 0.0
    assert engine.cache.match(prompt).num_tokens == 0
    engine.compute(1, 13 * P)
    engine.insert(1)
    assert engine.cache.match(np.concatenate([engine.tokens[1], [3]])).num_tokens == 13 * P
    engine.cache.check_invariants()


# ---- random workloads ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_random_workload_with_eviction_keeps_exact_accounting_and_leaks_nothing(seed: int):
    """Requests on a few shared documents come and go on a small pool: start from the cache, prefill
    in chunks, decode, insert, free; explicit evictions and the odd reset. Every match is checked
    by content, every failed allocation for changing nothing, the invariants after every step."""
    rng = np.random.default_rng(1000 + seed)
    P = int(rng.choice([2, 4, 8]))
    groups = toy_groups([None, 2 * P + 1, int(rng.integers(1, 4 * P))] + ([None] if seed % 2 else []))
    pool = KVPool(groups, num_pages=int(rng.integers(40, 100)), page_tokens=P)
    engine = Engine(pool, seed)
    cache = engine.cache
    documents = [random_tokens(rng, int(rng.integers(P, 12 * P))) for _ in range(3)]
    targets: dict[int, int] = {}  # sequence -> the length it stops at
    next_seq, failures, evicted_by_allocation, hit_tokens = 0, 0, 0, 0
    for _ in range(700):
        op = rng.random()
        if not targets or (op < 0.2 and len(targets) < 8):  # at most 8 running, like a scheduler
            document = documents[rng.integers(len(documents))]
            prefix = document[: rng.integers(0, len(document) + 1)]
            prompt = np.concatenate([prefix, random_tokens(rng, rng.integers(1, 3 * P))])
            hit_tokens += engine.start(next_seq, prompt).num_tokens
            targets[next_seq] = len(prompt) + int(rng.integers(0, 4 * P))
            next_seq += 1
        elif op < 0.8:
            seq = int(rng.choice(list(targets)))
            total = min(targets[seq], pool.num_tokens(seq) + int(rng.choice([1, 1, rng.integers(1, 4 * P)])))
            before, cache_before = state_of(pool), cache_state(cache)
            evicted = cache.stats.evicted_pages
            try:
                engine.compute(seq, total)
            except PoolExhausted:
                failures += 1
                assert state_of(pool) == before and cache_state(cache) == cache_before
            evicted_by_allocation += cache.stats.evicted_pages - evicted
            if pool.num_tokens(seq) == targets[seq] or rng.random() < 0.05:
                if rng.random() < 0.8:
                    engine.insert(seq, int(rng.integers(0, pool.num_tokens(seq) + 1)) if rng.random() < 0.3 else None)
                pool.free(seq)
                del targets[seq]
        elif op < 0.9:
            seq = int(rng.choice(list(targets)))
            engine.insert(seq, int(rng.integers(0, pool.num_tokens(seq) + 1)))
        elif op < 0.99:
            assert cache.evict(int(rng.integers(1, 10))) >= 0
        else:
            cache.reset()
        cache.check_invariants()
    assert failures > 0 and evicted_by_allocation > 0, "the pool never ran short: the test is too lenient"
    assert hit_tokens > 0
    for seq in list(targets):
        pool.free(seq)
        cache.check_invariants()
    cache.evict(pool.num_pages)
    cache.check_invariants()
    assert cache.stats.cached_pages == 0 and not cache._root.children
    assert pool.num_free == pool.num_pages and pool.used_pages_per_group.sum() == 0
    assert sorted(pool._free.tolist()) == list(range(pool.num_pages))
