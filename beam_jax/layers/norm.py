"""RMSNorm as Beam uses it: fp32 statistics, plain `w * x` (weight initialised to 1), rounded once."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


def rms_norm(x: Float[Array, "... d"], weight: Float[Array, " d"], eps: float) -> Float[Array, "... d"]:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        return rms_norm(x, self.weight[...], self.eps)
