"""Drafter distillation (beam_jax/train/distill.py) for the trained target beam-tiny-code: the data's
labels are the target's argmax (and the greedy part of a window is the target's greedy chain), a few
AdamW steps lower the distillation loss, and the accept length is the longest matching prefix plus
the bonus token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import beam_jax
from beam_jax import drafter as D
from beam_jax.generate import greedy_generate
from beam_jax.train import corpus
from beam_jax.train import distill as S

CONFIG = S.drafter_tiny_code(block_size=4)


@pytest.fixture(scope="module")
def beam():
    return beam_jax.load("beam-tiny-code", dtype=jnp.float32)


@pytest.fixture(scope="module")
def stream():
    return np.random.default_rng(0).integers(16, 8000, 4000).astype(np.uint16)


@pytest.fixture(scope="module")
def dataset(beam, stream):
    return S.build_dataset(beam, stream, CONFIG, num_windows=4, window=40, greedy_tokens=12, seed=3, batch_size=4)


def test_config_matches_the_target(beam):
    assert CONFIG.hidden_size == beam.config.hidden_size and CONFIG.vocab_size == beam.config.vocab_size
    assert max(CONFIG.target_layer_ids) < beam.config.num_hidden_layers
    assert beam.tokenizer.token_to_id("<|mask|>") == CONFIG.mask_token_id


def test_labels_are_the_targets_argmax_and_hidden_its_residual_stream(beam, dataset):
    tokens = dataset["tokens"]
    out = beam.forward(tokens, hidden_layers=CONFIG.target_layer_ids)
    np.testing.assert_array_equal(dataset["labels"], np.asarray(jnp.argmax(out.logits, -1)))
    np.testing.assert_allclose(
        dataset["hidden"].astype(np.float32),
        np.asarray(jnp.concatenate(out.hidden_states, -1).astype(jnp.bfloat16).astype(jnp.float32)),
        rtol=0,
        atol=1e-6,
    )
    # On the generated part, every label is the next token: the target's own greedy chain.
    first = int(dataset["first_anchor"])
    assert first == 40 - 12 - 1
    np.testing.assert_array_equal(dataset["labels"][:, first:-1], tokens[:, first + 1 :])
    [continuation] = greedy_generate(beam.params, beam.config, [list(map(int, tokens[0, :28]))], 12)
    np.testing.assert_array_equal(tokens[0, 28:], continuation)


def test_training_stream_never_reads_heldout_files(beam, monkeypatch):
    read = []
    original = corpus.read_sources
    monkeypatch.setattr(corpus, "read_sources", lambda root, paths: read.extend(paths) or original(root, paths))
    stream = S.training_stream(beam.tokenizer, max_files=3, seed=0)
    assert stream.size > 0 and len(read) == 3
    assert not set(read) & set(corpus.read_heldout_list())


def test_a_few_steps_lower_the_distillation_loss(beam, dataset):
    embed, head = S.target_head(beam)
    data = {k: jnp.asarray(v) for k, v in dataset.items() if k != "first_anchor"}
    anchors = jnp.asarray(np.random.default_rng(0).integers(int(dataset["first_anchor"]), 40 - 3, (4, 6)))
    loss_fn = jax.jit(
        lambda flat: S.distill_loss(
            flat, embed, head, data["hidden"], data["tokens"], data["labels"], anchors, config=CONFIG, decay=4.0
        )
    )
    flat = S.init_flat(CONFIG)
    before = float(loss_fn(flat)[0])
    flat, history = S.train_drafter(
        beam,
        CONFIG,
        dataset,
        steps=6,
        lr=3e-3,
        windows_per_step=4,
        anchors_per_window=6,
        log=lambda _: None,
        log_every=1,
    )
    after = float(loss_fn(flat)[0])
    assert after < before - 0.5, (before, after, history)


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
