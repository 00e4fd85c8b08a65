"""Incremental decoding with the KV cache equals the full forward pass (fp32, random weights).

The model is small (2 layers: a dense sliding layer with window 8 and a sparse full layer) and the
prompts cross the window many times. The full forward without a cache over a batch of three
40-token rows is the ground truth; the cached paths (one prefill, one token at a time, two uneven
chunks, rows at different positions) must reproduce it at every position. The array shapes are
shared between tests so that each program compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig
from beam_jax.generate import greedy_generate
from beam_jax.kv_cache import KVCache
from beam_jax.model import flat_params, forward
from tests.beam_jax.random_params import randomized_fp32_params

CONFIG = BeamConfig(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=8,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    layer_types=(SLIDING, FULL),
    mlp_layer_types=(DENSE, SPARSE),
    max_position_embeddings=128,
    initializer_range=0.2,  # ~1/sqrt(hidden): activations O(1), so every feature shows
)
BATCH, LENGTH, CACHE_LEN = 3, 40, 64
TOLERANCE = 1e-5

FORWARD = jax.jit(forward, static_argnames=("config", "hidden_layers", "return_routing"))


@pytest.fixture(scope="module")
def params():
    return randomized_fp32_params(CONFIG)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(BATCH, LENGTH)).astype(np.int32)


def positions_for(start: int, stop: int) -> jnp.ndarray:
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (BATCH, stop - start))


@pytest.fixture(scope="module")
def truth(params, tokens):
    """Logits `[batch, 40, vocab]` of the full forward pass without a cache."""
    out = FORWARD(params, jnp.asarray(tokens), positions_for(0, LENGTH), config=CONFIG)
    assert out.cache is None and out.hidden_states == () and out.expert_indices == ()
    return np.asarray(out.logits)


def new_cache() -> KVCache:
    return KVCache.create(CONFIG, BATCH, CACHE_LEN, jnp.float32)


def assert_logits_match(actual, expected, what: str):
    """Relative error at every position: max |diff| over the vocabulary / max |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    error = np.abs(actual - expected).max(-1) / np.abs(expected).max(-1)
    worst = np.unravel_index(error.argmax(), error.shape)
    assert error.max() <= TOLERANCE, f"{what}: rel err {error.max():.2e} at (row, position) {worst}"


@pytest.fixture(scope="module")
def prefill(params, tokens):
    """One cached prefill of all 40 tokens, also asked for hidden states (reversed) and routing."""
    return FORWARD(
        params,
        jnp.asarray(tokens),
        positions_for(0, LENGTH),
        new_cache(),
        config=CONFIG,
        hidden_layers=(1, 0),
        return_routing=True,
    )


# ---- (a) one prefill, token by token, chunked prefill ---------------------------------------------
def test_truth_is_not_trivial(truth):
    assert np.isfinite(truth).all()
    assert np.abs(truth).max() > 1.0  # soft-capped logits of O(1) weights
    # Every position predicts differently (the window and the history matter).
    assert len({int(a) for a in truth.argmax(-1).ravel()}) > 5


def test_cached_prefill_equals_full_forward(prefill, truth):
    assert prefill.cache.max_len == CACHE_LEN
    assert_logits_match(prefill.logits, truth, "prefill with cache")


def test_token_by_token_decode_equals_full_forward(params, tokens, truth, prefill):
    cache, logits = new_cache(), []
    for position in range(LENGTH):
        step = jnp.asarray(tokens[:, position : position + 1])
        out = FORWARD(params, step, positions_for(position, position + 1), cache, config=CONFIG)
        cache = out.cache
        logits.append(np.asarray(out.logits))
    assert_logits_match(np.concatenate(logits, axis=1), truth, "token by token")
    # The cache holds the same keys and values however it was filled.
    for layer in range(CONFIG.num_hidden_layers):
        for name in ("keys", "values"):
            stepwise = np.asarray(getattr(cache, name)[layer])
            at_once = np.asarray(getattr(prefill.cache, name)[layer])
            np.testing.assert_allclose(stepwise, at_once, rtol=1e-5, atol=1e-5, err_msg=f"{name}[{layer}]")


