"""The DFlash drafter (beam_jax/drafter.py): vLLM's checkpoint names and shapes, config.json round trip,
attention that is bidirectional inside the block but sees only the past context within the window,
the block-local convolution against a numpy reference, proposals (greedy = the selector's best walk,
sampling stays on the candidates, jit), checkpoint save / load with its error reports, and the drafter
as the memory planner counts it (KV bytes per token, window, cache group, weights)."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from beam_jax import drafter as D
from beam_jax.checkpoint import CheckpointError
from beam_jax.checkpoint.safetensors_io import load_safetensors, save_safetensors
from beam_jax.config import SLIDING, preset
from beam_jax.memory_plan import (
    DFLASH2,
    DrafterSpec,
    dflash2_matrix_params,
    drafter_cache_layers,
    kv_bytes_per_token_per_layer,
)
from beam_jax.model import flat_params
from serving.kv_cache import cache_groups, first_visible_page

CONFIG = D.drafter_tiny()
BATCH, CONTEXT = 6, 40  # context rows per sequence (the tiny window is 24)
forward_jit = jax.jit(D.draft_forward, static_argnames="config")
context_jit = jax.jit(D.context_kv, static_argnames="config")


def randomized(config: D.DrafterConfig, seed: int = 0):
    """fp32 parameters at a scale where every path visibly moves the output (random norms too)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, spec in D.abstract_flat(config).items():
        if name.endswith("norm.weight"):
            value = 1 + 0.3 * rng.standard_normal(spec.shape)
        else:
            value = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])
        flat[name] = jnp.asarray(value, jnp.float32)
    return D.params_from_flat(config, flat)


def target_weights(config: D.DrafterConfig, seed: int = 1):
    rng = np.random.default_rng(seed)
    shape = (config.vocab_size, config.hidden_size)
    return jnp.asarray(rng.standard_normal(shape), jnp.float32), jnp.asarray(rng.standard_normal(shape) / 8, jnp.float32)


