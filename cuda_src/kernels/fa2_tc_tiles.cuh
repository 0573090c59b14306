// fa2_tc_tiles.cuh: the building blocks of the tensor-core FA2 kernels (16-bit operands, float32 math).
//
//  - SwizzledTile: a (Rows x Cols) tile of 16-bit elements in shared memory, rows packed without padding,
//    its 16-byte chunks XOR-swizzled so that the 8 rows an ldmatrix phase reads and the 8 chunks a
//    cp.async phase writes land in 8 different bank quads (see below);
//  - load_tile: global -> swizzled shared memory with 16-byte cp.async (zero-filled past the valid rows and
//    the head dim), or element by element where the global rows are not 16-byte aligned;
//  - fragment loads with ldmatrix (A of m16n8k16 from a tile stored [m][k] or, transposing, [k][m]; B from a
//    tile stored [n][k] or, transposing, [k][n]) and the warp-level products built from them;
//  - the conversion of an S accumulator (float32, C layout) into the A operand of the next product, and
//    quad reductions over the 4 lanes that share an accumulator row.
//
// Swizzle. A tile row is Cols / 8 chunks of 16 bytes; shared memory serves 128 bytes (8 chunk positions) per
// wavefront, so 8 lanes touching 8 chunks conflict unless the chunks sit in 8 different positions mod 128
// bytes. With 8k chunks per row (Cols a multiple of 64), chunk c of row r is stored at position c ^ (r & 7)
// inside its 8-chunk atom: the same logical chunk of 8 consecutive rows (an ldmatrix phase) and 8 consecutive
// chunks of one row (a cp.async phase) both cover all 8 positions. With 8k + 4 chunks per row (Cols = 32, 96)
// odd rows start half a line later; chunk c of row r goes to c ^ ((r >> 1) & 3) inside its 4-chunk atom, so
// (r & 1, (r >> 1) & 3) again spreads 8 consecutive rows over 8 positions. This is FA2's 3-bit (2-bit for
// 32-wide atoms) XOR swizzle; the simulator's bank-conflict profile checks it (tests/test_fa2_tc.py).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 and ldmatrix; lane = 4 g + t):
//   A (16 x 16, row):  a0 = A[g][2t, 2t+1], a1 = A[g+8][..], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, ..]
//   B (16 x 8, col):   b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C (16 x 8, f32):   c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
// Two adjacent n8 C tiles of S, rounded to 16 bits and packed in pairs, are exactly the A operand of one k16
// step of the next product (P V or dS K): P never goes through shared memory in the forward.
//
// Everything lives in namespace cuflash::fa2tc (the simulator links every family into one library).
#pragma once

#include "arch/arch.cuh"
#include "common/block_info.cuh"
#include "common/kernel_utils.cuh"
#include "common/dropout.cuh"
#include "common/mask.cuh"

namespace cuflash {
namespace fa2tc {

constexpr int kChunkElems = 8;  // 16-bit elements per 16-byte chunk

// Whether this launch differs from the shape a kernel's traits were built for (one-dimensional blocks of
// kThreads, kSmemBytes of dynamic shared memory) or has a head dim its tiles do not hold. The plan (Python) and
// the traits must agree exactly; the kernels trap on any mismatch, which is a bug.
template <int kSmemBytes, int kThreads, int kHeadDim>
__device__ __forceinline__ bool launch_shape_differs(const AttentionParams& p) {
  return launch_differs_from_traits<kSmemBytes, kThreads>() || p.headdim > kHeadDim || p.headdim < 1 ||
         p.headdim_v > kHeadDim || p.headdim_v < 1;
}

template <int Rows, int Cols>
struct SwizzledTile {
  static_assert(Rows % 16 == 0 && Cols % 32 == 0, "tiles are whole 16-row MMA strips and 32-column atoms");
  static constexpr int kRows = Rows;
  static constexpr int kCols = Cols;
  static constexpr int kChunksPerRow = Cols / kChunkElems;
  static constexpr int kAtomChunks = kChunksPerRow % 8 == 0 ? 8 : 4;
  static constexpr int kRowBytes = kChunksPerRow * 16;  // rows are packed without padding
  static constexpr int kBytes = Rows * kRowBytes;

