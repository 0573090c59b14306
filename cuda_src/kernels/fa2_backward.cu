// FlashAttention-2 backward (Dao 2023, Algorithm 2), SIMT float32 math. Three kernels:
//
// 1. fa2_dout_dot_out_kernel<T>: the pre-pass D = rowsum(dO * O) into `dout_dot_out`
//    (batch, nheads, seqlen_q). grid = (ceil(seqlen_q / 16), nheads, batch), 128 threads; a
//    warp per row, lanes over 4-element chunks of the head dim, one shuffle reduction.
//    Reads 2 * B * H * Sq * d * es bytes, writes 4 * B * H * Sq.
//
// 2. fa2_backward_kernel<T, D, BlockM, BlockN, Warps>: grid = (X, nheads_k, batch). Block x
//    takes the K/V blocks j = x, x + X, x + 2X, ... of one kv head (X = ceil(seqlen_k / BlockN):
//    one K/V block each; deterministic: X = num_dq_splits, see below); per K/V block (BlockN
//    keys) K_j, V_j are loaded into shared memory once and dK_j, dV_j are accumulated in
//    registers. It loops over the query heads of its group (GQA/MQA: the group's dK/dV sum
//    happens on chip, in a fixed order, with no float32 dk/dv scratch and no extra reduction
//    kernel; the price is group-fold fewer blocks in flight for MQA-like shapes) and, per head,
//    over the Q blocks that see the K/V block (mask.cuh's q_blocks: under causal from the first
//    Q block with a row at or below the diagonal; the others are skipped unread). Per Q block i:
//        load Q_i, dO_i (shared memory), lse_i, D_i
//        S = Q_i K_j^T, dP = dO_i V_j^T                          (mma_nt, block-wide tiling)
//        P = exp2((hook(S) * scale - lse) * log2 e) (0 where masked), dS = P * (dP Z - D) * hook' -> shared memory
//        (hook, hook': mask.cuh's ScoreHook and d score / d (scale S): softcap and ALiBi; Z: dropout.cuh's
//        factor keep / (1 - dropout_p), 1 without dropout; the P tile holds P Z, what multiplied V in the forward)
//        dV_j += P^T dO_i, dK_j += dS^T Q_i                      (mma_tn, keys x head dim)
//        dQ_i += dS K_j -> float32 dq_accum                      (mma_nn, rows x head dim)
//    dq update: red.global.add.f32 (arch::atomic_add) into a zero-initialised dq_accum slice.
//    Atomic mode (num_dq_splits == 1, a block per K/V block): one slice that the blocks of
//    different K/V blocks race on, so the float32 sum order (and the last bits) may vary
//    between runs. Deterministic mode (FA2's): X = num_dq_splits = S blocks per kv head, S
//    fixed by the device's SM count (fa2.py's num_dq_splits_for), never by seqlen_k; block x
//    adds into slice x only, each element from the one thread that owns it in the dQ tiling,
//    in program order (K/V blocks, then heads, then Q blocks), so every slice's sums and
//    kernel 3's sum of the S slices in index order are the same bits on every run.
//    After each K/V block dK_j * scale and dV_j are written in the element type.
//
// 3. fa2_convert_dq_kernel<T, BlockN>: dq = scale * sum of the num_dq_splits dq_accum slices,
//    in slice order; grid = (ceil(seqlen_q / 16), nheads, batch), 128 threads over (row,
//    4-dim chunk). A row that sees no key reads nothing and gets exactly 0 (BlockN: which
//    rows see a key, as the main kernel's K/V blocks do).
//
// What it costs (es = sizeof(T), d = headdim, M = BlockM, N = BlockN, G = nheads / nheads_k):
//   kernel 2, per block (b, kv head, j) with keys_j = min(N, Sk - j N), for each of its G heads
//   and each Q block i it visits (rows_i = min(M, Sq - i M)):
//     reads  2 * keys_j * d * es                      (K_j, V_j once)
//          + sum_i rows_i * (2 * d * es + 8)          (Q_i, dO_i, lse_i, D_i)
//          + sum_i rows_i * d * 4                     (red.add reads what it adds to)
//     writes sum_i rows_i * d * 4                     (dq_accum by red.add)
//          + 2 * keys_j * d * es                      (dK_j, dV_j once)
//   (the same in both modes: a deterministic block moves what its K/V blocks' blocks would).
//   Without causal: Q, dO are read ceil(Sk / N) times and K, V once per kv head.
//   kernel 3: reads 4 * d * S per row that sees a key, writes d * es per row.
//   FLOPs: 2.5x the forward's (5 products of 2 * Sq * Sk * d each; 4 of them are the FA2
//   backward's own, the fifth is recomputing S).
//   Deterministic mode cost: dq_accum grows from B * Sq * H * d to S * B * Sq * H * d floats,
//   S = min(K/V blocks, ceil(SMs / (B * H_k))) (e.g. 132 SMs, B = 1, H_k = 32: S = 5; with
//   B * H_k >= SMs, S = 1), linear in Sq and independent of Sk; kernel 3 reads S slices per
//   row instead of one. Parallelism: S * B * H_k blocks (about one wave) instead of
//   ceil(Sk / N) * B * H_k, each doing ceil(Sk / N) / S blocks' work in turn.
//
// Tiles (Python table, cuflash/kernels/families/fa2.py), BlockM x BlockN (Q step x K/V block):
// 32 x 64 up to head dim 128 (8 warps at 64 and 128, 4 at 32 and 96 where 256 threads do not
// tile dK/dV evenly), 16 x 64 with 8 warps at 192, 32 x 32 with 8 warps at 256. FA2's
// head-dim-128 backward uses 64 x 128 with 8 warps and 16-bit tiles; this SIMT version keeps
// every tile in float32 shared memory (K, V, Q, dO, P, dS), so the tiles are halved to fit
// 119 KB at head dim 128, 134 KB at 192 and 142 KB at 256 (sm_80 allows 163 KB; targets with
// 99 KB per block take the smaller rows of BACKWARD_CHOICES), and each
// thread's dK + dV slice (2 * BlockN * D / threads floats) stays at 64 registers at head dims
// 64..128 (96 at 96 and 192, where the dQ tile is kept small instead).
//
// Shared memory (floats): K, V [BlockN][D+4]; Q, dO [BlockM][D+4]; P, dS [BlockM][BlockN+4];
// lse, D [BlockM].
//
// Recomputing P: FA2 forms exp2(S * scale_log2 - lse * log2 e); rounding lse * log2 e to float32
// costs every P a relative error of up to |lse| * 2^-24, which float32 inputs notice (and logits
// of 1e4 turn into 1e-3). Here one FMA forms S * scale - lse, rounded once close to 0 for every P
// that matters, and one multiply by log2 e follows: one extra FMUL per score, against 10 d FMAs
// per score for the five products. What remains is the float32 lse's own resolution.
//
// Masking and empty rows: P = 0 wherever the key is not visible (mask.cuh, or past the last
// key) and for rows past the last query; a row that saw no key in the
// forward has lse = -inf, which is stored as +inf here so P = exp2(-inf) = 0 (never
// exp2(+inf) * 0). Its dS, and so its dQ and its share of dK, dV, are exact zeros.
// Requires softmax_scale > 0 (the API validates it).
#include "arch/arch.cuh"
#include "kernels/fa2_tiles.cuh"

