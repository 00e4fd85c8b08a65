"""Tensor and expert parallelism over a `jax.sharding.Mesh`: the mesh, a partition spec for every
parameter and cache, placement, and the expert computation under `shard_map`.

    mesh = make_mesh(tp=2, ep=4)                          # 8 devices: ep x tp, tp innermost
    params = shard_params(params, mesh, config)           # each device holds its slices only
    cache = sharded_cache(lambda: KVCache.create(config, batch, max_len), mesh, config)
    out = sharded_forward(mesh, config)(params, tokens, positions, cache)

Layout (the blog's TP8, with EP as the alternative for the experts). The mesh has two axes, "ep"
and "tp" (tp innermost, so a TP group is neighbouring devices). Everything that is not an expert
is split over the whole mesh ("ep" and "tp" together): under EP8 attention still runs TP8.
- attention: q/gate projections, `gate_bias` and o_proj's input dim split by query head; k/v by KV
  head when the KV heads divide evenly, else replicated (each device then holds every KV head,
  which GQA needs for its query heads); q/k norms replicated.
- dense MLP: the intermediate dim (gate/up rows, down columns).
- experts: the expert dim over "ep" (whole experts per device) and each expert's intermediate dim
  over "tp" (a 1/tp slice of every expert). Packed NVFP4 weights are packed along the input dim, so
  gate/up split along their output rows and down along its packed input columns, whose 16-value
  scale groups must stay whole (checked); per-channel and per-expert scales follow their weights.
- the router and its correction bias (fp32), the norms and the embedding are replicated (the
  lookup stays local); the lm head is split on vocab, so each device computes its slice of the
  logits.
- KV pages (and the contiguous cache) split by KV head as k/v_proj are.

The bf16 experts' fused `gate_up_proj [E, 2I, H]` (gate rows first) cannot be split on dim 1: a
contiguous block would give one device gate rows only. On the mesh it is held as the view
`[E, 2, I, H]` (`mesh_layout`, a reshape that moves no data), split on I; the experts reshape it
back. Parameters from `shard_params` therefore have that one shape changed; everything else keeps
the HF shapes. NVFP4 experts converted to the Mosaic kernel's layout (`beam_jax.quant.kernel_layout`)
hold their gate/up rows the same way, and split so that each device's shard is a valid local layout
(`KERNEL_SPECS`).

XLA's SPMD partitioner partitions attention, the dense MLP and the head from these placements and
inserts the all-reduces (after o_proj and down_proj: the sandwich norm after each block then runs on
the reduced activations). For the experts it would all-gather whole expert weights, so they run
under `jax.shard_map` (`experts_on_mesh`): each device computes its experts' slices for every token
and one psum combines them. The compiled forward's only collectives are then two all-reduces per
layer, of `[tokens, hidden]` (tests/beam_jax/test_sharding.py counts them). Efficiency notes there.

Several processes (`jax.distributed`): the mesh spans every process's devices and each process
runs the same program on the same inputs (the serving engine drives identical steps everywhere).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from beam_jax.config import BeamConfig

EP = "ep"
TP = "tp"
AXES = (EP, TP)  # mesh axis order: tp innermost
NVFP4_GROUP = 16
GATE_UP = "gate_up_proj"


# ---- the mesh ------------------------------------------------------------------------------------
def make_mesh(tp: int = 1, ep: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(ep, tp)` mesh over `devices` (default: the first tp*ep of `jax.devices()`, every
    process's devices in a multi-process run). Axes are Auto: XLA partitions what the specs don't
    pin down."""
    if tp < 1 or ep < 1:
        raise ValueError(f"tp and ep must be >= 1, got tp={tp}, ep={ep}")
    size = tp * ep
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < size:
        raise ValueError(f"tp={tp} x ep={ep} needs {size} devices, {len(devices)} available")
    grid = np.array(devices[:size], dtype=object).reshape(ep, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _sizes(mesh) -> tuple[int, int]:
    shape = dict(mesh.shape)
    return shape[EP], shape[TP]


def mesh_shards_experts() -> bool:
    """Whether a mesh with this module's axes is set (`jax.set_mesh`) for the code being traced."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(AXES) <= set(mesh.axis_names)


def _split(size: int, mesh) -> tuple[str, ...] | None:
    """The axes a dim of `size` is split over: the whole mesh if it divides evenly, else "tp" alone,
    else none (replicated)."""
    ep, tp = _sizes(mesh)
    if size % (ep * tp) == 0:
        return AXES
    if tp > 1 and size % tp == 0:
        return (TP,)
    return None


def check_mesh(config: BeamConfig, mesh) -> None:
    """The expert layout has no fallback: experts must divide over "ep", intermediates over "tp"."""
    ep, tp = _sizes(mesh)
    if not any(config.is_sparse(i) for i in range(config.num_hidden_layers)):
        return
    problems = []
    if config.num_experts % ep:
        problems.append(f"num_experts ({config.num_experts}) is not divisible by ep={ep}")
    inter = config.moe_intermediate_size
    if inter % tp:
        problems.append(f"moe_intermediate_size ({inter}) is not divisible by tp={tp}")
    elif config.expert_format == "nvfp4" and (inter // tp) % NVFP4_GROUP:
        problems.append(
            f"NVFP4 down_proj is packed along the intermediate dim in groups of {NVFP4_GROUP}: "
            f"moe_intermediate_size/tp = {inter // tp} must be a multiple of {NVFP4_GROUP}"
        )
    if config.mosaic_experts and not problems:
        from beam_jax.quant.kernel_layout import layout_problems  # that module builds on this one

        problems = [f"in the Mosaic kernel's layout, {p}" for p in layout_problems(config, tp, ep)]
    if problems:
        raise ValueError("this mesh cannot hold the experts: " + "; ".join(problems))


# ---- partition specs -----------------------------------------------------------------------------
# NVFP4 experts in the Mosaic kernel's layout (`beam_jax.quant.kernel_layout`), gate_up in its mesh
# layout `[E, ..., 2, I, ...]`: gate/up rows split on I; down's K (the intermediate dim) split in whole
# 64-value tiles: its packed bytes `[E, K/64, H, 32]` and scale words `[E, K/64, H, 1]` on the K-tile axis.
KERNEL_SPECS = {
    "gate_up.packed": P(EP, None, None, TP, None),  # [E, H/256, 2, I, 128]
    "gate_up.scales": P(EP, None, None, TP, None),  # [E, H/256, 2, I, 4]
    "gate_up.global_scale": P(EP, None, TP),  # [E, 2, I]
    "down.packed": P(EP, TP, None, None),  # [E, I/64, H, 32]
    "down.scales": P(EP, TP, None, None),  # [E, I/64, H, 1]
    "down.global_scale": P(EP, None),  # [E, H]
}


def expert_spec(name: str, expert_format: str) -> P:
    """The spec of an expert parameter, by its name under `mlp.experts` (`gate_up_proj` in its
    mesh layout `[E, 2, I, H]`, `down_proj.weight_scale`, `gate_up.packed`, ...)."""
    if expert_format == "nvfp4" and name in KERNEL_SPECS:
        return KERNEL_SPECS[name]
    if expert_format == "bf16":
        specs = {GATE_UP: P(EP, None, TP, None), "down_proj": P(EP, None, TP)}
        if name in specs:
            return specs[name]
    else:
        proj, _, suffix = name.partition(".")
        if proj in ("gate_proj", "up_proj", "down_proj"):
            down = proj == "down_proj"
            # [E, out, in] weights: gate/up split their output rows, down its (packed) input columns.
            matrix = P(EP, None, TP) if down else P(EP, TP, None)
            per_expert = P(EP)  # scalars [E]
            if suffix == "weight":
                return matrix
            if suffix in ("weight_scale_2", "input_scale"):
                return per_expert
            if suffix == "weight_scale":
                # NVFP4 block scales [E, out, in/16] split as their weights; FP8 per-channel scales
                # [E, out, 1] follow the output rows (down's rows are the hidden dim: not split).
                channel = P(EP, None, None) if down else matrix
                return {"nvfp4": matrix, "fp8_channel": channel, "fp8_tensor": per_expert}[expert_format]
    raise ValueError(f"no partition spec for expert parameter {name!r} ({expert_format} experts)")


_LAYER = r"model\.layers\.\d+\."
# (pattern, spec builder(config, mesh)); names are the HF checkpoint names.
_RULES: list[tuple[re.Pattern, Callable[[BeamConfig, Mesh], P]]] = [
    (r"model\.embed_tokens\.weight", lambda c, m: P()),
    (r"lm_head\.weight", lambda c, m: P(_split(c.vocab_size, m), None)),
    (r"model\.norm\.weight", lambda c, m: P()),
    (_LAYER + r"(input|post_attention|pre_feedforward|post_feedforward)_layernorm\.weight", lambda c, m: P()),
    (_LAYER + r"self_attn\.(q|k)_norm\.weight", lambda c, m: P()),
    (_LAYER + r"self_attn\.(q|gate)_proj\.weight", lambda c, m: P(_split(c.num_attention_heads, m), None)),
    (_LAYER + r"self_attn\.(q_proj\.bias|gate_bias)", lambda c, m: P(_split(c.num_attention_heads, m))),
    (_LAYER + r"self_attn\.(k|v)_proj\.weight", lambda c, m: P(_split(c.num_key_value_heads, m), None)),
    (_LAYER + r"self_attn\.(k|v)_proj\.bias", lambda c, m: P(_split(c.num_key_value_heads, m))),
    (_LAYER + r"self_attn\.o_proj\.weight", lambda c, m: P(None, _split(c.num_attention_heads, m))),
    (_LAYER + r"self_attn\.o_proj\.bias", lambda c, m: P()),
    (_LAYER + r"mlp\.(gate|up)_proj\.weight", lambda c, m: P(_split(c.intermediate_size, m), None)),
    (_LAYER + r"mlp\.down_proj\.weight", lambda c, m: P(None, _split(c.intermediate_size, m))),
    (_LAYER + r"mlp\.gate\.(weight|e_score_correction_bias)", lambda c, m: P()),  # the router, fp32
]
_RULES = [(re.compile(pattern), build) for pattern, build in _RULES]
_EXPERT = re.compile(_LAYER + r"mlp\.experts\.(.+)")


def param_spec(name: str, config: BeamConfig, mesh) -> P:
    """The partition spec of the parameter with HF name `name` (experts in their mesh layout)."""
    if m := _EXPERT.fullmatch(name):
        return expert_spec(m[1], config.expert_format)
    for pattern, build in _RULES:
        if pattern.fullmatch(name):
            return build(config, mesh)
    raise ValueError(f"no partition spec for parameter {name!r}: add a rule to beam_jax.sharding")


def kv_cache_spec(config: BeamConfig, mesh) -> P:
    """KV pages `[pages, page_size, kv_heads, d]` and the contiguous cache `[batch, len, kv_heads, d]`:
    split by KV head as k/v_proj are."""
    return P(None, None, _split(config.num_key_value_heads, mesh), None)


def attention_head_axes(num_heads: int, num_kv_heads: int, mesh=None) -> tuple[str, ...] | None:
    """The mesh axes that split the query heads and the KV heads alike (`mesh`, default the one
    set), so that each device attends with its own query heads over its own KV heads: the attention
    kernels then run per device under `shard_map` (`PagedKVCache.attend`). None without a mesh, or
    when the heads split differently (e.g. KV heads replicated): there attention stays in plain jnp."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return None
    axes = _split(num_heads, mesh)
    return axes if axes is not None and axes == _split(num_kv_heads, mesh) else None


# Axis holding gate rows then up rows, and the rank, of each parameter split into gate and up on the mesh.
_GATE_UP_ROWS = {GATE_UP: (1, 3), "gate_up.packed": (2, 4), "gate_up.scales": (2, 4), "gate_up.global_scale": (1, 2)}


def mesh_layout(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter has on the mesh: the fused bf16 `gate_up_proj [E, 2I, H]` becomes
    `[E, 2, I, H]` (gate rows, then up rows: a reshape, no data moves), and so do the gate/up rows
    of the Mosaic kernel's layout (`gate_up.packed`, ...); every other is unchanged."""
    _, experts, suffix = name.rpartition("mlp.experts.")
    if experts and suffix in _GATE_UP_ROWS and len(shape) == _GATE_UP_ROWS[suffix][1]:
        axis = _GATE_UP_ROWS[suffix][0]
        return (*shape[:axis], 2, shape[axis] // 2, *shape[axis + 1 :])
    return tuple(shape)


# ---- placement -----------------------------------------------------------------------------------
def place_blocks(shape: tuple[int, ...], sharding: NamedSharding, read: Callable[[tuple], np.ndarray]) -> jax.Array:
    """A global array from `read(index) -> host block`, called once per distinct block among this
    process's devices (a block replicated over several devices is read once); each block is placed
    and dropped before the next is read, so the host never holds more than one block."""
    devices_of_block: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))  # [start, stop) per dim
        devices_of_block.setdefault(bounds, []).append(device)
    shards = []
    for bounds, devices in devices_of_block.items():
        block = read(tuple(slice(start, stop) for start, stop in bounds))
        shards += [jax.device_put(block, device) for device in devices]
        del block
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def shard_params(params: nnx.State, mesh: Mesh, config: BeamConfig) -> nnx.State:
    """The parameters placed on the mesh by `param_spec` (gate_up in its mesh layout). Every
    process passes the same values (e.g. the same seed); parameters already placed so (a
    checkpoint loaded with `load_checkpoint(..., mesh=mesh)`, which reads only the local slices)
    are kept as they are."""
    check_mesh(config, mesh)
    flat = []
    for path, leaf in nnx.to_flat_state(params):
        name = ".".join(str(p) for p in path)
        value = leaf.get_value()
        shape = mesh_layout(name, value.shape)
        sharding = NamedSharding(mesh, param_spec(name, config, mesh))
        if not (isinstance(value, jax.Array) and value.shape == shape and value.sharding == sharding):
            host = np.asarray(value).reshape(shape)  # every process holds it whole: slicing is free
            value = place_blocks(shape, sharding, host.__getitem__)
        flat.append((path, leaf.replace(value)))
    return nnx.from_flat_state(flat)


def sharded_cache(create: Callable[[], object], mesh: Mesh, config: BeamConfig):
    """The cache `create()` makes (a `KVCache` or `PagedKVCache` of zeros), built directly in its
    shards: every page array split by KV head (`kv_cache_spec`), no device ever holding it whole."""
    sharding = NamedSharding(mesh, kv_cache_spec(config, mesh))
    return jax.jit(create, out_shardings=jax.tree.map(lambda _: sharding, jax.eval_shape(create)))()


def constrain_cache(cache, config: BeamConfig):
    """Inside a jitted step on the mesh: keep the cache returned where `sharded_cache` put it (so a
    donated cache round-trips without resharding)."""
    spec = kv_cache_spec(config, jax.sharding.get_abstract_mesh())
    return jax.tree.map(lambda pages: jax.lax.with_sharding_constraint(pages, spec), cache)


def replicate(tree):
    """Inside a jitted step on the mesh: outputs every process reads whole (sampled tokens)."""
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P()), tree)


