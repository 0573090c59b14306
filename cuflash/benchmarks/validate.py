"""``validate-gpu``: the one command a maintainer runs on a GPU machine before a release.

Steps, each written to DIR and summarized in DIR/summary.md and DIR/summary.json:

0. the code the device gets (kernels/toolchain.py): the driver's CUDA version, NVRTC's, and
   whether the device runs its CUBIN or the PTX fallback (a failure names what to install);
1. the gpu-marked tests of the repository (``tests/``, when cuflash runs from a checkout);
2. compute-sanitizer's memcheck, racecheck, synccheck and initcheck over
   gpu_workloads' sanitizer grid (every family and variant, small ragged shapes);
3. a short speed sweep against the peers (speed.py), with its table, JSON, CSV and plots;
4. Nsight Compute metrics of the fa2 kernels at gpu_workloads.NCU_SHAPE (tensor pipe
   utilization, shared-memory bank conflicts, DRAM bytes, achieved occupancy) beside the
   simulator's counts for the same launches (global bytes, shared-memory wavefronts).

``first-gpu`` runs it restricted (``--skip tests speed --sanitizer-tools memcheck
racecheck --sanitizer-grid tensor-core --step-timeout S``): its own steps run the
tests and the sweep, and the whole must fit in its time budget.

A missing tool (compute-sanitizer, ncu) or a missing test folder is a note, not a
failure. It installs nothing and exits non-zero when a step fails. Without a GPU
it refuses before writing anything.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
NCU_METRICS = {
    "tensor_pipe_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "shared_ld_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "shared_st_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "shared_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "global_ld_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "global_st_bytes": "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
SPEED_SWEEP = dict(headdims=(64, 128), seqlens=(1024, 4096), causals=(False, True), dtypes=("float16",))
STEP_TIMEOUT_S = {"tests": 240, "sanitizer": 150, "ncu": 180}


def _run(cmd: list[str], log: Path, timeout: int) -> tuple[int, str]:
    """Run cmd, log its output to ``log``; rc 124 on timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        text = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        text, rc = text + f"\n(timed out after {timeout} s)", 124
    log.write_text(f"$ {' '.join(cmd)}\n{text}")
    return rc, text


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        candidate = Path(root) / "bin" / name
        if root and candidate.exists():
            return str(candidate)
    return None


def step_toolchain(out: Path) -> dict:
    from ..kernels.toolchain import ToolchainError
    from .speed import toolchain_line

    try:
        return {"status": "pass", "detail": toolchain_line()}
    except ToolchainError as err:
        return {"status": "fail", "detail": str(err)}


def step_tests(out: Path) -> dict:
    import cuflash

    tests = Path(cuflash.__file__).resolve().parents[1] / "tests"
    if not tests.is_dir():
        return {"status": "note", "detail": "no tests/ folder beside the package (installed without the repository)"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", str(tests)]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", "4"]
    except ImportError:
        pass
    rc, text = _run(cmd, out / "gpu_tests.txt", STEP_TIMEOUT_S["tests"])
    summary = next((line for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)),
                   "no pytest summary line")
    return {"status": "pass" if rc == 0 else "fail", "detail": summary.strip("= ")}


def _sanitizer_verdict(tool: str, rc: int, text: str) -> tuple[bool, str]:
    cases = len(re.findall(r"^case .*: ran$", text, re.M))
    if tool == "racecheck":
        m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
        errors = int(m.group(2)) + int(m.group(3)) if m else None
        shown = m.group(0) if m else "no summary"
    else:
        m = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
        errors = int(m.group(1)) if m else None
        shown = m.group(0) if m else "no summary"
    ok = rc == 0 and errors == 0
    return ok, f"{shown}; {cases} cases ran; exit {rc}"


# What ``main``'s options narrow: the sanitizer's tools and grid ("all", "tensor-core" or "flex", gpu_workloads.py).
OPTIONS = {"sanitizer_tools": SANITIZER_TOOLS, "sanitizer_grid": "all"}


