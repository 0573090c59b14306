// FlashAttention-2 forward (Dao 2023, Algorithm 1) on tensor cores: 16-bit Q, K, V, float32 math.
//
// What it does: out = softmax(scale * Q K^T [masked]) V and lse = logsumexp of the scaled scores, per (batch,
// query head), for __half and __nv_bfloat16 (float32 inputs keep the SIMT kernel, fa2_forward.cu).
//
// How it partitions work
//   grid  = (ceil(seqlen_q / BlockM), nheads, batch): one thread block per Q block of one head; query head h
//           reads kv head h / (nheads / nheads_k) (block_info.cuh).
//           Varlen (block_info.cuh): the grid spans the longest sequence and a block past its own sequence's
//           rows returns at once; lengths and offsets are re-read where used (none held through the K/V loop).
//   block = Warps x 32 threads; warp w owns the 16 MTiles query rows w * 16 MTiles .. of the Q block (whole
//           m16 MMA strips) for the whole kernel, so its softmax statistics never leave its registers and a
//           row's max and sum need only the 4 lanes of a quad (2 xor-shuffles).
//   Per visible K/V block, last to first (mask.cuh gives the range; the masked blocks at the diagonal and the
//   ragged end come first; a block-uniform test against the blocks that need no mask, found once before the loop
//   (mask.cuh's unmasked_kv_blocks: exactly those where its tile_needs_mask is false), keeps the
//   element-wise mask code off every other block):
//     S = Q K_j^T   mma.m16n8k16, A = Q by ldmatrix.x4, B = K by ldmatrix.x4 (K is stored [key][dim]: B^T);
//                   every ldmatrix address a lane base (fa2_tc_tiles.cuh's LaneBases, made once) plus an immediate;
//     mask (only blocks that need it, mask.cuh's tile test; one pass per edge of the band the tile crosses, each
//     score compared by its diagonal with a per-lane limit: mask.cuh's LaneTileMask),
//     online softmax in base 2 with the scale folded into
//     one FMA (p = exp2(s * scale_log2 - offset)), l and O rescaled by exp2(offset_old - offset_new);
//     O += P V_j    P is S's accumulator rounded to 16 bits and re-read as A fragments (never in shared
//                   memory); B = V by ldmatrix.x4.trans from V stored [key][dim].
//   Pipelining (FA2's): one Q, one K and one V buffer; cp.async of V_j is in flight during Q K_j^T, and of
//   K_{j-1} during the softmax and P V_j. Each step has two barriers: the first publishes K_j (and makes the
//   V buffer free), the second publishes V_j (and makes the K buffer free).
//   Copies: a K or V block with every key row, on 16-byte aligned rows at the compiled head dim, contiguous or in
//   one page of a paged cache, goes through load_whole_tile (each thread's cp.async unrolled from one source
//   pointer, shared offsets immediates: FA2's LDGSTS; the pointer carried from block to block, or looked up in the
//   block's page; at d96 and d192 one pointer per column part, WholeTileCopy); ragged or misaligned blocks, pages
//   smaller than a block and other head dims through load_tile. The test is block-uniform.
//   Epilogue: O / l rounded to 16 bits into the warp's own rows of the Q buffer (only this warp ever read
//   them), then 16-byte coalesced stores; lse = m * scale + log(l).
//   Split-KV (KV-cache decoding, p.num_kv_splits > 1): grid.x is (Q blocks) x splits; block x takes Q block
//   x / splits and only the K/V blocks of split x % splits (mask.cuh's split_kv_blocks), and writes its O / l and
//   lse in float32 to out_accum and lse_accum straight from the accumulators; fa2_split_kv_combine.cu merges the
//   splits. A runtime field, not a template flag: it only changes the block range and the epilogue, outside the
//   register-bound K/V loop (the compile report shows no instance grew).
//
// Shared memory: Q [BlockM][D], K [BlockN][D], V [BlockN][D], 16-bit, XOR-swizzled (fa2_tc_tiles.cuh):
//   (BlockM + 2 BlockN) * D * 2 bytes. Registers per thread: O is 4 MTiles D / 8 floats, S 4 MTiles BlockN / 8.
//
// What it costs, per launch (es = 2, d = headdim, M = BlockM, N = BlockN), as the SIMT forward: for each Q block
// that sees a key, rows_i * d * es of Q and 2 * keys_i * d * es of K and V (the keys of its visible blocks,
// clipped at seqlen_k), once; out and lse written once. Without a mask: B H Sq d es + 2 B H ceil(Sq / M) Sk d es.
// Zero-filled rows and columns (past seqlen, past d) are never read from global memory (cp.async src-size).
// FLOPs: 4 B H Sq Sk D (D = the compiled head dim), about half with causal.
//
// Masks and empty rows as in fa2_forward.cu: blocks outside the band are never loaded, a row that sees no key
// writes out = 0 and lse = -inf, and m * scale_log2 uses 0 while m = -inf. Requires softmax_scale > 0.
#include "arch/arch.cuh"
#include "common/sink.cuh"
#include "kernels/fa2_tc_tiles.cuh"

