"""Beam's fp32 MoE routing as Pallas (Triton) kernels, with its plain-jnp reference.

Routing (BEAM_SPEC): `logits = x @ W_router^T` (bf16 activations, fp32 weights, fp32 accumulation),
`scores = sigmoid(logits)`, `choice = scores + correction_bias`; each group of experts is scored by
the sum of its two best choices, the best `groups_kept` groups stay, the `top_k` best experts in
them are chosen (ties: lower index), and their weights are the unbiased scores, normalized to sum
1 (`normalize`) and multiplied by `scaling`.

Two kernels:
- logits: grid (token block, expert block, K split); every program writes the partial fp32 logits
  of its [tokens x experts] tile over its slice of the hidden axis. Decode batches multiply and add
  elementwise on the CUDA cores (token blocks of <= 4); batches over 64 tokens use an fp32 dot.
- select: one token per program (one warp). It adds the partials in split order, so the result
  never depends on scheduling, and selects on a [groups, group size] tile.
`fused=True` (the default up to `FUSED_MAX_TOKENS`, a token block per token) runs the select in the logits kernel
instead: the partials go into a state that marks each one unwritten until it is (`UNWRITTEN`), and the token
block's last program in grid order reads them until all are written, then selects: one launch, no atomics or
fences.
The selections equal the reference's on 100k random tokens (H200, benchmarks/moe/RESULTS.md).

Speed (benchmarks/moe/RESULTS.md): faster than XLA for decode batches on the H200, slower for
larger ones, so `routing()` picks the kernel only for the former.
"""

from __future__ import annotations

import functools
import math

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


