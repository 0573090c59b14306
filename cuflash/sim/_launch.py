"""launch / record / checking: the Python face of the simulator."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..kernels import targets
from ..kernels.program import KernelInstance
from ..kernels.targets import Target
from . import _build, _library

__all__ = [
    "KernelError",
    "LaunchRecord",
    "Recorder",
    "SharedAccessSite",
    "launch",
    "record",
    "checking",
    "copy_landing",
    "current_mode",
    "on_mode_change",
    "current_target",
    "current_arch",
    "targeting",
    "precompile",
    "params_layout",
    "launch_entry_address",
]


class KernelError(RuntimeError):
    """A kernel failed in the simulator (or its launch was invalid).

    ``kernel`` is the name expression of the instance; ``message`` is the
    simulator's report, which names the kernel, the block and the thread.
    """

    def __init__(self, kernel: str, message: str):
        super().__init__(message)
        self.kernel = kernel
        self.message = message

    def __reduce__(self):
        return (type(self), (self.kernel, self.message))


@dataclass(frozen=True)
class SharedAccessSite:
    """Bank-conflict counts of one shared-memory access site (profile mode), in the units of
    Nsight Compute's shared-memory wavefronts (see cuda_src/arch/sim/sim_profile.cpp)."""

    site: str  # "file:line" of the access (the innermost inlined location)
    # "load", "store", "ldmatrix", "cp.async", "tma.load" or "tma.store" (a TMA copy's shared side), "wgmma.read"
    # (a wgmma's shared operand)
    kind: str
    bytes: int  # per lane
    instructions: int  # warp-level instructions executed
    wavefronts: int
    ideal: int  # wavefronts had no bank been shared by two words

    @property
    def excess(self) -> int:
        return self.wavefronts - self.ideal


@dataclass(frozen=True)
class LaunchRecord:
    kernel: str
    grid: tuple
    block: tuple
    dynamic_smem_bytes: int
    global_bytes_read: int
    global_bytes_written: int
    shared_access_sites: tuple[SharedAccessSite, ...] = ()  # profile mode only


@dataclass
class Recorder:
    launches: list[LaunchRecord] = field(default_factory=list)


