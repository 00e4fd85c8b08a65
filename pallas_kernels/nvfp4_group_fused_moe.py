"""Beam's NVFP4 MoE layer for a few decode tokens in one Mosaic GPU launch, its down GEMM split by the gate/up GEMM's
row groups (Hopper only).

Why. `nvfp4_fused_moe` splits the down GEMM by output rows: a down tile needs every intermediate column of its pair,
so it waits for all of the pair's gate/up programs, and at one token its 720 programs do not fit on the GPU at once
(most down programs start only as gate/up programs leave, ~11 us into the layer: benchmarks/moe/RESULTS.md, session
34 run 5). Here a program owns a group of 64 intermediate columns (its 64 gate rows and their 64 up rows) and a
K split of them, and then the down GEMM's K step of those 64 columns for a share of the output rows:
- gate/up: the group's 128 rows over its split of K, every step's copy issued at once, fp32 partial sums to
  global memory, counted on the group's counter;
- down: its weights' copy issued, then a wait for the group's other splits only (`splits` programs, next to it in
  the grid), SwiGLU of the group's 64 columns from their partial sums, the down GEMM's one K step for `H / splits`
  output rows, and the pair's token row, times the global scales and the routing weight, added into the fp32
  output by a TMA reduction.
At one token that is 8 pairs x 5 groups x 5 splits = 200 programs, all resident (two an SM), so every weight copy
is in flight from the start and no program waits for another to leave. The counters are `nvfp4_fused_moe`'s (EPOCH
counters, passed from call to call or zeroed per call); this kernel's slots: `counter_slots(pairs)`.
Rounding: a group's part of a pair's output is weighted in fp32, unrounded (the reference rounds the pair's whole
output to bf16, then weighted; a part cannot be rounded so), and the parts are added in fp32 in the order their
programs finish; the caller rounds once.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import nvfp4_fused_moe as nfm
from pallas_kernels import nvfp4_mgpu as nm

GROUP = 64  # intermediate columns a group: the down GEMM's K step (its activation tile is one 128-byte row)
_BOX = 256  # TMA's largest box side


def counter_slots(pairs: int, intermediate: int) -> int:
    """Slots of the counters for `pairs` pairs: the zeroing's two and two a group."""
    return nfm.counter_slots(pairs * intermediate // GROUP)


def fits(hidden: int, intermediate: int, down_tile_k: int, tokens: int, splits: int) -> bool:
    """Whether `fused_group_moe` takes these shapes with `splits` K splits."""
    down_rows = hidden // splits if hidden % splits == 0 else 0
    return (down_tile_k == GROUP and intermediate % GROUP == 0 and tokens <= 8 and down_rows % 64 == 0
            and 0 < down_rows * GROUP // 2 // nm._LINE <= _BOX)


def fused_group_moe(x, pair_expert, pair_weight, gate_up_packed, gate_up_scales, gate_up_global_scale,
                    down_packed, down_scales, down_global_scale, *, gate_up_tile_k: int, down_tile_k: int,
                    splits: int = 5, gate_up_decode_chunks: int = 2, counters=None, compiler_params=None):
    """`nvfp4_fused_moe.fused_decode_moe`'s contract (pairs as they come, shared rows, the same weight layouts and
    counters: int32 `[slots]`, at least `counter_slots(pairs, I)` to be used, else the call zeroes its own), with
    programs of a 64-column intermediate group and a K split (`splits`; each then takes `H / splits` output rows
    of the down GEMM). `gate_up_decode_chunks`: K chunks of a gate/up step's decode."""
    tokens, hidden = x.shape
    experts, gu_steps, gu_rows, _ = gate_up_packed.shape
    intermediate = gu_rows // 2
    blocks = pair_expert.shape[0]
    block_t = 8  # wgmma's narrowest N
    if (pair_weight.shape != (blocks,) or blocks % tokens or gu_steps * gate_up_tile_k != hidden
            or down_packed.shape != (experts, intermediate // down_tile_k, hidden, down_tile_k // 2)
            or gu_steps % splits or not fits(hidden, intermediate, down_tile_k, tokens, splits)
            or gate_up_tile_k % (nm.TILE_K_QUANTUM * gate_up_decode_chunks) or gate_up_tile_k < nm.SWIGLU_MIN_TILE_K):
        raise ValueError(f"shapes: x {x.shape}, pairs {pair_expert.shape} / {pair_weight.shape}, gate/up "
                         f"{gate_up_packed.shape} (tile_k {gate_up_tile_k}), down {down_packed.shape} "
                         f"(tile_k {down_tile_k}), splits {splits}, decode chunks {gate_up_decode_chunks}")
    top_k = blocks // tokens
    per_pair = intermediate // GROUP
    groups = blocks * per_pair
    programs = groups * splits
    gu_k_steps, down_rows = gu_steps // splits, hidden // splits
    slots = counter_slots(blocks, intermediate)
    if counters is not None and (counters.dtype != jnp.int32 or counters.ndim != 1):
        raise ValueError(f"counters must be int32 [slots] (`fresh_counters()` or a call's), got "
                         f"{counters.dtype}{list(counters.shape)}")
    own = counters is None or counters.shape[0] < slots
    gu_in_specs, gu_stage, gu_decodes, gu_store = nm._tile_programs(
        2 * GROUP, gate_up_tile_k, block_t, False, False, gate_up_decode_chunks, paired_steps=gu_steps)
    down_in_specs, down_stage, down_decodes, _ = nm._tile_programs(
        down_rows, down_tile_k, block_t, True, True, 1, row_chunks=down_rows // 64)
    gu_packed, gu_scales = nm._paired_views(gate_up_packed, nm._fold_scales(gate_up_scales, gate_up_tile_k))
    down_scales = nm._fold_scales(down_scales, down_tile_k)
    down_packed = down_packed.reshape(*down_packed.shape[:2], -1, nm._LINE)  # a K step's rows as 128-byte lines
    x_transforms = down_in_specs(0, 0, 0, 0)[-1].transforms
    fill = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(transforms=x_transforms),
                                        *[plgpu.Layout.WG_SPLAT(())] * 4))(
        nfm._swiglu_activations(splits, block_t, GROUP))
    weighted_store = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(),
                                                  *[plgpu.Layout.WG_SPLAT(())] * tokens))(
        nfm._store_weighted_transposed(down_rows, block_t, tokens, rounded=False))
    chunks = [pl.ds(c * _BOX, min(_BOX, down_rows - c * _BOX)) for c in range(-(-down_rows // _BOX))]

    def step_body(stage, decodes, tile_n, tile_k, line_box, row_chunks, staged_smem, paired):
        def body(acc_ref, indices, w_smem, s_smem, x_smem):
            del indices
            if paired:  # [2, tile_n / 2, ...] boxes: the rows of one tile
                w_smem, s_smem = w_smem.reshape(tile_n, tile_k // 2), s_smem.reshape(-1, nm._SCALE_ROW)
            weights = w_smem if line_box else plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_8BIT)
            stage(s_smem, staged_smem)
            nm.multiply_step(acc_ref, decodes, weights, staged_smem, x_smem, tile_n=tile_n, tile_k=tile_k,
                             row_chunks=row_chunks)
        return body

    def kernel(pair_expert_gmem, pair_weight_gmem, x_gmem, gu_packed_gmem, gu_scales_gmem, gu_global_gmem,
               down_packed_gmem, down_scales_gmem, down_global_gmem, counters_gmem, out_gmem, sums_gmem):
        p = jax.lax.axis_index("p")
        q, s = p // splits, p % splits  # group q (pair b, its columns g) and split s
        b, g = q // per_pair, q % per_pair
        expert = pair_expert_gmem[b]

        @pl.when((expert >= 0) & (expert < experts))  # (a skipped pair's rows are not written: the caller drops them)
        def _():
            token = b // top_k

            def gate_up(out_smem, staged_smem):
                body = step_body(gu_stage, gu_decodes, 2 * GROUP, gate_up_tile_k, False, 1, staged_smem, True)

                def k_loop(acc_ref):  # every K step's copy at once
                    plgpu.emit_pipeline(functools.partial(body, acc_ref), grid=(gu_k_steps,),
                                        in_specs=gu_in_specs(expert, s * gu_k_steps, g, 0),
                                        max_concurrent_steps=gu_k_steps)(gu_packed_gmem, gu_scales_gmem, x_gmem)
                    return acc_ref[...]

                with jax.named_scope("gate_up_k_loop"):
                    acc = pl.run_scoped(k_loop, plgpu.ACC((2 * GROUP, block_t)))
                with jax.named_scope("gate_up_write"):
                    nm._write_tile(gu_store, acc, out_smem, sums_gmem, q, 0, s, block_t=block_t, tile_n=2 * GROUP)
                    plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(gate_up, plgpu.SMEM((block_t, 2 * GROUP), jnp.float32),
                          plgpu.SMEM((2 * GROUP * gate_up_tile_k // 16,), jnp.uint32))
            nfm._async_proxy_fence()
            nfm._add(counters_gmem, nfm._READY + 2 * q, nfm._share(s, splits), release=True)

            weight = pair_weight_gmem[b]  # its token's row gets it, the other rows none
            token_weights = [jnp.where(token == t, weight, 0.0) for t in range(tokens)]
            gate_scale, up_scale = gu_global_gmem[expert, 0], gu_global_gmem[expert, intermediate]

            def down(out_smem, staged_smem, scale_smem, scale_barrier):
                for c in chunks:
                    plgpu.copy_gmem_to_smem(down_global_gmem.at[expert, pl.ds(s * down_rows + c.start, c.size)],
                                            scale_smem.at[c], scale_barrier)

                def fill_activations(x_buf):
                    with jax.named_scope("down_wait"):
                        nfm._wait_epoch(counters_gmem, nfm._READY + 2 * q)
                        nfm._add(counters_gmem, nfm._READY + 2 * q + 1, nfm._share(s, splits), release=False)
                        nfm._async_proxy_fence()
                    with jax.named_scope("down_swiglu"):
                        fill(sums_gmem, x_buf, q * block_t, token, gate_scale, up_scale)
                        plgpu.commit_smem()

                body = step_body(down_stage, down_decodes, down_rows, down_tile_k, True, down_rows // 64,
                                 staged_smem, False)

                def k_loop(acc_ref):  # the weights' copy goes out before the wait
                    nm._prefetched_k_loop(functools.partial(body, acc_ref), down_in_specs(expert, g, s, 0),
                                          (down_packed_gmem, down_scales_gmem, x_gmem), k_steps=1, stages=1,
                                          fill_activations=fill_activations)
                    return acc_ref[...]

                with jax.named_scope("down_k_loop"):
                    acc = pl.run_scoped(k_loop, plgpu.ACC((down_rows, block_t)))
                with jax.named_scope("down_write"):
                    plgpu.barrier_wait(scale_barrier)
                    weighted_store(acc, out_smem, scale_smem, *token_weights)
                    plgpu.commit_smem()
                    for c in chunks:  # the token's row: the group's part of the pair's output
                        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(token, 1), c],
                                                out_gmem.at[pl.ds(q, 1), pl.ds(s * down_rows + c.start, c.size)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(down, plgpu.SMEM((block_t, down_rows), jnp.float32),
                          plgpu.SMEM((down_rows * down_tile_k // 16,), jnp.uint32),
                          plgpu.SMEM((down_rows,), jnp.float32), plgpu.Barrier(num_arrivals=len(chunks)))

    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((groups, hidden), jnp.float32),
                  jax.ShapeDtypeStruct((splits, groups * block_t, 2 * GROUP), jnp.float32)),
        grid=(programs,),
        grid_names=("p",),
        compiler_params=compiler_params,
    )
    counters_ref = jax.new_ref(nfm.fresh_counters(slots) if own else counters)
    parts, _ = call(pair_expert.astype(jnp.int32), pair_weight.astype(jnp.float32), x, gu_packed, gu_scales,
                    gate_up_global_scale, down_packed, down_scales, down_global_scale, counters_ref)
    # A token's output: the parts of its pairs' groups (XLA, with the caller's conversion); skipped pairs' parts
    # were not written.
    computed = (pair_expert >= 0) & (pair_expert < experts)
    parts = jnp.where(jnp.repeat(computed, per_pair)[:, None], parts, 0.0)
    out = jnp.pad(parts.reshape(tokens, top_k * per_pair, hidden).sum(1), ((0, block_t - tokens), (0, 0)))
    if counters is None:
        return out
    return out, counters if own else jax.freeze(counters_ref)
