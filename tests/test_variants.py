"""FlashAttention-2's options on plain attention: local windows, softcap, ALiBi and dropout ([variants]).

* Every option alone and combined, in float32 (the SIMT fa2) and float16/bfloat16 (the tensor-core fa2), forward
  and backward, on odd shapes, GQA/MQA, seqlen_q != seqlen_k and rows that see no key, against the float64
  reference under FA2's rule (cuflash._tolerance; with dropout the reference is fed cuflash.dropout_mask); fa1
  and standard attention with windows. tests/test_dropout.py shows the kernels drop exactly that mask's elements.
* The reference itself against oracles nobody here wrote: jax.nn.dot_product_attention with a boolean mask and an
  additive bias (windows, ALiBi), and JAX autodiff of a plain jnp softcapped attention for the gradients.
* Block skipping covers both sides of the band: the simulator's traffic equals the tile formula, which visits only
  the K/V blocks a Q block's band touches.
* Options fa1 and standard attention do not have are refused with an error naming fa2.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import _validation as V
from cuflash import sim
from cuflash.kernels import plans
from cuflash.kernels.families import fa2, fa2_tc
from cuflash.kernels.program import Problem
from cuflash.kernels.targets import target
from cuflash.mask import Mask
from cuflash.reference import attention_backward_reference, attention_reference
from cuflash.testing import random_inputs, rows_without_key

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): odd lengths, both orders, MHA/GQA/MQA, head dims that
# are not powers of two (and below a compiled one).
SHAPES = {
    "mha-tall": (2, 75, 33, 2, 2, 40),
    "gqa-wide": (1, 47, 161, 6, 2, 72),
    "mqa-square": (2, 97, 97, 3, 1, 59),
    "gqa-long": (1, 150, 290, 4, 2, 128),
}
# Option sets: each alone and in combination. "alibi" picks the slope layout by the case index.
OPTIONS = {
    "window": dict(window_size=(13, 6)),
    "window-causal": dict(window_size=(21, -1), causal=True),
    "window-left-only": dict(window_size=(0, -1)),
    "window-right-only": dict(window_size=(-1, 9)),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi=True),
    "softcap-alibi": dict(softcap=6.0, alibi=True),
    "window-softcap-alibi-causal": dict(window_size=(30, 5), causal=True, softcap=4.0, alibi=True),
    "dropout": dict(dropout_p=0.17),
    "dropout-window-causal-softcap-alibi": dict(dropout_p=0.3, window_size=(25, -1), causal=True, softcap=5.0,
                                                alibi=True),
}
DTYPES = ["float32", "float16", "bfloat16"]


def _cases():
    """Every option set in every dtype (so in both fa2 variants), the shapes in rotation."""
    cases = []
    for i, (name, options) in enumerate(OPTIONS.items()):
        for d, dtype in enumerate(DTYPES):
            shape_name = list(SHAPES)[(i + d) % len(SHAPES)]
            cases.append(pytest.param(shape_name, name, dtype, (i + d) % 2 == 1,
                                      id=f"{name}-{dtype}-{shape_name}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _cases()]
    assert {v[0] for v in values} == set(SHAPES)
    assert {v[1] for v in values} == set(OPTIONS)
    assert {v[2] for v in values} == set(DTYPES)
    assert {v[3] for v in values} == {False, True}


def _slopes(shape, per_batch: bool, seed: int) -> np.ndarray:
    batch, nheads = shape[0], shape[3]
    rng = np.random.default_rng(seed)
    return rng.uniform(0.02, 0.6, (batch, nheads) if per_batch else (nheads,)).astype(np.float32)


def _options(name: str, shape, per_batch: bool, seed: int) -> dict:
    options = dict(OPTIONS[name])
    if options.pop("alibi", False):
        options["alibi_slopes"] = _slopes(shape, per_batch, seed)
    if "dropout_p" in options:
        options["dropout_seed"] = 2**40 + 977 * seed  # a seed with both 32-bit words in use
    return options


def _reference_options(options: dict, q, k) -> dict:
    """The reference's options for a cuflash call's: dropout's seed becomes the mask cuflash.dropout_mask gives."""
    options = dict(options)
    seed = options.pop("dropout_seed", None)
    if seed is not None:
        batch, seqlen_q, nheads, _ = q.shape
        options["dropout_mask"] = cuflash.dropout_mask(seed, batch, nheads, seqlen_q, k.shape[1], options["dropout_p"])
    return options


