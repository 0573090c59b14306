// flex_mod.cuh: what the CUDA C++ that cuflash.flex emits for a score_mod / mask_mod needs, and nothing
// more: the side-array descriptor a kernel's params carry, reads through cuflash::arch::load, and the
// scalar operations whose semantics a C operator does not give (XLA's integer division by zero, NaN-
// propagating max/min, saturating float -> int, rounding to 16-bit floats).
//
// Calling convention. Each mod is a struct a kernel takes as a template argument:
//   struct FlexMod_<hash> {
//     static constexpr int kSides;          // side arrays it reads (sides.arrays[0 .. kSides))
//     static constexpr bool kHasDScore;     // score mods: whether dscore exists
//     static float score(float score, int b, int h, int q_idx, int kv_idx, const Sides& sides);
//     static float dscore(float score, int b, int h, int q_idx, int kv_idx, const Sides& sides);  // d score / d score
//     static bool mask(int b, int h, int q_idx, int kv_idx, const Sides& sides);               // mask mods
//     static constexpr bool kHasSideGrads;  // score mods: whether side_grads exists; it adds g * d score / d side
//     static void side_grads(float g, float score, int b, int h, int q_idx, int kv_idx, const Sides& sides,
//                            const SideGrads& grads);
//     static constexpr float kScoreFactor;  // score mods: the functions take score * kScoreFactor (1 but for a
//                                           // fast-math mod reading score only as score * c: flex._emit)
//   };
// (all __device__ __forceinline__). score is the scaled float32 score before softmax; h the query head.
#pragma once

#include "../arch/arch.cuh"
#include "attention_params.cuh"
#include "kernel_utils.cuh"  // kLog2e and tanh_by_exp2, which fast-math mods call

namespace cuflash::flex {

// SideArray, Sides and SideGrads (kMaxSides arrays of at most kMaxSideDims dims) are declared with AttentionParams,
// which carries them (common/attention_params.cuh).

// What a side element of stored type T reads as: float for the float types, int for int32 (int8 / uint8
// travel widened to int32), bool for bool (stored as an int32 0 / 1: global loads move 2 bytes or more).
template <class T> struct side_traits {
  using stored = T;
  using value = float;
  static constexpr bool is_bool = false;
};
template <> struct side_traits<int> {
  using stored = int;
  using value = int;
  static constexpr bool is_bool = false;
};
template <> struct side_traits<bool> {
  using stored = int;
  using value = bool;
  static constexpr bool is_bool = true;
};

__device__ __forceinline__ float side_value(float x) { return x; }
__device__ __forceinline__ float side_value(__half x) { return to_float(x); }
__device__ __forceinline__ float side_value(__nv_bfloat16 x) { return to_float(x); }
__device__ __forceinline__ int side_value(int x) { return x; }

template <class T>
__device__ __forceinline__ typename side_traits<T>::value side_read(const SideArray& array, long long offset) {
  const auto raw = arch::load(static_cast<const typename side_traits<T>::stored*>(array.data) + offset);
  if constexpr (side_traits<T>::is_bool)
    return raw != 0;
  else
    return side_value(raw);
}

// The expert form's accessor: bias(h, i) reads element [h, i] (no clamping: the expert code's indices
// must be in bounds; the simulator checks every read against the launch's buffers).
template <class T, int N> struct SideView {
  const SideArray& array;
  template <class... I> __device__ __forceinline__ typename side_traits<T>::value operator()(I... index) const {
    static_assert(sizeof(T) != 0 && sizeof...(I) == N, "a side array takes one index per dimension");
    long long offset = 0;
    int d = 0;
    ((offset += static_cast<long long>(index) * array.strides[d++]), ...);
    return side_read<T>(array, offset);
  }
};

// ---- scalar semantics of the jaxpr primitives (XLA's) ----------------------------------------

__device__ __forceinline__ int clamp_index(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Two's complement wrap-around (C's signed overflow is undefined).
__device__ __forceinline__ int wrap_add(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b));
}
__device__ __forceinline__ int wrap_sub(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) - static_cast<unsigned>(b));
}
__device__ __forceinline__ int wrap_mul(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) * static_cast<unsigned>(b));
}
__device__ __forceinline__ int wrap_neg(int a) { return static_cast<int>(0u - static_cast<unsigned>(a)); }
__device__ __forceinline__ int int_abs(int a) { return a < 0 ? wrap_neg(a) : a; }
__device__ __forceinline__ int int_sign(int a) { return (a > 0) - (a < 0); }
// XLA: x / 0 = -1, INT_MIN / -1 = INT_MIN; x % 0 = x, x % -1 = 0. Otherwise C's truncation.
__device__ __forceinline__ int int_div(int a, int b) { return b == 0 ? -1 : (b == -1 ? wrap_neg(a) : a / b); }
__device__ __forceinline__ int int_rem(int a, int b) { return b == 0 ? a : (b == -1 ? 0 : a % b); }

// XLA's float -> int32: truncation, saturating, NaN -> 0.
__device__ __forceinline__ int float_to_int(float x) {
  return x != x ? 0 : (x >= 2147483648.f ? 2147483647 : (x <= -2147483648.f ? -2147483647 - 1 : static_cast<int>(x)));
}
// max / min propagate NaN; max(-0, +0) = +0 and min(-0, +0) = -0 in either order.
__device__ __forceinline__ float float_max(float a, float b) {
  if (a != a || b != b) return a + b;
  return a > b ? a : (b > a ? b : (__float_as_int(a) >= 0 ? a : b));
}
__device__ __forceinline__ float float_min(float a, float b) {
  if (a != a || b != b) return a + b;
  return a < b ? a : (b < a ? b : (__float_as_int(a) < 0 ? a : b));
}
__device__ __forceinline__ float float_sign(float a) { return a > 0.f ? 1.f : (a < 0.f ? -1.f : a); }
__device__ __forceinline__ float logistic(float a) { return 1.f / (1.f + expf(-a)); }
__device__ __forceinline__ bool float_is_finite(float a) { return fabsf(a) < __uint_as_float(0x7f800000u); }

// Values of the 16-bit float dtypes are floats holding a representable value: every result rounds.
__device__ __forceinline__ float round_to_half(float a) { return to_float(__float2half_rn(a)); }
__device__ __forceinline__ float round_to_bfloat16(float a) { return to_float(__float2bfloat16_rn(a)); }
// Values of int8 / uint8 are ints in range: every result wraps.
__device__ __forceinline__ int wrap_int8(int a) { return static_cast<signed char>(a); }
__device__ __forceinline__ int wrap_uint8(int a) { return static_cast<unsigned char>(a); }

}  // namespace cuflash::flex