namespace cuflash {
namespace fa2 {

// Kernel traits of the backward: tile sizes, warps, the three thread tilings, smem layout.
template <int HeadDim, int BlockM, int BlockN, int Warps>
struct BackwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kThreads = Warps * 32;

  // S and dP: BlockM x BlockN, granule = one row / one key.
  using STile = ThreadTile<BlockM, BlockN, kThreads>;
  // dK and dV: BlockN x HeadDim, granules = chunks of 4 keys x 4 dims.
  using KvTile = ThreadTile<BlockN / 4, HeadDim / 4, kThreads>;
  // dQ: BlockM x HeadDim, granules = one row x a chunk of 4 dims.
  using QTile = ThreadTile<BlockM, HeadDim / 4, kThreads>;

  static constexpr int kRowStride = HeadDim + 4;
  static constexpr int kPStride = BlockN + 4;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + BlockN * kRowStride;
  static constexpr int kQOffset = kVOffset + BlockN * kRowStride;
  static constexpr int kDoOffset = kQOffset + BlockM * kRowStride;
  static constexpr int kPOffset = kDoOffset + BlockM * kRowStride;
  static constexpr int kDsOffset = kPOffset + BlockM * kPStride;
  static constexpr int kLseOffset = kDsOffset + BlockM * kPStride;
  static constexpr int kDOffset = kLseOffset + BlockM;
  static constexpr int kSmemFloats = kDOffset + BlockM;
  static constexpr int kSmemBytes = kSmemFloats * 4;

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static_assert(BlockM % 4 == 0 && BlockN % 32 == 0 && BlockM <= kThreads, "tile shape");
};

// Slices of dq_accum that query row `row` reads back: all num_dq_splits of them (zero-filled,
// so a slice none of whose K/V blocks the row sees adds 0) if the row sees a key, else none,
// which makes the dq of a row that sees no key exactly 0.
template <int BlockN>
__device__ __forceinline__ IndexRange dq_slices_of_row(const AttentionParams& p, const BlockInfo& info, int row) {
  const IndexRange blocks = MaskPolicy::of(p, info).kv_blocks<BlockN>(row, row + 1);
  return IndexRange{0, blocks.empty() ? 0 : p.num_dq_splits};
}

}  // namespace fa2

