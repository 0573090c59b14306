// FlashAttention-2 forward (Dao 2023, Algorithm 1), SIMT float32 math.
//
// What it does: out = softmax(scale * Q K^T [masked]) V and lse = logsumexp of the scaled
// scores, per (batch, query head), for element types float / __half / __nv_bfloat16.
//
// How it partitions work
//   grid  = (ceil(seqlen_q / BlockM), nheads, batch): one thread block per Q block of one
//           head; query head h reads kv head h / (nheads / nheads_k) (GQA / MQA). Varlen
//           (block_info.cuh): batch counts sequences, the grid spans the longest one, and a
//           block past its own sequence's rows returns at once.
//   block = Warps x 32 threads. Each warp owns BlockM / Warps consecutive query rows for the
//           whole kernel: their running max m, running sum l and un-normalised O stay in its
//           registers, so no softmax statistic ever goes through shared memory between warps
//           (FA2's change from FA1, which split K/V across warps and reduced through smem).
//   Inside a warp, lanes form 4 x 8 (rows x columns): lane (r, c) owns rows r, r + 4, ... of
//   the warp's rows; of the S tile the keys c, c + 8, ...; of O the head-dim chunks
//   4c..4c+3, 4c+32..4c+35, ... The 8 lanes of a row reduce its max / sum with 3 shuffles.
//   Loop: the Q block is loaded once into shared memory; then for each visible K/V block
//   (last to first, as FA2, so the masked blocks come first): load K_j, V_j into shared
//   memory (all warps), S = Q K_j^T (mma_nt), mask if the block crosses the diagonal or the
//   end of the keys, online softmax in base 2 with the scale folded into one FMA
//   (p = exp2(s * scale_log2 - offset), offset = m * scale_log2 rounded once per max update),
//   rescale l and O by exp2(offset_old - offset_new), stage P in the warp's own shared-memory
//   slab (each lane needs whole rows of P for P V, and they are spread over the 8 lanes of the
//   row group) and O += P V_j (mma_nn). O is divided by l once, after the loop, and written
//   with lse = m * scale + log(l) - (m * scale_log2 - offset) * ln 2: the last term takes the
//   offset's rounding back out, which float32 inputs would otherwise see in the lse.
//   Split-KV (KV-cache decoding, p.num_kv_splits > 1), as in fa2_tc_forward.cu: grid.x is (Q blocks) x splits,
//   block x takes Q block x / splits and the K/V blocks of split x % splits (mask.cuh's split_kv_blocks) and
//   writes float32 O / l and lse to out_accum / lse_accum, which fa2_split_kv_combine.cu merges.
//
// Tiles (Python table, cuflash/kernels/families/fa2.py): BlockM x BlockN = 64 x 64 for head
// dim <= 64, 64 x 32 up to 192, 64 x 32 with 8 warps for 256. FA2's tensor-core traits keep
// 32 query rows per warp with 16-bit Q fragments in registers; a SIMT thread holds its
// operands in float32 and its own O slice (rows x head dim / 8 floats) plus S (rows x
// BlockN / 8), so the rows per warp are halved (16; 8 at head dim 256) to stay far from 255
// registers, and BlockN shrinks with the head dim to keep K + V + Q + P in shared memory
// small enough for two blocks per SM up to head dim 128.
//
// Shared memory (floats): Q [BlockM][D+4], K [BlockN][D+4], V [BlockN][D+4],
// P [Warps][BlockM/Warps][BlockN+4] (see fa2_tiles.cuh for the +4).
//
// What it costs, per launch, with es = sizeof(T), d = headdim, M = BlockM, N = BlockN,
// and for each Q block (b, h, i) with rows_i = min(M, seqlen_q - i M) and
// n_i = number of K/V blocks it sees (ceil(seqlen_k / N), fewer under a mask; mask.cuh):
//   global bytes read    = sum over Q blocks with n_i > 0 of
//                            rows_i * d * es                      (Q, once)
//                          + 2 * keys_i * d * es  (K and V, once per Q block; keys_i = the keys of its
//                                                  n_i blocks, clipped at seqlen_k)
//   global bytes written = batch * nheads * seqlen_q * (d * es + 4)  (O and lse, once)
//   Without causal: reads = B H Sq d es + 2 B H ceil(Sq / M) Sk d es, FA2's formula.
//   FLOPs: 4 * B * H * Sq * Sk * d (about half with causal), run on the compiled head dim
//   (the zero padding between d and D is multiplied too, the reduction over the head dim
//   stops at d rounded up to 4).
//
// Masking and empty rows: mask.cuh decides who sees whom (causal: bottom-right aligned). K/V
// blocks outside the Q block's band are never loaded; blocks crossing an edge of the band or
// the end of the keys are masked element-wise (s = -inf). A Q block
// that sees no key at all (or seqlen_k == 0) loads nothing and writes out = 0, lse = -inf; a
// row inside a block that sees no key keeps m = -inf, l = 0 and gets the same. The running
// max uses 0 in place of -inf when forming m * scale_log2, so -inf - -inf never appears.
// Large logits are safe: the exponent s * scale_log2 - m * scale_log2 is <= 0 up to rounding.
// Requires softmax_scale > 0 (the API validates it).
#include "arch/arch.cuh"
#include "common/sink.cuh"
#include "kernels/fa2_tiles.cuh"

