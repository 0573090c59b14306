// Runtime-internal state of the Hopper synchronization twins (sim_mbarrier.cpp): mbarrier objects
// and named barriers of the running block. Included by sim_internal.h; kernel code never sees it.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_sim.h"

namespace cuflash::sim {

// A moment of a thread's execution, as race mode orders them (sim_race.cpp): the block's __syncthreads
// epoch, the warp's __syncwarp generation, the thread's vector-clock clock.
struct RaceMoment {
  uint32_t epoch;
  uint32_t gen;
  uint32_t clock;
  uint16_t tid;
};

// One mbarrier object. The PTX ISA makes its 64 bits opaque, so the twin keeps the state here, in a
// per-block side table keyed by the object's byte offset in shared memory (cleared at block start);
// the 8 shared bytes themselves are never read or written.
struct Mbarrier {
  uint32_t offset;    // byte offset of the object in the block's dynamic shared memory
  uint32_t expected;  // arrivals per phase: the count given to mbarrier.init
  uint32_t pending;   // arrivals the current phase still needs
  int32_t tx;         // the current phase's transaction count: expect_tx adds, complete_tx subtracts
  uint32_t phase;     // completed phases; the current phase's parity is phase & 1
  // Consecutive failed mbarrier_try_wait_parity polls since the object last changed: a spin loop
  // around the non-blocking form cannot be told from progress otherwise (see sim_mbarrier.cpp).
  uint32_t idle_polls;
  Site init_site;
#if CUFLASH_SIM_RACE
  RaceMoment init_moment;  // every later use by another thread must be ordered after the init
  // Happens-before (sim_race.cpp): the join of the vector clocks of the current phase's arrivals
  // (the releases), and of the last completed phase's, which a wait observing it acquires.
  std::vector<uint32_t> current_vc;
  std::vector<uint32_t> completed_vc;
#endif
};

// One of the 16 named barriers (bar.sync / bar.arrive id, threads) of the running block.
// A warp counts 32 threads (the ISA counts arrivals per warp); as the instruction is .aligned, every lane of
// the warp that was live at its first lane's arrival must arrive too (lanes are fibers, arriving one by one).
struct NamedBarrier {
  unsigned expected;                    // thread count of the instance in progress; 0: none in progress
  unsigned counted;                     // 32 per warp that arrived at it
  Site first_site;                      // the first arrival, for count-mismatch messages
  unsigned first_tid;
  std::vector<uint32_t> arrived_lanes;  // per warp: the lanes that arrived at this instance
  std::vector<uint32_t> required_lanes;  // per warp: the lanes live at the warp's first arrival
#if CUFLASH_SIM_RACE
  std::vector<uint32_t> vc;  // join of the arrivals' vector clocks (sim_race.cpp)
#endif
};

struct SyncState {
  std::vector<Mbarrier> mbarriers;  // the block's initialized mbarrier objects
  NamedBarrier named[16];
};

}  // namespace cuflash::sim
