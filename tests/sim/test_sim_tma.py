"""The TMA twins (cp.async.bulk.tensor loads and stores, bulk groups) and the tensor-map twin on the simulator:
1-D to 5-D loads against NumPy with out-of-bounds fill, every swizzle mode unit by unit with the model the wgmma
tests use (simkit.swizzled_address), a TMA load feeding a wgmma, clipped stores; each strict check on a planted
bug; every encode_tiled argument rule. Kernels: tests/sim/kernels/hopper_tma.cu (tests/test_arch_hopper_tma.py
checks their SASS)."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels import tensor_map as tm
from cuflash.kernels.program import KernelInstance
from simkit import KERNELS, swizzled_address

SOURCE = KERNELS / "hopper_tma.cu"
BOX_AT = 1024  # hopper_tma.cu's kBoxAt

ARGS_DTYPE = np.dtype({"names": ["map", "out", "image", "coords", "box_bytes", "box_offset", "mode", "span"],
                       "formats": ["V128", np.uint64, np.uint64, (np.int32, 5), np.int32, np.int32, np.int32,
                                   np.int32],
                       "offsets": [0, 128, 136, 144, 164, 168, 172, 176], "itemsize": 192})
GEMM_DTYPE = np.dtype({"names": ["map_a", "map_b", "out", "mode"], "formats": ["V128", "V128", np.uint64, np.int32],
                       "offsets": [0, 128, 256, 264], "itemsize": 320})
DTYPES = {np.dtype(np.uint16): tm.UINT16, np.dtype(np.float16): tm.FLOAT16, np.dtype(np.float32): tm.FLOAT32,
          np.dtype(np.uint8): tm.UINT8}


def inst(name: str) -> KernelInstance:
    return KernelInstance(str(SOURCE), f"simtma::{name}")


NAMES = [f"load_kernel<{r}>" for r in range(1, 6)] + ["store_kernel<2>", "store_kernel<3>", "tma_wgmma_kernel",
                                                        "ring_kernel", "reduce_kernel"]


@pytest.fixture(scope="module", params=["normal", "race"])
def mode(request):
    sim.precompile([inst(n) for n in NAMES], modes=(request.param,))
    with sim.checking(request.param):
        yield request.param


def tensor(dims, dtype, seed=0):
    """A global tensor of dims (innermost first) whose rows are padded to a 16-byte multiple (a pitch), and the
    map's view of it: the array (NumPy order, outermost first) and the byte strides of dims 1 ..."""
    dtype = np.dtype(dtype)
    pitch = -(-dims[0] * dtype.itemsize // 16) * 16 // dtype.itemsize
    rng = np.random.default_rng(seed)
    shape = tuple(reversed(dims[1:])) + (pitch,)
    if dtype.kind == "f":
        base = rng.integers(-8, 8, size=shape).astype(dtype)
    else:
        base = rng.integers(1, np.iinfo(dtype).max, size=shape).astype(dtype)
    strides = [base.strides[len(dims) - 1 - d] for d in range(1, len(dims))]
    return base, strides


def make_map(base, dims, strides, box, swizzle=0, oob_fill=0, element_strides=None):
    code = {0: tm.SWIZZLE_NONE, 32: tm.SWIZZLE_32B, 64: tm.SWIZZLE_64B, 128: tm.SWIZZLE_128B}[swizzle]
    return tm.encode_tiled(DTYPES[base.dtype], len(dims), base.ctypes.data, dims, strides, box, element_strides,
                           swizzle=code, oob_fill=oob_fill)


def expected_box(base, dims, coords, box, fill=0, element_strides=None):
    """The box as TMA loads it, NumPy order (outermost first): elements outside dims are `fill`."""
    rank = len(dims)
    element_strides = element_strides or [1] * rank
    counts = [-(-box[d] // element_strides[d]) for d in range(rank)]
    out = np.full(tuple(reversed(counts)), fill, base.dtype)
    for index in np.ndindex(*out.shape):
        c = [coords[d] + index[rank - 1 - d] * element_strides[d] for d in range(rank)]
        if all(0 <= c[d] < dims[d] for d in range(rank)):
            out[index] = base[tuple(reversed(c))]
    return out


def swizzled_image(dense: bytes, swizzle: int) -> tuple[bytes, int]:
    """The box's dense bytes placed unit by unit at their swizzled addresses (the box at BOX_AT), and the span."""
    places = [swizzled_address(BOX_AT + 16 * u, swizzle) - BOX_AT for u in range(len(dense) // 16)]
    span = max(places) + 16
    image = bytearray(span)
    for u, at in enumerate(places):
        image[at:at + 16] = dense[16 * u:16 * u + 16]
    return bytes(image), span


def run_load(base, dims, strides, box, coords, *, swizzle=0, oob_fill=0, element_strides=None, bug=0,
             box_offset=0):
    rank = len(dims)
    tmap = make_map(base, dims, strides, box, swizzle, oob_fill, element_strides)
    counts = [-(-box[d] // (element_strides or [1] * rank)[d]) for d in range(rank)]
    box_bytes = int(np.prod(counts)) * base.dtype.itemsize
    span = max(swizzled_address(BOX_AT + 16 * u, swizzle) - BOX_AT for u in range(box_bytes // 16)) + 16
    out = np.zeros(span + 16, np.uint8)
    a = np.zeros((), ARGS_DTYPE)
    a["map"] = tmap
    a["out"] = out.ctypes.data
    a["coords"][:rank] = coords
    a["box_bytes"], a["box_offset"], a["mode"], a["span"] = box_bytes, box_offset, bug, span
    sim.launch(inst(f"load_kernel<{rank}>"), 1, 64, BOX_AT + span + 32, a[()], [base, out])
    return out[:span].tobytes()


LOAD_CASES = [  # dims (innermost first), box, coords
    ([8], [8], [0]),
    ([20], [16], [-8]),
    ([40, 13], [16, 8], [0, 0]),
    ([40, 13], [16, 8], [-3, -5]),        # hangs off the low edges (negative coordinates)
    ([40, 13], [16, 8], [32, 9]),         # off the high edges
    ([24, 5, 7], [8, 4, 4], [20, -2, 5]),
    ([16, 3, 4, 5], [8, 2, 4, 2], [12, 2, -1, 4]),
    ([8, 3, 2, 2, 3], [8, 2, 2, 2, 2], [-4, 2, 1, -1, 2]),
]


@pytest.mark.parametrize("dims, box, coords", LOAD_CASES)
def test_load_matches_numpy_with_out_of_bounds_zeros(mode, dims, box, coords):
    base, strides = tensor(dims, np.uint16)
    got = run_load(base, dims, strides, box, coords)
    assert got == expected_box(base, dims, coords, box).tobytes()


@pytest.mark.parametrize("swizzle, dtype, inner", [(32, np.float16, 16), (64, np.float16, 32), (128, np.float16, 64),
                                                  (128, np.float32, 16), (64, np.uint8, 48), (32, np.float32, 4)])
def test_every_swizzle_mode_places_each_unit(mode, swizzle, dtype, inner):
    dims, box, coords = [inner + 8, 40], [inner, 24], [4, 10]
    base, strides = tensor(dims, dtype, seed=swizzle)
    got = run_load(base, dims, strides, box, coords, swizzle=swizzle)
    assert got == swizzled_image(expected_box(base, dims, coords, box).tobytes(), swizzle)[0]


def test_nan_fill_and_element_strides(mode):
    dims, box, coords = [16, 6], [16, 8], [-4, 3]
    base, strides = tensor(dims, np.float32)
    got = np.frombuffer(run_load(base, dims, strides, box, coords, oob_fill=tm.OOB_FILL_NAN_REQUEST_ZERO_FMA),
                        np.float32)
    want = expected_box(base, dims, coords, box, fill=np.nan).ravel()
    np.testing.assert_array_equal(got, want)  # NaN where NaN
    # element strides: every second row of the box (ceil(8 / 2) = 4 rows), coordinates stepping by 2
    got = run_load(base, dims, strides, box, [0, 1], element_strides=[1, 2])
    assert got == expected_box(base, dims, [0, 1], box, element_strides=[1, 2]).tobytes()


@pytest.mark.parametrize("variant", [0, 5])  # 5: the threads poll with try_wait.parity
def test_landing_moment_does_not_change_a_correct_kernel(variant):
    # A poll failing while a load to its barrier is in flight is not idle (the load changes the object without
    # any thread): polling loops never read as a deadlock, whenever the seed lands the copy.
    dims, box, coords = [40, 13], [16, 8], [-3, 2]
    base, strides = tensor(dims, np.uint16)
    want = expected_box(base, dims, coords, box).tobytes()
    with sim.checking("normal"):
        for seed in range(4):
            with sim.copy_landing(seed):
                assert run_load(base, dims, strides, box, coords, bug=variant) == want


def test_tma_load_feeds_wgmma(mode):
    rng = np.random.default_rng(3)
    A = (rng.integers(-4, 5, size=(64, 64)) / 4).astype(np.float16)
    B = (rng.integers(-4, 5, size=(64, 64)) / 4).astype(np.float16)
    out = np.zeros((64, 64), np.float32)
    g = np.zeros((), GEMM_DTYPE)
    for field, matrix in (("map_a", A), ("map_b", B)):
        g[field] = tm.encode_tiled(tm.FLOAT16, 2, matrix.ctypes.data, [64, 64], [128], [64, 64],
                                   swizzle=tm.SWIZZLE_128B)
    g["out"] = out.ctypes.data
    sim.launch(inst("tma_wgmma_kernel"), 1, 128, 1024 + 16384, g[()], [A, B, out])
    np.testing.assert_array_equal(out, A.astype(np.float64) @ B.astype(np.float64).T)


def run_store(dims, box, coords, *, swizzle=0, bug=0):
    rank = len(dims)
    base, strides = tensor(dims, np.uint16, seed=7)
    before = base.copy()
    tmap = make_map(base, dims, strides, box, swizzle)
    box_bytes = int(np.prod(box)) * 2
    payload = np.arange(1, int(np.prod(box)) + 1, dtype=np.uint16).reshape(tuple(reversed(box)))
    image, span = swizzled_image(payload.tobytes(), swizzle)
    image_arr = np.frombuffer(image + bytes(16), np.uint8).copy()
    a = np.zeros((), ARGS_DTYPE)
    a["map"] = tmap
    a["image"] = image_arr.ctypes.data
    a["coords"][:rank] = coords
    a["box_bytes"], a["mode"], a["span"] = span, bug, span
    sim.launch(inst(f"store_kernel<{rank}>"), 1, 64, BOX_AT + span + 32, a[()], [base, image_arr])
    want = before.copy()
    for index in np.ndindex(*payload.shape):
        c = [coords[d] + index[rank - 1 - d] for d in range(rank)]
        if all(0 <= c[d] < dims[d] for d in range(rank)):
            want[tuple(reversed(c))] = payload[index]
    return base, want


@pytest.mark.parametrize("dims, box, coords, swizzle", [
    ([40, 13], [16, 8], [0, 0], 0),
    ([40, 13], [16, 8], [30, -3], 0),      # clipped on the right and at the top
    ([40, 13], [64, 4], [-20, 11], 128),   # clipped on both sides of the row, swizzled
    ([24, 5, 7], [8, 4, 4], [20, -2, 5], 0),
])
def test_store_writes_the_box_clipped_to_the_tensor(mode, dims, box, coords, swizzle):
    got, want = run_store(dims, box, coords, swizzle=swizzle)
    np.testing.assert_array_equal(got, want)


# ---- planted bugs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bug, message", [
    (1, r"reads the destination of a TMA load that thread \(0,0,0\) issued at cp.async.bulk.tensor \(TMA load\) "
        r"\(hopper_tma.cu:\d+:\d+\), before a wait observes the mbarrier phase"),
    # thread 0's own wait landed the load first: the landing is its write, which thread 32 is not ordered after
    (2, r"thread \(0,0,0\) wrote it with no __syncthreads\(\) in between, nor an mbarrier or named-barrier handoff"),
])
def test_reading_the_destination_before_the_wait_is_a_race(bug, message):
    dims, box = [40, 13], [16, 8]
    base, strides = tensor(dims, np.uint16)
    with sim.checking("race"), pytest.raises(sim.KernelError, match=message):
        run_load(base, dims, strides, box, [0, 0], bug=bug)


def test_wrong_expected_tx_bytes(mode):
    dims, box = [40, 13], [16, 8]
    base, strides = tensor(dims, np.uint16)
    with pytest.raises(sim.KernelError, match=r"(?s)deadlock: .*waits at .*hopper_tma.cu:\d+.* for parity 0 of the "
                       r"mbarrier at shared byte offset 0 .*phase 0 \(parity 0\) with 0 of 1 arrivals pending and a "
                       r"tx-count of 16 bytes"):
        run_load(base, dims, strides, box, [0, 0], bug=3)
    with pytest.raises(sim.KernelError, match=r"hopper_tma.cu:\d+.*: the TMA load's 256 bytes exceed the 240 "
                       r"expected by the mbarrier at shared byte offset 0"):
        run_load(base, dims, strides, box, [0, 0], bug=4)


def test_misaligned_destination_is_an_error(mode):
    dims, box = [40, 13], [16, 8]
    base, strides = tensor(dims, np.uint16)
    with pytest.raises(sim.KernelError, match=r"hopper_tma.cu:\d+.*TMA load destination at shared byte offset "
                       r"1040 is not 128-byte aligned"):
        run_load(base, dims, strides, box, [0, 0], box_offset=16)


def test_store_source_overwritten_before_wait_read_is_an_error():
    with sim.checking("race"), pytest.raises(sim.KernelError, match=r"writes shared byte offset 1024, the source "
                                             r"of a TMA store that thread \(0,0,0\) issued at .*hopper_tma.cu:\d+"):
        run_store([40, 13], [16, 8], [0, 0], bug=2)


def test_store_of_unfenced_ordinary_stores_is_an_error():
    with sim.checking("race"), pytest.raises(sim.KernelError, match=r"async-proxy read of shared byte offset "
                                             r"\d+ \(a wgmma or TMA operand\) without a fence.proxy.async"):
        run_store([40, 13], [16, 8], [0, 0], bug=1)


def test_wgmma_reading_tiles_in_flight_is_a_race():
    A = np.ones((64, 64), np.float16)
    out = np.zeros((64, 64), np.float32)
    g = np.zeros((), GEMM_DTYPE)
    for field in ("map_a", "map_b"):
        g[field] = tm.encode_tiled(tm.FLOAT16, 2, A.ctypes.data, [64, 64], [128], [64, 64], swizzle=tm.SWIZZLE_128B)
    g["out"], g["mode"] = out.ctypes.data, 1
    with sim.checking("race"), pytest.raises(sim.KernelError, match=r"the destination of a TMA load"):
        sim.launch(inst("tma_wgmma_kernel"), 1, 128, 1024 + 16384, g[()], [A, out])


# ---- encode_tiled's argument rules -----------------------------------------------------------------------------

GOOD = dict(dtype=tm.FLOAT16, rank=2, global_address=0x10000, global_dims=[64, 32], global_strides=[128],
            box_dims=[64, 16], element_strides=[1, 1])


@pytest.mark.parametrize("change, message", [
    (dict(dtype=13), r"tensorDataType 13 is not a CUtensorMapDataType"),
    (dict(rank=0, global_dims=[], global_strides=[], box_dims=[], element_strides=[]),
     r"tensorRank 0: must be non-zero"),
    (dict(rank=6, global_dims=[2] * 6, global_strides=[16] * 5, box_dims=[8] * 6, element_strides=[1] * 6),
     r"tensorRank 6: must be non-zero and at most 5"),
    (dict(global_dims=[64]), r"globalDim has 1 entries; a rank-2 map takes 2"),
    (dict(global_strides=[128, 256]), r"globalStrides has 2 entries; a rank-2 map takes 1"),
    (dict(global_address=0x10008), r"globalAddress 0x10008: must be 16-byte aligned"),
    (dict(global_dims=[0, 32]), r"globalDim\[0\] = 0: must be non-zero and at most 2\^32"),
    (dict(global_dims=[64, 2**32 + 1]), r"globalDim\[1\] = 4294967297"),
    (dict(global_strides=[120]), r"globalStrides\[0\] = 120: must be a multiple of 16"),
    (dict(global_strides=[2**40]), r"globalStrides\[0\] = 1099511627776: must be positive and less than 2\^40"),
    (dict(box_dims=[0, 16]), r"boxDim\[0\] = 0: must be non-zero and at most 256"),
    (dict(box_dims=[64, 257]), r"boxDim\[1\] = 257: must be non-zero and at most 256"),
    (dict(box_dims=[12, 16]), r"boxDim\[0\] = 12: boxDim\[0\] \* 2 bytes must be a multiple of 16"),
    (dict(element_strides=[1, 9]), r"elementStrides\[1\] = 9: must be non-zero and at most 8"),
    (dict(element_strides=[0, 1]), r"elementStrides\[0\] = 0"),
    (dict(swizzle=tm.SWIZZLE_64B), r"boxDim\[0\] = 64: the inner box \(128 bytes\) must not exceed the 64-byte "
                                   r"swizzle span"),
    (dict(swizzle=7), r"swizzle 7 is not a CUtensorMapSwizzle"),
    (dict(interleave=3), r"interleave 3 is not a CUtensorMapInterleave"),
    (dict(interleave=tm.INTERLEAVE_16B), r"tensorRank 2: must be at least 3 with interleave"),
    (dict(rank=3, global_dims=[64, 32, 2], global_strides=[128, 4096], box_dims=[64, 16, 1],
          element_strides=[1, 1, 1], interleave=tm.INTERLEAVE_32B, swizzle=tm.SWIZZLE_32B, global_address=0x10010),
     r"globalAddress 0x10010: must be 32-byte aligned with 32B interleave"),
    (dict(rank=3, global_dims=[64, 32, 2], global_strides=[128, 4096], box_dims=[64, 16, 1],
          element_strides=[1, 1, 1], interleave=tm.INTERLEAVE_32B), r"swizzle: 32B interleave needs the 32B swizzle"),
    (dict(rank=3, global_dims=[64, 32, 2], global_strides=[128, 4096], box_dims=[64, 16, 1],
          element_strides=[1, 1, 1], interleave=tm.INTERLEAVE_16B), r"interleaved layouts are not modeled"),
    (dict(l2_promotion=4), r"l2Promotion 4 is not a CUtensorMapL2promotion"),
    (dict(oob_fill=2), r"oobFill 2 is not a CUtensorMapFloatOOBfill"),
    (dict(dtype=tm.UINT16, oob_fill=tm.OOB_FILL_NAN_REQUEST_ZERO_FMA), r"oobFill NAN_REQUEST_ZERO_FMA needs a "
                                                                      r"floating-point tensorDataType"),
])
def test_encode_tiled_names_the_broken_rule(change, message):
    with pytest.raises(ValueError, match=message):
        tm.encode_tiled(**{**GOOD, **change})


def test_encode_tiled_twin_layout():
    raw = tm.encode_tiled(**{**GOOD, "swizzle": tm.SWIZZLE_128B})
    assert len(raw) == 128 and raw[:4] == b"CFTM"
    assert raw[4:11] == bytes([tm.FLOAT16, 2, 0, tm.SWIZZLE_128B, 0, 0, 2])
    assert int.from_bytes(raw[16:24], "little") == 0x10000
    assert int.from_bytes(raw[24:28], "little") == 63 and int.from_bytes(raw[48:56], "little") == 128
    assert raw[80:82] == bytes([63, 15]) and raw[85:87] == bytes([1, 1])


def test_a_map_not_made_by_encode_tiled_is_an_error():
    a = np.zeros((), ARGS_DTYPE)
    out = np.zeros(16, np.uint8)
    a["out"], a["box_bytes"], a["span"] = out.ctypes.data, 16, 16
    with sim.checking("normal"), pytest.raises(sim.KernelError, match=r"the tensor map was not made by "
                                               r"cuflash.kernels.tensor_map.encode_tiled"):
        sim.launch(inst("load_kernel<1>"), 1, 64, BOX_AT + 64, a[()], [out])


def test_the_driver_call_takes_the_arguments_as_encode_tiled_passes_them():
    """cuda-bindings checks argument types before it looks for the driver: without a GPU the call must get as far
    as the missing driver library (with one, it returns a map), never stop at a TypeError on our arguments (the
    first H200 run: Python ints where cuuint32_t/cuuint64_t are required)."""
    pytest.importorskip("cuda.bindings")
    try:
        raw = tm.encode_tiled(**GOOD, device=True)
    except TypeError as error:
        pytest.fail(f"cuTensorMapEncodeTiled refused our arguments: {error}")
    except Exception as error:  # no driver here: cuda-pathfinder's DynamicLibNotFoundError, or a CUDA error
        assert "TypeError" not in repr(error)
        assert type(error).__name__ in ("DynamicLibNotFoundError", "RuntimeError"), repr(error)
    else:
        assert len(raw) == 128 and raw[:4] != b"CFTM"


@pytest.mark.gpu
def test_encode_tiled_on_a_gpu_calls_the_driver():
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    assert err == driver.CUresult.CUDA_SUCCESS
    raw = tm.encode_tiled(**GOOD, device=True)
    assert len(raw) == 128 and raw[:4] != b"CFTM"
    with pytest.raises(ValueError, match=r"globalStrides\[0\] = 120"):  # our checks run before the driver's
        tm.encode_tiled(**{**GOOD, "global_strides": [120]}, device=True)


def test_polling_consumers_see_the_box(mode):
    dims, box, coords = [24, 5, 7], [8, 4, 4], [20, -2, 5]
    base, strides = tensor(dims, np.uint16)
    assert run_load(base, dims, strides, box, coords, bug=5) == expected_box(base, dims, coords, box).tobytes()


def test_coordinates_must_match_the_maps_rank(mode):
    dims, box = [24, 5, 7], [8, 4, 4]
    base, strides = tensor(dims, np.uint16)
    a = np.zeros((), ARGS_DTYPE)
    out = np.zeros(512, np.uint8)
    a["map"] = make_map(base, dims, strides, box)
    a["out"], a["box_bytes"], a["span"] = out.ctypes.data, 256, 256
    with pytest.raises(sim.KernelError, match=r"hopper_tma.cu:\d+.*: 2 coordinates for a tensor map of rank 3"):
        sim.launch(inst("load_kernel<2>"), 1, 64, BOX_AT + 512, a[()], [base, out])


@pytest.mark.parametrize("direction", ["load", "store"])
@pytest.mark.parametrize("coords, dimension, taken", [
    ([40, 0], 0, r"40 \.\. 55 of 0 \.\. 39"),     # past the high edge of the rows
    ([0, -8], 1, r"-8 \.\. -1 of 0 \.\. 12"),     # below the low edge of the columns
    ([-16, 13], 0, r"-16 \.\. -1 of 0 \.\. 39"),  # outside along both: the first dimension is named
])
def test_a_box_wholly_outside_the_tensor_is_an_error(mode, direction, coords, dimension, taken):
    """No element of the box inside the tensor: what the hardware does is undocumented, so the simulator refuses
    it (its clean twins: every partly-outside case above, down to one element inside)."""
    dims, box = [40, 13], [16, 8]
    message = rf"TMA {direction}'s box lies wholly outside the tensor: along dimension {dimension} .*{taken}"
    with pytest.raises(sim.KernelError, match=message):
        if direction == "load":
            base, strides = tensor(dims, np.uint16)
            run_load(base, dims, strides, box, coords)
        else:
            run_store(dims, box, coords)
    base, strides = tensor(dims, np.uint16)
    one_inside = [39, 12]  # the box's first element is the tensor's last
    assert run_load(base, dims, strides, box, one_inside) == expected_box(base, dims, one_inside, box).tobytes()


def test_global_bytes_outside_the_launchs_buffers_are_errors(mode):
    dims, box = [40, 13], [16, 8]
    base, strides = tensor(dims, np.uint16)
    a = np.zeros((), ARGS_DTYPE)
    out = np.zeros(512, np.uint8)
    a["map"] = make_map(base, dims, strides, box)
    a["out"], a["box_bytes"], a["span"] = out.ctypes.data, 256, 256
    with pytest.raises(sim.KernelError, match=r"out of bounds \(TMA load source\)"):
        sim.launch(inst("load_kernel<2>"), 1, 64, BOX_AT + 512, a[()], [out])  # the tensor is not registered
    image = np.zeros(256, np.uint8)
    a["image"] = image.ctypes.data
    with pytest.raises(sim.KernelError, match=r"to a read-only buffer \(TMA store destination\)"):
        frozen = base.view()
        frozen.flags.writeable = False  # registered as a read-only buffer
        sim.launch(inst("store_kernel<2>"), 1, 64, BOX_AT + 512, a[()], [frozen, image])


# ---- bulk reduce-add (cp.reduce.async.bulk .add.f32) -------------------------------------------------------------


def run_reduce(floats=40, *, bug=0, box_offset=0, dst_offset=0, size=None, readonly=False):
    """reduce_kernel: `floats` float32 (integers, so sums are exact) added by one bulk reduce-add into a float32
    array at element dst_offset. Returns (result, want)."""
    rng = np.random.default_rng(3)
    image = rng.integers(-50, 50, size=floats).astype(np.float32)
    out = rng.integers(-50, 50, size=floats + 8).astype(np.float32)
    want = out.copy()
    want[dst_offset:dst_offset + floats] += (2 if bug == 4 else 1) * image
    if readonly:
        out.flags.writeable = False
    a = np.zeros((), ARGS_DTYPE)
    a["out"], a["image"] = out.ctypes.data, image.ctypes.data
    a["coords"][0] = dst_offset
    a["box_bytes"] = 4 * floats if size is None else size
    a["box_offset"], a["mode"] = box_offset, bug
    sim.launch(inst("reduce_kernel"), 1, 64, BOX_AT + 4 * floats + 64, a[()], [out, image])
    return out, want


@pytest.mark.parametrize("variant", [0, 4, 5])  # one issuer; two adding the same source; wait_group without .read
def test_bulk_reduce_adds_the_source_to_global_memory(mode, variant):
    got, want = run_reduce(bug=variant)
    np.testing.assert_array_equal(got, want)


def test_bulk_reduce_add_lands_between_issue_and_wait():
    # Normal mode lands it at a seeded moment up to the wait: whichever the seed, the sum is the same.
    for seed in range(4):
        with sim.copy_landing(seed):
            got, want = run_reduce(floats=64)
        np.testing.assert_array_equal(got, want)


def test_reduces_to_one_element_land_in_order_only_after_wait_group():
    """After wait_group.read a reduce has read its source, but its adds may still be in flight: a second reduce to the
    same floats may land first. 1e8 + (-1e8) + 1 = 1 in issue order, (1e8 + 1) - 1e8 = 0 the other way (float32)."""
    def run(mode, seed):
        image = np.array([-1e8] * 4 + [1.0] * 4, np.float32)
        out = np.full(8, 1e8, np.float32)
        a = np.zeros((), ARGS_DTYPE)
        a["out"], a["image"], a["box_bytes"], a["mode"] = out.ctypes.data, image.ctypes.data, 16, mode
        with sim.checking("normal"), sim.copy_landing(seed):  # race mode lands in issue order
            sim.launch(inst("reduce_kernel"), 1, 64, BOX_AT + 128, a[()], [out, image])
        return float(out[0])

    assert {run(6, seed) for seed in range(8)} == {0.0, 1.0}  # wait_group.read between them: either order
    assert {run(7, seed) for seed in range(8)} == {1.0}        # wait_group between them: issue order


@pytest.mark.parametrize("bug, message", [
    (1, r"async-proxy read of shared byte offset \d+ \(a wgmma or TMA operand\) without a fence.proxy.async"),
    (2, r"writes shared byte offset 1024, the source of a bulk reduce-add that thread \(0,0,0\) issued at "
        r"cp.reduce.async.bulk \(bulk reduce-add\) \(hopper_tma.cu:\d+:\d+\) and has not waited for"),
    # Thread 32's write is ordered after neither the issuer's wait (which lands the reduce) nor its read: either the
    # reduce is still pending (the error names its site) or it landed, and the write races with its source read.
    (3, r"writes shared byte offset 1024, the source of a bulk reduce-add that thread \(0,0,0\) issued at "
        r"cp.reduce.async.bulk|data race on shared memory byte offset 1024: this thread writes it, thread \(0,0,0\) "
        r"read it"),
])
def test_bulk_reduce_source_rules_are_race_errors(bug, message):
    with sim.checking("race"), pytest.raises(sim.KernelError, match=message):
        run_reduce(bug=bug)


@pytest.mark.parametrize("change, message", [
    ({"size": 36}, r"the bulk reduce-add's size, 36 bytes, is not a positive multiple of 16"),
    ({"dst_offset": 1}, r"the bulk reduce-add's global destination 0x[0-9a-f]+ is not 16-byte aligned"),
    ({"box_offset": 8}, r"the bulk reduce-add source at shared byte offset 1032 is not 16-byte aligned \(the ISA's "
                        r"rule for bulk copies\)"),
    ({"readonly": True}, r"to a read-only buffer \(bulk reduce-add destination\)"),
])
def test_bulk_reduce_alignment_size_and_destination_rules(mode, change, message):
    with pytest.raises(sim.KernelError, match=r"hopper_tma.cu:\d+.*" + message if "readonly" not in change
                       else message):
        run_reduce(**change)


def run_ring(rounds, bug=0):
    dims = [16, 8 * rounds]
    base, strides = tensor(dims, np.uint16, seed=11)
    out = np.zeros(128 * rounds, np.uint16)
    a = np.zeros((), ARGS_DTYPE)
    a["map"] = make_map(base, dims, strides, [16, 8])
    a["out"], a["mode"] = out.ctypes.data, bug
    a["coords"][0] = rounds
    sim.launch(inst("ring_kernel"), 1, 64, BOX_AT + 512, a[()], [base, out])
    return base, out


def test_two_stage_ring_hands_every_box_over(mode):
    # Stages refilled after the consumers' arrivals on "empty": the producer's waits order its TMA writes after
    # their reads, and the consumers' waits on "full" order their reads after the landing (race mode's clocks).
    base, out = run_ring(5)
    np.testing.assert_array_equal(out, base[:, :16].ravel())


def test_refilling_a_stage_without_waiting_for_its_consumers_is_an_error():
    # Race mode lands a load only when a thread waits on its barrier (or nothing else can run), so a producer
    # that never waits for "empty" reaches its next arrival on a stage's "full" while the stage's previous phase
    # still waits for its bytes: an over-arrival, as on a GPU whenever that copy is slow.
    with sim.checking("race"), pytest.raises(sim.KernelError, match=r"mbarrier.arrive.expect_tx \(hopper_tma.cu:\d+:"
                                             r"\d+\): over-arrival: no arrival is pending on the mbarrier at shared "
                                             r"byte offset 0 .*a tx-count of 256 bytes"):
        run_ring(5, bug=1)


@pytest.mark.parametrize("swizzle", [0, 128])
def test_profile_counts_a_copys_shared_side(swizzle):
    """Profile mode counts a TMA copy's shared side (sim_profile.cpp) as one instruction whose 16-byte units go 8 (128
    bytes) a phase in box order: a box of 8 rows of 128 bytes is 8 phases, each a line of distinct banks, swizzled
    or not."""
    dims, box = [64, 16], [64, 8]
    base, strides = tensor(dims, np.uint16)
    with sim.checking("profile"), sim.record() as records:
        run_load(base, dims, strides, box, [0, 4], swizzle=swizzle)
        run_store(dims, box, [0, 4], swizzle=swizzle)
    sites = {site.kind: site for launch in records.launches for site in launch.shared_access_sites
             if site.kind.startswith("tma.")}
    assert set(sites) == {"tma.load", "tma.store"}
    for site in sites.values():
        assert (site.instructions, site.bytes, site.ideal, site.wavefronts) == (1, 16, 8, 8), site
        assert "hopper_tma.cu:" in site.site
