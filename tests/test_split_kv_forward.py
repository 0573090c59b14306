"""Split-KV on any forward: ``num_splits`` of cuflash.attention and cuflash.attention_varlen (FA3's option; FA2 runs
its heuristic on the fixed-length forward), the same split kernels and combine kernel as a KV-cache decode.

* A grid in rotation over the entry point (fixed-length, varlen), dtypes (SIMT float32, mma.sync 16-bit), the
  simulator's target (sm_80; sm_90, where 16-bit calls run the Hopper forward), split counts (2, 3, the heuristic,
  more than there are K/V blocks) and options (masks, softcap with ALiBi, sinks): the split result against the
  float64 reference under FlashAttention's rule, against the unsplit call of the same signature, rows that see no
  key (out 0, lse -inf or the sink), and which kernels ran (the combine kernel exactly when the plan splits).
* The backward takes a split forward's out and lse: gradients within the rule of the reference.
* Plans: the heuristic splits a short-query grid that leaves SMs idle and not a full one; asked counts stop at one
  split per K/V block; a backward Problem never splits.
* Refusals before any kernel runs, naming num_splits: dropout, algorithms without split-KV, bad values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.kernels import plans, targets
from cuflash.kernels.families import fa2
from cuflash.kernels.program import Problem
from cuflash.mask import Mask
from cuflash.testing import numpy_dtype

COMBINE = "fa2_split_kv_combine_kernel"

ENTRIES = ["attention", "varlen"]
DTYPES = ["float16", "bfloat16", "float32"]
TARGETS = ["sm_80", "sm_90"]
SPLITS = [2, 3, 0, 128]  # 0: the heuristic; 128: more splits than K/V blocks (one per block)
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),  # seqlen_q > seqlen_k somewhere: rows that see no key
    "window": dict(window_size=(70, 9)),
    "softcap-alibi": dict(softcap=4.0, alibi=True),
    "sinks-causal": dict(sinks=True, causal=True),
}
# (nheads, nheads_k, headdim): GQA, MQA, MHA; head dims that are not powers of two.
HEADS = [(4, 2, 40), (3, 1, 72), (2, 2, 24)]
# Fixed length: (batch, seqlen_q, seqlen_k); varlen: (query lengths, key lengths), with empty sequences, a sequence
# without keys, one with more query rows than keys, and several K/V blocks per sequence.
FIXED_SHAPES = [(2, 5, 333), (1, 90, 260)]
PACKINGS = [([5, 0, 40, 1], [300, 3, 200, 0]), ([90, 2], [70, 250])]


def _cases():
    cases = []
    for i in range(10):
        entry, dtype, target = ENTRIES[i % 2], DTYPES[i % 3], TARGETS[(i // 2) % 2]
        splits, option, heads = SPLITS[i % 4], list(OPTIONS)[i % 5], HEADS[i % 3]
        shape = (FIXED_SHAPES if entry == "attention" else PACKINGS)[(i // 2) % 2]
        cases.append(pytest.param(entry, dtype, target, splits, option, heads, shape,
                                  id=f"{entry}-{dtype}-{target}-splits{splits}-{option}-h{heads[0]}x{heads[1]}"
                                     f"d{heads[2]}-shape{(i // 2) % 2}"))
    return cases


CASES = _cases()


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in CASES]
    for axis, expected in enumerate((ENTRIES, DTYPES, TARGETS, SPLITS, list(OPTIONS), HEADS)):
        assert {repr(v[axis]) for v in values} == {repr(e) for e in expected}, axis
    assert {repr(v[6]) for v in values} == {repr(s) for s in FIXED_SHAPES + PACKINGS}


def _inputs(entry, shape, heads, dtype, option, seed):
    rng = np.random.default_rng(seed)
    nheads, nheads_k, headdim = heads
    dt = numpy_dtype(dtype)
    if entry == "attention":
        batch, seqlen_q, seqlen_k = shape
        q_shape, k_shape = (batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim)
    else:
        batch = len(shape[0])
        q_shape, k_shape = (sum(shape[0]), nheads, headdim), (sum(shape[1]), nheads_k, headdim)
    q, k, v, dout = (rng.standard_normal(s).astype(dt) for s in (q_shape, k_shape, k_shape, q_shape))
    options = dict(OPTIONS[option])
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, (batch, nheads) if seed % 2 else (nheads,)).astype(
            np.float32)
    if options.pop("sinks", False):
        options["sinks"] = rng.uniform(-1.0, 2.0, nheads).astype(np.float32)
    return (q, k, v, dout), options


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _call(entry, shape, q, k, v, options, **more):
    if entry == "attention":
        return cuflash.attention(q, k, v, return_lse=True, **options, **more)
    return cuflash.attention_varlen(q, k, v, _cu(shape[0]), _cu(shape[1]), return_lse=True, **options, **more)


def _rows_without_key(entry, shape, options) -> list:
    """Index arrays (into out's rows; lse's last axis) of the rows that see no key."""
    mask = Mask.of(options.get("causal", False), options.get("window_size", (-1, -1)))
    if entry == "attention":
        return [np.s_[:, rows] for rows in [mask.policy(shape[1], shape[2]).rows_without_key()]]
    return [np.concatenate([mask.policy(sq, sk).rows_without_key() for sq, sk in zip(*shape)])]


def _expected_splits(entry, shape, heads, dtype, target, splits) -> int:
    """The split count the plan takes for this call (the combine kernel runs exactly when it is above 1)."""
    nheads, nheads_k, headdim = heads
    if entry == "attention":
        batch, seqlen_q, seqlen_k = shape
    else:
        batch, seqlen_q, seqlen_k = len(shape[0]), max(shape[0]), max(shape[1])
    problem = Problem(dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads,
                      nheads_k=nheads_k, headdim=headdim, num_splits=splits)
    return plans.forward_program("fa2", problem, targets.target(target)).num_kv_splits


@pytest.mark.parametrize("entry, dtype, target, splits, option, heads, shape", CASES)
def test_split_forward_matches_reference_and_one_split(entry, dtype, target, splits, option, heads, shape):
    (q, k, v, _), options = _inputs(entry, shape, heads, dtype, option, seed=3 + splits)
    results = {}
    with sim.targeting(target):
        for n in (1, splits):
            with sim.record() as records:
                results[n] = _call(entry, shape, q, k, v, options, num_splits=n)
            kernels = [str(launch.kernel) for launch in records.launches]
            expected = 1 if n == 1 else _expected_splits(entry, shape, heads, dtype, target, n)
            assert any(COMBINE in name for name in kernels) == (expected > 1), kernels
            if target == "sm_90" and dtype != "float32":
                assert kernels[0].startswith("cuflash::fa3_forward_kernel<"), kernels
    assert _expected_splits(entry, shape, heads, dtype, target, splits) > 1  # every case splits
    cu = None if entry == "attention" else (_cu(shape[0]), _cu(shape[1]))
    ref = tol.forward_references(q, k, v, cu_seqlens=cu, **options)
    atol = 4 * options.get("softcap", 0.0) * 2.0**-23  # the kernels' tanh (see test_varlen.py)
    for n, (out, lse) in results.items():
        assert out.shape == q.shape and out.dtype == q.dtype
        tol.check_close(f"out (num_splits={n})", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR, atol=atol)
        tol.check_close(f"lse (num_splits={n})", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR, atol=atol)
    out, lse = results[splits]
    tol.check_close("out vs num_splits=1", out, results[1][0].astype(np.float64), ref.out_lowp,
                    2 * tol.FORWARD_FACTOR, atol=atol)
    tol.check_close("lse vs num_splits=1", lse, results[1][1].astype(np.float64), ref.lse_lowp,
                    2 * tol.FORWARD_FACTOR, atol=atol)
    for rows in _rows_without_key(entry, shape, options):
        assert np.all(out[rows].astype(np.float32) == 0)
        lse_rows = lse[..., rows[1]] if entry == "attention" else lse[:, rows]
        if "sinks" in options:  # the row's softmax is its sink alone
            head_axis = 1 if entry == "attention" else 0
            sinks = np.expand_dims(options["sinks"], tuple(a for a in range(lse_rows.ndim) if a != head_axis))
            assert np.array_equal(lse_rows, np.broadcast_to(sinks, lse_rows.shape))
        else:
            assert np.all(lse_rows == -np.inf)


@pytest.mark.parametrize("entry", ENTRIES)
def test_backward_takes_a_split_forward(entry):
    """The gradients from a split forward's out and lse, within FA2's rule of the float64 reference."""
    shape = FIXED_SHAPES[1] if entry == "attention" else PACKINGS[1]
    (q, k, v, dout), options = _inputs(entry, shape, HEADS[0], "float16", "causal", seed=11)
    with sim.record() as records:
        out, lse = _call(entry, shape, q, k, v, options, num_splits=3)
    assert any(COMBINE in str(launch.kernel) for launch in records.launches)
    if entry == "attention":
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
        cu = None
    else:
        cu = (_cu(shape[0]), _cu(shape[1]))
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, *cu, **options)
    ref = tol.backward_references(dout, q, k, v, cu_seqlens=cu, **options)
    for name, got, r64, low in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv),
                                   (ref.dq_lowp, ref.dk_lowp, ref.dv_lowp)):
        tol.check_close(name, got, r64, low, tol.BACKWARD_FACTOR)


def test_chunked_attention_splits_its_virtual_batches():
    """attention_chunk runs as a varlen call over one sequence per chunk: num_splits reaches it."""
    (q, k, v, _), options = _inputs("attention", (1, 4, 600), HEADS[0], "float16", "plain", seed=5)
    for n in (1, 2):
        with sim.record() as records:
            out, lse = cuflash.attention(q, k, v, attention_chunk=256, num_splits=n, return_lse=True)
        assert any(COMBINE in str(launch.kernel) for launch in records.launches) == (n == 2)
    ref = tol.forward_references(q[:, :, :, :], k[:, 512:], v[:, 512:])  # the 4 rows' chunk: keys 512..599
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)


def test_plans_split_short_query_grids_and_never_a_backward():
    target = targets.target("sm_80")
    short = Problem(dtype="float16", batch=1, seqlen_q=64, seqlen_k=4096, nheads=8, nheads_k=8, headdim=128,
                    num_splits=0)
    traits = fa2.tile_traits(short, target, "forward")
    kv_blocks = -(-4096 // traits.block_n)
    program = plans.forward_program("fa2", short, target)
    assert program.num_kv_splits == fa2.split_heuristic(8, target.sm_count, kv_blocks) > 1
    assert program.launches[0].grid == (program.num_kv_splits, 8, 1) and COMBINE in str(program.launches[1].kernel)
    # A grid that fills the SMs stays whole; asked counts stop at one split per K/V block.
    full = dataclasses.replace(short, batch=8, seqlen_q=2048)
    assert plans.forward_program("fa2", full, target).num_kv_splits == 1
    assert plans.forward_program("fa2", dataclasses.replace(short, num_splits=500 // 4), target).num_kv_splits == \
        min(125, kv_blocks)
    varlen = dataclasses.replace(short, total_q=70, total_k=5000, num_splits=3)
    assert plans.forward_program("fa2", varlen, target).num_kv_splits == 3
    with pytest.raises(ValueError, match="num_splits is the forward's"):
        plans.backward_program("fa2", varlen, target)
    with pytest.raises(ValueError, match="num_splits other than 1 .* needs dropout_p == 0"):
        dataclasses.replace(short, dropout_p=0.1)


def test_refusals_name_num_splits():
    (q, k, v, _), _ = _inputs("attention", (1, 3, 200), HEADS[0], "float16", "plain", seed=1)
    cu_q, cu_k = _cu([3]), _cu([200])
    bad = {
        "dropout": (dict(num_splits=2, dropout_p=0.1, dropout_seed=7),
                    r"num_splits must be 1 when dropout_p > 0 .*got num_splits=2"),
        "heuristic-with-dropout": (dict(num_splits=0, dropout_p=0.1, dropout_seed=7), r"num_splits must be 1"),
        "fa1": (dict(num_splits=2, algorithm="fa1"), r"num_splits other than 1 \(split-KV\) is supported by "
                                                     r"algorithm='fa2' only, got algorithm='fa1'"),
        "standard": (dict(num_splits=0, algorithm="standard"), r"num_splits other than 1 .*'standard'"),
        "over-limit": (dict(num_splits=129), r"num_splits must be in \[0, 128\]"),
        "negative": (dict(num_splits=-1), r"num_splits must be in \[0, 128\]"),
        "float": (dict(num_splits=2.0), r"num_splits"),
        "bool": (dict(num_splits=True), r"num_splits"),
    }
    for name, (options, message) in bad.items():
        with sim.record() as records:
            with pytest.raises((ValueError, TypeError), match=message):
                cuflash.attention(q, k, v, **options)
            with pytest.raises((ValueError, TypeError), match=message):
                cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, **options)
        assert not records.launches, name


def test_default_calls_do_not_split():
    """num_splits omitted: one launch, as before the option (the result does not depend on the device)."""
    (q, k, v, _), _ = _inputs("attention", (1, 3, 700), HEADS[0], "float16", "plain", seed=2)
    with sim.record() as records:
        cuflash.attention(q, k, v)
        cuflash.attention_varlen(q[0], k[0], v[0], _cu([3]), _cu([700]))
    assert len(records.launches) == 2 and not any(COMBINE in str(launch.kernel) for launch in records.launches)
