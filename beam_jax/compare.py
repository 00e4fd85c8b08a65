"""JAX vs the PyTorch reference (`transformers.BeamForCausalLM`) on one checkpoint.

    python -m beam_jax.compare --checkpoint DIR [--dtype float32|bfloat16] [--prompt-lengths 1,37,300]

Loads the checkpoint into both models, runs the same prompts, and prints per layer the max
relative error of the residual stream, the routing disagreement count, and the logits error,
ending with one summary line. Needs the `reference` extra (torch, transformers>=5.23).

Relative error of a tensor is `max|jax - ref| / max|ref|`: an elementwise ratio is meaningless
where the reference is near zero. In bf16 a last-bit difference can flip a near-tied expert, and
a token routed elsewhere gets different logits by design; so the logits error is also reported
over the tokens whose expert selections agree at every sparse layer. Run bf16 comparisons on the
CPU: there our model rounds where the reference rounds; XLA:GPU fuses bf16 intermediates in fp32
(benchmarks/parity/RESULTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from beam_jax.api import checkpoint_dir
from beam_jax.checkpoint import load_checkpoint
from beam_jax.config import BeamConfig
from beam_jax.model import jit_forward

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    scale = np.abs(reference).max()
    return float(np.abs(actual - reference).max() / scale) if scale > 0 else float(np.abs(actual).max())


@dataclasses.dataclass
class RunOutputs:
    """One prompt's results: logits `[t, vocab]` fp32, the residual stream after each layer
    `[layers][t, hidden]`, and the selected experts `{layer: [t, k]}` of each sparse layer."""

    logits: np.ndarray
    hidden: list[np.ndarray]
    experts: dict[int, np.ndarray]


def run_jax(params, config: BeamConfig, tokens: np.ndarray) -> RunOutputs:
    layers = tuple(range(config.num_hidden_layers))
    tokens = jnp.asarray(tokens, jnp.int32)[None]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    out = jit_forward(params, tokens, positions, config=config, hidden_layers=layers, return_routing=True)
    sparse = [i for i in layers if config.is_sparse(i)]
    return RunOutputs(
        logits=np.asarray(out.logits[0], np.float32),
        hidden=[np.asarray(h[0].astype(jnp.float32)) for h in out.hidden_states],
        experts={layer: np.asarray(e[0]) for layer, e in zip(sparse, out.expert_indices)},
    )


def load_reference(checkpoint: str, dtype: str):
    """`BeamForCausalLM` with its plain (eager) attention and expert loop, the reference paths."""
    import torch
    from transformers import BeamForCausalLM

    model = BeamForCausalLM.from_pretrained(
        checkpoint, dtype=getattr(torch, dtype), attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def run_reference(model, tokens: np.ndarray) -> RunOutputs:
    """Forward hooks record each decoder layer's output and each router's selection."""
    import torch

    hidden, experts, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: hidden.__setitem__(i, out)))
        if hasattr(layer.mlp, "gate"):
            hooks.append(
                layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: experts.__setitem__(i, out[2]))
            )
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens, dtype=torch.long)[None]).logits
    finally:
        for hook in hooks:
            hook.remove()
    return RunOutputs(
        logits=logits[0].float().numpy(),
        hidden=[hidden[i][0].float().numpy() for i in sorted(hidden)],
        experts={i: e.numpy() for i, e in experts.items()},
    )


def routing_differs(actual: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per token: does the set of selected experts differ? (Order within the top-k does not matter.)"""
    return np.any(np.sort(actual, -1) != np.sort(reference, -1), axis=-1)


def routing_disagreements(actual: np.ndarray, reference: np.ndarray) -> int:
    return int(routing_differs(actual, reference).sum())


@dataclasses.dataclass
class Comparison:
    hidden_errors: list[float]  # per layer, worst over prompts
    routing_disagreements: dict[int, int]  # per sparse layer, summed over prompts
    routed_tokens: int
    logits_error: float
    # Over the tokens whose experts agree at every sparse layer (nan if there are none).
    logits_error_routing_agreed: float


def compare_outputs(pairs: list[tuple[RunOutputs, RunOutputs]]) -> Comparison:
    layers = len(pairs[0][0].hidden)
    hidden_errors = [max(relative_error(a.hidden[i], r.hidden[i]) for a, r in pairs) for i in range(layers)]
    disagreements = {
        layer: sum(routing_disagreements(a.experts[layer], r.experts[layer]) for a, r in pairs)
        for layer in pairs[0][1].experts
    }
    agreed_errors = []
    for a, r in pairs:
        agreed = ~np.any([routing_differs(a.experts[layer], r.experts[layer]) for layer in r.experts], axis=0)
        if agreed.any():
            agreed_errors.append(relative_error(a.logits[agreed], r.logits[agreed]))
    return Comparison(
        hidden_errors=hidden_errors,
        routing_disagreements=disagreements,
        routed_tokens=sum(len(a.logits) for a, _ in pairs),
        logits_error=max(relative_error(a.logits, r.logits) for a, r in pairs),
        logits_error_routing_agreed=max(agreed_errors, default=float("nan")),
    )


def default_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n) for n in lengths]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_jax.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", required=True, help="HF checkpoint directory (safetensors + config.json) or a shipped model's name"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--prompt-lengths", default="1,37,300", help="comma-separated lengths of random prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    checkpoint = checkpoint_dir(args.checkpoint) or args.checkpoint  # a shipped model's name works too
    config, params = load_checkpoint(checkpoint, dtype=DTYPES[args.dtype], progress=False)
    reference = load_reference(checkpoint, args.dtype)
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    prompts = default_prompts(config.vocab_size, lengths, args.seed)
    result = compare_outputs([(run_jax(params, config, p), run_reference(reference, p)) for p in prompts])

    print(f"{'layer':>5}  {'type':<8} {'mlp':<6} {'hidden rel err':>14}  routing disagreements")
    for i, err in enumerate(result.hidden_errors):
        kind = "sliding" if config.is_sliding(i) else "full"
        routing = result.routing_disagreements.get(i)
        routing_text = "-" if routing is None else f"{routing}/{result.routed_tokens} tokens"
        print(f"{i:>5}  {kind:<8} {config.mlp_layer_types[i]:<6} {err:>14.3e}  {routing_text}")
    total = sum(result.routing_disagreements.values())
    print(
        f"summary: dtype={args.dtype} prompts={lengths} logits max rel err {result.logits_error:.3e} "
        f"({result.logits_error_routing_agreed:.3e} over tokens with identical routing); "
        f"hidden max rel err {max(result.hidden_errors):.3e}; "
        f"routing disagreements {total} of {result.routed_tokens * len(result.routing_disagreements)} selections"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
