// fa3_forward_traits.cuh: the tile traits and building blocks of the warp-specialized Hopper forward
// (fa3_forward.cu): the shared-memory layout wgmma reads, the producer's copy into it, the descriptors of
// each product, the wgmma accumulator layout and the P fragment taken from it.
//
// Shared-memory layout (WgmmaTile). wgmma reads a K-major 16-bit operand with the 128-byte swizzle as rows
// of 128 bytes (64 elements) in atoms of 8 rows (1024 bytes), the 16-byte chunk c of row r stored at chunk
// c ^ (r % 8) of its row: the swizzle acts on address bits, so each tile starts on a 1024-byte boundary.
// A tile of D = 64 P columns is P such panels one after the other (panel p: columns 64 p .. 64 p + 63 of
// every row, Rows x 128 bytes). This is the layout a TMA load with CU_TENSOR_MAP_SWIZZLE_128B and a box of
// 64 columns writes, so the producer's copy can become one TMA load per panel without touching the readers.
//   Q K^T (SS, both K-major): A = 64 query rows, B = BlockN key rows, one descriptor per k16 step: the panel
//     of the step, the first row, 32 bytes per step inside the panel; SBO 1024 (8-row groups), LBO unused.
//   P V (RS): B = V, whose reduction index (the key) is its row: V is N-major for this product. It is read
//     with the transposed (MN-major) form rather than stored transposed: the ISA's MN-major 128-byte layout is
//     lines of 64 N-elements, one line per k, 8 lines per 1024-byte atom, the next 64 N LBO bytes on and the
//     next 8 k SBO bytes on; V's panels as stored are exactly that (line = key row, LBO = the panel size,
//     SBO = 1024), so K and V share one layout and one copy (a TMA load can write both), and no pass
//     transposes V through registers or a second buffer.
//
// Accumulator layout (wgmma m64nNk16, f32; thread t of the warpgroup: warp w = t / 32, lane l = t % 32):
// register i holds row 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2. So each thread
// holds two rows (half 0 and 1) and a row's BlockN scores are spread over the 4 lanes of a quad.
// P as wgmma_rs's A fragment: warp w supplies rows 16 w .. 16 w + 15 of A in mma.m16n8k16's A layout
// (lane = 4 g + q: a0 = A[g][2q, 2q+1], a1 = A[g+8][2q..], a2 = A[g][2q+8..], a3 = A[g+8][2q+8..]); for the
// k16 step kk (keys 16 kk ..) that is S's registers 8 kk + {0,1}, {2,3}, {4,5}, {6,7} (n8 tiles 2 kk and
// 2 kk + 1, halves 0 and 1): the accumulator converts in place, P never goes through shared memory.
//
// Everything lives in namespace cuflash::fa3.
#pragma once

#include "arch/arch.cuh"
#include "common/block_info.cuh"
#include "common/kernel_utils.cuh"
#include "common/mask.cuh"

namespace cuflash {
namespace fa3 {

constexpr int kWarpgroupThreads = 128;
constexpr int kChunkElems = 8;     // 16-bit elements per 16-byte chunk
constexpr int kPanelCols = 64;     // 16-bit elements per 128-byte swizzled line
constexpr int kSwizzleAtomBytes = 1024;

// desc with its high word (stride byte offset and swizzle, 0x40000040 for every tile here) hidden from ptxas: ORed
// with a zero it cannot know (DescZeros). Knowing the constant, ptxas writes it again into each HGMMA's descriptor
// registers (2 UMOV an HGMMA: 64 of the d128 backward step's 444 instructions, NVRTC 13.5); a value it cannot know it
// keeps in a register. WgmmaTile's descriptors (a kernel makes them once per K/V block, stage or product, before
// desc_advanced moves them on) take it.
__device__ __forceinline__ uint64_t desc_unfolded(uint64_t desc, unsigned zero) {
  return desc | static_cast<uint64_t>(zero) << 32;
}
// The zeros for desc_unfolded, read once by a kernel: `a` for A operands' descriptors, `b` for B's. An SS wgmma
// takes both descriptors in one quad of uniform registers (A's low and high words, then B's); with one high-word
// value shared by both, ptxas keeps it in B's place and copies it into A's before every HGMMA; two values it cannot
// tell apart stay in place (the d128 backward step 407 -> 385 instructions, NVRTC 13.5). kSeparate false: one zero
// for both, where a step short of uniform registers fares worse with two (ptxas then makes descriptors again inside
// the loop: the hooked d128 backward step 437 -> 472 instructions).
struct DescZeros {
  unsigned a, b;
  template <bool kSeparate = true> __device__ __forceinline__ static DescZeros read() {
    const unsigned zero = arch::opaque_zero();
    return {kSeparate ? zero << 1 : zero, zero};  // (zero << 1 differs to ptxas, which knows zero only as 0 or 1)
  }
};

template <int Rows, int Cols>
struct WgmmaTile {
  static_assert(Rows % 8 == 0 && Cols % kPanelCols == 0, "whole 8-row atoms and 64-column panels");
  static constexpr int kRows = Rows;
  static constexpr int kCols = Cols;
  static constexpr int kChunksPerRow = Cols / kChunkElems;
  static constexpr int kPanelBytes = Rows * 128;
  static constexpr int kBytes = Rows * Cols * 2;

