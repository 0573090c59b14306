// FlashAttention-2 backward (Dao 2023, Algorithm 2) on tensor cores: 16-bit operands, float32 accumulation.
//
// The main kernel of the tensor-core backward program; the program's other two kernels are the SIMT fa2 ones
// (fa2_backward.cu): fa2_dout_dot_out_kernel (D = rowsum(dO * O)) before it, fa2_convert_dq_kernel<T, BlockN>
// (dq = scale * sum of the dq_accum slices) after it, with the same dq_accum layout and slice rules.
//
// fa2_tc_backward_kernel<T, D, BlockM, BlockN, Warps>: grid = (X, nheads_k, batch), block x taking the K/V blocks
// x, x + X, ... of one kv head (X = ceil(seqlen_k / BlockN), one K/V block each, or in deterministic mode X =
// num_dq_splits; as in the SIMT backward). Per K/V block (BlockN keys) K_j and V_j are loaded into shared memory
// once, dK_j and dV_j accumulate in registers. It loops over the query heads of its group (GQA/MQA: the group's
// dK/dV sum in a fixed order, on chip) and per head over the Q blocks that see the K/V block (mask.cuh's
// q_blocks; the others are skipped unread). Per Q block i:
//     Q_i, dO_i (cp.async, 16-byte, zero-filled) issued during step i - 1 (pipeline below; a whole block at the
//     compiled head dim by load_whole_tile, unrolled from one source pointer); load lse_i, D_i
//     S = Q_i K_j^T, dP = dO_i V_j^T           mma.m16n8k16; A by ldmatrix, B = K, V stored [key][dim]
//     P = exp2(hook(S) scale log2 e - lse log2 e) (0 where masked), dS = P (dP Z - D) hook'  -> 16-bit, swizzled smem
//     (hook, hook': mask.cuh's ScoreHook and d score / d (scale S): softcap and ALiBi, or flex_hook.cuh's FlexHook,
//     whose score' with a score_mod is exponentiated by log2 e, per tile in one of two forms; Z: dropout.cuh's factor,
//     keep / (1 - dropout_p), 1 without dropout; the P tile holds P Z, the P that multiplied V in the forward)
//     dV_j += P^T dO_i, dK_j += dS^T Q_i        A = P, dS by ldmatrix.trans; B = dO, Q by ldmatrix.trans
//     dQ_i += dS K_j -> float32 dq_accum         A = dS by ldmatrix, B = K by ldmatrix.trans (in column chunks)
//   (every ldmatrix address a lane base, fa2_tc_tiles.cuh's LaneBases, plus an immediate: the bases made once per
//   K/V block and held up to d128, per step above; a whole Q block adds dQ unconditionally from one address per
//   lane, a ragged one tests rows and columns)
//   Where a step's rows start in q, dout, the row statistics and dq_accum (StepRows) is carried from one step to
//   the next: one Q block further within a head, derived again through BlockInfo only when the head changes.
//   dq_accum: zero-initialised slices updated with red.global.add.f32, exactly as in the SIMT backward: one slice
//   all blocks race on (atomic mode), or slice x added to only by block x, each element by the one thread owning
//   it, in program order (deterministic mode).
//   After each K/V block dK_j * scale and dV_j are rounded to T, staged through the K and V buffers and written in
//   16-byte chunks.
// Varlen (block_info.cuh): the grid spans the longest sequence; a block runs no K/V block past its sequence's keys
// (the loop's test, block-uniform, before any barrier); the sequence's offsets enter through StepRows and its
// query count is read once per K/V block.
// Warps: each product is tiled over all Warps warps as WarpsM x WarpsN warp tiles of whole 16-row strips and
// pairs of n8 tiles (WarpTiling below; the S/dP, dK/dV and dQ tilings differ). dK/dV stay in the registers of
// the warps that own them for a whole K/V block.
//
// Shared memory (16-bit, XOR-swizzled, fa2_tc_tiles.cuh): K, V [BlockN][D]; two Q buffers and dO [BlockM][D];
// P, dS [BlockM][BlockN]; float32 lse, D [BlockM]:
//   2 (2 BlockN D + 3 BlockM D + 2 BlockM BlockN) + 8 BlockM bytes.
// Pipeline (FA2's): Q is double-buffered, so Q_{i+1} loads during all of step i; dO_{i+1} loads into dO's one
// buffer once dV += P^T dO_i has read it, during dK += dS^T Q_i and dQ_i += dS K_j.
//
// What it costs: the global traffic of the SIMT fa2_backward_kernel (see fa2_backward.cu, kernel 2) with these
// tiles: per block, K_j and V_j once, per visited Q block Q_i, dO_i, lse_i, D_i once and dq_accum rows x d
// floats (red.add also reads them); dK_j, dV_j written once. FLOPs: 5 products of 2 M N D each per visited
// (Q block, K/V block) pair.
//
// Masking and empty rows as in the SIMT backward: P = 0 wherever the key is not visible or past the last key,
// and for rows past the last query; lse = -inf (a row that saw no key) is taken as +inf so P = exp2(-inf) = 0.
// P is recomputed as FA2 forms it, exp2(fmaf(S, scale log2 e, -lse log2 e)): one FMA per score. Rounding
// lse log2 e (once per row) costs P a relative error of up to |lse| 2^-24, below the 16-bit rounding P and dS
// take before their products (2^-11 for float16) while |lse| < 2^13; the SIMT backward, for float32 inputs, keeps
// fmaf(S, scale, -lse) * log2 e (see fa2_backward.cu), which cost this kernel a multiply per score (64 per
// 128 x 128 step). Requires softmax_scale > 0.
#include "arch/arch.cuh"
#include "kernels/fa2_tc_tiles.cuh"
#include "kernels/fa2_tiles.cuh"  // fa2::stage_row_stats, shared with the SIMT backward

