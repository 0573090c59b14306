// Test kernels for the simulator's semantics (tests/sim/test_sim_*.py).
// Each kernel takes the same by-value argument, Args; the Python mirror is
// simkit.ARGS_DTYPE. Line positions matter only where a test says so.
#include "arch/arch.cuh"
#include "simkit_args.cuh"

namespace simtest {

using simkit::Args;  // simkit_args.cuh: the layout of simkit.ARGS_DTYPE

using cuflash::arch::load;
using cuflash::arch::store;

__device__ __forceinline__ int tid_linear() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ __forceinline__ int nthreads() { return blockDim.x * blockDim.y * blockDim.z; }
__device__ __forceinline__ int block_linear() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }

// Every thread writes its slot, then sums all slots: out0[block, tid] = sum over the block.
__global__ void barrier_visibility_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  int* slots = reinterpret_cast<int*>(smem);
  const int t = tid_linear();
  const int n = nthreads();
  slots[t] = t * 3 + block_linear();
  __syncthreads();
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += slots[i];
  __syncthreads();
  slots[t] = -1;  // overwrite after everyone has read (needs the second barrier)
  store(static_cast<int*>(a.out0) + block_linear() * n + t, sum);
}

// Threads t >= a.n exit at once; the rest still meet at two barriers.
__global__ void exited_threads_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  int* slots = reinterpret_cast<int*>(smem);
  const int t = tid_linear();
  if (t >= a.n) return;
  slots[t] = t + 100;
  __syncthreads();
  const int other = slots[(t + 1) % a.n];
  __syncthreads();
  store(static_cast<int*>(a.out0) + t, other);
}

