// cuda_sim.h: the CUDA built-ins that kernels use, supplied for g++ so the same
// .cu sources run in the CPU simulator (every CUDA thread is a fiber; see
// sim_runtime.cpp for the scheduler and checking modes).
//
// Included by arch/arch.cuh when not compiling for a GPU. It provides:
//   - qualifiers (__global__, __device__, __forceinline__, __launch_bounds__, __align__),
//   - threadIdx / blockIdx / blockDim / gridDim / warpSize, vector types, dim3,
//   - __half / __nv_bfloat16 with bit-exact round-to-nearest-even conversions,
//   - __syncthreads, __syncwarp, shuffles and votes, __trap,
//   - twins of mma.sync / ldmatrix / cp.async for the arch layer to wrap (sim_tensor.h), and of
//     mbarrier, named barriers, elect.sync and the async-proxy fence (sim_mbarrier.h),
//   - the CPU twins of the arch layer (namespace cuflash::arch),
//   - launch_kernel<P>(): what the generated launcher TUs call.
//
// Strictness: everything a GPU rejects or leaves undefined that we can see cheaply
// is an error that ends the launch and surfaces in Python as cuflash.sim.KernelError.
//
// The per-thread state is found from the stack pointer (fiber stacks are aligned
// blocks inside one arena), not from TLS: each kernel library carries its own copy
// of the runtime, and initial-exec TLS in many dlopen'ed libraries exhausts glibc's
// static TLS reserve, while general-dynamic TLS costs a call per threadIdx read.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <source_location>
#include <type_traits>

#include "sim_abi.h"

// ---- qualifiers ------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
// __launch_bounds__ is enforced at launch: the simulator build reads each kernel's bound from the
// preprocessed source, where the probe build leaves this marker (cuflash/sim/_build.py, launch_bounds).
#ifdef CUFLASH_SIM_LAUNCH_BOUNDS_PROBE
#define __launch_bounds__(...) __cuflash_launch_bounds__(__VA_ARGS__)
#else
#define __launch_bounds__(...)
#endif
#define __align__(n) __attribute__((aligned(n)))
// A kernel parameter the kernel may take the address of (a TMA tensor map): on a GPU it stays in the
// parameter space; here the parameter block is already copied per thread (kernel_thunk), so it is a no-op.
#define __grid_constant__
// __shared__ is deliberately not defined: kernels use only dynamic shared memory,
// and a static __shared__ array would silently become per-fiber or per-process memory.

