"""Learnable attention sinks ([parity] item 4): ``sinks=`` on attention, its backward, varlen, the KV cache and the
packed entry points (NumPy here; JAX in tests/jax/test_jax_sinks.py).

* Forward and backward against the float64 reference under FA2's rule, dsinks included, over both fa2 variants
  (float32 SIMT, float16/bfloat16 tensor cores), odd shapes, GQA/MQA, seqlen_q != seqlen_k, causal and windowed
  masks and rows that see no key (out 0, lse = the head's sink, no gradient).
* The reference against the construction gpt-oss writes (a column of sink logits appended to the scores, with a
  zero value row), and dsinks against central finite differences of the float64 loss.
* Varlen (with used prefixes), the KV cache (split-KV's combine joins the sink once; a one-row GQA decode is not
  folded), packed inputs; bad sinks refused before anything is written; fa1 and standard refuse them.
* On the simulator targeting sm_90, the Hopper (wgmma) forward and backward: every forward tile and backward form,
  the KV cache with and without split-KV, varlen.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.kernels.families import fa3, fa3_backward
from cuflash.kernels.program import Problem
from cuflash.kernels.targets import target
from cuflash.mask import Mask
from cuflash.reference import attention_reference, attention_with_kvcache_reference
from cuflash.testing import random_inputs, rows_without_key

SHAPES = {
    "gqa-tall": (2, 45, 30, 4, 2, 40),
    "mqa-wide": (1, 19, 83, 3, 1, 72),
    "mha-square": (2, 64, 64, 2, 2, 32),
}
MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(9, 4)),
    "window-causal-softcap": dict(window_size=(20, -1), causal=True, softcap=4.0),
}
DTYPES = ["float32", "float16", "bfloat16"]


def _sinks(nheads: int, seed: int, spread: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(nheads) * spread).astype(np.float32)


def _cases():
    cases = []
    for i, mask in enumerate(MASKS):
        for d, dtype in enumerate(DTYPES):
            shape = list(SHAPES)[(i + d) % len(SHAPES)]
            cases.append(pytest.param(shape, mask, dtype, id=f"{mask}-{dtype}-{shape}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _cases()]
    assert {v[0] for v in values} == set(SHAPES)
    assert {v[1] for v in values} == set(MASKS)
    assert {v[2] for v in values} == set(DTYPES)


def _check_against_the_reference(q, k, v, dout, out, lse, grads, options):
    """out, lse, dq, dk, dv and dsinks against the float64 reference by FA2's rule; rows that see no key: out 0, lse
    the head's sink, dq 0."""
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = rows_without_key(q.shape[1], k.shape[1], options.get("causal", False),
                             options.get("window_size", (-1, -1)))
    sinks = options["sinks"]
    assert np.all(out[:, empty].astype(np.float32) == 0)
    assert np.array_equal(lse[:, :, empty], np.broadcast_to(sinks[None, :, None], lse[:, :, empty].shape))
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    assert np.all(grads[0][:, empty].astype(np.float32) == 0)


@pytest.mark.parametrize("shape_name, mask_name, dtype", _cases())
def test_sinks_match_the_reference_forward_and_backward(shape_name, mask_name, dtype):
    shape = SHAPES[shape_name]
    q, k, v, dout = random_inputs(shape, dtype, seed=len(shape_name) + 7 * len(mask_name))
    options = dict(MASKS[mask_name], sinks=_sinks(shape[3], seed=len(mask_name)))
    with sim.record() as records:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    expected = "cuflash::fa2_forward_kernel" if dtype == "float32" else "cuflash::fa2_tc_forward_kernel"
    assert expected in {r.kernel.split("<")[0] for r in records.launches}
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    assert all(got.dtype == q.dtype for got in grads[:3])
    assert grads[3].dtype == np.float32 and grads[3].shape == options["sinks"].shape
    _check_against_the_reference(q, k, v, dout, out, lse, grads, options)


