"""The Mosaic GPU NVFP4 grouped GEMM: its load-time layouts (checked on the CPU through
`decode_pair_bits`, the PTX decode's plain-jnp twin), its lowering for sm_90, its output in Mosaic GPU's
interpret mode on the CPU (stand-ins for its PTX bodies) and on a GPU, and the MoE layer built on it (its
glue on the CPU with the GEMM emulated or interpreted; the whole layer on a GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import moe_gemm as mg
from pallas_kernels import nvfp4_mgpu as nm
from pallas_kernels import nvfp4_moe_mgpu as nmm

E2M1 = mg._E2M1_VALUES


@pytest.mark.parametrize("k", [32, 96, 320, 5120])
def test_packed_words_decode_to_the_codes_in_k_order(k):
    rng = np.random.default_rng(k)
    codes = rng.integers(0, 16, (5, k), dtype=np.uint8)
    words = np.asarray(nm.pack_kernel_layout(codes)).view("<u4").reshape(5, k // 32, 4)  # [row, 32-block, thread]
    got = np.zeros((5, k), np.float32)
    for pair in range(4):
        bits = np.asarray(nm.decode_pair_bits(words, pair))
        for half in range(2):
            pattern = ((bits >> (16 * half)) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16)
            # wgmma column of this register half: 32c + 8 * pair + 2 * thread + half
            columns = 32 * np.arange(k // 32)[:, None] + 8 * pair + 2 * np.arange(4)[None, :] + half
            got[:, columns] = pattern.astype(np.float32) * 2.0**126
    np.testing.assert_array_equal(got, E2M1[codes])


def test_pack_k_steps_puts_a_step_of_every_row_together():
    packed = np.random.default_rng(2).integers(0, 256, (2, 64, 160), dtype=np.uint8)
    steps = np.asarray(nm.pack_k_steps(packed, tile_k=64))
    assert steps.shape == (2, 5, 64, 32)
    np.testing.assert_array_equal(steps[:, 3], packed[:, :, 96:128])
    with pytest.raises(ValueError, match="tile_k"):
        nm.pack_k_steps(packed, tile_k=256)


def e4m3_scales(rng, shape, signed=False):
    """Random e4m3 block scales over the format's whole range: subnormals (down to 2^-9), 448, zeros,
    and negative values if `signed`."""
    magnitude = np.exp2(rng.uniform(-9.5, 8.8, shape)).clip(0, 448)
    magnitude = np.where(rng.random(shape) < 0.05, 0.0, magnitude)
    sign = np.where(rng.random(shape) < 0.3, -1.0, 1.0) if signed else 1.0
    return (sign * magnitude).astype(ml_dtypes.float8_e4m3fn)


def test_pack_scales_codes_every_e4m3_value_and_puts_a_step_of_every_row_together():
    # 2^-9 .. 448 (0x01 .. 0x7E), and two ones to fill the step: zero has no code (`canonical_blocks`), NaN none
    every = np.concatenate([np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
                            np.ones(2, ml_dtypes.float8_e4m3fn)])
    words = nm.pack_scales(every.reshape(1, 1, -1), tile_k=16 * every.size)
    np.testing.assert_array_equal(np.asarray(nm.scale_values(words)).reshape(-1), every.astype(np.float32))
    scale = e4m3_scales(np.random.default_rng(1), (2, 128, 20))
    scale[scale == 0] = 1.0
    words = nm.pack_scales(scale, tile_k=64)
    assert words.shape == (2, 5, 128, 1) and words.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(nm.scale_values(words)),
                                  scale.astype(np.float32).reshape(2, 128, 5, 4).transpose(0, 2, 1, 3))


def test_canonical_blocks_keep_the_weights():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (2, 8, 64), dtype=np.uint8)
    scale = e4m3_scales(rng, (2, 8, 4), signed=True)
    new_codes, new_scale = nm.canonical_blocks(codes, scale)
    assert np.all(np.asarray(new_scale).astype(np.float32) >= 0)
    weights = lambda c, s: E2M1[np.asarray(c)] * np.repeat(np.asarray(s).astype(np.float32), 16, axis=-1)
    np.testing.assert_array_equal(weights(new_codes, new_scale), weights(codes, scale))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        nm.pack_kernel_layout(np.zeros((2, 48), np.uint8))
    with pytest.raises(ValueError, match="tile_k"):
        nm.pack_scales(np.ones((1, 64, 20), ml_dtypes.float8_e4m3fn), tile_k=256)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nm.pack_scales(np.ones((1, 64, 20), np.float32), tile_k=64)
    xs = jnp.zeros((16, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="shapes"):
        nm.grouped_matmul(xs, jnp.zeros((3,), jnp.int32), jnp.zeros((4, 2, 64, 128), jnp.uint8),
                          jnp.zeros((4, 2, 64, 4), jnp.uint32), block_t=8)
    with pytest.raises(ValueError, match="shapes"):  # the bytes by row, not by K step
        nm.grouped_matmul(jnp.zeros((16, 512), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                          jnp.zeros((4, 64, 256), jnp.uint8), jnp.zeros((4, 2, 64, 4), jnp.uint32), block_t=8)
    for rows in (9, 17):  # shared rows: a whole block of 16 or fewer than 8
        with pytest.raises(ValueError, match="shapes"):
            nm.grouped_matmul(jnp.zeros((rows, 512), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                              jnp.zeros((4, 2, 64, 128), jnp.uint8), jnp.zeros((4, 2, 64, 4), jnp.uint32), block_t=16,
                              shared_rows=True)
    weights = (jnp.zeros((4, 2, 64, 128), jnp.uint8), jnp.zeros((4, 2, 64, 4), jnp.uint32))
    with pytest.raises(ValueError, match="pdl must be one of"):
        nm.grouped_matmul(xs, jnp.zeros((2,), jnp.int32), *weights, block_t=8, pdl="early")
    with pytest.raises(ValueError, match="whole blocks"):  # shared rows under 8: the TMA box reads past the rows
        nm.grouped_matmul(jnp.zeros((5, 512), jnp.bfloat16), jnp.zeros((2,), jnp.int32), *weights, block_t=8,
                          shared_rows=True, pdl="prefetch")


def _shared_x_rows(block_t: int) -> int:
    """Shared rows as the layer passes them: a whole block, or under 8 rows (the rest must read as zeros)."""
    return 5 if block_t == 8 else block_t


def _specs(experts, n, k, blocks, block_t, tile_k, shared_rows=False):
    spec = jax.ShapeDtypeStruct
    return (spec((_shared_x_rows(block_t) if shared_rows else blocks * block_t, k), jnp.bfloat16),
            spec((blocks,), jnp.int32),
            spec((experts, k // tile_k, n, tile_k // 2), jnp.uint8),
            spec((experts, k // tile_k, n, tile_k // 64), jnp.uint32))


@pytest.mark.parametrize(
    "n,k,blocks,block_t,tile_k,splits,tile_n,shared_rows,stages,output,chunks,row_chunks,buffers", [
        (640, 5120, 8, 8, 256, 4, 64, False, 2, "sums", 1, 1, 1),
        (640, 5120, 8, 8, 256, 1, 128, False, 4, "scaled", 1, 1, 1),
        (5120, 320, 5, 16, 64, 1, 256, False, 4, "by_pair", 1, 1, 1),
        (640, 5120, 64, 16, 256, 1, 64, True, 2, "scaled", 1, 1, 1),
        (5120, 320, 57, 8, 64, 1, 128, True, 4, "sums", 1, 1, 1),
        (5120, 320, 8, 8, 64, 1, 64, True, 4, "scaled", 1, 1, 1),
        (640, 5120, 57, 8, 256, 1, 64, True, 2, "sums", 4, 1, 1),
        (640, 5120, 30, 8, 256, 1, 64, False, 2, "scaled", 2, 1, 1),
        (640, 5120, 57, 8, 256, 1, 64, True, 2, "swiglu", 2, 1, 1),
        (640, 5120, 30, 16, 256, 1, 64, False, 2, "swiglu", 1, 1, 1),
        (5120, 320, 5, 16, 64, 1, 256, False, 2, "by_pair", 1, 4, 1),
        (640, 5120, 8, 8, 256, 1, 128, False, 2, "sums", 2, 2, 1),
        (640, 5120, 30, 8, 256, 1, 128, False, 2, "swiglu", 1, 2, 1),
        (5120, 320, 5, 8, 64, 1, 256, False, 2, "by_pair", 1, 4, 2),
        (640, 5120, 30, 8, 256, 1, 64, False, 2, "swiglu", 1, 1, 2)])
def test_lowers_for_cuda(n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, stages, output, chunks,
                         row_chunks, buffers):
    """Beam's gate/up and down shapes lower to Mosaic GPU on the CPU (the PTX is built on the GPU)."""
    text = _lowered(n, k, blocks, block_t, tile_k, output, splits=splits, tile_n=tile_n, decode_chunks=chunks,
                    decode_row_chunks=row_chunks, shared_rows=shared_rows, stages=stages, staging_buffers=buffers)
    assert "mosaic_gpu" in text


