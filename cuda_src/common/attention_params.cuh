// AttentionParams: the one argument every attention kernel takes, by value.
//
// Why one struct: the same kernels are launched from three places (CuPy, the
// JAX FFI handler, the CPU simulator). A single POD argument keeps the launch
// ABI identical everywhere: the Python mirror (cuflash/kernels/params.py, derived
// from this header) packs these bytes once, and every backend hands them over
// unchanged. A test compares that layout with g++'s field by field (offset and size).
//
// Conventions
//  - Tensors are element pointers; the element type is a template parameter of
//    the kernel. Strides are in elements, 64-bit, for (batch, row, head); the
//    last (head-dim) dimension is always contiguous.
//  - q, dq:        (batch, seqlen_q, nheads,   headdim)     out, dout: (batch, seqlen_q, nheads,   headdim_v)
//    k, dk:        (batch, seqlen_k, nheads_k, headdim)     v, dv:     (batch, seqlen_k, nheads_k, headdim_v)
//    headdim is the head dim of the scores' dot products (q, k), headdim_v that of the values and of the output
//    (MLA-style calls give v its own; otherwise the two are equal).
//  - Float32 side buffers are dense, row-major, in the shapes given beside them.
//  - Only plain C types: NVRTC compiles this header without a C++ library.
#pragma once

