"""mma.sync m16n8k16, ldmatrix, stmatrix and cp.async twins against the PTX fragment layouts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels.program import KernelInstance
from simkit import ARGS_DTYPE, KERNELS

SOURCE = KERNELS / "tensor_ops.cu"
NAMES = ["mma_kernel<__half>", "mma_kernel<__nv_bfloat16>", "ldmatrix_bad_kernel", "cp_async_kernel",
         "cp_async_bad_kernel", "ldmatrix_mma_kernel<__half>", "ldmatrix_mma_kernel<__nv_bfloat16>",
         "cp_async_bytes_kernel<16>", "cp_async_bytes_kernel<16, true>", "pack_kernel<__half>",
         "pack_kernel<__nv_bfloat16>", "smem_address_kernel", "atomic_add2_kernel<0>", "atomic_add2_kernel<1>"] + [
    f"ldmatrix_kernel<{n}, {t}>" for n in (1, 2, 4) for t in ("false", "true")] + [
    f"stmatrix_kernel<{n}>" for n in (1, 2, 4)]


def inst(name: str) -> KernelInstance:
    return KernelInstance(str(SOURCE), f"simtensor::{name}")


@pytest.fixture(scope="module", autouse=True)
def _built():
    sim.precompile([inst(n) for n in NAMES], modes=("normal",))


def launch(name, block, smem=0, in0=None, in1=None, out0=None, out1=None, **ints):
    a = np.zeros((), ARGS_DTYPE)
    buffers = []
    for field, arr in (("in0", in0), ("in1", in1), ("out0", out0), ("out1", out1)):
        if arr is not None:
            a[field] = arr.ctypes.data
            buffers.append(arr)
    for field, value in ints.items():
        a[field] = value
    return sim.launch(inst(name), 1, block, smem, a[()], buffers)


def pack(lo, hi) -> int:
    return int(lo) | (int(hi) << 16)


# ---- layouts from the PTX ISA (g = lane >> 2, t = lane & 3) ----------------------------------


def a_fragment(A_bits, lane):
    g, t = lane >> 2, lane & 3
    return [pack(A_bits[g, 2 * t], A_bits[g, 2 * t + 1]), pack(A_bits[g + 8, 2 * t], A_bits[g + 8, 2 * t + 1]),
            pack(A_bits[g, 2 * t + 8], A_bits[g, 2 * t + 9]), pack(A_bits[g + 8, 2 * t + 8], A_bits[g + 8, 2 * t + 9])]


def b_fragment(B_bits, lane):
    g, t = lane >> 2, lane & 3
    return [pack(B_bits[2 * t, g], B_bits[2 * t + 1, g]), pack(B_bits[2 * t + 8, g], B_bits[2 * t + 9, g])]


def c_positions(lane):
    g, t = lane >> 2, lane & 3
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def ldmatrix_registers(matrices, lane, count, trans):
    g, t = lane >> 2, lane & 3
    regs = []
    for j in range(count):
        M = matrices[j]
        regs.append(pack(M[2 * t, g], M[2 * t + 1, g]) if trans else pack(M[g, 2 * t], M[g, 2 * t + 1]))
    return regs


@pytest.mark.parametrize("T, npdtype", [("__half", np.float16), ("__nv_bfloat16", ml_dtypes.bfloat16)])
def test_mma_m16n8k16(T, npdtype):
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 16)).astype(npdtype)
    B = rng.standard_normal((16, 8)).astype(npdtype)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    A_bits, B_bits = A.view(np.uint16), B.view(np.uint16)
    regs = np.array([a_fragment(A_bits, l) + b_fragment(B_bits, l) for l in range(32)], np.uint32)
    c_regs = np.array([[C[r, c] for r, c in c_positions(l)] for l in range(32)], np.float32)
    d_regs = np.zeros((32, 4), np.float32)
    launch(f"mma_kernel<{T}>", 32, in0=regs, in1=c_regs, out0=d_regs)
    D = np.zeros((16, 8), np.float32)
    for lane in range(32):
        for i, (r, c) in enumerate(c_positions(lane)):
            D[r, c] = d_regs[lane, i]
    expected = A.astype(np.float64) @ B.astype(np.float64) + C
    np.testing.assert_allclose(D, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("pitch", [16, 48])
def test_ldmatrix(count, trans, pitch):
    rng = np.random.default_rng(count * 2 + trans)
    matrices = rng.integers(0, 2**16, (4, 8, 8), dtype=np.uint16)
    out = np.zeros((32, 4), np.uint32)
    launch(f"ldmatrix_kernel<{count}, {'true' if trans else 'false'}>", 32, smem=32 * pitch,
           in0=matrices.reshape(-1), out0=out, width=pitch)
    for lane in range(32):
        assert out[lane, :count].tolist() == ldmatrix_registers(matrices, lane, count, trans), lane
        assert out[lane, count:].tolist() == [0] * (4 - count)


@pytest.mark.parametrize("T, npdtype", [("__half", np.float16), ("__nv_bfloat16", ml_dtypes.bfloat16)])
def test_ldmatrix_fragments_feed_mma(T, npdtype):
    # A through ldmatrix.x4 and B (k-major) through ldmatrix.x2.trans into mma: D must be A B.
    rng = np.random.default_rng(5)
    A = rng.standard_normal((16, 16)).astype(npdtype)
    B = rng.standard_normal((16, 8)).astype(npdtype)
    d_regs = np.zeros((32, 4), np.float32)
    launch(f"ldmatrix_mma_kernel<{T}>", 32, smem=768,
           in0=np.concatenate([A.view(np.uint16).ravel(), B.view(np.uint16).ravel()]), out0=d_regs)
    D = np.zeros((16, 8), np.float32)
    for lane in range(32):
        for i, (r, c) in enumerate(c_positions(lane)):
            D[r, c] = d_regs[lane, i]
    np.testing.assert_allclose(D, A.astype(np.float64) @ B.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, pattern", [(1, "not 16-byte aligned"), (2, "outside the block's dynamic shared")])
def test_ldmatrix_bad_addresses(mode, pattern):
    out = np.zeros(32, np.uint32)
    with pytest.raises(sim.KernelError, match=pattern):
        launch("ldmatrix_bad_kernel", 32, smem=256, out0=out, mode=mode)


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("pitch", [16, 48])
def test_stmatrix(count, pitch):
    """stmatrix mirrors ldmatrix: register j of lane l (row l / 4, columns 2 (l % 4) and + 1 of matrix j) lands in
    row l % 8 of matrix l / 8 at lane l's address; rows of matrices past kCount stay untouched, and reading them
    back through ldmatrix's layout gives the registers again."""
    rng = np.random.default_rng(10 + count + pitch)
    matrices = rng.integers(0, 2**16, (4, 8, 8), dtype=np.uint16)
    regs = np.array([ldmatrix_registers(matrices, lane, 4, False) for lane in range(32)], np.uint32)
    out = np.full((32, 4), 7, np.uint32)
    launch(f"stmatrix_kernel<{count}>", 32, smem=32 * pitch, in0=regs, out0=out, width=pitch, mode=0)
    rows = out.view(np.uint16).reshape(4, 8, 8)  # row l of shared memory is row l % 8 of matrix l / 8
    np.testing.assert_array_equal(rows[:count], matrices[:count])
    assert not rows[count:].any()


