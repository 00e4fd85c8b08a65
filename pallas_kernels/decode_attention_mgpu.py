"""The split decode kernel of `paged_attention` in Pallas Mosaic GPU (Hopper: TMA pipeline + wgmma).

The Triton split kernel (`paged_attention._decode_split_kernel`) has no asynchronous copies: each loop
step waits for its K and V loads. Here a program's pages stream through shared memory by TMA, `stages`
pages ahead of the math. On the H200 (runs 8-11 of benchmarks/attention/RESULTS.md) it took 5-29 % less
time than the Triton kernel where a split has at least 4 pages (85-87 % of the HBM floor at 8K x 32 and
32K x 8, against 66 %), and lost at 2 pages a split; `paged_attention.default_decode_blocks` picks it
on those terms.

A program is one (sequence, kv head, split), as in the Triton kernel, and writes the same partials
(unnormalized output, running max and sum per query row) for `paged_attention`'s combine, which reads
them as they are (`q_rows` rows, the group rounded up to 8, of which the first `group` are used).
- Its query rows are the kv head's `group` query heads: one TMA copy from the token's row of `queries`
  into the first rows of a 64-row buffer (wgmma's M). Rows past the group hold whatever the buffer
  held: computed, never stored.
- A ring of `stages` page buffers: the first `stages` fetches go out, then the queries are loaded into
  registers once, while those pages load. The page ids ride in the loop's carry, each loaded a step
  before its fetch (run 10: 128K x 1 from 20.8 to 20.2-20.5 us).
- The kernel takes finished queries: in the model the K/V write kernel applies the query prologue
  (`PagedKVCache.attend`), elsewhere `paged_attention` runs it in XLA first. On the H200 an in-kernel
  prologue computed wrong queries, and a TMA copy of a split's page ids into shared memory (1-D,
  16-byte boxes) stopped the GPU with CUDA_ERROR_ILLEGAL_INSTRUCTION (session 12); both were taken
  out, not understood.
- One page of keys is one step: scores `[64, page_size]` by wgmma, the online softmax in registers,
  then the probabilities (wgmma's register operand) times the page's values.
- Rounding follows the Triton kernel (and so the reference): fp32 scores rounded to the query dtype,
  scaled, rounded again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_tiles import smem_transforms

_M_INIT = -1e30  # as the Triton kernel's: exp(-inf - _M_INIT) = 0, never inf - inf
_WGMMA_ROWS = 64
KEYS_AS_ROWS = True


def fits(heads: int, kv_heads: int, page_size: int, head_dim: int, dtype) -> bool:
    """Whether the kernel takes these shapes: whole kv head groups of at most 64 query heads (wgmma's M),
    pages and heads of multiples of 64, 16-bit values."""
    group = heads // kv_heads
    return (heads % kv_heads == 0 and group <= _WGMMA_ROWS and page_size % 64 == 0 and head_dim % 64 == 0
            and jnp.dtype(dtype).itemsize == 2)


def _matmul(a, b, shape):
    """`a @ b` into a fresh fp32 accumulator by wgmma (`a` in registers or shared memory, `b` in shared
    memory), returned in registers once done."""
    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]
    return pl.run_scoped(scope, plgpu.ACC(shape))


def _lhs(x, interpreter_smem, index):
    """wgmma's left operand `x` (registers, WGMMA layout): as it is on a GPU; through shared memory for
    Mosaic GPU's interpreter, whose wgmma takes shared-memory operands only."""
    if not interpreter_smem:
        return x
    ref = interpreter_smem[index]
    ref[...] = x
    plgpu.commit_smem()
    return ref


def split_decode(queries, k_pages, v_pages, row_token, seq_lens, page_table, *, window: int | None,
                 softmax_scale: float, num_splits: int, stages: int = 2, keys_as_rows: bool | None = None,
                 interpret: bool = False):
    """Partials of every decode sequence's attention: (o `[batch, kv_heads, splits, q_rows, d]`, or with
    `keys_as_rows` (unset: KEYS_AS_ROWS) `[batch, kv_heads, splits, d, q_rows]`, m and l `[batch, kv_heads, splits,
    q_rows]`, fp32), rows past `group` unspecified. `queries [tokens, heads,
    d]`, `k_pages`/`v_pages [pages, page_size, kv_heads, d]`, `row_token [batch]` (a sequence's decode
    token, -1: none), `seq_lens [batch]`, `page_table [batch, max_pages]` (-1: released page)."""
    tokens, heads, head_dim = queries.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    batch, max_pages = page_table.shape
    group = heads // kv_heads
    q_rows = -(-group // 8) * 8
    one_dtype = queries.dtype == k_pages.dtype == v_pages.dtype
    if not (one_dtype and fits(heads, kv_heads, page_size, head_dim, queries.dtype)):
        raise ValueError(f"queries {queries.shape} {queries.dtype}, pages {k_pages.shape} {k_pages.dtype}: "
                         "needs at most 64 query heads per kv head, page_size and head_dim multiples of 64, "
                         "one 16-bit dtype")
    dtype = queries.dtype
    operand = smem_transforms(head_dim, dtype)
    if keys_as_rows is None:
        keys_as_rows = KEYS_AS_ROWS
    # Free reshapes: a query row is (token, head); a key row is (page, key) with the kv heads side by side.
    q_flat = queries.reshape(tokens * heads, head_dim)
    k_flat = k_pages.reshape(num_pages * page_size, kv_heads * head_dim)
    v_flat = v_pages.reshape(num_pages * page_size, kv_heads * head_dim)
    def kernel(row_token_gmem, seq_lens_gmem, page_table_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem, *,
               q_smem, q_barrier, lhs_smem):
        sequence, kv_head, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        token = row_token_gmem[sequence]
        seq_len = jnp.where(token >= 0, seq_lens_gmem[sequence], 0)  # no decode: nothing to visit
        q_pos = seq_len - 1
        first_page = 0 if window is None else jnp.maximum(q_pos - window + 1, 0) // page_size
        end_page = jnp.maximum((seq_len + page_size - 1) // page_size, first_page)
        per_split = (end_page - first_page + num_splits - 1) // num_splits
        lo = jnp.minimum(first_page + split * per_split, end_page)
        hi = jnp.minimum(lo + per_split, end_page)

        # The group's query rows into the first rows of an untiled buffer (any row offset); rows past the
        # group hold whatever shared memory held: computed, never stored.
        first_row = jnp.maximum(token, 0) * heads + kv_head * group
        plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(first_row, group)], q_smem.at[pl.ds(0, group)], q_barrier)
        num_steps = hi - lo

        def page_id(i):  # the split's i-th page (-1: released); past the table's end, its last entry (unused)
            return page_table_gmem[sequence, jnp.minimum(lo + i, max_pages - 1)]

        def fetch_first_pages(k_ring, v_ring, ring_barriers):
            """The ring: page i lands in slot i % stages, fetched `stages` pages ahead of the math; a slot is
            fetched again once its page's wgmmas are done. The page ids travel in the loop's carry, each loaded a
            step before its fetch needs it, so that no global load sits between a page's wgmmas and the next
            fetch. Returns `fetch(i, page)` and the first `stages` pages' ids."""
            def fetch(i, page):
                slot = i % stages
                rows = pl.ds(jnp.maximum(page, 0) * page_size, page_size)  # a released page (-1): page 0, masked
                columns = pl.ds(kv_head * head_dim, head_dim)
                plgpu.copy_gmem_to_smem(k_gmem.at[rows, columns], k_ring.at[slot], ring_barriers.at[slot])
                plgpu.copy_gmem_to_smem(v_gmem.at[rows, columns], v_ring.at[slot], ring_barriers.at[slot])

            first_ids = tuple(page_id(i) for i in range(stages))
            for i in range(stages):
                pl.when(i < num_steps)(lambda i=i: fetch(i, first_ids[i]))
            return fetch, first_ids

        def rounded_scores(scores):
            return (scores.astype(dtype).astype(jnp.float32) * softmax_scale).astype(dtype).astype(jnp.float32)

        def visible_keys(i, page, shape, key_axis):
            k_pos = (lo + i) * page_size + plgpu.broadcasted_iota(jnp.int32, shape, key_axis,
                                                                   layout=plgpu.Layout.WGMMA)
            visible = (k_pos <= q_pos) & (page >= 0)
            if window is not None:
                visible &= q_pos - k_pos < window
            return visible

        def attend(k_ring, v_ring, ring_barriers):
            """Query rows as wgmma's M (64 rows, `group` of them real): scores [64, page_size]."""
            fetch, first_ids = fetch_first_pages(k_ring, v_ring, ring_barriers)
            # The queries once, into registers (wgmma's left operand), while the first pages load.
            plgpu.barrier_wait(q_barrier)
            q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA, optimized=False)

            def step(i, carry):
                acc, m_prev, l_prev, ids = carry  # ids: pages i .. i + stages - 1
                next_id = page_id(i + stages)  # its latency hides behind this page's math
                slot = i % stages
                plgpu.barrier_wait(ring_barriers.at[slot])
                k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
                scores = rounded_scores(
                    _matmul(_lhs(q, lhs_smem, 0), k_smem.transpose((1, 0)), (_WGMMA_ROWS, page_size)))
                scores = jnp.where(visible_keys(i, ids[0], scores.shape, 1), scores, -jnp.inf)
                m_next = jnp.maximum(m_prev, scores.max(axis=1))
                correction = jnp.exp(m_prev - m_next)
                probs = jnp.exp(scores - lax.broadcast_in_dim(m_next, scores.shape, [0]))
                pv = _matmul(_lhs(probs.astype(dtype), lhs_smem, 1), v_smem, (_WGMMA_ROWS, head_dim))
                # Both wgmmas are done with the slot: the page `stages` ahead may land in it.
                pl.when(i + stages < num_steps)(lambda: fetch(i + stages, next_id))
                acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv
                return acc, m_next, correction * l_prev + probs.sum(axis=1), (*ids[1:], next_id)

            init = (plgpu.layout_cast(jnp.zeros((_WGMMA_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((_WGMMA_ROWS,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                    plgpu.layout_cast(jnp.zeros((_WGMMA_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                    first_ids)
            return lax.fori_loop(0, num_steps, step, init)[:3]

        def attend_keys_as_rows(k_ring, v_ring, ring_barriers, q_tiles, p_tile):
            """Keys as wgmma's M and the query rows as its N (`q_rows`): scores [page_size, q_rows] and the
            output transposed, [head_dim, q_rows], so a thread holds page_size * q_rows / 128 scores (4 at pages
            of 64 and 8 rows) where the other form holds 64 * page_size / 128 (32), 58 of whose 64 rows are
            padding at Beam's group of 6. The probabilities go through shared memory (wgmma's B operand);
            the softmax sums stay per thread until the end."""
            fetch, first_ids = fetch_first_pages(k_ring, v_ring, ring_barriers)
            # The queries into wgmma's swizzled tiles (a TMA copy there needs tile-aligned rows; here the group
            # starts at any row): through registers, once, while the first pages load.
            plgpu.barrier_wait(q_barrier)
            q_tiles[...] = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()
            queries_t = q_tiles.at[pl.ds(0, q_rows)].transpose((1, 0))  # [head_dim, q_rows]
            column = plgpu.Layout.WGMMA.reduce(0)

            def step(i, carry):
                acc, m_prev, l_parts, ids = carry  # ids: pages i .. i + stages - 1
                next_id = page_id(i + stages)
                slot = i % stages
                plgpu.barrier_wait(ring_barriers.at[slot])
                k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
                scores = rounded_scores(_matmul(k_smem, queries_t, (page_size, q_rows)))
                scores = jnp.where(visible_keys(i, ids[0], scores.shape, 0), scores, -jnp.inf)
                m_next = jnp.maximum(m_prev, scores.max(axis=0))
                correction = jnp.exp(m_prev - m_next)
                probs = jnp.exp(scores - lax.broadcast_in_dim(m_next, scores.shape, [1]))
                p_tile.transpose((1, 0))[...] = probs.astype(dtype)
                plgpu.commit_smem()
                pv = _matmul(v_smem.transpose((1, 0)), p_tile.transpose((1, 0)), (head_dim, q_rows))
                pl.when(i + stages < num_steps)(lambda: fetch(i + stages, next_id))
                acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1]) + pv
                l_parts = l_parts * lax.broadcast_in_dim(correction, l_parts.shape, [1]) + probs
                return acc, m_next, l_parts, (*ids[1:], next_id)

            init = (plgpu.layout_cast(jnp.zeros((head_dim, q_rows), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((q_rows,), _M_INIT, jnp.float32), column),
                    plgpu.layout_cast(jnp.zeros((page_size, q_rows), jnp.float32), plgpu.Layout.WGMMA),
                    first_ids)
            acc, m, l_parts, _ = lax.fori_loop(0, num_steps, step, init)
            return acc, m, l_parts.sum(axis=0)

        ring = plgpu.SMEM((stages, page_size, head_dim), dtype, transforms=operand)
        if keys_as_rows:
            acc, m, l = pl.run_scoped(attend_keys_as_rows, ring, ring,
                                      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                                      plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype, transforms=operand),
                                      plgpu.SMEM((q_rows, page_size), dtype,
                                                 transforms=smem_transforms(page_size, dtype)))
        else:
            acc, m, l = pl.run_scoped(attend, ring, ring, plgpu.Barrier(num_arrivals=2, num_barriers=stages))

        # The ring's buffers are free again: the partials go out through shared memory.
        def store(o_smem, m_smem, l_smem):
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            rows = pl.ds(0, q_rows)
            plgpu.copy_smem_to_gmem(o_smem if keys_as_rows else o_smem.at[rows], o_gmem.at[sequence, kv_head, split])
            plgpu.copy_smem_to_gmem(m_smem.at[rows], m_gmem.at[sequence, kv_head, split])
            plgpu.copy_smem_to_gmem(l_smem.at[rows], l_gmem.at[sequence, kv_head, split])
            plgpu.wait_smem_to_gmem(0)

        vector_rows = q_rows if keys_as_rows else _WGMMA_ROWS
        pl.run_scoped(store, plgpu.SMEM(acc.shape, jnp.float32),
                      plgpu.SMEM((vector_rows,), jnp.float32), plgpu.SMEM((vector_rows,), jnp.float32))

    partial = (batch, kv_heads, num_splits, q_rows)
    o_partial = (batch, kv_heads, num_splits, head_dim, q_rows) if keys_as_rows else (*partial, head_dim)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(o_partial, jnp.float32), jax.ShapeDtypeStruct(partial, jnp.float32),
                  jax.ShapeDtypeStruct(partial, jnp.float32)),
        grid=(batch, kv_heads, num_splits), grid_names=("b", "h", "s"),
        scratch_types=dict(q_smem=plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype),
                           q_barrier=plgpu.Barrier(),
                           # The interpreter's wgmma takes its left operand from shared memory only.
                           lhs_smem=(plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype, transforms=operand),
                                     plgpu.SMEM((_WGMMA_ROWS, page_size), dtype,
                                                transforms=smem_transforms(page_size, dtype)))
                                    if interpret and not keys_as_rows else ()),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(row_token.astype(jnp.int32), seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q_flat,
                k_flat, v_flat)
