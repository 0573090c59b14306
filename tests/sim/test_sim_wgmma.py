"""The wgmma twin (m64nNk16, f16/bf16 -> f32) against the PTX ISA: descriptors decoded element by element
against the canonical K-major layouts of each swizzle mode, products against NumPy in float64, the accumulator
fragment layout, asynchrony (seed-dependent landing, race-mode checks), warpgroup agreement and setmaxnreg."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels.program import KernelInstance
from simkit import KERNELS, swizzled_address

SOURCE = KERNELS / "hopper_wgmma.cu"
ARGS = np.dtype([("image", np.uint64), ("a_registers", np.uint64), ("acc_in", np.uint64), ("out", np.uint64),
                 ("desc_a", np.uint64), ("desc_b", np.uint64), ("desc_step_a", np.uint64),
                 ("desc_step_b", np.uint64), ("ksteps", np.int32), ("accumulate", np.int32), ("mode", np.int32),
                 ("smem_bytes", np.int32)])
TYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}
SS = [("__half", 16), ("__half", 64), ("__nv_bfloat16", 8), ("__nv_bfloat16", 128), ("__half", 256),
      ("__half", 128), ("__nv_bfloat16", 64)]
RS = [("__half", 64), ("__nv_bfloat16", 32)]
RACE = "wgmma_kernel<__half, 8, false>"


MN = [("__half", 64), ("__nv_bfloat16", 128)]  # SS with either operand or both MN-major
MAJORS = [(True, False), (False, True), (True, True)]


def kernel_name(T, n, registers=False, a_mn=False, b_mn=False):
    flag = lambda b: "true" if b else "false"
    tail = f", {flag(a_mn)}, {flag(b_mn)}" if a_mn or b_mn else ""
    return f"wgmma_kernel<{T}, {n}, {flag(registers)}{tail}>"


NAMES = ([kernel_name(T, n) for T, n in SS] + [kernel_name(T, n, True) for T, n in RS]
         + [kernel_name(T, n, False, a, b) for T, n in MN for a, b in MAJORS]
         + [kernel_name("__half", 16, False, True), kernel_name("__half", 64, False, False, True),
            kernel_name("__half", 64, True, False, True)]
         + [RACE, "wgmma_desc_kernel", "setmaxnreg_kernel"])


def inst(name):
    return KernelInstance(str(SOURCE), f"simwgmma::{name}")


@pytest.fixture(scope="module", autouse=True)
def _built():
    sim.precompile([inst(n) for n in NAMES], modes=("normal",))


# ---- the ISA's shared-memory matrix descriptor and canonical K-major layouts (16-bit elements) ----------

SWIZZLE_CODE = {0: 0, 128: 1, 64: 2, 32: 3}


def descriptor(start, lbo, sbo, swizzle, base_offset=0):
    """Bits 0-13 start, 16-29 LBO, 32-45 SBO (each (x & 0x3FFFF) >> 4), 49-51 base offset, 62-63 swizzle.
    Base offset 0: the swizzle pattern starts at a boundary of its size (the start may lie inside it)."""
    return ((start & 0x3FFFF) >> 4 | ((lbo & 0x3FFFF) >> 4) << 16 | ((sbo & 0x3FFFF) >> 4) << 32
            | base_offset << 49 | SWIZZLE_CODE[swizzle] << 62)


def layout_offset(shape, stride, coordinate):
    """A CuTe-style layout: the coordinate split over the (flattened) shape, dotted with the strides."""
    offset = 0
    for extent, step in zip(shape, stride):
        offset += (coordinate % extent) * step
        coordinate //= extent
    return offset


def element_address(start, lbo, sbo, swizzle, row, k, mn_major=False):
    """Byte address of element (row, k) (row along M or N) of a 16-bit operand, from the ISA's canonical layouts
    in elements, T = 8 (16 bytes), s = swizzle / 16 (a layout mode of extent 0 below stands for m or k: the
    rest of the index):
      K-major:  none ((8,m),(T,2k)):((1T,SBO),(1,LBO))    swizzled ((8,m),(T,2k)):((sT,SBO),(1,T))
      MN-major: none ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) swizzled ((T,s,m),(8,k)):((1,T,LBO),(sT,SBO))
    then the swizzle of the byte address: its 16-byte unit index (bits 4..) XOR its 128-byte row index
    (bits 7..) over log2(s) bits."""
    T, s, big = 8, max(swizzle // 16, 1), 1 << 30
    L, S = lbo // 2, sbo // 2
    if not mn_major:
        row_part = layout_offset((8, big), (s * T if swizzle else T, S), row)
        k_part = layout_offset((T, big), (1, T if swizzle else L), k)
    elif swizzle == 0:
        row_part = layout_offset((T, 1, big), (1, T, S), row)
        k_part = layout_offset((8, big), (T, L), k)
    else:
        row_part = layout_offset((T, s, big), (1, T, L), row)
        k_part = layout_offset((8, big), (s * T, S), k)
    return swizzled_address(start + 2 * (row_part + k_part), swizzle)


def place(image, matrix_bits, start, lbo, sbo, swizzle, mn_major=False):
    """Writes a rows x K matrix of 16-bit values into the shared-memory image (uint16 per 2 bytes)."""
    rows, cols = matrix_bits.shape
    for r in range(rows):
        for k in range(cols):
            image[element_address(start, lbo, sbo, swizzle, r, k, mn_major) // 2] = matrix_bits[r, k]


def acc_position(t, i):
    """Row and column of accumulator i of thread t (warp q = t / 32, lane l = t % 32)."""
    q, l = divmod(t, 32)
    return 16 * q + l // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (l % 4) + i % 2


def gather(out, n):
    D = np.zeros((64, n), np.float64)
    for t in range(128):
        for i in range(n // 2):
            D[acc_position(t, i)] = out[t, i]
    return D


def a_fragments(A_bits, ksteps):
    """[ksteps][128][4] registers of the RS form: warp q holds rows 16 q.., in mma.m16n8k16's A layout."""
    regs = np.zeros((ksteps, 128, 4), np.uint32)
    for s in range(ksteps):
        for t in range(128):
            q, l = divmod(t, 32)
            g, c = 16 * q + l // 4, 16 * s + 2 * (l % 4)
            pairs = [(g, c), (g + 8, c), (g, c + 8), (g + 8, c + 8)]
            regs[s, t] = [int(A_bits[r, k]) | int(A_bits[r, k + 1]) << 16 for r, k in pairs]
    return regs


