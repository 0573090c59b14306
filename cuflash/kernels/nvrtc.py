"""The NVRTC compile pipeline: kernel instance + GPU arch -> cached CUBIN and its resource usage.

Everything here runs without a GPU or a CUDA driver. NVRTC is driven through
NVIDIA's ``cuda-core`` (``Program``/``ProgramOptions``), which compiles to CUBIN
for an explicit arch without asking for a device; ``cuda-bindings`` reads the
program log, and ``cuda-pathfinder`` finds the CUDA headers and the SASS tools
(the nvidia-cuda-* wheels first, then conda and CUDA_PATH). The CuPy backend
loads the very CUBIN bytes this module cached, so what a GPU runs is exactly
what CI compiled and measured.

Resource numbers (registers, spills, stack, static shared memory) come only from
the ptxas report NVRTC writes into the program log with ``--ptxas-options=-v``.

Two forms of code: a CUBIN for a real architecture (arch=sm_XX: NVRTC runs ptxas,
which writes the resource report), what CI compiles, measures and every GPU NVRTC
knows runs; and PTX for a virtual one (arch=compute_XX), the fallback
kernels.toolchain picks for a GPU newer than the installed NVRTC, which the driver
compiles when it loads it (no ptxas, so no resource report).

Options and why:
  arch=sm_XX       a real architecture, so NVRTC runs ptxas and can emit a CUBIN
                   and the ptxas report (compute_XX stops at PTX).
  std=c++17        the language level the simulator's g++ build shares.
  ptxas -v         the resource report parsed below.
  lineinfo         source lines in the CUBIN for profilers; it does not change code.
  NDEBUG           release build, as on the simulator side.
  no device_as_default_execution_space: an unannotated function stays host-only,
                   as under nvcc, so a kernel calling a helper that lacks
                   __device__ fails here instead of compiling only for NVRTC.
  no use_fast_math: kernels choose their approximations explicitly through the
                   arch layer; everything else keeps IEEE semantics.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .._build_cache import BuildCache, Entry, content_key, write_atomically
from .._paths import CUDA_SRC
from .program import KernelInstance

# Bump when what a cache entry holds, or how code is compiled, changes (PTX entries differ by their options).
CACHE_TAG = "nvrtc-cubin-3"


class NvrtcError(RuntimeError):
    """NVRTC or the CUDA headers are missing, or an NVRTC call failed outside compilation itself."""


class CompileError(RuntimeError):
    """NVRTC rejected one kernel instance for one arch; carries the full program log."""

    def __init__(self, instance: KernelInstance, arch: str, log: str):
        # The same positional args as the constructor, so it pickles (process pools, pytest-xdist).
        super().__init__(instance, arch, log)
        self.instance = instance
        self.arch = arch
        self.log = log

    def __str__(self) -> str:
        return (
            f"NVRTC failed to compile {self.instance.name_expr} from {self.instance.source} for {self.arch}:\n"
            f"{self.log.rstrip()}"
        )


class PtxasReportError(RuntimeError):
    """The program log lacks the ptxas resource lines for a compiled function."""


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one entry function (numbers copied from the log)."""

    registers: int
    barriers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_smem_bytes: int


# ptxas's C75xx advisories about wgmma and setmaxnreg ("Potential Performance Loss", "... is injected ...").
_PERFORMANCE_LOSS_RE = re.compile(r"\(C75\d\d\)")


