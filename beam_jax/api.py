"""The notebook-facing API: `beam_jax.load(...)` returns a `Beam` with a jit-compiled forward.

    import beam_jax
    beam = beam_jax.load("beam-tiny")            # a preset (random weights) or a checkpoint dir
    out = beam.forward([[1, 2, 3]])              # ForwardOutput: logits [1, 3, vocab], ...
    beam.generate("def fib(n):", max_new_tokens=16)
    beam = beam_jax.load("beam-tiny", quantization="nvfp4")  # bf16 experts quantized at load time
    beam = beam_jax.load(path, expert_kernel="mosaic")   # NVFP4 experts for the Mosaic kernel (default on Hopper)
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
# Trained checkpoints that ship inside the package, loadable by name.
SHIPPED_MODELS = {"beam-tiny-code": Path(__file__).parent / "assets" / "beam-tiny-code"}
# Shipped speculative-decoding drafters by name (`beam-serve --draft-model NAME`): the DFlash drafter
# distilled for beam-tiny-code (beam_jax/train/distill.py).
SHIPPED_DRAFTERS = {"beam-tiny-code-dflash": Path(__file__).parent / "assets" / "beam-tiny-code-dflash"}


def checkpoint_dir(model: str | Path) -> Path | None:
    """The directory a model name or path stands for (a shipped model's by name); None for presets
    and paths that are not directories."""
    if str(model) in SHIPPED_MODELS:
        return SHIPPED_MODELS[str(model)]
    path = Path(model)
    return path if str(model) not in PRESETS and path.is_dir() else None


# Load-time quantization of bf16 experts (`load(..., quantization=)`, `beam-serve --quantization`):
# the method -> the expert format it makes (as `beam-jax quantize --format`: fp8 is compressed-tensors'
# per-channel FP8_DYNAMIC), and the stored formats that already are that method.
QUANTIZATIONS = {"fp8": "fp8_channel", "nvfp4": "nvfp4"}
_ALREADY = {"fp8": ("fp8_channel", "fp8_tensor"), "nvfp4": ("nvfp4",)}


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


def quantized_expert_format(config: BeamConfig, quantization: str | None) -> str:
    """The experts' format once `load(..., quantization=)` has run: as stored without a method; a
    bf16 model's becomes the method's; a quantized checkpoint keeps its format if it already is the
    method's (fp8: either FP8 layout) and is refused otherwise (its bf16 original is not there)."""
    if quantization is None:
        return config.expert_format
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(sorted(QUANTIZATIONS))} or None, not {quantization!r}"
        )
    stored = config.expert_format
    if stored == "bf16":
        return QUANTIZATIONS[quantization]
    if stored not in _ALREADY[quantization]:
        raise ValueError(
            f"the checkpoint's experts are already quantized ({stored}); quantization {quantization!r} "
            "applies to bf16 experts only: load it without a quantization, or quantize its bf16 original"
        )
    return stored


def quantize(beam: Beam, quantization: str | None) -> Beam:
    """`beam` with its bf16 experts quantized by `quantization` ("fp8" or "nvfp4"; None: unchanged),
    with the project's quantizer (`beam_jax.quant.convert.quantize_params`, what `beam-jax quantize`
    writes: weight scales from the weights, no calibration). A model already in that format is
    returned as it is. The quantizer works on the host one layer at a time and places the results
    on the default device (`shard_params` splits them over a mesh afterwards)."""
    from beam_jax.quant.convert import quantize_params

    expert_format = quantized_expert_format(beam.config, quantization)
    if expert_format == beam.config.expert_format:
        return beam
    config, params = quantize_params(beam.config, beam.params, expert_format)
    return Beam(config, params, beam.tokenizer)


