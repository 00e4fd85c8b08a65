"""A paged KV cache for the model: per layer `[num_pages, page_size, kv_heads, head_dim]` pages,
plus the metadata of one ragged step (`PagedBatch`), bundled together so that the paged cache goes
through `forward` / the decoder layers exactly where the contiguous `KVCache` goes.

Layout. Page ids are the pool's global ids (`serving.kv_cache.KVPool`): every layer owns one page
array over all `num_pages` ids and reads/writes only the ids its cache group's tables hold. Layers
of one group share that group's page tables and slot mapping (`PagedBatch.layer_group` maps a layer
to its group; it is static).

Tokens are flat and ragged: the model runs with batch dim 1 over `[1, total_tokens]` token ids and
positions; sequence b owns flat tokens `query_start[b] .. query_start[b+1]-1`, which are the LAST
`q_len` positions of its context of `seq_lens[b]` tokens (the positions passed to the model must
agree). Tokens at or past `query_start[batch]` are padding: slot -1 (not written), output zeros.

This module does no allocation bookkeeping (that is the serving pool's job); beam_jax never
imports serving.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig
from pallas_kernels.paged_attention import ragged_paged_attention, write_kv


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("query_start", "seq_lens", "page_tables", "slot_mappings"),
    meta_fields=("layer_group",),
)
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Metadata of one ragged step (like tpu-inference's attention metadata)."""

    query_start: Int[Array, " batch_plus_1"]
    seq_lens: Int[Array, " batch"]  # context length including this step's tokens
    page_tables: tuple[Int[Array, "batch max_pages"], ...]  # one per cache group; -1 = released/absent
    slot_mappings: tuple[Int[Array, " total_tokens"], ...]  # one per cache group; -1 = padding
    layer_group: tuple[int, ...]  # static: cache group of each layer


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("k_pages", "v_pages", "batch"), meta_fields=()
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k_pages: tuple[Float[Array, "pages page_size kv_heads head_dim"], ...]
    v_pages: tuple[Float[Array, "pages page_size kv_heads head_dim"], ...]
    # The current step's metadata; set it with `with_batch` before each forward.
    batch: PagedBatch | None = None

    @classmethod
    def create(
        cls, config: BeamConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16
    ) -> PagedKVCache:
        shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers))

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    def with_batch(self, batch: PagedBatch | None) -> PagedKVCache:
        return dataclasses.replace(self, batch=batch)

    def attend(
        self,
        layer: int,
        q: Float[Array, "tokens heads d"],
        k: Float[Array, "tokens kv_heads d"],
        v: Float[Array, "tokens kv_heads d"],
        window: int | None,
    ) -> tuple[Float[Array, "tokens heads d"], PagedKVCache]:
        """Write this step's K/V of `layer` into its pages, then ragged paged attention over them."""
        batch = self.batch
        if batch is None:
            raise ValueError("PagedKVCache.attend needs the step's PagedBatch (cache.with_batch(batch))")
        group = batch.layer_group[layer]
        k_pages, v_pages = write_kv(self.k_pages[layer], self.v_pages[layer], k, v, batch.slot_mappings[group])
        out = ragged_paged_attention(
            q, k_pages, v_pages, batch.query_start, batch.seq_lens, batch.page_tables[group], window=window
        )
        cache = dataclasses.replace(
            self,
            k_pages=_replace_at(self.k_pages, layer, k_pages),
            v_pages=_replace_at(self.v_pages, layer, v_pages),
        )
        return out, cache


def _replace_at(items: tuple, index: int, item) -> tuple:
    return items[:index] + (item,) + items[index + 1 :]
