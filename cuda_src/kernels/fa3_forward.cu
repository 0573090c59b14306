// Warp-specialized FlashAttention forward for Hopper (sm_90a): wgmma from swizzled shared memory, a producer
// warpgroup feeding consumer warpgroups through mbarriers (FlashAttention-3's published structure, hopper.md).
//
// What it does: out = softmax(hook(scale * Q K^T) [masked]) V and lse = logsumexp of the scores, per (batch, query
// head), for __half and __nv_bfloat16, head dims 1..256 (q's and k's, and v's own: headdim_v, MLA-style) on the
// next compiled one >= both (64, 128, 192 or 256; MLA's 192 / 128 on a tile of its own, V and O at 128: HeadDimV)
// (the columns past each tensor's head dim zero in shared memory, never read from global memory; out's columns past
// v's are computed and not written), GQA/MQA, any seqlens;
// masks of mask.cuh (none, causal, sliding windows: the K/V blocks outside the band are skipped on both sides);
// the hook (softcap, ALiBi: mask.cuh's ScoreHook) in the Hooked instances only, or a user's flex mods (score_mod,
// mask_mod, a block mask's K/V block lists: flex_hook.cuh's FlexHook) in instances cuflash.flex builds.
// Varlen batches, KV caches (contiguous, with cache_batch_idx and cache_leftpad, or paged) and split-KV: where the
// rows are and which keys a block takes are block_info.cuh's and mask.cuh's rules, runtime fields (the K/V loop
// does not change). Attention sinks (sink.cuh) join each row's O / l and lse in the epilogue (split 0's partials
// with split-KV). Not (yet): dropout, which stays on the mma.sync kernels (fa2_tc_forward.cu).
//
// How it partitions work
//   grid  = (ceil(seqlen_q / BlockM) x num_kv_splits, nheads, batch): one thread block per Q block of one head
//           (query head h reads kv head h / (nheads / nheads_k), block_info.cuh), and with split-KV per split of
//           its K/V blocks (mask.cuh's split_kv_blocks). Varlen: the grid spans the longest sequence; a block past
//           its own sequence's rows returns at once.
//   block = 1 + kConsumers warpgroups of 128 threads (fa3_forward_traits.cuh):
//     warpgroup 0, the producer (setmaxnreg down to kProducerRegisters): copies Q once and, per visible K/V block
//       (last to first, as mask.cuh's kv_blocks gives them), K and V into the next stage of a ring of kStages,
//       in the 128-byte-swizzled layout wgmma reads. With TMA (p.tma_loads: the host made q's, k's and v's tensor
//       maps, passed in the __grid_constant__ params): one elected thread arrives on the stage's "full" mbarrier
//       expecting the tile's bytes and issues one cp.async.bulk.tensor per 64-column panel holding any of the
//       tensor's columns (fa3::produce_tile_tma; the maps span the whole arrays and zero-fill rows past them and
//       columns past the head dim; the panels wholly past it, for which no box is issued, all threads zero once
//       before the roles split; block_info.cuh
//       gives each box's coordinates: a packed varlen sequence's rows, a KV cache's, a paged cache's page). Where
//       the rows past a sequence's keys are other data (varlen, a KV cache's unused rows), the ragged last K/V
//       block is copied by the elected thread's warp with loads instead (zero-filled: P's zeros would not keep a
//       NaN there out of P V; one arrival after __syncwarp), so that warp stays; the others exit. Else (what TMA
//       cannot address: a paged cache whose pages do not hold whole K/V blocks, unaligned arrays; or a caller
//       without maps) all 128 copy with 16-byte loads (fa3::produce_tile: the same zero fill, K/V rows through
//       block_info.cuh's KeyRows, fence.proxy.async, one arrival per thread). Packed varlen Q boxes read the next
//       sequence's rows too: those rows are computed and never written. Before refilling a stage's K (V) it
//       waits on the stage's "empty" mbarrier for K (V).
//     warpgroups 1.. kConsumers, the consumers (setmaxnreg up to kConsumerRegisters), each owning 64 query rows:
//       S = Q K^T by wgmma SS (both K-major, HeadDim / 16 k16 steps of m64nBlockNk16); the score hook (Hooked
//       instances); mask (blocks crossing an edge of the band or the keys' end only, mask.cuh); online softmax in
//       registers on the accumulator layout (a row's 4 lanes reduce with 2 shuffles; base 2, scale folded into one
//       FMA); P rounded to 16 bits in registers as wgmma_rs's A fragment; O += P V by wgmma RS (V read MN-major from
//       the same layout as K, BlockN / 16 k16 steps of m64nHeadDimVk16). Pipelined as FA3 publishes it:
//       - intra-warpgroup overlap: a step issues S_{j+1} (after full_k) and P_j V_j (after full_v) as two commit
//         groups, waits for the first only (wgmma_wait<1>), runs the softmax of S_{j+1} while P_j V_j is in flight,
//         then waits for it, releases K (after the first wait) and V (after the second: one arrival per warp on
//         the stage's "empty" mbarrier of each), rescales O and converts P_{j+1} (P's registers are A operands of
//         the wgmma in flight until then); the steps whose S_{j+1} needs the mask run in a loop of their own, as
//         FA3's do, so the steady step has no branch between the waits (with one, ptxas waited for P V at the join,
//         ahead of the softmax);
//       - ping-pong: the consumers take turns (round robin) to issue their wgmma (named barriers
//         kSchedulerBarrier + c: a consumer waits for its turn, issues, hands the turn to the next), so one's
//         softmax runs while another's products do.
//   Epilogue (per consumer): O / l rounded to 16 bits into the consumer's own 64 rows of the Q buffer (its wgmma
//   reading them are complete), a named barrier of its 128 threads, 16-byte coalesced stores; lse = m * scale +
//   log l from one lane per row (with sinks, both joined by the head's sink logit). Split-KV: O / l and lse in
//   float32 from the accumulators into out_accum and lse_accum, which fa2_split_kv_combine.cu merges.
//
// Shared memory: Q [BlockM][D], K [Stages][BlockN][D] and V [Stages][BlockN][Dv] (Dv = HeadDimV, D but for MLA's
//   tile), 16-bit, in 64-column panels (fa3_forward_traits.cuh), plus 1 + 4 Stages mbarriers:
//   (BlockM D + Stages BlockN (D + Dv)) 2 + 8 (1 + 4 Stages) bytes (2 stages: d128 128 x 176 208 KB + 72 B,
//   128 x 128 160 KB + 72 B; d64 192 x 128 88 KB + 72 B; d192 128 x 112 216 KB + 72 B; MLA 192 / 128 128 x 128
//   208 KB + 72 B; d256 128 x 80 224 KB + 72 B). Registers per consumer thread: S BlockN / 2 floats, O Dv / 2
//   floats, P BlockN / 4 words.
//
// What it costs, per launch (es = 2, d = headdim, dv = headdim_v, M = BlockM, N = BlockN): for each Q block that
// sees a key, rows_i d es of Q and keys_i (d + dv) es of K and V (its visible blocks, clipped at seqlen_k), once;
// out and lse written once. Rows past the sequence are zero-filled in shared memory, never read (TMA reads only the
// box's elements inside the tensor). FLOPs: 2 B H Sq Sk (d + dv), about half with causal (the tile's widths where
// they are wider).
//
// Rows that see no key write out = 0 and lse = -inf (with sinks: the sink logit). Requires softmax_scale > 0.
#include "arch/arch.cuh"
#include "common/sink.cuh"
#include "kernels/fa3_forward_traits.cuh"

