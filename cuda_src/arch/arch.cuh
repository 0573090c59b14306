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
//   - exponentials:      exp2_approx        (ex2.approx.ftz.f32), log2_approx (lg2.approx.ftz.f32)
//   - global memory:     load / store / atomic_add (red.global.add.f32), atomic_add2 (red.global.add.v2.f32,
//                        sm_90)
//   - tensor cores:      mma_m16n8k16<T>    (mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16})
//   - shared -> regs:    ldmatrix<n, trans> (ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16)
//   - regs -> shared:    stmatrix<n>        (stmatrix.sync.aligned.m8n8.x{1,2,4}.shared.b16, sm_90)
//   - async copies:      cp_async<bytes>    (zero-filling or whole), cp_async_commit, cp_async_wait<n>
//                                           (cp.async.{ca,cg}, groups)
//   - 16-bit packing:    pack_float2<T>     (cvt.rn.{f16x2,bf16x2}.f32), smem_address (cvta to shared)
//   - Hopper sync:       mbarrier_init / arrive / arrive_expect_tx / expect_tx / complete_tx /
//                        try_wait_parity / wait, fence_mbarrier_init, fence_proxy_async,
//                        named_barrier_sync / arrive (bar.sync / bar.arrive), elect_one_sync (sm_90a)
//   - Hopper (sm_90a):   wgmma<T, N> / wgmma_rs<T, N>, wgmma_fence / commit / wait<n>, wgmma_desc<swizzle>
//                        (wgmma.mma_async m64nNk16 and its fences), setmaxnreg_inc / _dec<n>
//   - Hopper TMA:        TensorMap, tma_load<rank> / tma_load_2d, tma_store<rank> / tma_store_2d,
//                        bulk_reduce_add_f32 (cp.reduce.async.bulk .add.f32), tma_store_wait<n>,
//                        tma_store_commit, tma_store_wait_read<n> (cp.async.bulk.tensor, bulk groups)
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define CUFLASH_GPU 1
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#if defined(__CUDACC_RTC__)
// NVRTC has no <stdint.h>; the mbarrier and wgmma wrappers take uint64_t as CUDA code spells it. glibc's
// uint64_t on 64-bit Linux is unsigned long, so this typedef agrees with it should both ever be seen.
typedef unsigned long uint64_t;
static_assert(sizeof(uint64_t) == 8, "uint64_t: unsigned long is not 64 bits on this target");
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
// Two float32 reductions into p[0] and p[1] by one instruction (the vector red, sm_90 and newer; p 8-byte aligned).
// Each element is its own atomic reduction (PTX ISA: a vector red acts element-wise), so it mixes with atomic_add on
// the same elements. A template, so that code for older archs never holds it.
template <int kUnused = 0> __device__ __forceinline__ void atomic_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__)
  static_assert(__CUDA_ARCH__ >= 900 || kUnused != 0, "red.global.add.v2.f32 needs sm_90");
#endif
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
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
// log2(x), within 2^-22 absolute (the PTX ISA's bound for lg2.approx); +0 (and subnormals, flushed) -> -inf.
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
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

// Zero, read from what no compiler can know at compile time (%dynamic_smem_size >> 31: a block's shared memory is
// far below 2^31 bytes). ORed into a compile-time constant, it makes ptxas hold that constant in a register rather
// than write it again at every use (fa3::desc_unfolded).
__device__ __forceinline__ unsigned opaque_zero() {
  unsigned dynamic_smem_bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem_bytes));
  return dynamic_smem_bytes >> 31;
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

// ldmatrix's mirror: kCount 8x8 b16 matrices into shared memory, register j of lane l holding row l / 4, columns
// 2 (l % 4) and + 1 of matrix j (an mma fragment's layout), lane l giving the address of row l % 8 of matrix l / 8
// (its 32-bit shared-window address, or a pointer into shared memory): stmatrix.sync.aligned.m8n8.x{1,2,4}.shared.b16
// (sm_90). One instruction stores an A fragment, where 32-bit stores take four, each with its own swizzled address.
template <int kCount>
__device__ __forceinline__ void stmatrix(unsigned smem_row_address, const unsigned (&r)[kCount]) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "stmatrix stores 1, 2 or 4 matrices");
#if defined(__CUDA_ARCH__)
  static_assert(__CUDA_ARCH__ >= 900 || kCount == 0, "stmatrix needs sm_90");
#endif
  const unsigned address = smem_row_address;
  if constexpr (kCount == 1)
    asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};" ::"r"(address), "r"(r[0]) : "memory");
  if constexpr (kCount == 2)
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1,%2};" ::"r"(address), "r"(r[0]), "r"(r[1])
                 : "memory");
  if constexpr (kCount == 4)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(address), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
template <int kCount>
__device__ __forceinline__ void stmatrix(void* smem_row, const unsigned (&r)[kCount]) {
  stmatrix<kCount>(smem_address(smem_row), r);
}

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
__forceinline__ unsigned opaque_zero() { return 0u; }  // (what the compiler knows is the GPU form's concern)

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

template <int kCount>
__forceinline__ void stmatrix(void* smem_row, const unsigned (&r)[kCount], CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "stmatrix stores 1, 2 or 4 matrices");
  sim::stmatrix<kCount>(smem_row, r, site_);
}
template <int kCount>
__forceinline__ void stmatrix(unsigned smem_row_address, const unsigned (&r)[kCount], CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "stmatrix stores 1, 2 or 4 matrices");
  sim::stmatrix<kCount>(sim::shared_window_pointer(smem_row_address), r, site_);
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

