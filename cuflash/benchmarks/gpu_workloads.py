"""Small GPU programs that validate-gpu runs under compute-sanitizer and Nsight Compute.

    python3 -m cuflash.benchmarks.gpu_workloads sanitizer   # every family and variant, small shapes
    python3 -m cuflash.benchmarks.gpu_workloads ncu         # the fa2 forward and backward at NCU_SHAPE

The sanitizer grid covers every algorithm of the catalog, each of its variants
(through the dtypes the variant serves), both causal settings, GQA, and sequence
lengths that are no block multiple, in rotation rather than every combination so
that racecheck stays within minutes. Each run prints one line per case.
"""

from __future__ import annotations

import sys

import numpy as np

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): ragged ends, seqlen_q != seqlen_k, GQA, a head dim
# that is no power of two, and a single-row query.
SANITIZER_SHAPES = ((2, 67, 131, 4, 2, 40), (1, 1, 77, 2, 1, 64), (1, 96, 33, 2, 2, 128))
# The launch Nsight Compute measures and the simulator counts, with the same shape and inputs.
NCU_SHAPE = dict(batch=1, seqlen=512, nheads=2, headdim=64, dtype="float16", causal=False)


def sanitizer_cases():
    """(algorithm, variant, dtype, causal, shape) in rotation over every axis."""
    from cuflash.kernels import catalog

    cases, turn = [], 0
    for algorithm in catalog.algorithms():
        for variant in catalog.variants(algorithm):
            for dtype in variant.dtypes:
                shape = SANITIZER_SHAPES[turn % len(SANITIZER_SHAPES)]
                cases.append((algorithm, variant.name, dtype, turn % 2 == 0, shape))
                turn += 1
    return cases


def run_sanitizer_grid() -> None:
    import cupy

    import cuflash
    from cuflash.testing import random_qkv

    for algorithm, variant, dtype, causal, shape in sanitizer_cases():
        rng = np.random.default_rng(0)
        q, k, v = (cupy.asarray(x) for x in random_qkv(rng, *shape, dtype))
        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
        dout = cupy.asarray(rng.standard_normal(out.shape).astype(q.dtype))
        for deterministic in (False, True):
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm,
                                       deterministic=deterministic)
        cupy.cuda.runtime.deviceSynchronize()
        print(f"case {algorithm}/{variant} {dtype} causal={causal} shape={shape}: ran", flush=True)


def ncu_inputs():
    from cuflash.testing import random_qkv

    s = NCU_SHAPE
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, s["batch"], s["seqlen"], s["seqlen"], s["nheads"], s["nheads"], s["headdim"], s["dtype"])
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    return q, k, v, dout


def run_ncu_target() -> None:
    """The fa2 forward and backward once each on the GPU (the launches ncu profiles)."""
    import cupy

    import cuflash

    q, k, v, dout = (cupy.asarray(x) for x in ncu_inputs())
    out, lse = cuflash.attention(q, k, v, causal=NCU_SHAPE["causal"], algorithm="fa2", return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=NCU_SHAPE["causal"], algorithm="fa2")
    cupy.cuda.runtime.deviceSynchronize()


def simulator_counts() -> list[dict]:
    """The same fa2 forward and backward on the simulator in profile mode: traffic and bank conflicts per kernel."""
    import cuflash
    from cuflash import sim

    q, k, v, dout = ncu_inputs()
    with sim.checking("profile"), sim.record() as rec:
        out, lse = cuflash.attention(q, k, v, causal=NCU_SHAPE["causal"], algorithm="fa2", return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=NCU_SHAPE["causal"], algorithm="fa2")
    return [
        {
            "kernel": r.kernel,
            "grid": list(r.grid),
            "block": list(r.block),
            "global_bytes_read": r.global_bytes_read,
            "global_bytes_written": r.global_bytes_written,
            "shared_wavefronts": sum(s.wavefronts for s in r.shared_access_sites),
            "shared_excess_wavefronts": sum(s.excess for s in r.shared_access_sites),
        }
        for r in rec.launches
    ]


if __name__ == "__main__":
    {"sanitizer": run_sanitizer_grid, "ncu": run_ncu_target}[sys.argv[1]]()
