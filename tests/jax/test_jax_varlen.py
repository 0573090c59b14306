"""cuflash.jax.attention_varlen: packed variable-length batches under jit, grad and vmap, on the CPU simulator.

* jit with traced cu_seqlens and static max_seqlen, and grad through out: bit for bit what cuflash.attention_varlen
  and attention_varlen_backward give on NumPy arrays (the same kernels, the same launches), in both fa2 variants;
* a grad through lse as well equals JAX autodiff of a plain jnp attention of each sequence;
* vmap runs one call per mapped element;
* concrete cu_seqlens are checked as cuflash.attention_varlen checks them; traced ones need max_seqlen.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402

LENGTHS_Q, LENGTHS_K = [7, 0, 30, 12], [10, 4, 22, 1]


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(dtype, seed=0, nheads=4, nheads_k=2, headdim=24):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(LENGTHS_Q), nheads, headdim)).astype(dtype)
    k = rng.standard_normal((sum(LENGTHS_K), nheads_k, headdim)).astype(dtype)
    v = rng.standard_normal((sum(LENGTHS_K), nheads_k, headdim)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_jit_and_grad_with_traced_cu_seqlens_equal_the_numpy_calls(dtype):
    q, k, v, dout = _inputs(dtype)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    options = dict(causal=True, softcap=3.0)

    @jax.jit
    def forward_and_grads(q, k, v, cu_q, cu_k):
        def loss(q, k, v):
            out = cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=30, max_seqlen_k=22, **options)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    out, grads = forward_and_grads(q, k, v, cu_q, cu_k)
    want_out, want_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    want_grads = cuflash.attention_varlen_backward(dout, q, k, v, want_out, want_lse, cu_q, cu_k, **options)
    assert np.array_equal(np.asarray(out), want_out)
    for got, want in zip(grads, want_grads):
        assert np.array_equal(np.asarray(got), want)


def _plain_sequence(q, k, v, scale):
    """One sequence, no mask, GQA by repetition: (out, lse) in jnp."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) * scale
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v), lse


def test_grad_through_out_and_lse_equals_autodiff_per_sequence():
    lengths = [5, 9, 3]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((17, 2, 16)).astype(np.float32)
    k = rng.standard_normal((17, 1, 16)).astype(np.float32)
    v = rng.standard_normal((17, 1, 16)).astype(np.float32)
    cu = _cu(lengths)
    weights = rng.standard_normal((2, 17)).astype(np.float32)

    def loss_cuflash(q, k, v):
        out, lse = cfj.attention_varlen(q, k, v, cu, cu, return_lse=True)
        return jnp.sum(out**2) + jnp.sum(lse * weights)

    def loss_plain(q, k, v):
        total = 0.0
        for b in range(len(lengths)):
            rows = slice(cu[b], cu[b + 1])
            out, lse = _plain_sequence(q[rows], k[rows], v[rows], 16**-0.5)
            total = total + jnp.sum(out**2) + jnp.sum(lse * weights[:, rows])
        return total

    got = jax.jit(jax.grad(loss_cuflash, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss_plain, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_vmap_runs_one_call_per_element():
    q, k, v, _ = _inputs(np.float32, seed=1)
    q2, k2, v2, _ = _inputs(np.float32, seed=2)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    batched = jax.vmap(lambda q, k, v: cfj.attention_varlen(q, k, v, cu_q, cu_k))(
        np.stack([q, q2]), np.stack([k, k2]), np.stack([v, v2]))
    for i, (a, b, c) in enumerate(((q, k, v), (q2, k2, v2))):
        assert np.array_equal(np.asarray(batched[i]), cuflash.attention_varlen(a, b, c, cu_q, cu_k))


def test_cu_seqlens_are_checked_when_concrete_and_max_seqlen_needed_when_traced():
    q, k, v, _ = _inputs(np.float32)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    with pytest.raises(ValueError, match="cu_seqlens_k must be nondecreasing"):
        cfj.attention_varlen(q, k, v, cu_q, np.array([0, 10, 9, 36, 37], np.int32))
    with pytest.raises(ValueError, match=r"max_seqlen_q must be at least the longest sequence of cu_seqlens_q \(30\)"):
        cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=29)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(a Python int\) is required when the cu_seqlens are traced"):
        jax.jit(lambda cu_q: cfj.attention_varlen(q, k, v, cu_q, cu_k))(cu_q)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 array"):
        jax.jit(lambda cu_q: cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=30, max_seqlen_k=22))(
            cu_q.astype(np.float32))


