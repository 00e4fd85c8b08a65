"""The grouped expert GEMM kernels (interpret mode on CPU, compiled on a GPU) against the plain-jnp
reference, for every weight format, on fresh seeded random inputs: packed NVFP4 bytes cover every
code (negative zero included), scales are random, ids leave experts empty."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import moe_gemm as mg

ON_GPU = jax.default_backend() == "gpu"
FORMATS = ["bf16", "fp8_channel", "fp8_tensor", "nvfp4"]


def random_weights(rng, fmt, experts, rows, cols, dtype=jnp.bfloat16):
    if fmt == "bf16":
        return mg.ExpertWeights(jnp.asarray(rng.standard_normal((experts, rows, cols)) * 0.1, dtype))
    if fmt.startswith("fp8"):
        values = jnp.asarray(np.clip(rng.standard_normal((experts, rows, cols)) * 100, -448, 448), jnp.float8_e4m3fn)
        shape = (experts, rows) if fmt == "fp8_channel" else (experts,)
        return mg.ExpertWeights(values, jnp.asarray(rng.uniform(5e-4, 2e-3, shape), jnp.float32), format=fmt)
    packed = jnp.asarray(rng.integers(0, 256, (experts, rows, cols // 2)), jnp.uint8)
    block = jnp.asarray(rng.uniform(0.25, 4, (experts, rows, cols // 16)), jnp.float8_e4m3fn)
    return mg.ExpertWeights(packed, block, jnp.asarray(rng.uniform(0.005, 0.02, experts), jnp.float32), format="nvfp4")


def random_problem(seed, tokens, hidden, intermediate, experts, top_k, fmt, dtype=jnp.bfloat16, used_experts=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    pool = experts if used_experts is None else used_experts  # experts >= pool are never routed to
    ids = jnp.asarray(np.stack([rng.choice(pool, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
    gate, up, down = (random_weights(rng, fmt, experts, n, k, dtype)
                      for n, k in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)))
    return x, weights, ids, gate, up, down


def assert_close_to_reference(problem, blocks=None, ulps=4):
    want = np.asarray(jax.jit(mg.moe_gemm_reference)(*problem), np.float32)
    kernel = functools.partial(mg.moe_gemm_kernel, blocks=blocks, interpret=not ON_GPU)
    got = np.asarray(jax.jit(kernel)(*problem), np.float32)
    # Kernel and reference round at the same points; they differ by summation order only.
    dtype = problem[0].dtype
    eps = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-20
    np.testing.assert_allclose(got, want, rtol=0, atol=ulps * eps * np.abs(want).max())
    assert np.abs(want).max() > 0


# (tokens, hidden, intermediate, experts, top_k, blocks): block sizes that leave K and N tails,
# expert counts that are not powers of two, one token, several blocks per expert, split K.
CASES = {
    "one_token_ids": (1, 64, 32, 16, 4, None),
    "tails_ids": (5, 96, 48, 12, 3, mg.MoEBlocks("ids", 16, 32, 64, 1, 32, 64)),
    "split_k_ids": (3, 256, 32, 8, 2, mg.MoEBlocks("ids", 16, 16, 32, 4, 32, 32)),
    "sorted_many_blocks_per_expert": (37, 64, 32, 4, 2, mg.MoEBlocks("sorted", 16, 16, 32, 1, 16, 32)),
    "sorted_tails_split": (20, 96, 48, 10, 3, mg.MoEBlocks("sorted", 16, 32, 64, 2, 32, 32)),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, fmt):
    tokens, hidden, intermediate, experts, top_k, blocks = CASES[case]
    problem = random_problem(len(case) + len(fmt), tokens, hidden, intermediate, experts, top_k, fmt)
    assert_close_to_reference(problem, blocks)


@pytest.mark.parametrize("source", ["ids", "sorted"])
def test_empty_experts(source):
    """Tokens use only 3 of 16 experts: the other experts' blocks must be skipped, not computed."""
    problem = random_problem(11, 4, 64, 32, 16, 2, "bf16", used_experts=3)
    assert_close_to_reference(problem, mg.MoEBlocks(source, 16, 32, 32, 1, 32, 32))


def test_fp32_activations_use_full_precision():
    problem = random_problem(2, 6, 64, 32, 8, 2, "bf16", dtype=jnp.float32)
    assert_close_to_reference(problem, ulps=8)


