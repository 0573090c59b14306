"""The arch layer's tensor-core, async-copy and packing wrappers (cuda_src/arch/arch.cuh).

* Compiled by NVRTC for sm_80 and sm_90, each wrapper's test kernel shows its instruction in SASS:
  HMMA.16816 (f16 and bf16), LDSM (plain and transposed), LDGSTS (4/8-byte .ca, 16-byte .cg zero-filling
  and whole) with the commit/wait barriers, F2FP (f16x2 and bf16x2 packing).
* The kernels are tests/sim/kernels/tensor_ops.cu's, which tests/sim/test_sim_tensor.py launches on the
  simulator (every wrapper, through cuflash::arch only).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuflash.kernels import nvrtc
from cuflash.kernels.program import KernelInstance

REPO = Path(__file__).resolve().parent.parent
TENSOR_OPS = REPO / "tests" / "sim" / "kernels" / "tensor_ops.cu"

# (tensor_ops.cu kernel, SASS instructions it must contain). Spellings cover sm_80 and sm_90's SASS.
SASS_CASES = [
    ("mma_kernel<__half>", [r"\bHMMA\.16816\.F32\s"]),
    ("mma_kernel<__nv_bfloat16>", [r"\bHMMA\.16816\.F32\.BF16\b"]),
    ("ldmatrix_kernel<4, false>", [r"\bLDSM\.16\.M88\.4\b"]),
    ("ldmatrix_kernel<2, true>", [r"\bLDSM\.16\.MT88\.2\b"]),
    ("ldmatrix_kernel<1, false>", [r"\bLDSM\.16\.M88\b"]),
    ("cp_async_kernel", [r"\bLDGSTS\.E\.64\b", r"\bLDGDEPBAR\b", r"\bDEPBAR\b"]),
    ("cp_async_bytes_kernel<16>", [r"\bLDGSTS\.E\.BYPASS\.(LTC128B\.)?128\.ZFILL\b", r"\bLDGDEPBAR\b"]),
    ("cp_async_bytes_kernel<16, true>", [r"\bLDGSTS\.E\.BYPASS\.(LTC128B\.)?128 ", r"\bLDGDEPBAR\b"]),
    ("cp_async_bytes_kernel<4>", [r"\bLDGSTS\.E\b(?!\.(64|128|BYPASS))"]),
    ("pack_kernel<__half>", [r"\bF2FP\.(F16\.F32\.)?PACK_AB\b"]),
    ("pack_kernel<__nv_bfloat16>", [r"\bF2FP\.BF16\.(F32\.)?PACK_AB\b"]),
    ("ldmatrix_mma_kernel<__nv_bfloat16>",
     [r"\bLDSM\.16\.M88\.4\b", r"\bLDSM\.16\.MT88\.2\b", r"\bHMMA\.16816\.F32\.BF16\b"]),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kernel, patterns", SASS_CASES, ids=[c[0] for c in SASS_CASES])
def test_wrapper_compiles_to_its_instruction(arch, kernel, patterns):
    compiled = nvrtc.compile_instance(KernelInstance(str(TENSOR_OPS), f"simtensor::{kernel}"), arch)
    sass = nvrtc.dump_sass(compiled)
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    for pattern in patterns:
        assert re.search(pattern, sass), f"{kernel} on {arch}: no {pattern} in its SASS:\n{sass[:4000]}"


def test_stmatrix_is_one_matrix_store_on_sm90_and_refused_before():
    """arch::stmatrix: STSM on sm_90 (the Hopper backward's P^T and dS^T tiles), x4 and x1; a compile error naming
    the instruction for an older arch, not a ptxas failure."""
    for count, pattern in ((4, r"\bSTSM\.16\.M88\.4\b"), (1, r"\bSTSM\.16\.M88\b")):
        instance = KernelInstance(str(TENSOR_OPS), f"simtensor::stmatrix_kernel<{count}>")
        sass = nvrtc.dump_sass(nvrtc.compile_instance(instance, "sm_90"))
        assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
        assert re.search(pattern, sass), sass[:4000]
    with pytest.raises(nvrtc.CompileError, match=re.escape("stmatrix needs sm_90")):
        nvrtc.compile_instance(KernelInstance(str(TENSOR_OPS), "simtensor::stmatrix_kernel<4>"), "sm_80")


def test_atomic_add2_is_one_vector_reduction_on_sm90_and_refused_before():
    """arch::atomic_add2: one REDG of two floats on sm_90 (the Hopper backward's dQ adds); a compile error naming
    the instruction for an older arch, not a ptxas failure."""
    instance = KernelInstance(str(TENSOR_OPS), "simtensor::atomic_add2_kernel<0>")
    sass = nvrtc.dump_sass(nvrtc.compile_instance(instance, "sm_90"))
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    assert re.search(r"\bREDG\.E\.ADD\.F32x2\b", sass), sass[:4000]
    with pytest.raises(nvrtc.CompileError, match=re.escape("red.global.add.v2.f32 needs sm_90")):
        nvrtc.compile_instance(instance, "sm_80")


@pytest.mark.parametrize("call, message", [
    ("float d[4]; const unsigned a[4] = {}; const unsigned b[2] = {}; const float c[4] = {};"
     " cuflash::arch::mma_m16n8k16<float>(d, a, b, c);", "mma_m16n8k16 takes __half or __nv_bfloat16"),
    ("unsigned r[3]; cuflash::arch::ldmatrix<3, false>(r, nullptr);", "ldmatrix loads 1, 2 or 4 matrices"),
    ("const unsigned r[3] = {}; cuflash::arch::stmatrix<3>(nullptr, r);", "stmatrix stores 1, 2 or 4 matrices"),
    ("cuflash::arch::cp_async<2>(nullptr, nullptr, 2);", "cp.async copies 4, 8 or 16 bytes"),
    ("(void)cuflash::arch::pack_float2<float>(1.f, 2.f);", "pack_float2 packs to __half or __nv_bfloat16"),
])
def test_wrappers_reject_wrong_types_at_compile_time(tmp_path, call, message):
    source = tmp_path / "bad_wrapper.cu"
    source.write_text('#include "arch/arch.cuh"\nnamespace bad {\n__global__ void kernel() { ' + call + ' }\n}\n')
    with pytest.raises(nvrtc.CompileError, match=re.escape(message)):
        nvrtc.compile_instance(KernelInstance(str(source), "bad::kernel"), "sm_80")