@dataclass(frozen=True)
class CompiledKernel:
    instance: KernelInstance
    arch: str  # "sm_80" (code is a CUBIN) or "compute_80" (code is NUL-terminated PTX text)
    code: bytes  # exactly what the driver loads (cuModuleLoad / cuModuleLoadData take either form)
    lowered_name: str
    log: str
    resources: Resources | None  # ptxas's report; None for PTX, which ptxas has not seen
    code_path: str  # the cache file holding exactly these bytes (what the CuPy backend loads)
    compile_seconds: float  # NVRTC wall time when this entry was built (not the cache lookup)

    @property
    def form(self) -> str:
        return code_form(self.arch)

    @property
    def warnings(self) -> list[str]:
        """Compiler warnings in the log (ptxas info lines excluded)."""
        return [line for line in self.log.splitlines() if re.search(r"\bwarning\b", line, re.IGNORECASE)]

    @property
    def performance_losses(self) -> list[str]:
        """ptxas's advisories that the code it made runs slower than the source asks (info lines, so no warning):
        wgmma serialized (C7509-C7520: a divergent path, registers read early, too few registers for the pipeline),
        waits or warpgroup.arrive it injected, setmaxnreg ignored (C7508). Each line once, in the log's order."""
        return list(dict.fromkeys(line.strip() for line in self.log.splitlines() if _PERFORMANCE_LOSS_RE.search(line)))


# ---------------------------------------------------------------------------
# NVRTC through cuda-core.


def code_form(arch: str) -> str:
    """"cubin" for a real architecture (sm_80, sm_90a), "ptx" for a virtual one (compute_80)."""
    if re.fullmatch(r"sm_\d+[af]?", arch):
        return "cubin"
    if re.fullmatch(r"compute_\d+[af]?", arch):
        return "ptx"
    raise ValueError(f"arch must be a real architecture like 'sm_80' or a virtual one like 'compute_80', got {arch!r}")


def cuda_wheels(major: int) -> tuple[str, str]:
    """The pip wheels of NVRTC and of the CUDA headers of a CUDA major version."""
    suffix = "-cu12" if major == 12 else ""
    return f"nvidia-cuda-nvrtc{suffix}", f"nvidia-cuda-runtime{suffix}"


def find_cuda_include_dir() -> Path | None:
    """Where cuda.h, cuda_fp16.h and cuda_bf16.h live, as cuda-pathfinder finds the CUDA runtime's headers
    (the nvidia-cuda-runtime wheel of CUDA 12 or 13, conda, CUDA_PATH); None when there are none."""
    from cuda import pathfinder

    found = pathfinder.find_nvidia_header_directory("cudart")
    return Path(found) if found else None


def cuda_headers_version(include_dir: Path) -> tuple[int, int]:
    """(major, minor) of the CUDA headers in include_dir, from cuda.h's CUDA_VERSION (12090 is 12.9)."""
    match = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", (include_dir / "cuda.h").read_text(errors="replace"), re.M)
    if match is None:
        raise NvrtcError(f"{include_dir / 'cuda.h'} does not define CUDA_VERSION")
    return int(match[1]) // 1000, int(match[1]) % 1000 // 10


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> Path:
    """The CUDA headers NVRTC compiles with: found by cuda-pathfinder and of NVRTC's own major version
    (cuda_fp16.h of another CUDA major need not match what that NVRTC understands)."""
    found = find_cuda_include_dir()
    major = nvrtc_version()[0]
    headers_wheel = cuda_wheels(major)[1]
    if found is None:
        raise NvrtcError(
            f"CUDA headers (cuda_fp16.h) not found: install the {headers_wheel} wheel (pip install "
            f"'{headers_wheel}>={major}' for NVRTC {major}) or point CUDA_PATH at a CUDA {major} toolkit"
        )
    headers = cuda_headers_version(found)
    if headers[0] != major:
        raise NvrtcError(
            f"the CUDA headers at {found} are CUDA {headers[0]}.{headers[1]} but NVRTC is "
            f"{major}.{nvrtc_version()[1]}: install the headers of CUDA {major} (pip install '{headers_wheel}') "
            f"or NVRTC {headers[0]} ({cuda_wheels(headers[0])[0]})"
        )
    return found.resolve()


def _check(result, call: str) -> None:
    from cuda.bindings import nvrtc as nvrtc_api

    if result != nvrtc_api.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"{call} failed: {result.name}")


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc as nvrtc_api

        result, major, minor = nvrtc_api.nvrtcVersion()
    except (ImportError, RuntimeError) as err:  # pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise NvrtcError(
            f"cannot load NVRTC ({err}): install cuflash's extra for your driver's CUDA major version, "
            "pip install 'cuflash[cuda13]' or 'cuflash[cuda12]' (nvidia-smi shows it as 'CUDA Version')"
        ) from err
    _check(result, "nvrtcVersion")
    return major, minor