// Threads of warp 0 and the others reach different __syncthreads() calls.
__global__ void divergent_barrier_kernel(const Args a) {
  if (tid_linear() < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  store(static_cast<int*>(a.out0) + tid_linear(), 1);
}

// Two __syncthreads() on one source line are still two call sites.
__global__ void same_line_barriers_kernel(const Args a) {
  if (tid_linear() % 2) __syncthreads(); else __syncthreads();  // NOLINT: one line on purpose
  store(static_cast<int*>(a.out0) + tid_linear(), 1);
}

// A shuffle of in0[t] (int or float) per a.mode: 0 idx, 1 up, 2 down, 3 xor;
// operand b = in1[t], width = a.width. Lanes outside a.mask skip the call.
template <class T>
__global__ void shuffle_kernel(const Args a) {
  const int t = tid_linear();
  const int lane = t & 31;
  const T v = load(static_cast<const T*>(a.in0) + t);
  const int b = load(static_cast<const int*>(a.in1) + t);
  if (!(a.mask >> lane & 1u)) return;
  T r;
  switch (a.mode) {
    case 0: r = __shfl_sync(a.mask, v, b, a.width); break;
    case 1: r = __shfl_up_sync(a.mask, v, static_cast<unsigned>(b), a.width); break;
    case 2: r = __shfl_down_sync(a.mask, v, static_cast<unsigned>(b), a.width); break;
    default: r = __shfl_xor_sync(a.mask, v, b, a.width); break;
  }
  store(static_cast<T*>(a.out0) + t, r);
}

// Votes over predicate in0[t] != 0 among lanes of a.mask: out0 = ballot, out1 = any | all << 1.
__global__ void vote_kernel(const Args a) {
  const int t = tid_linear();
  const int lane = t & 31;
  const int pred = load(static_cast<const int*>(a.in0) + t);
  if (!(a.mask >> lane & 1u)) return;
  const unsigned ballot = __ballot_sync(a.mask, pred);
  const int any = __any_sync(a.mask, pred);
  const int all = __all_sync(a.mask, pred);
  store(static_cast<unsigned*>(a.out0) + t, ballot);
  store(static_cast<int*>(a.out1) + t, any | (all << 1));
}

// Lane 0 calls a shuffle with a mask that does not include itself.
__global__ void caller_not_in_mask_kernel(const Args a) {
  const int lane = tid_linear() & 31;
  const unsigned mask = lane == 0 ? 0xfffffffeu : 0xffffffffu;
  const float r = __shfl_xor_sync(mask, 1.0f, 1);
  store(static_cast<float*>(a.out0) + tid_linear(), r);
}

// Lanes 0-15 use the full mask, lanes 16-31 mask 0xffff0000: the masks overlap but differ.
__global__ void mismatched_masks_kernel(const Args a) {
  const int lane = tid_linear() & 31;
  const unsigned mask = lane < 16 ? 0xffffffffu : 0xffff0000u;
  const float r = __shfl_xor_sync(mask, 1.0f, 1);
  store(static_cast<float*>(a.out0) + tid_linear(), r);
}

// Even and odd lanes reach different shuffle call sites with the full mask.
__global__ void mismatched_sites_kernel(const Args a) {
  const int lane = tid_linear() & 31;
  float r;
  if (lane % 2 == 0) {
    r = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  } else {
    r = __shfl_xor_sync(0xffffffffu, 2.0f, 1);
  }
  store(static_cast<float*>(a.out0) + tid_linear(), r);
}

// Lane 31 exits; the others shuffle with the full mask (a hang on a GPU).
__global__ void named_lane_exited_kernel(const Args a) {
  const int lane = tid_linear() & 31;
  if (lane == 31) return;
  const float r = __shfl_down_sync(0xffffffffu, 1.0f, 1);
  store(static_cast<float*>(a.out0) + tid_linear(), r);
}

// Independent half-warp groups (disjoint masks) shuffle at the same time.
__global__ void half_warp_groups_kernel(const Args a) {
  const int t = tid_linear();
  const int lane = t & 31;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  const int v = load(static_cast<const int*>(a.in0) + t);
  int r = v;
  for (int offset = 8; offset > 0; offset /= 2) r += __shfl_xor_sync(mask, r, offset, 16);
  store(static_cast<int*>(a.out0) + t, r);
}

// Thread 0 waits in a shuffle with lane 1, which waits at __syncthreads(): deadlock.
__global__ void deadlock_kernel(const Args a) {
  const int t = tid_linear();
  if (t == 0) {
    const float r = __shfl_xor_sync(0x3u, 1.0f, 1);
    store(static_cast<float*>(a.out0), r);
  }
  __syncthreads();
}

// Reads shared memory nobody wrote: out0[t] = float slot, out1[t] = half slot as float.
__global__ void unwritten_smem_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  const int t = tid_linear();
  const float* f = reinterpret_cast<const float*>(smem);
  const __half* h = reinterpret_cast<const __half*>(smem + 4 * nthreads());
  const __nv_bfloat16* bf = reinterpret_cast<const __nv_bfloat16*>(smem + 6 * nthreads());
  const float written_first = t < a.n ? 1.0f : f[t];
  store(static_cast<float*>(a.out0) + t, written_first);
  store(static_cast<float*>(a.out1) + 2 * t, __half2float(h[t]));
  store(static_cast<float*>(a.out1) + 2 * t + 1, __bfloat162float(bf[t]));
}

// Known traffic per thread: loads float (4) + __half (2) + float4 (16), one atomic_add
// (4 + 4), stores float2 (8). out0: float2 per thread; out1: one float accumulator.
__global__ void traffic_kernel(const Args a) {
  const int t = block_linear() * nthreads() + tid_linear();
  const float x = load(static_cast<const float*>(a.in0) + t);
  const __half h = load(reinterpret_cast<const __half*>(static_cast<const float*>(a.in0) + a.n) + t);
  const float4 q = load(static_cast<const float4*>(a.in1) + t);
  cuflash::arch::atomic_add(static_cast<float*>(a.out1), 1.0f);
  store(static_cast<float2*>(a.out0) + t, make_float2(x + __half2float(h), q.x + q.y + q.z + q.w));
}

