// Small kernels exercising the simulator's built-ins (tests/sim/test_basic.py).
#include "arch/arch.cuh"

namespace simtest {

struct Args {
  float* in;
  float* out;
  int n;
  int extra;
};

// out[i] = in[i] * 2 + blockIdx.x, one element per thread.
__global__ void scale_kernel(const Args a) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.n) cuflash::arch::store(a.out + i, cuflash::arch::load(a.in + i) * 2.0f + blockIdx.x);
}

// Each thread writes smem[tid], barrier, then reads its neighbour's value (reversed).
__global__ void reverse_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  int tid = threadIdx.x;
  int n = blockDim.x;
  tile[tid] = cuflash::arch::load(a.in + blockIdx.x * n + tid);
  __syncthreads();
  cuflash::arch::store(a.out + blockIdx.x * n + tid, tile[n - 1 - tid]);
}

__global__ void many_barriers_kernel(const Args a) {
  for (int i = 0; i < a.n; ++i) __syncthreads();
}

}  // namespace simtest
