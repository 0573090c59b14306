"""Where a call's arrays live and how results go back: NumPy (the simulator), CuPy (its GPU), or another library's
arrays through DLPack, imported without a copy and handed back in the caller's type.

DLPack rules kept here (the GPU-only halves live in backends/cupy_gpu.py):
- a CUDA array is imported with the stream cuflash will launch on (``__dlpack__(stream=...)``), so the producer
  orders its pending writes before that stream's work;
- the imported views are held until the work queued on that stream when the call returns has finished
  (``Placement.results``), so a producer freeing its array right after the call cannot recycle memory the
  kernels still read;
- whether an array arrived read-only (DLPack's READ_ONLY flag, NumPy's writeable flag) is recorded, so arrays a
  call would write in place (KV caches) are refused by name before anything is written.

The integer inputs (HOST_READ_INPUTS) are read on the host by every entry point, which uploads what its kernels
need: beside CUDA tensors they may be host arrays (NumPy, or a CPU array through DLPack), which a call then reads
without a device-to-host copy (each such copy waits for the device: a decode loop that keeps its lengths and block
table on the host, as servers do, runs ahead of the GPU).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ._dlpack import immutable_array_type
from .backends.simulator import SimulatorBackend

# Integer inputs read on the host (host_copy) and uploaded by the entry points, never handed to a kernel as given.
HOST_READ_INPUTS = frozenset({"cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "block_table",
                              "cache_seqlens", "cache_batch_idx", "cache_leftpad"})
_DL_CPU = 1
_DL_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


class Placement:
    """Which backend runs the call, and how to hand results back in the caller's array type."""

    def __init__(self, names: tuple[str, ...], arrays: tuple[Any, ...]):
        if set(map(type, arrays)) == _NUMPY_ONLY:
            # Every array a NumPy array (the simulator's case): what the general path below concludes for them,
            # without its per-array dispatch.
            self.names = names
            self.types = None  # every array an np.ndarray: signature() names no type per array
            self.foreign_type = None
            self.read_only = None  # NumPy's writeable flags, read where asked (check_writable)
            self.arrays = tuple(arrays)
            self._foreign_cuda = ()
            self.on_gpu = False
            return
        self.names = names
        kinds = []
        for name, array in zip(names, arrays):
            kinds.append((name, _array_kind(name, array)))
        # NumPy integer inputs are read on the host wherever the tensors are (HOST_READ_INPUTS): they place nothing.
        native = {kind for name, kind in kinds if kind == "cupy" or (kind == "numpy" and name not in HOST_READ_INPUTS)}
        if len(native) > 1:
            first = {kind: name for name, kind in reversed(kinds) if not (kind == "numpy" and name in HOST_READ_INPUTS)}
            raise TypeError(
                f"{first['numpy']} is a NumPy array but {first['cupy']} is a CuPy array: "
                "pass all arrays as NumPy (CPU simulator) or all as CuPy (GPU; integer inputs such as cu_seqlens, "
                "cache_seqlens and block_table may also be NumPy arrays, read on the host without waiting for the "
                "device)"
            )
        self.foreign_type = next((type(a) for (_, kind), a in zip(kinds, arrays) if kind == "dlpack"), None)
        self.read_only: dict[str, bool] | None = {}
        imported = [self._import(name, a, kind) for (name, kind), a in zip(kinds, arrays)]
        self.arrays = tuple(imported)
        self.types = tuple(map(type, self.arrays))
        # Views of another library's CUDA memory: held until the kernels reading them are done (results()).
        self._foreign_cuda = tuple(a for (_, kind), a in zip(kinds, imported) if kind == "dlpack" and _is_cupy(a))
        on_gpu = {_is_cupy(a) for a in self.arrays}
        if on_gpu == {True, False}:  # host integer inputs (HOST_READ_INPUTS) beside CUDA tensors are read there
            on_gpu = {_is_cupy(a) for name, a in zip(names, self.arrays) if _is_cupy(a) or name not in HOST_READ_INPUTS}
        if len(on_gpu) > 1:
            raise TypeError("all arrays must be on the same device: some are on the CPU and some on a CUDA GPU")
        self.on_gpu = on_gpu.pop()
        if self.on_gpu:
            devices = {name: a.device.id for name, a in zip(names, self.arrays) if _is_cupy(a)}
            if len(set(devices.values())) > 1:
                raise ValueError(f"all arrays must be on the same GPU, got devices {devices}")
            self.device_id = next(iter(devices.values()))

    def _import(self, name: str, array: Any, kind: str) -> Any:
        if kind == "numpy":
            self.read_only[name] = not array.flags.writeable
            return array
        if kind != "dlpack":
            return array
        device_type, device_id = array.__dlpack_device__()
        if device_type == _DL_CPU:
            imported = np.from_dlpack(array)  # NumPy honours the READ_ONLY flag: such an import is not writeable
            self.read_only[name] = not imported.flags.writeable
            return imported
        if device_type in _DL_CUDA:
            from .backends import cupy_gpu

            imported, flagged = cupy_gpu.import_dlpack(array, device_id)
            self.read_only[name] = flagged or immutable_array_type(array)
            return imported
        raise TypeError(f"{name} is on a DLPack device of type {device_type}; only CPU and CUDA are supported")

    def check_writable(self, names: tuple[str, ...], written_by: str, instead: str) -> None:
        """Refuse, naming the argument, an array that arrived read-only among ``names`` (what ``written_by``
        writes in place); ``instead`` says what to call instead. Called before anything is written."""
        read_only = self.read_only
        for name in names:
            if read_only is not None:
                refused = read_only.get(name, False)
            else:  # NumPy arrays only: their flags, read for the names asked
                refused = name in self.names and not self.arrays[self.names.index(name)].flags.writeable
            if refused:
                raise ValueError(f"{name} is read-only ({written_by} writes it in place); pass a writable array, "
                                 f"or {instead}")

    def unexported(self) -> "Placement":
        """This placement handing results back as the placed arrays, unexported and unheld: for a call made inside
        another, whose own results() exports and holds. Same signature."""
        inner = Placement.__new__(Placement)
        inner.__dict__ = {**self.__dict__, "foreign_type": None, "_foreign_cuda": ()}  # (copy.copy: 4x the time)
        return inner

    def backend(self):
        return _cupy_backend(self.device_id) if self.on_gpu else _SIMULATOR

    def signature(self) -> tuple:
        """What a prepared call (api.py) may depend on besides the option values: each placed array's type, shape,
        strides and dtype, and where the call runs (its GPU, or the target the simulator stands in for at this
        moment, cuflash.sim.targeting). Never data or addresses: those change between calls of equal signatures."""
        # The types once per call (None: all np.ndarray, the simulator's case), then (shape, strides, dtype) per
        # array, each read by one C call (_LAYOUT).
        layouts = tuple(map(_LAYOUT, self.arrays))
        # The simulator's target by its arch name: each is the table's Target of its arch (targets.target), and a
        # name hashes in C where a Target (a dataclass) hashes in Python, on every lookup of every call.
        return self.names, self.types, layouts, (self.device_id if self.on_gpu else _SIMULATOR.target_arch)

    def results(self, *results: Any) -> tuple[Any, ...]:
        """The call's results in the caller's array type, once every kernel of the call is queued: imported CUDA
        inputs are held until the work queued so far on the launch stream is done."""
        if self._foreign_cuda:
            from .backends import cupy_gpu

            cupy_gpu.hold_until_done(self.device_id, self._foreign_cuda)
        if self.foreign_type is None:
            return results
        return tuple([self.export(r) for r in results])

    def export(self, result: Any) -> Any:
        """Hand a result back in the array type the caller passed (zero-copy through DLPack)."""
        if self.foreign_type is None:
            return result
        module = self.foreign_type.__module__.split(".")[0]
        if module == "torch":
            import torch

            return torch.from_dlpack(result)
        if module in ("jax", "jaxlib"):
            import jax.numpy as jnp

            return jnp.from_dlpack(result)
        return result


