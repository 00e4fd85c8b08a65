"""The grouped expert GEMM kernels (interpret mode on CPU, compiled on a GPU) against the plain-jnp
reference, for every weight format, on fresh seeded random inputs: packed NVFP4 bytes cover every
code (negative zero included), scales are random, ids leave experts empty."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_gemm as mg

ON_GPU = jax.default_backend() == "gpu"
FORMATS = ["bf16", "fp8_channel", "fp8_tensor", "nvfp4"]


def random_weights(rng, fmt, experts, rows, cols, dtype=jnp.bfloat16):
    if fmt == "bf16":
        return mg.ExpertWeights(jnp.asarray(rng.standard_normal((experts, rows, cols)) * 0.1, dtype))
    if fmt.startswith("fp8"):
        values = jnp.asarray(np.clip(rng.standard_normal((experts, rows, cols)) * 100, -448, 448), jnp.float8_e4m3fn)
        shape = (experts, rows) if fmt == "fp8_channel" else (experts,)
        return mg.ExpertWeights(values, jnp.asarray(rng.uniform(5e-4, 2e-3, shape), jnp.float32), format=fmt)
    packed = jnp.asarray(rng.integers(0, 256, (experts, rows, cols // 2)), jnp.uint8)
    block = jnp.asarray(rng.uniform(0.25, 4, (experts, rows, cols // 16)), jnp.float8_e4m3fn)
    return mg.ExpertWeights(packed, block, jnp.asarray(rng.uniform(0.005, 0.02, experts), jnp.float32), format="nvfp4")


def random_problem(seed, tokens, hidden, intermediate, experts, top_k, fmt, dtype=jnp.bfloat16, used_experts=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    pool = experts if used_experts is None else used_experts  # experts >= pool are never routed to
    ids = jnp.asarray(np.stack([rng.choice(pool, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
    gate, up, down = (random_weights(rng, fmt, experts, n, k, dtype)
                      for n, k in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)))
    return x, weights, ids, gate, up, down


def assert_close_to_reference(problem, blocks=None, ulps=4):
    want = np.asarray(jax.jit(mg.moe_gemm_reference)(*problem), np.float32)
    kernel = functools.partial(mg.moe_gemm_kernel, blocks=blocks, interpret=not ON_GPU)
    got = np.asarray(jax.jit(kernel)(*problem), np.float32)
    # Kernel and reference round at the same points; they differ by summation order only.
    dtype = problem[0].dtype
    eps = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-20
    np.testing.assert_allclose(got, want, rtol=0, atol=ulps * eps * np.abs(want).max())
    assert np.abs(want).max() > 0


# (tokens, hidden, intermediate, experts, top_k, blocks): block sizes that leave K and N tails,
# expert counts that are not powers of two, one token, several blocks per expert, split K.
CASES = {
    "one_token_ids": (1, 64, 32, 16, 4, None),
    "tails_ids": (5, 96, 48, 12, 3, mg.MoEBlocks("ids", 16, 32, 64, 1, 32, 64)),
    "split_k_ids": (3, 256, 32, 8, 2, mg.MoEBlocks("ids", 16, 16, 32, 4, 32, 32)),
    "sorted_many_blocks_per_expert": (37, 64, 32, 4, 2, mg.MoEBlocks("sorted", 16, 16, 32, 1, 16, 32)),
    "sorted_tails_split": (20, 96, 48, 10, 3, mg.MoEBlocks("sorted", 16, 32, 64, 2, 32, 32)),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, fmt):
    tokens, hidden, intermediate, experts, top_k, blocks = CASES[case]
    problem = random_problem(len(case) + len(fmt), tokens, hidden, intermediate, experts, top_k, fmt)
    assert_close_to_reference(problem, blocks)


@pytest.mark.parametrize("source", ["ids", "sorted"])
def test_empty_experts(source):
    """Tokens use only 3 of 16 experts: the other experts' blocks must be skipped, not computed."""
    problem = random_problem(11, 4, 64, 32, 16, 2, "bf16", used_experts=3)
    assert_close_to_reference(problem, mg.MoEBlocks(source, 16, 32, 32, 1, 32, 32))


def test_fp32_activations_use_full_precision():
    problem = random_problem(2, 6, 64, 32, 8, 2, "bf16", dtype=jnp.float32)
    assert_close_to_reference(problem, ulps=8)


def test_sorted_blocks_cover_every_pair_once():
    rng = np.random.default_rng(4)
    experts, block_m = 12, 4
    ids = jnp.asarray(np.stack([rng.choice(experts, 3, replace=False) for _ in range(29)]), jnp.int32)
    block_expert, block_rows = map(np.asarray, mg.sorted_blocks(ids, experts, block_m))
    flat = np.asarray(ids).reshape(-1)
    rows = block_rows[block_rows >= 0]
    np.testing.assert_array_equal(np.sort(rows), np.arange(flat.size))
    for expert, block in zip(block_expert, block_rows):
        real = block[block >= 0]
        assert (expert < 0) == (real.size == 0)
        assert np.all(flat[real] == expert)


def test_ids_source_needs_every_pair_in_one_block():
    problem = random_problem(0, 20, 64, 32, 8, 2, "bf16")
    with pytest.raises(ValueError, match="block_m"):
        mg.moe_gemm_kernel(*problem, blocks=mg.MoEBlocks("ids", 16, 32, 32, 1, 32, 32), interpret=True)


def test_dequantize_nvfp4_codes():
    """The reference's decode: code c of a byte's low/high nibble times its block and global scale."""
    packed = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(1, 16, 16))
    w = mg.ExpertWeights(packed, jnp.full((1, 16, 2), 2.0, jnp.float8_e4m3fn), jnp.full((1,), 0.5, jnp.float32),
                         format="nvfp4")
    got = np.asarray(w.dequantize(jnp.float32))[0]
    lo, hi = mg._E2M1_VALUES[np.arange(256) & 15], mg._E2M1_VALUES[np.arange(256) >> 4]
    np.testing.assert_array_equal(got[:, 0::2].reshape(-1), lo)
    np.testing.assert_array_equal(got[:, 1::2].reshape(-1), hi)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_beam_tp8_shape_on_gpu(fmt, tokens):
    """Beam's per-GPU TP8 expert shape with the default block choice for each token count."""
    problem = random_problem(tokens, tokens, 5120, 320, 256, 8, fmt)
    assert_close_to_reference(problem)
