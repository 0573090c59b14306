/* The C ABI of the cuflash JAX FFI library: what Python (cuflash/jax/_ffi.py)
   declares to cffi from this very text, besides the XLA handler symbols.
   Plain C, no preprocessor lines besides the include guard (which Python strips). */
#ifndef CUFLASH_FFI_ABI_H
#define CUFLASH_FFI_ABI_H

#ifdef __cplusplus
extern "C" {
#endif

/* One platform's XLA FFI handler bundle, for jax.ffi.register_ffi_type and jax.ffi.register_ffi_target:
   the instantiate stage (decodes the attributes and resolves the kernels once per compiled call, returning a
   state of the registered type) and the execute stage (binds the buffers and launches). The state type is
   registered under its name with the id *state_type_id already holds (fixed, see program_call.h). */
typedef struct cuflash_ffi_handler_bundle {
  void* instantiate;           /* XLA_FFI_Handler* */
  void* execute;               /* XLA_FFI_Handler* */
  const char* state_type_name; /* unique in the process */
  void* state_type_id;         /* XLA_FFI_TypeId* (an int64) */
  void* state_type_info;       /* XLA_FFI_TypeInfo* (the state's deleter) */
} cuflash_ffi_handler_bundle;
/* Fill *bundle and return 1; the CUDA one returns 0 when the library was built without the CUDA driver API
   header (the CUDA platform is then not offered). */
int cuflash_ffi_cpu_handlers(cuflash_ffi_handler_bundle* bundle);
int cuflash_ffi_cuda_handlers(cuflash_ffi_handler_bundle* bundle);

/* How many states each platform's instantiate stage has created: one per compiled call, however often the
   executable runs. */
unsigned long long cuflash_ffi_cpu_instantiations(void);
unsigned long long cuflash_ffi_cuda_instantiations(void);
/* How many CUDA executions ran while their stream was being captured (XLA recording a command buffer). */
unsigned long long cuflash_ffi_cuda_captured_executions(void);

/* The traits an XLA_FFI_Handler* reports when XLA registers it (bit 0: command-buffer compatible): 1 and
   *traits set, or 0 if the handler refused the metadata query. Ask execute handlers (what XLA asks). */
int cuflash_ffi_handler_traits(void* handler, unsigned* traits);

/* CPU registry: kernel name expression -> the simulator entry point that runs it
   (int cuflash_sim_launch(const char*, cuflash_sim_launch_request*), see arch/sim/sim_abi.h).
   Filled by Python while lowering; read by the CPU handler when it instantiates a compiled call (and again when
   an execution finds an entry replaced or removed since). */
void cuflash_ffi_register_sim_kernel(const char* name_expr, void* sim_launch_entry);
void cuflash_ffi_unregister_sim_kernel(const char* name_expr);
int cuflash_ffi_sim_kernel_registered(const char* name_expr);

/* Simulated launches the CPU handler ran while recording was on, in order: what
   cuflash.sim.record() gives for the NumPy path (kernel, launch shape, counted global traffic). */
typedef struct cuflash_ffi_launch_record {
  char kernel[512];
  unsigned grid[3];
  unsigned block[3];
  unsigned long long dynamic_smem_bytes;
  unsigned long long bytes_read;
  unsigned long long bytes_written;
} cuflash_ffi_launch_record;
/* enabled = 1 starts recording (clearing earlier records), 0 stops it. */
void cuflash_ffi_sim_record(int enabled);
int cuflash_ffi_sim_recorded_count(void);
/* Copies record `index` into *record: 1 on success, 0 when index is out of range. */
int cuflash_ffi_sim_recorded(int index, cuflash_ffi_launch_record* record);
/* Record `index`'s bank-conflict report from a profile-mode simulator ("" otherwise, or out of range); valid until
   recording starts again. */
const char* cuflash_ffi_sim_recorded_profile(int index);

/* CUDA registry: (kernel name expression, the device's "sm_XY") -> the module image NVRTC built for
   that device (its CUBIN, or NUL-terminated PTX for a GPU newer than NVRTC) and the lowered (mangled)
   name of the kernel in it. The bytes are copied. */
void cuflash_ffi_register_module_image(const char* name_expr, const char* arch, const char* lowered_name,
                                       const void* image, unsigned long long image_size);
int cuflash_ffi_module_image_registered(const char* name_expr, const char* arch);

/* Resolver for kernels this process never lowered (an executable deserialized from jax.export): the handlers'
   instantiate stages call it with the kernel's name expression and "sim" (CPU) or "sm_XY" (CUDA) when their
   registry lacks it, without holding any lock (so do execute stages meeting what instantiate could not
   prepare: a CPU registry entry replaced or removed since, a CUDA context made active since); it registers the
   kernel as lowering would and returns 0, or nonzero if it cannot. Python installs it when cuflash.jax is
   imported. */
typedef int (*cuflash_ffi_resolver)(const char* name_expr, const char* target);
void cuflash_ffi_set_resolver(cuflash_ffi_resolver resolver);

/* The cuflash version the library was built for: calls lowered by another version are refused. */
const char* cuflash_ffi_version(void);

/* Loads the CUDA driver (libcuda.so.1) and its entry points if not done yet:
   "" when usable, else why not. Never needs a GPU to answer. */
const char* cuflash_ffi_cuda_driver_status(void);

/* Where the TMA attribute's words of one map (program_call.h's TiledArguments) hold cuTensorMapEncodeTiled's
   argument `name` ("data_type", "rank", "global_dims", "global_strides", "box_dims", "element_strides",
   "interleave", "swizzle", "l2_promotion", "oob_fill"): its first word's index, -1 if unknown; so a test can
   compare with cuflash/kernels/tensor_map.py's tiled_argument_words. */
long long cuflash_ffi_tiled_argument_word(const char* name);

/* sizeof(cuflash::AttentionParams) and offsetof of a pointer field (-1 if unknown),
   as the handlers see them, so a test can compare with cuflash/kernels/params.py. */
unsigned long long cuflash_ffi_params_size(void);
long long cuflash_ffi_pointer_field_offset(const char* name);

#ifdef __cplusplus
}
#endif

#endif
