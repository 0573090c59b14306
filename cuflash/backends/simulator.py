"""NumPy arrays on the CPU simulator: the backend every test in CI runs."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Sequence

import _cffi_backend
import numpy as np

from ..kernels.program import LaunchPlan
from ..kernels.targets import Target

# Outputs and the scratch the program does not zero start as all-ones bytes, NaN in every element type (float32,
# float16, bfloat16), the way the simulator fills shared memory: an element a kernel forgets to write, or reads
# before writing, shows. A byte fill is a memset, cheaper than filling float32 NaNs (a split-KV decode's out_accum).
_UNWRITTEN_BYTE = 0xFF
_UNWRITTEN = bytearray([_UNWRITTEN_BYTE])
_ALIGNMENT = 64
# cffi's C-level FFI (what compiled cffi modules use): its cast and from_buffer are C calls, the cffi.FFI wrapper's
# are Python functions.
_ffi = _cffi_backend.FFI()
_from_buffer = _ffi.from_buffer
# An address as a Python int: a buffer's char pointer less the null pointer. cffi subtracts two pointers in C and
# returns an int, at half the cost of casting to uintptr_t and converting the cast with int() (a decode call reads
# about ten addresses). from_buffer gives a char[], which "+ 0" makes the char * the subtraction takes.
_NULL = _ffi.cast("char *", 0)


_NO_DEVICE = contextlib.nullcontext()  # reusable: it holds no state
_current_target = _current_arch = None  # cuflash.sim.current_target and current_arch, once imported


class SimulatorBackend:
    name = "simulator"
    xp = np  # the array module of the backend's arrays
    synchronous = True  # a launch returns once its kernels have run
    tensor_maps_by_driver = False  # TMA tensor maps: the simulator twin's encoding (cuflash.kernels.tensor_map)

    @property
    def target(self) -> Target:
        """The GPU the simulator stands in for (cuflash.sim.targeting): plans are made for it (read on every call:
        it is part of each call's signature)."""
        global _current_target
        if _current_target is None:
            from ..sim import current_target  # cuflash.sim imports this module's package: bound on first use

            _current_target = current_target
        return _current_target()

    @property
    def target_arch(self) -> str:
        """The arch name of ``target``, not resolved (each name is one Target): what a call's signature names."""
        global _current_arch
        if _current_arch is None:
            from ..sim import current_arch  # as in target

            _current_arch = current_arch
        return _current_arch()

    def device(self) -> contextlib.AbstractContextManager:
        """The simulator has no device to select."""
        return _NO_DEVICE

    def empty_scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.empty(shape, np.float32)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def renewal(self, buffer: np.ndarray, zero: bool) -> Callable[[], None]:
        # A reused buffer is as unwritten as a new one (empty's bytes): a kernel reading what this launch did not
        # write still sees NaN, not the previous launch's values. A partial of the bytes' fill: one C call per
        # renewal, no Python frame and no byte view made per call.
        return functools.partial(buffer.view(np.uint8).fill, 0 if zero else _UNWRITTEN_BYTE)

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        # Unwritten (NaN) and 64-byte aligned, so JAX takes results through DLPack without a copy. The bytes are one
        # unwritten byte repeated: a bytearray allocated and filled (a memset) in one C call, about half the cost of
        # np.empty and a fill (a decode call's out is a few KB, where the calls' overhead is the cost).
        dtype = np.dtype(dtype)
        raw = _UNWRITTEN * (math.prod(shape) * dtype.itemsize + _ALIGNMENT)
        start = -((_from_buffer(raw) + 0) - _NULL) % _ALIGNMENT  # address(raw), one call less
        return np.ndarray(shape, dtype, raw, start)

    def upload(self, host: np.ndarray) -> np.ndarray:
        return host  # already on the simulator's device, and the API's own (ArrayBackend.upload)

    def address(self, array: np.ndarray) -> int:
        # The buffer protocol gives the address in C, at a fifth of the cost of NumPy's __array_interface__ dict (a
        # decode call reads ten addresses). NumPy exports a simple buffer of C-contiguous arrays only and refuses
        # the others with ValueError (asked first, their flags cost as much as the export's own test).
        try:
            return (_from_buffer(array) + 0) - _NULL
        except ValueError:
            return array.__array_interface__["data"][0]

    def launch(self, plan: LaunchPlan, params: np.void, buffers: Sequence[np.ndarray]) -> None:
        from .. import sim

        sim.launch(plan.kernel, plan.grid, plan.block, plan.dynamic_smem_bytes, params, buffers)
