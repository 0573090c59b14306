// The simulator runtime: fibers, the per-block scheduler, barriers, warp
// collectives, error handling and the launch entry point.
//
// Execution model
//   A launch runs its blocks on W OS worker threads (the calling thread is one of
//   them); each worker takes the next block index from an atomic counter and runs
//   that block to completion with one fiber per CUDA thread. Blocks never share
//   state, so results do not depend on W (except the order of the kernel's own
//   float atomics, as on a GPU).
//
// Scheduling inside a block
//   Fibers run in thread-index order until they block (at __syncthreads, at a warp
//   collective) or exit. A blocking fiber switches directly to the next runnable
//   fiber with a higher index, or back to the scheduler, which restarts from the
//   lowest runnable one. A 128-thread barrier therefore costs ~129 switches.
//   When nothing is runnable and threads remain, the block is deadlocked: an error.
//
// Errors
//   fail_current() records the message (kernel, block, thread), marks the block
//   failed and switches to the scheduler, never resuming the block's fibers.
//   Other workers stop at their next block boundary. C++ exceptions never cross
//   a fiber switch.
//
// Fiber stacks
//   kStackBytes-aligned slots of one reserved arena (so the running thread's view
//   is found from %rsp), with a PROT_NONE guard page at the low end, reused across
//   blocks and launches. A fault on a fiber stack (overflow into the guard, a wild
//   pointer, shared memory overrun into its guard page) becomes a kernel error via
//   the SIGSEGV/SIGBUS/SIGFPE/SIGILL handler, which hands back to the scheduler.
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "../../common/attention_params.cuh"
#include "sim_internal.h"

#if CUFLASH_SIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// ---- stack switching -------------------------------------------------------------------
// switch_stack and fiber_trampoline are host assembly in fiber_switch_x86_64.S.
extern "C" {
__attribute__((visibility("hidden"))) void cuflash_sim_switch_stack(void** save_sp, void* next_sp);
__attribute__((visibility("hidden"))) void cuflash_sim_fiber_trampoline();
__attribute__((visibility("hidden"), noreturn, used)) void cuflash_sim_fiber_main(cuflash::sim::Fiber* fiber);
}

namespace cuflash::sim {
namespace {

constexpr uintptr_t kPageBytes = 4096;
constexpr unsigned kArenaSlots = 16384;  // 4 GiB of address space, committed on use
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned long long kMaxDynamicSmemBytes = 227 * 1024;  // sm_90's opt-in limit
constexpr unsigned kScheduler = ~0u;

// ---- the stack arena ---------------------------------------------------------------------
class StackArena {
 public:
  static StackArena& instance() {
    static StackArena arena;
    return arena;
  }
  bool contains(uintptr_t address) const { return address - base_ < bytes_; }
  uintptr_t slot_base(unsigned slot) const { return base_ + static_cast<uintptr_t>(slot) * kStackBytes; }
  bool is_guard(uintptr_t address) const {
    return contains(address) && (address & (kStackBytes - 1)) < kPageBytes;
  }

  // Returns false when the arena is exhausted (too many concurrent blocks).
  bool acquire(std::vector<unsigned>& slots, unsigned count) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes_ == 0) {
      failure_ = "cannot reserve address space for fiber stacks";
      return false;
    }
    while (slots.size() < count) {
      unsigned slot;
      if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
      } else {
        if (next_ == kArenaSlots) {
          failure_ = "all fiber stack slots are in use (too many concurrent launches)";
          return false;
        }
        // Each committed slot is two mappings (guard + stack): vm.max_map_count
        // bounds how many a process can have, so slots are reused, never unmapped.
        if (mprotect(reinterpret_cast<void*>(slot_base(next_) + kPageBytes), kStackBytes - kPageBytes,
                     PROT_READ | PROT_WRITE) != 0) {
          failure_ = std::string("cannot commit a fiber stack: ") + strerror(errno);
          return false;
        }
        slot = next_++;
      }
      slots.push_back(slot);
    }
    return true;
  }
  std::string failure() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }
  void release(std::vector<unsigned>& slots) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (unsigned slot : slots) free_.push_back(slot);
    slots.clear();
  }

 private:
  StackArena() {
    bytes_ = static_cast<uintptr_t>(kArenaSlots) * kStackBytes;
    void* raw = mmap(nullptr, bytes_ + kStackBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
      base_ = 0;
      bytes_ = 0;
      return;
    }
    base_ = (reinterpret_cast<uintptr_t>(raw) + kStackBytes - 1) & ~(kStackBytes - 1);
  }
  uintptr_t base_ = 0;
  uintptr_t bytes_ = 0;
  std::string failure_;
  std::mutex mutex_;
  std::vector<unsigned> free_;
  unsigned next_ = 0;
};

// ---- shared memory ------------------------------------------------------------------------
// Normal and race modes: the block's bytes end right at a PROT_NONE page, so an
// overrun past the end faults at once (reported as a kernel error). ASan mode:
// exactly dynamic_smem_bytes from the (instrumented) heap, so ASan sees overruns.
// Dynamic shared memory of the running block. The base is 1024-byte aligned, as on a GPU
// (swizzles over 128- and 1024-byte atoms depend on it), and the allocation sits between two
// PROT_NONE guard pages: [guard][slack < 1 page][smem ... end][slack < 1 KiB][guard], so an
// access past either end faults once it leaves the slack (race mode checks every byte).
struct SmemRegion {
  static constexpr size_t kBaseAlignment = 1024;
  unsigned char* map = nullptr;
  size_t map_bytes = 0;
  unsigned char* block_smem = nullptr;

