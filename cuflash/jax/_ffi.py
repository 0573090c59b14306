"""The XLA FFI handler library: a plain shared library built at first use, cached, registered with JAX.

Build: g++ compiles ``cuda_src/ffi/cpu_program.cpp`` and
``cuda_src/ffi/cuda_program.cpp`` into one plain shared library (no Python.h;
Python loads it with cffi's ABI mode from the declarations in ``ffi_abi.h``),
against the XLA FFI headers of the installed jaxlib (``jax.ffi.include_dir()``)
and, when the ``nvidia-cuda-runtime`` wheel is installed, its ``cuda.h`` (only
the header: libcuda is opened with dlopen when a CUDA call first runs, so the
library builds and loads on machines without a driver or GPU).

Cache (cuflash._build_cache): ``cache_dir("jax_ffi")/libcuflash_jax_ffi_<key>.so``; the key hashes the
handler sources and every file they include (from cuda_src, the XLA FFI and CUDA headers), the compiler's
version line and the flags.

Registries: the handlers find kernels by name expression in process-global
tables of the library; :func:`register_sim_kernel` and :func:`register_module_image`
fill them (cuflash.jax's lowering rules call them), nothing else does.

Stages: each platform's handler is a bundle of two XLA FFI stages (ffi_abi.h):
instantiate, once per compiled call, decodes the attributes and resolves the
kernels into a per-instance state of a type registered with XLA; execute binds
the buffers and launches. :func:`register_targets` registers each state type
with its handlers; the type ids are fixed in the library, because JAX's CPU
client replays deferred handlers before deferred types.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import subprocess
import threading
import types
from pathlib import Path
from typing import Iterator

from .._build_cache import BuildCache, compiler as _compiler, compiler_identity, content_key
from .._paths import CUDA_SRC
from ..kernels import nvrtc

TARGET_NAME = "cuflash_program"

FFI_DIR = CUDA_SRC / "ffi"
HANDLER_SOURCES = ("cpu_program.cpp", "cuda_program.cpp")
ABI_HEADER = FFI_DIR / "ffi_abi.h"

COMPILE_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-Wall")
LINK_FLAGS = ("-lstdc++", "-ldl")

# Bump when how the library is built changes (2: a plain shared library loaded with cffi's ABI mode).
_CACHE_TAG = "jax-ffi-3"
_CACHE = BuildCache("jax_ffi")


class FfiBuildError(RuntimeError):
    """The C++ compiler rejected the FFI handler sources (the message holds its output)."""


def _cdef_text() -> str:
    text = ABI_HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def xla_include_dir() -> Path:
    import jax

    return Path(jax.ffi.include_dir())


def cuda_include_dir() -> Path | None:
    """The CUDA headers (cuda.h, cudaTypedefs.h) the CUDA handler is built with: those cuda-pathfinder finds for
    NVRTC (the nvidia-cuda-runtime wheel of CUDA 12 or 13, conda, CUDA_PATH); None when there are none, and
    the library then has the CPU handler only."""
    try:
        found = nvrtc.find_cuda_include_dir()
    except ImportError:  # no cuda-pathfinder
        return None
    return found if found is not None and (found / "cudaTypedefs.h").is_file() else None


# What a lowered call's bytes mean: the AttentionParams layout, the dropout seed rows, the attributes' decoding.
CALL_LAYOUT_SOURCES = ("common/attention_params.cuh", "common/dropout.cuh", "ffi/program_call.h")


@functools.lru_cache(maxsize=1)
def call_abi() -> str:
    """The version a lowered call carries and the handler library is built with (program_call.h refuses a
    mismatch): cuflash's version and a digest of CALL_LAYOUT_SOURCES, so an executable exported before a layout
    change is refused by name rather than misread, even between builds of one version."""
    from .. import __version__

    digest = hashlib.sha256(b"".join((CUDA_SRC / name).read_bytes() for name in CALL_LAYOUT_SOURCES)).hexdigest()
    return f"{__version__}+{digest[:12]}"


def version_flag() -> str:
    """The define the handlers compare each call's version attribute with (program_call.h)."""
    return f'-DCUFLASH_VERSION="{call_abi()}"'


def _compile_flags() -> list[str]:
    flags = [*COMPILE_FLAGS, version_flag(), "-I", str(CUDA_SRC), "-isystem", str(xla_include_dir())]
    cuda_include = cuda_include_dir()
    if cuda_include is not None:
        flags += ["-isystem", str(cuda_include), "-DCUFLASH_FFI_WITH_CUDA=1"]
    return flags


