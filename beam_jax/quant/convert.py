"""Quantize a bf16 Beam model's experts (and back), as the producers' checkpoints hold them.

    qconfig, qparams = quantize_params(config, params, "nvfp4")   # ModelOpt NVFP4 layout
    save_checkpoint(out, qconfig, qparams)                          # per-expert tensors + configs
    dconfig, dparams = dequantize_params(qconfig, qparams, jnp.float32)

Only the routed experts are quantized; attention, dense MLPs, embeddings and the head keep their
dtype and the router stays fp32 (BEAM_SPEC.md, "Checkpoint layout"). The fused
`gate_up_proj [E, 2I, H]` is split into `gate_proj` and `up_proj`, because each projection of
each expert gets its own scales, as in ModelOpt's and compressed-tensors' per-Linear exports.

No calibration data is used. Weight scales need none (they come from the weights' amax). The
static activation scales (`input_scale`, NVFP4 and ModelOpt FP8) would come from calibration;
they are set to 1.0, a placeholder that says "activations quantized against a global amax of
6·448 (NVFP4) / 448 (FP8)". The reference forward (`beam_jax.layers.quantized`) dequantizes the
weights only and never reads them; a kernel that quantizes activations statically should be fed
calibrated scales instead. compressed-tensors FP8_DYNAMIC has no input_scale (per-token scales at
run time), so its checkpoints are complete without calibration.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from beam_jax.config import BeamConfig
from beam_jax.model import Params, abstract_flat, flat_params, params_from_flat
from beam_jax.quant.fp8 import FP8Weight, dequantize_fp8, quantize_fp8_per_channel, quantize_fp8_per_tensor
from beam_jax.quant.nvfp4 import GROUP_SIZE, NVFP4Weight, dequantize_nvfp4, quantize_nvfp4

QUANTIZED_FORMATS = ("nvfp4", "fp8_channel", "fp8_tensor")
# Placeholder static activation scale (see the module docstring).
UNCALIBRATED_INPUT_SCALE = 1.0

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.")


def _producer() -> dict[str, str]:
    # Who wrote the checkpoint; ModelOpt records itself the same way.
    try:
        version = importlib.metadata.version("beam-jax")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"name": "beam_jax", "version": version}


def _sparse_layers(config: BeamConfig) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_sparse(i)]


def _modelopt_excluded(config: BeamConfig) -> list[str]:
    """ModelOpt's `exclude_modules`: fnmatch patterns of the Linears left unquantized. Dense
    MLPs and routers are named per layer so that no pattern can reach an expert."""
    dense = [f"model.layers.{i}.mlp*" for i in range(config.num_hidden_layers) if not config.is_sparse(i)]
    routers = [f"model.layers.{i}.mlp.gate" for i in _sparse_layers(config)]
    return ["lm_head", "*self_attn*", *dense, *routers]


def _compressed_tensors_ignored(config: BeamConfig) -> list[str]:
    """compressed-tensors' `ignore`: module names, or `re:` regexes matched against them."""
    dense = [
        f"model.layers.{i}.mlp.{proj}"
        for i in range(config.num_hidden_layers)
        if not config.is_sparse(i)
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]
    routers = [f"model.layers.{i}.mlp.gate" for i in _sparse_layers(config)]
    return ["lm_head", r"re:.*self_attn\..*", *dense, *routers]


def quantization_config_for(config: BeamConfig, expert_format: str) -> dict[str, Any]:
    """config.json's `quantization_config` as each producer writes it.

    ModelOpt: the `hf_quant_config.json` keys flattened (`quant_algo`, `group_size`,
    `exclude_modules`) plus `ignore`, the same list under the key newer ModelOpt exports and vLLM's
    config.json reader use. compressed-tensors: llm-compressor's FP8_DYNAMIC scheme."""
    if expert_format == "nvfp4":
        excluded = _modelopt_excluded(config)
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": GROUP_SIZE,
            "exclude_modules": excluded,
            "ignore": excluded,
            "producer": _producer(),
        }
    if expert_format == "fp8_tensor":
        excluded = _modelopt_excluded(config)
        return {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "exclude_modules": excluded,
            "ignore": excluded,
            "producer": _producer(),
        }
    if expert_format == "fp8_channel":
        scheme = {"num_bits": 8, "type": "float", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**scheme, "strategy": "channel", "dynamic": False},
                    "input_activations": {**scheme, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": _compressed_tensors_ignored(config),
        }
    raise ValueError(f"expert format must be one of {QUANTIZED_FORMATS}, not {expert_format!r}")


