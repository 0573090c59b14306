"""Measure the simulator's cost of one __syncthreads(): ``python -m cuflash.sim.bench_barrier``.

A single block runs a loop of barriers; (time(N barriers) - time(0)) / N is the
cost of one barrier for that block size, which is dominated by one fiber switch
per thread. One worker thread, best of several runs.
"""

from __future__ import annotations

import argparse
import os
import struct
import time

from .._paths import CUDA_SRC
from ..kernels.program import KernelInstance
from ._launch import launch

KERNEL = KernelInstance(str(CUDA_SRC / "arch" / "sim" / "bench_barrier.cu"), "cuflash_sim_bench::barrier_loop_kernel")


def _launch_seconds(threads: int, iterations: int, repeats: int) -> float:
    params = struct.pack("i", iterations)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        launch(KERNEL, 1, threads, 0, params, [])
        best = min(best, time.perf_counter() - start)
    return best


def barrier_cost(threads: int, iterations: int = 20000, repeats: int = 5) -> float:
    """Seconds per __syncthreads() of a block of `threads` threads."""
    _launch_seconds(threads, 1, 1)  # build or load the library, commit the fiber stacks
    empty = _launch_seconds(threads, 0, repeats)
    full = _launch_seconds(threads, iterations, repeats)
    return (full - empty) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[32, 128, 256, 1024])
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    os.environ["CUFLASH_SIM_THREADS"] = "1"
    _launch_seconds(32, 1, 1)  # build / load the library first
    for threads in args.threads:
        cost = barrier_cost(threads, args.iterations)
        print(
            f"__syncthreads() with {threads:4d} threads: {cost * 1e6:7.2f} us per barrier"
            f" ({cost / threads * 1e9:5.1f} ns per thread)"
        )


if __name__ == "__main__":
    main()
