// flex_hook.cuh: a user's score_mod and mask_mod (cuflash.flex) as the score hook of the fa2 kernels.
//
// The fa2 kernels (SIMT and tensor-core, forward and backward) and the Hopper ones (fa3_forward.cu, fa3_backward.cu)
// take their per-score transform as a template parameter, `Hook`, defaulting to mask.cuh's ScoreHook (softcap, ALiBi).
// FlexHook<ScoreMod, MaskMod> is the other one: it computes what a FlexAttention kernel computes for each score,
//     score' = mask_mod(b, h, q_idx, kv_idx) ? score_mod(scale q.k, b, h, q_idx, kv_idx) : -inf,
// with h the query head and q_idx / kv_idx positions in the sequence. The hook interface is the kernels' one: they
// pass x = q.k and fold the softmax scale into their exponents, so the hook returns score' / scale and, for the
// backward, d score' / d (scale x) = ScoreMod::dscore (0 for a hidden score); a kernel may instead take score'
// itself where a score_mod makes it (kScaledScores: the tensor-core kernels, exponentiating by log2 e). This is the
// one place that converts between the mods' convention (the scaled score) and the kernels' (the score over scale).
//
// A hidden score is -inf, so its P is exp2(-inf) = 0 in the forward and the backward; a row that sees no key ends with
// l = 0 (out 0, lse -inf), which the backward stages as lse +inf (zero gradients), as for the built-in masks. Scores
// past the sequence (rows >= seqlen_q, keys >= seqlen_k, which a tile holds at its edges) are hidden here before any
// mod runs, so no mod reads a side array at an index the caller never asked for; the tensor-core kernels and the SIMT
// forward take the hook per tile (on_tile), and only tiles crossing the sequence's end test it per score (the SIMT
// backward, float32, tests every score). The kernels still apply their MaskPolicy (no window, no causal: the API passes
// none with mods), so that test costs as before.
//
// Side arrays: the score_mod reads p.flex_sides.arrays[0 .. ScoreMod::kSides), the mask_mod the next
// MaskMod::kSides (each mod indexes its own from 0: the mask_mod sees a Sides starting at its first array).
// Gradients to them (ScoreMod::kHasSideGrads): side_grads(g, x, row, key) with g = d loss / d score' =
// P (dP - D), added atomically into p.flex_side_grads (float32), or deterministically into per-warp slices.
#pragma once

#include "common/flex_mod.cuh"
#include "common/mask.cuh"

namespace cuflash::flex {

// The score_mod of a call without one, and the mask_mod of a call without one.
struct NoScoreMod {
  static constexpr int kSides = 0;
  static constexpr bool kHasSideGrads = false;
  static constexpr float kScoreFactor = 1.f;
};
struct NoMaskMod {
  static constexpr int kSides = 0;
};

// Whether M is a real mod (not NoScoreMod / NoMaskMod); NVRTC has no <type_traits>.
template <class M> struct is_mod { static constexpr bool value = true; };
template <> struct is_mod<NoScoreMod> { static constexpr bool value = false; };
template <> struct is_mod<NoMaskMod> { static constexpr bool value = false; };

// The tiles a block mask lists for one row tile (attention_params.cuh's flex::TileVisits): i-th visited tile and
// whether it is full, for i in [0, count).
struct TileListVisits {
  const int* indices;
  const int* full_flags;
  int begin;
  int end;
  __device__ __forceinline__ bool empty() const { return end <= begin; }
  __device__ __forceinline__ int tile(int i) const { return arch::load(indices + i); }
  __device__ __forceinline__ bool full(int i) const { return arch::load(full_flags + i) != 0; }