def test_chunked_prefill_equals_full_forward(params, tokens, truth):
    split = 17  # chunks of 17 and 23 tokens
    first = FORWARD(params, jnp.asarray(tokens[:, :split]), positions_for(0, split), new_cache(), config=CONFIG)
    second = FORWARD(params, jnp.asarray(tokens[:, split:]), positions_for(split, LENGTH), first.cache, config=CONFIG)
    assert_logits_match(np.concatenate([first.logits, second.logits], axis=1), truth, "two chunks")


# ---- (b) rows at different positions --------------------------------------------------------------
def test_rows_at_different_positions(params, tokens, truth):
    """A right-padded prefill (pad tokens differ from the real continuation, so stale keys would
    show), then decode steps in which every row is at its own position."""
    lengths = np.array([5, 23, 14])
    width, steps = 23, 12
    pad = np.random.default_rng(2).integers(0, CONFIG.vocab_size, size=(BATCH, width)).astype(np.int32)
    padded = np.where(np.arange(width) < lengths[:, None], tokens[:, :width], pad)
    assert (padded[0, 5:] != tokens[0, 5:width]).any()
    out = FORWARD(params, jnp.asarray(padded), positions_for(0, width), new_cache(), config=CONFIG)
    for row, length in enumerate(lengths):
        assert_logits_match(np.asarray(out.logits)[row, :length], truth[row, :length], f"prefill row {row}")
    cache = out.cache
    for step in range(steps):
        positions = lengths + step
        step_tokens = tokens[np.arange(BATCH), positions][:, None]
        step_positions = jnp.asarray(positions[:, None], jnp.int32)
        out = FORWARD(params, jnp.asarray(step_tokens), step_positions, cache, config=CONFIG)
        cache = out.cache
        expected = truth[np.arange(BATCH), positions]
        assert_logits_match(np.asarray(out.logits)[:, 0], expected, f"step {step} at positions {positions.tolist()}")


def test_cache_write_drops_positions_past_the_end():
    cache = KVCache.create(CONFIG, 1, 8, jnp.float32)
    kv = jnp.ones((1, 2, CONFIG.num_key_value_heads, CONFIG.head_dim))
    written = cache.write(0, jnp.array([[3, 8]]), kv, kv)
    np.testing.assert_array_equal(np.asarray(written.keys[0])[0, :, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0])


def test_cache_write_drops_negative_positions():
    # jnp's .at[] wraps negative indices; position -1 (the mask's "empty slot") must not land anywhere.
    cache = KVCache.create(CONFIG, 1, 8, jnp.float32)
    kv = jnp.ones((1, 1, CONFIG.num_key_value_heads, CONFIG.head_dim))
    written = cache.write(0, jnp.array([[-1]]), kv, kv)
    np.testing.assert_array_equal(np.asarray(written.keys[0]), 0.0)