  __device__ __forceinline__ static int chunk_offset(int row, int chunk) {
    return (chunk / 8) * kPanelBytes + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
  }
  // Byte offset of element (row, col), col even: the pair col, col + 1 stays in one chunk.
  __device__ __forceinline__ static int element_offset(int row, int col) {
    return chunk_offset(row, col / kChunkElems) + (col % kChunkElems) * 2;
  }
  // K-major descriptor of rows first_row .. (64 of them for A, N for B) at k16 step 0 (columns 0 .. 15), its high
  // word ORed with `zero` (desc_unfolded: DescZeros' a for an A operand, b for a B operand).
  __device__ __forceinline__ static uint64_t k_major_desc(const unsigned char* tile, int first_row, unsigned zero) {
    return desc_unfolded(arch::wgmma_desc<128>(tile + first_row * 128, 16, kSwizzleAtomBytes), zero);
  }
  // Where step `step` of a K-major operand starts from its step 0 (the panel of the step, 32 bytes per step in it).
  __host__ __device__ static constexpr int k_major_step_bytes(int step) { return (step / 4) * kPanelBytes + (step % 4) * 32; }
  // MN-major descriptor of rows 0 .. 15 as the first k16 step of an operand whose M or N runs along the columns
  // (V in P V): 16 rows are two 1024-byte atoms, so every later step (16 rows on) starts on an atom boundary. Its
  // high word ORed with `zero`, as k_major_desc's.
  __device__ __forceinline__ static uint64_t mn_major_desc(const unsigned char* tile, unsigned zero) {
    return desc_unfolded(arch::wgmma_desc<128>(tile, kPanelBytes, kSwizzleAtomBytes), zero);
  }
};

// desc moved `bytes` on in shared memory (a multiple of 16): only the start address field (bits 0-13, the address
// / 16) changes, and it cannot carry, the shared window being below 256 KB; one 32-bit add where a descriptor made
// from the address again costs a handful of uniform instructions (mask, shift, or).
__device__ __forceinline__ uint64_t desc_advanced(uint64_t desc, unsigned bytes) {
  return (desc & 0xffffffff00000000ull) | static_cast<unsigned>(static_cast<unsigned>(desc) + (bytes >> 4));
}

// Registers per thread a block of `threads` starts with under __launch_bounds__(threads, 1): what ptxas gives a
// kernel that needs them all (the SM's 64 K shared out in setmaxnreg's multiples of 8; 168 for 384 threads).
__host__ __device__ constexpr int launch_registers(int threads) {
  return 65536 / threads / 8 * 8 > 256 ? 256 : 65536 / threads / 8 * 8;
}

// Registers per consumer thread after setmaxnreg: the block's launch allocation (1 + consumers warpgroups at
// launch_registers) less a producer warpgroup of `producer`, shared by `consumers` warpgroups, in multiples of 8,
// at most 240. The block's allocation, not the SM's 64 K: setmaxnreg.inc takes registers only from the CTA's pool
// of what its warpgroups' dec released, and waits forever for more (a producer of 48 beside two consumers of 232
// fits 65536 but not 384 x 168 = 64512: the hang the first such backward met on an H200).
__host__ __device__ constexpr int consumer_registers(int consumers, int producer) {
  const int block = launch_registers((1 + consumers) * kWarpgroupThreads) * (1 + consumers);  // per 128 threads
  const int share = (block - producer) / consumers / 8 * 8;
  return share > 240 ? 240 : share;
}

// The forward's tile: BlockM query rows (kConsumers warpgroups of 64), BlockN keys, head dim HeadDim for Q and K
// and HeadDimV for V and O (MLA's 192 / 128: P V and O at v's own width, FA3's instance for it; the same otherwise),
// K/V in a ring of Stages buffers.
template <int HeadDim, int BlockM, int BlockN, int Stages, int HeadDimV = HeadDim>
struct ForwardTraits {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimV = HeadDimV;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr int kConsumers = BlockM / 64;  // each owns 64 query rows: one wgmma M
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  static constexpr int kConsumerWarps = kConsumers * 4;
  // Registers per thread after setmaxnreg. At launch (__launch_bounds__(kThreads, 1)) every warpgroup has
  // launch_registers(kThreads); the producer gives back what its copy loop does not need and the consumers take
  // it: kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * launch_registers(kThreads) (per
  // 128 threads; 504 with two consumers, 512 with three). The producer's copy keeps
  // kLoadsInFlight (2) 16-byte chunks, its pointers and its loop counters: 40 with two consumers (232 each), 32
  // with three (160 each, FA3's split there; a TMA producer needs 24).
  static constexpr int kProducerRegisters = kConsumers == 3 ? 32 : 40;
  static constexpr int kConsumerRegisters = consumer_registers(kConsumers, kProducerRegisters);
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * launch_registers(kThreads),
                "setmaxnreg: the roles take more than the block's launch allocation");
  static constexpr int kAccS = BlockN / 2;  // S accumulator floats per thread
  static constexpr int kAccO = HeadDimV / 2;