// Writes one element past what the launch registered when t == a.extra.
__global__ void global_oob_kernel(const Args a) {
  const int t = tid_linear();
  const int index = t == a.extra ? a.n : t;
  store(static_cast<float*>(a.out0) + index, 1.0f);
}

__global__ void global_oob_load_kernel(const Args a) {
  const int t = tid_linear();
  const float v = load(static_cast<const float*>(a.in0) + t - a.extra);
  store(static_cast<float*>(a.out0) + t, v);
}

__global__ void misaligned_kernel(const Args a) {
  const char* base = static_cast<const char*>(a.in0);
  const float v = load(reinterpret_cast<const float*>(base + 2));
  store(static_cast<float*>(a.out0) + tid_linear(), v);
}

__global__ void readonly_store_kernel(const Args a) { store(static_cast<float*>(a.in0) + tid_linear(), 1.0f); }

__global__ void trap_kernel(const Args a) {
  if (tid_linear() == a.extra && block_linear() == a.n) __trap();
  __syncthreads();
  store(static_cast<int*>(a.out0) + block_linear() * nthreads() + tid_linear(), 1);
}

__global__ void dynamic_smem_size_kernel(const Args a) {
  store(static_cast<unsigned*>(a.out0) + tid_linear(), cuflash::arch::dynamic_smem_size());
}

__global__ void builtins_kernel(const Args a) {
  // out0 per thread: threadIdx.xyz, blockIdx.xyz, blockDim.xyz, gridDim.xyz, warpSize (13 ints).
  const int idx = (block_linear() * nthreads() + tid_linear()) * 13;
  int* o = static_cast<int*>(a.out0) + idx;
  const int values[13] = {(int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z, (int)blockIdx.x, (int)blockIdx.y,
                          (int)blockIdx.z, (int)blockDim.x, (int)blockDim.y, (int)blockDim.z, (int)gridDim.x,
                          (int)gridDim.y, (int)gridDim.z, warpSize};
  for (int i = 0; i < 13; ++i) store(o + i, values[i]);
}

// Element conversions: in0 float[n] -> out0 half bits[n], out1 bf16 bits[n];
// in1 (ushort pairs) -> decoded floats written after... see simkit.
__global__ void convert_kernel(const Args a) {
  const int i = block_linear() * nthreads() + tid_linear();
  if (i >= a.n) return;
  const float x = load(static_cast<const float*>(a.in0) + i);
  store(static_cast<__half*>(a.out0) + i, __float2half_rn(x));
  store(static_cast<__nv_bfloat16*>(a.out1) + i, __float2bfloat16_rn(x));
}

__global__ void decode_kernel(const Args a) {
  const int i = block_linear() * nthreads() + tid_linear();
  if (i >= a.n) return;
  const __half h = load(static_cast<const __half*>(a.in0) + i);
  const __nv_bfloat16 b = load(static_cast<const __nv_bfloat16*>(a.in1) + i);
  store(static_cast<float*>(a.out0) + i, __half2float(h));
  store(static_cast<float*>(a.out1) + i, __bfloat162float(b));
}

__global__ void exp2_kernel(const Args a) {
  const int i = tid_linear();
  if (i >= a.n) return;
  store(static_cast<float*>(a.out0) + i, cuflash::arch::exp2_approx(load(static_cast<const float*>(a.in0) + i)));
}

// Overflows its fiber stack (deep recursion with a big frame).
__device__ __noinline__ int deep(int depth, volatile int* sink) {
  volatile int frame[1024];
  frame[depth % 1024] = depth;
  if (depth == 0) return frame[0];
  return deep(depth - 1, sink) + frame[depth % 1024];
}
__global__ void stack_overflow_kernel(const Args a) {
  volatile int sink = 0;
  store(static_cast<int*>(a.out0) + tid_linear(), deep(a.n, &sink));
}

// Several KB of per-thread arrays must fit a fiber stack.
__global__ void big_locals_kernel(const Args a) {
  float acc[4096];
  for (int i = 0; i < 4096; ++i) acc[i] = static_cast<float>(i + tid_linear());
  float s = 0;
  for (int i = 0; i < 4096; i += 97) s += acc[i];
  store(static_cast<float*>(a.out0) + tid_linear(), s);
}

// Writes past the end of the dynamic shared memory (index a.n floats).
__global__ void smem_overrun_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  if (tid_linear() == 0) tile[a.n] = 1.0f;
  __syncthreads();
  store(static_cast<float*>(a.out0) + tid_linear(), 0.0f);
}

