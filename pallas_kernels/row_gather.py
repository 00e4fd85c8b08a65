"""The activation rows of an expert-sorted MoE batch, gathered by a Pallas (Triton) kernel, with its
plain-jnp reference.

The grouped GEMMs (`nvfp4_moe_mgpu`, `bf16_moe_mgpu`) read their activations as blocks of `block_t`
rows of one expert, so the tokens' rows are first copied into that order. XLA's gather wrote every
row of the static block bound, unused blocks included, and ran at 0.3-2 TB/s (H200 run W: 563 us at
T = 8192, 14.8 us at T = 32). This kernel copies the tokens' rows, writes nothing for unused blocks
(nor, unless asked, for padding rows: their outputs are never read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import moe_gemm as mg


def _gather_kernel(row_token_ref, block_expert_ref, *refs, block_t: int, tokens: int, rows_per_program: int,
                   columns_per_program: int, zero_padding: bool):
    x_ref, out_ref = refs
    rows = pl.program_id(0) * rows_per_program + jnp.arange(rows_per_program)
    cols = pl.program_id(1) * columns_per_program + jnp.arange(columns_per_program)
    num_rows, num_cols = out_ref.shape
    in_rows = rows < num_rows
    in_cols = cols < num_cols
    used = plgpu.load(block_expert_ref.at[rows // block_t], mask=in_rows, other=-1) >= 0
    token = plgpu.load(row_token_ref.at[rows], mask=in_rows, other=tokens)
    real = used & (token < tokens)
    values = plgpu.load(x_ref.at[jnp.minimum(token, tokens - 1)[:, None], cols[None, :]],
                        mask=real[:, None] & in_cols[None, :], other=0)
    written = used if zero_padding else real
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], values, mask=written[:, None] & in_cols[None, :])


def gather_rows(x, row_token, block_expert, *, block_t: int, zero_padding: bool = False,
                rows_per_program: int = 32, columns_per_program: int = 512, num_warps: int = 4,
                interpret: bool = False):
    """`out[r] = x[row_token[r]]` for the rows of blocks with `block_expert >= 0`; rows of unused blocks
    (`block_expert < 0`) are left unwritten, and so are rows whose token is `T` (padding) unless
    `zero_padding`: no GEMM output of a padding row is read, as a GEMM row depends on its own
    activations only (unwritten was the faster on the H200, run AH: 219 against 265 us at T = 8192,
    blocks of 128). `x [T, K]`, `row_token [blocks * block_t]`. A program copies `rows_per_program` x
    `columns_per_program` values."""
    tokens, k = x.shape
    num_rows = row_token.shape[0]
    if num_rows != block_expert.shape[0] * block_t:
        raise ValueError(f"{num_rows} rows for {block_expert.shape[0]} blocks of {block_t}")
    if tokens == 0 or num_rows == 0:
        return jnp.zeros((num_rows, k), x.dtype)
    kernel = functools.partial(_gather_kernel, block_t=block_t, tokens=tokens, rows_per_program=rows_per_program,
                               columns_per_program=columns_per_program, zero_padding=zero_padding)
    operands = [row_token.astype(jnp.int32), block_expert.astype(jnp.int32), x]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, k), x.dtype),
        grid=(pl.cdiv(num_rows, rows_per_program), pl.cdiv(k, columns_per_program)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(*operands)


def gather_rows_reference(x, row_token, block_expert, *, block_t: int):
    """Plain jnp; padding rows and rows of unused blocks are zeros here (the kernel may leave them unwritten)."""
    tokens = x.shape[0]
    rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[jnp.minimum(row_token, tokens)]
    used = jnp.repeat(block_expert >= 0, block_t)
    return jnp.where(used[:, None], rows, 0)


def gather_rows_on_backend(x, row_token, block_expert, *, block_t: int):
    """The kernel on a GPU, the reference elsewhere (the kernel is Triton's)."""
    gather = gather_rows if jax.default_backend() == "gpu" else gather_rows_reference
    return gather(x, row_token, block_expert, block_t=block_t)


# --------------------------------------------------------------------------------------------------
# Blocks opened by pairs: built and gathered in one launch
# --------------------------------------------------------------------------------------------------


def _pair_ranks(ids, num_experts: int, expert_offset):
    """(local expert of each pair, `num_experts` for other devices' pairs; [P, P] same-expert matrix; each pair's
    rank among its expert's pairs, in pair order)."""
    pair_expert, _ = mg._local_pairs(ids, expert_offset, num_experts)
    pair = jnp.arange(pair_expert.shape[0])
    same = pair_expert[None, :] == pair_expert[:, None]
    return pair_expert, same, (same & (pair[None, :] < pair[:, None])).sum(1)  # earlier pairs of the same expert


def earlier_same_id(ids):
    """Each pair's count of earlier pairs with the same id (int32 `[P]`): a local pair's rank among its expert's
    pairs, which compact slots (`gather_opened_blocks(compact=True)`) need; the kernel tests locality and
    `rank % block_t == 0` itself. Written on the raw ids so that XLA makes one reduction kernel of it (with the
    local ids and the test outside it took three kernels, ~3.7 µs at 40 tokens on the H200, session 26)."""
    ids = ids.astype(jnp.int32)
    pair = jnp.arange(ids.shape[0])
    return ((ids[None, :] == ids[:, None]) & (pair[None, :] < pair[:, None])).sum(1, dtype=jnp.int32)


def max_blocks(pairs: int, num_experts: int, block_t: int) -> int:
    """Static bound on sum over experts of ceil(count / block_t), the blocks `pairs` pairs fill: one per expert
    touched, plus one per `block_t` pairs (a GEMM's grid of blocks)."""
    return -(-pairs // block_t) + min(num_experts, pairs)


def compact_slots(pairs: int, num_experts: int, block_t: int) -> int:
    """Compact opened slots: `max_blocks`, and never more than one per pair."""
    return min(pairs, max_blocks(pairs, num_experts, block_t))


def opened_blocks_reference(ids, *, num_experts: int, block_t: int, expert_offset=0, compact: bool = False):
    """Blocks of `block_t` rows of one expert, one block slot per pair: slot p is used when pair p opens a
    block of its expert (its rank among the expert's pairs, in pair order, is a multiple of `block_t`), and
    its rows are that pair and the expert's next `block_t - 1` pairs. No slot depends on another, so a
    kernel program builds its own (`gather_opened_blocks`) where sorted blocks need prefix sums over
    experts. `compact`: the used slots moved to the front, in pair order, and only `compact_slots` of them
    (idle slots cost the GEMMs a program each). `ids [P]` the pairs' experts; the local experts are
    `expert_offset ..` (`num_experts` of them), other pairs (another device's, or negative ids) are in no
    block. Returns (local expert of each slot, -1 unused; pair of each row, -1 for padding)."""
    pair_expert, same, rank = _pair_ranks(ids, num_experts, expert_offset)
    pairs = pair_expert.shape[0]
    pair = jnp.arange(pairs)
    opens = (pair_expert < num_experts) & (rank % block_t == 0)
    wanted = rank[:, None] + jnp.arange(block_t)[None, :]  # [slot, row]: the rank each row holds
    match = same[:, None, :] & (rank[None, None, :] == wanted[:, :, None])  # at most one pair matches
    row_pair = jnp.where(opens[:, None], ((pair + 1) * match).sum(-1) - 1, -1)
    block_expert = jnp.where(opens, pair_expert, -1)
    if compact:
        used_first = jnp.argsort(~opens, stable=True)[:compact_slots(pairs, num_experts, block_t)]
        block_expert, row_pair = block_expert[used_first], row_pair[used_first]
    return block_expert.astype(jnp.int32), row_pair.reshape(-1).astype(jnp.int32)


def _opened_blocks_kernel(ids_ref, offset_ref, *refs, num_experts: int, block_t: int, top_k: int, padded_pairs: int,
                          columns_per_program: int, columns_per_step: int, compact: bool):
    ranks_ref, x_ref, out_ref, block_expert_ref, row_pair_ref = refs if compact else (None, *refs)
    slot, column_group = pl.program_id(0), pl.program_id(1)
    pairs = ids_ref.shape[0]
    pair = jnp.arange(padded_pairs)
    experts = plgpu.load(ids_ref.at[pair], mask=pair < pairs, other=0) - offset_ref[0]
    local = (experts >= 0) & (experts < num_experts)
    experts = jnp.where(pair < pairs, jnp.where(local, experts, num_experts), -1)  # -1 (past the pairs): no match
    opener = slot  # the pair whose block this slot holds (if it opens one)
    if compact:  # slot s holds the block of the (s + 1)-th opening pair; past the last one, none (expert -1)
        earlier = plgpu.load(ranks_ref.at[pair], mask=pair < pairs, other=1)  # rank among the expert's pairs
        opening = ((pair < pairs) & local & (earlier % block_t == 0)).astype(jnp.int32)
        hit = (opening > 0) & (jnp.cumsum(opening) == slot + 1)
        opener = jnp.where(jnp.sum(hit.astype(jnp.int32)) > 0, jnp.sum(jnp.where(hit, pair, 0)), padded_pairs)
    expert = jnp.sum(jnp.where(pair == opener, experts, 0))
    if compact:
        expert = jnp.where(opener < pairs, expert, num_experts)  # no opener: like another device's pair
    same = experts == expert
    seen = jnp.cumsum(same.astype(jnp.int32))  # pairs of this expert up to and with each pair
    rank = jnp.sum(jnp.where(pair == opener, seen, 0)) - 1
    opens = (expert < num_experts) & (rank % block_t == 0)
    row = jnp.arange(block_t)
    match = same[None, :] & (seen[None, :] - 1 == rank + row[:, None])
    row_pair = jnp.where(opens, jnp.sum(jnp.where(match, pair[None, :] + 1, 0), axis=1) - 1, -1)

    @pl.when(column_group == 0)
    def _():
        plgpu.store(block_expert_ref.at[slot + jnp.arange(1)], jnp.where(opens, expert, -1) + jnp.zeros(1, jnp.int32))
        plgpu.store(row_pair_ref.at[slot * block_t + row], row_pair)

    token = jnp.maximum(row_pair, 0) // top_k
    for step in range(columns_per_program // columns_per_step):  # the slot's metadata once, its columns in steps
        cols = column_group * columns_per_program + step * columns_per_step + jnp.arange(columns_per_step)
        real = (row_pair >= 0)[:, None] & (cols < x_ref.shape[1])[None, :]
        values = plgpu.load(x_ref.at[token[:, None], cols[None, :]], mask=real, other=0)
        plgpu.store(out_ref.at[(slot * block_t + row)[:, None], cols[None, :]], values, mask=real)


def gather_opened_blocks(x, ids, *, num_experts: int, block_t: int, expert_offset=0, column_groups: int = 1,
                         columns_per_step: int = 1024, num_warps: int = 4, compact: bool = False,
                         interpret: bool = False):
    """`opened_blocks_reference`'s blocks and their activation rows in one kernel: program (slot, column
    group) finds its slot's pairs from the ids alone (a cumulative count over the pairs) and copies their
    tokens' rows, `columns_per_step` columns at a time over its `1 / column_groups` of K (fewer programs
    count the pairs fewer times). `x [T, K]`, `ids [T * top_k]` (token t's pairs at t * top_k ...), local
    from `expert_offset` (an int or a traced scalar) on, as in the reference. `compact`: `compact_slots`
    slots, the used ones first (the reference's `compact`), from the pairs' ranks that XLA counts
    (`earlier_same_id`); each program finds its opener by a cumulative count of the opening pairs. Returns (rows
    [slots * block_t, K], unwritten for padding and unused slots; expert of each slot; pair of each row)."""
    tokens, k = x.shape
    pairs = ids.shape[0]
    if pairs == 0:
        return jnp.zeros((0, k), x.dtype), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)
    if tokens == 0 or pairs % tokens:
        raise ValueError(f"{pairs} pairs for {tokens} tokens: need a whole number of pairs per token")
    padded = 1 << max(pairs - 1, 0).bit_length()  # Triton's tensors have power-of-two sizes
    steps = pl.cdiv(pl.cdiv(k, column_groups), columns_per_step)
    slots = compact_slots(pairs, num_experts, block_t) if compact else pairs
    kernel = functools.partial(_opened_blocks_kernel, num_experts=num_experts, block_t=block_t,
                               top_k=pairs // tokens, padded_pairs=padded, columns_per_program=steps * columns_per_step,
                               columns_per_step=columns_per_step, compact=compact)
    ranks = [earlier_same_id(ids)] if compact else []
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((slots * block_t, k), x.dtype), jax.ShapeDtypeStruct((slots,), jnp.int32),
                   jax.ShapeDtypeStruct((slots * block_t,), jnp.int32)),
        grid=(slots, pl.cdiv(k, steps * columns_per_step)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(ids.astype(jnp.int32), jnp.asarray(expert_offset, jnp.int32).reshape(1), *ranks, x)


def gather_opened_blocks_on_backend(x, ids, *, num_experts: int, block_t: int, expert_offset=0, **program):
    """(rows, expert of each slot, pair of each row): the kernel on a GPU (`program`: its program shape,
    `gather_opened_blocks`' column_groups, columns_per_step, num_warps, and its `compact`), the references
    elsewhere."""
    if jax.default_backend() == "gpu":
        return gather_opened_blocks(x, ids, num_experts=num_experts, block_t=block_t, expert_offset=expert_offset,
                                    **program)
    block_expert, row_pair = opened_blocks_reference(ids, num_experts=num_experts, block_t=block_t,
                                                     expert_offset=expert_offset, compact=program.get("compact", False))
    top_k = ids.shape[0] // x.shape[0]
    row_token = jnp.where(row_pair >= 0, row_pair // top_k, x.shape[0])
    return gather_rows_reference(x, row_token, block_expert, block_t=block_t), block_expert, row_pair
