// Twins of the TMA's tiled tensor copies and of the bulk reduce-add (PTX ISA: cp.async.bulk.tensor,
// cp.reduce.async.bulk, cp.async.bulk.commit_group, cp.async.bulk.wait_group{.read}; the tensor map of
// cuTensorMapEncodeTiled).
//
// Loads (global -> shared, completing on an mbarrier)
//   One thread issues a copy of the box at the given coordinates. The box has ceil(box_dim[i] /
//   element_stride[i]) elements along dimension i (element j at coordinate c + j * element_stride); in shared
//   memory it is dense, innermost dimension contiguous, each 16-byte unit placed at its swizzled shared-window
//   address (swizzled_shared_address, the model wgmma reads with). Elements outside the global dims (negative
//   coordinates included) are zeros, or NaN when the map asks for it (OOB_FILL_NAN_REQUEST_ZERO_FMA). When the
//   copy lands it completes the box's bytes (filled ones included) as tx bytes on its mbarrier.
//   The global box is read at issue; the shared bytes are written when the copy lands:
//   - normal and asan modes: at issue or at any later fiber switch of the block (seeded by copy_landing, as
//     cp.async), at the latest when its mbarrier is waited on and nothing else can run (the scheduler lands
//     loads in flight before it reports a deadlock);
//   - race mode: when a thread waits on (or polls) its mbarrier, or nothing else can run. From the issue the
//     destination is in flight (any access to it is an error naming the TMA load); the landing writes it
//     as the issuer's async-proxy write and completes the tx bytes as the issuer's release, so the threads
//     whose wait observes the phase complete are ordered after the write and others are not.
//   Loads belong to the block, not the issuing thread: a producer may exit with its loads in flight.
//
// Stores (shared -> global, bulk async-groups)
//   One thread issues a store of a box from shared memory (the same layout and swizzle) to the global tensor,
//   clipped to the global dims (out-of-bounds elements are not written). The thread's stores since its last
//   commit_group form a bulk async-group; wait_group.read N returns when all but the newest N groups have
//   finished reading their source. The source is read through the async proxy (race mode: an ordinary store
//   to it needs its writer's fence.proxy.async before the TMA store's issue) and may not be written before
//   the covering wait_group.read. The store (source read and global write together) lands in normal mode at
//   a seeded moment up to that wait, in race mode at it (a write to the source in between is an error); a
//   store never waited for lands when its thread exits. wait_group without .read (the writes complete) lands
//   the same groups.
//
// Bulk reduce-add (shared -> global, the same bulk async-groups)
//   cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], bytes: one thread adds bytes / 4
//   contiguous float32 of shared memory into as many of global memory, each element atomically (other threads'
//   and blocks' atomics to them are not races). A TmaStore of op kAddF32 (no tensor map, no swizzle): its source
//   rules and landing moments are the store's, but a covering wait_group.read only reads its source (the values
//   kept): the adds land later, at a seeded moment in normal mode, at the latest at a covering wait_group (without
//   .read) or the thread's exit, so two reduces to one element with no wait_group between them land in either
//   order (their float sums differ: a deterministic kernel's reruns do not agree bitwise). Strict: bytes a positive multiple of 16, both addresses
//   16-byte aligned (the ISA's rules), the source inside the block's shared memory, the destination inside a
//   writable buffer of the launch.
//
// Strict checks, errors naming the site: a map not made by encode_tiled (the twin's magic), a map address
// not 64-byte aligned (the ISA), a coordinate count other than the map's rank, interleaved maps (not
// modeled), a shared address not 128-byte aligned (the ISA's rule for tensor copies) or a box outside the
// block's shared memory, an mbarrier that is not initialized, global bytes outside the launch's buffers (a
// store: or read-only), a box with no element inside the tensor (the ISA fills a box's out-of-bound elements;
// what a copy none of whose elements is in bounds does, and whether it completes its bytes, no document we know
// says, and cuTile calls a tile wholly outside its array undefined: kernels issue only boxes that overlap).
#include <algorithm>
#include <cinttypes>

#include "sim_internal.h"