  __device__ __forceinline__ static TileListVisits of(const TileVisits& lists, int batch, int head, int row_tile) {
    const long long at = batch * lists.batch_stride + head * lists.head_stride + row_tile;
    return TileListVisits{lists.indices + at * lists.columns, lists.full + at * lists.columns, 0,
                          arch::load(lists.counts + at)};
  }
};

// One tile's form of a FlexHook (FlexHook::on_tile): its scores with or without the sequence-bound test (Bounds),
// score' / scale or score' itself (Scaled: FlexHook::score), with or without the mask_mod (Masks false: a tile the
// block mask lists as full).
template <class Hook, bool Bounds, bool Scaled = false, bool Masks = true>
struct FlexTileScores {
  Hook hook;
  __device__ __forceinline__ float operator()(float qk, int row, int key) const {
    float unused;
    return hook.template score<Bounds, Scaled, Masks>(qk, row, key, unused);
  }
  __device__ __forceinline__ float operator()(float qk, int row, int key, float& slope_of_score) const {
    return hook.template score<Bounds, Scaled, Masks>(qk, row, key, slope_of_score);
  }
};

// BlockSparse: the call has a block mask (p.flex_tiles): the loops visit its listed tiles only, and the mask_mod
// runs on partial ones only.
template <class ScoreMod, class MaskMod, bool BlockSparse = false>
struct FlexHook {
  static constexpr bool kScoreModded = is_mod<ScoreMod>::value;
  static constexpr bool kMasked = is_mod<MaskMod>::value;
  static constexpr bool kHasSideGrads = ScoreMod::kHasSideGrads;
  static constexpr bool kBlockSparse = BlockSparse;
  // Whether a kernel may take score' itself (score<Bounds, true>) and exponentiate with log2 e rather than scale
  // log2 e: with a score_mod, which scales the score anyway, that drops the product by 1 / scale per score (the
  // tensor-core kernels do); without one the score stays x and the kernel's exponent scales it.
  static constexpr bool kScaledScores = kScoreModded;
  // A mask_mod without a score_mod: the mma.sync forward gives such a hook on_tile's full form (with a score_mod as
  // well ptxas spilled there).
  static constexpr bool kMaskOnly = kMasked && !kScoreModded;
  static_assert(ScoreMod::kSides + MaskMod::kSides <= kMaxSides, "the mods read at most kMaxSides arrays");

  const AttentionParams& p;
  int batch;  // the whole call's (a sharded call's shard adds its origin: attention_params.cuh's flex::Shard)
  int head;   // the query head, likewise
  bool check_mask;  // false on a tile the block mask lists as full
  // 1 / scale, divided once per block: score' / scale per score as an IEEE division costs a slow-path test and
  // branch each (the loop census counted them); a product is within an ulp of it, and the kernels' own
  // convention (ScoreHook's softcap factors c / scale, scale / c) rounds the same way.
  float inverse_scale;

  __device__ __forceinline__ static FlexHook of(const AttentionParams& p, const BlockInfo& info) {
    const int* origin = p.flex_shard.origin;  // loads the compiler drops where no mod reads b or h
    return FlexHook{p, origin ? info.batch + arch::load(origin) : info.batch,
                    origin ? info.head + arch::load(origin + 1) : info.head, true, 1.f / p.softmax_scale};
  }

  // The K/V tiles Q tile m_block of (info.batch, info.head) visits (forward): the block mask's list, or `range`.
  __device__ __forceinline__ static auto kv_visits(const AttentionParams& p, const BlockInfo& info, int m_block,
                                                   IndexRange range) {
    if constexpr (BlockSparse)
      return TileListVisits::of(p.flex_tiles.kv, info.batch, info.head, m_block);
    else
      return TileRangeVisits{range.begin, range.end};
  }
  // The Q tiles that visit K/V tile n_block of (batch, kv_head) (backward; the union over the group's heads).
  __device__ __forceinline__ static auto q_visits(const AttentionParams& p, int batch, int kv_head, int n_block,
                                                  IndexRange range) {
    if constexpr (BlockSparse)
      return TileListVisits::of(p.flex_tiles.q, batch, kv_head, n_block);
    else
      return TileRangeVisits{range.begin, range.end};
  }

  __device__ __forceinline__ FlexHook for_tile(bool full) const { return FlexHook{p, batch, head, !full, inverse_scale}; }

