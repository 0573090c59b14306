// Profile mode: shared-memory bank conflicts, counted the way Nsight Compute counts wavefronts.
//
// How accesses reach us: as in race mode, kernel TUs are compiled with -fsanitize=thread (and
// -fno-tree-sra, so a float4 access stays one 16-byte access), and this file defines the
// __tsan_* hooks; the call site of a plain load or store is the hook's return address (the
// Python side turns it into file:line with addr2line, from the -g1 line tables). ldmatrix rows
// and cp.async destinations are reported by their twins with their source location.
//
// One warp-level instruction = the accesses of the lanes of one warp at the same call site, the
// n-th time each lane executes it. A warp's accesses are grouped that way until the warp next
// synchronizes (a warp collective or a block barrier, when all its lanes have passed every
// earlier access), then counted:
//   - an access of B bytes per lane is served in phases of 128 / B lanes (32 lanes when B <= 4:
//     8-byte accesses take two half-warp phases, 16-byte accesses and ldmatrix rows four
//     quarter-warp phases; an ldmatrix x4 is four phases of eight 16-byte rows);
//   - a phase needs as many wavefronts as its most loaded bank holds distinct 32-bit words
//     (32 banks of 4 bytes; lanes reading the same word share it, a broadcast);
//   - ideal = the number of phases with an active lane; excess = wavefronts - ideal.
// A TMA copy (one thread's instruction, the copy engine's access) is counted as the engine moves it: its
// 16-byte units in box order (the innermost dimension first), 8 units (128 bytes) a phase, each phase as
// many wavefronts as its most loaded bank holds distinct words. A 128-byte swizzled box row is then 1
// wavefront; the same row without the swizzle too, but two rows whose units share banks are not. (The ISA
// does not document the engine's shared-memory phases: this is the model, the ideal a line per wavefront.)
// A wgmma's operand read from shared memory (one instruction per operand, the warpgroup's) is counted the same
// way, its units core matrix by core matrix (8 rows x 16 bytes, the unit of the ISA's canonical layouts), 8 a
// phase: every canonical layout reads a core matrix in 1 wavefront (the swizzles spread its 8 rows over the 8
// 16-byte positions of a 128-byte line), so the counts give the operands' shared traffic in wavefronts.
// Reported per call site: instructions, wavefronts, ideal (cuflash.sim.record's launch records).
#include <dlfcn.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <unordered_map>

#include "sim_internal.h"

#if CUFLASH_SIM_PROFILE

namespace cuflash::sim {

Fiber* fiber_on_this_stack();  // sim_runtime.cpp: nullptr when not running kernel code

namespace {

// A call site: a code address (plain accesses) or a source location (ldmatrix, cp.async).
struct SiteKey {
  const void* pc;
  const char* file;
  unsigned line;
  unsigned kind;   // ProfileKind
  unsigned bytes;  // per lane
  bool operator==(const SiteKey& o) const {
    return pc == o.pc && file == o.file && line == o.line && kind == o.kind && bytes == o.bytes;
  }
  bool operator<(const SiteKey& o) const {
    return std::tie(pc, file, line, kind, bytes) < std::tie(o.pc, o.file, o.line, o.kind, o.bytes);
  }
};

struct SiteHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<const void*>()(k.pc) ^ (std::hash<const void*>()(k.file) * 31) ^ (k.line * 131u) ^
           (k.kind * 7919u) ^ (k.bytes << 20);
  }
};

struct Instruction {  // one warp-level instruction being assembled
  uint32_t lanes = 0;
  uintptr_t address[32];
};

struct InstructionKey {
  SiteKey site;
  uint32_t nth;
  bool operator==(const InstructionKey& o) const { return site == o.site && nth == o.nth; }
};
struct InstructionHash {
  size_t operator()(const InstructionKey& k) const { return SiteHash()(k.site) ^ (k.nth * 0x9e3779b9u); }
};

struct Counts {
  unsigned long long instructions = 0, wavefronts = 0, ideal = 0;
};

struct ProfileState {
  // Per warp of the running block: instructions not counted yet, and per lane how often it ran each site.
  std::vector<std::unordered_map<InstructionKey, Instruction, InstructionHash>> pending;
  std::vector<std::unordered_map<SiteKey, uint32_t, SiteHash>> executions;  // per thread
  std::map<SiteKey, Counts> totals;                                         // per launch
};

ProfileState g_profile;  // profile-mode launches run one block at a time, like race mode

