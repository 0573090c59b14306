// Race mode: a data-race detector for shared memory and registered global buffers.
//
// How accesses reach us: kernel translation units are compiled with
// -fsanitize=thread, so GCC calls __tsan_read4(addr), __tsan_write8(addr), ... for
// every memory access. This file (compiled without instrumentation, like the rest of
// the runtime) defines those hooks itself and the race-mode runtime library exports
// them to the kernel libraries; no ThreadSanitizer runtime is loaded.
// Accesses outside the running block's shared memory and the launch's buffers
// (stacks, the simulator's own state) are ignored.
//
// What is a race (CUDA's rules, byte granularity):
//   two accesses to the same byte by different threads, at least one a write, not
//   ordered by
//     - program order (same thread),
//     - a __syncthreads() between them (same block: the barrier epoch changed),
//     - for lanes of one warp, a completed __syncwarp() that named both lanes and
//       came after the earlier access.
//     - a chain of mbarrier arrive -> wait, named-barrier arrive -> completion (and, from the block's
//       first mbarrier.init, __syncwarp) between them: vector clocks, below.
//   Accesses of different blocks of one launch are never ordered (global memory).
//   arch::atomic_add does not race with other atomics, but does with plain accesses.
//   A cp.async destination is written at issue and in flight until the issuing thread's
//   covering wait: any access to it before then, by any thread (the issuer included), is a
//   race; at the wait the copy lands as the issuer's write, so other threads need the barrier
//   (or __syncwarp) that follows the wait, as for any write.
//
// Shared memory is also checked for what a GPU faults on: every access naturally aligned
// (an 8-byte access at a 4-byte boundary runs on x86, not on a GPU) and inside the block's
// allocation (the slack next to the guard pages of normal mode included).
//
// Shadow state per byte: the last plain write (block, thread, epoch, warp
// generation), the reads since that write (block, epoch, warp, lane set, latest
// generation) and the last atomic. Reads of several lanes keep only the latest warp
// generation, so a write is accepted only after a __syncwarp that follows all those
// reads and names every reader: stricter than exact in one unusual pattern (readers
// synchronized with the writer by different, interleaved __syncwarp calls).
//
// Vector clocks (FastTrack style, beside the epoch and generation rules, which stay the fast paths):
// each thread has a clock, ticked at each release, and a vector clock vc (its knowledge of the others'
// clocks; empty until its first acquire). A release (mbarrier arrive or complete_tx, a named-barrier
// arrival, a __syncwarp in a block with mbarriers) joins the thread's vc and own clock into the
// synchronization object (the mbarrier's current phase, the barrier instance, the __syncwarp's lanes)
// and ticks the clock; an acquire (a wait observing the phase complete, the named barrier completing
// for a bar.sync, the __syncwarp) joins the object's clock into the thread's vc. A cell keeps its
// writer's clock at the write: a later access by t is ordered after it when t.vc[writer] >= that clock.
// Reads: in blocks that never release through these objects the summary above is kept, unchanged. In a
// block that does, the summary cannot tell which of several readers a release ordered (the usual
// consumer pattern: many warps read a stage, each arrives, the producer waits and refills it), so a
// summary started after the block's first release is exact instead: each reader's latest read
// (warp generation and clock, in a side map keyed by cell); the latest read of one reader covers its
// earlier ones, as epoch, generation and clock only grow along program order, so keeping one entry per
// reader is sound, and it is exact. A summary started before that first release keeps its old form
// (conservative: at worst a false report, never a missed race).
//
// The async proxy: a cell also keeps its writer's fence.proxy.async count at the write (every write the
// hooks see, cp.async landings included, is a generic-proxy write), and each thread keeps its fences as
// moments (epoch, warp generation, clock; the fence ticks the clock). race_async_proxy_read (the operand
// reads of the wgmma and TMA-store twins) fails on a byte unless the writer's first fence after the write
// is ordered before the read by the rules above (a fence after the barrier that orders the read does not
// count), and is otherwise checked as an ordinary read.
//
// Blocks run one at a time (one worker) in this mode, so the shadow needs no locks.
// The first race ends the launch with a KernelError naming both threads.
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <unordered_map>

