"""Shared test configuration: the `gpu` marker and array helpers."""

from __future__ import annotations

import functools

import numpy as np
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


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype by name; bfloat16 comes from ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype="float32"):
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dt)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dt)
    return q, k, v
