"""The Mosaic GPU split decode kernel (`pallas_kernels/decode_attention_mgpu.py`) through
`paged_decode_attention_kernel`: Mosaic GPU's interpret mode on the CPU, the compiled kernel on a GPU,
both against the plain-jnp reference."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa

# (seq_len, q_len): decodes at page boundaries and past them, a prefill chunk (not a decode: zeros),
# an empty sequence, one of 10 pages (splits of unequal page counts).
SPECS = [(1, 1), (64, 1), (65, 1), (200, 1), (37, 5), (0, 0), (130, 1), (600, 1)]


def _batch(seed, *, kv_heads, group, page_size=64, head_dim=128, release_hole=False, specs=SPECS):
    """Pages in a random physical order with garbage in unused pages; `release_hole`: one mapped page
    of the longest sequence becomes -1 (its keys must not count)."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    pages_of = [-(-s // page_size) for s, _ in specs]
    num_pages = sum(pages_of) + 2
    k_pages = rng.standard_normal((num_pages, page_size, kv_heads, head_dim)) * 4
    v_pages = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
    order = iter(rng.permutation(num_pages))
    table = np.full((len(specs), max(pages_of) + 1), -1, np.int32)
    for b, count in enumerate(pages_of):
        for page in range(count):
            table[b, page] = next(order)
    if release_hole:
        table[3, 1] = -1
    q_lens = [q for _, q in specs]
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    queries = rng.standard_normal((int(query_start[-1]) + 2, heads, head_dim))  # two padding tokens
    bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    return (bf16(queries), bf16(k_pages), bf16(v_pages), jnp.asarray(query_start),
            jnp.asarray([s for s, _ in specs], jnp.int32), jnp.asarray(table))


def _check(args, out, window):
    want = np.asarray(pa.ragged_paged_attention_reference(*args, window=window), np.float32)
    decodes = np.asarray(pa.decode_metadata(args[3], args[0].shape[0]).token_row) >= 0
    got = np.asarray(out, np.float32)
    assert not got[~decodes].any()  # other tokens get zeros
    # bf16 outputs; the kernel adds in another order: a few bf16 ulps at the largest value.
    np.testing.assert_allclose(got[decodes], want[decodes], rtol=0, atol=4 * 2.0**-8 * np.abs(want).max())
    assert np.abs(want[decodes]).max() > 0


CASES = [  # kv_heads, group, window, splits, stages, release_hole
    (1, 6, None, 1, 2, False), (2, 6, None, 4, 3, True), (2, 8, 70, 2, 2, False), (3, 1, None, 8, 4, False),
    (1, 6, 100, 16, 2, True), (1, 12, None, 2, 2, False)]  # group 12: two 8-column query tiles


def _device(on_gpu: bool):
    """Where a test runs: interpreted runs and their references on the CPU, also on a GPU host (interpreted
    on a GPU, two of 7680 outputs of the gated test landed 1.4 tolerances away: H200, session 20)."""
    return contextlib.nullcontext() if on_gpu else jax.default_device(jax.devices("cpu")[0])


@pytest.mark.parametrize("kv_heads,group,window,splits,stages,release_hole", CASES)
def test_mosaic_split_matches_reference_interpret(kv_heads, group, window, splits, stages, release_hole):
    with _device(on_gpu=False):
        args = _batch(kv_heads * 10 + group, kv_heads=kv_heads, group=group, release_hole=release_hole)
        blocks = pa.DecodeBlocks(pages_per_step=1, num_splits=splits, num_stages=stages, mosaic_split=True)
        out, _ = pa.paged_decode_attention_kernel(*args, window=window, blocks=blocks, interpret=True)
        _check(args, out, window)


def _prologue_and_gate(seed, args, kind):
    """The model's fused path: raw queries with a sliding (RoPE) or full (SSMax) layer's prologue, and the
    output gate; and the expected output (the references around the reference attention)."""
    rng = np.random.default_rng(seed)
    queries, _, _, query_start, seq_lens, _ = args
    tokens, heads, head_dim = queries.shape
    positions = np.zeros(tokens, np.float32)
    for b, seq_len in enumerate(np.asarray(seq_lens)):
        start, end = np.asarray(query_start)[b : b + 2]
        positions[start:end] = np.arange(seq_len - (end - start), seq_len)
    weight = jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), jnp.float32)
    if kind == "sliding":
        angles = positions[:, None] / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)[None, :]
        angles = np.concatenate([angles, angles], axis=-1).astype(np.float32)
        cos, sin = jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))
        query = pa.HeadPrologue(weight, 1e-6, rope_cos=cos, rope_sin=sin)
    else:
        query = pa.HeadPrologue(weight, 1e-6, ssmax_scale=jnp.asarray((1 + (positions + 1) / 2048) ** 0.1, jnp.float32))
    raw = jnp.asarray(3 * rng.standard_normal(queries.shape), queries.dtype)
    gate = pa.OutputGate(jnp.asarray(2 * rng.standard_normal(queries.shape), queries.dtype),
                         jnp.asarray(rng.standard_normal(heads), queries.dtype))
    # The prologue jitted as the kernel's caller has it (on a GPU, XLA's fusion of the norm rounds a few
    # queries one ulp away from op-by-op jnp, which large scores turn into several output ulps).
    queries = jax.jit(pa.head_prologue_reference)(raw, query)
    want = pa.output_gate_reference(pa.ragged_paged_attention_reference(queries, *args[1:]), gate)
    return raw, query, gate, want


