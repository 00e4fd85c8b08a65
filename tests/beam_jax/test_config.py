"""BeamConfig: the presets' structure and sizes, config.json round trips, validation, and (one
reference-marked test) agreement with transformers.BeamConfig."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import pytest
from flax import nnx

from beam_jax.config import DENSE, FULL, NOT_HF_FIELDS, SLIDING, SPARSE, BeamConfig, preset
from beam_jax.model import abstract_params


def param_shapes(config: BeamConfig) -> dict[str, tuple[int, ...]]:
    """`{HF name: shape}` from the abstract parameters: nothing is allocated."""
    shapes = {}
    for path, leaf in nnx.to_flat_state(abstract_params(config)):
        value = leaf.get_value()
        assert isinstance(value, jax.ShapeDtypeStruct), f"{path} was allocated"
        shapes[".".join(map(str, path))] = tuple(value.shape)
    return shapes


# ---- beam-501b ----------------------------------------------------------------------------------
def test_beam_501b_has_501_3b_parameters_23_4b_active():
    config = preset("beam-501b")
    sizes = {name: math.prod(shape) for name, shape in param_shapes(config).items()}
    total = sum(sizes.values())
    experts = sum(n for name, n in sizes.items() if ".mlp.experts." in name)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    assert total == pytest.approx(501.3e9, rel=0.005), f"{total / 1e9:.2f}B"
    assert active == pytest.approx(23.4e9, rel=0.01), f"{active / 1e9:.2f}B"
    # Embedding and head are separate (untied) and counted in both.
    assert sizes["model.embed_tokens.weight"] == sizes["lm_head.weight"] == 151936 * 5120


def test_beam_501b_layer_pattern():
    config = preset("beam-501b")
    full = [i for i, t in enumerate(config.layer_types) if t == FULL]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 51]
    assert config.layer_types.count(SLIDING) == 43 and len(config.layer_types) == 52
    assert config.mlp_layer_types == (DENSE,) * 3 + (SPARSE,) * 49
    assert [config.window(i) for i in (0, 5, 50, 51)] == [512, None, 512, None]


def test_beam_501b_matches_the_spec_table():
    config = preset("beam-501b")
    expected = dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=20480,
        moe_intermediate_size=2560,
        num_hidden_layers=52,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        sliding_window=512,
        rms_norm_eps=1e-6,
        final_logit_softcapping=30.0,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        max_position_embeddings=1_048_576,
    )
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.to_hf_dict()["rope_parameters"] == {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: None,
    }
    shapes = param_shapes(config)
    assert shapes["model.layers.3.mlp.gate.weight"] == (256, 5120)
    assert shapes["model.layers.0.self_attn.gate_proj.weight"] == (6144, 5120)
    assert shapes["model.layers.0.self_attn.gate_bias"] == (48,)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)


# ---- beam-tiny ----------------------------------------------------------------------------------
def test_beam_tiny_has_every_structural_feature():
    config = preset("beam-tiny")
    assert {DENSE, SPARSE} <= set(config.mlp_layer_types)
    assert {SLIDING, FULL} <= set(config.layer_types)
    assert config.sliding_window < 37  # shorter than test prompts
    assert config.num_attention_heads // config.num_key_value_heads > 1
    assert config.num_groups >= 2 and config.groups_kept < config.num_groups
    # Sliding layers come dense and sparse, full layers sparse.
    pairs = set(zip(config.layer_types, config.mlp_layer_types, strict=True))
    assert {(SLIDING, DENSE), (SLIDING, SPARSE), (FULL, SPARSE)} <= pairs
    assert sum(math.prod(s) for s in param_shapes(config).values()) < 10_000_000


# ---- beam-tp8-slice -----------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [1, 4, 8, 13])
def test_beam_tp8_slice_per_gpu_shapes(layers):
    config = preset("beam-tp8-slice", num_hidden_layers=layers)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 1, 128)
    assert (config.moe_intermediate_size, config.intermediate_size) == (320, 2560)
    assert config.vocab_size == 151936 // 8 == 18992
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok) == (5120, 256, 8)
    assert config.num_hidden_layers == len(config.layer_types) == len(config.mlp_layer_types) == layers
    # Beam's layer pattern, cut to `layers` (the last layer runs full attention).
    real = preset("beam-501b")
    assert config.layer_types[:-1] == real.layer_types[: layers - 1] and config.layer_types[-1] == FULL
    assert config.mlp_layer_types == real.mlp_layer_types[:layers]
    shapes = param_shapes(config)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (18992, 5120)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (6 * 128, 5120)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (128, 5120)
    assert shapes["model.layers.0.self_attn.gate_bias"] == (6,)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (2560, 5120)
    if layers > 3:
        assert shapes["model.layers.3.mlp.experts.gate_up_proj"] == (256, 2 * 320, 5120)
        assert shapes["model.layers.3.mlp.experts.down_proj"] == (256, 5120, 320)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'beam-huge'"):
        preset("beam-huge")


# ---- config.json --------------------------------------------------------------------------------
CUSTOM = BeamConfig(
    vocab_size=311,
    hidden_size=42,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=10,
    num_experts=12,
    num_experts_per_tok=3,
    n_group=3,
    topk_group=2,
    sliding_window=8,
    layer_types=(SLIDING, FULL, SLIDING, FULL),
    mlp_layer_types=(DENSE, SPARSE, SPARSE, DENSE),
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 5e5}, FULL: None},
    eos_token_id=[5, 7],
    final_logit_softcapping=None,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    "config",
    [preset("beam-501b"), preset("beam-tiny"), preset("beam-tp8-slice", num_hidden_layers=5), CUSTOM],
    ids=["501b", "tiny", "tp8-slice", "custom"],
)
def test_config_json_round_trip(config, tmp_path):
    path = config.save(tmp_path / "model")
    assert path == tmp_path / "model" / "config.json"
    data = json.loads(path.read_text())
    assert data["model_type"] == "beam" and data["architectures"] == ["BeamForCausalLM"]
    assert data["layer_types"] == list(config.layer_types)
    loaded = BeamConfig.load(tmp_path / "model")
    assert loaded == config
    assert BeamConfig.load(path) == config
    assert hash(loaded) == hash(config)  # usable as a static jit argument


def test_custom_fields_survive_the_round_trip(tmp_path):
    CUSTOM.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["rope_parameters"] == {SLIDING: {"rope_type": "default", "rope_theta": 5e5}, FULL: None}
    assert data["eos_token_id"] == [5, 7] and data["final_logit_softcapping"] is None
    loaded = BeamConfig.load(tmp_path)
    assert loaded.rope_theta(SLIDING) == 5e5 and loaded.rope_theta(FULL) is None
    assert loaded.eos_token_id == (5, 7) and loaded.tie_word_embeddings


def test_from_hf_dict_rejects_another_model_type():
    with pytest.raises(ValueError, match="model_type 'llama'"):
        BeamConfig.from_hf_dict({"model_type": "llama"})


# ---- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_hidden_layers=5), "layer_types has 6 entries, num_hidden_layers is 5"),
        (dict(layer_types=(SLIDING,) * 5 + ("linear_attention",)), r"unknown layer_types \['linear_attention'\]"),
        (dict(mlp_layer_types=(DENSE,) * 5), "mlp_layer_types has 5 entries, num_hidden_layers is 6"),
        (dict(mlp_layer_types=(DENSE,) * 5 + ("shared",)), r"unknown mlp_layer_types \['shared'\]"),
        (dict(num_attention_heads=6, num_key_value_heads=4), r"num_attention_heads \(6\) is not a multiple of"),
        (dict(num_experts=18, n_group=4), r"num_experts \(18\) is not a multiple of n_group \(4\)"),
        (dict(topk_group=5), r"topk_group \(5\) must be in \[1, n_group=4\]"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(rope_parameters={SLIDING: {"rope_type": "yarn"}, FULL: None}), "rope_type 'yarn'"),
    ],
)
def test_invalid_configs_raise_naming_the_problem(changes, message):
    with pytest.raises(ValueError, match=message):
        preset("beam-tiny").replace(**changes)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as error:
        preset("beam-tiny").replace(num_hidden_layers=5, num_key_value_heads=3)
    assert "layer_types has 6 entries" in str(error.value)
    assert "mlp_layer_types has 6 entries" in str(error.value)
    assert "not a multiple of num_key_value_heads" in str(error.value)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset("beam-tiny").hidden_size = 3


# ---- transformers.BeamConfig ------------------------------------------------------------------
@pytest.mark.reference
def test_agrees_with_transformers_beam_config():
    transformers = pytest.importorskip("transformers", minversion="5.23")
    # quantization_config is PreTrainedConfig's, written only when a checkpoint is quantized.
    # mosaic_experts is ours (NOT_HF_FIELDS), never in config.json.
    fields = [f.name for f in dataclasses.fields(BeamConfig) if f.name not in ("quantization_config", *NOT_HF_FIELDS)]
    for config in (preset("beam-501b"), preset("beam-tiny"), preset("beam-tp8-slice", num_hidden_layers=5), CUSTOM):
        data = {k: v for k, v in config.to_hf_dict().items() if k not in ("model_type", "architectures")}
        hf = transformers.BeamConfig(**data)
        assert BeamConfig.from_hf_dict(hf.to_dict()) == config
        assert hf.layer_types == list(config.layer_types)
    # Same defaults for every shared field (max_position_embeddings: the beam-501b preset sets 1M).
    ours, theirs = BeamConfig().to_hf_dict(), transformers.BeamConfig().to_dict()
    assert set(fields) <= set(theirs), sorted(set(fields) - set(theirs))
    differing = {k: (ours[k], theirs[k]) for k in fields if k != "max_position_embeddings" and ours[k] != theirs[k]}
    assert not differing


def test_compressed_tensors_ignore_list_can_leave_experts_in_bf16():
    fp8 = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"strategy": "channel"}}},
        "ignore": ["lm_head", "re:.*self_attn.*"],
    }
    tiny = preset("beam-tiny")
    assert tiny.replace(quantization_config=fp8).expert_format == "fp8_channel"
    experts_ignored = {**fp8, "ignore": ["lm_head", "re:.*mlp\\.experts\\..*"]}
    assert tiny.replace(quantization_config=experts_ignored).expert_format == "bf16"
