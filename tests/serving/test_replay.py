"""The agentic replay benchmark at a small scale: the prefix cache serves within 2 points of the
ideal hit rate of its workload (and the ideal is far from 0, so the check means something)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import beam_jax
from serving.engine import EngineConfig, LLMEngine

spec = importlib.util.spec_from_file_location("replay", Path(__file__).parents[2] / "benchmarks/engine/replay.py")
replay = importlib.util.module_from_spec(spec)
sys.modules["replay"] = replay  # dataclasses look their module up there
spec.loader.exec_module(replay)


def test_hit_rate_within_two_points_of_ideal():
    args = argparse.Namespace(users=2, questions=2, context=256, question_tokens=32, tool_tokens=64)
    engine = LLMEngine(beam_jax.load("beam-tiny", dtype=jnp.float32),
                       config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=2048))
    result = replay.replay(engine, replay.make_users(args, np.random.default_rng(0)), reply_tokens=4)
    assert result["ideal_hit_rate"] > 0.6
    assert abs(result["hit_rate"] - result["ideal_hit_rate"]) <= 0.02, result
