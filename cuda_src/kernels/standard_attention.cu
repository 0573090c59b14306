// Standard attention: the FlashAttention paper's Algorithm 0 (forward) and its standard backward,
// with every seqlen_q x seqlen_k matrix materialised in global memory. This is the baseline the fused
// kernels are measured against, so it is deliberately unfused: its cost is the HBM traffic of S and P.
//
// Forward (three launches):
//   1. standard_scores_kernel     S = softmax_scale * Q K^T          -> scores (float32; masked: -inf)
//   2. standard_softmax_kernel    P = softmax(S), lse = log sum exp  -> probs, lse
//   3. standard_out_kernel        O = P V                            -> out
// Backward (eight launches; forward and backward are separate calls, so S and P are recomputed):
//   1. standard_scores_kernel     S = softmax_scale * Q K^T          -> scores
//   2. standard_softmax_kernel    P = exp(S - lse)                   -> probs      (kRecompute pass)
//   3. standard_dv_kernel         dV = P^T dO                        -> dv
//   4. standard_dout_dot_out_kernel D = rowsum(dO * O)               -> dout_dot_out
//   5. standard_dp_kernel         dP = dO V^T                        -> scores     (S is dead by now)
//   6. standard_softmax_kernel    dS = P * (dP - D)                  -> scores     (kBackward pass, in place)
//   7. standard_dq_kernel         dQ = softmax_scale * dS K          -> dq
//   8. standard_dk_kernel         dK = softmax_scale * dS^T Q        -> dk
//
// Work partition.
//  - The six matrix products are one register-blocked batched-GEMM template (run_standard_gemm) driven by
//    a "product" policy that says where A and B live, how they are laid out, how far the reduction runs
//    and what the epilogue writes. Block = 16 x 16 threads computing a 64 x 64 tile of C; thread (tx, ty)
//    owns the 4 x 4 outputs (ty + 16 r, tx + 16 c), so neighbouring threads write neighbouring columns
//    (coalesced) and read shared memory without bank conflicts. The reduction runs in 32-deep steps: each
//    step stages a 64 x 32 slice of A and of B (converted to float32) in shared memory, double-buffered,
//    while the next slice's global loads are already in flight in registers. Every load and store is
//    predicated, so any M, N, K (any seqlen, any head dim) works without padding. Sums are float32 and
//    two-level (a fresh partial per 32-deep step), which bounds rounding growth on long reductions.
//    Grid: (tiles of C, heads, batch), tile t -> (m tile t / n_tiles, n tile t % n_tiles).
//  - dV and dK run over kv heads (grid.y = nheads_k) and reduce over the group's query heads inside the
//    block (K = group x seqlen_q), so GQA/MQA gradients need no atomics and are deterministic.
//  - The softmax kernel is warp-per-row (8 rows per 256-thread block, grid (ceil(seqlen_q / 8), nheads,
//    batch)); lanes stride the row (coalesced) and combine with xor-shuffles. The forward pass holds a row
//    of up to 1024 scores in registers (32 per lane) and reads S once; a longer row is read twice: an
//    online (max, sum) per lane first, then the normalisation. dout_dot_out is warp-per-row the same way,
//    over the head dim.
//  - Instances: the GEMM kernels and dout_dot_out per element type (float, __half, __nv_bfloat16); the
//    softmax passes touch only float32 scratch, so they are instantiated per pass, not per element type.
//
// Cost, per (batch, head), non-causal, e = element bytes, d = head dim, T = 64 (tile side):
//   FLOPs: forward 4 sq sk d (+ softmax); backward 10 sq sk d (S, dV, dP, dQ, dK).
//   scores:  read (ceil(sk/T) sq + ceil(sq/T) sk) d e            write 4 sq sk
//   softmax: forward read 4 sq sk (sk <= 1024, else 8 sq sk), write 4 sq sk + 4 sq
//            recompute read 4 sq sk + 4 sq, write 4 sq sk
//            backward read 8 sq sk + 4 sq,  write 4 sq sk
//   out:     read 4 ceil(d/T) sq sk + ceil(sq/T) sk d e         write sq d e
//   dp:      read (ceil(sk/T) sq + ceil(sq/T) sk) d e            write 4 sq sk
//   dv, dk:  per kv head: read group (4 ceil(d/T) sq sk + ceil(sk/T) sq d e), write sk d e
//   dq:      read 4 ceil(d/T) sq sk + ceil(sq/T) sk d e          write sq d e
//   dout_dot_out: read 2 sq d e, write 4 sq
//   The sq x sk terms dominate: S and P each cost 4 sq sk bytes to write and are read back, which is the
//   traffic FlashAttention removes. cuflash/kernels/families/standard.py has the exact formula (with the
//   mask skips below) and the tests assert it byte for byte against the simulator's counters.
//
// Masks (mask.cuh: causal bottom-right aligned, or a window) and empty rows.
//  - S and dP are written in full; masked entries get -inf (S) and 0 (dP). A 64 x 64 tile that no row of
//    it can see skips its reduction entirely (no loads) and only writes the mask values.
//  - Products that reduce over keys (O = P V, dQ = dS K) stop at the last key the tile's last row sees;
//    products that reduce over queries (dV, dK) start at the first query that sees the tile's first key,
//    rounded down to a multiple of 32 so loads stay aligned to the 32-wide steps. Skipped terms are exactly
//    zero (P and dS are 0 where masked), so results are unchanged.
//  - A row that sees no key (seqlen_k == 0, or outside the band, as causal rows when seqlen_q > seqlen_k)
//    gets P = 0 and lse = -inf; O = P V = 0 follows, and in the backward P = 0 (never exp(-inf - -inf)),
//    dS = 0, so its dQ is 0 and it adds nothing to dK, dV. No NaN is produced anywhere.
//  - seqlen_q == 0 still launches dv/dk over the keys: their reduction is empty and they write zeros.
#include "arch/arch.cuh"
#include "common/block_info.cuh"
#include "common/kernel_utils.cuh"
#include "common/mask.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------------
// Traits (mirrored by StandardTraits in cuflash/kernels/families/standard.py).

