"""The one-program block builder (interpret mode on the CPU, the kernel on a GPU) against its plain-jnp
reference (`nvfp4_moe_mgpu._blocks_by_comparison`, `row_tokens`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import expert_blocks as eb
from pallas_kernels.nvfp4_moe_mgpu import _blocks_by_comparison, row_tokens


def _ids(tokens, top_k, experts, seed, others=0):
    """Random distinct experts per token; `others` extra ids become another device's pairs (id == experts)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts + others, top_k, replace=False) for _ in range(tokens)])
    return jnp.asarray(np.minimum(ids, experts), jnp.int32)


def _check(ids, experts, block_t, interpret):
    tokens, top_k = ids.shape
    pair_row, block_expert, row_pair = _blocks_by_comparison(ids, experts, block_t)
    want = (pair_row, block_expert, row_pair, row_tokens(row_pair, top_k, tokens))
    got = eb.build_blocks(ids, experts, block_t, interpret=interpret)
    for name, g, w in zip(("pair_row", "block_expert", "row_pair", "row_token"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    assert (np.asarray(block_expert) < 0).any() and (np.asarray(row_pair) < 0).any()  # unused blocks, padding


# Beam's decode batches (256 experts, top-8, blocks of 8) past 16 tokens; small ones with tails, experts
# with more pairs than a block, pairs of other devices, and pair and expert counts not powers of two.
CASES = [(17, 8, 256, 8, 0), (64, 8, 256, 8, 0), (40, 8, 256, 8, 40), (11, 3, 6, 4, 2), (5, 4, 12, 2, 0),
         (1, 8, 256, 8, 0), (33, 5, 20, 8, 5)]


@pytest.mark.parametrize("tokens,top_k,experts,block_t,others", CASES)
def test_blocks_match_sorted_blocks_interpret(tokens, top_k, experts, block_t, others):
    _check(_ids(tokens, top_k, experts, tokens + experts, others), experts, block_t, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,experts,block_t,others", CASES)
def test_blocks_match_sorted_blocks_on_gpu(tokens, top_k, experts, block_t, others):
    _check(_ids(tokens, top_k, experts, tokens + experts, others), experts, block_t, interpret=False)


def test_too_many_pairs_are_refused():
    with pytest.raises(ValueError, match="pairs"):
        eb.build_blocks(jnp.zeros((eb.MAX_PAIRS // 8 + 1, 8), jnp.int32), 256, 8, interpret=True)
