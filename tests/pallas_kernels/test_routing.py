"""The routing kernels (interpret mode on CPU, compiled on a GPU) against the plain-jnp reference,
on fresh seeded random inputs: selections must be identical, weights equal to fp32 rounding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import routing as rt

ON_GPU = jax.default_backend() == "gpu"

# (tokens, hidden, experts, groups, groups kept, top_k): Beam's own 256/8/4/8 routing; odd sizes
# (hidden and experts not powers of two, 3 groups, hidden not a multiple of the K block); one token
# (one K block of 1024 per fused program: a hidden of 2100 ends in a partial one) and three tokens
# (the GEMV path, a token block with a padded row).
SHAPES = [(20, 100, 256, 8, 4, 8), (37, 42, 12, 3, 2, 3), (1, 64, 16, 4, 2, 4), (1, 300, 256, 8, 4, 8),
          (1, 2100, 256, 8, 4, 8), (3, 130, 40, 5, 3, 6)]


def _inputs(seed, tokens, hidden, experts):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, hidden)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal(experts) * 0.1, jnp.float32)
    return x, w, b


def _run(fn, x, w, b, **kwargs):
    return jax.jit(functools.partial(fn, **kwargs))(x, w, b)


def _check(x, w, b, *, tiles=None, **kwargs):
    want_w, want_i = _run(rt.routing_reference, x, w, b, **kwargs)
    got_w, got_i = _run(rt.routing_kernel, x, w, b, interpret=not ON_GPU, **(tiles or {}), **kwargs)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_selection_equals_reference(shape, fused):
    tokens, hidden, experts, groups, kept, top_k = shape
    x, w, b = _inputs(sum(shape), tokens, hidden, experts)
    _check(x, w, b, tiles=dict(fused=fused), num_groups=groups, groups_kept=kept, top_k=top_k, scaling=2.5)


@pytest.mark.parametrize("fused, tokens, real", [(False, 9, 5), (False, 9, 9), (False, 16, 1), (True, 3, 2),
                                                 (False, 70, 33)])
def test_padding_tokens_select_nothing(fused, tokens, real):
    """`num_tokens`: tokens from it on (a serving step's bucket padding) select expert -1 with weight 0
    (the two-kernel path skips their token blocks: here whole blocks of 4 and a block cut in two); the
    real tokens select as the reference. The reference path (`routing` off the kernel) masks alike."""
    x, w, b = _inputs(tokens + real, tokens, 96, 32)
    kwargs = dict(num_groups=4, groups_kept=2, top_k=4, scaling=2.5)
    want_w, want_i = _run(rt.routing_reference, x[:real], w, b, **kwargs)
    n = jnp.int32(real)
    for got_w, got_i in (jax.jit(functools.partial(rt.routing_kernel, fused=fused, interpret=not ON_GPU, **kwargs))(
                             x, w, b, num_tokens=n),
                         jax.jit(functools.partial(rt.routing, use_kernel=False, **kwargs))(x, w, b, num_tokens=n)):
        np.testing.assert_array_equal(np.asarray(got_i)[:real], np.asarray(want_i))
        np.testing.assert_allclose(np.asarray(got_w)[:real], np.asarray(want_w), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(got_i)[real:], -1)
        np.testing.assert_array_equal(np.asarray(got_w)[real:], 0.0)


@pytest.mark.parametrize("fused, tokens", [(True, 1), (True, 3), (False, 5)], ids=["fused1", "fused3", "two_kernels"])
def test_state_passed_from_call_to_call(fused, tokens):
    """`state=`: three calls in one jit (as three layers), each taking the state the one before returned, on
    different inputs: each selects as the reference, and the state comes back every slot `UNWRITTEN` (the fused
    kernel leaves it so; the two-kernel path passes it on). A state too short for a call's partials is passed on
    untouched (the call makes its own); one of another type is refused."""
    kwargs = dict(num_groups=4, groups_kept=2, top_k=4, scaling=2.5)
    inputs = [_inputs(100 * tokens + layer, tokens, 160, 32) for layer in range(3)]

    def layers(state):
        selections = []
        for x, w, b in inputs:
            got_w, got_i, state = rt.routing_kernel(x, w, b, fused=fused, state=state, interpret=not ON_GPU, **kwargs)
            selections.append((got_w, got_i))
        return selections, state

    for slots in (rt.STATE_SLOTS, 2):
        selections, state = jax.jit(layers)(rt.routing_state(slots))
        np.testing.assert_array_equal(np.asarray(state), np.asarray(rt.routing_state(slots)))
        for (x, w, b), (got_w, got_i) in zip(inputs, selections):
            want_w, want_i = _run(rt.routing_reference, x, w, b, **kwargs)
            np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
            np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    x, w, b = _inputs(7, 3, 160, 32)
    with pytest.raises(ValueError, match=r"state must be int32 \[slots\]"):
        rt.routing_kernel(x, w, b, fused=fused, state=jnp.zeros((4, 2), jnp.int32), interpret=True, **kwargs)


def test_fused_kernel_leaves_its_state_unwritten():
    """Whatever a passed state holds, every program writes its partials there before the last one reads them (on
    the CPU programs run in grid order; on a GPU the last one reads until none is `UNWRITTEN`), which then sets
    the slots of its partials back to `UNWRITTEN` and leaves the rest as they were."""
    kwargs = dict(num_groups=4, groups_kept=2, top_k=4)
    x, w, b = _inputs(13, 1, 160, 32)
    want_w, want_i = _run(rt.routing_reference, x, w, b, **kwargs)
    used = 3 * 32  # 3 K splits of 64 x 1 token x 32 experts
    for state in (rt.routing_state(128), jnp.arange(128, dtype=jnp.int32)):
        got_w, got_i, after = rt.routing_kernel(x, w, b, fused=True, block_k=64, state=state, interpret=True,
                                                **kwargs)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
        np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(after)[:used], rt.UNWRITTEN)
        np.testing.assert_array_equal(np.asarray(after)[used:], np.asarray(state)[used:])


@pytest.mark.parametrize("tiles", [dict(block_t=1, block_k=32, splits=3), dict(block_t=1, block_e=1, splits=1),
                                   dict(block_t=4, block_e=8, block_k=16),
                                   dict(block_t=16, block_e=32, block_k=32, splits=2)], ids=str)
def test_tilings_and_splits_select_alike(tiles):
    """Split sums over the hidden axis (a tail split), partial expert blocks, both logits paths."""
    x, w, b = _inputs(11, 5, 200, 48)
    _check(x, w, b, tiles=tiles, num_groups=6, groups_kept=2, top_k=5, scaling=2.5)


def test_unnormalized_weights():
    x, w, b = _inputs(3, 9, 64, 16)
    _check(x, w, b, num_groups=4, groups_kept=2, top_k=4, normalize=False)


@pytest.mark.parametrize("twins", ["across_groups", "inside_groups"])
def test_ties_go_to_the_lower_index(twins):
    """Duplicate router rows and a zero bias make exactly equal scores: expert e and e + 8 (other
    groups: tied group scores) or e and e + 1 (one group: a tied best, counted twice)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
    rows = rng.standard_normal((8, 64)) * 0.1
    w = np.concatenate([rows, rows]) if twins == "across_groups" else np.repeat(rows, 2, axis=0)
    _check(x, jnp.asarray(w, jnp.float32), jnp.zeros(16, jnp.float32), num_groups=4, groups_kept=1, top_k=3)


def test_ties_across_kept_groups_go_to_the_lower_index():
    """Experts 5, 10 and 15 copy experts 0, 1 and 2 (groups of 4, two kept): twins tie exactly, in groups whose
    scores differ, so that the later group often ranks first; the lower expert must still be picked first (the
    fused kernel's picks run on the kept groups in index order, not in rank order)."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
    w = rng.standard_normal((16, 64)) * 0.1
    w[[5, 10, 15]] = w[[0, 1, 2]]
    w = jnp.asarray(w, jnp.float32)
    kwargs = dict(num_groups=4, groups_kept=2, top_k=4)
    _, ids = _run(rt.routing_reference, x, w, jnp.zeros(16, jnp.float32), **kwargs)
    ids = np.asarray(ids)
    later_group_first = 0  # tokens that pick both of a pair of twins, the later twin's group ranked first
    scores = np.asarray(jax.nn.sigmoid(x.astype(jnp.float32) @ w.T)).reshape(64, 4, 4)
    group_scores = np.sort(scores, axis=2)[:, :, -2:].sum(2)
    for token in range(64):
        for low, high in ((0, 5), (1, 10), (2, 15)):
            picked = set(ids[token])
            if low in picked and high in picked and group_scores[token, high // 4] > group_scores[token, 0]:
                later_group_first += 1
    assert later_group_first >= 3
    for fused in (False, True):
        _check(x, w, jnp.zeros(16, jnp.float32), tiles=dict(fused=fused), **kwargs)


def test_logits_are_the_fp32_gemv():
    x, w, b = _inputs(9, 5, 100, 256)
    got = _run(rt.routing_kernel, x, w, b, num_groups=8, groups_kept=4, top_k=8, logits_only=True,
               interpret=not ON_GPU)
    want = jnp.einsum("th,eh->te", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,fused,padded", [(1, True, False), (1, False, False), (6, True, False),
                                                 (16, False, False), (16, False, True), (100, False, False)])
def test_kernels_lower_for_cuda(triton_for_sm90, tokens, fused, padded):
    """Beam's routing shape lowers to Triton for an sm_90 GPU (lowering only; runs on the CPU:
    interpret mode does not lower). `padded`: with a traced `num_tokens` (a serving step's)."""
    spec = jax.ShapeDtypeStruct
    args = [spec((tokens, 5120), jnp.bfloat16), spec((256, 5120), jnp.float32), spec((256,), jnp.float32)]
    args += [spec((), jnp.int32)] if padded else []
    op = functools.partial(rt.routing_kernel, num_groups=8, groups_kept=4, top_k=8, scaling=2.5, fused=fused)
    if padded:
        op = functools.partial(lambda x, w, b, n, op: op(x, w, b, num_tokens=n), op=op)
    text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == (1 if fused else 2)


def test_fused_kernel_with_a_passed_state_lowers_for_cuda(triton_for_sm90):
    """The fused kernel with a passed state (`state=`): one Triton kernel that keeps its partials in the passed
    array itself (without it, in a state made for the call, which XLA fills first)."""
    spec = jax.ShapeDtypeStruct
    args = [spec((1, 5120), jnp.bfloat16), spec((256, 5120), jnp.float32), spec((256,), jnp.float32),
            spec((rt.STATE_SLOTS,), jnp.int32)]
    op = functools.partial(rt.routing_kernel, num_groups=8, groups_kept=4, top_k=8, scaling=2.5, fused=True)
    text = jax.jit(lambda x, w, b, s: op(x, w, b, state=s)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "triton(%arg0, %arg1, %arg2, %arg3)" in text
    unchained = jax.jit(op).trace(*args[:3]).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton(%arg0, %arg1, %arg2, %0)" in unchained


def test_bad_grouping_is_rejected():
    x, w, b = _inputs(0, 2, 64, 12)
    with pytest.raises(ValueError, match="groups"):
        rt.routing_kernel(x, w, b, num_groups=5, groups_kept=2, top_k=2, interpret=True)
    with pytest.raises(ValueError, match="top_k"):
        rt.routing_kernel(x, w, b, num_groups=3, groups_kept=1, top_k=5, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
@pytest.mark.parametrize("inputs", ["exact_grid", "random"])
def test_100k_tokens_select_bit_for_bit(inputs, fused):
    """Beam's routing shape. On the exact grid every logit is exact in fp32 whatever the summation
    order, so any difference is a selection bug; plain random inputs agreed too when measured."""
    kx, kw, kb = jax.random.split(jax.random.key(7), 3)
    tokens, hidden, experts = 100_000, 5120, 256
    if inputs == "exact_grid":
        x = (jax.random.randint(kx, (tokens, hidden), -8, 9) / 16).astype(jnp.bfloat16)
        w = jax.random.randint(kw, (experts, hidden), -128, 129).astype(jnp.float32) / 2.0**16
        b = jax.random.randint(kb, (experts,), -64, 65).astype(jnp.float32) / 2.0**10
    else:
        x = jax.random.normal(kx, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(kw, (experts, hidden), jnp.float32) * 0.02
        b = jax.random.normal(kb, (experts,), jnp.float32) * 0.1
    _check(x, w, b, tiles=dict(fused=fused), num_groups=8, groups_kept=4, top_k=8, scaling=2.5)


@pytest.mark.gpu
def test_one_token_calls_in_a_row_select_bit_for_bit():
    """The fused one-token kernel called 5000 times in a row in one scan, its state passed from call to call as the
    model's layers pass it, on the exact grid of `test_100k_tokens_select_bit_for_bit` (logits exact in any
    summation order): each call's last program reads partials other programs may still be writing, so a call
    that selected on a partial not yet written would show."""
    kx, kw, kb = jax.random.split(jax.random.key(9), 3)
    tokens, hidden, experts = 5000, 5120, 256
    xs = (jax.random.randint(kx, (tokens, 1, hidden), -8, 9) / 16).astype(jnp.bfloat16)
    w = jax.random.randint(kw, (experts, hidden), -128, 129).astype(jnp.float32) / 2.0**16
    b = jax.random.randint(kb, (experts,), -64, 65).astype(jnp.float32) / 2.0**10
    kwargs = dict(num_groups=8, groups_kept=4, top_k=8, scaling=2.5)

    def call(state, x):
        weights, ids, state = rt.routing_kernel(x, w, b, fused=True, state=state, **kwargs)
        return state, (weights, ids)

    state, (got_w, got_i) = jax.jit(lambda xs: jax.lax.scan(call, rt.routing_state(), xs))(xs)
    want_w, want_i = _run(rt.routing_reference, xs[:, 0], w, b, **kwargs)
    np.testing.assert_array_equal(np.asarray(got_i)[:, 0], np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(got_w)[:, 0], np.asarray(want_w), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(state), rt.UNWRITTEN)


@pytest.mark.parametrize(("backend", "tokens", "kernel"), [("gpu", 1, True), ("gpu", rt.KERNEL_MAX_TOKENS, True),
                                                           ("gpu", rt.KERNEL_MAX_TOKENS + 1, False), ("cpu", 1, False)])
def test_routing_picks_the_kernel_for_gpu_decode_batches(monkeypatch, backend, tokens, kernel):
    calls = []
    monkeypatch.setattr(rt.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(rt, "routing_kernel", lambda *a, **k: calls.append("kernel"))
    monkeypatch.setattr(rt, "routing_reference", lambda *a, **k: calls.append("reference"))
    x, w, b = _inputs(1, tokens, 64, 16)
    rt.routing(x, w, b, num_groups=4, groups_kept=2, top_k=4)
    assert calls == ["kernel" if kernel else "reference"]
