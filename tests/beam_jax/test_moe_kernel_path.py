"""The model's experts as the GPU runs them: `Experts.expert_weights()` hands the (packed) parameters
to the grouped-GEMM kernel (interpret mode here), which must agree with the layer's CPU reference
for every expert format."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from beam_jax.config import SPARSE, preset
from beam_jax.layers.moe import compute_experts, expert_weights
from beam_jax.model import graphdef, init_params
from beam_jax.quant.convert import quantize_params
from pallas_kernels.moe_gemm import moe_gemm


def routed_tokens(seed: int, tokens: int, config):
    """Random activations, routing weights and distinct expert ids per token."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.bfloat16)
    top_k = config.num_experts_per_tok
    ids = jnp.asarray(np.stack([rng.choice(config.num_experts, top_k, replace=False) for _ in range(tokens)]))
    return x, jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32), ids


@pytest.mark.parametrize("expert_format", ["bf16", "nvfp4", "fp8_channel", "fp8_tensor"])
def test_kernel_path_matches_layer_reference(expert_format):
    config = preset("beam-tiny")
    params = init_params(config, seed=3, dtype=jnp.bfloat16)
    if expert_format != "bf16":
        config, params = quantize_params(config, params, expert_format)
    model = nnx.merge(graphdef(config), params)
    layer = config.mlp_layer_types.index(SPARSE)
    experts = model.model.layers[layer].mlp.experts

    x, weights, ids = routed_tokens(0, 7, config)

    want = np.asarray(experts(x, weights, ids), np.float32)
    got = np.asarray(moe_gemm(x, weights, ids, *experts.expert_weights(), use_kernel=True, interpret=True), np.float32)
    # The layer's reference adds a token's experts with a rounding per addition; the kernel once.
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2.0**-8 * np.abs(want).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("expert_format", ["bf16", "nvfp4", pytest.param("fp8_channel", marks=pytest.mark.slow)])
def test_kernel_path_under_expert_parallelism(expert_format):
    """Each EP device's share of the experts (its slices of the parameter arrays, experts from
    `offset` on): the kernel path the GPU takes agrees with the layer's reference for that share."""
    config = preset("beam-tiny")
    params = init_params(config, seed=5, dtype=jnp.bfloat16)
    if expert_format != "bf16":
        config, params = quantize_params(config, params, expert_format)
    model = nnx.merge(graphdef(config), params)
    arrays = model.model.layers[config.mlp_layer_types.index(SPARSE)].mlp.experts.arrays()

    shares = 2
    x, weights, ids = routed_tokens(1, 9, config)
    size = config.num_experts // shares
    for offset in range(0, config.num_experts, size):
        local = {name: a[offset : offset + size] for name, a in arrays.items()}
        want = np.asarray(compute_experts(local, x, weights, ids, expert_format=expert_format, expert_offset=offset),
                          np.float32)
        got = moe_gemm(x, weights, ids, *expert_weights(local, expert_format), expert_offset=offset, use_kernel=True,
                       interpret=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=8 * 2.0**-8 * np.abs(want).max())
        assert np.abs(want).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 6])