struct StandardGemmTraits {
  static constexpr int kThreadsX = 16;  // threads along N
  static constexpr int kThreadsY = 16;  // threads along M
  static constexpr int kThreads = kThreadsX * kThreadsY;
  static constexpr int kOutputsPerThreadM = 4;
  static constexpr int kOutputsPerThreadN = 4;
  static constexpr int kBlockM = kThreadsY * kOutputsPerThreadM;  // 64
  static constexpr int kBlockN = kThreadsX * kOutputsPerThreadN;  // 64
  static constexpr int kBlockK = 32;                              // reduction depth per step = warp size
  // One staged slice is stored k-major: tile[k][outer]. The +1 keeps stores of a k-contiguous operand
  // (a warp writes one outer index, 32 consecutive k) on 32 distinct banks.
  static constexpr int kTileRowFloats = kBlockM + 1;
  static constexpr int kTileFloats = kBlockK * kTileRowFloats;
  static constexpr int kStages = 2;  // double-buffered: one barrier per reduction step
  static constexpr int kSmemBytes = kStages * 2 * kTileFloats * static_cast<int>(sizeof(float));
  static constexpr int kLoadsPerThread = kBlockM * kBlockK / kThreads;  // per operand per step
  // Two resident blocks per SM cap registers at 128. The products need up to ~127 (16 accumulators, 16
  // step partials, 16 staged elements in flight, 64-bit addresses): with a cap of 85 (3 blocks) ptxas
  // spills on sm_80 and sm_90, and left to itself it picked 64 registers plus spills for some sm_90
  // instances. 2 x 256 threads x 33 KB of shared memory fit an sm_80 or sm_90 SM.
  static constexpr int kMinBlocksPerSm = 2;

  static_assert(kBlockM == kBlockN, "one staging layout serves A (64 x K) and B (K x 64)");
  static_assert(kBlockK == 32, "k-contiguous staging maps one lane to one k");
  static_assert(kThreads % kBlockK == 0 && kThreads % kBlockM == 0, "staging maps must tile the block");
};

struct StandardRowTraits {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerBlock = kWarps;  // one warp per row
  // The forward softmax holds a row of up to 32 x 32 = 1024 scores in registers and reads S once; longer
  // rows stream through it twice (online statistics, then normalise).
  static constexpr int kCachedKeysPerLane = 32;
  static constexpr int kCachedKeys = 32 * kCachedKeysPerLane;
};

// ---------------------------------------------------------------------------------------------------
// The batched GEMM: C (M x N) = sum over group members g, over k of A_g(m, k) B_g(k, n).

// How an operand sits in memory. "outer" is m for A and n for B.
enum class OperandLayout {
  kKContiguous,     // element (outer, k) at base + outer * stride + k
  kOuterContiguous  // element (outer, k) at base + k * stride + outer
};

