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
//   - tensor cores:      mma_m16n8k16<T>    (mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16})
//   - shared -> regs:    ldmatrix<n, trans> (ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16)
//   - async copies:      cp_async<bytes>    (zero-filling or whole), cp_async_commit, cp_async_wait<n>
//                                           (cp.async.{ca,cg}, groups)
//   - 16-bit packing:    pack_float2<T>     (cvt.rn.{f16x2,bf16x2}.f32), smem_address (cvta to shared)
//   - Hopper sync:       mbarrier_init / arrive / arrive_expect_tx / expect_tx / complete_tx /
//                        try_wait_parity / wait, fence_mbarrier_init, fence_proxy_async,
//                        named_barrier_sync / arrive (bar.sync / bar.arrive), elect_one_sync (sm_90a)
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define CUFLASH_GPU 1
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#if defined(__CUDACC_RTC__)
// NVRTC has no <stdint.h>; the mbarrier wrappers take the 64-bit object as uint64_t*, as CUDA code spells it.
typedef unsigned long long uint64_t;
#endif
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

// ---- tensor cores, async copies, 16-bit packing ------------------------------------------
// Each wrapper below is one PTX instruction family. On the GPU it is inline PTX; in the
// simulator it forwards to the CPU twin (sim/sim_tensor.h, sim_runtime.cpp) with the kernel's
// call site, so every use in a kernel is its own warp-collective site. Signatures are the same on
// both sides; tests/test_arch_wrappers.py checks each wrapper's SASS (NVRTC, sm_80 and sm_90) and
// its simulator semantics.

// Operand types of mma.sync m16n8k16 and of the f32 -> 16-bit pair conversion.
template <class T> struct is_mma_operand { static constexpr bool value = false; static constexpr bool bf16 = false; };
template <> struct is_mma_operand<__half> { static constexpr bool value = true; static constexpr bool bf16 = false; };
template <> struct is_mma_operand<__nv_bfloat16> {
  static constexpr bool value = true;
  static constexpr bool bf16 = true;
};

#if CUFLASH_GPU

// 32-bit shared-window address of a pointer into shared memory (what ldmatrix / cp.async take).
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// D (16x8, f32) = A (16x16, T, row) * B (16x8, T, col) + C: mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32.
// The PTX type ("f16" / "bf16") is pasted into the one instruction text.
#define CUFLASH_MMA_M16N8K16(ptx_type)                                                                          \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ptx_type "." ptx_type                                   \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                                 \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), \
                 "f"(c[3]))
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                             const float (&c)[4]) {
  static_assert(is_mma_operand<T>::value, "mma_m16n8k16 takes __half or __nv_bfloat16 operands");
  if constexpr (is_mma_operand<T>::bf16)
    CUFLASH_MMA_M16N8K16("bf16");
  else
    CUFLASH_MMA_M16N8K16("f16");
}
#undef CUFLASH_MMA_M16N8K16

// kCount 8x8 b16 matrices from shared memory (lane l gives row l % 8 of matrix l / 8), optionally
// transposed: ldmatrix.sync.aligned.m8n8.x{1,2,4}{,.trans}.shared.b16. `trans` is "" or ".trans".
#define CUFLASH_LDMATRIX_X1(trans) \
  asm volatile("ldmatrix.sync.aligned.m8n8.x1" trans ".shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(address))
#define CUFLASH_LDMATRIX_X2(trans)                                                      \
  asm volatile("ldmatrix.sync.aligned.m8n8.x2" trans ".shared.b16 {%0,%1}, [%2];"       \
               : "=r"(r[0]), "=r"(r[1])                                                 \
               : "r"(address))
#define CUFLASH_LDMATRIX_X4(trans)                                                      \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4" trans ".shared.b16 {%0,%1,%2,%3}, [%4];" \
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                         \
               : "r"(address))
template <int kCount, bool kTrans>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[kCount], const void* smem_row) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const unsigned address = smem_address(smem_row);
  if constexpr (kCount == 1 && kTrans) CUFLASH_LDMATRIX_X1(".trans");
  if constexpr (kCount == 1 && !kTrans) CUFLASH_LDMATRIX_X1("");
  if constexpr (kCount == 2 && kTrans) CUFLASH_LDMATRIX_X2(".trans");
  if constexpr (kCount == 2 && !kTrans) CUFLASH_LDMATRIX_X2("");
  if constexpr (kCount == 4 && kTrans) CUFLASH_LDMATRIX_X4(".trans");
  if constexpr (kCount == 4 && !kTrans) CUFLASH_LDMATRIX_X4("");
}
#undef CUFLASH_LDMATRIX_X1
#undef CUFLASH_LDMATRIX_X2
#undef CUFLASH_LDMATRIX_X4

