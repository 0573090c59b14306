// FlashAttention backward on Hopper (sm_90a) with wgmma: FA3's structure (a producer warpgroup filling a ring of
// stages guarded by mbarriers, consumer warpgroups computing the five products with wgmma, dK and dV in registers,
// dQ accumulated in float32). The main kernel of a three-launch program (fa3_backward.py): fa2's pre-pass
// (D = rowsum(dO * O), fa2_dout_dot_out_kernel) before it and fa2's convert kernel (dq = scale * the sum of the
// dq_accum slices) after it, with fa2's dq_accum scratch, layout and slice rules (fa2.py's backward_program_for).
//
// fa3_backward_kernel<T, HeadDim, BlockM, BlockN, Stages, Hooked, SplitHeadDim, HeadDimV, Hook>: grid = (X, nheads_k,
// batch); block x takes the K/V blocks x, x + X, ... of one kv head (fa2's rule: X = ceil(seqlen_k / BlockN), one
// K/V block each, dq_accum's one slice added to by atomics; deterministic mode: X = num_dq_splits, block x adding
// only into slice x, each element by one bulk reduce at a time, in program order). Per K/V block it loops over the
// query heads of its group (GQA/MQA: the group's dK/dV sum in registers, in a fixed order) and per head over the Q
// blocks that see the block (mask.cuh's q_blocks; a flex block mask's list of them: Hook below). Head dims: q's and
// k's, and v's (headdim_v, equal or its own: MLA-style) each up to HeadDim, the tile of the larger; V's and dO's
// columns past v's are zero-filled (dP^T's sum then ends at v's, dV's columns past it are zeros and not written),
// Q's and K's past q's likewise.
//   block = 1 + kConsumers warpgroups (fa3_backward_traits.cuh):
//     warpgroup 0, the producer (setmaxnreg down to 56): warps 0 .. 2 copy, warp 3 writes dQ, all walking the
//       same steps. K and V are copied once per K/V block, after the consumers' arrivals on "kv_empty" for the
//       previous one, then per step Q_i and dO_i, and lse_i log2(e) and D_i (rows past the sequence: +inf and 0, so
//       P = 0 there) into the next stage of a ring of kStages; the copiers wait on the stage's "empty" mbarrier (one
//       arrival per consumer warp) before refilling it. Two ways, chosen per call by the host (p.tma_loads, as the
//       forward's):
//       TMA (the host made q's, k's, v's and dout's tensor maps, in the __grid_constant__ params): warp 0 alone
//         copies (warps 1 and 2 exit); one elected lane arrives on "kv_full" / the stage's "full" expecting each
//         tile's bytes and issues one cp.async.bulk.tensor per 64-column panel holding any of the tensor's columns
//         (fa3::produce_tile_tma; the maps zero-fill rows past the array and columns past the head dim, and the
//         panels wholly past it, for which no box is issued, all threads zero once before the roles split; where
//         rows past a sequence are other data,
//         packed varlen sequences, a ragged last K/V or Q block is copied by warp 0's lanes with loads, zero-filled,
//         one arrival standing for the copy: the backward sums over keys and queries, and P's and dS's zeros would
//         not keep a NaN there out of dV, dK or dQ); its 32 lanes load the step's row
//         statistics (2 rows each, before the wait for the stage, so their latency hides behind it) and store them,
//         __syncwarp ordering the stores before the elected lane's arrival.
//       Loads (what TMA cannot address, callers without maps): warps 0 .. 2 (kCopyThreads) copy with 16-byte loads
//         (one in flight per thread: with two this producer spills) into the 128-byte swizzled panels wgmma reads
//         (fa3::produce_tile), the first 64 the row statistics, each thread arriving on the barrier after
//         fence.proxy.async.
//       warp 3, the dQ writer: per step, once every consumer warp has arrived on "dq_full" of the step's float32
//       dQ buffer (two, alternating), adds each valid row of it (d floats) into dq_accum's row with one bulk
//       reduce-add (cp.reduce.async.bulk .add.f32, the lanes taking rows in turn), waits for the reads
//       (wait_group.read) and hands the buffer back on "dq_empty"; before the next K/V block's reduces it waits for
//       its adds to complete (wait_group), so no two adds to one element are ever in flight together. Rows not
//       16-byte aligned (d not a multiple of 4): element adds (red.global.add.f32) from the buffer instead. A
//       reduce per row (64 a step, 512 bytes each at d128) rather than FA3's one per tile (its dq_accum laid out
//       in the accumulators' order): dq_accum keeps fa2's row layout, and fa2's convert kernel its one home.
//     warpgroups 1 .. kConsumers, the consumers (setmaxnreg up to kConsumerRegisters), consumer c owning keys
//       64 c .. 64 c + 63 of the block, so that the M of every product it issues is its 64 keys (S and dP computed
//       transposed, as FA3's "swapped" form) and dK, dV live in its registers whole:
//         S^T = K_c Q_i^T, dP^T = V_c dO_i^T     wgmma SS, both K-major (HeadDim / 16 steps of m64nBlockMk16;
//                                               dP^T HeadDimV / 16: v's own width, MLA's 128 on the d256 tile),
//                                               two commit groups: P^T is formed while dP^T is in flight
//         P^T = exp2(S^T scale log2 e - lse log2 e) (0 where the mask hides the score), dS^T = P^T (dP^T - D)
//                                               (Hooked: P^T of the hook's score, dS^T times its derivative;
//                                               with softcap both once dP^T has landed)
//         dV_c += P^T dO_i, dK_c += dS^T Q_i     wgmma RS: P^T and dS^T are A fragments straight from the
//                                               accumulators (as the forward's P: fa3::p_fragment), dO and Q read
//                                               MN-major from their stage (as the forward's V), BlockM / 16 steps of
//                                               m64nHeadDimk16
//         dQ_i += dS K                          wgmma SS (FA3's form): each consumer stores its 64 rows of dS^T
//                                               (16-bit, stmatrix) into the block's dS^T tile [BlockN][BlockM]; after a
//                                               barrier of all consumers, dQ's M is the Q block's 64 queries (dS^T
//                                               read MN-major as A), N 64 head-dim columns (K read MN-major as B),
//                                               the reduction all BlockN keys; head-dim tile t is the step's work of
//                                               consumer (t + Q block + head) % kConsumers (d128: one each; d64:
//                                               they take turns); the accumulators stored (8-byte pairs, 16 a
//                                               thread, bank-conflict free: rows kDqPitch = D + 8 floats apart) into
//                                               the step's dQ buffer once "dq_empty" says the writer has read its
//                                               previous use, fenced for the async proxy, then one arrival per warp
//                                               on "dq_full": no global atomics in the consumers
//       Why RS for dV and dK and SS for dQ: P^T and dS^T come out of S^T's and dP^T's accumulators with the keys as
//       rows, exactly the A operand (M = keys) of dV and dK, so they never touch shared memory; dQ reduces over the
//       keys that two consumers hold, and its operand dS must be read with the keys as its K dimension, which only
//       shared memory gives (wgmma's A from registers is the M x K fragment of the thread's own rows). dV and dK
//       land before dQ is issued (with both in flight ptxas spilled at d128 and serialized the wgmma).
//       Earlier forms: each consumer multiplying its own 64 keys into dQ (dS_c K_c, no barrier across consumers):
//       twice the atomics; dQ^T = K^T dS^T (M = the head dim): its accumulator pairs are two queries, a row apart in
//       dq_accum, so 32 scalar REDs at 16 addresses a step where dQ's pairs are adjacent columns (loop census: the
//       d128 step 596 instructions then); dQ's pairs added by the consumers themselves (red.global.add.v2.f32, 16
//       a thread a step: the d128 step 462 instructions, 453 with the shared stores and the dQ writer).
//       By head dim (SplitHeadDim, d256: dK and dV of 64 keys whole would be 256 floats a thread), FA3's d256
//       form: one 64-key block, consumer c computes S^T and dP^T of the 64 keys and queries 32 c .. 32 c + 31 (N =
//       32, K-major from its rows of the stage), forms P^T and dS^T of them and stores both (stmatrix) into the
//       block's P^T and dS^T tiles [64 keys][64 queries]; after a barrier of both consumers, all three of its
//       products read them from shared memory: dV_c += P^T dO[:, cols_c] and dK_c += dS^T Q[:, cols_c] (A
//       K-major, the reduction the 64 queries; B MN-major from its panels of the stage), dQ[:, cols_c] = dS
//       K[:, cols_c] (A the dS^T tile MN-major), cols_c = its half of the head dim (64 floats of dK, 64 of dV and
//       64 of dQ a thread), all in flight together. It adds its dQ into dq_accum with paired REDs
//       (red.global.add.v2.f32, 32 a thread a step): a float32 dQ tile (67 KB at d256) does not fit beside K, V
//       and two stages of Q and dO, so the dQ writer has nothing to do. A whole Q block inside the head dim adds
//       without a test; a ragged one or a head dim below 256 guards each add (rows past the block and columns
//       past the head dim are other rows of dq_accum).
//       The step's bookkeeping moves on without dividing (the next Q block, or the next head: dq_accum's rows and
//       whose turn each dQ tile is), and the stage's descriptors are stage 0's moved on by one add.
//   Epilogue (per consumer): dK_c * scale and dV_c rounded to T, stored from the accumulators (pairs of elements;
//   keys past the sequence and columns past the head dim not written).
//
// Shared memory (16-bit tiles in 64-column panels, fa3_forward_traits.cuh): K, V [BlockN][D]; Q, dO [Stages][BlockM]
// [D]; dS^T [BlockN][BlockM]; float32 dQ [2][BlockM][D + 8]; float32 lse, D [Stages][BlockM]; 2 + 2 Stages + 4
// mbarriers:
//   2 (2 BlockN D + 2 Stages BlockM D + BlockN BlockM) + 8 BlockM (D + 8) + 8 Stages BlockM + 8 (6 + 2 Stages) bytes
//   (d128 64 x 128, 2 stages: 144 KB + 68 KB + 1 KB + 80 B = 213 KB; d64 80 KB + 36 KB + 1 KB + 80 B). By head dim
//   (d256 64 x 64): K, V 64 KB, Q, dO 128 KB, P^T and dS^T 16 KB, no dQ buffer, 1 KB + 48 B = 209 KB; with V and dO
//   at HeadDimV (MLA's 128) their tiles at that width (K, V 48 KB, Q, dO 96 KB: 161 KB).
//
// What it costs, per block: K_j and V_j once; per visited (head, Q block) Q_i, dO_i, lse_i, D_i once and rows
// bulk reduce-adds of d float32 into dq_accum (rows x d adds, done by the L2, none by the consumers' threads; by
// head dim the consumers' REDs, rows x d / 2 paired adds);
// dK_j, dV_j written once. FLOPs: 5 products of
// 2 BlockM BlockN D each per visited pair.
//
// Requires softmax_scale > 0; rows that saw no key (lse = -inf) are taken as lse = +inf: P = 0.
#include "arch/arch.cuh"
#include "kernels/fa3_backward_traits.cuh"

