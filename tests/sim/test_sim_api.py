"""Launch API plumbing: GIL release, threads, native entry point, builds and the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels.program import KernelInstance
from cuflash.sim import _build
from simkit import args, kernel, run


def test_launch_releases_the_gil():
    done = threading.Event()

    def long_launch():
        run("many_barriers_kernel", 1, 32, n=300_000)
        done.set()

    worker = threading.Thread(target=long_launch)
    start = time.perf_counter()
    worker.start()
    ticks = 0
    while not done.is_set():
        ticks += 1
    worker.join()
    elapsed = time.perf_counter() - start
    # With the GIL held for the whole call this loop could not run until the end.
    assert elapsed > 0.05
    assert ticks > 10_000


def test_concurrent_launches_from_threads():
    errors = []

    def worker(seed):
        try:
            for _ in range(5):
                out = np.zeros(3 * 64, np.int32)
                run("barrier_visibility_kernel", 3, 64, smem=256, out0=out)
                expected = (3 * 64 * 63 // 2 + 64 * np.arange(3)).repeat(64)
                assert out.tolist() == expected.tolist()
                with pytest.raises(sim.KernelError):
                    run("divergent_barrier_kernel", 1, 64, out0=np.zeros(64, np.int32))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_native_entry_point_is_the_library_launcher():
    address = sim.launch_entry_address(kernel("many_barriers_kernel"))
    ffi = sim._library.ffi
    entry = ffi.cast("int (*)(const char*, cuflash_sim_launch_request*)", address)
    req = ffi.new("cuflash_sim_launch_request*")
    params = args(n=3).tobytes()
    keep = ffi.new("char[]", params)
    req.kernel_name = name = ffi.new("char[]", b"simtest::many_barriers_kernel")
    req.grid = [1, 1, 1]
    req.block = [64, 1, 1]
    req.params = keep
    req.params_size = len(params)
    req.num_workers = 1
    assert entry(name, req) == 0
    req.block = [0, 1, 1]
    assert entry(name, req) == 1
    assert b"invalid launch" in ffi.string(req.error)


def test_build_errors_carry_compiler_output(tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text('#include "arch/arch.cuh"\nstruct A { int x; };\n__global__ void k(const A a) { undefined_name(a.x); }\n')
    with pytest.raises(sim.BuildError, match="undefined_name"):
        sim.launch(KernelInstance(str(source), "k"), 1, 32, 0, b"\0" * 4, [])
    with pytest.raises(sim.BuildError, match="not found"):
        sim.launch(KernelInstance(str(tmp_path / "missing.cu"), "k"), 1, 32, 0, b"\0" * 4, [])


def test_static_shared_memory_is_rejected_at_build(tmp_path):
    source = tmp_path / "static_smem.cu"
    source.write_text('#include "arch/arch.cuh"\n__global__ void k(int n) { __shared__ float tile[32]; tile[0] = n; }\n')
    with pytest.raises(sim.BuildError, match="__shared__"):
        sim.launch(KernelInstance(str(source), "k"), 1, 32, 0, b"\0" * 4, [])


def test_concurrent_builds_of_one_library(tmp_path):
    # A kernel no other test uses: both processes find it missing and race to build it.
    source = tmp_path / "fresh.cu"
    source.write_text(
        '#include "arch/arch.cuh"\n'
        f"// unique: {os.getpid()} {time.time_ns()}\n"
        "struct A { float* out; };\n"
        "__global__ void fresh(const A a) { cuflash::arch::store(a.out + threadIdx.x, 2.0f * threadIdx.x); }\n"
    )
    script = textwrap.dedent(
        """
        import sys, numpy as np, cuflash.sim as sim
        from cuflash.kernels.program import KernelInstance
        out = np.zeros(32, np.float32)
        sim.launch(KernelInstance(sys.argv[1], "fresh"), 1, 32, 0, np.uint64(out.ctypes.data).tobytes(), [out])
        assert out.tolist() == [2.0 * i for i in range(32)]
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(source)], stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    inst = KernelInstance(str(source), "fresh")
    assert _build.find_library("normal", inst) is not None


def test_checking_rejects_unknown_modes():
    with pytest.raises(ValueError):
        with sim.checking("tsan"):
            pass


def test_bench_barrier_measures_something():
    from cuflash.sim import bench_barrier

    # Enough barriers that the difference dwarfs scheduling noise on a busy machine.
    cost = bench_barrier.barrier_cost(32, iterations=50_000, repeats=3)
    assert 0 < cost < 1e-3
