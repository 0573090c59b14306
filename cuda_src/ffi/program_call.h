// program_call.h: decoding one XLA custom call that runs one launch-plan Program.
//
// Shared by the CPU handler (the simulator) and the CUDA handler, so the part CI
// exercises on the CPU (attribute decoding, buffer binding, extent checks, params
// patching) is the very code a GPU runs.
//
// What Python (cuflash/jax/_lowering.py) puts into the HLO, all plain data:
//   params     u8[sizeof(AttentionParams)]  the struct packed by cuflash.kernels.params.pack_params
//                                           with every pointer field zero (addresses are per process
//                                           and per run, so they must never be baked into the HLO)
//   bindings   "q,k,v,out,lse,..."          the AttentionParams pointer field bound to each operand,
//                                           then to each result (scratch buffers are extra results)
//   zero_init  u8[num results]               1: the program accumulates into this result, clear it first
//   kernels    "name;name;..."               the kernel of each launch, by C++ name expression
//   grid, block  i32[3 * launches]           launch dimensions (x, y, z)
//   smem       i32[launches]                 dynamic shared memory bytes of each launch
//   tma_tensors            "q,k,v[,dout]"/"" the bound tensor of each TMA tensor map (AttentionParams.tma's member
//                                           of the same name); "": none, params' tma_loads is 0
//   tma_arguments          i64[25 * maps]    per map, cuTensorMapEncodeTiled's arguments but the address
//                                           (cuflash/kernels/tensor_map.py, tiled_argument_words: TiledArguments)
//   tma_twin_address_at    i64               where the simulator twin's map holds its address
//   tma_address_alignment  i64               what a tensor's address needs for TMA (else that call: tma_loads 0)
// With maps, params carries tma_loads = 1 and the twins' encodings with address 0 (backends/program.py's TmaMaps,
// the CuPy / NumPy path's own decision and encoding); per call the CPU handler patches each tensor's address into
// its twin (PatchTwinTmaMaps), the CUDA handler has the driver encode each map anew.
// Kernels are resolved by name at run time from a registry Python fills while
// lowering, so an executable from JAX's persistent cache finds them in another process.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/attention_params.cuh"
#include "ffi/ffi_abi.h"
#include "xla/ffi/api/ffi.h"

