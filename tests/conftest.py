"""Shared test configuration: the `gpu` marker and array helpers."""

from __future__ import annotations

import os

import pytest

# Test workers share one GPU: JAX must not grab 75% of its memory at start-up.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from cuflash.testing import gpu_count


def pytest_collection_modifyitems(config, items):
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
