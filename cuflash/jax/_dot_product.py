"""``cuflash.jax.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and semantics on cuflash.

What cuflash covers runs on its kernels; anything else falls back to ``jax.nn.dot_product_attention`` itself, with a
warning said once per reason. Covered:

- no ``bias`` and no ``mask``; no ``implementation`` asked for; float16, bfloat16 or float32; head dim 1..256;
- ``is_causal`` and ``local_window_size``, which jax.nn aligns top-left (query i sees key j iff j <= i, and
  i - left <= j <= i + right): cuflash's windows are aligned bottom-right (off = seqlen_k - seqlen_q), so the band
  is shifted by off; this is exact whenever both shifted bounds are >= 0 (always when seqlen_q == seqlen_k);
- ``query_seq_lengths`` / ``key_value_seq_lengths`` (padding) without a causal mask or window: the valid rows are
  packed and run as varlen (cuflash.jax.attention_varlen), padded query rows get 0 as in jax.nn;
- ``return_residual``: the log-sum-exp of each query row, (batch, seqlen_q, nheads) float32 as jax.nn gives it;
- ``bias`` and a boolean ``mask`` (broadcastable to (B, N, T, S), 4-D inputs, no sequence lengths, no
  return_residual) run as cuflash.jax.flex_attention (_flex_call): the bias is a side array a score_mod adds to the
  scaled score, as jax.nn adds it to the scaled logits (its gradient, summed over broadcast dims, comes from the
  backward's side gradients), the mask (with is_causal / local_window_size, top-left as jax.nn) a mask_mod, with a
  block mask built on the host when the mask is concrete (traced: the mask_mod runs on every score).

A row that sees no key gets 0 (jax.nn's XLA path averages the values there), except on the bias / mask path, which
matches jax.nn there too: jax.nn sets masked logits to one large negative number, so such a row's softmax is uniform
and its output the mean of the values over all keys (gradients: dv gets dout / S per key, nothing else).
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
    if implementation is not None:
        return _fallback(f"implementation={implementation!r} is not covered", *args, **kwargs)
    shape = tuple(getattr(query, "shape", ()))
    if bias is not None or mask is not None:
        lengths = query_seq_lengths is not None or key_value_seq_lengths is not None
        if len(shape) != 4 or lengths or return_residual:
            return _fallback("a bias or mask with 3-D inputs, sequence lengths or return_residual is not covered",
                             *args, **kwargs)
        return _flex_call(query, key, value, bias, mask, scale, is_causal, local_window_size)
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


def _replicated(array: Any) -> Any:
    """``array`` whole on every device where its type says it is sharded (an Explicit mesh): a mod reads it by
    scalar indices, which such an array refuses (dynamic_slice on a sharded dim), and a sharded flex call replicates
    its side arrays anyway (_partitioning.py)."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    if any(axis is not None for axis in getattr(sharding, "spec", ())):
        return jax.sharding.reshard(array, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    return array


def _broadcast_index(name: str, array: Any, full: tuple[int, ...]):
    """The array as jax.nn broadcasts it to (B, N, T, S), and an indexer of it by (b, h, q_idx, kv_idx): 0 along
    its dims of extent 1 (so a mod reads it unbroadcast, and its gradient sums over those dims as jax.nn's does)."""
    shape = tuple(np.shape(array))
    if len(shape) > 4:
        raise ValueError(f"{name} must broadcast to (B, N, T, S) = {full}, got shape {shape}")
    shape = (1,) * (4 - len(shape)) + shape
    for extent, want in zip(shape, full):
        if extent not in (1, want):
            raise ValueError(f"{name} must broadcast to (B, N, T, S) = {full}, got shape {np.shape(array)}")
    array = _replicated(jnp.reshape(array, shape))

    def read(table, b, h, q_idx, kv_idx):
        at = tuple(0 if extent == 1 else i for extent, i in zip(shape, (b, h, q_idx, kv_idx)))
        return jnp.asarray(table)[at]  # a NumPy mask (jnp.reshape under jit keeps it one) indexed by traced scalars

    return array, read


def _flex_call(query, key, value, bias, mask, scale, is_causal, local_window_size):
    """jax.nn.dot_product_attention with a bias and / or a boolean mask as cuflash.jax.flex_attention (module
    docstring): bias a score_mod, mask (and the band) a mask_mod with a block mask when concrete."""
    from ..flex import create_block_mask
    from ._flex import flex_attention

    batch, seqlen_q, nheads, _ = query.shape
    seqlen_k, nheads_k = key.shape[1], key.shape[2]
    full = (batch, nheads, seqlen_q, seqlen_k)
    score_mod = mask_mod = block_mask = None
    if bias is not None:
        bias, read_bias = _broadcast_index("bias", bias, full)

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + read_bias(bias, b, h, q_idx, kv_idx).astype(jnp.float32)

        score_mod = add_bias
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    left, right = local_window_size if local_window_size is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    keep = None
    if mask is not None:
        if jnp.asarray(mask).dtype != np.bool_:
            raise TypeError(f"mask must be boolean, got {jnp.asarray(mask).dtype}")
        keep, read_mask = _broadcast_index("mask", mask, full)
    if keep is not None or left is not None or right is not None:
        def visible(b, h, q_idx, kv_idx):  # jax.nn's mask, causal and window (top-left: key j for query i)
            seen = read_mask(keep, b, h, q_idx, kv_idx) if keep is not None else q_idx >= 0
            if left is not None:
                seen = seen & (kv_idx >= q_idx - left)
            if right is not None:
                seen = seen & (kv_idx <= q_idx + right)
            return seen

        mask_mod = visible
        if not isinstance(keep, jax.core.Tracer):  # a host block mask: the kernels skip what it hides
            mask_batch, mask_heads = (keep.shape[:2] if keep is not None else (1, 1))
            block_mask = create_block_mask(visible, None if mask_batch == 1 else batch,
                                           None if mask_heads == 1 else nheads, seqlen_q, seqlen_k)
    out = flex_attention(query, key, value, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                         softmax_scale=scale)
    if mask_mod is None:
        return out
    # Rows that see no key: jax.nn's uniform softmax over its equal large negative logits, the mean of the values.
    rows = jnp.arange(seqlen_q)[:, None]
    cols = jnp.arange(seqlen_k)[None, :]
    seen = jnp.ones(full, bool) if keep is None else jnp.broadcast_to(keep, full)
    if left is not None:
        seen = seen & (cols >= rows - left)
    if right is not None:
        seen = seen & (cols <= rows + right)
    empty = ~seen.any(axis=-1)  # (B, N, T)
    mean = jnp.mean(value.astype(jnp.float32), axis=1).astype(value.dtype)  # (B, K, H)
    mean = jnp.repeat(mean, nheads // nheads_k, axis=1)  # query head n reads kv head n // group, as jax.nn
    return jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean[:, None], out)
