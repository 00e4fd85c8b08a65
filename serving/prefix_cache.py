"""Prefix caching: a tree over full pages of token ids whose nodes hold the KV pages of every group.

A node stands for one page of `page_tokens` token ids following its parent's; the root is the empty
prefix, so a node at depth `d` holds logical page `d - 1` of every sequence whose tokens begin with
the path to it. The keys are whole pages (a radix tree with page-granular keys, one node per page,
not compressed: each page then has its own LRU time and can be evicted on its own).

Each node holds, per cache group, the page with that KV, or `NO_PAGE` where the cache has none: a
sliding group keeps only the pages its sequences still held when they were inserted. A match is
usable up to a length `L` (pages) iff every group has the pages a query at `L * page_tokens` can
see: all of them for full attention, those of the last window for a sliding group. The cache holds
one pool reference on every page it stores (`KVPool.add_refs`), so a page outlives the sequence that
wrote it; it evicts least recently used leaves whose pages nobody else holds, and is the pool's
evictor, so allocations reclaim cached pages when the free list runs short.

Use: `m = cache.match(prompt)`, then at once `pool.share_prefix(seq, m.pages_per_group,
m.num_tokens)` and `pool.allocate(seq, len(prompt))` (anything that allocates in between may evict
the matched pages); after computing KV for tokens, `cache.insert(seq, tokens)`; then `pool.free(seq)`.
Host-side numpy, O(pages of the prompt) per match and insert.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence

import numpy as np

from serving.kv_cache import NO_PAGE, KVPool, first_visible_page


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The first `num_tokens` tokens (whole pages) have KV in `pages_per_group`: per group, a table
    of `num_tokens // page_tokens` page ids, `NO_PAGE` before a sliding group's window. Exactly what
    `KVPool.share_prefix` takes."""

    num_tokens: int
    pages_per_group: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    queries: int
    query_tokens: int
    hit_tokens: int
    cached_pages: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens asked about."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclasses.dataclass(eq=False, slots=True)  # eq=False: nodes hash by identity (sets, dicts)
class _Node:
    parent: _Node | None
    key: bytes  # this page's token ids (int64 bytes)
    pages: np.ndarray  # int32 [num_groups], NO_PAGE where the cache holds no page of that group
    last_access: int
    children: dict[bytes, _Node] = dataclasses.field(default_factory=dict)

    def held_pages(self) -> np.ndarray:
        return self.pages[self.pages != NO_PAGE]