namespace cuflash {
namespace fa2tc {

// A Rows x Cols product over Warps warps arranged WarpsM x WarpsN (warp w at (w / WarpsN, w % WarpsN)); each warp
// owns MTiles 16-row strips and NTiles n8 tiles (an even number: B fragments come in pairs). Of the counts that
// divide the rows into whole strips and leave each warp an even number of n8 tiles, WarpsM is
//   Square: the one whose warp tile is the squarest: per k16 step a warp issues one ldmatrix.x4 per 16 rows of A
//     and one per 16 columns of B, so it reads the fewest fragments (ties: more warps along the rows). These are
//     FA2's atom layouts (AtomLayoutMSdP, NdKV): at d128 64 x 128 on 8 warps, 32 x 32 S/dP tiles and 32 x 64 dK/dV
//     tiles. With strips of 16 rows the step issued 200 ldmatrix, now 160 (FA2 144; sm_90, NVRTC 13.5): an H200
//     run showed this backward stalled on shared memory (short scoreboard and MIO throttle its top stall reasons,
//     the tensor pipe 29% busy);
//   otherwise: the largest (whole 16-row strips per warp where the rows allow).
__host__ __device__ constexpr int pick_warps_m(int rows, int cols, int warps, bool square = true) {
  int best = 0, best_loads = 0;
  for (int wm = warps; wm >= 1; --wm) {
    if (warps % wm != 0 || rows % (16 * wm) != 0 || cols % (16 * (warps / wm)) != 0) continue;
    const int loads = rows / wm / 16 + cols / (warps / wm) / 16;
    if (best == 0 || (square && loads < best_loads)) best = wm, best_loads = loads;
  }
  return best;
}

template <int Rows, int Cols, int Warps, bool Square = true>
struct WarpTiling {
  static constexpr int kWarpsM = pick_warps_m(Rows, Cols, Warps, Square);
  static_assert(kWarpsM > 0, "no warp tiling of whole strips and n8-tile pairs for this product");
  static constexpr int kWarpsN = Warps / kWarpsM;
  static constexpr int kRowsPerWarp = Rows / kWarpsM;
  static constexpr int kColsPerWarp = Cols / kWarpsN;
  static constexpr int kMTiles = kRowsPerWarp / 16;
  static constexpr int kNTiles = kColsPerWarp / 8;
  __device__ __forceinline__ static int m0(int warp) { return (warp / kWarpsN) * kRowsPerWarp; }
  __device__ __forceinline__ static int n0(int warp) { return (warp % kWarpsN) * kColsPerWarp; }
};

template <int HeadDim, int BlockM, int BlockN, int Warps>
struct BackwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kThreads = Warps * 32;

