"""The simulator is as strict as a GPU where pipelined tensor-core kernels go wrong.

Each check has a planted bug that it catches and a fixed twin that passes:
- cp.async copies are in flight from issue to the covering wait: race mode reports any access to
  their destination in that window (a refill of a stage other warps still read, a thread reading
  its own destination early); normal mode lands them at seeded random moments, so such a kernel's
  result changes with the seed;
- shared memory: natural alignment and bounds on both sides (race mode: every access; normal
  mode: guard pages), a 1024-byte aligned base;
- automatic variables start as a garbage pattern, so a forgotten accumulator reset shows;
- a block larger than the kernel's __launch_bounds__ is refused, as a GPU refuses it.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from cuflash._paths import CUDA_SRC
from cuflash.kernels.program import KernelInstance
from simkit import KERNELS, args

SOURCE = KERNELS / "sim_strict.cu"
NAMES = ("pipeline_kernel", "own_destination_kernel", "vector_read_kernel", "shared_index_kernel",
         "smem_base_kernel", "accumulator_kernel", "bounded_kernel", "bounded_template_kernel<2>",
         "bounded_template_kernel<4, 7>")
SEEDS = range(6)


def inst(name: str) -> KernelInstance:
    return KernelInstance(str(SOURCE), f"simstrict::{name}")


@pytest.fixture(scope="module", autouse=True)
def _built():
    sim.precompile([inst(n) for n in NAMES], modes=("normal", "race"))


def launch(name, block, smem=0, in0=None, out0=None, **ints):
    buffers = [b for b in (in0, out0) if b is not None]
    return sim.launch(inst(name), 1, block, smem, args(in0=in0, out0=out0, **ints), buffers)


# ---- cp.async in flight ------------------------------------------------------------------------

THREADS, TILES = 64, 4


def _pipeline(mode: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.arange(TILES * THREADS * 4, dtype=np.float32) + 1
    out = np.full(TILES * THREADS, np.nan, np.float32)
    launch("pipeline_kernel", THREADS, smem=2 * THREADS * 16, in0=src, out0=out, n=TILES, mode=mode)
    expected = src.reshape(TILES, THREADS, 4)[:, np.roll(np.arange(THREADS), -1), 0].reshape(-1)
    return out, expected


@pytest.mark.parametrize("seed", SEEDS)
def test_pipeline_with_its_barriers_is_right_for_every_landing_seed(seed):
    with sim.copy_landing(seed):
        out, expected = _pipeline(mode=0)
    np.testing.assert_array_equal(out, expected)


def test_pipeline_missing_the_refill_barrier_depends_on_when_copies_land():
    wrong = 0
    for seed in SEEDS:
        with sim.copy_landing(seed):
            out, expected = _pipeline(mode=1)
        wrong += not np.array_equal(out, expected)
    assert wrong > 0


def test_race_mode_reports_the_refill_of_a_stage_still_being_read():
    with sim.checking("race"):
        with pytest.raises(sim.KernelError, match="data race on shared memory"):
            _pipeline(mode=1)
        out, expected = _pipeline(mode=0)
    np.testing.assert_array_equal(out, expected)


def _own_destination(mode: int) -> np.ndarray:
    src = np.arange(32 * 4, dtype=np.float32) + 1
    out = np.zeros(32, np.float32)
    launch("own_destination_kernel", 32, smem=32 * 16, in0=src, out0=out, mode=mode)
    return out


def test_reading_own_destination_before_the_wait():
    expected = (np.arange(32) * 4 + 1).astype(np.float32)
    early = set()
    for seed in SEEDS:
        with sim.copy_landing(seed):
            np.testing.assert_array_equal(_own_destination(mode=0), expected)
            early.add(_own_destination(mode=1).tobytes())
    assert len(early) > 1  # what an early read sees changes with the landing moments
    with sim.checking("race"):
        with pytest.raises(sim.KernelError, match="its own cp.async before the cp.async.wait_group"):
            _own_destination(mode=1)
        np.testing.assert_array_equal(_own_destination(mode=0), expected)


def test_copy_landing_seed_is_validated():
    with pytest.raises(ValueError, match="copy_landing seed"):
        with sim.copy_landing(-1):
            pass


# ---- shared memory: alignment, bounds, base -----------------------------------------------------


@pytest.mark.parametrize("mode, offset", [(0, 16), (1, 8)])
def test_race_mode_accepts_naturally_aligned_vector_reads(mode, offset):
    out = np.zeros(32, np.float32)
    with sim.checking("race"):
        launch("vector_read_kernel", 32, smem=1024, out0=out, n=256, mode=mode, extra=offset)
    first = offset // 4 + 4 * np.arange(32)
    width = 4 if mode == 0 else 2
    np.testing.assert_array_equal(out, sum(first + i for i in range(width)).astype(np.float32))


@pytest.mark.parametrize("mode, offset", [(0, 8), (1, 4)])
def test_race_mode_reports_misaligned_vector_reads(mode, offset):
    out = np.zeros(32, np.float32)
    with sim.checking("race"), pytest.raises(sim.KernelError, match="misaligned shared memory access"):
        launch("vector_read_kernel", 32, smem=1024, out0=out, n=256, mode=mode, extra=offset)


@pytest.mark.parametrize("mode", ["normal", "race"])
@pytest.mark.parametrize("index", [-1024, 256])  # 4 KiB below the start; 1 KiB past the end
def test_shared_memory_overrun_on_either_side_is_caught(mode, index):
    out = np.zeros(32, np.float32)
    with sim.checking(mode), pytest.raises(sim.KernelError, match="shared memory access out of bounds"):
        launch("shared_index_kernel", 32, smem=1000, out0=out, extra=index)


@pytest.mark.parametrize("index", [-1, 250])
def test_race_mode_catches_the_first_byte_outside(index):
    out = np.zeros(32, np.float32)
    with sim.checking("race"), pytest.raises(sim.KernelError, match="shared memory access out of bounds"):
        launch("shared_index_kernel", 32, smem=1000, out0=out, extra=index)
    with sim.checking("race"):
        launch("shared_index_kernel", 32, smem=1000, out0=out, extra=249)


@pytest.mark.parametrize("mode", ["normal", "race"])
@pytest.mark.parametrize("smem", [16, 1000, 4096, 50_000])
def test_dynamic_shared_memory_base_is_1024_byte_aligned(mode, smem):
    out = np.full(1, 7, np.uint64)
    with sim.checking(mode):
        launch("smem_base_kernel", 32, smem=smem, out0=out)
    assert out[0] == 0


# ---- automatic variables ---------------------------------------------------------------------


def test_forgotten_accumulator_reset_gives_garbage():
    out = np.zeros(32, np.float32)
    launch("accumulator_kernel", 32, out0=out, n=3, mode=0)
    np.testing.assert_array_equal(out, 3.0)
    launch("accumulator_kernel", 32, out0=out, n=3, mode=1)
    assert not np.any(out == 3.0)


def test_multiply_add_fuses_like_nvrtc_default():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: rounding the product first loses the 2^-24 that a fused
    # multiply-add keeps. NVRTC fuses by default (--fmad=true), so the simulator must too.
    from simkit import run

    n = 32
    a = np.float32(1 + 2**-12)
    x = np.concatenate([np.full(n, a, np.float32), np.full(n, -(1 + 2**-11), np.float32)])
    y = np.full(n, a, np.float32)
    out = np.zeros(n, np.float32)
    run("multiply_add_kernel", (1, 1, 1), (n, 1, 1), in0=x, in1=y, out0=out, n=n)
    unfused = np.float32(a * a) + np.float32(-(1 + 2**-11))
    assert unfused == 0.0
    assert (out == np.float32(2**-24)).all(), out[:4]


def test_exp2_approx_flushes_subnormals_like_ex2_approx_ftz():
    from simkit import run

    x = np.array([-130.0, -126.5, -126.0, 0.0, -np.inf, np.inf, 1.5, -1e-40, 1e-40, 3.0], np.float32)
    x = np.resize(x, 32)
    out = np.full(32, np.nan, np.float32)
    run("exp2_approx_kernel", (1, 1, 1), (32, 1, 1), in0=x, out0=out)
    expected = np.exp2(x.astype(np.float64))
    expected[np.abs(expected) < np.finfo(np.float32).tiny] = 0.0  # 2^-130, 2^-126.5: subnormal results flushed
    expected[np.abs(x) < np.finfo(np.float32).tiny] = 1.0  # subnormal inputs flush to 0: 2^0
    np.testing.assert_allclose(out, expected.astype(np.float32), rtol=2**-22, atol=0)
    assert out[0] == 0.0 and np.signbit(out[0]) == False  # noqa: E712


def test_log2_approx_flushes_subnormals_like_lg2_approx_ftz():
    from simkit import run

    x = np.array([1.0, 2.0, 0.75, 1e-30, 1e30, 0.0, -0.0, 1e-40, np.inf, 3.0], np.float32)
    x = np.resize(x, 32)
    out = np.full(32, np.nan, np.float32)
    run("log2_approx_kernel", (1, 1, 1), (32, 1, 1), in0=x, out0=out)
    with np.errstate(divide="ignore"):
        expected = np.log2(x.astype(np.float64))
    expected[np.abs(x) < np.finfo(np.float32).tiny] = -np.inf  # subnormal inputs flush to 0: -inf
    np.testing.assert_allclose(out, expected.astype(np.float32), rtol=0, atol=2**-22)


# ---- __launch_bounds__ -----------------------------------------------------------------------


@pytest.mark.parametrize("name, bound", [("bounded_kernel", 64), ("bounded_template_kernel<2>", 64),
                                         ("bounded_template_kernel<4, 7>", 128)])
@pytest.mark.parametrize("mode", ["normal", "race"])
def test_block_within_launch_bounds_runs(name, bound, mode):
    for block in (1, bound // 2, bound):
        out = np.full(bound, -1, np.int32)
        with sim.checking(mode):
            launch(name, block, out0=out)
        np.testing.assert_array_equal(out[:block], np.arange(block))


@pytest.mark.parametrize("name, bound", [("bounded_kernel", 64), ("bounded_template_kernel<2>", 64),
                                         ("bounded_template_kernel<4, 7>", 128)])
def test_block_beyond_launch_bounds_is_refused(name, bound):
    out = np.full(1024, -1, np.int32)
    for block in (bound + 1, (bound // 2, 3, 1), 1024):
        with pytest.raises(sim.KernelError, match=f"__launch_bounds__ maximum of {bound}"):
            launch(name, block, out0=out)
    assert np.all(out == -1)  # refused before any thread ran


def test_launch_bounds_are_read_from_macro_generated_and_template_kernels():
    from cuflash.sim import _build
    from cuflash.kernels import catalog

    found = _build.launch_bounds(SOURCE)
    assert found["bounded_kernel"].max_threads == "64"
    assert found["bounded_template_kernel"].max_threads == "Warps * 32"
    assert found["bounded_template_kernel"].template_head == "template <int Warps, int Unused = 7>"
    assert found["bounded_kernel"].template_head == ""
    # Every kernel the library ships states its bound (the standard GEMMs come from a macro).
    kernels_by_source: dict = {}
    for inst in catalog.all_instances():
        kernels_by_source.setdefault(inst.source_path, set()).add(_build._split_name_expr(inst.name_expr)[1])
    assert "standard_scores_kernel" in kernels_by_source[CUDA_SRC / "kernels" / "standard_attention.cu"]
    for source, kernels in kernels_by_source.items():
        assert kernels <= set(_build.launch_bounds(source)), (source.name, kernels - set(_build.launch_bounds(source)))


def test_launch_bounds_in_another_position_is_a_build_error():
    from cuflash.sim import _build

    with pytest.raises(_build.BuildError, match=r"__global__ void __launch_bounds__\(\.\.\.\) name\("):
        _build.parse_launch_bounds("__global__ __cuflash_launch_bounds__(64) void f(int) {}")
