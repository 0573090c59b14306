"""Small GPU programs that validate-gpu runs under compute-sanitizer and Nsight Compute.

    python3 -m cuflash.benchmarks.gpu_workloads sanitizer              # every family and variant, small shapes
    python3 -m cuflash.benchmarks.gpu_workloads sanitizer tensor-core  # one fa2 tensor-core forward and backward
    python3 -m cuflash.benchmarks.gpu_workloads sanitizer flex         # each flex variant, forward and backward
    python3 -m cuflash.benchmarks.gpu_workloads ncu                    # the fa2 forward and backward at NCU_SHAPE
    python3 -m cuflash.benchmarks.gpu_workloads ncu-d128               # the same at NCU_D128_SETTING (first-gpu)
    python3 -m cuflash.benchmarks.gpu_workloads smoke                  # SMOKE_CASE, every launch watched (first-gpu)

The sanitizer grid covers every algorithm of the catalog, each of its variants
(through the dtypes the variant serves), both causal settings, GQA, and sequence
lengths that are no block multiple, in rotation rather than every combination so
that racecheck stays within minutes. Each run prints one line per case.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import numpy as np

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): ragged ends, seqlen_q != seqlen_k, GQA, a head dim
# that is no power of two, and a single-row query.
SANITIZER_SHAPES = ((2, 67, 131, 4, 2, 40), (1, 1, 77, 2, 1, 64), (1, 96, 33, 2, 2, 128))
# The launch Nsight Compute measures and the simulator counts, with the same shape and inputs.
NCU_SHAPE = dict(batch=1, seqlen=512, nheads=2, headdim=64, dtype="float16", causal=False)
# first-gpu's Nsight Compute point: FA2's benchmark setting at seqlen 2k, head dim 128 (batch 8, 16 heads), so the
# tensor-core kernels run full waves as in the speed sweep.
NCU_D128_SHAPE = dict(batch=8, seqlen=2048, nheads=16, headdim=128, dtype="float16", causal=False)
# first-gpu's sanitizer case: one tensor-core instance each way (float16, head dim 128, ragged, GQA, causal).
TENSOR_CORE_CASE = ("fa2", "float16", True, (1, 96, 131, 4, 2, 128))
# first-gpu's smoke case, before every other step: the sanitizer's tensor-core case (on sm_90 the wgmma forward and
# backward), forward, backward and deterministic backward, every launch synchronized and watched (LaunchWatch).
SMOKE_CASE = TENSOR_CORE_CASE
# At smoke shapes every kernel takes milliseconds: one still running after this long hangs.
SMOKE_KERNEL_LIMIT_S = 15.0
# The flex sanitizer cases: each variant of the speed sweep (workloads.FLEX_VARIANTS) on tensor cores and SIMT,
# self-attention of a ragged length with GQA (the variants' mods are defined for seqlen_q == seqlen_k).
FLEX_CASES = (("float16", (1, 131, 131, 4, 2, 64)), ("float32", (1, 77, 77, 2, 1, 40)))


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


def run_sanitizer_grid(which: str = "all") -> None:
    """Every case of sanitizer_cases() and the flex cases, or with ``which="tensor-core"`` only TENSOR_CORE_CASE,
    with ``which="flex"`` only the flex cases (FLEX_CASES)."""
    import cupy

    import cuflash
    from cuflash.testing import random_qkv

    if which == "flex":
        run_flex_sanitizer_cases()
        return
    if which == "tensor-core":
        algorithm, dtype, causal, shape = TENSOR_CORE_CASE
        cases = [(algorithm, "tensor-core", dtype, causal, shape)]
    else:
        cases = sanitizer_cases()
    for algorithm, variant, dtype, causal, shape in cases:
        rng = np.random.default_rng(0)
        q, k, v = (cupy.asarray(x) for x in random_qkv(rng, *shape, dtype))
        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
        dout = cupy.asarray(rng.standard_normal(out.shape).astype(q.dtype))
        for deterministic in (False, True):
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm,
                                       deterministic=deterministic)
        cupy.cuda.runtime.deviceSynchronize()
        print(f"case {algorithm}/{variant} {dtype} causal={causal} shape={shape}: ran", flush=True)
    if which == "all":
        run_flex_sanitizer_cases()


def run_flex_sanitizer_cases() -> None:
    """Each flex variant's forward and backward (its mask_mod through a block mask) on the GPU, per FLEX_CASES."""
    import cupy

    import cuflash
    from cuflash.testing import random_qkv

    from .peers import _flex_options
    from .workloads import FLEX_VARIANTS

    for dtype, shape in FLEX_CASES:
        for variant in FLEX_VARIANTS:
            rng = np.random.default_rng(0)
            q, k, v = (cupy.asarray(x) for x in random_qkv(rng, *shape, dtype))
            mods = _flex_options(variant, shape[1], shape[3])
            out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
            dout = cupy.asarray(rng.standard_normal(out.shape).astype(q.dtype))
            cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)
            cupy.cuda.runtime.deviceSynchronize()
            print(f"case flex/{variant} {dtype} shape={shape}: ran", flush=True)


