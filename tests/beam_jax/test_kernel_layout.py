"""NVFP4 experts repacked at load time for the Mosaic GPU kernel (`beam_jax.quant.kernel_layout`):
the converted model computes what the checkpoint-layout one does (on the CPU the kernel's GEMM is
emulated from the same layouts), on one device and on a TP x EP mesh (8 CPU devices in a
subprocess: `python -m tests.beam_jax.test_kernel_layout mesh`, run by a test below); shapes and
meshes the kernel cannot take are refused by name; the checkpoint-layout arrays are gone; a
converted model cannot be saved."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from beam_jax import sharding
from beam_jax.config import DENSE, FULL, SLIDING, SPARSE, preset
from beam_jax.model import abstract_flat, flat_params, graphdef, init_params, jit_forward, params_from_flat
from beam_jax.quant.convert import quantization_config_for, quantize_params
from beam_jax.quant.kernel_layout import KERNEL_ARRAYS, layout_problems, on_hopper, to_kernel_layout, use_mosaic

MESH_LAYOUT = (2, 4)  # (tp, ep) of the mesh test: 8 devices, both kinds of split


def fitting_config(mlp_layer_types=(SPARSE, SPARSE)):
    """beam-tiny with shapes the kernel takes (hidden 256: gate/up K tile; intermediate 128: two of
    down's 64-value K tiles, so TP2 still fits), two layers, a small vocabulary."""
    return preset("beam-tiny").replace(hidden_size=256, moe_intermediate_size=128, vocab_size=512, num_hidden_layers=2,
                                       layer_types=(SLIDING, FULL), mlp_layer_types=mlp_layer_types)


# In bf16 the two layouts round differently, and a sparse layer after another may then route a token
# to other experts (a jump, not a rounding): bf16 comparisons run one sparse layer.
ONE_SPARSE_LAYER = (DENSE, SPARSE)


def nvfp4_model(seed: int, dtype=jnp.bfloat16, config=None):
    """Random weights (experts scaled up so that they move the residual stream), quantized to NVFP4."""
    config = config or fitting_config()
    params = init_params(config, seed, dtype)
    flat = flat_params(params)
    for name in flat:
        if name.endswith(("gate_up_proj", "down_proj")):
            flat[name] = flat[name] * 10
    params = nnx.from_flat_state([(path, leaf.replace(flat[".".join(map(str, path))]))
                                  for path, leaf in nnx.to_flat_state(params)])
    return quantize_params(config, params, "nvfp4")


def tokens_of(seed: int, count: int, vocab: int):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (1, count)), jnp.int32)
    return tokens, jnp.arange(count, dtype=jnp.int32)[None]


def assert_bf16_close(got, want, what: str, ulps: float = 8):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    assert scale > 0, what
    err = np.abs(got - want).max()
    assert err <= ulps * 2.0**-8 * scale, f"{what}: max error {err:.3g} against max |value| {scale:.3g}"


# ---- one device ----------------------------------------------------------------------------------
def sparse_layer(config):
    """The jitted experts of the sparse layer (1) of a `fitting_config(ONE_SPARSE_LAYER)` model."""
    return jax.jit(lambda params, *args: nnx.merge(graphdef(config), params).model.layers[1].mlp.experts(*args))


