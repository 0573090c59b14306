"""``cuflash.jax.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and semantics on cuflash.

What cuflash covers runs on its kernels; anything else falls back to ``jax.nn.dot_product_attention`` itself, with a
warning said once per reason. Covered:

- no ``bias`` and no ``mask``; no ``implementation`` asked for; float16, bfloat16 or float32; head dim 1..256;
- ``is_causal`` and ``local_window_size``, which jax.nn aligns top-left (query i sees key j iff j <= i, and
  i - left <= j <= i + right): cuflash's windows are aligned bottom-right (off = seqlen_k - seqlen_q), so the band
  is shifted by off; this is exact whenever both shifted bounds are >= 0 (always when seqlen_q == seqlen_k);
- ``query_seq_lengths`` / ``key_value_seq_lengths`` (padding) without a causal mask or window: the valid rows are
  packed and run as varlen (cuflash.jax.attention_varlen), padded query rows get 0 as in jax.nn;
- ``return_residual``: the log-sum-exp of each query row, (batch, seqlen_q, nheads) float32 as jax.nn gives it.

A row that sees no key gets 0 (jax.nn's XLA path averages the values there).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .. import _validation as V
from ..kernels.program import ELEMENT_DTYPES
from ..mask import Mask
from ._attention import _call, attention

_warned: set[str] = set()


def _fallback(reason: str, *args, **kwargs):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"cuflash.jax.dot_product_attention: {reason}; running jax.nn.dot_product_attention instead",
                      stacklevel=3)
    return jax.nn.dot_product_attention(*args, **kwargs)


def band_of(local_window_size: int | tuple[int, int] | None, causal: bool, seqlen_q: int, seqlen_k: int) -> Mask | None:
    """jax.nn's (top-left) local_window_size and causal flag as cuflash's Mask, or None where it cannot be shifted."""
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    left, right = local_window_size if local_window_size is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return Mask.top_left(left, right, seqlen_q, seqlen_k)


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> Any:
    """``jax.nn.dot_product_attention`` on cuflash's kernels where they cover the call (see the module docstring);
    otherwise jax.nn's own, with a warning said once per reason. (B, T, N, H) layout, or (T, N, H) unbatched."""
    args = (query, key, value, bias, mask)
    kwargs = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                  implementation=implementation, return_residual=return_residual)
    for reason, unsupported in (("a bias", bias is not None), ("a boolean mask", mask is not None),
                                (f"implementation={implementation!r}", implementation is not None)):
        if unsupported:
            return _fallback(f"{reason} is not covered", *args, **kwargs)
    shape = tuple(getattr(query, "shape", ()))
    if len(shape) == 3:  # unbatched (T, N, H)
        out = dot_product_attention(*(x[None] for x in (query, key, value)), scale=scale, is_causal=is_causal,
                                    local_window_size=local_window_size, return_residual=return_residual)
        return jax.tree.map(lambda x: x[0], out)
    dtypes = {V.dtype_name(x) for x in (query, key, value)}
    if len(shape) != 4 or not dtypes <= set(ELEMENT_DTYPES) or len(dtypes) != 1 or not 1 <= shape[-1] <= V.MAX_HEADDIM:
        return _fallback("only 4-D (or 3-D) float16/bfloat16/float32 inputs of one dtype with head dim 1..256 are "
                         "covered", *args, **kwargs)
    mask = band_of(local_window_size, is_causal, shape[1], key.shape[1])
    if mask is None:
        return _fallback("a causal mask or local window top-left aligned with seqlen_q != seqlen_k that cuflash's "
                         "bottom-right windows cannot express", *args, **kwargs)
    window = (mask.window_left, mask.window_right)
    lengths = query_seq_lengths is not None or key_value_seq_lengths is not None
    if lengths and window != (-1, -1):
        return _fallback("sequence lengths together with a causal mask or window (jax.nn aligns them top-left per "
                         "sequence)", *args, **kwargs)
    if lengths:
        out, lse = _padded_as_varlen(query, key, value, scale, query_seq_lengths, key_value_seq_lengths)
    else:
        out, lse = attention(query, key, value, softmax_scale=scale, window_size=window, return_lse=True)
    return (out, jnp.swapaxes(lse, 1, 2)) if return_residual else out


def _padded_as_varlen(query, key, value, scale, query_seq_lengths, key_value_seq_lengths):
    """Padded (B, T, N, H) inputs with per-batch lengths: their valid rows packed (a gather of static size B * T),
    run as varlen, and scattered back (padded query rows 0, their lse -inf)."""
    batch, seqlen_q, nheads, _ = query.shape
    seqlen_k, headdim_v = key.shape[1], value.shape[-1]

    def lengths_of(lengths, seqlen):
        if lengths is None:
            return jnp.full((batch,), seqlen, jnp.int32)
        return jnp.clip(jnp.asarray(lengths, jnp.int32).reshape(batch), 0, seqlen)

    def pack(x, lengths, seqlen):
        valid = (jnp.arange(seqlen)[None, :] < lengths[:, None]).reshape(-1)
        rows = jnp.nonzero(valid, size=batch * seqlen, fill_value=batch * seqlen)[0]
        packed = jnp.take(x.reshape(batch * seqlen, *x.shape[2:]), rows, axis=0, mode="fill", fill_value=0)
        return packed, rows

    lengths_q, lengths_k = lengths_of(query_seq_lengths, seqlen_q), lengths_of(key_value_seq_lengths, seqlen_k)
    q, rows_q = pack(query, lengths_q, seqlen_q)
    k, _ = pack(key, lengths_k, seqlen_k)
    v, _ = pack(value, lengths_k, seqlen_k)
    zero = jnp.zeros((1,), jnp.int32)
    cu_q, cu_k = (jnp.concatenate([zero, jnp.cumsum(n).astype(jnp.int32)]) for n in (lengths_q, lengths_k))
    # Packed rows past the last sequence (the gather's static tail) are never read or written by the kernels.
    problem = V.varlen_problem(q, k, v, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, causal=False)
    cu_words = tuple(jax.lax.bitcast_convert_type(x, jnp.float32) for x in (cu_q, cu_k))
    out, lse = _call(problem, q, k, v, softmax_scale=scale, alibi_slopes=None, dropout_rng=None, algorithm="fa2",
                     return_lse=True, cu_words=cu_words)
    full = batch * seqlen_q
    out = jnp.zeros((full, nheads, headdim_v), query.dtype).at[rows_q].set(out, mode="drop")
    lse = jnp.full((nheads, full), -np.inf, jnp.float32).at[:, rows_q].set(lse, mode="drop")
    return out.reshape(batch, seqlen_q, nheads, headdim_v), jnp.moveaxis(lse.reshape(nheads, batch, seqlen_q), 1, 0)