  unsigned char* allocate(size_t bytes) {
    if (bytes == 0) return nullptr;
#if CUFLASH_SIM_ASAN
    void* p = nullptr;
    if (posix_memalign(&p, kBaseAlignment, bytes) != 0) return nullptr;
    block_smem = static_cast<unsigned char*>(p);
#else
    const size_t usable = (bytes + kBaseAlignment - 1 + kPageBytes - 1) & ~(kPageBytes - 1);
    if (map == nullptr || map_bytes < usable + 2 * kPageBytes) {
      release_map();
      map_bytes = usable + 2 * kPageBytes;
      void* raw = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) {
        map = nullptr;
        map_bytes = 0;
        return nullptr;
      }
      map = static_cast<unsigned char*>(raw);
      mprotect(map, kPageBytes, PROT_NONE);
      mprotect(map + map_bytes - kPageBytes, kPageBytes, PROT_NONE);
    }
    // The highest 1024-byte aligned start that still fits below the upper guard page.
    const uintptr_t limit = reinterpret_cast<uintptr_t>(map + map_bytes - kPageBytes);
    block_smem = reinterpret_cast<unsigned char*>((limit - bytes) & ~uintptr_t{kBaseAlignment - 1});
#endif
    memset(block_smem, 0xff, bytes);
    return block_smem;
  }
  uintptr_t mapped_lo() const { return reinterpret_cast<uintptr_t>(map); }
  uintptr_t mapped_hi() const { return reinterpret_cast<uintptr_t>(map + map_bytes); }
  void free_block() {
#if CUFLASH_SIM_ASAN
    free(block_smem);
#endif
    block_smem = nullptr;
  }
  void release_map() {
    if (map != nullptr) munmap(map, map_bytes);
    map = nullptr;
    map_bytes = 0;
  }
  ~SmemRegion() { release_map(); }
};

// ---- fault handling ------------------------------------------------------------------------------
// A fault while a fiber runs (stack overflow, wild pointer, shared memory overrun)
// must not kill the Python interpreter. The handler runs on a per-worker
// alternate stack; if the interrupted %rsp lies in the fiber arena it records the
// error and switches to the worker's scheduler (like siglongjmp; SA_NODEFER keeps
// the signal unblocked). Other faults go to the previously installed handler.
constexpr int kHandledSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction g_previous[NSIG];
std::once_flag g_handlers_once;

void forward_signal(int sig, siginfo_t* info, void* context) {
  const struct sigaction& prev = g_previous[sig];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction != nullptr) {
      prev.sa_sigaction(sig, info, context);
      return;
    }
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  // Default action: restore it and return; the faulting instruction faults again.
  signal(sig, SIG_DFL);
}

void fault_handler(int sig, siginfo_t* info, void* context);

void install_fault_handlers() {
  std::call_once(g_handlers_once, [] {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = &fault_handler;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    for (int sig : kHandledSignals) sigaction(sig, &action, &g_previous[sig]);
  });
}

// An alternate signal stack for the current OS thread while it runs blocks.
struct AltStack {
  void* memory = nullptr;
  stack_t previous{};
  bool installed = false;
  void install() {
    constexpr size_t kBytes = 64 * 1024;
    memory = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      memory = nullptr;
      return;
    }
    stack_t ss{};
    ss.ss_sp = memory;
    ss.ss_size = kBytes;
    ss.ss_flags = 0;
    installed = sigaltstack(&ss, &previous) == 0;
  }
  ~AltStack() {
    if (installed) sigaltstack(&previous, nullptr);
    if (memory != nullptr) munmap(memory, 64 * 1024);
  }
};

// ---- AddressSanitizer reports (asan mode) ---------------------------------------------------------
// The instrumented code runs with -fsanitize-recover=address and halt_on_error=0:
// a report does not stop the process. The callback (registered at each launch,
// since ASan keeps one callback per process) keeps the report; the fiber that
// caused it fails at its next synchronization point or when it yields, and the
// launch returns it as its error.
#if CUFLASH_SIM_ASAN
char g_asan_report[3500];
std::atomic<bool> g_asan_pending{false};

void asan_report_callback(const char* report) {
  if (g_asan_pending.load(std::memory_order_relaxed)) return;  // keep the first report of a launch
  // The shadow-byte dump and its legend follow the SUMMARY line; the full report
  // is on stderr anyway, the error message keeps the part that names the bug.
  size_t length = strlen(report);
  if (const char* shadow = strstr(report, "Shadow bytes around")) length = static_cast<size_t>(shadow - report);
  if (length >= sizeof g_asan_report) length = sizeof g_asan_report - 1;
  memcpy(g_asan_report, report, length);
  g_asan_report[length] = '\0';
  g_asan_pending.store(true, std::memory_order_release);
}
#endif

bool asan_report_pending() {
#if CUFLASH_SIM_ASAN
  return g_asan_pending.load(std::memory_order_acquire);
#else
  return false;
#endif
}

std::string asan_report_text() {
#if CUFLASH_SIM_ASAN
  return std::string("AddressSanitizer reported an error:\n") + g_asan_report;
#else
  return {};
#endif
}

// ---- switching ---------------------------------------------------------------------------------
void switch_context(void** save_sp, void** save_fake_stack, void* next_sp, uintptr_t next_lo, uintptr_t next_hi,
                    bool leaving_for_good) {
#if CUFLASH_SIM_ASAN
  __sanitizer_start_switch_fiber(leaving_for_good ? nullptr : save_fake_stack, reinterpret_cast<void*>(next_lo),
                                 next_hi - next_lo);
  cuflash_sim_switch_stack(save_sp, next_sp);
  __sanitizer_finish_switch_fiber(*save_fake_stack, nullptr, nullptr);
#else
  (void)save_fake_stack;
  (void)next_lo;
  (void)next_hi;
  (void)leaving_for_good;
  cuflash_sim_switch_stack(save_sp, next_sp);
#endif
}

void switch_to_scheduler(Worker* w, Fiber* from, bool leaving_for_good) {
  w->current = kScheduler;
  switch_context(&from->sp, &from->asan_fake_stack, w->scheduler_sp, w->scheduler_stack_lo, w->scheduler_stack_hi,
                 leaving_for_good);
}