def _check(q, k, v, dout, options, algorithm="fa2", deterministic=False):
    out, lse = cuflash.attention(q, k, v, algorithm=algorithm, return_lse=True, **options)
    ref = tol.forward_references(q, k, v, **_reference_options(options, q, k))
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = rows_without_key(q.shape[1], k.shape[1], options.get("causal", False), options.get("window_size", (-1, -1)))
    assert np.all(out[:, empty].astype(np.float32) == 0) and np.all(lse[:, :, empty] == -np.inf)

    grads = cuflash.attention_backward(dout, q, k, v, out, lse, algorithm=algorithm, deterministic=deterministic,
                                       **options)
    bref = tol.backward_references(dout, q, k, v, **_reference_options(options, q, k))
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert got.dtype == q.dtype
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    assert np.all(grads[0][:, empty].astype(np.float32) == 0)
    return empty


@pytest.mark.parametrize("shape_name, option_name, dtype, per_batch", _cases())
def test_fa2_options_match_reference(shape_name, option_name, dtype, per_batch):
    shape = SHAPES[shape_name]
    q, k, v, dout = random_inputs(shape, dtype, seed=len(option_name) * 31 + len(shape_name))
    options = _options(option_name, shape, per_batch, seed=7)
    with sim.record() as records:
        _check(q, k, v, dout, options, deterministic=per_batch)
    kernels = {r.kernel.split("<")[0] for r in records.launches}
    expected = "cuflash::fa2_forward_kernel" if dtype == "float32" else "cuflash::fa2_tc_forward_kernel"
    assert expected in kernels, kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_windows_put_rows_that_see_no_key_anywhere(dtype):
    """seqlen_q > seqlen_k with a band that ends before key 0 for the first rows, and a band that starts past the
    last key for no row but leaves early keys unseen: zeros, -inf and zero gradients where the band is empty."""
    shape = (1, 70, 20, 2, 1, 48)
    q, k, v, dout = random_inputs(shape, dtype, seed=3)
    empty = _check(q, k, v, dout, dict(window_size=(3, 2)))
    assert empty.sum() == 70 - 20 - 2 and not empty[-1]
    empty = _check(q, k, v, dout, dict(window_size=(2, 4), softcap=3.0, alibi_slopes=_slopes(shape, False, 1)))
    assert empty.sum() == 70 - 20 - 4


@pytest.mark.parametrize("algorithm, dtype", [("fa1", "float16"), ("fa1", "float32"), ("standard", "bfloat16"),
                                              ("standard", "float32")])
def test_fa1_and_standard_take_windows(algorithm, dtype):
    shape = (2, 53, 88, 4, 2, 24)
    q, k, v, dout = random_inputs(shape, dtype, seed=11)
    _check(q, k, v, dout, dict(window_size=(17, 3)), algorithm=algorithm)
    _check(q, k, v, dout, dict(window_size=(5, -1), causal=True), algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["fa1", "standard"])
@pytest.mark.parametrize("option", ["softcap", "alibi", "dropout"])
def test_options_without_kernels_are_refused_naming_fa2(algorithm, option):
    shape = (1, 8, 8, 2, 2, 16)
    q, k, v, dout = random_inputs(shape, "float32", seed=0)
    options = {"softcap": dict(softcap=1.0), "alibi": dict(alibi_slopes=_slopes(shape, False, 0)),
               "dropout": dict(dropout_p=0.1, dropout_seed=5)}[option]
    with pytest.raises(ValueError, match=f"{option} is supported by algorithm='fa2' only, got algorithm='{algorithm}'"):
        cuflash.attention(q, k, v, algorithm=algorithm, **options)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=f"{option} is supported by algorithm='fa2'"):
        cuflash.attention_backward(dout, q, k, v, out, lse, algorithm=algorithm, **options)


