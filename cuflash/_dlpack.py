"""Facts read off DLPack exports, for the placement of a call's arrays (cuflash/_placement.py) and the CuPy
backend's import (backends/cupy_gpu.py)."""

from __future__ import annotations

import ctypes
from typing import Any

# DLPack 1.x: DLManagedTensorVersioned = {DLPackVersion (2 x uint32), manager_ctx, deleter, uint64 flags, ...}.
_VERSIONED_CAPSULE = b"dltensor_versioned"
_FLAGS_OFFSET = 8 + 2 * ctypes.sizeof(ctypes.c_void_p)
_FLAG_READ_ONLY = 1 << 0


def dlpack_capsule_read_only(capsule: Any) -> bool:
    """Whether a DLPack capsule carries the READ_ONLY flag (only versioned capsules, DLPack >= 1.0, have flags;
    an unversioned one says nothing and counts as writable, as DLPack 0.x had no way to say otherwise)."""
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    if get_name(capsule) != _VERSIONED_CAPSULE:
        return False
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = get_pointer(capsule, _VERSIONED_CAPSULE)
    return bool(ctypes.c_uint64.from_address(managed + _FLAGS_OFFSET).value & _FLAG_READ_ONLY)


def immutable_array_type(array: Any) -> bool:
    """Arrays of libraries whose arrays are immutable, whatever their DLPack capsule says: JAX exports unversioned
    capsules, which carry no READ_ONLY flag (on the CPU NumPy marks them read-only anyway; CuPy would not)."""
    return type(array).__module__.split(".")[0] in ("jax", "jaxlib")