def step_sanitizer(out: Path) -> dict:
    sanitizer = _tool("compute-sanitizer")
    if sanitizer is None:
        return {"status": "note", "detail": "compute-sanitizer not found: skipped"}
    results = {}
    for tool in OPTIONS["sanitizer_tools"]:
        # API errors are not counted: on an H200 memcheck's 34 "errors" were all cuGetProcAddress probes of NVIDIA's
        # Python driver bindings returning CUDA_ERROR_INVALID_VALUE, none the kernels' (0 with this flag).
        cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99", "--print-limit", "20",
               sys.executable, "-m", "cuflash.benchmarks.gpu_workloads", "sanitizer", OPTIONS["sanitizer_grid"]]
        rc, text = _run(cmd, out / f"sanitizer_{tool}.txt", STEP_TIMEOUT_S["sanitizer"])
        ok, detail = _sanitizer_verdict(tool, rc, text)
        results[tool] = {"status": "pass" if ok else "fail", "detail": detail}
    status = "pass" if all(r["status"] == "pass" for r in results.values()) else "fail"
    return {"status": status, "detail": "; ".join(f"{t}: {r['detail']}" for t, r in results.items()), "tools": results}


def step_speed(out: Path) -> dict:
    from . import peers, speed
    from .workloads import fa2_sweep

    result = speed.sweep_on_gpu(peers.all_systems(), fa2_sweep(**SPEED_SWEEP), warmup=2, repeats=5)
    speed.write_outputs(result, out)
    failed = [c for c in result.checks if not c.passed and c.system.startswith("cuflash-")]
    detail = f"{len(result.measurements)} timings, {len(result.skipped)} skipped; table in speed.txt"
    return {"status": "fail" if failed else "pass", "detail": detail + "".join(f"; {c.system} failed its check"
                                                                              for c in failed)}


def ncu_raw_rows(text: str) -> list[dict[str, str]]:
    """Rows of ``ncu --csv --page raw`` (its log may hold other lines): one dict per kernel, column to text."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = rows[0], rows[2:]  # rows[1] holds the units
    return [dict(zip(header, row)) for row in body]


def parse_ncu_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw``: one dict per profiled kernel, metric names to numbers."""
    kernels = []
    for record in ncu_raw_rows(text):
        entry = {"kernel": record.get("Kernel Name", "?")}
        for short, metric in NCU_METRICS.items():
            value = record.get(metric, "").replace(",", "")
            try:
                entry[short] = float(value)
            except ValueError:
                entry[short] = None
        kernels.append(entry)
    return kernels


def step_ncu(out: Path) -> dict:
    from . import gpu_workloads

    ncu = _tool("ncu")
    if ncu is None:
        return {"status": "note", "detail": "ncu not found: skipped"}
    log = out / "ncu.csv"
    cmd = [ncu, "--csv", "--page", "raw", "--metrics", ",".join(NCU_METRICS.values()), "--kernel-name", "regex:fa2",
           "--log-file", str(log), sys.executable, "-m", "cuflash.benchmarks.gpu_workloads", "ncu"]
    rc, text = _run(cmd, out / "ncu_stdout.txt", STEP_TIMEOUT_S["ncu"])
    kernels = parse_ncu_csv(log.read_text()) if log.exists() else []
    simulated = gpu_workloads.simulator_counts()
    (out / "ncu_vs_simulator.json").write_text(json.dumps({"shape": gpu_workloads.NCU_SHAPE, "ncu": kernels,
                                                           "simulator": simulated}, indent=1))
    if rc != 0 or not kernels:
        return {"status": "fail", "detail": f"ncu exit {rc}, {len(kernels)} kernels parsed (see ncu_stdout.txt)"}
    return {"status": "pass", "detail": f"{len(kernels)} fa2 launches profiled", "ncu": kernels,
            "simulator": simulated}