def _lowered(n, k, blocks, block_t, tile_k, output, shared_rows=False, **settings) -> str:
    """`grouped_matmul` with these settings lowered for sm_90 (text); `output`: "sums", "scaled" (global scales),
    "swiglu" or "by_pair" (row destinations)."""
    op = functools.partial(nm.grouped_matmul, block_t=block_t, tile_k=tile_k, shared_rows=shared_rows, **settings)
    specs = _specs(256, n, k, blocks, block_t, tile_k, shared_rows)
    if output != "sums":
        spec = jax.ShapeDtypeStruct
        specs = (*specs, spec((256, n), jnp.float32), spec((blocks, block_t), jnp.int32))
        scatter = dict(out_rows=blocks * block_t // 2) if output == "by_pair" else {}
        op = functools.partial(lambda *args, op: op(*args[:4], global_scale=args[4], swiglu=output == "swiglu",
                                                    row_destination=args[5] if scatter else None, **scatter), op=op)
    return jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n,k,tile_k,tile_n,row_chunks,pdl,output", [
    (5120, 320, 64, 256, 4, "prefetch", "by_pair"), (5120, 320, 64, 128, 1, "prefetch", "sums"),
    (640, 5120, 256, 64, 1, "wait", "swiglu"), (640, 5120, 256, 64, 1, "off", "swiglu")])
def test_dependent_launch_lowers_for_cuda(n, k, tile_k, tile_n, row_chunks, pdl, output):
    """`pdl`: the kernel module asks for a programmatic dependent launch (its `griddepcontrol.wait` makes the
    launch use it), and only then."""
    text = _lowered(n, k, 16, 8, tile_k, output, tile_n=tile_n, decode_row_chunks=row_chunks, stages=2, pdl=pdl)
    assert "mosaic_gpu" in text
    assert ("uses_pdl" in text) == (pdl != "off")


