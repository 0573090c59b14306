// Warpgroup collectives, wgmma in flight and setmaxnreg (the twins sim_wgmma.h declares).
//
// Warpgroup collectives
//   Like warp_collective over the 128 threads of a warpgroup (threads 128 g .. 128 g + 127): every thread
//   arrives at the same site with the same parameters (WarpgroupKey), none exited; the last to arrive acts
//   for all of them, the others wait as fibers do at a barrier. A mismatch, an exited thread, a block
//   whose size is not a multiple of 128 and a thread that exits while the others wait are errors; a
//   thread that never arrives is a deadlock (the block's deadlock report names the waiting threads).
//
// wgmma
//   One wgmma of a warpgroup is one WgmmaOp, in flight from issue until every thread's covering
//   wgmma.wait_group (commit groups are counted per thread, as cp.async's). Its result lands for all 128
//   threads at once: at issue or at a later fiber switch (normal and asan modes, drawn from the block's
//   copy_landing stream), at the latest at the first covering wait of any of its threads. Landing reads
//   the shared operands and, when accumulating, the accumulators at that moment; wgmma of one warpgroup
//   land in issue order (a chain accumulating into the same registers stays a chain). Race mode lands at
//   the first covering wait, and watches:
//     - a thread's accumulators while its wgmma is in flight: any access by the thread is an error;
//     - the shared bytes a wgmma in flight reads: a write by any thread is an error; at the landing the
//       reads go through race_wgmma_operand_read as the waiting thread's;
//     - the fence rule (a sound subset of the ISA's): a thread must execute wgmma.fence before its first
//       wgmma of the block, and a wgmma whose accumulators the thread accessed (registers that an earlier,
//       waited-for wgmma of the thread used) since its last wgmma.fence is an error. Accesses to registers
//       no wgmma has used yet are not seen (so `fence; acc = 0; wgmma(accumulate)` on fresh registers is
//       not caught).
//   wgmma.fence, commit_group and wait_group are .sync.aligned: each is checked as a warp collective (all 32
//   lanes at one site), then acts for the thread alone.
//   Numerics: products of two 16-bit values are exact in float32; each result element is summed in k
//   order (k = 0..15) in float32, starting from the accumulator (or 0). The tensor core's order and
//   rounding are unspecified: results agree with a GPU to float32 rounding, not bits.
//
// setmaxnreg
//   Each warpgroup starts with the kernel's per-thread register count, which g++ cannot know: the
//   simulator assumes the largest count that fits one block of the kernel's __launch_bounds__ maximum in
//   the 64K registers of an SM, floor(65536 / max_threads / 8) * 8, at most 256: what ptxas gives a kernel
//   with __launch_bounds__(max_threads, 1) that needs it (ptxas drops setmaxnreg when it cannot tell the
//   count at entry, so kernels using it declare such bounds). inc must not lower the count and dec must not
//   raise it (errors). The registers an inc takes come from the block's own pool, which holds only what its
//   warpgroups' dec gave back (the PTX ISA: "a pool of available registers is maintained per-CTA"), never the
//   SM's registers the launch left unallocated: an inc whose warpgroup would take the block past its launch
//   allocation (the start count x its threads; 168 x 384 = 64512 for a 384-thread block, not 65536) waits until
//   other warpgroups' dec free enough, as on a GPU, and a block where none can is a deadlock naming the
//   request. Not checked: the kernel's real register use (ptxas's business; the compile report checks the roles
//   against ptxas's launch count), registers of other blocks on the SM.
#include <cinttypes>
#include <cstring>
#include <memory>

#include "sim_internal.h"

