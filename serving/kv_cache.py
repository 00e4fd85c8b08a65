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

Everything here is numpy and O(pages touched) per call; nothing loops over tokens. This module
only does bookkeeping: the device-side pages and the kernel that reads them are elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

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
    out-of-window pages; `free(seq)` returns all of them; `page_tables(seqs, group)` gives the
    runner a padded int32 table per group. `check_invariants()` verifies the exact accounting."""

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
        # Owner of each page (group -1: free). Redundant with the tables on purpose: the invariant
        # check cross-checks the two, and it answers "who holds page x" in O(1) when debugging.
        self._owner_seq = np.full(num_pages, -1, dtype=np.int64)
        self._owner_group = np.full(num_pages, -1, dtype=np.int32)
        self._owner_logical = np.full(num_pages, -1, dtype=np.int64)
        self._used = np.zeros(len(self.groups), dtype=np.int64)
        self._peak = np.zeros(len(self.groups), dtype=np.int64)
        self._peak_total = 0
        self._seqs: dict[int, _SequenceState] = {}

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
        if group.window is None:
            return 0
        first_visible = position - group.window + 1
        return min(num_pages, max(0, first_visible) // self.page_tokens)

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
        releasable = 0
        if state is not None:
            releasable = sum(
                max(0, self._dead_pages(group, old_tokens, old_pages) - state.first_live[g])
                for g, group in enumerate(self.groups)
            )
        needed = grow * len(self.groups)
        # Pages released below were dead already, so counting them as free cannot hurt anyone; but
        # check before touching anything so that a failure leaves the pool exactly as it was.
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
                self._claim(pages, seq_id, g, np.arange(old_pages, new_pages))
        state.num_tokens = new_total_tokens
        self._peak = np.maximum(self._peak, self._used)
        self._peak_total = max(self._peak_total, self.num_used)
        return needed

    def release_out_of_window(self, seq_id: int, current_position: int) -> int:
        """Free the sliding-group pages of `seq_id` that no query at `>= current_position` can
        see. Returns how many pages were freed. `allocate` calls this itself."""
        state = self._seqs[seq_id]
        return self._release(seq_id, state, current_position)

    def free(self, seq_id: int) -> int:
        """Return every page of `seq_id` to the pool and forget it. Returns how many."""
        state = self._seqs.pop(seq_id)
        num_pages = state.num_pages(self.page_tokens)
        freed = 0
        for g in range(len(self.groups)):
            live = state.tables[g][state.first_live[g] : num_pages]
            self._push(live, g)
            freed += len(live)
        return freed

    # ---- internals -------------------------------------------------------------------------------
    def _release(self, seq_id: int, state: _SequenceState, position: int) -> int:
        num_pages = state.num_pages(self.page_tokens)
        freed = 0
        for g, group in enumerate(self.groups):
            dead = self._dead_pages(group, position, num_pages)
            if dead <= state.first_live[g]:
                continue
            table = state.tables[g]
            self._push(table[state.first_live[g] : dead].copy(), g)
            table[state.first_live[g] : dead] = NO_PAGE
            freed += dead - state.first_live[g]
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

    def _claim(self, pages: np.ndarray, seq_id: int, group: int, logical: np.ndarray) -> None:
        self._owner_seq[pages] = seq_id
        self._owner_group[pages] = group
        self._owner_logical[pages] = logical
        self._used[group] += len(pages)

    def _push(self, pages: np.ndarray, group: int) -> None:
        self._free[self._num_free : self._num_free + len(pages)] = pages
        self._num_free += len(pages)
        self._owner_seq[pages] = -1
        self._owner_group[pages] = -1
        self._owner_logical[pages] = -1
        self._used[group] -= len(pages)

    # ---- debugging -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert exact accounting: every page is either free or held by exactly one
        (sequence, group, logical page), the tables and the owner arrays agree, and the counts
        match. O(pages); meant for tests and debugging."""
        free = self._free[: self._num_free]
        assert 0 <= self._num_free <= self.num_pages, self._num_free
        assert np.all((free >= 0) & (free < self.num_pages)), "free list holds an invalid page id"
        assert len(np.unique(free)) == len(free), "a page is on the free list twice"
        assert np.all(self._owner_group[free] == -1), "a free page has an owner"

        held_pages: list[np.ndarray] = []
        used = np.zeros(len(self.groups), dtype=np.int64)
        for seq_id, state in self._seqs.items():
            num_pages = state.num_pages(self.page_tokens)
            for g, group in enumerate(self.groups):
                table = state.tables[g]
                first_live = state.first_live[g]
                assert group.window is not None or first_live == 0, f"full group {g} of {seq_id} lost pages"
                assert 0 <= first_live <= num_pages, (seq_id, g, first_live, num_pages)
                assert len(table) >= num_pages
                assert np.all(table[:first_live] == NO_PAGE), f"released entries of {seq_id}/{g} still hold pages"
                live = table[first_live:num_pages]
                assert np.all((live >= 0) & (live < self.num_pages)), f"{seq_id}/{g} holds an invalid page id"
                assert np.all(self._owner_seq[live] == seq_id), f"{seq_id}/{g}: owner sequence mismatch"
                assert np.all(self._owner_group[live] == g), f"{seq_id}/{g}: owner group mismatch"
                assert np.all(self._owner_logical[live] == np.arange(first_live, num_pages)), \
                    f"{seq_id}/{g}: owner logical page mismatch"
                held_pages.append(live)
                used[g] += len(live)
        held = np.concatenate(held_pages) if held_pages else np.empty(0, dtype=np.int32)
        assert len(np.unique(held)) == len(held), "a page is held twice"
        assert len(held) + len(free) == self.num_pages, (len(held), len(free), self.num_pages)
        assert len(np.intersect1d(held, free)) == 0, "a page is both held and free"
        assert (self._owner_group >= 0).sum() == len(held), "owner arrays count stray pages"
        assert np.array_equal(used, self._used), (used, self._used)
        assert np.all(self._peak >= self._used) and self._peak_total >= self.num_used