GEMM_CASES = [  # experts, n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, chunks, row_chunks, buffers
    (16, 128, 512, 3, 8, 256, 1, 64, False, 1, 1, 1), (16, 192, 320, 5, 16, 64, 1, 64, False, 1, 1, 1),
    (8, 64, 1024, 2, 8, 256, 2, 64, False, 1, 1, 1), (32, 640, 5120, 4, 8, 256, 4, 64, False, 1, 1, 1),
    (16, 384, 320, 3, 8, 64, 1, 128, False, 1, 1, 1), (16, 512, 320, 2, 8, 64, 1, 256, False, 1, 1, 1),
    (16, 128, 512, 5, 24, 256, 2, 128, True, 1, 1, 1), (8, 192, 320, 4, 8, 64, 1, 64, True, 1, 1, 1),
    (16, 128, 512, 3, 8, 256, 1, 64, False, 4, 1, 1), (16, 256, 768, 5, 16, 256, 1, 128, True, 2, 1, 1),
    (16, 512, 320, 3, 8, 64, 1, 256, False, 1, 4, 1), (16, 384, 320, 3, 16, 64, 1, 128, True, 1, 2, 1),
    (16, 256, 768, 5, 16, 256, 1, 128, False, 2, 2, 1),
    (16, 512, 320, 3, 8, 64, 1, 256, False, 1, 4, 2), (16, 256, 1024, 5, 8, 256, 1, 64, True, 1, 1, 2),
]
GEMM_ARGS = "experts,n,k,blocks,block_t,tile_k,splits,tile_n,shared_rows,chunks,row_chunks,buffers"


@pytest.mark.gpu
@pytest.mark.parametrize(GEMM_ARGS, GEMM_CASES)
def test_matches_plain_jnp_on_gpu(experts, n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, chunks,
                                  row_chunks, buffers):
    """The fp32 partial sums; with one split also the finished bf16 projection (`global_scale`); steps
    decoded and multiplied whole or in K chunks (`decode_chunks`) and row chunks (`decode_row_chunks`), the
    block scales staged in one buffer or two (`staging_buffers`)."""
    _assert_gemm_matches_plain_jnp(experts, n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, chunks,
                                   row_chunks, buffers)


@pytest.mark.parametrize(GEMM_ARGS, GEMM_CASES)
def test_matches_plain_jnp_interpret(experts, n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, chunks,
                                     row_chunks, buffers):
    """The same in Mosaic GPU's interpret mode on the CPU: the kernel's grid, copies, barriers and data flow, with
    stand-ins for its PTX bodies (`nm.mgpu_op`), and one block skipped (expert -1: left unwritten)."""
    _assert_gemm_matches_plain_jnp(experts, n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, chunks,
                                   row_chunks, buffers, interpret=True)