#include "sim_internal.h"

#if CUFLASH_SIM_RACE

namespace cuflash::sim {

Fiber* fiber_on_this_stack();  // sim_runtime.cpp: nullptr when not running kernel code

namespace {

constexpr uint32_t kMultiple = 0xffffffffu;
constexpr uint16_t kMultipleWarps = 0xffff;

struct Cell {
  uint32_t w_block;  // 1 + linear block index; 0: no write recorded
  uint32_t w_epoch;
  uint32_t w_gen;
  uint16_t w_tid;
  uint16_t r_warp;   // warp of the readers, or kMultipleWarps
  uint32_t r_block;  // 1 + linear block index, kMultiple; 0: no reads recorded
  uint32_t r_epoch;
  uint32_t r_lanes;
  uint32_t r_gen;
  uint16_t r_tid;    // one reader, for messages
  uint16_t a_tid;    // last atomic's thread, or 0xffff for several
  uint32_t a_block;  // 1 + linear block index, kMultiple; 0: no atomics
  uint32_t a_epoch;
  uint32_t f_block;  // 1 + linear block index of a cp.async in flight to this byte; 0: none
  uint16_t f_tid;    // its issuing thread
  bool f_tma;        // the copy in flight is a TMA load (landing when its mbarrier phase is observed)
  bool r_mapped;     // every read since the last write is in RaceState::reads (exact per reader)
  uint32_t w_clock;  // the writer's vector-clock clock at the write
  uint32_t w_fences;  // the writer's fence.proxy.async count at the write (a generic-proxy write), or
                      // kAsyncProxyWrite
};

// w_fences of a byte the async proxy wrote (a TMA load's landing): an async-proxy read needs no fence for it.
constexpr uint32_t kAsyncProxyWrite = 0xffffffffu;

// One thread's latest read of a byte since its last write (reads in program order: the latest covers
// the earlier ones, as epoch, warp generation and clock only grow).
struct ReadEntry {
  uint16_t tid;
  uint32_t gen;
  uint32_t clock;
};

constexpr uintptr_t kChunkBytes = 4096;

struct GlobalShadow {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  int index = 0;
  std::vector<std::unique_ptr<Cell[]>> chunks;
  Cell* cell(uintptr_t address) {
    const uintptr_t offset = address - begin;
    std::unique_ptr<Cell[]>& chunk = chunks[offset / kChunkBytes];
    if (!chunk) chunk.reset(new Cell[kChunkBytes]());
    return &chunk[offset % kChunkBytes];
  }
};

struct RaceState {
  Launch* launch = nullptr;
  uint32_t epoch_counter = 0;
  std::vector<GlobalShadow> globals;
  std::vector<Cell> shared;
  uint32_t shared_block = 0;  // the block whose accesses the shared cells hold
  // In blocks with vector clocks: each cell's reads since its last write, by reader (Cell::r_mapped).
  std::unordered_map<const Cell*, std::vector<ReadEntry>> reads;
  std::vector<uint32_t> syncwarp_vc;  // scratch: the join of a __syncwarp's lanes
};

RaceState g_race;  // one worker runs every block of a race-mode launch

// The access being checked.
struct Access {
  Fiber* fiber;
  Worker* worker;
  uint32_t block;  // 1 + linear
  uint32_t epoch;
  uint32_t gen;    // the warp's __syncwarp generation now
  uint16_t tid;
  uint16_t warp;
  unsigned lane;
};

bool ordered_after(const Access& a, uint32_t block, uint32_t epoch, uint32_t gen, uint16_t tid, uint32_t clock) {
  if (block != a.block) return false;  // different blocks of one launch: never ordered
  if (epoch != a.epoch) return true;   // a __syncthreads() came between
  if (tid == a.tid) return true;       // program order
  if ((tid >> 5) == a.warp && a.fiber->joint_gen[tid & 31] > gen) return true;  // a __syncwarp naming both lanes
  // An mbarrier or named-barrier chain: this thread acquired a release that thread `tid` made after the access.
  return tid < a.fiber->vc.size() && a.fiber->vc[tid] >= clock;
}

std::string thread_name(const Access& a, uint32_t block_plus_one, uint16_t tid, bool global) {
  const Launch* launch = a.worker->launch;
  std::string text;
  char buf[128];
  if (global) {
    const unsigned long long linear = block_plus_one - 1;
    const dim3 g = launch->view.grid_dim;
    snprintf(buf, sizeof buf, "block (%llu,%llu,%llu) ", linear % g.x, (linear / g.x) % g.y, linear / g.x / g.y);
    text += buf;
  }
  const dim3 b = launch->view.block_dim;
  snprintf(buf, sizeof buf, "thread (%u,%u,%u)", tid % b.x, (tid / b.x) % b.y, tid / b.x / b.y);
  return text + buf;
}

[[noreturn]] void report(const Access& a, const char* where, uintptr_t offset, bool is_write, const char* other_kind,
                         uint32_t other_block, uint16_t other_tid, bool global) {
  const bool same_warp = other_block == a.block && (other_tid >> 5) == a.warp;
  char head[512];
  snprintf(head, sizeof head, "data race on %s byte offset %" PRIuPTR ": this thread %s it, ", where, offset,
           is_write ? "writes" : "reads");
  std::string text = head;
  text += thread_name(a, other_block, other_tid, global);
  text += " ";
  text += other_kind;
  if (other_block != a.block)
    text += " (different blocks of one launch are never ordered)";
  else if (same_warp)
    text += " with no __syncthreads() or __syncwarp() naming both lanes in between";
  else
    text += " with no __syncthreads() in between";
  if (other_block == a.block && a.worker->vector_clocks)
    text += ", nor an mbarrier or named-barrier handoff ordering them";
  fail_current(text);
}

void check_and_record(const Access& a, Cell& c, bool is_write, bool is_atomic, const char* where, uintptr_t offset,
                      bool global) {
  // For shared memory, cells of an earlier block are stale: that block's memory is gone.
  if (!global) {
    if (c.w_block != a.block) c.w_block = 0;
    if (c.r_block != a.block) c.r_block = 0;
    if (c.f_block != a.block) c.f_block = 0;
    c.a_block = 0;
  }
  if (c.f_block != 0) {
    if (c.f_tma)
      fail_current(std::string("data race on ") + where + " byte offset " + std::to_string(offset) + ": this thread " +
                   (is_write ? "writes" : "reads") + " the destination of a TMA load that " +
                   thread_name(a, c.f_block, c.f_tid, global) + " issued at " +
                   tma_load_site(a.worker, static_cast<unsigned>(offset)) +
                   ", before a wait observes the mbarrier phase the load completes on (mbarrier_wait)");
    if (c.f_tid == a.tid)
      fail_current(std::string("data race on ") + where + " byte offset " + std::to_string(offset) + ": this thread " +
                   (is_write ? "writes" : "reads") +
                   " the destination of its own cp.async before the cp.async.wait_group that covers it");
    report(a, where, offset, is_write, "has a cp.async in flight to it (issued, not yet waited for)", c.f_block,
           c.f_tid, global);
  }
  // Against the last plain write.
  if (c.w_block != 0 && !ordered_after(a, c.w_block, c.w_epoch, c.w_gen, c.w_tid, c.w_clock))
    report(a, where, offset, is_write, "wrote it", c.w_block, c.w_tid, global);
  // Against atomics (plain accesses only; atomics never race with each other).
  if (!is_atomic && c.a_block != 0) {
    bool unordered;
    if (c.a_block == kMultiple || c.a_block != a.block) {
      unordered = true;
    } else if (c.a_epoch != a.epoch) {
      unordered = false;
    } else {
      unordered = c.a_tid != a.tid;  // several atomic threads (0xffff) include another one
    }
    if (unordered)
      report(a, where, offset, is_write, "updated it atomically", c.a_block == kMultiple ? a.block : c.a_block,
             c.a_tid == 0xffff ? a.tid : c.a_tid, global);
  }
  // A write (plain or atomic) against the reads since the last write.
  if (is_write && c.r_block != 0) {
    if (c.r_block == kMultiple || c.r_block != a.block) {
      report(a, where, offset, is_write, "read it", c.r_block == kMultiple ? a.block : c.r_block, c.r_tid, global);
    } else if (c.r_epoch == a.epoch && c.r_mapped) {
      for (const ReadEntry& r : g_race.reads[&c])
        if (!ordered_after(a, c.r_block, c.r_epoch, r.gen, r.tid, r.clock))
          report(a, where, offset, is_write, "read it", c.r_block, r.tid, global);
    } else if (c.r_epoch == a.epoch) {
      if (c.r_warp == kMultipleWarps || c.r_warp != a.warp) {
        report(a, where, offset, is_write, "read it", c.r_block, c.r_tid, global);
      } else {
        const unsigned others = c.r_lanes & ~(1u << a.lane);
        for (unsigned l = 0; l < 32; ++l)
          if ((others >> l & 1u) && a.fiber->joint_gen[l] <= c.r_gen)
            report(a, where, offset, is_write, "read it", c.r_block, static_cast<uint16_t>(a.warp * 32 + l), global);
      }
    }
  }
  if (is_atomic) {
    if (c.a_block == 0 || (c.a_block == a.block && c.a_epoch != a.epoch)) {
      c.a_block = a.block;
      c.a_epoch = a.epoch;
      c.a_tid = a.tid;
    } else if (c.a_block != a.block) {
      c.a_block = kMultiple;
    } else if (c.a_tid != a.tid) {
      c.a_tid = 0xffff;
    }
    c.r_block = 0;  // an atomic update ends the earlier reads' interval like a write
    return;
  }
  if (is_write) {
    c.w_block = a.block;
    c.w_epoch = a.epoch;
    c.w_gen = a.gen;
    c.w_tid = a.tid;
    c.w_clock = a.fiber->clock;
    c.w_fences = static_cast<uint32_t>(a.fiber->proxy_fences.size());
    c.r_block = 0;
    return;
  }

  // Record the read. Blocks with vector clocks also keep every reader of the cell (the summary cannot
  // say which readers a release ordered): a summary started then is exact (r_mapped), one started
  // before keeps only its summary form.
  const bool starts = c.r_block == 0 || (c.r_block == a.block && c.r_epoch != a.epoch);
  if (starts) c.r_mapped = a.worker->vector_clocks;
  if (c.r_mapped) {
    std::vector<ReadEntry>& readers = g_race.reads[&c];
    if (starts) readers.clear();
    bool known = false;
    for (ReadEntry& r : readers) {
      if (r.tid != a.tid) continue;
      r.gen = a.gen;
      r.clock = a.fiber->clock;
      known = true;
    }
    if (!known) readers.push_back(ReadEntry{a.tid, a.gen, a.fiber->clock});
  }
  if (starts) {
    c.r_block = a.block;
    c.r_epoch = a.epoch;
    c.r_warp = a.warp;
    c.r_lanes = 1u << a.lane;
    c.r_gen = a.gen;
    c.r_tid = a.tid;
  } else if (c.r_block != a.block) {
    c.r_block = kMultiple;
  } else if (c.r_warp == a.warp) {
    c.r_lanes |= 1u << a.lane;
    c.r_gen = a.gen;
    if (c.r_tid == a.tid) return;
    c.r_tid = a.tid;
  } else if (c.r_warp != kMultipleWarps) {
    c.r_warp = kMultipleWarps;
    c.r_tid = a.tid;
  }
}

Access access_of(Fiber* f) {
  Worker* w = f->worker;
  Access a;
  a.fiber = f;
  a.worker = w;
  a.block = static_cast<uint32_t>(w->block_linear + 1);
  a.epoch = static_cast<uint32_t>(w->epoch);
  a.tid = static_cast<uint16_t>(f->index);
  a.warp = static_cast<uint16_t>(f->index >> 5);
  a.lane = f->index & 31;
  a.gen = w->warps[a.warp].generation;
  return a;
}

// check_alignment: the access is one instruction of `bytes` bytes (not a memcpy range).
void on_access(uintptr_t address, unsigned bytes, bool is_write, bool is_atomic, bool check_alignment = false) {
  Fiber* f = fiber_on_this_stack();
  if (f == nullptr) return;
  Worker* w = f->worker;
  // wgmma (sim_wgmma.cpp): accumulator registers it watches, shared operands it reads in flight.
  if (__builtin_expect(!f->wgmma.watch.empty() || (is_write && w->wgmma_operand_bytes != 0), 0))
    race_wgmma_check_access(f, address, bytes, is_write);
  // TMA stores (sim_tma.cpp): shared sources they may still read.
  if (__builtin_expect(is_write && w->tma_store_source_bytes != 0, 0)) race_tma_check_write(f, address, bytes);
  const Access a = access_of(f);
  const uintptr_t smem = reinterpret_cast<uintptr_t>(w->view.smem);
  const uintptr_t smem_end = smem + w->launch->view.smem_bytes;
  if (address + bytes > w->smem_map_lo && address < w->smem_map_hi) {
    if (address < smem || address + bytes > smem_end)
      fail_current(format("shared memory access out of bounds: %u-byte %s at byte %lld of a %u-byte dynamic shared "
                          "memory", bytes, is_write ? "write" : "read", static_cast<long long>(address - smem),
                          w->launch->view.smem_bytes));
    if (check_alignment && address % bytes != 0)
      fail_current(format("misaligned shared memory access: %u-byte %s at byte offset %llu (a GPU requires "
                          "natural alignment)", bytes, is_write ? "write" : "read",
                          static_cast<unsigned long long>(address - smem)));
  }
  for (uintptr_t p = address; p < address + bytes; ++p) {
    if (p >= smem && p < smem_end) {
      check_and_record(a, g_race.shared[p - smem], is_write, is_atomic, "shared memory", p - smem, false);
      continue;
    }
    for (GlobalShadow& g : g_race.globals) {
      if (p >= g.begin && p < g.end) {
        char where[64];
        snprintf(where, sizeof where, "global memory (buffer %d)", g.index);
        check_and_record(a, *g.cell(p), is_write, is_atomic, where, p - g.begin, true);
        break;
      }
    }
  }
}

}  // namespace

void race_launch_begin(Launch* launch) {
  g_race.launch = launch;
  g_race.epoch_counter = 0;
  g_race.globals.clear();
  for (const Buffer& b : launch->buffers) {
    GlobalShadow g;
    g.begin = b.begin;
    g.end = b.end;
    g.index = b.index;
    g.chunks.resize((b.end - b.begin + kChunkBytes - 1) / kChunkBytes);
    g_race.globals.push_back(std::move(g));
  }
  g_race.shared.assign(launch->view.smem_bytes, Cell{});
}

void race_launch_end(Launch*) {
  g_race.globals.clear();
  g_race.shared.clear();
  g_race.shared.shrink_to_fit();
  g_race.launch = nullptr;
}

void race_block_begin(Worker* w) {
  w->epoch = ++g_race.epoch_counter;
  w->vector_clocks = false;
  g_race.reads.clear();
}

void race_barrier_complete(Worker* w) { w->epoch = ++g_race.epoch_counter; }

void race_syncwarp_complete(Worker* w, unsigned warp, unsigned mask) {
  const uint32_t gen = ++w->warps[warp].generation;
  for (unsigned l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    Fiber& f = w->fibers[warp * 32 + l];
    for (unsigned m = 0; m < 32; ++m)
      if (mask >> m & 1u) f.joint_gen[m] = gen;
  }
  // With vector clocks a __syncwarp is also a release and acquire among its lanes, so a chain such as
  // "every lane writes, __syncwarp, one elected lane arrives on an mbarrier" orders every lane's write.
  if (w->vector_clocks) {
    std::vector<uint32_t>& joined = g_race.syncwarp_vc;
    joined.assign(w->fibers.size(), 0);
    for (unsigned l = 0; l < 32; ++l)
      if (mask >> l & 1u) race_release(&w->fibers[warp * 32 + l], joined);
    for (unsigned l = 0; l < 32; ++l)
      if (mask >> l & 1u) race_acquire(&w->fibers[warp * 32 + l], joined);
  }
}

void race_enable_vector_clocks(Worker* w) { w->vector_clocks = true; }

RaceMoment race_moment(Fiber* f) {
  const Access a = access_of(f);
  return RaceMoment{a.epoch, a.gen, f->clock, a.tid};
}

bool race_ordered_after(Fiber* f, const RaceMoment& m) {
  const Access a = access_of(f);
  return ordered_after(a, a.block, m.epoch, m.gen, m.tid, m.clock);
}

void race_atomic(Fiber*, uintptr_t address, unsigned bytes) { on_access(address, bytes, true, true); }

void race_access(uintptr_t address, unsigned bytes, bool is_write) { on_access(address, bytes, is_write, false); }

void race_copy_issued(uintptr_t dst, unsigned bytes, bool tma) {
  on_access(dst, bytes, true, false);  // the write happens at issue: it must be ordered after earlier accesses
  Fiber* f = fiber_on_this_stack();
  const uintptr_t smem = reinterpret_cast<uintptr_t>(f->worker->view.smem);
  for (uintptr_t p = dst; p < dst + bytes; ++p) {
    Cell& c = g_race.shared[p - smem];
    c.f_block = static_cast<uint32_t>(f->worker->block_linear + 1);
    c.f_tid = static_cast<uint16_t>(f->index);
    c.f_tma = tma;
  }
}

void race_copy_landed(Fiber* issuer, uintptr_t dst, unsigned bytes, bool async_proxy) {
  const Access a = access_of(issuer);
  const uintptr_t smem = reinterpret_cast<uintptr_t>(issuer->worker->view.smem);
  for (uintptr_t p = dst; p < dst + bytes; ++p) {
    Cell& c = g_race.shared[p - smem];
    c.f_block = 0;
    c.w_block = a.block;
    c.w_epoch = a.epoch;
    c.w_gen = a.gen;
    c.w_tid = a.tid;
    c.w_clock = issuer->clock;
    c.w_fences = async_proxy ? kAsyncProxyWrite : static_cast<uint32_t>(issuer->proxy_fences.size());
    c.r_block = 0;
  }
}

void race_release(Fiber* f, std::vector<uint32_t>& into) {
  Worker* w = f->worker;
  w->vector_clocks = true;
  const size_t n = w->fibers.size();
  if (into.size() < n) into.resize(n, 0);
  for (size_t t = 0; t < f->vc.size(); ++t)
    if (f->vc[t] > into[t]) into[t] = f->vc[t];
  if (f->clock > into[f->index]) into[f->index] = f->clock;
  ++f->clock;  // accesses after the release are not covered by it
}

void race_acquire(Fiber* f, const std::vector<uint32_t>& from) {
  if (f->vc.size() < from.size()) f->vc.resize(from.size(), 0);
  for (size_t t = 0; t < from.size(); ++t)
    if (from[t] > f->vc[t]) f->vc[t] = from[t];
}

void fence_proxy_async() {
  Fiber* f = fiber_on_this_stack();
  if (f == nullptr) return;
  const Access a = access_of(f);
  f->proxy_fences.push_back(Fiber::ProxyFence{a.epoch, a.gen, f->clock});
  ++f->clock;  // accesses after the fence are not covered by it (a release carrying this clock would say so)
}

void race_async_proxy_read(uintptr_t address, unsigned bytes) {
  Fiber* f = fiber_on_this_stack();
  if (f == nullptr) return;
  Worker* w = f->worker;
  const uintptr_t smem = reinterpret_cast<uintptr_t>(w->view.smem);
  const uintptr_t smem_end = smem + w->launch->view.smem_bytes;
  if (address < smem || address + bytes > smem_end)
    fail_current(format("async-proxy read of %u bytes at 0x%" PRIxPTR " outside the block's dynamic shared memory", bytes,
                        address));
  on_access(address, bytes, false, false);  // ordered after the writes like any read
  const Access a = access_of(f);
  for (uintptr_t p = address; p < address + bytes; ++p) {
    const Cell& c = g_race.shared[p - smem];
    if (c.w_block != a.block || c.w_fences == kAsyncProxyWrite) continue;
    // The writer's first fence after the write must be ordered before this read.
    const std::vector<Fiber::ProxyFence>& fences = w->fibers[c.w_tid].proxy_fences;
    if (c.w_fences < fences.size()) {
      const Fiber::ProxyFence& first = fences[c.w_fences];
      if (ordered_after(a, a.block, first.epoch, first.gen, c.w_tid, first.clock)) continue;
    }
    fail_current(format("async-proxy read of shared byte offset %" PRIuPTR " (a wgmma or TMA operand) without a "
                        "fence.proxy.async: %s wrote it with an ordinary (generic-proxy) store and no "
                        "fence.proxy.async of that thread after the write is ordered before this read, so the "
                        "async proxy may read stale bytes",
                        p - smem, thread_name(a, a.block, c.w_tid, false).c_str()));
  }
}

// A wgmma reads its shared operands through the async proxy: the ordinary read check and the
// fence.proxy.async rule, both in race_async_proxy_read.
void race_wgmma_operand_read(uintptr_t address, unsigned bytes) { race_async_proxy_read(address, bytes); }

}  // namespace cuflash::sim