// ---- Hopper warpgroup instructions: wgmma, its fences, setmaxnreg ------------------------------------
// A warpgroup is 4 consecutive warps (threads 128 g .. 128 g + 127); wgmma and setmaxnreg are executed by
// all of its threads at once. The GPU forms compile only for sm_90a (a use elsewhere is a static_assert);
// the simulator's twins (sim/sim_wgmma.h, sim_wgmma.cpp) check what the ISA requires of their use.
//   wgmma<T, N>(acc, desc_a, desc_b, accumulate): wgmma.mma_async.sync.aligned.m64nNk16.f32.T.T, A and B
//       K-major from shared-memory matrix descriptors; acc: N / 2 floats per thread (row 16 warp + lane / 4 +
//       8 ((i / 2) % 2), column 8 (i / 4) + 2 (lane % 4) + i % 2); accumulate false overwrites acc.
//       wgmma<T, N, kAMnMajor, kBMnMajor>: the transposed forms (imm-trans-a / -b 1: the operand M- / N-major).
//   wgmma_rs<T, N>(acc, a, desc_b, accumulate): the same with A from registers (warp q holds rows 16 q ..
//       16 q + 15 of the 64 x 16 A in mma.m16n8k16's A fragment layout); wgmma_rs<T, N, kBMnMajor>.
//   wgmma_fence(), wgmma_commit(), wgmma_wait<N>() (wgmma.fence / commit_group / wait_group N): a wgmma is
//       in flight until the wait that leaves at most N of the thread's committed groups pending; its
//       accumulators may not be touched before, and wgmma.fence must come between register accesses and a
//       wgmma using those registers (and before the first wgmma).
//   wgmma_desc<kSwizzleBytes>(smem, leading_byte_offset, stride_byte_offset): the 64-bit descriptor of an
//       operand at smem (swizzle 0, 32, 64 or 128 bytes), whose swizzle pattern starts at a boundary of
//       8 x kSwizzleBytes bytes (base offset 0; smem itself may lie inside the pattern, as a k step does).
//   setmaxnreg_inc<N>() / setmaxnreg_dec<N>(): setmaxnreg.{inc,dec}.sync.aligned.u32 N.

// The descriptor's bits (PTX ISA, "Matrix Descriptor Format"): 0-13 start address, 16-29 leading byte offset,
// 32-45 stride byte offset (each as (x & 0x3FFFF) >> 4), 49-51 base offset, 62-63 swizzle (0 none, 1 128B,
// 2 64B, 3 32B). The base offset is 0 here: the swizzle's repeating pattern (8 rows of kSwizzleBytes) starts
// at a boundary of its size, where the kernel places its tiles (the ISA's non-zero base offset, for patterns
// off their boundary, is left out).
__host__ __device__ constexpr uint64_t wgmma_desc_encode(unsigned start, unsigned leading_byte_offset,
                                                         unsigned stride_byte_offset, int swizzle_bytes) {
  const uint64_t swizzle_code = swizzle_bytes == 128 ? 1 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 3 : 0;
  return ((start & 0x3FFFFu) >> 4) | static_cast<uint64_t>((leading_byte_offset & 0x3FFFFu) >> 4) << 16 |
         static_cast<uint64_t>((stride_byte_offset & 0x3FFFFu) >> 4) << 32 | swizzle_code << 62;
}

#define CUFLASH_WGMMA_STATIC_CHECKS(T, N)                                                                   \
  static_assert(is_mma_operand<T>::value, "wgmma takes __half or __nv_bfloat16 operands");                 \
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk16 takes N a multiple of 8 in 8..256");     \
  static_assert(CUFLASH_WGMMA_TARGET || sizeof(T) == 0, "wgmma needs sm_90a (compile for sm_90a)")
#define CUFLASH_SETMAXNREG_STATIC_CHECKS(N)                                                                 \
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg takes a multiple of 8 in 24..256");          \
  static_assert(CUFLASH_WGMMA_TARGET || N == 0, "setmaxnreg needs sm_90a (compile for sm_90a)")

#if CUFLASH_GPU

// The architecture-specific features of sm_90 (wgmma, setmaxnreg) exist only in sm_90a code.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUFLASH_WGMMA_TARGET 1
#else
#define CUFLASH_WGMMA_TARGET 0
#endif

