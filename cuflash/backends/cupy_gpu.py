"""CuPy arrays on a CUDA GPU.

Deliberately thin: the launch plan, parameter packing and scratch layout are the
shared ones (cuflash.backends.program); this file only allocates with CuPy,
loads the code NVRTC produced for the device (kernels.toolchain's choice: the
CUBIN for its arch, byte for byte the one the compile report describes, or PTX
for a GPU newer than NVRTC) and launches it on the current stream.
Covered by tests marked ``gpu``.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..kernels import targets, toolchain
from ..kernels.program import KernelInstance, LaunchPlan


class CupyBackend:
    name = "cupy"
    synchronous = False  # launches are queued on the current stream
    tensor_maps_by_driver = True  # TMA tensor maps: cuTensorMapEncodeTiled

    def __init__(self, device_id: int):
        import cupy

        self._cupy = cupy
        self.xp = cupy  # the array module of the backend's arrays
        self.device_id = device_id
        device = cupy.cuda.Device(device_id)
        # Plans respect the device's opt-in shared memory limit and plan splits for its SMs.
        major, minor = toolchain.capability_of_cupy(device.compute_capability)
        self.target = targets.for_device(
            major, minor, device.attributes.get("MaxSharedMemoryPerBlockOptin"),
            device.attributes.get("MultiProcessorCount"),
        )
        # Before any kernel is compiled: a ToolchainError names the driver, the arch and what to install.
        self.code = toolchain.code_for_device(major, minor)

    def device(self):
        """Allocate and launch on the inputs' GPU, not whichever device is current."""
        return self._cupy.cuda.Device(self.device_id)

    def empty_scratch(self, shape: tuple[int, ...]):
        return self._cupy.empty(shape, dtype=np.float32)

    def zeros(self, shape: tuple[int, ...]):
        return self._cupy.zeros(shape, dtype=np.float32)

    def empty(self, shape: tuple[int, ...], dtype):
        return self._cupy.empty(shape, dtype=dtype)

    def upload(self, host: np.ndarray):
        return self._cupy.asarray(host)

    def address(self, array) -> int:
        return int(array.data.ptr)

    def launch(self, plan: LaunchPlan, params: np.void, buffers: Sequence) -> None:
        kernel = function(plan.kernel, plan.dynamic_smem_bytes, self.code.compile_arch, self.device_id)
        threads = int(np.prod(plan.block))
        if threads > kernel.max_threads_per_block:  # the simulator refuses the same launch
            raise RuntimeError(f"launch plan gives {plan.kernel.name_expr} a block of {threads} threads, more than "
                               f"its __launch_bounds__ maximum of {kernel.max_threads_per_block}")
        kernel(plan.grid, plan.block, (by_value(params),), shared_mem=plan.dynamic_smem_bytes)


def by_value(params: np.void) -> np.ndarray:
    """AttentionParams as the one kernel argument CuPy passes by value, its itemsize bytes (1280) whole: a 0-d
    structured NumPy array. Every CuPy >= 9 takes a one-element NumPy array by value (CNumpyArray). A numpy.void
    would go through CuPy's scalar path instead, which CuPy 14.0.x caps below 64 bytes (an AssertionError at every
    launch, and a buffer overrun under python -O); the scalar path takes large structs only from 14.1. The bytes
    are copied whole: np.array(params) copies field by field and leaves the struct's padding uninitialized (a
    test comparing the passed bytes with the packed ones caught garbage there)."""
    return np.ndarray((), dtype=params.dtype, buffer=bytearray(params.tobytes()))


def launch_stream_argument(device_id: int) -> int:
    """The stream cuflash launches on for ``device_id`` (CuPy's current stream there, which RawKernel calls use),
    as DLPack's ``__dlpack__(stream=...)`` spells it: the handle, or 1 for the legacy default stream (handle 0)."""
    import cupy

    with cupy.cuda.Device(device_id):
        handle = int(cupy.cuda.get_current_stream().ptr)
    return handle if handle else 1


