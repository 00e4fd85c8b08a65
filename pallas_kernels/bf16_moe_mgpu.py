"""Beam's bf16 MoE layer for prefill on a Pallas Mosaic GPU grouped GEMM (Hopper: TMA + wgmma).

The Triton kernels of `moe_gemm` reach 37 % of the H200's measured bf16 rate at T = 8192
(benchmarks/moe/RESULTS.md, run F): no TMA, no wgmma pipelining. Here a program computes a
`[block_t, tile_n]` tile of one block (rows of one expert, `nvfp4_moe_mgpu.pair_blocks`): its rows
are the wgmma's M, the weight rows its N, both operands stream through shared memory by TMA in a
`stages`-deep pipeline. The output is `[rows, N]` bf16, rounded as `moe_gemm_reference` rounds.

H200 (benchmarks/moe/RESULTS.md, runs X, AA and AB): 2190 us at T = 8192 against the Triton layer's
2538 and 1437 against 1497 at T = 4096 (run AB), but 1141 against 978 at T = 2048 (run X; blocks of
128 rows pad the few pairs each expert gets). The model calls it from PREFILL_MIN_TOKENS tokens on,
where the tiles fit (`fits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import moe_gemm as mg
from pallas_kernels import row_gather as rg
from pallas_kernels.nvfp4_moe_mgpu import pair_blocks, row_tokens


PREFILL_MIN_TOKENS = 4096  # run AB: 1437 against Triton's 1497 us at T = 4096 (run Y, 4 stages: a tie)


def fits(hidden: int, intermediate: int, *, tile_n: int = 128, tile_k: int = 64) -> bool:
    """Whether `moe_bf16`'s tiles divide experts of this size (both GEMMs)."""
    return not (2 * intermediate % tile_n or hidden % tile_n or hidden % tile_k or intermediate % tile_k)


def _smem_transforms(cols: int, dtype) -> tuple:
    """TMA/wgmma tiling and swizzle of a shared-memory tile whose rows hold `cols` values."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def grouped_matmul(xs, block_expert, w, *, block_t: int = 128, tile_n: int = 128, tile_k: int = 64,
                   stages: int = 4):
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
    operand = _smem_transforms(tile_k, xs.dtype)

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
                                               transforms=_smem_transforms(tile_n, xs.dtype))),
    )
    return call(block_expert, xs, w)


def grouped_matmul_reference(xs, block_expert, w, *, block_t: int, **_):
    """Plain jnp with the kernel's contract (blocks of expert -1 give zeros here)."""
    x = xs.reshape(block_expert.shape[0], block_t, -1)
    out = jnp.einsum("btk,bnk->btn", x, w[jnp.maximum(block_expert, 0)], preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST)
    out = jnp.where((block_expert >= 0)[:, None, None], out, 0)
    return out.reshape(-1, w.shape[1]).astype(xs.dtype)


def moe_bf16(x, weights, ids, gate_up, down, *, block_t: int = 128, tile_n: int = 128, tile_k: int = 64,
             stages: int = 6, down_tile_n: int | None = None, down_stages: int = 2,
             expert_offset: int | jax.Array | None = None, matmul=grouped_matmul):
    """Routed experts for bf16 weights: `x [T, H]`, `weights`/`ids [T, top_k]`, `gate_up [E, 2I, H]`
    (gate rows then up rows), `down [E, H, I]`. Pairs are sorted into blocks of `block_t` rows of one
    expert; `row_gather` copies their activations, and XLA applies SwiGLU between the GEMMs and adds
    each token's weighted pairs. `down_tile_n`, `down_stages`: the down GEMM's weight rows per program
    (default `tile_n`) and pipeline stages: its K is five steps, and 2 stages, which fit two programs on
    an SM, took 693 against 830 us with 4 at T = 8192 (run X). `stages` (gate/up): 6 took 2204 us for
    the layer at T = 8192 against 2284 with 4 (run AA); 6 x 32 KB of tiles fill the shared memory.
    `expert_offset`: the weights are one device's experts from that index on (expert parallelism); other
    pairs count zero. `matmul`: the kernel (CPU tests pass the reference)."""
    tokens = x.shape[0]
    num_experts, intermediate = gate_up.shape[0], down.shape[2]
    local_ids, local = mg._local_pairs(ids, expert_offset, num_experts)
    pair_row, block_expert, row_pair = pair_blocks(local_ids, num_experts, block_t)
    xs = rg.gather_rows_on_backend(x, row_tokens(row_pair, ids.shape[1], tokens), block_expert, block_t=block_t)
    settings = dict(block_t=block_t, tile_n=tile_n, tile_k=tile_k, stages=stages)
    gu = matmul(xs, block_expert, gate_up, **settings)
    act = mg._swiglu(gu[:, :intermediate], gu[:, intermediate:]).astype(x.dtype)
    down_settings = dict(settings, tile_n=down_tile_n or tile_n, stages=down_stages)
    out = matmul(act, block_expert, down, **down_settings)
    pair_out = (out[pair_row].astype(jnp.float32) * weights.reshape(-1, 1)).astype(x.dtype)
    return mg._add_token_pairs(pair_out, local, tokens)
