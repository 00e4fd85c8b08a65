"""Ragged paged attention for one layer: one step that mixes prefill chunks, single-token decodes and
16-token verify blocks, over a paged KV cache, with GQA, causal masking and an optional sliding window.

Layout (one layer):
  k_pages, v_pages  [num_pages, page_size, kv_heads, head_dim]
  queries           [total_q_tokens, heads, head_dim]   heads = kv_heads * group
  query_start       [batch + 1] int32: sequence b owns flat tokens query_start[b] .. query_start[b+1]-1;
                    tokens at or past query_start[batch] are padding (their output is zeros)
  seq_lens          [batch] int32: context length INCLUDING the new tokens; sequence b's q_len query
                    tokens sit at positions seq_len - q_len .. seq_len - 1 (the end of its context)
  page_table        [batch, max_pages] int32: logical page -> physical page; -1 = released or absent
                    (its keys are invisible; sliding layers release out-of-window pages, so -1 entries
                    may come before live ones)

A key at position k_pos is visible to a query at q_pos iff k_pos <= q_pos, its logical page is
mapped (page_table entry >= 0) and, when `window` is set, q_pos - k_pos < window.

Implementations: the plain-jnp reference (every token gathers its whole page-table span), a blocked
plain-jnp form for long contexts (query blocks visit only the pages they can see), the general Pallas
kernel, and the split decode kernels for q_len == 1 (flash-decoding). `ragged_paged_attention` picks
(`use_kernel`; `default_use_kernel()` is the model's choice per backend). The jnp forms round where
`beam_jax.layers.attention.attend` (the dense reference) rounds, so the paged and contiguous caches
give the same numbers:
  1. scores = q . k accumulated in fp32 (fp32 inputs: Precision.HIGHEST), rounded to q.dtype;
  2. scores * softmax_scale in fp32, rounded to q.dtype again;
  3. softmax in fp32 over visible keys (a query with no visible key gets zeros, not NaN);
  4. probabilities rounded to v.dtype; probs . v accumulated in fp32, rounded to v.dtype.

The decode kernels can also take the layer's per-head work (the model's GPU path): raw q with its
`HeadPrologue` (RMSNorm, then RoPE or the SSMax scale) applied in the split kernel's prologue, and the
`OutputGate` applied in the combine's epilogue; `write_kv_kernel` writes raw k with its prologue. The
references (`head_prologue_reference`, `output_gate_reference`) are the unfused math.

Files in pallas_kernels import nothing from beam_jax or serving.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels import decode_attention_mgpu
from pallas_kernels.mgpu_tiles import is_hopper


def _precision(dtype) -> lax.Precision:
    # fp32 runs are parity runs: true fp32 products (no TF32 on GPU), as in beam_jax's matmul_precision.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# --------------------------------------------------------------------------------------------------
# Writing the step's new K/V into the pages
# --------------------------------------------------------------------------------------------------


def write_kv(
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    new_k: Float[Array, "tokens kv_heads d"],
    new_v: Float[Array, "tokens kv_heads d"],
    slot_mapping: Int[Array, " tokens"],
    *,
    key_prologue: HeadPrologue | None = None,
    use_kernel: bool = False,
    interpret: bool = False,
) -> tuple[Float[Array, "pages page_size kv_heads d"], Float[Array, "pages page_size kv_heads d"]]:
    """Scatter each token's K/V to flat slot `page * page_size + offset`; slot -1 (padding) is skipped.
    Returns the new page arrays (donate them under jit for an in-place update).

    `key_prologue`: `new_k` is the raw projection; its norm and RoPE (`head_prologue_reference`) are
    applied first. `use_kernel`: one Pallas call does prologue and write (`write_kv_kernel`), in place;
    otherwise plain jnp (XLA's scatter)."""
    if use_kernel:
        return write_kv_kernel(k_pages, v_pages, new_k, new_v, slot_mapping, key_prologue=key_prologue,
                               interpret=interpret)
    if key_prologue is not None:
        new_k = head_prologue_reference(new_k, key_prologue)
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    num_slots = num_pages * page_size
    # JAX wraps negative indices, so -1 must become an out-of-range index that mode="drop" discards.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def scatter(pages, new):
        flat = pages.reshape(num_slots, kv_heads, head_dim)
        flat = flat.at[slots].set(new.astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, new_k), scatter(v_pages, new_v)


# --------------------------------------------------------------------------------------------------
# What a layer does around attention, for the kernels to fuse: the q/k prologue and the output gate
# --------------------------------------------------------------------------------------------------
#
# Beam's attention normalizes every q and k head (RMSNorm over head_dim), then rotates them (RoPE,
# sliding layers) or scales q (SSMax, full layers), and gates the output per head. At batch 1 a
# decode step is launch-bound, so the decode kernels take the raw projections and do these in their
# prologue / epilogue, and the page write takes raw k. The references below are the model's math
# with its rounding points (beam_jax.layers.norm / rope / attention; a test checks they agree bit for
# bit): the fused paths round where they round.


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("norm_weight", "rope_cos", "rope_sin", "ssmax_scale"),
    meta_fields=("eps",),
)
@dataclasses.dataclass(frozen=True)
class HeadPrologue:
    """Per head, before attention: RMSNorm over head_dim (fp32 statistics, `weight * x`, rounded to the
    input dtype), then RoPE (rotate-half layout, fp32, each product rounded to fp32, result rounded) if
    `rope_cos`/`rope_sin` are set, then the SSMax scale (fp32, rounded) if `ssmax_scale` is set. The
    position data is per flat token, computed once per step (all layers of a kind share it)."""

    norm_weight: Float[Array, " d"]
    eps: float
    rope_cos: Float[Array, "tokens d"] | None = None
    rope_sin: Float[Array, "tokens d"] | None = None
    ssmax_scale: Float[Array, " tokens"] | None = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=("gate", "bias"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class OutputGate:
    """The attention output gate: `out * sigmoid(gate + bias[head])`. The biased logits, the sigmoid and
    the product are each rounded to `gate.dtype` (the model's activation dtype)."""

    gate: Float[Array, "tokens heads d"]  # the gate projection, unbiased
    bias: Float[Array, " heads"]


def head_prologue_reference(x: Float[Array, "tokens heads d"], prologue: HeadPrologue) -> Float[Array, "tokens heads d"]:
    """Plain jnp, with the model's rounding points."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + prologue.eps)
    x = (prologue.norm_weight.astype(jnp.float32) * normed).astype(dtype)
    if prologue.rope_cos is not None:
        cos, sin = prologue.rope_cos[:, None, :], prologue.rope_sin[:, None, :]
        x32 = x.astype(jnp.float32)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
        # Products rounded to fp32 before the add (no FMA), as the model rounds them.
        direct, turned = lax.optimization_barrier((x32 * cos, rotated * sin))
        x = (direct + turned).astype(dtype)
    if prologue.ssmax_scale is not None:
        x = (x.astype(jnp.float32) * prologue.ssmax_scale[:, None, None]).astype(dtype)
    return x


def output_gate_reference(out: Float[Array, "tokens heads d"], gate: OutputGate) -> Float[Array, "tokens heads d"]:
    """Plain jnp, with the model's rounding points; the result has `gate.gate.dtype`."""
    dtype = gate.gate.dtype
    logits = (gate.gate.astype(jnp.float32) + gate.bias.astype(jnp.float32)[:, None]).astype(dtype)
    weights = jax.nn.sigmoid(logits.astype(jnp.float32)).astype(dtype)
    return (out.astype(jnp.float32) * weights.astype(jnp.float32)).astype(dtype)


def _prologue_arrays(prologue: HeadPrologue | None, head_dim: int) -> tuple[list, list, tuple]:
    """The prologue's arrays for a pallas_call, their block specs (whole arrays: a program indexes its
    token's row) and the static description the kernel reads them with."""
    if prologue is None:
        return [], [], ()
    arrays = [prologue.norm_weight.reshape(head_dim)]
    has_rope, has_ssmax = prologue.rope_cos is not None, prologue.ssmax_scale is not None
    if has_rope:
        arrays += [prologue.rope_cos.astype(jnp.float32), prologue.rope_sin.astype(jnp.float32)]
    if has_ssmax:
        arrays.append(prologue.ssmax_scale.astype(jnp.float32))
    specs = [pl.BlockSpec(a.shape, lambda *_, rank=a.ndim: (0,) * rank) for a in arrays]
    return arrays, specs, (prologue.eps, has_rope, has_ssmax)


def _prologue_count(spec: tuple) -> int:
    """How many arrays `_prologue_arrays` passes for its static description `spec`."""
    if not spec:
        return 0
    _, has_rope, has_ssmax = spec
    return 1 + 2 * has_rope + has_ssmax


def _rounded(x32, dtype):
    """fp32 `x32` rounded to `dtype` and back, as a kernel's intermediate rounding point. For bf16 the
    round-to-nearest-even is done on the bits: on the H200, Triton dropped a plain truncate-extend
    pair (a third of a bf16 RoPE prologue's values came out unrounded-then-rounded), integer ops it
    cannot drop. Finite values only (NaN may come out as inf)."""
    if jnp.dtype(dtype) == jnp.float32:
        return x32
    if jnp.dtype(dtype) != jnp.bfloat16:
        return x32.astype(dtype).astype(jnp.float32)
    bits = lax.bitcast_convert_type(x32, jnp.uint32)
    bits = bits + (jnp.uint32(0x7FFF) + ((bits >> jnp.uint32(16)) & jnp.uint32(1)))
    return lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)


