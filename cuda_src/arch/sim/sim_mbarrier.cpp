// Twins of Hopper's synchronization instructions: mbarrier objects, named barriers (bar.sync /
// bar.arrive with an id and a thread count), and the async-proxy fence's hooks. elect.sync is a warp
// collective in sim_mbarrier.h. Semantics follow the PTX ISA (mbarrier, bar, fence sections).
//
// mbarrier
//   The object is 64 opaque bits in shared memory; the state lives in the block's side table
//   (SyncState, sim_sync_state.h) keyed by the object's offset, cleared at block start. init sets the
//   expected arrival count (1 .. 2^20 - 1), pending = expected, tx-count 0, phase 0. An arrive takes one
//   pending arrival; expect_tx adds to the tx-count and complete_tx subtracts from it; the current phase
//   completes when pending arrivals and tx-count are both zero: the phase advances (its parity flips),
//   pending returns to the expected count, and the threads waiting for it resume.
//   try_wait.parity P (the ISA): P names the parity of the current phase or of the immediately
//   preceding one; the answer is true when the phase of parity P has completed. So it is false exactly
//   while the current (incomplete) phase has parity P, and true otherwise (then P is the preceding
//   phase's parity, and that phase completed). The ISA's try_wait may also return false after a
//   time limit; the blocking form (mbarrier_wait_parity, the wrappers' loop around try_wait) suspends
//   the thread until the phase completes, and the non-blocking form answers at once, letting the block's
//   other threads run after a false answer so a polling loop makes progress.
// Strict checks (each undefined behavior in the ISA, a hang or garbage on a GPU), errors naming the site:
//   an operation on an address that is not an initialized object of this block; init of an address not
//   8-byte aligned or outside the block's dynamic shared memory, or of an object threads wait on; an
//   arrival when the current phase has no pending arrival left (over-arrival: the phase waits only for
//   bytes); a tx-count outside +-(2^20 - 1); a tx-count below zero when no arrival is pending (more
//   bytes completed than expected: the phase can never complete). A tx-count may go below zero while
//   arrivals are pending (complete_tx may precede the matching expect_tx, as the ISA allows).
//   Race mode: a use by another thread not ordered after the init (no __syncthreads in between).
//   Deadlock: when no thread of the block can run, the launch fails naming each waiting thread's
//   barrier (shared byte offset), phase, pending arrivals and tx bytes. A polling loop around the
//   non-blocking form cannot block: kLonePollLimit failed polls of one object with no change to it
//   while no other thread of the block can run are a deadlock, and so are kPollLimit such polls while
//   others can (threads polling each other's barriers). TMA loads (sim_tma.cpp) change objects without
//   any thread: a poll while a load to its object is in flight is not idle, the scheduler lands loads in
//   flight before calling a block deadlocked, and race mode lands an object's loads when a thread waits on
//   or polls it (mbarrier_land_tx completes their bytes as the issuer's release).
//
// Named barriers
//   bar.sync / bar.arrive id, threads: id 1..15 (0 is the barrier of __syncthreads, which the simulator
//   keeps as its own mechanism, so named_barrier_* with id 0 is rejected rather than mixed with it);
//   threads a multiple of 32, 32 .. 1024. The ISA counts arrivals per warp (a warp adds the warp size),
//   and the wrappers emit bar.sync / bar.arrive, which it defines as barrier.sync.aligned /
//   barrier.arrive.aligned: every thread of the warp executes the same instruction. Lanes are fibers
//   arriving one at a time, so a warp's first lane counts 32 and the lanes live at that moment must all
//   arrive before the instance completes; one that exits instead is an error (on a GPU the warp would
//   have been divergent at an .aligned barrier). All arrivals at one instance give the same count; a
//   warp beyond the count, or a thread arriving twice at one instance, is an error (it would count for
//   another warp on a GPU); bar.arrive does not wait; bar.sync waits until the instance completes.
#include <cinttypes>

#include "sim_internal.h"