// ---- 1. D = rowsum(dO * O) ------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(fa2::RowKernel::kThreads) fa2_dout_dot_out_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "float, __half or __nv_bfloat16");
  constexpr int kWarps = fa2::RowKernel::kThreads / 32;
  if (launch_differs_from_traits<0, fa2::RowKernel::kThreads>()) __trap();
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const int lane = threadIdx.x % 32;
  const T* dout = info.dout<T>(p);
  const T* out = info.out_in<T>(p);
  float* dot = p.dout_dot_out + info.row_stats_offset(p);
  const int row_end = min(info.seqlen_q(p), (static_cast<int>(blockIdx.x) + 1) * fa2::RowKernel::kRows);
  for (int row = blockIdx.x * fa2::RowKernel::kRows + threadIdx.x / 32; row < row_end; row += kWarps) {
    float sum = 0.f;
    for (int dim0 = lane * 4; dim0 < p.headdim_v; dim0 += 128) {  // dO and O have v's head dim
      const float4 x = fa2::load_chunk4(dout + row * p.dout_stride.row + dim0, p.headdim_v - dim0);
      const float4 y = fa2::load_chunk4(out + row * p.out_stride.row + dim0, p.headdim_v - dim0);
      sum = fmaf(x.x, y.x, sum);
      sum = fmaf(x.y, y.y, sum);
      sum = fmaf(x.z, y.z, sum);
      sum = fmaf(x.w, y.w, sum);
    }
    sum = fa2::group_sum<32>(sum);
    if (lane == 0) arch::store(dot + row, dout_dot_out_minus_dlse(p, info, row, sum));
  }
}

