"""``cuflash.jax.attention``: the library's kernels as a differentiable JAX function."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .. import _validation as V
from ..kernels import catalog
from ._primitives import CallConfig, attention_backward_p, attention_forward_p, tensor_shape


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
    deterministic: bool = False,
) -> Any:
    """Scaled dot-product attention softmax(scale * q k^T) v on JAX arrays, through cuflash's kernels.

    The layout, dtypes, masking and return values are those of ``cuflash.attention``:
    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA); float16, bfloat16 or float32; head dim
    1..256. ``causal`` aligns the mask to the bottom-right corner (query i sees key j
    iff j <= i + seqlen_k - seqlen_q); a row that sees no key gives 0 and lse -inf.
    ``softmax_scale`` (a Python number, static) defaults to 1/sqrt(headdim).
    ``window_size`` and ``softcap`` (static) and ``alibi_slopes`` (a float32 array,
    (nheads,) or (batch, nheads); no gradient flows to it) mean what they mean for
    ``cuflash.attention``. Returns out, or (out, lse) with lse float32 (batch, nheads, seqlen_q).

    Arguments are checked when the call is traced, with the same checks and messages
    as ``cuflash.attention``. Works under ``jit``, ``grad``/``vjp`` (the backward runs
    the library's backward kernels on saved q, k, v, out, lse; the gradient through
    lse is exact too), ``vmap`` (the mapped axis is folded into the batch so one
    launch covers it) and ``shard_map`` (outputs vary along the inputs' mesh axes).
    ``deterministic=True`` asks the backward for bitwise-reproducible gradients.

    Runs on the CPU (the simulator: every CUDA thread a fiber; slow, exact to the
    CUDA programming model) and on CUDA GPUs (CUBINs from NVRTC, launched on XLA's
    stream). The XLA FFI handlers are built with cffi at first use and cached under
    ``cuflash._paths.cache_dir("jax_ffi")``.
    """
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(array).__name__}")
    # Checked on the caller's dtypes, before jnp.asarray could narrow e.g. float64 to float32.
    problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes, deterministic=deterministic)
    scale = V.check_softmax_scale(softmax_scale, problem.headdim)
    return_lse = V.check_bool("return_lse", return_lse)
    catalog.check_options(algorithm, problem)  # unknown algorithm or option
    arrays = (q, k, v) if alibi_slopes is None else (q, k, v, alibi_slopes)
    q, k, v, *slopes = _share_varying_axes(*(jnp.asarray(x) for x in arrays))
    out, lse = _attention(CallConfig(algorithm, problem, scale), q, k, v, tuple(slopes))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# shard_map: values carry the mesh axes they vary along. The custom calls'
# outputs are derived from all inputs, so they vary along the union of the
# inputs' axes; inputs are first cast to that union (outside the custom_vjp, so
# autodiff transposes the cast into the psum a replicated input's gradient needs).


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # older JAX spelling
    if vma is None:
        manual = getattr(aval, "manual_axis_type", None)
        vma = getattr(manual, "varying", frozenset()) if manual is not None else frozenset()
    return frozenset(vma)


def _mark_varying(x, axes: frozenset):
    missing = tuple(sorted(axes - _varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _share_varying_axes(*arrays):
    axes = frozenset().union(*(_varying_axes(x) for x in arrays))
    return tuple(_mark_varying(x, axes) for x in arrays)


# ---------------------------------------------------------------------------
# The two directions, with the no-launch cases of cuflash.attention handled at trace time.


def _forward(config: CallConfig, q, k, v, slopes=()):
    problem = config.problem
    axes = _varying_axes(q)
    out_shape = tensor_shape("out", problem)
    if problem.seqlen_k == 0 or 0 in out_shape:
        # No key at all: every row sees no key (the kernels' rule, without a launch).
        out = jnp.zeros(out_shape, q.dtype)
        lse = jnp.full(tensor_shape("lse", problem), -np.inf, jnp.float32)
    else:
        out, lse = attention_forward_p.bind(q, k, v, *slopes, config=config)
    return _mark_varying(out, axes), _mark_varying(lse, axes)


def _backward(config: CallConfig, dout, q, k, v, out, lse, slopes=(), dlse=None):
    problem = config.problem
    axes = _varying_axes(q)
    if problem.seqlen_k == 0 or problem.seqlen_q == 0 or 0 in tensor_shape("out", problem):
        grads = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype))
    else:
        extra = (*slopes,) if dlse is None else (*slopes, dlse.astype(jnp.float32))
        config = dataclasses.replace(config, with_dlse=dlse is not None)
        grads = attention_backward_p.bind(dout.astype(q.dtype), q, k, v, out, lse, *extra, config=config)
    return tuple(_mark_varying(g, axes) for g in grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: CallConfig, q, k, v, slopes):
    return _forward(config, q, k, v, slopes)


def _attention_fwd(config: CallConfig, q, k, v, slopes):
    q, k, v = q.value, k.value, v.value  # CustomVJPPrimal (symbolic_zeros=True)
    slopes = tuple(s.value for s in slopes)
    out, lse = _forward(config, q, k, v, slopes)
    return (out, lse), (q, k, v, slopes, out, lse)


def _is_zero(cotangent) -> bool:
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _attention_bwd(config: CallConfig, residuals, cotangents):
    """The backward kernels with the lse's cotangent folded into D (attention_params.cuh's dlse): exact for every
    option, softcap included, at no extra launch."""
    q, k, v, slopes, out, lse = residuals
    dout, dlse = cotangents
    no_slope_gradient = tuple(jnp.zeros(s.shape, s.dtype) for s in slopes)
    if _is_zero(dout) and _is_zero(dlse):
        return (*(jnp.zeros(x.shape, x.dtype) for x in (q, k, v)), no_slope_gradient)
    dout = jnp.zeros(q.shape, q.dtype) if _is_zero(dout) else dout
    dq, dk, dv = _backward(config, dout, q, k, v, out, lse, slopes, None if _is_zero(dlse) else dlse)
    return dq, dk, dv, no_slope_gradient


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
