"""Benchmarks CLI.

    python3 -m cuflash.benchmarks speed [--headdims 64 128 256] [--seqlens 512 ... 16384] [--causal both]
                                        [--dtypes float16 bfloat16] [--systems ...] [--budget-s S] [--out DIR]
                                        [--flex document prefix-lm relative-bias]
    python3 -m cuflash.benchmarks seeds [--out DIR]
    python3 -m cuflash.benchmarks validate-gpu --out DIR
    python3 -m cuflash.benchmarks first-gpu --out DIR
    python3 -m cuflash.benchmarks splitkv [--out DIR] [--dtypes bfloat16 float16] [--splits 1 0 16] [--budget-s S]
    python3 -m cuflash.benchmarks host --out DIR
    python3 -m cuflash.benchmarks traffic [--out DIR] [--seqlens ...] [--headdims ...] [--flex VARIANT ...]
    python3 -m cuflash.benchmarks profile [--out DIR] [--arch sm_80 sm_90]

``speed``, ``seeds``, ``validate-gpu``, ``first-gpu`` and ``splitkv`` time kernels on a CUDA
GPU (device ms with the L2 flushed before every timed run, and host us per call;
timing.py) beside the peers found in the environment; without a GPU they refuse
with a one-line reason and write nothing. ``first-gpu`` is the first command for
a new GPU machine: toolchain, gpu tests, sanitizers, the sweep, split-KV, Nsight
Compute and the host benchmark within 9 minutes, one summary (first_gpu.py).
``splitkv`` times short-query, long-key forwards with num_splits 1, 0 (the
heuristic) and a fixed count, checked against the unsplit call (splitkv.py). ``host``
times cuflash's host path per call (host.py). ``traffic`` and ``profile`` are
counts from the CPU simulator and the compile report, never times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .workloads import DTYPES, FA2_HEADDIMS, FA2_SEQLENS, DIRECTIONS, FLEX_VARIANTS, Workload, fa2_sweep, flex_sweep

# The llm.c attention benchmark the CUDA tutorials use, and the A100 figures they publish (forward, ms).
SEEDS_SETTING = dict(batch=8, seqlen=1024, nheads=12, headdim=64)
SEEDS_PUBLISHED_MS = (
    ("naive three-kernel attention", 238.9),
    ("simple FlashAttention-1 kernel", 536.7),
    ("cuBLAS matmuls + softmax", 2.03),
    ("cuBLAS with fused online softmax", 1.04),
    ("cuBLAS, float16", 0.70),
)


def _causal_values(choice: str) -> tuple[bool, ...]:
    return {"both": (False, True), "true": (True,), "false": (False,)}[choice]


def _timed_run(systems, workloads, directions, repeats, warmup, out: Path | None, budget_s: float | None = None):
    """Refuse without a GPU (before writing anything), else sweep, print and write the results."""
    from . import speed

    result = speed.sweep_on_gpu(systems, workloads, directions=directions, warmup=warmup, repeats=repeats,
                                budget_s=budget_s)
    print(speed.format_table(result))
    if out is not None:
        for path in speed.write_outputs(result, out):
            print(f"wrote {path}")
    return result


def validate_tools() -> tuple[str, ...]:
    from .validate import SANITIZER_TOOLS

    return SANITIZER_TOOLS


def _command_of(argv: list[str] | None) -> str | None:
    args = sys.argv[1:] if argv is None else argv
    return args[0] if args else None


def _host_module():
    """cuflash/benchmarks/host.py, imported only for the ``host`` command (None if it is not there)."""
    try:
        from . import host
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.host":
            raise
        return None
    return host


def main(argv: list[str] | None = None) -> int:
    from . import peers

    parser = argparse.ArgumentParser(prog="python3 -m cuflash.benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("speed", help="TFLOP/s of cuflash and its peers on a CUDA GPU, FA2's sweep")
    g.add_argument("--headdims", nargs="+", type=int, default=list(FA2_HEADDIMS))
    g.add_argument("--seqlens", nargs="+", type=int, default=list(FA2_SEQLENS))
    g.add_argument("--causal", choices=["both", "true", "false"], default="both")
    g.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float16", "bfloat16"])
    g.add_argument("--directions", nargs="+", choices=DIRECTIONS, default=list(DIRECTIONS))
    g.add_argument("--systems", nargs="+", default=None, help=f"default: all of {peers.system_keys()}")
    g.add_argument("--repeats", type=int, default=10)
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--out", type=Path, default=Path("cuflash-speed"), help="folder for JSON, CSV and PNG")
    g.add_argument("--budget-s", type=float, default=None,
                   help="seconds the sweep may take: points run shortest seqlen first, and a point expected to "
                        "overrun is skipped (and listed as skipped)")
    g.add_argument("--flex", nargs="*", choices=FLEX_VARIANTS, default=[],
                   help="also time cuflash.flex_attention with these variants (document mask of 8 documents, "
                        "prefix-LM, relative-position bias) at the same points, non-causal; only cuflash-fa2 runs "
                        "them (FLOPs: the visible scores')")

    s = sub.add_parser("seeds", help="the llm.c attention benchmark setting (B=8, T=1024, C=768, NH=12)")
    s.add_argument("--repeats", type=int, default=10)
    s.add_argument("--out", type=Path, default=None)

    v = sub.add_parser("validate-gpu", help="release check on a GPU: gpu tests, compute-sanitizer, speed, ncu")
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--skip", nargs="+", default=[], choices=["tests", "sanitizer", "speed", "ncu"])
    v.add_argument("--sanitizer-tools", nargs="+", default=list(validate_tools()), choices=list(validate_tools()))
    v.add_argument("--sanitizer-grid", choices=["all", "tensor-core", "flex"], default="all",
                   help="every family and variant (and the flex variants), one fa2 tensor-core forward and backward, "
                        "or the flex variants only")
    v.add_argument("--step-timeout", type=int, default=None, help="seconds for each tool run (default per step)")

    f = sub.add_parser("first-gpu", help="first command on a new GPU machine: every check and figure in 9 minutes")
    f.add_argument("--out", type=Path, required=True)

    k = sub.add_parser("splitkv", help="split-KV decode: num_splits 1, 0 (heuristic) and n on short-query, long-key "
                                       "shapes")
    k.add_argument("--out", type=Path, default=Path("cuflash-splitkv"), help="folder for splitkv.json and splitkv.md")
    k.add_argument("--dtypes", nargs="+", choices=["float16", "bfloat16"], default=["bfloat16", "float16"])
    k.add_argument("--splits", nargs="+", type=int, default=None, help="num_splits values timed (default 1 0 16)")
    k.add_argument("--repeats", type=int, default=10)
    k.add_argument("--warmup", type=int, default=3)
    k.add_argument("--budget-s", type=float, default=None,
                   help="seconds the run may take: a shape is started only while the time left exceeds what the "
                        "latest shape took (the rest are listed as skipped)")

    h = sub.add_parser("host", help="host microseconds per call of cuflash's API (host.py)")
    host_module = _host_module() if _command_of(argv) == "host" else None
    if host_module is not None:
        host_module.add_arguments(h)

    t = sub.add_parser("traffic", help="global-memory bytes per kernel, counted by the simulator")
    t.add_argument("--dtype", default="float16", choices=DTYPES)
    t.add_argument("--algorithms", nargs="+", default=None)
    t.add_argument("--out", type=Path, default=None, help="folder for traffic.json and traffic.png (a sweep)")
    t.add_argument("--seqlens", nargs="+", type=int, default=[128, 256, 512])
    t.add_argument("--headdims", nargs="+", type=int, default=[64])
    t.add_argument("--flex", nargs="+", choices=FLEX_VARIANTS, default=None,
                   help="bytes read by these flex variants beside dense fa2 (the first seqlen and head dim)")

    p = sub.add_parser("profile", help="bank conflicts per access site (simulator) and the compile report")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--headdims", nargs="+", type=int, default=[64, 128])

    args, unknown = parser.parse_known_args(argv)
    if unknown and not (args.command == "host" and host_module is None):  # then host.py's absence is the error
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from cuflash.kernels.catalog import algorithms as available_algorithms

    from .timing import NoGpuError

    try:
        if args.command == "speed":
            systems = peers.select(args.systems)
            workloads = fa2_sweep(args.headdims, args.seqlens, _causal_values(args.causal), args.dtypes)
            workloads += flex_sweep(args.flex, args.headdims, args.seqlens, args.dtypes) if args.flex else []
            if args.budget_s is not None:  # cheapest first: running out of time drops the longest sequences
                workloads.sort(key=lambda w: w.seqlen)
            _timed_run(systems, workloads, args.directions, args.repeats, args.warmup, args.out, args.budget_s)
        elif args.command == "seeds":
            systems = [peers.Cuflash(a) for a in available_algorithms()]
            workloads = [Workload(**SEEDS_SETTING, causal=True, dtype=d) for d in ("float32", "float16")]
            _timed_run(systems, workloads, ("forward",), args.repeats, 3, args.out)
            print("\nFor orientation only: the llm.c CUDA tutorials' published forward times for this setting, "
                  "measured on an A100 with another codebase (not comparable to the numbers above):")
            for name, ms in SEEDS_PUBLISHED_MS:
                print(f"  {name:<36} {ms:8.2f} ms")
        elif args.command == "validate-gpu":
            from . import validate

            return validate.main(args.out, skip=set(args.skip), sanitizer_tools=args.sanitizer_tools,
                                 sanitizer_grid=args.sanitizer_grid, step_timeout=args.step_timeout)
        elif args.command == "first-gpu":
            from . import first_gpu

            return first_gpu.main(args.out)
        elif args.command == "splitkv":
            from . import splitkv

            return splitkv.main(args.out, dtypes=tuple(args.dtypes), counts=tuple(args.splits or splitkv.SPLIT_COUNTS),
                                warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s)
        elif args.command == "host":
            if host_module is None:
                print("error: the host benchmark is not installed here (cuflash/benchmarks/host.py is missing)",
                      file=sys.stderr)
                return 2
            return host_module.main(args)
        elif args.command == "traffic":
            from . import traffic

            algorithms = args.algorithms or available_algorithms()
            unknown = sorted(set(algorithms) - set(available_algorithms()))
            if unknown:
                parser.error(f"unknown algorithms {unknown}; available: {available_algorithms()}")
            if args.flex:
                print(traffic.flex_table(args.flex, seqlen=args.seqlens[0], headdim=args.headdims[0],
                                         dtype=args.dtype))
            elif args.out is None:
                print(traffic.table(algorithms, dtype=args.dtype))
            else:
                for path in traffic.sweep_outputs(algorithms, args.out, seqlens=args.seqlens, headdims=args.headdims,
                                                  dtype=args.dtype):
                    print(f"wrote {path}")
        elif args.command == "profile":
            from . import profile

            for path in profile.write_outputs(args.out, arches=args.arch, seqlen=args.seqlen, headdims=args.headdims):
                print(f"wrote {path}")
    except NoGpuError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
