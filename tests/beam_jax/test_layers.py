"""Each layer function against a plain-numpy version written from the spec's formulas
(/work/shared/BEAM_SPEC.md, "Forward pass"), in fp32 on random inputs at several shapes.

The numpy versions compute in float64 from the same fp32 inputs; fp32 is the parity dtype, so
these tolerances are tight. Some features (SSMax's `pos+1`, the routed scaling factor, top-k
normalisation, the residual coefficients) cannot change Beam's logits (see test_features.py):
these unit tests are what pins them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import beam_jax.layers.decoder as decoder_module
from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig
from beam_jax.layers.attention import Attention, attend, visibility_mask
from beam_jax.layers.decoder import DecoderLayer, depth_scaled_residual
from beam_jax.layers.moe import MoE, experts_reference, route
from beam_jax.layers.norm import rms_norm
from beam_jax.layers.rope import apply_rope, apply_ssmax, rope_cos_sin, ssmax_scale


def f32(a) -> np.ndarray:
    return np.asarray(a, np.float32)


def run(fn, *args):
    """`fn(*args)` compiled as one program: much faster on CPU than dispatching op by op."""
    return jax.jit(fn)(*args)


def assert_close(actual, expected, rtol=2e-6, what=""):
    """Max abs error relative to the largest expected magnitude (elementwise ratios are meaningless
    near zero)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(np.abs(expected).max(), 1e-30)
    error = np.abs(actual - expected).max() / scale
    assert error <= rtol, f"{what}: relative error {error:.3e} > {rtol:.1e}"


# ---- numpy versions of the spec's formulas --------------------------------------------------------
def np_rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return np.asarray(w, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_rope_angles(positions, dim, theta):
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
    return np.concatenate([freqs, freqs], axis=-1)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def np_rope(x, positions, theta, cos=None, sin=None):
    """Rotate-half (NeoX) layout over the full head_dim: x*cos + rotate_half(x)*sin."""
    x = np.asarray(x, np.float64)
    if cos is None:
        angles = np_rope_angles(positions, x.shape[-1], theta)
        cos, sin = np.cos(angles), np.sin(angles)
    cos, sin = (np.asarray(a, np.float64)[..., None, :] for a in (cos, sin))  # broadcast over heads
    return x * cos + rotate_half(x) * sin


def np_visible(q_positions, k_positions, window):
    batch, tq = q_positions.shape
    tk = k_positions.shape[1]
    out = np.zeros((batch, tq, tk), bool)
    for b in range(batch):
        for i in range(tq):
            for j in range(tk):
                q, k = int(q_positions[b, i]), int(k_positions[b, j])
                out[b, i, j] = k >= 0 and q >= k and (window is None or q - k < window)
    return out


def np_attend(q, k, v, mask):
    """Softmax attention with GQA: query head h reads KV head h // (heads / kv_heads)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, tq, heads, d = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            scores = q[b, :, h] @ k[b, :, h // group].T / math.sqrt(d)
            scores = np.where(mask[b], scores, -np.inf)
            for i in range(tq):
                if mask[b, i].any():  # a query with no visible key gets zeros (documented choice)
                    p = np.exp(scores[i] - scores[i].max())
                    out[b, i, h] = (p / p.sum()) @ v[b, :, h // group]
    return out


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def np_route(x, router_weight, bias, num_groups, groups_kept, top_k, normalize):
    scores = np_sigmoid(np.asarray(x, np.float64) @ np.asarray(router_weight, np.float64).T)
    choice = scores + np.asarray(bias, np.float64)
    tokens, experts = choice.shape
    per_group = experts // num_groups
    weights, indices = [], []
    for t in range(tokens):
        groups = choice[t].reshape(num_groups, per_group)
        group_scores = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        kept = np.argsort(-group_scores, kind="stable")[:groups_kept]
        allowed = np.zeros(experts, bool)
        for g in kept:
            allowed[g * per_group : (g + 1) * per_group] = True
        masked = np.where(allowed, choice[t], -np.inf)
        idx = np.argsort(-masked, kind="stable")[:top_k]
        w = scores[t, idx]
        if normalize:
            w = w / (w.sum() + 1e-20)
        weights.append(w)
        indices.append(idx)
    return np.array(weights), np.array(indices)


def np_silu(x):
    return x * np_sigmoid(x)


def np_expert(x, gate_up, down):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate rows first in the fused [2I, H]."""
    inter = gate_up.shape[0] // 2
    gate, up = gate_up[:inter] @ x, gate_up[inter:] @ x
    return down @ (np_silu(gate) * up)


def np_experts(x, weights, indices, gate_up_proj, down_proj):
    x, gate_up_proj, down_proj = (np.asarray(a, np.float64) for a in (x, gate_up_proj, down_proj))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], indices[t], strict=True):
            out[t] += float(w) * np_expert(x[t], gate_up_proj[e], down_proj[e])
    return out


