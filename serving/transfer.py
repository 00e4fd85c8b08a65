"""A step's inputs and outputs as one array each way: one host-to-device and one device-to-host copy
per step instead of one per array.

On the H200 a decode step of `beam-tp8-slice` at batch 1 ran 0.65 ms of kernels in 4.7 ms of wall
time. Part of the rest was transfers: 26 input arrays put one by one (0.6 ms of host time) and 4
outputs fetched one by one (~0.35 ms each; benchmarks/engine/RESULTS.md). A step's arrays are all
32-bit or bool, so they travel as int32 words: floats and uint32 bit for bit, bools as 0/1.

    words, layout = pack(inputs)             # host: numpy pytree -> int32 [n], Layout
    inputs = unpack(words, layout)           # in the program (layout static): slices and bitcasts
    words, layout = pack_traced(outputs)     # in the program
    outputs = unpack_host(words, layout)     # host: numpy views of the fetched words
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("int32", "uint32", "float32", "bool")
_NAMES = {np.dtype(name): name for name in _DTYPES}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a pytree lies in the words: its shape and dtype, in flattening order. Hashable:
    a static argument of the program (one compilation per layout, as per shapes before)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.leaves)


def _check_dtype(dtype, where: str) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise ValueError(f"{where}: a {np.dtype(dtype).name} array cannot travel as int32 words "
                         f"(only {', '.join(_DTYPES)})")
    return name


def pack(tree) -> tuple[np.ndarray, Layout]:
    """Host side: a pytree of numpy arrays as one int32 array, and its layout."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    names = [_check_dtype(a.dtype, f"leaf {i} of the step's inputs") for i, a in enumerate(arrays)]
    parts = [np.ascontiguousarray(a).astype(np.int32) if name == "bool" else np.ascontiguousarray(a).view(np.int32)
             for a, name in zip(arrays, names)]
    words = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, np.int32)
    return words, Layout(treedef, tuple((a.shape, name) for a, name in zip(arrays, names)))


def _leaf_words(words, layout: Layout):
    """(dtype name, the leaf's words in its shape) for each leaf of `layout`, in order."""
    at = 0
    for shape, name in layout.leaves:
        size = math.prod(shape)
        yield name, words[at : at + size].reshape(shape)
        at += size


def unpack(words: jax.Array, layout: Layout):
    """In a program: the pytree `pack` flattened, from its words."""
    leaves = [part != 0 if name == "bool" else part if name == "int32"
              else jax.lax.bitcast_convert_type(part, jnp.dtype(name)) for name, part in _leaf_words(words, layout)]
    return jax.tree.unflatten(layout.treedef, leaves)


def pack_traced(tree) -> tuple[jax.Array, Layout]:
    """In a program: a pytree of arrays as one int32 array (fetched in one copy), and its layout."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = []
    for i, x in enumerate(leaves):
        name = _check_dtype(x.dtype, f"leaf {i} of the step's outputs")
        if name == "bool":
            x = x.astype(jnp.int32)
        elif name != "int32":
            x = jax.lax.bitcast_convert_type(x, jnp.int32)
        parts.append(x.reshape(-1))
    words = jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)
    return words, Layout(treedef, tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves))


def unpack_host(words: np.ndarray, layout: Layout):
    """Host side: the pytree `pack_traced` flattened, as numpy arrays over the fetched words."""
    words = np.asarray(words)
    if words.shape != (layout.size,):
        raise ValueError(f"{words.shape[0]} words for a layout of {layout.size}")
    leaves = [part != 0 if name == "bool" else part.view(name) for name, part in _leaf_words(words, layout)]
    return jax.tree.unflatten(layout.treedef, leaves)
