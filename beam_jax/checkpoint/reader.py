"""Load an HF safetensors checkpoint into Beam's parameter state.

Two phases, so nothing is half loaded: first every tensor name, shape and dtype (headers only)
is checked against what the config expects and all problems are raised as one `CheckpointError`;
only then are tensors read one at a time from memory maps, cast, and handed to `put`.

Quantized checkpoints (ModelOpt NVFP4 / FP8, compressed-tensors FP8) store each expert's
projection as its own tensors (`experts.{e}.gate_proj.weight`, `.weight_scale`, ...); the loader
stacks them over experts into the model's parameters, keeping packed values and block scales in
their exact dtype (fp32 scales are widened to fp32). Everything else is cast to the model dtype.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from beam_jax.checkpoint.errors import CheckpointError
from beam_jax.checkpoint.quant_layout import (
    EXPERT_PARAM,
    FLOAT_CODES,
    HF_QUANT_CONFIG,
    PER_EXPERT,
    PROJECTIONS,
    per_expert_shapes,
    quantization_config_from_hf_quant_config,
    stored_codes,
)
from beam_jax.checkpoint.safetensors_io import DTYPES, SafetensorsCheckpoint, TensorInfo
from beam_jax.checkpoint.sharded import Source, load_sharded_param
from beam_jax.config import BeamConfig
from beam_jax.model import Params, abstract_params, param_name, params_from_flat
from beam_jax.sharding import check_mesh

Put = Callable[[str, np.ndarray], jax.Array]

# Per-expert tensors of one layer: {(expert, projection, suffix): name}.
LayerExperts = dict[tuple[int, str, str], str]


def float_dtype(dtype) -> np.dtype:
    """Normalise a dtype given as a name, numpy or jnp dtype; only f32/bf16/f16 are model dtypes."""
    result = np.dtype(jnp.dtype(dtype))
    if result not in (np.dtype(np.float32), DTYPES["BF16"], np.dtype(np.float16)):
        raise ValueError(f"model dtype must be float32, bfloat16 or float16, not {result}")
    return result


def expected_params(config: BeamConfig, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """`{HF name: ShapeDtypeStruct}` of the model's parameters in `dtype` (bf16 experts fused,
    quantized experts stacked over experts and in their packed dtypes whatever `dtype` is)."""
    state = abstract_params(config, float_dtype(dtype))
    return {param_name(path): leaf.get_value() for path, leaf in nnx.to_flat_state(state)}


def is_expert_param(name: str) -> bool:
    return EXPERT_PARAM.match(name) is not None


def fp32_params(config: BeamConfig) -> frozenset[str]:
    """Non-expert parameters kept in float32 whatever the model dtype (the router): read off the
    model built in bf16, so the rule lives in one place (the module definitions). Quantized
    experts' fp32 scales are not in it: they follow their own layout (`quant_layout`)."""
    return frozenset(
        n for n, s in expected_params(config, jnp.bfloat16).items() if s.dtype == jnp.float32 and not is_expert_param(n)
    )


def read_config(directory: str | Path) -> BeamConfig:
    """config.json; a quantized checkpoint without `quantization_config` there (older ModelOpt
    exports) gets it from `hf_quant_config.json`."""
    directory = Path(directory)
    data = json.loads((directory / "config.json").read_text())
    if "quantization_config" not in data and (directory / HF_QUANT_CONFIG).is_file():
        data["quantization_config"] = quantization_config_from_hf_quant_config(
            json.loads((directory / HF_QUANT_CONFIG).read_text())
        )
    return BeamConfig.from_hf_dict(data)


def checkpoint_dtype(directory: Path, tensors: Mapping[str, TensorInfo]) -> np.dtype:
    """The checkpoint's floating dtype: config.json's `dtype` (or legacy `torch_dtype`), else the
    embedding's stored dtype, else bfloat16 (validation reports the missing embedding)."""
    config_file = directory / "config.json"
    if config_file.is_file():
        raw = json.loads(config_file.read_text())
        for key in ("dtype", "torch_dtype"):
            try:
                return float_dtype(str(raw[key]).removeprefix("torch."))
            except (KeyError, TypeError, ValueError):
                pass
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and embed.code in FLOAT_CODES:
        return DTYPES[embed.code]
    return DTYPES["BF16"]