// ---- vector types and dims ----------------------------------------------------
struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct __align__(8) int2 { int x, y; };
struct int3 { int x, y, z; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(8) float2 { float x, y; };
struct float3 { float x, y, z; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(16) longlong2 { long long x, y; };
struct __align__(16) ulonglong2 { unsigned long long x, y; };
struct __align__(16) double2 { double x, y; };
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

static constexpr int warpSize = 32;

// ---- integer / float min and max as CUDA's device headers declare them -----------
__forceinline__ int min(int a, int b) { return a < b ? a : b; }
__forceinline__ int max(int a, int b) { return a > b ? a : b; }
__forceinline__ unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
__forceinline__ unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
__forceinline__ unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
__forceinline__ unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
__forceinline__ unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
__forceinline__ unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
__forceinline__ long long min(long long a, long long b) { return a < b ? a : b; }
__forceinline__ long long max(long long a, long long b) { return a > b ? a : b; }
__forceinline__ unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
__forceinline__ unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
__forceinline__ float min(float a, float b) { return fminf(a, b); }
__forceinline__ float max(float a, float b) { return fmaxf(a, b); }

// ---- 16-bit floats ------------------------------------------------------------------
// Plain 2-byte structs (trivially copyable, no arithmetic operators: kernels do math
// in float32). Conversions are done in integer arithmetic so they are bit-exact and
// independent of compiler flags; tests compare them with numpy / ml_dtypes.
struct __align__(2) __half { unsigned short __x; };
struct __align__(2) __nv_bfloat16 { unsigned short __x; };
struct __align__(4) __half2 { __half x, y; };
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

namespace cuflash::sim {

template <class To, class From>
__forceinline__ To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different size");
  To to;
  __builtin_memcpy(&to, &from, sizeof(To));
  return to;
}

// fp32 -> fp16, round to nearest even, subnormals kept, |x| >= 65520 -> inf,
// NaN -> 0x7fff (the GPU's canonical NaN).
inline unsigned short float_to_half_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fffu;
  if (ax >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // >= 65520 (or inf)
  if (ax >= 0x38800000u) {  // normal half (>= 2^-14)
    uint32_t h = (ax >> 13) - (112u << 10);
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return static_cast<unsigned short>(sign | h);
  }
  if (ax < 0x33000000u) return static_cast<unsigned short>(sign);  // < 2^-25: rounds to zero
  // Subnormal half: value / 2^-24 = mantissa * 2^(e - 126), shift in [14, 24].
  const uint32_t e = ax >> 23;
  const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;
  uint32_t h = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
  return static_cast<unsigned short>(sign | h);
}

inline float half_bits_to_float(unsigned short h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    uint32_t e = 113u;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return bit_cast<float>(bits);
}

// fp32 -> bf16, round to nearest even, NaN -> 0x7fff.
inline unsigned short float_to_bfloat16_bits(float f) {
  const uint32_t x = bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return static_cast<unsigned short>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bfloat16_bits_to_float(unsigned short b) { return bit_cast<float>(static_cast<uint32_t>(b) << 16); }

}  // namespace cuflash::sim

__forceinline__ float __half2float(__half h) { return cuflash::sim::half_bits_to_float(h.__x); }
__forceinline__ __half __float2half_rn(float f) { return __half{cuflash::sim::float_to_half_bits(f)}; }
__forceinline__ __half __float2half(float f) { return __float2half_rn(f); }
__forceinline__ float __bfloat162float(__nv_bfloat16 b) { return cuflash::sim::bfloat16_bits_to_float(b.__x); }
__forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{cuflash::sim::float_to_bfloat16_bits(f)};
}
__forceinline__ __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
__forceinline__ __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
__forceinline__ __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
__forceinline__ float __low2float(__half2 h) { return __half2float(h.x); }
__forceinline__ float __high2float(__half2 h) { return __half2float(h.y); }
__forceinline__ float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
__forceinline__ float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
__forceinline__ unsigned short __half_as_ushort(__half h) { return h.__x; }
__forceinline__ __half __ushort_as_half(unsigned short x) { return __half{x}; }
__forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
__forceinline__ __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return __nv_bfloat16{x}; }
__forceinline__ int __float_as_int(float f) { return cuflash::sim::bit_cast<int>(f); }
__forceinline__ unsigned __float_as_uint(float f) { return cuflash::sim::bit_cast<unsigned>(f); }
__forceinline__ float __int_as_float(int i) { return cuflash::sim::bit_cast<float>(i); }
__forceinline__ float __uint_as_float(unsigned i) { return cuflash::sim::bit_cast<float>(i); }

// ---- paired 16-bit math (each lane as the CUDA headers define it) ----------------------------
// Results are rounded once to the 16-bit format: products of 16-bit values are exact in float; a * b + c
// is formed in double (exact when the exponents of a b and c are within 29 of each other) and rounded
// to 16 bits through round-to-odd.
namespace cuflash::sim {
__forceinline__ float h_to_float(__half h) { return half_bits_to_float(h.__x); }
__forceinline__ float h_to_float(__nv_bfloat16 h) { return bfloat16_bits_to_float(h.__x); }
template <class H> __forceinline__ H h_from_float(float f) {
  if constexpr (std::is_same_v<H, __half>) return H{float_to_half_bits(f)};
  else return H{float_to_bfloat16_bits(f)};
}
// double -> 16-bit, rounding once: through float with round-to-odd (truncate, then set the last bit
// when inexact), which keeps the final round-to-nearest-even exact for formats 2+ bits narrower.
template <class H> __forceinline__ H h_from_double(double d) {
  float f = static_cast<float>(d);
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.f);
    f = bit_cast<float>(bit_cast<unsigned>(f) | 1u);
  }
  return h_from_float<H>(f);
}
template <class H> __forceinline__ H h_max(H a, H b) {
  const float x = h_to_float(a), y = h_to_float(b);
  if (x != x && y != y) return h_from_float<H>(NAN);  // canonical NaN
  if (x != x) return b;
  if (y != y) return a;
  if (x == 0.f && y == 0.f) return std::signbit(x) ? b : a;  // +0 > -0
  return x > y ? a : b;
}
}  // namespace cuflash::sim

