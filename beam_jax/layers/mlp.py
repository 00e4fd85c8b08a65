"""Dense SwiGLU MLP (Beam's first layers); the activation and product are evaluated in fp32."""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from beam_jax.layers.linear import Linear


def swiglu(gate: Float[Array, "... i"], up: Float[Array, "... i"]) -> Float[Array, "... i"]:
    gate32 = gate.astype(jnp.float32)
    # silu as torch's kernel computes it, `x / (1 + exp(-x))` (jax.nn.silu's `x * sigmoid(x)` is an
    # ulp off for a quarter of the inputs).
    return (gate32 / (1.0 + jnp.exp(-gate32)) * up.astype(jnp.float32)).astype(gate.dtype)


class DenseMLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, dtype):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype)

    def __call__(self, x: Float[Array, "... hidden"]) -> Float[Array, "... hidden"]:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