namespace cuflash::sim {
namespace {

constexpr uint32_t kMaxArrivals = (1u << 20) - 1;
constexpr int32_t kMaxTx = (1 << 20) - 1;
// Failed polls of one object with no change to it, taken for a deadlock: when no other thread of the block can
// run (the polling thread alone could still change it, so not at the first failed poll), and when the threads
// that can run keep polling too.
constexpr uint32_t kLonePollLimit = 1024;
constexpr uint32_t kPollLimit = 1u << 22;

uintptr_t smem_base(const Worker* w) { return reinterpret_cast<uintptr_t>(w->view.smem); }

Mbarrier* find_mbarrier(Worker* w, uint32_t offset) {
  for (Mbarrier& b : w->sync.mbarriers)
    if (b.offset == offset) return &b;
  return nullptr;
}

// The initialized object at `bar`, else a failure naming the site.
Mbarrier& object_at(const Site& site, const uint64_t* bar) {
  Worker* w = current_fiber()->worker;
  const uintptr_t at = reinterpret_cast<uintptr_t>(bar);
  const uintptr_t base = smem_base(w);
  if (at < base || at + 8 > base + w->launch->view.smem_bytes)
    fail_current(format("%s: the address 0x%" PRIxPTR " is not inside the block's dynamic shared memory",
                        describe_site(site).c_str(), at));
  Mbarrier* b = find_mbarrier(w, static_cast<uint32_t>(at - base));
  if (b == nullptr)
    fail_current(format("%s: no initialized mbarrier at shared byte offset %" PRIuPTR " (mbarrier.init must come first)",
                        describe_site(site).c_str(), at - base));
#if CUFLASH_SIM_RACE
  // Another thread's init is visible only through an ordering (a __syncthreads after it, as a rule).
  if (!race_ordered_after(current_fiber(), b->init_moment))
    fail_current(format("%s: uses the mbarrier at shared byte offset %u, which %s initialized at %s, with nothing "
                        "ordering the init before this use (a __syncthreads after mbarrier.init)",
                        describe_site(site).c_str(), b->offset, describe_thread(w, b->init_moment.tid).c_str(),
                        describe_site(b->init_site).c_str()));
#endif
  return *b;
}

std::string describe_state(const Mbarrier& b) {
  return format("the mbarrier at shared byte offset %u (initialized at %s): phase %u (parity %u) with %u of %u "
                "arrivals pending and a tx-count of %d bytes",
                b.offset, describe_site(b.init_site).c_str(), b.phase, b.phase & 1u, b.pending, b.expected, b.tx);
}

void check_tx_range(const Site& site, const Mbarrier& b, int64_t tx) {
  if (tx > kMaxTx || tx < -kMaxTx)
    fail_current(format("%s: the tx-count would become %lld, outside the ISA's range of +-(2^20 - 1), on %s",
                        describe_site(site).c_str(), static_cast<long long>(tx), describe_state(b).c_str()));
}

// Completes the current phase if nothing is pending: the phase advances and its waiters resume.
void maybe_complete(Worker* w, Mbarrier& b) {
  if (b.pending != 0 || b.tx != 0) return;
  const unsigned parity = b.phase & 1u;
  ++b.phase;
  b.pending = b.expected;
#if CUFLASH_SIM_RACE
  b.completed_vc.swap(b.current_vc);
  b.current_vc.assign(b.completed_vc.size(), 0);
#endif
  for (Fiber& f : w->fibers) {
    if (f.state != FiberState::kAtMbarrier || f.wait_object != b.offset || f.wait_parity != parity) continue;
    f.state = FiberState::kRunnable;
#if CUFLASH_SIM_RACE
    race_acquire(&f, b.completed_vc);  // the wait observes this completion
#endif
  }
}

void changed(Mbarrier& b) { b.idle_polls = 0; }

// Adds `delta` more expected bytes to the phase's tx-count, in range.
void add_tx(const Site& site, Mbarrier& b, int64_t delta) {
  check_tx_range(site, b, static_cast<int64_t>(b.tx) + delta);
  b.tx = static_cast<int32_t>(b.tx + delta);
}

// After an arrival or completed bytes: the pollers see a change, the releasing thread's writes (race mode) reach
// whoever waits on this phase, and the phase completes if nothing is pending.
void release_to_waiters(Worker* w, Fiber* releaser, Mbarrier& b) {
  changed(b);
#if CUFLASH_SIM_RACE
  race_release(releaser, b.current_vc);
#else
  (void)releaser;
#endif
  maybe_complete(w, b);
}

}  // namespace

void sync_block_begin(Worker* w) {
  w->sync.mbarriers.clear();
  for (NamedBarrier& n : w->sync.named) {
    n.expected = 0;
    n.counted = 0;
    n.arrived_lanes.assign(w->num_warps, 0);
    n.required_lanes.assign(w->num_warps, 0);
#if CUFLASH_SIM_RACE
    n.vc.assign(w->fibers.size(), 0);
#endif
  }
}

void mbarrier_init(const Site& site, uint64_t* bar, unsigned arrivals) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  const uintptr_t at = reinterpret_cast<uintptr_t>(bar);
  const uintptr_t base = smem_base(w);
  if (at < base || at + 8 > base + w->launch->view.smem_bytes)
    fail_current(format("%s: the mbarrier address 0x%" PRIxPTR " is not inside the block's dynamic shared memory",
                        describe_site(site).c_str(), at));
  if (at % 8 != 0)
    fail_current(format("%s: the mbarrier at shared byte offset %" PRIuPTR " is not 8-byte aligned",
                        describe_site(site).c_str(), at - base));
  if (arrivals < 1 || arrivals > kMaxArrivals)
    fail_current(format("%s: an arrival count of %u is outside 1 .. 2^20 - 1", describe_site(site).c_str(), arrivals));
  const uint32_t offset = static_cast<uint32_t>(at - base);
  Mbarrier* b = find_mbarrier(w, offset);
  if (b != nullptr) {
    for (const Fiber& other : w->fibers)
      if (other.state == FiberState::kAtMbarrier && other.wait_object == offset)
        fail_current(format("%s: re-initializes %s while %s waits on it", describe_site(site).c_str(),
                            describe_state(*b).c_str(), describe_thread(w, other.index).c_str()));
  } else {
    w->sync.mbarriers.emplace_back();
    b = &w->sync.mbarriers.back();
  }
  b->offset = offset;
  b->expected = arrivals;
  b->pending = arrivals;
  b->tx = 0;
  b->phase = 0;
  b->idle_polls = 0;
  b->init_site = site;
#if CUFLASH_SIM_RACE
  race_enable_vector_clocks(w);
  b->init_moment = race_moment(f);
  b->current_vc.assign(w->fibers.size(), 0);
  b->completed_vc.assign(w->fibers.size(), 0);
#endif
}