#define CUFLASH_SIM_PAIRED(H2, H)                                                                          \
  __forceinline__ H2 __hfma2(H2 a, H2 b, H2 c) {                                                         \
    using namespace cuflash::sim;                                                                         \
    return {h_from_double<H>(static_cast<double>(h_to_float(a.x)) * h_to_float(b.x) + h_to_float(c.x)), \
            h_from_double<H>(static_cast<double>(h_to_float(a.y)) * h_to_float(b.y) + h_to_float(c.y))}; \
  }                                                                                                       \
  __forceinline__ H2 __hmul2(H2 a, H2 b) {                                                               \
    using namespace cuflash::sim;                                                                         \
    return {h_from_float<H>(h_to_float(a.x) * h_to_float(b.x)), h_from_float<H>(h_to_float(a.y) * h_to_float(b.y))}; \
  }                                                                                                       \
  __forceinline__ H2 __hmax2(H2 a, H2 b) { return {cuflash::sim::h_max(a.x, b.x), cuflash::sim::h_max(a.y, b.y)}; } \
  __forceinline__ H2 h2exp2(H2 a) {                                                                      \
    using namespace cuflash::sim;                                                                         \
    return {h_from_float<H>(exp2f(h_to_float(a.x))), h_from_float<H>(exp2f(h_to_float(a.y)))};           \
  }
CUFLASH_SIM_PAIRED(__half2, __half)
CUFLASH_SIM_PAIRED(__nv_bfloat162, __nv_bfloat16)
#undef CUFLASH_SIM_PAIRED
__forceinline__ __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
__forceinline__ float2 __half22float2(__half2 h) { return {__low2float(h), __high2float(h)}; }
__forceinline__ __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
__forceinline__ float2 __bfloat1622float2(__nv_bfloat162 h) { return {__low2float(h), __high2float(h)}; }

// ---- integer and fast-math intrinsics -----------------------------------------------------------
__forceinline__ int __popc(unsigned x) { return __builtin_popcount(x); }
__forceinline__ int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
__forceinline__ int __ffs(int x) { return __builtin_ffs(x); }
__forceinline__ int __ffsll(long long x) { return __builtin_ffsll(x); }
__forceinline__ int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
__forceinline__ int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
// The 64 bits hi:lo, which __byte_perm picks bytes from and the funnel shifts shift.
namespace cuflash::sim {
__forceinline__ unsigned long long funnel(unsigned lo, unsigned hi) { return (static_cast<unsigned long long>(hi) << 32) | lo; }
}  // namespace cuflash::sim
// Byte n of the result is byte (s >> 4n) & 7 of the 8 bytes y:x (x holds bytes 0..3).
__forceinline__ unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long bytes = cuflash::sim::funnel(x, y);
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<unsigned>((bytes >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
// The funnel shifts shift the 64 bits hi:lo by (shift & 31), or min(shift, 32) for the clamped forms.
__forceinline__ unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>((cuflash::sim::funnel(lo, hi) << (shift & 31u)) >> 32);
}
__forceinline__ unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>(cuflash::sim::funnel(lo, hi) >> (shift & 31u));
}
__forceinline__ unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>((cuflash::sim::funnel(lo, hi) << (shift < 32u ? shift : 32u)) >> 32);
}
__forceinline__ unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>(cuflash::sim::funnel(lo, hi) >> (shift < 32u ? shift : 32u));
}
// __fdividef: x / y, except 0 for 2^126 < |y| < 2^128 (NaN if x is infinite there), as CUDA documents.
__forceinline__ float __fdividef(float x, float y) {
  const float ay = std::fabs(y);
  if (ay > 8.50705917e+37f && ay < INFINITY) return std::isinf(x) ? NAN : 0.f;
  return x / y;
}
// __fmul_rn: a product rounded on its own, never contracted into an FMA, as CUDA documents the intrinsic (the
// kernels build with -ffp-contract=fast). GCC (12 on) and Clang keep a product inside __builtin_assoc_barrier out of
// any contraction; elsewhere a volatile round trip does (slower, the same bits).
__forceinline__ float __fmul_rn(float a, float b) {
#if defined(__has_builtin) && __has_builtin(__builtin_assoc_barrier)
  return __builtin_assoc_barrier(a * b);
#else
  volatile float p = a * b;
  return p;
#endif
}
__forceinline__ float rsqrtf(float x) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(x))); }
__forceinline__ long long clock64() { return static_cast<long long>(__builtin_ia32_rdtsc()); }

