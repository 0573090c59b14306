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
from typing import Sequence

import numpy as np

from ..kernels import targets, toolchain
from ..kernels.program import KernelInstance, LaunchPlan


class CupyBackend:
    name = "cupy"

    def __init__(self, device_id: int):
        import cupy

        self._cupy = cupy
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
        kernel(plan.grid, plan.block, (params,), shared_mem=plan.dynamic_smem_bytes)


@functools.lru_cache(maxsize=None)
def function(kernel: KernelInstance, dynamic_smem_bytes: int, arch: str, device_id: int):
    """The loaded kernel on a device (current when called), compiled for ``arch`` (sm_XX or compute_XX); resolved
    once per process, since checking the compile cache reads and hashes the kernel's sources."""
    from ..kernels import nvrtc

    compiled = nvrtc.compile_instance(kernel, arch)
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