def _prologue_in_kernel(x, refs, token, spec):
    """`head_prologue_reference` on one token's heads (`[rows, d]` or `[d]`) inside a kernel, with the
    same rounding points (`_rounded`). `refs`/`spec` come from `_prologue_arrays`."""
    eps, has_rope, has_ssmax = spec
    weight_ref, *position_refs = refs
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    x32 = _rounded(weight_ref[...].astype(jnp.float32) * normed, dtype)
    if has_rope:
        cos_ref, sin_ref, *position_refs = position_refs
        x32 = _rounded(x32 * cos_ref[token] + _rotate_half(x32) * sin_ref[token], dtype)
    if has_ssmax:
        (scale_ref,) = position_refs
        x32 = _rounded(x32 * scale_ref[token], dtype)
    return x32.astype(dtype)


def _rotate_half(x):
    """`concat(-x[..., half:], x[..., :half])` from the ops Triton lowers: an even split of the lanes,
    and a join as stack + transpose + reshape (it has no lane slicing and no general concatenate)."""
    low, high = jnp.split(x, 2, axis=-1)
    joined = jnp.stack([-high, low], axis=-1)  # [..., half, 2]
    joined = jnp.swapaxes(joined, -1, -2)  # [..., 2, half]
    return joined.reshape(x.shape)


def _write_kv_kernel(
    slot_ref,  # [tokens] int32
    k_ref,  # [tokens, kv_heads, d]: raw projections when there is a prologue
    v_ref,  # [tokens, kv_heads, d]
    k_pages_in_ref,  # aliased with k_pages_ref
    v_pages_in_ref,  # aliased with v_pages_ref
    *refs,  # the key prologue's arrays; with a query prologue the raw queries and its arrays; then the
    # outputs k_pages_ref, v_pages_ref (and the prologued queries)
    page_size: int,
    prologue_spec: tuple,
    query_spec: tuple,
    group: int,
):
    del k_pages_in_ref, v_pages_in_ref
    token, kv_head = pl.program_id(0), pl.program_id(1)
    head_dim = k_ref.shape[-1]
    key_count = _prologue_count(prologue_spec)
    key_refs, refs = refs[:key_count], refs[key_count:]
    if query_spec:
        q_ref, *refs = refs
        query_refs, (k_pages_ref, v_pages_ref, q_out_ref) = refs[:-3], refs[-3:]
        # This kv head's `group` query heads, as rows padded to a power of two (masked).
        rows = 1 << (group - 1).bit_length()
        heads = pl.ds(kv_head * group, rows)
        head_rows = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) < group
        q = pltriton.load(q_ref.at[token, heads, :], mask=head_rows, other=0)
        pltriton.store(q_out_ref.at[token, heads, :], _prologue_in_kernel(q, query_refs, token, query_spec),
                       mask=head_rows)
    else:
        k_pages_ref, v_pages_ref = refs
    slot = slot_ref[token]
    live = jnp.broadcast_to(slot >= 0, (head_dim,))  # padding (slot -1) writes nothing
    slot = jnp.maximum(slot, 0)
    page, offset = slot // page_size, slot % page_size
    k = k_ref[token, kv_head, :]
    if prologue_spec:
        k = _prologue_in_kernel(k, key_refs, token, prologue_spec)
    pltriton.store(k_pages_ref.at[page, offset, kv_head, :], k.astype(k_pages_ref.dtype), mask=live)
    v = v_ref[token, kv_head, :]
    pltriton.store(v_pages_ref.at[page, offset, kv_head, :], v.astype(v_pages_ref.dtype), mask=live)


