"""Flash paths never allocate O(seqlen_q x seqlen_k) memory, scratch included.

Every program the plans can make for a flash algorithm (fa2 in both variants, SIMT float32 and tensor-core 16-bit,
and fa1), forward and backward, with each option (causal, window, deterministic, dropout, softcap/ALiBi, varlen,
KV cache contiguous and paged with split-KV, GQA/MQA), on every target, is planned at seqlens 1k .. 128k (only
planned: nothing is allocated or launched) and its scratch must grow linearly:

* at every seqlen the scratch is at most C float32 copies of q and k, per query head, with C a constant of the
  devices and families (the most SMs of any target, FA2's deterministic dq slices being at most one per SM; 128
  split-KV partial results), never of the sequence lengths;
* from 16k on, doubling both sequence lengths at most doubles the scratch (plus a few bytes of slack); O(seqlen^2)
  scratch quadruples, which is what per-K/V-block dq slices did. Below that, counts that grow with the K/V
  blocks up to a device constant (FA2's dq slices: about SMs / (batch * nheads_k), reached by 10k keys for one
  head on 148 SMs; split-KV) may still be growing, which the first check bounds.

"standard" materializes the seqlen_q x seqlen_k scores and probabilities by design, so it is the one algorithm not
held to this; the last test checks the checker does see its quadratic scratch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from cuflash.kernels import catalog, plans
from cuflash.kernels.families import fa2
from cuflash.kernels.program import Problem, Program
from cuflash.kernels.targets import TARGETS
from cuflash.mask import Mask

MATERIALIZING_ALGORITHMS = ("standard",)
FLASH_ALGORITHMS = tuple(a for a in catalog.algorithms() if a not in MATERIALIZING_ALGORITHMS)
SEQLENS = tuple(1024 * 2**i for i in range(8))  # 1k .. 128k
# Below this, a deterministic backward's dq slices still grow with seqlen_k (one per K/V block, up to the SM count:
# num_dq_splits_for's cap); from here every target's cap is reached for K/V blocks of up to 128 keys (d32's and
# d64's tensor-core tiles), so doubling the length at most doubles the scratch.
DOUBLING_FROM = next(s for s in SEQLENS if s >= 128 * max(t.sm_count for t in TARGETS.values()))
# Bytes a doubling may add beyond twice the scratch: per-row statistics rounded to blocks and the like.
SLACK_BYTES = 64 * 1024
# The largest number of float32 copies of a query (or key) row any flash program keeps: FA2's deterministic dq
# slices (at most one per SM of the device: num_dq_splits_for) or split-KV partial results (at most 128), plus a
# few accumulators (dq, dk, dv, out).
MAX_ROW_COPIES = 4 + max(max(t.sm_count for t in TARGETS.values()), fa2.MAX_KV_SPLITS)

SHAPES = {  # (batch, nheads, nheads_k, headdim)
    "mha-b1h1": (1, 1, 1, 64),  # one head: FA2's deterministic rule gives it the most dq slices
    "gqa": (2, 8, 2, 128),
    "mqa": (1, 4, 1, 256),
}


def _options(seqlen: int) -> dict[str, dict]:
    """Problem fields per option, for both sequence lengths = seqlen."""
    page_size = 256
    kvcache = dict(kvcache=True, seqlen_q=1)
    return {
        "plain": {},
        "causal": dict(mask=Mask.causal()),
        "window": dict(mask=Mask(256, 0)),
        "deterministic": dict(deterministic=True),
        "deterministic-causal": dict(deterministic=True, mask=Mask.causal()),
        "dropout": dict(dropout_p=0.1, deterministic=True),
        "softcap-alibi": dict(softcap=30.0, alibi="heads"),
        "varlen": dict(total_q=3 * seqlen, total_k=3 * seqlen, deterministic=True),
        "kvcache": dict(kvcache),
        "kvcache-split-heuristic": dict(kvcache, num_splits=0),
        "kvcache-split-7": dict(kvcache, num_splits=7),
        "kvcache-split-128": dict(kvcache, num_splits=128),
        "kvcache-paged-split": dict(kvcache, num_splits=0, page_size=page_size,
                                    pages_per_sequence=math.ceil(seqlen / page_size)),
        "kvcache-rows-split": dict(kvcache, seqlen_q=seqlen // 64, num_splits=0),
    }


def _problem(dtype: str, shape: str, option: str, seqlen: int) -> Problem:
    batch, nheads, nheads_k, headdim = SHAPES[shape]
    fields = dict(dtype=dtype, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads, nheads_k=nheads_k,
                  headdim=headdim)
    fields.update(_options(seqlen)[option])
    return Problem(**fields)


def _scratch_bytes(program: Program) -> int:
    return sum(4 * math.prod(s.shape) for s in program.scratch)


def _programs(algorithm: str, problem: Problem, target) -> dict[str, Program]:
    """Forward and (where there is one: not for a KV cache) backward programs of the variant serving ``problem``;
    empty if no variant of the algorithm takes it."""
    if not any(v.serves(problem, target) for v in catalog.variants(algorithm)):
        return {}
    programs = {"forward": plans.forward_program(algorithm, problem, target)}
    if not problem.kvcache:
        programs["backward"] = plans.backward_program(algorithm, problem, target)
    return programs


def _linear_unit(problem: Problem) -> int:
    """float32 bytes of one copy of q and one of k per query head: what linear-memory scratch is measured in."""
    rows_q = problem.rows_q
    rows_k = problem.rows_k if not problem.kvcache else problem.batch * problem.seqlen_k
    return 4 * problem.nheads * problem.headdim * (rows_q + rows_k)


def _check_linear(algorithm: str, dtype: str, shape: str, option: str, target) -> int:
    """Assert the scratch of every program of this case grows linearly over SEQLENS; return how many programs."""
    scratch: dict[str, list[int]] = {}
    problems = [_problem(dtype, shape, option, seqlen) for seqlen in SEQLENS]
    for problem in problems:
        for direction, program in _programs(algorithm, problem, target).items():
            scratch.setdefault(direction, []).append(_scratch_bytes(program))
    for direction, sizes in scratch.items():
        where = f"{algorithm} {dtype} {shape} {option} {direction} on {target.arch}: scratch {sizes}"
        for seqlen, size, problem in zip(SEQLENS, sizes, problems):
            assert size <= MAX_ROW_COPIES * _linear_unit(problem), f"{where} exceeds linear at seqlen {seqlen}"
        for seqlen, small, large in zip(SEQLENS, sizes, sizes[1:]):
            if seqlen >= DOUBLING_FROM:
                assert large <= 2 * small + SLACK_BYTES, f"{where} more than doubles from {seqlen} to {2 * seqlen}"
    return len(scratch)


@pytest.mark.parametrize("algorithm", FLASH_ALGORITHMS)
@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_flash_scratch_is_linear_in_seqlen(algorithm, arch):
    target = TARGETS[arch]
    checked = 0
    for dtype in ("float32", "float16", "bfloat16"):
        for shape in SHAPES:
            for option in _options(SEQLENS[0]):
                checked += _check_linear(algorithm, dtype, shape, option, target)
    assert checked > 0


def test_deterministic_dq_slices_follow_the_sm_count_not_seqlen_k():
    """The one rule (fa2.num_dq_splits_for), as plans apply it: S = clamp(ceil(SMs / (batch * nheads_k)), 1,
    K/V blocks) in deterministic mode, 1 otherwise; the main kernel's grid.x is S (deterministic) or the K/V
    blocks."""
    target = TARGETS["sm_90"]
    for dtype in ("float32", "float16"):
        for seqlen in SEQLENS:
            for batch, nheads_k in ((1, 1), (2, 8), (4, 64)):
                problem = Problem(dtype, batch, seqlen, seqlen, nheads_k, nheads_k, 128, deterministic=True)
                program = plans.backward_program("fa2", problem, target)
                block_n = plans.variant_for("fa2", problem, target, "backward").module.backward_traits(128, target).block_n
                kv_blocks = math.ceil(seqlen / block_n)
                expected = max(1, min(kv_blocks, math.ceil(target.sm_count / (batch * nheads_k))))
                assert program.num_dq_splits == expected
                assert program.launches[1].grid == (expected, nheads_k, batch)
                atomic = plans.backward_program("fa2", dataclasses.replace(problem, deterministic=False), target)
                assert atomic.num_dq_splits == 1 and atomic.launches[1].grid == (kv_blocks, nheads_k, batch)


def test_the_check_sees_standard_attentions_quadratic_scratch():
    target = TARGETS["sm_80"]
    with pytest.raises(AssertionError, match="exceeds linear"):
        _check_linear("standard", "float16", "gqa", "plain", target)
