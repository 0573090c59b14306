"""How a call is timed: device milliseconds and host microseconds per call, L2 flushed before every timed run.

A timed call has two costs that the sweep reports apart:

* **device milliseconds**: how long the GPU is busy with the call's kernels;
* **host microseconds**: the wall-clock time the call takes on the host
  (``time.perf_counter`` around it): argument checks, planning, allocation,
  launches. cuflash spends 150-450 us there per call, which at FA2's short
  sequences is as long as the kernels themselves.

**Busy start** (``BusyStartTimer``; cuflash, CuPy + cuBLAS, PyTorch SDPA).
Before every timed run the stream the system launches on gets, without any
synchronize: an overwrite of twice the L2 cache's bytes (no input is served
from the cache a previous run warmed), then a kernel that spins for a set
number of microseconds, then the start event. The host then makes the call
while the GPU is still spinning, so the call's kernels are queued behind the
start event before it fires, and the end event follows the last of them:
start to end is device time only. The spin is sized from the warm-up calls'
host time and doubled, and the run repeated, whenever the host took longer to
queue the call than the spin lasted (the device went idle inside the window);
a run that stays uncovered after a few tries is counted in ``Sample.uncovered``
and shown in the table. What the method cannot hide: host work *after* a
call's last launch (it ends the window only if it outlasts the kernels), and a
call that synchronizes with the device inside itself.

**Back to back** (``BackToBackTimer``; JAX). JAX dispatches to streams of its
own that no CUDA event on CuPy's or PyTorch's stream can bracket, and no public
JAX API hands out that stream. So JAX's figure is wall-clock: the L2 overwrite
runs as a jitted program on JAX's streams and is waited for (untimed), then N
jitted calls are dispatched back to back (dispatch is asynchronous) and waited
for once; the figure is the elapsed time over N. While the GPU is busier than
the host (the sweep's problems), it is device time plus 1/N of one dispatch and
one wait; where the host dispatch per call is the slower, it is the host's rate
and the run counts as uncovered. Only the first of the N calls starts from a
flushed L2. The host figure is the dispatch time per call.

Everything here but the CuPy, PyTorch and JAX bindings at the bottom is plain
Python, tested with a fake device and a fake clock (tests/test_benchmarks_speed.py).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol


class NoGpuError(RuntimeError):
    """Raised when no CUDA device is visible: GPU speed cannot be measured here."""


@dataclass(frozen=True)
class Run:
    """One timed run of a call: device milliseconds, host microseconds, and whether the device stayed busy."""

    device_ms: float
    host_us: float
    covered: bool = True


class Timer(Protocol):
    """Times one call: ``warm(fn)`` runs it untimed, ``run(fn)`` times it once."""

    def warm(self, fn: Callable[[], object]) -> None: ...

    def run(self, fn: Callable[[], object]) -> Run: ...


@dataclass(frozen=True)
class Sample:
    """The timed runs of one call in the order they ran: device ms, host us, and how many were uncovered."""

    milliseconds: tuple[float, ...]
    host_microseconds: tuple[float, ...] = ()
    uncovered: int = 0

    @property
    def median(self) -> float:
        return float(statistics.median(self.milliseconds))

    @property
    def host_median(self) -> float:
        return float(statistics.median(self.host_microseconds)) if self.host_microseconds else math.nan


def measure(fn: Callable[[], object], timer: Timer, *, warmup: int = 3, repeats: int = 10) -> Sample:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed by ``timer``."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        timer.warm(fn)
    runs = [timer.run(fn) for _ in range(repeats)]
    return Sample(tuple(float(r.device_ms) for r in runs), tuple(float(r.host_us) for r in runs),
                  sum(not r.covered for r in runs))


class Stream(Protocol):
    """What BusyStartTimer needs from the stream a system launches on; nothing here synchronizes but ``elapsed_ms``."""

    def flush(self) -> None: ...  # queue an overwrite of twice the L2 cache

    def busy(self, microseconds: float) -> None: ...  # queue a kernel that spins this long

    def event(self) -> object: ...  # record an event now

    def elapsed_ms(self, start: object, end: object) -> float: ...  # wait for ``end``, then start to end


class BusyStartTimer:
    """Start event behind an L2 flush and a spin, so the host's preparation of the call overlaps device work."""

    MIN_BUSY_US = 100.0
    MAX_BUSY_US = 50_000.0
    TRIES = 4

    def __init__(self, stream: Stream, clock: Callable[[], float] | None = None):
        self.stream, self.clock = stream, clock or time.perf_counter
        self.busy_us = self.MIN_BUSY_US
        self._warm_host_us: list[float] = []

    def warm(self, fn) -> None:
        t0 = self.clock()
        fn()
        self._warm_host_us.append((self.clock() - t0) * 1e6)
        self.stream.elapsed_ms(self.stream.event(), self.stream.event())  # the device idle, as every run starts
        # The fastest warm-up is the steady state (the first may compile); twice it leaves room for jitter,
        # and a short spin wastes nothing: it runs before the start event.
        self.busy_us = min(max(2 * min(self._warm_host_us) + 50, self.MIN_BUSY_US), self.MAX_BUSY_US)

    def run(self, fn) -> Run:
        for attempt in range(self.TRIES):
            queued = self.clock()
            self.stream.flush()
            self.stream.busy(self.busy_us)
            start = self.stream.event()
            t0 = self.clock()
            fn()
            t1 = self.clock()
            end = self.stream.event()
            device_ms = float(self.stream.elapsed_ms(start, end))
            # The spin starts no earlier than ``queued`` (the flush runs first), so a call queued within
            # busy_us of it was queued before the start event fired.
            needed_us = (t1 - queued) * 1e6
            if needed_us < self.busy_us:
                # A warm-up that compiled sized the spin for seconds: spin no longer than this run needed.
                self.busy_us = min(self.busy_us, max(2 * needed_us + 50, self.MIN_BUSY_US))
                return Run(device_ms, (t1 - t0) * 1e6, True)
            self.busy_us = min(2 * needed_us, self.MAX_BUSY_US)
        return Run(device_ms, (t1 - t0) * 1e6, False)


