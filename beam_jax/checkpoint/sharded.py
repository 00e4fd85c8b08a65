"""Sharded loading (`load_checkpoint(path, mesh=mesh)`): each process reads, straight from the
memory-mapped safetensors, only the slices of each parameter that its devices own
(`beam_jax.sharding.param_spec`), and the global arrays are assembled from those device shards.

    config, params = load_checkpoint("/ckpt/beam", mesh=make_mesh(tp=8))

No host ever holds a whole split tensor: one device block at a time is read (cast while copying
out of the memory map, which touches only the pages of that block's rows), placed on the devices
that own it, and dropped. Per-expert checkpoint tensors (quantized or per-expert bf16) are read
only for the experts and rows of the block. Replicated parameters (embedding, router, norms) are
read whole, once per process.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from beam_jax.checkpoint.safetensors_io import SafetensorsCheckpoint
from beam_jax.config import BeamConfig
from beam_jax.sharding import mesh_layout, param_spec, place_blocks

# One destination slice of a parameter: (checkpoint tensor name, index into the parameter).
# A parameter stored under its own name has one source with the empty index (the whole array).
Source = tuple[str, tuple]
Box = tuple[tuple[int, int], ...]  # [start, stop) per dim


def load_sharded_param(
    checkpoint: SafetensorsCheckpoint,
    name: str,
    sources: list[Source],
    spec: jax.ShapeDtypeStruct,
    mesh: Mesh,
    config: BeamConfig,
) -> jax.Array:
    """One parameter (`spec`: its shape and dtype) placed on the mesh in its mesh layout."""
    shape = mesh_layout(name, spec.shape)
    sharding = NamedSharding(mesh, param_spec(name, config, mesh))
    return place_blocks(
        shape, sharding, lambda index: read_block(checkpoint, sources, spec.shape, spec.dtype, shape, index)
    )


def read_block(
    checkpoint: SafetensorsCheckpoint,
    sources: list[Source],
    param_shape: tuple[int, ...],
    dtype,
    layout_shape: tuple[int, ...],
    index: tuple[slice, ...],
) -> np.ndarray:
    """One device's block `index` of a parameter in its mesh layout, read from its sources.
    The fused gate_up's mesh layout `[E, 2, I, H]` maps half `h`, rows `i` to rows `h*I + i`."""
    box = _box(index, layout_shape)
    block = np.empty([stop - start for start, stop in box], dtype)
    if layout_shape == tuple(param_shape):
        _fill(block, checkpoint, sources, param_shape, box)
        return block
    (e0, e1), (h0, h1), (i0, i1), hidden = box
    inter = layout_shape[2]
    for h in range(h0, h1):
        rows = (h * inter + i0, h * inter + i1)
        _fill(block[:, h - h0], checkpoint, sources, param_shape, ((e0, e1), rows, hidden))
    return block


def _fill(out: np.ndarray, checkpoint: SafetensorsCheckpoint, sources: list[Source], shape, box: Box) -> None:
    """Write the part `box` of a parameter of `shape` into `out`, from sources that each fill
    `index` of the parameter."""
    for name, index in sources:
        source_box = _box(index, shape)
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(source_box, box)]
        if any(start >= stop for start, stop in overlap):
            continue
        # The source as a block of the parameter (an expert's [I, H] as [1, I, H]; a `[1]` scalar as
        # [1]); slicing the memory map reads only the rows inside the overlap, and the assignment
        # casts while copying.
        source = checkpoint.get(name).reshape([b - a for a, b in source_box])
        out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(overlap, box))] = source[
            tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(overlap, source_box))
        ]


def _box(index: tuple, shape: tuple[int, ...]) -> Box:
    """An index (ints and unit-step slices, possibly fewer than the dims) as [start, stop) per dim."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    box = []
    for item, size in zip(index, shape):
        if isinstance(item, slice):
            start, stop, _ = item.indices(size)
            box.append((start, stop))
        else:
            box.append((int(item), int(item) + 1))
    return tuple(box)
