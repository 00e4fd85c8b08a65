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
- `merged_decode` (session 38, not yet run on a GPU): the same programs without the combine kernel. A sequence's
  splits are one cluster; each leaves its partials in its shared memory and the first merges them through
  distributed shared memory, gates the output as the combine does and writes the token's rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_tiles import cluster_sync, smem_transforms, stamp

_M_INIT = -1e30  # as the Triton kernel's: exp(-inf - _M_INIT) = 0, never inf - inf
_WGMMA_ROWS = 64
# Programs a cluster holds on Hopper (`merged_decode`'s splits a sequence): 8 portably, 16 with the non-portable
# opt-in (which MLIR's CUDA launcher asks for above 8, as we read it; not yet run on our H200).
PORTABLE_CLUSTER, MAX_CLUSTER = 8, 16
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
    return _decode(queries, k_pages, v_pages, row_token, seq_lens, page_table, window=window,
                   softmax_scale=softmax_scale, num_splits=num_splits, stages=stages,
                   dependent_launch=dependent_launch, interpret=interpret, stamps=stamps)


def merged_decode(queries, k_pages, v_pages, row_token, token_row, seq_lens, page_table, *, window: int | None,
                  softmax_scale: float, num_splits: int, stages: int = 2, gate=None, gate_bias=None,
                  dependent_launch: bool = False, interpret: bool = False, stamps: bool = False):
    """Every decode token's attention output `[tokens, heads, d]` in one launch, without `paged_attention`'s combine
    kernel: a sequence's `num_splits` (at most `MAX_CLUSTER`) programs of a kv head are one cluster, each puts its
    partials in its shared memory, and split 0 merges them (`plgpu.cluster_ref` loads, between two
    `cluster_sync`s) and writes the token's rows. `token_row [tokens]`: a token's sequence if it is that
    sequence's decode, else -1 (`paged_attention.decode_metadata`); needs `tokens <= batch`, so that the first
    split of sequence b can write zeros to token b's rows when token b is no decode (every row of the output is
    written). With `gate [tokens, heads, d]` and `gate_bias [heads]` the output is gated as
    `paged_attention.output_gate_reference` rounds it, and has the gate's dtype. Other arguments as `split_decode`'s.
    Interpreted, one program a (sequence, kv head) runs its splits in turn and merges them (no peer loads).
    Why: the combine kernel costs 1.6-2.0 us at every decode point (H200, session 36), 8K x 8 misses 70 % of its
    floor by 1.6 us, and 43 of Beam's 52 layers are sliding ones whose split kernel takes ~3 us (not yet timed)."""
    return _decode(queries, k_pages, v_pages, row_token, seq_lens, page_table, window=window,
                   softmax_scale=softmax_scale, num_splits=num_splits, stages=stages,
                   dependent_launch=dependent_launch, interpret=interpret, stamps=stamps, merge=True,
                   token_row=token_row, gate=gate, gate_bias=gate_bias)