@functools.lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    """The real architectures this NVRTC compiles for, as numbers (80 is sm_80, 120 is sm_120), ascending."""
    from cuda.bindings import nvrtc as nvrtc_api

    nvrtc_version()  # a clear error when NVRTC is missing
    result, archs = nvrtc_api.nvrtcGetSupportedArchs()
    _check(result, "nvrtcGetSupportedArchs")
    return tuple(sorted(int(arch) for arch in archs))


# Programs this process has handed to NVRTC (cache hits do not count).
_nvrtc_compiles = 0


def nvrtc_compile_count() -> int:
    """How many programs this process has handed to NVRTC (tests use it to prove cache hits)."""
    return _nvrtc_compiles


def _program_log(program) -> str:
    """The program log, read from NVRTC itself: cuda.core passes it on only after a successful compile,
    and puts a failed one's into its exception's message."""
    from cuda.bindings import nvrtc as nvrtc_api

    result, size = nvrtc_api.nvrtcGetProgramLogSize(program.handle)
    _check(result, "nvrtcGetProgramLogSize")
    buffer = b" " * size
    (result,) = nvrtc_api.nvrtcGetProgramLog(program.handle, buffer)
    _check(result, "nvrtcGetProgramLog")
    return buffer.rstrip(b"\0").decode("utf-8", errors="replace")


def _compile_program(source: str, options, name_expr: str):
    """cuda.core compiles one program to CUBIN: returns (ObjectCode, or None when NVRTC failed; the log; the
    failure's text).

    Returns instead of raising so that no traceback keeps the Program alive: cuda.core 1.2's
    Program.__dealloc__ fails (an "Exception ignored" warning) when the garbage collector frees
    it out of a reference cycle, which an exception held by its caller easily makes.
    """
    from cuda.core import Program

    program = Program(source, "c++", options)
    try:
        try:
            object_code = program.compile("cubin", name_expressions=(name_expr,))
        except Exception as failure:  # cuda.core's NVRTCError is not public; every failure here is NVRTC's
            return None, _program_log(program), str(failure)
        return object_code, _program_log(program), ""
    finally:
        program.close()


def _compile_ptx(source: str, options, name_expr: str) -> tuple[bytes | None, str, str]:
    """NVRTC compiles one program to PTX through cuda-bindings: returns (NUL-terminated PTX or None when NVRTC
    failed, the lowered name, the log).

    Not through cuda.core: its compile("ptx") asks the driver whether it could load the result, so it cannot
    run on a machine without one, where CI checks this fallback. The options are cuda.core's own spelling.
    """
    from cuda.bindings import nvrtc as nvrtc_api

    result, program = nvrtc_api.nvrtcCreateProgram(source.encode(), options.name.encode(), 0, [], [])
    _check(result, "nvrtcCreateProgram")
    try:
        _check(nvrtc_api.nvrtcAddNameExpression(program, name_expr.encode())[0], "nvrtcAddNameExpression")
        flags = options.as_bytes("nvrtc", "ptx")
        (compiled,) = nvrtc_api.nvrtcCompileProgram(program, len(flags), flags)
        result, size = nvrtc_api.nvrtcGetProgramLogSize(program)
        _check(result, "nvrtcGetProgramLogSize")
        buffer = b" " * size
        _check(nvrtc_api.nvrtcGetProgramLog(program, buffer)[0], "nvrtcGetProgramLog")
        log = buffer.rstrip(b"\0").decode("utf-8", errors="replace")
        if compiled != nvrtc_api.nvrtcResult.NVRTC_SUCCESS:
            return None, "", log or compiled.name
        result, lowered = nvrtc_api.nvrtcGetLoweredName(program, name_expr.encode())
        _check(result, "nvrtcGetLoweredName")
        result, size = nvrtc_api.nvrtcGetPTXSize(program)
        _check(result, "nvrtcGetPTXSize")
        ptx = b" " * size
        _check(nvrtc_api.nvrtcGetPTX(program, ptx)[0], "nvrtcGetPTX")
        return ptx.rstrip(b"\0") + b"\0", lowered.decode(), log
    finally:
        nvrtc_api.nvrtcDestroyProgram(program)