namespace cuflash::sim {
namespace {

constexpr unsigned kWarpgroupThreads = 128;
constexpr unsigned kRegistersPerSm = 65536;

enum CollectiveKind : unsigned { kWgmma = 1, kSetmaxnregInc = 2, kSetmaxnregDec = 3 };

struct WarpgroupKey {  // what the 128 threads must agree on
  unsigned kind;
  WgmmaShape shape;  // setmaxnreg: shape.n is the register count
};

bool same_key(const WarpgroupKey& a, const WarpgroupKey& b) {
  return a.kind == b.kind && a.shape.n == b.shape.n && a.shape.bf16 == b.shape.bf16 &&
         a.shape.a_registers == b.shape.a_registers && a.shape.accumulate == b.shape.accumulate &&
         (a.shape.a_registers || a.shape.desc_a == b.shape.desc_a) && a.shape.desc_b == b.shape.desc_b &&
         a.shape.a_mn_major == b.shape.a_mn_major && a.shape.b_mn_major == b.shape.b_mn_major;
}

std::string describe_key(const WarpgroupKey& k) {
  if (k.kind != kWgmma) return format("setmaxnreg.%s %u", k.kind == kSetmaxnregInc ? "inc" : "dec", k.shape.n);
  const WgmmaShape& s = k.shape;
  std::string a = s.a_registers ? std::string("A from registers")
                                : format("desc-a 0x%016" PRIx64 "%s", s.desc_a, s.a_mn_major ? " (M-major)" : "");
  return format("m64n%uk16 %s, %s, desc-b 0x%016" PRIx64 "%s, scale-d %u", s.n, s.bf16 ? "bf16" : "f16", a.c_str(),
                s.desc_b, s.b_mn_major ? " (N-major)" : "", s.accumulate);
}

// ---- shared-memory matrix descriptors (PTX ISA, "Matrix Descriptor Format") ----------------------------
struct Descriptor {
  unsigned start;          // shared-window byte address, bits 0-13 (x >> 4)
  unsigned leading;        // leading dimension byte offset, bits 16-29
  unsigned stride;         // stride dimension byte offset, bits 32-45
  unsigned base_offset;    // bits 49-51
  unsigned swizzle_bytes;  // bits 62-63: 0 none, 1 128B, 2 64B, 3 32B
  bool mn_major;           // the instruction's imm-trans bit for this operand, not a descriptor field
};

constexpr uint64_t kReservedBits = (3ull << 14) | (3ull << 30) | (7ull << 46) | (0x3ffull << 52);

Descriptor decode(uint64_t d, bool mn_major) {
  static constexpr unsigned kSwizzle[4] = {0, 128, 64, 32};
  return Descriptor{static_cast<unsigned>(d & 0x3fff) << 4, static_cast<unsigned>((d >> 16) & 0x3fff) << 4,
                    static_cast<unsigned>((d >> 32) & 0x3fff) << 4, static_cast<unsigned>((d >> 49) & 7),
                    kSwizzle[d >> 62], mn_major};
}

// The shared-window byte address of element (row, k) of a 16-bit operand (row along M for A, N for B; k =
// 0..15), per the ISA's canonical layouts in element units, T = 8 elements (16 bytes), s = swizzle bytes / 16:
//   K-major, no swizzle:  ((8,m),(T,2k)):((1T,SBO),(1,LBO))  core matrices of 8 rows x 16 bytes, rows 16 bytes
//                         apart, the next 8 k LBO bytes on, the next 8 rows SBO bytes on;
//   K-major, swizzled:    ((8,m),(T,2k)):((sT,SBO),(1,T))    rows of 16 s bytes holding all 16 k, 8-row groups
//                         SBO apart;
//   MN-major, no swizzle: ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) core matrices of 8 k x 16 bytes (T rows), the
//                         next T rows SBO bytes on, the next 8 k LBO bytes on;
//   MN-major, swizzled:   ((T,s,m),(8,k)):((1,T,LBO),(sT,SBO)) lines of 16 s bytes holding s T rows, one line
//                         per k, the next s T rows LBO bytes on, the next 8 k SBO bytes on;
// then the swizzle of the address (swizzled_shared_address, sim_internal.h: the same model places TMA boxes).
// The swizzle acts on the address itself: with base offset 0 (the only one modeled, see check_descriptor) the
// repeating pattern starts at a 256/512/1024-byte boundary, and a start inside a pattern (a k step on) reads
// the same swizzled tile.
unsigned element_address(const Descriptor& d, unsigned row, unsigned k) {
  const unsigned s = d.swizzle_bytes / 16;  // 16-byte units per swizzled line
  unsigned a;
  if (!d.mn_major) {
    a = d.swizzle_bytes == 0 ? d.start + (row % 8) * 16 + (row / 8) * d.stride + (k % 8) * 2 + (k / 8) * d.leading
                             : d.start + (row % 8) * 16 * s + (row / 8) * d.stride + k * 2;
  } else {
    a = d.swizzle_bytes == 0 ? d.start + (row % 8) * 2 + (row / 8) * d.stride + (k % 8) * 16 + (k / 8) * d.leading
                             : d.start + (row % (8 * s)) * 2 + (row / (8 * s)) * d.leading + (k % 8) * 16 * s +
                                   (k / 8) * d.stride;
  }
  return swizzled_shared_address(a, d.swizzle_bytes);
}

// nullptr, or what is wrong with a descriptor of a `rows` x 16 operand in `smem_bytes` of shared memory.
std::string check_descriptor(uint64_t raw, bool mn_major, unsigned rows, unsigned smem_bytes) {
  if (raw & kReservedBits) return format("reserved bits set (0x%016" PRIx64 ")", raw & kReservedBits);
  const Descriptor d = decode(raw, mn_major);
  // The ISA: the base offset is 0 when the swizzle's repeating pattern starts at a boundary of its size
  // (1024 / 512 / 256 bytes), else (pattern start >> 7) & 7. How the hardware then shifts the pattern is not
  // specified, so the simulator refuses patterns off their boundary rather than guess (the no-swizzle mode
  // ignores the field).
  if (d.swizzle_bytes != 0 && d.base_offset != 0)
    return format("base offset %u: a %uB swizzle pattern that does not start at a %u-byte boundary (not modeled: "
                  "place swizzled tiles at pattern boundaries, with base offset 0)",
                  d.base_offset, d.swizzle_bytes, 8 * d.swizzle_bytes);
  for (unsigned r = 0; r < rows; ++r)
    for (unsigned k = 0; k < 16; ++k) {
      const unsigned a = element_address(d, r, k);
      if (a + 2 > smem_bytes)
        return format("element (%u, %u) at shared address 0x%x lies outside the block's %u bytes of dynamic shared "
                      "memory (start 0x%x, LBO %u, SBO %u, swizzle %uB, %s-major)",
                      r, k, a, smem_bytes, d.start, d.leading, d.stride, d.swizzle_bytes, mn_major ? "MN" : "K");
    }
  return {};
}

float element_value(unsigned short bits, bool bf16) {
  return bf16 ? bfloat16_bits_to_float(bits) : half_bits_to_float(bits);
}

// ---- per-block state -------------------------------------------------------------------------------------
struct WgmmaOp {
  Site site;
  WgmmaShape shape;
  float* acc[kWarpgroupThreads];
  unsigned a[kWarpgroupThreads][4];
  unsigned group[kWarpgroupThreads];  // each thread's commit group
  uint32_t waited[4] = {0, 0, 0, 0};
  unsigned num_waited = 0;
  bool landed = false;
  std::vector<unsigned> operand_bytes;  // race mode: shared offsets it reads, counted in operand_reads
};

struct WgmmaIo {  // what each thread brings to a wgmma
  float* acc;
  unsigned a[4];
  unsigned group;
};

struct Warpgroup {
  unsigned arrived = 0;  // threads at the collective being gathered
  Site site{};
  WarpgroupKey key{};
  const void* io[kWarpgroupThreads];
  unsigned registers = 0;  // per thread (setmaxnreg)
  unsigned requested = 0;  // a setmaxnreg.inc waiting for registers, else 0
  std::vector<std::unique_ptr<WgmmaOp>> ops;  // issue order; kept until every thread waited for it
};

struct BlockState {
  Worker* worker = nullptr;
  std::vector<Warpgroup> groups;
  unsigned register_allocation = 0;  // the block's registers at launch: setmaxnreg's per-CTA pool never exceeds it
  std::vector<uint16_t> operand_reads;  // race mode: per shared byte, how many wgmma in flight read it
};

thread_local BlockState t_block;  // one per worker: the block it runs

Warpgroup& warpgroup_of(const Site& site, Fiber* f) {
  const unsigned n = f->worker->launch->threads_per_block;
  if (n % kWarpgroupThreads != 0)
    fail_current(format("%s: a warpgroup instruction in a block of %u threads (warpgroup g is threads 128 g .. "
                        "128 g + 127: the block size must be a multiple of 128)",
                        describe_site(site).c_str(), n));
  return t_block.groups[f->index / kWarpgroupThreads];
}

void wake(Warpgroup& g, unsigned group_index, unsigned except) {
  Worker* w = t_block.worker;
  for (unsigned t = 0; t < kWarpgroupThreads; ++t) {
    Fiber& f = w->fibers[group_index * kWarpgroupThreads + t];
    if (f.index != except) f.state = FiberState::kRunnable;
  }
  g.arrived = 0;
}

// Every thread of the warpgroup deposits `io`; the last to arrive gets all 128 and acts for them (then calls
// wake), the others return nullptr once woken.
// The running thread waits at a warpgroup collective (wait_mask 0: more than one warp; describe_wait asks
// describe_warpgroup_wait) until another thread of the warpgroup sets it runnable.
void wait_for_warpgroup(const Site& site) {
  Fiber* f = current_fiber();
  f->state = FiberState::kAtCollective;
  f->wait_site = site;
  f->wait_mask = 0;
  run_others(f);
}

const void* const* warpgroup_arrive(const Site& site, const WarpgroupKey& key, const void* io) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  Warpgroup& g = warpgroup_of(site, f);
  const unsigned first = f->index / kWarpgroupThreads * kWarpgroupThreads;
  for (unsigned t = first; t < first + kWarpgroupThreads; ++t)
    if (w->fibers[t].state == FiberState::kExited)
      fail_current(format("%s: %s of this warpgroup exited; a warpgroup instruction needs all 128 threads (a hang "
                          "on a GPU)",
                          describe_site(site).c_str(), describe_thread(w, t).c_str()));
  if (g.arrived == 0) {
    g.site = site;
    g.key = key;
  } else if (!same_site(site, g.site) || !same_key(key, g.key)) {
    unsigned other = first;
    while (w->fibers[other].state != FiberState::kAtCollective) ++other;
    fail_current(format("warpgroup collective mismatch: this thread reached %s with %s while %u thread(s) of its "
                        "warpgroup (%s among them) wait at %s with %s",
                        describe_site(site).c_str(), describe_key(key).c_str(), g.arrived,
                        describe_thread(w, other).c_str(), describe_site(g.site).c_str(),
                        describe_key(g.key).c_str()));
  }
  g.io[f->index % kWarpgroupThreads] = io;
  if (++g.arrived < kWarpgroupThreads) {
    wait_for_warpgroup(site);
    return nullptr;
  }
  return g.io;
}

// ---- landing ---------------------------------------------------------------------------------------------
void land(WgmmaOp& op) {
  Worker* w = t_block.worker;
  const unsigned char* smem = w->view.smem;
  const WgmmaShape& s = op.shape;
  const bool bf16 = s.bf16 != 0;
  static thread_local float A[64][16], B[256][16];
  auto read = [&](unsigned address) {
    unsigned short bits;
    memcpy(&bits, smem + address, 2);
#if CUFLASH_SIM_RACE
    race_wgmma_operand_read(reinterpret_cast<uintptr_t>(smem + address), 2);
#endif
    return element_value(bits, bf16);
  };
  if (s.a_registers) {
    // The A fragment of the ISA's m64nNk16 register layout: warp q holds rows 16 q .. 16 q + 15 as mma.m16n8k16
    // holds its A (g = lane / 4, t = lane % 4; low half = the even column).
    for (unsigned t = 0; t < kWarpgroupThreads; ++t) {
      const unsigned row = 16 * (t / 32) + (t % 32) / 4, col = 2 * (t % 4);
      for (unsigned h = 0; h < 2; ++h) {
        A[row][col + h] = element_value(static_cast<unsigned short>(op.a[t][0] >> (16 * h)), bf16);
        A[row + 8][col + h] = element_value(static_cast<unsigned short>(op.a[t][1] >> (16 * h)), bf16);
        A[row][col + 8 + h] = element_value(static_cast<unsigned short>(op.a[t][2] >> (16 * h)), bf16);
        A[row + 8][col + 8 + h] = element_value(static_cast<unsigned short>(op.a[t][3] >> (16 * h)), bf16);
      }
    }
  } else {
    const Descriptor da = decode(s.desc_a, s.a_mn_major != 0);
    for (unsigned r = 0; r < 64; ++r)
      for (unsigned k = 0; k < 16; ++k) A[r][k] = read(element_address(da, r, k));
  }
  const Descriptor db = decode(s.desc_b, s.b_mn_major != 0);
  for (unsigned r = 0; r < s.n; ++r)
    for (unsigned k = 0; k < 16; ++k) B[r][k] = read(element_address(db, r, k));
  // Accumulator i of thread t (warp q, lane l): row 16 q + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4)
  // + i % 2: each warp's 16 rows in mma.m16n8's C layout, N / 8 such tiles side by side.
  for (unsigned t = 0; t < kWarpgroupThreads; ++t) {
    float* acc = op.acc[t];
    const unsigned q = t / 32, l = t % 32;
    for (unsigned i = 0; i < s.n / 2; ++i) {
      const unsigned row = 16 * q + l / 4 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
      float sum = s.accumulate ? acc[i] : 0.f;
      for (unsigned k = 0; k < 16; ++k) sum += A[row][k] * B[col][k];
      acc[i] = sum;
    }
  }
  for (unsigned b : op.operand_bytes) --t_block.operand_reads[b];
  w->wgmma_operand_bytes -= op.operand_bytes.size();
  op.operand_bytes.clear();
  op.landed = true;
  --w->wgmma_in_flight;
}

// Lands `op` and every earlier wgmma of its warpgroup still in flight, in issue order.
void land_through(Warpgroup& g, const WgmmaOp* op) {
  for (auto& o : g.ops) {
    if (!o->landed) land(*o);
    if (o.get() == op) return;
  }
}

// Thread `f` no longer waits for `op` (its covering wait, or its exit); an op every thread left is dropped.
void finish_for_thread(Warpgroup& g, WgmmaOp& op, Fiber* f) {
  const unsigned local = f->index % kWarpgroupThreads;
  op.waited[local / 32] |= 1u << (local % 32);
  ++op.num_waited;
  std::vector<RegisterWatch>& watch = f->wgmma.watch;
  for (size_t i = 0; i < watch.size(); ++i) {
    if (watch[i].op != &op) continue;
    bool known = false;  // keep one entry per range
    for (const RegisterWatch& other : watch)
      known = known || (&other != &watch[i] && other.op == nullptr && other.lo == watch[i].lo && other.hi == watch[i].hi);
    if (known) {
      watch.erase(watch.begin() + static_cast<long>(i));
      --i;
    } else {
      watch[i].op = nullptr;
      watch[i].touched = false;
    }
  }
  (void)g;
}

void drop_finished(Warpgroup& g) {
  size_t kept = 0;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i]->num_waited < kWarpgroupThreads) g.ops[kept++] = std::move(g.ops[i]);
  g.ops.resize(kept);
}