void count(const SiteKey& site, const Instruction& in) {
  const unsigned lanes_per_phase = site.bytes >= 4 ? 128 / site.bytes : 32;
  Counts& c = g_profile.totals[site];
  ++c.instructions;
  for (unsigned phase = 0; phase < 32 / lanes_per_phase; ++phase) {
    // Distinct 32-bit words per bank in this phase.
    std::vector<uintptr_t> words[32];
    bool active = false;
    for (unsigned lane = phase * lanes_per_phase; lane < (phase + 1) * lanes_per_phase; ++lane) {
      if (!(in.lanes >> lane & 1u)) continue;
      active = true;
      for (uintptr_t word = in.address[lane] / 4; word < (in.address[lane] + std::max(site.bytes, 1u) + 3) / 4;
           ++word) {
        std::vector<uintptr_t>& bank = words[word % 32];
        if (std::find(bank.begin(), bank.end(), word) == bank.end()) bank.push_back(word);
      }
    }
    if (!active) continue;
    size_t most = 0;
    for (const std::vector<uintptr_t>& bank : words) most = std::max(most, bank.size());
    c.wavefronts += most;
    c.ideal += 1;
  }
}

// Counts a bulk copy's phases straight away (it is one instruction of one thread: nothing to gather).
void count_bulk(const SiteKey& site, const std::vector<uint32_t>& unit_offsets) {
  Counts& c = g_profile.totals[site];
  ++c.instructions;
  for (size_t first = 0; first < unit_offsets.size(); first += 8) {
    std::vector<uint32_t> words[32];
    for (size_t u = first; u < std::min(unit_offsets.size(), first + 8); ++u)
      for (uint32_t word = unit_offsets[u] / 4; word < unit_offsets[u] / 4 + 4; ++word) {
        std::vector<uint32_t>& bank = words[word % 32];
        if (std::find(bank.begin(), bank.end(), word) == bank.end()) bank.push_back(word);
      }
    size_t most = 0;
    for (const std::vector<uint32_t>& bank : words) most = std::max(most, bank.size());
    c.wavefronts += most;
    c.ideal += 1;
  }
}

void record(Fiber* f, const SiteKey& site, uintptr_t address) {
  Worker* w = f->worker;
  const uintptr_t smem = reinterpret_cast<uintptr_t>(w->view.smem);
  if (address < smem || address >= smem + w->launch->view.smem_bytes) return;  // shared memory only
  const uint32_t nth = g_profile.executions[f->index][site]++;
  Instruction& in = g_profile.pending[f->index >> 5][InstructionKey{site, nth}];
  const unsigned lane = f->index & 31;
  in.lanes |= 1u << lane;
  in.address[lane] = address - smem;  // bank = (offset / 4) % 32: the base is 1024-byte aligned
}

void on_access(uintptr_t address, unsigned bytes, bool is_write, const void* return_address) {
  Fiber* f = fiber_on_this_stack();
  if (f == nullptr) return;
  record(f, SiteKey{return_address, nullptr, 0, is_write ? kProfileStore : kProfileLoad, bytes}, address);
}

}  // namespace

void profile_warp_synchronized(Worker* w, unsigned warp) {
  (void)w;
  for (const auto& [key, in] : g_profile.pending[warp]) count(key.site, in);
  g_profile.pending[warp].clear();
}

void profile_block_begin(Worker* w) {
  g_profile.pending.assign(w->num_warps, {});
  g_profile.executions.assign(w->fibers.size(), {});
}

void profile_block_end(Worker* w) {
  for (unsigned warp = 0; warp < g_profile.pending.size(); ++warp) profile_warp_synchronized(w, warp);
}

void profile_launch_begin() { g_profile.totals.clear(); }

// One line per call site: "pc <library>\t<offset hex>" or "src <file>\t<line>", then kind, bytes,
// instructions, wavefronts, ideal, tab-separated.
std::string profile_launch_report() {
  static const char* const kKinds[] = {"load", "store", "ldmatrix", "cp.async", "tma.load", "tma.store", "wgmma.read"};
  std::string text;
  char line[4096];
  for (const auto& [site, c] : g_profile.totals) {
    if (site.pc != nullptr) {
      Dl_info info{};
      const uintptr_t pc = reinterpret_cast<uintptr_t>(site.pc) - 1;  // inside the call, not after it
      if (dladdr(reinterpret_cast<void*>(pc), &info) == 0 || info.dli_fname == nullptr) continue;
      snprintf(line, sizeof line, "pc\t%s\t%" PRIxPTR, info.dli_fname, pc - reinterpret_cast<uintptr_t>(info.dli_fbase));
    } else {
      snprintf(line, sizeof line, "src\t%s\t%u", site.file, site.line);
    }
    text += line;
    snprintf(line, sizeof line, "\t%s\t%u\t%llu\t%llu\t%llu\n", kKinds[site.kind], site.bytes, c.instructions,
             c.wavefronts, c.ideal);
    text += line;
  }
  g_profile.totals.clear();
  return text;
}

