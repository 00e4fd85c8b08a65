"""Distilling a DFlash drafter for a target on the target's own greedy predictions, and measuring
the drafter's offline acceptance.

    python -m beam_jax.train.distill train --out DIR [--data .traindata] [--steps N ...]
    python -m beam_jax.train.distill evaluate --drafter DIR            # mean accept length on held-out

`--target` is any model `beam_jax.load` takes (a shipped name, a preset, a directory); the drafter
is shaped for it (`drafter_for`). Acceptance only means something for a trained target: on
beam-tiny or beam-tp8-slice (random weights) the script runs (a CPU smoke test, a GPU timing), but
nothing learnable links the target's greedy chain to its features.

Data: windows of the target's training tokens (the corpus's training files only, never the
committed held-out list): fresh corpus windows drawn every step, and optionally a fixed set of
windows whose last `greedy_tokens` are the target's own greedy continuation (`greedy_windows`, built
once; serving drafts over the target's greedy output, which is more repetitive than the corpus).
Only tokens are stored: each training step runs the target over its windows (`target_features`) for
the drafter's inputs, the residual stream after `config.target_layer_ids` concatenated, and the
labels, the target's argmax next token at every position.

Labels of a block are the target's greedy chain from the anchor: draft j learns `labels[a + j - 1]`,
which is the chain's token j only if the window's tokens `a + 1 .. a + j - 1` are the chain's
earlier tokens (`chain_targets`); elsewhere draft j is not trained. On greedy-generated tokens that
always holds; on corpus tokens it holds where the target predicted the corpus.

Training (`train_drafter`): an anchor at position a of a window, context = the target hidden states of
positions < a, block `[token_a, mask, ...]` at positions a..a+N; cross-entropy of draft j weighted by
`exp(-(j - 1) / decay)` (early drafts matter most: a miss ends the block). AdamW (optax) on fp32
drafter weights, warm-up then cosine decay over the steps or the time limit, whichever ends first;
the target's embedding and lm_head are shared and frozen.

Acceptance (`measure_acceptance`): held-out prompts of `prefix_len` tokens; the target's greedy chain
of N tokens after each prompt; the drafter proposes N drafts from the anchor (the prompt's last token)
and the context (the target's hidden states of the rest); accept length = longest prefix of drafts
equal to the chain, plus the bonus token (1..N+1), as greedy verification in serving/speculative.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import beam_jax
from beam_jax import drafter as D
from beam_jax.config import BeamConfig
from beam_jax.generate import greedy_generate
from beam_jax.layers.moe import dense_experts_for_training
from beam_jax.model import flat_params, forward
from beam_jax.train import corpus, data
from beam_jax.train.tiny_code import beam_tiny_code_config

MASK_TOKEN_ID = 8  # the project tokenizer's <|mask|>


def drafter_for(
    target: BeamConfig, block_size: int = 8, num_layers: int = 2, intermediate_size: int = 512, num_features: int = 3
) -> D.DrafterConfig:
    """A DFlash drafter shaped for `target`: its width, vocabulary, window and attention heads (KV
    heads and head size must be the target's: the serving engine keeps the drafter's context K/V in
    the target's page arrays), features from `num_features` target layers spread from layer 1 to the
    second last (beam-tiny-code: 1, 4, 7), block-local convolutions, no candidate selector (drafts are
    the argmax; the selector is not trained here). The shipped drafter for beam-tiny-code
    (assets/beam-tiny-code-dflash) is `num_layers=4, intermediate_size=768`; the defaults are small
    for CPU runs."""
    last = target.num_hidden_layers - 1
    features = sorted({round(1 + i * (last - 1) / max(num_features - 1, 1)) for i in range(num_features)})
    return D.DrafterConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        sliding_window=target.sliding_window,
        max_position_embeddings=target.max_position_embeddings,
        block_size=block_size,
        target_layer_ids=tuple(features),
        mask_token_id=MASK_TOKEN_ID,
        conv_kernel_size=2,
        conv_group_size=target.hidden_size // 8,
        selector_rank=None,
        selector_top_k=None,
        final_logit_softcapping=30.0,
    )


def drafter_tiny_code(block_size: int = 8, num_layers: int = 2, intermediate_size: int = 512) -> D.DrafterConfig:
    """The drafter shape for `beam-tiny-code` (hidden 256, vocabulary 8192, 8 layers)."""
    return drafter_for(beam_tiny_code_config(), block_size, num_layers, intermediate_size)


# ---- the target ------------------------------------------------------------------------------------
def target_head(beam) -> tuple[jax.Array, jax.Array]:
    """The target's embedding and lm_head (the embedding twice when tied), fp32."""
    flat = flat_params(beam.params)
    embed = flat["model.embed_tokens.weight"]
    head = embed if beam.config.tie_word_embeddings else flat["lm_head.weight"]
    return embed.astype(jnp.float32), head.astype(jnp.float32)


def target_features(target_params, tokens, *, target_config, layer_ids: tuple[int, ...]):
    """`[B, T, hidden * len(layer_ids)]` hidden states (the target's dtype) and `[B, T]` argmax next
    tokens of windows `tokens [B, T]` at positions 0..T-1. Traceable: the training step calls it.
    Experts run dense (plain einsums, fast at training batch sizes on any backend)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    with dense_experts_for_training():
        out = forward(target_params, tokens, positions, config=target_config, hidden_layers=layer_ids)
    hidden = jax.lax.stop_gradient(jnp.concatenate(out.hidden_states, axis=-1))
    return hidden, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)


# ---- data ------------------------------------------------------------------------------------------
def training_stream(tokenizer, max_files: int | None = None, seed: int = 0, root: Path | None = None) -> np.ndarray:
    """The token stream of (a seeded sample of) the corpus's training files: the committed held-out
    files are never read."""
    root = corpus.stdlib_dir() if root is None else Path(root)
    paths = corpus.training_paths(corpus.source_files(root))
    if max_files is not None and max_files < len(paths):
        pick = np.random.default_rng(seed).choice(len(paths), max_files, replace=False)
        paths = [paths[i] for i in sorted(pick)]
    return corpus.token_stream(tokenizer, corpus.read_sources(root, paths))


def greedy_windows(
    beam,
    stream: np.ndarray,
    *,
    num_windows: int,
    window: int,
    greedy_tokens: int,
    seed: int = 0,
    batch_size: int = 16,
    time_limit_s: float | None = None,
) -> np.ndarray:
    """`[n, window]` int32: the first `window - greedy_tokens` tokens of a random stretch of `stream`,
    then the target's greedy continuation of them. Built in batches; stops early (fewer windows)
    once `time_limit_s` has passed."""
    if not 0 < greedy_tokens < window:
        raise ValueError(f"greedy_tokens must be in (0, {window}), got {greedy_tokens}")
    rng = np.random.default_rng(seed)
    prompt_len = window - greedy_tokens
    starts = rng.integers(0, len(stream) - prompt_len, num_windows)
    windows = np.zeros((num_windows, window), np.int32)
    windows[:, :prompt_len] = np.stack([stream[s : s + prompt_len] for s in starts])
    start, done = time.perf_counter(), 0
    while done < num_windows:
        rows = [list(map(int, p)) for p in windows[done : done + batch_size, :prompt_len]]
        windows[done : done + len(rows), prompt_len:] = greedy_generate(beam.params, beam.config, rows, greedy_tokens)
        done += len(rows)
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            break
    return windows[:done]


def sample_windows(key, stream: jax.Array, count: int, window: int) -> jax.Array:
    """`count` random windows of `window` tokens of a device-resident stream, int32."""
    starts = jax.random.randint(key, (count,), 0, stream.shape[0] - window + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (window,)))(starts).astype(jnp.int32)


def chain_targets(tokens, labels, anchors, n: int):
    """For anchors `[W, A]` of windows `tokens, labels [W, T]` (`anchors < T - n`): the targets
    `labels[a + j - 1]` of drafts j = 1..n `[W, A, n]`, and where each is the target's greedy chain
    from the anchor: draft j's target is the chain only if tokens `a + 1 .. a + j - 1` are the
    chain's earlier tokens, i.e. `tokens[a + i] == labels[a + i - 1]` for every i < j."""
    w = tokens.shape[0]
    index = (anchors[:, :, None] + jnp.arange(n)[None, None]).reshape(w, -1)
    targets = jnp.take_along_axis(labels, index, axis=1).reshape(*anchors.shape, n)
    following = jnp.take_along_axis(tokens, index + 1, axis=1).reshape(*anchors.shape, n)
    agrees = (following == targets).astype(jnp.float32)
    valid = jnp.cumprod(jnp.concatenate([jnp.ones_like(agrees[..., :1]), agrees[..., :-1]], axis=-1), axis=-1)
    return targets, valid


# ---- training --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """What a training run draws and how it steps. Each step: `corpus_windows` fresh windows of the
    training stream (anchors from `min_anchor`) and `greedy_windows` rows of the greedy set (anchors
    from the last prompt token, which is always one of them: the held-out measurement's anchor)."""

    steps: int = 500
    lr: float = 2e-3
    warmup_steps: int = 50
    final_lr_ratio: float = 0.1
    window: int = 192
    corpus_windows: int = 8
    greedy_windows: int = 0
    greedy_tokens: int = 64  # the greedy set's generated tail
    anchors_per_window: int = 16
    min_anchor: int = 16
    decay: float = 4.0
    seed: int = 0
    time_limit_s: float | None = None  # the schedule then ends at the limit, if that comes first
    compute_dtype: str | None = None  # default: the target's dtype (fp32 master weights either way)

    def learning_rate(self, step: int, progress: float) -> float:
        """Linear warm-up over `warmup_steps`, then cosine decay to `final_lr_ratio` as `progress`
        (the fraction of steps or of the time limit done) goes 0 -> 1."""
        warmup = min(1.0, step / max(self.warmup_steps, 1))
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * warmup * (self.final_lr_ratio + (1 - self.final_lr_ratio) * cosine)


def block_logits(params, embed, head, hidden, tokens, anchors, *, config: D.DrafterConfig):
    """Draft logits `[W, A, N, vocab]` for anchors `[W, A]` of windows `hidden [W, T, .]`,
    `tokens [W, T]`: the context is the whole window (the block mask hides rows at or after the
    anchor), the block `[tokens[anchor], mask * N]`."""
    w, t = tokens.shape
    a = anchors.shape[1]
    n = config.num_drafts
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (w, t))
    context = D.context_kv(params, hidden.astype(embed.dtype), positions, config=config)
    context = D.DraftContext(
        jnp.repeat(context.keys, a, axis=1), jnp.repeat(context.values, a, axis=1), jnp.repeat(positions, a, axis=0)
    )
    anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    block = jnp.concatenate([anchor_tokens[:, None], jnp.full((w * a, n), config.mask_token_id, jnp.int32)], axis=1)
    block_positions = anchors.reshape(-1)[:, None] + jnp.arange(n + 1, dtype=jnp.int32)[None]
    out = D.draft_forward(
        params, block, block_positions, context, embed_weight=embed, lm_head_weight=head, config=config
    )
    return out.logits.reshape(w, a, n, -1)


def position_weights(n: int, decay: float) -> jax.Array:
    weights = jnp.exp(-jnp.arange(n, dtype=jnp.float32) / decay)
    return weights / weights.sum()


def distill_loss(flat, embed, head, hidden, tokens, labels, anchors, *, config: D.DrafterConfig, decay: float):
    """Weighted cross-entropy of the drafts against the target's greedy chain from each anchor
    (`chain_targets`; each position averaged over the blocks where its target is the chain). Also
    per-position accuracy `[N]` on those blocks and the fraction of them `[N]`. `flat`, `embed` and
    `head` in the compute dtype."""
    params = D.params_from_flat(config, flat)
    logits = block_logits(params, embed, head, hidden, tokens, anchors, config=config)
    targets, valid = chain_targets(tokens, labels, anchors, config.num_drafts)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    count = jnp.maximum(valid.sum(axis=(0, 1)), 1.0)
    loss = ((nll * valid).sum(axis=(0, 1)) / count * position_weights(config.num_drafts, decay)).sum()
    accuracy = ((jnp.argmax(logits, -1) == targets) * valid).sum(axis=(0, 1)) / count
    return loss, {"accuracy": accuracy, "chain_fraction": valid.mean(axis=(0, 1))}


def make_step(config: D.DrafterConfig, target_config, tx, distill: DistillConfig, compute_dtype):
    """One jitted step: draw windows and anchors, run the target over the windows (its hidden states
    and labels are computed here, never stored), and update the drafter by `lr * adamw(grads)`."""
    n = config.num_drafts
    greedy_first_anchor = distill.window - distill.greedy_tokens - 1
    if distill.greedy_windows and greedy_first_anchor < 0:
        raise ValueError(f"greedy_tokens {distill.greedy_tokens} leaves no prompt in a window of {distill.window}")

    def loss_fn(flat, embed, head, hidden, tokens, labels, anchors):
        flat = {k: v.astype(compute_dtype) for k, v in flat.items()}
        return distill_loss(flat, embed, head, hidden, tokens, labels, anchors, config=config, decay=distill.decay)

    @jax.jit
    def step(flat, opt_state, lr, target_params, embed, head, stream, greedy, key):
        corpus_key, greedy_key, anchor_key = jax.random.split(key, 3)
        tokens, lowest = [], []
        if distill.corpus_windows:
            tokens.append(sample_windows(corpus_key, stream, distill.corpus_windows, distill.window))
            lowest.append(jnp.full((distill.corpus_windows,), distill.min_anchor, jnp.int32))
        if distill.greedy_windows:
            tokens.append(greedy[jax.random.randint(greedy_key, (distill.greedy_windows,), 0, greedy.shape[0])])
            lowest.append(jnp.full((distill.greedy_windows,), greedy_first_anchor, jnp.int32))
        tokens, lowest = jnp.concatenate(tokens), jnp.concatenate(lowest)
        anchors = jax.random.randint(
            anchor_key, (len(tokens), distill.anchors_per_window), lowest[:, None], distill.window - n
        )
        anchors = anchors.at[distill.corpus_windows :, 0].set(greedy_first_anchor)
        hidden, labels = target_features(
            target_params, tokens, target_config=target_config, layer_ids=config.target_layer_ids
        )
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            flat, embed.astype(compute_dtype), head.astype(compute_dtype), hidden, tokens, labels, anchors
        )
        updates, opt_state = tx.update(grads, opt_state, flat)
        updates = jax.tree.map(lambda u: lr * u, updates)
        return optax.apply_updates(flat, updates), opt_state, loss, metrics

    return step


