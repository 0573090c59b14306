// CPU twins of Hopper's tensor memory accelerator (TMA), for the arch layer to wrap (arch.cuh owns the
// names kernels see; the runtime side is sim_tma.cpp):
//   cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes  -> tma_load
//   cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group                         -> tma_store
//   cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32                         -> bulk_reduce_add_f32
//   cp.async.bulk.commit_group / cp.async.bulk.wait_group{.read} N                     -> tma_store_commit / _wait_read
// and the simulator's encoding of a tensor map (CUtensorMap's 128 bytes; on a GPU the driver's opaque
// encoding made by cuTensorMapEncodeTiled, here this one, made by cuflash.kernels.tensor_map.encode_tiled
// after the same argument checks).
//
// Included by cuda_sim.h; not a separate API for kernels.
#pragma once

namespace cuflash::sim {

// The twin's tensor map, inside the 128 bytes of arch::TensorMap. Little-endian, no padding the Python
// encoder (cuflash/kernels/tensor_map.py, _TWIN_LAYOUT) does not spell out: keep the two in step.
// Enumerations take the driver's values (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion,
// ...FloatOOBfill), so a map reads the same in both encodings' terms.
struct TensorMapTwin {
  uint32_t magic;             // kTensorMapMagic: anything else was not made by encode_tiled
  uint8_t data_type;          // CUtensorMapDataType
  uint8_t rank;               // 1 .. 5
  uint8_t interleave;         // CUtensorMapInterleave (only NONE is encoded)
  uint8_t swizzle;            // CUtensorMapSwizzle: 0 none, 1 32B, 2 64B, 3 128B
  uint8_t l2_promotion;       // CUtensorMapL2promotion (no effect on a CPU)
  uint8_t oob_fill;           // CUtensorMapFloatOOBfill: 0 zeros, 1 NaN (NAN_REQUEST_ZERO_FMA)
  uint8_t element_bytes;      // of data_type
  uint8_t reserved0;
  uint32_t reserved1;
  uint64_t global_address;    // 16-byte aligned
  uint32_t global_dims_minus_1[5];  // dims are 1 .. 2^32
  uint32_t reserved2;
  uint64_t global_strides[4];  // bytes between consecutive indices of dimensions 1 .. rank - 1
  uint8_t box_dims_minus_1[5];     // box dims are 1 .. 256
  uint8_t element_strides[5];      // 1 .. 8
  uint8_t reserved3[38];
};
constexpr uint32_t kTensorMapMagic = 0x4d544643u;  // "CFTM"
static_assert(sizeof(TensorMapTwin) == 128, "the twin's tensor map fills CUtensorMap's 128 bytes");
static_assert(offsetof(TensorMapTwin, global_address) == 16 && offsetof(TensorMapTwin, global_strides) == 48 &&
                  offsetof(TensorMapTwin, box_dims_minus_1) == 80 && offsetof(TensorMapTwin, element_strides) == 85,
              "keep in step with cuflash/kernels/tensor_map.py");

// One thread issues each. coords: `rank` signed element coordinates of the box's first element (innermost
// first); the rank must be the map's. map: the kernel's __grid_constant__ parameter (its address).
CUFLASH_SIM_API void tma_load(const Site& site, void* smem_dst, const void* map, const int* coords, unsigned rank,
                              uint64_t* bar);
CUFLASH_SIM_API void tma_store(const Site& site, const void* map, const void* smem_src, const int* coords,
                               unsigned rank);
// bytes / 4 float32 at smem_src added to as many at gmem_dst, in the thread's current bulk async-group.
CUFLASH_SIM_API void bulk_reduce_add_f32(const Site& site, float* gmem_dst, const void* smem_src, unsigned bytes);
CUFLASH_SIM_API void tma_store_commit(const Site& site);
CUFLASH_SIM_API void tma_store_wait_read(const Site& site, unsigned newest_groups_left_pending);
CUFLASH_SIM_API void tma_store_wait(const Site& site, unsigned newest_groups_left_pending);

}  // namespace cuflash::sim