def _assert_gemm_matches_plain_jnp(experts, n, k, blocks, block_t, tile_k, splits, tile_n, shared_rows, chunks,
                                   row_chunks, buffers, interpret=False):
    rng = np.random.default_rng(n + k)
    codes = rng.integers(0, 16, (experts, n, k), dtype=np.uint8)
    scale = e4m3_scales(rng, (experts, n, k // 16), signed=True)
    x = rng.standard_normal((_shared_x_rows(block_t) if shared_rows else blocks * block_t, k))
    x = x.astype(ml_dtypes.bfloat16)
    block_expert = rng.integers(0, experts, blocks).astype(np.int32)
    if interpret:
        block_expert[1] = -1
    computed = np.repeat(block_expert >= 0, block_t)
    operands = (jnp.asarray(x), jnp.asarray(block_expert),
                *nm.pack_weights(codes, scale, tile_k))
    settings = dict(block_t=block_t, tile_k=tile_k, tile_n=tile_n, decode_chunks=chunks, decode_row_chunks=row_chunks,
                    shared_rows=shared_rows, staging_buffers=buffers, interpret=interpret)

    def assert_close(got, want, rtol):  # on the computed blocks' rows (the skipped one's are left unwritten)
        got, want = np.asarray(got, np.float32)[computed], want[computed]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5 * np.abs(want).max())

    got = np.asarray(nm.grouped_matmul(*operands, splits=splits, **settings)).sum(0) * nm.OUTPUT_FACTOR
    w = jnp.asarray(E2M1[codes] * np.repeat(scale.astype(np.float32), 16, axis=-1))
    want = np.asarray(nm.grouped_matmul_reference(jnp.asarray(x), jnp.asarray(np.maximum(block_expert, 0)), w,
                                                  block_t=block_t, shared_rows=shared_rows))
    assert_close(got, want, 0)
    if splits == 1:
        global_scale = rng.uniform(0.5, 2, (experts, n)).astype(np.float32)
        scaled = nm.grouped_matmul(*operands, global_scale=jnp.asarray(global_scale), **settings)
        want = want * np.repeat(global_scale[np.maximum(block_expert, 0)], block_t, axis=0)
        assert_close(scaled[0], want, 2.0**-8)
        if tile_n <= 128 and tile_k == 256 and n % tile_n == 0:  # gate rows then up rows: the SwiGLU epilogue
            activated = nm.grouped_matmul(*operands, global_scale=jnp.asarray(global_scale), swiglu=True, **settings)
            rounded = np.asarray(scaled[0], np.float32)
            assert_close(activated[0], np.asarray(mg._swiglu(rounded[:, :n // 2], rounded[:, n // 2:]), np.float32),
                         2.0**-7)


def _layer_problem(seed, tokens, hidden, intermediate, experts, top_k, tile_k):
    from tests.pallas_kernels.test_moe_gemm import random_problem

    x, weights, ids, gate, up, down = random_problem(seed, tokens, hidden, intermediate, experts, top_k, "nvfp4")
    return (x, weights, ids, gate, up, down), nmm.kernel_experts(gate, up, down, gate_up_tile_k=tile_k)


def _assert_layer_close(problem, got, expert_offset=None):
    # The reference rounds each dequantized weight (value * block * global) to bf16; the kernel applies
    # the global scale to the fp32 sums: a few output ulps apart.
    reference = functools.partial(mg.moe_gemm_reference, expert_offset=expert_offset)
    want = np.asarray(jax.jit(reference)(*problem), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=4 * 2.0**-7 * np.abs(want).max())
    assert np.abs(want).max() > 0


def _builder(builder: str | None) -> dict:
    """`moe_nvfp4`'s block settings: a `block_builder`, or "opened-compact" (opened blocks in compact slots)."""
    if builder == "opened-compact":
        return dict(block_builder="opened", opened_program=dict(compact=True))
    return dict(block_builder=builder)


def _epilogues(which: str) -> dict:
    """`moe_nvfp4`'s epilogue settings: "none", "down" (the down GEMM's only), "both" or "swiglu" (both, and
    SwiGLU in the gate/up GEMM's)."""
    return dict(gate_up_epilogue=which in ("both", "swiglu"), down_epilogue=which in ("down", "both", "swiglu"),
                gate_up_swiglu=which == "swiglu")


@pytest.mark.parametrize("tokens,block_t,splits,builder,epilogue", [
    (1, 8, 2, "sort", "none"), (5, 2, 2, "sort", "none"), (13, 2, 1, "sort", "both"), (13, 8, 2, "compare", "both"),
    (70, None, None, "sort", "none"), (70, None, None, "sort", "both"), (70, None, None, "sort", "down"),
    (1, None, 4, "shared", "both"), (5, None, 1, "shared", "none"), (5, None, 1, "shared", "both"),
    (5, None, 1, "shared", "down"), (13, None, 2, None, "none"), (5, None, 1, "shared", "swiglu"),
    (30, None, 1, None, "swiglu"), (45, None, 1, None, "both"), (13, 2, 1, "opened", "both"),
    (30, None, 1, "opened", "swiglu"),
    (30, None, 2, "opened", "none"), (13, 2, 1, "opened-compact", "both"), (30, None, 1, "opened-compact", "swiglu")])
def test_layer_glue_matches_reference_with_emulated_gemm(tokens, block_t, splits, builder, epilogue):
    """Blocks, gathers, splits, scales, SwiGLU and combine, with the GEMM emulated in plain jnp:
    experts with more pairs than a block (tails), experts picked by several tokens, unused experts,
    and unused blocks; None: the defaults (`default_config`: shared rows up to 8 tokens, opened
    blocks of 8 rows up to 64, then sorted blocks of 32); with and without the kernel's own epilogue."""
    problem, (gate_up, down) = _layer_problem(tokens, tokens, 256, 64, 16, 4, tile_k=128)
    layer = functools.partial(nmm.moe_nvfp4, block_t=block_t, gate_up_splits=splits, **_builder(builder),
                              **_epilogues(epilogue), fused=False, matmul=nm.grouped_matmul_emulated)
    _assert_layer_close(problem, jax.jit(layer)(*problem[:3], gate_up, down))


@pytest.mark.parametrize("tokens,block_t,splits,builder,epilogue", [
    (1, 8, 2, "sort", "none"), (5, None, 1, "shared", "both"), (13, None, 2, None, "none"),
    (30, None, 1, "opened", "swiglu"), (45, None, 1, None, "both"), (70, None, None, "sort", "down")])
def test_layer_matches_reference_on_interpreted_gemm(tokens, block_t, splits, builder, epilogue):
    """The two-GEMM layer with the kernel in Mosaic GPU's interpret mode (no dependent launch there)."""
    problem, (gate_up, down) = _layer_problem(tokens, tokens, 512, 64, 16, 4, tile_k=256)
    layer = functools.partial(nmm.moe_nvfp4, block_t=block_t, gate_up_splits=splits, **_builder(builder),
                              **_epilogues(epilogue), fused=False, pdl=False,
                              matmul=functools.partial(nm.grouped_matmul, interpret=True))
    _assert_layer_close(problem, layer(*problem[:3], gate_up, down))


def test_signed_and_zero_block_scales_give_the_reference_with_emulated_gemm():
    """Block scales over e4m3's whole range, negative and zero ones too (`canonical_blocks` folds them into
    the codes): the converted experts (`kernel_experts`, the emulated GEMM) against the reference."""
    import dataclasses

    (x, weights, ids, gate, up, down), _ = _layer_problem(8, 6, 256, 64, 16, 4, tile_k=128)
    rng = np.random.default_rng(9)
    gate, up, down = (dataclasses.replace(w, scale=jnp.asarray(e4m3_scales(rng, w.scale.shape, signed=True)))
                      for w in (gate, up, down))
    kernel_weights = nmm.kernel_experts(gate, up, down, gate_up_tile_k=128)
    got = nmm.moe_nvfp4(x, weights, ids, *kernel_weights, matmul=nm.grouped_matmul_emulated)
    _assert_layer_close((x, weights, ids, gate, up, down), got)


def test_blocks_hold_every_pair_once():
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 6, (11, 3)), jnp.int32)
    pair_row, block_expert, row_pair = map(np.asarray, nmm.pair_blocks(ids, 6, 4))
    assert len(set(pair_row)) == ids.size
    np.testing.assert_array_equal(block_expert[pair_row // 4], np.asarray(ids).reshape(-1))
    np.testing.assert_array_equal(row_pair[pair_row], np.arange(ids.size))
    padding = np.setdiff1d(np.arange(row_pair.size), pair_row)
    assert (row_pair[padding] == -1).all()
    np.testing.assert_array_equal(np.asarray(nmm.row_tokens(jnp.asarray(row_pair), 3, 11))[padding], 11)


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (3, 4), (11, 3)])
def test_shared_blocks_give_each_expert_one_block(tokens, top_k):
    """Each pair's output row lies in a block of its expert, at its token's row, and that row names the
    pair back; an expert has one block; other devices' pairs (id == experts) make no block."""
    experts = 6
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(experts + 2, top_k, replace=False) for _ in range(tokens)])
    ids = np.minimum(ids, experts).astype(np.int32)
    block_t = -(-tokens // 8) * 8
    row, block_expert, row_pair = map(np.asarray, nmm._shared_blocks(jnp.asarray(ids), experts, block_t))
    flat, local = ids.reshape(-1), ids.reshape(-1) < experts
    np.testing.assert_array_equal(block_expert[row // block_t][local], flat[local])
    np.testing.assert_array_equal(row % block_t, np.arange(ids.size) // top_k)
    np.testing.assert_array_equal(row_pair[row[local]], np.flatnonzero(local))
    assert (row_pair >= 0).sum() == local.sum()
    used = block_expert[block_expert >= 0]
    assert sorted(used) == sorted(set(flat[local]))


@pytest.mark.parametrize("tokens,top_k,experts,block_t",
                         [(2, 8, 256, 8), (8, 8, 256, 8), (11, 3, 6, 4), (64, 8, 256, 8)])
def test_both_block_builders_agree(tokens, top_k, experts, block_t):
    """Also with other devices' pairs (id == experts, as `_local_pairs` marks them)."""
    rng = np.random.default_rng(tokens + experts)
    ids = np.stack([rng.choice(experts + 4, top_k, replace=False) for _ in range(tokens)])
    ids = jnp.asarray(np.minimum(ids, experts), jnp.int32)
    sorted_blocks = nmm.pair_blocks(ids, experts, block_t)
    compared_blocks = nmm._blocks_by_comparison(ids, experts, block_t)
    for by_sort, by_comparison in zip(sorted_blocks, compared_blocks):
        np.testing.assert_array_equal(np.asarray(by_sort), np.asarray(by_comparison))


@pytest.mark.parametrize("tokens,builder,epilogue", [
    pytest.param(1, "sort", "none", marks=pytest.mark.slow),  # ~25 s on CI's 2 cores; T = 1 takes shared rows
    (7, "sort", "both"), (7, "compare", "none"), (1, "shared", "both"), (7, "shared", "down"),
    (7, "shared", "none"), (7, "opened", "both"), (7, "opened", "none")])
def test_expert_parallel_shares_add_up(tokens, builder, epilogue):
    """Each device's share of the experts (`expert_offset`): equal to the reference on it (other
    shares' pairs count zero), and the shares add up to the whole layer."""
    from tests.pallas_kernels.test_moe_gemm import share_of_experts

    problem, _ = _layer_problem(40 + tokens, tokens, 256, 64, 12, 4, tile_k=128)
    x, weights, ids, gate, up, down = problem
    total = 0.0
    for start in (0, 4, 8):
        share = [share_of_experts(w, start, start + 4) for w in (gate, up, down)]
        kernel_weights = (nmm.KernelNvfp4.from_expert_weights(*share[:2], tile_k=128),
                          nmm.KernelNvfp4.from_expert_weights(share[2], tile_k=64))
        got = nmm.moe_nvfp4(x, weights, ids, *kernel_weights, expert_offset=start, block_builder=builder,
                            **_epilogues(epilogue), matmul=nm.grouped_matmul_emulated)
        want = mg.moe_gemm_reference(x, weights, ids, *share, expert_offset=start)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                                   atol=4 * 2.0**-7 * np.abs(np.asarray(want, np.float32)).max())
        total = total + np.asarray(got, np.float32)
    whole = np.asarray(mg.moe_gemm_reference(*problem), np.float32)
    np.testing.assert_allclose(total, whole, rtol=0, atol=3 * 4 * 2.0**-7 * np.abs(whole).max())


def test_swiglu_needs_whole_swizzled_rows():
    """The GEMM refuses SwiGLU on line-box steps (tile_k < 256); the two-GEMM layer's default then leaves it to XLA."""
    operands = (jnp.zeros((8, 512), jnp.bfloat16), jnp.zeros((1,), jnp.int32), jnp.zeros((4, 4, 128, 64), jnp.uint8),
                jnp.zeros((4, 4, 128, 2), jnp.uint32))
    with pytest.raises(ValueError, match="swiglu needs"):
        nm.grouped_matmul(*operands, block_t=8, tile_k=128, global_scale=jnp.ones((4, 128)), swiglu=True)
    asked = []

    def matmul(*args, swiglu=False, **kwargs):
        asked.append(swiglu)
        return nm.grouped_matmul_emulated(*args, swiglu=swiglu, **kwargs)

    for tile_k, want in ((128, False), (256, True)):
        problem, (gate_up, down) = _layer_problem(2, 5, 512, 64, 16, 4, tile_k=tile_k)
        asked.clear()
        _assert_layer_close(problem, nmm.moe_nvfp4(*problem[:3], gate_up, down, fused=False, matmul=matmul))
        assert asked[0] is want  # the gate/up GEMM's call


def test_unknown_block_builder_is_rejected():
    problem, (gate_up, down) = _layer_problem(0, 3, 256, 64, 16, 4, tile_k=128)
    with pytest.raises(ValueError, match="block_builder"):
        nmm.moe_nvfp4(*problem[:3], gate_up, down, block_builder="hash", matmul=nm.grouped_matmul_emulated)


@pytest.mark.parametrize("pdl,modes", [(True, ["wait", "prefetch"]), (False, ["off", "off"])])
def test_layer_launches_its_gemms_as_dependents_when_asked(pdl, modes):
    """`moe_nvfp4(pdl=True)`: gate/up waits first thing, down prefetches its weights (`grouped_matmul(pdl=)`),
    and the output is the same."""
    problem, (gate_up, down) = _layer_problem(1, 13, 256, 64, 16, 4, tile_k=128)
    asked = []

    def matmul(*args, pdl, **kwargs):
        asked.append(pdl)
        return nm.grouped_matmul_emulated(*args, **kwargs)

    got = jax.jit(functools.partial(nmm.moe_nvfp4, pdl=pdl, matmul=matmul))(*problem[:3], gate_up, down)
    assert asked == modes
    _assert_layer_close(problem, got)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,down_tile_n,builder,epilogue,chunks", [
    (1, 64, None, "none", None), (1, 64, None, "both", None), (8, 128, None, "none", None),
    (8, 128, None, "both", None), (8, 128, None, "down", None), (8, 64, "sort", "both", None),
    (13, 64, None, "both", None), (32, 64, "shared", "none", None), (64, 256, None, "both", None),
    (300, 64, None, "both", None), (8, 128, None, "down", 4), (40, 128, None, "both", 2),
    (8, 128, None, "swiglu", None), (40, 256, None, "swiglu", None), (16, 256, "opened", "swiglu", None),
    (64, 256, "opened", "swiglu", None), (13, 128, "opened", "none", None), (12, None, None, "both", None),
    (64, None, "opened-compact", "swiglu", None)])
def test_layer_matches_reference_on_gpu(tokens, down_tile_n, builder, epilogue, chunks):
    """Beam's per-GPU TP8 expert shape on the kernel (None: `default_config`'s blocks and gate/up decode
    chunks), with and without the kernel's own epilogue."""
    problem, (gate_up, down) = _layer_problem(tokens, tokens, 5120, 320, 256, 8, tile_k=256)
    layer = functools.partial(nmm.moe_nvfp4, down_tile_n=down_tile_n, **_builder(builder),
                              gate_up_decode_chunks=chunks, **_epilogues(epilogue), fused=False)
    _assert_layer_close(problem, jax.jit(layer)(*problem[:3], gate_up, down))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 8, 16, 40, 70])