// Which part of the reduction the mask lets a tile skip (see the file comment).
enum class MaskSkip {
  kMaskedTiles,  // C is (query x key): tiles nobody sees skip the whole reduction
  kKeys,         // reduction over keys, A rows are queries: only the keys the tile's rows see
  kQueries       // reduction over queries, A rows are keys: only the queries that see the tile's keys
};

template <class Elem>
struct GemmOperand {
  const Elem* base;      // element (outer 0, k 0) of group member 0
  long long stride;      // see OperandLayout
  long long group_step;  // elements from one group member's matrix to the next
  int outer_extent;      // valid outer indices are [0, outer_extent)
};

template <class ElemA, class ElemB>
struct GemmShape {
  int m, n, k;      // k is the reduction length per group member
  int group_count;  // group members reduced over (query heads of one kv head for dV/dK, else 1)
  GemmOperand<ElemA> a;
  GemmOperand<ElemB> b;
};

// Each thread's share of one staged 64 x 32 slice of an operand, held in registers between the global
// load (issued a step early) and the shared-memory store.
template <class Elem, OperandLayout Layout>
struct SliceStager {
  using Traits = StandardGemmTraits;
  Elem staged[Traits::kLoadsPerThread];

  // Element i of this thread's share: (outer, k) within the slice. k-contiguous operands put a warp on
  // 32 consecutive k of one outer index; outer-contiguous ones put it on 32 consecutive outer indices.
  __device__ __forceinline__ static void coords(int tid, int i, int& outer, int& k) {
    if (Layout == OperandLayout::kKContiguous) {
      k = tid % Traits::kBlockK;
      outer = tid / Traits::kBlockK + i * (Traits::kThreads / Traits::kBlockK);
    } else {
      outer = tid % Traits::kBlockM;
      k = tid / Traits::kBlockM + i * (Traits::kThreads / Traits::kBlockM);
    }
  }

  __device__ __forceinline__ void load(const GemmOperand<Elem>& op, int group_member, int outer0, int k0,
                                       int k_end, int tid) {
    const Elem* base = op.base + group_member * op.group_step;
#pragma unroll
    for (int i = 0; i < Traits::kLoadsPerThread; ++i) {
      int outer, k;
      coords(tid, i, outer, k);
      outer += outer0;
      k += k0;
      if (outer < op.outer_extent && k < k_end) {
        const long long offset = Layout == OperandLayout::kKContiguous
                                     ? outer * op.stride + k
                                     : k * op.stride + outer;
        staged[i] = arch::load(base + offset);
      } else {
        staged[i] = from_float<Elem>(0.f);
      }
    }
  }

  __device__ __forceinline__ void store(float* slice, int tid) const {
#pragma unroll
    for (int i = 0; i < Traits::kLoadsPerThread; ++i) {
      int outer, k;
      coords(tid, i, outer, k);
      slice[k * Traits::kTileRowFloats + outer] = to_float(staged[i]);
    }
  }
};

// The reduction range [begin, end) of one C tile, per group member.
struct KRange {
  int begin, end;
};

// Begins are rounded down to a multiple of kBlockK so loads stay aligned to the k steps; the extra
// terms are exact zeros (P and dS are 0 where masked).
template <MaskSkip Skip>
__device__ __forceinline__ KRange tile_k_range(const AttentionParams& p, const BlockInfo& info, int m0, int n0, int m,
                                               int n, int k) {
  using Traits = StandardGemmTraits;
  const MaskPolicy mask = MaskPolicy::of(p, info);
  const int m_end = min(m0 + Traits::kBlockM, m);
  if (Skip == MaskSkip::kMaskedTiles) {  // rows are queries, columns keys
    const IndexRange keys = mask.keys_of_rows(m0, m_end);
    const bool seen = max(keys.begin, n0) < min(keys.end, min(n0 + Traits::kBlockN, n));
    return KRange{0, seen ? k : 0};
  }
  const IndexRange range = Skip == MaskSkip::kKeys ? mask.keys_of_rows(m0, m_end) : mask.rows_of_keys(m0, m_end);
  if (range.empty()) return KRange{0, 0};
  return KRange{range.begin / Traits::kBlockK * Traits::kBlockK, range.end};
}