# ---- RMSNorm ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, eps, seed", [((7,), 1e-6, 0), ((3, 5), 1e-6, 1), ((2, 3, 13), 1e-2, 2), ((1, 4, 3, 128), 1e-6, 3)]
)
def test_rms_norm(shape, eps, seed):
    rng = np.random.default_rng(seed)
    x = f32(rng.normal(0, 2.0, shape))
    w = f32(1 + 0.3 * rng.normal(size=shape[-1]))
    out = rms_norm(jnp.asarray(x), jnp.asarray(w), eps)
    assert out.dtype == jnp.float32
    assert_close(out, np_rms_norm(x, w, eps), what="rms_norm")


def test_rms_norm_weight_is_plain_scale_not_one_plus_w():
    x = f32(np.random.default_rng(4).normal(size=(3, 9)))
    assert_close(rms_norm(jnp.asarray(x), jnp.zeros(9), 1e-6), np.zeros((3, 9)), what="w=0 gives 0")
    assert_close(rms_norm(jnp.asarray(x), jnp.ones(9), 1e-6), np_rms_norm(x, np.ones(9), 1e-6), what="w=1")


# ---- RoPE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, t, heads, dim, seed", [(1, 1, 1, 2, 10), (3, 7, 5, 10, 11), (1, 5, 2, 128, 13)])
def test_rope_rotate_half_theta_10000(batch, t, heads, dim, seed):
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 3000, size=(batch, t)).astype(np.int32)
    x = f32(rng.normal(size=(batch, t, heads, dim)))
    cos, sin = rope_cos_sin(jnp.asarray(positions), dim, 10000.0)
    assert cos.shape == sin.shape == (batch, t, dim) and cos.dtype == sin.dtype == jnp.float32
    # The angles are fp32 products `pos * inv_freq`: an ulp of the angle grows with the position.
    angles = np_rope_angles(positions, dim, 10000.0)
    allowed = 1e-6 + 3e-7 * positions[..., None]
    assert (np.abs(np.asarray(cos, np.float64) - np.cos(angles)) <= allowed).all(), "cos"
    assert (np.abs(np.asarray(sin, np.float64) - np.sin(angles)) <= allowed).all(), "sin"
    out = apply_rope(jnp.asarray(x), cos, sin)
    assert out.dtype == jnp.float32
    assert_close(out, np_rope(x, positions, 10000.0, cos, sin), rtol=1e-6, what="apply_rope")


def test_rope_theta_is_10000_on_sliding_layers_and_absent_on_full_layers():
    config = BeamConfig()
    assert config.rope_theta(SLIDING) == 10000.0
    assert config.rope_theta(FULL) is None


def test_rope_at_position_0_is_identity():
    x = f32(np.random.default_rng(14).normal(size=(2, 3, 5, 12)))
    cos, sin = rope_cos_sin(jnp.zeros((2, 3), jnp.int32), 12, 10000.0)
    np.testing.assert_array_equal(np.asarray(apply_rope(jnp.asarray(x), cos, sin)), x)


