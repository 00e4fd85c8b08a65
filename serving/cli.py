"""`beam-serve`: the OpenAI- and Anthropic-compatible HTTP server (flags named as vLLM's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from beam_jax.config import EXPERT_KERNELS


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
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default: 64 on a GPU, 16 elsewhere)")
    p.add_argument("--min-token-bucket", type=int, default=None,
                   help="the smallest compiled step size in tokens, a power of two (default: 1 on a GPU, 16 elsewhere)")
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
    p.add_argument(
        "--expert-kernel",
        choices=EXPERT_KERNELS,
        default="auto",
        help="NVFP4 experts: repacked at load time for the Mosaic GPU kernel (mosaic), kept in the checkpoint "
        "layout for the Triton kernels (triton), or mosaic on Hopper GPUs where the shapes fit (auto, the default)",
    )
    # Speculative decoding (serving/speculative_step.py), named as SGLang's with vLLM-style aliases.
    p.add_argument(
        "--speculative",
        "--speculative-algorithm",
        dest="speculative",
        default=None,
        help="speculative decoding: dflash (a DFlash / DFlash2 drafter, needs --draft-model)",
    )
    p.add_argument(
        "--draft-model",
        "--speculative-draft-model-path",
        dest="draft_model",
        default=None,
        help="the drafter checkpoint directory (config.json with dflash_config, safetensors)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        "--speculative-num-draft-tokens",
        dest="num_speculative_tokens",
        type=int,
        default=None,
        help="drafts verified per step (default: the drafter's block size - 1)",
    )
    p.add_argument(
        "--speculative-simulated-accept-length",
        dest="simulated_accept_length",
        type=float,
        default=None,
        help="BENCHMARKS ONLY: accept this many tokens per step on average whatever the model says (the text is not the model's)",
    )
    # Several nodes (serving/multihost.py): named as SGLang's, which vLLM's multi-node flags follow.
    p.add_argument(
        "--nnodes", type=int, default=1, help="processes (one per node or tray) serving one mesh (default: 1)"
    )
    p.add_argument(
        "--node-rank", type=int, default=0, help="this process's rank; rank 0 serves HTTP, the others follow it"
    )
    p.add_argument(
        "--coordinator",
        "--dist-init-addr",
        dest="coordinator",
        default=None,
        help="HOST:PORT of rank 0's jax.distributed coordinator, the same on every node (default: $JAX_COORDINATOR_ADDRESS)",
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
        min_token_bucket=args.min_token_bucket,
        num_pages=args.num_pages,
        enable_prefix_caching=args.enable_prefix_caching,
        tp=args.tp,
        ep=args.ep,
        quantization=args.quantization,
        expert_kernel=args.expert_kernel,
        speculative=args.speculative,
        draft_model=args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        simulated_accept_length=args.simulated_accept_length,
    )


def build_engine(args: argparse.Namespace):
    """The engine `beam-serve` serves (not yet warmed up); a bad model, setting or mesh exits with
    the reason."""
    from serving.engine import LLMEngine

    try:
        return LLMEngine(args.model, config=engine_config(args), dtype=args.dtype, seed=args.seed)
    except (FileNotFoundError, ValueError) as error:  # CheckpointError is a ValueError
        raise SystemExit(f"error: {error}") from None


def start_processes(args: argparse.Namespace):
    """With `--nnodes` > 1, joins the other nodes' processes (`jax.distributed`, before anything
    touches a device); bad settings exit with the reason. Returns the `multihost.Launch`."""
    from serving import multihost

    try:
        launch = multihost.launch_settings(args.nnodes, args.node_rank, args.coordinator)
        multihost.initialize(launch, tp=args.tp, ep=args.ep)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return launch


def build_server(args: argparse.Namespace, engine=None):
    """The FastAPI app around the warmed-up engine (every token bucket compiled); `engine` defaults
    to `build_engine(args)`."""
    from serving.api.app import build_app
    from serving.async_engine import AsyncEngine

    engine = engine or build_engine(args)
    print(f"beam-serve: compiling the step for {len(engine.runner.buckets)} token buckets...", file=sys.stderr)
    engine.warmup()
    return build_app(
        AsyncEngine(engine), served_model_name=args.served_model_name or str(args.model), api_key=args.api_key
    )


def follow(args: argparse.Namespace, launch) -> int:
    """A rank > 0: load the model onto the shared mesh, then run the steps rank 0 sends until it stops."""
    from serving import multihost

    engine = build_engine(args)
    print(f"beam-serve: node {launch.node_rank} of {launch.nnodes}: following node 0's steps", file=sys.stderr)
    calls = multihost.follow(engine.runner)
    print(f"beam-serve: node {launch.node_rank}: node 0 stopped after {calls} compiled calls", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launch = start_processes(args)
    return serve(args, launch) if launch.is_leader else follow(args, launch)


def serve(args: argparse.Namespace, launch) -> int:
    """Rank 0: the HTTP server. With other ranks, every compiled call is sent to them too (from
    warm-up on, so that they compile the same programs), and they are released however it stops."""
    import signal

    import uvicorn

    from serving import multihost

    engine = build_engine(args)
    leader = multihost.Leader(engine.runner) if launch.nnodes > 1 else None
    if leader is not None:
        # uvicorn re-raises the signal that stopped it once it has shut down: SIGTERM as KeyboardInterrupt
        # (as SIGINT already is) lets the `finally` below release the followers before the process ends.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    app = None
    try:
        app = build_server(args, engine)
        where = f" on {args.tp * args.ep} devices (tp={args.tp}, ep={args.ep})" if args.tp * args.ep > 1 else ""
        where += f" of {launch.nnodes} nodes" if leader is not None else ""
        print(f"beam-serve: serving {args.model}{where} on http://{args.host}:{args.port}/v1", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except KeyboardInterrupt:
        if leader is None:
            raise
    finally:
        if leader is not None:
            if app is not None:
                app.state.server.engine.shutdown()  # the engine thread's last step ends before the STOP
            leader.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