def _run_nvrtc(instance: KernelInstance, arch: str, include_dirs: Sequence[Path]) -> tuple[bytes, str, str]:
    """One NVRTC program for one instance: returns (CUBIN or PTX, lowered name, log) or raises CompileError."""
    global _nvrtc_compiles
    source_path = instance.source_path.resolve()
    # The absolute path as the program name: NVRTC then resolves quoted includes
    # relative to the source file's own folder (as nvcc does) and diagnostics
    # name the real file.
    options = program_options(arch, include_dirs, name=str(source_path))
    source = source_path.read_text(encoding="utf-8")
    _nvrtc_compiles += 1
    if code_form(arch) == "ptx":
        ptx, lowered_name, log = _compile_ptx(source, options, instance.name_expr)
        if ptx is None:
            raise CompileError(instance, arch, log)
        return ptx, lowered_name, log
    object_code, log, failure = _compile_program(source, options, instance.name_expr)
    if object_code is None:
        raise CompileError(instance, arch, log if log.strip() else failure)
    return bytes(object_code.code), object_code.symbol_mapping[instance.name_expr].decode(), log


# ---------------------------------------------------------------------------
# The ptxas report.

_ENTRY_RE = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>[^']+)'")
_PROPERTIES_RE = re.compile(r"Function properties for (?P<name>\S+)")
_FRAME_RE = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
_USED_RE = re.compile(r"Used (?P<registers>\d+) registers")
_BARRIERS_RE = re.compile(r"used (?P<barriers>\d+) barriers")
_SMEM_RE = re.compile(r"(?P<smem>\d+) bytes smem")


def parse_resources(log: str, lowered_name: str, arch: str) -> Resources:
    """Resources of entry function ``lowered_name`` from an ``-Xptxas=-v`` program log.

    ptxas writes, per entry function:
        Compiling entry function '<name>' for 'sm_80'
        Function properties for <name>
            N bytes stack frame, N bytes spill stores, N bytes spill loads
        Used N registers, used N barriers[, N bytes smem][, ...]
    It leaves out "bytes smem" when the function has no static shared memory,
    so that one field alone may be absent (meaning 0); every other line must be there.
    """
    lines = log.splitlines()
    start = None
    for index, line in enumerate(lines):
        match = _ENTRY_RE.search(line)
        if match and match["name"] == lowered_name:
            if match["arch"] != arch:
                raise PtxasReportError(f"ptxas compiled {lowered_name} for {match['arch']}, expected {arch}")
            start = index
            break
    if start is None:
        raise PtxasReportError(f"no ptxas report for entry function {lowered_name} in the log:\n{log}")
    end = next((i for i in range(start + 1, len(lines)) if _ENTRY_RE.search(lines[i])), len(lines))
    section = lines[start:end]

    frame = None
    for index, line in enumerate(section):
        match = _PROPERTIES_RE.search(line)
        if match and match["name"] == lowered_name and index + 1 < len(section):
            frame = _FRAME_RE.search(section[index + 1])
            break
    used_line = next((line for line in section if _USED_RE.search(line)), None)
    if frame is None or used_line is None:
        raise PtxasReportError(f"incomplete ptxas report for {lowered_name}:\n" + "\n".join(section))
    barriers = _BARRIERS_RE.search(used_line)
    smem = _SMEM_RE.search(used_line)
    return Resources(
        registers=int(_USED_RE.search(used_line)["registers"]),
        barriers=int(barriers["barriers"]) if barriers else 0,
        stack_frame_bytes=int(frame["stack"]),
        spill_store_bytes=int(frame["stores"]),
        spill_load_bytes=int(frame["loads"]),
        static_smem_bytes=int(smem["smem"]) if smem else 0,
    )


# ---------------------------------------------------------------------------
# The disk cache (cuflash._build_cache): entry <key> is <key>.cubin or <key>.ptx plus its manifest
# <key>.json, which keeps the compile's record (lowered name, log, resources).

_CUBINS = BuildCache("nvrtc")


def program_options(arch: str, include_dirs: Sequence[Path], name: str | None = None):
    """cuda.core's ProgramOptions for one arch (see the module docstring for each choice)."""
    from cuda.core import ProgramOptions

    ptxas = "-v" if code_form(arch) == "cubin" else None  # PTX never reaches ptxas here
    return ProgramOptions(name=name, arch=arch, std="c++17", ptxas_options=ptxas, lineinfo=True,
                          define_macro="NDEBUG", include_path=[str(d) for d in include_dirs])


def compile_options(arch: str, include_dirs: Sequence[Path]) -> list[str]:
    """The NVRTC command line cuda.core makes of program_options: what the cache key and the manifest record,
    so a cuda-core release that spells the options differently also makes new entries."""
    return [option.decode() for option in program_options(arch, include_dirs).as_bytes("nvrtc", code_form(arch))]


def _include_dirs() -> list[Path]:
    return [CUDA_SRC.resolve(), cuda_include_dir()]


def cache_key(instance: KernelInstance, arch: str) -> str:
    """Hash of everything that decides the CUBIN: the text of every file the source can
    include (CUDA's headers among them), the instance, the options (the arch among them)
    and NVRTC's version.

    Only the files the source can reach count, so editing one kernel family does
    not invalidate the others' entries.
    """
    include_dirs = _include_dirs()
    return content_key(CACHE_TAG, toolchain=f"nvrtc {nvrtc_version()}", options=compile_options(arch, include_dirs),
                       sources=[instance.source_path.resolve()], include_dirs=include_dirs,
                       extra=[instance.name_expr])


def _code_file(key: str, arch: str) -> str:
    return f"{key}.{code_form(arch)}"


def _compile_into(workdir: Path, key: str, instance: KernelInstance, arch: str) -> dict:
    """NVRTC into workdir/<key>.cubin (or .ptx); returns the record the manifest keeps."""
    include_dirs = _include_dirs()
    started = time.perf_counter()
    code, lowered_name, log = _run_nvrtc(instance, arch, include_dirs)
    seconds = time.perf_counter() - started
    resources = parse_resources(log, lowered_name, arch) if code_form(arch) == "cubin" else None
    (workdir / _code_file(key, arch)).write_bytes(code)
    return {
        "instance": {"source": instance.source, "name_expr": instance.name_expr},
        "arch": arch,
        "options": compile_options(arch, include_dirs),
        "lowered_name": lowered_name,
        "log": log,
        "resources": asdict(resources) if resources else None,
        "compile_seconds": seconds,
    }


def _compiled_kernel(instance: KernelInstance, arch: str, entry: Entry) -> CompiledKernel:
    record = entry.details
    return CompiledKernel(
        instance=instance,
        arch=arch,
        code=entry.paths[0].read_bytes(),
        lowered_name=record["lowered_name"],
        log=record["log"],
        resources=Resources(**record["resources"]) if record["resources"] else None,
        code_path=str(entry.paths[0]),
        compile_seconds=record["compile_seconds"],
    )


def compile_instance(instance: KernelInstance, arch: str) -> CompiledKernel:
    """Compile one kernel instance for one arch, through the disk cache: a CUBIN for sm_XX, PTX for compute_XX.

    Safe when several processes ask for the same entry at once: one compiles
    under the entry's lock; the others wait and then read it.
    """
    key = cache_key(instance, arch)
    entry = _CUBINS.get(key, [_code_file(key, arch)], lambda workdir: _compile_into(workdir, key, instance, arch))
    return _compiled_kernel(instance, arch, entry)


def _compile_or_error(task: tuple[KernelInstance, str]) -> CompiledKernel | CompileError:
    try:
        return compile_instance(*task)
    except CompileError as err:
        return err


def compile_many(
    instances: Iterable[KernelInstance],
    archs: Iterable[str],
    jobs: int | None = None,
    *,
    return_errors: bool = False,
    check_sass: bool = False,
) -> list[CompiledKernel | CompileError]:
    """Compile every (instance, arch) pair, instance-major, in ``jobs`` processes (default 2).

    Results come back in input order. A CompileError is raised (the first one,
    after all pairs were tried) unless return_errors, which puts it in its slot.
    check_sass: the workers also run uses_hmma, so its verdicts are cached
    (the report wants them; disassembly costs as much as compiling).

    Workers are separate ``python -m cuflash.kernels.nvrtc`` processes fed one
    task at a time (so a long kernel does not hold up a fixed share of the
    list); they fill the disk cache, and this process then reads every entry
    back from it. Not multiprocessing: its spawn mode re-runs the caller's
    __main__ (breaking scripts without a main guard or read from stdin) and
    fork is unsafe once a parent has threads (JAX). A crash inside NVRTC takes
    down one worker, reported with the task it was on.
    """
    archs = list(archs)
    tasks = [(instance, arch) for instance in instances for arch in archs]
    jobs = 2 if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    failures: dict[int, str] = {}
    if jobs > 1:
        # Only what the cache lacks goes to the workers.
        missing = [index for index, task in enumerate(tasks) if not _is_cached(*task, check_sass)]
        if len(missing) > 1:
            found = _compile_in_workers([tasks[i] for i in missing], min(jobs, len(missing)), check_sass)
            failures = {missing[i]: log for i, log in found.items()}
    results: list[CompiledKernel | CompileError] = []
    for index, task in enumerate(tasks):
        if index in failures:
            results.append(CompileError(task[0], task[1], failures[index]))
        else:
            results.append(_compile_or_error(task))  # a cache hit after the workers
    if not return_errors:
        for result in results:
            if isinstance(result, CompileError):
                raise result
    return results


def _is_cached(instance: KernelInstance, arch: str, with_sass: bool) -> bool:
    try:
        entry = _CUBINS.lookup(cache_key(instance, arch))
    except OSError:
        return False  # e.g. a missing source: let a worker report it
    if entry is None or not with_sass:
        return entry is not None
    verdict = _beside_entry(_compiled_kernel(instance, arch, entry), "hmma")
    return verdict is not None and verdict.exists()


def _worker_environment() -> dict[str, str]:
    # The worker must import this very package, wherever the caller found it.
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def _compile_in_workers(tasks: list[tuple[KernelInstance, str]], workers: int, check_sass: bool) -> dict[int, str]:
    """Fill the cache for every task in worker processes; returns {task index: NVRTC log} of failures."""
    pending = list(enumerate(tasks))
    pending_lock = threading.Lock()
    failures: dict[int, str] = {}
    problems: list[str] = []

    def drive(process: subprocess.Popen) -> None:
        while True:
            with pending_lock:
                if not pending or problems:
                    return
                index, (instance, arch) = pending.pop(0)
            request = {"source": instance.source, "name_expr": instance.name_expr, "arch": arch, "sass": check_sass}
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                line = process.stdout.readline()
            except BrokenPipeError:
                line = ""
            if not line:
                problems.append(f"compile worker died while compiling {instance.name_expr} for {arch}")
                return
            reply = json.loads(line)
            if reply.get("compile_error") is not None:
                failures[index] = reply["compile_error"]
            elif not reply.get("ok"):
                problems.append(f"compile worker failed on {instance.name_expr} for {arch}:\n{reply['error']}")
                return

    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "cuflash.kernels.nvrtc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_worker_environment(),
        )
        for _ in range(workers)
    ]
    try:
        threads = [threading.Thread(target=drive, args=(process,)) for process in processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for process in processes:
            if process.stdin and not process.stdin.closed:
                try:
                    process.stdin.close()  # end of tasks: the worker exits
                except BrokenPipeError:
                    pass
            process.wait()
    if problems:
        raise RuntimeError("\n".join(problems))
    return failures


def _worker_main() -> None:
    """Compile tasks read as JSON lines on stdin; answer one JSON line per task."""
    import traceback

    # Only replies go to the real stdout; anything else printed lands on stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        task = json.loads(line)
        try:
            compiled = compile_instance(KernelInstance(task["source"], task["name_expr"]), task["arch"])
            if task["sass"]:
                uses_hmma(compiled)
            reply = {"ok": True}
        except CompileError as err:
            reply = {"ok": False, "compile_error": err.log}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# ---------------------------------------------------------------------------
# SASS inspection.


def cuda_tool(name: str) -> Path | None:
    """cuobjdump or nvdisasm as cuda-pathfinder finds it (the nvidia-cuda-* wheels, conda, CUDA_PATH), else None."""
    from cuda import pathfinder

    found = pathfinder.find_nvidia_binary_utility(name)
    return Path(found) if found else None


class SassError(RuntimeError):
    """cuobjdump ran but did not produce SASS for the function."""


@contextlib.contextmanager
def _cubin_file(compiled: CompiledKernel):
    """A file holding the compiled function's cubin for the disassemblers: its cache entry where that still holds
    these bytes, else a scratch copy. SassError for a PTX-only compile (no SASS yet)."""
    if compiled.form != "cubin":
        raise SassError(f"{compiled.lowered_name} was compiled to PTX for {compiled.arch}: it has no SASS yet")
    cubin_file = Path(compiled.code_path)
    if cubin_file.exists() and cubin_file.read_bytes() == compiled.code:
        yield cubin_file
        return
    with tempfile.TemporaryDirectory() as scratch:
        cubin_file = Path(scratch) / "kernel.cubin"
        cubin_file.write_bytes(compiled.code)
        yield cubin_file


def dump_sass(compiled: CompiledKernel) -> str | None:
    """SASS of the compiled function, or None when cuobjdump or nvdisasm is not installed."""
    cuobjdump = cuda_tool("cuobjdump")
    nvdisasm = cuda_tool("nvdisasm")  # cuobjdump 13 runs it for --dump-sass
    if cuobjdump is None or nvdisasm is None:
        return None
    with _cubin_file(compiled) as cubin_file:
        environment = dict(os.environ, NVDISASM_PATH=str(nvdisasm.parent))
        run = subprocess.run(
            [str(cuobjdump), "--dump-sass", "--function", compiled.lowered_name, str(cubin_file)],
            capture_output=True,
            text=True,
            env=environment,
        )
    # cuobjdump exits 0 with only a warning when the function is absent: insist on its header.
    if run.returncode != 0 or f"Function : {compiled.lowered_name}" not in run.stdout:
        raise SassError(
            f"cuobjdump gave no SASS for {compiled.lowered_name} ({compiled.arch}); exit {run.returncode}\n"
            f"{run.stderr}{run.stdout}"
        )
    return run.stdout


_LINE_MARK = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_SASS_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]+)\*/")


