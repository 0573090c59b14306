"""v with a head dim of its own (MLA-style) on JAX arrays: cuflash.jax.attention, attention_varlen and
attention_with_kvcache.

* jit and grad: out, lse and dq, dk, dv bit for bit the NumPy calls' (the same kernels), for v narrower (DeepSeek's
  192 / 128 on the tensor cores) and wider than q and k;
* a loss through out and lse against JAX autodiff of plain jnp attention;
* vmap with k and v shared (folded into the heads) and mapped (folded into the batch): each element bit for bit
  its own call;
* varlen and the KV cache (with an append) bit for bit their NumPy twins;
* v wider than the kernels (qk 64 / v 512): a call per column chunk, bit for bit the NumPy calls, the lse's
  cotangent counted once.
(Sharding: the "headdim_v" and "headdim_v wide" cases of tests/jax/sharded_jit_worker.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash.testing import numpy_dtype  # noqa: E402


def _inputs(shape, d, dv, dtype, seed):
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    return (rng.standard_normal((batch, seqlen_q, nheads, d)).astype(dt),
            rng.standard_normal((batch, seqlen_k, nheads_k, d)).astype(dt),
            rng.standard_normal((batch, seqlen_k, nheads_k, dv)).astype(dt),
            rng.standard_normal((batch, seqlen_q, nheads, dv)).astype(dt))


# The wide pair (64 / 512) runs V in column chunks (program.value_column_chunks): the same chunks, summed in the
# same order, as the NumPy calls.
@pytest.mark.parametrize("dtype, d, dv", [("float32", 24, 40), ("bfloat16", 192, 128), ("bfloat16", 64, 512)])
def test_jit_and_grad_equal_the_numpy_calls(dtype, d, dv):
    q, k, v, dout = _inputs((2, 23, 31, 4, 2), d, dv, dtype, seed=1)
    options = dict(causal=True, window_size=(12, -1))

    @jax.jit
    def forward_and_grads(q, k, v):
        def loss(q, k, v):
            out, lse = cfj.attention(q, k, v, return_lse=True, **options)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), (out, lse)
        (_, results), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return results, grads

    (out, lse), grads = forward_and_grads(q, k, v)
    assert out.shape == (2, 23, 4, dv)
    want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, **options)
    assert np.array_equal(np.asarray(out), want_out) and np.array_equal(np.asarray(lse), want_lse)
    for got, expected in zip(grads, want):
        assert got.shape == expected.shape and np.array_equal(np.asarray(got), expected)


# With V in column chunks (32 / 300) the lse's cotangent joins D once (in the first chunk's call), not per chunk.
@pytest.mark.parametrize("dv", [20, 300])
def test_grad_through_out_and_lse_matches_jnp_autodiff(dv):
    q, k, v, dout = _inputs((1, 17, 29, 4, 2), 32, dv, "float32", seed=3)
    dlse = np.random.default_rng(4).standard_normal((1, 4, 17)).astype(np.float32)
    scale = 32 ** -0.5

    def plain(q, k, v):
        kk, vv = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * scale
        keep = jnp.arange(29)[None, :] <= jnp.arange(17)[:, None] + 12  # causal, bottom-right
        scores = jnp.where(keep, scores, -jnp.inf)
        lse = jax.nn.logsumexp(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(scores - lse[..., None]), vv)
        return out, lse

    def loss(attention):
        def of(q, k, v):
            out, lse = attention(q, k, v)
            return jnp.sum(out * dout) + jnp.sum(lse * dlse)
        return jax.grad(of, argnums=(0, 1, 2))(q, k, v)

    got = loss(lambda q, k, v: cfj.attention(q, k, v, causal=True, return_lse=True))
    want = loss(plain)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_vmap_folds_equal_each_elements_call():
    q, k, v, _ = _inputs((2, 19, 27, 4, 2), 40, 24, "float16", seed=5)
    qs, ks, vs = np.stack([q, -q]), np.stack([k, 0.5 * k]), np.stack([v, -v])
    shared = jax.jit(jax.vmap(lambda q: cfj.attention(q, k, v, causal=True)))(qs)
    mapped = jax.jit(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True)))(qs, ks, vs)
    for m in range(2):
        assert np.array_equal(np.asarray(shared[m]), cuflash.attention(qs[m], k, v, causal=True))
        assert np.array_equal(np.asarray(mapped[m]), cuflash.attention(qs[m], ks[m], vs[m], causal=True))


def test_varlen_and_kvcache_equal_the_numpy_calls():
    rng = np.random.default_rng(6)
    cu_q, cu_k = np.array([0, 5, 21], np.int32), np.array([0, 9, 40], np.int32)
    q = rng.standard_normal((21, 4, 24)).astype(np.float32)
    k = rng.standard_normal((40, 2, 24)).astype(np.float32)
    v = rng.standard_normal((40, 2, 56)).astype(np.float32)
    got = jax.jit(lambda q, k, v: cfj.attention_varlen(q, k, v, cu_q, cu_k, causal=True))(q, k, v)
    assert np.array_equal(np.asarray(got), cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True))

    q = rng.standard_normal((2, 1, 4, 48)).astype(np.float32)
    k_cache = rng.standard_normal((2, 64, 2, 48)).astype(np.float32)
    v_cache = rng.standard_normal((2, 64, 2, 32)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 2, 48)).astype(np.float32)
    v_new = rng.standard_normal((2, 1, 2, 32)).astype(np.float32)
    lengths = np.array([10, 50], np.int32)
    out, k_after, v_after = cfj.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths)
    kc, vc = k_cache.copy(), v_cache.copy()
    want = cuflash.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lengths)
    assert out.shape == (2, 1, 4, 32) and np.array_equal(np.asarray(out), want)
    assert np.array_equal(np.asarray(k_after), kc) and np.array_equal(np.asarray(v_after), vc)


# ---------------------------------------------------------------------------
# V wider than the kernels take (FA3's qk 64 / v 512): a call per column chunk (program.value_column_chunks).


def test_wide_v_vmap_equals_each_elements_call():
    """V in column chunks under vmap: each element its own call."""
    q, k, v, _ = _inputs((2, 23, 31, 4, 2), 64, 512, "bfloat16", seed=7)
    options = dict(causal=True, window_size=(12, -1))
    qs = np.stack([q, -q])
    mapped = jax.jit(jax.vmap(lambda q: cfj.attention(q, k, v, **options)))(qs)
    for m in range(2):
        assert np.array_equal(np.asarray(mapped[m]), cuflash.attention(qs[m], k, v, **options))


def test_wide_v_kvcache_equals_the_numpy_call():
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float16)
    k_cache = rng.standard_normal((2, 64, 2, 64)).astype(np.float16)
    v_cache = rng.standard_normal((2, 64, 2, 512)).astype(np.float16)
    k_new = rng.standard_normal((2, 1, 2, 64)).astype(np.float16)
    v_new = rng.standard_normal((2, 1, 2, 512)).astype(np.float16)
    lengths = np.array([10, 50], np.int32)
    out, k_after, v_after = cfj.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                                       causal=True)
    kc, vc = k_cache.copy(), v_cache.copy()
    want = cuflash.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lengths, causal=True)
    assert out.shape == (2, 1, 4, 512) and np.array_equal(np.asarray(out), want)
    assert np.array_equal(np.asarray(k_after), kc) and np.array_equal(np.asarray(v_after), vc)