def init_flat(config: D.DrafterConfig, seed: int = 0) -> dict[str, jax.Array]:
    return {k: v.astype(jnp.float32) for k, v in flat_params(D.init_drafter_params(config, seed, jnp.float32)).items()}


def train_drafter(
    beam,
    config: D.DrafterConfig,
    distill: DistillConfig,
    stream: np.ndarray,
    greedy: np.ndarray | None = None,
    *,
    flat: dict[str, jax.Array] | None = None,
    log=print,
    log_every: int = 50,
) -> tuple[dict[str, jax.Array], list[dict]]:
    """AdamW (optax) on the drafter's fp32 weights over windows of `stream` (and rows of `greedy`,
    `[n, distill.window]`, when `distill.greedy_windows`); returns the weights and the logged history."""
    if distill.greedy_windows and (greedy is None or greedy.shape[1] != distill.window):
        raise ValueError(f"greedy_windows needs a greedy set of windows of {distill.window} tokens")
    flat = init_flat(config, distill.seed) if flat is None else flat
    # The learning rate is applied by the step (it follows the clock when there is a time limit).
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=0.01, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()}),
    )
    opt_state = tx.init(flat)
    compute_dtype = jnp.dtype(distill.compute_dtype or beam.params["model"]["embed_tokens"]["weight"][...].dtype)
    step = make_step(config, beam.config, tx, distill, compute_dtype)
    embed, head = target_head(beam)
    device_stream = jnp.asarray(stream.astype(np.int32))
    device_greedy = jnp.asarray(greedy if distill.greedy_windows else np.zeros((1, distill.window), np.int32))
    key, history = jax.random.key(distill.seed), []
    start = timed_from = time.perf_counter()
    for i in range(1, distill.steps + 1):
        elapsed = time.perf_counter() - timed_from
        progress = max((i - 1) / distill.steps, elapsed / distill.time_limit_s if distill.time_limit_s else 0.0)
        if progress >= 1.0:
            log(f"time limit: stopped after {i - 1} of {distill.steps} steps")
            break
        lr = distill.learning_rate(i, progress)
        flat, opt_state, loss, metrics = step(
            flat, opt_state, lr, beam.params, embed, head, device_stream, device_greedy, jax.random.fold_in(key, i)
        )
        if i == 1:  # the clock of the time limit starts after the compile
            loss.block_until_ready()
            timed_from = time.perf_counter()
        if i % log_every == 0 or i in (1, distill.steps):
            record = {
                "step": i,
                "lr": round(lr, 6),
                "loss": round(float(loss), 4),  # also keeps the host within a log interval of the device
                **{k: [round(float(x), 3) for x in v] for k, v in metrics.items()},
                "elapsed_s": round(time.perf_counter() - start, 1),
            }
            history.append(record)
            log(json.dumps(record))
    return flat, history