// ---- the hooks GCC's -fsanitize=thread instrumentation calls --------------------------------
#define CUFLASH_HOOK extern "C" __attribute__((visibility("default")))
using cuflash::sim::on_access;

CUFLASH_HOOK void __tsan_init() {}
CUFLASH_HOOK void __tsan_func_entry(void*) {}
CUFLASH_HOOK void __tsan_func_exit() {}
CUFLASH_HOOK void __tsan_vptr_update(void**, void*) {}
CUFLASH_HOOK void __tsan_vptr_read(void**) {}

#define CUFLASH_ACCESS_HOOKS(n)                                                                                    \
  CUFLASH_HOOK void __tsan_read##n(void* p) { on_access(reinterpret_cast<uintptr_t>(p), n, false, false, true); } \
  CUFLASH_HOOK void __tsan_write##n(void* p) { on_access(reinterpret_cast<uintptr_t>(p), n, true, false, true); } \
  CUFLASH_HOOK void __tsan_volatile_read##n(void* p) {                                                           \
    on_access(reinterpret_cast<uintptr_t>(p), n, false, false, true);                                           \
  }                                                                                                              \
  CUFLASH_HOOK void __tsan_volatile_write##n(void* p) {                                                          \
    on_access(reinterpret_cast<uintptr_t>(p), n, true, false, true);                                            \
  }