def dump_line_table(compiled: CompiledKernel) -> dict[int, tuple[str, int]] | None:
    """The source line of each SASS instruction of the compiled function: {address: (source path, line)} from the
    line information cuflash compiles in (lineinfo; nvdisasm -g prints it, the innermost line of inlined code), or
    None when nvdisasm is not installed. Addresses are cuobjdump's (dump_sass). A fact about the cached bytes, kept
    beside the cache entry like the HMMA verdict: nvdisasm -g takes seconds on a large kernel, and the loop census
    asks for every instance's table from the tests, the report and the loop command."""
    table_file = _beside_entry(compiled, "lines.json")
    if table_file is not None:
        try:
            return {int(address): (source, line) for address, (source, line) in json.loads(table_file.read_text())}
        except (OSError, ValueError, TypeError):
            pass
    nvdisasm = cuda_tool("nvdisasm")
    if nvdisasm is None:
        return None
    with _cubin_file(compiled) as cubin_file:
        run = subprocess.run([str(nvdisasm), "-g", "-c", str(cubin_file)], capture_output=True, text=True)
    if run.returncode != 0 or f".text.{compiled.lowered_name}" not in run.stdout:
        raise SassError(f"nvdisasm gave no line table for {compiled.lowered_name} ({compiled.arch}); exit "
                        f"{run.returncode}\n{run.stderr}")
    table: dict[int, tuple[str, int]] = {}
    where = None
    for text in run.stdout.splitlines():
        if text.startswith("//----") or text.lstrip().startswith(".section"):
            where = None  # a new section: its instructions carry their own marks
        mark = _LINE_MARK.match(text)
        if mark:
            where = (mark.group(1), int(mark.group(2)))
            continue
        address = _SASS_ADDRESS.match(text)
        if address and where is not None:
            table[int(address.group(1), 16)] = where
    if table_file is not None:
        write_atomically(table_file, json.dumps(sorted(table.items())).encode())
    return table