@pytest.mark.parametrize("dtype, window", [("float16", (40, 24)), ("float32", (3, 70)), ("bfloat16", (60, 0))])
def test_block_skipping_covers_both_sides_of_the_band(dtype, window):
    """The kernels read only the K/V (forward) and Q/dO (backward) blocks the band touches: the simulator's traffic
    equals the tile formula, and a narrow band reads a fraction of what the full mask reads."""
    shape = (1, 600, 640, 2, 1, 64)
    q, k, v, dout = random_inputs(shape, dtype, seed=5)
    family = fa2 if dtype == "float32" else fa2_tc
    problem = Problem(dtype, 1, 600, 640, 2, 1, 64, mask=Mask(*window), deterministic=True)
    full = Problem(dtype, 1, 600, 640, 2, 1, 64)
    sm80 = target("sm_80")
    with sim.record() as records:
        out, lse = cuflash.attention(q, k, v, window_size=window, return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse, window_size=window, deterministic=True)
    measured = [(r.global_bytes_read, r.global_bytes_written) for r in records.launches]
    expected_forward = tuple(family.forward_traffic(problem, sm80))
    expected_backward = [tuple(t) for plan, t in zip(plans.backward_program("fa2", problem, sm80).launches,
                                                     family.backward_traffic(problem, sm80)) if not plan.is_empty]
    assert measured == [expected_forward] + expected_backward
    assert expected_forward[0] < 0.45 * family.forward_traffic(full, sm80)[0]


def test_window_size_normalizes_bounds_no_row_reaches():
    """left >= seqlen_k and right >= seqlen_q reach past every key: the same as unbounded, planned as such."""
    assert V.check_mask(False, (12, 9), 9, 12) == Mask()
    assert V.check_mask(False, (11, 8), 9, 12) == Mask(11, 8)
    assert V.check_mask(True, (2**40, 5), 9, 12) == Mask(-1, 0)
    shape = (1, 9, 12, 1, 1, 8)
    q, k, v, _ = random_inputs(shape, "float32", seed=0)
    assert np.array_equal(cuflash.attention(q, k, v, window_size=(12, 9)), cuflash.attention(q, k, v))


# ---------------------------------------------------------------------------
# The reference against oracles nobody here wrote.

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _alibi_bias(slopes, batch, nheads, seqlen_q, seqlen_k):
    """-slope * |i + off - j| as JAX's additive bias (batch, nheads, seqlen_q, seqlen_k), written from the formula."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    distance = np.abs(i + (seqlen_k - seqlen_q) - j)
    return -np.broadcast_to(slopes, (batch, nheads))[:, :, None, None] * distance


def _band(seqlen_q, seqlen_k, left, right):
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    return ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))


@pytest.mark.parametrize("window, use_alibi", [((4, 2), False), ((-1, 0), True), ((7, -1), True), ((-1, -1), True)])
def test_reference_equals_jax_dot_product_attention(window, use_alibi):
    """Rows that see a key: out equals jax.nn.dot_product_attention (XLA, float32) fed the band as a mask and ALiBi
    as a bias, to float32 accuracy."""
    shape = (2, 23, 31, 4, 2, 16)
    q, k, v, _ = random_inputs(shape, "float32", seed=9)
    slopes = _slopes(shape, True, 2) if use_alibi else None
    out, _ = attention_reference(q, k, v, window_size=window, alibi_slopes=slopes)
    mask = _band(23, 31, *window)[None, None]
    bias = _alibi_bias(slopes, 2, 4, 23, 31).astype(np.float32) if use_alibi else None
    expected = jax.nn.dot_product_attention(q, np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2), bias=bias, mask=mask,
                                            implementation="xla")
    seen = mask[0, 0].any(axis=1)
    np.testing.assert_allclose(out[:, seen], np.asarray(expected)[:, seen], rtol=2e-5, atol=2e-6)


def test_reference_gradients_equal_jax_autodiff_of_softcapped_attention():
    """softcap + ALiBi + window: the reference's hand-derived gradients (dS through tanh) equal JAX autodiff of a
    plain jnp attention (float32, to float32 accuracy)."""
    shape = (1, 19, 26, 2, 1, 8)
    q, k, v, dout = random_inputs(shape, "float32", seed=4)
    slopes = _slopes(shape, False, 3)
    options = dict(window_size=(6, 3), softcap=2.0, alibi_slopes=slopes, softmax_scale=0.7)
    mask = _band(19, 26, 6, 3)
    bias = _alibi_bias(slopes, 1, 2, 19, 26)[0].astype(np.float32)

    def attention(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.7
        s = 2.0 * jnp.tanh(s / 2.0) + bias
        s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    out, vjp = jax.vjp(attention, q, k, v)
    expected = vjp(dout)
    out_ref, _ = attention_reference(q, k, v, **options)
    np.testing.assert_allclose(out_ref, np.asarray(out), rtol=2e-5, atol=2e-6)
    for got, want in zip(attention_backward_reference(dout, q, k, v, **options), expected):
        np.testing.assert_allclose(got, np.asarray(want), rtol=5e-5, atol=5e-6)
