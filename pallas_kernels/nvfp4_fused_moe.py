"""Beam's NVFP4 MoE layer for a few decode tokens in one Mosaic GPU launch (Hopper only): gate/up GEMM,
SwiGLU, down GEMM and the routing-weighted pair sum. The layer's default at 1-7 tokens (1-8 on an H100).

Why. At one token the layer of separate kernels (`nvfp4_moe_mgpu.moe_nvfp4(fused=False)`) is six launches, each
waiting for the one before: the two GEMMs took 8.0 + 5.5 us of its 19.5, XLA's pass between them (the K splits'
sum, the global scales, SwiGLU) 1.6 and the combine two kernels of 1.7 (H200, benchmarks/moe/RESULTS.md,
session 27 run A). Here a block is a (token, expert) pair of the routing as it comes (no kernel before this one),
and one grid holds two kinds of programs:
- gate/up programs, first in the grid: `grouped_matmul`'s programs for shared-row blocks (K splits, fp32
  partial sums of which each stores its pair's token row only, from registers), each counting itself done on its
  block's counter once its sums are written;
- down programs: fetch their weight steps, wait on their block's counter, add the partial sums of their pair's
  token row and apply the global scales and SwiGLU into their activation tiles themselves, run the down GEMM, and
  write their tile of the pair's row, times the expert's global scale and the routing weight, to the fp32 output
  `[pairs, H]`; XLA adds a token's pairs after the kernel, in the kernel that converts the output for the caller.
A down program waits only on programs earlier in the grid, which the GPU starts first, so its wait cannot
keep them from running (the assumption CUTLASS's stream-K fix-up makes too). The counters (global int32; the
release / acquire of Mosaic GPU's semaphores) count in epochs (EPOCH, below), so a caller can pass them on to the
next call instead of zeroing fresh ones (`counters=`).
Rounding follows `moe_gemm_reference`: a pair's output is rounded to bf16, weighted and rounded again, the pairs
added in fp32 and the caller rounds once.

H200 (RESULTS.md, session 29): 16.2-16.3 us at one token against 18.7-18.9 for the six launches (spans: an XLA
zeroing of the semaphores, this kernel, the output's conversion to bf16). Session 30 (runs 3-6): with a block a
pair, only its token's SwiGLU row, and at 4-7 tokens the gate/up decode in 4 K chunks, 24.2 / 30.0 / 35.1 / 41.1 /
46.8 / 54.2 us at 2-7 tokens against 29.8 / 34.3 / 40.1 / 45.4 / 48.8 / 57.2 for the two GEMMs; 60.9 against 58.8 at
8 (runs 6, 8). At one token Mosaic GPU's profiler (benchmarks/moe/fused_timeline.py) shows where its 13 us go: the
gate/up programs end 6-9 us in (400 of them, 4 K steps each, the HBM shared with the resident down programs' first
fetches); the kernel's 102 registers fit 4 programs an SM, so of its 720 programs ~190 down programs start only as
gate/up programs leave, 9-13 us in, and fetch their weights then; a down program's wait, SwiGLU, 5 K steps and write
take ~4 us after its block is ready. Prefetching the down weights into L2 from the gate/up programs (TMA prefetch)
made the gate/up programs ~0.8 us slower and the down programs no faster. Session 34: with the counters passed on
from call to call (as the model's layers pass them), 15.6 us at one token and 22.4-23.5 at two, against 16.7 /
24.1 for the session-30 kernel with its zeroing kernel in the same calls (runs 2-3). The down tiles run by the
gate/up programs instead (their weights fetched before the gate/up work, every program resident) lost at every
token count (run 4: 17.8-18.2 us at one token). Session 35 (run 4): the pairs' rows written as they are and added by
XLA, where the first programs zeroed the output and the down programs waited for that before a TMA reduction into it:
15.1-15.2 / 21.7-21.8 / 32.8 / 53.0 us at 1 / 2 / 4 / 7 tokens against 15.5-15.6 / 23.2-23.3 / 34.4 / 54.6; at 1-2
tokens the down steps overlapped (`down_overlap`, run 10): 14.8 / 21.2-21.4. Per-program globaltimer stamps (run 9)
correct the profiler's picture above: the non-resident down programs start as the gate/up programs leave (5.7-7 us
in at one token), and what ends the kernel is a down program's ~4-5 us after its block is ready. Session 40
(stamps at one token, median / max): a down program's tail after its block is ready is fill 0.8 / 1.5, K loop 1.7
/ 2.7 and write 0.4 / 0.7 us; with its step scales staged before the wait the K loop is 1.0 / 2.0. Gate/up programs
that store their token's row from registers (not the whole tile by TMA, waiting for the copy) took the layer to 20.3
-20.4 / 50.4-50.7 us at 2 / 7 tokens against 20.5-20.7 / 51.4-51.8.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import nvfp4_mgpu as nm
from pallas_kernels.mgpu_tiles import device_kind, interpret_params, is_h100, stamp

_X_ROW_BYTES = 128  # the down GEMM's activation tile rows: tile_k 64 bf16, one 128-byte swizzled row
_X_TILE_K = _X_ROW_BYTES // 2  # (their bf16 columns)
# The columns of `fused_decode_moe(stamps=True)`: a program's `%globaltimer_lo` (ns) at its start and its end, its
# kind (0 gate/up, 1 down), and when it got past its phases: a down program past its block's wait ("ready") and
# with its activations filled ("filled"), any program with its K loop done ("multiplied"); 0 where it did not get
# there (a real stamp is 0 once in 2^32 ns); its block (pair); the SM it ran on (`%smid`); a gate/up program with
# its token's row stored, before it counts itself done ("stored"), and when it began its first STAMPED_STEPS K steps
# (the step's copies landed and the step before decoded).
STAMPED_STEPS = 4
STAMPS = ("start", "end", "kind", "ready", "filled", "multiplied", "block", "sm", "stored",
          *[f"step{k}" for k in range(STAMPED_STEPS)])


def _async_proxy_fence():
    """Orders this thread's global accesses of the generic proxy (loads, the counters' atomics) with those
    of the async proxy (TMA copies and reductions) across the release / acquire of a counter."""
    def fence(ctx):
        del ctx
        from jax.experimental.mosaic.gpu import utils
        utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    nm.mgpu_op(fence, lambda: None)()  # (interpret mode: one memory, nothing to order)


# The kernel's counters: int32 slots that a caller can pass from call to call (`fused_decode_moe(counters=)`, e.g.
# layer to layer) instead of zeroing fresh ones before each call (an XLA kernel and a launch: 1.8 us of the
# one-token layer's span, H200 session 30 run 7). Nothing sets them back to zero: each wait has two counters,
# one its signals add to and one its waiters add to once past it, and each grows by exactly EPOCH a call (the
# first signaller and the first waiter add the rest). A waiter reads the waiters' counter before adding to it,
# so that counter's multiple of EPOCH below it is the call's start (`base`), and it waits until the signals'
# counter is EPOCH past that. (Taking a ticket back to zero instead made the kernel 0.5-1.2 us slower: H200,
# session 34 run 1.)
EPOCH = 1 << 16  # a power of two, so that the counters' wrap-around keeps whole epochs
MAX_BLOCKS = 8 * 8  # the kernel's largest call: 8 tokens, top-8


def counter_slots(blocks: int) -> int:
    """Slots of the counters for `blocks` pairs: block b's gate/up programs signal on slot 2 b, its down programs
    pass on slot 2 b + 1."""
    return 2 * blocks


COUNTER_SLOTS = counter_slots(MAX_BLOCKS)  # enough for every call


def fresh_counters(slots: int = COUNTER_SLOTS) -> jax.Array:
    """Counters for a first `fused_decode_moe(counters=)`: every slot zero."""
    return jnp.zeros((slots,), jnp.int32)


def _share(index, count: int):
    """What program `index` of `count` adds to a counter so that the `count` of them add EPOCH in all."""
    if count >= EPOCH:
        raise ValueError(f"{count} programs count on one counter, more than EPOCH={EPOCH}")
    return jnp.where(index == 0, 1 + EPOCH - count, 1).astype(jnp.int32)


def _slot(counters, slot):
    """Pointer to a counter (`slot` a WG_SPLAT int32), in an inline_mgpu body."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import utils
    return utils.getelementptr(utils.memref_ptr(counters), [slot.registers.item()], ir.IntegerType.get_signless(32))