// Operand lists of m64nNk16 for N = 8 j: the accumulators are asm operands %0 .. %(4 j - 1), four per group.
#define CUFLASH_WGMMA_R0 "%0, %1, %2, %3"
#define CUFLASH_WGMMA_R1 "%4, %5, %6, %7"
#define CUFLASH_WGMMA_R2 "%8, %9, %10, %11"
#define CUFLASH_WGMMA_R3 "%12, %13, %14, %15"
#define CUFLASH_WGMMA_R4 "%16, %17, %18, %19"
#define CUFLASH_WGMMA_R5 "%20, %21, %22, %23"
#define CUFLASH_WGMMA_R6 "%24, %25, %26, %27"
#define CUFLASH_WGMMA_R7 "%28, %29, %30, %31"
#define CUFLASH_WGMMA_R8 "%32, %33, %34, %35"
#define CUFLASH_WGMMA_R9 "%36, %37, %38, %39"
#define CUFLASH_WGMMA_R10 "%40, %41, %42, %43"
#define CUFLASH_WGMMA_R11 "%44, %45, %46, %47"
#define CUFLASH_WGMMA_R12 "%48, %49, %50, %51"
#define CUFLASH_WGMMA_R13 "%52, %53, %54, %55"
#define CUFLASH_WGMMA_R14 "%56, %57, %58, %59"
#define CUFLASH_WGMMA_R15 "%60, %61, %62, %63"
#define CUFLASH_WGMMA_R16 "%64, %65, %66, %67"
#define CUFLASH_WGMMA_R17 "%68, %69, %70, %71"
#define CUFLASH_WGMMA_R18 "%72, %73, %74, %75"
#define CUFLASH_WGMMA_R19 "%76, %77, %78, %79"
#define CUFLASH_WGMMA_R20 "%80, %81, %82, %83"
#define CUFLASH_WGMMA_R21 "%84, %85, %86, %87"
#define CUFLASH_WGMMA_R22 "%88, %89, %90, %91"
#define CUFLASH_WGMMA_R23 "%92, %93, %94, %95"
#define CUFLASH_WGMMA_R24 "%96, %97, %98, %99"
#define CUFLASH_WGMMA_R25 "%100, %101, %102, %103"
#define CUFLASH_WGMMA_R26 "%104, %105, %106, %107"
#define CUFLASH_WGMMA_R27 "%108, %109, %110, %111"
#define CUFLASH_WGMMA_R28 "%112, %113, %114, %115"
#define CUFLASH_WGMMA_R29 "%116, %117, %118, %119"
#define CUFLASH_WGMMA_R30 "%120, %121, %122, %123"
#define CUFLASH_WGMMA_R31 "%124, %125, %126, %127"
#define CUFLASH_WGMMA_A4(i) "+f"(acc[i]), "+f"(acc[i + 1]), "+f"(acc[i + 2]), "+f"(acc[i + 3])
#define CUFLASH_WGMMA_REGS_1 CUFLASH_WGMMA_R0
#define CUFLASH_WGMMA_ACC_1 CUFLASH_WGMMA_A4(0)
#define CUFLASH_WGMMA_REGS_2 CUFLASH_WGMMA_REGS_1 ", " CUFLASH_WGMMA_R1
#define CUFLASH_WGMMA_ACC_2 CUFLASH_WGMMA_ACC_1, CUFLASH_WGMMA_A4(4)
#define CUFLASH_WGMMA_REGS_3 CUFLASH_WGMMA_REGS_2 ", " CUFLASH_WGMMA_R2
#define CUFLASH_WGMMA_ACC_3 CUFLASH_WGMMA_ACC_2, CUFLASH_WGMMA_A4(8)
#define CUFLASH_WGMMA_REGS_4 CUFLASH_WGMMA_REGS_3 ", " CUFLASH_WGMMA_R3
#define CUFLASH_WGMMA_ACC_4 CUFLASH_WGMMA_ACC_3, CUFLASH_WGMMA_A4(12)
#define CUFLASH_WGMMA_REGS_5 CUFLASH_WGMMA_REGS_4 ", " CUFLASH_WGMMA_R4
#define CUFLASH_WGMMA_ACC_5 CUFLASH_WGMMA_ACC_4, CUFLASH_WGMMA_A4(16)
#define CUFLASH_WGMMA_REGS_6 CUFLASH_WGMMA_REGS_5 ", " CUFLASH_WGMMA_R5
#define CUFLASH_WGMMA_ACC_6 CUFLASH_WGMMA_ACC_5, CUFLASH_WGMMA_A4(20)
#define CUFLASH_WGMMA_REGS_7 CUFLASH_WGMMA_REGS_6 ", " CUFLASH_WGMMA_R6
#define CUFLASH_WGMMA_ACC_7 CUFLASH_WGMMA_ACC_6, CUFLASH_WGMMA_A4(24)
#define CUFLASH_WGMMA_REGS_8 CUFLASH_WGMMA_REGS_7 ", " CUFLASH_WGMMA_R7
#define CUFLASH_WGMMA_ACC_8 CUFLASH_WGMMA_ACC_7, CUFLASH_WGMMA_A4(28)
#define CUFLASH_WGMMA_REGS_9 CUFLASH_WGMMA_REGS_8 ", " CUFLASH_WGMMA_R8
#define CUFLASH_WGMMA_ACC_9 CUFLASH_WGMMA_ACC_8, CUFLASH_WGMMA_A4(32)
#define CUFLASH_WGMMA_REGS_10 CUFLASH_WGMMA_REGS_9 ", " CUFLASH_WGMMA_R9
#define CUFLASH_WGMMA_ACC_10 CUFLASH_WGMMA_ACC_9, CUFLASH_WGMMA_A4(36)
#define CUFLASH_WGMMA_REGS_11 CUFLASH_WGMMA_REGS_10 ", " CUFLASH_WGMMA_R10
#define CUFLASH_WGMMA_ACC_11 CUFLASH_WGMMA_ACC_10, CUFLASH_WGMMA_A4(40)
#define CUFLASH_WGMMA_REGS_12 CUFLASH_WGMMA_REGS_11 ", " CUFLASH_WGMMA_R11
#define CUFLASH_WGMMA_ACC_12 CUFLASH_WGMMA_ACC_11, CUFLASH_WGMMA_A4(44)
#define CUFLASH_WGMMA_REGS_13 CUFLASH_WGMMA_REGS_12 ", " CUFLASH_WGMMA_R12
#define CUFLASH_WGMMA_ACC_13 CUFLASH_WGMMA_ACC_12, CUFLASH_WGMMA_A4(48)
#define CUFLASH_WGMMA_REGS_14 CUFLASH_WGMMA_REGS_13 ", " CUFLASH_WGMMA_R13
#define CUFLASH_WGMMA_ACC_14 CUFLASH_WGMMA_ACC_13, CUFLASH_WGMMA_A4(52)
#define CUFLASH_WGMMA_REGS_15 CUFLASH_WGMMA_REGS_14 ", " CUFLASH_WGMMA_R14
#define CUFLASH_WGMMA_ACC_15 CUFLASH_WGMMA_ACC_14, CUFLASH_WGMMA_A4(56)
#define CUFLASH_WGMMA_REGS_16 CUFLASH_WGMMA_REGS_15 ", " CUFLASH_WGMMA_R15
#define CUFLASH_WGMMA_ACC_16 CUFLASH_WGMMA_ACC_15, CUFLASH_WGMMA_A4(60)
#define CUFLASH_WGMMA_REGS_17 CUFLASH_WGMMA_REGS_16 ", " CUFLASH_WGMMA_R16
#define CUFLASH_WGMMA_ACC_17 CUFLASH_WGMMA_ACC_16, CUFLASH_WGMMA_A4(64)
#define CUFLASH_WGMMA_REGS_18 CUFLASH_WGMMA_REGS_17 ", " CUFLASH_WGMMA_R17
#define CUFLASH_WGMMA_ACC_18 CUFLASH_WGMMA_ACC_17, CUFLASH_WGMMA_A4(68)
#define CUFLASH_WGMMA_REGS_19 CUFLASH_WGMMA_REGS_18 ", " CUFLASH_WGMMA_R18
#define CUFLASH_WGMMA_ACC_19 CUFLASH_WGMMA_ACC_18, CUFLASH_WGMMA_A4(72)
#define CUFLASH_WGMMA_REGS_20 CUFLASH_WGMMA_REGS_19 ", " CUFLASH_WGMMA_R19
#define CUFLASH_WGMMA_ACC_20 CUFLASH_WGMMA_ACC_19, CUFLASH_WGMMA_A4(76)
#define CUFLASH_WGMMA_REGS_21 CUFLASH_WGMMA_REGS_20 ", " CUFLASH_WGMMA_R20
#define CUFLASH_WGMMA_ACC_21 CUFLASH_WGMMA_ACC_20, CUFLASH_WGMMA_A4(80)
#define CUFLASH_WGMMA_REGS_22 CUFLASH_WGMMA_REGS_21 ", " CUFLASH_WGMMA_R21
#define CUFLASH_WGMMA_ACC_22 CUFLASH_WGMMA_ACC_21, CUFLASH_WGMMA_A4(84)
#define CUFLASH_WGMMA_REGS_23 CUFLASH_WGMMA_REGS_22 ", " CUFLASH_WGMMA_R22
#define CUFLASH_WGMMA_ACC_23 CUFLASH_WGMMA_ACC_22, CUFLASH_WGMMA_A4(88)
#define CUFLASH_WGMMA_REGS_24 CUFLASH_WGMMA_REGS_23 ", " CUFLASH_WGMMA_R23
#define CUFLASH_WGMMA_ACC_24 CUFLASH_WGMMA_ACC_23, CUFLASH_WGMMA_A4(92)
#define CUFLASH_WGMMA_REGS_25 CUFLASH_WGMMA_REGS_24 ", " CUFLASH_WGMMA_R24
#define CUFLASH_WGMMA_ACC_25 CUFLASH_WGMMA_ACC_24, CUFLASH_WGMMA_A4(96)
#define CUFLASH_WGMMA_REGS_26 CUFLASH_WGMMA_REGS_25 ", " CUFLASH_WGMMA_R25
#define CUFLASH_WGMMA_ACC_26 CUFLASH_WGMMA_ACC_25, CUFLASH_WGMMA_A4(100)
#define CUFLASH_WGMMA_REGS_27 CUFLASH_WGMMA_REGS_26 ", " CUFLASH_WGMMA_R26
#define CUFLASH_WGMMA_ACC_27 CUFLASH_WGMMA_ACC_26, CUFLASH_WGMMA_A4(104)
#define CUFLASH_WGMMA_REGS_28 CUFLASH_WGMMA_REGS_27 ", " CUFLASH_WGMMA_R27
#define CUFLASH_WGMMA_ACC_28 CUFLASH_WGMMA_ACC_27, CUFLASH_WGMMA_A4(108)
#define CUFLASH_WGMMA_REGS_29 CUFLASH_WGMMA_REGS_28 ", " CUFLASH_WGMMA_R28
#define CUFLASH_WGMMA_ACC_29 CUFLASH_WGMMA_ACC_28, CUFLASH_WGMMA_A4(112)
#define CUFLASH_WGMMA_REGS_30 CUFLASH_WGMMA_REGS_29 ", " CUFLASH_WGMMA_R29
#define CUFLASH_WGMMA_ACC_30 CUFLASH_WGMMA_ACC_29, CUFLASH_WGMMA_A4(116)
#define CUFLASH_WGMMA_REGS_31 CUFLASH_WGMMA_REGS_30 ", " CUFLASH_WGMMA_R30
#define CUFLASH_WGMMA_ACC_31 CUFLASH_WGMMA_ACC_30, CUFLASH_WGMMA_A4(120)
#define CUFLASH_WGMMA_REGS_32 CUFLASH_WGMMA_REGS_31 ", " CUFLASH_WGMMA_R31
#define CUFLASH_WGMMA_ACC_32 CUFLASH_WGMMA_ACC_31, CUFLASH_WGMMA_A4(124)
// X(j, N, o0, .., o6): N = 8 j and the numbers of the seven operands after the 4 j accumulators.
#define CUFLASH_WGMMA_SHAPES(X) \
  X(1, 8, 4, 5, 6, 7, 8, 9, 10) \
  X(2, 16, 8, 9, 10, 11, 12, 13, 14) \
  X(3, 24, 12, 13, 14, 15, 16, 17, 18) \
  X(4, 32, 16, 17, 18, 19, 20, 21, 22) \
  X(5, 40, 20, 21, 22, 23, 24, 25, 26) \
  X(6, 48, 24, 25, 26, 27, 28, 29, 30) \
  X(7, 56, 28, 29, 30, 31, 32, 33, 34) \
  X(8, 64, 32, 33, 34, 35, 36, 37, 38) \
  X(9, 72, 36, 37, 38, 39, 40, 41, 42) \
  X(10, 80, 40, 41, 42, 43, 44, 45, 46) \
  X(11, 88, 44, 45, 46, 47, 48, 49, 50) \
  X(12, 96, 48, 49, 50, 51, 52, 53, 54) \
  X(13, 104, 52, 53, 54, 55, 56, 57, 58) \
  X(14, 112, 56, 57, 58, 59, 60, 61, 62) \
  X(15, 120, 60, 61, 62, 63, 64, 65, 66) \
  X(16, 128, 64, 65, 66, 67, 68, 69, 70) \
  X(17, 136, 68, 69, 70, 71, 72, 73, 74) \
  X(18, 144, 72, 73, 74, 75, 76, 77, 78) \
  X(19, 152, 76, 77, 78, 79, 80, 81, 82) \
  X(20, 160, 80, 81, 82, 83, 84, 85, 86) \
  X(21, 168, 84, 85, 86, 87, 88, 89, 90) \
  X(22, 176, 88, 89, 90, 91, 92, 93, 94) \
  X(23, 184, 92, 93, 94, 95, 96, 97, 98) \
  X(24, 192, 96, 97, 98, 99, 100, 101, 102) \
  X(25, 200, 100, 101, 102, 103, 104, 105, 106) \
  X(26, 208, 104, 105, 106, 107, 108, 109, 110) \
  X(27, 216, 108, 109, 110, 111, 112, 113, 114) \
  X(28, 224, 112, 113, 114, 115, 116, 117, 118) \
  X(29, 232, 116, 117, 118, 119, 120, 121, 122) \
  X(30, 240, 120, 121, 122, 123, 124, 125, 126) \
  X(31, 248, 124, 125, 126, 127, 128, 129, 130) \
  X(32, 256, 128, 129, 130, 131, 132, 133, 134)