@pytest.mark.parametrize("dim, seed", [(10, 15), (64, 16)])
def test_rope_scores_depend_only_on_relative_position(dim, seed):
    rng = np.random.default_rng(seed)
    q, k = f32(rng.normal(size=(1, 1, 1, dim))), f32(rng.normal(size=(1, 1, 1, dim)))

    def score(q_pos, k_pos):
        rq = apply_rope(jnp.asarray(q), *rope_cos_sin(jnp.array([[q_pos]]), dim, 10000.0))
        rk = apply_rope(jnp.asarray(k), *rope_cos_sin(jnp.array([[k_pos]]), dim, 10000.0))
        return float(jnp.sum(rq * rk))

    for q_pos, k_pos in [(5, 2), (17, 17), (40, 3)]:
        base = score(q_pos, k_pos)
        for shift in (1, 13, 250):
            assert score(q_pos + shift, k_pos + shift) == pytest.approx(base, abs=2e-4 * math.sqrt(dim))
    # ...and it does depend on the relative position.
    assert abs(score(7, 2) - score(7, 3)) > 1e-3


# ---- SSMax --------------------------------------------------------------------------------------
def test_ssmax_scale_is_one_plus_pos_plus_1_over_2048_to_the_0_1():
    positions = np.array([[0, 1, 2, 100, 2046, 2047, 2048, 65535, 1_048_575]], np.int32)
    expected = (1 + (positions.astype(np.float64) + 1) / 2048) ** 0.1
    assert_close(ssmax_scale(jnp.asarray(positions)), expected, rtol=1e-6, what="ssmax_scale")
    assert float(ssmax_scale(jnp.array([0]))[0]) == pytest.approx((1 + 1 / 2048) ** 0.1, rel=1e-7)
    assert float(ssmax_scale(jnp.array([0]))[0]) != 1.0  # pos + 1, not pos


@pytest.mark.parametrize("shape, seed", [((1, 1, 1, 4), 20), ((2, 7, 3, 10), 21)])
def test_apply_ssmax_scales_q_per_position(shape, seed):
    rng = np.random.default_rng(seed)
    q = f32(rng.normal(size=shape))
    positions = rng.integers(0, 100_000, size=shape[:2]).astype(np.int32)
    expected = q * (1 + (positions.astype(np.float64) + 1) / 2048)[..., None, None] ** 0.1
    assert_close(apply_ssmax(jnp.asarray(q), jnp.asarray(positions)), expected, rtol=1e-6, what="apply_ssmax")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_fused_kernels_references_are_the_layers_math(dtype, kind):
    """The decode kernels fuse the layer's q/k prologue and output gate with the rounding points of
    `pallas_kernels.paged_attention`'s references; those equal this package's norm, RoPE, SSMax and
    the layer's gate bit for bit (each side one jitted program, as in the model)."""
    from pallas_kernels.paged_attention import HeadPrologue, OutputGate, head_prologue_reference, output_gate_reference

    rng = np.random.default_rng(7)
    tokens, heads, d = 9, 6, 128
    x = jnp.asarray(3 * rng.normal(size=(tokens, heads, d)), dtype)
    weight = jnp.asarray(1 + 0.3 * rng.normal(size=d), dtype)
    positions = jnp.asarray([0, 1, 63, 64, 511, 512, 4095, 32767, 131071], jnp.int32)

    def model(x, weight, positions):
        normed = rms_norm(x, weight, 1e-6)
        if kind == "sliding":
            cos, sin = rope_cos_sin(positions, d, 10000.0)
            return apply_rope(normed, cos, sin)
        return apply_ssmax(normed, positions)

    def fused_reference(x, weight, positions):
        if kind == "sliding":
            cos, sin = rope_cos_sin(positions, d, 10000.0)
            return head_prologue_reference(x, HeadPrologue(weight, 1e-6, rope_cos=cos, rope_sin=sin))
        return head_prologue_reference(x, HeadPrologue(weight, 1e-6, ssmax_scale=ssmax_scale(positions)))

    np.testing.assert_array_equal(f32(run(fused_reference, x, weight, positions)), f32(run(model, x, weight, positions)))

    out, gate = (jnp.asarray(rng.normal(size=(tokens, heads, d)), dtype) for _ in range(2))
    bias = jnp.asarray(rng.normal(size=heads), dtype)

    def layer_gate(out, gate, bias):  # Attention.__call__'s gate, as written there
        logits = (gate.astype(jnp.float32) + bias.astype(jnp.float32)[:, None]).astype(dtype)
        weights = jax.nn.sigmoid(logits.astype(jnp.float32)).astype(dtype)
        return (out.astype(jnp.float32) * weights.astype(jnp.float32)).astype(dtype)

    fused_gate = run(lambda out, gate, bias: output_gate_reference(out, OutputGate(gate, bias)), out, gate, bias)
    np.testing.assert_array_equal(f32(fused_gate), f32(run(layer_gate, out, gate, bias)))


