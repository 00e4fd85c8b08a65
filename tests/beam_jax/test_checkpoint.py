"""Checkpoints: our safetensors reader/writer, the validating loader, orbax restarts, and parity
with transformers' BeamForCausalLM on checkpoints each side wrote."""

from __future__ import annotations

import json
import secrets

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from beam_jax.checkpoint import (
    CheckpointError,
    init_checkpoint,
    is_orbax_checkpoint,
    load_any,
    load_checkpoint,
    restore_orbax,
    save_checkpoint,
    save_orbax,
)
from beam_jax.checkpoint import safetensors_io
from beam_jax.checkpoint.safetensors_io import SafetensorsCheckpoint, load_safetensors, save_safetensors
from beam_jax.config import preset
from beam_jax.model import flat_params, init_params

BF16 = np.dtype(ml_dtypes.bfloat16)


def tiny(**changes):
    # vocab 512 keeps files small; layers 1, 2, 4, 5 are sparse with 16 experts each.
    return preset("beam-tiny").replace(vocab_size=512, **changes)


@pytest.fixture
def seed():
    return secrets.randbelow(2**31)


def host(params) -> dict[str, np.ndarray]:
    return {name: np.asarray(array) for name, array in flat_params(params).items()}


def assert_params_equal(actual, expected, context=""):
    a, b = host(actual), host(expected)
    assert a.keys() == b.keys(), context
    for name in b:
        assert a[name].dtype == b[name].dtype, f"{context} {name}: {a[name].dtype} != {b[name].dtype}"
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{context} {name}")


# ---- safetensors format ---------------------------------------------------------------------------
def random_tensors(rng) -> dict[str, np.ndarray]:
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f32": floats,
        "f16": floats.astype(np.float16),
        "bf16": floats.astype(BF16),
        "f8": floats.astype(ml_dtypes.float8_e4m3fn),
        "u8": rng.integers(0, 256, (7,), dtype=np.uint8),
        "i8": rng.integers(-128, 128, (2, 2), dtype=np.int8),
        "i32": rng.integers(-(2**31), 2**31, (4,), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, (1, 3), dtype=np.int64),
        "bool": rng.integers(0, 2, (5,)).astype(bool),
        "scalar": np.float32(rng.standard_normal()).reshape(()),
        "empty": np.zeros((0, 4), np.float32),
        "strided": floats.T,  # not C-contiguous: the writer must lay it out row-major
    }


