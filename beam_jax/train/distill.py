"""Distilling a DFlash drafter for a target on the target's own greedy predictions, and measuring
the drafter's offline acceptance.

    python -m beam_jax.train.distill train --out DIR [--steps N ...]   # build data, train, save, measure
    python -m beam_jax.train.distill evaluate --drafter DIR            # mean accept length on held-out

Data (`build_dataset`): windows of the target's training stream (the corpus's training files only,
never the committed held-out list), each optionally extended by the target's own greedy generation
(`greedy_tokens`); one target pass over every window gives the drafter's inputs, the residual stream
after `config.target_layer_ids` concatenated, and the labels, the target's argmax next token at every
position. On the greedy-generated part the labels are exactly the target's greedy chain; on the corpus
part they are the target's greedy prediction after the corpus prefix.

Training (`train_drafter`): an anchor at position a of a window, context = the target hidden states of
positions < a, block `[token_a, mask, ...]` at positions a..a+N; draft j (1..N) learns
`labels[a + j - 1]` with cross-entropy weighted by `exp(-(j - 1) / decay)` (early drafts matter most:
a miss ends the block). AdamW (optax) on fp32 drafter weights; the target's embedding and lm_head are
shared and frozen.

Acceptance (`measure_acceptance`): held-out prompts of `prefix_len` tokens; the target's greedy chain
of N tokens after each prompt; the drafter proposes N drafts from the anchor (the prompt's last token)
and the context (the target's hidden states of the rest); accept length = longest prefix of drafts
equal to the chain, plus the bonus token (1..N+1), as greedy verification in serving/speculative.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import beam_jax
from beam_jax import drafter as D
from beam_jax.generate import greedy_generate
from beam_jax.model import flat_params, forward
from beam_jax.train import corpus, data

MASK_TOKEN_ID = 8  # the project tokenizer's <|mask|>


def drafter_tiny_code(block_size: int = 8) -> D.DrafterConfig:
    """A DFlash drafter for `beam-tiny-code` (hidden 256, vocabulary 8192, 8 layers): 2 layers,
    features from target layers 1, 4 and 7, block-local convolutions, no candidate selector (drafts
    are the argmax; the selector is not trained here)."""
    return D.DrafterConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=128,
        max_position_embeddings=8192,
        block_size=block_size,
        target_layer_ids=(1, 4, 7),
        mask_token_id=MASK_TOKEN_ID,
        conv_kernel_size=2,
        conv_group_size=32,
        selector_rank=None,
        selector_top_k=None,
        final_logit_softcapping=30.0,
    )


# ---- the target ------------------------------------------------------------------------------------
def target_head(beam) -> tuple[jax.Array, jax.Array]:
    """The target's embedding and lm_head (the embedding twice when tied), fp32."""
    flat = flat_params(beam.params)
    embed = flat["model.embed_tokens.weight"]
    head = embed if beam.config.tie_word_embeddings else flat["lm_head.weight"]
    return embed.astype(jnp.float32), head.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config", "layer_ids"))
def _target_pass(params, tokens, *, config, layer_ids):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = forward(params, tokens, positions, config=config, hidden_layers=layer_ids)
    hidden = jnp.concatenate(out.hidden_states, axis=-1).astype(jnp.bfloat16)
    return hidden, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)