_SPLAT = plgpu.Layout.WG_SPLAT(())


def _add(counters, slot, amount, *, release: bool) -> None:
    """Adds `amount` to a counter from one thread; `release`: after every thread of the warpgroup, releasing their
    writes (after `_async_proxy_fence` for TMA writes)."""
    def add(ctx, counters, slot, amount):
        del ctx
        from jax.experimental.mosaic.gpu import utils
        if release:
            utils.warpgroup_barrier()
        utils.SemaphoreRef(_slot(counters, slot)).signal(amount.registers.item(), relaxed=not release,
                                                         memory_scope="gpu")

    def stand_in(counters, slot, amount):  # (interpret mode: one program at a time)
        counters[slot] = counters[slot] + amount

    nm.mgpu_op(add, stand_in, arg_types=(plgpu.RefType(), _SPLAT, _SPLAT))(counters, jnp.asarray(slot, jnp.int32),
                                                                           amount)


def _wait_epoch(counters, slot) -> None:
    """Waits until a signals' counter (`slot`) is EPOCH past this call's start, acquiring what its signals released.
    The start is the waiters' counter (slot + 1) rounded down to a multiple of EPOCH, read before this program adds
    to it, here by the waiting thread just before the wait (read by every thread instead: equal within 0.1 us at 1-2
    tokens, H200 session 35 run 8; both faster than a read at the program's start, session 34 run 8); unsigned
    differences, so a counter that wrapped still counts. Interpret mode runs the programs one at a time in the grid's
    order, so a wait that would not pass at once would never pass: there it does not wait, and what the program then
    reads was not written (the interpreter's fresh buffers: NaN in its output)."""
    def wait(ctx, counters, slot):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, scf
        from jax.experimental.mosaic.gpu import utils
        i32 = ir.IntegerType.get_signless(32)
        ptr = _slot(counters, slot)
        load = lambda address: utils.inline_ptx(  # noqa: E731
            "ld.relaxed.gpu.global.b32 $0, [$1];", address, result_types=i32, has_side_effects=True)
        with utils.single_thread(scope=utils.ThreadSubset.WARPGROUP):
            base = arith.andi(load(utils.getelementptr(ptr, [1], i32)), utils.c(-EPOCH, i32))
            loop = scf.WhileOp([], [])
            with ir.InsertionPoint(loop.before.blocks.append()):
                scf.condition(arith.cmpi(arith.CmpIPredicate.ult, arith.subi(load(ptr), base), utils.c(EPOCH, i32)), [])
            with ir.InsertionPoint(loop.after.blocks.append()):
                scf.yield_([])
            utils.inline_ptx("fence.acquire.gpu;", has_side_effects=True)
        utils.warpgroup_barrier()

    nm.mgpu_op(wait, lambda *refs: None, arg_types=(plgpu.RefType(), _SPLAT))(counters, jnp.asarray(slot, jnp.int32))


