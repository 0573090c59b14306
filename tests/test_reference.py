"""The float64 reference checked against implementations nobody on this project wrote, and the tolerance rule.

Oracles:
* ``jax.nn.dot_product_attention`` (XLA implementation, layout B,T,N,H) for the forward and LSE, and
  ``jax.grad`` through it for the backward. Three facts about it shape the comparisons below:
  - Its ``is_causal`` is aligned to the top-left corner, so the bottom-right mask is passed as ``mask=``.
  - It always runs the softmax in float32 (even with float64 inputs under x64), so it agrees with a float64
    reference only to float32 roundoff: ~1e-7 relative. Mask, GQA-mapping or scale mistakes cost >= 1e-3.
  - A row whose mask is all False gets a large negative *finite* logit everywhere, so jax returns the uniform
    average of all of V for it, an LSE near -2.4e38 instead of -inf, and gradients flowing through that
    uniform softmax. FlashAttention returns 0 / -inf / zero gradient. Rows that see no key are therefore
    checked against the documented values directly and excluded from (or given zero dout in) jax comparisons.
* Central finite differences of the reference's own forward, for the backward at float64 accuracy.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cuflash._tolerance import (
    BACKWARD_FACTOR,
    FORWARD_FACTOR,
    backward_references,
    check_close,
    forward_references,
    low_precision_dtype,
)
import cuflash.reference as reference_module
from cuflash.reference import attention_backward_reference, attention_reference

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

# Agreement demanded from jax, relative to the largest reference magnitude. jax's float32 softmax gives
# about 1e-7 on these shapes; 2e-6 leaves margin for that and none for a real mistake.
JAX_RELATIVE_TOLERANCE = 2e-6


def _visible(seqlen_q: int, seqlen_k: int, causal: bool) -> np.ndarray:
    """Bottom-right aligned causal mask, written independently of the reference's own helper."""
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if causal:
        for i in range(seqlen_q):
            last_key = i + seqlen_k - seqlen_q  # inclusive
            visible[i, max(last_key + 1, 0):] = False
    return visible


def _inputs(seed, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    dout = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    return q, k, v, dout


def _assert_near_jax(name, ours, theirs):
    ours = np.asarray(ours, dtype=np.float64)
    theirs = np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
    assert np.all(np.isfinite(ours)), f"{name}: reference has non-finite values"
    if ours.size == 0:
        return
    error = np.max(np.abs(ours - theirs))
    scale = max(np.max(np.abs(theirs)), np.max(np.abs(ours)))
    # The absolute 1e-12 covers gradients that are exactly 0 in exact arithmetic (seqlen_k == 1 makes dq
    # vanish) where jax leaves float64 rounding noise.
    bound = JAX_RELATIVE_TOLERANCE * scale + 1e-12
    assert error <= bound, f"{name}: max |ours - jax| = {error:.3g}, scale {scale:.3g}"


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, softmax_scale)
JAX_CASES = [
    pytest.param(2, 113, 203, 4, 4, 40, False, None, id="113x203-d40"),
    pytest.param(2, 113, 203, 4, 4, 40, True, None, id="113x203-d40-causal"),
    pytest.param(1, 1, 239, 2, 2, 59, True, None, id="1x239-d59-causal"),
    pytest.param(1, 239, 1, 2, 2, 59, False, None, id="239x1-d59"),
    pytest.param(1, 239, 1, 2, 2, 59, True, None, id="239x1-d59-causal-one-row-sees-the-key"),
    pytest.param(1, 203, 113, 6, 2, 128, True, None, id="203x113-d128-gqa-causal-empty-rows"),
    pytest.param(1, 113, 203, 6, 2, 128, False, None, id="113x203-d128-gqa"),
    pytest.param(2, 113, 203, 4, 1, 59, True, None, id="113x203-d59-mqa-causal"),
    pytest.param(1, 113, 203, 4, 1, 128, False, 0.37, id="113x203-d128-mqa-scale0.37"),
    pytest.param(1, 97, 97, 3, 3, 40, True, 1.3, id="97x97-d40-causal-scale1.3"),
]


