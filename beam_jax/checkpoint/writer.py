"""Write Beam parameters as an HF checkpoint that `transformers.BeamForCausalLM` loads.

Tensors are streamed one at a time from device to file (headers are planned from shapes alone),
so writing never holds more than one parameter on the host.

Quantized experts are written as their producer does: one tensor per expert and projection,
packed values and scales in their own dtypes (per-expert scalars as shape `[]`), the
`quantization_config` in config.json, and for ModelOpt also `hf_quant_config.json`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import jax
import numpy as np

from beam_jax.checkpoint.quant_layout import (
    HF_QUANT_CONFIG,
    STACKED_QUANT,
    hf_quant_config_from_quantization_config,
    is_modelopt,
)
from beam_jax.checkpoint.reader import float_dtype, fp32_params, natural_key
from beam_jax.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE, TensorSpec, write_safetensors
from beam_jax.config import BeamConfig
from beam_jax.model import Params, abstract_flat, flat_params, init_params
from beam_jax.quant.convert import quantize_params

ExpertLayout = Literal["per_expert", "fused"]
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

# A tensor to write: its header entry, the parameter it comes from, and the index into it.
_Entry = tuple[TensorSpec, str, tuple]


def plan_tensors(
    config: BeamConfig, params: dict[str, jax.ShapeDtypeStruct], dtype: np.dtype, expert_layout: ExpertLayout
) -> list[_Entry]:
    """Checkpoint tensors in a stable order (layers numerically); with `per_expert`, each fused
    expert parameter becomes `experts.{e}.{gate,up,down}_proj.weight` (HF's original layout).
    Quantized experts are always written per expert, each tensor in its parameter's dtype."""
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout must be 'per_expert' or 'fused', not {expert_layout!r}")
    if expert_layout == "fused" and config.expert_format != "bf16":
        raise ValueError(f"{config.expert_format} experts are written per expert (the producers' layout), not fused")
    router = fp32_params(config)
    entries: list[_Entry] = []
    for name in sorted(params, key=natural_key):
        shape = tuple(params[name].shape)
        if quantized := STACKED_QUANT.match(name):
            prefix, proj, suffix = quantized[1], quantized[3], quantized[4]
            stored = np.dtype(params[name].dtype)  # packed values and scales are never cast
            for e in range(shape[0]):
                entries.append((TensorSpec(f"{prefix}.{e}.{proj}.{suffix}", stored, shape[1:]), name, (e,)))
            continue
        stored = np.dtype(np.float32) if name in router else dtype
        fused = _FUSED.match(name)
        if fused is None or expert_layout == "fused":
            entries.append((TensorSpec(name, stored, shape), name, ()))
            continue
        prefix, which = fused[1], fused[2]
        if which == "gate_up_proj":
            inter = shape[1] // 2
            for e in range(shape[0]):
                for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                    spec = TensorSpec(f"{prefix}.{e}.{proj}.weight", stored, (inter, shape[2]))
                    entries.append((spec, name, (e, rows)))
        else:
            for e in range(shape[0]):
                entries.append((TensorSpec(f"{prefix}.{e}.down_proj.weight", stored, tuple(shape[1:])), name, (e,)))
    return entries


def split_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in order; a tensor larger than the limit gets a shard of its own (as in HF)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_config(directory: Path, config: BeamConfig, dtype: np.dtype) -> Path:
    """config.json as transformers writes it: `dtype` (5.x) and `torch_dtype` (older readers)."""
    data = config.to_hf_dict() | {"dtype": dtype.name, "torch_dtype": dtype.name}
    path = directory / "config.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def write_hf_quant_config(directory: Path, config: BeamConfig) -> Path | None:
    """ModelOpt's `hf_quant_config.json` beside config.json, for a ModelOpt-format config."""
    quantization_config = config.to_hf_dict().get("quantization_config")
    if not is_modelopt(quantization_config):
        return None
    path = directory / HF_QUANT_CONFIG
    path.write_text(json.dumps(hf_quant_config_from_quantization_config(quantization_config), indent=2) + "\n")
    return path


def _remove_stale_weights(directory: Path) -> None:
    # A leftover index or shard from an earlier save would be picked up by a loader in place of
    # (or beside) the new files; transformers' save_pretrained cleans up the same way. So would
    # an hf_quant_config.json: the reader falls back to it when config.json has no quantization.
    for path in directory.iterdir():
        if path.name in (SINGLE_FILE, INDEX_FILE, HF_QUANT_CONFIG) or _SHARD.match(path.name):
            path.unlink()


def _check_matches_config(config: BeamConfig, flat: dict[str, jax.Array]) -> None:
    # Quantized parameters saved under a bf16 config (or the reverse) would give a checkpoint
    # whose config.json contradicts its tensors; catch it here rather than at the next load.
    expected = abstract_flat(config).keys()
    if flat.keys() != expected:
        extra, missing = sorted(flat.keys() - expected), sorted(expected - flat.keys())
        raise ValueError(
            f"params do not match the config (expert format {config.expert_format}): "
            f"{len(extra)} unexpected, e.g. {extra[:3]}; {len(missing)} missing, e.g. {missing[:3]}"
        )


def save_checkpoint(
    directory: str | Path,
    config: BeamConfig,
    params: Params,
    *,
    max_shard_bytes: int = 2**31,
    expert_layout: ExpertLayout = "per_expert",
    dtype=None,
) -> Path:
    """Write config.json and `model.safetensors`, or `model-0000k-of-0000N.safetensors` shards
    plus `model.safetensors.index.json` when the tensors exceed `max_shard_bytes`.

    `dtype=None` keeps the parameters' floating dtype (the embedding's); the router is always
    written as float32, quantized experts in their own dtypes. Returns the directory.
    """
    config.require_checkpoint_layout(f"save a checkpoint to {directory}")  # before anything is written
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    flat = flat_params(params)
    _check_matches_config(config, flat)
    stored = float_dtype(dtype if dtype is not None else flat["model.embed_tokens.weight"].dtype)
    shapes = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in flat.items()}
    entries = plan_tensors(config, shapes, stored, expert_layout)
    sources = {spec.name: (source, index, spec.dtype) for spec, source, index in entries}
    shards = split_shards([spec for spec, _, _ in entries], max_shard_bytes)

    # One parameter on the host at a time: per-expert tensors of one fused parameter are
    # consecutive, so each parameter is fetched from the device once.
    cached: dict[str, np.ndarray] = {}

    def fetch(name: str) -> np.ndarray:
        source, index, target = sources[name]
        if source not in cached:
            cached.clear()
            cached[source] = np.asarray(jax.device_get(flat[source])).astype(target, copy=False)
        return cached[source][index]

    _remove_stale_weights(directory)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0], fetch, metadata)
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            total += write_safetensors(directory / file, shard, fetch, metadata)
            weight_map.update({spec.name: file for spec in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    write_config(directory, config, stored)
    write_hf_quant_config(directory, config)
    return directory


def init_checkpoint(
    out_dir: str | Path,
    config: BeamConfig,
    *,
    seed: int = 0,
    dtype="bfloat16",
    expert_layout: ExpertLayout = "per_expert",
    max_shard_bytes: int = 2**31,
) -> Path:
    """A checkpoint of random weights (`beam_jax.model.init_params`): the reference's
    initialisation, router fp32. A quantized config gets random bf16-format weights quantized
    to its expert format (`beam_jax.quant.convert.quantize_params`). Builds the whole model in
    memory first, so it is meant for test- and slice-sized configs."""
    if config.expert_format == "bf16":
        params = init_params(config, seed, float_dtype(dtype))
    else:
        unquantized = config.replace(quantization_config=None)
        unquantized_params = init_params(unquantized, seed, float_dtype(dtype))
        _, params = quantize_params(unquantized, unquantized_params, config.expert_format)
    return save_checkpoint(out_dir, config, params, max_shard_bytes=max_shard_bytes, expert_layout=expert_layout)
