"""The Beam forward pass: embed -> decoder layers -> norm -> lm_head -> fp32 soft-cap.

`BeamForCausalLM` is a Flax NNX module whose attribute paths are the HF checkpoint names
(`model.layers.3.mlp.experts.gate_up_proj`, ...). `forward(params, ...)` is the pure, jittable
function over its parameter state that the rest of the project calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from beam_jax.config import BeamConfig
from beam_jax.kv_cache import KVCache
from beam_jax.layers.decoder import DecoderLayer
from beam_jax.layers.linear import Embedding, Linear, linear
from beam_jax.layers.norm import RMSNorm

Params = nnx.State


class BeamModel(nnx.Module):
    def __init__(self, config: BeamConfig, *, dtype):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class BeamForCausalLM(nnx.Module):
    def __init__(self, config: BeamConfig, *, dtype=jnp.bfloat16):
        self.config = config
        self.model = BeamModel(config, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype)

    def __call__(
        self,
        tokens: Int[Array, "batch t"],
        positions: Int[Array, "batch t"],
        cache: KVCache | None = None,
        *,
        hidden_layers: tuple[int, ...] = (),
        return_routing: bool = False,
        logits_at: Int[Array, " n"] | None = None,
    ) -> ForwardOutput:
        config = self.config
        x = self.model.embed_tokens(tokens)
        hidden, routing = {}, []
        for i, layer in enumerate(self.model.layers):
            x, cache, expert_indices = layer(x, positions, cache)
            if i in hidden_layers:
                hidden[i] = x
            if expert_indices is not None and return_routing:
                routing.append(expert_indices.reshape(*tokens.shape, -1))
        if logits_at is not None:  # only these token positions need logits (a serving step's last tokens)
            x = x[:, logits_at]
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if config.tie_word_embeddings else self.lm_head.weight
        # Logits leave the head in the model dtype (as in the reference); the soft-cap runs in fp32.
        logits = linear(x, head[...]).astype(jnp.float32)
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return ForwardOutput(
            logits=logits, cache=cache, hidden_states=tuple(hidden[i] for i in hidden_layers), expert_indices=tuple(routing)
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: Float[Array, "batch t vocab"]
    cache: KVCache | None
    # The residual stream after each layer named in `hidden_layers`, in that order.
    hidden_states: tuple[Float[Array, "batch t hidden"], ...]
    # Selected experts `[batch, t, k]` of each sparse layer, in layer order (with return_routing).
    expert_indices: tuple[Int[Array, "batch t k"], ...]


@functools.lru_cache(maxsize=16)
def _abstract_model(config: BeamConfig, dtype_name: str):
    model = nnx.eval_shape(lambda: BeamForCausalLM(config, dtype=jnp.dtype(dtype_name)))
    return nnx.split(model)


def graphdef(config: BeamConfig) -> nnx.GraphDef:
    """The module structure; dtypes live in the parameters, so one graphdef serves every dtype."""
    return _abstract_model(config, "bfloat16")[0]


def abstract_params(config: BeamConfig, dtype=jnp.bfloat16) -> Params:
    """Parameter shapes and dtypes (`jax.ShapeDtypeStruct` leaves), allocating nothing."""
    return _abstract_model(config, jnp.dtype(dtype).name)[1]


def init_params(config: BeamConfig, seed: int = 0, dtype=jnp.bfloat16) -> Params:
    """Random parameters with the reference's initialisation: normal(0, initializer_range) for
    matrices and the router, ones for norms, zeros for biases (the router stays fp32).
    Drawn with numpy, which is much faster than compiling hundreds of small random ops."""
    if config.expert_format != "bf16":
        raise ValueError(
            f"random init draws bf16/fp32 weights; for {config.expert_format} experts, init a bf16 config "
            "and quantize it (beam_jax.quant.convert.quantize_params or `beam-jax quantize`)"
        )
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, leaf in abstract_flat(config, dtype).items():
        if name.endswith("norm.weight"):
            value = np.ones(leaf.shape, np.float32)
        elif name.endswith(("bias", "e_score_correction_bias")):
            value = np.zeros(leaf.shape, np.float32)
        else:
            value = rng.normal(0.0, config.initializer_range, leaf.shape).astype(np.float32)
        arrays[name] = jnp.asarray(value, leaf.dtype)
    return params_from_flat(config, arrays)


def abstract_flat(config: BeamConfig, dtype=jnp.bfloat16) -> dict[str, jax.ShapeDtypeStruct]:
    """`{HF name: ShapeDtypeStruct}` of every parameter."""
    return {param_name(path): leaf.get_value() for path, leaf in nnx.to_flat_state(abstract_params(config, dtype))}


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def flat_params(params: Params) -> dict[str, jax.Array]:
    """`{"model.layers.0.self_attn.q_proj.weight": array, ...}`: the HF checkpoint names."""
    return {param_name(path): leaf.get_value() for path, leaf in nnx.to_flat_state(params)}


def params_from_flat(config: BeamConfig, arrays: dict[str, jax.Array]) -> Params:
    """The inverse of `flat_params`: every expected name must be present (the loader checks)."""
    state = abstract_params(config)
    flat = [(path, leaf.replace(arrays[param_name(path)])) for path, leaf in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def forward(
    params: Params,
    tokens: Int[Array, "batch t"],
    positions: Int[Array, "batch t"],
    cache: KVCache | None = None,
    *,
    config: BeamConfig,
    hidden_layers: tuple[int, ...] = (),
    return_routing: bool = False,
    logits_at: Int[Array, " n"] | None = None,
) -> ForwardOutput:
    """The pure forward pass. Jit it with `config`, `hidden_layers`, `return_routing` static
    (`jit_forward` does). With a cache, the new keys/values are written at `positions` first.
    With a `beam_jax.paged_cache.PagedKVCache` (its `PagedBatch` set by `with_batch`), `tokens` and
    `positions` are one flat ragged step `[1, total_tokens]` that the batch metadata describes.
    `logits_at` (token indices along `t`) limits the head to those tokens: logits `[batch, n, vocab]`."""
    model = nnx.merge(graphdef(config), params)
    return model(
        tokens, positions, cache, hidden_layers=hidden_layers, return_routing=return_routing, logits_at=logits_at
    )


jit_forward = jax.jit(forward, static_argnames=("config", "hidden_layers", "return_routing"), donate_argnames=("cache",))