namespace cuflash {

// Hooked: the instance applies mask.cuh's ScoreHook (softcap, ALiBi) to every score and its derivative to dS, as the
// forward's Hooked instances (a template flag: only problems with softcap or ALiBi run them). ALiBi alone: P^T is
// formed from the hook's scores while dP^T is in flight, as in the plain step (the derivative is 1). With softcap the
// raw scores wait for dP^T and one pass forms the hook's score, P^T and dS^T with the tanh's derivative, as a flex
// score_mod's step (fa3::softcapped_gradients): the derivative kept from before the wait took a float more per score
// than the consumers have (the d128 step spilled), and recovered from P after it a logarithm and 6 instructions a
// score. Which of them are on is tested once per tile.
// SplitHeadDim: the consumers share the head dim rather than the keys (fa3_backward_traits.cuh; head dims past 128).
// HeadDimV: V's, dO's and dV's tile width where narrower (MLA's 192 / 128 on the d256 tile: a fifth fewer FLOPs).
// Hook: ScoreHook, or flex_hook.cuh's FlexHook with a user's score_mod and mask_mod (cuflash.flex builds such an
// instance from a plain one: Hooked false). A flex call has no softcap, ALiBi or window (the kernel traps on them):
// the hook hides the scores past the sequence and the mask_mod's, so its steps run no element-wise mask of mask.cuh;
// with a block mask (FlexHook's BlockSparse) the producer, the dQ writer and the consumers walk its list of the Q
// blocks that see the K/V block (FlexHook::q_visits, the union over the group's heads), in the same order, and the
// mask_mod runs on its partial tiles only. Per step, a mask_mod alone hides its scores before P^T is formed (the
// plain step's overlap with dP^T; nothing at all on a full tile inside the sequence: FlexHook::idle_on); with a
// score_mod the raw scores wait for dP^T and one pass forms score', P^T, the side gradients and dS^T
// (fa3::FlexGradientsEachScore).
template <class T, int HeadDim, int BlockM, int BlockN, int Stages, bool Hooked = false, bool SplitHeadDim = false,
          int HeadDimV = HeadDim, class Hook = ScoreHook>
__global__ void __launch_bounds__((fa3::BackwardTraits<HeadDim, BlockM, BlockN, Stages, SplitHeadDim>::kThreads), 1)
    fa3_backward_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(arch::is_mma_operand<T>::value, "the wgmma backward takes __half or __nv_bfloat16");
  constexpr bool kFlex = !fa3::is_score_hook<Hook>::value;
  static_assert(!(Hooked && kFlex), "a flex instance is built from a plain one (its hook is the mods alone)");
  using Tr = fa3::BackwardTraits<HeadDim, BlockM, BlockN, Stages, SplitHeadDim, HeadDimV>;
  using QTile = typename Tr::QTile;
  using DoTile = typename Tr::DoTile;
  using KVTile = typename Tr::KVTile;
  using VTile = typename Tr::VTile;
  using DsTile = typename Tr::DsTile;
  using PtTile = typename Tr::PtTile;