def raw_bytes(array) -> np.ndarray:
    # Compare bit patterns: NaNs in fp8 and signed zeros must survive too.
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def test_safetensors_round_trip_every_dtype(tmp_path):
    tensors = random_tensors(np.random.default_rng())
    save_safetensors(tmp_path / "t.safetensors", tensors)
    loaded = load_safetensors(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        np.testing.assert_array_equal(raw_bytes(loaded[name]), raw_bytes(array), err_msg=name)
    # Header is padded so that tensor data starts 8-byte aligned.
    header_len = int.from_bytes((tmp_path / "t.safetensors").read_bytes()[:8], "little")
    assert (8 + header_len) % 8 == 0


def test_safetensors_interoperates_with_the_reference_library(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = random_tensors(np.random.default_rng())
    save_safetensors(tmp_path / "ours.safetensors", tensors)
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, array in tensors.items():
            got = f.get_tensor(name)
            assert tuple(got.shape) == array.shape, name
            np.testing.assert_array_equal(got.contiguous().reshape(-1).view(torch.uint8).numpy(), raw_bytes(array), name)

    theirs = {"bf16": torch.randn(4, 6, dtype=torch.bfloat16), "i64": torch.arange(5), "f16": torch.randn(3).half()}
    save_file(theirs, tmp_path / "theirs.safetensors")
    loaded = load_safetensors(tmp_path / "theirs.safetensors")
    np.testing.assert_array_equal(loaded["bf16"].astype(np.float32), theirs["bf16"].float().numpy())
    np.testing.assert_array_equal(loaded["i64"], theirs["i64"].numpy())
    np.testing.assert_array_equal(loaded["f16"], theirs["f16"].numpy())


def test_corrupt_file_is_a_checkpoint_error(tmp_path):
    save_safetensors(tmp_path / "model.safetensors", {"x": np.ones((4, 4), np.float32)})
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])  # truncated: offsets run past the end
    with pytest.raises(CheckpointError, match="outside the"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(CheckpointError, match="header length"):
        SafetensorsCheckpoint(tmp_path)


# ---- HF checkpoints: round trips ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_is_exact(tmp_path, seed, dtype):
    config = tiny()
    params = init_params(config, seed, dtype)
    save_checkpoint(tmp_path, config, params)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == jnp.dtype(dtype).name
    loaded_config, loaded = load_checkpoint(tmp_path, progress=False)
    assert loaded_config == config
    assert_params_equal(loaded, params, f"seed {seed}")
    assert flat_params(loaded)["model.layers.1.mlp.gate.weight"].dtype == jnp.float32


def test_layouts_and_shards_load_identically(tmp_path, seed):
    config = tiny()
    params = init_params(config, seed, jnp.bfloat16)
    save_checkpoint(tmp_path / "per_expert", config, params, expert_layout="per_expert")
    save_checkpoint(tmp_path / "fused", config, params, expert_layout="fused")
    save_checkpoint(tmp_path / "sharded", config, params, max_shard_bytes=100_000)

    per_expert = SafetensorsCheckpoint(tmp_path / "per_expert").tensors
    fused = SafetensorsCheckpoint(tmp_path / "fused").tensors
    assert "model.layers.1.mlp.experts.15.up_proj.weight" in per_expert
    assert "model.layers.1.mlp.experts.gate_up_proj" not in per_expert
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and not any(".experts.0." in n for n in fused)

    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / "sharded" / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["weight_map"].keys() == per_expert.keys()

    for layout in ("per_expert", "fused", "sharded"):
        _, loaded = load_checkpoint(tmp_path / layout, progress=False)
        assert_params_equal(loaded, params, f"{layout}, seed {seed}")


def test_resave_removes_stale_shards(tmp_path, seed):
    config = tiny()
    params = init_params(config, seed, jnp.bfloat16)
    save_checkpoint(tmp_path, config, params, max_shard_bytes=100_000)
    save_checkpoint(tmp_path, config, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_dtype_is_cast_on_load_and_router_stays_fp32(tmp_path, seed):
    config = tiny()
    params = init_params(config, seed, jnp.float32)
    save_checkpoint(tmp_path, config, params)
    _, loaded = load_checkpoint(tmp_path, dtype="bfloat16", progress=False)
    expected = {n: a if a.dtype == jnp.float32 and ".mlp.gate." in n else a.astype(jnp.bfloat16)
                for n, a in flat_params(params).items()}
    got = flat_params(loaded)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)
    assert got["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == jnp.float32


def test_tied_embeddings_have_no_head(tmp_path, seed):
    config = tiny(tie_word_embeddings=True)
    params = init_params(config, seed, jnp.bfloat16)
    save_checkpoint(tmp_path, config, params)
    assert "lm_head.weight" not in SafetensorsCheckpoint(tmp_path).tensors
    loaded_config, loaded = load_checkpoint(tmp_path, progress=False)
    assert loaded_config.tie_word_embeddings and "lm_head.weight" not in flat_params(loaded)
    assert_params_equal(loaded, params)

    # A head in a tied checkpoint is reported, not silently dropped.
    tensors = {n: np.array(a) for n, a in load_safetensors(tmp_path).items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight: expected no such tensor \(tie_word_embeddings"):
        load_checkpoint(tmp_path, progress=False)


# ---- the reader reads tensor by tensor, from memory maps -------------------------------------------
def test_reader_reads_headers_only_and_tensors_from_memory_maps(tmp_path, seed, monkeypatch):
    config = tiny()
    params = init_params(config, seed, jnp.float32)
    save_checkpoint(tmp_path, config, params, max_shard_bytes=200_000)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    header_bytes = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)

    # Every byte that `read()` delivers through `open` in the reader is counted; tensor bytes
    # must come from the memory maps instead.
    bytes_read, maps = [0], []

    class CountingFile:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            assert n >= 0, "a read of the whole file"
            data = self._f.read(n)
            bytes_read[0] += len(data)
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    original_get = safetensors_io.SafetensorsFile.get

    def recording_get(self, name):
        view = original_get(self, name)
        assert isinstance(self._map, np.memmap) and np.shares_memory(view, self._map), name
        if not any(m is self._map for m in maps):
            maps.append(self._map)
        return view

    monkeypatch.setattr(safetensors_io, "open", lambda *a, **k: CountingFile(open(*a, **k)), raising=False)
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", recording_get)
    placed = {}

    def put(name, array):
        # Each parameter arrives owned, not as a view that keeps the file mapped.
        assert not any(np.shares_memory(array, m) for m in maps), name
        placed[name] = array.shape
        return jax.device_put(array)

    _, loaded = load_checkpoint(tmp_path, put=put, progress=False)
    assert bytes_read[0] == header_bytes, "the reader read tensor data with read()"
    assert len(maps) == len(files)  # each shard mapped once
    assert placed.keys() == host(params).keys()
    assert_params_equal(loaded, params)

    view = SafetensorsCheckpoint(tmp_path).get("model.embed_tokens.weight")
    assert not view.flags.owndata and not view.flags.writeable


# ---- one error naming every problem ---------------------------------------------------------------
def test_every_problem_is_reported_at_once_and_nothing_is_placed(tmp_path, seed):
    config = tiny()
    save_checkpoint(tmp_path, config, init_params(config, seed, jnp.bfloat16))
    tensors = {n: np.array(a) for n, a in load_safetensors(tmp_path).items()}

    missing = "model.layers.0.self_attn.q_proj.weight"
    wrong_shape = "model.layers.3.self_attn.k_proj.weight"
    router_bf16 = "model.layers.2.mlp.gate.weight"
    integer = "model.layers.3.mlp.up_proj.weight"
    unknown = "model.layers.0.self_attn.rotary_emb.inv_freq"
    missing_expert = "model.layers.4.mlp.experts.7.down_proj.weight"
    del tensors[missing], tensors[missing_expert]
    tensors[wrong_shape] = tensors[wrong_shape][:-1]
    tensors[router_bf16] = tensors[router_bf16].astype(BF16)
    tensors[integer] = tensors[integer].astype(np.int32)
    tensors[unknown] = np.ones(8, np.float32)
    # Layer 5 holds a fused tensor beside its per-expert ones.
    tensors["model.layers.5.mlp.experts.down_proj"] = np.zeros((16, 64, 32), BF16)
    save_safetensors(tmp_path / "model.safetensors", tensors)

    placed = []
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path, put=lambda name, array: placed.append(name), progress=False)
    message = str(error.value)
    assert placed == []
    assert f"{missing}: expected float (F32/BF16/F16) [64, 64], found nothing (missing)" in message
    assert f"{wrong_shape}: expected float (F32/BF16/F16) [32, 64], found BF16 [31, 64]" in message
    assert f"{router_bf16}: expected F32 [16, 64], found BF16 [16, 64]" in message
    assert f"{integer}: expected float (F32/BF16/F16) [128, 64], found I32 [128, 64]" in message
    assert f"{unknown}: expected no such tensor, found F32 [8] (unknown name)" in message
    assert "model.layers.4.mlp.experts.{e}.down_proj.weight: expected for every expert 0..15, " \
           "found nothing for experts [7]" in message
    assert "model.layers.5.mlp.experts: expected either fused gate_up_proj/down_proj or per-expert tensors, " \
           "found both" in message
    assert len(error.value.problems) == 7, message
    assert isinstance(error.value, ValueError)


def test_missing_fused_expert_tensor_and_fp8_weight_are_reported(tmp_path, seed):
    config = tiny()
    save_checkpoint(tmp_path, config, init_params(config, seed, jnp.bfloat16), expert_layout="fused")
    tensors = {n: np.array(a) for n, a in load_safetensors(tmp_path).items()}
    del tensors["model.layers.1.mlp.experts.gate_up_proj"]
    tensors["model.layers.2.mlp.experts.down_proj"] = tensors["model.layers.2.mlp.experts.down_proj"].astype(
        ml_dtypes.float8_e4m3fn
    )
    save_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path, progress=False)
    assert error.value.problems == (
        "model.layers.1.mlp.experts.gate_up_proj: expected float (F32/BF16/F16) [16, 64, 64], found nothing (missing)",
        "model.layers.2.mlp.experts.down_proj: expected float (F32/BF16/F16) [16, 64, 32], found F8_E4M3 [16, 64, 32]",
    )


# ---- orbax ------------------------------------------------------------------------------------------
def test_orbax_round_trip(tmp_path, seed):
    config = tiny()
    params = init_params(config, seed, jnp.bfloat16)
    save_orbax(tmp_path / "orbax", config, params)
    assert is_orbax_checkpoint(tmp_path / "orbax")
    restored_config, restored = restore_orbax(tmp_path / "orbax")
    assert restored_config == config
    assert_params_equal(restored, params)

    _, as_fp32 = restore_orbax(tmp_path / "orbax", dtype=jnp.float32)
    expected = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    assert_params_equal(as_fp32, expected)

    save_checkpoint(tmp_path / "hf", config, params)
    assert not is_orbax_checkpoint(tmp_path / "hf")
    for path in (tmp_path / "orbax", tmp_path / "hf"):
        _, loaded = load_any(path, progress=False)
        assert_params_equal(loaded, params, path.name)


# ---- parity with transformers -----------------------------------------------------------------------
def hf_config(config):
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in config.to_hf_dict().items() if k not in ("model_type", "architectures")}
    return transformers.BeamConfig(**fields)


