"""Checkpoints: HF safetensors (read, write, random init) and orbax (fast restarts).

    config, params = load_any("/ckpt/beam")            # orbax or safetensors, whichever it is
    save_checkpoint("/out", config, params)              # HF layout, transformers loads it

Quantized checkpoints (ModelOpt NVFP4 / FP8, compressed-tensors FP8) load and save in the
producers' per-expert layouts (`quant_layout`); `beam_jax.quant.convert` makes them from bf16.
"""

from __future__ import annotations

from pathlib import Path

from beam_jax.checkpoint.errors import CheckpointError
from beam_jax.checkpoint.orbax_io import is_orbax_checkpoint, restore_orbax, save_orbax
from beam_jax.checkpoint.reader import load_checkpoint, read_config
from beam_jax.checkpoint.writer import init_checkpoint, save_checkpoint
from beam_jax.config import BeamConfig
from beam_jax.model import Params


def load_any(path: str | Path, dtype=None, *, progress: bool = True, **kwargs) -> tuple[BeamConfig, Params]:
    """Restore an orbax checkpoint (`save_orbax`) or load a safetensors one (`load_checkpoint`).
    Other keyword arguments go to the one chosen (`sharding=` for orbax, `put=`/`config=`/`mesh=`
    for safetensors); `progress` applies to safetensors only (orbax restores in one call)."""
    if is_orbax_checkpoint(path):
        return restore_orbax(path, dtype=dtype, **kwargs)
    return load_checkpoint(path, dtype=dtype, progress=progress, **kwargs)


__all__ = [
    "CheckpointError",
    "init_checkpoint",
    "is_orbax_checkpoint",
    "load_any",
    "load_checkpoint",
    "read_config",
    "restore_orbax",
    "save_checkpoint",
    "save_orbax",
]