def ncu_inputs(s=NCU_SHAPE):
    from cuflash.testing import random_qkv

    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, s["batch"], s["seqlen"], s["seqlen"], s["nheads"], s["nheads"], s["headdim"], s["dtype"])
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    return q, k, v, dout


def run_ncu_target(shape=NCU_SHAPE) -> None:
    """The fa2 forward and backward once each on the GPU (the launches ncu profiles)."""
    import cupy

    import cuflash

    q, k, v, dout = (cupy.asarray(x) for x in ncu_inputs(shape))
    out, lse = cuflash.attention(q, k, v, causal=shape["causal"], algorithm="fa2", return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=shape["causal"], algorithm="fa2")
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


class LaunchWatch:
    """Runs each kernel launch, then ``synchronize``, and names a kernel still running ``limit_s`` after its launch
    returned: ``on_hang(name, seconds)`` from a watchdog thread (a running CUDA kernel cannot be cancelled, and a
    process waiting on one hangs whatever it does next). Compiles and module loads happen inside the launch call,
    while no kernel of this process runs, so they never count. Unsynchronized, a hung kernel surfaces later and
    elsewhere: the first H200 run of the wgmma backward (a setmaxnreg.inc waiting forever) hung in the next
    kernel's module load (cuModuleLoad waits for the device), and every later first-gpu step timed out."""

    def __init__(self, synchronize: Callable[[], object], limit_s: float, on_hang: Callable[[str, float], object],
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.25):
        self.synchronize, self.limit_s, self.on_hang = synchronize, limit_s, on_hang
        self.clock, self.poll_s = clock, poll_s
        self._running: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def run(self, name: str, launch: Callable[[], object]) -> None:
        launch()
        with self._lock:
            self._running = (name, self.clock())
        self.synchronize()
        with self._lock:
            self._running = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                running = self._running
            if running is not None and self.clock() - running[1] > self.limit_s:
                self.on_hang(running[0], self.clock() - running[1])
                return


def _report_hang_and_exit(name: str, seconds: float) -> None:
    print(f"smoke: HANG: {name} still running {seconds:.0f} s after its launch", flush=True)
    os._exit(3)


def run_smoke(limit_s: float = SMOKE_KERNEL_LIMIT_S) -> None:
    """SMOKE_CASE's forward, backward and deterministic backward with every kernel launch synchronized and watched
    (LaunchWatch): one line per direction, or "smoke: HANG: <kernel> ..." and exit status 3."""
    import cupy

    import cuflash
    from cuflash.backends import cupy_gpu
    from cuflash.testing import random_qkv

    watch = LaunchWatch(cupy.cuda.runtime.deviceSynchronize, limit_s, _report_hang_and_exit)
    unwatched = cupy_gpu.CupyBackend.launch
    launched: list[str] = []

    def watched(backend, plan, params, buffers):
        name = f"{plan.kernel.name_expr} grid {tuple(plan.grid)} block {tuple(plan.block)}"
        launched.append(plan.kernel.name_expr)
        watch.run(name, lambda: unwatched(backend, plan, params, buffers))

    cupy_gpu.CupyBackend.launch = watched
    try:
        algorithm, dtype, causal, shape = SMOKE_CASE
        rng = np.random.default_rng(0)
        q, k, v = (cupy.asarray(x) for x in random_qkv(rng, *shape, dtype))
        dout = None
        for direction in ("forward", "backward", "deterministic backward"):
            began, first = time.monotonic(), len(launched)
            if direction == "forward":
                out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
                dout = cupy.asarray(rng.standard_normal(out.shape).astype(q.dtype))
            else:
                cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm,
                                           deterministic=direction.startswith("deterministic"))
            kernels = ", ".join(dict.fromkeys(launched[first:]))
            print(f"smoke: {algorithm} {dtype} causal={causal} shape={shape} {direction}: ok in "
                  f"{time.monotonic() - began:.1f} s (compile included): {kernels}", flush=True)
    finally:
        cupy_gpu.CupyBackend.launch = unwatched
        watch.close()


if __name__ == "__main__":
    if sys.argv[1] == "smoke":
        run_smoke()
    elif sys.argv[1] == "sanitizer":
        run_sanitizer_grid(*sys.argv[2:3])
    else:
        run_ncu_target({"ncu": NCU_SHAPE, "ncu-d128": NCU_D128_SHAPE}[sys.argv[1]])