def _group_tile(experts: int, num_groups: int) -> tuple[int, int]:
    """The selection's tile: [padded groups, padded group size] (expert = group x size + column)."""
    return _next_pow2(num_groups), _next_pow2(experts // num_groups)


def _kept_choices(logits, bias, valid, *, groups_kept: int):
    """Scores and choices (score + bias) of one token's [padded groups, padded group size] tile, the choices of
    every group but the `groups_kept` best at -inf, and which groups are kept [padded groups].

    A group's score is the sum of its two best choices (a tied best counts twice); group-wise steps are row
    reductions of the tile, all groups at once, and the groups are ranked by counting who beats whom (ties: lower
    index)."""
    padded_groups = logits.shape[0]
    scores = 1.0 / (1.0 + jnp.exp(-logits))
    choice = jnp.where(valid, scores + bias, -jnp.inf)
    best = jnp.max(choice, axis=1)
    is_best = choice == best[:, None]
    second = jnp.where(jnp.sum(is_best.astype(jnp.int32), axis=1) >= 2, best,
                       jnp.max(jnp.where(is_best, -jnp.inf, choice), axis=1))
    group_score = best + second  # -inf for padded groups: they never beat a real one
    group = lax.iota(jnp.int32, padded_groups)
    beaten_by = (group_score[None, :] > group_score[:, None]) | (
        (group_score[None, :] == group_score[:, None]) & (group[None, :] < group[:, None]))
    kept = jnp.sum(beaten_by.astype(jnp.int32), axis=1) < groups_kept
    return scores, jnp.where(kept[:, None], choice, -jnp.inf), kept


def _order_key(x):
    """int32 keys that order as the fp32 `x` does (no NaN; -0 below +0, which no choice is: a score is > 0). Triton
    can reduce int32 max or min over a warp in one instruction (redux.sync on sm_80+), where an fp32 argmax is a
    tree of shuffles of value and index (H200: ~0.07 against ~0.2 µs a pick, benchmarks/moe/RESULTS.md session 33)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


_LOWEST_KEY = jnp.iinfo(jnp.int32).min  # below every choice's key, -inf's included


def _pick_top_k(key, *, top_k: int, value=None):
    """The `top_k` best choices along the last axis of their keys (`_order_key`), best first (ties: lower
    position): a pick is the best key, then the lowest position holding it, two dependent int32 reductions, the
    only chain. Returns their positions and, given an int32 `value` laid out as `key`, its entries there (else
    None); each [..., next_pow2(top_k)], 0 past `top_k`."""
    position = lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)
    out_shape = key.shape[:-1] + (_next_pow2(top_k),)
    slot = lax.broadcasted_iota(jnp.int32, out_shape, key.ndim - 1)
    picks = jnp.zeros(out_shape, jnp.int32)
    picked_value = None if value is None else jnp.zeros(out_shape, jnp.int32)
    for k in range(top_k):
        best = jnp.max(key, axis=-1, keepdims=True)
        pick = jnp.min(jnp.where(key == best, position, key.shape[-1]), axis=-1, keepdims=True)
        picked = position == pick
        picks = jnp.where(slot == k, pick, picks)
        if value is not None:
            here = jnp.max(jnp.where(picked, value, _LOWEST_KEY), axis=-1, keepdims=True)
            picked_value = jnp.where(slot == k, here, picked_value)
        key = jnp.where(picked, _LOWEST_KEY, key)
    return picks, picked_value


def _finish_weights(weights, *, normalize: bool, scaling):
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights


def _select(logits, bias, valid, *, size: int, groups_kept: int, top_k: int, normalize: bool, scaling):
    """Selection for one token on its [padded groups, padded group size] tile (`valid` marks real experts; `size`
    experts a group): fp32 weights and expert ids, each [next_pow2(top_k)]. The picks run on the flattened tile:
    in a one-warp program (the select kernel) every reduction stays inside the warp."""
    padded_size = logits.shape[1]
    scores, choice, _ = _kept_choices(logits, bias, valid, groups_kept=groups_kept)
    scores = lax.bitcast_convert_type(scores, jnp.int32)
    picks, weights = _pick_top_k(_order_key(choice).reshape(-1), top_k=top_k, value=scores.reshape(-1))
    weights = lax.bitcast_convert_type(weights, jnp.float32)
    return _finish_weights(weights, normalize=normalize, scaling=scaling), (picks // padded_size) * size + (
        picks % padded_size)


def _select_gathered(logits, bias, valid, *, scratch_ref, token, warps: int, interpret: bool, size: int,
                     groups_kept: int, top_k: int, normalize: bool, scaling):
    """`_select` for a program of `warps` warps (the fused kernel's last): the groups' choice keys, scores and
    expert ids go through `scratch_ref` (int32 [tokens x 3 x groups x size]), the kept groups first and in index
    order (so positions keep the experts' order: ties go to the lower index), and the kept groups' keys come back
    as [warps, groups_kept x size] tiles, a copy in every warp, so that each pick's two reductions stay inside a
    warp. (On the [groups, size] tile Triton spreads the groups over the warps; picks reduced across them gained
    nothing from the keys. H200, one token: 5.3 µs a call against 6.1, session 33.) Weights and ids come back
    [warps, next_pow2(top_k)], each row a copy. In interpret mode, where a program runs sequentially: no barrier,
    and one row (copies stored to one address under a mask race in the interpreter's scatter)."""
    from jax.experimental.pallas import triton as plgpu

    padded_groups, padded_size = logits.shape
    scores, choice, kept = _kept_choices(logits, bias, valid, groups_kept=groups_kept)
    group = lax.iota(jnp.int32, padded_groups)
    kept_before = jnp.sum((kept[None, :] & (group[None, :] < group[:, None])).astype(jnp.int32), axis=1)
    row = jnp.where(kept, kept_before, groups_kept + group - kept_before)  # the kept groups first, in index order
    column = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    stride = padded_groups * padded_size  # each array's slots in a token's part of the scratch
    base = token * (3 * stride)
    position = base + row[:, None] * padded_size + column
    plgpu.store(scratch_ref.at[position], _order_key(choice))
    plgpu.store(scratch_ref.at[position + stride], lax.bitcast_convert_type(scores, jnp.int32))
    plgpu.store(scratch_ref.at[position + 2 * stride], group[:, None] * size + column)
    if not interpret:
        plgpu.debug_barrier()  # the stores of every thread before any load
    gathered = groups_kept * padded_size
    width = _next_pow2(gathered)
    tile = jnp.broadcast_to(lax.iota(jnp.int32, width)[None, :], (1 if interpret else warps, width))
    key = plgpu.load(scratch_ref.at[base + tile], mask=tile < gathered, other=_LOWEST_KEY)
    picks, _ = _pick_top_k(key, top_k=top_k)
    # the picks' scores and ids loaded after the chain, not reduced at each pick (H200: 5.30-5.36 against 5.39-5.43
    # µs at one token, session 33 run 8)
    picked = lax.broadcasted_iota(jnp.int32, picks.shape, 1) < top_k  # slots past top_k: weight 0
    weights = lax.bitcast_convert_type(plgpu.load(scratch_ref.at[base + stride + picks], mask=picked, other=0),
                                       jnp.float32)
    ids = plgpu.load(scratch_ref.at[base + 2 * stride + picks], mask=picked, other=0)
    return _finish_weights(weights, normalize=normalize, scaling=scaling), ids


def _partial_logits(x_ref, w_ref, t_block, e_block, split, *, block_t, block_e, block_k, k_chunks_per_split):
    """fp32 logits of one [block_t tokens, block_e experts] tile over one split of the hidden axis.
    Few tokens (block_t < 16): products accumulate elementwise and are summed once at the end (a
    GEMV on the CUDA cores; no tensor-core tile padded to 16 rows). Otherwise an fp32 dot."""
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
    gemv = block_t < 16

    def body(chunk, acc):
        cols = chunk * block_k + k_iota
        x_mask, w_mask = row_ok[:, None], expert_ok[:, None]
        if k_tail:
            x_mask, w_mask = x_mask & (cols < hidden)[None, :], w_mask & (cols < hidden)[None, :]
        x = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=x_mask, other=0).astype(jnp.float32)
        w = plgpu.load(w_ref.at[expert_rows[:, None], cols[None, :]], mask=w_mask, other=0.0)
        if gemv:
            return acc + x[:, None, :] * w[None, :, :]
        return acc + lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )

    shape = (block_t, block_e, block_k) if gemv else (block_t, block_e)
    acc = lax.fori_loop(first_chunk, last_chunk, body, jnp.zeros(shape, jnp.float32))
    return jnp.sum(acc, axis=2) if gemv else acc


def _logits_kernel(num_tokens_ref, x_ref, w_ref, partial_ref, *, block_t, **tile):
    t_block, e_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(t_block * block_t < num_tokens_ref[0])  # a block of padding only: nothing read or written
    def _():
        acc = _partial_logits(x_ref, w_ref, t_block, e_block, split, block_t=block_t, **tile)
        block_e = tile["block_e"]
        partial_ref[split, pl.ds(t_block * block_t, block_t), pl.ds(e_block * block_e, block_e)] = acc


# The fused kernel's state (`routing_kernel(state=)`): int32 slots holding the bits of its partial logits, each
# `UNWRITTEN` until its program writes it. That is a signaling NaN, which no arithmetic produces (a GPU's NaNs are
# quiet), so a logit, even of bad inputs, never looks unwritten.
UNWRITTEN = 0x7FA5A5A5
# Slots of the state the model passes from layer to layer: splits x padded tokens x padded experts of a fused call
# (Beam: 5 x tokens x 256, 10240 at `FUSED_MAX_TOKENS`); a call needing more makes its own.
STATE_SLOTS = 10240


def routing_state(slots: int = STATE_SLOTS) -> Int[Array, " slots"]:
    """A fresh fused-kernel state: every slot `UNWRITTEN`."""
    return jnp.full((slots,), UNWRITTEN, jnp.int32)


def _select_token(read_partial, bias_ref, weights_ref, ids_ref, token, *, splits, experts, num_groups, select,
                  reset=None):
    """One token: sum its partial logits (`read_partial(split, token, expert, mask)`, in split order), select
    (`select(logits, bias, valid)`: `_select` or `_select_gathered`), store. `reset`: the partials are int32
    bits that other programs may still be writing, read again until none is `UNWRITTEN`, then
    `reset(split, token, expert, mask)` for the next call."""
    from jax.experimental.pallas import triton as plgpu

    size = experts // num_groups
    shape = _group_tile(experts, num_groups)
    group, column = lax.broadcasted_iota(jnp.int32, shape, 0), lax.broadcasted_iota(jnp.int32, shape, 1)
    valid = (group < num_groups) & (column < size)
    expert = jnp.where(valid, group * size + column, 0)
    bias = plgpu.load(bias_ref.at[expert], mask=valid, other=0.0)  # first: it waits on no other program

    def read_all(_=None):
        return tuple(read_partial(jnp.int32(s), token, expert, valid) for s in range(splits))

    partials = read_all()
    if reset is not None:
        def unwritten(parts):
            return jnp.max(sum(jnp.where(part == UNWRITTEN, 1, 0) for part in parts)) > 0

        partials = lax.while_loop(unwritten, read_all, partials)
        partials = [lax.bitcast_convert_type(part, jnp.float32) for part in partials]
        for s in range(splits):
            reset(jnp.int32(s), token, expert, valid)
    logits = jnp.zeros(shape, jnp.float32)
    for partial in partials:  # fixed order: the sum does not depend on scheduling
        logits = logits + partial
    weights, ids = select(logits, bias, valid)
    slots = lax.broadcasted_iota(jnp.int32, weights.shape, weights.ndim - 1)
    first = None if weights.ndim == 1 else lax.broadcasted_iota(jnp.int32, weights.shape, 0) == 0  # rows: copies
    plgpu.store(weights_ref.at[token, slots], weights, mask=first)
    plgpu.store(ids_ref.at[token, slots], ids, mask=first)


def _select_kernel(num_tokens_ref, partial_ref, bias_ref, weights_ref, ids_ref, **kwargs):
    from jax.experimental.pallas import triton as plgpu

    token = pl.program_id(0)

    @pl.when(token < num_tokens_ref[0])  # padding: left unwritten (`routing_kernel` masks it)
    def _():
        def read_partial(split, token, expert, mask):
            return plgpu.load(partial_ref.at[split, token, expert], mask=mask, other=0.0)

        _select_token(read_partial, bias_ref, weights_ref, ids_ref, token, splits=partial_ref.shape[0], **kwargs)


def _fused_routing_kernel(x_ref, w_ref, bias_ref, state_in_ref, state_ref, weights_ref, ids_ref, scratch_ref, *,
                          block_t, partials_dims, select_args, gathered_args, **tile):
    """Partial logits into the state (every slot left `UNWRITTEN` by the call before: a partial is its own flag),
    then the token block's last program in grid order reads them until all are written, selects, and leaves them
    `UNWRITTEN` again. No atomic and no fence, which a ticket counter needs (H200, one token: 6.2 µs a call against
    the ticket's 6.5, benchmarks/moe/RESULTS.md session 32). The waiting program is the last one the grid
    launches, so every other program is running or done while it waits. `scratch_ref`: `_select_gathered`'s."""
    del state_in_ref  # aliased to state_ref
    from jax.experimental.pallas import triton as plgpu

    splits, padded_tokens, padded_experts = partials_dims
    t_block, e_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    acc = _partial_logits(x_ref, w_ref, t_block, e_block, split, block_t=block_t, **tile)

    def slot(split, token, expert):
        return (split * padded_tokens + token) * padded_experts + expert

    rows = t_block * block_t + lax.iota(jnp.int32, block_t)
    cols = e_block * tile["block_e"] + lax.iota(jnp.int32, tile["block_e"])
    plgpu.store(state_ref.at[slot(split, rows[:, None], cols[None, :])], lax.bitcast_convert_type(acc, jnp.int32))

    def read_partial(split, token, expert, mask):  # volatile: other programs' stores, past the L1
        return plgpu.load(state_ref.at[slot(split, token, expert)], mask=mask, other=0, volatile=True)

    def reset(split, token, expert, mask):
        plgpu.store(state_ref.at[slot(split, token, expert)], jnp.full(expert.shape, UNWRITTEN, jnp.int32),
                    mask=mask)

    @pl.when((e_block == pl.num_programs(1) - 1) & (split == pl.num_programs(2) - 1))
    def _select_last():
        for row in range(block_t):
            token = t_block * block_t + row
            select = functools.partial(_select_gathered, scratch_ref=scratch_ref, token=token, **gathered_args)
            _select_token(read_partial, bias_ref, weights_ref, ids_ref, token, splits=splits, reset=reset,
                          select=select, **select_args)


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
    block_t: int | None = None,
    block_e: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    target_programs: int = 256,
    num_warps: int = 4,
    num_stages: int | None = None,
    fused: bool | None = None,
    logits_only: bool = False,
    num_tokens: Int[Array, ""] | None = None,
    state: Int[Array, " slots"] | None = None,
    interpret: bool = False,
):
    """The routing kernels (see the module docstring). By default batches of up to 64 tokens take
    the CUDA-core GEMV path in token blocks of at most 4, larger ones blocks of 16 on the dot path;
    `splits` divides the hidden axis so that the logits grid has about `target_programs`
    programs (enough to stream the 5 MB router); one fused token instead loads one [2, 1024] router
    slice per program. `fused` selects in the logits kernel's last program of each token block
    instead of a second launch; by default up to `FUSED_MAX_TOKENS` tokens, each its own token block, so that
    their last programs select side by side (a block of several tokens selects one after the other). `logits_only`
    returns the kernel's fp32 logits [tokens, experts] (for tests). `num_tokens`: only the first
    `num_tokens` tokens are real (a serving step padded to its bucket); the two-kernel path reads and
    selects nothing for the rest, and their selection comes back as expert -1, weight 0 (`routing`).
    `state`: the fused kernel's (`routing_state()`); the kernel leaves it as it found it and (weights, ids, state)
    come back, the state for the next call. Passed from call to call (e.g. layer to layer,
    `PagedBatch.routing_state`), it spares each call the fill of a fresh one (0.8 µs of a 6.9 µs lone call at T = 1
    on the H200, session 32). A call whose partials need more slots than the state has makes its own; the two-kernel
    path and that call return the state untouched."""
    from jax.experimental.pallas import triton as plgpu

    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if experts % num_groups or experts // num_groups < 2:
        raise ValueError(f"{experts} experts cannot form {num_groups} groups of at least 2")
    if not 1 <= top_k <= groups_kept * (experts // num_groups):
        raise ValueError(f"top_k={top_k} needs 1..{groups_kept * (experts // num_groups)} experts in the kept groups")
    if fused is None:
        fused = tokens <= FUSED_MAX_TOKENS
    if block_t is None:  # H200 (benchmarks/moe/RESULTS.md): GEMV blocks of <= 4 tokens beat the dot to T = 64
        block_t = 1 if fused and tokens <= FUSED_MAX_TOKENS else min(_next_pow2(tokens), 4) if tokens <= 64 else 16
    # Fused, a token a block: one load of a [2 experts, 1024] slice per program, 640 programs a token (H200, run M:
    # 5.73 us at one token; 5.89 with 4 experts, 6.84 with run H's 8 x 256 slices in 3 pipelined steps), [4, 1024]
    # from 4 tokens on (session 32: 8.6 against 9.3 us at 4 tokens)
    one_load = fused and block_t == 1
    if block_e is None:
        block_e = (2 if tokens < 4 else 4) if one_load else 8 if block_t == 1 else 16
    if block_k is None:
        block_k = min(1024, _next_pow2(hidden)) if one_load else 256 // block_t if block_t < 16 else 64
    block_e = min(block_e, _next_pow2(experts))
    token_blocks = pl.cdiv(tokens, block_t)
    expert_blocks = pl.cdiv(experts, block_e)
    k_chunks = pl.cdiv(hidden, block_k)
    if splits is None:
        splits = k_chunks if one_load else max(1, min(k_chunks, target_programs // (token_blocks * expert_blocks)))
    if num_stages is None:
        num_stages = 1 if one_load else 2
    k_chunks_per_split = pl.cdiv(k_chunks, splits)
    splits = pl.cdiv(k_chunks, k_chunks_per_split)
    padded_tokens, padded_experts = token_blocks * block_t, expert_blocks * block_e

    tile = dict(block_e=block_e, block_k=block_k, k_chunks_per_split=k_chunks_per_split)
    grid = (token_blocks, expert_blocks, splits)
    partial_shape = jax.ShapeDtypeStruct((splits, padded_tokens, padded_experts), jnp.float32)
    logits_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    router_weight = router_weight.astype(jnp.float32)

    real = jnp.full((1,), tokens if num_tokens is None else num_tokens, jnp.int32)  # the kernels' first input

    def partial_logits():
        return pl.pallas_call(
            functools.partial(_logits_kernel, block_t=block_t, **tile), grid=grid, out_shape=partial_shape,
            compiler_params=logits_params, interpret=interpret, name="beam_router_logits",
        )(real, x, router_weight)

    if logits_only:
        return partial_logits().sum(0)[:tokens, :experts]
    picking = dict(size=experts // num_groups, groups_kept=groups_kept, top_k=top_k, normalize=normalize,
                   scaling=scaling)
    select_args = dict(experts=experts, num_groups=num_groups)
    padded_k = _next_pow2(top_k)
    selection_shapes = [jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.float32),
                        jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.int32)]
    bias = correction_bias.astype(jnp.float32)
    if state is not None and (state.dtype != jnp.int32 or state.ndim != 1):
        raise ValueError(f"state must be int32 [slots] (`routing_state()`), got {state.dtype}{list(state.shape)}")
    if fused:
        needed = math.prod(partial_shape.shape)
        own = state is None or state.shape[0] < needed
        used_state = routing_state(needed) if own else state
        gathered_args = dict(warps=num_warps, interpret=interpret, **picking)
        scratch_slots = padded_tokens * 3 * math.prod(_group_tile(experts, num_groups))
        used_state, weights, ids, _ = pl.pallas_call(
            functools.partial(_fused_routing_kernel, block_t=block_t, partials_dims=partial_shape.shape,
                              select_args=select_args, gathered_args=gathered_args, **tile),
            grid=grid, out_shape=[jax.ShapeDtypeStruct(used_state.shape, jnp.int32), *selection_shapes,
                                  jax.ShapeDtypeStruct((scratch_slots,), jnp.int32)],
            input_output_aliases={3: 0}, compiler_params=logits_params, interpret=interpret, name="beam_routing",
        )(x, router_weight, bias, used_state)
        selection = _mask_padding(weights[:tokens, :top_k], ids[:tokens, :top_k], num_tokens)
        return selection if state is None else (*selection, state if own else used_state)
    # One token per program and one warp: the selection's reductions stay inside the warp (no shared-memory round
    # trips; the picks' int32 reductions one instruction each).
    partials = partial_logits()
    weights, ids = pl.pallas_call(
        functools.partial(_select_kernel, select=functools.partial(_select, **picking), **select_args),
        grid=(padded_tokens,),
        out_shape=selection_shapes,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="beam_router_select",
    )(real, partials, bias)
    selection = _mask_padding(weights[:tokens, :top_k], ids[:tokens, :top_k], num_tokens)
    return selection if state is None else (*selection, state)


def _mask_padding(weights, ids, num_tokens):
    """Tokens from `num_tokens` on (padding) select expert -1 with weight 0, which no expert path
    computes (`moe_gemm._local_pairs`)."""
    if num_tokens is None:
        return weights, ids
    real = (jnp.arange(ids.shape[0]) < num_tokens)[:, None]
    return jnp.where(real, weights, 0.0).astype(weights.dtype), jnp.where(real, ids, -1).astype(ids.dtype)


# Largest batch for which `routing()` picks the kernel on a GPU (H200: faster than XLA there).
KERNEL_MAX_TOKENS = 16
# Largest batch that `routing_kernel` fuses by default (H200, session 33, spans with the state passed, both with
# the picks by keys: 8.0 / 9.0 / 9.9 / 11.5 µs at 4 / 5 / 6 / 8 tokens against the two kernels' 9.5 / 15.7 / 15.7 /
# 11.9; session 32, the argmax picks: at 16 tokens 19.1 against 18.6).
FUSED_MAX_TOKENS = 8


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
    use_kernel: bool | None = None,
    num_tokens: Int[Array, ""] | None = None,
    state: Int[Array, " slots"] | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]] | tuple[Array, Array, Int[Array, " slots"]]:
    """Beam's routing. `use_kernel=None`: the kernel on a GPU for decode batches of at most
    `KERNEL_MAX_TOKENS` tokens, where it beats XLA's fusion of the reference; the reference
    otherwise. `num_tokens`: tokens from it on are padding and select expert -1 with weight 0 (the
    kernel skips their work). `state`: the fused kernel's state passed from call to call (`routing_kernel`);
    then (weights, ids, state) come back, the state untouched off the kernel."""
    kwargs = dict(
        num_groups=num_groups, groups_kept=groups_kept, top_k=top_k, normalize=normalize, scaling=scaling
    )
    if use_kernel is None:
        use_kernel = jax.default_backend() == "gpu" and x.shape[0] <= KERNEL_MAX_TOKENS
    if use_kernel:
        return routing_kernel(x, router_weight, correction_bias, num_tokens=num_tokens, state=state,
                              interpret=interpret, **kwargs)
    selection = routing_reference(x, router_weight, correction_bias, **kwargs)
    if num_tokens is not None:
        selection = _mask_padding(*selection, num_tokens)
    return selection if state is None else (*selection, state)
