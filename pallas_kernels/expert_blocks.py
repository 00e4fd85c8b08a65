"""A decode batch's (token, expert) pairs sorted into blocks of one expert, by one Pallas (Triton) program.

The grouped GEMMs take blocks of `block_t` rows of one expert. For 17-64 tokens the layer built them in XLA
by compare-and-count (`nvfp4_moe_mgpu._blocks_by_comparison`, its plain-jnp reference here): nine small
fusions, ~12 us of launches at T = 64 on the H200 (RESULTS.md, session 19). This kernel builds the same
blocks in one program of one launch: every count is a compare over the pairs (at most a few hundred) in
registers, and only the expert offsets and the row scatters go through global memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_PAIRS = 1024  # [pairs, _CHUNK] compares in registers: a decode batch's pairs (64 tokens x top-8 = 512)
_CHUNK = 32  # pairs compared at a time against all of them: [pairs, _CHUNK] values in registers
_FILL = 1024  # output rows filled with "no pair" a store at a time


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _blocks_kernel(ids_ref, pair_row_ref, block_expert_ref, row_pair_ref, row_token_ref, first_ref, *,
                   pairs: int, experts: int, block_t: int, top_k: int, tokens: int, interpret: bool):
    padded_pairs, padded_experts = _pow2(pairs), _pow2(experts)
    num_blocks, num_rows = block_expert_ref.shape[0], row_pair_ref.shape[0]
    p = jnp.arange(padded_pairs)
    e = jnp.arange(padded_experts)
    # Padding pairs read as another device's pair (id == experts): they get no row and count for no expert.
    flat = plgpu.load(ids_ref.at[p], mask=p < pairs, other=experts)
    counts = jnp.zeros(padded_experts, jnp.int32)
    rank = jnp.zeros(padded_pairs, jnp.int32)  # earlier pairs with the same expert
    for start in range(0, padded_pairs, _CHUNK):
        q = start + jnp.arange(_CHUNK)
        other = plgpu.load(ids_ref.at[q], mask=q < pairs, other=experts)
        counts += (e[:, None] == other[None, :]).astype(jnp.int32).sum(1)
        rank += ((flat[:, None] == other[None, :]) & (q[None, :] < p[:, None])).astype(jnp.int32).sum(1)
    blocks_of = jnp.where(e < experts, (counts + block_t - 1) // block_t, 0)
    first_block = jnp.cumsum(blocks_of) - blocks_of
    # A pair's expert's first block: through memory (Triton cannot index a register vector by a vector).
    plgpu.store(first_ref.at[e], first_block)
    for start in range(0, num_blocks, _CHUNK):  # block b belongs to the expert whose range holds it
        b = start + jnp.arange(_CHUNK)
        owns = (first_block[None, :] <= b[:, None]) & (b[:, None] < (first_block + blocks_of)[None, :])
        owner = (owns.astype(jnp.int32) * (e + 1)[None, :]).sum(1) - 1
        plgpu.store(block_expert_ref.at[b], owner, mask=b < num_blocks)
    for start in range(0, num_rows, _FILL):  # rows no pair fills: padding
        r = start + jnp.arange(_FILL)
        in_rows = r < num_rows
        plgpu.store(row_pair_ref.at[r], jnp.full(_FILL, -1, jnp.int32), mask=in_rows)
        plgpu.store(row_token_ref.at[r], jnp.full(_FILL, tokens, jnp.int32), mask=in_rows)
    if not interpret:  # the stores above land before the loads and stores below (interpret mode is sequential)
        plgpu.debug_barrier()
    local = flat < experts
    first = plgpu.load(first_ref.at[jnp.minimum(flat, experts - 1)])
    row = (first + rank // block_t) * block_t + rank % block_t
    real = p < pairs
    plgpu.store(pair_row_ref.at[p], jnp.where(local, row, 0), mask=real)
    # Pairs without a row aim past the end (and are masked): no address is stored to twice.
    row = jnp.where(local & real, row, num_rows)
    plgpu.store(row_pair_ref.at[row], p, mask=local & real)
    plgpu.store(row_token_ref.at[row], p // top_k, mask=local & real)


def build_blocks(ids, num_experts: int, block_t: int, *, num_warps: int = 4, interpret: bool = False):
    """`ids [T, top_k]` (`num_experts`: another device's pair) -> (row of each pair (0 for others' pairs),
    expert of each block (-1: unused), pair of each block row (-1: padding), token of each block row (T:
    padding)), as `nvfp4_moe_mgpu.pair_blocks` and `row_tokens` give them."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    if not 0 < pairs <= MAX_PAIRS:
        raise ValueError(f"build_blocks takes 1 to {MAX_PAIRS} (token, expert) pairs, got {tokens} x {top_k}")
    num_blocks = -(-pairs // block_t) + min(num_experts, pairs)
    kernel = functools.partial(_blocks_kernel, pairs=pairs, experts=num_experts, block_t=block_t, top_k=top_k,
                               tokens=tokens, interpret=interpret)
    shapes = [(pairs,), (num_blocks,), (num_blocks * block_t,), (num_blocks * block_t,), (_pow2(num_experts),)]
    *outputs, _ = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(ids.reshape(-1).astype(jnp.int32))
    return tuple(outputs)