namespace cuflash {
namespace fa2tc {

template <int HeadDim, int BlockM, int BlockN, int Warps>
struct ForwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kWarps = Warps;
  static constexpr int kThreads = Warps * 32;
  static constexpr int kMTiles = BlockM / (16 * Warps);  // m16 strips per warp
  static constexpr int kRowsPerWarp = 16 * kMTiles;
  static constexpr int kKeyTiles = BlockN / 8;           // n8 tiles of S
  static constexpr int kDimTiles = HeadDim / 8;          // n8 tiles of O
  // Whether K's ldmatrix bases stay pinned in registers through the K/V loop like Q's and V's (LaneBases::pinned).
  // Not with two strips per warp and 160 accumulator floats per thread (d96 at 128 x 64 and d128 at 128 x 32 on 4
  // warps): at d128 ptxas for sm_90 spilled 8 bytes with all three sets pinned; K's are rebuilt per block instead
  // (about 14 instructions).
  static constexpr bool kPinKBases = !(kMTiles == 2 && kMTiles * (kDimTiles + kKeyTiles) * 4 >= 160);
  // Whether the K/V loop takes load_whole_tile for whole blocks: not on those tiles under CUDA 12, whose ptxas spilled
  // 4 bytes at d128 128 x 32 on sm_90 with the unrolled copies (13's does not), and 4 at d96 128 x 64 on sm_90 with
  // the two-part copies (12.9); nor at d32, where the copies' registers cost sm_90 a block per SM (157 -> 174
  // registers: 3 -> 2 blocks).
  // Whether paged blocks take them too (each block's source looked up in its page): not at d256 under CUDA 12,
  // whose ptxas spilled 64 x 64 on 4 warps with the lookup (16 bytes on sm_90, 8 on sm_86; 13's does not).
  // Whether a K/V loop without whole copies holds the sequence's K and V rows from key 0 (KeyRows::from) rather than
  // finding each block's (key_rows re-reads the sequence's offsets and the cache's indexing: 45 instructions an
  // iteration at d96 and d192 on sm_80 while they had no whole copies, for 5 to 14 more registers). Since d96 and
  // d192 copy whole blocks in two column parts (WholeTileCopy), that loop is d96 at 128 x 64 on 4 warps under CUDA
  // 12 alone. Not at d32, whose 166 registers would pass 168 (173 on sm_80, 179 on sm_90) and cost a block per SM
  // (3 -> 2). With whole copies the loop finds each ragged block's rows: holding them there cost 1 to 20
  // instructions an iteration instead.
  static constexpr bool kHoldKeyRows = HeadDim > 32;
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ < 13
  static constexpr bool kWholeCopiesFit = kPinKBases && HeadDim > 32;
  static constexpr bool kPagedWholeCopiesFit = HeadDim < 256;
#else
  static constexpr bool kWholeCopiesFit = HeadDim > 32;
  static constexpr bool kPagedWholeCopiesFit = true;
#endif