def test_dependent_launches_match_reference_on_gpu(tokens):
    """The layer with its GEMMs launched as programmatic dependents (gate/up waiting first thing, down
    prefetching its weights before it waits), on the defaults' blocks at each size; the same call twice in a
    row, so that the second's down GEMM may start during the first's kernels."""
    problem, (gate_up, down) = _layer_problem(tokens + 100, tokens, 5120, 320, 256, 8, tile_k=256)
    layer = functools.partial(nmm.moe_nvfp4, pdl=True, fused=False)
    twice = jax.jit(lambda *args: (layer(*args), layer(args[0] * 2, *args[1:])))
    once, doubled = twice(*problem[:3], gate_up, down)
    _assert_layer_close(problem, once)
    _assert_layer_close((problem[0] * 2, *problem[1:]), doubled)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16, 40])
def test_expert_parallel_share_on_gpu(tokens):
    """Half of Beam's experts on this device (`expert_offset` 128): the kernel path against the reference;
    the other half's pairs count zero."""
    from tests.pallas_kernels.test_moe_gemm import share_of_experts

    problem, _ = _layer_problem(tokens, tokens, 5120, 320, 256, 8, tile_k=256)
    x, weights, ids, gate, up, down = problem
    share = [share_of_experts(w, 128, 256) for w in (gate, up, down)]
    kernel_weights = (nmm.KernelNvfp4.from_expert_weights(*share[:2], tile_k=256),
                      nmm.KernelNvfp4.from_expert_weights(share[2], tile_k=64))
    layer = functools.partial(nmm.moe_nvfp4, expert_offset=128)
    got = jax.jit(layer)(x, weights, ids, *kernel_weights)
    _assert_layer_close((x, weights, ids, *share), got, expert_offset=128)


