"""The arch layer's tensor-core, async-copy and packing wrappers (cuda_src/arch/arch.cuh).

* Compiled by NVRTC for sm_80 and sm_90, each wrapper's test kernel shows its instruction in SASS:
  HMMA.16816 (f16 and bf16), LDSM (plain and transposed), LDGSTS (4/8-byte .ca and 16-byte .cg) with the
  commit/wait barriers, F2FP (f16x2 and bf16x2 packing).
* On the simulator, the wrappers that tests/sim/test_sim_tensor.py does not cover: 16-byte cp.async with
  zero fill, pack_float2 against NumPy's round-to-nearest-even, smem_address as byte offsets from an
  aligned shared base. (test_sim_tensor.py launches mma, ldmatrix and cp.async through cuflash::arch too.)
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cuflash import sim
from cuflash.kernels import nvrtc
from cuflash.kernels.program import KernelInstance

REPO = Path(__file__).resolve().parent.parent
WRAPPERS = REPO / "tests" / "kernels" / "arch_wrappers.cu"
TENSOR_OPS = REPO / "tests" / "sim" / "kernels" / "tensor_ops.cu"

ARGS_DTYPE = np.dtype([("in0", np.uint64), ("in1", np.uint64), ("out0", np.uint64), ("out1", np.uint64),
                       ("n", np.int32), ("mode", np.int32), ("width", np.int32), ("mask", np.uint32),
                       ("extra", np.int32), ("pad", np.int32)])

# (source, kernel, SASS instructions it must contain). Spellings cover sm_80 and sm_90's SASS.
SASS_CASES = [
    (TENSOR_OPS, "simtensor::mma_kernel<__half>", [r"\bHMMA\.16816\.F32\s"]),
    (TENSOR_OPS, "simtensor::mma_kernel<__nv_bfloat16>", [r"\bHMMA\.16816\.F32\.BF16\b"]),
    (TENSOR_OPS, "simtensor::ldmatrix_kernel<4, false>", [r"\bLDSM\.16\.M88\.4\b"]),
    (TENSOR_OPS, "simtensor::ldmatrix_kernel<2, true>", [r"\bLDSM\.16\.MT88\.2\b"]),
    (TENSOR_OPS, "simtensor::ldmatrix_kernel<1, false>", [r"\bLDSM\.16\.M88\b"]),
    (TENSOR_OPS, "simtensor::cp_async_kernel", [r"\bLDGSTS\.E\.64\b", r"\bLDGDEPBAR\b", r"\bDEPBAR\b"]),
    (WRAPPERS, "archtest::cp_async_kernel<16>", [r"\bLDGSTS\.E\.BYPASS\.(LTC128B\.)?128\b", r"\bLDGDEPBAR\b"]),
    (WRAPPERS, "archtest::cp_async_kernel<4>", [r"\bLDGSTS\.E\b(?!\.(64|128|BYPASS))"]),
    (WRAPPERS, "archtest::pack_kernel<__half>", [r"\bF2FP\.(F16\.F32\.)?PACK_AB\b"]),
    (WRAPPERS, "archtest::pack_kernel<__nv_bfloat16>", [r"\bF2FP\.BF16\.(F32\.)?PACK_AB\b"]),
    (TENSOR_OPS, "simtensor::ldmatrix_mma_kernel<__nv_bfloat16>",
     [r"\bLDSM\.16\.M88\.4\b", r"\bLDSM\.16\.MT88\.2\b", r"\bHMMA\.16816\.F32\.BF16\b"]),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source, kernel, patterns", SASS_CASES, ids=[c[1] for c in SASS_CASES])
def test_wrapper_compiles_to_its_instruction(arch, source, kernel, patterns):
    compiled = nvrtc.compile_instance(KernelInstance(str(source), kernel), arch)
    sass = nvrtc.dump_sass(compiled)
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    for pattern in patterns:
        assert re.search(pattern, sass), f"{kernel} on {arch}: no {pattern} in its SASS:\n{sass[:4000]}"


def _launch(kernel: str, threads: int, *, smem: int = 0, **arrays_and_ints):
    args = np.zeros((), ARGS_DTYPE)
    buffers = []
    for name, value in arrays_and_ints.items():
        if isinstance(value, np.ndarray):
            args[name] = value.ctypes.data
            buffers.append(value)
        else:
            args[name] = value
    return sim.launch(KernelInstance(str(WRAPPERS), f"archtest::{kernel}"), (1, 1, 1), (threads, 1, 1), smem,
                      args[()], buffers)


@pytest.mark.parametrize("src_bytes", [16, 12, 0])
def test_cp_async_16_bytes_copies_and_zero_fills(src_bytes):
    n = 32
    src = np.arange(1, 4 * n + 1, dtype=np.uint32)
    out = np.full(4 * n, 0xDEAD, dtype=np.uint32)
    rec = _launch("cp_async_kernel<16>", n, smem=16 * n, in0=src, out0=out, n=src_bytes)
    expected = src.reshape(n, 4).copy()
    expected[:, src_bytes // 4:] = 0
    np.testing.assert_array_equal(out.reshape(n, 4), expected)
    assert rec.global_bytes_read == n * src_bytes


@pytest.mark.parametrize("T, npdtype", [("__half", np.float16), ("__nv_bfloat16", ml_dtypes.bfloat16)])
def test_pack_float2_rounds_to_nearest_even_lo_in_the_low_half(T, npdtype):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(48).astype(np.float32) * 100,
                        np.array([0.0, -0.0, 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 1e30, -1e-30, np.inf, -np.inf,
                                  1 + 2**-8, 1 + 3 * 2**-8, 3.0, 2**-30, 7.5, -2.25, 0.1], np.float32)])
    out = np.zeros(x.size // 2, dtype=np.uint32)
    _launch(f"pack_kernel<{T}>", x.size // 2, in0=x, out0=out)
    with np.errstate(over="ignore"):  # 1e30 overflows float16 to inf, as cvt.rn does
        bits = x.astype(npdtype).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(out, bits[0::2] | bits[1::2] << 16)


def test_smem_address_is_the_byte_offset_from_an_aligned_shared_base():
    out = np.zeros(32, dtype=np.uint32)
    base = np.ones(32, dtype=np.uint32)
    _launch("smem_address_kernel", 32, smem=16 * 32, out0=out, out1=base)
    np.testing.assert_array_equal(out, 16 * np.arange(32))
    assert (base == 0).all(), "the shared base is 1024-byte aligned in the shared window (swizzle atoms rely on it)"


@pytest.mark.parametrize("call, message", [
    ("float d[4]; const unsigned a[4] = {}; const unsigned b[2] = {}; const float c[4] = {};"
     " cuflash::arch::mma_m16n8k16<float>(d, a, b, c);", "mma_m16n8k16 takes __half or __nv_bfloat16"),
    ("unsigned r[3]; cuflash::arch::ldmatrix<3, false>(r, nullptr);", "ldmatrix loads 1, 2 or 4 matrices"),
    ("cuflash::arch::cp_async<2>(nullptr, nullptr, 2);", "cp.async copies 4, 8 or 16 bytes"),
    ("(void)cuflash::arch::pack_float2<float>(1.f, 2.f);", "pack_float2 packs to __half or __nv_bfloat16"),
])
def test_wrappers_reject_wrong_types_at_compile_time(tmp_path, call, message):
    source = tmp_path / "bad_wrapper.cu"
    source.write_text('#include "arch/arch.cuh"\nnamespace bad {\n__global__ void kernel() { ' + call + ' }\n}\n')
    with pytest.raises(nvrtc.CompileError, match=re.escape(message)):
        nvrtc.compile_instance(KernelInstance(str(source), "bad::kernel"), "sm_80")
