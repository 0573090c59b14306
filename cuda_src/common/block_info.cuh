// block_info.cuh: where the (batch, head) a block works on lives, and how long its sequences are.
//
// Every per-(batch, head) pointer and offset a kernel forms goes through BlockInfo: the element
// tensors (strided, (batch, row, head) strides in AttentionParams) and the float32 side buffers
// (dense, in the shapes attention_params.cuh gives). Query-side tensors (q, out, dout, dq) are
// indexed by the query head, key-side ones (k, v, dk, dv) by its kv head (GQA/MQA: query head h
// reads kv head h / (nheads / nheads_k)).
//
// Variable-length batches (cu_seqlens_q/k set, attention_params.cuh) change only this file: sequence b
// holds query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of the packed (total_q, nheads, d) tensors and
// keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1]; p.seqlen_q and p.seqlen_k are then the longest lengths (the
// grid's extent). Row indices inside a kernel are always positions within the sequence.
// A contiguous KV cache may map sequence b to another row of the caches' batch (cache_batch_idx) and start its keys
// past left padding (cache_leftpad), as may a paged one (cache_leftpad only: rows past its first page's row 0);
// only key_rows, key_tma_coords and seqlen_k read them, so key 0 is the first valid key here too.
//
// Why the lengths are methods, not members: a fixed-length kernel reads them from the parameter bank
// where it uses them and holds no register for them; a varlen one loads them from cu_seqlens where it
// uses them (L1 hits). Members loaded once would stay live through the K/V loops, and the tensor-core
// kernels, at the 255-register limit, spilled for those two registers. So kernels call seqlen_q(p) and
// seqlen_k(p) at each use and keep nothing derived from them across a barrier.
#pragma once

#include "arch/arch.cuh"
#include "common/attention_params.cuh"

namespace cuflash {

// Where key row j of a paged sequence lives: page `page` of the cache (its block_table entry), row `row` in it.
struct PageSlot {
  int page;
  int row;
  __device__ __forceinline__ static PageSlot of(const int* pages, int page_size, int j) {
    const unsigned index = static_cast<unsigned>(j) / static_cast<unsigned>(page_size);  // rows are >= 0
    const unsigned in_page = static_cast<unsigned>(j) - index * static_cast<unsigned>(page_size);
    return PageSlot{arch::load(pages + index), static_cast<int>(in_page)};
  }
};

// Rows first_row, first_row + 1, ... of one head of a key-side tensor. Contiguous: head_base + j row_stride.
// Paged KV cache: row j lives at row j % page_size of page pages[j / page_size], pages page_stride apart
// (the cache's batch stride). The page lookup is one int load per row; the contiguous path is the old
// pointer arithmetic (pages is a literal null there, so the branch folds away).
template <class T>
struct KeyRows {
  T* head_base;  // contiguous: row 0 of the sequence's head; paged: the head in page 0
  long long row_stride;
  long long page_stride;
  const int* pages;  // the sequence's row of block_table; null: contiguous
  int page_size;
  int first_row;

  __device__ __forceinline__ T* row(int r) const {
    const int j = first_row + r;
    if (pages == nullptr) return head_base + static_cast<long long>(j) * row_stride;
    return paged_row(j);
  }
  // Row j of a paged sequence: one block_table entry and a division by the page size (PageSlot).
  __device__ __forceinline__ T* paged_row(int j) const {
    const PageSlot slot = PageSlot::of(pages, page_size, j);
    return head_base + static_cast<long long>(slot.page) * page_stride + static_cast<long long>(slot.row) * row_stride;
  }
  // The same sequence's rows from `rows` further on: what key_rows gives for first_row + rows, without finding the
  // sequence's base again (its offsets and the cache's indexing: loads and tests a loop need not repeat per block).
  __device__ __forceinline__ KeyRows from(int rows) const {
    KeyRows shifted = *this;
    shifted.first_row += rows;
    return shifted;
  }
  // Whether every row starts 16-byte aligned (the tensor-core loads then use 16-byte cp.async).
  __device__ __forceinline__ bool rows_16b_aligned() const {
    return (reinterpret_cast<unsigned long long>(head_base) & 15) == 0 && (row_stride * sizeof(T)) % 16 == 0 &&
           (pages == nullptr || (page_stride * sizeof(T)) % 16 == 0);
  }
};

struct BlockInfo {
  int batch;
  int head;     // the query head
  int kv_head;  // the kv head it reads

