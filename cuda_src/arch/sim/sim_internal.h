// Runtime-internal structures of the simulator, shared by sim_runtime.cpp and
// sim_race.cpp. Kernel code never includes this file (it sees only the views
// declared in cuda_sim.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_sim.h"
#include "sim_sync_state.h"

#if defined(__SANITIZE_ADDRESS__)
#define CUFLASH_SIM_ASAN 1
#else
#define CUFLASH_SIM_ASAN 0
#endif

#ifndef CUFLASH_SIM_RACE
#define CUFLASH_SIM_RACE 0
#endif

#ifndef CUFLASH_SIM_PROFILE
#define CUFLASH_SIM_PROFILE 0
#endif

namespace cuflash::sim {

// kAtMbarrier: in mbarrier_wait_parity until a phase of that parity completes; kAtNamedBarrier: in
// bar.sync until its instance completes (sim_mbarrier.cpp).
enum class FiberState : uint8_t { kRunnable, kAtBarrier, kAtCollective, kAtMbarrier, kAtNamedBarrier, kExited };

struct Worker;

struct PendingCopy {  // one cp.async in flight: lands at a random moment before its group's wait
  unsigned char* dst;
  const unsigned char* src;
  unsigned cp_size;
  unsigned src_size;
  unsigned group;
};

// A range of a thread's registers (its stack here) that wgmma watches in race mode (sim_wgmma.cpp): the
// accumulators of a wgmma in flight (any access is an error), or of one already waited for (an access marks
// them touched: a later wgmma on them needs a wgmma.fence first).
struct RegisterWatch {
  uintptr_t lo, hi;
  const void* op;  // the wgmma in flight (its WgmmaOp), or nullptr once waited for
  bool touched;    // accessed since the thread's last wgmma.fence
};

// A TMA load in flight (sim_tma.cpp): the box as it will land (read from global memory at issue), in
// 16-byte units placed at their swizzled offsets from dst_offset, and the mbarrier whose tx bytes it completes.
struct TmaLoad {
  struct Fiber* issuer;
  Site site;
  uint32_t bar_offset;
  unsigned bytes;
  unsigned dst_offset;
  unsigned swizzle_bytes;
  std::vector<unsigned char> image;
};

// A bulk async-group operation not yet known to have read its source (sim_tma.cpp): a TMA store
// (cp.async.bulk.tensor, kCopy) or a bulk reduce-add (cp.reduce.async.bulk .add.f32, kAddF32: each element added
// atomically to global memory); each element inside the global tensor, its box offset in shared memory (before the
// swizzle) and its global address.
struct TmaStore {
  struct Element {
    unsigned shared;
    uintptr_t global;
  };
  enum class Op : uint8_t { kCopy, kAddF32 };
  Op op;
  Site site;
  unsigned group;  // the issuing thread's bulk async-group
  unsigned src_offset;
  unsigned swizzle_bytes;
  unsigned bytes;
  unsigned element_bytes;
  std::vector<Element> elements;
  // kAddF32 after a covering wait_group.read: the source values read then (the shared bytes may be overwritten),
  // the adds still to land (at a seeded moment, or at the covering wait_group / the thread's exit).
  bool source_read = false;
  std::vector<float> values;
};

struct FiberWgmma {
  unsigned groups_committed;  // wgmma.commit_group count
  unsigned fences;            // wgmma.fence count
  std::vector<RegisterWatch> watch;  // race mode only
};

struct Fiber {
  ThreadView* view;  // lives at the top of the fiber's stack slot
  Worker* worker;
  void* sp;          // saved stack pointer while switched out
  uintptr_t stack_lo;
  uintptr_t stack_hi;
  unsigned index;    // linear thread id in the block
  FiberState state;
  Site wait_site;    // where it waits (barrier or collective)
  unsigned wait_mask;
  unsigned wait_object;  // kAtMbarrier: the object's shared byte offset; kAtNamedBarrier: the barrier id
  unsigned wait_parity;  // kAtMbarrier: the parity waited for
  void* asan_fake_stack;
  std::vector<PendingCopy> copies;  // cp.async not yet waited for, in issue order
  unsigned groups_committed;        // cp.async.commit_group count
  FiberWgmma wgmma;
  std::vector<TmaStore> tma_stores;  // TMA stores not yet covered by a wait_group.read, in issue order
  unsigned bulk_groups_committed;    // cp.async.bulk.commit_group count
#if CUFLASH_SIM_RACE
  // joint_gen[l]: generation of the latest __syncwarp of this warp that included
  // both this thread and lane l (see sim_race.cpp).
  uint32_t joint_gen[32];
  // Vector clock (sim_race.cpp): clock ticks at each release (mbarrier arrive, named barrier); vc[t] is the
  // latest clock of thread t this thread has acquired, empty until its first acquire.
  uint32_t clock;
  std::vector<uint32_t> vc;
  // Each fence.proxy.async of this thread, in order, as the moment a later access must be ordered after.
  struct ProxyFence {
    uint32_t epoch;
    uint32_t gen;
    uint32_t clock;
  };
  std::vector<ProxyFence> proxy_fences;
#endif
};

struct PendingCollective {
  unsigned mask;
  unsigned arrived;
  Site site;
  CollectiveFn compute;
  unsigned flags;
};

struct Warp {
  unsigned gone;  // lanes that exited or do not exist (last, partial warp)
  int num_pending;
  PendingCollective pending[32];
  LaneIO io[32];
#if CUFLASH_SIM_RACE
  uint32_t generation;  // completed __syncwarp count of this warp
#endif
};

struct Launch {
  LaunchView view;
  std::vector<Buffer> buffers;
  KernelThunk thunk;
  const void* kernel;
  const void* params;
  unsigned threads_per_block;
  unsigned launch_bound_threads;  // the first argument of the kernel's __launch_bounds__ (1024 without one)
  unsigned long long num_blocks;
  std::atomic<unsigned long long> next_block{0};
  std::atomic<bool> abort{false};
  std::mutex error_mutex;
  unsigned long long error_block = ~0ull;
  std::string error;
  uint64_t copy_landing_seed;