def launch(name, image, out, *, desc_a=0, desc_b=0, step_a=0, step_b=0, ksteps=1, accumulate=0, mode=0,
           a_registers=None, acc_in=None, block=128, mode_name=None):
    a = np.zeros((), ARGS)
    buffers = [image, out]
    a["image"], a["out"] = image.ctypes.data, out.ctypes.data
    for field, arr in (("a_registers", a_registers), ("acc_in", acc_in)):
        if arr is not None:
            a[field] = arr.ctypes.data
            buffers.append(arr)
    a["desc_a"], a["desc_b"], a["desc_step_a"], a["desc_step_b"] = desc_a, desc_b, step_a, step_b
    a["ksteps"], a["accumulate"], a["mode"], a["smem_bytes"] = ksteps, accumulate, mode, image.nbytes
    return sim.launch(inst(name), 1, block, image.nbytes, a[()], buffers)


def slot_values(count):
    """A distinct-looking exact f16 value for every 2-byte slot of shared memory."""
    return (((np.arange(count) * 7) % 2039) - 1019).astype(np.float16).view(np.uint16)


IDENTITY_AT = 28672  # where the selecting identity operand lives (no swizzle, LBO 128, SBO 256)


# ---- descriptors, element by element ------------------------------------------------------------------

LAYOUTS = [  # (swizzle, start, LBO, SBO); some starts lie inside a pattern (rows 1, 2 or 3 on, or a k step on)
    (0, 0, 128, 256), (0, 2048, 1024, 128), (32, 256, 16, 256), (32, 4096 + 32, 16, 512), (64, 512, 16, 512),
    (64, 8192 + 640, 16, 512), (128, 0, 16, 1024), (128, 8192 + 3 * 128, 16, 1024), (128, 32, 16, 1024)]