@pytest.mark.reference
@pytest.mark.parametrize("expert_layout", ["per_expert", "fused"])
def test_transformers_loads_our_checkpoint(tmp_path, seed, expert_layout):
    transformers = pytest.importorskip("transformers")
    config = tiny()
    init_checkpoint(tmp_path, config, seed=seed, dtype="float32", expert_layout=expert_layout, max_shard_bytes=300_000)
    model = transformers.BeamForCausalLM.from_pretrained(tmp_path)
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    ours = host(init_params(config, seed, jnp.float32))
    assert state.keys() == ours.keys()
    for name, array in ours.items():
        np.testing.assert_array_equal(state[name], array, err_msg=name)


@pytest.mark.reference
def test_we_load_what_save_pretrained_writes(tmp_path, seed):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = tiny()
    torch.manual_seed(seed)
    model = transformers.BeamForCausalLM(hf_config(config))  # random torch init, fp32
    # Give the correction bias values: its init is zeros, which would hide a swap with another bias.
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
            layer.mlp.gate.e_score_correction_bias.normal_()
    model.save_pretrained(tmp_path)

    # transformers 5.23 writes experts in HF's original per-expert layout (it reverts the fusing
    # conversion on save), not the fused parameters it holds.
    written = SafetensorsCheckpoint(tmp_path).tensors
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in written
    assert "model.layers.1.mlp.experts.gate_up_proj" not in written

    loaded_config, params = load_checkpoint(tmp_path, progress=False)
    assert loaded_config == config
    ours = host(params)
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    assert state.keys() == ours.keys()
    for name, tensor in state.items():
        assert ours[name].dtype == np.float32, name
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