namespace cuflash {

// Hooked: the instance applies mask.cuh's ScoreHook (softcap, ALiBi) to every score. A template flag, not a runtime
// test: the test cost the plain step 2 to 5 instructions (loop census; d128 128 x 176 past its bound of 1.15x
// FA3's figure), so only problems with softcap or ALiBi run the hooked instances.
// HeadDimV: V's and O's tile width where narrower than Q's and K's (MLA's 192 / 128: a third fewer P V FLOPs and
// O registers than on the d192 tile).
// Hook: ScoreHook, or flex_hook.cuh's FlexHook with a user's score_mod and mask_mod (cuflash.flex builds such an
// instance from a hooked one: Hooked true). A flex call has no softcap, ALiBi, window or split-KV (the kernel traps on
// them): the hook hides the scores past the sequence and the mask_mod's, so its steps run no element-wise mask of
// mask.cuh; with a block mask (FlexHook's BlockSparse) the producer and the consumers walk its list of K/V blocks for
// the Q block (FlexHook::kv_visits), in the same order, and the mask_mod runs on its partial blocks only.
template <class T, int HeadDim, int BlockM, int BlockN, int Stages, bool Hooked = false, int HeadDimV = HeadDim,
          class Hook = ScoreHook>
__global__ void __launch_bounds__((1 + BlockM / 64) * 128, 1) fa3_forward_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(arch::is_mma_operand<T>::value, "the wgmma forward takes __half or __nv_bfloat16");
  constexpr bool kFlex = !fa3::is_score_hook<Hook>::value;
  static_assert(Hooked || !kFlex, "a flex instance is a hooked one");
  using Tr = fa3::ForwardTraits<HeadDim, BlockM, BlockN, Stages, HeadDimV>;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  using VTile = typename Tr::VTile;