template <int kGroups> struct WgmmaAsm;  // kGroups = N / 8; the instruction text for each N
// imm-trans-a / imm-trans-b are "n" operands: 1 reads the operand MN-major.
#define CUFLASH_WGMMA_SS(N, ptx_type, j, o0, o1, o2, o3, o4)                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #o2 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N        \
               "k16.f32." ptx_type "." ptx_type " {" CUFLASH_WGMMA_REGS_##j "}, %" #o0 ", %" #o1              \
               ", p, 1, 1, %" #o3 ", %" #o4 ";\n}"                                                           \
               : CUFLASH_WGMMA_ACC_##j                                                                       \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB)                          \
               : "memory")
#define CUFLASH_WGMMA_RS(N, ptx_type, j, o0, o1, o2, o3, o4, o5, o6)                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #o5 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N        \
               "k16.f32." ptx_type "." ptx_type " {" CUFLASH_WGMMA_REGS_##j "}, {%" #o0 ", %" #o1 ", %" #o2     \
               ", %" #o3 "}, %" #o4 ", p, 1, 1, %" #o6 ";\n}"                                                \
               : CUFLASH_WGMMA_ACC_##j                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB)         \
               : "memory")
#define CUFLASH_WGMMA_DEFINE(j, N, o0, o1, o2, o3, o4, o5, o6)                                               \
  template <> struct WgmmaAsm<j> {                                                                           \
    template <bool kBf16, int kTransA, int kTransB>                                                          \
    __device__ static __forceinline__ void ss(float* acc, uint64_t desc_a, uint64_t desc_b, int scale_d) {   \
      if constexpr (kBf16) CUFLASH_WGMMA_SS(N, "bf16", j, o0, o1, o2, o3, o4);                               \
      else CUFLASH_WGMMA_SS(N, "f16", j, o0, o1, o2, o3, o4);                                                \
    }                                                                                                        \
    template <bool kBf16, int kTransB>                                                                       \
    __device__ static __forceinline__ void rs(float* acc, const unsigned* a, uint64_t desc_b, int scale_d) { \
      if constexpr (kBf16) CUFLASH_WGMMA_RS(N, "bf16", j, o0, o1, o2, o3, o4, o5, o6);                       \
      else CUFLASH_WGMMA_RS(N, "f16", j, o0, o1, o2, o3, o4, o5, o6);                                        \
    }                                                                                                        \
  };