_NUMPY_ONLY = {np.ndarray}
_LAYOUT = operator.attrgetter("shape", "strides", "dtype")  # what signature() reads of each array
_SIMULATOR = SimulatorBackend()  # stateless: one serves every call
_cupy_backends: dict[int, Any] = {}


def _cupy_backend(device_id: int) -> Any:
    """The CuPy backend of a device, made once per device (making one reads the device's attributes and matches
    the toolchain, which is the same for every call)."""
    backend = _cupy_backends.get(device_id)
    if backend is None:
        from .backends.cupy_gpu import CupyBackend

        backend = _cupy_backends.setdefault(device_id, CupyBackend(device_id))
    return backend


def _array_kind(name: str, array: Any) -> str:
    if isinstance(array, np.ndarray):
        return "numpy"
    if _is_cupy(array):
        return "cupy"
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(f"{name} must be a NumPy or CuPy array or support DLPack, got {type(array).__name__}")


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.split(".")[0] == "cupy"


def ascontiguous(array: Any) -> Any:
    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array)
    import cupy

    return cupy.ascontiguousarray(array)


def place(names: tuple[str, ...], arrays: tuple[Any, ...], alibi_slopes: Any = None,
          sinks: Any = None) -> tuple[Placement, dict[str, Any]]:
    """The placement of the arrays and of the per-head float32 inputs given (alibi_slopes, sinks), and those placed
    and made C-contiguous (kernels index them densely), by name: the kernels' side inputs of those names."""
    per_head = {}
    if alibi_slopes is not None:
        per_head["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        per_head["sinks"] = sinks
    if not per_head:
        return Placement(names, arrays), per_head
    placement = Placement(names + tuple(per_head), arrays + tuple(per_head.values()))
    placed = placement.arrays[len(names):]
    return placement, {name: x if x.flags.c_contiguous else ascontiguous(x) for name, x in zip(per_head, placed)}


def host_copy(array: Any) -> np.ndarray:
    """A NumPy copy of a placed array (CuPy: copied from the device, which waits for it)."""
    return np.array(array if type(array) is np.ndarray or not _is_cupy(array) else array.get())