def test_sinks_far_from_the_scores_neither_overflow_nor_vanish():
    """A sink 80 above every score takes nearly all of the denominator (out ~ e^-80, lse ~ s); one 80 below takes
    nothing (the plain softmax): sink.cuh's log1p form keeps both finite and exact."""
    shape = (1, 33, 47, 2, 1, 64)
    for dtype in ("float16", "float32"):
        q, k, v, _ = random_inputs(shape, dtype, seed=4)
        sinks = np.array([80.0, -80.0], np.float32)
        out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=sinks)
        ref = tol.forward_references(q, k, v, sinks=sinks)
        tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
        tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
        plain, plain_lse = cuflash.attention(q, k, v, return_lse=True)
        assert np.array_equal(out[:, :, 1], plain[:, :, 1]) and np.array_equal(lse[:, 1], plain_lse[:, 1])
        assert np.all(np.abs(out[:, :, 0].astype(np.float32)) < 1e-30) and np.allclose(lse[:, 0], 80.0)


def test_no_key_at_all_gives_the_sink_and_no_gradient():
    q, k, v, dout = random_inputs((2, 5, 0, 4, 2, 16), "float16", seed=1)
    sinks = _sinks(4, seed=2)
    out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=sinks)
    assert np.all(out.astype(np.float32) == 0)
    assert np.array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))
    dq, dk, dv, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks)
    assert np.all(dq.astype(np.float32) == 0) and dk.size == 0 and np.all(dsinks == 0)


# ---------------------------------------------------------------------------
# The reference against the construction gpt-oss writes, and dsinks against finite differences.


def _sink_column_attention(q, k, v, sinks, causal):
    """Attention with the sink as an extra key: its score column is s_h and its value row 0, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    group = nheads // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(headdim)
    if causal:
        offset = k.shape[1] - seqlen_q
        allowed = np.arange(k.shape[1])[None, :] <= np.arange(seqlen_q)[:, None] + offset
        scores = np.where(allowed, scores, -np.inf)
    column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (batch, nheads, seqlen_q, 1))
    scores = np.concatenate([scores, column], axis=-1)
    lse = np.log(np.sum(np.exp(scores - scores.max(-1, keepdims=True)), -1)) + scores.max(-1)
    probabilities = np.exp(scores - lse[..., None])[..., :-1]
    return np.einsum("bhqk,bkhd->bqhd", probabilities, v), lse


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_is_a_softmax_over_a_sink_column(causal):
    q, k, v, _ = random_inputs((2, 13, 9, 4, 2, 24), "float32", seed=3)
    sinks = _sinks(4, seed=5)
    out, lse = attention_reference(q, k, v, causal=causal, sinks=sinks)
    oracle_out, oracle_lse = _sink_column_attention(q, k, v, sinks, causal)
    np.testing.assert_allclose(out, oracle_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, oracle_lse, rtol=1e-12, atol=1e-13)


def test_dsinks_match_finite_differences():
    """The kernels' dsinks (float32 inputs) against central differences of the float64 loss sum(out * dout)."""
    q, k, v, dout = random_inputs((1, 11, 14, 3, 1, 16), "float32", seed=8)
    sinks = _sinks(3, seed=9, spread=1.0)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    *_, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)

    def loss(s):
        return float(np.sum(attention_reference(q, k, v, causal=True, sinks=s)[0] * dout.astype(np.float64)))

    step = 1e-5
    differences = [(loss(sinks + step * e) - loss(sinks - step * e)) / (2 * step) for e in np.eye(3)]
    np.testing.assert_allclose(dsinks, differences, rtol=1e-4, atol=1e-6)
    assert np.abs(dsinks).min() > 1e-3  # a gradient that is there to check