// The running fiber stops (it is waiting or exited): run the next runnable fiber
// with a higher index, else return to the scheduler.
void yield_from(Worker* w, Fiber* f, bool leaving_for_good) {
  const unsigned n = static_cast<unsigned>(w->fibers.size());
  for (unsigned j = f->index + 1; j < n; ++j) {
    Fiber& next = w->fibers[j];
    if (next.state == FiberState::kRunnable) {
      w->current = j;
      switch_context(&f->sp, &f->asan_fake_stack, next.sp, next.stack_lo, next.stack_hi, leaving_for_good);
      return;
    }
  }
  switch_to_scheduler(w, f, leaving_for_good);
}

uint3 unflatten(unsigned long long linear, dim3 dims) {
  uint3 r;
  r.x = static_cast<unsigned>(linear % dims.x);
  linear /= dims.x;
  r.y = static_cast<unsigned>(linear % dims.y);
  r.z = static_cast<unsigned>(linear / dims.y);
  return r;
}

void release_barrier(Worker* w) {
  for (Fiber& f : w->fibers)
    if (f.state == FiberState::kAtBarrier) f.state = FiberState::kRunnable;
  // __syncthreads_count/and/or read these after waking (sim_internal.h).
  w->barrier_result = w->barrier_predicates;
  w->barrier_live = w->arrived;
  w->barrier_predicates = 0;
  w->arrived = 0;
#if CUFLASH_SIM_RACE
  race_barrier_complete(w);
#endif
#if CUFLASH_SIM_PROFILE
  for (unsigned warp = 0; warp < w->num_warps; ++warp) profile_warp_synchronized(w, warp);
#endif
}

// ---- the block scheduler ---------------------------------------------------------------------------

std::string describe_wait(const Worker* w, const Fiber& f) {
  if (f.state == FiberState::kAtBarrier) return "waits at " + describe_site(f.wait_site);
  if (f.state == FiberState::kAtMbarrier || f.state == FiberState::kAtNamedBarrier) return describe_sync_wait(w, f);
  if (f.wait_mask == 0) return describe_warpgroup_wait(w, f);  // a collective of more than one warp
  const unsigned warp = f.index >> 5;
  const Warp& wp = w->warps[warp];
  unsigned missing = f.wait_mask;
  for (int i = 0; i < wp.num_pending; ++i)
    if (wp.pending[i].mask == f.wait_mask && (wp.pending[i].arrived >> (f.index & 31) & 1u))
      missing = wp.pending[i].mask & ~wp.pending[i].arrived;
  return format("waits at %s (mask 0x%08x) for lane(s) %s of warp %u", describe_site(f.wait_site).c_str(),
                f.wait_mask, lanes_text(missing).c_str(), warp);
}

std::string deadlock_message(const Worker* w) {
  std::string text = "deadlock: no thread of the block can proceed:";
  int shown = 0;
  const unsigned n = static_cast<unsigned>(w->fibers.size());
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& f = w->fibers[i];
    if (f.state == FiberState::kExited) continue;
    // Group consecutive threads waiting the same way.
    const std::string wait = describe_wait(w, f);
    unsigned j = i;
    while (j + 1 < n && w->fibers[j + 1].state != FiberState::kExited && describe_wait(w, w->fibers[j + 1]) == wait)
      ++j;
    if (shown++ < 8) {
      text += "\n    " + describe_thread(w, i);
      if (j > i) text += " .. " + describe_thread(w, j);
      text += " " + wait;
    }
    i = j;
  }
  if (shown > 8) text += format("\n    (%d more groups)", shown - 8);
  return text;
}

// ---- cp.async landing (the instructions themselves are below) ----------------------------------

void apply_copy(const PendingCopy& c) {
  if (c.src_size) memcpy(c.dst, c.src, c.src_size);
  if (c.src_size < c.cp_size) memset(c.dst + c.src_size, 0, c.cp_size - c.src_size);
}

}  // namespace

