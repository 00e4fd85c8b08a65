"""How quantized experts sit in a checkpoint, and ModelOpt's `hf_quant_config.json`.

The model holds each quantized projection stacked over experts
(`model.layers.{i}.mlp.experts.gate_proj.weight [E, out, in/2]`, `...weight_scale_2 [E]`); the
producers (ModelOpt, compressed-tensors) write one tensor per expert
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight [out, in/2]`, `...weight_scale_2 []`). The
per-expert shape and dtype are read off the stacked parameter, so the rules live in one place
(`beam_jax.layers.quantized`): drop the leading E; a per-expert scalar may also be stored as `[1]`
(ModelOpt has written both; we write `[]`).
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

HF_QUANT_CONFIG = "hf_quant_config.json"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")

_SUFFIX = "|".join(QUANT_SUFFIXES)
# A stacked quantized expert parameter of the model: prefix, layer, projection, suffix.
STACKED_QUANT = re.compile(rf"^(model\.layers\.(\d+)\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.({_SUFFIX})$")
# A per-expert checkpoint tensor: layer, expert, projection, suffix (bf16 checkpoints have `weight` only).
PER_EXPERT = re.compile(rf"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.({_SUFFIX})$")
# Any expert parameter of the model, fused bf16 or stacked quantized.
EXPERT_PARAM = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.")

FLOAT_CODES = ("F32", "BF16", "F16")


def stored_codes(dtype) -> tuple[str, ...]:
    """Safetensors dtypes a quantized-expert tensor may be stored in, given its parameter dtype.

    Packed values and block scales must match exactly (a cast would corrupt them); fp32 scales
    may come as any float (compressed-tensors writes BF16 `weight_scale`), widened exactly on load.
    """
    dtype = np.dtype(dtype)
    if dtype == np.dtype(np.uint8):
        return ("U8",)
    if dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return ("F8_E4M3",)
    if dtype == np.dtype(np.float32):
        return FLOAT_CODES
    raise ValueError(f"no checkpoint encoding for a quantized expert parameter of dtype {dtype}")


def per_expert_shapes(stacked_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Accepted per-expert shapes of a stacked `[E, ...]` parameter; the first is the one written."""
    rest = tuple(stacked_shape[1:])
    return (rest, (1,)) if rest == () else (rest,)


def is_modelopt(quantization_config: dict[str, Any] | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == "modelopt"


def quantization_config_from_hf_quant_config(data: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's `hf_quant_config.json` (`{"producer": ..., "quantization": {"quant_algo": ...}}`)
    as a config.json `quantization_config`: the `quantization` keys (null ones dropped) plus
    `quant_method: modelopt` and the producer."""
    quantization = data.get("quantization")
    if not isinstance(quantization, dict) or "quant_algo" not in quantization:
        raise ValueError(f"{HF_QUANT_CONFIG} has no quantization.quant_algo: {data!r}")
    out = {"quant_method": "modelopt", **{k: v for k, v in quantization.items() if v is not None}}
    if "producer" in data:
        out["producer"] = data["producer"]
    return out


def hf_quant_config_from_quantization_config(quantization_config: dict[str, Any]) -> dict[str, Any]:
    """The inverse for a ModelOpt `quantization_config`: what ModelOpt writes beside config.json
    (older readers, vLLM's `hf_quant_config.json` detection among them, look only there)."""
    quantization: dict[str, Any] = {"quant_algo": quantization_config["quant_algo"]}
    if "group_size" in quantization_config:
        quantization["group_size"] = quantization_config["group_size"]
    quantization["kv_cache_quant_algo"] = quantization_config.get("kv_cache_quant_algo")
    excluded = quantization_config.get("exclude_modules", quantization_config.get("ignore", []))
    quantization["exclude_modules"] = list(excluded)
    out: dict[str, Any] = {}
    if "producer" in quantization_config:
        out["producer"] = quantization_config["producer"]
    out["quantization"] = quantization
    return out
