// FlashAttention-1 backward: the paper's Algorithm 4 (Dao et al. 2022, appendix B),
// without dropout: the K/V loop is outer, dK_j and dV_j are accumulated on chip,
// the inner loop over Q blocks recomputes P from the saved statistics, and dQ
// lives in global memory, read, updated and written back at every step.
//
// What it computes, per (batch b, query head h), kv head h / (nheads / nheads_k):
//   P  = exp(scale Q K^T - lse)  (masked entries 0)     D = rowsum(dO o O)
//   dV = P^T dO    dP = dO V^T    dS = P o (dP - D)
//   dQ = scale dS K               dK = scale dS^T Q
// The forward saved lse = m + log l (natural log, float32), which is what
// Algorithm 4 needs from l and m: diag(l)^-1 exp(S - m) = exp(S - lse).
//
// Work partition
//   fa1_backward_kernel: grid = (nheads, batch), one thread block per (b, h);
//   block = 128 threads, SIMT float32 math; tiles Br x Bc over the compiled HeadDim
//   (the paper's rule with M = 20480 floats, since this kernel keeps six d-wide tiles
//   to the forward's three; a fixed table in the launch plan; head dim 64: Br = 64, Bc = 80).
//   for j over K/V blocks:                                  (outer, Tc blocks)
//     K_j, V_j -> shared memory (skipped if no Q block sees block j);
//     dK~_j = dV~_j = 0 in shared memory
//     for i over Q blocks that see block j:                 (inner)
//       O_i, dO_i -> shared memory, D_i = rowsum(dO_i o O_i) (thread per row)
//         (Algorithm 4 line 20: D_i is recomputed at each visit from O_i, dO_i);
//       lse_i from global; Q_i -> shared memory (overwriting O_i)
//       P, dS: thread per (row, key), strided over Br x Bc
//       dV~_j += P^T dO_i, dK~_j += dS^T Q_i: thread per (key, column) of the
//         shared-memory accumulators, strided over Bc x HeadDim (each element has
//         one owner: no atomics, fixed summation order)
//       dQ_i += scale dS K_j: thread per (row, column), read-modify-write of the
//         float32 dq_accum in global memory; the row block's last visit writes dq
//         (element type) instead
//     write dK_j = scale dK~_j, dV_j = dV~_j
//   dq_accum is zero-filled by the program: Algorithm 4 line 6 (dQ = 0 in HBM).
//   Within a block the Q-block updates of dQ are serial, so MHA needs no atomics.
//
//   GQA/MQA (nheads_k < nheads): several query-head blocks contribute to one dK/dV.
//   Choice: each query-head block writes its own float32 dK_j, dV_j into dk_accum /
//   dv_accum (batch, seqlen_k, nheads, headdim), and fa1_gqa_reduce_kernel then sums
//   each group's heads in head order into dk, dv. This keeps FA1's one block per
//   (b, h) and its parallelism (batch x nheads blocks; a block per kv head looping
//   over its query heads would leave only batch blocks for MQA), stays deterministic
//   without atomics, and costs one extra float32 write + read of dK, dV per query
//   head. MHA writes dk, dv directly and launches no reduction.
//   fa1_gqa_reduce_kernel: grid = (ceil(seqlen_k nheads_k d / 256), batch), 256
//   threads, one thread per dk/dv element.
//
// Masking and rows that see no key
//   K/V blocks wholly outside the mask's band are skipped per Q block; crossing
//   blocks and the partial last block are masked element-wise (P = 0, dS = 0). A
//   row with lse = -inf (it saw no key) gets P = 0 without evaluating exp(-inf + inf);
//   its dQ is 0 and it adds nothing to dK, dV. Q blocks that see no K/V block write
//   dq = 0; K/V blocks no Q block sees (e.g. seqlen_q == 0) write dk = dv = 0.
//   Exponentials: as in the forward (natural-unit scores, fa1::exp_of_difference):
//   P = exp2((scale q.k - lse) log2 e), with scale q.k computed exactly as the forward
//   did, so a row the forward saw as one key (lse = m) gets P = 1 there again.
//   What remains is the float32 rounding of the saved lse itself: row r of P sums
//   to exp(eps_r), |eps_r| <= min(ulp(lse_r) / 2, log l_r), i.e. up to ~5e-4 for rows
//   with |lse| ~ 1e4 that several keys share. Any backward fed a float32 lse has it.
//
// Cost (per launch; e = sizeof(T), d = headdim, B = batch, H = nheads, Hk = nheads_k)
//   Tr, Tc, rows_i, n_i, V (visits), W (revisits) as in fa1_forward.cu;
//   K/V bytes per (b, h): 2 seqlen_k d e when seqlen_q > 0, else 0.
//   fa1_backward_kernel:
//     read    = B H [ K/V bytes  +  V (3 d e + 4 + 4 d) ]
//               K_j, V_j once per K/V block; Q_i, O_i, dO_i, lse_i and dQ_i once per visit
//     written = B H [ W 4 d  +  seqlen_q d e  +  2 seqlen_k d g ]
//               dQ_i once per visit (float32 except at the last, where dq is written;
//               rows that see no block write dq = 0), dK_j, dV_j once per K/V block,
//               g = e for MHA (dk, dv) and 4 for GQA (dk_accum, dv_accum)
//   fa1_gqa_reduce_kernel (GQA only): read B H seqlen_k d 8, written B Hk seqlen_k d 2 e.
//   FLOPs: 10 HeadDim Br Bc per visited tile pair (S, dP, dV~, dK~ and dQ, 2 each),
//   2.5x the forward's 4, plus one exponential per visible score.
// Deterministic: no atomics anywhere, fixed summation orders.
#include "fa1_common.cuh"