// splitmix64 step: one fair bit per call, from the block's landing stream.
bool coin_flip(Worker* w) {
  uint64_t z = (w->landing_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return ((z ^ (z >> 31)) >> 63) != 0;
}

namespace {

// At a fiber switch: every copy still in flight lands now with probability 1/2.
void land_some_copies(Worker* w) {
#if !CUFLASH_SIM_RACE
  for (Fiber& f : w->fibers) {
    size_t kept = 0;
    for (size_t i = 0; i < f.copies.size(); ++i) {
      if (coin_flip(w))
        apply_copy(f.copies[i]);
      else
        f.copies[kept++] = f.copies[i];
    }
    w->copies_in_flight -= f.copies.size() - kept;
    f.copies.resize(kept);
  }
#else
  (void)w;  // race mode lands copies at the wait, where it checks their ordering
#endif
}

void init_fiber(Worker* w, Fiber& f, unsigned index, unsigned slot) {
  StackArena& arena = StackArena::instance();
  const uintptr_t base = arena.slot_base(slot);
  f.worker = w;
  f.index = index;
  f.state = FiberState::kRunnable;
  f.stack_lo = base + kPageBytes;
  f.stack_hi = base + kThreadViewOffset;
  f.asan_fake_stack = nullptr;
  f.wait_mask = 0;
  f.wait_object = 0;
  f.wait_parity = 0;
  f.copies.clear();
  f.groups_committed = 0;
  f.wgmma.groups_committed = 0;
  f.wgmma.fences = 0;
  f.wgmma.watch.clear();
  f.tma_stores.clear();
  f.bulk_groups_committed = 0;
  f.view = reinterpret_cast<ThreadView*>(base + kThreadViewOffset);
  f.view->thread_idx = unflatten(index, w->launch->view.block_dim);
  f.view->linear_tid = index;
  f.view->block = &w->view;
  f.view->fiber = &f;
#if CUFLASH_SIM_ASAN
  // Frames abandoned by a failed block (or left by a previous kernel) may have
  // left poisoned redzones in this slot.
  __asan_unpoison_memory_region(reinterpret_cast<void*>(f.stack_lo), f.stack_hi - f.stack_lo);
#endif
#if CUFLASH_SIM_RACE
  memset(f.joint_gen, 0, sizeof f.joint_gen);
  f.clock = 1;
  f.vc.clear();
  f.proxy_fences.clear();
#endif
  // First frame, as switch_stack pops it: x87 CW, MXCSR, r15..r12, rbx, rbp, return address.
  // sp0 + 72 (the trampoline's %rsp) must be 16-byte aligned for its call.
  uintptr_t sp = (f.stack_hi - 128) & ~uintptr_t{15};
  sp -= 8;  // sp = 8 mod 16
  uint64_t* frame = reinterpret_cast<uint64_t*>(sp);
  frame[0] = 0x037f;  // x87 control word: default (round to nearest, all exceptions masked)
  frame[1] = 0x1f80;  // MXCSR: default (round to nearest, no FTZ/DAZ, exceptions masked)
  frame[2] = 0;       // r15
  frame[3] = 0;       // r14
  frame[4] = 0;       // r13
  frame[5] = 0;       // r12
  frame[6] = reinterpret_cast<uint64_t>(&f);  // rbx -> fiber_main's argument
  frame[7] = 0;                               // rbp
  frame[8] = reinterpret_cast<uint64_t>(&cuflash_sim_fiber_trampoline);
  f.sp = reinterpret_cast<void*>(sp);
}

void scheduler_stack_bounds(Worker* w) {
  pthread_attr_t attr;
  void* addr = nullptr;
  size_t size = 0;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    pthread_attr_getstack(&attr, &addr, &size);
    pthread_attr_destroy(&attr);
  }
  w->scheduler_stack_lo = reinterpret_cast<uintptr_t>(addr);
  w->scheduler_stack_hi = reinterpret_cast<uintptr_t>(addr) + size;
}

void run_block(Worker* w, SmemRegion& smem, unsigned long long block_linear) {
  Launch* launch = w->launch;
  const unsigned n = launch->threads_per_block;
  w->block_linear = block_linear;
  w->view.block_idx = unflatten(block_linear, launch->view.grid_dim);
  w->view.smem = smem.allocate(launch->view.smem_bytes);
  if (launch->view.smem_bytes != 0 && w->view.smem == nullptr) {
    launch->record_error(block_linear, "simulator: cannot allocate shared memory");
    return;
  }
  w->smem_map_lo = smem.mapped_lo();
  w->smem_map_hi = smem.mapped_hi();
  w->landing_rng = launch->copy_landing_seed ^ (0x9e3779b97f4a7c15ull * (block_linear + 1));
  w->copies_in_flight = 0;
  wgmma_block_begin(w);
  tma_block_begin(w);
  w->live = n;
  w->arrived = 0;
  w->barrier_predicates = 0;
  w->barrier_result = 0;
  w->barrier_live = 0;
  w->failed = false;
  w->num_warps = (n + 31) / 32;
  for (unsigned i = 0; i < w->num_warps; ++i) {
    Warp& wp = w->warps[i];
    const unsigned lanes = n - 32 * i >= 32 ? 32 : n - 32 * i;
    wp.gone = lanes == 32 ? 0u : ~((1u << lanes) - 1u);
    wp.num_pending = 0;
#if CUFLASH_SIM_RACE
    wp.generation = 1;
#endif
  }
  for (unsigned i = 0; i < n; ++i) init_fiber(w, w->fibers[i], i, w->slots[i]);
  sync_block_begin(w);
#if CUFLASH_SIM_RACE
  race_block_begin(w);
#endif
#if CUFLASH_SIM_PROFILE
  profile_block_begin(w);
#endif

  for (;;) {
    unsigned next = 0;
    while (next < n && w->fibers[next].state != FiberState::kRunnable) ++next;
    if (next == n) {
      // Nothing can run: TMA loads still in flight land now (they may complete the phases threads wait for);
      // only without any is the block deadlocked.
      if (!w->tma_loads.empty() && tma_land_loads(w, LoadsToLand::kAll, 0, false) && !w->failed) continue;
      break;
    }
    w->current = next;
    Fiber& f = w->fibers[next];
    if (w->copies_in_flight != 0) land_some_copies(w);
    if (w->wgmma_in_flight != 0) wgmma_land_some(w);
#if !CUFLASH_SIM_RACE
    if (!w->tma_loads.empty()) tma_land_loads(w, LoadsToLand::kSome, 0, false);
    if (w->tma_stores_in_flight != 0) tma_land_some_stores(w);
    if (w->failed) break;
#endif
    switch_context(&w->scheduler_sp, &w->scheduler_fake_stack, f.sp, f.stack_lo, f.stack_hi, false);
    if (w->failed) break;
    if (asan_report_pending()) {
      launch->record_error(block_linear, asan_report_text() + "\n  in " + describe_block(w));
      w->failed = true;
      break;
    }
  }
  if (!w->failed && w->live != 0) launch->record_error(block_linear, deadlock_message(w) + "\n  in " + describe_block(w));
#if CUFLASH_SIM_PROFILE
  profile_block_end(w);
#endif
  smem.free_block();
}

void worker_main(Launch* launch, Worker* w) {
  AltStack alt;
  alt.install();
  scheduler_stack_bounds(w);
  SmemRegion smem;
  while (!launch->abort.load(std::memory_order_relaxed)) {
    const unsigned long long b = launch->next_block.fetch_add(1, std::memory_order_relaxed);
    if (b >= launch->num_blocks) break;
    run_block(w, smem, b);
  }
}

// The worker whose fiber faulted, found from the interrupted stack pointer.
void fault_handler(int sig, siginfo_t* info, void* context) {
  ucontext_t* uc = static_cast<ucontext_t*>(context);
  const uintptr_t rsp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
  StackArena& arena = StackArena::instance();
  if (!arena.contains(rsp)) {
    forward_signal(sig, info, context);
    return;
  }
  const uintptr_t fault = reinterpret_cast<uintptr_t>(info->si_addr);
  ThreadView* view = reinterpret_cast<ThreadView*>((rsp & ~(kStackBytes - 1)) + kThreadViewOffset);
  Fiber* f = static_cast<Fiber*>(view->fiber);
  Worker* w = f->worker;
  std::string what;
  const uintptr_t smem = reinterpret_cast<uintptr_t>(w->view.smem);
  const uintptr_t smem_end = smem + w->launch->view.smem_bytes;
  if (sig == SIGFPE) {
    what = "SIGFPE: arithmetic exception (integer division by zero or overflow; a GPU does not trap here, "
           "but the result would be meaningless)";
  } else if (sig == SIGILL) {
    what = "SIGILL: illegal instruction (reached __builtin_trap or __builtin_unreachable)";
  } else if (arena.is_guard(fault) && (fault & ~(kStackBytes - 1)) == (rsp & ~(kStackBytes - 1))) {
    what = format("stack overflow: the thread used more than its %zu KiB fiber stack",
                  static_cast<size_t>((kStackBytes - kPageBytes - 256) / 1024));
  } else if (smem != 0 && fault >= w->smem_map_lo && fault < w->smem_map_hi) {
    what = format("shared memory access out of bounds: byte %lld of a %u-byte dynamic shared memory",
                  static_cast<long long>(fault - smem), w->launch->view.smem_bytes);
  } else {
    what = format("%s at address 0x%" PRIxPTR " (invalid memory access)", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS",
                  fault);
  }
  w->launch->record_error(w->block_linear, what + "\n  in " + describe_block(w) + ", " + describe_thread(w, f->index));
  w->failed = true;
  // Leave the handler for the scheduler; the alternate stack is released by the
  // kernel's SS_ONSTACK bookkeeping being based on %rsp.
  w->current = kScheduler;
  void* discard;
#if CUFLASH_SIM_ASAN
  __sanitizer_start_switch_fiber(nullptr, reinterpret_cast<void*>(w->scheduler_stack_lo),
                                 w->scheduler_stack_hi - w->scheduler_stack_lo);
#endif
  cuflash_sim_switch_stack(&discard, w->scheduler_sp);
}

}  // namespace

