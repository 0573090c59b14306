"""Shared test configuration: the `gpu` marker and array helpers."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """CUDA devices visible through CuPy (0 when CuPy or a driver is missing)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return 0


def pytest_collection_modifyitems(config, items):
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