@pytest.mark.parametrize("builder", nmm.BLOCK_BUILDERS)
def test_negative_ids_are_not_computed(builder):
    """Padding tokens masked by the MoE layer (id -1 on every pair): zeros, and the real tokens as the
    reference on them alone; every block builder (the emulated GEMM)."""
    problem, kernel_weights = _layer_problem(60, 7, 256, 64, 12, 4, tile_k=128)
    x, weights, ids, gate, up, down = problem
    masked = ids.at[4:].set(-1)
    got = np.asarray(nmm.moe_nvfp4(x, weights, masked, *kernel_weights, block_builder=builder,
                                   matmul=nm.grouped_matmul_emulated), np.float32)
    want = np.asarray(mg.moe_gemm_reference(x[:4], weights[:4], ids[:4], gate, up, down), np.float32)
    np.testing.assert_array_equal(got[4:], 0.0)
    np.testing.assert_allclose(got[:4], want, rtol=0, atol=4 * 2.0**-7 * np.abs(want).max())


def _moe_benchmark(name: str, monkeypatch):
    """A script of benchmarks/moe as a module (its directory on the path, as when it runs)."""
    import importlib.util
    from pathlib import Path

    moe_benchmarks = Path(__file__).parents[2] / "benchmarks/moe"
    monkeypatch.syspath_prepend(str(moe_benchmarks))
    spec = importlib.util.spec_from_file_location(name, moe_benchmarks / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["full", "no_scales", "raw", "const", "copy"])