  CUFLASH_DYNAMIC_SMEM(smem);
  // The swizzle acts on shared-window address bits: the tiles must start on 1024-byte boundaries. An instance
  // without the hook launched with softcap or ALiBi would silently drop them.
  if (fa3::launch_shape_differs<Tr>(p) || (arch::smem_address(smem) & (fa3::kSwizzleAtomBytes - 1)) != 0 ||
      (!Hooked && (p.softcap_outer != 0.f || p.alibi_slopes != nullptr)) ||
      Hook::rejects(p) || (kFlex && p.num_kv_splits != 1))
    __trap();

  const int m_block = blockIdx.x / p.num_kv_splits;  // split-KV: the split is blockIdx.x % p.num_kv_splits
  const BlockInfo info = BlockInfo::of(p, blockIdx.z, blockIdx.y);
  const int row0 = m_block * BlockM;
  if (row0 >= info.seqlen_q(p)) return;  // the whole block (past its sequence for varlen), before any barrier
  const int block_rows = min(BlockM, info.seqlen_q(p) - row0);
  const MaskPolicy mask = MaskPolicy::of(p, info);
  // The K/V blocks of the band (both sides skipped under a window), of this block's split with split-KV: the one
  // range the producer loads and the consumers compute, made once before the roles split, so the two walk the same
  // blocks in the same order.
  const IndexRange n_range = split_kv_blocks<BlockN>(mask.kv_blocks<BlockN>(row0, row0 + block_rows),
                                                     info.seqlen_k(p), blockIdx.x % p.num_kv_splits,
                                                     p.num_kv_splits);
  // The blocks visited, last to first: visits.tile(i) for i from visits.end - 1 down to visits.begin (n_range's
  // blocks; a flex block mask's listed ones).
  const auto visits = Hook::kv_visits(p, info, m_block, n_range);

