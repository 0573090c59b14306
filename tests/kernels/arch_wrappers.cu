// arch_wrappers.cu: kernels for the arch wrappers tests/sim/kernels/tensor_ops.cu does not cover
// (16-byte cp.async, pack_float2, smem_address), calling only cuflash::arch::. tests/test_arch_wrappers.py
// compiles these and tensor_ops.cu's kernels with NVRTC for sm_80 and sm_90 (each SASS must show its
// instruction) and launches these on the simulator. Args as tests/sim/simkit.py.
#include "arch/arch.cuh"

namespace archtest {

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

// Thread t copies kBytes of in0 (from byte kBytes * t) to shared memory with a.n source bytes
// (the rest zero-filled), waits, and writes the shared bytes back to out0 as 32-bit words.
template <int kBytes>
__global__ void cp_async_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int t = threadIdx.x;
  cuflash::arch::cp_async<kBytes>(smem + kBytes * t, static_cast<const unsigned char*>(a.in0) + kBytes * t, a.n);
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

}  // namespace archtest