def write_kv_kernel(
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    new_k: Float[Array, "tokens kv_heads d"],
    new_v: Float[Array, "tokens kv_heads d"],
    slot_mapping: Int[Array, " tokens"],
    *,
    key_prologue: HeadPrologue | None = None,
    queries: Float[Array, "tokens heads d"] | None = None,
    query_prologue: HeadPrologue | None = None,
    interpret: bool = False,
):
    """`write_kv` as one Pallas call, grid (token, kv head): the key prologue (norm, RoPE) on the raw
    k, then both rows stored in place (the page arrays are aliased to the outputs). Replaces XLA's
    norm, rotation and two scatters: at batch 1 each launch costs more than its work.

    With `queries` and `query_prologue`, each program also applies the query prologue to its kv head's
    query heads, and the call returns (k_pages, v_pages, prologued queries): for a decode kernel that
    takes finished queries (the Mosaic split kernel), a launch less than a separate prologue."""
    _, page_size, kv_heads, head_dim = k_pages.shape
    tokens = new_k.shape[0]
    prologue, prologue_specs, prologue_spec = _prologue_arrays(key_prologue, head_dim)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, h, rank=a.ndim: (0,) * rank)
    query_inputs, query_specs, query_spec, query_out = [], [], (), []
    if queries is not None:
        if query_prologue is None or queries.shape[0] != tokens or queries.shape[1] % kv_heads:
            raise ValueError(f"queries {queries.shape} need a query prologue, {tokens} tokens and whole groups "
                             f"of {kv_heads} kv heads")
        arrays, specs, query_spec = _prologue_arrays(query_prologue, head_dim)
        query_inputs, query_specs = [queries, *arrays], [whole(queries), *specs]
        query_out = [jax.ShapeDtypeStruct(queries.shape, queries.dtype)]
    kernel = functools.partial(_write_kv_kernel, page_size=page_size, prologue_spec=prologue_spec,
                               query_spec=query_spec, group=1 if queries is None else queries.shape[1] // kv_heads)
    out = pl.pallas_call(
        kernel,
        grid=(tokens, kv_heads),
        in_specs=[whole(slot_mapping), whole(new_k), whole(new_v), whole(k_pages), whole(v_pages), *prologue_specs,
                  *query_specs],
        out_specs=[whole(k_pages), whole(v_pages), *[whole(q) for q in query_out]],
        out_shape=[jax.ShapeDtypeStruct(pages.shape, pages.dtype) for pages in (k_pages, v_pages)] + query_out,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=_triton_params(1, 1),
        interpret=interpret,
        name=("write_kv_norm_rope" if prologue_spec else "write_kv") + ("_queries" if query_spec else ""),
    )(slot_mapping.astype(jnp.int32), new_k, new_v, k_pages, v_pages, *prologue, *query_inputs)
    return tuple(out)


def write_kv_before_decode(
    k_pages, v_pages, new_k, new_v, slot_mapping, queries, *, key_prologue: HeadPrologue,
    query_prologue: HeadPrologue, blocks: DecodeBlocks, interpret: bool = False,
):
    """The fused layer's page write ahead of its decode attention on `blocks`, by the write kernel: the
    Mosaic split kernel takes finished queries, so for it the write kernel also applies the query
    prologue (a launch less than a separate prologue); the Triton split kernel applies it itself.
    Returns (k_pages, v_pages, queries, the query prologue the attention still applies: None or
    `query_prologue`)."""
    if blocks.mosaic_split:
        k_pages, v_pages, queries = write_kv_kernel(k_pages, v_pages, new_k, new_v, slot_mapping,
                                                    key_prologue=key_prologue, queries=queries,
                                                    query_prologue=query_prologue, interpret=interpret)
        return k_pages, v_pages, queries, None
    k_pages, v_pages = write_kv_kernel(k_pages, v_pages, new_k, new_v, slot_mapping, key_prologue=key_prologue,
                                       interpret=interpret)
    return k_pages, v_pages, queries, query_prologue


# --------------------------------------------------------------------------------------------------
# Token metadata shared by the reference and the kernel wrapper
# --------------------------------------------------------------------------------------------------


def _token_sequence_and_position(query_start, seq_lens, total_tokens: int):
    """For each flat query token: its sequence, its absolute position, and whether it is a real token."""
    batch = seq_lens.shape[0]
    tokens = jnp.arange(total_tokens, dtype=jnp.int32)
    # side="right" maps a token to the last sequence starting at or before it, which skips empty ones.
    sequence = jnp.searchsorted(query_start, tokens, side="right").astype(jnp.int32) - 1
    valid = tokens < query_start[batch]
    sequence = jnp.clip(sequence, 0, batch - 1)
    q_len = query_start[sequence + 1] - query_start[sequence]
    position = seq_lens[sequence] - q_len + (tokens - query_start[sequence])
    return sequence, position, valid


# --------------------------------------------------------------------------------------------------
# Plain-jnp reference
# --------------------------------------------------------------------------------------------------


def ragged_paged_attention_reference(
    queries: Float[Array, "tokens heads d"],
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    query_start: Int[Array, " batch_plus_1"],
    seq_lens: Int[Array, " batch"],
    page_table: Int[Array, "batch max_pages"],
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
) -> Float[Array, "tokens heads d"]:
    """Plain jnp: each query token gathers its sequence's pages through the page table (all
    `max_pages` of them, a static shape) and attends with the module's rounding points.

    Memory is O(tokens * max_pages * page_size * kv_heads * d): a reference, not a serving path."""
    tokens, heads, head_dim = queries.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = heads // kv_heads
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale

    sequence, q_pos, valid = _token_sequence_and_position(query_start, seq_lens, tokens)
    token_pages = page_table[sequence]  # [tokens, max_pages]
    gathered = jnp.maximum(token_pages, 0)  # -1 gathers page 0; masked below
    span = max_pages * page_size
    keys = k_pages[gathered].reshape(tokens, span, kv_heads, head_dim)
    values = v_pages[gathered].reshape(tokens, span, kv_heads, head_dim)

    k_pos = jnp.arange(span, dtype=jnp.int32)
    mapped = jnp.repeat(token_pages >= 0, page_size, axis=1)  # [tokens, span]
    distance = q_pos[:, None] - k_pos[None, :]
    visible = (distance >= 0) & mapped & valid[:, None]
    if window is not None:
        visible &= distance < window

    q = queries.reshape(tokens, kv_heads, group, head_dim)
    precision = _precision(q.dtype)
    scores = jnp.einsum("thgd,tkhd->thgk", q, keys, precision=precision, preferred_element_type=jnp.float32)
    scores = (scores.astype(q.dtype).astype(jnp.float32) * scale).astype(q.dtype).astype(jnp.float32)
    mask = visible[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(-1, keepdims=True), probs, 0.0).astype(v_pages.dtype)
    out = jnp.einsum("thgk,tkhd->thgd", probs, values, precision=precision, preferred_element_type=jnp.float32)
    return out.reshape(tokens, heads, head_dim).astype(v_pages.dtype)


# --------------------------------------------------------------------------------------------------
# Blocked jnp: the reference's math without materializing every token's whole span
# --------------------------------------------------------------------------------------------------


def ragged_paged_attention_blocked(
    queries: Float[Array, "tokens heads d"],
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    query_start: Int[Array, " batch_plus_1"],
    seq_lens: Int[Array, " batch"],
    page_table: Int[Array, "batch max_pages"],
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    block_q: int = 256,
    block_pages: int = 32,
    skip_decodes: bool = False,
) -> Float[Array, "tokens heads d"]:
    """Plain jnp with the reference's rounding points, for long contexts: the reference gathers all
    `max_pages` pages for every token (a 4,096-token chunk over a 70K-token table is 68 GiB of fp32 keys and values).

    Query blocks of up to `block_q` tokens of one sequence (split as the kernel splits them) run one
    after another (`lax.map`); each visits only the pages from its first query's window start to its
    last query, `block_pages` pages per step, so a sliding layer's cost does not grow with the
    context. The softmax is taken in two passes (row max and sum, then the probabilities normalized
    and rounded to v.dtype, where the reference rounds them, times V); with fp32 pages that rounding
    is exact and one online pass gives the same rounding points. Either way it equals the reference
    up to fp32 summation order. Memory: O(block_q * heads * block_pages * page_size) per step.
    `skip_decodes`: sequences with q_len == 1 get no block and zeros (the decode kernel serves them)."""
    tokens, heads, head_dim = queries.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    block_q = max(1, min(block_q, tokens))
    rows, span = block_q * group, block_pages * page_size
    precision = _precision(queries.dtype)
    one_pass = jnp.dtype(v_pages.dtype) == jnp.float32

    num_blocks, block_sequence, block_meta, blocks_start = _query_blocks(
        query_start, seq_lens, tokens, block_q, skip_decodes
    )
    token_of_row = query_start[block_sequence][:, None] + block_meta[:, 2:3] + jnp.arange(block_q)[None, :]
    # [blocks, kv_heads, block_q * group, d]: one batched matmul per kv head, rows query-major.
    q_blocks = queries[jnp.minimum(token_of_row, tokens - 1)].reshape(num_blocks, block_q, kv_heads, group, head_dim)
    q_blocks = q_blocks.transpose(0, 2, 1, 3, 4).reshape(num_blocks, kv_heads, rows, head_dim)
    # Padded by a step's pages so that a dynamic slice never runs off the end (and gets clamped).
    page_rows = jnp.pad(page_table, ((0, 0), (0, block_pages)), constant_values=-1)[block_sequence]

    def attend_block(args):
        q, meta, page_row = args
        seq_len, q_len, block_start, valid_rows = meta[0], meta[1], meta[2], meta[3]
        row_query = jnp.arange(rows, dtype=jnp.int32) // group
        q_pos = seq_len - q_len + block_start + row_query
        row_valid = row_query < valid_rows
        first_q_pos = seq_len - q_len + block_start
        first_key = 0 if window is None else jnp.maximum(first_q_pos - window + 1, 0)
        first_page = first_key // page_size
        end_page = jnp.where(valid_rows > 0, (first_q_pos + valid_rows - 1) // page_size + 1, first_page)
        num_steps = (end_page - first_page + block_pages - 1) // block_pages

        def scores_and_values(step):
            start = first_page + step * block_pages
            pages = lax.dynamic_slice(page_row, (start,), (block_pages,))
            # The last step may reach past the block's last query, and -1 entries gather page 0: such
            # keys are masked, and their values zeroed so that garbage there (even NaN) cannot leak.
            live = jnp.repeat((pages >= 0) & (start + jnp.arange(block_pages) < end_page), page_size)
            gathered = jnp.maximum(pages, 0)
            k = k_pages[gathered].reshape(span, kv_heads, head_dim).transpose(1, 0, 2)
            v = v_pages[gathered].reshape(span, kv_heads, head_dim)
            v = jnp.where(live[:, None, None], v, 0).transpose(1, 0, 2)
            scores = jnp.einsum("hrd,hkd->hrk", q, k, precision=precision, preferred_element_type=jnp.float32)
            scores = (scores.astype(q.dtype).astype(jnp.float32) * scale).astype(q.dtype).astype(jnp.float32)
            distance = q_pos[:, None] - (start * page_size + jnp.arange(span, dtype=jnp.int32))[None, :]
            visible = (distance >= 0) & live[None, :] & row_valid[:, None]
            if window is not None:
                visible &= distance < window
            return jnp.where(visible[None], scores, -jnp.inf), v

        def times_v(probs, v):
            return jnp.einsum("hrk,hkd->hrd", probs, v, precision=precision, preferred_element_type=jnp.float32)

        def online(step, carry):  # running max and sum; with one_pass also the running P.V
            acc, m_prev, l_prev = carry
            scores, v = scores_and_values(step)
            m_next = jnp.maximum(m_prev, scores.max(axis=-1))
            correction = jnp.exp(m_prev - m_next)
            probs = jnp.exp(scores - m_next[..., None])  # masked keys: exp(-inf) = 0
            if one_pass:
                acc = correction[..., None] * acc + times_v(probs, v)
            return acc, m_next, correction * l_prev + probs.sum(axis=-1)

        acc = jnp.zeros((kv_heads, rows, head_dim), jnp.float32)
        m = jnp.full((kv_heads, rows), _M_INIT, jnp.float32)
        acc, m, l = lax.fori_loop(0, num_steps, online, (acc, m, jnp.zeros_like(m)))
        total = jnp.where(l > 0, l, 1.0)[..., None]  # a query with no visible key gets zeros
        if one_pass:
            return (acc / total).astype(v_pages.dtype)

        def accumulate(step, acc):
            scores, v = scores_and_values(step)
            return acc + times_v((jnp.exp(scores - m[..., None]) / total).astype(v.dtype), v)

        return lax.fori_loop(0, num_steps, accumulate, acc).astype(v_pages.dtype)

    out = lax.map(attend_block, (q_blocks, block_meta, page_rows))  # [blocks, kv_heads, rows, d]
    sequence, _, valid = _token_sequence_and_position(query_start, seq_lens, tokens)
    if skip_decodes:
        valid &= query_start[sequence + 1] - query_start[sequence] != 1
    local = jnp.arange(tokens, dtype=jnp.int32) - query_start[sequence]
    block = jnp.where(valid, blocks_start[sequence] + local // block_q, 0)
    out = out.reshape(num_blocks, kv_heads, block_q, group, head_dim)[block, :, local % block_q]
    out = jnp.where(valid[:, None, None, None], out, 0)
    return out.reshape(tokens, heads, head_dim)


# --------------------------------------------------------------------------------------------------
# Pallas kernel (Triton backend style; tested in interpret mode on CPU)
# --------------------------------------------------------------------------------------------------

# Finite start for the running max: a row whose keys are all masked keeps m = _M_INIT, so the
# correction exp(m_prev - m_next) stays 1 instead of exp(-inf + inf) = NaN.
_M_INIT = -1e30


def _ragged_paged_attention_kernel(
    # inputs
    block_meta_ref,  # [4] int32: seq_len, q_len, first query row of this block within the sequence, valid rows
    page_row_ref,  # [max_pages] int32: this block's sequence's page table row
    q_ref,  # [block_q * group, head_dim]: rows are (query, head of the group), query-major
    k_pages_ref,  # [num_pages, page_size, head_dim] for this kv head
    v_pages_ref,  # [num_pages, page_size, head_dim] for this kv head
    # outputs
    o_ref,  # [block_q * group, head_dim]
    *,
    group: int,
    window: int | None,
    softmax_scale: float,
):
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    seq_len, q_len = block_meta_ref[0], block_meta_ref[1]
    block_start, valid_rows = block_meta_ref[2], block_meta_ref[3]

    q = q_ref[...]
    row_query = lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // group
    q_pos = seq_len - q_len + block_start + row_query  # [rows, page_size]
    row_valid = row_query < valid_rows
    key_offset = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)

    # Pages this block can see: from the window start of its first query to its last query.
    first_q_pos = seq_len - q_len + block_start
    last_q_pos = first_q_pos + valid_rows - 1
    first_key = 0 if window is None else jnp.maximum(first_q_pos - window + 1, 0)
    first_page = first_key // page_size
    end_page = jnp.where(valid_rows > 0, last_q_pos // page_size + 1, first_page)

    def body(page, carry):
        acc, m_prev, l_prev = carry
        physical = page_row_ref[page]
        # A released page (-1) inside the range (a hole) is read from page 0 and fully masked.
        k = k_pages_ref[jnp.maximum(physical, 0)]  # [page_size, head_dim]
        v = v_pages_ref[jnp.maximum(physical, 0)]
        # Rounding points of the reference: fp32 dot -> q.dtype -> * scale -> q.dtype -> fp32.
        scores = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype), preferred_element_type=jnp.float32
        )
        scores = (scores.astype(q.dtype).astype(jnp.float32) * softmax_scale).astype(q.dtype).astype(jnp.float32)
        k_pos = page * page_size + key_offset
        visible = (k_pos <= q_pos) & row_valid & (physical >= 0)
        if window is not None:
            visible &= q_pos - k_pos < window
        scores = jnp.where(visible, scores, -jnp.inf)

        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.exp(scores - m_next[:, None])  # masked keys: exp(-inf) = 0
        l_next = correction * l_prev + probs.sum(axis=-1)
        # Unnormalized probabilities are rounded to v.dtype here (the reference rounds normalized
        # ones): identical in fp32, within bf16 rounding otherwise.
        pv = lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            precision=_precision(v.dtype), preferred_element_type=jnp.float32,
        )
        return correction[:, None] * acc + pv, m_next, l_next

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _M_INIT, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = lax.fori_loop(first_page, end_page, body, (acc, m, l))
    # A query with no visible key gets zeros, as in the reference.
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _query_blocks(query_start, seq_lens, total_tokens: int, block_q: int, skip_decodes: bool = False):
    """Splits each sequence's query tokens into blocks of `block_q` rows (a block never straddles two
    sequences). The number of blocks is static: cdiv(total_tokens, block_q) + batch bounds it.
    `skip_decodes`: sequences with q_len == 1 get no block (the decode kernel serves them)."""
    batch = seq_lens.shape[0]
    num_blocks = pl.cdiv(total_tokens, block_q) + batch
    q_lens = query_start[1:] - query_start[:-1]
    if skip_decodes:
        q_lens = jnp.where(q_lens == 1, 0, q_lens)
    blocks_per_seq = (q_lens + block_q - 1) // block_q
    blocks_end = jnp.cumsum(blocks_per_seq)
    blocks_start = blocks_end - blocks_per_seq
    block = jnp.arange(num_blocks, dtype=jnp.int32)
    sequence = jnp.searchsorted(blocks_end, block, side="right").astype(jnp.int32)
    used = sequence < batch
    sequence = jnp.minimum(sequence, batch - 1)
    block_start = (block - blocks_start[sequence]) * block_q  # first query row within the sequence
    valid_rows = jnp.where(used, jnp.clip(q_lens[sequence] - block_start, 0, block_q), 0)
    meta = jnp.stack([seq_lens[sequence], q_lens[sequence], block_start, valid_rows], axis=1).astype(jnp.int32)
    return num_blocks, sequence, meta, blocks_start