@pytest.mark.parametrize("mode, pattern", [(2, "not 16-byte aligned"), (3, "outside the block's dynamic shared")])
def test_stmatrix_bad_addresses(mode, pattern):
    out = np.zeros((32, 4), np.uint32)
    with pytest.raises(sim.KernelError, match=pattern):
        launch("stmatrix_kernel<4>", 32, smem=32 * 16, in0=np.zeros((32, 4), np.uint32), out0=out, width=16,
               mode=mode)


def test_stmatrix_rows_are_their_address_lanes_stores_in_race_mode():
    """Each row is its address lane's store: another lane of the warp reads it after a __syncwarp (clean), not
    without one (a race naming the missing __syncwarp)."""
    sim.precompile([inst("stmatrix_kernel<4>")], modes=("race",))
    regs = np.arange(128, dtype=np.uint32).reshape(32, 4)
    out = np.zeros((32, 4), np.uint32)
    with sim.checking("race"):
        launch("stmatrix_kernel<4>", 32, smem=32 * 16, in0=regs, out0=out, width=16, mode=0)
        with pytest.raises(sim.KernelError, match="data race on shared memory") as info:
            launch("stmatrix_kernel<4>", 32, smem=32 * 16, in0=regs, out0=out, width=16, mode=1)
    assert "__syncwarp" in str(info.value)


def test_cp_async_applies_at_wait():
    n = 64
    src = np.arange(4 * n, dtype=np.float32) + 1
    out0 = np.zeros(4 * n, np.float32)
    out1 = np.zeros(n, np.float32)
    rec = launch("cp_async_kernel", n, smem=16 * n, in0=src, out0=out0, out1=out1, mode=0, n=8)
    assert out0.tolist() == src.tolist()
    assert out1.tolist() == src.reshape(n, 4)[np.roll(np.arange(n), -1), 0].tolist()
    assert rec.global_bytes_read == n * 16


