// fa3_backward_traits.cuh: the tile traits of the warp-specialized Hopper backward (fa3_backward.cu). The layout,
// the producer's copy, the descriptors and the accumulator layout are the forward's (fa3_forward_traits.cuh).
#pragma once

#include "kernels/fa3_forward_traits.cuh"

namespace cuflash {
namespace fa3 {

// The backward's tile: a K/V block of BlockN keys, Q blocks of BlockM rows streamed through a ring of Stages buffers.
// Two ways to share the products among the consumer warpgroups:
//   by keys (SplitHeadDim false; head dims up to 128): kConsumers = BlockN / 64 warpgroups, each owning 64 keys
//     (the M of its S^T, dP^T, dV and dK products), dK and dV of its keys whole in its registers;
//   by head dim (SplitHeadDim true; head dims past 128, where dK and dV of 64 keys whole are more floats a thread
//     than a consumer has: 256 at d256): one K/V block of 64 keys, two consumers; consumer c computes S^T and dP^T of
//     the 64 keys and its half of the Q block's queries (N = BlockM / 2), both store P^T and dS^T to shared memory,
//     and consumer c multiplies dV, dK and dQ for head-dim columns c HeadDim / 2 .. (c + 1) HeadDim / 2 - 1 from
//     there (FA3's d256 backward shares its two consumers' work so).
// HeadDimV: V's and dO's tile width, and dV's, where narrower than HeadDim (MLA's 192 / 128 on the d256 tile: dP^T
// sums over 128 columns, dV has 128; by head dim each consumer's half of them); HeadDim otherwise.
template <int HeadDim, int BlockM, int BlockN, int Stages, bool SplitHeadDim = false, int HeadDimV = HeadDim>
struct BackwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimV = HeadDimV;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr bool kSplitHeadDim = SplitHeadDim;
  static constexpr int kConsumers = SplitHeadDim ? 2 : BlockN / 64;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  static constexpr int kConsumerWarps = kConsumers * 4;
  // setmaxnreg: the producer needs more than 40 (its copy loop, the row statistics and the dQ writer's loop: at 40
  // ptxas kept the K/V loop's counter in local memory at d128, NVRTC 13.5), the consumers share the rest of the
  // block's launch allocation: with two, 504 - 56 = 2 x 224 per 128 threads (a producer of 48 leaves the same 224:
  // (504 - 48) / 2 rounds down to 8).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = consumer_registers(kConsumers, kProducerRegisters);
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * launch_registers(kThreads),
                "setmaxnreg: the roles take more than the block's launch allocation");
  static constexpr int kQueries = SplitHeadDim ? BlockM / 2 : BlockM;  // S^T's and dP^T's N: a consumer's queries
  static constexpr int kOutCols = SplitHeadDim ? HeadDim / 2 : HeadDim;     // dK's (and dQ's) N per consumer
  static constexpr int kOutColsV = SplitHeadDim ? HeadDimV / 2 : HeadDimV;  // dV's
  static constexpr int kAccS = kQueries / 2;   // S^T and dP^T accumulator floats per thread (64 keys x kQueries)
  static constexpr int kAccD = kOutCols / 2;   // dK (64 keys x kOutCols)
  static constexpr int kAccDV = kOutColsV / 2;  // dV (64 keys x kOutColsV)
  static constexpr int kDqTiles = HeadDim / 64;  // by keys: dQ's N tiles of 64 head-dim columns (32 floats each)
  using KVTile = WgmmaTile<BlockN, HeadDim>;   // K
  using VTile = WgmmaTile<BlockN, HeadDimV>;
  using QTile = WgmmaTile<BlockM, HeadDim>;    // Q
  using DoTile = WgmmaTile<BlockM, HeadDimV>;
  using DsTile = WgmmaTile<BlockN, BlockM>;   // dS^T [keys][queries] (by keys: each consumer's 64 keys stored by it)
  using PtTile = DsTile;                      // by head dim: P^T [keys][queries] too, both consumers' halves
  // The producer warpgroup: warps 0 .. 2 copy the tiles (kCopyThreads, one arrival each on a "full" barrier), warp
  // 3 is the dQ writer (bulk reduce-adds of the consumers' float32 dQ tiles into dq_accum; by head dim it has
  // nothing to do: the consumers add their dQ into dq_accum themselves, the shared memory a float32 dQ tile would
  // take, 67 KB at d256, being past what is left).
  static constexpr int kCopyThreads = kWarpgroupThreads - 32;
  // The float32 dQ tile [BlockM][kDqPitch] of a step (kDqBuffers of them): rows of HeadDim floats 8 apart in banks
  // (pitch HeadDim + 8), so a warp's 8-byte accumulator stores (4 pairs x 8 rows, 16 lanes a phase) hit 32
  // distinct banks; each row a 16-byte aligned run for one bulk reduce-add.
  static constexpr int kDqPitch = HeadDim + 8;
  static constexpr int kDqTileBytes = BlockM * kDqPitch * 4;
  static constexpr int kDqBuffers = SplitHeadDim ? 0 : 2;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + KVTile::kBytes;
  static constexpr int kQOffset = kVOffset + VTile::kBytes;             // [Stages]
  static constexpr int kDoOffset = kQOffset + Stages * QTile::kBytes;   // [Stages]
  static constexpr int kDsOffset = kDoOffset + Stages * DoTile::kBytes;
  static constexpr int kPtOffset = kDsOffset + DsTile::kBytes;          // by head dim only
  static constexpr int kDqOffset = kPtOffset + (SplitHeadDim ? PtTile::kBytes : 0);  // [kDqBuffers]
  // Per stage, float32 lse log2(e) and D of the Q block's rows (rows past the sequence: +inf and 0).
  static constexpr int kStatsOffset = kDqOffset + kDqBuffers * kDqTileBytes;
  static constexpr int kBarrierOffset = kStatsOffset + Stages * 2 * BlockM * 4;
  // kv_full, kv_empty, full[Stages], empty[Stages], dq_full[kDqBuffers], dq_empty[kDqBuffers].
  static constexpr int kBarriers = 2 + 2 * Stages + 2 * kDqBuffers;
  static constexpr int kSmemBytes = kBarrierOffset + kBarriers * 8;