bool waited_by(const WgmmaOp& op, unsigned local) { return op.waited[local / 32] >> (local % 32) & 1u; }

unsigned registers_held(unsigned except_group, unsigned except_count) {
  unsigned total = 0;
  for (size_t i = 0; i < t_block.groups.size(); ++i)
    total += (i == except_group ? except_count : t_block.groups[i].registers) * kWarpgroupThreads;
  return total;
}

}  // namespace

// ---- runtime hooks (sim_internal.h) ---------------------------------------------------------------------
void wgmma_block_begin(Worker* w) {
  t_block.worker = w;
  t_block.groups.clear();
  t_block.register_allocation = 0;
  const unsigned n = w->launch->threads_per_block;
  if (n % kWarpgroupThreads == 0) {
    t_block.groups.resize(n / kWarpgroupThreads);
    unsigned initial = kRegistersPerSm / w->launch->launch_bound_threads / 8 * 8;
    if (initial > 256) initial = 256;
    for (Warpgroup& g : t_block.groups) g.registers = initial;
    t_block.register_allocation = initial * n;
  }
  t_block.operand_reads.clear();
  w->wgmma_in_flight = 0;
  w->wgmma_operand_bytes = 0;
}

void wgmma_land_some(Worker* w) {
#if !CUFLASH_SIM_RACE
  for (Warpgroup& g : t_block.groups)
    for (auto& op : g.ops) {
      if (op->landed) continue;
      if (!coin_flip(w)) break;  // later ones land after this one
      land(*op);
    }
#else
  (void)w;  // race mode lands at the covering wait, where it checks the ordering
#endif
}

