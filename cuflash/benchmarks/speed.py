"""GPU speed of cuflash beside its peers, in one run on one GPU: ms and TFLOP/s per direction.

``run_sweep`` takes the systems (peers.py), the workloads (workloads.py) and a
way to time (timing.py). Before a system's first timing at a (dtype, head dim,
causal) setting it is checked once against the float64 reference on a small
problem with FlashAttention's tolerance rule; a system that fails the check, or
cannot run a workload (out of memory, dtype not supported), is recorded as
skipped with the reason, never timed. Every timing has two figures (timing.py):
device milliseconds, from which TFLOP/s is computed, and host microseconds per
call. With a ``Budget`` the sweep skips, and records as skipped, each point whose
expected cost exceeds the seconds left. The result renders as a table (TFLOP/s,
device ms and host us per system, and the ratio of cuflash's fa2 to each peer),
JSON and CSV, and plots (plots.py).

Only the timers' CUDA bindings need a GPU; everything else is tested with fakes.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .peers import System
from .timing import Sample, measure
from .workloads import DIRECTIONS, Workload, flex_mods

# The small problem each system is checked on before it is timed: square, so that every system's causal
# convention (top-left or bottom-right diagonal) agrees, and not a multiple of any block size.
CHECK_SHAPE = dict(batch=1, nheads=2)  # seqlen: the system's check_seqlen


@dataclass(frozen=True)
class Measurement:
    system: str
    workload: Workload
    direction: str
    sample: Sample
    variant: str = ""  # System.variant: the system's kernels behind the figure, where it says

    @property
    def milliseconds(self) -> float:
        return self.sample.median

    @property
    def tflops(self) -> float:
        return self.workload.flops(self.direction) / self.milliseconds / 1e9

    @property
    def host_us(self) -> float:
        return self.sample.host_median

    def record(self) -> dict:
        return {"system": self.system, "direction": self.direction, **self.workload.as_dict(),
                "milliseconds": self.milliseconds, "tflops": self.tflops, "host_microseconds": self.host_us,
                "runs_ms": list(self.sample.milliseconds), "runs_host_us": list(self.sample.host_microseconds),
                "uncovered_runs": self.sample.uncovered, "variant": self.variant}

    @classmethod
    def from_record(cls, r: dict) -> Measurement:
        workload = Workload(**{k: r[k] for k in ("batch", "seqlen", "nheads", "headdim", "causal", "dtype")},
                            flex=r.get("flex"))
        sample = Sample(tuple(r["runs_ms"]), tuple(r.get("runs_host_us", ())), r.get("uncovered_runs", 0))
        return cls(r["system"], workload, r["direction"], sample, r.get("variant", ""))


@dataclass(frozen=True)
class Check:
    system: str
    dtype: str
    headdim: int
    causal: bool
    passed: bool
    detail: str
    flex: str | None = None  # the flex variant checked (workloads.FLEX_VARIANTS), None for plain attention


@dataclass(frozen=True)
class Skip:
    system: str
    workload: str
    reason: str


@dataclass
class SweepResult:
    device: str
    timing: str
    systems: list[str]
    toolchain: str = ""  # the code cuflash's kernels ran as (kernels/toolchain.py): CUBIN or PTX, NVRTC, driver
    measurements: list[Measurement] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "timing": self.timing,
            "toolchain": self.toolchain,
            "systems": self.systems,
            "measurements": [m.record() for m in self.measurements],
            "checks": [asdict(c) for c in self.checks],
            "skipped": [asdict(s) for s in self.skipped],
        }

    @classmethod
    def from_dict(cls, d: dict) -> SweepResult:
        """The result back from its JSON (speed.json), for summaries and plots made after the run."""
        return cls(d.get("device", ""), d.get("timing", ""), list(d.get("systems", [])), d.get("toolchain", ""),
                   [Measurement.from_record(r) for r in d.get("measurements", [])],
                   [Check(**c) for c in d.get("checks", [])], [Skip(**s) for s in d.get("skipped", [])])


class Budget:
    """The seconds a sweep may take, and what each (system, point) is expected to cost from what ran before.

    A point's cost (check, inputs, warm-up and timed runs) is expected to scale with its FLOPs from the
    system's latest point of no more FLOPs (FA2's sweep doubles them with each seqlen); a system not yet
    seen is expected to cost ``first_guess_s`` (NVRTC or XLA compiles dominate there).
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic, first_guess_s: float = 20.0):
        self.clock, self.first_guess_s = clock, first_guess_s
        self.deadline = clock() + seconds
        self._seen: dict[str, list[tuple[float, float]]] = {}

    def left(self) -> float:
        return self.deadline - self.clock()

    def expect(self, system: str, workload: Workload) -> float:
        flops = workload.flops("forward+backward")
        seen = self._seen.get(system, [])
        below = [(f, s) for f, s in seen if f <= flops]
        if not below:
            return self.first_guess_s if not seen else max(s for _, s in seen)
        f, s = below[-1]
        return s * flops / f

    def observe(self, system: str, workload: Workload, seconds: float) -> None:
        self._seen.setdefault(system, []).append((workload.flops("forward+backward"), seconds))