void profile_shared_access(const Site& site, const void* address, unsigned bytes, unsigned kind) {
  Fiber* f = fiber_on_this_stack();
  if (f == nullptr) return;
  record(f, SiteKey{nullptr, site.file, site.line, kind, bytes}, reinterpret_cast<uintptr_t>(address));
}

void profile_bulk_shared_access(const Site& site, const std::vector<uint32_t>& unit_offsets, unsigned kind) {
  if (fiber_on_this_stack() == nullptr) return;
  count_bulk(SiteKey{nullptr, site.file, site.line, kind, 16}, unit_offsets);
}

}  // namespace cuflash::sim

// ---- the hooks GCC's -fsanitize=thread instrumentation calls --------------------------------
#define CUFLASH_HOOK extern "C" __attribute__((visibility("default")))
using cuflash::sim::on_access;

CUFLASH_HOOK void __tsan_init() {}
CUFLASH_HOOK void __tsan_func_entry(void*) {}
CUFLASH_HOOK void __tsan_func_exit() {}
CUFLASH_HOOK void __tsan_vptr_update(void**, void*) {}
CUFLASH_HOOK void __tsan_vptr_read(void**) {}

#define CUFLASH_PROFILE_HOOKS(n)                                                                       \
  CUFLASH_HOOK void __tsan_read##n(void* p) {                                                          \
    on_access(reinterpret_cast<uintptr_t>(p), n, false, __builtin_return_address(0));                  \
  }                                                                                                    \
  CUFLASH_HOOK void __tsan_write##n(void* p) {                                                         \
    on_access(reinterpret_cast<uintptr_t>(p), n, true, __builtin_return_address(0));                   \
  }                                                                                                    \
  CUFLASH_HOOK void __tsan_volatile_read##n(void* p) {                                                 \
    on_access(reinterpret_cast<uintptr_t>(p), n, false, __builtin_return_address(0));                  \
  }                                                                                                    \
  CUFLASH_HOOK void __tsan_volatile_write##n(void* p) {                                                \
    on_access(reinterpret_cast<uintptr_t>(p), n, true, __builtin_return_address(0));                   \
  }
CUFLASH_PROFILE_HOOKS(1)
CUFLASH_PROFILE_HOOKS(2)
CUFLASH_PROFILE_HOOKS(4)
CUFLASH_PROFILE_HOOKS(8)
CUFLASH_PROFILE_HOOKS(16)

#define CUFLASH_PROFILE_UNALIGNED_HOOKS(n)                                                             \
  CUFLASH_HOOK void __tsan_unaligned_read##n(void* p) {                                                \
    on_access(reinterpret_cast<uintptr_t>(p), n, false, __builtin_return_address(0));                  \
  }                                                                                                    \
  CUFLASH_HOOK void __tsan_unaligned_write##n(void* p) {                                               \
    on_access(reinterpret_cast<uintptr_t>(p), n, true, __builtin_return_address(0));                   \
  }
CUFLASH_PROFILE_UNALIGNED_HOOKS(2)
CUFLASH_PROFILE_UNALIGNED_HOOKS(4)
CUFLASH_PROFILE_UNALIGNED_HOOKS(8)
CUFLASH_PROFILE_UNALIGNED_HOOKS(16)

// memcpy / memset ranges are not one instruction; they are not counted.
CUFLASH_HOOK void __tsan_read_range(void*, unsigned long) {}
CUFLASH_HOOK void __tsan_write_range(void*, unsigned long) {}

#else  // not profile mode: the twins' calls do nothing

namespace cuflash::sim {
void profile_shared_access(const Site&, const void*, unsigned, unsigned) {}
void profile_bulk_shared_access(const Site&, const std::vector<uint32_t>&, unsigned) {}
}  // namespace cuflash::sim

#endif  // CUFLASH_SIM_PROFILE
