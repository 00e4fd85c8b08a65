"""The notebook-facing API: `beam_jax.load(...)` returns a `Beam` with a jit-compiled forward.

    import beam_jax
    beam = beam_jax.load("beam-tiny")            # a preset (random weights) or a checkpoint dir
    out = beam.forward([[1, 2, 3]])              # ForwardOutput: logits [1, 3, vocab], ...
    beam.generate("def fib(n):", max_new_tokens=16)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from beam_jax.config import PRESETS, BeamConfig, preset
from beam_jax.generate import greedy_generate
from beam_jax.kv_cache import KVCache
from beam_jax.model import ForwardOutput, Params, abstract_flat, init_params, jit_forward
from beam_jax.sharding import shard_params
from beam_jax.tokenizer import STOP_TOKENS, load_tokenizer


RANDOM_PRESET_LIMIT_BYTES = 16 * 2**30  # random weights are drawn on the host


def default_dtype() -> jnp.dtype:
    """bf16 on accelerators; fp32 on CPU, where bf16 arithmetic is emulated and slower."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


@dataclasses.dataclass
class Beam:
    config: BeamConfig
    params: Params
    tokenizer: tokenizers.Tokenizer

    def forward(
        self,
        tokens,
        positions=None,
        cache: KVCache | None = None,
        *,
        hidden_layers: tuple[int, ...] = (),
        return_routing: bool = False,
    ) -> ForwardOutput:
        """Jit-compiled forward of `tokens` `[batch, t]` (positions default to 0..t-1)."""
        tokens = jnp.atleast_2d(jnp.asarray(tokens, jnp.int32))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        positions = jnp.atleast_2d(jnp.asarray(positions, jnp.int32))
        return jit_forward(
            self.params,
            tokens,
            positions,
            cache,
            config=self.config,
            hidden_layers=tuple(hidden_layers),
            return_routing=return_routing,
        )

    __call__ = forward

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def stop_token_ids(self) -> list[int]:
        ids = [self.tokenizer.token_to_id(t) for t in STOP_TOKENS]
        return [i for i in ids if i is not None]

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32) -> str | list[int]:
        """Greedy continuation: text in, text out; token ids in, token ids out."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in np.asarray(prompt).ravel()]
        [out] = greedy_generate(self.params, self.config, [ids], max_new_tokens, stop_token_ids=self.stop_token_ids)
        return self.decode(out) if isinstance(prompt, str) else out


def load(model: str | Path = "beam-tiny", *, dtype=None, seed: int = 0, mesh: jax.sharding.Mesh | None = None) -> Beam:
    """A preset name (random weights from `seed`) or a checkpoint directory (HF safetensors or
    orbax). The tokenizer is the directory's `tokenizer.json` if it has one, else the shipped one.
    With a `mesh` (`beam_jax.sharding.make_mesh`) the parameters are split over it; safetensors
    are read slice by slice, each process reading only what its devices hold."""
    dtype = default_dtype() if dtype is None else jnp.dtype(dtype)
    if str(model) in PRESETS:
        config = preset(str(model))
        size = sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in abstract_flat(config, dtype).values())
        if size > RANDOM_PRESET_LIMIT_BYTES:
            raise ValueError(
                f"preset {model!r} would need {size / 2**30:.0f} GiB of random weights; "
                "load a checkpoint directory instead (beam-jax init-checkpoint writes one for small presets)"
            )
        params = init_params(config, seed, dtype)
        return Beam(config, params if mesh is None else shard_params(params, mesh, config), load_tokenizer())
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"{model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
    from beam_jax.checkpoint import is_orbax_checkpoint, load_any

    sliced_read = mesh is not None and not is_orbax_checkpoint(path)  # orbax restores whole arrays
    config, params = load_any(path, dtype=dtype, **({"mesh": mesh} if sliced_read else {}))
    if mesh is not None:
        params = shard_params(params, mesh, config)  # keeps what the reader placed already
    tokenizer = load_tokenizer(path if (path / "tokenizer.json").exists() else None)
    return Beam(config, params, tokenizer)
