"""The row-gather kernel (interpret mode on the CPU, the kernel on a GPU) against its plain-jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import row_gather as rg
from pallas_kernels.nvfp4_moe_mgpu import pair_blocks, row_tokens


def _case(tokens, k, block_t, seed, top_k=3, num_experts=7):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]), jnp.int32)
    _, block_expert, row_pair = pair_blocks(ids, num_experts, block_t)
    return x, row_tokens(row_pair, top_k, tokens), block_expert


def _check(x, row_token, block_expert, block_t, interpret, zero_padding=False, **program):
    got = np.asarray(rg.gather_rows(x, row_token, block_expert, block_t=block_t, zero_padding=zero_padding,
                                    interpret=interpret, **program), np.float32)
    want = np.asarray(rg.gather_rows_reference(x, row_token, block_expert, block_t=block_t), np.float32)
    used = np.repeat(np.asarray(block_expert) >= 0, block_t)
    token = np.asarray(row_token)
    real = used & (token < x.shape[0])
    # The case has unused blocks and padding rows, which the kernel leaves alone.
    assert real.any() and not used.all() and (used & ~real).any()
    np.testing.assert_array_equal(got[real], want[real])
    assert set(token[real]) == set(range(x.shape[0]))  # every token's row lands somewhere
    if zero_padding:
        assert not got[used & ~real].any()


# Odd token counts, K not a multiple of the program's 512 columns, blocks of 8 to 128 rows.
CASES = [(2, 96, 8), (5, 608, 8), (37, 1056, 64), (70, 64, 128)]
# Program shapes: the default, and others that leave row and column tails.
PROGRAM_SHAPES = [{}, dict(rows_per_program=16, columns_per_program=256),
                  dict(rows_per_program=64, columns_per_program=1024, num_warps=8)]


@pytest.mark.parametrize("tokens,k,block_t", CASES)
def test_gather_matches_reference_interpret(tokens, k, block_t):
    x, row_token, block_expert = _case(tokens, k, block_t, seed=tokens + k)
    _check(x, row_token, block_expert, block_t, interpret=True)


@pytest.mark.parametrize("zero_padding", [False, True])
def test_padding_rows_are_zeros_when_asked_interpret(zero_padding):
    x, row_token, block_expert = _case(37, 160, 64, seed=11)
    _check(x, row_token, block_expert, 64, interpret=True, zero_padding=zero_padding)


@pytest.mark.parametrize("program", PROGRAM_SHAPES[1:])
def test_program_shapes_gather_the_same_rows_interpret(program):
    x, row_token, block_expert = _case(37, 1056, 64, seed=5)
    _check(x, row_token, block_expert, 64, interpret=True, **program)


def test_rows_must_fill_whole_blocks():
    x, row_token, block_expert = _case(4, 64, 8, seed=1)
    with pytest.raises(ValueError, match="rows for"):
        rg.gather_rows(x, row_token[:-1], block_expert, block_t=8, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("program", PROGRAM_SHAPES)
@pytest.mark.parametrize("tokens,k,block_t", CASES + [(8192, 5120, 64), (8192, 5120, 128)])
def test_gather_matches_reference_on_gpu(tokens, k, block_t, program):
    experts = 256 if tokens > 100 else 9
    x, row_token, block_expert = _case(tokens, k, block_t, seed=tokens, top_k=8, num_experts=experts)
    _check(x, row_token, block_expert, block_t, interpret=False, **program)
