"""Tensor maps for the TMA (cp.async.bulk.tensor): the 128 bytes a kernel takes as `arch::TensorMap`.

`encode_tiled(...)` takes cuTensorMapEncodeTiled's arguments. On the simulator it checks every requirement
the CUDA driver API documents for them, raising a ValueError that names the argument and the rule (the
driver itself answers CUDA_ERROR_INVALID_VALUE), and returns the simulator twin's encoding
(cuda_src/arch/sim/sim_tma.h, TensorMapTwin). With `device=True` it runs the same checks and then asks the
driver (cuda.bindings.driver) for the real, opaque encoding.

Enumerations take the driver's values (the CU_TENSOR_MAP_* constants below).
"""

from __future__ import annotations

import struct
from typing import Sequence

# CUtensorMapDataType
UINT8, UINT16, UINT32, INT32, UINT64, INT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16, FLOAT32_FTZ, TFLOAT32, \
    TFLOAT32_FTZ = range(13)
ELEMENT_BYTES = {UINT8: 1, UINT16: 2, UINT32: 4, INT32: 4, UINT64: 8, INT64: 8, FLOAT16: 2, FLOAT32: 4,
                 FLOAT64: 8, BFLOAT16: 2, FLOAT32_FTZ: 4, TFLOAT32: 4, TFLOAT32_FTZ: 4}
FLOATING = {FLOAT16, FLOAT32, FLOAT64, BFLOAT16, FLOAT32_FTZ, TFLOAT32, TFLOAT32_FTZ}
# CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill
INTERLEAVE_NONE, INTERLEAVE_16B, INTERLEAVE_32B = range(3)
SWIZZLE_NONE, SWIZZLE_32B, SWIZZLE_64B, SWIZZLE_128B = range(4)
SWIZZLE_BYTES = {SWIZZLE_NONE: 0, SWIZZLE_32B: 32, SWIZZLE_64B: 64, SWIZZLE_128B: 128}
L2_PROMOTION_NONE, L2_PROMOTION_64B, L2_PROMOTION_128B, L2_PROMOTION_256B = range(4)
OOB_FILL_NONE, OOB_FILL_NAN_REQUEST_ZERO_FMA = range(2)

TENSOR_MAP_BYTES = 128
_TWIN_MAGIC = 0x4D544643  # "CFTM", sim_tma.h's kTensorMapMagic
# sim_tma.h's TensorMapTwin, field by field (little-endian, no implicit padding).
_TWIN_LAYOUT = struct.Struct("<I8BIQ5II4Q5B5B38x")
assert _TWIN_LAYOUT.size == TENSOR_MAP_BYTES
# Where the twin holds the global address (after the magic, the eight enum bytes and a 32-bit word): a caller that
# re-encodes only the address patches it there.
TWIN_ADDRESS = struct.Struct("<Q")
TWIN_ADDRESS_OFFSET = 16
assert _TWIN_LAYOUT.format.startswith("<I8BIQ") and struct.calcsize("<I8BI") == TWIN_ADDRESS_OFFSET

# cuTensorMapEncodeTiled's arguments but the address, in the driver's order, as int64 words with the per-dimension
# lists padded to rank 5 (dims and box with 1, strides with 0, element strides with 1): what a caller that encodes
# maps elsewhere (the JAX CUDA handler, cuda_src/ffi/program_call.h's TiledArguments) takes, word by word.
TILED_ARGUMENT_WORDS = 25  # dtype, rank, 5 dims, 4 strides, 5 box dims, 5 element strides, 4 enums


def address_alignment(interleave: int = INTERLEAVE_NONE) -> int:
    """The alignment cuTensorMapEncodeTiled requires of globalAddress."""
    return 32 if interleave == INTERLEAVE_32B else 16