USED_Q, USED_K = [5, 0, 30, 3], [10, 2, 9, 0]


@pytest.mark.parametrize("dtype", [np.float32, jnp.float16])
def test_seqused_traced_under_jit_with_grads_equals_the_numpy_calls(dtype):
    """seqused_q and seqused_k traced (values taken on trust): out, lse and the gradients through both, bit for bit
    the NumPy functions' (whose unused rows are out 0, lse -inf and zero gradients)."""
    q, k, v, dout = _inputs(dtype, seed=4)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    used_q, used_k = np.array(USED_Q, np.int32), np.array(USED_K, np.int32)
    weights = np.random.default_rng(5).standard_normal((4, q.shape[0])).astype(np.float32)
    options = dict(causal=True, window_size=(6, -1))

    @jax.jit
    def forward_and_grads(q, k, v, used_q, used_k):
        def loss(q, k, v):
            out, lse = cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=30, max_seqlen_k=22, seqused_q=used_q,
                                            seqused_k=used_k, return_lse=True, **options)
            finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
            loss = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(finite_lse * weights)
            return loss, (out, lse)
        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, lse, grads

    out, lse, grads = forward_and_grads(q, k, v, used_q, used_k)
    counts = dict(seqused_q=used_q, seqused_k=used_k)
    want_out, want_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **counts, **options)
    assert np.array_equal(np.asarray(out), want_out) and np.array_equal(np.asarray(lse), want_lse)
    unused_q = cuflash._validation.unused_rows(cu_q, used_q, q.shape[0])
    unused_k = cuflash._validation.unused_rows(cu_k, used_k, k.shape[0])
    assert unused_q.sum() == sum(LENGTHS_Q) - sum(USED_Q) and unused_k.sum() == sum(LENGTHS_K) - sum(USED_K)
    assert np.all(want_lse[:, unused_q] == -np.inf) and np.all(want_out[unused_q].astype(np.float32) == 0)
    # The lse's cotangent joins the backward as dlse (attention_params.cuh); the NumPy backward has no such input,
    # so compare with it where the lse's weights vanish: dq, dk, dv through out alone.
    @jax.jit
    def grads_through_out(q, k, v, used_q, used_k):
        def loss(q, k, v):
            out = cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=30, max_seqlen_k=22, seqused_q=used_q,
                                       seqused_k=used_k, **options)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    want_grads = cuflash.attention_varlen_backward(dout, q, k, v, want_out, want_lse, cu_q, cu_k, **counts, **options)
    for got, want in zip(grads_through_out(q, k, v, used_q, used_k), want_grads):
        assert np.array_equal(np.asarray(got), want)
    # With the lse's cotangent too: unused rows still get zero gradients, used rows finite ones.
    for got, unused in zip(grads, (unused_q, unused_k, unused_k)):
        got = np.asarray(got).astype(np.float32)
        assert np.all(got[unused] == 0) and np.all(np.isfinite(got[~unused]))


def test_seqused_is_checked_when_concrete():
    q, k, v, _ = _inputs(np.float32)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    with pytest.raises(ValueError, match=r"seqused_k\[3\] must be in 0..1 \(sequence 3's length in cu_seqlens_k\)"):
        cfj.attention_varlen(q, k, v, cu_q, cu_k, seqused_k=np.array([1, 1, 1, 2], np.int32))
    with pytest.raises(TypeError, match="seqused_q must have dtype int32"):
        jax.jit(lambda used: cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=30, max_seqlen_k=22,
                                                  seqused_q=used))(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"seqused_q must have shape \(batch,\) = \(4,\)"):
        jax.jit(lambda used: cfj.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=30, max_seqlen_k=22,
                                                  seqused_q=used))(np.zeros(3, np.int32))