  CUFLASH_DYNAMIC_SMEM(smem);
  if (launch_differs_from_traits<Tr::kSmemBytes, Tr::kThreads>() || p.headdim > HeadDim || p.headdim < 1 ||
      p.headdim_v > HeadDimV || p.headdim_v < 1 ||
      (p.num_dq_splits > 1 && p.num_dq_splits != static_cast<int>(gridDim.x)) ||
      (arch::smem_address(smem) & (fa3::kSwizzleAtomBytes - 1)) != 0 ||
      (!Hooked && (p.softcap_outer != 0.f || p.alibi_slopes != nullptr)) ||  // would drop them silently
      Hook::rejects(p))
    __trap();

  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo kv_info = BlockInfo::of_group(p, batch, kv_head, 0);
  const int seqlen_k = kv_info.seqlen_k(p);
  const int seqlen_q = kv_info.seqlen_q(p);
  const MaskPolicy mask = MaskPolicy::of(p, kv_info);
  const int group = BlockInfo::group_size(p);
  // This block's K/V blocks: blockIdx.x in atomic mode, every gridDim.x-th in deterministic mode, where the block
  // adds only into its own dq_accum slice (fa2's rule).
  const int slice = p.num_dq_splits > 1 ? blockIdx.x : 0;
  // Walked by their first key (key0 = the K/V block's index x BlockN): the loops keep no block index beside it
  // (with one, ptxas kept it in local memory in the consumers at 224 registers, d128).
  const int first_key0 = blockIdx.x * BlockN;
  const int key0_step = gridDim.x * BlockN;