def _compile(flags: list[str], output: Path) -> None:
    """g++ the handler sources into a plain shared library (no Python.h: any Python loads it with cffi's ABI
    mode, and a host without Python development headers can build it)."""
    command = [_compiler(), *flags, "-shared", *(str(FFI_DIR / name) for name in HANDLER_SOURCES),
               "-o", str(output), *LINK_FLAGS]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise FfiBuildError(f"building the cuflash JAX FFI handlers failed ({' '.join(command)}):\n{run.stderr}")


def library_path() -> Path:
    """The cached handler library for this environment, building it if needed."""
    flags = _compile_flags()
    include_dirs = [CUDA_SRC, xla_include_dir(), *filter(None, [cuda_include_dir()])]
    key = content_key(_CACHE_TAG, toolchain=compiler_identity(_compiler()), options=[*flags, *LINK_FLAGS],
                      sources=[FFI_DIR / name for name in HANDLER_SOURCES], include_dirs=include_dirs)
    entry = f"libcuflash_jax_ffi_{key}"
    library = f"{entry}.so"
    return _CACHE.get(entry, [library], lambda workdir: _compile(flags, workdir / library)).paths[0]


_lock = threading.RLock()
_module = None
_registered_platforms: set[str] = set()


def library():
    """The loaded library as ``.ffi`` (its cffi declarations, ffi_abi.h) and ``.lib`` (cffi ABI mode), built at
    first use."""
    global _module
    with _lock:
        if _module is None:
            import cffi

            ffi = cffi.FFI()
            ffi.cdef(_cdef_text())
            _module = types.SimpleNamespace(ffi=ffi, lib=ffi.dlopen(str(library_path())))
        return _module


def _address(pointer) -> int:
    ffi = library().ffi
    return int(ffi.cast("uintptr_t", pointer))


PLATFORMS = ("cpu", "CUDA")


def handler_bundle(platform: str):
    """The library's ``cuflash_ffi_handler_bundle`` for ``platform`` ("cpu" or "CUDA"), or None when it has no
    handler for it (CUDA without the driver API header at build time)."""
    module = library()
    getter = {"cpu": module.lib.cuflash_ffi_cpu_handlers, "CUDA": module.lib.cuflash_ffi_cuda_handlers}[platform]
    bundle = module.ffi.new("cuflash_ffi_handler_bundle*")
    return bundle if getter(bundle) else None


def has_cuda_handler() -> bool:
    return handler_bundle("CUDA") is not None


def register_targets() -> None:
    """Register the handlers with JAX as ``cuflash_program`` (cpu, and CUDA when built with it): per platform, the
    state type of its instantiate stage, then the instantiate + execute bundle. JAX defers both for a platform
    whose backend has not started; the state type ids are fixed in the library, so the order JAX replays them in
    does not matter (program_call.h, FixedStateTypeId).

    No traits are passed here: XLA reads them from the execute handler itself (the CUDA one declares itself
    command-buffer compatible), and JAX's GPU plugin refuses traits given at registration."""
    import jax

    with _lock:
        ffi = library().ffi
        for platform in PLATFORMS:
            if platform in _registered_platforms:
                continue
            bundle = handler_bundle(platform)
            if bundle is None:
                continue
            state_type = {"type_id": jax.ffi.pycapsule(_address(bundle.state_type_id)),
                          "type_info": jax.ffi.pycapsule(_address(bundle.state_type_info))}
            jax.ffi.register_ffi_type(ffi.string(bundle.state_type_name).decode(), state_type, platform=platform)
            stages = {"instantiate": jax.ffi.pycapsule(_address(bundle.instantiate)),
                      "execute": jax.ffi.pycapsule(_address(bundle.execute))}
            jax.ffi.register_ffi_target(TARGET_NAME, stages, platform=platform, api_version=1)
            _registered_platforms.add(platform)


def state_type_id(platform: str) -> int:
    """The XLA FFI type id of the platform's state type (fixed in the library, registered under its name)."""
    bundle = handler_bundle(platform)
    return int(library().ffi.cast("int64_t*", bundle.state_type_id)[0])


def execute_handler_traits(platform: str) -> int:
    """The traits XLA reads from the platform's execute handler when registering it (bit 0: command-buffer
    compatible), by the same metadata query XLA makes."""
    module = library()
    traits = module.ffi.new("unsigned*")
    if not module.lib.cuflash_ffi_handler_traits(handler_bundle(platform).execute, traits):
        raise RuntimeError(f"the {platform} execute handler refused XLA's metadata query")
    return int(traits[0])


COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE (xla/ffi/api/c_api.h)


