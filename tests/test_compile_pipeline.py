"""The NVRTC compile pipeline and the compile report, on probe kernels in tests/compile_kernels/.

No GPU is needed (except the one test marked gpu): NVRTC compiles to CUBIN on
the CPU and ptxas's report and cuobjdump's SASS are read from its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from cuflash._build_cache import include_closure
from cuflash.backends import cupy_gpu
from cuflash.kernels import nvrtc, report, targets
from cuflash.kernels.program import KernelInstance

REPO = Path(__file__).resolve().parent.parent
PROBES = Path(__file__).resolve().parent / "compile_kernels" / "probe_kernels.cu"
ARCHS = ["sm_80", "sm_90"]


def probe(name_expr: str, source: Path = PROBES) -> KernelInstance:
    return KernelInstance(str(source), name_expr)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for the module's read-only tests (each probe compiles once per worker)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("cuflash_cache")))
        yield


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nvrtc"


needs_sass = pytest.mark.skipif(
    nvrtc.cuda_tool("cuobjdump") is None or nvrtc.cuda_tool("nvdisasm") is None,
    reason="cuobjdump/nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)",
)


# ---- compiling and resources ------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("name_expr", "mangled_prefix", "smem"), [
    ("static_smem_probe<__half, 100>", "_Z17static_smem_probeI6__halfLi100E", 200),
    ("static_smem_probe<float, 96>", "_Z17static_smem_probeIfLi96E", 384),
])
def test_template_instance_compiles_with_resources(shared_cache, arch, name_expr, mangled_prefix, smem):
    compiled = nvrtc.compile_instance(probe(name_expr), arch)
    assert compiled.code[:4] == b"\x7fELF"
    assert compiled.lowered_name.startswith(mangled_prefix)
    assert f"Compiling entry function '{compiled.lowered_name}' for '{arch}'" in compiled.log
    assert compiled.resources.registers > 0
    assert compiled.resources.barriers == 1  # the one __syncthreads
    assert compiled.resources.static_smem_bytes == smem  # Elements * sizeof(T)
    assert compiled.resources.spill_store_bytes == compiled.resources.spill_load_bytes == 0
    assert Path(compiled.code_path).read_bytes() == compiled.code


@pytest.mark.parametrize("arch", ARCHS)
def test_register_cap_forces_spills_while_indexed_array_only_uses_stack(shared_cache, arch):
    capped = nvrtc.compile_instance(probe("register_pressure_probe<64, 32>"), arch).resources
    uncapped = nvrtc.compile_instance(probe("register_pressure_probe<64, 255>"), arch).resources
    assert capped.registers <= 32 < uncapped.registers
    assert capped.spill_store_bytes > 0 and capped.spill_load_bytes > 0
    # The dynamically indexed 64-float array lives in local memory either way:
    # stack frame, but no spills, when registers are not capped.
    assert uncapped.spill_store_bytes == uncapped.spill_load_bytes == 0
    assert uncapped.stack_frame_bytes >= 64 * 4
    assert capped.stack_frame_bytes > uncapped.stack_frame_bytes


def test_parser_picks_the_named_function_and_rejects_a_missing_one(shared_cache):
    compiled = nvrtc.compile_instance(probe("static_smem_probe<float, 96>"), "sm_80")
    other = nvrtc.compile_instance(probe("register_pressure_probe<64, 32>"), "sm_80")
    # Two reports in one log, as when a source file holds several kernels.
    combined = other.log + compiled.log
    assert nvrtc.parse_resources(combined, compiled.lowered_name, "sm_80") == compiled.resources
    assert nvrtc.parse_resources(combined, other.lowered_name, "sm_80") == other.resources
    with pytest.raises(nvrtc.PtxasReportError, match="no ptxas report"):
        nvrtc.parse_resources(compiled.log, other.lowered_name, "sm_80")
    with pytest.raises(nvrtc.PtxasReportError, match="expected sm_90"):
        nvrtc.parse_resources(compiled.log, compiled.lowered_name, "sm_90")
    truncated = "\n".join(line for line in compiled.log.splitlines() if "Used" not in line)
    with pytest.raises(nvrtc.PtxasReportError, match="incomplete"):
        nvrtc.parse_resources(truncated, compiled.lowered_name, "sm_80")


def test_compile_error_names_instance_and_arch_with_full_log(fresh_cache):
    instance = probe("float_only_probe<double>")
    with pytest.raises(nvrtc.CompileError) as caught:
        nvrtc.compile_instance(instance, "sm_90")
    error = caught.value
    assert error.instance == instance and error.arch == "sm_90"
    assert 'static assertion failed with "float_only_probe wants float"' in error.log
    assert "with T=double" in error.log
    # NVRTC's own log, not cuda.core's exception text wrapped around it.
    assert error.log.startswith(f"{PROBES}(") and "NVRTC_ERROR" not in error.log and "\0" not in error.log
    message = str(error)
    assert "float_only_probe<double>" in message and "sm_90" in message and error.log.strip() in message
    # Failures are not cached.
    assert not list(fresh_cache.glob("*.json"))
    # The same template with a valid argument compiles.
    assert nvrtc.compile_instance(probe("float_only_probe<float>"), "sm_90").resources.registers > 0


def test_a_compile_error_in_a_reference_cycle_is_collected_cleanly(fresh_cache, monkeypatch):
    """A cuda.core Program that the garbage collector frees out of a cycle fails in its __dealloc__
    (cuda.core 1.2): the traceback of a CompileError must not keep one alive."""
    import gc

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def fail_into_a_cycle():
        try:
            nvrtc.compile_instance(probe("float_only_probe<double>"), "sm_80")
        except nvrtc.CompileError as error:
            kept = error  # this frame holds the error, whose traceback holds this frame
        return kept.arch

    assert fail_into_a_cycle() == "sm_80"
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]


def test_compile_error_pickles():
    import pickle

    error = nvrtc.CompileError(probe("x<1>"), "sm_80", "log text")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.instance, clone.arch, clone.log) == (error.instance, error.arch, error.log)


@pytest.mark.parametrize("bad", ["sm80", "90", "compute-90", "lto_90"])
def test_bad_arch_is_rejected_before_compiling(bad):
    """sm_XX (a CUBIN) and compute_XX (PTX) are the two forms; anything else is refused before NVRTC runs."""
    with pytest.raises(ValueError, match="real architecture"):
        nvrtc.compile_options(bad, [])


# ---- the disk cache ------------------------------------------------------------


def test_second_compile_is_a_cache_hit(fresh_cache, monkeypatch):
    instance = probe("static_smem_probe<__half, 100>")
    before = nvrtc.nvrtc_compile_count()
    first = nvrtc.compile_instance(instance, "sm_80")
    assert nvrtc.nvrtc_compile_count() == before + 1
    assert len(list(fresh_cache.glob("*.cubin"))) == 1 and len(list(fresh_cache.glob("*.json"))) == 1

    # A hit must not reach NVRTC at all.
    def no_compiling(*args):
        raise AssertionError("NVRTC called on a cache hit")

    with monkeypatch.context() as patch:
        patch.setattr(nvrtc, "_run_nvrtc", no_compiling)
        second = nvrtc.compile_instance(instance, "sm_80")
    assert second == first
    assert nvrtc.nvrtc_compile_count() == before + 1
    # Another arch is another entry.
    nvrtc.compile_instance(instance, "sm_90")
    assert nvrtc.nvrtc_compile_count() == before + 2


def test_cache_hit_in_another_process(fresh_cache):
    instance = probe("static_smem_probe<__half, 100>")
    first = nvrtc.compile_instance(instance, "sm_90")
    script = (
        "from cuflash.kernels import nvrtc\n"
        "from cuflash.kernels.program import KernelInstance\n"
        f"c = nvrtc.compile_instance(KernelInstance({str(PROBES)!r}, {instance.name_expr!r}), 'sm_90')\n"
        "print(nvrtc.nvrtc_compile_count(), c.code_path)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    count, path = out.split()
    assert count == "0" and path == first.code_path


def test_source_edit_or_corrupt_entry_recompiles(fresh_cache, tmp_path):
    source = tmp_path / "kernels" / "probe.cu"
    source.parent.mkdir()
    (source.parent / "neighbour.cuh").write_text("#pragma once\n#define PROBE_PADDING 0\n")
    text = PROBES.read_text().replace("__shared__ T staging[Elements];", "__shared__ T staging[Elements + PROBE_PADDING];")
    source.write_text('#include "neighbour.cuh"\n' + text)
    instance = probe("static_smem_probe<float, 96>", source)
    first = nvrtc.compile_instance(instance, "sm_80")
    count = nvrtc.nvrtc_compile_count()

    # A file nothing includes does not matter.
    (source.parent / "unrelated.cuh").write_text("// not included\n")
    nvrtc.compile_instance(instance, "sm_80")
    assert nvrtc.nvrtc_compile_count() == count

    # An included header beside the source does.
    (source.parent / "neighbour.cuh").write_text("#pragma once\n#define PROBE_PADDING 4\n")
    edited = nvrtc.compile_instance(instance, "sm_80")
    assert nvrtc.nvrtc_compile_count() == count + 1
    assert (first.resources.static_smem_bytes, edited.resources.static_smem_bytes) == (384, 400)

    # So does the kernel text itself.
    source.write_text(source.read_text().replace("Elements + PROBE_PADDING", "Elements + 2 * PROBE_PADDING"))
    edited = nvrtc.compile_instance(instance, "sm_80")
    assert nvrtc.nvrtc_compile_count() == count + 2
    assert edited.resources.static_smem_bytes == 416

    # A cubin that no longer matches its record is rebuilt, not trusted.
    Path(edited.code_path).write_bytes(b"garbage")
    rebuilt = nvrtc.compile_instance(instance, "sm_80")
    assert nvrtc.nvrtc_compile_count() == count + 3
    assert rebuilt.code == edited.code == Path(rebuilt.code_path).read_bytes()


def test_cache_key_follows_includes_into_cuda_src(monkeypatch, tmp_path):
    import shutil

    copy = tmp_path / "cuda_src"
    shutil.copytree(nvrtc.CUDA_SRC, copy, ignore=shutil.ignore_patterns("*.so", "*.o", "__pycache__"))
    monkeypatch.setattr(nvrtc, "CUDA_SRC", copy)
    instance = probe("static_smem_probe<float, 96>")
    before = nvrtc.cache_key(instance, "sm_80")
    assert nvrtc.cache_key(instance, "sm_90") != before
    assert nvrtc.cache_key(probe("static_smem_probe<float, 97>"), "sm_80") != before

    # The probe includes arch/arch.cuh, which includes common/attention_params.cuh.
    params = (copy / "common" / "attention_params.cuh").resolve()
    assert params in include_closure([PROBES], [copy.resolve()])
    (copy / "common" / "unrelated_new_header.cuh").write_text("#pragma once\n")
    assert nvrtc.cache_key(instance, "sm_80") == before
    params.write_text(params.read_text() + "\n// edited\n")
    assert nvrtc.cache_key(instance, "sm_80") != before

    # An include through a macro cannot be followed: then every file counts.
    macro_source = tmp_path / "macro_include.cu"
    macro_source.write_text('#define PROBE_HEADER "arch/arch.cuh"\n#include PROBE_HEADER\n')
    macro_instance = probe("anything<0>", macro_source)
    assert (copy / "kernels" / "fa1_forward.cu").resolve() in include_closure([macro_source], [copy.resolve()])
    key = nvrtc.cache_key(macro_instance, "sm_80")
    (copy / "kernels" / "another_unrelated.cuh").write_text("#pragma once\n")
    assert nvrtc.cache_key(macro_instance, "sm_80") != key


def test_concurrent_compiles_of_one_entry_agree(fresh_cache):
    instance = probe("register_pressure_probe<16, 255>")
    results = nvrtc.compile_many([instance, instance, instance], ["sm_80"], jobs=2)
    assert len({r.code for r in results}) == 1
    assert len(list(fresh_cache.glob("*.cubin"))) == 1
    assert not list(fresh_cache.glob("*.tmp"))
    # Threads in one process, too.
    outputs = []
    threads = [threading.Thread(target=lambda: outputs.append(nvrtc.compile_instance(instance, "sm_90"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outputs) == 3 and len({o.code for o in outputs}) == 1


def test_compile_many_keeps_order_and_collects_errors(fresh_cache):
    good = probe("static_smem_probe<float, 96>")
    bad = probe("float_only_probe<double>")
    results = nvrtc.compile_many([good, bad], ARCHS, jobs=2, return_errors=True)
    assert [(r.instance, r.arch) for r in results] == [(good, "sm_80"), (good, "sm_90"), (bad, "sm_80"), (bad, "sm_90")]
    assert [type(r) for r in results] == [nvrtc.CompiledKernel] * 2 + [nvrtc.CompileError] * 2
    with pytest.raises(nvrtc.CompileError) as caught:
        nvrtc.compile_many([good, bad], ["sm_80"], jobs=1)
    assert caught.value.instance == bad


def test_compile_many_starts_no_workers_when_all_is_cached(fresh_cache, monkeypatch):
    instances = [probe("static_smem_probe<float, 96>"), probe("half_fma_probe<0>")]
    first = nvrtc.compile_many(instances, ARCHS, jobs=2)

    def no_workers(*args):
        raise AssertionError("workers started for cached entries")

    monkeypatch.setattr(nvrtc, "_compile_in_workers", no_workers)
    assert nvrtc.compile_many(instances, ARCHS, jobs=2) == first


def test_compile_many_reports_a_failing_worker_task(fresh_cache, tmp_path):
    missing = probe("static_smem_probe<float, 96>", tmp_path / "missing.cu")
    with pytest.raises(RuntimeError, match=r"(?s)compile worker failed on static_smem_probe<float, 96>.*FileNotFoundError"):
        nvrtc.compile_many([missing], ARCHS, jobs=2)


def test_compile_many_from_a_script_without_main_guard(fresh_cache):
    """Workers do not re-run the caller's __main__ (multiprocessing's spawn would, and fail on stdin)."""
    script = (
        "from cuflash.kernels import nvrtc\n"
        "from cuflash.kernels.program import KernelInstance\n"
        f"instances = [KernelInstance({str(PROBES)!r}, n) for n in ('mma_probe<0>', 'half_fma_probe<0>')]\n"
        "results = nvrtc.compile_many(instances, ['sm_80', 'sm_90'], jobs=2)\n"
        "print([r.arch for r in results], nvrtc.nvrtc_compile_count())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    # The workers compiled; the caller only read the cache.
    assert run.stdout.split("]")[1].strip() == "0"
    assert run.stdout.startswith("['sm_80', 'sm_90', 'sm_80', 'sm_90']")
    assert len(list(fresh_cache.glob("*.cubin"))) == 4


# ---- SASS ---------------------------------------------------------------------------


@needs_sass
@pytest.mark.parametrize("arch", ARCHS)
def test_hmma_found_only_where_the_kernel_uses_mma(shared_cache, arch):
    assert nvrtc.uses_hmma(nvrtc.compile_instance(probe("mma_probe<0>"), arch)) is True
    assert nvrtc.uses_hmma(nvrtc.compile_instance(probe("half_fma_probe<0>"), arch)) is False


@needs_sass
def test_sass_of_a_missing_function_is_an_error_not_false(shared_cache):
    compiled = nvrtc.compile_instance(probe("mma_probe<0>"), "sm_80")
    import dataclasses

    renamed = dataclasses.replace(compiled, lowered_name="_Z13not_in_cubinv")
    with pytest.raises(nvrtc.SassError):
        nvrtc.uses_hmma(renamed)


@needs_sass
def test_hmma_verdict_is_cached_beside_the_entry(fresh_cache, monkeypatch):
    compiled = nvrtc.compile_instance(probe("mma_probe<0>"), "sm_90")
    assert nvrtc.uses_hmma(compiled) is True
    assert len(list(fresh_cache.glob("*.hmma"))) == 1

    def no_disassembly(_):
        raise AssertionError("cuobjdump run again")

    monkeypatch.setattr(nvrtc, "dump_sass", no_disassembly)
    assert nvrtc.uses_hmma(compiled) is True


@needs_sass
def test_line_table_is_cached_beside_the_entry(fresh_cache, monkeypatch):
    compiled = nvrtc.compile_instance(probe("mma_probe<0>"), "sm_80")
    table = nvrtc.dump_line_table(compiled)
    assert table and len(list(fresh_cache.glob("*.lines.json"))) == 1

    def no_disassembly(*args, **kwargs):
        raise AssertionError("nvdisasm run again")

    monkeypatch.setattr(nvrtc.subprocess, "run", no_disassembly)
    assert nvrtc.dump_line_table(compiled) == table


@pytest.mark.parametrize("missing", ["cuobjdump", "nvdisasm"])
def test_hmma_is_none_without_a_sass_tool(fresh_cache, monkeypatch, missing):
    compiled = nvrtc.compile_instance(probe("mma_probe<0>"), "sm_80")
    found = nvrtc.cuda_tool
    monkeypatch.setattr(nvrtc, "cuda_tool", lambda name: None if name == missing else found(name))
    assert nvrtc.uses_hmma(compiled) is None


def test_system_cuda_tools_are_not_needed():
    """cuda-pathfinder finds everything in the pip wheels: NVRTC, the CUDA headers the kernels include
    and (when installed) cuobjdump and nvdisasm."""
    from cuda import pathfinder

    assert nvrtc.nvrtc_version() >= (13, 0)
    assert "site-packages" in str(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    include_dir = nvrtc.cuda_include_dir()
    assert "site-packages" in str(include_dir)
    cuda_headers = {line.split("<")[1].split(">")[0]
                    for source in nvrtc.CUDA_SRC.rglob("*.cu*") for line in source.read_text().splitlines()
                    if line.strip().startswith("#include <cuda")}
    assert {"cuda_fp16.h", "cuda_bf16.h"} <= cuda_headers
    assert all((include_dir / header).exists() for header in cuda_headers)
    for name in ("cuobjdump", "nvdisasm"):
        tool = nvrtc.cuda_tool(name)
        if tool is not None:
            assert "site-packages" in str(tool), tool


# ---- the report ------------------------------------------------------------------------


@pytest.fixture
def probe_catalog(monkeypatch):
    """A fake catalog of probe kernels and a fake launch plan."""
    instances = [probe("static_smem_probe<float, 96>"), probe("mma_probe<0>")]
    smem = {instances[0]: 100 * 1024, instances[1]: 0}
    monkeypatch.setattr(report.catalog, "instances", lambda target: list(instances))
    monkeypatch.setattr(report.catalog, "dynamic_smem_bytes", lambda instance: smem[instance])
    monkeypatch.setattr(report.catalog, "threads", lambda instance: 128)
    return instances, smem


def test_report_json_rows(shared_cache, probe_catalog, capsys):
    assert report.main(["--arch", "sm_80", "sm_90", "--json", "--jobs", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [tuple(row) for row in rows] == [report.JSON_KEYS] * 4
    by_key = {(row["kernel"], row["arch"]): row for row in rows}
    smem_row = by_key[("static_smem_probe<float, 96>", "sm_90")]
    assert smem_row["static_smem_bytes"] == 384 and smem_row["dynamic_smem_bytes"] == 100 * 1024
    assert smem_row["registers"] > 0 and smem_row["spill_store_bytes"] == 0
    tools = nvrtc.cuda_tool("cuobjdump") is not None and nvrtc.cuda_tool("nvdisasm") is not None
    assert by_key[("mma_probe<0>", "sm_80")]["hmma"] is (True if tools else None)
    assert by_key[("static_smem_probe<float, 96>", "sm_80")]["hmma"] is (False if tools else None)
    if tools:  # the compile workers left their verdicts in the cache
        assert len(list((Path(os.environ["CUFLASH_CACHE_DIR"]) / "nvrtc").glob("*.hmma"))) >= 4


def test_report_fails_on_spills_when_asked(shared_cache, monkeypatch, capsys):
    spilling, clean = probe("register_pressure_probe<64, 32>"), probe("register_pressure_probe<64, 255>")
    monkeypatch.setattr(report.catalog, "dynamic_smem_bytes", lambda instance: 0)
    monkeypatch.setattr(report.catalog, "threads", lambda instance: 64)
    monkeypatch.setattr(report.catalog, "instances", lambda target: [clean])
    assert report.main(["--arch", "sm_80", "--no-spills"]) == 0
    monkeypatch.setattr(report.catalog, "instances", lambda target: [clean, spilling])
    assert report.main(["--arch", "sm_80"]) == 0  # spills are reported, not failed, unless asked
    capsys.readouterr()
    assert report.main(["--arch", "sm_80", "--no-spills"]) == 1
    err = capsys.readouterr().err
    assert "register_pressure_probe<64, 32> spills on sm_80" in err and "register_pressure_probe<64, 255>" not in err


def test_report_table_and_occupancy(shared_cache, probe_catalog, capsys):
    assert report.main(["--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "static_smem_probe<float, 96>" in out and "mma_probe<0>" in out and "blocks/SM" in out
    rows, errors = report.build_report(["sm_80"], jobs=1)
    assert not errors
    smem_row = rows[0]
    # 384 static + 100 KB dynamic + 1 KB reserved per block: one block fits in 164 KB.
    assert smem_row.blocks_per_sm == 1 and smem_row.as_json()["smem_limit_bytes"] == 163 * 1024


def test_occupancy_bounds_of_a_target():
    sm80 = targets.target("sm_80")
    # 255 registers: 8192 per warp after rounding to 256, 4 warps a block: 2 blocks fill the register file.
    assert sm80.blocks_per_sm(threads=128, registers=255, smem_bytes=0) == 2
    # 32 registers: registers allow 16 blocks of 4 warps, and 64 warps per SM allow 16 too.
    assert sm80.blocks_per_sm(threads=128, registers=32, smem_bytes=0) == 16
    assert sm80.blocks_per_sm(threads=32, registers=16, smem_bytes=0) == 32  # the block count caps it
    assert sm80.blocks_per_sm(threads=128, registers=32, smem_bytes=40 * 1024) == 4  # 164 KB // 41 KB
    assert sm80.blocks_per_sm(threads=128, registers=32, smem_bytes=164 * 1024) == 0  # above 163 KB: never
    assert targets.target("sm_86").blocks_per_sm(threads=128, registers=32, smem_bytes=0) == 12  # 48 warps
    with pytest.raises(ValueError, match="unknown GPU arch 'sm_99'"):
        targets.target("sm_99")
    # A device's own opt-in limit wins; an arch newer than the table gets the conservative limits.
    assert targets.for_device(8, 0, 100 * 1024).smem_per_block_bytes == 100 * 1024
    assert targets.for_device(13, 0).smem_per_block_bytes == 99 * 1024


def test_report_fails_on_compile_error_or_oversized_smem(shared_cache, probe_catalog, monkeypatch, capsys):
    instances, smem = probe_catalog
    bad = probe("float_only_probe<double>")
    monkeypatch.setattr(report.catalog, "instances", lambda target: [*instances, bad])
    assert report.main(["--arch", "sm_80", "--json"]) == 1
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)) == 2  # the good rows still print
    assert "float_only_probe<double>" in captured.err and "static assertion failed" in captured.err

    monkeypatch.setattr(report.catalog, "instances", lambda target: list(instances))
    smem[instances[0]] = 200 * 1024  # above sm_80's 163 KB per block, within sm_90's 227 KB
    assert report.main(["--arch", "sm_80"]) == 1
    assert "sm_80 allows 166912" in capsys.readouterr().err
    assert report.main(["--arch", "sm_90"]) == 0


# The real catalog's report (every instance the plans can launch, on sm_80, sm_86, sm_89, sm_90 and sm_120: compiled,
# spill-free, within each arch's shared memory, resident at least once per SM) is CI's own step after the suite:
# `.ci/run` runs `python -m cuflash.kernels report --arch ... --no-spills`, whose exit status the tests above pin
# down on planted rows, under NVRTC 13 and again under NVRTC 12. In the suite it was a cold compile of every
# instance (about 13 CPU-minutes) competing with the other worker's tests, which pushed the suite past its budget.


# ---- loading on a GPU ----------------------------------------------------------------------


class _FakeFunction:
    def __init__(self, name, static_smem_bytes):
        self.name = name
        # What cuFuncGetAttribute reports before any opt-in: 48 KB less the static shared memory.
        self.max_dynamic_shared_size_bytes = 48 * 1024 - static_smem_bytes


def _fake_cupy(device_id, loads, static_smem_bytes):
    class RawModule:
        def __init__(self, *, path):
            self.path = path
            loads.append(path)

        def get_function(self, name):
            return _FakeFunction(name, static_smem_bytes)

    return types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=device_id[0])))


def test_load_function_loads_cached_cubin_and_raises_smem_limit(shared_cache, monkeypatch):
    compiled = nvrtc.compile_instance(probe("static_smem_probe<float, 96>"), "sm_80")
    device, loads = [0], []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(device, loads, compiled.resources.static_smem_bytes))
    monkeypatch.setattr(cupy_gpu, "_loaded", {})

    small = cupy_gpu.load_function(compiled, dynamic_smem_bytes=1024)
    assert loads == [compiled.code_path] and small.name == compiled.lowered_name
    assert small.max_dynamic_shared_size_bytes == 48 * 1024 - 384  # under 48 KB in total: no opt-in needed
    # 384 static + 48 KB - 100 dynamic crosses 48 KB in total: opt in.
    big = cupy_gpu.load_function(compiled, dynamic_smem_bytes=48 * 1024 - 100)
    assert big is small and loads == [compiled.code_path]
    assert big.max_dynamic_shared_size_bytes == 48 * 1024 - 100
    device[0] = 1
    other_device = cupy_gpu.load_function(compiled, dynamic_smem_bytes=0)
    assert other_device is not small and len(loads) == 2


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["cubin", "ptx"])
def test_loaded_code_runs_on_gpu(shared_cache, form):
    """The device's CUBIN, and PTX for sm_80 (the toolchain's fallback form), which the driver compiles at load."""
    import cupy

    arch = "sm_" + cupy.cuda.Device().compute_capability if form == "cubin" else "compute_80"
    compiled = nvrtc.compile_instance(probe("register_pressure_probe<16, 255>"), arch)
    assert compiled.form == form
    kernel = cupy_gpu.load_function(compiled, dynamic_smem_bytes=0)
    threads = 64
    values = np.random.default_rng(0).standard_normal(threads * 16).astype(np.float32)
    output = cupy.zeros(threads, dtype=cupy.float32)
    kernel((1,), (threads,), (cupy.asarray(values), output, np.int32(0)))
    expected = (values.reshape(threads, 16).astype(np.float64) * np.arange(1, 17)).sum(axis=1)
    # float32 accumulation of 16 terms of size up to ~50: absolute error well under 1e-3.
    np.testing.assert_allclose(cupy.asnumpy(output), expected, rtol=1e-5, atol=1e-3)


HOPPER_PROBES = Path(__file__).resolve().parent / "sim" / "kernels" / "hopper_wgmma.cu"


def test_report_fails_on_ptxas_performance_loss_when_asked(shared_cache, monkeypatch, capsys):
    # The wgmma test kernel reads its accumulators before the wait (a planted bug): ptxas serializes its wgmma and
    # says so only in an info line (C7519), with no spill; the setmaxnreg kernel beside it is clean.
    serialized = KernelInstance(str(HOPPER_PROBES), "simwgmma::wgmma_kernel<__half, 64, false>")
    clean = KernelInstance(str(HOPPER_PROBES), "simwgmma::setmaxnreg_kernel")
    monkeypatch.setattr(report.catalog, "dynamic_smem_bytes", lambda instance: 0)
    monkeypatch.setattr(report.catalog, "threads", lambda instance: 384)
    monkeypatch.setattr(report.catalog, "instances", lambda target: [clean])
    assert report.main(["--arch", "sm_90a", "--no-spills", "--no-perf-loss"]) == 0
    monkeypatch.setattr(report.catalog, "instances", lambda target: [clean, serialized])
    capsys.readouterr()
    assert report.main(["--arch", "sm_90a", "--no-spills"]) == 0  # printed as a warning unless asked
    out = capsys.readouterr().out
    assert "warning: simwgmma::wgmma_kernel<__half, 64, false> (sm_90a): ptxas info" in out and "(C7519)" in out
    assert report.main(["--arch", "sm_90a", "--no-perf-loss", "--json"]) == 1
    captured = capsys.readouterr()
    rows = {row["kernel"]: row for row in json.loads(captured.out)}
    assert rows["simwgmma::wgmma_kernel<__half, 64, false>"]["performance_losses"] == ["C7519"]
    assert rows["simwgmma::setmaxnreg_kernel"]["performance_losses"] == []
    assert "error: simwgmma::wgmma_kernel<__half, 64, false> (sm_90a): ptxas reports a performance loss" in captured.err
    assert "setmaxnreg_kernel" not in captured.err
