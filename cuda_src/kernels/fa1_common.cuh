// fa1_common.cuh: what the FA1 forward and backward kernels share.
//
//  - the thread count (both kernels are SIMT: 128 threads, no tensor cores yet),
//  - which K/V blocks a Q block visits (through mask.cuh, the one home of visibility),
//  - loading a (rows x head dim) tile of Q/K/V/O/dO into shared memory as float32.
//
// Tiles of d-wide rows live in shared memory with a row stride of HeadDim + 1
// floats. Every product loop walks such a tile either along a row with
// consecutive threads on consecutive columns (any stride is conflict-free) or
// down a column with consecutive threads on consecutive rows; the odd stride
// puts those 32 rows in 32 different banks.
#pragma once

#include "arch/arch.cuh"
#include "common/block_info.cuh"
#include "common/kernel_utils.cuh"
#include "common/mask.cuh"

namespace cuflash {
namespace fa1 {

constexpr int kThreads = 128;
constexpr int kReduceThreads = 256;  // fa1_gqa_reduce_kernel's block (fa1.py's REDUCE_THREADS)
// The launch plan gives both kernels the largest budget its target allows (the
// paper's M: 163 KB on sm_80/87, 99 KB on sm_86/89/120; families/fa1.py
// BUDGETS), so one block is resident per SM.
// Saying so lets ptxas use the registers it needs: with no minimum-blocks hint it
// capped the forward at 72 registers and spilled a few bytes on sm_80.
constexpr int kMinBlocksPerSm = 1;

// exp(a - b) for scores in natural units, through ex2.approx: the difference is
// formed first (exact when a and b are close, as they are wherever the result
// is not negligible) and only then scaled by log2(e). See the opening comment of
// fa1_forward.cu for why the scale is not folded into the scores.
__device__ __forceinline__ float exp_of_difference(float a, float b) {
  return arch::exp2_approx((a - b) * kLog2e);
}

// The K/V blocks (of BlockCols keys) that Q block `q_block` (of BlockRows rows) visits: the
// blocks holding a key one of its rows sees (mask.cuh); empty when none of its rows sees a key.
template <int BlockRows, int BlockCols>
__device__ __forceinline__ IndexRange kv_blocks_of_q_block(const MaskPolicy& mask, int q_block) {
  const int row0 = q_block * BlockRows;
  return mask.kv_blocks<BlockCols>(row0, min(row0 + BlockRows, mask.seqlen_q));
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
