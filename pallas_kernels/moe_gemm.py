"""Beam's routed experts as two grouped GEMMs in Pallas (Triton), for bf16, fp8 and NVFP4 weights.

For tokens `x [T, H]` routed to `top_k` experts each (`ids`, `weights` from routing), the output is
`sum_j weights[t, j] * down_e(swiglu(gate_e(x_t), up_e(x_t)))` with `e = ids[t, j]`. The T*top_k
(token, expert) pairs are the rows of the computation ("pair" p = t * top_k + j).

Work is split into blocks of at most `block_m` pairs of one expert; each program computes one
block against one tile of output columns, so only the experts that tokens were routed to are read.
Blocks come from one of two sources, chosen by shape:
- "ids" (decode, T <= block_m): program `slot` finds the slot-th expert that any pair uses and that
  expert's pairs directly from `ids` inside the kernel. No sort, no extra launch; a block holds all
  of an expert's pairs because a token picks an expert at most once.
- "sorted" (prefill): pairs are sorted by expert in XLA and cut into blocks of `block_m` rows.
Kernel 1 computes gate and up tiles together and applies SwiGLU (or, split over the hidden axis
for small batches, writes fp32 partial sums that a small XLA epilogue adds before SwiGLU); kernel 2
computes the down projection and scales each pair by its routing weight; the top_k pair rows of a
token are added in XLA (fused with whatever follows).

Quantized weights stay packed: fp8 tiles are converted to bf16 in registers and their per-channel
(or per-tensor) scale applied to the accumulator; NVFP4 nibbles are turned into fp16 bit patterns
(sign and three magnitude bits moved into place: a few integer operations, no table), scaled by
their e4m3 block scale, and fed to the tensor cores as bf16; the fp32 global scale is applied to the
accumulator. Even and odd K elements (low and high nibbles) go through two dots against the even
and odd activation columns, so nibbles are never interleaved in registers.

NVFP4 has two decodes, chosen by `MoEBlocks.nvfp4_decode` until the GPU has measured both:
- "per_value": the one above; every value is converted to fp32, multiplied by its block scale (loaded
  once per value) and rounded to bf16, and the even/odd activation columns are strided loads.
- "packed": the activations are permuted once per call so that each K block holds its even columns,
  then its odd ones (two contiguous loads). Block scales are loaded once per 16 values and
  broadcast with a reshape. A few PTX instructions per 8 values (`_E2M1_PTX`, one asm block for
  the low nibbles and one for the high ones) turn 4 packed bytes into 4 bf16x2 registers: `prmt`
  spreads the bytes into 16-bit lanes, `(nibble * 0x1040) & 0x81C0` puts the magnitude bits at
  bf16 bits 6-8 and the sign at bit 15 (that bit pattern is the E2M1 value times 2^-126,
  subnormals included), and one `fma.rn.bf16x2` multiplies it by `block_scale * 2^119` (exact:
  the product has at most 6 significant bits). The decoded weight is the true one times 2^-7,
  which the global scale undoes on the accumulator. No fp32 conversion per
  value. In interpret mode (no PTX on the CPU) a plain-jnp decode with the same results stands in.

Rounding (the reference below does the same): each projection accumulates in fp32 and is rounded
to the activation dtype; SwiGLU is computed in fp32 from those and rounded; each pair's down output
is scaled by its weight in fp32 and rounded; a token's pairs are added in fp32 and rounded once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

Format = Literal["bf16", "fp8_channel", "fp8_tensor", "nvfp4"]
NVFP4_GROUP = 16
# fp16 bit pattern (e2m1 code bits moved into place) times 2^14 is the E2M1 value, subnormals included.
_FP16_E2M1_FACTOR = 2.0**14
Nvfp4Decode = Literal["per_value", "packed"]
# The default NVFP4 decode of `choose_blocks` (the "packed" one is not yet measured on a GPU).
NVFP4_DECODE: Nvfp4Decode = "packed"  # H200, 2026-11-30: 1.5-2.6x faster than per_value (RESULTS.md)
# "packed": the bf16 bit pattern of an E2M1 code (magnitude at bits 6-8, sign at 15) is the value
# times 2^-126; block scales are multiplied by 2^119 (448 * 2^119 still fits bf16), so the decoded
# weight is value * block_scale * 2^-7 and the accumulator is multiplied by 2^7 * global_scale.
_PACKED_SCALE_FACTOR = 2.0**119
_PACKED_OUTPUT_FACTOR = 2.0**7
# One asm per nibble (Pallas' Triton lowering takes one result per inline asm). Inputs: $2 = 4
# packed bytes (elements 0-3), $3/$4 = their bf16 scales (elements 0,1 / 2,3). Outputs: $0/$1 = the
# low (or high) nibbles of bytes 0,1 / 2,3 times their scales. NIBBLE_MASK/MULTIPLIER: 0x000F000F /
# 0x1040 for low nibbles, 0x00F000F0 / 0x104 for high ones: both put the nibble n at n<<6 + n<<12,
# whose mask 0x81C0 keeps the magnitude at bf16 bits 6-8 and the sign at bit 15.
_E2M1_PTX = """{
.reg .b32 d01, d23, t, zero, negzero;
mov.b32 zero, 0;
mov.b32 negzero, 0x80008000;
prmt.b32 d01, $2, zero, 0x4140;
prmt.b32 d23, $2, zero, 0x4342;
and.b32 t, d01, NIBBLE_MASK;
mul.lo.u32 t, t, MULTIPLIER;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 $0, t, $3, negzero;
and.b32 t, d23, NIBBLE_MASK;
mul.lo.u32 t, t, MULTIPLIER;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 $1, t, $4, negzero;
}"""
_E2M1_PTX_LOW = _E2M1_PTX.replace("NIBBLE_MASK", "0x000F000F").replace("MULTIPLIER", "0x1040")
_E2M1_PTX_HIGH = _E2M1_PTX.replace("NIBBLE_MASK", "0x00F000F0").replace("MULTIPLIER", "0x104")
_E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale", "global_scale"],
                   meta_fields=["format", "row_offset", "rows"])
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert, logically `[E, rows, K]` (HF [out, in] layout).

    - bf16 (or any float dtype): `values [E, N, K]`; rows `row_offset .. row_offset + rows` of it
      are used, so gate and up can be two views of one fused `gate_up_proj` without a copy.
    - fp8_channel: `values` e4m3 `[E, N, K]`, `scale` fp32 `[E, N]`.
    - fp8_tensor: `values` e4m3 `[E, N, K]`, `scale` fp32 `[E]`.
    - nvfp4: `values` uint8 `[E, N, K/2]` (element 2j in the low nibble), `scale` e4m3
      `[E, N, K/16]`, `global_scale` fp32 `[E]`.
    """

    values: jax.Array
    scale: jax.Array | None = None
    global_scale: jax.Array | None = None
    format: Format = "bf16"
    row_offset: int = 0
    rows: int | None = None

    @property
    def num_rows(self) -> int:
        return self.values.shape[1] - self.row_offset if self.rows is None else self.rows

    @property
    def in_features(self) -> int:
        return self.values.shape[2] * (2 if self.format == "nvfp4" else 1)

    def arrays(self) -> tuple[jax.Array, ...]:
        return tuple(a for a in (self.values, self.scale, self.global_scale) if a is not None)

    def dequantize(self, dtype) -> Float[Array, "experts rows k"]:
        """Plain-jnp dequantization of the used rows (the reference path)."""
        rows = slice(self.row_offset, self.row_offset + self.num_rows)
        values = self.values[:, rows]
        if self.format == "nvfp4":
            codes = jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(*values.shape[:-1], -1)
            decoded = jnp.asarray(_E2M1_VALUES)[codes.astype(jnp.int32)]
            block = self.scale[:, rows].astype(jnp.float32)
            decoded = decoded.reshape(*block.shape, NVFP4_GROUP) * block[..., None]
            w = decoded.reshape(values.shape[:-1] + (-1,)) * self.global_scale[:, None, None]
        elif self.format == "fp8_channel":
            w = values.astype(jnp.float32) * self.scale[:, rows, None]
        elif self.format == "fp8_tensor":
            w = values.astype(jnp.float32) * self.scale[:, None, None]
        else:
            return values.astype(dtype)
        return w.astype(dtype)