# An opcode column entry: HMMA, optionally with modifiers (HMMA.16816.F32.BF16).
# HFMA2.MMA (a plain FMA on the MMA pipe) must not match.
_HMMA_RE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?HMMA\b", re.MULTILINE)


def _beside_entry(compiled: CompiledKernel, kind: str) -> Path | None:
    """Where a fact about a cache entry's bytes (``kind``: "hmma", "lines.json") is kept, or None if the entry no
    longer holds these bytes."""
    cubin_file = Path(compiled.code_path)
    try:
        if cubin_file.read_bytes() != compiled.code:
            return None
    except OSError:
        return None
    function_tag = hashlib.sha256(compiled.lowered_name.encode()).hexdigest()[:12]
    return cubin_file.with_name(f"{cubin_file.stem}.{function_tag}.{kind}")


def uses_hmma(compiled: CompiledKernel) -> bool | None:
    """True if the function's SASS has a tensor-core HMMA, False if not, None without cuobjdump/nvdisasm.

    Disassembling a large kernel takes nvdisasm about half a second, so the
    verdict (a fact about the cached bytes, whichever tool version found it) is
    kept beside the cache entry and reused.
    """
    verdict_file = _beside_entry(compiled, "hmma")
    if verdict_file is not None:
        try:
            return {"1": True, "0": False}[verdict_file.read_text()]
        except (OSError, KeyError):
            pass
    sass = dump_sass(compiled)
    if sass is None:
        return None
    verdict = bool(_HMMA_RE.search(sass))
    if verdict_file is not None:
        write_atomically(verdict_file, b"1" if verdict else b"0")
    return verdict


