"""The FFI handler library: both handlers build here; only the CPU one can run (no GPU, no driver).

The CUDA handler is compiled against cuda.h from the nvidia-cuda-runtime wheel and loads libcuda with dlopen
at first use, so the library builds and loads on this machine; tests marked gpu (test_jax_dlpack.py,
test_jax_ffi_stages.py) run it.
"""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("jax")

from cuflash._paths import CUDA_SRC  # noqa: E402
from cuflash.jax import _ffi  # noqa: E402
from cuflash.testing import gpu_count  # noqa: E402


def _syntax_check(source: str, *defines: str) -> subprocess.CompletedProcess:
    flags = ["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-I", str(CUDA_SRC), _ffi.version_flag()]
    flags += ["-isystem", str(_ffi.xla_include_dir())]
    cuda_include = _ffi.cuda_include_dir()
    if cuda_include is not None:
        flags += ["-isystem", str(cuda_include)]
    return subprocess.run([_ffi._compiler(), *flags, *defines, str(CUDA_SRC / "ffi" / source)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("source", _ffi.HANDLER_SOURCES)
def test_handler_sources_compile_without_warnings(source):
    defines = ("-DCUFLASH_FFI_WITH_CUDA=1",) if source == "cuda_program.cpp" else ()
    if defines and _ffi.cuda_include_dir() is None:
        pytest.skip("nvidia-cuda-runtime (cuda.h) is not installed")
    result = _syntax_check(source, *defines)
    assert result.returncode == 0, result.stderr


def test_cuda_handler_is_built_and_registered():
    if _ffi.cuda_include_dir() is None:
        pytest.skip("nvidia-cuda-runtime (cuda.h) is not installed")
    _ffi.register_targets()
    assert _ffi.has_cuda_handler()
    assert {"cpu", "CUDA"} <= _ffi._registered_platforms


@pytest.mark.parametrize("platform", _ffi.PLATFORMS)
def test_each_handler_is_an_instantiate_and_execute_bundle_with_its_own_state_type(platform):
    if platform == "CUDA" and _ffi.cuda_include_dir() is None:
        pytest.skip("nvidia-cuda-runtime (cuda.h) is not installed")
    bundle = _ffi.handler_bundle(platform)
    assert bundle is not None
    assert _ffi._address(bundle.instantiate) and _ffi._address(bundle.execute)
    assert bundle.instantiate != bundle.execute
    names = {p: _ffi.library().ffi.string(_ffi.handler_bundle(p).state_type_name).decode()
             for p in _ffi.PLATFORMS if _ffi.handler_bundle(p) is not None}
    ids = {p: _ffi.state_type_id(p) for p in names}
    # Each platform's state is a type of its own, with an id fixed before any registration (ffi_abi.h).
    assert len(set(names.values())) == len(names) and len(set(ids.values())) == len(ids)
    assert ids[platform] != 0


def test_cuda_driver_is_loaded_lazily():
    status = _ffi.cuda_driver_status()
    if gpu_count():
        assert status == ""
    else:
        # The library loaded and the CPU handler works; the CUDA one would report exactly this.
        assert "libcuda.so.1" in status or "cuGetProcAddress" in status, status


def test_library_is_cached():
    first = _ffi.library_path()
    assert first.exists() and first.parent.name == "jax_ffi"
    assert _ffi.library_path() == first


def test_cuda_handler_source_builds_without_the_cuda_header_too():
    """Without cuda.h the library still builds; the CUDA platform is then simply not offered."""
    result = _syntax_check("cuda_program.cpp")
    assert result.returncode == 0, result.stderr


def test_library_is_a_plain_shared_library_without_python():
    """[jax-scale] 4: the handlers build with g++ alone (no Python.h) into a library any Python loads with cffi's
    ABI mode: it references no Python C API symbol."""
    import shutil

    path = _ffi.library_path()
    assert path.name.startswith("libcuflash_jax_ffi_") and path.suffix == ".so"
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(path)], capture_output=True, text=True, check=True)
    assert not [line for line in undefined.stdout.splitlines() if " Py" in line or "_Py" in line], undefined.stdout
    assert _ffi.library().lib.cuflash_ffi_params_size() > 0


def test_call_abi_names_the_version_and_changes_with_the_call_layout(monkeypatch, tmp_path):
    """A lowered call carries call_abi() and the library is built with it (program_call.h refuses a mismatch): it
    changes when a file that defines what a call's bytes mean changes, so an executable exported before a layout
    change is refused rather than misread."""
    import shutil

    import cuflash

    here = _ffi.call_abi()
    assert here.startswith(cuflash.__version__ + "+") and f'"{here}"' in _ffi.version_flag()
    for name in _ffi.CALL_LAYOUT_SOURCES:
        copy = tmp_path / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(CUDA_SRC / name, copy)
    monkeypatch.setattr(_ffi, "CUDA_SRC", tmp_path)
    _ffi.call_abi.cache_clear()
    try:
        assert _ffi.call_abi() == here
        edited = tmp_path / "common" / "dropout.cuh"
        edited.write_text(edited.read_text().replace("kSeedRowWords = 8", "kSeedRowWords = 4"))
        _ffi.call_abi.cache_clear()
        assert _ffi.call_abi() != here
    finally:
        _ffi.call_abi.cache_clear()