def test_gpu_forward_routes_as_the_reference(monkeypatch, tokens):
    """On a GPU a forward of up to `routing.FUSED_MAX_TOKENS` tokens routes with the fused kernel (the default
    there): two calls of the compiled forward select as the reference routing in every sparse layer."""
    from beam_jax.layers import moe as moe_module
    from beam_jax.model import forward
    from pallas_kernels import routing as rt

    config = preset("beam-tiny")
    params = init_params(config, seed=6, dtype=jnp.float32)
    prompt = np.array([17, 230, 5, 99, 3, 42, 7, 64, 120, 11, 8, 150])
    steps = [(jnp.asarray(prompt[None, s * tokens:(s + 1) * tokens]),
              jnp.arange(s * tokens, (s + 1) * tokens)[None]) for s in range(2)]
    # Each a function of its own: jit's trace cache keys on the function (a second `jax.jit(forward)` would reuse the
    # kernel's trace, the patch ignored).
    kernel_forward = jax.jit(lambda *args, **kwargs: forward(*args, **kwargs),
                             static_argnames=("config", "return_routing"))
    got = [kernel_forward(params, t, p, config=config, return_routing=True).expert_indices for t, p in steps]
    monkeypatch.setattr(moe_module, "route", functools.partial(rt.routing, use_kernel=False))
    reference_forward = jax.jit(lambda *args, **kwargs: forward(*args, **kwargs),
                                static_argnames=("config", "return_routing"))
    for (t, p), g in zip(steps, got):
        want = reference_forward(params, t, p, config=config, return_routing=True).expert_indices
        assert len(g) == len(want) == config.mlp_layer_types.count(SPARSE)
        for layer_got, layer_want in zip(g, want):
            np.testing.assert_array_equal(np.asarray(layer_got), np.asarray(layer_want))


