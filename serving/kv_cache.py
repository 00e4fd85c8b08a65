"""Host-side paged KV cache: one pool of equal-size pages shared by all cache groups.

Beam keeps two KV lifetimes (full history, and sliding windows), so layers are grouped by lifetime
(`beam_jax.memory_plan.plan_cache_groups`, which also splits large sliding groups). A page holds
`page_tokens` consecutive tokens of one sequence for one group, with one slot per layer of that
group; pages are sized for the largest group (as the planner assumes), so any free page can serve
any group and one free list suffices.

Each sequence has, per group, a page table indexed by logical page (`position // page_tokens`).
Sliding groups release pages whose tokens all left the window: a key at `k` is visible to a query
at `q` iff `0 <= q - k < window`, so once the next query is at `p`, a page whose last token is
`< p - window + 1` is never read again. Released entries read -1. Release is a prefix of the table
(positions only grow), so each group keeps a `first_live` page index instead of scanning.

Pages are reference counted so that sequences can start from a cached prefix
(`serving.prefix_cache`): a page's holders are the sequences whose tables map it plus external
references (the prefix cache's own, via `add_refs` / `drop_refs`), and it returns to the free list
only when the last holder lets go. A shared page is full and read-only: prefixes are shared in
whole pages (`share_prefix`) and a sequence writes only from its own length on, so its writes
always land in pages it alone holds (`allocate` asserts this). When free pages run short,
`allocate` asks the pool's `evictor` (the prefix cache) to give some back.

Everything here is numpy and O(pages touched) per call; nothing loops over tokens. This module
only does bookkeeping: the device-side pages and the kernel that reads them are elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from beam_jax.config import BeamConfig
from beam_jax.memory_plan import (
    PAGE_TOKENS,
    CacheGroup,
    DrafterSpec,
    MemoryPlan,
    ceil_div,
    drafter_cache_layers,
    model_split_limit,
    plan_cache_groups,
    pool_kv_bytes_per_token,
    resolve_drafter,
    target_cache_layers,
)

NO_PAGE = -1  # a page-table entry that holds no page: released (sliding) or padding


class PoolExhausted(RuntimeError):
    """The pool cannot supply the pages an allocation needs; nothing was changed."""

    def __init__(self, seq_id: int, pages_needed: int, pages_free: int, pages_released: int):
        self.seq_id = seq_id
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        self.pages_released = pages_released
        super().__init__(
            f"KV pool exhausted: sequence {seq_id} needs {pages_needed} new pages but only "
            f"{pages_free} are free (+{pages_released} it would release out of its windows)"
        )


def cache_groups(
    config: BeamConfig, *, tp: int = 1, drafter: bool | DrafterSpec | None = None
) -> tuple[CacheGroup, ...]:
    """The planner's cache groups for `config` (and a drafter) under `tp`, without the weight
    accounting `plan_memory` also does (which needs the model's abstract parameters)."""
    spec = resolve_drafter(drafter)
    layers = target_cache_layers(config, tp) + (drafter_cache_layers(spec, tp) if spec else [])
    return plan_cache_groups(layers, split_limit=model_split_limit(config))


def sliding_groups(groups: Iterable[CacheGroup]) -> list[int]:
    """Indices of the groups with a window (the ones whose pages are released)."""
    return [g for g, group in enumerate(groups) if group.window is not None]


def first_visible_page(window: int | None, position, page_tokens: int):
    """The first logical page a query at `position` (an int or an array of them) can see: a key at
    `k` is visible iff `0 <= position - k < window`, so pages below `(position - window + 1) // P`
    hold only invisible keys. 0 for a full-history group."""
    if window is None:
        return 0 if isinstance(position, int) else np.zeros_like(position)
    if isinstance(position, int):  # plain ints on the pool's per-step path: numpy scalars cost more
        return max(0, position - window + 1) // page_tokens
    return np.maximum(0, np.asarray(position) - window + 1) // page_tokens


@dataclasses.dataclass
class _SequenceState:
    """One sequence's pages: per group a growable table (capacity doubles, so appends are
    amortized O(1) per page) of which the first `num_pages` entries are meaningful."""

    num_tokens: int
    tables: list[np.ndarray]
    first_live: list[int]  # per group: logical pages below this were released

    def num_pages(self, page_tokens: int) -> int:
        return ceil_div(self.num_tokens, page_tokens)


class KVPool:
    """A pool of `num_pages` pages (ids 0..num_pages-1) shared by `groups`.

    `allocate(seq, total)` grows a sequence (creating it on first use) and releases its
    out-of-window pages; `truncate(seq, total)` rolls it back (rejected speculative drafts);
    `share_prefix(seq, pages, tokens)` creates one on cached pages;
    `free(seq)` lets go of all of them; `page_tables(seqs, group)` gives the runner a padded int32
    table per group. `check_invariants()` verifies the exact accounting.

    `evictor`, if set, is called as `evictor(num_pages)` when an allocation is short of
    `num_pages` free pages; it returns how many it freed, and must free at least that many or
    none, so that a failed allocation changes nothing."""

    def __init__(self, groups: Sequence[CacheGroup], num_pages: int, *, page_tokens: int = PAGE_TOKENS):
        if not groups:
            raise ValueError("a KV pool needs at least one cache group")
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        for group in groups:
            if group.window is not None and group.window < 1:
                raise ValueError(f"a window must be >= 1, got {group.window}")
        self.groups: tuple[CacheGroup, ...] = tuple(groups)
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        # Free list as a stack: `_free[:_num_free]`; reversed so that a fresh pool hands out 0, 1, ...
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = num_pages
        # Holders of each page (0: free): sequences mapping it plus external references, which
        # are also counted apart so that the invariant check can account for every reference.
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        self._external_refs = np.zeros(num_pages, dtype=np.int32)
        # Group and logical page of each page (-1: free). Every holder maps a page at the same
        # place (a prefix is shared position for position), so these are per page; redundant with
        # the tables on purpose: the invariant check cross-checks the two.
        self._owner_group = np.full(num_pages, -1, dtype=np.int32)
        self._owner_logical = np.full(num_pages, -1, dtype=np.int64)
        self._used = np.zeros(len(self.groups), dtype=np.int64)
        self._peak = np.zeros(len(self.groups), dtype=np.int64)
        self._peak_total = 0
        self._seqs: dict[int, _SequenceState] = {}
        self.evictor: Callable[[int], int] | None = None

    # ---- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: BeamConfig,
        num_pages: int,
        *,
        tp: int = 1,
        drafter: bool | DrafterSpec | None = None,
        page_tokens: int = PAGE_TOKENS,
    ) -> KVPool:
        return cls(cache_groups(config, tp=tp, drafter=drafter), num_pages, page_tokens=page_tokens)

    @classmethod
    def from_budget(
        cls,
        groups: Sequence[CacheGroup],
        budget_bytes: int,
        *,
        mem_fraction: float = 1.0,
        page_tokens: int = PAGE_TOKENS,
    ) -> KVPool:
        """As many whole pages as `budget_bytes * mem_fraction` holds, at the planner's per-token
        bytes (the largest group's)."""
        page_bytes = page_tokens * pool_kv_bytes_per_token(groups)
        return cls(groups, int(budget_bytes * mem_fraction) // page_bytes, page_tokens=page_tokens)

    @classmethod
    def from_plan(cls, plan: MemoryPlan) -> KVPool:
        """The pool `plan_memory` sized: its groups, its page count."""
        return cls(plan.cache_groups, plan.pool_pages, page_tokens=plan.page_tokens)

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.page_tokens * pool_kv_bytes_per_token(self.groups)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    @property
    def used_pages_per_group(self) -> np.ndarray:
        return self._used.copy()

    @property
    def peak_pages_per_group(self) -> np.ndarray:
        """The most pages each group held at once since creation or `reset_peak()`."""
        return self._peak.copy()

    @property
    def peak_pages(self) -> int:
        return self._peak_total

    def reset_peak(self) -> None:
        self._peak = self._used.copy()
        self._peak_total = self.num_used

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def refcount(self, pages: np.ndarray) -> np.ndarray:
        """How many holders (sequences and external references) each of `pages` has."""
        return self._refcount[np.asarray(pages, dtype=np.int64)]

    def page_table(self, seq_id: int, group: int) -> np.ndarray:
        """A copy of one sequence's table for one group: logical page -> page id, -1 released."""
        state = self._seqs[seq_id]
        return state.tables[group][: state.num_pages(self.page_tokens)].copy()

    def page_tables(self, seq_ids: Sequence[int], group: int, *, max_pages: int | None = None) -> np.ndarray:
        """`int32 [batch, max_pages]` page tables of one group, padded (and released) with -1.
        `max_pages` defaults to the longest table; pass a bucketed size to keep shapes stable."""
        lengths = [self._seqs[s].num_pages(self.page_tokens) for s in seq_ids]
        width = max(lengths, default=0) if max_pages is None else max_pages
        if lengths and max(lengths) > width:
            raise ValueError(f"max_pages={width} is shorter than a table of {max(lengths)} pages")
        out = np.full((len(seq_ids), width), NO_PAGE, dtype=np.int32)
        for row, (seq_id, length) in enumerate(zip(seq_ids, lengths)):
            out[row, :length] = self._seqs[seq_id].tables[group][:length]
        return out

    def pages_for_sequence(self, total_tokens: int, *, chunk_tokens: int = 1) -> int:
        """Pages (all groups) a sequence of `total_tokens` holds at its peak when it is fed
        `chunk_tokens` at a time: the whole history in full groups; in a sliding group the pages
        a span of `window + chunk_tokens - 1` tokens can straddle (the chunk's queries reach back
        a window from its first token), i.e. the planner's count for a window widened by the chunk."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        total = 0
        for group in self.groups:
            if group.window is not None:
                group = dataclasses.replace(group, window=group.window + chunk_tokens - 1)
            total += group.pages_per_session(total_tokens, self.page_tokens)
        return total

    def can_admit(self, total_tokens: int, *, chunk_tokens: int = 1) -> bool:
        """Whether a new sequence of `total_tokens` fits in the free pages now (a conservative
        bound: it counts every group at its own peak, and ignores other sequences' growth)."""
        return self.pages_for_sequence(total_tokens, chunk_tokens=chunk_tokens) <= self._num_free

    # ---- the window arithmetic -------------------------------------------------------------------
    def _dead_pages(self, group: CacheGroup, position: int, num_pages: int) -> int:
        """How many leading logical pages no query at `>= position` can see: a page is dead iff its
        last token `(j + 1) * P - 1 < position - window + 1`, i.e. `j < (position - window + 1) // P`."""
        return min(num_pages, int(first_visible_page(group.window, position, self.page_tokens)))

    def _release_due(self, state: _SequenceState, position: int) -> bool:
        """Whether a sliding release at `position` has pages to release (`_release` would change something)."""
        num_pages = state.num_pages(self.page_tokens)
        return any(self._dead_pages(group, position, num_pages) > state.first_live[g]
                   for g, group in enumerate(self.groups) if group.window is not None)

    def _releasable(self, state: _SequenceState | None, position: int) -> int:
        """How many pages a sliding release at `position` would return to the free list: the dead
        pages this sequence alone holds (a shared one stays with its other holders)."""
        if state is None:
            return 0
        num_pages = state.num_pages(self.page_tokens)
        releasable = 0
        for g, group in enumerate(self.groups):
            dead = state.tables[g][state.first_live[g] : self._dead_pages(group, position, num_pages)]
            releasable += int(np.count_nonzero(self._refcount[dead] == 1))
        return releasable

    # ---- mutations -------------------------------------------------------------------------------
    def allocate(self, seq_id: int, new_total_tokens: int) -> int:
        """Grow `seq_id` (created if new) to hold positions `[0, new_total_tokens)`, after releasing
        the pages no query of this step can see (its first query is at the old length). All groups
        grow or none does: raises `PoolExhausted` with nothing changed. Returns how many pages were
        newly assigned (over all groups)."""
        state = self._seqs.get(seq_id)
        old_tokens = 0 if state is None else state.num_tokens
        if new_total_tokens < old_tokens:
            raise ValueError(f"sequence {seq_id} holds {old_tokens} tokens; cannot shrink to {new_total_tokens}")
        old_pages = ceil_div(old_tokens, self.page_tokens)
        new_pages = ceil_div(new_total_tokens, self.page_tokens)
        grow = new_pages - old_pages
        if state is not None and new_total_tokens > old_tokens and old_tokens % self.page_tokens:
            # The step writes into the partly filled last page: it must be this sequence's alone.
            # It is, because shared pages are full (prefixes and cache entries are whole pages).
            assert all(self._refcount[table[old_pages - 1]] == 1 for table in state.tables), (
                f"sequence {seq_id} would write into a shared page")
        if state is not None and not grow and not self._release_due(state, old_tokens):
            state.num_tokens = new_total_tokens  # a token into the last page: nothing else changes
            return 0
        needed = grow * len(self.groups)
        # Pages released below were dead already, so counting them as free cannot hurt anyone; but
        # check before touching anything so that a failure leaves the pool exactly as it was.
        releasable = self._releasable(state, old_tokens)
        shortfall = needed - self._num_free - releasable
        if shortfall > 0 and self.evictor is not None:
            self.evictor(shortfall)  # frees at least `shortfall` pages or none (see the class)
            releasable = self._releasable(state, old_tokens)
        if needed > self._num_free + releasable:
            raise PoolExhausted(seq_id, needed, self._num_free, releasable)
        if state is None:
            state = _SequenceState(0, [np.empty(0, dtype=np.int32) for _ in self.groups], [0] * len(self.groups))
            self._seqs[seq_id] = state
        self._release(seq_id, state, old_tokens)
        if grow:
            for g in range(len(self.groups)):
                self._ensure_capacity(state, g, new_pages)
                pages = self._pop(grow)
                state.tables[g][old_pages:new_pages] = pages
                self._claim(pages, g, np.arange(old_pages, new_pages))
        state.num_tokens = new_total_tokens
        self._peak = np.maximum(self._peak, self._used)
        self._peak_total = max(self._peak_total, self.num_used)
        return needed

    def share_prefix(self, seq_id: int, pages_per_group: Sequence[np.ndarray], num_tokens: int) -> None:
        """Create `seq_id` holding `num_tokens` tokens whose KV is already in `pages_per_group`
        (one table of `num_tokens // page_tokens` pages per group, e.g. a `PrefixMatch`'s): each
        page is mapped at its logical page and gains a reference. In a sliding group the entries
        before the window of the next query (at `num_tokens`) must be `NO_PAGE`. `num_tokens` is
        whole pages, so `allocate` then puts the sequence's own tokens into fresh pages."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} exists already")
        if num_tokens < 0 or num_tokens % self.page_tokens:
            raise ValueError(f"a shared prefix is whole pages of {self.page_tokens} tokens, got {num_tokens}")
        if len(pages_per_group) != len(self.groups):
            raise ValueError(f"expected {len(self.groups)} page tables, got {len(pages_per_group)}")
        num_pages = num_tokens // self.page_tokens
        tables, first_live, live_pages = [], [], []
        for g, group in enumerate(self.groups):
            table = np.asarray(pages_per_group[g], dtype=np.int32)
            if table.shape != (num_pages,):
                raise ValueError(f"group {g}: expected {num_pages} pages, got shape {table.shape}")
            first = self._dead_pages(group, num_tokens, num_pages)
            live = table[first:]
            if np.any(table[:first] != NO_PAGE):
                raise ValueError(f"group {g}: pages before the window must be NO_PAGE")
            # Only held pages at their own place can be shared: anything else is stale or misplaced.
            if np.any((live < 0) | (live >= self.num_pages)) or np.any(self._refcount[live] == 0):
                raise ValueError(f"group {g}: a page the next query sees is missing or free")
            if np.any(self._owner_group[live] != g) or np.any(self._owner_logical[live] != np.arange(first, num_pages)):
                raise ValueError(f"group {g}: a shared page belongs to another group or position")
            tables.append(table.copy())
            first_live.append(first)
            live_pages.append(live)
        self._seqs[seq_id] = _SequenceState(num_tokens, tables, first_live)
        self._refcount[np.concatenate(live_pages)] += 1

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Roll `seq_id` back to its first `num_tokens` tokens: the KV of positions `>= num_tokens`
        (a verify block's rejected drafts) is dropped. Pages holding only dropped positions lose this
        sequence's reference in every group, sliding ones included; the page of position
        `num_tokens - 1` is kept, and its later slots are rewritten before any query can see them
        (a key is visible only at positions below the step's sequence length, which the next step
        writes first). Returns how many pages returned to the free list.

        Refused (ValueError, nothing changed) if a sliding group already released pages a query at
        `num_tokens` would see (the sequence was released at a later position: `allocate` releases
        at the step's first query, so rolling back to at least that is always fine), or if the next
        write would land in a page the sequence shares (a cached prefix's)."""
        state = self._seqs[seq_id]
        if not 0 <= num_tokens <= state.num_tokens:
            raise ValueError(f"sequence {seq_id} holds {state.num_tokens} tokens; cannot truncate to {num_tokens}")
        old_pages = state.num_pages(self.page_tokens)
        new_pages = ceil_div(num_tokens, self.page_tokens)
        for g, group in enumerate(self.groups):
            if self._dead_pages(group, num_tokens, new_pages) < state.first_live[g]:
                raise ValueError(
                    f"sequence {seq_id}: group {g} released pages a query at {num_tokens} sees "
                    f"(released up to logical page {state.first_live[g]})"
                )
        if num_tokens % self.page_tokens:
            last = [state.tables[g][new_pages - 1] for g in range(len(self.groups))]
            if np.any(self._refcount[last] > 1):
                raise ValueError(f"sequence {seq_id}: position {num_tokens} would be written into a shared page")
        freed = 0
        for g in range(len(self.groups)):
            table = state.tables[g]
            freed += self._unref(table[new_pages:old_pages].copy())
            table[new_pages:old_pages] = NO_PAGE
        state.num_tokens = num_tokens
        return freed

    def release_out_of_window(self, seq_id: int, current_position: int) -> int:
        """Drop the sliding-group pages of `seq_id` that no query at `>= current_position` can
        see. Returns how many pages returned to the free list (shared ones stay with their other
        holders). `allocate` calls this itself."""
        state = self._seqs[seq_id]
        return self._release(seq_id, state, current_position)

    def free(self, seq_id: int) -> int:
        """Drop every page of `seq_id` and forget it. Returns how many pages returned to the free
        list (a page still held by another sequence or the prefix cache stays)."""
        state = self._seqs.pop(seq_id)
        num_pages = state.num_pages(self.page_tokens)
        live = [state.tables[g][state.first_live[g] : num_pages] for g in range(len(self.groups))]
        return self._unref(np.concatenate(live))

    def add_refs(self, pages: np.ndarray) -> None:
        """Take an external reference (one not in any page table: the prefix cache's) on each of
        `pages`, distinct pages that some sequence holds now."""
        pages = self._distinct_pages(pages)
        if np.any(self._refcount[pages] == 0):
            raise ValueError("an external reference needs a page that is held, not a free one")
        self._refcount[pages] += 1
        self._external_refs[pages] += 1

    def drop_refs(self, pages: np.ndarray) -> int:
        """Drop one external reference on each of `pages`. Returns how many pages that freed."""
        pages = self._distinct_pages(pages)
        if np.any(self._external_refs[pages] == 0):
            raise ValueError("dropping an external reference that was never taken")
        self._external_refs[pages] -= 1
        return self._unref(pages)

    # ---- internals -------------------------------------------------------------------------------
    def _release(self, seq_id: int, state: _SequenceState, position: int) -> int:
        num_pages = state.num_pages(self.page_tokens)
        freed = 0
        for g, group in enumerate(self.groups):
            dead = self._dead_pages(group, position, num_pages)
            if dead <= state.first_live[g]:
                continue
            table = state.tables[g]
            freed += self._unref(table[state.first_live[g] : dead].copy())
            table[state.first_live[g] : dead] = NO_PAGE
            state.first_live[g] = dead
        return freed

    @staticmethod
    def _ensure_capacity(state: _SequenceState, group: int, num_pages: int) -> None:
        table = state.tables[group]
        if len(table) >= num_pages:
            return
        grown = np.full(max(num_pages, 2 * len(table), 8), NO_PAGE, dtype=np.int32)
        grown[: len(table)] = table
        state.tables[group] = grown

    def _pop(self, count: int) -> np.ndarray:
        start = self._num_free - count
        pages = self._free[start : self._num_free].copy()
        self._num_free = start
        return pages

    def _claim(self, pages: np.ndarray, group: int, logical: np.ndarray) -> None:
        self._refcount[pages] = 1
        self._owner_group[pages] = group
        self._owner_logical[pages] = logical
        self._used[group] += len(pages)

    def _unref(self, pages: np.ndarray) -> int:
        """Drop one reference on each of `pages` (distinct); those left with none go back on the
        free list. Returns how many did."""
        self._refcount[pages] -= 1
        unheld = pages[self._refcount[pages] == 0]
        self._free[self._num_free : self._num_free + len(unheld)] = unheld
        self._num_free += len(unheld)
        self._used -= np.bincount(self._owner_group[unheld], minlength=len(self.groups))
        self._owner_group[unheld] = -1
        self._owner_logical[unheld] = -1
        return len(unheld)

    def _distinct_pages(self, pages: np.ndarray) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        if np.any((pages < 0) | (pages >= self.num_pages)) or len(np.unique(pages)) != len(pages):
            raise ValueError("expected distinct valid page ids")
        return pages

    # ---- debugging -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert exact accounting: each page's reference count is the number of sequences whose
        tables map it plus its external references; a page is free iff it has none, and then it is
        on the free list exactly once; every holder maps a page at the page's group and logical
        page; and the counts match. O(pages); meant for tests and debugging."""
        free = self._free[: self._num_free]
        assert 0 <= self._num_free <= self.num_pages, self._num_free
        assert np.all((free >= 0) & (free < self.num_pages)), "free list holds an invalid page id"
        assert len(np.unique(free)) == len(free), "a page is on the free list twice"

        refs = self._external_refs.astype(np.int64)
        for seq_id, state in self._seqs.items():
            num_pages = state.num_pages(self.page_tokens)
            live_pages = []
            for g, group in enumerate(self.groups):
                table = state.tables[g]
                first_live = state.first_live[g]
                assert group.window is not None or first_live == 0, f"full group {g} of {seq_id} lost pages"
                assert 0 <= first_live <= num_pages, (seq_id, g, first_live, num_pages)
                assert len(table) >= num_pages
                assert np.all(table[:first_live] == NO_PAGE), f"released entries of {seq_id}/{g} still hold pages"
                live = table[first_live:num_pages]
                assert np.all((live >= 0) & (live < self.num_pages)), f"{seq_id}/{g} holds an invalid page id"
                assert np.all(self._owner_group[live] == g), f"{seq_id}/{g}: owner group mismatch"
                assert np.all(self._owner_logical[live] == np.arange(first_live, num_pages)), \
                    f"{seq_id}/{g}: owner logical page mismatch"
                live_pages.append(live)
            held_by_seq = np.concatenate(live_pages)
            assert len(np.unique(held_by_seq)) == len(held_by_seq), f"{seq_id} maps a page twice"
            refs[held_by_seq] += 1
        assert np.all(self._external_refs >= 0)
        assert np.array_equal(refs, self._refcount), "reference counts differ from the holders"
        held = self._refcount > 0
        assert not np.any(held[free]), "a page is both held and free"
        assert held.sum() + len(free) == self.num_pages, (held.sum(), len(free), self.num_pages)
        assert np.all(self._owner_group[held] >= 0), "a held page has no group"
        assert np.all(self._owner_group[~held] == -1) and np.all(self._owner_logical[~held] == -1), \
            "a free page has an owner"
        used = np.bincount(self._owner_group[held], minlength=len(self.groups))
        assert np.array_equal(used, self._used), (used, self._used)
        assert np.all(self._peak >= self._used) and self._peak_total >= self.num_used