// A raw (unchecked) global write past the end of out0, at element a.n: only ASan sees it.
__global__ void raw_global_overrun_kernel(const Args a) {
  if (tid_linear() == 0) static_cast<volatile float*>(a.out0)[a.n] = 1.0f;
  __syncthreads();
}

__global__ void null_pointer_kernel(const Args a) {
  volatile int* p = static_cast<volatile int*>(a.out0);
  *p = 1;
}

__global__ void many_barriers_kernel(const Args a) {
  for (int i = 0; i < a.n; ++i) __syncthreads();
}

// ---- race-mode kernels --------------------------------------------------------------------

// Neighbour exchange through shared memory; a.mode = 1 leaves out the barrier.
__global__ void smem_exchange_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = tid_linear();
  const int n = nthreads();
  tile[t] = load(static_cast<const float*>(a.in0) + t);
  if (a.mode == 0) __syncthreads();
  const float v = tile[(t + 1) % n];
  store(static_cast<float*>(a.out0) + t, v);
}

// Reuses a shared tile across iterations; a.mode = 1 drops the barrier that protects
// the next overwrite (write-after-read race).
__global__ void smem_reuse_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = tid_linear();
  const int n = nthreads();
  float acc = 0;
  for (int it = 0; it < 3; ++it) {
    tile[t] = static_cast<float>(t + it);
    __syncthreads();
    acc += tile[n - 1 - t];
    if (a.mode == 0) __syncthreads();
  }
  store(static_cast<float*>(a.out0) + t, acc);
}

// Lanes of one warp exchange through shared memory; a.mode: 0 __syncwarp between,
// 1 nothing between, 2 a __syncwarp that names only half the warp.
__global__ void warp_exchange_kernel(const Args a) {
  CUFLASH_DYNAMIC_SMEM(smem);
  float* tile = reinterpret_cast<float*>(smem);
  const int t = tid_linear();
  const int lane = t & 31;
  tile[t] = static_cast<float>(t);
  if (a.mode == 0) __syncwarp();
  if (a.mode == 2) {
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    __syncwarp(half);
  }
  const float v = tile[(t & ~31) + (lane ^ 1)];
  if (a.mode == 0) __syncwarp();
  tile[t] = v;  // overwrite after the neighbour has read: ordered only by the second __syncwarp
  store(static_cast<float*>(a.out0) + t, v);
}

// Every block writes out0[0..n) (mode 0: a cross-block write/write race), or each block
// writes its own slice (mode 1: clean), or all blocks atomically add into out1 (mode 2:
// clean), or block 0 reads what block 1 writes (mode 3: race).
__global__ void global_blocks_kernel(const Args a) {
  const int t = tid_linear();
  const int b = block_linear();
  float* out = static_cast<float*>(a.out0);
  switch (a.mode) {
    case 0: store(out + t, static_cast<float>(b)); break;
    case 1: store(out + b * nthreads() + t, static_cast<float>(b)); break;
    case 2: cuflash::arch::atomic_add(static_cast<float*>(a.out1) + t, 1.0f); break;
    default:
      if (b == 1) store(out + t, 1.0f);
      if (b == 0) store(out + nthreads() + t, load(out + t));
      break;
  }
}

}  // namespace simtest

namespace simtest {
// Integer division by a runtime zero (a.n == 0).
__global__ void int_divide_kernel(const Args a) {
  store(static_cast<int*>(a.out0) + tid_linear(), 100 / a.n);
}
}  // namespace simtest

