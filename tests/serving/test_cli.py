"""`beam-serve` flags: `--tp` serves on a tensor-parallel mesh of local devices (the same greedy tokens
as one device; 8 CPU devices in a subprocess, tests/serving/parallel_worker.py) and refuses meshes
the devices or the model cannot hold, naming why; `--quantization` (`--quant`) quantizes bf16 experts
as they load and refuses a checkpoint quantized in another format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import beam_jax
from beam_jax.checkpoint import save_checkpoint
from beam_jax.config import preset
from beam_jax.model import flat_params
from beam_jax.quant.convert import quantize_params
from serving.cli import build_engine, parser
from serving.engine import check_parallelism
from tests.beam_jax.sharding_worker import XLA_FLAGS
from tests.serving.parallel_worker import PROMPT_LENGTHS, greedy

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


def test_ep2_and_tp2_ep2_give_the_tokens_of_one_device():
    one, ep2, both = (
        run_worker("1", *SMALL)["1"],
        run_worker("1", *SMALL, "--ep", "2")["1"],
        run_worker("2", *SMALL, "--ep", "2")["2"],
    )
    assert ep2["tokens"] == one["tokens"] and both["tokens"] == one["tokens"]
    assert (ep2["param_devices"], both["param_devices"]) == (2, 4)


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


# ---- --quantization ------------------------------------------------------------------------------
EXPERT = "model.layers.1.mlp.experts.down_proj."  # beam-tiny's first sparse layer


@pytest.mark.parametrize(
    ("flag", "expert_format", "stored"), [("fp8", "fp8_channel", jnp.float8_e4m3fn), ("nvfp4", "nvfp4", jnp.uint8)]
)
def test_quantization_at_load_generates(flag, expert_format, stored):
    engine = build_engine(parser().parse_args([*SMALL, "--quant", flag]))
    assert engine.beam.config.expert_format == expert_format
    flat = flat_params(engine.runner.params)
    assert flat[EXPERT + "weight"].dtype == stored  # packed on the device, not bf16 copies
    assert flat[EXPERT + "weight_scale"].dtype != jnp.bfloat16
    assert flat["model.embed_tokens.weight"].dtype == jnp.float32  # only the experts are quantized
    tokens = greedy(engine)
    assert [len(t) for t in tokens] == [8] * len(PROMPT_LENGTHS)


def test_quantization_of_a_quantized_checkpoint(tmp_path):
    beam = beam_jax.load("beam-tiny", dtype=jnp.float32)
    save_checkpoint(tmp_path, *quantize_params(beam.config, beam.params, "fp8_channel"))
    with pytest.raises(SystemExit, match=r"already quantized \(fp8_channel\); quantization 'nvfp4' applies to bf16"):
        build_engine(parser().parse_args([*SMALL, "--model", str(tmp_path), "--quantization", "nvfp4"]))
    # The method it already has: served as stored.
    engine = build_engine(parser().parse_args([*SMALL, "--model", str(tmp_path), "-q", "fp8"]))
    assert engine.beam.config.expert_format == "fp8_channel"


def test_tp2_with_nvfp4_at_load_gives_the_tokens_of_one_device():
    out = run_worker("1,2", *SMALL, "--quant", "nvfp4")
    assert out["2"]["tokens"] == out["1"]["tokens"]
    assert out["1"]["expert_format"] == out["2"]["expert_format"] == "nvfp4"
    assert out["2"]["param_devices"] == 2