// ---- shared helpers ------------------------------------------------------------------------------

void Launch::record_error(unsigned long long block_linear, std::string message) {
  std::lock_guard<std::mutex> lock(error_mutex);
  // Keep the error of the lowest block index, so the report does not depend on
  // how blocks were spread over workers.
  if (block_linear < error_block || error.empty()) {
    error_block = block_linear;
    error = std::move(message);
  }
  abort.store(true, std::memory_order_relaxed);
}

std::string format(const char* fmt, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  return buffer;
}

std::string lanes_text(unsigned mask) {
  std::string s;
  for (unsigned lane = 0; lane < 32; ++lane) {
    if (!(mask >> lane & 1u)) continue;
    unsigned end = lane;
    while (end + 1 < 32 && (mask >> (end + 1) & 1u)) ++end;
    if (!s.empty()) s += ",";
    s += end == lane ? format("%u", lane) : format("%u-%u", lane, end);
    lane = end;
  }
  return s.empty() ? "none" : s;
}

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.column == b.column && (a.file == b.file || strcmp(a.file, b.file) == 0) &&
         (a.what == b.what || strcmp(a.what, b.what) == 0);
}

std::string describe_site(const Site& s) {
  const char* file = strrchr(s.file, '/');
  return format("%s (%s:%u:%u)", s.what, file ? file + 1 : s.file, s.line, s.column);
}

std::string describe_thread(const Worker* w, unsigned linear_tid) {
  const uint3 t = unflatten(linear_tid, w->launch->view.block_dim);
  return format("thread (%u,%u,%u)", t.x, t.y, t.z);
}

std::string describe_block(const Worker* w) {
  return format("kernel %s, block (%u,%u,%u)", w->launch->view.kernel_name, w->view.block_idx.x,
                w->view.block_idx.y, w->view.block_idx.z);
}

void fail_current(const std::string& message) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  w->launch->record_error(w->block_linear,
                          message + "\n  in " + describe_block(w) + ", " + describe_thread(w, f->index));
  w->failed = true;
  switch_to_scheduler(w, f, true);
  __builtin_unreachable();
}

void fail(const char* message) { fail_current(message); }

// The running fiber lets the block's others run: the runnable ones above it, then from the lowest up
// (the scheduler), so a fiber that stays runnable (a failed poll) runs again after the others had a turn,
// and one that set a waiting state runs again once another fiber (or a landing) sets it runnable.
void run_others(Fiber* f) { yield_from(f->worker, f, false); }

Fiber* fiber_on_this_stack() {
  const uintptr_t frame = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  if (!StackArena::instance().contains(frame)) return nullptr;
  return current_fiber();
}

void trap(const Site& site) { fail_current("__trap() called at " + describe_site(site)); }

void global_access_failed(const void* address, unsigned bytes, bool is_write, const char* why) {
  Fiber* f = current_fiber();
  const Launch* launch = f->worker->launch;
  const uintptr_t a = reinterpret_cast<uintptr_t>(address);
  // Name the nearest buffer, to make off-by-one and wrong-stride bugs readable.
  std::string where = "no registered buffer";
  uintptr_t best = ~uintptr_t{0};
  for (const Buffer& b : launch->buffers) {
    const uintptr_t distance = a < b.begin ? b.begin - a : (a >= b.end ? a - b.end + 1 : 0);
    if (distance < best) {
      best = distance;
      const long long offset = static_cast<long long>(a) - static_cast<long long>(b.begin);
      where = format("buffer %d (%zu bytes) at byte offset %lld", b.index, static_cast<size_t>(b.end - b.begin),
                     offset);
    }
  }
  fail_current(format("global %s %s: %u bytes at 0x%" PRIxPTR ", nearest %s", is_write ? "store" : "load", why,
                      bytes, a, where.c_str()));
}

