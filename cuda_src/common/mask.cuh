// mask.cuh: who sees whom. The one place a kernel learns which keys a query row attends to.
//
// Rule (FlashAttention's, bottom-right aligned): with off = seqlen_k - seqlen_q, query row i's
// diagonal key is i + off, and row i sees key j (0 <= j < seqlen_k) iff
//     (window_left  < 0 or j >= i + off - window_left) and
//     (window_right < 0 or j <= i + off + window_right).
// -1 means unbounded. causal = (-1, 0); no mask = (-1, -1). Both bounds grow with i, so the keys
// a range of rows sees form one interval (the hull of its first and last row), and so do the rows
// a range of keys is seen by: block skipping is two interval computations, on both sides of the
// band. A row whose interval is empty sees no key (output 0, lse -inf, zero gradients).
//
// The NumPy twin is cuflash/mask.py (MaskPolicy); a simulator test compares the two on every
// method. Nothing else in cuda_src/ or cuflash/ decides visibility.
//
// ScoreHook: the per-element score transforms, softcap and ALiBi. With x = q.k and scale the softmax
// scale, the score a softmax sees is
//     score = softcap > 0 ? softcap * tanh(scale * x / softcap) : scale * x,   then
//     score -= slope[batch, head] * |i + off - j|                              (with alibi_slopes).
// Kernels fold the scale into their exponents (exp2(x * scale_log2 - m)), so the hook returns the score
// divided by scale: x itself when nothing is on, and the scores, the lse and every max stay as before.
// The backward also asks for d score / d (scale x) = 1 - tanh^2 (1 without softcap), the factor its dS
// takes before the dQ and dK products. Every kernel calls a hook on q.k before masking: the fa2 kernels this
// one, fa1 and the standard kernels IdentityScoreHook (the Python plans refuse softcap and ALiBi for them).
#pragma once

#include "common/attention_params.cuh"
#include "common/block_info.cuh"
#include "common/kernel_utils.cuh"

namespace cuflash {

// Half-open [begin, end); empty when end <= begin.
struct IndexRange {
  int begin;
  int end;
  __device__ __forceinline__ bool empty() const { return end <= begin; }
  __device__ __forceinline__ bool contains(int x) const { return x >= begin && x < end; }
};

// The edges of the band a tile crosses, each where some score of the tile's rows (those below seqlen_q) is hidden by
// it: a key left of a row's window, right of it (causal: above the diagonal), or past seqlen_k. A tile crossing none
// needs no element-wise mask; one crossing some tests only those (every score passes the others).
struct TileEdges {
  bool left;
  bool right;
  bool end;
  __device__ __forceinline__ bool any() const { return left || right || end; }
};

enum class Edge { kLeft, kRight, kEnd };

// The element-wise mask of a tile as one lane applies it. The lane's scores lie at rows row + dr and keys key + dc,
// dr and dc fixed at compile time by the accumulator layout, and visible(row + dr, key + dc) holds exactly when
//     (window_left < 0 or dc - dr >= left) and (window_right < 0 or dc - dr < right) and dc < end
// with the limits of MaskPolicy::lane_tile(row, key): key_begin and key_end at row + dr, less key + dc (a key is
// never negative, which covers key_begin's max with 0). Each test compares a per-lane limit with a constant, and the
// scores of one diagonal (equal dc - dr) share it: a tile's mask costs one compare per diagonal and one select per
// score and edge, where visible() per score cost about five instructions (the loop census's masked rows).
struct LaneTileMask {
  int left;
  int right;
  int end;

  // Whether edge E leaves the score at (row + dr, key + dc) seen (only meaningful for an edge the policy has).
  template <Edge E>
  __device__ __forceinline__ bool keeps(int dr, int dc) const {
    if constexpr (E == Edge::kLeft) return dc - dr >= left;
    else if constexpr (E == Edge::kRight) return dc - dr < right;
    else return dc < end;
  }
};

struct MaskPolicy {
  int seqlen_q;
  int seqlen_k;
  int window_left;   // -1: unbounded
  int window_right;  // -1: unbounded; 0: causal