def test_cp_async_zero_fills_past_src_size():
    n = 32
    src = np.arange(4 * n, dtype=np.float32) + 1
    out0 = np.zeros(4 * n, np.float32)
    out1 = np.zeros(n, np.float32)
    rec = launch("cp_async_kernel", n, smem=16 * n, in0=src, out0=out0, out1=out1, mode=0, n=4)
    got = out0.reshape(n, 4)
    assert got[:, 1].tolist() == [0.0] * n
    assert got[:, [0, 2, 3]].tolist() == src.reshape(n, 4)[:, [0, 2, 3]].tolist()
    assert rec.global_bytes_read == n * 12


@pytest.mark.parametrize("mode, pattern", [(0, "aligned"), (1, "out of bounds"), (2, "outside the block")])
def test_cp_async_errors(mode, pattern):
    src = np.zeros(16, np.float32)
    with pytest.raises(sim.KernelError, match=pattern):
        launch("cp_async_bad_kernel", 32, smem=64, in0=src, mode=mode, n=16, extra=64)


@pytest.mark.parametrize("src_bytes", [16, 12, 0])
def test_cp_async_16_bytes_copies_and_zero_fills(src_bytes):
    n = 32
    src = np.arange(1, 4 * n + 1, dtype=np.uint32)
    out = np.full(4 * n, 0xDEAD, dtype=np.uint32)
    rec = launch("cp_async_bytes_kernel<16>", n, smem=16 * n, in0=src, out0=out, n=src_bytes)
    expected = src.reshape(n, 4).copy()
    expected[:, src_bytes // 4:] = 0
    np.testing.assert_array_equal(out.reshape(n, 4), expected)
    assert rec.global_bytes_read == n * src_bytes


def test_cp_async_whole_form_copies_all_16_bytes():
    # The form without src-size, arch::cp_async<16>(dst, src), reads all 16 bytes and fills nothing.
    n = 32
    src = np.arange(1, 4 * n + 1, dtype=np.uint32)
    out = np.full(4 * n, 0xDEAD, dtype=np.uint32)
    rec = launch("cp_async_bytes_kernel<16, true>", n, smem=16 * n, in0=src, out0=out, n=0)
    np.testing.assert_array_equal(out, src)
    assert rec.global_bytes_read == n * 16


@pytest.mark.parametrize("T, npdtype", [("__half", np.float16), ("__nv_bfloat16", ml_dtypes.bfloat16)])
def test_pack_float2_rounds_to_nearest_even_lo_in_the_low_half(T, npdtype):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(48).astype(np.float32) * 100,
                        np.array([0.0, -0.0, 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 1e30, -1e-30, np.inf, -np.inf,
                                  1 + 2**-8, 1 + 3 * 2**-8, 3.0, 2**-30, 7.5, -2.25, 0.1], np.float32)])
    out = np.zeros(x.size // 2, dtype=np.uint32)
    launch(f"pack_kernel<{T}>", x.size // 2, in0=x, out0=out)
    with np.errstate(over="ignore"):  # 1e30 overflows float16 to inf, as cvt.rn does
        bits = x.astype(npdtype).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(out, bits[0::2] | bits[1::2] << 16)


def test_smem_address_is_the_byte_offset_from_an_aligned_shared_base():
    out = np.zeros(32, dtype=np.uint32)
    base = np.ones(32, dtype=np.uint32)
    launch("smem_address_kernel", 32, smem=16 * 32, out0=out, out1=base)
    np.testing.assert_array_equal(out, 16 * np.arange(32))
    assert (base == 0).all(), "the shared base is 1024-byte aligned in the shared window (swizzle atoms rely on it)"


def test_atomic_add2_adds_both_elements_of_the_pair():
    """red.global.add.v2.f32's twin: 64 threads into 4 pairs, each element its own atomic add (mixing with the
    scalar atomic_add on the pair's first element); 8 bytes read and written per pair add, 4 per scalar one."""
    n, threads = 4, 64
    x = np.arange(2 * threads, dtype=np.float32)  # small integers: every order of the adds gives the same sum
    out = np.zeros(2 * n, dtype=np.float32)
    rec = launch("atomic_add2_kernel<0>", threads, in0=x, out0=out, n=n)
    expected = x.reshape(threads // n, n, 2).sum(axis=0).reshape(-1)
    expected[0::2] += threads // n
    np.testing.assert_array_equal(out, expected)
    assert rec.global_bytes_written == threads * (8 + 4)
    assert rec.global_bytes_read == threads * (8 + 8 + 4)  # x's pair, then the two reductions' reads


def test_atomic_add2_needs_an_aligned_pair():
    out = np.zeros(16, dtype=np.float32)
    with pytest.raises(sim.KernelError, match="misaligned"):
        launch("atomic_add2_kernel<1>", 4, in0=np.zeros(8, np.float32), out0=out, n=4)