def _swiglu_activations(splits: int, block_t: int, intermediate: int):
    """inline_mgpu body: the block's gate/up partial sums (gmem `[splits, rows, 2 I]` fp32, the block's rows from
    `row0`) -> the down GEMM's activation tiles (smem `[I / 64, block_t, 64]` bf16, 128-byte swizzle): for the
    pair's `token` row, gate and up summed over the splits, times OUTPUT_FACTOR and their global scales, rounded
    to bf16, and SwiGLU rounded to bf16 (as `moe_nvfp4`'s XLA pass). The other rows keep what shared memory held:
    a row is a column of the down GEMM's output that no other column reads, and only the token's is stored
    (without their zeroing: 14.1-14.2 / 31.3 us at 1 / 4 tokens against 14.7 / 33.3, H200 session 40)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref
    from jax.experimental.mosaic.gpu import utils

    def body(ctx, sums_ref, x_ref, row0, token, gate_scale, up_scale):
        del ctx
        index, i32, f32, bf16 = ir.IndexType.get(), ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.BF16Type.get()
        token = arith.index_cast(index, token.registers.item())
        row = arith.addi(arith.index_cast(index, row0.registers.item()), token)
        gate_factor = arith.mulf(gate_scale.registers.item(), arith.constant(f32, nm.OUTPUT_FACTOR))
        up_factor = arith.mulf(up_scale.registers.item(), arith.constant(f32, nm.OUTPUT_FACTOR))
        base = utils.memref_ptr(x_ref)

        def place(t, j):
            """Byte of activation (row t, column j): tile j / 64, row t, 16-byte chunk (j % 64 / 8) ^ (t % 8)."""
            step, k = arith.divui(j, utils.c(64, index)), arith.remui(j, utils.c(64, index))
            chunk = arith.xori(arith.divui(k, utils.c(8, index)), arith.remui(t, utils.c(8, index)))
            byte = arith.addi(arith.muli(arith.addi(arith.muli(step, utils.c(block_t, index)), t),
                                         utils.c(_X_ROW_BYTES, index)),
                              arith.addi(arith.muli(chunk, utils.c(16, index)),
                                         arith.muli(arith.remui(k, utils.c(8, index)), utils.c(2, index))))
            return utils.getelementptr(base, [arith.index_cast(i32, byte)], ir.IntegerType.get_signless(8))

        def partial_sums(j):  # the splits' partial sums of gate column j, then of up column j
            return [memref.load(sums_ref, [utils.c(s, index), row, column])
                    for column in (j, arith.addi(j, utils.c(intermediate, index))) for s in range(splits)]

        def projection(sums, factor):
            total = sums[0]
            for value in sums[1:]:
                total = arith.addf(total, value)
            return arith.extf(f32, arith.truncf(bf16, arith.mulf(total, factor)))

        def one(j, sums):
            gate, up = projection(sums[:splits], gate_factor), projection(sums[splits:], up_factor)
            llvm.store(arith.truncf(bf16, nm.swiglu_value(gate, up)), place(token, j))

        # A thread's loads for all its columns (2-3 of them, gate and up of each K split) first: one round trip to L2,
        # none waiting behind the last column's guard (no change measured: 14.1-14.2 us at one token against 14.2,
        # H200 session 40).
        nm.for_each_index(intermediate, one, load=partial_sums)

    return body


def _each_token_value(acc, tile_n: int, token, store) -> None:
    """In an inline_mgpu body: `store(row, value)` for each value of the fp32 accumulator [tile_n, 8] (WGMMA layout)
    in column `token` (an index), by the threads that hold it (rows r and r + 8 of each 64-row tile: a thread holds
    columns 2 (lane % 4) and that + 1)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, scf, vector
    from jax.experimental.mosaic.gpu import utils

    index = ir.IndexType.get()
    row0, lane = nm._thread_place()
    holds = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(lane, utils.c(4, index)),
                       arith.divui(token, utils.c(2, index)))
    second = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(token, utils.c(2, index)), utils.c(1, index))
    guard = scf.IfOp(holds)
    with ir.InsertionPoint(guard.then_block):
        for m in range(tile_n // 64):
            for half in range(2):
                pair = acc.registers[m, 0, 0, 0, half, 0, 0, 0, 0]
                value = arith.select(second, vector.extract(pair, dynamic_position=[], static_position=[1]),
                                     vector.extract(pair, dynamic_position=[], static_position=[0]))
                store(arith.addi(row0, utils.c(64 * m + 8 * half, index)), value)
        scf.yield_([])


def _store_token_row(tile_n: int):
    """inline_mgpu body: the gate/up fp32 accumulator [tile_n, 8] (WGMMA layout) -> gmem: its column `token` (the
    one row of the partial sums that the pair's down programs read) to `sums[split, row, col0 ..]`, stored from
    registers by the threads that hold it, no shared memory or TMA."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref

    def body(ctx, acc, sums_ref, split, row, col0, token):
        del ctx
        as_index = lambda v: arith.index_cast(ir.IndexType.get(), v.registers.item())  # noqa: E731
        split, row, col0, token = map(as_index, (split, row, col0, token))
        _each_token_value(acc, tile_n, token,
                          lambda n, value: memref.store(value, sums_ref, [split, row, arith.addi(col0, n)]))

    return body


def _store_weighted_row(tile_n: int):
    """inline_mgpu body: the down GEMM's fp32 accumulator [tile_n, 8] (WGMMA layout) -> gmem: its column `token`
    (the pair's row of the down tile) to `out[b, n0 ..]`, each value times OUTPUT_FACTOR and its row's global scale,
    rounded to bf16 (the expert's output), times the pair's routing weight and rounded to bf16 again (the pair's
    output, as `moe_gemm_reference`); stored from registers by the threads that hold the column, as
    `_store_token_row`. (Through shared memory by TMA, waiting for the copy: 61.6-61.8 us at 7 tokens against
    58.9-59.8, 15.9 against 15.6-15.8 at one; H100, RESULTS.md session 44.)"""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref

    def body(ctx, acc, out_ref, scale_ref, b, n0, token, weight):
        del ctx
        index, f32, bf16 = ir.IndexType.get(), ir.F32Type.get(), ir.BF16Type.get()
        round_bf16 = lambda v: arith.extf(f32, arith.truncf(bf16, v))  # noqa: E731
        as_index = lambda v: arith.index_cast(index, v.registers.item())  # noqa: E731
        b, n0, token = map(as_index, (b, n0, token))
        weight = weight.registers.item()

        def store(row, value):
            factor = arith.mulf(memref.load(scale_ref, [row]), arith.constant(f32, nm.OUTPUT_FACTOR))
            value = round_bf16(arith.mulf(round_bf16(arith.mulf(value, factor)), weight))
            memref.store(value, out_ref, [b, arith.addi(n0, row)])

        _each_token_value(acc, tile_n, token, store)

    return body


# Interpret mode's stand-ins (`nm.mgpu_op`) for the three bodies above.
def _swiglu_activations_stand_in(splits: int, intermediate: int):
    """`_swiglu_activations` in interpret mode (`exp` rather than `ex2.approx`)."""

    def stand_in(sums_ref, x_ref, row0, token, gate_scale, up_scale):
        row = row0 + token

        def projection(start, scale):
            total = sums_ref[0, row, pl.ds(start, intermediate)]
            for split in range(1, splits):
                total = total + sums_ref[split, row, pl.ds(start, intermediate)]
            return (total * (scale * nm.OUTPUT_FACTOR)).astype(jnp.bfloat16)

        values = nm._swiglu(projection(0, gate_scale), projection(intermediate, up_scale))
        values = values.astype(jnp.bfloat16)
        for step in range(intermediate // _X_TILE_K):
            x_ref[step, token, :] = values[step * _X_TILE_K:(step + 1) * _X_TILE_K]

    return stand_in


def _store_token_row_stand_in(tile_n: int):
    """`_store_token_row` in interpret mode."""
    def stand_in(acc, sums_ref, split, row, col0, token):
        sums_ref[split, row, pl.ds(col0, tile_n)] = jax.lax.dynamic_slice_in_dim(acc, token, 1, axis=1)[:, 0]

    return stand_in


def _store_weighted_row_stand_in(tile_n: int):
    """`_store_weighted_row` in interpret mode."""
    def stand_in(acc, out_ref, scale_ref, b, n0, token, weight):
        column = jax.lax.dynamic_slice_in_dim(acc, token, 1, axis=1)[:, 0]
        expert_out = (column * (scale_ref[...] * nm.OUTPUT_FACTOR)).astype(jnp.bfloat16).astype(jnp.float32)
        out_ref[b, pl.ds(n0, tile_n)] = (expert_out * weight).astype(jnp.bfloat16).astype(jnp.float32)

    return stand_in


def program_defaults(tokens: int, kind: str) -> dict:
    """The kernel's settings at `tokens` tokens where a call leaves them unset, each the faster one in a same-run
    comparison on an H200 (spans, µs; benchmarks/moe/RESULTS.md), or on an H100 where `kind` (`device_kind()`) is one
    and it measured otherwise. `most_splits`: the gate/up K splits, at most (those that divide its K steps);
    `decode_chunks`: the gate/up decode's K chunks, at most (those that split its tile_k)."""
    h100 = is_h100(kind)
    return dict(
        # Up to 5 at 1-2 tokens, 2 at 3-7, else 1 (16.2-16.3 us against 17.4-17.5 with 4 at one token, session 29;
        # 23.8 / 29.8 / 37.4 us at 2 / 3 / 4 tokens against 25.0 / 32.4 / 40.7 with the other of 2 and 5, and 29.2
        # / 34.7 / 39.4 with 1, session 30 run 4; with 4 decode chunks 41.1 / 46.8 / 54.2 at 5 / 6 / 7 against 45.4
        # / 50.1 / 55.2 with 1, runs 6 and 8). On an H100 4 at 2 tokens, with 3 stages (below).
        most_splits=4 if h100 and tokens == 2 else 5 if tokens <= 2 else 2 if tokens <= 7 else 1,
        # 2; on an H100 3 at 2 tokens (with 4 splits: 22.8 / 22.8 / 23.1 / 23.2 against 23.6 / 23.4 / 23.3 / 23.4)
        # and 4 (37.8 / 38.2 / 37.8 against 39.1 / 39.0 / 39.2; equal at 3 and 5, slower at 6-8; session 45); 4 at
        # one token, with the scales staged by chunk (below).
        gate_up_stages=4 if h100 and tokens == 1 else 3 if h100 and tokens in (2, 4) else 2,
        # On an H100 at one token, so that 4 stages (every K step's copy at once) fit 4 programs an SM: 15.4 / 15.4 /
        # 15.4 / 15.4 / 15.5 / 15.3 us against 15.9 / 16.1 / 15.7 / 15.6 / 15.7 / 15.6 (4 stages alone, 3 programs an
        # SM: 15.5 / 15.6; the staging alone 15.8 / 15.6; session 46). At two tokens equal (23.0-23.3 against
        # 22.9-23.4). Off elsewhere: untimed on an H200.
        gate_up_chunk_scales=h100 and tokens == 1,
        # 4 K chunks at 4-7 tokens (75 registers instead of 102: the gate/up grid in one wave; 35.1 / 41.1 / 46.8 us
        # at 4 / 5 / 6 tokens against 36.9 / 44.5 / 50.9, session 30 run 6; slower at 1 and 3), else 2.
        decode_chunks=4 if 4 <= tokens <= 7 else 2,
        # At 1-2 tokens (14.8 / 21.2-21.4 us against 14.9-15.1 / 21.9-22.0; at 4 and 7 tokens, where the kernel
        # takes 71 registers, 98 with it: 33.7 / 56.6-56.8 against 32.9-33.0 / 53.4-53.5; session 35 run 10).
        down_overlap=tokens <= 2,
        # At one token (13.7-14.0 us against 14.1-14.5; at two 21.0-21.3 against 20.3-20.7, session 40).
        down_scales_first=tokens == 1)


def fits(hidden: int, down_tile_k: int, tokens: int) -> bool:
    """Whether `fused_decode_moe` takes these shapes: down weights in K steps of 64 (its activation tiles are one
    128-byte row), a hidden size in whole 64-row down tiles, at most 8 tokens."""
    return down_tile_k * 2 == _X_ROW_BYTES and hidden % 64 == 0 and tokens <= 8


def fused_decode_moe(x, pair_expert, pair_weight, gate_up_packed, gate_up_scales, gate_up_global_scale,
                     down_packed, down_scales, down_global_scale, *, gate_up_tile_k: int, down_tile_k: int,
                     splits: int | None = None, gate_up_stages: int | None = None, gate_up_tile_n: int = 64,
                     gate_up_decode_chunks: int | None = None, down_stages: int = 5,
                     down_tile_n: int | None = None,
                     down_decode_row_chunks: int = 1, down_overlap: bool | None = None,
                     down_scales_first: bool | None = None, gate_up_chunk_scales: bool | None = None, counters=None,
                     compiler_params=None, stamps: bool = False, interpret: bool = False):
    """`x [T, H]` bf16 (T <= 8), `pair_expert [T * top_k]` int32 (token t's picks from t * top_k on; an expert
    outside [0, E): skip the pair) and `pair_weight [T * top_k]` fp32, its routing weights. Each pair is a block of
    all T rows (shared rows), of which only its token's row is weighted: two pairs of one expert read its weights
    twice, at the same time (no kernel before this one to merge them: RESULTS.md, session 30). The gate/up weights
    (gate rows then up rows, `nm.pack_weights` with `gate_up_tile_k`; global scales `[E, 2 I]`) and the down weights
    (`down_tile_k` 64) -> `[8, H]` fp32, the routed experts' output of each token (rows past T zero). Settings as
    `grouped_matmul`'s: the gate/up GEMM's `splits` K splits, pipeline `stages`, `tile_n` rows a program and
    `decode_chunks`; the down GEMM's; `down_overlap`: a down program issues every K step's copy at once and decodes a
    step while the one before multiplies (`down_stages` then does not apply); `down_scales_first` (with
    `down_overlap`): it stages every step's block scales before it waits for its block; `gate_up_chunk_scales`: a
    gate/up program stages each decode chunk's block scales before that chunk's decode, in a buffer of 1 / chunks
    the size (4 gate/up stages then fit 4 programs an SM at 1-2 tokens: 55376 bytes a program against 57424, with
    the 1 KB the GPU reserves a program 4 x 56400 of 228 KB). Unset, the gate/up settings and these three are
    `program_defaults`' for the token count and the device. (Settings that lost
    everywhere they were timed were removed: a grid of blocks one after another with padded shared memory, a down
    program's wait per K step, an expert's pairs computed once, a token's pairs added in the kernel, RESULTS.md
    session 43; a down program's weight copies issued only once some of its block's gate/up programs are done, and
    gate/up programs asking L2 for later down programs' weights mid-stream, session 45.)
    `counters`:
    int32 `[slots]` from `fresh_counters()` or as the call before returned them (other values break the waits: wrong
    sums or a hang); then (output, counters) come back, for the next call. Unset, or with fewer than
    `counter_slots(pairs)` slots (returned untouched), the call zeroes its own (an XLA kernel before this one).
    `compiler_params`: `plgpu.CompilerParams` for the kernel (e.g. Mosaic GPU's profiler, which records the named
    scopes of each program: benchmarks/moe/fused_timeline.py).
    `stamps` (a diagnostic): the kernel also writes int32 `[programs, len(STAMPS)]` (each program's `%globaltimer_lo`
    at its start, its end and past its phases, and its kind), and the call returns (what it returns otherwise,
    stamps).
    `interpret`: Mosaic GPU's interpret mode on the CPU, the PTX bodies replaced by stand-ins (`nm.mgpu_op`), the
    programs run one at a time in the grid's order (so no wait waits; no `stamps`)."""
    tokens, hidden = x.shape
    experts, gu_steps, gu_rows, _ = gate_up_packed.shape
    defaults = program_defaults(tokens, device_kind())
    if gate_up_decode_chunks is None:  # (as many as a step has, up to the default)
        gate_up_decode_chunks = max(c for c in (1, 2, 4) if c <= defaults["decode_chunks"]
                                    and gate_up_tile_k % (c * nm.TILE_K_QUANTUM) == 0)
    gate_up_stages = defaults["gate_up_stages"] if gate_up_stages is None else gate_up_stages
    down_overlap = defaults["down_overlap"] if down_overlap is None else down_overlap
    down_scales_first = defaults["down_scales_first"] if down_scales_first is None else down_scales_first
    gate_up_chunk_scales = defaults["gate_up_chunk_scales"] if gate_up_chunk_scales is None else gate_up_chunk_scales
    if down_tile_n is None:  # 128 rows where they divide the hidden size (17.1 us against 19.1 with 64
        # and 4 stages, session 29 run A)
        down_tile_n = 128 if hidden % 128 == 0 else 64
    block_t = 8  # wgmma's narrowest N
    blocks = pair_expert.shape[0]  # a block a pair
    top_k = blocks // tokens
    intermediate = gu_rows // 2
    if (tokens > block_t or pair_weight.shape != (blocks,) or blocks % tokens or gu_steps * gate_up_tile_k != hidden
            or down_tile_k * 2 != _X_ROW_BYTES or down_packed.shape[1:] != (intermediate // down_tile_k, hidden,
                                                                               down_tile_k // 2)
            or down_packed.shape[0] != experts or hidden % down_tile_n or gu_rows % gate_up_tile_n):
        raise ValueError(f"shapes: x {x.shape}, pairs {pair_expert.shape} / {pair_weight.shape}, gate/up "
                         f"{gate_up_packed.shape} (tile_k {gate_up_tile_k}), down {down_packed.shape} "
                         f"(tile_k {down_tile_k}), tile_n {gate_up_tile_n} / {down_tile_n}")
    if splits is None:  # (as many as divide the K steps, up to the default)
        splits = max(s for s in (1, 2, 4, 5) if gu_steps % s == 0 and s <= defaults["most_splits"])
    if gate_up_tile_k % (nm.TILE_K_QUANTUM * gate_up_decode_chunks):
        raise ValueError(f"gate_up_decode_chunks={gate_up_decode_chunks} must split gate_up_tile_k={gate_up_tile_k} "
                         f"into multiples of {nm.TILE_K_QUANTUM}")
    gu_k_steps, down_k_steps = gu_steps // splits, intermediate // down_tile_k
    gu_programs_per_block = gu_rows // gate_up_tile_n * splits
    down_tiles = hidden // down_tile_n
    gu_programs, down_programs = blocks * gu_programs_per_block, blocks * down_tiles
    if interpret and stamps:
        raise ValueError("stamps read the GPU's clock: not in interpret mode")
    slots = counter_slots(blocks)
    if counters is not None and (counters.dtype != jnp.int32 or counters.ndim != 1):
        raise ValueError(f"counters must be int32 [slots] (`fresh_counters()` or a call's), got "
                         f"{counters.dtype}{list(counters.shape)}")
    own = counters is None or counters.shape[0] < slots
    if gu_steps % splits:
        raise ValueError(f"splits={splits} must divide gate/up's {gu_steps} K steps")
    gu_in_specs, gu_stage, gu_decodes, _ = nm._tile_programs(
        gate_up_tile_n, gate_up_tile_k, block_t, False, False, gate_up_decode_chunks,
        chunk_staging=gate_up_chunk_scales)
    gu_staged_words = gate_up_tile_n * gate_up_tile_k // 16 // (gate_up_decode_chunks if gate_up_chunk_scales else 1)
    down_line_box = down_tile_k // 2 < nm._LINE
    down_in_specs, down_stage, down_decodes, _ = nm._tile_programs(
        down_tile_n, down_tile_k, block_t, True, down_line_box, 1, row_chunks=down_decode_row_chunks)
    gu_scales = nm._fold_scales(gate_up_scales, gate_up_tile_k)
    down_scales = nm._fold_scales(down_scales, down_tile_k)
    if down_line_box:
        down_packed = down_packed.reshape(*down_packed.shape[:2], -1, nm._LINE)
    x_transforms = down_in_specs(0, 0, 0, 0)[-1].transforms  # the down GEMM's activation tiles (swizzled)
    fill_types = (plgpu.RefType(), plgpu.RefType(transforms=x_transforms), *[_SPLAT] * 4)
    fill = nm.mgpu_op(_swiglu_activations(splits, block_t, intermediate),
                      _swiglu_activations_stand_in(splits, intermediate), arg_types=fill_types)
    token_row = nm.mgpu_op(_store_token_row(gate_up_tile_n), _store_token_row_stand_in(gate_up_tile_n),
                           arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), *[_SPLAT] * 4))
    row_store = nm.mgpu_op(_store_weighted_row(down_tile_n), _store_weighted_row_stand_in(down_tile_n),
                           arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(), *[_SPLAT] * 4))

    def run_k_loop(step_body, tile_n, specs, gmem_refs, k_steps, stages, fill_activations=None):
        """The program's K loop into a fresh accumulator [tile_n, block_t], returned in registers."""
        def acc_scope(acc_ref):
            def step(indices, w_smem, s_smem, x_smem):
                step_body(acc_ref, indices, w_smem, s_smem, x_smem)
            if fill_activations is None:
                plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=specs, max_concurrent_steps=stages)(*gmem_refs)
            else:
                nm._prefetched_k_loop(step, specs, gmem_refs, k_steps=k_steps, stages=stages,
                                      fill_activations=fill_activations)
            return acc_ref[...]
        return pl.run_scoped(acc_scope, plgpu.ACC((tile_n, block_t)))

    def decode_step(stage, decodes, tile_n, tile_k, line_box, row_chunks, staged_smem, drain=True):
        def body(acc_ref, indices, w_smem, s_smem, x_smem):
            del indices
            weights = w_smem if line_box else nm._load_bytes(w_smem)
            stage_chunk = None
            if isinstance(stage, list):  # (chunk staging)
                stage_chunk = lambda chunk: stage[chunk](s_smem, staged_smem)  # noqa: E731
            else:
                stage(s_smem, staged_smem)
            nm.multiply_step(acc_ref, decodes, weights, staged_smem, x_smem, tile_n=tile_n, tile_k=tile_k,
                             row_chunks=row_chunks, drain=drain, stage_chunk=stage_chunk)
        return body

    down_words = down_tile_n * down_tile_k // 16  # a step's staged block scales

    def resident_down_loop(acc_ref, specs, gmem_refs, fill_activations, staged_smem):
        """A down program's K loop with every step's copy issued first: after `fill_activations`, each step's scales
        are staged into a buffer of its own and its decode runs while the step before multiplies (no wait for a
        step's wgmma before the next step's decode, as a pipeline's step has)."""
        weight_specs, x_spec = specs[:-1], specs[-1]
        shape = lambda spec: tuple(d for d in spec.block_shape if not nm._squeezed(d))  # noqa: E731

        def scoped(weight_bufs, x_buf, barriers):
            for kk in range(down_k_steps):
                for spec, ref, buf in zip(weight_specs, gmem_refs, weight_bufs):
                    plgpu.copy_gmem_to_smem(nm._block_of(spec, ref, (kk,)), buf.at[kk], barriers.at[kk])
            staged = [staged_smem.at[pl.ds(kk * down_words, down_words)] for kk in range(down_k_steps)]

            def stage_scales(kk):  # once the step's copies landed
                plgpu.barrier_wait(barriers.at[kk])
                down_stage(weight_bufs[1].at[kk], staged[kk])

            if down_scales_first:  # every step's scales staged before the block's wait, off the tail after it
                for kk in range(down_k_steps):
                    stage_scales(kk)
            fill_activations(x_buf)
            for kk in range(down_k_steps):
                if not down_scales_first:
                    stage_scales(kk)
                nm.multiply_step(acc_ref, down_decodes, weight_bufs[0].at[kk], staged[kk], x_buf.at[kk],
                                 tile_n=down_tile_n, tile_k=down_tile_k, row_chunks=down_decode_row_chunks,
                                 drain=kk + 1 == down_k_steps)

        pl.run_scoped(scoped,
                      [plgpu.SMEM((down_k_steps, *shape(sp)), r.dtype, transforms=sp.transforms)
                       for sp, r in zip(weight_specs, gmem_refs)],
                      plgpu.SMEM((down_k_steps, *shape(x_spec)), gmem_refs[-1].dtype, transforms=x_spec.transforms),
                      plgpu.Barrier(num_arrivals=len(weight_specs), num_barriers=down_k_steps))

    def kernel(pair_expert_gmem, pair_weight_gmem, x_gmem, gu_packed_gmem, gu_scales_gmem, gu_global_gmem,
               down_packed_gmem, down_scales_gmem, down_global_gmem, counters_gmem, out_gmem, sums_gmem, *stamps_gmem):
        p = jax.lax.axis_index("p")

        def mark(name, value=None, **options):  # a stamp (`stamps`)
            if stamps:
                stamp(stamps_gmem[0], p, STAMPS.index(name), value, **options)

        # Every gate/up program first in the grid, then the down programs: a down program waits only on programs
        # that the GPU started before it, so its wait cannot keep them from running.
        gate_up = p < gu_programs
        q = p - gu_programs
        b = jnp.where(gate_up, p // gu_programs_per_block, q // down_tiles)  # the block (pair)
        r = jnp.where(gate_up, p % gu_programs_per_block, q % down_tiles)  # the program among its block's of its kind
        token = b // top_k

        mark("start")
        mark("kind", jnp.logical_not(gate_up).astype(jnp.int32))
        mark("block", b)
        mark("sm", register="%smid")
        for phase in ("ready", "filled", "multiplied", "stored", *STAMPS[-STAMPED_STEPS:]):  # 0 until reached
            mark(phase, 0)

        @pl.when(gate_up)
        def _():
            ni, si = r // splits, r % splits
            expert = pair_expert_gmem[b]

            @pl.when((expert >= 0) & (expert < experts))
            def _():
                def scoped(staged_smem):
                    decode = decode_step(gu_stage, gu_decodes, gate_up_tile_n, gate_up_tile_k, False, 1, staged_smem)

                    def body(acc_ref, indices, *smem):
                        if stamps:
                            @pl.when(indices[0] < STAMPED_STEPS)
                            def _():
                                stamp(stamps_gmem[0], p, STAMPS.index("step0") + indices[0])
                        decode(acc_ref, indices, *smem)

                    specs = gu_in_specs(expert, si * gu_k_steps, ni, 0)
                    with jax.named_scope("gate_up_k_loop"):
                        acc = run_k_loop(body, gate_up_tile_n, specs, (gu_packed_gmem, gu_scales_gmem, x_gmem),
                                         gu_k_steps, gate_up_stages)
                    mark("multiplied")
                    with jax.named_scope("gate_up_write"):
                        token_row(acc, sums_gmem, si, b * block_t + token, ni * gate_up_tile_n, token)
                    mark("stored")
                pl.run_scoped(scoped, plgpu.SMEM((gu_staged_words,), jnp.uint32))
                _add(counters_gmem, 2 * b, _share(r, gu_programs_per_block), release=True)

        @pl.when(jnp.logical_not(gate_up))
        def _():
            ni = r
            expert = pair_expert_gmem[b]

            @pl.when((expert >= 0) & (expert < experts))  # (a skipped pair's row is not written: the caller drops
            def _():  # it)
                weight = pair_weight_gmem[b]  # (its token's row is the one stored)
                gate_scale, up_scale = gu_global_gmem[expert, 0], gu_global_gmem[expert, intermediate]

                def scoped(staged_smem, scale_smem, scale_barrier):
                    plgpu.copy_gmem_to_smem(down_global_gmem.at[expert, pl.ds(ni * down_tile_n, down_tile_n)],
                                            scale_smem, scale_barrier)

                    def fill_activations(x_buf):
                        """The activations, once the block's gate/up programs are done."""
                        with jax.named_scope("down_wait"):
                            _wait_epoch(counters_gmem, 2 * b)
                            _add(counters_gmem, 2 * b + 1, _share(ni, down_tiles), release=False)
                            _async_proxy_fence()
                        mark("ready")
                        with jax.named_scope("down_swiglu"):
                            fill(sums_gmem, x_buf, b * block_t, token, gate_scale, up_scale)
                            plgpu.commit_smem()
                        mark("filled")

                    body = decode_step(down_stage, down_decodes, down_tile_n, down_tile_k, down_line_box,
                                       down_decode_row_chunks, staged_smem)
                    specs = down_in_specs(expert, 0, ni, 0)
                    with jax.named_scope("down_k_loop"):
                        if down_overlap:
                            def resident(acc_ref):
                                resident_down_loop(acc_ref, specs, (down_packed_gmem, down_scales_gmem, x_gmem),
                                                   fill_activations, staged_smem)
                                return acc_ref[...]
                            acc = pl.run_scoped(resident, plgpu.ACC((down_tile_n, block_t)))
                        else:
                            acc = run_k_loop(body, down_tile_n, specs, (down_packed_gmem, down_scales_gmem, x_gmem),
                                             down_k_steps, down_stages, fill_activations=fill_activations)
                    mark("multiplied")
                    with jax.named_scope("down_write"):
                        plgpu.barrier_wait(scale_barrier)
                        # The pair's row of the tile: a row of its own, no zeroing or reduction.
                        row_store(acc, out_gmem, scale_smem, b, ni * down_tile_n, token, weight)

                pl.run_scoped(scoped, plgpu.SMEM(((down_k_steps if down_overlap else 1) * down_words,), jnp.uint32),
                              plgpu.SMEM((down_tile_n,), jnp.float32), plgpu.Barrier())

        mark("end")

    programs = gu_programs + down_programs
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((blocks, hidden), jnp.float32),
                  jax.ShapeDtypeStruct((splits, blocks * block_t, gu_rows), jnp.float32),
                  *[jax.ShapeDtypeStruct((programs, len(STAMPS)), jnp.int32)] * stamps),
        grid=(programs,),
        grid_names=("p",),
        compiler_params=compiler_params,
        interpret=interpret_params(interpret),
    )
    counters_ref = jax.new_ref(fresh_counters(slots) if own else counters)
    pair_expert = pair_expert.astype(jnp.int32)
    with nm.interpreting(interpret):
        pair_out, _, *stamped = call(pair_expert, pair_weight.astype(jnp.float32), x, gate_up_packed, gu_scales,
                                     gate_up_global_scale, down_packed, down_scales, down_global_scale, counters_ref)
    # A token's pairs added by XLA (in the kernel that converts the output for the caller); skipped pairs' rows were
    # not written.
    computed = (pair_expert >= 0) & (pair_expert < experts)
    out = jnp.where(computed[:, None], pair_out, 0.0).reshape(tokens, top_k, hidden).sum(1)
    out = jnp.pad(out, ((0, block_t - tokens), (0, 0)))
    result = out if counters is None else (out, counters if own else jax.freeze(counters_ref))
    return (result, *stamped) if stamps else result


