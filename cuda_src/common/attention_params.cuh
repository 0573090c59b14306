// AttentionParams: the one argument every attention kernel takes, by value.
//
// Why one struct: the same kernels are launched from three places (CuPy, the
// JAX FFI handler, the CPU simulator). A single POD argument keeps the launch
// ABI identical everywhere: the Python mirror (cuflash/kernels/params.py) packs
// these bytes once, and every backend hands them over unchanged. A test
// compares this layout with the mirror field by field (offset and size).
//
// Conventions
//  - Tensors are element pointers; the element type is a template parameter of
//    the kernel. Strides are in elements, 64-bit, for (batch, row, head); the
//    last (head-dim) dimension is always contiguous.
//  - q, out, dout, dq: (batch, seqlen_q, nheads,   headdim)
//    k, v, dk, dv:     (batch, seqlen_k, nheads_k, headdim)   [dk/dv: nheads_k]
//  - Float32 side buffers are dense, row-major, in the shapes given beside them.
//  - Only plain C types: NVRTC compiles this header without a C++ library.
#pragma once

namespace cuflash {

struct TensorStrides {
  long long batch;
  long long row;
  long long head;
};

struct AttentionParams {
  // Inputs and outputs (element type = kernel template parameter).
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;

  // Float32 side buffers.
  float* lse;          // (batch, nheads, seqlen_q) log-sum-exp of scaled scores
  float* scores;       // standard attention: S or dP, (batch, nheads, seqlen_q, seqlen_k)
  float* probs;        // standard attention: P, (batch, nheads, seqlen_q, seqlen_k)
  float* row_max;      // fa1: running m, (batch, nheads, seqlen_q)
  float* row_sum;      // fa1: running l, (batch, nheads, seqlen_q)
  float* out_accum;    // fa1 forward: float32 O, (batch, seqlen_q, nheads, headdim)
  float* dout_dot_out; // backward pre-pass D = rowsum(dO * O), (batch, nheads, seqlen_q)
  float* dq_accum;     // backward: float32 dQ, (num_dq_splits, batch, seqlen_q, nheads, headdim)
  float* dk_accum;     // backward GQA: float32 dK per q-head, (batch, seqlen_k, nheads, headdim)
  float* dv_accum;     // backward GQA: float32 dV per q-head, (batch, seqlen_k, nheads, headdim)

  TensorStrides q_stride, k_stride, v_stride, out_stride;
  TensorStrides dout_stride, dq_stride, dk_stride, dv_stride;

  int batch;
  int seqlen_q;
  int seqlen_k;
  int nheads;
  int nheads_k;
  int headdim;

  float softmax_scale;       // multiplies q.k
  float softmax_scale_log2;  // softmax_scale * log2(e): exp(s*x - m) = exp2(x*scale_log2 - m*log2e)

  int window_left;    // mask.cuh: keys i + off - window_left .. i + off + window_right, -1 unbounded;
  int window_right;   //   causal = (-1, 0), no mask = (-1, -1)
  int num_dq_splits;  // 1, or the number of dq_accum slices (deterministic backward)
};

}  // namespace cuflash
