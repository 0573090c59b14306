"""The arch layer's Hopper synchronization wrappers (cuda_src/arch/arch.cuh, section "Hopper synchronization").

Compiled by NVRTC for sm_90a, each wrapper's test kernel (tests/sim/kernels/hopper_sync.cu, which
tests/sim/test_sim_hopper_sync.py launches on the simulator) shows its instruction in SASS:
  mbarrier.init -> SYNCS.EXCH.64; mbarrier.arrive -> SYNCS.ARRIVE.TRANS64.A1T0 (one arrival, no bytes);
  mbarrier.arrive.expect_tx -> SYNCS.ARRIVE.TRANS64 with a byte register; mbarrier.expect_tx ->
  SYNCS.ARRIVE.TRANS64.RED.A0TX; mbarrier.complete_tx -> SYNCS.ARRIVE.TRANS64.RED.A0TR; try_wait.parity ->
  SYNCS.PHASECHK.TRANS64.TRYWAIT; bar.sync / bar.arrive id, count -> BAR.SYNC.DEFER_BLOCKING / BAR.ARV with
  register operands; elect.sync -> ELECT; fence.proxy.async.shared::cta -> FENCE.VIEW.ASYNC.S.
fence.mbarrier_init.release.cluster leaves no instruction in a kernel launched without a cluster, so its
test reads the PTX (compute_90a).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuflash.kernels import nvrtc, targets
from cuflash.kernels.program import KernelInstance

REPO = Path(__file__).resolve().parent.parent
HOPPER_SYNC = REPO / "tests" / "sim" / "kernels" / "hopper_sync.cu"

SASS_CASES = [
    ("handoff_kernel", [r"\bSYNCS\.EXCH\.64\b", r"\bSYNCS\.ARRIVE\.TRANS64\.A1T0\b",
                        r"\bSYNCS\.ARRIVE\.TRANS64 RZ, \[[^\]]+\], R\d+", r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b"]),
    ("mbarrier_ops_kernel", [r"\bSYNCS\.ARRIVE\.TRANS64\.RED\.A0TX\b", r"\bSYNCS\.ARRIVE\.TRANS64\.RED\.A0TR\b",
                             r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b"]),
    ("named_barrier_kernel", [r"\bBAR\.SYNC\.DEFER_BLOCKING R\d+, (R\d+|0x[0-9a-f]+)", r"\bBAR\.ARV R\d+, "]),
    ("elect_kernel", [r"\bELECT\b"]),
    ("async_proxy_kernel", [r"\bFENCE\.VIEW\.ASYNC\.S\b"]),
]


def instance(kernel: str) -> KernelInstance:
    return KernelInstance(str(HOPPER_SYNC), f"simhopper::{kernel}")


def test_targets_know_sm_90a():
    assert targets.target("sm_90a").arch == "sm_90a"


@pytest.mark.parametrize("kernel, patterns", SASS_CASES, ids=[c[0] for c in SASS_CASES])
def test_wrapper_compiles_to_its_instruction(kernel, patterns):
    sass = nvrtc.dump_sass(nvrtc.compile_instance(instance(kernel), "sm_90a"))
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    for pattern in patterns:
        assert re.search(pattern, sass), f"{kernel}: no {pattern} in its SASS:\n{sass[:4000]}"


def test_fence_mbarrier_init_is_in_the_ptx():
    ptx = nvrtc.compile_instance(instance("handoff_kernel"), "compute_90a").code.decode(errors="replace")
    assert "fence.mbarrier_init.release.cluster;" in ptx
