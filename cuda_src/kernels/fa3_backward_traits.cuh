// fa3_backward_traits.cuh: the tile traits of the warp-specialized Hopper backward (fa3_backward.cu). The layout,
// the producer's copy, the descriptors and the accumulator layout are the forward's (fa3_forward_traits.cuh).
#pragma once

#include "kernels/fa3_forward_traits.cuh"

namespace cuflash {
namespace fa3 {

// The backward's tile: a K/V block of BlockN keys (kConsumers = BlockN / 64 warpgroups, each owning 64 keys: the M of
// its S^T, dP^T, dV and dK products), Q blocks of BlockM rows streamed through a ring of Stages buffers.
template <int HeadDim, int BlockM, int BlockN, int Stages>
struct BackwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr int kConsumers = BlockN / 64;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  static constexpr int kConsumerWarps = kConsumers * 4;
  // setmaxnreg: as the forward (ForwardTraits): the producer keeps 40 (its copy loop and the row statistics), the
  // consumers share the rest, at most 240.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = consumer_registers(kConsumers, kProducerRegisters);
  static constexpr int kAccS = BlockM / 2;     // S^T and dP^T accumulator floats per thread (64 keys x BlockM)
  static constexpr int kAccD = HeadDim / 2;    // dK and dV
  static constexpr int kDqTiles = HeadDim / 64;  // dQ's N tiles of 64 head-dim columns (32 accumulators each)

  using KVTile = WgmmaTile<BlockN, HeadDim>;
  using QTile = WgmmaTile<BlockM, HeadDim>;   // Q and dO
  using DsTile = WgmmaTile<BlockN, BlockM>;   // dS^T [keys][queries], each consumer's 64 keys stored by it
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + KVTile::kBytes;
  static constexpr int kQOffset = kVOffset + KVTile::kBytes;            // [Stages]
  static constexpr int kDoOffset = kQOffset + Stages * QTile::kBytes;   // [Stages]
  static constexpr int kDsOffset = kDoOffset + Stages * QTile::kBytes;
  // Per stage, float32 lse log2(e) and D of the Q block's rows (rows past the sequence: +inf and 0).
  static constexpr int kStatsOffset = kDsOffset + DsTile::kBytes;
  static constexpr int kBarrierOffset = kStatsOffset + Stages * 2 * BlockM * 4;
  // kv_full, kv_empty, full[Stages], empty[Stages].
  static constexpr int kBarriers = 2 + 2 * Stages;
  static constexpr int kSmemBytes = kBarrierOffset + kBarriers * 8;

  static_assert(HeadDim % kPanelCols == 0 && HeadDim <= 256, "head dims of whole 64-column panels");
  static_assert(BlockN % 64 == 0 && kConsumers >= 1 && kConsumers <= 3, "1 to 3 consumer warpgroups of 64 keys");
  static_assert(BlockM == 64, "a Q block is dQ's wgmma M (64 queries) and one 64-column dS^T panel");
  static_assert(Stages >= 2, "the producer fills one stage while the consumers read another");
};

}  // namespace fa3
}  // namespace cuflash