@pytest.mark.parametrize("n,k,tile_k,splits,tile_n", [(640, 5120, 256, 4, 64), (5120, 320, 64, 1, 128)],
                         ids=["gate_up", "down"])
def test_decode_cost_stand_ins_lower_for_cuda(mode, n, k, tile_k, splits, tile_n, monkeypatch):
    """benchmarks/moe/decode_cost.py's stand-ins (cheaper decodes; "copy": no wgmma either) build the kernel,
    with weights in registers (gate/up) and from smem lines (down)."""
    decode_cost = _moe_benchmark("decode_cost", monkeypatch)
    op = functools.partial(nm.grouped_matmul, block_t=8, tile_k=tile_k, splits=splits, stages=2, tile_n=tile_n)
    with decode_cost.stand_in(mode):
        text = jax.jit(op).trace(*_specs(256, n, k, 8, 8, tile_k)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and ("wgmma.mma_async" in text) == (mode != "copy")


@pytest.mark.parametrize("builder,gemm,shape", [
    # ~25 s each on CI's 2 cores, and a benchmark's paths only (the kernel's own lowering cases stay in CI):
    # all slow, to keep CI under 30 minutes (29:33 at session 26's end with the first one in).
    pytest.param("opened-compact", "down", (256, 2, 4, 1), marks=pytest.mark.slow),
    pytest.param("compare", "down", (256, 2, 1, 1), marks=pytest.mark.slow),
    pytest.param("opened", "down", (256, 2, 4, 1), marks=pytest.mark.slow),
    pytest.param("opened", "gate_up", (64, 2, 1, 2), marks=pytest.mark.slow),
    pytest.param("compare", "gate_up", (128, 2, 2, 1), marks=pytest.mark.slow)])
def test_down_epilogue_cost_paths_lower_for_cuda(builder, gemm, shape, monkeypatch):
    """benchmarks/moe/down_epilogue_cost.py: the layer's blocks from routed ids, and the GEMM with each
    output path and decode stand-in it times (the copy stand-in without wgmma) built for the GPU."""
    cost = _moe_benchmark("down_epilogue_cost", monkeypatch)
    tokens = 5
    _, _, ids = cost.bench.make_tokens(tokens, 2, jax.random.key(0))
    block_expert, row_pair = jax.vmap(functools.partial(cost.layer_blocks, builder=builder))(ids)
    for r in range(2):  # each local pair in one row of a block of its expert
        experts, rows = np.asarray(block_expert[r]), np.asarray(row_pair[r])
        used = np.flatnonzero(rows >= 0)
        np.testing.assert_array_equal(np.sort(rows[used]), np.arange(tokens * cost.bench.TOP_K))
        np.testing.assert_array_equal(experts[used // cost.BLOCK_T], np.asarray(ids[r]).reshape(-1)[rows[used]])
    packed, scales, global_scale = cost.gemm_weights(jax.random.key(1), gemm)
    spec = jax.ShapeDtypeStruct
    specs = (spec((block_expert.shape[1] * cost.BLOCK_T, cost.GEMMS[gemm][1]), jnp.bfloat16),
             spec(block_expert.shape[1:], jnp.int32), spec(row_pair.shape[1:], jnp.int32),
             spec(packed.shape, packed.dtype), spec(scales.shape, scales.dtype))
    tile_n, stages, row_chunks, k_chunks = shape
    for path, mode in cost.variants(["full", "no_scales", "raw", "const", "copy"], gemm):
        with cost.decode_cost.stand_in(mode):
            op = cost.path_op(path, tokens, tile_n, stages, global_scale, row_chunks, k_chunks, gemm)
            text = jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and ("wgmma.mma_async" in text) == (mode != "copy")


def test_copy_ceiling_kernels_lower_for_cuda(monkeypatch):
    """benchmarks/moe/copy_ceiling.py's copy-only pipelines build for every configuration it times."""
    copy_ceiling = _moe_benchmark("copy_ceiling", monkeypatch)
    for rows, cols, steps, stages, variant in copy_ceiling.CONFIGS:
        kernel = copy_ceiling.copy_kernel(10, steps, rows, cols, stages, variant)
        specs = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((40, steps, rows, cols), jnp.uint8))
        assert "mosaic_gpu" in jax.jit(kernel).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def test_probe_variants_summarize_every_layer(monkeypatch, capsys):
    """`mgpu_probe.py --variants`: a line per layer and T with its % of the floor and bf16 ratio; a layer that
    failed is reported, not dropped; with `--real`, each T with fewer real tokens (no bf16 row there). The timings
    are stand-ins: CUPTI needs a GPU."""
    probe = _moe_benchmark("mgpu_probe", monkeypatch)
    layer = dict(us=50.0, kernels=[("kernel_mosaic_gpu_kernel", 40.0)], max_err=0.002, timer="cupti")
    monkeypatch.setattr(probe, "layer_weights", lambda: None)
    monkeypatch.setattr(probe.bench, "make_weights", lambda *args: None)
    monkeypatch.setattr(probe, "time_layers", lambda t, variants, weights, spans, real, progress: {
        "kind": "layers", "t": t, "real": real, "floor_us": 25.0, "mosaic[default]": layer,
        "mosaic[x=1]": dict(error="boom")})
    monkeypatch.setattr(probe, "time_bf16_layers", lambda t, variants, weights, spans: {"moe_gemm": dict(us=150.0)})
    rows = []
    probe.compare_variants([{}, {"x": 1}], [1, 8], True, rows.append)
    out = capsys.readouterr().out
    assert "T=8 real=8 mosaic[default] 50.0 us (50.0 % of 25.0) bf16/this 3.00" in out
    assert "T=1 real=1 mosaic[default] 50.0 us (50.0 % of 25.0) err" in out and "T=1 bf16" not in out
    assert out.count("mosaic[x=1] ERROR boom") == 2 and len(rows) == 3
    progress = probe.layer_line("PROGRESS", {"t": 8, "real": 8, "floor_us": 25.0, "mosaic[default]": layer},
                                "mosaic[default]")  # (a line as each layer is timed: no bf16 ratio, no kernels)
    assert progress == "PROGRESS T=8 real=8 mosaic[default] 50.0 us (50.0 % of 25.0) err 0.0020"
    rows.clear()
    probe.compare_variants([{}], [1, 8], True, rows.append, real=[5, 8])
    out = capsys.readouterr().out
    assert "T=8 real=5 mosaic[default] 50.0 us (50.0 % of 25.0) err" in out and "real=8" not in out
    assert [row["real"] for row in rows] == [5]


def test_call_spans_time_each_call_from_its_first_start_to_its_last_end(monkeypatch):
    """`bench.time_spans`' arithmetic on a made-up trace: two calls, each behind a separating matmul, the
    second with a kernel that starts before the one ahead of it ends (a dependent launch): counted once."""
    bench = _moe_benchmark("bench", monkeypatch)
    events = [(0, 1000_000, "gemm"), (1000_500, 1003_000, "a"), (1003_500, 1010_000, "b"),
              (1011_000, 2011_000, "gemm"), (2011_200, 2020_000, "a"), (2015_000, 2021_200, "b")]
    mean_us, kernels = bench.call_spans(events, {"gemm"}, 2)
    assert mean_us == pytest.approx((9.5 + 10.0) / 2)
    assert kernels == [("a", 2.5, 0.0), ("b", 6.5, 3.0)]
    with pytest.raises(RuntimeError, match="2 groups of kernels for 3 calls"):
        bench.call_spans(events, {"gemm"}, 3)


def test_jitted_caller_passes_the_carry_from_call_to_call(monkeypatch):
    """`time_spans(carry=)`'s calls: each gets the carry the call before returned (as the routing state passes
    from layer to layer), which is left off the outputs; without a carry the outputs are op's own."""
    bench = _moe_benchmark("bench", monkeypatch)
    xs = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    call = bench.jitted_caller(lambda x, y, c: (x * y + c, c + 1.0), 1, (jnp.float32(2.0),), carry=jnp.float32(0.5))
    for r in range(3):
        (out,) = call((xs[r],))
        np.testing.assert_allclose(np.asarray(out), xs[r] * 2.0 + 0.5 + r, rtol=1e-6)
    plain = bench.jitted_caller(lambda x, y: (x - y, y), 1, (jnp.float32(2.0),))
    out, y = plain((xs[0],))
    np.testing.assert_allclose(np.asarray(out), xs[0] - 2.0, rtol=1e-6)
    assert float(y) == 2.0


def test_spans_separator_spins_without_memory_traffic(monkeypatch, triton_for_sm90):
    """`time_spans`' separator: one Triton kernel named `spans_separator` (the name the spans are split at), whose
    output is the recurrence v <- 0.999 v + 0.001 run `iterations` times from the seed, in every program's row."""
    bench = _moe_benchmark("bench", monkeypatch)
    seed = jnp.asarray(np.random.default_rng(0).standard_normal(128), jnp.float32)
    out = bench.separator(seed, iterations=5, interpret=True)
    want = np.asarray(seed, np.float64)
    for _ in range(5):
        want = want * 0.999 + 0.001
    assert out.shape == (132, 128)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(want, (132, 128)), rtol=1e-6)
    text = jax.jit(bench.separator).trace(seed).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("spans_separator") >= 1 and text.count("triton") == 1
