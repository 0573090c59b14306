"""Cold NVRTC time of flex kernel instances: ``python -m cuflash.kernels flex [--arch ...] [--dtypes ...]
[--mods ...] [--directions ...] [--headdim N] [--json]``.

What a user's new mod costs before its first call runs: each example mod (FlexAttention's common variants, below) is
compiled into the fa2 programs' main kernels (cuflash.flex._kernels) for each dtype (float16 / bfloat16: tensor
cores, float32: SIMT) and direction, in a fresh, empty cache (a temporary CUFLASH_CACHE_DIR: nothing is a hit), and
each instance's NVRTC seconds are printed with its registers and spills. Compile figures on this machine's CPUs,
not GPU speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Callable, Sequence

import jax.numpy as jnp

from ..benchmarks import workloads
from ..kernels import catalog, plans, targets
from ..kernels.nvrtc import CompileError, compile_many, supported_archs
from ..kernels.report import archs_to_report
from ..kernels.program import Problem
from ._kernels import hooked_program
from ._mod import FlexMod, trace_mask_mod, trace_score_mod

_SEQLEN = 256  # the example problem's lengths: the plans pick the same tiles for any length
_HEADS = 2


def _example_mods(seqlen: int) -> dict[str, Callable[[], tuple[FlexMod | None, FlexMod | None]]]:
    """name -> (score_mod, mask_mod) of the example variants, traced on demand: tanh softcap, and the benchmarks'
    flex variants (workloads.flex_mods: document mask, prefix-LM, relative-position bias with its table's gradient)."""

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * jnp.tanh(score / 30.0)

    def traced(variant: str) -> tuple[FlexMod | None, FlexMod | None]:
        mods = workloads.flex_mods(variant, seqlen, _HEADS)
        score, mask = mods.get("score_mod"), mods.get("mask_mod")
        return (None if score is None else trace_score_mod(score, side_grads=True),
                None if mask is None else trace_mask_mod(mask))

    return {"softcap": lambda: (trace_score_mod(softcap), None),
            **{variant: (lambda variant=variant: traced(variant)) for variant in workloads.FLEX_VARIANTS}}


MODS = tuple(_example_mods(8))
DTYPES = ("float16", "bfloat16", "float32")
DIRECTIONS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Row:
    mod: str
    dtype: str
    direction: str
    kernel: str
    arch: str
    seconds: float | None  # NVRTC wall time; None where the compile failed
    registers: int | None
    spill_bytes: int | None
    error: str | None = None


def flex_instances(mod: str, dtype: str, direction: str, arch: str, headdim: int):
    """The hooked kernel instances (the main kernels only: the others are the catalog's) of one example."""
    score, mask = _example_mods(_SEQLEN)[mod]()
    problem = dataclasses.replace(Problem(dtype, 1, _SEQLEN, _SEQLEN, _HEADS, _HEADS, headdim), flex=True)
    target = targets.target(arch)
    planner = plans.backward_program if direction == "backward" else plans.forward_program
    plain = planner("fa2", problem, target)
    hooked = hooked_program(plain, score, mask, block_sparse=mask is not None)
    return [new.kernel for old, new in zip(plain.launches, hooked.launches) if new.kernel != old.kernel]


def compile_report(archs: Sequence[str], dtypes: Sequence[str], mods: Sequence[str], directions: Sequence[str],
                   headdim: int, jobs: int) -> list[Row]:
    """Compile every (mod, dtype, direction, arch) example's flex instances in a fresh cache; a Row per instance.
    The cache directory is a temporary one for the duration (every compile is cold) and restored after."""
    saved = os.environ.get("CUFLASH_CACHE_DIR")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cuflash-flex-cold-") as fresh:
        os.environ["CUFLASH_CACHE_DIR"] = fresh
        try:
            tasks = []
            for arch in archs:
                for mod in mods:
                    for dtype in dtypes:
                        for direction in directions:
                            for instance in flex_instances(mod, dtype, direction, arch, headdim):
                                tasks.append((mod, dtype, direction, instance, catalog.compile_arch(instance, arch)))
            for compile_arch in dict.fromkeys(t[4] for t in tasks):
                mine = [t for t in tasks if t[4] == compile_arch]
                results = compile_many([t[3] for t in mine], [compile_arch], jobs=jobs, return_errors=True)
                for (mod, dtype, direction, instance, _), result in zip(mine, results):
                    kernel = instance.name_expr.split("<")[0].split("::")[-1]
                    if isinstance(result, CompileError):
                        rows.append(Row(mod, dtype, direction, kernel, compile_arch, None, None, None, str(result)))
                        continue
                    r = result.resources
                    rows.append(Row(mod, dtype, direction, kernel, compile_arch, result.compile_seconds,
                                    r.registers if r else None,
                                    (r.spill_store_bytes + r.spill_load_bytes) if r else None))
        finally:
            if saved is None:
                os.environ.pop("CUFLASH_CACHE_DIR", None)
            else:
                os.environ["CUFLASH_CACHE_DIR"] = saved
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    table = [("mod", "dtype", "direction", "kernel", "arch", "NVRTC s", "regs", "spill B")]
    for row in rows:
        table.append((row.mod, row.dtype, row.direction, row.kernel, row.arch,
                      "FAILED" if row.seconds is None else f"{row.seconds:.2f}",
                      "-" if row.registers is None else str(row.registers),
                      "-" if row.spill_bytes is None else str(row.spill_bytes)))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 5 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash.kernels flex", description=__doc__.split("\n\n")[1])
    parser.add_argument("--arch", nargs="+", default=["sm_80"], choices=list(targets.TARGETS),
                        help="real GPU archs (default sm_80)")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "float32"], choices=DTYPES)
    parser.add_argument("--mods", nargs="+", default=list(MODS), choices=MODS)
    parser.add_argument("--directions", nargs="+", default=list(DIRECTIONS), choices=DIRECTIONS)
    parser.add_argument("--headdim", type=int, default=64, help="the example problem's head dim (default 64)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="compile processes (default 1: parallel compiles share the CPUs and inflate each time)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of the rows")
    args = parser.parse_args(argv)
    try:
        archs_to_report(args.arch, supported_archs())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = compile_report(args.arch, args.dtypes, args.mods, args.directions, args.headdim, args.jobs)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=1), flush=True)
    else:
        print(format_rows(rows), flush=True)
    failed = [row for row in rows if row.error is not None]
    for row in failed:
        print(f"error: {row.mod} {row.dtype} {row.direction} {row.kernel}: {row.error}", file=sys.stderr)
    built = [row.seconds for row in rows if row.seconds is not None]
    print(f"{len(built)} flex instances compiled cold, {len(failed)} failed, {elapsed:.1f} s wall (NVRTC "
          f"{sum(built):.1f} s; per instance mean {sum(built) / max(1, len(built)):.2f} s)", file=sys.stderr)
    return 1 if failed or not rows else 0
