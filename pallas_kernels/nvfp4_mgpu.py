"""Grouped NVFP4 x bf16 GEMM for Hopper in Pallas Mosaic GPU: weights decoded in the wgmma registers.

Computes, for every block b of `block_t` activation rows (one expert per block),
`out[s, b*block_t + t, n] = sum_k W[e_b, n, k] * x[b*block_t + t, k]` over the K range of split s, in
fp32, without the global scale. A program (one warpgroup) computes `tile_n` rows of W (64 per wgmma
row tile) for one block and split. The weight tile is the wgmma's A operand and lives in registers:
it is loaded as bytes and decoded there, so decoded weights never go through shared memory. The
activations are the B operand, read by wgmma from shared memory.

Why a kernel layout. wgmma's register layout gives each thread, per row and per 32 K values, four
bf16x2 registers. A thread loads those 32 K values' 4 bytes as one 32-bit word; the load-time
repacking below (`pack_kernel_layout`) places each value's four bits in that word so that a register
needs one `and` (pair 0), a rotate and an `and` (pairs 1, 2), or an `and`, a multiply and an `and`
(pair 3), then one `fma.rn.bf16x2` by the block scales: 1 integer operation per value (the Triton
kernel issues 5.1 instructions per value, RESULTS.md run I). The bits land on a bf16 bit pattern
with the E2M1 magnitude at bits 6-8 and the sign at bit 15: value * 2^-126, subnormals included.
The words hold K in its own order: register pair p of thread t holds values 8 p + 2 t and the next of
the 32, both in scale block p // 2, so the warpgroup stages each block scale in both halves of a
register and that register multiplies the pair with no shuffle. (Until session 18 each register held
one value of each block, at the price of a permuted K for the activations: an XLA transpose before
every decode GEMM and a permuting row gather at prefill. A byte permute per register pair in the
decode instead of the staged copies cost gate/up 15 % at T = 8, H200 session 18.)
The block scales are one byte each, as in the checkpoint (bf16 scales were 11 % more bytes than the
weights' floor): a code `(E - 224) << 3 | m` of the bf16 `scale * 2^119` (exponent field E in 237..254 for
every e4m3 value, subnormals included; m its 3 mantissa bits), so that a byte permute, a shift and an
`or` rebuild a register of two (`pack_scales`). Zero and negative scales have no code: the packing makes
the block's values zero or flips their signs instead (`canonical_blocks`), which represents the same weights.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu_tiles import interpret_params
from pallas_kernels.moe_gemm import _swiglu

# bf16 bit positions of an E2M1 code's bits (m, e0, e1, sign) in the low half of a register.
_CODE_BIT_POSITIONS = (6, 7, 8, 15)
_PAIR_MASK = 0x81C081C0
# Pairs 0-2: stored rotated left by these amounts. Pair 3: stored at _REST_BITS, moved into place by
# one multiply (shifts 2, 7, 12; the shifted copies do not overlap, so the product is an OR).
_ROTATIONS = (0, 3, 6)
_REST_BITS = (0, 1, 3, 4, 16, 17, 19, 20)
_REST_MASK = sum(1 << bit for bit in _REST_BITS)
_REST_SHIFTS = (2, 7, 12)
_REST_MULTIPLIER = sum(1 << shift for shift in _REST_SHIFTS)
# The decoded weight is value * 2^-126 * (scale * 2^119): the output is multiplied by 2^7.
SCALE_FACTOR = 2.0**119
OUTPUT_FACTOR = 2.0**7
_K_PER_WORD_GROUP = 32  # one 32-bit word per thread per row per 32 K values
_SCALE_ROW = 16  # the kernel layout's scale words fold into rows of 16 (64 bytes) for TMA's box limits
_LINE = 128  # bytes of a line of the weight boxes of short rows (`grouped_matmul`)
SWIGLU_MIN_TILE_K = 2 * _LINE  # `grouped_matmul(swiglu=True)` needs whole swizzled rows, not line boxes
# Scale codes: bf16 bits (code << 4) | _SCALE_BASE, i.e. exponent field 224 | (code >> 3), mantissa code & 7.
_SCALE_BASE = 0x7000
_SCALE_EXPONENT_OFFSET = 224
_SCALES_PER_WORD = 4
# prmt selector: a word's scale byte j to bytes 0 and 2 of a register, zeros in 1 and 3 (plus j * 0x101).
_SCALE_SELECTOR = 0x4040
# tile_k: a multiple of 64, so that a byte tile row is >= 32 bytes (Mosaic's smallest swizzle).
TILE_K_QUANTUM = 64


def _stored_position(pair: int, target: int) -> int:
    """Bit of the packed word that holds the bit decoded to `target` for register pair `pair`."""
    if pair < 3:
        return (target + _ROTATIONS[pair]) % 32
    sources = [target - shift for shift in _REST_SHIFTS if target - shift in _REST_BITS]
    assert len(sources) == 1, (target, sources)
    return sources[0]


def pack_kernel_layout(codes) -> jax.Array:
    """E2M1 codes `[..., K]` (one code per value) -> bytes `[..., K/2]` (jnp)."""
    k = codes.shape[-1]
    if k % _K_PER_WORD_GROUP:
        raise ValueError(f"K={k} must be a multiple of {_K_PER_WORD_GROUP}")
    codes = jnp.asarray(codes, jnp.uint32).reshape(*codes.shape[:-1], k // 32, 4, 4, 2)  # [.., c, pair, thread, half]
    codes = jnp.moveaxis(codes, (-3, -1), (-1, -3))  # [.., c, half, thread, pair]: value 8 pair + 2 thread + half
    words = jnp.zeros(codes.shape[:-3] + (4,), jnp.uint32)  # [.., c, thread]
    for pair in range(4):
        for half in range(2):
            code = codes[..., half, :, pair]
            for bit, position in enumerate(_CODE_BIT_POSITIONS):
                words |= ((code >> bit) & 1) << _stored_position(pair, position + 16 * half)
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*codes.shape[:-4], k // 2)


def pack_k_steps(packed, tile_k: int) -> jax.Array:
    """Kernel-layout bytes `[..., N, K/2]` -> `[..., K/tile_k, N, tile_k/2]`: one K step's bytes of every
    row together, so that a program's weight tile is one contiguous block (a TMA box of `tile_n` rows
    of `tile_k/2` bytes at the row stride was 5 % slower for the down GEMM at T = 8 and 64, H200
    session 15 run G). K steps and rows stay axes of their own, so a mesh can split either."""
    *lead, n, half_k = packed.shape
    if (2 * half_k) % tile_k:
        raise ValueError(f"K={2 * half_k} must be a multiple of tile_k={tile_k}")
    steps = jnp.asarray(packed).reshape(*lead, n, 2 * half_k // tile_k, tile_k // 2)
    return jnp.moveaxis(steps, -2, -3)


def checkpoint_codes(values) -> jax.Array:
    """Checkpoint NVFP4 bytes `[..., K/2]` (element 2j in the low nibble) -> codes `[..., K]`."""
    return jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(*values.shape[:-1], -1)


def canonical_blocks(codes, scale):
    """E2M1 codes `[..., N, K]` and their block scales `[..., N, K/16]` -> the same weights with every scale
    positive: a negative scale's block has its values' signs flipped (bit 3 of a code) and takes the
    scale's magnitude; a zero scale's block has its codes zeroed (any scale then gives zeros)."""
    scale = jnp.asarray(scale)
    value = scale.astype(jnp.float32)
    negative, zero = (jnp.repeat(flag, 16, axis=-1) for flag in (value < 0, value == 0))
    codes = jnp.where(negative, jnp.asarray(codes) ^ 8, codes)
    return jnp.where(zero, 0, codes).astype(jnp.uint8), jnp.abs(scale)


def pack_scales(scale, tile_k: int) -> jax.Array:
    """Block scales `[E, N, K/16]` float8_e4m3fn, none negative (`canonical_blocks`) -> uint32 words
    `[E, K/tile_k, N, tile_k/64]` of four one-byte codes each (block 4 w + j in byte j; zero scales any code;
    NaN has none: `beam_jax.quant.kernel_layout` refuses checkpoints that hold one).

    One K step's scales of every row are contiguous, so a step's tile is one TMA box whatever tile_k
    is (the kernel folds them into rows of 64 bytes for TMA's box limits). Rows (N) and K steps stay axes
    of their own, so a mesh can split either."""
    e, n, blocks = scale.shape
    if jnp.asarray(scale).dtype != jnp.float8_e4m3fn:
        raise ValueError(f"block scales must be float8_e4m3fn (the checkpoint's), got {jnp.asarray(scale).dtype}")
    per_step = tile_k // 16
    if tile_k % TILE_K_QUANTUM or blocks % per_step:
        raise ValueError(f"K={blocks * 16} must be a multiple of tile_k={tile_k}, itself of {TILE_K_QUANTUM}")
    bits = jax.lax.bitcast_convert_type(jnp.asarray(scale).astype(jnp.float32), jnp.uint32)
    # fp32 exponent e: the bf16 of scale * 2^119 has exponent field e + 119; zeros (e = 0) get code 0.
    exponent, mantissa = (bits >> 23) & 0xFF, (bits >> 20) & 7
    codes = jnp.where(exponent > 0, ((exponent + 119 - _SCALE_EXPONENT_OFFSET) << 3) | mantissa, 0)
    words = jax.lax.bitcast_convert_type(codes.astype(jnp.uint8).reshape(e, n, blocks // 4, 4), jnp.uint32)
    return words.reshape(e, n, blocks // per_step, tile_k // 64).transpose(0, 2, 1, 3)


def pack_weights(codes, scale, tile_k: int) -> tuple[jax.Array, jax.Array]:
    """E2M1 codes `[E, N, K]` and e4m3 block scales `[E, N, K/16]` -> the kernel's
    `(packed, scales)`: `canonical_blocks`, then `pack_kernel_layout` + `pack_k_steps` and `pack_scales`."""
    codes, scale = canonical_blocks(codes, scale)
    return pack_k_steps(pack_kernel_layout(codes), tile_k), pack_scales(scale, tile_k)


def decode_scale_bits(words, j: int) -> jax.Array:
    """Plain-jnp twin of `_scale_asm`: scale words -> bf16x2 bit patterns with scale j of the word
    (byte j, times 2^119) in both halves."""
    code = (jnp.asarray(words, jnp.uint32) >> (8 * j)) & 0xFF
    return ((code << 4) | (code << 20)) | jnp.uint32(_SCALE_BASE | _SCALE_BASE << 16)


def scale_values(words) -> jax.Array:
    """Scale words `[..., W]` -> fp32 scales `[..., 4 W]` (without SCALE_FACTOR)."""
    low_halves = jnp.stack([decode_scale_bits(words, j) & 0xFFFF for j in range(_SCALES_PER_WORD)], axis=-1)
    values = jax.lax.bitcast_convert_type(low_halves.astype(jnp.uint16), jnp.bfloat16).astype(jnp.float32)
    return (values / SCALE_FACTOR).reshape(*values.shape[:-2], -1)


def decode_pair_bits(words, pair: int) -> jax.Array:
    """Plain-jnp twin of `_decode_pair_asm` without the scale: uint32 words -> bf16x2 bit patterns
    (value * 2^-126 in each half)."""
    words = jnp.asarray(words, jnp.uint32)
    if pair == 0:
        moved = words
    elif pair < 3:
        moved = (words >> _ROTATIONS[pair]) | (words << (32 - _ROTATIONS[pair]))
    else:
        moved = (words & _REST_MASK) * jnp.uint32(_REST_MULTIPLIER)
    return moved & jnp.uint32(_PAIR_MASK)


def decode_values(packed, words) -> jax.Array:
    """Kernel-layout bytes `[..., N, K/2]` and their scale words `[..., N, K/64]` -> fp32 weights `[..., N, K]`
    (E2M1 value times block scale), decoded from the words as the PTX decodes them (which gives them times
    2^-7: OUTPUT_FACTOR). No array constants, so that kernels in interpret mode can use it."""
    *lead, n, half_k = packed.shape
    k = 2 * half_k
    words_by_thread = jax.lax.bitcast_convert_type(jnp.asarray(packed).reshape(*lead, n, k // 32, 4, 4), jnp.uint32)
    pairs = []
    for pair in range(4):
        bits = decode_pair_bits(words_by_thread, pair)
        halves = []
        for half in range(2):
            # The bf16 pattern is value * 2^-126, subnormal in fp32 too (XLA's CPU flushes those): read
            # the code back from its bits (magnitude 6-8, sign 15) instead of converting.
            pattern = (bits >> (16 * half)) & 0xFFFF
            exponent, mantissa = ((pattern >> 7) & 3).astype(jnp.int32), ((pattern >> 6) & 1).astype(jnp.float32)
            magnitude = jnp.where(exponent == 0, 0.5 * mantissa,
                                  jnp.exp2((exponent - 1).astype(jnp.float32)) * (1 + 0.5 * mantissa))
            halves.append(jnp.where((pattern >> 15) & 1 == 1, -magnitude, magnitude))
        pairs.append(jnp.stack(halves, axis=-1))  # [..., c, thread, half]
    # Value 32 c + 8 pair + 2 thread + half of the row.
    values = jnp.stack(pairs, axis=-3).reshape(*lead, n, k)
    return values * jnp.repeat(scale_values(words), 16, axis=-1)


# Mosaic GPU's interpret mode (a simulated GPU on the CPU) runs Pallas ops but no PTX: while a kernel is traced for
# it, each `inline_mgpu` op of these kernels is replaced by a stand-in with the same effect from Pallas ops on refs
# and arrays (`mgpu_op`). What the interpreter then checks is the rest of the kernel: its grid, copies, barriers,
# indexing and data flow; the PTX bodies themselves are checked on a GPU (and the decode's bit layout on the CPU
# through `decode_pair_bits`).
_interpreting = contextvars.ContextVar("nvfp4_mgpu_interpreting", default=False)


@contextlib.contextmanager
def interpreting(interpret: bool):
    """While a kernel is traced: `mgpu_op`s take their stand-ins if `interpret`."""
    token = _interpreting.set(interpret)
    try:
        yield
    finally:
        _interpreting.reset(token)


def is_interpreting() -> bool:
    """Whether the kernel being traced is for interpret mode (`interpreting`)."""
    return _interpreting.get()


def mgpu_op(body, stand_in, **inline_mgpu_settings):
    """`plgpu.inline_mgpu(**inline_mgpu_settings)(body)`, or `stand_in` (the same arguments) where the kernel is
    traced for interpret mode."""
    op = plgpu.inline_mgpu(**inline_mgpu_settings)(body)
    return lambda *args: (stand_in if is_interpreting() else op)(*args)


def _scale_asm(j: int) -> str:
    """PTX: $1 = a scale word -> $0 = bf16x2 with its scale j (times 2^119) in both halves."""
    return ("{ .reg .b32 t, zero; mov.b32 zero, 0; "
            f"prmt.b32 t, $1, zero, {_SCALE_SELECTOR + 0x101 * j:#x}; shl.b32 t, t, 4; "
            f"or.b32 $0, t, {_SCALE_BASE | _SCALE_BASE << 16:#x}; }}")


def _decode_pair_asm(pair: int) -> str:
    """PTX: $1 = packed word, $2 = bf16x2 block scales (times 2^119) -> $0 = bf16x2 weights * 2^-7."""
    if pair == 0:
        extract = "and.b32 t, $1, MASK;"
    elif pair < 3:
        extract = f"shf.r.wrap.b32 t, $1, $1, {_ROTATIONS[pair]}; and.b32 t, t, MASK;"
    else:
        extract = f"and.b32 t, $1, {_REST_MASK:#x}; mul.lo.u32 t, t, {_REST_MULTIPLIER:#x}; and.b32 t, t, MASK;"
    extract = extract.replace("MASK", f"{_PAIR_MASK:#x}")
    return "{ .reg .b32 t, negzero; mov.b32 negzero, 0x80008000; " + extract + " fma.rn.bf16x2 $0, t, $2, negzero; }"


def for_each_index(count: int, body, *, load=None) -> None:
    """In an inline_mgpu body: `body(i)` for i in 0 .. count-1, spread over the warpgroup's 128 threads
    (thread t takes t, t + 128, ...; a guard where fewer indices than threads are left).
    With `load`, a thread's `load(i)` for all its indices come first, unguarded (an index past the end loads as the
    last one), then `body(i, loaded)`: the loads are in flight together, none waits behind a guard or another
    index's stores."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, scf
    from jax.experimental.mosaic.gpu import utils

    index = ir.IndexType.get()
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), utils.c(128, index))
    starts = range(0, count, 128)
    indices = [arith.addi(tid, utils.c(start, index)) for start in starts]
    if load is None:
        calls = [body] * len(indices)
    else:
        loaded = [load(arith.minui(i, utils.c(count - 1, index))) for i in indices]
        calls = [lambda i, values=values: body(i, values) for values in loaded]
    for start, i, one in zip(starts, indices, calls):
        if start + 128 <= count:
            one(i)
            continue
        guard = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, i, utils.c(count, index)))
        with ir.InsertionPoint(guard.then_block):
            one(i)
            scf.yield_([])


