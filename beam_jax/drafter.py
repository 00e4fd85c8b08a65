"""The DFlash drafter: proposes a block of tokens in one forward pass from the target's hidden states.

Architecture (DFlash2 for Beam, as vLLM's `vllm/models/beam/nvidia/dflash2.py` serves
`DFlash2BeamDraftModel`; DFlash, the blog's drafter, is taken to be the same without convolutions and
selector, which is all BEAM_SPEC.md says of it):

  context (tokens the target has processed, one row per token):
    c = hidden_norm(fc(concat(target residual stream after each of `target_layer_ids`)))
    each layer i: K_i = RoPE(k_norm(k_proj_i(c)), pos), V_i = v_proj_i(c)      (`context_kv`)
  block (one step): tokens [anchor, mask, ..., mask] at positions P, P+1, ..., P+N, where the anchor
  is the last token the target accepted (not yet in the context) and `mask_token_id` fills the rest:
    x = embed(tokens)                               (the target's embedding, not the drafter's)
    each layer (pre-norm):
      h = input_layernorm(x); h, d = attention_conv.prepare(h)
      x = x + attention_conv.finish(attn(h), d)     (queries: the block; keys: context + block)
      h = post_attention_layernorm(x); h, d = mlp_conv.prepare(h)
      x = x + mlp_conv.finish(mlp(h), d)
    logits = softcap(lm_head(norm(x)))              (the target's lm_head; the drafter's soft-cap)
  Mask positions P+j (j >= 1) predict the token at their own position: draft j.
  Attention: GQA with q/k RMSNorm per head and NeoX RoPE, no output gate, no SSMax. NOT causal inside
  the block (every block token sees the whole block); a context key is visible iff it is before the
  anchor and within the sliding window (`q_pos - k_pos < window`).
  Block-local convolution (`GroupedConv`, `conv_kernel_size` taps): `y[t] = sum_tap (base[tap] +
  delta[t, tap, group]) * x[t - tap]`, taps reaching before the block's first token dropped; the
  per-token, per-channel-group `delta` comes from `kernel_projection` of the sublayer's normed input,
  one half for `prepare` (before the sublayer), the other for `finish` (after it).
  Candidate selector (`CandidateSelector`): the top `selector_top_k` tokens of each draft position's
  logits are rescored against the candidates one position back (the anchor for the first):
  `score[c | p] = logit[c] + <predecessor[p] * hidden_projection(h), successor[c]>`, and the drafts are
  a walk through these scores (greedy argmax, or a Gumbel draw at the request's temperature).

Parameter names are those vLLM's DFlash2 loader reads from the drafter checkpoint (no `model.` prefix;
`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, `layers.{i}.attention_conv.base_kernel`,
`candidate_selector.predecessor_codebook`, ...); the checkpoint ships no embedding and no lm_head.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, UInt32

from beam_jax.checkpoint.errors import CheckpointError
from beam_jax.checkpoint.reader import float_dtype, natural_key
from beam_jax.checkpoint.safetensors_io import SINGLE_FILE, SafetensorsCheckpoint, save_safetensors
from beam_jax.config import FULL, SLIDING
from beam_jax.layers.attention import attend
from beam_jax.layers.linear import Linear, linear
from beam_jax.layers.mlp import DenseMLP
from beam_jax.layers.norm import RMSNorm
from beam_jax.layers.rope import apply_rope, rope_cos_sin
from beam_jax.model import flat_params, param_name

Params = nnx.State
DFLASH2_ARCHITECTURE = "DFlash2BeamDraftModel"  # vLLM's registry name for Beam's DFlash2 drafter
DFLASH_ARCHITECTURE = "DFlashDraftModel"  # a drafter without convolutions and selector
# Keys of config.json's `dflash_config` that DrafterConfig reads (vLLM's names).
DFLASH_CONFIG_KEYS = (
    "target_layer_ids", "mask_token_id", "conv_kernel_size", "conv_group_size",
    "selector_rank", "selector_top_k", "final_logit_softcapping",
)


# ---- configuration --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """The drafter's config.json: Qwen3-style top-level fields plus `dflash_config`. Defaults are
    DFlash2 for Beam-501B where BEAM_SPEC.md gives them; `conv_group_size`, `selector_rank`,
    `selector_top_k`, `mask_token_id` and the RoPE base are not in the spec: the released
    config.json decides them (placeholders here)."""

    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 17408
    num_hidden_layers: int = 5
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] | None = None  # default: all sliding (DFlash2)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1_048_576
    initializer_range: float = 0.02
    # Query tokens per step: the anchor plus block_size - 1 drafts (DFlash2 serves 8; DFlash 16).
    block_size: int = 8
    # ---- dflash_config ----
    target_layer_ids: tuple[int, ...] = (4, 16, 28, 40, 46)
    mask_token_id: int | None = None
    conv_kernel_size: int | None = 2  # None: no block-local convolutions (DFlash)
    conv_group_size: int | None = 128
    selector_rank: int | None = 256  # None: no candidate selector (drafts are argmax / sampled)
    selector_top_k: int | None = 8
    final_logit_softcapping: float | None = 30.0

    def __post_init__(self):
        n = self.num_hidden_layers
        layer_types = (SLIDING,) * n if self.layer_types is None else tuple(self.layer_types)
        object.__setattr__(self, "layer_types", layer_types)
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids or ()))
        problems = []
        if len(layer_types) != n:
            problems.append(f"layer_types has {len(layer_types)} entries, num_hidden_layers is {n}")
        if bad := sorted(set(layer_types) - {SLIDING, FULL}):
            problems.append(f"unknown layer_types {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads is not a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2 (the anchor and a draft), got {self.block_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary")
        if self.has_convs and (not self.conv_group_size or self.hidden_size % self.conv_group_size):
            problems.append(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.has_selector and not self.selector_top_k:
            problems.append("selector_rank is set but selector_top_k is not")
        if problems:
            raise ValueError("invalid DrafterConfig: " + "; ".join(problems))

    @property
    def has_convs(self) -> bool:
        return bool(self.conv_kernel_size)

    @property
    def has_selector(self) -> bool:
        return bool(self.selector_rank)

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def replace(self, **changes) -> DrafterConfig:
        return dataclasses.replace(self, **changes)

    # ---- config.json ----
    def to_hf_dict(self) -> dict[str, Any]:
        top = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in DFLASH_CONFIG_KEYS}
        del top["rope_theta"]
        dflash = {key: getattr(self, key) for key in DFLASH_CONFIG_KEYS}
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        return top | {
            "layer_types": list(self.layer_types),
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "is_causal": False,
            "dflash_config": dflash,
            "architectures": [DFLASH2_ARCHITECTURE if self.has_convs or self.has_selector else DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        if data.get("is_causal", False) or (data.get("dflash_config") or {}).get("causal", False):
            raise ValueError("a causal DFlash drafter is not supported (DFlash attends non-causally in the block)")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {data['hidden_act']!r} is not supported")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known and k not in DFLASH_CONFIG_KEYS}
        rope = data.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
        if "rope_theta" in rope or "rope_theta" in data:
            values["rope_theta"] = float(rope.get("rope_theta", data.get("rope_theta")))
        dflash = data.get("dflash_config") or {}
        # vLLM's fallbacks: a top-level mask_token_id, dflash_config.swa_window_size for the window.
        if "mask_token_id" not in dflash and data.get("mask_token_id") is not None:
            dflash = dflash | {"mask_token_id": data["mask_token_id"]}
        if dflash.get("swa_window_size") is not None:
            values["sliding_window"] = dflash["swa_window_size"]
        for key in DFLASH_CONFIG_KEYS:
            # Absent convolution / selector keys mean the drafter has none (DFlash).
            values[key] = dflash.get(key) if key != "target_layer_ids" else dflash.get(key, data.get(key))
        return cls(**values)

    def save(self, directory: str | Path, dtype=None) -> Path:
        data = self.to_hf_dict()
        if dtype is not None:
            data |= {"dtype": np.dtype(dtype).name, "torch_dtype": np.dtype(dtype).name}
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory_or_file: str | Path) -> DrafterConfig:
        path = Path(directory_or_file)
        return cls.from_hf_dict(json.loads((path / "config.json" if path.is_dir() else path).read_text()))


def dflash2_beam() -> DrafterConfig:
    """DFlash2 for Beam-501B (BEAM_SPEC.md), with placeholders where the spec is silent."""
    return DrafterConfig()


def drafter_tiny() -> DrafterConfig:
    """A DFlash2 drafter for `beam-tiny` (hidden 64, vocabulary 8192, 6 layers): every feature at toy
    size, a window shorter than test contexts, the project tokenizer's `<|mask|>` (id 8)."""
    return DrafterConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
        max_position_embeddings=4096, block_size=4, target_layer_ids=(1, 3, 4), mask_token_id=8,
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
    )


