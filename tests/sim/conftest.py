"""Simulator tests: build every test kernel once, as one library, before the tests run.

Without this each kernel instance would get its own library (one g++ run each)
at first launch. The build is cached on disk and locked, so pytest-xdist workers
share it.
"""

from __future__ import annotations

import pytest

import cuflash.sim as sim
from simkit import all_kernels


@pytest.fixture(scope="session", autouse=True)
def _precompiled_sim_test_kernels():
    sim.precompile(all_kernels(), modes=("normal",))
