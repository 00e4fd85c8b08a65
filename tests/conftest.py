"""Markers: `slow` tests run only with --run-slow; `gpu` tests only where JAX sees a GPU.
Both show up as skipped (with the reason) in the summary, never silently."""

import jax
import pytest


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    has_gpu = jax.default_backend() == "gpu"
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA GPU"))
