"""Building simulator libraries: generated launcher TUs + the runtime, compiled by g++.

A library holds a set of KernelInstances for one checking mode. Instances are
grouped by source file (one translation unit per file, so a header-heavy kernel
file is parsed once), the TUs compile in parallel, and one ``.so`` is linked
with the runtime object (itself cached per mode).

Cache (cuflash._build_cache, ``cache_dir("sim")``): a library's key covers the mode, flags, compiler
version, instance list, the runtime library it links, and the text of exactly the files its translation units
include (so editing an FFI header or another family's kernel rebuilds nothing here). The runtime library of a
mode is an entry of its own, beside the kernel libraries (they find it through $ORIGIN).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .._build_cache import BuildCache, compiler, compiler_identity, content_key, write_atomically
from .._paths import CUDA_SRC, cache_dir
from ..kernels.program import KernelInstance

MODES = ("normal", "race", "asan", "profile")

SIM_DIR = CUDA_SRC / "arch" / "sim"
RUNTIME_SOURCES = ("sim_runtime.cpp", "sim_race.cpp", "sim_mbarrier.cpp", "sim_wgmma.cpp", "sim_tma.cpp",
                   "sim_profile.cpp", "fiber_switch_x86_64.S")
# What the generated launcher table includes (beside the kernel sources, the rest of a library's input).
TABLE_INCLUDES = ("arch/sim/sim_abi.h", "common/attention_params.cuh")
# Bump when the generated translation units, or how a library or the runtime is linked, change.
_LIBRARY_TAG = "sim-library-4"
_RUNTIME_TAG = "sim-runtime-3"

_CACHE = BuildCache("sim")

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


def extra_flags() -> tuple[str, ...]:
    """$CUFLASH_SIM_CXXFLAGS: extra flags for kernel TUs (e.g. "-O0 -g" to debug a kernel)."""
    return tuple(shlex.split(os.environ.get("CUFLASH_SIM_CXXFLAGS", "")))


def _sorted_instances(instances: Iterable[KernelInstance]) -> list[KernelInstance]:
    instances = sorted(set(instances), key=lambda i: (str(i.source_path), i.name_expr))
    for inst in instances:
        if not inst.source_path.is_file():
            raise BuildError(f"kernel source {inst.source_path} not found (instance {inst.name_expr})")
    return instances


def _runtime_entry(mode: str) -> str:
    _, runtime_flags, link_flags = _MODE_FLAGS[mode]
    key = content_key(_RUNTIME_TAG, toolchain=compiler_identity(compiler()),
                      options=[*_COMMON_FLAGS, *runtime_flags, *link_flags],
                      sources=[SIM_DIR / name for name in RUNTIME_SOURCES], include_dirs=[CUDA_SRC], extra=[mode])
    return f"libcuflash_sim_runtime-{mode}-{key}"


def library_key(mode: str, instances: Iterable[KernelInstance]) -> str:
    kernel_flags, _, link_flags = _MODE_FLAGS[mode]
    instances = _sorted_instances(instances)
    return content_key(
        _LIBRARY_TAG,
        toolchain=compiler_identity(compiler()),
        options=[*_COMMON_FLAGS, *_KERNEL_FLAGS, *kernel_flags, *extra_flags(), *link_flags],
        sources=[*(inst.source_path for inst in instances), *(CUDA_SRC / name for name in TABLE_INCLUDES)],
        include_dirs=[CUDA_SRC],
        # The runtime's entry names the library this one links (and loads by that name).
        extra=[mode, _runtime_entry(mode), *(f"{inst.source_path} {inst.name_expr}" for inst in instances)],
    )


def _library_entry(mode: str, instances: Iterable[KernelInstance]) -> str:
    return f"lib-{mode}-{library_key(mode, instances)}"


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
    # What the preprocessed text depends on: the source, everything it includes, the preprocessor.
    key = content_key("sim-launch-bounds", toolchain=compiler_identity(compiler()), options=[], sources=[source],
                      include_dirs=[CUDA_SRC])
    with _launch_bounds_lock:
        found = _launch_bounds_found.get(key)
    if found is None:
        found = _read_launch_bounds(source)
        with _launch_bounds_lock:
            _launch_bounds_found[key] = found
    return found


_launch_bounds_found: dict[str, dict[str, LaunchBound]] = {}
_launch_bounds_lock = threading.Lock()


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
        *(f'#include "{name}"' for name in TABLE_INCLUDES),
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
        "  static char text[16384];",
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
    entry = _runtime_entry(mode)
    library = f"{entry}.so"

    def build(workdir: Path) -> None:
        objects = []
        for name in RUNTIME_SOURCES:
            obj = workdir / (name + ".o")
            _compile(SIM_DIR / name, obj, runtime_flags, f"runtime {name}, mode {mode}")
            objects.append(str(obj))
        _run([compiler(), *_COMMON_FLAGS, "-shared", f"-Wl,-soname,{library}", "-o", str(workdir / library),
              *objects, *link_flags], f"link {library}")

    return _CACHE.get(entry, [library], build).paths[0]


def alias_path(mode: str, inst: KernelInstance) -> Path:
    """Points a single instance at the combined library precompile() built for it (holds its file name)."""
    return cache_dir("sim") / f"alias-{mode}-{library_key(mode, [inst])}.txt"


def build_library(mode: str, instances: Sequence[KernelInstance]) -> Path:
    """Build (or find in the cache) the library of `instances` for `mode`."""
    if mode not in MODES:
        raise ValueError(f"unknown simulator mode {mode!r}; expected one of {MODES}")
    instances = _sorted_instances(instances)
    entry = _library_entry(mode, instances)
    library = f"{entry}.so"
    return _CACHE.get(entry, [library], lambda workdir: _build_into(mode, instances, workdir, library)).paths[0]


def _build_into(mode: str, instances: Sequence[KernelInstance], workdir: Path, library: str) -> None:
    kernel_flags, _, link_flags = _MODE_FLAGS[mode]
    jobs: list[tuple[Path, Path, tuple[str, ...], str]] = []
    for i, (source, group) in enumerate(sorted(group_by_source(instances).items())):
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
    _run(
        [compiler(), *_COMMON_FLAGS, "-shared", "-o", str(workdir / library), *[str(j[1]) for j in jobs],
         str(runtime), "-Wl,-rpath,$ORIGIN", *link_flags],
        f"link {library}",
    )


def write_alias(mode: str, inst: KernelInstance, library: Path) -> None:
    write_atomically(alias_path(mode, inst), library.name.encode())


def find_library(mode: str, inst: KernelInstance) -> Path | None:
    """A cached library holding `inst` (its own, or a precompiled group's), if any."""
    own = _CACHE.lookup(_library_entry(mode, [inst]))
    if own is not None:
        return own.paths[0]
    try:
        library = alias_path(mode, inst).read_text().strip()
    except OSError:
        return None
    group = _CACHE.lookup(Path(library).stem)  # a library's file name is its entry's name + ".so"
    return group.paths[0] if group is not None else None


def clean_cache() -> None:
    """Remove every cached simulator build (tests and users rarely need this)."""
    shutil.rmtree(cache_dir("sim"), ignore_errors=True)


def group_by_source(instances: Iterable[KernelInstance]) -> dict[Path, list[KernelInstance]]:
    groups: dict[Path, list[KernelInstance]] = {}
    for inst in instances:
        groups.setdefault(inst.source_path, []).append(inst)
    return groups
