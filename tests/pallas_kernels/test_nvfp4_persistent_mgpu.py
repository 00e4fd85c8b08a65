"""The persistent NVFP4 grouped GEMM: its lowering for sm_90 (CPU), its output against the grid kernel
and the layer with it against the reference (GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import nvfp4_mgpu as nm
from pallas_kernels import nvfp4_moe_mgpu as nmm
from pallas_kernels.nvfp4_persistent_mgpu import grouped_matmul_persistent
from tests.pallas_kernels.test_nvfp4_mgpu import _assert_layer_close, _layer_problem, e4m3_scales


def _operands(rng, experts, n, k, blocks, block_t, tile_k, shared_rows, unused):
    codes = rng.integers(0, 16, (experts, n, k), dtype=np.uint8)
    scale = e4m3_scales(rng, (experts, n, k // 16), signed=True)
    x = rng.standard_normal(((1 if shared_rows else blocks) * block_t, k)).astype(ml_dtypes.bfloat16)
    block_expert = rng.integers(0, experts, blocks).astype(np.int32)
    block_expert[rng.permutation(blocks)[:unused]] = -1
    return (jnp.asarray(x[:, nm.kernel_k_order(k)]), jnp.asarray(block_expert), *nm.pack_weights(codes, scale, tile_k))


@pytest.mark.parametrize("output,n,k,blocks,tile_k,splits", [
    ("sums", 5120, 320, 57, 64, 1), ("scaled", 5120, 320, 57, 64, 1), ("by_pair", 5120, 320, 57, 64, 1),
    ("sums", 640, 5120, 8, 256, 4)])
def test_lowers_for_cuda(output, n, k, blocks, tile_k, splits):
    """Beam's down GEMM at T = 8 (57 blocks, 40 row tiles each) and its gate/up GEMM at T = 1 (four K
    splits) lower to Mosaic GPU on the CPU."""
    spec = jax.ShapeDtypeStruct
    block_t = 8
    args = [spec((blocks * block_t, k), jnp.bfloat16), spec((blocks,), jnp.int32),
            spec((256, k // tile_k, n, tile_k // 2), jnp.uint8), spec((256, k // tile_k, n, tile_k // 64), jnp.uint32),
            spec((256, n), jnp.float32), spec((blocks, block_t), jnp.int32)]

    def op(xs, block_expert, packed, scales, global_scale, row_destination):
        extra = {}
        if output != "sums":
            extra["global_scale"] = global_scale
        if output == "by_pair":
            extra.update(row_destination=row_destination, out_rows=64)
        return grouped_matmul_persistent(xs, block_expert, packed, scales, block_t=block_t, tile_k=tile_k,
                                         splits=splits, **extra)

    assert "mosaic_gpu" in jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_operands_are_rejected():
    """The grid kernel's checks: K splits that do not divide K's steps, the global scales with splits."""
    operands = _operands(np.random.default_rng(0), 4, 64, 320, 2, 8, 64, False, 0)
    with pytest.raises(ValueError, match="shapes"):
        grouped_matmul_persistent(*operands, block_t=8, tile_k=64, tile_n=64, splits=2)
    with pytest.raises(ValueError, match="one split"):
        grouped_matmul_persistent(*operands, block_t=8, tile_k=64, tile_n=64, splits=5,
                                  global_scale=jnp.ones((4, 64), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("experts,n,k,blocks,block_t,tile_k,tile_n,splits,programs,stages,shared_rows,unused", [
    (16, 320, 320, 7, 8, 64, 64, 1, 3, 8, False, 2), (16, 512, 320, 5, 16, 64, 128, 1, 4, 4, False, 1),
    (8, 128, 512, 3, 8, 256, 64, 1, 1, 2, True, 0), (32, 640, 5120, 6, 8, 256, 64, 4, 5, 3, True, 1),
    (16, 384, 192, 9, 8, 64, 128, 3, None, 8, False, 3)])
def test_matches_the_grid_kernel_on_gpu(experts, n, k, blocks, block_t, tile_k, tile_n, splits, programs, stages,
                                        shared_rows, unused):
    """Sums (K splits too), the scaled projection and rows written by pair: the grid kernel's bits, for
    every used block; programs walk several tiles (num_programs 1-5, uneven shares) over unused blocks (-1)."""
    rng = np.random.default_rng(n + k + blocks)
    operands = _operands(rng, experts, n, k, blocks, block_t, tile_k, shared_rows, unused)
    settings = dict(block_t=block_t, tile_k=tile_k, tile_n=tile_n, shared_rows=shared_rows)
    persistent = functools.partial(grouped_matmul_persistent, num_programs=programs, stages=stages, **settings)
    used = np.repeat(np.asarray(operands[1]) >= 0, block_t)
    want = np.asarray(nm.grouped_matmul(*operands, splits=splits, **settings))[:, used]
    np.testing.assert_array_equal(np.asarray(persistent(*operands, splits=splits))[:, used], want)
    global_scale = jnp.asarray(rng.uniform(0.5, 2, (experts, n)).astype(np.float32))
    want = np.asarray(nm.grouped_matmul(*operands, global_scale=global_scale, **settings), np.float32)[0]
    got = np.asarray(persistent(*operands, global_scale=global_scale), np.float32)[0]
    np.testing.assert_array_equal(got[used], want[used])
    # Every block row to its own output row, in reverse; rows of unused blocks and every third row dropped.
    rows = blocks * block_t
    destination = np.where(used & (np.arange(rows) % 3 > 0), rows - 1 - np.arange(rows), -1).astype(np.int32)
    by_pair = np.asarray(persistent(*operands, global_scale=global_scale, row_destination=jnp.asarray(
        destination.reshape(blocks, block_t)), out_rows=rows), np.float32)[0]
    written = destination >= 0
    np.testing.assert_array_equal(by_pair[destination[written]], want[written])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,down_tile_n", [(1, 64), (8, 128), (13, 64), (64, 128)])
def test_layer_with_the_persistent_down_gemm_matches_reference_on_gpu(tokens, down_tile_n):
    """Beam's per-GPU TP8 expert shape, the down GEMM on the persistent kernel (the layer's defaults else)."""
    problem, (gate_up, down) = _layer_problem(tokens, tokens, 5120, 320, 256, 8, tile_k=256)
    layer = functools.partial(nmm.moe_nvfp4, down_tile_n=down_tile_n, down_matmul=grouped_matmul_persistent)
    _assert_layer_close(problem, jax.jit(layer)(*problem[:3], gate_up, down))