# ---------------------------------------------------------------------------
# Varlen, KV cache, packed inputs.


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_varlen_with_sinks_and_used_prefixes(dtype):
    rng = np.random.default_rng(12)
    lengths_q, lengths_k = np.array([7, 0, 23, 12]), np.array([15, 6, 23, 4])
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    nheads, nheads_k, d = 4, 2, 40
    np_dtype = cuflash.testing.numpy_dtype(dtype)
    q = rng.standard_normal((cu_q[-1], nheads, d)).astype(np_dtype)
    k = rng.standard_normal((cu_k[-1], nheads_k, d)).astype(np_dtype)
    v = rng.standard_normal((cu_k[-1], nheads_k, d)).astype(np_dtype)
    dout = rng.standard_normal(q.shape).astype(np_dtype)
    sinks = _sinks(nheads, seed=13)
    seqused_k = np.array([11, 6, 20, 0], np.int32)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, sinks=sinks,
                                        seqused_k=seqused_k)
    # The used prefixes as sequences of their own: the reference's cu_seqlens_k and keys.
    keep = np.concatenate([np.arange(cu_k[b], cu_k[b] + seqused_k[b]) for b in range(4)])
    cu_used = np.concatenate([[0], np.cumsum(seqused_k)]).astype(np.int32)
    ref = tol.forward_references(q, k[keep], v[keep], cu_seqlens=(cu_q, cu_used), causal=True, sinks=sinks)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    assert np.array_equal(lse[:, cu_q[3]:cu_q[4]], np.broadcast_to(sinks[:, None], (nheads, 12)))  # no key

    dq, dk, dv, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True,
                                                           sinks=sinks, seqused_k=seqused_k)
    bref = tol.backward_references(dout, q, k[keep], v[keep], cu_seqlens=(cu_q, cu_used), causal=True, sinks=sinks)
    tol.check_close("dq", dq, bref.dq, bref.dq_lowp, tol.BACKWARD_FACTOR, atol=1e-5)
    tol.check_close("dk", dk[keep], bref.dk, bref.dk_lowp, tol.BACKWARD_FACTOR, atol=1e-5)
    tol.check_close("dsinks", dsinks, bref.dsinks, bref.dsinks_lowp, tol.BACKWARD_FACTOR, atol=1e-5)
    assert np.all(np.delete(dk, keep, axis=0).astype(np.float32) == 0)


def test_varlen_rows_past_a_used_query_prefix_give_no_sink_gradient():
    """Unused query rows are not computed (out 0, lse -inf): whatever lse and dout hold there, dsinks ignores them."""
    q, k, v, dout = (x[0] for x in random_inputs((1, 20, 20, 2, 2, 16), "float32", seed=3))
    cu = np.array([0, 9, 20], np.int32)
    seqused_q = np.array([5, 11], np.int32)
    sinks = _sinks(2, seed=1)
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, return_lse=True, sinks=sinks, seqused_q=seqused_q)
    *_, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, sinks=sinks, seqused_q=seqused_q)
    lse_junk = lse.copy()
    lse_junk[:, 5:9] = 3.0  # unused rows of sequence 0
    *_, again = cuflash.attention_varlen_backward(dout, q, k, v, out, lse_junk, cu, cu, sinks=sinks,
                                                  seqused_q=seqused_q)
    assert np.all(np.isfinite(dsinks)) and np.array_equal(dsinks, again)


@pytest.mark.parametrize("num_splits, paged", [(1, False), (3, False), (0, True)])
def test_kvcache_with_sinks(num_splits, paged):
    """Decode steps over GQA heads: without a split, with split-KV (the combine joins the sink once) and paged."""
    rng = np.random.default_rng(14)
    batch, nheads, nheads_k, d, capacity = 3, 8, 2, 64, 192
    q = rng.standard_normal((batch, 1, nheads, d)).astype(np.float16)
    k_cache = rng.standard_normal((batch, capacity, nheads_k, d)).astype(np.float16)
    v_cache = rng.standard_normal((batch, capacity, nheads_k, d)).astype(np.float16)
    lengths = np.array([150, 0, 77], np.int32)
    sinks = _sinks(nheads, seed=15)
    options = dict(cache_seqlens=lengths, sinks=sinks, num_splits=num_splits, return_lse=True)
    if paged:
        table = np.arange(batch * capacity // 16, dtype=np.int32).reshape(batch, -1)
        pages = k_cache.reshape(batch * capacity // 16, 16, nheads_k, d), v_cache.reshape(-1, 16, nheads_k, d)
        out, lse = cuflash.attention_with_kvcache(q, *pages, block_table=table, **options)
    else:
        with sim.record() as records:
            out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, **options)
        combines = [r for r in records.launches if "combine" in r.kernel]
        assert len(combines) == (num_splits > 1)
    ref_out, ref_lse = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, sinks=sinks)
    low_out, low_lse = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, sinks=sinks, dtype=np.float16)
    tol.check_close("out", out, ref_out, low_out, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref_lse, low_lse, tol.FORWARD_FACTOR)
    assert np.array_equal(lse[1, :, 0], sinks)  # an empty cache: the sink alone


