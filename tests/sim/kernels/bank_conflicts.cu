// Planted access patterns for the bank-conflict profile (tests/sim/test_sim_bank_conflicts.py).
// One warp; each kernel's shared accesses sit on marked lines the test names.
#include "arch/arch.cuh"
#include "simkit_args.cuh"

namespace simbank {

using simkit::Args;  // simkit_args.cuh: the layout of simkit.ARGS_DTYPE

// A 32 x 32 float tile with a row stride of a.n floats (32: every row starts in bank 0; 33: padded),
// written by rows, then read down column 0 (lane l reads row l).
__global__ void column_read_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int lane = threadIdx.x;
  for (int r = 0; r < 32; ++r) tile[r * a.n + lane] = static_cast<float>(r * 32 + lane);  // ROW_WRITE
  __syncwarp();
  const float x = tile[lane * a.n];  // COLUMN_READ
  cuflash::arch::store(static_cast<float*>(a.out0) + lane, x);
}

// A 64 x 64 tile of 16-bit elements (128-byte rows, eight 16-byte chunks a row), written from
// global memory with 16-byte cp.async and read back with ldmatrix x4: matrix j of lane l's group
// covers rows 8 (l / 8) .. + 7 of chunk j (the A operand of four k16 steps). a.mode 1 stores chunk
// c of row r at chunk c ^ (r % 8) (FA2's XOR swizzle); 0 stores it unswizzled.
__device__ __forceinline__ int chunk_slot(int row, int chunk, int swizzle) { return swizzle ? chunk ^ (row % 8) : chunk; }

__global__ void swizzle_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  const unsigned short* src = static_cast<const unsigned short*>(a.in0);
  for (int i = lane; i < 64 * 8; i += 32) {  // 8 lanes a row, one 16-byte chunk each
    const int row = i / 8, chunk = i % 8;
    unsigned char* dst = smem + row * 128 + chunk_slot(row, chunk, a.mode) * 16;
    cuflash::sim::cp_async(dst, src + row * 64 + chunk * 8, 16, 16);  // CP_ASYNC
  }
  cuflash::sim::cp_async_commit();
  cuflash::sim::cp_async_wait(0);
  __syncwarp();
  unsigned* out = static_cast<unsigned*>(a.out0);
  for (int rows = 0; rows < 64; rows += 8) {
    // Lane l: row rows + l % 8 ... of matrix l / 8, which is chunk (l / 8) of those rows.
    const int row = rows + lane % 8, chunk = lane / 8;
    unsigned r[4];
    cuflash::sim::ldmatrix<4, false>(r, smem + row * 128 + chunk_slot(row, chunk, a.mode) * 16);  // LDMATRIX
    for (int j = 0; j < 4; ++j) cuflash::arch::store(out + (rows / 8) * 128 + j * 32 + lane, r[j]);
  }
}

}  // namespace simbank
