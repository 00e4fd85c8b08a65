"""fp32 random parameters with random norms and biases too (the reference initialises those to 1
and 0, which would hide the features that use them)."""

import jax.numpy as jnp
import numpy as np

from beam_jax.config import BeamConfig
from beam_jax.model import Params, flat_params, init_params, params_from_flat


def randomized_fp32_params(config: BeamConfig, seed: int = 0) -> Params:
    rng = np.random.default_rng(seed)
    initial = init_params(config, seed=1, dtype=jnp.float32)
    flat = {name: np.asarray(value) for name, value in flat_params(initial).items()}
    for name, value in flat.items():
        if name.endswith("norm.weight"):
            flat[name] = (1 + 0.3 * rng.standard_normal(value.shape)).astype(value.dtype)
        elif name.endswith("gate_bias"):
            flat[name] = (0.5 * rng.standard_normal(value.shape)).astype(value.dtype)
        elif name.endswith("e_score_correction_bias"):
            flat[name] = (0.05 * rng.standard_normal(value.shape)).astype(value.dtype)
    return params_from_flat(config, {name: jnp.asarray(value) for name, value in flat.items()})
