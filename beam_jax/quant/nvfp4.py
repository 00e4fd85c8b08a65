"""NVFP4 (NVIDIA ModelOpt, `quant_algo: NVFP4`, group size 16): E2M1 codes with two-level scales.

A weight `W [..., out, in]` is stored as
- `packed`      uint8 `[..., out, in/2]`: two 4-bit E2M1 codes per byte, element 2j in the LOW nibble;
- `block_scale` float8_e4m3fn `[..., out, in/16]`: one scale per 16 consecutive values along `in`;
- `global_scale` float32 `[...]` (ModelOpt's `weight_scale_2`): one per matrix;
- `input_scale` float32 `[...]`, optional: the calibrated activation scale, carried through untouched;
and `W ≈ e2m1(code) * f32(block_scale[o, k // 16]) * global_scale`.

ModelOpt's recipe (reproduced by `quantize_nvfp4`): `global = amax(|W|) / (6 * 448)`, so that the
block scales `block_amax / (6 * global)` use e4m3's whole range (max 448), then each value is divided
by `f32(block_scale) * global` and rounded to the nearest E2M1 value, ties to even, saturating at ±6.

Choices where ModelOpt is silent or does something else (all dequantize to the same zeros):
- An all-zero block gets block scale 0 and codes 0 (ModelOpt writes scale 1.0 there). A block whose
  scale underflows e4m3 (block amax below ~2.2e-6 of the tensor amax) is also stored as scale 0,
  codes 0: its values are below the format's resolution for that tensor.
- An all-zero tensor gets `global_scale = 0`, block scales 0 and codes 0; nothing divides by zero.
- `in` must be a multiple of 16: nothing is padded, because a padded matrix would no longer have the
  checkpoint's shapes; pad the weight (and the activations) yourself if you need to.

Precision, per element: `|W - deq| ≤ block_amax · (1 + 2^-4) / 6 + amax(|W|) · 2^-10 / 448`.
Half an E2M1 step is at most 1 (between 4 and 6), i.e. 1/6 of the block's top value; the block
scale's e4m3 rounding (3 mantissa bits: relative error ≤ 2^-4 while the scale is normal, i.e. block
amax ≥ 2^-6 · 6 · global) stretches that step by up to 2^-4, or shrinks it so the top value saturates
at 6 (error ≤ 2^-4 · block_amax). The second term covers subnormal and underflowed block scales,
whose rounding error is absolute (≤ 2^-10 · 6 · global); it vanishes for blocks with normal scales.

Host-side work (quantization, packing, the reference dequantization) is numpy; `dequantize_nvfp4` is
jnp and runs inside jit. It decodes through a 16-entry table and applies the block scale once per 16
values (GPU.md: a fast decode must not do per-value exponent arithmetic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Code c (bit 3 = sign, bits 0-2 = magnitude index) decodes to E2M1_VALUES[c]; code 8 is -0.0.
_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_VALUES = np.concatenate([_MAGNITUDES, -_MAGNITUDES])

# Midpoints between consecutive magnitudes. A magnitude exactly on a midpoint goes to the neighbour
# with the even code: upward when the lower code is odd (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0), down
# when it is even (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2.0, 5 -> 4.0).
_MIDPOINTS = (_MAGNITUDES[:-1] + _MAGNITUDES[1:]) / 2


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """Round to the nearest E2M1 value (ties to the even code), saturating at ±6; uint8 codes.

    The sign bit is taken from the sign of `x` (so -0.0 and small negatives give code 8, negative
    zero). ±inf saturate to ±6; NaN raises ValueError.
    """
    x = np.asarray(x)
    # float64 stays float64 so that its ties are judged exactly; narrower floats are exact in fp32.
    x = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    if np.isnan(x).any():
        raise ValueError("encode_e2m1: input contains NaN")
    mag = np.abs(x)
    code = np.zeros(x.shape, dtype=np.uint8)
    for lower, mid in enumerate(_MIDPOINTS):
        # Passing midpoint k moves the code from k to k+1; on the midpoint only if k+1 is even.
        passed = mag >= mid if lower % 2 == 1 else mag > mid
        code += passed.astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """float32 values of 4-bit E2M1 codes (the high four bits of each uint8 must be zero)."""
    codes = np.asarray(codes)
    if codes.size and int(codes.max()) > 15:
        raise ValueError("decode_e2m1: codes must be in [0, 15]")
    return E2M1_VALUES[codes.astype(np.intp)]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes `[..., n]` (n even) into uint8 `[..., n/2]`: element 2j low, 2j+1 high."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {codes.shape}")
    if codes.size and int(codes.max()) > 15:
        raise ValueError("pack_nibbles: codes must be in [0, 15]")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_nibbles`: uint8 `[..., n/2]` -> codes `[..., n]`."""
    packed = np.asarray(packed, dtype=np.uint8)
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """An NVFP4 weight `[..., out, in]`; leading dims stack matrices (experts `[E, out, in]`).

    A jax pytree: pass it through jit, `jax.tree.map` it (e.g. `lambda a: a[e]` picks expert e when
    there is an input_scale; index the fields directly otherwise). There is no shape check in the
    constructor because pytree transformations rebuild it with non-array leaves; call `validate()`.
    """

    packed: jax.Array | np.ndarray  # uint8 [..., out, in/2]
    block_scale: jax.Array | np.ndarray  # float8_e4m3fn [..., out, in/16]
    global_scale: jax.Array | np.ndarray  # float32 [...]
    input_scale: jax.Array | np.ndarray | None = None  # float32 [...] (calibrated; may be absent)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape `[..., out, in]`."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def validate(self) -> NVFP4Weight:
        """Check dtypes and shapes agree with each other; returns self."""
        p, s, g = self.packed, self.block_scale, self.global_scale
        if p.dtype != np.uint8 or s.dtype != ml_dtypes.float8_e4m3fn or g.dtype != np.float32:
            raise ValueError(f"NVFP4Weight dtypes must be uint8/float8_e4m3fn/float32, got {p.dtype}/{s.dtype}/{g.dtype}")
        if p.ndim < 2 or p.shape[-1] * 2 != s.shape[-1] * GROUP_SIZE or p.shape[:-1] != s.shape[:-1]:
            raise ValueError(f"NVFP4Weight: packed {p.shape} and block_scale {s.shape} do not match (16 values per scale)")
        if g.shape != p.shape[:-2]:
            raise ValueError(f"NVFP4Weight: global_scale shape {g.shape} must be {p.shape[:-2]} (one per matrix)")
        if self.input_scale is not None and self.input_scale.shape != p.shape[:-2]:
            raise ValueError(f"NVFP4Weight: input_scale shape {self.input_scale.shape} must be {p.shape[:-2]}")
        return self

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return dequantize_nvfp4(self, dtype)

    @classmethod
    def from_modelopt(cls, weight, weight_scale, weight_scale_2, input_scale=None) -> NVFP4Weight:
        """From a ModelOpt Linear's tensors (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`).

        Scalars stored as shape `[1]` are reshaped to `[]` so that stacking gives `[E]`."""
        weight_scale_2 = np.asarray(weight_scale_2, np.float32).reshape(np.shape(weight)[:-2])
        if input_scale is not None:
            input_scale = np.asarray(input_scale, np.float32).reshape(np.shape(weight)[:-2])
        return cls(np.asarray(weight), np.asarray(weight_scale), weight_scale_2, input_scale).validate()

    def to_modelopt(self) -> dict[str, np.ndarray]:
        """The tensors under ModelOpt's names, as numpy arrays (input_scale only if present)."""
        out = {
            "weight": np.asarray(self.packed),
            "weight_scale": np.asarray(self.block_scale),
            "weight_scale_2": np.asarray(self.global_scale),
        }
        if self.input_scale is not None:
            out["input_scale"] = np.asarray(self.input_scale)
        return out


