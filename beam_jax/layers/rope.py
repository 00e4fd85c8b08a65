"""Position handling: RoPE (rotate-half, sliding layers) and SSMax query scaling (full layers)."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

SSMAX_BASE = 2048.0
SSMAX_EXPONENT = 0.1


def rope_cos_sin(positions: Int[Array, "*batch t"], head_dim: int, theta: float):
    """cos/sin in fp32, `[*batch, t, head_dim]`, the half-frequencies repeated (NeoX layout)."""
    # A host constant, like the reference's buffer: traced, XLA rewrites `1 / theta**e` into
    # `theta**-e`, an ulp off, and `pos * inv_freq` scales that ulp by the position.
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (float(theta) ** exponents.astype(np.float64)).astype(np.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: Float[Array, "*batch t heads d"], cos, sin) -> Float[Array, "*batch t heads d"]:
    """Rotate in fp32 (cos/sin are fp32), cast back to the input dtype once."""
    cos, sin = cos[..., None, :], sin[..., None, :]
    x32 = x.astype(jnp.float32)
    # Both products rounded to fp32 before the add, as the reference's separate kernels round them:
    # fused, XLA contracts `a*b + c*d` into an FMA, which flips ~3e-5 of the bf16 results.
    direct, rotated = jax.lax.optimization_barrier((x32 * cos, rotate_half(x32) * sin))
    return (direct + rotated).astype(x.dtype)


def ssmax_scale(positions: Int[Array, "*batch t"]) -> Float[Array, "*batch t"]:
    """Scalable-softmax query scale `(1 + (pos+1)/2048) ** 0.1`, as exp(0.1*log1p(.)) like the reference."""
    return jnp.exp(SSMAX_EXPONENT * jnp.log1p((positions.astype(jnp.float32) + 1.0) / SSMAX_BASE))


def apply_ssmax(q: Float[Array, "*batch t heads d"], positions) -> Float[Array, "*batch t heads d"]:
    return (q.astype(jnp.float32) * ssmax_scale(positions)[..., None, None]).astype(q.dtype)
