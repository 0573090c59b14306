// sink.cuh: learnable attention sinks (gpt-oss; FA4, cuDNN, vLLM's FA3), the one place their rule is written.
//
// Query head h's sink logit s_h (AttentionParams::sinks, float32 (nheads,), natural-log units of the scaled
// score) joins the softmax denominator of every row of that head, with no value of its own:
//     out = sum_j e^{x_j} v_j / (e^{s_h} + sum_j e^{x_j}),   lse = log(e^{s_h} + sum_j e^{x_j}).
// A row that sees no key gets out 0 and lse s_h (the sink alone).
//
// Where it applies: once per row, in the forward's epilogue (RowSink::join below rescales the keys-only result:
// out = out_keys * keys_share, keys_share = e^{lse_keys} / (e^{lse_keys} + e^{s_h})). With split-KV only split 0
// joins it, into its partial O and lse: the combine's lse merge then weighs split 0 by e^{lse_0'} = e^{lse_0} + e^{s_h}
// and its O by keys_share, which is exactly the sink's place in the whole row's softmax (every split-0 block writes
// its rows' partials, seen keys or not). The combine kernel is unchanged.
// The backward needs nothing of its own: with this out and this lse, P = exp(x - lse) and D = rowsum(dO * O)
// are the sink softmax's, so dQ, dK, dV come out right; the sink's own gradient, -sum_rows e^{s_h - lse} D, is
// a reduction over the row statistics the API forms (cuflash/sinks.py).
#pragma once

#include "arch/arch.cuh"
#include "common/attention_params.cuh"
#include "common/kernel_utils.cuh"

namespace cuflash {

struct SinkShare {
  float keys_share;  // the keys' share of the denominator: multiplies the keys-only out
  float lse;         // the row's lse with the sink
};

// The row whose lse over its keys is lse_keys (-inf where it saw none) joined by sink logit `sink`. With
// t = log(1 + e^-|gap|), gap = sink - lse_keys: lse = max(sink, lse_keys) + t and the keys' share
// e^{lse_keys - lse} = e^{-t} or e^{-gap - t}. No term overflows for any gap, no large lse is subtracted from
// another, and no IEEE division is made (it calls a slow-path subroutine, around which live values spill).
__device__ __forceinline__ SinkShare join_sink(float lse_keys, float sink) {
  if (lse_keys == neg_inf()) return SinkShare{0.f, sink};
  const float gap = sink - lse_keys;
  const float t = log1pf(expf(-fabsf(gap)));
  return SinkShare{expf(gap > 0.f ? -gap - t : -t), fmaxf(sink, lse_keys) + t};
}

// The sink a forward block's rows join, read once per block: with sinks, the blocks of split 0 (every block without
// split-KV) join the head's logit; the others, and every block of a call without sinks (uniform over the grid: the
// test costs nothing there), join none.
struct RowSink {
  bool joins;
  float logit;

  __device__ __forceinline__ static RowSink of(const AttentionParams& p, int head, int split) {
    const bool joins = p.sinks != nullptr && split == 0;
    return RowSink{joins, joins ? arch::load(p.sinks + head) : 0.f};
  }
  // A row's keys-only 1 / l (or whatever scales its O) and lse, joined in place where the block joins the sink.
  __device__ __forceinline__ void join(float& inv_l, float& lse) const {
    if (!joins) return;
    const SinkShare joined = join_sink(lse, logit);
    inv_l *= joined.keys_share;
    lse = joined.lse;
  }
};

}  // namespace cuflash