namespace cuflash {

// The side arrays of user mods (cuflash.flex: score_mod / mask_mod compiled into a kernel as a template argument,
// cuda_src/common/flex_mod.cuh says how they are read). Declared here because AttentionParams carries them; a
// kernel without a mod never reads them and the API leaves them null. The Python mirror (params.py) reads the
// constants and these three structs from this text too.
namespace flex {
constexpr int kMaxSides = 4;     // side arrays of a kernel's mods, together
constexpr int kMaxSideDims = 4;  // dims of one side array
// One side array: its data and element strides. Its dtype is known statically by the emitted code; shape
// is the one the mod was traced with (traced mods clamp indices with that static shape).
struct SideArray {
  const void* data;
  long long strides[kMaxSideDims];  // in elements
  int shape[kMaxSideDims];
};
struct Sides {
  SideArray arrays[kMaxSides];
};
// Gradients to float side arrays (score mods traced with side_grads): one float32 array per side, contiguous
// and row-major in the side's shape, that side_grads adds into atomically (null for sides without one).
// Deterministic (per_warp_slices 1): each array holds one slice of slice_elements (the side's size) per warp of
// the grid, which only that warp adds into, one lane at a time (flex_hook.cuh); the caller sums the slices in order.
struct SideGrads {
  float* arrays[kMaxSides];
  long long slice_elements[kMaxSides];
  int per_warp_slices;
};
// A block mask seen through a kernel's tiles (cuflash.flex.BlockMask.tile_lists): per (batch, head, row tile) the
// column tiles its loop visits, in increasing order, and whether each is full (every score visible: no mask_mod).
// Tile (b, h, r)'s list is entry (b batch_stride + h head_stride + r) of counts, and that row of `columns` entries
// of indices and full (int32 words; full 1 or 0).
struct TileVisits {
  const int* counts;
  const int* indices;
  const int* full;
  long long batch_stride;  // row tiles between batches (0: one list for every batch)
  long long head_stride;   // between heads (0: one for every head)
  int columns;
};
// kv: per Q tile its K/V tiles (the forward's loop); q: per K/V tile its Q tiles (the backward's), per kv head
// (the backward's block loops over the group's query heads: a Q tile is visited if some head of the group visits it,
// full if full for every one).
struct TileLists {
  TileVisits kv;
  TileVisits q;
};
// A call that runs one device's shard of a bigger call's batch and heads (cuflash/jax/_partitioning.py: sharded
// jit): the mods see the whole call's b and h, as FlexAttention defines them, so a shard's local batch i and query
// head j are b = origin[0] + i, h = origin[1] + j. Device memory (two int32 words), not scalars: one compiled call
// runs on every device, each computing its own origin from its mesh position. Null: the call is the whole problem.
struct Shard {
  const int* origin;
};
}  // namespace flex

// TMA tensor maps of q, k, v and dout for a kernel whose producer copies tiles with cp.async.bulk.tensor (the Hopper
// forward: q, k, v; the Hopper backward: all four): each arch::TensorMap's 128 bytes (CUtensorMap, 64-byte aligned),
// made per call on the host (they hold the tensor's address: cuflash/backends/program.py's TmaMaps, the driver's
// encoding on a GPU, the simulator twin's on the CPU). Which box each holds is the kernel family's
// (Program.tma_boxes); a map no box names stays zero.
struct alignas(64) TmaMaps {
  unsigned long long q[16];
  unsigned long long k[16];
  unsigned long long v[16];
  unsigned long long dout[16];
};

struct TensorStrides {
  long long batch;
  long long row;
  long long head;
};

// The pointer fields, in declaration order, as X-macro lists: the struct below, the FFI handler's
// field tables (ffi/program_call.h) and the Python mirror (cuflash/kernels/params.py parses these
// lists and the scalar declarations) all come from here.
//
// Element tensors: X(name, side, width, access). side: Query = (batch, seqlen_q, nheads, width),
// Key = (batch, seqlen_k, nheads_k, width). width: QK = headdim, V = headdim_v. access: In (const) or Out. Each
// has a TensorStrides name##_stride.
#define CUFLASH_PARAMS_TENSORS(X) \
  X(q, Query, QK, In)             \
  X(k, Key, QK, In)               \
  X(v, Key, V, In)                \
  X(out, Query, V, Out)           \
  X(dout, Query, V, In)           \
  X(dq, Query, QK, Out)           \
  X(dk, Key, QK, Out)             \
  X(dv, Key, V, Out)

// Float32 side buffers, dense, row-major: X(name).
//   lse          (batch, nheads, seqlen_q) log-sum-exp of scaled scores
//   scores       standard attention: S or dP, (batch, nheads, seqlen_q, seqlen_k)
//   probs        standard attention: P, (batch, nheads, seqlen_q, seqlen_k)
//   row_max      fa1: running m, (batch, nheads, seqlen_q)
//   row_sum      fa1: running l, (batch, nheads, seqlen_q)
//   out_accum    fa1 forward: float32 O, (batch, seqlen_q, nheads, headdim); split-KV forward (num_kv_splits > 1):
//                each split's O / l, (num_kv_splits, total_q, nheads, headdim_v)
//   dout_dot_out backward pre-pass D = rowsum(dO * O), (batch, nheads, seqlen_q)
//   dq_accum     backward: float32 dQ, (num_dq_splits, batch, seqlen_q, nheads, headdim)
//   dk_accum     backward GQA: float32 dK per q-head, (batch, seqlen_k, nheads, headdim)
//   dv_accum     backward GQA: float32 dV per q-head, (batch, seqlen_k, nheads, headdim)
//   alibi_slopes input (read only): ALiBi slope per query head, (nheads,) or (batch, nheads); null: no ALiBi
//   dlse         input (read only): backward, d loss / d lse, (batch, nheads, seqlen_q); null: 0. Since
//                d lse_i / d score_ij = P_ij, it adds dlse_i P_ij to dS_ij: the backward uses D - dlse for D
//   dropout_seed input (read only): rows of eight 32-bit words (dropout.cuh): dropout's 64-bit seed, low word
//                first, then (first row only) the global index of the call's first batch, head, query row and
//                key (0 unless the call is part of a larger one); one row, or one per dropout_batches_per_seed
//                batches; read only when dropout_threshold != 0
//   cu_seqlens_q input (read only): varlen batches, int32 words (batch + 1): sequence b holds query rows
//                cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q, out, dout, dq (total_q, nheads, headdim; batch
//                stride 0) and the row-stats buffers become (nheads, total_q); null: fixed length (block_info.cuh)
//   cu_seqlens_k input (read only): the same for keys: k, v, dk, dv (total_k, nheads_k, headdim); set with
//                cu_seqlens_q
//   seqused_k    input (read only): int32 words (batch): keys 0 .. seqused_k[b] of sequence b are in use (the rows
//                past them are not read): a KV cache's rows in use, or varlen's used prefix of each sequence's
//                packed keys; null: all seqlen_k (varlen: all of the sequence's keys)
//   seqused_q    input (read only): varlen only, int32 words (batch): sequence b's query rows 0 .. seqused_q[b] are
//                computed (rows past them are not read nor written); null: all of the sequence's rows
//   block_table  input (read only): paged KV cache, int32 words (batch, block_table_stride): row j of sequence b's
//                keys is row j % page_size of page block_table[b][j / page_size] of k and v, which are then
//                (num_pages, page_size, nheads_k, headdim) with the page stride in place of the batch stride;
//                null: contiguous (block_info.cuh)
//   lse_accum    split-KV forward (num_kv_splits > 1): each split's lse, (num_kv_splits, <the lse's shape>); the
//                combine kernel (fa2_split_kv_combine.cu) merges them with out_accum into out and lse
//   sinks        input (read only): attention sinks, the sink logit of each query head, (nheads,) (sink.cuh): it
//                joins every row's softmax denominator; null: no sinks
//   cache_batch_idx  input (read only): contiguous KV cache only, int32 words (batch): sequence b reads row
//                cache_batch_idx[b] of the caches' batch (which may hold more rows than q's); null: row b
//   cache_leftpad input (read only): KV cache only, int32 words (batch): sequence b's keys start at cache row
//                cache_leftpad[b] (the rows before it are padding, never read; of a paged cache, the rows of its pages
//                in block_table order): its keys are rows cache_leftpad[b] .. seqused_k[b] and its seqlen_k their
//                count; null: 0 (block_info.cuh)
#define CUFLASH_PARAMS_SIDE_BUFFERS(X) \
  X(lse)                               \
  X(scores)                            \
  X(probs)                             \
  X(row_max)                           \
  X(row_sum)                           \
  X(out_accum)                         \
  X(dout_dot_out)                      \
  X(dq_accum)                          \
  X(dk_accum)                          \
  X(dv_accum)                           \
  X(alibi_slopes)                      \
  X(dlse)                              \
  X(dropout_seed)                      \
  X(cu_seqlens_q)                      \
  X(cu_seqlens_k)                      \
  X(seqused_k)                         \
  X(seqused_q)                         \
  X(block_table)                       \
  X(lse_accum)                         \
  X(sinks)                             \
  X(cache_batch_idx)                   \
  X(cache_leftpad)

#define CUFLASH_PARAMS_POINTER_In const void*
#define CUFLASH_PARAMS_POINTER_Out void*
#define CUFLASH_PARAMS_IS_QUERY_Query true
#define CUFLASH_PARAMS_IS_QUERY_Key false
#define CUFLASH_PARAMS_IS_VALUE_WIDTH_QK false
#define CUFLASH_PARAMS_IS_VALUE_WIDTH_V true
#define CUFLASH_PARAMS_DECLARE_TENSOR(name, side, width, access) CUFLASH_PARAMS_POINTER_##access name;
#define CUFLASH_PARAMS_DECLARE_SIDE_BUFFER(name) float* name;
#define CUFLASH_PARAMS_DECLARE_STRIDES(name, side, width, access) TensorStrides name##_stride;

struct AttentionParams {
  CUFLASH_PARAMS_TENSORS(CUFLASH_PARAMS_DECLARE_TENSOR)
  CUFLASH_PARAMS_SIDE_BUFFERS(CUFLASH_PARAMS_DECLARE_SIDE_BUFFER)
  CUFLASH_PARAMS_TENSORS(CUFLASH_PARAMS_DECLARE_STRIDES)