  __device__ __forceinline__ static int group_size(const AttentionParams& p) { return p.nheads / p.nheads_k; }

  __device__ __forceinline__ static BlockInfo of(const AttentionParams& p, int batch, int head) {
    return BlockInfo{batch, head, head / group_size(p)};
  }
  // Query head `member` (0 .. group_size - 1) of kv head `kv_head`.
  __device__ __forceinline__ static BlockInfo of_group(const AttentionParams& p, int batch, int kv_head, int member) {
    return of_group_head(batch, kv_head, kv_head * group_size(p) + member);
  }
  // Query head `head` (an absolute index) of kv head `kv_head`'s group, for a caller that steps through the group's
  // heads: no division in its loop (head / group_size is an integer division by a runtime value, about 25
  // instructions).
  __device__ __forceinline__ static BlockInfo of_group_head(int batch, int kv_head, int head) {
    return BlockInfo{batch, head, kv_head};
  }

  __device__ __forceinline__ static bool varlen(const AttentionParams& p) { return p.cu_seqlens_q != nullptr; }

  // Length of this sequence: its queries and its keys.
  // A used count (seqused_q/k) shortens the sequence to a prefix of its rows: every kernel, its mask (aligned
  // bottom-right to the used lengths, FA2's rule) and its loads see only that prefix; rows past it are neither
  // read nor written (the API zeroes those outputs).
  __device__ __forceinline__ int seqlen_q(const AttentionParams& p) const {
    if (!varlen(p)) return p.seqlen_q;
    if (p.seqused_q != nullptr) return cu_seqlen(p.seqused_q, batch);
    return cu_seqlen(p.cu_seqlens_q, batch + 1) - cu_seqlen(p.cu_seqlens_q, batch);
  }
  // A KV cache's left padding (cache_leftpad) moves the first key: its keys are the rows from there to seqused_k.
  __device__ __forceinline__ int seqlen_k(const AttentionParams& p) const {
    if (p.seqused_k != nullptr) return cu_seqlen(p.seqused_k, batch) - first_key_row(p);  // KV cache or varlen
    return varlen(p) ? cu_seqlen(p.cu_seqlens_k, batch + 1) - cu_seqlen(p.cu_seqlens_k, batch) : p.seqlen_k;
  }
  // Index of this sequence's row 0 among all query (key) rows of the batch: b * seqlen (fixed length) or
  // cu_seqlens[b] (varlen). The dense float32 buffers are laid out over these rows.
  __device__ __forceinline__ long long q_row0(const AttentionParams& p) const {
    return varlen(p) ? cu_seqlen(p.cu_seqlens_q, batch) : static_cast<long long>(batch) * p.seqlen_q;
  }
  __device__ __forceinline__ long long k_row0(const AttentionParams& p) const {
    return varlen(p) ? cu_seqlen(p.cu_seqlens_k, batch) : static_cast<long long>(batch) * p.seqlen_k;
  }

