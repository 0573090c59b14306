// Planted-bug kernels for the simulator's strict checks (tests/sim/test_sim_strict.py): cp.async
// copies in flight, shared-memory alignment and bounds, the shared-memory base,
// pattern-initialized automatic variables, and __launch_bounds__. Each bug has a mode that fixes it.
#include "arch/arch.cuh"
#include "simkit_args.cuh"

namespace simstrict {

using simkit::Args;  // simkit_args.cuh: the layout of simkit.ARGS_DTYPE

using cuflash::arch::load;
using cuflash::arch::store;

// A two-stage cp.async pipeline over a.n tiles of blockDim.x * 4 floats: thread t copies its
// 16 bytes of tile k + 1 into the other stage while the block reads tile k, and
// out0[k * threads + t] = the first float of thread t + 1's part of tile k.
// a.mode 0: correct (a barrier after the reads, before the stage is refilled);
// a.mode 1: that barrier is missing, so a refill may land while other warps still read the stage.
__global__ void pipeline_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* stages = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  const int threads = blockDim.x;
  const int tile_floats = 4 * threads;
  const float* src = static_cast<const float*>(a.in0);
  float* out = static_cast<float*>(a.out0);
  cuflash::sim::cp_async(stages + 4 * t, src + 4 * t, 16, 16);
  cuflash::sim::cp_async_commit();
  for (int k = 0; k < a.n; ++k) {
    if (k + 1 < a.n)
      cuflash::sim::cp_async(stages + ((k + 1) % 2) * tile_floats + 4 * t, src + (k + 1) * tile_floats + 4 * t, 16,
                             16);
    cuflash::sim::cp_async_commit();
    cuflash::sim::cp_async_wait(1);  // tile k has landed (for this thread's copy)
    __syncthreads();                 // ... and is visible to the whole block
    const float* stage = stages + (k % 2) * tile_floats;
    store(out + k * threads + t, stage[4 * ((t + 1) % threads)]);
    if (a.mode == 0) __syncthreads();  // everyone has read stage k % 2 before it is refilled
  }
  cuflash::sim::cp_async_wait(0);
}

// out0[t] = the first float of the thread's own cp.async destination.
// a.mode 0: read after the covering wait; a.mode 1: read before it.
__global__ void own_destination_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  cuflash::sim::cp_async(tile + 4 * t, static_cast<const float*>(a.in0) + 4 * t, 16, 16);
  cuflash::sim::cp_async_commit();
  if (a.mode == 0) cuflash::sim::cp_async_wait(0);
  const float first = tile[4 * t];
  cuflash::sim::cp_async_wait(0);
  store(static_cast<float*>(a.out0) + t, first);
}

// out0[t] = a vector read of shared memory at byte offset a.extra + 16 t (16-byte float4 when
// a.mode is 0, 8-byte float2 when 1): natural alignment needs a.extra % 16 (resp. 8) == 0.
__global__ void vector_read_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int t = threadIdx.x;
  float* floats = reinterpret_cast<float*>(smem);
  for (int i = t; i < a.n; i += blockDim.x) floats[i] = static_cast<float>(i);
  __syncthreads();
  const unsigned char* at = smem + a.extra + 16 * t;
  float x;
  if (a.mode == 0) {
    const float4 v = *reinterpret_cast<const float4*>(at);
    x = v.x + v.y + v.z + v.w;
  } else {
    const float2 v = *reinterpret_cast<const float2*>(at);
    x = v.x + v.y;
  }
  store(static_cast<float*>(a.out0) + t, x);
}

// Thread 0 writes the float at index a.extra of the dynamic shared memory (negative: below it).
__global__ void shared_index_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  if (threadIdx.x == 0) reinterpret_cast<volatile float*>(smem)[a.extra] = 1.0f;
  __syncthreads();
  store(static_cast<float*>(a.out0) + threadIdx.x, 0.0f);
}

// out0[0] = the dynamic shared memory's start address modulo 1024.
__global__ void smem_base_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  if (threadIdx.x == 0)
    store(static_cast<unsigned long long*>(a.out0), reinterpret_cast<unsigned long long>(smem) % 1024);
}

// out0[t] = sum of a.n ones accumulated into a register array; a.mode 1 forgets to zero it.
__global__ void accumulator_kernel(const Args a) {
  float acc[4];
  if (a.mode == 0)
    for (int i = 0; i < 4; ++i) acc[i] = 0.f;
  for (int k = 0; k < a.n; ++k)
    for (int i = 0; i < 4; ++i) acc[i] += 1.f;
  store(static_cast<float*>(a.out0) + threadIdx.x, acc[threadIdx.x % 4]);
}

// out0[t] = t. Declares at most 64 threads per block (and two blocks per SM, which changes nothing
// here): a larger block is refused, as a GPU refuses it.
__global__ void __launch_bounds__(64, 2) bounded_kernel(const Args a) {
  store(static_cast<int*>(a.out0) + threadIdx.x, static_cast<int>(threadIdx.x));
}

// The same with a bound computed from template parameters, written as the fa2 kernels write theirs.
template <int Warps, int Unused = 7>
__global__ void __launch_bounds__(Warps * 32, 1) bounded_template_kernel(const Args a) {
  store(static_cast<int*>(a.out0) + threadIdx.x, static_cast<int>(threadIdx.x) + Unused - 7);
}

}  // namespace simstrict
