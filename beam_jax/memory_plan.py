"""Per-GPU memory plan for serving Beam under tensor parallelism: weights, KV cache groups, pool.

Everything is computed from the config and the real parameter shapes and dtypes
(`model.abstract_flat`), not from constants; the only stated inputs are the blog's drafter weight
figure (`DFLASH.stated_weight_gib_per_gpu`) and the serving knobs (HBM size, memory fraction,
reserve). `plan_memory(config, ...)` returns a `MemoryPlan`; `format_plan(plan)` renders it.

Rules (see the docstrings of each function for the arithmetic):

* Weights. Experts alone take the weight format (`bf16`, `fp8` per-channel, `nvfp4`); attention,
  the dense MLPs, the embedding and the head stay bf16, the router fp32. The embedding, the router
  (weight and correction bias) and the norm weights are replicated on every GPU; everything else is
  split `tp` ways. Expert matrices are sized on their per-GPU shard: gate and up split their output
  rows (column parallel), down splits its input columns (row parallel), and each shard keeps its
  own per-matrix scalars. (The blog's FP8 checkpoint, 503 GB on disk, suggests FP8 attention and
  dense MLPs as well; keeping them bf16, as the spec says, gives 61.05 GiB per GPU against the
  blog's 61.2, where FP8 for them would give about 60.3.)
* KV cache. One layer costs `2 * ceil(kv_heads / tp) * head_dim * 2` bytes per token per GPU.
  Layers are grouped by KV lifetime (full history, or one group per window size); each windowed
  group with more layers than the target model's full-attention group is split into near-equal
  contiguous groups of at most that size (Beam: 43 sliding layers -> 5 groups of 9, 9, 9, 8, 8).
  A full-history drafter (DFlash) then joins the full group (9 + 5 = 14 layers); the sliding split
  is the model's own and does not change when a drafter is switched on, as in the blog, where the
  same 5 groups of <= 9 serve with and without the drafter. All groups share one pool of 64-token
  pages sized for the largest group, so the pool's KV bytes per token are the largest group's.
* Pool. `usable = hbm * mem_fraction - weights - drafter weights - reserve`, in whole pages.
  `hbm_gb` is decimal (186 GB = 186e9 bytes = 173.2 GiB): that reading reproduces the blog's pools;
  reading it as 186 GiB would put 12 GiB more into every pool (+10 % tokens for NVFP4, +28 % for
  BF16). `DEFAULT_RESERVE_GIB` is fitted to the blog (see there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import jax.numpy as jnp

from beam_jax.config import BeamConfig

GIB = 2**30
KIB = 2**10
DECIMAL_GB = 10**9
BF16_BYTES = 2
FP32_BYTES = 4

# "nvfp4-mosaic": NVFP4 experts as the model holds them on Hopper GPUs, repacked for the Mosaic kernel.
QuantFormat = Literal["bf16", "fp8", "nvfp4", "nvfp4-mosaic"]
QUANT_FORMATS: tuple[str, ...] = ("bf16", "fp8", "nvfp4", "nvfp4-mosaic")

PAGE_TOKENS = 64
NVFP4_BLOCK = 16

# Activations, workspaces and CUDA graphs left outside the KV pool, per GPU. Fitted (minimax) to
# the blog: with the weights this module computes, 1.25 GiB puts the three pools with the drafter
# (18.8M / 15.2M / 6.53M tokens) within 0.6 % each (1.0 to 2.0 GiB keeps them within 1.5 %). The
# blog's own weight figures, 0.15-0.85 GiB above ours, imply 0.5-1.2 GiB, and the blog reports that
# raising the graph size from 2,048 to 8,192 tokens costs 2.0-2.5 GiB more, so a reserve of about
# a gigabyte for graphs of up to 2,048 tokens and the kernels' workspaces is of the right size.
DEFAULT_RESERVE_GIB = 1.25


# ---- weights -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExpertMatrices:
    """`count` expert matrices `[out_features, in_features]` split along `split_dim` under TP."""

    count: int
    out_features: int
    in_features: int
    split_dim: Literal["out", "in"]

    def shard_shape(self, tp: int) -> tuple[int, int]:
        if self.split_dim == "out":
            return ceil_div(self.out_features, tp), self.in_features
        return self.out_features, ceil_div(self.in_features, tp)


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Weight bytes held by one GPU, experts apart from the rest (`rest_by_part` breaks it down)."""

    experts: int
    rest_by_part: Mapping[str, int]

    @property
    def rest(self) -> int:
        return sum(self.rest_by_part.values())

    @property
    def total(self) -> int:
        return self.experts + self.rest


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bf16_matrix_bytes(out_features: int, in_features: int) -> int:
    return out_features * in_features * BF16_BYTES


