"""Training (beam_jax/train): dense experts against the reference, the step, the bias rule, the
corpus split, the evaluation, and the shipped beam-tiny-code checkpoint."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from beam_jax.api import SHIPPED_MODELS, load
from beam_jax.config import preset
from beam_jax.layers.moe import compute_experts, dense_experts_for_training, experts_dense, experts_reference
from beam_jax.model import abstract_flat, flat_params, forward, init_params, params_from_flat
from beam_jax.tokenizer import load_tokenizer
from beam_jax.train import corpus
from beam_jax.train.evaluate import evaluate, unigram_loss
from beam_jax.train.loop import (
    TrainConfig,
    TrainState,
    balance_correction_bias,
    consecutive_windows,
    make_train_step,
    optimizer,
    parameter_count,
    train,
)
from beam_jax.train.tiny_code import beam_tiny_code_config, write_model


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"), [(1, 4, 2, 8, 6), (37, 12, 4, 24, 10), (5, 16, 8, 16, 3)]
)
def test_dense_experts_equal_the_reference(tokens, experts, top_k, hidden, inter):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(experts, 2 * inter, hidden)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(experts, hidden, inter)), jnp.float32)
    indices = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    np.testing.assert_allclose(
        experts_dense(x, weights, indices, gate_up, down),
        experts_reference(x, weights, indices, gate_up, down),
        rtol=1e-5,
        atol=1e-5,
    )


def test_bias_rule_moves_toward_balance():
    config = preset("beam-tiny")
    sparse = [i for i in range(config.num_hidden_layers) if config.is_sparse(i)]
    master = {f"model.layers.{i}.mlp.gate.e_score_correction_bias": jnp.zeros(config.num_experts) for i in sparse}
    # Expert 0 gets every pick of the first layer; the others' loads stay below the mean.
    chosen = [jnp.zeros((3, 5, 1), jnp.int32)] + [jnp.arange(16).reshape(1, 16, 1)] * (len(sparse) - 1)
    updated = balance_correction_bias(config, master, tuple(chosen), rate=0.01)
    first = np.asarray(updated[f"model.layers.{sparse[0]}.mlp.gate.e_score_correction_bias"])
    assert first[0] == pytest.approx(-0.01) and np.allclose(first[1:], 0.01)
    balanced = np.asarray(updated[f"model.layers.{sparse[1]}.mlp.gate.e_score_correction_bias"])
    assert np.allclose(balanced, 0.0)  # equal loads: sign(0) = 0


def _tiny_train_config(**changes) -> TrainConfig:
    return TrainConfig(
        **{
            "steps": 40,
            "batch_size": 4,
            "seq_len": 32,
            "peak_lr": 1e-2,
            "warmup_steps": 5,
            "compute_dtype": "float32",
            **changes,
        }
    )


def test_training_learns_a_repeating_stream_and_only_the_rule_moves_the_bias():
    config = preset("beam-tiny")
    rng = np.random.default_rng(0)
    stream = np.tile(rng.integers(16, config.vocab_size, 50), 40).astype(np.uint16)  # a period of 50 tokens
    master, history = train(
        config, _tiny_train_config(bias_update_rate=0.0), stream, stream[:200], eval_every=20, log=lambda _: None
    )
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["heldout_loss"] < history[0]["heldout_loss"] - 2.0
    assert [r["step"] for r in history] == [1, 20, 40]
    biases = [n for n in master if n.endswith("e_score_correction_bias")]
    assert biases and all(np.all(np.asarray(master[n]) == 0) for n in biases)  # no gradient, no weight decay


def test_a_step_moves_the_bias_by_the_rate_and_is_reproducible():
    config = preset("beam-tiny")
    train_config = _tiny_train_config(steps=2, bias_update_rate=0.125)
    stream = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, 500), jnp.int32)
    master = flat_params(init_params(config, 0, jnp.float32))
    tx = optimizer(train_config, list(master))
    step = make_train_step(config, train_config, tx)
    results = []
    for _ in range(2):  # the same key gives the same step (fresh copies: the step donates its state)
        copy = {n: jnp.array(a, copy=True) for n, a in master.items()}
        state = TrainState(copy, tx.init(copy))
        state, metrics = step(state, stream, jax.random.key(7))
        results.append((state, float(metrics["loss"])))
    assert results[0][1] == results[1][1]
    for name in master:
        if name.endswith("e_score_correction_bias"):
            moved = np.abs(np.asarray(results[0][0].master[name]))
            assert set(np.round(moved, 6)) <= {0.0, 0.125} and moved.max() == 0.125


def test_consecutive_windows_cover_every_target_once():
    stream = np.arange(10)
    windows = consecutive_windows(stream, 3)
    assert windows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="shorter than one window"):
        consecutive_windows(np.arange(3), 3)


def test_heldout_list_follows_the_hash_rule_and_is_disjoint_from_training():
    heldout = corpus.read_heldout_list()
    assert len(heldout) > 20 and all(corpus.is_heldout(p) for p in heldout)
    train_paths, heldout_paths = corpus.split(sorted(set(heldout) | {"a.py", "pkg/b.py", "json/decoder.py"}))
    assert set(heldout_paths) == set(heldout) and not set(train_paths) & set(heldout)


def test_chat_documents_use_the_chat_tokens():
    source = "".join(f"x{i} = {i}\n" for i in range(30))
    document = corpus.chat_document(source)
    assert document.endswith("x29 = 29\n<|return|>") and "<|channel|>final<|message|>x12 = 12" in document
    assert "```python\nx0 = 0\n" in document and "x11 = 11\n```<|end|>" in document
    ids = corpus.token_stream(load_tokenizer(), [document])
    assert ids[0] == 1 and 5 in ids and ids[-1] == 0  # <|start|>, <|return|>, then the separator
    assert corpus.chat_document("short\n") is None


def test_unigram_loss_is_the_entropy_of_the_frequencies():
    assert unigram_loss(np.array([3, 3, 5, 5]), 8) == pytest.approx(np.log(2))
    assert unigram_loss(np.array([1, 1, 1]), 8) == 0.0


def test_written_model_loads_with_the_same_logits(tmp_path):
    config = preset("beam-tiny")
    master = flat_params(init_params(config, 3, jnp.float32))
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text(load_tokenizer().to_str())
    write_model(tmp_path / "model", config, master, tokenizer_dir)
    beam = load(tmp_path / "model", dtype=jnp.bfloat16)
    tokens = jnp.asarray([[1, 20, 300, 4000]])
    expected_params = {n: a.astype(abstract_flat(config)[n].dtype) for n, a in master.items()}
    expected = forward(params_from_flat(config, expected_params), tokens, jnp.arange(4)[None], config=config).logits
    np.testing.assert_array_equal(beam.forward(tokens).logits, expected)


def test_shipped_model_is_the_recipe_and_small():
    path = SHIPPED_MODELS["beam-tiny-code"]
    stored = json.loads((path / "config.json").read_text())
    recipe = beam_tiny_code_config()
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_experts",
        "sliding_window",
        "layer_types",
        "mlp_layer_types",
    ):
        assert stored[field] == (
            list(getattr(recipe, field)) if isinstance(getattr(recipe, field), tuple) else getattr(recipe, field)
        )
    assert parameter_count(recipe) < 13e6
    assert sum(f.stat().st_size for f in path.glob("*.safetensors")) < 25e6


def test_shipped_model_beats_the_unigram_baseline_on_heldout_code():
    """Two windows here (the whole held-out set is benchmarks/train/RESULTS.md's table)."""
    result = evaluate("beam-tiny-code", max_windows=2)
    assert result["tokens"] == 2048
    assert result["perplexity"] < 0.1 * result["unigram_perplexity"]
    assert result["accuracy"] > 0.4


def test_trained_model_reuses_names_from_the_prompt():
    beam = load("beam-tiny-code")
    # No final newline: the tokenizer merges a newline with the next line's indent.
    prompt = "def scale_vector(vector, factor):\n    result = []\n    for item in vector:"
    continuation = beam.generate(prompt, max_new_tokens=24)
    assert "result" in continuation or "factor" in continuation or "item" in continuation, continuation


def test_dense_experts_refuse_quantized_or_sharded_experts():
    x, w, i = jnp.ones((2, 4)), jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32)
    with dense_experts_for_training(), pytest.raises(ValueError, match="unquantized experts on one device"):
        compute_experts({}, x, w, i, expert_format="nvfp4")


@pytest.mark.reference
def test_trained_model_matches_transformers_in_fp32():
    """The compare command's check on the shipped checkpoint, with a held-out file as the prompt."""
    pytest.importorskip("transformers", minversion="5.23")
    pytest.importorskip("torch")
    from beam_jax.checkpoint import load_checkpoint
    from beam_jax.compare import compare_outputs, load_reference, run_jax, run_reference

    path = SHIPPED_MODELS["beam-tiny-code"]
    config, params = load_checkpoint(path, dtype=jnp.float32, progress=False)
    source = (corpus.stdlib_dir() / corpus.read_heldout_list()[0]).read_text()
    tokens = np.asarray(load_tokenizer(path).encode(source).ids[:200])
    result = compare_outputs(
        [(run_jax(params, config, tokens), run_reference(load_reference(str(path), "float32"), tokens))]
    )
    assert result.logits_error <= 1e-4, result
    assert sum(result.routing_disagreements.values()) == 0, result
