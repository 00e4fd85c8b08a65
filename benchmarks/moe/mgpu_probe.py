"""GPU probe of the Mosaic GPU NVFP4 grouped GEMM (`pallas_kernels/nvfp4_mgpu.py`): checks it against
plain jnp, then times it at Beam's TP8 expert shapes beside the Triton NVFP4 layer of `moe_gemm` in the
same run. CUPTI device time per call; weights rotate over fresh expert ids so they come from HBM.

    OUT=dir python3 -u benchmarks/moe/mgpu_probe.py [--no-check | --layers | --bf16-prefill | --table | --gather |
                                                     --epilogues | --glue [--tokens 8,64]]
    OUT=dir python3 -u benchmarks/moe/mgpu_probe.py --variants '[{}, {"gate_up_swiglu": true}]' --tokens 8,64 [--bf16]

`--variants`: the NVFP4 layer with each set of `moe_nvfp4` settings (`{}`: the defaults) per token count, the
Triton layer beside them (and with `--bf16` the model's bf16 layer), one line per layer and the JSON rows.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from bench import mg  # noqa: E402
from pallas_kernels import nvfp4_mgpu as nm  # noqa: E402

HBM_BYTES_PER_S = 4.2e12  # the floor rate of benchmarks/moe (RESULTS.md)
E2M1 = mg._E2M1_VALUES


def make_expert_weights(rng, experts, n, k, tile_k):
    """Random codes and e4m3 block scales -> (packed, kernel scales, dequantized fp32 [E, N, K])."""
    codes = rng.integers(0, 16, (experts, n, k), dtype=np.uint8)
    scale = rng.uniform(0.02, 4, (experts, n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
    dequant = E2M1[codes] * np.repeat(scale.astype(np.float32), 16, axis=-1)
    return (*nm.pack_weights(codes, scale, tile_k), dequant)


def check(rng, experts, n, k, blocks, block_t, tile_k, splits):
    packed, scales, dequant = make_expert_weights(rng, experts, n, k, tile_k)
    x = rng.standard_normal((blocks * block_t, k)).astype(ml_dtypes.bfloat16)
    block_expert = rng.integers(0, experts, blocks).astype(np.int32)
    out = nm.grouped_matmul(jnp.asarray(x), jnp.asarray(block_expert), packed, scales,
                            block_t=block_t, tile_k=tile_k, splits=splits)
    got = np.asarray(out).sum(0) * nm.OUTPUT_FACTOR
    want = np.einsum("btk,bnk->btn", x.astype(np.float32).reshape(blocks, block_t, k),
                     dequant[block_expert]).reshape(-1, n)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return dict(kind="check", experts=experts, n=n, k=k, blocks=blocks, block_t=block_t, tile_k=tile_k,
                splits=splits, rel_err=err, ok=err < 1e-5)


def time_kernel(rng, n, k, blocks, block_t, tile_k, splits, stages, tile_n=64, repeats=4, **options):
    # Random bytes and scales made on the device: timing does not need known values.
    kp, ks = jax.random.split(jax.random.key(n * k + splits))
    packed = jax.random.bits(kp, (bench.E, k // tile_k, n, tile_k // 2), jnp.uint8)
    scales = jax.random.bits(ks, (bench.E, k // tile_k, n, tile_k // 64), jnp.uint32)  # any codes decode
    xs = jnp.asarray(rng.standard_normal((repeats, blocks * block_t, k)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(bench.E)[:blocks] for _ in range(repeats)]).astype(np.int32))
    op = functools.partial(nm.grouped_matmul, block_t=block_t, tile_k=tile_k, splits=splits, stages=stages,
                           tile_n=tile_n, **options)
    us, _, _ = bench.time_calls(op, (xs, ids), packed, scales)
    weight_bytes = blocks * n * k // 2 + blocks * n * k // 16  # values + one-byte scales (the layer's floor bytes)
    return dict(kind="time", n=n, k=k, blocks=blocks, block_t=block_t, tile_k=tile_k, splits=splits,
                stages=stages, tile_n=tile_n, **options, us=us,
                floor_us=weight_bytes / HBM_BYTES_PER_S * 1e6,
                pct_floor=100 * weight_bytes / HBM_BYTES_PER_S / (us * 1e-6))


def time_triton_layer(t, repeats=4):
    """Same-run baseline: the Triton NVFP4 MoE layer (per kernel, one call) and its total per call."""
    weights = bench.make_weights("nvfp4", jax.random.key(0))
    x, w, ids = bench.make_tokens(t, repeats, jax.random.key(t))
    total, kernels, _ = bench.time_calls(mg.moe_gemm_kernel, (x, w, ids), *weights)
    return dict(kind="triton_layer", t=t, us=total, kernels=kernels)


def variant_name(settings: dict) -> str:
    """A Mosaic layer variant's name from its keyword arguments."""
    def text(value):  # without spaces: a name is one word of the SUMMARY lines
        return json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else value
    return "mosaic[" + (",".join(f"{key}={text(value)}" for key, value in settings.items()) or "default") + "]"