// ---- the runtime interface ------------------------------------------------------------
namespace cuflash::sim {

// A source location of a synchronizing call; threads must meet at the same one.
struct Site {
  const char* what;  // "__syncthreads", "__shfl_xor_sync", ...
  const char* file;
  unsigned line;
  unsigned column;
};

struct Buffer {
  uintptr_t begin;
  uintptr_t end;
  int writable;
  int index;  // position in the launch's buffer list (for messages)
};

// What kernel code reads inline on its hot paths. The runtime's own structures
// embed these views; see sim_runtime.cpp.
struct LaunchView {
  dim3 grid_dim;
  dim3 block_dim;
  const Buffer* buffers;
  int num_buffers;
  unsigned smem_bytes;
  const char* kernel_name;
};

struct BlockView {
  uint3 block_idx;
  unsigned char* smem;
  const LaunchView* launch;
  // Traffic counters of the worker running this block (summed over workers at the end).
  unsigned long long bytes_read;
  unsigned long long bytes_written;
};

struct ThreadView {
  uint3 thread_idx;
  unsigned linear_tid;
  BlockView* block;
  void* fiber;  // the runtime's per-thread record
};

// Fiber stacks are kStackBytes-aligned slots of one arena; a thread's view sits
// at the top of its slot, above the initial stack pointer.
constexpr uintptr_t kStackBytes = 256 * 1024;
constexpr uintptr_t kThreadViewOffset = kStackBytes - 256;

// Any address inside the running function's frame lies in the current fiber's stack
// slot, and a function runs on one fiber stack for its whole life, so the compiler
// may reuse the result across calls (also across fiber switches).
__forceinline__ ThreadView* current_thread() {
  const uintptr_t frame = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  return reinterpret_cast<ThreadView*>((frame & ~(kStackBytes - 1)) + kThreadViewOffset);
}

// ---- runtime entry points (sim_runtime.cpp) ----
// The runtime is one shared library per checking mode, loaded once per process
// (one fiber-stack arena, one set of signal handlers); kernel libraries link to it.
// Everything else is built with -fvisibility=hidden.
#define CUFLASH_SIM_API __attribute__((visibility("default")))
CUFLASH_SIM_API void sync_threads(const Site& site);
// __syncthreads_count / _and / _or (op 0, 1, 2): the barrier, reducing the predicates of the block's live threads.
CUFLASH_SIM_API int sync_threads_reduce(const Site& site, int predicate, unsigned op);
// __threadfence_block: does nothing; being an external call, the compiler keeps memory accesses on their side.
CUFLASH_SIM_API void block_fence();
[[noreturn]] CUFLASH_SIM_API void trap(const Site& site);
[[noreturn]] CUFLASH_SIM_API void fail(const char* message);
[[noreturn]] CUFLASH_SIM_API void global_access_failed(const void* address, unsigned bytes, bool is_write, const char* why);

// A warp collective: every lane of `mask` deposits `in` and blocks until all of them
// have arrived at the same site with the same mask and the same operation; then one
// call of `compute` fills every lane's `out` from all lanes' `in`.
constexpr unsigned kLaneInBytes = 64;
constexpr unsigned kLaneOutBytes = 64;
struct LaneIO {
  alignas(16) unsigned char in[kLaneInBytes];
  alignas(16) unsigned char out[kLaneOutBytes];
};
// compute returns nullptr, or an error message naming what the lanes did wrong.
using CollectiveFn = const char* (*)(unsigned mask, LaneIO* lanes);
enum CollectiveFlags : unsigned {
  kCollectiveNone = 0,
  kCollectiveOrdersMemory = 1,  // __syncwarp: orders the named lanes' memory accesses
};
CUFLASH_SIM_API void warp_collective(const Site& site, unsigned mask, CollectiveFn compute, unsigned flags,
                                     const void* in, unsigned in_bytes, void* out, unsigned out_bytes);

// Profile mode (sim_profile.cpp): shared-memory accesses the twins make on a lane's behalf, by
// source location (plain loads and stores are seen by the instrumentation). A no-op elsewhere.
enum ProfileKind : unsigned {
  kProfileLoad = 0,
  kProfileStore = 1,
  kProfileLdmatrix = 2,
  kProfileCpAsync = 3,
  kProfileTmaLoad = 4,   // a TMA load's shared writes (sim_tma.cpp, profile_bulk_shared_access)
  kProfileTmaStore = 5,  // a TMA store's shared reads
  kProfileWgmmaRead = 6,  // a wgmma's shared operand reads (sim_wgmma.cpp, profile_bulk_shared_access)
};
CUFLASH_SIM_API void profile_shared_access(const Site& site, const void* address, unsigned bytes, unsigned kind);

// Global memory: find the registered buffer holding [p, p + bytes), else fail.
__forceinline__ void check_global(const BlockView* block, const void* p, unsigned bytes, bool is_write) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (__builtin_expect((a & (bytes - 1)) != 0, 0)) global_access_failed(p, bytes, is_write, "misaligned");
  const LaunchView* launch = block->launch;
  for (int i = 0; i < launch->num_buffers; ++i) {
    const Buffer& b = launch->buffers[i];
    if (a >= b.begin && a + bytes <= b.end) {
      if (is_write && !b.writable) global_access_failed(p, bytes, is_write, "read-only buffer");
      return;
    }
  }
  global_access_failed(p, bytes, is_write, "out of bounds");
}