void wgmma_thread_exit(Fiber* f) {
  if (t_block.groups.empty()) return;
  Warpgroup& g = t_block.groups[f->index / kWarpgroupThreads];
  if (g.arrived != 0 && g.requested == 0)
    fail_current(format("this thread exited while %u thread(s) of its warpgroup wait for it at %s: a hang on a GPU",
                        g.arrived, describe_site(g.site).c_str()));
  // Its wgmma still complete on a GPU: they land now if they have not.
  const unsigned local = f->index % kWarpgroupThreads;
  for (auto& op : g.ops)
    if (!waited_by(*op, local)) {
      land_through(g, op.get());
      finish_for_thread(g, *op, f);
    }
  drop_finished(g);
}

std::string describe_warpgroup_wait(const Worker*, const Fiber& f) {
  const Warpgroup& g = t_block.groups[f.index / kWarpgroupThreads];
  if (g.requested != 0)
    return format("waits at %s for registers: its warpgroup asks for %u per thread, the block's warpgroups hold %u "
                  "of the %u it was launched with",
                  describe_site(f.wait_site).c_str(), g.requested, registers_held(~0u, 0), t_block.register_allocation);
  return format("waits at %s for the rest of warpgroup %u (%u of 128 threads arrived)", describe_site(f.wait_site).c_str(),
                f.index / kWarpgroupThreads, g.arrived);
}

