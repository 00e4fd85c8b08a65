"""NVFP4 and FP8 formats: code tables, rounding, packing, ModelOpt's recipe, error bounds, jnp == numpy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from beam_jax.quant import (
    E2M1_VALUES,
    FP8Weight,
    NVFP4Weight,
    decode_e2m1,
    dequantize_activations,
    dequantize_fp8,
    dequantize_fp8_reference,
    dequantize_nvfp4,
    dequantize_nvfp4_reference,
    encode_e2m1,
    pack_nibbles,
    quantize_activations_per_token,
    quantize_activations_static,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
    stack_fp8,
    stack_nvfp4,
    unpack_nibbles,
)

F8 = ml_dtypes.float8_e4m3fn
TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nvfp4_bound(w: np.ndarray) -> np.ndarray:
    """Per-element error bound (see nvfp4.py): block_amax·(1+2^-4)/6 + amax·2^-10/448, fp32 slack."""
    blocks = np.abs(w.astype(np.float64)).reshape(*w.shape[:-1], -1, 16)
    block_amax = np.repeat(blocks.max(-1), 16, axis=-1)
    amax = np.abs(w.astype(np.float64)).max(axis=(-2, -1), keepdims=True)
    return (block_amax * (1 + 2**-4) / 6 + amax * 2**-10 / 448) * (1 + 1e-5)


def brute_force_e2m1(v: float) -> int:
    """Nearest E2M1 code by exhaustive search; ties to the even code; sign from the sign bit."""
    mag = min(abs(v), 6.0)
    dists = [abs(mag - t) for t in TABLE]
    best = min(dists)
    candidates = [c for c in range(8) if dists[c] == best]
    code = next((c for c in candidates if c % 2 == 0), candidates[0])
    return code | (8 if np.signbit(v) else 0)


# ---------------------------------------------------------------- E2M1 codes


def test_every_code_decodes_to_table_and_reencodes_to_itself():
    codes = np.arange(16, dtype=np.uint8)
    values = decode_e2m1(codes)
    expected = np.array(TABLE + [-t for t in TABLE], np.float32)
    np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(np.signbit(values), codes >= 8)  # code 8 is -0.0
    np.testing.assert_array_equal(encode_e2m1(values), codes)
    np.testing.assert_array_equal(E2M1_VALUES, expected)


def test_ties_round_to_even_code():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    expected = np.array([0, 2, 2, 4, 4, 6, 6], np.uint8)  # 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0
    np.testing.assert_array_equal(encode_e2m1(ties), expected)
    np.testing.assert_array_equal(encode_e2m1(-ties), expected | 8)
    # One ulp either side of each tie leaves the tie: lower neighbour below, upper above.
    below = encode_e2m1(np.nextafter(ties, np.float32(0)))
    above = encode_e2m1(np.nextafter(ties, np.float32(10)))
    np.testing.assert_array_equal(below, np.arange(7))
    np.testing.assert_array_equal(above, np.arange(1, 8))
    # Ties decided in float64 too (no rounding to fp32 on the way).
    np.testing.assert_array_equal(encode_e2m1(np.array([0.75, 0.75 - 1e-12])), [2, 1])


def test_encode_matches_brute_force_and_saturates():
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [rng.uniform(-7, 7, 2000), rng.choice([-1, 1], 200) * rng.choice(np.arange(0, 6.5, 0.25), 200)]
    ).astype(np.float32)
    np.testing.assert_array_equal(encode_e2m1(x), [brute_force_e2m1(float(v)) for v in x])
    big = np.array([6.0, 6.5, 7.0, 100.0, 1e30, np.inf], np.float32)
    np.testing.assert_array_equal(encode_e2m1(big), 7)
    np.testing.assert_array_equal(encode_e2m1(-big), 15)
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(np.array([1.0, np.nan]))


def test_nibble_order_hand_built():
    codes = np.array([[1, 2, 3, 4], [15, 0, 8, 7]], np.uint8)
    packed = pack_nibbles(codes)
    np.testing.assert_array_equal(packed, [[0x21, 0x43], [0x0F, 0x78]])
    np.testing.assert_array_equal(unpack_nibbles(packed), codes)
    # A hand-packed weight: byte 0x21 holds element 0 = code 1 (0.5) and element 1 = code 2 (1.0).
    packed_row = np.zeros((1, 8), np.uint8)
    packed_row[0, 0] = 0x21
    packed_row[0, 7] = 0xF0  # element 15 = code 15 (-6), element 14 = code 0
    w = NVFP4Weight(packed_row, np.array([[2.0]], F8), np.float32(0.5)).validate()
    d = np.asarray(dequantize_nvfp4(w, jnp.float32))
    expected = np.zeros((1, 16), np.float32)
    expected[0, 0], expected[0, 1], expected[0, 15] = 0.5, 1.0, -6.0
    np.testing.assert_array_equal(d, expected)
    np.testing.assert_array_equal(dequantize_nvfp4_reference(w), expected)


# ---------------------------------------------------------------- NVFP4 recipe


def test_recipe_by_hand_on_two_blocks():
    # Tensor amax 2688 -> global = 2688 / (6·448) = 1 exactly. Block 0 amax 2688 -> scale 448.
    v0 = [0, 0.3, 0.75, 1.25, -1.75, 2.5, 3.5, 5, 6, -6, 0.24, 0.26, 2.9, -4.9, 5.1, 1.0]
    codes0 = [0, 1, 2, 2, 12, 4, 6, 6, 7, 15, 0, 1, 5, 14, 7, 2]
    # Block 1 amax 100 -> 100/6 = 16.67 -> e4m3 16 (grid 16, 18): values are divided by 16.
    w1 = [100, -100, 8, 24, 40, 56, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    codes1 = [7, 15, 1, 3, 4, 6] + [0] * 10  # 6.25 saturates; 0.5; 1.5; 2.5 -> 2.0; 3.5 -> 4.0
    w = np.array([[448 * v for v in v0] + w1], np.float32)
    q = quantize_nvfp4(w, input_scale=0.125)
    assert q.global_scale.shape == () and q.global_scale == np.float32(1.0)
    np.testing.assert_array_equal(q.block_scale.astype(np.float32), [[448.0, 16.0]])
    np.testing.assert_array_equal(unpack_nibbles(q.packed), [codes0 + codes1])
    assert q.input_scale == np.float32(0.125)
    deq = dequantize_nvfp4_reference(q)
    np.testing.assert_array_equal(deq[0, 16:22], [96, -96, 8, 24, 32, 64])


def recipe_by_loops(w: np.ndarray):
    """ModelOpt's recipe written out scalar by scalar, with a brute-force nearest-value search."""
    amax = np.float32(max(abs(float(x)) for x in w.ravel()))
    g = np.float32(amax / np.float32(2688.0))
    scales, codes = [], []
    for row in w:
        srow, crow = [], []
        for k in range(0, len(row), 16):
            block = row[k : k + 16]
            bamax = np.float32(max(abs(float(x)) for x in block))
            b = np.float32(bamax / np.float32(np.float32(6.0) * g)) if g > 0 else np.float32(0)
            s = np.float32(np.array(min(b, 448.0), np.float32).astype(F8).astype(np.float32))
            denom = np.float32(s * g)
            srow.append(s)
            crow += [brute_force_e2m1(float(np.float32(x / denom))) if denom > 0 else 0 for x in block]
        scales.append(srow)
        codes.append(crow)
    return g, np.array(scales, np.float32), np.array(codes, np.uint8)


