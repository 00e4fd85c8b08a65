"""Fixtures of the Pallas kernel tests."""

from __future__ import annotations

import types

import pytest


@pytest.fixture
def triton_for_sm90(monkeypatch):
    """Pallas' Triton lowering asks the local GPU for its compute capability; on the CPU it says
    sm_90 (Hopper), so `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` lowers the
    kernels as for the H200 (lowering only: catches Triton lowering errors without a GPU)."""
    from jax._src.pallas.triton import pallas_call_registration

    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
