"""The decode kernels with the layer's per-head work fused in (q norm + RoPE / SSMax in the split
kernel's prologue, the output gate in the combine's epilogue) and the page write with the k norm +
RoPE, in interpret mode, against the unfused path (the references around the plain kernels) on fresh
seeded random inputs: GQA 1 / 6 / 8, odd head counts, padding tokens, empty entries, decodes at page
and window edges, sliding (RoPE, window) and full (SSMax) layers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from tests.pallas_kernels.test_paged_attention import DECODES, HEAD_DIM, MIXED, make_batch

op = jax.jit(
    pa.ragged_paged_attention,
    static_argnames=("window", "use_kernel", "decode_only", "decode_block_sizes", "interpret"),
)
reference = jax.jit(pa.ragged_paged_attention_reference, static_argnames=("window",))
prologue_reference = jax.jit(pa.head_prologue_reference)
gate_reference = jax.jit(pa.output_gate_reference)
write_reference = jax.jit(pa.write_kv)
# The fused paths round where the references round, but fp32 results may differ in the last bit
# (a norm's sum in another order; interpret mode has no barrier against FMA contraction in RoPE), so
# one bf16 ulp can flip where such a bit decides the rounding.
CLOSE = {jnp.float32: {"atol": 1e-6, "rtol": 1e-6}, jnp.bfloat16: {"atol": 1e-6, "rtol": 2**-7}}


def assert_same_rounding(got, want, dtype, gpu_ulps: int = 1):
    """Within CLOSE. On a GPU, bf16 gets `gpu_ulps` ulps at the output's scale instead: XLA fuses the
    interpret-mode ops differently there (H200, 2026-12-01: 1155 of 6144 values of
    test_fused_decode_equals_unfused one ulp apart at values near 1, 0.0078)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.bfloat16 and jax.default_backend() == "gpu":
        np.testing.assert_allclose(got, want, rtol=0, atol=gpu_ulps * 2**-7 * np.abs(want).max())
    else:
        np.testing.assert_allclose(got, want, **CLOSE[dtype])
SLIDING_WINDOW = 17  # crosses pages of 16 both ways


def token_positions(batch) -> np.ndarray:
    """Each flat token's absolute position (the last q_len of its context); padding gets 0."""
    positions = np.zeros(batch.queries.shape[0], np.int32)
    starts, seq_lens = np.asarray(batch.query_start), np.asarray(batch.seq_lens)
    for b, seq_len in enumerate(seq_lens):
        q_len = starts[b + 1] - starts[b]
        positions[starts[b] : starts[b + 1]] = np.arange(seq_len - q_len, seq_len)
    return positions


def layer_prologues(rng, positions, kind: str) -> tuple[pa.HeadPrologue, pa.HeadPrologue]:
    """(query, key) prologues of a sliding (RoPE, theta 10000) or full (SSMax on q) layer, with
    random norm weights; the tables are computed here in numpy, fp32, NeoX layout."""
    q_weight, k_weight = (jnp.asarray(1 + 0.3 * rng.standard_normal(HEAD_DIM), jnp.float32) for _ in range(2))
    if kind == "sliding":
        inv_freq = (1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32)
        angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))
        return (pa.HeadPrologue(q_weight, 1e-6, rope_cos=cos, rope_sin=sin),
                pa.HeadPrologue(k_weight, 1e-6, rope_cos=cos, rope_sin=sin))
    scale = jnp.asarray((1 + (positions + 1.0) / 2048.0) ** 0.1, jnp.float32)
    return pa.HeadPrologue(q_weight, 1e-6, ssmax_scale=scale), pa.HeadPrologue(k_weight, 1e-6)


def random_gate(rng, tokens, heads, dtype) -> pa.OutputGate:
    return pa.OutputGate(jnp.asarray(2 * rng.standard_normal((tokens, heads, HEAD_DIM)), dtype),
                         jnp.asarray(rng.standard_normal(heads), dtype))


# dtype, kv_heads, group, page_size, kind, pages_per_step, num_splits
FUSED_CASES = [
    (jnp.float32, 3, 1, 16, "sliding", 1, 2),  # GQA 1, three heads
    (jnp.float32, 1, 6, 16, "full", 2, 4),  # Beam's TP8 ratio
    (jnp.float32, 3, 6, 64, "sliding", 1, 1),  # 18 heads: kv heads past the first start mid-row-block
    (jnp.bfloat16, 2, 8, 16, "full", 2, 8),  # more splits than most sequences have pages
    (jnp.bfloat16, 1, 6, 16, "sliding", 4, 2),
]