@pytest.mark.parametrize("seed", [2, 3])
def test_recipe_matches_scalar_brute_force(seed):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(4, 48)).astype(np.float32) * np.exp(rng.uniform(-8, 3, size=(4, 48))).astype(np.float32)
    w[1, 16:32] = 0.0  # an all-zero block
    w[2, :16] *= 1e-7  # a block whose scale underflows e4m3 -> scale 0, codes 0
    g, scales, codes = recipe_by_loops(w)
    q = quantize_nvfp4(w)
    assert q.global_scale == g
    np.testing.assert_array_equal(q.block_scale.astype(np.float32), scales)
    np.testing.assert_array_equal(unpack_nibbles(q.packed), codes)
    assert q.block_scale[1, 1] == 0 and q.block_scale[2, 0] == 0


def test_saturation_when_block_scale_rounds_down():
    # Block 1's amax gives an unrounded scale of 430, which e4m3 rounds down to 416: its largest
    # value divides to 6·430/416 ≈ 6.2 and must saturate to 6 (code 7), not wrap or overflow.
    amax = np.float32(2688.0)
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = amax
    w[0, 16] = np.float32(430 * 6)
    w[0, 17] = -np.float32(430 * 6)
    q = quantize_nvfp4(w)
    assert float(q.block_scale[0, 1].astype(np.float32)) == 416.0
    codes = unpack_nibbles(q.packed)
    assert codes[0, 16] == 7 and codes[0, 17] == 15
    deq = dequantize_nvfp4_reference(q)
    assert deq[0, 16] == 6 * 416 and deq[0, 17] == -6 * 416
    assert abs(deq[0, 16] - w[0, 16]) <= 2**-4 * w[0, 16]