// ---- 2. dK, dV (and dQ into dq_accum) per K/V block ------------------------------------------
// __launch_bounds__(threads, 1): shared memory, not registers, bounds the blocks per SM (1 to 3),
// so ptxas need not squeeze under a register-occupancy cliff (without it, it spilled a setup
// value at head dim 96 to stay at 128 registers).
// Hook: the per-score transform (mask.cuh's ScoreHook; flex_hook.cuh's FlexHook for a user's mods).
template <class T, int HeadDim, int BlockM, int BlockN, int Warps, class Hook = ScoreHook>
__global__ void __launch_bounds__(Warps * 32, 1) fa2_backward_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "float, __half or __nv_bfloat16");
  using Tr = fa2::BackwardTraits<HeadDim, BlockM, BlockN, Warps>;
  using STile = typename Tr::STile;
  using KvTile = typename Tr::KvTile;
  using QTile = typename Tr::QTile;
  constexpr int kThreads = Tr::kThreads;

  CUFLASH_DYNAMIC_SMEM(smem_bytes);
  // Deterministic mode runs one block per slice along x.
  if (launch_differs_from_traits<Tr::kSmemBytes, kThreads>() || p.headdim > HeadDim || p.headdim < 1 ||
      p.headdim_v > HeadDim || p.headdim_v < 1 ||
      (p.num_dq_splits > 1 && p.num_dq_splits != static_cast<int>(gridDim.x)))
    __trap();
  float* smem = reinterpret_cast<float*>(smem_bytes);
  float* k_tile = smem + Tr::kKOffset;
  float* v_tile = smem + Tr::kVOffset;
  float* q_tile = smem + Tr::kQOffset;
  float* do_tile = smem + Tr::kDoOffset;
  float* p_tile = smem + Tr::kPOffset;
  float* ds_tile = smem + Tr::kDsOffset;
  float* lse_rows = smem + Tr::kLseOffset;
  float* dot_rows = smem + Tr::kDOffset;

  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo kv_info = BlockInfo::of_group(p, batch, kv_head, 0);
  // The thread index is read back from a volatile local at each K/V block (tid) and each Q block (step_tid), so
  // that its derived offsets are not hoisted out of those loops and held through the products (without it the K/V
  // loop cost 13 to 24 registers and spilled 60 bytes at head dim 96 on sm_80); the cost is a local load (an L1
  // hit) and a few integer instructions per Q block.
  volatile int thread_index = threadIdx.x;
  const int d = p.headdim;         // q's, k's and their gradients' columns
  const int dim_v = p.headdim_v;  // v's, dO's and dV's (attention_params.cuh)
  const int group = BlockInfo::group_size(p);
  const float softmax_scale = p.softmax_scale;
  const int k_extent = min(HeadDim, (d + 3) / 4 * 4);      // of Q K^T's dot products
  const int v_extent = min(HeadDim, (dim_v + 3) / 4 * 4);  // of dO V^T's
  const int dq_slice = p.num_dq_splits > 1 ? blockIdx.x : 0;
  const MaskPolicy mask = MaskPolicy::of(p, kv_info);  // the sequence's: the same for every head of the group

  // This block's K/V blocks: just blockIdx.x in atomic mode, every gridDim.x-th in deterministic mode. The test is
  // block-uniform and made before an iteration's barriers; varlen: a block past its sequence's keys runs none.
  for (int n_block = blockIdx.x; n_block * BlockN < kv_info.seqlen_k(p); n_block += gridDim.x) {
    const int key0 = n_block * BlockN;
    const int block_keys = min(BlockN, kv_info.seqlen_k(p) - key0);
    const int tid = thread_index;
    // dK / dV: key chunks kv_key + i * kThreadsM, dim chunks kv_dim + j * kThreadsN.
    const int kv_key = tid / KvTile::kThreadsN;
    const int kv_dim = tid % KvTile::kThreadsN;
    __syncthreads();  // everyone is done with the previous K/V block's K and V tiles
    const T* k = kv_info.k<T>(p) + key0 * p.k_stride.row;
    const T* v = kv_info.v<T>(p) + key0 * p.v_stride.row;
    fa2::load_tile<BlockN, HeadDim, Tr::kRowStride>(k_tile, k, p.k_stride.row, block_keys, d, tid, kThreads);
    fa2::load_tile<BlockN, HeadDim, Tr::kRowStride>(v_tile, v, p.v_stride.row, block_keys, dim_v, tid, kThreads);

    float acc_dk[KvTile::kM][4][KvTile::kN][4];
    float acc_dv[KvTile::kM][4][KvTile::kN][4];
#pragma unroll
    for (int i = 0; i < KvTile::kM; ++i)
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int j = 0; j < KvTile::kN; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dk[i][a][j][e] = acc_dv[i][a][j][e] = 0.f;

    const IndexRange m_range = mask.q_blocks<BlockM>(key0, key0 + block_keys);
    // The Q blocks visited: those of m_range, or a block mask's list (flex_hook.cuh), the same for the group's heads.
    const auto visits = Hook::q_visits(p, batch, kv_head, n_block, m_range);
    for (int h = 0; h < group; ++h) {
      const BlockInfo info = BlockInfo::of_group(p, batch, kv_head, h);
      const Hook score_hook = Hook::of(p, info);
      const Dropout dropout = Dropout::of(p, batch, info.head);
      const T* q_head = info.q<T>(p);
      const T* do_head = info.dout<T>(p);
      const long long row_base = info.row_stats_offset(p);
      float* dq_head = info.dq_accum(p, dq_slice);
      const long long dq_row_stride = BlockInfo::dense_row_stride(p);

      for (int visit = visits.begin; visit < visits.end; ++visit) {
        const int m_block = visits.tile(visit);
        const Hook tile_hook = score_hook.for_tile(visits.full(visit));
        const int row0 = m_block * BlockM;
        const int block_rows = min(BlockM, mask.seqlen_q - row0);
        const int step_tid = thread_index;
        // This thread's tiles. S / dP: rows s_row + i * kThreadsM, keys s_key + j * kThreadsN.
        const int s_row = step_tid / STile::kThreadsN;
        const int s_key = step_tid % STile::kThreadsN;
        // dQ: rows q_row + i * kThreadsM, dim chunks q_dim + j * kThreadsN.
        const int q_row = step_tid / QTile::kThreadsN;
        const int q_dim = step_tid % QTile::kThreadsN;
        __syncthreads();  // everyone is done with the previous Q_i, dO_i, P, dS
        fa2::load_tile<BlockM, HeadDim, Tr::kRowStride>(q_tile, q_head + row0 * p.q_stride.row, p.q_stride.row,
                                                        block_rows, d, step_tid, kThreads);
        fa2::load_tile<BlockM, HeadDim, Tr::kRowStride>(do_tile, do_head + row0 * p.dout_stride.row,
                                                        p.dout_stride.row, block_rows, dim_v, step_tid, kThreads);
        fa2::stage_row_stats<BlockM>(p, row_base + row0, block_rows, step_tid, lse_rows, dot_rows);
        __syncthreads();

        // S = Q K^T and dP = dO V^T, then P and dS, for this thread's rows x keys.
        {
          float s[STile::kM][STile::kN], dp[STile::kM][STile::kN];
#pragma unroll
          for (int i = 0; i < STile::kM; ++i)
#pragma unroll
            for (int j = 0; j < STile::kN; ++j) s[i][j] = dp[i][j] = 0.f;
          fa2::mma_nt<STile::kM, STile::kN>(s, q_tile + s_row * Tr::kRowStride, STile::kThreadsM * Tr::kRowStride,
                                            k_tile + s_key * Tr::kRowStride, STile::kThreadsN * Tr::kRowStride,
                                            k_extent);
          fa2::mma_nt<STile::kM, STile::kN>(dp, do_tile + s_row * Tr::kRowStride,
                                            STile::kThreadsM * Tr::kRowStride, v_tile + s_key * Tr::kRowStride,
                                            STile::kThreadsN * Tr::kRowStride, v_extent);
          const bool needs_mask = mask.tile_needs_mask(row0, block_rows, key0, BlockN);
#pragma unroll
          for (int i = 0; i < STile::kM; ++i) {
            const int r = s_row + i * STile::kThreadsM;
            const float lse = lse_rows[r];
            const float dot = dot_rows[r];
#pragma unroll
            for (int j = 0; j < STile::kN; ++j) {
              const int c = s_key + j * STile::kThreadsN;
              float dscore;  // d score / d (scale q.k)
              const float qk = tile_hook(s[i][j], row0 + r, key0 + c, dscore);
              float prob = arch::exp2_approx(fmaf(qk, softmax_scale, -lse) * kLog2e);
              if (needs_mask && !mask.visible(row0 + r, key0 + c)) prob = 0.f;
              const float kept = dropout.factor(row0 + r, key0 + c);  // dropout.cuh; 1 without dropout
              p_tile[r * Tr::kPStride + c] = prob * kept;
              ds_tile[r * Tr::kPStride + c] = prob * (dp[i][j] * kept - dot) * dscore;
              // Gradients to a score_mod's side arrays: d loss / d score' = P (dP - D) (mods run without dropout;
              // by every lane: the hook skips P = 0).
              if constexpr (Hook::kHasSideGrads)
                tile_hook.side_grads(prob * (dp[i][j] - dot), s[i][j], row0 + r, key0 + c);
            }
          }
        }
        __syncthreads();

        // dV += P^T dO, dK += dS^T Q over this Q block's rows.
        fa2::mma_tn<KvTile::kM, KvTile::kN, BlockM>(acc_dv, p_tile + kv_key * 4, Tr::kPStride, KvTile::kThreadsM * 4,
                                                    do_tile + kv_dim * 4, Tr::kRowStride, KvTile::kThreadsN * 4);
        fa2::mma_tn<KvTile::kM, KvTile::kN, BlockM>(acc_dk, ds_tile + kv_key * 4, Tr::kPStride,
                                                    KvTile::kThreadsM * 4, q_tile + kv_dim * 4, Tr::kRowStride,
                                                    KvTile::kThreadsN * 4);

        // dQ_i += dS K_j, straight into dq_accum (unscaled; the convert kernel applies the scale).
        {
          float acc_dq[QTile::kM][QTile::kN][4];
#pragma unroll
          for (int i = 0; i < QTile::kM; ++i)
#pragma unroll
            for (int j = 0; j < QTile::kN; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc_dq[i][j][e] = 0.f;
          fa2::mma_nn<QTile::kM, QTile::kN, BlockN>(acc_dq, ds_tile + q_row * Tr::kPStride,
                                                    QTile::kThreadsM * Tr::kPStride, k_tile + q_dim * 4,
                                                    Tr::kRowStride, QTile::kThreadsN * 4);
#pragma unroll
          for (int i = 0; i < QTile::kM; ++i) {
            const int r = q_row + i * QTile::kThreadsM;
            if (r >= block_rows) continue;
            float* dq_row = dq_head + (row0 + r) * dq_row_stride;
#pragma unroll
            for (int j = 0; j < QTile::kN; ++j) {
              const int dim0 = (q_dim + j * QTile::kThreadsN) * 4;
              if (dim0 >= d) continue;
#pragma unroll
              for (int e = 0; e < 4; ++e)
                if (dim0 + e < d) arch::atomic_add(dq_row + dim0 + e, acc_dq[i][j][e]);
            }
          }
        }
      }
    }

    // dK_j = scale * sum dS^T Q, dV_j = sum P^T dO (over the group's heads), once.
    T* dk = kv_info.dk<T>(p);
    T* dv = kv_info.dv<T>(p);
#pragma unroll
    for (int i = 0; i < KvTile::kM; ++i)
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int key = (kv_key + i * KvTile::kThreadsM) * 4 + a;
        if (key >= block_keys) continue;
#pragma unroll
        for (int j = 0; j < KvTile::kN; ++j) {
          const int dim0 = (kv_dim + j * KvTile::kThreadsN) * 4;
          if (dim0 >= max(d, dim_v)) continue;
          float x[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) x[e] = acc_dk[i][a][j][e] * p.softmax_scale;
          fa2::store_chunk4(dk + (key0 + key) * p.dk_stride.row + dim0, x, d - dim0);
          fa2::store_chunk4(dv + (key0 + key) * p.dv_stride.row + dim0, acc_dv[i][a][j], dim_v - dim0);
        }
      }
  }
}

