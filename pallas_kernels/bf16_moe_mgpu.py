"""Beam's bf16 MoE layer for prefill on Pallas Mosaic GPU grouped GEMMs (Hopper: TMA + wgmma).

The Triton kernels of `moe_gemm` reach 37 % of the H200's measured bf16 rate at T = 8192
(benchmarks/moe/RESULTS.md, run F): no TMA, no wgmma pipelining. Here the pairs are sorted into blocks
of `block_t` rows of one expert (`nvfp4_moe_mgpu.pair_blocks`) and a GEMM tile is `[block_t, tile_n]`
of one block: its rows are the wgmma's M, the weight rows its N, both operands stream through shared
memory by TMA. Two kernels share that contract: `grouped_matmul`, a program per tile, and
`persistent_matmul`, a program per SM with a memory warpgroup feeding two compute warpgroups, which
also fuses SwiGLU into the gate/up GEMM. Outputs are `[rows, N]` bf16, rounded as `moe_gemm_reference`
rounds.

H200 (benchmarks/moe/RESULTS.md, runs AF and AG): the persistent layer took 1826 and 1868 us at T =
8192 (52 and 51 % of 676 TFLOP/s) against Triton's 2529 and 2538, and 1222 against 1474 at T = 4096;
at T = 2048 Triton wins (983 against 1061, run AC). The model calls it from PREFILL_MIN_TOKENS tokens
on, where the tiles fit (`fits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import moe_gemm as mg
from pallas_kernels import row_gather as rg
from pallas_kernels.mgpu_tiles import interpret_params, num_sms, smem_transforms
from pallas_kernels.nvfp4_moe_mgpu import pair_blocks, row_tokens


PREFILL_MIN_TOKENS = 4096  # run AC: 1327 against Triton's 1477 us at T = 4096; at 2048 Triton's 983 beat 1061


def default_tiles(persistent: bool) -> dict:
    """`moe_bf16`'s tiles and stages. Grid kernels: runs X and AA (see `moe_bf16`). Persistent kernels
    (H200 runs AC and AD, benchmarks/moe/RESULTS.md): down programs of 256 weight rows and 3 stages (581
    us at T = 8192, against 645 with 128 rows and 4 stages); gate/up tiles of 160 SwiGLU columns and 3
    stages (601 against 638 us with 64 and 6 at T = 4096; at 8192 each won one run by 1-2 %)."""
    if not persistent:
        return dict(tile_n=128, stages=6, down_tile_n=128, down_stages=2)
    return dict(tile_n=160, stages=3, down_tile_n=256, down_stages=3)


def fits(hidden: int, intermediate: int, *, tile_k: int = 64) -> bool:
    """Whether the persistent `moe_bf16`'s default tiles divide experts of this size."""
    tiles = default_tiles(persistent=True)
    return not (intermediate % tiles["tile_n"] or hidden % tiles["down_tile_n"] or hidden % tile_k
                or intermediate % tile_k)


def grouped_matmul(xs, block_expert, w, *, block_t: int = 128, tile_n: int = 128, tile_k: int = 64,
                   stages: int = 4, interpret: bool = False):
    """`xs [B*block_t, K]` bf16, `block_expert [B]` int32 (-1: skip the block; its rows are left
    unwritten), `w [E, N, K]` bf16 (HF [out, in] layout) -> `[B*block_t, N]` bf16: each block's rows
    times its expert's weights, accumulated in fp32."""
    rows, k = xs.shape
    _, n, k2 = w.shape
    blocks = block_expert.shape[0]
    if (rows != blocks * block_t or k2 != k or block_t % 64 or tile_n % 8 or n % tile_n or k % tile_k
            or xs.dtype != w.dtype):
        raise ValueError(f"shapes: xs {xs.shape} {xs.dtype}, w {w.shape} {w.dtype}, blocks {blocks}, "
                         f"block_t {block_t} (a multiple of 64), tile_n {tile_n}, tile_k {tile_k}")
    operand = smem_transforms(tile_k, xs.dtype)

    def kernel(block_expert_gmem, xs_gmem, w_gmem, out_gmem, out_smem):
        b, ni = jax.lax.axis_index("b"), jax.lax.axis_index("n")
        expert = block_expert_gmem[b]

        def acc_scope(acc_ref):
            def step(_, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                # One wgmma stays in flight; the previous one, done now, releases its tiles (delay_release).
                plgpu.wgmma_wait(1)

            plgpu.emit_pipeline(
                step,
                grid=(k // tile_k,),
                in_specs=[
                    plgpu.BlockSpec((block_t, tile_k), lambda kk: (b, kk), transforms=operand, delay_release=1),
                    plgpu.BlockSpec((tile_n, tile_k), lambda kk: (ni, kk), transforms=operand, delay_release=1),
                ],
                max_concurrent_steps=stages,
            )(xs_gmem, w_gmem.at[expert])
            return acc_ref[...]

        @pl.when(expert >= 0)
        def _():
            acc = pl.run_scoped(acc_scope, plgpu.ACC((block_t, tile_n)))
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(b * block_t, block_t), pl.ds(ni * tile_n, tile_n)])
            plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((rows, n), xs.dtype),
        grid=(blocks, n // tile_n),
        grid_names=("b", "n"),
        scratch_types=dict(out_smem=plgpu.SMEM((block_t, tile_n), xs.dtype,
                                               transforms=smem_transforms(tile_n, xs.dtype))),
        interpret=interpret_params(interpret),
    )
    return call(block_expert, xs, w)