def tiled_argument_words(dtype: int, rank: int, global_dims: Sequence[int], global_strides: Sequence[int],
                         box_dims: Sequence[int], element_strides: Sequence[int], *, interleave: int = INTERLEAVE_NONE,
                         swizzle: int = SWIZZLE_NONE, l2_promotion: int = L2_PROMOTION_NONE,
                         oob_fill: int = OOB_FILL_NONE) -> list[int]:
    """TILED_ARGUMENT_WORDS words: the arguments of one map (check_tiled's, the address left out)."""
    pad = lambda values, fill, n: [int(v) for v in values] + [fill] * (n - len(values))  # noqa: E731
    words = [dtype, rank, *pad(global_dims, 1, 5), *pad(global_strides, 0, 4), *pad(box_dims, 1, 5),
             *pad(element_strides, 1, 5), interleave, swizzle, l2_promotion, oob_fill]
    assert len(words) == TILED_ARGUMENT_WORDS
    return words


def check_tiled(dtype: int, rank: int, global_address: int, global_dims: Sequence[int],
                global_strides: Sequence[int], box_dims: Sequence[int], element_strides: Sequence[int],
                interleave: int = INTERLEAVE_NONE, swizzle: int = SWIZZLE_NONE,
                l2_promotion: int = L2_PROMOTION_NONE, oob_fill: int = OOB_FILL_NONE) -> None:
    """cuTensorMapEncodeTiled's documented requirements; a ValueError naming the argument and the rule."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"tensorDataType {dtype} is not a CUtensorMapDataType")
    if interleave not in (INTERLEAVE_NONE, INTERLEAVE_16B, INTERLEAVE_32B):
        raise ValueError(f"interleave {interleave} is not a CUtensorMapInterleave")
    if swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle {swizzle} is not a CUtensorMapSwizzle")
    if l2_promotion not in (L2_PROMOTION_NONE, L2_PROMOTION_64B, L2_PROMOTION_128B, L2_PROMOTION_256B):
        raise ValueError(f"l2Promotion {l2_promotion} is not a CUtensorMapL2promotion")
    if oob_fill not in (OOB_FILL_NONE, OOB_FILL_NAN_REQUEST_ZERO_FMA):
        raise ValueError(f"oobFill {oob_fill} is not a CUtensorMapFloatOOBfill")
    if not 1 <= rank <= 5:
        raise ValueError(f"tensorRank {rank}: must be non-zero and at most 5")
    if interleave != INTERLEAVE_NONE and rank < 3:
        raise ValueError(f"tensorRank {rank}: must be at least 3 with interleave")
    for name, values, want in (("globalDim", global_dims, rank), ("globalStrides", global_strides, rank - 1),
                               ("boxDim", box_dims, rank), ("elementStrides", element_strides, rank)):
        if len(values) != want:
            raise ValueError(f"{name} has {len(values)} entries; a rank-{rank} map takes {want}")
    align = address_alignment(interleave)
    if global_address % align:
        raise ValueError(f"globalAddress 0x{global_address:x}: must be {align}-byte aligned"
                         + (" with 32B interleave" if align == 32 else ""))
    for i, d in enumerate(global_dims):
        if not 1 <= d <= 2**32:
            raise ValueError(f"globalDim[{i}] = {d}: must be non-zero and at most 2^32")
    stride_align = 32 if interleave == INTERLEAVE_32B else 16
    for i, s in enumerate(global_strides):
        if s % stride_align:
            raise ValueError(f"globalStrides[{i}] = {s}: must be a multiple of {stride_align}")
        if not 0 < s < 2**40:
            raise ValueError(f"globalStrides[{i}] = {s}: must be positive and less than 2^40")
    element_bytes = ELEMENT_BYTES[dtype]
    for i, b in enumerate(box_dims):
        if not 1 <= b <= 256:
            raise ValueError(f"boxDim[{i}] = {b}: must be non-zero and at most 256")
    if interleave == INTERLEAVE_NONE and box_dims[0] * element_bytes % 16:
        raise ValueError(f"boxDim[0] = {box_dims[0]}: boxDim[0] * {element_bytes} bytes must be a multiple of 16 "
                         "bytes without interleave")
    for i, e in enumerate(element_strides):
        if not 1 <= e <= 8:
            raise ValueError(f"elementStrides[{i}] = {e}: must be non-zero and at most 8")
    if interleave == INTERLEAVE_NONE and swizzle != SWIZZLE_NONE and \
            box_dims[0] * element_bytes > SWIZZLE_BYTES[swizzle]:
        raise ValueError(f"boxDim[0] = {box_dims[0]}: the inner box ({box_dims[0] * element_bytes} bytes) must "
                         f"not exceed the {SWIZZLE_BYTES[swizzle]}-byte swizzle span")
    if interleave == INTERLEAVE_32B and swizzle != SWIZZLE_32B:
        raise ValueError("swizzle: 32B interleave needs the 32B swizzle")
    if oob_fill == OOB_FILL_NAN_REQUEST_ZERO_FMA and dtype not in FLOATING:
        raise ValueError(f"oobFill NAN_REQUEST_ZERO_FMA needs a floating-point tensorDataType, not {dtype}")


def encode_tiled(dtype: int, rank: int, global_address: int, global_dims: Sequence[int],
                 global_strides: Sequence[int], box_dims: Sequence[int], element_strides: Sequence[int] | None = None,
                 *, swizzle: int = SWIZZLE_NONE, interleave: int = INTERLEAVE_NONE,
                 l2_promotion: int = L2_PROMOTION_NONE, oob_fill: int = OOB_FILL_NONE, device: bool = False) -> bytes:
    """The 128 bytes of a tiled tensor map: cuTensorMapEncodeTiled's arguments (dims and strides innermost
    first; global_strides has rank - 1 entries, in bytes, for dimensions 1 .. rank - 1). device=False: the
    simulator twin's encoding; device=True: the driver's (needs a CUDA GPU and cuda-bindings). The enums are
    keyword-only (the driver's positional order puts interleave before swizzle)."""
    if element_strides is None:
        element_strides = [1] * rank
    global_dims, global_strides = [int(v) for v in global_dims], [int(v) for v in global_strides]
    box_dims, element_strides = [int(v) for v in box_dims], [int(v) for v in element_strides]
    check_tiled(dtype, rank, global_address, global_dims, global_strides, box_dims, element_strides, interleave,
                swizzle, l2_promotion, oob_fill)
    if device:
        return encode_with_driver(dtype, rank, global_address, global_dims, global_strides, box_dims,
                                  element_strides, interleave=interleave, swizzle=swizzle,
                                  l2_promotion=l2_promotion, oob_fill=oob_fill)
    if interleave != INTERLEAVE_NONE:
        raise ValueError("interleave: interleaved layouts are not modeled by the simulator")
    pad = lambda values, fill: list(values) + [fill] * (5 - len(values))  # noqa: E731
    return _TWIN_LAYOUT.pack(_TWIN_MAGIC, dtype, rank, interleave, swizzle, l2_promotion, oob_fill,
                             ELEMENT_BYTES[dtype], 0, 0, global_address, *pad([d - 1 for d in global_dims], 0), 0,
                             *pad(global_strides, 0)[:4], *pad([b - 1 for b in box_dims], 0),
                             *pad(element_strides, 1))


def encode_with_driver(dtype, rank, global_address, global_dims, global_strides, box_dims, element_strides, *,
                       interleave=INTERLEAVE_NONE, swizzle=SWIZZLE_NONE, l2_promotion=L2_PROMOTION_NONE,
                       oob_fill=OOB_FILL_NONE) -> bytes:
    """cuTensorMapEncodeTiled through cuda.bindings.driver, unchecked: for callers whose arguments check_tiled
    already passed (encode_tiled; a prepared program re-encoding its maps per call for a new address)."""
    from cuda.bindings import driver

    # cuda-bindings converts no Python int into its cuuint32_t/cuuint64_t (TypeError "Cannot convert int to
    # cuda.bindings.driver.cuuint32_t", seen on the first H200 run): every count goes in wrapped.
    u32, u64 = driver.cuuint32_t, driver.cuuint64_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(dtype), u32(rank), global_address, [u64(d) for d in global_dims],
        [u64(s) for s in global_strides], [u32(b) for b in box_dims], [u32(e) for e in element_strides],
        driver.CUtensorMapInterleave(interleave), driver.CUtensorMapSwizzle(swizzle),
        driver.CUtensorMapL2promotion(l2_promotion), driver.CUtensorMapFloatOOBfill(oob_fill))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {err!r}")
    words = [int(w) for w in tensor_map.opaque]  # CUtensorMap: 16 64-bit words
    return struct.pack("<16Q", *words)
