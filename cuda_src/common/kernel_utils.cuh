// kernel_utils.cuh: the small helpers every kernel family shares, in one place.
//
// Only plain device functions and constants: NVRTC compiles this without a C++ library, and the
// simulator links every family into one library, so each helper exists exactly once.
#pragma once

#include "arch/arch.cuh"

namespace cuflash {

// Infinities by bit pattern: no <cmath>/<limits> under NVRTC, and -ffast-math style flags must not
// fold them away.
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7f800000u); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// log2(e): natural-log quantities (scores, the saved LSE) times this are base-2 quantities for ex2.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// tanh(x) = 1 - 2 / (e^(2x) + 1), the built-in softcap's (mask.cuh) and fast-math mods' (cuflash.flex._emit): one
// ex2, one approximate division. Its absolute error is a few float32 ulps of 1 (the softcapped score c tanh carries c
// times that, as a float32 score of size c does anyway); it saturates to +-1 without a NaN. Chosen over tanhf, whose
// longer sequence pushed the tensor-core backward past the register limit (spills). The division is __fdividef
// (rcp.approx and a multiply, 2 ulp): an IEEE division costs a range check and a slow-path call per score (the
// tensor-core forward had 28 such call sites in its softcap branch). __fdividef's one weak range, a divisor above
// 2^126 (x > 43.7), gives 0 and so t = 1, which is tanh there in float32.
__device__ __forceinline__ float tanh_by_exp2(float x) {
  return 1.f - __fdividef(2.f, arch::exp2_approx(x * (2.f * kLog2e)) + 1.f);
}

// Whether this launch differs from the one a kernel's traits describe: exactly SmemBytes of dynamic shared memory
// and a block of exactly BlockX x BlockY x 1 threads. The Python plans mirror the traits (each family's
// dynamic_smem_bytes and threads); any difference is a bug on one side, so every kernel tests this first and
// __trap()s before touching memory (tests/test_launch_shapes.py launches every catalog instance off its shape).
template <int SmemBytes, int BlockX, int BlockY = 1>
__device__ __forceinline__ bool launch_differs_from_traits() {
  return arch::dynamic_smem_size() != static_cast<unsigned>(SmemBytes) || blockDim.x != BlockX || blockDim.y != BlockY ||
         blockDim.z != 1;
}

}  // namespace cuflash
