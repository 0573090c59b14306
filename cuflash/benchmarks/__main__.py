"""Benchmarks CLI.

    python3 -m cuflash.benchmarks traffic [--dtype float16] [--algorithms standard fa1 fa2]

``traffic`` prints global-memory bytes measured by the CPU simulator (not times).
"""

from __future__ import annotations

import argparse
import sys

from cuflash.kernels.plans import available_algorithms

from . import traffic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m cuflash.benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("traffic", help="global-memory traffic per algorithm, measured by the simulator")
    t.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    t.add_argument("--algorithms", nargs="+", default=None)
    args = parser.parse_args(argv)
    if args.command == "traffic":
        algorithms = args.algorithms or available_algorithms()
        unknown = sorted(set(algorithms) - set(available_algorithms()))
        if unknown:
            parser.error(f"unknown algorithms {unknown}; available: {available_algorithms()}")
        print(traffic.table(algorithms, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
