"""FP8 (float8_e4m3fn) weights: compressed-tensors FP8_DYNAMIC (per channel) and ModelOpt FP8 (per tensor).

- compressed-tensors `float-quantized` / FP8_DYNAMIC: `weight` e4m3 `[out, in]`, `weight_scale` fp32
  `[out, 1]` (one per output channel); activations are quantized per token at run time
  (`quantize_activations_per_token`).
- ModelOpt FP8: `weight` e4m3, `weight_scale` fp32 scalar per tensor, `input_scale` fp32 scalar: a
  static activation scale (`quantize_activations_static`).
In both `W ≈ f32(weight) * weight_scale`. Leading dims stack matrices (experts `[E, out, in]`): scales
are then `[E, out, 1]` (per channel) or `[E]` (per tensor).

Scale rule (weights and activations alike): `scale = max(amax / 448, float32 smallest normal)`,
values `clip(x / scale, ±448)` cast to e4m3 (round to nearest, ties to even). The floor changes
nothing for real data; it gives all-zero rows/tensors/tokens (padding tokens!) a positive scale, so
their codes are 0, they dequantize to exactly 0, and nothing downstream divides by zero or by an fp32
subnormal (which XLA flushes to zero). The clip is needed because e4m3fn has no inf: a cast of
anything ≥ 464 gives NaN, and `amax / (amax / 448)` may land a hair above 448.

Precision: for a value with |x/scale| ≥ 2^-6 (e4m3 normal) the relative error is ≤ 2^-4; below that
the absolute error is ≤ 2^-10 · scale. Either way `|x - deq| ≤ 2^-4 · row amax` (per tensor: amax).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
FP8_DTYPE = ml_dtypes.float8_e4m3fn
# Smallest normal fp32: the floor on every scale (see the module docstring).
MIN_SCALE = float(np.finfo(np.float32).tiny)
# Run-time activation scales are `amax * ACT_SCALE_FACTOR` (see quantize_activations_per_token).
ACT_SCALE_FACTOR = float(np.float32(1.0 / E4M3_MAX))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """An FP8 weight `[..., out, in]` with per-channel (`[..., out, 1]`) or per-tensor (`[...]`) scale.

    A jax pytree (see `NVFP4Weight` for why the constructor checks nothing; call `validate()`)."""

    weight: jax.Array | np.ndarray  # float8_e4m3fn [..., out, in]
    weight_scale: jax.Array | np.ndarray  # float32 [..., out, 1] per channel, or [...] per tensor
    input_scale: jax.Array | np.ndarray | None = None  # float32 [...]: ModelOpt's static activation scale

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.ndim == self.weight.ndim

    def validate(self) -> FP8Weight:
        """Check dtypes and that the scale is per channel or per tensor; returns self."""
        w, s = self.weight, self.weight_scale
        if w.dtype != FP8_DTYPE or s.dtype != np.float32:
            raise ValueError(f"FP8Weight dtypes must be float8_e4m3fn/float32, got {w.dtype}/{s.dtype}")
        if w.ndim < 2 or s.shape not in ((*w.shape[:-1], 1), tuple(w.shape[:-2])):
            raise ValueError(
                f"FP8Weight: weight_scale shape {s.shape} is neither per channel {(*w.shape[:-1], 1)} "
                f"nor per tensor {tuple(w.shape[:-2])} for weight {w.shape}"
            )
        if self.input_scale is not None and self.input_scale.shape != w.shape[:-2]:
            raise ValueError(f"FP8Weight: input_scale shape {self.input_scale.shape} must be {w.shape[:-2]}")
        return self

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        return dequantize_fp8(self, dtype)

    @classmethod
    def from_checkpoint(cls, weight, weight_scale, input_scale=None) -> FP8Weight:
        """From a checkpoint Linear's `weight`, `weight_scale` (and ModelOpt's `input_scale`).

        Scale shapes are normalised: one value per output channel -> `[..., out, 1]`, one per matrix
        (ModelOpt may store `[1]` or `[]`) -> `[...]`."""
        weight = np.asarray(weight)
        weight_scale = np.asarray(weight_scale, np.float32)
        lead = weight.shape[:-2]
        per_tensor = weight_scale.size == int(np.prod(lead))
        weight_scale = weight_scale.reshape(lead if per_tensor else (*weight.shape[:-1], 1))
        if input_scale is not None:
            input_scale = np.asarray(input_scale, np.float32).reshape(lead)
        return cls(weight, weight_scale, input_scale).validate()


def _check(w, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # overflow to inf is reported below
        w32 = np.asarray(w).astype(np.float32)
    if w32.ndim < 2 or w32.size == 0:
        raise ValueError(f"{name}: need a non-empty [..., out, in] array, got shape {w32.shape}")
    # After the cast: float64 values beyond fp32's range become inf here.
    if not np.isfinite(w32).all():
        raise ValueError(f"{name}: weight contains NaN or Inf (or values beyond float32's range)")
    return w32


def _scale_from_amax(amax: np.ndarray) -> np.ndarray:
    return np.maximum(amax / np.float32(E4M3_MAX), np.float32(MIN_SCALE)).astype(np.float32)


def _cast_e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)


def quantize_fp8_per_channel(w: np.ndarray) -> FP8Weight:
    """compressed-tensors FP8 (FP8_DYNAMIC's weights): `w [..., out, in]`, scale `[..., out, 1]`."""
    w = _check(w, "quantize_fp8_per_channel")
    scale = _scale_from_amax(np.abs(w).max(axis=-1, keepdims=True))
    return FP8Weight(_cast_e4m3(w / scale), scale).validate()


def quantize_fp8_per_tensor(w: np.ndarray, input_scale: np.ndarray | float | None = None) -> FP8Weight:
    """ModelOpt FP8: one scale per matrix (scalar for `[out, in]`, `[E]` for `[E, out, in]`).

    `input_scale` (calibrated elsewhere) is stored as float32 broadcast to the leading shape."""
    w = _check(w, "quantize_fp8_per_tensor")
    scale = _scale_from_amax(np.abs(w).max(axis=(-2, -1)))
    if input_scale is not None:
        input_scale = np.broadcast_to(np.asarray(input_scale, np.float32), w.shape[:-2]).copy()
    return FP8Weight(_cast_e4m3(w / scale[..., None, None]), scale, input_scale).validate()


def stack_fp8(weights: Sequence[FP8Weight]) -> FP8Weight:
    """Stack separately quantized matrices (e.g. one per expert) into one `[E, ...]` weight."""
    if not weights:
        raise ValueError("stack_fp8: nothing to stack")
    has_input = {w.input_scale is not None for w in weights}
    if len(has_input) != 1 or len({w.per_channel for w in weights}) != 1:
        raise ValueError("stack_fp8: weights mix per-channel/per-tensor scales or with/without input_scale")
    return FP8Weight(
        np.stack([np.asarray(w.weight) for w in weights]),
        np.stack([np.asarray(w.weight_scale) for w in weights]),
        np.stack([np.asarray(w.input_scale) for w in weights]) if has_input == {True} else None,
    ).validate()


def _broadcast_scale(scale, weight_shape, xp):
    # Per channel [..., out, 1] broadcasts as is; per tensor [...] (or a stored [1] for one
    # matrix) becomes [..., 1, 1].
    if scale.ndim == len(weight_shape):
        return scale
    return xp.reshape(scale, (*weight_shape[:-2], 1, 1))


def dequantize_fp8(weight: FP8Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Dense weight in `dtype` (jnp; jittable): fp32 product, rounded once to `dtype`."""
    w = jnp.asarray(weight.weight)
    scale = _broadcast_scale(jnp.asarray(weight.weight_scale, jnp.float32), w.shape, jnp)
    return (w.astype(jnp.float32) * scale).astype(dtype)


def dequantize_fp8_reference(weight: FP8Weight, dtype=np.float32) -> np.ndarray:
    """numpy reference for `dequantize_fp8`."""
    w = np.asarray(weight.weight)
    scale = _broadcast_scale(np.asarray(weight.weight_scale, np.float32), w.shape, np)
    return (w.astype(np.float32) * scale).astype(dtype)


def quantize_activations_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8_DYNAMIC's run-time activation quantization (jnp; jittable).

    `x [..., hidden]` -> (`x_fp8` e4m3 `[..., hidden]`, `scale` fp32 `[..., 1]`), one scale per token:
    `max(amax * fp32(1/448), MIN_SCALE)` (an all-zero token gets the floor scale and zero codes)."""
    xf = jnp.asarray(x).astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    # A multiply by fp32(1/448), spelled out: XLA rewrites division by a constant into this anyway,
    # and writing it so keeps any numpy re-implementation bit-identical (1 ulp apart otherwise).
    scale = jnp.maximum(amax * ACT_SCALE_FACTOR, MIN_SCALE)
    return jnp.clip(xf / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn), scale


def quantize_activations_static(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    """ModelOpt FP8's activation quantization with the calibrated `input_scale` (jnp; jittable).

    Values beyond ±448 · input_scale saturate to ±448 (the scale is fixed, so they can occur)."""
    xf = jnp.asarray(x).astype(jnp.float32)
    return jnp.clip(xf / jnp.asarray(input_scale, jnp.float32), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def dequantize_activations(x_fp8: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """Inverse of the activation quantizers: `f32(x_fp8) * scale` (per-token `[..., 1]` or scalar)."""
    return (jnp.asarray(x_fp8).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)
