// sink.cuh: learnable attention sinks (gpt-oss; FA4, cuDNN, vLLM's FA3), the one place their rule is written.
//
// Query head h's sink logit s_h (AttentionParams::sinks, float32 (nheads,), natural-log units of the scaled
// score) joins the softmax denominator of every row of that head, with no value of its own:
//     out = sum_j e^{x_j} v_j / (e^{s_h} + sum_j e^{x_j}),   lse = log(e^{s_h} + sum_j e^{x_j}).
// A row that sees no key gets out 0 and lse s_h (the sink alone).
//
// Where it applies: once per row, when the row's keys are complete: the forward's epilogue without split-KV, or
// the split-KV combine (never in a split's partial results, which the combine merges first). It rescales the
// keys-only result: out = out_keys * keys_share, keys_share = e^{lse_keys} / (e^{lse_keys} + e^{s_h}).
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

// The row whose lse over its keys is lse_keys (-inf where it saw none) joined by sink logit `sink`. Both logs are
// taken of a sum whose larger term is 1 (log1p of the smaller's ratio): no overflow for any gap.
__device__ __forceinline__ SinkShare join_sink(float lse_keys, float sink) {
  if (lse_keys == neg_inf()) return SinkShare{0.f, sink};
  const float gap = sink - lse_keys;
  const float lse = gap > 0.f ? sink + log1pf(expf(-gap)) : lse_keys + log1pf(expf(gap));
  return SinkShare{1.f / (1.f + expf(gap)), lse};  // gap > 88: expf = inf, share 0 (the keys' part underflows)
}

// Whether the call has sinks (uniform over the grid: the branch costs nothing where there are none).
__device__ __forceinline__ bool has_sinks(const AttentionParams& p) { return p.sinks != nullptr; }

// Query head `head`'s sink logit.
__device__ __forceinline__ float sink_of(const AttentionParams& p, int head) { return arch::load(p.sinks + head); }

}  // namespace cuflash