def test_packed_inputs_take_sinks():
    qkv = np.random.default_rng(16).standard_normal((2, 17, 3, 4, 32)).astype(np.float16)
    sinks = _sinks(4, seed=17)
    out, lse = cuflash.attention_qkvpacked(qkv, causal=True, sinks=sinks, return_lse=True)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    expected_out, expected_lse = cuflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.array_equal(out, expected_out) and np.array_equal(lse, expected_lse)
    dout = np.ones_like(out)
    dqkv, dsinks = cuflash.attention_qkvpacked_backward(dout, qkv, out, lse, causal=True, sinks=sinks)
    dq, dk, dv, expected_dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
    assert np.array_equal(dqkv, np.stack([dq, dk, dv], axis=2)) and np.array_equal(dsinks, expected_dsinks)
    kv = qkv[:, :, 1:]
    dq2, dkv, dsinks2 = cuflash.attention_kvpacked_backward(dout, q, kv, out, lse, causal=True, sinks=sinks)
    assert np.array_equal(dkv, np.stack([dk, dv], axis=2)) and np.array_equal(dsinks2, expected_dsinks)


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("sinks, error, message", [
    (np.zeros(3, np.float32), ValueError, r"sinks must have shape \(nheads,\) = \(4,\)"),
    (np.zeros((1, 4), np.float32), ValueError, r"sinks must have shape \(nheads,\)"),
    (np.zeros(4, np.float16), TypeError, "sinks must have dtype float32, got float16"),
    ([0.0, 0.0, 0.0, 0.0], TypeError, "sinks"),
])
def test_bad_sinks_are_refused_before_anything_is_written(sinks, error, message):
    q, k, v, dout = random_inputs((1, 4, 6, 4, 2, 16), "float16", seed=0)
    with pytest.raises(error, match=message):
        cuflash.attention(q, k, v, sinks=sinks)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(error, match=message):
        cuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks)
    k_cache, v_cache = (np.zeros((1, 32, 2, 16), np.float16) for _ in range(2))
    with pytest.raises(error, match=message):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=0, sinks=sinks)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("algorithm", ["fa1", "standard"])
def test_fa1_and_standard_refuse_sinks_naming_fa2(algorithm):
    q, k, v, _ = random_inputs((1, 8, 8, 2, 2, 16), "float32", seed=0)
    with pytest.raises(ValueError, match=f"sinks is supported by algorithm='fa2' only, got algorithm='{algorithm}'"):
        cuflash.attention(q, k, v, algorithm=algorithm, sinks=np.zeros(2, np.float32))


# ---------------------------------------------------------------------------
# On Hopper (the simulator targeting sm_90): the wgmma forward joins the sinks in its epilogue (split 0's partials with
# split-KV) and the wgmma backward takes them as they are. Every forward tile (d64 192 x 128, d128 128 x 176 and
# 128 x 128, d256 128 x 80, hooked d64) and every backward form (keys-sharing d64, d128; head-dim-sharing d256; hooked),
# ragged blocks, GQA/MQA, rows that see no key (causal with seqlen_q > seqlen_k, windows), TMA and load paths (d100).
HOPPER_CASES = {
    "d64-causal": ((1, 77, 200, 4, 2, 64), "float16", dict(causal=True)),
    "d128-full-mqa": ((2, 130, 77, 3, 1, 128), "bfloat16", dict()),
    "d100-causal-rows-without-key": ((1, 200, 129, 2, 2, 100), "float16", dict(causal=True)),
    "d256-window": ((1, 64, 150, 4, 2, 256), "bfloat16", dict(window_size=(30, 5))),
    "d64-causal-softcap": ((1, 90, 90, 2, 1, 64), "float16", dict(causal=True, softcap=3.0)),
}