  unsigned char* q_tile = smem + Tr::kQOffset;
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + Tr::kBarrierOffset);
  uint64_t* q_full = barriers;
  uint64_t* full_k = barriers + 1;
  uint64_t* full_v = full_k + Stages;
  uint64_t* empty_k = full_v + Stages;
  uint64_t* empty_v = empty_k + Stages;
  auto k_tile = [&](int stage) { return smem + Tr::kKOffset + stage * KVTile::kBytes; };
  auto v_tile = [&](int stage) { return smem + Tr::kVOffset + stage * VTile::kBytes; };

  const bool tma = p.tma_loads != 0;  // the host made q's, k's and v's tensor maps (fa3_forward_traits.cuh)
  if (tma) {
    // The panels wholly past q's, k's or v's columns, which no TMA copy fills (fa3::panels_holding), zeroed for S's
    // sum and P V; fenced for the wgmma (async proxy) that read them, after the barrier below. (The load path
    // writes every column.)
    fa3::zero_panels_past<QTile>(q_tile, p.headdim, threadIdx.x, Tr::kThreads);
    for (int s = 0; s < Stages; ++s) {
      fa3::zero_panels_past<KVTile>(k_tile(s), p.headdim, threadIdx.x, Tr::kThreads);
      fa3::zero_panels_past<VTile>(v_tile(s), p.headdim_v, threadIdx.x, Tr::kThreads);
    }
    arch::fence_proxy_async();
  }
  if (threadIdx.x == 0) {
    const unsigned full_arrivals = fa3::full_arrivals(tma);
    arch::mbarrier_init(q_full, full_arrivals);
    for (int s = 0; s < Stages; ++s) {
      arch::mbarrier_init(full_k + s, full_arrivals);
      arch::mbarrier_init(full_v + s, full_arrivals);
      arch::mbarrier_init(empty_k + s, Tr::kConsumerWarps);  // one arrival per consumer warp
      arch::mbarrier_init(empty_v + s, Tr::kConsumerWarps);
    }
    arch::fence_mbarrier_init();  // visible to the async proxy (the TMA's complete_tx) too
  }
  __syncthreads();  // every use of the barriers after their init

  // Warp-uniform as ptxas sees it (a shuffle's result), so the role branches are not divergent paths to it.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / fa3::kWarpgroupThreads), 0);
  const int thread = threadIdx.x % fa3::kWarpgroupThreads;

  if (warpgroup == 0) {
    // ---- producer ----
    arch::setmaxnreg_dec<Tr::kProducerRegisters>();
    if (visits.empty()) return;
    const int d = p.headdim, dv = p.headdim_v;  // q's and k's, v's (launch_shape_differs)
    if (tma) {
      // Warp 0 goes on: its elected lane issues every TMA copy; its 32 lanes copy a ragged K/V block with loads
      // where the map would read other data past the keys (packed varlen sequences, a KV cache's unused rows: keys
      // the mask hides, but V rows that P's zeros would not keep out of P V were they NaN or inf). Such a block is
      // the sequence's last, so the first the producer fills. The other producer warps have nothing to do.
      if (thread >= 32) return;
      const bool leader = arch::elect_one_sync();
      if (leader)
        fa3::produce_tile_tma<QTile>(q_tile, fa3::tensor_map(p.tma.q), info.q_tma_coords(p, row0), info.head, d,
                                     q_full);
      const bool ragged_by_loads = BlockInfo::keys_end_inside_array(p);
      const int seqlen_k = info.seqlen_k(p);
#pragma unroll 1
      for (int visit = visits.end - 1, it = 0; visit >= visits.begin; --visit, ++it) {
        const int n_block = visits.tile(visit);
        const int stage = it % Stages;
        const unsigned previous_round = ((it / Stages) & 1) ^ 1;  // as below
        const int key0 = n_block * BlockN;
        const int keys = min(BlockN, seqlen_k - key0);
        arch::mbarrier_wait(empty_k + stage, previous_round);
        if (ragged_by_loads && keys < BlockN) {
          constexpr auto kOnce = fa3::Arrival::kOnceByTheWarp;  // stands in for the warp's one TMA copy
          const KeyRows<const T> k_rows = info.k_rows<T>(p, key0);
          fa3::produce_tile<KVTile, 32, fa3::kLoadsInFlight, kOnce>(k_tile(stage), fa3::KeyRowsAt<T>{k_rows}, keys, d,
                                                                   k_rows.rows_16b_aligned(), thread, full_k + stage);
          arch::mbarrier_wait(empty_v + stage, previous_round);
          const KeyRows<const T> v_rows = info.v_rows<T>(p, key0);
          fa3::produce_tile<VTile, 32, fa3::kLoadsInFlight, kOnce>(v_tile(stage), fa3::KeyRowsAt<T>{v_rows}, keys, dv,
                                                                  v_rows.rows_16b_aligned(), thread, full_v + stage);
          continue;
        }
        if (leader)
          fa3::produce_tile_tma<KVTile>(k_tile(stage), fa3::tensor_map(p.tma.k), info.key_tma_coords(p, key0),
                                        info.kv_head, d, full_k + stage);
        arch::mbarrier_wait(empty_v + stage, previous_round);
        if (leader)
          fa3::produce_tile_tma<VTile>(v_tile(stage), fa3::tensor_map(p.tma.v), info.key_tma_coords(p, key0),
                                       info.kv_head, dv, full_v + stage);
      }
      return;
    }
    const T* q = info.q<T>(p) + row0 * p.q_stride.row;
    fa3::produce_tile<QTile>(q_tile, q, p.q_stride.row, block_rows, d, fa3::rows_16b_aligned(q, p.q_stride.row),
                             thread, q_full);
    // K and V rows through BlockInfo's KeyRows: contiguous (a KV cache's rows from its cache_batch_idx and
    // cache_leftpad) or a paged cache's, looked up per row.
    const bool k_vector = info.k_rows<T>(p, 0).rows_16b_aligned();
    const bool v_vector = info.v_rows<T>(p, 0).rows_16b_aligned();
    const int seqlen_k = info.seqlen_k(p);
#pragma unroll 1
    for (int visit = visits.end - 1, it = 0; visit >= visits.begin; --visit, ++it) {
      const int n_block = visits.tile(visit);
      const int stage = it % Stages;
      // The empty phases of the previous round of this stage; on the first round the barrier's phase "before
      // phase 0" (parity 1) counts as complete, so the waits return at once.
      const unsigned previous_round = ((it / Stages) & 1) ^ 1;
      const int key0 = n_block * BlockN;
      const int keys = min(BlockN, seqlen_k - key0);
      arch::mbarrier_wait(empty_k + stage, previous_round);
      fa3::produce_tile<KVTile>(k_tile(stage), fa3::KeyRowsAt<T>{info.k_rows<T>(p, key0)}, keys, d, k_vector, thread,
                                full_k + stage);
      arch::mbarrier_wait(empty_v + stage, previous_round);
      fa3::produce_tile<VTile>(v_tile(stage), fa3::KeyRowsAt<T>{info.v_rows<T>(p, key0)}, keys, dv, v_vector, thread,
                               full_v + stage);
    }
    return;
  }

  // ---- consumers ----
  arch::setmaxnreg_inc<Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = thread / 32;  // in the warpgroup
  const int lane = thread % 32;
  const int group_row0 = consumer * 64;  // block-relative first row of this consumer
  const int first_row = group_row0 + fa3::acc_first_row(warp, lane);  // block-relative, half 0

  float acc_o[Tr::kAccO];