CUFLASH_WGMMA_SHAPES(CUFLASH_WGMMA_DEFINE)
#undef CUFLASH_WGMMA_DEFINE
#undef CUFLASH_WGMMA_SS
#undef CUFLASH_WGMMA_RS

template <class T, int N, bool kAMnMajor = false, bool kBMnMajor = false>
__device__ __forceinline__ void wgmma(float (&acc)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  CUFLASH_WGMMA_STATIC_CHECKS(T, N);
  WgmmaAsm<N / 8>::template ss<is_mma_operand<T>::bf16, kAMnMajor, kBMnMajor>(acc, desc_a, desc_b, accumulate ? 1 : 0);
}
template <class T, int N, bool kBMnMajor = false>
__device__ __forceinline__ void wgmma_rs(float (&acc)[N / 2], const unsigned (&a)[4], uint64_t desc_b, bool accumulate) {
  CUFLASH_WGMMA_STATIC_CHECKS(T, N);
  WgmmaAsm<N / 8>::template rs<is_mma_operand<T>::bf16, kBMnMajor>(acc, a, desc_b, accumulate ? 1 : 0);
}
// Templates, so that nothing sm_90a-only is compiled for a kernel that does not use them.
template <int kUnused = 0> __device__ __forceinline__ void wgmma_fence() {
  static_assert(CUFLASH_WGMMA_TARGET || kUnused != 0, "wgmma needs sm_90a (compile for sm_90a)");
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
template <int kUnused = 0> __device__ __forceinline__ void wgmma_commit() {
  static_assert(CUFLASH_WGMMA_TARGET || kUnused != 0, "wgmma needs sm_90a (compile for sm_90a)");
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
  static_assert(kPending >= 0 && kPending < 8, "wgmma.wait_group takes 0..7");
  static_assert(CUFLASH_WGMMA_TARGET || kPending < 0, "wgmma needs sm_90a (compile for sm_90a)");
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// The wait, then the accumulators pinned after it: registers are not memory, so without this the compiler
// may read them before the wait (the "memory" clobber does not order register reads).
template <int kPending, int K> __device__ __forceinline__ void wgmma_wait(float (&acc)[K]) {
  wgmma_wait<kPending>();
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}
template <int kSwizzleBytes>
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, unsigned leading_byte_offset,
                                               unsigned stride_byte_offset) {
  static_assert(kSwizzleBytes == 0 || kSwizzleBytes == 32 || kSwizzleBytes == 64 || kSwizzleBytes == 128,
                "wgmma descriptors swizzle 0, 32, 64 or 128 bytes");
  return wgmma_desc_encode(smem_address(smem), leading_byte_offset, stride_byte_offset, kSwizzleBytes);
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  CUFLASH_SETMAXNREG_STATIC_CHECKS(N);
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  CUFLASH_SETMAXNREG_STATIC_CHECKS(N);
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

#else  // the simulator

#define CUFLASH_WGMMA_TARGET 1

template <class T, int N, bool kAMnMajor = false, bool kBMnMajor = false>
__forceinline__ void wgmma(float (&acc)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate,
                           CUFLASH_SIM_SITE_PARAMS) {
  CUFLASH_WGMMA_STATIC_CHECKS(T, N);
  const sim::WgmmaShape shape{N, is_mma_operand<T>::bf16 ? 1u : 0u, 0, accumulate ? 1u : 0u, desc_a, desc_b,
                              kAMnMajor ? 1u : 0u, kBMnMajor ? 1u : 0u};
  sim::wgmma_issue(CUFLASH_SIM_SITE("wgmma.mma_async"), shape, acc, nullptr);
}
template <class T, int N, bool kBMnMajor = false>
__forceinline__ void wgmma_rs(float (&acc)[N / 2], const unsigned (&a)[4], uint64_t desc_b, bool accumulate,
                              CUFLASH_SIM_SITE_PARAMS) {
  CUFLASH_WGMMA_STATIC_CHECKS(T, N);
  const sim::WgmmaShape shape{N, is_mma_operand<T>::bf16 ? 1u : 0u, 1, accumulate ? 1u : 0u, 0, desc_b,
                              0, kBMnMajor ? 1u : 0u};
  sim::wgmma_issue(CUFLASH_SIM_SITE("wgmma.mma_async"), shape, acc, a);
}
__forceinline__ void wgmma_fence(CUFLASH_SIM_SITE_PARAMS) { sim::wgmma_fence(CUFLASH_SIM_SITE("wgmma.fence")); }
__forceinline__ void wgmma_commit(CUFLASH_SIM_SITE_PARAMS) {
  sim::wgmma_commit(CUFLASH_SIM_SITE("wgmma.commit_group"));
}
template <int kPending> __forceinline__ void wgmma_wait(CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kPending >= 0 && kPending < 8, "wgmma.wait_group takes 0..7");
  sim::wgmma_wait(CUFLASH_SIM_SITE("wgmma.wait_group"), kPending);
}
template <int kPending, int K> __forceinline__ void wgmma_wait(float (&)[K], CUFLASH_SIM_SITE_PARAMS) {
  wgmma_wait<kPending>(site_);
}
template <int kSwizzleBytes>
__forceinline__ uint64_t wgmma_desc(const void* smem, unsigned leading_byte_offset, unsigned stride_byte_offset,
                                    CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kSwizzleBytes == 0 || kSwizzleBytes == 32 || kSwizzleBytes == 64 || kSwizzleBytes == 128,
                "wgmma descriptors swizzle 0, 32, 64 or 128 bytes");
  const unsigned start =
      sim::wgmma_descriptor_start(CUFLASH_SIM_SITE("wgmma_desc"), smem, leading_byte_offset, stride_byte_offset);
  return wgmma_desc_encode(start, leading_byte_offset, stride_byte_offset, kSwizzleBytes);
}
template <int N> __forceinline__ void setmaxnreg_inc(CUFLASH_SIM_SITE_PARAMS) {
  CUFLASH_SETMAXNREG_STATIC_CHECKS(N);
  sim::setmaxnreg(CUFLASH_SIM_SITE("setmaxnreg.inc"), N, true);
}
template <int N> __forceinline__ void setmaxnreg_dec(CUFLASH_SIM_SITE_PARAMS) {
  CUFLASH_SETMAXNREG_STATIC_CHECKS(N);
  sim::setmaxnreg(CUFLASH_SIM_SITE("setmaxnreg.dec"), N, false);
}

