"""cuflash._build_cache, the one cache of NVRTC cubins, simulator libraries and the FFI handler library: keys
cover exactly what a build reads, concurrent builders build once, damaged entries are rebuilt, and no artifact
is ever visible half-written. Everything runs in temporary folders (a copy of cuda_src, a temporary cache)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cuflash import _build_cache
from cuflash._build_cache import BuildCache, content_key, include_closure
from cuflash._paths import CUDA_SRC
from cuflash.kernels.program import KernelInstance
from cuflash.sim import _build as sim_build

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def temporary_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> Path:
    """A copy of cuda_src the simulator build reads instead of the real one."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(CUDA_SRC, copy, ignore=shutil.ignore_patterns("*.so", "*.o", "__pycache__"))
    monkeypatch.setattr(sim_build, "CUDA_SRC", copy)
    monkeypatch.setattr(sim_build, "SIM_DIR", copy / "arch" / "sim")
    return copy


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n// edited\n")


def _key(sources, include_dirs, **changes) -> str:
    parts = dict(toolchain="g++ 1.0", options=["-O2"], sources=sources, include_dirs=include_dirs)
    parts.update(changes)
    return content_key("test", **parts)


# ---- keys ----------------------------------------------------------------------------------------------------


def test_key_covers_exactly_the_included_files(tmp_path):
    tree = tmp_path / "src"
    (tree / "common").mkdir(parents=True)
    (tree / "kernels").mkdir()
    (tree / "common" / "shared.h").write_text('#pragma once\n#include "deeper.h"\n')
    (tree / "common" / "deeper.h").write_text("#pragma once\n")
    (tree / "common" / "other.h").write_text("#pragma once\n")
    (tree / "kernels" / "local.h").write_text("#pragma once\n")
    kernel = tree / "kernels" / "a.cu"
    kernel.write_text('#include "common/shared.h"\n#include "local.h"\n#include <vector>\n')
    (tree / "kernels" / "b.cu").write_text('#include "common/other.h"\n')

    # "common/shared.h" from the include folder, "deeper.h" beside shared.h, "local.h" beside a.cu;
    # <vector> resolves nowhere here: the toolchain's own header, covered by its identity.
    assert include_closure([kernel], [tree]) == sorted(
        [kernel, tree / "common" / "shared.h", tree / "common" / "deeper.h", tree / "kernels" / "local.h"])
    before = _key([kernel], [tree])
    _edit(tree / "kernels" / "b.cu")
    _edit(tree / "common" / "other.h")
    (tree / "common" / "new.h").write_text("#pragma once\n")
    assert _key([kernel], [tree]) == before
    _edit(tree / "common" / "deeper.h")  # included through another header
    assert _key([kernel], [tree]) != before


def test_include_through_a_macro_counts_every_file_it_could_name(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "header.h").write_text("#pragma once\n")
    kernel = tree / "macro.cu"
    kernel.write_text('#define HEADER "header.h"\n#include HEADER\n')
    before = _key([kernel], [tree])
    (tree / "unrelated.h").write_text("#pragma once\n")
    assert _key([kernel], [tree]) != before


def test_key_changes_with_options_toolchain_tag_and_extra(tmp_path):
    source = tmp_path / "a.cpp"
    source.write_text("int a;\n")
    base = _key([source], [])
    assert _key([source], [], options=["-O3"]) != base
    assert _key([source], [], toolchain="g++ 2.0") != base
    assert _key([source], [], extra=["kernel<1>"]) != base
    assert content_key("another-tag", toolchain="g++ 1.0", options=["-O2"], sources=[source], include_dirs=[]) != base
    assert _key([source], []) == base


def test_simulator_library_key_ignores_ffi_headers_and_other_kernels(source_copy):
    instance = KernelInstance(str(source_copy / "kernels" / "standard_attention.cu"), "cuflash::anything<float>")
    before = sim_build.library_key("normal", [instance])
    for unrelated in ("ffi/ffi_abi.h", "ffi/program_call.h", "kernels/fa2_forward.cu", "common/dropout.cuh"):
        _edit(source_copy / unrelated)
    assert sim_build.library_key("normal", [instance]) == before
    _edit(source_copy / "common" / "mask.cuh")  # standard_attention.cu includes it
    edited = sim_build.library_key("normal", [instance])
    assert edited != before
    _edit(source_copy / "arch" / "sim" / "sim_runtime.cpp")  # the runtime the library links
    assert sim_build.library_key("normal", [instance]) != edited


def test_simulator_library_key_changes_with_flags_and_compiler(source_copy, tmp_path, monkeypatch):
    instance = KernelInstance(str(source_copy / "kernels" / "standard_attention.cu"), "cuflash::anything<float>")
    before = sim_build.library_key("normal", [instance])
    assert sim_build.library_key("race", [instance]) != before
    monkeypatch.setenv("CUFLASH_SIM_CXXFLAGS", "-O0 -g")
    assert sim_build.library_key("normal", [instance]) != before
    monkeypatch.delenv("CUFLASH_SIM_CXXFLAGS")
    other_compiler = tmp_path / "other-g++"
    other_compiler.write_text("#!/bin/sh\necho 'g++ (Other) 99.1'\n")
    other_compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(other_compiler))
    assert sim_build.library_key("normal", [instance]) != before
    monkeypatch.delenv("CXX")
    assert sim_build.library_key("normal", [instance]) == before