# ---- modules (attribute paths are the checkpoint names) ---------------------------------------------
class DrafterAttention(nnx.Module):
    def __init__(self, config: DrafterConfig, layer: int, *, dtype):
        hidden, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.window = config.window(layer)
        self.rope_theta = config.rope_theta
        self.q_proj = Linear(hidden, config.num_attention_heads * d, dtype=dtype)
        self.k_proj = Linear(hidden, config.num_key_value_heads * d, dtype=dtype)
        self.v_proj = Linear(hidden, config.num_key_value_heads * d, dtype=dtype)
        self.o_proj = Linear(config.num_attention_heads * d, hidden, dtype=dtype)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)

    def keys_values(self, h: Float[Array, "batch t hidden"], positions: Int[Array, "batch t"]):
        """K (normed, rotated) and V of `h` at `positions`: for the block and for the context alike."""
        batch, t, _ = h.shape
        k = self.k_norm(self.k_proj(h).reshape(batch, t, -1, self.head_dim))
        k = apply_rope(k, *rope_cos_sin(positions, self.head_dim, self.rope_theta))
        return k, self.v_proj(h).reshape(batch, t, -1, self.head_dim)

    def __call__(
        self,
        h: Float[Array, "batch t hidden"],
        positions: Int[Array, "batch t"],
        context_keys: Float[Array, "batch c kv_heads d"],
        context_values: Float[Array, "batch c kv_heads d"],
        context_positions: Int[Array, "batch c"],
    ) -> Float[Array, "batch t hidden"]:
        batch, t, _ = h.shape
        q = self.q_norm(self.q_proj(h).reshape(batch, t, -1, self.head_dim))
        q = apply_rope(q, *rope_cos_sin(positions, self.head_dim, self.rope_theta))
        k, v = self.keys_values(h, positions)
        keys = jnp.concatenate([context_keys.astype(k.dtype), k], axis=1)
        values = jnp.concatenate([context_values.astype(v.dtype), v], axis=1)
        out = attend(q, keys, values, block_mask(positions, context_positions, self.window))
        return self.o_proj(out.reshape(batch, t, -1))