@pytest.mark.parametrize("kind,on_gpu", [("sliding", False), ("full", False),
                                         pytest.param("sliding", True, marks=pytest.mark.gpu),
                                         pytest.param("full", True, marks=pytest.mark.gpu)])
def test_mosaic_split_with_prologue_and_gate(kind, on_gpu):
    """The model's call: raw queries, the query prologue (XLA, before the kernel), the gated combine;
    interpreted on the CPU, compiled on a GPU."""
    with _device(on_gpu):
        args = _batch(41, kv_heads=2, group=6)
        raw, query, gate, want = _prologue_and_gate(3, args, kind)
        blocks = pa.DecodeBlocks(pages_per_step=1, num_splits=4, num_stages=2, mosaic_split=True)
        run = functools.partial(pa.paged_decode_attention_kernel, blocks=blocks, interpret=not on_gpu)
        got, token_row = jax.jit(run)(raw, *args[1:], query_prologue=query, output_gate=gate)
    decodes = np.asarray(token_row) >= 0
    want = np.asarray(want, np.float32)[decodes]
    got = np.asarray(got, np.float32)[decodes]
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * 2.0**-8 * np.abs(want).max())


@pytest.mark.parametrize("kind,on_gpu", [("full", False), pytest.param("sliding", True, marks=pytest.mark.gpu),
                                         pytest.param("full", True, marks=pytest.mark.gpu)])