def test_sorted_blocks_cover_every_pair_once():
    rng = np.random.default_rng(4)
    experts, block_m = 12, 4
    ids = jnp.asarray(np.stack([rng.choice(experts, 3, replace=False) for _ in range(29)]), jnp.int32)
    block_expert, block_rows = map(np.asarray, mg.sorted_blocks(ids, experts, block_m))
    flat = np.asarray(ids).reshape(-1)
    rows = block_rows[block_rows >= 0]
    np.testing.assert_array_equal(np.sort(rows), np.arange(flat.size))
    for expert, block in zip(block_expert, block_rows):
        real = block[block >= 0]
        assert (expert < 0) == (real.size == 0)
        assert np.all(flat[real] == expert)


def share_of_experts(w: mg.ExpertWeights, start: int, stop: int) -> mg.ExpertWeights:
    """Experts start..stop of every array (one device's share under expert parallelism)."""
    scale = w.scale[start:stop] if w.scale is not None else None
    global_scale = w.global_scale[start:stop] if w.global_scale is not None else None
    return dataclasses.replace(w, values=w.values[start:stop], scale=scale, global_scale=global_scale)


EP_CASES = {  # (tokens, experts, shares, blocks): 12 experts in shares of 6 or 4, not powers of two
    "ids_two_shares": (5, 12, 2, mg.MoEBlocks("ids", 16, 32, 32, 1, 32, 32)),
    "ids_split_k_three_shares": (3, 12, 3, mg.MoEBlocks("ids", 16, 16, 32, 2, 32, 32)),
    "sorted_three_shares": (21, 12, 3, mg.MoEBlocks("sorted", 16, 32, 32, 1, 32, 32)),
}


EP_CI = {("ids_two_shares", "bf16"), ("ids_two_shares", "nvfp4"), ("sorted_three_shares", "bf16")}


@pytest.mark.parametrize(("case", "fmt"), [
    pytest.param(case, fmt, marks=() if (case, fmt) in EP_CI else pytest.mark.slow)
    for case, fmt in [("ids_two_shares", fmt) for fmt in FORMATS]
    + [("ids_split_k_three_shares", "bf16"), ("sorted_three_shares", "bf16"), ("sorted_three_shares", "nvfp4")]
])
def test_expert_parallel_shares(case, fmt):
    """Each device's share of the experts (`expert_offset`): the kernel equals the reference on it,
    pairs of other shares count zero, and the shares add up to the whole layer."""
    tokens, experts, shares, blocks = EP_CASES[case]
    x, weights, ids, gate, up, down = random_problem(len(case) + len(fmt), tokens, 64, 32, experts, 3, fmt)
    # the first token's experts all in the first share, the last token's all in the last one
    ids = ids.at[0].set(jnp.arange(3)).at[-1].set(experts - 1 - jnp.arange(3))
    size = experts // shares
    total = np.zeros((tokens, 64), np.float32)
    for offset in range(0, experts, size):
        local = [share_of_experts(w, offset, offset + size) for w in (gate, up, down)]
        problem = (x, weights, ids, *local)
        want = np.asarray(jax.jit(functools.partial(mg.moe_gemm_reference, expert_offset=offset))(*problem), np.float32)
        kernel = functools.partial(mg.moe_gemm_kernel, expert_offset=offset, blocks=blocks, interpret=not ON_GPU)
        got = np.asarray(jax.jit(kernel)(*problem), np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * 2.0**-7 * np.abs(want).max())
        no_local_pair = ~np.isin(np.asarray(ids), np.arange(offset, offset + size)).any(1)
        assert no_local_pair.any() and np.all(got[no_local_pair] == 0)  # tokens with no pair here
        total += got
    whole = np.asarray(jax.jit(mg.moe_gemm_reference)(x, weights, ids, gate, up, down), np.float32)
    np.testing.assert_allclose(total, whole, rtol=0, atol=shares * 4 * 2.0**-7 * np.abs(whole).max())


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("blocks", [None, mg.MoEBlocks("sorted", 16, 16, 32, 1, 16, 32)])
def test_negative_ids_are_not_computed(fmt, blocks):
    """Pairs with a negative id (padding tokens the MoE layer masked) count zero on every path, as
    other devices' pairs do: a token with only such pairs gets zeros, the others equal the layer without
    the masked pairs (their weights zeroed instead)."""
    x, weights, ids, gate, up, down = random_problem(3 + len(fmt), 9, 64, 32, 12, 3, fmt)
    masked = ids.at[5:].set(-1).at[1, 0].set(-1)  # tokens 5-8: padding; token 1: one pair dropped
    without = (x, weights.at[5:].set(0).at[1, 0].set(0), ids, gate, up, down)
    want = np.asarray(jax.jit(mg.moe_gemm_reference)(*without), np.float32)
    for run in (mg.moe_gemm_reference,
                functools.partial(mg.moe_gemm_kernel, blocks=blocks, interpret=not ON_GPU)):
        got = np.asarray(jax.jit(run)(x, weights, masked, gate, up, down), np.float32)
        np.testing.assert_array_equal(got[5:], 0.0)
        np.testing.assert_allclose(got[:5], want[:5], rtol=0, atol=4 * 2.0**-7 * np.abs(want).max())
    assert np.abs(want[1]).max() > 0


