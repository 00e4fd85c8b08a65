"""NVFP4 experts in the Mosaic GPU kernel's layouts (`pallas_kernels/nvfp4_moe_mgpu.py`), made once
at load time in place of the checkpoint layout.

    config, params = to_kernel_layout(config, params, mesh=mesh)   # the checkpoint-layout arrays go
    beam = beam_jax.load(path, expert_kernel="mosaic")               # the same, inside load

Per sparse layer, `mlp.experts` then holds two `KernelNvfp4Linear`s instead of `gate_proj`, `up_proj`
and `down_proj`: `gate_up` (gate rows then up rows; K = hidden, `tile_k` 256) and `down` (K = the expert intermediate, `tile_k`
64), each `packed` uint8 `[E, K/tile_k, N, tile_k/2]` and `scales` uint32 `[E, K/tile_k, N, tile_k/64]`
(one-byte block-scale codes, four a word; both `nm.pack_weights`) and `global_scale` fp32 `[E, N]`
(the checkpoint's per-expert `weight_scale_2` on every row of that projection). The activation
`input_scale` is not kept (W4A16 never reads it). The config says so (`BeamConfig.mosaic_experts`),
and a model so converted cannot be saved: a checkpoint holds the producers' layout.

The kernel needs K a multiple of its tile_k and rows in multiples of 64 (`layout_problems`). On a
mesh (`beam_jax.sharding`) every device's shard is itself a valid local layout: gate_up is held as
`[E, ..., 2, I, ...]` (packed `[E, H/256, 2, I, 128]`, scales `[E, H/256, 2, I, 4]`, global scale
`[E, 2, I]`) so that TP splits gate rows and up rows alike, and each device reshapes its `[.., 2, I/tp, ..]`
back to `[.., 2I/tp, ..]`; down's K is the intermediate dim, split in whole
64-value tiles (packed bytes and scales on their K/tile_k axis). Packing works per row and per 32 K
values, so converting each device's checkpoint shard gives exactly its shard of the global layout:
the conversion runs per device under `shard_map`, one layer at a time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from beam_jax.config import EXPERT_KERNELS, BeamConfig
from beam_jax.sharding import EP, TP, expert_spec, mesh_layout
from pallas_kernels import moe_gemm as mg
from pallas_kernels.mgpu_tiles import is_hopper
from pallas_kernels.nvfp4_moe_mgpu import KernelNvfp4, kernel_experts

GATE_UP_TILE_K = 256  # gate/up: K = hidden_size
DOWN_TILE_K = 64  # down: K = moe_intermediate_size (per device under TP)
ROW_QUANTUM = 64  # the kernel's rows (N) come in tiles of 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
CHECKPOINT_ARRAYS = ("weight", "weight_scale", "weight_scale_2")  # what the conversion reads
CHECKPOINT_NAMES = tuple(f"{p}.{a}" for p in PROJECTIONS for a in CHECKPOINT_ARRAYS)
KERNEL_PROJECTIONS = ("gate_up", "down")
KERNEL_FIELDS = ("packed", "scales", "global_scale")
KERNEL_ARRAYS = tuple(f"{p}.{f}" for p in KERNEL_PROJECTIONS for f in KERNEL_FIELDS)
EXPERTS_PER_STEP = 8  # experts repacked per step of the conversion (bounds its temporaries)


class KernelNvfp4Linear(nnx.Module):
    """One projection (gate and up: both, stacked on N) of every expert in the kernel's layouts."""

    def __init__(self, experts: int, out_features: int, in_features: int, tile_k: int):
        if in_features % tile_k or out_features % ROW_QUANTUM:
            raise ValueError(f"the Mosaic NVFP4 layout needs K a multiple of {tile_k} and rows a multiple of "
                             f"{ROW_QUANTUM}: K={in_features}, rows={out_features}")
        self.packed = nnx.Param(jnp.zeros((experts, in_features // tile_k, out_features, tile_k // 2), jnp.uint8))
        self.scales = nnx.Param(jnp.zeros((experts, in_features // tile_k, out_features, tile_k // 64), jnp.uint32))
        self.global_scale = nnx.Param(jnp.zeros((experts, out_features), jnp.float32))


def _has_experts(config: BeamConfig) -> bool:
    return any(config.is_sparse(i) for i in range(config.num_hidden_layers))


def layout_problems(config: BeamConfig, tp: int = 1, ep: int = 1) -> list[str]:
    """Why the experts cannot take the kernel layout with each device holding 1/ep of the experts
    and 1/tp of each expert's intermediate dim (empty: they can)."""
    if config.expert_format != "nvfp4":
        return [f"the Mosaic expert kernel takes NVFP4 experts, these are {config.expert_format}"]
    problems = []
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    if hidden % GATE_UP_TILE_K:
        problems.append(f"gate/up need hidden_size ({hidden}) a multiple of {GATE_UP_TILE_K} (their K tile)")
    if hidden % ROW_QUANTUM:
        problems.append(f"down needs hidden_size ({hidden}) a multiple of {ROW_QUANTUM} (its rows)")
    if config.num_experts % ep:
        problems.append(f"num_experts ({config.num_experts}) is not divisible by ep={ep}")
    per_device = f"moe_intermediate_size/tp = {inter}/{tp}" if tp > 1 else f"moe_intermediate_size ({inter})"
    if inter % (DOWN_TILE_K * tp):
        # down's K tile is 64; the gate/up rows per device (2 I/tp) are then a multiple of 64 too.
        problems.append(f"down's K tile is {DOWN_TILE_K}: {per_device} must be a multiple of {DOWN_TILE_K}")
    return problems


def _mesh_sizes(mesh) -> tuple[int, int]:
    if mesh is None:
        return 1, 1
    sizes = dict(mesh.shape)
    return sizes[TP], sizes[EP]


def on_hopper(mesh=None) -> bool:
    """Whether every device that would run the experts is a Hopper GPU (compute capability 9.0)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    return all(is_hopper(d) for d in devices)


def use_mosaic(config: BeamConfig, expert_kernel: str = "auto", mesh=None) -> bool:
    """Whether to convert the experts (`expert_kernel`: "auto" converts NVFP4 experts whose shapes
    fit, on Hopper GPUs; "mosaic" always, refusing shapes that do not fit; "triton" never)."""
    if expert_kernel not in EXPERT_KERNELS:
        raise ValueError(f"expert_kernel must be one of {', '.join(EXPERT_KERNELS)}, not {expert_kernel!r}")
    if config.mosaic_experts:
        if expert_kernel == "triton":
            raise ValueError("the experts are already in the Mosaic kernel's layout; load the checkpoint again "
                             "with expert_kernel='triton'")
        return False  # converted already
    if expert_kernel == "triton" or not _has_experts(config):
        return False
    problems = layout_problems(config, *_mesh_sizes(mesh))
    if expert_kernel == "mosaic":
        if problems:
            where = "" if mesh is None else " on a tp={}, ep={} mesh".format(*_mesh_sizes(mesh))
            raise ValueError(f"expert_kernel='mosaic' cannot hold these experts{where}: " + "; ".join(problems))
        return True
    return not problems and on_hopper(mesh)


def _convert_experts(arrays: dict[str, jax.Array], mesh_shaped: bool) -> dict[str, jax.Array]:
    """One layer's (or one device's share of its) checkpoint arrays (`gate_proj.weight`, ...) ->
    kernel arrays (`gate_up.packed`, ...); gate_up in its mesh layout `[E, ..., 2, I, ...]` if `mesh_shaped`."""
    experts = arrays["gate_proj.weight"].shape[0]
    chunk = math.gcd(experts, EXPERTS_PER_STEP)

    def convert(chunk_arrays):
        gate, up, down = (mg.ExpertWeights(*(chunk_arrays[f"{p}.{a}"] for a in CHECKPOINT_ARRAYS), format="nvfp4")
                          for p in PROJECTIONS)
        kernel = dict(zip(KERNEL_PROJECTIONS, kernel_experts(gate, up, down, gate_up_tile_k=GATE_UP_TILE_K,
                                                            down_tile_k=DOWN_TILE_K)))
        return {f"{p}.{f}": getattr(kernel[p], f) for p in KERNEL_PROJECTIONS for f in KERNEL_FIELDS}

    # A step repacks `chunk` experts: the unpacked codes (4 bytes a value) exist for those only.
    chunks = {name: a.reshape(experts // chunk, chunk, *a.shape[1:]) for name, a in arrays.items()}
    out = {name: a.reshape(experts, *a.shape[2:]) for name, a in jax.lax.map(convert, chunks).items()}
    if mesh_shaped:
        out = {name: a.reshape(mesh_layout("mlp.experts." + name, a.shape)) for name, a in out.items()}
    return out


def kernel_shaped(name: str, array: jax.Array) -> jax.Array:
    """A kernel array as `KernelNvfp4` takes it, also from its mesh layout (gate_up `[E, ..., 2, I, ...]`)."""
    if name in ("gate_up.packed", "gate_up.scales"):
        return array.reshape(*array.shape[:2], -1, array.shape[-1])
    if name == "gate_up.global_scale":
        return array.reshape(array.shape[0], -1)
    return array


def kernel_weights(arrays: dict[str, jax.Array]) -> tuple[KernelNvfp4, KernelNvfp4]:
    """gate_up and down as `moe_nvfp4` takes them, from `Experts.arrays()` (or one device's slices)."""
    gate_up, down = (
        KernelNvfp4(*(kernel_shaped(f"{p}.{f}", arrays[f"{p}.{f}"]) for f in KERNEL_FIELDS), tile_k=tile_k)
        for p, tile_k in zip(KERNEL_PROJECTIONS, (GATE_UP_TILE_K, DOWN_TILE_K))
    )
    return gate_up, down


def to_kernel_layout(config: BeamConfig, params: nnx.State, mesh=None, *, delete_checkpoint_layout: bool = True
                     ) -> tuple[BeamConfig, nnx.State]:
    """The model with its NVFP4 experts in the kernel layout: `(config with mosaic_experts, params)`.
    Every other parameter is passed through. One sparse layer at a time: its checkpoint-layout
    arrays are deleted (`delete_checkpoint_layout`, the default) once its kernel arrays exist, so
    the two layouts coexist for one layer only; the caller's `params` then hold deleted arrays.
    With a `mesh` (the parameters placed by `shard_params` or a sliced load, or not placed yet),
    each device converts its own shard and the results carry `param_spec`'s sharding."""
    from beam_jax.model import flat_params, params_from_flat  # the model's layers import this module

    if config.mosaic_experts:
        raise ValueError("the experts are in the Mosaic kernel's layout already")
    tp, ep = _mesh_sizes(mesh)
    if problems := layout_problems(config, tp, ep):
        raise ValueError("the experts cannot take the Mosaic kernel's layout: " + "; ".join(problems))
    converted = config.replace(mosaic_experts=True)
    flat = flat_params(params)
    convert = jax.jit(lambda arrays: _convert_experts(arrays, mesh_shaped=False))
    if mesh is not None:
        in_specs = {name: expert_spec(name, "nvfp4") for name in CHECKPOINT_NAMES}
        out_specs = {name: expert_spec(name, "nvfp4") for name in KERNEL_ARRAYS}
        # out_shardings: exactly `param_spec`'s (jit would drop trailing Nones), so that `shard_params`
        # finds them placed already and moves nothing.
        convert = jax.jit(jax.shard_map(lambda arrays: _convert_experts(arrays, mesh_shaped=True), mesh=mesh,
                                        in_specs=(in_specs,), out_specs=out_specs),
                          out_shardings={name: NamedSharding(mesh, spec) for name, spec in out_specs.items()})
    # Before any layer is converted (and its checkpoint arrays deleted): the one-byte scale codes have no NaN.
    sparse = [layer for layer in range(config.num_hidden_layers) if config.is_sparse(layer)]
    for layer, projection in ((layer, p) for layer in sparse for p in PROJECTIONS):
        name = f"model.layers.{layer}.mlp.experts.{projection}.weight_scale"
        if bool(jnp.isnan(flat[name]).any()):
            raise ValueError(f"{name} holds NaN block scales, which the Mosaic kernel's layout cannot represent; "
                             "load with expert_kernel='triton' to keep the checkpoint layout")
    out = {name: array for name, array in flat.items() if ".mlp.experts." not in name}
    for layer in sparse:
        prefix = f"model.layers.{layer}.mlp.experts."
        old = {name[len(prefix):]: a for name, a in flat.items() if name.startswith(prefix)}
        new = jax.block_until_ready(convert({name: old[name] for name in CHECKPOINT_NAMES}))
        out.update({prefix + name: a for name, a in new.items()})
        if delete_checkpoint_layout:
            for a in old.values():
                if isinstance(a, jax.Array) and not a.is_deleted():
                    a.delete()
        del old, new
    del flat
    return converted, params_from_flat(converted, out)

