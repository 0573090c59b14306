// cuda_program.cpp: the XLA FFI handler for platform "CUDA" — launches the CUBINs
// of the NVRTC pipeline with the driver API on XLA's stream.
//
// Declared command-buffer compatible (xla::ffi::Traits::kCmdBufferCompatible, which
// XLA reads from the execute handler's metadata when it is registered), so XLA can
// record attention calls into its CUDA-graph command buffers instead of splitting
// the graph at each one. Recording works by stream capture of the execute stage, so
// everything that is not capturable lives in the instantiate stage:
//
//   instantiate  once per compiled call, when XLA builds (or deserializes) the
//                executable, with no stream: decodes and checks the attributes
//                (program_call.h, shared with the CPU handler), then, in every CUDA
//                context that can run it (the active primary context of each device,
//                the ones XLA uses), resolves each kernel's CUBIN for that device's
//                arch (asking the Python resolver to compile one this process never
//                lowered), loads its module (cuModuleLoadData, kept for the life of the
//                process and shared by all executables) and raises the function's
//                maximum dynamic shared memory to what its launches need (CUDA
//                requires that above 48 KB). The functions go into a CudaProgramState.
//   execute      per run, possibly under capture: binds and checks the buffers (host
//                arithmetic), looks up the state's functions for the stream's context,
//                encodes the TMA tensor maps of q, k and v (cuTensorMapEncodeTiled: host
//                only, program_call.h's TMA attributes), clears the results the program
//                accumulates into (cuMemsetD8Async) and cuLaunchKernel's each launch,
//                all on XLA's stream. No device allocation, no
//                synchronization, no module loading, no attribute change: XLA's stream
//                orders the launches after the producers of the operands and before the
//                consumers of the results, and scratch buffers are extra results of the
//                custom call, so XLA owns them and keeps them alive until the stream
//                has run past the kernels. A context instantiate did not see (one made
//                active later) is prepared on its first execution outside a capture;
//                inside one that is refused with an error rather than done.
//
// libcuda is opened with dlopen at first use, so this library builds and loads on
// machines without a driver (CI); entry points come from cuGetProcAddress at the
// ABI versions whose prototypes cudaTypedefs.h spells out below.
#include "ffi/ffi_abi.h"

#if CUFLASH_FFI_WITH_CUDA

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ffi/program_call.h"

