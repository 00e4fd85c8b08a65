"""Beam's NVFP4 MoE layer on the Mosaic GPU grouped GEMM (`nvfp4_mgpu.grouped_matmul`), Hopper only.

The weights are repacked once into the kernel's layouts (`KernelNvfp4.from_expert_weights`; the model
does it at load time on Hopper, `beam_jax.quant.kernel_layout`). At 1-7 tokens (1-8 on an H100) the whole layer is
one kernel on the pairs as they come (`nvfp4_fused_moe`). Otherwise per call the pairs are put into blocks
of one expert each (up to 8 tokens: one block per distinct expert, multiplying all the step's tokens; 9-64
tokens: blocks opened by the pairs, built and gathered by one kernel, `row_gather.gather_opened_blocks`;
larger batches: pairs sorted by XLA into blocks of `block_t` rows), and after
each GEMM XLA adds the K splits, applies the global scales, SwiGLU and the routing weights (with
`gate_up_epilogue` / `down_epilogue` and `gate_up_swiglu`, the GEMMs apply the scales and SwiGLU
themselves). Rounding follows `moe_gemm_reference`.

H200 (benchmarks/moe/RESULTS.md, session 26: the span of a call's kernels on the device): 58.4 / 77.2 / 88.0 /
136.3 / 154.7 / 168.4 / 185.7 us at T = 8 / 12 / 16 / 32 / 40 / 48 / 64 (62.0 / 68.2 / 76.3 / 76.8 / 74.5 / 79.0 /
81.2 % of the HBM floor), 2.73-3.61x faster than the bf16 layer in the same runs; at T = 1 19.2 us, and 16.2-16.3
in one launch (`nvfp4_fused_moe`, the default at 1-7 tokens since session 30: 24.2 / 30.0 / 35.1 / 41.1 / 46.8 /
54.2 us at T = 2-7 against 29.8 / 34.3 / 40.1 / 45.4 / 48.8 / 57.2). The two GEMMs are 90-98 % of the time at
T = 8-64."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import moe_gemm as mg
from pallas_kernels import nvfp4_fused_moe as nfm
from pallas_kernels import nvfp4_mgpu as nm
from pallas_kernels import row_gather as rg
from pallas_kernels.mgpu_tiles import device_kind, is_h100


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scales", "global_scale"],
                   meta_fields=["tile_k"])
@dataclasses.dataclass(frozen=True)
class KernelNvfp4:
    """One projection of every expert in the kernel's layouts (`nm.pack_weights`): `packed [E, K/tile_k, N,
    tile_k/2]` uint8, `scales [E, K/tile_k, N, tile_k/64]` uint32 (four one-byte codes of block scales a
    word), `global_scale [E, N]` fp32 per output row: one value per expert and projection, repeated over the
    projection's rows (the layer's XLA epilogues read each projection's first row only)."""

    packed: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    tile_k: int

    @classmethod
    def from_expert_weights(cls, *projections: mg.ExpertWeights, tile_k: int) -> KernelNvfp4:
        """NVFP4 `ExpertWeights` with the same K, their used rows stacked (gate then up for gate/up).
        The kernel needs tile_k a multiple of 64 dividing K, and rows in multiples of 64."""
        k, rows_total = projections[0].in_features, sum(w.num_rows for w in projections)
        if tile_k % nm.TILE_K_QUANTUM or k % tile_k or rows_total % 64:
            raise ValueError(f"the Mosaic NVFP4 kernel needs tile_k a multiple of {nm.TILE_K_QUANTUM} dividing "
                             f"K and rows in multiples of 64: K={k}, tile_k={tile_k}, rows={rows_total}")
        codes, scales, global_scale = [], [], []
        for w in projections:
            if w.format != "nvfp4":
                raise ValueError(f"KernelNvfp4 takes nvfp4 weights, got {w.format}")
            rows = slice(w.row_offset, w.row_offset + w.num_rows)
            codes.append(nm.checkpoint_codes(w.values[:, rows]))
            scales.append(w.scale[:, rows])
            global_scale.append(jnp.broadcast_to(w.global_scale[:, None], (w.values.shape[0], w.num_rows)))
        packed, scales = nm.pack_weights(jnp.concatenate(codes, 1), jnp.concatenate(scales, 1), tile_k)
        return cls(packed, scales, jnp.concatenate(global_scale, 1).astype(jnp.float32), tile_k)


def kernel_experts(gate: mg.ExpertWeights, up: mg.ExpertWeights, down: mg.ExpertWeights, *,
                   gate_up_tile_k: int = 256, down_tile_k: int = 64) -> tuple[KernelNvfp4, KernelNvfp4]:
    """gate/up and down in the kernel's layouts, as `moe_nvfp4` takes them."""
    return (KernelNvfp4.from_expert_weights(gate, up, tile_k=gate_up_tile_k),
            KernelNvfp4.from_expert_weights(down, tile_k=down_tile_k))


def pair_blocks(ids, num_experts: int, block_t: int):
    """Pairs sorted into blocks of one expert: (row of each pair, expert of each block (-1: unused),
    pair of each row (-1 for padding rows; `row_tokens` gives their tokens)). `ids == num_experts`
    marks another device's pair (expert parallelism): it gets no row (its pair_row is 0, read back
    and masked by the caller)."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    if tokens == 1:  # a token picks an expert once: one block per pair, no sort (XLA's sort and scatters
        # cost more than the GEMMs at one token: H200 run Q)
        pair_row = jnp.arange(top_k, dtype=jnp.int32) * block_t
        # The first row of each block is the pair, the rest padding: a constant (run R paid a fill and
        # a scatter, 1.3 us, for building it at run time).
        rows = np.arange(top_k * block_t)
        row_pair = jnp.asarray(np.where(rows % block_t == 0, rows // block_t, -1), jnp.int32)
        block_expert = jnp.where(ids[0] < num_experts, ids[0], -1).astype(jnp.int32)
        return pair_row, block_expert, row_pair
    num_blocks = rg.max_blocks(pairs, num_experts, block_t)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts + 1)  # the last entry counts other devices' pairs
    blocks_of = (-(-counts // block_t)).at[num_experts].set(0)
    first_pair = jnp.cumsum(counts) - counts
    first_block = jnp.cumsum(blocks_of) - blocks_of
    sorted_experts = flat[order]
    rank = jnp.arange(pairs) - first_pair[sorted_experts]
    sorted_rows = (first_block[sorted_experts] + rank // block_t) * block_t + rank % block_t
    # Other devices' pairs: a row past the end, which the scatters below drop.
    sorted_rows = jnp.where(sorted_experts < num_experts, sorted_rows, num_blocks * block_t)
    pair_row = jnp.zeros(pairs, jnp.int32).at[order].set(jnp.where(sorted_experts < num_experts, sorted_rows, 0))
    block_expert = jnp.full(num_blocks, -1, jnp.int32).at[sorted_rows // block_t].set(sorted_experts.astype(jnp.int32))
    row_pair = jnp.full(num_blocks * block_t, -1, jnp.int32).at[sorted_rows].set(order.astype(jnp.int32))
    return pair_row, block_expert, row_pair


def row_tokens(row_pair, top_k: int, tokens: int):
    """The token of each block row (`tokens`, a zero row, for padding) from its pair."""
    return jnp.where(row_pair >= 0, row_pair // top_k, tokens).astype(jnp.int32)


def _blocks_by_comparison(ids, num_experts: int, block_t: int):
    """`pair_blocks` without a sort or scatters, for decode batches: every quantity is a count over a
    [pairs, pairs] or [rows, pairs] comparison, a few XLA fusions where the sorted version is about a dozen
    small kernels (run Q: 17 us of XLA at T = 8). A pair's row follows from the pairs before it: its rank
    among its expert's pairs, and the blocks of lower experts, counted as the pairs that open a block (rank
    a multiple of block_t). Memory grows with pairs^2: meant for T <= 64. H200 (RESULTS.md, session 19): the
    layer took 155.0 us against 163.9 with sorted blocks at T = 32, and 207.4 against 215.8 at T = 64 (run D,
    counting blocks per expert over [experts, experts] and [blocks, experts]); counting from the pairs as
    here is as fast (run G: 150.2 against 149.8 at T = 32, 201.6 against 202.8 at T = 64; XLA makes 9 small
    kernels of either, ~12 us at T = 64)."""
    tokens, top_k = ids.shape
    pairs = tokens * top_k
    num_blocks = rg.max_blocks(pairs, num_experts, block_t)
    flat = ids.reshape(-1).astype(jnp.int32)
    p = jnp.arange(pairs)
    local = flat < num_experts  # `num_experts` marks another device's pair (see `pair_blocks`)
    rank = ((flat[None, :] == flat[:, None]) & (p[None, :] < p[:, None])).sum(1)  # earlier pairs, same expert
    opens = local & (rank % block_t == 0)
    first_block = ((flat[None, :] < flat[:, None]) & opens[None, :]).sum(1)  # blocks of lower experts
    row = jnp.where(local, (first_block + rank // block_t) * block_t + rank % block_t, -1)
    # A row holds one pair at most: the sum of (pair + 1) over its matches, less one, is that pair or -1.
    match = row[None, :] == jnp.arange(num_blocks * block_t)[:, None]
    row_pair = ((p + 1)[None, :] * match).sum(1).astype(jnp.int32) - 1
    block_pair = row_pair.reshape(num_blocks, block_t)[:, 0]  # a used block's first row is taken
    block_expert = jnp.where(block_pair >= 0, flat[jnp.maximum(block_pair, 0)], -1)
    return jnp.maximum(row, 0).astype(jnp.int32), block_expert.astype(jnp.int32), row_pair


def _shared_blocks(ids, num_experts: int, block_t: int):
    """Decode blocks that share their rows: block p is pair p's expert if no earlier pair has it (else
    -1: skipped), and every block multiplies all the step's tokens (`grouped_matmul(shared_rows=True)`),
    so there is no sort, no scatter and no activation gather; the weights of an expert picked twice
    are read once. Returns (output row of each pair: its expert's first pair times block_t plus its
    token; expert of each block (-1: unused); pair of each block row: the token's pair with the
    block's expert, -1 if it has none)."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    pair = jnp.arange(flat.shape[0])
    # One token picks an expert once; more tokens: the first pair with the same expert, by comparison.
    first = pair if tokens == 1 else jnp.argmax(flat[:, None] == flat[None, :], axis=1)
    block_expert = jnp.where((first == pair) & (flat < num_experts), flat, -1).astype(jnp.int32)
    picks = (ids[None, :, :] == block_expert[:, None, None]) & (block_expert >= 0)[:, None, None]  # [block, t, k]
    row_pair = jnp.where(picks.any(2), jnp.arange(tokens)[None, :] * top_k + jnp.argmax(picks, axis=2), -1)
    row_pair = jnp.pad(row_pair, ((0, 0), (0, block_t - tokens)), constant_values=-1).astype(jnp.int32)
    return (first * block_t + pair // top_k).astype(jnp.int32), block_expert, row_pair.reshape(-1)


SHARED_ROWS_MAX_TOKENS = 8
BLOCK_BUILDERS = ("shared", "sort", "compare", "opened")
PAIR_ORDER_MAX_BLOCK_T = 16  # the down GEMM stores a row at a time up to this many rows per block


def default_config(tokens: int, kind: str | None = None) -> dict:
    """The layer's settings by token count, each the faster one in a same-run comparison on one H200
    (benchmarks/moe/RESULTS.md; µs of the whole layer unless said; runs O-AA without a session are sessions 8-10),
    or on an H100 where `kind` (the device's, `device_kind()` where unset) is one and it measured otherwise.
    Blocks:
    - up to SHARED_ROWS_MAX_TOKENS tokens every block takes all the tokens (`_shared_blocks`: no gather, an
      expert's weights read once); from 9 to 64 one kernel opens a block per pair and gathers its rows
      (`rg.gather_opened_blocks`, where compare-and-count and the gather take seven kernels: 94.5 / 143.4
      against 101.4 / 149.6 at T = 16 / 32, session 22 run A), up to 16 tokens in programs of a fifth of the
      columns (79.0 / 91.7 against 81.1 / 93.8 at T = 12 / 16, slower at 24 / 32, run F), from 40 in compact
      slots, E + P/8 programs instead of one per pair (154.9 / 169.6 / 188.8 against 159.5 / 171.8 and
      compare-and-count's 194.6 at T = 40 / 48 / 64, session 24 run A; 156.3 / 169.9 / 188.3 against 158.0 /
      171.7 / 194.0 in session 25; below 37 tokens Beam's 256 experts leave no slot to drop; the pairs' ranks
      from one XLA kernel: 151.6-151.9 / 166.1-166.3 / 183.6-184.1 against 153.4 / 168.7 / 186.7 with three,
      session 28 run A); past 64 sorted (`pair_blocks`).
    - 8 rows (wgmma's narrowest N) up to 64 tokens, then 32 up to 1024 (T = 512: 389.6 against 516.5 with
      64 rows and 416.1 with 16, run AA), then 64 (128 were slower at T = 512 and 8192, run W).
    Gate/up GEMM:
    - 4 K splits at one token fill the GPU (7.3 against 11.5 for the GEMM, run O); one from 2 tokens on.
    - pipelines of 2 stages: half the shared memory fits twice the programs on an SM (65.2 against 72.2 at
      T = 8, run V).
    - programs of 64 rows up to 64 tokens (96 registers; 128 rows with the epilogue take 175: 223.1 against
      231.6 at T = 64, session 16), 128 from 65 to 1024 (2 % faster at T = 512, runs Z, AA).
    - up to 8 tokens each step decoded and multiplied in two K chunks (96 registers instead of 108: 60.9
      against 66.8 at T = 8, session 19 run D).
    - past one token it applies the global scales and SwiGLU itself (58.7 / 103.7 / 148.0 / 200.6 against
      60.5 / 104.4 / 149.7 / 202.9 at T = 8 / 16 / 32 / 64, session 20 run C).
    Down GEMM:
    - from 9 to 64 tokens programs of 256 rows, each K step decoded and multiplied in four 64-row pieces
      (74 registers instead of 106, a piece's wgmma running while the next decodes: 89.6 / 137.0 / 171.0 /
      193.1 against 92.5 / 141.2 / 176.0 / 200.2 at T = 16 / 32 / 48 / 64, session 23 run B; 77.9 against
      80.7 with 128 rows at T = 12, run C), with the pair-order epilogue (`row_destination`); with shared rows
      (2-8 tokens) and past 64, programs of 128 rows (the GEMM took 21.4 against 23.4 with 64 at T = 8, run T;
      the epilogue gains nothing with shared rows, session 17 run B); at one token 64.
    - pipelines of 2 stages past one token (K is 5 steps; 3 and 5 stages were slower, session 22 run B,
      session 23 run C), 4 at one token.
    One launch: at 1-7 tokens the whole layer is one kernel on the pairs as they come (`nvfp4_fused_moe`: 16.2-16.3
    us against 18.7-18.9 for the GEMMs and XLA's kernels between them at one token, spans, session 29 run F; 24.2
    / 30.0 / 35.1 / 41.1 / 46.8 / 54.2 against 29.8 / 34.3 / 40.1 / 45.4 / 48.8 / 57.2 at 2-7 tokens, session 30
    runs 6 and 8; at 8 60.9 against 58.8, though 1-8 % faster at the 8-token bucket with 5-7 real tokens, run 8).
    On an H100 at 8 tokens too (66.0 / 67.4 / 69.1-69.8 against 72.9 / 71.9 / 72.4, sessions 45 / 44 / 43).
    Launches: from 9 to 64 tokens both GEMMs launch as programmatic dependents, the down GEMM's weights
    streaming during the gate/up GEMM's last wave (spans of the layer's kernels, session 26 runs B-C: 77.2 / 88.0 /
    117.9 / 136.3 against 83.5 / 92.8 / 123.2 / 140.0 at T = 12 / 16 / 24 / 32; equal at 40-64); not at 8 (58.6
    against 58.4: the gate/up grid is one wave) or 1 (19.5 against 19.2)."""
    shared, small_blocks = tokens <= SHARED_ROWS_MAX_TOKENS, tokens <= 1024
    h100 = is_h100(device_kind() if kind is None else kind)
    builder = "shared" if shared else "opened" if tokens <= 64 else "sort"
    return dict(block_builder=builder,
                block_t=8 if tokens <= 64 else 32 if small_blocks else 64, gate_up_splits=4 if tokens == 1 else 1,
                gate_up_stages=2, gate_up_tile_n=128 if 64 < tokens <= 1024 else 64,
                down_tile_n=64 if tokens == 1 else 256 if not shared and tokens <= 64 else 128,
                down_stages=4 if tokens == 1 else 2, down_decode_row_chunks=4 if not shared and tokens <= 64 else 1,
                gate_up_decode_row_chunks=1, staging_buffers=1,
                gate_up_epilogue=tokens > 1, down_epilogue=not shared,
                gate_up_decode_chunks=2 if tokens <= 8 else 1, gate_up_swiglu=True,
                opened_program=dict(column_groups=5) if tokens <= 16 else dict(compact=True) if tokens >= 40 else {},
                pdl=not shared and tokens <= 64, fused=tokens <= 7 or (h100 and tokens == 8))


def _fused_layer(x, weights, ids, gate_up: KernelNvfp4, down: KernelNvfp4, expert_offset, matmul, counters,
                 **settings):
    """`moe_nvfp4(fused=True)`: `nfm.fused_decode_moe` on the pairs as they are (the kernel skips ids outside its
    experts: other devices' and masked pairs); no XLA kernel before it but the expert offset's subtraction
    (shared-row blocks of distinct experts, built by four XLA kernels, took ~4 us more at 2-4 tokens, session 30
    run 3)."""
    block_expert = ids.reshape(-1) if expert_offset is None else ids.reshape(-1) - expert_offset
    # The emulated GEMM (CPU tests) takes the emulated layer.
    fused_layer = nfm.fused_decode_moe if matmul is nm.grouped_matmul else nfm.fused_decode_moe_emulated
    out = fused_layer(x, block_expert, weights.reshape(-1), gate_up.packed, gate_up.scales, gate_up.global_scale,
                      down.packed, down.scales, down.global_scale, gate_up_tile_k=gate_up.tile_k,
                      down_tile_k=down.tile_k, counters=counters, **settings)
    if counters is None:
        return out[:ids.shape[0]].astype(x.dtype)
    out, counters = out
    return out[:ids.shape[0]].astype(x.dtype), counters


def moe_nvfp4(x, weights, ids, gate_up: KernelNvfp4, down: KernelNvfp4, *, block_t: int | None = None,
              gate_up_splits: int | None = None, gate_up_stages: int | None = None, gate_up_tile_n: int | None = None,
              down_tile_n: int | None = None, down_stages: int | None = None, block_builder: str | None = None,
              gate_up_epilogue: bool | None = None, down_epilogue: bool | None = None,
              gate_up_decode_chunks: int | None = None, gate_up_decode_row_chunks: int | None = None,
              down_decode_row_chunks: int | None = None, gate_up_swiglu: bool | None = None,
              staging_buffers: int | None = None, opened_program: dict | None = None, pdl: bool | None = None,
              expert_offset: int | jax.Array | None = None, fused: bool | None = None,
              counters: jax.Array | None = None, fused_settings: dict | None = None, matmul=nm.grouped_matmul):
    """Routed experts for NVFP4 weights: `x [T, H]` bf16, `weights`/`ids [T, top_k]`. `gate_up` holds
    gate rows then up rows. Unset settings come from `default_config`. `block_builder`: "shared"
    (`_shared_blocks`; its blocks have T rows rounded up to 8, whatever `block_t` says), "sort"
    (`pair_blocks`), "compare" (`_blocks_by_comparison`), "opened" (a block slot per pair, built and
    gathered by one kernel: `rg.gather_opened_blocks`, with `opened_program` its program shape).
    `gate_up_epilogue` / `down_epilogue`: that GEMM
    applies the global scales and writes bf16 (gate/up only with one K split; `grouped_matmul(global_scale=)`),
    and at decode the down GEMM writes each pair's row in pair order (`row_destination=`).
    `gate_up_decode_chunks` / `gate_up_decode_row_chunks`: the gate/up GEMM's `decode_chunks` / `decode_row_chunks`;
    `down_decode_row_chunks` the down GEMM's `decode_row_chunks`; `staging_buffers` both GEMMs'.
    `gate_up_swiglu`: the gate/up GEMM applies SwiGLU too (`grouped_matmul(swiglu=True)`; needs its epilogue,
    one K split and tile_k >= 256; unset, on wherever those hold). `pdl`: the GEMMs launch as programmatic
    dependents (`grouped_matmul(pdl=)`: gate/up "wait", down "prefetch", its weights streaming during the
    gate/up GEMM's last wave). `expert_offset`: the weights are one device's
    experts from that index on (expert parallelism); other pairs count zero.
    `fused` (shared-row blocks only, up to SHARED_ROWS_MAX_TOKENS tokens): the whole layer in one launch,
    `nvfp4_fused_moe.fused_decode_moe`, with the gate/up settings above that are set (its K splits:
    `gate_up_splits`) and the down GEMM's tile, stages and row chunks; unset, the kernel's own defaults (the
    epilogue, SwiGLU, staging and `pdl` settings are the two GEMMs' and do not apply). Unset, on at 1-7 tokens (1-8
    on an H100) with shared-row blocks where the kernel takes the shapes (`nfm.fits`). `fused_settings`: further keyword
    arguments of `fused_decode_moe` (e.g. `down_overlap`; unset: its defaults).
    `counters`: the fused kernel's (`nvfp4_fused_moe.fresh_counters()`), passed from call to call (e.g. layer to
    layer), which spares each fused call zeroing its own; then (output, counters) come back, the counters
    untouched where the layer is not the fused kernel.
    `matmul` is the GEMM (the kernel; tests on the CPU pass an emulation)."""
    tokens, top_k = ids.shape
    config = default_config(tokens)
    block_builder = config["block_builder"] if block_builder is None else block_builder
    if fused is None:  # the default where nothing asks for the two GEMMs' blocks
        fused = (config["fused"] and block_builder == "shared"
                 and nfm.fits(x.shape[1], down.tile_k, tokens))
    if fused_settings and not fused:
        raise ValueError(f"fused_settings {sorted(fused_settings)} are the one-launch kernel's, which this layer of "
                         f"{tokens} tokens does not run (fused=False)")
    if fused:
        if block_builder != "shared":
            raise ValueError(f"fused needs shared-row blocks (block_builder='shared'), got {block_builder!r}")
        # The fused kernel's own defaults where unset (its programs differ from the two GEMMs').
        settings = dict(splits=gate_up_splits, gate_up_stages=gate_up_stages, gate_up_tile_n=gate_up_tile_n,
                        gate_up_decode_chunks=gate_up_decode_chunks, down_stages=down_stages, down_tile_n=down_tile_n,
                        down_decode_row_chunks=down_decode_row_chunks)
        return _fused_layer(x, weights, ids, gate_up, down, expert_offset, matmul, counters,
                            **{key: value for key, value in settings.items() if value is not None},
                            **(fused_settings or {}))
    block_t = config["block_t"] if block_t is None else block_t
    if gate_up_splits is None:  # the default, where it divides gate/up's K steps (else fewer)
        gate_up_splits = math.gcd(config["gate_up_splits"], x.shape[1] // gate_up.tile_k)
    down_tile_n = config["down_tile_n"] if down_tile_n is None else down_tile_n
    down_stages = config["down_stages"] if down_stages is None else down_stages
    gate_up_stages = config["gate_up_stages"] if gate_up_stages is None else gate_up_stages
    gate_up_epilogue = config["gate_up_epilogue"] if gate_up_epilogue is None else gate_up_epilogue
    down_epilogue = config["down_epilogue"] if down_epilogue is None else down_epilogue
    gate_up_tile_n = config["gate_up_tile_n"] if gate_up_tile_n is None else gate_up_tile_n
    gate_up_decode_chunks = config["gate_up_decode_chunks"] if gate_up_decode_chunks is None else gate_up_decode_chunks
    if down_decode_row_chunks is None:  # the default, where it divides the down tile's 64-row pieces (else fewer)
        down_decode_row_chunks = math.gcd(config["down_decode_row_chunks"], down_tile_n // 64)
    if gate_up_decode_row_chunks is None:
        gate_up_decode_row_chunks = config["gate_up_decode_row_chunks"]
    staging_buffers = config["staging_buffers"] if staging_buffers is None else staging_buffers
    opened_program = config["opened_program"] if opened_program is None else opened_program
    pdl = config["pdl"] if pdl is None else pdl
    intermediate = down.packed.shape[1] * down.tile_k
    num_experts = gate_up.packed.shape[0]
    if block_builder not in BLOCK_BUILDERS:
        raise ValueError(f"block_builder must be one of {BLOCK_BUILDERS}, got {block_builder!r}")
    local_ids, local = mg._local_pairs(ids, expert_offset, num_experts)
    shared = block_builder == "shared"
    if shared:
        block_t = -(-tokens // 8) * 8
        pair_row, block_expert, row_pair = _shared_blocks(local_ids, num_experts, block_t)
        xs = x if tokens < 8 else jnp.pad(x, ((0, block_t - tokens), (0, 0)))  # under 8 rows the GEMM pads
    elif block_builder == "opened":
        xs, block_expert, row_pair = rg.gather_opened_blocks_on_backend(
            x, ids.reshape(-1), num_experts=num_experts, block_t=block_t,
            expert_offset=0 if expert_offset is None else expert_offset,  # (the kernel finds the local pairs)
            **opened_program)
        # A pair's row, where the layer reads rows back (none with the down GEMM's pair-order epilogue).
        pair_row = jnp.zeros(ids.size, jnp.int32).at[jnp.where(row_pair >= 0, row_pair, ids.size)].set(
            jnp.arange(row_pair.size, dtype=jnp.int32), mode="drop")
    else:
        build = _blocks_by_comparison if block_builder == "compare" and tokens > 1 else pair_blocks
        pair_row, block_expert, row_pair = build(local_ids, num_experts, block_t)
        xs = rg.gather_rows_on_backend(x, row_tokens(row_pair, top_k, tokens), block_expert, block_t=block_t)
    scaled_gate_up = gate_up_epilogue and gate_up_splits == 1  # else XLA adds the splits and scales
    if gate_up_swiglu is None:  # the default where the GEMM finishes its projections itself and takes SwiGLU
        gate_up_swiglu = config["gate_up_swiglu"] and scaled_gate_up and gate_up.tile_k >= nm.SWIGLU_MIN_TILE_K
    if gate_up_swiglu and not scaled_gate_up:
        raise ValueError("gate_up_swiglu needs the gate/up epilogue (gate_up_epilogue=True) and one K split, "
                         f"got gate_up_epilogue={gate_up_epilogue}, gate_up_splits={gate_up_splits}")
    gu = matmul(xs, block_expert, gate_up.packed, gate_up.scales, block_t=block_t, tile_k=gate_up.tile_k,
                splits=gate_up_splits, stages=gate_up_stages, tile_n=gate_up_tile_n,
                decode_chunks=gate_up_decode_chunks, decode_row_chunks=gate_up_decode_row_chunks, shared_rows=shared,
                global_scale=gate_up.global_scale if scaled_gate_up else None, swiglu=gate_up_swiglu,
                staging_buffers=staging_buffers, pdl="wait" if pdl else "off")
    if not scaled_gate_up:
        row_expert = jnp.maximum(jnp.repeat(block_expert, block_t), 0)  # unused rows: any expert, never read
        # One global scale per projection (gate, up): [rows, 2] gathered, not a row of N scales per row.
        projection_scale = gate_up.global_scale[:, ::intermediate][row_expert]
        gu = gu.sum(0).reshape(-1, 2, intermediate) * nm.OUTPUT_FACTOR * projection_scale[:, :, None]
        gu = gu.reshape(1, -1, 2 * intermediate).astype(x.dtype)
    act = gu[0] if gate_up_swiglu else mg._swiglu(gu[0, :, :intermediate], gu[0, :, intermediate:]).astype(x.dtype)
    down_gemm = functools.partial(matmul, act, block_expert, down.packed, down.scales, block_t=block_t,
                                  tile_k=down.tile_k, splits=1, stages=down_stages, tile_n=down_tile_n,
                                  decode_row_chunks=down_decode_row_chunks, staging_buffers=staging_buffers,
                                  pdl="prefetch" if pdl else "off")
    if not down_epilogue:
        # Only the pairs' rows are scaled and weighted (rows of unused blocks and padding are not).
        pair_expert = jnp.minimum(local_ids.reshape(-1), num_experts - 1)
        expert_out = down_gemm()[0][pair_row] * nm.OUTPUT_FACTOR * down.global_scale[pair_expert, :1]
    elif block_t <= PAIR_ORDER_MAX_BLOCK_T:
        # Decode blocks write each pair's row straight to its place, [pairs, H] in pair order: no more
        # rows than pairs (shared-row blocks hold a row for every token) and no gather after.
        expert_out = down_gemm(global_scale=down.global_scale, row_destination=row_pair.reshape(-1, block_t),
                               out_rows=ids.size)[0]
    else:
        expert_out = down_gemm(global_scale=down.global_scale)[0][pair_row]
    pair_out = (expert_out.astype(x.dtype).astype(jnp.float32) * weights.reshape(-1, 1)).astype(x.dtype)
    out = mg._add_token_pairs(pair_out, local, tokens)
    return out if counters is None else (out, counters)
