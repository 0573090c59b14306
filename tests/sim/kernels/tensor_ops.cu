// Test kernels for the tensor-core, async-copy and packing wrappers of the arch layer (cuflash::arch::, whose
// simulator side forwards to the twins in sim_tensor.h). tests/test_arch_wrappers.py also compiles them
// with NVRTC and checks their SASS.
#include "arch/arch.cuh"
#include "simkit_args.cuh"

namespace simtensor {

using simkit::Args;  // simkit_args.cuh: the layout of simkit.ARGS_DTYPE

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
  cuflash::arch::mma_m16n8k16<T>(d, ar, br, cr);
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
  cuflash::arch::ldmatrix<kCount, kTrans>(r, smem + lane * pitch);
  for (int j = 0; j < 4; ++j) store(static_cast<unsigned*>(a.out0) + 4 * lane + j, j < kCount ? r[j] : 0u);
}

// The tensor-core path end to end: A (16x16) and B (16x8, stored k-major) from in0 go to shared
// memory; ldmatrix.x4 gives the mma A fragment (lane l points at A[l % 16][8 (l / 16)]), the
// transposing ldmatrix.x2 the B fragment (lane l < 16 points at B[l][0]); out0 = D = A B, 4 per lane.
template <class T>
__global__ void ldmatrix_mma_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);  // A: 16 rows x 32 bytes at 0; B: 16 rows x 16 bytes at 512
  const int lane = threadIdx.x;
  for (int i = lane; i < 256 + 128; i += 32)
    reinterpret_cast<unsigned short*>(smem)[i] = load(static_cast<const unsigned short*>(a.in0) + i);
  __syncwarp();
  unsigned ar[4], br[2];
  cuflash::arch::ldmatrix<4, false>(ar, smem + (lane % 16) * 32 + 16 * (lane / 16));
  cuflash::arch::ldmatrix<2, true>(br, smem + 512 + (lane % 16) * 16);
  const float c[4] = {0.f, 0.f, 0.f, 0.f};
  float d[4];
  cuflash::arch::mma_m16n8k16<T>(d, ar, br, c);
  for (int i = 0; i < 4; ++i) store(static_cast<float*>(a.out0) + 4 * lane + i, d[i]);
}

// ldmatrix with a misaligned row address (a.mode = 1) or a row outside shared memory (2).
__global__ void ldmatrix_bad_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  unsigned char* row = smem + 16 * (lane % 8);
  if (a.mode == 1 && lane == 3) row += 8;
  if (a.mode == 2 && lane == 5) row = smem + 4096;
  unsigned r[1];
  cuflash::arch::ldmatrix<1, false>(r, row);
  store(static_cast<unsigned*>(a.out0) + lane, r[0]);
}

// stmatrix: in0 = the registers [32][4] (uint32); shared memory (32 rows of a.width bytes, zeroed first) takes
// kCount matrices, lane l giving row l % 8 of matrix l / 8 (row l); out0 = the 32 rows' first 16 bytes (256 ushorts),
// each lane copying row (l + 1) % 32, which another lane stored: after a __syncwarp (a.mode 0), or without one (1, a
// race in race mode). A row address misaligned (a.mode 2, lane 3) or outside shared memory (3, lane 5) is an error.
template <int kCount>
__global__ void stmatrix_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x;
  const int pitch = a.width;
  for (int i = lane; i < 32 * pitch / 4; i += 32) reinterpret_cast<unsigned*>(smem)[i] = 0u;
  __syncwarp();
  unsigned r[kCount];
  for (int j = 0; j < kCount; ++j) r[j] = load(static_cast<const unsigned*>(a.in0) + 4 * lane + j);
  unsigned char* row = smem + lane * pitch;
  if (a.mode == 2 && lane == 3) row += 8;
  if (a.mode == 3 && lane == 5) row = smem + 32 * pitch;
  cuflash::arch::stmatrix<kCount>(row, r);
  if (a.mode != 1) __syncwarp();
  const int from = (lane + 1) % 32;
  for (int w = 0; w < 4; ++w)
    store(static_cast<unsigned*>(a.out0) + 4 * from + w, reinterpret_cast<const unsigned*>(smem + from * pitch)[w]);
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
  cuflash::arch::cp_async<8>(tile + 4 * t, src, static_cast<unsigned>(a.n));
  cuflash::arch::cp_async_commit();
  cuflash::arch::cp_async<8>(tile + 4 * t + 2, src + 2, 8);
  cuflash::arch::cp_async_commit();
  if (a.mode == 0) cuflash::arch::cp_async_wait<0>();
  if (a.mode == 1) cuflash::arch::cp_async_wait<1>();
  for (int i = 0; i < 4; ++i) store(static_cast<float*>(a.out0) + 4 * t + i, tile[4 * t + i]);
  __syncthreads();
  store(static_cast<float*>(a.out1) + t, tile[4 * ((t + 1) % blockDim.x)]);
}