def _ncu_table(ncu: list[dict], simulated: list[dict]) -> list[str]:
    lines = ["| kernel | tensor pipe % | occupancy % | smem bank conflicts (ld+st) | smem wavefronts | sim smem "
             "wavefronts (excess) | global ld+st bytes (L1) | sim global bytes | DRAM bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
    for i, k in enumerate(ncu):
        sim = simulated[i] if i < len(simulated) else {}
        conflicts = (k["shared_ld_bank_conflicts"] or 0) + (k["shared_st_bank_conflicts"] or 0)
        global_bytes = (k["global_ld_bytes"] or 0) + (k["global_st_bytes"] or 0)
        dram = (k["dram_read_bytes"] or 0) + (k["dram_write_bytes"] or 0)
        sim_bytes = sim.get("global_bytes_read", 0) + sim.get("global_bytes_written", 0)
        lines.append(f"| {k['kernel'][:40]} | {fmt(k['tensor_pipe_pct'])} | {fmt(k['achieved_occupancy_pct'])} | "
                     f"{fmt(conflicts)} | {fmt(k['shared_wavefronts'])} | {fmt(sim.get('shared_wavefronts'))} "
                     f"({fmt(sim.get('shared_excess_wavefronts'))}) | {fmt(global_bytes)} | {fmt(sim_bytes)} | "
                     f"{fmt(dram)} |")
    return lines


def write_summary(out: Path, steps: dict[str, dict], seconds: float) -> Path:
    lines = [f"# cuflash validate-gpu ({seconds:.0f} s)", ""]
    for name, step in steps.items():
        lines.append(f"- **{name}**: {step['status']}: {step['detail']}")
    speed_table = out / "speed.txt"
    if speed_table.exists():
        lines += ["", "## Speed (TFLOP/s)", "", "```", speed_table.read_text().rstrip(), "```"]
    ncu = steps.get("ncu", {})
    if ncu.get("ncu"):
        lines += ["", f"## Nsight Compute beside the simulator (fa2 at {ncu.get('shape', '')})".replace(" at )", ")"),
                  ""] + _ncu_table(ncu["ncu"], ncu.get("simulator", []))
        lines.append("\nThe simulator counts bytes the threads request and wavefronts per access; ncu's L1 bytes count "
                     "32-byte sectors and DRAM bytes only what misses L2.")
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"seconds": seconds, "steps": steps}, indent=1, default=str))
    return path


STEPS = {"toolchain": step_toolchain, "tests": step_tests, "sanitizer": step_sanitizer, "speed": step_speed,
         "ncu": step_ncu}


def main(out: Path, skip: set[str] = frozenset(), sanitizer_tools=SANITIZER_TOOLS, sanitizer_grid: str = "all",
         step_timeout: int | None = None) -> int:
    from .timing import cupy_or_refuse

    cupy_or_refuse()  # NoGpuError before anything is written
    OPTIONS.update(sanitizer_tools=tuple(sanitizer_tools), sanitizer_grid=sanitizer_grid)
    if step_timeout is not None:
        STEP_TIMEOUT_S.update({k: step_timeout for k in STEP_TIMEOUT_S})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    steps = {}
    for name, step in STEPS.items():
        if name in skip:
            steps[name] = {"status": "note", "detail": "skipped (--skip)"}
            continue
        print(f"validate-gpu: {name} ...", flush=True)
        try:
            steps[name] = step(out)
        except Exception as err:  # one broken step must not hide the others' results
            steps[name] = {"status": "fail", "detail": f"{type(err).__name__}: {err}".splitlines()[0]}
        print(f"validate-gpu: {name}: {steps[name]['status']}: {steps[name]['detail']}", flush=True)
    path = write_summary(out, steps, time.monotonic() - start)
    print(f"wrote {path}")
    return 1 if any(s["status"] == "fail" for s in steps.values()) else 0