# ---- entries ---------------------------------------------------------------------------------------------------


def _counting_build(counter: Path, content: bytes, artifact: str = "artifact.bin"):
    def build(workdir: Path) -> dict:
        with open(counter, "a") as file:
            file.write("built\n")
        (workdir / artifact).write_bytes(content)
        return {"size": len(content)}

    return build


def _builds(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def test_entry_is_built_once_then_read(tmp_path):
    cache, counter = BuildCache("test"), tmp_path / "count"
    first = cache.get("entry", ["artifact.bin"], _counting_build(counter, b"payload"))
    second = cache.get("entry", ["artifact.bin"], _counting_build(counter, b"payload"))
    assert _builds(counter) == 1
    assert first == second and first.details == {"size": 7}
    assert first.paths == (cache.directory() / "artifact.bin",) and first.paths[0].read_bytes() == b"payload"


_RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cuflash._build_cache import BuildCache

    folder, me = Path(sys.argv[1]), sys.argv[2]
    (folder / f"ready-{me}").touch()
    while len(list(folder.glob("ready-*"))) < 2:  # start together
        time.sleep(0.01)
    built = []

    def build(workdir):
        built.append(True)
        with open(folder / "count", "a") as file:
            file.write(me + "\\n")
        time.sleep(1.0)  # long enough that the other process asks while this one builds
        (workdir / "artifact.bin").write_bytes(b"built by " + me.encode())

    entry = BuildCache("race").get("entry", ["artifact.bin"], build)
    print("built" if built else "read", entry.paths[0].read_text())
""")


def test_two_processes_racing_on_one_entry_build_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), name], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in ("a", "b")]
    outputs = []
    for racer in racers:
        out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err
        outputs.append(out.split(None, 1))
    assert _builds(tmp_path / "count") == 1
    builder = (tmp_path / "count").read_text().strip()
    assert sorted(how for how, _ in outputs) == ["built", "read"]
    assert {text.strip() for _, text in outputs} == {f"built by {builder}"}


def test_threads_racing_on_one_entry_build_once(tmp_path):
    cache, counter = BuildCache("test"), tmp_path / "count"
    slow = _counting_build(counter, b"payload")

    def build(workdir):
        time.sleep(0.3)
        return slow(workdir)

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("entry", ["artifact.bin"], build)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _builds(counter) == 1 and len(results) == 4 and all(result == results[0] for result in results)


@pytest.mark.parametrize("damage", ["overwritten artifact", "truncated artifact", "missing artifact",
                                    "missing manifest", "partial manifest", "older format"])
def test_damaged_entry_is_rebuilt(tmp_path, damage):
    cache, counter = BuildCache("test"), tmp_path / "count"
    build = _counting_build(counter, b"the whole artifact")
    artifact = cache.get("entry", ["artifact.bin"], build).paths[0]
    manifest = cache.directory() / "entry.json"
    if damage == "overwritten artifact":
        artifact.write_bytes(b"the whole artifacX")
    elif damage == "truncated artifact":
        artifact.write_bytes(b"the whole")
    elif damage == "missing artifact":
        artifact.unlink()
    elif damage == "missing manifest":  # a build killed after placing its artifact
        manifest.unlink()
    elif damage == "partial manifest":
        manifest.write_text(manifest.read_text()[:20])
    else:
        manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), format="cuflash-build-cache-0")))
    assert cache.lookup("entry") is None
    rebuilt = cache.get("entry", ["artifact.bin"], build)
    assert _builds(counter) == 2 and rebuilt.paths[0].read_bytes() == b"the whole artifact"
    assert cache.lookup("entry") == rebuilt


def test_artifact_appears_only_whole_under_its_final_name(tmp_path):
    cache = BuildCache("test")
    final = cache.directory() / "artifact.bin"
    chunks = [bytes([i]) * 4096 for i in range(20)]
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            try:
                seen.add(final.read_bytes())
            except FileNotFoundError:
                pass

    def build(workdir: Path) -> None:
        with open(workdir / "artifact.bin", "wb") as file:
            for chunk in chunks:
                file.write(chunk)
                file.flush()
                time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        cache.get("entry", ["artifact.bin"], build)
        time.sleep(0.05)
    finally:
        done.set()
        watcher.join()
    assert seen == {b"".join(chunks)}


def test_failed_build_leaves_nothing_behind(tmp_path):
    cache = BuildCache("test")

    def failing(workdir: Path) -> None:
        (workdir / "artifact.bin").write_bytes(b"half")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get("entry", ["artifact.bin"], failing)
    with pytest.raises(RuntimeError, match="did not write artifact.bin"):
        cache.get("entry", ["artifact.bin"], lambda workdir: None)
    assert sorted(p.name for p in cache.directory().iterdir()) == ["locks"]
    assert cache.lookup("entry") is None


def test_write_atomically_replaces_whole_files(tmp_path):
    target = tmp_path / "verdict"
    _build_cache.write_atomically(target, b"1")
    _build_cache.write_atomically(target, b"0")
    assert target.read_bytes() == b"0" and [p.name for p in tmp_path.iterdir()] == ["verdict"]
