"""The compile report: every instance each arch's plans can launch, compiled for that arch.

    python -m cuflash.kernels report --arch sm_80 sm_86 sm_89 sm_90 sm_120 [--json] [--jobs N] [--no-spills]
        [--no-perf-loss]

Per (kernel, arch): registers, spill stores/loads, stack frame, static shared memory (all
from the ptxas log), dynamic shared memory (from the launch plan) beside the arch's limit per
block, whether the SASS uses tensor cores (HMMA; HGMMA, wgmma, in sm_90a code), the NVRTC
compile time, and the resident blocks per SM those numbers and the arch's published limits
allow (cuflash/kernels/targets.py). An instance compiles for what the catalog says
(catalog.compile_arch: the Hopper kernels are sm_90a code on sm_90, and their rows say so).
Warp-specialized kernels add their roles: warpgroups (the family's) and registers per thread
after setmaxnreg (the SASS's). Exits 1 if an instance fails to compile or a plan asks for
more shared memory than a block of its arch may have (it could never launch there), or its
roles more registers than the block was launched with (roles_exceed_launch_allocation); with
--no-spills if an instance spills, and with
--no-perf-loss if ptxas says an instance's code runs slower than written (its C75xx advisories:
wgmma serialized, waits or warpgroup.arrive injected, setmaxnreg ignored), which no spill count
shows and which cost a Hopper kernel its overlap.

It compiles with whichever NVRTC is installed (CUDA 12 or 13): without --arch it reports the
default archs that NVRTC knows and names those it skips; an --arch it does not know is refused.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from . import catalog, targets
from .nvrtc import (CompiledKernel, CompileError, compile_many, nvrtc_version, supported_archs, uses_hmma,
                    warpgroup_facts)
from .program import KernelInstance

JSON_KEYS = (
    "kernel",
    "arch",
    "registers",
    "spill_store_bytes",
    "spill_load_bytes",
    "static_smem_bytes",
    "dynamic_smem_bytes",
    "smem_limit_bytes",
    "blocks_per_sm",
    "hmma",
    "hgmma",
    "roles",
    "performance_losses",
)

DEFAULT_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120")


def roles_exceed_launch_allocation(roles: dict, launch_registers: int, threads: int) -> bool:
    """Whether warp-specialized ``roles`` ({role: {"warpgroups", "registers"}}, registers per thread after setmaxnreg)
    take more registers than a block of ``threads`` launched at ``launch_registers`` each (ptxas's count) holds.
    setmaxnreg.inc draws only on the CTA's pool of what its warpgroups' dec released (the PTX ISA), never on the
    SM's registers the launch left over: such a block's inc waits forever (a 48-register producer beside two
    232-register consumers fits the SM's 65536 but not 384 x 168 = 64512, and hung on an H200)."""
    return sum(128 * role["warpgroups"] * role["registers"] for role in roles.values()
               if role["registers"] is not None) > launch_registers * threads


@dataclass(frozen=True)
class ReportRow:
    compiled: CompiledKernel
    dynamic_smem_bytes: int
    threads: int | None  # block size of its plans (None: not known to the report)
    hmma: bool | None
    hgmma: bool | None = False  # only sm_90a code can have it (None: no disassembler)
    roles: dict | None = None  # {role: {"warpgroups": n, "registers": after setmaxnreg}} (warp-specialized)

    @property
    def exceeds_launch_registers(self) -> bool:
        """Whether the roles' registers after setmaxnreg exceed the block's at launch
        (roles_exceed_launch_allocation)."""
        return bool(self.roles) and (self.threads is None or roles_exceed_launch_allocation(
            self.roles, self.compiled.resources.registers, self.threads))  # no block size: nothing to check against

    @property
    def performance_loss_codes(self) -> list[str]:
        """The codes of ptxas's performance-loss advisories for this instance (nvrtc.CompiledKernel.performance_losses),
        each once: ["C7519"] for a serialized wgmma pipeline."""
        return list(dict.fromkeys(re.search(r"C75\d\d", line)[0] for line in self.compiled.performance_losses))

    @property
    def target(self) -> targets.Target:
        return targets.target(self.compiled.arch)

    @property
    def total_smem_bytes(self) -> int:
        return self.compiled.resources.static_smem_bytes + self.dynamic_smem_bytes

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM allowed by registers, shared memory, warps and blocks (0: cannot launch)."""
        return self.target.blocks_per_sm(self.threads or 32, self.compiled.resources.registers, self.total_smem_bytes)

    @property
    def exceeds_block_smem(self) -> bool:
        return self.total_smem_bytes > self.target.smem_per_block_bytes

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
            "smem_limit_bytes": self.target.smem_per_block_bytes,
            "blocks_per_sm": self.blocks_per_sm,
            "hmma": self.hmma,
            "hgmma": self.hgmma,
            "roles": self.roles,
            "performance_losses": self.performance_loss_codes,
        }


def build_report(
    archs: Sequence[str], jobs: int | None = None, instances: Sequence[KernelInstance] | None = None
) -> tuple[list[ReportRow], list[CompileError]]:
    """Compile (through the cache) and inspect, for each arch, every instance its plans can launch
    (or the given instances for every arch)."""
    pairs = []
    for arch in archs:
        for instance in catalog.instances(targets.target(arch)) if instances is None else instances:
            pairs.append((instance, catalog.compile_arch(instance, arch)))
    results = []
    for arch in dict.fromkeys(a for _, a in pairs):
        mine = [instance for instance, a in pairs if a == arch]
        results += compile_many(mine, [arch], jobs=jobs, return_errors=True, check_sass=True)
    compiled = [r for r in results if isinstance(r, CompiledKernel)]
    errors = [r for r in results if isinstance(r, CompileError)]
    # Verdicts are cached by the workers; threads overlap any cuobjdump still needed.
    with ThreadPoolExecutor(max_workers=max(1, jobs or 2)) as pool:
        hmma = list(pool.map(uses_hmma, compiled))
        warpgroup = list(pool.map(_warpgroup_facts, compiled))
    rows = [
        ReportRow(kernel, catalog.dynamic_smem_bytes(kernel.instance), catalog.threads(kernel.instance), uses,
                  hgmma=None if facts is None else facts["hgmma"], roles=_roles(kernel, facts))
        for kernel, uses, facts in zip(compiled, hmma, warpgroup)
    ]
    return rows, errors


def _warpgroup_facts(compiled: CompiledKernel) -> dict | None:
    """The SASS's wgmma and setmaxnreg facts for arch-specific sm_90a code; no wgmma elsewhere (none to look for)."""
    if not compiled.arch.endswith("a") or compiled.form != "cubin":
        return {"hgmma": False, "setmaxnreg": {"dealloc": [], "alloc": []}}
    return warpgroup_facts(compiled)


def _roles(compiled: CompiledKernel, facts: dict | None) -> dict | None:
    """A warp-specialized kernel's roles (its family's ``warpgroups``: producer, consumer): each one's warpgroups and
    registers per thread after its setmaxnreg (None where the SASS has not exactly one such count)."""
    try:
        warpgroups = getattr(catalog.owner(compiled.instance), "warpgroups", None)
    except KeyError:  # an instance outside the catalog (a test's probe kernel)
        return None
    if warpgroups is None:
        return None
    way = {"producer": "dealloc", "consumer": "alloc"}
    counts = (facts or {}).get("setmaxnreg", {})
    roles = {}
    for role, n in warpgroups(compiled.instance).items():
        found = counts.get(way[role], [])
        roles[role] = {"warpgroups": n, "registers": found[0] if len(found) == 1 else None}
    return roles


def loop_census_json(row: ReportRow) -> dict:
    """{"main_loop": census rows} for a tensor-core instance (loop_census.py), {} for any other kernel."""
    from . import loop_census

    traits = loop_census.traits_by_instance(row.compiled.arch).get(row.compiled.instance)
    if traits is None:
        return {}
    dtype = next(d for d in ("float16", "bfloat16") if traits.instance(d) == row.compiled.instance)
    census = loop_census.instance_census(traits, dtype, row.compiled.arch, row.compiled)
    return {"main_loop": [{key: value for key, value in r.as_json().items() if key not in ("kernel", "arch")}
                          for r in census]}


def archs_to_report(requested: Sequence[str] | None, known: Sequence[int]) -> tuple[list[str], list[str]]:
    """(archs to compile, default archs skipped) for NVRTC knowing ``known`` (80 is sm_80); ``requested`` None
    means the defaults. A requested arch NVRTC does not know is a ValueError."""
    archs = list(DEFAULT_ARCHS if requested is None else requested)
    unknown = [arch for arch in archs if targets.arch_number(arch) not in known]
    if requested is not None and unknown:
        major, minor = nvrtc_version()
        raise ValueError(f"NVRTC {major}.{minor} cannot compile for {', '.join(unknown)} (it knows "
                         f"{', '.join(f'sm_{a}' for a in known)}): install a newer NVRTC or leave these out")
    return [arch for arch in archs if arch not in unknown], unknown


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
        "limit B",
        "hmma",
        "roles: wg x regs",
        "blocks/SM",
        "compile s",
    )
    table = [headers]
    for row in rows:
        r = row.compiled.resources
        blocks = row.blocks_per_sm
        table.append(
            (
                row.compiled.instance.name_expr,
                row.compiled.arch,
                str(r.registers),
                f"{r.spill_store_bytes}/{r.spill_load_bytes}",
                str(r.stack_frame_bytes),
                str(r.static_smem_bytes),
                str(row.dynamic_smem_bytes),
                str(row.target.smem_per_block_bytes),
                "HGMMA" if row.hgmma else _yes_no(row.hmma),
                " ".join(f"{name[0]}{r['warpgroups']}x{r['registers']}" for name, r in (row.roles or {}).items()),
                str(blocks) if blocks else "TOO BIG",
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
    parser.add_argument("--arch", nargs="+", default=None, choices=list(targets.TARGETS),
                        help="real GPU archs (default: those of " + " ".join(DEFAULT_ARCHS) + " NVRTC knows)")
    parser.add_argument("--json", action="store_true", help="print a JSON list (keys: " + ", ".join(JSON_KEYS) + ")")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    parser.add_argument("--no-spills", action="store_true", help="also exit 1 if any instance spills registers")
    parser.add_argument("--no-perf-loss", action="store_true",
                        help="also exit 1 if ptxas says an instance's code runs slower than written (C75xx: wgmma "
                             "serialized, waits injected, setmaxnreg ignored)")
    parser.add_argument("--loop", action="store_true",
                        help="with --json: add each tensor-core instance's loop census (key main_loop; "
                             "python -m cuflash.kernels loop)")
    args = parser.parse_args(argv)

    try:
        archs, skipped = archs_to_report(args.arch, supported_archs())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if skipped:
        major, minor = nvrtc_version()
        print(f"note: NVRTC {major}.{minor} does not know {', '.join(skipped)}: not reported", file=sys.stderr)
    started = time.perf_counter()
    rows, errors = build_report(archs, jobs=args.jobs)
    elapsed = time.perf_counter() - started

    if args.json:
        print(json.dumps([{**row.as_json(), **(loop_census_json(row) if args.loop else {})} for row in rows],
                         indent=1))
    else:
        print(format_table(rows))
        for row in rows:
            for warning in row.compiled.warnings + row.compiled.performance_losses:
                print(f"warning: {row.compiled.instance.name_expr} ({row.compiled.arch}): {warning}")
    too_big = [row for row in rows if row.exceeds_block_smem]
    for row in too_big:
        limit = row.target.smem_per_block_bytes
        print(
            f"error: {row.compiled.instance.name_expr} needs {row.total_smem_bytes} bytes of shared memory per block "
            f"(static {row.compiled.resources.static_smem_bytes} + dynamic {row.dynamic_smem_bytes}); "
            f"{row.compiled.arch} allows {limit}",
            file=sys.stderr,
        )
    # Without a disassembler (hgmma None) the counts are unknown, not wrong.
    over = [row for row in rows if row.exceeds_launch_registers or (row.roles and row.hgmma is not None and any(
        r["registers"] is None for r in row.roles.values()))]
    for row in over:
        print(f"error: {row.compiled.instance.name_expr} ({row.compiled.arch}): its roles after setmaxnreg "
              f"{row.roles} exceed the block's {row.compiled.resources.registers} x {row.threads} registers at launch "
              f"or have no single count",
              file=sys.stderr)
    spilling = [row for row in rows if row.compiled.resources.spill_store_bytes
                or row.compiled.resources.spill_load_bytes] if args.no_spills else []
    for row in spilling:
        r = row.compiled.resources
        print(f"error: {row.compiled.instance.name_expr} spills on {row.compiled.arch} ({r.spill_store_bytes} bytes "
              f"stored, {r.spill_load_bytes} loaded, at {r.registers} registers)", file=sys.stderr)
    losing = [row for row in rows if row.compiled.performance_losses] if args.no_perf_loss else []
    for row in losing:
        print(f"error: {row.compiled.instance.name_expr} ({row.compiled.arch}): ptxas reports a performance loss: "
              + " | ".join(row.compiled.performance_losses), file=sys.stderr)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    print(
        f"{len(rows)} compiled, {len(errors)} failed, {elapsed:.1f} s wall "
        f"(sum of NVRTC times when built: {sum(r.compiled.compile_seconds for r in rows):.1f} s)",
        file=sys.stderr,
    )
    return 1 if errors or too_big or over or spilling or losing else 0