namespace cuflash::ffi_handlers {
namespace {

// The driver entry points the handler uses, at fixed ABI versions.
struct Driver {
  PFN_cuInit_v2000 Init = nullptr;
  PFN_cuGetErrorString_v6000 GetErrorString = nullptr;
  PFN_cuStreamGetCtx_v9020 StreamGetCtx = nullptr;
  PFN_cuCtxPushCurrent_v4000 CtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 CtxPopCurrent = nullptr;
  PFN_cuCtxGetDevice_v2000 CtxGetDevice = nullptr;
  PFN_cuDeviceGetCount_v2000 DeviceGetCount = nullptr;
  PFN_cuDeviceGet_v2000 DeviceGet = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 DevicePrimaryCtxGetState = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 DevicePrimaryCtxRetain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 DevicePrimaryCtxRelease = nullptr;
  PFN_cuStreamIsCapturing_v10000 StreamIsCapturing = nullptr;
  PFN_cuDeviceGetAttribute_v2000 DeviceGetAttribute = nullptr;
  PFN_cuModuleLoadData_v2000 ModuleLoadData = nullptr;
  PFN_cuModuleGetFunction_v2000 ModuleGetFunction = nullptr;
  PFN_cuFuncSetAttribute_v9000 FuncSetAttribute = nullptr;
  PFN_cuMemsetD8Async_v3020 MemsetD8Async = nullptr;
  PFN_cuLaunchKernel_v4000 LaunchKernel = nullptr;
  PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncodeTiled = nullptr;
  std::string status;  // "" once every entry point is loaded
};

const Driver& LoadDriver() {
  static const Driver driver = [] {
    Driver d;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      d.status = std::string("cannot load the CUDA driver libcuda.so.1: ") + (why ? why : "unknown reason");
      return d;
    }
    auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(library, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) {
      d.status = "the CUDA driver has no cuGetProcAddress_v2 (a driver for CUDA 12.0 or newer is needed)";
      return d;
    }
    auto load = [&](const char* symbol, int version, auto& slot) {
      void* entry = nullptr;
      CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      CUresult result = get_proc(symbol, &entry, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
      if (result != CUDA_SUCCESS || entry == nullptr || found != CU_GET_PROC_ADDRESS_SUCCESS) {
        if (d.status.empty())
          d.status = std::string("the CUDA driver has no ") + symbol + " at ABI version " + std::to_string(version);
        return;
      }
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(entry);
    };
    load("cuInit", 2000, d.Init);
    load("cuGetErrorString", 6000, d.GetErrorString);
    load("cuStreamGetCtx", 9020, d.StreamGetCtx);
    load("cuCtxPushCurrent", 4000, d.CtxPushCurrent);
    load("cuCtxPopCurrent", 4000, d.CtxPopCurrent);
    load("cuCtxGetDevice", 2000, d.CtxGetDevice);
    load("cuDeviceGetCount", 2000, d.DeviceGetCount);
    load("cuDeviceGet", 2000, d.DeviceGet);
    load("cuDevicePrimaryCtxGetState", 7000, d.DevicePrimaryCtxGetState);
    load("cuDevicePrimaryCtxRetain", 7000, d.DevicePrimaryCtxRetain);
    load("cuDevicePrimaryCtxRelease", 11000, d.DevicePrimaryCtxRelease);
    load("cuStreamIsCapturing", 10000, d.StreamIsCapturing);
    load("cuDeviceGetAttribute", 2000, d.DeviceGetAttribute);
    load("cuModuleLoadData", 2000, d.ModuleLoadData);
    load("cuModuleGetFunction", 2000, d.ModuleGetFunction);
    load("cuFuncSetAttribute", 9000, d.FuncSetAttribute);
    load("cuMemsetD8Async", 3020, d.MemsetD8Async);
    load("cuLaunchKernel", 4000, d.LaunchKernel);
    load("cuTensorMapEncodeTiled", 12000, d.TensorMapEncodeTiled);
    // XLA has initialised the driver before any handler runs; calling cuInit again is a no-op
    // then, and makes the status below meaningful when asked for outside XLA.
    if (d.status.empty()) {
      if (CUresult r = d.Init(0); r != CUDA_SUCCESS) {
        const char* text = nullptr;
        if (d.GetErrorString(r, &text) != CUDA_SUCCESS) text = nullptr;
        d.status = std::string("cuInit failed: ") + (text ? text : std::to_string(static_cast<int>(r)));
      }
    }
    return d;
  }();
  return driver;
}

ffi::Error CudaError(const Driver& driver, CUresult result, const std::string& what) {
  const char* text = nullptr;
  if (driver.GetErrorString == nullptr || driver.GetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
  return ffi::Error::Internal("cuflash CUDA handler: " + what + " failed: " +
                             (text ? text : "CUDA error " + std::to_string(static_cast<int>(result))));
}

// What cuModuleLoadData takes: a CUBIN, or NUL-terminated PTX the driver compiles (kernels/toolchain.py).
struct ModuleImage {
  std::string lowered_name;
  std::vector<unsigned char> image;
};

struct LoadedKernel {
  CUfunction function = nullptr;
  unsigned max_dynamic_smem = 0;  // the attribute as last set (0: never set, default limit)
};

std::mutex& StateMutex() {
  static std::mutex mutex;
  return mutex;
}
// (name expression, device arch) -> the module image NVRTC built for that device.
std::map<std::pair<std::string, std::string>, std::shared_ptr<const ModuleImage>>& ModuleImages() {
  static std::map<std::pair<std::string, std::string>, std::shared_ptr<const ModuleImage>> images;
  return images;
}
// (context, name expression) -> function loaded in that context. Modules are never unloaded.
std::map<std::pair<CUcontext, std::string>, LoadedKernel>& Loaded() {
  static std::map<std::pair<CUcontext, std::string>, LoadedKernel> loaded;
  return loaded;
}
std::map<CUcontext, std::string>& ContextArch() {
  static std::map<CUcontext, std::string> arch;
  return arch;
}

// Pushes a context for the duration of a call and pops it on every exit path.
class ContextGuard {
 public:
  ContextGuard(const Driver& driver, CUcontext context) : driver_(driver) {
    pushed_ = driver_.CtxPushCurrent(context) == CUDA_SUCCESS;
  }
  ~ContextGuard() {
    if (pushed_) {
      CUcontext popped;
      driver_.CtxPopCurrent(&popped);
    }
  }
  bool pushed() const { return pushed_; }

 private:
  const Driver& driver_;
  bool pushed_ = false;
};

// Called with StateMutex held and the context current.
ffi::Error ContextArchLocked(const Driver& driver, CUcontext context, std::string* arch) {
  auto it = ContextArch().find(context);
  if (it != ContextArch().end()) {
    *arch = it->second;
    return ffi::Error::Success();
  }
  CUdevice device;
  if (CUresult r = driver.CtxGetDevice(&device); r != CUDA_SUCCESS) return CudaError(driver, r, "cuCtxGetDevice");
  int major = 0, minor = 0;
  if (CUresult r = driver.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device);
      r != CUDA_SUCCESS)
    return CudaError(driver, r, "cuDeviceGetAttribute");
  if (CUresult r = driver.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device);
      r != CUDA_SUCCESS)
    return CudaError(driver, r, "cuDeviceGetAttribute");
  *arch = "sm_" + std::to_string(major) + std::to_string(minor);
  ContextArch()[context] = *arch;
  return ffi::Error::Success();
}

ffi::Error GetFunctionLocked(const Driver& driver, CUcontext context, const KernelLaunch& launch, CUfunction* function,
                             std::string* missing_arch);

// A kernel this process never lowered (a deserialized executable) is compiled and registered by the Python
// resolver, called without the lock (it registers through cuflash_ffi_register_module_image).
ffi::Error GetFunction(const Driver& driver, CUcontext context, const KernelLaunch& launch, CUfunction* function) {
  std::string missing_arch;
  {
    std::lock_guard<std::mutex> lock(StateMutex());
    if (ffi::Error error = GetFunctionLocked(driver, context, launch, function, &missing_arch); error.failure())
      return error;
  }
  if (missing_arch.empty()) return ffi::Error::Success();
  ResolveKernel(launch.name, missing_arch);
  std::lock_guard<std::mutex> lock(StateMutex());
  if (ffi::Error error = GetFunctionLocked(driver, context, launch, function, &missing_arch); error.failure())
    return error;
  if (!missing_arch.empty())
    return ffi::Error(ffi::ErrorCode::kNotFound,
                      "cuflash CUDA handler: no code (CUBIN or PTX) registered for " + launch.name + " on " + missing_arch +
                          " (kernels are compiled and registered when cuflash.jax lowers a call, or when a "
                          "compiled call is instantiated once cuflash.jax is imported)");
  return ffi::Error::Success();
}

// The function for one launch, loading its module on first use; *missing_arch is set (and nothing else done) when
// no CUBIN is registered for it.
ffi::Error GetFunctionLocked(const Driver& driver, CUcontext context, const KernelLaunch& launch, CUfunction* function,
                             std::string* missing_arch) {
  missing_arch->clear();
  auto key = std::make_pair(context, launch.name);
  auto it = Loaded().find(key);
  if (it == Loaded().end()) {
    std::string arch;
    if (ffi::Error error = ContextArchLocked(driver, context, &arch); error.failure()) return error;
    auto image = ModuleImages().find({launch.name, arch});
    if (image == ModuleImages().end()) {
      *missing_arch = arch;
      return ffi::Error::Success();
    }
    CUmodule module;
    if (CUresult r = driver.ModuleLoadData(&module, image->second->image.data()); r != CUDA_SUCCESS)
      return CudaError(driver, r, "cuModuleLoadData of " + launch.name + " for " + arch);
    LoadedKernel kernel;
    if (CUresult r = driver.ModuleGetFunction(&kernel.function, module, image->second->lowered_name.c_str());
        r != CUDA_SUCCESS)
      return CudaError(driver, r, "cuModuleGetFunction(" + image->second->lowered_name + ")");
    it = Loaded().emplace(key, kernel).first;
  }
  LoadedKernel& kernel = it->second;
  if (launch.dynamic_smem_bytes > kernel.max_dynamic_smem) {
    if (CUresult r = driver.FuncSetAttribute(kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             static_cast<int>(launch.dynamic_smem_bytes));
        r != CUDA_SUCCESS)
      return CudaError(driver, r,
                       "raising the dynamic shared memory of " + launch.name + " to " +
                           std::to_string(launch.dynamic_smem_bytes) + " bytes");
    kernel.max_dynamic_smem = launch.dynamic_smem_bytes;
  }
  *function = kernel.function;
  return ffi::Error::Success();
}

// The per-instance state XLA keeps from instantiate to every execution of one compiled call, and deletes with the
// executable. One executable runs on every device of a multi-GPU client, each in its own context, so the functions
// are kept per context.
struct CudaProgramState {
  static constexpr const char* kTypeName = "cuflash.CudaProgramState";
  static inline xla::ffi::TypeId id = {FixedStateTypeId(kTypeName)};  // see FixedStateTypeId