namespace cuflash::sim {
namespace {

constexpr uintptr_t kSharedTensorAlignment = 128;
constexpr uintptr_t kTensorMapAlignment = 64;
constexpr unsigned kSwizzleBytes[4] = {0, 32, 64, 128};

// A box walked element by element: the map, the box's first coordinates, and per element its shared offset
// (before the swizzle) and, when inside the global dims, its global address.
struct Box {
  TensorMapTwin map;
  int64_t coords[5];
  unsigned counts[5];  // elements along each dimension
  unsigned elements;
  unsigned bytes;
  unsigned swizzle_bytes;
};

const TensorMapTwin& checked_map(const Site& site, const void* map) {
  if (reinterpret_cast<uintptr_t>(map) % kTensorMapAlignment != 0)
    fail_current(format("%s: the tensor map at 0x%" PRIxPTR " is not 64-byte aligned", describe_site(site).c_str(),
                        reinterpret_cast<uintptr_t>(map)));
  const TensorMapTwin& m = *static_cast<const TensorMapTwin*>(map);
  if (m.magic != kTensorMapMagic || m.rank < 1 || m.rank > 5 || m.swizzle > 3 || m.element_bytes == 0)
    fail_current(describe_site(site) + ": the tensor map was not made by cuflash.kernels.tensor_map.encode_tiled "
                 "(pass it as a __grid_constant__ kernel parameter, unchanged)");
  if (m.interleave != 0)
    fail_current(describe_site(site) + ": interleaved tensor maps are not modeled by the simulator");
  return m;
}

Box make_box(const Site& site, const void* map, const int* coords, unsigned rank) {
  Box b;
  b.map = checked_map(site, map);
  if (rank != b.map.rank)
    fail_current(format("%s: %u coordinates for a tensor map of rank %u", describe_site(site).c_str(), rank,
                        b.map.rank));
  b.elements = 1;
  for (unsigned d = 0; d < 5; ++d) {
    b.coords[d] = d < rank ? coords[d] : 0;
    const unsigned box = d < rank ? b.map.box_dims_minus_1[d] + 1u : 1u;
    const unsigned stride = d < rank ? b.map.element_strides[d] : 1u;
    b.counts[d] = (box + stride - 1) / stride;
    b.elements *= b.counts[d];
  }
  b.bytes = b.elements * b.map.element_bytes;
  b.swizzle_bytes = kSwizzleBytes[b.map.swizzle];
  if (b.counts[0] * b.map.element_bytes % 16 != 0)
    fail_current(format("%s: the box's inner dimension holds %u bytes (element strides applied), not a multiple of "
                        "16 (not modeled)", describe_site(site).c_str(), b.counts[0] * b.map.element_bytes));
  return b;
}

// A box none of whose elements lies inside the tensor is an error (see the opening comment): along some dimension
// every coordinate it takes is outside 0 .. dim - 1.
void check_box_overlaps_tensor(const Site& site, const Box& b, const char* what) {
  const TensorMapTwin& m = b.map;
  for (unsigned d = 0; d < m.rank; ++d) {
    const int64_t first = b.coords[d];
    const int64_t last = first + static_cast<int64_t>(b.counts[d] - 1) * m.element_strides[d];
    const int64_t dim = static_cast<int64_t>(m.global_dims_minus_1[d]) + 1;
    bool any = false;
    for (int64_t c = first; c <= last && !any; c += m.element_strides[d]) any = c >= 0 && c < dim;
    if (!any)
      fail_current(format("%s: the %s's box lies wholly outside the tensor: along dimension %u (innermost 0) it takes "
                          "coordinates %" PRId64 " .. %" PRId64 " of 0 .. %" PRId64 "; issue only boxes that overlap "
                          "the tensor (what the hardware does with one that does not is undocumented)",
                          describe_site(site).c_str(), what, d, first, last, dim - 1));
  }
}

// Calls fn(shared_offset_before_swizzle, global_address_or_0) for every element of the box, in shared order.
template <class Fn> void for_each_element(const Box& b, Fn fn) {
  const TensorMapTwin& m = b.map;
  unsigned index[5] = {0, 0, 0, 0, 0};
  for (unsigned e = 0; e < b.elements; ++e) {
    bool inside = true;
    uint64_t address = m.global_address;
    for (unsigned d = 0; d < m.rank; ++d) {
      const int64_t c = b.coords[d] + static_cast<int64_t>(index[d]) * m.element_strides[d];
      inside = inside && c >= 0 && c <= static_cast<int64_t>(m.global_dims_minus_1[d]);
      address += static_cast<uint64_t>(c) * (d == 0 ? m.element_bytes : m.global_strides[d - 1]);
    }
    fn(e * m.element_bytes, inside ? address : 0);
    for (unsigned d = 0; d < 5 && ++index[d] == b.counts[d]; ++d) index[d] = 0;
  }
}

// The shared-window offset of the box's 16-byte unit `unit` (the swizzle permutes units).
unsigned unit_offset(unsigned dst_offset, unsigned unit, unsigned swizzle_bytes) {
  return swizzled_shared_address(dst_offset + 16 * unit, swizzle_bytes);
}

unsigned checked_shared_offset(const Site& site, const void* smem, unsigned bytes, const char* what,
                               uintptr_t alignment = kSharedTensorAlignment, const char* rule = "tensor copies") {
  Worker* w = current_fiber()->worker;
  const uintptr_t at = reinterpret_cast<uintptr_t>(smem);
  const uintptr_t base = reinterpret_cast<uintptr_t>(w->view.smem);
  if (at < base || at + bytes > base + w->launch->view.smem_bytes)
    fail_current(format("%s: the %s (%u bytes at 0x%" PRIxPTR ") is not inside the block's dynamic shared memory",
                        describe_site(site).c_str(), what, bytes, at));
  if ((at - base) % alignment != 0)
    fail_current(format("%s: the %s at shared byte offset %" PRIuPTR " is not %u-byte aligned (the ISA's rule for "
                        "%s)", describe_site(site).c_str(), what, at - base, static_cast<unsigned>(alignment), rule));
  return static_cast<unsigned>(at - base);
}

// The profile's view of a copy (profile_bulk_shared_access): its 16-byte units' shared offsets, in box order.
void profile_units(const Site& site, unsigned offset, const Box& box, unsigned kind) {
#if CUFLASH_SIM_PROFILE
  std::vector<uint32_t> units(box.bytes / 16);
  for (unsigned u = 0; u < units.size(); ++u) units[u] = unit_offset(offset, u, box.swizzle_bytes);
  profile_bulk_shared_access(site, units, kind);
#else
  (void)site, (void)offset, (void)box, (void)kind;
#endif
}

const Buffer* buffer_holding(const Launch* launch, uintptr_t address, unsigned bytes) {
  for (const Buffer& b : launch->buffers)
    if (address >= b.begin && address + bytes <= b.end) return &b;
  return nullptr;
}

unsigned char* smem_at(Worker* w, unsigned offset) { return static_cast<unsigned char*>(w->view.smem) + offset; }

// Lands one load: the shared bytes, then its tx bytes on the mbarrier. An error text, or empty.
std::string land_load(Worker* w, TmaLoad& load) {
  for (unsigned u = 0; u < load.image.size() / 16; ++u) {
    const unsigned at = unit_offset(load.dst_offset, u, load.swizzle_bytes);
    memcpy(smem_at(w, at), load.image.data() + 16 * u, 16);
#if CUFLASH_SIM_RACE
    race_copy_landed(load.issuer, reinterpret_cast<uintptr_t>(smem_at(w, at)), 16, true);
#endif
  }
  const std::string error = mbarrier_land_tx(w, load.issuer, load.bar_offset, load.bytes);
  if (!error.empty()) return describe_site(load.site) + ": the TMA load's " + error;
  return "";
}

void fail_block(Worker* w, bool on_fiber, const std::string& message) {
  if (on_fiber) fail_current(message);
  w->launch->record_error(w->block_linear, message + "\n  in " + describe_block(w));
  w->failed = true;
}

// The store's source read (checked at issue) and global write (a reduce-add: atomic adds), at once. Race mode: on
// the issuer's fiber.
void apply_store(Worker* w, const TmaStore& store) {
  for (const TmaStore::Element& e : store.elements) {
    const unsigned at = swizzled_shared_address(store.src_offset + e.shared, store.swizzle_bytes);
#if CUFLASH_SIM_RACE
    // The source read at the landing, as the issuer's: a write by another thread that is not ordered after the
    // covering wait (which lands it) is a race with it, as one before the wait is (race_tma_check_write).
    if (!store.source_read) race_access(reinterpret_cast<uintptr_t>(smem_at(w, at)), store.element_bytes, false);
#endif
    if (store.op == TmaStore::Op::kAddF32) {
      float v;
      if (store.source_read)
        v = store.values[&e - store.elements.data()];
      else
        memcpy(&v, smem_at(w, at), 4);
      add_f32_to_word(reinterpret_cast<float*>(e.global), v);
#if CUFLASH_SIM_RACE
      race_atomic(current_fiber(), e.global, 4);
#endif
      continue;
    }
    memcpy(reinterpret_cast<void*>(e.global), smem_at(w, at), store.element_bytes);
#if CUFLASH_SIM_RACE
    race_access(e.global, store.element_bytes, true);
#endif
  }
}

// A store that lands: its source (unless read already) and its place in flight.
void forget_store(Worker* w, const TmaStore& store) {
  if (!store.source_read) w->tma_store_source_bytes -= store.bytes;
  --w->tma_stores_in_flight;
}

// A reduce-add's source read by a covering wait_group.read: the values kept, the shared bytes free.
void read_reduce_source(Worker* w, TmaStore& store) {
  store.values.resize(store.elements.size());
  for (size_t i = 0; i < store.elements.size(); ++i) {
    const unsigned at = store.src_offset + store.elements[i].shared;
    memcpy(&store.values[i], smem_at(w, at), 4);
#if CUFLASH_SIM_RACE
    race_access(reinterpret_cast<uintptr_t>(smem_at(w, at)), 4, false);
#endif
  }
  store.source_read = true;
  w->tma_store_source_bytes -= store.bytes;
}

// Lands the thread's stores of groups below complete_below; with reads_only, a reduce-add only reads its source.
// Normal mode lands them in issue order or in reverse (a seeded bit): nothing orders two bulk operations in flight.
void wait_groups(Fiber* f, unsigned complete_below, bool reads_only) {
  std::vector<TmaStore> landing, kept;
  for (TmaStore& store : f->tma_stores) {
    if (store.group < complete_below && reads_only && store.op == TmaStore::Op::kAddF32) {
      if (!store.source_read) read_reduce_source(f->worker, store);
      kept.push_back(std::move(store));
    } else if (store.group < complete_below) {
      landing.push_back(std::move(store));
    } else {
      kept.push_back(std::move(store));
    }
  }
  f->tma_stores = std::move(kept);
#if !CUFLASH_SIM_RACE
  if (landing.size() > 1 && coin_flip(f->worker)) std::reverse(landing.begin(), landing.end());
#endif
  for (const TmaStore& store : landing) {
    apply_store(f->worker, store);
    forget_store(f->worker, store);
  }
}

}  // namespace

void tma_block_begin(Worker* w) {
  w->tma_loads.clear();
  w->tma_store_source_bytes = 0;
  w->tma_stores_in_flight = 0;
}

bool tma_loads_pending_on(const Worker* w, uint32_t bar_offset) {
  for (const TmaLoad& load : w->tma_loads)
    if (load.bar_offset == bar_offset) return true;
  return false;
}

bool tma_land_loads(Worker* w, LoadsToLand which, uint32_t bar_offset, bool on_fiber) {
  bool landed = false;
  for (size_t i = 0; i < w->tma_loads.size() && !w->failed;) {
    const bool take = which == LoadsToLand::kAll    ? true
                      : which == LoadsToLand::kSome ? coin_flip(w)
                                                    : w->tma_loads[i].bar_offset == bar_offset;
    if (!take) {
      ++i;
      continue;
    }
    TmaLoad load = std::move(w->tma_loads[i]);
    w->tma_loads.erase(w->tma_loads.begin() + static_cast<ptrdiff_t>(i));
    const std::string error = land_load(w, load);
    if (!error.empty()) {
      fail_block(w, on_fiber, error);
      return landed;
    }
    landed = true;
  }
  return landed;
}

void tma_land_some_stores(Worker* w) {
#if !CUFLASH_SIM_RACE
  for (Fiber& f : w->fibers) {
    size_t kept = 0;
    for (size_t i = 0; i < f.tma_stores.size(); ++i) {
      if (coin_flip(w)) {
        apply_store(w, f.tma_stores[i]);
        forget_store(w, f.tma_stores[i]);
      } else {
        // Not onto itself: a self-move-assigned std::vector is left empty (libstdc++), losing the store's elements.
        if (kept != i) f.tma_stores[kept] = std::move(f.tma_stores[i]);
        ++kept;
      }
    }
    f.tma_stores.resize(kept);
  }
#else
  (void)w;  // race mode lands stores at the covering wait_group.read, where it checks the source
#endif
}

void tma_thread_exit(Fiber* f) {
  for (const TmaStore& store : f->tma_stores) {
    apply_store(f->worker, store);
    forget_store(f->worker, store);
  }
  f->tma_stores.clear();
}

#if CUFLASH_SIM_RACE
std::string tma_load_site(const Worker* w, unsigned offset) {
  for (const TmaLoad& load : w->tma_loads)
    for (unsigned u = 0; u < load.bytes / 16; ++u) {
      const unsigned at = unit_offset(load.dst_offset, u, load.swizzle_bytes);
      if (offset >= at && offset < at + 16) return describe_site(load.site);
    }
  return "?";
}

void race_tma_check_write(Fiber* f, uintptr_t address, unsigned bytes) {
  Worker* w = f->worker;
  const uintptr_t base = reinterpret_cast<uintptr_t>(w->view.smem);
  for (const Fiber& issuer : w->fibers)
    for (const TmaStore& store : issuer.tma_stores)
      for (unsigned u = 0; !store.source_read && u < store.bytes / 16; ++u) {
        const uintptr_t lo = base + unit_offset(store.src_offset, u, store.swizzle_bytes);
        if (address < lo + 16 && address + bytes > lo)
          fail_current(format("writes shared byte offset %" PRIuPTR ", the source of a %s that %s issued at %s "
                              "and has not waited for with a covering cp.async.bulk.wait_group.read (it may still "
                              "be reading it)", (address > lo ? address : lo) - base,
                              store.op == TmaStore::Op::kAddF32 ? "bulk reduce-add" : "TMA store",
                              describe_thread(w, issuer.index).c_str(), describe_site(store.site).c_str()));
      }
}
#endif

void tma_load(const Site& site, void* smem_dst, const void* map, const int* coords, unsigned rank, uint64_t* bar) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  const Box box = make_box(site, map, coords, rank);
  check_box_overlaps_tensor(site, box, "TMA load");
  const unsigned dst_offset = checked_shared_offset(site, smem_dst, box.bytes, "TMA load destination");
  const uint32_t bar_offset = mbarrier_offset_for_tx(site, bar);
  profile_units(site, dst_offset, box, kProfileTmaLoad);
  TmaLoad load;
  load.issuer = f;
  load.site = site;
  load.bar_offset = bar_offset;
  load.bytes = box.bytes;
  load.dst_offset = dst_offset;
  load.swizzle_bytes = box.swizzle_bytes;
  load.image.assign(box.bytes, 0);
  const unsigned eb = box.map.element_bytes;
  // The out-of-bounds fill: zeros, or the type's canonical quiet NaN.
  unsigned char nan[8] = {0};
  if (box.map.oob_fill == 1) {
    if (eb == 2) {
      const uint16_t bits = box.map.data_type == 9 ? 0x7fc0 : 0x7e00;  // bfloat16, else float16
      memcpy(nan, &bits, 2);
    } else if (eb == 4) {
      const uint32_t bits = 0x7fffffffu;
      memcpy(nan, &bits, 4);
    } else if (eb == 8) {
      const uint64_t bits = 0x7fffffffffffffffull;
      memcpy(nan, &bits, 8);
    }
  }
  for_each_element(box, [&](unsigned shared, uint64_t global) {
    if (global == 0) {
      memcpy(load.image.data() + shared, nan, eb);
      return;
    }
    const uintptr_t src = static_cast<uintptr_t>(global);
    if (buffer_holding(w->launch, src, eb) == nullptr)
      global_access_failed(reinterpret_cast<const void*>(src), eb, false, "out of bounds (TMA load source)");
#if CUFLASH_SIM_RACE
    race_access(src, eb, false);
#endif
    memcpy(load.image.data() + shared, reinterpret_cast<const void*>(src), eb);
    w->view.bytes_read += eb;
  });
#if CUFLASH_SIM_RACE
  for (unsigned u = 0; u < box.bytes / 16; ++u)
    race_copy_issued(reinterpret_cast<uintptr_t>(smem_at(w, unit_offset(dst_offset, u, box.swizzle_bytes))), 16, true);
#else
  if (coin_flip(w)) {  // landed before the issuing instruction even retired
    const std::string error = land_load(w, load);
    if (!error.empty()) fail_current(error);
    return;
  }
#endif
  w->tma_loads.push_back(std::move(load));
}