def _jax_forward_and_grads(q, k, v, dout, visible, softmax_scale):
    """jax output (B,T,N,H), LSE transposed to (B,N,T), and grads of sum(out * dout), all in float64.

    Jitted as a whole: op-by-op eager execution compiles every primitive for every new shape, which costs
    seconds per case here.
    """
    with jax.enable_x64(True):

        @jax.jit
        def run(qx, kx, vx, doutx, mask):
            def attend(qa, ka, va):
                return jax.nn.dot_product_attention(qa, ka, va, mask=mask, scale=softmax_scale, return_residual=True)

            out, lse = attend(qx, kx, vx)
            grads = jax.grad(lambda *qkv: jnp.sum(attend(*qkv)[0] * doutx), argnums=(0, 1, 2))(qx, kx, vx)
            return out, lse, grads

        args = [jnp.asarray(x, dtype=jnp.float64) for x in (q, k, v, dout)]
        out, lse, grads = run(*args, jnp.asarray(visible)[None, None])  # the mask broadcasts over (B, N, T, S)
        assert out.dtype == jnp.float64
        return np.asarray(out), np.asarray(lse).transpose(0, 2, 1), tuple(np.asarray(g) for g in grads)


@functools.lru_cache(maxsize=None)
def _jax_case(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, softmax_scale):
    """Inputs of one case and jax's answers on them, shared by its forward and backward tests.

    dout is zero on rows that see no key. Those rows then contribute nothing to jax's gradients (its uniform
    softmax there is multiplied by zero), so every gradient entry is comparable with FlashAttention's.
    """
    q, k, v, dout = _inputs(1, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    visible = _visible(seqlen_q, seqlen_k, causal)
    sees_a_key = visible.any(axis=1)
    dout = np.where(sees_a_key[None, :, None, None], dout, 0.0)
    return (q, k, v, dout), sees_a_key, _jax_forward_and_grads(q, k, v, dout, visible, softmax_scale)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_k,headdim,causal,softmax_scale", JAX_CASES)
def test_forward_matches_jax(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, softmax_scale):
    (q, k, v, _), sees_a_key, (out_jax, lse_jax, _) = _jax_case(
        batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, softmax_scale
    )
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.dtype == np.float64 and out.shape == q.shape
    assert lse.dtype == np.float64 and lse.shape == (batch, nheads, seqlen_q)

    _assert_near_jax("out", out[:, sees_a_key], out_jax[:, sees_a_key])
    _assert_near_jax("lse", lse[:, :, sees_a_key], lse_jax[:, :, sees_a_key])

    # Rows that see no key: FlashAttention's convention, not jax's uniform average.
    assert np.all(out[:, ~sees_a_key] == 0.0)
    assert np.all(lse[:, :, ~sees_a_key] == -np.inf)
    if causal and seqlen_q > seqlen_k:
        assert (~sees_a_key).sum() == seqlen_q - seqlen_k


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_k,headdim,causal,softmax_scale", JAX_CASES)
def test_backward_matches_jax(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, softmax_scale):
    (q, k, v, dout), _, (_, _, grads_jax) = _jax_case(
        batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, softmax_scale
    )
    grads = attention_backward_reference(dout, q, k, v, causal=causal, softmax_scale=softmax_scale)
    for name, grad, like, grad_jax in zip(("dq", "dk", "dv"), grads, (q, k, v), grads_jax):
        assert grad.dtype == np.float64 and grad.shape == like.shape
        _assert_near_jax(name, grad, grad_jax)


def _loss(dout, q, k, v, causal, softmax_scale):
    out, _ = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return float(np.sum(out * dout))


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_finite_differences(causal):
    # GQA with seqlen_q > seqlen_k so the causal case has rows that see no key.
    q, k, v, dout = _inputs(3, 1, 9, 6, 4, 2, 5)
    dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=causal, softmax_scale=0.6)
    rng = np.random.default_rng(4)
    step = 1e-5
    for index, grad in enumerate((dq, dk, dv)):
        direction = rng.standard_normal(grad.shape)
        plus = [q, k, v]
        minus = [q, k, v]
        plus[index] = plus[index] + step * direction
        minus[index] = minus[index] - step * direction
        numeric = (_loss(dout, *plus, causal, 0.6) - _loss(dout, *minus, causal, 0.6)) / (2 * step)
        analytic = float(np.sum(grad * direction))
        assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), ("qkv"[index], numeric, analytic)