def layer_weights():
    """Beam's TP8 NVFP4 experts (gate, up, down), and the Mosaic kernel's copies of them."""
    weights = bench.make_weights("nvfp4", jax.random.key(0))
    return weights, bench.mosaic_layout(*weights)


def _timer(spans: bool):
    """(timing function, its name): `bench.time_spans` or `bench.time_calls` (CUPTI sums)."""
    return (bench.time_spans, "span") if spans else (bench.time_calls, "cupti")


def time_layers(t, variants, weights, repeats=4, spans=False, real=None, progress=False):
    """The whole NVFP4 MoE layer, Triton kernels against the Mosaic GEMMs, same weights and tokens:
    CUPTI total per call (`bench.time_calls`; with `spans` the span of a call's kernels instead,
    `bench.time_spans`) and one call's kernels; plus each layer's error against the reference. `real`: only the
    first `real` tokens are routed, the others padding (id -1, as the model masks an engine bucket's padding).
    A variant with `"counters_passed": true` passes the fused kernel's counters from call to call, as the model
    passes them from layer to layer (spans only: `bench.time_spans(carry=)`). `progress`: a PROGRESS line as each
    layer is timed (what a run cut short by a hang or a timeout still shows)."""
    from pallas_kernels import nvfp4_fused_moe as nfm
    from pallas_kernels import nvfp4_moe_mgpu as nmm

    (gate, up, down), _ = weights
    x, w, ids = bench.make_tokens(t, repeats, jax.random.key(t))
    real = t if real is None else real
    ids = ids.at[:, real:].set(-1)
    # Weights are arguments, not closed over: jit would make them constants of the program.
    layers = {"triton": (lambda x, w, ids, weights: mg.moe_gemm_kernel(x, w, ids, *weights[0]), None)}
    for settings in variants:  # moe_nvfp4 keyword arguments; the rest from default_config
        name = variant_name(settings)
        settings = dict(settings)
        if settings.pop("counters_passed", False):
            layer = functools.partial(lambda x, w, ids, weights, counters, **kw: nmm.moe_nvfp4(
                x, w, ids, *weights[1], counters=counters, **kw), **settings)
            layers[name] = (layer, nfm.fresh_counters())
        else:
            layers[name] = (functools.partial(
                lambda x, w, ids, weights, **kw: nmm.moe_nvfp4(x, w, ids, *weights[1], **kw), **settings), None)
    # Tokens are independent: the reference (which gathers every pair's weights) checks the first 64.
    checked = min(real, 64)
    want = np.asarray(jax.jit(mg.moe_gemm_reference)(x[0, :checked], w[0, :checked], ids[0, :checked], gate, up,
                                                     down), np.float32)
    floor_bytes = bench.expert_bytes(gate, up, down) * len(np.unique(np.asarray(ids[0, :real])))
    row = dict(kind="layers", t=t, real=real, floor_us=floor_bytes / HBM_BYTES_PER_S * 1e6)
    timer, timer_name = _timer(spans)
    for name, (layer, carry) in layers.items():
        t0 = time.time()
        try:
            total, kernels, got = timer(layer, (x, w, ids), weights, **({} if carry is None else dict(carry=carry)))
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            row[name] = dict(error=repr(e)[:1000])
        else:
            got = np.asarray(got if carry is None else got[0], np.float32)[:checked]
            row[name] = dict(us=total, kernels=kernels, timer=timer_name,
                             max_err=float(np.abs(got - want).max()), max_ref=float(np.abs(want).max()),
                             seconds=round(time.time() - t0, 1))
        if progress:
            print(layer_line("PROGRESS", row, name), flush=True)
    return row