def test_ids_source_skips_padding_when_experts_are_not_a_power_of_two():
    """15 pairs padded to 16 lanes (filled with the "no expert" id 12) over 12 experts padded to
    16: the padding must not become a 12th used expert (a block reading past the weights)."""
    ids = jnp.asarray(np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 0], [1, 2, 3]]), jnp.int32).reshape(-1)
    num_experts, slots = 12, 12

    def kernel(ids_ref, out_ref):
        expert, _, _ = mg._block_from_ids(ids_ref, pl.program_id(0), num_experts=num_experts, block_m=16)
        out_ref[pl.program_id(0)] = expert

    experts = pl.pallas_call(kernel, grid=(slots,), out_shape=jax.ShapeDtypeStruct((slots,), jnp.int32),
                             interpret=True)(ids)
    np.testing.assert_array_equal(np.asarray(experts), list(range(11)) + [-1])


def test_ids_source_needs_every_pair_in_one_block():
    problem = random_problem(0, 20, 64, 32, 8, 2, "bf16")
    with pytest.raises(ValueError, match="block_m"):
        mg.moe_gemm_kernel(*problem, blocks=mg.MoEBlocks("ids", 16, 32, 32, 1, 32, 32), interpret=True)


@pytest.mark.parametrize(("shape", "bucket"), [(shape, bucket) for shape, table in mg.TUNED_BLOCKS.items()
                                                for bucket in table])
def test_tuned_blocks_are_chosen_and_correct_at_their_bucket_edges(shape, bucket):
    """Each measured entry is what choose_blocks returns across its token range, and its block
    sizes compute the right result at both ends of the range (on a small problem with K and N tails)."""
    fmt, experts, hidden, intermediate, top_k = shape
    blocks = mg.TUNED_BLOCKS[shape][bucket]
    for tokens in bucket:
        assert mg.choose_blocks(tokens, top_k, experts, hidden, intermediate, fmt) == blocks
        assert blocks.source != "ids" or tokens <= blocks.block_m
        problem = random_problem(tokens, tokens, 200, 72, 12, 3, fmt)
        assert_close_to_reference(problem, blocks)
    low = bucket[0]
    if low > 1 and mg.tuned_blocks(low - 1, top_k, experts, hidden, intermediate, fmt) is None:
        assert mg.choose_blocks(low - 1, top_k, experts, hidden, intermediate, fmt) != blocks  # the heuristic


# NVFP4 "packed" decode (PTX on the GPU, its plain-jnp stand-in in interpret mode; on the GPU its
# weight tiles must hold >= 512 bytes at 4 warps): K blocks of 32+ values, tails in K (hidden 80 / intermediate 48 against K blocks of 32-128) and N, empty experts,
# one token, several blocks per expert, split K, and Beam's prefill default (sorted, block_m 64).
PACKED_CASES = {
    "one_token_ids": (1, 256, 64, 16, 4, mg.MoEBlocks("ids", 16, 32, 128, 2, 32, 64, nvfp4_decode="packed")),
    "tails_ids": (5, 80, 48, 12, 3, mg.MoEBlocks("ids", 16, 32, 64, 1, 32, 32, nvfp4_decode="packed")),
    "tails_wide_k": (3, 80, 48, 12, 3, mg.MoEBlocks("ids", 16, 16, 128, 1, 16, 128, nvfp4_decode="packed")),
    "split_k_ids": (7, 512, 32, 8, 2, mg.MoEBlocks("ids", 16, 16, 64, 4, 32, 32, nvfp4_decode="packed")),
    "sorted_many_blocks_per_expert": (37, 64, 32, 4, 2, mg.MoEBlocks("sorted", 16, 32, 32, 1, 32, 32,
                                                                    nvfp4_decode="packed")),
    "sorted_tails_split": (20, 96, 48, 10, 3, mg.MoEBlocks("sorted", 16, 32, 64, 2, 32, 32, nvfp4_decode="packed")),
    "sorted_prefill_default": (70, 160, 96, 6, 2, None),
}


