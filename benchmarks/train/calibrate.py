"""Training throughput of beam-tiny-code at its batch shape, and the step count that fits a time
budget at a token cap (how the shipped run's --steps was chosen):

    python -m benchmarks.train.calibrate --data DIR --budget-s 330 --max-steps 3000
Prints one JSON line; the last field, `steps`, is what to pass to `tiny_code train`.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from beam_jax.train.loop import TrainConfig, train
from beam_jax.train.tiny_code import beam_tiny_code_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--probe-steps", type=int, default=40)
    args = parser.parse_args()
    train_stream = np.load(f"{args.data}/train.npy")
    heldout = np.load(f"{args.data}/heldout.npy")[: 4 * 1025]  # evaluation is not what is timed
    config = TrainConfig(steps=args.probe_steps)
    _, history = train(
        beam_tiny_code_config(), config, train_stream, heldout, eval_every=args.probe_steps, log=lambda _: None
    )
    tokens_per_s = history[-1]["train_tokens_per_s"]
    steps = min(args.max_steps, int(args.budget_s * tokens_per_s / (config.batch_size * config.seq_len)))
    print(json.dumps({"device": jax.devices()[0].device_kind, "train_tokens_per_s": tokens_per_s, "steps": steps}))


if __name__ == "__main__":
    main()