  unsigned char* k_tile = smem + Tr::kKOffset;
  unsigned char* v_tile = smem + Tr::kVOffset;
  auto q_tile = [&](int stage) { return smem + Tr::kQOffset + stage * QTile::kBytes; };
  auto do_tile = [&](int stage) { return smem + Tr::kDoOffset + stage * DoTile::kBytes; };
  auto lse_rows = [&](int stage) { return reinterpret_cast<float*>(smem + Tr::kStatsOffset) + stage * 2 * BlockM; };
  auto dot_rows = [&](int stage) { return lse_rows(stage) + BlockM; };
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + Tr::kBarrierOffset);
  uint64_t* kv_full = barriers;
  uint64_t* kv_empty = barriers + 1;
  uint64_t* full = barriers + 2;
  uint64_t* empty = full + Stages;
  uint64_t* dq_full = empty + Stages;             // [kDqBuffers]: every consumer warp's part of the tile stored
  uint64_t* dq_empty = dq_full + Tr::kDqBuffers;  // [kDqBuffers]: the dQ writer has read the tile
  auto dq_tile = [&](int buffer) { return reinterpret_cast<float*>(smem + Tr::kDqOffset + buffer * Tr::kDqTileBytes); };

  const bool tma = p.tma_loads != 0;  // the host made q's, k's, v's and dout's tensor maps (fa3_forward_traits.cuh)
  if (tma) {
    // The panels wholly past q's and k's columns or v's and dout's, which no TMA copy fills (fa3::panels_holding),
    // zeroed for the products that sum over the head dim; fenced for the wgmma (async proxy) that read them, after
    // the barrier below. (The load paths write every column.)
    fa3::zero_panels_past<KVTile>(k_tile, p.headdim, threadIdx.x, Tr::kThreads);
    fa3::zero_panels_past<VTile>(v_tile, p.headdim_v, threadIdx.x, Tr::kThreads);
    for (int s = 0; s < Stages; ++s) {
      fa3::zero_panels_past<QTile>(q_tile(s), p.headdim, threadIdx.x, Tr::kThreads);
      fa3::zero_panels_past<DoTile>(do_tile(s), p.headdim_v, threadIdx.x, Tr::kThreads);
    }
    arch::fence_proxy_async();
  }
  if (threadIdx.x == 0) {
    const unsigned copy_arrivals = fa3::full_arrivals(tma, Tr::kCopyThreads);  // per copy
    arch::mbarrier_init(kv_full, 2 * copy_arrivals);     // K's and V's copies
    arch::mbarrier_init(kv_empty, Tr::kConsumerWarps);   // every consumer warp done with a K/V block
    for (int s = 0; s < Stages; ++s) {
      arch::mbarrier_init(full + s, 2 * copy_arrivals);  // Q's and dO's copies (the row statistics before Q's)
      arch::mbarrier_init(empty + s, Tr::kConsumerWarps);
    }
    for (int b = 0; b < Tr::kDqBuffers; ++b) {
      arch::mbarrier_init(dq_full + b, Tr::kConsumerWarps);
      arch::mbarrier_init(dq_empty + b, 1);  // lane 0 of the dQ writer, after its warp's reads
    }
    arch::fence_mbarrier_init();  // visible to the async proxy (the TMA's complete_tx) too
  }
  __syncthreads();

  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / fa3::kWarpgroupThreads), 0);
  const int thread = threadIdx.x % fa3::kWarpgroupThreads;
  const int d = p.headdim;  // q's, k's, dq's and dk's columns (v's, dout's and dv's: p.headdim_v, read where used)

  if (warpgroup == 0) {
    // ---- producer ----
    // Row row0 + r's lse log2(e) and D (rows past the sequence: +inf and 0, so P = 0 there; a row that saw no key,
    // lse -inf: +inf likewise).
    auto row_statistics = [&](const BlockInfo& info, int row0, int r, float& lse, float& dot) {
      lse = pos_inf();
      dot = 0.f;
      if (row0 + r < seqlen_q) {
        const long long at = info.row_stats_offset(p) + row0 + r;
        const float stored = arch::load(p.lse + at);
        lse = stored == neg_inf() ? pos_inf() : stored * kLog2e;
        dot = arch::load(p.dout_dot_out + at);
      }
    };
    arch::setmaxnreg_dec<Tr::kProducerRegisters>();
    const int d_v = p.headdim_v;
    // Warps 0 .. 2 copy (kCopyThreads); warp 3 is the dQ writer. Both walk the same steps (one loop: with a loop
    // each, ptxas kept the loop bounds in local memory across the setmaxnreg regions).
    // The dQ writer, per step, once the consumers' dQ tile is in its buffer: each valid row (d floats, 16-byte
    // aligned when d is a multiple of 4 and dq_accum is) added into dq_accum's row by one bulk reduce-add, the
    // lanes taking rows in turn; each lane's group waited for its reads, then the buffer handed back. Where the rows
    // are not 16-byte aligned, element adds (red.global.add.f32) from the tile instead. The reduces of one K/V block
    // touch distinct rows (one (head, Q block) a step); before the next K/V block's, the lanes wait for their adds
    // to complete (wait_group without .read): two adds to one element are never in flight together, each element is
    // added to in program order (deterministic mode: bitwise reruns).
    const bool dq_writer = thread >= Tr::kCopyThreads;
    const int writer_lane = thread - Tr::kCopyThreads;
    const bool bulk = d % 4 == 0 && (reinterpret_cast<unsigned long long>(p.dq_accum) & 15) == 0;
    int ring = 0, kv_round = 0;  // steps and K/V blocks with steps so far: the stages' and K/V's phases
    // TMA: warp 0 copies (one elected lane issues, all 32 load the row statistics); warps 1 and 2 have nothing to do.
    if (tma && thread >= 32 && !dq_writer) return;
    if (Tr::kDqBuffers == 0 && dq_writer) return;  // no dQ buffers (by head dim): the consumers add their own dQ
    const bool issuer = tma && thread < 32 && arch::elect_one_sync();
    // Where the rows past a sequence's keys (queries) are other data a map would read (packed varlen sequences), its
    // ragged last K/V block (Q block) is copied by warp 0 with loads, zero-filled, one arrival standing for the TMA
    // copy's: the backward sums over both, and P's and dS's zeros would not keep a NaN there out of dV, dK or dQ.
    const bool ragged_keys_by_loads = tma && BlockInfo::keys_end_inside_array(p);
    const bool ragged_rows_by_loads = tma && BlockInfo::queries_end_inside_array(p);
    constexpr auto kOnce = fa3::Arrival::kOnceByTheWarp;
#pragma unroll 1
    for (int key0 = first_key0; key0 < seqlen_k; key0 += key0_step) {
      const int block_keys = min(BlockN, seqlen_k - key0);
      // The Q blocks visited (those of the mask's range, or a flex block mask's list: the same for every head of
      // the group), a step's the visits.begin + step % m_blocks-th.
      const auto visits = Hook::q_visits(p, batch, kv_head, key0 / BlockN,
                                         mask.q_blocks<BlockM>(key0, key0 + block_keys));
      const int m_blocks = max(visits.end - visits.begin, 0);
      const int steps = group * m_blocks;  // (query head, Q block), heads outer
      if (steps == 0) continue;
      if (!dq_writer) {
        arch::mbarrier_wait(kv_empty, (kv_round & 1) ^ 1);
        if (tma && ragged_keys_by_loads && block_keys < BlockN) {
          const T* k = kv_info.k<T>(p) + key0 * p.k_stride.row;
          const T* v = kv_info.v<T>(p) + key0 * p.v_stride.row;
          fa3::produce_tile<KVTile, T, 32, 1, kOnce>(k_tile, k, p.k_stride.row, block_keys, d,
                                                     fa3::rows_16b_aligned(k, p.k_stride.row), thread, kv_full);
          fa3::produce_tile<VTile, T, 32, 1, kOnce>(v_tile, v, p.v_stride.row, block_keys, d_v,
                                                     fa3::rows_16b_aligned(v, p.v_stride.row), thread, kv_full);
        } else if (tma) {
          if (issuer) {
            fa3::produce_tile_tma<KVTile>(k_tile, fa3::tensor_map(p.tma.k), kv_info.key_tma_coords(p, key0), kv_head,
                                          d, kv_full);
            fa3::produce_tile_tma<VTile>(v_tile, fa3::tensor_map(p.tma.v), kv_info.key_tma_coords(p, key0), kv_head,
                                          d_v, kv_full);
          }
        } else {
          const T* k = kv_info.k<T>(p) + key0 * p.k_stride.row;
          const T* v = kv_info.v<T>(p) + key0 * p.v_stride.row;
          fa3::produce_tile<KVTile, T, Tr::kCopyThreads, 1>(k_tile, k, p.k_stride.row, block_keys, d,
                                                         fa3::rows_16b_aligned(k, p.k_stride.row), thread, kv_full);
          fa3::produce_tile<VTile, T, Tr::kCopyThreads, 1>(v_tile, v, p.v_stride.row, block_keys, d_v,
                                                         fa3::rows_16b_aligned(v, p.v_stride.row), thread, kv_full);
        }
      }
#pragma unroll 1
      for (int step = 0; step < steps; ++step, ++ring) {
        const int head = kv_info.head + step / m_blocks;
        const int row0 = visits.tile(visits.begin + step % m_blocks) * BlockM;
        const int rows = min(BlockM, seqlen_q - row0);
        const BlockInfo info = BlockInfo::of_group_head(batch, kv_head, head);
        if (dq_writer) {
          if constexpr (Tr::kDqBuffers > 0) {  // (without buffers the writer has returned)
            const int buffer = ring % Tr::kDqBuffers;
            const long long dq_row_stride = BlockInfo::dense_row_stride(p);
            float* dq = info.dq_accum(p, slice) + row0 * dq_row_stride;
            const float* tile = dq_tile(buffer);
            arch::mbarrier_wait(dq_full + buffer, (ring / Tr::kDqBuffers) & 1);
            if (bulk) {
#pragma unroll 1
              for (int r = writer_lane; r < rows; r += 32)
                arch::bulk_reduce_add_f32(dq + r * dq_row_stride, tile + r * Tr::kDqPitch,
                                          static_cast<unsigned>(4 * d));
              arch::tma_store_commit();
              arch::tma_store_wait_read<0>();
            } else {
#pragma unroll 1
              for (int e = writer_lane; e < rows * d; e += 32)
                arch::atomic_add(dq + (e / d) * dq_row_stride + e % d, tile[(e / d) * Tr::kDqPitch + e % d]);
            }
            __syncwarp();
            if (writer_lane == 0) arch::mbarrier_arrive(dq_empty + buffer);
          }
          continue;
        }
        const int stage = ring % Stages;
        if (tma) {
          // The statistics loaded before the wait for the stage: their latency hides behind it.
          float lse[BlockM / 32], dot[BlockM / 32];
#pragma unroll
          for (int r = 0; r < BlockM / 32; ++r) row_statistics(info, row0, thread + 32 * r, lse[r], dot[r]);
          arch::mbarrier_wait(empty + stage, ((ring / Stages) & 1) ^ 1);
#pragma unroll
          for (int r = 0; r < BlockM / 32; ++r) {
            lse_rows(stage)[thread + 32 * r] = lse[r];
            dot_rows(stage)[thread + 32 * r] = dot[r];
          }
          __syncwarp();
          if (ragged_rows_by_loads && rows < BlockM) {
            const T* q = info.q<T>(p) + row0 * p.q_stride.row;
            const T* dout = info.dout<T>(p) + row0 * p.dout_stride.row;
            fa3::produce_tile<QTile, T, 32, 1, kOnce>(q_tile(stage), q, p.q_stride.row, rows, d,
                                                      fa3::rows_16b_aligned(q, p.q_stride.row), thread, full + stage);
            fa3::produce_tile<DoTile, T, 32, 1, kOnce>(do_tile(stage), dout, p.dout_stride.row, rows, d_v,
                                                      fa3::rows_16b_aligned(dout, p.dout_stride.row), thread,
                                                      full + stage);
          } else if (issuer) {
            fa3::produce_tile_tma<QTile>(q_tile(stage), fa3::tensor_map(p.tma.q), info.q_tma_coords(p, row0), head,
                                        d, full + stage);
            fa3::produce_tile_tma<DoTile>(do_tile(stage), fa3::tensor_map(p.tma.dout), info.q_tma_coords(p, row0), head,
                                        d_v, full + stage);
          }
          continue;
        }
        arch::mbarrier_wait(empty + stage, ((ring / Stages) & 1) ^ 1);
        if (thread < BlockM) row_statistics(info, row0, thread, lse_rows(stage)[thread], dot_rows(stage)[thread]);
        const T* q = info.q<T>(p) + row0 * p.q_stride.row;
        const T* dout = info.dout<T>(p) + row0 * p.dout_stride.row;
        fa3::produce_tile<QTile, T, Tr::kCopyThreads, 1>(q_tile(stage), q, p.q_stride.row, rows, d,
                                                      fa3::rows_16b_aligned(q, p.q_stride.row), thread, full + stage);
        fa3::produce_tile<DoTile, T, Tr::kCopyThreads, 1>(do_tile(stage), dout, p.dout_stride.row, rows, d_v,
                                                      fa3::rows_16b_aligned(dout, p.dout_stride.row), thread,
                                                      full + stage);
      }
      if (dq_writer && bulk) arch::tma_store_wait<0>();
      ++kv_round;
    }
    return;
  }

  // ---- consumers ----
  arch::setmaxnreg_inc<Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = thread / 32;
  const int lane = thread % 32;
  // This consumer's share (fa3_backward_traits.cuh): by keys, its 64 keys; by head dim, its kQueries queries of S^T
  // and dP^T and its kOutCols columns of dV, dK and dQ.
  const int key_base = Tr::kSplitHeadDim ? 0 : consumer * 64;             // block-relative first key
  const int query_base = Tr::kSplitHeadDim ? consumer * Tr::kQueries : 0;  // block-relative first query of S^T
  const int col_base = Tr::kSplitHeadDim ? consumer * Tr::kOutCols : 0;    // first head-dim column of dK, dQ
  const int col_base_v = Tr::kSplitHeadDim ? consumer * Tr::kOutColsV : 0;  // of dV
  const int first_key = key_base + fa3::acc_first_row(warp, lane);        // block-relative, half 0
  const int first_col = query_base + fa3::acc_first_col(lane);            // query, block-relative
  const int out_col = col_base + fa3::acc_first_col(lane);                // head-dim column of dK (and dQ)
  const int out_col_v = col_base_v + fa3::acc_first_col(lane);            // of dV
  unsigned char* ds_tile = smem + Tr::kDsOffset;
  unsigned char* pt_tile = smem + Tr::kPtOffset;  // by head dim only
  // This lane's stmatrix rows of the dS^T and P^T tiles (fa3::store_fragment: a k16 step of this consumer's
  // kQueries a stmatrix): key stmatrix_row, query stmatrix_col (P^T's by head dim only: by keys it stays in
  // registers).
  const int stmatrix_key = key_base + fa3::stmatrix_row(warp, lane);
  const int stmatrix_query = query_base + fa3::stmatrix_col(lane);
  const unsigned ds_row = fa3::stmatrix_address<DsTile>(ds_tile, stmatrix_key, stmatrix_query);
  const unsigned pt_row =
      Tr::kSplitHeadDim ? fa3::stmatrix_address<PtTile>(pt_tile, stmatrix_key, stmatrix_query) : 0u;
  // Every consumer's barrier around the dS^T tile (the forward's scheduler ids: the backward takes no turns).
  constexpr unsigned kDsBarrier = fa3::kSchedulerBarrier;
  // A stage's Q and dO are read once this thread's wait covering dV and dK's group is behind it: one arrival per
  // warp on the stage's empty barrier.
  auto release = [&](uint64_t* bar) {
    __syncwarp();
    if (lane == 0) arch::mbarrier_arrive(bar);
  };

  int ring = 0, kv_round = 0;  // as the producer's