#if CUFLASH_SIM_RACE
void race_wgmma_check_access(Fiber* f, uintptr_t address, unsigned bytes, bool is_write) {
  for (RegisterWatch& watch : f->wgmma.watch) {
    if (address >= watch.hi || address + bytes <= watch.lo) continue;
    if (watch.op != nullptr) {
      const WgmmaOp* op = static_cast<const WgmmaOp*>(watch.op);
      fail_current(format("wgmma accumulators in flight: this thread %s accumulator %u of the wgmma issued at %s "
                          "before the wgmma.wait_group that covers it",
                          is_write ? "writes" : "reads", static_cast<unsigned>((address - watch.lo) / 4),
                          describe_site(op->site).c_str()));
    }
    watch.touched = true;
  }
  Worker* w = f->worker;
  if (!is_write || w->wgmma_operand_bytes == 0) return;
  const uintptr_t smem = reinterpret_cast<uintptr_t>(w->view.smem);
  for (uintptr_t p = address; p < address + bytes; ++p) {
    if (p < smem || p >= smem + t_block.operand_reads.size() || t_block.operand_reads[p - smem] == 0) continue;
    const unsigned offset = static_cast<unsigned>(p - smem);
    std::string site = "?";
    for (const Warpgroup& g : t_block.groups)
      for (const auto& op : g.ops)
        for (unsigned b : op->operand_bytes)
          if (b == offset) site = describe_site(op->site);
    fail_current(format("shared memory byte offset %u written while the wgmma issued at %s reads it (in flight until "
                        "the wgmma.wait_group that covers it)",
                        offset, site.c_str()));
  }
}
#endif