def _describe(code: str, shape) -> str:
    return f"{code} {list(shape)}"


def _want_text(codes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> str:
    kind = "float (F32/BF16/F16)" if codes == FLOAT_CODES else "/".join(codes)
    return f"{kind} {' or '.join(str(list(s)) for s in shapes)}"


def _want(shape, fp32: bool) -> str:
    return _want_text(("F32",) if fp32 else FLOAT_CODES, (tuple(shape),))


def _expert_list(experts: list[int]) -> str:
    """`[3, 7]`, or `0..15` for a contiguous run."""
    experts = sorted(experts)
    if len(experts) > 2 and experts == list(range(experts[0], experts[-1] + 1)):
        return f"{experts[0]}..{experts[-1]}"
    return str(experts)


class _Planner:
    """Builds the load plan and collects every problem (see `plan_load`)."""

    def __init__(self, config: BeamConfig, tensors: Mapping[str, TensorInfo], dtype):
        self.config, self.tensors = config, tensors
        self.expected = expected_params(config, dtype)
        self.router = fp32_params(config)
        self.plan: dict[str, list[Source]] = {}
        self.problems: list[str] = []
        self.used: set[str] = set()
        # Per-expert tensors grouped by layer; experts past num_experts are reported, not planned.
        self.per_expert: dict[int, LayerExperts] = {}
        for name in tensors:
            if m := PER_EXPERT.match(name):
                self.per_expert.setdefault(int(m[1]), {})[(int(m[2]), m[3], m[4])] = name

    def check(self, name: str, want_shape: tuple, fp32: bool) -> None:
        """Shape and dtype of one present non-expert (or fused expert) tensor."""
        info = self.tensors[name]
        self.used.add(name)
        codes = ("F32",) if fp32 else FLOAT_CODES
        if info.shape != tuple(want_shape) or info.code not in codes:
            found = _describe(info.code, info.shape)
            self.problems.append(f"{name}: expected {_want(want_shape, fp32)}, found {found}")

    def check_experts(
        self, pattern: str, found: dict[int, str], shapes: tuple[tuple[int, ...], ...], codes: tuple[str, ...]
    ) -> None:
        """One per-expert tensor kind (`pattern` names it with `{e}`) across all experts: one
        problem for the missing experts, one per distinct wrong shape/dtype (a checkpoint in the
        wrong format is wrong for every expert alike, and 256 identical lines help nobody)."""
        num_experts = self.config.num_experts
        missing = [e for e in range(num_experts) if e not in found]
        if missing:
            self.problems.append(
                f"{pattern}: expected for every expert 0..{num_experts - 1}, "
                f"found nothing for experts {missing} (missing)"
            )
        wrong: dict[str, list[int]] = {}
        for expert, name in found.items():
            self.used.add(name)
            info = self.tensors[name]
            if info.shape not in shapes or info.code not in codes:
                wrong.setdefault(_describe(info.code, info.shape), []).append(expert)
        for found_text, experts in wrong.items():
            if len(experts) == 1:
                where, which = pattern.replace("{e}", str(experts[0])), ""
            else:
                where, which = pattern, f" (experts {_expert_list(experts)})"
            self.problems.append(f"{where}: expected {_want_text(codes, shapes)}, found {found_text}{which}")

    def plan_dense_params(self) -> None:
        for name, spec in self.expected.items():
            if is_expert_param(name):
                continue  # planned per layer
            if name in self.tensors:
                self.check(name, spec.shape, name in self.router)
                self.plan[name] = [(name, ())]
            else:
                want = _want(spec.shape, name in self.router)
                self.problems.append(f"{name}: expected {want}, found nothing (missing)")

    def experts_of(self, layer: int, proj: str, suffix: str) -> dict[int, str]:
        return {
            e: n
            for (e, p, s), n in self.per_expert.get(layer, {}).items()
            if p == proj and s == suffix and e < self.config.num_experts
        }

    def plan_bf16_layer(self, layer: int) -> None:
        """Fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, or per-expert weights."""
        config, tensors = self.config, self.tensors
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        prefix = f"model.layers.{layer}.mlp.experts"
        fused = {n: self.expected[n].shape for n in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")}
        found_fused = [n for n in fused if n in tensors]
        experts = {proj: self.experts_of(layer, proj, "weight") for proj in PROJECTIONS}
        has_per_expert = any(experts.values())
        if found_fused and has_per_expert:
            count = sum(map(len, experts.values()))
            self.problems.append(
                f"{prefix}: expected either fused gate_up_proj/down_proj or per-expert tensors, "
                f"found both (fused {[n.rsplit('.', 1)[1] for n in found_fused]}, {count} per-expert tensors)"
            )
            for n in found_fused:
                self.check(n, fused[n], False)
        elif found_fused or not has_per_expert:
            for n, shape in fused.items():
                if n in tensors:
                    self.check(n, shape, False)
                    self.plan[n] = [(n, ())]
                else:
                    alt = " (or per-expert .{e}.{gate,up,down}_proj.weight)" if not found_fused else ""
                    self.problems.append(f"{n}: expected {_want(shape, False)}{alt}, found nothing (missing)")
            return
        for proj, found in experts.items():
            shape = (hidden, inter) if proj == "down_proj" else (inter, hidden)
            self.check_experts(f"{prefix}.{{e}}.{proj}.weight", found, (shape,), FLOAT_CODES)
        if found_fused:
            return
        # Gate rows then up rows of expert e form gate_up_proj[e].
        self.plan[f"{prefix}.gate_up_proj"] = [
            source
            for e in range(config.num_experts)
            for source in (
                (experts["gate_proj"].get(e, ""), (e, slice(0, inter))),
                (experts["up_proj"].get(e, ""), (e, slice(inter, 2 * inter))),
            )
        ]
        self.plan[f"{prefix}.down_proj"] = [(experts["down_proj"].get(e, ""), (e,)) for e in range(config.num_experts)]

    def plan_quantized_layer(self, layer: int) -> None:
        """Each stacked parameter (`experts.gate_proj.weight_scale [E, out, in/16]`, ...) from its
        per-expert tensors; which suffixes exist, and their shapes and dtypes, come from the model."""
        prefix = f"model.layers.{layer}.mlp.experts"
        for proj in PROJECTIONS:
            for name, spec in self.expected.items():
                if not name.startswith(f"{prefix}.{proj}."):
                    continue
                suffix = name.rsplit(".", 1)[1]
                found = self.experts_of(layer, proj, suffix)
                pattern = f"{prefix}.{{e}}.{proj}.{suffix}"
                self.check_experts(pattern, found, per_expert_shapes(spec.shape), stored_codes(spec.dtype))
                self.plan[name] = [(found.get(e, ""), (e,)) for e in range(self.config.num_experts)]

    def check_stray_experts(self) -> None:
        """Per-expert tensors beyond num_experts in a sparse layer, of a kind the model has."""
        config = self.config
        for layer, entries in self.per_expert.items():
            if layer >= config.num_hidden_layers or not config.is_sparse(layer):
                continue  # reported as unknown names
            for (expert, proj, suffix), name in entries.items():
                kind_exists = (
                    suffix == "weight"
                    if config.expert_format == "bf16"
                    else f"model.layers.{layer}.mlp.experts.{proj}.{suffix}" in self.expected
                )
                if expert >= config.num_experts and kind_exists:
                    self.problems.append(f"{name}: expected experts 0..{config.num_experts - 1}, found expert {expert}")
                    self.used.add(name)

    def report_unknown(self) -> None:
        for name in self.tensors.keys() - self.used:
            info = self.tensors[name]
            hint = ""
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                hint = " (tie_word_embeddings is set: the head is the embedding)"
            elif self.config.expert_format == "bf16" and name.endswith(("_scale", "_scale_2")):
                hint = " (a quantization scale, but the config declares no quantization_config)"
            found = _describe(info.code, info.shape)
            self.problems.append(f"{name}: expected no such tensor{hint}, found {found} (unknown name)")


def plan_load(
    config: BeamConfig, tensors: Mapping[str, TensorInfo], dtype
) -> tuple[dict[str, list[Source]], list[str]]:
    """Map each model parameter to the checkpoint tensors it is built from, checking names,
    shapes and dtypes from headers only. Returns (plan, problems); the plan is usable only
    when there are no problems."""
    planner = _Planner(config, tensors, dtype)
    planner.plan_dense_params()
    for layer in range(config.num_hidden_layers):
        if not config.is_sparse(layer):
            continue
        if config.expert_format == "bf16":
            planner.plan_bf16_layer(layer)
        else:
            planner.plan_quantized_layer(layer)
    planner.check_stray_experts()
    planner.report_unknown()
    return planner.plan, planner.problems


def _summary(path: Path, config: BeamConfig, tensors: Mapping[str, TensorInfo], count: int) -> str:
    summary = f"{path}: checkpoint does not match the config ({count} problems"
    if config.expert_format != "bf16":
        summary += f"; expert format {config.expert_format} from quantization_config"
    elif any(name.endswith(("weight_scale", "weight_scale_2")) for name in tensors):
        summary += f"; the checkpoint holds quantization scales, but neither config.json nor {HF_QUANT_CONFIG} " \
                   "declares a quantization_config"
    return summary + ")"


def load_checkpoint(
    path: str | Path,
    *,
    dtype=None,
    config: BeamConfig | None = None,
    put: Put | None = None,
    mesh: Mesh | None = None,
    progress: bool = True,
) -> tuple[BeamConfig, Params]:
    """Read a safetensors checkpoint (directory, `model.safetensors`, or index file).

    `dtype=None` keeps the checkpoint's floating dtype; the router stays float32 and quantized
    experts keep their packed dtypes regardless. The config (with its `quantization_config`) is
    `read_config(directory)` unless given. `put(name, host_array) -> jax.Array` places each
    finished parameter (default `jax.device_put`). With a `mesh`, parameters are placed as
    `beam_jax.sharding.shard_params` places them instead, each process reading only the blocks its
    devices own (`checkpoint.sharded`: no host holds a whole split tensor). Raises
    `CheckpointError` listing every mismatch before anything is read or placed.
    """
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    config = config if config is not None else read_config(directory)
    put = put if put is not None else (lambda name, array: jax.device_put(array))
    if mesh is not None:
        check_mesh(config, mesh)
    with SafetensorsCheckpoint(path) as checkpoint:
        target = float_dtype(dtype) if dtype is not None else checkpoint_dtype(directory, checkpoint.tensors)
        expected = expected_params(config, target)
        plan, problems = plan_load(config, checkpoint.tensors, target)
        if problems:
            summary = _summary(path, config, checkpoint.tensors, len(problems))
            raise CheckpointError(summary, sorted(problems, key=natural_key))

        arrays: dict[str, jax.Array] = {}
        with tqdm(total=len(checkpoint.tensors), desc="loading", unit="tensor", disable=not progress) as bar:
            for name, sources in plan.items():
                if mesh is None:
                    arrays[name] = put(name, _assemble(checkpoint, expected[name], sources))
                else:
                    arrays[name] = load_sharded_param(checkpoint, name, sources, expected[name], mesh, config)
                bar.update(len(sources))
    return config, params_from_flat(config, arrays)


def _assemble(checkpoint: SafetensorsCheckpoint, spec: jax.ShapeDtypeStruct, sources: list[Source]) -> np.ndarray:
    """One parameter on the host, owned (never a view of the memory map)."""
    if len(sources) == 1 and sources[0][1] == ():
        return checkpoint.get(sources[0][0]).astype(spec.dtype, copy=True)
    # Stacked over experts: allocated once, filled one expert at a time from the memory map
    # (casting while copying; a `[1]` scalar lands in its `[]` slot).
    host = np.empty(spec.shape, spec.dtype)
    for source, index in sources:
        host[index] = checkpoint.get(source).reshape(np.shape(host[index]))
    return host


def natural_key(text: str):
    """Sort `layers.2` before `layers.10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