// One float32 atomically added to a word (a compare-and-swap loop: blocks run on several workers at once).
void add_f32_to_word(float* p, float v) {
  uint32_t* word = reinterpret_cast<uint32_t*>(p);
  uint32_t expected = __atomic_load_n(word, __ATOMIC_RELAXED);
  for (;;) {
    const uint32_t desired = bit_cast<uint32_t>(bit_cast<float>(expected) + v);
    if (__atomic_compare_exchange_n(word, &expected, desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
  }
}

// An atomic read-modify-write of `bytes` at p as one access: checked (alignment, bounds), counted both ways, and in
// race mode an atomic access (ordered with other atomics, a race with plain accesses).
static void atomic_access(void* p, unsigned bytes) {
  Fiber* f = current_fiber();
  BlockView* block = f->view->block;
  check_global(block, p, bytes, true);
  block->bytes_read += bytes;
  block->bytes_written += bytes;
#if CUFLASH_SIM_RACE
  race_atomic(f, reinterpret_cast<uintptr_t>(p), bytes);
#endif
}

void atomic_add_f32(float* p, float v) {
  atomic_access(p, 4);
  add_f32_to_word(p, v);
}

// red.global.add.v2.f32: the pair's 8 bytes checked as one access (alignment and bounds), each element added on its
// own, as the ISA defines a vector red.
void atomic_add_f32x2(float* p, float a, float b) {
  atomic_access(p, 8);
  add_f32_to_word(p, a);
  add_f32_to_word(p + 1, b);
}

void sync_threads(const Site& site) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  if (asan_report_pending()) fail_current(asan_report_text());
  if (w->arrived == 0) {
    w->barrier_site = site;
  } else if (!same_site(site, w->barrier_site)) {
    // Name one thread already waiting at the other barrier.
    unsigned other = 0;
    while (w->fibers[other].state != FiberState::kAtBarrier) ++other;
    fail_current("barrier divergence: this thread reached " + describe_site(site) + " while " +
                 describe_thread(w, other) + " waits at " + describe_site(w->barrier_site));
  }
  if (++w->arrived == w->live) {
    release_barrier(w);
    return;
  }
  f->state = FiberState::kAtBarrier;
  f->wait_site = site;
  yield_from(w, f, false);
}

void block_fence() {}

int sync_threads_reduce(const Site& site, int predicate, unsigned op) {
  Worker* w = current_fiber()->worker;
  w->barrier_predicates += predicate != 0;
  sync_threads(site);
  if (op == 0) return static_cast<int>(w->barrier_result);         // __syncthreads_count
  if (op == 1) return w->barrier_result == w->barrier_live ? 1 : 0;  // __syncthreads_and
  return w->barrier_result != 0 ? 1 : 0;                             // __syncthreads_or
}

void warp_collective(const Site& site, unsigned mask, CollectiveFn compute, unsigned flags, const void* in,
                     unsigned in_bytes, void* out, unsigned out_bytes) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  if (asan_report_pending()) fail_current(asan_report_text());
  const unsigned warp = f->index >> 5;
  const unsigned lane = f->index & 31;
  const unsigned bit = 1u << lane;
  Warp& wp = w->warps[warp];
  if (!(mask & bit))
    fail_current(format("%s: the calling lane %u is not in mask 0x%08x", describe_site(site).c_str(), lane, mask));
  if (mask & wp.gone)
    fail_current(format("%s: mask 0x%08x names lane(s) %s that exited or do not exist (a hang on a GPU)",
                        describe_site(site).c_str(), mask, lanes_text(mask & wp.gone).c_str()));
  PendingCollective* p = nullptr;
  for (int i = 0; i < wp.num_pending; ++i) {
    PendingCollective& q = wp.pending[i];
    if (!(q.mask & mask)) continue;
    if (q.mask != mask || q.compute != compute || q.flags != flags || !same_site(q.site, site)) {
      fail_current(format("warp collective mismatch: lane %u reached %s with mask 0x%08x while lane(s) %s wait at %s "
                          "with mask 0x%08x",
                          lane, describe_site(site).c_str(), mask, lanes_text(q.arrived).c_str(),
                          describe_site(q.site).c_str(), q.mask));
    }
    p = &q;
    break;
  }
  if (p == nullptr) {
    p = &wp.pending[wp.num_pending++];
    p->mask = mask;
    p->arrived = 0;
    p->site = site;
    p->compute = compute;
    p->flags = flags;
  }
  if (in_bytes) memcpy(wp.io[lane].in, in, in_bytes);
  p->arrived |= bit;
  if (p->arrived == mask) {
    if (const char* error = compute(mask, wp.io)) fail_current(describe_site(site) + ": " + error);
#if CUFLASH_SIM_RACE
    if (flags & kCollectiveOrdersMemory) race_syncwarp_complete(w, warp, mask);
#endif
#if CUFLASH_SIM_PROFILE
    if (mask == 0xffffffffu) profile_warp_synchronized(w, warp);
#endif
    for (unsigned l = 0; l < 32; ++l)
      if ((mask >> l & 1u) && l != lane) w->fibers[warp * 32 + l].state = FiberState::kRunnable;
    *p = wp.pending[--wp.num_pending];
  } else {
    f->state = FiberState::kAtCollective;
    f->wait_site = site;
    f->wait_mask = mask;
    yield_from(w, f, false);
  }
  if (out_bytes) memcpy(out, wp.io[lane].out, out_bytes);
}

// ---- cp.async -------------------------------------------------------------------------------------
// A copy is in flight from its issue to the issuing thread's covering cp.async.wait_group; on a GPU
// it may land at any moment in between. Race mode (sim_race.cpp) treats the destination as written
// at issue and untouchable until the wait, and lands the copy at the wait. The other modes land each
// copy at a random moment: at issue or at any later fiber switch of its block (whoever runs next sees
// it, or not), or at the latest at the wait, drawn from the launch's copy_landing_seed, so a result
// that depends on when copies land changes between seeds.