CUFLASH_SIM_API void atomic_add_f32(float* p, float v);
CUFLASH_SIM_API void atomic_add_f32x2(float* p, float a, float b);

// The 32-bit shared-window address of a pointer into the block's dynamic shared memory: its byte
// offset from the shared base, which the runtime aligns to 1024 bytes as a GPU's shared window is.
inline unsigned shared_window_address(const void* p);

// ---- warp collectives on values ----
template <class T>
struct ShuffleIn {
  T value;
  unsigned b;      // srcLane / delta / laneMask
  int width;
};

enum class ShuffleMode { kIdx, kUp, kDown, kXor };

// The PTX shfl.sync formulas with c = ((32 - width) << 8) | (up ? 0 : 0x1f).
// A source lane outside the mask reads all-one bits (a NaN for float): the GPU
// leaves that value undefined, and NaN makes a use of it visible in results.
template <class T, ShuffleMode kMode>
const char* shuffle_compute(unsigned mask, LaneIO* lanes) {
  for (unsigned lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    ShuffleIn<T> in;
    __builtin_memcpy(&in, lanes[lane].in, sizeof in);
    const int width = in.width;
    if (width < 1 || width > 32 || (width & (width - 1)) != 0) return "shuffle width must be a power of two in 1..32";
    const unsigned seg_mask = ~static_cast<unsigned>(width - 1) & 31u;
    const unsigned bval = in.b & 31u;
    const unsigned min_lane = lane & seg_mask;
    const unsigned max_lane = kMode == ShuffleMode::kUp ? min_lane : (min_lane | (31u & ~seg_mask));
    int j;
    bool valid;
    switch (kMode) {
      case ShuffleMode::kUp:
        j = static_cast<int>(lane) - static_cast<int>(bval);
        valid = j >= static_cast<int>(max_lane);
        break;
      case ShuffleMode::kDown:
        j = static_cast<int>(lane + bval);
        valid = j <= static_cast<int>(max_lane);
        break;
      case ShuffleMode::kXor:
        j = static_cast<int>(lane ^ bval);
        valid = j <= static_cast<int>(max_lane);
        break;
      default:
        j = static_cast<int>(min_lane | (bval & ~seg_mask));
        valid = j <= static_cast<int>(max_lane);
        break;
    }
    if (!valid) j = static_cast<int>(lane);
    if (mask >> j & 1u) {
      __builtin_memcpy(lanes[lane].out, lanes[j].in, sizeof(T));
    } else {
      __builtin_memset(lanes[lane].out, 0xff, sizeof(T));
    }
  }
  return nullptr;
}

template <class T, ShuffleMode kMode>
__forceinline__ T shuffle(const Site& site, unsigned mask, T value, unsigned b, int width) {
  static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8),
                "shuffles move 2-, 4- or 8-byte trivially copyable values");
  const ShuffleIn<T> in{value, b, width};
  T out;
  warp_collective(site, mask, &shuffle_compute<T, kMode>, kCollectiveNone, &in, sizeof in, &out, sizeof out);
  return out;
}

inline const char* syncwarp_compute(unsigned, LaneIO*) { return nullptr; }

enum class VoteMode { kBallot, kAny, kAll };
template <VoteMode kMode>
const char* vote_compute(unsigned mask, LaneIO* lanes) {
  unsigned ballot = 0;
  for (unsigned lane = 0; lane < 32; ++lane) {
    int pred;
    __builtin_memcpy(&pred, lanes[lane].in, sizeof pred);
    if ((mask >> lane & 1u) && pred) ballot |= 1u << lane;
  }
  unsigned result = kMode == VoteMode::kBallot ? ballot
                    : kMode == VoteMode::kAny  ? (ballot != 0)
                                               : (ballot == mask);
  for (unsigned lane = 0; lane < 32; ++lane)
    if (mask >> lane & 1u) __builtin_memcpy(lanes[lane].out, &result, sizeof result);
  return nullptr;
}

template <VoteMode kMode>
__forceinline__ unsigned vote(const Site& site, unsigned mask, int predicate) {
  unsigned out;
  warp_collective(site, mask, &vote_compute<kMode>, kCollectiveNone, &predicate, sizeof predicate, &out, sizeof out);
  return out;
}