def _decode(queries, k_pages, v_pages, row_token, seq_lens, page_table, *, window, softmax_scale, num_splits, stages,
            dependent_launch, interpret, stamps, merge=False, token_row=None, gate=None, gate_bias=None):
    """`split_decode` (partials) or with `merge` `merged_decode` (the output)."""
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
    gated = gate is not None
    if merge:
        if not 1 <= num_splits <= MAX_CLUSTER:
            raise ValueError(f"num_splits {num_splits}: the merged kernel's splits are one cluster, 1 to {MAX_CLUSTER}")
        if tokens > batch:
            raise ValueError(f"{tokens} tokens for {batch} sequences: the merged kernel writes token b's rows from "
                             "sequence b's programs, so it needs tokens <= batch")
        if gated and (gate.shape != queries.shape or gate_bias is None or gate_bias.shape != (heads,)):
            raise ValueError(f"gate {gate.shape} and bias {None if gate_bias is None else gate_bias.shape}: need "
                             f"{queries.shape} and ({heads},)")
    dtype = queries.dtype
    out_dtype = gate.dtype if gated else dtype
    operand = smem_transforms(head_dim, dtype)
    wgmma, row_vector = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)  # [head_dim, q_rows] tiles, [q_rows]
    # Free reshapes: a query row is (token, head); a key row is (page, key) with the kv heads side by side.
    q_flat = queries.reshape(tokens * heads, head_dim)
    k_flat = k_pages.reshape(num_pages * page_size, kv_heads * head_dim)
    v_flat = v_pages.reshape(num_pages * page_size, kv_heads * head_dim)
    # Interpreted, the merged kernel's program of a (sequence, kv head) runs its splits one after another: the
    # interpreter has no peer loads, and its cluster barriers deadlocked now and then on the CPU (a cluster's
    # programs are threads that block XLA's callbacks).
    one_program = merge and interpret

    def kernel(*refs, q_smem, q_barrier, acc_smem=None, m_smem=None, l_smem=None, out_smem=None, gate_smem=None,
               gate_barrier=None):
        row_token_gmem, seq_lens_gmem, page_table_gmem, q_gmem, k_gmem, v_gmem, *refs = refs
        if merge:
            token_row_gmem, *refs = refs
            if gated:
                gate_gmem, bias_gmem, *refs = refs
            out_gmem, *refs = refs
        else:
            o_gmem, m_gmem, l_gmem, *refs = refs
        stamps_gmem = refs
        sequence, kv_head = lax.axis_index("b"), lax.axis_index("h")
        split = 0 if one_program else lax.axis_index("s")

        def mark(name, value=None):  # a stamp (`stamps`)
            if stamps:
                stamp(stamps_gmem[0], (sequence * kv_heads + kv_head) * num_splits + split, STAMPS.index(name), value)

        mark("start")
        token = row_token_gmem[sequence]
        seq_len = jnp.where(token >= 0, seq_lens_gmem[sequence], 0)  # no decode: nothing to visit
        q_pos = seq_len - 1
        first_page = 0 if window is None else jnp.maximum(q_pos - window + 1, 0) // page_size
        end_page = jnp.maximum((seq_len + page_size - 1) // page_size, first_page)

        # Split s's pages: every num_splits-th visible page from its own. Without a window a page's index
        # needs no load, so the first page ids load beside the sequence's length, not after it.
        def page_index(s, i):  # split s's i-th page in the sequence
            return first_page + s + i * num_splits

        def page_id(s, i):  # its page id (-1: released); past the table's end, its last entry (unused)
            return page_table_gmem[sequence, jnp.minimum(page_index(s, i), max_pages - 1)]

        def plan(s):  # split s's page count and first page ids
            num_steps = jnp.maximum(end_page - first_page - s + num_splits - 1, 0) // num_splits
            return num_steps, tuple(page_id(s, i) for i in range(stages))

        plans = [plan(s) for s in range(num_splits)] if one_program else [plan(split)]
        if dependent_launch and not interpret:  # the queries and pages may still be being written
            plgpu.griddepcontrol_wait()
        # The group's query rows into the first rows of an untiled buffer (any row offset).
        first_row = jnp.maximum(token, 0) * heads + kv_head * group
        plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(first_row, group)], q_smem.at[pl.ds(0, group)], q_barrier)
        head_rows = pl.ds(kv_head * group, group)  # the kv head's query heads in a token's row
        leader = split == 0  # (merge) the program that merges and writes

        def write_rows(out_t, row):
            """(merge) `out_t [head_dim, q_rows]` (fp32, WGMMA) as token `row`'s rows of the kv head, in
            `out_dtype`: transposed through shared memory, then the group's rows by TMA."""
            acc_smem[...] = out_t
            plgpu.commit_smem()
            out_smem[...] = plgpu.load(acc_smem.transpose((1, 0)), layout=plgpu.Layout.WG_STRIDED(
                (q_rows, head_dim), vec_size=1)).astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, group)], out_gmem.at[row, head_rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if merge:
            if gated:  # the token's gate rows, while the pages stream
                pl.when(leader & (token >= 0))(lambda: plgpu.copy_gmem_to_smem(
                    gate_gmem.at[jnp.maximum(token, 0), head_rows], gate_smem.at[pl.ds(0, group)], gate_barrier))
            # Token `sequence` is no decode (padding, or a sequence with no token): its rows are zeros.
            no_decode = token_row_gmem[jnp.minimum(sequence, tokens - 1)] < 0
            pl.when(leader & (sequence < tokens) & no_decode)(
                lambda: write_rows(plgpu.layout_cast(jnp.zeros((head_dim, q_rows), jnp.float32), wgmma), sequence))

        def attend(s, num_steps, first_ids, first):
            """Split s's partials (output^T, max and sum of each query row) from its pages through a ring: page
            i lands in slot i % stages, fetched `stages` pages ahead of the math; a slot is fetched again once
            its page's wgmmas are done. The page ids travel in the loop's carry, each loaded a step before its
            fetch needs it, so that no global load sits between a page's wgmmas and the next fetch. `first`: the
            program's first split (its queries' copy is waited for once)."""
            def scoped(k_ring, v_ring, ring_barriers, q_tiles, p_tile):
                def fetch(i, page):
                    slot = i % stages
                    rows = pl.ds(jnp.maximum(page, 0) * page_size, page_size)  # a released page (-1): page 0, masked
                    columns = pl.ds(kv_head * head_dim, head_dim)
                    plgpu.copy_gmem_to_smem(k_gmem.at[rows, columns], k_ring.at[slot], ring_barriers.at[slot])
                    plgpu.copy_gmem_to_smem(v_gmem.at[rows, columns], v_ring.at[slot], ring_barriers.at[slot])

                for i in range(stages):
                    pl.when(i < num_steps)(lambda i=i: fetch(i, first_ids[i]))
                mark("fetching")
                # The queries into wgmma's swizzled tiles, while the first pages load.
                if first:
                    plgpu.barrier_wait(q_barrier)
                q_tiles[...] = plgpu.load(q_smem, layout=wgmma, optimized=False)
                plgpu.commit_smem()
                queries_t = q_tiles.at[pl.ds(0, q_rows)].transpose((1, 0))  # [head_dim, q_rows]

                def step(i, carry):
                    acc, m_prev, l_parts, ids = carry  # ids: pages i .. i + stages - 1
                    next_id = page_id(s, i + stages)  # its latency hides behind this page's math
                    slot = i % stages
                    plgpu.barrier_wait(ring_barriers.at[slot])
                    if stamps:
                        pl.when(i == 0)(lambda: mark("first_page"))
                    k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
                    scores = _matmul(k_smem, queries_t, (page_size, q_rows))
                    scores = (scores.astype(dtype).astype(jnp.float32) * softmax_scale).astype(dtype).astype(
                        jnp.float32)
                    k_pos = page_index(s, i) * page_size + plgpu.broadcasted_iota(
                        jnp.int32, (page_size, q_rows), 0, layout=wgmma)
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

                init = (plgpu.layout_cast(jnp.zeros((head_dim, q_rows), jnp.float32), wgmma),
                        plgpu.layout_cast(jnp.full((q_rows,), _M_INIT, jnp.float32), row_vector),
                        plgpu.layout_cast(jnp.zeros((page_size, q_rows), jnp.float32), wgmma),
                        first_ids)
                acc, m, l_parts, _ = lax.fori_loop(0, num_steps, step, init)
                return acc, m, l_parts.sum(axis=0)

            ring = plgpu.SMEM((stages, page_size, head_dim), dtype, transforms=operand)
            return pl.run_scoped(scoped, ring, ring, plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                                 plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype, transforms=operand),  # queries
                                 plgpu.SMEM((q_rows, page_size), dtype,  # a page's probabilities
                                            transforms=smem_transforms(page_size, dtype)))

        if one_program:
            partials = [attend(s, *plans[s], first=s == 0) for s in range(num_splits)]
        else:
            partials = [attend(split, *plans[0], first=True)]
        mark("pages_done")
        mark("pages", plans[0][0])

        def store(o_smem, m_smem, l_smem):
            """The partials for the combine, through shared memory (the ring's buffers are free again). The
            output^T is read back transposed (Mosaic GPU stores fp32 registers transposed into shared memory
            only as 16-bit pairs) and stored by the threads, in the combine's `[q_rows, head_dim]`."""
            acc, m, l = partials[0]
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[sequence, kv_head, split])
            plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[sequence, kv_head, split])
            o_gmem.at[sequence, kv_head, split][...] = plgpu.load(
                o_smem.transpose((1, 0)), layout=plgpu.Layout.WG_STRIDED((q_rows, head_dim), vec_size=1))
            plgpu.wait_smem_to_gmem(0)

        def merge_and_write():
            """The leader adds the other splits' partials to its own (online, as the page loop does) and writes
            the token's rows. Compiled, the others are its cluster's peers: each puts its partials in its shared
            memory before the first sync; the second keeps that memory alive until the leader has read it."""
            def peer_partials(s):
                if one_program:
                    return partials[s]
                return tuple(plgpu.load(plgpu.cluster_ref(ref, {"s": s}), layout=layout, optimized=False)
                             for ref, layout in ((acc_smem, wgmma), (m_smem, row_vector), (l_smem, row_vector)))

            clustered = num_splits > 1 and not one_program
            if clustered:
                acc_smem[...], m_smem[...], l_smem[...] = partials[0]
                cluster_sync()

            @pl.when(leader & (token >= 0))
            def _():
                merged_acc, merged_m, merged_l = partials[0]
                for s in range(1, num_splits):
                    acc, m, l = peer_partials(s)
                    m_next = jnp.maximum(merged_m, m)
                    mine, theirs = jnp.exp(merged_m - m_next), jnp.exp(m - m_next)
                    merged_acc = (merged_acc * lax.broadcast_in_dim(mine, acc.shape, [1])
                                  + acc * lax.broadcast_in_dim(theirs, acc.shape, [1]))
                    merged_m, merged_l = m_next, merged_l * mine + l * theirs
                # No visible key: the sum and the output are 0, and so is the row.
                out_t = merged_acc / lax.broadcast_in_dim(jnp.where(merged_l > 0, merged_l, 1.0), merged_acc.shape, [1])
                write_rows(gate_output(out_t) if gated else out_t, token)

            if clustered:
                cluster_sync()

        def gate_output(out_t):
            """`output_gate_reference`'s rounding on `[head_dim, q_rows]` tiles: the attention output rounded, the
            biased logits, the sigmoid and the product rounded to the gate's dtype (the product in write_rows)."""
            out_t = out_t.astype(dtype).astype(jnp.float32)
            plgpu.barrier_wait(gate_barrier)
            logits = plgpu.load(gate_smem.transpose((1, 0)), layout=wgmma, optimized=False).astype(jnp.float32)
            columns = plgpu.broadcasted_iota(jnp.int32, out_t.shape, 1, layout=wgmma)
            for r in range(group):  # the bias of query head r (a scalar load: a group's biases are under TMA's 16 B)
                logits += jnp.where(columns == r, bias_gmem[kv_head * group + r].astype(jnp.float32), 0.0)
            logits = logits.astype(out_dtype).astype(jnp.float32)
            weights = (1.0 / (1.0 + jnp.exp(-logits))).astype(out_dtype).astype(jnp.float32)
            return out_t * weights

        if merge:
            merge_and_write()
        else:
            pl.run_scoped(store, plgpu.SMEM((head_dim, q_rows), jnp.float32),
                          plgpu.SMEM((q_rows,), jnp.float32), plgpu.SMEM((q_rows,), jnp.float32))
        mark("end")

    partial = (batch, kv_heads, num_splits, q_rows)
    stamp_type = [jax.ShapeDtypeStruct((batch * kv_heads * num_splits, len(STAMPS)), jnp.int32)] * stamps
    scratch = dict(q_smem=plgpu.SMEM((_WGMMA_ROWS, head_dim), dtype), q_barrier=plgpu.Barrier())
    inputs = [row_token.astype(jnp.int32), seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q_flat, k_flat,
              v_flat]
    if merge:
        out_types = [jax.ShapeDtypeStruct((tokens, heads, head_dim), out_dtype)]
        scratch.update(acc_smem=plgpu.SMEM((head_dim, q_rows), jnp.float32),
                       m_smem=plgpu.SMEM((q_rows,), jnp.float32), l_smem=plgpu.SMEM((q_rows,), jnp.float32),
                       out_smem=plgpu.SMEM((q_rows, head_dim), out_dtype))
        inputs.append(token_row.astype(jnp.int32))
        if gated:
            scratch.update(gate_smem=plgpu.SMEM((q_rows, head_dim), gate.dtype), gate_barrier=plgpu.Barrier())
            inputs += [gate, gate_bias]
        layout = dict(grid=(batch, kv_heads), grid_names=("b", "h"))
        if not one_program:
            layout.update(cluster=(num_splits,), cluster_names=("s",))
    else:
        out_types = [jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32),
                     *[jax.ShapeDtypeStruct(partial, jnp.float32)] * 2]
        layout = dict(grid=(batch, kv_heads, num_splits), grid_names=("b", "h", "s"))
    call = plgpu.kernel(kernel, out_type=(*out_types, *stamp_type), scratch_types=scratch,
                        interpret=plgpu.InterpretGPUParams() if interpret else None, **layout)
    outs = call(*inputs)
    return outs[0] if merge and not stamps else outs
