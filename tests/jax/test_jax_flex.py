"""cuflash.jax.flex_attention (the flex programs as the JAX custom call) and the jax.nn drop-in's bias and mask.

The NumPy API's flex_attention is judged against the float64 reference (tests/flex); the JAX call runs the very same
kernels through the FFI handler, so its results are compared bitwise with the NumPy API's where the inputs are the
same, and against the reference (cuflash._tolerance's rule) once. The simulator compiles a library per mod structure
and kernel: the tests share a few mods and one float32 shape (SIMT kernels) to stay fast.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import _tolerance as tol  # noqa: E402
from cuflash.testing import random_inputs  # noqa: E402

BATCH, SEQLEN_Q, SEQLEN_K, HEADS, HEADS_K, HEADDIM = 2, 21, 27, 2, 1, 16
SPAN = SEQLEN_Q + SEQLEN_K


def _inputs(seed=1):
    return random_inputs((BATCH, SEQLEN_Q, SEQLEN_K, HEADS, HEADS_K, HEADDIM), "float32", seed=seed)


_rng = np.random.default_rng(7)
DOC_Q = np.sort(_rng.integers(0, 4, (BATCH, SEQLEN_Q))).astype(np.int32)
DOC_K = np.sort(_rng.integers(0, 3, (BATCH, SEQLEN_K))).astype(np.int32)  # document 3: queries only, no key
DOC_Q_J, DOC_K_J = jnp.asarray(DOC_Q), jnp.asarray(DOC_K)
TABLE = _rng.standard_normal((HEADS, SPAN)).astype(np.float32)


def same_document(b, h, q_idx, kv_idx):
    return DOC_Q_J[b, q_idx] == DOC_K_J[b, kv_idx]


def relative_bias_of(table):
    table = jnp.asarray(table)  # a NumPy table indexed by the traced indices would not trace

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + SEQLEN_K]

    return relative_bias


def test_jit_and_grad_to_q_k_v_and_a_captured_bias_table_with_a_document_block_mask():
    """Under jax.jit, a relative-position table passed as an argument (so the score_mod captures a tracer) and a
    document block mask: out and lse meet the rule against the reference, rows that see no key give 0 and lse -inf,
    and jax.grad to q, k, v and the table is the NumPy API's backward (up to the order of float32 atomics) (return_aux_grads) on the same
    inputs. The dense mask_mod (no block mask) gives bitwise the same."""
    q, k, v, dout = _inputs()
    block_mask = cfj.create_block_mask(same_document, BATCH, None, SEQLEN_Q, SEQLEN_K, block_size=8)
    assert cfj.create_block_mask is cuflash.flex.create_block_mask

    @jax.jit
    def forward(q, k, v, table):
        return cfj.flex_attention(q, k, v, score_mod=relative_bias_of(table), block_mask=block_mask, return_lse=True)

    out, lse = forward(q, k, v, TABLE)
    mods = dict(score_mod=relative_bias_of(jnp.asarray(TABLE)), mask_mod=same_document)
    ref = tol.forward_references(q, k, v, **mods)
    tol.check_close("out", np.asarray(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", np.asarray(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = ~(DOC_Q[:, :, None] == DOC_K[:, None, :]).any(-1)
    assert empty.any() and np.all(np.asarray(out)[empty] == 0)
    assert np.all(np.asarray(lse).transpose(0, 2, 1)[empty] == -np.inf)

    dense = cfj.flex_attention(q, k, v, return_lse=True, **mods)
    np.testing.assert_array_equal(dense[0], out)
    np.testing.assert_array_equal(dense[1], lse)

    def loss(q, k, v, table):
        return jnp.sum(forward(q, k, v, table)[0] * dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, TABLE)
    *want, (dtable,) = cuflash.flex_attention_backward(dout, q, k, v, np.asarray(out), np.asarray(lse),
                                                       return_aux_grads=True, **mods)
    for name, got, expected in zip(("dq", "dk", "dv", "dtable"), grads, (*want, dtable)):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        # the same kernels; dq and the table's gradient are summed with float32 atomics, in no fixed order
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(dtable).max() > 0


def test_vmap_over_an_extra_leading_axis_equals_a_loop():
    """vmap over a leading axis of q, k and v and of the captured table: each element's call, bitwise."""
    q, k, v, _ = _inputs(seed=2)
    tables = np.stack([TABLE, TABLE[::-1] * 0.5])
    qs, ks, vs = (np.stack([x, x[::-1]]) for x in (q, k, v))

    def one(q, k, v, table):
        return cfj.flex_attention(q, k, v, score_mod=relative_bias_of(table), mask_mod=same_document)

    batched = jax.jit(jax.vmap(one))(qs, ks, vs, tables)
    for m in range(2):
        np.testing.assert_array_equal(np.asarray(batched[m]), np.asarray(one(qs[m], ks[m], vs[m], tables[m])))


