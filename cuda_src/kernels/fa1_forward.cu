// FlashAttention-1 forward: Algorithm 1 of Dao et al., "FlashAttention: Fast and
// Memory-Efficient Exact Attention with IO-Awareness" (2022), as written there:
// the K/V loop is the outer one, and the running output O and softmax
// statistics l, m live in global memory, read, rescaled and written back at
// every step. (FA2 swaps the loops and keeps O, l, m on chip; this kernel is
// the baseline that shows why.)
//
// What it computes, per (batch b, query head h), with kv head h / (nheads / nheads_k):
//   out = softmax(scale * Q K^T, masked) V     (element type T)
//   lse = log(rowsum(exp(scale * Q K^T)))       (float32; -inf for a row that sees no key)
//
// Work partition
//   grid  = (nheads, batch): one thread block per (b, h), as in the paper.
//   block = 128 threads (fa1::kThreads), SIMT float32 math (tensor cores come later).
//   Tiles: Br query rows x Bc keys, head dim padded to the compiled HeadDim (the
//   launch plan runs head dim d on the smallest compiled HeadDim >= d; columns
//   d..HeadDim-1 are zero in shared memory and never touch global memory).
//   Br, Bc come from the paper's rule Bc = ceil(M / 4d), Br = min(Bc, d), evaluated
//   per compiled head dim with M = 40960 floats (160 KiB) into a fixed table in the
//   launch plan (cuflash/kernels/families/fa1.py); e.g. head dim 64: Br = 64, Bc = 160.
//   for j over K/V blocks seen by some Q block:            (outer, Tc blocks)
//     K_j, V_j -> shared memory
//     for i over Q blocks that see block j:                (inner, Tr blocks)
//       Q_i -> shared memory; S = Q_i K_j^T (thread per score, strided over Br x Bc)
//       one thread per row: m~ = rowmax S, P~ = exp(S - m~), l~ = rowsum P~, reads
//         l_i, m_i from global, m_new = max(m_i, m~), l_new = e^(m_i-m_new) l_i + e^(m~-m_new) l~,
//         writes l_i, m_i back (lse instead at the row block's last visit)
//       thread per output element (strided over Br x HeadDim): reads O_i from
//         global, O_i = (l_i e^(m_i-m_new) O_i + e^(m~-m_new) P~ V_j) / l_new, writes it back
//         (to `out` in element type at the row block's last visit)
//   O, l, m are float32 scratch (out_accum, row_sum, row_max), zero-filled by the
//   program: that memset is line 2 of Algorithm 1 (O = 0, l = 0). m starts at 0,
//   not -inf; a row whose stored l is 0 has seen nothing yet and its stored m is
//   read as -inf, so no separate -inf initialisation pass is needed.
//
// Exponentials: arch::exp2_approx (ex2.approx.ftz: one MUFU.EX2, within 2 ulp,
// -inf -> +0) rather than expf's range reduction, but with the scale NOT folded
// into the scores as FA2 does. Scores stay in natural units, s = scale * q.k, so
// m and the saved lse = m + log l are in the units of the backward's recomputed
// s, and exp(s - x) is evaluated as exp2((s - x) * log2 e) (fa1::exp_of_difference):
// one extra FMUL per exponential. Why: with |s| ~ 1e4 the float32 spacing is
// ~1e-3. Folded (s2 = s log2 e), lse would be converted log2 -> natural in the
// forward and back in the backward, and each rounding of a 1e4-sized number moves
// the backward's P = exp(s - lse) by up to ~5e-4 relatively, systematically for a
// whole row; measured, that put float32 gradients >10x past the tolerance at large
// logits. In natural units a row dominated by one key has lse = m exactly and the
// backward recomputes its P as exp(0) = 1, as the forward had it.
//
// Masking and rows that see no key
//   mask.cuh decides who sees whom (causal: bottom-right aligned). K/V blocks wholly
//   outside a Q block's band are skipped for that Q block
//   (fa1::kv_blocks_of_q_block), crossing blocks and the partial last block are
//   masked element-wise (score -inf). A block row max of -inf gives P~ = 0 (no
//   exp2(-inf - -inf) = NaN); a row whose l is still 0 gets O = 0. A Q block that
//   sees no K/V block at all (seqlen_k == 0, or rows outside the band)
//   writes out = 0 and lse = -inf directly; a row that sees no key inside a
//   visited block ends with l = 0, hence out = 0 and lse = -inf. Nothing divides
//   by zero, so finite inputs never produce NaN/Inf, also with |scale q.k| ~ 1e4.
//
// Cost (per launch; e = sizeof(T), d = headdim, B = batch, H = nheads)
//   Tr = ceil(seqlen_q / Br), Tc = ceil(seqlen_k / Bc), rows_i = min(Br, seqlen_q - i Br),
//   n_i = K/V blocks Q block i sees (Tc without the causal mask),
//   visits  V = sum_i n_i rows_i                 (= Tc seqlen_q without the mask)
//   revisits W = sum_i max(n_i - 1, 0) rows_i    (= (Tc - 1) seqlen_q without the mask)
//   Global bytes read    = B H [ 2 seqlen_k d e  +  V (d e + 4 (d + 2)) ]        (seqlen_q > 0)
//                          K_j, V_j once per K/V block; Q_i, O_i, l_i, m_i once per visit
//   Global bytes written = B H [ W 4 (d + 2)  +  seqlen_q (d e + 4) ]
//                          O_i, l_i, m_i once per K/V block but the last, where out
//                          and lse are written instead (once per row, also for rows
//                          that see no block)
//   This is Algorithm 1's Theta(Tc N d) traffic: O, l, m move once per K/V block.
//   FLOPs: 4 HeadDim Br Bc per visited (i, j) tile pair (S and P~ V_j; masked
//   scores skip their dot product), plus O(Br Bc) exponentials.
// Deterministic: no atomics, every sum in a fixed order, so reruns are bitwise equal.
#include "fa1_common.cuh"