def _swiglu(gate, up):
    """fp32 SwiGLU of rounded gate/up, silu as `x / (1 + exp(-x))` (the reference's form)."""
    gate32, up32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    return gate32 / (1.0 + jnp.exp(-gate32)) * up32


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def moe_gemm_reference(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    ids: Int[Array, "tokens k"],
    gate: ExpertWeights,
    up: ExpertWeights,
    down: ExpertWeights,
    *,
    expert_offset: int | Int[Array, ""] | None = None,
) -> Float[Array, "tokens hidden"]:
    """Plain jnp: each (token, expert) pair gathers its expert's dequantized weights. With
    `expert_offset`, the weights are one device's experts `expert_offset ..` (expert parallelism)
    and pairs routed to other experts count zero."""
    dtype = x.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    tokens, top_k = ids.shape
    local_ids, local = _local_pairs(ids, expert_offset, gate.values.shape[0])
    g, u, d = gate.dequantize(dtype), up.dequantize(dtype), down.dequantize(dtype)
    pair_x = jnp.repeat(x, top_k, axis=0)
    pair_ids = jnp.where(local, local_ids, 0).reshape(-1)

    def project(w, inputs):
        return jnp.einsum("pk,pnk->pn", inputs, w[pair_ids], precision=precision,
                          preferred_element_type=jnp.float32).astype(dtype)

    act = _swiglu(project(g, pair_x), project(u, pair_x)).astype(dtype)
    out = project(d, act).astype(jnp.float32) * weights.reshape(-1, 1)
    return _add_token_pairs(out.astype(dtype), local, tokens)