  using SdP = WarpTiling<BlockM, BlockN, Warps>;   // S, dP, P, dS
  using DkDv = WarpTiling<BlockN, HeadDim, Warps>;  // dK, dV
  // dQ keeps whole strips: its column chunks (below) are live beside dK and dV, and a square tile's chunk holds
  // twice the accumulators; square, d128 64 x 128 spilled 4 bytes on sm_80 (NVRTC 13.5) for 8 ldmatrix a step.
  using Dq = WarpTiling<BlockM, HeadDim, Warps, false>;
  // dQ_i is computed in column chunks of kDqChunkTiles n8 tiles per warp: a chunk's accumulators are live beside
  // dK and dV. 4, or 8 at d256 on 8 warps (dK and dV hold 16 n8 tiles per warp each): the settings at which the
  // compile report shows every instance spill-free on every target (whole rows spilled 4 to 24 bytes at d128 and
  // d256 once varlen's sequence offsets took their registers; chunks of 4 spilled d256 on 8 warps). That one
  // setting depends on the compiler: NVRTC 12.9's ptxas spills the chunks of 8 (12 bytes on sm_80) and fits
  // chunks of 4, which NVRTC 13.5's spills (4 bytes on sm_80/86/89). d128's 64 x 128 (dK and dV 16 n8 tiles each
  // too) takes 4 under both: with 8, NVRTC 13 spilled 8 bytes on sm_90. The results do not depend on it: each dQ
  // element is the same products summed in the same order either way.
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ < 13
  static constexpr bool kWideDqChunks = false;
#else
  static constexpr bool kWideDqChunks = true;
#endif
  static constexpr int kDqChunkTiles =
      kWideDqChunks && HeadDim == 256 && Dq::kNTiles == 8 && DkDv::kNTiles == 16 ? 8 : 4;
  static constexpr int kDqChunks = Dq::kNTiles > kDqChunkTiles ? Dq::kNTiles / kDqChunkTiles : 1;
  // The per-step Q and dO copies step their rows (fa2_tc_tiles.cuh's load_tile) except at head dim 256, where
  // the stepped loop's extra registers made ptxas spill 4 bytes on sm_90 beside dK and dV.
  static constexpr bool kStepQRows = HeadDim < 256;
  // Whole Q and dO blocks (every row, the compiled head dim, 16-byte rows; block-uniform) are copied by
  // load_whole_tile: a thread's cp.async unrolled from one source pointer per column part (two at d96 and d192,
  // whose 12 and 24 chunks per row divide no thread count: WholeTileCopy), shared offsets immediates. With the two
  // parts the census's step (sm_80) fell from 727 to 546 instructions at d96 (64 x 64) and 729 to 549 at d192.
  static constexpr bool kWholeQCopies = WholeTileCopy<SwizzledTile<BlockM, HeadDim>, kThreads>::kAvailable;
  static_assert(Dq::kNTiles % kDqChunks == 0, "whole chunks");
  // Whether the lanes' ldmatrix bases (BackwardLaneBases, 4 sets of up to 4 registers) are made once per K/V block
  // and held through its steps, pinned, or made again in every step from the thread index (about 90 instructions a
  // step at d128). Held up to head dim 128, where the kernel has the registers (sm_80, NVRTC 13: d128 64 x 64 190
  // before, 206 held; 64 x 128 254 held, spill-free; with dQ chunks of 8 it spilled on sm_90 8 bytes held and 20
  // rebuilt: rebuilding them needs registers too); at d192 and d256 it runs near the limit.
  static constexpr bool kHoldLaneBases = HeadDim <= 128;
  // Whether P and dS are stored from one per-lane base (fa2_tc_tiles.cuh's AccPairOffsets: 7 instructions for the
  // 32 stores of a 64 x 128 step, against about 60 through element_offset). Not at d256, where its register made
  // ptxas spill 16 to 48 bytes (32 x 64 on 8 warps, sm_80 and sm_90, at 255 registers already).
  static constexpr bool kStorePairsFromBase = HeadDim < 256;
  // How a masked step without a score hook hides scores: by the edges its tile crosses (fa2_tc_tiles.cuh's
  // mask_tile on S, -inf before the exponent, as the forward: a compare per crossed edge and diagonal against a
  // per-lane limit, a select per score), or per score in P's loop (MaskPolicy::visible: each key formed and compared
  // with both limits, about four instructions a score). By edges everywhere since the square warp tiles: the masked
  // step issued (NVRTC 13.5) d64 128 x 128 x 8 1227 instructions for 320 HMMA on sm_80 and 1251 on sm_90 where it
  // issued 1369 and 1389 per score, d128 64 x 128 x 8 1002 and 1022 where 1070 and 1092, d256 672 and 710 where
  // 682 and 716; the compile report spill-free under NVRTC 13.5 and 12.9 (before the square tiles, 12.9 spilled
  // d128's step on sm_90 44 bytes this way). Kept as a switch: the per-score form is what a step with a score hook
  // runs (the hook first, then the mask: softcap of -inf is not -inf).
  static constexpr bool kMaskByEdges = true;

  using KVTile = SwizzledTile<BlockN, HeadDim>;
  using QTile = SwizzledTile<BlockM, HeadDim>;
  using PTile = SwizzledTile<BlockM, BlockN>;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + KVTile::kBytes;
  static constexpr int kQOffset = kVOffset + KVTile::kBytes;
  static constexpr int kQ1Offset = kQOffset + QTile::kBytes;  // Q's second buffer (the next step's Q block)
  static constexpr int kDoOffset = kQ1Offset + QTile::kBytes;
  static constexpr int kPOffset = kDoOffset + QTile::kBytes;
  static constexpr int kDsOffset = kPOffset + PTile::kBytes;
  static constexpr int kLseOffset = kDsOffset + PTile::kBytes;
  static constexpr int kDotOffset = kLseOffset + 4 * BlockM;
  static constexpr int kSmemBytes = kDotOffset + 4 * BlockM;

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static_assert(BlockM % 16 == 0 && BlockN % 32 == 0 && BlockM <= kThreads, "tile shape");
};

// The lanes' ldmatrix bases of the backward's products (with them every ldmatrix address is a register plus an
// immediate): S = Q K^T and dP = dO V^T (Q and dO share a layout, so do K and V) with the warp's first row and
// key folded in; dV += P^T dO and dK += dS^T Q, read transposed (P and dS share a layout, so do dO and Q) with the
// warp's first key and dim; dQ = dS K, the warp's first row of dS and K's first column of the warp's dQ tile (its
// later column chunks shift these: LaneBases::shifted).
template <class Tr>
struct BackwardLaneBases {
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  using PTile = typename Tr::PTile;
  LaneBases<QTile> s_a;
  LaneBases<KVTile> s_b;
  LaneBases<PTile> t_a;
  LaneBases<QTile> t_b;
  LaneBases<PTile> dq_a;
  LaneBases<KVTile> dq_b;

