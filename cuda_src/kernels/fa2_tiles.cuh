// fa2_tiles.cuh: the building blocks the FA2 forward and backward kernels share.
//
//  - moving (rows x head dim) tiles between global memory and float32 shared
//    memory, 4 elements at a time (one 16-byte float4 / 8-byte half4 access
//    when the address allows it, element by element at a ragged tail),
//  - three register-blocked SIMT products over float32 shared-memory tiles:
//        mma_nt:  C[m][n] += sum_k A[m][k] * B[n][k]   (S = Q K^T, dP = dO V^T)
//        mma_nn:  C[m][n] += sum_k A[m][k] * B[k][n]   (O += P V,  dQ = dS K)
//        mma_tn:  C[m][n] += sum_k A[k][m] * B[k][n]   (dV += P^T dO, dK += dS^T Q)
//    Each thread owns a small tile of C in registers; operands are read from
//    shared memory as float4, so one load feeds 4 (mma_nt: along k) or 4 x TM
//    (mma_nn / mma_tn: along n) FMAs. These are the SIMT stand-ins for FA2's
//    mma.sync tiles, for float32 inputs (16-bit inputs run the tensor-core kernels, fa2_tc_*.cu).
//    The long reductions (mma_nt over the head dim, mma_nn over keys) sum in two
//    levels, 4 products of one k-step first and then into the accumulator, as an
//    MMA sums its k-slice before accumulating: one extra FADD per 4 FMAs halves
//    the rounding-error growth of a single running sum, which float32 inputs
//    (judged against a float32 BLAS yardstick) need. The k loops are not
//    unrolled: each step already has TM x TN x 4 independent FMAs, and unrolling
//    only raised register pressure (head dim 64 forward: 168 -> 160 registers).
//
// Shared-memory tiles are float32 row-major with a row stride of (width + 4)
// floats. Why +4: the widths are multiples of 32 floats, so without padding the
// same column of 8 consecutive rows would sit in one bank quad; with +4 they
// fall in 8 different quads, and a float4 read of one column by 8 lanes (one
// shared-memory phase of a 128-bit access) is conflict-free. Reads of one row
// by many lanes are broadcasts.
//
// Everything here lives in namespace cuflash::fa2: the simulator links every
// kernel family into one library, so helper names must not collide.
#pragma once

#include "arch/arch.cuh"
#include "common/block_info.cuh"
#include "common/kernel_utils.cuh"
#include "common/dropout.cuh"
#include "common/mask.cuh"

namespace cuflash {
namespace fa2 {

// ---- global <-> shared, 4 elements at a time ---------------------------------------------

// Four consecutive elements moved as one global access (16 bytes for float, 8 for 16-bit types).
template <class T>
struct alignas(4 * sizeof(T)) Chunk4 {
  T v[4];
};

template <class T>
__device__ __forceinline__ bool chunk_aligned(const T* p) {
  return (reinterpret_cast<unsigned long long>(p) & (sizeof(Chunk4<T>) - 1)) == 0;
}

// x[0..3] = src[0..3] as float; only the first `valid` elements are read, the rest are 0.
// A full, aligned chunk is one vector load; a ragged tail (head dim not a multiple of 4, or
// strides that break alignment) falls back to element loads. Either way exactly
// min(valid, 4) elements are read, so the traffic formulas count elements, not accesses.
template <class T>
__device__ __forceinline__ float4 load_chunk4(const T* src, int valid) {
  float x[4] = {0.f, 0.f, 0.f, 0.f};
  if (valid >= 4 && chunk_aligned(src)) {
    const Chunk4<T> c = arch::load(reinterpret_cast<const Chunk4<T>*>(src));
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = to_float(c.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < valid) x[e] = to_float(arch::load(src + e));
  }
  return make_float4(x[0], x[1], x[2], x[3]);
}

// dst[0..min(valid,4)) = x (converted to T); nothing past `valid` is written.
template <class T>
__device__ __forceinline__ void store_chunk4(T* dst, const float (&x)[4], int valid) {
  if (valid >= 4 && chunk_aligned(dst)) {
    Chunk4<T> c;
#pragma unroll
    for (int e = 0; e < 4; ++e) c.v[e] = from_float<T>(x[e]);
    arch::store(reinterpret_cast<Chunk4<T>*>(dst), c);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < valid) arch::store(dst + e, from_float<T>(x[e]));
  }
}

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void sts4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// tile[r][c] (row stride Stride floats) = rows[r * row_stride + c] as float for r < Rows,
// c < Width; zero where r >= valid_rows or c >= headdim. The zeros matter: shared memory
// starts as garbage (NaN in the simulator) and the products run over the whole padded
// tile, so the padding must contribute exact zeros. `threads` threads starting at
// `thread` share the work; consecutive threads take consecutive 4-element chunks of a row
// (coalesced along the contiguous head dim).
template <int Rows, int Width, int Stride, class T>
__device__ __forceinline__ void load_tile(float* tile, const KeyRows<const T>& rows, int valid_rows, int headdim,
                                          int thread, int threads) {
  static_assert(Width % 4 == 0 && Stride % 4 == 0, "tiles move in float4 chunks");
  constexpr int kChunksPerRow = Width / 4;
  for (int c = thread; c < Rows * kChunksPerRow; c += threads) {
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < valid_rows) x = load_chunk4(rows.row(r) + col, headdim - col);
    sts4(tile + r * Stride + col, x);
  }
}

