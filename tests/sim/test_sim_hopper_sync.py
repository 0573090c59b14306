"""The Hopper synchronization twins (mbarrier, named barriers, elect.sync, fence.proxy.async) on the simulator:
their semantics, each strict check on a planted bug beside its clean twin, deadlock reports, and race mode's
happens-before edges through mbarriers and named barriers and its async-proxy check.
Kernels: tests/sim/kernels/hopper_sync.cu (tests/test_arch_hopper_sync.py checks their SASS)."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels.program import KernelInstance
from simkit import ARGS_DTYPE, KERNELS

SOURCE = KERNELS / "hopper_sync.cu"
NAMES = ["handoff_kernel", "mbarrier_ops_kernel", "named_barrier_kernel", "elect_kernel", "async_proxy_kernel"]


def inst(name: str) -> KernelInstance:
    return KernelInstance(str(SOURCE), f"simhopper::{name}")


def launch(name, block, smem=0, in0=None, out0=None, out1=None, **ints):
    a = np.zeros((), ARGS_DTYPE)
    buffers = []
    for field, arr in (("in0", in0), ("out0", out0), ("out1", out1)):
        if arr is not None:
            a[field] = arr.ctypes.data
            buffers.append(arr)
    for field, value in ints.items():
        a[field] = value
    return sim.launch(inst(name), 1, block, smem, a[()], buffers)


@pytest.fixture(scope="module", params=["normal", "race"])
def mode(request):
    sim.precompile([inst(n) for n in NAMES], modes=(request.param,))
    with sim.checking(request.param):
        yield request.param


# ---- mbarrier ----------------------------------------------------------------------------------------


def handoff(mode_value, rounds=3):
    x = np.arange(32 * rounds, dtype=np.float32)
    out = np.zeros(32 * rounds, np.float32)
    launch("handoff_kernel", 64, smem=16 + 128, in0=x, out0=out, n=rounds, mode=mode_value)
    return x, out


@pytest.mark.parametrize("variant", [0, 4, 5])
def test_producer_consumer_handoff_through_mbarriers(mode, variant):
    x, out = handoff(variant)
    assert out.tolist() == [x[32 * (i // 32) + (i % 32 + 1) % 32] for i in range(out.size)]


def test_try_wait_parity_follows_the_isa(mode):
    out = np.full(8, -1, np.int32)
    launch("mbarrier_ops_kernel", 32, smem=16, out0=out, mode=0)
    # phase 0 incomplete (parity 0 false, the preceding parity 1 true); arrivals done but bytes pending;
    # half the bytes; all of them (phase 0 complete: parity 0 true, parity 1 now the current phase);
    # phase 1 completed by bytes that came before their expectation: parity 0 is current again.
    assert out[:7].tolist() == [0, 1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("bug, message", [
    (1, r"no initialized mbarrier at shared byte offset 8 \(mbarrier.init must come first\)"),
    (2, r"mbarrier at shared byte offset 4 is not 8-byte aligned"),
    (3, r"over-arrival: no arrival is pending on the mbarrier at shared byte offset 8 .*phase 0 \(parity 0\) "
        r"with 0 of 1 arrivals pending and a tx-count of 16 bytes"),
    (4, r"32 completed bytes exceed the 16 expected"),
    (7, r"is not inside the block's dynamic shared memory"),
])
def test_mbarrier_misuse_is_an_error(mode, bug, message):
    out = np.zeros(8, np.int32)
    spare = np.zeros(2, np.uint64)
    with pytest.raises(sim.KernelError, match=message) as info:
        launch("mbarrier_ops_kernel", 32, smem=16, out0=out, out1=spare, mode=bug)
    assert "hopper_sync.cu:" in str(info.value)  # the site


def test_bytes_that_never_arrive_are_a_deadlock(mode):
    out = np.zeros(8, np.int32)
    with pytest.raises(sim.KernelError, match="deadlock") as info:
        launch("mbarrier_ops_kernel", 32, smem=16, out0=out, mode=5)
    text = str(info.value)
    assert "thread (0,0,0) waits at mbarrier_wait (hopper_sync.cu:" in text
    assert ("for parity 0 of the mbarrier at shared byte offset 8 (initialized at mbarrier.init (hopper_sync.cu:"
            in text)
    assert "phase 0 (parity 0) with 0 of 1 arrivals pending and a tx-count of 128 bytes" in text


def test_handoff_deadlock_names_barrier_and_waiting_threads(mode):
    with pytest.raises(sim.KernelError, match="deadlock: no thread of the block can proceed") as info:
        handoff(2)
    text = str(info.value)
    assert "thread (32,0,0) .. thread (63,0,0) waits at mbarrier_wait" in text
    assert "shared byte offset 0" in text and "a tx-count of 128 bytes" in text


def test_polling_a_phase_that_never_completes_is_a_deadlock(mode):
    out = np.zeros(8, np.int32)
    with pytest.raises(sim.KernelError, match=r"deadlock: mbarrier.try_wait.parity \(hopper_sync.cu:\d+:\d+\) polled "
                                              r"1024 times for parity 0 of the mbarrier at shared byte offset 8 .* 1 of 2 "
                                              r"arrivals pending .* while no other thread of the block can run"):
        launch("mbarrier_ops_kernel", 32, smem=16, out0=out, mode=6)


def test_early_phase_completion_is_a_race(mode):
    # Each consumer arrives twice: `empty` completes with half the consumers, so the producer refills the
    # buffer while the other half still reads it. Same data, so only race mode sees it.
    if mode == "race":
        with pytest.raises(sim.KernelError, match="data race on shared memory"):
            handoff(3)
    else:
        handoff(3)


# ---- named barriers --------------------------------------------------------------------------------


def named(mode_value):
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    launch("named_barrier_kernel", 128, smem=256, in0=x, out0=out, mode=mode_value)
    return x, out


def test_named_barrier_handoff(mode):
    x, out = named(0)
    assert out.tolist() == [2 * x[(i + 1) % 64] for i in range(64)]


@pytest.mark.parametrize("bug, message", [
    (1, r"barrier 1 reached with a thread count of 96 while thread \(0,0,0\) arrived at bar.arrive .* with 128"),
    (2, r"a thread count of 100 is not a multiple of the warp size"),
    (3, r"barrier id 16 is outside 0 .. 15"),
    (4, r"named barrier 0 is the barrier of __syncthreads"),
    (5, r"deadlock: no thread of the block can proceed:\n    thread \(64,0,0\) .. thread \(127,0,0\) waits at "
        r"bar.sync \(hopper_sync.cu:\d+:\d+\) on named barrier 1 \(64 of 128 threads counted\)"),
    (6, r"this thread exits without arriving at barrier 1, where lanes 0-15 of its warp arrived \(bar.arrive "
        r"\(hopper_sync.cu:\d+:\d+\)\): bar.sync and bar.arrive are .aligned(.|\n)*thread \(16,0,0\)"),
    (7, r"this thread arrives twice at one instance of barrier 1"),
])
def test_named_barrier_misuse_is_an_error(mode, bug, message):
    with pytest.raises(sim.KernelError, match=message):
        named(bug)


# ---- elect.sync --------------------------------------------------------------------------------------


def test_elect_one_sync_elects_the_lowest_lane(mode):
    out = np.full(64, -1, np.int32)
    launch("elect_kernel", 64, out0=out, mode=0)
    assert np.flatnonzero(out).tolist() == [0, 32]
    with pytest.raises(sim.KernelError, match=r"lane 5 exited while lane\(s\) 0-4 wait for it at elect.sync"):
        launch("elect_kernel", 64, out0=out, mode=1)


# ---- race mode: happens-before through mbarriers and named barriers; the async proxy -------------------


def test_consumer_without_the_wait_races(mode):
    if mode != "race":
        pytest.skip("only race mode sees a read that no wait orders after the write")
    # The last thread through the opening __syncthreads runs first: consumer thread 63 reads (and goes on, never
    # waiting), so the producer's write is the second access of the race.
    with pytest.raises(sim.KernelError, match=r"data race on shared memory byte offset 16: this thread writes it, "
                                              r"thread \(63,0,0\) read it .*nor an mbarrier or named-barrier handoff"):
        handoff(1)


def test_elected_arrival_without_syncwarp_races(mode):
    if mode != "race":
        pytest.skip("race mode only")
    handoff(5)  # the clean twin: __syncwarp, then the elected lane arrives for the warp
    with pytest.raises(sim.KernelError, match=r"data race on shared memory byte offset 20: this thread reads it, "
                                              r"thread \(1,0,0\) wrote it"):
        handoff(6)


def test_use_of_an_mbarrier_not_ordered_after_its_init(mode):
    if mode != "race":
        handoff(7)  # the fibers happen to run the init first: only race mode sees the missing ordering
        return
    with pytest.raises(sim.KernelError, match=r"mbarrier_wait \(hopper_sync.cu:\d+:\d+\): uses the mbarrier at "
                                              r"shared byte offset 8, which thread \(0,0,0\) initialized at "
                                              r"mbarrier.init \(hopper_sync.cu:\d+:\d+\), with nothing ordering"
                                              r"(.|\n)*thread \(1,0,0\)"):
        handoff(7)


def test_named_barrier_without_the_sync_races(mode):
    if mode != "race":
        pytest.skip("only race mode sees a read that no barrier orders after the write")
    with pytest.raises(sim.KernelError, match="data race on shared memory"):
        named(8)


@pytest.mark.parametrize("bug", [1, 2, 3])
def test_async_proxy_read_needs_the_writers_fence(mode, bug):
    out = np.zeros(32, np.float32)
    launch("async_proxy_kernel", 32, smem=512, out0=out, mode=0)  # every writer fenced: clean
    assert out.tolist() == [float((4 * t + 4) % 128) for t in range(32)]
    if mode != "race":
        launch("async_proxy_kernel", 32, smem=512, out0=out, mode=bug)  # the other modes do not model proxies
        return
    # Thread 0 reads. In bug 2 it fenced; in bug 3 its own fence precedes its read in program order: either way
    # its own bytes are fine, and the first unfenced byte is thread 1's.
    writer = 0 if bug == 1 else 1
    with pytest.raises(sim.KernelError, match=rf"async-proxy read of shared byte offset {16 * writer} \(a wgmma or "
                                              rf"TMA operand\) without a fence.proxy.async: thread \({writer},0,0\) "
                                              r"wrote it with an ordinary"):
        launch("async_proxy_kernel", 32, smem=512, out0=out, mode=bug)


# ---- the other modes: the twins' blocking (fiber switches) under ASan, named barriers as profile sync points ----


def _asan_scenarios() -> list[str]:
    sim.precompile([inst("handoff_kernel"), inst("named_barrier_kernel")], modes=("asan",))
    with sim.checking("asan"):
        _, out = handoff(0)
        x, named_out = named(0)
        try:
            handoff(2)
            deadlock = "none"
        except sim.KernelError as error:
            deadlock = str(error).splitlines()[0]
    return [sim.current_mode(), str(out[:4].tolist()), str(named_out[:2].tolist()), deadlock]


def test_twins_under_asan():
    mode, out, named_out, deadlock = sim.run_in_asan_subprocess(_asan_scenarios)
    assert mode == "asan" and out == "[1.0, 2.0, 3.0, 4.0]" and named_out == "[2.0, 4.0]"
    assert deadlock == "deadlock: no thread of the block can proceed:"


def test_named_barrier_in_profile_mode():
    sim.precompile([inst("named_barrier_kernel")], modes=("profile",))
    with sim.checking("profile"):
        x, out = named(0)
    assert out.tolist() == [2 * x[(i + 1) % 64] for i in range(64)]
