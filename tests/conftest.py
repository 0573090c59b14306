"""Shared test configuration: the `gpu` marker and array helpers."""

from __future__ import annotations

import pytest

from cuflash.testing import gpu_count


def pytest_collection_modifyitems(config, items):
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
