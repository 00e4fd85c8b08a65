"""Held-out quality of a checkpoint: next-token loss, perplexity and accuracy on the committed
held-out files (`beam_jax/train/heldout_files.txt`), beside the unigram baseline of the tokenizer.

The model runs its inference path (`beam_jax.model.forward`, quantized experts dequantized on
CPU, the Pallas kernels on GPU), so BF16, FP8 and NVFP4 checkpoints compare on the same tokens.
The unigram baseline is the entropy of the held-out tokens' own frequencies: the best any model
that ignores context could score on them (an optimistic baseline, so beating it means something).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from beam_jax.api import load
from beam_jax.config import BeamConfig
from beam_jax.model import forward
from beam_jax.train.data import load_heldout_tokens
from beam_jax.train.loop import consecutive_windows


@functools.partial(jax.jit, static_argnames="config")
def _window_sums(params, windows, *, config: BeamConfig):
    inputs, targets = windows[:, :-1], windows[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    logits = forward(params, inputs, positions, config=config).logits
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    return nll.sum(), (jnp.argmax(logits, axis=-1) == targets).sum()


def unigram_loss(targets: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(targets, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def evaluate(
    model: str | Path,
    *,
    seq_len: int = 1024,
    batch_size: int = 8,
    max_windows: int | None = None,
    corpus_dir: Path | None = None,
    dtype=None,
) -> dict[str, float | int | str]:
    beam = load(model, dtype=dtype)
    stream = load_heldout_tokens(beam.tokenizer, corpus_dir).astype(np.int32)
    windows = consecutive_windows(stream, seq_len)[:max_windows]
    nll = correct = 0.0
    for start in range(0, len(windows), batch_size):
        n, c = _window_sums(beam.params, jnp.asarray(windows[start : start + batch_size]), config=beam.config)
        nll, correct = nll + float(n), correct + float(c)
    count = windows.shape[0] * seq_len
    baseline = unigram_loss(windows[:, 1:].reshape(-1), beam.config.vocab_size)
    return {
        "model": str(model),
        "expert_format": beam.config.expert_format,
        "tokens": count,
        "loss": nll / count,
        "perplexity": math.exp(nll / count),
        "accuracy": correct / count,
        "unigram_loss": baseline,
        "unigram_perplexity": math.exp(baseline),
    }