def paged_one_token_steps(params, config, tokens=(17, 230, 5)):
    """One sequence's paged one-token steps (a fresh batch each, as the engine makes them; attention on the plain-jnp
    path), each `forward`'s output with its routing."""
    from beam_jax.model import forward
    from beam_jax.paged_cache import PagedBatch, PagedKVCache
    from serving.kv_cache import KVPool
    from serving.runner import layer_groups

    # A function of its own each time: jit's trace cache keys on the function, and a caller that patches the model
    # (the reference routing) between two calls must get a new trace.
    paged_forward = jax.jit(lambda *args, **kwargs: forward(*args, **kwargs),
                            static_argnames=("config", "return_routing"))
    pool = KVPool.from_config(config, 16, page_tokens=16)
    groups = range(len(pool.groups))
    cache = PagedKVCache.create(config, 16, 16, layer_groups(pool, config.num_hidden_layers), jnp.float32,
                                use_kernel=False)
    outs = []
    for position, token in enumerate(tokens):
        pool.allocate(0, position + 1)
        slots = tuple(jnp.array([pool.page_table(0, g)[position // 16] * 16 + position % 16], jnp.int32)
                      for g in groups)
        batch = PagedBatch(query_start=jnp.array([0, 1], jnp.int32), seq_lens=jnp.array([position + 1], jnp.int32),
                           page_tables=tuple(jnp.asarray(pool.page_tables([0], g, max_pages=4)) for g in groups),
                           slot_mappings=slots)
        outs.append(paged_forward(params, jnp.array([[token]]), jnp.array([[position]]), cache.with_batch(batch),
                                  config=config, return_routing=True))
        cache = outs[-1].cache.with_batch(None)
    return outs


@pytest.mark.gpu
def test_gpu_paged_forward_routes_with_the_passed_state(monkeypatch):
    """On a GPU a paged one-token step routes with the fused kernel in every sparse layer, the kernel's state
    passed from layer to layer (`PagedBatch.routing_state`): three steps select as the reference routing, and
    each step's state comes back `UNWRITTEN` (attention on the plain-jnp path: only the routing is under test)."""
    from beam_jax.layers import moe as moe_module
    from pallas_kernels import routing as rt

    config = preset("beam-tiny")
    params = init_params(config, seed=6, dtype=jnp.float32)
    got = paged_one_token_steps(params, config)
    monkeypatch.setattr(moe_module, "route", functools.partial(rt.routing, use_kernel=False))
    for g, w in zip(got, paged_one_token_steps(params, config)):
        np.testing.assert_array_equal(np.asarray(g.cache.batch.routing_state), rt.UNWRITTEN)
        assert len(g.expert_indices) == config.mlp_layer_types.count(SPARSE)
        for layer_got, layer_want in zip(g.expert_indices, w.expert_indices):
            np.testing.assert_array_equal(np.asarray(layer_got), np.asarray(layer_want))


def test_mosaic_nvfp4_layer_takes_the_models_experts():
    """The model's NVFP4 experts (`Experts.expert_weights()`) repacked into the Mosaic GPU kernel's
    layouts (`KernelNvfp4`, as a load step would) give the layer's reference output; the GEMM is
    emulated in plain jnp on the CPU (`pallas_kernels/nvfp4_mgpu.py` needs a Hopper GPU). beam-tiny's
    expert width (32) is below the kernel's K step (64): it is refused, and a width of 64 is used."""
    import dataclasses

    from pallas_kernels import nvfp4_mgpu as nm
    from pallas_kernels import nvfp4_moe_mgpu as nmm

    def nvfp4_experts(config):
        config, params = quantize_params(config, init_params(config, seed=4, dtype=jnp.bfloat16), "nvfp4")
        model = nnx.merge(graphdef(config), params)
        return config, model.model.layers[config.mlp_layer_types.index(SPARSE)].mlp.experts

    _, tiny = nvfp4_experts(preset("beam-tiny"))
    with pytest.raises(ValueError, match="multiple of 64"):
        nmm.KernelNvfp4.from_expert_weights(tiny.expert_weights()[2], tile_k=64)
    config, experts = nvfp4_experts(dataclasses.replace(preset("beam-tiny"), moe_intermediate_size=64))
    gate, up, down = experts.expert_weights()
    kernel_weights = (nmm.KernelNvfp4.from_expert_weights(gate, up, tile_k=64),
                      nmm.KernelNvfp4.from_expert_weights(down, tile_k=64))

    x, weights, ids = routed_tokens(2, 6, config)
    want = np.asarray(experts(x, weights, ids), np.float32)
    got = np.asarray(nmm.moe_nvfp4(x, weights, ids, *kernel_weights, matmul=nm.grouped_matmul_emulated), np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2.0**-8 * np.abs(want).max())
    assert np.abs(want).max() > 0


def test_bf16_prefill_kernel_takes_only_fitting_experts():
    from pallas_kernels import bf16_moe_mgpu as bm

    assert bm.fits(5120, 320)  # Beam's TP8 share
    assert not bm.fits(5120, 32)  # beam-tiny's experts: below one K step of the down GEMM
    assert not bm.fits(5120 + 64, 320)  # hidden not a multiple of the down GEMM's 256-row tiles


@pytest.mark.gpu
def test_gpu_bf16_prefill_takes_the_mosaic_layer():
    """On an H200, bf16 experts at prefill size go through `bf16_moe_mgpu.moe_bf16` (its row-gather
    kernel shows in the compiled program) and agree with the layer's reference, also for one device's
    share of the experts."""
    from beam_jax.layers.moe import experts_reference
    from pallas_kernels import bf16_moe_mgpu as bm

    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    experts, hidden, intermediate, top_k, tokens = 16, 256, 320, 4, bm.PREFILL_MIN_TOKENS  # tiles that fit
    shapes = {"gate_up_proj": (experts, 2 * intermediate, hidden), "down_proj": (experts, hidden, intermediate)}
    arrays = {name: jnp.asarray(rng.standard_normal(shape) / 16, jnp.bfloat16) for name, shape in shapes.items()}
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k], jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
    for offset, share in ((None, arrays), (8, {name: a[8:] for name, a in arrays.items()})):
        run = jax.jit(functools.partial(compute_experts, expert_format="bf16", expert_offset=offset))
        assert "_gather_kernel" in run.lower(share, x, weights, ids).as_text()
        got = np.asarray(run(share, x, weights, ids), np.float32)
        want = np.asarray(experts_reference(x, weights, ids, share["gate_up_proj"], share["down_proj"], offset or 0),
                          np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2.0**-8 * np.abs(want).max(),
                                   err_msg=f"seed {seed}, offset {offset}")
