"""The arch layer's Hopper warpgroup wrappers (cuda_src/arch/arch.cuh) compiled by NVRTC for sm_90a.

* wgmma<T, N> (SS) and wgmma_rs<T, N> compile to HGMMA.64xNx16 (descriptor operands gdesc[..]; A in registers for
  RS; .tnspA / .tnspB for the MN-major forms) between WARPGROUP.ARRIVE (wgmma.fence) and WARPGROUP.DEPBAR.LE
  (wgmma.wait_group), for every N of the m64nNk16 shapes (multiples of 8 up to 256); setmaxnreg_inc/_dec compile
  to USETMAXREG.TRY_ALLOC / .DEALLOC.
* The test kernel's planted early accumulator read makes ptxas inject a wait (C7517) and serialize the wgmma
  (C7519): on a GPU that bug costs time, not correctness; the simulator reports it (race mode) or shows it
  (normal mode: seed-dependent results).
* Uses outside sm_90a, other element types, bad N and bad register counts are compile-time errors.
* The kernels are tests/sim/kernels/hopper_wgmma.cu's, which tests/sim/test_sim_wgmma.py runs on the simulator.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuflash.kernels import nvrtc
from cuflash.kernels.program import KernelInstance

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "tests" / "sim" / "kernels" / "hopper_wgmma.cu"

SASS_CASES = [
    ("wgmma_kernel<__half, 64, false>",
     [r"\bWARPGROUP\.ARRIVE\b", r"\bHGMMA\.64x64x16\.F32 R\d+, gdesc\[UR\d+\]", r"\bWARPGROUP\.DEPBAR\.LE gsb0, 0x0\b"]),
    ("wgmma_kernel<__nv_bfloat16, 128, false>", [r"\bHGMMA\.64x128x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]"]),
    ("wgmma_kernel<__half, 256, false>", [r"\bHGMMA\.64x256x16\.F32 R\d+, gdesc\[UR\d+\]"]),
    ("wgmma_kernel<__nv_bfloat16, 32, true>",
     [r"\bHGMMA\.64x32x16\.F32\.BF16 R\d+, R\d+, gdesc\[UR\d+\], ", r"\bWARPGROUP\.ARRIVE\b"]),
    # The MN-major forms (imm-trans-a / -b): the descriptor operand marked .tnspA / .tnspB.
    ("wgmma_kernel<__half, 64, false, true, true>", [r"\bHGMMA\.64x64x16\.F32 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB, "]),
    ("wgmma_kernel<__half, 64, false, true, false>", [r"\bHGMMA\.64x64x16\.F32 R\d+, gdesc\[UR\d+\]\.tnspA, "]),
    ("wgmma_kernel<__half, 64, true, false, true>", [r"\bHGMMA\.64x64x16\.F32 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB, "]),
    # ptxas honours setmaxnreg only when it knows the count at entry: __launch_bounds__(384, 1) gives 168.
    ("setmaxnreg_kernel", [r"\bUSETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d+, 0xe8\b", r"\bUSETMAXREG\.DEALLOC\.CTAPOOL 0x28\b"]),
]


def sass_of(source: Path, name: str) -> str:
    compiled = nvrtc.compile_instance(KernelInstance(str(source), name), "sm_90a")
    sass = nvrtc.dump_sass(compiled)
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    return sass


@pytest.mark.parametrize("kernel, patterns", SASS_CASES, ids=[c[0] for c in SASS_CASES])
def test_wrapper_compiles_to_its_instruction(kernel, patterns):
    sass = sass_of(KERNELS, f"simwgmma::{kernel}")
    for pattern in patterns:
        assert re.search(pattern, sass), f"{kernel}: no {pattern} in its SASS:\n{sass[:4000]}"


def test_every_n_compiles(tmp_path):
    # One kernel issuing every m64nNk16 shape in turn into the same 128 accumulators.
    calls = "\n".join(
        f"  cuflash::arch::wgmma<__half, {n}>(reinterpret_cast<float (&)[{n // 2}]>(acc), d, d, true);"
        f" cuflash::arch::wgmma_commit(); cuflash::arch::wgmma_wait<0>(acc);" for n in range(8, 257, 8))
    source = tmp_path / "every_n.cu"
    source.write_text('#include "arch/arch.cuh"\nnamespace every {\n__global__ void __launch_bounds__(128) '
                      "kernel(float* out, uint64_t d) {\n  float acc[128] = {};\n  cuflash::arch::wgmma_fence();\n"
                      f"{calls}\n  for (int i = 0; i < 128; ++i) out[128 * threadIdx.x + i] = acc[i];\n}}\n}}\n")
    sass = sass_of(source, "every::kernel")
    shapes = sorted(int(n) for n in re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\b", sass))
    assert shapes == list(range(8, 257, 8))


@pytest.mark.parametrize("arch, call, message", [
    ("sm_90", "float acc[32]; cuflash::arch::wgmma<__half, 64>(acc, 0, 0, false);", "wgmma needs sm_90a"),
    ("sm_80", "cuflash::arch::wgmma_fence();", "wgmma needs sm_90a"),
    ("sm_80", "cuflash::arch::setmaxnreg_dec<40>();", "setmaxnreg needs sm_90a"),
    ("sm_90a", "float acc[32]; cuflash::arch::wgmma<float, 64>(acc, 0, 0, false);",
     "wgmma takes __half or __nv_bfloat16"),
    ("sm_90a", "float acc[6]; cuflash::arch::wgmma<__half, 12>(acc, 0, 0, false);", "a multiple of 8 in 8..256"),
    ("sm_90a", "cuflash::arch::wgmma_wait<8>();", "wgmma.wait_group takes 0..7"),
    ("sm_90a", "cuflash::arch::setmaxnreg_inc<20>();", "setmaxnreg takes a multiple of 8 in 24..256"),
    ("sm_90a", "(void)cuflash::arch::wgmma_desc<16>(nullptr, 16, 1024);", "swizzle 0, 32, 64 or 128 bytes"),
])
def test_wrappers_reject_misuse_at_compile_time(tmp_path, arch, call, message):
    source = tmp_path / "bad_wgmma.cu"
    source.write_text('#include "arch/arch.cuh"\nnamespace bad {\n__global__ void kernel() { ' + call + ' }\n}\n')
    with pytest.raises(nvrtc.CompileError, match=re.escape(message)):
        nvrtc.compile_instance(KernelInstance(str(source), "bad::kernel"), arch)