# ---- acceptance ------------------------------------------------------------------------------------
def accept_lengths(drafts: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """Per row: the longest prefix of `drafts [B, N]` equal to the target's greedy chain
    `greedy [B, N]`, plus the bonus token (1 .. N + 1)."""
    match = np.asarray(drafts) == np.asarray(greedy)
    return np.cumprod(match, axis=1).sum(axis=1) + 1


@functools.partial(jax.jit, static_argnames=("config", "prefix_len", "n", "layer_ids"))
def _greedy_chain(params, buffer, *, config, prefix_len, n, layer_ids):
    """The target's greedy chain of n tokens after `buffer[:, :prefix_len]` (the buffer is written in
    place, one full causal pass per token), and the hidden states of the first pass."""
    positions = jnp.broadcast_to(jnp.arange(buffer.shape[1], dtype=jnp.int32), buffer.shape)
    hidden = None
    for j in range(n):
        out = forward(params, buffer, positions, config=config, hidden_layers=layer_ids if j == 0 else ())
        if j == 0:
            hidden = jnp.concatenate(out.hidden_states, axis=-1)
        nxt = jnp.argmax(out.logits[:, prefix_len - 1 + j], axis=-1).astype(buffer.dtype)
        buffer = buffer.at[:, prefix_len + j].set(nxt)
    return buffer[:, prefix_len:], hidden[:, :prefix_len]


def measure_acceptance(
    beam,
    config: D.DrafterConfig,
    params,
    stream: np.ndarray,
    *,
    num_prompts: int = 64,
    prefix_len: int = 128,
    seed: int = 1,
    batch_size: int = 16,
) -> dict:
    """Mean accept length (and its distribution, per-position draft accuracy) over `num_prompts`
    prompts drawn from `stream` (held-out tokens)."""
    n = config.num_drafts
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - prefix_len, num_prompts)
    embed, head = target_head(beam)
    lengths, correct = [], []
    for i in range(0, num_prompts, batch_size):
        prompts = np.stack([stream[s : s + prefix_len] for s in starts[i : i + batch_size]]).astype(np.int32)
        buffer = np.concatenate([prompts, np.zeros((len(prompts), n), np.int32)], axis=1)
        greedy, hidden = _greedy_chain(
            beam.params,
            jnp.asarray(buffer),
            config=beam.config,
            prefix_len=prefix_len,
            n=n,
            layer_ids=config.target_layer_ids,
        )
        b = len(prompts)
        positions = jnp.broadcast_to(jnp.arange(prefix_len, dtype=jnp.int32), (b, prefix_len))
        context = D.context_kv(params, hidden.astype(jnp.float32), positions, config=config)
        proposal = D.jit_propose(
            params,
            jnp.asarray(prompts[:, -1]),
            jnp.full((b,), prefix_len - 1, jnp.int32),
            context,
            embed_weight=embed,
            lm_head_weight=head,
            config=config,
        )
        drafts, greedy = np.asarray(proposal.tokens), np.asarray(greedy)
        lengths.append(accept_lengths(drafts, greedy))
        correct.append(drafts == greedy)
    lengths, correct = np.concatenate(lengths), np.concatenate(correct)
    return {
        "mean_accept_length": float(lengths.mean()),
        "max_accept_length": n + 1,
        "accept_length_histogram": np.bincount(lengths, minlength=n + 2)[1:].tolist(),
        "draft_accuracy_by_position": [round(float(c), 3) for c in correct.mean(axis=0)],
        "prompts": int(num_prompts),
        "prefix_len": prefix_len,
    }