  // The policy of the sequence `info` works on (its own lengths, for varlen too). Kernels make it where they use it
  // rather than once per block: see block_info.cuh for why the lengths are not kept in registers (the tensor-core
  // forward holds one through its K/V loop, where its masked blocks need both lengths).
  __device__ __forceinline__ static MaskPolicy of(const AttentionParams& p, const BlockInfo& info) {
    return MaskPolicy{info.seqlen_q(p), info.seqlen_k(p), p.window_left, p.window_right};
  }

  __device__ __forceinline__ int diagonal(int row) const { return row + seqlen_k - seqlen_q; }

  // Whether the call's mask is a band (causal or a window), not only the sequence's end: a flex call's is not (its
  // mask_mod says what is hidden).
  __device__ __forceinline__ static bool banded(const AttentionParams& p) {
    return p.window_left >= 0 || p.window_right >= 0;
  }

  // First key row `row` sees, and one past its last (end <= begin: it sees none).
  __device__ __forceinline__ int key_begin(int row) const {
    return window_left < 0 ? 0 : max(0, diagonal(row) - window_left);
  }
  __device__ __forceinline__ int key_end(int row) const {
    return window_right < 0 ? seqlen_k : min(seqlen_k, diagonal(row) + window_right + 1);
  }
  __device__ __forceinline__ bool visible(int row, int key) const {
    return key >= key_begin(row) && key < key_end(row);
  }

  // Keys seen by at least one of rows [row_begin, row_end) (row_end <= seqlen_q).
  __device__ __forceinline__ IndexRange keys_of_rows(int row_begin, int row_end) const {
    if (row_end <= row_begin) return IndexRange{0, 0};
    IndexRange keys{key_begin(row_begin), key_end(row_end - 1)};
    return keys.empty() ? IndexRange{0, 0} : keys;
  }

  // Rows that see at least one of keys [key_begin, key_end) (key_end <= seqlen_k).
  __device__ __forceinline__ IndexRange rows_of_keys(int first_key, int key_limit) const {
    if (key_limit <= first_key) return IndexRange{0, 0};
    const int off = seqlen_k - seqlen_q;
    IndexRange rows{window_right < 0 ? 0 : max(0, first_key - window_right - off),
                    window_left < 0 ? seqlen_q : min(seqlen_q, key_limit + window_left - off)};
    return rows.empty() ? IndexRange{0, 0} : rows;
  }

  // K/V blocks (of BlockN keys) that rows [row_begin, row_end) visit.
  template <int BlockN>
  __device__ __forceinline__ IndexRange kv_blocks(int row_begin, int row_end) const {
    const IndexRange keys = keys_of_rows(row_begin, row_end);
    return IndexRange{keys.begin / BlockN, ceil_div(keys.end, BlockN)};
  }

  // Q blocks (of BlockM rows) that visit keys [first_key, key_limit).
  template <int BlockM>
  __device__ __forceinline__ IndexRange q_blocks(int first_key, int key_limit) const {
    const IndexRange rows = rows_of_keys(first_key, key_limit);
    return IndexRange{rows.begin / BlockM, ceil_div(rows.end, BlockM)};
  }

  // Whether the tile rows [row0, row0 + rows) x keys [key0, key0 + keys) crosses each edge (TileEdges).
  __device__ __forceinline__ bool crosses_left(int row0, int rows, int key0) const {
    return window_left >= 0 && key0 < diagonal(row0 + rows - 1) - window_left;
  }
  __device__ __forceinline__ bool crosses_right(int row0, int key0, int keys) const {
    return window_right >= 0 && key0 + keys - 1 > diagonal(row0) + window_right;
  }
  __device__ __forceinline__ bool crosses_end(int key0, int keys) const { return key0 + keys > seqlen_k; }
  __device__ __forceinline__ TileEdges tile_edges(int row0, int rows, int key0, int keys) const {
    return TileEdges{crosses_left(row0, rows, key0), crosses_right(row0, key0, keys), crosses_end(key0, keys)};
  }

  // Whether that tile holds an element some row does not see (so it needs the element-wise mask), counting keys
  // past seqlen_k as unseen: tile_edges(...).any(), tested edge by edge (as one OR of the three, the tensor-core
  // backward's step issued 14 more instructions on sm_90).
  __device__ __forceinline__ bool tile_needs_mask(int row0, int rows, int key0, int keys) const {
    return crosses_end(key0, keys) || crosses_right(row0, key0, keys) || crosses_left(row0, rows, key0);
  }

