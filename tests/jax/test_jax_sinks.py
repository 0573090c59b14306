"""Attention sinks on JAX arrays: cuflash.jax.attention, attention_varlen and attention_with_kvcache with ``sinks=``.

* jit and grad: out, lse and dq, dk, dv bit for bit the NumPy calls' (the same kernels); dsinks, which JAX forms
  from rowsum(dout * out) in jnp (cuflash/sinks.py), equal to the NumPy backward's up to float32 summation order;
* a loss through both out and lse against JAX autodiff of plain jnp attention over a sink column (gpt-oss's
  construction), and dsinks against finite differences of the float64 reference;
* vmap with the sinks mapped or shared, folded into heads, into the batch or called per element: each element
  bit for bit its own NumPy call;
* varlen and the KV cache bit for bit their NumPy twins.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash.reference import attention_reference  # noqa: E402
from cuflash.testing import random_inputs  # noqa: E402


def _sinks(nheads, seed, spread=2.0):
    return (np.random.default_rng(seed).standard_normal(nheads) * spread).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jit_and_grad_equal_the_numpy_calls(dtype):
    q, k, v, dout = random_inputs((2, 23, 31, 4, 2, 40), dtype, seed=1)
    sinks = _sinks(4, seed=2)
    options = dict(causal=True, window_size=(12, -1))

    @jax.jit
    def forward_and_grads(q, k, v, sinks):
        def loss(q, k, v, sinks):
            out, lse = cfj.attention(q, k, v, sinks=sinks, return_lse=True, **options)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), (out, lse)
        (_, results), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
        return results, grads

    (out, lse), grads = forward_and_grads(q, k, v, sinks)
    want_out, want_lse = cuflash.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, sinks=sinks, **options)
    assert np.array_equal(np.asarray(out), want_out) and np.array_equal(np.asarray(lse), want_lse)
    for got, expected in zip(grads[:3], want[:3]):
        assert np.array_equal(np.asarray(got), expected)
    np.testing.assert_allclose(np.asarray(grads[3]), want[3], rtol=2e-5, atol=1e-6)


def _sink_column_attention(q, k, v, sinks, scale):
    """Plain jnp attention with the sink as an extra key (score column s_h, value row 0); GQA by repetition."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    column = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:3] + (1,))
    scores = jnp.concatenate([scores, column], axis=-1)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probabilities = jnp.exp(scores - lse[..., None])[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", probabilities, v), lse


def test_a_loss_through_out_and_lse_matches_autodiff_of_plain_jnp():
    q, k, v, dout = random_inputs((1, 17, 26, 4, 1, 24), "float32", seed=3)
    dlse = np.random.default_rng(4).standard_normal((1, 4, 17)).astype(np.float32)
    sinks = _sinks(4, seed=5)
    scale = 24 ** -0.5

    def loss(attention):
        def f(q, k, v, sinks):
            out, lse = attention(q, k, v, sinks)
            return jnp.sum(out * dout) + jnp.sum(lse * dlse)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))

    got = loss(lambda q, k, v, s: cfj.attention(q, k, v, sinks=s, return_lse=True))(q, k, v, sinks)
    with jax.default_matmul_precision("highest"):
        want = loss(lambda q, k, v, s: _sink_column_attention(q, k, v, s, scale))(q, k, v, sinks)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5, err_msg=name)


