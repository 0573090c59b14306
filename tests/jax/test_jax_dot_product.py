"""cuflash.jax.dot_product_attention against jax.nn.dot_product_attention on the same arguments ([jax-scale] 3).

* A grid over is_causal, local_window_size (int and pairs), seqlen_q vs seqlen_k, GQA, query/key-value lengths,
  return_residual and dtypes: the values and the gradients of q, k, v equal jax.nn's within float32 (or 16-bit)
  accuracy, and the call ran on cuflash (one cuflash custom call forward, no warning).
* What cuflash does not cover (bias, mask, an implementation asked for, a top-left band cuflash cannot shift,
  lengths with a causal mask, float64) gives jax.nn's result exactly, with a warning said once per reason.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cfj  # noqa: E402
from cuflash.jax import _dot_product  # noqa: E402

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SHAPES = {"square": (2, 24, 24, 4, 2, 32), "tall": (1, 30, 17, 3, 1, 40), "wide": (2, 13, 29, 2, 2, 24)}
CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window-int": dict(local_window_size=5),
    "window-pair-causal": dict(local_window_size=(7, 3), is_causal=True),
    "lengths": dict(lengths=True),
    "kv-lengths-residual": dict(kv_lengths_only=True, return_residual=True),
    "residual-causal": dict(is_causal=True, return_residual=True),
}


def _expressible(name: str, shape) -> bool:
    """Whether cuflash covers the case's band on this shape (else it is a fallback, tested below)."""
    options = CASES[name]
    return _dot_product.band_of(options.get("local_window_size"), options.get("is_causal", False), shape[1],
                                shape[2]) is not None


def _grid():
    cases = []
    for i, name in enumerate(CASES):
        for j, dtype in enumerate(("float32", "bfloat16")):
            shape = list(SHAPES)[(i + j) % len(SHAPES)]
            if not _expressible(name, SHAPES[shape]):
                shape = "square"
            cases.append(pytest.param(name, shape, dtype, id=f"{name}-{shape}-{dtype}"))
    return cases


def _inputs(shape, dtype, seed=0):
    batch, sq, sk, h, hk, d = shape
    rng = np.random.default_rng(seed)
    dt = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    return tuple(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dt)
                 for s in ((batch, sq, h, d), (batch, sk, hk, d), (batch, sk, hk, d)))


def _kwargs(name, shape):
    kwargs = dict(CASES[name])
    batch, sq, sk = shape[:3]
    if kwargs.pop("lengths", False):
        kwargs["query_seq_lengths"] = jnp.asarray(np.minimum([sq - 3, sq][:batch] or [sq], sq), jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray(np.minimum([5, sk - 1][:batch], sk), jnp.int32)
    if kwargs.pop("kv_lengths_only", False):
        kwargs["key_value_seq_lengths"] = jnp.asarray(np.minimum([sk - 4, 3][:batch], sk), jnp.int32)
    return kwargs


@pytest.mark.parametrize("name, shape_name, dtype", _grid())
def test_matches_jax_nn_values_and_gradients(name, shape_name, dtype):
    shape = SHAPES[shape_name]
    q, k, v = _inputs(shape, dtype, seed=len(name))
    kwargs = _kwargs(name, shape)
    residual = kwargs.get("return_residual", False)

    def loss(f):
        def run(q, k, v):
            result = f(q, k, v, **kwargs)
            out = result[0] if residual else result
            return jnp.sum(out.astype(jnp.float32) ** 2), result
        return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        (_, got), got_grads = loss(cfj.dot_product_attention)(q, k, v)
    (_, want), want_grads = loss(jax.nn.dot_product_attention)(q, k, v)
    # Two implementations of the same float32-accumulated math: float32 agrees to a few ulps; 16-bit results differ
    # by the rounding of P (and dS) to bfloat16 in one and not the other, a few bfloat16 ulps of the largest value.
    tol = 2e-5 if dtype == "float32" else 2**-6
    for a, b in zip((*jax.tree.leaves(got), *got_grads), (*jax.tree.leaves(want), *want_grads)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if residual and a.ndim == 3:  # lse: rows that see a key (jax.nn's empty rows are not -inf)
            seen = np.isfinite(a)
            a, b = a[seen], b[seen]
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(b), initial=0.0))))
    hlo = jax.jit(lambda q, k, v: cfj.dot_product_attention(q, k, v, **kwargs)).lower(q, k, v).as_text()
    assert hlo.count("cuflash_program") == 1


def test_unbatched_inputs():
    q, k, v = _inputs(SHAPES["square"], "float32")
    got = cfj.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.nn.dot_product_attention(q[0], k[0], v[0],
                                                                                        is_causal=True)),
                               rtol=2e-5, atol=2e-5)


FALLBACKS = {
    # bias and mask alone run on flex_attention (test_jax_flex.py); with sequence lengths they fall back
    "bias-lengths": (dict(bias=True, key_value_seq_lengths=True), "a bias or mask with"),
    "mask-lengths": (dict(mask=True, key_value_seq_lengths=True), "a bias or mask with"),
    "implementation": (dict(implementation="xla"), "implementation='xla' is not covered"),
    "wide-causal": (dict(is_causal=True), "top-left aligned"),
    "lengths-causal": (dict(is_causal=True, key_value_seq_lengths=True), "sequence lengths together with"),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_uncovered_calls_fall_back_to_jax_nn_with_one_warning(case, monkeypatch):
    monkeypatch.setattr(_dot_product, "_warned", set())
    kwargs, message = FALLBACKS[case]
    kwargs = dict(kwargs)
    shape = SHAPES["wide"] if case == "wide-causal" else SHAPES["square"]
    q, k, v = _inputs(shape, "float32")
    batch, sq, sk, h = shape[:4]
    if kwargs.pop("bias", False):
        kwargs["bias"] = jnp.ones((batch, h, sq, sk), jnp.float32) * 0.1
    if kwargs.pop("mask", False):
        kwargs["mask"] = jnp.asarray(np.random.default_rng(0).random((batch, h, sq, sk)) < 0.8)
    if kwargs.get("key_value_seq_lengths") is True:
        kwargs["key_value_seq_lengths"] = jnp.asarray([sk - 2] * batch, jnp.int32)
    with pytest.warns(UserWarning, match=message):
        got = cfj.dot_product_attention(q, k, v, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        again = cfj.dot_product_attention(q, k, v, **kwargs)
    want = jax.nn.dot_product_attention(q, k, v, **kwargs)
    assert np.array_equal(np.asarray(got), np.asarray(want)) and np.array_equal(np.asarray(again), np.asarray(want))
