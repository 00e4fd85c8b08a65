"""Training a small Beam with the project's own model: AdamW on fp32 master weights, the forward
in bf16 (the router in fp32, as always), next-token cross-entropy, and the correction bias moved
by the auxiliary-loss-free rule instead of by gradients.

Batches are random windows of the token stream, drawn on the device from a seeded key, so a run
is reproduced by its seed and step count. Each step is one jitted program.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from beam_jax.config import BeamConfig
from beam_jax.layers.moe import dense_experts_for_training
from beam_jax.model import abstract_flat, flat_params, forward, init_params, params_from_flat

CORRECTION_BIAS = "e_score_correction_bias"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int = 32
    seq_len: int = 1024
    peak_lr: float = 3e-3
    warmup_steps: int = 200
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # Auxiliary-loss-free balancing: each step, bias += rate * sign(mean load - expert load).
    bias_update_rate: float = 1e-3
    seed: int = 0
    compute_dtype: str = "bfloat16"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    master: dict[str, jax.Array]  # fp32, by HF name
    opt_state: optax.OptState


def learning_rate(train: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0,
        train.peak_lr,
        train.warmup_steps,
        max(train.steps, train.warmup_steps + 1),
        end_value=train.peak_lr * train.final_lr_ratio,
    )


def optimizer(train: TrainConfig, names: list[str]) -> optax.GradientTransformation:
    """AdamW with decay on matrices only; the correction bias is not a gradient parameter."""
    labels = {n: "fixed" if n.endswith(CORRECTION_BIAS) else "trained" for n in names}
    adamw = optax.adamw(
        learning_rate(train),
        b1=0.9,
        b2=0.95,
        weight_decay=train.weight_decay,
        mask=lambda params: {n: getattr(p, "ndim", 0) >= 2 for n, p in params.items()},  # MaskedNode: 0
    )
    return optax.chain(
        optax.clip_by_global_norm(train.grad_clip),
        optax.multi_transform({"trained": adamw, "fixed": optax.set_to_zero()}, labels),
    )


def compute_params(config: BeamConfig, master: dict[str, jax.Array], dtype) -> dict[str, jax.Array]:
    """Master weights cast to the dtypes a `dtype` model has (the router stays fp32)."""
    target = abstract_flat(config, dtype)
    return {n: a.astype(target[n].dtype) for n, a in master.items()}


def token_loss(
    config: BeamConfig, params: dict[str, jax.Array], windows: jax.Array
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """Per-token cross-entropy and correctness of `windows[:, 1:]` given the prefixes, and the
    experts each sparse layer chose. Experts run dense (differentiable)."""
    inputs, targets = windows[:, :-1].astype(jnp.int32), windows[:, 1:].astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    with dense_experts_for_training():
        out = forward(params_from_flat(config, params), inputs, positions, config=config, return_routing=True)
    log_probs = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    correct = jnp.argmax(out.logits, axis=-1) == targets
    return nll, correct, out.expert_indices


def balance_correction_bias(
    config: BeamConfig, master: dict[str, jax.Array], expert_indices: tuple[jax.Array, ...], rate: float
) -> dict[str, jax.Array]:
    """DeepSeek-V3's rule: raise the bias of underloaded experts, lower it for overloaded ones."""
    sparse_layers = [i for i in range(config.num_hidden_layers) if config.is_sparse(i)]
    updated = dict(master)
    for layer, chosen in zip(sparse_layers, expert_indices, strict=True):
        load = jnp.bincount(chosen.reshape(-1), length=config.num_experts).astype(jnp.float32)
        name = f"model.layers.{layer}.mlp.gate.{CORRECTION_BIAS}"
        updated[name] = master[name] + rate * jnp.sign(load.mean() - load)
    return updated


