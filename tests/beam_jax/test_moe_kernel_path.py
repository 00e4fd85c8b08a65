"""The model's experts as the GPU runs them: `Experts.expert_weights()` hands the (packed) parameters
to the grouped-GEMM kernel (interpret mode here), which must agree with the layer's CPU reference
for every expert format."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from beam_jax.config import SPARSE, preset
from beam_jax.model import graphdef, init_params
from beam_jax.quant.convert import quantize_params
from pallas_kernels.moe_gemm import moe_gemm


@pytest.mark.parametrize("expert_format", ["bf16", "nvfp4", "fp8_channel", "fp8_tensor"])
def test_kernel_path_matches_layer_reference(expert_format):
    config = preset("beam-tiny")
    params = init_params(config, seed=3, dtype=jnp.bfloat16)
    if expert_format != "bf16":
        config, params = quantize_params(config, params, expert_format)
    model = nnx.merge(graphdef(config), params)
    layer = config.mlp_layer_types.index(SPARSE)
    experts = model.model.layers[layer].mlp.experts

    rng = np.random.default_rng(0)
    tokens, top_k = 7, config.num_experts_per_tok
    x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(config.num_experts, top_k, replace=False) for _ in range(tokens)]))
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)

    want = np.asarray(experts(x, weights, ids), np.float32)
    got = np.asarray(moe_gemm(x, weights, ids, *experts.expert_weights(), use_kernel=True, interpret=True), np.float32)
    # The layer's reference adds a token's experts with a rounding per addition; the kernel once.
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2.0**-8 * np.abs(want).max())
    assert np.abs(want).max() > 0