#endif  // CUFLASH_GPU

// ---- Hopper TMA: tiled tensor copies through a tensor map -------------------------------------------
// A tensor map describes a global tensor of rank 1..5 and the box one copy moves (cuTensorMapEncodeTiled
// on a GPU, cuflash.kernels.tensor_map.encode_tiled on both sides). Kernels take it as a `const
// __grid_constant__` parameter (or a member of one) and pass its address. One thread issues each copy.
//   tma_load<kRank>(smem_dst, map, {c0, ..}, bar): the box at coordinates c (innermost first, signed:
//       elements outside the tensor arrive as zeros, or NaN when the map says so) into shared memory (dense,
//       innermost contiguous, swizzled as the map says; 128-byte aligned), completing the box's bytes as tx
//       bytes on the mbarrier `bar`: cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes.
//       tma_load_2d(smem_dst, map, c0, c1, bar) is the 2-D form.
//   tma_store<kRank>(map, smem_src, {c0, ..}): the box from shared memory to the tensor, clipped to it:
//       cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group. tma_store_2d(map, smem_src, c0, c1).
//   tma_store_commit(): cp.async.bulk.commit_group (this thread's stores since the last commit form a group).
//   tma_store_wait_read<N>(): cp.async.bulk.wait_group.read N: all but the newest N groups have read their
//       source, which may be overwritten from then on (their global writes may still be in flight).
//   tma_store_wait<N>(): cp.async.bulk.wait_group N: all but the newest N groups are complete, their global writes
//       (adds) done: two bulk reduce-adds to the same elements land in program order only with this between them.
//   bulk_reduce_add_f32(gmem_dst, smem_src, bytes): bytes / 4 contiguous float32 of shared memory added to as many
//       of global memory, each element atomically, in the thread's bulk async-group (committed and waited for as
//       the stores above): cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (SASS UBLKRED). bytes a
//       positive multiple of 16, both addresses 16-byte aligned.
// Shared-memory writes a TMA store or bulk reduce-add reads need fence_proxy_async() first (the async proxy reads
// them). The simulator's twins are in sim/sim_tma.h and sim/sim_tma.cpp (the README's section "TMA").

