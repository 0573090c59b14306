"""Argument checks for the public API, run before any kernel (shared by CuPy, NumPy and JAX paths).

Every error names the argument and says what was expected. The checks use only
``shape``, ``dtype`` and ``strides``, so the same function validates NumPy,
CuPy and JAX arrays (abstract values at trace time included).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .kernels.program import ELEMENT_DTYPES, Problem
from .mask import Mask

MAX_HEADDIM = 256
# gridDim.y and gridDim.z are limited to 65535 on every CUDA GPU; plans put heads and batch there.
MAX_GRID_YZ = 65535
MAX_SEQLEN = 2**31 - 1


def dtype_name(array: Any) -> str:
    return str(getattr(array.dtype, "name", array.dtype))


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool,)) and type(value).__name__ != "bool_":
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_softmax_scale(softmax_scale: Any, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, (bool, str, bytes)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return scale


def _check_4d(name: str, array: Any, layout: str) -> tuple[int, int, int, int]:
    shape = tuple(array.shape)
    if len(shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions {layout}, got shape {shape}")
    return shape  # type: ignore[return-value]


def check_qkv(q: Any, k: Any, v: Any, *, causal: Any, deterministic: Any = False) -> Problem:
    """Validate q, k, v and return the Problem they describe."""
    batch, seqlen_q, nheads, headdim = _check_4d("q", q, "(batch, seqlen_q, nheads, headdim)")
    kshape = _check_4d("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    vshape = _check_4d("v", v, "(batch, seqlen_k, nheads_k, headdim)")
    if kshape != vshape:
        raise ValueError(f"k and v must have the same shape, got k {kshape} and v {vshape}")
    kbatch, seqlen_k, nheads_k, kheaddim = kshape
    if kbatch != batch:
        raise ValueError(f"k must have the batch size of q ({batch}), got {kbatch}")
    if kheaddim != headdim:
        raise ValueError(f"k and v must have the head dim of q ({headdim}), got {kheaddim}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dim (last dimension of q) must be in 1..{MAX_HEADDIM}, got {headdim}")
    if nheads_k == 0 and nheads != 0:
        raise ValueError(f"k must have at least one head when q has {nheads}")
    if nheads_k and nheads % nheads_k:
        raise ValueError(
            f"nheads of q ({nheads}) must be a multiple of nheads_k of k and v ({nheads_k}) (GQA/MQA)"
        )
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"batch and nheads must be at most {MAX_GRID_YZ}, got {batch} and {nheads}")
    if seqlen_q > MAX_SEQLEN or seqlen_k > MAX_SEQLEN:
        raise ValueError(f"sequence lengths must be below 2**31, got {seqlen_q} and {seqlen_k}")
    dtypes = {name: dtype_name(a) for name, a in (("q", q), ("k", k), ("v", v))}
    for name, dt in dtypes.items():
        if dt not in ELEMENT_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {dt}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"q, k and v must have the same dtype, got {dtypes['q']}, {dtypes['k']}, {dtypes['v']}")
    return Problem(
        dtype=dtypes["q"],
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        headdim=headdim,
        mask=Mask.causal(check_bool("causal", causal)),
        deterministic=check_bool("deterministic", deterministic),
    )


def check_like(name: str, array: Any, like_name: str, like: Any) -> None:
    """``array`` must have the shape and dtype of ``like``."""
    if tuple(array.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(array.shape)}")
    if dtype_name(array) != dtype_name(like):
        raise TypeError(f"{name} must have the dtype of {like_name} ({dtype_name(like)}), got {dtype_name(array)}")


def check_lse(lse: Any, problem: Problem) -> None:
    expected = (problem.batch, problem.nheads, problem.seqlen_q)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {expected}, got {tuple(lse.shape)}")
    if dtype_name(lse) != "float32":
        raise TypeError(f"lse must have dtype float32, got {dtype_name(lse)}")


def needs_copy(array: Any) -> bool:
    """Kernels take (batch, row, head) strides and need the head-dim contiguous.

    Arrays whose last dimension is not contiguous, or with negative or
    non-element-multiple strides, are copied to a contiguous array (documented
    in the API): a copy costs one pass over the array, far less than attention.
    """
    itemsize = array.dtype.itemsize
    strides = tuple(array.strides)
    shape = tuple(array.shape)
    if any(s < 0 or s % itemsize for s in strides):
        return True
    return shape[-1] > 1 and strides[-1] != itemsize