  using QTile = SwizzledTile<BlockM, HeadDim>;
  using KVTile = SwizzledTile<BlockN, HeadDim>;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + QTile::kBytes;
  static constexpr int kVOffset = kKOffset + KVTile::kBytes;
  static constexpr int kSmemBytes = kVOffset + KVTile::kBytes;

  static_assert(HeadDim % 32 == 0 && HeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static_assert(kMTiles >= 1 && BlockM == 16 * kMTiles * Warps, "warps own whole 16-row strips");
  static_assert(BlockN % 16 == 0, "keys come in k16 steps");
};

}  // namespace fa2tc

// __launch_bounds__(threads, 1): as the SIMT forward, shared memory bounds the blocks per SM; ptxas may use up
// to 255 registers for the O and S accumulators rather than spill.
//
// WithDropout: dropout (dropout.cuh) is a template flag here, as in FA2: its Philox work inside the K/V loop would
// push the instances without it past the register limit (a runtime flag spilled 100 to 600 bytes per instance),
// and the instances with it take their own tiles (fa2_tc.py).
// Hook: the per-score transform (mask.cuh's ScoreHook; flex_hook.cuh's FlexHook for a user's mods).
template <class T, int HeadDim, int BlockM, int BlockN, int Warps, bool WithDropout = false, class Hook = ScoreHook>
__global__ void __launch_bounds__(Warps * 32, 1) fa2_tc_forward_kernel(const AttentionParams p) {
  static_assert(arch::is_mma_operand<T>::value, "the tensor-core forward takes __half or __nv_bfloat16");
  using Tr = fa2tc::ForwardTraits<HeadDim, BlockM, BlockN, Warps>;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int MT = Tr::kMTiles;
  constexpr int kRows = 2 * MT;  // accumulator rows per lane: g and g + 8 of each strip

  CUFLASH_DYNAMIC_SMEM(smem);
  if (fa2tc::launch_shape_differs<Tr::kSmemBytes, Tr::kThreads, HeadDim>(p)) __trap();

  const int m_block = blockIdx.x / p.num_kv_splits;  // the split, blockIdx.x % p.num_kv_splits, is re-derived
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool quad_leader = lane % 4 == 0;  // writes its quad's row statistics
  const int d = p.headdim;     // q's and k's columns
  const int dim_v = p.headdim_v;  // v's and out's (attention_params.cuh)

  const int row0 = m_block * BlockM;
  if (row0 >= info.seqlen_q(p)) return;  // the whole block (past its sequence for varlen): before any barrier
  // The sequence's lengths are re-read where used (block_info.cuh): nothing derived from them stays live.
  auto block_rows = [&] { return min(BlockM, info.seqlen_q(p) - row0); };
  const Hook score_hook = Hook::of(p, info);
  const IndexRange n_range =
      split_kv_blocks<BlockN>(MaskPolicy::of(p, info).kv_blocks<BlockN>(row0, row0 + block_rows()), info.seqlen_k(p),
                              blockIdx.x % p.num_kv_splits, p.num_kv_splits);
  // The K/V blocks the loop visits: those of n_range, or a block mask's list (flex_hook.cuh).
  const auto visits = Hook::kv_visits(p, info, m_block, n_range);

  const int warp_row0 = warp * Tr::kRowsPerWarp;
  // Block-relative row of this lane's accumulator row r (strip r / 2, half r % 2).
  auto lane_row = [&](int r) { return warp_row0 + fa2tc::acc_row(lane, r / 2, r % 2); };

  fa2tc::Accumulator<MT, Tr::kDimTiles> acc_o;
  acc_o.zero();
  // Running max of this lane's rows in base 2, m * scale_log2 (-inf until the row sees a key). It is also the
  // offset the exponents subtract; unlike the SIMT forward no separate rounded offset is kept: the product's
  // rounding (half an ulp of m * scale_log2) only enters the lse, 2^-24 relative to a logit, where 16-bit inputs
  // already carry 2^-11 (half) or 2^-8 (bfloat16), and it saves a register per row.
  float row_max[kRows];
  float row_sum[kRows];  // this lane's part of l (the quad is summed at the end)
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = neg_inf();
    row_sum[r] = 0.f;
  }