void tma_store(const Site& site, const void* map, const void* smem_src, const int* coords, unsigned rank) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  const Box box = make_box(site, map, coords, rank);
  check_box_overlaps_tensor(site, box, "TMA store");
  TmaStore store;
  store.op = TmaStore::Op::kCopy;
  store.site = site;
  store.group = f->bulk_groups_committed;
  store.src_offset = checked_shared_offset(site, smem_src, box.bytes, "TMA store source");
  profile_units(site, store.src_offset, box, kProfileTmaStore);
  store.swizzle_bytes = box.swizzle_bytes;
  store.bytes = box.bytes;
  store.element_bytes = box.map.element_bytes;
  for_each_element(box, [&](unsigned shared, uint64_t global) {
    if (global == 0) return;  // clipped: outside the tensor nothing is written
    const uintptr_t dst = static_cast<uintptr_t>(global);
    const Buffer* b = buffer_holding(w->launch, dst, store.element_bytes);
    if (b == nullptr)
      global_access_failed(reinterpret_cast<const void*>(dst), store.element_bytes, true,
                           "out of bounds (TMA store destination)");
    if (!b->writable)
      global_access_failed(reinterpret_cast<const void*>(dst), store.element_bytes, true,
                           "to a read-only buffer (TMA store destination)");
    store.elements.push_back(TmaStore::Element{shared, dst});
    w->view.bytes_written += store.element_bytes;
  });
