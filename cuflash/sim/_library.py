"""Loading simulator libraries with cffi (ABI mode: no C compiler needed to bind).

cffi releases the GIL around every call, so a long launch does not block other
Python threads, and several launches may run at once (the runtime keeps no
global state besides its fiber-stack arena, which is locked).
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path
from typing import Sequence

import cffi

from ..kernels.program import KernelInstance
from . import _build

_ABI_HEADER = _build.SIM_DIR / "sim_abi.h"


def _cdef_text() -> str:
    text = _ABI_HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


ffi = cffi.FFI()
ffi.cdef(_cdef_text())

_lock = threading.Lock()
_loaded: dict[Path, object] = {}  # library path -> cffi lib
_by_instance: dict[tuple[str, KernelInstance, str], object] = {}  # (mode, instance, library key) -> lib


def asan_runtime_loaded() -> bool:
    """True when libasan is in the process (preloaded): required to load asan-mode libraries."""
    try:
        ctypes.CDLL(None).__asan_init  # noqa: B018 - attribute lookup is the probe
    except AttributeError:
        return False
    return True


def _dlopen(path: Path):
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            lib = ffi.dlopen(str(path))
            _loaded[path] = lib
        return lib


def _check_mode(mode: str) -> None:
    if mode == "asan" and not asan_runtime_loaded():
        raise RuntimeError(
            "cuflash.sim asan mode needs AddressSanitizer's runtime loaded before Python starts "
            "(LD_PRELOAD=$(g++ -print-file-name=libasan.so)); use cuflash.sim.run_in_asan_subprocess(...)"
        )


def library_for(mode: str, inst: KernelInstance):
    """The loaded library that can launch `inst` in `mode`, building it at first use."""
    key = _build.library_key(mode, [inst])
    cached = _by_instance.get((mode, inst, key))
    if cached is not None:
        return cached
    _check_mode(mode)
    path = _build.find_library(mode, inst) or _build.build_library(mode, [inst])
    lib = _dlopen(path)
    with _lock:
        _by_instance[(mode, inst, key)] = lib
    return lib


def precompile(mode: str, instances: Sequence[KernelInstance]) -> Path | None:
    """Build one library for all `instances` and point each instance's cache alias at it."""
    instances = list(dict.fromkeys(instances))
    missing = [inst for inst in instances if _build.find_library(mode, inst) is None]
    if not missing:
        return None
    path = _build.build_library(mode, missing)
    for inst in missing:
        _build.write_alias(mode, inst, path)
    return path


def probe_library(mode: str = "normal"):
    """A library with no kernels (for the layout probe and mode queries)."""
    _check_mode(mode)
    return _dlopen(_build.build_library(mode, []))