// ---- the instructions --------------------------------------------------------------------------------------
void wgmma_issue(const Site& site, const WgmmaShape& shape, float* acc, const unsigned* a_registers) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  if (shape.n < 8 || shape.n > 256 || shape.n % 8 != 0)
    fail_current(format("%s: N = %u (m64nNk16 takes N a multiple of 8 in 8..256)", describe_site(site).c_str(), shape.n));
#if CUFLASH_SIM_RACE
  if (f->wgmma.fences == 0)
    fail_current(format("%s: this thread issues a wgmma without a wgmma.fence before it (the ISA requires one before "
                        "the first wgmma.mma_async and between register accesses and a wgmma using those registers)",
                        describe_site(site).c_str()));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(acc), hi = lo + shape.n / 2 * sizeof(float);
  for (const RegisterWatch& watch : f->wgmma.watch)
    if (watch.op == nullptr && watch.touched && lo < watch.hi && watch.lo < hi)
      fail_current(format("%s: this thread accessed the accumulator registers of this wgmma since its last "
                          "wgmma.fence (the ISA requires wgmma.fence between register accesses and a wgmma using "
                          "those registers)",
                          describe_site(site).c_str()));
#endif
  WgmmaIo io{acc, {0, 0, 0, 0}, f->wgmma.groups_committed};
  if (a_registers != nullptr) memcpy(io.a, a_registers, sizeof io.a);
  const void* const* all = warpgroup_arrive(site, WarpgroupKey{kWgmma, shape}, &io);
  if (all == nullptr) return;
  // The last thread to arrive: check the operands, put the wgmma in flight.
  const unsigned smem_bytes = w->launch->view.smem_bytes;
  if (!shape.a_registers) {
    const std::string why = check_descriptor(shape.desc_a, shape.a_mn_major != 0, 64, smem_bytes);
    if (!why.empty()) fail_current(describe_site(site) + ": the descriptor of A: " + why);
  }
  {
    const std::string why = check_descriptor(shape.desc_b, shape.b_mn_major != 0, shape.n, smem_bytes);
    if (!why.empty()) fail_current(describe_site(site) + ": the descriptor of B: " + why);
  }