namespace cuflash {

template <int HeadDim, int BlockRows, int BlockCols>
struct Fa1BackwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockRows = BlockRows;  // Br
  static constexpr int kBlockCols = BlockCols;  // Bc
  static constexpr int kThreads = fa1::kThreads;
  static constexpr int kTileStride = HeadDim + 1;
  static constexpr int kScoreStride = BlockCols + 1;
  // Shared memory layout, in floats.
  static constexpr int kQ = 0;                                    // O_i, then Q_i   Br x HeadDim
  static constexpr int kDout = kQ + BlockRows * kTileStride;      // dO_i            Br x HeadDim
  static constexpr int kK = kDout + BlockRows * kTileStride;      // K_j             Bc x HeadDim
  static constexpr int kV = kK + BlockCols * kTileStride;         // V_j             Bc x HeadDim
  static constexpr int kDk = kV + BlockCols * kTileStride;        // dK~_j (unscaled) Bc x HeadDim
  static constexpr int kDv = kDk + BlockCols * HeadDim;           // dV~_j           Bc x HeadDim
  static constexpr int kProbs = kDv + BlockCols * HeadDim;        // P               Br x Bc
  static constexpr int kDscores = kProbs + BlockRows * kScoreStride;  // dS          Br x Bc
  static constexpr int kLse = kDscores + BlockRows * kScoreStride;    // lse_i
  static constexpr int kDelta = kLse + BlockRows;                      // D_i
  static constexpr int kSmemFloats = kDelta + BlockRows;
  static constexpr unsigned kSmemBytes = kSmemFloats * sizeof(float);

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static_assert(BlockRows >= 1 && BlockRows <= kThreads, "one thread per query row computes D_i");
  static_assert(BlockCols >= 1, "a K/V block holds at least one key");
};

