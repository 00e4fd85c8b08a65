"""Beam's configuration: a frozen dataclass that reads and writes HF `config.json` (`model_type: beam`).

Field names and defaults are those of `transformers.BeamConfig`, so one `config.json` serves both;
one field of ours (`mosaic_experts`, a load-time choice) is never written or read there.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
DENSE = "dense"
SPARSE = "sparse"
# Expert weight formats (everything else stays bf16, the router fp32).
EXPERT_FORMATS = ("bf16", "nvfp4", "fp8_channel", "fp8_tensor")
# How NVFP4 experts run on GPUs (`beam_jax.quant.kernel_layout.use_mosaic`), for `load(expert_kernel=)`.
EXPERT_KERNELS = ("auto", "mosaic", "triton")

# Fields of transformers.BeamConfig that matter only for training or HF plumbing: kept on a
# round trip through config.json so that nothing a user wrote is dropped.
_PASSTHROUGH_FIELDS = ("initializer_range", "use_cache", "attention_dropout", "output_router_logits")
# Fields of ours that config.json never holds.
NOT_HF_FIELDS = ("mosaic_experts",)


def default_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    """Every sixth layer runs full attention, and so does the last one."""
    types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_hidden_layers)]
    if types:
        types[-1] = FULL
    return tuple(types)


def default_mlp_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    dense = min(3, num_hidden_layers)
    return (DENSE,) * dense + (SPARSE,) * (num_hidden_layers - dense)


def default_rope_parameters() -> dict[str, dict[str, Any] | None]:
    return {SLIDING: {"rope_type": "default", "rope_theta": 10000.0}, FULL: None}


@dataclasses.dataclass(frozen=True)
class BeamConfig:
    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 20480
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = 512
    moe_intermediate_size: int = 2560
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    n_group: int | None = 8
    topk_group: int | None = 4
    routed_scaling_factor: float = 2.5
    final_logit_softcapping: float | None = 30.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # None means "the reference's default"; __post_init__ fills them in.
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    # Keyed by layer type; a None entry means that layer type runs without positional encoding.
    # Frozen into sorted (key, value) pairs so the config stays hashable.
    rope_parameters: Any = None
    # HF's `quantization_config` as the producer wrote it (ModelOpt or compressed-tensors), frozen
    # into nested tuples; None for bf16/fp32 checkpoints. `expert_format` reads it.
    quantization_config: Any = None
    initializer_range: float = 0.02
    use_cache: bool = True
    attention_dropout: float = 0.0
    output_router_logits: bool = False
    # Not an HF field (never read from or written to config.json): the NVFP4 experts' parameters are
    # in the Mosaic GPU kernel's layout (`beam_jax.quant.kernel_layout`, converted at load time), not
    # the checkpoint's.
    mosaic_experts: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        n = self.num_hidden_layers
        set_("layer_types", tuple(self.layer_types) if self.layer_types is not None else default_layer_types(n))
        set_(
            "mlp_layer_types",
            tuple(self.mlp_layer_types) if self.mlp_layer_types is not None else default_mlp_layer_types(n),
        )
        rope = self.rope_parameters if self.rope_parameters is not None else default_rope_parameters()
        set_("rope_parameters", _freeze(dict(rope)))
        if isinstance(self.quantization_config, dict):
            set_("quantization_config", _freeze(self.quantization_config))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        self.validate()

    def validate(self) -> None:
        problems = []
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            problems.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {n}")
        if len(self.mlp_layer_types) != n:
            problems.append(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, num_hidden_layers is {n}")
        if bad := sorted(set(self.layer_types) - {SLIDING, FULL}):
            problems.append(f"unknown layer_types {bad}; expected {SLIDING!r} or {FULL!r}")
        if bad := sorted(set(self.mlp_layer_types) - {DENSE, SPARSE}):
            problems.append(f"unknown mlp_layer_types {bad}; expected {DENSE!r} or {SPARSE!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (Beam uses 'silu')")
        if SPARSE in self.mlp_layer_types:
            if self.num_experts % self.num_groups:
                problems.append(f"num_experts ({self.num_experts}) is not a multiple of n_group ({self.n_group})")
            elif self.num_experts // self.num_groups < 2:
                problems.append("each routing group needs at least 2 experts (group score = sum of its top 2)")
            if not 1 <= self.groups_kept <= self.num_groups:
                problems.append(f"topk_group ({self.topk_group}) must be in [1, n_group={self.num_groups}]")
            if not 1 <= self.num_experts_per_tok <= self.groups_kept * (self.num_experts // self.num_groups):
                problems.append(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in the kept groups"
                )
        for layer_type, params in _thaw(self.rope_parameters).items():
            if params is not None and params.get("rope_type", "default") != "default":
                problems.append(f"rope_type {params['rope_type']!r} for {layer_type} is not supported")
        expert_format = None
        if self.quantization_config is not None:
            try:
                expert_format = self.expert_format
            except ValueError as error:
                problems.append(str(error))
        if self.mosaic_experts and expert_format != "nvfp4":
            problems.append("mosaic_experts (the Mosaic kernel's layout) applies to NVFP4 experts only")
        if problems:
            raise ValueError("invalid BeamConfig: " + "; ".join(problems))

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return self.n_group or 1

    @property
    def groups_kept(self) -> int:
        return self.topk_group or self.num_groups

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def expert_format(self) -> str:
        """One of EXPERT_FORMATS, read off `quantization_config`."""
        if self.quantization_config is None:
            return "bf16"
        qc = _thaw(self.quantization_config)
        method = qc.get("quant_method")
        if method == "modelopt":
            algo = str(qc.get("quant_algo", "")).upper()
            if algo == "NVFP4":
                if qc.get("group_size", 16) != 16:
                    raise ValueError(f"NVFP4 group_size {qc['group_size']} is not supported (16 is)")
                return "nvfp4"
            if algo == "FP8":
                return "fp8_tensor"
            if algo == "FP8_PER_CHANNEL_PER_TOKEN":
                return "fp8_channel"
            raise ValueError(f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported (NVFP4, FP8 are)")
        if method == "compressed-tensors":
            if self._experts_ignored(qc.get("ignore", ())):
                return "bf16"
            strategies = {g.get("weights", {}).get("strategy") for g in qc.get("config_groups", {}).values()}
            if strategies == {"channel"}:
                return "fp8_channel"
            if strategies == {"tensor"}:
                return "fp8_tensor"
            raise ValueError(f"compressed-tensors weight strategies {sorted(map(str, strategies))} are not supported")
        raise ValueError(f"quant_method {method!r} is not supported (modelopt, compressed-tensors are)")

    def _experts_ignored(self, ignore) -> bool:
        """compressed-tensors may leave the experts unquantized: does `ignore` (names, or `re:`
        patterns) cover an expert projection?"""
        sparse = [i for i in range(self.num_hidden_layers) if self.is_sparse(i)]
        if not sparse:
            return True
        expert = f"model.layers.{sparse[0]}.mlp.experts.0.gate_proj"
        return any(
            re.fullmatch(entry[3:], expert) if entry.startswith("re:") else entry == expert for entry in ignore
        )

    def rope_theta(self, layer_type: str) -> float | None:
        """RoPE base for a layer type, or None when that type runs without positional encoding."""
        params = _thaw(self.rope_parameters).get(layer_type)
        return None if params is None else float(params.get("rope_theta", 10000.0))

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_sparse(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    def window(self, layer: int) -> int | None:
        """Keys with `q_pos - k_pos < window` are visible; None means the whole causal history."""
        return self.sliding_window if self.is_sliding(layer) else None

    def replace(self, **changes) -> BeamConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json -----------------------------------------------------------------------
    def require_checkpoint_layout(self, action: str) -> None:
        """Refuse `action` (saving, ...) for a model whose experts were converted to the Mosaic
        kernel's layout: a checkpoint holds the producers' layout, which that model no longer has."""
        if self.mosaic_experts:
            raise ValueError(
                f"cannot {action}: the NVFP4 experts were converted to the Mosaic kernel's layout at load time "
                "(expert_kernel 'auto' on a Hopper GPU, or 'mosaic'); load the model with expert_kernel='triton' "
                "to keep the checkpoint layout"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        self.require_checkpoint_layout("write config.json")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NOT_HF_FIELDS}
        out["layer_types"] = list(self.layer_types)
        out["mlp_layer_types"] = list(self.mlp_layer_types)
        out["rope_parameters"] = _thaw(self.rope_parameters)
        if self.quantization_config is None:
            del out["quantization_config"]
        else:
            out["quantization_config"] = _thaw(self.quantization_config)
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        out["model_type"] = "beam"
        out["architectures"] = ["BeamForCausalLM"]
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> BeamConfig:
        if data.get("model_type", "beam") != "beam":
            raise ValueError(f"config.json has model_type {data['model_type']!r}, expected 'beam'")
        known = {f.name for f in dataclasses.fields(cls)} - set(NOT_HF_FIELDS)
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory_or_file: str | Path) -> BeamConfig:
        path = Path(directory_or_file)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_dict(json.loads(path.read_text()))


class _FrozenDict(tuple):
    """A JSON object as sorted (key, value) pairs: hashable, so the config can be a jit static."""


def _freeze(value):
    if isinstance(value, dict):
        return _FrozenDict(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple) and not isinstance(value, _FrozenDict):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, _FrozenDict):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# ---- presets -----------------------------------------------------------------------------------
def beam_501b() -> BeamConfig:
    """The released model (Beam-1.0-501B-A23B), served at a 1M-token context."""
    return BeamConfig(max_position_embeddings=1_048_576)


def beam_tiny() -> BeamConfig:
    """Every structural feature at toy size: dense and sparse layers, sliding and full attention
    with a window shorter than test prompts, GQA ratio 2, 4 routing groups of 4 experts."""
    return BeamConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=16,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        layer_types=(SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL),
        mlp_layer_types=(DENSE, SPARSE, SPARSE, DENSE, SPARSE, SPARSE),
        pad_token_id=0,
        eos_token_id=(5, 6),
    )


def beam_tp8_slice(num_hidden_layers: int = 8) -> BeamConfig:
    """What one GPU holds under TP8, as one unsharded model: 6 query heads and 1 KV head,
    expert intermediate 320, dense intermediate 2560, vocabulary split 8 ways. The layer
    pattern is Beam's first `num_hidden_layers` layers (full at every sixth, plus the last)."""
    real = beam_501b()
    return real.replace(
        vocab_size=real.vocab_size // 8,
        num_attention_heads=real.num_attention_heads // 8,
        num_key_value_heads=real.num_key_value_heads // 8,
        intermediate_size=real.intermediate_size // 8,
        moe_intermediate_size=real.moe_intermediate_size // 8,
        num_hidden_layers=num_hidden_layers,
        layer_types=default_layer_types(num_hidden_layers),
        mlp_layer_types=default_mlp_layer_types(num_hidden_layers),
    )


PRESETS = {"beam-501b": beam_501b, "beam-tiny": beam_tiny, "beam-tp8-slice": beam_tp8_slice}


def preset(name: str, **kwargs) -> BeamConfig:
    """A preset by name: `preset("beam-tp8-slice", num_hidden_layers=4)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](**kwargs)
