/* The C ABI between a simulator library and Python (cuflash/sim/_library.py
   declares the same text with cffi). Plain C: keep it parseable by cffi's cdef
   (no preprocessor lines besides the include guard, which _library.py strips). */
#ifndef CUFLASH_SIM_ABI_H
#define CUFLASH_SIM_ABI_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cuflash_sim_launch_request {
  /* inputs */
  const char* kernel_name;
  unsigned grid[3];
  unsigned block[3];
  unsigned long long dynamic_smem_bytes;
  const void* params;
  unsigned long long params_size;
  int num_buffers;
  const unsigned long long* buffer_begin;
  const unsigned long long* buffer_bytes;
  const int* buffer_writable;
  int num_workers; /* 0: one per core */
  unsigned long long copy_landing_seed; /* normal mode: seeds the moments at which cp.async copies land */
  char* profile_out;                    /* profile mode: the bank-conflict report is written here */
  unsigned long long profile_out_bytes;
  /* outputs */
  unsigned long long bytes_read;
  unsigned long long bytes_written;
  char error[4096];
} cuflash_sim_launch_request;

/* 0 on success; otherwise request->error holds the message. */
int cuflash_sim_launch(const char* name_expr, cuflash_sim_launch_request* request);
/* The checking mode this library was built for: "normal", "race" or "asan". */
const char* cuflash_sim_mode(void);
/* "path offset size" lines for every leaf field of cuflash::AttentionParams, then "sizeof N". */
const char* cuflash_sim_params_layout(void);

#ifdef __cplusplus
}
#endif

#endif
