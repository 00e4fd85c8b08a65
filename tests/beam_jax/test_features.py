"""Mutation tests: each Beam feature, broken on purpose, must make the parity check fail.

One checkpoint written by the PyTorch reference (`PARITY_CONFIGS["odd-window8"]`: GQA 6/2, window 8,
full layers 5 and 6, dense layers 0-2 and sparse layers 3-6 with 3 routing groups of 4 experts)
and one 40-token prompt. The unmutated model must match the reference's fp32 logits (the parity
tolerance, 1e-4); each mutation, patched at the module attribute where the model looks it up,
must push the logits' relative error past that tolerance with a wide margin.

Some mutations cannot change the logits at all, so no output comparison can catch them; they are
pinned by the unit tests in test_layers.py instead, and `test_parity_is_blind_to` records why:
- the MoE output goes through `post_feedforward_layernorm`, which removes any per-token scale:
  dropping `routed_scaling_factor` or the top-k normalisation changes nothing but the eps term;
- with the residual coefficients 1/sqrt(n) and sqrt((n-1)/n) the stream after the n-th addition
  is exactly (plain-sum stream)/sqrt(n), and every reader of the stream normalises it first;
- SSMax with `pos` instead of `pos+1` moves the query scale by at most 5e-5 (relative).

Our logits come from a fresh trace every time: `jax.jit` caches traces per Python function (a new
`jax.jit(forward)` object reuses the old trace of `forward`, patches ignored), so the jitted run
wraps `forward` in a new function object; the mutated runs go op by op (`jax.disable_jit`), which
traces nothing and costs about a second instead of ~7 s of XLA compilation per mutation.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers", minversion="5.23")
pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import beam_jax.layers.attention as attention_module  # noqa: E402
import beam_jax.layers.decoder as decoder_module  # noqa: E402
import beam_jax.layers.moe as moe_module  # noqa: E402
import beam_jax.layers.norm as norm_module  # noqa: E402
import beam_jax.model  # noqa: E402
from beam_jax import compare  # noqa: E402
from beam_jax.checkpoint import load_checkpoint  # noqa: E402
from beam_jax.config import SLIDING  # noqa: E402
from beam_jax.layers.decoder import DecoderLayer  # noqa: E402
from beam_jax.layers.norm import RMSNorm  # noqa: E402
from beam_jax.layers.rope import apply_rope, rope_cos_sin  # noqa: E402
from beam_jax.model import flat_params, params_from_flat  # noqa: E402
from tests.beam_jax.reference_models import PARITY_CONFIGS, write_reference_checkpoint  # noqa: E402

pytestmark = pytest.mark.reference

CONFIG_NAME = "odd-window8"
PROMPT_LENGTH = 40
PARITY_TOLERANCE = 1e-4  # test_parity_reference's fp32 logits tolerance
MUTATION_THRESHOLD = 1e-3  # a mutation must miss the reference by 10x the parity tolerance


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(config, fp32 params, prompt, the reference's fp32 logits `[t, vocab]`)."""
    directory = write_reference_checkpoint(PARITY_CONFIGS[CONFIG_NAME], tmp_path_factory.mktemp(CONFIG_NAME), seed=3)
    config, params = load_checkpoint(directory, dtype=jnp.float32, progress=False)
    prompt = np.random.default_rng(2024).integers(0, config.vocab_size, size=PROMPT_LENGTH)
    reference = compare.run_reference(compare.load_reference(str(directory), "float32"), prompt).logits
    return config, params, prompt, reference


def _inputs(prompt):
    tokens = jnp.asarray(prompt, jnp.int32)[None]
    return tokens, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]


def jit_logits(params, config, prompt) -> np.ndarray:
    """A fresh trace under `jax.jit`: a new function object, so no cached trace is reused."""

    def fresh_forward(params, tokens, positions, config):
        return beam_jax.model.forward(params, tokens, positions, config=config)

    fn = jax.jit(fresh_forward, static_argnames=("config",))
    return np.asarray(fn(params, *_inputs(prompt), config=config).logits[0])


def eager_logits(params, config, prompt) -> np.ndarray:
    with jax.disable_jit():
        return np.asarray(beam_jax.model.forward(params, *_inputs(prompt), config=config).logits[0])


def test_unmutated_model_matches_the_reference(setup):
    config, params, prompt, reference = setup
    jitted = compare.relative_error(jit_logits(params, config, prompt), reference)
    assert jitted <= PARITY_TOLERANCE, f"jitted logits rel err {jitted:.3e}"
    # The op-by-op path the mutations run is the same model.
    eager = compare.relative_error(eager_logits(params, config, prompt), reference)
    assert eager <= PARITY_TOLERANCE, f"op-by-op logits rel err {eager:.3e}"


# ---- mutations: each takes (monkeypatch, config, params) and returns the params to run --------
def _ssmax_position_offset(mp, config, params):
    original = attention_module.apply_ssmax
    mp.setattr(attention_module, "apply_ssmax", lambda q, positions: original(q, positions - 1))
    return params


