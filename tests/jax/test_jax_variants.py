"""cuflash.jax.attention with FlashAttention-2's options (windows, softcap, ALiBi, dropout), on the CPU simulator.

* jit(grad) of a loss through out and lse equals JAX autodiff of a plain jnp attention written from the options'
  formulas (float32, to float32 accuracy), for fa2 with every option and for fa1 and standard with windows;
* the lse's cotangent goes into the backward's D: a grad through out and lse lowers to one forward and one backward
  custom call, nothing else;
* vmap with ALiBi slopes mapped, shared, per head and per (batch, head) equals per-element calls;
* 16-bit inputs: the tensor-core kernels within FA2's rule of the float64 reference;
* options fa1 and standard lack are refused naming fa2, at trace time;
* dropout from a (traced) PRNG key: grad equals autodiff of the plain attention fed cuflash.dropout_mask of
  cuflash.jax.dropout_seed(key), vmap (one call: seeds fold with the batch) equals a loop, and keys are checked.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import _tolerance as T  # noqa: E402
from cuflash.testing import random_inputs  # noqa: E402

SHAPE = (2, 21, 30, 4, 2, 24)  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim


def _slopes(per_batch: bool, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(0.05, 0.5, (SHAPE[0], SHAPE[3]) if per_batch else (SHAPE[3],)).astype(np.float32)


def _band(seqlen_q, seqlen_k, left, right):
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    return ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right)), np.abs(i - j)


def plain_attention(q, k, v, *, scale, window_size=(-1, -1), causal=False, softcap=0.0, slopes=None, keep=None,
                    dropout_p=0.0):
    """Attention in jnp from the options' formulas: (out, lse), lse 0 on rows that see no key. ``keep``: dropout's
    mask (batch, nheads, seqlen_q, seqlen_k); P is multiplied by keep / (1 - dropout_p) before P V."""
    left, right = window_size
    visible, distance = _band(q.shape[1], k.shape[1], left, 0 if causal else right)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if slopes is not None:
        s = s - jnp.broadcast_to(slopes, (q.shape[0], q.shape[2]))[:, :, None, None] * distance
    s = jnp.where(visible, s, -jnp.inf)
    seen = visible.any(axis=1)[None, None, :]
    lse = jnp.where(seen, jax.nn.logsumexp(jnp.where(seen[..., None], s, 0.0), axis=-1), 0.0)
    p = jnp.where(seen[..., None], jax.nn.softmax(jnp.where(seen[..., None], s, 0.0), axis=-1), 0.0)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return jnp.einsum("bhqk,bkhd->bqhd", p * visible, v), lse


CASES = [
    pytest.param("fa2", dict(window_size=(7, 2), softcap=3.0), True, id="fa2-window-softcap-alibi-batch"),
    pytest.param("fa2", dict(window_size=(4, -1), causal=True), False, id="fa2-window-causal-alibi-heads"),
    pytest.param("fa2", dict(softcap=1.5), None, id="fa2-softcap"),
    pytest.param("fa1", dict(window_size=(5, 6)), None, id="fa1-window"),
    pytest.param("standard", dict(window_size=(-1, 3)), None, id="standard-window"),
]


@pytest.mark.parametrize("algorithm, options, alibi_per_batch", CASES)
def test_jit_grad_through_out_and_lse_equals_autodiff(algorithm, options, alibi_per_batch):
    q, k, v, dout = random_inputs(SHAPE, "float32", seed=3)
    lse_weights = np.random.default_rng(4).standard_normal((SHAPE[0], SHAPE[3], SHAPE[1])).astype(np.float32)
    slopes = None if alibi_per_batch is None else _slopes(alibi_per_batch)
    scale = 0.6

    def ours(q, k, v):
        out, lse = cfj.attention(q, k, v, softmax_scale=scale, alibi_slopes=slopes, algorithm=algorithm,
                                 return_lse=True, **options)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * lse_weights)

    def theirs(q, k, v):
        out, lse = plain_attention(q, k, v, scale=scale, slopes=slopes, **options)
        return jnp.sum(out * dout) + jnp.sum(lse * lse_weights)

    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v)
    value_ref, grads_ref = jax.value_and_grad(theirs, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, value_ref, rtol=2e-5)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=3e-5, atol=3e-5, err_msg=name)


def test_lse_cotangent_costs_no_extra_call():
    q, k, v, _ = random_inputs(SHAPE, "float32", seed=0)

    def loss(q, k, v):
        out, lse = cfj.attention(q, k, v, softcap=2.0, alibi_slopes=_slopes(False), return_lse=True)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    calls = re.findall(r"stablehlo\.custom_call @cuflash_program\(.*", hlo)
    assert len(calls) == 2, calls
    bindings = sorted(re.search(r'bindings = "([^"]*)"', c).group(1).split(",")[0] for c in calls)
    assert bindings == ["dout", "q"]
    backward = next(c for c in calls if 'bindings = "dout' in c)
    assert 'bindings = "dout,q,k,v,out,lse,alibi_slopes,dlse,dq,dk,dv' in backward


@pytest.mark.parametrize("slopes_axis, per_batch", [(0, False), (None, False), (0, True), (None, True)])
def test_vmap_with_alibi_slopes(slopes_axis, per_batch):
    q, k, v, _ = random_inputs(SHAPE, "float32", seed=5)
    qs = np.stack([q, 0.5 * q, -q])
    slopes = _slopes(per_batch)
    ss = np.stack([slopes, 2 * slopes, 0.5 * slopes]) if slopes_axis == 0 else slopes
    options = dict(window_size=(9, 3), softcap=4.0)
    got = jax.vmap(lambda q, s: cfj.attention(q, k, v, alibi_slopes=s, **options), in_axes=(0, slopes_axis))(qs, ss)
    for m in range(3):
        expected = cuflash.attention(qs[m], k, v, alibi_slopes=ss[m] if slopes_axis == 0 else ss, **options)
        assert np.array_equal(np.asarray(got[m]), expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_options_on_tensor_cores_meet_the_rule(dtype):
    q, k, v, dout = random_inputs(SHAPE, dtype, seed=8)
    slopes = _slopes(True)
    options = dict(window_size=(11, 0), softcap=5.0, alibi_slopes=slopes)
    out, vjp = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, **options), q, k, v)
    ref = T.forward_references(q, k, v, **options)
    T.check_close("out", np.asarray(out), ref.out, ref.out_lowp, T.FORWARD_FACTOR)
    bref = T.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv"), vjp(jnp.asarray(dout))):
        T.check_close(name, np.asarray(got), getattr(bref, name), getattr(bref, name + "_lowp"), T.BACKWARD_FACTOR,
                      atol=1e-5)


@pytest.mark.parametrize("algorithm", ["fa1", "standard"])
def test_options_without_kernels_are_refused_at_trace_time(algorithm):
    q, k, v, _ = random_inputs(SHAPE, "float32", seed=0)
    with pytest.raises(ValueError, match=f"softcap is supported by algorithm='fa2' only, got algorithm='{algorithm}'"):
        jax.jit(lambda q: cfj.attention(q, k, v, softcap=1.0, algorithm=algorithm))(q)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cfj.attention(q, k, v, alibi_slopes=np.zeros((3,), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_grad_equals_autodiff_with_dropout_mask(dtype):
    """A traced key under jit: the kernels drop cuflash.dropout_mask(dropout_seed(key)), forward and backward."""
    q, k, v, dout = random_inputs(SHAPE, dtype, seed=12)
    key = jax.random.key(2024)
    p = 0.3
    options = dict(window_size=(12, -1), causal=True, softcap=4.0)
    keep = cuflash.dropout_mask(cfj.dropout_seed(key), SHAPE[0], SHAPE[3], SHAPE[1], SHAPE[2], p)

    def ours(q, k, v, key):
        out = cfj.attention(q, k, v, softmax_scale=0.5, dropout_p=p, dropout_rng=key, **options)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(np.float32))

    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v, key)
    if dtype == "float32":
        def theirs(q, k, v):
            return jnp.sum(plain_attention(q, k, v, scale=0.5, keep=keep, dropout_p=p, **options)[0] * dout)

        value_ref, grads_ref = jax.value_and_grad(theirs, argnums=(0, 1, 2))(q, k, v)
        np.testing.assert_allclose(value, value_ref, rtol=2e-5)
        for name, a, b in zip(("dq", "dk", "dv"), grads, grads_ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=3e-5, atol=3e-5, err_msg=name)
    else:  # the tensor-core kernels against the float64 reference fed the same mask
        bref = T.backward_references(dout, q, k, v, softmax_scale=0.5, dropout_p=p, dropout_mask=keep, **options)
        for name, got in zip(("dq", "dk", "dv"), grads):
            T.check_close(name, np.asarray(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                          T.BACKWARD_FACTOR, atol=1e-5)
    out = cfj.attention(q, k, v, softmax_scale=0.5, dropout_p=p, dropout_rng=key, **options)
    expected = cuflash.attention(q, k, v, softmax_scale=0.5, dropout_p=p, dropout_seed=cfj.dropout_seed(key),
                                 **options)
    assert np.array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_vmap_with_dropout_is_one_call_that_drops_what_a_loop_drops(monkeypatch, dtype):
    """vmap folds the mapped elements with their seeds into one call per direction (Problem's
    dropout_batches_per_seed): over keys, over q with a shared key, nested, under grad and in grid-limit chunks,
    each element gets bitwise what its own call gives."""
    from cuflash import _validation

    q, k, v, dout = random_inputs(SHAPE, dtype, seed=13)
    keys = jax.random.split(jax.random.key(7), 3)
    qs = np.stack([q, -q])
    options = dict(causal=True, dropout_p=0.2)

    def one(key, q):
        return cfj.attention(q, k, v, dropout_rng=key, **options)

    def expected(key, q):
        return cuflash.attention(q, k, v, dropout_seed=cfj.dropout_seed(key), **options)

    over_keys = jax.jit(jax.vmap(lambda key: one(key, q)))
    got = over_keys(keys)
    for m in range(3):
        assert np.array_equal(np.asarray(got[m]), expected(keys[m], q))
    calls = re.findall(r"stablehlo\.custom_call @cuflash_program\(.*", over_keys.lower(keys).as_text())
    assert len(calls) == 1 and re.search(rf"grid = dense<\[?\d+, \d+, {3 * SHAPE[0]}\b", calls[0]), calls

    shared = jax.vmap(lambda q: one(keys[0], q))(qs)
    for n in range(2):
        assert np.array_equal(np.asarray(shared[n]), expected(keys[0], qs[n]))

    nested = jax.jit(jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None)))(keys, qs)
    for m in range(3):
        for n in range(2):
            assert np.array_equal(np.asarray(nested[m, n]), expected(keys[m], qs[n]))

    def loss(q, k, v, key):
        out = cfj.attention(q, k, v, dropout_rng=key, **options)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(np.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    grads = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0)))(qs, k, v, keys[:2])
    for n in range(2):
        for got_n, want in zip(grads, jax.jit(grad)(qs[n], k, v, keys[n])):
            np.testing.assert_allclose(np.asarray(got_n[n]), np.asarray(want), rtol=1e-6, atol=1e-6)

    monkeypatch.setattr(_validation, "MAX_GRID_YZ", 4)  # batch 2: chunks of 2 mapped elements, then 1
    chunked = jax.jit(jax.vmap(lambda key: one(key, q)))
    assert len(re.findall(r"custom_call @cuflash_program\(", chunked.lower(keys).as_text())) == 2
    assert np.array_equal(np.asarray(chunked(keys)), np.asarray(got))


def _cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_devices(), reason="needs a CUDA build of JAX with a GPU")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_vmap_with_dropout_drops_what_each_call_drops(dtype):
    """On a GPU (the CUDA FFI handler): vmap over keys folds into one call per direction whose results are bitwise
    each key's own call (forward; grads within a 16-bit rounding: dQ's atomics sum in any order)."""
    device = _cuda_devices()[0]
    q, k, v, dout = (jax.device_put(x, device) for x in random_inputs(SHAPE, dtype, seed=14))
    keys = jax.random.split(jax.random.key(9), 3)

    def loss(q, key):
        out = cfj.attention(q, k, v, causal=True, dropout_p=0.25, dropout_rng=key)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    batched = jax.jit(jax.vmap(jax.value_and_grad(loss, has_aux=True), in_axes=(None, 0)))
    (_, outs), grads = batched(q, keys)
    for m in range(3):
        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(q, keys[m])
        assert np.array_equal(np.asarray(outs[m]), np.asarray(out)), m
        np.testing.assert_allclose(np.asarray(grads[m], np.float32), np.asarray(grad, np.float32), rtol=2e-3,
                                   atol=2e-3)


def test_ring_attention_with_dropout_needs_aligned_chunks():
    """Dropout's Philox counters pair rows i, i + 8 and keys j, j + 1: ring blocks must start at multiples of 16
    rows and even keys, checked before anything is traced (shapes from tests/jax/ring_worker.py run the ring)."""
    key = jax.random.key(0)
    q, k = np.zeros((1, 24, 2, 16), np.float32), np.zeros((1, 24, 2, 16), np.float32)
    with pytest.raises(ValueError, match=r"chunks \(half the local length\) that are multiples of 16.* got 12 query"):
        cfj.ring_attention(q, k, k, axis_name="x", causal=True, dropout_p=0.1, dropout_rng=key)
    with pytest.raises(ValueError, match="lengths that are multiples of 16 and even key lengths, got 16 query and 7"):
        cfj.ring_attention(q[:, :16], k[:, :7], k[:, :7], axis_name="x", dropout_p=0.1, dropout_rng=key)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        cfj.ring_attention(q, k, k, axis_name="x", dropout_p=1.0, dropout_rng=key)


def test_dropout_keys_are_checked():
    q, k, v, _ = random_inputs(SHAPE, "float32", seed=0)
    with pytest.raises(ValueError, match="dropout_rng .* is required"):
        cfj.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout_rng must be one JAX PRNG key"):
        cfj.attention(q, k, v, dropout_p=0.1, dropout_rng=jax.random.split(jax.random.key(0), 2))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        cfj.attention(q, k, v, dropout_p=1.5, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="dropout is supported by algorithm='fa2' only"):
        cfj.attention(q, k, v, dropout_p=0.1, dropout_rng=jax.random.key(0), algorithm="fa1")
    legacy = jax.random.PRNGKey(3)  # raw uint32[2] keys work too
    out = cfj.attention(q, k, v, dropout_p=0.1, dropout_rng=legacy)
    assert np.array_equal(np.asarray(out), cuflash.attention(q, k, v, dropout_p=0.1,
                                                             dropout_seed=cfj.dropout_seed(legacy)))
