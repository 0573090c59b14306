"""``host``: what cuflash's Python costs per call, with the kernels taken away.

A decode step's kernel takes 10-30 us on an H100, so for a CuPy user who decodes, the host path (placement,
validation, planning, allocation, packing AttentionParams) can set the speed. This benchmark measures that path on
the CPU: NumPy arrays on the simulator backend, whose launch is swapped for a function that does nothing, so
allocation, validation, planning and packing all still run and only the kernels are missing.

Rows: ``attention``, ``attention_backward``, ``attention_varlen`` and ``attention_with_kvcache`` at a decode shape
(batch 1, one query row, GQA 32 query heads over 8 kv heads, head dim 128, 4096 cached keys; the KV-cache call with
int32 cache_seqlens growing a row per call, as a decode loop's, and one new k/v row appended; ``kvcache host
lengths``: the same call with cache_seqlens kept on the host, which on a GPU spares a device-to-host copy per call;
``attention_varlen paged``: the same keys in pages of 256 rows read by a paged varlen decode step, vLLM's call), and
the first three at a training shape (batch 4, seqlen 2048, 32/8 heads, head dim 128, float16, causal). Per row, in
microseconds: the first call of its signature (cold: nothing of that call cached yet), the median of warm calls
after a warm-up (wall clock, and the thread's CPU time, which a loaded machine inflates less), the median of uncached
calls (the API's prepared calls forgotten before each: a new signature in a warm process); and the Python function
calls a warm call makes (counted with sys.setprofile).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

BACKEND_LABELS = {"simulator": "simulator, launches no-op",
                  "cupy": "CuPy arrays on the GPU, kernels launched (host time only: launches are asynchronous)"}
BACKEND_LABEL = BACKEND_LABELS["simulator"]
PROFILE_TOP = 30  # rows of the cProfile table (--profile)

DECODE = dict(batch=1, nheads=32, nheads_k=8, headdim=128, cached_keys=4096)
PAGE_SIZE = 256  # the paged decode row's pages (FA2 takes multiples of 256; vLLM's default is 16)
TRAINING = dict(batch=4, seqlen=2048, nheads=32, nheads_k=8, headdim=128)


@dataclass
class Case:
    call: str
    shape: str
    run: Callable[[], Any]
    repeats: int


@contextlib.contextmanager
def launches_do_nothing() -> Iterator[None]:
    """Inside the block the simulator backend's launch does nothing (everything before it still runs)."""
    from ..backends.simulator import SimulatorBackend

    original = SimulatorBackend.launch

    def no_launch(self, plan, params, buffers) -> None:
        return None

    SimulatorBackend.launch = no_launch
    try:
        yield
    finally:
        SimulatorBackend.launch = original


def _random(shape: tuple[int, ...], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _placer(backend: str) -> Callable[[Any], Any]:
    """Where the rows' arrays live: NumPy (the simulator) or CuPy arrays on the current GPU."""
    if backend == "simulator":
        return lambda x: x
    from .timing import cupy_or_refuse

    cupy = cupy_or_refuse()
    return cupy.asarray


def decode_cases(repeats: int, backend: str = "simulator") -> list[Case]:
    import cuflash

    place = _placer(backend)
    rng = np.random.default_rng(0)
    b, h, hk, d, n = (DECODE[key] for key in ("batch", "nheads", "nheads_k", "headdim", "cached_keys"))
    f16 = np.float16
    q = _random((b, 1, h, d), f16, rng)
    k = _random((b, n, hk, d), f16, rng)
    v = _random((b, n, hk, d), f16, rng)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = _random(q.shape, f16, rng)
    cu_q = np.array([0, 1], np.int32)
    cu_k = np.array([0, n], np.int32)
    k_cache, v_cache = k.copy(), v.copy()
    k_new = _random((b, 1, hk, d), f16, rng)
    v_new = _random((b, 1, hk, d), f16, rng)
    # The caches gain a row per call, as in a decode loop: cache_seqlens runs through n/2 .. n-2 rows in use (arrays
    # made beforehand, so the row times cuflash alone), then starts over. A decode's seqlen_k grows every step; the
    # plan serves a range of it (V.kvcache_key_extent), and the row shows what a real decode step costs.
    def growing(where: Callable[[Any], Any]) -> Iterator[Any]:
        return itertools.cycle([where(np.full(b, used, np.int32)) for used in range(n // 2, n - 1)])

    lengths = growing(place)
    # The same lengths kept on the host (NumPy beside CuPy tensors: _placement.HOST_READ_INPUTS), as a server keeps
    # them: no device-to-host copy per call. On the simulator the row is the one above.
    host_lengths = growing(np.asarray)
    # The same keys in pages of PAGE_SIZE rows, read by a paged varlen decode step (vLLM's: packed query rows, keys
    # counted by seqused_k, no cu_seqlens_k), its keys in use growing a row per call as the KV-cache row's.
    pages = n // PAGE_SIZE
    table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
    k_pages, v_pages = (x.reshape(b * pages, PAGE_SIZE, hk, d) for x in (k, v))
    paged_lengths = growing(place)
    q, k, v, out, lse, dout, cu_q, cu_k, k_cache, v_cache, k_new, v_new, k_pages, v_pages, table = (
        place(x) for x in (q, k, v, out, lse, dout, cu_q, cu_k, k_cache, v_cache, k_new, v_new, k_pages, v_pages,
                           table))
    shape = f"batch {b}, seqlen_q 1, heads {h}/{hk}, d {d}, keys {n}, float16, causal"
    return [
        Case("attention", shape, lambda: cuflash.attention(q, k, v, causal=True), repeats),
        Case("attention_backward", shape,
             lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True), repeats),
        Case("attention_varlen", shape,
             lambda: cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, causal=True), repeats),
        Case("attention_with_kvcache", shape + ", cache_seqlens int32 array growing a row per call, 1 new k/v row",
             lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                                    cache_seqlens=next(lengths), causal=True), repeats),
        Case("kvcache host lengths", shape + ", cache_seqlens a NumPy array (host) growing a row per call, 1 new k/v "
             "row", lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                                           cache_seqlens=next(host_lengths), causal=True), repeats),
        Case("attention_varlen paged", shape + f", pages of {PAGE_SIZE} rows, seqused_k growing a row per call",
             lambda: cuflash.attention_varlen(q[:, 0], k_pages, v_pages, cu_q, None, max_seqlen_q=1, max_seqlen_k=n,
                                              seqused_k=next(paged_lengths), block_table=table, causal=True),
             repeats),
    ]


