"""Ragged paged attention against an independent dense attention written here (each sequence's
contiguous K/V, a plain causal/window mask, fp32 math), on fresh seeded random inputs."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa

HEAD_DIM = 32

# Jitted once per shape: eager dispatch compiles every primitive separately and is far slower.
reference = jax.jit(pa.ragged_paged_attention_reference, static_argnames=("window", "softmax_scale"))


@dataclasses.dataclass
class Batch:
    queries: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    query_start: jax.Array
    seq_lens: jax.Array
    page_table: jax.Array
    # Per sequence, for the dense check: contiguous fp32 q/k/v and which key positions are present.
    dense: list


def make_batch(
    seed,
    specs,
    *,
    page_size,
    kv_heads,
    group,
    dtype,
    window=None,
    release="none",
    padding_tokens=0,
):
    """specs: list of (seq_len, q_len). release: "none"; "before_window" (pages no query of the step
    can see become -1, as the engine frees them); "hole" (also an in-window page is -1: its keys must
    be invisible). Unused physical pages hold large garbage, so reading a wrong page shows."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    pages_per_seq = [-(-seq_len // page_size) for seq_len, _ in specs]
    max_pages = max(pages_per_seq) + 1
    num_pages = sum(pages_per_seq) + 3
    k_pages = 10 * rng.standard_normal((num_pages, page_size, kv_heads, HEAD_DIM), dtype=np.float32)
    v_pages = 10 * rng.standard_normal((num_pages, page_size, kv_heads, HEAD_DIM), dtype=np.float32)
    physical = iter(rng.permutation(num_pages))
    page_table = np.full((len(specs), max_pages), -1, np.int32)
    queries, query_start, dense = [], [0], []
    for b, (seq_len, q_len) in enumerate(specs):
        # Round through dtype so the dense check sees exactly the values the kernel sees.
        k = rng.standard_normal((seq_len, kv_heads, HEAD_DIM), dtype=np.float32)
        v = rng.standard_normal((seq_len, kv_heads, HEAD_DIM), dtype=np.float32)
        q = rng.standard_normal((q_len, heads, HEAD_DIM), dtype=np.float32)
        k, v, q = (x.astype(dtype).astype(np.float32) for x in (k, v, q))
        present = np.ones(seq_len, bool)
        first_q_pos = seq_len - q_len
        for page in range(pages_per_seq[b]):
            lo, hi = page * page_size, min((page + 1) * page_size, seq_len)
            released = False
            if release in ("before_window", "hole") and window is not None:
                released = hi - 1 < first_q_pos - window + 1  # every key out of every query's window
            if released:
                present[lo:hi] = False
                continue
            phys = next(physical)
            page_table[b, page] = phys
            k_pages[phys, : hi - lo] = k[lo:hi]
            v_pages[phys, : hi - lo] = v[lo:hi]
        if release == "hole":
            live = [p for p in range(pages_per_seq[b] - 1) if page_table[b, p] >= 0]
            if live:
                hole = live[len(live) // 2]
                page_table[b, hole] = -1
                present[hole * page_size : (hole + 1) * page_size] = False
        queries.append(q)
        query_start.append(query_start[-1] + q_len)
        dense.append((q, k, v, present))
    queries.append(rng.standard_normal((padding_tokens, heads, HEAD_DIM), dtype=np.float32))
    return Batch(
        queries=jnp.asarray(np.concatenate(queries), dtype),
        k_pages=jnp.asarray(k_pages, dtype),
        v_pages=jnp.asarray(v_pages, dtype),
        query_start=jnp.asarray(query_start, jnp.int32),
        seq_lens=jnp.asarray([s for s, _ in specs], jnp.int32),
        page_table=jnp.asarray(page_table),
        dense=dense,
    )


def dense_attention(q, k, v, present, window, scale):
    """fp32 numpy attention of a sequence's last q_len tokens over its contiguous keys."""
    q_len, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    if q_len == 0:
        return np.zeros(q.shape)
    group = heads // kv_heads
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    q_pos = np.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = np.arange(seq_len)[None, :]
    visible = (k_pos <= q_pos) & present[None, :]
    if window is not None:
        visible &= q_pos - k_pos < window
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) * scale
    scores = np.where(visible[None], scores, -np.inf)
    scores -= np.where(visible.any(-1), scores.max(-1), 0.0)[..., None]
    probs = np.exp(scores)
    # A query with no visible key (its only keys were on a released page) gets zeros.
    probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-30)
    return np.einsum("hqk,khd->qhd", probs, v.astype(np.float64))


TOLERANCE = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=4e-2, rtol=4e-2)}