// ---- launching (called by generated launcher TUs) ----
using LaunchRequest = ::cuflash_sim_launch_request;  // the C ABI struct of sim_abi.h
using KernelThunk = void (*)(const void* kernel, const void* params);
CUFLASH_SIM_API int run_launch(LaunchRequest* request, KernelThunk thunk, const void* kernel,
                               unsigned long long params_size, long long max_threads);

template <class P>
void kernel_thunk(const void* kernel, const void* params) {
  P p;
  __builtin_memcpy(static_cast<void*>(&p), params, sizeof(P));
  reinterpret_cast<void (*)(P)>(const_cast<void*>(kernel))(p);
}

// Type-erases a kernel taking one trivially-copyable argument by value. max_threads: the first
// argument of the kernel's __launch_bounds__ (1024, the hardware limit, when it has none).
template <class P>
int launch_kernel(void (*kernel)(P), LaunchRequest* request, long long max_threads = 1024) {
  using Param = std::remove_cv_t<std::remove_reference_t<P>>;
  static_assert(std::is_trivially_copyable_v<Param>, "kernel arguments must be trivially copyable");
  static_assert(!std::is_reference_v<P>, "kernels take their argument by value");
  return run_launch(request, &kernel_thunk<Param>, reinterpret_cast<const void*>(kernel), sizeof(Param),
                    max_threads);
}

}  // namespace cuflash::sim

// ---- built-in variables ----------------------------------------------------------------
#define threadIdx (static_cast<const uint3&>(::cuflash::sim::current_thread()->thread_idx))
#define blockIdx (static_cast<const uint3&>(::cuflash::sim::current_thread()->block->block_idx))
#define blockDim (static_cast<const dim3&>(::cuflash::sim::current_thread()->block->launch->block_dim))
#define gridDim (static_cast<const dim3&>(::cuflash::sim::current_thread()->block->launch->grid_dim))

// Synchronizing built-ins take their call site as a defaulted last argument
// (file, line and column: two barriers on one line are still different sites).
#define CUFLASH_SIM_SITE(what) \
  ::cuflash::sim::Site { what, site_.file_name(), site_.line(), site_.column() }
#define CUFLASH_SIM_SITE_PARAMS std::source_location site_ = std::source_location::current()

// Shared memory: one block-private byte array of exactly the launch's dynamic size,
// filled with 0xFF bytes (NaN as float, half and bfloat16) at every block start.
#define CUFLASH_DYNAMIC_SMEM(name) \
  unsigned char* const name =      \
      static_cast<unsigned char*>(__builtin_assume_aligned(::cuflash::sim::current_thread()->block->smem, 16))

// ---- synchronization and collectives -------------------------------------------------------
__forceinline__ void __syncthreads(CUFLASH_SIM_SITE_PARAMS) {
  ::cuflash::sim::sync_threads(CUFLASH_SIM_SITE("__syncthreads"));
}
// A block's threads are fibers on one OS thread, so ordering among them needs only the compiler not to move
// memory accesses across the fence: an opaque call into the (uninstrumented) runtime does that, where an
// atomic fence would be instrumented by race mode's TSan pass.
__forceinline__ void __threadfence_block() { cuflash::sim::block_fence(); }
__forceinline__ int __syncthreads_count(int predicate, CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::sync_threads_reduce(CUFLASH_SIM_SITE("__syncthreads"), predicate, 0);
}
__forceinline__ int __syncthreads_and(int predicate, CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::sync_threads_reduce(CUFLASH_SIM_SITE("__syncthreads"), predicate, 1);
}
__forceinline__ int __syncthreads_or(int predicate, CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::sync_threads_reduce(CUFLASH_SIM_SITE("__syncthreads"), predicate, 2);
}
__forceinline__ void __syncwarp(unsigned mask = 0xffffffffu, CUFLASH_SIM_SITE_PARAMS) {
  ::cuflash::sim::warp_collective(CUFLASH_SIM_SITE("__syncwarp"), mask, &::cuflash::sim::syncwarp_compute,
                                  ::cuflash::sim::kCollectiveOrdersMemory, nullptr, 0, nullptr, 0);
}
[[noreturn]] __forceinline__ void __trap(CUFLASH_SIM_SITE_PARAMS) { ::cuflash::sim::trap(CUFLASH_SIM_SITE("__trap")); }