def _thread_place():
    """In an inline_mgpu body: (row0, lane) of this thread in its warpgroup's WGMMA layouts, where row0 =
    16 warp + lane / 4 is its first row of every 64-row tile (the second is row0 + 8)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu
    from jax.experimental.mosaic.gpu import utils

    index = ir.IndexType.get()
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), utils.c(128, index))
    warp, lane = arith.divui(tid, utils.c(32, index)), arith.remui(tid, utils.c(32, index))
    return arith.addi(arith.muli(warp, utils.c(16, index)), arith.divui(lane, utils.c(4, index))), lane


def weight_words(packed, tile_k: int, line_box: bool):
    """In an inline_mgpu body: `word_at(m, c, half)`, this thread's packed word of 64-row tile m, 32-value
    group c and row half (WGMMA_8BIT's register [m, c, .., half, ..]: row 64 m + 16 warp + lane / 4 + 8 half,
    bytes 16 c + 4 (lane % 4) .. + 3), from `packed`'s registers or, with `line_box`, from its smem lines."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils

    i32 = ir.IntegerType.get_signless(32)
    if not line_box:
        return lambda m, c, half: utils.bitcast(packed.registers[m, c, 0, 0, half, 0, 0, 0, 0], i32)
    index, row_bytes = ir.IndexType.get(), tile_k // 2
    row0, lane = _thread_place()
    thread_byte = arith.index_cast(i32, arith.addi(arith.muli(row0, utils.c(row_bytes, index)),
                                                   arith.muli(arith.remui(lane, utils.c(4, index)), utils.c(4, index))))
    base = utils.memref_ptr(packed)

    def word_at(m, c, half):
        offset = arith.addi(thread_byte, utils.c((64 * m + 8 * half) * row_bytes + 16 * c, i32))
        return llvm.load(i32, utils.getelementptr(base, [offset], ir.IntegerType.get_signless(8)))

    return word_at