#if CUFLASH_SIM_RACE
  // The async proxy reads the source from the issue on: ordinary stores to it must be fenced before now.
  for (unsigned u = 0; u < box.bytes / 16; ++u) {
    const unsigned at = unit_offset(store.src_offset, u, store.swizzle_bytes);
    race_async_proxy_read(reinterpret_cast<uintptr_t>(smem_at(w, at)), 16);
  }
#endif
  w->tma_store_source_bytes += store.bytes;
  ++w->tma_stores_in_flight;
  f->tma_stores.push_back(std::move(store));
}

void bulk_reduce_add_f32(const Site& site, float* gmem_dst, const void* smem_src, unsigned bytes) {
  Fiber* f = current_fiber();
  Worker* w = f->worker;
  const uintptr_t dst = reinterpret_cast<uintptr_t>(gmem_dst);
  if (bytes == 0 || bytes % 16 != 0)
    fail_current(format("%s: the bulk reduce-add's size, %u bytes, is not a positive multiple of 16 (the ISA's rule)",
                        describe_site(site).c_str(), bytes));
  if (dst % 16 != 0)
    fail_current(format("%s: the bulk reduce-add's global destination 0x%" PRIxPTR " is not 16-byte aligned (the "
                        "ISA's rule)", describe_site(site).c_str(), dst));
  TmaStore store;
  store.op = TmaStore::Op::kAddF32;
  store.site = site;
  store.group = f->bulk_groups_committed;
  store.src_offset = checked_shared_offset(site, smem_src, bytes, "bulk reduce-add source", 16, "bulk copies");
  store.swizzle_bytes = 0;
  store.bytes = bytes;
  store.element_bytes = 4;
  const Buffer* b = buffer_holding(w->launch, dst, bytes);
  if (b == nullptr)
    global_access_failed(gmem_dst, bytes, true, "out of bounds (bulk reduce-add destination)");
  if (!b->writable)
    global_access_failed(gmem_dst, bytes, true, "to a read-only buffer (bulk reduce-add destination)");
#if CUFLASH_SIM_PROFILE
  std::vector<uint32_t> units(bytes / 16);
  for (unsigned u = 0; u < units.size(); ++u) units[u] = store.src_offset + 16 * u;
  profile_bulk_shared_access(site, units, kProfileTmaStore);  // the async proxy's shared reads, as a store's
#endif
  for (unsigned e = 0; e < bytes / 4; ++e) store.elements.push_back(TmaStore::Element{4 * e, dst + 4 * e});
  w->view.bytes_read += bytes;
  w->view.bytes_written += bytes;
#if CUFLASH_SIM_RACE
  // The async proxy reads the source from the issue on: ordinary stores to it must be fenced before now.
  race_async_proxy_read(reinterpret_cast<uintptr_t>(smem_at(w, store.src_offset)), bytes);
#endif
  w->tma_store_source_bytes += store.bytes;
  ++w->tma_stores_in_flight;
  f->tma_stores.push_back(std::move(store));
}

void tma_store_commit(const Site&) { ++current_fiber()->bulk_groups_committed; }

void tma_store_wait_read(const Site&, unsigned newest_groups_left_pending) {
  Fiber* f = current_fiber();
  if (f->bulk_groups_committed < newest_groups_left_pending) return;
  wait_groups(f, f->bulk_groups_committed - newest_groups_left_pending, true);
}

void tma_store_wait(const Site&, unsigned newest_groups_left_pending) {
  Fiber* f = current_fiber();
  if (f->bulk_groups_committed < newest_groups_left_pending) return;
  wait_groups(f, f->bulk_groups_committed - newest_groups_left_pending, false);
}

}  // namespace cuflash::sim