def test_converted_forward_matches_the_checkpoint_layout():
    """bf16, fresh random weights and tokens each run: logits and the sparse layer's output within
    bf16 rounding at 1, 8 and 13 tokens; and the experts alone (which the residual stream would
    hide) at 1, 13, 40 and 70 tokens (each a plan of `moe_nvfp4`'s defaults: one launch, blocks opened
    per pair, compact slots, sorted blocks of 32 rows)."""
    seed = secrets.randbelow(2**31)
    config, params = nvfp4_model(seed, config=fitting_config(ONE_SPARSE_LAYER))
    rng = np.random.default_rng(seed)
    layer_inputs = {}
    for count in (1, 13, 40, 70):
        x = jnp.asarray(rng.standard_normal((count, config.hidden_size)), jnp.bfloat16)
        ids = jnp.asarray(np.stack([rng.choice(config.num_experts, config.num_experts_per_tok, replace=False)
                                    for _ in range(count)]))
        weights = jnp.asarray(rng.uniform(0.1, 1, ids.shape), jnp.float32)
        layer_inputs[count] = (x, weights, ids, sparse_layer(config)(params, x, weights, ids))
    steps = {count: tokens_of(seed + count, count, config.vocab_size) for count in (1, 8, 13)}
    want = {count: jit_forward(params, *step, config=config, hidden_layers=(1,)) for count, step in steps.items()}

    converted_config, converted = to_kernel_layout(config, params)
    for count, (x, weights, ids, expected) in layer_inputs.items():
        got = sparse_layer(converted_config)(converted, x, weights, ids)
        assert_bf16_close(got, expected, f"experts at {count} tokens (seed {seed})")
    for count, step in steps.items():
        got = jit_forward(converted, *step, config=converted_config, hidden_layers=(1,))
        assert_bf16_close(got.hidden_states[0], want[count].hidden_states[0], f"layer output at {count} tokens "
                          f"(seed {seed})")
        assert_bf16_close(got.logits, want[count].logits, f"logits at {count} tokens (seed {seed})")