  // Element tensors at row 0 of this (batch, head). Not a KV cache's keys (another row of the caches' batch, left
  // padding, pages): k_rows and v_rows find those.
  template <class T>
  __device__ __forceinline__ const T* q(const AttentionParams& p) const {
    return at<const T>(p.q, p.q_stride, q_start(p), head);
  }
  template <class T>
  __device__ __forceinline__ const T* k(const AttentionParams& p) const {
    return at<const T>(p.k, p.k_stride, k_start(p), kv_head);
  }
  template <class T>
  __device__ __forceinline__ const T* v(const AttentionParams& p) const {
    return at<const T>(p.v, p.v_stride, k_start(p), kv_head);
  }
  template <class T>
  __device__ __forceinline__ T* out(const AttentionParams& p) const {
    return at<T>(p.out, p.out_stride, q_start(p), head);
  }
  template <class T>
  __device__ __forceinline__ const T* out_in(const AttentionParams& p) const {
    return at<const T>(p.out, p.out_stride, q_start(p), head);
  }
  template <class T>
  __device__ __forceinline__ const T* dout(const AttentionParams& p) const {
    return at<const T>(p.dout, p.dout_stride, q_start(p), head);
  }
  template <class T>
  __device__ __forceinline__ T* dq(const AttentionParams& p) const {
    return at<T>(p.dq, p.dq_stride, q_start(p), head);
  }
  template <class T>
  __device__ __forceinline__ T* dk(const AttentionParams& p) const {
    return at<T>(p.dk, p.dk_stride, k_start(p), kv_head);
  }
  template <class T>
  __device__ __forceinline__ T* dv(const AttentionParams& p) const {
    return at<T>(p.dv, p.dv_stride, k_start(p), kv_head);
  }

  // Rows first_row, first_row + 1, ... of this sequence's k or v (its kv head): contiguous, or spread over the
  // pages of a paged KV cache (KeyRows below). The forward kernels load K/V blocks through these.
  template <class T>
  __device__ __forceinline__ KeyRows<const T> k_rows(const AttentionParams& p, int first_row) const {
    return key_rows<const T>(p, p.k, p.k_stride, first_row);
  }
  template <class T>
  __device__ __forceinline__ KeyRows<const T> v_rows(const AttentionParams& p, int first_row) const {
    return key_rows<const T>(p, p.v, p.v_stride, first_row);
  }

  // TMA coordinates {row, batch} of row `row` of this sequence in a tensor map spanning the whole array (the Hopper
  // forward's, fa3_forward_traits.cuh): (rows, batch) of a fixed-length array, (total rows, 1) of a packed varlen one
  // (its sequences one after the other: a box may run into the next one's rows), and for keys a contiguous KV cache's
  // (rows, cache batch) from the cache row of key 0 (cache_batch_idx, cache_leftpad) or a paged cache's (page_size,
  // pages): {row in the page, page}, the block_table entry of the row's page.
  __device__ __forceinline__ int2 q_tma_coords(const AttentionParams& p, int row) const {
    return varlen(p) ? make_int2(q_start(p) + row, 0) : make_int2(row, batch);
  }
  __device__ __forceinline__ int2 key_tma_coords(const AttentionParams& p, int row) const {
    if (p.block_table != nullptr) {  // (a box reads one page: with cache_leftpad the plans take the load path)
      const PageSlot slot = PageSlot::of(pages(p), p.page_size, first_key_row(p) + row);
      return make_int2(slot.row, slot.page);
    }
    return make_int2(k_start(p) + first_key_row(p) + row, varlen(p) ? 0 : cache_batch(p));
  }
  // Whether the rows past this sequence's keys are other data where a map reaches them (packed varlen sequences, a
  // KV cache's rows past its used count) rather than outside the array (zero-filled by the map).
  __device__ __forceinline__ static bool keys_end_inside_array(const AttentionParams& p) {
    return varlen(p) || p.seqused_k != nullptr;
  }
  // The same for the queries: packed varlen sequences (their used counts among them).
  __device__ __forceinline__ static bool queries_end_inside_array(const AttentionParams& p) {
    return varlen(p) || p.seqused_q != nullptr;
  }

