"""cuflash.jax.attention and attention_varlen with num_splits (split-KV on any forward), on the CPU simulator.

* under jit, num_splits 2, 3 and 0 (the heuristic) give out and lse bit for bit what cuflash.attention gives on
  NumPy arrays with the same num_splits, whose launches include the combine kernel (so the JAX call split too);
  omitted, no combine kernel runs (no split, as before); with attention_chunk, the chunks' varlen call splits;
* attention_varlen with num_splits=3, its cu_seqlens concrete or traced (or in chunks), equals
  cuflash.attention_varlen's; over pages, a decode step too, it splits as the NumPy call does (None: a decode
  step's heuristic);
* grad through a split forward equals cuflash.attention_backward given that forward's out and lse (the backward
  takes no split), bit for bit, and lies within the float64 reference's tolerance;
* vmap equals a loop of calls: a heuristic split's (num_splits=0) elements run their own calls, whose heuristic
  sees each element's problem; an asked count folds into one launch;
* num_splits with dropout, with an algorithm without split-KV, or past 128 raises a ValueError naming it (varlen's
  too, its cu_seqlens concrete or traced).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import _tolerance as tol  # noqa: E402
from cuflash import sim  # noqa: E402
from cuflash.jax._ffi import record_launches  # noqa: E402

COMBINE = "fa2_split_kv_combine_kernel"
# Few query rows over many keys (several K/V blocks per sequence): the shape split-KV is for, and one whose
# batch x heads x Q blocks leaves the simulated target's SMs idle, so the heuristic splits too.
BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_K, HEADDIM = 2, 5, 300, 4, 2, 40


def _inputs(dtype=np.float16, seed=0, *, batch=BATCH, seqlen_q=SEQLEN_Q, seqlen_k=SEQLEN_K, headdim=HEADDIM):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, NHEADS, headdim)).astype(dtype)
    k, v = (rng.standard_normal((batch, seqlen_k, NHEADS_K, headdim)).astype(dtype) for _ in range(2))
    return q, k, v


def _kernels_run(call):
    """call()'s result and the names of the kernels it launched on the simulator."""
    with sim.record() as records:
        result = call()
    return result, [str(launch.kernel) for launch in records.launches]