def test_bad_inputs_raise_before_any_kernel():
    q, k, v, _ = _inputs()
    block_mask = cfj.create_block_mask(same_document, BATCH, None, SEQLEN_Q, SEQLEN_K, block_size=8)
    with pytest.raises(TypeError, match="block_mask is traced"):
        jax.jit(lambda q, k, v, m: cfj.flex_attention(q, k, v, block_mask=m))(q, k, v, block_mask)
    wrong = cfj.create_block_mask(same_document, BATCH, None, SEQLEN_Q, SEQLEN_Q, block_size=8)
    with pytest.raises(ValueError, match="block_mask has shape"):
        cfj.flex_attention(q, k, v, block_mask=wrong)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        cfj.flex_attention(q, k, v, score_mod=3)


# ---------------------------------------------------------------------------
# The drop-in: jax.nn.dot_product_attention's bias and mask on flex_attention.


def _drop_in_case(seed):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (jnp.asarray(x) for x in _inputs(seed))
    bias = jnp.asarray(rng.standard_normal((1, HEADS, SEQLEN_Q, SEQLEN_K)).astype(np.float32))
    mask = rng.random((BATCH, 1, SEQLEN_Q, SEQLEN_K)) < 0.6
    mask[1, 0, 4] = False  # a row that sees no key: jax.nn gives the mean of the values there
    return q, k, v, dout, bias, jnp.asarray(mask)


def _with_and_without(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warning must not be raised
        mine = fn(cfj.dot_product_attention, *args)
    theirs = fn(jax.nn.dot_product_attention, *args)
    return mine, theirs


def _close(name, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()), err_msg=name)


