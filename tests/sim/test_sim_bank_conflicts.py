"""The bank-conflict profile (profile mode) on planted access patterns with known counts."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels.program import KernelInstance
from simkit import KERNELS, args

SOURCE = KERNELS / "bank_conflicts.cu"


def inst(name: str) -> KernelInstance:
    return KernelInstance(str(SOURCE), f"simbank::{name}")


def line_of(marker: str) -> str:
    for number, line in enumerate(SOURCE.read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"// {marker}"):
            return f"{SOURCE}:{number}"
    raise AssertionError(marker)


def profile(name: str, smem: int, **kwargs):
    with sim.checking("profile"):
        record = sim.launch(inst(name), 1, 32, smem, args(**{k: v for k, v in kwargs.items() if k in ("in0", "out0")},
                            **{k: v for k, v in kwargs.items() if k not in ("in0", "out0")}),
                            [v for k, v in kwargs.items() if k in ("in0", "out0")])
    return {(s.site, s.kind): s for s in record.shared_access_sites}


@pytest.mark.parametrize("stride, wavefronts", [(32, 32), (33, 1)])
def test_column_read_of_a_32_float_stride_is_32_way_and_padding_removes_it(stride, wavefronts):
    out = np.zeros(32, np.float32)
    sites = profile("column_read_kernel", 32 * 33 * 4, out0=out, n=stride)
    np.testing.assert_array_equal(out, np.arange(32) * 32)
    read = sites[(line_of("COLUMN_READ"), "load")]
    assert (read.bytes, read.instructions, read.wavefronts, read.ideal) == (4, 1, wavefronts, 1)
    assert read.excess == wavefronts - 1
    write = sites[(line_of("ROW_WRITE"), "store")]
    assert (write.instructions, write.wavefronts, write.ideal, write.excess) == (32, 32, 32, 0)


@pytest.mark.parametrize("swizzle", [0, 1])
def test_xor_swizzle_makes_cp_async_writes_and_ldmatrix_reads_conflict_free(swizzle):
    src = np.arange(64 * 64, dtype=np.uint16)
    out = np.zeros(8 * 128, np.uint32)
    sites = profile("swizzle_kernel", 64 * 128, in0=src, out0=out, mode=swizzle)
    # What ldmatrix returned is the tile itself, whatever the layout in shared memory.
    tile = src.reshape(64, 64)
    lane = np.arange(32)
    for step in range(8):
        for j in range(4):
            row, col = 8 * step + lane // 4, 8 * j + 2 * (lane % 4)
            expected = tile[row, col].astype(np.uint32) | (tile[row, col + 1].astype(np.uint32) << 16)
            np.testing.assert_array_equal(out[step * 128 + j * 32: step * 128 + j * 32 + 32], expected)
    copies = sites[(line_of("CP_ASYNC"), "cp.async")]
    assert (copies.bytes, copies.instructions, copies.ideal, copies.excess) == (16, 16, 64, 0)
    reads = sites[(line_of("LDMATRIX"), "ldmatrix")]
    assert (reads.instructions, reads.ideal) == (8, 32)
    # Unswizzled, the 8 rows of a matrix hold the same chunk, in the same 4 banks: 8 wavefronts a phase.
    assert reads.wavefronts == (32 if swizzle else 8 * 32)


def test_other_modes_record_no_profile():
    out = np.zeros(32, np.float32)
    record = sim.launch(inst("column_read_kernel"), 1, 32, 32 * 33 * 4, args(out0=out, n=32), [out])
    assert record.shared_access_sites == ()