def _local_pairs(ids: Int[Array, "tokens k"], expert_offset, num_experts: int):
    """(ids relative to the local experts, with `num_experts` for pairs that are not computed here;
    whether each pair is local). A pair is not local when its id is past these experts: another
    device's expert (expert parallelism, `expert_offset`), or a negative id (a padding token the
    caller masked: `MoE(num_tokens=)`)."""
    local_ids = ids.astype(jnp.int32) - (0 if expert_offset is None else expert_offset)
    local = (local_ids >= 0) & (local_ids < num_experts)
    return jnp.where(local, local_ids, num_experts), local


def _add_token_pairs(pair_out: Float[Array, "pairs hidden"], local: Array, tokens: int) -> Float[Array, "tokens hidden"]:
    """A token's pair outputs added in fp32 and rounded once; other devices' pairs (never computed
    here, so their rows hold anything) count zero."""
    summed = jnp.where(local[:, :, None], pair_out.reshape(tokens, local.shape[1], -1).astype(jnp.float32), 0.0)
    return summed.sum(1).astype(pair_out.dtype)


# --------------------------------------------------------------------------------------------------
# Blocks of pairs
# --------------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_from_ids(ids_ref, slot, *, num_experts: int, block_m: int):
    """(expert, pair rows [block_m], row valid [block_m]) of the slot-th used expert; expert -1 when
    fewer experts are used than there are slots. All of the expert's pairs must fit one block.
    Padding rows point one past the last pair: masked on the GPU, and dropped (not written over a
    real row) by interpret mode's scatters."""
    pairs = ids_ref.shape[0]
    padded_pairs, padded_experts = _next_pow2(pairs), _next_pow2(num_experts)
    pair_iota = lax.iota(jnp.int32, padded_pairs)
    if padded_pairs == pairs:
        ids = ids_ref[...]
    else:
        from jax.experimental.pallas import triton as plgpu

        ids = plgpu.load(ids_ref.at[pair_iota], mask=pair_iota < pairs, other=num_experts)
    expert_iota = lax.iota(jnp.int32, padded_experts)
    # ids == num_experts (padding lanes, other devices' pairs) match no expert, also when E is not a power of 2
    present = jnp.max((ids[:, None] == expert_iota[None, :]).astype(jnp.int32), axis=0)
    if padded_experts != num_experts:
        present = jnp.where(expert_iota < num_experts, present, 0)
    rank = jnp.cumsum(present) - 1
    expert = jnp.sum(jnp.where((present > 0) & (rank == slot), expert_iota, 0))
    expert = jnp.where(slot < jnp.sum(present), expert, -1)
    mine = (ids == expert).astype(jnp.int32)
    position = jnp.cumsum(mine) - 1
    match = (mine[None, :] > 0) & (position[None, :] == lax.iota(jnp.int32, block_m)[:, None])
    rows = jnp.sum(jnp.where(match, pair_iota[None, :], 0), axis=1)
    row_ok = jnp.max(match.astype(jnp.int32), axis=1) > 0
    return expert, jnp.where(row_ok, rows, pairs), row_ok


def _block_from_table(block_expert_ref, block_rows_ref, block, pairs: int):
    rows = block_rows_ref[block, :]
    return block_expert_ref[block], jnp.where(rows >= 0, rows, pairs), rows >= 0


def sorted_blocks(ids: Int[Array, "tokens k"], num_experts: int, block_m: int):
    """Pairs sorted by expert and cut into blocks of `block_m` rows of one expert (XLA); ids equal
    to `num_experts` (other devices' pairs) are left out. Returns block_expert [B] (-1: unused
    block) and block_rows [B, block_m] (pair index, -1: pad); B = a static bound on the number of
    blocks."""
    flat = ids.reshape(-1)
    pairs = flat.shape[0]
    used_bound = min(num_experts, pairs)
    num_blocks = (pairs + used_bound * (block_m - 1)) // block_m
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks_per_expert)
    block_start = block_end - blocks_per_expert
    pair_start = jnp.cumsum(counts) - counts
    block = jnp.arange(num_blocks, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(block_end, block, side="right"), num_experts - 1).astype(jnp.int32)
    used = block < block_end[-1]
    first_row = (block - block_start[expert]) * block_m
    valid_rows = jnp.where(used, jnp.clip(counts[expert] - first_row, 0, block_m), 0)
    row = jnp.arange(block_m, dtype=jnp.int32)
    source = jnp.minimum(pair_start[expert][:, None] + first_row[:, None] + row[None, :], pairs - 1)
    block_rows = jnp.where(row[None, :] < valid_rows[:, None], order[source], -1)
    return jnp.where(used, expert, -1), block_rows


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Operand:
    """Static description of an ExpertWeights passed to a kernel as 1-3 refs."""

    format: Format
    row_offset: int
    rows: int
    in_features: int
    num_arrays: int
    # NVFP4 only: "per_value", "packed" (PTX), or "packed_emulated" (the same values in plain jnp).
    decode: str = "per_value"

    @classmethod
    def of(cls, w: ExpertWeights) -> _Operand:
        return cls(w.format, w.row_offset, w.num_rows, w.in_features, len(w.arrays()))