  ProgramPlan plan;
  std::mutex mutex;  // executions on several devices may look up (and, outside a capture, add) at once
  std::vector<std::pair<CUcontext, std::vector<CUfunction>>> functions;  // per context, one per launch
};

const XLA_FFI_TypeInfo kCudaProgramStateTypeInfo = xla::ffi::MakeTypeInfo<CudaProgramState>();

std::atomic<unsigned long long>& CudaInstantiations() {
  static std::atomic<unsigned long long> count{0};
  return count;
}

// Executions that ran while XLA was capturing their stream into a command buffer (a CUDA graph): what shows that
// XLA recorded the custom call, now that it converts thunks to commands after the HLO (JAX 0.11 shows no
// command_buffer computations in the compiled HLO).
std::atomic<unsigned long long>& CudaCapturedExecutions() {
  static std::atomic<unsigned long long> count{0};
  return count;
}

// Everything a context needs before the plan's launches can be recorded in it: each launch's function, its module
// loaded and its dynamic shared memory limit raised. Makes the context current for the duration.
ffi::Error PrepareContext(const Driver& driver, CUcontext context, const ProgramPlan& plan,
                          std::vector<CUfunction>* functions) {
  ContextGuard guard(driver, context);
  if (!guard.pushed()) return ffi::Error::Internal("cuflash CUDA handler: cannot make a CUDA context current");
  functions->assign(plan.launches.size(), nullptr);
  for (std::size_t i = 0; i < plan.launches.size(); ++i)
    if (ffi::Error error = GetFunction(driver, context, plan.launches[i], &(*functions)[i]); error.failure())
      return error;
  return ffi::Error::Success();
}

// The contexts XLA runs in are primary contexts, made active when its client starts, before it compiles anything:
// every active one is prepared (one another library activated costs a few module loads, not a failure). Retaining
// an active context only counts a reference, released after.
ffi::Error PrepareActivePrimaryContexts(const Driver& driver, CudaProgramState* state) {
  int count = 0;
  if (CUresult r = driver.DeviceGetCount(&count); r != CUDA_SUCCESS) return CudaError(driver, r, "cuDeviceGetCount");
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    CUdevice device;
    if (CUresult r = driver.DeviceGet(&device, ordinal); r != CUDA_SUCCESS) return CudaError(driver, r, "cuDeviceGet");
    unsigned flags = 0;
    int active = 0;
    if (CUresult r = driver.DevicePrimaryCtxGetState(device, &flags, &active); r != CUDA_SUCCESS)
      return CudaError(driver, r, "cuDevicePrimaryCtxGetState");
    if (!active) continue;  // a device this process does not use: creating its context would cost its memory
    CUcontext context;
    if (CUresult r = driver.DevicePrimaryCtxRetain(&context, device); r != CUDA_SUCCESS)
      return CudaError(driver, r, "cuDevicePrimaryCtxRetain");
    std::vector<CUfunction> functions;
    ffi::Error error = PrepareContext(driver, context, state->plan, &functions);
    driver.DevicePrimaryCtxRelease(device);
    if (error.failure()) return error;
    state->functions.emplace_back(context, std::move(functions));
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<CudaProgramState>> CudaProgramInstantiate(
    ffi::Span<const uint8_t> params, std::string_view bindings, ffi::Span<const uint8_t> zero_init,
    std::string_view kernels, ffi::Span<const int32_t> grid, ffi::Span<const int32_t> block,
    ffi::Span<const int32_t> smem, std::string_view version, std::string_view tma_tensors,
    ffi::Span<const int64_t> tma_arguments, int64_t tma_twin_address_at, int64_t tma_address_alignment) {
  const Driver& driver = LoadDriver();
  if (!driver.status.empty())
    return ffi::Unexpected<ffi::Error>(ffi::Error::Internal("cuflash CUDA handler: " + driver.status));
  auto state = std::make_unique<CudaProgramState>();
  if (ffi::Error error = DecodeProgramPlan(params, bindings, zero_init, kernels, grid, block, smem, version,
                                           {tma_tensors, tma_arguments, tma_twin_address_at, tma_address_alignment},
                                           &state->plan);
      error.failure())
    return ffi::Unexpected<ffi::Error>(std::move(error));
  if (ffi::Error error = PrepareActivePrimaryContexts(driver, state.get()); error.failure())
    return ffi::Unexpected<ffi::Error>(std::move(error));
  CudaInstantiations().fetch_add(1);
  return state;
}

// The functions of the plan in the stream's context: those instantiate prepared, or, for a context it did not see,
// prepared now, which loads modules and sets attributes and so is refused while the stream is being captured.
ffi::Error FunctionsFor(const Driver& driver, CudaProgramState* state, CUcontext context, CUstream stream,
                        std::vector<CUfunction>* functions) {
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    for (const auto& [prepared, found] : state->functions)
      if (prepared == context) {
        *functions = found;
        return ffi::Error::Success();
      }
  }
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (CUresult r = driver.StreamIsCapturing(stream, &capture); r != CUDA_SUCCESS)
    return CudaError(driver, r, "cuStreamIsCapturing on XLA's stream");
  if (capture != CU_STREAM_CAPTURE_STATUS_NONE)
    return ffi::Error::Internal(
        "cuflash CUDA handler: XLA is capturing a command buffer in a CUDA context that was not active when this "
        "call was instantiated, and loading its kernels there is not allowed during a capture");
  if (ffi::Error error = PrepareContext(driver, context, state->plan, functions); error.failure()) return error;
  std::lock_guard<std::mutex> lock(state->mutex);
  state->functions.emplace_back(context, *functions);
  return ffi::Error::Success();
}

// The call's TMA tensor maps, each encoded by the driver for its tensor's address (the encoding is opaque, so the
// whole map is written; host arithmetic only, no stream: as legal under capture as the rest of params). An address
// TMA cannot take leaves tma_loads 0 (the kernels copy with loads); a map the driver refuses, whose arguments
// check_tiled passed when the call was lowered, is an error, as on the CuPy path (tensor_map.encode_with_driver).
ffi::Error EncodeTmaMaps(const Driver& driver, const ProgramPlan& plan, ProgramCall* call) {
  std::vector<uint64_t> addresses;
  bool usable = false;
  if (ffi::Error error = TmaMapAddresses(plan, call, &addresses, &usable); error.failure() || !usable) return error;
  for (std::size_t i = 0; i < plan.tma_maps.size(); ++i) {
    const TiledArguments& a = plan.tma_maps[i].arguments;
    cuuint64_t dims[5], strides[4];
    cuuint32_t box[5], element_strides[5];
    for (int d = 0; d < 5; ++d) {
      dims[d] = static_cast<cuuint64_t>(a.global_dims[d]);
      box[d] = static_cast<cuuint32_t>(a.box_dims[d]);
      element_strides[d] = static_cast<cuuint32_t>(a.element_strides[d]);
      if (d < 4) strides[d] = static_cast<cuuint64_t>(a.global_strides[d]);
    }
    CUtensorMap map;
    if (CUresult r = driver.TensorMapEncodeTiled(
            &map, static_cast<CUtensorMapDataType>(a.data_type), static_cast<cuuint32_t>(a.rank),
            reinterpret_cast<void*>(static_cast<std::uintptr_t>(addresses[i])), dims, strides, box, element_strides,
            static_cast<CUtensorMapInterleave>(a.interleave), static_cast<CUtensorMapSwizzle>(a.swizzle),
            static_cast<CUtensorMapL2promotion>(a.l2_promotion), static_cast<CUtensorMapFloatOOBfill>(a.oob_fill));
        r != CUDA_SUCCESS)
      return CudaError(driver, r, std::string("cuTensorMapEncodeTiled of ") + plan.tma_maps[i].tensor->name + "'s map");
    static_assert(sizeof(CUtensorMap) == sizeof(TmaMaps::q), "AttentionParams.tma holds CUtensorMaps");
    std::memcpy(reinterpret_cast<unsigned char*>(&call->params) + plan.tma_maps[i].map_at, &map, sizeof map);
  }
  return ffi::Error::Success();
}

ffi::Error CudaProgramExecute(CUstream stream, CudaProgramState* state, ffi::RemainingArgs args,
                              ffi::RemainingRets rets) {
  const Driver& driver = LoadDriver();
  if (!driver.status.empty()) return ffi::Error::Internal("cuflash CUDA handler: " + driver.status);
  const ProgramPlan& plan = state->plan;

  ProgramCall call;
  if (ffi::Error error = BindProgramBuffers(plan, args, rets, &call); error.failure()) return error;
  if (ffi::Error error = EncodeTmaMaps(driver, plan, &call); error.failure()) return error;

  CUcontext context;
  if (CUresult r = driver.StreamGetCtx(stream, &context); r != CUDA_SUCCESS)
    return CudaError(driver, r, "cuStreamGetCtx on XLA's stream");
  std::vector<CUfunction> functions;
  if (ffi::Error error = FunctionsFor(driver, state, context, stream, &functions); error.failure()) return error;
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  if (CUresult r = driver.StreamIsCapturing(stream, &capture); r != CUDA_SUCCESS)
    return CudaError(driver, r, "cuStreamIsCapturing on XLA's stream");
  if (capture == CU_STREAM_CAPTURE_STATUS_ACTIVE) CudaCapturedExecutions().fetch_add(1);
  ContextGuard guard(driver, context);
  if (!guard.pushed()) return ffi::Error::Internal("cuflash CUDA handler: cannot make XLA's CUDA context current");

  for (const BoundBuffer& buffer : call.buffers) {
    if (!buffer.zero_init || buffer.bytes == 0) continue;
    if (CUresult r = driver.MemsetD8Async(reinterpret_cast<CUdeviceptr>(buffer.data), 0, buffer.bytes, stream);
        r != CUDA_SUCCESS)
      return CudaError(driver, r, std::string("clearing ") + buffer.field->name);
  }
  for (std::size_t i = 0; i < plan.launches.size(); ++i) {
    const KernelLaunch& launch = plan.launches[i];
    // cuLaunchKernel copies the argument bytes when it returns (a captured launch keeps its own copy in the graph
    // node), so a local struct is fine.
    void* arguments[] = {&call.params};
    if (CUresult r = driver.LaunchKernel(functions[i], launch.grid[0], launch.grid[1], launch.grid[2],
                                         launch.block[0], launch.block[1], launch.block[2],
                                         launch.dynamic_smem_bytes, stream, arguments, nullptr);
        r != CUDA_SUCCESS)
      return CudaError(driver, r, "cuLaunchKernel of " + launch.name);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuflash::ffi_handlers

XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashProgramCudaInstantiate, cuflash::ffi_handlers::CudaProgramInstantiate,
                              CUFLASH_PROGRAM_PLAN_ATTRS(xla::ffi::Ffi::BindInstantiate()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashProgramCuda, cuflash::ffi_handlers::CudaProgramExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>()
                                  .Ctx<xla::ffi::State<cuflash::ffi_handlers::CudaProgramState>>()
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

extern "C" {

int cuflash_ffi_cuda_handlers(cuflash_ffi_handler_bundle* bundle) {
  using namespace cuflash::ffi_handlers;
  return FillHandlerBundle<CudaProgramState>(bundle, CuflashProgramCudaInstantiate, CuflashProgramCuda,
                                             kCudaProgramStateTypeInfo);
}

unsigned long long cuflash_ffi_cuda_instantiations(void) {
  return cuflash::ffi_handlers::CudaInstantiations().load();
}

unsigned long long cuflash_ffi_cuda_captured_executions(void) {
  return cuflash::ffi_handlers::CudaCapturedExecutions().load();
}

void cuflash_ffi_register_module_image(const char* name_expr, const char* arch, const char* lowered_name,
                                       const void* image, unsigned long long image_size) {
  using namespace cuflash::ffi_handlers;
  auto entry = std::make_shared<ModuleImage>();
  entry->lowered_name = lowered_name;
  const auto* bytes = static_cast<const unsigned char*>(image);
  entry->image.assign(bytes, bytes + image_size);
  std::lock_guard<std::mutex> lock(StateMutex());
  ModuleImages()[{name_expr, arch}] = std::move(entry);
}

int cuflash_ffi_module_image_registered(const char* name_expr, const char* arch) {
  using namespace cuflash::ffi_handlers;
  std::lock_guard<std::mutex> lock(StateMutex());
  return ModuleImages().count({name_expr, arch}) ? 1 : 0;
}

const char* cuflash_ffi_cuda_driver_status(void) { return cuflash::ffi_handlers::LoadDriver().status.c_str(); }

}  // extern "C"

#else  // !CUFLASH_FFI_WITH_CUDA: built without cuda.h; the CUDA platform is not offered.

extern "C" {
int cuflash_ffi_cuda_handlers(cuflash_ffi_handler_bundle*) { return 0; }
unsigned long long cuflash_ffi_cuda_instantiations(void) { return 0; }
unsigned long long cuflash_ffi_cuda_captured_executions(void) { return 0; }
void cuflash_ffi_register_module_image(const char*, const char*, const char*, const void*, unsigned long long) {}
int cuflash_ffi_module_image_registered(const char*, const char*) { return 0; }
const char* cuflash_ffi_cuda_driver_status(void) {
  return "the cuflash FFI library was built without the CUDA driver API header (install nvidia-cuda-runtime)";
}
}

#endif