  unsigned char* q_tile = smem + Tr::kQOffset;
  unsigned char* k_tile = smem + Tr::kKOffset;
  unsigned char* v_tile = smem + Tr::kVOffset;

  if (!visits.empty()) {
    const T* q = info.q<T>(p) + row0 * p.q_stride.row;
    const bool q_vector = fa2tc::rows_16b_aligned(q, p.q_stride.row);
    const bool k_vector = info.k_rows<T>(p, 0).rows_16b_aligned();
    const bool v_vector = info.v_rows<T>(p, 0).rows_16b_aligned();
    // K and V blocks copied by load_whole_tile where whole (below): 16-byte aligned rows at the compiled head dim,
    // contiguous or paged with every block inside one page (FA2's paged layout: pages a multiple of the block, keys
    // from a page's row 0);
    // per block, every key row in the sequence.
    constexpr bool kWholeCopies = fa2tc::WholeTileCopy<KVTile, Tr::kThreads>::kAvailable && Tr::kWholeCopiesFit;
    // (Not with a block mask: the whole copies' addresses step one block back per visit.)
    const bool kv_whole = kWholeCopies && k_vector && v_vector && d == HeadDim && dim_v == HeadDim &&
                         (p.block_table == nullptr || (Tr::kPagedWholeCopiesFit && p.page_size % BlockN == 0 &&
                                                       p.cache_leftpad == nullptr)) &&
                         !Hook::kBlockSparse;
    // This thread's first chunk of the K block a step prefetches (n_block - 1) and of the V block it loads
    // (n_block), meaningful where kv_whole and contiguous: carried from step to step, one block back each (a 64-bit
    // subtraction), where a base plus key0 * stride cost 9 instructions per copy. Paged, a block's first chunk is
    // found in its page (whole_in_page).
    const int whole_row = fa2tc::whole_tile_row<KVTile, Tr::kThreads>(threadIdx.x);
    const int whole_col = fa2tc::whole_tile_column<KVTile, Tr::kThreads>(threadIdx.x);
    // From the sequence's key 0 as KeyRows finds it: a contiguous KV cache's row of the caches' batch
    // (cache_batch_idx) past its left padding (cache_leftpad); BlockInfo::k's row 0 of batch b is neither.
    const T* k_whole = kWholeCopies ? info.k_rows<T>(p, 0).head_base +
                                          ((n_range.end - 2) * BlockN + whole_row) * p.k_stride.row + whole_col
                                    : nullptr;
    const T* v_whole = kWholeCopies ? info.v_rows<T>(p, 0).head_base +
                                          ((n_range.end - 1) * BlockN + whole_row) * p.v_stride.row + whole_col
                                    : nullptr;
    auto whole_in_page = [&](const KeyRows<const T>& rows) {
      return rows.paged_row(rows.first_row + whole_row) + whole_col;
    };
    // A block's K or V rows from its first key: the rows from key 0 shifted where the loop holds them
    // (ForwardTraits::kHoldKeyRows, without whole copies), else found for the block.
    constexpr bool kHoldRows = Tr::kHoldKeyRows && !kWholeCopies;
    // (Unused unless kHoldRows. k_vector, v_vector, k_whole and v_whole above find key 0's rows themselves: read
    // from these, the whole-copy instances' loops grew, sm_90 d128 by 16 instructions an iteration.)
    const KeyRows<const T> k_rows = info.k_rows<T>(p, 0);
    const KeyRows<const T> v_rows = info.v_rows<T>(p, 0);
    auto k_rows_from = [&](int key0) {
      if constexpr (kHoldRows) return k_rows.from(key0);
      else return info.k_rows<T>(p, key0);
    };
    auto v_rows_from = [&](int key0) {
      if constexpr (kHoldRows) return v_rows.from(key0);
      else return info.v_rows<T>(p, key0);
    };
    // A flex hook with a score_mod gives score' itself (FlexHook::kScaledScores, every tile hooked): its exponent's
    // factor is log2 e.
    const float scale_log2 = Hook::kScaledScores ? kLog2e : p.softmax_scale_log2;
    // The thread index for V's ragged copies, read back from a volatile local at each use: V's columns end at v's
    // head dim, K's at q's, and with both limits' per-thread chunk bounds hoisted out of the K/V loop ptxas spilled
    // 48 bytes at d128 (128 x 32) on sm_90; re-read, they cost a local load on ragged blocks only.
    volatile int ragged_thread_index = threadIdx.x;
    auto block_keys = [&](int n_block) { return min(BlockN, info.seqlen_k(p) - n_block * BlockN); };
    // The K/V blocks whose tile needs no element-wise mask (mask.cuh's tile_needs_mask false), found once: the
    // loop then tests its block index against two bounds instead of re-reading the sequence's lengths per block.
    // The policy is held through the loop (its two lengths: two registers), unlike the lengths elsewhere: re-read per
    // masked block, they cost 11 instructions of varlen tests there.
    const MaskPolicy mask = MaskPolicy::of(p, info);
    const IndexRange unmasked = mask.unmasked_kv_blocks<BlockN>(row0, block_rows());

    // Each lane's ldmatrix bases (the XOR swizzle's lane part), once per kernel: Q's with the warp's rows.
    const auto q_at =
        fa2tc::LaneBases<QTile>::of(fa2tc::a_row_lane<QTile>(lane), warp_row0 * QTile::kRowBytes).pinned(lane);
    const auto k_lane_bases = fa2tc::LaneBases<KVTile>::of(fa2tc::pair_lane<KVTile>(lane));
    const auto k_at = Tr::kPinKBases ? k_lane_bases.pinned(lane) : k_lane_bases;
    const auto v_at = fa2tc::LaneBases<KVTile>::of(fa2tc::b_kn_lane<KVTile>(lane)).pinned(lane);

    fa2tc::load_tile<QTile, Tr::kThreads>(q_tile, q, p.q_stride.row, block_rows(), d, q_vector, threadIdx.x);
    fa2tc::load_tile<KVTile, Tr::kThreads>(k_tile, k_rows_from(visits.tile(visits.end - 1) * BlockN),
                                           block_keys(visits.tile(visits.end - 1)), d, k_vector, threadIdx.x);
    arch::cp_async_commit();

    for (int visit = visits.end - 1; visit >= visits.begin; --visit) {
      const int n_block = visits.tile(visit);
      const int key0 = n_block * BlockN;
      arch::cp_async_wait<0>();
      __syncthreads();  // K_j (and Q) visible to all; every warp is done with V_{j+1}
      // A block below unmasked.end has every key row (mask.cuh: (n + 1) BlockN <= seqlen_k).
      if (kv_whole && n_block < unmasked.end) {
        if constexpr (kWholeCopies)
          fa2tc::load_whole_tile<KVTile, Tr::kThreads>(
              v_tile,
              Tr::kPagedWholeCopiesFit && p.block_table != nullptr ? whole_in_page(info.v_rows<T>(p, key0)) : v_whole,
              p.v_stride.row, threadIdx.x);
      } else {
        fa2tc::load_tile<KVTile, Tr::kThreads>(v_tile, v_rows_from(key0), block_keys(n_block), dim_v, v_vector,
                                               ragged_thread_index);
      }
      arch::cp_async_commit();

      fa2tc::Accumulator<MT, Tr::kKeyTiles> s;
      s.zero();
      fa2tc::gemm_ss<T, false, false, QTile, KVTile, MT, Tr::kKeyTiles, HeadDim>(s, q_tile, q_at, k_tile, k_at);

      // Score hook, then the element-wise mask where the tile crosses an edge of the band or the end of the keys.
      // Each behind one block-uniform test per tile. Tested per score instead, ptxas kept both tests (three
      // branches and the key index per score) in every tile of plain attention.
      // FlexHook: mask_mod on partial tiles only; without one, the sequence bounds on edge tiles only (on_tile).
      // A copy per case of the hook's parts where registers allow (ScoreHook::in_tile_cases: not with dropout).
      if (score_hook.active()) {
        auto hook_tile = [&] {
          score_hook.template on_tile<Hook::kScaledScores, Hook::kMaskOnly>(
              visits.full(visit), row0, BlockM, key0, BlockN,
              fa2tc::HookEachScore<MT, Tr::kKeyTiles>{s, row0 + warp_row0, key0, lane});
        };
        if constexpr (WithDropout)
          hook_tile();
        else
          score_hook.in_tile_cases(hook_tile);
      }
      if (!unmasked.contains(n_block)) {
        fa2tc::mask_tile(s, mask, mask.tile_edges(row0, min(BlockM, mask.seqlen_q - row0), key0, BlockN),
                         row0 + warp_row0, key0, lane);
      }

      arch::cp_async_wait<0>();
      __syncthreads();  // V_j visible to all; every warp is done with K_j
      if (visit > visits.begin) {
        // The next visited block: the one before (without a block mask, as the expressions the whole copies use).
        const int next_block = Hook::kBlockSparse ? visits.tile(visit - 1) : n_block - 1;
        const int next_key0 = Hook::kBlockSparse ? next_block * BlockN : key0 - BlockN;
        if (kv_whole && next_block < unmasked.end) {
          if constexpr (kWholeCopies)
            fa2tc::load_whole_tile<KVTile, Tr::kThreads>(
                k_tile,
                Tr::kPagedWholeCopiesFit && p.block_table != nullptr ? whole_in_page(info.k_rows<T>(p, next_key0))
                                                                     : k_whole,
                p.k_stride.row, threadIdx.x);
        } else {
          fa2tc::load_tile<KVTile, Tr::kThreads>(k_tile, k_rows_from(next_key0), block_keys(next_block),
                                                 d, k_vector, threadIdx.x);
        }
        arch::cp_async_commit();
      }

      // Online softmax, base 2, scale folded into the exponent's FMA (see fa2_forward.cu for the offset).
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float block_max = neg_inf();
#pragma unroll
        for (int j = 0; j < Tr::kKeyTiles; ++j)
          block_max = fmaxf(block_max, fmaxf(s.c[r / 2][j][2 * (r % 2)], s.c[r / 2][j][2 * (r % 2) + 1]));
        block_max = fa2tc::quad_max(block_max);
        const float old_max = row_max[r];
        const float new_max = fmaxf(old_max, block_max * scale_log2);  // rounding is monotonic: max commutes
        row_max[r] = new_max;
        // A row with no visible key so far keeps -inf: use offset 0 so p = exp2(-inf) = 0 (never -inf - -inf).
        const float max_scaled = new_max == neg_inf() ? 0.f : new_max;
        const float correction = old_max == neg_inf() ? 0.f : arch::exp2_approx(old_max - max_scaled);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < Tr::kKeyTiles; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s.c[r / 2][j][2 * (r % 2) + e];
            x = arch::exp2_approx(fmaf(x, scale_log2, -max_scaled));
            sum += x;
          }
        row_sum[r] = fmaf(row_sum[r], correction, sum);
#pragma unroll
        for (int j = 0; j < Tr::kDimTiles; ++j) {
          acc_o.c[r / 2][j][2 * (r % 2)] *= correction;
          acc_o.c[r / 2][j][2 * (r % 2) + 1] *= correction;
        }
      }