#pragma unroll 1
  for (int key0 = first_key0; key0 < seqlen_k; key0 += key0_step) {
    const int block_keys = min(BlockN, seqlen_k - key0);
    const auto visits = Hook::q_visits(p, batch, kv_head, key0 / BlockN,
                                       mask.q_blocks<BlockM>(key0, key0 + block_keys));  // as the producer's
    // The block's first key of this consumer's tile and of this lane's scores, which the step's mask and hooks take:
    // with key0 itself kept across the steps, ptxas spilled it at d128 (NVRTC 13.5: 4 bytes, a reload a step).
    const int tile_key0 = key0 + key_base, lane_key0 = key0 + first_key;
    const int m_blocks = max(visits.end - visits.begin, 0);
    const int steps = group * m_blocks;
    float acc_dk[Tr::kAccD], acc_dv[Tr::kAccDV];
#pragma unroll
    for (int i = 0; i < Tr::kAccD; ++i) acc_dk[i] = 0.f;
#pragma unroll
    for (int i = 0; i < Tr::kAccDV; ++i) acc_dv[i] = 0.f;

    if (steps > 0) {
      const float scale_log2 = p.softmax_scale_log2;
      // Descriptors made once per K/V block (K_c, V_c; this consumer's dS^T; K_c MN-major for dQ; Q and dO of stage
      // 0, K- and MN-major), each stage's and each product's steps moved on from them by desc_advanced (stage: one
      // add; k16 steps: compile-time offsets), their high words in registers (fa3::desc_unfolded, with A's zero or
      // B's: 444 -> 385 instructions a d128 step). One zero for both where the d128 step holds a hook (census, NVRTC
      // 13.5: hooked 437 with one, 472 with two; flex document mask 440 and 466).
      const fa3::DescZeros zero = fa3::DescZeros::read<!(HeadDim == 128 && (Hooked || kFlex))>();
      const uint64_t k_desc = KVTile::k_major_desc(k_tile, key_base, zero.a);
      const uint64_t v_desc = VTile::k_major_desc(v_tile, key_base, zero.a);
      // K as dQ's B (N = the head dim, contiguous)
      const uint64_t k_mn_desc = KVTile::mn_major_desc(k_tile, zero.b);
      const uint64_t ds_desc = DsTile::mn_major_desc(ds_tile, zero.a);
      // By head dim: P^T and dS^T as K-major A operands (M the keys, K the queries).
      const uint64_t pt_desc = PtTile::k_major_desc(pt_tile, 0, zero.a);
      const uint64_t ds_k_desc = DsTile::k_major_desc(ds_tile, 0, zero.a);
      // By head dim, this thread's dQ adds: its first query of dQ's M, the head-dim columns left from out_col,
      // whether its consumer's columns all lie inside the head dim (d256), pairs where d is even and dq_accum 8-byte
      // aligned.
      const long long dq_row_stride = BlockInfo::dense_row_stride(p);
      const int dq_query = fa3::acc_first_row(warp, lane);
      const int cols_left = d - out_col;
      const bool whole_cols = d - col_base >= Tr::kOutCols;
      const bool dq_pairs = d % 2 == 0 && (reinterpret_cast<unsigned long long>(p.dq_accum) & 7) == 0;
      // This thread's first dQ element in the group's first query head (kv_info's); a step adds d floats per head
      // past that one and dq_row_stride per row of its Q block. Made once: the REDs are asm with a memory clobber, so
      // the address made from the step's BlockInfo (params and cu_seqlens read again) cost 25 instructions a step.
      float* const dq_first = kv_info.dq_accum(p, slice) + dq_query * dq_row_stride + out_col;
      const uint64_t q_desc0 = QTile::k_major_desc(q_tile(0), query_base, zero.b);
      const uint64_t do_desc0 = DoTile::k_major_desc(do_tile(0), query_base, zero.b);
      const uint64_t q_mn_desc0 = QTile::mn_major_desc(q_tile(0), zero.b);
      const uint64_t do_mn_desc0 = DoTile::mn_major_desc(do_tile(0), zero.b);
      // The step's (head, Q block), moved on step by step (no division by m_blocks): Q blocks inner, heads outer, as
      // the producer's. Head-dim tile t of dQ is consumer (t + Q block + head) % kConsumers' work: this consumer's
      // are the tiles t with t % kConsumers == dq_mine. dq_lane: this thread's first element of a dQ buffer (query
      // acc_first_row, column first_col). visit: the step's position in the visits (a block mask's list; without
      // one m_block is its own position and visit goes unused).
      int head = kv_info.head, visit = visits.begin, m_block = visits.tile(visit);
      const int dq_lane = fa3::acc_first_row(warp, lane) * Tr::kDqPitch + first_col;
      auto tiles_of_this_consumer = [&] {
        return (consumer + Tr::kConsumers - (m_block + head) % Tr::kConsumers) % Tr::kConsumers;
      };
      int dq_mine = tiles_of_this_consumer();
      arch::mbarrier_wait(kv_full, kv_round & 1);
#pragma unroll 1
      for (int step = 0; step < steps; ++step, ++ring) {
        const int stage = ring % Stages;
        const int row0 = m_block * BlockM;
        const int rows = min(BlockM, seqlen_q - row0);
        arch::mbarrier_wait(full + stage, (ring / Stages) & 1);
        const unsigned stage_bytes = stage * QTile::kBytes;
        const unsigned do_stage_bytes = stage * DoTile::kBytes;
        const uint64_t q_desc = fa3::desc_advanced(q_desc0, stage_bytes);
        const uint64_t do_desc = fa3::desc_advanced(do_desc0, do_stage_bytes);
        const uint64_t q_mn_desc = fa3::desc_advanced(q_mn_desc0, stage_bytes);
        const uint64_t do_mn_desc = fa3::desc_advanced(do_mn_desc0, do_stage_bytes);

        // S^T and dP^T, two groups.
        float s[Tr::kAccS], dp[Tr::kAccS];
        arch::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HeadDim / 16; ++ks)
          arch::wgmma<T, Tr::kQueries>(s, fa3::desc_advanced(k_desc, KVTile::k_major_step_bytes(ks)),
                                       fa3::desc_advanced(q_desc, QTile::k_major_step_bytes(ks)), ks > 0);
        arch::wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < HeadDimV / 16; ++ks)
          arch::wgmma<T, Tr::kQueries>(dp, fa3::desc_advanced(v_desc, VTile::k_major_step_bytes(ks)),
                                       fa3::desc_advanced(do_desc, DoTile::k_major_step_bytes(ks)), ks > 0);
        arch::wgmma_commit();

        // Register i: key first_key + acc_row_step(i), query first_col + acc_col_step(i).
        const float* lse = lse_rows(stage);
        const float* dot = dot_rows(stage);
        const BlockInfo head_info = BlockInfo::of_group_head(batch, kv_head, head);  // the step's query head
        const int tile_row0 = row0 + query_base;  // this consumer's first query (by head dim; else the block's)
        const Hook mods = fa3::score_hook_of<Hook, kFlex>(p, head_info);  // flex: the user's mods (opening comment)
        const bool full = visits.full(visit);  // (a block mask's full flag holds for any part of a full tile)
        if constexpr (kFlex && !Hook::kMaskOnly) {
          // A score_mod: the raw scores wait for dP^T, then one pass forms score', P^T, g and dS^T, in the hook's
          // form for this consumer's part of the tile.
          arch::wgmma_wait<1>(s);
          arch::wgmma_wait<0>(dp);
          mods.template on_tile<Hook::kScaledScores, true>(
              full, tile_row0, Tr::kQueries, tile_key0, 64,
              fa3::FlexGradientsEachScore<Tr::kAccS, Hook>{s, dp, mods, lse + first_col, dot + first_col,
                                                            row0 + first_col, lane_key0,
                                                            Hook::kScaledScores ? kLog2e : scale_log2});
        } else {
          // ALiBi: the step's head's slope, the sequence's diagonal (any head of the group's kv_info). The element-wise
          // mask only on tiles that cross an edge (block-uniform tests, outside the scores' loop), the forward's
          // per-lane limits on the transposed tile (with visible() per score the masked step took 830 instructions at
          // d128, 224 registers), after the hook: softcap of a hidden score is no hidden score. By head dim the tile
          // is this consumer's queries (at least one row asked: a half wholly past the sequence has P = 0 from its
          // lse of +inf whatever the mask says). A flex hook has hidden what is hidden.
          const float alibi_slope = Hooked ? ScoreHook::of(p, head_info).slope : 0.f;
          const ScoreHook hook{p, kv_info, alibi_slope};
          const int tile_rows = Tr::kSplitHeadDim ? max(1, min(Tr::kQueries, rows - query_base)) : rows;
          bool softcapped = false;
          if constexpr (Hooked) softcapped = hook.softcapped();
          if (softcapped) {
            // Softcap (ALiBi with it or not): as a score_mod, one pass once dP^T has landed forms the hook's score,
            // P^T and dS^T with the derivative from the tanh itself (fa3::softcapped_gradients), then the mask zeroes
            // both where it hides the score. (P^T formed while dP^T was in flight, the derivative recovered from P
            // after the wait cost a logarithm and 6 instructions a score: the d128 step 981 instructions, 733 so.)
            arch::wgmma_wait<1>(s);
            arch::wgmma_wait<0>(dp);
            fa3::softcapped_gradients(s, dp, hook, lse + first_col, dot + first_col, row0 + first_col, lane_key0,
                                      scale_log2);
            if (mask.tile_needs_mask(tile_row0, tile_rows, tile_key0, 64)) {
              const TileEdges edges = mask.tile_edges(tile_row0, tile_rows, tile_key0, 64);
              fa3::mask_scores<true>(s, mask, edges, row0 + first_col, lane_key0, 0.f);
              fa3::mask_scores<true>(dp, mask, edges, row0 + first_col, lane_key0, 0.f);
            }
          } else {
            // P^T while dP^T is in flight (Hooked: of the ALiBi scores, whose derivative is 1; a flex mask_mod alone:
            // hidden ones hidden first), then dS^T once it landed.
            arch::wgmma_wait<1>(s);
            if constexpr (Hooked) fa3::hook_scores<true>(s, hook, row0 + first_col, lane_key0);
            // (No FullForm for a mask_mod alone: idle_on already covers a full tile inside the sequence.)
            if constexpr (kFlex)
              if (!mods.idle_on(full, tile_row0, Tr::kQueries, tile_key0, 64))
                mods.template on_tile<false, false>(full, tile_row0, Tr::kQueries, tile_key0, 64,
                                                   fa3::HookEachScore<Tr::kAccS, true>{s, row0 + first_col,
                                                                                       lane_key0});
#pragma unroll
            for (int i = 0; i < Tr::kAccS; ++i)
              s[i] = arch::exp2_approx(fmaf(s[i], scale_log2, -lse[first_col + fa3::acc_col_step(i)]));
            if (!kFlex && mask.tile_needs_mask(tile_row0, tile_rows, tile_key0, 64))
              fa3::mask_scores<true>(s, mask, mask.tile_edges(tile_row0, tile_rows, tile_key0, 64),
                                     row0 + first_col, lane_key0, 0.f);
            arch::wgmma_wait<0>(dp);
#pragma unroll
            for (int i = 0; i < Tr::kAccS; ++i) dp[i] = s[i] * (dp[i] - dot[first_col + fa3::acc_col_step(i)]);
          }
        }
        if constexpr (Tr::kSplitHeadDim) {
          // P^T and dS^T of this consumer's queries into the block's tiles [keys][queries]: every consumer thread is
          // past its wait for the previous step's products (which read both tiles) at the first barrier; the stores
          // are fenced for wgmma and published to both consumers by the second.
          arch::named_barrier_sync(kDsBarrier, Tr::kConsumers * fa3::kWarpgroupThreads);
#pragma unroll
          for (int kk = 0; kk < Tr::kQueries / 16; ++kk) {
            unsigned p_frag[4], ds_frag[4];
            fa3::p_fragment<T>(p_frag, s, kk);
            fa3::p_fragment<T>(ds_frag, dp, kk);
            fa3::store_fragment<Tr::kQueries / 16>(pt_row, p_frag, kk);
            fa3::store_fragment<Tr::kQueries / 16>(ds_row, ds_frag, kk);
          }
          arch::fence_proxy_async();
          arch::named_barrier_sync(kDsBarrier, Tr::kConsumers * fa3::kWarpgroupThreads);

          // This consumer's columns: dV += P^T dO, dK += dS^T Q (A K-major from the tiles: M the 64 keys, the
          // reduction all BlockM queries; B its panels of dO and Q, MN-major), then dQ = dS K (A the dS^T tile read
          // MN-major: M the queries, the reduction the 64 keys; B its panels of K), all three in flight together
          // (no fragment is live: P^T and dS^T are in shared memory).
          const unsigned q_cols = (col_base / fa3::kPanelCols) * QTile::kPanelBytes;
          const unsigned do_cols = (col_base_v / fa3::kPanelCols) * DoTile::kPanelBytes;
          const unsigned kv_cols = (col_base / fa3::kPanelCols) * KVTile::kPanelBytes;
          float dq[Tr::kAccD];  // declared before the fence that covers all three products
          arch::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BlockM / 16; ++kk)
            arch::wgmma<T, Tr::kOutColsV, false, true>(
                acc_dv, fa3::desc_advanced(pt_desc, PtTile::k_major_step_bytes(kk)),
                fa3::desc_advanced(do_mn_desc, do_cols + kk * 16 * 128), true);
#pragma unroll
          for (int kk = 0; kk < BlockM / 16; ++kk)
            arch::wgmma<T, Tr::kOutCols, false, true>(
                acc_dk, fa3::desc_advanced(ds_k_desc, DsTile::k_major_step_bytes(kk)),
                fa3::desc_advanced(q_mn_desc, q_cols + kk * 16 * 128), true);
          arch::wgmma_commit();
#pragma unroll
          for (int kk = 0; kk < BlockN / 16; ++kk)
            arch::wgmma<T, Tr::kOutCols, true, true>(dq, fa3::desc_advanced(ds_desc, kk * 16 * 128),
                                                     fa3::desc_advanced(k_mn_desc, kv_cols + kk * 16 * 128), kk > 0);
          arch::wgmma_commit();
          arch::wgmma_wait<0>(dq);
          arch::wgmma_wait<0>(acc_dk);
          arch::wgmma_wait<0>(acc_dv);
          release(empty + stage);  // the stage's Q and dO are read

          // dQ into dq_accum's rows (unscaled: convert applies the scale) by this thread's atomics: register i is
          // query dq_query + acc_row_step(i), column out_col + acc_col_step(i); i, i + 1 (i even) adjacent columns,
          // one paired add where d is even. A whole Q block with this consumer's columns inside the head dim (every
          // step but a sequence's last at d256) adds without a test; otherwise each add is guarded (rows past the
          // Q block and columns past the head dim are other rows of dq_accum, and dQ there need not be 0: a NaN key
          // gives NaN). Each element of a slice is added by one thread, in program order (deterministic mode:
          // bitwise reruns).
          float* dq_at = dq_first + (head - kv_info.head) * d + row0 * dq_row_stride;
          auto dq_element = [&](int i) {
            return dq_at + fa3::acc_row_step(i) * dq_row_stride + fa3::acc_col_step(i);
          };
          if (dq_pairs && whole_cols && rows == BlockM) {
#pragma unroll
            for (int i = 0; i < Tr::kAccD; i += 2) arch::atomic_add2(dq_element(i), dq[i], dq[i + 1]);
          } else {
#pragma unroll  // (dq indexed at run time would live in local memory)
            for (int i = 0; i < Tr::kAccD; i += 2) {
              if (dq_query + fa3::acc_row_step(i) >= rows || fa3::acc_col_step(i) >= cols_left) continue;
              if (dq_pairs) {
                arch::atomic_add2(dq_element(i), dq[i], dq[i + 1]);
              } else {
                arch::atomic_add(dq_element(i), dq[i]);
                if (fa3::acc_col_step(i) + 1 < cols_left) arch::atomic_add(dq_element(i) + 1, dq[i + 1]);
              }
            }
          }
        } else {
          unsigned p_frag[BlockM / 16][4], ds_frag[BlockM / 16][4];
#pragma unroll
          for (int kk = 0; kk < BlockM / 16; ++kk) {
            fa3::p_fragment<T>(p_frag[kk], s, kk);
            fa3::p_fragment<T>(ds_frag[kk], dp, kk);
          }

          // dS^T into the block's tile (this consumer's 64 key rows): every consumer thread is past its wait for the
          // previous step's dQ (which read the whole tile) at the first barrier; the stores are fenced for wgmma and
          // published to every consumer by the second.
          arch::named_barrier_sync(kDsBarrier, Tr::kConsumers * fa3::kWarpgroupThreads);
#pragma unroll
          for (int kk = 0; kk < BlockM / 16; ++kk) fa3::store_fragment<Tr::kQueries / 16>(ds_row, ds_frag[kk], kk);
          arch::fence_proxy_async();

          // dV += P^T dO, dK += dS^T Q: one group, in flight across the barrier.
          arch::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BlockM / 16; ++kk)
            arch::wgmma_rs<T, HeadDimV, true>(acc_dv, p_frag[kk], fa3::desc_advanced(do_mn_desc, kk * 16 * 128), true);
