// CPU twins of Hopper's warpgroup instructions, ready for the arch layer to wrap (arch.cuh owns the
// names kernels see; the runtime side is sim_wgmma.cpp):
//   wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}  -> wgmma_issue (SS and RS forms)
//   wgmma.fence / commit_group / wait_group                           -> wgmma_fence / _commit / _wait
//   setmaxnreg.{inc,dec}.sync.aligned.u32                              -> setmaxnreg
// and the shared-memory matrix descriptor (checked, then encoded by arch::wgmma_desc).
//
// A warpgroup is 4 consecutive warps: threads 128 g .. 128 g + 127 of the block's linear thread ids.
// wgmma and setmaxnreg are warpgroup collectives: all 128 threads arrive at the same site with the same
// parameters (a block whose size is not a multiple of 128 cannot use them).
//
// Included by cuda_sim.h; not a separate API for kernels.
#pragma once

namespace cuflash::sim {

// What every thread of the warpgroup must give a wgmma identically (the ISA: the descriptors are the same
// across the warpgroup; the shape, types and immediates are one instruction's).
struct WgmmaShape {
  unsigned n;            // m64nNk16
  unsigned bf16;         // 0: f16 inputs, 1: bf16 inputs
  unsigned a_registers;  // 1: A from registers (RS), desc_a unused
  unsigned accumulate;   // scale-d: 1 adds to the accumulators, 0 overwrites them
  uint64_t desc_a;
  uint64_t desc_b;
  unsigned a_mn_major;   // imm-trans-a: 1 reads A M-major from its descriptor (SS only)
  unsigned b_mn_major;   // imm-trans-b: 1 reads B N-major
};

// acc: the thread's n / 2 accumulators (read at landing when accumulating, written at landing);
// a_registers: the thread's 4 A-fragment registers (RS form; read at issue), else nullptr.
CUFLASH_SIM_API void wgmma_issue(const Site& site, const WgmmaShape& shape, float* acc, const unsigned* a_registers);
// .sync.aligned: each is a warp collective (all 32 lanes at the same site), then the thread's own action.
CUFLASH_SIM_API void wgmma_fence(const Site& site);
CUFLASH_SIM_API void wgmma_commit(const Site& site);
CUFLASH_SIM_API void wgmma_wait(const Site& site, unsigned newest_groups_left_pending);
// Checks what a descriptor for `smem` can encode (inside the block's shared memory, 16-byte aligned start,
// offsets multiples of 16 below 2^18) and returns the start's shared-window address.
CUFLASH_SIM_API unsigned wgmma_descriptor_start(const Site& site, const void* smem, unsigned leading_byte_offset,
                                                unsigned stride_byte_offset);
CUFLASH_SIM_API void setmaxnreg(const Site& site, unsigned count, bool increase);

}  // namespace cuflash::sim
