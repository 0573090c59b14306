"""CuPy arrays on a CUDA GPU.

Deliberately thin: the launch plan, parameter packing and scratch layout are the
shared ones (cuflash.backends.program); this file only allocates with CuPy,
loads the cubin NVRTC produced for the device's architecture (byte for byte the
one the compile report describes) and launches it on the current stream.
Covered by tests marked ``gpu``.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from ..kernels.program import KernelInstance
from ..kernels import targets
from ..kernels.program import LaunchPlan


class CupyBackend:
    name = "cupy"

    def __init__(self, device_id: int):
        import cupy

        self._cupy = cupy
        self.device_id = device_id
        device = cupy.cuda.Device(device_id)
        # compute_capability is a string such as "80" or "90"; plans respect the device's opt-in limit.
        capability = device.compute_capability
        self.target = targets.for_device(
            int(capability[:-1]), int(capability[-1]), device.attributes.get("MaxSharedMemoryPerBlockOptin"),
            device.attributes.get("MultiProcessorCount"),
        )
        self.arch = "sm_" + capability

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
        kernel = function(plan.kernel, plan.dynamic_smem_bytes, self.arch, self.device_id)
        threads = int(np.prod(plan.block))
        if threads > kernel.max_threads_per_block:  # the simulator refuses the same launch
            raise RuntimeError(f"launch plan gives {plan.kernel.name_expr} a block of {threads} threads, more than "
                               f"its __launch_bounds__ maximum of {kernel.max_threads_per_block}")
        kernel(plan.grid, plan.block, (params,), shared_mem=plan.dynamic_smem_bytes)


@functools.lru_cache(maxsize=None)
def function(kernel: KernelInstance, dynamic_smem_bytes: int, arch: str, device_id: int):
    """The loaded kernel on a device (current when called); resolved once per process,
    since checking the compile cache reads and hashes the kernel's sources."""
    from ..kernels import nvrtc

    compiled = nvrtc.compile_instance(kernel, arch)
    return nvrtc.load_function(compiled, dynamic_smem_bytes=dynamic_smem_bytes)