def test_conversion_replaces_the_checkpoint_arrays():
    config, params = nvfp4_model(1)
    old = flat_params(params)
    converted_config, converted = to_kernel_layout(config, params)
    flat = flat_params(converted)
    assert converted_config.mosaic_experts and converted_config.expert_format == "nvfp4"
    prefix = "model.layers.0.mlp.experts."
    assert sorted(n[len(prefix):] for n in flat if n.startswith(prefix)) == sorted(KERNEL_ARRAYS)
    assert not [n for n in flat if ".experts." in n and "_proj." in n]  # gate_proj.weight, ... are gone
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    assert flat[prefix + "gate_up.packed"].shape == (e, h // 256, 2 * i, 128)
    assert flat[prefix + "gate_up.scales"].shape == (e, h // 256, 2 * i, 4)
    assert flat[prefix + "down.packed"].shape == (e, i // 64, h, 32)
    assert flat[prefix + "down.scales"].shape == (e, i // 64, h, 1)
    assert flat.keys() == abstract_flat(converted_config).keys()
    # The checkpoint-layout arrays are freed, not kept beside the new ones; the rest is shared.
    experts_before = [a for n, a in old.items() if ".experts." in n]
    assert len(experts_before) == 2 * 3 * 4 and all(a.is_deleted() for a in experts_before)
    assert flat["model.embed_tokens.weight"] is old["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="already"):
        to_kernel_layout(converted_config, converted)


def test_nan_block_scales_are_refused_before_anything_is_converted():
    config, params = nvfp4_model(1)
    flat = flat_params(params)
    name = "model.layers.1.mlp.experts.down_proj.weight_scale"
    flat[name] = flat[name].at[0, 3, 1].set(jnp.nan)
    params = params_from_flat(config, flat)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + " holds NaN block scales.*expert_kernel='triton'"):
        to_kernel_layout(config, params)
    assert not any(a.is_deleted() for n, a in flat_params(params).items() if ".experts." in n)


def test_converted_experts_refuse_the_checkpoint_view():
    from beam_jax.layers.moe import Experts

    config, _ = nvfp4_model(1)
    experts = Experts(config.replace(mosaic_experts=True), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="in the Mosaic kernel's layout"):
        experts.expert_weights()


def test_shapes_the_kernel_cannot_take_are_refused_by_name():
    tiny = preset("beam-tiny")  # hidden 64, expert intermediate 32
    nvfp4 = tiny.replace(quantization_config=quantization_config_for(tiny, "nvfp4"))
    with pytest.raises(ValueError, match=r"hidden_size \(64\) a multiple of 256.*moe_intermediate_size \(32\) must "
                                         r"be a multiple of 64"):
        use_mosaic(nvfp4, "mosaic")
    with pytest.raises(ValueError, match="takes NVFP4 experts, these are fp8_channel"):
        use_mosaic(tiny.replace(quantization_config=quantization_config_for(tiny, "fp8_channel")), "mosaic")
    with pytest.raises(ValueError, match="expert_kernel must be one of auto, mosaic, triton"):
        use_mosaic(nvfp4, "cutlass")
    fits = fitting_config()
    fits = fits.replace(quantization_config=quantization_config_for(fits, "nvfp4"))
    assert use_mosaic(fits, "mosaic") and not use_mosaic(fits, "triton")
    assert use_mosaic(fits, "auto") == on_hopper()  # the default converts on Hopper GPUs only
    assert not use_mosaic(tiny, "auto") and not use_mosaic(nvfp4, "auto")  # bf16; shapes that do not fit
    with pytest.raises(ValueError, match="NVFP4 experts only"):
        tiny.replace(mosaic_experts=True)
    # Meshes: TP4 leaves 32 intermediate values per device, half of down's K tile; experts must divide.
    with pytest.raises(ValueError, match=r"on a tp=4, ep=1 mesh.*moe_intermediate_size/tp = 128/4 must be a multiple "
                                         r"of 64"):
        use_mosaic(fits, "mosaic", AbstractMesh((1, 4), sharding.AXES))
    assert layout_problems(fits, tp=1, ep=3) == ["num_experts (16) is not divisible by ep=3"]
    converted = fits.replace(mosaic_experts=True)
    sharding.check_mesh(converted, AbstractMesh((4, 2), sharding.AXES))
    with pytest.raises(ValueError, match=r"cannot hold the experts: in the Mosaic kernel's layout, down's K tile"):
        sharding.check_mesh(converted, AbstractMesh((2, 4), sharding.AXES))
    sharding.check_mesh(fits, AbstractMesh((2, 4), sharding.AXES))  # the checkpoint layout needs 16 only


def local_kernel_shapes(experts: int, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """A device's shard of each kernel array (gate_up in its mesh layout) holding `experts` experts
    and `inter` of each one's intermediate dim."""
    e, h, i = experts, hidden, inter
    return {"gate_up.packed": (e, h // 256, 2, i, 128), "gate_up.scales": (e, h // 256, 2, i, 4),
            "gate_up.global_scale": (e, 2, i), "down.packed": (e, i // 64, h, 32), "down.scales": (e, i // 64, h, 1),
            "down.global_scale": (e, h)}


@pytest.mark.parametrize("tp, ep", [(8, 1), (1, 8), (2, 4)])
def test_the_real_models_kernel_layout_splits_into_local_layouts(tp, ep):
    """Beam-501B's converted experts: every spec divides its parameter, and each device's shard has
    the shapes of a local kernel layout (gate_up rows 2 I/tp, down's K I/tp in 64-value tiles)."""
    real = preset("beam-501b")
    config = real.replace(quantization_config=quantization_config_for(real, "nvfp4"), mosaic_experts=True)
    mesh = AbstractMesh((ep, tp), sharding.AXES)
    sharding.check_mesh(config, mesh)
    sizes = {"ep": ep, "tp": tp}
    e, h, i = config.num_experts // ep, config.hidden_size, config.moe_intermediate_size // tp
    local = {}
    for name, leaf in abstract_flat(config).items():
        if ".mlp.experts." in name and name.startswith("model.layers.3."):
            shape = sharding.mesh_layout(name, leaf.shape)
            spec = tuple(sharding.param_spec(name, config, mesh)) + (None,) * len(shape)
            assert all(dim % sizes.get(axis, 1) == 0 for dim, axis in zip(shape, spec)), name
            local[name.rsplit("experts.", 1)[1]] = tuple(dim // sizes.get(axis, 1) for dim, axis in zip(shape, spec))
    assert local == local_kernel_shapes(e, h, i)


# ---- loading and saving ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    from beam_jax.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("nvfp4")
    save_checkpoint(path, *nvfp4_model(2, jnp.float32))
    return path


def test_load_converts_when_asked(nvfp4_checkpoint):
    import beam_jax

    triton = beam_jax.load(nvfp4_checkpoint, expert_kernel="triton")
    assert not triton.config.mosaic_experts
    assert beam_jax.load(nvfp4_checkpoint).config.mosaic_experts == on_hopper()  # auto
    mosaic = beam_jax.load(nvfp4_checkpoint, expert_kernel="mosaic")
    assert mosaic.config.mosaic_experts
    assert not [n for n in flat_params(mosaic.params) if ".experts.gate_proj." in n]
    if jax.default_backend() == "cpu":  # fp32 here, differing in summation order only (GPU: the gpu test below)
        tokens = [[5, 17, 230, 11, 3, 90, 1]]
        want = np.asarray(triton.forward(tokens).logits)
        got = np.asarray(mosaic.forward(tokens).logits)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="expert_kernel must be one of"):
        beam_jax.load(nvfp4_checkpoint, expert_kernel="fast")
    # Refused before the weights are drawn: beam-tiny's hidden size (64) is below gate/up's K tile.
    with pytest.raises(ValueError, match=r"expert_kernel='mosaic' cannot hold these experts: gate/up need hidden_size"):
        beam_jax.load("beam-tiny", quantization="nvfp4", expert_kernel="mosaic")


def test_a_converted_model_cannot_be_saved(nvfp4_checkpoint, tmp_path):
    import beam_jax
    from beam_jax.checkpoint import save_checkpoint, save_orbax

    beam = beam_jax.load(nvfp4_checkpoint, expert_kernel="mosaic")
    for save, directory in ((save_checkpoint, tmp_path / "hf"), (save_orbax, tmp_path / "orbax")):
        with pytest.raises(ValueError, match="cannot save .*converted to the Mosaic kernel's layout.*'triton'"):
            save(directory, beam.config, beam.params)
        assert not directory.exists()  # nothing written
    with pytest.raises(ValueError, match="cannot write config.json"):
        beam.config.to_hf_dict()
    assert "mosaic_experts" not in beam_jax.load(nvfp4_checkpoint, expert_kernel="triton").config.to_hf_dict()


def test_serve_flag():
    from serving.cli import build_engine, engine_config, parser

    args = ["--model", "beam-tiny", "--dtype", "float32", "--quant", "nvfp4"]
    assert engine_config(parser().parse_args(args)).expert_kernel == "auto"
    assert engine_config(parser().parse_args([*args, "--expert-kernel", "triton"])).expert_kernel == "triton"
    with pytest.raises(SystemExit, match=r"error: expert_kernel='mosaic' cannot hold these experts: gate/up need"):
        build_engine(parser().parse_args([*args, "--expert-kernel", "mosaic"]))


def test_generate_flag():
    from beam_jax.cli import main

    with pytest.raises(SystemExit, match=r"error: expert_kernel='mosaic' cannot hold these experts: .*NVFP4 experts"):
        main(["generate", "--model", "beam-tiny", "--prompt-ids", "1,2", "--expert-kernel", "mosaic"])


# ---- on a mesh (8 CPU devices, in a subprocess) ------------------------------------------------------
def check_mesh_layout(directory: str) -> dict:
    """Load the checkpoint onto a TP x EP mesh in the kernel layout (a sliced read, then each device
    converts its shard), against the one-device checkpoint-layout forward."""
    import beam_jax

    tp, ep = MESH_LAYOUT
    mesh = sharding.make_mesh(tp=tp, ep=ep)
    want = beam_jax.load(directory, expert_kernel="triton")
    got = beam_jax.load(directory, mesh=mesh, expert_kernel="mosaic")
    run = sharding.sharded_forward(mesh, got.config)
    errors = {}
    for count in (1, 13, 20):  # 20: sorted blocks, where pairs of other devices' experts are dropped
        step = tokens_of(count, count, got.config.vocab_size)
        w, g = jit_forward(want.params, *step, config=want.config).logits, run(got.params, *step).logits
        errors[count] = float(np.abs(np.asarray(g) - np.asarray(w)).max() / np.abs(np.asarray(w)).max())
    placed = {}
    for name, array in flat_params(got.params).items():
        if ".experts." in name:
            spec = sharding.param_spec(name, got.config, mesh)
            placed[name] = [array.sharding.spec == spec, list(array.addressable_shards[0].data.shape)]
    kept = sharding.shard_params(got.params, mesh, got.config)  # what the serving runner does: nothing moves
    unmoved = all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(got.params)))
    refused = ""
    try:
        beam_jax.load(directory, mesh=sharding.make_mesh(tp=4, ep=2), expert_kernel="mosaic")
    except ValueError as error:
        refused = str(error)
    auto = beam_jax.load(directory, mesh=mesh).config.mosaic_experts
    return {"errors": errors, "placed": placed, "unmoved": unmoved, "refused": refused, "auto": auto,
            "converted": got.config.mosaic_experts}


def test_mesh_with_tp_and_ep(nvfp4_checkpoint):
    from tests.beam_jax.test_sharding import ROOT, result_of, worker_env

    proc = subprocess.run([sys.executable, "-m", "tests.beam_jax.test_kernel_layout", "mesh", str(nvfp4_checkpoint)],
                          cwd=ROOT, env=worker_env(8), capture_output=True, text=True, timeout=600, check=False)
    result = result_of(proc.returncode, proc.stdout, proc.stderr)
    assert result["converted"] and not result["auto"]
    assert all(err < 1e-4 for err in result["errors"].values()), result["errors"]  # fp32: summation order only
    tp, ep = MESH_LAYOUT
    config = fitting_config()
    e, h, i = config.num_experts // ep, config.hidden_size, config.moe_intermediate_size // tp
    shards = {name.rsplit("experts.", 1)[1]: shape for name, (spec_ok, shape) in result["placed"].items()
              if name.startswith("model.layers.1.")}
    assert shards == {name: list(shape) for name, shape in local_kernel_shapes(e, h, i).items()}
    assert all(spec_ok for spec_ok, _ in result["placed"].values()) and result["unmoved"]
    assert "tp=4, ep=2 mesh" in result["refused"] and "128/4 must be a multiple of 64" in result["refused"]


# ---- on a Hopper GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_mosaic_experts_match_the_triton_path(tmp_path):
    """On an H200: the model loaded with its experts converted (the default there) against the same
    checkpoint on today's path (Triton kernels / XLA), in bf16, at 1, 8 and 13 tokens."""
    import beam_jax
    from beam_jax.checkpoint import save_checkpoint

    seed = secrets.randbelow(2**31)
    save_checkpoint(tmp_path, *nvfp4_model(seed, config=fitting_config(ONE_SPARSE_LAYER)))
    triton = beam_jax.load(tmp_path, expert_kernel="triton")
    auto = beam_jax.load(tmp_path)
    assert auto.config.mosaic_experts == (jax.devices()[0].compute_capability == "9.0")
    mosaic = beam_jax.load(tmp_path, expert_kernel="mosaic")
    for count in (1, 8, 13):
        step = tokens_of(seed + count, count, triton.config.vocab_size)
        want = triton.forward(*step, hidden_layers=(1,))
        got = mosaic.forward(*step, hidden_layers=(1,))
        assert_bf16_close(got.hidden_states[0], want.hidden_states[0], f"layer output at {count} tokens (seed {seed})")
        assert_bf16_close(got.logits, want.logits, f"logits at {count} tokens (seed {seed})")



@pytest.mark.gpu
def test_gpu_paged_steps_pass_the_moe_counters_on(tmp_path):
    """On an H200: paged one-token steps of a model whose sparse layers run the one-launch NVFP4 kernel, its
    counters passed from sparse layer to sparse layer (`PagedBatch.moe_counters`): the logits as the same
    checkpoint's on the Triton path, and each step's counters come back one epoch a sparse layer further."""
    import beam_jax
    from beam_jax.checkpoint import save_checkpoint
    from pallas_kernels import nvfp4_fused_moe as nfm
    from tests.beam_jax.test_moe_kernel_path import paged_one_token_steps

    seed = secrets.randbelow(2**31)
    save_checkpoint(tmp_path, *nvfp4_model(seed))  # two sparse layers
    mosaic, triton = (beam_jax.load(tmp_path, expert_kernel=kernel) for kernel in ("mosaic", "triton"))
    want = paged_one_token_steps(triton.params, triton.config)
    for step, (got, ref) in enumerate(zip(paged_one_token_steps(mosaic.params, mosaic.config), want)):
        assert_bf16_close(got.logits, ref.logits, f"logits of step {step} (seed {seed})")
        counters = np.asarray(got.cache.batch.moe_counters).view(np.uint32)
        assert counters[0] == counters[1] == 2 * nfm.EPOCH, counters[:2]  # the zeroing wait: every call
        assert np.all(counters % nfm.EPOCH == 0) and counters.max() == 2 * nfm.EPOCH, counters

if __name__ == "__main__":
    check, *args = sys.argv[1:]
    print(json.dumps({"mesh": check_mesh_layout}[check](*args)))