template <class Product>
__device__ __forceinline__ void run_standard_gemm(const AttentionParams& p, unsigned char* smem) {
  using Traits = StandardGemmTraits;
  using ElemA = typename Product::ElemA;
  using ElemB = typename Product::ElemB;
  if (launch_differs_from_traits<Traits::kSmemBytes, Traits::kThreadsX, Traits::kThreadsY>()) __trap();

  // grid.y is a query head, or a kv head for the products over the group (its first query head's info)
  const BlockInfo info = Product::kOverKvHeads ? BlockInfo::of_group(p, blockIdx.z, blockIdx.y, 0)
                                               : BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const GemmShape<ElemA, ElemB> shape = Product::shape(p, info);
  const int n_tiles = (shape.n + Traits::kBlockN - 1) / Traits::kBlockN;
  const int m0 = static_cast<int>(blockIdx.x / n_tiles) * Traits::kBlockM;
  const int n0 = static_cast<int>(blockIdx.x % n_tiles) * Traits::kBlockN;

  const KRange range = tile_k_range<Product::kMaskSkip>(p, info, m0, n0, shape.m, shape.n, shape.k);
  const int steps_per_member = range.end > range.begin ? (range.end - range.begin + Traits::kBlockK - 1) / Traits::kBlockK : 0;
  const int steps = steps_per_member * shape.group_count;

  float* slices_a = reinterpret_cast<float*>(smem);
  float* slices_b = slices_a + Traits::kStages * Traits::kTileFloats;

  const int tid = threadIdx.y * Traits::kThreadsX + threadIdx.x;
  SliceStager<ElemA, Product::kLayoutA> stage_a;
  SliceStager<ElemB, Product::kLayoutB> stage_b;
  auto load_step = [&](int step) {
    const int member = step / steps_per_member;
    const int k0 = range.begin + (step % steps_per_member) * Traits::kBlockK;
    stage_a.load(shape.a, member, m0, k0, range.end, tid);
    stage_b.load(shape.b, member, n0, k0, range.end, tid);
  };

  float acc[Traits::kOutputsPerThreadM][Traits::kOutputsPerThreadN];
#pragma unroll
  for (int r = 0; r < Traits::kOutputsPerThreadM; ++r)
#pragma unroll
    for (int c = 0; c < Traits::kOutputsPerThreadN; ++c) acc[r][c] = 0.f;

  if (steps > 0) {  // block-uniform, so the barriers below are reached by every thread or none
    load_step(0);
    stage_a.store(slices_a, tid);
    stage_b.store(slices_b, tid);
    __syncthreads();
    for (int step = 0; step < steps; ++step) {
      const int buffer = step % Traits::kStages;
      const bool has_next = step + 1 < steps;
      if (has_next) load_step(step + 1);  // global loads overlap the math below
      const float* slice_a = slices_a + buffer * Traits::kTileFloats;
      const float* slice_b = slices_b + buffer * Traits::kTileFloats;
      // Two-level summation: each 32-deep step sums into a fresh partial that is then added to the total.
      // A float32 running sum over K terms errs by ~K ulps in the worst case; this is ~32 + K/32, which
      // keeps a long reduction (O = P V over thousands of keys) and the float32 path within the tolerance.
      float partial[Traits::kOutputsPerThreadM][Traits::kOutputsPerThreadN];
#pragma unroll
      for (int r = 0; r < Traits::kOutputsPerThreadM; ++r)
#pragma unroll
        for (int c = 0; c < Traits::kOutputsPerThreadN; ++c) partial[r][c] = 0.f;
#pragma unroll 8
      for (int kk = 0; kk < Traits::kBlockK; ++kk) {
        float a[Traits::kOutputsPerThreadM], b[Traits::kOutputsPerThreadN];
#pragma unroll
        for (int r = 0; r < Traits::kOutputsPerThreadM; ++r)
          a[r] = slice_a[kk * Traits::kTileRowFloats + threadIdx.y + r * Traits::kThreadsY];
#pragma unroll
        for (int c = 0; c < Traits::kOutputsPerThreadN; ++c)
          b[c] = slice_b[kk * Traits::kTileRowFloats + threadIdx.x + c * Traits::kThreadsX];
#pragma unroll
        for (int r = 0; r < Traits::kOutputsPerThreadM; ++r)
#pragma unroll
          for (int c = 0; c < Traits::kOutputsPerThreadN; ++c) partial[r][c] = fmaf(a[r], b[c], partial[r][c]);
      }
#pragma unroll
      for (int r = 0; r < Traits::kOutputsPerThreadM; ++r)
#pragma unroll
        for (int c = 0; c < Traits::kOutputsPerThreadN; ++c) acc[r][c] += partial[r][c];
      // The other buffer was last read in the previous step, which every thread finished before the
      // barrier that ended it; this step's reads of `buffer` end at the barrier below.
      if (has_next) {
        stage_a.store(slices_a + (1 - buffer) * Traits::kTileFloats, tid);
        stage_b.store(slices_b + (1 - buffer) * Traits::kTileFloats, tid);
      }
      __syncthreads();
    }
  }

#pragma unroll
  for (int r = 0; r < Traits::kOutputsPerThreadM; ++r) {
    const int row = m0 + threadIdx.y + r * Traits::kThreadsY;
#pragma unroll
    for (int c = 0; c < Traits::kOutputsPerThreadN; ++c) {
      const int col = n0 + threadIdx.x + c * Traits::kThreadsX;
      if (row < shape.m && col < shape.n) Product::store(p, info, row, col, acc[r][c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// The six products. q/out/dout/dq are (batch, seqlen_q, nheads, d); k/v/dk/dv (batch, seqlen_k, nheads_k,
// d); scores/probs are (batch, nheads, seqlen_q, seqlen_k) float32.

// (row, d) of one head of an element tensor; k-contiguous over d when the GEMM reduces over d,
// outer-contiguous otherwise. Consecutive query heads of a group are `s.head` apart.
template <class T>
__device__ __forceinline__ GemmOperand<T> tensor_operand(const T* head_base, const TensorStrides& s, int rows) {
  return GemmOperand<T>{head_base, s.row, s.head, rows};
}

// One (seqlen_q x seqlen_k) slice of scores/probs; consecutive query heads are consecutive slices.
__device__ __forceinline__ GemmOperand<float> matrix_operand(const float* matrix, const AttentionParams& p,
                                                            const BlockInfo& info, int outer_extent) {
  const long long slice = static_cast<long long>(info.seqlen_q(p)) * info.seqlen_k(p);
  return GemmOperand<float>{matrix + info.score_matrix_offset(p), info.seqlen_k(p), slice, outer_extent};
}

// S = scale Q K^T (M = seqlen_q, N = seqlen_k, K = d).
template <class T>
struct ScoresProduct {
  using ElemA = T;
  using ElemB = T;
  static constexpr OperandLayout kLayoutA = OperandLayout::kKContiguous;
  static constexpr OperandLayout kLayoutB = OperandLayout::kKContiguous;
  static constexpr MaskSkip kMaskSkip = MaskSkip::kMaskedTiles;
  static constexpr bool kOverKvHeads = false;

  __device__ static GemmShape<T, T> shape(const AttentionParams& p, const BlockInfo& info) {
    return {info.seqlen_q(p), info.seqlen_k(p), p.headdim, 1,
            tensor_operand(info.q<T>(p), p.q_stride, info.seqlen_q(p)),
            tensor_operand(info.k<T>(p), p.k_stride, info.seqlen_k(p))};
  }
  __device__ static void store(const AttentionParams& p, const BlockInfo& info, int query, int key, float acc) {
    const float s = MaskPolicy::of(p, info).visible(query, key)
                        ? IdentityScoreHook{}(acc, query, key) * p.softmax_scale
                        : neg_inf();
    arch::store(p.scores + info.score_row_offset(p, query) + key, s);
  }
};

// O = P V (M = seqlen_q, N = d, K = seqlen_k).
template <class T>
struct OutProduct {
  using ElemA = float;
  using ElemB = T;
  static constexpr OperandLayout kLayoutA = OperandLayout::kKContiguous;
  static constexpr OperandLayout kLayoutB = OperandLayout::kOuterContiguous;
  static constexpr MaskSkip kMaskSkip = MaskSkip::kKeys;
  static constexpr bool kOverKvHeads = false;

  __device__ static GemmShape<float, T> shape(const AttentionParams& p, const BlockInfo& info) {
    return {info.seqlen_q(p), p.headdim, info.seqlen_k(p), 1, matrix_operand(p.probs, p, info, info.seqlen_q(p)),
            tensor_operand(info.v<T>(p), p.v_stride, p.headdim)};
  }
  __device__ static void store(const AttentionParams& p, const BlockInfo& info, int query, int col, float acc) {
    arch::store(info.out<T>(p) + query * p.out_stride.row + col, from_float<T>(acc));
  }
};

// dP = dO V^T (M = seqlen_q, N = seqlen_k, K = d); masked entries are written as 0.
template <class T>
struct DpProduct {
  using ElemA = T;
  using ElemB = T;
  static constexpr OperandLayout kLayoutA = OperandLayout::kKContiguous;
  static constexpr OperandLayout kLayoutB = OperandLayout::kKContiguous;
  static constexpr MaskSkip kMaskSkip = MaskSkip::kMaskedTiles;
  static constexpr bool kOverKvHeads = false;

  __device__ static GemmShape<T, T> shape(const AttentionParams& p, const BlockInfo& info) {
    return {info.seqlen_q(p), info.seqlen_k(p), p.headdim, 1,
            tensor_operand(info.dout<T>(p), p.dout_stride, info.seqlen_q(p)),
            tensor_operand(info.v<T>(p), p.v_stride, info.seqlen_k(p))};
  }
  __device__ static void store(const AttentionParams& p, const BlockInfo& info, int query, int key, float acc) {
    arch::store(p.scores + info.score_row_offset(p, query) + key,
                MaskPolicy::of(p, info).visible(query, key) ? acc : 0.f);
  }
};

// dQ = scale dS K (M = seqlen_q, N = d, K = seqlen_k); dS sits in scores.
template <class T>
struct DqProduct {
  using ElemA = float;
  using ElemB = T;
  static constexpr OperandLayout kLayoutA = OperandLayout::kKContiguous;
  static constexpr OperandLayout kLayoutB = OperandLayout::kOuterContiguous;
  static constexpr MaskSkip kMaskSkip = MaskSkip::kKeys;
  static constexpr bool kOverKvHeads = false;

  __device__ static GemmShape<float, T> shape(const AttentionParams& p, const BlockInfo& info) {
    return {info.seqlen_q(p), p.headdim, info.seqlen_k(p), 1, matrix_operand(p.scores, p, info, info.seqlen_q(p)),
            tensor_operand(info.k<T>(p), p.k_stride, p.headdim)};
  }
  __device__ static void store(const AttentionParams& p, const BlockInfo& info, int query, int col, float acc) {
    arch::store(info.dq<T>(p) + query * p.dq_stride.row + col, from_float<T>(acc * p.softmax_scale));
  }
};

// dV = sum over the group's query heads of P^T dO (M = seqlen_k, N = d, K = seqlen_q per head);
// grid.y is the kv head.
template <class T>
struct DvProduct {
  using ElemA = float;
  using ElemB = T;
  static constexpr OperandLayout kLayoutA = OperandLayout::kOuterContiguous;  // P^T: keys contiguous
  static constexpr OperandLayout kLayoutB = OperandLayout::kOuterContiguous;
  static constexpr MaskSkip kMaskSkip = MaskSkip::kQueries;
  static constexpr bool kOverKvHeads = true;  // grid.y runs over kv heads, K over the group's query heads

  __device__ static GemmShape<float, T> shape(const AttentionParams& p, const BlockInfo& info) {
    return {info.seqlen_k(p), p.headdim, info.seqlen_q(p), BlockInfo::group_size(p),
            matrix_operand(p.probs, p, info, info.seqlen_k(p)),
            tensor_operand(info.dout<T>(p), p.dout_stride, p.headdim)};
  }
  __device__ static void store(const AttentionParams& p, const BlockInfo& info, int key, int col, float acc) {
    arch::store(info.dv<T>(p) + key * p.dv_stride.row + col, from_float<T>(acc));
  }
};

// dK = scale * sum over the group's query heads of dS^T Q (M = seqlen_k, N = d, K = seqlen_q per head).
template <class T>
struct DkProduct {
  using ElemA = float;
  using ElemB = T;
  static constexpr OperandLayout kLayoutA = OperandLayout::kOuterContiguous;  // dS^T: keys contiguous
  static constexpr OperandLayout kLayoutB = OperandLayout::kOuterContiguous;
  static constexpr MaskSkip kMaskSkip = MaskSkip::kQueries;
  static constexpr bool kOverKvHeads = true;  // grid.y runs over kv heads, K over the group's query heads

  __device__ static GemmShape<float, T> shape(const AttentionParams& p, const BlockInfo& info) {
    return {info.seqlen_k(p), p.headdim, info.seqlen_q(p), BlockInfo::group_size(p),
            matrix_operand(p.scores, p, info, info.seqlen_k(p)), tensor_operand(info.q<T>(p), p.q_stride, p.headdim)};
  }
  __device__ static void store(const AttentionParams& p, const BlockInfo& info, int key, int col, float acc) {
    arch::store(info.dk<T>(p) + key * p.dk_stride.row + col, from_float<T>(acc * p.softmax_scale));
  }
};

// One named kernel per product, so reports and profiles say which product they are.
#define CUFLASH_STANDARD_GEMM_KERNEL(kernel_name, Product)                                                \
  template <class T>                                                                                      \
  __global__ void __launch_bounds__(StandardGemmTraits::kThreads, StandardGemmTraits::kMinBlocksPerSm)    \
      kernel_name(const AttentionParams p) {                                                              \
    static_assert(is_element_type<T>::value, "standard attention runs on float, __half, __nv_bfloat16");  \
    CUFLASH_DYNAMIC_SMEM(smem);                                                                           \
    run_standard_gemm<Product<T>>(p, smem);                                                               \
  }

CUFLASH_STANDARD_GEMM_KERNEL(standard_scores_kernel, ScoresProduct)
CUFLASH_STANDARD_GEMM_KERNEL(standard_out_kernel, OutProduct)
CUFLASH_STANDARD_GEMM_KERNEL(standard_dp_kernel, DpProduct)
CUFLASH_STANDARD_GEMM_KERNEL(standard_dq_kernel, DqProduct)
CUFLASH_STANDARD_GEMM_KERNEL(standard_dv_kernel, DvProduct)
CUFLASH_STANDARD_GEMM_KERNEL(standard_dk_kernel, DkProduct)

#undef CUFLASH_STANDARD_GEMM_KERNEL

// ---------------------------------------------------------------------------------------------------
// Row-wise passes over the float32 matrices: warp per row.

enum class SoftmaxPass {
  kForward,    // scores -> probs, lse
  kRecompute,  // scores, lse -> probs                    (backward)
  kBackward    // probs, scores = dP, dout_dot_out -> scores = dS   (backward)
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, lane_mask);
  return x;
}

// exp(x - m) for a running maximum m that may still be -inf (then x is -inf too and the weight is 0).
__device__ __forceinline__ float rescale(float sum, float old_max, float new_max) {
  return old_max == neg_inf() ? 0.f : sum * arch::exp2_approx((old_max - new_max) * kLog2e);
}

// P = exp(s - lse); a row that sees no key (lse = -inf) has P = 0, not exp(-inf + inf) = NaN.
__device__ __forceinline__ float probability(float s, float lse) {
  return lse == neg_inf() ? 0.f : arch::exp2_approx((s - lse) * kLog2e);
}

// Lane 0 reads one float32 and the warp shares it, so each side-buffer value is fetched once per row.
__device__ __forceinline__ float load_row_value(const float* value, int lane) {
  return __shfl_sync(0xffffffffu, lane == 0 ? arch::load(value) : 0.f, 0);
}

// Forward softmax of one row that fits in registers: S is read once; exact max, then sum.
__device__ __forceinline__ void softmax_row_in_registers(const AttentionParams& p, const float* scores,
                                                         float* probs, long long row, int lane) {
  constexpr int kPerLane = StandardRowTraits::kCachedKeysPerLane;
  float values[kPerLane];
  float row_max = neg_inf();
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int key = lane + 32 * i;
    values[i] = key < p.seqlen_k ? arch::load(scores + key) : neg_inf();
    row_max = fmaxf(row_max, values[i]);
  }
#pragma unroll
  for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1)
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, lane_mask));
  // Every lane holds the same row_max, so this branch is warp-uniform. Without a visible key the row is
  // all -inf and exp(-inf - -inf) must not be formed.
  const bool has_key = row_max != neg_inf();
  float row_sum = 0.f;
  if (has_key) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      values[i] = arch::exp2_approx((values[i] - row_max) * kLog2e);  // masked and padding: exp2(-inf) = 0
      row_sum += values[i];
    }
  }
  row_sum = warp_sum(row_sum);
  if (lane == 0) arch::store(p.lse + row, has_key ? row_max + logf(row_sum) : neg_inf());
  const float inv_sum = has_key ? 1.f / row_sum : 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int key = lane + 32 * i;
    // Without a key the values are still -inf (never exponentiated), and -inf * 0 would be NaN.
    if (key < p.seqlen_k) arch::store(probs + key, has_key ? values[i] * inv_sum : 0.f);
  }
}