def fused_decode_moe_emulated(x, pair_expert, pair_weight, gate_up_packed, gate_up_scales, gate_up_global_scale,
                              down_packed, down_scales, down_global_scale, *, gate_up_tile_k: int, down_tile_k: int,
                              counters=None, **settings):
    """`fused_decode_moe`'s contract in plain jnp, from the kernel layouts (for CPU tests of the code that calls
    it): both GEMMs by `nm.grouped_matmul_emulated`, then the weighted sum with the kernel's rounding in `x`'s
    dtype; `counters` come back as they came. `settings` (the kernel's program shapes) do not change the result,
    but each must be one that `fused_decode_moe` takes."""
    known = inspect.signature(fused_decode_moe).parameters
    unknown = sorted(key for key in settings if key not in known or known[key].kind != inspect.Parameter.KEYWORD_ONLY)
    if unknown:
        raise TypeError(f"fused_decode_moe takes no settings {unknown}")
    tokens = x.shape[0]
    block_t, blocks, experts = 8, pair_expert.shape[0], gate_up_packed.shape[0]
    computed = (pair_expert >= 0) & (pair_expert < experts)
    block_expert = jnp.where(computed, pair_expert, -1)
    gu = nm.grouped_matmul_emulated(x, block_expert, gate_up_packed, gate_up_scales, block_t=block_t,
                                    tile_k=gate_up_tile_k, shared_rows=True, global_scale=gate_up_global_scale,
                                    swiglu=True)[0]
    down = nm.grouped_matmul_emulated(gu, block_expert, down_packed, down_scales, block_t=block_t,
                                      tile_k=down_tile_k, global_scale=down_global_scale)[0]
    pair_token = jnp.arange(blocks) // (blocks // tokens)
    token_weight = jnp.where(pair_token[:, None] == jnp.arange(tokens), pair_weight[:, None], 0.0)
    pair_out = down.reshape(blocks, block_t, -1)[:, :tokens].astype(jnp.float32) * token_weight[:, :, None]
    # Rounded to the activations' dtype (the kernel's bf16; the model's fp32 on a CPU), as the two GEMMs' glue.
    pair_out = jnp.where(computed[:, None, None], pair_out.astype(x.dtype).astype(jnp.float32), 0.0)
    out = jnp.pad(pair_out.sum(0), ((0, block_t - tokens), (0, 0)))
    return out if counters is None else (out, counters)