def sharded_forward(mesh: Mesh, config: BeamConfig, **forward_kwargs) -> Callable:
    """`beam_jax.model.forward` jitted for the mesh: `f(params, tokens, positions, cache=None)`
    with params from `shard_params` and a cache from `sharded_cache` (donated, returned with the same
    sharding). Tokens and positions are replicated. `forward_kwargs` are its static options."""
    from beam_jax.model import forward  # here, not at the top: the model's layers import this module

    def step(params, tokens, positions, cache):
        out = forward(params, tokens, positions, cache, config=config, **forward_kwargs)
        if out.cache is not None:
            out = dataclasses.replace(out, cache=constrain_cache(out.cache, config))
        return out

    jitted = jax.jit(step, donate_argnums=(3,))

    def run(params, tokens, positions, cache=None):
        with jax.set_mesh(mesh):
            return jitted(params, tokens, positions, cache)

    def lower(params, tokens, positions, cache=None):
        with jax.set_mesh(mesh):
            return jitted.lower(params, tokens, positions, cache)

    run.lower = lower  # to read the compiled program (tests count its collectives)
    return run


# ---- the experts under shard_map -----------------------------------------------------------------
def experts_on_mesh(
    compute: Callable,
    arrays: dict[str, jax.Array],
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    *,
    expert_format: str,
    counters: jax.Array | None = None,
):
    """Run `compute(local_arrays, x, weights, indices, expert_offset=...)` on every device of the
    current mesh over the expert slices it holds, and psum the partial outputs. With `counters` (the one-launch
    NVFP4 kernel's: `compute(..., counters=)` returns (output, counters)), (output, counters) come back: each
    device passes its own on (under EP they count different calls, since their kernels skip different pairs;
    replicated in name only, and nothing reads them across devices).

    Each device gets every token (activations and routing are replicated after the attention
    all-reduce) and its own experts' slices of the weights: under EP the experts
    `offset .. offset + E/ep` (pairs routed elsewhere count zero), under TP a 1/tp slice of every
    expert's intermediate dim (SwiGLU is elementwise over it, and down_proj's contraction over it
    is completed by the psum). `expert_offset=None` when ep == 1 (every expert is local).

    Efficiency: the psum is one all-reduce of `[tokens, hidden]` per MoE layer (the blog's combine
    within one NVLink domain), summed in fp32 (twice the bytes of bf16, one rounding); every device
    sorts all the step's pairs, and under EP the pairs of other devices' experts still pass through
    the local sort. Dispatching tokens to their experts' devices (all-to-all) would avoid both at
    large batch. On the GPU the grouped-GEMM kernel runs on the local experts, under TP and EP alike
    (other devices' pairs form no block and count zero)."""
    mesh = jax.sharding.get_abstract_mesh()
    ep, _ = _sizes(mesh)
    arrays = {name: a.reshape(mesh_layout("mlp.experts." + name, a.shape)) for name, a in arrays.items()}
    specs = {name: expert_spec(name, expert_format) for name in arrays}
    num_local = next(iter(arrays.values())).shape[0] // ep

    def local(arrays, x, weights, indices, *counters):
        offset = None if ep == 1 else jax.lax.axis_index(EP) * num_local
        if counters:
            partial, *counters = compute(arrays, x, weights, indices, expert_offset=offset, counters=counters[0])
        else:
            partial = compute(arrays, x, weights, indices, expert_offset=offset)
        return jax.lax.psum(partial.astype(jnp.float32), AXES).astype(x.dtype), *counters

    # check_vma=False: the Pallas kernel's outputs carry no varying-axes annotation (pallas_call
    # refuses to run under check_vma=True on the GPU); the psum makes the result replicated anyway.
    passed = () if counters is None else (counters,)
    out = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P(), P(), *[P()] * len(passed)),
                        out_specs=(P(), *[P()] * len(passed)), check_vma=False)(arrays, x, weights, indices, *passed)
    return out if passed else out[0]