@pytest.mark.parametrize("dtype, kv_heads, group, page_size, kind, pages_per_step, num_splits", FUSED_CASES)
def test_fused_decode_equals_unfused(dtype, kv_heads, group, page_size, kind, pages_per_step, num_splits):
    """Decode-only step: raw q into the fused kernels equals the references' prologue, the plain decode
    kernels and the reference gate (same rounding points; interpret mode runs the same XLA ops), and
    is within the usual tolerance of the all-jnp reference. Non-decode and padding tokens get zeros."""
    window = SLIDING_WINDOW if kind == "sliding" else None
    batch = make_batch(
        301 + 7 * group + kv_heads + page_size, DECODES, page_size=page_size, kv_heads=kv_heads, group=group,
        dtype=dtype, window=window, release="hole" if kind == "sliding" else "none", padding_tokens=3,
    )
    rng = np.random.default_rng(group + 11 * kv_heads)
    tokens, heads, _ = batch.queries.shape
    raw_q = jnp.asarray(3 * rng.standard_normal(batch.queries.shape), dtype)  # norms far from 1
    query, _ = layer_prologues(rng, token_positions(batch), kind)
    gate = random_gate(rng, tokens, heads, dtype)
    pages = (batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    blocks = pa.DecodeBlocks(pages_per_step=pages_per_step, num_splits=num_splits)
    kw = {"window": window, "use_kernel": "decode", "decode_only": True, "decode_block_sizes": blocks, "interpret": True}

    fused = op(raw_q, *pages, query_prologue=query, output_gate=gate, **kw)
    unfused = gate_reference(op(prologue_reference(raw_q, query), *pages, **kw), gate)
    assert fused.shape == (tokens, heads, HEAD_DIM) and fused.dtype == dtype
    assert_same_rounding(fused, unfused, dtype)

    expected = gate_reference(reference(prologue_reference(raw_q, query), *pages, window=window), gate)
    is_decode = np.asarray(pa.decode_metadata(batch.query_start, tokens).token_row) >= 0
    loose = {"atol": 2e-6, "rtol": 2e-6} if dtype == jnp.float32 else {"atol": 2e-2, "rtol": 2e-2}
    got = np.asarray(fused, np.float32)
    np.testing.assert_allclose(got[is_decode], np.asarray(expected, np.float32)[is_decode], **loose)
    np.testing.assert_array_equal(got[~is_decode], 0.0)


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_fused_mixed_step_matches_reference(kind):
    """A step with prefill chunks, a verify block and decodes (use_kernel="decode"): decode tokens take
    the fused kernels, the rest the references around plain jnp; the whole equals the reference."""
    window = SLIDING_WINDOW if kind == "sliding" else None
    batch = make_batch(17, MIXED, page_size=16, kv_heads=1, group=6, dtype=jnp.float32, window=window,
                       padding_tokens=2)
    rng = np.random.default_rng(5)
    raw_q = jnp.asarray(3 * rng.standard_normal(batch.queries.shape), jnp.float32)
    query, _ = layer_prologues(rng, token_positions(batch), kind)
    gate = random_gate(rng, *batch.queries.shape[:2], jnp.float32)
    pages = (batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    mixed = op(raw_q, *pages, window=window, use_kernel="decode", query_prologue=query, output_gate=gate, interpret=True)
    expected = gate_reference(reference(prologue_reference(raw_q, query), *pages, window=window), gate)
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(expected), atol=2e-6, rtol=2e-6)
    plain = op(raw_q, *pages, window=window, use_kernel=False, query_prologue=query, output_gate=gate)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(expected), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype, kv_heads, kind", [(jnp.float32, 3, "sliding"), (jnp.bfloat16, 1, "sliding"),
                                                   (jnp.bfloat16, 2, "full"), (jnp.float32, 1, None)])
def test_write_kernel_equals_reference_write(dtype, kv_heads, kind):
    """The write kernel (k norm + RoPE, then both rows in place) equals the reference prologue + XLA's
    scatter (to the last fp32 bit); padding tokens (slot -1) write nothing. `kind=None`: no prologue."""
    rng = np.random.default_rng(kv_heads)
    num_pages, page_size, tokens = 9, 16, 13
    pages = [jnp.asarray(rng.standard_normal((num_pages, page_size, kv_heads, HEAD_DIM)), dtype) for _ in range(2)]
    new_k, new_v = (jnp.asarray(3 * rng.standard_normal((tokens, kv_heads, HEAD_DIM)), dtype) for _ in range(2))
    slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    slots[[2, 7, 12]] = -1
    # Positions around page edges; the key of a full layer has no position transform.
    positions = np.array([0, 15, 16, 17, 31, 32, 63, 64, 65, 100, 511, 512, 513], np.int32)
    key = None if kind is None else layer_prologues(rng, positions, kind)[1]
    expected = write_reference(*pages, new_k, new_v, jnp.asarray(slots), key_prologue=key)
    fused = jax.jit(functools.partial(pa.write_kv, use_kernel=True, interpret=True))(
        *pages, new_k, new_v, jnp.asarray(slots), key_prologue=key
    )
    for got, want, old in zip(fused, expected, pages):
        assert_same_rounding(got, want, dtype)
        assert int((np.asarray(got) != np.asarray(old)).any(axis=(2, 3)).sum()) == tokens - 3  # rows written


