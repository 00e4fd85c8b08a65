"""Load an HF safetensors checkpoint into Beam's parameter state.

Two phases, so nothing is half loaded: first every tensor name, shape and dtype (headers only)
is checked against what the config expects and all problems are raised as one `CheckpointError`;
only then are tensors read one at a time from memory maps, cast, and handed to `put`.
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
from tqdm import tqdm

from beam_jax.checkpoint.errors import CheckpointError
from beam_jax.checkpoint.safetensors_io import DTYPES, SafetensorsCheckpoint, TensorInfo
from beam_jax.config import BeamConfig
from beam_jax.model import Params, abstract_params, param_name, params_from_flat

Put = Callable[[str, np.ndarray], jax.Array]

# Dtypes a floating weight may be stored in; the loader casts to the target dtype.
FLOAT_CODES = ("F32", "BF16", "F16")
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

# One destination slice of a parameter: (checkpoint tensor name, index into the parameter).
# A parameter stored under its own name has one source with the empty index (the whole array).
Source = tuple[str, tuple]


def float_dtype(dtype) -> np.dtype:
    """Normalise a dtype given as a name, numpy or jnp dtype; only f32/bf16/f16 are model dtypes."""
    result = np.dtype(jnp.dtype(dtype))
    if result not in (np.dtype(np.float32), DTYPES["BF16"], np.dtype(np.float16)):
        raise ValueError(f"model dtype must be float32, bfloat16 or float16, not {result}")
    return result


def expected_params(config: BeamConfig, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """`{HF name: ShapeDtypeStruct}` of the model's parameters (experts fused) in `dtype`."""
    state = abstract_params(config, float_dtype(dtype))
    return {param_name(path): leaf.get_value() for path, leaf in nnx.to_flat_state(state)}


def fp32_params(config: BeamConfig) -> frozenset[str]:
    """Parameters kept in float32 whatever the model dtype (the router): read off the model
    built in bf16, so the rule lives in one place (the module definitions)."""
    return frozenset(n for n, s in expected_params(config, jnp.bfloat16).items() if s.dtype == jnp.float32)


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


