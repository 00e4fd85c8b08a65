"""Beam's fp32 MoE routing as Pallas (Triton) kernels, with its plain-jnp reference.

Routing (BEAM_SPEC): `logits = x @ W_router^T` (bf16 activations, fp32 weights, fp32 accumulation),
`scores = sigmoid(logits)`, `choice = scores + correction_bias`; each group of experts is scored by
the sum of its two best choices, the best `groups_kept` groups stay, the `top_k` best experts in
them are chosen (ties: lower index), and their weights are the unbiased scores, normalized to sum
1 (`normalize`) and multiplied by `scaling`.

The kernel: grid (token block, expert block, K split). Every program writes the partial logits of
its [tokens x experts] tile over its slice of the hidden axis. The fp32 logits are summed in split
order, so the result never depends on scheduling; on the H200 they equal XLA's HIGHEST-precision
einsum bit for bit, and the selections equal the reference's on 100k random tokens.
Two ways to select:
- `fused=False` (default): a second kernel, one token per program.
- `fused=True`: the program that finishes last for a token block (an atomic counter per token
  block says which) selects, so routing is one launch. Passes in interpret mode; its first GPU
  version (a one-element vector atomic) selected garbage on the H200, and the scalar-atomic
  version here has not run on a GPU yet.

Speed (benchmarks/moe/RESULTS.md): not yet faster than XLA, so `routing()` runs the reference unless
asked for the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int


def routing_reference(
    x: Float[Array, "tokens hidden"],
    router_weight: Float[Array, "experts hidden"],
    correction_bias: Float[Array, " experts"],
    *,
    num_groups: int,
    groups_kept: int,
    top_k: int,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Expert weights (fp32) and indices (int32), fp32 end to end, in plain jnp."""
    logits = jnp.einsum(
        "th,eh->te", x.astype(jnp.float32), router_weight.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    scores = jax.nn.sigmoid(logits)
    choice = scores + correction_bias.astype(jnp.float32)
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, num_groups, experts // num_groups)
    group_scores = lax.top_k(grouped, 2)[0].sum(-1)
    _, kept_groups = lax.top_k(group_scores, groups_kept)
    group_mask = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], kept_groups].set(True)
    choice = jnp.where(jnp.repeat(group_mask, experts // num_groups, axis=1), choice, -jnp.inf)
    _, indices = lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, indices, axis=1)
    if normalize:
        # Divide as the PyTorch reference does: XLA rewrites `x / broadcast(d)` into `x * (1 / d)`,
        # an ulp off for ~20% of the weights, unless the broadcast divisor is behind a barrier.
        total = jnp.broadcast_to(weights.sum(-1, keepdims=True) + 1e-20, weights.shape)
        weights = weights / lax.optimization_barrier(total)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, indices.astype(jnp.int32)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _select(logits, bias, *, experts: int, num_groups: int, groups_kept: int, top_k: int, normalize: bool, scaling):
    """Selection on a [rows, padded experts] tile of fp32 logits (pure jnp on values, so it runs in
    the kernel; padded expert columns are never chosen). Returns weights and ids, [rows, padded k]."""
    rows, padded_experts = logits.shape
    column = lax.broadcasted_iota(jnp.int32, (rows, padded_experts), 1)
    scores = 1.0 / (1.0 + jnp.exp(-logits))
    choice = jnp.where(column < experts, scores + bias[None, :], -jnp.inf)
    group_of = column // (experts // num_groups)  # padded columns fall in groups >= num_groups

    padded_groups = _next_pow2(num_groups)
    group_column = lax.broadcasted_iota(jnp.int32, (rows, padded_groups), 1)
    group_scores = jnp.full((rows, padded_groups), -jnp.inf, jnp.float32)
    for group in range(num_groups):
        in_group = jnp.where(group_of == group, choice, -jnp.inf)
        best = jnp.argmax(in_group, axis=1)  # ties: lower index
        first = jnp.max(in_group, axis=1)
        second = jnp.max(jnp.where(column == best[:, None], -jnp.inf, in_group), axis=1)
        group_scores = jnp.where(group_column == group, (first + second)[:, None], group_scores)

    kept = jnp.zeros((rows, padded_groups), jnp.int32)
    for _ in range(groups_kept):
        best = jnp.argmax(group_scores, axis=1)
        taken = group_column == best[:, None]
        kept = jnp.where(taken, 1, kept)
        group_scores = jnp.where(taken, -jnp.inf, group_scores)
    expert_kept = jnp.zeros((rows, padded_experts), jnp.int32)
    for group in range(num_groups):
        kept_here = jnp.max(jnp.where(group_column == group, kept, 0), axis=1)
        expert_kept = jnp.where(group_of == group, kept_here[:, None], expert_kept)
    choice = jnp.where(expert_kept > 0, choice, -jnp.inf)

    padded_k = _next_pow2(top_k)
    k_column = lax.broadcasted_iota(jnp.int32, (rows, padded_k), 1)
    ids = jnp.zeros((rows, padded_k), jnp.int32)
    weights = jnp.zeros((rows, padded_k), jnp.float32)
    for slot in range(top_k):
        best = jnp.argmax(choice, axis=1)
        picked = column == best[:, None]
        weight = jnp.sum(jnp.where(picked, scores, 0.0), axis=1)
        ids = jnp.where(k_column == slot, best[:, None], ids)
        weights = jnp.where(k_column == slot, weight[:, None], weights)
        choice = jnp.where(picked, -jnp.inf, choice)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids


def _partial_logits(x_ref, w_ref, t_block, e_block, split, *, block_t, block_e, block_k, k_chunks_per_split):
    """fp32 logits of one [block_t tokens, block_e experts] tile over one split of the hidden axis."""
    from jax.experimental.pallas import triton as plgpu

    tokens, hidden = x_ref.shape
    experts = w_ref.shape[0]
    rows = t_block * block_t + lax.iota(jnp.int32, block_t)
    row_ok = rows < tokens
    expert_rows = e_block * block_e + lax.iota(jnp.int32, block_e)
    expert_ok = expert_rows < experts
    k_iota = lax.iota(jnp.int32, block_k)
    k_chunks = pl.cdiv(hidden, block_k)
    first_chunk = split * k_chunks_per_split
    last_chunk = jnp.minimum(first_chunk + k_chunks_per_split, k_chunks)
    k_tail = hidden % block_k != 0

    def body(chunk, acc):
        cols = chunk * block_k + k_iota
        x_mask, w_mask = row_ok[:, None], expert_ok[:, None]
        if k_tail:
            x_mask, w_mask = x_mask & (cols < hidden)[None, :], w_mask & (cols < hidden)[None, :]
        x = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=x_mask, other=0).astype(jnp.float32)
        w = plgpu.load(w_ref.at[expert_rows[:, None], cols[None, :]], mask=w_mask, other=0.0)
        return acc + lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )

    return lax.fori_loop(first_chunk, last_chunk, body, jnp.zeros((block_t, block_e), jnp.float32))


