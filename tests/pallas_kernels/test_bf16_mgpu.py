"""The bf16 Mosaic GPU grouped GEMM and MoE layer (`pallas_kernels/bf16_moe_mgpu.py`): lowering and
the layer's glue on the CPU (the GEMM replaced by its plain-jnp reference), the kernel on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bf16_moe_mgpu as bm
from pallas_kernels import moe_gemm as mg
from tests.pallas_kernels.test_moe_gemm import random_problem, share_of_experts


def _fused(problem):
    """(x, weights, ids, gate_up [E, 2I, H], down [E, H, I]) from `random_problem`'s bf16 projections."""
    x, weights, ids, gate, up, down = problem
    return x, weights, ids, jnp.concatenate([gate.values, up.values], axis=1), down.values


def _assert_close(got, want):
    """Kernel and reference round at the same points; they differ by summation order only."""
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=4 * 2.0**-7 * np.abs(want).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("n,k,blocks,block_t,tile_n,tile_k,stages", [
    (640, 5120, 6, 128, 128, 64, 4), (5120, 320, 6, 128, 128, 64, 4), (640, 5120, 3, 64, 64, 128, 2),
    (5120, 320, 4, 64, 256, 64, 4)])
def test_lowers_for_cuda(n, k, blocks, block_t, tile_n, tile_k, stages):
    """Beam's gate/up and down shapes lower to Mosaic GPU on the CPU (the PTX is built on the GPU)."""
    spec = jax.ShapeDtypeStruct
    op = functools.partial(bm.grouped_matmul, block_t=block_t, tile_n=tile_n, tile_k=tile_k, stages=stages)
    specs = (spec((blocks * block_t, k), jnp.bfloat16), spec((blocks,), jnp.int32), spec((16, n, k), jnp.bfloat16))
    assert "mosaic_gpu" in jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n,k,swiglu,tile_n,stages", [(640, 5120, True, 160, 3), (640, 5120, True, 64, 6),
                                                     (5120, 320, False, 256, 3), (5120, 320, False, 128, 4)])
def test_persistent_lowers_for_cuda(n, k, swiglu, tile_n, stages):
    """The persistent GEMM at Beam's gate/up (SwiGLU fused) and down shapes, within the shared memory."""
    spec = jax.ShapeDtypeStruct
    op = functools.partial(bm.persistent_matmul, tile_n=tile_n, stages=stages, swiglu=swiglu)
    specs = (spec((5 * 128, k), jnp.bfloat16), spec((5,), jnp.int32), spec((16, n, k), jnp.bfloat16))
    assert "mosaic_gpu" in jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _random_blocks(experts, n, k, blocks, block_t, seed):
    """Fresh operands; block `blocks // 2` is skipped (expert -1). Returns them and the used rows."""
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.standard_normal((blocks * block_t, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, n, k)) * 0.05, jnp.bfloat16)
    block_expert = rng.integers(0, experts, blocks)
    block_expert[blocks // 2] = -1
    return xs, jnp.asarray(block_expert, jnp.int32), w, np.repeat(block_expert >= 0, block_t)


def _assert_rows_close(got, want, used):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got[used], want[used], rtol=0, atol=2 * 2.0**-7 * np.abs(want).max())
    assert np.abs(want[used]).max() > 0


# (experts, n, k, blocks, tile_n, stages, swiglu, programs): K of 1-5 steps (stages above the step count
# are clipped), several N tiles, fewer programs than tiles (each walks several) and more (some idle).
PERSISTENT_CASES = [(4, 128, 128, 3, 32, 2, False, 2), (4, 192, 320, 5, 32, 3, True, 3),
                    (3, 64, 64, 2, 64, 4, False, 5), (5, 256, 192, 4, 64, 2, True, 1)]


@pytest.mark.parametrize("experts,n,k,blocks,tile_n,stages,swiglu,programs", PERSISTENT_CASES)
def test_persistent_matches_reference_interpret(experts, n, k, blocks, tile_n, stages, swiglu, programs):
    """The persistent kernel in Mosaic GPU's interpret mode (a simulated GPU: TMA, barriers, warpgroups)."""
    xs, block_expert, w, used = _random_blocks(experts, n, k, blocks, 128, seed=n + k + blocks)
    settings = dict(block_t=128, tile_n=tile_n, stages=stages, swiglu=swiglu)
    got = bm.persistent_matmul(xs, block_expert, w, num_programs=programs, interpret=True, **settings)
    _assert_rows_close(got, bm.grouped_matmul_reference(xs, block_expert, w, **settings), used)


@pytest.mark.parametrize("block_t,tile_n,stages", [(64, 32, 2), (128, 64, 3)])
def test_grid_kernel_matches_reference_interpret(block_t, tile_n, stages):
    xs, block_expert, w, used = _random_blocks(4, 128, 192, 3, block_t, seed=block_t + tile_n)
    settings = dict(block_t=block_t, tile_n=tile_n, stages=stages)
    got = bm.grouped_matmul(xs, block_expert, w, interpret=True, **settings)
    _assert_rows_close(got, bm.grouped_matmul_reference(xs, block_expert, w, **settings), used)