namespace cuflash::ffi_handlers {

namespace ffi = xla::ffi;

static_assert(std::is_standard_layout_v<AttentionParams> && std::is_trivially_copyable_v<AttentionParams>,
              "AttentionParams is patched with offsetof and copied as bytes");

enum class FieldKind {
  kTensor,     // element-typed (batch, seqlen, heads, headdim) tensor
  kSide,       // float32 side buffer
  kFlexSide,   // a flex mod's side array: any element type, reach from its SideArray's shape and strides
  kFlexGrad,   // float32 gradient of flex side i: the side's shape, contiguous
  kFlexTiles,  // int32 words of a block mask's tile lists (their extent is the Python lowering's: it sizes them)
  kFlexShard,  // int32 {first batch, first query head} of a sharded call's shard (flex::Shard): two words or more
};

struct PointerField {
  const char* name;
  std::size_t offset;
  FieldKind kind;
  int flex_side = -1;  // kFlexSide / kFlexGrad: which side
  bool is_tensor() const { return kind == FieldKind::kTensor; }
};

// From the header's X-macro lists: element tensors first, then the float32 side buffers, then the flex fields
// (cuflash.flex: the mods' side arrays, their gradients and the tile lists; cuflash/jax/_flex.py binds them as
// "flex_side<i>", "flex_side_grad<i>", "flex_tiles_<kv|q>_<counts|indices|full>", the same fields
// PreparedProgram.run fills on the NumPy / CuPy path; and a sharded call's "flex_shard_origin", JAX's only).
#define CUFLASH_TENSOR_POINTER_FIELD(name, side, width, access) {#name, offsetof(AttentionParams, name), FieldKind::kTensor},
#define CUFLASH_SIDE_POINTER_FIELD(name) {#name, offsetof(AttentionParams, name), FieldKind::kSide},
#define CUFLASH_FLEX_SIDE_FIELDS(i)                                                                         \
  {"flex_side" #i, offsetof(AttentionParams, flex_sides) + i * sizeof(flex::SideArray) +                     \
                       offsetof(flex::SideArray, data), FieldKind::kFlexSide, i},                            \
  {"flex_side_grad" #i, offsetof(AttentionParams, flex_side_grads) + i * sizeof(float*), FieldKind::kFlexGrad, i},
#define CUFLASH_FLEX_TILE_FIELDS(member)                                                                    \
  {"flex_tiles_" #member "_counts", offsetof(AttentionParams, flex_tiles) + offsetof(flex::TileLists, member) + \
                                         offsetof(flex::TileVisits, counts), FieldKind::kFlexTiles},          \
  {"flex_tiles_" #member "_indices", offsetof(AttentionParams, flex_tiles) + offsetof(flex::TileLists, member) + \
                                          offsetof(flex::TileVisits, indices), FieldKind::kFlexTiles},        \
  {"flex_tiles_" #member "_full", offsetof(AttentionParams, flex_tiles) + offsetof(flex::TileLists, member) + \
                                       offsetof(flex::TileVisits, full), FieldKind::kFlexTiles},
static_assert(flex::kMaxSides == 4, "the flex side fields below name sides 0..3");
inline constexpr PointerField kPointerFields[] = {
    CUFLASH_PARAMS_TENSORS(CUFLASH_TENSOR_POINTER_FIELD) CUFLASH_PARAMS_SIDE_BUFFERS(CUFLASH_SIDE_POINTER_FIELD)
    CUFLASH_FLEX_SIDE_FIELDS(0) CUFLASH_FLEX_SIDE_FIELDS(1) CUFLASH_FLEX_SIDE_FIELDS(2) CUFLASH_FLEX_SIDE_FIELDS(3)
    CUFLASH_FLEX_TILE_FIELDS(kv) CUFLASH_FLEX_TILE_FIELDS(q)
    {"flex_shard_origin", offsetof(AttentionParams, flex_shard) + offsetof(flex::Shard, origin),
     FieldKind::kFlexShard}};
#undef CUFLASH_TENSOR_POINTER_FIELD
#undef CUFLASH_SIDE_POINTER_FIELD
#undef CUFLASH_FLEX_SIDE_FIELDS
#undef CUFLASH_FLEX_TILE_FIELDS

// The bytes a flex side (or its gradient, float32 and contiguous) reaches, from the SideArray the params carry.
inline unsigned long long FlexSideReach(const AttentionParams& p, const PointerField& field, std::size_t element_bytes) {
  const flex::SideArray& side = p.flex_sides.arrays[field.flex_side];
  long long last = 0, count = 1;
  for (int d = 0; d < flex::kMaxSideDims; ++d) {
    // dims past the side's own are 0 in shape and stride (params.sides_struct)
    int extent = side.shape[d] > 0 ? side.shape[d] : 1;
    last += (extent - 1) * side.strides[d];
    count *= extent;
  }
  if (field.kind == FieldKind::kFlexGrad) return static_cast<unsigned long long>(count) * 4;
  return static_cast<unsigned long long>(last + 1) * element_bytes;
}

inline const PointerField* FindPointerField(std::string_view name) {
  for (const PointerField& field : kPointerFields)
    if (name == field.name) return &field;
  return nullptr;
}

struct BoundBuffer {
  const PointerField* field;
  void* data;
  std::size_t bytes;
  long long leading_extent;  // the buffer's first dimension (1 for a scalar): a paged cache's page count
  bool is_result;
  bool zero_init;
  std::size_t element_bytes;
};

struct KernelLaunch {
  std::string name;  // C++ name expression, the registry key
  unsigned grid[3];
  unsigned block[3];
  unsigned dynamic_smem_bytes;
};

// cuTensorMapEncodeTiled's arguments but the address, as Python lays them (tensor_map.tiled_argument_words): the
// driver's order, the per-dimension lists padded to rank 5.
struct TiledArguments {
  static constexpr std::size_t kWords = 25;
  int64_t data_type, rank;
  int64_t global_dims[5], global_strides[4], box_dims[5], element_strides[5];
  int64_t interleave, swizzle, l2_promotion, oob_fill;
};
static_assert(sizeof(TiledArguments) == TiledArguments::kWords * sizeof(int64_t), "one int64 word per argument");

// One TMA tensor map a call fills per execution.
struct TmaMapPlan {
  const PointerField* tensor;  // the bound tensor it describes
  std::size_t binding;         // that tensor's index among the call's buffers
  std::size_t map_at;          // the map's offset in AttentionParams
  TiledArguments arguments;
};

// What a call's attributes say, decoded and checked once per compiled call (the handlers' instantiate stage):
// params with every pointer field null, the field each operand and result binds, and the launches.
struct ProgramPlan {
  AttentionParams params;
  std::vector<const PointerField*> bindings;  // operands first, then results
  std::vector<uint8_t> zero_init;             // one entry per result
  std::vector<KernelLaunch> launches;
  bool packed = false;  // varlen: cu_seqlens_q is bound (TensorLayout)
  bool paged = false;   // paged KV cache: block_table is bound and page_size > 0 (TensorLayout)
  std::vector<TmaMapPlan> tma_maps;   // none: params' tma_loads is 0
  std::size_t tma_twin_address_at = 0;
  uint64_t tma_address_alignment = 16;
};

// The TMA attributes, as the instantiate stages bind them.
struct TmaAttributes {
  std::string_view tensors;
  ffi::Span<const int64_t> arguments;
  int64_t twin_address_at;
  int64_t address_alignment;
};

// Where AttentionParams.tma holds the map of tensor `name` (q, k, v or dout); false for any other name.
inline bool TmaMapOffset(std::string_view name, std::size_t* offset) {
  const std::size_t tma = offsetof(AttentionParams, tma);
  if (name == "q") *offset = tma + offsetof(TmaMaps, q);
  else if (name == "k") *offset = tma + offsetof(TmaMaps, k);
  else if (name == "v") *offset = tma + offsetof(TmaMaps, v);
  else if (name == "dout") *offset = tma + offsetof(TmaMaps, dout);
  else return false;
  return true;
}

// One execution of a plan (the execute stage): its buffers, checked, and params carrying their addresses.
struct ProgramCall {
  AttentionParams params;
  std::vector<BoundBuffer> buffers;
};

// The XLA FFI type id of a handler's state type, fixed in advance instead of assigned by XLA at registration.
// Registering a type with a nonzero id is allowed (XLA checks that a name keeps its id), and it has to be known
// early: an instantiate handler reports its state type id when XLA registers the handler, and JAX's CPU client
// replays deferred handler registrations before deferred type registrations (a target registered before JAX
// started its CPU backend would otherwise fail the backend's start). A 64-bit FNV-1a hash of the type's name,
// with bit 62 set, stays clear of the small ids XLA hands out from its counter.
constexpr int64_t FixedStateTypeId(std::string_view type_name) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : type_name) hash = (hash ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return static_cast<int64_t>((hash & 0x3fffffffffffffffull) | (1ull << 62));
}

// Fills a platform's handler bundle (ffi_abi.h): its two stages and the state type they share.
template <class State>
int FillHandlerBundle(cuflash_ffi_handler_bundle* bundle, XLA_FFI_Handler* instantiate, XLA_FFI_Handler* execute,
                      const XLA_FFI_TypeInfo& state_type_info) {
  bundle->instantiate = reinterpret_cast<void*>(instantiate);
  bundle->execute = reinterpret_cast<void*>(execute);
  bundle->state_type_name = State::kTypeName;
  bundle->state_type_id = &State::id;
  bundle->state_type_info = const_cast<XLA_FFI_TypeInfo*>(&state_type_info);
  return 1;
}

inline std::vector<std::string_view> Split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  if (text.empty()) return parts;
  std::size_t start = 0;
  while (true) {
    std::size_t end = text.find(separator, start);
    parts.push_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return parts;
}

inline ffi::Error Invalid(std::string message) {
  return ffi::Error::InvalidArgument("cuflash custom call: " + std::move(message));
}

// (batch, rows, heads, headdim) extents and the strides of a tensor field, from the params themselves.
struct TensorGeometry {
  long long extents[4];
  TensorStrides strides;
};

// How a call lays its tensors out beyond what each tensor's own params say.
struct TensorLayout {
  bool packed;            // varlen (cu_seqlens bound): (total, heads, headdim) tensors
  bool paged;             // paged KV cache (page_size > 0 and block_table bound): k and v hold pages
  long long cache_pages;  // paged: the page count of the tensor's buffer
};

inline bool TensorGeometryOf(const AttentionParams& p, std::string_view name, const TensorLayout& layout,
                             TensorGeometry* geometry) {
  struct Entry {
    const char* name;
    TensorStrides AttentionParams::*strides;
    bool query_side;   // (batch, seqlen_q, nheads, width); else (batch, seqlen_k, nheads_k, width)
    bool value_width;  // width headdim_v (v, out, dout, dv); else headdim
  };
#define CUFLASH_TENSOR_GEOMETRY(name, side, width, access) \
  {#name, &AttentionParams::name##_stride, CUFLASH_PARAMS_IS_QUERY_##side, CUFLASH_PARAMS_IS_VALUE_WIDTH_##width},
  static constexpr Entry kTensors[] = {CUFLASH_PARAMS_TENSORS(CUFLASH_TENSOR_GEOMETRY)};
#undef CUFLASH_TENSOR_GEOMETRY
  for (const Entry& entry : kTensors) {
    if (name != entry.name) continue;
    // Varlen tensors (packed: cu_seqlens bound) are (total, heads, headdim), one "batch" of all rows
    // (block_info.cuh). Whether the cu_seqlens stay inside them is data the handler does not read (the Python
    // entry points check it where the values are concrete).
    const bool packed = layout.packed;
    geometry->extents[0] = packed ? 1 : p.batch;
    geometry->extents[1] = packed ? (entry.query_side ? p.total_q : p.total_k) : entry.query_side ? p.seqlen_q : p.seqlen_k;
    geometry->extents[2] = entry.query_side ? p.nheads : p.nheads_k;
    geometry->extents[3] = entry.value_width ? p.headdim_v : p.headdim;
    geometry->strides = p.*entry.strides;
    // A paged cache's k and v are (num_pages, page_size, nheads_k, headdim), the page stride in the batch stride
    // (attention_params.cuh's block_table, block_info.cuh's KeyRows). Which pages a sequence reads is data (the
    // block_table) the handler does not read, so the check covers every page of the buffer.
    if (layout.paged && (name == "k" || name == "v")) {
      geometry->extents[0] = layout.cache_pages;
      geometry->extents[1] = p.page_size;
    }
    return true;
  }
  return false;
}

// A tensor's kernel reach (last element touched + 1) must lie inside the buffer XLA gave us:
// a mismatch between the params attribute and the operand shapes would otherwise be an
// out-of-bounds access on the GPU.
inline ffi::Error CheckTensorExtent(const AttentionParams& p, const BoundBuffer& buffer, const TensorLayout& layout,
                                    std::size_t element_bytes) {
  TensorGeometry g;
  if (!TensorGeometryOf(p, buffer.field->name, layout, &g))
    return Invalid(std::string(buffer.field->name) + " is not a tensor field");
  const long long* extents = g.extents;
  const TensorStrides& strides = g.strides;
  for (int d = 0; d < 4; ++d)
    if (extents[d] <= 0) return ffi::Error::Success();  // nothing is touched
  if (strides.batch < 0 || strides.row < 0 || strides.head < 0)
    return Invalid(std::string("negative stride for ") + buffer.field->name);
  const long long last = (extents[0] - 1) * strides.batch + (extents[1] - 1) * strides.row +
                         (extents[2] - 1) * strides.head + extents[3];
  const unsigned long long needed = static_cast<unsigned long long>(last) * element_bytes;
  if (needed > buffer.bytes)
    return Invalid(std::string(buffer.field->name) + " needs " + std::to_string(needed) + " bytes for shape (" +
                   std::to_string(extents[0]) + ", " + std::to_string(extents[1]) + ", " +
                   std::to_string(extents[2]) + ", " + std::to_string(extents[3]) + ") and its strides, but its buffer has " +
                   std::to_string(buffer.bytes));
  return ffi::Error::Success();
}

#ifndef CUFLASH_VERSION
#error "the FFI library is built with -DCUFLASH_VERSION=\"<cuflash version>\" (cuflash/jax/_ffi.py)"
#endif

// The Python resolver (ffi_abi.h): registers a kernel this process never lowered. Called without locks held.
inline std::atomic<cuflash_ffi_resolver>& KernelResolver() {
  static std::atomic<cuflash_ffi_resolver> resolver{nullptr};
  return resolver;
}
inline bool ResolveKernel(const std::string& name, const std::string& target) {
  cuflash_ffi_resolver resolver = KernelResolver().load();
  return resolver != nullptr && resolver(name.c_str(), target.c_str()) == 0;
}

// The instantiate stage's half: everything the attributes alone determine. Operands and results are not known
// here (XLA's CPU runtime instantiates with attributes only), so their count and types are checked per call.
inline ffi::Error DecodeTmaMaps(const TmaAttributes& tma, ProgramPlan* plan);

inline ffi::Error DecodeProgramPlan(ffi::Span<const uint8_t> params, std::string_view bindings,
                                    ffi::Span<const uint8_t> zero_init, std::string_view kernels,
                                    ffi::Span<const int32_t> grid, ffi::Span<const int32_t> block,
                                    ffi::Span<const int32_t> smem, std::string_view version,
                                    const TmaAttributes& tma, ProgramPlan* plan) {
  if (version != CUFLASH_VERSION)
    return Invalid("this call was lowered by cuflash " + std::string(version) + ", but the handler library is " +
                   CUFLASH_VERSION + " (an exported executable runs with the cuflash version that exported it)");
  if (params.size() != sizeof(AttentionParams))
    return Invalid("params attribute has " + std::to_string(params.size()) + " bytes but sizeof(AttentionParams) is " +
                   std::to_string(sizeof(AttentionParams)) + " (Python mirror and C++ header disagree)");
  std::memcpy(&plan->params, params.begin(), sizeof(AttentionParams));

  // Pointer fields must arrive null: an address in the HLO would be stale in any other run.
  for (const PointerField& field : kPointerFields) {
    std::uintptr_t value;
    std::memcpy(&value, reinterpret_cast<const unsigned char*>(&plan->params) + field.offset, sizeof value);
    if (value != 0)
      return Invalid(std::string("params attribute carries an address in pointer field ") + field.name +
                     ": addresses must not be baked into the HLO");
  }

  plan->bindings.clear();
  plan->packed = plan->paged = false;
  for (std::string_view name : Split(bindings, ',')) {
    const PointerField* field = FindPointerField(name);
    if (field == nullptr) return Invalid("binding '" + std::string(name) + "' is not an AttentionParams pointer field");
    for (const PointerField* other : plan->bindings)
      if (other == field) return Invalid("field " + std::string(name) + " is bound twice");
    plan->bindings.push_back(field);
    plan->packed = plan->packed || name == "cu_seqlens_q";
    plan->paged = plan->paged || name == "block_table";
  }
  plan->paged = plan->paged && plan->params.page_size > 0;
  if (zero_init.size() > plan->bindings.size())
    return Invalid("zero_init has " + std::to_string(zero_init.size()) + " entries for " +
                   std::to_string(plan->bindings.size()) + " bound buffers");
  plan->zero_init.assign(zero_init.begin(), zero_init.end());

  const std::vector<std::string_view> kernel_names = Split(kernels, ';');
  const std::size_t n = kernel_names.size();
  if (grid.size() != 3 * n || block.size() != 3 * n || smem.size() != n)
    return Invalid(std::to_string(n) + " kernels need " + std::to_string(3 * n) + " grid and block entries and " +
                   std::to_string(n) + " smem entries, got " + std::to_string(grid.size()) + ", " +
                   std::to_string(block.size()) + " and " + std::to_string(smem.size()));
  plan->launches.clear();
  for (std::size_t i = 0; i < n; ++i) {
    KernelLaunch launch;
    launch.name = std::string(kernel_names[i]);
    if (launch.name.empty()) return Invalid("launch " + std::to_string(i) + " names no kernel");
    for (int d = 0; d < 3; ++d) {
      // Python drops launches with an empty grid; CUDA rejects a zero dimension.
      if (grid[3 * i + d] <= 0 || block[3 * i + d] <= 0)
        return Invalid("launch of " + launch.name + " has a grid or block dimension <= 0");
      launch.grid[d] = static_cast<unsigned>(grid[3 * i + d]);
      launch.block[d] = static_cast<unsigned>(block[3 * i + d]);
    }
    if (smem[i] < 0) return Invalid("launch of " + launch.name + " has negative dynamic shared memory");
    launch.dynamic_smem_bytes = static_cast<unsigned>(smem[i]);
    plan->launches.push_back(std::move(launch));
  }
  return DecodeTmaMaps(tma, plan);
}

// The maps the attributes describe, each tied to its bound tensor; params' tma_loads must say whether there are any.
inline ffi::Error DecodeTmaMaps(const TmaAttributes& tma, ProgramPlan* plan) {
  plan->tma_maps.clear();
  for (std::string_view name : Split(tma.tensors, ',')) {
    TmaMapPlan map{};
    if (!TmaMapOffset(name, &map.map_at))
      return Invalid("tma_tensors names " + std::string(name) + ", which has no map in AttentionParams.tma");
    for (std::size_t i = 0; i < plan->bindings.size(); ++i)
      if (name == plan->bindings[i]->name) {
        map.tensor = plan->bindings[i];
        map.binding = i;
      }
    if (map.tensor == nullptr) return Invalid("tma_tensors names " + std::string(name) + ", which is not bound");
    for (const TmaMapPlan& other : plan->tma_maps)
      if (other.tensor == map.tensor) return Invalid("tma_tensors names " + std::string(name) + " twice");
    plan->tma_maps.push_back(map);
  }
  const std::size_t words = TiledArguments::kWords;
  if (tma.arguments.size() != words * plan->tma_maps.size())
    return Invalid("tma_arguments has " + std::to_string(tma.arguments.size()) + " words for " +
                   std::to_string(plan->tma_maps.size()) + " maps of " + std::to_string(words));
  for (std::size_t i = 0; i < plan->tma_maps.size(); ++i) {
    TiledArguments& arguments = plan->tma_maps[i].arguments;
    std::memcpy(&arguments, tma.arguments.begin() + i * words, sizeof arguments);
    if (arguments.rank < 1 || arguments.rank > 5)
      return Invalid("tma_arguments: map " + std::to_string(i) + " has rank " + std::to_string(arguments.rank));
  }
  if (tma.twin_address_at < 0 || tma.twin_address_at + sizeof(uint64_t) > sizeof(TmaMaps::q))
    return Invalid("tma_twin_address_at " + std::to_string(tma.twin_address_at) + " is not inside a map");
  if (tma.address_alignment <= 0 || (tma.address_alignment & (tma.address_alignment - 1)))
    return Invalid("tma_address_alignment " + std::to_string(tma.address_alignment) + " is not a power of 2");
  plan->tma_twin_address_at = static_cast<std::size_t>(tma.twin_address_at);
  plan->tma_address_alignment = static_cast<uint64_t>(tma.address_alignment);
  if ((plan->params.tma_loads != 0) != !plan->tma_maps.empty())
    return Invalid("params' tma_loads is " + std::to_string(plan->params.tma_loads) + " but tma_tensors names " +
                   std::to_string(plan->tma_maps.size()) + " maps");
  return ffi::Error::Success();
}

// The bytes a map of elements of `element_bytes` (the bound tensor's) reaches from its address: (dim - 1) * stride
// summed over the outer dimensions, plus the innermost row.
inline unsigned long long TmaMapReach(const TiledArguments& a, std::size_t element_bytes) {
  unsigned long long reach = static_cast<unsigned long long>(a.global_dims[0]) * element_bytes;
  for (int d = 1; d < a.rank; ++d)
    reach += static_cast<unsigned long long>(a.global_dims[d] - 1) *
             static_cast<unsigned long long>(a.global_strides[d - 1]);
  return reach;
}

// The address of each map's tensor in this call (into addresses, in tma_maps' order), checked to lie inside the
// bound buffer. *usable is false (and call->params.tma_loads set 0: the kernels copy with loads) where the plan has no
// maps or an address is not aligned as TMA needs: TmaMaps.block's rule, the only one left per call.
inline ffi::Error TmaMapAddresses(const ProgramPlan& plan, ProgramCall* call, std::vector<uint64_t>* addresses,
                                  bool* usable) {
  addresses->clear();
  *usable = !plan.tma_maps.empty();
  for (const TmaMapPlan& map : plan.tma_maps) {
    const BoundBuffer& buffer = call->buffers[map.binding];
    const unsigned long long reach = TmaMapReach(map.arguments, buffer.element_bytes);
    if (reach > buffer.bytes)
      return Invalid(std::string("the TMA map of ") + map.tensor->name + " reaches " + std::to_string(reach) +
                     " bytes, but its buffer has " +
                     std::to_string(buffer.bytes));
    const uint64_t address = reinterpret_cast<std::uintptr_t>(buffer.data);
    if (address % plan.tma_address_alignment) *usable = false;
    addresses->push_back(address);
  }
  if (!*usable) call->params.tma_loads = 0;
  return ffi::Error::Success();
}

// The CPU handler's maps: the twins' encodings params already holds, each tensor's address patched in.
inline ffi::Error PatchTwinTmaMaps(const ProgramPlan& plan, ProgramCall* call) {
  std::vector<uint64_t> addresses;
  bool usable = false;
  if (ffi::Error error = TmaMapAddresses(plan, call, &addresses, &usable); error.failure() || !usable) return error;
  for (std::size_t i = 0; i < plan.tma_maps.size(); ++i)
    std::memcpy(reinterpret_cast<unsigned char*>(&call->params) + plan.tma_maps[i].map_at + plan.tma_twin_address_at,
                &addresses[i], sizeof(uint64_t));
  return ffi::Error::Success();
}

// The execute stage's half: binds this run's operands and results to the plan's fields, checks their element types
// and extents against the params, and writes their addresses into call->params. Host arithmetic only: no CUDA
// call, so it is as legal while XLA captures a command buffer as anywhere else.
inline ffi::Error BindProgramBuffers(const ProgramPlan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                     ProgramCall* call) {
  const std::size_t num_args = args.size(), num_rets = rets.size();
  if (plan.bindings.size() != num_args + num_rets)
    return Invalid("bindings name " + std::to_string(plan.bindings.size()) + " buffers but the call has " +
                   std::to_string(num_args) + " operands and " + std::to_string(num_rets) + " results");
  if (plan.zero_init.size() != num_rets)
    return Invalid("zero_init has " + std::to_string(plan.zero_init.size()) + " entries for " +
                   std::to_string(num_rets) + " results");
  call->params = plan.params;

  ffi::DataType tensor_type = ffi::DataType::INVALID;
  std::string first_tensor;
  call->buffers.clear();
  for (std::size_t i = 0; i < plan.bindings.size(); ++i) {
    const PointerField* field = plan.bindings[i];
    const bool is_result = i >= num_args;
    ffi::DataType type;
    void* data;
    std::size_t bytes;
    ffi::AnyBuffer::Dimensions dimensions;
    if (!is_result) {
      auto buffer = args.get<ffi::AnyBuffer>(i);
      if (!buffer.has_value()) return Invalid("operand " + std::to_string(i) + " is not a buffer");
      type = buffer->element_type();
      data = buffer->untyped_data();
      bytes = buffer->size_bytes();
      dimensions = buffer->dimensions();
    } else {
      auto buffer = rets.get<ffi::AnyBuffer>(i - num_args);
      if (!buffer.has_value()) return Invalid("result " + std::to_string(i - num_args) + " is not a buffer");
      type = (*buffer)->element_type();
      data = (*buffer)->untyped_data();
      bytes = (*buffer)->size_bytes();
      dimensions = (*buffer)->dimensions();
    }
    if (field->kind == FieldKind::kFlexSide || field->kind == FieldKind::kFlexTiles) {
      // any element type: the mod's emitted code reads its own dtype; tile lists are int32 words
    } else if (field->kind == FieldKind::kFlexShard) {
      if (type != ffi::DataType::S32 || bytes < 2 * sizeof(int32_t))
        return Invalid(std::string(field->name) + " must be two int32 words (first batch, first query head)");
    } else if (field->kind == FieldKind::kFlexGrad) {
      if (type != ffi::DataType::F32) return Invalid(std::string(field->name) + " must be float32");
    } else if (field->is_tensor()) {
      if (type != ffi::DataType::F32 && type != ffi::DataType::F16 && type != ffi::DataType::BF16)
        return Invalid(std::string(field->name) + " must be float32, float16 or bfloat16");
      if (tensor_type == ffi::DataType::INVALID) {
        tensor_type = type;
        first_tensor = field->name;
      } else if (type != tensor_type) {
        return Invalid(std::string(field->name) + " and " + first_tensor + " have different element types");
      }
    } else if (type != ffi::DataType::F32) {
      return Invalid(std::string("side buffer ") + field->name + " must be float32");
    }
    const bool zero_init = is_result && plan.zero_init[i - num_args] != 0;
    const long long leading_extent = dimensions.size() ? static_cast<long long>(dimensions.front()) : 1;
    call->buffers.push_back(
        BoundBuffer{field, data, bytes, leading_extent, is_result, zero_init, ffi::ByteWidth(type)});
  }
  for (const BoundBuffer& bound : call->buffers) {
    if (bound.field->kind == FieldKind::kFlexSide || bound.field->kind == FieldKind::kFlexGrad) {
      const unsigned long long needed = FlexSideReach(call->params, *bound.field, bound.element_bytes);
      if (needed > bound.bytes)
        return Invalid(std::string(bound.field->name) + " needs " + std::to_string(needed) +
                       " bytes for the shape and strides in params, but its buffer has " + std::to_string(bound.bytes));
      continue;
    }
    if (!bound.field->is_tensor()) continue;
    // num_pages is not in AttentionParams (kernels never need it: the block_table names the pages), so a paged
    // cache's page count is the bound buffer's own leading dimension.
    const TensorLayout layout{plan.packed, plan.paged, bound.leading_extent};
    if (ffi::Error error = CheckTensorExtent(call->params, bound, layout, ffi::ByteWidth(tensor_type)); error.failure())
      return error;
  }

  for (const BoundBuffer& buffer : call->buffers) {
    std::uintptr_t address = reinterpret_cast<std::uintptr_t>(buffer.data);
    std::memcpy(reinterpret_cast<unsigned char*>(&call->params) + buffer.field->offset, &address, sizeof address);
  }
  return ffi::Error::Success();
}

// The attributes both handlers' instantiate stages bind, in this order after their platform context. The execute
// stages bind no attribute (XLA then passes them none to decode) and read the plan from their state instead.
#define CUFLASH_PROGRAM_PLAN_ATTRS(binding)                         \
  binding.Attr<xla::ffi::Span<const uint8_t>>("params")             \
      .Attr<std::string_view>("bindings")                           \
      .Attr<xla::ffi::Span<const uint8_t>>("zero_init")            \
      .Attr<std::string_view>("kernels")                            \
      .Attr<xla::ffi::Span<const int32_t>>("grid")                 \
      .Attr<xla::ffi::Span<const int32_t>>("block")                \
      .Attr<xla::ffi::Span<const int32_t>>("smem")                 \
      .Attr<std::string_view>("version")                            \
      .Attr<std::string_view>("tma_tensors")                        \
      .Attr<xla::ffi::Span<const int64_t>>("tma_arguments")         \
      .Attr<int64_t>("tma_twin_address_at")                         \
      .Attr<int64_t>("tma_address_alignment")

}  // namespace cuflash::ffi_handlers