def test_rows_without_keys_give_zero_gradient_and_no_nan():
    q, k, v, dout = _inputs(5, 2, 40, 7, 4, 2, 16)
    sees_a_key = _visible(40, 7, True).any(axis=1)
    dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=True)
    assert all(not np.any(np.isnan(g)) for g in (dq, dk, dv))
    assert np.all(dq[:, ~sees_a_key] == 0.0) and np.any(dq[:, sees_a_key] != 0.0)
    dout_on_seeing_rows = np.where(sees_a_key[None, :, None, None], dout, 0.0)
    _, dk_masked, dv_masked = attention_backward_reference(dout_on_seeing_rows, q, k, v, causal=True)
    np.testing.assert_array_equal(dk, dk_masked)
    np.testing.assert_array_equal(dv, dv_masked)


def test_row_blocking_changes_nothing(monkeypatch):
    # The reference forms at most _BLOCK_ELEMENTS scores at once; forcing blocks of a few rows (not dividing
    # seqlen_q) must give the same answers up to float64 summation order in dk/dv.
    q, k, v, dout = _inputs(11, 2, 37, 29, 4, 2, 16)
    whole = [attention_reference(q, k, v, causal=True), attention_backward_reference(dout, q, k, v, causal=True)]
    monkeypatch.setattr(reference_module, "_BLOCK_ELEMENTS", 2 * 29 * 5)  # group 2 x seqlen_k 29 x 5 rows
    blocked = [attention_reference(q, k, v, causal=True), attention_backward_reference(dout, q, k, v, causal=True)]
    for a, b in zip([*whole[0], *whole[1]], [*blocked[0], *blocked[1]]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "batch,seqlen_q,seqlen_k,nheads,nheads_k",
    [(2, 0, 5, 2, 1), (2, 5, 0, 2, 1), (0, 5, 5, 2, 1), (2, 5, 5, 0, 0), (2, 5, 5, 0, 2)],
    ids=["seqlen_q=0", "seqlen_k=0", "batch=0", "nheads=0", "nheads=0-with-kv-heads"],
)
def test_empty_dimensions(batch, seqlen_q, seqlen_k, nheads, nheads_k):
    q, k, v, dout = _inputs(6, batch, seqlen_q, seqlen_k, nheads, nheads_k, 8)
    for dtype in (np.float64, np.float16):
        for causal in (False, True):
            out, lse = attention_reference(q, k, v, causal=causal, dtype=dtype)
            assert out.shape == q.shape and out.dtype == dtype
            assert lse.shape == (batch, nheads, seqlen_q)
            # seqlen_k == 0: every row sees no key.
            assert np.all(out == 0.0) and np.all(lse == -np.inf)
            dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=causal, dtype=dtype)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
            assert all(np.all(g == 0.0) for g in (dq, dk, dv))