  __device__ __forceinline__ static constexpr bool active() { return true; }

  // Whether a launch carries what a flex call never has and the hook would drop (softcap, ALiBi, a window: the mods
  // say all a flex call hides or changes); the Hopper kernels trap on it.
  __device__ __forceinline__ static bool rejects(const AttentionParams& p) {
    return p.softcap_outer != 0.f || p.alibi_slopes != nullptr || MaskPolicy::banded(p);
  }

  // Whether a tile of tile_rows x tile_keys scores from (row0, key0) lies inside seqlen_q x seqlen_k.
  __device__ __forceinline__ bool inside_sequence(int row0, int tile_rows, int key0, int tile_keys) const {
    return row0 + tile_rows <= p.seqlen_q && key0 + tile_keys <= p.seqlen_k;
  }
  // Whether the hook leaves every score of such a visited tile as it is: a mask_mod alone on a block mask's full
  // tile inside the sequence (block-uniform: a kernel may run its step without the hook there, as the mma.sync and
  // Hopper backwards do).
  __device__ __forceinline__ bool idle_on(bool full, int row0, int tile_rows, int key0, int tile_keys) const {
    return kMaskOnly && full && inside_sequence(row0, tile_rows, key0, tile_keys);
  }

  // Runs f(tile_scores) for the visited tile of tile_rows x tile_keys scores from (row0, key0) (block-uniform):
  // without a mask_mod, a tile inside seqlen_q x seqlen_k gets a form without the per-score sequence-bound test
  // (which costs every score two compares and a branch: about 400 instructions per step of the d64 tensor-core
  // forward with a softcap mod), and only tiles crossing the sequence's end test it; each form is its own copy of the
  // score_mod's code, and the loop census walks the interior one. With a mask_mod, one form tests both per score
  // (check_mask skips the mask_mod on the block mask's full tiles), and FullForm adds a third for the block mask's
  // full tiles inside the sequence, with neither test. Loop census, fp16, NVRTC 13.5, a full step without / with it:
  //   the Hopper forward (always): a document mask at d128 1900 / 541 instructions (ptxas had predicated the
  //     mask_mod's loads into every step), prefix-LM 937 / 527;
  //   the mma.sync forward (kMaskOnly hooks only): sm_80 document d64 2003 / 808, d128 1187 / 750, prefix-LM d64
  //     1278 / 806, d128 962 / 749, spills gone (24 and 168, 16 and 152 bytes without); with a side-reading
  //     score_mod as well ptxas spilled 76 bytes at d128 for 963 against 966 instructions (none without), so such
  //     hooks keep two forms there.
  // Scaled: the tile's scores are score' itself (kScaledScores).
  template <bool Scaled = false, bool FullForm = false, class F>
  __device__ __forceinline__ void on_tile(bool full, int row0, int tile_rows, int key0, int tile_keys, F&& f) const {
    const FlexHook tile = for_tile(full);
    const bool inside = inside_sequence(row0, tile_rows, key0, tile_keys);
    if constexpr (FullForm && kMasked) {
      if (full && inside) {
        f(FlexTileScores<FlexHook, false, Scaled, false>{tile});
        return;
      }
    }
    if (tests_bounds(inside))
      f(FlexTileScores<FlexHook, true, Scaled>{tile});
    else
      f(FlexTileScores<FlexHook, false, Scaled>{tile});
  }
  // Runs f(): the hook's parts are compile-time (ScoreHook's tests which are on per tile).
  template <class F>
  __device__ __forceinline__ void in_tile_cases(F&& f) const {
    f();
  }
  // Whether on_tile's form for such a tile (not FullForm's) tests the sequence bounds per score (score<true>):
  // with a mask_mod always (its one form tests both), else on tiles crossing the sequence's end.
  __device__ __forceinline__ bool tests_bounds(int row0, int tile_rows, int key0, int tile_keys) const {
    return tests_bounds(inside_sequence(row0, tile_rows, key0, tile_keys));
  }
  __device__ __forceinline__ static constexpr bool tests_bounds(bool inside_sequence) {
    return kMasked || !inside_sequence;
  }

