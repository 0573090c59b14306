// Test kernels for the Hopper synchronization wrappers of the arch layer (mbarrier, named barriers,
// elect.sync, the proxy fences): tests/sim/test_sim_hopper_sync.py launches them on the simulator (normal
// and race modes), tests/test_arch_hopper_sync.py compiles them with NVRTC for sm_90a and checks their SASS.
// Each planted bug has a mode; mode 0 is the correct kernel.
#include "arch/arch.cuh"
#include "simkit_args.cuh"

namespace simhopper {

using simkit::Args;  // simkit_args.cuh: the layout of simkit.ARGS_DTYPE

namespace arch = cuflash::arch;
using arch::load;
using arch::store;

// Warp 0 produces, warp 1 consumes, a.n rounds through one 32-float buffer guarded by two mbarriers:
// `full` (32 producer arrivals) and `empty` (32 consumer arrivals). out0[32 k + l] = in0[32 k + (l + 1) % 32].
// a.mode 1: the consumer does not wait for `full` (a race); 2: the producer announces 4 bytes per lane
// that never arrive (a deadlock); 3: each consumer arrives twice on `empty`, so its phase completes with
// half the consumers and the producer refills the buffer while the others read it (a race); 4: correct,
// with every consumer lane reading the whole buffer (many readers per byte, each ordered by its arrival);
// 5: correct, `full` counts one arrival: the producer warp's writes, a __syncwarp, one elected lane arrives;
// 6: the same without the __syncwarp (the other lanes' writes are not ordered before the arrival: a race);
// 7: no __syncthreads between thread 0's inits and the other threads' first uses.
__global__ void __launch_bounds__(64) handoff_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + 1;
  float* buffer = reinterpret_cast<float*>(smem + 16);
  const int t = threadIdx.x;
  const int lane = t & 31;
  if (t == 0) {
    arch::mbarrier_init(full, a.mode >= 5 ? 1 : 32);
    arch::mbarrier_init(empty, 32);
    arch::fence_mbarrier_init();
  }
  if (a.mode != 7) __syncthreads();
  const float* in = static_cast<const float*>(a.in0);
  float* out = static_cast<float*>(a.out0);
  for (int k = 0; k < a.n; ++k) {
    if (t < 32) {
      arch::mbarrier_wait(empty, (k & 1) ^ 1);  // round 0: the phase before the first counts as complete
      buffer[lane] = load(in + 32 * k + lane);
      if (a.mode >= 5) {  // the warp's writes reach the consumers through one elected arrival
        if (a.mode == 5) __syncwarp();
        if (arch::elect_one_sync()) arch::mbarrier_arrive(full);
      } else if (a.mode == 2)
        arch::mbarrier_arrive_expect_tx(full, 4);
      else
        arch::mbarrier_arrive(full);
    } else {
      if (a.mode != 1) arch::mbarrier_wait(full, k & 1);
      float v = buffer[(lane + 1) % 32];
      if (a.mode == 4) {  // every consumer lane reads every element: each byte has 32 readers
        float sum = 0.f;
        for (int i = 0; i < 32; ++i) sum += buffer[i];
        v += 0.f * sum;
      }
      store(out + 32 * k + lane, v);
      arch::mbarrier_arrive(empty);
      if (a.mode == 3) arch::mbarrier_arrive(empty);
    }
  }
}

