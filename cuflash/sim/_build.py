"""Building simulator libraries: generated launcher TUs + the runtime, compiled by g++.

A library holds a set of KernelInstances for one checking mode. Instances are
grouped by source file (one translation unit per file, so a header-heavy kernel
file is parsed once), the TUs compile in parallel, and one ``.so`` is linked
with the runtime object (itself cached per mode).

Cache (``cache_dir("sim")``): file names carry a hash of everything that can
change the binary: mode, flags, compiler version, the instance list, the text of
every header/runtime source under cuda_src/ and of the kernel files. Builds go
to a private temporary directory and are moved into place with ``os.replace``
under an ``fcntl.flock`` lock, so concurrent processes (pytest-xdist) neither
see half-written files nor build the same thing twice.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .._paths import CUDA_SRC, cache_dir
from ..kernels.program import KernelInstance

MODES = ("normal", "race", "asan", "profile")

SIM_DIR = CUDA_SRC / "arch" / "sim"
RUNTIME_SOURCES = ("sim_runtime.cpp", "sim_race.cpp", "sim_profile.cpp", "fiber_switch_x86_64.S")
HEADER_SUFFIXES = (".cuh", ".h", ".cpp", ".hpp", ".S")

_COMMON_FLAGS = ("-std=c++20", "-O2", "-mf16c", "-fPIC", "-fvisibility=hidden", "-pthread")
# Kernel TUs only: every automatic variable starts as a repeated 0xFE byte pattern (a NaN-like
# float, a huge integer) instead of whatever the fiber stack held (usually 0), so a forgotten
# accumulator reset gives garbage here as it does on a GPU.
_KERNEL_FLAGS = ("-ftrivial-auto-var-init=pattern",)


def _host_has_fma() -> bool:
    try:
        return re.search(r"^flags\s*:.*\bfma\b", Path("/proc/cpuinfo").read_text(), re.M) is not None
    except OSError:
        return False


# Kernel TUs contract a * b + c into one fused multiply-add, as NVRTC does by default (--fmad=true), so
# rounding matches a GPU's. Hosts without FMA (pre-Haswell x86) keep separate roundings: the README says so.
# -fno-exceptions: device code has none, and a call that may throw ends a basic block, which would stop
# GCC fusing a product with a sum across a global load (every arch::load is a call in the simulator).
_FMA_FLAGS = ("-mfma", "-ffp-contract=fast") if _host_has_fma() else ("-ffp-contract=fast",)
_KERNEL_FLAGS += _FMA_FLAGS + ("-fno-exceptions",)

# Per mode: flags for kernel TUs, flags for the (uninstrumented in race mode) runtime, link flags.
_MODE_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "normal": ((), (), ("-Wl,-z,defs",)),
    # Kernel TUs are instrumented; the __tsan_* hooks are ours (sim_race.cpp), so
    # no libtsan is linked and -z defs catches a hook we do not provide. Without scalar
    # replacement of aggregates a float4 / float2 access stays one 16- / 8-byte access
    # (instead of four 4-byte ones), so the hooks can check its natural alignment.
    "race": (("-fsanitize=thread", "-fno-tree-sra", "-DCUFLASH_SIM_RACE=1"), ("-DCUFLASH_SIM_RACE=1",),
             ("-Wl,-z,defs",)),
    # The same instrumentation as race mode, counted by sim_profile.cpp's hooks instead; -g1 gives
    # the line tables that turn a hook's return address into file:line.
    "profile": (("-fsanitize=thread", "-fno-tree-sra", "-g1", "-DCUFLASH_SIM_PROFILE=1"), ("-DCUFLASH_SIM_PROFILE=1",),
                ("-Wl,-z,defs", "-ldl")),
    "asan": (
        ("-fsanitize=address", "-fsanitize-recover=address", "-fno-omit-frame-pointer", "-g"),
        ("-fsanitize=address", "-fsanitize-recover=address", "-fno-omit-frame-pointer", "-g"),
        ("-fsanitize=address",),
    ),
}


class BuildError(RuntimeError):
    """g++ rejected a simulator translation unit (the message holds its diagnostics)."""


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def extra_flags() -> tuple[str, ...]:
    """$CUFLASH_SIM_CXXFLAGS: extra flags for kernel TUs (e.g. "-O0 -g" to debug a kernel)."""
    return tuple(shlex.split(os.environ.get("CUFLASH_SIM_CXXFLAGS", "")))


@functools.lru_cache(maxsize=None)
def compiler_identity(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0] if out else cxx


# ---- source hashing ---------------------------------------------------------------------

_hash_lock = threading.Lock()
_file_hashes: dict[Path, tuple[tuple[int, int], str]] = {}


def _file_hash(path: Path) -> str:
    st = path.stat()
    signature = (st.st_mtime_ns, st.st_size)
    with _hash_lock:
        cached = _file_hashes.get(path)
        if cached and cached[0] == signature:
            return cached[1]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with _hash_lock:
        _file_hashes[path] = (signature, digest)
    return digest


def _tree_hash(root: Path) -> str:
    """Hash of every header and runtime source under root (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in HEADER_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(_file_hash(path).encode())
    return h.hexdigest()


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def library_key(mode: str, instances: Sequence[KernelInstance]) -> str:
    cxx = compiler()
    kernel_flags, runtime_flags, link_flags = _MODE_FLAGS[mode]
    parts = [
        "cuflash-sim-lib-v3",
        mode,
        compiler_identity(cxx),
        " ".join(_COMMON_FLAGS + _KERNEL_FLAGS + kernel_flags + extra_flags() + runtime_flags + link_flags),
        _tree_hash(CUDA_SRC),
    ]
    for inst in sorted(set(instances), key=lambda i: (str(i.source_path), i.name_expr)):
        if not inst.source_path.is_file():
            raise BuildError(f"kernel source {inst.source_path} not found (instance {inst.name_expr})")
        parts += [str(inst.source_path), _file_hash(inst.source_path), inst.name_expr]
    return _key(*parts)


# ---- locking and atomic placement -------------------------------------------------------


@contextlib.contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"simulator build failed ({what}):\n$ {shlex.join(cmd)}\n{proc.stderr[-20000:]}")