@pytest.mark.parametrize("case", list(HOPPER_CASES))
def test_hopper_kernels_take_sinks(case):
    shape, dtype, mask = HOPPER_CASES[case]
    q, k, v, dout = random_inputs(shape, dtype, seed=len(case))
    options = dict(mask, sinks=_sinks(shape[3], seed=len(case), spread=3.0))
    race = sim.checking("race") if case == "d64-causal" else contextlib.nullcontext()  # the sink's epilogue, raced
    with sim.targeting("sm_90"), sim.record() as records, race:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    kernels = [r.kernel.split("<")[0] for r in records.launches]
    assert kernels[0] == "cuflash::fa3_forward_kernel" and "cuflash::fa3_backward_kernel" in kernels, kernels
    _check_against_the_reference(q, k, v, dout, out, lse, grads, options)


def test_hopper_grid_keeps_every_tile_and_form():
    sm90 = target("sm_90")
    forward, backward = set(), set()
    for shape, dtype, mask in HOPPER_CASES.values():
        problem = Problem(dtype=dtype, batch=shape[0], seqlen_q=shape[1], seqlen_k=shape[2], nheads=shape[3],
                          nheads_k=shape[4], headdim=shape[5], mask=Mask.of(mask.get("causal", False),
                                                                           mask.get("window_size", (-1, -1))),
                          softcap=mask.get("softcap", 0.0), sinks=True)
        forward.add(fa3.forward_traits(problem, sm90))
        backward.add(fa3_backward.backward_program(problem, sm90).launches[1].kernel.name_expr.split(",", 1)[1])
    assert len(forward) == 5 and len(backward) == 4, (forward, backward)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_hopper_kvcache_and_split_kv_join_the_sink_once(num_splits):
    """Decode and prefill over a KV cache through the Hopper forward: split-KV's split 0 joins the sink, the combine
    takes it once; an empty cache gives the sink alone."""
    rng = np.random.default_rng(18)
    batch, nheads, nheads_k, d, capacity = 3, 8, 2, 128, 300
    q = rng.standard_normal((batch, 5, nheads, d)).astype(np.float16)
    k_cache = rng.standard_normal((batch, capacity, nheads_k, d)).astype(np.float16)
    v_cache = rng.standard_normal((batch, capacity, nheads_k, d)).astype(np.float16)
    lengths = np.array([260, 0, 77], np.int32)
    sinks = _sinks(nheads, seed=19)
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, sinks=sinks,
                                                  num_splits=num_splits, return_lse=True)
    kernels = [r.kernel.split("<")[0] for r in records.launches]
    assert kernels[0] == "cuflash::fa3_forward_kernel", kernels
    assert ("cuflash::fa2_split_kv_combine_kernel" in kernels) == (num_splits > 1), kernels
    ref_out, ref_lse = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, sinks=sinks)
    low_out, low_lse = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, sinks=sinks, dtype=np.float16)
    tol.check_close("out", out, ref_out, low_out, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref_lse, low_lse, tol.FORWARD_FACTOR)
    assert np.array_equal(lse[1], np.broadcast_to(sinks[:, None], (nheads, 5)))  # an empty cache: the sink alone


def test_hopper_varlen_with_sinks():
    rng = np.random.default_rng(20)
    lengths_q, lengths_k = np.array([70, 0, 150, 9]), np.array([130, 5, 150, 0])
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    nheads, nheads_k, d = 4, 2, 64
    q = rng.standard_normal((cu_q[-1], nheads, d)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], nheads_k, d)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float16)
    sinks = _sinks(nheads, seed=21)
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, sinks=sinks)
        dq, dk, dv, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True,
                                                               sinks=sinks)
    kernels = {r.kernel.split("<")[0] for r in records.launches}
    assert {"cuflash::fa3_forward_kernel", "cuflash::fa3_backward_kernel"} <= kernels, kernels
    ref = tol.forward_references(q, k, v, cu_seqlens=(cu_q, cu_k), causal=True, sinks=sinks)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    assert np.array_equal(lse[:, cu_q[3]:cu_q[4]], np.broadcast_to(sinks[:, None], (nheads, 9)))  # no key
    bref = tol.backward_references(dout, q, k, v, cu_seqlens=(cu_q, cu_k), causal=True, sinks=sinks)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