_recorders_lock = threading.Lock()
_recorders: list[Recorder] = []


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Collect the LaunchRecord of every launch (from any thread) made inside the block."""
    rec = Recorder()
    with _recorders_lock:
        _recorders.append(rec)
    try:
        yield rec
    finally:
        with _recorders_lock:
            _recorders.remove(rec)


# ---- checking modes ----------------------------------------------------------------------

_mode_lock = threading.Lock()
_mode_stack: list[str] = []


def _default_mode() -> str:
    mode = os.environ.get("CUFLASH_SIM_MODE", "normal") or "normal"
    if mode not in _build.MODES:
        raise ValueError(f"CUFLASH_SIM_MODE={mode!r}; expected one of {_build.MODES}")
    return mode


def current_mode() -> str:
    with _mode_lock:
        return _mode_stack[-1] if _mode_stack else _default_mode()


@contextlib.contextmanager
def checking(mode: str) -> Iterator[str]:
    """Run launches inside the block in a checking mode ("normal", "race", "asan", "profile").

    "profile" counts shared-memory bank conflicts per access site into each launch record's
    ``shared_access_sites`` (no race checks). Process-wide (not per thread), so launches made from helper threads (JAX
    callbacks) are checked too. "asan" needs the ASan runtime preloaded; from a
    normal interpreter use run_in_asan_subprocess().
    """
    if mode not in _build.MODES:
        raise ValueError(f"unknown simulator mode {mode!r}; expected one of {_build.MODES}")
    with _mode_lock:
        _mode_stack.append(mode)
    _notify_mode_change()
    try:
        yield mode
    finally:
        with _mode_lock:
            # Remove this entry (the last one equal to mode), tolerant of interleaved threads.
            for i in range(len(_mode_stack) - 1, -1, -1):
                if _mode_stack[i] == mode:
                    del _mode_stack[i]
                    break
        _notify_mode_change()


_mode_listeners: list = []


def on_mode_change(listener) -> None:
    """Call ``listener()`` whenever checking() enters or leaves a mode: cuflash.jax forgets the kernels its FFI
    handler registered in the previous mode, so already-compiled executables run in the new one (their kernels
    are registered again, in the current mode, on their next execution)."""
    if listener not in _mode_listeners:
        _mode_listeners.append(listener)


def _notify_mode_change() -> None:
    for listener in list(_mode_listeners):
        listener()


# ---- when cp.async copies land -----------------------------------------------------------

_copy_seeds: list[int] = []


@contextlib.contextmanager
def copy_landing(seed: int) -> Iterator[int]:
    """Launches inside the block land their cp.async copies at moments drawn from ``seed``.

    A copy may land anywhere between its issue and the issuing thread's covering wait; the
    simulator picks the moment (at issue, or at one of the block's later fiber switches) from
    a seeded stream, 0 by default. A kernel whose results differ between seeds reads a copy's
    destination before the wait and barrier that publish it. Race mode ignores the seed: it
    reports any such access instead. Process-wide, like ``checking``.
    """
    if not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"copy_landing seed must be an int in [0, 2**64), got {seed!r}")
    with _mode_lock:
        _copy_seeds.append(int(seed))
    try:
        yield int(seed)
    finally:
        with _mode_lock:
            del _copy_seeds[len(_copy_seeds) - 1 - _copy_seeds[::-1].index(int(seed))]


def _copy_seed() -> int:
    with _mode_lock:
        return _copy_seeds[-1] if _copy_seeds else 0


# ---- the GPU the simulator stands in for -------------------------------------------------------

_target_stack: list[Target] = []
_TARGET_VARIABLE = "CUFLASH_SIM_TARGET"
# The store behind os.environ (os._Environ's mapping of encoded names to encoded values), which every change made
# through os.environ updates (monkeypatch.setenv included): os.environ.get raises and catches KeyError twice for an
# unset name, about a microsecond of every simulator call (its signature names the target). Read through
# os.environ where the store is not there.
_ENVIRON_STORE = getattr(os.environ, "_data", None)
_TARGET_VARIABLE_KEY = os.environ.encodekey(_TARGET_VARIABLE) if _ENVIRON_STORE is not None else None


def current_arch() -> str:
    """The arch name of current_target(), not resolved to its Target (a call's signature names it: each name is one
    Target, targets.target): the innermost ``targeting(...)``'s, else $CUFLASH_SIM_TARGET, else sm_80's. An unknown
    name raises where it is resolved."""
    # Read without the lock (every simulator call's signature reads it): a slice of a list is taken atomically, and
    # targeting() changes the stack under the lock.
    innermost = _target_stack[-1:]
    if innermost:
        return innermost[0].arch
    if _ENVIRON_STORE is None:
        return os.environ.get(_TARGET_VARIABLE) or targets.DEFAULT_ARCH
    value = _ENVIRON_STORE.get(_TARGET_VARIABLE_KEY)
    return targets.DEFAULT_ARCH if value is None else os.environ.decodevalue(value) or targets.DEFAULT_ARCH


def current_target() -> Target:
    """The target plans for NumPy arrays are made for and launches are checked against:
    the innermost ``targeting(...)``, else $CUFLASH_SIM_TARGET, else sm_80."""
    return targets.target(current_arch())


@contextlib.contextmanager
def targeting(arch: str) -> Iterator[Target]:
    """Inside the block the simulator stands in for ``arch`` (e.g. "sm_86": 99 KB of shared memory per
    block): plans are made for it and a launch asking more shared memory than it allows is refused.
    Process-wide, like ``checking``."""
    chosen = targets.target(arch)
    with _mode_lock:
        _target_stack.append(chosen)
    try:
        yield chosen
    finally:
        with _mode_lock:
            del _target_stack[len(_target_stack) - 1 - _target_stack[::-1].index(chosen)]


# ---- launching ---------------------------------------------------------------------------------


def _dims(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)):
        dims = (int(value),)
    else:
        dims = tuple(int(v) for v in value)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < 0 for d in dims):
        raise ValueError(f"{what} dimensions must be >= 0, got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _buffer_extent(array) -> tuple[int, int, bool]:
    """(first byte address, byte length, writable) of the memory an array views."""
    iface = array.__array_interface__
    address, readonly = iface["data"]
    shape = iface["shape"]
    itemsize = np.dtype(iface["typestr"]).itemsize
    strides = iface.get("strides")
    if any(n == 0 for n in shape):
        return address, 0, not readonly
    if strides is None:
        return address, itemsize * int(np.prod(shape, dtype=np.int64)), not readonly
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    return address + low, high - low + itemsize, not readonly


def _workers() -> int:
    value = os.environ.get("CUFLASH_SIM_THREADS", "")
    if value.strip():
        n = int(value)
        if n < 1:
            raise ValueError(f"CUFLASH_SIM_THREADS must be >= 1, got {value!r}")
        return n
    return os.cpu_count() or 1


def launch(
    kernel: KernelInstance,
    grid,
    block,
    dynamic_smem_bytes: int,
    params: bytes | np.void | np.ndarray,
    buffers: Sequence[np.ndarray],
) -> LaunchRecord:
    """Run one kernel launch in the simulator (current checking mode).

    buffers: every array the kernel may touch through its parameters; accesses
    outside them are errors, and they are what the race detector shadows.
    Raises KernelError on any kernel error or invalid launch.
    """
    mode = current_mode()
    target = current_target()
    if dynamic_smem_bytes > target.smem_per_block_bytes:
        raise KernelError(
            kernel.name_expr,
            f"invalid launch of kernel {kernel.name_expr}: it asks for {dynamic_smem_bytes} bytes of dynamic shared "
            f"memory, more than the {target.smem_per_block_bytes} bytes a block may have on {target.arch}",
        )
    grid3 = _dims(grid, "grid")
    block3 = _dims(block, "block")
    if isinstance(params, (np.void, np.ndarray)):
        param_bytes = params.tobytes()
    else:
        param_bytes = bytes(params)
    lib = _library.library_for(mode, kernel)
    ffi = _library.ffi

    extents = [_buffer_extent(b) for b in buffers]
    n = len(extents)
    begin = ffi.new("unsigned long long[]", [e[0] for e in extents] or [0])
    nbytes = ffi.new("unsigned long long[]", [e[1] for e in extents] or [0])
    writable = ffi.new("int[]", [int(e[2]) for e in extents] or [0])
    name = ffi.new("char[]", kernel.name_expr.encode())
    param_buf = ffi.new("char[]", max(1, len(param_bytes)))
    ffi.memmove(param_buf, param_bytes, len(param_bytes))

    req = ffi.new("cuflash_sim_launch_request*")
    req.kernel_name = name
    req.grid = list(grid3)
    req.block = list(block3)
    req.dynamic_smem_bytes = int(dynamic_smem_bytes)
    req.params = param_buf
    req.params_size = len(param_bytes)
    req.num_buffers = n
    req.buffer_begin = begin
    req.buffer_bytes = nbytes
    req.buffer_writable = writable
    req.num_workers = _workers()
    req.copy_landing_seed = _copy_seed()
    if mode == "profile":
        profile_out = ffi.new("char[]", _PROFILE_REPORT_BYTES)
        req.profile_out = profile_out
        req.profile_out_bytes = _PROFILE_REPORT_BYTES

    # Keep the arrays alive (and their memory in place) for the whole call.
    keep_alive = list(buffers)
    rc = lib.cuflash_sim_launch(name, req)
    del keep_alive
    if rc != 0:
        raise KernelError(kernel.name_expr, ffi.string(req.error).decode(errors="replace"))
    rec = LaunchRecord(
        kernel=kernel.name_expr,
        grid=grid3,
        block=block3,
        dynamic_smem_bytes=int(dynamic_smem_bytes),
        global_bytes_read=int(req.bytes_read),
        global_bytes_written=int(req.bytes_written),
        shared_access_sites=_parse_profile(ffi.string(profile_out).decode()) if mode == "profile" else (),
    )
    with _recorders_lock:
        for recorder in _recorders:
            recorder.launches.append(rec)
    return rec


_PROFILE_REPORT_BYTES = 1 << 22


def _parse_profile(text: str) -> tuple[SharedAccessSite, ...]:
    """Report lines (sim_profile.cpp) -> sites; code addresses are named by addr2line."""
    rows = [line.split("\t") for line in text.splitlines() if line]
    addresses: dict[str, list[str]] = {}
    for row in rows:
        if row[0] == "pc":
            addresses.setdefault(row[1], []).append(row[2])
    names = {(library, offset): name for library, offsets in addresses.items()
             for offset, name in zip(offsets, _source_lines(library, offsets))}
    merged: dict[tuple[str, str, int], list[int]] = {}
    for kind_of_site, where, what, kind, nbytes, instructions, wavefronts, ideal in rows:
        site = names[(where, what)] if kind_of_site == "pc" else f"{where}:{what}"
        counts = merged.setdefault((site, kind, int(nbytes)), [0, 0, 0])
        for i, value in enumerate((instructions, wavefronts, ideal)):
            counts[i] += int(value)
    return tuple(SharedAccessSite(site, kind, nbytes, *counts) for (site, kind, nbytes), counts in sorted(merged.items()))


def _source_lines(library: str, offsets: list[str]) -> list[str]:
    """file:line of each code offset in a library (the innermost inlined frame), via addr2line."""
    import shutil
    import subprocess

    if shutil.which("addr2line") is None:
        return [f"{Path(library).name}+0x{offset}" for offset in offsets]
    out = subprocess.run(["addr2line", "-e", library, *[f"0x{o}" for o in offsets]], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    # "file:line (discriminator N)": the discriminator only tells basic blocks of one line apart.
    return [line.split(" (discriminator")[0] if not line.startswith("??") else f"{Path(library).name}+0x{o}"
            for line, o in zip(out, offsets)]


def launch_entry_address(kernel: KernelInstance, mode: str | None = None) -> int:
    """Address of ``int cuflash_sim_launch(const char* name_expr, cuflash_sim_launch_request*)``
    in a loaded library that holds `kernel` (built at first use).

    For callers that launch from C (the JAX FFI handler): fill a request as declared
    in cuda_src/arch/sim/sim_abi.h and call the entry; a non-zero return means
    request->error holds the message. The library stays loaded for the process.
    """
    lib = _library.library_for(mode or current_mode(), kernel)
    return int(_library.ffi.cast("uintptr_t", lib.cuflash_sim_launch))


def precompile(instances: Sequence[KernelInstance], modes: Sequence[str] | None = None) -> None:
    """Build the simulator libraries for `instances` ahead of time (warms the on-disk cache).

    One library per mode holding every instance not cached yet (one TU per source
    file, compiled in parallel). modes: default just the current mode.
    """
    for mode in modes or (current_mode(),):
        _library.precompile(mode, list(instances))


def params_layout(mode: str = "normal") -> dict[str, tuple[int, int]]:
    """Layout of cuflash::AttentionParams as g++ lays it out: C field path -> (offset, size).

    The special key "sizeof" maps to (0, sizeof(AttentionParams)).
    """
    lib = _library.probe_library(mode)
    text = _library.ffi.string(lib.cuflash_sim_params_layout()).decode()
    layout: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if parts[0] == "sizeof":
            layout["sizeof"] = (0, int(parts[1]))
        else:
            layout[parts[0]] = (int(parts[1]), int(parts[2]))
    return layout