  static_assert(HeadDim % kPanelCols == 0 && HeadDim <= 256, "head dims of whole 64-column panels");
  static_assert(HeadDimV % kPanelCols == 0 && HeadDimV <= HeadDim && (!SplitHeadDim || HeadDimV % 128 == 0),
                "v's head dim whole 64-column panels (by head dim: each consumer's half), at most q's");
  static_assert(BlockN % 64 == 0 && kConsumers >= 1 && kConsumers <= 3, "1 to 3 consumer warpgroups of 64 keys");
  static_assert(!SplitHeadDim || (BlockN == 64 && HeadDim % 128 == 0),
                "by head dim: one 64-key block, each consumer's half of the head dim whole 64-column panels");
  static_assert(BlockM == 64, "a Q block is dQ's wgmma M (64 queries) and one 64-column dS^T panel");
  static_assert(Stages >= 2, "the producer fills one stage while the consumers read another");
  static_assert(kDqOffset % 16 == 0 && (kDqPitch * 4) % 16 == 0, "dQ rows are 16-byte aligned bulk sources");
};

// The flex backward's P^T and dS^T of a user's mods (flex_hook.cuh's FlexHook with a score_mod; and the built-in
// softcap's, softcapped_gradients below), per score of S^T's raw q.k (s) once dP^T (dp) has landed: score' and d score'
// / d (scale x) from the form of the hook its tile needs (FlexHook::on_tile calls this with it), P^T = exp2(score'
// exponent_scale - lse), the gradient to score' g = P^T (dP^T - D) (added into the side arrays' gradients where the
// score_mod has some: FlexHook::side_grads, with the raw score it needs), dS^T = g slope; s becomes P^T and dp dS^T.
// Unlike the plain step, which forms P^T while dP^T is in flight, it holds the raw scores across that wait: no second
// float per score (the slope) outlives it. lse, dot: the stage's lse log2(e) and D from the lane's first query on;
// first_row (query), first_key: the lane's first score's.
template <int N, class Hook>
struct FlexGradientsEachScore {
  float (&s)[N];
  float (&dp)[N];
  const Hook& hook;
  const float* lse;
  const float* dot;
  int first_row;
  int first_key;
  float exponent_scale;  // log2 e for score' itself (FlexHook::kScaledScores), else scale log2 e
  template <class TileHook>
  __device__ __forceinline__ void operator()(const TileHook& tile) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int row = first_row + query_step<true>(i);
      const int key = first_key + key_step<true>(i);
      const float qk = s[i];
      float slope;
      const float score = tile(qk, row, key, slope);
      const float prob = arch::exp2_approx(fmaf(score, exponent_scale, -lse[query_step<true>(i)]));
      const float g = prob * (dp[i] - dot[query_step<true>(i)]);
      if constexpr (Hook::kHasSideGrads) hook.side_grads(g, qk, row, key);
      s[i] = prob;
      dp[i] = g * slope;
    }
  }
};

// The built-in softcap's step (mask.cuh's ScoreHook with softcap on, and ALiBi with it or not) in the flex form:
// once dP^T has landed, one pass forms the hook's score, P^T and dS^T = P^T (dP^T - D) (1 - tanh^2), the derivative
// from the tanh itself. ALiBi tested once a tile (each case its own copy of the pass, the hook's tests folded).
template <int N>
__device__ __forceinline__ void softcapped_gradients(float (&s)[N], float (&dp)[N], const ScoreHook& hook,
                                                     const float* lse, const float* dot, int first_row, int first_key,
                                                     float scale_log2) {
  const FlexGradientsEachScore<N, ScoreHook> each_score{s, dp, hook, lse, dot, first_row, first_key, scale_log2};
  if (hook.slope != 0.f)
    each_score(hook);
  else
    each_score(hook);
}

}  // namespace fa3
}  // namespace cuflash