template <class T>
__forceinline__ T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::shuffle<T, ::cuflash::sim::ShuffleMode::kIdx>(CUFLASH_SIM_SITE("__shfl_sync"), mask, var,
                                                                      static_cast<unsigned>(src_lane), width);
}
template <class T>
__forceinline__ T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::shuffle<T, ::cuflash::sim::ShuffleMode::kUp>(CUFLASH_SIM_SITE("__shfl_up_sync"), mask, var,
                                                                     delta, width);
}
template <class T>
__forceinline__ T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                                   CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::shuffle<T, ::cuflash::sim::ShuffleMode::kDown>(CUFLASH_SIM_SITE("__shfl_down_sync"), mask,
                                                                       var, delta, width);
}
template <class T>
__forceinline__ T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                                  CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::shuffle<T, ::cuflash::sim::ShuffleMode::kXor>(CUFLASH_SIM_SITE("__shfl_xor_sync"), mask, var,
                                                                      static_cast<unsigned>(lane_mask), width);
}
// __match_any_sync: each lane gets the lanes of `mask` holding the same value as its own.
// __reduce_{add,min,max,and,or,xor}_sync: every lane of `mask` gets the reduction of their values.
namespace cuflash::sim {
template <class T>
const char* match_any_compute(unsigned mask, LaneIO* lanes) {
  T v[32];
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1u) __builtin_memcpy(&v[l], lanes[l].in, sizeof(T));
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    unsigned same = 0;
    for (int o = 0; o < 32; ++o)
      if ((mask >> o & 1u) && v[o] == v[l]) same |= 1u << o;
    __builtin_memcpy(lanes[l].out, &same, sizeof same);
  }
  return nullptr;
}
enum class ReduceOp { kAdd, kMin, kMax, kAnd, kOr, kXor };
template <class T, ReduceOp kOp>
const char* reduce_compute(unsigned mask, LaneIO* lanes) {
  bool first = true;
  T acc{};
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    T v;
    __builtin_memcpy(&v, lanes[l].in, sizeof v);
    if (first) {
      acc = v;
      first = false;
      continue;
    }
    switch (kOp) {
      case ReduceOp::kAdd: acc = static_cast<T>(static_cast<unsigned>(acc) + static_cast<unsigned>(v)); break;  // wraps
      case ReduceOp::kMin: acc = v < acc ? v : acc; break;
      case ReduceOp::kMax: acc = v > acc ? v : acc; break;
      case ReduceOp::kAnd: acc &= v; break;
      case ReduceOp::kOr: acc |= v; break;
      case ReduceOp::kXor: acc ^= v; break;
    }
  }
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1u) __builtin_memcpy(lanes[l].out, &acc, sizeof acc);
  return nullptr;
}
}  // namespace cuflash::sim

template <class T>
__forceinline__ unsigned __match_any_sync(unsigned mask, T value, CUFLASH_SIM_SITE_PARAMS) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_any_sync compares 32- or 64-bit values");
  unsigned out = 0;
  ::cuflash::sim::warp_collective(CUFLASH_SIM_SITE("__match_any_sync"), mask, &::cuflash::sim::match_any_compute<T>,
                                  ::cuflash::sim::kCollectiveNone, &value, sizeof value, &out, sizeof out);
  return out;
}
#define CUFLASH_SIM_REDUCE(name, T, op)                                                                              \
  __forceinline__ T name(unsigned mask, T value, CUFLASH_SIM_SITE_PARAMS) {                                         \
    T out{};                                                                                                         \
    ::cuflash::sim::warp_collective(CUFLASH_SIM_SITE(#name), mask,                                                   \
                                    &::cuflash::sim::reduce_compute<T, ::cuflash::sim::ReduceOp::op>,                \
                                    ::cuflash::sim::kCollectiveNone, &value, sizeof value, &out, sizeof out);        \
    return out;                                                                                                      \
  }
CUFLASH_SIM_REDUCE(__reduce_add_sync, unsigned, kAdd)
CUFLASH_SIM_REDUCE(__reduce_add_sync, int, kAdd)
CUFLASH_SIM_REDUCE(__reduce_min_sync, unsigned, kMin)
CUFLASH_SIM_REDUCE(__reduce_min_sync, int, kMin)
CUFLASH_SIM_REDUCE(__reduce_max_sync, unsigned, kMax)
CUFLASH_SIM_REDUCE(__reduce_max_sync, int, kMax)
CUFLASH_SIM_REDUCE(__reduce_and_sync, unsigned, kAnd)
CUFLASH_SIM_REDUCE(__reduce_or_sync, unsigned, kOr)
CUFLASH_SIM_REDUCE(__reduce_xor_sync, unsigned, kXor)
#undef CUFLASH_SIM_REDUCE

__forceinline__ unsigned __ballot_sync(unsigned mask, int predicate, CUFLASH_SIM_SITE_PARAMS) {
  return ::cuflash::sim::vote<::cuflash::sim::VoteMode::kBallot>(CUFLASH_SIM_SITE("__ballot_sync"), mask, predicate);
}
__forceinline__ int __any_sync(unsigned mask, int predicate, CUFLASH_SIM_SITE_PARAMS) {
  return static_cast<int>(
      ::cuflash::sim::vote<::cuflash::sim::VoteMode::kAny>(CUFLASH_SIM_SITE("__any_sync"), mask, predicate));
}
__forceinline__ int __all_sync(unsigned mask, int predicate, CUFLASH_SIM_SITE_PARAMS) {
  return static_cast<int>(
      ::cuflash::sim::vote<::cuflash::sim::VoteMode::kAll>(CUFLASH_SIM_SITE("__all_sync"), mask, predicate));
}

#include "sim_tensor.h"
#include "sim_mbarrier.h"
#include "sim_wgmma.h"
#include "sim_tma.h"

// ---- CPU twins of the arch layer ---------------------------------------------------------------
namespace cuflash::sim {
inline unsigned shared_window_address(const void* p) {
  const BlockView* block = current_thread()->block;
  const uintptr_t base = reinterpret_cast<uintptr_t>(block->smem);
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at < base || at > base + block->launch->smem_bytes)
    fail("smem_address: the pointer is not inside the block's dynamic shared memory");
  return static_cast<unsigned>(at - base);
}
// Its inverse: the pointer a shared-window address names (the twins that take one check its bounds).
inline void* shared_window_pointer(unsigned address) { return current_thread()->block->smem + address; }
}  // namespace cuflash::sim