// Forward softmax of a row too long for registers: per-lane online maximum and sum in one read, a
// butterfly merge (every lane ends with bitwise identical statistics: max and + commute), then a second
// read to normalise.
__device__ __forceinline__ void softmax_row_streaming(const AttentionParams& p, const float* scores, float* probs,
                                                      long long row, int lane) {
  float row_max = neg_inf(), row_sum = 0.f;
  for (int key = lane; key < p.seqlen_k; key += 32) {
    const float s = arch::load(scores + key);
    if (s == neg_inf()) continue;  // masked: contributes exp(-inf) = 0
    if (s > row_max) {
      row_sum = rescale(row_sum, row_max, s) + 1.f;
      row_max = s;
    } else {
      row_sum += arch::exp2_approx((s - row_max) * kLog2e);
    }
  }
#pragma unroll
  for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
    const float other_max = __shfl_xor_sync(0xffffffffu, row_max, lane_mask);
    const float other_sum = __shfl_xor_sync(0xffffffffu, row_sum, lane_mask);
    const float merged_max = fmaxf(row_max, other_max);
    row_sum = rescale(row_sum, row_max, merged_max) + rescale(other_sum, other_max, merged_max);
    row_max = merged_max;
  }
  const bool has_key = row_sum > 0.f;
  if (lane == 0) arch::store(p.lse + row, has_key ? row_max + logf(row_sum) : neg_inf());
  const float inv_sum = has_key ? 1.f / row_sum : 0.f;
  for (int key = lane; key < p.seqlen_k; key += 32) {
    const float s = arch::load(scores + key);
    arch::store(probs + key, has_key ? arch::exp2_approx((s - row_max) * kLog2e) * inv_sum : 0.f);
  }
}