// ---- 3. dq = scale * sum of dq_accum slices -------------------------------------------------
template <class T, int BlockN>
__global__ void __launch_bounds__(fa2::RowKernel::kThreads) fa2_convert_dq_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "float, __half or __nv_bfloat16");
  if (launch_differs_from_traits<0, fa2::RowKernel::kThreads>() || p.num_dq_splits < 1 ||
      p.num_dq_splits > max(1, ceil_div(p.seqlen_k, BlockN)))  // at most a slice per K/V block
    __trap();
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const int d = p.headdim;
  const int chunks_per_row = ceil_div(d, 4);
  const int row0 = blockIdx.x * fa2::RowKernel::kRows;
  const int rows = min(fa2::RowKernel::kRows, info.seqlen_q(p) - row0);
  const long long slice_stride = BlockInfo::dense_q_elements(p);
  T* dq = info.dq<T>(p);
  for (int c = threadIdx.x; c < rows * chunks_per_row; c += fa2::RowKernel::kThreads) {
    const int row = row0 + c / chunks_per_row;
    const int dim0 = (c % chunks_per_row) * 4;
    const float* accum = info.dq_accum(p, 0) + row * BlockInfo::dense_row_stride(p) + dim0;
    const IndexRange slices = fa2::dq_slices_of_row<BlockN>(p, info, row);
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = slices.begin; j < slices.end; ++j) {  // fixed order: bitwise reproducible
      const float4 x = fa2::load_chunk4(accum + j * slice_stride, d - dim0);
      sum[0] += x.x;
      sum[1] += x.y;
      sum[2] += x.z;
      sum[3] += x.w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sum[e] *= p.softmax_scale;
    fa2::store_chunk4(dq + row * p.dq_stride.row + dim0, sum, d - dim0);
  }
}

}  // namespace cuflash