  // Float32 per-row statistics (lse, dout_dot_out, row_max, row_sum): (batch, nheads, seqlen_q), or
  // (nheads, total_q) for varlen (FlashAttention-2's layout).
  __device__ __forceinline__ long long row_stats_offset(const AttentionParams& p) const {
    return varlen(p) ? static_cast<long long>(head) * p.total_q + q_row0(p)
                     : (static_cast<long long>(batch) * p.nheads + head) * p.seqlen_q;
  }
  // Float32 score matrices, (batch, nheads, seqlen_q, seqlen_k): scores, probs (fixed length only).
  __device__ __forceinline__ long long score_matrix_offset(const AttentionParams& p) const {
    return row_stats_offset(p) * p.seqlen_k;
  }
  __device__ __forceinline__ long long score_row_offset(const AttentionParams& p, int query) const {
    return score_matrix_offset(p) + static_cast<long long>(query) * p.seqlen_k;
  }
  // Dense float32 accumulators in the tensor layout (rows, nheads, d) over all query (key) rows, one row
  // every dense_row_stride floats: dq_accum (and fa1's out_accum, dk_accum and dv_accum: fa1 takes no headdim_v of
  // its own) over query (key) rows, per query head. The split-KV forward's out_accum has v's head dim: a row every
  // dense_out_row_stride floats.
  __device__ __forceinline__ static long long dense_row_stride(const AttentionParams& p) {
    return static_cast<long long>(p.nheads) * p.headdim;
  }
  __device__ __forceinline__ static long long dense_out_row_stride(const AttentionParams& p) {
    return static_cast<long long>(p.nheads) * p.headdim_v;
  }
  __device__ __forceinline__ long long dense_q_offset(const AttentionParams& p) const {
    return q_row0(p) * dense_row_stride(p) + static_cast<long long>(head) * p.headdim;
  }
  __device__ __forceinline__ long long dense_out_offset(const AttentionParams& p) const {
    return q_row0(p) * dense_out_row_stride(p) + static_cast<long long>(head) * p.headdim_v;
  }
  __device__ __forceinline__ long long dense_k_offset(const AttentionParams& p) const {
    return k_row0(p) * dense_row_stride(p) + static_cast<long long>(head) * p.headdim;
  }
  // Row 0 of this (batch, head) in slice `slice` of dq_accum (num_dq_splits, total_q, nheads, d).
  __device__ __forceinline__ float* dq_accum(const AttentionParams& p, int slice) const {
    return p.dq_accum + slice * dense_q_elements(p) + dense_q_offset(p);
  }
  // Row 0 of this (batch, head) in split `split`'s partial results (split-KV forward): its O / l in out_accum
  // (num_kv_splits, total_q, nheads, headdim_v) and its lse in lse_accum (num_kv_splits, <row stats>).
  // Written as a slice base plus a fixed offset, like dq_accum: the combine kernel steps through the splits by adding
  // a slice's size (folded as (split * total_q + row0) * stride, it spilled 12 bytes on sm_90).
  __device__ __forceinline__ float* out_accum_split(const AttentionParams& p, int split) const {
    return p.out_accum + split * dense_out_elements(p) + dense_out_offset(p);
  }
  __device__ __forceinline__ float* lse_accum_split(const AttentionParams& p, int split) const {
    return p.lse_accum + split * row_stats_elements(p) + row_stats_offset(p);
  }
  // Floats in one (batch, nheads, seqlen_q) or (nheads, total_q) row-stats buffer.
  __device__ __forceinline__ static long long row_stats_elements(const AttentionParams& p) {
    return static_cast<long long>(p.nheads) * p.total_q;
  }
  // Floats in one slice of the split dq_accum (num_dq_splits, total_q, nheads, d); total_q = batch * seqlen_q
  // for fixed-length batches.
  __device__ __forceinline__ static long long dense_q_elements(const AttentionParams& p) {
    return static_cast<long long>(p.total_q) * dense_row_stride(p);
  }
  // Floats in one split's slice of out_accum (num_kv_splits, total_q, nheads, headdim_v).
  __device__ __forceinline__ static long long dense_out_elements(const AttentionParams& p) {
    return static_cast<long long>(p.total_q) * dense_out_row_stride(p);
  }

