// fa1_common.cuh: what the FA1 forward and backward kernels share.
//
//  - the thread count (both kernels are SIMT: 128 threads, no tensor cores yet),
//  - which K/V blocks a Q block sees (the causal block skip),
//  - the element-wise mask inside a crossing block,
//  - loading a (rows x head dim) tile of Q/K/V/O/dO into shared memory as float32.
//
// Tiles of d-wide rows live in shared memory with a row stride of HeadDim + 1
// floats. Every product loop walks such a tile either along a row with
// consecutive threads on consecutive columns (any stride is conflict-free) or
// down a column with consecutive threads on consecutive rows; the odd stride
// puts those 32 rows in 32 different banks.
#pragma once

#include "arch/arch.cuh"

namespace cuflash {
namespace fa1 {

constexpr int kThreads = 128;
// The launch plan gives both kernels the largest budget its target allows (the
// paper's M: 163 KB on sm_80/87, 99 KB on sm_86/89/120; families/fa1.py
// BUDGETS), so one block is resident per SM.
// Saying so lets ptxas use the registers it needs: with no minimum-blocks hint it
// capped the forward at 72 registers and spilled a few bytes on sm_80.
constexpr int kMinBlocksPerSm = 1;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// exp(a - b) for scores in natural units, through ex2.approx: the difference is
// formed first (exact when a and b are close, as they are wherever the result
// is not negligible) and only then scaled by log2(e). See the opening comment of
// fa1_forward.cu for why the scale is not folded into the scores.
__device__ __forceinline__ float exp_of_difference(float a, float b) {
  constexpr float kLog2e = 1.44269504088896341f;
  return arch::exp2_approx((a - b) * kLog2e);
}

// Number of K/V blocks (of BlockCols keys) that Q block `q_block` (of BlockRows
// rows) sees: all of them without a mask; with the causal mask (aligned to the
// bottom-right corner: row i sees key j iff j <= i + seqlen_k - seqlen_q) the
// blocks up to the one holding the last key its last row sees. Blocks past that
// are wholly above the diagonal and are skipped. The count grows with q_block,
// so the last Q block sees the most (all of them when seqlen_q > 0).
template <int BlockRows, int BlockCols>
__device__ __forceinline__ int visible_kv_blocks(const AttentionParams& p, int q_block) {
  const int num_kv_blocks = ceil_div(p.seqlen_k, BlockCols);
  if (!p.is_causal) return num_kv_blocks;
  const int last_row = min((q_block + 1) * BlockRows, p.seqlen_q) - 1;
  const int last_key = last_row + p.seqlen_k - p.seqlen_q;
  if (last_key < 0) return 0;
  return min(num_kv_blocks, last_key / BlockCols + 1);
}

// Whether query row `row` may attend to key `key` (both absolute indices).
__device__ __forceinline__ bool key_visible(const AttentionParams& p, int row, int key) {
  return key < p.seqlen_k && (!p.is_causal || key <= row + p.seqlen_k - p.seqlen_q);
}

// tile[r * (HeadDim + 1) + c] = rows[r * row_stride + c] as float, for r < Rows,
// c < HeadDim; zero where r >= valid_rows or c >= headdim (the predicated tail of
// a partial block or of a head dim below the compiled one). The zeros matter:
// shared memory starts as garbage (NaN in the simulator), and products over the
// padded range must add exact zeros. Consecutive threads take consecutive
// columns, so global reads are coalesced along the contiguous head dim.
template <int Rows, int HeadDim, class T>
__device__ __forceinline__ void load_tile(float* tile, const T* rows, long long row_stride, int valid_rows,
                                          int headdim) {
  for (int e = threadIdx.x; e < Rows * HeadDim; e += kThreads) {
    const int r = e / HeadDim;
    const int c = e % HeadDim;
    float x = 0.f;
    if (r < valid_rows && c < headdim) x = to_float(arch::load(rows + r * row_stride + c));
    tile[r * (HeadDim + 1) + c] = x;
  }
}

}  // namespace fa1
}  // namespace cuflash