def _compile(source: Path, output: Path, flags: Sequence[str], what: str) -> None:
    _run([compiler(), *_COMMON_FLAGS, *flags, f"-I{CUDA_SRC}", "-c", str(source), "-o", str(output)], what)


# ---- generated translation units -----------------------------------------------------------


def _launcher_symbol(inst: KernelInstance) -> str:
    return "cuflash_sim_launch_" + hashlib.sha256(f"{inst.source_path}\0{inst.name_expr}".encode()).hexdigest()[:16]


# ---- __launch_bounds__ ---------------------------------------------------------------------
# g++ cannot read an attribute back, so the build reads each kernel's bound from the source: a
# preprocessing pass (macro-generated kernels included) in which cuda_sim.h turns __launch_bounds__
# into a marker, then a helper with the kernel's own template head evaluates the first argument for
# each instance (so "Warps * 32" or "Traits::kThreads" mean what they mean to nvcc).

_BOUNDS_MARK = "__cuflash_launch_bounds__"


@dataclass(frozen=True)
class LaunchBound:
    kernel: str  # the kernel's unqualified name
    template_head: str  # "template <class T, int Warps>", or "" for a plain function
    max_threads: str  # the first __launch_bounds__ argument, as written


def _balanced_end(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise BuildError(f"unbalanced {open_}{close} in the preprocessed kernel source")


def _template_head_before(text: str, end: int) -> str:
    """The `template <...>` that ends at text[:end] (after whitespace), or ""."""
    i = len(text[:end].rstrip())
    if i == 0 or text[i - 1] != ">":
        return ""
    depth = 0
    for j in range(i - 1, -1, -1):
        if text[j] == ">":
            depth += 1
        elif text[j] == "<":
            depth -= 1
            if depth == 0:
                head = re.search(r"\btemplate\s*$", text[:j])
                if head is None:
                    raise BuildError(f"cannot read the template head before {text[j:i][:80]!r}")
                return "template " + text[j:i]
    raise BuildError("unbalanced <> before a __launch_bounds__ kernel")


def _split_top_level(args: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in args:
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def parse_launch_bounds(preprocessed: str) -> dict[str, LaunchBound]:
    """Every `void <marker>(args) name(` in a preprocessed source, by kernel name."""
    bounds: dict[str, LaunchBound] = {}
    for match in re.finditer(r"\b" + _BOUNDS_MARK + r"\s*\(", preprocessed):
        args_end = _balanced_end(preprocessed, match.end() - 1, "(", ")")
        args = preprocessed[match.end():args_end - 1]
        name = re.match(r"\s*(\w+)\s*\(", preprocessed[args_end:])
        before = re.search(r"\bvoid\s*$", preprocessed[:match.start()])
        if name is None or before is None:
            context = preprocessed[max(0, match.start() - 60):args_end + 60]
            raise BuildError(f"write kernels as `__global__ void __launch_bounds__(...) name(`; found {context!r}")
        bound = LaunchBound(name.group(1), _template_head_before(preprocessed, before.start()),
                            _split_top_level(args)[0])
        if bounds.get(bound.kernel, bound) != bound:
            raise BuildError(f"two kernels named {bound.kernel} with different __launch_bounds__")
        bounds[bound.kernel] = bound
    return bounds


def launch_bounds(source: Path) -> dict[str, LaunchBound]:
    """The __launch_bounds__ of every kernel `source` defines (or includes), by kernel name."""
    key = (source, _file_hash(source), _tree_hash(CUDA_SRC))  # what the preprocessed text depends on
    with _hash_lock:
        found = _launch_bounds_found.get(key)
    if found is None:
        found = _read_launch_bounds(source)
        with _hash_lock:
            _launch_bounds_found[key] = found
    return found


_launch_bounds_found: dict[tuple[Path, str, str], dict[str, LaunchBound]] = {}


def _read_launch_bounds(source: Path) -> dict[str, LaunchBound]:
    cmd = [compiler(), "-x", "c++", "-std=c++20", "-E", "-P", "-DCUFLASH_SIM_LAUNCH_BOUNDS_PROBE=1", f"-I{CUDA_SRC}",
           str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"simulator build failed (preprocessing {source.name}):\n$ {shlex.join(cmd)}\n"
                         f"{proc.stderr[-20000:]}")
    return parse_launch_bounds(proc.stdout)


def _split_name_expr(name_expr: str) -> tuple[list[str], str, str]:
    """"ns::kernel<args>" -> (["ns"], "kernel", "<args>")."""
    cut = name_expr.find("<")
    path, targs = (name_expr, "") if cut < 0 else (name_expr[:cut], name_expr[cut:])
    *namespaces, kernel = path.strip().lstrip(":").split("::")
    return [n.strip() for n in namespaces], kernel.strip(), targs


def _bound_helper(bound: LaunchBound) -> str:
    return (f"{bound.template_head} constexpr long long cuflash_sim_max_threads_{bound.kernel}() "
            f"{{ return static_cast<long long>({bound.max_threads}); }}")


def _kernel_tu(source: Path, instances: Sequence[KernelInstance]) -> str:
    bounds = launch_bounds(source)
    lines = [
        f"// Generated by cuflash.sim: launchers for {source.name}.",
        f'#include "{source}"',
        "",
    ]
    helpers_done = set()
    for inst in instances:
        namespaces, kernel, targs = _split_name_expr(inst.name_expr)
        bound = bounds.get(kernel)
        if bound is not None and (tuple(namespaces), kernel) not in helpers_done:
            helpers_done.add((tuple(namespaces), kernel))
            opening = " ".join(f"namespace {n} {{" for n in namespaces)
            lines += [f"{opening} {_bound_helper(bound)} {'}' * len(namespaces)}", ""]
        qualified = "".join(f"::{n}" for n in namespaces) + f"::cuflash_sim_max_threads_{kernel}{targs}()"
        max_threads = qualified if bound is not None else "1024"
        lines += [
            f"// {inst.name_expr}",
            f'extern "C" __attribute__((visibility("hidden"))) int {_launcher_symbol(inst)}(',
            "    cuflash_sim_launch_request* request) {",
            f"  return ::cuflash::sim::launch_kernel(&{inst.name_expr}, request, {max_threads});",
            "}",
            "",
        ]
    return "\n".join(lines)


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table_tu(instances: Sequence[KernelInstance]) -> str:
    lines = [
        "// Generated by cuflash.sim: name -> launcher table and the AttentionParams layout probe.",
        "#include <cstddef>",
        "#include <cstdio>",
        "#include <cstring>",
        '#include "arch/sim/sim_abi.h"',
        '#include "common/attention_params.cuh"',
        "",
    ]
    for inst in instances:
        lines.append(f'extern "C" int {_launcher_symbol(inst)}(cuflash_sim_launch_request*);')
    lines += [
        "",
        'extern "C" __attribute__((visibility("default"))) int cuflash_sim_launch(',
        "    const char* name_expr, cuflash_sim_launch_request* request) {",
    ]
    for inst in instances:
        lines.append(
            f"  if (std::strcmp(name_expr, {_c_string(inst.name_expr)}) == 0) return {_launcher_symbol(inst)}(request);"
        )
    lines += [
        '  std::snprintf(request->error, sizeof request->error, "kernel %s is not in this simulator library", name_expr);',
        "  return 1;",
        "}",
        "",
        'extern "C" __attribute__((visibility("default"))) const char* cuflash_sim_params_layout(void) {',
        "  static char text[8192];",
        "  if (text[0] == 0) {",
        "    int n = 0;",
        "    using P = cuflash::AttentionParams;",
    ]
    for path, _ in attention_params_fields():
        expr = f"((P*)nullptr)->{path}"
        lines.append(
            f'    n += std::snprintf(text + n, sizeof text - n, "%s %zu %zu\\n", {_c_string(path)}, '
            f"(size_t)__builtin_offsetof(P, {path}), sizeof({expr}));"
        )
    lines += [
        '    std::snprintf(text + n, sizeof text - n, "sizeof %zu\\n", sizeof(P));',
        "  }",
        "  return text;",
        "}",
        "",
    ]
    return "\n".join(lines)


def attention_params_fields() -> list[tuple[str, str]]:
    """Leaf fields of cuflash::AttentionParams as (C path, C type), as the header declares them
    (cuflash.kernels.params reads it); nested TensorStrides appear as "q_stride.batch"."""
    from ..kernels.params import header_fields

    return header_fields()[0]


# ---- building ------------------------------------------------------------------------------


def _runtime_library(mode: str) -> Path:
    """The runtime library of a mode (fibers, scheduler, checks), from the cache or freshly built.

    One shared library per mode, so a process has one fiber-stack arena and one set
    of fault handlers however many kernel libraries it loads (each committed stack
    costs two memory mappings, and vm.max_map_count is finite).
    """
    _, runtime_flags, link_flags = _MODE_FLAGS[mode]
    cache = cache_dir("sim")
    key = _key("cuflash-sim-runtime-v2", mode, compiler_identity(compiler()),
               " ".join(_COMMON_FLAGS + runtime_flags + link_flags), _tree_hash(CUDA_SRC))
    target = cache / f"libcuflash_sim_runtime-{mode}-{key}.so"
    if target.exists():
        return target
    with _locked(cache / f"runtime-{mode}-{key}.lock"):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=cache, prefix="build-runtime-") as tmp:
            workdir = Path(tmp)
            objects = []
            for name in RUNTIME_SOURCES:
                obj = workdir / (Path(name).name + ".o")
                _compile(SIM_DIR / name, obj, runtime_flags, f"runtime {name}, mode {mode}")
                objects.append(str(obj))
            tmp_lib = workdir / target.name
            _run([compiler(), *_COMMON_FLAGS, "-shared", f"-Wl,-soname,{target.name}", "-o", str(tmp_lib), *objects,
                  *link_flags], f"link {target.name}")
            os.replace(tmp_lib, target)
    return target


def library_path(mode: str, instances: Sequence[KernelInstance]) -> Path:
    return cache_dir("sim") / f"lib-{mode}-{library_key(mode, instances)}.so"


def alias_path(mode: str, inst: KernelInstance) -> Path:
    """Points a single instance at the combined library precompile() built for it."""
    return cache_dir("sim") / f"alias-{mode}-{library_key(mode, [inst])}.txt"


def build_library(mode: str, instances: Sequence[KernelInstance]) -> Path:
    """Build (or find in the cache) the library of `instances` for `mode`."""
    if mode not in MODES:
        raise ValueError(f"unknown simulator mode {mode!r}; expected one of {MODES}")
    instances = sorted(set(instances), key=lambda i: (str(i.source_path), i.name_expr))
    target = library_path(mode, instances)
    if target.exists():
        return target
    cache = cache_dir("sim")
    with _locked(cache / (target.stem + ".lock")):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as tmp:
            workdir = Path(tmp)
            _build_into(mode, instances, workdir, target)
    return target


def _build_into(mode: str, instances: Sequence[KernelInstance], workdir: Path, target: Path) -> None:
    kernel_flags, _, link_flags = _MODE_FLAGS[mode]
    groups: dict[Path, list[KernelInstance]] = {}
    for inst in instances:
        if not inst.source_path.is_file():
            raise BuildError(f"kernel source {inst.source_path} not found (instance {inst.name_expr})")
        groups.setdefault(inst.source_path, []).append(inst)

    jobs: list[tuple[Path, Path, tuple[str, ...], str]] = []
    for i, (source, group) in enumerate(sorted(groups.items())):
        tu = workdir / f"kernels_{i}_{source.stem}.cpp"
        tu.write_text(_kernel_tu(source, group))
        jobs.append((tu, tu.with_suffix(".o"), _KERNEL_FLAGS + kernel_flags + extra_flags(),
                     f"{source.name} [{', '.join(g.name_expr for g in group)}]"))
    table = workdir / "table.cpp"
    table.write_text(_table_tu(instances))
    jobs.append((table, table.with_suffix(".o"), (), "launcher table"))

    workers = max(1, min(len(jobs) + 1, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        runtime_future = pool.submit(_runtime_library, mode)
        futures = [pool.submit(_compile, src, obj, flags, what) for src, obj, flags, what in jobs]
        for future in futures:
            future.result()
        runtime = runtime_future.result()

    # The runtime sits beside the kernel library in the cache: found through $ORIGIN.
    tmp_lib = workdir / target.name
    _run(
        [compiler(), *_COMMON_FLAGS, "-shared", "-o", str(tmp_lib), *[str(j[1]) for j in jobs], str(runtime),
         "-Wl,-rpath,$ORIGIN", *link_flags],
        f"link {target.name}",
    )
    os.replace(tmp_lib, target)


def write_alias(mode: str, inst: KernelInstance, library: Path) -> None:
    alias = alias_path(mode, inst)
    tmp = alias.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(library.name)
    os.replace(tmp, alias)


def find_library(mode: str, inst: KernelInstance) -> Path | None:
    """A cached library holding `inst` (its own, or a precompiled group's), if any."""
    own = library_path(mode, [inst])
    if own.exists():
        return own
    alias = alias_path(mode, inst)
    if alias.exists():
        candidate = alias.parent / alias.read_text().strip()
        if candidate.exists():
            return candidate
    return None


def clean_cache() -> None:
    """Remove every cached simulator build (tests and users rarely need this)."""
    shutil.rmtree(cache_dir("sim"), ignore_errors=True)


def group_by_source(instances: Iterable[KernelInstance]) -> dict[Path, list[KernelInstance]]:
    groups: dict[Path, list[KernelInstance]] = {}
    for inst in instances:
        groups.setdefault(inst.source_path, []).append(inst)
    return groups
