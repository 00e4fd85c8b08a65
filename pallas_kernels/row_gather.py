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