class PrefixCache:
    """Cached KV pages of `pool`, keyed by full pages of token ids; becomes `pool.evictor`."""

    def __init__(self, pool: KVPool):
        if pool.evictor is not None:
            raise ValueError("the pool has an evictor already (one prefix cache per pool)")
        self.pool = pool
        self._clock = itertools.count(1)  # LRU time: one tick per match or insert
        self._clear()
        # For the pool, all or nothing: a failed allocation must not cost the cache anything.
        pool.evictor = lambda num_pages: self.evict(num_pages, all_or_nothing=True)

    def _clear(self) -> None:
        self._root = _Node(None, b"", np.full(len(self.pool.groups), NO_PAGE, dtype=np.int32), 0)
        self._leaves: set[_Node] = set()  # childless nodes other than the root: the eviction candidates
        self._cached_pages = 0
        self._queries = self._query_tokens = self._hit_tokens = self._evicted_pages = 0

    # ---- lookups ---------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int] | np.ndarray, *, touch: bool = True) -> PrefixMatch:
        """The longest cached prefix of `token_ids` a new sequence can start from: whole pages, at
        least one token short of the whole prompt (its last token's logits must be computed), and
        only as long as every group has the pages the next query can see. Touches what it returns
        and counts the query in the stats, unless `touch=False` (a look that admits nothing)."""
        tokens = self._tokens(token_ids)
        page_tokens = self.pool.page_tokens
        path = self._walk(tokens, max(0, len(tokens) - 1) // page_tokens)
        pages = np.stack([node.pages for node in path]) if path else np.empty((0, len(self.pool.groups)), np.int32)
        length = self._usable_pages(pages)
        tables = []
        for g, group in enumerate(self.pool.groups):
            table = pages[:length, g].copy()
            table[: first_visible_page(group.window, length * page_tokens, page_tokens)] = NO_PAGE
            tables.append(table)
        if not touch:
            return PrefixMatch(length * page_tokens, tuple(tables))
        tick = next(self._clock)
        for node in path[:length]:
            node.last_access = tick
        self._queries += 1
        self._query_tokens += len(tokens)
        self._hit_tokens += length * page_tokens
        return PrefixMatch(length * page_tokens, tuple(tables))

    def _walk(self, tokens: np.ndarray, max_pages: int) -> list[_Node]:
        """The nodes of the longest cached page path that `tokens` begins with, up to `max_pages`."""
        page_tokens = self.pool.page_tokens
        path, node = [], self._root
        for j in range(max_pages):
            node = node.children.get(tokens[j * page_tokens : (j + 1) * page_tokens].tobytes())
            if node is None:
                break
            path.append(node)
        return path

    def _usable_pages(self, pages: np.ndarray) -> int:
        """The largest `L <= len(pages)` (`pages`: [path pages, groups], a walk's nodes) such that in
        every group the pages from the first one a query at `L * page_tokens` sees up to `L - 1`
        are all cached. Not the first failure minus one: a longer match can have its window past a
        hole that a shorter one's window covers."""
        if not len(pages):
            return 0
        index = np.arange(len(pages))[:, None]
        # last_missing[i, g]: the last page <= i that group g lacks (-1: none).
        last_missing = np.maximum.accumulate(np.where(pages == NO_PAGE, index, -1), axis=0)
        lengths = np.arange(1, len(pages) + 1)
        usable = np.ones(len(pages), dtype=bool)
        for g, group in enumerate(self.pool.groups):
            usable &= last_missing[:, g] < first_visible_page(group.window, lengths * self.pool.page_tokens,
                                                              self.pool.page_tokens)
        candidates = np.flatnonzero(usable)
        return int(candidates[-1]) + 1 if len(candidates) else 0

    # ---- insertion -------------------------------------------------------------------------------
    def insert(self, seq_id: int, token_ids: Sequence[int] | np.ndarray) -> int:
        """Cache the full pages of `token_ids`, the first tokens of `seq_id` whose KV is computed:
        every group's page that the sequence still holds, with a reference each. Where the tree
        has a page already, the sequence's copy is not cached (it stays the sequence's own);
        where it has a hole (a sliding page released by an earlier inserter), this one fills it.
        Returns how many pages the cache took."""
        tokens = self._tokens(token_ids)
        if len(tokens) > self.pool.num_tokens(seq_id):
            raise ValueError(f"sequence {seq_id} holds {self.pool.num_tokens(seq_id)} tokens, fewer than {len(tokens)}")
        page_tokens = self.pool.page_tokens
        num_pages = len(tokens) // page_tokens
        rows = np.stack([self.pool.page_table(seq_id, g)[:num_pages] for g in range(len(self.pool.groups))], axis=1)
        tick = next(self._clock)
        taken, node = [], self._root
        for j, row in enumerate(rows):
            key = tokens[j * page_tokens : (j + 1) * page_tokens].tobytes()
            child = node.children.get(key)
            if child is None:
                child = _Node(node, key, row.copy(), tick)
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                taken.append(child.held_pages())
            else:
                holes = (child.pages == NO_PAGE) & (row != NO_PAGE)
                child.pages[holes] = row[holes]
                taken.append(row[holes])
                child.last_access = tick
            node = child
        taken_pages = _concatenate(taken)
        self.pool.add_refs(taken_pages)
        self._cached_pages += len(taken_pages)
        return len(taken_pages)

    # ---- eviction --------------------------------------------------------------------------------
    def evict(self, num_pages: int, *, all_or_nothing: bool = False) -> int:
        """Free `num_pages` pages by evicting least recently used leaves whose pages only the cache
        holds (a page a sequence uses is never evicted; a parent becomes a candidate once its
        children are gone). A node's pages go together, so this may free a few more; it frees
        fewer if no more are evictable, or, with `all_or_nothing`, none at all. Returns how many."""
        victims, freeable = self._lru_victims(num_pages)
        if all_or_nothing and freeable < num_pages:
            return 0
        freed = 0
        for node in victims:  # children before their parents
            del node.parent.children[node.key]
            self._leaves.discard(node)
            if node.parent is not self._root and not node.parent.children:
                self._leaves.add(node.parent)
            held = node.held_pages()
            self._cached_pages -= len(held)
            freed += self.pool.drop_refs(held)
        assert freed == freeable, (freed, freeable)
        self._evicted_pages += freed
        return freed

    def _lru_victims(self, num_pages: int) -> tuple[list[_Node], int]:
        """Evictable nodes, oldest leaf first, until they free `num_pages` (or all there are), and
        how many pages they free. Picks without changing the tree, so a caller can still decline."""
        serial = itertools.count()  # tie-break, so the heap never compares nodes
        heap = [(leaf.last_access, next(serial), leaf) for leaf in self._leaves if self._only_cached(leaf)]
        heapq.heapify(heap)
        children_left: dict[_Node, int] = {}
        victims, freeable = [], 0
        while heap and freeable < num_pages:
            _, _, node = heapq.heappop(heap)
            victims.append(node)
            freeable += len(node.held_pages())
            parent = node.parent
            if parent is not self._root:
                children_left[parent] = children_left.get(parent, len(parent.children)) - 1
                if children_left[parent] == 0 and self._only_cached(parent):
                    heapq.heappush(heap, (parent.last_access, next(serial), parent))
        return victims, freeable

    def _only_cached(self, node: _Node) -> bool:
        return bool(np.all(self.pool.refcount(node.held_pages()) == 1))

    def reset(self) -> None:
        """Drop every cached page (those no sequence holds return to the pool) and the statistics."""
        self.pool.drop_refs(_concatenate([node.held_pages() for node in self._nodes()]))
        self._clear()

    # ---- statistics and debugging -----------------------------------------------------------------
    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._query_tokens, self._hit_tokens, self._cached_pages,
                                self._evicted_pages)

    def _nodes(self) -> list[_Node]:
        """Every node but the root, parents before children."""
        nodes, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check_invariants(self) -> None:
        """The pool's invariants, plus: the cache is the pool's only external holder and holds one
        reference on exactly the pages in the tree; each node's pages are of their group and at
        the node's logical page; the leaf set and the page count are exact. O(cached pages)."""
        self.pool.check_invariants()
        # Reads the pool's owner arrays directly: this is its debugging counterpart, same package.
        cached, nodes = [], self._nodes()
        depth = {self._root: 0}
        for node in nodes:
            depth[node] = depth[node.parent] + 1
            assert node.parent.children[node.key] is node
            assert len(node.key) == 8 * self.pool.page_tokens
            for g, page in enumerate(node.pages):
                if page != NO_PAGE:
                    assert self.pool._owner_group[page] == g and self.pool._owner_logical[page] == depth[node] - 1
            cached.append(node.held_pages())
        cached_pages = _concatenate(cached)
        assert len(cached_pages) == self._cached_pages == len(np.unique(cached_pages)), "a page is cached twice"
        expected = np.zeros(self.pool.num_pages, dtype=np.int32)
        expected[cached_pages] = 1
        assert np.array_equal(self.pool._external_refs, expected), "cache references differ from the tree"
        assert self._leaves == {node for node in nodes if not node.children}, "leaf set is stale"

    @staticmethod
    def _tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        tokens = np.asarray(token_ids, dtype=np.int64)  # one dtype, so equal pages have equal keys
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be one-dimensional, got shape {tokens.shape}")
        return tokens


def _concatenate(pages: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(pages) if pages else np.empty(0, dtype=np.int32)