def check(batch, out, window, dtype, scale=None):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    scale = HEAD_DIM**-0.5 if scale is None else scale
    starts = np.asarray(batch.query_start)
    for b, (q, k, v, present) in enumerate(batch.dense):
        expected = dense_attention(q, k, v, present, window, scale)
        np.testing.assert_allclose(out[starts[b] : starts[b + 1]], expected, **TOLERANCE[dtype], err_msg=f"seq {b}")
    # Padding tokens past the last sequence see no keys: zeros, not NaN.
    np.testing.assert_array_equal(out[starts[-1] :], 0.0)


# A mixed step: odd prefill chunks (a first chunk and a later one), decodes at page boundaries,
# a 16-token verify block, and an empty padding sequence.
MIXED = [(37, 37), (63, 1), (64, 1), (65, 1), (130, 29), (97, 16), (0, 0), (128, 3)]


# Every GQA ratio (1, 6, 8) and page size (16, 64) appears in fp32 and in bf16.
CAUSAL_CASES = [
    (jnp.float32, 1, 16),
    (jnp.float32, 6, 64),
    (jnp.float32, 8, 16),
    (jnp.float32, 8, 64),
    (jnp.bfloat16, 1, 64),
    (jnp.bfloat16, 6, 16),
    (jnp.bfloat16, 8, 64),
]


@pytest.mark.parametrize("dtype, group, page_size", CAUSAL_CASES)
def test_reference_matches_dense_causal(dtype, group, page_size):
    batch = make_batch(
        1000 + group + page_size, MIXED, page_size=page_size, kv_heads=2, group=group, dtype=dtype, padding_tokens=5
    )
    out = reference(
        batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table
    )
    assert out.shape == batch.queries.shape and out.dtype == dtype
    check(batch, out, None, dtype)


# Lengths around the window (64) and page boundaries; window larger than some sequences.
WINDOWED = [(63, 1), (64, 1), (65, 1), (129, 1), (200, 16), (150, 40), (30, 30), (64, 64), (190, 7)]


WINDOW_CASES = [
    (jnp.float32, release, window, page_size)
    for release in ("before_window", "hole")
    for window in (64, 17, 1000)
    for page_size in (16, 64)
] + [(jnp.bfloat16, "hole", 64, 16), (jnp.bfloat16, "before_window", 17, 64), (jnp.bfloat16, "none", 1000, 64)]


@pytest.mark.parametrize("dtype, release, window, page_size", WINDOW_CASES)
def test_reference_matches_dense_window(dtype, release, window, page_size):
    batch = make_batch(
        7 * window + page_size, WINDOWED, page_size=page_size, kv_heads=2, group=6, dtype=dtype,
        window=window, release=release, padding_tokens=3,
    )
    if release != "none" and window < 100:
        assert (np.asarray(batch.page_table)[:, :2] == -1).any()  # released pages come before live ones
    out = reference(
        batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table, window=window
    )
    check(batch, out, window, dtype)


def test_reference_softmax_scale_and_jit():
    batch = make_batch(3, MIXED, page_size=16, kv_heads=1, group=8, dtype=jnp.float32)
    fn = jax.jit(pa.ragged_paged_attention_reference, static_argnames=("window", "softmax_scale"))
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    out = fn(*args, softmax_scale=0.3)
    check(batch, out, None, jnp.float32, scale=0.3)