namespace cuflash {

template <int HeadDim, int BlockRows, int BlockCols>
struct Fa1ForwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockRows = BlockRows;  // Br
  static constexpr int kBlockCols = BlockCols;  // Bc
  static constexpr int kThreads = fa1::kThreads;
  static constexpr int kTileStride = HeadDim + 1;    // floats per row of a d-wide tile
  static constexpr int kScoreStride = BlockCols + 1;  // floats per row of S / P~ (odd: row walks by
                                                      // the per-row threads hit distinct banks)
  // Shared memory layout, in floats.
  static constexpr int kQ = 0;                                  // Q_i   Br x HeadDim
  static constexpr int kK = kQ + BlockRows * kTileStride;       // K_j   Bc x HeadDim
  static constexpr int kV = kK + BlockCols * kTileStride;       // V_j   Bc x HeadDim
  static constexpr int kScores = kV + BlockCols * kTileStride;  // S, then P~   Br x Bc
  static constexpr int kOldWeight = kScores + BlockRows * kScoreStride;  // l_i e^(m_i-m_new) / l_new
  static constexpr int kNewWeight = kOldWeight + BlockRows;              // e^(m~-m_new) / l_new
  static constexpr int kSmemFloats = kNewWeight + BlockRows;
  static constexpr unsigned kSmemBytes = kSmemFloats * sizeof(float);

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static_assert(BlockRows >= 1 && BlockRows <= kThreads, "one thread per query row runs the online softmax");
  static_assert(BlockCols >= 1, "a K/V block holds at least one key");
};

