"""beam-tiny-code: a ~12M-parameter Beam trained on the Python standard library.

    python -m beam_jax.train.tiny_code prepare --data DIR            # corpus split, tokenizer, token streams
    python -m beam_jax.train.tiny_code train --data DIR --out MODEL  # train, write the checkpoint + log

`scripts/train-beam-tiny-code` runs both with the settings the shipped model was trained with.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from beam_jax.checkpoint import save_checkpoint
from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig
from beam_jax.model import params_from_flat
from beam_jax.train import data
from beam_jax.train.loop import TrainConfig, compute_params, parameter_count, save_history, train


def beam_tiny_code_config() -> BeamConfig:
    """Every structural feature of Beam at ~12M parameters: 3 dense then 5 MoE layers, sliding
    (window 128, RoPE) and full (NoPE + SSMax) attention with GQA 4, 16 experts in 4 groups with
    top-2 groups and top-4 experts, gated attention and logit soft-capping."""
    return BeamConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        sliding_window=128,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        layer_types=(SLIDING,) * 5 + (FULL, SLIDING, FULL),
        mlp_layer_types=(DENSE,) * 3 + (SPARSE,) * 5,
        pad_token_id=0,
        eos_token_id=(5, 6),
    )


SHARD_BYTES = 12 * 2**20  # files stay under 16 MiB (what a GPU run can send back)


def write_model(out: Path, config: BeamConfig, master: dict[str, jax.Array], tokenizer_dir: Path) -> Path:
    """The shipped form: bf16 safetensors (router fp32), config.json, the tokenizer and template."""
    params = params_from_flat(config, compute_params(config, master, jnp.bfloat16))
    save_checkpoint(out, config, params, expert_layout="fused", max_shard_bytes=SHARD_BYTES)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, out / file.name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="split the corpus, train the tokenizer, write token streams")
    prep.add_argument("--data", type=Path, required=True)
    prep.add_argument("--corpus-dir", type=Path, default=None, help="default: this interpreter's standard library")
    prep.add_argument("--write-heldout-list", action="store_true", help="regenerate the committed list (new corpus)")
    run = commands.add_parser("train", help="train on prepared data and write the model directory")
    run.add_argument("--data", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--log", type=Path, default=None, help="training history JSON (default: OUT/training_log.json)")
    defaults = TrainConfig(steps=0)
    run.add_argument("--steps", type=int, required=True)
    run.add_argument("--batch-size", type=int, default=defaults.batch_size)
    run.add_argument("--seq-len", type=int, default=defaults.seq_len)
    run.add_argument("--peak-lr", type=float, default=defaults.peak_lr)
    run.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    run.add_argument("--seed", type=int, default=defaults.seed)
    run.add_argument("--compute-dtype", default=defaults.compute_dtype, choices=["bfloat16", "float32"])
    run.add_argument("--eval-every", type=int, default=250)
    run.add_argument(
        "--eval-tokens", type=int, default=None, help="evaluate on the first N held-out tokens (default: all)"
    )
    run.add_argument("--time-limit-s", type=float, default=None, help="stop early (and say so) after this long")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        print(json.dumps(data.prepare(args.data, args.corpus_dir, write_list=args.write_heldout_list), indent=2))
        return
    config = beam_tiny_code_config()
    train_config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        peak_lr=args.peak_lr,
        warmup_steps=min(args.warmup_steps, args.steps),
        seed=args.seed,
        compute_dtype=args.compute_dtype,
    )
    train_stream, heldout_stream = (
        np.load(args.data / "train.npy"),
        np.load(args.data / "heldout.npy")[: args.eval_tokens],
    )
    print(
        f"{parameter_count(config) / 1e6:.2f}M parameters; {train_stream.size} training tokens; "
        f"{train_config.batch_size * train_config.seq_len} tokens per step; device {jax.devices()[0].device_kind}"
    )
    master, history = train(
        config, train_config, train_stream, heldout_stream, eval_every=args.eval_every, time_limit_s=args.time_limit_s
    )
    write_model(args.out, config, master, args.data / data.TOKENIZER_SUBDIR)
    corpus = json.loads((args.data / "corpus.json").read_text())
    save_history(
        args.log or args.out / "training_log.json",
        train_config,
        history,
        corpus=corpus,
        device=jax.devices()[0].device_kind,
        parameters=parameter_count(config),
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