@pytest.mark.parametrize("persistent", [False, True])
def test_layer_on_interpreted_kernels_matches_reference(persistent):
    """The whole layer, blocks to combine, with the kernels interpreted: 70 tokens over 12 experts."""
    problem = random_problem(70, 70, 128, 64, 12, 4, "bf16")
    kernel = bm.persistent_matmul if persistent else bm.grouped_matmul
    layer = functools.partial(bm.moe_bf16, persistent=persistent, tile_n=32, stages=2, down_tile_n=64,
                              down_stages=2, matmul=functools.partial(kernel, interpret=True))
    _assert_close(layer(*_fused(problem)), mg.moe_gemm_reference(*problem))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="shapes"):
        bm.grouped_matmul(jnp.zeros((96, 64), jnp.bfloat16), jnp.zeros((1,), jnp.int32),
                          jnp.zeros((2, 64, 64), jnp.bfloat16), block_t=96)
    with pytest.raises(ValueError, match="block_t 64"):  # two warpgroups of 64 rows
        bm.persistent_matmul(jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((1,), jnp.int32),
                             jnp.zeros((2, 64, 64), jnp.bfloat16), block_t=64, tile_n=64)
    with pytest.raises(ValueError, match="tile_n 128"):  # SwiGLU's output has 96 columns
        bm.persistent_matmul(jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((1,), jnp.int32),
                             jnp.zeros((2, 192, 64), jnp.bfloat16), tile_n=128, swiglu=True)


@pytest.mark.parametrize("tokens,block_t,down_tile_n,persistent", [
    (1, 64, None, False), (37, 64, 128, False), (300, 128, None, False), (37, 128, 128, True), (300, 128, 64, True)])
def test_layer_glue_matches_reference(tokens, block_t, down_tile_n, persistent):
    """Blocks, gathers, SwiGLU (XLA's, or the fused GEMM's contract) and combine with the GEMM's plain-jnp
    reference: experts with more pairs than a block, unused experts, one token."""
    problem = random_problem(tokens, tokens, 128, 64, 12, 4, "bf16")
    layer = functools.partial(bm.moe_bf16, block_t=block_t, tile_n=64, down_tile_n=down_tile_n,
                              persistent=persistent, matmul=bm.grouped_matmul_reference)
    _assert_close(jax.jit(layer)(*_fused(problem)), jax.jit(mg.moe_gemm_reference)(*problem))


def test_expert_parallel_shares_add_up():
    problem = random_problem(5, 70, 128, 64, 12, 4, "bf16")
    x, weights, ids, gate, up, down = problem
    total = 0.0
    for start in (0, 6):
        share = [share_of_experts(w, start, start + 6) for w in (gate, up, down)]
        got = bm.moe_bf16(*_fused((x, weights, ids, *share)), block_t=64, tile_n=64, expert_offset=start,
                          matmul=bm.grouped_matmul_reference)
        _assert_close(got, mg.moe_gemm_reference(x, weights, ids, *share, expert_offset=start))
        total = total + np.asarray(got, np.float32)
    whole = np.asarray(mg.moe_gemm_reference(*problem), np.float32)
    np.testing.assert_allclose(total, whole, rtol=0, atol=2 * 4 * 2.0**-7 * np.abs(whole).max())


@pytest.mark.gpu
@pytest.mark.parametrize("experts,n,k,blocks,block_t,tile_n,tile_k,stages",
                         [(16, 640, 5120, 5, 128, 128, 64, 4), (16, 5120, 320, 3, 128, 128, 64, 4),
                          (8, 192, 448, 4, 64, 64, 64, 2)])
def test_kernel_matches_reference_on_gpu(experts, n, k, blocks, block_t, tile_n, tile_k, stages):
    """Fresh random operands, a skipped block (expert -1) among them."""
    rng = np.random.default_rng(n + k)
    xs = jnp.asarray(rng.standard_normal((blocks * block_t, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, n, k)) * 0.05, jnp.bfloat16)
    block_expert = jnp.asarray(np.r_[rng.integers(0, experts, blocks - 1), -1], jnp.int32)
    settings = dict(block_t=block_t, tile_n=tile_n, tile_k=tile_k, stages=stages)
    got = np.asarray(bm.grouped_matmul(xs, block_expert, w, **settings), np.float32)[:-block_t]
    want = np.asarray(bm.grouped_matmul_reference(xs, block_expert, w, **settings), np.float32)[:-block_t]
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * 2.0**-7 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("experts,n,k,blocks,tile_n,stages,swiglu,programs", [
    (16, 640, 5120, 7, 160, 3, True, None), (16, 640, 5120, 5, 64, 6, True, 2), (16, 5120, 320, 6, 256, 3, False, 3),
    (8, 192, 448, 3, 32, 2, False, None), (8, 384, 192, 4, 64, 4, True, 1)])
def test_persistent_matches_reference_on_gpu(experts, n, k, blocks, tile_n, stages, swiglu, programs):
    """Fresh random operands, a skipped block (expert -1) in the middle, more tiles than programs
    (`programs`: a few programs walk many tiles each; None: one per SM)."""
    xs, block_expert, w, used = _random_blocks(experts, n, k, blocks, 128, seed=n + k + blocks)
    settings = dict(block_t=128, tile_n=tile_n, stages=stages, swiglu=swiglu)
    got = bm.persistent_matmul(xs, block_expert, w, num_programs=programs, **settings)
    assert got.shape == (blocks * 128, n // 2 if swiglu else n)
    _assert_rows_close(got, bm.grouped_matmul_reference(xs, block_expert, w, **settings), used)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,persistent", [(5, False), (300, False), (2048, False), (300, True), (2048, True)])
def test_layer_matches_reference_on_gpu(tokens, persistent):
    """Beam's per-GPU TP8 expert shape. `moe_gemm_reference` gathers each pair's weights (too much
    memory past a few hundred tokens); the model's ragged_dot reference, which rounds each addition
    of a token's pairs, stands in there."""
    from beam_jax.layers.moe import experts_reference

    problem = random_problem(tokens, tokens, 5120, 320, 256, 8, "bf16")
    reference = mg.moe_gemm_reference(*problem) if tokens <= 300 else experts_reference(*_fused(problem))
    _assert_close(jax.jit(functools.partial(bm.moe_bf16, persistent=persistent))(*_fused(problem)), reference)
