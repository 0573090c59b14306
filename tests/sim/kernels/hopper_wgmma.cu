// Test kernels for the arch layer's Hopper warpgroup wrappers (wgmma, its fences, wgmma_desc, setmaxnreg):
// tests/sim/test_sim_wgmma.py launches them on the simulator, tests/test_arch_hopper_wgmma.py compiles them
// with NVRTC for sm_90a and checks their SASS.
#include "arch/arch.cuh"

namespace simwgmma {

struct Args {
  const unsigned short* image;  // the whole shared memory, copied in before the wgmma
  const unsigned* a_registers;  // RS form: [ksteps][128][4]
  const float* acc_in;          // [128][N / 2], when accumulating
  float* out;                   // [128][N / 2]
  unsigned long long desc_a;    // step 0's descriptors; step s adds s * desc_step_*
  unsigned long long desc_b;
  unsigned long long desc_step_a;
  unsigned long long desc_step_b;
  int ksteps;
  int accumulate;  // the first step's scale-d (later steps always accumulate)
  int mode;        // 0: clean; otherwise the planted bug named at wgmma_kernel
  int smem_bytes;
};

using cuflash::arch::load;
using cuflash::arch::store;

__device__ __forceinline__ void copy_image_in(const Args& a, unsigned char* smem) {
  for (int i = threadIdx.x; i < a.smem_bytes / 2; i += blockDim.x)
    reinterpret_cast<unsigned short*>(smem)[i] = load(a.image + i);
  // Ordinary stores reach a wgmma (the async proxy) only through fence.proxy.async; a.mode 12 leaves it out.
  if (a.mode != 12) cuflash::arch::fence_proxy_async();
  __syncthreads();
}

// D (+)= A B^T over a.ksteps k16 steps, A and B from descriptors (kRegisters: A from a.a_registers), each
// K-major or, with kAMnMajor / kBMnMajor, MN-major.
// Planted bugs (a.mode):
//   1 reads the accumulators before the covering wait     2 overwrites A's first elements in flight
//   3 no wgmma.fence before the first wgmma                4 touches acc after a wait, no fence before the next
//   5 the clean twin of 4 (a fence before every step)      6 warp 3 never issues the wgmma (it exits)
//   7 warp 3 gives another descriptor of B                8 warp 3 waits at a barrier instead (a deadlock)
//   9 lane 0 of each warp skips the commit (.aligned: the warp must execute it together)
//  12 no fence.proxy.async between the operands' ordinary stores and the wgmma (copy_image_in)
// and clean variants of the pipeline: 10 one fence, every step issued back to back, one commit and wait;
// 11 a commit per step and wait<1> in the loop (one group left in flight, chained on the same accumulators).
template <class T, int N, bool kRegisters, bool kAMnMajor = false, bool kBMnMajor = false>
__global__ void __launch_bounds__(128) wgmma_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  copy_image_in(a, smem);
  const int t = threadIdx.x;
  float acc[N / 2];
  if (a.accumulate)
    for (int i = 0; i < N / 2; ++i) acc[i] = load(a.acc_in + t * (N / 2) + i);
  if (a.mode == 6 && t / 32 == 3) return;
  if (a.mode == 8 && t / 32 == 3) __syncthreads();
  for (int s = 0; s < a.ksteps; ++s) {
    const bool last = s + 1 == a.ksteps;
    if (a.mode != 3 && (s == 0 || (a.mode != 4 && a.mode != 10))) cuflash::arch::wgmma_fence();
    const unsigned long long desc_b = a.desc_b + s * a.desc_step_b + (a.mode == 7 && t / 32 == 3 ? 2 : 0);
    const bool accumulate = a.accumulate || s > 0;
    if constexpr (kRegisters) {
      unsigned r[4];
      for (int j = 0; j < 4; ++j) r[j] = load(a.a_registers + (s * 128 + t) * 4 + j);
      cuflash::arch::wgmma_rs<T, N, kBMnMajor>(acc, r, desc_b, accumulate);
    } else {
      cuflash::arch::wgmma<T, N, kAMnMajor, kBMnMajor>(acc, a.desc_a + s * a.desc_step_a, desc_b, accumulate);
    }
    if ((a.mode != 9 || t % 32 != 0) && (a.mode != 10 || last)) cuflash::arch::wgmma_commit();
    if (a.mode == 1)
      for (int i = 0; i < N / 2; ++i) store(a.out + t * (N / 2) + i, acc[i]);
    if (a.mode == 2) {  // each thread one of A's first 16 elements (the first writer is the issuing thread)
      const unsigned start = static_cast<unsigned>(a.desc_a & 0x3fff) << 4;
      *reinterpret_cast<unsigned short*>(smem + start + 2 * (t % 16)) = 0;
    }
    if (a.mode == 11)
      cuflash::arch::wgmma_wait<1>();
    else if (a.mode != 10 || last)
      cuflash::arch::wgmma_wait<0>(acc);
    if (a.mode == 4 || a.mode == 5) acc[0] += 0.f;
  }
  if (a.mode == 11) cuflash::arch::wgmma_wait<0>(acc);
  if (a.mode != 1)
    for (int i = 0; i < N / 2; ++i) store(a.out + t * (N / 2) + i, acc[i]);
}

// Thread 0 stores the descriptors arch::wgmma_desc makes for four operands (one per swizzle mode);
// a.mode = 1 asks for one at a misaligned start.
__global__ void __launch_bounds__(128) wgmma_desc_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  if (threadIdx.x != 0) return;
  unsigned long long* out = reinterpret_cast<unsigned long long*>(a.out);
  store(out + 0, static_cast<unsigned long long>(cuflash::arch::wgmma_desc<0>(smem + 256, 128, 256)));
  store(out + 1, static_cast<unsigned long long>(cuflash::arch::wgmma_desc<32>(smem + 512 + 32, 16, 256)));
  store(out + 2, static_cast<unsigned long long>(cuflash::arch::wgmma_desc<64>(smem + 1024 + 128, 16, 512)));
  store(out + 3, static_cast<unsigned long long>(cuflash::arch::wgmma_desc<128>(smem + 2048 + 3 * 128, 16, 1024)));
  if (a.mode == 1) store(out + 4, static_cast<unsigned long long>(cuflash::arch::wgmma_desc<128>(smem + 8, 16, 1024)));
}

// Three warpgroups re-balance registers as a producer / two consumers split does (a.mode 0): the producer
// gives registers back, the consumers take them. 1: the producer does not give any back (the consumers wait
// forever); 2: warp 1 asks for another count than its warpgroup; 3: an inc that lowers the count; 4: the
// producer gives back too little for what the consumers ask (the split fits the SM's 64 K, not the block's
// 168 x 384: the hang the first wgmma backward with a 48-register producer met on an H200).
__global__ void __launch_bounds__(384, 1) setmaxnreg_kernel(const Args a) {
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    if (a.mode == 1) return;
    if (a.mode == 2 && threadIdx.x / 32 == 1)
      cuflash::arch::setmaxnreg_dec<32>();
    else if (a.mode == 4)
      cuflash::arch::setmaxnreg_dec<48>();  // 48 + 2 x 232 = 512 a 128 threads: the SM's 64 K, past the block's 64512
    else
      cuflash::arch::setmaxnreg_dec<40>();
  } else if (a.mode == 3) {
    cuflash::arch::setmaxnreg_inc<160>();
  } else {
    cuflash::arch::setmaxnreg_inc<232>();
  }
  store(a.out + threadIdx.x, 1.f);
}

}  // namespace simwgmma