namespace cuflash {
namespace fa2 {

// Kernel traits of the forward: tile sizes, warps, thread tiles, shared-memory layout.
template <int HeadDim, int BlockM, int BlockN, int Warps>
struct ForwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kWarps = Warps;
  static constexpr int kThreads = Warps * 32;
  static constexpr int kRowsPerWarp = BlockM / Warps;

  // Lanes as 4 rows x 8 columns: the S tile (granule = one key) and the O tile (granule = a
  // chunk of 4 head-dim columns) use the same row assignment, so a lane rescales exactly the
  // O rows whose statistics it holds.
  static constexpr int kLaneCols = 8;
  using STile = ThreadTile<kRowsPerWarp, BlockN, 32, kLaneCols>;
  using OTile = ThreadTile<kRowsPerWarp, HeadDim / 4, 32, kLaneCols>;
  static constexpr int kRowsPerThread = STile::kM;
  static constexpr int kKeysPerThread = STile::kN;
  static constexpr int kDimChunksPerThread = OTile::kN;

  static constexpr int kRowStride = HeadDim + 4;  // Q, K, V tiles
  static constexpr int kPStride = BlockN + 4;     // P slabs
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + BlockM * kRowStride;
  static constexpr int kVOffset = kKOffset + BlockN * kRowStride;
  static constexpr int kPOffset = kVOffset + BlockN * kRowStride;
  static constexpr int kSmemFloats = kPOffset + BlockM * kPStride;
  static constexpr int kSmemBytes = kSmemFloats * 4;

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static_assert(BlockM % Warps == 0 && BlockN % 32 == 0, "tile shape");
  static_assert(OTile::kThreadsM == STile::kThreadsM, "S and O must share the row assignment");
};

// A score hook's tile form (FlexHook::on_tile's callback) applied to this thread's TM x TN scores: a struct with a
// call template, not a generic lambda, whose call operator NVRTC 12.9 takes for a host function in a kernel.
template <int TM, int TN, int LaneRows, int LaneCols>
struct HookEachScore {
  float (&s)[TM][TN];
  int first_row;  // of the thread's scores: row first_row + i * LaneRows, key first_key + j * LaneCols
  int first_key;
  template <class TileHook>
  __device__ __forceinline__ void operator()(const TileHook& tile_hook) const {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) s[i][j] = tile_hook(s[i][j], first_row + i * LaneRows, first_key + j * LaneCols);
  }
};

}  // namespace fa2

