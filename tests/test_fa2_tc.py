"""The tensor-core FA2 (cuda_src/kernels/fa2_tc_forward.cu, fa2_tc_backward.cu), the fa2 variant for float16 and
bfloat16.

* The fa2 grid (test_fa2.SHAPES: FA2's odd length pairs, head dims 1..256 on and between the compiled sizes, MHA /
  GQA / MQA, seqlen_q < and > seqlen_k) in both 16-bit types, causal and not, forward and backward (both dq modes
  in rotation), against the float64 reference with FlashAttention's rule (test_fa2.py runs the same shapes through
  the API with rotating dtypes, both dq modes on each).
* Every tensor-core instance any target's plans launch (forward and backward): under the race detector with
  cp.async copies landing at different moments (results bitwise equal across landings; the backward in
  deterministic mode), and under AddressSanitizer; global traffic of every launch byte for byte against the
  formula. (Pattern-initialized locals are on in every simulator build.)
* The bank-conflict profile: no excess wavefronts at any shared-memory site (ldmatrix reads, cp.async writes, the
  P / dS and output staging stores), at every compiled head dim, forward and backward.
* K and V are read ceil(seqlen_q / 128) times per head at head dims 64 and 128.
* The kernel traps on any launch shape but its traits' own (shared memory more or less, other block sizes).
* The tile tables: FA2's where ptxas keeps them spill-free, 99 KB rows, the head-dim-256 choice per target.
* Compiled (sm_80, sm_90): the backward's P and dS of a plain tile are one branch-free run of SASS; the forward's
  K/V copies step their rows (a short loop per 16-byte cp.async).
* On a GPU (marked gpu): the same checks against the reference and bitwise reruns.
"""

from __future__ import annotations

import datetime
import math
import re

import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash.backends.program import run_program
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels import catalog, nvrtc, plans
from cuflash.kernels.families import fa2, fa2_tc
from cuflash.kernels.program import LaunchPlan, Problem, Program
from cuflash.kernels.targets import target
from test_fa2 import SHAPES, _check_backward, _check_forward, _inputs, _launch_traffic, _problem

SM80 = target("sm_80")
DTYPES = fa2_tc.DTYPES


def _grid_cases():
    """Every shape in both 16-bit types, causal and not; the dq mode alternates so that each shape, and each causal
    setting of it, meets both."""
    cases = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        for d, dtype in enumerate(DTYPES):
            for causal in (False, True):
                scale = 0.3 if i % 2 else None
                deterministic = (i + d + causal) % 2 == 1
                case_id = f"{name}-{dtype}-{'causal' if causal else 'full'}-{'det' if deterministic else 'atomic'}"
                cases.append(pytest.param(shape, dtype, causal, scale, deterministic, id=case_id))
    return cases


@pytest.mark.parametrize("shape, dtype, causal, scale, deterministic", _grid_cases())
def test_grid_matches_reference(shape, dtype, causal, scale, deterministic):
    q, k, v, dout = _inputs(shape, dtype, seed=21)
    with sim.record() as records:
        out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="fa2", return_lse=True)
    assert [r.kernel.split("<")[0] for r in records.launches] == ["cuflash::fa2_tc_forward_kernel"]
    _check_forward(q, k, v, out, lse, causal, scale)
    with sim.record() as records:
        grads = cuflash.attention_backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, algorithm="fa2", deterministic=deterministic
        )
    assert "cuflash::fa2_tc_backward_kernel" in [r.kernel.split("<")[0] for r in records.launches]
    _check_backward(dout, q, k, v, grads, causal, scale)


