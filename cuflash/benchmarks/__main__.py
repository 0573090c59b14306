"""Benchmarks CLI.

    python3 -m cuflash.benchmarks traffic [--dtype float16] [--algorithms standard fa1 fa2]
    python3 -m cuflash.benchmarks speed [--headdims 64 128] [--seqlens 512 ... 16384] [--causal]

``traffic`` prints global-memory bytes measured by the CPU simulator (not times).
``speed`` times the kernels on a CUDA GPU (CuPy arrays, CUDA events); without a
GPU it refuses: simulator timings are not GPU speed.
"""

from __future__ import annotations

import argparse
import sys

from cuflash.kernels.catalog import algorithms as available_algorithms

from . import speed, traffic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m cuflash.benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("traffic", help="global-memory traffic per algorithm, measured by the simulator")
    t.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    t.add_argument("--algorithms", nargs="+", default=None)
    g = sub.add_parser("speed", help="forward/backward TFLOPs/s on a CUDA GPU")
    g.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    g.add_argument("--algorithms", nargs="+", default=None)
    g.add_argument("--headdims", nargs="+", type=int, default=[64, 128])
    g.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    g.add_argument("--causal", action="store_true")
    g.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    algorithms = getattr(args, "algorithms", None) or available_algorithms()
    unknown = sorted(set(algorithms) - set(available_algorithms()))
    if unknown:
        parser.error(f"unknown algorithms {unknown}; available: {available_algorithms()}")
    if args.command == "speed":
        try:
            print(speed.table(algorithms, args.headdims, args.seqlens, args.causal, args.dtype, args.repeats))
        except speed.NoGpuError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.command == "traffic":
        print(traffic.table(algorithms, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
