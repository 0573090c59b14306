// The arch layer: the only place where inline PTX and arch-specific
// intrinsics may appear. Every function here has a CPU twin with the same
// signature in sim/cuda_sim.h, so a kernel that includes this header compiles
// unchanged for NVRTC (sm_80, sm_90) and for the host simulator (g++).
//
// Kernels reach global memory only through load/store/atomic_add below: on the
// GPU they are plain accesses; in the simulator they are bounds-checked against
// the launch's buffers and counted (bytes read / written per launch).
//
// Instruction families (each guarded by static checks on the types it takes):
//   - special registers: dynamic_smem_size  (mov %dynamic_smem_size)
//   - exponentials:      exp2_approx        (ex2.approx.ftz.f32)
//   - global memory:     load / store / atomic_add (red.global.add.f32)
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define CUFLASH_GPU 1
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// Shared memory is only dynamic: one byte array per block, sized by the launch plan.
#define CUFLASH_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#define CUFLASH_GPU 0
#include "sim/cuda_sim.h"
#endif

#include "../common/attention_params.cuh"

namespace cuflash {

// ---- element types -------------------------------------------------------
// The three element types kernels are instantiated for. Math is always float32.
template <class T> struct is_element_type { static constexpr bool value = false; };
template <> struct is_element_type<float> { static constexpr bool value = true; };
template <> struct is_element_type<__half> { static constexpr bool value = true; };
template <> struct is_element_type<__nv_bfloat16> { static constexpr bool value = true; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

namespace arch {

#if CUFLASH_GPU

template <class T> struct is_global_word {
  static constexpr bool value = sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16;
};

// Global memory. Plain accesses on the GPU; the simulator's twin counts and checks them.
template <class T> __device__ __forceinline__ T load(const T* p) {
  static_assert(is_global_word<T>::value, "global loads move 2, 4, 8 or 16 bytes");
  return *p;
}
template <class T> __device__ __forceinline__ void store(T* p, T v) {
  static_assert(is_global_word<T>::value, "global stores move 2, 4, 8 or 16 bytes");
  *p = v;
}
// Float32 reduction into global memory; the result is not needed, so red (not atom).
__device__ __forceinline__ void atomic_add(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// Bytes of dynamic shared memory this launch was given (kernels check their need).
__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// 2^x, within 2 ulp; -inf -> +0 (what FlashAttention's online softmax relies on).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#endif  // CUFLASH_GPU: the CPU twins are in sim/cuda_sim.h, namespace cuflash::arch.

}  // namespace arch
}  // namespace cuflash