def global_norm(tree) -> jax.Array:
    """The L2 norm over every leaf (optax renamed its helper between versions; this one is stable)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree)))


def make_train_step(config: BeamConfig, train: TrainConfig, tx: optax.GradientTransformation) -> Callable:
    dtype = jnp.dtype(train.compute_dtype)

    def loss_fn(master, windows):
        nll, correct, routing = token_loss(config, compute_params(config, master, dtype), windows)
        return nll.mean(), (correct.mean(), routing)

    def step(state: TrainState, stream: jax.Array, key: jax.Array):
        starts = jax.random.randint(key, (train.batch_size,), 0, stream.shape[0] - train.seq_len - 1)
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (train.seq_len + 1,)))(starts)
        (loss, (accuracy, routing)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.master, windows)
        updates, opt_state = tx.update(grads, state.opt_state, state.master)
        master = optax.apply_updates(state.master, updates)
        master = balance_correction_bias(config, master, routing, train.bias_update_rate)
        metrics = {"loss": loss, "accuracy": accuracy, "grad_norm": global_norm(grads)}
        return TrainState(master, opt_state), metrics

    return jax.jit(step, donate_argnums=0)


def make_eval(config: BeamConfig, train: TrainConfig) -> Callable:
    """Mean loss and accuracy over consecutive `seq_len` windows of a stream (the training forward)."""
    dtype = jnp.dtype(train.compute_dtype)

    @jax.jit
    def batch_sums(master, windows):
        nll, correct, _ = token_loss(config, compute_params(config, master, dtype), windows)
        return nll.sum(), correct.sum()

    def evaluate(master, stream: np.ndarray) -> dict[str, float]:
        windows = consecutive_windows(stream, train.seq_len)
        nll = correct = 0.0
        for start in range(0, len(windows), train.batch_size):
            n, c = batch_sums(master, jnp.asarray(windows[start : start + train.batch_size]))
            nll, correct = nll + float(n), correct + float(c)
        count = windows.shape[0] * train.seq_len
        return {"loss": nll / count, "accuracy": correct / count}

    return evaluate


def consecutive_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """`[n, seq_len + 1]` windows that overlap by one token, so every token but the first is a
    target exactly once (a tail shorter than a window is dropped)."""
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise ValueError(f"a stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[index]


def train(
    config: BeamConfig,
    train_config: TrainConfig,
    train_stream: np.ndarray,
    heldout_stream: np.ndarray,
    *,
    eval_every: int = 250,
    log: Callable[[str], None] = print,
    time_limit_s: float | None = None,
) -> tuple[dict[str, jax.Array], list[dict]]:
    """Runs `train_config.steps` steps (fewer if `time_limit_s` runs out, which the history says)
    and returns the fp32 master weights and the history (step, train and held-out metrics, time)."""
    master = {
        n: a.astype(jnp.float32) for n, a in flat_params(init_params(config, train_config.seed, jnp.float32)).items()
    }
    tx = optimizer(train_config, list(master))
    state = TrainState(master, tx.init(master))
    step_fn, evaluate = make_train_step(config, train_config, tx), make_eval(config, train_config)
    stream = jnp.asarray(train_stream.astype(np.int32))
    key = jax.random.key(train_config.seed)
    history, tokens_per_step = [], train_config.batch_size * train_config.seq_len
    start = time.perf_counter()
    # Training throughput counts steps 2.. between evaluations: not the compile, not the evals.
    train_time, timed_steps, segment_start = 0.0, 0, None
    for step in range(1, train_config.steps + 1):
        state, metrics = step_fn(state, stream, jax.random.fold_in(key, step))
        last = step == train_config.steps or (time_limit_s is not None and time.perf_counter() - start > time_limit_s)
        if step % eval_every and step != 1 and not last:
            continue
        metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
        if segment_start is not None:
            train_time += time.perf_counter() - segment_start
            timed_steps = step - 1
        record = {"step": step, "lr": float(learning_rate(train_config)(step - 1)), **metrics}
        record |= {f"heldout_{k}": v for k, v in evaluate(state.master, heldout_stream).items()}
        record["elapsed_s"] = round(time.perf_counter() - start, 2)
        record["train_tokens_per_s"] = round(timed_steps * tokens_per_step / train_time) if train_time else None
        history.append(record)
        log(json.dumps(record))
        segment_start = time.perf_counter()
        if last:
            if step < train_config.steps:
                log(f"time limit: stopped after {step} of {train_config.steps} steps")
            break
    return state.master, history


def save_history(path: Path, train_config: TrainConfig, history: list[dict], **extra) -> None:
    record = {"train_config": dataclasses.asdict(train_config), **extra, "history": history}
    path.write_text(json.dumps(record, indent=1) + "\n")


def parameter_count(config: BeamConfig) -> int:
    return sum(math.prod(leaf.shape) for leaf in abstract_flat(config).values())
