"""Decode step and prefill of the jitted JAX model vs the PyTorch reference, in one run.

    python benchmarks/decode/step.py [--layers 8] [--iters 20] [--out rows.json]
    python benchmarks/decode/step.py --smoke          # tiny config, CPU, end to end

At `beam-tp8-slice` (TP8 per-GPU shapes), bf16, router fp32, random weights (std 0.02, norms
ones, biases zeros), prompt 512: prefill 512 tokens at batch 1, and one decode step (forward +
argmax) at batch 1 and 8 after a 512-token prefill (JAX: contiguous KVCache of 1024 slots;
PyTorch: its DynamicCache). JAX's MoE is the plain-jnp reference (`lax.ragged_dot_general`)
and its attention is dense over the whole contiguous cache. PyTorch is transformers'
`BeamForCausalLM` with eager attention and the grouped_mm experts (eager if that fails).

HBM floor of a decode step: bytes of weights read once per step / 4.2 TB/s, counting every
non-expert weight (attention, dense MLPs, norms, fp32 routers, lm_head), B rows of the
embedding, and the expected number of DISTINCT experts touched per sparse layer at batch B
under uniform random routing, E * (1 - (1 - k/E)^B); the all-experts figure is printed too
(an upper bound). The KV cache read is added separately (small here).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "beam_jax"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, BeamConfig, preset  # noqa: E402
from beam_jax.generate import _greedy_step  # noqa: E402
from beam_jax.kv_cache import KVCache  # noqa: E402
from beam_jax.model import abstract_flat, params_from_flat  # noqa: E402

HBM_BYTES_PER_S = 4.2e12
STD = 0.02


def smoke_config() -> BeamConfig:
    return BeamConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        sliding_window=16,
        layer_types=(SLIDING, SLIDING, SLIDING, SLIDING, SLIDING, FULL),
        mlp_layer_types=(DENSE, DENSE, DENSE, SPARSE, SPARSE, SPARSE),
        max_position_embeddings=4096,
    )


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ---- HBM floor -------------------------------------------------------------------------------
def floor_bytes(config: BeamConfig, batch: int, cache_len: int, all_experts: bool) -> tuple[float, float]:
    """(weight bytes, KV-cache bytes) read by one decode step at `batch`."""
    E, k = config.num_experts, config.num_experts_per_tok
    touched = E if all_experts else E * (1 - (1 - k / E) ** batch)
    total = 0.0
    for name, leaf in abstract_flat(config, jnp.bfloat16).items():
        nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
        if name == "model.embed_tokens.weight":
            if config.tie_word_embeddings:
                total += nbytes
            else:
                total += batch * leaf.shape[1] * jnp.dtype(leaf.dtype).itemsize
        elif ".mlp.experts." in name:
            total += nbytes * touched / E
        else:
            total += nbytes
    kv = 2 * config.num_hidden_layers * batch * cache_len * config.num_key_value_heads * config.head_dim * 2
    return total, kv


# ---- timing helpers --------------------------------------------------------------------------
def median_ms(times):
    return 1e3 * statistics.median(times)


# ---- JAX -------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * STD).astype(dtype)


def jax_params(config: BeamConfig):
    key = jax.random.key(0)
    arrays = {}
    for i, (name, leaf) in enumerate(sorted(abstract_flat(config, jnp.bfloat16).items())):
        if name.endswith("norm.weight"):
            arrays[name] = jnp.ones(leaf.shape, leaf.dtype)
        elif name.endswith(("bias", "e_score_correction_bias")):
            arrays[name] = jnp.zeros(leaf.shape, leaf.dtype)
        else:
            arrays[name] = _normal(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype))
    jax.block_until_ready(arrays)
    return params_from_flat(config, arrays)


def run_jax(config, args, results):
    """Fills results[(what)] = ms."""
    t0 = time.time()
    params = jax_params(config)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    log(f"JAX params on {jax.devices()[0]}: {nbytes / 1e9:.2f} GB in {time.time() - t0:.1f} s")
    P, S = args.prompt, args.cache
    tokens = jax.random.randint(jax.random.key(1), (1, P), 0, config.vocab_size, jnp.int32)
    positions = jnp.arange(P, dtype=jnp.int32)[None]
    last = jnp.array([P - 1], jnp.int32)

    # prefill 512, batch 1 (cache of S slots; the returned cache is fed back in: donated)
    cache = None
    try:
        cache = KVCache.create(config, 1, S)
        t0 = time.time()
        tok, cache = _greedy_step(params, tokens, positions, last, cache, config=config)
        jax.block_until_ready(tok)
        log(f"JAX prefill compile+first {time.time() - t0:.1f} s")
        for _ in range(args.warmup):
            tok, cache = _greedy_step(params, tokens, positions, last, cache, config=config)
        jax.block_until_ready(tok)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            tok, cache = _greedy_step(params, tokens, positions, last, cache, config=config)
            jax.block_until_ready(tok)
            times.append(time.perf_counter() - t)
        results[f"prefill {P}, batch 1"] = median_ms(times)
        log(f"JAX prefill {results[f'prefill {P}, batch 1']:.3f} ms")
    except Exception:
        traceback.print_exc()
        cache = None

    for B in args.batches:
        what = f"decode step, batch {B}"
        try:
            if cache is None:
                cache = KVCache.create(config, 1, S)
                _, cache = _greedy_step(params, tokens, positions, last, cache, config=config)
            # The batch-1 prefill's cache, repeated B times (JAX's attention is dense over all slots,
            # so the step's cost does not depend on the contents).
            c = KVCache(
                tuple(jnp.repeat(x, B, axis=0) for x in cache.keys),
                tuple(jnp.repeat(x, B, axis=0) for x in cache.values),
            )
            step_tok = jnp.asarray(jnp.arange(B, dtype=jnp.int32)[:, None] % config.vocab_size)
            step_pos = jnp.full((B, 1), P, jnp.int32)
            zero = jnp.zeros((B,), jnp.int32)
            t0 = time.time()
            nxt, c = _greedy_step(params, step_tok, step_pos, zero, c, config=config)
            jax.block_until_ready(nxt)
            log(f"JAX {what} compile+first {time.time() - t0:.1f} s")
            for _ in range(args.warmup):
                nxt, c = _greedy_step(params, nxt[:, None], step_pos, zero, c, config=config)
            jax.block_until_ready(nxt)
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                nxt, c = _greedy_step(params, nxt[:, None], step_pos, zero, c, config=config)
                jax.block_until_ready(nxt)
                times.append(time.perf_counter() - t)
            results[what] = median_ms(times)
            log(f"JAX {what} {results[what]:.3f} ms")
            del c
        except Exception:
            traceback.print_exc()
    del params, cache
    gc.collect()


# ---- PyTorch ---------------------------------------------------------------------------------
def build_torch(config, device):
    import torch
    import transformers
    from reference_models import hf_config

    hf = hf_config(config)
    hf._attn_implementation = "eager"
    last_error = None
    for impl in ("grouped_mm", "eager"):
        try:
            hf._experts_implementation = impl
            torch.manual_seed(0)
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(device):
                    model = transformers.BeamForCausalLM(hf)
            finally:
                torch.set_default_dtype(old)
            model.eval()
            try:
                model.set_attn_implementation("eager")
            except Exception as e:  # noqa: BLE001
                log(f"set_attn_implementation: {e!r}")
            try:
                model.set_experts_implementation(impl)
            except Exception as e:  # noqa: BLE001
                log(f"set_experts_implementation({impl}): {e!r}")
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.fill_(1.0)
                    elif p.ndim == 1:
                        p.zero_()
                    else:
                        p.normal_(0.0, STD)
                # Router fp32, as the reference keeps it (`_keep_in_fp32_modules_strict`).
                for module in model.modules():
                    if isinstance(module, transformers.models.beam.modeling_beam.BeamTopKRouter):
                        module.weight.data = module.weight.data.float()
                        module.e_score_correction_bias.data = torch.zeros_like(
                            module.e_score_correction_bias, dtype=torch.float32
                        )
            # A tiny check that this experts implementation runs here.
            with torch.inference_mode():
                ids = torch.zeros((2, 4), dtype=torch.long, device=device)
                model(input_ids=ids).logits.float().sum().item()
            return model, hf, impl
        except Exception as e:  # noqa: BLE001
            last_error = e
            traceback.print_exc()
            log(f"experts implementation {impl!r} failed; trying the next")
            model = None
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()
    raise RuntimeError(f"no experts implementation worked: {last_error!r}")


def run_torch(config, args, results, device):
    import torch
    from transformers import DynamicCache

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    t0 = time.time()
    model, hf, impl = build_torch(config, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"torch model on {device}: {nbytes / 1e9:.2f} GB, experts={impl!r}, "
        f"attn={model.config._attn_implementation!r}, in {time.time() - t0:.1f} s")
    results["_experts_implementation"] = impl
    P = args.prompt
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.inference_mode():
        try:
            ids = torch.randint(0, config.vocab_size, (1, P), generator=g).to(device)

            def prefill():
                cache = DynamicCache(config=hf)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                return out.logits[:, -1].argmax(-1), out.past_key_values

            for _ in range(args.warmup):
                prefill()
            sync()
            times = []
            for _ in range(args.iters):
                sync()
                t = time.perf_counter()
                tok, _ = prefill()
                sync()
                times.append(time.perf_counter() - t)
            results[f"prefill {P}, batch 1"] = median_ms(times)
            log(f"torch prefill {results[f'prefill {P}, batch 1']:.3f} ms")
        except Exception:
            traceback.print_exc()

        for B in args.batches:
            what = f"decode step, batch {B}"
            try:
                ids = torch.randint(0, config.vocab_size, (B, P), generator=g).to(device)
                cache = DynamicCache(config=hf)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1)
                del out
                # The cache grows by one slot a step (warm-up + iters steps after the 512 prompt).
                for _ in range(args.warmup):
                    out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
                sync()
                times = []
                for _ in range(args.iters):
                    sync()
                    t = time.perf_counter()
                    out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
                    sync()
                    times.append(time.perf_counter() - t)
                results[what] = median_ms(times)
                log(f"torch {what} {results[what]:.3f} ms")
                del cache, out
            except Exception:
                traceback.print_exc()
    del model
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


# ---- main ------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--cache", type=int, default=1024, help="JAX KVCache slots")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--skip-jax", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (JAX and torch)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    if args.smoke:
        config = smoke_config()
        args.prompt, args.cache, args.iters, args.warmup = 64, 128, 3, 1
        device = "cpu"
    else:
        config = preset("beam-tp8-slice", num_hidden_layers=args.layers)
        device = "cuda"
    started = time.time()
    log(f"jax {jax.__version__} devices {jax.devices()}; config layers={config.num_hidden_layers} "
        f"hidden={config.hidden_size} experts={config.num_experts}x{config.moe_intermediate_size} "
        f"layer_types={config.layer_types} mlp={config.mlp_layer_types}")
    try:
        import torch
        import transformers

        log(f"torch {torch.__version__} (cuda {torch.cuda.is_available()}), transformers {transformers.__version__}")
    except Exception:
        traceback.print_exc()

    torch_ms, jax_ms = {}, {}
    # PyTorch first (then its memory is freed), JAX second: with preallocation off both fit anyway.
    if not args.skip_torch:
        try:
            run_torch(config, args, torch_ms, device)
        except Exception:
            traceback.print_exc()
    if not args.skip_jax:
        try:
            run_jax(config, args, jax_ms)
        except Exception:
            traceback.print_exc()

    rows = []
    whats = [f"prefill {args.prompt}, batch 1"] + [f"decode step, batch {B}" for B in args.batches]
    for what in whats:
        row = {"what": what, "jax_ms": jax_ms.get(what), "torch_ms": torch_ms.get(what)}
        row["torch_over_jax"] = (
            row["torch_ms"] / row["jax_ms"] if row["jax_ms"] and row["torch_ms"] else None
        )
        if what.startswith("decode"):
            B = int(what.rsplit(" ", 1)[1])
            w, kv = floor_bytes(config, B, args.prompt + 1, all_experts=False)
            w_all, _ = floor_bytes(config, B, args.prompt + 1, all_experts=True)
            row.update(
                floor_bytes_weights_touched=w,
                floor_bytes_weights_all_experts=w_all,
                floor_bytes_kv=kv,
                floor_ms=(w + kv) / HBM_BYTES_PER_S * 1e3,
                floor_all_experts_ms=(w_all + kv) / HBM_BYTES_PER_S * 1e3,
            )
            # JAX time as a multiple of the floor, and the floor as a % of JAX's time (roofline share)
            row["jax_over_floor"] = row["jax_ms"] / row["floor_ms"] if row["jax_ms"] else None
            row["jax_pct_of_floor"] = 100 * row["floor_ms"] / row["jax_ms"] if row["jax_ms"] else None
        rows.append(row)

    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    print()
    print(f"config: {'smoke' if args.smoke else f'beam-tp8-slice, {config.num_hidden_layers} layers'}, bf16, "
          f"prompt {args.prompt}, median of {args.iters}; torch experts={torch_ms.get('_experts_implementation')}, "
          f"attn=eager; JAX MoE=ragged_dot reference, dense attention over {args.cache}-slot cache")
    print("floor = (non-expert weights + B embedding rows + expected distinct experts touched "
          f"E(1-(1-k/E)^B) + KV of {args.prompt + 1} slots) / 4.2 TB/s; [all exp] = all experts (upper bound); "
          "JAX/floor = JAX time / floor; floor/JAX = share of the HBM roofline reached")
    header = f"| {'what':<22} | {'JAX ms':>9} | {'PyTorch ms':>10} | {'PT/JAX':>7} | {'floor ms':>8} | {'[all exp]':>9} | {'JAX/floor':>9} | {'floor/JAX %':>11} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(f"| {r['what']:<22} | {fmt(r['jax_ms']):>9} | {fmt(r['torch_ms']):>10} | "
              f"{fmt(r['torch_over_jax'], '{:.2f}x'):>7} | {fmt(r.get('floor_ms')):>8} | "
              f"{fmt(r.get('floor_all_experts_ms')):>9} | {fmt(r.get('jax_over_floor'), '{:.1f}x'):>9} | {fmt(r.get('jax_pct_of_floor'), '{:.2f}%'):>11} |")
    print(f"total {time.time() - started:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "config": "smoke" if args.smoke else f"beam-tp8-slice/{config.num_hidden_layers}",
            "prompt": args.prompt, "cache_slots_jax": args.cache, "iters": args.iters,
            "torch_experts_implementation": torch_ms.get("_experts_implementation"),
            "hbm_bytes_per_s": HBM_BYTES_PER_S, "jax": jax.__version__, "device": str(jax.devices()[0]),
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