void mbarrier_arrive(const Site& site, uint64_t* bar, bool expect_tx, unsigned tx_bytes) {
  Fiber* f = current_fiber();
  Mbarrier& b = object_at(site, bar);
  if (b.pending == 0)
    fail_current(format("%s: over-arrival: no arrival is pending on %s (its phase waits only for transaction bytes)",
                        describe_site(site).c_str(), describe_state(b).c_str()));
  if (expect_tx) add_tx(site, b, tx_bytes);
  --b.pending;
  if (b.pending == 0 && b.tx < 0)
    fail_current(format("%s: the last arrival leaves %s: %d more bytes completed than were expected, so the phase "
                        "can never complete", describe_site(site).c_str(), describe_state(b).c_str(), -b.tx));
  release_to_waiters(f->worker, f, b);
}

void mbarrier_expect_tx(const Site& site, uint64_t* bar, unsigned bytes) {
  Mbarrier& b = object_at(site, bar);
  add_tx(site, b, bytes);
  changed(b);
}

void mbarrier_complete_tx(const Site& site, uint64_t* bar, unsigned bytes) {
  Fiber* f = current_fiber();
  Mbarrier& b = object_at(site, bar);
  check_tx_range(site, b, static_cast<int64_t>(b.tx) - bytes);
  if (b.pending == 0 && static_cast<int64_t>(b.tx) - bytes < 0)
    fail_current(format("%s: %u completed bytes exceed the %d expected by %s", describe_site(site).c_str(), bytes,
                        b.tx, describe_state(b).c_str()));
  b.tx -= static_cast<int32_t>(bytes);
  // The bytes' writes (a copy landing, done on the completing thread's behalf) are released to the waiters.
  release_to_waiters(f->worker, f, b);
}

// Race mode: a thread about to wait on (or poll) the phase lands the TMA loads completing on the barrier
// first, so the copies land as late as a wait allows (their destinations are in flight until then).
void land_loads_at_wait(Worker* w, const Mbarrier& b) {
#if CUFLASH_SIM_RACE
  if (tma_loads_pending_on(w, b.offset)) tma_land_loads(w, LoadsToLand::kOnBarrier, b.offset, true);
#else
  (void)w;
  (void)b;
#endif
}

uint32_t mbarrier_offset_for_tx(const Site& site, uint64_t* bar) { return object_at(site, bar).offset; }