def _quantize_projection(weight: np.ndarray, expert_format: str) -> dict[str, np.ndarray]:
    """One projection of every expert `[E, out, in]` -> its tensors by checkpoint suffix, stacked
    over experts (the quantizers give per-expert scales for a stacked input)."""
    if expert_format == "nvfp4":
        q = quantize_nvfp4(weight, input_scale=UNCALIBRATED_INPUT_SCALE)
        return {
            "weight": q.packed,
            "weight_scale": q.block_scale,
            "weight_scale_2": q.global_scale,
            "input_scale": q.input_scale,
        }
    if expert_format == "fp8_channel":
        q = quantize_fp8_per_channel(weight)
        return {"weight": q.weight, "weight_scale": q.weight_scale}
    q = quantize_fp8_per_tensor(weight, input_scale=UNCALIBRATED_INPUT_SCALE)
    return {"weight": q.weight, "weight_scale": q.weight_scale, "input_scale": q.input_scale}


def _host_f32(array: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(array)).astype(np.float32)


def quantize_params(config: BeamConfig, params: Params, expert_format: str) -> tuple[BeamConfig, Params]:
    """Quantize the routed experts of a bf16-format model (`config.expert_format == "bf16"`; the
    floating dtype may be anything). Returns the config with the producer's `quantization_config`
    and the parameters with quantized experts; everything else is passed through unchanged.

    Work is numpy on the host, one sparse layer at a time (that layer's experts are the only
    host copy alive); the results are placed with `jax.device_put` on the default device."""
    if expert_format not in QUANTIZED_FORMATS:
        raise ValueError(f"expert format must be one of {QUANTIZED_FORMATS}, not {expert_format!r}")
    if config.expert_format != "bf16":
        raise ValueError(f"the experts are already {config.expert_format}; dequantize_params first")
    quantized_config = config.replace(quantization_config=quantization_config_for(config, expert_format))
    flat = flat_params(params)
    out = {name: array for name, array in flat.items() if not _FUSED.match(name)}
    inter = config.moe_intermediate_size
    for layer in _sparse_layers(config):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = _host_f32(flat[f"{prefix}.gate_up_proj"])  # gate rows first
        projections = {
            "gate_proj": gate_up[:, :inter],
            "up_proj": gate_up[:, inter:],
            "down_proj": _host_f32(flat[f"{prefix}.down_proj"]),
        }
        del gate_up
        for proj, weight in projections.items():
            for suffix, value in _quantize_projection(weight, expert_format).items():
                out[f"{prefix}.{proj}.{suffix}"] = jax.device_put(value)
    return quantized_config, params_from_flat(quantized_config, out)


def _dequantize_projection(flat: dict[str, jax.Array], name: str, expert_format: str) -> jax.Array:
    """`[E, out, in]` in fp32, by the functions the model's forward uses (so bit-identical)."""
    part = lambda suffix: flat[f"{name}.{suffix}"]  # noqa: E731
    if expert_format == "nvfp4":
        return dequantize_nvfp4(NVFP4Weight(part("weight"), part("weight_scale"), part("weight_scale_2")), jnp.float32)
    return dequantize_fp8(FP8Weight(part("weight"), part("weight_scale")), jnp.float32)


def dequantize_params(config: BeamConfig, params: Params, dtype=jnp.bfloat16) -> tuple[BeamConfig, Params]:
    """The bf16-format model that the quantized one computes with: experts dequantized and fused
    back into `gate_up_proj`/`down_proj`, in `dtype`; the other parameters cast to `dtype` (the
    router stays fp32). Returns (config without quantization_config, params)."""
    if config.expert_format == "bf16":
        raise ValueError("the experts are not quantized")
    config.require_checkpoint_layout("dequantize the experts")
    plain = config.replace(quantization_config=None)
    flat = flat_params(params)
    out = {}
    for name, spec in abstract_flat(plain, dtype).items():
        fused = _FUSED.match(name)
        if fused is None:
            out[name] = jnp.asarray(flat[name]).astype(spec.dtype)
        elif fused[2] == "gate_up_proj":
            gate = _dequantize_projection(flat, f"{fused[1]}.gate_proj", config.expert_format)
            up = _dequantize_projection(flat, f"{fused[1]}.up_proj", config.expert_format)
            out[name] = jnp.concatenate([gate, up], axis=1).astype(spec.dtype)
        else:
            out[name] = _dequantize_projection(flat, f"{fused[1]}.down_proj", config.expert_format).astype(spec.dtype)
    return plain, params_from_flat(plain, out)


def expert_nbytes(params: Params) -> int:
    """Bytes of the routed experts' parameters (values and scales), in their stored dtypes."""
    return sum(int(array.nbytes) for name, array in flat_params(params).items() if _EXPERT.match(name))