void cp_async_issue(const Site& site, void* smem_dst, const void* global_src, unsigned cp_size, unsigned src_size) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  if (asan_report_pending()) fail_current(asan_report_text());
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) fail_current(format("cp.async: cp-size %u is not 4, 8 or 16", cp_size));
  if (src_size > cp_size) fail_current(format("cp.async: src-size %u exceeds cp-size %u", src_size, cp_size));
  const uintptr_t dst = reinterpret_cast<uintptr_t>(smem_dst);
  const uintptr_t smem = reinterpret_cast<uintptr_t>(w->view.smem);
  if (dst % cp_size != 0 || reinterpret_cast<uintptr_t>(global_src) % cp_size != 0)
    fail_current(format("cp.async: addresses must be aligned to cp-size %u", cp_size));
  if (dst < smem || dst + cp_size > smem + w->launch->view.smem_bytes)
    fail_current(format("cp.async: destination 0x%" PRIxPTR " (%u bytes) is outside the block's dynamic shared memory",
                        dst, cp_size));
  if (src_size != 0) {
    const uintptr_t src = reinterpret_cast<uintptr_t>(global_src);
    bool inside = false;
    for (const Buffer& b : w->launch->buffers) inside = inside || (src >= b.begin && src + src_size <= b.end);
    if (!inside) global_access_failed(global_src, src_size, false, "out of bounds (cp.async source)");
    w->view.bytes_read += src_size;
#if CUFLASH_SIM_RACE
    race_access(src, src_size, false);
#endif
  }
#if CUFLASH_SIM_RACE
  race_copy_issued(dst, cp_size);
#endif
  profile_shared_access(site, smem_dst, cp_size, kProfileCpAsync);
  const PendingCopy copy{static_cast<unsigned char*>(smem_dst), static_cast<const unsigned char*>(global_src), cp_size,
                         src_size, f->groups_committed};
#if !CUFLASH_SIM_RACE
  if (coin_flip(w)) {  // landed before the issuing instruction even retired
    apply_copy(copy);
    return;
  }
#endif
  f->copies.push_back(copy);
  ++w->copies_in_flight;
}

void cp_async_commit() { ++current_fiber()->groups_committed; }

void cp_async_wait(unsigned newest_groups_left_pending) {
  Fiber* f = current_fiber();
  if (f->groups_committed < newest_groups_left_pending) return;
  const unsigned complete_below = f->groups_committed - newest_groups_left_pending;
  size_t kept = 0;
  for (size_t i = 0; i < f->copies.size(); ++i) {
    if (f->copies[i].group < complete_below) {
      apply_copy(f->copies[i]);
#if CUFLASH_SIM_RACE
      race_copy_landed(f, reinterpret_cast<uintptr_t>(f->copies[i].dst), f->copies[i].cp_size);
#endif
    } else {
      f->copies[kept++] = f->copies[i];
    }
  }
  f->worker->copies_in_flight -= f->copies.size() - kept;
  f->copies.resize(kept);
}

// ---- fiber entry and exit -------------------------------------------------------------------------

}  // namespace cuflash::sim

extern "C" void cuflash_sim_fiber_main(cuflash::sim::Fiber* f) {
  using namespace cuflash::sim;
#if CUFLASH_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  Worker* w = f->worker;
  w->launch->thunk(w->launch->kernel, w->launch->params);
  if (asan_report_pending()) fail_current(asan_report_text());
  // Copies the thread never waited for are dropped: only the issuing thread can wait
  // for them, so any other thread reading their destination races with them on a
  // GPU; leaving the NaN fill in place makes such a read visible.
  w->copies_in_flight -= f->copies.size();
  f->copies.clear();
  wgmma_thread_exit(f);
  tma_thread_exit(f);
  // The thread exited: it no longer blocks barriers, but lanes waiting for it in a
  // warp collective never complete on a GPU.
  const unsigned warp = f->index >> 5;
  const unsigned lane = f->index & 31;
  Warp& wp = w->warps[warp];
  for (int i = 0; i < wp.num_pending; ++i) {
    const PendingCollective& q = wp.pending[i];
    if (q.mask >> lane & 1u)
      fail_current(format("lane %u exited while lane(s) %s wait for it at %s (mask 0x%08x): a hang on a GPU", lane,
                          lanes_text(q.arrived).c_str(), describe_site(q.site).c_str(), q.mask));
  }
  sync_thread_exit(w, f);
  wp.gone |= 1u << lane;
  f->state = FiberState::kExited;
  --w->live;
  if (w->arrived != 0 && w->arrived == w->live) release_barrier(w);
  yield_from(w, f, true);
  __builtin_unreachable();
}