// __launch_bounds__(threads, 1): shared memory, not registers, bounds the blocks per SM (1 to 3),
// so ptxas need not squeeze under a register-occupancy cliff (without it, it spilled a setup
// value at head dim 96 to stay at 128 registers).
// Hook: the per-score transform (mask.cuh's ScoreHook; flex_hook.cuh's FlexHook for a user's mods).
template <class T, int HeadDim, int BlockM, int BlockN, int Warps, class Hook = ScoreHook>
__global__ void __launch_bounds__(Warps * 32, 1) fa2_forward_kernel(const AttentionParams p) {
  static_assert(is_element_type<T>::value, "float, __half or __nv_bfloat16");
  using Tr = fa2::ForwardTraits<HeadDim, BlockM, BlockN, Warps>;
  constexpr int TM = Tr::kRowsPerThread;
  constexpr int TN = Tr::kKeysPerThread;
  constexpr int TC = Tr::kDimChunksPerThread;
  constexpr int kLaneRows = Tr::STile::kThreadsM;
  constexpr int kLaneCols = Tr::kLaneCols;

  CUFLASH_DYNAMIC_SMEM(smem_bytes);
  // The plan (Python) and these traits must agree on the launch shape; a mismatch is a bug.
  if (launch_differs_from_traits<Tr::kSmemBytes, Tr::kThreads>() || p.headdim > HeadDim || p.headdim < 1 ||
      p.headdim_v > HeadDim || p.headdim_v < 1)
    __trap();
  float* smem = reinterpret_cast<float*>(smem_bytes);

  const int m_block = blockIdx.x / p.num_kv_splits;  // the split is blockIdx.x % p.num_kv_splits
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_row = lane / kLaneCols;
  const int lane_col = lane % kLaneCols;
  const int d = p.headdim;         // q's and k's columns
  const int dim_v = p.headdim_v;  // v's and out's (attention_params.cuh)

  const int row0 = m_block * BlockM;
  if (row0 >= info.seqlen_q(p)) return;  // the whole block (past its sequence for varlen): before any barrier
  const int block_rows = min(BlockM, info.seqlen_q(p) - row0);
  const MaskPolicy mask = MaskPolicy::of(p, info);
  const Hook score_hook = Hook::of(p, info);
  const IndexRange n_range = split_kv_blocks<BlockN>(mask.kv_blocks<BlockN>(row0, row0 + block_rows), mask.seqlen_k,
                                                     blockIdx.x % p.num_kv_splits, p.num_kv_splits);
  // The K/V blocks the loop visits: those of n_range, or a block mask's list (flex_hook.cuh).
  const auto visits = Hook::kv_visits(p, info, m_block, n_range);

  // This thread's rows (absolute index of its i-th row = first_row + i * kLaneRows).
  const int warp_row0 = warp * Tr::kRowsPerWarp;
  const int first_row = row0 + warp_row0 + lane_row;

  float acc_o[TM][TC][4];
  float row_max[TM];     // running max m of the raw scores q.k (unscaled)
  float row_offset[TM];  // m * scale_log2 as rounded and used in the exponents (0 while m = -inf)
  float row_sum[TM];  // this lane's part of the running sum l (the 8 lanes are summed at the end)
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    row_max[i] = neg_inf();
    row_offset[i] = 0.f;
    row_sum[i] = 0.f;
#pragma unroll
    for (int j = 0; j < TC; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[i][j][e] = 0.f;
  }

  if (!visits.empty()) {
    const T* q = info.q<T>(p) + row0 * p.q_stride.row;
    float* q_tile = smem + Tr::kQOffset;
    float* k_tile = smem + Tr::kKOffset;
    float* v_tile = smem + Tr::kVOffset;
    float* p_slab = smem + Tr::kPOffset + warp_row0 * Tr::kPStride;

    fa2::load_tile<BlockM, HeadDim, Tr::kRowStride>(q_tile, q, p.q_stride.row, block_rows, d, threadIdx.x,
                                                    Tr::kThreads);
    const int k_extent = min(HeadDim, (d + 3) / 4 * 4);
    const float scale_log2 = p.softmax_scale_log2;

    for (int visit = visits.end - 1; visit >= visits.begin; --visit) {
      const int n_block = visits.tile(visit);
      const int key0 = n_block * BlockN;
      const int block_keys = min(BlockN, mask.seqlen_k - key0);
      __syncthreads();  // every warp is done with the previous K_j, V_j (and Q is complete)
      fa2::load_tile<BlockN, HeadDim, Tr::kRowStride>(k_tile, info.k_rows<T>(p, key0), block_keys, d, threadIdx.x,
                                                      Tr::kThreads);
      fa2::load_tile<BlockN, HeadDim, Tr::kRowStride>(v_tile, info.v_rows<T>(p, key0),
                                                      block_keys, dim_v, threadIdx.x, Tr::kThreads);
      __syncthreads();

      // S = Q K_j^T for this lane's rows x keys.
      float s[TM][TN];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
      fa2::mma_nt<TM, TN>(s, q_tile + (warp_row0 + lane_row) * Tr::kRowStride, kLaneRows * Tr::kRowStride,
                          k_tile + lane_col * Tr::kRowStride, kLaneCols * Tr::kRowStride, k_extent);

      // FlexHook: mask_mod on partial tiles only; without one, the sequence bounds on edge tiles only (on_tile).
      if (score_hook.active()) {
        score_hook.on_tile(visits.full(visit), row0, BlockM, key0, BlockN,
                           fa2::HookEachScore<TM, TN, kLaneRows, kLaneCols>{s, first_row, key0 + lane_col});
      }
      if (mask.tile_needs_mask(row0, block_rows, key0, BlockN)) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j)
            if (!mask.visible(first_row + i * kLaneRows, key0 + lane_col + j * kLaneCols)) s[i][j] = neg_inf();
      }

      // Online softmax, base 2, scale folded into the exponent's FMA.
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        float block_max = s[i][0];
#pragma unroll
        for (int j = 1; j < TN; ++j) block_max = fmaxf(block_max, s[i][j]);
        block_max = fa2::group_max<kLaneCols>(block_max);
        const float new_max = fmaxf(row_max[i], block_max);
        // A row with no visible key so far keeps new_max = -inf: use 0 so p = exp2(-inf) = 0.
        const float max_scaled = new_max == neg_inf() ? 0.f : new_max * scale_log2;
        // l and O are sums relative to the rounded offset; moving them to the new one uses the
        // difference of the two offsets actually used (a plain subtraction of stored values, which no
        // FMA contraction can turn into m_old * scale_log2 - max_scaled), so l stays exactly relative
        // to the current offset and the epilogue can take the offset's rounding out of the lse.
        const float correction =
            row_max[i] == neg_inf() ? 0.f : arch::exp2_approx(row_offset[i] - max_scaled);
        row_max[i] = new_max;
        row_offset[i] = max_scaled;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          s[i][j] = arch::exp2_approx(fmaf(s[i][j], scale_log2, -max_scaled));
          sum += s[i][j];
        }
        row_sum[i] = fmaf(row_sum[i], correction, sum);