def layer_line(tag, row, name, bf16_us=None, kernels=False):
    """A layer's line of a `time_layers` row: T, real tokens, µs, % of the floor, (bf16's µs over it), error,
    (timer and kernels), or its error."""
    layer, head = row[name], f"{tag} T={row['t']} real={row['real']} {name}"
    if "error" in layer:
        return f"{head} ERROR {layer['error'][:300]}"
    ratio = f" bf16/this {bf16_us / layer['us']:.2f}" if bf16_us else ""
    line = (f"{head} {layer['us']:.1f} us ({100 * row['floor_us'] / layer['us']:.1f} % of {row['floor_us']:.1f})"
            f"{ratio} err {layer['max_err']:.4f}")
    if kernels:
        line += f" {layer['timer']} kernels " + str([(kernel[:10], *[round(v, 1) for v in times])
                                                    for kernel, *times in layer["kernels"]])
    return line


def time_bf16_layers(t, variants, weights, repeats=2, spans=False):
    """The bf16 layer: the model's path before this layer existed (`moe_gemm`: Triton kernels, XLA at
    one token) against the Mosaic TMA + wgmma layer (`bf16_moe_mgpu.moe_bf16`) per setting; µs,
    TFLOP/s, % of the HBM floor (touched experts' bytes), kernels, error against the reference."""
    from beam_jax.layers.moe import experts_reference
    from pallas_kernels import bf16_moe_mgpu as bm

    gate, up, down = weights
    fused = (gate.values, down.values)
    x, w, ids = bench.make_tokens(t, repeats, jax.random.key(t))
    checked = min(t, 512)  # tokens are independent; XLA's ragged_dot runs out of memory at T = 8192
    want = np.asarray(jax.jit(experts_reference)(x[0, :checked], w[0, :checked], ids[0, :checked], *fused),
                      np.float32)
    layers = {"moe_gemm": (lambda x, w, ids, weights: mg.moe_gemm(x, w, ids, *weights), weights)}
    for settings in variants:
        name = variant_name(settings)
        layers[name] = (functools.partial(lambda x, w, ids, weights, **kw: bm.moe_bf16(x, w, ids, *weights, **kw),
                                          **settings), fused)
    flops = 2 * t * bench.TOP_K * 3 * bench.H * bench.I
    floor_bytes = bench.expert_bytes(gate, up, down) * len(np.unique(np.asarray(ids[0])))
    row = dict(kind="bf16_layers", t=t, floor_us=floor_bytes / HBM_BYTES_PER_S * 1e6)
    timer, timer_name = _timer(spans)
    for name, (layer, args) in layers.items():
        t0 = time.time()
        try:
            us, kernels, got = timer(layer, (x, w, ids), args)
        except Exception as e:  # noqa: BLE001 - report and go on
            row[name] = dict(error=repr(e)[:1000])
            continue
        row[name] = dict(us=us, tflops=flops / us / 1e6, kernels=kernels, seconds=round(time.time() - t0, 1),
                         max_err=float(np.abs(np.asarray(got, np.float32)[:checked] - want).max()),
                         max_ref=float(np.abs(want).max()), timer=timer_name)
    return row