  // What the score_mod's functions take for x = q.k: the scaled score times the mod's kScoreFactor (1 but for a
  // fast-math mod whose one product by a constant the emitter folded into the scale: one product per score).
  __device__ __forceinline__ float mod_input(float qk) const {
    return qk * (p.softmax_scale * ScoreMod::kScoreFactor);
  }

  __device__ __forceinline__ float operator()(float qk, int row, int key) const {
    float unused;
    return score<true>(qk, row, key, unused);
  }

  // score' / scale for x = q.k of (row, key), and d score' / d (scale x) in `slope_of_score`: every test (the
  // kernels that call the hook per score without on_tile).
  __device__ __forceinline__ float operator()(float qk, int row, int key, float& slope_of_score) const {
    return score<true>(qk, row, key, slope_of_score);
  }

  // The same, with the sequence-bound test where Bounds (on_tile: tiles crossing the sequence's end); Scaled:
  // score' itself (kScaledScores), not over scale (slope_of_score as ever).
  template <bool Bounds, bool Scaled = false, bool Masks = true>
  __device__ __forceinline__ float score(float qk, int row, int key, float& slope_of_score) const {
    static_assert(!Scaled || kScaledScores, "score' itself only where a score_mod scales the score");
    slope_of_score = 0.f;
    if (Bounds && (row >= p.seqlen_q || key >= p.seqlen_k)) return neg_inf();
    if constexpr (kMasked && Masks) {
      // The mask_mod's sides follow the score_mod's: a Sides view starting there (only its first
      // MaskMod::kSides arrays are read, all inside p.flex_sides).
      const Sides& mask_sides = *reinterpret_cast<const Sides*>(&p.flex_sides.arrays[ScoreMod::kSides]);
      if (check_mask && !MaskMod::mask(batch, head, row, key, mask_sides)) return neg_inf();
    }
    if constexpr (kScoreModded) {
      const float scaled = mod_input(qk);
      if constexpr (ScoreMod::kHasDScore) slope_of_score = ScoreMod::dscore(scaled, batch, head, row, key, p.flex_sides);
      const float modded = ScoreMod::score(scaled, batch, head, row, key, p.flex_sides);
      return Scaled ? modded : modded * inverse_scale;
    } else {
      slope_of_score = 1.f;
      return qk;
    }
  }

  // Adds g * d score' / d side into the side gradients (nothing where g is 0: the scores the mask hides). Called by
  // every lane of the warp together (the kernels call it per score, outside any per-lane test). Deterministic
  // (SideGrads::per_warp_slices): into this warp's own slices, the lanes with a gradient one after another in lane
  // order (__syncwarp orders their adds), so each slice's sums run in one order whatever the schedule.
  __device__ __forceinline__ void side_grads(float g, float qk, int row, int key) const {
    if constexpr (kHasSideGrads) {
      const float scaled = mod_input(qk);
      const SideGrads& grads = p.flex_side_grads;
      if (!grads.per_warp_slices) {
        if (g != 0.f) ScoreMod::side_grads(g, scaled, batch, head, row, key, p.flex_sides, grads);
        return;
      }
      const long long warp = ((static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x +
                              blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
      SideGrads mine = grads;
#pragma unroll
      for (int s = 0; s < kMaxSides; ++s)
        if (mine.arrays[s] != nullptr) mine.arrays[s] += warp * grads.slice_elements[s];
      const int lane = threadIdx.x % 32;
      for (unsigned pending = __ballot_sync(0xffffffffu, g != 0.f); pending != 0u; pending &= pending - 1u) {
        if (lane == __ffs(static_cast<int>(pending)) - 1)
          ScoreMod::side_grads(g, scaled, batch, head, row, key, p.flex_sides, mine);
        __syncwarp();
      }
    }
  }
};

}  // namespace cuflash::flex