  // The limits of one lane's scores at rows row + dr, keys key + dc (LaneTileMask).
  __device__ __forceinline__ LaneTileMask lane_tile(int row, int key) const {
    return LaneTileMask{diagonal(row) - window_left - key, diagonal(row) + window_right + 1 - key, seqlen_k - key};
  }

  // The K/V blocks (of BlockN keys) whose tile rows [row0, row0 + rows) x keys [n BlockN, (n + 1) BlockN) need no
  // element-wise mask: exactly the n for which tile_needs_mask(row0, rows, n BlockN, BlockN) is false (that test is
  // monotone in n on both sides: the keys' end and the window's right edge from above, its left edge from below).
  template <int BlockN>
  __device__ __forceinline__ IndexRange unmasked_kv_blocks(int row0, int rows) const {
    int end = seqlen_k / BlockN;  // (n + 1) BlockN <= seqlen_k
    if (window_right >= 0) {      // (n + 1) BlockN - 1 <= diagonal(row0) + window_right
      const int limit = diagonal(row0) + window_right + 1;
      end = min(end, limit <= 0 ? 0 : limit / BlockN);
    }
    int begin = 0;
    if (window_left >= 0) {  // n BlockN >= diagonal(row0 + rows - 1) - window_left
      const int first = diagonal(row0 + rows - 1) - window_left;
      begin = first <= 0 ? 0 : ceil_div(first, BlockN);
    }
    return IndexRange{begin, end};
  }
};

// Split-KV (attention_params.cuh's num_kv_splits): which of the `visible` K/V blocks of a Q block split `split` of
// `num_splits` computes. The sequence's ceil(seqlen_k / BlockN) blocks are cut into runs of ceil(that / num_splits)
// (FA2's partition: every split but the last gets the same count, so splits finish together); a split whose run
// misses the Q block's band computes nothing and writes out 0, lse -inf, which the combine weighs by 0.
template <int BlockN>
__device__ __forceinline__ IndexRange split_kv_blocks(IndexRange visible, int seqlen_k, int split, int num_splits) {
  if (num_splits <= 1) return visible;
  const int per_split = ceil_div(ceil_div(seqlen_k, BlockN), num_splits);
  return IndexRange{max(visible.begin, split * per_split), min(visible.end, (split + 1) * per_split)};
}

// The tiles a kernel's loop visits, by position i in [begin, end): here every tile of a range (tile(i) = i), which
// is what the kernels visit but with a block mask (flex_hook.cuh's TileListVisits, the other kind). full(i): whether
// the tile needs no user mask_mod (never known here).
struct TileRangeVisits {
  int begin;
  int end;
  __device__ __forceinline__ bool empty() const { return end <= begin; }
  __device__ __forceinline__ int tile(int i) const { return i; }
  __device__ __forceinline__ bool full(int) const { return false; }
};

struct ScoreHook {
  // What flex_hook.cuh's FlexHook adds, absent here: gradients to side arrays, block-sparse tile lists.
  static constexpr bool kHasSideGrads = false;
  static constexpr bool kBlockSparse = false;
  static constexpr bool kScaledScores = false;  // returns score / scale
  static constexpr bool kMaskOnly = false;      // not a mask_mod alone
  // The kernel's parameters: the softcap factors (AttentionParams packs c / scale and scale / c) and the diagonal
  // offset are read from the parameter bank where they are used, so the hook holds no register for them (the
  // tensor-core kernels run at the register limit).
  const AttentionParams& p;
  const BlockInfo& info;  // the sequence: ALiBi's diagonal is its own
  float slope;            // ALiBi slope / scale of this (batch, head) (0: no ALiBi)

  __device__ __forceinline__ static ScoreHook of(const AttentionParams& p, const BlockInfo& info) {
    const float slope = p.alibi_slopes != nullptr
                            ? arch::load(p.alibi_slopes + info.batch * p.alibi_batch_stride + info.head) /
                                  p.softmax_scale
                            : 0.f;
    return ScoreHook{p, info, slope};
  }

  __device__ __forceinline__ bool softcapped() const { return p.softcap_outer != 0.f; }
  // Whether the hook changes anything (block-uniform: kernels skip the element loop when it does not).
  __device__ __forceinline__ bool active() const { return softcapped() || slope != 0.f; }