// One thread walks one mbarrier through its states; out0 (ints) records what try_wait_parity answers.
// a.mode 0: the walk; 1: arrive before init; 2: init at a misaligned address; 3: over-arrival;
// 4: more bytes completed than expected; 5: waits for bytes that never arrive (deadlock); 6: polls a
// phase that never completes (deadlock); 7: init of a global address.
__global__ void __launch_bounds__(32) mbarrier_ops_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 8);
  int* out = static_cast<int*>(a.out0);
  if (threadIdx.x != 0) return;
  switch (a.mode) {
    case 0: {
      arch::mbarrier_init(bar, 1);
      store(out + 0, int{arch::mbarrier_try_wait_parity(bar, 0)});  // phase 0 incomplete: false
      store(out + 1, int{arch::mbarrier_try_wait_parity(bar, 1)});  // the phase before: true
      arch::mbarrier_expect_tx(bar, 64);
      arch::mbarrier_arrive(bar);  // no arrival pending, 64 bytes are
      store(out + 2, int{arch::mbarrier_try_wait_parity(bar, 0)});
      arch::mbarrier_complete_tx(bar, 32);
      store(out + 3, int{arch::mbarrier_try_wait_parity(bar, 0)});
      arch::mbarrier_complete_tx(bar, 32);  // phase 0 completes
      store(out + 4, int{arch::mbarrier_try_wait_parity(bar, 0)});
      store(out + 5, int{arch::mbarrier_try_wait_parity(bar, 1)});
      arch::mbarrier_complete_tx(bar, 16);  // bytes before their expectation: allowed while an arrival is pending
      arch::mbarrier_arrive_expect_tx(bar, 16);  // phase 1 completes
      arch::mbarrier_wait(bar, 1);
      store(out + 6, int{arch::mbarrier_try_wait_parity(bar, 0)});
      break;
    }
    case 1: arch::mbarrier_arrive(bar); break;
    case 2: arch::mbarrier_init(reinterpret_cast<uint64_t*>(smem + 4), 1); break;
    case 3:
      arch::mbarrier_init(bar, 1);
      arch::mbarrier_arrive_expect_tx(bar, 16);
      arch::mbarrier_arrive(bar);
      break;
    case 4:
      arch::mbarrier_init(bar, 1);
      arch::mbarrier_arrive_expect_tx(bar, 16);
      arch::mbarrier_complete_tx(bar, 32);
      break;
    case 5:
      arch::mbarrier_init(bar, 1);
      arch::mbarrier_arrive_expect_tx(bar, 128);
      arch::mbarrier_wait(bar, 0);
      break;
    case 6:
      arch::mbarrier_init(bar, 2);
      arch::mbarrier_arrive(bar);
      while (!arch::mbarrier_try_wait_parity(bar, 0)) {
      }
      break;
    case 7: arch::mbarrier_init(static_cast<uint64_t*>(a.out1), 1); break;
  }
}

// Warps 0-1 write a 64-float tile and bar.arrive on barrier 1; warps 2-3 bar.sync on it and read:
// out0[t - 64] = tile[(t - 64 + 1) % 64] * 2. a.mode 1: the consumers give another thread count;
// 2: a count that is not a multiple of 32; 3: id 16; 4: id 0; 5: the producers never arrive
// (deadlock); 6: half of each producer warp arrives, the other half exits; 7: the producers arrive twice;
// 8: the consumers do not wait (a race).
__global__ void __launch_bounds__(128) named_barrier_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  const unsigned id = a.mode == 3 ? 16u : a.mode == 4 ? 0u : 1u;
  const unsigned count = a.mode == 2 ? 100u : 128u;
  if (t < 64) {
    tile[t] = load(static_cast<const float*>(a.in0) + t);
    if (a.mode == 5) return;
    if (a.mode == 6) {
      if ((t & 31) < 16) arch::named_barrier_arrive(id, 96);
      return;
    }
    arch::named_barrier_arrive(id, count);
    if (a.mode == 7) arch::named_barrier_arrive(id, count);
  } else {
    if (a.mode == 6)
      arch::named_barrier_sync(id, 96);
    else if (a.mode != 8)
      arch::named_barrier_sync(id, a.mode == 1 ? 96u : count);
    store(static_cast<float*>(a.out0) + (t - 64), tile[(t - 64 + 1) % 64] * 2.f);
  }
}

// out0[t] = 1 where elect_one_sync() elected the thread, else 0. a.mode 1: lane 5 of each warp exits first.
__global__ void __launch_bounds__(64) elect_kernel(const Args a) {
  const int t = threadIdx.x;
  if (a.mode == 1 && (t & 31) == 5) return;
  store(static_cast<int*>(a.out0) + t, int{arch::elect_one_sync()});
}

// Each thread writes 4 floats of a 512-byte tile with ordinary stores; after a barrier, thread 0 hands the
// tile to the async proxy (as a wgmma or TMA store reads its shared operand). a.mode 0: every writer
// fences (fence.proxy.async) before the barrier; 1: no fence (an error in race mode); 2: only thread 0
// fences (the other writers' bytes are unfenced); 3: every writer fences after the barrier (too late).
__global__ void __launch_bounds__(32) async_proxy_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  for (int i = 0; i < 4; ++i) tile[4 * t + i] = static_cast<float>(4 * t + i);
  if (a.mode == 0 || (a.mode == 2 && t == 0)) arch::fence_proxy_async();
  __syncthreads();
  if (a.mode == 3) arch::fence_proxy_async();  // too late: the barrier before it ordered the read
#if !CUFLASH_GPU
  if (t == 0) cuflash::sim::race_async_proxy_read(reinterpret_cast<uintptr_t>(tile), 512);
#endif
  store(static_cast<float*>(a.out0) + t, tile[(4 * t + 4) % 128]);
}

}  // namespace simhopper