  __device__ __forceinline__ static BackwardLaneBases of(int warp, int lane) {
    using SdP = typename Tr::SdP;
    using DkDv = typename Tr::DkDv;
    using Dq = typename Tr::Dq;
    return BackwardLaneBases{
        LaneBases<QTile>::of(a_row_lane<QTile>(lane), SdP::m0(warp) * QTile::kRowBytes),
        LaneBases<KVTile>::of(pair_lane<KVTile>(lane), SdP::n0(warp) * KVTile::kRowBytes),
        LaneBases<PTile>::of(pair_lane<PTile>(lane), 0, DkDv::m0(warp) / kChunkElems),
        LaneBases<QTile>::of(b_kn_lane<QTile>(lane), 0, DkDv::n0(warp) / kChunkElems),
        LaneBases<PTile>::of(a_row_lane<PTile>(lane), Dq::m0(warp) * PTile::kRowBytes),
        LaneBases<KVTile>::of(b_kn_lane<KVTile>(lane), 0, Dq::n0(warp) / kChunkElems)};
  }
  __device__ __forceinline__ BackwardLaneBases pinned(int lane) const {
    return BackwardLaneBases{s_a.pinned(lane), s_b.pinned(lane), t_a.pinned(lane),
                             t_b.pinned(lane), dq_a.pinned(lane), dq_b.pinned(lane)};
  }
};

// Where a step's Q block starts in what the step reads (q, dout, the row statistics lse and D) and adds to (its
// dq_accum slice). Held from one step to the next: within a head the next step's block is BlockM rows further,
// four additions; only at a head change is it derived again through BlockInfo (the tensors' strides, varlen's
// sequence offsets), so a steady-state step does no address arithmetic from the strides and no alignment test.
// q and dout point at this thread's first chunk of a whole-block copy (load_whole_tile's row and column; row 0,
// column 0 where the traits copy no whole blocks); any other copy steps back to the block's row 0.
template <class Tr, class T>
struct StepRows {
  using QTile = typename Tr::QTile;
  const T* q;
  const T* dout;
  long long stats;   // the block's row 0 in the row statistics
  float* dq;         // the block's row 0, column 0 in dq_accum's slice
  bool q_vector;     // the rows 16-byte aligned (rows_16b_aligned: a block's start is exactly when its head's is)
  bool dout_vector;

  __device__ __forceinline__ static long long thread_offset(long long row_stride, int thread) {
    if constexpr (Tr::kWholeQCopies)
      return whole_tile_row<QTile, Tr::kThreads>(thread) * row_stride +
             whole_tile_column<QTile, Tr::kThreads>(thread);
    else
      return 0;
  }
  __device__ __forceinline__ static StepRows of(const AttentionParams& p, const BlockInfo& info, int row0, int slice,
                                                int thread) {
    const T* q_rows = info.q<T>(p) + row0 * p.q_stride.row;
    const T* dout_rows = info.dout<T>(p) + row0 * p.dout_stride.row;
    return StepRows{q_rows + thread_offset(p.q_stride.row, thread),
                    dout_rows + thread_offset(p.dout_stride.row, thread),
                    info.row_stats_offset(p) + row0,
                    info.dq_accum(p, slice) + row0 * BlockInfo::dense_row_stride(p),
                    rows_16b_aligned(q_rows, p.q_stride.row),
                    rows_16b_aligned(dout_rows, p.dout_stride.row)};
  }
  __device__ __forceinline__ StepRows advanced(const AttentionParams& p, int rows) const {
    return StepRows{q + rows * p.q_stride.row, dout + rows * p.dout_stride.row, stats + rows,
                    dq + rows * BlockInfo::dense_row_stride(p), q_vector, dout_vector};
  }
};

}  // namespace fa2tc

