"""Race mode: data races on shared memory (barriers, __syncwarp) and global memory (across blocks)."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from simkit import kernel, run

RACE_KERNELS = [
    "smem_exchange_kernel",
    "smem_reuse_kernel",
    "warp_exchange_kernel",
    "global_blocks_kernel",
    "barrier_visibility_kernel",
    "traffic_kernel",
    "global_oob_kernel",
]


@pytest.fixture(scope="module", autouse=True)
def race_mode():
    sim.precompile([kernel(n) for n in RACE_KERNELS], modes=("race",))
    with sim.checking("race"):
        yield


def test_mode_is_race():
    assert sim.current_mode() == "race"


def test_missing_syncthreads_is_a_shared_race():
    x = np.arange(128, dtype=np.float32)
    out = np.zeros(128, np.float32)
    run("smem_exchange_kernel", 1, 128, smem=512, in0=x, out0=out, mode=0)  # with the barrier: clean
    assert out.tolist() == np.roll(x, -1).tolist()
    with pytest.raises(sim.KernelError, match="data race on shared memory") as info:
        run("smem_exchange_kernel", 1, 128, smem=512, in0=x, out0=out, mode=1)
    text = str(info.value)
    # Thread 0 reads slot 1 before thread 1 wrote it (fibers run in order): thread 1's
    # write is the second access, and the report names both threads and the byte offset.
    assert "kernel simtest::smem_exchange_kernel" in text
    assert "thread (1,0,0)" in text and "thread (0,0,0)" in text
    assert "byte offset 4" in text
    assert "no __syncthreads()" in text


def test_write_after_read_race_on_reused_tile():
    out = np.zeros(64, np.float32)
    run("smem_reuse_kernel", 1, 64, smem=256, out0=out, mode=0)
    with pytest.raises(sim.KernelError, match="data race on shared memory"):
        run("smem_reuse_kernel", 1, 64, smem=256, out0=out, mode=1)


def test_correct_kernels_are_clean():
    out = np.zeros(4 * 96, np.int32)
    run("barrier_visibility_kernel", 4, 96, smem=4 * 96, out0=out)
    n = 2 * 64
    in0 = np.zeros(n + n // 2, np.float32)
    in1 = np.zeros(4 * n, np.float32)
    out0 = np.zeros(2 * n, np.float32)
    out1 = np.zeros(1, np.float32)
    rec = run("traffic_kernel", 2, 64, in0=in0, in1=in1, out0=out0, out1=out1, n=n)
    assert rec.global_bytes_read == n * 26  # counting works in race mode too
    assert out1[0] == n


def test_warp_exchange_needs_syncwarp():
    out = np.zeros(64, np.float32)
    run("warp_exchange_kernel", 1, 64, smem=256, out0=out, mode=0)
    assert out.tolist() == [float((t & ~31) + ((t & 31) ^ 1)) for t in range(64)]
    with pytest.raises(sim.KernelError, match="data race on shared memory") as info:
        run("warp_exchange_kernel", 1, 64, smem=256, out0=out, mode=1)
    assert "__syncwarp" in str(info.value)


def test_syncwarp_must_name_both_lanes():
    # Each half-warp synchronizes only itself; lanes 15 and 16 exchange across halves.
    out = np.zeros(32, np.float32)
    with pytest.raises(sim.KernelError, match="data race on shared memory"):
        run("warp_exchange_kernel", 1, 32, smem=128, out0=out, mode=2)


def test_cross_block_global_write_race():
    out0 = np.zeros(2 * 64, np.float32)
    out1 = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match=r"data race on global memory \(buffer 0\)") as info:
        run("global_blocks_kernel", 2, 64, out0=out0, out1=out1, mode=0)
    text = str(info.value)
    assert "block (0,0,0) thread (0,0,0)" in text and "block (1,0,0)" in text
    assert "different blocks" in text


def test_cross_block_read_write_race():
    out0 = np.zeros(2 * 64, np.float32)
    out1 = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match="data race on global memory"):
        run("global_blocks_kernel", 2, 64, out0=out0, out1=out1, mode=3)


def test_disjoint_slices_and_atomics_are_clean():
    out0 = np.zeros(3 * 64, np.float32)
    out1 = np.zeros(64, np.float32)
    run("global_blocks_kernel", 3, 64, out0=out0, out1=out1, mode=1)
    assert out0.tolist() == np.repeat(np.arange(3, dtype=np.float32), 64).tolist()
    run("global_blocks_kernel", 3, 64, out0=out0, out1=out1, mode=2)
    assert np.all(out1 == 3)


def test_launches_are_ordered():
    # The same bytes written by two launches in a row are not a race.
    out0 = np.zeros(2 * 64, np.float32)
    out1 = np.zeros(64, np.float32)
    for _ in range(2):
        run("global_blocks_kernel", 2, 64, out0=out0, out1=out1, mode=1)


def test_other_errors_still_reported_in_race_mode():
    out = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match="global store out of bounds"):
        run("global_oob_kernel", 1, 64, out0=out, n=64, extra=3)