MN_LAYOUTS = [  # (swizzle, start, LBO, SBO) of MN-major operands: LBO between row groups when swizzled
    (0, 0, 128, 256), (0, 2048, 1024, 128), (32, 256, 256, 2048), (64, 4096, 512, 2048), (128, 8192, 4096, 1024)]
DECODE_CASES = [(*layout, False) for layout in LAYOUTS] + [(*layout, True) for layout in MN_LAYOUTS]


@pytest.mark.parametrize("operand", ["A", "B"])
@pytest.mark.parametrize("swizzle, start, lbo, sbo, mn_major", DECODE_CASES)
def test_descriptor_decodes_to_the_canonical_layout(operand, swizzle, start, lbo, sbo, mn_major):
    # The operand under test holds the slot values; the other is a 0/1 selector, so D shows each element read.
    image = slot_values(32768 // 2)
    rows = 64 if operand == "A" else 64
    n = 16 if operand == "A" else 64
    selector = np.zeros((64 if operand == "B" else n, 16), np.float16)
    selector[np.arange(16), np.arange(16)] = 1
    place(image, selector.view(np.uint16), IDENTITY_AT, 128, 256, 0)
    tested = descriptor(start, lbo, sbo, swizzle)
    identity = descriptor(IDENTITY_AT, 128, 256, 0)
    out = np.zeros((128, n // 2), np.float32)
    launch(kernel_name("__half", n, False, mn_major and operand == "A", mn_major and operand == "B"), image, out,
           desc_a=tested if operand == "A" else identity, desc_b=identity if operand == "A" else tested)
    D = gather(out, n)
    values = image.view(np.float16).astype(np.float64)
    expected = np.array([[values[element_address(start, lbo, sbo, swizzle, r, k, mn_major) // 2]
                          for k in range(16)] for r in range(rows)])
    if operand == "A":
        np.testing.assert_array_equal(D[:, :16], expected)  # D = A I
    else:
        np.testing.assert_array_equal(D[:16, :], expected.T)  # D = I B^T


def test_wgmma_desc_encodes_the_descriptor_fields():
    out = np.zeros(4, np.uint64)
    launch("wgmma_desc_kernel", np.zeros(2048, np.uint16), out)
    assert out.tolist() == [descriptor(256, 128, 256, 0), descriptor(512 + 32, 16, 256, 32),
                            descriptor(1024 + 128, 16, 512, 64), descriptor(2048 + 384, 16, 1024, 128)]
    assert all(d >> 49 & 7 == 0 for d in out)  # patterns at their boundaries, starts anywhere inside


def test_wgmma_desc_rejects_a_misaligned_start():
    with pytest.raises(sim.KernelError, match=r"wgmma_desc \(hopper_wgmma.cu:\d+:\d+\): start address 0x8 is not "
                                              r"16-byte aligned"):
        launch("wgmma_desc_kernel", np.zeros(2048, np.uint16), np.zeros(5, np.uint64), mode=1)


@pytest.mark.parametrize("desc, pattern", [
    (descriptor(8192 + 384, 16, 1024, 128, base_offset=3),
     r"the descriptor of A: base offset 3: a 128B swizzle pattern that does not start at a 1024-byte boundary"),
    (descriptor(30720, 16, 1024, 128),
     r"the descriptor of A: element \(16, 0\) at shared address 0x8000 lies outside the block's 32768 bytes"),
    (descriptor(0, 16, 1024, 128) | 1 << 47, r"the descriptor of A: reserved bits set \(0x0000800000000000\)"),
])
def test_bad_descriptors_are_errors_naming_the_site(desc, pattern):
    image = np.zeros(16384, np.uint16)
    with pytest.raises(sim.KernelError, match=r"wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\): " + pattern):
        launch(kernel_name("__half", 16), image, np.zeros((128, 8), np.float32), desc_a=desc,
               desc_b=descriptor(IDENTITY_AT, 128, 256, 0))


# ---- products ------------------------------------------------------------------------------------------


def operands(T, n, k, seed):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((64, k)).astype(TYPES[T])
    B = rng.standard_normal((n, k)).astype(TYPES[T])
    return A, B


@pytest.mark.parametrize("T, n", SS)
@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
def test_ss_product(T, n, swizzle):
    # One k16 step for every swizzle; K = 64 over four steps for 128B (rows of 128 bytes) and no swizzle.
    ksteps = 4 if swizzle in (0, 128) else 1
    A, B = operands(T, n, 16 * ksteps, n + swizzle)
    image = np.zeros(65536 // 2 if n == 256 else 32768 // 2, np.uint16)
    b_at = 8192
    lbo, sbo = (128, 2 * 128 * ksteps) if swizzle == 0 else (16, 8 * swizzle)
    place(image, A.view(np.uint16), 0, lbo, sbo, swizzle)
    place(image, B.view(np.uint16), b_at, lbo, sbo, swizzle)
    step = (2 * lbo if swizzle == 0 else 32) >> 4
    accumulate = swizzle % 64 == 0  # on for 0 and 128, off for 32 and 64
    acc_in = np.random.default_rng(7).standard_normal((128, n // 2)).astype(np.float32)
    out = np.zeros((128, n // 2), np.float32)
    launch(kernel_name(T, n), image, out, desc_a=descriptor(0, lbo, sbo, swizzle),
           desc_b=descriptor(b_at, lbo, sbo, swizzle), step_a=step, step_b=step, ksteps=ksteps,
           accumulate=int(accumulate), acc_in=acc_in)
    expected = A.astype(np.float64) @ B.astype(np.float64).T
    if accumulate:
        expected += gather(acc_in, n)
    np.testing.assert_allclose(gather(out, n), expected, rtol=1e-5, atol=1e-4)


def mn_major_tile(rows, k, swizzle):
    """LBO, SBO and the k16 descriptor step of a dense MN-major rows x k tile: 8-k groups next to each other
    (SBO, swizzled; LBO without swizzle), then the next group of rows."""
    if swizzle == 0:  # core matrices of 8 k x 8 rows (128 bytes): k groups 128 apart, row groups after all k
        return 128, 128 * (k // 8), 2 * 128
    atom = 8 * swizzle  # 8 lines of 8 s rows
    return atom * (k // 8), atom, 2 * atom


@pytest.mark.parametrize("T, n", MN)
@pytest.mark.parametrize("a_mn, b_mn", MAJORS)
@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
def test_ss_product_mn_major(T, n, a_mn, b_mn, swizzle):
    ksteps = 4 if swizzle in (0, 128) else 1
    A, B = operands(T, n, 16 * ksteps, n + swizzle + a_mn)
    image = np.zeros(32768 // 2, np.uint16)
    descs, steps = [], []
    for M, at, mn in ((A, 0, a_mn), (B, 8192, b_mn)):
        if mn:
            lbo, sbo, step = mn_major_tile(M.shape[0], M.shape[1], swizzle)
        else:
            lbo, sbo = (128, 2 * 128 * ksteps) if swizzle == 0 else (16, 8 * swizzle)
            step = 2 * lbo if swizzle == 0 else 32
        place(image, M.view(np.uint16), at, lbo, sbo, swizzle, mn)
        descs.append(descriptor(at, lbo, sbo, swizzle))
        steps.append(step >> 4)
    out = np.zeros((128, n // 2), np.float32)
    launch(kernel_name(T, n, False, a_mn, b_mn), image, out, desc_a=descs[0], desc_b=descs[1], step_a=steps[0],
           step_b=steps[1], ksteps=ksteps)
    np.testing.assert_allclose(gather(out, n), A.astype(np.float64) @ B.astype(np.float64).T, rtol=1e-5, atol=1e-4)


def test_rs_product_with_n_major_b():
    A, B = operands("__half", 64, 64, 13)
    image = np.zeros(16384, np.uint16)
    lbo, sbo, step = mn_major_tile(64, 64, 128)
    place(image, B.view(np.uint16), 0, lbo, sbo, 128, mn_major=True)
    out = np.zeros((128, 32), np.float32)
    launch(kernel_name("__half", 64, True, False, True), image, out, desc_b=descriptor(0, lbo, sbo, 128),
           step_b=step >> 4, ksteps=4, a_registers=a_fragments(A.view(np.uint16), 4))
    np.testing.assert_allclose(gather(out, 64), A.astype(np.float64) @ B.astype(np.float64).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T, n", RS)
def test_rs_product(T, n):
    ksteps = 4
    A, B = operands(T, n, 64, 11)
    image = np.zeros(16384, np.uint16)
    place(image, B.view(np.uint16), 0, 16, 1024, 128)
    out = np.zeros((128, n // 2), np.float32)
    launch(kernel_name(T, n, True), image, out, desc_b=descriptor(0, 16, 1024, 128), step_b=2, ksteps=ksteps,
           a_registers=a_fragments(A.view(np.uint16), ksteps))
    np.testing.assert_allclose(gather(out, n), A.astype(np.float64) @ B.astype(np.float64).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
@pytest.mark.parametrize("majors", [(False, False), (True, True), "registers"])
def test_profile_counts_the_shared_operand_reads(swizzle, majors):
    """Profile mode: each wgmma's shared operands are one instruction each at the call site ("wgmma.read"), read
    core matrix by core matrix (8 rows x 16 bytes, 8 16-byte units a phase): 64 x 16 of A is 16 wavefronts, N x 16
    of B N / 4; every canonical layout (each swizzle, K- and MN-major) reads a core matrix in one (excess 0). A from
    registers reads only B. The products are the normal mode's (checked against NumPy)."""
    n, ksteps = 64, 4
    registers = majors == "registers"
    a_mn, b_mn = (False, True) if registers else majors
    if swizzle in (32, 64) and not (a_mn or b_mn):
        ksteps = 1  # a K-major swizzled line holds swizzle / 2 elements: one k16 step for 32 and 64
    A, B = operands("__half", n, 16 * ksteps, 5 + swizzle)
    image = np.zeros(16384, np.uint16)
    k_major = (128, 2 * 128 * ksteps, 2 * 128 >> 4) if swizzle == 0 else (16, 8 * swizzle, 32 >> 4)
    descriptors = {}
    for name, matrix, at, mn in (("a", A, 0, a_mn), ("b", B, 8192, b_mn)):
        if registers and name == "a":
            continue
        if mn:
            lbo, sbo, step_bytes = mn_major_tile(64, 16 * ksteps, swizzle)
            lbo, sbo, step = lbo, sbo, step_bytes >> 4
        else:
            lbo, sbo, step = k_major
        place(image, matrix.view(np.uint16), at, lbo, sbo, swizzle, mn_major=mn)
        descriptors[name] = (descriptor(at, lbo, sbo, swizzle), step)
    out = np.zeros((128, n // 2), np.float32)
    name = kernel_name("__half", n, registers, a_mn, b_mn)
    options = dict(desc_b=descriptors["b"][0], step_b=descriptors["b"][1], ksteps=ksteps)
    if registers:
        options["a_registers"] = a_fragments(A.view(np.uint16), ksteps)
    else:
        options.update(desc_a=descriptors["a"][0], step_a=descriptors["a"][1])
    with sim.checking("profile"):
        rec = launch(name, image, out, **options)
    np.testing.assert_allclose(gather(out, n), A.astype(np.float64) @ B.astype(np.float64).T, rtol=1e-5, atol=1e-4)
    reads = [site for site in rec.shared_access_sites if site.kind == "wgmma.read"]
    assert len(reads) == 1 and "hopper_wgmma.cu:" in reads[0].site, rec.shared_access_sites
    (site,) = reads
    operands_read = 1 if registers else 2
    assert site.instructions == operands_read * ksteps, site
    assert site.ideal == ksteps * (n // 4 + (0 if registers else 16)), site
    assert site.excess == 0, site


def test_accumulator_fragment_layout():
    # A[m] = (m, 1, 0..), B[n] = (1, 64 n, 0..): D[m, n] = m + 64 n exactly, so each accumulator names its place.
    n = 128
    A = np.zeros((64, 16), np.float16)
    A[:, 0], A[:, 1] = np.arange(64), 1
    B = np.zeros((n, 16), np.float16)
    B[:, 0], B[:, 1] = 1, 64 * np.arange(n)
    image = np.zeros(16384, np.uint16)
    place(image, A.view(np.uint16), 0, 16, 1024, 128)
    place(image, B.view(np.uint16), 8192, 16, 1024, 128)
    out = np.zeros((128, n // 2), np.float32)
    launch(kernel_name("__half", n), image, out, desc_a=descriptor(0, 16, 1024, 128),
           desc_b=descriptor(8192, 16, 1024, 128))
    for t in range(128):
        for i in range(n // 2):
            r, c = acc_position(t, i)
            assert out[t, i] == r + 64 * c, (t, i)


# ---- asynchrony, warpgroup agreement ---------------------------------------------------------------------


def small_case(mode, ksteps=1):
    A, B = operands("__half", 8, 16 * ksteps, 3)
    image = np.zeros(8192, np.uint16)
    place(image, A.view(np.uint16), 0, 16, 1024, 128)
    place(image, B.view(np.uint16), 8192, 16, 1024, 128)
    out = np.zeros((128, 4), np.float32)
    kw = dict(desc_a=descriptor(0, 16, 1024, 128), desc_b=descriptor(8192, 16, 1024, 128), step_a=2, step_b=2,
              ksteps=ksteps, mode=mode)
    return image, out, kw


def run_small(mode, ksteps=1):
    image, out, kw = small_case(mode, ksteps)
    launch(RACE, image, out, **kw)
    return out


@pytest.mark.parametrize("mode", [1, 2], ids=["accumulators read early", "operand overwritten early"])
def test_early_accesses_depend_on_when_the_wgmma_lands(mode):
    clean = run_small(0)
    results = []
    for seed in range(6):
        with sim.copy_landing(seed):
            results.append(run_small(mode))
            np.testing.assert_array_equal(run_small(0), clean)  # the clean twin: the same at every seed
    assert any(not np.array_equal(results[0], r) for r in results[1:]), "the result did not depend on the seed"


@pytest.mark.parametrize("mode, pattern", [
    # Warp 3 leaves: whichever side the scheduler meets first reports it.
    (6, r"(this thread exited while \d+ thread\(s\) of its warpgroup wait for it at wgmma.mma_async|"
        r"wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\): thread \(\d+,0,0\) of this warpgroup exited)"),
    (7, r"warpgroup collective mismatch: this thread reached wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\) with "
        r"m64n8k16 f16, desc-a 0x[0-9a-f]+, desc-b 0x[0-9a-f]+, scale-d 0 while \d+ thread\(s\) of its warpgroup"),
])
def test_warpgroup_disagreement_is_an_error(mode, pattern):
    image, out, kw = small_case(mode)
    with pytest.raises(sim.KernelError, match=pattern):
        launch(RACE, image, out, **kw)


def test_a_divergent_commit_is_an_error():
    image, out, kw = small_case(9)
    with pytest.raises(sim.KernelError, match=r"warp collective mismatch: lane 1 reached wgmma.commit_group "
                                              r"\(hopper_wgmma.cu:\d+:\d+\) .* while lane\(s\) 0 wait at "
                                              r"wgmma.wait_group"):
        launch(RACE, image, out, **kw)


def test_a_warp_that_never_arrives_is_a_deadlock_naming_the_site():
    image, out, kw = small_case(8)
    with pytest.raises(sim.KernelError, match=r"(?s)deadlock: .*thread \(0,0,0\) \.\. thread \(95,0,0\) waits at "
                                              r"wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\) for the rest of warpgroup 0 "
                                              r"\(96 of 128 threads arrived\).*thread \(96,0,0\) \.\. thread "
                                              r"\(127,0,0\) waits at __syncthreads"):
        launch(RACE, image, out, **kw)


def test_wgmma_needs_whole_warpgroups():
    image, out, kw = small_case(0)
    with pytest.raises(sim.KernelError, match=r"a warpgroup instruction in a block of 96 threads"):
        launch(RACE, image, out, block=96, **kw)


@pytest.fixture(scope="class")
def race_mode():
    sim.precompile([inst(RACE)], modes=("race",))
    with sim.checking("race"):
        yield


@pytest.mark.usefixtures("race_mode")
class TestRaceMode:

    @pytest.mark.parametrize("mode, ksteps", [(0, 1), (0, 3), (5, 3), (10, 3), (11, 3)])
    def test_clean_twins(self, mode, ksteps):
        out = run_small(mode, ksteps)
        with sim.checking("normal"):
            np.testing.assert_array_equal(out, run_small(mode, ksteps))
            np.testing.assert_array_equal(out, run_small(0, ksteps))  # the same sums in every pipeline

    @pytest.mark.parametrize("mode, ksteps, pattern", [
        (1, 1, r"wgmma accumulators in flight: this thread reads accumulator 0 of the wgmma issued at "
               r"wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\) before the wgmma.wait_group"),
        (2, 1, r"shared memory byte offset \d+ written while the wgmma issued at wgmma.mma_async "
               r"\(hopper_wgmma.cu:\d+:\d+\) reads it"),
        (3, 1, r"wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\): this thread issues a wgmma without a wgmma.fence"),
        (4, 3, r"wgmma.mma_async \(hopper_wgmma.cu:\d+:\d+\): this thread accessed the accumulator registers of "
               r"this wgmma since its last wgmma.fence"),
        (12, 1, r"async-proxy read of shared byte offset \d+ \(a wgmma or TMA operand\) without a fence.proxy.async"),
    ])
    def test_planted_bugs(self, mode, ksteps, pattern):
        image, out, kw = small_case(mode, ksteps)
        with pytest.raises(sim.KernelError, match=pattern):
            launch(RACE, image, out, **kw)


# ---- setmaxnreg ---------------------------------------------------------------------------------------------


def test_setmaxnreg_rebalances_within_the_budget():
    out = np.zeros(384, np.float32)
    launch("setmaxnreg_kernel", np.zeros(8, np.uint16), out, block=384)
    assert (out == 1).all()


@pytest.mark.parametrize("mode, pattern", [
    (1, r"(?s)deadlock.*waits at setmaxnreg.inc \(hopper_wgmma.cu:\d+:\d+\) for registers: its warpgroup asks for 232"),
    (2, r"warpgroup collective mismatch: this thread reached setmaxnreg.dec .* with setmaxnreg.dec 32 while 32 "
        r"thread\(s\) .* with setmaxnreg.dec 40"),
    (3, r"setmaxnreg.inc 160, but the warpgroup holds 168 registers per thread"),
    (4, r"(?s)deadlock.*asks for 232 per thread, the block's warpgroups hold \d+ of the 64512 it was launched with"),
])
def test_setmaxnreg_errors(mode, pattern):
    with pytest.raises(sim.KernelError, match=pattern):
        launch("setmaxnreg_kernel", np.zeros(8, np.uint16), np.zeros(384, np.float32), block=384, mode=mode)