namespace cuflash::sim {

int run_launch(LaunchRequest* request, KernelThunk thunk, const void* kernel, unsigned long long params_size,
               long long max_threads) {
  const char* name = request->kernel_name ? request->kernel_name : "?";
  request->bytes_read = 0;
  request->bytes_written = 0;
  request->error[0] = '\0';
  auto reject = [&](const std::string& why) {
    snprintf(request->error, sizeof request->error, "invalid launch of kernel %s: %s", name, why.c_str());
    return 1;
  };
  const unsigned* bd = request->block;
  const unsigned* gd = request->grid;
  const unsigned long long threads = 1ull * bd[0] * bd[1] * bd[2];
  if (bd[0] == 0 || bd[1] == 0 || bd[2] == 0 || bd[0] > 1024 || bd[1] > 1024 || bd[2] > 64 ||
      threads > kMaxThreadsPerBlock)
    return reject(format("block (%u,%u,%u): need 1..1024 threads, x,y <= 1024, z <= 64", bd[0], bd[1], bd[2]));
  // A GPU refuses a block larger than the kernel's __launch_bounds__ (its maxThreadsPerBlock): ptxas
  // may have given each thread more registers than such a block could get.
  if (max_threads < 1 || max_threads > kMaxThreadsPerBlock)
    return reject(format("__launch_bounds__ maximum of %lld threads: need 1..%u", max_threads, kMaxThreadsPerBlock));
  if (threads > static_cast<unsigned long long>(max_threads))
    return reject(format("block (%u,%u,%u) has %llu threads, more than the kernel's __launch_bounds__ maximum of %lld",
                         bd[0], bd[1], bd[2], threads, max_threads));
  if (gd[0] > 0x7fffffffu || gd[1] > 65535 || gd[2] > 65535)
    return reject(format("grid (%u,%u,%u): need x < 2^31, y,z <= 65535", gd[0], gd[1], gd[2]));
  if (request->params_size != params_size)
    return reject(format("parameter block is %llu bytes, the kernel takes %llu", request->params_size, params_size));
  if (request->dynamic_smem_bytes > kMaxDynamicSmemBytes)
    return reject(format("%llu bytes of dynamic shared memory exceed the %llu bytes of any supported GPU",
                         request->dynamic_smem_bytes, kMaxDynamicSmemBytes));
  const unsigned long long blocks = 1ull * gd[0] * gd[1] * gd[2];
  if (blocks == 0) return 0;  // an empty grid launches nothing

  install_fault_handlers();
  Launch launch;
  launch.view.grid_dim = dim3(gd[0], gd[1], gd[2]);
  launch.view.block_dim = dim3(bd[0], bd[1], bd[2]);
  launch.view.smem_bytes = static_cast<unsigned>(request->dynamic_smem_bytes);
  launch.view.kernel_name = name;
  for (int i = 0; i < request->num_buffers; ++i) {
    if (request->buffer_bytes[i] == 0) continue;
    launch.buffers.push_back(Buffer{static_cast<uintptr_t>(request->buffer_begin[i]),
                                    static_cast<uintptr_t>(request->buffer_begin[i] + request->buffer_bytes[i]),
                                    request->buffer_writable[i], i});
  }
  launch.view.buffers = launch.buffers.data();
  launch.view.num_buffers = static_cast<int>(launch.buffers.size());
  launch.thunk = thunk;
  launch.kernel = kernel;
  launch.params = request->params;
  launch.threads_per_block = static_cast<unsigned>(threads);
  launch.launch_bound_threads = static_cast<unsigned>(max_threads);
  launch.num_blocks = blocks;
  launch.copy_landing_seed = request->copy_landing_seed;

  unsigned workers = request->num_workers > 0 ? static_cast<unsigned>(request->num_workers)
                                              : std::max(1u, std::thread::hardware_concurrency());
#if CUFLASH_SIM_RACE || CUFLASH_SIM_ASAN
  // The race shadow and the ASan report slot are per process: checking-mode
  // launches from several threads run one at a time.
  static std::mutex checking_mode_mutex;
  std::lock_guard<std::mutex> checking_mode_lock(checking_mode_mutex);
#endif
#if CUFLASH_SIM_RACE
  workers = 1;  // the race shadow is not thread-safe; blocks run one after another
  race_launch_begin(&launch);
#endif
#if CUFLASH_SIM_PROFILE
  static std::mutex profile_mode_mutex;  // the profile tables are per process
  std::lock_guard<std::mutex> profile_mode_lock(profile_mode_mutex);
  workers = 1;
  profile_launch_begin();
#endif
#if CUFLASH_SIM_ASAN
  workers = 1;  // reports are attributed to the one running block
  g_asan_pending.store(false);
  __asan_set_error_report_callback(&asan_report_callback);
#endif
  if (workers > blocks) workers = static_cast<unsigned>(blocks);

  std::vector<Worker> pool(workers);
  bool stacks_ok = true;
  for (Worker& w : pool) {
    w.launch = &launch;
    w.view.launch = &launch.view;
    w.view.bytes_read = 0;
    w.view.bytes_written = 0;
    w.fibers.resize(launch.threads_per_block);
    w.warps.resize((launch.threads_per_block + 31) / 32);
    w.scheduler_fake_stack = nullptr;
#if CUFLASH_SIM_RACE
    w.epoch = 0;
#endif
    stacks_ok = stacks_ok && StackArena::instance().acquire(w.slots, launch.threads_per_block);
  }
  if (stacks_ok) {
    std::vector<std::thread> threads_running;
    for (unsigned i = 1; i < workers; ++i) threads_running.emplace_back(worker_main, &launch, &pool[i]);
    worker_main(&launch, &pool[0]);
    for (std::thread& t : threads_running) t.join();
  } else {
    launch.record_error(0, "simulator: " + StackArena::instance().failure());
  }
  for (Worker& w : pool) {
    StackArena::instance().release(w.slots);
    request->bytes_read += w.view.bytes_read;
    request->bytes_written += w.view.bytes_written;
  }
#if CUFLASH_SIM_RACE
  race_launch_end(&launch);
#endif
#if CUFLASH_SIM_PROFILE
  const std::string report = profile_launch_report();
  if (request->profile_out == nullptr || report.size() + 1 > request->profile_out_bytes)
    launch.record_error(0, format("simulator: the bank-conflict report (%zu bytes) does not fit the %llu-byte buffer",
                                  report.size() + 1, request->profile_out_bytes));
  else
    memcpy(request->profile_out, report.c_str(), report.size() + 1);
#endif
  if (launch.error.empty() && asan_report_pending()) launch.record_error(0, asan_report_text());
  if (!launch.error.empty()) {
    snprintf(request->error, sizeof request->error, "%s", launch.error.c_str());
    return 1;
  }
  return 0;
}

}  // namespace cuflash::sim

extern "C" __attribute__((visibility("default"))) const char* cuflash_sim_mode(void) {
#if CUFLASH_SIM_ASAN
  return "asan";
#elif CUFLASH_SIM_RACE
  return "race";
#else
  return "normal";
#endif
}