class OnStream:
    """An array that another library exports through DLPack, exported for a given consumer stream whatever stream
    the importer names: cuflash says which stream will read it (the producer then orders its pending writes
    before that stream's work), and remembers whether the capsule said read-only (CuPy ignores the flag)."""

    def __init__(self, array: Any, stream: int):
        self._array = array
        self._stream = stream
        self.read_only = False

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def __dlpack__(self, *, stream: Any = None, **options: Any):
        from .._dlpack import dlpack_capsule_read_only

        capsule = self._array.__dlpack__(stream=self._stream, **options)
        self.read_only = dlpack_capsule_read_only(capsule)
        return capsule


def import_dlpack(array: Any, device_id: int) -> tuple[Any, bool]:
    """A CuPy view of another library's CUDA array (no copy), exported for cuflash's launch stream, and whether the
    producer marked it read-only."""
    import cupy

    from .._dtypes import BF16_PACKAGE_HINT, bfloat16_available

    exported = OnStream(array, launch_stream_argument(device_id))
    with cupy.cuda.Device(device_id):
        try:
            return cupy.from_dlpack(exported), exported.read_only
        except Exception as error:
            if "bfloat16" in str(getattr(array, "dtype", "")) and not bfloat16_available():
                raise ImportError(BF16_PACKAGE_HINT) from error
            raise


class InFlight:
    """Objects held until the work queued before an event is done: views of another library's memory that
    kernels read, so the producer cannot free and recycle it under them. Completed entries are dropped whenever a
    new one is added (events are polled, never waited for)."""

    def __init__(self):
        self._entries: list[tuple[Any, tuple]] = []
        self._lock = threading.Lock()

    def hold(self, event: Any, objects: tuple) -> None:
        with self._lock:
            self._entries = [(e, o) for e, o in self._entries if not e.done]
            self._entries.append((event, objects))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


_in_flight = InFlight()


def hold_until_done(device_id: int, objects: tuple) -> None:
    """Hold ``objects`` until everything queued so far on the launch stream of ``device_id`` is done."""
    import cupy

    with cupy.cuda.Device(device_id):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(cupy.cuda.get_current_stream())
    _in_flight.hold(event, objects)


@functools.lru_cache(maxsize=None)
def function(kernel: KernelInstance, dynamic_smem_bytes: int, arch: str, device_id: int):
    """The loaded kernel on a device (current when called), compiled for what the catalog says the kernel takes where
    the device gets ``arch`` code (sm_XX or compute_XX; sm_90a for the Hopper kernels); resolved once per process,
    since checking the compile cache reads and hashes the kernel's sources."""
    from ..kernels import catalog, nvrtc

    compiled = nvrtc.compile_instance(kernel, catalog.compile_arch(kernel, arch))
    return load_function(compiled, dynamic_smem_bytes=dynamic_smem_bytes)


_loaded: dict[tuple[str, str, int], object] = {}
_loaded_lock = threading.Lock()


def load_function(compiled, dynamic_smem_bytes: int | None = None):
    """The cupy RawKernel for a ``nvrtc.CompiledKernel`` on the current device (cached per device).

    Loads the cached CUBIN (or PTX) file itself (RawModule(path=...), cuModuleLoad),
    so the GPU runs the bytes CI compiled. ``dynamic_smem_bytes`` defaults to the
    launch plan's value; the function's max dynamic shared memory attribute is
    raised to it when below (48 KB unless raised), which CUDA requires before launch.
    """
    import cupy

    if dynamic_smem_bytes is None:
        from ..kernels import catalog

        dynamic_smem_bytes = catalog.dynamic_smem_bytes(compiled.instance)
    device = cupy.cuda.Device().id
    key = (compiled.code_path, compiled.lowered_name, device)
    with _loaded_lock:
        function = _loaded.get(key)
        if function is None:
            if Path(compiled.code_path).read_bytes() != compiled.code:
                raise RuntimeError(f"{compiled.code_path} no longer holds the compiled bytes of {compiled.instance}")
            module = cupy.RawModule(path=compiled.code_path)
            function = module.get_function(compiled.lowered_name)
            _loaded[key] = function
        if function.max_dynamic_shared_size_bytes < dynamic_smem_bytes:
            function.max_dynamic_shared_size_bytes = dynamic_smem_bytes
    return function
