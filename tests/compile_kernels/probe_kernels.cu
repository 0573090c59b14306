// Probe kernels for tests/test_compile_pipeline.py: each one makes ptxas report
// one resource we parse (static shared memory, spills, HMMA), so the pipeline's
// parser and SASS check are tested against what the compiler really emits.
// They are templates on purpose: NVRTC compiles a template only when a name
// expression instantiates it, so each test compiles just the kernel it names.
#include <cuda_fp16.h>

#include "arch/arch.cuh"

// A fixed-size static __shared__ array: ptxas must report Elements * sizeof(T) bytes smem.
template <class T, int Elements>
__global__ void static_smem_probe(cuflash::AttentionParams params) {
  __shared__ T staging[Elements];
  const T* input = static_cast<const T*>(params.q);
  T* output = static_cast<T*>(params.out);
  for (int i = threadIdx.x; i < Elements; i += blockDim.x) staging[i] = cuflash::arch::load(input + i);
  __syncthreads();
  for (int i = threadIdx.x; i < Elements; i += blockDim.x)
    cuflash::arch::store(output + i, staging[Elements - 1 - i]);
}

// Keeps Values floats live across a data-dependent loop under a register cap of
// RegisterCap per thread, so ptxas has to spill some of them to local memory.
template <int Values, int RegisterCap>
__global__ void __maxnreg__(RegisterCap) register_pressure_probe(const float* input, float* output, int rounds) {
  float live[Values];
#pragma unroll
  for (int i = 0; i < Values; ++i) live[i] = input[threadIdx.x * Values + i];
  for (int r = 0; r < rounds; ++r) {
#pragma unroll
    for (int i = 0; i < Values; ++i) live[i] = live[i] * live[(i + r) % Values] + live[(i * 7 + 3) % Values];
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < Values; ++i) sum += live[i] * (i + 1);
  output[threadIdx.x] = sum;
}

// One warp-wide m16n8k16 tensor-core MMA with f16 inputs and f32 accumulators;
// on sm_80/sm_90 it must lower to an HMMA instruction.
template <int Unused>
__global__ void mma_probe(const unsigned* a_fragments, const unsigned* b_fragments, float* d_fragments) {
  const int lane = threadIdx.x % 32;
  unsigned a0 = a_fragments[lane * 4 + 0], a1 = a_fragments[lane * 4 + 1];
  unsigned a2 = a_fragments[lane * 4 + 2], a3 = a_fragments[lane * 4 + 3];
  unsigned b0 = b_fragments[lane * 2 + 0], b1 = b_fragments[lane * 2 + 1];
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  d_fragments[lane * 4 + 0] = d0;
  d_fragments[lane * 4 + 1] = d1;
  d_fragments[lane * 4 + 2] = d2;
  d_fragments[lane * 4 + 3] = d3;
}

// Half-precision FMA without tensor cores: SASS has HFMA2 (possibly the
// HFMA2.MMA variant) but no HMMA, the negative case for the SASS check.
template <int Unused>
__global__ void half_fma_probe(const __half* x, __half* y) {
  const int i = threadIdx.x;
  y[i] = __hfma(x[i], x[i], y[i]);
}

// Instantiating it with a type other than float fails on purpose: the
// CompileError test needs a real NVRTC diagnostic for one instance only.
template <class T>
__global__ void float_only_probe(T* data) {
  static_assert(sizeof(T) == sizeof(float) && T(0.5) != T(0), "float_only_probe wants float");
  data[threadIdx.x] = T(1);
}
