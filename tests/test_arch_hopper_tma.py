"""The arch layer's TMA wrappers (cuda_src/arch/arch.cuh) compiled by NVRTC.

* tma_load<rank> compiles to UTMALDG.<rank>D after the mbarrier's expect-tx arrival (SYNCS.ARRIVE.TRANS64);
  tma_store<rank> to UTMASTG.<rank>D, bulk_reduce_add_f32 to UBLKRED, tma_store_commit to UTMACMDFLUSH and
  tma_store_wait_read<0> to DEPBAR.LE SB0, 0x0; the waits on the mbarrier are SYNCS.PHASECHK.TRANS64.TRYWAIT.
* cp.async.bulk.tensor is an sm_90 instruction (not one of sm_90a's architecture-specific features): the
  wrappers compile for sm_90 and sm_90a, and a use for sm_80 is a compile-time error.
* The kernels are tests/sim/kernels/hopper_tma.cu's, which tests/sim/test_sim_tma.py runs on the simulator.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuflash.kernels import nvrtc
from cuflash.kernels.program import KernelInstance

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "tests" / "sim" / "kernels" / "hopper_tma.cu"

SASS_CASES = [
    ("load_kernel<2>", "sm_90a", [r"\bSYNCS\.ARRIVE\.TRANS64 ", r"\bUTMALDG\.2D \[UR\d+\], \[UR\d+\]",
                                  r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT "]),
    ("load_kernel<5>", "sm_90a", [r"\bUTMALDG\.5D \[UR\d+\], \[UR\d+\]"]),
    ("store_kernel<3>", "sm_90a", [r"\bUTMASTG\.3D \[UR\d+\], \[UR\d+\]", r"\bUTMACMDFLUSH\b",
                                   r"\bDEPBAR\.LE SB0, 0x0\b"]),
    ("store_kernel<2>", "sm_90a", [r"\bUTMASTG\.2D \[UR\d+\], \[UR\d+\]"]),
    # bulk_reduce_add_f32: cp.reduce.async.bulk .add.f32 is the TMA unit's bulk reduce (UBLKRED), no per-thread RED;
    # tma_store_wait<0> (wait_group without .read) is a scoreboard wait as well.
    ("reduce_kernel", "sm_90a", [r"\bUBLKRED\b", r"\bUTMACMDFLUSH\b", r"\bDEPBAR\.LE SB0, 0x0\b"]),
    ("tma_wgmma_kernel", "sm_90a", [r"(?s)UTMALDG\.2D .*UTMALDG\.2D .*SYNCS\.PHASECHK\.TRANS64\.TRYWAIT .*HGMMA"]),
]


@pytest.mark.parametrize("kernel, arch, patterns", SASS_CASES, ids=[f"{c[0]}-{c[1]}" for c in SASS_CASES])
def test_wrapper_compiles_to_its_instruction(kernel, arch, patterns):
    compiled = nvrtc.compile_instance(KernelInstance(str(KERNELS), f"simtma::{kernel}"), arch)
    sass = nvrtc.dump_sass(compiled)
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    for pattern in patterns:
        assert re.search(pattern, sass), f"{kernel}: no {pattern} in its SASS:\n{sass[:4000]}"


def test_plain_sm_90_has_tma(tmp_path):
    # hopper_tma.cu also holds a wgmma kernel (sm_90a only): a kernel of its own for plain sm_90.
    source = tmp_path / "tma_sm90.cu"
    source.write_text('#include "arch/arch.cuh"\nnamespace plain {\n__global__ void kernel(const __grid_constant__ '
                      "cuflash::arch::TensorMap map) {\n  CUFLASH_DYNAMIC_SMEM(smem);\n  uint64_t* bar = "
                      "reinterpret_cast<uint64_t*>(smem);\n  cuflash::arch::tma_load_2d(smem + 128, &map, 1, 2, bar);\n"
                      "  cuflash::arch::mbarrier_wait(bar, 0);\n"
                      "  cuflash::arch::tma_store_2d(&map, smem + 128, 3, 4);\n"
                      "  cuflash::arch::tma_store_commit();\n  cuflash::arch::tma_store_wait_read<0>();\n}\n}\n")
    sass = nvrtc.dump_sass(nvrtc.compile_instance(KernelInstance(str(source), "plain::kernel"), "sm_90"))
    assert sass is not None
    for pattern in (r"\bUTMALDG\.2D ", r"\bUTMASTG\.2D ", r"\bUTMACMDFLUSH\b"):
        assert re.search(pattern, sass), f"no {pattern} in:\n{sass[:4000]}"


@pytest.mark.parametrize("arch, call, message", [
    ("sm_80", "int c[2] = {0, 0}; cuflash::arch::tma_load<2>(nullptr, m, c, nullptr);",
     "TMA (cp.async.bulk.tensor) needs sm_90 or later"),
    ("sm_80", "cuflash::arch::tma_load_2d(nullptr, m, 0, 0, nullptr);", "needs sm_90 or later"),
    ("sm_80", "cuflash::arch::tma_store_2d(m, nullptr, 0, 0);", "needs sm_90 or later"),
    ("sm_80", "cuflash::arch::tma_store_commit();", "TMA (cp.async.bulk) needs sm_90 or later"),
    ("sm_80", "cuflash::arch::tma_store_wait_read<0>();", "TMA (cp.async.bulk) needs sm_90 or later"),
    ("sm_90a", "int c[6] = {}; cuflash::arch::tma_store<6>(m, nullptr, c);", "tensor copies take 1 to 5 coordinates"),
])
def test_wrappers_reject_misuse_at_compile_time(tmp_path, arch, call, message):
    source = tmp_path / "bad_tma.cu"
    source.write_text('#include "arch/arch.cuh"\nnamespace bad {\n__global__ void kernel('
                      "const __grid_constant__ cuflash::arch::TensorMap map) { const cuflash::arch::TensorMap* m = "
                      "&map; " + call + " }\n}\n")
    with pytest.raises(nvrtc.CompileError, match=re.escape(message)):
        nvrtc.compile_instance(KernelInstance(str(source), "bad::kernel"), arch)
