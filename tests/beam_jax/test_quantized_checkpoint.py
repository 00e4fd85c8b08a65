"""Quantized checkpoints: bf16 -> NVFP4 / FP8 conversion, the producers' per-expert layouts and
configs, loading them packed, and the quantized model against one built from its dequantized
weights (ours, and transformers' on an fp32 checkpoint of those weights)."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import secrets
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from beam_jax.checkpoint import CheckpointError, init_checkpoint, load_checkpoint, save_checkpoint
from beam_jax.checkpoint.reader import read_config
from beam_jax.checkpoint.safetensors_io import SafetensorsCheckpoint, load_safetensors, save_safetensors
from beam_jax.cli import main as cli_main
from beam_jax.compare import compare_outputs, default_prompts, run_jax
from beam_jax.config import BeamConfig, preset
from beam_jax.model import abstract_flat, flat_params, init_params
from beam_jax.quant import quantize_fp8_per_channel, quantize_fp8_per_tensor, quantize_nvfp4
from beam_jax.quant.convert import dequantize_params, expert_nbytes, quantize_params

FORMATS = ("nvfp4", "fp8_channel", "fp8_tensor")
BF16 = np.dtype(ml_dtypes.bfloat16)
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOATS = (np.dtype(np.float32), BF16, np.dtype(np.float16))
PROMPT_LENGTH = 40  # longer than beam-tiny's sliding window (16)


def tiny() -> BeamConfig:
    # vocab 512 keeps files small; layers 1, 2, 4, 5 are sparse with 16 experts (I=32, H=64).
    return preset("beam-tiny").replace(vocab_size=512)


@dataclasses.dataclass(frozen=True)
class Quantized:
    expert_format: str
    seed: int
    bf16_dir: Path
    path: Path
    config: BeamConfig
    params: object  # what quantize_params returned (before any save)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    seed = secrets.randbelow(2**31)
    path = tmp_path_factory.mktemp("bf16")
    init_checkpoint(path, tiny(), seed=seed)
    return path, seed


@pytest.fixture(scope="module")
def quantized_as(bf16_checkpoint, tmp_path_factory):
    """`quantized_as(expert_format)`: the bf16 checkpoint quantized and saved, once per format."""
    bf16_dir, seed = bf16_checkpoint
    made: dict[str, Quantized] = {}

    def make(expert_format: str) -> Quantized:
        if expert_format not in made:
            config, params = load_checkpoint(bf16_dir, progress=False)
            qconfig, qparams = quantize_params(config, params, expert_format)
            path = tmp_path_factory.mktemp(expert_format)
            save_checkpoint(path, qconfig, qparams)
            made[expert_format] = Quantized(expert_format, seed, bf16_dir, path, qconfig, qparams)
        return made[expert_format]

    return make


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, quantized_as) -> Quantized:
    return quantized_as(request.param)


def raw(array) -> np.ndarray:
    # Bit patterns: fp8 NaNs and signed zeros compare as themselves.
    return np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def sparse_layers(config: BeamConfig) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_sparse(i)]


def expected_expert_bytes(config: BeamConfig, expert_format: str) -> int:
    """Per sparse layer and expert: gate and up are [I, H], down is [H, I]."""
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    outs = (i, i, h)  # output rows of gate, up, down
    if expert_format == "nvfp4":  # nibbles + e4m3 per 16 + weight_scale_2 + input_scale
        per_expert = sum(i * h // 2 + i * h // 16 + 4 + 4 for _ in outs)
    elif expert_format == "fp8_channel":  # e4m3 + fp32 per output channel
        per_expert = sum(i * h + 4 * out for out in outs)
    else:  # e4m3 + weight_scale + input_scale
        per_expert = sum(i * h + 4 + 4 for _ in outs)
    return len(sparse_layers(config)) * e * per_expert


# ---- (a) packed on device, and the bytes they should take ---------------------------------------------
def test_loaded_experts_stay_packed_and_take_the_formats_bytes(quantized):
    config, params = load_checkpoint(quantized.path, dtype=jnp.float32, progress=False)
    context = f"{quantized.expert_format}, seed {quantized.seed}"
    assert config == quantized.config and config.expert_format == quantized.expert_format
    flat = flat_params(params)
    want = abstract_flat(config, jnp.float32)
    assert flat.keys() == want.keys()
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    packed_dtypes = {np.dtype(np.uint8), F8}
    for name, array in flat.items():
        assert isinstance(array, jax.Array) and array.devices(), name
        assert (array.shape, array.dtype) == (want[name].shape, want[name].dtype), f"{context} {name}"
        if not is_expert(name):
            continue
        if name.endswith(".weight"):
            assert np.dtype(array.dtype) in packed_dtypes, f"{context} {name}: {array.dtype}"
        if np.dtype(array.dtype) in FLOATS:
            # Scales only: at most one value per output channel, never a dequantized matrix.
            assert array.size <= e * max(i, h), f"{context} {name}: float leaf {array.shape}"
    assert not any(is_expert(n) and n.endswith(("gate_up_proj", "down_proj")) for n in flat)

    expected = expected_expert_bytes(config, quantized.expert_format)
    assert expert_nbytes(params) == expected, context
    on_disk = SafetensorsCheckpoint(quantized.path).tensors
    assert sum(t.nbytes for n, t in on_disk.items() if is_expert(n)) == expected, context
    # Round trip: every leaf, bit for bit, as quantize_params made it.
    made = flat_params(quantized.params)
    for name, array in flat.items():
        if is_expert(name):
            np.testing.assert_array_equal(raw(array), raw(made[name]), err_msg=f"{context} {name}")


def test_each_expert_is_quantized_on_its_own_under_its_name(quantized):
    """The file's `experts.{e}.{proj}` tensors are expert e's bf16 matrix (gate rows first in the
    fused parameter) quantized alone: checks the split, the per-expert scales and the order."""
    source = load_safetensors(quantized.bf16_dir)
    written = load_safetensors(quantized.path)
    rng = np.random.default_rng(quantized.seed)
    for layer in sparse_layers(quantized.config):
        for expert in rng.choice(quantized.config.num_experts, size=2, replace=False):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                matrix = np.asarray(source[f"{name}.weight"])
                if quantized.expert_format == "nvfp4":
                    want = quantize_nvfp4(matrix, input_scale=1.0).to_modelopt()
                elif quantized.expert_format == "fp8_channel":
                    q = quantize_fp8_per_channel(matrix)
                    want = {"weight": q.weight, "weight_scale": q.weight_scale}
                else:
                    q = quantize_fp8_per_tensor(matrix, input_scale=1.0)
                    want = {"weight": q.weight, "weight_scale": q.weight_scale, "input_scale": q.input_scale}
                got = {k.rsplit(".", 1)[1]: v for k, v in written.items() if k.startswith(name + ".")}
                assert got.keys() == want.keys(), name
                for suffix, value in want.items():
                    assert got[suffix].dtype == value.dtype and got[suffix].shape == value.shape, f"{name}.{suffix}"
                    np.testing.assert_array_equal(raw(got[suffix]), raw(value), err_msg=f"{name}.{suffix}")


# ---- (b) the quantized model computes with exactly its dequantized weights ------------------------
def prompt(config: BeamConfig, seed: int) -> np.ndarray:
    return default_prompts(config.vocab_size, [PROMPT_LENGTH], seed)[0]


def test_quantized_logits_equal_the_dequantized_models(quantized):
    config, params = load_checkpoint(quantized.path, dtype=jnp.float32, progress=False)
    plain, dequantized = dequantize_params(config, params, jnp.float32)
    assert plain.expert_format == "bf16" and plain.quantization_config is None
    tokens = prompt(config, quantized.seed)
    ours, theirs = run_jax(params, config, tokens), run_jax(dequantized, plain, tokens)
    result = compare_outputs([(ours, theirs)])
    assert result.logits_error <= 1e-5, (quantized.expert_format, quantized.seed, result)
    assert sum(result.routing_disagreements.values()) == 0, result

    # And the dequantized experts are the bf16 ones up to the format's precision (so the check
    # above compared two models that really run quantized weights).
    _, bf16 = load_checkpoint(quantized.bf16_dir, dtype=jnp.float32, progress=False)
    name = f"model.layers.{sparse_layers(config)[0]}.mlp.experts.gate_up_proj"
    original, approx = np.asarray(flat_params(bf16)[name]), np.asarray(flat_params(dequantized)[name])
    error = np.abs(approx - original).max() / np.abs(original).max()
    assert 0 < error <= (0.2 if quantized.expert_format == "nvfp4" else 0.07), (quantized.expert_format, error)


# ---- (c) every problem of a broken quantized checkpoint at once --------------------------------------
def rewrite(path: Path, edit) -> None:
    tensors = {n: np.array(a) for n, a in load_safetensors(path).items()}
    edit(tensors)
    save_safetensors(path / "model.safetensors", tensors)


def copy_checkpoint(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def load_failing(path: Path) -> CheckpointError:
    placed = []
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, put=lambda name, array: placed.append(name), progress=False)
    assert placed == []
    return error.value


def test_broken_nvfp4_checkpoint_reports_every_problem(quantized_as, tmp_path):
    quantized = quantized_as("nvfp4")
    path = copy_checkpoint(quantized.path, tmp_path / "broken")

    def edit(t):
        del t["model.layers.1.mlp.experts.3.gate_proj.weight_scale_2"]
        # A bf16 expert weight where packed nibbles belong (dtype and shape both wrong).
        t["model.layers.2.mlp.experts.5.up_proj.weight"] = np.zeros((32, 64), BF16)
        for e in range(16):  # the same wrong shape for every expert: one line
            t[f"model.layers.4.mlp.experts.{e}.down_proj.weight_scale"] = np.zeros((64, 4), F8)
        t["model.layers.5.mlp.experts.0.up_proj.input_scale"] = np.float32([1.0, 1.0])
        t["model.layers.5.mlp.experts.16.up_proj.weight"] = np.zeros((32, 32), np.uint8)
        t["model.layers.1.mlp.experts.gate_up_proj"] = np.zeros((16, 64, 64), BF16)

    rewrite(path, edit)
    error = load_failing(path)
    assert "expert format nvfp4" in error.summary
    assert error.problems == (
        "model.layers.1.mlp.experts.gate_up_proj: expected no such tensor, found BF16 [16, 64, 64] (unknown name)",
        "model.layers.1.mlp.experts.{e}.gate_proj.weight_scale_2: expected for every expert 0..15, "
        "found nothing for experts [3] (missing)",
        "model.layers.2.mlp.experts.5.up_proj.weight: expected U8 [32, 32], found BF16 [32, 64]",
        "model.layers.4.mlp.experts.{e}.down_proj.weight_scale: expected F8_E4M3 [64, 2], "
        "found F8_E4M3 [64, 4] (experts 0..15)",
        "model.layers.5.mlp.experts.0.up_proj.input_scale: expected float (F32/BF16/F16) [] or [1], found F32 [2]",
        "model.layers.5.mlp.experts.16.up_proj.weight: expected experts 0..15, found expert 16",
    ), str(error)


def test_broken_fp8_checkpoint_reports_every_problem(quantized_as, tmp_path):
    quantized = quantized_as("fp8_channel")
    path = copy_checkpoint(quantized.path, tmp_path / "broken")

    def edit(t):
        del t["model.layers.1.mlp.experts.0.down_proj.weight_scale"]
        t["model.layers.2.mlp.experts.7.gate_proj.weight"] = t["model.layers.2.mlp.experts.7.gate_proj.weight"].astype(
            np.float32
        )
        t["model.layers.4.mlp.experts.1.up_proj.weight_scale"] = np.ones((1, 32), np.float32)  # transposed
        t["model.layers.4.mlp.experts.1.up_proj.input_scale"] = np.float32(1.0)  # FP8_DYNAMIC has none

    rewrite(path, edit)
    error = load_failing(path)
    assert error.problems == (
        "model.layers.1.mlp.experts.{e}.down_proj.weight_scale: expected for every expert 0..15, "
        "found nothing for experts [0] (missing)",
        "model.layers.2.mlp.experts.7.gate_proj.weight: expected F8_E4M3 [32, 64], found F32 [32, 64]",
        "model.layers.4.mlp.experts.1.up_proj.input_scale: expected no such tensor, found F32 [] (unknown name)",
        "model.layers.4.mlp.experts.1.up_proj.weight_scale: expected float (F32/BF16/F16) [32, 1], found F32 [1, 32]",
    ), str(error)


def test_quantized_tensors_under_a_bf16_config_are_explained(quantized_as, tmp_path):
    quantized = quantized_as("nvfp4")
    path = copy_checkpoint(quantized.path, tmp_path / "unlabelled")
    raw_config = json.loads((path / "config.json").read_text())
    del raw_config["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw_config))
    (path / "hf_quant_config.json").unlink()
    error = load_failing(path)
    assert "holds quantization scales, but neither config.json nor hf_quant_config.json" in error.summary
    assert "model.layers.1.mlp.experts.0.gate_proj.weight: expected float (F32/BF16/F16) [32, 64], found U8 [32, 32]" \
        not in error.problems  # aggregated over experts instead:
    assert "model.layers.1.mlp.experts.{e}.gate_proj.weight: expected float (F32/BF16/F16) [32, 64], " \
           "found U8 [32, 32] (experts 0..15)" in error.problems


# ---- the layouts' variants load too -----------------------------------------------------------------
def test_modelopt_scalars_as_1_element_tensors_and_bf16_channel_scales_load(quantized, tmp_path):
    path = copy_checkpoint(quantized.path, tmp_path / "variant")
    if quantized.expert_format == "fp8_channel":
        # compressed-tensors may store the per-channel scale in the model dtype.
        def edit(t):
            for name in [n for n in t if n.endswith("weight_scale")]:
                t[name] = t[name].astype(BF16)
    else:
        def edit(t):
            for name in [n for n in t if n.endswith(("weight_scale_2", "input_scale")) or
                         (quantized.expert_format == "fp8_tensor" and n.endswith("weight_scale"))]:
                t[name] = t[name].reshape(1)

    rewrite(path, edit)
    _, params = load_checkpoint(path, progress=False)
    got, made = flat_params(params), flat_params(quantized.params)
    for name, array in made.items():
        want = np.asarray(array)
        if quantized.expert_format == "fp8_channel" and name.endswith("weight_scale"):
            want = want.astype(BF16).astype(np.float32)  # what the file now holds, widened exactly
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        np.testing.assert_array_equal(raw(got[name]), raw(want), err_msg=name)


# ---- (d) configs as the producers write them ------------------------------------------------------------
def linear_modules(config: BeamConfig) -> tuple[list[str], list[str]]:
    """(non-expert Linear modules incl. routers and head, per-expert Linear modules) of the HF model."""
    plain = config.replace(quantization_config=None)
    others = [n.removesuffix(".weight") for n in abstract_flat(plain) if n.endswith(".weight") and
              "norm" not in n and "embed_tokens" not in n and not is_expert(n)]
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in sparse_layers(config)
               for e in range(config.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    return others, experts


def modelopt_excludes(patterns: list[str], module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def compressed_tensors_ignores(patterns: list[str], module: str) -> bool:
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def test_written_configs_have_the_producers_keys_and_read_back(quantized, tmp_path):
    written = json.loads((quantized.path / "config.json").read_text())
    qc = written["quantization_config"]
    others, experts = linear_modules(quantized.config)
    hf_quant = quantized.path / "hf_quant_config.json"
    if quantized.expert_format == "fp8_channel":
        assert not hf_quant.exists()
        assert {k: qc[k] for k in ("quant_method", "format", "quantization_status")} == {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
        }
        assert qc["config_groups"] == {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
                "input_activations": {
                    "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True,
                },
            }
        }
        excluded = lambda module: compressed_tensors_ignores(qc["ignore"], module)  # noqa: E731
    else:
        algo = "NVFP4" if quantized.expert_format == "nvfp4" else "FP8"
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == algo
        assert qc.get("group_size") == (16 if algo == "NVFP4" else None)
        assert qc["ignore"] == qc["exclude_modules"]
        sidecar = json.loads(hf_quant.read_text())
        assert sidecar["producer"]["name"] == "beam_jax"
        assert sidecar["quantization"]["quant_algo"] == algo
        assert sidecar["quantization"]["exclude_modules"] == qc["exclude_modules"]
        assert sidecar["quantization"].get("group_size") == qc.get("group_size")
        excluded = lambda module: modelopt_excludes(qc["exclude_modules"], module)  # noqa: E731
    assert [m for m in others if not excluded(m)] == [], "non-expert Linears left quantized"
    assert [m for m in experts if excluded(m)] == [], "experts excluded from quantization"

    assert BeamConfig.load(quantized.path).expert_format == quantized.expert_format
    assert read_config(quantized.path) == quantized.config
    if quantized.expert_format != "fp8_channel":
        # An older ModelOpt export: the quantization only in hf_quant_config.json.
        path = copy_checkpoint(quantized.path, tmp_path / "sidecar_only")
        del written["quantization_config"]
        (path / "config.json").write_text(json.dumps(written))
        config, params = load_checkpoint(path, progress=False)
        assert config.expert_format == quantized.expert_format
        assert config.quantization_config != quantized.config.quantization_config  # no `ignore` there
        for name, array in flat_params(quantized.params).items():
            np.testing.assert_array_equal(raw(flat_params(params)[name]), raw(array), err_msg=name)


def test_resaving_bf16_removes_a_stale_hf_quant_config(tmp_path, bf16_checkpoint):
    config = tiny()
    params = init_params(config, bf16_checkpoint[1], jnp.bfloat16)
    qconfig, qparams = quantize_params(config, params, "nvfp4")
    save_checkpoint(tmp_path, qconfig, qparams)
    assert (tmp_path / "hf_quant_config.json").exists()
    save_checkpoint(tmp_path, config, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert read_config(tmp_path).expert_format == "bf16"
    with pytest.raises(ValueError, match="params do not match the config"):
        save_checkpoint(tmp_path / "mismatch", config, qparams)
    with pytest.raises(ValueError, match="written per expert"):
        save_checkpoint(tmp_path / "fused", qconfig, qparams, expert_layout="fused")


def test_init_checkpoint_of_a_quantized_config(tmp_path, bf16_checkpoint):
    seed = bf16_checkpoint[1]
    config = tiny()
    qconfig, qparams = quantize_params(config, init_params(config, seed, jnp.bfloat16), "fp8_tensor")
    init_checkpoint(tmp_path, qconfig, seed=seed)
    loaded_config, loaded = load_checkpoint(tmp_path, progress=False)
    assert loaded_config == qconfig
    for name, array in flat_params(qparams).items():
        np.testing.assert_array_equal(raw(flat_params(loaded)[name]), raw(array), err_msg=name)


# ---- the CLI --------------------------------------------------------------------------------------------
def test_cli_quantize(tmp_path, bf16_checkpoint, capsys):
    source = copy_checkpoint(bf16_checkpoint[0], tmp_path / "bf16")
    (source / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    out = tmp_path / "fp8"
    assert cli_main(["quantize", "--in", str(source), "--out", str(out), "--format", "fp8"]) == 0
    line = capsys.readouterr().out.strip()
    before = 4 * 16 * 3 * 32 * 64 * 2  # 4 sparse layers, 16 experts, 3 projections of 32x64 in bf16
    after = expected_expert_bytes(tiny(), "fp8_channel")
    assert line.startswith(f"experts {before:,} -> {after:,} bytes (") and "fp8_channel" in line, line
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 4096}'

    config, params = load_checkpoint(out, progress=False)
    want_config, want = quantize_params(*load_checkpoint(source, progress=False), "fp8_channel")
    assert config == want_config and config.expert_format == "fp8_channel"
    for name, array in flat_params(want).items():
        np.testing.assert_array_equal(raw(flat_params(params)[name]), raw(array), err_msg=name)

    with pytest.raises(SystemExit, match="already fp8_channel"):
        cli_main(["quantize", "--in", str(out), "--out", str(tmp_path / "again"), "--format", "nvfp4"])
    with pytest.raises(SystemExit, match="must differ"):
        cli_main(["quantize", "--in", str(source), "--out", str(source), "--format", "nvfp4"])


# ---- (e) transformers on the dequantized weights ----------------------------------------------------------
@pytest.mark.reference
def test_quantized_model_matches_transformers_on_the_dequantized_checkpoint(quantized, tmp_path):
    pytest.importorskip("transformers", minversion="5.23")
    pytest.importorskip("torch")
    from beam_jax.compare import load_reference, run_reference

    # transformers cannot load pre-quantized NVFP4 (quantizer_nvfp4: "Loading pre-quantized NVFP4
    # checkpoints is not supported yet"), so the reference runs an fp32 checkpoint of exactly the
    # weights the quantized model computes with.
    config, params = load_checkpoint(quantized.path, dtype=jnp.float32, progress=False)
    plain, dequantized = dequantize_params(config, params, jnp.float32)
    save_checkpoint(tmp_path, plain, dequantized)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    reference = load_reference(str(tmp_path), "float32")

    tokens = prompt(config, quantized.seed)
    result = compare_outputs([(run_jax(params, config, tokens), run_reference(reference, tokens))])
    context = (quantized.expert_format, quantized.seed, result)
    assert result.logits_error <= 1e-4, context
    assert sum(result.routing_disagreements.values()) == 0, context
