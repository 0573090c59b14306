"""How a call is timed: warm-up, L2 flushed before every timed run, CUDA events, median of N.

Everything here but the CUDA-event timers is plain Python and is tested with a
fake timer (tests/test_benchmarks_speed.py). The GPU parts are small:

* ``CudaEventTimer`` records a start and an end event on the stream the timed
  system launches on (CuPy's or PyTorch's current stream) and returns the
  elapsed milliseconds between them once the end event has completed.
* ``L2Flush`` overwrites a buffer twice the size of the GPU's L2 cache and
  waits for the device, so every timed run starts with a cold L2 and an idle
  device: inputs are never served from the cache a previous run warmed, and
  no earlier work overlaps the timed window.

JAX dispatches to its own streams, which events on another stream cannot
bracket; its systems therefore block until their results are ready inside the
timed call, and the events measure from the start of dispatch to the end of
the last kernel (dispatch costs some tens of microseconds, small against the
milliseconds the sweep's problems take).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Protocol


class NoGpuError(RuntimeError):
    """Raised when no CUDA device is visible: GPU speed cannot be measured here."""


class Timer(Protocol):
    """Brackets one call: ``start()`` before it, ``stop()`` after it returns the elapsed milliseconds."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


@dataclass(frozen=True)
class Sample:
    """The timed runs of one call, in milliseconds, in the order they ran."""

    milliseconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.milliseconds))


def measure(fn: Callable[[], object], timer: Timer, *, warmup: int = 3, repeats: int = 10,
            flush: Callable[[], None] | None = None) -> Sample:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed, flushing before each timed run."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        timer.start()
        fn()
        times.append(float(timer.stop()))
    return Sample(tuple(times))


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


class CudaEventTimer:
    """Start and end CUDA events from ``make_event`` (CuPy's or PyTorch's), recorded on its current stream."""

    def __init__(self, make_event: Callable[[], object], elapsed_ms: Callable[[object, object], float]):
        self._make_event = make_event
        self._elapsed_ms = elapsed_ms
        self._start = self._end = None

    def start(self) -> None:
        self._start, self._end = self._make_event(), self._make_event()
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return float(self._elapsed_ms(self._start, self._end))

    @classmethod
    def cupy(cls) -> CudaEventTimer:
        cupy = cupy_or_refuse()
        return cls(cupy.cuda.Event, cupy.cuda.get_elapsed_time)

    @classmethod
    def torch(cls) -> CudaEventTimer:
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True), lambda s, e: s.elapsed_time(e))


class L2Flush:
    """Overwrites twice the L2 cache's bytes on the current device, then waits for the whole device."""

    def __init__(self):
        cupy = cupy_or_refuse()
        device = cupy.cuda.Device()
        l2_bytes = int(device.attributes.get("L2CacheSize", 0)) or 64 << 20
        self.bytes = 2 * l2_bytes
        self._buffer = cupy.empty(self.bytes, dtype=cupy.uint8)
        self._cupy = cupy

    def __call__(self) -> None:
        self._buffer.fill(1)
        self._cupy.cuda.runtime.deviceSynchronize()
