// cpu_program.cpp: the XLA FFI handler for platform "cpu" — runs a launch-plan
// Program on the CPU simulator, the same kernels a GPU runs, every thread a fiber.
//
// Its job is to exercise the whole custom-call path in CI (attribute decoding,
// operand/result binding, extent checks, params patching, launch order, and the
// split into XLA's stages) with the code the CUDA handler shares (program_call.h);
// only the last step differs: instead of cuLaunchKernel, each launch goes to the
// simulator entry point the registry holds for the kernel's name expression.
//
// Two stages, as the CUDA handler has:
//   instantiate  once per compiled call, when XLA builds the executable (also when it
//                deserializes one): decodes and checks the attributes (DecodeProgramPlan),
//                resolves every kernel to its simulator entry (asking the Python resolver
//                for one this process never lowered), and keeps both in a CpuProgramState.
//                A bad attribute or an unknown kernel therefore fails the compilation,
//                before any buffer exists.
//   execute      per run: binds and checks this run's buffers (BindProgramBuffers) and
//                launches the state's entries. The one thing it may redo is resolution:
//                cuflash.sim.checking() swaps the simulator library of every kernel and
//                README promises that functions jitted before it follow, so the registry
//                counts replacements and removals (a generation) and an execution that
//                finds the count moved since its state resolved resolves again.
//
// Buffers the program does not zero are filled with 0xFF bytes (NaN in float32,
// float16 and bfloat16) before the first launch, as the NumPy simulator backend
// does, so an element no kernel writes shows up as NaN instead of stale memory.
// While Python records (cuflash.jax._ffi.record_launches), each launch's shape, the
// global traffic the simulator counted and, in profile mode, its bank-conflict report
// (TMA loads among the sites) are logged, like cuflash.sim.record().
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "arch/sim/sim_abi.h"
#include "ffi/ffi_abi.h"
#include "ffi/program_call.h"

namespace cuflash::ffi_handlers {
namespace {

using SimLaunchEntry = int (*)(const char* name_expr, cuflash_sim_launch_request* request);

std::shared_mutex& RegistryMutex() {
  static std::shared_mutex mutex;
  return mutex;
}

std::unordered_map<std::string, SimLaunchEntry>& Registry() {
  static std::unordered_map<std::string, SimLaunchEntry> registry;
  return registry;
}

// Bumped (under the unique lock) whenever an entry is replaced or removed, never when a new name is added: only
// those can make an entry a state resolved earlier stale.
std::atomic<std::uint64_t>& RegistryGeneration() {
  static std::atomic<std::uint64_t> generation{0};
  return generation;
}

SimLaunchEntry FindSimKernel(const std::string& name) {
  std::shared_lock lock(RegistryMutex());
  auto it = Registry().find(name);
  return it == Registry().end() ? nullptr : it->second;
}

// The entry of every launch, in launch order, and the registry generation they were read at (read first, so a
// change during the lookups shows as a moved generation at the next execution). A kernel this process never
// lowered (a deserialized executable) is built and registered by the Python resolver, called without locks.
ffi::Error ResolveSimKernels(const ProgramPlan& plan, std::vector<SimLaunchEntry>* entries,
                             std::uint64_t* generation) {
  *generation = RegistryGeneration().load();
  entries->clear();
  for (const KernelLaunch& launch : plan.launches) {
    SimLaunchEntry entry = FindSimKernel(launch.name);
    if (entry == nullptr && ResolveKernel(launch.name, "sim")) entry = FindSimKernel(launch.name);
    if (entry == nullptr)
      return ffi::Error(ffi::ErrorCode::kNotFound,
                        "cuflash CPU handler: no simulator kernel registered for " + launch.name +
                            " (kernels are registered when cuflash.jax lowers a call, or when a compiled call is "
                            "instantiated once cuflash.jax is imported)");
    entries->push_back(entry);
  }
  return ffi::Error::Success();
}

// The per-instance state XLA keeps from instantiate to every execution of one compiled call, and deletes with the
// executable (through the deleter of its registered type info).
struct CpuProgramState {
  static constexpr const char* kTypeName = "cuflash.CpuProgramState";
  static inline xla::ffi::TypeId id = {FixedStateTypeId(kTypeName)};  // see FixedStateTypeId