namespace simtest {
// out0[t] = in0[t] * in1[t] + in0[t + n] (kernels are built with FMA contraction, as NVRTC's --fmad=true).
__global__ void multiply_add_kernel(const Args a) {
  const int t = tid_linear();
  const float* x = static_cast<const float*>(a.in0);
  const float u = load(x + t), v = load(static_cast<const float*>(a.in1) + t), w = load(x + t + a.n);
  store(static_cast<float*>(a.out0) + t, u * v + w);
}
// out0[t] = exp2_approx(in0[t]).
__global__ void exp2_approx_kernel(const Args a) {
  const int t = tid_linear();
  store(static_cast<float*>(a.out0) + t, cuflash::arch::exp2_approx(load(static_cast<const float*>(a.in0) + t)));
}
// out0[t] = log2_approx(in0[t]).
__global__ void log2_approx_kernel(const Args a) {
  const int t = tid_linear();
  store(static_cast<float*>(a.out0) + t, cuflash::arch::log2_approx(load(static_cast<const float*>(a.in0) + t)));
}
}  // namespace simtest

namespace simtest {
// out0[t] = integer built-in a.mode of x = in0[t], y = in1[t], z = in0[t + n] (see test_sim_builtins.py).
__global__ void int_builtin_kernel(const Args a) {
  const int t = tid_linear();
  const unsigned x = load(static_cast<const unsigned*>(a.in0) + t), z = load(static_cast<const unsigned*>(a.in0) + t + a.n);
  const unsigned y = load(static_cast<const unsigned*>(a.in1) + t);
  const unsigned long long xy = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  switch (a.mode) {
    case 0: r = __popc(x); break;
    case 1: r = __ffs(static_cast<int>(x)); break;
    case 2: r = __clz(static_cast<int>(x)); break;
    case 3: r = __byte_perm(x, y, z); break;
    case 4: r = __funnelshift_l(x, y, z); break;
    case 5: r = __funnelshift_r(x, y, z); break;
    case 6: r = __funnelshift_lc(x, y, z); break;
    case 7: r = __funnelshift_rc(x, y, z); break;
    case 8: r = __popcll(xy); break;
    case 9: r = __ffsll(static_cast<long long>(xy)); break;
    default: r = __clzll(static_cast<long long>(xy)); break;
  }
  store(static_cast<unsigned*>(a.out0) + t, r);
}
// out0[t] = float built-in a.mode of x = in0[t], y = in1[t].
__global__ void float_builtin_kernel(const Args a) {
  const int t = tid_linear();
  const float* in0 = static_cast<const float*>(a.in0);
  const float x = load(in0 + t), y = load(static_cast<const float*>(a.in1) + t);
  float r = 0.f;
  switch (a.mode) {
    case 0: r = __fdividef(x, y); break;
    case 1: r = __expf(x); break;
    case 2: r = rsqrtf(x); break;
    default: r = __ldg(in0 + t); break;
  }
  store(static_cast<float*>(a.out0) + t, r);
}
// Paired 16-bit math: in0 = a, b, c (n pairs each, 32-bit words); out0[t] = op a.mode as 32 bits.
template <class H2>
__global__ void paired_kernel(const Args a) {
  const int t = tid_linear();
  const unsigned* w = static_cast<const unsigned*>(a.in0);
  const H2 x = cuflash::sim::bit_cast<H2>(load(w + t)), y = cuflash::sim::bit_cast<H2>(load(w + a.n + t));
  const H2 z = cuflash::sim::bit_cast<H2>(load(w + 2 * a.n + t));
  H2 r;
  switch (a.mode) {
    case 0: r = __hfma2(x, y, z); break;
    case 1: r = __hmul2(x, y); break;
    case 2: r = __hmax2(x, y); break;
    default: r = h2exp2(x); break;
  }
  store(static_cast<unsigned*>(a.out0) + t, cuflash::sim::bit_cast<unsigned>(r));
}
// out0[2t], out0[2t+1] = float2 of the pair in0[t] as __half2 (mode 0) or bf162 (1); out1[t] = the pair
// rebuilt from in1[2t], in1[2t+1] (floats) with __float22*_rn.
__global__ void pair_conversion_kernel(const Args a) {
  const int t = tid_linear();
  const unsigned w = load(static_cast<const unsigned*>(a.in0) + t);
  const float* f = static_cast<const float*>(a.in1);
  const float2 in = make_float2(load(f + 2 * t), load(f + 2 * t + 1));
  float2 out;
  unsigned packed;
  if (a.mode == 0) {
    out = __half22float2(cuflash::sim::bit_cast<__half2>(w));
    packed = cuflash::sim::bit_cast<unsigned>(__float22half2_rn(in));
  } else {
    out = __bfloat1622float2(cuflash::sim::bit_cast<__nv_bfloat162>(w));
    packed = cuflash::sim::bit_cast<unsigned>(__float22bfloat162_rn(in));
  }
  store(static_cast<float*>(a.out0) + 2 * t, out.x);
  store(static_cast<float*>(a.out0) + 2 * t + 1, out.y);
  store(static_cast<unsigned*>(a.out1) + t, packed);
}
// out0[2t], out0[2t+1]: clock64() before and after a fence and some work (must not decrease).
__global__ void clock_kernel(const Args a) {
  const int t = tid_linear();
  const long long first = clock64();
  __threadfence_block();
  volatile float sink = 0.f;
  for (int i = 0; i < 1000; ++i) sink = sink + 1.f;
  const long long second = clock64();
  store(static_cast<long long*>(a.out0) + 2 * t, first);
  store(static_cast<long long*>(a.out0) + 2 * t + 1, second);
}
}  // namespace simtest