# ---- visibility mask ----------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_visibility_mask(window):
    rng = np.random.default_rng(30 + (window or 0))
    q_positions = rng.integers(0, 20, size=(3, 5)).astype(np.int32)
    k_positions = rng.integers(-3, 20, size=(3, 11)).astype(np.int32)
    k_positions[:, 0] = -1  # an empty slot in every row
    mask = np.asarray(visibility_mask(jnp.asarray(q_positions), jnp.asarray(k_positions), window))
    np.testing.assert_array_equal(mask, np_visible(q_positions, k_positions, window))


def test_visibility_mask_edges():
    q = jnp.array([[10]])
    k = jnp.array([[-1, 2, 3, 9, 10, 11]])
    np.testing.assert_array_equal(np.asarray(visibility_mask(q, k, None))[0, 0], [0, 1, 1, 1, 1, 0])
    # window 8: q - k < 8, so key 3 (distance 7) is the oldest visible one, key 2 (distance 8) is not
    np.testing.assert_array_equal(np.asarray(visibility_mask(q, k, 8))[0, 0], [0, 0, 1, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(visibility_mask(q, k, 1))[0, 0], [0, 0, 0, 0, 1, 0])


# ---- attention core -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch, tq, tk, heads, kv_heads, d, seed",
    [(1, 1, 1, 1, 1, 4, 40), (2, 5, 7, 6, 2, 10, 41), (3, 4, 9, 8, 1, 16, 42)],
)
def test_attend_matches_numpy_gqa_softmax(batch, tq, tk, heads, kv_heads, d, seed):
    rng = np.random.default_rng(seed)
    q = f32(rng.normal(0, 1.5, (batch, tq, heads, d)))
    k = f32(rng.normal(0, 1.5, (batch, tk, kv_heads, d)))
    v = f32(rng.normal(size=(batch, tk, kv_heads, d)))
    mask = rng.random((batch, tq, tk)) < 0.6
    mask[..., 0] = True
    if tq > 1:
        mask[0, 1] = False  # a query that sees nothing
    out = run(attend, *(jnp.asarray(a) for a in (q, k, v, mask)))
    assert out.shape == q.shape and out.dtype == jnp.float32
    assert_close(out, np_attend(q, k, v, mask), rtol=1e-5, what="attend")


# ---- the attention layer, end to end --------------------------------------------------------------
ATTENTION_CONFIG = BeamConfig(
    vocab_size=64,
    hidden_size=24,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=5,
    layer_types=(SLIDING, FULL),
    mlp_layer_types=(DENSE, DENSE),
)