  // Byte offset of chunk `chunk` (columns 8 chunk .. 8 chunk + 7) of row `row`. The XOR key is below the atom
  // width, so a chunk never leaves its atom (nor its row).
  __device__ __forceinline__ static int chunk_offset(int row, int chunk) {
    const int key = kAtomChunks == 8 ? (row & 7) : ((row >> 1) & 3);
    return (row * kChunksPerRow + (chunk ^ key)) * 16;
  }
  // An ldmatrix address split into a per-lane part and a compile-time step. The lane gives row `lane_row` and
  // chunk `lane_chunk` (0 or 1); the step adds row_step (a multiple of 8: the XOR key is unchanged) and
  // chunk_step (even: no carry into the lane's bit). Then the swizzled chunk is
  //   (chunk_step + lane_chunk) ^ key = (chunk_step & ~(atom-1)) + ((chunk_step & (atom-1)) ^ lane_x),
  // lane_x = lane_chunk ^ key: an immediate plus one of atom / 2 XORed values per lane, so ptxas folds the steps
  // into ldmatrix's immediate offsets instead of holding one address register per step.
  struct LaneOffset {
    int row_bytes;  // lane_row * row pitch
    int lane_x;     // lane_chunk ^ key(lane_row)
    __device__ __forceinline__ int at(int row_step, int chunk_step) const {
      return row_step * kRowBytes + row_bytes + (chunk_step & ~(kAtomChunks - 1)) * 16 +
             ((chunk_step & (kAtomChunks - 1)) ^ lane_x) * 16;
    }
  };
  __device__ __forceinline__ static LaneOffset lane_offset(int lane_row, int lane_chunk) {
    const int key = kAtomChunks == 8 ? (lane_row & 7) : ((lane_row >> 1) & 3);
    return LaneOffset{lane_row * kRowBytes, lane_chunk ^ key};
  }
  // Byte offset of element (row, col) (col even: the 4-byte pair col, col + 1 stays in one chunk).
  __device__ __forceinline__ static int element_offset(int row, int col) {
    return chunk_offset(row, col / kChunkElems) + (col % kChunkElems) * 2;
  }
};

// Whether rows of a global tile can move as 16-byte chunks: the base and every row start 16-byte aligned.
template <class T>
__device__ __forceinline__ bool rows_16b_aligned(const T* base, long long row_stride) {
  return (reinterpret_cast<unsigned long long>(base) & 15) == 0 && (row_stride * sizeof(T)) % 16 == 0;
}

// tile[r][c] = src[r * row_stride + c] for r < valid_rows, c < headdim; 0 elsewhere. The block's kThreads threads
// share the chunks (consecutive threads take consecutive chunks of a row: coalesced and, swizzled, conflict-free).
// vector: 16-byte cp.async (asynchronous: the caller commits the group and waits for it); otherwise element
// loads and a 16-byte shared store (synchronous). Either way exactly the valid elements are read.
template <class Tile, int kThreads, bool kStepRows = true, class T>
__device__ __forceinline__ void load_tile(unsigned char* tile, const KeyRows<const T>& rows, int valid_rows,
                                          int headdim, bool vector, int thread) {
  static_assert(sizeof(T) == 2, "tensor-core tiles hold 16-bit elements");
  static_assert(kChunkElems == 8, "the whole-chunk test below reads bit 3 of a count in 0..8");
  constexpr int kChunks = Tile::kRows * Tile::kChunksPerRow;
  // Where the threads cover whole rows 8k at a time, a thread's chunks are one column of rows r, r + kRowStep, ...,
  // all with the same XOR key (its period is 8 rows): on contiguous rows its copies step a source pointer by
  // kRowStep rows and the shared offset by kRowStep row pitches. The general loop below splits every chunk index
  // into row and column, bounds the column, tests for pages and multiplies out the 64-bit row offset: its loop
  // spans 77 SASS instructions per 16-byte copy at head dim 128 (sm_90), this one 12 (21 where it zero-fills).
  // Each thread issues the same copies in the same order either way. The stepped loop holds two registers more
  // while it runs: a caller at the register limit passes kStepRows = false.
  constexpr int kRowStep = kThreads / Tile::kChunksPerRow;
  constexpr bool kWholeRows = kStepRows && kThreads % Tile::kChunksPerRow == 0 && kRowStep % 8 == 0;
  // No copy loop is unrolled: they run while the kernels' accumulators are live, and unrolled, ptxas hoists
  // every copy's 64-bit source offset out of the main loops and spills for them.
  if (vector && kWholeRows && rows.pages == nullptr) {
    const int chunk = thread % Tile::kChunksPerRow;
    const int col_valid = max(0, min(kChunkElems, headdim - chunk * kChunkElems));
    int row = thread / Tile::kChunksPerRow;
    const T* from = rows.row(row) + chunk * kChunkElems;
    unsigned char* to = tile + Tile::chunk_offset(row, chunk);
    const long long from_step = kRowStep * rows.row_stride;
    constexpr int kToStep = kRowStep * Tile::kRowBytes;
    // Rows with this thread's chunk whole (every row of an interior tile, inside the head dim) take the copy
    // without zero fill: its loop is half as long. The rest (a ragged end) zero-fill what is past the data.
    // Whole is tested as a bit of col_valid (in 0..8, 8 = 0b1000), not as col_valid == kChunkElems: NVRTC 13.0's
    // and 12.9's ptxas fold that compare into the clamp (one VIMNMX.RELU with a predicate out, sm_90), which took a
    // chunk with no column left for a whole one: on an H200 the next row's first 8 elements landed where zeros
    // belong (head dims 16, 24, 40, 48, 56, 120 wrong; 13.5 compiles a plain compare). Tested as columns left >= 8
    // instead, 12.9 spilled the backward (d128 64 x 128 4 bytes on sm_80 and 20 on sm_90). With the bit, no
    // tensor-core instance for sm_90 holds the fused form under 13.0; tests/test_fa2_tc.py's gpu tests cover head
    // dims ending on a chunk boundary.
    const int whole_rows = (col_valid & kChunkElems) ? min(valid_rows, Tile::kRows) : 0;
#pragma unroll 1
    for (; row < whole_rows; row += kRowStep, from += from_step, to += kToStep) arch::cp_async<16>(to, from);
#pragma unroll 1
    for (; row < Tile::kRows; row += kRowStep, from += from_step, to += kToStep) {
      const int valid = row < valid_rows ? col_valid : 0;
      // A zero-byte copy still needs an aligned source address: the tile's own start.
      arch::cp_async<16>(to, valid > 0 ? from : rows.head_base, valid * 2);
    }
  } else if (vector) {
#pragma unroll 1
    for (int c = thread; c < kChunks; c += kThreads) {
      const int row = c / Tile::kChunksPerRow;
      const int col = (c % Tile::kChunksPerRow) * kChunkElems;
      const int valid = row < valid_rows ? max(0, min(kChunkElems, headdim - col)) : 0;
      // A zero-byte copy still needs an aligned source address: the tile's own start.
      const T* from = valid > 0 ? rows.row(row) + col : rows.head_base;
      arch::cp_async<16>(tile + Tile::chunk_offset(row, col / kChunkElems), from, valid * 2);
    }
  } else {
#pragma unroll 1
    for (int c = thread; c < kChunks; c += kThreads) {
      const int row = c / Tile::kChunksPerRow;
      const int col = (c % Tile::kChunksPerRow) * kChunkElems;
      const int valid = row < valid_rows ? max(0, min(kChunkElems, headdim - col)) : 0;
      unsigned short* to = reinterpret_cast<unsigned short*>(tile + Tile::chunk_offset(row, col / kChunkElems));
      if (valid == 0) {
#pragma unroll 1
        for (int e = 0; e < kChunkElems; ++e) to[e] = 0;
        continue;
      }
      const unsigned short* from = reinterpret_cast<const unsigned short*>(rows.row(row) + col);
#pragma unroll 1
      for (int e = 0; e < kChunkElems; ++e) to[e] = e < valid ? arch::load(from + e) : static_cast<unsigned short>(0);
    }
  }
}

// Whether load_whole_tile can copy a Tile with kThreads threads, and how. A row's chunks go in at most two column
// parts of power-of-two widths, the wider first: one where the row's chunk count is a power of two (d64: 8, d128:
// 16, d256: 32), two where it is not (d96: 8 + 4, d192: 16 + 8; 12 and 24 chunks divide no thread count, so one
// part could not give each thread one column of rows). In each part the threads cover whole rows kRowStep at a
// time: a thread's chunks there are one column of rows kRowStep apart, and the rows divide evenly. kRowStep a
// multiple of 4: the XOR key (period 8 rows) of rows r + 2 i kRowStep is r's and that of rows r + (2 i + 1)
// kRowStep is that of r + kRowStep, so a part's shared offsets are two bases (one where kRowStep is a multiple of
// 8) plus immediates.
template <class Tile, int kThreads>
struct WholeTileCopy {
  template <int kChunks>
  struct Part {
    static constexpr int kRowStep = kChunks > 0 ? kThreads / kChunks : 0;
    static constexpr bool kFits = kChunks == 0 || (kThreads % kChunks == 0 && kRowStep % 4 == 0 &&
                                                   Tile::kRows % kRowStep == 0);
  };
  __host__ __device__ static constexpr int highest_power_of_two(int n) {
    return n < 2 ? n : 2 * highest_power_of_two(n / 2);
  }
  static constexpr int kFirstChunks = highest_power_of_two(Tile::kChunksPerRow);
  static constexpr int kSecondChunks = Tile::kChunksPerRow - kFirstChunks;
  static constexpr bool kAvailable = Part<kFirstChunks>::kFits && Part<kSecondChunks>::kFits &&
                                     kSecondChunks == highest_power_of_two(kSecondChunks);
};

// The first row and column of a thread's chunks in load_whole_tile's first part (its source pointer's).
template <class Tile, int kThreads>
__device__ __forceinline__ int whole_tile_row(int thread) {
  return thread / WholeTileCopy<Tile, kThreads>::kFirstChunks;
}
template <class Tile, int kThreads>
__device__ __forceinline__ int whole_tile_column(int thread) {
  return (thread % WholeTileCopy<Tile, kThreads>::kFirstChunks) * kChunkElems;
}

// One column part of load_whole_tile: kChunks chunks of every row, `from` this thread's first (row `row`, chunk
// `chunk`), unrolled.
template <class Tile, int kThreads, int kChunks, class T>
__device__ __forceinline__ void load_whole_tile_part(unsigned char* tile, const T* from, long long row_stride,
                                                     int row, int chunk) {
  constexpr int kRowStep = WholeTileCopy<Tile, kThreads>::template Part<kChunks>::kRowStep;
  unsigned char* to = tile + Tile::chunk_offset(row, chunk);
  // Odd steps: row + kRowStep's offset, less the step's rows (the same as `to` where kRowStep % 8 == 0).
  unsigned char* to_odd = kRowStep % 8 == 0
                              ? to
                              : tile + Tile::chunk_offset(row + kRowStep, chunk) - kRowStep * Tile::kRowBytes;
#pragma unroll
  for (int i = 0; i < Tile::kRows / kRowStep; ++i) {
    arch::cp_async<16>((i % 2 ? to_odd : to) + i * kRowStep * Tile::kRowBytes, from);
    from += kRowStep * row_stride;
  }
}

// tile = rows [0, Tile::kRows) x columns [0, Tile::kCols) of contiguous rows `row_stride` elements apart: the copy
// of an interior tile, every row valid, every chunk whole (head dim = Tile::kCols), rows 16-byte aligned, not paged
// (the caller tests this per block; load_tile stays the general path). `from` is this thread's first chunk: row
// whole_tile_row, column whole_tile_column. Each thread's copies are unrolled: per column part one source pointer
// stepped by kRowStep rows (the second part's a per-thread offset from the first's) and shared offsets that are
// immediates from one or two per-thread bases, so a 16-byte cp.async costs a pointer step instead of load_tile's
// loop. Where the row's chunks are a power of two (one part), the same chunks as load_tile, in the same order per
// thread; with two parts (d96, d192) a thread's chunks differ from load_tile's general loop, which the loop's
// cp.async wait and barrier make irrelevant.
template <class Tile, int kThreads, class T>
__device__ __forceinline__ void load_whole_tile(unsigned char* tile, const T* from, long long row_stride, int thread) {
  using Copy = WholeTileCopy<Tile, kThreads>;
  static_assert(Copy::kAvailable, "each column part's threads cover whole rows, 4k at a time");
  static_assert(sizeof(T) == 2, "tensor-core tiles hold 16-bit elements");
  // The first part's chunk as the callers find their pointer's (whole_tile_row, whole_tile_column): written as
  // thread % kFirstChunks instead, ptxas scheduled the one-part instances otherwise (sm_90 d128 backward +6 a step).
  const int row = whole_tile_row<Tile, kThreads>(thread);
  const int column = whole_tile_column<Tile, kThreads>(thread);
  load_whole_tile_part<Tile, kThreads, Copy::kFirstChunks>(tile, from, row_stride, row, column / kChunkElems);
  if constexpr (Copy::kSecondChunks > 0) {
    // The second part's first chunk: row thread / kSecondChunks, chunk kFirstChunks + thread % kSecondChunks.
    const int second_row = thread / Copy::kSecondChunks;
    const int second_column = (Copy::kFirstChunks + thread % Copy::kSecondChunks) * kChunkElems;
    load_whole_tile_part<Tile, kThreads, Copy::kSecondChunks>(
        tile, from + (second_row - row) * row_stride + (second_column - column), row_stride, second_row,
        second_column / kChunkElems);
  }
}

// The same from contiguous rows: src[r * row_stride + c].
template <class Tile, int kThreads, bool kStepRows = true, class T>
__device__ __forceinline__ void load_tile(unsigned char* tile, const T* src, long long row_stride, int valid_rows,
                                          int headdim, bool vector, int thread) {
  load_tile<Tile, kThreads, kStepRows>(tile, KeyRows<const T>{src, row_stride, 0, nullptr, 0, 0}, valid_rows, headdim,
                                       vector, thread);
}

// ---- fragments ------------------------------------------------------------------------------------------

// ldmatrix addresses of this lane for the operand kinds; `at(row_step, chunk_step)` then gives a step.
// A (16 x 16) from a row-major tile [m][k], ldmatrix.x4: lane l gives row l % 16 at chunk l / 16 (a0..a3).
template <class Tile>
__device__ __forceinline__ typename Tile::LaneOffset a_row_lane(int lane) {
  return Tile::lane_offset(lane % 16, lane / 16);
}
// Two 8x8 pairs read as [8 rows][2 chunks] per half warp: lane l gives row (l & 7) + 8 (l >> 4) at chunk
// (l >> 3) & 1. Used untransposed for B of two adjacent n8 tiles from a tile stored [n][k] (K in Q K^T:
// b[0..1] for n0, b[2..3] for n0 + 8), and transposed for A from a tile stored [k][m] (P or dS in P^T dO,
// dS^T Q: matrices a0..a3 are rows k0.. / k0 + 8.. x columns m0.. / m0 + 8..).
template <class Tile>
__device__ __forceinline__ typename Tile::LaneOffset pair_lane(int lane) {
  return Tile::lane_offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}
// B of two adjacent n8 tiles from a tile stored [k][n] (V in P V, dO, Q, K in the backward), ldmatrix.x4.trans:
// lane l gives row (l & 7) + 8 ((l >> 3) & 1) at chunk l >> 4; b[0..1] for n0, b[2..3] for n0 + 8.
template <class Tile>
__device__ __forceinline__ typename Tile::LaneOffset b_kn_lane(int lane) {
  return Tile::lane_offset((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
}

// ldmatrix addresses with every step an immediate (the forward's main loop). LaneOffset::at still XORs each even
// chunk step into the lane's chunk; over a tile those XORs take only kAtomChunks / 2 values per lane (the step's
// bits below the atom), so a lane holds that many base offsets, computed once per kernel (outside the K/V loop),
// and every ldmatrix address is a base plus a compile-time row, atom and tile offset. `extra` (a block-uniform
// byte offset, e.g. the warp's first row) is folded into the bases too.
template <class Tile>
struct LaneBases {
  static constexpr int kBases = Tile::kAtomChunks / 2;
  int base[kBases];
  // chunk0 (even, block-uniform: a warp's first column of a tile read transposed) is folded in as well: at(r, s)
  // is then lane.at(r, chunk0 + s). (chunk0 + s splits into the atom's part and the rest the same way for every
  // s of the same residue mod kAtomChunks, so base c = lane.at(0, chunk0 + 2 c) serves every s = 2 c + atom q.)
  __device__ __forceinline__ static LaneBases of(typename Tile::LaneOffset lane, int extra = 0, int chunk0 = 0) {
    LaneBases bases;
#pragma unroll
    for (int c = 0; c < kBases; ++c) bases.base[c] = extra + lane.at(0, chunk0 + 2 * c);
    return bases;
  }
  // The same bases passed through an identity shuffle (each lane reads its own): ptxas cannot recompute a shuffle's
  // result, so it keeps the bases in registers through the main loop instead of rebuilding them from the thread
  // index in every iteration (it did, with 12 registers to spare: about 35 instructions per K/V block at d128).
  // Not under CUDA 12: its ptxas spilled the pinned bases (sm_90: d96 128x64x4 76 bytes, d192 128x64x8 40, d256
  // 64x64x4 316) where 13's does not; there the bases stay plain values ptxas may rebuild.
  __device__ __forceinline__ LaneBases pinned(int lane) const {
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ < 13
    (void)lane;
    return *this;
#else
    LaneBases out;
#pragma unroll
    for (int c = 0; c < kBases; ++c) out.base[c] = __shfl_sync(0xffffffffu, base[c], lane);
    return out;
#endif
  }
  // The bases of the same lanes chunk_step chunks further (even): shifted(s).at(r, c) = at(r, s + c). The new bases
  // are the old ones in another order plus whole atoms (at(0, x + atom q) = at(0, x) + 16 atom q), so where
  // chunk_step is a constant (an unrolled loop's) every address stays a register plus an immediate; a runtime
  // chunk_step would index the bases dynamically (local memory).
  __device__ __forceinline__ LaneBases shifted(int chunk_step) const {
    LaneBases out;
#pragma unroll
    for (int c = 0; c < kBases; ++c) out.base[c] = at(0, chunk_step + 2 * c);
    return out;
  }
  // The byte offset LaneOffset::at(row_step, chunk_step) gives (row_step a multiple of 8, chunk_step even).
  __device__ __forceinline__ int at(int row_step, int chunk_step) const {
    return row_step * Tile::kRowBytes + (chunk_step & ~(Tile::kAtomChunks - 1)) * 16 +
           base[(chunk_step & (Tile::kAtomChunks - 1)) / 2];
  }
};

// Accumulator of an (MTiles x 16) x (NTiles x 8) warp product, C layout per 16 x 8 tile.
// Where a lane's c[i][j][2 half + e] sits in the warp's product (mma's C layout, lane = 4 g + t): row
// acc_row(lane, i, half) = 16 i + g + 8 half, column acc_col(lane, j) + e = 8 j + 2 t + e. Every index a kernel
// derives from an accumulator (mask, score hook, dropout, epilogues) goes through these two.
__device__ __forceinline__ int acc_row(int lane, int i, int half) { return 16 * i + lane / 4 + 8 * half; }
__device__ __forceinline__ int acc_col(int lane, int j) { return 8 * j + 2 * (lane % 4); }

// Byte offsets in a swizzled Tile of a warp's accumulator pairs c[i][j][2 half + 0/1] (row row0 + acc_row(lane, i,
// half), columns col0 + acc_col(lane, j) + 0/1), where a product's result is staged (P, dS): one per-lane base and,
// per pair, an XOR with a constant plus an immediate. Exact when row0 is a multiple of 8 (the XOR key has a period
// of 8 rows, so i and half move whole rows) and NTiles is a power of two with col0 / 8 a multiple of NTiles or of
// the atom (a warp's first column in a WarpTiling): then chunk col0 / 8 + j is (col0 / 8) | (j % atom) plus whole
// atoms, and swizzled it differs from the base's chunk only in the key's bits, by j % atom. (Through
// element_offset, ptxas made every store's address anew: about 2 instructions per 4-byte store.)
template <class Tile, int NTiles>
struct AccPairOffsets {
  static_assert(NTiles > 0 && (NTiles & (NTiles - 1)) == 0, "n8 tiles per warp: a power of two");
  int base;
  __device__ __forceinline__ static AccPairOffsets of(int row0, int col0, int lane) {
    return AccPairOffsets{Tile::element_offset(row0 + acc_row(lane, 0, 0), col0 + acc_col(lane, 0))};
  }
  __device__ __forceinline__ int at(int i, int half, int j) const {
    constexpr int kAtom = Tile::kAtomChunks;
    return (base ^ (j % kAtom) * 16) + (j / kAtom) * kAtom * 16 + (16 * i + 8 * half) * Tile::kRowBytes;
  }
};

template <int MTiles, int NTiles>
struct Accumulator {
  float c[MTiles][NTiles][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < MTiles; ++i)
#pragma unroll
      for (int j = 0; j < NTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[i][j][e] = 0.f;
  }
};

template <class T>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const unsigned b[2] = {b0, b1};
  arch::mma_m16n8k16<T>(d, a, b, d);
}

// An accumulator of (MTiles x 16) x (16 KSteps) as the A operands of the next product (P from S, dS for dQ):
// n8 tiles 2 kk and 2 kk + 1 become k16 step kk, each pair of floats rounded to T. Converted all at once before
// the product: the packed operand is half the registers of the float32 accumulator, which then dies.
template <class T, int MTiles, int KSteps>
__device__ __forceinline__ void to_a_operand(unsigned (&a)[MTiles][KSteps][4],
                                             const Accumulator<MTiles, 2 * KSteps>& acc) {
#pragma unroll
  for (int i = 0; i < MTiles; ++i)
#pragma unroll
    for (int kk = 0; kk < KSteps; ++kk) {
      a[i][kk][0] = arch::pack_float2<T>(acc.c[i][2 * kk][0], acc.c[i][2 * kk][1]);
      a[i][kk][1] = arch::pack_float2<T>(acc.c[i][2 * kk][2], acc.c[i][2 * kk][3]);
      a[i][kk][2] = arch::pack_float2<T>(acc.c[i][2 * kk + 1][0], acc.c[i][2 * kk + 1][1]);
      a[i][kk][3] = arch::pack_float2<T>(acc.c[i][2 * kk + 1][2], acc.c[i][2 * kk + 1][3]);
    }
}

// acc += A B over k in [0, K) for one warp's (16 MTiles) x (8 NTiles) tile, both operands from shared memory:
//   A row-major [m][k] (kATrans = false) or stored [k][m] (kATrans: ldmatrix.trans);
//   B stored [n][k] (kBTrans = false: B^T row-major, K in Q K^T) or [k][n] (kBTrans: ldmatrix.trans).
// S = Q K^T, dP = dO V^T: <false, false>; dV += P^T dO, dK += dS^T Q: <true, true>; dQ = dS K: <false, true>.
// Every ldmatrix address is a lane base (LaneBases) plus an immediate: the bases hold the warp's first row of an
// operand read row-major (`extra`), and its first column (`chunk0`) of one read transposed.
template <class T, bool kATrans, bool kBTrans, class TileA, class TileB, int MTiles, int NTiles, int K>
__device__ __forceinline__ void gemm_ss(Accumulator<MTiles, NTiles>& acc, const unsigned char* tile_a,
                                        const LaneBases<TileA>& a_at, const unsigned char* tile_b,
                                        const LaneBases<TileB>& b_at) {
  static_assert(NTiles % 2 == 0 && K % 16 == 0, "B fragments come in pairs of n8 tiles, k in steps of 16");
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    unsigned a[MTiles][4];
#pragma unroll
    for (int i = 0; i < MTiles; ++i)
      arch::ldmatrix<4, kATrans>(a[i], tile_a + (kATrans ? a_at.at(k0, 2 * i) : a_at.at(16 * i, k0 / kChunkElems)));
#pragma unroll
    for (int j = 0; j < NTiles; j += 2) {
      unsigned b[4];
      arch::ldmatrix<4, kBTrans>(b, tile_b + (kBTrans ? b_at.at(k0, j) : b_at.at(8 * j, k0 / kChunkElems)));
#pragma unroll
      for (int i = 0; i < MTiles; ++i) {
        mma<T>(acc.c[i][j], a[i], b[0], b[1]);
        mma<T>(acc.c[i][j + 1], a[i], b[2], b[3]);
      }
    }
  }
}

// acc += A B over k in [0, 16 KSteps): A from registers (to_a_operand of this warp's previous product), B = rows
// k of tile_b [k][n], columns 0 .. 8 NTiles read transposed from the lanes' bases b_at (O += P V).
template <class T, class TileB, int MTiles, int NTiles, int KSteps>
__device__ __forceinline__ void gemm_rs(Accumulator<MTiles, NTiles>& acc, const unsigned (&a)[MTiles][KSteps][4],
                                        const unsigned char* tile_b, const LaneBases<TileB>& b_at) {
  static_assert(NTiles % 2 == 0, "B fragments come in pairs of n8 tiles");
#pragma unroll
  for (int kk = 0; kk < KSteps; ++kk) {
#pragma unroll
    for (int j = 0; j < NTiles; j += 2) {
      unsigned b[4];
      arch::ldmatrix<4, true>(b, tile_b + b_at.at(16 * kk, j));
#pragma unroll
      for (int i = 0; i < MTiles; ++i) {
        mma<T>(acc.c[i][j], a[i][kk], b[0], b[1]);
        mma<T>(acc.c[i][j + 1], a[i][kk], b[2], b[3]);
      }
    }
  }
}

// f(score, row, key) on every score this lane holds of a warp's S accumulator whose first row is `row0` and first
// key `key0`.
template <int MTiles, int NTiles, class F>
__device__ __forceinline__ void for_each_score(Accumulator<MTiles, NTiles>& acc, int row0, int key0, int lane, F&& f) {
#pragma unroll
  for (int i = 0; i < MTiles; ++i)
#pragma unroll
    for (int j = 0; j < NTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(acc.c[i][j][e], row0 + acc_row(lane, i, e / 2), key0 + acc_col(lane, j) + e % 2);
}

// A score hook's tile form (FlexHook::on_tile's callback) applied to every score of a warp's S accumulator: a
// struct with a call template, not a generic lambda, whose call operator NVRTC 12.9 takes for a host function in a
// kernel.
template <int MTiles, int NTiles>
struct HookEachScore {
  Accumulator<MTiles, NTiles>& acc;
  int row0;
  int key0;
  int lane;
  template <class TileHook>
  __device__ __forceinline__ void operator()(const TileHook& tile_hook) const {
    for_each_score(acc, row0, key0, lane, [&](float& x, int row, int key) { x = tile_hook(x, row, key); });
  }
};

// The element-wise mask of a tile crossing `edges` (mask.cuh) on a warp's S accumulator whose first row is `row0`
// and first key `key0`: hidden scores become -inf. The lane's scores sit at acc_row(lane, i, half) =
// acc_row(lane, 0, 0) + acc_row(0, i, half) and acc_col(lane, j) + e = acc_col(lane, 0) + acc_col(0, j) + e, so
// the offsets LaneTileMask takes are constants; one pass per crossed edge.
template <Edge E, int MTiles, int NTiles>
__device__ __forceinline__ void mask_edge(Accumulator<MTiles, NTiles>& acc, const LaneTileMask& lane_mask) {
  // for_each_score from row 0, key 0 as lane 0 gives each score's offsets (dr, dc), constants once unrolled.
  for_each_score(acc, 0, 0, 0, [&](float& x, int dr, int dc) {
    if (!lane_mask.keeps<E>(dr, dc)) x = neg_inf();
  });
}

template <int MTiles, int NTiles>
__device__ __forceinline__ void mask_tile(Accumulator<MTiles, NTiles>& acc, const MaskPolicy& mask, TileEdges edges,
                                          int row0, int key0, int lane) {
  const LaneTileMask lane_mask = mask.lane_tile(row0 + acc_row(lane, 0, 0), key0 + acc_col(lane, 0));
  if (edges.right) mask_edge<Edge::kRight>(acc, lane_mask);
  if (edges.left) mask_edge<Edge::kLeft>(acc, lane_mask);
  if (edges.end) mask_edge<Edge::kEnd>(acc, lane_mask);
}

// Reductions over the 4 lanes of a quad (they hold one accumulator row between them), in a fixed order.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Writes rows [0, valid_rows) x columns [0, headdim) of a swizzled tile to global memory (row stride in
// elements): 16-byte stores where the rows are 16-byte aligned and a chunk is whole, element stores otherwise.
template <class Tile, class T>
__device__ __forceinline__ void store_tile(T* dst, long long row_stride, const unsigned char* tile, int row_begin,
                                           int row_end, int valid_rows, int headdim, int thread, int threads) {
  const bool vector = rows_16b_aligned(dst, row_stride);
  const int chunks = (row_end - row_begin) * Tile::kChunksPerRow;
  for (int c = thread; c < chunks; c += threads) {
    const int row = row_begin + c / Tile::kChunksPerRow;
    const int chunk = c % Tile::kChunksPerRow;
    const int col = chunk * kChunkElems;
    const int valid = row < valid_rows ? max(0, min(kChunkElems, headdim - col)) : 0;
    if (valid == 0) continue;
    const uint4 packed = *reinterpret_cast<const uint4*>(tile + Tile::chunk_offset(row, chunk));
    T* to = dst + row * row_stride + col;
    if (vector && valid == kChunkElems) {
      arch::store(reinterpret_cast<uint4*>(to), packed);
    } else {
      const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
      for (int e = 0; e < kChunkElems; ++e)  // unrolled: words[] stays in registers
        if (e < valid)
          arch::store(reinterpret_cast<unsigned short*>(to) + e,
                      static_cast<unsigned short>(words[e / 2] >> (16 * (e % 2))));
    }
  }
}

}  // namespace fa2tc
}  // namespace cuflash