def test_dependent_launch_after_the_write_gives_the_same_layer(kind, on_gpu):
    """The model's fused layer (the K/V write kernel with the query prologue, then the Mosaic split kernel and the
    gated combine) with the split kernel launched as a dependent of the write (`mosaic_dependent_launch`): the same
    output and pages as launched plainly. On a GPU the split kernel then starts before the write ends, so a copy
    ahead of its wait would read stale queries or pages; interpreted (the CPU case) the wait is skipped."""
    window = 100 if kind == "sliding" else None
    with _device(on_gpu):
        args = _batch(43, kv_heads=2, group=6)
        queries, k_pages, v_pages, query_start, seq_lens, table = args
        raw, query, gate, _ = _prologue_and_gate(5, args, kind)
        key = dataclasses.replace(query, ssmax_scale=None)
        rng = np.random.default_rng(7)
        new_k, new_v = (jnp.asarray(rng.standard_normal((queries.shape[0], 2, 128)), jnp.bfloat16) for _ in range(2))
        token_row = np.asarray(pa.decode_metadata(query_start, queries.shape[0]).token_row)
        slots = np.full(queries.shape[0], -1, np.int32)  # each decode token's K/V at its position's slot
        for t in np.flatnonzero(token_row >= 0):
            position = int(seq_lens[token_row[t]]) - 1
            slots[t] = int(table[token_row[t], position // 64]) * 64 + position % 64
        slots = jnp.asarray(slots)

        def layer(k_pages, v_pages, dependent):
            blocks = pa.DecodeBlocks(pages_per_step=1, num_splits=4, num_stages=2, mosaic_split=True,
                                     mosaic_dependent_launch=dependent)
            k_pages, v_pages, q, left = pa.write_kv_before_decode(
                k_pages, v_pages, new_k, new_v, slots, raw, key_prologue=key, query_prologue=query, blocks=blocks,
                interpret=not on_gpu)
            out = pa.ragged_paged_attention(q, k_pages, v_pages, query_start, seq_lens, table, window=window,
                                            use_kernel="decode", decode_block_sizes=blocks, query_prologue=left,
                                            output_gate=gate, interpret=not on_gpu)
            return out, k_pages, v_pages

        plain, dependent = (jax.jit(functools.partial(layer, dependent=d))(k_pages, v_pages) for d in (False, True))
    assert np.abs(np.asarray(plain[0], np.float32)).max() > 0
    for got, want in zip(dependent, plain):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_mosaic_split_rejects_what_it_cannot_do():
    args = _batch(1, kv_heads=1, group=6, head_dim=96)
    blocks = pa.DecodeBlocks(pages_per_step=1, num_splits=2, mosaic_split=True)
    with pytest.raises(ValueError, match="multiples of 64"):
        pa.paged_decode_attention_kernel(*args, blocks=blocks, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads,group,window,splits,stages,release_hole", CASES)
def test_mosaic_split_matches_reference_on_gpu(kv_heads, group, window, splits, stages, release_hole):
    args = _batch(kv_heads * 10 + group, kv_heads=kv_heads, group=group, release_hole=release_hole)
    blocks = pa.DecodeBlocks(pages_per_step=1, num_splits=splits, num_stages=stages, mosaic_split=True)
    run = jax.jit(functools.partial(pa.paged_decode_attention_kernel, window=window, blocks=blocks))
    _check(args, run(*args)[0], window)


@pytest.mark.parametrize("batch,heads,kv_heads,context,splits,stages,window", [
    (8, 6, 1, 8192, 32, 2, None), (32, 48, 8, 8192, 2, 3, None), (1, 6, 1, 131072, 256, 4, None),
    (32, 6, 1, 32768, 4, 2, 512), (8, 48, 8, 131072, 4, 2, None), (8, 6, 1, 8192, 16, 2, 512)])
def test_mosaic_split_lowers_for_cuda(batch, heads, kv_heads, context, splits, stages, window):
    """Beam's decode shapes (TP8 and all heads; sliding layers, the last with splits of under a page) lower for
    sm_90 on the CPU, within the shared memory at up to 4 stages (the PTX is built on the GPU)."""
    from pallas_kernels import decode_attention_mgpu as dm

    spec = jax.ShapeDtypeStruct
    pages, max_pages = batch * context // 64 + 1, context // 64
    op = functools.partial(dm.split_decode, window=window, softmax_scale=128**-0.5, num_splits=splits, stages=stages)
    specs = (spec((batch, heads, 128), jnp.bfloat16), *[spec((pages, 64, kv_heads, 128), jnp.bfloat16)] * 2,
             spec((batch,), jnp.int32), spec((batch,), jnp.int32), spec((batch, max_pages), jnp.int32))
    assert "mosaic_gpu" in jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _split_specs():
    """`split_decode`'s arguments at 8K x 8 in Beam's TP8 shape (8 sequences of 128 pages, 6 query heads, 1 kv head)."""
    spec = jax.ShapeDtypeStruct
    return (spec((8, 6, 128), jnp.bfloat16), *[spec((1025, 64, 1, 128), jnp.bfloat16)] * 2,
            spec((8,), jnp.int32), spec((8,), jnp.int32), spec((8, 128), jnp.int32))


def test_mosaic_split_with_stamps_lowers_for_cuda():
    """The diagnostic form (`stamps=True`, benchmarks/attention/split_timeline.py) lowers and returns a stamp row a
    program after the partials, its time columns read from `%globaltimer_lo` (until session 38 the stamp helper
    stored 0 there: its inner argument shadowed the `value is None` test, and the H200 showed spans of 0)."""
    from pallas_kernels import decode_attention_mgpu as dm

    op = functools.partial(dm.split_decode, window=None, softmax_scale=128**-0.5, num_splits=4, stages=2, stamps=True)
    traced = jax.jit(op).trace(*_split_specs())
    assert [out.shape for out in traced.out_info][-1] == (8 * 4, len(dm.STAMPS))
    lowered = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in lowered
    assert "globaltimer_lo" in lowered


def test_mosaic_decode_blocks_and_when_the_model_takes_them(monkeypatch):
    """`decode_blocks(mosaic_split=True)`: the Triton kernel's splits, two stages. The model's default takes
    the Mosaic kernel on Hopper for shapes it takes, at any pages a split (session 36 runs 1-2: it wins or ties
    at one and two pages a split, sliding layers included)."""
    blocks = pa.decode_blocks(8, 1, 128, 64, None, mosaic_split=True)
    assert blocks.mosaic_split and blocks.num_stages == pa.DECODE_MOSAIC_STAGES
    assert blocks.num_splits == pa.decode_blocks(8, 1, 128, 64, None).num_splits == 32

    bf16, f32 = jnp.zeros((2, 6, 128), jnp.bfloat16), jnp.zeros((2, 6, 128), jnp.float32)
    pages = jnp.zeros((4, 64, 1, 128), jnp.bfloat16)
    monkeypatch.setattr(pa, "is_hopper", lambda device: False)  # whatever the host is
    assert not pa.use_mosaic_split(bf16, pages, pages)
    monkeypatch.setattr(pa, "is_hopper", lambda device: True)
    assert pa.use_mosaic_split(bf16, pages, pages)
    assert not pa.use_mosaic_split(f32, pages.astype(jnp.float32), pages.astype(jnp.float32))
    assert not pa.use_mosaic_split(bf16, pages[:, :16], pages[:, :16])  # pages of 16
    assert not pa.use_mosaic_split(jnp.zeros((2, 6, 96), jnp.bfloat16), pages[..., :96], pages[..., :96])
    monkeypatch.setattr(pa, "DECODE_MOSAIC_SPLIT", False)
    assert not pa.use_mosaic_split(bf16, pages, pages)


def test_dependent_launch_waits_before_the_first_copies():
    """`split_decode(dependent_launch=True)`: a `griddepcontrol.wait` (the kernel then launches as a dependent of the
    kernel ahead of it) after the length and page-id loads and before any copy; it lowers for sm_90."""
    from pallas_kernels import decode_attention_mgpu as dm

    specs = _split_specs()
    for dependent in (False, True):
        op = functools.partial(dm.split_decode, window=None, softmax_scale=128**-0.5, num_splits=4,
                               dependent_launch=dependent)
        kernel = str(jax.make_jaxpr(op)(*specs))
        assert ("griddepcontrol_wait" in kernel) == dependent
        if dependent:
            wait = kernel.index("griddepcontrol_wait")
            # Before it: the loads of the decode token, the length and the first 2 page ids (`x <- ref[...]`).
            assert kernel.count(" <- ", 0, wait) == 4 and "copy_gmem_to_smem" not in kernel[:wait]
            assert "mosaic_gpu" in jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def test_the_model_launches_the_split_kernel_as_a_dependent_only_after_the_write(monkeypatch):
    """`default_decode_blocks(after_write=True)` (the model's layer, right after the K/V write kernel) takes the
    dependent launch where `DECODE_MOSAIC_DEPENDENT_LAUNCH` says so, on the Mosaic kernel only."""
    queries, pages = jnp.zeros((8, 6, 128), jnp.bfloat16), jnp.zeros((4, 64, 1, 128), jnp.bfloat16)
    monkeypatch.setattr(pa, "is_hopper", lambda device: True)
    for switch in (False, True):
        monkeypatch.setattr(pa, "DECODE_MOSAIC_DEPENDENT_LAUNCH", switch)
        assert pa.default_decode_blocks(queries, pages, pages, 8, 128, None, after_write=True).mosaic_dependent_launch \
            == switch
        assert not pa.default_decode_blocks(queries, pages, pages, 8, 128, None).mosaic_dependent_launch
    monkeypatch.setattr(pa, "is_hopper", lambda device: False)  # the Triton kernel: never
    assert not pa.default_decode_blocks(queries, pages, pages, 8, 128, None, after_write=True).mosaic_dependent_launch


def test_split_timeline_summary_reads_the_timer_across_its_wrap_around(monkeypatch):
    """benchmarks/attention/split_timeline.py's summary: times in µs from the first start, each program's phases,
    over the programs that visit pages, with the 32-bit nanosecond timer wrapping around between stamps."""
    import importlib.util
    from pathlib import Path

    from pallas_kernels import decode_attention_mgpu as dm

    scripts = Path(__file__).parents[2] / "benchmarks/attention"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("split_timeline", scripts / "split_timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    top = 2**32
    # start, fetching, first_page, pages_done, end (ns), pages; the first starts 2 us before the wrap.
    stamps = np.array([[top - 2000, top - 1000, 500, 4000, 4500, 3],
                       [top - 1500, top - 1000, 1000, 2000, 3000, 2],
                       [top - 1900, top - 1800, top - 1700, top - 1700, top - 1600, 0]])  # no pages
    assert list(dm.STAMPS) == ["start", "fetching", "first_page", "pages_done", "end", "pages"]
    summary = timeline.stamp_summary(stamps.astype(np.uint32).view(np.int32))
    assert summary["kernel_us"] == 6.5 and summary["busy_programs"] == 2 and summary["programs"] == 3
    assert summary["at"]["first_page"] == [2.5, 2.55, 2.75, 2.95, 3.0]
    assert summary["phases"]["chain"] == [0.5, 0.55, 0.75, 0.95, 1.0]
    assert summary["phases"]["later_pages"] == [1.0, 1.25, 2.25, 3.25, 3.5]
    assert summary["phases"]["program"] == [4.5, 4.7, 5.5, 6.3, 6.5]