def _ssmax_removed(mp, config, params):
    mp.setattr(attention_module, "apply_ssmax", lambda q, positions: q)
    return params


def _rope_also_on_full_layers(mp, config, params):
    """Full layers rotate q (here, before SSMax) and their keys (in `attend`, which follows)."""
    original_ssmax, original_attend = attention_module.apply_ssmax, attention_module.attend
    pending = []  # set by a full layer's SSMax, consumed by the same layer's attend
    theta = config.rope_theta(SLIDING)

    def ssmax(q, positions):
        cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
        pending.append((cos, sin))
        return original_ssmax(apply_rope(q, cos, sin), positions)

    def attend(q, k, v, mask):
        if pending:  # without a cache the keys sit at the queries' positions
            k = apply_rope(k, *pending.pop())
        return original_attend(q, k, v, mask)

    mp.setattr(attention_module, "apply_ssmax", ssmax)
    mp.setattr(attention_module, "attend", attend)
    return params


def _rope_removed_from_sliding_layers(mp, config, params):
    mp.setattr(attention_module, "apply_rope", lambda x, cos, sin: x)
    return params


def _rope_theta_changed(mp, config, params):
    original = attention_module.rope_cos_sin
    mp.setattr(attention_module, "rope_cos_sin", lambda positions, dim, theta: original(positions, dim, 500000.0))
    return params


def _qk_norm_removed(mp, config, params):
    original = norm_module.rms_norm

    def rms_norm(x, *args, **kwargs):  # q/k norms are the only ones over [batch, t, heads, head_dim]
        return x if x.ndim == 4 else original(x, *args, **kwargs)

    mp.setattr(norm_module, "rms_norm", rms_norm)
    return params


def _replace_params(config, params, updates):
    """Params with each entry named `...{suffix}` for a suffix in `updates` replaced by fn(value)."""
    flat = dict(flat_params(params))
    replaced = 0
    for name, value in list(flat.items()):
        for suffix, fn in updates.items():
            if name.endswith(suffix):
                flat[name], replaced = fn(value), replaced + 1
    assert replaced == len(updates) * config.num_hidden_layers
    return params_from_flat(config, flat)


# The gate is a parameter: "ignored" and "removed" are the parameters that compute exactly that.
def _gate_bias_ignored(mp, config, params):
    return _replace_params(config, params, {"self_attn.gate_bias": jnp.zeros_like})


def _gate_removed(mp, config, params):
    # sigmoid(0 * h + 100) is exactly 1 in fp32: the attention output passes through ungated.
    return _replace_params(
        config,
        params,
        {"self_attn.gate_proj.weight": jnp.zeros_like, "self_attn.gate_bias": lambda b: jnp.full_like(b, 100.0)},
    )


def _plain_residual_sum(mp, config, params):
    mp.setattr(decoder_module, "depth_scaled_residual", lambda update, residual, add_index: update + residual)
    return params


def _residual_coefficients_swapped(mp, config, params):
    original = decoder_module.depth_scaled_residual
    mp.setattr(decoder_module, "depth_scaled_residual", lambda update, residual, n: original(residual, update, n))
    return params


def _residual_add_index_off_by_one(mp, config, params):
    original = decoder_module.depth_scaled_residual
    mp.setattr(decoder_module, "depth_scaled_residual", lambda update, residual, n: original(update, residual, n + 1))
    return params


def _sandwich_post_norms_removed(mp, config, params):
    post_norms = set()  # ids of the post-attention / post-feedforward norms of the layer running now
    original_layer_call, original_norm_call = DecoderLayer.__call__, RMSNorm.__call__

    def layer_call(self, *args, **kwargs):
        post_norms.clear()
        post_norms.update({id(self.post_attention_layernorm), id(self.post_feedforward_layernorm)})
        return original_layer_call(self, *args, **kwargs)

    def norm_call(self, x):
        return x if id(self) in post_norms else original_norm_call(self, x)

    mp.setattr(DecoderLayer, "__call__", layer_call)
    mp.setattr(RMSNorm, "__call__", norm_call)
    return params


def _window_off_by_one(mp, config, params):
    original = attention_module.visibility_mask
    mp.setattr(
        attention_module,
        "visibility_mask",
        lambda q, k, window: original(q, k, None if window is None else window + 1),  # q - k <= window
    )
    return params


def _patch_route(mp, change):
    """`change(correction_bias, kwargs)` returns the bias and keyword arguments `route` runs with."""
    original = moe_module.route

    def route(x, router_weight, correction_bias, **kwargs):
        correction_bias, kwargs = change(correction_bias, dict(kwargs))
        return original(x, router_weight, correction_bias, **kwargs)

    mp.setattr(moe_module, "route", route)


def _correction_bias_ignored(mp, config, params):
    _patch_route(mp, lambda bias, kwargs: (jnp.zeros_like(bias), kwargs))
    return params