template <class T, int HeadDim, int BlockRows, int BlockCols>
__global__ void __launch_bounds__(fa1::kThreads, fa1::kMinBlocksPerSm) fa1_backward_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "fa1_backward_kernel: T is float, __half or __nv_bfloat16");
  using Traits = Fa1BackwardTraits<HeadDim, BlockRows, BlockCols>;
  constexpr int kTS = Traits::kTileStride;
  constexpr int kSS = Traits::kScoreStride;

  CUFLASH_DYNAMIC_SMEM(smem_bytes);
  if (launch_differs_from_traits<Traits::kSmemBytes, fa1::kThreads>()) __trap();
  float* const smem = reinterpret_cast<float*>(smem_bytes);
  float* const q_tile = smem + Traits::kQ;
  float* const dout_tile = smem + Traits::kDout;
  float* const k_tile = smem + Traits::kK;
  float* const v_tile = smem + Traits::kV;
  float* const dk_acc = smem + Traits::kDk;
  float* const dv_acc = smem + Traits::kDv;
  float* const probs = smem + Traits::kProbs;
  float* const dscores = smem + Traits::kDscores;
  float* const row_lse = smem + Traits::kLse;
  float* const delta = smem + Traits::kDelta;

  const int tid = threadIdx.x;
  const BlockInfo info = BlockInfo::of(p, blockIdx.y, blockIdx.x);
  const bool grouped = p.nheads != p.nheads_k;
  const int d = p.headdim;
  const float scale = p.softmax_scale;
  const int num_q_blocks = ceil_div(p.seqlen_q, BlockRows);
  const int num_kv_blocks = ceil_div(p.seqlen_k, BlockCols);
  const MaskPolicy mask = MaskPolicy::of(p, info);
  const IdentityScoreHook score_hook{};  // fa1 takes no softcap or ALiBi

  const T* const q = info.q<T>(p);
  const T* const k = info.k<T>(p);
  const T* const v = info.v<T>(p);
  const T* const o = info.out_in<T>(p);
  const T* const dout = info.dout<T>(p);
  T* const dq = info.dq<T>(p);
  T* const dk = info.dk<T>(p);
  T* const dv = info.dv<T>(p);
  const float* const lse = p.lse + info.row_stats_offset(p);
  // dq_accum (1, batch, seqlen_q, nheads, headdim) and dk_accum / dv_accum
  // (batch, seqlen_k, nheads, headdim) are dense: one row of this head every nheads * d floats.
  const long long accum_row_stride = BlockInfo::dense_row_stride(p);
  float* const dq_acc = info.dq_accum(p, 0);
  float* const dk_part = grouped ? p.dk_accum + info.dense_k_offset(p) : nullptr;
  float* const dv_part = grouped ? p.dv_accum + info.dense_k_offset(p) : nullptr;

  // Q blocks that see no K/V block: dq = 0.
  for (int q_block = 0; q_block < num_q_blocks; ++q_block) {
    if (!fa1::kv_blocks_of_q_block<BlockRows, BlockCols>(mask, q_block).empty()) continue;
    const int row0 = q_block * BlockRows;
    const int rows = min(BlockRows, p.seqlen_q - row0);
    for (int e = tid; e < rows * d; e += fa1::kThreads)
      arch::store(dq + (row0 + e / d) * p.dq_stride.row + e % d, from_float<T>(0.f));
  }

  const IndexRange kv_seen = mask.kv_blocks<BlockCols>(0, p.seqlen_q);  // by any row
  for (int kv_block = 0; kv_block < num_kv_blocks; ++kv_block) {
    const int key0 = kv_block * BlockCols;
    const int keys = min(BlockCols, p.seqlen_k - key0);
    __syncthreads();  // the previous block's tiles and accumulators are no longer read
    if (kv_seen.contains(kv_block)) {
      fa1::load_tile<BlockCols, HeadDim>(k_tile, k + key0 * p.k_stride.row, p.k_stride.row, keys, d);
      fa1::load_tile<BlockCols, HeadDim>(v_tile, v + key0 * p.v_stride.row, p.v_stride.row, keys, d);
    }
    for (int e = tid; e < BlockCols * HeadDim; e += fa1::kThreads) {
      dk_acc[e] = 0.f;
      dv_acc[e] = 0.f;
    }

    for (int q_block = 0; q_block < num_q_blocks; ++q_block) {
      const IndexRange visible = fa1::kv_blocks_of_q_block<BlockRows, BlockCols>(mask, q_block);
      if (!visible.contains(kv_block)) continue;  // wholly outside the band: skipped
      const bool last_visit = kv_block == visible.end - 1;
      const int row0 = q_block * BlockRows;
      const int rows = min(BlockRows, p.seqlen_q - row0);

      // D_i = rowsum(dO_i o O_i), with O_i parked where Q_i goes next.
      __syncthreads();  // the previous Q_i, dO_i, P, dS are no longer read
      fa1::load_tile<BlockRows, HeadDim>(q_tile, o + row0 * p.out_stride.row, p.out_stride.row, rows, d);
      fa1::load_tile<BlockRows, HeadDim>(dout_tile, dout + row0 * p.dout_stride.row, p.dout_stride.row, rows, d);
      __syncthreads();
      if (tid < rows) {
        const float* orow = q_tile + tid * kTS;
        const float* dorow = dout_tile + tid * kTS;
        float sum = 0.f;
        for (int x = 0; x < HeadDim; ++x) sum += orow[x] * dorow[x];
        delta[tid] = dout_dot_out_minus_dlse(p, info, row0 + tid, sum);
        row_lse[tid] = arch::load(lse + row0 + tid);
      }
      __syncthreads();
      fa1::load_tile<BlockRows, HeadDim>(q_tile, q + row0 * p.q_stride.row, p.q_stride.row, rows, d);
      __syncthreads();

      // P = exp(S - lse) and dS = P o (dO V^T - D), one thread per (row, key).
      for (int e = tid; e < BlockRows * BlockCols; e += fa1::kThreads) {
        const int r = e / BlockCols;
        const int c = e % BlockCols;
        float prob = 0.f, ds = 0.f;
        if (r < rows && c < keys && row_lse[r] != neg_inf() && mask.visible(row0 + r, key0 + c)) {
          const float* qr = q_tile + r * kTS;
          const float* dor = dout_tile + r * kTS;
          const float* kc = k_tile + c * kTS;
          const float* vc = v_tile + c * kTS;
          float qk = 0.f, dp = 0.f;
#pragma unroll 8
          for (int x = 0; x < HeadDim; ++x) {
            qk += qr[x] * kc[x];
            dp += dor[x] * vc[x];
          }
          prob = fa1::exp_of_difference(score_hook(qk, row0 + r, key0 + c) * p.softmax_scale, row_lse[r]);
          ds = prob * (dp - delta[r]);
        }
        probs[r * kSS + c] = prob;
        dscores[r * kSS + c] = ds;
      }
      __syncthreads();

      // dV~_j += P^T dO_i and dK~_j += dS^T Q_i (scale applied when dK_j is written).
      for (int e = tid; e < BlockCols * HeadDim; e += fa1::kThreads) {
        const int c = e / HeadDim;  // key within the block
        const int x = e % HeadDim;  // head-dim column
        if (c >= keys || x >= d) continue;
        float dv_sum = 0.f, dk_sum = 0.f;
#pragma unroll 4
        for (int r = 0; r < BlockRows; ++r) {
          dv_sum += probs[r * kSS + c] * dout_tile[r * kTS + x];
          dk_sum += dscores[r * kSS + c] * q_tile[r * kTS + x];
        }
        dv_acc[e] += dv_sum;
        dk_acc[e] += dk_sum;
      }

      // dQ_i += scale dS K_j, in global memory.
      for (int e = tid; e < BlockRows * HeadDim; e += fa1::kThreads) {
        const int r = e / HeadDim;
        const int x = e % HeadDim;
        if (r >= rows || x >= d) continue;
        const float* dsrow = dscores + r * kSS;
        float sum = 0.f;
#pragma unroll 8
        for (int c = 0; c < BlockCols; ++c) sum += dsrow[c] * k_tile[c * kTS + x];
        float* acc = dq_acc + (row0 + r) * accum_row_stride + x;
        const float updated = arch::load(acc) + scale * sum;
        if (last_visit) {
          arch::store(dq + (row0 + r) * p.dq_stride.row + x, from_float<T>(updated));
        } else {
          arch::store(acc, updated);
        }
      }
    }

    // dK_j, dV_j: this (b, h)'s contribution, final for MHA, a per-head partial for GQA.
    __syncthreads();
    for (int e = tid; e < BlockCols * HeadDim; e += fa1::kThreads) {
      const int c = e / HeadDim;
      const int x = e % HeadDim;
      if (c >= keys || x >= d) continue;
      const int key = key0 + c;
      const float dk_value = scale * dk_acc[e];
      const float dv_value = dv_acc[e];
      if (grouped) {
        arch::store(dk_part + key * accum_row_stride + x, dk_value);
        arch::store(dv_part + key * accum_row_stride + x, dv_value);
      } else {
        arch::store(dk + key * p.dk_stride.row + x, from_float<T>(dk_value));
        arch::store(dv + key * p.dv_stride.row + x, from_float<T>(dv_value));
      }
    }
  }
}

