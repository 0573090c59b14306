"""Helpers for tests of cuflash and of code built on it (array making, dtype names)."""

from __future__ import annotations

import functools

import numpy as np

from ._dtypes import element_dtype

from .mask import Mask


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """CUDA devices visible through CuPy (0 when CuPy or a driver is missing)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return 0


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype by name; bfloat16 comes from ml_dtypes (an ImportError naming it when missing)."""
    return element_dtype(name)


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype="float32"):
    """Standard-normal q, k, v in the (batch, seqlen, heads, headdim) layout."""
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dt)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dt)
    return q, k, v


def random_inputs(shape, dtype, seed):
    """q, k, v and an upstream gradient dout for shape (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, *shape, dtype=dtype)
    dout = rng.standard_normal(q.shape).astype(numpy_dtype(dtype))
    return q, k, v, dout


def rows_without_key(seqlen_q: int, seqlen_k: int, causal: bool, window_size=(-1, -1),
                     attention_chunk: int = 0) -> np.ndarray:
    """Boolean mask of the query rows that see no key (bottom-right aligned causal mask, local window and chunks, or
    no keys at all)."""
    return Mask.of(causal, window_size, attention_chunk).policy(seqlen_q, seqlen_k).rows_without_key()