def test_all_zero_blocks_and_all_zero_tensor():
    rng = np.random.default_rng(4)
    w = rng.normal(size=(6, 64)).astype(np.float32)
    w[:, 16:32] = 0.0
    w[3] = 0.0
    q = quantize_nvfp4(w)
    bs = q.block_scale.astype(np.float32)
    assert (bs[:, 1] == 0).all() and (bs[3] == 0).all() and (bs[[0, 1, 2, 4, 5]][:, [0, 2, 3]] > 0).all()
    assert (unpack_nibbles(q.packed)[:, 16:32] == 0).all()
    deq = dequantize_nvfp4_reference(q)
    assert np.isfinite(deq).all() and (deq[:, 16:32] == 0).all() and (deq[3] == 0).all()

    z = quantize_nvfp4(np.zeros((2, 5, 32), np.float32))
    assert (z.global_scale == 0).all() and (z.block_scale.astype(np.float32) == 0).all() and (z.packed == 0).all()
    for d in (dequantize_nvfp4_reference(z), np.asarray(dequantize_nvfp4(z, jnp.float32))):
        assert np.isfinite(d).all() and (d == 0).all()


@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
def test_tiny_and_huge_blocks_within_bound(magnitude):
    rng = np.random.default_rng(5)
    # Per-block magnitudes spread over 10 decades: many block scales are e4m3 subnormals, a few underflow.
    spread = 10.0 ** rng.uniform(-10, 0, size=(16, 8, 1))
    w = (rng.normal(size=(16, 8, 16)) * spread * magnitude).reshape(16, 128).astype(np.float32)
    q = quantize_nvfp4(w)
    bits = q.block_scale.view(np.uint8)
    subnormal = ((bits & 0x78) == 0) & ((bits & 0x07) != 0)
    assert subnormal.any() and (bits == 0).any() and ((bits & 0x78) != 0).any()
    deq = dequantize_nvfp4_reference(q, np.float64)
    err = np.abs(deq - w)
    assert np.isfinite(deq).all()
    assert (err <= nvfp4_bound(w)).all()
    # Blocks with normal scales meet the bound without the second term, and their largest
    # element comes back within the scale's rounding (≤ 2^-4 relative).
    normal = np.repeat(((bits & 0x78) != 0), 16, axis=-1)
    blocks_abs = np.abs(w.astype(np.float64)).reshape(16, 8, 16)
    block_amax = np.repeat(blocks_abs.max(-1), 16, axis=-1)
    assert (err[normal] <= (block_amax * (1 + 2**-4) / 6 * (1 + 1e-5))[normal]).all()
    top = np.abs(w) == block_amax
    sel = top & normal
    assert (err[sel] <= 2**-4 * block_amax[sel] * (1 + 1e-5)).all()
    # jnp stays bit-exact in this range (the smallest products are still fp32 normals).
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize_nvfp4, static_argnums=1)(q, jnp.float32)), dequantize_nvfp4_reference(q))