// Asynchronous copy of kBytes (4, 8 or 16) from global to shared memory; only the first src_bytes
// are read, the rest of the destination is zero-filled. 16-byte copies bypass L1 (.cg).
template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* global_src, int src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst = smem_address(smem_dst);
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global_src), "r"(src_bytes)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(global_src), "n"(kBytes),
                 "r"(src_bytes)
                 : "memory");
}
// The same for a copy known to be whole (kBytes read, nothing zero-filled): the form without src-size. With one,
// ptxas spends about five more instructions per copy encoding the fill (the tc kernels' copy loops).
template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* global_src) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst = smem_address(smem_dst);
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(global_src), "n"(kBytes) : "memory");
}
// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(kPending >= 0 && kPending < 8, "cp.async.wait_group takes 0..7");
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Two floats rounded to nearest-even 16-bit values in one register, lo in bits 0..15:
// cvt.rn.{f16x2,bf16x2}.f32 (its first source goes to the upper half).
template <class T>
__device__ __forceinline__ unsigned pack_float2(float lo, float hi) {
  static_assert(is_mma_operand<T>::value, "pack_float2 packs to __half or __nv_bfloat16");
  unsigned r;
#define CUFLASH_CVT_PACK(ptx_type) asm("cvt.rn." ptx_type "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo))
  if constexpr (is_mma_operand<T>::bf16)
    CUFLASH_CVT_PACK("bf16");
  else
    CUFLASH_CVT_PACK("f16");
#undef CUFLASH_CVT_PACK
  return r;
}

#else  // the simulator: forward to the CPU twins, passing the kernel's call site on.

__forceinline__ unsigned smem_address(const void* p) { return sim::shared_window_address(p); }

template <class T>
__forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4],
                                  CUFLASH_SIM_SITE_PARAMS) {
  static_assert(is_mma_operand<T>::value, "mma_m16n8k16 takes __half or __nv_bfloat16 operands");
  sim::mma_m16n8k16<T>(d, a, b, c, site_);
}

template <int kCount, bool kTrans>
__forceinline__ void ldmatrix(unsigned (&r)[kCount], const void* smem_row, CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "ldmatrix loads 1, 2 or 4 matrices");
  sim::ldmatrix<kCount, kTrans>(r, smem_row, site_);
}

template <int kBytes>
__forceinline__ void cp_async(void* smem_dst, const void* global_src, int src_bytes, CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  sim::cp_async(smem_dst, global_src, kBytes, static_cast<unsigned>(src_bytes), site_);
}
template <int kBytes>
__forceinline__ void cp_async(void* smem_dst, const void* global_src, CUFLASH_SIM_SITE_PARAMS) {
  cp_async<kBytes>(smem_dst, global_src, kBytes, site_);  // the whole form is a src-size of kBytes
}
__forceinline__ void cp_async_commit() { sim::cp_async_commit(); }
template <int kPending>
__forceinline__ void cp_async_wait() {
  static_assert(kPending >= 0 && kPending < 8, "cp.async.wait_group takes 0..7");
  sim::cp_async_wait(kPending);
}

template <class T>
__forceinline__ unsigned pack_float2(float lo, float hi) {
  static_assert(is_mma_operand<T>::value, "pack_float2 packs to __half or __nv_bfloat16");
  if constexpr (is_mma_operand<T>::bf16)
    return sim::float_to_bfloat16_bits(lo) | static_cast<unsigned>(sim::float_to_bfloat16_bits(hi)) << 16;
  else
    return sim::float_to_half_bits(lo) | static_cast<unsigned>(sim::float_to_half_bits(hi)) << 16;
}

#endif  // CUFLASH_GPU

// ---- Hopper synchronization: mbarrier, named barriers, elect.sync, proxy fences -------------------
// One PTX instruction each (sm_90a; emitted only where a kernel calls them, so sm_80 kernels never see
// them). The simulator's twins are in sim/sim_mbarrier.h and sim/sim_mbarrier.cpp (the README's
// section "Hopper synchronization"); tests/test_arch_hopper_sync.py checks each wrapper's SASS. An
// mbarrier is a 64-bit object in shared memory; `bar` points at it.

#if CUFLASH_GPU