      unsigned p_frag[MT][Tr::kKeyTiles / 2][4];  // P = S rounded to T, as A operands
      fa2tc::to_a_operand<T>(p_frag, s);
      if (WithDropout) {
        // After the row sums (l normalizes the undropped softmax) and on the packed P (half the registers of S):
        // one Philox evaluation per n8 tile and strip zeroes the dropped halves; the kept P is scaled by
        // 1 / (1 - dropout_p) once, in the epilogue. Made here so the seed is live only through this loop.
        const Dropout dropout = Dropout::of(p, info.batch, info.head);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < Tr::kKeyTiles; ++j) {
            const unsigned bits = dropout.keep_bits(row0 + lane_row(2 * i), key0 + fa2tc::acc_col(lane, j));
            unsigned* rows_g_and_g8 = &p_frag[i][j / 2][2 * (j % 2)];  // to_a_operand's layout
            rows_g_and_g8[0] &= Dropout::half_mask(bits);
            rows_g_and_g8[1] &= Dropout::half_mask(bits >> 2);
          }
      }
      fa2tc::gemm_rs<T, KVTile>(acc_o, p_frag, v_tile, v_at);
      if constexpr (kWholeCopies) {
        k_whole -= BlockN * p.k_stride.row;
        v_whole -= BlockN * p.v_stride.row;
      }
    }
  }

  // lse of accumulator row r with row sum l: (m log2 e + log2 l) ln 2, or -inf where the row saw no key.
  auto row_lse = [&](int r, float l) { return l > 0.f ? fmaf(row_max[r], kLn2, logf(l)) : neg_inf(); };

  if (p.num_kv_splits > 1) {
    // Split-KV: this split's O / l and lse in float32, from the accumulators (the combine kernel rounds to T).
    // Without dropout (the API allows none here), and with 0 and -inf where the split saw no key of the row.
    // With sinks, split 0's partials hold the head's sink (sink.cuh), so the combine counts it once.
    const int split = blockIdx.x % p.num_kv_splits;
    float* out_part = info.out_accum_split(p, split);
    float* lse_part = info.lse_accum_split(p, split);
    const RowSink sink = RowSink::of(p, info.head, split);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float l = fa2tc::quad_sum(row_sum[r]);  // a quad shuffle: every lane, before the row test
      const int row = row0 + lane_row(r);
      if (row >= info.seqlen_q(p)) continue;
      float inv_l = l > 0.f ? 1.f / l : 0.f;
      float part_lse = row_lse(r, l);
      sink.join(inv_l, part_lse);
      float* out_row = out_part + row * BlockInfo::dense_out_row_stride(p);
#pragma unroll
      for (int j = 0; j < Tr::kDimTiles; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = fa2tc::acc_col(lane, j) + e;
          if (col < dim_v) arch::store(out_row + col, acc_o.c[r / 2][j][2 * (r % 2) + e] * inv_l);
        }
      if (quad_leader) arch::store(lse_part + row, part_lse);
    }
    return;
  }

  // Epilogue. O / l into this warp's own rows of the Q buffer (no other warp reads them; the warp's last ldmatrix
  // of Q is behind it, and no copy is in flight), then out in 16-byte chunks and lse from one lane per quad.
  // With sinks (sink.cuh) each row's keys-only O / l and lse are joined by the head's sink logit.
  T* out = info.out<T>(p) + row0 * p.out_stride.row;
  float* lse = p.lse + info.row_stats_offset(p);
  const RowSink sink = RowSink::of(p, info.head, 0);
  __syncwarp();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float l = fa2tc::quad_sum(row_sum[r]);
    float inv_l = l > 0.f ? (WithDropout ? p.dropout_rescale : 1.f) / l : 0.f;  // rescale: 1 / (1 - p)
    float row_lse_out = row_lse(r, l);
    sink.join(inv_l, row_lse_out);
    const int row = lane_row(r);
#pragma unroll
    for (int j = 0; j < Tr::kDimTiles; ++j) {
      const float* o = &acc_o.c[r / 2][j][2 * (r % 2)];
      *reinterpret_cast<unsigned*>(q_tile + QTile::element_offset(row, fa2tc::acc_col(lane, j))) =
          arch::pack_float2<T>(o[0] * inv_l, o[1] * inv_l);
    }
    if (quad_leader && row0 + row < info.seqlen_q(p)) arch::store(lse + row0 + row, row_lse_out);
  }
  __syncwarp();
  fa2tc::store_tile<QTile>(out, p.out_stride.row, q_tile, warp_row0, warp_row0 + Tr::kRowsPerWarp, block_rows(), dim_v,
                           lane, 32);
}

}  // namespace cuflash