def _assert_bitwise(got, want):
    for name, g, w in zip(("out", "lse"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.array_equal(np.asarray(g), w), f"{name} differs from the NumPy call's"


@pytest.mark.parametrize("num_splits", [2, 3, 0])
def test_jit_equals_numpy_bit_for_bit(num_splits):
    q, k, v = _inputs()
    options = dict(causal=True, num_splits=num_splits)
    want, kernels = _kernels_run(lambda: cuflash.attention(q, k, v, return_lse=True, **options))
    assert any(COMBINE in name for name in kernels), kernels
    got = jax.jit(lambda q, k, v: cfj.attention(q, k, v, return_lse=True, **options))(q, k, v)
    _assert_bitwise(got, want)


def _lowered_kernels(function, *args) -> list[str]:
    """The kernels the custom calls of jit(function)(*args) launch, from the lowered module's attributes."""
    text = jax.jit(function).lower(*args).as_text()
    return [name for found in re.findall(r'kernels = "([^"]*)"', text) for name in found.split(";")]


def test_no_split_by_default():
    q, k, v = _inputs()
    unsplit = _lowered_kernels(lambda q, k, v: cfj.attention(q, k, v, causal=True), q, k, v)
    assert len(unsplit) == 1 and "forward_kernel" in unsplit[0], unsplit
    split = _lowered_kernels(lambda q, k, v: cfj.attention(q, k, v, causal=True, num_splits=3), q, k, v)
    assert split[0] == unsplit[0] and COMBINE in split[1], split


# Varlen: a prefill-like batch, sequences of few queries over many keys (one empty), GQA.
LENGTHS_Q, LENGTHS_K = [3, 0, 17], [400, 9, 650]


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("cu_seqlens", ["concrete", "traced", "chunked"])
def test_varlen_equals_numpy_bit_for_bit(cu_seqlens):
    """cu_seqlens closed over or jit arguments; "chunked": attention_chunk's call over the chunks' sequences."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((sum(LENGTHS_Q), NHEADS, 72)).astype(np.float16)
    k, v = (rng.standard_normal((sum(LENGTHS_K), NHEADS_K, 72)).astype(np.float16) for _ in range(2))
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    options = dict(window_size=(500, -1), num_splits=3, return_lse=True)
    if cu_seqlens == "chunked":
        options["attention_chunk"] = 256
    want, kernels = _kernels_run(lambda: cuflash.attention_varlen(q, k, v, cu_q, cu_k, **options))
    assert any(COMBINE in name for name in kernels), kernels
    if cu_seqlens == "traced":
        got = jax.jit(lambda q, k, v, cu_q, cu_k: cfj.attention_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K), **options))(
            q, k, v, cu_q, cu_k)
    else:
        got = jax.jit(lambda q, k, v: cfj.attention_varlen(q, k, v, cu_q, cu_k, **options))(q, k, v)
    _assert_bitwise(got, want)


@pytest.mark.parametrize("lengths_q, num_splits", [([1, 1, 1], None), ([1, 1, 1], 1), ([1, 1, 1], 2),
                                                    ([3, 0, 17], 3)])
def test_paged_splits_as_numpy(lengths_q, num_splits):
    """A decode step over pages (one query row per sequence) runs as attention_with_kvcache's decode: num_splits None
    is its heuristic (which splits here: 3 sequences x 2 kv heads leave the SMs idle), 1 no split; other paged
    calls run the varlen forward over the pages."""
    lengths_k, page = [300, 40, 650], 64
    rng = np.random.default_rng(5)
    per_sequence = -(-max(lengths_k) // page)
    num_pages = len(lengths_k) * per_sequence
    q = rng.standard_normal((sum(lengths_q), NHEADS, HEADDIM)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((num_pages, page, NHEADS_K, HEADDIM)).astype(np.float16)
                        for _ in range(2))
    table = rng.permutation(num_pages).astype(np.int32).reshape(len(lengths_k), per_sequence)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    options = dict(block_table=table, causal=True, return_lse=True, num_splits=num_splits)
    want, kernels = _kernels_run(lambda: cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, **options))
    split = any(COMBINE in name for name in kernels)
    assert split == (num_splits != 1), kernels

    def step(q, k_cache, v_cache):
        return cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, **options)

    assert any(COMBINE in name for name in _lowered_kernels(step, q, k_cache, v_cache)) == split
    _assert_bitwise(jax.jit(step)(q, k_cache, v_cache), want)


def test_chunked_attention_takes_num_splits():
    """attention_chunk runs a varlen call over the chunks' sequences, with the call's num_splits."""
    q, k, v = _inputs(seqlen_q=40, seqlen_k=700)
    options = dict(causal=True, attention_chunk=512, num_splits=2, return_lse=True)  # the last chunk: 188 keys
    want, kernels = _kernels_run(lambda: cuflash.attention(q, k, v, **options))
    assert any(COMBINE in name for name in kernels), kernels
    _assert_bitwise(jax.jit(lambda q, k, v: cfj.attention(q, k, v, **options))(q, k, v), want)


def test_grad_through_a_split_forward():
    q, k, v = _inputs(np.float32, seed=2, batch=1)
    dout = np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)
    options = dict(causal=True, softcap=5.0)

    def loss(q, k, v):
        out, lse = cfj.attention(q, k, v, return_lse=True, num_splits=3, deterministic=True, **options)
        return jnp.sum(out * dout), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.array_equal(out, cuflash.attention(q, k, v, num_splits=3, **options))
    # deterministic: dq accumulated in a fixed order (atomic adds over several K/V blocks need not repeat bitwise)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert np.array_equal(np.asarray(got), w), f"{name} differs from attention_backward's"
    ref = tol.backward_references(dout, q, k, v, **options)
    for name, got, exact, lowp in zip(("dq", "dk", "dv"), grads, ref[:3], ref[3:6]):
        tol.check_close(name, np.asarray(got), exact, lowp, tol.BACKWARD_FACTOR)


@pytest.mark.parametrize("num_splits, shared_kv", [(0, False), (0, True), (3, True)])
def test_vmap_equals_a_loop(num_splits, shared_kv):
    """The heuristic's split count depends on the batch and heads, so each element of a vmap of num_splits=0 runs
    its own call; an asked count does not, so that one folds into one launch (shared k, v: into the heads)."""
    members = 3
    q, k, v = _inputs(np.float16, seed=4, batch=members * BATCH)
    q, k, v = (x.reshape(members, BATCH, *x.shape[1:]) for x in (q, k, v))
    k, v = (x[0] if shared_kv else x for x in (k, v))

    def step(q, k, v):
        return cfj.attention(q, k, v, return_lse=True, num_splits=num_splits)

    with record_launches() as launches:
        mapped = jax.block_until_ready(jax.jit(jax.vmap(step, in_axes=(0, None, None) if shared_kv else 0))(q, k, v))
    forwards = [launch for launch in launches if COMBINE not in str(launch.kernel)]
    assert len(forwards) == (members if num_splits == 0 else 1), [str(launch.kernel) for launch in launches]
    single = jax.jit(step)
    for m in range(members):
        one = single(q[m], k, v) if shared_kv else single(q[m], k[m], v[m])
        for got, want in zip(mapped, one):
            assert np.array_equal(np.asarray(got[m]), np.asarray(want))


@pytest.mark.parametrize("options, message", [
    (dict(num_splits=3, dropout_p=0.1, dropout_rng=jax.random.key(0)), "num_splits must be 1 when dropout_p > 0"),
    (dict(num_splits=2, algorithm="fa1"), "num_splits other than 1"),
    (dict(num_splits=129), "num_splits must be in"),
    (dict(num_splits=-1), "num_splits must be in"),
])
def test_bad_num_splits_raises(options, message):
    q, k, v = _inputs(seqlen_k=20)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda q, k, v: cfj.attention(q, k, v, **options), q, k, v)


@pytest.mark.parametrize("traced", [False, True])
def test_bad_varlen_num_splits_raises(traced):
    q, k, v = (x[0] for x in _inputs(seqlen_q=20, seqlen_k=20))
    cu = _cu([20])
    extents = dict(max_seqlen_q=20, max_seqlen_k=20) if traced else {}
    for options, message in ((dict(num_splits=129), "num_splits must be in"),
                             (dict(num_splits=2, dropout_p=0.1, dropout_rng=jax.random.key(0)), "dropout_p > 0")):
        def call(q, k, v, cu_q, cu_k):
            return cfj.attention_varlen(q, k, v, cu_q, cu_k, **extents, **options)

        with pytest.raises(ValueError, match=message):
            if traced:
                jax.eval_shape(call, q, k, v, cu, cu)
            else:
                jax.eval_shape(lambda q, k, v: call(q, k, v, cu, cu), q, k, v)