class BackToBackTimer:
    """N asynchronous calls between two host clock readings and one wait (for JAX, whose streams events cannot reach).

    ``flush()`` queues the L2 overwrite on the system's own streams and returns something ``block`` waits for;
    ``block(x)`` waits until ``x`` (a call's result) is computed.
    """

    TARGET_MS = 5.0  # enough back-to-back work that one dispatch and one wait are small beside it
    MAX_CALLS = 50

    def __init__(self, flush: Callable[[], object], block: Callable[[object], object],
                 clock: Callable[[], float] | None = None, calls: int | None = None):
        self.flush, self.block, self.clock = flush, block, clock or time.perf_counter
        self.calls = calls
        self._per_call_ms: list[float] = []  # warm-ups (a first one may compile) and timed runs so far

    def warm(self, fn) -> None:
        t0 = self.clock()
        self.block(fn())
        self._per_call_ms.append((self.clock() - t0) * 1e3)

    def _count(self) -> int:
        if self.calls is not None:
            return self.calls
        if not self._per_call_ms:
            return 5
        return max(3, min(self.MAX_CALLS, math.ceil(self.TARGET_MS / max(min(self._per_call_ms), 1e-3))))

    def run(self, fn) -> Run:
        n = self._count()
        self.block(self.flush())
        dispatch = 0.0
        t0 = self.clock()
        for _ in range(n):
            ta = self.clock()
            result = fn()
            dispatch += self.clock() - ta
        self.block(result)
        elapsed_s = self.clock() - t0
        device_ms, host_us = elapsed_s * 1e3 / n, dispatch * 1e6 / n
        self._per_call_ms.append(device_ms)  # later runs size N from it when the warm-up was a compile
        # Dispatching as slowly as the device computes means the host set the pace, not the GPU.
        return Run(device_ms, host_us, covered=host_us < 0.9 * device_ms * 1e3)


# ---- the GPU bindings: CuPy for the flush and the spin, CuPy's or PyTorch's events, JAX's own programs.


