"""Device memory of a loaded `beam-tp8-slice` checkpoint, per expert format, against the planner.

    python benchmarks/memory/loaded_weights.py [--layers 4] [--out results.json]

Writes a random bf16 checkpoint of the slice, quantizes it to FP8 and NVFP4 with the project's
own quantizer, loads each onto the default device and reads the allocator's bytes in use
before and after; the planner (`beam_jax.memory_plan`, tp=1 on the slice) predicts the weight
bytes from the config alone. Run on the GPU machine; results go to benchmarks/memory/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from beam_jax.checkpoint import init_checkpoint, load_checkpoint, save_checkpoint
from beam_jax.config import preset
from beam_jax.memory_plan import plan_memory
from beam_jax.quant.convert import quantize_params

# CLI name of the expert format -> (quantize_params format, planner format)
FORMATS = {"bf16": (None, "bf16"), "fp8": ("fp8_channel", "fp8"), "nvfp4": ("nvfp4", "nvfp4")}


def bytes_in_use() -> int:
    return jax.devices()[0].memory_stats()["bytes_in_use"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="slice layers (3 dense, then sparse)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    config = preset("beam-tp8-slice", num_hidden_layers=args.layers)
    cpu = jax.devices("cpu")[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        bf16_dir = init_checkpoint(Path(tmp) / "bf16", config, seed=0, dtype="bfloat16")
        print(f"wrote bf16 checkpoint in {time.time() - started:.0f} s", flush=True)
        for name, (quant_format, plan_format) in FORMATS.items():
            directory = bf16_dir
            if quant_format is not None:
                started = time.time()
                _, host_params = load_checkpoint(bf16_dir, put=lambda _, a: jax.device_put(a, cpu), progress=False)
                quant_config, quant_params = quantize_params(config, host_params, quant_format)
                directory = save_checkpoint(Path(tmp) / name, quant_config, quant_params)
                del host_params, quant_params
                print(f"quantized to {name} in {time.time() - started:.0f} s", flush=True)
            gc.collect()
            before = bytes_in_use()
            _, params = load_checkpoint(directory, progress=False)
            jax.block_until_ready(params)
            measured = bytes_in_use() - before
            planned = plan_memory(config, tp=1, quant=plan_format, drafter=False).weights.total
            rows.append({"format": name, "measured_bytes": measured, "planned_bytes": planned})
            del params
            gc.collect()

    print(f"\nbeam-tp8-slice, {args.layers} layers, device {jax.devices()[0].device_kind}")
    print(f"{'format':<8}{'measured GiB':>14}{'planned GiB':>13}{'planned/measured':>18}")
    for row in rows:
        ratio = row["planned_bytes"] / row["measured_bytes"]
        row["ratio"] = ratio
        print(f"{row['format']:<8}{row['measured_bytes'] / 2**30:>14.3f}{row['planned_bytes'] / 2**30:>13.3f}{ratio:>18.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": args.layers, "device": jax.devices()[0].device_kind, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