#pragma unroll
  for (int i = 0; i < Tr::kAccO; ++i) acc_o[i] = 0.f;
  // Running max of this thread's two rows in base 2 (m * scale_log2, -inf until the row sees a key) and its part
  // of the row sums (the quad is summed at the end).
  float row_max[2] = {neg_inf(), neg_inf()};
  float row_sum[2] = {0.f, 0.f};

  if (!visits.empty()) {
    // A flex hook with a score_mod gives score' itself (FlexHook::kScaledScores): its exponent's factor is log2 e.
    const float scale_log2 = Hook::kScaledScores ? kLog2e : p.softmax_scale_log2;
    const IndexRange unmasked = mask.unmasked_kv_blocks<BlockN>(row0, block_rows);
    const Hook hook = fa3::score_hook_of<Hook, Hooked>(p, info);
    // S of K/V block n_block in s: the score hook where softcap or ALiBi is on (a flex hook: its mods, on the
    // consumer's 64 rows, `full` a block mask's full block), the element-wise mask where `masked` (the tile needs
    // it), then the online softmax (s becomes P in float32); returns O's correction per half (applied by the caller
    // once no P V is in flight). Each loop below calls it with a constant `masked`, folded once the lambda is
    // inlined: its step holds no mask code, or no test of it. (A bool, not a compile-time tag taken as `auto`:
    // NVRTC 12 refuses a generic lambda in device code.)
    float s[Tr::kAccS];
    unsigned p_frag[BlockN / 16][4];
    auto softmax = [&](int n_block, bool full, float (&correction)[2], bool masked) {
      const int key0 = n_block * BlockN;
      if constexpr (kFlex)
        hook.template on_tile<Hook::kScaledScores, true>(
            full, row0 + group_row0, 64, key0, BlockN,
            fa3::HookEachScore<Tr::kAccS>{s, row0 + first_row, key0 + fa3::acc_first_col(lane)});
      else if constexpr (Hooked)
        fa3::hook_scores(s, hook, row0 + first_row, key0 + fa3::acc_first_col(lane));
      if (masked)
        fa3::mask_scores(s, mask, mask.tile_edges(row0, block_rows, key0, BlockN), row0 + first_row,
                         key0 + fa3::acc_first_col(lane));
      fa3::online_softmax<BlockN>(s, row_max, row_sum, scale_log2, correction);
    };
    auto to_p = [&] {
#pragma unroll
      for (int kk = 0; kk < BlockN / 16; ++kk) fa3::p_fragment<T>(p_frag[kk], s, kk);
    };
    // The steps' descriptors: each product's step 0 made once, the others moved on from it by compile-time offsets
    // (fa3::desc_advanced: one add where a descriptor made again costs a handful of instructions; HeadDim / 16 of
    // them a step for S, 16 at d256), their high words in registers (fa3::desc_unfolded).
    const fa3::DescZeros zero = fa3::DescZeros::read();
    const uint64_t q_desc = QTile::k_major_desc(q_tile, group_row0, zero.a);
    auto issue_s = [&](int stage) {
      const uint64_t k_desc = KVTile::k_major_desc(k_tile(stage), 0, zero.b);
#pragma unroll
      for (int step = 0; step < HeadDim / 16; ++step)
        arch::wgmma<T, BlockN>(s, fa3::desc_advanced(q_desc, QTile::k_major_step_bytes(step)),
                               fa3::desc_advanced(k_desc, KVTile::k_major_step_bytes(step)), step > 0);
      arch::wgmma_commit();
    };

    // A stage's K (or V) is read once this thread's wait covering the wgmma reading it is behind it: one arrival per
    // warp on its empty barrier, after its lanes' waits (a wgmma's reads land at a waiting thread of the warpgroup).
    auto release = [&](uint64_t* empty) {
      __syncwarp();
      if (lane == 0) arch::mbarrier_arrive(empty);
    };

    // Prologue: S and P of the first block (O is still 0: no correction to apply).
    arch::mbarrier_wait(q_full, 0);
    arch::mbarrier_wait(full_k, 0);
    arch::wgmma_fence();
    issue_s(0);
    arch::wgmma_wait<0>(s);
    release(empty_k);
    {
      float unused[2];
      const int first_block = visits.tile(visits.end - 1);
      softmax(first_block, visits.full(visits.end - 1), unused, !kFlex && !unmasked.contains(first_block));
    }
    to_p();

    auto issue_pv = [&](int stage, unsigned phase) {
      arch::mbarrier_wait(full_v + stage, phase);
      const uint64_t v_desc = VTile::mn_major_desc(v_tile(stage), zero.b);
#pragma unroll
      for (int kk = 0; kk < BlockN / 16; ++kk)
        arch::wgmma_rs<T, HeadDimV, true>(acc_o, p_frag[kk], fa3::desc_advanced(v_desc, kk * 16 * 128), true);
      arch::wgmma_commit();
    };
    // The consumers' turns (ping-pong; round robin with three): a consumer issues its wgmma between waiting for its
    // turn and handing the turn to the next, so one's softmax runs while another's products do. The last consumer
    // hands consumer 0 the first turn, and hands none over after its last block: every barrier instance completes.
    // One consumer takes no turns.
    constexpr bool kTurns = Tr::kConsumers > 1;
    const bool last_consumer = consumer == Tr::kConsumers - 1;
    auto take_turn = [&] {
      if constexpr (kTurns) arch::named_barrier_sync(fa3::kSchedulerBarrier + consumer, 2 * fa3::kWarpgroupThreads);
    };
    auto hand_over_turn = [&] {
      if constexpr (kTurns)
        arch::named_barrier_arrive(fa3::kSchedulerBarrier + (consumer + 1) % Tr::kConsumers,
                                   2 * fa3::kWarpgroupThreads);
    };
    if (last_consumer) hand_over_turn();

    // Each step but the last issues the next block's S and this block's P V back to back, then computes the next
    // softmax while P V is in flight (intra-warpgroup overlap), then rescales O and converts P once it landed. The
    // loop has no branch around a wgmma: ptxas serializes wgmma on a path it cannot prove uniform (C7519).
    int it = 0;
    auto step = [&](int next_block, bool next_full, bool masked) {
      const int stage = it % Stages;
      const int next_stage = (it + 1) % Stages;
      take_turn();
      arch::wgmma_fence();  // s was read into P and O rescaled since the last wgmma
      arch::mbarrier_wait(full_k + next_stage, ((it + 1) / Stages) & 1);
      issue_s(next_stage);
      issue_pv(stage, (it / Stages) & 1);
      hand_over_turn();
      float correction[2];
      arch::wgmma_wait<1>(s);  // S of the next block; P V still in flight
      release(empty_k + next_stage);
      softmax(next_block, next_full, correction, masked);
      arch::wgmma_wait<0>(acc_o);
      release(empty_v + stage);
#pragma unroll
      for (int i = 0; i < Tr::kAccO; ++i) acc_o[i] *= correction[fa3::acc_row_step(i) / 8];
      to_p();
    };
    // The steps whose next block needs the mask and those whose next block does not, in two loops, step(true) and
    // step(false) (the unmasked blocks are one run of the range, so the outer loop turns at most twice): with the
    // mask's branch inside the step, ptxas placed P V's wait at the join after it, ahead of the softmax (1 of its 188
    // instructions in flight at d128 128 x 176, NVRTC 13.5); without it P V stays in flight across a third of the
    // softmax (FA3's overlap). Each run's last n_block is computed before it (a single compare per step).
    // A flex instance's steps take no such mask (its hook hides what is hidden): one loop over the visited blocks.
    if constexpr (kFlex) {
#pragma unroll 1
      for (int visit = visits.end - 1; visit > visits.begin; --visit, ++it)
        step(visits.tile(visit - 1), visits.full(visit - 1), false);
    } else {
      int n_block = n_range.end - 1;
      while (n_block > n_range.begin) {
        if (unmasked.contains(n_block - 1)) {
          const int stop = max(unmasked.begin, n_range.begin);
#pragma unroll 1
          for (; n_block > stop; --n_block, ++it) step(n_block - 1, false, false);
        } else {
          // Above the unmasked run (or all the way down when none is left below this block).
          const int stop = n_block - 1 >= unmasked.end ? max(unmasked.end, n_range.begin) : n_range.begin;
#pragma unroll 1
          for (; n_block > stop; --n_block, ++it) step(n_block - 1, false, true);
        }
      }
    }
    // The last block: P V alone.
    const int stage = it % Stages;
    take_turn();
    arch::wgmma_fence();
    issue_pv(stage, (it / Stages) & 1);
    if (!last_consumer) hand_over_turn();
    arch::wgmma_wait<0>(acc_o);
    release(empty_v + stage);
  }

  // lse of this thread's row `half` with row sum l: m * scale + log l (natural log), -inf where it saw no key.
  auto row_lse = [&](int half, float l) { return l > 0.f ? fmaf(row_max[half], kLn2, logf(l)) : neg_inf(); };
  // 1 / l and the lse of row `half`, joined by the head's sink logit where this block joins sinks (sink.cuh: with
  // split-KV, split 0's blocks).
  const RowSink sink = RowSink::of(p, info.head, blockIdx.x % p.num_kv_splits);
  auto row_result = [&](int half, float l, float& inv_l, float& lse_out) {
    inv_l = l > 0.f ? 1.f / l : 0.f;
    lse_out = row_lse(half, l);
    sink.join(inv_l, lse_out);
  };
  if (p.num_kv_splits > 1) {
    // Split-KV: this split's O / l and lse in float32 straight from the accumulators into out_accum and lse_accum
    // (fa2_split_kv_combine.cu merges the splits and rounds to T), 0 and -inf where the split saw no key of a row.
    // A runtime test outside the K/V loop (as fa2_tc_forward.cu's): the plain instances' step does not change.
    const int split = blockIdx.x % p.num_kv_splits;
    const long long part_row_stride = BlockInfo::dense_out_row_stride(p);
    float* out_part = info.out_accum_split(p, split) + row0 * part_row_stride;
    float* lse_part = info.lse_accum_split(p, split) + row0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = fa3::quad_sum(row_sum[half]);  // a quad shuffle: every lane, before the row test
      const int row = first_row + 8 * half;
      if (row >= block_rows) continue;
      float inv_l, lse_out;
      row_result(half, l, inv_l, lse_out);
#pragma unroll
      for (int j = 0; j < HeadDimV / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = fa3::acc_first_col(lane) + 8 * j + e;
          if (col < p.headdim_v)
            arch::store(out_part + row * part_row_stride + col, acc_o[4 * j + 2 * half + e] * inv_l);
        }
      if (lane % 4 == 0) arch::store(lse_part + row, lse_out);
    }
    return;
  }

  // Epilogue: O / l into this consumer's 64 rows of the Q buffer, then 16-byte stores. The named barrier first
  // orders the stores after every read of those rows by this warpgroup's wgmma (their reads land at one waiting
  // thread), then publishes the staged rows to the warpgroup's 128 threads.
  const unsigned named_barrier = fa3::kEpilogueBarrier + consumer;
  T* out = info.out<T>(p) + row0 * p.out_stride.row;
  float* lse = p.lse + info.row_stats_offset(p);
  arch::named_barrier_sync(named_barrier, fa3::kWarpgroupThreads);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = fa3::quad_sum(row_sum[half]);
    float inv_l, lse_out;
    row_result(half, l, inv_l, lse_out);
    const int row = first_row + 8 * half;