def instantiations(platform: str) -> int:
    """How many states the platform's instantiate stage has created in this process (one per compiled call)."""
    lib = library().lib
    return int({"cpu": lib.cuflash_ffi_cpu_instantiations, "CUDA": lib.cuflash_ffi_cuda_instantiations}[platform]())


def captured_executions() -> int:
    """How many CUDA executions ran in this process while XLA captured their stream into a command buffer."""
    return int(library().lib.cuflash_ffi_cuda_captured_executions())


_resolver = None  # the cffi callback the handlers call; kept alive here


def set_resolver(resolve) -> None:
    """Install ``resolve(name_expr, target) -> bool`` (target "sim" or "sm_XY") as the handlers' resolver for
    kernels this process never lowered (ffi_abi.h). The handlers call it while XLA instantiates a compiled call
    (while compiling or deserializing it), on XLA's thread."""
    global _resolver
    ffi, lib = library().ffi, library().lib

    def callback(name_expr, target):
        try:
            return 0 if resolve(ffi.string(name_expr).decode(), ffi.string(target).decode()) else 1
        except Exception:  # an exception must not cross into the handler; it reports the kernel as missing
            import traceback

            traceback.print_exc()
            return 1

    with _lock:
        _resolver = ffi.callback("cuflash_ffi_resolver", callback)
        lib.cuflash_ffi_set_resolver(_resolver)


def library_version() -> str:
    return library().ffi.string(library().lib.cuflash_ffi_version()).decode()


def register_sim_kernel(name_expr: str, entry_address: int) -> None:
    library().lib.cuflash_ffi_register_sim_kernel(name_expr.encode(), library().ffi.cast("void*", entry_address))


def unregister_sim_kernel(name_expr: str) -> None:
    library().lib.cuflash_ffi_unregister_sim_kernel(name_expr.encode())


def sim_kernel_registered(name_expr: str) -> bool:
    return bool(library().lib.cuflash_ffi_sim_kernel_registered(name_expr.encode()))


def register_module_image(name_expr: str, arch: str, lowered_name: str, image: bytes) -> None:
    """Register for devices of ``arch`` the code NVRTC built for them (a CUBIN, or NUL-terminated PTX)."""
    library().lib.cuflash_ffi_register_module_image(
        name_expr.encode(), arch.encode(), lowered_name.encode(), image, len(image)
    )


def module_image_registered(name_expr: str, arch: str) -> bool:
    return bool(library().lib.cuflash_ffi_module_image_registered(name_expr.encode(), arch.encode()))


def cuda_driver_status() -> str:
    """"" when the CUDA handler can use the driver here, else the reason it cannot."""
    ffi = library().ffi
    return ffi.string(library().lib.cuflash_ffi_cuda_driver_status()).decode()


@contextlib.contextmanager
def record_launches() -> Iterator[list]:
    """Collect the simulated launches the CPU handler runs inside the block, as cuflash.sim.LaunchRecord (in
    profile mode with their shared_access_sites, as cuflash.sim.record gives them).

    The list fills when the block exits (JAX dispatches asynchronously: block on results inside it).
    Not reentrant: one recording at a time per process.
    """
    from ..sim import LaunchRecord
    from ..sim._launch import _parse_profile

    lib, ffi = library().lib, library().ffi
    records: list = []
    lib.cuflash_ffi_sim_record(1)
    try:
        yield records
    finally:
        lib.cuflash_ffi_sim_record(0)
        entry = ffi.new("cuflash_ffi_launch_record*")
        for index in range(lib.cuflash_ffi_sim_recorded_count()):
            if lib.cuflash_ffi_sim_recorded(index, entry):
                profile = ffi.string(lib.cuflash_ffi_sim_recorded_profile(index)).decode()
                records.append(
                    LaunchRecord(
                        kernel=ffi.string(entry.kernel).decode(),
                        grid=tuple(entry.grid),
                        block=tuple(entry.block),
                        dynamic_smem_bytes=int(entry.dynamic_smem_bytes),
                        global_bytes_read=int(entry.bytes_read),
                        global_bytes_written=int(entry.bytes_written),
                        shared_access_sites=_parse_profile(profile) if profile else (),
                    )
                )


def params_size() -> int:
    return int(library().lib.cuflash_ffi_params_size())


def pointer_field_offset(name: str) -> int:
    return int(library().lib.cuflash_ffi_pointer_field_offset(name.encode()))


def tiled_argument_word(name: str) -> int:
    """The index of cuTensorMapEncodeTiled's argument ``name`` in one map's tma_arguments words, as the handlers
    read them (program_call.h's TiledArguments); -1 if unknown."""
    return int(library().lib.cuflash_ffi_tiled_argument_word(name.encode()))