  ProgramPlan plan;
  // Executions of one executable may run at once (one per host device under shard_map), so the resolution they
  // may refresh is guarded.
  std::mutex mutex;
  std::vector<SimLaunchEntry> entries;
  std::uint64_t resolved_generation = 0;
};

const XLA_FFI_TypeInfo kCpuProgramStateTypeInfo = xla::ffi::MakeTypeInfo<CpuProgramState>();

std::atomic<unsigned long long>& CpuInstantiations() {
  static std::atomic<unsigned long long> count{0};
  return count;
}

// One simulated launch at a time per process: each launch already spreads its
// blocks over every core, and shard_map on host devices would otherwise start
// one launch per device at once and oversubscribe the cores.
std::mutex& SimLaunchMutex() {
  static std::mutex mutex;
  return mutex;
}

// Worker threads per launch: $CUFLASH_SIM_THREADS when set (as for cuflash.sim.launch), else 0 (one per core).
int SimWorkers() {
  const char* value = std::getenv("CUFLASH_SIM_THREADS");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  long n = std::strtol(value, &end, 10);
  return (end != value && *end == '\0' && n >= 1 && n <= 4096) ? static_cast<int>(n) : 0;
}

struct LaunchLog {
  std::mutex mutex;
  bool enabled = false;
  std::vector<cuflash_ffi_launch_record> records;
  std::vector<std::string> profiles;  // per record: the simulator's bank-conflict report (profile mode), else ""
};

// What cuflash.sim's launch gives a profile-mode library for its bank-conflict report (sim/_launch.py's
// _PROFILE_REPORT_BYTES); other modes write nothing there. Allocated per launch, untouched unless written.
constexpr std::size_t kProfileReportBytes = 1u << 22;

LaunchLog& Log() {
  static LaunchLog log;
  return log;
}

void RecordLaunch(const KernelLaunch& launch, const cuflash_sim_launch_request& request, const char* profile) {
  LaunchLog& log = Log();
  std::lock_guard<std::mutex> lock(log.mutex);
  if (!log.enabled) return;
  cuflash_ffi_launch_record record;
  std::memset(&record, 0, sizeof record);
  std::strncpy(record.kernel, launch.name.c_str(), sizeof record.kernel - 1);
  for (int d = 0; d < 3; ++d) {
    record.grid[d] = launch.grid[d];
    record.block[d] = launch.block[d];
  }
  record.dynamic_smem_bytes = launch.dynamic_smem_bytes;
  record.bytes_read = request.bytes_read;
  record.bytes_written = request.bytes_written;
  log.records.push_back(record);
  log.profiles.emplace_back(profile);
}

ffi::ErrorOr<std::unique_ptr<CpuProgramState>> CpuProgramInstantiate(
    ffi::Span<const uint8_t> params, std::string_view bindings, ffi::Span<const uint8_t> zero_init,
    std::string_view kernels, ffi::Span<const int32_t> grid, ffi::Span<const int32_t> block,
    ffi::Span<const int32_t> smem, std::string_view version, std::string_view tma_tensors,
    ffi::Span<const int64_t> tma_arguments, int64_t tma_twin_address_at, int64_t tma_address_alignment) {
  auto state = std::make_unique<CpuProgramState>();
  if (ffi::Error error = DecodeProgramPlan(params, bindings, zero_init, kernels, grid, block, smem, version,
                                           {tma_tensors, tma_arguments, tma_twin_address_at, tma_address_alignment},
                                           &state->plan);
      error.failure())
    return ffi::Unexpected<ffi::Error>(std::move(error));
  if (ffi::Error error = ResolveSimKernels(state->plan, &state->entries, &state->resolved_generation);
      error.failure())
    return ffi::Unexpected<ffi::Error>(std::move(error));
  CpuInstantiations().fetch_add(1);
  return state;
}

// The state's entries, resolved again first when the registry changed since they were read.
ffi::Error CurrentSimKernels(CpuProgramState* state, std::vector<SimLaunchEntry>* entries) {
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (state->resolved_generation == RegistryGeneration().load()) {
      *entries = state->entries;
      return ffi::Error::Success();
    }
  }
  std::uint64_t generation;
  if (ffi::Error error = ResolveSimKernels(state->plan, entries, &generation); error.failure()) return error;
  std::lock_guard<std::mutex> lock(state->mutex);
  state->entries = *entries;
  state->resolved_generation = generation;
  return ffi::Error::Success();
}

ffi::Error CpuProgramExecute(CpuProgramState* state, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const ProgramPlan& plan = state->plan;
  ProgramCall call;
  if (ffi::Error error = BindProgramBuffers(plan, args, rets, &call); error.failure()) return error;
  if (ffi::Error error = PatchTwinTmaMaps(plan, &call); error.failure()) return error;

  // Resolved before touching any buffer, so a kernel gone missing since instantiation fails cleanly.
  std::vector<SimLaunchEntry> entries;
  if (ffi::Error error = CurrentSimKernels(state, &entries); error.failure()) return error;

  std::vector<unsigned long long> begins, sizes;
  std::vector<int> writable;
  for (const BoundBuffer& buffer : call.buffers) {
    if (buffer.is_result && buffer.bytes) std::memset(buffer.data, buffer.zero_init ? 0x00 : 0xFF, buffer.bytes);
    begins.push_back(reinterpret_cast<unsigned long long>(buffer.data));
    sizes.push_back(buffer.bytes);
    writable.push_back(buffer.is_result ? 1 : 0);  // XLA operands are read-only to the program
  }

  std::lock_guard<std::mutex> serial(SimLaunchMutex());
  for (std::size_t i = 0; i < plan.launches.size(); ++i) {
    const KernelLaunch& launch = plan.launches[i];
    cuflash_sim_launch_request request;
    std::memset(&request, 0, sizeof request);
    request.kernel_name = launch.name.c_str();
    for (int d = 0; d < 3; ++d) {
      request.grid[d] = launch.grid[d];
      request.block[d] = launch.block[d];
    }
    request.dynamic_smem_bytes = launch.dynamic_smem_bytes;
    request.params = &call.params;
    request.params_size = sizeof(AttentionParams);
    request.num_buffers = static_cast<int>(call.buffers.size());
    request.buffer_begin = begins.data();
    request.buffer_bytes = sizes.data();
    request.buffer_writable = writable.data();
    request.num_workers = SimWorkers();
    std::unique_ptr<char[]> profile(new char[kProfileReportBytes]);
    profile[0] = '\0';
    request.profile_out = profile.get();
    request.profile_out_bytes = kProfileReportBytes;
    if (entries[i](launch.name.c_str(), &request) != 0) {
      request.error[sizeof request.error - 1] = '\0';
      return ffi::Error::Internal("cuflash CPU handler: kernel " + launch.name + " failed in the simulator: " +
                                  request.error);
    }
    RecordLaunch(launch, request, profile.get());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuflash::ffi_handlers

XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashProgramCpuInstantiate, cuflash::ffi_handlers::CpuProgramInstantiate,
                              CUFLASH_PROGRAM_PLAN_ATTRS(xla::ffi::Ffi::BindInstantiate()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashProgramCpu, cuflash::ffi_handlers::CpuProgramExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::State<cuflash::ffi_handlers::CpuProgramState>>()
                                  .RemainingArgs()
                                  .RemainingRets());

extern "C" {

int cuflash_ffi_cpu_handlers(cuflash_ffi_handler_bundle* bundle) {
  using namespace cuflash::ffi_handlers;
  return FillHandlerBundle<CpuProgramState>(bundle, CuflashProgramCpuInstantiate, CuflashProgramCpu,
                                            kCpuProgramStateTypeInfo);
}

unsigned long long cuflash_ffi_cpu_instantiations(void) { return cuflash::ffi_handlers::CpuInstantiations().load(); }

int cuflash_ffi_handler_traits(void* handler, unsigned* traits) {
  // The call XLA makes when a handler is registered (xla/ffi/ffi_api.cc, GetMetadata): a call frame whose only
  // content is the metadata extension, answered by the handler with its API version and traits.
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  metadata.api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  frame.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  frame.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  if (handler == nullptr || reinterpret_cast<XLA_FFI_Handler*>(handler)(&frame) != nullptr) return 0;
  *traits = metadata.traits;
  return 1;
}

void cuflash_ffi_register_sim_kernel(const char* name_expr, void* sim_launch_entry) {
  using namespace cuflash::ffi_handlers;
  std::unique_lock lock(RegistryMutex());
  auto [it, added] = Registry().try_emplace(name_expr, reinterpret_cast<SimLaunchEntry>(sim_launch_entry));
  if (!added && it->second != reinterpret_cast<SimLaunchEntry>(sim_launch_entry)) {
    it->second = reinterpret_cast<SimLaunchEntry>(sim_launch_entry);
    RegistryGeneration().fetch_add(1);
  }
}

void cuflash_ffi_unregister_sim_kernel(const char* name_expr) {
  using namespace cuflash::ffi_handlers;
  std::unique_lock lock(RegistryMutex());
  if (Registry().erase(name_expr) != 0) RegistryGeneration().fetch_add(1);
}

int cuflash_ffi_sim_kernel_registered(const char* name_expr) {
  return cuflash::ffi_handlers::FindSimKernel(name_expr) != nullptr;
}

void cuflash_ffi_sim_record(int enabled) {
  cuflash::ffi_handlers::LaunchLog& log = cuflash::ffi_handlers::Log();
  std::lock_guard<std::mutex> lock(log.mutex);
  if (enabled) {
    log.records.clear();
    log.profiles.clear();
  }
  log.enabled = enabled != 0;
}

int cuflash_ffi_sim_recorded_count(void) {
  cuflash::ffi_handlers::LaunchLog& log = cuflash::ffi_handlers::Log();
  std::lock_guard<std::mutex> lock(log.mutex);
  return static_cast<int>(log.records.size());
}

int cuflash_ffi_sim_recorded(int index, cuflash_ffi_launch_record* record) {
  cuflash::ffi_handlers::LaunchLog& log = cuflash::ffi_handlers::Log();
  std::lock_guard<std::mutex> lock(log.mutex);
  if (index < 0 || static_cast<std::size_t>(index) >= log.records.size()) return 0;
  *record = log.records[static_cast<std::size_t>(index)];
  return 1;
}

const char* cuflash_ffi_sim_recorded_profile(int index) {
  cuflash::ffi_handlers::LaunchLog& log = cuflash::ffi_handlers::Log();
  std::lock_guard<std::mutex> lock(log.mutex);
  if (index < 0 || static_cast<std::size_t>(index) >= log.profiles.size()) return "";
  return log.profiles[static_cast<std::size_t>(index)].c_str();
}

long long cuflash_ffi_tiled_argument_word(const char* name) {
  using cuflash::ffi_handlers::TiledArguments;
  const std::string_view wanted(name);
#define CUFLASH_TILED_ARGUMENT(field) \
  if (wanted == #field) return static_cast<long long>(offsetof(TiledArguments, field) / sizeof(int64_t));
  CUFLASH_TILED_ARGUMENT(data_type) CUFLASH_TILED_ARGUMENT(rank) CUFLASH_TILED_ARGUMENT(global_dims)
  CUFLASH_TILED_ARGUMENT(global_strides) CUFLASH_TILED_ARGUMENT(box_dims) CUFLASH_TILED_ARGUMENT(element_strides)
  CUFLASH_TILED_ARGUMENT(interleave) CUFLASH_TILED_ARGUMENT(swizzle) CUFLASH_TILED_ARGUMENT(l2_promotion)
  CUFLASH_TILED_ARGUMENT(oob_fill)
#undef CUFLASH_TILED_ARGUMENT
  return -1;
}

unsigned long long cuflash_ffi_params_size(void) { return sizeof(cuflash::AttentionParams); }

long long cuflash_ffi_pointer_field_offset(const char* name) {
  const cuflash::ffi_handlers::PointerField* field = cuflash::ffi_handlers::FindPointerField(name);
  return field == nullptr ? -1 : static_cast<long long>(field->offset);
}

}  // extern "C"

extern "C" void cuflash_ffi_set_resolver(cuflash_ffi_resolver resolver) {
  cuflash::ffi_handlers::KernelResolver().store(resolver);
}

extern "C" const char* cuflash_ffi_version(void) { return CUFLASH_VERSION; }
