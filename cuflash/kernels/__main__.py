"""Command line of cuflash.kernels: ``python -m cuflash.kernels report --arch sm_80 sm_90 [--json] [--jobs N]``,
``python -m cuflash.kernels loop --arch sm_80 sm_90 [--json]``, ``python -m cuflash.kernels flex [--arch sm_80] [--mods ...]``
and ``python -m cuflash.kernels toolchain``."""

from __future__ import annotations

import sys

COMMANDS = {
    "report": "compile every catalog instance and print its resource usage",
    "toolchain": "the installed NVRTC and CUDA headers, the driver, and the code each local GPU gets",
    "loop": "the loop census: what one iteration of each tensor-core main loop issues, from SASS",
    "flex": "cold NVRTC seconds per flex kernel instance of example mods (a fresh cache; needs JAX)",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m cuflash.kernels {" + ",".join(COMMANDS) + "} [options]", file=sys.stderr)
        for name, summary in COMMANDS.items():
            print(f"  {name}: {summary}", file=sys.stderr)
        return 2
    if argv[0] == "toolchain":
        from . import toolchain

        lines, ok = toolchain.machine_report()
        print("\n".join(lines))
        return 0 if ok else 1
    if argv[0] == "loop":
        from . import loop_census

        return loop_census.main(argv[1:])
    if argv[0] == "flex":
        from ..flex import _compile_report

        return _compile_report.main(argv[1:])
    from . import report

    return report.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
