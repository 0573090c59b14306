"""``first-gpu --out DIR``: the first command on a new GPU machine, every check and figure within 9 minutes.

Steps, in this order, each a subprocess with its own time budget (``STEPS``) whose outcome is recorded
(pass, fail, timeout, skipped) before the next one runs whatever happened:

1. ``toolchain``: ``python3 -m cuflash.kernels toolchain`` (NVRTC, headers, driver, the code the GPU gets);
2. ``smoke``: one small forward and backward of the kernels every later step runs, each launch synchronized and
   watched (gpu_workloads.LaunchWatch): a kernel that hangs is named, and every later step is skipped, since each
   would wait on the same kernel until its time ran out (the first run of the wgmma backward lost all of them so);
3. ``tests``: the gpu-marked tests, with a JUnit XML parsed into pass/fail/skip counts and the failures' names;
4. ``validate``: ``validate-gpu`` narrowed to what the other steps do not cover: compute-sanitizer memcheck and
   racecheck on one tensor-core forward and backward, and Nsight Compute beside the simulator;
5. ``speed``: the sweep against every peer found (head dim 128, bfloat16 and float16, causal and not,
   seqlen 4k to 16k, forward, backward, forward+backward), and cuflash's flex variants (document mask, prefix-LM,
   relative bias) at the same points, within the step's time: shortest seqlens first, a point expected to overrun
   is skipped and listed (speed.Budget);
6. ``splitkv``: ``python3 -m cuflash.benchmarks splitkv``: short-query, long-key forwards (decode steps) with
   num_splits 1, 0 (the heuristic) and a fixed count, each checked against the unsplit call, and PyTorch flash
   beside them (splitkv.py), after the speed step so that their kernels are compiled;
7. ``ncu``: Nsight Compute's tensor-pipe utilization and warp stall reasons (WarpStateStats,
   ComputeWorkloadAnalysis) of the d128 forward and backward tensor-core kernels;
8. ``host``: ``python3 -m cuflash.benchmarks host`` (host microseconds per call).

A step may use the time earlier steps left unused, never the time reserved for the steps after it
(``step_timeout``). Then ``write_summary``, a pure function of the recorded steps, writes DIR/summary.md,
DIR/summary.json and DIR/summary.png (the first two after every step as well, marked partial: a run cut short, as
a lent machine's time limit may cut it, leaves the summary of the steps it finished); each step's own files and log
are in DIR/<step>/. Without a GPU the command refuses before creating DIR. Everything here but ``main``'s
subprocesses is tested with fakes (tests/test_first_gpu.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TOTAL_S = 540  # 9 minutes on an H100 with a cold compile cache
SUMMARY_RESERVE_S = 10  # the summary and its plot, after the last step
# Issue 31's targets (d128, seqlen >= 4k, both 16-bit dtypes) first: a cold compile cache leaves the sweep about
# 100 s of GPU time, which a d64-to-16k sweep spent on short seqlens before it reached them.
SPEED_SETTING = dict(headdims=(128,), dtypes=("bfloat16", "float16"),
                     seqlens=(4096, 8192, 16384), flex=("document", "prefix-lm", "relative-bias"))
# The FA2 sweep's peers, and cuflash's fa2 (its other algorithms are the README's, not the peers' rivals).
SPEED_SYSTEMS = ("cuflash-fa2", "cupy-standard", "jax-xla", "jax-cudnn", "torch-flash", "torch-cudnn")
SPEED_OUTPUT_S = 40  # what the speed subprocess needs after its sweep: start-up, writing JSON and plots
SPLITKV_OUTPUT_S = 10  # what the splitkv subprocess needs besides its shapes: start-up (CuPy, PyTorch) and output
NCU_KERNELS = "regex:(fa2_tc|fa3)_(forward|backward)_kernel"  # fa3 on sm_90 16-bit
HOST_PROFILE_CALLS = 500  # warm decode calls host.py profiles (profile.txt)
HOST_PROFILE_LINES = 20  # of which the summary shows the first
NCU_SECTIONS = ("WarpStateStats", "ComputeWorkloadAnalysis")
TENSOR_PIPE_METRIC = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
STALL_PATTERN = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    what: str


STEPS = (
    Step("toolchain", 20, "python3 -m cuflash.kernels toolchain"),
    # smoke's budget holds a cold compile of its kernels (the Hopper forward and backward: about a minute of NVRTC),
    # which every later step then finds in the cache
    Step("smoke", 70, "one small forward and backward (the wgmma kernels on sm_90), every launch watched for a hang"),
    Step("tests", 110, "gpu-marked tests"),
    Step("validate", 80, "validate-gpu: compute-sanitizer memcheck + racecheck (tensor-core forward and backward), "
                         "Nsight Compute beside the simulator"),
    # 35 s of the speed sweep's time (the sweep's d128 points, the issue's target, come first); a split forward runs
    # the sweep's d128 forward kernel (compiled there by then) and a small combine kernel
    Step("speed", 135, "the speed sweep against every peer found"),
    Step("splitkv", 35, "split-KV decode: num_splits 1, 0 (heuristic) and a fixed count, short queries over long keys"),
    Step("ncu", 50, "Nsight Compute: tensor pipe and stall reasons, d128 tensor-core forward and backward"),
    Step("host", 30, "host microseconds per call"),
)
HANG_PATTERN = re.compile(r"^smoke: HANG: (.+)$", re.MULTILINE)


def step_timeout(steps: tuple[Step, ...], index: int, elapsed_s: float, total_s: float = TOTAL_S) -> float:
    """Seconds step ``index`` may run: its budget plus whatever earlier steps left, less nothing reserved for later."""
    reserved = sum(s.budget_s for s in steps[index + 1:]) + SUMMARY_RESERVE_S
    return max(0.0, total_s - elapsed_s - reserved)


def _tool(name: str) -> str | None:
    from .validate import _tool as find

    return find(name)


def commands(out: Path, timeout_s: float, python: str = sys.executable) -> dict[str, list[str] | str]:
    """Each step's command line for a timeout of ``timeout_s``, or a string saying why the step cannot run."""
    import cuflash

    bench = [python, "-m", "cuflash.benchmarks"]
    tests = Path(cuflash.__file__).resolve().parents[1] / "tests"
    result: dict[str, list[str] | str] = {"toolchain": [python, "-m", "cuflash.kernels", "toolchain"],
                                          "smoke": [python, "-m", "cuflash.benchmarks.gpu_workloads", "smoke"]}
    if tests.is_dir():
        cmd = [python, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
               "--junitxml", str(out / "tests" / "junit.xml"), str(tests)]
        try:
            import xdist  # noqa: F401

            cmd += ["-n", "4"]  # the compile cache is cold: NVRTC compiles in parallel across workers
        except ImportError:
            pass
        result["tests"] = cmd
    else:
        result["tests"] = "no tests/ folder beside the package (installed without the repository)"
    # Three tool runs (memcheck, racecheck, ncu) share validate's time.
    result["validate"] = [*bench, "validate-gpu", "--out", str(out / "validate"), "--skip", "tests", "speed",
                          "--sanitizer-tools", "memcheck", "racecheck", "--sanitizer-grid", "tensor-core",
                          "--step-timeout", str(max(10, int((timeout_s - 10) / 3)))]
    result["speed"] = [*bench, "speed", "--out", str(out / "speed"), "--headdims", *map(str, SPEED_SETTING["headdims"]),
                       "--dtypes", *SPEED_SETTING["dtypes"], "--seqlens", *map(str, SPEED_SETTING["seqlens"]),
                       "--causal", "both", "--flex", *SPEED_SETTING["flex"], "--systems", *SPEED_SYSTEMS,
                       "--repeats", "3", "--warmup", "1",
                       "--budget-s", str(max(0, int(timeout_s - SPEED_OUTPUT_S)))]
    result["splitkv"] = [*bench, "splitkv", "--out", str(out / "splitkv"),
                         "--budget-s", str(max(0, int(timeout_s - SPLITKV_OUTPUT_S)))]
    ncu = _tool("ncu")
    if ncu is None:
        result["ncu"] = "ncu not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
    else:
        result["ncu"] = [ncu, "--csv", "--page", "raw", *[a for s in NCU_SECTIONS for a in ("--section", s)],
                         "--metrics", TENSOR_PIPE_METRIC, "--kernel-name", NCU_KERNELS, "--launch-count", "2",
                         "--log-file", str(out / "ncu" / "ncu.csv"),
                         python, "-m", "cuflash.benchmarks.gpu_workloads", "ncu-d128"]
    # The real host path: CuPy arrays, kernels launched, and where a warm decode call's microseconds go.
    result["host"] = [*bench, "host", "--out", str(out / "host"), "--backend", "cupy",
                      "--profile", str(HOST_PROFILE_CALLS)]
    return result