def test_rejects_inconsistent_shapes_and_dtypes():
    q, k, v, dout = _inputs(7, 1, 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention_reference(q, k, v)
    q, k, v, dout = _inputs(7, 1, 4, 4, 4, 2, 8)
    with pytest.raises(ValueError, match="v must have k's shape but for the head dim"):
        attention_reference(q, k, v[:, :2])
    with pytest.raises(ValueError, match="head dim"):
        attention_reference(q[..., :4], k, v)
    with pytest.raises(ValueError, match="dout"):
        attention_backward_reference(dout[:, :2], q, k, v)
    with pytest.raises(ValueError, match="unsupported dtype"):
        attention_reference(q, k, v, dtype=np.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_emulation_is_close_but_not_exact(causal):
    q, k, v, dout = _inputs(8, 2, 113, 203, 4, 2, 64)
    out, lse = attention_reference(q, k, v, causal=causal)
    grads = attention_backward_reference(dout, q, k, v, causal=causal)
    errors = {}
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        out_lp, lse_lp = attention_reference(q, k, v, causal=causal, dtype=dtype)
        assert out_lp.dtype == dtype and lse_lp.dtype == np.float32
        grads_lp = attention_backward_reference(dout, q, k, v, causal=causal, dtype=dtype)
        assert all(g.dtype == dtype for g in grads_lp)
        errors[np.dtype(dtype).name] = [
            float(np.max(np.abs(a.astype(np.float64) - b)))
            for a, b in zip((out_lp, lse_lp, *grads_lp), (out, lse, *grads))
        ]
    for name, errs in errors.items():
        assert all(e > 0 for e in errs), (name, errs)
    assert all(e < 1e-5 for e in errors["float32"]), errors
    assert all(e < 1e-2 for e in errors["float16"]), errors
    assert all(e < 5e-2 for e in errors["bfloat16"]), errors
    # bfloat16 keeps 8 significand bits to float16's 11: its emulation must be the coarser one.
    assert all(b > h for b, h in zip(errors["bfloat16"], errors["float16"])), errors


def test_low_precision_emulation_rounds_inputs():
    # Inputs already in float16 give the same result whether passed as float16 or as their float64 values.
    q, k, v, _ = _inputs(9, 1, 17, 23, 2, 1, 24)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    from_f16 = attention_reference(q16, k16, v16, dtype=np.float16)
    from_f64 = attention_reference(*(x.astype(np.float64) for x in (q16, k16, v16)), dtype=np.float16)
    from_unrounded = attention_reference(q, k, v, dtype=np.float16)
    for a, b, c in zip(from_f16, from_f64, from_unrounded):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_low_precision_emulation_rounds_scores_and_probabilities():
    # Hand-built float16 cases, headdim 1 and scale 1, where each rounding the emulation promises shows.
    one_query = np.ones((1, 1, 1, 1))
    # Scores: 1.25 * 801.5 = 1001.875 is not a float16 (spacing 0.5 there) and rounds to 1002, so the two
    # logits differ by 2.0 instead of 1.875 and the output is sigmoid(2.0), not sigmoid(1.875).
    q = 1.25 * one_query
    k = np.array([801.5, 800.0]).reshape(1, 2, 1, 1)
    v = np.array([1.0, 0.0]).reshape(1, 2, 1, 1)
    out64, _ = attention_reference(q, k, v)
    out16, _ = attention_reference(q, k, v, dtype=np.float16)
    assert out64.item() == pytest.approx(1.0 / (1.0 + np.exp(-1.875)), rel=1e-12)
    assert out16.item() == np.float16(1.0 / (1.0 + np.exp(-2.0)))
    # Probabilities: eleven equal scores give P = float16(1/11) each, and eleven of those against v = 1 sum
    # to 1 - 5 * 2**-14, which rounds to the float16 below 1 instead of to 1.
    k = np.zeros((1, 11, 1, 1))
    v = np.ones((1, 11, 1, 1))
    out16, _ = attention_reference(one_query, k, v, dtype=np.float16)
    assert out16.item() == np.float16(11 * np.float64(np.float16(1.0 / 11.0))) == 1.0 - 2.0**-11
    assert attention_reference(one_query, k, v)[0].item() == pytest.approx(1.0, rel=1e-15)


# --- check_close -------------------------------------------------------------------------------------------


def _fp16_problem(causal=True):
    q, k, v, dout = _inputs(10, 1, 50, 40, 2, 1, 32)
    q, k, v, dout = (x.astype(np.float16) for x in (q, k, v, dout))
    return q, k, v, dout, forward_references(q, k, v, causal=causal)


def test_check_close_accepts_the_low_precision_result_and_reports_numbers():
    _, _, _, _, refs = _fp16_problem()
    result = check_close("out", refs.out_lowp, refs.out, refs.out_lowp, FORWARD_FACTOR)
    assert 0 < result.max_error == result.lowp_error < result.bound
    check_close("lse", refs.lse_lowp, refs.lse, refs.lse_lowp, FORWARD_FACTOR)  # -inf rows match exactly


def test_check_close_rejects_error_beyond_the_bound():
    _, _, _, _, refs = _fp16_problem()
    lowp_error = np.max(np.abs(refs.out_lowp.astype(np.float64) - refs.out))
    too_far = refs.out.copy()
    too_far[0, 45, 1, 7] += 2.5 * lowp_error
    with pytest.raises(AssertionError) as info:
        check_close("out", too_far, refs.out, refs.out_lowp, FORWARD_FACTOR)
    message = str(info.value)
    assert "out" in message and "max error" in message and "bound" in message and "(0, 45, 1, 7)" in message
    # atol widens the bound by exactly what it says.
    check_close("out", too_far, refs.out, refs.out_lowp, FORWARD_FACTOR, atol=0.6 * lowp_error)


def test_check_close_catches_an_off_by_one_causal_mask():
    # A realistic kernel bug: top-left instead of bottom-right alignment.
    q, k, v, _, refs = _fp16_problem()
    top_left = np.ones((50, 40), dtype=bool)
    top_left[np.triu_indices(50, 1, 40)] = False
    with jax.enable_x64(True):
        wrong = np.asarray(
            jax.nn.dot_product_attention(
                jnp.asarray(q, jnp.float64), jnp.asarray(k, jnp.float64), jnp.asarray(v, jnp.float64),
                mask=jnp.asarray(top_left)[None, None],
            )
        )
    with pytest.raises(AssertionError, match="max error"):
        check_close("out", wrong, refs.out, refs.out_lowp, FORWARD_FACTOR)


def test_check_close_special_values():
    _, _, _, _, refs = _fp16_problem()
    empty_row = np.argwhere(refs.lse == -np.inf)[0]
    lse = refs.lse_lowp.copy()
    lse[tuple(empty_row)] = np.float32(-1e30)  # finite where -inf is required
    with pytest.raises(AssertionError, match="non-finite"):
        check_close("lse", lse, refs.lse, refs.lse_lowp, FORWARD_FACTOR)
    out = refs.out_lowp.astype(np.float32)
    out[0, 49, 0, 0] = np.nan
    with pytest.raises(AssertionError, match="non-finite"):
        check_close("out", out, refs.out, refs.out_lowp, FORWARD_FACTOR)
    with pytest.raises(AssertionError, match="shape"):
        check_close("out", out[:, :10], refs.out, refs.out_lowp, FORWARD_FACTOR)


def test_check_close_float32_floor():
    # float32 yardstick equal to the reference: a one-ulp difference from reordering must pass, a
    # hundred-ulp one must not.
    ref = np.linspace(-3.0, 3.0, 101).astype(np.float32).astype(np.float64)
    lowp = ref.astype(np.float32)
    one_ulp = np.nextafter(lowp, np.float32(np.inf))
    check_close("x", one_ulp, ref, lowp, FORWARD_FACTOR)
    hundred_ulps = lowp + 100 * np.spacing(lowp)
    with pytest.raises(AssertionError):
        check_close("x", hundred_ulps, ref, lowp, FORWARD_FACTOR)


def test_backward_references_apply_the_rule():
    q, k, v, dout, _ = _fp16_problem()
    refs = backward_references(dout, q, k, v, causal=True)
    assert low_precision_dtype(q.dtype) == np.float16 and refs.dq_lowp.dtype == np.float16
    # Gradients of the non-causal problem are a different answer and must not pass as this one.
    other = backward_references(dout, q, k, v, causal=False)
    for name in ("dq", "dk", "dv"):
        ref, lowp = getattr(refs, name), getattr(refs, name + "_lowp")
        check_close(name, lowp, ref, lowp, BACKWARD_FACTOR, atol=1e-5)
        with pytest.raises(AssertionError, match=name):
            check_close(name, getattr(other, name + "_lowp"), ref, lowp, BACKWARD_FACTOR, atol=1e-5)
