"""ASan mode: out-of-bounds accesses the bounds checks cannot see, reported as KernelError in the parent.

Each test runs a module-level function in a child Python with libasan preloaded
(run_in_asan_subprocess); one child runs several scenarios to keep the cost of
starting instrumented Pythons down.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from simkit import kernel, run

ASAN_KERNELS = ["raw_global_overrun_kernel", "smem_overrun_kernel", "barrier_visibility_kernel", "trap_kernel"]


def _precompile_asan() -> None:
    sim.precompile([kernel(n) for n in ASAN_KERNELS], modes=("asan",))


def _raw_global_overrun(index: int) -> float:
    # 4096 bytes: above numpy's small-allocation cache, so the array has its own
    # heap block with ASan redzones around it.
    out = np.zeros(1024, np.float32)
    run("raw_global_overrun_kernel", 1, 32, out0=out, n=index)
    return float(out.sum())


def _smem_overrun(index: int) -> str:
    out = np.zeros(32, np.float32)
    run("smem_overrun_kernel", 1, 32, smem=500, out0=out, n=index)
    return sim.current_mode()


def _scenarios() -> dict:
    """Runs in the child: a clean kernel, then each planted bug; returns what happened."""
    results = {"mode": sim.current_mode()}
    out = np.zeros(2 * 64, np.int32)
    run("barrier_visibility_kernel", 2, 64, smem=256, out0=out)
    results["clean"] = int(out[0])
    for name, fn, arg in [
        ("global_ok", _raw_global_overrun, 1023),
        ("global_overrun", _raw_global_overrun, 1024),
        ("smem_ok", _smem_overrun, 124),
        ("smem_overrun", _smem_overrun, 125),
    ]:
        try:
            fn(arg)
            results[name] = "ok"
        except sim.KernelError as exc:
            results[name] = str(exc)
    # After reports, the library still works.
    run("barrier_visibility_kernel", 2, 64, smem=256, out0=out)
    results["clean_again"] = int(out[0])
    return results


@pytest.fixture(scope="module")
def scenarios():
    sim.run_in_asan_subprocess(_precompile_asan)
    return sim.run_in_asan_subprocess(_scenarios)


def test_child_ran_in_asan_mode(scenarios):
    assert scenarios["mode"] == "asan"
    assert scenarios["clean"] == 3 * 64 * 63 // 2
    assert scenarios["clean_again"] == scenarios["clean"]


def test_in_bounds_accesses_are_clean(scenarios):
    assert scenarios["global_ok"] == "ok"
    assert scenarios["smem_ok"] == "ok"


def test_global_overrun_caught(scenarios):
    text = scenarios["global_overrun"]
    assert "AddressSanitizer" in text and "heap-buffer-overflow" in text
    assert "kernel simtest::raw_global_overrun_kernel" in text


def test_shared_overrun_caught(scenarios):
    # smem is exactly 500 bytes: float index 125 is bytes 500..503, just past the end.
    text = scenarios["smem_overrun"]
    assert "AddressSanitizer" in text and "heap-buffer-overflow" in text
    assert "kernel simtest::smem_overrun_kernel" in text


def test_kernel_error_reaches_the_parent():
    with pytest.raises(sim.KernelError, match="heap-buffer-overflow") as info:
        sim.run_in_asan_subprocess(_raw_global_overrun, 1024)
    assert "simtest::raw_global_overrun_kernel" in info.value.message


def test_results_come_back():
    assert sim.run_in_asan_subprocess(_smem_overrun, 10) == "asan"


def test_asan_mode_refused_in_a_plain_interpreter():
    out = np.zeros(64, np.int32)
    with sim.checking("asan"), pytest.raises(RuntimeError, match="run_in_asan_subprocess"):
        run("barrier_visibility_kernel", 1, 64, smem=256, out0=out)
