"""GPU speed of cuflash beside its peers, in one run on one GPU: ms and TFLOP/s per direction.

``run_sweep`` takes the systems (peers.py), the workloads (workloads.py) and a
way to time (timing.py). Before a system's first timing at a (dtype, head dim,
causal) setting it is checked once against the float64 reference on a small
problem with FlashAttention's tolerance rule; a system that fails the check, or
cannot run a workload (out of memory, dtype not supported), is recorded as
skipped with the reason, never timed. The result renders as a table (TFLOP/s
per system and the ratio of cuflash's fa2 to each peer), JSON and CSV, and
plots (plots.py).

Only the CUDA-event timer and the L2 flush need a GPU; everything else is
tested with a fake timer.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .peers import System
from .timing import Sample, measure
from .workloads import DIRECTIONS, Workload

# The small problem each system is checked on before it is timed: square, so that every system's causal
# convention (top-left or bottom-right diagonal) agrees, and not a multiple of any block size.
CHECK_SHAPE = dict(batch=1, seqlen=257, nheads=2)


@dataclass(frozen=True)
class Measurement:
    system: str
    workload: Workload
    direction: str
    sample: Sample

    @property
    def milliseconds(self) -> float:
        return self.sample.median

    @property
    def tflops(self) -> float:
        return self.workload.flops(self.direction) / self.milliseconds / 1e9

    def record(self) -> dict:
        return {"system": self.system, "direction": self.direction, **self.workload.as_dict(),
                "milliseconds": self.milliseconds, "tflops": self.tflops, "runs_ms": list(self.sample.milliseconds)}


@dataclass(frozen=True)
class Check:
    system: str
    dtype: str
    headdim: int
    causal: bool
    passed: bool
    detail: str


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


def check_against_reference(system: System, dtype: str, headdim: int, causal: bool, seed: int = 0) -> Check:
    """Run ``system`` once on a small problem and judge out and gradients by the FlashAttention rule."""
    from cuflash import _tolerance as tol
    from cuflash.testing import random_qkv

    shape = CHECK_SHAPE
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, shape["batch"], shape["seqlen"], shape["seqlen"], shape["nheads"], shape["nheads"],
                         headdim, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    try:
        out, grads = system.compute(q, k, v, dout, causal)
        ref = tol.forward_references(q, k, v, causal=causal)
        measured = [tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)]
        bref = tol.backward_references(dout, q, k, v, causal=causal)
        for name, got in zip(("dq", "dk", "dv"), grads):
            measured.append(tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"),
                                            tol.BACKWARD_FACTOR, atol=1e-5 if causal else 0.0))
    except AssertionError as err:
        return Check(system.key, dtype, headdim, causal, False, f"wrong result: {err}".splitlines()[0])
    except Exception as err:  # the system cannot run this setting at all
        return Check(system.key, dtype, headdim, causal, False, f"{type(err).__name__}: {err}".splitlines()[0])
    worst = max(m.max_error / m.bound if m.bound else 0.0 for m in measured)
    return Check(system.key, dtype, headdim, causal, True, f"max error {worst:.2f} of the bound")


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
              warmup: int = 3, repeats: int = 10, flush: Callable[[], None] | None = None, device: str = "",
              timing: str = "", check: Callable[..., Check] = check_against_reference,
              progress_stream=sys.stderr, toolchain: str = "") -> SweepResult:
    """Check, then time, every available system on every workload, in the same process."""
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
            setting = (system.key, workload.dtype, workload.headdim, workload.causal)
            if setting not in verdicts:
                verdicts[setting] = check(system, workload.dtype, workload.headdim, workload.causal)
                result.checks.append(verdicts[setting])
            if not verdicts[setting].passed:
                result.skipped.append(Skip(system.key, workload.label(), f"failed its check: {verdicts[setting].detail}"))
                continue
            try:
                prepared = system.prepare(workload)
                for direction in directions:
                    if direction not in prepared.calls:
                        continue
                    sample = measure(prepared.calls[direction], prepared.timer, warmup=warmup, repeats=repeats,
                                     flush=flush)
                    result.measurements.append(Measurement(system.key, workload, direction, sample))
            except Exception as err:  # out of memory, an unsupported shape: say so and go on
                result.skipped.append(Skip(system.key, workload.label(), f"{type(err).__name__}: {err}".splitlines()[0]))
            finally:
                prepared = None
                system.release()
    return result


def sweep_on_gpu(systems, workloads, *, directions=DIRECTIONS, warmup: int = 3, repeats: int = 10) -> SweepResult:
    """run_sweep with the CUDA-event timers and the L2 flush, on the current GPU (NoGpuError without one)."""
    from .timing import L2Flush, cupy_or_refuse

    cupy_or_refuse()
    flush = L2Flush()
    return run_sweep(systems, workloads, directions=directions, warmup=warmup, repeats=repeats, flush=flush,
                     device=device_name(), timing=f"CUDA events, median of {repeats} after {warmup} warm-up, "
                                                  f"L2 flushed ({flush.bytes >> 20} MiB written) before each run",
                     toolchain=toolchain_line())


def baseline_system(result: SweepResult) -> str | None:
    """The cuflash system the ratios are taken against: fa2 if it ran, else the first cuflash system."""
    cuflash = [s for s in result.systems if s.startswith("cuflash-")]
    return "cuflash-fa2" if "cuflash-fa2" in cuflash else (cuflash[0] if cuflash else None)


def _cell(m: Measurement) -> str:
    return f"{m.tflops:.1f} ({m.milliseconds:.3f} ms)"


def format_table(result: SweepResult) -> str:
    """TFLOP/s per system for every (direction, workload), then cuflash's ratio to each peer."""
    timed = [s for s in result.systems if any(m.system == s for m in result.measurements)]
    base = baseline_system(result)
    peers = [s for s in timed if not s.startswith("cuflash-")]
    by_key = {(m.system, m.workload, m.direction): m for m in result.measurements}
    lines = [f"{result.device}: TFLOP/s (ms), {result.timing}".strip(": ")]
    if result.toolchain:
        lines.append(f"cuflash ran {result.toolchain}")
    for direction in DIRECTIONS:
        workloads = list(dict.fromkeys(m.workload for m in result.measurements if m.direction == direction))
        if not workloads:
            continue
        head = f"{'dtype':>8} {'hdim':>4} {'causal':>6} {'seqlen':>6} " + " ".join(f"{s:>22}" for s in timed)
        ratios = [(p, f"{base.removeprefix('cuflash-')}/{p}") for p in peers] if base in timed else []
        head += "".join(f" {label:>{max(14, len(label))}}" for _, label in ratios)
        lines += ["", f"{direction}", head]
        for w in workloads:
            row = f"{w.dtype:>8} {w.headdim:4d} {str(w.causal):>6} {w.seqlen:6d} "
            row += " ".join(f"{_cell(by_key[(s, w, direction)]):>22}" if (s, w, direction) in by_key else f"{'-':>22}"
                            for s in timed)
            for p, label in ratios:
                mine, theirs = by_key.get((base, w, direction)), by_key.get((p, w, direction))
                cell = f"{mine.tflops / theirs.tflops:.3f}" if mine and theirs else "-"
                row += f" {cell:>{max(14, len(label))}}"
            lines.append(row)
    if result.skipped:
        lines += ["", "skipped:"] + [f"  {s.system} {s.workload}: {s.reason}" for s in result.skipped]
    return "\n".join(lines)


CSV_FIELDS = ("system", "direction", "batch", "seqlen", "nheads", "headdim", "causal", "dtype", "milliseconds",
              "tflops")


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
