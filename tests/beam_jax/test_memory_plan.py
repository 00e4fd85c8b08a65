"""The memory planner: byte formulas by hand on small shapes, the cache-group planner on hand-made
layer patterns, and Beam-501B at TP8 on GB200 against the TokenSpeed blog's figures."""

from __future__ import annotations

import pytest

from beam_jax.config import FULL, SLIDING, preset
from beam_jax.memory_plan import (
    DFLASH,
    DFLASH2,
    GIB,
    KIB,
    CacheGroup,
    CacheLayer,
    DrafterSpec,
    bf16_matrix_bytes,
    expert_matrices,
    format_plan,
    fp8_matrix_bytes,
    kv_bytes_per_token_per_layer,
    nvfp4_matrix_bytes,
    nvfp4_mosaic_matrix_bytes,
    parameter_shapes,
    plan_cache_groups,
    plan_memory,
    pool_kv_bytes_per_token,
    split_evenly,
    weight_bytes_per_gpu,
)

# The blog's figures (TP8, GB200 186 GB, memory fraction 0.95).
BLOG_WEIGHTS_GIB = {"nvfp4": 36.5, "fp8": 61.2, "bf16": 119.1}
BLOG_NVFP4_EXPERTS_GIB = 33.0
BLOG_POOL_TOKENS_WITH_DRAFTER = {"nvfp4": 18.8e6, "fp8": 15.2e6, "bf16": 6.53e6}
ONE_MIB_CONTEXT = 1_048_576


@pytest.fixture(scope="module")
def beam():
    return preset("beam-501b")


@pytest.fixture(scope="module")
def plans(beam):
    return {
        (quant, drafter): plan_memory(beam, tp=8, quant=quant, drafter=drafter)
        for quant in BLOG_WEIGHTS_GIB
        for drafter in (True, False)
    }


# ---- byte formulas -------------------------------------------------------------------------------
def test_matrix_byte_formulas():
    assert bf16_matrix_bytes(32, 64) == 32 * 64 * 2
    assert fp8_matrix_bytes(32, 64) == 32 * 64 + 32 * 4  # e4m3 + fp32 per output channel
    # packed e2m1 [32, 32] uint8 + e4m3 block scales [32, 4] + weight_scale_2 + input_scale
    assert nvfp4_matrix_bytes(32, 64) == 32 * 32 + 32 * 4 + 4 + 4


def test_expert_matrices_fused_and_per_expert():
    gate_up = expert_matrices("model.layers.3.mlp.experts.gate_up_proj", (256, 5120, 5120))
    assert (gate_up.count, gate_up.out_features, gate_up.in_features) == (512, 2560, 5120)
    assert gate_up.shard_shape(8) == (320, 5120)  # column parallel
    down = expert_matrices("model.layers.3.mlp.experts.down_proj", (256, 5120, 2560))
    assert (down.count, down.out_features, down.in_features) == (256, 5120, 2560)
    assert down.shard_shape(8) == (5120, 320)  # row parallel
    single = expert_matrices("model.layers.3.mlp.experts.7.down_proj.weight", (5120, 2560))
    assert (single.count, single.shard_shape(8)) == (1, (5120, 320))
    assert expert_matrices("model.layers.3.mlp.experts.7.up_proj.weight", (2560, 5120)).shard_shape(8) == (320, 5120)


