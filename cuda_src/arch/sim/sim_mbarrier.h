// CPU twins of Hopper's synchronization instructions, for the arch layer to wrap (arch.cuh owns the
// names kernels see; the runtime side is sim_mbarrier.cpp):
//   mbarrier.init / arrive / arrive.expect_tx / expect_tx / complete_tx / try_wait.parity (.shared::cta.b64)
//   fence.mbarrier_init.release.cluster, fence.proxy.async.shared::cta
//   bar.sync / bar.arrive with a barrier id and a thread count (named barriers)
//   elect.sync _|P, 0xffffffff
// Included by cuda_sim.h; not a separate API for kernels.
#pragma once

namespace cuflash::sim {

// ---- mbarrier ----------------------------------------------------------------------------------
CUFLASH_SIM_API void mbarrier_init(const Site& site, uint64_t* bar, unsigned arrivals);
// One arrival; with expect_tx, the transaction count first grows by tx_bytes (arrive.expect_tx).
CUFLASH_SIM_API void mbarrier_arrive(const Site& site, uint64_t* bar, bool expect_tx, unsigned tx_bytes);
CUFLASH_SIM_API void mbarrier_expect_tx(const Site& site, uint64_t* bar, unsigned bytes);
CUFLASH_SIM_API void mbarrier_complete_tx(const Site& site, uint64_t* bar, unsigned bytes);
// try_wait.parity: true when the phase of that parity has completed; the blocking form waits for it.
CUFLASH_SIM_API bool mbarrier_try_wait_parity(const Site& site, uint64_t* bar, unsigned parity);
CUFLASH_SIM_API void mbarrier_wait_parity(const Site& site, uint64_t* bar, unsigned parity);
CUFLASH_SIM_API void fence_mbarrier_init();

// ---- named barriers ------------------------------------------------------------------------------
// bar.sync (wait) / bar.arrive (not wait) on barrier `id` with `threads` participating threads.
CUFLASH_SIM_API void named_barrier(const Site& site, unsigned id, unsigned threads, bool wait);

// ---- the async proxy -----------------------------------------------------------------------------
// fence.proxy.async.shared::cta: this thread's earlier generic-proxy writes to shared memory become
// visible to its later async-proxy operations (race mode checks it; a no-op in the other modes).
CUFLASH_SIM_API void fence_proxy_async();
// An async-proxy read of shared memory on the running thread's behalf (the operand reads of the wgmma and
// TMA-store twins): in race mode, an error unless each byte's last generic-proxy write was followed by a
// fence.proxy.async of its writer, and a race check like any read. A no-op in the other modes.
CUFLASH_SIM_API void race_async_proxy_read(uintptr_t address, unsigned bytes);

// ---- elect.sync ------------------------------------------------------------------------------------
// The PTX ISA promises one leader among membermask, the same one for the same membermask every time,
// and leaves which unspecified: the twin elects the lowest lane of the mask.
inline const char* elect_compute(unsigned mask, LaneIO* lanes) {
  const unsigned leader = static_cast<unsigned>(__builtin_ctz(mask));
  for (unsigned lane = 0; lane < 32; ++lane)
    if (mask >> lane & 1u) lanes[lane].out[0] = lane == leader;
  return nullptr;
}
__forceinline__ bool elect_one_sync(CUFLASH_SIM_SITE_PARAMS) {
  unsigned char elected = 0;
  warp_collective(CUFLASH_SIM_SITE("elect.sync"), 0xffffffffu, &elect_compute, kCollectiveNone, nullptr, 0, &elected,
                  sizeof elected);
  return elected != 0;
}

}  // namespace cuflash::sim