// GQA/MQA: dk[b, key, hk] = sum over the group's query heads h = hk g .. hk g + g - 1 of
// dk_accum[b, key, h] (same for dv), summed in head order (deterministic).
template <class T>
__global__ void __launch_bounds__(fa1::kReduceThreads) fa1_gqa_reduce_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "fa1_gqa_reduce_kernel: T is float, __half or __nv_bfloat16");
  if (launch_differs_from_traits<0, fa1::kReduceThreads>()) __trap();
  const int batch = blockIdx.y;
  const int d = p.headdim;
  const int group = BlockInfo::group_size(p);
  const long long per_batch = static_cast<long long>(p.seqlen_k) * p.nheads_k * d;
  const long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= per_batch) return;
  const int x = static_cast<int>(e % d);
  const int kv_head = static_cast<int>(e / d % p.nheads_k);
  const int key = static_cast<int>(e / (static_cast<long long>(d) * p.nheads_k));
  float dk_sum = 0.f, dv_sum = 0.f;
  for (int g = 0; g < group; ++g) {  // the group's query heads, in order
    const BlockInfo member = BlockInfo::of_group(p, batch, kv_head, g);
    const long long at = member.dense_k_offset(p) + key * BlockInfo::dense_row_stride(p) + x;
    dk_sum += arch::load(p.dk_accum + at);
    dv_sum += arch::load(p.dv_accum + at);
  }
  const BlockInfo info = BlockInfo::of_group(p, batch, kv_head, 0);
  T* const dk = info.dk<T>(p) + key * p.dk_stride.row;
  T* const dv = info.dv<T>(p) + key * p.dv_stride.row;
  arch::store(dk + x, from_float<T>(dk_sum));
  arch::store(dv + x, from_float<T>(dv_sum));
}

}  // namespace cuflash