namespace simtest {
// Lanes of a.mask (others idle): out0[t] = __match_any_sync(a.mask, in0[t]) (mode 0) or
// __reduce_{add,min,max,and,or,xor}_sync (modes 1..6 unsigned, 7..9 int add/min/max).
__global__ void warp_reduce_kernel(const Args a) {
  const int t = tid_linear();
  if (!(a.mask >> (t % 32) & 1u)) return;
  const unsigned u = load(static_cast<const unsigned*>(a.in0) + t);
  const int i = static_cast<int>(u);
  unsigned r = 0;
  switch (a.mode) {
    case 0: r = __match_any_sync(a.mask, u); break;
    case 1: r = __reduce_add_sync(a.mask, u); break;
    case 2: r = __reduce_min_sync(a.mask, u); break;
    case 3: r = __reduce_max_sync(a.mask, u); break;
    case 4: r = __reduce_and_sync(a.mask, u); break;
    case 5: r = __reduce_or_sync(a.mask, u); break;
    case 6: r = __reduce_xor_sync(a.mask, u); break;
    case 7: r = static_cast<unsigned>(__reduce_add_sync(a.mask, i)); break;
    case 8: r = static_cast<unsigned>(__reduce_min_sync(a.mask, i)); break;
    default: r = static_cast<unsigned>(__reduce_max_sync(a.mask, i)); break;
  }
  store(static_cast<unsigned*>(a.out0) + t, r);
}
}  // namespace simtest

namespace simtest {
// Threads t >= a.n exit first. out0[3 t .. 3 t + 2] = __syncthreads_count/and/or of (in0[t] != 0),
// three barriers in a row.
__global__ void block_vote_kernel(const Args a) {
  const int t = tid_linear();
  if (t >= a.n) return;
  const int p = load(static_cast<const int*>(a.in0) + t);
  const int count = __syncthreads_count(p);
  const int all = __syncthreads_and(p);
  const int any = __syncthreads_or(p);
  store(static_cast<int*>(a.out0) + 3 * t, count);
  store(static_cast<int*>(a.out0) + 3 * t + 1, all);
  store(static_cast<int*>(a.out0) + 3 * t + 2, any);
}
}  // namespace simtest