@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_nvfp4_matches_reference(case):
    tokens, hidden, intermediate, experts, top_k, blocks = PACKED_CASES[case]
    problem = random_problem(100 + len(case), tokens, hidden, intermediate, experts, top_k, "nvfp4")
    if blocks is None:
        blocks = mg.choose_blocks(tokens, top_k, experts, hidden, intermediate, "nvfp4", nvfp4_decode="packed")
        assert blocks.nvfp4_decode == "packed"
    assert_close_to_reference(problem, blocks)


def test_packed_nvfp4_empty_experts_and_extreme_scales():
    """Only 3 of 16 experts used; block scales at e4m3's extremes (448 and the smallest subnormal,
    2^-9), where the decode's 2^119 / 2^-7 factors must neither overflow nor lose bits."""
    x, weights, ids, gate, up, down = random_problem(12, 4, 128, 64, 16, 2, "nvfp4", used_experts=3)
    rng = np.random.default_rng(3)

    def extreme(w):
        choice = rng.choice(np.array([448.0, 2.0**-9, 1.0, 0.0], np.float32), w.scale.shape)
        return mg.ExpertWeights(w.values, jnp.asarray(choice, jnp.float8_e4m3fn), w.global_scale, format="nvfp4")

    blocks = mg.MoEBlocks("ids", 16, 32, 64, 2, 32, 64, nvfp4_decode="packed")
    assert_close_to_reference((x, weights, ids, extreme(gate), extreme(up), extreme(down)), blocks)


def test_packed_nvfp4_decode_is_exact():
    """The stand-in decode gives E2M1 * block scale * 2^-7 exactly, for every byte and e4m3 scale."""
    packed = jnp.asarray(np.repeat(np.arange(256, dtype=np.uint8), 256).reshape(256, 256))
    block = np.asarray(jnp.arange(256, dtype=jnp.uint8).view(jnp.float8_e4m3fn), np.float32)
    block = np.where(np.isnan(block), 1.0, block)
    scale = jnp.asarray(np.tile(block * 2.0**119, (256, 1)), jnp.bfloat16)
    assert np.all(np.asarray(scale, np.float32) == np.tile(block * 2.0**119, (256, 1)))  # exact in bf16
    low, high = mg._e2m1_times_scale(packed, scale, emulated=True)
    byte = np.repeat(np.arange(256), 256).reshape(256, 256)
    for got, codes in ((low, byte & 15), (high, byte >> 4)):
        want = mg._E2M1_VALUES[codes].astype(np.float64) * block[None, :] * 2.0**-7
        np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def _ptx_decode_bits(word: np.ndarray) -> tuple[np.ndarray, ...]:
    """numpy transcription of _E2M1_PTX before its fma: the four bf16x2 registers (uint32)."""
    word = word.astype(np.uint64)

    def prmt_with_zero(selector):  # selector nibbles 0-3 pick bytes of word, 4 picks a zero byte
        out = np.zeros_like(word)
        for position in range(4):
            pick = (selector >> (4 * position)) & 0xF
            if pick < 4:
                out |= ((word >> np.uint64(8 * pick)) & np.uint64(0xFF)) << np.uint64(8 * position)
        return out

    for asm, mask, multiplier in ((mg._E2M1_PTX_LOW, "0x000F000F", "0x1040"),
                                  (mg._E2M1_PTX_HIGH, "0x00F000F0", "0x104")):  # what is transcribed
        assert asm.count(f"and.b32 t, d01, {mask};") == asm.count(f"and.b32 t, d23, {mask};") == 1
        assert asm.count(f"mul.lo.u32 t, t, {multiplier};") == 2 and asm.count("0x81C081C0") == 2
        assert "prmt.b32 d01, $2, zero, 0x4140;" in asm and "prmt.b32 d23, $2, zero, 0x4342;" in asm
    mask32 = np.uint64(0xFFFFFFFF)
    d01, d23 = prmt_with_zero(0x4140), prmt_with_zero(0x4342)
    low = lambda d: (((d & np.uint64(0x000F000F)) * np.uint64(0x1040)) & mask32) & np.uint64(0x81C081C0)
    high = lambda d: (((d & np.uint64(0x00F000F0)) * np.uint64(0x104)) & mask32) & np.uint64(0x81C081C0)
    return low(d01), low(d23), high(d01), high(d23)