template <SoftmaxPass Pass>
__global__ void __launch_bounds__(StandardRowTraits::kThreads) standard_softmax_kernel(const AttentionParams p) {
  if (launch_differs_from_traits<0, StandardRowTraits::kThreads>()) __trap();
  const int lane = threadIdx.x % 32;
  const int query = blockIdx.x * StandardRowTraits::kRowsPerBlock + threadIdx.x / 32;
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  if (query >= info.seqlen_q(p)) return;  // the whole warp leaves together, before any shuffle

  const long long matrix_row = info.score_row_offset(p, query);
  float* scores = p.scores + matrix_row;
  float* probs = p.probs + matrix_row;
  const long long row = info.row_stats_offset(p) + query;

  if (Pass == SoftmaxPass::kForward) {
    if (p.seqlen_k <= StandardRowTraits::kCachedKeys) {  // warp-uniform
      softmax_row_in_registers(p, scores, probs, row, lane);
    } else {
      softmax_row_streaming(p, scores, probs, row, lane);
    }
  } else if (Pass == SoftmaxPass::kRecompute) {
    const float lse = load_row_value(p.lse + row, lane);
    for (int key = lane; key < p.seqlen_k; key += 32)
      arch::store(probs + key, probability(arch::load(scores + key), lse));
  } else {
    const float dout_dot_out = load_row_value(p.dout_dot_out + row, lane);
    for (int key = lane; key < p.seqlen_k; key += 32) {
      const float prob = arch::load(probs + key);
      const float dprob = arch::load(scores + key);
      arch::store(scores + key, prob * (dprob - dout_dot_out));  // same thread reads, then overwrites
    }
  }
}

// D = rowsum(dO * O) for every (batch, head, query): warp per row, lanes stride the head dim.
template <class T>
__global__ void __launch_bounds__(StandardRowTraits::kThreads) standard_dout_dot_out_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "standard attention runs on float, __half, __nv_bfloat16");
  if (launch_differs_from_traits<0, StandardRowTraits::kThreads>()) __trap();
  const int lane = threadIdx.x % 32;
  const int query = blockIdx.x * StandardRowTraits::kRowsPerBlock + threadIdx.x / 32;
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  if (query >= info.seqlen_q(p)) return;

  const T* dout = info.dout<T>(p) + query * p.dout_stride.row;
  const T* out = info.out_in<T>(p) + query * p.out_stride.row;
  float partial = 0.f;
  for (int col = lane; col < p.headdim; col += 32)
    partial = fmaf(to_float(arch::load(dout + col)), to_float(arch::load(out + col)), partial);
  const float total = warp_sum(partial);
  if (lane == 0) arch::store(p.dout_dot_out + info.row_stats_offset(p) + query, dout_dot_out_minus_dlse(p, info, query, total));
}

}  // namespace cuflash