def target_pass(beam, tokens: np.ndarray, layer_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """`[B, T, hidden * len(layer_ids)]` bf16 hidden states and `[B, T]` argmax next tokens."""
    hidden, greedy = _target_pass(beam.params, jnp.asarray(tokens, jnp.int32), config=beam.config, layer_ids=layer_ids)
    return np.asarray(hidden), np.asarray(greedy)


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


def build_dataset(
    beam,
    stream: np.ndarray,
    config: D.DrafterConfig,
    *,
    num_windows: int,
    window: int,
    greedy_tokens: int = 0,
    seed: int = 0,
    batch_size: int = 16,
) -> dict[str, np.ndarray]:
    """`tokens [n, window]`, `hidden [n, window, hidden * layers]` (bf16), `labels [n, window]` (the
    target's argmax after each prefix) and `first_anchor`. With `greedy_tokens`, each window is its
    first `window - greedy_tokens` corpus tokens followed by the target's greedy continuation, and
    anchors start where the generation does (so labels are the greedy chain)."""
    if not 0 <= greedy_tokens < window:
        raise ValueError(f"greedy_tokens must be in [0, {window}), got {greedy_tokens}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - window, num_windows)
    windows = np.stack([stream[s : s + window] for s in starts]).astype(np.int32)
    if greedy_tokens:
        prompts = windows[:, : window - greedy_tokens]
        for i in range(0, num_windows, batch_size):
            rows = [list(map(int, p)) for p in prompts[i : i + batch_size]]
            generated = greedy_generate(beam.params, beam.config, rows, greedy_tokens)
            windows[i : i + batch_size, window - greedy_tokens :] = np.asarray(generated, np.int32)
    hidden, labels = [], []
    for i in range(0, num_windows, batch_size):
        h, g = target_pass(beam, windows[i : i + batch_size], config.target_layer_ids)
        hidden.append(h)
        labels.append(g)
    first_anchor = max(1, window - greedy_tokens - 1) if greedy_tokens else 1
    return {
        "tokens": windows,
        "hidden": np.concatenate(hidden),
        "labels": np.concatenate(labels),
        "first_anchor": np.int32(first_anchor),
    }


# ---- training --------------------------------------------------------------------------------------
def block_logits(params, embed, head, hidden, tokens, anchors, *, config: D.DrafterConfig):
    """Draft logits `[W, A, N, vocab]` for anchors `[W, A]` of windows `hidden [W, T, .]`,
    `tokens [W, T]`: the context is the whole window (the block mask hides rows at or after the
    anchor), the block `[tokens[anchor], mask * N]`."""
    w, t = tokens.shape
    a = anchors.shape[1]
    n = config.num_drafts
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (w, t))
    context = D.context_kv(params, hidden.astype(jnp.float32), positions, config=config)
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
    """Weighted cross-entropy of the drafts against `labels[anchor + j - 1]`; also per-position
    accuracy `[N]`."""
    params = D.params_from_flat(config, flat)
    logits = block_logits(params, embed, head, hidden, tokens, anchors, config=config)
    n = config.num_drafts
    targets = jnp.take_along_axis(
        labels, (anchors[:, :, None] + jnp.arange(n)[None, None]).reshape(labels.shape[0], -1), 1
    )
    targets = targets.reshape(*anchors.shape, n)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    loss = (nll.mean(axis=(0, 1)) * position_weights(n, decay)).sum()
    accuracy = (jnp.argmax(logits, -1) == targets).mean(axis=(0, 1))
    return loss, accuracy


def sample_anchors(key, batch: int, anchors: int, first: int, window: int, n: int) -> jax.Array:
    return jax.random.randint(key, (batch, anchors), first, window - n)


def make_step(config: D.DrafterConfig, tx, *, windows_per_step: int, anchors_per_window: int, decay: float):
    loss_fn = functools.partial(distill_loss, config=config, decay=decay)

    @jax.jit
    def step(flat, opt_state, embed, head, dataset, key):
        k1, k2 = jax.random.split(key)
        rows = jax.random.randint(k1, (windows_per_step,), 0, dataset["tokens"].shape[0])
        window = dataset["tokens"].shape[1]
        anchors = sample_anchors(
            k2, windows_per_step, anchors_per_window, dataset["first_anchor"], window, config.num_drafts
        )
        batch = [dataset[k][rows] for k in ("hidden", "tokens", "labels")]
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(flat, embed, head, *batch, anchors)
        updates, opt_state = tx.update(grads, opt_state, flat)
        return optax.apply_updates(flat, updates), opt_state, loss, accuracy

    return step


def init_flat(config: D.DrafterConfig, seed: int = 0) -> dict[str, jax.Array]:
    return {k: v.astype(jnp.float32) for k, v in flat_params(D.init_drafter_params(config, seed, jnp.float32)).items()}


def train_drafter(
    beam,
    config: D.DrafterConfig,
    dataset: dict[str, np.ndarray],
    *,
    steps: int,
    lr: float = 2e-3,
    windows_per_step: int = 8,
    anchors_per_window: int = 16,
    decay: float = 4.0,
    seed: int = 0,
    flat: dict[str, jax.Array] | None = None,
    log=print,
    log_every: int = 50,
    time_limit_s: float | None = None,
) -> tuple[dict[str, jax.Array], list[dict]]:
    """AdamW (optax) on the drafter's fp32 weights; returns the weights and the logged history."""
    flat = init_flat(config, seed) if flat is None else flat
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 10 + 1), max(steps, 2), lr * 0.1)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            schedule, b1=0.9, b2=0.95, weight_decay=0.01, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()}
        ),
    )
    opt_state = tx.init(flat)
    step = make_step(config, tx, windows_per_step=windows_per_step, anchors_per_window=anchors_per_window, decay=decay)
    embed, head = target_head(beam)
    device_data = {k: jnp.asarray(v) for k, v in dataset.items()}
    key, history, start = jax.random.key(seed), [], time.perf_counter()
    for i in range(1, steps + 1):
        flat, opt_state, loss, accuracy = step(flat, opt_state, embed, head, device_data, jax.random.fold_in(key, i))
        over = time_limit_s is not None and time.perf_counter() - start > time_limit_s
        if i % log_every == 0 or i in (1, steps) or over:
            record = {
                "step": i,
                "loss": round(float(loss), 4),
                "accuracy": [round(float(a), 3) for a in accuracy],
                "elapsed_s": round(time.perf_counter() - start, 1),
            }
            history.append(record)
            log(json.dumps(record))
        if over:
            log(f"time limit: stopped after {i} of {steps} steps")
            break
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