def _group_limit_removed(mp, config, params):
    _patch_route(mp, lambda bias, kwargs: (bias, kwargs | {"groups_kept": kwargs["num_groups"]}))
    return params


def _correction_bias_also_in_weights(mp, config, params):
    original = moe_module.route

    def route(x, router_weight, correction_bias, **kwargs):
        _, indices = original(x, router_weight, correction_bias, **kwargs)
        logits = jnp.einsum("th,eh->te", x, router_weight, precision=jax.lax.Precision.HIGHEST)
        weights = jnp.take_along_axis(jax.nn.sigmoid(logits) + correction_bias, indices, axis=1)
        return weights / (weights.sum(-1, keepdims=True) + 1e-20), indices

    mp.setattr(moe_module, "route", route)
    return params


def _weights_not_normalised(mp, config, params):
    _patch_route(mp, lambda bias, kwargs: (bias, kwargs | {"normalize": False}))
    return params


def _routed_scaling_dropped(mp, config, params):
    original = moe_module.experts_reference
    scale = config.routed_scaling_factor
    assert scale == 2.5
    mp.setattr(moe_module, "experts_reference", lambda *args, **kwargs: original(*args, **kwargs) / scale)
    return params


def _softcap_removed(mp, config, params):
    original = beam_jax.model.graphdef
    mp.setattr(beam_jax.model, "graphdef", lambda config: original(config.replace(final_logit_softcapping=None)))
    return params


# name -> (mutation, the relative error it must exceed)
CAUGHT = {
    # At 40 tokens SSMax scales q by at most 1.002 (0.2%): caught at 4x the tolerance, not 10x.
    "ssmax_removed": (_ssmax_removed, 2 * PARITY_TOLERANCE),
    "rope_also_on_full_layers": (_rope_also_on_full_layers, MUTATION_THRESHOLD),
    "rope_removed_from_sliding_layers": (_rope_removed_from_sliding_layers, MUTATION_THRESHOLD),
    "rope_theta_changed": (_rope_theta_changed, MUTATION_THRESHOLD),
    "qk_norm_removed": (_qk_norm_removed, MUTATION_THRESHOLD),
    "gate_bias_ignored": (_gate_bias_ignored, MUTATION_THRESHOLD),
    "gate_removed": (_gate_removed, MUTATION_THRESHOLD),
    "residual_coefficients_swapped": (_residual_coefficients_swapped, MUTATION_THRESHOLD),
    "residual_add_index_off_by_one": (_residual_add_index_off_by_one, MUTATION_THRESHOLD),
    "sandwich_post_norms_removed": (_sandwich_post_norms_removed, MUTATION_THRESHOLD),
    "window_off_by_one": (_window_off_by_one, MUTATION_THRESHOLD),
    "correction_bias_ignored_in_selection": (_correction_bias_ignored, MUTATION_THRESHOLD),
    "correction_bias_also_in_weights": (_correction_bias_also_in_weights, MUTATION_THRESHOLD),
    "group_limit_removed": (_group_limit_removed, MUTATION_THRESHOLD),
    "softcap_removed": (_softcap_removed, MUTATION_THRESHOLD),
}

# Mutations that leave the logits unchanged (see the module docstring); tested in test_layers.py.
BLIND = {
    "ssmax_position_offset": (_ssmax_position_offset, attention_module, "apply_ssmax"),
    "plain_residual_sum": (_plain_residual_sum, decoder_module, "depth_scaled_residual"),
    "weights_not_normalised": (_weights_not_normalised, moe_module, "route"),
    "routed_scaling_dropped": (_routed_scaling_dropped, moe_module, "experts_reference"),
}


@pytest.mark.parametrize("name", list(CAUGHT))
def test_mutation_breaks_parity(setup, monkeypatch, name):
    config, params, prompt, reference = setup
    mutate, threshold = CAUGHT[name]
    error = compare.relative_error(eager_logits(mutate(monkeypatch, config, params), config, prompt), reference)
    assert error > threshold, f"{name}: logits rel err {error:.3e} vs the reference"


@pytest.mark.parametrize("name", list(BLIND))
def test_parity_is_blind_to(setup, monkeypatch, name):
    """The mutation runs (its patch is called) and yet the logits stay within the tolerance."""
    config, params, prompt, reference = setup
    mutate, module, attribute = BLIND[name]
    mutated_params = mutate(monkeypatch, config, params)
    calls = []
    patched = getattr(module, attribute)
    monkeypatch.setattr(module, attribute, lambda *args, **kwargs: calls.append(1) or patched(*args, **kwargs))
    error = compare.relative_error(eager_logits(mutated_params, config, prompt), reference)
    assert calls, f"{name}: the patched {attribute} never ran"
    assert error <= PARITY_TOLERANCE, f"{name}: logits rel err {error:.3e}: parity now sees it; move it to CAUGHT"