def _set(module, values: dict[str, np.ndarray]):
    for path, value in values.items():
        target = module
        for part in path.split("."):
            target = getattr(target, part)
        assert target[...].shape == value.shape, path
        target.set_value(jnp.asarray(value))


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_attention_layer_matches_the_spec(layer):
    """q/k RMSNorm per head, RoPE (sliding) or SSMax on q (full), windowed GQA softmax, the
    per-head-biased sigmoid gate, o_proj. Large q/k norm weights make the scores O(10), so that
    SSMax's pos+1 (a 5e-5 change of q) is visible."""
    config = ATTENTION_CONFIG
    h_, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rng = np.random.default_rng(50 + layer)
    w = {
        "q_proj.weight": rng.normal(0, h_**-0.5, (heads * d, h_)),
        "k_proj.weight": rng.normal(0, h_**-0.5, (kv * d, h_)),
        "v_proj.weight": rng.normal(0, h_**-0.5, (kv * d, h_)),
        "o_proj.weight": rng.normal(0, (heads * d) ** -0.5, (h_, heads * d)),
        "gate_proj.weight": rng.normal(0, h_**-0.5, (heads * d, h_)),
        "gate_bias": rng.normal(0, 1.0, heads),
        "q_norm.weight": 3.0 + rng.normal(0, 0.3, d),
        "k_norm.weight": 3.0 + rng.normal(0, 0.3, d),
    }
    w = {name: f32(value) for name, value in w.items()}
    module = Attention(config, layer, dtype=jnp.float32)
    _set(module, w)

    batch, t = 2, 11
    x = f32(rng.normal(size=(batch, t, h_)))
    positions = np.stack([np.arange(t), np.arange(50, 50 + t)]).astype(np.int32)
    out, cache = run(lambda x, positions: module(x, positions, None), jnp.asarray(x), jnp.asarray(positions))
    assert cache is None

    x64 = x.astype(np.float64)
    q = np_rms_norm((x64 @ w["q_proj.weight"].T).reshape(batch, t, heads, d), w["q_norm.weight"], 1e-6)
    k = np_rms_norm((x64 @ w["k_proj.weight"].T).reshape(batch, t, kv, d), w["k_norm.weight"], 1e-6)
    v = (x64 @ w["v_proj.weight"].T).reshape(batch, t, kv, d)
    if config.is_sliding(layer):
        q, k = np_rope(q, positions, 10000.0), np_rope(k, positions, 10000.0)
    else:
        q = q * ((1 + (positions + 1) / 2048) ** 0.1)[..., None, None]
    o = np_attend(q, k, v, np_visible(positions, positions, config.window(layer)))
    gate = (x64 @ w["gate_proj.weight"].T).reshape(batch, t, heads, d) + w["gate_bias"][None, None, :, None]
    expected = (o * np_sigmoid(gate)).reshape(batch, t, heads * d) @ w["o_proj.weight"].T
    assert_close(out, expected, rtol=3e-6, what="attention layer")


# ---- routing ------------------------------------------------------------------------------------
def _sorted_by_expert(weights, indices):
    order = np.argsort(indices, axis=-1)
    return np.take_along_axis(np.asarray(weights), order, -1), np.take_along_axis(np.asarray(indices), order, -1)


@pytest.mark.parametrize(
    "tokens, hidden, experts, groups, kept, top_k, normalize, seed",
    [
        (1, 5, 8, 1, 1, 2, True, 60),
        (33, 13, 12, 3, 2, 3, True, 61),
        (9, 11, 30, 5, 3, 7, False, 63),
    ],
)
def test_route_matches_numpy(tokens, hidden, experts, groups, kept, top_k, normalize, seed):
    rng = np.random.default_rng(seed)
    x = f32(rng.normal(size=(tokens, hidden)))
    router = f32(rng.normal(0, hidden**-0.5, (experts, hidden)))
    bias = f32(rng.normal(0, 0.2, experts))
    weights, indices = run(
        lambda *a: route(*a, num_groups=groups, groups_kept=kept, top_k=top_k, normalize=normalize),
        jnp.asarray(x),
        jnp.asarray(router),
        jnp.asarray(bias),
    )
    assert weights.shape == indices.shape == (tokens, top_k)
    assert weights.dtype == jnp.float32
    expected_w, expected_i = np_route(x, router, bias, groups, kept, top_k, normalize)
    actual_w, actual_i = _sorted_by_expert(weights, indices)
    expected_w, expected_i = _sorted_by_expert(expected_w, expected_i)
    np.testing.assert_array_equal(actual_i, expected_i)
    assert_close(actual_w, expected_w, rtol=1e-6, what="routing weights")
    if normalize:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


def _route_logits(logits, bias=None, **kwargs):
    """Route tokens whose router logits are given: x = logits, router = identity."""
    logits = f32(np.atleast_2d(logits))
    experts = logits.shape[1]
    bias = np.zeros(experts, np.float32) if bias is None else f32(bias)
    w, i = run(lambda *a: route(*a, **kwargs), jnp.asarray(logits), jnp.eye(experts), jnp.asarray(bias))
    return np.asarray(w)[0], np.asarray(i)[0]