def training_cases(repeats: int, backend: str = "simulator") -> list[Case]:
    import cuflash

    place = _placer(backend)
    rng = np.random.default_rng(1)
    b, s, h, hk, d = (TRAINING[key] for key in ("batch", "seqlen", "nheads", "nheads_k", "headdim"))
    f16 = np.float16
    q = _random((b, s, h, d), f16, rng)
    k = _random((b, s, hk, d), f16, rng)
    v = _random((b, s, hk, d), f16, rng)
    dout = _random(q.shape, f16, rng)
    # The forward's results as inputs of the backward (their values do not matter with launches taken away).
    out = np.zeros_like(q)
    lse = np.zeros((b, h, s), np.float32)
    cu = np.arange(0, (b + 1) * s, s, dtype=np.int32)
    q, k, v, dout, out, lse, cu = (place(x) for x in (q, k, v, dout, out, lse, cu))
    shape = f"batch {b}, seqlen {s}, heads {h}/{hk}, d {d}, float16, causal"
    packed = shape.replace(f"batch {b}", f"{b} packed sequences")
    return [
        Case("attention", shape, lambda: cuflash.attention(q, k, v, causal=True), repeats),
        Case("attention_backward", shape,
             lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True), repeats),
        Case("attention_varlen", packed,
             lambda: cuflash.attention_varlen(q.reshape(b * s, h, d), k.reshape(b * s, hk, d),
                                              v.reshape(b * s, hk, d), cu, cu, causal=True), repeats),
    ]


def _microseconds(run: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    run()
    return (time.perf_counter_ns() - start) / 1e3


def _cpu_microseconds(run: Callable[[], Any]) -> float:
    """This thread's CPU time for one run: unlike wall time, it leaves out the time the thread waits for a core
    other processes hold (on a shared machine, most of a loaded wall-clock figure)."""
    start = time.thread_time_ns()
    run()
    return (time.thread_time_ns() - start) / 1e3


def python_calls(run: Callable[[], Any]) -> int:
    """Python function calls one run makes (C functions not counted)."""
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _forget_prepared_calls() -> None:
    """Empty the API's cache of prepared calls, so the next call is checked and planned from scratch."""
    from .. import api

    api.prepared_calls.clear()


def measure(case: Case, warmup: int = 5, backend: str = "simulator") -> dict[str, Any]:
    """One row: the cold first call of the case's signature, the median of ``case.repeats`` warm calls, and the
    median of as many calls each made with the prepared calls forgotten (what a call of a new signature costs once
    the process is warm)."""
    first = _microseconds(case.run)
    for _ in range(warmup):
        case.run()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing in one call is noise, not host cost
    try:
        times = [_microseconds(case.run) for _ in range(case.repeats)]
        cpu_times = [_cpu_microseconds(case.run) for _ in range(case.repeats)]
        uncached = []
        for _ in range(case.repeats):
            _forget_prepared_calls()
            uncached.append(_microseconds(case.run))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "call": case.call,
        "shape": case.shape,
        "backend": BACKEND_LABELS[backend],
        "microseconds_per_call": statistics.median(times),
        "first_call_microseconds": first,
        "uncached_microseconds_per_call": statistics.median(uncached),
        "min_microseconds": min(times),
        "cpu_microseconds_per_call": statistics.median(cpu_times),
        "repeats": case.repeats,
        "python_calls_per_call": python_calls(case.run),
    }