def _dot(a, b, dtype):
    """a @ b^T in fp32."""
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _e2m1_as_fp16(codes):
    """E2M1 codes (uint8, one per value, bits 0-3) as fp16 values equal to e2m1 / 2^14."""
    codes = codes.astype(jnp.uint16)
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return lax.bitcast_convert_type(bits, jnp.float16)


def _e2m1_times_scale(packed, scale, *, emulated: bool):
    """(low, high) nibbles of uint8 `packed [N, C]` decoded and multiplied by bf16 `scale [N, C]`
    (block scale * 2^119): bf16 E2M1 value * block scale * 2^-7, exact. PTX on the GPU; in
    interpret mode the same values from plain jnp (XLA on the CPU flushes the subnormal bit
    patterns the PTX relies on, so the emulation builds the values arithmetically)."""
    if not emulated:
        from jax.experimental.pallas import triton as plgpu

        out = [jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)]
        return tuple(plgpu.elementwise_inline_asm(asm, args=[packed, scale], constraints="=r,=r,r,r,r", pack=4,
                                                  result_shape_dtypes=out)[0]
                     for asm in (_E2M1_PTX_LOW, _E2M1_PTX_HIGH))
    # what the PTX computes: (E2M1 value * 2^-126) * scale, here without subnormals
    factor = scale.astype(jnp.float32) * 2.0**-126

    def value(code):
        magnitude_code = (code & 7).astype(jnp.int32)
        exponent, mantissa = magnitude_code >> 1, magnitude_code & 1
        normal = ((2 + mantissa) << exponent).astype(jnp.float32) * 0.25
        magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 0.5, normal)
        return (jnp.where((code & 8) != 0, -magnitude, magnitude) * factor).astype(jnp.bfloat16)

    return value(packed & 0x0F), value(packed >> 4)