#pragma unroll
    for (int j = 0; j < HeadDimV / 8; ++j) {
      const int i = 4 * j + 2 * half;
      *reinterpret_cast<unsigned*>(q_tile + QTile::element_offset(row, fa3::acc_first_col(lane) + 8 * j)) =
          arch::pack_float2<T>(acc_o[i] * inv_l, acc_o[i + 1] * inv_l);
    }
    if (lane % 4 == 0 && row < block_rows) arch::store(lse + row0 + row, lse_out);
  }
  arch::named_barrier_sync(named_barrier, fa3::kWarpgroupThreads);
  const bool vector = fa3::rows_16b_aligned(out, p.out_stride.row);
  constexpr int kOutChunksPerRow = HeadDimV / fa3::kChunkElems;  // O's columns of the Q tile
#pragma unroll 1
  for (int c = thread; c < 64 * kOutChunksPerRow; c += fa3::kWarpgroupThreads) {
    const int row = group_row0 + c / kOutChunksPerRow;
    const int chunk = c % kOutChunksPerRow;
    if (row >= block_rows) break;  // rows grow with c
    const int valid = max(0, min(fa3::kChunkElems, p.headdim_v - chunk * fa3::kChunkElems));  // columns of out
    if (valid == 0) continue;
    const uint4 packed = *reinterpret_cast<const uint4*>(q_tile + QTile::chunk_offset(row, chunk));
    T* to = out + row * p.out_stride.row + chunk * fa3::kChunkElems;
    if (vector && valid == fa3::kChunkElems) {
      arch::store(reinterpret_cast<uint4*>(to), packed);
    } else {
      const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
      for (int e = 0; e < fa3::kChunkElems; ++e)  // unrolled: words[] stays in registers
        if (e < valid)
          arch::store(reinterpret_cast<unsigned short*>(to) + e,
                      static_cast<unsigned short>(words[e / 2] >> (16 * (e % 2))));
    }
  }
}

}  // namespace cuflash