def time_gathers(t, block_t, configs, repeats=2):
    """`row_gather.gather_rows` alone for T tokens' sorted blocks of `block_t` rows, per program shape
    (rows, columns, warps) and `zero_padding` (z1: padding rows written as zeros, z0: left alone): µs per
    call (with the block building) and the gather kernel's own µs."""
    from pallas_kernels import nvfp4_moe_mgpu as nmm
    from pallas_kernels import row_gather as rg

    x, _, ids = bench.make_tokens(t, repeats, jax.random.key(t))
    row = dict(kind="gather", t=t, block_t=block_t)
    for (rows, cols, warps), zeros in itertools.product(configs, (False, True)):
        def gather(x, ids, rows=rows, cols=cols, warps=warps, zeros=zeros):
            _, block_expert, row_pair = nmm.pair_blocks(ids, bench.E, block_t)
            return rg.gather_rows(x, nmm.row_tokens(row_pair, bench.TOP_K, t), block_expert, block_t=block_t,
                                  zero_padding=zeros, rows_per_program=rows,
                                  columns_per_program=cols, num_warps=warps)
        name = f"r{rows}c{cols}w{warps}z{int(zeros)}"
        try:
            us, kernels, _ = bench.time_calls(gather, (x, ids))
        except Exception as e:  # noqa: BLE001 - report and go on
            row[name] = dict(error=repr(e)[:1000])
            continue
        gather_us = sum(u for name_, u in kernels if "gather" in name_)
        row[name] = dict(us=us, gather_us=gather_us, kernels=kernels)
    return row


def time_glue(t, opened_shapes, repeats=4):
    """The blocks at T tokens, alone, µs per call: blocks of 8 rows built by compare-and-count and gathered
    against `gather_opened_blocks` per program shape (column groups, columns per step, warps)."""
    from pallas_kernels import nvfp4_moe_mgpu as nmm
    from pallas_kernels import row_gather as rg

    x, _, ids = bench.make_tokens(t, repeats, jax.random.key(t))

    def compare(x, ids):
        _, block_expert, row_pair = nmm._blocks_by_comparison(ids, bench.E, 8)
        return rg.gather_rows(x, nmm.row_tokens(row_pair, bench.TOP_K, t), block_expert, block_t=8)

    ops = {"compare+gather": compare}
    for groups, step, warps in opened_shapes:
        ops[f"opened g{groups}s{step}w{warps}"] = functools.partial(
            lambda x, ids, **kw: rg.gather_opened_blocks(x, ids.reshape(-1), num_experts=bench.E, block_t=8, **kw),
            column_groups=groups, columns_per_step=step, num_warps=warps)
    row = dict(kind="glue", t=t)
    for name, op in ops.items():
        try:
            us, kernels, _ = bench.time_calls(op, (x, ids))
        except Exception as e:  # noqa: BLE001 - report and go on
            row[name] = dict(error=repr(e)[:1000])
            continue
        row[name] = dict(us=us, kernels=kernels)
        print(f"SUMMARY T={t} {name} {us:.2f} us kernels {[(k[:12], round(u, 2)) for k, u in kernels]}", flush=True)
    return row