def test_rejects_nonfinite_and_bad_shapes():
    w = np.ones((4, 32), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        w2 = w.copy()
        w2[1, 3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize_nvfp4(w2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(np.full((1, 16), 1e300))  # float64 beyond fp32's range
    with pytest.raises(ValueError, match=r"\(4, 24\)"):
        quantize_nvfp4(np.ones((4, 24), np.float32))
    with pytest.raises(ValueError):
        quantize_nvfp4(np.ones(32, np.float32))


@pytest.mark.parametrize("shape", [(8, 32), (3, 16, 64), (2, 3, 4, 16)])
def test_gaussian_round_trip_and_jnp_matches_reference(shape):
    rng = np.random.default_rng(6)
    w = (rng.normal(size=shape) * 0.02).astype(ml_dtypes.bfloat16)
    q = quantize_nvfp4(w)
    assert q.shape == shape and q.global_scale.shape == shape[:-2]
    assert q.packed.shape == (*shape[:-1], shape[-1] // 2) and q.block_scale.shape == (*shape[:-1], shape[-1] // 16)
    w32 = w.astype(np.float32)
    ref = dequantize_nvfp4_reference(q, np.float64)
    assert (np.abs(ref - w32) <= nvfp4_bound(w32)).all()
    # NVFP4 on Gaussian data: ~9-10% relative RMS error; far above means a broken recipe.
    rel_rms = np.sqrt(((ref - w32) ** 2).mean() / (w32.astype(np.float64) ** 2).mean())
    assert 0.03 < rel_rms < 0.13, rel_rms
    f = jax.jit(dequantize_nvfp4, static_argnums=1)
    for dt_jnp, dt_np in ((jnp.float32, np.float32), (jnp.bfloat16, ml_dtypes.bfloat16)):
        got = np.asarray(f(q, dt_jnp))
        assert got.dtype == dt_np
        np.testing.assert_array_equal(got.view(np.uint8), dequantize_nvfp4_reference(q, dt_np).view(np.uint8))


def test_stacked_experts_have_per_expert_global_scale():
    rng = np.random.default_rng(7)
    w = rng.normal(size=(4, 8, 32)).astype(np.float32) * np.array([1, 10, 1e-3, 5], np.float32)[:, None, None]
    q = quantize_nvfp4(w, input_scale=np.array([1, 2, 3, 4], np.float32))
    singles = [quantize_nvfp4(w[e], input_scale=float(e + 1)) for e in range(4)]
    stacked = stack_nvfp4(singles)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_allclose(q.global_scale, np.abs(w).max(axis=(1, 2)) / 2688, rtol=1e-6)
    picked = jax.tree.map(lambda a: a[2], q)
    np.testing.assert_array_equal(dequantize_nvfp4_reference(picked), dequantize_nvfp4_reference(q)[2])
    # Round trip through ModelOpt's tensor names.
    t = singles[1].to_modelopt()
    assert set(t) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    back = NVFP4Weight.from_modelopt(t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(1), t["input_scale"])
    np.testing.assert_array_equal(dequantize_nvfp4_reference(back), dequantize_nvfp4_reference(singles[1]))
    with pytest.raises(ValueError):
        stack_nvfp4([singles[0], quantize_nvfp4(w[1])])  # input_scale on one only


# ---------------------------------------------------------------- FP8


def fp8_elementwise_bound(w, scale):
    # e4m3: relative ≤ 2^-4 for normals, absolute ≤ 2^-10 (times the scale) for subnormals.
    return (2**-4 * np.abs(w) + 2**-10 * scale) * (1 + 1e-6)


@pytest.mark.parametrize("shape", [(16, 40), (3, 8, 24)])
def test_fp8_per_channel_round_trip(shape):
    rng = np.random.default_rng(8)
    w = (rng.normal(size=shape) * np.exp(rng.uniform(-6, 6, size=(*shape[:-1], 1)))).astype(np.float32)
    w[..., 2, :] = 0.0  # a zero row
    q = quantize_fp8_per_channel(w)
    assert q.weight.dtype == F8 and q.weight_scale.shape == (*shape[:-1], 1) and q.weight_scale.dtype == np.float32
    assert np.isfinite(q.weight.astype(np.float32)).all()
    deq = dequantize_fp8_reference(q)
    row_amax = np.abs(w).max(-1, keepdims=True)
    assert (np.abs(deq - w) <= fp8_elementwise_bound(w, q.weight_scale)).all()
    assert (np.abs(deq - w) <= 2**-4 * row_amax * (1 + 1e-6)).all()
    assert (deq[..., 2, :] == 0).all() and (q.weight_scale[..., 2, :] > 0).all()
    # Each nonzero row's largest value maps to ±448 exactly (its scale is amax/448), never NaN.
    top = np.abs(q.weight.astype(np.float32)).max(-1)
    nonzero = row_amax[..., 0] > 0
    np.testing.assert_array_equal(top[nonzero], 448.0)
    f = jax.jit(dequantize_fp8, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(f(q, jnp.float32)), deq)
    np.testing.assert_array_equal(
        np.asarray(f(q, jnp.bfloat16)).view(np.uint16), dequantize_fp8_reference(q, ml_dtypes.bfloat16).view(np.uint16)
    )


def test_fp8_per_channel_saturation_and_rounding_by_hand():
    # Row amax 448 -> scale 1: values are just cast to e4m3 (ties to even).
    w = np.array([[448, -448, 17, 18, 19, 20, 0.0009765625, 0.00146484375]], np.float32)
    q = quantize_fp8_per_channel(w)
    assert q.weight_scale[0, 0] == 1.0
    # 17 ties between 16 and 18 -> 16 (even mantissa); 19 -> 20; 2^-10 ties to 0; 0.75·2^-9 -> 2^-9.
    np.testing.assert_array_equal(q.weight.astype(np.float32), [[448, -448, 16, 18, 20, 20, 0, 2**-9]])
    # A row whose amax/scale lands a hair above 448 still saturates to 448, not NaN.
    rng = np.random.default_rng(9)
    rows = rng.uniform(0.1, 10, size=(2000, 16)).astype(np.float32)
    qq = quantize_fp8_per_channel(rows).weight.astype(np.float32)
    assert np.isfinite(qq).all() and (np.abs(qq) <= 448).all()


def test_fp8_per_tensor_round_trip_and_stacking():
    rng = np.random.default_rng(10)
    w = rng.normal(size=(3, 12, 32)).astype(np.float32) * np.array([1, 1e-4, 1e4], np.float32)[:, None, None]
    q = quantize_fp8_per_tensor(w, input_scale=0.5)
    assert q.weight_scale.shape == (3,) and q.input_scale.shape == (3,) and not q.per_channel
    amax = np.abs(w).max(axis=(1, 2))
    np.testing.assert_allclose(q.weight_scale, amax / 448, rtol=1e-6)
    deq = dequantize_fp8_reference(q)
    assert (np.abs(deq - w) <= 2**-4 * amax[:, None, None] * (1 + 1e-6)).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize_fp8, static_argnums=1)(q, jnp.float32)), deq)
    stacked = stack_fp8([quantize_fp8_per_tensor(w[e], input_scale=0.5) for e in range(3)])
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # Checkpoint scalars stored as [1] are normalised; a per-channel [out] scale too.
    single = FP8Weight.from_checkpoint(q.weight[0], q.weight_scale[0].reshape(1), np.float32([0.5]))
    np.testing.assert_array_equal(dequantize_fp8_reference(single), deq[0])
    pc = quantize_fp8_per_channel(w[0])
    assert FP8Weight.from_checkpoint(pc.weight, pc.weight_scale.ravel()).per_channel
    # Zero tensor: positive scale, exact zeros.
    z = quantize_fp8_per_tensor(np.zeros((4, 16), np.float32))
    assert z.weight_scale > 0 and (dequantize_fp8_reference(z) == 0).all()
    for bad in (np.nan, np.inf):
        w2 = w[0].copy()
        w2[0, 0] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize_fp8_per_tensor(w2)
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize_fp8_per_channel(w2)


def test_activation_per_token_round_trip():
    rng = np.random.default_rng(11)
    x = (rng.normal(size=(2, 7, 64)) * np.exp(rng.uniform(-5, 5, size=(2, 7, 1)))).astype(np.float32)
    x[1, 3] = 0.0  # a padding token
    xq, scale = jax.jit(quantize_activations_per_token)(jnp.asarray(x))
    assert xq.dtype == jnp.float8_e4m3fn and scale.shape == (2, 7, 1) and scale.dtype == jnp.float32
    # Bit-exact against the same rule computed with numpy/ml_dtypes.
    amax = np.abs(x).max(-1, keepdims=True)
    ref_scale = np.maximum(amax * np.float32(1 / 448), np.finfo(np.float32).tiny).astype(np.float32)
    ref_q = np.clip(x / ref_scale, -448, 448).astype(F8)
    np.testing.assert_array_equal(np.asarray(scale), ref_scale)
    np.testing.assert_array_equal(np.asarray(xq).view(np.uint8), ref_q.view(np.uint8))
    back = np.asarray(dequantize_activations(xq, scale, jnp.float32))
    assert (np.abs(back - x) <= 2**-4 * amax * (1 + 1e-6)).all()
    assert (back[1, 3] == 0).all() and np.isfinite(back).all()
    # bf16 input works and round-trips within the same bound.
    xb = jnp.asarray(x, jnp.bfloat16)
    xq_b, s_b = quantize_activations_per_token(xb)
    xb32 = np.asarray(xb, np.float32)
    back_b = np.asarray(dequantize_activations(xq_b, s_b, jnp.float32))
    assert (np.abs(back_b - xb32) <= 2**-4 * np.abs(xb32).max(-1, keepdims=True) * (1 + 1e-6)).all()


def test_activation_static_saturates():
    x = jnp.asarray([[0.5, -1.0, 480.0, -1e6, 3.0]], jnp.float32)
    q = quantize_activations_static(x, jnp.float32(2.0))
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[0.25, -0.5, 240.0, -448.0, 1.5]])
    np.testing.assert_array_equal(np.asarray(dequantize_activations(q, 2.0, jnp.float32)), [[0.5, -1.0, 480.0, -896.0, 3.0]])