namespace cuflash::arch {

template <class T>
struct is_global_word {
  static constexpr bool value = sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16;
};

// Checked against the launch's registered buffers (bounds, alignment, writability)
// and counted: bytes_read / bytes_written of the launch record.
template <class T>
__forceinline__ T load(const T* p) {
  static_assert(is_global_word<T>::value, "global loads move 2, 4, 8 or 16 bytes");
  static_assert(std::is_trivially_copyable_v<T>, "global loads move trivially copyable values");
  sim::BlockView* block = sim::current_thread()->block;
  sim::check_global(block, p, sizeof(T), false);
  block->bytes_read += sizeof(T);
  return *p;
}

template <class T>
__forceinline__ void store(T* p, T v) {
  static_assert(is_global_word<T>::value, "global stores move 2, 4, 8 or 16 bytes");
  static_assert(std::is_trivially_copyable_v<T>, "global stores move trivially copyable values");
  sim::BlockView* block = sim::current_thread()->block;
  sim::check_global(block, p, sizeof(T), true);
  block->bytes_written += sizeof(T);
  *p = v;
}

// Float32 reduction (red.global.add.f32): checked, counted as 4 bytes read + 4 written,
// performed atomically (blocks run on several workers at once).
__forceinline__ void atomic_add(float* p, float v) { sim::atomic_add_f32(p, v); }
// red.global.add.v2.f32: p 8-byte aligned (checked), 8 bytes read + 8 written, each element added atomically.
template <int kUnused = 0> __forceinline__ void atomic_add2(float* p, float a, float b) {
  sim::atomic_add_f32x2(p, a, b);
}

__forceinline__ unsigned dynamic_smem_size() { return sim::current_thread()->block->launch->smem_bytes; }

// ex2.approx.ftz.f32: within 2 ulp of 2^x with subnormal inputs and results flushed to a zero of
// the same sign. exp2f here is correctly rounded (glibc), so results can differ in the last bits;
// the flushing is the GPU's. +0 for -inf and +inf for +inf, which online softmax relies on.
__forceinline__ float flush_subnormal(float x) { return std::fabs(x) < 1.17549435e-38f ? std::copysign(0.f, x) : x; }
__forceinline__ float exp2_approx(float x) { return flush_subnormal(exp2f(flush_subnormal(x))); }
// lg2.approx.ftz.f32: log2 of x with a subnormal x flushed to a zero of its sign: -inf for +-0, NaN below 0.
__forceinline__ float log2_approx(float x) { return log2f(flush_subnormal(x)); }

}  // namespace cuflash::arch

// __expf: ex2.approx.ftz of x * log2(e) rounded to float, as the CUDA headers define it.
__forceinline__ float __expf(float x) { return cuflash::arch::exp2_approx(x * 1.4426950408889634f); }
// __ldg: a read-only global load; checked and counted like every other global load.
template <class T>
__forceinline__ T __ldg(const T* p) {
  return cuflash::arch::load(p);
}