def compare_variants(variants, tokens, with_bf16, record, spans=False, real=None):
    """`--variants`: per T, `time_layers` with these settings and a line per layer (µs, % of the floor, error,
    kernels); with `with_bf16` the model's bf16 layer and its ratio to each NVFP4 variant; `spans`: timed as
    the span of a call's kernels (`bench.time_spans`), the kernels' start times in the lines; `real`: per T, the
    real token counts below T to time it with (the rest padding), instead of T real tokens."""
    nvfp4 = layer_weights()
    bf16 = bench.make_weights("bf16", jax.random.key(0)) if with_bf16 else None
    shapes = [(t, r) for t in tokens for r in ([t] if real is None else [r for r in real if r < t])]
    for t, r in shapes:
        row = time_layers(t, variants, nvfp4, spans=spans, real=r, progress=True)
        record(row)
        bf16_us = None
        if with_bf16 and t > 1 and r == t:
            bf16_row = time_bf16_layers(t, [], bf16, spans=spans)
            record(bf16_row)
            bf16_us = bf16_row["moe_gemm"].get("us")
            print(f"SUMMARY T={t} bf16 moe_gemm {bf16_us} us", flush=True)
        for name, layer in row.items():
            if isinstance(layer, dict):
                print(layer_line("SUMMARY", row, name, bf16_us, kernels=True), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-check", action="store_true", help="skip the checks against plain numpy")
    parser.add_argument("--layers", action="store_true", help="only the whole layer, Triton against Mosaic")
    parser.add_argument("--bf16-prefill", action="store_true", help="only the bf16 layer at prefill sizes")
    parser.add_argument("--gather", action="store_true", help="the row-gather kernel's program shapes")
    parser.add_argument("--glue", action="store_true", help="block builders and pair combines alone, per program shape")
    parser.add_argument("--table", action="store_true", help="both formats' layers on the model's paths, all T")
    parser.add_argument("--epilogues", action="store_true",
                        help="the layer at decode sizes with each GEMM's own epilogue on or off")
    parser.add_argument("--variants", help="JSON list of moe_nvfp4 settings: the layer with each, per --tokens")
    parser.add_argument("--tokens", default="1,8,16,32,64", help="token counts for --variants and --glue")
    parser.add_argument("--bf16", action="store_true", help="with --variants: the bf16 layer too (T > 1)")
    parser.add_argument("--real", default=None,
                        help="with --variants: real token counts below each T, the rest padding (id -1), e.g. 5,6,7")
    parser.add_argument("--spans", action="store_true",
                        help="with --variants: time each call as its kernels' span, not CUPTI's sum of kernel times")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    out = os.path.join(os.environ.get("OUT", "."), "mgpu-probe.json")

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)

    if args.variants:
        compare_variants(json.loads(args.variants), [int(t) for t in args.tokens.split(",")], args.bf16, record,
                         spans=args.spans, real=args.real and [int(r) for r in args.real.split(",")])
        return
    if args.bf16_prefill:
        weights = bench.make_weights("bf16", jax.random.key(0))
        # Runs X and AA chose the grid kernels' stages; runs AC and AD the persistent kernels' tiles (now
        # the default), the grid kernels as the same-run baseline besides Triton's.
        plans = {8192: [{}, dict(persistent=False)], 4096: [{}, dict(persistent=False)]}
        for t, variants in plans.items():
            record(time_bf16_layers(t, variants, weights))
        return
    if args.gather:
        # Run AA chose the default program shape; run AH (session 11) the padding rows' writes per path.
        configs = [(32, 512, 4)]
        for t, block_t in ((8192, 128), (8192, 64), (4096, 64)):
            record(time_gathers(t, block_t, configs))
        return
    if args.glue:
        # Sessions 21-22: the opened-blocks kernel's program shapes (and, removed since, two other glue kernels).
        opened = [(5, 1024, 4), (1, 1024, 4), (1, 1024, 8), (2, 512, 4), (1, 2048, 8)]
        for t in [int(t) for t in args.tokens.split(",")]:
            record(time_glue(t, opened))
        return
    if args.epilogues:
        # Session 17: the GEMMs' own epilogues (global scales, bf16 out; the down GEMM writing pair rows) per
        # GEMM, at the decode sizes that use shared-row blocks (default: none) and sorted ones (default: both).
        weights = layer_weights()
        both, down_only = dict(gate_up_epilogue=True, down_epilogue=True), dict(gate_up_epilogue=False,
                                                                                 down_epilogue=True)
        for t in (1, 8, 16, 32, 64):
            variants = [{}, down_only] + ([both] if t <= 16 else [])
            try:
                record(time_layers(t, variants, weights))
            except Exception as e:  # noqa: BLE001
                record(dict(kind="layers", t=t, error=repr(e)[:2000]))
        return
    if args.table:
        # Issue 4's table for the paths the model takes, both formats in one run: NVFP4 (Triton against
        # the Mosaic layer) and bf16 (`moe_gemm` against the Mosaic prefill layer at T >= 512).
        nvfp4, bf16 = layer_weights(), bench.make_weights("bf16", jax.random.key(0))
        for t in (1, 8, 16, 32, 64, 512, 4096, 8192):
            nvfp4_variants = [{}, dict(down_tile_n=256)] if 1 < t <= 16 else [{}]
            bf16_variants = [{}] if t >= 512 else []
            for kind, time_row in (("layers", lambda: time_layers(t, nvfp4_variants, nvfp4)),
                                   ("bf16_layers", lambda: time_bf16_layers(t, bf16_variants, bf16))):
                try:
                    record(time_row())
                except Exception as e:  # noqa: BLE001
                    record(dict(kind=kind, t=t, error=repr(e)[:2000]))
        return
    if args.layers:
        # Run V (RESULTS.md) chose 2 gate/up stages and the kernel's epilogue past 16 tokens; run W found
        # XLA's row gather slow (now `row_gather`) and blocks of 128 rows slower at prefill (run X).
        # Run Y: the GEMMs are 85-90 % of the layer at T <= 64; next, gate/up program shapes.
        # Run Z: nothing near the decode defaults won (tile_n 128 by 2 % at T = 64 only). Run AA: blocks
        # of 32 rows and gate/up programs of 128 rows at T = 512 (now the defaults up to 1024 tokens);
        # next, the same choices where they are untimed: 2048 tokens and prefill. Session 15 (runs B-D):
        # the down GEMM with the combine in it, and one wgmma in flight, both lost and were removed.
        wide = dict(gate_up_tile_n=128)
        down2 = dict(down_stages=2)  # the down GEMM's K is 5 steps; the isolated sweep (no flag) times more
        plans = {8: [{}, down2], 64: [{}, down2], 2048: [{}, dict(block_t=32), dict(block_t=32, **wide), dict(wide)],
                 8192: [{}, wide]}
        weights = layer_weights()
        for t, variants in plans.items():
            try:
                record(time_layers(t, variants, weights))
            except Exception as e:  # noqa: BLE001
                record(dict(kind="layers", t=t, error=repr(e)[:2000]))
        return
    if not args.no_check:
        for case in [(16, 128, 512, 3, 8, 256, 1), (16, 192, 320, 5, 16, 64, 1), (32, 640, 5120, 4, 8, 256, 4)]:
            try:
                record(check(rng, *case))
            except Exception as e:  # noqa: BLE001 - report and go on
                record(dict(kind="check", case=case, error=repr(e)[:2000]))
    # (tokens, distinct experts): T=1 uses 8 experts; T=8/64 about 57/223 of 256 (random top-8 ids).
    # Each T: the Triton layer first (same-run baseline), then the Mosaic GEMMs alone as
    # (N, K, tile_k, splits, stages, tile_n). Runs Y-Z: in the layer the down GEMM reaches 57 % of its
    # share of the floor at T = 8, gate/up 73 %; this sweeps the down GEMM's stages and program rows.
    down = [(5120, 320, 64, 1, stages, tile_n) for stages in (1, 2, 4) for tile_n in (64, 128, 256)]
    plans = {8: [(640, 5120, 256, 1, 2, 64), (640, 5120, 256, 1, 1, 64)] + down,
             64: [(640, 5120, 256, 1, 2, 64), (5120, 320, 64, 1, 4, 128), (5120, 320, 64, 1, 2, 128)]}
    for t, blocks in [(8, 57), (64, 223)]:
        try:
            record(time_triton_layer(t))
        except Exception as e:  # noqa: BLE001
            record(dict(kind="triton_layer", t=t, error=repr(e)[:2000]))
        for n, k, tile_k, splits, stages, tile_n in plans[t]:
            try:
                record(dict(t=t, **time_kernel(rng, n, k, blocks, 8, tile_k, splits, stages, tile_n)))
            except Exception as e:  # noqa: BLE001
                record(dict(kind="time", t=t, n=n, splits=splits, stages=stages, tile_n=tile_n,
                            error=repr(e)[:2000]))


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