def _as_finite_f32(w, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is reported below
        w32 = np.asarray(w).astype(np.float32)
    # Checked after the cast: float64 values beyond fp32's range become inf here.
    if not np.isfinite(w32).all():
        raise ValueError(f"{name}: weight contains NaN or Inf (or values beyond float32's range)")
    return w32


def quantize_nvfp4(w: np.ndarray, input_scale: np.ndarray | float | None = None) -> NVFP4Weight:
    """Quantize `w [..., out, in]` with ModelOpt's NVFP4 recipe; one global scale per matrix.

    A `[out, in]` matrix gets a scalar global scale; a stack `[E, out, in]` gets `[E]` (per expert).
    Computation is fp32, as in ModelOpt (bf16/fp16 inputs are exact in fp32). `input_scale`, if
    given, is stored as float32 broadcast to the leading shape.
    Raises ValueError for NaN/Inf, fewer than 2 dims, an empty array, or `in % 16 != 0`.
    """
    w = _as_finite_f32(w, "quantize_nvfp4")
    if w.ndim < 2 or w.size == 0:
        raise ValueError(f"quantize_nvfp4: need a non-empty [..., out, in] array, got shape {w.shape}")
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(
            f"quantize_nvfp4: in-dim of weight shape {w.shape} is not a multiple of {GROUP_SIZE} (no padding is done)"
        )
    lead, out_dim, in_dim = w.shape[:-2], w.shape[-2], w.shape[-1]
    blocks = w.reshape(*lead, out_dim, in_dim // GROUP_SIZE, GROUP_SIZE)

    amax = np.abs(w).max(axis=(-2, -1))
    global_scale = (amax / np.float32(E2M1_MAX * E4M3_MAX)).astype(np.float32)
    g = global_scale[..., None, None]

    block_amax = np.abs(blocks).max(axis=-1)
    denom = np.float32(E2M1_MAX) * g
    # global == 0 only for an all-zero matrix, whose block amaxes are 0 too: scale 0, not 0/0.
    block_scale_f32 = np.divide(block_amax, denom, out=np.zeros_like(block_amax), where=denom > 0)
    # Defensive: the top block lands on 448 only up to fp32 rounding (which e4m3 rounds back to 448),
    # but e4m3fn has no inf and casts anything ≥ 464 to NaN, so never let a cast see more than 448.
    block_scale = np.minimum(block_scale_f32, np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)

    # Same association as ModelOpt: divide by the fp32 product (block scale × global).
    per_block = (block_scale.astype(np.float32) * g)[..., None]
    # Scale 0 (all-zero block, or a scale that underflowed e4m3): codes 0 instead of 0/0 or x/0.
    scaled = np.divide(blocks, per_block, out=np.zeros_like(blocks), where=per_block > 0)
    codes = encode_e2m1(scaled).reshape(w.shape)

    if input_scale is not None:
        input_scale = np.broadcast_to(np.asarray(input_scale, np.float32), lead).copy()
    return NVFP4Weight(pack_nibbles(codes), block_scale, global_scale, input_scale).validate()


def stack_nvfp4(weights: Sequence[NVFP4Weight]) -> NVFP4Weight:
    """Stack separately quantized matrices (e.g. one per expert) into one `[E, ...]` weight.

    input_scale must be present on all of them or on none."""
    if not weights:
        raise ValueError("stack_nvfp4: nothing to stack")
    has_input = {w.input_scale is not None for w in weights}
    if len(has_input) != 1:
        raise ValueError("stack_nvfp4: input_scale is present on some weights and absent on others")
    return NVFP4Weight(
        np.stack([np.asarray(w.packed) for w in weights]),
        np.stack([np.asarray(w.block_scale) for w in weights]),
        np.stack([np.asarray(w.global_scale) for w in weights]),
        np.stack([np.asarray(w.input_scale) for w in weights]) if has_input == {True} else None,
    ).validate()


def dequantize_nvfp4(weight: NVFP4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Dense `[..., out, in]` weight in `dtype` (jnp; jittable).

    Each code goes through a 16-entry table; the fp32 block scale × global scale is formed once per
    16 values and multiplied in, then the fp32 result is rounded once to `dtype`. Bit-identical to
    `dequantize_nvfp4_reference` (with the caveat that XLA flushes fp32 subnormals, reached only by
    tensors with amax below ~3e-35).
    """
    packed = jnp.asarray(weight.packed)
    lead = packed.shape[:-1]
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)  # [..., out, in/2, 2]
    values = jnp.take(jnp.asarray(E2M1_VALUES), codes.astype(jnp.int32), axis=0)
    values = values.reshape(*lead, -1, GROUP_SIZE)  # [..., out, in/16, 16]
    global_scale = jnp.asarray(weight.global_scale, jnp.float32)[..., None, None]
    per_block = jnp.asarray(weight.block_scale).astype(jnp.float32) * global_scale
    return (values * per_block[..., None]).reshape(*lead, -1).astype(dtype)


def dequantize_nvfp4_reference(weight: NVFP4Weight, dtype=np.float32) -> np.ndarray:
    """numpy reference for `dequantize_nvfp4` (same fp32 operations, same order)."""
    codes = unpack_nibbles(np.asarray(weight.packed))
    values = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, GROUP_SIZE)
    global_scale = np.asarray(weight.global_scale, np.float32)[..., None, None]
    per_block = np.asarray(weight.block_scale).astype(np.float32) * global_scale
    return (values * per_block[..., None]).reshape(codes.shape).astype(dtype)