@pytest.mark.parametrize("dtype, kv_heads, group, kind", [(jnp.float32, 3, 1, "sliding"), (jnp.bfloat16, 1, 6, "sliding"),
                                                          (jnp.bfloat16, 2, 6, "full"), (jnp.float32, 2, 8, "full"),
                                                          (jnp.bfloat16, 1, 3, "full")])
def test_write_kernel_with_queries_applies_their_prologue(dtype, kv_heads, group, kind):
    """With `queries`, the write kernel also returns them with the query prologue applied: equal to the
    reference prologue for every token (padding and prefill tokens too: the caller picks what it reads),
    odd groups (padded to a power of two of rows, masked) included; the pages as without queries."""
    rng = np.random.default_rng(40 + group + kv_heads)
    num_pages, page_size, tokens = 7, 16, 11
    pages = [jnp.asarray(rng.standard_normal((num_pages, page_size, kv_heads, HEAD_DIM)), dtype) for _ in range(2)]
    new_k, new_v = (jnp.asarray(3 * rng.standard_normal((tokens, kv_heads, HEAD_DIM)), dtype) for _ in range(2))
    raw_q = jnp.asarray(3 * rng.standard_normal((tokens, kv_heads * group, HEAD_DIM)), dtype)
    slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    slots[[1, 9]] = -1
    positions = np.array([0, 15, 16, 17, 63, 64, 65, 100, 511, 512, 513], np.int32)
    query, key = layer_prologues(rng, positions, kind)
    write = jax.jit(functools.partial(pa.write_kv_kernel, interpret=True))
    k_pages, v_pages, queries = write(*pages, new_k, new_v, jnp.asarray(slots), key_prologue=key, queries=raw_q,
                                      query_prologue=query)
    assert queries.shape == raw_q.shape and queries.dtype == dtype
    assert_same_rounding(queries, prologue_reference(raw_q, query), dtype)
    for got, want in zip((k_pages, v_pages), write(*pages, new_k, new_v, jnp.asarray(slots), key_prologue=key)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="query prologue"):
        pa.write_kv_kernel(*pages, new_k, new_v, jnp.asarray(slots), key_prologue=key, queries=raw_q, interpret=True)


def test_kernel_rounding_to_bf16_is_round_to_nearest_even():
    """The kernels' bit-level bf16 rounding (which Triton cannot elide) equals the dtype conversion,
    ties (even and odd), subnormals, huge values and zeros included."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    values = np.concatenate([bits, ties]).view(np.float32)
    values = values[np.isfinite(values) & (np.abs(values) < 3.38e38)]  # rounding past bf16's max: inf
    values = np.concatenate([values, [0.0, -0.0, 1e-40, -3e-39, 3.3e38]]).astype(np.float32)
    got = jax.jit(lambda x: pa._rounded(x, jnp.bfloat16))(jnp.asarray(values))
    want = jnp.asarray(values).astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_fused_kernels_lower_for_the_gpu(triton_for_sm90, monkeypatch, kind):
    """The Triton lowering of the fused split kernel, the gated combine and the write kernel, on CPU
    told the GPU is sm_90, at Beam's TP8 shape (6 q heads on 1 kv head, head_dim 128, pages of 64, bf16)."""
    monkeypatch.setattr(pa, "DECODE_MOSAIC_SPLIT", False)  # the Triton split kernel, also on a Hopper host
    shape, bf16, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    window = 512 if kind == "sliding" else None
    for batch, context, tokens, decode_only in [(1, 32768, 1, True), (8, 8192, 64, False)]:
        max_pages = context // 64
        pages = shape((batch * max_pages, 64, 1, 128), bf16)
        weight, per_token = shape((128,), bf16), shape((tokens, 128), f32)
        if kind == "sliding":
            query = key = pa.HeadPrologue(weight, 1e-6, rope_cos=per_token, rope_sin=per_token)
        else:
            query, key = pa.HeadPrologue(weight, 1e-6, ssmax_scale=shape((tokens,), f32)), pa.HeadPrologue(weight, 1e-6)
        gate = pa.OutputGate(shape((tokens, 6, 128), bf16), shape((6,), bf16))

        def layer(q, k, v, k_pages, v_pages, slots, query_start, seq_lens, table, query, key, gate, *, decode_only):
            k_pages, v_pages = pa.write_kv(k_pages, v_pages, k, v, slots, key_prologue=key, use_kernel=True)
            return pa.ragged_paged_attention(
                q, k_pages, v_pages, query_start, seq_lens, table, window=window, use_kernel="decode",
                decode_only=decode_only, query_prologue=query, output_gate=gate,
            )

        args = (shape((tokens, 6, 128), bf16), shape((tokens, 1, 128), bf16), shape((tokens, 1, 128), bf16), pages,
                pages, shape((tokens,), i32), shape((batch + 1,), i32), shape((batch,), i32),
                shape((batch, max_pages), i32), query, key, gate)
        step = functools.partial(layer, decode_only=decode_only)
        text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        # The write kernel, the split kernel and the gated combine.
        assert text.count("triton") == 3, text.count("triton")
        assert "write_kv_norm_rope" in text if kind == "sliding" else "write_kv" in text
        assert "paged_decode_split" in text and "paged_decode_combine" in text and "_gated" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kv_heads, group, page_size, kind", [(jnp.bfloat16, 1, 6, 64, "sliding"),
                                                                     (jnp.bfloat16, 2, 8, 16, "full"),
                                                                     (jnp.float32, 3, 6, 16, "sliding")])
