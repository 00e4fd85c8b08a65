"""Linear and embedding layers with HF's weight layout (`weight` is `[out, in]`).

Modules in this package only declare parameter shapes and dtypes (they are built under
`nnx.eval_shape`); `beam_jax.model.init_params` draws random values, checkpoints load real ones."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int


def matmul_precision(dtype) -> jax.lax.Precision:
    """fp32 weights get true fp32 products (no TF32 on GPU): fp32 runs are parity runs."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def linear(x: Float[Array, "... i"], weight: Float[Array, "o i"], bias=None) -> Float[Array, "... o"]:
    y = jnp.einsum("...i,oi->...o", x, weight, precision=matmul_precision(weight.dtype))
    return y if bias is None else y + bias


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, dtype, bias: bool = False):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: Float[Array, "... i"]) -> Float[Array, "... o"]:
        return linear(x, self.weight[...], None if self.bias is None else self.bias[...])


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), dtype))

    def __call__(self, tokens: Int[Array, "..."]) -> Float[Array, "... hidden"]:
        return jnp.take(self.weight[...], tokens, axis=0)
