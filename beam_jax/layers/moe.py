"""Beam's MoE block: fp32 sigmoid routing with a correction bias and group-limited top-k, routed
experts with fp32 SwiGLU, and the routed scaling factor applied after aggregation."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig
from beam_jax.layers.linear import matmul_precision
from beam_jax.layers.mlp import swiglu
from beam_jax.layers.quantized import QuantizedExpertLinear, dequantize_experts, packed_expert_weights
from beam_jax.quant.kernel_layout import DOWN_TILE_K, GATE_UP_TILE_K, KernelNvfp4Linear, kernel_weights, on_hopper
from beam_jax.sharding import experts_on_mesh, mesh_shards_experts
from pallas_kernels import bf16_moe_mgpu, nvfp4_mgpu, nvfp4_moe_mgpu
from pallas_kernels.moe_gemm import ExpertWeights, moe_gemm
from pallas_kernels.routing import routing as route  # fp32 routing (the kernel for GPU decode batches)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def experts_reference(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    indices: Int[Array, "tokens k"],
    gate_up_proj: Float[Array, "experts two_i hidden"],
    down_proj: Float[Array, "experts hidden i"],
    expert_offset: int | Int[Array, ""] = 0,
) -> Float[Array, "tokens hidden"]:
    """Weighted sum of each token's experts, in plain jnp: the (token, expert) pairs are sorted by
    expert and run as two ragged matmuls. As in the reference, each weighted expert output is
    rounded to the input dtype and a token's outputs are added in increasing expert order, each
    addition rounded (in bf16 the order changes the result).

    The weights may be one device's share under expert parallelism: experts
    `expert_offset .. expert_offset + len(gate_up_proj)`; pairs routed to other experts count zero."""
    tokens, top_k = indices.shape
    num_experts = gate_up_proj.shape[0]
    local_experts = indices.reshape(-1) - expert_offset
    is_local = (local_experts >= 0) & (local_experts < num_experts)
    # Pairs of other devices' experts sort last, past every group (ragged_dot leaves their rows alone).
    flat_experts = jnp.where(is_local, local_experts, num_experts)
    order = jnp.argsort(flat_experts, stable=True)
    token_of_pair = order // top_k
    group_sizes = jnp.bincount(flat_experts, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    precision = matmul_precision(gate_up_proj.dtype)
    # Weights are [out, in] (HF layout): contract the lhs feature dim with the rhs dim 2.
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    gate_up = jax.lax.ragged_dot_general(x[token_of_pair], gate_up_proj, group_sizes, dims, precision=precision)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jax.lax.ragged_dot_general(swiglu(gate, up), down_proj, group_sizes, dims, precision=precision)
    pair_weights = weights.reshape(-1)[order][:, None]
    weighted = jnp.where(is_local[order][:, None], (out.astype(jnp.float32) * pair_weights).astype(x.dtype), 0)
    # Back to [tokens, k] with each token's experts in increasing expert order: the sort was
    # stable by expert, so pair j of a token in sorted order lands in slot rank(j).
    slot_in_token = jnp.argsort(jnp.argsort(indices, axis=1, stable=True), axis=1).reshape(-1)[order]
    per_token = jnp.zeros((tokens, top_k, x.shape[1]), x.dtype).at[token_of_pair, slot_in_token].set(weighted)
    total = per_token[:, 0]
    for slot in range(1, top_k):
        total = (total.astype(jnp.float32) + per_token[:, slot].astype(jnp.float32)).astype(x.dtype)
    return total


def experts_dense(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    indices: Int[Array, "tokens k"],
    gate_up_proj: Float[Array, "experts two_i hidden"],
    down_proj: Float[Array, "experts hidden i"],
) -> Float[Array, "tokens hidden"]:
    """Every expert on every token, weighted by the routing weight (zero off the selection): the
    same sum as `experts_reference`, rounded once. For training small models, where plain einsums
    differentiate and run fast and the extra FLOPs (experts / k) are cheap."""
    num_experts = gate_up_proj.shape[0]
    dense_weights = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], indices].add(weights.astype(jnp.float32))
    gate_up = jnp.einsum("th,eih->tei", x, gate_up_proj, preferred_element_type=jnp.float32).astype(x.dtype)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jnp.einsum("tei,ehi->teh", swiglu(gate, up), down_proj, preferred_element_type=jnp.float32)
    return jnp.einsum("teh,te->th", out, dense_weights).astype(x.dtype)


_DENSE_EXPERTS = contextvars.ContextVar("dense_experts", default=False)


@contextlib.contextmanager
def dense_experts_for_training():
    """Inside this block, models traced run `experts_dense` for bf16 experts (training needs
    gradients, which neither the Pallas kernels nor the sorted reference are written for)."""
    token = _DENSE_EXPERTS.set(True)
    try:
        yield
    finally:
        _DENSE_EXPERTS.reset(token)


class Router(nnx.Module):
    """`mlp.gate`: fp32 weight and correction bias, whatever the model's dtype."""

    def __init__(self, config: BeamConfig):
        self.weight = nnx.Param(jnp.zeros((config.num_experts, config.hidden_size), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
        self.num_groups = config.num_groups
        self.groups_kept = config.groups_kept
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob

    def __call__(self, x: Float[Array, "tokens hidden"], num_tokens: Int[Array, ""] | None = None,
                 state: Int[Array, " slots"] | None = None):
        """(weights, expert ids) `[tokens, top_k]`; tokens from `num_tokens` on are padding: expert -1,
        weight 0, and the routing kernel skips them. With `state` (the routing kernel's, passed from
        layer to layer: `pallas_kernels.routing.routing_kernel`), the state for the next comes third."""
        def route_here(x, weight, bias, num_tokens, state):
            return route(x, weight, bias, num_groups=self.num_groups, groups_kept=self.groups_kept, top_k=self.top_k,
                         normalize=self.normalize, num_tokens=num_tokens, state=state)

        args = (x, self.weight[...], self.e_score_correction_bias[...], num_tokens, state)
        if mesh_shards_experts():
            # Inputs and router are replicated: every device routes every token itself (the GPU's
            # kernel is a pallas_call, which XLA does not partition). check_vma=False: pallas_call
            # outputs carry no varying-axes annotation.
            out_specs = (P(),) * (2 if state is None else 3)
            return jax.shard_map(route_here, in_specs=(P(),) * 5, out_specs=out_specs, check_vma=False)(*args)
        return route_here(*args)


class Experts(nnx.Module):
    """bf16 experts fused as in the reference: `gate_up_proj [E, 2I, H]` (gate rows first),
    `down_proj [E, H, I]`. Quantized experts keep `gate_proj`, `up_proj`, `down_proj` apart, each
    packed in its checkpoint format (`QuantizedExpertLinear`), since each has its own scales. NVFP4
    experts converted at load time for the Mosaic GPU kernel (`config.mosaic_experts`) hold
    `gate_up` and `down` in its layouts instead (`beam_jax.quant.kernel_layout`)."""

    def __init__(self, config: BeamConfig, *, dtype):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.expert_format = config.expert_format
        self.mosaic_layout = config.mosaic_experts
        if self.expert_format == "bf16":
            self.gate_up_proj = nnx.Param(jnp.zeros((e, 2 * i, h), dtype))
            self.down_proj = nnx.Param(jnp.zeros((e, h, i), dtype))
        elif self.mosaic_layout:
            self.gate_up = KernelNvfp4Linear(e, 2 * i, h, GATE_UP_TILE_K)
            self.down = KernelNvfp4Linear(e, h, i, DOWN_TILE_K)
        else:
            self.gate_proj = QuantizedExpertLinear(e, i, h, self.expert_format)
            self.up_proj = QuantizedExpertLinear(e, i, h, self.expert_format)
            self.down_proj = QuantizedExpertLinear(e, h, i, self.expert_format)

    def arrays(self) -> dict[str, Array]:
        """The parameters by their names under `mlp.experts` (`gate_up_proj`, `gate_proj.weight_scale`, ...)."""
        state = nnx.to_flat_state(nnx.state(self, nnx.Param))
        return {".".join(map(str, path)): leaf.get_value() for path, leaf in state}

    def expert_weights(self) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
        """gate, up, down as the grouped-GEMM kernel takes them (packed weights stay packed)."""
        if self.mosaic_layout:
            raise ValueError("these experts are in the Mosaic kernel's layout (converted at load time): "
                             "`beam_jax.quant.kernel_layout.kernel_weights(experts.arrays())` gives them as "
                             "`moe_nvfp4` takes them; load with expert_kernel='triton' for the checkpoint layout")
        return expert_weights(self.arrays(), self.expert_format)

    def __call__(self, x, weights, indices, counters: Int[Array, " slots"] | None = None):
        """The experts' output; with `counters` (the one-launch NVFP4 kernel's, passed from layer to layer:
        `PagedBatch.moe_counters`), (output, counters for the next layer)."""
        compute = functools.partial(compute_experts, expert_format=self.expert_format, mosaic_layout=self.mosaic_layout)
        if mesh_shards_experts():  # on a tensor/expert-parallel mesh: each device its own slices
            return experts_on_mesh(compute, self.arrays(), x, weights, indices, expert_format=self.expert_format,
                                   counters=counters)
        return compute(self.arrays(), x, weights, indices, counters=counters)


def _fused_gate_up(gate_up: Array) -> Float[Array, "experts two_i hidden"]:
    """`[E, 2I, H]`, also from the mesh layout `[E, 2, I, H]` (`beam_jax.sharding.mesh_layout`)."""
    return gate_up.reshape(gate_up.shape[0], -1, gate_up.shape[-1])


def _projection(arrays: dict[str, Array], proj: str) -> dict[str, Array]:
    return {name.split(".", 1)[1]: a for name, a in arrays.items() if name.startswith(proj + ".")}


def expert_weights(arrays: dict[str, Array], expert_format: str) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
    if expert_format == "bf16":
        gate_up = _fused_gate_up(arrays["gate_up_proj"])
        intermediate = gate_up.shape[1] // 2
        return (
            ExpertWeights(gate_up, rows=intermediate),
            ExpertWeights(gate_up, row_offset=intermediate, rows=intermediate),
            ExpertWeights(arrays["down_proj"]),
        )
    gate, up, down = (packed_expert_weights(_projection(arrays, p), expert_format) for p in PROJECTIONS)
    return gate, up, down


def compute_experts(
    arrays: dict[str, Array],
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    indices: Int[Array, "tokens k"],
    *,
    expert_format: str,
    expert_offset: int | Int[Array, ""] | None = None,
    mosaic_layout: bool = False,
    counters: Int[Array, " slots"] | None = None,
):
    """The experts' output from their parameter arrays (`Experts.arrays()`, or one device's slices
    of them, holding experts from `expert_offset` on). The GPU runs the Pallas kernels (pairs routed
    to other devices' experts form no block there), or XLA's gather + einsum where that is faster
    (`pallas_kernels.moe_gemm.kernel_is_faster`); the CPU the plain-jnp reference, dequantizing
    packed weights. Experts in the Mosaic kernel's layout (`mosaic_layout`) run `mosaic_experts`; bf16
    experts at prefill sizes on Hopper the Mosaic prefill layer (`_bf16_prefill_kernel`). With `counters` (the
    one-launch NVFP4 kernel's), (output, counters) come back, untouched by the paths that do not use them."""
    if mosaic_layout:
        return mosaic_experts(arrays, x, weights, indices, expert_offset=expert_offset, counters=counters)
    out = _experts_without_counters(arrays, x, weights, indices, expert_format=expert_format,
                                    expert_offset=expert_offset)
    return out if counters is None else (out, counters)


def _experts_without_counters(arrays, x, weights, indices, *, expert_format: str, expert_offset):
    """`compute_experts` for experts not in the Mosaic kernel's layout."""
    if _DENSE_EXPERTS.get():
        if expert_format != "bf16" or expert_offset is not None:
            raise ValueError("training (dense experts) needs unquantized experts on one device")
        return experts_dense(x, weights, indices, _fused_gate_up(arrays["gate_up_proj"]), arrays["down_proj"])
    if jax.default_backend() == "gpu":  # the kernels, or XLA where it is faster (`moe_gemm`)
        if expert_format == "bf16" and _bf16_prefill_kernel(arrays, x.shape[0]):
            gate_up, down = _fused_gate_up(arrays["gate_up_proj"]), arrays["down_proj"]
            out = bf16_moe_mgpu.moe_bf16(x.astype(jnp.bfloat16), weights, indices, gate_up.astype(jnp.bfloat16),
                                         down.astype(jnp.bfloat16), expert_offset=expert_offset)
            return out.astype(x.dtype)
        return moe_gemm(x, weights, indices, *expert_weights(arrays, expert_format), expert_offset=expert_offset)
    if expert_format == "bf16":
        gate_up, down = _fused_gate_up(arrays["gate_up_proj"]), arrays["down_proj"]
    else:
        gate, up, down = (dequantize_experts(_projection(arrays, p), expert_format, x.dtype) for p in PROJECTIONS)
        gate_up = jnp.concatenate([gate, up], axis=1)
    return experts_reference(x, weights, indices, gate_up, down, 0 if expert_offset is None else expert_offset)


def _bf16_prefill_kernel(arrays: dict[str, Array], tokens: int) -> bool:
    """Whether bf16 experts run `bf16_moe_mgpu.moe_bf16` (Hopper, prefill sizes, tiles that fit)."""
    down = arrays["down_proj"]
    return (tokens >= bf16_moe_mgpu.PREFILL_MIN_TOKENS and bf16_moe_mgpu.fits(down.shape[1], down.shape[2])
            and on_hopper())


def mosaic_experts(
    arrays: dict[str, Array],
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens k"],
    indices: Int[Array, "tokens k"],
    *,
    expert_offset: int | Int[Array, ""] | None = None,
    counters: Int[Array, " slots"] | None = None,
):
    """NVFP4 experts in the Mosaic kernel's layout (`gate_up.packed`, ...; or one device's slices):
    `pallas_kernels.nvfp4_moe_mgpu.moe_nvfp4` with the Hopper kernel on the GPU (bf16 activations,
    which are what it takes) and its plain-jnp emulation of the same layouts on the CPU; with `counters`,
    (output, counters) as `moe_nvfp4` returns them."""
    gate_up, down = kernel_weights(arrays)
    on_gpu = jax.default_backend() == "gpu"
    matmul = nvfp4_mgpu.grouped_matmul if on_gpu else nvfp4_mgpu.grouped_matmul_emulated
    out = nvfp4_moe_mgpu.moe_nvfp4(x.astype(jnp.bfloat16) if on_gpu else x, weights, indices, gate_up, down,
                                   expert_offset=expert_offset, counters=counters, matmul=matmul)
    if counters is None:
        return out.astype(x.dtype)
    out, counters = out
    return out.astype(x.dtype), counters


class MoE(nnx.Module):
    def __init__(self, config: BeamConfig, *, dtype):
        self.gate = Router(config)
        self.experts = Experts(config, dtype=dtype)
        self.routed_scaling_factor = config.routed_scaling_factor

    def __call__(
        self, x: Float[Array, "... hidden"], num_tokens: Int[Array, ""] | None = None,
        routing_state: Int[Array, " slots"] | None = None,
        moe_counters: Int[Array, " slots"] | None = None,
    ) -> tuple[Array, ...]:
        """Routed experts of every token, and each token's selected experts. `num_tokens`: only the
        first `num_tokens` flat tokens are real (a serving step padded to its token bucket); the
        padding selects expert -1 (the router), which no expert path computes (its output is zero), so
        padding reads no expert weights. (The padding tokens of a step are all alike and so would pick
        the same experts: at batch 1 in a bucket of 16, as many again as the real token's.)
        `routing_state`: the routing kernel's state from the layer before (`PagedBatch.routing_state`);
        then the state for the next layer comes third. `moe_counters`: the one-launch NVFP4 kernel's counters from
        the layer before (`PagedBatch.moe_counters`); then the counters for the next layer come last."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices, *state = self.gate(flat, num_tokens, routing_state)
        if moe_counters is None:
            out, counters = self.experts(flat, weights, indices), ()
        else:
            out, *counters = self.experts(flat, weights, indices, moe_counters)
        out = out.astype(jnp.float32) * self.routed_scaling_factor
        return out.astype(x.dtype).reshape(x.shape), indices, *state, *counters
