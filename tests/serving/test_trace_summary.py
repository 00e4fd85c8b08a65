"""benchmarks/engine/trace_summary.py on the H200 trace recorded in session 14 (5 decode steps of
beam-tp8-slice at batch 1, before the one-array transfers): the phases RESULTS.md quotes from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ENGINE = Path(__file__).parents[2] / "benchmarks/engine"
spec = importlib.util.spec_from_file_location("trace_summary", ENGINE / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_summary)


def test_the_recorded_step_splits_into_its_phases():
    trace = ENGINE / "trace-2026-12-02-h200-s14-run-d-batch1.json.gz"
    rows = trace_summary.summarize(trace_summary.load_events(str(trace)))
    assert len(rows) == 5
    step = rows[2]
    assert step["wall_us"] == pytest.approx(4733.3, abs=0.1)
    assert step["input puts (DevicePut)"][1] == 26 and step["output fetches (np.asarray)"][1] == 4
    assert step["CUDA graph launch"][0] == pytest.approx(763.3, abs=0.1)
    assert step["gpu_busy_us"] == pytest.approx(575, abs=1) and step["gpu_kernels"] == 174
    assert step["gpu_span_us"] < 700 < step["gpu_first_kernel_at_us"]  # the GPU waits for the host
    assert "GPU busy 575 us" in trace_summary.describe(step)