#if CUFLASH_SIM_PROFILE
  // The shared operands' reads, core matrix by core matrix (sim_profile.cpp): 8 rows (M or N) of the 8 k of a
  // k-half, K-major; 8 k of the 8 rows (M or N) of a row group, MN-major. One instruction per operand.
  auto profile_operand = [&](uint64_t raw, bool mn_major, unsigned rows) {
    const Descriptor d = decode(raw, mn_major);
    std::vector<uint32_t> units;
    units.reserve(rows * 2);
    for (unsigned group = 0; group < rows / 8; ++group)
      for (unsigned half = 0; half < 2; ++half)
        for (unsigned i = 0; i < 8; ++i)
          units.push_back(mn_major ? element_address(d, 8 * group, 8 * half + i)
                                   : element_address(d, 8 * group + i, 8 * half));
    profile_bulk_shared_access(site, units, kProfileWgmmaRead);
  };
  if (!shape.a_registers) profile_operand(shape.desc_a, shape.a_mn_major != 0, 64);
  profile_operand(shape.desc_b, shape.b_mn_major != 0, shape.n);
#endif
  auto op = std::make_unique<WgmmaOp>();
  op->site = site;
  op->shape = shape;
  for (unsigned t = 0; t < kWarpgroupThreads; ++t) {
    const WgmmaIo* in = static_cast<const WgmmaIo*>(all[t]);
    op->acc[t] = in->acc;
    memcpy(op->a[t], in->a, sizeof in->a);
    op->group[t] = in->group;
  }
  Warpgroup& g = t_block.groups[f->index / kWarpgroupThreads];
  const unsigned group_index = f->index / kWarpgroupThreads;
#if CUFLASH_SIM_RACE
  if (t_block.operand_reads.size() != smem_bytes) t_block.operand_reads.assign(smem_bytes, 0);
  auto mark = [&](const Descriptor& d, unsigned rows) {
    for (unsigned r = 0; r < rows; ++r)
      for (unsigned k = 0; k < 16; ++k)
        for (unsigned b = 0; b < 2; ++b) {
          const unsigned offset = element_address(d, r, k) + b;
          ++t_block.operand_reads[offset];
          op->operand_bytes.push_back(offset);
        }
  };
  if (!shape.a_registers) mark(decode(shape.desc_a, shape.a_mn_major != 0), 64);
  mark(decode(shape.desc_b, shape.b_mn_major != 0), shape.n);
  w->wgmma_operand_bytes += op->operand_bytes.size();
  for (unsigned t = 0; t < kWarpgroupThreads; ++t) {
    const uintptr_t a_lo = reinterpret_cast<uintptr_t>(op->acc[t]);
    w->fibers[group_index * kWarpgroupThreads + t].wgmma.watch.push_back(
        RegisterWatch{a_lo, a_lo + shape.n / 2 * sizeof(float), op.get(), false});
  }
#endif
  WgmmaOp* issued = op.get();
  g.ops.push_back(std::move(op));
  ++w->wgmma_in_flight;
#if !CUFLASH_SIM_RACE
  if (coin_flip(w)) land_through(g, issued);  // landed before the issuing instruction even retired
