// Test kernels for the arch layer's TMA wrappers (tma_load, tma_store, their bulk groups) taking tensor maps
// as __grid_constant__ parameters: tests/sim/test_sim_tma.py launches them on the simulator with maps from
// cuflash.kernels.tensor_map.encode_tiled, tests/test_arch_hopper_tma.py compiles them with NVRTC for sm_90a
// and checks their SASS.
#include "arch/arch.cuh"

namespace simtma {

using cuflash::arch::load;
using cuflash::arch::store;
using cuflash::arch::TensorMap;

// Shared memory of the load and store kernels: the mbarrier at 0, the box at kBoxAt (1024-byte aligned, so
// every swizzle pattern starts at the box), plus box_offset (a planted misalignment).
constexpr int kBoxAt = 1024;

struct Args {
  TensorMap map;
  unsigned short* out;          // load: the box's shared bytes as they are after the wait
  const unsigned short* image;  // store: the shared bytes the store reads
  int coords[5];
  int box_bytes;
  int box_offset;
  int mode;
  int span;  // load: the bytes copied out (the swizzle may place a partial line's units past box_bytes)
};

// One thread loads the box at a.coords; every thread waits on the mbarrier, then the block copies the box's
// shared bytes out as they are (swizzled). Planted bugs (a.mode):
//   1 the issuing thread reads the destination before its wait      2 thread 32 reads it after a __syncthreads
//                                                                      that follows the issue, before any wait
//   3 expects 16 more tx bytes than the box has (a deadlock)         4 expects 16 fewer (bytes beyond the count)
// and a clean variant: 5 every thread polls with try_wait.parity instead of the blocking wait.
// a.box_offset != 0 misaligns the destination.
template <int kRank>
__global__ void __launch_bounds__(64) load_kernel(const __grid_constant__ Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  unsigned char* box = smem + kBoxAt + a.box_offset;
  const unsigned short* box16 = reinterpret_cast<const unsigned short*>(box);
  const int t = threadIdx.x;
  if (t == 0) {
    cuflash::arch::mbarrier_init(bar, 1);
    cuflash::arch::fence_mbarrier_init();
  }
  __syncthreads();
  if (t == 0) {
    const int expected = a.box_bytes + (a.mode == 3 ? 16 : a.mode == 4 ? -16 : 0);
    cuflash::arch::mbarrier_arrive_expect_tx(bar, static_cast<unsigned>(expected));
    int c[kRank];
    for (int d = 0; d < kRank; ++d) c[d] = a.coords[d];
    cuflash::arch::tma_load<kRank>(box, &a.map, c, bar);
    if (a.mode == 1) store(a.out, box16[0]);
  }
  if (a.mode == 2) {
    __syncthreads();
    if (t == 32) store(a.out, box16[0]);
  }
  if (a.mode == 5) {
    while (!cuflash::arch::mbarrier_try_wait_parity(bar, 0)) {
    }
  } else {
    cuflash::arch::mbarrier_wait(bar, 0);
  }
  for (int i = t; i < a.span / 2; i += blockDim.x) store(a.out + i, box16[i]);
}

// The block writes a.image into the box's shared bytes, then one thread stores the box at a.coords, commits
// and waits for the read. Planted bugs (a.mode):
//   1 no fence.proxy.async between the ordinary stores and the TMA store (which reads through the async proxy)
//   2 the issuing thread overwrites the source before cp.async.bulk.wait_group.read
template <int kRank>
__global__ void __launch_bounds__(64) store_kernel(const __grid_constant__ Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  unsigned char* box = smem + kBoxAt + a.box_offset;
  const int t = threadIdx.x;
  unsigned short* box16 = reinterpret_cast<unsigned short*>(box);
  for (int i = t; i < a.box_bytes / 2; i += blockDim.x) box16[i] = load(a.image + i);
  if (a.mode != 1) cuflash::arch::fence_proxy_async();
  __syncthreads();
  if (t == 0) {
    int c[kRank];
    for (int d = 0; d < kRank; ++d) c[d] = a.coords[d];
    cuflash::arch::tma_store<kRank>(&a.map, box, c);
    cuflash::arch::tma_store_commit();
    if (a.mode == 2) box16[0] = 0;
    cuflash::arch::tma_store_wait_read<0>();
  }
}

// The block writes a.image (box_bytes / 4 float32) into shared memory at kBoxAt + box_offset, then thread 0 adds it
// to the floats at a.out + a.coords[0] with one bulk reduce-add, commits and waits for the read. Planted bugs
// (a.mode):
//   1 no fence.proxy.async between the ordinary stores and the reduce (which reads through the async proxy)
//   2 the issuing thread overwrites the source before cp.async.bulk.wait_group.read
//   3 thread 32 overwrites the source after a __syncthreads that follows the issue, before the issuer's wait
// and clean variants: 4 threads 0 and 32 both add the source (atomic adds: no race), 5 the wait is
// cp.async.bulk.wait_group (the adds complete) instead of .read; 6 and 7 (below) order two reduces to one place. Misaligned box_offset, coords[0] or box_bytes are
// the alignment and size rules' planted bugs.
__global__ void __launch_bounds__(64) reduce_kernel(const __grid_constant__ Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* src = reinterpret_cast<float*>(smem + kBoxAt + a.box_offset);
  const float* image = reinterpret_cast<const float*>(a.image);
  float* dst = reinterpret_cast<float*>(a.out) + a.coords[0];
  const int t = threadIdx.x;
  const int floats = a.box_bytes / 4 + (a.mode >= 6 ? 4 : 0);  // 6, 7: the second reduce's 4 floats too
  for (int i = t; i < floats; i += blockDim.x) src[i] = load(image + i);
  if (a.mode != 1) cuflash::arch::fence_proxy_async();
  __syncthreads();
  if (t == 0 || (a.mode == 4 && t == 32)) {
    cuflash::arch::bulk_reduce_add_f32(dst, src, static_cast<unsigned>(a.box_bytes));
    cuflash::arch::tma_store_commit();
    if (a.mode == 2) src[0] = 0.f;
  }
  if (a.mode == 3) {
    __syncthreads();
    if (t == 32) src[0] = 0.f;
  }
  if (t == 0 || (a.mode == 4 && t == 32)) {
    if (a.mode == 5 || a.mode == 7)
      cuflash::arch::tma_store_wait<0>();
    else
      cuflash::arch::tma_store_wait_read<0>();
  }
  // 6, 7: thread 0 then adds the source's second 16 bytes to the same 4 floats, after wait_group.read (6: the two
  // reduces may land in either order) or wait_group (7: the first has landed).
  if (t == 0 && (a.mode == 6 || a.mode == 7)) {
    cuflash::arch::bulk_reduce_add_f32(dst, src + 4, 16u);
    cuflash::arch::tma_store_commit();
    cuflash::arch::tma_store_wait<0>();
  }
}

// A two-stage ring: lane 0 of warp 0 loads a.coords[0] boxes of 16 x 8 16-bit elements (box i at row 8 i) into
// alternating stages, each completing on its stage's "full" mbarrier; warp 1 waits on it, copies the stage to
// a.out (box i at element 128 i) and arrives on the stage's "empty" mbarrier (32 arrivals), which the producer
// waits on before refilling the stage. a.mode 1: the producer refills without waiting for "empty" (it runs
// ahead: its next expect-tx arrival on "full" may find the stage's previous phase still waiting for bytes).
__global__ void __launch_bounds__(64) ring_kernel(const __grid_constant__ Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + 2;
  const int t = threadIdx.x, n = a.coords[0];
  if (t == 0) {
    for (int s = 0; s < 2; ++s) {
      cuflash::arch::mbarrier_init(full + s, 1);
      cuflash::arch::mbarrier_init(empty + s, 32);
    }
    cuflash::arch::fence_mbarrier_init();
  }
  __syncthreads();
  if (t == 0) {
    for (int i = 0; i < n; ++i) {
      const int s = i % 2;
      if (i >= 2 && a.mode != 1) cuflash::arch::mbarrier_wait(empty + s, (i / 2 - 1) % 2);
      cuflash::arch::mbarrier_arrive_expect_tx(full + s, 256);
      cuflash::arch::tma_load_2d(smem + kBoxAt + 256 * s, &a.map, 0, 8 * i, full + s);
    }
  } else if (t >= 32) {
    for (int i = 0; i < n; ++i) {
      const int s = i % 2;
      cuflash::arch::mbarrier_wait(full + s, (i / 2) % 2);
      const unsigned short* stage = reinterpret_cast<const unsigned short*>(smem + kBoxAt + 256 * s);
      for (int j = t - 32; j < 128; j += 32) store(a.out + 128 * i + j, stage[j]);
      cuflash::arch::mbarrier_arrive(empty + s);
    }
  }
}

// The producer/consumer pattern: thread 0 loads A (64 x 64) and B (64 x 64) f16 tiles, K-major with the 128B
// swizzle, through TMA onto one mbarrier; the warpgroup waits on it and computes D = A B^T with 4 k16 wgmma steps
// (a k step advances the descriptors' start by 32 bytes), then writes D (64 x 64 floats) out.
// a.mode 1: the consumers skip the mbarrier wait (the wgmma reads the tiles in flight).
struct GemmArgs {
  TensorMap map_a;
  TensorMap map_b;
  float* out;
  int mode;
};

__global__ void __launch_bounds__(128) tma_wgmma_kernel(const __grid_constant__ GemmArgs a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  unsigned char* tile_a = smem + 1024;
  unsigned char* tile_b = smem + 1024 + 8192;
  const int t = threadIdx.x;
  if (t == 0) {
    cuflash::arch::mbarrier_init(bar, 1);
    cuflash::arch::fence_mbarrier_init();
  }
  __syncthreads();
  if (t == 0) {
    cuflash::arch::mbarrier_arrive_expect_tx(bar, 2 * 8192);
    cuflash::arch::tma_load_2d(tile_a, &a.map_a, 0, 0, bar);
    cuflash::arch::tma_load_2d(tile_b, &a.map_b, 0, 0, bar);
  }
  if (a.mode != 1) cuflash::arch::mbarrier_wait(bar, 0);
  float acc[32];
  const uint64_t desc_a = cuflash::arch::wgmma_desc<128>(tile_a, 16, 1024);
  const uint64_t desc_b = cuflash::arch::wgmma_desc<128>(tile_b, 16, 1024);
  cuflash::arch::wgmma_fence();
  for (int s = 0; s < 4; ++s) cuflash::arch::wgmma<__half, 64>(acc, desc_a + 2 * s, desc_b + 2 * s, s > 0);
  cuflash::arch::wgmma_commit();
  cuflash::arch::wgmma_wait<0>(acc);
  const int w = t / 32, l = t % 32;
  for (int i = 0; i < 32; ++i) {
    const int row = 16 * w + l / 4 + 8 * ((i / 2) % 2);
    const int col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
    store(a.out + row * 64 + col, acc[i]);
  }
}

}  // namespace simtma
