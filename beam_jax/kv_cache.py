"""A contiguous KV cache: one `[batch, max_len, kv_heads, head_dim]` buffer per layer.

Slot `j` of a row holds the key/value of absolute position `j`. The paged cache of the serving
engine replaces this behind the same attention interface.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    keys: tuple[Float[Array, "batch max_len kv_heads head_dim"], ...]
    values: tuple[Float[Array, "batch max_len kv_heads head_dim"], ...]

    @classmethod
    def create(cls, config: BeamConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
        shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers))

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    def write(self, layer: int, positions: Int[Array, "batch t"], k, v) -> KVCache:
        """Store the new keys/values at their positions (out-of-range positions are dropped)."""
        rows = jnp.arange(positions.shape[0])[:, None]
        # Negative positions mark padding; jnp indexing would wrap them onto the last slots.
        positions = jnp.where(positions < 0, self.max_len, positions)
        keys = _replace_at(self.keys, layer, self.keys[layer].at[rows, positions].set(k, mode="drop"))
        values = _replace_at(self.values, layer, self.values[layer].at[rows, positions].set(v, mode="drop"))
        return KVCache(keys, values)


def _replace_at(items: tuple, index: int, item) -> tuple:
    return items[:index] + (item,) + items[index + 1 :]