std::string mbarrier_land_tx(Worker* w, Fiber* issuer, uint32_t bar_offset, unsigned bytes) {
  Mbarrier* b = find_mbarrier(w, bar_offset);
  if (b == nullptr) return format("mbarrier at shared byte offset %u is gone (re-initialized?)", bar_offset);
  const int64_t tx = static_cast<int64_t>(b->tx) - bytes;
  if (tx < -kMaxTx)
    return format("%u bytes would take the tx-count outside the ISA's range of +-(2^20 - 1), on %s", bytes,
                  describe_state(*b).c_str());
  if (b->pending == 0 && tx < 0)
    return format("%u bytes exceed the %d expected by %s", bytes, b->tx, describe_state(*b).c_str());
  b->tx = static_cast<int32_t>(tx);
  release_to_waiters(w, issuer, *b);  // the copy's writes, made on the issuer's behalf, reach the waiters
  return "";
}

bool mbarrier_try_wait_parity(const Site& site, uint64_t* bar, unsigned parity) {
  Fiber* f = current_fiber();
  Mbarrier& b = object_at(site, bar);
  if (parity > 1) fail_current(format("%s: the phase parity must be 0 or 1, not %u", describe_site(site).c_str(), parity));
  if ((b.phase & 1u) == parity) land_loads_at_wait(f->worker, b);
  if ((b.phase & 1u) != parity) {  // the phase of this parity is the preceding one: it completed
    changed(b);
#if CUFLASH_SIM_RACE
    race_acquire(f, b.completed_vc);
#endif
    return true;
  }
  Worker* w = f->worker;
  bool others_can_run = false;
  for (const Fiber& other : w->fibers) others_can_run = others_can_run || (&other != f && other.state == FiberState::kRunnable);
  // A TMA load in flight changes the object without any thread: polls while one is pending are not idle (the
  // scheduler lands it at a later switch, at the latest when nothing else can run).
  if (tma_loads_pending_on(w, b.offset))
    b.idle_polls = 0;
  else
    ++b.idle_polls;
  if (!others_can_run && b.idle_polls >= kLonePollLimit)
    fail_current(format("deadlock: %s polled %u times for parity %u of %s while no other thread of the block can "
                        "run, so the phase can never complete", describe_site(site).c_str(), b.idle_polls, parity,
                        describe_state(b).c_str()));
  if (b.idle_polls >= kPollLimit)
    fail_current(format("deadlock: %s polled %u times for parity %u with no change to %s (the threads that can "
                        "run are polling too)", describe_site(site).c_str(), kPollLimit, parity,
                        describe_state(b).c_str()));
  run_others(f);
  return false;
}

void mbarrier_wait_parity(const Site& site, uint64_t* bar, unsigned parity) {
  Fiber* f = current_fiber();
  Mbarrier& b = object_at(site, bar);
  if (parity > 1) fail_current(format("%s: the phase parity must be 0 or 1, not %u", describe_site(site).c_str(), parity));
  if ((b.phase & 1u) == parity) land_loads_at_wait(f->worker, b);
  if ((b.phase & 1u) != parity) {
#if CUFLASH_SIM_RACE
    race_acquire(f, b.completed_vc);
#endif
    return;
  }
  f->state = FiberState::kAtMbarrier;
  f->wait_site = site;
  f->wait_object = b.offset;
  f->wait_parity = parity;
  run_others(f);  // resumes once maybe_complete saw the phase complete (and joined its clocks)
}

void fence_mbarrier_init() {}