// CUtensorMap's size and alignment; the contents are the driver's (GPU) or the simulator twin's encoding.
struct alignas(64) TensorMap {
  unsigned char opaque[128];
};
static_assert(sizeof(TensorMap) == 128, "a tensor map is 128 bytes");

#define CUFLASH_TMA_STATIC_CHECKS(kRank)                                                                    \
  static_assert(kRank >= 1 && kRank <= 5, "tensor copies take 1 to 5 coordinates");                        \
  static_assert(CUFLASH_TMA_TARGET || kRank == 0, "TMA (cp.async.bulk.tensor) needs sm_90 or later")

#if CUFLASH_GPU

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUFLASH_TMA_TARGET 1
#else
#define CUFLASH_TMA_TARGET 0
#endif

template <int kRank>
__device__ __forceinline__ void tma_load(void* smem_dst, const TensorMap* map, const int (&c)[kRank], uint64_t* bar) {
  CUFLASH_TMA_STATIC_CHECKS(kRank);
  const unsigned dst = smem_address(smem_dst);
  const unsigned mbar = smem_address(bar);
  const unsigned long long tmap = reinterpret_cast<unsigned long long>(map);
  // The coordinate list {%3, ..} has kRank operands.
#define CUFLASH_TMA_LOAD_PTX(dims, list) \
  "cp.async.bulk.tensor." dims ".shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {" list "}], [%2];"
  if constexpr (kRank == 1) {
    asm volatile(CUFLASH_TMA_LOAD_PTX("1d", "%3")::"r"(dst), "l"(tmap), "r"(mbar), "r"(c[0]) : "memory");
  } else if constexpr (kRank == 2) {
    asm volatile(CUFLASH_TMA_LOAD_PTX("2d", "%3, %4")::"r"(dst), "l"(tmap), "r"(mbar), "r"(c[0]), "r"(c[1]) : "memory");
  } else if constexpr (kRank == 3) {
    asm volatile(CUFLASH_TMA_LOAD_PTX("3d", "%3, %4, %5")::"r"(dst), "l"(tmap), "r"(mbar), "r"(c[0]), "r"(c[1]),
                 "r"(c[2]) : "memory");
  } else if constexpr (kRank == 4) {
    asm volatile(CUFLASH_TMA_LOAD_PTX("4d", "%3, %4, %5, %6")::"r"(dst), "l"(tmap), "r"(mbar), "r"(c[0]), "r"(c[1]),
                 "r"(c[2]), "r"(c[3]) : "memory");
  } else {
    asm volatile(CUFLASH_TMA_LOAD_PTX("5d", "%3, %4, %5, %6, %7")::"r"(dst), "l"(tmap), "r"(mbar), "r"(c[0]),
                 "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
  }
#undef CUFLASH_TMA_LOAD_PTX
}
template <int kRank>
__device__ __forceinline__ void tma_store(const TensorMap* map, const void* smem_src, const int (&c)[kRank]) {
  CUFLASH_TMA_STATIC_CHECKS(kRank);
  const unsigned src = smem_address(smem_src);
  const unsigned long long tmap = reinterpret_cast<unsigned long long>(map);
  if constexpr (kRank == 1) {
    asm volatile("cp.async.bulk.tensor.1d.global.shared::cta.tile.bulk_group [%0, {%2}], [%1];"
                 ::"l"(tmap), "r"(src), "r"(c[0]) : "memory");
  } else if constexpr (kRank == 2) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(tmap), "r"(src), "r"(c[0]), "r"(c[1]) : "memory");
  } else if constexpr (kRank == 3) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(tmap), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]) : "memory");
  } else if constexpr (kRank == 4) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(tmap), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]) : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];"
                 ::"l"(tmap), "r"(src), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
  }
}
// Templates, so that nothing sm_90-only is compiled for a kernel that does not use them.
template <int kUnused = 0> __device__ __forceinline__ void tma_store_commit() {
  static_assert(CUFLASH_TMA_TARGET || kUnused != 0, "TMA (cp.async.bulk) needs sm_90 or later");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void tma_store_wait_read() {
  static_assert(kPending >= 0 && kPending < 64, "cp.async.bulk.wait_group.read takes an immediate");
  static_assert(CUFLASH_TMA_TARGET || kPending < 0, "TMA (cp.async.bulk) needs sm_90 or later");
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
template <int kPending> __device__ __forceinline__ void tma_store_wait() {
  static_assert(kPending >= 0 && kPending < 64, "cp.async.bulk.wait_group takes an immediate");
  static_assert(CUFLASH_TMA_TARGET || kPending < 0, "TMA (cp.async.bulk) needs sm_90 or later");
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}
template <int kUnused = 0>
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, unsigned bytes) {
  static_assert(CUFLASH_TMA_TARGET || kUnused != 0, "cp.reduce.async.bulk needs sm_90 or later");
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(gmem_dst), "r"(smem_address(smem_src)), "r"(bytes) : "memory");
}
// Templates too (kUnused makes the rank dependent), so an sm_80 kernel never instantiates the sm_90 forms.
template <int kUnused = 0>
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const TensorMap* map, int c0, int c1, uint64_t* bar) {
  const int c[2] = {c0, c1};
  tma_load<2 + kUnused>(smem_dst, map, c, bar);
}
template <int kUnused = 0>
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, const void* smem_src, int c0, int c1) {
  const int c[2] = {c0, c1};
  tma_store<2 + kUnused>(map, smem_src, c);
}