#else
  (void)issued;
#endif
  wake(g, group_index, f->index);
}

// wgmma.fence, commit_group and wait_group are .sync.aligned: the whole warp executes each one together.
const char* converged(unsigned, LaneIO*) { return nullptr; }
void warp_converged(const Site& site) {
  warp_collective(site, 0xffffffffu, &converged, kCollectiveNone, nullptr, 0, nullptr, 0);
}

void wgmma_fence(const Site& site) {
  warp_converged(site);
  Fiber* f = current_fiber();
  ++f->wgmma.fences;
  for (RegisterWatch& watch : f->wgmma.watch) watch.touched = false;
}

void wgmma_commit(const Site& site) {
  warp_converged(site);
  ++current_fiber()->wgmma.groups_committed;
}

void wgmma_wait(const Site& site, unsigned newest_groups_left_pending) {
  warp_converged(site);
  Fiber* f = current_fiber();
  if (t_block.groups.empty() || f->wgmma.groups_committed < newest_groups_left_pending) return;
  const unsigned complete_below = f->wgmma.groups_committed - newest_groups_left_pending;
  const unsigned local = f->index % kWarpgroupThreads;
  Warpgroup& g = t_block.groups[f->index / kWarpgroupThreads];
  for (auto& op : g.ops) {
    if (waited_by(*op, local) || op->group[local] >= complete_below) continue;
    if (!op->landed) land_through(g, op.get());
    finish_for_thread(g, *op, f);
  }
  drop_finished(g);
}

unsigned wgmma_descriptor_start(const Site& site, const void* smem, unsigned leading_byte_offset,
                                unsigned stride_byte_offset) {
  Worker* w = current_fiber()->worker;
  const uintptr_t base = reinterpret_cast<uintptr_t>(w->view.smem);
  const uintptr_t at = reinterpret_cast<uintptr_t>(smem);
  if (at < base || at >= base + w->launch->view.smem_bytes)
    fail_current(describe_site(site) + ": the pointer is not inside the block's dynamic shared memory");
  const unsigned start = static_cast<unsigned>(at - base);
  if (start % 16 != 0)
    fail_current(format("%s: start address 0x%x is not 16-byte aligned (a descriptor encodes address bits 4..17)",
                        describe_site(site).c_str(), start));
  for (unsigned offset : {leading_byte_offset, stride_byte_offset})
    if (offset % 16 != 0 || offset >= (1u << 18))
      fail_current(format("%s: byte offset %u is not a multiple of 16 below 2^18 (a descriptor encodes bits 4..17)",
                          describe_site(site).c_str(), offset));
  return start;
}

void setmaxnreg(const Site& site, unsigned count, bool increase) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  const WarpgroupKey key{increase ? kSetmaxnregInc : kSetmaxnregDec, WgmmaShape{count, 0, 0, 0, 0, 0, 0, 0}};
  if (warpgroup_arrive(site, key, nullptr) == nullptr) return;
  const unsigned group_index = f->index / kWarpgroupThreads;
  Warpgroup& g = t_block.groups[group_index];
  if (increase ? count < g.registers : count > g.registers)
    fail_current(format("%s: setmaxnreg.%s %u, but the warpgroup holds %u registers per thread (inc may not lower the "
                        "count, dec may not raise it)",
                        describe_site(site).c_str(), increase ? "inc" : "dec", count, g.registers));
  if (!increase) {
    g.registers = count;
    wake(g, group_index, f->index);
    // Freed registers may let waiting warpgroups go on.
    for (size_t i = 0; i < t_block.groups.size(); ++i) {
      Warpgroup& other = t_block.groups[i];
      if (other.requested == 0 ||
          registers_held(static_cast<unsigned>(i), other.requested) > t_block.register_allocation)
        continue;
      other.registers = other.requested;
      other.requested = 0;
      wake(other, static_cast<unsigned>(i), f->index);
    }
    return;
  }
  if (registers_held(group_index, count) <= t_block.register_allocation) {
    g.registers = count;
    wake(g, group_index, f->index);
    return;
  }
  g.requested = count;  // wait, with the other 127, for a dec elsewhere
  wait_for_warpgroup(site);
}

}  // namespace cuflash::sim
