"""A paged KV cache for the model, plus the metadata of one ragged step (`PagedBatch`), bundled
together so that the paged cache goes through `forward` / the decoder layers exactly where the
contiguous `KVCache` goes.

Layout. Page ids are the pool's global ids (`serving.kv_cache.KVPool`). A pool page holds
`page_size` tokens of one sequence for one cache group, with one slot per layer of that group
(layers of a group share its page tables). So the cache is ONE key and ONE value array,
`[num_pages * slots, page_size, kv_heads, head_dim]` with `slots` = the largest group's layer count:
row `page * slots + slot` is layer `slot`-of-its-group's part of pool page `page`. That is exactly
the memory the planner budgets (pages sized for the largest group). Each layer's attention sees its
group's page tables and slot mapping moved to its rows (`page * slots + slot`), elementwise, so
the kernels take the whole array and nothing is copied.

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
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig
from beam_jax.sharding import attention_head_axes
from pallas_kernels.paged_attention import (
    DecodeMetadata,
    HeadPrologue,
    OutputGate,
    decode_metadata,
    default_decode_blocks,
    default_use_kernel,
    ragged_paged_attention,
    write_kv,
    write_kv_before_decode,
)
from pallas_kernels.nvfp4_fused_moe import fresh_counters
from pallas_kernels.routing import routing_state


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("query_start", "seq_lens", "page_tables", "slot_mappings", "decode", "routing_state",
                 "moe_counters"),
    meta_fields=("decode_only",),
)
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Metadata of one ragged step (like tpu-inference's attention metadata)."""

    query_start: Int[Array, " batch_plus_1"]
    seq_lens: Int[Array, " batch"]  # context length including this step's tokens
    page_tables: tuple[Int[Array, "batch max_pages"], ...]  # one per cache group; pool page ids, -1 = none
    slot_mappings: tuple[Int[Array, " total_tokens"], ...]  # one per cache group; page * page_size + offset, -1 = padding
    # Which tokens are decodes (q_len == 1), for the decode kernel: `PagedKVCache.with_batch` builds it
    # once per step when the cache runs that kernel, and every layer reuses it.
    decode: DecodeMetadata | None = None
    # Static: the caller promises every sequence has q_len <= 1, so a kernel mode runs only the decode
    # kernel (a decode-only step is its own compiled program).
    decode_only: bool = False
    # The fused routing kernel's state (`pallas_kernels.routing.routing_state()`), passed from layer to
    # layer: `with_batch` makes it once per step, so the layers' routing calls do not each fill a fresh one.
    routing_state: Int[Array, " slots"] | None = None
    # The one-launch NVFP4 MoE kernel's counters (`pallas_kernels.nvfp4_fused_moe.fresh_counters()`), passed from
    # layer to layer the same way, so that its calls do not each zero their own (1.1 us of a one-token layer's
    # 16.7 on the H200, session 34).
    moe_counters: Int[Array, " slots"] | None = None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("k_pages", "v_pages", "batch"),
    meta_fields=("layer_group", "layer_slot", "use_kernel", "interpret", "fused"),
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k_pages: Float[Array, "rows page_size kv_heads head_dim"]  # rows = num_pages * slots
    v_pages: Float[Array, "rows page_size kv_heads head_dim"]
    layer_group: tuple[int, ...]  # static: cache group of each layer
    layer_slot: tuple[int, ...]  # static: each layer's slot within its group's pages
    # The current step's metadata; set it with `with_batch` before each forward.
    batch: PagedBatch | None = None
    # Static: the attention path, `ragged_paged_attention`'s `use_kernel` (False: plain jnp; "decode":
    # the decode kernel for decodes; True: all kernels). `create` takes the backend's default.
    use_kernel: bool | str = False
    interpret: bool = False  # static: run the kernels in interpret mode (tests on CPU)
    # Static: with a kernel path, the attention layer hands over raw projections (`fuses_attention`):
    # the decode kernel applies the q norm and RoPE / SSMax and the output gate, the page write the k
    # norm and RoPE. False keeps them in the layer (plain jnp), for comparisons.
    fused: bool = True

    @classmethod
    def create(
        cls, config: BeamConfig, num_pages: int, page_size: int, layer_group: tuple[int, ...], dtype=jnp.bfloat16,
        *, use_kernel: bool | str | None = None, interpret: bool | None = None, fused: bool = True,
    ) -> PagedKVCache:
        """`layer_group` maps every cached layer to its group: the model's layers first, then any
        drafter layers (serving.speculative), which share the pages and so the K/V shape.
        `use_kernel=None`: `default_use_kernel()` ("decode" on GPU, plain jnp elsewhere).
        `interpret=None`: kernels asked for off the GPU run in interpret mode (slow; for tests)."""
        if len(layer_group) < config.num_hidden_layers:
            raise ValueError(f"layer_group has {len(layer_group)} entries for {config.num_hidden_layers} layers")
        layer_slot = tuple(layer_group[:i].count(g) for i, g in enumerate(layer_group))
        slots = max(layer_slot) + 1
        shape = (num_pages * slots, page_size, config.num_key_value_heads, config.head_dim)
        use_kernel = default_use_kernel() if use_kernel is None else use_kernel
        if interpret is None:
            interpret = bool(use_kernel) and jax.default_backend() != "gpu"
        return cls(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), tuple(layer_group), layer_slot,
            use_kernel=use_kernel, interpret=interpret, fused=fused,
        )

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def slots(self) -> int:
        return max(self.layer_slot) + 1

    @property
    def fuses_attention(self) -> bool:
        """Whether `attend` wants the layer's raw projections with its prologues and gate: when the
        decode kernel runs (the GPU's path), which fuses them; plain jnp gains nothing from it."""
        return bool(self.use_kernel) and self.fused

    def with_batch(self, batch: PagedBatch | None) -> PagedKVCache:
        """Sets the step's metadata; with a kernel path, also the step's decode metadata, and the routing
        state and MoE counters (once per step here, not once per layer)."""
        if batch is not None and self.use_kernel and batch.decode is None:
            num_tokens = batch.slot_mappings[0].shape[0]
            batch = dataclasses.replace(batch, decode=decode_metadata(batch.query_start, num_tokens))
        if batch is not None and batch.routing_state is None:
            batch = dataclasses.replace(batch, routing_state=routing_state())
        if batch is not None and batch.moe_counters is None:
            batch = dataclasses.replace(batch, moe_counters=fresh_counters())
        return dataclasses.replace(self, batch=batch)

    def with_kernel_states(self, routing_state: Int[Array, " slots"],
                           moe_counters: Int[Array, " slots"] | None = None) -> PagedKVCache:
        """The step's batch with the routing state and MoE counters the last sparse layer returned (for the
        next one's)."""
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, routing_state=routing_state,
                                                                   moe_counters=moe_counters))

    def attend(
        self,
        layer: int,
        q: Float[Array, "tokens heads d"],
        k: Float[Array, "tokens kv_heads d"],
        v: Float[Array, "tokens kv_heads d"],
        window: int | None,
        *,
        query_prologue: HeadPrologue | None = None,
        key_prologue: HeadPrologue | None = None,
        output_gate: OutputGate | None = None,
    ) -> tuple[Float[Array, "tokens heads d"], PagedKVCache]:
        """Write this step's K/V of `layer` into its rows of the pages, then ragged paged attention.
        With `query_prologue` / `key_prologue`, `q` / `k` are raw projections that these normalize
        and rotate / scale; with `output_gate` the output comes gated (see `fuses_attention`).
        On a mesh the kernels run per device over its own heads (`shard_map`; plain jnp is
        partitioned by XLA)."""
        args = (q, k, v, query_prologue, key_prologue, output_gate)
        attend = functools.partial(PagedKVCache._attend_here, layer=layer, window=window)
        if not self.use_kernel or jax.sharding.get_abstract_mesh().empty:
            return attend(self, *args)
        axes = attention_head_axes(q.shape[1], k.shape[1])
        if axes is None:
            raise ValueError(
                f"the attention kernels need the {q.shape[1]} query heads and {k.shape[1]} KV heads split alike "
                "on the mesh; use the plain-jnp path (use_kernel=False) for this mesh"
            )
        heads, pages = P(None, axes, None), P(None, None, axes, None)
        cache = dataclasses.replace(self, k_pages=pages, v_pages=pages, batch=P())
        gate = None if output_gate is None else OutputGate(heads, P(axes))
        # check_vma=False: pallas_call outputs carry no varying-axes annotation
        return jax.shard_map(attend, in_specs=(cache, heads, heads, heads, P(), P(), gate), out_specs=(heads, cache),
                             check_vma=False)(self, *args)

    def _attend_here(self, q, k, v, query_prologue, key_prologue, output_gate, *, layer: int, window: int | None):
        """`attend` on the arrays as they are here (one device's heads under `shard_map`)."""
        batch = self._step_batch()
        table = self._layer_table(layer)
        blocks = None
        if self.fuses_attention and query_prologue is not None and key_prologue is not None:
            # The decode kernel's blocks decide who applies the query prologue (`write_kv_before_decode`).
            blocks = default_decode_blocks(q, self.k_pages, self.v_pages, *table.shape, window, after_write=True,
                                           interpret=self.interpret)
            k_pages, v_pages, q, query_prologue = write_kv_before_decode(
                self.k_pages, self.v_pages, k, v, self._slot_mapping(layer), q, key_prologue=key_prologue,
                query_prologue=query_prologue, blocks=blocks, interpret=self.interpret)
            written = dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)
        else:
            written = self.write(layer, k, v, key_prologue=key_prologue)
        out = ragged_paged_attention(
            q, written.k_pages, written.v_pages, batch.query_start, batch.seq_lens, table,
            window=window, use_kernel=self.use_kernel, decode_only=batch.decode_only, decode=batch.decode,
            decode_block_sizes=blocks, query_prologue=query_prologue, output_gate=output_gate,
            interpret=self.interpret,
        )
        return out, written

    def write(
        self, layer: int, k: Float[Array, "tokens kv_heads d"], v: Float[Array, "tokens kv_heads d"],
        *, key_prologue: HeadPrologue | None = None,
    ) -> PagedKVCache:
        """Write the step's K/V of `layer` (one row per flat token) into its rows of the pages. With
        `key_prologue`, `k` is the raw projection: normalized and rotated on the way in (in the write
        kernel when the cache fuses attention)."""
        k_pages, v_pages = write_kv(
            self.k_pages, self.v_pages, k, v, self._slot_mapping(layer), key_prologue=key_prologue,
            use_kernel=key_prologue is not None and self.fuses_attention, interpret=self.interpret,
        )
        return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)

    def _slot_mapping(self, layer: int) -> Int[Array, " tokens"]:
        """Each flat token's row in `layer`'s slot of the page arrays (-1: padding, not written)."""
        group, slot, slots, size = self.layer_group[layer], self.layer_slot[layer], self.slots, self.page_size
        mapping = self._step_batch().slot_mappings[group]
        return jnp.where(mapping >= 0, (mapping // size * slots + slot) * size + mapping % size, -1)

    def window_context(
        self, layer: int, end: Int[Array, " batch"], num_pages: int
    ) -> tuple[Float[Array, "batch c kv_heads d"], Float[Array, "batch c kv_heads d"], Int[Array, "batch c"]]:
        """Each sequence's cached K/V of `layer` over the `num_pages` logical pages that end with the
        one holding position `end - 1`, contiguous (`c = num_pages * page_size` rows), with each row's
        position; -1 marks rows at or past `end` and pages the sequence does not hold (released or
        never written). For a reader that attends over a window of the context (the drafter)."""
        size = self.page_size
        table = self._layer_table(layer)  # [batch, max_pages]
        first = jnp.maximum((end - 1) // size - (num_pages - 1), 0)
        logical = first[:, None] + jnp.arange(num_pages)[None, :]
        rows = jnp.take_along_axis(table, jnp.minimum(logical, table.shape[1] - 1), axis=1)
        rows = jnp.where(logical < table.shape[1], rows, -1)
        batch = end.shape[0]
        gather = lambda pages: pages[jnp.maximum(rows, 0)].reshape(batch, num_pages * size, *pages.shape[2:])
        positions = (logical[:, :, None] * size + jnp.arange(size)[None, None, :]).reshape(batch, -1)
        held = jnp.repeat(rows >= 0, size, axis=1)
        return gather(self.k_pages), gather(self.v_pages), jnp.where(held & (positions < end[:, None]), positions, -1)

    def _step_batch(self) -> PagedBatch:
        if self.batch is None:
            raise ValueError("the paged cache needs the step's PagedBatch (cache.with_batch(batch))")
        return self.batch

    def _layer_table(self, layer: int) -> Int[Array, "batch max_pages"]:
        """The step's page table of `layer`'s group, as rows of the page arrays (-1 stays -1)."""
        table = self._step_batch().page_tables[self.layer_group[layer]]
        return jnp.where(table >= 0, table * self.slots + self.layer_slot[layer], -1)