// WithDropout: a template flag, as in the tensor-core forward (a runtime flag spilled the instances without it).
// Hook: the per-score transform (mask.cuh's ScoreHook; flex_hook.cuh's FlexHook for a user's mods).
template <class T, int HeadDim, int BlockM, int BlockN, int Warps, bool WithDropout = false, class Hook = ScoreHook>
__global__ void __launch_bounds__(Warps * 32, 1) fa2_tc_backward_kernel(const AttentionParams p) {
  static_assert(arch::is_mma_operand<T>::value, "the tensor-core backward takes __half or __nv_bfloat16");
  using Tr = fa2tc::BackwardTraits<HeadDim, BlockM, BlockN, Warps>;
  using SdP = typename Tr::SdP;
  using DkDv = typename Tr::DkDv;
  using Dq = typename Tr::Dq;
  using KVTile = typename Tr::KVTile;
  using QTile = typename Tr::QTile;
  using PTile = typename Tr::PTile;

  CUFLASH_DYNAMIC_SMEM(smem);
  // Deterministic mode runs one block per slice along x.
  if (fa2tc::launch_shape_differs<Tr::kSmemBytes, Tr::kThreads, HeadDim>(p) ||
      (p.num_dq_splits > 1 && p.num_dq_splits != static_cast<int>(gridDim.x)))
    __trap();
  unsigned char* k_tile = smem + Tr::kKOffset;
  unsigned char* v_tile = smem + Tr::kVOffset;
  unsigned char* do_tile = smem + Tr::kDoOffset;
  unsigned char* p_tile = smem + Tr::kPOffset;
  unsigned char* ds_tile = smem + Tr::kDsOffset;
  float* lse_rows = reinterpret_cast<float*>(smem + Tr::kLseOffset);
  float* dot_rows = reinterpret_cast<float*>(smem + Tr::kDotOffset);

  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo kv_info = BlockInfo::of_group(p, batch, kv_head, 0);
  // The thread index is read back from a volatile local at each K/V block and each step, so that nothing derived
  // from it (the K/V copy, ldmatrix and dK/dV staging addresses) is hoisted out of those loops and held through the
  // products: hoisted out of the K/V loop, they cost 20 to 30 registers and spilled at head dim 256; re-read, they
  // cost a local load (an L1 hit) and a few integer instructions per step, and fewer registers than before the
  // K/V loop (d128 on sm_80: 226 without the loop, 255 with it, 217 re-read). The ldmatrix bases, where the traits
  // hold them (kHoldLaneBases), are made from it once per K/V block and pinned (LaneBases::pinned).
  volatile unsigned thread_index = threadIdx.x;
  const int d = p.headdim;         // q's, k's and their gradients' columns
  const int dim_v = p.headdim_v;  // v's, dO's and dV's (attention_params.cuh)
  const int group = BlockInfo::group_size(p);
  const float softmax_scale = p.softmax_scale;
  const float scale_log2 = p.softmax_scale_log2;

  // This block's K/V blocks: just blockIdx.x in atomic mode, every gridDim.x-th in deterministic mode. The test is
  // block-uniform and made before an iteration's barriers; varlen: a block past its sequence's keys runs none.
#pragma unroll 1
  for (int n_block = blockIdx.x; n_block * BlockN < kv_info.seqlen_k(p); n_block += gridDim.x) {
    const int key0 = n_block * BlockN;
    const int tid = thread_index % Tr::kThreads;  // unsigned, bounded: the divisions below are shifts
    const int warp = tid / 32;
    const int lane = tid % 32;
    // The sequence's lengths are re-read where used (block_info.cuh): nothing derived from them stays live.
    auto block_keys = [&] { return min(BlockN, kv_info.seqlen_k(p) - key0); };
    __syncthreads();  // everyone is done with the previous K/V block's K and V buffers (its dK and dV staging)

    const T* k = kv_info.k<T>(p) + key0 * p.k_stride.row;
    const T* v = kv_info.v<T>(p) + key0 * p.v_stride.row;
    fa2tc::load_tile<KVTile, Tr::kThreads>(k_tile, k, p.k_stride.row, block_keys(), d,
                                           fa2tc::rows_16b_aligned(k, p.k_stride.row), tid);
    fa2tc::load_tile<KVTile, Tr::kThreads>(v_tile, v, p.v_stride.row, block_keys(), dim_v,
                                           fa2tc::rows_16b_aligned(v, p.v_stride.row), tid);
    arch::cp_async_commit();

    fa2tc::Accumulator<DkDv::kMTiles, DkDv::kNTiles> acc_dk, acc_dv;
    acc_dk.zero();
    acc_dv.zero();

    // The steps: the group's heads, each over the Q blocks that see the K/V block (the same blocks for every head of
    // the group: one sequence, one mask).
    const IndexRange m_range = MaskPolicy::of(p, kv_info).q_blocks<BlockM>(key0, key0 + block_keys());
    // The Q blocks visited: those of m_range, or a block mask's list (flex_hook.cuh), the same for the group's heads;
    // a step's position in it (without a block mask the position is the Q block itself).
    const auto visits = Hook::q_visits(p, batch, kv_head, n_block, m_range);
    const int steps = group * max(visits.end - visits.begin, 0);
    // A step is (query head, Q block), heads outer from the group's first head; the next step's, from this one's by
    // a compare (no division by the runtime number of Q blocks or by the group size in the loop), and so are its
    // rows (StepRows). The sequence's query count is the same for every head.
    const int slice = p.num_dq_splits > 1 ? blockIdx.x : 0;  // block x's own in deterministic mode, else the one
    using Rows = fa2tc::StepRows<Tr, T>;
    auto rows_of = [&](int head, int m_block) {
      return Rows::of(p, BlockInfo::of_group_head(batch, kv_head, head), m_block * BlockM, slice, tid);
    };
    const int seqlen_q = kv_info.seqlen_q(p);
    auto rows_in = [&](int m_block) { return min(BlockM, seqlen_q - m_block * BlockM); };
    // Copies of a Q or dO block (from: StepRows' q or dout) into dst.
    auto copy_rows = [&](unsigned char* dst, const T* from, long long stride, bool vector, int rows, int cols) {
      if (Tr::kWholeQCopies && vector && rows == BlockM && cols == HeadDim) {
        if constexpr (Tr::kWholeQCopies) fa2tc::load_whole_tile<QTile, Tr::kThreads>(dst, from, stride, tid);
      } else {
        fa2tc::load_tile<QTile, Tr::kThreads, Tr::kStepQRows>(dst, from - Rows::thread_offset(stride, tid), stride,
                                                              rows, cols, vector, tid);
      }
    };
    // Q's two buffers alternate: step i reads the one at q_offset, the next Q block lands in the other (q_offset
    // flips by an XOR per step instead of a select on the step's parity).
    int q_offset = Tr::kQOffset;
    constexpr int kOtherQBuffer = Tr::kQOffset ^ Tr::kQ1Offset;
    int head = kv_info.head, m_block = visits.tile(visits.begin), visit = visits.begin;  // this step's
    Rows rows = rows_of(head, m_block);
    if (steps > 0) {
      copy_rows(smem + q_offset, rows.q, p.q_stride.row, rows.q_vector, rows_in(m_block), d);
      copy_rows(do_tile, rows.dout, p.dout_stride.row, rows.dout_vector, rows_in(m_block), dim_v);
    }
    arch::cp_async_commit();

    const int s_m0 = SdP::m0(warp), s_n0 = SdP::n0(warp);
    using LaneBasesOfProducts = fa2tc::BackwardLaneBases<Tr>;
    LaneBasesOfProducts held_bases;
    if constexpr (Tr::kHoldLaneBases) held_bases = LaneBasesOfProducts::of(warp, lane).pinned(lane);
    // Step i issues Q_{i+1} at its start and dO_{i+1} after dV (the pipeline in the header); step i + 1 waits for
    // just those two copy groups.
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      const int tid = thread_index % Tr::kThreads;  // unsigned, bounded: the divisions below are shifts
      const int warp = tid / 32;
      const int lane = tid % 32;
      const LaneBasesOfProducts bases = Tr::kHoldLaneBases ? held_bases : LaneBasesOfProducts::of(warp, lane);
      const BlockInfo info = BlockInfo::of_group_head(batch, kv_head, head);
      const int row0 = m_block * BlockM;
      auto block_rows = [&] { return rows_in(m_block); };
      unsigned char* q_tile = smem + q_offset;
      // The next step's head, Q block and rows.
      const int position = Hook::kBlockSparse ? visit : m_block;
      const bool head_ends = position + 1 == visits.end;
      const int next_position = head_ends ? visits.begin : position + 1;
      const int next_m_block = Hook::kBlockSparse ? visits.tile(next_position) : next_position;
      const Rows next = head_ends             ? rows_of(head + 1, next_m_block)
                        : Hook::kBlockSparse ? rows_of(head, next_m_block)  // not the next block: found anew
                                             : rows.advanced(p, BlockM);
      // Everyone is done with the previous step's P, dS, lse, D and its Q buffer (read by dK += dS^T Q), which
      // the next Q block now fills.
      __syncthreads();
      if (step + 1 < steps)
        copy_rows(smem + (q_offset ^ kOtherQBuffer), next.q, p.q_stride.row, next.q_vector, rows_in(next_m_block), d);
      arch::cp_async_commit();  // possibly empty: the waits below count groups
      fa2::stage_row_stats<BlockM>(p, rows.stats, block_rows(), tid, lse_rows, dot_rows);
      arch::cp_async_wait<1>();  // all but Q_{i+1}: Q_i, dO_i (and K_j, V_j at the first step)
      __syncthreads();           // ... landed for every thread; lse, D visible to all

      // S = Q K^T, dP = dO V^T for this warp's tile; P and dS into shared memory as T.
      {
        fa2tc::Accumulator<SdP::kMTiles, SdP::kNTiles> s, dp;
        s.zero();
        dp.zero();
        {
          constexpr int kM = SdP::kMTiles, kN = SdP::kNTiles;
          fa2tc::gemm_ss<T, false, false, QTile, KVTile, kM, kN, HeadDim>(s, q_tile, bases.s_a, k_tile, bases.s_b);
          fa2tc::gemm_ss<T, false, false, QTile, KVTile, kM, kN, HeadDim>(dp, do_tile, bases.s_a, v_tile, bases.s_b);
        }
        const MaskPolicy mask = MaskPolicy::of(p, info);
        const bool masked = mask.tile_needs_mask(row0, block_rows(), key0, BlockN);
        // Made here, not per head: its slope then lives only through this loop (the kernel runs at the register
        // limit), for one cached load per Q block.
        const Hook score_hook = Hook::of(p, info).for_tile(visits.full(position));
        // P and dS of this warp's tile, called from one site per outcome of the block-uniform tests (whether the hook
        // changes anything and then whether it tests the sequence bounds, whether the tile needs the element-wise mask)
        // with those outcomes as constants: inlined, each copy is compiled for its case (tests/test_fa2_tc.py finds the
        // plain one branch-free in SASS). Tested per score instead, ptxas kept both tests in the loop: every score sat
        // behind its own branches. Hooked, the scores are the hook's: with the per-score sequence-bound test where
        // `bounds` (a flex hook's tests_bounds: tiles crossing the sequence's end), the scaled score itself where the
        // hook gives it (kScaledScores: exponent factor log2 e, no product by 1 / scale per score). (A lambda with
        // template parameters would say it directly, or the hook's on_tile with a generic lambda: NVRTC 12 refuses the
        // first in device code and takes the second's call operator for a host function.)
        // Where this lane's pairs of P and dS go (the two tiles share a layout): a base and an XOR per n8 tile
        // (BackwardTraits::kStorePairsFromBase).
        const auto stores = fa2tc::AccPairOffsets<PTile, SdP::kNTiles>::of(s_m0, s_n0, lane);
        const float hooked_exponent_factor = Hook::kScaledScores ? kLog2e : scale_log2;
        auto p_and_ds = [&](bool hooked, bool bounds, bool tile_masked) {
#pragma unroll
          for (int i = 0; i < SdP::kMTiles; ++i) {
            // Dropout's keep bits of this strip, one Philox evaluation per n8 tile (dropout.cuh; unused without it).
            unsigned keep_bits[SdP::kNTiles];
            if (WithDropout) {
              const Dropout dropout = Dropout::of(p, batch, info.head);
#pragma unroll
              for (int j = 0; j < SdP::kNTiles; ++j)
                keep_bits[j] =
                    dropout.keep_bits(row0 + s_m0 + fa2tc::acc_row(lane, i, 0), key0 + s_n0 + fa2tc::acc_col(lane, j));
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int r = s_m0 + fa2tc::acc_row(lane, i, half);
              const float lse_log2 = lse_rows[r] * kLog2e;  // P's exponent offset, base 2 (the header: why)
              const float dot = dot_rows[r];
#pragma unroll
              for (int j = 0; j < SdP::kNTiles; ++j) {
                const int c = s_n0 + fa2tc::acc_col(lane, j);
                float prob[2], grad[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  float dscore = 1.f;  // d score / d (scale q.k)
                  const float x = s.c[i][j][2 * half + e];
                  const float qk =
                      !hooked  ? x
                      : bounds ? score_hook.template score<true, Hook::kScaledScores>(x, row0 + r, key0 + c + e, dscore)
                               : score_hook.template score<false, Hook::kScaledScores>(x, row0 + r, key0 + c + e,
                                                                                       dscore);
                  prob[e] = arch::exp2_approx(fmaf(qk, hooked ? hooked_exponent_factor : scale_log2, -lse_log2));
                  if (tile_masked && !mask.visible(row0 + r, key0 + c + e)) prob[e] = 0.f;
                  if (WithDropout) {  // Z = keep / (1 - dropout_p): P Z multiplied V, so dP = dO V^T Z
                    const float kept = (keep_bits[j] >> (2 * half + e)) & 1u ? p.dropout_rescale : 0.f;
                    grad[e] = (prob[e] * dscore) * (dp.c[i][j][2 * half + e] * kept - dot);
                    prob[e] *= kept;
                  } else {
                    grad[e] = (prob[e] * dscore) * (dp.c[i][j][2 * half + e] - dot);
                    // Gradients to a score_mod's side arrays: d loss / d score' = P (dP - D) (by every lane: the
                    // hook skips P = 0).
                    if constexpr (Hook::kHasSideGrads)
                      if (hooked)
                        score_hook.side_grads(prob[e] * (dp.c[i][j][2 * half + e] - dot), s.c[i][j][2 * half + e],
                                              row0 + r, key0 + c + e);
                  }
                }
                const int at = Tr::kStorePairsFromBase ? stores.at(i, half, j) : PTile::element_offset(r, c);
                *reinterpret_cast<unsigned*>(p_tile + at) = arch::pack_float2<T>(prob[0], prob[1]);
                *reinterpret_cast<unsigned*>(ds_tile + at) = arch::pack_float2<T>(grad[0], grad[1]);
              }
            }
          }
        };
        // The mask: by the edges the tile crosses, on S (BackwardTraits::kMaskByEdges), or per score with P. A hook
        // that leaves this tile's scores as they are (a flex mask_mod alone on a block mask's full tile) takes the
        // unhooked step.
        if (score_hook.active() && !score_hook.idle_on(visits.full(position), row0, BlockM, key0, BlockN)) {
          // The hook first, then the mask: per score (softcap of -inf is not -inf).
          // A copy per case of the hook's parts where registers allow (ScoreHook::in_tile_cases).
          if (score_hook.tests_bounds(row0, BlockM, key0, BlockN))
            p_and_ds(true, true, masked);
          else if constexpr (HeadDim <= 64)
            score_hook.in_tile_cases([&] { p_and_ds(true, false, masked); });
          else
            p_and_ds(true, false, masked);
        } else if constexpr (Tr::kMaskByEdges) {
          if (masked)
            fa2tc::mask_tile(s, mask, mask.tile_edges(row0, block_rows(), key0, BlockN), row0 + s_m0, key0 + s_n0,
                             lane);
          p_and_ds(false, false, false);  // a hidden score's P is exp2(-inf) = 0 (a row that sees no key has lse +inf)
        } else if (masked) {
          p_and_ds(false, false, true);
        } else {
          p_and_ds(false, false, false);
        }
      }
      __syncthreads();  // P, dS complete

      // dV += P^T dO_i; once every warp has read dO_i, the next step's dO copy is issued into its buffer; then
      // dK += dS^T Q_i over this Q block's rows.
      // Both products read their operands transposed.
      fa2tc::gemm_ss<T, true, true, PTile, QTile, DkDv::kMTiles, DkDv::kNTiles, BlockM>(acc_dv, p_tile, bases.t_a,
                                                                                       do_tile, bases.t_b);
      __syncthreads();
      if (step + 1 < steps)
        copy_rows(do_tile, next.dout, p.dout_stride.row, next.dout_vector, rows_in(next_m_block), dim_v);
      arch::cp_async_commit();
      fa2tc::gemm_ss<T, true, true, PTile, QTile, DkDv::kMTiles, DkDv::kNTiles, BlockM>(acc_dk, ds_tile, bases.t_a,
                                                                                       q_tile, bases.t_b);

      // dQ_i += dS K_j, straight into dq_accum (unscaled; the convert kernel applies the scale), one column chunk
      // at a time (BackwardTraits::kDqChunkTiles; the dS fragments are re-read from shared memory per chunk). A Q
      // block with every row at the compiled head dim (block-uniform) adds every element unconditionally, from one
      // row base per strip; a ragged block tests rows and columns.
      const bool dq_whole = block_rows() == BlockM && d == HeadDim;
      // This lane's first dQ element (row acc_row(lane, 0, 0), column acc_col(lane, 0) of the warp's tile): one
      // address per step; chunks, strips, halves and n8 tiles add row strides and immediates to it.
      const long long row_stride = BlockInfo::dense_row_stride(p);
      float* const dq_lane =
          rows.dq + (Dq::m0(warp) + fa2tc::acc_row(lane, 0, 0)) * row_stride + Dq::n0(warp) + fa2tc::acc_col(lane, 0);
      // The chunks unrolled: each chunk's column offset is a constant, so its ldmatrix bases are K's first chunk's,
      // shifted, and its dq_accum addresses immediates from dq_lane.
#pragma unroll
      for (int chunk = 0; chunk < Tr::kDqChunks; ++chunk) {
        constexpr int kChunkTiles = Dq::kNTiles / Tr::kDqChunks;
        const int chunk_col = chunk * 8 * kChunkTiles;  // the chunk's first column in the warp's dQ tile
        const int n0 = Dq::n0(warp) + chunk_col;
        fa2tc::Accumulator<Dq::kMTiles, kChunkTiles> dq;
        dq.zero();
        fa2tc::gemm_ss<T, false, true, PTile, KVTile, Dq::kMTiles, kChunkTiles, BlockN>(
            dq, ds_tile, bases.dq_a, k_tile, bases.dq_b.shifted(chunk_col / fa2tc::kChunkElems));
        float* const dq_rows = dq_lane + chunk_col;
        if (dq_whole) {
#pragma unroll
          for (int i = 0; i < Dq::kMTiles; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
              for (int j = 0; j < kChunkTiles; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                  arch::atomic_add(dq_rows + (16 * i + 8 * half) * row_stride + 8 * j + e, dq.c[i][j][2 * half + e]);
        } else {
#pragma unroll
          for (int i = 0; i < Dq::kMTiles; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int r = Dq::m0(warp) + fa2tc::acc_row(lane, i, half);
              if (r >= block_rows()) continue;
#pragma unroll
              for (int j = 0; j < kChunkTiles; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  if (n0 + fa2tc::acc_col(lane, j) + e >= d) continue;
                  arch::atomic_add(dq_rows + (16 * i + 8 * half) * row_stride + 8 * j + e, dq.c[i][j][2 * half + e]);
                }
            }
        }
      }
      head += head_ends;
      m_block = next_m_block;
      visit = next_position;
      rows = next;
      q_offset ^= kOtherQBuffer;
    }

    // dK_j = scale * sum dS^T Q, dV_j = sum P^T dO (over the group's heads): rounded to T into the K and V buffers
    // (every warp is done reading them after the barrier; the wait covers a block that visited no Q block and so
    // never waited for its K/V copies), then 16-byte stores.
    arch::cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int i = 0; i < DkDv::kMTiles; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = DkDv::m0(warp) + fa2tc::acc_row(lane, i, half);
#pragma unroll
        for (int j = 0; j < DkDv::kNTiles; ++j) {
          const int col = DkDv::n0(warp) + fa2tc::acc_col(lane, j);
          const float* dk_pair = &acc_dk.c[i][j][2 * half];
          const float* dv_pair = &acc_dv.c[i][j][2 * half];
          *reinterpret_cast<unsigned*>(k_tile + KVTile::element_offset(key, col)) =
              arch::pack_float2<T>(dk_pair[0] * softmax_scale, dk_pair[1] * softmax_scale);
          *reinterpret_cast<unsigned*>(v_tile + KVTile::element_offset(key, col)) =
              arch::pack_float2<T>(dv_pair[0], dv_pair[1]);
        }
      }
    __syncthreads();
    T* dk = kv_info.dk<T>(p) + key0 * p.dk_stride.row;
    T* dv = kv_info.dv<T>(p) + key0 * p.dv_stride.row;
    fa2tc::store_tile<KVTile>(dk, p.dk_stride.row, k_tile, 0, BlockN, block_keys(), d, tid, Tr::kThreads);
    fa2tc::store_tile<KVTile>(dv, p.dv_stride.row, v_tile, 0, BlockN, block_keys(), dim_v, tid, Tr::kThreads);
  }
}

}  // namespace cuflash
