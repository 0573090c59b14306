/* The C ABI of the cuflash JAX FFI library: what Python (cuflash/jax/_ffi.py)
   declares to cffi from this very text, besides the XLA handler symbols.
   Plain C, no preprocessor lines besides the include guard (which Python strips). */
#ifndef CUFLASH_FFI_ABI_H
#define CUFLASH_FFI_ABI_H

#ifdef __cplusplus
extern "C" {
#endif

/* Addresses of the XLA FFI handlers (XLA_FFI_Handler*), for jax.ffi.register_ffi_target.
   The CUDA one is NULL when the library was built without the CUDA driver API header. */
void* cuflash_ffi_cpu_handler(void);
void* cuflash_ffi_cuda_handler(void);

/* CPU registry: kernel name expression -> the simulator entry point that runs it
   (int cuflash_sim_launch(const char*, cuflash_sim_launch_request*), see arch/sim/sim_abi.h).
   Filled by Python while lowering; read by the CPU handler at run time. */
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

/* CUDA registry: (kernel name expression, "sm_XY") -> the CUBIN NVRTC built and the
   lowered (mangled) name of the kernel in it. The bytes are copied. */
void cuflash_ffi_register_cubin(const char* name_expr, const char* arch, const char* lowered_name,
                                const void* cubin, unsigned long long cubin_size);
int cuflash_ffi_cubin_registered(const char* name_expr, const char* arch);

/* Resolver for kernels this process never lowered (an executable deserialized from jax.export): the handlers
   call it with the kernel's name expression and "sim" (CPU) or "sm_XY" (CUDA) when their registry lacks it,
   without holding any lock; it registers the kernel as lowering would and returns 0, or nonzero if it cannot.
   Python installs it when cuflash.jax is imported. */
typedef int (*cuflash_ffi_resolver)(const char* name_expr, const char* target);
void cuflash_ffi_set_resolver(cuflash_ffi_resolver resolver);

/* The cuflash version the library was built for: calls lowered by another version are refused. */
const char* cuflash_ffi_version(void);

/* Loads the CUDA driver (libcuda.so.1) and its entry points if not done yet:
   "" when usable, else why not. Never needs a GPU to answer. */
const char* cuflash_ffi_cuda_driver_status(void);

/* sizeof(cuflash::AttentionParams) and offsetof of a pointer field (-1 if unknown),
   as the handlers see them, so a test can compare with cuflash/kernels/params.py. */
unsigned long long cuflash_ffi_params_size(void);
long long cuflash_ffi_pointer_field_offset(const char* name);

#ifdef __cplusplus
}
#endif

#endif