def test_fused_kernels_compiled_match_unfused_on_gpu(dtype, kv_heads, group, page_size, kind):
    """Compiled through Triton: the fused decode (decode-only and mixed) and the write kernel against
    the references around the plain kernels. Triton computes rsqrt / the norm's sum / sigmoid its own
    way (and may contract RoPE's products into FMAs), so a prologue value can land one bf16 ulp off;
    the attention output then moves within the decode kernel's usual bf16 tolerance. The written keys
    (the prologue alone) stay within one bf16 ulp of their scale (normed values are O(1)) / a few fp32
    ulps: not of each element, since RoPE's difference of products near zero turns an input ulp into a
    large relative change of a small output (on the H200: 7 of 40,960 keys, at most 2.7e-3 off)."""
    window = 64 if kind == "sliding" else None
    for specs, decode_only in [(DECODES, True), (MIXED, False)]:
        batch = make_batch(23 + group, specs, page_size=page_size, kv_heads=kv_heads, group=group, dtype=dtype,
                           window=window, release="hole" if kind == "sliding" else "none", padding_tokens=3)
        rng = np.random.default_rng(group)
        raw_q = jnp.asarray(3 * rng.standard_normal(batch.queries.shape), dtype)
        query, key = layer_prologues(rng, token_positions(batch), kind)
        gate = random_gate(rng, *batch.queries.shape[:2], dtype)
        pages = (batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
        kw = {"window": window, "use_kernel": "decode", "decode_only": decode_only}
        fused = op(raw_q, *pages, query_prologue=query, output_gate=gate, **kw)
        unfused = gate_reference(op(prologue_reference(raw_q, query), *pages, **kw), gate)
        attention = {"atol": 1e-5, "rtol": 1e-5} if dtype == jnp.float32 else {"atol": 2e-2, "rtol": 2e-2}
        np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(unfused, np.float32), **attention)

        tokens = batch.queries.shape[0]
        new_k, new_v = (jnp.asarray(3 * rng.standard_normal((tokens, kv_heads, HEAD_DIM)), dtype) for _ in range(2))
        slots = jnp.asarray(rng.permutation(batch.k_pages.shape[0] * page_size)[:tokens], jnp.int32)
        written = jax.jit(functools.partial(pa.write_kv, use_kernel=True))(*pages[:2], new_k, new_v, slots,
                                                                           key_prologue=key)
        expected = write_reference(*pages[:2], new_k, new_v, slots, key_prologue=key)
        close = {"atol": 1e-5, "rtol": 1e-5} if dtype == jnp.float32 else {"atol": 2**-6, "rtol": 2**-7}
        for got, want in zip(written, expected):
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **close)
        # The write kernel with the query prologue too (the Mosaic decode path's): queries as the reference's.
        *written, queries = jax.jit(pa.write_kv_kernel)(*pages[:2], new_k, new_v, slots, key_prologue=key,
                                                        queries=raw_q, query_prologue=query)
        np.testing.assert_allclose(np.asarray(queries, np.float32),
                                   np.asarray(prologue_reference(raw_q, query), np.float32), **close)
        for got, want in zip(written, expected):
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **close)