def block_mask(
    positions: Int[Array, "batch t"], context_positions: Int[Array, "batch c"], window: int | None
) -> Bool[Array, "batch t c_plus_t"]:
    """Keys `[context; block]` each block query sees. Context: before the anchor (`positions[:, 0]`;
    rows at or after it are stale) and `q_pos - k_pos < window`. Block: all of it (not causal), within
    the window both ways (as a non-causal sliding-window kernel). Negative positions are padding."""
    q = positions[:, :, None]
    ctx = context_positions[:, None, :]
    context = (ctx >= 0) & (ctx < positions[:, :1, None])
    block = jnp.broadcast_to(positions[:, None, :] >= 0, (*positions.shape, positions.shape[1]))
    if window is not None:
        context &= q - ctx < window
        block &= jnp.abs(q - positions[:, None, :]) < window
    return jnp.concatenate([context, block], axis=-1)


def grouped_conv(
    x: Float[Array, "batch t hidden"], delta: Float[Array, "batch t taps groups"], base: Float[Array, "taps hidden"]
) -> Float[Array, "batch t hidden"]:
    """`y[t] = sum_tap (base[tap] + delta[t, tap, channel group]) * x[t - tap]`, causal within the
    block (`t` indexes the block; taps before its start read zeros). fp32, rounded once."""
    _, t, hidden = x.shape
    taps, groups = delta.shape[2], delta.shape[3]
    coefficient = base.astype(jnp.float32)[None, None] + jnp.repeat(delta.astype(jnp.float32), hidden // groups, axis=-1)
    x32 = x.astype(jnp.float32)
    out = coefficient[:, :, 0] * x32
    for tap in range(1, taps):
        shifted = jnp.pad(x32[:, : max(t - tap, 0)], ((0, 0), (min(tap, t), 0), (0, 0)))
        out = out + coefficient[:, :, tap] * shifted
    return out.astype(x.dtype)


class GroupedConv(nnx.Module):
    """DFlash2's block-local convolution around a sublayer (`attention_conv`, `mlp_conv`)."""

    def __init__(self, config: DrafterConfig, *, dtype):
        self.taps = config.conv_kernel_size
        self.groups = config.hidden_size // config.conv_group_size
        # [side, tap, channel]: side 0 before the sublayer (prepare), side 1 after it (finish).
        self.base_kernel = nnx.Param(jnp.zeros((2, self.taps, config.hidden_size), dtype))
        self.kernel_projection = Linear(config.hidden_size, 2 * self.taps * self.groups, dtype=dtype)

    def prepare(self, h: Float[Array, "batch t hidden"]):
        """The convolved sublayer input and the `finish` half of this input's coefficients."""
        batch, t, _ = h.shape
        delta = self.kernel_projection(h).reshape(batch, t, 2, self.taps, self.groups)
        return grouped_conv(h, delta[:, :, 0], self.base_kernel[0]), delta[:, :, 1]

    def finish(self, out: Float[Array, "batch t hidden"], delta: Float[Array, "batch t taps groups"]):
        return grouped_conv(out, delta, self.base_kernel[1])


class DrafterLayer(nnx.Module):
    def __init__(self, config: DrafterConfig, layer: int, *, dtype):
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DrafterAttention(config, layer, dtype=dtype)
        self.mlp = DenseMLP(hidden, config.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.has_convs = config.has_convs
        if config.has_convs:
            self.attention_conv = GroupedConv(config, dtype=dtype)
            self.mlp_conv = GroupedConv(config, dtype=dtype)

    def __call__(self, x, positions, context_keys, context_values, context_positions):
        convs, delta = self.has_convs, None
        h = self.input_layernorm(x)
        if convs:
            h, delta = self.attention_conv.prepare(h)
        h = self.self_attn(h, positions, context_keys, context_values, context_positions)
        x = x + (self.attention_conv.finish(h, delta) if convs else h)
        h = self.post_attention_layernorm(x)
        if convs:
            h, delta = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        return x + (self.mlp_conv.finish(h, delta) if convs else h)


class CandidateSelector(nnx.Module):
    def __init__(self, config: DrafterConfig, *, dtype):
        rank = config.selector_rank
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nnx.Param(jnp.zeros((config.vocab_size, rank), dtype))
        self.successor_codebook = nnx.Param(jnp.zeros((config.vocab_size, rank), dtype))
        self.hidden_projection = Linear(config.hidden_size, rank, dtype=dtype)

    def edges(
        self,
        candidate_ids: Int[Array, "batch n k"],
        candidate_logits: Float[Array, "batch n k"],
        hidden: Float[Array, "batch n hidden"],
        anchor_tokens: Int[Array, " batch"],
    ) -> Float[Array, "batch n k k"]:
        """`score[b, l, p, c]`: candidate c at draft position l after candidate p at l - 1 (after the
        anchor at l = 0, whichever p)."""
        k = candidate_ids.shape[-1]
        predecessor_ids = jnp.concatenate(
            [jnp.broadcast_to(anchor_tokens[:, None, None], (anchor_tokens.shape[0], 1, k)), candidate_ids[:, :-1]],
            axis=1,
        )
        predecessors = jnp.take(self.predecessor_codebook[...], predecessor_ids, axis=0).astype(jnp.float32)
        successors = jnp.take(self.successor_codebook[...], candidate_ids, axis=0).astype(jnp.float32)
        projected = self.hidden_projection(hidden).astype(jnp.float32)
        pairwise = jnp.einsum("blpr,blcr->blpc", predecessors * projected[:, :, None], successors)
        return candidate_logits.astype(jnp.float32)[:, :, None, :] + pairwise


class Drafter(nnx.Module):
    def __init__(self, config: DrafterConfig, *, dtype=jnp.bfloat16):
        self.config = config
        hidden = config.hidden_size
        self.fc = Linear(hidden * len(config.target_layer_ids), hidden, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.layers = nnx.List([DrafterLayer(config, i, dtype=dtype) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        if config.has_selector:
            self.candidate_selector = CandidateSelector(config, dtype=dtype)


# ---- parameters -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _abstract_drafter(config: DrafterConfig, dtype_name: str):
    return nnx.split(nnx.eval_shape(lambda: Drafter(config, dtype=jnp.dtype(dtype_name))))


def graphdef(config: DrafterConfig) -> nnx.GraphDef:
    return _abstract_drafter(config, "bfloat16")[0]


def abstract_flat(config: DrafterConfig, dtype=jnp.bfloat16) -> dict[str, jax.ShapeDtypeStruct]:
    """`{checkpoint name: ShapeDtypeStruct}` of every drafter parameter."""
    state = _abstract_drafter(config, jnp.dtype(dtype).name)[1]
    return {param_name(path): leaf.get_value() for path, leaf in nnx.to_flat_state(state)}


def params_from_flat(config: DrafterConfig, arrays: dict[str, jax.Array]) -> Params:
    state = _abstract_drafter(config, "bfloat16")[1]
    return nnx.from_flat_state([(path, leaf.replace(arrays[param_name(path)])) for path, leaf in nnx.to_flat_state(state)])


def init_drafter_params(config: DrafterConfig, seed: int = 0, dtype=jnp.bfloat16) -> Params:
    """Random parameters: normal(0, initializer_range) matrices and codebooks, ones for norms, and
    convolutions that start as the identity (tap 0 weight 1) plus small random taps."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, leaf in abstract_flat(config, dtype).items():
        if name.endswith("norm.weight"):
            value = np.ones(leaf.shape, np.float32)
        else:
            value = rng.normal(0.0, config.initializer_range, leaf.shape).astype(np.float32)
            if name.endswith("base_kernel"):
                value[:, 0] += 1.0
        arrays[name] = jnp.asarray(value, leaf.dtype)
    return params_from_flat(config, arrays)


# ---- the pure forward -----------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """Every drafter layer's K/V of the context tokens (contiguous rows; the serving engine keeps the
    same rows in the paged pool instead). A negative position marks an empty row."""

    keys: Float[Array, "layers batch c kv_heads d"]
    values: Float[Array, "layers batch c kv_heads d"]
    positions: Int[Array, "batch c"]


class DraftOutput(NamedTuple):
    logits: Float[Array, "batch n vocab"]  # fp32, soft-capped: draft j (position P + 1 + j)
    hidden: Float[Array, "batch n hidden"]  # the final normed hidden state at the draft positions


class Proposal(NamedTuple):
    tokens: Int[Array, "batch n"]  # the drafts
    # What the drafts were drawn from, as logits: q = softmax(logits / temperature) (greedy rows: the
    # argmax). With the selector, the realized candidate scores and -inf off the candidates.
    logits: Float[Array, "batch n vocab"]


def context_kv(
    params: Params,
    target_hidden: Float[Array, "batch c hidden_times_layers"],
    positions: Int[Array, "batch c"],
    *,
    config: DrafterConfig,
) -> DraftContext:
    """The drafter's K/V for context tokens: `hidden_norm(fc(target_hidden))`, then each layer's k/v
    projection, k-norm and RoPE at the tokens' own positions. `target_hidden` is the target's residual
    stream after `config.target_layer_ids`, concatenated in that order:
    `jnp.concatenate(beam_jax.model.forward(..., hidden_layers=config.target_layer_ids).hidden_states, -1)`."""
    model = nnx.merge(graphdef(config), params)
    combined = model.hidden_norm(model.fc(target_hidden))
    pairs = [layer.self_attn.keys_values(combined, positions) for layer in model.layers]
    return DraftContext(jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs]), positions)


def _run_block(model: Drafter, tokens, positions, context: DraftContext, embed_weight, lm_head_weight) -> DraftOutput:
    x = jnp.take(embed_weight, tokens, axis=0)
    for i, layer in enumerate(model.layers):
        x = layer(x, positions, context.keys[i], context.values[i], context.positions)
    hidden = model.norm(x)[:, 1:]
    logits = linear(hidden, lm_head_weight).astype(jnp.float32)
    cap = model.config.final_logit_softcapping
    return DraftOutput(logits if cap is None else cap * jnp.tanh(logits / cap), hidden)


def draft_forward(
    params: Params,
    tokens: Int[Array, "batch t"],
    positions: Int[Array, "batch t"],
    context: DraftContext,
    *,
    embed_weight: Float[Array, "vocab hidden"],
    lm_head_weight: Float[Array, "vocab hidden"],
    config: DrafterConfig,
) -> DraftOutput:
    """One drafter pass over a block `[anchor, mask...]` at consecutive `positions` (see the module
    docstring). `embed_weight` and `lm_head_weight` are the target's (pass the embedding twice for a
    tied target). Returns the logits and hidden states of the mask positions `1..t-1`."""
    model = nnx.merge(graphdef(config), params)
    return _run_block(model, tokens, positions, context, embed_weight, lm_head_weight)


def _choose(scores: Float[Array, "batch k"], temperature, key_data) -> Int[Array, " batch"]:
    """argmax for greedy rows (temperature 0), a Gumbel-max draw from softmax(scores / T) otherwise."""
    best = jnp.argmax(scores, axis=-1)
    if key_data is None:
        return best
    noise = jax.vmap(lambda kd: jax.random.gumbel(jax.random.wrap_key_data(kd, impl="threefry2x32"), scores.shape[-1:]))
    sampled = jnp.argmax(scores / jnp.where(temperature > 0, temperature, 1.0)[:, None] + noise(key_data), axis=-1)
    return jnp.where(temperature > 0, sampled, best)


def propose(
    params: Params,
    anchor_tokens: Int[Array, " batch"],
    anchor_positions: Int[Array, " batch"],
    context: DraftContext,
    *,
    embed_weight: Float[Array, "vocab hidden"],
    lm_head_weight: Float[Array, "vocab hidden"],
    config: DrafterConfig,
    num_drafts: int | None = None,
    temperature: Float[Array, " batch"] | None = None,
    rng_key_data: UInt32[Array, "batch n 2"] | None = None,
) -> Proposal:
    """Draft `num_drafts` (default `config.num_drafts`) tokens after each row's anchor. Greedy unless
    `temperature` and `rng_key_data` (one key per row and draft: serving.speculative's DRAFT_STREAM)
    are given; rows with temperature 0 stay greedy."""
    if config.mask_token_id is None:
        raise ValueError("the drafter config has no mask_token_id")
    n = config.num_drafts if num_drafts is None else num_drafts
    batch = anchor_tokens.shape[0]
    tokens = jnp.concatenate([anchor_tokens[:, None], jnp.full((batch, n), config.mask_token_id, anchor_tokens.dtype)], 1)
    positions = anchor_positions[:, None] + jnp.arange(n + 1)[None, :]
    model = nnx.merge(graphdef(config), params)
    out = _run_block(model, tokens, positions, context, embed_weight, lm_head_weight)
    if temperature is None or rng_key_data is None:
        temperature, rng_key_data = jnp.zeros((batch,), jnp.float32), None
    key_at = (lambda j: None) if rng_key_data is None else (lambda j: rng_key_data[:, j])
    if not config.has_selector:
        drafts = jnp.stack([_choose(out.logits[:, j], temperature, key_at(j)) for j in range(n)], axis=1)
        return Proposal(drafts.astype(jnp.int32), out.logits)

    candidate_logits, candidate_ids = jax.lax.top_k(out.logits, model.candidate_selector.top_k)
    edges = model.candidate_selector.edges(candidate_ids, candidate_logits, out.hidden, anchor_tokens)
    rows = jnp.arange(batch)
    previous = jnp.zeros((batch,), jnp.int32)  # at l = 0 every predecessor row is the anchor's
    drafts, realized = [], []
    for j in range(n):  # n is small (a block): unrolled, each step one [batch, k] choice
        scores = edges[rows, j, previous]
        previous = _choose(scores, temperature, key_at(j)).astype(jnp.int32)
        drafts.append(candidate_ids[rows, j, previous])
        realized.append(scores)
    realized = jnp.stack(realized, axis=1)
    logits = jnp.full(out.logits.shape, -jnp.inf, jnp.float32)
    logits = logits.at[rows[:, None, None], jnp.arange(n)[None, :, None], candidate_ids].set(realized)
    return Proposal(jnp.stack(drafts, axis=1).astype(jnp.int32), logits)


jit_propose = jax.jit(propose, static_argnames=("config", "num_drafts"))


# ---- checkpoints ----------------------------------------------------------------------------------
def save_drafter(directory: str | Path, config: DrafterConfig, params: Params, *, dtype=None) -> Path:
    """config.json and one `model.safetensors` with vLLM's drafter names (the drafter is small: one
    file). `dtype=None` keeps the parameters' dtype."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    flat = flat_params(params)
    if flat.keys() != abstract_flat(config).keys():
        raise ValueError(f"params do not match the config: {sorted(flat.keys() ^ abstract_flat(config).keys())[:5]}")
    stored = float_dtype(dtype if dtype is not None else flat["fc.weight"].dtype)
    tensors = {name: np.asarray(jax.device_get(flat[name])).astype(stored) for name in sorted(flat, key=natural_key)}
    save_safetensors(directory / SINGLE_FILE, tensors)
    config.save(directory, stored)
    return directory


# Shared with the target, never the drafter's own: a checkpoint that ships them is read without them.
_TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")


def load_drafter(path: str | Path, dtype=None) -> tuple[DrafterConfig, Params]:
    """Read a drafter checkpoint (directory with config.json and safetensors, single or sharded).
    Names may carry a `model.` prefix. Every missing, unexpected or misshapen tensor is reported in
    one `CheckpointError` before anything is read. `dtype=None` keeps the checkpoint's dtype."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    config = DrafterConfig.load(directory)
    with SafetensorsCheckpoint(path) as checkpoint:
        names = {name.removeprefix("model."): name for name in checkpoint.tensors}
        expected = abstract_flat(config)
        problems = [f"{name}: expected {list(spec.shape)}, found nothing (missing)"
                    for name, spec in expected.items() if name not in names]
        for name, stored in names.items():
            info = checkpoint.tensors[stored]
            if name in expected and info.shape != tuple(expected[name].shape):
                problems.append(f"{stored}: expected {list(expected[name].shape)}, found {list(info.shape)}")
            elif name not in expected and name not in _TARGET_OWNED:
                problems.append(f"{stored}: expected no such tensor, found {info.code}{list(info.shape)} (unknown name)")
        if problems:
            raise CheckpointError(f"{path}: does not match the drafter config", sorted(problems, key=natural_key))
        target = float_dtype(dtype if dtype is not None else checkpoint.tensors[names["fc.weight"]].dtype)
        arrays = {name: jnp.asarray(np.asarray(checkpoint.get(names[name])).astype(target)) for name in expected}
    return config, params_from_flat(config, arrays)