def error_line(err: BaseException) -> str:
    """One line naming what stopped a call: its exception's type and the first line of its message."""
    return f"{type(err).__name__}: {err}".splitlines()[0]


def wrong_result_line(err: AssertionError) -> str:
    """One line for a result outside the FlashAttention rule (cuflash._tolerance.check_close's AssertionError)."""
    return f"wrong result: {err}".splitlines()[0]


def share_of_bound(measured) -> str:
    """A passing check's figure: the largest error of ``measured`` (check_close results) as a share of its bound."""
    worst = max(m.max_error / m.bound if m.bound else 0.0 for m in measured)
    return f"max error {worst:.2f} of the bound"


def check_against_reference(system: System, dtype: str, headdim: int, causal: bool, seed: int = 0,
                            flex: str | None = None) -> Check:
    """Run ``system`` once on a small problem and judge out and gradients by the FlashAttention rule (with ``flex``,
    the variant's mods, workloads.flex_mods, against the reference evaluating them element by element)."""
    from cuflash import _tolerance as tol
    from cuflash.testing import random_qkv

    shape = CHECK_SHAPE
    rng = np.random.default_rng(seed)
    seqlen = system.check_seqlen
    q, k, v = random_qkv(rng, shape["batch"], seqlen, seqlen, shape["nheads"], shape["nheads"], headdim, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    try:
        if flex is None:
            out, grads = system.compute(q, k, v, dout, causal)
            options = {"causal": causal}
        else:
            out, grads = system.compute(q, k, v, dout, causal, flex=flex)
            options = flex_mods(flex, seqlen, shape["nheads"])
        ref = tol.forward_references(q, k, v, **options)
        measured = [tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)]
        bref = tol.backward_references(dout, q, k, v, **options)
        for name, got in zip(("dq", "dk", "dv"), grads):
            measured.append(tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"),
                                            tol.BACKWARD_FACTOR, atol=1e-5 if causal or flex else 0.0))
    except AssertionError as err:
        return Check(system.key, dtype, headdim, causal, False, wrong_result_line(err), flex)
    except Exception as err:  # the system cannot run this setting at all
        return Check(system.key, dtype, headdim, causal, False, error_line(err), flex)
    return Check(system.key, dtype, headdim, causal, True, share_of_bound(measured), flex)