#pragma unroll
          for (int kk = 0; kk < BlockM / 16; ++kk)
            arch::wgmma_rs<T, HeadDim, true>(acc_dk, ds_frag[kk], fa3::desc_advanced(q_mn_desc, kk * 16 * 128), true);
          arch::wgmma_commit();
          arch::named_barrier_sync(kDsBarrier, Tr::kConsumers * fa3::kWarpgroupThreads);
          // dV and dK land before dQ is issued: with both in flight (P^T's and dS^T's fragments live beside dQ's
          // accumulators) ptxas spilled 12 bytes at d128 and serialized the wgmma (C7512, NVRTC 13.5).
          arch::wgmma_wait<0>(acc_dk);
          arch::wgmma_wait<0>(acc_dv);
          release(empty + stage);  // the stage's Q and dO are read

          // dQ_i += dS K over all BlockN keys (FA3's form: M = the Q block's 64 queries, the reduction every key of
          // the block, both consumers' rows of dS^T), one 64-column tile of the head dim per wgmma N: tile t is this
          // step's work of consumer (t + Q block + head) % kConsumers (d128, two consumers: one tile each; d64: the
          // consumers take turns). dS is read from the dS^T tile as an MN-major A (the queries contiguous), K as an
          // MN-major B (the head dim). The accumulators go to the step's float32 dQ buffer (unscaled: convert applies
          // the scale) once the dQ writer has read its previous use; every consumer warp then hands the buffer over
          // (its stores fenced for the writer's bulk reduce, which reads through the async proxy).
          const int dq_buffer = ring % Tr::kDqBuffers;
          arch::mbarrier_wait(dq_empty + dq_buffer, ((ring / Tr::kDqBuffers) & 1) ^ 1);
          float* dq_out = dq_tile(dq_buffer) + dq_lane;
