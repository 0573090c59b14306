"""FlashAttention's correctness rule, shared by every kernel test.

A kernel in precision X is judged against two references computed from the *same* inputs:

* ``ref``  - the float64 reference (``cuflash.reference`` with ``dtype=float64``);
* ``lowp`` - the same math done naively in X (``dtype=X``: inputs and intermediates rounded to X).

``max|lowp - ref|`` measures how much error precision X alone forces on a straightforward implementation. The
kernel passes when its own error is within a small factor of that:

    max|actual - ref| <= factor * max|lowp - ref| + atol + floor

FlashAttention 2's suite uses factor 2 for the forward output and 3 for gradients (plus 1e-5 absolute for
causal gradients). Its reference is float32; ours is float64, which only makes ``ref`` closer to the truth.

``floor`` exists because for float32 inputs ``lowp`` can coincide exactly with ``ref`` on some outputs (tiny
problems, exact zeros), and a bound of 0 would then demand bit-exactness from a kernel that merely sums in a
different order. It is ``2 * eps(A) * max|ref| + smallest_normal(A)`` where A is the accumulator format of
``lowp``'s precision (float32 for float16, bfloat16 and float32; float64 for float64): two units of roundoff of
the largest reference value in the format sums run in (what one reordered sum may legitimately change), plus the
smallest normal float32, so a GPU flushing a float32 subnormal to zero is not a failure. For float16/bfloat16
this is four orders of magnitude below the bound the low-precision error gives.

Non-finite values are compared by position first: where the reference is ``-inf`` (the LSE of a row that sees
no key) the kernel must write exactly ``-inf``; anywhere else it must write a finite number.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cuflash.sinks import sink_gradient
from cuflash.reference import (accumulator_dtype, attention_backward_reference, attention_reference,
                               attention_varlen_backward_reference, attention_varlen_reference, resolve_dtype)

__all__ = [
    "CloseCheck",
    "check_close",
    "low_precision_dtype",
    "forward_references",
    "backward_references",
    "FORWARD_FACTOR",
    "BACKWARD_FACTOR",
]

# FlashAttention 2's test factors (see the module docstring).
FORWARD_FACTOR = 2.0
BACKWARD_FACTOR = 3.0


class CloseCheck(NamedTuple):
    """What ``check_close`` measured, for logs and benchmark reports."""

    max_error: float
    bound: float
    lowp_error: float


def _as_float64(name: str, role: str, x) -> np.ndarray:
    try:
        return np.asarray(x).astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: {role} cannot be read as floating-point numbers: {exc}") from exc


def _floor(lowp_dtype: np.dtype, ref_max: float) -> float:
    try:
        accumulator = accumulator_dtype(lowp_dtype)
    except (TypeError, ValueError):  # integers or other formats a kernel never computes in
        accumulator = np.dtype(np.float64)
    info = np.finfo(accumulator)
    return 2.0 * float(info.eps) * ref_max + float(info.smallest_normal)


def check_close(name: str, actual, ref64, lowp, factor: float, atol: float = 0.0) -> CloseCheck:
    """Assert ``actual`` meets the FlashAttention rule against ``ref64`` with ``lowp`` as the precision yardstick.

    Raises AssertionError naming ``name``, the max error, the bound and where the max error occurs. Returns the
    measured numbers when it passes.
    """
    actual64 = _as_float64(name, "actual", actual)
    ref = _as_float64(name, "reference", ref64)
    low = _as_float64(name, "low-precision reference", lowp)
    if actual64.shape != ref.shape or low.shape != ref.shape:
        raise AssertionError(
            f"{name}: shape mismatch: actual {actual64.shape}, reference {ref.shape}, low-precision {low.shape}"
        )

    ref_finite = np.isfinite(ref)
    if not np.all(ref_finite == np.isfinite(low)) or not np.all(np.where(ref_finite, True, low == ref)):
        # The yardstick itself overflowed or disagrees on special values: the rule has no meaning here.
        raise ValueError(f"{name}: low-precision reference has non-finite values where the reference does not")

    wrong_special = np.where(ref_finite, ~np.isfinite(actual64), actual64 != ref)
    if np.any(wrong_special):
        first = tuple(int(i) for i in np.argwhere(wrong_special)[0])
        raise AssertionError(
            f"{name}: {int(wrong_special.sum())} non-finite mismatches; first at index {first}: "
            f"actual {actual64[first]!r}, reference {ref[first]!r}"
        )

    if ref.size == 0:
        return CloseCheck(0.0, 0.0, 0.0)
    # Special values matched above; zero them on all three sides so no inf - inf is ever formed.
    actual64, ref, low = (np.where(ref_finite, x, 0.0) for x in (actual64, ref, low))
    error = np.abs(actual64 - ref)
    lowp_error = float(np.max(np.abs(low - ref)))
    ref_max = float(np.max(np.abs(ref)))
    bound = factor * lowp_error + atol + _floor(np.asarray(lowp).dtype, ref_max)
    where = np.unravel_index(int(np.argmax(error)), error.shape)
    max_error = float(error[where])
    if not max_error <= bound:
        where = tuple(int(i) for i in where)
        raise AssertionError(
            f"{name}: max error {max_error:.6g} > bound {bound:.6g} "
            f"(= {factor} x low-precision error {lowp_error:.6g} + atol {atol:.3g} + floor) "
            f"at index {where}: actual {actual64[where]!r}, reference {ref[where]!r}, low-precision {low[where]!r}"
        )
    return CloseCheck(max_error, bound, lowp_error)


def low_precision_dtype(input_dtype) -> np.dtype:
    """The precision a kernel fed ``input_dtype`` works in, i.e. the ``dtype`` its yardstick is computed in."""
    return resolve_dtype(input_dtype)


class ForwardReferences(NamedTuple):
    out: np.ndarray  # float64
    lse: np.ndarray  # float64
    out_lowp: np.ndarray  # input precision
    lse_lowp: np.ndarray  # float32 (float64 for float64 inputs)


class BackwardReferences(NamedTuple):
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dq_lowp: np.ndarray
    dk_lowp: np.ndarray
    dv_lowp: np.ndarray
    dsinks: np.ndarray | None = None  # with sinks
    dsinks_lowp: np.ndarray | None = None


def forward_references(q, k, v, *, cu_seqlens=None, **options) -> ForwardReferences:
    """The float64 reference and its low-precision twin in q's precision, ready for ``check_close``.

    ``options``: those of ``attention_reference`` (causal, softmax_scale, window_size, softcap, alibi_slopes,
    sinks).
    ``cu_seqlens=(cu_seqlens_q, cu_seqlens_k)``: packed varlen inputs (``attention_varlen_reference``)."""
    lowp = low_precision_dtype(np.asarray(q).dtype)
    if cu_seqlens is not None:
        out, lse = attention_varlen_reference(q, k, v, *cu_seqlens, **options)
        out_lowp, lse_lowp = attention_varlen_reference(q, k, v, *cu_seqlens, **options, dtype=lowp)
    else:
        out, lse = attention_reference(q, k, v, **options)
        out_lowp, lse_lowp = attention_reference(q, k, v, **options, dtype=lowp)
    return ForwardReferences(out, lse, out_lowp, lse_lowp)


def backward_references(dout, q, k, v, *, cu_seqlens=None, **options) -> BackwardReferences:
    """Float64 gradients and their low-precision twins in q's precision, ready for ``check_close``
    (``cu_seqlens`` as for ``forward_references``).

    With sinks, ``dsinks_lowp`` is the farther from ``dsinks`` of the emulation's and of the exact formula
    -sum_rows e^{s_h - lse} rowsum(dout * out) fed the float64 output rounded to q's precision: D reads the output as
    stored, and that one rounding moves dsinks by as much as the emulation's whole error does, more or less by
    chance (a kernel cannot avoid it: it has no other output to read)."""
    lowp = low_precision_dtype(np.asarray(q).dtype)
    if cu_seqlens is not None:
        grads = attention_varlen_backward_reference(dout, q, k, v, *cu_seqlens, **options)
        grads_lowp = attention_varlen_backward_reference(dout, q, k, v, *cu_seqlens, **options, dtype=lowp)
    else:
        grads = attention_backward_reference(dout, q, k, v, **options)
        grads_lowp = attention_backward_reference(dout, q, k, v, **options, dtype=lowp)
    references = BackwardReferences(*grads[:3], *grads_lowp[:3], *grads[3:], *grads_lowp[3:])
    if options.get("sinks") is None:
        return references
    if cu_seqlens is not None:
        out, lse = attention_varlen_reference(q, k, v, *cu_seqlens, **options)
        dot = np.einsum("qhd,qhd->hq", np.asarray(dout, np.float64), _rounded(out, lowp))
    else:
        out, lse = attention_reference(q, k, v, **options)
        dot = np.einsum("bqhd,bqhd->bhq", np.asarray(dout, np.float64), _rounded(out, lowp))
    from_stored_output = sink_gradient(np.asarray(options["sinks"], np.float64), lse, dot)
    if np.max(np.abs(from_stored_output - references.dsinks)) > np.max(np.abs(references.dsinks_lowp
                                                                               - references.dsinks)):
        references = references._replace(dsinks_lowp=from_stored_output)
    return references


def _rounded(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x.astype(dtype).astype(np.float64)