def fp8_matrix_bytes(out_features: int, in_features: int) -> int:
    """e4m3 values plus one fp32 scale per output channel (`weight_scale [out, 1]`)."""
    return out_features * in_features + out_features * FP32_BYTES


def nvfp4_matrix_bytes(out_features: int, in_features: int) -> int:
    """Packed e2m1 (`uint8 [out, in/2]`), e4m3 block scales (`[out, in/16]`), and two fp32
    scalars: `weight_scale_2` (global) and `input_scale`."""
    packed = out_features * ceil_div(in_features, 2)
    block_scales = out_features * ceil_div(in_features, NVFP4_BLOCK)
    return packed + block_scales + 2 * FP32_BYTES


def nvfp4_mosaic_matrix_bytes(out_features: int, in_features: int) -> int:
    """NVFP4 in the Mosaic kernel's layout (`pallas_kernels.nvfp4_moe_mgpu.KernelNvfp4`, made at load
    time on Hopper): the packed values, the block scales as one-byte codes, and the global scale as
    fp32 per output row (no input scale)."""
    packed = out_features * ceil_div(in_features, 2)
    block_scales = out_features * ceil_div(in_features, NVFP4_BLOCK)
    return packed + block_scales + out_features * FP32_BYTES


MATRIX_BYTES = {"bf16": bf16_matrix_bytes, "fp8": fp8_matrix_bytes, "nvfp4": nvfp4_matrix_bytes,
                "nvfp4-mosaic": nvfp4_mosaic_matrix_bytes}