def persistent_matmul(xs, block_expert, w, *, block_t: int = 128, tile_n: int = 128, tile_k: int = 64,
                      stages: int = 4, swiglu: bool = False, num_programs: int | None = None, interpret: bool = False):
    """`grouped_matmul`'s contract on a persistent, warp-specialized kernel: one program per SM walks the
    `[block, tile]` tiles (block-major, so an expert's consecutive blocks share its weights in L2); a
    memory warpgroup streams both operands by TMA while two compute warpgroups (half the block's rows
    each) run wgmma, so the next tile's loads overlap this tile's epilogue (the down GEMM's K is five
    steps, so each tile's pipeline fill weighs: 692 us at T = 8192 on `grouped_matmul`, 547-582 here,
    runs AC-AF). `swiglu`: `w` is gate/up `[E, 2I, K]`;
    a tile multiplies `tile_n` gate rows and the matching up rows and writes `SwiGLU(gate, up)`
    `[rows, I]`, rounded as `moe_bf16` rounds (gate and up to bf16 first)."""
    rows, k = xs.shape
    _, n_w, k2 = w.shape
    n_out = n_w // 2 if swiglu else n_w
    blocks = block_expert.shape[0]
    if (rows != blocks * block_t or k2 != k or block_t % 128 or tile_n % 8 or n_out % tile_n or k % tile_k
            or xs.dtype != w.dtype or (swiglu and n_w % 2)):
        raise ValueError(f"shapes: xs {xs.shape} {xs.dtype}, w {w.shape} {w.dtype}, blocks {blocks}, "
                         f"block_t {block_t} (a multiple of 128), tile_n {tile_n}, tile_k {tile_k}")
    wg_rows, n_tiles = block_t // 2, n_out // tile_n
    operand = smem_transforms(tile_k, xs.dtype)
    weight_specs = 2 if swiglu else 1

    def pipeline(body, context):
        spec = lambda shape: plgpu.BlockSpec(shape, lambda kk: (0, kk), transforms=operand, delay_release=1)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tile_k,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            in_specs=[spec((block_t, tile_k))] + [spec((tile_n, tile_k))] * weight_specs,
            max_concurrent_steps=stages, compute_context=context)

    def kernel(block_expert_gmem, xs_gmem, w_gmem, out_gmem):
        wg = jax.lax.axis_index("wg")
        my_rows = pl.ds(wg * wg_rows, wg_rows)
        ignore = lambda *_, **__: None
        shapes = (xs_gmem.at[pl.ds(0, block_t)],) + (w_gmem.at[0, pl.ds(0, tile_n)],) * weight_specs

        @functools.partial(pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(*shapes),
                           out_smem=plgpu.SMEM((2, wg_rows, tile_n), xs.dtype,
                                               transforms=smem_transforms(tile_n, xs.dtype)),
                           collective_axes="wg")
        def scope(allocations, out_smem):
            @plgpu.nd_loop((blocks * n_tiles,), collective_axes="sm")
            def tile(info):
                b, ni = info.index[0] // n_tiles, info.index[0] % n_tiles
                expert = block_expert_gmem[b]

                def step(_, x_smem, *refs):
                    *w_smems, accs = refs
                    for acc, w_smem in zip(accs, w_smems):
                        plgpu.wgmma(acc, x_smem.at[my_rows], w_smem.transpose((1, 0)))
                    # Only this step's wgmmas stay in flight: the previous step's tiles are released.
                    plgpu.wgmma_wait(len(accs))
                    return accs

                def context(run):
                    def acc_scope(*accs):
                        run(accs)
                        values = [acc[...] for acc in accs]
                        if swiglu:  # of gate and up rounded to bf16, as the reference rounds them
                            values = [mg._swiglu(*(v.astype(xs.dtype) for v in values))]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read out_smem
                        out_smem[wg] = values[0].astype(xs.dtype)
                        plgpu.commit_smem()
                        out_rows = pl.ds(b * block_t + wg * wg_rows, wg_rows)
                        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[out_rows, pl.ds(ni * tile_n, tile_n)])
                    pl.run_scoped(acc_scope, *[plgpu.ACC((wg_rows, tile_n))] * weight_specs)

                weights = [w_gmem.at[expert, pl.ds(ni * tile_n, tile_n)],
                           w_gmem.at[expert, pl.ds(n_out + ni * tile_n, tile_n)]][:weight_specs]

                @pl.when(expert >= 0)
                def _():
                    pipeline(step, context)(xs_gmem.at[pl.ds(b * block_t, block_t)], *weights,
                                            allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((rows, n_out), xs.dtype),
        grid=(num_programs or num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )
    return call(block_expert, xs, w)


def grouped_matmul_reference(xs, block_expert, w, *, block_t: int, swiglu: bool = False, **_):
    """Plain jnp with the kernels' contract (blocks of expert -1 give zeros here); `swiglu` as
    `persistent_matmul`'s."""
    x = xs.reshape(block_expert.shape[0], block_t, -1)
    out = jnp.einsum("btk,bnk->btn", x, w[jnp.maximum(block_expert, 0)], preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST)
    out = jnp.where((block_expert >= 0)[:, None, None], out, 0).reshape(-1, w.shape[1]).astype(xs.dtype)
    if swiglu:
        half = w.shape[1] // 2
        out = mg._swiglu(out[:, :half], out[:, half:]).astype(xs.dtype)
    return out


def moe_bf16(x, weights, ids, gate_up, down, *, persistent: bool = True, block_t: int = 128,
             tile_n: int | None = None, tile_k: int = 64, stages: int | None = None, down_tile_n: int | None = None,
             down_stages: int | None = None, expert_offset: int | jax.Array | None = None, matmul=None):
    """Routed experts for bf16 weights: `x [T, H]`, `weights`/`ids [T, top_k]`, `gate_up [E, 2I, H]`
    (gate rows then up rows), `down [E, H, I]`. Pairs are sorted into blocks of `block_t` rows of one
    expert; `row_gather` copies their activations, and XLA adds each token's weighted pairs.
    `persistent`: both GEMMs on `persistent_matmul`, SwiGLU in the gate/up GEMM's epilogue; else on
    `grouped_matmul`, with XLA's SwiGLU between them. Unset tiles and stages: `default_tiles`.
    On `grouped_matmul`, the down GEMM's K is five steps, and 2 stages, which fit two programs on an SM,
    took 693 against 830 us with 4 at T = 8192 (run X); gate/up's 6 stages took 2204 us for the layer at
    T = 8192 against 2284 with 4 (run AA); 6 x 32 KB of tiles fill the shared memory.
    `expert_offset`: the weights are one device's experts from that index on (expert parallelism); other
    pairs count zero. `matmul`: the GEMM (CPU tests pass `grouped_matmul_reference`)."""
    tokens = x.shape[0]
    defaults = default_tiles(persistent)
    tile_n, stages = tile_n or defaults["tile_n"], stages or defaults["stages"]
    down_tile_n, down_stages = down_tile_n or defaults["down_tile_n"], down_stages or defaults["down_stages"]
    matmul = matmul or (persistent_matmul if persistent else grouped_matmul)
    num_experts, intermediate = gate_up.shape[0], down.shape[2]
    local_ids, local = mg._local_pairs(ids, expert_offset, num_experts)
    pair_row, block_expert, row_pair = pair_blocks(local_ids, num_experts, block_t)
    xs = rg.gather_rows_on_backend(x, row_tokens(row_pair, ids.shape[1], tokens), block_expert, block_t=block_t)
    settings = dict(block_t=block_t, tile_n=tile_n, tile_k=tile_k, stages=stages)
    if persistent:
        act = matmul(xs, block_expert, gate_up, swiglu=True, **settings)
    else:
        gu = matmul(xs, block_expert, gate_up, **settings)
        act = mg._swiglu(gu[:, :intermediate], gu[:, intermediate:]).astype(x.dtype)
    out = matmul(act, block_expert, down, **dict(settings, tile_n=down_tile_n, stages=down_stages))
    pair_out = (out[pair_row].astype(jnp.float32) * weights.reshape(-1, 1)).astype(x.dtype)
    return mg._add_token_pairs(pair_out, local, tokens)