def test_reference_rounds_like_attend():
    """bf16: the paged reference reproduces beam_jax's dense `attend` (same rounding points)."""
    from beam_jax.layers.attention import attend, visibility_mask

    window = 40
    batch = make_batch(11, [(90, 13)], page_size=16, kv_heads=2, group=6, dtype=jnp.bfloat16, window=window)
    out = reference(
        batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table, window=window
    )
    starts = np.asarray(batch.query_start)
    for b, (q, k, v, _) in enumerate(batch.dense):
        seq_len, q_len = k.shape[0], q.shape[0]
        q_pos = jnp.arange(seq_len - q_len, seq_len)[None]
        k_pos = jnp.arange(seq_len)[None]
        expected = jax.jit(attend)(
            jnp.asarray(q, jnp.bfloat16)[None], jnp.asarray(k, jnp.bfloat16)[None], jnp.asarray(v, jnp.bfloat16)[None],
            visibility_mask(q_pos, k_pos, window),
        )[0]
        got = out[starts[b] : starts[b + 1]].astype(jnp.float32)
        # Same rounding points; only fp32 summation order may differ (at most a bf16 ulp here and there).
        np.testing.assert_allclose(got, expected.astype(jnp.float32), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("page_size", [16, 64])
def test_write_kv_follows_page_table_and_skips_padding(page_size):
    rng = np.random.default_rng(page_size)
    num_pages, kv_heads = 12, 2
    k_pages = rng.standard_normal((num_pages, page_size, kv_heads, HEAD_DIM)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, kv_heads, HEAD_DIM)).astype(np.float32)
    page_table = np.full((3, 4), -1, np.int32)
    page_table[0, :2] = [5, 2]
    page_table[1, 1:3] = [9, 0]  # logical page 0 released
    page_table[2, :1] = [7]
    # (sequence, positions) of this step's new tokens, then two padding tokens.
    new_tokens = [(0, p) for p in range(page_size - 3, page_size + 4)] + [(1, 2 * page_size + 1)] + [(2, 0), (2, 1)]
    slots = [page_table[b, p // page_size] * page_size + p % page_size for b, p in new_tokens] + [-1, -1]
    tokens = len(slots)
    new_k = rng.standard_normal((tokens, kv_heads, HEAD_DIM)).astype(np.float32)
    new_v = rng.standard_normal((tokens, kv_heads, HEAD_DIM)).astype(np.float32)
    got_k, got_v = jax.jit(pa.write_kv)(
        jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(new_k), jnp.asarray(new_v),
        jnp.asarray(slots, jnp.int32),
    )
    want_k, want_v = k_pages.copy(), v_pages.copy()
    for t, (b, p) in enumerate(new_tokens):
        phys = page_table[b, p // page_size]
        want_k[phys, p % page_size] = new_k[t]
        want_v[phys, p % page_size] = new_v[t]
    np.testing.assert_array_equal(got_k, want_k)  # also: the -1 slots wrote nothing (no wrap to the last slot)
    np.testing.assert_array_equal(got_v, want_v)


def test_write_then_attend_decode_step():
    """A decode step end to end: write the new token's K/V through the slot mapping, then attend."""
    page_size, kv_heads, group = 16, 2, 6
    specs = [(33, 1), (64, 1), (17, 1)]
    batch = make_batch(21, specs, page_size=page_size, kv_heads=kv_heads, group=group, dtype=jnp.float32)
    rng = np.random.default_rng(22)
    table = np.asarray(batch.page_table)
    # Overwrite each sequence's last key/value (the new token) through write_kv.
    new_k = rng.standard_normal((len(specs), kv_heads, HEAD_DIM)).astype(np.float32)
    new_v = rng.standard_normal((len(specs), kv_heads, HEAD_DIM)).astype(np.float32)
    slots = [table[b, (s - 1) // page_size] * page_size + (s - 1) % page_size for b, (s, _) in enumerate(specs)]
    k_pages, v_pages = pa.write_kv(batch.k_pages, batch.v_pages, new_k, new_v, jnp.asarray(slots, jnp.int32))
    for b, (q, k, v, present) in enumerate(batch.dense):
        k[-1], v[-1] = new_k[b], new_v[b]
    out = reference(batch.queries, k_pages, v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    check(batch, out, None, jnp.float32)


# --- The blocked jnp form (long contexts) against the dense check and the reference ---

blocked = jax.jit(
    pa.ragged_paged_attention_blocked, static_argnames=("window", "softmax_scale", "block_q", "block_pages")
)

BLOCKED_CASES = [
    # dtype, group, page_size, window, release, specs, block_q, block_pages
    (jnp.float32, 6, 16, None, "none", MIXED, 8, 1),
    (jnp.float32, 8, 64, None, "none", MIXED, 256, 32),
    (jnp.float32, 1, 16, 17, "hole", WINDOWED, 4, 3),
    (jnp.float32, 6, 16, 64, "before_window", WINDOWED, 16, 2),
    (jnp.float32, 8, 64, 1000, "hole", MIXED, 32, 1),
    (jnp.bfloat16, 6, 16, None, "none", MIXED, 16, 4),
    (jnp.bfloat16, 8, 64, 17, "hole", WINDOWED, 8, 2),
]


@pytest.mark.parametrize("dtype, group, page_size, window, release, specs, block_q, block_pages", BLOCKED_CASES)
def test_blocked_matches_dense_and_reference(dtype, group, page_size, window, release, specs, block_q, block_pages):
    options = {"window": window, "release": release, "padding_tokens": 3}
    seed = 71 + group + page_size
    batch = make_batch(seed, specs, page_size=page_size, kv_heads=2, group=group, dtype=dtype, **options)
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    out = blocked(*args, window=window, block_q=block_q, block_pages=block_pages)
    assert out.shape == batch.queries.shape and out.dtype == dtype
    check(batch, out, window, dtype)
    # The reference's rounding points: fp32 differs by summation order, bf16 by at most an ulp or so.
    tol = {"atol": 2e-6, "rtol": 2e-6} if dtype == jnp.float32 else {"atol": 4e-3, "rtol": 4e-3}
    expected = reference(*args, window=window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tol)


def test_blocked_is_blind_to_pages_out_of_the_window_past_the_last_query_or_unmapped():
    """NaN in pages wholly before every query's window, in mapped pages past a sequence's last query
    and in page 0 (which -1 entries gather): reading any of them into the output would poison it."""
    window, page_size = 20, 16
    specs = [(200, 1), (150, 16), (97, 33)]
    batch = make_batch(43, specs, page_size=page_size, kv_heads=1, group=8, dtype=jnp.float32, window=window)
    table = np.array(batch.page_table)
    extra = np.zeros((1 + len(specs), *batch.k_pages.shape[1:]), np.float32)  # spare pages
    k_pages, v_pages = (np.concatenate([np.asarray(pages), extra]) for pages in (batch.k_pages, batch.v_pages))
    spare = list(range(len(batch.k_pages), len(k_pages)))
    # Move whatever lives in page 0 to a spare page, then poison page 0.
    moved = spare.pop()
    k_pages[moved], v_pages[moved] = k_pages[0], v_pages[0]
    table[table == 0] = moved
    poisoned = [0]
    for b, (seq_len, q_len) in enumerate(specs):
        poisoned += [table[b, page] for page in range((seq_len - q_len - window + 1) // page_size)]
        last = (seq_len - 1) // page_size
        if last + 1 < table.shape[1]:
            table[b, last + 1] = spare.pop()  # mapped, but past every query of the sequence
            poisoned.append(table[b, last + 1])
        table[b, 0] = -1 if table[b, 0] in poisoned[1:] else table[b, 0]
    # A hole inside the last sequence's window (its first query, 64, sees keys from 45): read as page 0.
    table[2, 3] = -1
    batch.dense[2][3][48:64] = False
    k_pages[poisoned] = v_pages[poisoned] = np.nan
    assert len(poisoned) >= 10
    pages = (jnp.asarray(k_pages), jnp.asarray(v_pages))
    for block_q, block_pages in [(8, 1), (8, 4), (64, 32)]:
        metadata = (batch.query_start, batch.seq_lens, jnp.asarray(table))
        out = blocked(batch.queries, *pages, *metadata, window=window, block_q=block_q, block_pages=block_pages)
        check(batch, out, window, jnp.float32)


def test_op_takes_the_blocked_form_past_the_reference_gather_limit(monkeypatch):
    batch = make_batch(53, MIXED[:5], page_size=16, kv_heads=2, group=6, dtype=jnp.float32)
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    size = pa.reference_gather_size(batch.queries, batch.k_pages, batch.page_table)
    # A fresh jit per call: the limit is read when the op is traced.
    op = lambda **kwargs: jax.jit(functools.partial(pa.ragged_paged_attention, **kwargs))(*args)
    assert size <= pa.REFERENCE_MAX_GATHER
    np.testing.assert_array_equal(op(window=17), reference(*args, window=17))
    monkeypatch.setattr(pa, "REFERENCE_MAX_GATHER", size - 1)
    np.testing.assert_array_equal(op(window=17), blocked(*args, window=17))
    np.testing.assert_array_equal(op(blocked=False), reference(*args))


def test_a_4096_token_chunk_over_a_70k_token_table_fits():
    """The case the reference cannot run on a CPU host (68 GiB of gathered keys and values): the blocked
    form's working set is a few MiB."""
    page_size, max_pages, tokens = 16, 4375, 4096
    shapes = (
        jax.ShapeDtypeStruct((tokens, 4, 16), jnp.float32),
        jax.ShapeDtypeStruct((max_pages + 1, page_size, 2, 16), jnp.float32),
        jax.ShapeDtypeStruct((max_pages + 1, page_size, 2, 16), jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1, max_pages), jnp.int32),
    )
    assert 2 * pa.reference_gather_size(shapes[0], shapes[1], shapes[5]) * 4 > 64 * 2**30  # fp32 keys and values
    compiled = jax.jit(pa.ragged_paged_attention).lower(*shapes).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 2**20


# --- The Pallas kernel, in interpret mode on CPU, against the dense check and the reference ---

kernel_op = jax.jit(
    pa.ragged_paged_attention, static_argnames=("window", "softmax_scale", "use_kernel", "block_q", "interpret")
)

KERNEL_CASES = [
    # dtype, group, page_size, window, release, specs, block_q
    (jnp.float32, 6, 16, None, "none", MIXED, 8),
    (jnp.float32, 8, 64, 17, "hole", WINDOWED, 16),
    (jnp.float32, 1, 16, 64, "before_window", WINDOWED, 4),
    (jnp.bfloat16, 6, 64, 1000, "hole", MIXED[:6], 16),
]


@pytest.mark.parametrize("dtype, group, page_size, window, release, specs, block_q", KERNEL_CASES)
def test_kernel_interpret_matches_dense_and_reference(dtype, group, page_size, window, release, specs, block_q):
    batch = make_batch(
        31 + group, specs, page_size=page_size, kv_heads=2, group=group, dtype=dtype,
        window=window, release=release, padding_tokens=3,
    )
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    out = kernel_op(*args, window=window, use_kernel=True, block_q=block_q, interpret=True)
    assert out.shape == batch.queries.shape and out.dtype == dtype
    check(batch, out, window, dtype)
    expected = reference(*args, window=window)
    # fp32: same math up to summation order. bf16: the kernel rounds unnormalized probabilities.
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tol)


def test_kernel_never_reads_pages_out_of_the_window():
    """Pages wholly before every query's window stay mapped but hold NaN: if the kernel read them,
    0 * NaN would poison the output."""
    window, page_size = 20, 16
    specs = [(200, 1), (150, 16), (97, 33)]
    batch = make_batch(41, specs, page_size=page_size, kv_heads=1, group=8, dtype=jnp.float32, window=window)
    table = np.asarray(batch.page_table)
    k_pages, v_pages = np.array(batch.k_pages), np.array(batch.v_pages)
    poisoned = 0
    for b, (seq_len, q_len) in enumerate(specs):
        first_key = seq_len - q_len - window + 1
        for page in range(first_key // page_size):  # pages ending before the first visible key
            k_pages[table[b, page]] = np.nan
            v_pages[table[b, page]] = np.nan
            poisoned += 1
    assert poisoned >= 10
    out = kernel_op(
        batch.queries, jnp.asarray(k_pages), jnp.asarray(v_pages), batch.query_start, batch.seq_lens, batch.page_table,
        window=window, use_kernel=True, block_q=8, interpret=True,
    )
    check(batch, out, window, jnp.float32)


def test_op_defaults_to_reference():
    batch = make_batch(51, MIXED[:4], page_size=16, kv_heads=2, group=6, dtype=jnp.float32)
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    np.testing.assert_array_equal(kernel_op(*args), reference(*args))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, group, page_size, window",
    [(jnp.bfloat16, 6, 16, None), (jnp.bfloat16, 8, 64, 17), (jnp.float32, 1, 16, 64)],
)
def test_kernel_compiled_matches_reference_on_gpu(dtype, group, page_size, window):
    batch = make_batch(
        61, WINDOWED, page_size=page_size, kv_heads=2, group=group, dtype=dtype,
        window=window, release="hole", padding_tokens=3,
    )
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    out = kernel_op(*args, window=window, use_kernel=True, block_q=16)
    check(batch, out, window, dtype)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    expected = reference(*args, window=window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tol)


# --- The split decode kernels (flash-decoding), in interpret mode, against the dense check and the reference ---

decode_op = jax.jit(
    pa.ragged_paged_attention,
    static_argnames=("window", "softmax_scale", "use_kernel", "block_q", "decode_only", "decode_block_sizes", "interpret"),
)

# Decodes at and around page (16, 64) and window (17, 64) boundaries, a one-token context, empty
# entries (no context; a context but no query this step) and a long one.
DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (63, 1), (64, 1), (65, 1), (0, 0), (129, 1), (40, 0), (300, 1)]

DECODE_CASES = [
    # dtype, group, page_size, window, release, pages_per_step, num_splits
    (jnp.float32, 1, 16, None, "none", 1, 1),
    (jnp.float32, 6, 16, None, "none", 2, 4),
    (jnp.float32, 8, 64, None, "none", 2, 8),  # more splits than most sequences have pages: empty splits
    (jnp.float32, 6, 16, 17, "hole", 4, 2),
    (jnp.float32, 8, 16, 64, "before_window", 2, 4),
    (jnp.float32, 1, 64, 64, "before_window", 1, 2),
    (jnp.bfloat16, 6, 64, None, "hole", 2, 16),
    (jnp.bfloat16, 8, 16, 17, "before_window", 2, 2),
    (jnp.bfloat16, 1, 16, 1000, "hole", 4, 4),
]


@pytest.mark.parametrize("dtype, group, page_size, window, release, pages_per_step, num_splits", DECODE_CASES)
def test_decode_kernel_interpret_matches_dense_and_reference(
    dtype, group, page_size, window, release, pages_per_step, num_splits
):
    batch = make_batch(
        91 + group + page_size, DECODES, page_size=page_size, kv_heads=2, group=group, dtype=dtype,
        window=window, release=release, padding_tokens=3,
    )
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    blocks = pa.DecodeBlocks(pages_per_step=pages_per_step, num_splits=num_splits)
    out = decode_op(*args, window=window, use_kernel=True, decode_only=True, decode_block_sizes=blocks, interpret=True)
    assert out.shape == batch.queries.shape and out.dtype == dtype
    check(batch, out, window, dtype)
    expected = reference(*args, window=window)
    # fp32: same math up to summation order. bf16: the kernel rounds unnormalized probabilities.
    tol = {"atol": 2e-6, "rtol": 2e-6} if dtype == jnp.float32 else {"atol": 2e-2, "rtol": 2e-2}
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tol)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu, id="compiled")])
def test_decode_kernel_never_reads_pages_out_of_the_window_past_the_query_or_unmapped(interpret):
    """NaN in pages wholly before the window, in a mapped page past a sequence's last key, and in page 0
    (which -1 entries and masked lanes point at): if any leaked into the output, 0 * NaN would poison
    it. Compiled on the GPU too: there the masked loads are Triton's, not the interpreter's."""
    window, page_size = 20, 16
    specs = [(200, 1), (150, 1), (97, 1), (33, 1)]
    batch = make_batch(47, specs, page_size=page_size, kv_heads=1, group=6, dtype=jnp.float32, window=window)
    table = np.array(batch.page_table)
    extra = np.zeros((1 + len(specs), *batch.k_pages.shape[1:]), np.float32)
    k_pages, v_pages = (np.concatenate([np.asarray(pages), extra]) for pages in (batch.k_pages, batch.v_pages))
    spare = list(range(len(batch.k_pages), len(k_pages)))
    moved = spare.pop()  # whatever lives in page 0 moves to a spare page; page 0 is poisoned
    k_pages[moved], v_pages[moved] = k_pages[0], v_pages[0]
    table[table == 0] = moved
    poisoned = [0]
    for b, (seq_len, _) in enumerate(specs):
        poisoned += [table[b, page] for page in range((seq_len - window) // page_size)]
        last = (seq_len - 1) // page_size
        if last + 1 < table.shape[1]:
            table[b, last + 1] = spare.pop()  # mapped, but past the sequence's last key
            poisoned.append(table[b, last + 1])
    k_pages[poisoned] = v_pages[poisoned] = np.nan
    assert len(poisoned) >= 10
    args = (batch.queries, jnp.asarray(k_pages), jnp.asarray(v_pages), batch.query_start, batch.seq_lens, jnp.asarray(table))
    for pages_per_step, num_splits in [(1, 1), (4, 2), (2, 8)]:
        blocks = pa.DecodeBlocks(pages_per_step=pages_per_step, num_splits=num_splits)
        out = decode_op(*args, window=window, use_kernel=True, decode_only=True, decode_block_sizes=blocks,
                        interpret=interpret)
        check(batch, out, window, jnp.float32)


def test_mixed_step_sends_decodes_to_the_decode_kernel():
    """In a mixed step the decode tokens come from the decode kernel (equal to a decode-only call on
    the same pages), everything else from the general kernel, and the whole matches the reference."""
    batch = make_batch(57, MIXED, page_size=16, kv_heads=2, group=8, dtype=jnp.float32, padding_tokens=3)
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    metadata = pa.decode_metadata(batch.query_start, batch.queries.shape[0])
    token_row = np.asarray(metadata.token_row)
    starts = np.asarray(batch.query_start)
    decode_tokens = [starts[b] for b, (_, q_len) in enumerate(MIXED) if q_len == 1]
    assert sorted(np.flatnonzero(token_row >= 0)) == decode_tokens and len(decode_tokens) == 3
    mixed = kernel_op(*args, use_kernel=True, block_q=8, interpret=True)
    check(batch, mixed, None, jnp.float32)
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(reference(*args)), atol=2e-6, rtol=2e-6)
    decoded, _ = jax.jit(functools.partial(pa.paged_decode_attention_kernel, interpret=True))(*args, metadata=metadata)
    np.testing.assert_array_equal(np.asarray(mixed)[decode_tokens], np.asarray(decoded)[decode_tokens])
    np.testing.assert_array_equal(np.asarray(decoded)[token_row < 0], 0.0)  # non-decode tokens: zeros


# --- use_kernel="decode" (the GPU's default): decodes on the decode kernel, the rest in plain jnp ---

decode_jnp_op = jax.jit(
    pa.ragged_paged_attention, static_argnames=("window", "use_kernel", "blocked", "decode_only", "interpret")
)

# Prefill chunks, decodes at page and window edges, an empty entry, a long chunk, and a whole prompt.
DECODE_AND_PREFILL = [(37, 37), (63, 1), (1, 1), (200, 16), (0, 0), (65, 1), (150, 40), (129, 1), (30, 30), (300, 1)]

DECODE_JNP_CASES = [
    # dtype, group, page_size, window, release, blocked
    (jnp.float32, 1, 16, None, "none", False),
    (jnp.float32, 6, 16, 17, "hole", False),
    (jnp.float32, 8, 64, 64, "before_window", False),
    (jnp.float32, 6, 64, None, "none", True),
    (jnp.float32, 1, 16, 64, "hole", True),
    (jnp.float32, 8, 16, 1000, "before_window", True),
    (jnp.bfloat16, 6, 16, 17, "before_window", False),
    (jnp.bfloat16, 8, 64, None, "hole", True),
]


@pytest.mark.parametrize("dtype, group, page_size, window, release, blocked", DECODE_JNP_CASES)
def test_decode_kernel_beside_plain_jnp_matches_dense_and_reference(dtype, group, page_size, window, release, blocked):
    batch = make_batch(
        701 + 3 * group + page_size + int(blocked), DECODE_AND_PREFILL, page_size=page_size, kv_heads=2,
        group=group, dtype=dtype, window=window, release=release, padding_tokens=5,
    )
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    out = decode_jnp_op(*args, window=window, use_kernel="decode", blocked=blocked, interpret=True)
    assert out.shape == batch.queries.shape and out.dtype == dtype
    check(batch, out, window, dtype)
    expected = reference(*args, window=window)
    # fp32: same math up to summation order. bf16: the decode kernel rounds unnormalized probabilities.
    tol = {"atol": 2e-6, "rtol": 2e-6} if dtype == jnp.float32 else {"atol": 2e-2, "rtol": 2e-2}
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[int(batch.query_start[-1]) :], 0.0)  # padding


def test_decode_mode_runs_the_decode_kernel_and_no_general_kernel():
    batch = make_batch(77, DECODE_AND_PREFILL[:4], page_size=16, kv_heads=2, group=6, dtype=jnp.float32)
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    text = str(jax.make_jaxpr(functools.partial(pa.ragged_paged_attention, use_kernel="decode", interpret=True))(*args))
    assert "paged_decode_split" in text and "paged_decode_combine" in text and "ragged_paged_attention_block" not in text
    assert "pallas_call" not in str(jax.make_jaxpr(pa.ragged_paged_attention)(*args))
    assert pa.default_use_kernel("gpu") == "decode" and pa.default_use_kernel("cpu") is False
    with pytest.raises(ValueError):
        pa.ragged_paged_attention(*args, use_kernel="general")


def test_blocked_skip_decodes_gives_decodes_zeros():
    batch = make_batch(79, DECODE_AND_PREFILL, page_size=16, kv_heads=2, group=6, dtype=jnp.float32, window=64)
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    blocked = jax.jit(pa.ragged_paged_attention_blocked, static_argnames=("window", "block_q", "skip_decodes"))
    out = np.asarray(blocked(*args, window=64, block_q=16, skip_decodes=True))
    full = np.asarray(blocked(*args, window=64, block_q=16))
    is_decode = np.asarray(pa.decode_metadata(batch.query_start, out.shape[0]).token_row) >= 0
    assert is_decode.sum() == 5
    np.testing.assert_array_equal(out[is_decode], 0.0)
    np.testing.assert_array_equal(out[~is_decode], full[~is_decode])


def test_decode_blocks_fill_the_gpu_and_stay_flat_for_windows():
    # TP8 batch 1 at 128K: one kv head, so the context is split across (at least) every SM.
    blocks = pa.decode_blocks(1, 1, 2048, 64, None)
    assert blocks.num_splits >= 128
    # ... but never into splits shorter than the minimum number of steps.
    for batch, max_pages in [(1, 128), (1, 2048), (8, 512), (32, 128)]:
        blocks = pa.decode_blocks(batch, 1, max_pages, 64, None)
        steps = max_pages // blocks.pages_per_step // blocks.num_splits
        assert steps >= pa.DECODE_MIN_STEPS_PER_SPLIT
    # A window: the splits (and so the work) do not depend on the context.
    sliding = {pa.decode_blocks(1, 1, max_pages, 64, 512) for max_pages in (16, 128, 2048, 16384)}
    assert len(sliding) == 1 and sliding.pop().num_splits <= 16
    # A latency-bound step (fewer loop steps than SMs): one page per split.
    assert pa.decode_blocks(1, 1, 128, 64, None) == pa.DecodeBlocks(1, 128, 4, 1)
    assert pa.decode_blocks(8, 1, 2048, 64, 512).num_splits == 16
    assert pa.decode_blocks(32, 1, 2048, 64, 512).pages_per_step == 2
    # Enough sequences and heads: no split.
    assert pa.decode_blocks(64, 8, 2048, 64, None).num_splits == 1
    # Overrides win; splits and pages per step must be powers of two.
    assert pa.decode_blocks(8, 1, 512, 64, None, pages_per_step=2, num_splits=4, num_warps=8).num_warps == 8
    with pytest.raises(ValueError):
        pa.decode_blocks(1, 1, 64, 64, None, num_splits=3)


@pytest.mark.parametrize("heads, kv_heads, window", [(6, 1, None), (6, 1, 512), (48, 8, None), (8, 1, 512), (16, 16, None)])
def test_decode_kernels_lower_for_the_gpu(triton_for_sm90, monkeypatch, heads, kv_heads, window):
    """The Triton lowering (power-of-two tensors, supported ops) runs on CPU when told the GPU is sm_90:
    at the benchmark's shapes (head_dim 128, pages of 64, bf16), decode-only and mixed."""
    monkeypatch.setattr(pa, "DECODE_MOSAIC_SPLIT", False)  # the Triton split kernel, also on a Hopper host
    shape = jax.ShapeDtypeStruct
    for batch, context, tokens, decode_only in [(1, 131072, 1, True), (32, 8192, 32, True), (8, 8192, 64, False)]:
        max_pages = context // 64
        pages = shape((batch * max_pages, 64, kv_heads, 128), jnp.bfloat16)
        args = (shape((tokens, heads, 128), jnp.bfloat16), pages, pages, shape((batch + 1,), jnp.int32),
                shape((batch,), jnp.int32), shape((batch, max_pages), jnp.int32))
        op = functools.partial(pa.ragged_paged_attention, window=window, use_kernel=True, decode_only=decode_only, block_q=2)
        text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        # The split kernel and the combine kernel (and the general kernel in a mixed step).
        assert text.count("triton") == (2 if decode_only else 3), text.count("triton")
        assert "paged_decode_split" in text and "paged_decode_combine" in text


@pytest.mark.parametrize("combine_num_warps", [1, 2])
def test_combine_warps_reach_the_combine_kernel(triton_for_sm90, monkeypatch, combine_num_warps):
    """`DecodeBlocks.combine_num_warps` (a benchmark knob, decode.py's `r`) is the combine kernel's; the split
    kernel keeps its own."""
    monkeypatch.setattr(pa, "DECODE_MOSAIC_SPLIT", False)
    shape = jax.ShapeDtypeStruct
    pages = shape((8 * 128, 64, 1, 128), jnp.bfloat16)
    args = (shape((8, 6, 128), jnp.bfloat16), pages, pages, shape((9,), jnp.int32), shape((8,), jnp.int32),
            shape((8, 128), jnp.int32))
    blocks = pa.DecodeBlocks(2, 32, num_warps=4, combine_num_warps=combine_num_warps)
    op = functools.partial(pa.ragged_paged_attention, use_kernel=True, decode_only=True, decode_block_sizes=blocks)
    text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(re.findall(r"num_warps = (\d+) : i32", text)) == sorted(["4", str(combine_num_warps)])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, group, page_size, window, num_splits",
    [(jnp.bfloat16, 6, 64, None, 8), (jnp.bfloat16, 8, 16, 17, 2), (jnp.float32, 1, 16, 64, 4),
     (jnp.float32, 6, 16, None, 1)],
)
def test_decode_kernel_compiled_matches_reference_on_gpu(dtype, group, page_size, window, num_splits):
    batch = make_batch(
        67, DECODES, page_size=page_size, kv_heads=2, group=group, dtype=dtype,
        window=window, release="hole", padding_tokens=3,
    )
    args = (batch.queries, batch.k_pages, batch.v_pages, batch.query_start, batch.seq_lens, batch.page_table)
    blocks = pa.DecodeBlocks(pages_per_step=2, num_splits=num_splits)
    out = decode_op(*args, window=window, use_kernel=True, decode_only=True, decode_block_sizes=blocks)
    check(batch, out, window, dtype)
    tol = {"atol": 2e-6, "rtol": 2e-6} if dtype == jnp.float32 else {"atol": 2e-2, "rtol": 2e-2}
    expected = reference(*args, window=window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tol)