#pragma unroll
        for (int j = 0; j < TC; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[i][j][e] *= correction;
      }

      // Dropout (dropout.cuh) after the row sums, which normalize the undropped softmax; the kept P is scaled by
      // 1 / (1 - dropout_p) once, in the epilogue. Made here so its seed is not live through the whole kernel
      // (held from the start, it made the d64 instance spill on sm_120).
      const Dropout dropout = Dropout::of(p, info.batch, info.head);
      if (dropout.active()) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j)
            if (!dropout.keep(first_row + i * kLaneRows, key0 + lane_col + j * kLaneCols)) s[i][j] = 0.f;
      }

      // Stage P in the warp's slab: P V needs whole rows, spread over the row group's 8 lanes.
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          p_slab[(lane_row + i * kLaneRows) * Tr::kPStride + lane_col + j * kLaneCols] = s[i][j];
      __syncwarp();
      fa2::mma_nn<TM, TC, BlockN>(acc_o, p_slab + lane_row * Tr::kPStride, kLaneRows * Tr::kPStride,
                                  v_tile + lane_col * 4, Tr::kRowStride, kLaneCols * 4);
      // The next write to the slab comes after the next iteration's __syncthreads().
    }
  }

  // Epilogue: O / l and lse = m * scale + log(l); rows that saw no key get 0 and -inf. Split-KV: this split's
  // O / l in float32 (no dropout there) and lse into its slice of out_accum / lse_accum instead. With sinks
  // (sink.cuh) the head's sink logit joins O / l and the lse here, in split 0's partials with split-KV.
  const bool split_kv = p.num_kv_splits > 1;
  const RowSink sink = RowSink::of(p, info.head, blockIdx.x % p.num_kv_splits);
  T* out = info.out<T>(p);
  float* out_part = split_kv ? info.out_accum_split(p, blockIdx.x % p.num_kv_splits) : nullptr;
  float* lse = split_kv ? info.lse_accum_split(p, blockIdx.x % p.num_kv_splits) : p.lse + info.row_stats_offset(p);
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const float l = fa2::group_sum<kLaneCols>(row_sum[i]);
    const int row = first_row + i * kLaneRows;
    if (row >= mask.seqlen_q) continue;
    float inv_l = l > 0.f ? p.dropout_rescale / l : 0.f;  // 1 / (1 - dropout_p); 1 without dropout
    // l = sum 2^(s * scale_log2 - offset) with offset = m * scale_log2 rounded; the rounding
    // residual r = m * scale_log2 - offset (exact through the FMA) is taken out again in base e:
    // lse = m * scale + log(l) - r * ln 2. (float32 inputs notice the residual; 16-bit ones do not.)
    const float residual = fmaf(row_max[i], p.softmax_scale_log2, -row_offset[i]);
    float row_lse = l > 0.f ? fmaf(row_max[i], p.softmax_scale, fmaf(-residual, kLn2, logf(l))) : neg_inf();
    sink.join(inv_l, row_lse);
#pragma unroll
    for (int j = 0; j < TC; ++j) {
      const int dim0 = (lane_col + j * kLaneCols) * 4;
      if (dim0 >= dim_v) continue;
      float o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = acc_o[i][j][e] * inv_l;
      if (split_kv)
        fa2::store_chunk4(out_part + row * BlockInfo::dense_out_row_stride(p) + dim0, o, dim_v - dim0);
      else
        fa2::store_chunk4(out + row * p.out_stride.row + dim0, o, dim_v - dim0);
    }
    if (lane_col == 0) arch::store(lse + row, row_lse);
  }
}

}  // namespace cuflash