__global__ void cp_async_bad_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const float* src = static_cast<const float*>(a.in0);
  if (a.mode == 0) cuflash::arch::cp_async<16>(smem + 4, src, 16);           // misaligned destination
  if (a.mode == 1) cuflash::arch::cp_async<16>(smem, src + a.n, 16);         // source past the buffer
  if (a.mode == 2) cuflash::arch::cp_async<16>(smem + a.extra, src, 16);     // destination past smem
  cuflash::arch::cp_async_commit();
  cuflash::arch::cp_async_wait<0>();
}

// Thread t copies kBytes of in0 (from byte kBytes * t) to shared memory with a.n source bytes
// (the rest zero-filled; kWhole: the form without src-size, all kBytes), waits, and writes the shared bytes
// back to out0 as 32-bit words.
template <int kBytes, bool kWhole = false>
__global__ void cp_async_bytes_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int t = threadIdx.x;
  const unsigned char* src = static_cast<const unsigned char*>(a.in0) + kBytes * t;
  if constexpr (kWhole)
    cuflash::arch::cp_async<kBytes>(smem + kBytes * t, src);
  else
    cuflash::arch::cp_async<kBytes>(smem + kBytes * t, src, a.n);
  cuflash::arch::cp_async_commit();
  cuflash::arch::cp_async_wait<0>();
  __syncthreads();
  for (int w = 0; w < kBytes / 4; ++w)
    store(static_cast<unsigned*>(a.out0) + (kBytes / 4) * t + w, reinterpret_cast<const unsigned*>(smem)[(kBytes / 4) * t + w]);
}

// out0[t] = pack_float2<T>(in0[2t], in0[2t + 1]).
template <class T>
__global__ void pack_kernel(const Args a) {
  const int t = threadIdx.x;
  const float* x = static_cast<const float*>(a.in0);
  store(static_cast<unsigned*>(a.out0) + t, cuflash::arch::pack_float2<T>(load(x + 2 * t), load(x + 2 * t + 1)));
}

// out0[t] = smem_address(smem + 16 t) - smem_address(smem): shared addresses are byte offsets.
__global__ void smem_address_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int t = threadIdx.x;
  store(static_cast<unsigned*>(a.out0) + t,
        cuflash::arch::smem_address(smem + 16 * t) - cuflash::arch::smem_address(smem));
  store(static_cast<unsigned*>(a.out1) + t, cuflash::arch::smem_address(smem) % 1024u);
}

// Thread t adds in0[2t], in0[2t + 1] to the pair at out0 + 2 (t % a.n) + kOffset with atomic_add2 (kOffset 1: a
// pair off its 8-byte alignment), then 1 to out0[2 (t % a.n)] with atomic_add (the two kinds on one element). A
// template: red.global.add.v2.f32 exists from sm_90, and the file also compiles for sm_80.
template <int kOffset>
__global__ void atomic_add2_kernel(const Args a) {
  const int t = threadIdx.x;
  const float* x = static_cast<const float*>(a.in0) + 2 * t;
  float* pairs = static_cast<float*>(a.out0);
  cuflash::arch::atomic_add2(pairs + 2 * (t % a.n) + kOffset, load(x), load(x + 1));
  cuflash::arch::atomic_add(pairs + 2 * (t % a.n), 1.f);
}

}  // namespace simtensor
