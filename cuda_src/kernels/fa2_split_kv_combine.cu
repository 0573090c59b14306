// Split-KV combine (the second step of flash-decoding): merges the float32 partial results the fa2 forward kernels
// wrote with num_kv_splits > 1 into out and lse. Serves both fa2 variants (SIMT float32 and tensor-core 16-bit).
//
// What it computes, per (batch, query head, row), over the splits s whose K/V ranges partition the row's keys:
//     lse = log sum_s exp(lse_s)            (max-shifted; -inf when no split saw a key)
//     out = sum_s exp(lse_s - lse) O_s      (O_s = the split's O / l_s; 0 when lse = -inf)
// which is exactly the softmax over all keys: exp(lse_s) is split s's sum of exp(score), and O_s its weighted mean.
// With sinks, split 0's partial result already holds the sink (sink.cuh), so the merge takes it once.
//
// How it partitions work: fa2::RowKernel's launch, grid = (ceil(seqlen_q / 16), nheads, batch), 128 threads, a warp
// per row. Lane i holds lse_s of splits s = i, i + 32, ... (at most kMaxSplits = 128 splits: 4 registers), the warp
// reduces their max and sum with shuffles; then, split by split, the weight is broadcast from its lane and every
// lane adds weight * O_s over its columns c = lane, lane + 32, ... (coalesced reads of out_accum).
//
// What it costs, per row: reads num_splits * (4 + headdim_v * 4) bytes (lse_accum, out_accum), writes headdim_v * es
// + 4 (out, lse). Splits are summed in index order: the result is bitwise reproducible.
#include "arch/arch.cuh"
#include "kernels/fa2_tiles.cuh"

namespace cuflash {
namespace fa2 {

struct SplitKvCombine {
  static constexpr int kMaxSplits = 128;  // fa2.py's MAX_KV_SPLITS
  static constexpr int kSplitsPerLane = kMaxSplits / 32;
  static constexpr int kMaxColumnsPerLane = 256 / 32;  // head dims up to 256
};

}  // namespace fa2

// __launch_bounds__(threads, 4): at least 4 blocks per SM, so ptxas may use up to 128 registers. With the block size
// alone NVRTC 12.9's ptxas capped sm_90 at 64 and spilled 8 bytes once AttentionParams grew its 64-byte-aligned TMA
// block; now 62 (sm_80) and 75 (sm_90) under both NVRTC 12.9 and 13.5, no spill.
template <class T>
__global__ void __launch_bounds__(fa2::RowKernel::kThreads, 4) fa2_split_kv_combine_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "float, __half or __nv_bfloat16");
  using Combine = fa2::SplitKvCombine;
  constexpr int kWarps = fa2::RowKernel::kThreads / 32;
  const int splits = p.num_kv_splits;
  if (launch_differs_from_traits<0, fa2::RowKernel::kThreads>() || splits < 2 || splits > Combine::kMaxSplits ||
      p.headdim_v > 256)
    __trap();
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const int lane = threadIdx.x % 32;
  const int row_end = min(info.seqlen_q(p), (static_cast<int>(blockIdx.x) + 1) * fa2::RowKernel::kRows);
  for (int row = blockIdx.x * fa2::RowKernel::kRows + threadIdx.x / 32; row < row_end; row += kWarps) {
    float part_lse[Combine::kSplitsPerLane];
    float max_lse = neg_inf();
#pragma unroll
    for (int i = 0; i < Combine::kSplitsPerLane; ++i) {
      const int split = 32 * i + lane;
      part_lse[i] = split < splits ? arch::load(info.lse_accum_split(p, split) + row) : neg_inf();
      max_lse = fmaxf(max_lse, part_lse[i]);
    }
    max_lse = fa2::group_max<32>(max_lse);
    // Weights relative to the largest split's lse (every split -inf: all weights 0, out 0, lse -inf).
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < Combine::kSplitsPerLane; ++i) {
      part_lse[i] = max_lse == neg_inf() ? 0.f : expf(part_lse[i] - max_lse);  // exp(-inf) = 0 for the unused
      sum += part_lse[i];
    }
    sum = fa2::group_sum<32>(sum);
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;

    float acc[Combine::kMaxColumnsPerLane];
#pragma unroll
    for (int c = 0; c < Combine::kMaxColumnsPerLane; ++c) acc[c] = 0.f;
#pragma unroll
    for (int i = 0; i < Combine::kSplitsPerLane; ++i) {
      if (32 * i >= splits) break;  // warp-uniform
      for (int source = 0; source < 32 && 32 * i + source < splits; ++source) {
        const float weight = __shfl_sync(0xffffffffu, part_lse[i], source) * inv_sum;
        const float* o_split = info.out_accum_split(p, 32 * i + source) + row * BlockInfo::dense_out_row_stride(p);
#pragma unroll
        for (int c = 0; c < Combine::kMaxColumnsPerLane; ++c) {
          const int col = lane + 32 * c;
          if (col < p.headdim_v) acc[c] = fmaf(weight, arch::load(o_split + col), acc[c]);
        }
      }
    }
    T* out = info.out<T>(p) + row * p.out_stride.row;
#pragma unroll
    for (int c = 0; c < Combine::kMaxColumnsPerLane; ++c) {
      const int col = lane + 32 * c;
      if (col < p.headdim_v) arch::store(out + col, from_float<T>(acc[c]));
    }
    if (lane == 0)
      arch::store(p.lse + info.row_stats_offset(p) + row, sum > 0.f ? max_lse + logf(sum) : neg_inf());
  }
}

}  // namespace cuflash