_HGMMA_RE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?HGMMA\b", re.MULTILINE)
# setmaxnreg as ptxas writes it: the producer's decrease, the consumers' increase (its count in hex).
_SETMAXNREG_RE = re.compile(r"\bUSETMAXREG\.(DEALLOC|TRY_ALLOC)\.CTAPOOL (?:UP\d+, )?(0x[0-9a-f]+)\b")


def warpgroup_facts(compiled: CompiledKernel) -> dict | None:
    """What the SASS of arch-specific Hopper code (sm_90a) says about its warpgroup instructions: {"hgmma": whether
    it issues a wgmma, "setmaxnreg": {"dealloc": [counts], "alloc": [counts]}} (the registers per thread each
    setmaxnreg leaves, distinct, ascending). None without cuobjdump/nvdisasm. Kept beside the cache entry as the
    HMMA verdict is."""
    facts_file = _beside_entry(compiled, "warpgroup.json")
    if facts_file is not None:
        try:
            return json.loads(facts_file.read_text())
        except (OSError, ValueError):
            pass
    sass = dump_sass(compiled)
    if sass is None:
        return None
    counts = {"dealloc": set(), "alloc": set()}
    for way, count in _SETMAXNREG_RE.findall(sass):
        counts["dealloc" if way == "DEALLOC" else "alloc"].add(int(count, 16))
    facts = {"hgmma": bool(_HGMMA_RE.search(sass)), "setmaxnreg": {k: sorted(v) for k, v in counts.items()}}
    if facts_file is not None:
        write_atomically(facts_file, json.dumps(facts).encode())
    return facts


if __name__ == "__main__":
    _worker_main()