// The same from contiguous rows: rows[r * row_stride + c].
template <int Rows, int Width, int Stride, class T>
__device__ __forceinline__ void load_tile(float* tile, const T* rows, long long row_stride, int valid_rows,
                                          int headdim, int thread, int threads) {
  load_tile<Rows, Width, Stride>(tile, KeyRows<const T>{rows, row_stride, 0, nullptr, 0, 0}, valid_rows, headdim,
                                 thread, threads);
}

// ---- register-blocked products over shared-memory tiles ----------------------------------
//
// Thread-tile mapping. Threads of one product form a ThreadsM x ThreadsN grid (thread t is
// (t / ThreadsN, t % ThreadsN), so a warp spans few rows and many columns: its A reads are
// broadcasts). A granule is a single row/column (Granule = 1) or a float4 chunk of 4
// (Granule = 4); a thread owns granules g0, g0 + Threads, g0 + 2 * Threads, ... along each
// axis (strided, so neighbouring threads touch neighbouring granules at the same time).

// The widest ThreadsN <= 32 (one warp wide at most) that tiles an M x N granule grid
// evenly with `threads` threads; 0 if none does (a static_assert reports it).
__host__ __device__ constexpr int pick_threads_n(int m_granules, int n_granules, int threads) {
  for (int tn = 32; tn >= 1; tn /= 2)
    if (n_granules % tn == 0 && threads % tn == 0 && m_granules % (threads / tn) == 0) return tn;
  return 0;
}

template <int MGranules, int NGranules, int Threads, int ForcedThreadsN = 0>
struct ThreadTile {
  static constexpr int kThreadsN =
      ForcedThreadsN ? ForcedThreadsN : pick_threads_n(MGranules, NGranules, Threads);
  static_assert(kThreadsN > 0 && Threads % kThreadsN == 0, "no even thread tiling for this tile");
  static constexpr int kThreadsM = Threads / kThreadsN;
  static_assert(MGranules % kThreadsM == 0 && NGranules % kThreadsN == 0, "uneven thread tiling");
  static constexpr int kM = MGranules / kThreadsM;  // granules per thread along M
  static constexpr int kN = NGranules / kThreadsN;  // granules per thread along N
};

// acc[i][j] += sum_{k < k_extent} A(i)[k] * B(j)[k], where A(i) = a + i * a_step and
// B(j) = b + j * b_step are rows contiguous along k (16-byte aligned, k_extent % 4 == 0).
template <int TM, int TN>
__device__ __forceinline__ void mma_nt(float (&acc)[TM][TN], const float* a, int a_step, const float* b,
                                       int b_step, int k_extent) {
#pragma unroll 1
  for (int k = 0; k < k_extent; k += 4) {
    float4 av[TM], bv[TN];
#pragma unroll
    for (int i = 0; i < TM; ++i) av[i] = lds4(a + i * a_step + k);
#pragma unroll
    for (int j = 0; j < TN; ++j) bv[j] = lds4(b + j * b_step + k);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        float s = av[i].x * bv[j].x;
        s = fmaf(av[i].y, bv[j].y, s);
        s = fmaf(av[i].z, bv[j].z, s);
        s = fmaf(av[i].w, bv[j].w, s);
        acc[i][j] += s;
      }
  }
}

__device__ __forceinline__ void fma4(float (&acc)[4], float a, float4 b) {
  acc[0] = fmaf(a, b.x, acc[0]);
  acc[1] = fmaf(a, b.y, acc[1]);
  acc[2] = fmaf(a, b.z, acc[2]);
  acc[3] = fmaf(a, b.w, acc[3]);
}