def _prime(backend: str = "simulator") -> None:
    """Import and initialize what any first call needs (families, simulator target or CuPy backend), on a shape no
    row uses, so each row's first call is cold for its own signature rather than for the process."""
    import cuflash

    place = _placer(backend)
    rng = np.random.default_rng(2)
    q, k, v = (place(_random((1, 3, 2, 64), np.float16, rng)) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(out, q, k, v, out, lse)
    cu = place(np.array([0, 3], np.int32))
    cuflash.attention_varlen(q[0], k[0], v[0], cu, cu)
    cache = place(_random((1, 16, 2, 64), np.float16, rng))
    cuflash.attention_with_kvcache(q, cache, cache.copy(), k=k[:, :1], v=v[:, :1],
                                   cache_seqlens=place(np.array([3], np.int32)))


@contextlib.contextmanager
def _launches(backend: str) -> Iterator[None]:
    """The simulator's launches taken away; on the GPU the kernels run (their launch is host cost too), and the
    queued ones finish inside the block, not at exit."""
    if backend == "simulator":
        with launches_do_nothing():
            yield
        return
    yield
    from .timing import cupy_or_refuse

    cupy_or_refuse().cuda.get_current_stream().synchronize()


def run(repeats: int, training_repeats: int, backend: str = "simulator") -> list[dict[str, Any]]:
    with _launches(backend):
        _prime(backend)
        cases = decode_cases(repeats, backend)
        if training_repeats > 0:
            cases += training_cases(training_repeats, backend)
        return [measure(case, warmup=5 if case.repeats >= 20 else 1, backend=backend) for case in cases]


def profile(case: Case, calls: int, backend: str = "simulator") -> str:
    """cProfile's table (PROFILE_TOP rows by own time) of ``calls`` warm calls of ``case``: where its host time
    goes, function by function."""
    import cProfile
    import pstats

    with _launches(backend):
        for _ in range(5):
            case.run()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            case.run()
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (primitive calls, calls, own s, total s, ...)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:PROFILE_TOP]
    lines = [f"cProfile of {calls} warm calls of {case.call} ({case.shape}; {BACKEND_LABELS[backend]}), per call, "
             f"by own time (profiling inflates small functions)",
             f"{'own us':>9} {'total us':>9} {'calls':>7}  function"]
    for (path, line, name), (_, ncalls, own, total, _) in rows:
        where = name if path == "~" else f"{'/'.join(Path(path).parts[-2:])}:{line}({name})"
        lines.append(f"{own / calls * 1e6:>9.2f} {total / calls * 1e6:>9.2f} {ncalls / calls:>7.2f}  {where}")
    return "\n".join(lines) + "\n"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'call':<24} {'warm us':>10} {'warm cpu':>10} {'uncached':>10} {'first us':>10} {'py calls':>9}  shape"
    label = rows[0]["backend"] if rows else BACKEND_LABEL
    lines = [f"host cost per call ({label}; medians; warm cpu: this thread's CPU time)", header,
             "-" * len(header)]
    for row in rows:
        lines.append(f"{row['call']:<24} {row['microseconds_per_call']:>10.1f} "
                     f"{row['cpu_microseconds_per_call']:>10.1f} "
                     f"{row['uncached_microseconds_per_call']:>10.1f} {row['first_call_microseconds']:>10.1f} "
                     f"{row['python_calls_per_call']:>9}  {row['shape']}")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "numpy": np.__version__}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="folder for host.json")
    parser.add_argument("--repeats", type=int, default=200, help="warm calls per decode row (median reported)")
    parser.add_argument("--training-repeats", type=int, default=5,
                        help="warm calls per training-shape row (0: skip those rows; each allocates its outputs)")
    parser.add_argument("--backend", choices=sorted(BACKEND_LABELS), default="simulator",
                        help="simulator: NumPy arrays, launches taken away (any machine); cupy: CuPy arrays on the "
                             "GPU, kernels launched")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also write profile.txt: cProfile of CALLS warm decode attention calls (0: none)")


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        print("--repeats must be >= 1", file=sys.stderr)
        return 2
    if args.profile < 0:
        print("--profile must be >= 0", file=sys.stderr)
        return 2
    rows = run(args.repeats, args.training_repeats, args.backend)
    print(format_table(rows))
    profiled = profile(decode_cases(1, args.backend)[0], args.profile, args.backend) if args.profile else None
    if profiled:
        print(profiled)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "host.json"
        path.write_text(json.dumps({"rows": rows, "python": sys.version, "machine": machine()}, indent=1))
        print(f"wrote {path}")
        if profiled:
            (args.out / "profile.txt").write_text(profiled)
            print(f"wrote {args.out / 'profile.txt'}")
    return 0