def _stage_scales(tile_n: int, tile_k: int, double_buffered: bool = False, chunk: int = 0, chunks: int = 1):
    """inline_mgpu body: the step's scale words (smem) -> a staging buffer (smem, `tile_n * tile_k / 16` words):
    the warpgroup converts them into one bf16x2 register per block scale (the scale in both halves), a word
    or two of scales per thread, for `_decode_tile` to read its rows' scales from. Converting in each
    thread's own registers instead took 6-17 more registers (101 for 64-row programs, 184 for 128), one
    program fewer per SM, and was 12 % slower at T = 8 (H200, benchmarks/moe/RESULTS.md, session 16).
    `double_buffered`: steps alternate between two staging buffers, so no barrier waits for the last step's
    decode to finish reading (the decode two steps back finished before every thread passed the last step's
    second barrier).
    `chunks` > 1: only the scales of K chunk `chunk` of `chunks` (the decode's, `_decode_tile(chunk_staged=True)`),
    a buffer of 1 / `chunks` the size (so that a program's deeper pipeline fits beside it)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental.mosaic.gpu import utils

    row_words = tile_k // (16 * _SCALES_PER_WORD)
    chunk_words = row_words // chunks
    words = tile_n * chunk_words  # staged 4 i .. 4 i + 3 from the chunk's word i (all the step's words if one chunk)

    def body(ctx, scale_ref, staged_ref):
        del ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        if not double_buffered:
            utils.warpgroup_barrier()  # the previous step's decode has read the staged scales

        def convert(i):
            w = i
            if chunks > 1:  # the row's word of the chunk: row i / chunk_words, word chunk * chunk_words + i % ..
                w = arith.addi(arith.muli(arith.divui(i, utils.c(chunk_words, index)), utils.c(row_words, index)),
                               arith.addi(arith.remui(i, utils.c(chunk_words, index)),
                                          utils.c(chunk * chunk_words, index)))
            word = memref.load(scale_ref, [arith.divui(w, utils.c(_SCALE_ROW, index)),
                                           arith.remui(w, utils.c(_SCALE_ROW, index))])
            staged = [llvm.inline_asm(i32, [word], _scale_asm(j), "=r,r") for j in range(_SCALES_PER_WORD)]
            vector.store(vector.from_elements(ir.VectorType.get((_SCALES_PER_WORD,), i32), staged), staged_ref,
                         [arith.muli(i, utils.c(_SCALES_PER_WORD, index))])

        for_each_index(words, convert)
        utils.warpgroup_barrier()

    return body


def _decode_tile(tile_n: int, tile_k: int, line_box: bool = False, chunk: int = 0, chunks: int = 1, row_chunk: int = 0,
                 row_chunks: int = 1, chunk_staged: bool = False):
    """inline_mgpu body: bytes [tile_n, tile_k/2] (WGMMA_8BIT layout; with `line_box` the step's smem
    tile itself, its rows one after another, which each thread reads its words from) and the step's staged
    block scales (`_stage_scales`) -> bf16 [tile_n / row_chunks, tile_k / chunks] (WGMMA): the step's K chunk
    `chunk` of `chunks` of its row chunk `row_chunk` of `row_chunks`. A thread's registers: first index the 64-row
    tile m, second the column group; its rows are 64 m + 16 warp + lane / 4 and that + 8 (the `half` index).
    `chunk_staged`: the staging buffer holds this K chunk's scales only (`_stage_scales(chunk=, chunks=)`)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    groups = tile_k // _K_PER_WORD_GROUP
    chunk_groups = range(chunk * groups // chunks, (chunk + 1) * groups // chunks)
    row_tiles = range(row_chunk * tile_n // 64 // row_chunks, (row_chunk + 1) * tile_n // 64 // row_chunks)

    def body(ctx, packed, staged_ref):
        del ctx
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        pair_type = ir.VectorType.get((2,), ir.BF16Type.get())
        row0, _ = _thread_place()
        word_at = weight_words(packed, tile_k, line_box)
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape((64 * len(row_tiles), tile_k // chunks)), dtype=object)
        staged_groups, first_group = (len(chunk_groups), chunk_groups[0]) if chunk_staged else (groups, 0)
        for m in row_tiles:
            for half in range(2):
                row = arith.addi(row0, utils.c(64 * m + 8 * half, index))
                row_scales = arith.muli(row, utils.c(2 * staged_groups, index))  # the row's staged block scales
                for c in chunk_groups:
                    word = word_at(m, c, half)
                    # Pairs 0-1 are in the group's first scale block, 2-3 in its second.
                    scales = vector.load(ir.VectorType.get((2,), i32), staged_ref,
                                         [arith.addi(row_scales, utils.c(2 * (c - first_group), index))])
                    for pair in range(4):
                        block_scale = vector.extract(scales, dynamic_position=[], static_position=[pair // 2])
                        reg = llvm.inline_asm(i32, [word, block_scale], _decode_pair_asm(pair), "=r,r,r")
                        register = (m - row_tiles[0], 4 * (c - chunk_groups[0]) + pair, 0, 0, half, 0, 0, 0, 0)
                        out[register] = utils.bitcast(reg, pair_type)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return body


def _store_transposed(tile_n: int, block_t: int, scaled: bool):
    """inline_mgpu body: fp32 accumulator [tile_n, block_t] (WGMMA layout) -> smem [block_t, tile_n], so
    the output is [rows, N] (a row per activation row: the layer's gathers and epilogues then read
    contiguous rows). A thread's register [m, c, .., half, ..] holds row 64 m + 16 warp + lane / 4 + 8 half,
    columns 8 c + 2 (lane % 4) and the next. Pallas' own store does not take a transposed ref.
    `scaled`: a third argument holds the tile's global scales `[tile_n]`; each value is multiplied by
    OUTPUT_FACTOR and its row's scale and rounded to the output's dtype (bf16), as the layer's
    reference rounds the projections."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    from jax.experimental.mosaic.gpu import utils

    def body(ctx, acc, out_ref, scale_ref=None):
        del ctx
        index, f32 = ir.IndexType.get(), ir.F32Type.get()
        out_type = ir.MemRefType(out_ref.type).element_type
        row0, lane = _thread_place()
        col0 = arith.muli(arith.remui(lane, utils.c(4, index)), utils.c(2, index))
        for m in range(tile_n // 64):
            for half in range(2):
                row = arith.addi(row0, utils.c(64 * m + 8 * half, index))
                if scaled:  # (acc * 2^7) * scale equals acc * (2^7 * scale): a power of two rounds nothing
                    factor = arith.mulf(memref.load(scale_ref, [row]), arith.constant(f32, OUTPUT_FACTOR))
                for c in range(block_t // 8):
                    pair = acc.registers[m, c, 0, 0, half, 0, 0, 0, 0]
                    for j in range(2):
                        col = arith.addi(col0, utils.c(8 * c + j, index))
                        value = vector.extract(pair, dynamic_position=[], static_position=[j])
                        if scaled:
                            value = arith.truncf(out_type, arith.mulf(value, factor))
                        memref.store(value, out_ref, [col, row])

    return body


def _swiglu_rows(block_t: int, width: int):
    """inline_mgpu body: smem [block_t, 2 width] (gate then up columns, bf16) -> smem [block_t, width]:
    `gate / (1 + exp(-gate)) * up` in fp32 (`moe_gemm._swiglu`; exp by `ex2.approx`), rounded to bf16."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic.gpu import utils

    def body(ctx, projections_ref, out_ref):
        del ctx
        index, f32 = ir.IndexType.get(), ir.F32Type.get()
        out_type = ir.MemRefType(out_ref.type).element_type
        utils.warpgroup_barrier()  # every thread's transposed store has landed

        def one(i):
            t, j = arith.divui(i, utils.c(width, index)), arith.remui(i, utils.c(width, index))
            gate = arith.extf(f32, memref.load(projections_ref, [t, j]))
            up = arith.extf(f32, memref.load(projections_ref, [t, arith.addi(j, utils.c(width, index))]))
            memref.store(arith.truncf(out_type, swiglu_value(gate, up)), out_ref, [t, j])

        for_each_index(block_t * width, one)

    return body


# Interpret mode's stand-ins (`mgpu_op`) for the bodies above.
def _stage_scales_stand_in(tile_n: int, tile_k: int, chunk: int = 0, chunks: int = 1):
    """`_stage_scales` in interpret mode: the step's scale words (its K chunk's) as they are, at the staging buffer's
    start (its decode stand-in reads them from there)."""
    row_words = tile_k // 64
    chunk_words = row_words // chunks

    def stand_in(scale_ref, staged_ref):
        words = scale_ref[...].reshape(tile_n, row_words)[:, chunk * chunk_words:(chunk + 1) * chunk_words]
        staged_ref[pl.ds(0, tile_n * chunk_words)] = words.reshape(-1)

    return stand_in


def _decode_tile_stand_in(tile_n: int, tile_k: int, chunk: int, chunks: int, row_chunk: int, row_chunks: int,
                          chunk_staged: bool = False):
    """`_decode_tile` in interpret mode: the step's bytes (loaded, or the smem lines of a line box) and the scale
    words staged by `_stage_scales_stand_in` (the chunk's, if `chunk_staged`) -> the piece's bf16 weights times
    2^-7, as the PTX gives them."""
    rows, columns = tile_n // row_chunks, tile_k // chunks

    def stand_in(packed, staged_ref):
        data = (packed if isinstance(packed, jax.Array) else packed[...]).reshape(tile_n, tile_k // 2)
        staged_k = columns if chunk_staged else tile_k
        words = staged_ref[pl.ds(0, tile_n * staged_k // 64)].reshape(tile_n, staged_k // 64)
        if chunk_staged:  # (a 32-value group is 16 bytes of a row in the kernel layout)
            data = data[:, chunk * columns // 2:(chunk + 1) * columns // 2]
        weights = (decode_values(data, words) / OUTPUT_FACTOR).astype(jnp.bfloat16)
        if not chunk_staged:
            weights = weights[:, chunk * columns:(chunk + 1) * columns]
        return weights[row_chunk * rows:(row_chunk + 1) * rows]

    return stand_in


def _store_transposed_stand_in(acc, out_ref, scale_ref=None):
    """`_store_transposed` in interpret mode."""
    value = acc.T
    if scale_ref is not None:
        value = value * (scale_ref[...] * OUTPUT_FACTOR)[None, :]
    out_ref[...] = value.astype(out_ref.dtype)


def _swiglu_rows_stand_in(projections_ref, out_ref):
    """`_swiglu_rows` in interpret mode (`exp` rather than `ex2.approx`)."""
    width = out_ref.shape[1]
    projections = projections_ref[...]
    out_ref[...] = _swiglu(projections[:, :width], projections[:, width:]).astype(out_ref.dtype)


def swiglu_value(gate, up):
    """In an inline_mgpu body: fp32 `gate / (1 + exp(-gate)) * up` (`moe_gemm._swiglu`; exp by `ex2.approx`)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    f32 = ir.F32Type.get()
    exp = llvm.inline_asm(f32, [arith.mulf(gate, arith.constant(f32, -1.4426950408889634))],
                          "ex2.approx.ftz.f32 $0, $1;", "=f,f")
    return arith.mulf(arith.divf(gate, arith.addf(exp, arith.constant(f32, 1.0))), up)


def _check_operands(xs, block_expert, packed, scales, *, block_t, tile_k, splits, tile_n, shared_rows, global_scale,
                    row_destination, out_rows) -> tuple[bool, bool]:
    """Raises on operands `grouped_matmul` cannot take; returns (scaled, scattered)."""
    rows, k = xs.shape
    experts, n = packed.shape[0], packed.shape[2]
    blocks = block_expert.shape[0]
    # Shared rows: a whole block, or fewer than 8 (TMA's row tiling allows a box past the end of those only).
    shared_ok = rows == block_t or 0 < rows < min(8, block_t)
    if (not (shared_ok if shared_rows else rows == blocks * block_t) or tile_n % 64 or n % tile_n
            or tile_k % TILE_K_QUANTUM or k % (tile_k * splits) or packed.shape[1:] != (k // tile_k, n, tile_k // 2)
            or scales.shape[1:] != (k // tile_k, n, tile_k // 64) or scales.dtype != jnp.uint32):
        raise ValueError(f"shapes: xs {xs.shape}, packed {packed.shape}, blocks {blocks}, block_t {block_t}, "
                         f"tile_n {tile_n}, tile_k {tile_k}, splits {splits}")
    scaled, scattered = global_scale is not None, row_destination is not None
    if scaled and (splits != 1 or global_scale.shape != (experts, n)):
        raise ValueError(f"global_scale {global_scale.shape} needs one split and shape {(experts, n)}")
    if scattered and (not scaled or out_rows is None or row_destination.shape != (blocks, block_t)):
        raise ValueError(f"row_destination needs global_scale, out_rows and shape {(blocks, block_t)}")
    return scaled, scattered


def _fold_scales(scales, tile_k: int) -> jax.Array:
    """Scale words `[E, K/tile_k, N, tile_k/64]` -> `[E, K/tile_k, N tile_k/64/_SCALE_ROW, _SCALE_ROW]`: a
    program's step of scale words is then a box of whole rows."""
    e, steps, n, per_row = scales.shape
    return scales.reshape(e, steps, n * per_row // _SCALE_ROW, _SCALE_ROW)


def _tile_programs(tile_n: int, tile_k: int, block_t: int, scaled: bool, line_box: bool, chunks: int,
                   paired_steps: int | None = None, row_chunks: int = 1, staging_buffers: int = 1,
                   chunk_staging: bool = False):
    """What a program of `tile_n` rows needs: `in_specs(expert, k0, ni, x_block)` (the pipeline's BlockSpecs:
    step kk takes the expert's packed bytes and folded scales of K step k0 + kk and row tile ni, and block
    x_block's activations), the scale staging, the decodes of the step's pieces (its `chunks` K chunks, each in
    `row_chunks` row chunks) and the transposed store (`inline_mgpu` ops). `line_box`: the packed bytes come as
    `_LINE`-byte lines, unswizzled, a box of `tile_n * tile_k / 2 / _LINE` lines. `paired_steps` (SwiGLU
    programs; the weights' K steps): bytes and scales are read through `[E * K steps, 2, I, ...]` views
    (`_paired_views`), and a step's box is `tile_n / 2` gate rows with their up rows, the same smem bytes as a
    box of `tile_n` consecutive rows (gate rows first): one copy each, and the decode of any other tile.
    `chunk_staging`: the staging is a list, one op a K chunk that stages that chunk's scales only (a buffer of
    `tile_n * tile_k / 16 / chunks` words), for `multiply_step` to run before the chunk's decode."""
    byte_swizzle = plgpu.find_swizzle(tile_k // 2 * 8, "lhs")
    x_swizzle = plgpu.find_swizzle(tile_k * 16, "rhs")
    scale_rows = tile_n * tile_k // 64 // _SCALE_ROW  # a step's scale words in folded rows
    if line_box:
        packed_block, packed_transforms = (tile_n * tile_k // 2 // _LINE, _LINE), ()
    else:
        packed_block = (tile_n, tile_k // 2)
        # Paired boxes [2, rows, bytes] get a unit tile on their first axis, so that they fold back to [tile_n, bytes].
        tiling = (8, byte_swizzle) if paired_steps is None else (1, 8, byte_swizzle)
        packed_transforms = (plgpu.TilingTransform(tiling), plgpu.SwizzleTransform(byte_swizzle))
    scale_block = (scale_rows, _SCALE_ROW)
    x_transforms = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))

    def in_specs(expert, k0, ni, x_block):
        if paired_steps is None:
            lead, at = (None, None), lambda kk: (expert, k0 + kk, ni, 0)
            shapes = (packed_block, scale_block)
        else:  # both projections' halves of row tile ni, in views with experts and K steps merged
            lead, at = (None, 2), lambda kk: (expert * paired_steps + k0 + kk, 0, ni, 0)
            shapes = ((packed_block[0] // 2, packed_block[1]), (scale_block[0] // 2, scale_block[1]))
        return [plgpu.BlockSpec((*lead, *shapes[0]), at, transforms=packed_transforms),
                plgpu.BlockSpec((*lead, *shapes[1]), at),
                plgpu.BlockSpec((block_t, tile_k), lambda kk: (x_block, k0 + kk), transforms=x_transforms)]

    if chunk_staging:
        if staging_buffers != 1 or tile_k // 64 % chunks:
            raise ValueError(f"chunk staging needs one staging buffer and tile_k={tile_k} in chunks={chunks} of "
                             f"whole scale words (64 values)")
        stage = [mgpu_op(_stage_scales(tile_n, tile_k, chunk=chunk, chunks=chunks),
                         _stage_scales_stand_in(tile_n, tile_k, chunk, chunks), arg_types=(plgpu.RefType(),) * 2)
                 for chunk in range(chunks)]
    else:
        stage = mgpu_op(_stage_scales(tile_n, tile_k, staging_buffers == 2), _stage_scales_stand_in(tile_n, tile_k),
                        arg_types=(plgpu.RefType(),) * 2)
    decodes = [mgpu_op(
        _decode_tile(tile_n, tile_k, line_box, chunk, chunks, row_chunk, row_chunks, chunk_staging),
        _decode_tile_stand_in(tile_n, tile_k, chunk, chunks, row_chunk, row_chunks, chunk_staging),
        arg_types=(plgpu.RefType() if line_box else plgpu.Layout.WGMMA_8BIT, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((tile_n // row_chunks, tile_k // chunks), jnp.bfloat16,
                                           layout=plgpu.Layout.WGMMA),
    ) for chunk in range(chunks) for row_chunk in range(row_chunks)]
    store_transposed = mgpu_op(_store_transposed(tile_n, block_t, scaled), _store_transposed_stand_in,
                               arg_types=(plgpu.Layout.WGMMA, *[plgpu.RefType()] * (1 + scaled)))
    return in_specs, stage, decodes, store_transposed


def _paired_views(packed, scales):
    """SwiGLU programs' views of the gate/up weights (N = 2 I, gate rows then up rows): bytes `[E, S, N, B]` ->
    `[E S, 2, I, B]` and folded scales likewise (free reshapes)."""
    return tuple(a.reshape(a.shape[0] * a.shape[1], 2, a.shape[2] // 2, a.shape[3]) for a in (packed, scales))


def _scratch(tile_n: int, tile_k: int, block_t: int, out_dtype, scaled: bool, scattered: bool, swiglu: bool,
             staging_buffers: int = 1) -> dict:
    """A program's shared memory besides its pipeline: the output tile, the staged block scales and, with
    global scales, the tile's scales and their barrier; with row destinations, the block's and theirs; with
    SwiGLU, its output tile."""
    scratch = dict(out_smem=plgpu.SMEM((block_t, tile_n), out_dtype),
                   staged_smem=plgpu.SMEM((staging_buffers * tile_n * tile_k // 16,), jnp.uint32))  # a word a scale
    if scaled:  # SwiGLU programs copy their gate rows' scales and their up rows' in two copies
        scratch.update(scale_smem=plgpu.SMEM((tile_n,), jnp.float32),
                       scale_barrier=plgpu.Barrier(num_arrivals=2 if swiglu else 1))
    if swiglu:
        scratch.update(swiglu_smem=plgpu.SMEM((block_t, tile_n // 2), out_dtype))
    if scattered:
        scratch.update(destination_smem=plgpu.SMEM((block_t,), jnp.int32), destination_barrier=plgpu.Barrier())
    return scratch


PDL_MODES = ("off", "wait", "prefetch")


def _squeezed(dim) -> bool:
    return dim is None or isinstance(dim, pl.Squeezed)


def _block_of(spec, ref, indices):
    """The gmem window of `spec`'s block at `indices` (squeezed dims indexed, others sliced)."""
    return ref.at[tuple(i if _squeezed(d) else pl.ds(i * d, d) for i, d in zip(spec.index_map(*indices),
                                                                               spec.block_shape))]


def _prefetched_k_loop(step, specs, gmem_refs, *, k_steps: int, stages: int, after_wait=None,
                       fill_activations=None):
    """`emit_pipeline(step, grid=(k_steps,), in_specs=specs, max_concurrent_steps=stages)` for a dependent
    launch: the weight specs' (all but the last) first `stages` steps are fetched before `griddepcontrol.wait`,
    so that they stream while the kernel before still runs; then `after_wait()`, the activations of every
    step (the last spec) into one buffer, and the signal that lets the next kernel launch.
    `fill_activations(x_buf)` instead of the wait and the activations' copies: it waits and fills every step's
    activations itself (the fused decode layer's down programs, `nvfp4_fused_moe`)."""
    weight_specs, x_spec = specs[:-1], specs[-1]
    stages = min(stages, k_steps)
    shape = lambda spec: tuple(d for d in spec.block_shape if not _squeezed(d))  # noqa: E731

    def scoped(weight_bufs, x_buf, weight_barriers, x_barrier):
        def fetch(kk, slot):
            for spec, ref, buf in zip(weight_specs, gmem_refs, weight_bufs):
                plgpu.copy_gmem_to_smem(_block_of(spec, ref, (kk,)), buf.at[slot], weight_barriers.at[slot])

        for kk in range(stages):
            fetch(kk, kk)
        if fill_activations is not None:
            fill_activations(x_buf)
        else:
            plgpu.griddepcontrol_wait()
            after_wait()
            for kk in range(k_steps):
                plgpu.copy_gmem_to_smem(_block_of(x_spec, gmem_refs[-1], (kk,)), x_buf.at[kk], x_barrier)
            plgpu.griddepcontrol_launch_dependents()
            plgpu.barrier_wait(x_barrier)

        def body(kk, carry):
            slot = kk % stages
            plgpu.barrier_wait(weight_barriers.at[slot])
            step((kk,), *(buf.at[slot] for buf in weight_bufs), x_buf.at[kk])

            @pl.when(kk + stages < k_steps)
            def _():
                fetch(kk + stages, slot)

            return carry

        jax.lax.fori_loop(0, k_steps, body, None)

    pl.run_scoped(scoped,
                  [plgpu.SMEM((stages, *shape(s)), r.dtype, transforms=s.transforms)
                   for s, r in zip(weight_specs, gmem_refs)],
                  plgpu.SMEM((k_steps, *shape(x_spec)), gmem_refs[-1].dtype, transforms=x_spec.transforms),
                  plgpu.Barrier(num_arrivals=len(weight_specs), num_barriers=stages),
                  plgpu.Barrier(num_arrivals=k_steps))


def _load_bytes(w_smem):
    """A step's weight bytes from smem into the wgmma registers (interpret mode: the array as it is)."""
    return w_smem[...] if is_interpreting() else plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_8BIT)


def _wgmma(acc_ref, weights, x_smem) -> None:
    """`plgpu.wgmma` of decoded weights (registers) by activations (smem); in interpret mode, whose wgmma takes
    shared memory operands only, through a scratch tile."""
    if not is_interpreting():
        plgpu.wgmma(acc_ref, weights, x_smem)
        return

    def through_smem(weights_smem):
        weights_smem[...] = weights
        plgpu.wgmma(acc_ref, weights_smem, x_smem)

    pl.run_scoped(through_smem, plgpu.SMEM(weights.shape, weights.dtype))


def multiply_step(acc_ref, decodes, weights, staged, x_smem, *, tile_n: int, tile_k: int, row_chunks: int,
                  drain: bool = True, stage_chunk=None):
    """One K step of a program: each of `decodes` (`_tile_programs`' pieces: K chunks, each in `row_chunks` row
    chunks) decodes its piece of the step's `weights` with the `staged` block scales and multiplies it by its K
    chunk of the activations into its rows of the accumulator, the next piece decoding while one multiplies. Not
    `drain`: the last piece's wgmma may still run on return (the next step's first decode overlaps it; the caller
    waits for it). `stage_chunk(chunk)`, if given, stages a K chunk's scales into `staged` before its decode
    (`_tile_programs(chunk_staging=True)`)."""
    chunks = len(decodes) // row_chunks
    chunk_k, chunk_n = tile_k // chunks, tile_n // row_chunks
    for piece, decode in enumerate(decodes):
        chunk, row_chunk = divmod(piece, row_chunks)
        if stage_chunk is not None and row_chunk == 0:
            stage_chunk(chunk)
        x_chunk = x_smem if chunks == 1 else x_smem.at[:, pl.ds(chunk * chunk_k, chunk_k)]
        acc = acc_ref if row_chunks == 1 else acc_ref.at[pl.ds(row_chunk * chunk_n, chunk_n)]
        _wgmma(acc, decode(weights, staged), x_chunk.transpose((1, 0)))
        if piece + 1 < len(decodes):
            plgpu.wgmma_wait(1)
    plgpu.wgmma_wait(0 if drain else 1)


def _write_tile(store_transposed, acc, out_smem, out_gmem, b, ni, si, *, block_t: int, tile_n: int, scale_smem=None,
                destination_smem=None):
    """A finished tile (block b, rows ni, split si): the accumulator transposed into `out_smem` (times the
    global scales if `scale_smem`), then to the output by TMA, whole or a row at a time to the rows that
    `destination_smem` (the block's row destinations) names. Returns without waiting for the copies."""
    store_transposed(acc, out_smem, *([scale_smem] if scale_smem is not None else []))
    plgpu.commit_smem()
    columns = pl.ds(ni * tile_n, tile_n)
    if destination_smem is None:
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(b * block_t, block_t), columns])
        return
    for r in range(block_t):
        destination = destination_smem[r]

        @pl.when(destination >= 0)
        def _():
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(r, 1)], out_gmem.at[0, pl.ds(destination, 1), columns])


def grouped_matmul(xs, block_expert, packed, scales, *, block_t: int, tile_k: int = 256, splits: int = 1,
                   stages: int = 4, tile_n: int = 64, decode_chunks: int = 1, decode_row_chunks: int = 1,
                   shared_rows: bool = False, global_scale=None, row_destination=None, out_rows: int | None = None,
                   swiglu: bool = False, staging_buffers: int = 1, pdl: str = "off", interpret: bool = False):
    """`xs [B*block_t, K]` bf16, `block_expert [B]` int32 (-1: skip the block),
    `packed [E, K/tile_k, N, tile_k/2]` uint8 and `scales [E, K/tile_k, N, tile_k/64]` uint32 (`pack_weights`) ->
    `[splits, B*block_t, N]` fp32 partial sums (times 2^7 / OUTPUT_FACTOR; no global scale). A program
    computes `tile_n` (a multiple of 64) rows of one block and split. `shared_rows`: `xs` is one block
    `[block_t, K]` that every block multiplies (decode: each expert takes all the step's tokens), or
    fewer than 8 rows, the rest of the block then read as zeros (the TMA box fills them: no pad).
    `global_scale [E, N]` (one split only): the output is instead the finished projection,
    `[1, B*block_t, N]` in the activations' dtype (bf16): the sums times the global scales, rounded
    once (half the bytes to write, and nothing left for XLA to scale). With it, `row_destination
    [B, block_t]` int32 (-1: drop the row) and `out_rows` write each block row to that row of a
    `[1, out_rows, N]` output instead, one row at a time: decode blocks then write only their
    (token, expert) pairs, in pair order (rows nobody writes are left unwritten). Weight rows shorter
    than 128 bytes (tile_k < 256) are copied as 128-byte lines (their K step's tile is contiguous),
    unswizzled, and the decode loads its words from shared memory itself: for the down GEMM's tile_k 64
    one box of 32 lines, not 128 rows of 32 bytes, was 5-7 % faster (H200, session 18). `decode_chunks`: each
    step is decoded and multiplied in that many K chunks, the next chunk decoding while the last one's wgmma
    runs, with fewer registers live (64 x 256 steps: 108 whole, 96 in two chunks, 68 in four; H200, session 19).
    `decode_row_chunks` does the same by rows (pieces of tile_n / decode_row_chunks rows, a multiple of 64), each
    piece's wgmma into its rows of the accumulator: the down GEMM's K steps of 64 have no K chunks to split.
    `staging_buffers` 2: the block scales are staged in two buffers by step parity (`_stage_scales`), one
    warpgroup barrier a step fewer.
    `swiglu` (with `global_scale`, tile_k >= 256): the weights are gate rows then up rows (N = 2 I), a
    program takes tile_n / 2 gate rows and their up rows (one box a step, `_tile_programs`), and the output is
    `[1, B*block_t, I]` bf16, `moe_gemm._swiglu` of the two finished projections: XLA's SwiGLU pass and half
    the bytes go. (Session 19's version, two boxes of 32 rows read by the decode from swizzled smem, made the
    GEMM 3-10 us slower at T = 8-64, more than the 2.2-3.0 us of XLA's SwiGLU it saved; H200, session 20.)
    `pdl` (programmatic dependent launch; the kernel may start before the kernel ahead of it ends): "wait" waits
    for it first thing; "prefetch" reads `block_expert`, fetches its weights' first `stages` K steps and the
    global scales before it waits (none of these may be written by the kernel just before: in the layer they
    come from before the gate/up GEMM, which waits first thing), and the activations and row destinations
    after. Both then let the next kernel launch (`griddepcontrol.launch_dependents`), which a "prefetch" down
    GEMM after a "wait" gate/up GEMM uses to stream its weights during the gate/up GEMM's last wave.
    `interpret`: Mosaic GPU's interpret mode, the PTX bodies replaced by stand-ins (`mgpu_op`; no `pdl`)."""
    scaled, scattered = _check_operands(xs, block_expert, packed, scales, block_t=block_t, tile_k=tile_k, splits=splits,
                                        tile_n=tile_n, shared_rows=shared_rows, global_scale=global_scale,
                                        row_destination=row_destination, out_rows=out_rows)
    if decode_chunks < 1 or tile_k % (TILE_K_QUANTUM * decode_chunks):
        raise ValueError(f"decode_chunks={decode_chunks} must split tile_k={tile_k} into multiples of {TILE_K_QUANTUM}")
    if decode_row_chunks < 1 or tile_n % (64 * decode_row_chunks):
        raise ValueError(f"decode_row_chunks={decode_row_chunks} must split tile_n={tile_n} into multiples of 64")
    if staging_buffers not in (1, 2):
        raise ValueError(f"staging_buffers must be 1 or 2, got {staging_buffers}")
    if pdl not in PDL_MODES:
        raise ValueError(f"pdl must be one of {PDL_MODES}, got {pdl!r}")
    if interpret and pdl != "off":
        raise ValueError(f"interpret mode has no dependent launch: pdl={pdl!r}")
    if pdl == "prefetch" and xs.shape[0] < block_t:
        raise ValueError(f"pdl='prefetch' needs whole blocks of activations: {xs.shape[0]} rows, block_t {block_t}")
    k, n, blocks = xs.shape[1], packed.shape[2], block_expert.shape[0]
    line_box = tile_k // 2 < _LINE
    half_n = tile_n // 2  # SwiGLU programs: gate rows, and as many up rows
    # (Gate and up rows come in multiples of tile_n / 2: N = 2 I is a multiple of tile_n, `_check_operands`.)
    if swiglu and (not scaled or scattered or tile_k < SWIGLU_MIN_TILE_K):
        raise ValueError(f"swiglu needs global_scale, no row_destination and tile_k >= {SWIGLU_MIN_TILE_K}: "
                         f"tile_k {tile_k}, global_scale {global_scale is not None}, row_destination {scattered}")
    intermediate = n // 2 if swiglu else None
    k_steps = k // (tile_k * splits)
    scales = _fold_scales(scales, tile_k)
    if line_box:  # a K step's tile of rows is contiguous (`pack_k_steps`): the same bytes as lines
        packed = packed.reshape(*packed.shape[:2], -1, _LINE)
    in_specs, stage, decodes, store_transposed = _tile_programs(
        tile_n, tile_k, block_t, scaled, line_box, decode_chunks, paired_steps=packed.shape[1] if swiglu else None,
        row_chunks=decode_row_chunks, staging_buffers=staging_buffers)
    if swiglu:
        packed, scales = _paired_views(packed, scales)
    out_dtype = xs.dtype if scaled else jnp.float32

    # Optional inputs, in this order: the global scales (scaled), the row destinations (scattered).
    optional = [a for a in (global_scale, row_destination) if a is not None]

    def kernel(block_expert_gmem, xs_gmem, packed_gmem, scales_gmem, *gmem, out_smem, staged_smem, scale_smem=None,
               scale_barrier=None, destination_smem=None, destination_barrier=None, swiglu_smem=None):
        *optional_gmem, out_gmem = gmem
        global_scale_gmem, row_destination_gmem = (*optional_gmem, None, None)[:2]
        b, ni, si = (jax.lax.axis_index(a) for a in ("b", "n", "s"))
        if pdl == "wait":
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        expert = block_expert_gmem[b]
        k0 = si * k_steps

        def acc_scope(acc_ref):
            def step(indices, w_smem, s_smem, x_smem):
                if swiglu and not is_interpreting():  # [2, tile_n / 2, ...] boxes: the rows of one tile
                    # (`_tile_programs`; the interpreter reads no reshaped refs, and its stand-ins take either shape)
                    w_smem, s_smem = w_smem.reshape(tile_n, tile_k // 2), s_smem.reshape(-1, _SCALE_ROW)
                weights = w_smem if line_box else _load_bytes(w_smem)
                staged = staged_smem  # (one buffer: the ref itself, no view)
                if staging_buffers == 2:
                    size = tile_n * tile_k // 16
                    staged = staged_smem.at[pl.ds(indices[0] % 2 * size, size)]
                stage(s_smem, staged)
                multiply_step(acc_ref, decodes, weights, staged, x_smem, tile_n=tile_n, tile_k=tile_k,
                              row_chunks=decode_row_chunks)

            specs = in_specs(expert, k0, ni, 0 if shared_rows else b)
            if pdl == "prefetch":
                _prefetched_k_loop(step, specs, (packed_gmem, scales_gmem, xs_gmem), k_steps=k_steps, stages=stages,
                                   after_wait=copy_destinations)
            else:
                plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=specs,
                                    max_concurrent_steps=stages)(packed_gmem, scales_gmem, xs_gmem)
            return acc_ref[...]

        def copy_destinations():
            if scattered:
                plgpu.copy_gmem_to_smem(row_destination_gmem.at[b], destination_smem, destination_barrier)

        @pl.when(expert >= 0)  # unused blocks (expert -1) are skipped; their output is left unwritten
        def _():
            # The tile's global scales and the block's row destinations arrive while the K loop runs (read
            # from global memory after it, each destination cost a load's latency at the program's end).
            if swiglu:  # the gate rows' scales, then their up rows'
                for piece, first in enumerate((0, intermediate)):
                    rows = pl.ds(first + ni * half_n, half_n)
                    plgpu.copy_gmem_to_smem(global_scale_gmem.at[expert, rows],
                                            scale_smem.at[pl.ds(piece * half_n, half_n)], scale_barrier)
            elif scaled:
                plgpu.copy_gmem_to_smem(global_scale_gmem.at[expert, pl.ds(ni * tile_n, tile_n)], scale_smem,
                                        scale_barrier)
            if pdl != "prefetch":  # (else after the wait, in the K loop)
                copy_destinations()
            acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_n, block_t)))
            for barrier in (scale_barrier, destination_barrier):
                if barrier is not None:
                    plgpu.barrier_wait(barrier)
            if swiglu:
                store_transposed(acc, out_smem, scale_smem)
                mgpu_op(_swiglu_rows(block_t, half_n), _swiglu_rows_stand_in,
                        arg_types=(plgpu.RefType(), plgpu.RefType()))(out_smem, swiglu_smem)
                plgpu.commit_smem()
                columns = pl.ds(ni * half_n, half_n)
                plgpu.copy_smem_to_gmem(swiglu_smem, out_gmem.at[0, pl.ds(b * block_t, block_t), columns])
            else:
                _write_tile(store_transposed, acc, out_smem, out_gmem, b, ni, si, block_t=block_t, tile_n=tile_n,
                            scale_smem=scale_smem, destination_smem=destination_smem)
            plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, out_rows if scattered else blocks * block_t,
                                       intermediate if swiglu else n), out_dtype),
        grid=(blocks, n // tile_n, splits),
        grid_names=("b", "n", "s"),
        scratch_types=_scratch(tile_n, tile_k, block_t, out_dtype, scaled, scattered, swiglu, staging_buffers),
        interpret=interpret_params(interpret),
    )
    with interpreting(interpret):
        return call(block_expert, xs, packed, scales, *optional)


def grouped_matmul_reference(xs, block_expert, w, *, block_t: int, shared_rows: bool = False):
    """Plain jnp: `w [E, N, K]` dequantized weights."""
    if shared_rows:  # rows past the shared block's end read as zeros (the kernel's TMA fills them so)
        xs = jnp.tile(jnp.pad(xs, ((0, block_t - xs.shape[0]), (0, 0))), (block_expert.shape[0], 1))
    x = xs.reshape(block_expert.shape[0], block_t, -1).astype(jnp.float32)
    w = w[block_expert].astype(jnp.float32)
    return jnp.einsum("btk,bnk->btn", x, w, precision=jax.lax.Precision.HIGHEST).reshape(-1, w.shape[1])


def grouped_matmul_emulated(xs, block_expert, packed, scales, *, block_t: int, tile_k: int, splits: int = 1,
                            stages: int = 4, tile_n: int = 64, decode_chunks: int = 1, decode_row_chunks: int = 1,
                            shared_rows: bool = False, global_scale=None, row_destination=None,
                            out_rows: int | None = None, swiglu: bool = False, staging_buffers: int = 1,
                            pdl: str = "off"):
    """`grouped_matmul`'s contract in plain jnp, from the kernel layouts (for CPU tests of code that
    calls the kernel): decodes the words as the PTX does, then `grouped_matmul_reference`. Blocks
    of expert -1 get NaN, as the kernel leaves them unwritten (any bits); one split holds the whole sum."""
    del splits, stages, tile_n, decode_chunks, decode_row_chunks, staging_buffers, pdl
    e, k_steps, n, _ = packed.shape
    k = k_steps * tile_k
    w = decode_values(jnp.moveaxis(packed, 1, 2).reshape(e, n, k // 2), jnp.moveaxis(scales, 1, 2).reshape(e, n, -1))
    out = grouped_matmul_reference(xs, jnp.maximum(block_expert, 0), w, block_t=block_t, shared_rows=shared_rows)
    out = jnp.where(jnp.repeat(block_expert >= 0, block_t)[:, None], out, jnp.nan)
    if global_scale is not None:
        row_scale = jnp.repeat(global_scale[jnp.maximum(block_expert, 0)], block_t, axis=0)
        out = (out * row_scale).astype(xs.dtype)
        if swiglu:
            out = _swiglu(out[:, :n // 2], out[:, n // 2:]).astype(xs.dtype)
        if row_destination is not None:  # dropped rows go past the end; unwritten rows read as zeros
            destination = row_destination.reshape(-1)
            out = jnp.zeros((out_rows, n), out.dtype).at[jnp.where(destination >= 0, destination, out_rows)].set(
                out, mode="drop")
        return out[None]
    return (out / OUTPUT_FACTOR)[None]