def _run(q, k, v, causal, scale, arch="sm_80", program=None):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
    program = program or fa2_tc.forward_program(problem, target(arch))
    scale = scale if scale is not None else 1.0 / math.sqrt(problem.headdim)  # the API's default
    with sim.targeting(arch), sim.record() as records:
        run_program(backend, program, problem, scale, {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    return out, lse, records


# One problem per compiled head dim: ragged Q and K/V blocks, GQA, causal with seqlen_q > seqlen_k (rows without a
# key) and a head dim below the compiled one (zero-filled columns, element-wise tails where it is not a multiple
# of 8).
INSTANCE_SHAPES = {32: 27, 64: 64, 96: 90, 128: 123, 192: 160, 256: 256}
PLANNED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120")


def _instance_cases(traits_of):
    """Each distinct instance ``traits_of(head_dim, target)`` gives on any target, once, with the first arch that
    plans it (the simulator then stands in for that arch). The instances with dropout: tests/test_dropout.py."""
    cases = {}
    for arch in PLANNED_ARCHS:
        for head_dim in fa2_tc.HEAD_DIMS:
            for dtype in DTYPES:
                cases.setdefault(traits_of(head_dim, target(arch)).instance(dtype), (arch, head_dim, dtype))
    return list(cases.values())


FORWARD_CASES = _instance_cases(fa2_tc.forward_traits)
BACKWARD_CASES = _instance_cases(fa2_tc.backward_traits)


TODAY = datetime.date.today().toordinal()


def one_dtype_per_tile(cases, day: int = TODAY):
    """ASan's cases of ``day``: of the distinct (arch, head dim) tiles, half (alternate ones, the other half the next
    day), each in one 16-bit dtype, the dtypes in rotation (a tile's dtype changes every other day: every tile in both
    every four days). ASan's question is where each access lands: float16 and bfloat16 instances of one tile share
    every address (the element type changes only the conversions), and one tile's addresses are a day's work for
    ASan as they are another's (a ragged edge, a swizzle: its own ASan build and run, 10-20 s each on a CI core;
    every tile a day took the suite's two longest tests, about 200 s each). Every instance of both dtypes runs under
    the race detector and against the reference every day."""
    tiles = dict.fromkeys((arch, head_dim) for arch, head_dim, _ in cases)  # distinct, in order
    return [(arch, head_dim, DTYPES[(i // 2 + day // 2) % len(DTYPES)]) for i, (arch, head_dim) in enumerate(tiles)
            if (i + day) % 2 == 0]


ASAN_FORWARD_CASES = one_dtype_per_tile(FORWARD_CASES)
ASAN_BACKWARD_CASES = one_dtype_per_tile(BACKWARD_CASES)


def test_instance_cases_cover_every_tensor_core_instance():
    for cases, traits_of, kernel, count in ((FORWARD_CASES, fa2_tc.forward_traits, "fa2_tc_forward", 18),
                                            (BACKWARD_CASES, fa2_tc.backward_traits, "fa2_tc_backward", 20)):
        covered = {traits_of(hd, target(arch)).instance(dt) for arch, hd, dt in cases}
        planned = {i for arch in PLANNED_ARCHS for i in fa2_tc.instances(target(arch))
                   if kernel in i.name_expr and not i.name_expr.endswith(", true>")}  # without dropout
        # 20 backward instances: d64's 128 x 128 (sm_90) and 64 x 128, d96's and d128's 64 x 128 (sm_80, sm_90) and
        # 64 x 64 (the 99 KB targets), in both dtypes.
        assert covered == planned and len(cases) == len(planned) == count
    for cases, asan in ((FORWARD_CASES, ASAN_FORWARD_CASES), (BACKWARD_CASES, ASAN_BACKWARD_CASES)):
        assert set(asan) <= set(cases)
        assert_asan_rotation_covers(cases)


def assert_asan_rotation_covers(cases):
    """ASan's rotation (one_dtype_per_tile) runs every instance of ``cases`` (each tile in each 16-bit dtype) within
    any four days in a row, half the tiles a day."""
    tiles = {(arch, head_dim) for arch, head_dim, _ in cases}
    for first in (TODAY, TODAY + 1):
        days = [one_dtype_per_tile(cases, day) for day in range(first, first + 4)]
        assert {case for day in days for case in day} == {(a, hd, dt) for a, hd in tiles for dt in DTYPES}
        assert all(abs(2 * len(day) - len(tiles)) <= 1 for day in days)


def _instance_inputs(head_dim, dtype):
    return _inputs((1, 150, 133, 4, 2, INSTANCE_SHAPES[head_dim]), dtype, seed=22)


def _run_backward(q, k, v, dout, out, lse, causal, deterministic, arch="sm_80", program=None):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal, deterministic)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads}
    program = program or fa2_tc.backward_program(problem, target(arch))
    with sim.targeting(arch), sim.record() as records:
        run_program(backend, program, problem, 1.0 / math.sqrt(problem.headdim), arrays)
    return (grads["dq"], grads["dk"], grads["dv"]), records


@pytest.mark.parametrize("arch, head_dim, dtype", FORWARD_CASES)
def test_every_forward_instance_race_free_reproducible_and_on_formula(arch, head_dim, dtype):
    """Race mode treats a cp.async destination as written at issue and in flight until its wait; the landing seed
    moves the moment each copy lands in normal mode, which must not change a bit of the result."""
    q, k, v, _ = _instance_inputs(head_dim, dtype)
    problem = _problem(q, k, True)
    with sim.checking("race"):
        out, lse, records = _run(q, k, v, True, None, arch)
    _check_forward(q, k, v, out, lse, True, None)
    assert _launch_traffic(records) == [tuple(fa2_tc.forward_traffic(problem, target(arch)))]
    for seed in (1, 2):
        with sim.copy_landing(seed):
            again, again_lse, _ = _run(q, k, v, True, None, arch)
        assert np.array_equal(out.view(np.uint16), again.view(np.uint16))
        assert np.array_equal(lse.view(np.uint32), again_lse.view(np.uint32))


@pytest.mark.parametrize("arch, head_dim, dtype", BACKWARD_CASES)
def test_every_backward_instance_race_free_reproducible_and_on_formula(arch, head_dim, dtype):
    """Both dq modes under the race detector (dq_accum by red.add from several K/V blocks into one slice, or from
    each block into its own slice); the deterministic mode bitwise equal across cp.async landings
    (tests/test_deterministic_backward.py runs blocks that loop over several K/V blocks)."""
    q, k, v, dout = _instance_inputs(head_dim, dtype)
    out, lse, _ = _run(q, k, v, True, None, arch)
    for deterministic in (False, True):
        problem = _problem(q, k, True, deterministic)
        with sim.checking("race"):
            grads, records = _run_backward(q, k, v, dout, out, lse, True, deterministic, arch)
        _check_backward(dout, q, k, v, grads, True, None)
        assert _launch_traffic(records) == [tuple(t) for t in fa2_tc.backward_traffic(problem, target(arch))]
    for seed in (1, 2):
        with sim.copy_landing(seed):
            again, _ = _run_backward(q, k, v, dout, out, lse, True, True, arch)
        for a, b in zip(grads, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def _every_instance_under_asan():
    results = []
    for arch, head_dim, dtype in ASAN_FORWARD_CASES:
        q, k, v, _ = _instance_inputs(head_dim, dtype)
        results.append(_run(q, k, v, True, None, arch)[:2])
    for arch, head_dim, dtype in ASAN_BACKWARD_CASES:
        q, k, v, dout = _instance_inputs(head_dim, dtype)
        out, lse, _ = _run(q, k, v, True, None, arch)
        results.append(_run_backward(q, k, v, dout, out, lse, True, True, arch)[0])
    return results


def test_every_instance_clean_under_asan():
    """Shared memory is allocated with exactly the planned bytes: an ldmatrix, cp.async or staging access past the
    swizzled layout, or a global access past a ragged tile, is reported (every tile, one_dtype_per_tile)."""
    results = sim.run_in_asan_subprocess(_every_instance_under_asan, timeout=1200)
    forward, backward = results[: len(ASAN_FORWARD_CASES)], results[len(ASAN_FORWARD_CASES):]
    for (arch, head_dim, dtype), (out, lse) in zip(ASAN_FORWARD_CASES, forward):
        q, k, v, _ = _instance_inputs(head_dim, dtype)
        _check_forward(q, k, v, out, lse, True, None)
    for (arch, head_dim, dtype), grads in zip(ASAN_BACKWARD_CASES, backward):
        q, k, v, dout = _instance_inputs(head_dim, dtype)
        _check_backward(dout, q, k, v, grads, True, None)


@pytest.mark.parametrize("head_dim", fa2_tc.HEAD_DIMS)
def test_no_bank_conflicts(head_dim):
    """Every shared-memory site of the forward and backward kernels at its ideal wavefront count: the swizzle spreads
    each ldmatrix phase (8 rows of one chunk, transposed or not) and each cp.async phase (8 chunks) over the 8 bank
    quads; the P / dS and output staging stores (a 4-byte pair per lane over 8 rows) and the 16-byte reads that
    copy the outputs out likewise; the lse / D reads are quad broadcasts."""
    q, k, v, dout = _inputs((1, 200, 190, 2, 2, head_dim), "float16", seed=23)
    with sim.checking("profile"):
        out, lse, forward = _run(q, k, v, True, None)
        _, backward = _run_backward(q, k, v, dout, out, lse, True, False)
    launches = [r for r in (*forward.launches, *backward.launches) if "fa2_tc_" in r.kernel]
    assert len(launches) == 2
    for launch in launches:
        kinds = {site.kind for site in launch.shared_access_sites}
        assert {"ldmatrix", "cp.async"} <= kinds
        for site in launch.shared_access_sites:
            assert site.excess == 0, (launch.kernel, site)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_kv_read_once_per_128_row_q_block(head_dim):
    batch, seqlen_q, seqlen_k, nheads = 2, 300, 170, 2
    q, k, v, _ = _inputs((batch, seqlen_q, seqlen_k, nheads, nheads, head_dim), "bfloat16", seed=24)
    assert fa2_tc.forward_traits(head_dim, SM80).block_m == 128
    _, _, records = _run(q, k, v, False, None)
    es = 2
    reads = batch * nheads * (seqlen_q * head_dim * es + 2 * math.ceil(seqlen_q / 128) * seqlen_k * head_dim * es)
    writes = batch * nheads * seqlen_q * (head_dim * es + 4)
    assert [(r.global_bytes_read, r.global_bytes_written) for r in records.launches] == [(reads, writes)]


def test_kernels_trap_on_any_launch_shape_but_their_own():
    q, k, v, _ = _inputs((1, 40, 50, 1, 1, 64), "float16", seed=25)
    (plan,) = fa2_tc.forward_program(_problem(q, k, False), SM80).launches
    for smem, block in ((plan.dynamic_smem_bytes - 16, plan.block), (plan.dynamic_smem_bytes + 16, plan.block),
                        (plan.dynamic_smem_bytes, (plan.block[0] // 2, 1, 1)),
                        (plan.dynamic_smem_bytes, (plan.block[0] // 2, 2, 1))):
        wrong = LaunchPlan(plan.kernel, plan.grid, block, smem)
        with pytest.raises(sim.KernelError, match="fa2_tc_forward_kernel"):
            _run(q, k, v, False, 0.1, program=Program(launches=(wrong,)))
    out, lse, _ = _run(q, k, v, False, 0.1)
    _check_forward(q, k, v, out, lse, False, 0.1)
    dout = _inputs((1, 40, 50, 1, 1, 64), "float16", seed=25)[3]
    program = fa2_tc.backward_program(_problem(q, k, False), SM80)
    pre, main, convert = program.launches
    for smem, block in ((main.dynamic_smem_bytes - 16, main.block), (main.dynamic_smem_bytes + 16, main.block),
                        (main.dynamic_smem_bytes, (main.block[0] // 2, 1, 1))):
        wrong = Program((pre, LaunchPlan(main.kernel, main.grid, block, smem), convert), program.scratch)
        with pytest.raises(sim.KernelError, match="fa2_tc_backward_kernel"):
            _run_backward(q, k, v, dout, out, lse, False, False, program=wrong)


def test_tile_tables():
    # 16-bit inputs take the tensor-core variant, float32 the SIMT one.
    for dtype, module in (("float16", fa2_tc), ("bfloat16", fa2_tc), ("float32", fa2)):
        problem = Problem(dtype, 1, 8, 8, 1, 1, 64)
        assert plans.variant_for("fa2", problem, SM80).module is module
    # The Hopper kernels come first, on sm_90 only (tests/test_fa3_plans.py).
    assert [v.name for v in catalog.variants("fa2")] == ["hopper", "tensor_core", "simt"]
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120"):
        t = target(arch)
        for head_dim in fa2_tc.HEAD_DIMS:
            traits = fa2_tc.forward_traits(head_dim, t)
            assert traits.smem_bytes <= t.smem_per_block_bytes
            assert traits.block_m == (64 if head_dim == 256 and arch != "sm_80" else 128)
            assert traits.block_m // traits.warps in (16, 32)
        instances = fa2_tc.instances(t)
        assert len(instances) == len(set(instances))
        for dropout in (False, True):
            assert sum("fa2_tc_forward_kernel" in i.name_expr and i.name_expr.endswith(", true>") == dropout
                       for i in instances) == 2 * len(fa2_tc.HEAD_DIMS)
    # FA2's head-dim-256 choice: 8 warps x 128 rows on A100, 4 warps x 64 rows (two blocks per SM) on H100.
    assert fa2_tc.forward_traits(256, SM80) == fa2_tc.ForwardTraits(256, 128, 64, 8)
    assert fa2_tc.forward_traits(256, target("sm_90")) == fa2_tc.ForwardTraits(256, 64, 64, 4)
    assert [fa2_tc.forward_traits(h, target("sm_86")).block_m for h in (1, 40, 100, 128)] == [128, 128, 128, 128]
    for bad in ((64, 128, 64, 3), (64, 128, 40, 4), (256, 256, 128, 8)):  # warps, k16 steps, shared memory
        with pytest.raises(ValueError):
            fa2_tc.ForwardTraits(*bad)
    with pytest.raises(ValueError, match="takes"):
        fa2_tc.ForwardTraits(64, 128, 64, 4).instance("float32")
    # Backward: 8 warps with FA2's 99 KB tiles up to head dim 96, FA2's 128 x 128 at 64 where a block has its 145 KB
    # and the installed NVRTC is CUDA 13's (12.9's ptxas spills it) and its 64 x 128 at 96 and 128 where it fits (the
    # 99 KB targets take 64 x 64, as does sm_100 at 128, whose ptxas spills the larger one there), the 99 KB targets'
    # own row at 256.
    cuda12 = fa2_tc._nvrtc_major() == 12
    for arch in ("sm_80", "sm_86", "sm_90", "sm_100"):
        for head_dim in fa2_tc.HEAD_DIMS:
            traits = fa2_tc.backward_traits(head_dim, target(arch))
            assert traits.smem_bytes <= target(arch).smem_per_block_bytes
            second = ((arch == "sm_86" and head_dim in (96, 128, 256)) or (arch == "sm_100" and head_dim == 128)
                      or (head_dim == 64 and (arch == "sm_86" or cuda12)))
            assert traits == fa2_tc.BACKWARD_CHOICES[head_dim][1 if second else 0]
    assert (fa2_tc.backward_traits(128, SM80).block_n, fa2_tc.backward_traits(128, target("sm_100")).block_n) == (128, 64)
    assert [fa2_tc.backward_traits(96, target(arch)).block_n for arch in ("sm_80", "sm_86", "sm_100")] == [128, 64, 128]
    assert {fa2_tc.backward_traits(64, target(arch)).block_m for arch in ("sm_80", "sm_90")} == {64 if cuda12 else 128}
    assert fa2_tc.backward_traits(128, SM80, dropout=True).block_n == 64
    assert fa2_tc.backward_traits(64, target("sm_90"), dropout=True).block_m == 64
    # Square warp tiles (FA2's atom layouts: 2 x 4 warps of 32 x 32 for d128's 64 x 128 S/dP, 4 x 2 of 32 x 64 for its
    # 128 x 128 dK/dV); dQ's whole strips (square=False) take the most warps along the rows.
    shapes = ((64, 128, 8), (128, 128, 8), (64, 64, 8), (32, 32, 4), (32, 32, 8))
    assert [fa2_tc.pick_warps_m(*shape) for shape in shapes] == [2, 4, 4, 2, 0]
    assert [fa2_tc.pick_warps_m(*shape, square=False) for shape in shapes] == [4, 8, 4, 2, 0]
    for bad in ((64, 48, 128, 8), (256, 32, 32, 8), (256, 128, 128, 8)):  # block_m, warp tiling, shared memory
        with pytest.raises(ValueError):
            fa2_tc.BackwardTraits(*bad)
    with pytest.raises(KeyError):
        fa2_tc.dynamic_smem_bytes(fa2.ForwardTraits(64, 64, 64, 4).instance("float16"))


def _sass(traits, arch: str) -> list[tuple[int, str]]:
    """(address, instruction) of the float16 instance of ``traits`` compiled for ``arch``, predicates included."""
    sass = nvrtc.dump_sass(nvrtc.compile_instance(traits.instance("float16"), arch))
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    return [(int(address, 16), text) for address, text in re.findall(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?);", sass, re.M)]


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def _branch_free_runs(sass: list[tuple[int, str]]) -> list[list[str]]:
    """The opcodes of a function's SASS, cut at every branch and exit."""
    runs, run = [], []
    for _, instruction in sass:
        if _opcode(instruction).startswith(("BRA", "EXIT")):
            runs.append(run)
            run = []
        else:
            run.append(_opcode(instruction))
    return runs + [run]


def _loops(sass: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of every loop of a function's SASS: from a backward branch's target to the branch."""
    loops = []
    for address, instruction in sass:
        target = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", instruction)
        if target and int(target.group(1), 16) < address:
            loops.append([text for at, text in sass if int(target.group(1), 16) <= at <= address])
    return loops


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_backward_plain_tiles_make_p_and_ds_without_a_branch(arch):
    # The scores of a tile without softcap, ALiBi or element-wise mask (block-uniform tests) take a body compiled
    # for that case: every exponential of the lane's scores in one straight run. Tested per score, each of them
    # sat behind its own branches (no run held more than one).
    traits = fa2_tc.backward_traits(128, target(arch))
    scores_per_lane = traits.block_m * traits.block_n // traits.threads
    most = max(run.count("MUFU.EX2") for run in _branch_free_runs(_sass(traits, arch)))
    assert most >= scores_per_lane, f"{most} exponentials in the longest branch-free run, {scores_per_lane} scores"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_forward_kv_copies_step_their_rows(arch):
    # On contiguous, 16-byte aligned K and V, each thread's copies of a tile are one column of rows kRowStep apart
    # (fa2_tc_tiles.cuh's load_tile), and where its chunk is whole (interior tiles) the copy has no zero fill: a
    # loop of 12 instructions per 16-byte cp.async. The zero-filling loop of a ragged end spans about 21, the
    # general loop (paged caches, head dims whose rows the threads do not cover whole) about 77.
    sass = _sass(fa2_tc.forward_traits(128, target(arch)), arch)
    copy_loops = [loop for loop in _loops(sass) if sum("LDGSTS" in text for text in loop) == 1]
    whole = [len(loop) for loop in copy_loops if not any("ZFILL" in text for text in loop)]
    assert whole and min(whole) <= 16, f"copy loops without zero fill: {sorted(whole)} instructions"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_forward_whole_kv_tiles_copy_in_one_straight_run(arch, head_dim):
    # Interior K and V blocks (contiguous, 16-byte aligned rows, the compiled head dim: fa2_tc_tiles.cuh's
    # load_whole_tile, taken per block) are copied as FA2 copies them: each thread's 16-byte cp.async of a tile in one
    # branch-free run, every shared-memory address a base register plus an immediate (one base where a thread's rows
    # are 8k apart; two where they are 4 apart, sm_90's d256 64 x 64 on 4 warps: the XOR key alternates; one per
    # column part at d96 and d192, whose rows copy as 8 + 4 and 16 + 8 chunks). Ragged, paged or misaligned blocks
    # keep load_tile (test_forward_kv_copies_step_their_rows).
    traits = fa2_tc.forward_traits(head_dim, target(arch))
    copies = traits.block_n * traits.head_dim // 8 // traits.threads  # per thread and tile
    runs, run = [], []
    for _, instruction in _sass(traits, arch):
        if _opcode(instruction).startswith(("BRA", "EXIT")):
            runs.append(run)
            run = []
        elif _opcode(instruction).startswith("LDGSTS"):
            run.append(instruction)
    whole = []
    for run in runs + [run]:
        bases = {re.search(r"LDGSTS\S*\s+\[(R\d+)", text).group(1) for text in run}
        if len(run) == copies and len(bases) <= 2 and not any("ZFILL" in text for text in run):
            whole.append(run)
    assert len(whole) >= 2, f"no straight runs of {copies} copies from one base (K and V)"


# ---------------------------------------------------------------------------------------------------
# On a GPU.


# Head dims on the compiled sizes and between them, among them ones that end on a 16-byte chunk boundary short of
# the tile (24, 40, 56, 120): there the copies zero-fill whole chunks, which NVRTC 13.0's ptxas once miscompiled
# (fa2_tc_tiles.cuh, load_tile) where the simulator could not see it.
GPU_HEAD_DIMS = [24, 40, 56, 64, 72, 120, 128, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
def test_gpu_tensor_core_forward(dtype, head_dim):
    cupy = pytest.importorskip("cupy")
    q, k, v, _ = _inputs((2, 333, 517, 6, 2, head_dim), dtype, seed=26)
    gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
    for causal in (False, True):
        out, lse = cuflash.attention(gq, gk, gv, causal=causal, algorithm="fa2", return_lse=True)
        _check_forward(q, k, v, cupy.asnumpy(out), cupy.asnumpy(lse), causal, None)
        for _ in range(3):
            again = cuflash.attention(gq, gk, gv, causal=causal, algorithm="fa2")
            assert bool(cupy.all(again.view(cupy.uint16) == out.view(cupy.uint16)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
def test_gpu_tensor_core_backward(dtype, head_dim):
    cupy = pytest.importorskip("cupy")
    q, k, v, dout = _inputs((2, 333, 517, 6, 2, head_dim), dtype, seed=27)
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    for causal in (False, True):
        out, lse = cuflash.attention(gq, gk, gv, causal=causal, algorithm="fa2", return_lse=True)
        for deterministic in (False, True):
            grads = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=causal, algorithm="fa2",
                                               deterministic=deterministic)
            _check_backward(dout, q, k, v, [cupy.asnumpy(g) for g in grads], causal, None)
        again = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=causal, algorithm="fa2",
                                           deterministic=True)
        for a, b in zip(grads, again):
            assert bool(cupy.all(a.view(cupy.uint16) == b.view(cupy.uint16)))