# ---- reading what each step left behind (pure functions of its files and output)


def parse_junit(xml_text: str) -> dict:
    """pass/fail/skip counts and the failures' names from pytest's JUnit XML (a session interrupted at its time limit
    writes the test it stopped in as a testcase without a name: not counted)."""
    root = ElementTree.fromstring(xml_text)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures = []
    for case in root.iter("testcase"):
        if case.get("name") is None:
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        if case.find("failure") is not None:
            counts["failed"] += 1
            failures.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failures.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def parse_ncu(csv_text: str) -> list[dict]:
    """Per profiled kernel: tensor pipe % of peak and the warp stall reasons (cycles per issued instruction)."""
    from .validate import ncu_raw_rows

    kernels = []
    for row in ncu_raw_rows(csv_text):
        stalls = {}
        for column, value in row.items():
            m = STALL_PATTERN.match(column)
            number = _number(value)
            if m and number is not None and not m.group(1).endswith("not_issued"):
                stalls[m.group(1)] = number
        kernels.append({"kernel": row.get("Kernel Name", "?"), "tensor_pipe_pct": _number(row.get(TENSOR_PIPE_METRIC)),
                        "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1]))})
    return kernels


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_data(name: str, out: Path, text: str) -> dict:
    """What a finished step recorded, from its files (and for the toolchain, its output)."""
    if name == "toolchain":
        return {"lines": text.strip().splitlines()[-20:]}
    if name == "smoke":
        hang = HANG_PATTERN.search(text)
        return {"hang": hang.group(1) if hang else None,
                "ran": [line for line in text.splitlines() if line.startswith("smoke: ") and ": ok in " in line]}
    if name == "tests":
        junit = out / "tests" / "junit.xml"
        return parse_junit(junit.read_text()) if junit.exists() else {}
    if name == "validate":
        summary = _read_json(out / "validate" / "summary.json") or {}
        return {"steps": summary.get("steps", {})}
    if name == "speed":
        return {"result": _read_json(out / "speed" / "speed.json")}
    if name == "splitkv":
        return {"result": _read_json(out / "splitkv" / "splitkv.json")}
    if name == "ncu":
        log = out / "ncu" / "ncu.csv"
        return {"kernels": parse_ncu(log.read_text()) if log.exists() else []}
    if name == "host":
        profile = out / "host" / "profile.txt"
        return {"rows": (_read_json(out / "host" / "host.json") or {}).get("rows", []),
                "profile": profile.read_text() if profile.exists() else ""}
    return {}


def _detail(name: str, rc: int | None, data: dict, text: str) -> str:
    if name == "smoke" and data.get("hang"):
        return f"HANG: {data['hang']}"
    if name == "tests" and "passed" in data:
        return (f"{data['passed']} passed, {data['failed']} failed, {data['errors']} errors, "
                f"{data['skipped']} skipped")
    if name == "validate" and data.get("steps"):
        return "; ".join(f"{step}: {s.get('status')}" for step, s in data["steps"].items())
    if name == "speed" and data.get("result"):
        r = data["result"]
        return f"{len(r['measurements'])} timings, {len(r['skipped'])} skipped"
    if name == "splitkv" and data.get("result"):
        from .splitkv import summary_detail

        return summary_detail(data["result"])
    if name == "ncu" and data.get("kernels"):
        return f"{len(data['kernels'])} kernels profiled"
    if name == "host" and data.get("rows"):
        return f"{len(data['rows'])} rows"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else f"exit {rc}"


Runner = Callable[[list[str], float], tuple[int | None, str]]  # (rc, or None on timeout; output)


INTERRUPT_GRACE_S = 5  # after SIGINT, before SIGKILL: pytest writes its JUnit XML of the tests that ran


def run_subprocess(cmd: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd``; rc None when it ran out of time: its process group gets SIGINT (pytest then ends its session and
    writes what it has, the JUnit XML of the tests that finished) and, INTERRUPT_GRACE_S later, SIGKILL (the whole
    group: pytest workers, compute-sanitizer's target, a process waiting on a hung kernel)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            text, _ = proc.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the interrupt left running in the group
        return None, (text or "") + f"\n(timed out after {timeout_s:.0f} s)"


def run_steps(out: Path, *, runner: Runner = run_subprocess, clock: Callable[[], float] = time.monotonic,
              steps: tuple[Step, ...] = STEPS, total_s: float = TOTAL_S,
              commands_for: Callable[[Path, float], dict] = commands, progress=sys.stdout,
              on_record: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run every step in order within ``total_s``, each within step_timeout; one record per step, handed with the
    earlier ones to ``on_record`` as soon as it is made."""
    began = clock()
    records = []
    hang = None  # a kernel the smoke step saw hang: every later step would wait on it
    for index, step in enumerate(steps):
        timeout = step_timeout(steps, index, clock() - began, total_s)
        cmd = commands_for(out, timeout)[step.name]
        record = {"name": step.name, "what": step.what, "budget_s": step.budget_s, "timeout_s": round(timeout, 1)}
        if hang is not None:
            record.update(status="skipped", detail=f"the smoke step saw a kernel hang ({hang}): this step would wait "
                          f"on it", seconds=0.0, command=None if isinstance(cmd, str) else " ".join(cmd), rc=None,
                          data={})
        elif isinstance(cmd, str):
            record.update(status="skipped", detail=cmd, seconds=0.0, command=None, rc=None, data={})
        elif timeout < 5:
            record.update(status="skipped", detail=f"no time left ({timeout:.0f} s)", seconds=0.0,
                          command=" ".join(cmd), rc=None, data={})
        else:
            (out / step.name).mkdir(parents=True, exist_ok=True)
            if progress:
                print(f"first-gpu: {step.name} (up to {timeout:.0f} s) ...", file=progress, flush=True)
            t0 = clock()
            rc, text = runner(cmd, timeout)
            seconds = clock() - t0
            (out / step.name / "log.txt").write_text(f"$ {' '.join(cmd)}\n{text}")
            try:
                data = step_data(step.name, out, text)
            except Exception as err:  # a damaged output file must not stop the other steps
                data = {"parse_error": f"{type(err).__name__}: {err}".splitlines()[0]}
            status = "timeout" if rc is None else ("pass" if rc == 0 else "fail")
            record.update(status=status, rc=rc, seconds=round(seconds, 1), command=" ".join(cmd),
                          detail=_detail(step.name, rc, data, text), data=data)
        if progress:
            print(f"first-gpu: {step.name}: {record['status']}: {record['detail']}", file=progress, flush=True)
        records.append(record)
        if on_record is not None:
            on_record(list(records))
        hang = hang or record["data"].get("hang")
    return records


# ---- the summary: a pure function of the recorded steps


def speed_rows(result: dict) -> list[dict]:
    """Per (direction, workload): TFLOP/s and host us of every system, the best peer, and cuflash fa2's ratio to it."""
    cells: dict[tuple, dict[str, dict]] = {}
    for m in result.get("measurements", []):
        key = (m["direction"], m["dtype"], m["headdim"], m["causal"], m["seqlen"])
        cells.setdefault(key, {})[m["system"]] = m
    order = {d: i for i, d in enumerate(("forward", "backward", "forward+backward"))}
    rows = []
    for key in sorted(cells, key=lambda k: (order.get(k[0], 9), *k[1:])):
        systems = cells[key]
        peers = {s: m for s, m in systems.items() if not s.startswith("cuflash-")}
        best = max(peers, key=lambda s: peers[s]["tflops"]) if peers else None
        mine = systems.get("cuflash-fa2")
        rows.append({
            "direction": key[0], "dtype": key[1], "headdim": key[2], "causal": key[3], "seqlen": key[4],
            "tflops": {s: m["tflops"] for s, m in systems.items()},
            "host_us": {s: m.get("host_microseconds") for s, m in systems.items()},
            "best_peer": best,
            "ratio_to_best_peer": mine["tflops"] / peers[best]["tflops"] if mine and best else None,
        })
    return rows


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _speed_markdown(result: dict) -> list[str]:
    rows = speed_rows(result)
    systems = [s for s in result.get("systems", []) if any(s in r["tflops"] for r in rows)]
    lines = [f"Device {result.get('device', '?')}; {result.get('timing', '')}",
             f"cuflash ran {result.get('toolchain', '?')}" if result.get("toolchain") else "", "",
             "TFLOP/s from device time; host us: wall-clock host time per call (timing.py).", "",
             "| direction | dtype | d | causal | seqlen | " + " | ".join(f"{s} TFLOP/s" for s in systems)
             + " | best peer | fa2 / best peer | " + " | ".join(f"{s} host us" for s in systems) + " |",
             "|" + "---|" * (5 + 2 * len(systems) + 2)]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['dtype']} | {r['headdim']} | {r['causal']} | {r['seqlen']} | "
                     + " | ".join(_fmt(r["tflops"].get(s)) for s in systems)
                     + f" | {r['best_peer'] or '-'} | {_fmt(r['ratio_to_best_peer'], '.3f')} | "
                     + " | ".join(_fmt(r["host_us"].get(s), ".0f") for s in systems) + " |")
    skipped = result.get("skipped", [])
    if skipped:
        lines += ["", f"Skipped ({len(skipped)}):"] + [f"- {s['system']} {s['workload']}: {s['reason']}"
                                                        for s in skipped]
    return [line for line in lines if line is not None]


def write_summary(out: Path, record: dict, plot: bool = True) -> list[Path]:
    """DIR/summary.md, DIR/summary.json and (with ``plot``) DIR/summary.png from ``record`` ({"device", "seconds",
    "steps": [...]}, and "partial": True while steps remain: main writes one after every step, so a run killed
    before its end, as a lent machine's time limit may, still leaves the summary of the steps it finished)."""
    from .splitkv import markdown_lines as splitkv_markdown, splitkv_rows

    out = Path(out)
    steps = {s["name"]: s for s in record["steps"]}
    lines = [f"# cuflash first-gpu on {record.get('device', '?')}", "",
             f"{record.get('seconds', 0):.0f} s of a {record.get('total_s', TOTAL_S)} s budget.", ""]
    if record.get("partial"):
        last = record["steps"][-1]["name"] if record["steps"] else "no"
        lines += [f"**Partial**: written after the {last} step, before the run's end (a run cut short ends here).", ""]
    lines += ["| step | outcome | seconds (limit) | detail |", "|---|---|---|---|"]
    for s in record["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {_fmt(s.get('seconds'), '.0f')} ({_fmt(s.get('timeout_s'), '.0f')})"
                     f" | {str(s.get('detail', '')).replace('|', '/')} |")
    lines += ["", "Commands:", ""] + [f"- {s['name']}: `{s['command']}`" for s in record["steps"] if s.get("command")]

    toolchain = steps.get("toolchain", {}).get("data", {}).get("lines", [])
    if toolchain:
        lines += ["", "## Toolchain", "", "```", *toolchain, "```"]

    tests = steps.get("tests", {}).get("data", {})
    if tests.get("failures"):
        lines += ["", "## Failed gpu tests", ""] + [f"- {name}" for name in tests["failures"]]

    validate_steps = steps.get("validate", {}).get("data", {}).get("steps", {})
    if validate_steps:
        lines += ["", "## validate-gpu", ""]
        for name, s in validate_steps.items():
            lines.append(f"- {name}: {s.get('status')}: {s.get('detail')}")
            for tool, verdict in s.get("tools", {}).items():
                lines.append(f"  - sanitizer {tool}: **{verdict['status']}** ({verdict['detail']})")

    speed = steps.get("speed", {}).get("data", {}).get("result")
    if speed and speed.get("measurements"):
        lines += ["", "## Speed", ""] + _speed_markdown(speed)

    splitkv = steps.get("splitkv", {}).get("data", {}).get("result")
    if splitkv and splitkv.get("shapes"):
        lines += ["", "## Split-KV decode (splitkv.py)", ""] + splitkv_markdown(splitkv)

    kernels = steps.get("ncu", {}).get("data", {}).get("kernels", [])
    if kernels:
        lines += ["", "## Nsight Compute (d128 tensor-core kernels)", "",
                  "| kernel | tensor pipe % of peak | top stall reasons (cycles per issued instruction) |",
                  "|---|---|---|"]
        for k in kernels:
            stalls = ", ".join(f"{reason} {value:.2f}" for reason, value in list(k["stalls"].items())[:5])
            lines.append(f"| {k['kernel'][:60]} | {_fmt(k['tensor_pipe_pct'])} | {stalls or '-'} |")

    host_rows = steps.get("host", {}).get("data", {}).get("rows", [])
    if host_rows:
        lines += ["", "## Host microseconds per call (host.py)", "",
                  "| call | shape | backend | us per call | first call us |", "|---|---|---|---|---|"]
        lines += [f"| {r.get('call')} | {r.get('shape')} | {r.get('backend')} | "
                  f"{_fmt(r.get('microseconds_per_call'))} | {_fmt(r.get('first_call_microseconds'))} |"
                  for r in host_rows]
    host_profile = steps.get("host", {}).get("data", {}).get("profile", "")
    if host_profile:
        lines += ["", "```", *host_profile.splitlines()[:HOST_PROFILE_LINES], "```"]

    written = [out / "summary.md", out / "summary.json"] + ([out / "summary.png"] if plot else [])
    written[0].write_text("\n".join(lines) + "\n")
    derived = {"speed_rows": speed_rows(speed) if speed else [],
               "splitkv_rows": splitkv_rows(splitkv) if splitkv else []}
    written[1].write_text(json.dumps({**record, **derived}, indent=1, default=str))
    if plot:
        _summary_plot(speed, record.get("device", "?"), written[2])
    return written


def _summary_plot(speed: dict | None, device: str, path: Path) -> None:
    """Every direction's TFLOP/s panels (plots.py), or a figure that says why there are none."""
    from . import plots
    from .speed import SweepResult

    result = SweepResult.from_dict(speed) if speed else None
    if result is not None and result.measurements:
        plots.plot_speed_directions(result, path)
    else:
        plots.plot_message(f"first-gpu on {device}: no speed measurements (see summary.md)", path)


def main(out: Path) -> int:
    from . import speed
    from .timing import cupy_or_refuse

    cupy_or_refuse()  # NoGpuError before DIR exists
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    try:
        device = speed.device_name()
    except Exception as err:  # the summary is written whatever state the device is in
        device = f"unknown ({type(err).__name__})"

    def summary_so_far(records: list[dict]) -> None:
        partial = {"device": device, "total_s": TOTAL_S, "seconds": round(time.monotonic() - began, 1),
                   "steps": records, "partial": True}
        write_summary(out, partial, plot=False)

    records = run_steps(out, on_record=summary_so_far)
    record = {"device": device, "total_s": TOTAL_S, "seconds": round(time.monotonic() - began, 1), "steps": records}
    for path in write_summary(out, record):
        print(f"wrote {path}")
    return 0 if all(s["status"] in ("pass", "skipped") for s in records) else 1