 private:
  __device__ __forceinline__ static int cu_seqlen(const float* cu_seqlens, int index) {
    return arch::load(reinterpret_cast<const int*>(cu_seqlens) + index);
  }
  // Row 0 of this sequence in a strided tensor: varlen tensors are (total, heads, d), batch stride 0.
  __device__ __forceinline__ int q_start(const AttentionParams& p) const {
    return varlen(p) ? cu_seqlen(p.cu_seqlens_q, batch) : 0;
  }
  __device__ __forceinline__ int k_start(const AttentionParams& p) const {
    return varlen(p) ? cu_seqlen(p.cu_seqlens_k, batch) : 0;
  }
  // A contiguous KV cache's row of the caches' batch this sequence reads (cache_batch_idx), and the cache row of its
  // key 0 (cache_leftpad; a paged cache's: the row in its pages); b and 0 without them. Null pointers in every call
  // but a KV cache's that passes them.
  __device__ __forceinline__ int cache_batch(const AttentionParams& p) const {
    return p.cache_batch_idx != nullptr ? cu_seqlen(p.cache_batch_idx, batch) : batch;
  }
  __device__ __forceinline__ int first_key_row(const AttentionParams& p) const {
    return p.cache_leftpad != nullptr ? cu_seqlen(p.cache_leftpad, batch) : 0;
  }
  // A paged cache's pages of this sequence: its row of block_table.
  __device__ __forceinline__ const int* pages(const AttentionParams& p) const {
    return reinterpret_cast<const int*>(p.block_table) + batch * p.block_table_stride;
  }
  template <class T, class Void>
  __device__ __forceinline__ KeyRows<T> key_rows(const AttentionParams& p, Void* base, const TensorStrides& s,
                                                 int first_row) const {
    if (p.block_table == nullptr) {
      T* head_base = static_cast<T*>(base) + static_cast<long long>(cache_batch(p)) * s.batch +
                     static_cast<long long>(k_start(p) + first_key_row(p)) * s.row + kv_head * s.head;
      return KeyRows<T>{head_base, s.row, 0, nullptr, 0, first_row};
    }
    return paged_key_rows<T>(p, base, s, first_row);
  }
  // key_rows of a paged cache, a function of its own so that the loop census can tell its instructions from the
  // contiguous arm's (loop_census.MARKED_PATHS). Its first key may lie past row 0 of its first page (cache_leftpad: a
  // windowed decode's keys start at the row's first visible one): then rows count from it, looked up page by page
  // like any other.
  template <class T, class Void>
  __device__ __forceinline__ KeyRows<T> paged_key_rows(const AttentionParams& p, Void* base, const TensorStrides& s,
                                                       int first_row) const {
    return KeyRows<T>{static_cast<T*>(base) + kv_head * s.head, s.row, s.batch, pages(p), p.page_size,
                      first_key_row(p) + first_row};
  }
  template <class T, class Void>
  __device__ __forceinline__ T* at(Void* base, const TensorStrides& s, int row, int head_index) const {
    return static_cast<T*>(base) + batch * s.batch + row * s.row + head_index * s.head;
  }
};

// The backward's D_i = rowsum(dO_i * O_i), less dlse_i when the caller passes the lse's cotangent (see dlse in
// attention_params.cuh); every backward's D goes through here.
__device__ __forceinline__ float dout_dot_out_minus_dlse(const AttentionParams& p, const BlockInfo& info, int row,
                                                         float dout_dot_out) {
  return p.dlse != nullptr ? dout_dot_out - arch::load(p.dlse + info.row_stats_offset(p) + row) : dout_dot_out;
}

}  // namespace cuflash