def test_parameters_carry_vllms_checkpoint_names():
    flat = {name: tuple(spec.shape) for name, spec in D.abstract_flat(CONFIG).items()}
    h, groups = CONFIG.hidden_size, CONFIG.hidden_size // CONFIG.conv_group_size
    expected = {
        "fc.weight": (h, 3 * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "layers.1.input_layernorm.weight": (h,),
        "layers.1.post_attention_layernorm.weight": (h,),
        "layers.1.self_attn.q_proj.weight": (4 * 16, h),
        "layers.1.self_attn.k_proj.weight": (2 * 16, h),
        "layers.1.self_attn.v_proj.weight": (2 * 16, h),
        "layers.1.self_attn.o_proj.weight": (h, 4 * 16),
        "layers.1.self_attn.q_norm.weight": (16,),
        "layers.1.self_attn.k_norm.weight": (16,),
        "layers.1.mlp.gate_proj.weight": (128, h),
        "layers.1.mlp.up_proj.weight": (128, h),
        "layers.1.mlp.down_proj.weight": (h, 128),
        "layers.1.attention_conv.base_kernel": (2, 2, h),
        "layers.1.attention_conv.kernel_projection.weight": (2 * 2 * groups, h),
        "layers.1.mlp_conv.base_kernel": (2, 2, h),
        "layers.1.mlp_conv.kernel_projection.weight": (2 * 2 * groups, h),
        "candidate_selector.predecessor_codebook": (CONFIG.vocab_size, 8),
        "candidate_selector.successor_codebook": (CONFIG.vocab_size, 8),
        "candidate_selector.hidden_projection.weight": (8, h),
    }
    assert {name: flat[name] for name in expected} == expected
    assert len(flat) == 3 + 2 * 15 + 3  # fc and two norms; 15 per layer; the selector
    assert not any("embed_tokens" in n or "lm_head" in n for n in flat)  # the target's, not the drafter's
    plain = D.abstract_flat(CONFIG.replace(conv_kernel_size=None, selector_rank=None, selector_top_k=None))
    assert not any("conv" in n or "selector" in n for n in plain)


def test_config_json_round_trip_and_vllm_spellings():
    data = CONFIG.to_hf_dict()
    assert data["architectures"] == ["DFlash2BeamDraftModel"] and data["is_causal"] is False
    assert data["dflash_config"] == {
        "target_layer_ids": [1, 3, 4], "mask_token_id": 8, "conv_kernel_size": 2, "conv_group_size": 16,
        "selector_rank": 8, "selector_top_k": 4, "final_logit_softcapping": 30.0,
    }
    assert D.DrafterConfig.from_hf_dict(json.loads(json.dumps(data))) == CONFIG
    # Legacy rope_theta, a top-level mask token, the window in dflash_config, no DFlash2 extras.
    legacy = {k: v for k, v in data.items() if k not in ("rope_parameters", "dflash_config", "sliding_window")}
    legacy |= {"rope_theta": 1e6, "mask_token_id": 9, "dflash_config": {"target_layer_ids": [2], "swa_window_size": 64}}
    plain = D.DrafterConfig.from_hf_dict(legacy)
    assert (plain.rope_theta, plain.mask_token_id, plain.sliding_window, plain.target_layer_ids) == (1e6, 9, 64, (2,))
    assert not plain.has_convs and not plain.has_selector and plain.final_logit_softcapping is None
    assert plain.to_hf_dict()["architectures"] == ["DFlashDraftModel"]
    with pytest.raises(ValueError, match="causal"):
        D.DrafterConfig.from_hf_dict(data | {"is_causal": True})
    with pytest.raises(ValueError, match="conv_group_size"):
        CONFIG.replace(conv_group_size=24)


def test_block_is_bidirectional_and_context_causal_within_the_window():
    """Rows of one batch, each a variant of row 0: what changes the drafts' outputs and what must not."""
    params, (embed, head) = randomized(CONFIG), target_weights(CONFIG)
    rng = np.random.default_rng(2)
    anchor = 36  # block positions 36..39; the window (24) reaches back to position 13
    hidden = np.repeat(rng.standard_normal((1, CONTEXT, 3 * CONFIG.hidden_size)), BATCH, 0).astype(np.float32)
    positions = np.repeat(np.arange(CONTEXT)[None], BATCH, 0)
    positions[:, anchor:] = -1  # rows past the context: padding
    tokens = np.repeat(np.array([[100, 8, 8, 8]]), BATCH, 0)
    tokens[1, 3] = 200  # 1: a later block token
    hidden[2, 37] += 1.0  # 2: a padding row's content
    positions[3, 38] = 38  # 3: a stale row at a block position (at or after the anchor)
    hidden[3, 38] += 1.0
    hidden[4, 5] += 1.0  # 4: a context token outside every query's window (39 - 5 >= 24, 36 - 5 >= 24)
    hidden[5, 20] += 1.0  # 5: a context token inside the window
    context = context_jit(params, jnp.asarray(hidden), jnp.asarray(positions), config=CONFIG)
    block_positions = jnp.asarray(anchor + np.arange(4)[None].repeat(BATCH, 0))
    out = forward_jit(
        params, jnp.asarray(tokens), block_positions, context, embed_weight=embed, lm_head_weight=head, config=CONFIG
    )
    assert out.logits.shape == (BATCH, 3, CONFIG.vocab_size) and out.hidden.shape == (BATCH, 3, CONFIG.hidden_size)
    logits = np.asarray(out.logits)
    moved = lambda row: np.abs(logits[row] - logits[0]).max(axis=-1)
    assert np.all(moved(1)[:2] > 1e-3)  # not causal: the last block token moves the earlier drafts
    for row in (2, 3, 4):
        np.testing.assert_array_equal(logits[row], logits[0])
    assert np.all(moved(5) > 1e-3)
    assert np.all(np.abs(logits) <= CONFIG.final_logit_softcapping)


def test_grouped_conv_matches_numpy_and_stays_inside_the_block():
    rng = np.random.default_rng(3)
    batch, t, hidden, taps, groups = 2, 5, 8, 3, 2
    x, base = rng.standard_normal((batch, t, hidden)), rng.standard_normal((taps, hidden))
    delta = rng.standard_normal((batch, t, taps, groups))
    expected = np.zeros_like(x)
    for b in range(batch):
        for i in range(t):
            for tap in range(min(taps, i + 1)):
                expected[b, i] += (base[tap] + np.repeat(delta[b, i, tap], hidden // groups)) * x[b, i - tap]
    as_f32 = lambda a: jnp.asarray(a, jnp.float32)
    got = D.grouped_conv(as_f32(x), as_f32(delta), as_f32(base))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    # A block shorter than the kernel reads nothing before its start.
    short = D.grouped_conv(as_f32(x[:, :1]), as_f32(delta[:, :1]), as_f32(base))
    np.testing.assert_allclose(np.asarray(short), expected[:, :1], rtol=1e-5, atol=1e-5)


def test_proposals_greedy_sampled_and_jitted():
    params, (embed, head) = randomized(CONFIG, seed=4), target_weights(CONFIG, seed=5)
    rng = np.random.default_rng(6)
    positions = np.repeat(np.arange(CONTEXT)[None], BATCH, 0)
    hidden = rng.standard_normal((BATCH, CONTEXT, 3 * CONFIG.hidden_size)).astype(np.float32)
    context = context_jit(params, jnp.asarray(hidden), jnp.asarray(positions), config=CONFIG)
    anchors, anchor_positions = jnp.asarray(rng.integers(16, 8000, BATCH)), jnp.full(BATCH, CONTEXT)
    weights = {"embed_weight": embed, "lm_head_weight": head, "config": CONFIG}
    n, k = CONFIG.num_drafts, CONFIG.selector_top_k

    greedy = D.jit_propose(params, anchors, anchor_positions, context, **weights)
    assert greedy.tokens.shape == (BATCH, n) and greedy.logits.shape == (BATCH, n, CONFIG.vocab_size)
    finite = np.isfinite(np.asarray(greedy.logits))
    assert np.all(finite.sum(-1) == k)  # q lives on the selector's top-k candidates
    # The drafter's own top-k at each position are the candidates.
    top = np.argsort(-np.asarray(forward_jit(
        params, jnp.concatenate([anchors[:, None], jnp.full((BATCH, n), 8)], 1),
        anchor_positions[:, None] + jnp.arange(n + 1), context, **weights,
    ).logits), axis=-1)[..., :k]
    assert np.array_equal(np.sort(top, -1), np.sort(np.argsort(~finite, axis=-1, kind="stable")[..., :k], -1))
    # Greedy drafts take the best realized score at each step of the walk.
    assert np.array_equal(np.asarray(greedy.tokens), np.asarray(greedy.logits).argmax(-1))

    temperature = jnp.asarray([0.0, 1.0, 1.0, 2.0, 0.0, 1.0], jnp.float32)
    key_data = jnp.asarray(rng.integers(0, 2**32, (BATCH, n, 2), dtype=np.uint32))
    sampled = D.jit_propose(params, anchors, anchor_positions, context, **weights, temperature=temperature,
                            rng_key_data=key_data)
    tokens = np.asarray(sampled.tokens)
    assert np.all(np.take_along_axis(np.isfinite(np.asarray(sampled.logits)), tokens[..., None], -1))
    assert np.array_equal(tokens[[0, 4]], np.asarray(greedy.tokens)[[0, 4]])  # temperature 0 rows stay greedy
    again = D.jit_propose(params, anchors, anchor_positions, context, **weights, temperature=temperature,
                          rng_key_data=key_data)
    assert np.array_equal(np.asarray(again.tokens), tokens)  # same keys, same drafts


def test_drafter_without_extras_drafts_its_argmax():
    config = CONFIG.replace(conv_kernel_size=None, selector_rank=None, selector_top_k=None, num_hidden_layers=1,
                            layer_types=None)
    params, (embed, head) = randomized(config, seed=7), target_weights(config)
    context = D.context_kv(params, jnp.ones((1, 3, 3 * config.hidden_size)), jnp.arange(3)[None], config=config)
    proposal = D.propose(params, jnp.asarray([20]), jnp.asarray([3]), context, embed_weight=embed,
                         lm_head_weight=head, config=config, num_drafts=2)
    assert proposal.tokens.shape == (1, 2)
    assert np.array_equal(np.asarray(proposal.tokens), np.asarray(proposal.logits).argmax(-1))


def test_checkpoint_round_trip_and_errors(tmp_path):
    params = randomized(CONFIG, seed=8)
    D.save_drafter(tmp_path / "fp32", CONFIG, params)
    config, loaded = D.load_drafter(tmp_path / "fp32")
    assert config == CONFIG
    original, restored = flat_params(params), flat_params(loaded)
    assert original.keys() == restored.keys()
    for name in original:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(original[name]))
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"

    D.save_drafter(tmp_path / "bf16", CONFIG, params, dtype="bfloat16")
    tensors = load_safetensors(tmp_path / "bf16")
    assert {str(a.dtype) for a in tensors.values()} == {"bfloat16"} and tensors.keys() == original.keys()
    assert flat_params(D.load_drafter(tmp_path / "bf16")[1])["fc.weight"].dtype == jnp.bfloat16

    # A `model.` prefix and a shipped embedding (the target's, ignored) still load.
    prefixed = {f"model.{name}": np.asarray(a) for name, a in tensors.items()}
    prefixed["model.embed_tokens.weight"] = np.zeros((4, 4), np.float32)
    (tmp_path / "prefixed").mkdir()
    save_safetensors(tmp_path / "prefixed" / "model.safetensors", prefixed)
    CONFIG.save(tmp_path / "prefixed")
    assert D.load_drafter(tmp_path / "prefixed", dtype=jnp.float32)[0] == CONFIG

    broken = {name: a for name, a in prefixed.items() if "layers.1.mlp_conv" not in name}
    broken["model.fc.weight"] = np.zeros((64, 128), np.float32)
    broken["model.layers.0.self_attn.gate_proj.weight"] = np.zeros((64, 64), np.float32)
    save_safetensors(tmp_path / "prefixed" / "model.safetensors", broken)
    with pytest.raises(CheckpointError) as error:
        D.load_drafter(tmp_path / "prefixed")
    problems = "\n".join(error.value.problems)
    assert "layers.1.mlp_conv.base_kernel: expected [2, 2, 64], found nothing" in problems
    assert "model.fc.weight: expected [64, 192], found [64, 128]" in problems
    assert "model.layers.0.self_attn.gate_proj.weight: expected no such tensor" in problems
    assert len(error.value.problems) == 4


# ---- the memory planner's view of the drafter -------------------------------------------------------
def planner_spec(config: D.DrafterConfig) -> DrafterSpec:
    """What beam_jax.memory_plan counts for a drafter of `config`, built the way `DFLASH2` is for
    `dflash2_beam()`: one window for every layer, bf16 K and V per KV head, the matrices' parameters."""
    assert set(config.layer_types) == {SLIDING}, "the planner gives a drafter one window for all its layers"
    num_params = dflash2_matrix_params(
        hidden=config.hidden_size,
        q_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_target_layers=len(config.target_layer_ids),
    )
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    layers, window = config.num_hidden_layers, config.sliding_window
    return DrafterSpec(DFLASH2.name, layers, window, kv_heads, head_dim, num_params=num_params)


def test_planners_dflash2_is_the_dflash2_config():
    assert planner_spec(D.dflash2_beam()) == DFLASH2


def test_drafter_kv_per_token_is_what_the_planner_counts():
    """The drafter's context K/V (what the pool will hold for its layers) against the planner's bytes per
    token, and its group in the pool beside beam-tiny's (the tiny drafter has beam-tiny's KV shape)."""
    target = preset("beam-tiny")
    params = D.init_drafter_params(CONFIG, seed=0, dtype=jnp.bfloat16)
    hidden = jnp.ones((1, CONTEXT, len(CONFIG.target_layer_ids) * CONFIG.hidden_size), jnp.bfloat16)
    context = context_jit(params, hidden, jnp.arange(CONTEXT)[None], config=CONFIG)
    layers, kv_heads, head_dim = CONFIG.num_hidden_layers, CONFIG.num_key_value_heads, CONFIG.head_dim
    for rows in (context.keys, context.values):
        assert rows.shape == (layers, 1, CONTEXT, kv_heads, head_dim) and rows.dtype == jnp.bfloat16
    per_token = (context.keys.nbytes + context.values.nbytes) // CONTEXT
    spec = planner_spec(CONFIG)
    assert [layer.kv_bytes_per_token for layer in drafter_cache_layers(spec, tp=1)] == [per_token // layers] * layers
    assert per_token // layers == kv_bytes_per_token_per_layer(kv_heads, head_dim, tp=1) == 2 * 2 * 16 * 2
    # In the pool: one group of the drafter's window with all its layers, apart from the target's windows.
    groups = cache_groups(target, drafter=spec)
    [group] = [g for g in groups if g.labels[0].startswith("D")]
    assert group.window == CONFIG.sliding_window != target.sliding_window
    assert group.labels == ("D0", "D1") and group.kv_bytes_per_token == per_token
    # A pool page row is [page_size, kv_heads, head_dim] of the target's shape: the drafter's rows fit it.
    assert (kv_heads, head_dim) == (target.num_key_value_heads, target.head_dim)
    beam = preset("beam-501b")
    assert (DFLASH2.num_key_value_heads, DFLASH2.head_dim) == (beam.num_key_value_heads, beam.head_dim)


def test_drafter_sees_exactly_the_window_the_pool_keeps():
    """The pool releases a drafter page once no query at or after the block's anchor P can see it
    (`first_visible_page(window, P)`): the anchor's query sees context keys from P - window + 1, the
    mask queries after it less. A change at P - window + 1 moves the drafts; one at P - window does not."""
    params, (embed, head) = randomized(CONFIG), target_weights(CONFIG)
    anchor, window = 36, CONFIG.sliding_window
    hidden = np.repeat(np.random.default_rng(4).standard_normal((1, anchor, 3 * CONFIG.hidden_size)), 3, 0)
    hidden[1, anchor - window + 1] += 1.0
    hidden[2, anchor - window] += 1.0
    context_positions = jnp.arange(anchor)[None].repeat(3, 0)
    context = context_jit(params, jnp.asarray(hidden, jnp.float32), context_positions, config=CONFIG)
    tokens = jnp.asarray([[100, 8, 8, 8]] * 3)
    positions = jnp.asarray(anchor + np.arange(4)[None].repeat(3, 0))
    logits = np.asarray(
        forward_jit(params, tokens, positions, context, embed_weight=embed, lm_head_weight=head, config=CONFIG).logits
    )
    assert np.abs(logits[1] - logits[0]).max(axis=-1).min() > 1e-3
    np.testing.assert_array_equal(logits[2], logits[0])
    # The pool's rule at P: the first visible key's page stays, everything before it may go.
    assert first_visible_page(window, anchor, 1) == anchor - window + 1


def test_planner_counts_the_drafters_matrices():
    """DFLASH2's weights: exactly the fc, attention and MLP matrices of the drafter module. What it
    leaves out (norms, convolutions, the candidate selector's codebooks) is 4.7% of DFlash2's 1.87B
    parameters at Beam size (the 151,936 x 256 codebooks are most of it): under 22 MB per GPU at TP8."""
    matrix = re.compile(r"fc\.weight|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
    left_out = re.compile(r".*norm\.weight|layers\.\d+\.(attention|mlp)_conv\..*|candidate_selector\..*")
    for config in (CONFIG, D.dflash2_beam()):
        sizes = {name: math.prod(spec.shape) for name, spec in D.abstract_flat(config).items()}
        matrices = sum(size for name, size in sizes.items() if matrix.fullmatch(name))
        assert matrices == planner_spec(config).num_params
        assert all(matrix.fullmatch(name) or left_out.fullmatch(name) for name in sizes)
    assert 0.04 < 1 - matrices / sum(sizes.values()) < 0.05
