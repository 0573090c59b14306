// CPU twins of the warp-level tensor-core and async-copy instructions, ready for
// the arch layer to wrap (arch.cuh owns the names kernels see):
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32  -> mma_m16n8k16<T>
//   ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16          -> ldmatrix<kCount, kTrans>
//   stmatrix.sync.aligned.m8n8.{x1,x2,x4}.shared.b16                   -> stmatrix<kCount>
//   cp.async.{ca,cg}.shared.global + commit_group / wait_group          -> cp_async*, in the runtime
//
// mma and ldmatrix are warp collectives like the shuffles: every lane deposits its
// operands, the last lane of the full warp to arrive at the same call site computes
// all 32 lanes' results at once. Fragment layouts are those of the PTX ISA (see
// /work/shared/notes/ptx-warp-primitives.md): g = lane >> 2, t = lane & 3.
//
// Included by cuda_sim.h; not a separate API for kernels.
#pragma once

namespace cuflash::sim {

// ---- mma.sync m16n8k16, f32 accumulate ---------------------------------------------------
template <class T>
struct MmaIn {
  unsigned a[4];  // A 16x16 row-major fragment, two 16-bit elements per register (low = even column)
  unsigned b[2];  // B 16x8 (K x N) fragment, two 16-bit elements per register (low = even k)
  float c[4];
};

template <class T>
__forceinline__ float mma_element(unsigned reg, int half) {
  const unsigned short bits = static_cast<unsigned short>(half ? reg >> 16 : reg & 0xffffu);
  if constexpr (std::is_same_v<T, __half>) {
    return half_bits_to_float(bits);
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "mma_m16n8k16 takes __half or __nv_bfloat16 operands");
    return bfloat16_bits_to_float(bits);
  }
}

// D = A B + C in float32: products of 16-bit values are exact in float32; the
// sum runs over k in order, starting from C. The GPU's order and rounding inside
// the tensor core are unspecified, so results agree to float32 rounding, not bits.
template <class T>
const char* mma_m16n8k16_compute(unsigned, LaneIO* lanes) {
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    MmaIn<T> in;
    __builtin_memcpy(&in, lanes[lane].in, sizeof in);
    const int g = lane >> 2, t = lane & 3;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = mma_element<T>(in.a[0], h);
      A[g + 8][2 * t + h] = mma_element<T>(in.a[1], h);
      A[g][2 * t + 8 + h] = mma_element<T>(in.a[2], h);
      A[g + 8][2 * t + 8 + h] = mma_element<T>(in.a[3], h);
      B[2 * t + h][g] = mma_element<T>(in.b[0], h);
      B[2 * t + 8 + h][g] = mma_element<T>(in.b[1], h);
    }
    C[g][2 * t] = in.c[0];
    C[g][2 * t + 1] = in.c[1];
    C[g + 8][2 * t] = in.c[2];
    C[g + 8][2 * t + 1] = in.c[3];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    const int rows[4] = {g, g, g + 8, g + 8};
    const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float d[4];
    for (int i = 0; i < 4; ++i) {
      float acc = C[rows[i]][cols[i]];
      for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
      d[i] = acc;
    }
    __builtin_memcpy(lanes[lane].out, d, sizeof d);
  }
  return nullptr;
}

template <class T>
__forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4],
                                  CUFLASH_SIM_SITE_PARAMS) {
  MmaIn<T> in;
  for (int i = 0; i < 4; ++i) in.a[i] = a[i];
  for (int i = 0; i < 2; ++i) in.b[i] = b[i];
  for (int i = 0; i < 4; ++i) in.c[i] = c[i];
  // .sync.aligned: the whole warp, one instruction.
  warp_collective(CUFLASH_SIM_SITE("mma.sync.m16n8k16"), 0xffffffffu, &mma_m16n8k16_compute<T>, kCollectiveNone, &in,
                  sizeof in, d, sizeof d);
}

// ---- ldmatrix m8n8 b16 ----------------------------------------------------------------------
// Lane L supplies the address of row L % 8 of matrix L / 8 (lanes beyond 8 * kCount are
// ignored). Each row is 16 bytes, 16-byte aligned, inside the block's shared memory.
template <int kCount, bool kTrans>
const char* ldmatrix_compute(unsigned, LaneIO* lanes) {
  const BlockView* block = current_thread()->block;
  const uintptr_t smem = reinterpret_cast<uintptr_t>(block->smem);
  const uintptr_t smem_end = smem + block->launch->smem_bytes;
  unsigned short m[kCount][8][8];
  for (int lane = 0; lane < 8 * kCount; ++lane) {
    uintptr_t row;
    __builtin_memcpy(&row, lanes[lane].in, sizeof row);
    if (row % 16 != 0) return "ldmatrix: a row address is not 16-byte aligned";
    if (row < smem || row + 16 > smem_end) return "ldmatrix: a row lies outside the block's dynamic shared memory";
    __builtin_memcpy(m[lane / 8][lane % 8], reinterpret_cast<const void*>(row), 16);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    unsigned r[kCount];
    for (int j = 0; j < kCount; ++j) {
      const unsigned lo = kTrans ? m[j][2 * t][g] : m[j][g][2 * t];
      const unsigned hi = kTrans ? m[j][2 * t + 1][g] : m[j][g][2 * t + 1];
      r[j] = lo | (hi << 16);
    }
    __builtin_memcpy(lanes[lane].out, r, sizeof r);
  }
  return nullptr;
}