template <class T, int HeadDim, int BlockRows, int BlockCols>
__global__ void __launch_bounds__(fa1::kThreads, fa1::kMinBlocksPerSm) fa1_forward_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "fa1_forward_kernel: T is float, __half or __nv_bfloat16");
  using Traits = Fa1ForwardTraits<HeadDim, BlockRows, BlockCols>;
  constexpr int kTS = Traits::kTileStride;
  constexpr int kSS = Traits::kScoreStride;

  CUFLASH_DYNAMIC_SMEM(smem_bytes);
  if (launch_differs_from_traits<Traits::kSmemBytes, fa1::kThreads>()) __trap();
  float* const smem = reinterpret_cast<float*>(smem_bytes);
  float* const q_tile = smem + Traits::kQ;
  float* const k_tile = smem + Traits::kK;
  float* const v_tile = smem + Traits::kV;
  float* const scores = smem + Traits::kScores;
  float* const old_weight = smem + Traits::kOldWeight;
  float* const new_weight = smem + Traits::kNewWeight;

  const int tid = threadIdx.x;
  const BlockInfo info = BlockInfo::of(p, blockIdx.y, blockIdx.x);
  const int d = p.headdim;
  const int num_q_blocks = ceil_div(p.seqlen_q, BlockRows);
  const MaskPolicy mask = MaskPolicy::of(p, info);
  const IdentityScoreHook score_hook{};  // fa1 takes no softcap or ALiBi

  const T* const q = info.q<T>(p);
  const T* const k = info.k<T>(p);
  const T* const v = info.v<T>(p);
  T* const out = info.out<T>(p);
  const long long stats_base = info.row_stats_offset(p);
  float* const lse = p.lse + stats_base;
  float* const row_max = p.row_max + stats_base;
  float* const row_sum = p.row_sum + stats_base;
  // out_accum is dense (batch, seqlen_q, nheads, headdim): row r of this head starts at
  // o_accum + r * o_row_stride.
  const long long o_row_stride = BlockInfo::dense_row_stride(p);
  float* const o_accum = p.out_accum + info.dense_q_offset(p);

  // Q blocks that see no K/V block at all: their rows' final values, now.
  for (int q_block = 0; q_block < num_q_blocks; ++q_block) {
    if (!fa1::kv_blocks_of_q_block<BlockRows, BlockCols>(mask, q_block).empty()) continue;
    const int row0 = q_block * BlockRows;
    const int rows = min(BlockRows, p.seqlen_q - row0);
    for (int e = tid; e < rows * d; e += fa1::kThreads)
      arch::store(out + (row0 + e / d) * p.out_stride.row + e % d, from_float<T>(0.f));
    for (int r = tid; r < rows; r += fa1::kThreads) arch::store(lse + row0 + r, neg_inf());
  }

  const IndexRange kv_seen = mask.kv_blocks<BlockCols>(0, p.seqlen_q);  // by any row
  for (int kv_block = kv_seen.begin; kv_block < kv_seen.end; ++kv_block) {
    const int key0 = kv_block * BlockCols;
    const int keys = min(BlockCols, p.seqlen_k - key0);
    __syncthreads();  // the previous K_j, V_j are no longer read
    fa1::load_tile<BlockCols, HeadDim>(k_tile, k + key0 * p.k_stride.row, p.k_stride.row, keys, d);
    fa1::load_tile<BlockCols, HeadDim>(v_tile, v + key0 * p.v_stride.row, p.v_stride.row, keys, d);

    for (int q_block = 0; q_block < num_q_blocks; ++q_block) {
      const IndexRange visible = fa1::kv_blocks_of_q_block<BlockRows, BlockCols>(mask, q_block);
      if (!visible.contains(kv_block)) continue;  // wholly outside the band: skipped
      const bool last_visit = kv_block == visible.end - 1;
      const int row0 = q_block * BlockRows;
      const int rows = min(BlockRows, p.seqlen_q - row0);

      __syncthreads();  // the previous Q_i, P~ and weights are no longer read
      fa1::load_tile<BlockRows, HeadDim>(q_tile, q + row0 * p.q_stride.row, p.q_stride.row, rows, d);
      __syncthreads();

      // S = scale Q_i K_j^T; -inf where masked (and in padding rows/cols).
      for (int e = tid; e < BlockRows * BlockCols; e += fa1::kThreads) {
        const int r = e / BlockCols;
        const int c = e % BlockCols;
        float s = neg_inf();
        if (r < rows && c < keys && mask.visible(row0 + r, key0 + c)) {
          const float* qr = q_tile + r * kTS;
          const float* kc = k_tile + c * kTS;
          float dot = 0.f;
#pragma unroll 8
          for (int x = 0; x < HeadDim; ++x) dot += qr[x] * kc[x];
          s = score_hook(dot, row0 + r, key0 + c) * p.softmax_scale;
        }
        scores[r * kSS + c] = s;
      }
      __syncthreads();

      // Online softmax, one thread per row: P~ in place of S, the two rescaling weights,
      // and l, m (or lse) back to global memory.
      if (tid < rows) {
        float* srow = scores + tid * kSS;
        float block_max = neg_inf();
        for (int c = 0; c < BlockCols; ++c) block_max = fmaxf(block_max, srow[c]);
        float block_sum = 0.f;
        if (block_max == neg_inf()) {
          for (int c = 0; c < BlockCols; ++c) srow[c] = 0.f;
        } else {
          for (int c = 0; c < BlockCols; ++c) {
            const float prob = fa1::exp_of_difference(srow[c], block_max);
            srow[c] = prob;
            block_sum += prob;
          }
        }
        const int row = row0 + tid;
        const float old_sum = arch::load(row_sum + row);
        const float stored_max = arch::load(row_max + row);
        const float old_max = old_sum > 0.f ? stored_max : neg_inf();
        const float new_max = fmaxf(old_max, block_max);
        float old_scale = 0.f, new_scale = 0.f;
        if (new_max != neg_inf()) {
          old_scale = old_sum > 0.f ? fa1::exp_of_difference(old_max, new_max) * old_sum : 0.f;
          new_scale = block_max != neg_inf() ? fa1::exp_of_difference(block_max, new_max) : 0.f;
        }
        const float new_sum = old_scale + new_scale * block_sum;
        const float inv_sum = new_sum > 0.f ? 1.f / new_sum : 0.f;
        old_weight[tid] = old_scale * inv_sum;
        new_weight[tid] = new_scale * inv_sum;
        if (last_visit) {
          arch::store(lse + row, new_sum > 0.f ? new_max + logf(new_sum) : neg_inf());
        } else {
          arch::store(row_sum + row, new_sum);
          arch::store(row_max + row, new_max);
        }
      }
      __syncthreads();

      // O_i = old_weight O_i + new_weight P~ V_j, read from and written to global memory.
      for (int e = tid; e < BlockRows * HeadDim; e += fa1::kThreads) {
        const int r = e / HeadDim;
        const int c = e % HeadDim;
        if (r >= rows || c >= d) continue;
        const float* prow = scores + r * kSS;
        float pv = 0.f;
#pragma unroll 8
        for (int x = 0; x < BlockCols; ++x) pv += prow[x] * v_tile[x * kTS + c];
        float* o = o_accum + (row0 + r) * o_row_stride + c;
        const float o_new = old_weight[r] * arch::load(o) + new_weight[r] * pv;
        if (last_visit) {
          arch::store(out + (row0 + r) * p.out_stride.row + c, from_float<T>(o_new));
        } else {
          arch::store(o, o_new);
        }
      }
    }
  }
}

}  // namespace cuflash