  int batch;
  int seqlen_q;
  int seqlen_k;
  int nheads;
  int nheads_k;
  int headdim;    // q's and k's (the scores' dot products)
  int headdim_v;  // v's, and so out's (equal to headdim but in MLA-style calls)
  int total_q;  // query rows of the whole batch: batch * seqlen_q, or cu_seqlens_q[batch] for varlen (where
                // seqlen_q and seqlen_k are the longest sequence's lengths)
  int total_k;  // key rows of the whole batch, likewise

  float softmax_scale;       // multiplies q.k
  float softmax_scale_log2;  // softmax_scale * log2(e): exp(s*x - m) = exp2(x*scale_log2 - m*log2e)

  int window_left;    // mask.cuh: keys i + off - window_left .. i + off + window_right, -1 unbounded;
  int window_right;   //   causal = (-1, 0), no mask = (-1, -1)
  int num_dq_splits;  // 1, or the number of dq_accum slices (deterministic backward)

  // mask.cuh's ScoreHook, softcap c: score = c tanh(scale q.k / c). Packed as the two factors the hook multiplies by
  // (kernels read them from the parameter bank, no registers held): c / scale (0: no softcap) and scale / c.
  float softcap_outer;
  float softcap_inner;
  int alibi_batch_stride;  // slopes of batch b start at alibi_slopes + b * alibi_batch_stride (0 or nheads)

  // dropout.cuh: an element is dropped iff its Philox word < dropout_threshold = floor(dropout_p 2^32) (0: no
  // dropout); kept probabilities are multiplied by dropout_rescale = 1 / (1 - dropout_p).
  unsigned dropout_threshold;
  float dropout_rescale;
  // 0: one seed for the whole call. n > 0: global batch b takes the seed of dropout_seed's row b / n and drops as
  // batch b % n would (the calls of vmap's mapped elements folded into one batch, each with its own seed).
  int dropout_batches_per_seed;

  int page_size;           // paged KV cache: rows per page (a multiple of 16); block_table null: unused
  int block_table_stride;  // int32 words between the block_table rows of consecutive sequences

  // Split-KV (flash-decoding): the forward's grid.x is (Q blocks) x num_kv_splits, block x taking Q block
  // x / num_kv_splits and the K/V blocks of split x % num_kv_splits (mask.cuh's split_kv_blocks); with more than
  // one split it writes float32 partial results (out_accum, lse_accum) that the combine kernel merges. 1: no split.
  int num_kv_splits;

  // User mods (cuflash.flex, flex/flex_hook.cuh): the score_mod's side arrays first, then the mask_mod's; the float32
  // gradient buffers of the score_mod's sides (backward with side gradients). Last in the struct, so the fields
  // above keep their offsets and kernels without a mod their code.
  flex::Sides flex_sides;
  flex::SideGrads flex_side_grads;
  flex::TileLists flex_tiles;  // with a block mask (FlexHook's BlockSparse), else unused
  flex::Shard flex_shard;      // the shard's global first batch and query head (null: offsets 0)

  // 1: tma holds q's, k's and v's maps and the kernel copies with TMA; 0: the host could not make them (an address
  // or stride TMA cannot take; the JAX handlers decide as the CuPy path, ffi/program_call.h) and the kernel copies
  // with loads.
  // A kernel takes the params as a __grid_constant__ parameter to pass the maps' addresses (param space).
  int tma_loads;
  TmaMaps tma;
};

}  // namespace cuflash
