"""The pair-combine kernel (interpret mode on the CPU, the kernel on a GPU) against its plain-jnp reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pair_combine as pc


EXPERTS, OFFSET = 6, 4  # this device's experts: 4 .. 9


def _case(tokens, top_k, hidden, seed, dtype=jnp.bfloat16):
    """Pair rows, routing weights and the pairs' experts, some pairs not local (another device's expert or
    a negative id), whose rows hold inf and NaN (another device's rows are never written here): they count
    zero."""
    rng = np.random.default_rng(seed)
    pair_out = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32) * 4
    weights = rng.random((tokens, top_k)).astype(np.float32)
    local = rng.random((tokens, top_k)) < 0.7
    local[0, 0], local[-1, -1] = True, False
    foreign = np.flatnonzero(~local.reshape(-1))
    pair_out[foreign] = np.inf
    pair_out[foreign[::2], ::3] = np.nan
    foreign_ids = rng.choice(np.r_[-1, 0:OFFSET, OFFSET + EXPERTS:20], local.shape)
    pair_expert = np.where(local, rng.integers(OFFSET, OFFSET + EXPERTS, local.shape), foreign_ids)
    return jnp.asarray(pair_out, dtype), jnp.asarray(weights), jnp.asarray(pair_expert, jnp.int32)


def _check(pair_out, weights, pair_expert, interpret, dtype=None, **program):
    got = pc.combine_pairs(pair_out, weights, pair_expert, num_experts=EXPERTS, expert_offset=OFFSET, dtype=dtype,
                           interpret=interpret, **program)
    want = pc.combine_pairs_reference(pair_out, weights, pair_expert, num_experts=EXPERTS, expert_offset=OFFSET,
                                      dtype=dtype)
    assert got.dtype == want.dtype == (pair_out.dtype if dtype is None else dtype)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(want).all() and np.abs(want).max() > 1
    # The same roundings in the same order: at most a last-bit difference from fp32 contraction.
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)


# Hidden sizes with a column tail, top_k 1 to 8 (3: a padded tile).
CASES = [(1, 8, 64), (5, 3, 600), (16, 8, 5120), (37, 2, 1030), (9, 1, 512)]
PROGRAM_SHAPES = [{}, dict(columns_per_program=256), dict(columns_per_program=1024, num_warps=8)]


@pytest.mark.parametrize("tokens,top_k,hidden", CASES)
def test_combine_matches_reference_interpret(tokens, top_k, hidden):
    _check(*_case(tokens, top_k, hidden, seed=tokens * hidden), interpret=True)


@pytest.mark.parametrize("program", PROGRAM_SHAPES[1:])
def test_program_shapes_give_the_same_sums_interpret(program):
    _check(*_case(37, 2, 1030, seed=3), interpret=True, **program)


def test_fp32_pairs_are_rounded_to_the_dtype_first_interpret():
    _check(*_case(7, 8, 96, seed=2, dtype=jnp.float32), interpret=True, dtype=jnp.bfloat16)


def test_no_tokens_and_mismatched_shapes():
    combine = functools.partial(pc.combine_pairs, num_experts=EXPERTS, interpret=True)
    assert combine(jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 8)), jnp.zeros((0, 8), jnp.int32)).shape == (0, 64)
    pair_out, weights, pair_expert = _case(3, 4, 64, seed=1)
    with pytest.raises(ValueError, match="11 pair rows"):
        combine(pair_out[:-1], weights, pair_expert)
    with pytest.raises(ValueError, match="ids"):
        combine(pair_out, weights, pair_expert[:, :2])


def test_combine_lowers_for_cuda(triton_for_sm90):
    shapes = (jax.ShapeDtypeStruct((64 * 8, 5120), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8), jnp.float32),
              jax.ShapeDtypeStruct((64, 8), jnp.int32))
    text = jax.jit(functools.partial(pc.combine_pairs, num_experts=256)).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("program", PROGRAM_SHAPES)
@pytest.mark.parametrize("tokens,top_k,hidden", CASES + [(64, 8, 5120), (513, 8, 5120)])
def test_combine_matches_reference_on_gpu(tokens, top_k, hidden, program):
    _check(*_case(tokens, top_k, hidden, seed=tokens), interpret=False, **program)