#pragma unroll
          for (int t = 0; t < Tr::kDqTiles; ++t) {
            if (t % Tr::kConsumers != dq_mine) continue;
            float dq[fa3::kPanelCols / 2];
            arch::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BlockN / 16; ++kk)
              arch::wgmma<T, fa3::kPanelCols, true, true>(
                  dq, fa3::desc_advanced(ds_desc, kk * 16 * 128),
                  fa3::desc_advanced(k_mn_desc, t * KVTile::kPanelBytes + kk * 16 * 128), kk > 0);
            arch::wgmma_commit();
            arch::wgmma_wait<0>(dq);
            // Register i: query acc_first_row + acc_row_step(i), head-dim column 64 t + first_col + acc_col_step(i):
            // registers i, i + 1 (i even) are adjacent columns, one 8-byte store (bank-conflict free: kDqPitch).
#pragma unroll
            for (int i = 0; i < fa3::kPanelCols / 2; i += 2)
              *reinterpret_cast<float2*>(dq_out + ((i / 2) % 2 ? 8 * Tr::kDqPitch : 0) + 64 * t +
                                         fa3::acc_col_step(i)) = make_float2(dq[i], dq[i + 1]);
          }
          arch::fence_proxy_async();
          release(dq_full + dq_buffer);

        }

        // The next step: the next Q block of this head, or the first of the next head.
        if constexpr (Hook::kBlockSparse) {
          if (++visit == visits.end) {
            visit = visits.begin;
            ++head;
          }
          m_block = visits.tile(visit);  // not the next block: whose dQ tiles are whose found anew
          dq_mine = tiles_of_this_consumer();
        } else if (++m_block < visits.end) {
          dq_mine = (dq_mine + Tr::kConsumers - 1) % Tr::kConsumers;
        } else {
          m_block = visits.begin;
          ++head;
          dq_mine = tiles_of_this_consumer();
        }
      }
      arch::wgmma_wait<0>(acc_dk);
      arch::wgmma_wait<0>(acc_dv);
      release(kv_empty);  // every wgmma reading this K/V block is behind this thread's waits
      ++kv_round;
    }

    // Epilogue: dK * scale and dV, element by element (keys past the sequence, columns past each one's head dim
    // skipped).
    // The params' fields read once, into registers: the producer takes the maps' addresses in param space, so a
    // store through a generic pointer may, as the compiler sees it, write the params, and a field read after one
    // is read again (the epilogue's strides per store: twice the kernel's code, IMAD-heavy).
    const float softmax_scale = p.softmax_scale;
    const long long dk_row_stride = p.dk_stride.row, dv_row_stride = p.dv_stride.row;
    const int d_v = p.headdim_v;  // dv's columns (dk's: d)
    T* dk = kv_info.dk<T>(p) + key0 * dk_row_stride;
    T* dv = kv_info.dv<T>(p) + key0 * dv_row_stride;
    // (dV's registers are the first kAccDV of the same layout: one loop, dV's stores past them folded away.)
#pragma unroll
    for (int i = 0; i < Tr::kAccD; ++i) {
      const int key = first_key + fa3::acc_row_step(i);
      const int col = out_col + fa3::acc_col_step(i);
      const int col_v = out_col_v + fa3::acc_col_step(i);
      // Both tests per store: with a `continue` for the keys past the block the d128 hooked instance spilled 56 bytes.
      if (key < block_keys && col < d)
        arch::store(reinterpret_cast<unsigned short*>(dk + key * dk_row_stride + col),
                    static_cast<unsigned short>(arch::pack_float2<T>(acc_dk[i] * softmax_scale, 0.f) & 0xffffu));
      if (i < Tr::kAccDV && key < block_keys && col_v < d_v)
        arch::store(reinterpret_cast<unsigned short*>(dv + key * dv_row_stride + col_v),
                    static_cast<unsigned short>(arch::pack_float2<T>(acc_dv[i < Tr::kAccDV ? i : 0], 0.f) & 0xffffu));
    }
  }
}

}  // namespace cuflash