def _even_odd_columns(x: Float[Array, "rows k"], block_k: int) -> Float[Array, "rows k_padded"]:
    """Columns of each K block of `block_k` reordered to its even columns, then its odd ones (the
    "packed" NVFP4 decode's low and high nibbles); K padded with zeros to a multiple of block_k."""
    rows, k = x.shape
    padded = pl.cdiv(k, block_k) * block_k
    x = jnp.pad(x, ((0, 0), (0, padded - k)))
    x = x.reshape(rows, padded // block_k, block_k // 2, 2).transpose(0, 1, 3, 2)
    return x.reshape(rows, padded)


def _accumulate_packed_nvfp4(acc, x_ref, token_rows, row_ok, op: _Operand, refs, expert, n_idx, n_ok, chunk,
                             block_k: int):
    """acc [M, N] += x[token_rows, chunk] @ w[expert, n_idx, chunk]^T, NVFP4 "packed" decode; x_ref holds
    the activations reordered by `_even_odd_columns` (padded, so x needs no K mask)."""
    from jax.experimental.pallas import triton as plgpu

    k_total = op.in_features
    half, groups = block_k // 2, block_k // NVFP4_GROUP
    block_n = n_idx.shape[0]
    w_rows = (op.row_offset + n_idx)[:, None]
    k_tail = k_total % block_k != 0
    n_tail = op.rows % block_n != 0

    def mask_for(cols, bound):
        mask = n_ok[:, None] if n_tail else None
        if k_tail:
            mask = (cols[None, :] < bound) if mask is None else mask & (cols[None, :] < bound)
        return mask

    byte_cols = chunk * half + lax.iota(jnp.int32, half)
    byte_mask = mask_for(byte_cols, k_total // 2)
    packed = plgpu.load(refs[0].at[expert, w_rows, byte_cols[None, :]], mask=byte_mask,
                        other=None if byte_mask is None else 0)
    group_cols = chunk * groups + lax.iota(jnp.int32, groups)
    # (no `other=`: Triton cannot splat an int into fp8; the tail is zeroed below)
    scale = plgpu.load(refs[1].at[expert, w_rows, group_cols[None, :]],
                       mask=mask_for(group_cols, k_total // NVFP4_GROUP))
    scale = scale.astype(jnp.float32) * _PACKED_SCALE_FACTOR
    if k_tail:
        scale = jnp.where(group_cols[None, :] < k_total // NVFP4_GROUP, scale, 0.0)
    # one scale per 16 values = per 8 bytes: broadcast, not gathered per value
    scale = jnp.broadcast_to(scale.astype(jnp.bfloat16)[:, :, None], (block_n, groups, NVFP4_GROUP // 2))
    low, high = _e2m1_times_scale(packed, scale.reshape(block_n, half), emulated=op.decode == "packed_emulated")
    dtype = x_ref.dtype
    cols = chunk * block_k + lax.iota(jnp.int32, half)
    x_even = plgpu.load(x_ref.at[token_rows[:, None], cols[None, :]], mask=row_ok[:, None], other=0)
    x_odd = plgpu.load(x_ref.at[token_rows[:, None], half + cols[None, :]], mask=row_ok[:, None], other=0)
    return acc + _dot(x_even, low.astype(dtype), dtype) + _dot(x_odd, high.astype(dtype), dtype)


def _accumulate(acc, x_ref, token_rows, row_ok, op: _Operand, refs, expert, n_idx, n_ok, chunk, block_k: int):
    """acc [M, N] += x[token_rows, chunk] @ w[expert, n_idx, chunk]^T for one K chunk."""
    from jax.experimental.pallas import triton as plgpu

    if op.format == "nvfp4" and op.decode != "per_value":
        return _accumulate_packed_nvfp4(acc, x_ref, token_rows, row_ok, op, refs, expert, n_idx, n_ok, chunk,
                                        block_k)
    k_total = op.in_features
    dtype = x_ref.dtype
    w_rows = (op.row_offset + n_idx)[:, None]
    k_tail = k_total % block_k != 0
    n_tail = op.rows % n_idx.shape[0] != 0

    def load_x(cols):
        mask = row_ok[:, None] & (cols[None, :] < k_total) if k_tail else row_ok[:, None]
        return plgpu.load(x_ref.at[token_rows[:, None], cols[None, :]], mask=mask, other=0)

    def load_w(ref, cols, bound):
        """Weight tile; lanes past K are zeroed (past N they only feed masked outputs)."""
        mask = None
        if n_tail:
            mask = n_ok[:, None]
        if k_tail:
            mask = (cols[None, :] < bound) if mask is None else mask & (cols[None, :] < bound)
        # (no `other=`: Triton cannot splat an int into fp8)
        tile = plgpu.load(ref.at[expert, w_rows, cols[None, :]], mask=mask)
        return (lambda t: jnp.where(cols[None, :] < bound, t, 0)) if k_tail else (lambda t: t), tile

    if op.format == "nvfp4":
        half = block_k // 2
        j = lax.iota(jnp.int32, half)
        even = chunk * block_k + 2 * j
        zero_tail, packed = load_w(refs[0], chunk * half + j, k_total // 2)
        scale_cols = chunk * (block_k // NVFP4_GROUP) + j // (NVFP4_GROUP // 2)
        zero_scale_tail, scale = load_w(refs[1], scale_cols, k_total // NVFP4_GROUP)
        scale = zero_scale_tail(scale.astype(jnp.float32) * _FP16_E2M1_FACTOR)
        low = (_e2m1_as_fp16(packed & 0x0F).astype(jnp.float32) * scale).astype(dtype)
        high = (_e2m1_as_fp16(packed >> 4).astype(jnp.float32) * scale).astype(dtype)
        return acc + _dot(load_x(even), low, dtype) + _dot(load_x(even + 1), high, dtype)

    cols = chunk * block_k + lax.iota(jnp.int32, block_k)
    zero_tail, w = load_w(refs[0], cols, k_total)
    return acc + _dot(load_x(cols), zero_tail(w.astype(dtype)), dtype)


def _output_scale(acc, op: _Operand, refs, expert, n_idx, n_ok):
    """The quantized formats' scales that factor out of the K sum."""
    from jax.experimental.pallas import triton as plgpu

    if op.format == "fp8_channel":
        scale = plgpu.load(refs[1].at[expert, op.row_offset + n_idx], mask=n_ok, other=0.0)
        return acc * scale[None, :]
    if op.format == "fp8_tensor":
        return acc * refs[1][expert]
    if op.format == "nvfp4":
        return acc * (refs[2][expert] * (_PACKED_OUTPUT_FACTOR if op.decode != "per_value" else 1.0))
    return acc


def _project(x_ref, token_rows, row_ok, op, refs, expert, n_idx, n_ok, chunks, block_k, block_m):
    acc = jnp.zeros((block_m, n_idx.shape[0]), jnp.float32)
    body = lambda chunk, acc: _accumulate(acc, x_ref, token_rows, row_ok, op, refs, expert, n_idx, n_ok, chunk, block_k)
    acc = lax.fori_loop(chunks[0], chunks[1], body, acc)
    return _output_scale(acc, op, refs, expert, n_idx, n_ok)


def _split_refs(refs, *ops):
    out, at = [], 0
    for op in ops:
        out.append(refs[at:at + op.num_arrays])
        at += op.num_arrays
    return out, refs[at:]


def _block(meta_refs, source: str, *, num_experts: int, block_m: int):
    if source == "ids":
        return _block_from_ids(meta_refs[0], pl.program_id(0), num_experts=num_experts, block_m=block_m)
    return _block_from_table(meta_refs[0], meta_refs[1], pl.program_id(0), meta_refs[2].shape[0])


def _gate_up_kernel(*refs, source, num_meta, gate: _Operand, up: _Operand, num_experts, top_k,
                    block_m, block_n, block_k, chunks_per_split, fused):
    from jax.experimental.pallas import triton as plgpu

    meta_refs, (x_ref, *rest) = refs[:num_meta], refs[num_meta:]
    (gate_refs, up_refs), (out_ref,) = _split_refs(rest, gate, up)
    expert, pair_rows, row_ok = _block(meta_refs, source, num_experts=num_experts, block_m=block_m)
    n_tile, split = pl.program_id(1), pl.program_id(2)
    intermediate = gate.rows
    n_idx = n_tile * block_n + lax.iota(jnp.int32, block_n)
    n_ok = n_idx < intermediate
    k_chunks = pl.cdiv(gate.in_features, block_k)
    chunks = (split * chunks_per_split, jnp.minimum((split + 1) * chunks_per_split, k_chunks))

    @pl.when(expert >= 0)
    def _compute():
        token_rows = pair_rows // top_k
        args = (x_ref, token_rows, row_ok)
        g = _project(*args, gate, gate_refs, expert, n_idx, n_ok, chunks, block_k, block_m)
        u = _project(*args, up, up_refs, expert, n_idx, n_ok, chunks, block_k, block_m)
        mask = row_ok[:, None] & n_ok[None, :]
        if fused:
            dtype = x_ref.dtype
            act = _swiglu(g.astype(dtype), u.astype(dtype)).astype(out_ref.dtype)
            plgpu.store(out_ref.at[pair_rows[:, None], n_idx[None, :]], act, mask=mask)
        else:
            plgpu.store(out_ref.at[split, pair_rows[:, None], n_idx[None, :]], g, mask=mask)
            plgpu.store(out_ref.at[split, pair_rows[:, None], intermediate + n_idx[None, :]], u, mask=mask)


def _down_kernel(*refs, source, num_meta, down: _Operand, num_experts, block_m, block_n, block_k):
    from jax.experimental.pallas import triton as plgpu

    meta_refs, (act_ref, pair_weight_ref, *rest) = refs[:num_meta], refs[num_meta:]
    (down_refs,), (out_ref,) = _split_refs(rest, down)
    expert, pair_rows, row_ok = _block(meta_refs, source, num_experts=num_experts, block_m=block_m)
    n_idx = pl.program_id(1) * block_n + lax.iota(jnp.int32, block_n)
    n_ok = n_idx < down.rows

    @pl.when(expert >= 0)
    def _compute():
        chunks = (0, pl.cdiv(down.in_features, block_k))
        acc = _project(act_ref, pair_rows, row_ok, down, down_refs, expert, n_idx, n_ok, chunks, block_k, block_m)
        pair_weight = plgpu.load(pair_weight_ref.at[pair_rows], mask=row_ok, other=0.0)
        out = (acc.astype(act_ref.dtype).astype(jnp.float32) * pair_weight[:, None]).astype(out_ref.dtype)
        plgpu.store(out_ref.at[pair_rows[:, None], n_idx[None, :]], out, mask=row_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Block sizes and the op
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEBlocks:
    """Block sizes of one call. `source` "ids" needs tokens <= block_m."""

    source: Literal["ids", "sorted"]
    block_m: int
    gate_up_n: int
    gate_up_k: int
    gate_up_splits: int
    down_n: int
    down_k: int
    num_warps: int = 4
    num_stages: int = 3
    nvfp4_decode: Nvfp4Decode = "per_value"  # ignored by the other formats


# Largest batch whose blocks are found in the kernel from `ids`: each of the programs scans all
# T*top_k ids, which stops paying off against a few small XLA kernels as T grows.
IDS_SOURCE_MAX_TOKENS = 16
# About this many programs keep the H200's 132 SMs streaming weights at decode sizes.
_TARGET_PROGRAMS = 1024


# Measured winners of `benchmarks/moe/bench.py --sweep` (H200, runs C and F in RESULTS.md) at
# Beam's TP8 expert shape, keyed by (format, experts, hidden, intermediate, top_k) and then by the
# largest token count each covers (down from the previous key + 1). Other shapes: the heuristic.
TUNED_BLOCKS: dict[tuple, dict[tuple[int, int], MoEBlocks]] = {
    ("bf16", 256, 5120, 320, 8): {
        (1, 1): MoEBlocks("ids", 16, 32, 128, 6, 64, 64),  # 27.4 µs vs 28.2 heuristic
        (9, 16): MoEBlocks("ids", 16, 32, 64, 2, 128, 64),  # T=16: 257.1 vs 274.7
        (17, 32): MoEBlocks("sorted", 16, 32, 64, 2, 128, 64),  # T=32: 412.4 vs 499.9
        (33, 64): MoEBlocks("sorted", 16, 32, 128, 1, 64, 64),  # T=64: 560.1 vs 571.9
        (65, 1024): MoEBlocks("sorted", 32, 64, 64, 1, 64, 64),  # T=512: 683.5 vs 745.0 (2026-12-01 run F)
    },
}


def tuned_blocks(tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, fmt: Format) -> MoEBlocks | None:
    for (low, high), blocks in TUNED_BLOCKS.get((fmt, num_experts, hidden, intermediate, top_k), {}).items():
        if low <= tokens <= high:
            return blocks
    return None


def choose_blocks(tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, fmt: Format,
                  nvfp4_decode: Nvfp4Decode | None = None) -> MoEBlocks:
    """Block sizes by shape: a measured entry of TUNED_BLOCKS, else a heuristic. Decode batches split the hidden axis of the gate/up GEMM until about
    `_TARGET_PROGRAMS` programs share the weight reads; large batches use sorted blocks of 64 rows
    and fused SwiGLU. The "packed" NVFP4 decode uses wider K blocks: its bytes per block are a
    quarter of bf16's."""
    if (tuned := tuned_blocks(tokens, top_k, num_experts, hidden, intermediate, fmt)) is not None:
        return tuned
    decode = (NVFP4_DECODE if nvfp4_decode is None else nvfp4_decode) if fmt == "nvfp4" else "per_value"
    packed = decode == "packed"
    if tokens <= 64:
        source = "ids" if tokens <= IDS_SOURCE_MAX_TOKENS else "sorted"
        block_m = max(16, _next_pow2(tokens)) if source == "ids" else 16
        # packed: the best of three shapes timed on the H200 at T = 1, 8, 64 (benchmarks/moe/RESULTS.md)
        block_n, block_k = (64, 128) if packed else (32, 64)
        down_n, down_k = (128, 64) if packed else (64, 64)
        # >= 4 K blocks per program: packed NVFP4 at T = 1 took 24.8 us with 10 splits against 26.1
        # with 20 (H200, run J)
        min_chunks_per_split = 4
        used = min(num_experts, tokens * top_k)
        k_chunks = pl.cdiv(hidden, block_k)
        splits = max(1, min(k_chunks // min_chunks_per_split,
                            _TARGET_PROGRAMS // max(1, used * pl.cdiv(intermediate, block_n))))
        return MoEBlocks(source, block_m, block_n, block_k, splits, down_n, down_k, nvfp4_decode=decode)
    if packed:
        return MoEBlocks("sorted", 64, 64, 128, 1, 64, 128, nvfp4_decode=decode)
    # bf16 T=8192 on the H200: 2542 us against 3155 for 64-column tiles (RESULTS.md, run F)
    return MoEBlocks("sorted", 64, 128, 64, 1, 128, 64, num_warps=4, num_stages=3)


def moe_gemm_kernel(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    ids: Int[Array, "tokens k"],
    gate: ExpertWeights,
    up: ExpertWeights,
    down: ExpertWeights,
    *,
    expert_offset: int | Int[Array, ""] | None = None,
    blocks: MoEBlocks | None = None,
    interpret: bool = False,
) -> Float[Array, "tokens hidden"]:
    """The two Pallas kernels (see the module docstring). `expert_offset`: as in the reference, the
    weights hold experts `expert_offset ..` only and other pairs count zero; they form no block."""
    from jax.experimental.pallas import triton as plgpu

    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts = gate.values.shape[0]
    intermediate = gate.num_rows
    pairs = tokens * top_k
    if up.num_rows != intermediate or down.in_features != intermediate or down.num_rows != hidden:
        raise ValueError("gate/up must be [E, I, H] and down [E, H, I]")
    if gate.in_features != hidden:
        raise ValueError(f"expert weights take {gate.in_features} inputs, activations have {hidden}")
    fmt = gate.format
    if blocks is None:
        blocks = choose_blocks(tokens, top_k, num_experts, hidden, intermediate, fmt)
    if blocks.source == "ids" and tokens > blocks.block_m:
        raise ValueError(f"source 'ids' needs tokens ({tokens}) <= block_m ({blocks.block_m})")
    if fmt == "nvfp4" and (blocks.gate_up_k % 32 or blocks.down_k % 32):
        raise ValueError("NVFP4 needs K blocks that are multiples of 32")
    packed = fmt == "nvfp4" and blocks.nvfp4_decode == "packed"
    if packed and not interpret:
        # the PTX takes 4 bytes at a time: each thread must hold a multiple of 4 of a weight tile
        threads = 32 * blocks.num_warps
        for n, k in ((blocks.gate_up_n, blocks.gate_up_k), (blocks.down_n, blocks.down_k)):
            if n * k // 2 < 4 * threads:
                raise ValueError(f"packed NVFP4 decode needs weight tiles of >= {4 * threads} bytes, got {n}x{k // 2}")
    decode = ("packed_emulated" if interpret else "packed") if packed else "per_value"
    operand = lambda w: dataclasses.replace(_Operand.of(w), decode=decode)
    local_ids, local = _local_pairs(ids, expert_offset, num_experts)
    flat_ids = local_ids.reshape(-1)
    if blocks.source == "ids":
        meta = (flat_ids,)
        grid0 = min(num_experts, pairs)
    else:
        meta = (*sorted_blocks(flat_ids, num_experts, blocks.block_m), flat_ids)
        grid0 = meta[0].shape[0]
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    common = dict(source=blocks.source, num_meta=len(meta), num_experts=num_experts, block_m=blocks.block_m)

    k_chunks = pl.cdiv(hidden, blocks.gate_up_k)
    chunks_per_split = pl.cdiv(k_chunks, blocks.gate_up_splits)
    splits = pl.cdiv(k_chunks, chunks_per_split)
    fused = splits == 1
    gate_up_out = (
        jax.ShapeDtypeStruct((pairs, intermediate), x.dtype) if fused
        else jax.ShapeDtypeStruct((splits, pairs, 2 * intermediate), jnp.float32)
    )
    gate_up = pl.pallas_call(
        functools.partial(
            _gate_up_kernel, gate=operand(gate), up=operand(up), top_k=top_k, block_n=blocks.gate_up_n,
            block_k=blocks.gate_up_k, chunks_per_split=chunks_per_split, fused=fused, **common,
        ),
        grid=(grid0, pl.cdiv(intermediate, blocks.gate_up_n), splits),
        out_shape=gate_up_out,
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
    )(*meta, _even_odd_columns(x, blocks.gate_up_k) if packed else x, *gate.arrays(), *up.arrays())
    if fused:
        act = gate_up
    else:
        summed = gate_up.sum(0)
        act = _swiglu(summed[:, :intermediate].astype(x.dtype), summed[:, intermediate:].astype(x.dtype))
        act = act.astype(x.dtype)
    if packed:
        act = _even_odd_columns(act, blocks.down_k)

    out = pl.pallas_call(
        functools.partial(_down_kernel, down=operand(down), block_n=blocks.down_n, block_k=blocks.down_k, **common),
        grid=(grid0, pl.cdiv(hidden, blocks.down_n)),
        out_shape=jax.ShapeDtypeStruct((pairs, hidden), x.dtype),
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(*meta, act, weights.reshape(-1).astype(jnp.float32), *down.arrays())
    return _add_token_pairs(out, local, tokens)


def kernel_is_faster(tokens: int, fmt: Format) -> bool:
    """Whether the kernels beat XLA's compile of `moe_gemm_reference` on a GPU: everywhere but bf16
    at one token, where XLA fuses the weight gather into its GEMV (H200: 23.3 against 30.5 us in
    run K, 23.3 against 27.1 in run E; benchmarks/moe/RESULTS.md)."""
    return not (fmt == "bf16" and tokens == 1)


def moe_gemm(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    ids: Int[Array, "tokens k"],
    gate: ExpertWeights,
    up: ExpertWeights,
    down: ExpertWeights,
    *,
    expert_offset: int | Int[Array, ""] | None = None,
    use_kernel: bool | None = None,
    blocks: MoEBlocks | None = None,
    interpret: bool = False,
) -> Float[Array, "tokens hidden"]:
    """Routed experts: by default the Pallas kernels on GPU where they are the faster path
    (`kernel_is_faster`) or with `interpret=True`, the reference elsewhere. `expert_offset`: the
    weights are one device's experts from that index on (expert parallelism)."""
    if use_kernel is None:
        use_kernel = (jax.default_backend() == "gpu" and kernel_is_faster(x.shape[0], gate.format)) or interpret
    if use_kernel:
        return moe_gemm_kernel(x, weights, ids, gate, up, down, expert_offset=expert_offset, blocks=blocks,
                               interpret=interpret)
    return moe_gemm_reference(x, weights, ids, gate, up, down, expert_offset=expert_offset)