def expert_matrices(name: str, shape: tuple[int, ...]) -> ExpertMatrices:
    """The matrices behind an expert parameter, fused (`gate_up_proj [E, 2I, H]`,
    `down_proj [E, H, I]`) or per expert (`experts.{e}.{gate,up,down}_proj.weight [out, in]`)."""
    if name.endswith("experts.gate_up_proj"):
        num_experts, two_i, hidden = shape
        return ExpertMatrices(2 * num_experts, two_i // 2, hidden, "out")
    if name.endswith("experts.down_proj"):
        num_experts, hidden, inter = shape
        return ExpertMatrices(num_experts, hidden, inter, "in")
    out_features, in_features = shape
    split_dim = "in" if name.endswith("down_proj.weight") else "out"
    return ExpertMatrices(1, out_features, in_features, split_dim)


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def weight_part(name: str) -> str:
    """The non-expert part a parameter belongs to, for the breakdown of `WeightBytes.rest`."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if ".mlp.gate." in name:
        return "router"
    if name.endswith("norm.weight"):
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    raise ValueError(f"parameter {name!r} belongs to no known part")


REPLICATED_PARTS = frozenset({"embedding", "router", "norms"})


def expert_bytes_per_gpu(name: str, shape: tuple[int, ...], quant: QuantFormat, tp: int) -> int:
    matrices = expert_matrices(name, shape)
    return matrices.count * MATRIX_BYTES[quant](*matrices.shard_shape(tp))


def dense_bytes_per_gpu(part: str, shape: tuple[int, ...], itemsize: int, tp: int) -> int:
    size = math.prod(shape) * itemsize
    return size if part in REPLICATED_PARTS else ceil_div(size, tp)


def weight_bytes_per_gpu(
    shapes: Mapping[str, tuple[tuple[int, ...], int]], *, quant: QuantFormat, tp: int
) -> WeightBytes:
    """Per-GPU weight bytes from `{name: (shape, bf16/fp32 itemsize)}` of every parameter."""
    if quant not in MATRIX_BYTES:
        raise ValueError(f"unknown weight format {quant!r}; choose one of {QUANT_FORMATS}")
    experts = 0
    rest: dict[str, int] = {}
    for name, (shape, itemsize) in shapes.items():
        if is_expert(name):
            experts += expert_bytes_per_gpu(name, shape, quant, tp)
        else:
            part = weight_part(name)
            rest[part] = rest.get(part, 0) + dense_bytes_per_gpu(part, shape, itemsize, tp)
    return WeightBytes(experts=experts, rest_by_part=rest)


def parameter_shapes(config: BeamConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """`{HF name: (shape, itemsize)}` from the model's abstract parameters (bf16, router fp32)."""
    from beam_jax.model import abstract_flat  # the model pulls in flax: import it only when planning

    return {
        name: (tuple(leaf.shape), jnp.dtype(leaf.dtype).itemsize)
        for name, leaf in abstract_flat(config, jnp.bfloat16).items()
    }


# ---- drafters ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """A speculative-decoding drafter as far as memory goes: its KV layers and its weights.

    `window=None` means its layers keep the full history (they join the full-attention group).
    Weights: `stated_weight_gib_per_gpu` (a measured figure, used as is) takes precedence over
    `num_params` (computed as bf16 parameters split `tp` ways)."""

    name: str
    num_layers: int
    window: int | None
    num_key_value_heads: int
    head_dim: int
    stated_weight_gib_per_gpu: float | None = None
    num_params: int | None = None

    def weight_bytes_per_gpu(self, tp: int) -> int:
        if self.stated_weight_gib_per_gpu is not None:
            return round(self.stated_weight_gib_per_gpu * GIB)
        if self.num_params is not None:
            return ceil_div(self.num_params * BF16_BYTES, tp)
        raise ValueError(f"drafter {self.name!r} has neither a stated weight figure nor a parameter count")

    def weight_source(self) -> str:
        if self.stated_weight_gib_per_gpu is not None:
            return "stated (blog), not computed"
        return f"computed: {self.num_params / 1e9:.2f}B bf16 params / tp"


def dflash2_matrix_params(
    hidden: int = 5120, q_heads: int = 40, kv_heads: int = 8, head_dim: int = 128,
    intermediate: int = 17408, num_layers: int = 5, num_target_layers: int = 5,
) -> int:
    """DFlash2's matrices as the spec names them: `fc` (5*hidden -> hidden), then per layer
    q/k/v/o and a SwiGLU MLP. Convolutions, the candidate selector and norms are left out."""
    attention = hidden * (q_heads * head_dim) * 2 + hidden * (kv_heads * head_dim) * 2
    mlp = 3 * hidden * intermediate
    return num_target_layers * hidden * hidden + num_layers * (attention + mlp)


# The blog's DFlash: 5 full-history layers, 1.93B parameters, "adding 1.40 GiB per GPU" (stated;
# 1.93B bf16 parameters split 8 ways would be 0.45 GiB, so its layout is not fully sharded).
DFLASH = DrafterSpec(
    name="dflash", num_layers=5, window=None, num_key_value_heads=8, head_dim=128,
    stated_weight_gib_per_gpu=1.40, num_params=1_930_000_000,
)
# SGLang / vLLM's DFlash2: 5 layers sliding over 4096 tokens; weights computed from its matrices.
DFLASH2 = DrafterSpec(
    name="dflash2", num_layers=5, window=4096, num_key_value_heads=8, head_dim=128,
    num_params=dflash2_matrix_params(),
)


# ---- KV cache groups -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheLayer:
    """One attention layer's KV: `label` (`L5` target layer 5, `D0` drafter layer 0), its window
    (None: full history), and its KV bytes per token on one GPU."""

    label: str
    window: int | None
    kv_bytes_per_token: int


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    window: int | None
    layers: tuple[CacheLayer, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(layer.kv_bytes_per_token for layer in self.layers)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(layer.label for layer in self.layers)

    def pages_per_session(self, context_tokens: int, page_tokens: int) -> int:
        """Pages one request of `context_tokens` holds at its peak: the whole history, or the
        pages a window of `window` consecutive tokens can straddle (window 512: 9 pages of 64)."""
        history_pages = ceil_div(context_tokens, page_tokens)
        if self.window is None:
            return history_pages
        return min(history_pages, ceil_div(self.window - 1, page_tokens) + 1)


def group_by_lifetime(layers: Iterable[CacheLayer]) -> list[CacheGroup]:
    """One group per KV lifetime, full history first, then windows from short to long."""
    by_window: dict[int | None, list[CacheLayer]] = {}
    for layer in layers:
        by_window.setdefault(layer.window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [CacheGroup(window, tuple(by_window[window])) for window in order]


def split_evenly(layers: Sequence[CacheLayer], max_layers: int) -> list[tuple[CacheLayer, ...]]:
    """Contiguous runs of near-equal length (larger first), none longer than `max_layers`:
    43 layers with at most 9 -> 9, 9, 9, 8, 8."""
    if max_layers < 1:
        raise ValueError(f"max_layers must be >= 1, got {max_layers}")
    num_groups = ceil_div(len(layers), max_layers)
    base, extra = divmod(len(layers), num_groups)
    runs, start = [], 0
    for index in range(num_groups):
        length = base + (index < extra)
        runs.append(tuple(layers[start : start + length]))
        start += length
    return runs


def plan_cache_groups(layers: Sequence[CacheLayer], *, split_limit: int | None) -> tuple[CacheGroup, ...]:
    """Group layers by KV lifetime and split each windowed group larger than `split_limit` into
    near-equal groups of at most `split_limit` layers. The full-history group is never split
    (every page of it holds history that can never be released); `split_limit=None` splits nothing."""
    planned: list[CacheGroup] = []
    for group in group_by_lifetime(layers):
        if group.window is None or split_limit is None or len(group.layers) <= split_limit:
            planned.append(group)
        else:
            planned.extend(CacheGroup(group.window, run) for run in split_evenly(group.layers, split_limit))
    return tuple(planned)


def pool_kv_bytes_per_token(groups: Sequence[CacheGroup]) -> int:
    """Pages are equal in size across groups, sized for the largest group."""
    return max(group.kv_bytes_per_token for group in groups)


def kv_bytes_per_token_per_layer(num_key_value_heads: int, head_dim: int, tp: int) -> int:
    """K and V, bf16, for the KV heads one GPU holds (heads are replicated when tp > kv heads)."""
    return 2 * ceil_div(num_key_value_heads, tp) * head_dim * BF16_BYTES


def target_cache_layers(config: BeamConfig, tp: int) -> list[CacheLayer]:
    per_layer = kv_bytes_per_token_per_layer(config.num_key_value_heads, config.head_dim, tp)
    return [CacheLayer(f"L{i}", config.window(i), per_layer) for i in range(config.num_hidden_layers)]


def drafter_cache_layers(drafter: DrafterSpec, tp: int) -> list[CacheLayer]:
    per_layer = kv_bytes_per_token_per_layer(drafter.num_key_value_heads, drafter.head_dim, tp)
    return [CacheLayer(f"D{j}", drafter.window, per_layer) for j in range(drafter.num_layers)]


def model_split_limit(config: BeamConfig) -> int | None:
    """The size cap for windowed groups: the target model's own full-attention layer count (Beam: 9),
    or no split for a model without full attention."""
    full_layers = sum(config.window(i) is None for i in range(config.num_hidden_layers))
    return full_layers or None


# ---- the plan ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory under TP. Byte counts are per GPU; see `format_plan` for a readable view."""

    tp: int
    quant: str
    hbm_bytes: int
    mem_fraction: float
    reserve_bytes: int
    weights: WeightBytes
    drafter: DrafterSpec | None
    drafter_weight_bytes: int
    cache_groups: tuple[CacheGroup, ...]
    # The same layers without splitting: every sliding layer of one window in a single group.
    unsplit_cache_groups: tuple[CacheGroup, ...]
    page_tokens: int
    context_tokens: int

    @property
    def kv_bytes_per_token(self) -> int:
        return pool_kv_bytes_per_token(self.cache_groups)

    @property
    def single_group_kv_bytes_per_token(self) -> int:
        return pool_kv_bytes_per_token(self.unsplit_cache_groups)

    @property
    def capacity_gain_vs_single_group(self) -> float:
        """Tokens the split layout holds per token of the single-sliding-group layout, same pool."""
        return self.single_group_kv_bytes_per_token / self.kv_bytes_per_token

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token

    @property
    def usable_kv_bytes(self) -> int:
        budget = int(self.hbm_bytes * self.mem_fraction)
        return max(0, budget - self.weights.total - self.drafter_weight_bytes - self.reserve_bytes)

    @property
    def pool_pages(self) -> int:
        return self.usable_kv_bytes // self.page_bytes

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.page_tokens

    @property
    def pages_per_session(self) -> int:
        """Pages of one `context_tokens` request across all groups (sliding groups hold a window)."""
        return sum(group.pages_per_session(self.context_tokens, self.page_tokens) for group in self.cache_groups)

    @property
    def full_context_sessions(self) -> int:
        return self.pool_pages // self.pages_per_session


def resolve_drafter(drafter: bool | DrafterSpec | None) -> DrafterSpec | None:
    if drafter is True:
        return DFLASH
    if drafter is False or drafter is None:
        return None
    return drafter


def plan_memory(
    config: BeamConfig,
    *,
    tp: int = 8,
    quant: QuantFormat = "nvfp4",
    drafter: bool | DrafterSpec | None = True,
    hbm_gb: float = 186.0,
    mem_fraction: float = 0.95,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    page_tokens: int = PAGE_TOKENS,
    context_tokens: int | None = None,
    split_limit: int | None = None,
) -> MemoryPlan:
    """The per-GPU memory plan of serving `config` with `tp`-way tensor parallelism.

    `drafter`: True for the blog's DFlash (`DFLASH`), False/None for none, or a `DrafterSpec`.
    `hbm_gb`: decimal GB per GPU (GB200: 186). `context_tokens`: the session length that
    `full_context_sessions` counts (default `config.max_position_embeddings`). `split_limit`:
    the largest windowed cache group (default: the model's full-attention layer count)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    spec = resolve_drafter(drafter)
    layers = target_cache_layers(config, tp) + (drafter_cache_layers(spec, tp) if spec else [])
    limit = split_limit if split_limit is not None else model_split_limit(config)
    return MemoryPlan(
        tp=tp,
        quant=quant,
        hbm_bytes=round(hbm_gb * DECIMAL_GB),
        mem_fraction=mem_fraction,
        reserve_bytes=round(reserve_gib * GIB),
        weights=weight_bytes_per_gpu(parameter_shapes(config), quant=quant, tp=tp),
        drafter=spec,
        drafter_weight_bytes=spec.weight_bytes_per_gpu(tp) if spec else 0,
        cache_groups=plan_cache_groups(layers, split_limit=limit),
        unsplit_cache_groups=plan_cache_groups(layers, split_limit=None),
        page_tokens=page_tokens,
        context_tokens=context_tokens if context_tokens is not None else config.max_position_embeddings,
    )


# ---- rendering -----------------------------------------------------------------------------------
def gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def kib(num_bytes: int) -> str:
    return f"{num_bytes / KIB:.1f} KiB"


def describe_window(window: int | None) -> str:
    return "full history" if window is None else f"window {window}"


def format_group(index: int, group: CacheGroup) -> str:
    return (
        f"  group {index}: {describe_window(group.window):<13} {len(group.layers):>2} layers "
        f"{kib(group.kv_bytes_per_token):>9}/token  {' '.join(group.labels)}"
    )


def format_plan(plan: MemoryPlan) -> str:
    """A readable per-GPU table of the plan."""
    drafter = plan.drafter
    rest_parts = ", ".join(f"{part} {gib(size)}" for part, size in sorted(plan.weights.rest_by_part.items()))
    lines = [
        f"Memory plan per GPU: TP{plan.tp}, {plan.quant} experts, "
        f"drafter {drafter.name if drafter else 'off'}, HBM {plan.hbm_bytes / DECIMAL_GB:g} GB "
        f"x {plan.mem_fraction:g}, reserve {gib(plan.reserve_bytes)}",
        "weights",
        f"  experts                 {gib(plan.weights.experts):>11}",
        f"  rest                    {gib(plan.weights.rest):>11}  ({rest_parts})",
        f"  total                   {gib(plan.weights.total):>11}",
        f"  drafter                 {gib(plan.drafter_weight_bytes):>11}  ({drafter.weight_source()})"
        if drafter
        else "  drafter                         off",
        "KV cache (bf16, pages of %d tokens)" % plan.page_tokens,
        f"  per token, split groups {kib(plan.kv_bytes_per_token):>11}",
        f"  per token, one sliding  {kib(plan.single_group_kv_bytes_per_token):>11}"
        f"  (split holds {plan.capacity_gain_vs_single_group:.2f}x the tokens)",
        *[format_group(i, group) for i, group in enumerate(plan.cache_groups)],
        "pool",
        f"  usable for KV           {gib(plan.usable_kv_bytes):>11}",
        f"  pages x tokens          {plan.pool_pages:,} x {plan.page_tokens} = {plan.pool_tokens:,} tokens "
        f"({plan.pool_tokens / 1e6:.2f}M)",
        f"  {plan.context_tokens:,}-token sessions  {plan.full_context_sessions}"
        f"  ({plan.pages_per_session:,} pages each)",
    ]
    return "\n".join(lines)