# ---- CLI ------------------------------------------------------------------------------------------
def heldout_tokens(tokenizer, data_dir: Path | None) -> np.ndarray:
    """The held-out stream: prepared data's `heldout.npy` (the same tokens, for machines without the
    corpus), else the committed held-out files tokenized here."""
    return np.load(data_dir / "heldout.npy") if data_dir else data.load_heldout_tokens(tokenizer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("train", help="train a drafter, save it (fp32), measure acceptance")
    run.add_argument("--target", default="beam-tiny-code")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--data", type=Path, default=None, help="prepared data (train.npy, heldout.npy) to read")
    run.add_argument("--train-files", type=int, default=300, help="without --data: training files sampled")
    run.add_argument("--init", type=Path, default=None, help="start from this drafter checkpoint")
    run.add_argument("--block-size", type=int, default=8)
    run.add_argument("--layers", type=int, default=2)
    run.add_argument("--intermediate-size", type=int, default=512)
    defaults = DistillConfig()
    for field in dataclasses.fields(DistillConfig):
        kind = {"time_limit_s": float, "compute_dtype": str}.get(field.name, type(getattr(defaults, field.name)))
        run.add_argument("--" + field.name.replace("_", "-"), type=kind, default=getattr(defaults, field.name))
    run.add_argument("--greedy-set", type=int, default=0, help="windows in the greedy set (built first)")
    run.add_argument("--greedy-set-time-limit-s", type=float, default=None)
    run.add_argument("--greedy-batch", type=int, default=16)
    run.add_argument("--log-every", type=int, default=50)
    ev = commands.add_parser("evaluate", help="mean accept length of a drafter checkpoint on held-out prompts")
    ev.add_argument("--target", default="beam-tiny-code")
    ev.add_argument("--drafter", type=Path, required=True)
    ev.add_argument("--data", type=Path, default=None, help="prepared data whose heldout.npy to read")
    for command in (run, ev):
        command.add_argument("--eval-prompts", type=int, default=64)
        command.add_argument("--prefix-len", type=int, default=128)
        command.add_argument("--eval-batch", type=int, default=16)
    args = parser.parse_args(argv)

    beam = beam_jax.load(args.target)
    print(f"target {args.target} ({beam.params['model']['embed_tokens']['weight'][...].dtype}) on {jax.devices()[0]}")
    if args.command == "evaluate":
        config, params = D.load_drafter(args.drafter, dtype=jnp.float32)
    else:
        config = drafter_for(beam.config, args.block_size, args.layers, args.intermediate_size)
        distill = DistillConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)})
        start = time.perf_counter()
        if args.data:
            stream = np.load(args.data / "train.npy")
        else:
            stream = training_stream(beam.tokenizer, args.train_files, distill.seed)
        greedy = None
        if args.greedy_set:
            greedy = greedy_windows(
                beam,
                stream,
                num_windows=args.greedy_set,
                window=distill.window,
                greedy_tokens=distill.greedy_tokens,
                seed=distill.seed,
                batch_size=args.greedy_batch,
                time_limit_s=args.greedy_set_time_limit_s,
            )
        print(
            f"data: {stream.size} training tokens; greedy set {0 if greedy is None else len(greedy)} windows of "
            f"{distill.window} ({distill.greedy_tokens} generated), built in {time.perf_counter() - start:.1f}s"
        )
        flat = None
        if args.init:
            config, init_params = D.load_drafter(args.init, dtype=jnp.float32)
            flat = flat_params(init_params)
        flat, history = train_drafter(beam, config, distill, stream, greedy, flat=flat, log_every=args.log_every)
        params = D.params_from_flat(config, flat)
        D.save_drafter(args.out, config, params, dtype=jnp.float32)
        (args.out / "distill_log.json").write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "history": history}, indent=1) + "\n"
        )
        print(f"wrote {args.out}")
    result = measure_acceptance(
        beam,
        config,
        params,
        heldout_tokens(beam.tokenizer, args.data),
        num_prompts=args.eval_prompts,
        prefix_len=args.prefix_len,
        batch_size=args.eval_batch,
    )
    print(json.dumps(result))
    print(f"mean accept length (held-out, greedy, block {config.block_size}): {result['mean_accept_length']:.3f}")


if __name__ == "__main__":
    main()