def test_dsinks_match_finite_differences_of_the_float64_reference():
    q, k, v, dout = random_inputs((2, 9, 12, 2, 2, 16), "float32", seed=6)
    sinks = _sinks(2, seed=7, spread=1.0)

    def loss(s):
        return jnp.sum(cfj.attention(q, k, v, causal=True, sinks=s) * dout)

    dsinks = np.asarray(jax.grad(loss)(sinks))
    step = 1e-5

    def reference_loss(s):
        return float(np.sum(attention_reference(q, k, v, causal=True, sinks=s)[0] * dout.astype(np.float64)))

    differences = [(reference_loss(sinks + step * e) - reference_loss(sinks - step * e)) / (2 * step)
                   for e in np.eye(2)]
    np.testing.assert_allclose(dsinks, differences, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mapped", ["q-and-sinks", "sinks-only", "k-shared-sinks", "k-and-sinks"])
def test_vmap_gives_each_element_its_own_call(mapped):
    """q mapped (or nothing but the sinks): folded into the query heads; k mapped with shared sinks: folded into
    the batch; k and sinks both mapped: one call per element. Each element is its own NumPy call, bit for bit."""
    q, k, v, _ = random_inputs((2, 11, 14, 4, 2, 32), "float16", seed=8)
    qs, ks = np.stack([q, q[:, ::-1]]), np.stack([k, k[:, ::-1]])
    sinks = np.stack([_sinks(4, seed=9), _sinks(4, seed=10)])
    calls = {
        "q-and-sinks": (lambda q, s: cfj.attention(q, k, v, causal=True, sinks=s), (qs, sinks),
                        lambda i: (qs[i], k, sinks[i])),
        "sinks-only": (lambda s: cfj.attention(q, k, v, causal=True, sinks=s), (sinks,), lambda i: (q, k, sinks[i])),
        "k-shared-sinks": (lambda kk: cfj.attention(q, kk, v, causal=True, sinks=sinks[0]), (ks,),
                           lambda i: (q, ks[i], sinks[0])),
        "k-and-sinks": (lambda kk, s: cfj.attention(q, kk, v, causal=True, sinks=s), (ks, sinks),
                        lambda i: (q, ks[i], sinks[i])),
    }
    function, arguments, element = calls[mapped]
    out = np.asarray(jax.jit(jax.vmap(function))(*arguments))
    for i in range(2):
        qi, ki, si = element(i)
        assert np.array_equal(out[i], cuflash.attention(qi, ki, v, causal=True, sinks=si))


def test_varlen_and_kvcache_equal_their_numpy_twins():
    rng = np.random.default_rng(11)
    cu_q, cu_k = np.array([0, 5, 5, 19], np.int32), np.array([0, 9, 12, 30], np.int32)
    q = rng.standard_normal((19, 4, 32)).astype(np.float16)
    k = rng.standard_normal((30, 2, 32)).astype(np.float16)
    v = rng.standard_normal((30, 2, 32)).astype(np.float16)
    sinks = _sinks(4, seed=12)
    out, lse = jax.jit(lambda q, k, v, s, cq, ck: cfj.attention_varlen(
        q, k, v, cq, ck, max_seqlen_q=14, max_seqlen_k=18, causal=True, sinks=s, return_lse=True))(
        q, k, v, sinks, cu_q, cu_k)
    want_out, want_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks, return_lse=True)
    assert np.array_equal(np.asarray(out), want_out) and np.array_equal(np.asarray(lse), want_lse)

    q = rng.standard_normal((2, 1, 8, 64)).astype(np.float16)
    k_cache = rng.standard_normal((2, 96, 2, 64)).astype(np.float16)
    v_cache = rng.standard_normal((2, 96, 2, 64)).astype(np.float16)
    k_new = rng.standard_normal((2, 1, 2, 64)).astype(np.float16)
    lengths = np.array([70, 3], np.int32)
    sinks = _sinks(8, seed=13)
    for splits in (1, 2):
        out, lse, *_ = jax.jit(lambda q, kc, vc, kn, n, s: cfj.attention_with_kvcache(
            q, kc, vc, k=kn, v=kn, cache_seqlens=n, sinks=s, num_splits=splits, return_lse=True))(
            q, k_cache, v_cache, k_new, lengths, sinks)
        caches = k_cache.copy(), v_cache.copy()
        want_out, want_lse = cuflash.attention_with_kvcache(q, *caches, k=k_new, v=k_new, cache_seqlens=lengths,
                                                            sinks=sinks, num_splits=splits, return_lse=True)
        assert np.array_equal(np.asarray(out), want_out) and np.array_equal(np.asarray(lse), want_lse)


def test_bad_sinks_are_refused_when_traced():
    q, k, v, _ = random_inputs((1, 4, 4, 2, 2, 16), "float32", seed=0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(nheads,\) = \(2,\)"):
        jax.jit(lambda s: cfj.attention(q, k, v, sinks=s))(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="sinks must have dtype float32"):
        cfj.attention(q, k, v, sinks=jnp.zeros(2, jnp.bfloat16))