def cupy_or_refuse():
    """CuPy with a visible CUDA device, or NoGpuError saying why timing is refused."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # CuPy missing, no driver, no device: all mean no GPU here
        pass
    raise NoGpuError(
        "GPU speed needs a CUDA GPU visible to CuPy (pip install 'cuflash[cuda13]'); none was found. "
        "The CPU simulator runs the same kernels, but its timings are not GPU speed."
    )


def l2_flush_bytes(cupy) -> int:
    """Twice the current device's L2 cache (a 32 MiB L2 assumed if the driver does not say)."""
    return 2 * (int(cupy.cuda.Device().attributes.get("L2CacheSize", 0)) or 32 << 20)


# Spins for a number of SM clock cycles (clock64, a CUDA built-in: no inline PTX outside cuda_src/arch). Cycles are
# converted from microseconds at the device's rated clock; boost makes the spin shorter or longer than asked, which
# BusyStartTimer absorbs (it doubles a spin that did not cover the call). One thread keeps the stream busy.
_SPIN_SOURCE = r"""
extern "C" __global__ void cuflash_bench_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


class CudaStream:
    """A CUDA stream as BusyStartTimer sees it: CuPy queues the flush and the spin, events come from CuPy or PyTorch.

    ``stream_ptr`` gives the stream's handle (None: CuPy's current stream); ``make_event()`` returns an event
    object with ``record()`` on that stream and ``synchronize()``; ``elapsed`` is ``(start, end) -> ms``.
    """

    def __init__(self, cupy, make_event: Callable[[], object], elapsed: Callable[[object, object], float],
                 stream_ptr: Callable[[], int] | None = None):
        import numpy as np

        self._cupy, self._np = cupy, np
        self._make_event, self._elapsed, self._stream_ptr = make_event, elapsed, stream_ptr
        self.bytes = l2_flush_bytes(cupy)
        self._buffer = cupy.empty(self.bytes, dtype=cupy.uint8)
        self._spin = cupy.RawKernel(_SPIN_SOURCE, "cuflash_bench_spin")
        self._cycles_per_us = int(cupy.cuda.Device().attributes.get("ClockRate", 0) or 2_000_000) / 1000.0  # kHz

    def _on_stream(self, work: Callable[[], None]) -> None:
        if self._stream_ptr is None:
            work()
        else:
            with self._cupy.cuda.ExternalStream(self._stream_ptr()):
                work()

    def flush(self) -> None:
        self._on_stream(lambda: self._buffer.fill(1))

    def busy(self, microseconds: float) -> None:
        cycles = self._np.int64(int(microseconds * self._cycles_per_us))
        self._on_stream(lambda: self._spin((1,), (1,), (cycles,)))

    def event(self) -> object:
        event = self._make_event()
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return float(self._elapsed(start, end))


def cupy_timer() -> BusyStartTimer:
    """Busy-start timing on CuPy's current stream (cuflash and the CuPy peer launch there)."""
    cupy = cupy_or_refuse()
    return BusyStartTimer(CudaStream(cupy, cupy.cuda.Event, cupy.cuda.get_elapsed_time))


def torch_timer() -> BusyStartTimer:
    """Busy-start timing on PyTorch's current stream: its events, the flush and spin queued there through CuPy."""
    import torch

    cupy = cupy_or_refuse()
    return BusyStartTimer(CudaStream(cupy, lambda: torch.cuda.Event(enable_timing=True),
                                     lambda s, e: s.elapsed_time(e),
                                     stream_ptr=lambda: torch.cuda.current_stream().cuda_stream))


def jax_timer(device) -> BackToBackTimer:
    """Back-to-back timing of jitted calls on ``device``; the L2 overwrite is a jitted program on JAX's streams."""
    import jax
    import jax.numpy as jnp

    words = l2_flush_bytes(cupy_or_refuse()) // 4
    state = {"buffer": jax.device_put(jnp.zeros((words,), jnp.int32), device)}
    overwrite = jax.jit(lambda b: b + 1, donate_argnums=0)

    def flush():
        state["buffer"] = overwrite(state["buffer"])
        return state["buffer"]

    return BackToBackTimer(flush, jax.block_until_ready)


def describe(repeats: int, warmup: int, flush_bytes: int) -> str:
    """The timing line of a sweep's table and JSON."""
    return (f"device ms: median of {repeats} after {warmup} warm-up, L2 overwritten ({flush_bytes >> 20} MiB) before "
            f"each run; CUDA events behind a spin (busy start), JAX wall-clock over back-to-back calls; "
            f"host us: perf_counter around each call")
