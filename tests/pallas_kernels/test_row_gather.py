"""The row-gather kernel (interpret mode on the CPU, the kernel on a GPU) against its plain-jnp reference."""

import functools

import jax
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


OFFSET = 3  # the local experts' first id; ids below it or past the local ones are other devices'


def _pair_experts(tokens, top_k, experts, seed, other_devices=3):
    """Each token's distinct experts among `experts + 2 * other_devices`, the local ones `OFFSET ..`;
    token 0's last pair another device's (at least one) and, with two pairs or more, its first a padding
    token's -1."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts + 2 * other_devices, top_k, replace=False) for _ in range(tokens)])
    ids[0, -1] = OFFSET + experts
    if top_k > 1:
        ids[0, 0] = -1
    return jnp.asarray(ids.reshape(-1), jnp.int32)


# (tokens, top_k, experts, block_t, K): few experts give experts with several blocks and a tail block.
OPENED_CASES = [(1, 8, 256, 8, 64), (9, 8, 256, 8, 96), (17, 3, 5, 4, 1056), (40, 8, 12, 8, 608), (64, 8, 256, 8, 5120)]


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 8, 256), (17, 3, 5), (40, 8, 12)])
def test_earlier_same_id_counts_earlier_pairs_of_each_id(tokens, top_k, experts):
    """Compact slots' ranks: for each pair, how many earlier pairs carry its id (other devices' and padding ids
    included; the kernel ignores those pairs), counted here pair by pair."""
    flat = _pair_experts(tokens, top_k, experts, seed=tokens).reshape(-1)
    want = [int((flat[:p] == flat[p]).sum()) for p in range(len(flat))]
    np.testing.assert_array_equal(np.asarray(rg.earlier_same_id(jnp.asarray(flat))), want)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("tokens,top_k,experts,block_t,k", OPENED_CASES)
def test_opened_blocks_hold_each_local_pair_once(tokens, top_k, experts, block_t, k, compact):
    """Every local pair lands in one row of a block of its expert, after the earlier pairs of that expert
    in the block; a slot is used exactly when its pair opens a block (compact: the used slots first, in
    their openers' order, within the static bound); other devices' pairs get no row."""
    ids = _pair_experts(tokens, top_k, experts, seed=tokens)
    block_expert, row_pair = map(np.asarray, rg.opened_blocks_reference(ids, num_experts=experts, block_t=block_t,
                                                                         expert_offset=OFFSET, compact=compact))
    flat = np.asarray(ids) - OFFSET
    local = (flat >= 0) & (flat < experts)
    assert (~local).any() and local.any()
    rows = row_pair.reshape(-1, block_t)
    placed = rows[rows >= 0]
    np.testing.assert_array_equal(np.sort(placed), np.flatnonzero(local))
    used = np.flatnonzero(block_expert >= 0)
    openers = rows[used, 0]
    if compact:
        assert len(block_expert) == rg.compact_slots(len(flat), experts, block_t)
        np.testing.assert_array_equal(used, np.arange(len(used)))
        assert (np.diff(openers) > 0).all()
    else:
        np.testing.assert_array_equal(openers, used)
    for slot in used:
        members = rows[slot][rows[slot] >= 0]
        assert (np.diff(members) > 0).all() and (flat[members] == block_expert[slot]).all()
        assert (rows[slot][len(members):] == -1).all()  # padding after the pairs
    _, counts = np.unique(flat[local], return_counts=True)
    assert (block_expert >= 0).sum() == (-(-counts // block_t)).sum()
    assert (rows[block_expert < 0] == -1).all()


@pytest.mark.parametrize("program", [{}, dict(column_groups=3, columns_per_step=128, num_warps=2),
                                     dict(compact=True), dict(compact=True, column_groups=2)])
@pytest.mark.parametrize("tokens,top_k,experts,block_t,k", OPENED_CASES)
def test_opened_blocks_kernel_matches_reference_interpret(tokens, top_k, experts, block_t, k, program):
    _check_opened(tokens, top_k, experts, block_t, k, program, interpret=True)


def _check_opened(tokens, top_k, experts, block_t, k, program, interpret):
    ids = _pair_experts(tokens, top_k, experts, seed=tokens + k)
    x = jnp.asarray(np.random.default_rng(k).standard_normal((tokens, k)), jnp.bfloat16)
    rows, block_expert, row_pair = rg.gather_opened_blocks(x, ids, num_experts=experts, block_t=block_t,
                                                          expert_offset=OFFSET, interpret=interpret, **program)
    want_expert, want_pair = rg.opened_blocks_reference(ids, num_experts=experts, block_t=block_t,
                                                        expert_offset=OFFSET, compact=program.get("compact", False))
    np.testing.assert_array_equal(np.asarray(block_expert), np.asarray(want_expert))
    np.testing.assert_array_equal(np.asarray(row_pair), np.asarray(want_pair))
    real = np.asarray(row_pair) >= 0
    np.testing.assert_array_equal(np.asarray(rows, np.float32)[real],
                                  np.asarray(x, np.float32)[np.asarray(row_pair)[real] // top_k])


def test_opened_blocks_need_whole_tokens():
    with pytest.raises(ValueError, match="pairs for 3 tokens"):
        rg.gather_opened_blocks(jnp.zeros((3, 64), jnp.bfloat16), jnp.zeros(7, jnp.int32), num_experts=4, block_t=8,
                                interpret=True)


@pytest.mark.parametrize("tokens,program", [(9, dict(column_groups=5)), (64, {}), (64, dict(compact=True))])
def test_opened_blocks_kernel_lowers_for_cuda(triton_for_sm90, tokens, program):
    """One Triton kernel, compact slots included (XLA counts their pairs' ranks: `rg.earlier_same_id`)."""
    shapes = (jax.ShapeDtypeStruct((tokens, 5120), jnp.bfloat16), jax.ShapeDtypeStruct((tokens * 8,), jnp.int32))
    op = functools.partial(rg.gather_opened_blocks, num_experts=256, block_t=8, **program)
    text = jax.jit(op).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("program", [{}, dict(column_groups=5), dict(compact=True)])  # the layer's shapes and compact
@pytest.mark.parametrize("tokens,top_k,experts,block_t,k", OPENED_CASES + [(16, 8, 256, 8, 5120), (33, 8, 256, 8, 5120)])
def test_opened_blocks_kernel_matches_reference_on_gpu(tokens, top_k, experts, block_t, k, program):
    _check_opened(tokens, top_k, experts, block_t, k, program, interpret=False)
