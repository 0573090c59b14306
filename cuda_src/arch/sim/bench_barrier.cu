// Kernel for `python -m cuflash.sim.bench_barrier`: a block that only meets at
// __syncthreads() `iterations` times, so launch time / iterations is the cost of one
// barrier (about one fiber switch per thread).
#include "arch/arch.cuh"

namespace cuflash_sim_bench {

struct BarrierArgs {
  int iterations;
};

__global__ void barrier_loop_kernel(const BarrierArgs a) {
  for (int i = 0; i < a.iterations; ++i) __syncthreads();
}

}  // namespace cuflash_sim_bench
