"""The deterministic fa2 backward (FA2's rule, fa2.num_dq_splits_for): S dq_accum slices fixed by the device's SM
count, block x of the main kernel looping over K/V blocks x, x + S, ... and adding into slice x, the convert
kernel summing the S slices in order.

The simulator stands in for sm_87 (16 SMs) here, so the grids are small enough that S >= 2 and every block loops
over two K/V blocks or more (each case asserts it on the launch it recorded). Per case, SIMT float32 and
tensor-core float16 / bfloat16, GQA, causal and not, sequence lengths that are no block multiple (a tall case with
rows that see no key), and a varlen batch with a sequence too short for some blocks' K/V blocks:

* dq, dk and dv are the same bits when rerun and when cp.async copies land at other moments (copy_landing seeds);
* they meet FlashAttention's tolerance against the float64 reference; rows that see no key get dq = 0.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.kernels import plans
from cuflash.kernels.program import Problem
from cuflash.mask import Mask
from cuflash.testing import numpy_dtype, random_inputs, rows_without_key

ARCH = "sm_87"  # 16 SMs: batch * nheads_k = 8 gives S = 2 dq slices
LANDING_SEEDS = (1, 1, 2)  # a rerun, then other cp.async landing moments

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): 4 K/V blocks of the tensor cores' 128 keys at d64 (8 of
# the SIMT kernel's 64), the last ragged, for S = 2.
CASES = {
    "float32": (2, 101, 459, 8, 4, 64),
    "float16": (2, 490, 459, 8, 4, 64),  # seqlen_q > seqlen_k: causal leaves 31 rows without a key
    "bfloat16": (2, 101, 459, 8, 4, 40),  # head dim 40 runs on the 64 kernel
}


def _main_launch(records):
    (launch,) = [r for r in records.launches if "backward_kernel" in r.kernel]
    return launch


def _assert_loops(records, problem: Problem) -> None:
    """The main kernel ran S >= 2 blocks per kv head, each over >= 2 K/V blocks, as planned; with fixed lengths,
    every launch moved exactly the bytes of the traffic formulas."""
    target = sim.current_target()
    program = plans.backward_program("fa2", problem, target)
    family = plans.variant_for("fa2", problem, target, "backward").module
    kv_blocks = -(-problem.seqlen_k // family.backward_traits(problem.headdim, target).block_n)
    launch = _main_launch(records)
    assert launch.grid == program.launches[1].grid == (program.num_dq_splits, problem.nheads_k, problem.batch)
    assert 2 <= program.num_dq_splits and kv_blocks >= 2 * program.num_dq_splits
    if not problem.varlen:
        moved = [(r.global_bytes_read, r.global_bytes_written) for r in records.launches]
        assert moved == [tuple(t) for t in family.backward_traffic(problem, target)]


def _runs(backward) -> list:
    """``backward()`` under each landing seed, recorded; returns [(grads, records)]."""
    runs = []
    for seed in LANDING_SEEDS:
        with sim.copy_landing(seed), sim.record() as records:
            grads = backward()
        runs.append((tuple(np.asarray(g) for g in grads), records))
    return runs


def _assert_same_bits(runs) -> None:
    first = runs[0][0]
    for grads, _ in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), first, grads):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(CASES))
def test_deterministic_backward_is_bitwise_reproducible_and_accurate(dtype, causal):
    shape = CASES[dtype]
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = shape
    q, k, v, dout = random_inputs(shape, dtype, seed=31 + causal)
    problem = Problem(dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, mask=Mask.causal(causal),
                      deterministic=True)
    with sim.targeting(ARCH):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        runs = _runs(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True))
        _assert_loops(runs[0][1], problem)
    _assert_same_bits(runs)

    ref = tol.backward_references(dout, q, k, v, causal=causal)
    atol = 1e-5 if causal else 0.0
    for name, grad in zip(("dq", "dk", "dv"), runs[0][0]):
        tol.check_close(name, grad, getattr(ref, name), getattr(ref, name + "_lowp"), tol.BACKWARD_FACTOR, atol)
    empty = rows_without_key(seqlen_q, seqlen_k, causal)
    assert np.all(runs[0][0][0].astype(np.float32)[:, empty] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_varlen_deterministic_backward_skips_keys_past_a_sequence(dtype):
    """Three sequences (4, 2 and 1 tensor-core K/V blocks; batch * nheads_k = 12, S = 2): block 0 loops over K/V
    blocks 0 and 2 of the first sequence, block 1 over 1 and 3; for the last sequence block 1 has no K/V block and
    skips its iterations (no early return before the loop's barriers). The SIMT kernel's 64-key blocks: 8, 3, 1."""
    lengths_q, lengths_k = [101, 37, 9], [459, 150, 5]
    nheads, nheads_k, headdim = 8, 4, 48
    rng = np.random.default_rng(7)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((sum(lengths_q), nheads, headdim)).astype(dt)
    k = rng.standard_normal((sum(lengths_k), nheads_k, headdim)).astype(dt)
    v = rng.standard_normal((sum(lengths_k), nheads_k, headdim)).astype(dt)
    dout = rng.standard_normal(q.shape).astype(dt)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    options = dict(causal=True)
    problem = Problem(dtype, len(lengths_q), max(lengths_q), max(lengths_k), nheads, nheads_k, headdim,
                      mask=Mask.causal(), deterministic=True, total_q=sum(lengths_q), total_k=sum(lengths_k))
    with sim.targeting(ARCH):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
        runs = _runs(lambda: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                               deterministic=True, **options))
        _assert_loops(runs[0][1], problem)
    _assert_same_bits(runs)

    ref = tol.backward_references(dout, q, k, v, cu_seqlens=(cu_q, cu_k), **options)
    for name, grad in zip(("dq", "dk", "dv"), runs[0][0]):
        tol.check_close(name, grad, getattr(ref, name), getattr(ref, name + "_lowp"), tol.BACKWARD_FACTOR, 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_looping_blocks_are_race_free(dtype):
    """The race detector over blocks that loop over K/V blocks: each iteration's K/V loads wait for the previous
    iteration's last reads of the K and V tiles (and, tensor cores, of its dK / dV staging there)."""
    shape = (2, 40, 459, 8, 4, 64)
    q, k, v, dout = random_inputs(shape, dtype, seed=41)
    problem = Problem(dtype, *shape, mask=Mask.causal(), deterministic=True)
    with sim.targeting(ARCH):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        with sim.checking("race"), sim.record() as records:
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        _assert_loops(records, problem)
    ref = tol.backward_references(dout, q, k, v, causal=True)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, grad, getattr(ref, name), getattr(ref, name + "_lowp"), tol.BACKWARD_FACTOR, 1e-5)