def convert_experts(
    beam: Beam, expert_kernel: str = "auto", mesh: jax.sharding.Mesh | None = None, *, own_params: bool = False
) -> Beam:
    """`beam` with its NVFP4 experts repacked for the Mosaic GPU kernel where `expert_kernel` says
    so (`beam_jax.quant.kernel_layout.use_mosaic`: "auto" on Hopper GPUs when the shapes fit,
    "mosaic" always, "triton" never), else `beam` itself. `mesh`: the one the model runs on (its
    local shapes must fit the kernel). `own_params`: `beam`'s checkpoint-layout expert arrays are
    deleted as they are converted, so that the two layouts never coexist beyond one layer; else they
    are left to the caller."""
    from beam_jax.quant.kernel_layout import to_kernel_layout, use_mosaic

    if not use_mosaic(beam.config, expert_kernel, mesh):
        return beam
    config, params = to_kernel_layout(beam.config, beam.params, mesh, delete_checkpoint_layout=own_params)
    return Beam(config, params, beam.tokenizer)


def load(
    model: str | Path = "beam-tiny",
    *,
    dtype=None,
    seed: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    quantization: str | None = None,
    expert_kernel: str = "auto",
) -> Beam:
    """A preset name (random weights from `seed`), a shipped model's name (`SHIPPED_MODELS`:
    `beam-tiny-code`, trained) or a checkpoint directory (HF safetensors or orbax). The tokenizer is the directory's `tokenizer.json` if it has one, else the shipped one.
    With a `mesh` (`beam_jax.sharding.make_mesh`) the parameters are split over it; safetensors
    are read slice by slice, each process reading only what its devices hold. `quantization`
    ("fp8", "nvfp4") quantizes bf16 experts as they load (`quantize`); the whole model is then
    read onto one device before it is quantized and split. `expert_kernel` ("auto", "mosaic",
    "triton") says whether NVFP4 experts are repacked for the Mosaic GPU kernel once loaded
    (`convert_experts`; "auto": on Hopper GPUs where the shapes fit). Such a model cannot be saved."""
    from beam_jax.quant.convert import quantization_config_for
    from beam_jax.quant.kernel_layout import use_mosaic

    def check_expert_kernel(config: BeamConfig) -> None:  # a forced kernel that cannot run fails before loading
        expert_format = quantized_expert_format(config, quantization)
        if expert_format != config.expert_format:
            config = config.replace(quantization_config=quantization_config_for(config, expert_format))
        use_mosaic(config, expert_kernel, mesh)

    dtype = default_dtype() if dtype is None else jnp.dtype(dtype)
    if str(model) in PRESETS:
        config = preset(str(model))
        size = sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in abstract_flat(config, dtype).values())
        if size > RANDOM_PRESET_LIMIT_BYTES:
            raise ValueError(
                f"preset {model!r} would need {size / 2**30:.0f} GiB of random weights; "
                "load a checkpoint directory instead (beam-jax init-checkpoint writes one for small presets)"
            )
        check_expert_kernel(config)  # so does a bad quantization method, before the weights are drawn
        beam = quantize(Beam(config, init_params(config, seed, dtype), load_tokenizer()), quantization)
        if mesh is not None:
            beam.params = shard_params(beam.params, mesh, beam.config)
        return convert_experts(beam, expert_kernel, mesh, own_params=True)
    path = checkpoint_dir(model)
    if path is None:
        names = ", ".join(sorted(PRESETS) + sorted(SHIPPED_MODELS))
        raise FileNotFoundError(f"{model!r} is neither a model name ({names}) nor a directory")
    from beam_jax.checkpoint import is_orbax_checkpoint, load_any, read_config

    stored = read_config(path)
    quantizing = quantized_expert_format(stored, quantization) != stored.expert_format  # refused before loading
    check_expert_kernel(stored)
    # orbax restores whole arrays; experts about to be quantized are read whole too.
    sliced_read = mesh is not None and not is_orbax_checkpoint(path) and not quantizing
    config, params = load_any(path, dtype=dtype, **({"mesh": mesh} if sliced_read else {}))
    tokenizer = load_tokenizer(path if (path / "tokenizer.json").exists() else None)
    beam = quantize(Beam(config, params, tokenizer), quantization)
    if mesh is not None:
        beam.params = shard_params(beam.params, mesh, beam.config)  # keeps what the reader placed already
    return convert_experts(beam, expert_kernel, mesh, own_params=True)
