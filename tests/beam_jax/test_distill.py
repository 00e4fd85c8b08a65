"""Drafter distillation (beam_jax/train/distill.py) for the trained target beam-tiny-code: the step's
features are the target's residual stream and its labels the target's argmax, a label counts only
where it is the target's greedy chain from the anchor, a few AdamW steps lower the distillation loss,
the accept length is the longest matching prefix plus the bonus token, and the shipped drafter
(beam_jax/assets/beam-tiny-code-dflash) accepts >= 3 tokens per step on held-out code."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import beam_jax
from beam_jax import drafter as D
from beam_jax.generate import greedy_generate
from beam_jax.train import corpus, data
from beam_jax.train import distill as S

CONFIG = S.drafter_tiny_code(block_size=4)
DRAFTER_DIR = Path(beam_jax.__file__).parent / "assets" / "beam-tiny-code-dflash"


@pytest.fixture(scope="module")
def beam():
    return beam_jax.load("beam-tiny-code", dtype=jnp.float32)


@pytest.fixture(scope="module")
def stream():
    return np.random.default_rng(0).integers(16, 8000, 4000).astype(np.uint16)


@pytest.fixture(scope="module")
def greedy(beam, stream):
    return S.greedy_windows(beam, stream, num_windows=2, window=40, greedy_tokens=12, seed=3, batch_size=2)


def test_config_matches_the_target(beam):
    assert CONFIG.hidden_size == beam.config.hidden_size and CONFIG.vocab_size == beam.config.vocab_size
    assert max(CONFIG.target_layer_ids) < beam.config.num_hidden_layers
    assert beam.tokenizer.token_to_id("<|mask|>") == CONFIG.mask_token_id
    # The serving engine keeps the drafter's context K/V in the target's page arrays.
    assert (CONFIG.num_key_value_heads, CONFIG.head_dim) == (beam.config.num_key_value_heads, beam.config.head_dim)


def test_target_features_are_the_targets_argmax_and_residual_stream(beam, stream):
    tokens = jnp.asarray(stream[:80].reshape(2, 40).astype(np.int32))
    hidden, labels = jax.jit(
        lambda t: S.target_features(beam.params, t, target_config=beam.config, layer_ids=CONFIG.target_layer_ids)
    )(tokens)
    out = beam.forward(tokens, hidden_layers=CONFIG.target_layer_ids)
    np.testing.assert_array_equal(labels, np.asarray(jnp.argmax(out.logits, -1)))
    np.testing.assert_allclose(hidden, jnp.concatenate(out.hidden_states, -1), rtol=1e-4, atol=1e-4)


def test_greedy_windows_end_in_the_targets_greedy_chain(beam, stream, greedy):
    prompts = greedy[:, :28]
    assert all(any((stream[s : s + 28] == p).all() for s in range(len(stream) - 27)) for p in prompts)
    chains = greedy_generate(beam.params, beam.config, [list(map(int, p)) for p in prompts], 12)
    np.testing.assert_array_equal(greedy[:, 28:], chains)
    # So from every anchor in the generated part the labels are the chain, all of it.
    _, labels = S.target_features(
        beam.params, jnp.asarray(greedy), target_config=beam.config, layer_ids=CONFIG.target_layer_ids
    )
    anchors = jnp.broadcast_to(jnp.arange(27, 40 - 3), (len(greedy), 10))
    targets, valid = S.chain_targets(jnp.asarray(greedy), labels, anchors, 3)
    assert float(valid.min()) == 1.0
    np.testing.assert_array_equal(targets[:, 0], greedy[:, 28:31])


def test_chain_targets_stop_where_the_window_leaves_the_chain():
    tokens = jnp.asarray([[10, 11, 12, 13, 14, 15]])
    labels = jnp.asarray([[11, 12, 99, 14, 15, 16]])  # the target predicts 99 after 12, the window has 13
    targets, valid = S.chain_targets(tokens, labels, jnp.asarray([[0, 2]]), 3)
    np.testing.assert_array_equal(targets, [[[11, 12, 99], [99, 14, 15]]])
    # From anchor 0: drafts 1..3 follow the chain 11, 12, 99 (tokens 1, 2 agree). From anchor 2: the
    # chain starts 99, but the window goes on with 13, so labels after it are not the chain.
    np.testing.assert_array_equal(valid, [[[1, 1, 1], [1, 0, 0]]])


def test_training_stream_never_reads_heldout_files(beam, monkeypatch):
    read = []
    original = corpus.read_sources
    monkeypatch.setattr(corpus, "read_sources", lambda root, paths: read.extend(paths) or original(root, paths))
    stream = S.training_stream(beam.tokenizer, max_files=3, seed=0)
    assert stream.size > 0 and len(read) == 3
    assert not set(read) & set(corpus.read_heldout_list())


def test_a_few_steps_lower_the_distillation_loss(beam, stream, greedy):
    embed, head = S.target_head(beam)
    tokens = jnp.asarray(np.concatenate([greedy, stream[:160].reshape(4, 40).astype(np.int32)]))
    hidden, labels = S.target_features(
        beam.params, tokens, target_config=beam.config, layer_ids=CONFIG.target_layer_ids
    )
    anchors = jnp.asarray(np.random.default_rng(0).integers(8, 40 - 3, (len(tokens), 6)))
    loss_fn = jax.jit(
        lambda flat: S.distill_loss(flat, embed, head, hidden, tokens, labels, anchors, config=CONFIG, decay=4.0)
    )
    distill = S.DistillConfig(
        steps=6, lr=3e-3, warmup_steps=1, window=40, corpus_windows=2, greedy_windows=2, greedy_tokens=12,
        anchors_per_window=6, min_anchor=8,
    )  # fmt: skip
    before = float(loss_fn(S.init_flat(CONFIG))[0])
    flat, history = S.train_drafter(beam, CONFIG, distill, stream, greedy, log=lambda _: None, log_every=1)
    after = float(loss_fn(flat)[0])
    assert len(history) == 6 and after < before - 0.5, (before, after, history)


def test_accept_length_is_matching_prefix_plus_bonus():
    greedy = np.array([[5, 6, 7, 8, 9]] * 4)
    drafts = np.array(
        [
            [5, 6, 7, 0, 9],  # first 3 match: 3 accepted + bonus
            [0, 6, 7, 8, 9],  # first misses: only the target's own token
            [5, 6, 7, 8, 9],  # all match: 5 + bonus
            [5, 0, 7, 8, 9],  # a later match after a miss does not count
        ]
    )
    np.testing.assert_array_equal(S.accept_lengths(drafts, greedy), [4, 1, 6, 2])


def test_measure_acceptance_with_a_drafter_that_copies_the_chain(beam, stream, monkeypatch):
    """The measurement's greedy chain is the target's greedy generation: a drafter replaced by one
    proposing exactly that chain gets the maximum accept length, a wrong one gets 1."""
    prefix = 24
    starts = np.random.default_rng(5).integers(0, len(stream) - prefix, 2)
    chains = greedy_generate(beam.params, beam.config, [list(map(int, stream[s : s + prefix])) for s in starts], 3)
    for drafts, expected in ((np.asarray(chains), 4.0), (np.full((2, 3), 1), 1.0)):
        monkeypatch.setattr(D, "jit_propose", lambda *a, _d=drafts, **k: D.Proposal(jnp.asarray(_d), None))
        result = S.measure_acceptance(
            beam,
            CONFIG,
            D.init_drafter_params(CONFIG, dtype=jnp.float32),
            stream,
            num_prompts=2,
            prefix_len=prefix,
            seed=5,
            batch_size=2,
        )
        assert result["mean_accept_length"] == expected


@pytest.mark.slow
def test_shipped_drafter_accepts_three_tokens_per_step_on_heldout_code(beam):
    """beam-tiny-code-dflash (benchmarks/train/RESULTS.md: 3.54 over 512 held-out prompts here, 3.56
    on the GPU): the issue's bar of a mean accept length >= 3, greedy, on 32 held-out prompts, offline.
    Slow (a minute); CI checks the same bar through the engine instead
    (tests/serving/test_speculative_engine.py::test_shipped_drafter_accepts_three_tokens_per_step_and_stays_lossless)."""
    config, params = D.load_drafter(DRAFTER_DIR, dtype=jnp.float32)
    assert (config.num_key_value_heads, config.head_dim) == (beam.config.num_key_value_heads, beam.config.head_dim)
    assert config.block_size == 8 and (DRAFTER_DIR / "model.safetensors").stat().st_size < 8e6
    heldout = data.load_heldout_tokens(beam.tokenizer)
    result = S.measure_acceptance(beam, config, params, heldout, num_prompts=32, batch_size=32)
    assert result["mean_accept_length"] >= 3.0, result


@pytest.mark.parametrize("name", ["beam-tiny", "beam-tiny-code", "beam-tp8-slice", "beam-501b"])
def test_drafter_shape_suits_any_target_in_the_engine(name):
    """`drafter_for` gives every target a drafter the serving engine takes (shared embedding width,
    vocabulary, KV shape for the shared pages, feature layers inside the target)."""
    from beam_jax.api import checkpoint_dir
    from beam_jax.checkpoint import read_config
    from beam_jax.config import PRESETS, preset
    from serving.speculative_step import check_drafter

    target = preset(name) if name in PRESETS else read_config(checkpoint_dir(name))
    check_drafter(S.drafter_for(target), target)
