"""The main job for now: run every available algorithm on the CPU simulator and check it.

    python3 -m cuflash.demo [--dtype float16] [--causal/--no-causal]

Runs forward and backward of each algorithm on an odd-shaped GQA problem, judges
the results against the float64 reference with FlashAttention's tolerance rule,
and prints the errors beside their bounds and the global memory traffic the
simulator measured. Exits non-zero if any check fails. These are CPU-simulator
runs: the times printed are not GPU speed.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash._dtypes import element_dtype


def _dtype(name: str) -> np.dtype:
    return element_dtype(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--shape", default="1,113,203,4,2,59", help="batch,seqlen_q,seqlen_k,nheads,nheads_k,headdim")
    args = parser.parse_args(argv)
    b, sq, sk, h, hk, d = (int(x) for x in args.shape.split(","))

    rng = np.random.default_rng(0)
    dt = _dtype(args.dtype)
    q = rng.standard_normal((b, sq, h, d)).astype(dt)
    k = rng.standard_normal((b, sk, hk, d)).astype(dt)
    v = rng.standard_normal((b, sk, hk, d)).astype(dt)
    dout = rng.standard_normal((b, sq, h, d)).astype(dt)
    print(f"problem: batch {b}, seqlen_q {sq}, seqlen_k {sk}, nheads {h}, nheads_k {hk}, headdim {d}, "
          f"{args.dtype}, causal={args.causal}  (CPU simulator; times are not GPU speed)")

    fwd_ref = tol.forward_references(q, k, v, causal=args.causal)
    bwd_ref = tol.backward_references(dout, q, k, v, causal=args.causal)
    failures = 0
    for algorithm in cuflash.available_algorithms():
        start = time.perf_counter()
        try:
            with sim.record() as rec:
                out, lse = cuflash.attention(q, k, v, causal=args.causal, algorithm=algorithm, return_lse=True)
                dq, dk, dv = cuflash.attention_backward(
                    dout, q, k, v, out, lse, causal=args.causal, algorithm=algorithm
                )
            checks = [
                tol.check_close("out", out, fwd_ref.out, fwd_ref.out_lowp, tol.FORWARD_FACTOR),
                tol.check_close("lse", lse, fwd_ref.lse, fwd_ref.lse_lowp, tol.FORWARD_FACTOR),
            ] + [
                tol.check_close(name, got, getattr(bwd_ref, name), getattr(bwd_ref, name + "_lowp"),
                                tol.BACKWARD_FACTOR, atol=1e-5 if args.causal else 0.0)
                for name, got in (("dq", dq), ("dk", dk), ("dv", dv))
            ]
        except (AssertionError, sim.KernelError) as err:
            failures += 1
            print(f"{algorithm:>9}: FAILED: {err}")
            continue
        seconds = time.perf_counter() - start
        read = sum(r.global_bytes_read for r in rec.launches)
        written = sum(r.global_bytes_written for r in rec.launches)
        worst = max(c.max_error / c.bound for c in checks)
        print(f"{algorithm:>9}: ok  worst error/bound {worst:.3f}  launches {len(rec.launches):2d}  "
              f"global read {read / 1e6:8.3f} MB  written {written / 1e6:8.3f} MB  ({seconds:.1f} s of CPU-simulator time)")
    if not cuflash.available_algorithms():
        print("no algorithm is available")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