def test_group_limit_changes_the_selection():
    # 4 groups of 2. Groups 0 and 1 hold the two best experts (0 and 2) but each has a weak
    # second expert; groups 2 and 3 win on the sum of their top 2, so only experts 4..7 qualify.
    logits = [3.0, -5.0, 2.9, -5.0, 2.0, 1.95, 1.9, 1.85]
    _, plain = _route_logits(logits, num_groups=4, groups_kept=4, top_k=2, normalize=True)
    assert sorted(plain) == [0, 2]
    weights, limited = _route_logits(logits, num_groups=4, groups_kept=2, top_k=2, normalize=True)
    assert sorted(limited) == [4, 5]
    s4, s5 = np_sigmoid(2.0), np_sigmoid(1.95)
    assert_close(_sorted_by_expert(weights, limited)[0], [s4 / (s4 + s5), s5 / (s4 + s5)], rtol=1e-6)


def test_correction_bias_selects_but_does_not_weight():
    logits = [1.0, 0.0, -1.0, 0.5]
    bias = [0.0, 0.0, 0.8, 0.0]  # lifts expert 2 (sigmoid 0.27) above expert 3 (0.62) and 0 (0.73)
    _, unbiased = _route_logits(logits, num_groups=1, groups_kept=1, top_k=2, normalize=False)
    assert sorted(unbiased) == [0, 3]
    weights, indices = _route_logits(logits, bias, num_groups=1, groups_kept=1, top_k=2, normalize=False)
    assert sorted(indices) == [0, 2]
    # Weights are the un-biased sigmoid scores (not normalised here, so exactly the scores).
    assert_close(_sorted_by_expert(weights, indices)[0], [np_sigmoid(1.0), np_sigmoid(-1.0)], rtol=1e-6)
    weights, indices = _route_logits(logits, bias, num_groups=1, groups_kept=1, top_k=2, normalize=True)
    total = np_sigmoid(1.0) + np_sigmoid(-1.0)
    assert_close(_sorted_by_expert(weights, indices)[0], [np_sigmoid(1.0) / total, np_sigmoid(-1.0) / total], rtol=1e-6)