def _summed_logits(partial_ref, t_block, block_t, *, volatile: bool):
    from jax.experimental.pallas import triton as plgpu

    splits, _, padded_experts = partial_ref.shape
    tile = pl.ds(t_block * block_t, block_t)
    logits = jnp.zeros((block_t, padded_experts), jnp.float32)
    for s in range(splits):  # fixed order: the same sum whichever program finishes last
        logits = logits + plgpu.load(partial_ref.at[jnp.int32(s), tile, :], volatile=volatile)
    return logits


def _fused_routing_kernel(x_ref, w_ref, bias_ref, counter_in_ref, partial_ref, weights_ref, ids_ref, counter_ref,
                          *, block_t, interpret, select, **tile):
    """Partial logits, then the last program of the token block (atomic counter) selects."""
    del counter_in_ref  # aliased to counter_ref
    from jax.experimental.pallas import triton as plgpu

    t_block, e_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    acc = _partial_logits(x_ref, w_ref, t_block, e_block, split, block_t=block_t, **tile)
    block_e = tile["block_e"]
    partial_ref[split, pl.ds(t_block * block_t, block_t), pl.ds(e_block * block_e, block_e)] = acc
    if not interpret:
        plgpu.debug_barrier()  # every thread's partial store is ordered before the release below
    # A scalar atomic: Triton runs it once per program. (A one-element vector atomic, the first
    # version, may run once per thread holding a replica of the element; that version selected
    # garbage on the H200.)
    finished_before = plgpu.atomic_add(counter_ref, (jnp.asarray(t_block, jnp.int32),), jnp.ones((), jnp.int32))

    @pl.when(finished_before == pl.num_programs(1) * pl.num_programs(2) - 1)
    def _select_last():
        weights, ids = select(_summed_logits(partial_ref, t_block, block_t, volatile=True), bias_ref[...])
        tile_rows = pl.ds(t_block * block_t, block_t)
        weights_ref[tile_rows, :] = weights
        ids_ref[tile_rows, :] = ids


def _logits_kernel(x_ref, w_ref, partial_ref, *, block_t, **tile):
    t_block, e_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    acc = _partial_logits(x_ref, w_ref, t_block, e_block, split, block_t=block_t, **tile)
    block_e = tile["block_e"]
    partial_ref[split, pl.ds(t_block * block_t, block_t), pl.ds(e_block * block_e, block_e)] = acc


def _select_kernel(partial_ref, bias_ref, weights_ref, ids_ref, *, block_t, select):
    t_block = pl.program_id(0)
    weights, ids = select(_summed_logits(partial_ref, t_block, block_t, volatile=False), bias_ref[...])
    tile_rows = pl.ds(t_block * block_t, block_t)
    weights_ref[tile_rows, :] = weights
    ids_ref[tile_rows, :] = ids


