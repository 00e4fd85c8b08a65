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
`fused=True` (the default for one token) runs the select in the logits kernel instead: the program
that finishes last for a token block (an atomic counter per block) selects for it, one launch.
The selections equal the reference's on 100k random tokens (H200, benchmarks/moe/RESULTS.md).

Speed (benchmarks/moe/RESULTS.md): faster than XLA for decode batches on the H200, slower for
larger ones, so `routing()` picks the kernel only for the former.
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


def _select(logits, bias, valid, *, groups_kept: int, top_k: int, normalize: bool, scaling):
    """Selection for one token. `logits`/`bias` are laid out [padded groups, padded group size]
    (expert = group * group size + column), `valid` marks real experts. Returns fp32 weights and
    flat positions in that layout, each [next_pow2(top_k)].

    Group-wise steps are row reductions of that tile, all groups at once, and the kept groups are
    ranked by counting who beats whom."""
    padded_groups, padded_size = logits.shape
    scores = 1.0 / (1.0 + jnp.exp(-logits))
    choice = jnp.where(valid, scores + bias, -jnp.inf)

    # a group's score is the sum of its two best choices (a tied best counts twice)
    best = jnp.max(choice, axis=1)
    is_best = choice == best[:, None]
    second = jnp.where(jnp.sum(is_best.astype(jnp.int32), axis=1) >= 2, best,
                       jnp.max(jnp.where(is_best, -jnp.inf, choice), axis=1))
    group_score = best + second  # -inf for padded groups: they never beat a real one
    group = lax.iota(jnp.int32, padded_groups)
    beaten_by = (group_score[None, :] > group_score[:, None]) | (
        (group_score[None, :] == group_score[:, None]) & (group[None, :] < group[:, None]))
    kept = jnp.sum(beaten_by.astype(jnp.int32), axis=1) < groups_kept  # ties: lower index
    choice = jnp.where(kept[:, None], choice, -jnp.inf)

    # top-k on the flattened tile (position = group * padded size + column): one (value, index)
    # reduction per pick, the only chain of dependent reductions
    choice, scores = choice.reshape(-1), scores.reshape(-1)
    position = lax.iota(jnp.int32, choice.shape[0])
    padded_k = _next_pow2(top_k)
    slot = lax.iota(jnp.int32, padded_k)
    picks = jnp.zeros((padded_k,), jnp.int32)
    weights = jnp.zeros((padded_k,), jnp.float32)
    for k in range(top_k):
        pick = jnp.argmax(choice).astype(jnp.int32)  # ties: lower index
        picked = position == pick
        picks = jnp.where(slot == k, pick, picks)
        weights = jnp.where(slot == k, jnp.sum(jnp.where(picked, scores, 0.0)), weights)
        choice = jnp.where(picked, -jnp.inf, choice)
    if normalize:
        weights = weights / (jnp.sum(weights) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, picks


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


def _select_token(partial_ref, bias_ref, weights_ref, ids_ref, token, *, experts, num_groups, select, volatile):
    """One token: sum its partial logits (in split order), select, store."""
    from jax.experimental.pallas import triton as plgpu

    size = experts // num_groups
    shape = (_next_pow2(num_groups), _next_pow2(size))
    group, column = lax.broadcasted_iota(jnp.int32, shape, 0), lax.broadcasted_iota(jnp.int32, shape, 1)
    valid = (group < num_groups) & (column < size)
    expert = jnp.where(valid, group * size + column, 0)
    logits = jnp.zeros(shape, jnp.float32)
    for s in range(partial_ref.shape[0]):  # fixed order: the sum does not depend on scheduling
        logits = logits + plgpu.load(partial_ref.at[jnp.int32(s), token, expert], mask=valid, other=0.0,
                                     volatile=volatile)
    bias = plgpu.load(bias_ref.at[expert], mask=valid, other=0.0)
    weights, picks = select(logits, bias, valid)
    slots = lax.iota(jnp.int32, weights.shape[0])
    plgpu.store(weights_ref.at[token, slots], weights)
    plgpu.store(ids_ref.at[token, slots], (picks // shape[1]) * size + picks % shape[1])


def _select_kernel(num_tokens_ref, partial_ref, bias_ref, weights_ref, ids_ref, **kwargs):
    token = pl.program_id(0)

    @pl.when(token < num_tokens_ref[0])  # padding: left unwritten (`routing_kernel` masks it)
    def _():
        _select_token(partial_ref, bias_ref, weights_ref, ids_ref, token, volatile=False, **kwargs)


def _fused_routing_kernel(x_ref, w_ref, bias_ref, counter_in_ref, partial_ref, weights_ref, ids_ref, counter_ref,
                          *, block_t, interpret, select_args, reset_counter, **tile):
    """Partial logits, then the program that finishes last in a token block (an atomic counter says
    which) selects for the block's tokens: one launch. `reset_counter`: that program then sets the block's
    counter back to zero (every other program of the block has counted), for the next call."""
    del counter_in_ref  # aliased to counter_ref
    from jax.experimental.pallas import triton as plgpu

    t_block, e_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    acc = _partial_logits(x_ref, w_ref, t_block, e_block, split, block_t=block_t, **tile)
    block_e = tile["block_e"]
    partial_ref[split, pl.ds(t_block * block_t, block_t), pl.ds(e_block * block_e, block_e)] = acc
    if not interpret:
        plgpu.debug_barrier()  # every thread's partial store is ordered before the release below
    # a scalar atomic, so it runs once per program (acq_rel: this program's stores are released)
    finished_before = plgpu.atomic_add(counter_ref, (jnp.asarray(t_block, jnp.int32),), jnp.ones((), jnp.int32))

    @pl.when(finished_before == pl.num_programs(1) * pl.num_programs(2) - 1)
    def _select_last():
        for row in range(block_t):  # other programs' partials: volatile loads, past the L1
            _select_token(partial_ref, bias_ref, weights_ref, ids_ref, t_block * block_t + row, volatile=True,
                          **select_args)
        if reset_counter:  # a plain store: nothing in this launch reads the counter after the last count
            plgpu.store(counter_ref.at[t_block + jnp.arange(1)], jnp.zeros((1,), jnp.int32))


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
    counter: Int[Array, " n"] | None = None,
    interpret: bool = False,
):
    """The routing kernels (see the module docstring). By default batches of up to 64 tokens take
    the CUDA-core GEMV path in token blocks of at most 4, larger ones blocks of 16 on the dot path;
    `splits` divides the hidden axis so that the logits grid has about `target_programs`
    programs (enough to stream the 5 MB router); one fused token instead loads one [2, 1024] router
    slice per program. `fused` selects in the logits kernel's last program of each token block
    instead of a second launch; by default only for one token (H200, run M: 5.73 against 6.91 µs;
    slower from 2 tokens on, where that program selects one token after the other). `logits_only`
    returns the kernel's fp32 logits [tokens, experts] (for tests). `num_tokens`: only the first
    `num_tokens` tokens are real (a serving step padded to its bucket); the two-kernel path reads and
    selects nothing for the rest, and their selection comes back as expert -1, weight 0 (`routing`).
    `counter`: int32 zeros, at least one per token block, for the fused kernel's ticket counter; the kernel
    leaves them zero and (weights, ids, counter) come back, the counter for the next call. Passed from call
    to call (e.g. layer to layer, `PagedBatch.routing_counter`), it spares each call the copy of a zeroed
    counter into the buffer the kernel counts in (1.1 µs of a 7.7 µs call at T = 1 on the H200, session 28);
    the two-kernel path returns it untouched."""
    from jax.experimental.pallas import triton as plgpu

    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if experts % num_groups or experts // num_groups < 2:
        raise ValueError(f"{experts} experts cannot form {num_groups} groups of at least 2")
    if not 1 <= top_k <= groups_kept * (experts // num_groups):
        raise ValueError(f"top_k={top_k} needs 1..{groups_kept * (experts // num_groups)} experts in the kept groups")
    if fused is None:
        fused = tokens == 1
    if block_t is None:  # H200 (benchmarks/moe/RESULTS.md): GEMV blocks of <= 4 tokens beat the dot to T = 64
        block_t = min(_next_pow2(tokens), 4) if tokens <= 64 else 16
    # One token, fused: one load of a [2 experts, 1024] slice per program, 640 programs (H200, run M:
    # 5.73 us; 5.89 with 4 experts, 6.84 with run H's 8 x 256 slices in 3 pipelined steps)
    one_load = fused and block_t == 1
    if block_e is None:
        block_e = 2 if one_load else 8 if block_t == 1 else 16
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
    select = functools.partial(_select, groups_kept=groups_kept, top_k=top_k, normalize=normalize, scaling=scaling)
    select_args = dict(experts=experts, num_groups=num_groups, select=select)
    padded_k = _next_pow2(top_k)
    selection_shapes = [jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.float32),
                        jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.int32)]
    bias = correction_bias.astype(jnp.float32)
    if counter is not None and (counter.dtype != jnp.int32 or counter.ndim != 1 or counter.shape[0] < token_blocks):
        raise ValueError(f"counter must be int32 [n >= {token_blocks}] (one per token block), got "
                         f"{counter.dtype}{list(counter.shape)}")
    if fused:
        ticket = jnp.zeros((token_blocks,), jnp.int32) if counter is None else counter
        _, weights, ids, ticket = pl.pallas_call(
            functools.partial(_fused_routing_kernel, block_t=block_t, interpret=interpret, select_args=select_args,
                              reset_counter=counter is not None, **tile),
            grid=grid, out_shape=[partial_shape, *selection_shapes, jax.ShapeDtypeStruct(ticket.shape, jnp.int32)],
            input_output_aliases={3: 3}, compiler_params=logits_params, interpret=interpret, name="beam_routing",
        )(x, router_weight, bias, ticket)
        selection = _mask_padding(weights[:tokens, :top_k], ids[:tokens, :top_k], num_tokens)
        return selection if counter is None else (*selection, ticket)
    # One token per program and one warp: the selection's reductions stay inside a warp (shuffles,
    # no shared-memory round trips).
    partials = partial_logits()
    weights, ids = pl.pallas_call(
        functools.partial(_select_kernel, **select_args),
        grid=(padded_tokens,),
        out_shape=selection_shapes,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="beam_router_select",
    )(real, partials, bias)
    selection = _mask_padding(weights[:tokens, :top_k], ids[:tokens, :top_k], num_tokens)
    return selection if counter is None else (*selection, counter)


def _mask_padding(weights, ids, num_tokens):
    """Tokens from `num_tokens` on (padding) select expert -1 with weight 0, which no expert path
    computes (`moe_gemm._local_pairs`)."""
    if num_tokens is None:
        return weights, ids
    real = (jnp.arange(ids.shape[0]) < num_tokens)[:, None]
    return jnp.where(real, weights, 0.0).astype(weights.dtype), jnp.where(real, ids, -1).astype(ids.dtype)


# Largest batch for which `routing()` picks the kernel on a GPU (H200: faster than XLA there).
KERNEL_MAX_TOKENS = 16
# A ticket counter passed from call to call (`routing_kernel(counter=)`): one per token block of any batch the
# kernel path takes (blocks hold at least one token).
COUNTER_SLOTS = KERNEL_MAX_TOKENS


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
    counter: Int[Array, " n"] | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]] | tuple[Array, Array, Int[Array, " n"]]:
    """Beam's routing. `use_kernel=None`: the kernel on a GPU for decode batches of at most
    `KERNEL_MAX_TOKENS` tokens, where it beats XLA's fusion of the reference; the reference
    otherwise. `num_tokens`: tokens from it on are padding and select expert -1 with weight 0 (the
    kernel skips their work). `counter`: the kernel's ticket counter passed from call to call
    (`routing_kernel`); then (weights, ids, counter) come back, the counter untouched off the kernel."""
    kwargs = dict(
        num_groups=num_groups, groups_kept=groups_kept, top_k=top_k, normalize=normalize, scaling=scaling
    )
    if use_kernel is None:
        use_kernel = jax.default_backend() == "gpu" and x.shape[0] <= KERNEL_MAX_TOKENS
    if use_kernel:
        return routing_kernel(x, router_weight, correction_bias, num_tokens=num_tokens, counter=counter,
                              interpret=interpret, **kwargs)
    selection = routing_reference(x, router_weight, correction_bias, **kwargs)
    if num_tokens is not None:
        selection = _mask_padding(*selection, num_tokens)
    return selection if counter is None else (*selection, counter)