void named_barrier(const Site& site, unsigned id, unsigned threads, bool wait) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  if (id == 0)
    fail_current(describe_site(site) + ": named barrier 0 is the barrier of __syncthreads; use ids 1 .. 15");
  if (id > 15) fail_current(format("%s: barrier id %u is outside 0 .. 15", describe_site(site).c_str(), id));
  if (threads == 0 || threads % 32 != 0 || threads > 1024)
    fail_current(format("%s: a thread count of %u is not a multiple of the warp size in 32 .. 1024",
                        describe_site(site).c_str(), threads));
  if (threads > 32 * w->num_warps)
    fail_current(format("%s: a thread count of %u exceeds the block's %u warps", describe_site(site).c_str(), threads,
                        w->num_warps));
  NamedBarrier& n = w->sync.named[id];
  const unsigned warp = f->index >> 5;
  const uint32_t bit = 1u << (f->index & 31);
  if (n.expected == 0) {
    n.expected = threads;
    n.first_site = site;
    n.first_tid = f->index;
  } else if (n.expected != threads) {
    fail_current(format("%s: barrier %u reached with a thread count of %u while %s arrived at %s with %u",
                        describe_site(site).c_str(), id, threads, describe_thread(w, n.first_tid).c_str(),
                        describe_site(n.first_site).c_str(), n.expected));
  }
  if (n.arrived_lanes[warp] & bit)
    fail_current(format("%s: this thread arrives twice at one instance of barrier %u (%u of %u threads counted): on "
                        "a GPU the second arrival would count for another warp", describe_site(site).c_str(), id,
                        n.counted, n.expected));
  if (n.arrived_lanes[warp] == 0) {  // the warp's first lane: the warp counts 32
    if (n.counted + 32 > n.expected)
      fail_current(format("%s: more threads than the count of %u arrive at barrier %u (warp %u would be thread %u)",
                          describe_site(site).c_str(), n.expected, id, warp, n.counted + 32));
    n.counted += 32;
    n.required_lanes[warp] = ~w->warps[warp].gone;
  }
  n.arrived_lanes[warp] |= bit;
#if CUFLASH_SIM_RACE
  race_release(f, n.vc);
#endif
  bool complete = n.counted == n.expected;
  for (unsigned wp = 0; complete && wp < w->num_warps; ++wp) complete = n.arrived_lanes[wp] == n.required_lanes[wp];
  if (complete) {
    for (Fiber& other : w->fibers) {
      if (other.state != FiberState::kAtNamedBarrier || other.wait_object != id) continue;
      other.state = FiberState::kRunnable;
#if CUFLASH_SIM_RACE
      race_acquire(&other, n.vc);
#endif
    }
#if CUFLASH_SIM_RACE
    if (wait) race_acquire(f, n.vc);
    n.vc.assign(n.vc.size(), 0);
#endif
#if CUFLASH_SIM_PROFILE
    // Every live lane of each participating warp passed its accesses before the barrier (.aligned).
    for (unsigned wp = 0; wp < w->num_warps; ++wp)
      if (n.arrived_lanes[wp] != 0) profile_warp_synchronized(w, wp);
#endif
    n.expected = 0;
    n.counted = 0;
    n.arrived_lanes.assign(w->num_warps, 0);
    n.required_lanes.assign(w->num_warps, 0);
    return;
  }
  if (!wait) return;
  f->state = FiberState::kAtNamedBarrier;
  f->wait_site = site;
  f->wait_object = id;
  run_others(f);
}

void sync_thread_exit(Worker* w, Fiber* f) {
  const unsigned warp = f->index >> 5;
  const uint32_t bit = 1u << (f->index & 31);
  for (unsigned id = 1; id < 16; ++id) {
    const NamedBarrier& n = w->sync.named[id];
    if (n.expected != 0 && (n.required_lanes[warp] & ~n.arrived_lanes[warp] & bit))
      fail_current(format("this thread exits without arriving at barrier %u, where lanes %s of its warp arrived "
                          "(%s): bar.sync and bar.arrive are .aligned, every thread of a warp executes them", id,
                          lanes_text(n.arrived_lanes[warp]).c_str(), describe_site(n.first_site).c_str()));
  }
}

std::string describe_sync_wait(const Worker* w, const Fiber& f) {
  if (f.state == FiberState::kAtNamedBarrier) {
    const NamedBarrier& n = w->sync.named[f.wait_object];
    std::string missing;
    for (unsigned wp = 0; wp < w->num_warps; ++wp)
      if (n.required_lanes[wp] & ~n.arrived_lanes[wp])
        missing += format(", lanes %s of warp %u missing", lanes_text(n.required_lanes[wp] & ~n.arrived_lanes[wp]).c_str(), wp);
    return format("waits at %s on named barrier %u (%u of %u threads counted%s)", describe_site(f.wait_site).c_str(),
                  f.wait_object, n.counted, n.expected, missing.c_str());
  }
  for (const Mbarrier& b : w->sync.mbarriers)
    if (b.offset == f.wait_object)
      return format("waits at %s for parity %u of %s", describe_site(f.wait_site).c_str(), f.wait_parity,
                    describe_state(b).c_str());
  return "waits at " + describe_site(f.wait_site);
}

#if !CUFLASH_SIM_RACE
void fence_proxy_async() {}
void race_async_proxy_read(uintptr_t, unsigned) {}
#endif

}  // namespace cuflash::sim