def plan_load(
    config: BeamConfig, tensors: Mapping[str, TensorInfo], dtype
) -> tuple[dict[str, list[Source]], list[str]]:
    """Map each model parameter to the checkpoint tensors it is built from, checking names,
    shapes and dtypes from headers only. Returns (plan, problems); the plan is usable only
    when there are no problems."""
    expected = expected_params(config, dtype)
    router = fp32_params(config)
    plan: dict[str, list[Source]] = {}
    problems: list[str] = []
    used: set[str] = set()

    def check(name: str, want_shape: tuple, fp32: bool) -> None:
        """Shape and dtype of one present tensor."""
        info = tensors[name]
        used.add(name)
        codes = ("F32",) if fp32 else FLOAT_CODES
        if info.shape != tuple(want_shape) or info.code not in codes:
            problems.append(f"{name}: expected {_want(want_shape, fp32)}, found {_describe(info.code, info.shape)}")

    # Per-expert tensors grouped by layer: {layer: {(expert, proj): name}}.
    per_expert: dict[int, dict[tuple[int, str], str]] = {}
    for name in tensors:
        if m := PER_EXPERT.match(name):
            per_expert.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = name

    num_experts, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for name, spec in expected.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            continue  # handled per layer below
        if name in tensors:
            check(name, spec.shape, name in router)
            plan[name] = [(name, ())]
        else:
            problems.append(f"{name}: expected {_want(spec.shape, name in router)}, found nothing (missing)")

    for layer in range(config.num_hidden_layers):
        if not config.is_sparse(layer):
            continue
        prefix = f"model.layers.{layer}.mlp.experts"
        fused = {n: expected[n].shape for n in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")}
        found_fused = [n for n in fused if n in tensors]
        experts = {k: n for k, n in per_expert.get(layer, {}).items() if k[0] < num_experts}
        if found_fused and experts:
            problems.append(
                f"{prefix}: expected either fused gate_up_proj/down_proj or per-expert tensors, "
                f"found both (fused {[n.rsplit('.', 1)[1] for n in found_fused]}, {len(experts)} per-expert tensors)"
            )
            for n in found_fused:
                check(n, fused[n], False)
            continue  # per-expert names are checked (and marked used) below with the rest
        if found_fused or not experts:
            for n, shape in fused.items():
                if n in tensors:
                    check(n, shape, False)
                    plan[n] = [(n, ())]
                else:
                    alt = " (or per-expert .{e}.{gate,up,down}_proj.weight)" if not found_fused else ""
                    problems.append(f"{n}: expected {_want(shape, False)}{alt}, found nothing (missing)")
            continue
        # Per-expert layout: gate rows then up rows of expert e form gate_up_proj[e].
        for proj in ("gate_proj", "up_proj", "down_proj"):
            missing = [e for e in range(num_experts) if (e, proj) not in experts]
            if missing:
                problems.append(
                    f"{prefix}.{{e}}.{proj}.weight: expected for every expert 0..{num_experts - 1}, "
                    f"found nothing for experts {missing} (missing)"
                )
        plan[f"{prefix}.gate_up_proj"] = [
            source
            for e in range(num_experts)
            for source in (
                (experts.get((e, "gate_proj"), ""), (e, slice(0, inter))),
                (experts.get((e, "up_proj"), ""), (e, slice(inter, 2 * inter))),
            )
        ]
        plan[f"{prefix}.down_proj"] = [(experts.get((e, "down_proj"), ""), (e,)) for e in range(num_experts)]

    # Per-expert tensors: shape and dtype, and whether the expert/layer exists at all.
    for layer, entries in per_expert.items():
        for (expert, proj), name in entries.items():
            if layer >= config.num_hidden_layers or not config.is_sparse(layer):
                continue  # reported as unknown below
            if expert >= num_experts:
                problems.append(f"{name}: expected experts 0..{num_experts - 1}, found expert {expert}")
                used.add(name)
                continue
            check(name, (hidden, inter) if proj == "down_proj" else (inter, hidden), False)

    for name in tensors.keys() - used:
        info = tensors[name]
        hint = ""
        if name == "lm_head.weight" and config.tie_word_embeddings:
            hint = " (tie_word_embeddings is set: the head is the embedding)"
        found = _describe(info.code, info.shape)
        problems.append(f"{name}: expected no such tensor{hint}, found {found} (unknown name)")
    return plan, problems


def _want(shape, fp32: bool) -> str:
    return f"{'F32' if fp32 else 'float (F32/BF16/F16)'} {list(shape)}"


def load_checkpoint(
    path: str | Path,
    *,
    dtype=None,
    config: BeamConfig | None = None,
    put: Put | None = None,
    progress: bool = True,
) -> tuple[BeamConfig, Params]:
    """Read a safetensors checkpoint (directory, `model.safetensors`, or index file).

    `dtype=None` keeps the checkpoint's floating dtype; the router stays float32 regardless.
    `put(name, host_array) -> jax.Array` places each finished parameter (default
    `jax.device_put`; the sharding layer passes one that places shards). Raises `CheckpointError`
    listing every mismatch before anything is read or placed.
    """
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    config = config if config is not None else BeamConfig.load(directory)
    put = put if put is not None else (lambda name, array: jax.device_put(array))
    with SafetensorsCheckpoint(path) as checkpoint:
        target = float_dtype(dtype) if dtype is not None else checkpoint_dtype(directory, checkpoint.tensors)
        expected = expected_params(config, target)
        plan, problems = plan_load(config, checkpoint.tensors, target)
        if problems:
            summary = f"{path}: checkpoint does not match the config ({len(problems)} problems)"
            if (directory / "config.json").is_file() and "quantization_config" in json.loads(
                (directory / "config.json").read_text()
            ):
                summary += "; config.json declares a quantization_config, which this loader does not read"
            raise CheckpointError(summary, sorted(problems, key=natural_key))

        arrays: dict[str, jax.Array] = {}
        with tqdm(total=len(checkpoint.tensors), desc="loading", unit="tensor", disable=not progress) as bar:
            for name, sources in plan.items():
                spec = expected[name]
                if len(sources) == 1 and sources[0][1] == ():
                    # astype copies: the array handed to `put` never aliases the memory map.
                    host = checkpoint.get(sources[0][0]).astype(spec.dtype, copy=True)
                else:
                    host = np.empty(spec.shape, spec.dtype)
                    for source, index in sources:
                        host[index] = checkpoint.get(source)  # casts while copying, one expert at a time
                arrays[name] = put(name, host)
                del host
                bar.update(len(sources))
    return config, params_from_flat(config, arrays)


def natural_key(text: str):
    """Sort `layers.2` before `layers.10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
