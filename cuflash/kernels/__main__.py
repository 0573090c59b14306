"""Command line of cuflash.kernels: ``python -m cuflash.kernels report --arch sm_80 sm_90 [--json] [--jobs N]``."""

from __future__ import annotations

import sys

COMMANDS = {"report": "compile every catalog instance and print its resource usage"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m cuflash.kernels {" + ",".join(COMMANDS) + "} [options]", file=sys.stderr)
        for name, summary in COMMANDS.items():
            print(f"  {name}: {summary}", file=sys.stderr)
        return 2
    from . import report

    return report.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