class Progress:
    """A one-line progress bar on stderr (nothing when ``stream`` is None)."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 30):
        self.total, self.done, self.stream, self.width = max(total, 1), 0, stream, width

    def step(self, what: str) -> None:
        self.done += 1
        if self.stream is None:
            return
        filled = self.width * self.done // self.total
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {what:<60}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_sweep(systems: Iterable[System], workloads: Iterable[Workload], *, directions=DIRECTIONS,
              warmup: int = 3, repeats: int = 10, device: str = "", timing: str = "",
              check: Callable[..., Check] = check_against_reference, progress_stream=sys.stderr,
              toolchain: str = "", budget: Budget | None = None) -> SweepResult:
    """Check, then time, every available system on every workload, in the same process (within ``budget``)."""
    systems, workloads = list(systems), list(workloads)
    result = SweepResult(device, timing, [s.key for s in systems], toolchain)
    present = []
    for system in systems:
        reason = system.unavailable()
        if reason:
            result.skipped.append(Skip(system.key, "all", f"unavailable: {reason}"))
        else:
            present.append(system)
    progress = Progress(len(present) * len(workloads), progress_stream)
    verdicts: dict[tuple, Check] = {}
    for workload in workloads:
        for system in present:
            progress.step(f"{system.key} {workload.label()}")
            if budget is not None:
                expected, left = budget.expect(system.key, workload), budget.left()
                if expected > left:
                    result.skipped.append(Skip(system.key, workload.label(),
                                               f"over budget: expected {expected:.0f} s, {max(left, 0):.0f} s left"))
                    continue
                began = budget.clock()
            if workload.flex is not None and workload.flex not in system.flex_variants:
                result.skipped.append(Skip(system.key, workload.label(), "takes no flex mods"))
                continue
            setting = (system.key, workload.dtype, workload.headdim, workload.causal, workload.flex)
            if setting not in verdicts:
                flex = {"flex": workload.flex} if workload.flex is not None else {}
                verdicts[setting] = check(system, workload.dtype, workload.headdim, workload.causal, **flex)
                result.checks.append(verdicts[setting])
            if not verdicts[setting].passed:
                result.skipped.append(Skip(system.key, workload.label(), f"failed its check: {verdicts[setting].detail}"))
                continue
            try:
                prepared = system.prepare(workload)
                for direction in directions:
                    if direction not in prepared.calls:
                        continue
                    sample = measure(prepared.calls[direction], prepared.timer, warmup=warmup, repeats=repeats)
                    result.measurements.append(Measurement(system.key, workload, direction, sample,
                                                           system.variant(workload, direction)))
            except Exception as err:  # out of memory, an unsupported shape: say so and go on
                result.skipped.append(Skip(system.key, workload.label(), error_line(err)))
            finally:
                prepared = None
                system.release()
                if budget is not None:
                    budget.observe(system.key, workload, budget.clock() - began)
    return result


def sweep_on_gpu(systems, workloads, *, directions=DIRECTIONS, warmup: int = 3, repeats: int = 10,
                 budget_s: float | None = None) -> SweepResult:
    """run_sweep on the current GPU with each system's own timer (NoGpuError without one)."""
    from .timing import cupy_or_refuse, describe, l2_flush_bytes

    cupy = cupy_or_refuse()
    budget = Budget(budget_s) if budget_s is not None else None
    return run_sweep(systems, workloads, directions=directions, warmup=warmup, repeats=repeats, device=device_name(),
                     timing=describe(repeats, warmup, l2_flush_bytes(cupy)), toolchain=toolchain_line(),
                     budget=budget)


def baseline_system(result: SweepResult) -> str | None:
    """The cuflash system the ratios are taken against: fa2 if it ran, else the first cuflash system."""
    cuflash = [s for s in result.systems if s.startswith("cuflash-")]
    return "cuflash-fa2" if "cuflash-fa2" in cuflash else (cuflash[0] if cuflash else None)


def _cell(m: Measurement) -> str:
    """TFLOP/s (device ms, host us per call); a trailing * when some runs left the device idle (timing.py)."""
    return f"{m.tflops:.1f} ({m.milliseconds:.3f} ms, {m.host_us:.0f} us){'*' if m.sample.uncovered else ''}"