  // score / scale for x = q.k of (row, key).
  __device__ __forceinline__ float operator()(float qk, int row, int key) const {
    float unused;
    return (*this)(qk, row, key, unused);
  }

  // The same, and d score / d (scale x) in `slope_of_score` (1 - tanh^2 with softcap, else 1).
  __device__ __forceinline__ float operator()(float qk, int row, int key, float& slope_of_score) const {
    slope_of_score = 1.f;
    if (softcapped()) {
      const float t = tanh_by_exp2(qk * p.softcap_inner);
      slope_of_score = fmaf(-t, t, 1.f);
      qk = p.softcap_outer * t;
    }
    if (slope != 0.f) qk -= slope * static_cast<float>(abs(MaskPolicy::of(p, info).diagonal(row) - key));
    return qk;
  }

  // FlexHook's per-tile forms (a kernel choosing one by tests_bounds): the one form here, score / scale.
  template <bool Bounds, bool Scaled = false, bool Masks = true>
  __device__ __forceinline__ float score(float qk, int row, int key, float& slope_of_score) const {
    static_assert(!Scaled, "ScoreHook returns score / scale");
    return (*this)(qk, row, key, slope_of_score);
  }
  __device__ __forceinline__ static constexpr bool tests_bounds(int, int, int, int) { return false; }

  __device__ __forceinline__ void side_grads(float, float, int, int) const {}

  // The K/V tiles Q tile m_block visits (forward), and the Q tiles K/V tile n_block is visited by (backward): those
  // of the mask's range.
  __device__ __forceinline__ static TileRangeVisits kv_visits(const AttentionParams&, const BlockInfo&, int,
                                                             IndexRange range) {
    return TileRangeVisits{range.begin, range.end};
  }
  __device__ __forceinline__ static TileRangeVisits q_visits(const AttentionParams&, int, int, int, IndexRange range) {
    return TileRangeVisits{range.begin, range.end};
  }
  // The hook for one visited tile (FlexHook skips its mask_mod on full tiles).
  __device__ __forceinline__ ScoreHook for_tile(bool) const { return *this; }
  // Whether the hook leaves a visited tile's scores as they are though active (FlexHook's mask_mod alone on a full
  // tile): never.
  __device__ __forceinline__ static constexpr bool idle_on(bool, int, int, int, int) { return false; }
  // Whether a launch carries what the hook cannot serve (FlexHook's: the built-in options): none (a kernel's Hooked
  // flag says whether it applies this hook at all).
  __device__ __forceinline__ static constexpr bool rejects(const AttentionParams&) { return false; }
  // Runs f(hook) with the hook for the visited tile of tile_rows x tile_keys scores from (row0, key0): this one
  // (FlexHook passes a form without the tests the tile does not need: the sequence bounds, the mask_mod).
  template <bool Scaled = false, bool FullForm = false, class F>
  __device__ __forceinline__ void on_tile(bool /*full*/, int /*row0*/, int /*tile_rows*/, int /*key0*/,
                                          int /*tile_keys*/, F&& f) const {
    f(*this);
  }
  // Runs f() under block-uniform tests of which parts are on (softcap, ALiBi), each case its own inlined copy of f
  // with the hook's per-score tests folded: left in the hook, ptxas kept them per score (loop census, sm_80 fp16,
  // the softcap step: forward d64 1289 instructions, 1139 so, d128 922, 828; backward d64 2056, 1808). The copies
  // cost registers: kernels take them where they fit (the d128 backward spilled 12 bytes, 1440 -> 1288; the d64
  // forward with dropout 28 on sm_90).
  template <class F>
  __device__ __forceinline__ void in_tile_cases(F&& f) const {
    if (softcapped()) {
      if (slope != 0.f)
        f();
      else
        f();
    } else {
      f();
    }
  }
};

// What fa1 and standard attention call where fa2 calls ScoreHook: the identity (the Python plans refuse softcap and
// ALiBi for them, so nothing else is packed).
struct IdentityScoreHook {
  __device__ __forceinline__ float operator()(float qk, int /*row*/, int /*key*/) const { return qk; }
};

}  // namespace cuflash