#else  // the simulator: the twins of sim/sim_tma.h, with the kernel's call site.

#define CUFLASH_TMA_TARGET 1

template <int kRank>
__forceinline__ void tma_load(void* smem_dst, const TensorMap* map, const int (&c)[kRank], uint64_t* bar,
                              CUFLASH_SIM_SITE_PARAMS) {
  CUFLASH_TMA_STATIC_CHECKS(kRank);
  sim::tma_load(CUFLASH_SIM_SITE("cp.async.bulk.tensor (TMA load)"), smem_dst, map, c, kRank, bar);
}
template <int kRank>
__forceinline__ void tma_store(const TensorMap* map, const void* smem_src, const int (&c)[kRank],
                               CUFLASH_SIM_SITE_PARAMS) {
  CUFLASH_TMA_STATIC_CHECKS(kRank);
  sim::tma_store(CUFLASH_SIM_SITE("cp.async.bulk.tensor (TMA store)"), map, smem_src, c, kRank);
}
__forceinline__ void tma_store_commit(CUFLASH_SIM_SITE_PARAMS) {
  sim::tma_store_commit(CUFLASH_SIM_SITE("cp.async.bulk.commit_group"));
}
template <int kPending> __forceinline__ void tma_store_wait_read(CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kPending >= 0 && kPending < 64, "cp.async.bulk.wait_group.read takes an immediate");
  sim::tma_store_wait_read(CUFLASH_SIM_SITE("cp.async.bulk.wait_group.read"), kPending);
}
template <int kPending> __forceinline__ void tma_store_wait(CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kPending >= 0 && kPending < 64, "cp.async.bulk.wait_group takes an immediate");
  sim::tma_store_wait(CUFLASH_SIM_SITE("cp.async.bulk.wait_group"), kPending);
}
__forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, unsigned bytes,
                                         CUFLASH_SIM_SITE_PARAMS) {
  sim::bulk_reduce_add_f32(CUFLASH_SIM_SITE("cp.reduce.async.bulk (bulk reduce-add)"), gmem_dst, smem_src, bytes);
}
__forceinline__ void tma_load_2d(void* smem_dst, const TensorMap* map, int c0, int c1, uint64_t* bar,
                                 CUFLASH_SIM_SITE_PARAMS) {
  const int c[2] = {c0, c1};
  tma_load<2>(smem_dst, map, c, bar, site_);
}
__forceinline__ void tma_store_2d(const TensorMap* map, const void* smem_src, int c0, int c1,
                                  CUFLASH_SIM_SITE_PARAMS) {
  const int c[2] = {c0, c1};
  tma_store<2>(map, smem_src, c, site_);
}

#endif  // CUFLASH_GPU

}  // namespace arch
}  // namespace cuflash