// mbarrier.init.shared::cta.b64: expected arrivals per phase (1 .. 2^20 - 1), phase 0, tx-count 0.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}
// Makes the initializations visible to the other threads (and the async proxy): before they use the objects.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival (release semantics): mbarrier.arrive.shared::cta.b64.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}
// Raises the phase's transaction count by `bytes`, then one arrival: mbarrier.arrive.expect_tx.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// Raises the transaction count without arriving: mbarrier.expect_tx.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// Lowers the transaction count by `bytes` (what a TMA copy does as its bytes land): mbarrier.complete_tx.
__device__ __forceinline__ void mbarrier_complete_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// True when the phase of parity `phase` (the current one or the one before it) has completed; may give up
// after a hardware time limit: mbarrier.try_wait.parity.
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n .reg .pred complete;\n mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
      " selp.u32 %0, 1, 0, complete;\n}"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(phase)
      : "memory");
  return done != 0;
}
// Waits until the phase of parity `phase` has completed (acquire): try_wait.parity in a loop.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned phase) {
  asm volatile(
      "{\n .reg .pred complete;\n wait_for_phase:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 complete, [%0], %1;\n @!complete bra wait_for_phase;\n}" ::"r"(
          smem_address(bar)),
      "r"(phase)
      : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory writes before its later async-proxy accesses
// (a wgmma or TMA store reading them): fence.proxy.async.shared::cta.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// bar.sync id, threads: waits until `threads` threads (a multiple of 32) arrived at barrier `id` (1 .. 15).
__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.arrive id, threads: arrives at barrier `id` without waiting.
__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// True in exactly one lane of the (whole, converged) warp: elect.sync _|P, 0xffffffff.
__device__ __forceinline__ bool elect_one_sync() {
  unsigned elected;
  asm volatile(
      "{\n .reg .pred leader;\n elect.sync _|leader, 0xffffffff;\n selp.u32 %0, 1, 0, leader;\n}"
      : "=r"(elected));
  return elected != 0;
}

#else  // the simulator: the twins of sim/sim_mbarrier.h, with the kernel's call site.

__forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals, CUFLASH_SIM_SITE_PARAMS) {
  sim::mbarrier_init(CUFLASH_SIM_SITE("mbarrier.init"), bar, arrivals);
}
__forceinline__ void fence_mbarrier_init() { sim::fence_mbarrier_init(); }
__forceinline__ void mbarrier_arrive(uint64_t* bar, CUFLASH_SIM_SITE_PARAMS) {
  sim::mbarrier_arrive(CUFLASH_SIM_SITE("mbarrier.arrive"), bar, false, 0);
}
__forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes, CUFLASH_SIM_SITE_PARAMS) {
  sim::mbarrier_arrive(CUFLASH_SIM_SITE("mbarrier.arrive.expect_tx"), bar, true, bytes);
}
__forceinline__ void mbarrier_expect_tx(uint64_t* bar, unsigned bytes, CUFLASH_SIM_SITE_PARAMS) {
  sim::mbarrier_expect_tx(CUFLASH_SIM_SITE("mbarrier.expect_tx"), bar, bytes);
}
__forceinline__ void mbarrier_complete_tx(uint64_t* bar, unsigned bytes, CUFLASH_SIM_SITE_PARAMS) {
  sim::mbarrier_complete_tx(CUFLASH_SIM_SITE("mbarrier.complete_tx"), bar, bytes);
}
__forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, unsigned phase, CUFLASH_SIM_SITE_PARAMS) {
  return sim::mbarrier_try_wait_parity(CUFLASH_SIM_SITE("mbarrier.try_wait.parity"), bar, phase);
}
__forceinline__ void mbarrier_wait(uint64_t* bar, unsigned phase, CUFLASH_SIM_SITE_PARAMS) {
  sim::mbarrier_wait_parity(CUFLASH_SIM_SITE("mbarrier_wait"), bar, phase);
}
__forceinline__ void fence_proxy_async() { sim::fence_proxy_async(); }
__forceinline__ void named_barrier_sync(unsigned id, unsigned threads, CUFLASH_SIM_SITE_PARAMS) {
  sim::named_barrier(CUFLASH_SIM_SITE("bar.sync"), id, threads, true);
}
__forceinline__ void named_barrier_arrive(unsigned id, unsigned threads, CUFLASH_SIM_SITE_PARAMS) {
  sim::named_barrier(CUFLASH_SIM_SITE("bar.arrive"), id, threads, false);
}
__forceinline__ bool elect_one_sync(CUFLASH_SIM_SITE_PARAMS) { return sim::elect_one_sync(site_); }

#endif  // CUFLASH_GPU

}  // namespace arch
}  // namespace cuflash
