"""`beam-serve`: the OpenAI- and Anthropic-compatible HTTP server (flags named as vLLM's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="beam-serve", description="Serve a Beam model over HTTP (OpenAI and Anthropic APIs)."
    )
    p.add_argument(
        "--model",
        default="beam-tiny-code",
        help="a model name (beam-tiny-code, trained; presets with random weights: beam-tiny, ...) or a checkpoint directory (default: beam-tiny-code)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("BEAM_API_KEY"),
        help="require this key (Bearer or x-api-key) on every route but /health; env BEAM_API_KEY",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-prefill-chunk", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--num-pages", type=int, default=None, help="KV pool pages (default: every sequence can reach max-model-len)"
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        type=int,
        default=1,
        help="serve on a tensor-parallel mesh of this many local devices (default: 1)",
    )
    p.add_argument(
        "--expert-parallel-size",
        "--ep",
        dest="ep",
        type=int,
        default=1,
        help="split the experts over this many devices (the mesh has tp x ep devices; default: 1)",
    )
    p.add_argument(
        "--quantization",
        "--quant",
        "-q",
        choices=["fp8", "nvfp4"],
        default=None,
        help="quantize a bf16 checkpoint's experts as it loads: fp8 (per channel) or nvfp4 (default: as stored)",
    )
    p.add_argument("--log-level", default="info")
    return p


def engine_config(args: argparse.Namespace):
    from serving.engine import EngineConfig

    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        max_model_len=args.max_model_len,
        page_tokens=args.page_size,
        num_pages=args.num_pages,
        enable_prefix_caching=args.enable_prefix_caching,
        tp=args.tp,
        ep=args.ep,
        quantization=args.quantization,
    )


def build_engine(args: argparse.Namespace):
    """The engine `beam-serve` serves (not yet warmed up); a bad model, setting or mesh exits with
    the reason."""
    from serving.engine import LLMEngine

    try:
        return LLMEngine(args.model, config=engine_config(args), dtype=args.dtype, seed=args.seed)
    except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
        raise SystemExit(f"error: {error}") from None


def build_server(args: argparse.Namespace):
    """The FastAPI app around the warmed-up engine (every token bucket compiled)."""
    from serving.api.app import build_app
    from serving.async_engine import AsyncEngine

    engine = build_engine(args)
    print(f"beam-serve: compiling the step for {len(engine.runner.buckets)} token buckets...", file=sys.stderr)
    engine.warmup()
    return build_app(
        AsyncEngine(engine), served_model_name=args.served_model_name or str(args.model), api_key=args.api_key
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    app = build_server(args)
    where = f" on {args.tp * args.ep} devices (tp={args.tp}, ep={args.ep})" if args.tp * args.ep > 1 else ""
    print(f"beam-serve: serving {args.model}{where} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