# ---- experts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k, used, seed",
    [(1, 5, 3, 4, 1, 1, 70), (33, 42, 18, 12, 3, 7, 72)],
)
def test_experts_reference_matches_a_per_token_loop(tokens, hidden, inter, experts, top_k, used, seed):
    rng = np.random.default_rng(seed)
    x = f32(rng.normal(size=(tokens, hidden)))
    gate_up = f32(rng.normal(0, hidden**-0.5, (experts, 2 * inter, hidden)))
    down = f32(rng.normal(0, inter**-0.5, (experts, hidden, inter)))
    # Only `used` of the experts receive tokens; each token picks distinct experts among them.
    pool = rng.permutation(experts)[:used]
    indices = np.stack([rng.choice(pool, size=top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = f32(rng.random((tokens, top_k)))
    assert len(set(indices.ravel())) < experts
    out = run(experts_reference, *(jnp.asarray(a) for a in (x, weights, indices, gate_up, down)))
    assert out.shape == x.shape and out.dtype == jnp.float32
    assert_close(out, np_experts(x, weights, indices, gate_up, down), rtol=1e-5, what="experts")


MOE_CONFIG = BeamConfig(
    vocab_size=64,
    hidden_size=13,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    moe_intermediate_size=7,
    num_experts=12,
    num_experts_per_tok=3,
    n_group=3,
    topk_group=2,
    layer_types=(FULL,),
    mlp_layer_types=(SPARSE,),
)


def random_moe(config, rng) -> tuple[MoE, dict[str, np.ndarray]]:
    """An fp32 MoE block with random router and experts, and its weights by name."""
    h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
    w = {
        "gate.weight": f32(rng.normal(0, h**-0.5, (e, h))),
        "gate.e_score_correction_bias": f32(rng.normal(0, 0.1, e)),
        "experts.gate_up_proj": f32(rng.normal(0, h**-0.5, (e, 2 * i, h))),
        "experts.down_proj": f32(rng.normal(0, i**-0.5, (e, h, i))),
    }
    module = MoE(config, dtype=jnp.float32)
    _set(module, w)
    return module, w


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_block_scales_by_2_5_after_aggregation(normalize):
    """Invisible in the logits (post_feedforward_layernorm removes a per-token scale): pinned here."""
    config = MOE_CONFIG.replace(norm_topk_prob=normalize)
    assert config.routed_scaling_factor == 2.5
    rng = np.random.default_rng(80)
    module, w = random_moe(config, rng)
    h = config.hidden_size
    x = f32(rng.normal(size=(2, 5, h)))
    out, indices = run(module, jnp.asarray(x))
    flat = x.reshape(-1, h)
    weights, expected_indices = np_route(flat, w["gate.weight"], w["gate.e_score_correction_bias"], 3, 2, 3, normalize)
    np.testing.assert_array_equal(np.sort(np.asarray(indices), -1), np.sort(expected_indices, -1))
    expected = 2.5 * np_experts(flat, weights, expected_indices, w["experts.gate_up_proj"], w["experts.down_proj"])
    assert_close(out, expected.reshape(x.shape), rtol=1e-5, what="MoE block")


def test_moe_padding_tokens_get_no_experts(monkeypatch):
    """`num_tokens`: the tokens past it (a serving step's bucket padding) select expert -1 on every
    pair, so no expert path computes them (zeros); the real tokens' selections and outputs are as
    without it."""
    rng = np.random.default_rng(81)
    module, _ = random_moe(MOE_CONFIG, rng)
    x = jnp.asarray(f32(rng.normal(size=(1, 7, MOE_CONFIG.hidden_size))))
    whole, whole_indices = module(x)
    seen = []
    experts_call = type(module.experts).__call__
    monkeypatch.setattr(type(module.experts), "__call__", lambda self, x, w, ids: seen.append(ids) or experts_call(
        self, x, w, ids))
    padded, indices = module(x, jnp.int32(4))
    np.testing.assert_array_equal(np.asarray(indices)[:4], np.asarray(whole_indices)[:4])
    np.testing.assert_array_equal(np.asarray(indices)[4:], -1)
    np.testing.assert_array_equal(np.asarray(seen[0]), np.asarray(indices))  # what the experts were given
    np.testing.assert_array_equal(np.asarray(padded)[0, 4:], 0.0)
    np.testing.assert_allclose(np.asarray(padded)[0, :4], np.asarray(whole)[0, :4], rtol=1e-6, atol=1e-7)


# ---- residuals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 52, 105])
def test_depth_scaled_residual(n):
    rng = np.random.default_rng(90 + n)
    update, residual = f32(rng.normal(size=(3, 11))), f32(rng.normal(size=(3, 11)))
    out = depth_scaled_residual(jnp.asarray(update), jnp.asarray(residual), n)
    expected = update.astype(np.float64) / math.sqrt(n) + residual.astype(np.float64) * math.sqrt((n - 1) / n)
    assert out.dtype == jnp.float32
    assert_close(out, expected, rtol=1e-6, what=f"n={n}")
    ones, zeros = jnp.ones((1, 4)), jnp.zeros((1, 4))
    assert_close(depth_scaled_residual(ones, zeros, n), np.full((1, 4), 1 / math.sqrt(n)), rtol=1e-7)
    assert_close(depth_scaled_residual(zeros, ones, n), np.full((1, 4), math.sqrt((n - 1) / n)), rtol=1e-7)


def test_decoder_layers_count_residual_additions_from_two(monkeypatch):
    """Layer i adds attention as addition n = 2(i+1) and the MLP as n' = 2(i+1) + 1."""
    config = MOE_CONFIG.replace(num_hidden_layers=4, layer_types=None, mlp_layer_types=None)
    seen = []
    original = decoder_module.depth_scaled_residual

    def spy(update, residual, add_index):
        seen.append(add_index)
        return original(update, residual, add_index)

    monkeypatch.setattr(decoder_module, "depth_scaled_residual", spy)
    x, positions = jnp.ones((1, 3, config.hidden_size)), jnp.arange(3)[None]
    for i in range(config.num_hidden_layers):
        seen.clear()
        layer = DecoderLayer(config, i, dtype=jnp.float32)
        jax.eval_shape(lambda layer=layer: layer(x, positions, None))  # traced only: the spy sees the indices
        assert seen == [2 * (i + 1), 2 * (i + 1) + 1]