def test_ptx_bit_patterns_are_e2m1_times_2_pow_minus_126():
    """The PTX's integer steps (transcribed): each 16-bit lane is the bf16 bit pattern of the right
    nibble's E2M1 value times 2^-126 (subnormal for 0 and 0.5), for all bytes in all 4 positions."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    data = np.concatenate([np.arange(256, dtype=np.uint8).repeat(4), rng.integers(0, 256, 4096).astype(np.uint8)])
    words = data.reshape(-1, 4).view("<u4")[:, 0]
    registers = _ptx_decode_bits(words)
    lanes = [(registers[0], 0, 1, "low"), (registers[1], 2, 3, "low"), (registers[2], 0, 1, "high"),
             (registers[3], 2, 3, "high")]
    byte_of = data.reshape(-1, 4)
    for register, first, second, nibble in lanes:
        for lane, element in ((0, first), (1, second)):
            bits = ((register >> np.uint64(16 * lane)) & np.uint64(0xFFFF)).astype(np.uint16)
            value = bits.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0**126
            code = byte_of[:, element] & 15 if nibble == "low" else byte_of[:, element] >> 4
            np.testing.assert_array_equal(value, mg._E2M1_VALUES[code].astype(np.float64))
            np.testing.assert_array_equal(np.signbit(value), code >= 8)  # -0.0 stays negative


def test_dequantize_nvfp4_codes():
    """The reference's decode: code c of a byte's low/high nibble times its block and global scale."""
    packed = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(1, 16, 16))
    w = mg.ExpertWeights(packed, jnp.full((1, 16, 2), 2.0, jnp.float8_e4m3fn), jnp.full((1,), 0.5, jnp.float32),
                         format="nvfp4")
    got = np.asarray(w.dequantize(jnp.float32))[0]
    lo, hi = mg._E2M1_VALUES[np.arange(256) & 15], mg._E2M1_VALUES[np.arange(256) >> 4]
    np.testing.assert_array_equal(got[:, 0::2].reshape(-1), lo)
    np.testing.assert_array_equal(got[:, 1::2].reshape(-1), hi)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS + ["nvfp4_packed"])
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_beam_tp8_shape_on_gpu(fmt, tokens):
    """Beam's per-GPU TP8 expert shape with the default block choice for each token count."""
    decode = "packed" if fmt == "nvfp4_packed" else None
    fmt = fmt.removesuffix("_packed")
    problem = random_problem(tokens, tokens, 5120, 320, 256, 8, fmt)
    assert_close_to_reference(problem, mg.choose_blocks(tokens, 8, 256, 5120, 320, fmt, nvfp4_decode=decode))


@pytest.mark.parametrize("decode", ["per_value", "packed"])
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_nvfp4_kernels_lower_for_cuda(triton_for_sm90, tokens, decode):
    """Beam's TP8 shape lowers to Triton for an sm_90 GPU (lowering only; runs on the CPU)."""
    experts, hidden, intermediate, top_k = 256, 5120, 320, 8
    spec = jax.ShapeDtypeStruct

    def nvfp4(rows, cols):
        return mg.ExpertWeights(spec((experts, rows, cols // 2), jnp.uint8),
                                spec((experts, rows, cols // 16), jnp.float8_e4m3fn),
                                spec((experts,), jnp.float32), format="nvfp4")

    blocks = mg.choose_blocks(tokens, top_k, experts, hidden, intermediate, "nvfp4", nvfp4_decode=decode)
    args = (spec((tokens, hidden), jnp.bfloat16), spec((tokens, top_k), jnp.float32),
            spec((tokens, top_k), jnp.int32), nvfp4(intermediate, hidden), nvfp4(intermediate, hidden),
            nvfp4(hidden, intermediate))
    lowered = jax.jit(functools.partial(mg.moe_gemm_kernel, blocks=blocks)).trace(*args).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


def test_kernel_is_chosen_where_it_is_faster():
    """bf16 at one token goes to XLA's gather + einsum (faster on the H200); every other shape and
    format to the kernels."""
    assert not mg.kernel_is_faster(1, "bf16")
    assert all(mg.kernel_is_faster(t, f) for t in (2, 8, 64, 8192) for f in ("bf16", "fp8_channel", "nvfp4"))
    assert mg.kernel_is_faster(1, "nvfp4") and mg.kernel_is_faster(1, "fp8_channel")