@pytest.mark.parametrize("traced_mask", [False, True], ids=["host_mask_block_sparse", "traced_mask_dense"])
def test_dot_product_attention_bias_and_mask_match_jax_nn_with_gradients(traced_mask):
    """bias (broadcast over batch) and a boolean mask (broadcast over heads), causal off, GQA: out and dq, dk, dv,
    dbias match jax.nn's within float32 rounding, the row no key sees included (the mean of the values), and no
    fallback warning. The mask is concrete (block mask on the host) or a jit argument (dense mask_mod)."""
    q, k, v, dout, bias, mask = _drop_in_case(seed=3)

    def run(attention, q, k, v, bias, mask):
        def loss(q, k, v, bias, mask):
            return jnp.sum(attention(q, k, v, bias, mask) * dout)

        if traced_mask:
            out = jax.jit(attention)(q, k, v, bias, mask)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias, mask)
        else:
            out = jax.jit(lambda q, k, v, bias: attention(q, k, v, bias, mask))(q, k, v, bias)
            grads = jax.jit(jax.grad(lambda q, k, v, bias: loss(q, k, v, bias, mask), argnums=(0, 1, 2, 3)))(
                q, k, v, bias)
        return out, *grads

    mine, theirs = _with_and_without(run, q, k, v, bias, mask)
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbias"), mine, theirs):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        _close(name, got, want)
    empty_row = np.asarray(mine[0])[1, 4]
    np.testing.assert_allclose(empty_row, np.repeat(np.asarray(v)[1].mean(0), HEADS // HEADS_K, axis=0), rtol=1e-5)


def test_dot_product_attention_causal_bias_without_a_mask_matches_jax_nn():
    """A per-key bias (B, 1, 1, S) with is_causal (top-left, as jax.nn): out and dbias match jax.nn's."""
    q, k, v, dout, _, _ = _drop_in_case(seed=4)
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((BATCH, 1, 1, SEQLEN_K)).astype(np.float32))

    def run(attention, q, k, v, bias):
        out = attention(q, k, v, bias, is_causal=True)
        dbias = jax.grad(lambda b: jnp.sum(attention(q, k, v, b, is_causal=True) * dout))(bias)
        return out, dbias

    for name, got, want in zip(("out", "dbias"), *_with_and_without(run, q, k, v, bias)):
        _close(name, got, want)


def _dense_flex(q, k, v, table):
    """The relative bias and document mask in plain jax.numpy (float32, dense): an independent autodiff path."""
    group = HEADS // HEADS_K
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(HEADDIM)
    offsets = np.arange(SEQLEN_Q)[:, None] - np.arange(SEQLEN_K)[None, :] + SEQLEN_K
    scores = scores + table[:, offsets][None]
    visible = (DOC_Q[:, :, None] == DOC_K[:, None, :])[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    probs = jnp.where(visible, jnp.exp(scores - lse_safe[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest"), lse


def test_a_loss_through_out_and_lse_matches_dense_jax_numpy_autodiff():
    """The lse's cotangent joins the backward (D): gradients of sum(out * dout) + sum(finite lse * w) to q, k, v and
    the table match jax.numpy's autodiff of the dense computation (float32, within float32 rounding)."""
    q, k, v, dout = (jnp.asarray(x) for x in _inputs(seed=6))
    weights = jnp.asarray(np.random.default_rng(6).standard_normal((BATCH, HEADS, SEQLEN_Q)).astype(np.float32))

    def loss_of(attention):
        def loss(q, k, v, table):
            out, lse = attention(q, k, v, table)
            return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights)

        return loss

    def flex(q, k, v, table):
        return cfj.flex_attention(q, k, v, score_mod=relative_bias_of(table), mask_mod=same_document,
                                  return_lse=True)

    got = jax.jit(jax.grad(loss_of(flex), argnums=(0, 1, 2, 3)))(q, k, v, TABLE)
    want = jax.grad(loss_of(_dense_flex), argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(TABLE))
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), got, want):
        _close(name, a, b)


def test_a_call_without_a_block_mask_builds_one_when_the_mask_mod_captures_only_concrete_arrays():
    """block_mask_for_call (both APIs): built once per (structure, captured values, shapes) and kept; another
    document layout builds another; a mask_mod capturing a traced array (inside jit) runs dense (None)."""
    from cuflash import _validation as V
    from cuflash.flex import trace_mask_mod
    from cuflash.flex._api import CALL_BLOCK_SIZE, block_mask_for_call

    q, k, v, _ = _inputs()
    problem = V.check_qkv(q, k, v, causal=False)
    first = block_mask_for_call(same_document, trace_mask_mod(same_document), problem)
    assert first is block_mask_for_call(same_document, trace_mask_mod(same_document), problem)
    want = cfj.create_block_mask(same_document, BATCH, HEADS, SEQLEN_Q, SEQLEN_K, block_size=CALL_BLOCK_SIZE)
    np.testing.assert_array_equal(first.to_dense(), want.to_dense())

    def shifted(b, h, q_idx, kv_idx):
        return DOC_Q_J[b, q_idx] == DOC_K_J[b, kv_idx] + 1

    assert block_mask_for_call(shifted, trace_mask_mod(shifted), problem) is not first
    found = []

    @jax.jit
    def traced(doc_q):
        def mod(b, h, q_idx, kv_idx):
            return doc_q[b, q_idx] == DOC_K_J[b, kv_idx]

        found.append(block_mask_for_call(mod, trace_mask_mod(mod), problem))
        return doc_q

    traced(DOC_Q_J)
    assert found == [None]


def test_sharded_jit_along_batch_and_heads_runs_per_shard():
    """Plain jit over q, k, v sharded along batch, heads (whole GQA groups) or both on a 2 x 2 mesh of host devices (a
    fresh process: flex_sharded_worker; GQA, and MHA along both; Explicit and Auto meshes), with mods that read b and
    h and two block masks (lists per batch and head; heads broadcast): one forward and one backward custom call per
    device on its shard, no all-gather, the results sharded like the inputs; out, lse, dq, dk, dv bitwise the
    unsharded call's, the captured table's gradient (each shard's partial sums, all-reduced: the only collective)
    within float32 rounding of it, and all meet the rule against the float64 reference; under vmap too (forward,
    bitwise, no collective). With each shard's origin forced to 0 (the planted bug: mods would see local b and h),
    the results differ. The jax.nn drop-in with a bias sharded like the scores (a side array: gathered) and a NumPy
    mask gives the unsharded call's results."""
    from test_jax_subprocesses import run_worker

    results = run_worker("flex_sharded_worker.py")
    splits = {"batch": ("P('data',)", "P('data',)"), "heads": ("P(None, None, 'model')", "P(None, 'model')"),
              "batch+heads": ("P('data', None, 'model')", "P('data', 'model')")}
    sharded = [f"{mode}:per batch and head:{s}" for mode in ("Explicit", "Auto") for s in splits]
    sharded += [f"Explicit:heads broadcast:{s}" for s in splits] + ["mha:batch+heads"]
    unsharded = ["per batch and head:unsharded", "heads broadcast:unsharded"]
    drop_in = ["Explicit:drop-in", "Auto:drop-in"]
    assert set(results) == set(sharded + unsharded + drop_in) | {"forward only", "no origin", "vmap"}
    forward = results.pop("forward only")
    assert forward == {"collectives": [], "custom_calls": 1, "out": 0.0, "sharding": "P('data', None, 'model')"}
    # vmap inside: a call per mapped element, each split per device
    assert results.pop("vmap") == {"bitwise": True, "collectives": [], "custom_calls": 2,
                                   "sharding": "P(None, 'data', None, 'model')"}
    planted = results.pop("no origin")["differences"]
    assert min(planted) > 1e-2, planted  # every result: mods reading local b and h compute another attention
    for name in drop_in:  # out, dq, dk, dv, dbias; the bias (B, H, LQ, LK) gathered along each of its two axes
        case = results.pop(name)
        assert case["differences"] == [0.0] * 5 and case["custom_calls"] == 2, (name, case)
        assert case["gathered"] == ["f32[2,4,13,19]", "f32[4,4,13,19]"], (name, case)
    for name, case in results.items():
        for check, measured in case["checks"].items():
            assert measured["ok"], f"{name} {check}: {measured.get('message')}"
        assert case["custom_calls"] == 2 and case["same_special"] == [True] * 6, (name, case)
        assert case["differences"][:5] == [0.0] * 5 and case["differences"][5] < 1e-5, (name, case["differences"])
        if name in unsharded:
            continue
        # The table's gradient, (H, LQ + LK) float32 partial sums: the only collective. No operand is gathered.
        assert case["collectives"] == ["all-reduce"] and case["reduced"] == ["f32[4,32]"], (name, case)
        assert case["gathered"] == [], (name, case)
        tensor, rows = splits[name.split(":")[-1]]
        assert case["shardings"] == [tensor, rows, tensor, tensor, tensor, "P()"], (name, case["shardings"])
