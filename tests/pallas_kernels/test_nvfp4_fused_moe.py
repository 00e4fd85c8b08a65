"""The one-launch NVFP4 decode layer (`nvfp4_fused_moe`): its glue through `moe_nvfp4(fused=True)` on the CPU
with the kernel emulated, its lowering for sm_90, and the kernel against the reference in Mosaic GPU's interpret
mode on the CPU (stand-ins for its PTX bodies) and on a GPU."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import nvfp4_fused_moe as nfm
from pallas_kernels import nvfp4_mgpu as nm
from pallas_kernels import nvfp4_moe_mgpu as nmm
from pallas_kernels.mgpu_tiles import is_h100
from tests.pallas_kernels.test_nvfp4_mgpu import _assert_layer_close, _layer_problem, _moe_benchmark

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"  # as the driver names them


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 16, 4), (3, 16, 4), (8, 12, 4), (5, 6, 3)])
def test_fused_glue_matches_reference_with_emulated_kernel(tokens, experts, top_k):
    """The pairs straight in, a block each, at one and several tokens; experts picked by several tokens (12 and 6
    experts for 32 and 15 pairs: one expert's weights in several blocks), on the emulated kernel."""
    problem, (gate_up, down) = _layer_problem(tokens, tokens, 256, 64, experts, top_k, tile_k=128)
    layer = functools.partial(nmm.moe_nvfp4, fused=True, matmul=nm.grouped_matmul_emulated)
    _assert_layer_close(problem, jax.jit(layer)(*problem[:3], gate_up, down))


def test_fused_settings_reach_the_emulated_kernel_and_unknown_ones_are_refused():
    """`moe_nvfp4(fused_settings=)` passes the kernel's own settings: the emulation takes the kernel's (same result)
    and names any that the kernel does not take, as the kernel's call would fail on a GPU."""
    problem, (gate_up, down) = _layer_problem(3, 3, 256, 64, 16, 4, tile_k=128)
    layer = functools.partial(nmm.moe_nvfp4, fused=True, matmul=nm.grouped_matmul_emulated)
    _assert_layer_close(problem, layer(*problem[:3], gate_up, down,
                                       fused_settings=dict(down_overlap=True, down_scales_first=False)))
    with pytest.raises(TypeError, match=r"no settings \['down_lag', 'tiles'\]"):
        layer(*problem[:3], gate_up, down, fused_settings=dict(down_lag=1, tiles=2))
    with pytest.raises(ValueError, match=r"fused_settings \['down_overlap'\] are the one-launch kernel's"):
        layer(*problem[:3], gate_up, down, fused=False, fused_settings=dict(down_overlap=True))


def test_fused_glue_skips_other_devices_and_padding_pairs():
    """Expert parallelism (`expert_offset`: the other half's pairs count zero) and padding tokens (id -1)."""
    from tests.pallas_kernels.test_moe_gemm import share_of_experts

    problem, _ = _layer_problem(21, 1, 256, 64, 16, 4, tile_k=128)
    x, weights, ids, gate, up, down = problem
    share = [share_of_experts(w, 8, 16) for w in (gate, up, down)]
    kernel_weights = nmm.kernel_experts(*share, gate_up_tile_k=128)
    got = nmm.moe_nvfp4(x, weights, ids, *kernel_weights, expert_offset=8, fused=True,
                        matmul=nm.grouped_matmul_emulated)
    _assert_layer_close((x, weights, ids, *share), got, expert_offset=8)
    masked = nmm.moe_nvfp4(x, weights, jnp.full_like(ids, -1), *nmm.kernel_experts(gate, up, down, gate_up_tile_k=128),
                           fused=True, matmul=nm.grouped_matmul_emulated)
    np.testing.assert_array_equal(np.asarray(masked, np.float32), 0.0)


def test_fused_needs_shared_blocks_and_few_tokens():
    problem, (gate_up, down) = _layer_problem(2, 9, 256, 64, 16, 4, tile_k=128)
    with pytest.raises(ValueError, match="shared-row blocks"):
        nmm.moe_nvfp4(*problem[:3], gate_up, down, fused=True, block_builder="sort")
    x = problem[0]
    with pytest.raises(ValueError, match="shapes"):
        nfm.fused_decode_moe(x, jnp.zeros(72, jnp.int32), jnp.zeros((72, 9)), gate_up.packed, gate_up.scales,
                             gate_up.global_scale, down.packed, down.scales, down.global_scale,
                             gate_up_tile_k=128, down_tile_k=64)


def test_counters_come_back_from_either_path():
    """`counters=`: (output, counters) from the fused layer (emulated) and from the two GEMMs, which leave them as
    they are; counters that are not int32 `[slots]` are refused."""
    problem, (gate_up, down) = _layer_problem(4, 3, 256, 64, 16, 4, tile_k=128)
    counters = nfm.fresh_counters()
    for fused in (True, False):
        out, back = nmm.moe_nvfp4(*problem[:3], gate_up, down, fused=fused, counters=counters,
                                  matmul=nm.grouped_matmul_emulated)
        _assert_layer_close(problem, out)
        assert back is counters
    x = problem[0]
    pairs = jnp.zeros(12, jnp.int32)
    for bad in (jnp.zeros((2, nfm.COUNTER_SLOTS), jnp.int32), jnp.zeros(nfm.COUNTER_SLOTS, jnp.float32)):
        with pytest.raises(ValueError, match="counters must be int32"):
            nfm.fused_decode_moe(x, pairs, jnp.zeros(12), gate_up.packed, gate_up.scales, gate_up.global_scale,
                                 down.packed, down.scales, down.global_scale, gate_up_tile_k=128, down_tile_k=64,
                                 counters=bad)


def _specs(experts, hidden, intermediate, tokens, pairs, gate_up_tile_k=256, down_tile_k=64):
    spec = jax.ShapeDtypeStruct
    return (spec((tokens, hidden), jnp.bfloat16), spec((pairs,), jnp.int32), spec((pairs,), jnp.float32),
            spec((experts, hidden // gate_up_tile_k, 2 * intermediate, gate_up_tile_k // 2), jnp.uint8),
            spec((experts, hidden // gate_up_tile_k, 2 * intermediate, gate_up_tile_k // 64), jnp.uint32),
            spec((experts, 2 * intermediate), jnp.float32),
            spec((experts, intermediate // down_tile_k, hidden, down_tile_k // 2), jnp.uint8),
            spec((experts, intermediate // down_tile_k, hidden, down_tile_k // 64), jnp.uint32),
            spec((experts, hidden), jnp.float32))


def _cuda_lowering(op, specs) -> str:
    """`op` on these shapes lowered for CUDA (on the CPU), as text."""
    return jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind,timed", [(H100, True), ("NVIDIA H100 PCIe", False), ("NVIDIA H100 NVL", False),
                                        (H200, False), ("", False)])
def test_only_the_timed_h100_has_defaults_of_its_own(kind, timed):
    assert is_h100(kind) == timed


@pytest.mark.parametrize("tokens,h100_settings", [(1, dict(gate_up_stages=4, gate_up_chunk_scales=True)),
                                                   (2, dict(splits=4, gate_up_stages=3)),
                                                   (4, dict(gate_up_stages=3)), (7, {})])
def test_unset_settings_follow_the_device(tokens, h100_settings, monkeypatch):
    """`program_defaults`: on an H100 the kernel traces as with its H100 settings spelled out; an H200 (and a CPU)
    as with the H200's. (Jaxprs compared: two lowerings of one program differ in their serialized modules.)"""
    def traced(kind, **settings):
        monkeypatch.setattr(nfm, "device_kind", lambda: kind)
        op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=256, down_tile_k=64, **settings)
        return str(jax.make_jaxpr(op)(*_specs(256, 5120, 320, tokens, 8 * tokens)))

    h100, h200 = traced(H100), traced(H200)
    assert h200 == traced("")
    assert h100 == traced(H200, **h100_settings)
    assert (h100 != h200) == bool(h100_settings)
    assert nfm.program_defaults(tokens, H100)["gate_up_stages"] == h100_settings.get("gate_up_stages", 2)


def _shared_memory_bytes(op, specs) -> list[int]:
    """The dynamic shared memory of each Mosaic GPU launch in `op`'s CUDA lowering (read from the kernel's module)."""
    import re

    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import dialect as mgpu_dialect

    modules = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in inner.attributes:
                        config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        modules.append(ir.StringAttr(config["module"]).value_bytes)
                    walk(inner.operation)

    walk(jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo").operation)
    sizes = []
    for blob in modules:
        with jax_mlir.make_ir_context() as context, ir.Location.unknown():
            mgpu_dialect.register_dialect(context)
            context.allow_unregistered_dialects = True
            text = ir.Module.parse(blob).operation.get_asm(enable_debug_info=False)
        for operands in re.findall(r'gpu.launch"\(([^)]*)\)', text):  # the last operand: dynamic smem bytes
            sizes.append(int(re.search(re.escape(operands.split(", ")[-1]) + r" = [^\n]*value = (\d+)", text)[1]))
    return sizes


def test_h100_one_token_default_fits_four_programs_an_sm(monkeypatch):
    """The H100's one-token default (4 gate/up stages, scales staged by chunk) keeps 4 programs an SM (what its
    registers allow): 4 x (its shared memory + the 1 KB the GPU reserves a program) within an SM's 228 KB, where the
    same stages with whole-step staging would not fit."""
    monkeypatch.setattr(nfm, "device_kind", lambda: H100)
    op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=256, down_tile_k=64)
    specs = _specs(256, 5120, 320, 1, 8)
    per_program = lambda smem: smem + 1024  # noqa: E731
    (default,) = _shared_memory_bytes(op, specs)
    (whole_steps,) = _shared_memory_bytes(functools.partial(op, gate_up_chunk_scales=False), specs)
    assert 4 * per_program(default) <= 228 * 1024 < 4 * per_program(whole_steps)


@pytest.mark.parametrize("tokens,splits,down_tile_n,row_chunks", [(1, 4, 64, 1), (3, None, 128, 1), (2, 2, 256, 4),
                                                                (5, None, 128, 1)])
def test_lowers_for_cuda(tokens, splits, down_tile_n, row_chunks):
    """Beam's TP8 expert shape (256 experts, hidden 5120, intermediate 320) lowers to Mosaic GPU on the CPU."""
    op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=256, down_tile_k=64, splits=splits,
                           down_tile_n=down_tile_n, down_decode_row_chunks=row_chunks)
    text = _cuda_lowering(op, _specs(256, 5120, 320, tokens, 8 * tokens))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("tokens,scales_first", [(1, False), (2, True)])
def test_down_scales_first_lowers_against_its_default(tokens, scales_first):
    """The overlapped down loop with its step scales staged before or after the block's wait, each where the
    default is the other (on at one token)."""
    op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=256, down_tile_k=64, down_overlap=True,
                           down_scales_first=scales_first)
    text = _cuda_lowering(op, _specs(256, 5120, 320, tokens, 8 * tokens))
    assert "mosaic_gpu" in text


def test_passed_counters_are_the_kernels_in_place():
    """Counters passed in are the kernel's own buffer (an input aliased to an output: no copy, no zeroing kernel);
    without them, or with too few, the call makes zeroed ones."""
    op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=256, down_tile_k=64)
    specs = _specs(256, 5120, 320, 2, 16)

    def lowered(slots):
        return jax.jit(lambda *args: op(*args[:-1], counters=args[-1]), donate_argnums=9).trace(
            *specs, jax.ShapeDtypeStruct((slots,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()

    def kernel_takes_the_passed_counters(text):
        [call] = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
        return call.split("(", 1)[1].split(")", 1)[0].endswith("%arg9")

    def zeroes_counters(text):
        own = nfm.counter_slots(16)
        return any("broadcast_in_dim" in line and f"tensor<{own}xi32>" in line for line in text.splitlines())

    passed = lowered(nfm.COUNTER_SLOTS)
    assert kernel_takes_the_passed_counters(passed) and not zeroes_counters(passed)
    assert f"tensor<{nfm.COUNTER_SLOTS}xi32> {{tf.aliasing_output = 1 : i32}}" in passed
    assert zeroes_counters(_cuda_lowering(op, specs))
    # Too few slots for the call's 16 pairs: it zeroes its own, and the ones passed come back untouched.
    short = lowered(nfm.counter_slots(16) - 1)
    assert not kernel_takes_the_passed_counters(short) and zeroes_counters(short)


def test_hidden_sizes_of_64_row_tiles_lower_for_cuda():
    """A hidden size that 128-row down tiles do not divide (320) takes 64-row tiles by default."""
    op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=64, down_tile_k=64)
    text = jax.jit(op).trace(*_specs(16, 320, 128, 1, 8, gate_up_tile_k=64)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_one_token_takes_the_two_gemms_where_the_fused_kernel_does_not_fit():
    """Down weights in K steps of 128 (the fused kernel's activation tiles need 64): the default at one token
    is then the two GEMMs (their emulation is called), with the reference's output."""
    problem, (gate_up, _) = _layer_problem(5, 1, 256, 128, 16, 4, tile_k=128)
    down = nmm.KernelNvfp4.from_expert_weights(problem[5], tile_k=128)
    calls = []

    def matmul(*args, **kwargs):
        calls.append(kwargs["tile_k"])
        return nm.grouped_matmul_emulated(*args, **kwargs)

    _assert_layer_close(problem, nmm.moe_nvfp4(*problem[:3], gate_up, down, matmul=matmul))
    assert calls == [128, 128]
    assert not nfm.fits(256, 128, 1) and nfm.fits(256, 64, 1) and not nfm.fits(256, 64, 9)


@pytest.mark.parametrize("tokens,kind,fused", [(2, "", True), (7, "", True), (8, "", False), (8, H200, False),
                                               (8, H100, True), (9, H100, False)])
def test_default_is_one_launch_up_to_seven_tokens_or_eight_on_an_h100(tokens, kind, fused, monkeypatch):
    """`default_config`: the fused layer at 1-7 tokens (its emulation, not the GEMM passed in, is called), at 8 on
    an H100 too, else the two GEMMs; the reference's output either way, experts picked by several tokens (12
    experts, 28 pairs)."""
    monkeypatch.setattr(nmm, "device_kind", lambda: kind)
    problem, (gate_up, down) = _layer_problem(tokens + 60, tokens, 256, 64, 12, 4, tile_k=128)
    calls = []

    def matmul(*args, **kwargs):
        calls.append(kwargs["tile_k"])
        return nm.grouped_matmul_emulated(*args, **kwargs)

    _assert_layer_close(problem, nmm.moe_nvfp4(*problem[:3], gate_up, down, matmul=matmul))
    assert calls == ([] if fused else [128, 64])


def test_timeline_summarizes_each_scope_across_programs(tmp_path, monkeypatch):
    """benchmarks/moe/fused_timeline.py's summary of a profiler trace: a program's first event is its start (the
    global timer, µs), later events clock cycles after it (the trace writes start + cycles / 1e3 as µs)."""
    timeline = _moe_benchmark("fused_timeline", monkeypatch)
    events = []
    for tid, start, (begin, end) in ((1, 10.0, (200, 2200)), (2, 11.0, (200, 4200))):
        for name, (b, e) in (("Init", (0, 100)), ("gate_up_k_loop", (begin, end))):
            events += [dict(name=name, ph="B", ts=start + b / 1e3, tid=tid, pid=1),
                       dict(name=name, ph="E", ts=start + e / 1e3, tid=tid, pid=1)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(dict(traceEvents=events)))
    summary = timeline.summarize(str(trace), clock_ghz=2.0)
    # Program 1: 0.1 us after its start (10.0) to 1.1 us after; program 2 starts 1 us later and runs 2 us.
    assert summary["gate_up_k_loop"] == dict(programs=2, begin=[0.1, 0.6, 1.1], end=[1.1, 2.1, 3.1],
                                             median_length=1.5)
    assert summary["last_program_start"] == 1.0


def test_stamp_summary_reads_the_timer_across_its_wrap_around(monkeypatch):
    """fused_timeline.py's `--stamps` summary: stamps in µs from the first start and phase lengths, per kind of
    program, with the 32-bit nanosecond timer wrapping around between stamps and 0 for a phase not reached."""
    timeline = _moe_benchmark("fused_timeline", monkeypatch)
    assert nfm.STAMPS == ("start", "end", "kind", "ready", "filled", "multiplied", "block", "sm", "stored", "step0",
                          "step1", "step2", "step3")
    first = 2**32 - 2000  # the first start, 2 us before the wrap
    at = lambda us: (first + int(us * 1000)) % 2**32  # noqa: E731
    # gate/up: K loop 3 us (steps 0-1 begun 1 and 2 us in), store 0.5, signal 1.5; SMs 7, 7, 3
    stamps = np.array([[at(1), at(6), 0, 0, 0, at(4), 1, 7, at(4.5), at(2), at(3), 0, 0],
                       [at(0), at(5), 0, 0, 0, at(3), 0, 7, at(3.5), at(1), at(2), 0, 0],
                       [at(0.5), at(4), 0, 0, 0, at(3.5), 1, 3, at(4), at(1.5), at(2.5), 0, 0],
                       [at(2.5), at(11), 1, at(7), at(8), at(10), 1, 3, 0, 0, 0, 0, 0],  # down: wait 4.5, fill 1,
                       [at(2.1), at(9), 1, at(6), at(7), at(8), 0, 5, 0, 0, 0, 0, 0]])  # K loop 2, write 1
    summary = timeline.stamp_summary(stamps.astype(np.uint32).view(np.int32))
    assert summary["kernel_us"] == 11.0
    assert summary["gate_up"] == dict(programs=3, start=[0.0, 0.1, 0.5, 0.9, 1.0], end=[4.0, 4.2, 5.0, 5.8, 6.0],
                                      k_loop=[3.0] * 5, store=[0.5] * 5, signal=[0.0, 0.3, 1.5, 1.5, 1.5],
                                      step0=[1.0] * 5, step1=[2.0] * 5)
    assert summary["down"] == dict(programs=2, start=[2.1, 2.14, 2.3, 2.46, 2.5], end=[9.0, 9.2, 10.0, 10.8, 11.0],
                                   wait=[3.9, 3.96, 4.2, 4.44, 4.5], fill=[1.0] * 5, k_loop=[1.0, 1.1, 1.5, 1.9, 2.0],
                                   write=[1.0] * 5)
    assert summary["blocks"] == dict(ready=[5.0, 6.0], done=[9.0, 11.0])  # block 0's last gate/up ends at 5
    # SM 3 ran one gate/up program (its last ended at 4), SM 7 two (at 6)
    assert summary["sm_gate_up_last_end"] == {1: dict(sms=1, last_end=[4.0] * 5), 2: dict(sms=1, last_end=[6.0] * 5)}


@pytest.mark.parametrize("tokens,programs", [(1, 720), (4, 1920)])  # the down steps overlapped at 1, piped at 4
def test_stamps_come_back_with_the_output(tokens, programs):
    """`fused_decode_moe(stamps=True)`: (output, counters) and the stamps `[programs, len(STAMPS)]` (720 programs at
    one token: 400 gate/up, 320 down)."""
    op = functools.partial(nfm.fused_decode_moe, gate_up_tile_k=256, down_tile_k=64, stamps=True)
    specs = _specs(256, 5120, 320, tokens, 8 * tokens)
    (out, counters), stamps = jax.eval_shape(lambda *a: op(*a, counters=nfm.fresh_counters()), *specs)
    assert out.shape == (8, 5120) and counters.shape == (nfm.COUNTER_SLOTS,)
    assert stamps.shape == (programs, len(nfm.STAMPS)) and stamps.dtype == jnp.int32
    assert "mosaic_gpu" in _cuda_lowering(op, specs)


SMALL = (512, 128, 16, 4)  # hidden, intermediate, experts, top_k


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,settings", [
    (1, {}), (1, dict(gate_up_splits=2, gate_up_tile_n=64, down_tile_n=256, down_decode_row_chunks=4)), (2, {}),
    (3, dict(gate_up_splits=1, down_tile_n=64, down_stages=2)), (5, {}), (7, {}), (8, {}),
    (8, dict(gate_up_splits=2, down_tile_n=256, down_decode_row_chunks=4)),
    (1, dict(fused_settings=dict(down_overlap=True))),
    (5, dict(fused_settings=dict(down_overlap=True), down_tile_n=256, down_decode_row_chunks=4)),
    (1, dict(fused_settings=dict(gate_up_chunk_scales=True, gate_up_stages=4))),
    (4, dict(fused_settings=dict(gate_up_chunk_scales=True)))])
def test_fused_layer_matches_reference_on_gpu(tokens, settings):
    """Beam's TP8 expert shape; the same call twice in one program with other inputs (the semaphores and the
    output start from zero in each call)."""
    _assert_fused_layer_close(tokens, settings, 5120, 320, 256, 8)


@pytest.mark.parametrize("tokens,settings,shape", [
    (1, {}, SMALL), (2, {}, SMALL), (3, dict(gate_up_splits=1, down_tile_n=64, down_stages=2), SMALL),
    (5, {}, (512, 128, 6, 3)), (8, dict(gate_up_splits=2, down_tile_n=256, down_decode_row_chunks=4), SMALL),
    (1, dict(fused_settings=dict(down_overlap=False)), (512, 192, 16, 4)),
    (4, dict(fused_settings=dict(down_overlap=True, down_scales_first=True)), SMALL),
    (1, dict(fused_settings=dict(gate_up_chunk_scales=True, gate_up_stages=4)), SMALL),
    (4, dict(fused_settings=dict(gate_up_chunk_scales=True)), SMALL),
    pytest.param(1, {}, (5120, 320, 256, 8), marks=pytest.mark.slow)])  # (~2 minutes)
def test_fused_layer_matches_reference_interpret(tokens, settings, shape):
    """The kernel in Mosaic GPU's interpret mode on the CPU (`interpret=True`: its grid roles, copies, barriers,
    counters and indexing, with stand-ins for the PTX bodies; the programs one at a time in the grid's order), at
    small shapes with pairs of one expert in several blocks (6 to 16 experts), and once at Beam's TP8 shape."""
    settings = dict(settings, fused_settings=dict(settings.get("fused_settings", {}), interpret=True))
    _assert_fused_layer_close(tokens, settings, *shape)


@pytest.mark.parametrize("tokens,real", [(3, 2), (5, 5), (5, 4)])
def test_fused_layer_skips_other_devices_and_padding_interpret(tokens, real):
    """Interpret mode: half the experts on this device (`expert_offset`: the other half's pairs are skipped by the
    kernel) and a bucket's padding tokens (ids -1: their rows zero)."""
    from tests.pallas_kernels.test_moe_gemm import share_of_experts

    problem, _ = _layer_problem(tokens + 40, tokens, 512, 128, 16, 4, tile_k=256)
    x, weights, ids, gate, up, down = problem
    share = [share_of_experts(w, 8, 16) for w in (gate, up, down)]
    got = nmm.moe_nvfp4(x, weights, ids.at[real:].set(-1), *nmm.kernel_experts(*share, gate_up_tile_k=256),
                        expert_offset=8, fused=True, fused_settings=dict(interpret=True))
    np.testing.assert_array_equal(np.asarray(got[real:], np.float32), 0.0)
    _assert_layer_close((x[:real], weights[:real], ids[:real], *share), got[:real], expert_offset=8)


def _assert_fused_layer_close(tokens, settings, hidden, intermediate, experts, top_k):
    problem, (gate_up, down) = _layer_problem(tokens + 300, tokens, hidden, intermediate, experts, top_k, tile_k=256)
    layer = functools.partial(nmm.moe_nvfp4, fused=True, **settings)
    twice = jax.jit(lambda *args: (layer(*args), layer(args[0] * 2, *args[1:])))
    once, doubled = twice(*problem[:3], gate_up, down)
    _assert_layer_close(problem, once)
    _assert_layer_close((problem[0] * 2, *problem[1:]), doubled)


@pytest.mark.gpu
def test_counters_passed_from_call_to_call_on_gpu():
    """The counters passed on through eight calls in one program, as a model's layers pass them: 1, 5, 1, 3, 2, 2
    and 6 tokens (the second 1 and 2 with the down K steps overlapped the other way from their defaults) and 7 with
    every pair skipped (ids -1: no counter used), from counters one epoch below wrapping around. Each call matches
    the reference (the skipped one is zero), and each counter comes back grown by EPOCH a call that used it: its
    signals' and its waiters' alike."""
    _assert_counters_passed(5120, 320, 256, 8, interpret=False)


def test_counters_passed_from_call_to_call_interpret():
    """The same in interpret mode at a small shape (4 pairs a token, 16 experts)."""
    _assert_counters_passed(*SMALL, interpret=True)


def _assert_counters_passed(hidden, intermediate, experts, top_k, interpret):
    problem, (gate_up, down) = _layer_problem(700, 7, hidden, intermediate, experts, top_k, tile_k=256)
    x, weights, ids = problem[:3]
    plan = ((1, False, {}), (5, False, {}), (1, False, dict(down_overlap=False)), (7, True, {}), (3, False, {}),
            (2, False, dict(down_overlap=False)), (2, False, {}), (6, False, {}))

    def chain(x, weights, ids, gate_up, down, counters):
        outs = []
        for tokens, skipped, settings in plan:
            picked = jnp.full_like(ids[:tokens], -1) if skipped else ids[:tokens]
            out, counters = nmm.moe_nvfp4(x[:tokens], weights[:tokens], picked, gate_up, down, fused=True,
                                          counters=counters, fused_settings=dict(settings, interpret=interpret))
            outs.append(out)
        return outs, counters

    start = jnp.full((nfm.COUNTER_SLOTS,), -nfm.EPOCH, jnp.int32)  # 2^32 - EPOCH: the first call wraps around
    outs, counters = jax.jit(chain, donate_argnums=5)(x, weights, ids, gate_up, down, start)
    uses = np.zeros(nfm.COUNTER_SLOTS, np.int64)
    for tokens, skipped, _ in plan:
        for b in range(0 if skipped else top_k * tokens):
            uses[[2 * b, 2 * b + 1]] += 1
    want = ((uses - 1) * nfm.EPOCH) % 2**32  # the start counts one epoch less
    np.testing.assert_array_equal(np.asarray(counters).view(np.uint32), want.astype(np.uint32))
    for (tokens, skipped, _), out in zip(plan, outs):
        if skipped:
            np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
        else:
            _assert_layer_close((x[:tokens], weights[:tokens], ids[:tokens], *problem[3:]), out)


@pytest.mark.gpu
@pytest.mark.parametrize("bucket,real", [(4, 3), (8, 5)])
def test_fused_layer_skips_a_buckets_padding_on_gpu(bucket, real):
    """An engine step's bucket with padding tokens (ids -1, as `MoE(num_tokens=)` masks them): the real tokens as
    the reference on them alone, the padding's rows zero."""
    problem, (gate_up, down) = _layer_problem(bucket + 500, bucket, 5120, 320, 256, 8, tile_k=256)
    x, weights, ids = problem[:3]
    got = jax.jit(functools.partial(nmm.moe_nvfp4, fused=True))(x, weights, ids.at[real:].set(-1), gate_up, down)
    np.testing.assert_array_equal(np.asarray(got[real:], np.float32), 0.0)
    _assert_layer_close((x[:real], weights[:real], ids[:real], *problem[3:]), got[:real])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_expert_parallel_share_on_gpu(tokens):
    """Half of Beam's experts on this device: the other half's pairs are skipped by the kernel."""
    from tests.pallas_kernels.test_moe_gemm import share_of_experts

    problem, _ = _layer_problem(tokens + 400, tokens, 5120, 320, 256, 8, tile_k=256)
    x, weights, ids, gate, up, down = problem
    share = [share_of_experts(w, 128, 256) for w in (gate, up, down)]
    got = jax.jit(functools.partial(nmm.moe_nvfp4, expert_offset=128, fused=True))(
        x, weights, ids, *nmm.kernel_experts(*share))
    _assert_layer_close((x, weights, ids, *share), got, expert_offset=128)
