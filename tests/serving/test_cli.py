"""`beam-serve` flags: `--tp` serves on a tensor-parallel mesh of local devices (the same greedy tokens
as one device; 8 CPU devices in a subprocess, tests/serving/parallel_worker.py) and refuses meshes
the devices or the model cannot hold, naming why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beam_jax.config import preset
from serving.cli import build_engine, parser
from serving.engine import check_parallelism
from tests.beam_jax.sharding_worker import XLA_FLAGS

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--model",
    "beam-tiny",
    "--dtype",
    "float32",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "16",
    "--max-model-len",
    "64",
]


def run_worker(tps: str, *flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS.format(devices=8), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.serving.parallel_worker", tps, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tp2_gives_the_tokens_of_one_device():
    out = run_worker("1,2", *SMALL)
    assert out["2"]["tokens"] == out["1"]["tokens"]
    assert len({tuple(t) for t in out["1"]["tokens"]}) == 3  # not trivially equal outputs
    assert (out["1"]["param_devices"], out["1"]["cache_devices"]) == (1, 1)
    assert (out["2"]["param_devices"], out["2"]["cache_devices"]) == (2, 2)


def test_tp_errors_name_the_problem():
    tiny = preset("beam-tiny")  # 4 query heads, 2 KV heads, 16 experts of intermediate 32
    with pytest.raises(ValueError, match=r"tp=4 x ep=1 needs 4 devices, JAX sees 2"):
        check_parallelism(tiny, 4, 1, num_devices=2)
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(4\) is not divisible by tp=3.*"
        r"moe_intermediate_size \(32\) is not divisible by tp=3",
    ):
        check_parallelism(tiny, 3, 1, num_devices=8)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        check_parallelism(tiny, 0, 1, num_devices=8)
    check_parallelism(tiny, 4, 1, num_devices=8)  # KV heads (2) replicate: allowed
    # This process has one CPU device: the CLI exits with the reason before loading anything.
    with pytest.raises(SystemExit, match=r"error: cannot serve on tp=2.*needs 2 devices, JAX sees 1.*XLA_FLAGS"):
        build_engine(parser().parse_args([*SMALL, "--tp", "2"]))