# ---- hidden states and routing ------------------------------------------------------------------
def _rms_norm(x, w, eps=CONFIG.rms_norm_eps):
    x = np.asarray(x, np.float64)
    return np.asarray(w, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def test_hidden_layers_come_back_in_the_requested_order(params, prefill):
    weights = {name: np.asarray(value, np.float64) for name, value in flat_params(params).items()}
    assert len(prefill.hidden_states) == 2
    last, first = (np.asarray(h, np.float64) for h in prefill.hidden_states)
    assert last.shape == first.shape == (BATCH, LENGTH, CONFIG.hidden_size)
    # hidden_states[0] is layer 1, the last: final norm -> lm_head -> soft-cap gives the logits.
    cap = CONFIG.final_logit_softcapping
    logits = cap * np.tanh(_rms_norm(last, weights["model.norm.weight"]) @ weights["lm_head.weight"].T / cap)
    assert_logits_match(prefill.logits, logits, "logits from hidden_states[0]")
    # hidden_states[1] is layer 0: layer 1 (full attention, no RoPE) cached its keys and values from it.
    h = _rms_norm(first, weights["model.layers.1.input_layernorm.weight"])
    shape = (BATCH, LENGTH, CONFIG.num_key_value_heads, CONFIG.head_dim)
    values = (h @ weights["model.layers.1.self_attn.v_proj.weight"].T).reshape(shape)
    keys = _rms_norm(
        (h @ weights["model.layers.1.self_attn.k_proj.weight"].T).reshape(shape),
        weights["model.layers.1.self_attn.k_norm.weight"],
    )
    np.testing.assert_allclose(np.asarray(prefill.cache.values[1])[:, :LENGTH], values, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(prefill.cache.keys[1])[:, :LENGTH], keys, rtol=1e-4, atol=1e-5)
    assert not np.allclose(first, last)


def test_return_routing_gives_one_batch_t_k_array_per_sparse_layer(prefill):
    sparse = [i for i in range(CONFIG.num_hidden_layers) if CONFIG.is_sparse(i)]
    assert len(prefill.expert_indices) == len(sparse) == 1  # none for the dense layer
    for indices in prefill.expert_indices:
        indices = np.asarray(indices)
        assert indices.shape == (BATCH, LENGTH, CONFIG.num_experts_per_tok)
        assert np.issubdtype(indices.dtype, np.integer)
        assert indices.min() >= 0 and indices.max() < CONFIG.num_experts
        assert (np.sort(indices, -1)[..., 1:] != np.sort(indices, -1)[..., :-1]).all()  # distinct per token
        assert len(np.unique(indices)) > CONFIG.num_experts_per_tok  # tokens route differently


# ---- (c) greedy generation ----------------------------------------------------------------------
PROMPT_LENGTHS = (3, 11, 7)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, CONFIG.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def alone(params, prompts):
    return [greedy_generate(params, CONFIG, [prompt], NEW_TOKENS)[0] for prompt in prompts]


def test_greedy_batch_equals_each_prompt_alone(params, prompts, alone):
    assert all(len(out) == NEW_TOKENS for out in alone)
    assert len({tuple(out) for out in alone}) == len(prompts)
    assert greedy_generate(params, CONFIG, prompts, NEW_TOKENS) == alone


def test_greedy_stop_tokens_end_a_row_and_are_included(params, prompts, alone):
    # A token that row 1 emits early and row 0 never emits.
    stop = next((t for t in alone[1][:8] if t not in alone[0]), None)
    assert stop is not None, f"pick another stop token for {alone}"
    expected = [out[: out.index(stop) + 1] if stop in out else out for out in alone]
    assert len(expected[1]) < NEW_TOKENS and len(expected[0]) == NEW_TOKENS
    assert greedy_generate(params, CONFIG, prompts, NEW_TOKENS, stop_token_ids=[stop]) == expected


def test_greedy_zero_new_tokens(params, prompts):
    assert greedy_generate(params, CONFIG, prompts, 0) == [[], [], []]


@pytest.mark.parametrize(
    "prompts, max_new_tokens, message",
    [
        ([[]], 4, "at least one token"),
        ([[1, 2], []], 4, "at least one token"),
        ([], 4, "at least one token"),
        ([[1, CONFIG.vocab_size]], 4, rf"token ids \[{CONFIG.vocab_size}\] are outside the vocabulary"),
        ([[3, -1]], 4, r"token ids \[-1\] are outside the vocabulary"),
        ([[1] * 40], 89, "exceeds max_position_embeddings"),
        ([[1]], -1, "max_new_tokens must be >= 0"),
    ],
)
def test_greedy_rejects_bad_requests(params, prompts, max_new_tokens, message):
    with pytest.raises(ValueError, match=message):
        greedy_generate(params, CONFIG, prompts, max_new_tokens)
