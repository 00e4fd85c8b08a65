"""beam-jax: the Beam mixture-of-experts LLM in JAX.

`beam_jax.load(...)` gives a model with a jit-compiled forward; `beam_jax.model.forward` is the
pure function underneath.
"""

from beam_jax.api import Beam, load
from beam_jax.config import BeamConfig, preset
from beam_jax.model import ForwardOutput, forward, init_params, jit_forward

__all__ = ["Beam", "BeamConfig", "ForwardOutput", "forward", "init_params", "jit_forward", "load", "preset"]