// acc[i][j][0..3] += sum_{k < K} A(i)[k] * B[k][chunk j], where A(i) = a + i * a_step is a
// row contiguous along k and B[k][chunk j] = b + k * ldb + j * b_chunk_step is a float4.
// Summed in two levels, like mma_nt: 4 products of one k-step first, then into acc.
template <int TM, int TC, int K>
__device__ __forceinline__ void mma_nn(float (&acc)[TM][TC][4], const float* a, int a_step, const float* b,
                                       int ldb, int b_chunk_step) {
  static_assert(K % 4 == 0, "reduction in steps of 4");
#pragma unroll 1
  for (int k = 0; k < K; k += 4) {
    float4 av[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) av[i] = lds4(a + i * a_step + k);
#pragma unroll
    for (int j = 0; j < TC; ++j) {
      float4 bv[4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) bv[kk] = lds4(b + (k + kk) * ldb + j * b_chunk_step);
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        float part[4] = {av[i].x * bv[0].x, av[i].x * bv[0].y, av[i].x * bv[0].z, av[i].x * bv[0].w};
        fma4(part, av[i].y, bv[1]);
        fma4(part, av[i].z, bv[2]);
        fma4(part, av[i].w, bv[3]);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[e];
      }
    }
  }
}

// acc[i][e][j][0..3] += sum_{k < K} A[k][chunk i][e] * B[k][chunk j], where
// A[k][chunk i] = a + k * lda + i * a_chunk_step and B[k][chunk j] = b + k * ldb + j * b_chunk_step.
template <int TCM, int TCN, int K>
__device__ __forceinline__ void mma_tn(float (&acc)[TCM][4][TCN][4], const float* a, int lda, int a_chunk_step,
                                       const float* b, int ldb, int b_chunk_step) {
#pragma unroll 1
  for (int k = 0; k < K; ++k) {
    float4 av[TCM], bv[TCN];
#pragma unroll
    for (int i = 0; i < TCM; ++i) av[i] = lds4(a + k * lda + i * a_chunk_step);
#pragma unroll
    for (int j = 0; j < TCN; ++j) bv[j] = lds4(b + k * ldb + j * b_chunk_step);
#pragma unroll
    for (int i = 0; i < TCM; ++i)
#pragma unroll
      for (int j = 0; j < TCN; ++j) {
        fma4(acc[i][0][j], av[i].x, bv[j]);
        fma4(acc[i][1][j], av[i].y, bv[j]);
        fma4(acc[i][2][j], av[i].z, bv[j]);
        fma4(acc[i][3][j], av[i].w, bv[j]);
      }
  }
}

// ---- the backward's per-row statistics ----------------------------------------------------
// lse_rows[r], dot_rows[r] = lse and D = rowsum(dO * O) of query row first + r (first: the row's offset in the
// (batch, nheads, seqlen_q) statistics) for r < valid_rows, by threads 0 .. BlockM - 1 (the caller publishes them
// with a barrier). P is recomputed as exp2((S * scale - lse) log2 e), so lse = +inf makes it exactly 0: rows past
// the end get +inf (and D = 0), and so does a row that saw no key in the forward (lse = -inf), whose dS, dQ and
// share of dK, dV are then exact zeros. Used by the SIMT and the tensor-core backward.
template <int BlockM>
__device__ __forceinline__ void stage_row_stats(const AttentionParams& p, long long first, int valid_rows, int thread,
                                                float* lse_rows, float* dot_rows) {
  if (thread >= BlockM) return;
  float lse = pos_inf();
  float dot = 0.f;
  if (thread < valid_rows) {
    lse = arch::load(p.lse + first + thread);
    if (lse == neg_inf()) lse = pos_inf();
    dot = arch::load(p.dout_dot_out + first + thread);
  }
  lse_rows[thread] = lse;
  dot_rows[thread] = dot;
}

// The row kernels (the backward's pre-pass and convert kernels, the split-KV combine): 128 threads over 16 query
// rows per block, a warp per row (fa2.py's ROW_KERNEL_THREADS and ROW_KERNEL_ROWS).
struct RowKernel {
  static constexpr int kThreads = 128;
  static constexpr int kRows = 16;
};

// Butterfly reductions over the Lanes (a power of two <= 32) consecutive lanes that share a
// row; every one of them ends with the result, summed in the same order on every rerun.
template <int Lanes>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int m = Lanes / 2; m >= 1; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
template <int Lanes>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = Lanes / 2; m >= 1; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

}  // namespace fa2
}  // namespace cuflash