def test_tiny_config_weight_bytes_by_hand():
    """beam-tiny at TP2: vocab 8192, hidden 64, 6 layers (dense 0 and 3, sparse 1, 2, 4, 5),
    4 query / 2 KV heads of 16, dense MLP 128, 16 experts of intermediate 32."""
    shapes = parameter_shapes(preset("beam-tiny"))
    tp, bf16, fp32 = 2, 2, 4
    embedding = 8192 * 64 * bf16  # replicated
    lm_head = 8192 * 64 * bf16 // tp
    attention = 6 * ((64 + 32 + 32 + 64 + 64) * 64 + 4) * bf16 // tp  # q, k, v, gate, o + gate_bias
    dense_mlp = 2 * 3 * 128 * 64 * bf16 // tp
    router = 4 * (16 * 64 + 16) * fp32  # replicated
    norms = (6 * (4 * 64 + 2 * 16) + 64) * bf16  # replicated: 4 sandwich norms, q/k norms, final
    rest = {"embedding": embedding, "lm_head": lm_head, "attention": attention,
            "dense_mlp": dense_mlp, "router": router, "norms": norms}
    # Per GPU each expert holds gate [16, 64], up [16, 64] (split rows), down [64, 16] (split columns).
    expert_shards = 4 * 16  # sparse layers x experts
    experts = {
        "bf16": expert_shards * 3 * 16 * 64 * bf16,
        "fp8": expert_shards * (2 * (16 * 64 + 16 * 4) + (64 * 16 + 64 * 4)),
        "nvfp4": expert_shards * 3 * (16 * 64 // 2 + 16 * 64 // 16 + 8),
    }
    for quant, expected in experts.items():
        weights = weight_bytes_per_gpu(shapes, quant=quant, tp=tp)
        assert weights.experts == expected, quant
        assert dict(weights.rest_by_part) == rest, quant


def test_unknown_weight_format_is_refused():
    with pytest.raises(ValueError, match="unknown weight format"):
        weight_bytes_per_gpu({}, quant="int4", tp=8)


# ---- KV cache groups -----------------------------------------------------------------------------
def layers_from_pattern(pattern: str, window: int = 512) -> list[CacheLayer]:
    """`"SSF"` -> sliding, sliding, full layers of 1 byte per token each, labelled L0, L1, ..."""
    return [CacheLayer(f"L{i}", None if kind == "F" else window, 1) for i, kind in enumerate(pattern)]


def labels(groups) -> list[tuple[str, ...]]:
    return [group.labels for group in groups]


def test_kv_bytes_per_layer():
    assert kv_bytes_per_token_per_layer(8, 128, tp=8) == 512  # one KV head per GPU
    assert kv_bytes_per_token_per_layer(8, 128, tp=1) == 2 * 8 * 128 * 2
    assert kv_bytes_per_token_per_layer(2, 16, tp=8) == 2 * 1 * 16 * 2  # replicated when tp > heads


def test_split_evenly_sizes():
    layers = layers_from_pattern("S" * 43)
    assert [len(run) for run in split_evenly(layers, 9)] == [9, 9, 9, 8, 8]
    assert [len(run) for run in split_evenly(layers, 14)] == [11, 11, 11, 10]
    assert [len(run) for run in split_evenly(layers, 43)] == [43]
    runs = split_evenly(layers, 9)
    assert [layer for run in runs for layer in run] == layers  # contiguous, in order, nothing lost


def test_groups_by_lifetime_and_splits_to_the_limit():
    groups = plan_cache_groups(layers_from_pattern("SSSFSSSSF"), split_limit=2)
    assert labels(groups) == [("L3", "L8"), ("L0", "L1"), ("L2", "L4"), ("L5", "L6"), ("L7",)]
    assert [g.window for g in groups] == [None, 512, 512, 512, 512]
    assert pool_kv_bytes_per_token(groups) == 2


def test_no_split_limit_keeps_one_group_per_lifetime():
    groups = plan_cache_groups(layers_from_pattern("SSSFSSSSF"), split_limit=None)
    assert labels(groups) == [("L3", "L8"), ("L0", "L1", "L2", "L4", "L5", "L6", "L7")]
    assert pool_kv_bytes_per_token(groups) == 7


def test_full_group_is_never_split_and_windows_are_kept_apart():
    layers = layers_from_pattern("FFFS") + [CacheLayer("D0", 4096, 1), CacheLayer("D1", 4096, 1)]
    groups = plan_cache_groups(layers, split_limit=1)
    assert [(g.window, g.labels) for g in groups] == [
        (None, ("L0", "L1", "L2")), (512, ("L3",)), (4096, ("D0",)), (4096, ("D1",)),
    ]


def test_pool_page_is_sized_by_bytes_of_the_largest_group():
    groups = (CacheGroup(None, (CacheLayer("a", None, 3),)), CacheGroup(512, tuple(layers_from_pattern("SS"))))
    assert pool_kv_bytes_per_token(groups) == 3


def test_pages_per_session():
    sliding, full = CacheGroup(512, ()), CacheGroup(None, ())
    assert sliding.pages_per_session(ONE_MIB_CONTEXT, 64) == 9  # 512 keys straddle at most 9 pages
    assert sliding.pages_per_session(100, 64) == 2  # never more than the history itself
    assert full.pages_per_session(ONE_MIB_CONTEXT, 64) == 16384


# ---- drafters ------------------------------------------------------------------------------------
def test_drafter_weights_stated_or_computed():
    assert DFLASH.weight_bytes_per_gpu(8) == round(1.40 * GIB)
    assert "stated" in DFLASH.weight_source()
    computed = DrafterSpec("d", 5, None, 8, 128, num_params=1_930_000_000)
    assert computed.weight_bytes_per_gpu(8) == 1_930_000_000 * 2 // 8
    assert "computed" in computed.weight_source()
    with pytest.raises(ValueError, match="neither"):
        DrafterSpec("d", 5, None, 8, 128).weight_bytes_per_gpu(8)


def test_dflash2_layers_form_their_own_window_group(beam):
    plan = plan_memory(beam, quant="nvfp4", drafter=DFLASH2)
    assert [(g.window, len(g.layers)) for g in plan.cache_groups] == [
        (None, 9), (512, 9), (512, 9), (512, 9), (512, 8), (512, 8), (4096, 5)
    ]
    assert plan.kv_bytes_per_token == 9 * 512


# ---- Beam-501B at TP8 against the blog -----------------------------------------------------------
def within(value: float, target: float, tolerance: float) -> bool:
    return abs(value / target - 1) <= tolerance


@pytest.mark.parametrize("quant", sorted(BLOG_WEIGHTS_GIB))
def test_weights_per_gpu_match_the_blog(plans, quant):
    weights = plans[quant, True].weights
    assert within(weights.total / GIB, BLOG_WEIGHTS_GIB[quant], 0.03), weights.total / GIB
    assert weights.rest == plans["bf16", True].weights.rest  # only experts change with the format


def test_nvfp4_expert_weights_match_the_blog(plans):
    assert within(plans["nvfp4", True].weights.experts / GIB, BLOG_NVFP4_EXPERTS_GIB, 0.03)


def test_kv_per_token_and_group_layout(plans):
    with_drafter, without = plans["nvfp4", True], plans["nvfp4", False]
    assert with_drafter.kv_bytes_per_token == 7 * KIB
    assert without.kv_bytes_per_token == 4.5 * KIB
    assert with_drafter.single_group_kv_bytes_per_token == 21.5 * KIB
    assert without.single_group_kv_bytes_per_token == 21.5 * KIB
    assert round(with_drafter.capacity_gain_vs_single_group, 2) == 3.07
    assert round(without.capacity_gain_vs_single_group, 2) == 4.78
    # One full group of 9 (+5 drafter layers) beside 5 sliding groups of <= 9, with or without drafter.
    for plan, full_layers in ((with_drafter, 14), (without, 9)):
        full, *sliding = plan.cache_groups
        assert full.window is None and len(full.layers) == full_layers
        assert [len(group.layers) for group in sliding] == [9, 9, 9, 8, 8]
        assert all(group.window == 512 for group in sliding)
    assert with_drafter.cache_groups[0].labels[-5:] == ("D0", "D1", "D2", "D3", "D4")


def test_sliding_layers_follow_the_config(beam, plans):
    sliding_labels = {f"L{i}" for i, kind in enumerate(beam.layer_types) if kind == SLIDING}
    full_labels = {f"L{i}" for i, kind in enumerate(beam.layer_types) if kind == FULL}
    groups = plans["bf16", False].cache_groups
    assert set(groups[0].labels) == full_labels == {f"L{i}" for i in (5, 11, 17, 23, 29, 35, 41, 47, 51)}
    assert {label for group in groups[1:] for label in group.labels} == sliding_labels


@pytest.mark.parametrize("quant", sorted(BLOG_POOL_TOKENS_WITH_DRAFTER))
def test_pool_capacity_matches_the_blog(plans, quant):
    plan = plans[quant, True]
    assert within(plan.pool_tokens, BLOG_POOL_TOKENS_WITH_DRAFTER[quant], 0.05), plan.pool_tokens
    assert plan.pool_tokens % 64 == 0
    assert plan.full_context_sessions >= 1  # a 1,048,576-token session fits


def test_nvfp4_pool_holds_17_full_sessions_as_the_blog_says(plans):
    plan = plans["nvfp4", True]
    assert plan.context_tokens == ONE_MIB_CONTEXT
    assert plan.pages_per_session == 16384 + 5 * 9  # full history + 5 sliding groups' windows
    assert plan.full_context_sessions == 17


def test_hbm_is_read_as_decimal_gb(beam):
    """186 GB = 186e9 bytes reproduces the blog; reading it as 186 GiB overshoots the BF16 pool."""
    as_gib = plan_memory(beam, quant="bf16", hbm_gb=186 * GIB / 1e9)
    assert not within(as_gib.pool_tokens, BLOG_POOL_TOKENS_WITH_DRAFTER["bf16"], 0.05)


def test_format_plan_lists_the_figures(plans):
    plan = plans["nvfp4", True]
    text = format_plan(plan)
    for fragment in ("TP8", "nvfp4", "experts", "7.0 KiB", "21.5 KiB", "3.07x", "stated (blog)",
                     "full history", "window 512", "L51 D0", f"{plan.pool_tokens:,} tokens", "sessions  17"):
        assert fragment in text, fragment


def test_mosaic_layout_bytes_are_what_the_kernel_layout_holds():
    """`nvfp4-mosaic` counts what `kernel_experts` makes of NVFP4 experts (the arrays' bytes): the
    checkpoint's bytes and a global scale per row, 0.1 % more at Beam's TP8 shapes."""
    from pallas_kernels import nvfp4_moe_mgpu as nmm
    from tests.pallas_kernels.test_moe_gemm import random_problem

    experts, hidden, intermediate = 3, 256, 128
    *_, gate, up, down = random_problem(5, 4, hidden, intermediate, experts, 2, "nvfp4")
    held = sum(a.nbytes for w in nmm.kernel_experts(gate, up, down, gate_up_tile_k=128)
               for a in (w.packed, w.scales, w.global_scale))
    planned = experts * (2 * nvfp4_mosaic_matrix_bytes(intermediate, hidden)
                         + nvfp4_mosaic_matrix_bytes(hidden, intermediate))
    assert held == planned
    ratio = nvfp4_mosaic_matrix_bytes(640, 5120) / nvfp4_matrix_bytes(640, 5120)
    assert 1.001 < ratio < 1.002