def _workload_order(w: Workload) -> tuple:
    return (w.dtype, w.headdim, w.flex or "", w.causal, w.seqlen)


def format_table(result: SweepResult) -> str:
    """TFLOP/s per system for every (direction, workload), then cuflash's ratio to each peer."""
    timed = [s for s in result.systems if any(m.system == s for m in result.measurements)]
    base = baseline_system(result)
    peers = [s for s in timed if not s.startswith("cuflash-")]
    by_key = {(m.system, m.workload, m.direction): m for m in result.measurements}
    lines = [f"{result.device}: TFLOP/s (device ms, host us per call), {result.timing}".strip(": ")]
    if result.toolchain:
        lines.append(f"cuflash ran {result.toolchain}")
    for direction in DIRECTIONS:
        workloads = sorted({m.workload for m in result.measurements if m.direction == direction}, key=_workload_order)
        if not workloads:
            continue
        mask_width = max([6, *(len(w.flex) for w in workloads if w.flex)])  # a flex variant's name in causal's column
        head = f"{'dtype':>8} {'hdim':>4} {'causal':>{mask_width}} {'seqlen':>6} " + " ".join(f"{s:>32}" for s in timed)
        ratios = [(p, f"{base.removeprefix('cuflash-')}/{p}") for p in peers] if base in timed else []
        head += "".join(f" {label:>{max(14, len(label))}}" for _, label in ratios)
        lines += ["", f"{direction}", head]
        for w in workloads:
            row = f"{w.dtype:>8} {w.headdim:4d} {w.flex or str(w.causal):>{mask_width}} {w.seqlen:6d} "
            row += " ".join(f"{_cell(by_key[(s, w, direction)]):>32}" if (s, w, direction) in by_key else f"{'-':>32}"
                            for s in timed)
            for p, label in ratios:
                mine, theirs = by_key.get((base, w, direction)), by_key.get((p, w, direction))
                cell = f"{mine.tflops / theirs.tflops:.3f}" if mine and theirs else "-"
                row += f" {cell:>{max(14, len(label))}}"
            lines.append(row)
    if any(m.sample.uncovered for m in result.measurements):
        lines += ["", "* some runs of this call left the GPU idle while the host prepared it: device ms may include "
                      "host time (see timing.py)"]
    if result.skipped:
        lines += ["", "skipped:"] + [f"  {s.system} {s.workload}: {s.reason}" for s in result.skipped]
    return "\n".join(lines)


CSV_FIELDS = ("system", "direction", "batch", "seqlen", "nheads", "headdim", "causal", "dtype", "flex", "milliseconds",
              "tflops", "host_microseconds", "uncovered_runs", "variant")


def write_outputs(result: SweepResult, out_dir: Path, stem: str = "speed") -> list[Path]:
    """speed.json (everything), speed.csv (one row per measurement), speed.txt (the table), and the plots."""
    from . import plots

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.csv", out_dir / f"{stem}.txt"]
    written[0].write_text(json.dumps(result.as_dict(), indent=1))
    with written[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for m in result.measurements:
            writer.writerow(m.record())
    written[2].write_text(format_table(result) + "\n")
    for direction in DIRECTIONS:
        if any(m.direction == direction for m in result.measurements):
            path = out_dir / f"{stem}_{direction.replace('+', '_')}.png"
            plots.plot_speed(result, direction, path)
            written.append(path)
    return written


def toolchain_line() -> str:
    """The code cuflash's kernels run as on the current GPU: "sm_90 CUBINs from NVRTC 13.5, driver for CUDA 13.0"."""
    from cuflash.kernels import toolchain

    from .timing import cupy_or_refuse

    capability = toolchain.capability_of_cupy(cupy_or_refuse().cuda.Device().compute_capability)
    return toolchain.describe_code(toolchain.code_for_device(*capability))


def device_name() -> str:
    from .timing import cupy_or_refuse

    cupy = cupy_or_refuse()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)
