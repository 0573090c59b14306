"""The compile report: every catalog instance compiled for each arch, with what ptxas and the SASS say.

    python -m cuflash.kernels report --arch sm_80 sm_90 [--json] [--jobs N]

Per (kernel, arch): registers, spill stores/loads, stack frame, static shared
memory (all from the ptxas log), dynamic shared memory (from the launch plan),
whether the SASS uses tensor cores (HMMA), the NVRTC compile time, and two
occupancy bounds that need only those numbers and the arch's published limits.
Exits 1 if an instance fails to compile or asks for more shared memory than a
block of that arch may have (it could never launch there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from . import catalog, plans
from .nvrtc import CompiledKernel, CompileError, compile_many, uses_hmma

JSON_KEYS = (
    "kernel",
    "arch",
    "registers",
    "spill_store_bytes",
    "spill_load_bytes",
    "static_smem_bytes",
    "dynamic_smem_bytes",
    "hmma",
)


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits from the CUDA C++ Programming Guide's compute capability table."""

    registers_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm_bytes: int  # largest shared memory carveout
    smem_per_block_bytes: int  # largest opt-in shared memory per block
    reserved_smem_per_block_bytes: int = 1024  # the runtime keeps 1 KB per resident block
    register_alloc_unit: int = 256  # registers are given to a warp in units of 256


ARCH_LIMITS = {
    "sm_80": ArchLimits(65536, 64, 32, 164 * 1024, 163 * 1024),
    "sm_86": ArchLimits(65536, 48, 16, 100 * 1024, 99 * 1024),
    "sm_89": ArchLimits(65536, 48, 24, 100 * 1024, 99 * 1024),
    "sm_90": ArchLimits(65536, 64, 32, 228 * 1024, 227 * 1024),
    "sm_90a": ArchLimits(65536, 64, 32, 228 * 1024, 227 * 1024),
}


@dataclass(frozen=True)
class ReportRow:
    compiled: CompiledKernel
    dynamic_smem_bytes: int
    hmma: bool | None

    @property
    def total_smem_bytes(self) -> int:
        return self.compiled.resources.static_smem_bytes + self.dynamic_smem_bytes

    @property
    def limits(self) -> ArchLimits | None:
        return ARCH_LIMITS.get(self.compiled.arch)

    @property
    def warps_per_sm_by_registers(self) -> int | None:
        """Resident warps per SM if registers were the only limit (None for an unknown arch)."""
        limits = self.limits
        if limits is None:
            return None
        per_warp = -(-self.compiled.resources.registers * 32 // limits.register_alloc_unit) * limits.register_alloc_unit
        return min(limits.max_warps_per_sm, limits.registers_per_sm // max(per_warp, 1))

    @property
    def blocks_per_sm_by_smem(self) -> int | None:
        """Resident blocks per SM if shared memory were the only limit (0: cannot launch)."""
        limits = self.limits
        if limits is None:
            return None
        if self.total_smem_bytes > limits.smem_per_block_bytes:
            return 0
        return min(limits.max_blocks_per_sm, limits.smem_per_sm_bytes // (self.total_smem_bytes + limits.reserved_smem_per_block_bytes))

    @property
    def exceeds_block_smem(self) -> bool:
        limits = self.limits
        return limits is not None and self.total_smem_bytes > limits.smem_per_block_bytes

    def as_json(self) -> dict:
        resources = self.compiled.resources
        return {
            "kernel": self.compiled.instance.name_expr,
            "arch": self.compiled.arch,
            "registers": resources.registers,
            "spill_store_bytes": resources.spill_store_bytes,
            "spill_load_bytes": resources.spill_load_bytes,
            "static_smem_bytes": resources.static_smem_bytes,
            "dynamic_smem_bytes": self.dynamic_smem_bytes,
            "hmma": self.hmma,
        }


def build_report(
    archs: Sequence[str], jobs: int | None = None, instances: Sequence[catalog.KernelInstance] | None = None
) -> tuple[list[ReportRow], list[CompileError]]:
    """Compile (through the cache) and inspect every instance for every arch."""
    if instances is None:
        instances = catalog.all_instances()
    results = compile_many(instances, archs, jobs=jobs, return_errors=True, check_sass=True)
    compiled = [r for r in results if isinstance(r, CompiledKernel)]
    errors = [r for r in results if isinstance(r, CompileError)]
    # Verdicts are cached by the workers; threads overlap any cuobjdump still needed.
    with ThreadPoolExecutor(max_workers=max(1, jobs or 2)) as pool:
        hmma = list(pool.map(uses_hmma, compiled))
    rows = [
        ReportRow(kernel, plans.dynamic_smem_bytes(kernel.instance), uses)
        for kernel, uses in zip(compiled, hmma)
    ]
    return rows, errors


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def format_table(rows: Sequence[ReportRow]) -> str:
    headers = (
        "kernel",
        "arch",
        "regs",
        "spill st/ld B",
        "stack B",
        "static smem B",
        "dyn smem B",
        "hmma",
        "warps/SM (regs)",
        "blocks/SM (smem)",
        "compile s",
    )
    table = [headers]
    for row in rows:
        r = row.compiled.resources
        blocks = row.blocks_per_sm_by_smem
        table.append(
            (
                row.compiled.instance.name_expr,
                row.compiled.arch,
                str(r.registers),
                f"{r.spill_store_bytes}/{r.spill_load_bytes}",
                str(r.stack_frame_bytes),
                str(r.static_smem_bytes),
                str(row.dynamic_smem_bytes),
                _yes_no(row.hmma),
                "?" if row.warps_per_sm_by_registers is None else str(row.warps_per_sm_by_registers),
                "?" if blocks is None else (str(blocks) if blocks else "TOO BIG"),
                f"{row.compiled.compile_seconds:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    lines = []
    for index, line in enumerate(table):
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash.kernels report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], help="real GPU archs, e.g. sm_80 sm_90")
    parser.add_argument("--json", action="store_true", help="print a JSON list (keys: " + ", ".join(JSON_KEYS) + ")")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    rows, errors = build_report(args.arch, jobs=args.jobs)
    elapsed = time.perf_counter() - started

    if args.json:
        print(json.dumps([row.as_json() for row in rows], indent=1))
    else:
        print(format_table(rows))
        for row in rows:
            for warning in row.compiled.warnings:
                print(f"warning: {row.compiled.instance.name_expr} ({row.compiled.arch}): {warning}")
    too_big = [row for row in rows if row.exceeds_block_smem]
    for row in too_big:
        limit = row.limits.smem_per_block_bytes
        print(
            f"error: {row.compiled.instance.name_expr} needs {row.total_smem_bytes} bytes of shared memory per block "
            f"(static {row.compiled.resources.static_smem_bytes} + dynamic {row.dynamic_smem_bytes}); "
            f"{row.compiled.arch} allows {limit}",
            file=sys.stderr,
        )
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    print(
        f"{len(rows)} compiled, {len(errors)} failed, {elapsed:.1f} s wall "
        f"(sum of NVRTC times when built: {sum(r.compiled.compile_seconds for r in rows):.1f} s)",
        file=sys.stderr,
    )
    return 1 if errors or too_big else 0