# ---- CLI -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("train", help="build the data, train a drafter, save it, measure acceptance")
    run.add_argument("--target", default="beam-tiny-code")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--steps", type=int, default=500)
    run.add_argument("--block-size", type=int, default=8)
    run.add_argument("--train-files", type=int, default=300, help="training files sampled for the data")
    run.add_argument("--windows", type=int, default=256)
    run.add_argument("--window", type=int, default=192)
    run.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens generated per window")
    run.add_argument("--lr", type=float, default=2e-3)
    run.add_argument("--windows-per-step", type=int, default=8)
    run.add_argument("--anchors-per-window", type=int, default=16)
    run.add_argument("--decay", type=float, default=4.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--time-limit-s", type=float, default=None)
    run.add_argument("--eval-prompts", type=int, default=64)
    run.add_argument("--prefix-len", type=int, default=128)
    ev = commands.add_parser("evaluate", help="mean accept length of a drafter checkpoint on held-out prompts")
    ev.add_argument("--target", default="beam-tiny-code")
    ev.add_argument("--drafter", type=Path, required=True)
    ev.add_argument("--eval-prompts", type=int, default=64)
    ev.add_argument("--prefix-len", type=int, default=128)
    args = parser.parse_args(argv)

    beam = beam_jax.load(args.target)
    if args.command == "evaluate":
        config, params = D.load_drafter(args.drafter, dtype=jnp.float32)
    else:
        config = drafter_tiny_code(args.block_size)
        start = time.perf_counter()
        stream = training_stream(beam.tokenizer, args.train_files, args.seed)
        dataset = build_dataset(
            beam,
            stream,
            config,
            num_windows=args.windows,
            window=args.window,
            greedy_tokens=args.greedy_tokens,
            seed=args.seed,
        )
        print(
            f"data: {stream.size} training tokens, {args.windows} windows of {args.window} "
            f"({args.greedy_tokens} greedy), built in {time.perf_counter() - start:.1f}s"
        )
        flat, history = train_drafter(
            beam,
            config,
            dataset,
            steps=args.steps,
            lr=args.lr,
            windows_per_step=args.windows_per_step,
            anchors_per_window=args.anchors_per_window,
            decay=args.decay,
            seed=args.seed,
            time_limit_s=args.time_limit_s,
        )
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
        data.load_heldout_tokens(beam.tokenizer),
        num_prompts=args.eval_prompts,
        prefix_len=args.prefix_len,
    )
    print(json.dumps(result))
    print(f"mean accept length (held-out, greedy, block {config.block_size}): {result['mean_accept_length']:.3f}")


if __name__ == "__main__":
    main()
