"""The split decode kernel of `paged_attention` in Pallas Mosaic GPU (Hopper: TMA pipeline + wgmma).

The Triton split kernel (`paged_attention._decode_split_kernel`) has no asynchronous copies: each loop
step waits for its K and V loads. Here a program's pages stream through shared memory by TMA, `stages`
pages ahead of the math. `paged_attention.default_decode_blocks` picks it wherever it fits (use_mosaic_split).

A program is one (sequence, kv head, split), as in the Triton kernel, and writes its partials (unnormalized
output, running max and sum per query row) for `paged_attention`'s combine, which reads them as they are:
`q_rows` query rows, the group rounded up to 8, of which the first `group` are used.
- A split takes every `num_splits`-th visible page, from its own index on (the Triton kernel's splits are
  contiguous runs of pages). A program's start is a chain of global loads before its first page can be fetched;
  with contiguous splits, a page's index needed the sequence's length first (sequence length, then page id,
  then the page); interleaved, without a window, it needs none, and the page ids load beside the length
  (session 37; not yet timed on a GPU).
- Keys are wgmma's M and the group's query rows its N: a page's scores are `[page_size, q_rows]`, a few
  values a thread (4 at pages of 64 and Beam's group of 6). Until session 36 the query rows were M, padded to
  64 rows: 32 scores a thread for the softmax, 58 of each 64 rows padding, ~1.3 us of math a page (H200,
  benchmarks/attention/RESULTS.md run 9). Keys as rows took 8K x 8 from 15.0 to 13.2 us (split + combine),
  128K x 1 from 22.3 to 20.7, 8K x 32 from 37.5 to 35.2 (session 36 run 1).
- The queries: one TMA copy of the group's rows into an untiled 64-row buffer (any row offset; a copy into
  wgmma's swizzled tiles needs rows aligned to 8), then through registers into the swizzled tiles, once,
  while the first pages load. Rows past the group hold whatever shared memory held: their columns are
  computed, never stored, and a column never mixes with another.
- A page: scores = K (smem, M) x queries^T (smem, N); the online softmax in registers, its max over the keys
  (a reduction across the warpgroup, through a little shared memory); the probabilities, transposed into
  shared memory, are the B operand of output^T += V^T (smem, transposed M) x probabilities. Each thread keeps
  its part of the softmax sums and adds them up once, at the end.
- A ring of `stages` page buffers: the first `stages` fetches go out first. The page ids ride in the loop's
  carry, each loaded a step before its fetch (run 10: 128K x 1 from 20.8 to 20.2-20.5 us).
- The kernel takes finished queries: in the model the K/V write kernel applies the query prologue
  (`PagedKVCache.attend`), elsewhere `paged_attention` runs it in XLA first. On the H200 an in-kernel
  prologue computed wrong queries, and a TMA copy of a split's page ids into shared memory (1-D,
  16-byte boxes) stopped the GPU with CUDA_ERROR_ILLEGAL_INSTRUCTION (session 12); both were taken
  out, not understood.
- Rounding follows the Triton kernel (and so the reference): fp32 scores rounded to the query dtype,
  scaled, rounded again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_tiles import interpret_params, smem_transforms, stamp

_M_INIT = -1e30  # as the Triton kernel's: exp(-inf - _M_INIT) = 0, never inf - inf
_WGMMA_ROWS = 64
# The columns of `split_decode(stamps=True)`: times (ns) and the program's page count.
STAMPS = ("start", "fetching", "first_page", "pages_done", "end", "pages")


def fits(heads: int, kv_heads: int, page_size: int, head_dim: int, dtype) -> bool:
    """Whether the kernel takes these shapes: whole kv head groups of at most 64 query heads (the queries pass
    through one 64-row register tile), pages and heads of multiples of 64, 16-bit values."""
    group = heads // kv_heads
    return (heads % kv_heads == 0 and group <= _WGMMA_ROWS and page_size % 64 == 0 and head_dim % 64 == 0
            and jnp.dtype(dtype).itemsize == 2)


def _matmul(a, b, shape):
    """`a @ b` into a fresh fp32 accumulator by wgmma (operands in shared memory), returned in registers once
    done."""
    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]
    return pl.run_scoped(scope, plgpu.ACC(shape))


def split_decode(queries, k_pages, v_pages, row_token, seq_lens, page_table, *, window: int | None,
                 softmax_scale: float, num_splits: int, stages: int = 2, dependent_launch: bool = False,
                 interpret: bool = False, stamps: bool = False):
    """Partials of every decode sequence's attention: (o `[batch, kv_heads, splits, q_rows, d]`, m and l
    `[batch, kv_heads, splits, q_rows]`, fp32), query rows past `group` unspecified. `queries [tokens, heads, d]`,
    `k_pages`/`v_pages [pages, page_size, kv_heads, d]`, `row_token [batch]` (a sequence's decode token, -1:
    none), `seq_lens [batch]`, `page_table [batch, max_pages]` (-1: released page).
    `dependent_launch` (compiled only): the kernel may start before the kernel ahead of it ends (programmatic
    dependent launch; the K/V write kernel in the model's layer, which writes the queries and the pages): a
    program loads its sequence's length and first page ids, then waits for that kernel (`griddepcontrol.wait`)
    before it copies queries or pages. Nothing it reads before the wait may be written by the kernel ahead.
    `stamps` (a diagnostic, compiled only): each program (sequence, kv head, split) also writes int32 `[programs,
    len(STAMPS)]` (`STAMPS`: its `%globaltimer_lo` in ns at its start, once its first page fetch is issued, once
    that page is in, after its last page, at its end; and its page count), returned after the partials."""
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
    # Free reshapes: a query row is (token, head); a key row is (page, key) with the kv heads side by side.
    q_flat = queries.reshape(tokens * heads, head_dim)
    k_flat = k_pages.reshape(num_pages * page_size, kv_heads * head_dim)
    v_flat = v_pages.reshape(num_pages * page_size, kv_heads * head_dim)
    def kernel(row_token_gmem, seq_lens_gmem, page_table_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem,
               *stamps_gmem, q_smem, q_barrier):
        sequence, kv_head, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")

        def mark(name, value=None):  # a stamp (`stamps`)
            if stamps:
                stamp(stamps_gmem[0], (sequence * kv_heads + kv_head) * num_splits + split, STAMPS.index(name), value)

        mark("start")
        token = row_token_gmem[sequence]
        seq_len = jnp.where(token >= 0, seq_lens_gmem[sequence], 0)  # no decode: nothing to visit
        q_pos = seq_len - 1
        first_page = 0 if window is None else jnp.maximum(q_pos - window + 1, 0) // page_size
        end_page = jnp.maximum((seq_len + page_size - 1) // page_size, first_page)
        # The split's pages: every num_splits-th visible page from its own. Without a window a page's index
        # needs no load, so the first page ids load beside the sequence's length, not after it.
        num_steps = jnp.maximum(end_page - first_page - split + num_splits - 1, 0) // num_splits

        def page_index(i):  # the split's i-th page in the sequence
            return first_page + split + i * num_splits

        def page_id(i):  # its page id (-1: released); past the table's end, its last entry (unused)
            return page_table_gmem[sequence, jnp.minimum(page_index(i), max_pages - 1)]

        first_ids = tuple(page_id(i) for i in range(stages))
        if dependent_launch and not interpret:  # the queries and pages may still be being written
            plgpu.griddepcontrol_wait()
        # The group's query rows into the first rows of an untiled buffer (any row offset).
        first_row = jnp.maximum(token, 0) * heads + kv_head * group
        plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(first_row, group)], q_smem.at[pl.ds(0, group)], q_barrier)

        def attend(k_ring, v_ring, ring_barriers, q_tiles, p_tile):
            """The split's pages through a ring: page i lands in slot i % stages, fetched `stages` pages ahead of
            the math; a slot is fetched again once its page's wgmmas are done. The page ids travel in the loop's
            carry, each loaded a step before its fetch needs it, so that no global load sits between a page's
            wgmmas and the next fetch. Returns the output^T, the max and the sum of each query row."""
            def fetch(i, page):
                slot = i % stages
                rows = pl.ds(jnp.maximum(page, 0) * page_size, page_size)  # a released page (-1): page 0, masked
                columns = pl.ds(kv_head * head_dim, head_dim)
                plgpu.copy_gmem_to_smem(k_gmem.at[rows, columns], k_ring.at[slot], ring_barriers.at[slot])
                plgpu.copy_gmem_to_smem(v_gmem.at[rows, columns], v_ring.at[slot], ring_barriers.at[slot])

            for i in range(stages):
                pl.when(i < num_steps)(lambda i=i: fetch(i, first_ids[i]))
            mark("fetching")
            # The queries into wgmma's swizzled tiles, once, while the first pages load.
            plgpu.barrier_wait(q_barrier)
            q_tiles[...] = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()
            queries_t = q_tiles.at[pl.ds(0, q_rows)].transpose((1, 0))  # [head_dim, q_rows]

            def step(i, carry):
                acc, m_prev, l_parts, ids = carry  # ids: pages i .. i + stages - 1
                next_id = page_id(i + stages)  # its latency hides behind this page's math
                slot = i % stages
                plgpu.barrier_wait(ring_barriers.at[slot])
                if stamps:
                    pl.when(i == 0)(lambda: mark("first_page"))
                k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
                scores = _matmul(k_smem, queries_t, (page_size, q_rows))
                scores = (scores.astype(dtype).astype(jnp.float32) * softmax_scale).astype(dtype).astype(jnp.float32)
                k_pos = page_index(i) * page_size + plgpu.broadcasted_iota(
                    jnp.int32, (page_size, q_rows), 0, layout=plgpu.Layout.WGMMA)
                visible = (k_pos <= q_pos) & (ids[0] >= 0)
                if window is not None:
                    visible &= q_pos - k_pos < window
                scores = jnp.where(visible, scores, -jnp.inf)
                m_next = jnp.maximum(m_prev, scores.max(axis=0))
                correction = jnp.exp(m_prev - m_next)
                probs = jnp.exp(scores - lax.broadcast_in_dim(m_next, scores.shape, [1]))
                p_tile.transpose((1, 0))[...] = probs.astype(dtype)
                plgpu.commit_smem()
                pv = _matmul(v_smem.transpose((1, 0)), p_tile.transpose((1, 0)), (head_dim, q_rows))
                # Both wgmmas are done with the slot: the page `stages` ahead may land in it.
                pl.when(i + stages < num_steps)(lambda: fetch(i + stages, next_id))
                acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1]) + pv
                l_parts = l_parts * lax.broadcast_in_dim(correction, l_parts.shape, [1]) + probs
                return acc, m_next, l_parts, (*ids[1:], next_id)

            init = (plgpu.layout_cast(jnp.zeros((head_dim, q_rows), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((q_rows,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(0)),
                    plgpu.layout_cast(jnp.zeros((page_size, q_rows), jnp.float32), plgpu.Layout.WGMMA),
                    first_ids)
            acc, m, l_parts, _ = lax.fori_loop(0, num_steps, step, init)
            return acc, m, l_parts.sum(axis=0)

        ring = plgpu.SMEM((stages, page_size, head_dim), dtype, transforms=operand)
        acc, m, l = pl.run_scoped(attend, ring, ring, plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                                  plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype, transforms=operand),  # queries
                                  plgpu.SMEM((q_rows, page_size), dtype,  # a page's probabilities
                                             transforms=smem_transforms(page_size, dtype)))

        mark("pages_done")
        mark("pages", num_steps)
        # The ring's buffers are free again: the partials go out through shared memory. The output^T is read
        # back transposed (Mosaic GPU stores fp32 registers transposed into shared memory only as 16-bit pairs)
        # and stored by the threads, in the combine's `[q_rows, head_dim]`.
        def store(o_smem, m_smem, l_smem):
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[sequence, kv_head, split])
            plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[sequence, kv_head, split])
            o_gmem.at[sequence, kv_head, split][...] = plgpu.load(
                o_smem.transpose((1, 0)), (), layout=plgpu.Layout.WG_STRIDED((q_rows, head_dim), vec_size=1))
            plgpu.wait_smem_to_gmem(0)
            mark("end")

        pl.run_scoped(store, plgpu.SMEM(acc.shape, jnp.float32),
                      plgpu.SMEM((q_rows,), jnp.float32), plgpu.SMEM((q_rows,), jnp.float32))

    partial = (batch, kv_heads, num_splits, q_rows)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32), jax.ShapeDtypeStruct(partial, jnp.float32),
                  jax.ShapeDtypeStruct(partial, jnp.float32),
                  *[jax.ShapeDtypeStruct((batch * kv_heads * num_splits, len(STAMPS)), jnp.int32)] * stamps),
        grid=(batch, kv_heads, num_splits), grid_names=("b", "h", "s"),
        scratch_types=dict(q_smem=plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype), q_barrier=plgpu.Barrier()),
        interpret=interpret_params(interpret),
    )
    return call(row_token.astype(jnp.int32), seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q_flat,
                k_flat, v_flat)