  void record_error(unsigned long long block_linear, std::string message);
};

struct Worker {
  Launch* launch;
  BlockView view;
  unsigned long long block_linear;
  std::vector<Fiber> fibers;
  std::vector<unsigned> slots;  // arena stack slots owned while running
  void* scheduler_sp;
  uintptr_t scheduler_stack_lo;
  uintptr_t scheduler_stack_hi;
  void* scheduler_fake_stack;
  unsigned current;
  unsigned live;
  unsigned arrived;
  Site barrier_site;
  // __syncthreads_count/and/or: predicates summed by the arrivals at the current barrier; the last
  // arrival moves the sum to barrier_result, which stays until the next barrier completes (which
  // needs every live thread, so each has read it by then).
  unsigned barrier_predicates;
  unsigned barrier_result;
  unsigned barrier_live;  // threads that took part in that barrier
  bool failed;
  unsigned num_warps;
  std::vector<Warp> warps;
  unsigned long long bytes_read;
  unsigned long long bytes_written;
  uint64_t landing_rng;             // per block, from the launch's copy_landing_seed
  unsigned long long copies_in_flight;  // cp.async of this block's fibers not landed yet
  uintptr_t smem_map_lo;            // the mapping around the block's shared memory: an access here
  uintptr_t smem_map_hi;            // outside [smem, smem + bytes) is a shared-memory overrun
  SyncState sync;                   // mbarriers and named barriers (sim_mbarrier.cpp)
  unsigned long long wgmma_in_flight;  // wgmma of this block not landed yet (sim_wgmma.cpp)
  size_t wgmma_operand_bytes;          // race mode: shared bytes a wgmma in flight reads
  std::vector<TmaLoad> tma_loads;      // TMA loads of the block not landed yet, in issue order (sim_tma.cpp)
  size_t tma_store_source_bytes;       // shared bytes TMA stores of the block may still read
  size_t tma_stores_in_flight;         // TMA stores and bulk reduce-adds of the block not yet landed
#if CUFLASH_SIM_RACE
  uint64_t epoch;  // fresh at every block start and every completed __syncthreads
  bool vector_clocks;  // the block has released through an mbarrier or named barrier (sim_race.cpp)
#endif
};

__attribute__((always_inline)) inline Fiber* current_fiber() {
  return static_cast<Fiber*>(current_thread()->fiber);
}

// The one model of the shared-memory swizzle modes (32B, 64B, 128B; 0 or 16: none), used by the wgmma
// twin to read operands and by the TMA twin to place a box: the 16-byte unit bits [4, 4 + b) of the
// shared-window address XOR its bits [7, 7 + b), b = log2(swizzle_bytes / 16), so the pattern of 8 lines
// of swizzle_bytes repeats every 8 * swizzle_bytes (256/512/1024) bytes from address 0 of the window
// (whose base is 1024-byte aligned, as on a GPU). Addresses here are offsets in the shared window.
inline unsigned swizzled_shared_address(unsigned address, unsigned swizzle_bytes) {
  const unsigned units = swizzle_bytes / 16;  // 16-byte units per line: 2, 4 or 8
  if (units <= 1) return address;
  return address ^ (((address >> 7) & (units - 1)) << 4);
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
bool same_site(const Site& a, const Site& b);
std::string describe_site(const Site& s);
std::string describe_thread(const Worker* w, unsigned linear_tid);
std::string describe_block(const Worker* w);
std::string lanes_text(unsigned mask);  // "0-3,8"
[[noreturn]] void fail_current(const std::string& message);
// The running fiber `f` lets the others run: until woken when it set a waiting state (state, wait_site and
// the state's wait fields first), else (a failed poll) until they had their turn. Every wait of the runtime
// twins (mbarrier, named barrier, warpgroup collective) goes through it.
void run_others(Fiber* f);

// Hopper synchronization twins (sim_mbarrier.cpp).
void sync_block_begin(Worker* w);
std::string describe_sync_wait(const Worker* w, const Fiber& f);  // for kAtMbarrier / kAtNamedBarrier
void sync_thread_exit(Worker* w, Fiber* f);  // the running fiber exits: fails if its warp awaits it at a named barrier
bool coin_flip(Worker* w);  // one fair bit from the block's landing stream (copy_landing's seed)

// TMA (sim_tma.cpp).
void tma_block_begin(Worker* w);
bool tma_loads_pending_on(const Worker* w, uint32_t bar_offset);  // a load in flight completes on that mbarrier
// Lands the block's loads in flight: all of them, each with probability 1/2 (the copy_landing stream), or those
// completing on the mbarrier at bar_offset. A landing's error fails the block (on_fiber: the running fiber's
// failure, else recorded from the scheduler). True when any landed.
enum class LoadsToLand { kAll, kSome, kOnBarrier };
bool tma_land_loads(Worker* w, LoadsToLand which, uint32_t bar_offset, bool on_fiber);
void tma_land_some_stores(Worker* w);  // normal mode, at a fiber switch: each store lands with probability 1/2
void tma_thread_exit(Fiber* f);        // the exiting thread's stores land (on a GPU they complete)
void add_f32_to_word(float* p, float v);  // one float32 added atomically (sim_runtime.cpp; red.add.f32's twin)
// sim_mbarrier.cpp for the TMA twin: the offset of the initialized mbarrier at `bar` (else a failure naming
// the site), and a landing's complete_tx on behalf of the issuer (its release in race mode): an error text or "".
uint32_t mbarrier_offset_for_tx(const Site& site, uint64_t* bar);
std::string mbarrier_land_tx(Worker* w, Fiber* issuer, uint32_t bar_offset, unsigned bytes);

// wgmma and warpgroup collectives (sim_wgmma.cpp).
void wgmma_block_begin(Worker* w);
void wgmma_land_some(Worker* w);  // normal mode, at a fiber switch: each wgmma in flight lands with probability 1/2
void wgmma_thread_exit(Fiber* f);
std::string describe_warpgroup_wait(const Worker* w, const Fiber& f);

#if CUFLASH_SIM_RACE
// Race detector hooks (sim_race.cpp).
void race_launch_begin(Launch* launch);
void race_launch_end(Launch* launch);
void race_block_begin(Worker* w);
void race_barrier_complete(Worker* w);
void race_syncwarp_complete(Worker* w, unsigned warp, unsigned mask);
void race_atomic(Fiber* f, uintptr_t address, unsigned bytes);
void race_access(uintptr_t address, unsigned bytes, bool is_write);  // on behalf of the running fiber
// cp.async: its destination counts as written at issue and stays in flight (any access is a race)
// until the issuing thread's covering wait, where the copy lands as that thread's write.
// tma: a TMA load, in flight until its mbarrier phase is observed (messages say which); async_proxy: the
// landing is an async-proxy write (a TMA load's), which a later async-proxy read needs no fence for.
void race_copy_issued(uintptr_t dst, unsigned bytes, bool tma = false);
void race_copy_landed(Fiber* issuer, uintptr_t dst, unsigned bytes, bool async_proxy = false);
// The issue site of the TMA load in flight to shared byte offset `offset` (sim_tma.cpp), for messages.
std::string tma_load_site(const Worker* w, unsigned offset);
// A write to shared bytes a TMA store in flight may still read (sim_tma.cpp): an error.
void race_tma_check_write(Fiber* f, uintptr_t address, unsigned bytes);
// Happens-before edges beyond __syncthreads and __syncwarp (mbarriers, named barriers): a release joins
// the thread's vector clock into `into` and ticks the thread's clock; an acquire joins `from` into it.
void race_release(Fiber* f, std::vector<uint32_t>& into);
void race_acquire(Fiber* f, const std::vector<uint32_t>& from);
// From the block's first mbarrier.init on, __syncwarp also joins its lanes' clocks (a write, __syncwarp,
// then one lane's arrive is a chain), so accesses before it are ordered after by clocks, not only by generation.
void race_enable_vector_clocks(Worker* w);
RaceMoment race_moment(Fiber* f);                         // the running fiber's moment now
bool race_ordered_after(Fiber* f, const RaceMoment& m);  // is f's next access ordered after m?
// A wgmma's read of a shared operand, at its landing, on behalf of the running fiber.
void race_wgmma_operand_read(uintptr_t address, unsigned bytes);
// sim_wgmma.cpp: an access to a watched register range or a write to a shared operand in flight.
void race_wgmma_check_access(Fiber* f, uintptr_t address, unsigned bytes, bool is_write);
#endif

#if CUFLASH_SIM_PROFILE
// Bank-conflict profile hooks (sim_profile.cpp).
void profile_launch_begin();
void profile_block_begin(Worker* w);
void profile_warp_synchronized(Worker* w, unsigned warp);  // all lanes of `warp` passed their accesses
void profile_block_end(Worker* w);
std::string profile_launch_report();
#endif
// The shared-memory side of one bulk copy (a TMA load's writes, a TMA store's reads): its 16-byte units at these
// shared offsets, in the order the box lists them (sim_profile.cpp; a no-op outside profile mode).
void profile_bulk_shared_access(const Site& site, const std::vector<uint32_t>& unit_offsets, unsigned kind);

}  // namespace cuflash::sim