  using QTile = WgmmaTile<BlockM, HeadDim>;   // Q, then O / l staged for the epilogue's stores (kHeadDimV columns)
  using KVTile = WgmmaTile<BlockN, HeadDim>;  // K
  using VTile = WgmmaTile<BlockN, HeadDimV>;
  // Tiles first, each on a 1024-byte boundary (the swizzle's period), then the mbarriers (8 bytes each).
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + QTile::kBytes;
  static constexpr int kVOffset = kKOffset + Stages * KVTile::kBytes;
  static constexpr int kBarrierOffset = kVOffset + Stages * VTile::kBytes;
  // q_full, then full_k[Stages], full_v[Stages], empty_k[Stages], empty_v[Stages] (K is released as soon as S has
  // read it, V once P V has).
  static constexpr int kBarriers = 1 + 4 * Stages;
  static constexpr int kSmemBytes = kBarrierOffset + kBarriers * 8;

  static_assert(HeadDim % kPanelCols == 0 && HeadDim <= 256, "head dims of whole 64-column panels (wgmma N <= 256)");
  static_assert(HeadDimV % kPanelCols == 0 && HeadDimV <= HeadDim,
                "v's head dim whole 64-column panels, at most q's: O / l is staged in the Q tile");
  static_assert(BlockM % 64 == 0 && kConsumers >= 1 && kConsumers <= 3, "1 to 3 consumer warpgroups of 64 rows");
  static_assert(BlockN % 16 == 0 && BlockN <= 256, "keys in k16 steps, S's N at most 256");
  static_assert(QTile::kBytes % kSwizzleAtomBytes == 0 && KVTile::kBytes % kSwizzleAtomBytes == 0 &&
                    VTile::kBytes % kSwizzleAtomBytes == 0,
                "tiles stay on swizzle-atom boundaries");
  static_assert(Stages >= 2, "the producer fills one stage while the consumers read another");
};

// Whether this launch differs from the traits' shape, or holds a head dim the tiles do not: q's and k's head dim in
// 1 .. kHeadDim, v's (headdim_v, equal or its own) in 1 .. kHeadDimV (the plan sends each to a tile at least as
// wide; the columns past each are zero-filled in shared memory, so they add nothing to S and give O columns that
// are never written).
template <class Tr>
__device__ __forceinline__ bool launch_shape_differs(const AttentionParams& p) {
  return launch_differs_from_traits<Tr::kSmemBytes, Tr::kThreads>() || p.headdim > Tr::kHeadDim || p.headdim < 1 ||
         p.headdim_v > Tr::kHeadDimV || p.headdim_v < 1;
}

// ---- the producer ---------------------------------------------------------------------------------------
// Two ways to fill a tile, chosen per call by the host (AttentionParams.tma_loads):
//   TMA (produce_tile_tma): one elected thread arrives on the stage's "full" mbarrier expecting the tile's bytes
//     and issues one cp.async.bulk.tensor per 64-column panel holding any of the tensor's columns; the copies'
//     bytes complete the phase. The tensor maps (4-D: head dim, rows, heads, batch, innermost first; box 64
//     columns x the tile's rows; 128-byte swizzle, the layout WgmmaTile describes) zero-fill what lies outside
//     the tensor: rows past the sequence and columns past the head dim in a panel, so the tails need no code
//     here; panels wholly past the head dim (a tile wider than the tensor by 64 columns or more) the kernels zero
//     once per block (zero_panels_past).
//   Loads (produce_tile): every producer thread copies chunks with ordinary loads and stores, fences them for the
//     async proxy and arrives. For what TMA cannot address (a tensor map needs a 16-byte aligned base and strides
//     of whole 16 bytes: head dims not a multiple of 8, odd strides) and callers that make no maps (the JAX
//     handlers).
// How many arrivals complete a "full" phase per copy: the elected thread's one with TMA, one per copying thread on
// the load path (the forward's whole producer warpgroup; the backward's 96 copying threads).
__device__ __forceinline__ unsigned full_arrivals(bool tma, int copy_threads = kWarpgroupThreads) {
  return tma ? 1u : static_cast<unsigned>(copy_threads);
}

// The panels of a tile that hold any of a tensor's `cols` columns (its head dim): the ones its TMA copies fill.
// The rest lie wholly past the tensor's columns, and no box is issued for them: a box none of whose elements is
// inside the tensor has no documented result (the ISA defines the zero fill of a box's out-of-bound elements only;
// the simulator refuses such a box), so those panels are zeroed once per block instead (zero_panels_past).
template <class Tile>
__device__ __forceinline__ int panels_holding(int cols) {
  return min(Tile::kCols / kPanelCols, (cols + kPanelCols - 1) / kPanelCols);
}

// The tile at rows at.x .. at.x + Tile::kRows - 1 of (head, at.y) through `map` (box: 64 columns x Tile::kRows
// rows; `at` from BlockInfo's q_tma_coords / key_tma_coords: the row and the batch, or a paged cache's row in the
// page and the page), the panels holding the tensor's `cols` columns, completing their bytes on `full` (zero-filled
// elements count: each box is whole).
template <class Tile>
__device__ __forceinline__ void produce_tile_tma(unsigned char* tile, const arch::TensorMap* map, int2 at, int head,
                                                 int cols, uint64_t* full) {
  const int panels = panels_holding<Tile>(cols);
  arch::mbarrier_arrive_expect_tx(full, static_cast<unsigned>(panels * Tile::kPanelBytes));
#pragma unroll
  for (int panel = 0; panel < Tile::kCols / kPanelCols; ++panel) {
    if (panel >= panels) break;
    const int coords[4] = {panel * kPanelCols, at.x, head, at.y};
    arch::tma_load<4>(tile + panel * Tile::kPanelBytes, map, coords, full);
  }
}

// Zeroes the panels of `tile` past those holding a tensor's `cols` columns (panels_holding: no TMA copy writes
// them, and the products read them as the columns' zeros), by `threads` threads with 16-byte stores, before any
// copy into the tile. The caller orders them before the async proxy's reads (fence.proxy.async, then a barrier).
template <class Tile>
__device__ __forceinline__ void zero_panels_past(unsigned char* tile, int cols, int thread, int threads) {
  const int first = panels_holding<Tile>(cols);
  const int chunks = (Tile::kCols / kPanelCols - first) * (Tile::kPanelBytes / 16);
  uint4* chunk = reinterpret_cast<uint4*>(tile + first * Tile::kPanelBytes);
#pragma unroll 1
  for (int c = thread; c < chunks; c += threads) chunk[c] = make_uint4(0u, 0u, 0u, 0u);
}

// The map of tensor `member` (AttentionParams.tma's q, k, v or dout) as the TMA takes it: its address in param space
// (the params are a __grid_constant__ kernel parameter; without it the address is a local copy's). Taking the
// address makes the whole params escape: to the compiler a store through a generic pointer may then write them, so
// a field read after such a store is read again (LDC) and the arithmetic on it redone. The forward barely changes
// (d128 x 176: SASS 3584 -> 3648 instructions with the TMA path, LDC 18 -> 24, consumer loop 663 -> 664); the
// backward's epilogue, reading dK's and dV's row strides from the params at every one of its 2-byte stores, doubled
// (3400 -> 6976 instructions, IMAD 319 -> 1975): a kernel reads the fields it uses after global stores into locals
// first (the backward then: 3600, the TMA producer included).
__device__ __forceinline__ const arch::TensorMap* tensor_map(const unsigned long long (&member)[16]) {
  static_assert(sizeof(member) == sizeof(arch::TensorMap) && alignof(TmaMaps) == alignof(arch::TensorMap),
                "AttentionParams' maps are arch::TensorMap's bytes");
  return reinterpret_cast<const arch::TensorMap*>(&member);
}

// The load path: tile = rows [0, valid_rows) x columns [0, cols) of a (Tile::kRows x Tile::kCols) block whose row r
// starts at row_at(r) (a pointer and a stride, or BlockInfo's KeyRows: a KV cache's rows, a paged cache's page
// lookup), zero elsewhere: rows past valid_rows (a ragged last block: zero keys give finite scores the mask hides,
// and zero V rows keep 0 * NaN out of P V) and columns past the head dim (zero in Q and K add nothing to S). Exactly
// the valid elements are read. Consecutive threads take consecutive chunks of a row (coalesced). vector: whole
// chunks by 16-byte loads (rows 16-byte aligned); otherwise, and for a chunk the head dim cuts, element loads. Each
// thread issues Loads chunks' loads before their stores: with one load per iteration the copy waits a global
// latency per 16-byte chunk (2 KB in flight per SM). The forward takes kLoadsInFlight; the backward 1 (its
// producer, 48 registers with the dQ writer's loop and the TMA path beside this one, spilled 28 bytes with 2). Then
// each thread orders its generic-proxy stores before the wgmma (async proxy) that will read them
// (fence.proxy.async) and arrives on `full`. Threads: the copying threads (thread 0 .. Threads - 1): the producer
// warpgroup, or 96, the backward's (its fourth warp writes dQ). Arrival: kEachThread, each of them arriving
// (full_arrivals' count on the load path); kOnceByTheWarp (one warp copying: the forward's TMA producer with a
// ragged block the map cannot zero-fill), lane 0 arriving once after the warp's stores (__syncwarp), as the one TMA
// copy it stands in for would.
constexpr int kLoadsInFlight = 2;
enum class Arrival { kEachThread, kOnceByTheWarp };
template <class Tile, int Threads = kWarpgroupThreads, int Loads = kLoadsInFlight,
          Arrival Arrives = Arrival::kEachThread, class RowAt>
__device__ __forceinline__ void produce_tile(unsigned char* tile, RowAt row_at, int valid_rows, int cols, bool vector,
                                             int thread, uint64_t* full) {
  using T = typename RowAt::Element;
  static_assert(sizeof(T) == 2, "wgmma tiles hold 16-bit elements");
  static_assert(Threads % 32 == 0 && Threads <= kWarpgroupThreads, "whole warps of the producer warpgroup");
  static_assert(Arrives == Arrival::kEachThread || Threads == 32, "one arrival stands for one warp's copy");
  constexpr int kChunks = Tile::kRows * Tile::kChunksPerRow;
  constexpr int kRound = Loads * Threads;                // chunks the copying threads take per iteration
  constexpr bool kWholeRounds = kChunks % kRound == 0;   // else the last round's chunks past kChunks skipped
#pragma unroll 1
  for (int first = thread; first < kChunks; first += kRound) {
    uint4 packed[Loads];
#pragma unroll
    for (int n = 0; n < Loads; ++n) {
      const int c = first + n * Threads;
      if (!kWholeRounds && c >= kChunks) break;
      const int row = c / Tile::kChunksPerRow;
      const int chunk = c % Tile::kChunksPerRow;
      const int valid = row < valid_rows ? max(0, min(kChunkElems, cols - chunk * kChunkElems)) : 0;
      packed[n] = make_uint4(0u, 0u, 0u, 0u);
      const T* from = valid > 0 ? row_at(row) + chunk * kChunkElems : nullptr;
      if (vector && valid == kChunkElems) {
        packed[n] = arch::load(reinterpret_cast<const uint4*>(from));
      } else if (valid > 0) {
        const unsigned short* e = reinterpret_cast<const unsigned short*>(from);
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned lo = 2 * i < valid ? arch::load(e + 2 * i) : 0u;
          const unsigned hi = 2 * i + 1 < valid ? arch::load(e + 2 * i + 1) : 0u;
          w[i] = lo | (hi << 16);
        }
        packed[n] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < Loads; ++n) {
      const int c = first + n * Threads;
      if (!kWholeRounds && c >= kChunks) break;
      *reinterpret_cast<uint4*>(tile + Tile::chunk_offset(c / Tile::kChunksPerRow, c % Tile::kChunksPerRow)) =
          packed[n];
    }
  }
  arch::fence_proxy_async();
  if constexpr (Arrives == Arrival::kOnceByTheWarp) {
    __syncwarp();
    if (thread == 0) arch::mbarrier_arrive(full);
  } else {
    arch::mbarrier_arrive(full);
  }
}

// Row r of a strided block (row_at of produce_tile).
template <class T>
struct StridedRows {
  using Element = T;
  const T* base;
  long long row_stride;
  __device__ __forceinline__ const T* operator()(int r) const { return base + r * row_stride; }
};
// The load path over a strided block: rows `row_stride` elements apart from src (the backward's Q, K, V, dO tiles).
template <class Tile, class T, int Threads = kWarpgroupThreads, int Loads = kLoadsInFlight,
          Arrival Arrives = Arrival::kEachThread>
__device__ __forceinline__ void produce_tile(unsigned char* tile, const T* src, long long row_stride, int valid_rows,
                                             int cols, bool vector, int thread, uint64_t* full) {
  produce_tile<Tile, Threads, Loads, Arrives>(tile, StridedRows<T>{src, row_stride}, valid_rows, cols, vector, thread,
                                              full);
}
// Row r of key rows (BlockInfo's KeyRows: contiguous or paged).
template <class T>
struct KeyRowsAt {
  using Element = T;
  KeyRows<const T> rows;
  __device__ __forceinline__ const T* operator()(int r) const { return rows.row(r); }
};

template <class T>
__device__ __forceinline__ bool rows_16b_aligned(const T* base, long long row_stride) {
  return (reinterpret_cast<unsigned long long>(base) & 15) == 0 && (row_stride * sizeof(T)) % 16 == 0;
}

// ---- the consumers' accumulator layout -----------------------------------------------------------------
// Row and column offsets of accumulator register i from the thread's first (row 16 w + l / 4, column 2 (l % 4)).
__device__ __forceinline__ constexpr int acc_row_step(int i) { return 8 * ((i / 2) % 2); }
__device__ __forceinline__ constexpr int acc_col_step(int i) { return 8 * (i / 4) + i % 2; }
__device__ __forceinline__ int acc_first_row(int warp_in_group, int lane) { return 16 * warp_in_group + lane / 4; }
__device__ __forceinline__ int acc_first_col(int lane) { return 2 * (lane % 4); }
// Register i's query-row and key offsets from the lane's first score: in S (rows queries, the forward's) or, with
// KeysAsRows, in S^T (rows keys, columns queries: the backward's S^T and dP^T).
template <bool KeysAsRows>
__device__ __forceinline__ constexpr int query_step(int i) { return KeysAsRows ? acc_col_step(i) : acc_row_step(i); }
template <bool KeysAsRows>
__device__ __forceinline__ constexpr int key_step(int i) { return KeysAsRows ? acc_row_step(i) : acc_col_step(i); }

// k16 step kk of P (S rounded to T) as wgmma_rs's A fragment (see the opening comment).
template <class T, int N>
__device__ __forceinline__ void p_fragment(unsigned (&a)[4], const float (&s)[N], int kk) {
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = arch::pack_float2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// Stores an A fragment of k16 step kk (p_fragment's words) into a 16-bit tile [rows][columns] of one 128-byte
// swizzled panel (at most 64 columns) with one stmatrix: word r holds rows half r % 2 (8 rows on), columns 16 kk +
// 8 (r / 2) on of the warp's 16 rows, so the fragment is stmatrix's four matrices as they are, lane l giving the
// address of row l % 8 of matrix l / 8: row stmatrix_row, columns stmatrix_col + 16 kk on (the backward's P^T and
// dS^T, rows keys, into the tiles its dQ, dV and dK read). step0_address: the lane's row at kk = 0, the shared-window
// address of element (row, col) with col / 8 = c the lane's chunk. Step kk's chunk c + 2 kk is c | 2 kk (c is 0 or 1
// past a multiple of 2 kSteps, kk < kSteps), so its swizzled place ((c + 2 kk) ^ (row % 8)) is step 0's XOR 2 kk and
// its address step 0's XOR 32 kk: one LOP3 from one register, where the 16 addresses of 32-bit stores (four a step)
// were each a register held across the loop (the flex backward at d128 spilled them and reloaded them each step).
__device__ __forceinline__ int stmatrix_row(int warp_in_group, int lane) { return 16 * warp_in_group + lane % 16; }
__device__ __forceinline__ int stmatrix_col(int lane) { return 8 * (lane / 16); }
template <int kSteps>
__device__ __forceinline__ void store_fragment(unsigned step0_address, const unsigned (&a)[4], int kk) {
  static_assert(kSteps == 1 || kSteps == 2 || kSteps == 4, "a 64-column panel holds 1, 2 or 4 k16 steps");
  arch::stmatrix<4>(step0_address ^ (32u * kk), a);
}
// The lane's step-0 address in a Tile (one panel wide) whose stmatrix rows start at (row, col): col a multiple of 8
// whose chunk is 0 or 1 past a multiple of 2 kSteps (store_fragment's premise; the backward's tests on the
// simulator fail at once without it: dQ, dK and dV of every tile read these tiles).
template <class Tile>
__device__ __forceinline__ unsigned stmatrix_address(const unsigned char* tile, int row, int col) {
  return arch::smem_address(tile + Tile::element_offset(row, col));
}

// The element-wise mask of a tile crossing `edges` on a warpgroup's S accumulator: hidden scores become `hidden`
// (-inf before the softmax; 0 for the backward's P, after it). The lane's limits come from mask.cuh
// (LaneTileMask); each register's offsets are compile-time constants (query_step, key_step). KeysAsRows: the
// accumulator is S^T (the backward's).
template <Edge E, bool KeysAsRows, int N>
__device__ __forceinline__ void mask_edge(float (&s)[N], const LaneTileMask& lane, float hidden) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (!lane.keeps<E>(query_step<KeysAsRows>(i), key_step<KeysAsRows>(i))) s[i] = hidden;
}
// One pass per edge the tile crosses, each behind a block-uniform test (a select per score, no branch).
// first_row, first_key: the lane's first score's query row and key.
template <bool KeysAsRows = false, int N>
__device__ __forceinline__ void mask_scores(float (&s)[N], const MaskPolicy& mask, TileEdges edges, int first_row,
                                            int first_key, float hidden = neg_inf()) {
  const LaneTileMask lane = mask.lane_tile(first_row, first_key);
  if (edges.right) mask_edge<Edge::kRight, KeysAsRows>(s, lane, hidden);
  if (edges.left) mask_edge<Edge::kLeft, KeysAsRows>(s, lane, hidden);
  if (edges.end) mask_edge<Edge::kEnd, KeysAsRows>(s, lane, hidden);
}

// Whether Hook is mask.cuh's ScoreHook (softcap, ALiBi), not a user's mods (flex_hook.cuh's FlexHook); NVRTC has no
// <type_traits>.
template <class Hook> struct is_score_hook { static constexpr bool value = false; };
template <> struct is_score_hook<ScoreHook> { static constexpr bool value = true; };

// The score hook of a block: Hook::of where the instance is hooked, else a ScoreHook that changes nothing.
template <class Hook, bool Hooked>
__device__ __forceinline__ Hook score_hook_of(const AttentionParams& p, const BlockInfo& info) {
  if constexpr (Hooked) return Hook::of(p, info);
  else return ScoreHook{p, info, 0.f};
}

// A hook on every score of a warpgroup's S accumulator: each x = q.k becomes hook(x, row, key) (the hook's score /
// scale, or a flex hook's score' itself: FlexHook::kScaledScores) at its (row, key), from the lane's first score's
// first_row and first_key (each register's offsets are compile-time steps). A struct with a call template, not a
// generic lambda (NVRTC 12 takes one in device code for a host function): FlexHook::on_tile calls it with the form of
// the hook its tile needs. KeysAsRows: the accumulator is S^T (the backward's), as mask_scores'.
template <int N, bool KeysAsRows = false>
struct HookEachScore {
  float (&s)[N];
  int first_row;
  int first_key;
  template <class TileHook>
  __device__ __forceinline__ void operator()(const TileHook& hook) const {
#pragma unroll
    for (int i = 0; i < N; ++i)
      s[i] = hook(s[i], first_row + query_step<KeysAsRows>(i), first_key + key_step<KeysAsRows>(i));
  }
};

// The score hook (mask.cuh's ScoreHook: softcap, ALiBi) on a warpgroup's S accumulator, before the mask. Only the
// hooked instances run it. Which parts are on (softcap, ALiBi) is block-uniform: tested here once per tile, each of
// the three cases holding its own copy of the loop with the hook's tests folded; left in the hook, ptxas kept them
// per score (2 branches a score: the d128 128 x 128 softcap step 1123 instructions against 987 so, loop census). The
// copies cost compile time: NVRTC took about 24 s for that instance against 11 s with one copy (6.5 s for the plain
// one), on a loaded 2-core machine.
template <bool KeysAsRows = false, class Hook, int N>
__device__ __forceinline__ void hook_scores(float (&s)[N], const Hook& hook, int first_row, int first_key) {
  const HookEachScore<N, KeysAsRows> each_score{s, first_row, first_key};
  if (hook.softcapped()) {
    if (hook.slope != 0.f) each_score(hook);
    else each_score(hook);
  } else if (hook.slope != 0.f) {
    each_score(hook);
  }  // neither: the identity
}

// Named barriers (0 is __syncthreads'): each consumer's epilogue (kEpilogueBarrier + consumer, its 128 threads) and
// the consumers' turns to issue wgmma (kSchedulerBarrier + consumer: its 128 threads wait, the previous consumer's
// 128 arrive). Up to 3 consumers: ids 1..6.
constexpr unsigned kEpilogueBarrier = 1;
constexpr unsigned kSchedulerBarrier = 4;

// Reductions over the 4 lanes of a quad (one accumulator row between them), in a fixed order.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One block's online softmax on a warpgroup's S accumulator (BlockN scores per row; this thread's two rows are
// halves 0 and 1), base 2 with the scale folded into the exponent's FMA (as fa2_tc_forward.cu): s becomes
// P = exp2(s scale_log2 - m) in float32, row_max and row_sum (this thread's part of l) move on, and
// correction[half] is the factor O must take (exp2(m_old - m_new); 0 while the row had seen no key).
template <int BlockN>
__device__ __forceinline__ void online_softmax(float (&s)[BlockN / 2], float (&row_max)[2], float (&row_sum)[2],
                                               float scale_log2, float (&correction)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float block_max = neg_inf();
#pragma unroll
    for (int j = 0; j < BlockN / 8; ++j)
      block_max = fmaxf(block_max, fmaxf(s[4 * j + 2 * half], s[4 * j + 2 * half + 1]));
    block_max = quad_max(block_max);
    const float old_max = row_max[half];
    const float new_max = fmaxf(old_max, block_max * scale_log2);  // rounding is monotonic: max commutes
    row_max[half] = new_max;
    // A row with no visible key so far keeps -inf: offset 0, so p = exp2(-inf) = 0 (never -inf - -inf).
    const float max_scaled = new_max == neg_inf() ? 0.f : new_max;
    correction[half] = old_max == neg_inf() ? 0.f : arch::exp2_approx(old_max - max_scaled);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * half + e];
        x = arch::exp2_approx(fmaf(x, scale_log2, -max_scaled));
        sum += x;
      }
    row_sum[half] = fmaf(row_sum[half], correction[half], sum);
  }
}

}  // namespace fa3
}  // namespace cuflash
