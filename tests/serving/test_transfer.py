"""serving/transfer.py: a pytree of step arrays through one int32 array and back, bit for bit, both
ways (host -> program, program -> host); dtypes that cannot travel are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving import transfer
from serving.sampling import SamplerOutput


def random_tree(rng):
    """The kinds of leaves a step has: int32 and uint32 (keys), float32 with inf, nan and -0.0, bools,
    an empty array and a scalar; nested in tuples and a NamedTuple, with a None."""
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats.flat[:3] = [np.inf, -0.0, np.nan]
    return (
        rng.integers(-2**31, 2**31 - 1, (4,), dtype=np.int64).astype(np.int32),
        {"keys": rng.integers(0, 2**32 - 1, (2, 2), dtype=np.uint64).astype(np.uint32), "none": None},
        SamplerOutput(rng.integers(0, 9, (3,)).astype(np.int32), floats[0], np.zeros((3, 0), np.int32), floats),
        rng.random(7) < 0.5,
        np.float32(2.5),
    )


def assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))  # bit for bit


@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_both_ways(seed):
    tree = random_tree(np.random.default_rng(seed))
    words, layout = transfer.pack(tree)
    assert words.dtype == np.int32 and words.shape == (layout.size,)
    in_program = jax.jit(transfer.unpack, static_argnums=1)(jnp.asarray(words), layout)
    assert_same(in_program, tree)

    out_layouts = []

    def back(words):
        out, layout_out = transfer.pack_traced(transfer.unpack(words, layout))
        out_layouts.append(layout_out)
        return out

    fetched = np.asarray(jax.jit(back)(words))
    assert out_layouts[0] == layout  # the same tree, the same layout
    assert_same(transfer.unpack_host(fetched, out_layouts[0]), tree)


def test_bad_dtypes_and_sizes_are_refused():
    with pytest.raises(ValueError, match="int64"):
        transfer.pack((np.zeros(2, np.int32), np.zeros(3, np.int64)))
    with pytest.raises(ValueError, match="float16"):
        jax.jit(lambda x: transfer.pack_traced([x])[0])(jnp.zeros(2, jnp.float16))
    words, layout = transfer.pack([np.arange(4, dtype=np.int32)])
    with pytest.raises(ValueError, match="3 words for a layout of 4"):
        transfer.unpack_host(words[:3], layout)
