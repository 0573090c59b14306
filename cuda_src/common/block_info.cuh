// block_info.cuh: where the (batch, head) a block works on lives, and how long its sequences are.
//
// Every per-(batch, head) pointer and offset a kernel forms goes through BlockInfo: the element
// tensors (strided, (batch, row, head) strides in AttentionParams) and the float32 side buffers
// (dense, in the shapes attention_params.cuh gives). Query-side tensors (q, out, dout, dq) are
// indexed by the query head, key-side ones (k, v, dk, dv) by its kv head (GQA/MQA: query head h
// reads kv head h / (nheads / nheads_k)). Variable-length batches and paged K/V change only this
// file: where a sequence starts and how long it is.
#pragma once

#include "arch/arch.cuh"
#include "common/attention_params.cuh"

namespace cuflash {

struct BlockInfo {
  int batch;
  int head;     // the query head
  int kv_head;  // the kv head it reads
  int seqlen_q;
  int seqlen_k;

  __device__ __forceinline__ static int group_size(const AttentionParams& p) { return p.nheads / p.nheads_k; }

  __device__ __forceinline__ static BlockInfo of(const AttentionParams& p, int batch, int head) {
    return BlockInfo{batch, head, head / group_size(p), p.seqlen_q, p.seqlen_k};
  }
  // Query head `member` (0 .. group_size - 1) of kv head `kv_head`.
  __device__ __forceinline__ static BlockInfo of_group(const AttentionParams& p, int batch, int kv_head, int member) {
    return of(p, batch, kv_head * group_size(p) + member);
  }

  // Element tensors at row 0 of this (batch, head).
  template <class T>
  __device__ __forceinline__ const T* q(const AttentionParams& p) const { return at<const T>(p.q, p.q_stride, head); }
  template <class T>
  __device__ __forceinline__ const T* k(const AttentionParams& p) const { return at<const T>(p.k, p.k_stride, kv_head); }
  template <class T>
  __device__ __forceinline__ const T* v(const AttentionParams& p) const { return at<const T>(p.v, p.v_stride, kv_head); }
  template <class T>
  __device__ __forceinline__ T* out(const AttentionParams& p) const { return at<T>(p.out, p.out_stride, head); }
  template <class T>
  __device__ __forceinline__ const T* out_in(const AttentionParams& p) const {
    return at<const T>(p.out, p.out_stride, head);
  }
  template <class T>
  __device__ __forceinline__ const T* dout(const AttentionParams& p) const {
    return at<const T>(p.dout, p.dout_stride, head);
  }
  template <class T>
  __device__ __forceinline__ T* dq(const AttentionParams& p) const { return at<T>(p.dq, p.dq_stride, head); }
  template <class T>
  __device__ __forceinline__ T* dk(const AttentionParams& p) const { return at<T>(p.dk, p.dk_stride, kv_head); }
  template <class T>
  __device__ __forceinline__ T* dv(const AttentionParams& p) const { return at<T>(p.dv, p.dv_stride, kv_head); }

  // Float32 per-row statistics, (batch, nheads, seqlen_q): lse, dout_dot_out, row_max, row_sum.
  __device__ __forceinline__ long long row_stats_offset(const AttentionParams& p) const {
    return (static_cast<long long>(batch) * p.nheads + head) * seqlen_q;
  }
  // Float32 score matrices, (batch, nheads, seqlen_q, seqlen_k): scores, probs.
  __device__ __forceinline__ long long score_matrix_offset(const AttentionParams& p) const {
    return row_stats_offset(p) * seqlen_k;
  }
  __device__ __forceinline__ long long score_row_offset(const AttentionParams& p, int query) const {
    return score_matrix_offset(p) + static_cast<long long>(query) * seqlen_k;
  }
  // Dense float32 accumulators in the tensor layout (batch, seqlen, nheads, d), one row every
  // dense_row_stride floats: out_accum and dq_accum over seqlen_q, dk_accum and dv_accum over seqlen_k
  // (per query head).
  __device__ __forceinline__ static long long dense_row_stride(const AttentionParams& p) {
    return static_cast<long long>(p.nheads) * p.headdim;
  }
  __device__ __forceinline__ long long dense_q_offset(const AttentionParams& p) const {
    return static_cast<long long>(batch) * seqlen_q * dense_row_stride(p) + static_cast<long long>(head) * p.headdim;
  }
  __device__ __forceinline__ long long dense_k_offset(const AttentionParams& p) const {
    return static_cast<long long>(batch) * seqlen_k * dense_row_stride(p) + static_cast<long long>(head) * p.headdim;
  }
  // Row 0 of this (batch, head) in slice `slice` of dq_accum (num_dq_splits, batch, seqlen_q, nheads, d).
  __device__ __forceinline__ float* dq_accum(const AttentionParams& p, int slice) const {
    return p.dq_accum + slice * dense_q_elements(p) + dense_q_offset(p);
  }
  // Floats in one slice of the split dq_accum (num_dq_splits, batch, seqlen_q, nheads, d).
  __device__ __forceinline__ static long long dense_q_elements(const AttentionParams& p) {
    return static_cast<long long>(p.batch) * p.seqlen_q * dense_row_stride(p);
  }

 private:
  template <class T, class Void>
  __device__ __forceinline__ T* at(Void* base, const TensorStrides& s, int head_index) const {
    return static_cast<T*>(base) + batch * s.batch + head_index * s.head;
  }
};

// The backward's D_i = rowsum(dO_i * O_i), less dlse_i when the caller passes the lse's cotangent (see dlse in
// attention_params.cuh); every backward's D goes through here.
__device__ __forceinline__ float dout_dot_out_minus_dlse(const AttentionParams& p, const BlockInfo& info, int row,
                                                         float dout_dot_out) {
  return p.dlse != nullptr ? dout_dot_out - arch::load(p.dlse + info.row_stats_offset(p) + row) : dout_dot_out;
}

}  // namespace cuflash
