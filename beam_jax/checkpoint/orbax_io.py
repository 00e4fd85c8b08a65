"""Orbax checkpoints of the parameter state, for fast restarts.

Layout: `<directory>/config.json` (with `dtype`, as in an HF checkpoint) and
`<directory>/params/` (an orbax StandardCheckpointer tree). Restoring goes straight into
`abstract_params` targets, so orbax reads each array into its final dtype and placement.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from beam_jax.checkpoint.reader import float_dtype
from beam_jax.checkpoint.writer import write_config
from beam_jax.config import BeamConfig
from beam_jax.model import Params, abstract_params, flat_params, param_name

PARAMS_DIR = "params"
# Files orbax writes into a finished checkpoint directory (either marks one).
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")

ShardingFor = Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding]


def is_orbax_checkpoint(path: str | Path) -> bool:
    """True for a directory written by `save_orbax` (config.json beside an orbax `params/`)."""
    params = Path(path) / PARAMS_DIR
    return (Path(path) / "config.json").is_file() and any((params / m).exists() for m in _ORBAX_MARKERS)


def save_orbax(directory: str | Path, config: BeamConfig, params: Params) -> Path:
    """Save `params` (overwriting an earlier save in `directory`) and config.json; returns the
    directory. The floating dtype recorded is the embedding's; the router stays float32."""
    config.require_checkpoint_layout(f"save an orbax checkpoint to {directory}")  # before anything is written
    directory = Path(directory).absolute()  # orbax requires absolute paths
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(flat_params(params)["model.embed_tokens.weight"].dtype)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / PARAMS_DIR, params, force=True)
        checkpointer.wait_until_finished()
    write_config(directory, config, dtype)
    return directory


def restore_orbax(
    directory: str | Path, *, dtype=None, sharding: ShardingFor | None = None
) -> tuple[BeamConfig, Params]:
    """Restore `(config, params)`. `dtype=None` keeps the saved floating dtype; otherwise orbax
    casts on read (router stays float32). `sharding(name, shape_dtype)` places each parameter
    (default: orbax's default device)."""
    directory = Path(directory).absolute()
    if not is_orbax_checkpoint(directory):
        raise FileNotFoundError(f"{directory}: not an orbax checkpoint (no config.json and {PARAMS_DIR}/)")
    config = BeamConfig.load(directory)
    if dtype is None:
        dtype = json.loads((directory / "config.json").read_text()).get("dtype", "bfloat16")
    target = abstract_params(config, float_dtype(dtype))
    if sharding is not None:
        target = nnx.from_flat_state(
            [
                (path, leaf.replace(_with_sharding(leaf.get_value(), sharding(param_name(path), leaf.get_value()))))
                for path, leaf in nnx.to_flat_state(target)
            ]
        )
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(directory / PARAMS_DIR, target)
    return config, params


def _with_sharding(spec: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