template <int kCount, bool kTrans>
__forceinline__ void ldmatrix(unsigned (&r)[kCount], const void* smem_row, CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "ldmatrix loads 1, 2 or 4 matrices");
  const uintptr_t address = reinterpret_cast<uintptr_t>(smem_row);
  if ((current_thread()->linear_tid & 31) < 8 * kCount)  // one 16-byte row per lane: 8 lanes a matrix
    profile_shared_access(CUFLASH_SIM_SITE("ldmatrix"), smem_row, 16, kProfileLdmatrix);
  warp_collective(CUFLASH_SIM_SITE(kTrans ? "ldmatrix.trans" : "ldmatrix"), 0xffffffffu,
                  &ldmatrix_compute<kCount, kTrans>, kCollectiveNone, &address, sizeof address, r, sizeof r);
}

// ---- stmatrix m8n8 b16 (sm_90) ------------------------------------------------------------------
// ldmatrix's mirror: register j of lane L holds row L / 4, columns 2 (L % 4) and + 1 of matrix j; lane L < 8 kCount
// gives the address of row L % 8 of matrix L / 8 (16 bytes, 16-byte aligned, inside the block's shared memory). The
// collective checks every address and hands each address lane its row's 16 bytes, gathered from the four lanes
// holding them; that lane then stores them itself, one 16-byte store: race mode sees each row as its address lane's
// write (other lanes of the warp read it after a __syncwarp or a barrier, as after any store), and profile mode
// counts it as one (a quarter-warp phase is one matrix, as the GPU serves stmatrix).
struct alignas(16) MatrixRow {
  unsigned words[4];
};
template <int kCount>
struct StmatrixIn {
  uintptr_t row;  // the lane's row address (lanes 8 kCount on: unused)
  unsigned r[kCount];
};
template <int kCount>
const char* stmatrix_compute(unsigned, LaneIO* lanes) {
  const BlockView* block = current_thread()->block;
  const uintptr_t smem = reinterpret_cast<uintptr_t>(block->smem);
  const uintptr_t smem_end = smem + block->launch->smem_bytes;
  StmatrixIn<kCount> in[32];
  for (int lane = 0; lane < 32; ++lane) __builtin_memcpy(&in[lane], lanes[lane].in, sizeof in[lane]);
  for (int lane = 0; lane < 8 * kCount; ++lane) {
    const uintptr_t row = in[lane].row;
    if (row % 16 != 0) return "stmatrix: a row address is not 16-byte aligned";
    if (row < smem || row + 16 > smem_end) return "stmatrix: a row lies outside the block's dynamic shared memory";
    const int matrix = lane / 8, g = lane % 8;
    MatrixRow out;
    for (int t = 0; t < 4; ++t) out.words[t] = in[4 * g + t].r[matrix];
    __builtin_memcpy(lanes[lane].out, &out, sizeof out);
  }
  return nullptr;
}

template <int kCount>
__forceinline__ void stmatrix(void* smem_row, const unsigned (&r)[kCount], CUFLASH_SIM_SITE_PARAMS) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4, "stmatrix stores 1, 2 or 4 matrices");
  StmatrixIn<kCount> in;
  in.row = reinterpret_cast<uintptr_t>(smem_row);
  for (int j = 0; j < kCount; ++j) in.r[j] = r[j];
  MatrixRow row;
  warp_collective(CUFLASH_SIM_SITE("stmatrix"), 0xffffffffu, &stmatrix_compute<kCount>, kCollectiveNone, &in,
                  sizeof in, &row, sizeof row);
  if ((current_thread()->linear_tid & 31) < 8 * kCount) *static_cast<MatrixRow*>(smem_row) = row;
}

// ---- cp.async ----------------------------------------------------------------------------------
// Copies are queued per thread and performed when the thread waits for their group
// (as the notes describe for a faithful twin): reading the destination before the
// covering wait (or, from another thread, before the following barrier) sees the old
// shared-memory contents (NaN if never written). Source bytes are checked and counted
// at issue; src_size < cp_size zero-fills the rest of the destination.
CUFLASH_SIM_API void cp_async_issue(const Site& site, void* smem_dst, const void* global_src, unsigned cp_size,
                                    unsigned src_size);
__forceinline__ void cp_async(void* smem_dst, const void* global_src, unsigned cp_size, unsigned src_size,
                              CUFLASH_SIM_SITE_PARAMS) {
  cp_async_issue(CUFLASH_SIM_SITE("cp.async"), smem_dst, global_src, cp_size, src_size);
}
CUFLASH_SIM_API void cp_async_commit();
CUFLASH_SIM_API void cp_async_wait(unsigned newest_groups_left_pending);

}  // namespace cuflash::sim
