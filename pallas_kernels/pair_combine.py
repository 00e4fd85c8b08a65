"""A token's routed-expert outputs weighted and added: a Pallas (Triton) kernel and its plain-jnp reference.

The MoE layers end with `[pairs, H]` expert outputs in pair order (token t's pairs at t * top_k ...):
each is weighted by its routing weight, rounded to the activations' dtype, and a token's pairs are
added in fp32 and rounded once. XLA's fusion of that took 2.4-3.3 us at 16-64 tokens on the H200
(session 20 run G) for 1.3-5 MB read; this kernel reads each pair row once and writes each token once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import moe_gemm as mg


def combine_pairs_reference(pair_out, weights, ids, *, num_experts: int, expert_offset=0, dtype=None):
    """`pair_out [T * top_k, H]` (rounded to `dtype` first, default its own), `weights [T, top_k]` fp32,
    `ids [T, top_k]` the pairs' experts, computed here from `expert_offset` on (`num_experts` of them); the
    other pairs' rows (another device's, or negative ids) hold anything and count zero. Returns `[T, H]`
    in `dtype`."""
    dtype = pair_out.dtype if dtype is None else dtype
    weighted = (pair_out.astype(dtype).astype(jnp.float32) * weights.reshape(-1, 1)).astype(dtype)
    _, local = mg._local_pairs(ids, expert_offset, num_experts)
    return mg._add_token_pairs(weighted, local, weights.shape[0])


def _combine_kernel(pair_out_ref, weight_ref, ids_ref, offset_ref, out_ref, *, num_experts: int, top_k: int,
                    padded_top_k: int, columns_per_program: int):
    token = pl.program_id(0)
    hidden = out_ref.shape[1]
    j = jnp.arange(padded_top_k)
    pair = token * top_k + j
    cols = pl.program_id(1) * columns_per_program + jnp.arange(columns_per_program)
    in_cols = cols < hidden
    weight = plgpu.load(weight_ref.at[pair], mask=j < top_k, other=0.0)
    expert = plgpu.load(ids_ref.at[pair], mask=j < top_k, other=0) - offset_ref[0]
    local = (j < top_k) & (expert >= 0) & (expert < num_experts)
    rows = plgpu.load(pair_out_ref.at[pair[:, None], cols[None, :]], mask=local[:, None] & in_cols[None, :], other=0)
    weighted = (rows.astype(out_ref.dtype).astype(jnp.float32) * weight[:, None]).astype(out_ref.dtype)
    total = jnp.sum(jnp.where(local[:, None], weighted.astype(jnp.float32), 0.0), axis=0)
    plgpu.store(out_ref.at[token, cols], total.astype(out_ref.dtype), mask=in_cols)


def combine_pairs(pair_out, weights, ids, *, num_experts: int, expert_offset=0, dtype=None,
                  columns_per_program: int = 512, num_warps: int = 4, interpret: bool = False):
    """`combine_pairs_reference` in one kernel: program (token, column group) reads the token's local pair
    rows once, as one `[top_k, columns]` tile, and writes their sum."""
    tokens, top_k = weights.shape
    pairs, hidden = pair_out.shape
    dtype = pair_out.dtype if dtype is None else dtype
    if pairs != tokens * top_k or ids.shape != weights.shape:
        raise ValueError(f"{pairs} pair rows, weights {weights.shape}, ids {ids.shape}: need "
                         "T * top_k rows and one weight and one expert per pair")
    if tokens == 0:
        return jnp.zeros((0, hidden), dtype)
    kernel = functools.partial(_combine_kernel, num_experts=num_experts, top_k=top_k,
                               padded_top_k=1 << max(top_k - 1, 0).bit_length(),  # Triton's sizes: powers of two
                               columns_per_program=columns_per_program)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens, hidden), dtype),
        grid=(tokens, pl.cdiv(hidden, columns_per_program)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
    )(pair_out, weights.reshape(-1).astype(jnp.float32), ids.reshape(-1).astype(jnp.int32),
      jnp.asarray(expert_offset, jnp.int32).reshape(1))


def combine_pairs_on_backend(pair_out, weights, ids, *, num_experts: int, expert_offset=0, dtype=None):
    """The kernel on a GPU, the reference elsewhere (the kernel is Triton's)."""
    combine = combine_pairs if jax.default_backend() == "gpu" else combine_pairs_reference
    return combine(pair_out, weights, ids, num_experts=num_experts, expert_offset=expert_offset, dtype=dtype)