def ragged_paged_attention_kernel(
    queries: Float[Array, "tokens heads d"],
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    query_start: Int[Array, " batch_plus_1"],
    seq_lens: Int[Array, " batch"],
    page_table: Int[Array, "batch max_pages"],
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    block_q: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    skip_decodes: bool = False,
) -> Float[Array, "tokens heads d"]:
    """Pallas kernel, grid (query block, kv head). Each query block holds up to `block_q` tokens of ONE
    sequence times the kv head's `group` query heads (padded to a power of two), and runs an online
    softmax over that sequence's pages, one page (block_k = page_size) per step, visiting only pages
    between its first query's window start and its last query: pages out of the window are never read.

    Tested in interpret mode on CPU (tests/pallas_kernels); also compiled through Triton on one H200
    and matched the reference on four mixed batches (bf16 and fp32, GQA 1/6/8, page sizes 16/64,
    windows 17/64/512, a 4000-token context). Decodes are better served by the split decode kernel
    (`paged_decode_attention_kernel`; the op sends them there); `skip_decodes` gives them no block here.
    Triton needs block_q * padded_group >= 16 rows and power-of-two page_size and head_dim."""
    tokens, heads, head_dim = queries.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = heads // kv_heads
    padded_group = 1 << (group - 1).bit_length()  # Triton wants power-of-two block rows
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    max_pages = page_table.shape[1]

    num_blocks, block_sequence, block_meta, blocks_start = _query_blocks(
        query_start, seq_lens, tokens, block_q, skip_decodes
    )
    # Gather queries into [block, kv_head, block_q * padded_group, d]; rows past a sequence's end are
    # clamped reads, masked in the kernel and dropped below.
    token_of_row = query_start[block_sequence][:, None] + block_meta[:, 2:3] + jnp.arange(block_q)[None, :]
    q = queries.reshape(tokens, kv_heads, group, head_dim)
    if padded_group != group:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))
    q = q[jnp.minimum(token_of_row, tokens - 1)]  # [blocks, block_q, kv_heads, padded_group, d]
    q = q.transpose(0, 2, 1, 3, 4).reshape(num_blocks, kv_heads, block_q * padded_group, head_dim)
    rows = block_q * padded_group

    kernel = functools.partial(_ragged_paged_attention_kernel, group=padded_group, window=window, softmax_scale=scale)
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, kv_heads),
        in_specs=[
            pl.BlockSpec((None, 4), lambda i, h: (i, 0)),  # block metadata
            pl.BlockSpec((None, max_pages), lambda i, h: (i, 0)),  # the block's page table row
            pl.BlockSpec((None, None, rows, head_dim), lambda i, h: (i, h, 0, 0)),  # queries
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda i, h: (0, 0, h, 0)),  # k_pages
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda i, h: (0, 0, h, 0)),  # v_pages
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_blocks, kv_heads, rows, head_dim), v_pages.dtype),
        compiler_params=_triton_params(num_warps, num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{block_q=}",
    )(block_meta, page_table[block_sequence], q, k_pages, v_pages)

    # Back to the flat token axis: token t sits in block blocks_start[seq] + local // block_q.
    sequence, _, valid = _token_sequence_and_position(query_start, seq_lens, tokens)
    local = jnp.arange(tokens, dtype=jnp.int32) - query_start[sequence]
    block = jnp.where(valid, blocks_start[sequence] + local // block_q, 0)
    out = out.reshape(num_blocks, kv_heads, block_q, padded_group, head_dim)[block, :, local % block_q, :group]
    out = jnp.where(valid[:, None, None, None], out, 0)
    return out.reshape(tokens, heads, head_dim)


def _triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# --------------------------------------------------------------------------------------------------
# Decode kernels: one query token per sequence, split over the context (flash-decoding)
# --------------------------------------------------------------------------------------------------
#
# Why a second kernel: the general kernel gives each (query block, kv head) ONE program that walks
# every page, so a batch-1 decode at TP8 (one KV head) is one thread block for the whole context
# (3.2 ms at 128K against a 16 us floor, benchmarks/attention/RESULTS.md). Here each (sequence,
# kv head) gets `num_splits` programs, each walking its own range of the sequence's visible pages
# `pages_per_step` pages at a time, writing a partial (unnormalized output, running max, running
# sum); a second kernel combines the partials and writes each decode token's row. All `group` query
# heads of a kv head are the rows of one program (padded to 16, Triton's smallest dot), so every
# K/V page is read once. The page range is computed in the kernel from seq_lens: with a window only
# the pages holding in-window keys are visited, so a sliding layer's cost is flat in the context.
# The per-step metadata (`DecodeMetadata`) depends only on query_start, so all layers of a step
# share it: build it once per step and pass it to every layer's call.
#
# Keys that are not visible (past the query, out of the window, on a released page or past the
# split's end) are never read: K and V are loaded with masks (V's masked lanes come back as zeros,
# so 0 * NaN cannot poison the output; K's scores are masked to -inf). The partials keep only the
# `group` real rows, so the combine reads 6/16 of what a padded layout would hold at Beam's GQA 6.

# Triton's dot needs M >= 16: a kv head's query heads are padded to this many rows.
_DECODE_MIN_ROWS = 16


@functools.partial(jax.tree_util.register_dataclass, data_fields=("row_token", "token_row"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """Which flat tokens are decodes. Depends only on `query_start`, so one step builds it once and
    every layer (of every cache group) reuses it."""

    row_token: Int[Array, " batch"]  # sequence b's decode token (q_len == 1), or -1: b has no decode
    token_row: Int[Array, " tokens"]  # token t's sequence if t is a decode token, else -1


def decode_metadata(query_start: Int[Array, " batch_plus_1"], num_tokens: int) -> DecodeMetadata:
    q_lens = query_start[1:] - query_start[:-1]
    batch = q_lens.shape[0]
    is_decode = q_lens == 1
    row_token = jnp.where(is_decode, query_start[:-1], -1).astype(jnp.int32)
    # Sequences without a decode scatter to index num_tokens, which mode="drop" discards.
    token_row = jnp.full((num_tokens,), -1, jnp.int32).at[jnp.where(is_decode, query_start[:-1], num_tokens)].set(
        jnp.arange(batch, dtype=jnp.int32), mode="drop"
    )
    return DecodeMetadata(row_token=row_token, token_row=token_row)


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Static block sizes of the decode kernels (chosen per shape by `decode_blocks`)."""

    pages_per_step: int  # pages gathered per loop iteration of the split kernel (power of two)
    num_splits: int  # split-kernel programs per (sequence, kv head) (power of two)
    num_warps: int = 4  # split kernel
    num_stages: int = 2  # split kernel (Triton's software pipelining depth)
    combine_block_d: int | None = None  # head_dim lanes per combine program; None: by the token count
    combine_num_warps: int = 4  # combine kernel
    # The split kernel in Mosaic GPU (`decode_attention_mgpu`, Hopper, bf16; it takes finished queries, so
    # a query prologue runs before it), `num_stages` pages ahead by TMA; `pages_per_step` and `num_warps`
    # do not apply.
    mosaic_split: bool = False
    # The Mosaic split kernel starts as a dependent of the kernel ahead of it (programmatic dependent launch:
    # `decode_attention_mgpu.split_decode(dependent_launch=)`), for a call right after the K/V write kernel.
    mosaic_dependent_launch: bool = False


# The H200 has 132 SMs.
DECODE_NUM_SMS = 132
# Tuned on one H200 at head_dim 128, pages of 64, bf16 (benchmarks/attention/RESULTS.md, runs 4 and 5:
# device time, cold L2). Against the alternatives swept there:
#   - one stage: Triton's software pipelining (num_stages 2 or 3) made the split kernel 40-50% slower
#     (probably its shared-memory buffers leaving fewer programs per SM; the masked loads also
#     pipeline worse than the previous kernel's plain gathers did);
#   - 2 pages (128 keys) per step: 1 page was 17-26% slower at batch >= 8, 4 pages 21-23% slower;
#   - 2 programs per SM: 4 were 1-17% slower, 1 27-42% slower;
#   - 4 warps (8 were slower; 2 were only tried with two stages);
#   - no minimum of steps per split (DECODE_MIN_STEPS_PER_SPLIT = 1).
# When the whole step has no more loop steps than there are SMs (batch 1 at <= 16K, sliding windows
# at small batch), it is latency-bound: one page per step and per split was 13-17% faster.
# Two launches (split kernel, then combine kernel): a one-launch variant, whose last split program per
# (sequence, kv head) merged the partials after an atomic counter, was slower at every shape (run 6:
# its split kernel slower, plus a zeros kernel for the counters) and was removed.
DECODE_PAGES_PER_STEP = 2
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 1
DECODE_PROGRAMS_PER_SM = 2
DECODE_MIN_STEPS_PER_SPLIT = 1
# The Mosaic GPU split kernel (`decode_attention_mgpu`), on Hopper, wherever it fits. Against the Triton kernel
# (H200, session 36 runs 1-2 of benchmarks/attention/RESULTS.md, two stages, the same splits; split + combine):
# 13.0-13.2 against 15.8-16.0 us at 8K x 8, 20.4-20.7 against 27.0-27.2 at 128K x 1, 35.0-35.2 against 48.1-48.7
# at 8K x 32, 244-247 against 340-342 at 8K x 32 with 48/8 heads, at 32K x 1 (two pages a split) 9.2-9.6 against
# 10.4-10.6, at 8K x 1 (one page a split) 6.0 against 6.1, and sliding (window 512) 4.3 against 5.0 at 8K x 1 and
# 5.2 against 5.8 at 8K x 8. Three stages lost (16.2 us at 8K x 8: one program an SM).
DECODE_MOSAIC_SPLIT = True
DECODE_MOSAIC_STAGES = 2
# The model's Mosaic split kernel as a dependent launch of the K/V write kernel before it (its length and page-id
# loads overlapping that kernel's end). Off until timed on a GPU (session 37 built it without one).
DECODE_MOSAIC_DEPENDENT_LAUNCH = False


def _visible_pages(max_pages: int, page_size: int, window: int | None) -> int:
    """The most pages a decode sees: all of `max_pages`, or with a window cdiv(window - 1, page_size) + 1."""
    return max_pages if window is None else min(max_pages, -(-(window - 1) // page_size) + 1)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def decode_blocks(
    batch: int, kv_heads: int, max_pages: int, page_size: int, window: int | None, *,
    pages_per_step: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, programs_per_sm: int | None = None, min_steps_per_split: int | None = None,
    num_sms: int = DECODE_NUM_SMS, mosaic_split: bool = False,
) -> DecodeBlocks:
    """The decode kernels' block sizes for a step's static shape; any argument given overrides the
    tuned value. The context is split until batch * kv_heads * num_splits programs reach
    `programs_per_sm` per SM, but a split never gets fewer than `min_steps_per_split` steps of a
    sequence's visible pages (all of `max_pages`, or with a window at most
    cdiv(window - 1, page_size) + 1 whatever the context, so a sliding layer's blocks are flat).
    A latency-bound step (fewer loop steps in all than SMs) gets one page per split instead.
    `mosaic_split`: blocks of the Mosaic GPU split kernel (`DECODE_MOSAIC_STAGES` stages by default)."""
    visible_pages = _visible_pages(max_pages, page_size, window)
    if pages_per_step is None and num_splits is None and page_size >= 64:
        steps = batch * kv_heads * -(-visible_pages // DECODE_PAGES_PER_STEP)
        if steps <= num_sms:
            pages_per_step, num_splits = 1, 1 << (visible_pages - 1).bit_length()
    if pages_per_step is None:
        # Pages of fewer than 64 keys: keep about 64 keys per step.
        pages_per_step = max(1, DECODE_PAGES_PER_STEP * 64 // page_size) if page_size < 64 else DECODE_PAGES_PER_STEP
    programs_per_sm = DECODE_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    min_steps_per_split = DECODE_MIN_STEPS_PER_SPLIT if min_steps_per_split is None else min_steps_per_split
    if num_splits is None:
        steps = -(-visible_pages // pages_per_step)
        wanted = -(-(programs_per_sm * num_sms) // (batch * kv_heads))
        num_splits = max(1, min(_pow2_floor(wanted), _pow2_floor(steps // max(min_steps_per_split, 1))))
    for name, value in (("num_splits", num_splits), ("pages_per_step", pages_per_step)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} {value} must be a power of two")
    if num_stages is None:
        num_stages = DECODE_MOSAIC_STAGES if mosaic_split else DECODE_NUM_STAGES
    return DecodeBlocks(pages_per_step, num_splits, DECODE_NUM_WARPS if num_warps is None else num_warps, num_stages,
                        mosaic_split=mosaic_split)


def _decode_split_kernel(
    # inputs
    row_token_ref,  # [batch] int32
    seq_lens_ref,  # [batch] int32
    page_row_ref,  # [max_pages] int32: this sequence's page table row
    q_ref,  # [tokens, heads, head_dim]: all queries (raw projections when there is a prologue)
    k_pages_ref,  # [num_pages, page_size, head_dim] for this kv head
    v_pages_ref,  # [num_pages, page_size, head_dim] for this kv head
    *refs,  # the query prologue's arrays (`_prologue_arrays`), then the outputs (whole arrays):
    # o_ref [batch, kv_heads, splits, group, head_dim] fp32: unnormalized partial outputs
    # m_ref [batch, kv_heads, splits, group] fp32: running maxima
    # l_ref [batch, kv_heads, splits, group] fp32: running sums
    window: int | None,
    softmax_scale: float,
    pages_per_step: int,
    num_splits: int,
    group: int,
    rows: int,
    prologue_spec: tuple,
):
    *prologue_refs, o_ref, m_ref, l_ref = refs
    sequence, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    page_size = k_pages_ref.shape[1]
    max_pages = page_row_ref.shape[0]
    keys = pages_per_step * page_size

    token = row_token_ref[jnp.asarray(sequence)]
    seq_len = jnp.where(token >= 0, seq_lens_ref[jnp.asarray(sequence)], 0)  # no decode: nothing to visit
    q_pos = seq_len - 1
    first_page = 0 if window is None else jnp.maximum(q_pos - window + 1, 0) // page_size
    end_page = jnp.maximum((seq_len + page_size - 1) // page_size, first_page)
    # This split's share, whole steps each: split s takes pages [lo, hi).
    per_split = (end_page - first_page + num_splits - 1) // num_splits
    per_split = (per_split + pages_per_step - 1) // pages_per_step * pages_per_step
    lo = jnp.minimum(first_page + split * per_split, end_page)
    hi = jnp.minimum(lo + per_split, end_page)
    num_steps = (hi - lo + pages_per_step - 1) // pages_per_step

    # This kv head's `group` query heads as the first of `rows` rows (Triton's dot wants >= 16), the
    # rest masked to zeros; then the layer's norm and RoPE / SSMax, if given.
    token = jnp.maximum(token, 0)
    head_rows = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) < group
    q = pltriton.load(q_ref.at[token, pl.ds(kv_head * group, rows), :], mask=head_rows, other=0)
    if prologue_spec:
        q = _prologue_in_kernel(q, prologue_refs, token, prologue_spec)
    tile = (pages_per_step, page_size, head_dim)

    def body(step, carry):
        acc, m_prev, l_prev = carry
        step_page = lax.broadcasted_iota(jnp.int32, (pages_per_step,), 0)
        page_key = lax.broadcasted_iota(jnp.int32, tile, 1)  # key within its page
        lane = lax.broadcasted_iota(jnp.int32, tile, 2)
        key_offset = lax.broadcasted_iota(jnp.int32, (keys,), 0)
        start = lo + step * pages_per_step
        logical = start + step_page
        physical = page_row_ref[jnp.minimum(logical, max_pages - 1)]
        # Pages past this split's end or released (-1) are not read (masked loads).
        page_live = (logical < hi) & (physical >= 0)
        page = jnp.broadcast_to(jnp.where(page_live, physical, 0)[:, None, None], tile)
        k_pos = start * page_size + key_offset
        visible = jnp.broadcast_to(page_live[:, None], (pages_per_step, page_size)).reshape(keys) & (k_pos <= q_pos)
        if window is not None:
            visible &= q_pos - k_pos < window
        k = pltriton.load(k_pages_ref.at[page, page_key, lane],
                          mask=jnp.broadcast_to(page_live[:, None, None], tile), other=0).reshape(keys, head_dim)
        v = pltriton.load(v_pages_ref.at[page, page_key, lane],
                          mask=jnp.broadcast_to(visible.reshape(tile[:2])[:, :, None], tile), other=0)
        v = v.reshape(keys, head_dim)
        # Rounding points of the reference: fp32 dot -> q.dtype -> * scale -> q.dtype -> fp32.
        scores = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype), preferred_element_type=jnp.float32
        )
        scores = (scores.astype(q.dtype).astype(jnp.float32) * softmax_scale).astype(q.dtype).astype(jnp.float32)
        scores = jnp.where(visible[None, :], scores, -jnp.inf)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.exp(scores - m_next[:, None])  # masked keys: exp(-inf) = 0
        pv = lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            precision=_precision(v.dtype), preferred_element_type=jnp.float32,
        )
        return correction[:, None] * acc + pv, m_next, correction * l_prev + probs.sum(axis=-1)

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _M_INIT, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = lax.fori_loop(0, num_steps, body, (acc, m, l))
    # Only the `group` real rows are stored.
    heads = pl.ds(0, rows)
    pltriton.store(o_ref.at[sequence, kv_head, split, heads, :], acc, mask=head_rows)
    real_rows = lax.broadcasted_iota(jnp.int32, (rows,), 0) < group
    pltriton.store(m_ref.at[sequence, kv_head, split, heads], m, mask=real_rows)
    pltriton.store(l_ref.at[sequence, kv_head, split, heads], l, mask=real_rows)


def _decode_combine_kernel(
    token_row_ref, o_ref, m_ref, l_ref, *refs, splits_per_step: int, group: int, block_d: int, attention_dtype,
    gated: bool,
):
    """One (token, query head, head_dim block): the weighted sum of its sequence's split partials
    ([batch, kv_heads, splits, group, ...], whole arrays), or zeros for a token that is not a decode,
    written to `out_ref[token, head, block]`. One query head per program, so that a batch-1 decode
    still spreads the partials over heads * head_dim / block_d programs. The partials are read
    `splits_per_step` splits at a time (all at once unless there are very many). `gated`: `refs`
    starts with the gate projection and bias, and the epilogue applies the output gate
    (`output_gate_reference`)."""
    *gate_refs, out_ref = refs
    token, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head, row_in_group = head // group, head % group
    batch, num_splits = m_ref.shape[0], m_ref.shape[2]
    lanes = pl.ds(block * block_d, block_d)

    def weighted_sum(source):  # sequence `source`'s partials: (unnormalized output lanes, softmax sum)
        # Empty splits have m = _M_INIT, l = 0, o = 0.
        m = m_ref[source, kv_head, :, row_in_group]  # [splits]
        l = l_ref[source, kv_head, :, row_in_group]
        if splits_per_step == num_splits:  # one chunk: o loads beside m and l, not after their reductions
            o = o_ref[source, kv_head, :, row_in_group, lanes]
            m_all = m.max()
            return (jnp.exp(m - m_all)[:, None] * o).sum(axis=0), (jnp.exp(m - m_all) * l).sum()
        m_all = m.max()

        def body(step, acc):
            chunk = pl.ds(step * splits_per_step, splits_per_step)
            weight = jnp.exp(m_ref[source, kv_head, chunk, row_in_group] - m_all)  # [splits_per_step]
            return acc + (weight[:, None] * o_ref[source, kv_head, chunk, row_in_group, lanes]).sum(axis=0)

        acc = lax.fori_loop(0, num_splits // splits_per_step, body, jnp.zeros((block_d,), jnp.float32))
        return acc, (jnp.exp(m - m_all) * l).sum()

    # In a step of decodes only (most steps) token t is sequence t: its partials are read while the
    # token's row loads, not after it (one dependent load less); any other token reads them again.
    row = token_row_ref[token]
    guess = jnp.minimum(token, batch - 1)
    acc, total = weighted_sum(guess)
    acc, total = lax.cond((row == guess) | (row < 0), lambda: (acc, total), lambda: weighted_sum(row))
    keep = (total > 0) & (row >= 0)  # a query with no visible key gets zeros
    out = jnp.where(keep, acc / jnp.where(total > 0, total, 1.0), 0.0)
    if gated:
        gate_ref, bias_ref = gate_refs
        gate_dtype = gate_ref.dtype
        out = _rounded(out, attention_dtype)  # where the unfused attention output is rounded
        gate = gate_ref[token, head, lanes].astype(jnp.float32) + bias_ref[head].astype(jnp.float32)
        out = out * _rounded(jax.nn.sigmoid(_rounded(gate, gate_dtype)), gate_dtype)
    out_ref[token, head, lanes] = out.astype(out_ref.dtype)


# The combine reads at most this many partial elements per loop step (fp32; 32 registers a thread
# at 4 warps) ...
_COMBINE_CHUNK_ELEMENTS = 4096
# ... and aims for this many programs: with few (token, head) pairs, head_dim is split too.
_COMBINE_TARGET_PROGRAMS = 256


def paged_decode_attention_kernel(
    queries: Float[Array, "tokens heads d"],
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    query_start: Int[Array, " batch_plus_1"],
    seq_lens: Int[Array, " batch"],
    page_table: Int[Array, "batch max_pages"],
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    metadata: DecodeMetadata | None = None,
    blocks: DecodeBlocks | None = None,
    query_prologue: HeadPrologue | None = None,
    output_gate: OutputGate | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "tokens heads d"], Int[Array, " tokens"]]:
    """Attention of every decode token (sequences with q_len == 1) in the step; other tokens get
    zeros. Returns (output, token_row): token_row[t] >= 0 marks the decode tokens. Pass `metadata`
    (from `decode_metadata`, once per step) to keep its few small ops out of every layer.

    Two Pallas calls: the split kernel, grid (sequence, kv head, split), then the combine, grid
    (token, query head, head_dim block). Triton needs power-of-two page_size and head_dim. The split
    kernel is Triton's, or with `blocks.mosaic_split` Mosaic GPU's (`decode_attention_mgpu`, Hopper);
    without `blocks`, `decode_blocks` picks (`use_mosaic_split`).

    Fused (the model's GPU path): with `query_prologue`, `queries` are the raw projections and the
    split kernel applies the norm and RoPE / SSMax to its query rows first; with `output_gate`, the
    combine gates its output, which then has the gate's dtype. Both round where the references do
    (`head_prologue_reference`, `output_gate_reference`)."""
    tokens, heads, head_dim = queries.shape
    _, page_size, kv_heads, _ = k_pages.shape
    batch, max_pages = page_table.shape
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    if metadata is None:
        metadata = decode_metadata(query_start, tokens)
    if blocks is None:
        blocks = default_decode_blocks(queries, k_pages, v_pages, batch, max_pages, window, interpret=interpret)
    splits = blocks.num_splits

    if blocks.mosaic_split:
        if query_prologue is not None:  # XLA, before the kernel (the model's cache has the write kernel do it)
            queries = head_prologue_reference(queries, query_prologue)
        o, m, l = decode_attention_mgpu.split_decode(
            queries, k_pages, v_pages, metadata.row_token, seq_lens, page_table, window=window, softmax_scale=scale,
            num_splits=splits, stages=blocks.num_stages, dependent_launch=blocks.mosaic_dependent_launch,
            interpret=interpret)
    else:
        o, m, l = _split_partials(queries, k_pages, v_pages, seq_lens, page_table, metadata, blocks, window, scale,
                                  query_prologue, interpret)
    out = _combine_partials(o, m, l, metadata, blocks, heads, v_pages.dtype, output_gate, interpret)
    return out, metadata.token_row


def default_decode_blocks(queries, k_pages, v_pages, batch: int, max_pages: int, window: int | None, *,
                          after_write: bool = False, interpret: bool = False) -> DecodeBlocks:
    """The blocks `paged_decode_attention_kernel` takes when given none (what the model runs) for `batch`
    sequences of page tables `max_pages` wide: the Triton kernel's `decode_blocks`, or the Mosaic GPU
    kernel's where `use_mosaic_split` says so. `after_write`: the call follows the K/V write kernel
    (`write_kv_before_decode`), which the Mosaic kernel may then start under (`DECODE_MOSAIC_DEPENDENT_LAUNCH`)."""
    _, page_size, kv_heads, _ = k_pages.shape
    mosaic = not interpret and use_mosaic_split(queries, k_pages, v_pages)
    blocks = decode_blocks(batch, kv_heads, max_pages, page_size, window, mosaic_split=mosaic)
    dependent = mosaic and after_write and DECODE_MOSAIC_DEPENDENT_LAUNCH
    return dataclasses.replace(blocks, mosaic_dependent_launch=dependent)


def use_mosaic_split(queries, k_pages, v_pages) -> bool:
    """Whether the step takes the Mosaic GPU split kernel instead of the Triton one (on the same splits):
    `DECODE_MOSAIC_SPLIT`, on a Hopper GPU, for shapes the kernel takes."""
    _, heads, head_dim = queries.shape
    _, page_size, kv_heads, _ = k_pages.shape
    return (DECODE_MOSAIC_SPLIT and is_hopper(jax.devices()[0]) and queries.dtype == k_pages.dtype == v_pages.dtype
            and decode_attention_mgpu.fits(heads, kv_heads, page_size, head_dim, queries.dtype))


def _whole_block(shape) -> pl.BlockSpec:
    """A block that is the whole array, the same for every program."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _split_partials(queries, k_pages, v_pages, seq_lens, page_table, metadata, blocks, window, scale, query_prologue,
                    interpret):
    """The Triton split kernel: partials `[batch, kv_heads, splits, group, ...]`."""
    tokens, heads, head_dim = queries.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    batch, max_pages = page_table.shape
    group = heads // kv_heads
    rows = max(_DECODE_MIN_ROWS, 1 << (group - 1).bit_length())
    splits = blocks.num_splits
    prologue, prologue_specs, prologue_spec = _prologue_arrays(query_prologue, head_dim)
    split_kernel = functools.partial(
        _decode_split_kernel, window=window, softmax_scale=scale,
        pages_per_step=blocks.pages_per_step, num_splits=splits, group=group, rows=rows, prologue_spec=prologue_spec,
    )
    partial_shape = (batch, kv_heads, splits, group)
    o, m, l = pl.pallas_call(
        split_kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[
            pl.BlockSpec((batch,), lambda b, h, s: (0,)),  # row_token
            pl.BlockSpec((batch,), lambda b, h, s: (0,)),  # seq_lens
            pl.BlockSpec((None, max_pages), lambda b, h, s: (b, 0)),  # the sequence's page table row
            pl.BlockSpec((tokens, heads, head_dim), lambda b, h, s: (0, 0, 0)),  # queries: rows picked in the kernel
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h, s: (0, 0, h, 0)),  # k_pages
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h, s: (0, 0, h, 0)),  # v_pages
            *prologue_specs,
        ],
        # Whole arrays: a program stores its `group` rows (masked) at (sequence, kv head, split).
        out_specs=[_whole_block((*partial_shape, head_dim)), *[_whole_block(partial_shape)] * 2],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        compiler_params=_triton_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name=f"paged_decode_split_{splits=}_pages_per_step={blocks.pages_per_step}",
    )(metadata.row_token, seq_lens, page_table, queries, k_pages, v_pages, *prologue)
    return o, m, l


def _combine_partials(o, m, l, metadata, blocks, heads, attention_dtype, output_gate, interpret):
    """The combine kernel over split partials `o [batch, kv_heads, splits, rows >= group, d]`, m and l:
    the attention output `[tokens, heads, d]` (gated with `output_gate`)."""
    tokens = metadata.token_row.shape[0]
    kv_heads, splits, head_dim = o.shape[1], o.shape[2], o.shape[4]
    group = heads // kv_heads
    # Few (token, head) pairs: split head_dim too, so that many SMs read the partials.
    block_d = blocks.combine_block_d
    if block_d is None:
        block_d = min(head_dim, max(8, _pow2_floor(head_dim * tokens * heads // _COMBINE_TARGET_PROGRAMS)))
    splits_per_step = min(splits, _pow2_floor(_COMBINE_CHUNK_ELEMENTS // block_d))
    combine = functools.partial(
        _decode_combine_kernel, splits_per_step=splits_per_step, group=group, block_d=block_d,
        attention_dtype=attention_dtype, gated=output_gate is not None,
    )
    gate, gate_specs = [], []
    if output_gate is not None:
        gate = [output_gate.gate, output_gate.bias]
        gate_specs = [_whole_block((tokens, heads, head_dim)), _whole_block((heads,))]
    out_dtype = attention_dtype if output_gate is None else output_gate.gate.dtype
    out = pl.pallas_call(
        combine,
        grid=(tokens, heads, head_dim // block_d),
        in_specs=[
            _whole_block((tokens,)),  # token_row
            _whole_block(o.shape),
            _whole_block(m.shape),
            _whole_block(l.shape),
            *gate_specs,
        ],
        # The whole output: a program writes its head's lanes.
        out_specs=_whole_block((tokens, heads, head_dim)),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, head_dim), out_dtype),
        compiler_params=_triton_params(blocks.combine_num_warps, 1),
        interpret=interpret,
        name=f"paged_decode_combine_{splits=}" + ("_gated" if output_gate is not None else ""),
    )(metadata.token_row, o, m, l, *gate)
    return out


# --------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------


# The reference gathers `tokens * max_pages * page_size * kv_heads * head_dim` key elements (and as
# many values); past this many (256 MiB of fp32 keys) the op runs the blocked form instead.
REFERENCE_MAX_GATHER = 2**26


def reference_gather_size(queries, k_pages, page_table) -> int:
    """Key elements the reference would gather for this step (static: from shapes only)."""
    _, page_size, kv_heads, head_dim = k_pages.shape
    return queries.shape[0] * page_table.shape[1] * page_size * kv_heads * head_dim


def ragged_paged_attention(
    queries: Float[Array, "tokens heads d"],
    k_pages: Float[Array, "pages page_size kv_heads d"],
    v_pages: Float[Array, "pages page_size kv_heads d"],
    query_start: Int[Array, " batch_plus_1"],
    seq_lens: Int[Array, " batch"],
    page_table: Int[Array, "batch max_pages"],
    *,
    window: int | None = None,
    softmax_scale: float | None = None,
    use_kernel: bool | Literal["decode"] = False,
    blocked: bool | None = None,
    block_q: int = 16,
    decode_only: bool = False,
    decode: DecodeMetadata | None = None,
    decode_block_sizes: DecodeBlocks | None = None,
    query_prologue: HeadPrologue | None = None,
    output_gate: OutputGate | None = None,
    interpret: bool = False,
) -> Float[Array, "tokens heads d"]:
    """Ragged paged attention (see the module docstring for the layout and rounding).

    `use_kernel` picks the path (static); `default_use_kernel()` is what the model runs:
      False     plain jnp for every token: the reference, or the blocked form when the reference's
                gather would exceed `REFERENCE_MAX_GATHER` elements (`blocked=None`; True / False
                forces it). Both have the same rounding points, so the choice, static per shape
                bucket, shows only as fp32 summation order.
      "decode"  decode tokens (sequences with q_len == 1) go to the split decode kernel, every other
                token to plain jnp as above; merged per token. The blocked form gives the decodes no
                block (they cost nothing there); the reference computes them too and drops them.
      True      decode tokens to the split decode kernel, the rest to the general Pallas kernel
                (whose blocks skip the decodes). `block_q` is the general kernel's.
    The kernels run through Triton on GPU, in interpret mode (`interpret=True`) on CPU.

    `decode_only=True` (static: the caller promises no sequence has q_len > 1) runs only the decode
    kernel, with either kernel mode. `decode` is the step's `decode_metadata`, shared by all layers
    (built here when None); `decode_block_sizes` overrides the decode kernel's block sizes.

    `query_prologue`: `queries` are the raw projections, normalized and rotated / scaled as it says
    before attention; `output_gate`: the output is gated. With a kernel mode the decode kernel fuses
    both (prologue in the split kernel, gate in the combine); other tokens and plain jnp take the
    references (`head_prologue_reference`, `output_gate_reference`) around the unfused attention."""
    if use_kernel not in (False, True, "decode"):
        raise ValueError(f"use_kernel must be False, True or 'decode', got {use_kernel!r}")

    def unfused(attention, **kwargs):
        q = queries if query_prologue is None else head_prologue_reference(queries, query_prologue)
        out = attention(q, k_pages, v_pages, query_start, seq_lens, page_table, window=window,
                        softmax_scale=softmax_scale, **kwargs)
        return out if output_gate is None else output_gate_reference(out, output_gate)

    if use_kernel is False:
        return unfused(_plain_jnp, blocked=blocked)
    decoded, token_row = paged_decode_attention_kernel(
        queries, k_pages, v_pages, query_start, seq_lens, page_table, window=window,
        softmax_scale=softmax_scale, metadata=decode, blocks=decode_block_sizes,
        query_prologue=query_prologue, output_gate=output_gate, interpret=interpret,
    )
    if decode_only:
        return decoded
    if use_kernel == "decode":
        rest = unfused(_plain_jnp, blocked=blocked, skip_decodes=True)
    else:
        rest = unfused(ragged_paged_attention_kernel, block_q=block_q, interpret=interpret, skip_decodes=True)
    return jnp.where((token_row >= 0)[:, None, None], decoded, rest)


def _plain_jnp(queries, k_pages, v_pages, query_start, seq_lens, page_table, *, window, softmax_scale, blocked,
               skip_decodes=False):
    if blocked is None:
        blocked = reference_gather_size(queries, k_pages, page_table) > REFERENCE_MAX_GATHER
    if blocked:
        return ragged_paged_attention_blocked(
            queries, k_pages, v_pages, query_start, seq_lens, page_table, window=window,
            softmax_scale=softmax_scale, skip_decodes=skip_decodes,
        )
    return ragged_paged_attention_reference(
        queries, k_pages, v_pages, query_start, seq_lens, page_table, window=window, softmax_scale=softmax_scale
    )


def default_use_kernel(backend: str | None = None) -> bool | Literal["decode"]:
    """The path the model runs (`use_kernel` of `ragged_paged_attention`), per backend. GPU: "decode".
    On one H200 (benchmarks/attention/RESULTS.md) the split decode kernel beats XLA's plain-jnp
    gather 1.2-2.8x on decode batches, while the general kernel is slower than XLA in most configs,
    so prefill chunks stay in plain jnp. CPU and others: False (the kernels run there only in
    interpret mode, in tests)."""
    backend = jax.default_backend() if backend is None else backend
    return "decode" if backend == "gpu" else False
