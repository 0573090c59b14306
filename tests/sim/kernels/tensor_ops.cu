// Test kernels for the simulator's mma.sync / ldmatrix / cp.async twins
// (cuflash::sim::*, sim_tensor.h). Simulator-only: they call the twins directly.
#include "arch/arch.cuh"

namespace simtensor {

struct Args {
  void* in0;
  void* in1;
  void* out0;
  void* out1;
  int n;
  int mode;
  int width;
  unsigned mask;
  int extra;
  int pad;
};

using cuflash::arch::load;
using cuflash::arch::store;

// Registers in, registers out: in0 = A regs [32][4] and B regs [32][2] (uint32, 6 per lane),
// in1 = C [32][4] floats, out0 = D [32][4] floats.
template <class T>
__global__ void mma_kernel(const Args a) {
  const int lane = threadIdx.x;
  const unsigned* regs = static_cast<const unsigned*>(a.in0) + 6 * lane;
  const unsigned ar[4] = {load(regs), load(regs + 1), load(regs + 2), load(regs + 3)};
  const unsigned br[2] = {load(regs + 4), load(regs + 5)};
  const float* c = static_cast<const float*>(a.in1) + 4 * lane;
  const float cr[4] = {load(c), load(c + 1), load(c + 2), load(c + 3)};
  float d[4];
  cuflash::sim::mma_m16n8k16<T>(d, ar, br, cr);
  for (int i = 0; i < 4; ++i) store(static_cast<float*>(a.out0) + 4 * lane + i, d[i]);
}

// in0: four 8x8 matrices of 16-bit values, row-major, back to back (256 ushorts).
// Copied to shared memory with a row pitch of a.width bytes (>= 16, multiple of 16).
// Lane l points at row l % 8 of matrix l / 8; out0 = the registers, 4 per lane.
template <int kCount, bool kTrans>
__global__ void ldmatrix_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  const int pitch = a.width;
  for (int i = lane; i < 32 * 8; i += 32) {
    const int row = i / 8, col = i % 8;  // 32 rows of 8 halves
    const unsigned short v = load(static_cast<const unsigned short*>(a.in0) + i);
    *reinterpret_cast<unsigned short*>(smem + row * pitch + 2 * col) = v;
  }
  __syncwarp();
  unsigned r[kCount];
  cuflash::sim::ldmatrix<kCount, kTrans>(r, smem + lane * pitch);
  for (int j = 0; j < 4; ++j) store(static_cast<unsigned*>(a.out0) + 4 * lane + j, j < kCount ? r[j] : 0u);
}

// ldmatrix with a misaligned row address (a.mode = 1) or a row outside shared memory (2).
__global__ void ldmatrix_bad_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  unsigned char* row = smem + 16 * (lane % 8);
  if (a.mode == 1 && lane == 3) row += 8;
  if (a.mode == 2 && lane == 5) row = smem + 4096;
  unsigned r[1];
  cuflash::sim::ldmatrix<1, false>(r, row);
  store(static_cast<unsigned*>(a.out0) + lane, r[0]);
}

// Each thread copies 16 bytes (4 floats) of in0 to its smem slot, in two groups:
// floats [0, 2) in group 0 (src-size a.n bytes of 8), floats [2, 4) in group 1.
// a.mode: 0 wait_group 0; 1 wait_group 1 (group 1 still pending); 2 no wait at all.
// out0[t] = the thread's 4 smem floats after the wait; out1[t] = neighbour's first float
// after a barrier.
__global__ void cp_async_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  const float* src = static_cast<const float*>(a.in0) + 4 * t;
  cuflash::sim::cp_async(tile + 4 * t, src, 8, static_cast<unsigned>(a.n));
  cuflash::sim::cp_async_commit();
  cuflash::sim::cp_async(tile + 4 * t + 2, src + 2, 8, 8);
  cuflash::sim::cp_async_commit();
  if (a.mode == 0) cuflash::sim::cp_async_wait(0);
  if (a.mode == 1) cuflash::sim::cp_async_wait(1);
  for (int i = 0; i < 4; ++i) store(static_cast<float*>(a.out0) + 4 * t + i, tile[4 * t + i]);
  __syncthreads();
  store(static_cast<float*>(a.out1) + t, tile[4 * ((t + 1) % blockDim.x)]);
}

__global__ void cp_async_bad_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const float* src = static_cast<const float*>(a.in0);
  if (a.mode == 0) cuflash::sim::cp_async(smem + 4, src, 16, 16);           // misaligned destination
  if (a.mode == 1) cuflash::sim::cp_async(smem, src + a.n, 16, 16);         // source past the buffer
  if (a.mode == 2) cuflash::sim::cp_async(smem + a.extra, src, 16, 16);     // destination past smem
  cuflash::sim::cp_async_commit();
  cuflash::sim::cp_async_wait(0);
}

}  // namespace simtensor
