"""Simulator semantics: barriers, shared memory, global access checks, errors, counters, launch API."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import cuflash.sim as sim
from cuflash.kernels import params as params_mirror
from simkit import ARGS_DTYPE, args, kernel, run


# ---- barriers ----------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(128,), (32, 4), (5, 3, 2), (1,), (1024,), (33,)])
def test_barrier_makes_smem_writes_visible(block):
    n = int(np.prod(block))
    grid = (3, 2)
    out = np.zeros(6 * n, np.int32)
    run("barrier_visibility_kernel", grid, block, smem=4 * n, out0=out)
    blocks = np.arange(6)
    expected = (3 * n * (n - 1) // 2 + n * blocks).repeat(n)
    assert out.tolist() == expected.tolist()


def test_exited_threads_do_not_block_barriers():
    out = np.zeros(100, np.int32)
    run("exited_threads_kernel", 1, 128, smem=512, out0=out, n=100)
    assert out.tolist() == [((t + 1) % 100) + 100 for t in range(100)]


@pytest.mark.parametrize("name", ["divergent_barrier_kernel", "same_line_barriers_kernel"])
def test_divergent_barriers_are_errors(name):
    out = np.zeros(64, np.int32)
    with pytest.raises(sim.KernelError, match="barrier divergence") as info:
        run(name, 1, 64, out0=out)
    assert info.value.kernel == f"simtest::{name}"
    assert f"kernel simtest::{name}" in str(info.value)
    assert "sim_checks.cu:" in str(info.value)


def test_deadlock_is_an_error_not_a_hang():
    out = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match="deadlock") as info:
        run("deadlock_kernel", 1, 64, out0=out)
    text = str(info.value)
    assert "__syncthreads" in text and "__shfl_xor_sync" in text


# ---- shared memory -----------------------------------------------------------------------


def test_unwritten_shared_memory_reads_as_nan():
    n = 64
    out0 = np.zeros(n, np.float32)
    out1 = np.zeros(2 * n, np.float32)
    run("unwritten_smem_kernel", 1, n, smem=8 * n, out0=out0, out1=out1, n=16)
    assert np.all(out0[:16] == 1.0)
    assert np.all(np.isnan(out0[16:]))  # float slots nobody wrote
    assert np.all(np.isnan(out1))  # half and bfloat16 slots nobody wrote


def test_dynamic_smem_size_is_the_launch_size():
    out = np.zeros(32, np.uint32)
    run("dynamic_smem_size_kernel", 1, 32, smem=1000, out0=out)
    assert np.all(out == 1000)


def test_smem_overrun_is_an_error():
    # Normal mode: the 1024-byte aligned base leaves (-size mod 1024) bytes of slack before the
    # guard page, none for this size (race mode checks every byte: test_sim_strict.py).
    out = np.zeros(32, np.float32)
    with pytest.raises(sim.KernelError, match="shared memory access out of bounds"):
        run("smem_overrun_kernel", 1, 32, smem=1024, out0=out, n=256)
    run("smem_overrun_kernel", 1, 32, smem=1024, out0=out, n=255)  # the last float is fine


# ---- global memory -----------------------------------------------------------------------


def test_byte_counters_match_known_traffic():
    blocks, threads = 3, 64
    n = blocks * threads
    in0 = np.zeros(n + (n + 1) // 2, np.float32)  # n floats, then n halves
    in1 = np.zeros(4 * n, np.float32)
    out0 = np.zeros(2 * n, np.float32)
    out1 = np.zeros(1, np.float32)
    rec = run("traffic_kernel", blocks, threads, in0=in0, in1=in1, out0=out0, out1=out1, n=n)
    assert rec.global_bytes_read == n * (4 + 2 + 16 + 4)
    assert rec.global_bytes_written == n * (8 + 4)
    assert out1[0] == n


def test_global_store_out_of_bounds():
    out = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match="global store out of bounds") as info:
        run("global_oob_kernel", 1, 64, out0=out, n=64, extra=5)
    text = str(info.value)
    assert "kernel simtest::global_oob_kernel" in text
    assert "thread (5,0,0)" in text and "byte offset 256" in text


def test_global_load_out_of_bounds_below_start():
    in0 = np.zeros(64, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match="global load out of bounds"):
        run("global_oob_load_kernel", 1, 64, in0=in0, out0=out, extra=1)


def test_misaligned_global_load():
    in0 = np.zeros(64, np.float32)
    out = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match="misaligned"):
        run("misaligned_kernel", 1, 32, in0=in0, out0=out)


def test_store_to_read_only_buffer():
    in0 = np.zeros(64, np.float32)
    in0.flags.writeable = False
    with pytest.raises(sim.KernelError, match="read-only"):
        run("readonly_store_kernel", 1, 32, in0=in0)


def test_unregistered_buffer_is_out_of_bounds():
    out = np.zeros(64, np.float32)
    a = args(out0=out, n=64, extra=99)
    with pytest.raises(sim.KernelError, match="out of bounds"):
        sim.launch(kernel("global_oob_kernel"), 1, 64, 0, a, [])


# ---- errors ------------------------------------------------------------------------------------


def test_trap_names_kernel_block_and_thread():
    out = np.zeros(4 * 64, np.int32)
    with pytest.raises(sim.KernelError, match=r"__trap\(\) called") as info:
        run("trap_kernel", 4, 64, out0=out, n=2, extra=7)
    assert "block (2,0,0)" in str(info.value) and "thread (7,0,0)" in str(info.value)


def test_stack_overflow_is_an_error():
    out = np.zeros(32, np.int32)
    with pytest.raises(sim.KernelError, match="stack overflow"):
        run("stack_overflow_kernel", 1, 32, out0=out, n=1000)
    run("stack_overflow_kernel", 1, 32, out0=out, n=20)  # the stacks are usable again


def test_wild_pointer_is_an_error():
    a = args(n=0)  # out0 = NULL
    with pytest.raises(sim.KernelError, match="SIGSEGV"):
        sim.launch(kernel("null_pointer_kernel"), 1, 32, 0, a, [])


def test_integer_division_by_zero_is_an_error():
    out = np.zeros(32, np.int32)
    with pytest.raises(sim.KernelError, match="SIGFPE"):
        run("int_divide_kernel", 1, 32, out0=out, n=0)
    run("int_divide_kernel", 1, 32, out0=out, n=7)
    assert np.all(out == 14)


def test_big_per_thread_arrays_fit():
    out = np.zeros(128, np.float32)
    run("big_locals_kernel", 1, 128, out0=out)
    idx = np.arange(0, 4096, 97)
    assert np.allclose(out, [np.sum(idx + t) for t in range(128)])


def test_errors_do_not_poison_later_launches():
    out = np.zeros(64, np.int32)
    for _ in range(3):
        with pytest.raises(sim.KernelError):
            run("divergent_barrier_kernel", 1, 64, out0=out)
    good = np.zeros(128, np.int32)
    run("barrier_visibility_kernel", 1, 128, smem=512, out0=good)
    assert good[0] == 3 * 128 * 127 // 2


# ---- launch validation -------------------------------------------------------------------------


@pytest.mark.parametrize("block", [0, 1025, (1024, 2), (1, 1, 65), (2048,)])
def test_invalid_block_shapes(block):
    with pytest.raises(sim.KernelError, match="invalid launch"):
        sim.launch(kernel("many_barriers_kernel"), 1, block, 0, args(n=1), [])


def test_parameter_size_must_match():
    with pytest.raises(sim.KernelError, match="parameter block is 8 bytes"):
        sim.launch(kernel("many_barriers_kernel"), 1, 32, 0, b"\0" * 8, [])


def test_too_much_shared_memory():
    with pytest.raises(sim.KernelError, match="dynamic shared memory"):
        sim.launch(kernel("many_barriers_kernel"), 1, 32, 228 * 1024, args(n=1), [])


def test_empty_grid_is_a_no_op():
    out = np.zeros(32, np.int32)
    rec = run("global_oob_kernel", (0, 4), 32, out0=out, n=32, extra=0)
    assert rec.grid == (0, 4, 1) and rec.global_bytes_written == 0
    assert np.all(out == 0)


def test_builtin_variables():
    grid, block = (3, 2, 2), (4, 2, 3)
    nb, nt = 12, 24
    out = np.zeros(nb * nt * 13, np.int32)
    run("builtins_kernel", grid, block, out0=out)
    got = out.reshape(nb, nt, 13)
    for b in range(nb):
        bx, by, bz = b % 3, (b // 3) % 2, b // 6
        for t in range(nt):
            tx, ty, tz = t % 4, (t // 4) % 2, t // 8
            assert got[b, t].tolist() == [tx, ty, tz, bx, by, bz, 4, 2, 3, 3, 2, 2, 32]


# ---- element conversions -------------------------------------------------------------------------


def _conversion_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-24, 2.0**-25,
         1.5 * 2.0**-25, 2.0**-14, 2.0**-14 * (1 - 2.0**-11), 3.0e38, -3.0e38, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
         1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=np.float32)
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # Values near the half range, and ties of both formats.
    near = (rng.standard_normal(20000) * rng.choice([1e-6, 1e-3, 1, 1e3, 6e4], 20000)).astype(np.float32)
    return np.concatenate([special, random_bits, near])


def test_float_to_half_and_bfloat16_round_to_nearest_even():
    x = _conversion_inputs()
    n = x.size
    h = np.zeros(n, np.uint16)
    b = np.zeros(n, np.uint16)
    run("convert_kernel", (n + 255) // 256, 256, in0=x, out0=h, out1=b, n=n)
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16).view(np.uint16).copy()
    with np.errstate(invalid="ignore"):
        want_b = x.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
    nan = np.isnan(x)
    want_h[nan] = 0x7FFF  # the GPU's canonical NaN
    want_b[nan] = 0x7FFF
    assert np.array_equal(h, want_h)
    assert np.array_equal(b, want_b)


def test_half_and_bfloat16_to_float_exact():
    bits = np.arange(65536, dtype=np.uint16)
    n = bits.size
    f_h = np.zeros(n, np.float32)
    f_b = np.zeros(n, np.float32)
    run("decode_kernel", n // 256, 256, in0=bits, in1=bits, out0=f_h, out1=f_b, n=n)
    assert np.array_equal(f_h.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))
    assert np.array_equal(f_b.view(np.uint32), bits.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32))


def test_exp2_approx():
    x = np.array([-np.inf, np.inf, 0.0, 1.0, -1.0, 10.5, -126.0, -149.0, -150.0, 127.9], np.float32)
    out = np.zeros_like(x)
    run("exp2_kernel", 1, 32, in0=x, out0=out, n=x.size)
    assert out[0] == 0.0 and not np.signbit(out[0])
    assert out[1] == np.inf
    # The simulator uses exp2f (the GPU's ex2.approx is within 2 ulp and flushes subnormals).
    ref = np.exp2(x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_max_ulp(out, ref, maxulp=1)


# ---- launch API ------------------------------------------------------------------------------------


def test_record_collects_launches_and_nests():
    out = np.zeros(2 * 64, np.int32)
    with sim.record() as outer:
        run("barrier_visibility_kernel", 2, 64, smem=256, out0=out)
        with sim.record() as inner:
            run("barrier_visibility_kernel", (2, 1), (64, 1, 1), smem=256, out0=out)
    assert [r.grid for r in outer.launches] == [(2, 1, 1), (2, 1, 1)]
    assert len(inner.launches) == 1
    rec = inner.launches[0]
    assert rec == sim.LaunchRecord("simtest::barrier_visibility_kernel", (2, 1, 1), (64, 1, 1), 256, 0, 512)


def test_results_do_not_depend_on_worker_count():
    script = textwrap.dedent(
        """
        import numpy as np, sys
        sys.path.insert(0, sys.argv[1])
        from simkit import run
        out = np.zeros(40 * 96, np.int32)
        run("barrier_visibility_kernel", (8, 5), 96, smem=4 * 96, out0=out)
        sys.stdout.write(out.tobytes().hex())
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    outputs = []
    for workers in ("1", "2", "5"):
        env = dict(os.environ, CUFLASH_SIM_THREADS=workers)
        proc = subprocess.run([sys.executable, "-c", script, here], env=env, capture_output=True, text=True, check=True)
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 40 * 96 * 8


def test_params_layout_matches_python_mirror():
    layout = sim.params_layout()
    mirror = params_mirror.field_layout()
    assert layout.pop("sizeof") == (0, params_mirror.PARAMS_DTYPE.itemsize)
    assert layout == mirror


def test_args_mirror_size_matches_kernel_parameter():
    # A launch with the right bytes succeeds; ARGS_DTYPE is the kernel's struct.
    sim.launch(kernel("many_barriers_kernel"), 1, 32, 0, np.zeros((), ARGS_DTYPE), [])