CUFLASH_ACCESS_HOOKS(1)
CUFLASH_ACCESS_HOOKS(2)
CUFLASH_ACCESS_HOOKS(4)
CUFLASH_ACCESS_HOOKS(8)
CUFLASH_ACCESS_HOOKS(16)

#define CUFLASH_UNALIGNED_HOOKS(n)                                                    \
  CUFLASH_HOOK void __tsan_unaligned_read##n(void* p) {                               \
    on_access(reinterpret_cast<uintptr_t>(p), n, false, false);                       \
  }                                                                                   \
  CUFLASH_HOOK void __tsan_unaligned_write##n(void* p) {                              \
    on_access(reinterpret_cast<uintptr_t>(p), n, true, false);                        \
  }
CUFLASH_UNALIGNED_HOOKS(2)
CUFLASH_UNALIGNED_HOOKS(4)
CUFLASH_UNALIGNED_HOOKS(8)
CUFLASH_UNALIGNED_HOOKS(16)

CUFLASH_HOOK void __tsan_read_range(void* p, unsigned long size) {
  on_access(reinterpret_cast<uintptr_t>(p), static_cast<unsigned>(size), false, false);
}
CUFLASH_HOOK void __tsan_write_range(void* p, unsigned long size) {
  on_access(reinterpret_cast<uintptr_t>(p), static_cast<unsigned>(size), true, false);
}

#endif  // CUFLASH_SIM_RACE