def routing_kernel(
    x: Float[Array, "tokens hidden"],
    router_weight: Float[Array, "experts hidden"],
    correction_bias: Float[Array, " experts"],
    *,
    num_groups: int,
    groups_kept: int,
    top_k: int,
    normalize: bool = True,
    scaling: float = 1.0,
    block_t: int = 16,
    block_e: int = 32,
    block_k: int = 64,
    splits: int | None = None,
    num_warps: int = 4,
    fused: bool = False,
    logits_only: bool = False,
    interpret: bool = False,
):
    """The routing kernel (see the module docstring). `splits` divides the hidden axis; by default
    it is chosen so that a grid has about 128 programs (enough to stream the router). `fused`
    selects in the last program instead of a second kernel; `logits_only` returns the kernel's
    fp32 logits [tokens, experts] (for tests)."""
    from jax.experimental.pallas import triton as plgpu

    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if experts % num_groups or experts // num_groups < 2:
        raise ValueError(f"{experts} experts cannot form {num_groups} groups of at least 2")
    if not 1 <= top_k <= groups_kept * (experts // num_groups):
        raise ValueError(f"top_k={top_k} needs 1..{groups_kept * (experts // num_groups)} experts in the kept groups")
    padded_experts = _next_pow2(max(experts, block_e))
    block_e = min(block_e, padded_experts)
    token_blocks = pl.cdiv(tokens, block_t)
    expert_blocks = padded_experts // block_e
    k_chunks = pl.cdiv(hidden, block_k)
    if splits is None:
        splits = max(1, min(k_chunks, 128 // (token_blocks * expert_blocks)))
    k_chunks_per_split = pl.cdiv(k_chunks, splits)
    splits = pl.cdiv(k_chunks, k_chunks_per_split)
    padded_k = _next_pow2(top_k)
    padded_tokens = token_blocks * block_t
    bias = jnp.zeros((padded_experts,), jnp.float32).at[:experts].set(correction_bias.astype(jnp.float32))
    router_weight = router_weight.astype(jnp.float32)

    select = functools.partial(
        _select, experts=experts, num_groups=num_groups, groups_kept=groups_kept,
        top_k=top_k, normalize=normalize, scaling=scaling,
    )
    tile = dict(block_t=block_t, block_e=block_e, block_k=block_k, k_chunks_per_split=k_chunks_per_split)
    grid = (token_blocks, expert_blocks, splits)
    partial_shape = jax.ShapeDtypeStruct((splits, padded_tokens, padded_experts), jnp.float32)
    selection_shapes = [
        jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.float32),
        jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.int32),
    ]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    if fused and not logits_only:
        _, weights, ids, _ = pl.pallas_call(
            functools.partial(_fused_routing_kernel, interpret=interpret, select=select, **tile),
            grid=grid,
            out_shape=[partial_shape, *selection_shapes, jax.ShapeDtypeStruct((token_blocks,), jnp.int32)],
            input_output_aliases={3: 3},
            compiler_params=params,
            interpret=interpret,
            name="beam_routing",
        )(x, router_weight, bias, jnp.zeros((token_blocks,), jnp.int32))
    else:
        partial = pl.pallas_call(
            functools.partial(_logits_kernel, **tile), grid=grid, out_shape=partial_shape,
            compiler_params=params, interpret=interpret, name="beam_router_logits",
        )(x, router_weight)
        if logits_only:
            return partial.sum(0)[:tokens, :experts]
        # One token per program and one warp: the selection is ~70 dependent reductions over the
        # experts, which stay inside a warp (shuffles, no shared-memory round trips) this way.
        weights, ids = pl.pallas_call(
            functools.partial(_select_kernel, block_t=1, select=select), grid=(padded_tokens,),
            out_shape=selection_shapes, compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
            interpret=interpret, name="beam_router_select",
        )(partial, bias)
    return weights[:tokens, :top_k], ids[:tokens, :top_k]


def routing(
    x: Float[Array, "tokens hidden"],
    router_weight: Float[Array, "experts hidden"],
    correction_bias: Float[Array, " experts"],
    *,
    num_groups: int,
    groups_kept: int,
    top_k: int,
    normalize: bool = True,
    scaling: float = 1.0,
    use_kernel: bool = False,
    interpret: bool = False,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
    """Beam's routing. The plain-jnp reference unless `use_kernel` (the kernel is correct but was
    slower than XLA's fusion of the reference when last measured on the H200)."""
    kwargs = dict(
        num_groups=num_groups, groups_kept=groups_kept, top_k=top_k, normalize=normalize, scaling=scaling
    )
    if use_kernel:
        return routing_kernel(x, router_weight, correction_bias, interpret=interpret, **kwargs)
    return routing_reference(x, router_weight, correction_bias, **kwargs)
