"""A persistent variant of the NVFP4 grouped GEMM (`nvfp4_mgpu.grouped_matmul`, same contract).

Why. The down GEMM's K is the expert intermediate (320 per GPU under TP8): a program of the grid kernel
runs 5 K steps of 2-4 KB and ends, so every program pays a pipeline fill and its own launch, and the
down GEMM reaches 55-62 % of its floor at T = 8-64 where gate/up (20 steps a program) reaches 77-90 %
(benchmarks/moe/RESULTS.md, sessions 15-16). Longer programs that walk several experts in one
accumulator were slower (run B of session 15): each still had only `stages` loads in flight.

How. `programs_per_sm` programs per SM each walk the tiles `p, p + P, p + 2P, ...` (tile t is block
t // (S N/tile_n), then K split, then rows, for S splits) as ONE pipeline over all their (tile, K step)
pairs, so loads for the next tile are in flight while this one finishes, and no pipeline drains between
tiles. The
accumulator is written out and zeroed after each tile's last K step; the output copy of one tile
overlaps the next tile's steps. Tiles of unused blocks (expert -1) load expert 0's tile (from L2 after
the first time) and compute nothing.

Status: lowers for sm_90 on the CPU (tests/pallas_kernels/test_nvfp4_persistent_mgpu.py); not yet run
on a GPU: its GPU test and timings are the next GPU session's (RESULTS.md, session 16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import nvfp4_mgpu as nm
from pallas_kernels.mgpu_tiles import num_sms


def _copy_words(count: int):
    """inline_mgpu body: `count` 32-bit words from one ref to another, spread over the warpgroup, then a
    warpgroup barrier (TMA needs 16-byte multiples; the block list is any length)."""
    from jax._src.lib.mlir.dialects import memref
    from jax.experimental.mosaic.gpu import utils

    def body(ctx, source, target):
        del ctx
        nm.for_each_index(count, lambda i: memref.store(memref.load(source, [i]), target, [i]))
        utils.warpgroup_barrier()

    return body


def grouped_matmul_persistent(xs, block_expert, packed, scales, *, block_t: int, tile_k: int = 64, stages: int = 8,
                              tile_n: int = 128, splits: int = 1, programs_per_sm: int = 4,
                              num_programs: int | None = None, shared_rows: bool = False, global_scale=None,
                              row_destination=None, out_rows: int | None = None):
    """`nm.grouped_matmul`'s contract on `programs_per_sm` persistent programs per SM (or `num_programs`
    in all), each with a pipeline of `stages` (tile, K step) loads."""
    scaled, scattered = nm._check_operands(xs, block_expert, packed, scales, block_t=block_t, tile_k=tile_k,
                                           splits=splits, tile_n=tile_n, shared_rows=shared_rows,
                                           global_scale=global_scale, row_destination=row_destination,
                                           out_rows=out_rows)
    k, n, blocks = xs.shape[1], packed.shape[2], block_expert.shape[0]
    k_steps, n_tiles = k // (tile_k * splits), n // tile_n
    tiles = blocks * splits * n_tiles
    programs = min(tiles, num_programs or programs_per_sm * num_sms())
    in_specs, decode, store_transposed = nm._tile_programs(tile_n, tile_k, block_t, scaled)
    out_dtype = xs.dtype if scaled else jnp.float32
    optional = [a for a in (global_scale, row_destination) if a is not None]
    copy_blocks = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(_copy_words(blocks))

    def kernel(block_expert_gmem, xs_gmem, packed_gmem, scales_gmem, *gmem, out_smem, staged_smem, block_smem,
               scale_smem=None, scale_barrier=None):
        *optional_gmem, out_gmem = gmem
        global_scale_gmem, row_destination_gmem = (*optional_gmem, None, None)[:2]
        p = jax.lax.axis_index("p")
        # The block list is read at every step (the pipeline's fetches and the body): from shared memory.
        copy_blocks(block_expert_gmem, block_smem)
        my_tiles = (tiles - 1 - p) // programs + 1

        def place(step):
            """A flat step -> (expert, step of the tile, K step, row tile, split, block): this program's
            tile step // k_steps."""
            tile = p + (step // k_steps) * programs
            b, si, ni = tile // (splits * n_tiles), tile // n_tiles % splits, tile % n_tiles
            kk = step % k_steps
            return block_smem[b], kk, si * k_steps + kk, ni, si, b

        def fetch_place(step):  # unused blocks load expert 0's tile; `0` rows: every block shares one
            expert, _, k_step, ni, _, b = place(step)
            return jnp.maximum(expert, 0), k_step, ni, 0 if shared_rows else b

        def acc_scope(acc_ref):
            def step(indices, w_smem, s_smem, x_smem):
                expert, kk, _, ni, si, b = place(indices[0])

                @pl.when(expert >= 0)
                def _():
                    if scaled:  # the tile's global scales arrive while its K steps run

                        @pl.when(kk == 0)
                        def _():
                            plgpu.copy_gmem_to_smem(global_scale_gmem.at[expert, pl.ds(ni * tile_n, tile_n)],
                                                    scale_smem, scale_barrier)

                    weights = decode(plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_8BIT), s_smem, staged_smem)
                    plgpu.wgmma(acc_ref, weights, x_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)

                    @pl.when(kk == k_steps - 1)
                    def _():
                        acc = acc_ref[...]
                        acc_ref[...] = jnp.zeros_like(acc)
                        if scaled:
                            plgpu.barrier_wait(scale_barrier)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's copy has read out_smem
                        nm._write_tile(store_transposed, acc, out_smem, out_gmem, b, ni, si, block_t=block_t,
                                       tile_n=tile_n, scale_smem=scale_smem, row_destination_gmem=row_destination_gmem)

            plgpu.emit_pipeline(step, grid=(my_tiles * k_steps,), in_specs=in_specs(fetch_place),
                                max_concurrent_steps=stages)(packed_gmem, scales_gmem, xs_gmem)

        pl.run_scoped(acc_scope, plgpu.ACC((tile_n, block_t)))
        plgpu.wait_smem_to_gmem(0)

    scratch = nm._scratch(tile_n, tile_k, block_t, out_dtype, scaled)
    scratch.update(block_smem=plgpu.SMEM((blocks,), jnp.int32))
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, out_rows if scattered else blocks * block_t, n), out_dtype),
        grid=(programs,),
        grid_names=("p",),
        scratch_types=scratch,
    )
    return call(block_expert, xs, packed, nm._fold_scales(scales, tile_k), *optional)
