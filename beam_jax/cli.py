"""`beam-jax` command line: generate, init-checkpoint, to-orbax, quantize, plan, evaluate, compare."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from beam_jax.api import QUANTIZATIONS
from beam_jax.config import EXPERT_KERNELS, PRESETS


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"error: --prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise SystemExit("error: --prompt-ids is empty")
    return ids


def cmd_generate(args) -> int:
    from beam_jax.api import load

    prompt = _token_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    try:
        beam = load(args.model, dtype=args.dtype, seed=args.seed, expert_kernel=args.expert_kernel)
        output = beam.generate(prompt, args.max_new_tokens)
    except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
        raise SystemExit(f"error: {error}") from None
    print(json.dumps(output) if args.prompt_ids is not None else args.prompt + output)
    return 0


def cmd_init_checkpoint(args) -> int:
    from beam_jax.checkpoint import init_checkpoint
    from beam_jax.config import preset

    overrides = {"num_hidden_layers": args.layers} if args.layers is not None else {}
    config = preset(args.preset, **overrides)
    path = init_checkpoint(
        args.out,
        config,
        seed=args.seed,
        dtype=args.dtype,
        expert_layout=args.expert_layout,
        max_shard_bytes=args.max_shard_mb * 2**20,
    )
    print(f"wrote {args.preset} with random weights (seed {args.seed}, {args.dtype}) to {path}")
    return 0


def cmd_to_orbax(args) -> int:
    from beam_jax.checkpoint import load_checkpoint, save_orbax

    config, params = load_checkpoint(args.checkpoint, dtype=args.dtype)
    print(f"wrote orbax checkpoint {save_orbax(args.out, config, params)}")
    return 0


# `quantize --format` choices -> expert formats (fp8: compressed-tensors FP8_DYNAMIC, per channel).
QUANTIZE_FORMATS = {**QUANTIZATIONS, "fp8-tensor": "fp8_tensor"}  # load-time methods, plus ModelOpt's per-tensor FP8
# Files beside the weights that a quantized copy should keep (tokenizer, generation defaults).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def cmd_quantize(args) -> int:
    from beam_jax.api import checkpoint_dir
    from beam_jax.checkpoint import load_checkpoint, save_checkpoint
    from beam_jax.quant.convert import expert_nbytes, quantize_params

    source, out = checkpoint_dir(args.source) or Path(args.source), Path(args.out)
    if out.resolve() == source.resolve():
        raise SystemExit("error: --out must differ from --in (saving removes the old weight files)")
    try:
        config, params = load_checkpoint(source, progress=False)
        quantized_config, quantized = quantize_params(config, params, QUANTIZE_FORMATS[args.format])
    except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
        raise SystemExit(f"error: {error}") from None
    before, after = expert_nbytes(params), expert_nbytes(quantized)
    del params
    save_checkpoint(out, quantized_config, quantized)
    copied = [name for name in SIDE_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, out / name)
    print(
        f"experts {before:,} -> {after:,} bytes ({before / after:.2f}x smaller, {quantized_config.expert_format}); "
        f"wrote {out}" + (f" with {', '.join(copied)}" if copied else "")
    )
    return 0


def cmd_plan(args) -> int:
    from beam_jax.config import preset
    from beam_jax.memory_plan import format_plan, plan_memory

    config = preset(args.preset)
    plan = plan_memory(
        config,
        tp=args.tp,
        quant=args.quant,
        drafter=args.drafter,
        hbm_gb=args.hbm_gb,
        mem_fraction=args.mem_fraction,
    )
    print(format_plan(plan))
    return 0


def cmd_evaluate(args) -> int:
    from beam_jax.train.evaluate import evaluate

    try:
        result = evaluate(args.model, seq_len=args.seq_len, batch_size=args.batch_size, max_windows=args.max_windows,
                          corpus_dir=args.corpus_dir, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print(
        f"{result['model']} ({result['expert_format']} experts) on {result['tokens']} held-out tokens: "
        f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, next-token accuracy "
        f"{100 * result['accuracy']:.2f}%; unigram baseline: loss {result['unigram_loss']:.4f}, "
        f"perplexity {result['unigram_perplexity']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beam-jax", description="Beam in JAX: generation and checkpoint tools")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="greedy generation with the contiguous KV cache")
    gen.add_argument("--model", default="beam-tiny-code",
                     help=f"checkpoint directory, beam-tiny-code (trained) or a random-weight preset ({', '.join(PRESETS)})")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text prompt (encoded with the model's tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids; prints the generated ids as JSON")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    gen.add_argument("--seed", type=int, default=0, help="weights seed for presets")
    gen.add_argument("--expert-kernel", choices=EXPERT_KERNELS, default="auto",
                     help="NVFP4 experts: the Mosaic GPU kernel's layout (mosaic), the checkpoint's for the Triton "
                     "kernels (triton), or mosaic on Hopper GPUs where the shapes fit (auto)")
    gen.set_defaults(run=cmd_generate)

    init = commands.add_parser("init-checkpoint", help="write a random-weight HF checkpoint of a preset")
    init.add_argument("--preset", required=True, choices=sorted(PRESETS))
    init.add_argument("--out", required=True)
    init.add_argument("--layers", type=int, default=None, help="layer count (for beam-tp8-slice)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    init.add_argument("--expert-layout", choices=["per_expert", "fused"], default="per_expert")
    init.add_argument("--max-shard-mb", type=int, default=2048)
    init.set_defaults(run=cmd_init_checkpoint)

    orbax = commands.add_parser("to-orbax", help="convert a safetensors checkpoint to orbax for fast restarts")
    orbax.add_argument("--checkpoint", required=True)
    orbax.add_argument("--out", required=True)
    orbax.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    orbax.set_defaults(run=cmd_to_orbax)

    quantize = commands.add_parser("quantize", help="quantize a bf16 checkpoint's experts (NVFP4 or FP8)")
    quantize.add_argument("--in", dest="source", metavar="BF16_DIR", required=True, help="bf16 (or fp32) HF checkpoint")
    quantize.add_argument("--out", metavar="DIR", required=True, help="directory for the quantized checkpoint")
    quantize.add_argument(
        "--format",
        required=True,
        choices=sorted(QUANTIZE_FORMATS),
        help="nvfp4: ModelOpt NVFP4; fp8: compressed-tensors FP8_DYNAMIC (per channel); fp8-tensor: ModelOpt FP8",
    )
    quantize.set_defaults(run=cmd_quantize)

    plan = commands.add_parser("plan", help="GPU memory plan: weights, KV per token, cache groups, pool size")
    plan.add_argument("--preset", default="beam-501b", choices=sorted(PRESETS))
    plan.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs")
    plan.add_argument("--quant", choices=["bf16", "fp8", "nvfp4", "nvfp4-mosaic"], default="nvfp4",
                      help="expert weight format; nvfp4-mosaic: NVFP4 as held on Hopper GPUs, in the Mosaic "
                           "kernel's layout (0.1%% larger)")
    plan.add_argument("--drafter", action="store_true", help="with the DFlash drafter (5 full-history layers)")
    plan.add_argument("--hbm-gb", type=float, default=186.0, help="HBM per GPU in GB (1e9 bytes); GB200: 186")
    plan.add_argument("--mem-fraction", type=float, default=0.95)
    plan.set_defaults(run=cmd_plan)

    evaluate = commands.add_parser("evaluate", help="held-out loss, perplexity and next-token accuracy (stdlib code)")
    evaluate.add_argument("--model", default="beam-tiny-code", help="checkpoint directory or model name")
    evaluate.add_argument("--seq-len", type=int, default=1024, help="tokens of context per window")
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    evaluate.add_argument("--corpus-dir", type=Path, default=None, help="default: this interpreter's standard library")
    evaluate.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    evaluate.add_argument("--json", default=None, help="also write the figures to this file")
    evaluate.set_defaults(run=cmd_evaluate)

    # Listed for --help; main() hands `compare ...` to beam_jax.compare whole.
    commands.add_parser("compare", help="JAX vs transformers' BeamForCausalLM (same as python -m beam_jax.compare)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:  # its options are compare's own (argparse's REMAINDER drops leading --options)
        from beam_jax.compare import main as compare_main

        return compare_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
