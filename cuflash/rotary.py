"""Rotary position embedding inside KV-cache decoding: FlashAttention-2's ``rotary_cos``, ``rotary_sin`` and
``rotary_interleaved`` of ``flash_attn_with_kvcache``.

What it computes: the first rotary_dim = 2 * rotary_cos.shape[1] features of q and of the new k rows are rotated
by the angle of their position p (cos = rotary_cos[p], sin = rotary_sin[p]): pairs (x1, x2) become
(x1 cos - x2 sin, x1 sin + x2 cos), in float32, rounded once to the inputs' dtype. Pairs are the two halves of
the rotary features (GPT-NeoX), or neighbours (2i, 2i + 1) with ``rotary_interleaved`` (GPT-J). New key i of
sequence b sits at position cache_seqlens[b] + i; q's rows at the same positions when the call is causal or
windowed, else all at cache_seqlens[b] (FA2's rule). Features past rotary_dim and the cached rows are untouched.

How: one small pass over q and the new rows, in the arrays' own library (NumPy, CuPy or jax.numpy, passed as
``xp``), before the append and the kernels; the cached rows are never read. One home for the rule, shared by
cuflash.attention_with_kvcache and cuflash.jax.attention_with_kvcache.
"""

from __future__ import annotations

from typing import Any

from ._validation import check_bool, dtype_name


def check_rotary(rotary_cos: Any, rotary_sin: Any, rotary_interleaved: Any, q: Any, k: Any, capacity: int) -> bool:
    """The shape and dtype checks of the rotary tables (values are never needed): whether rotary is on."""
    check_bool("rotary_interleaved", rotary_interleaved)
    if rotary_cos is None and rotary_sin is None:
        return False
    if rotary_cos is None or rotary_sin is None:
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise ValueError(f"{given} needs {missing}: pass both rotary tables or neither")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate q and the new k rows: pass k and v (FA2's rule)")
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if dtype_name(table) != dtype_name(q):
            raise TypeError(f"{name} must have q's dtype {dtype_name(q)}, got {dtype_name(table)}")
        if len(table.shape) != 2 or table.shape[1] == 0:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(table.shape)}")
    if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
        raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, got "
                         f"{tuple(rotary_sin.shape)}")
    seqlen_ro, half = rotary_cos.shape
    headdim = q.shape[-1]
    if 2 * half > headdim:
        raise ValueError(f"rotary_cos's rotary_dim / 2 = {half} rotates {2 * half} features, more than the head dim "
                         f"{headdim}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos and rotary_sin must have a row per position of the caches, at least {capacity} "
                         f"(the caches' capacity per sequence), got {seqlen_ro}")
    return True


def query_rows_apart(causal: Any, window_size: Any, attention_chunk: Any = 0) -> bool:
    """FA2's rule for q's positions: consecutive (cache_seqlens[b] + i) when the call is causal, windowed or chunked
    (FA3's: a chunked call is local), all at cache_seqlens[b] otherwise (arguments already checked)."""
    return bool(causal) or tuple(int(w) for w in window_size) != (-1, -1) or int(attention_chunk) > 0


def positions(starts: Any, rows: int, each_row_its_own: bool, xp: Any) -> Any:
    """(batch, rows) positions of rows starting at ``starts`` (batch,): consecutive, or all at the start."""
    offsets = xp.arange(rows, dtype=xp.int32)[None, :]
    if not each_row_its_own:
        offsets = offsets * 0
    return starts.astype(xp.int32)[:, None] + offsets


def rotate(x: Any, rotary_cos: Any, rotary_sin: Any, at: Any, interleaved: bool, xp: Any) -> Any:
    """``x`` (batch, rows, heads, headdim) with its first rotary_dim features rotated at positions ``at`` (batch,
    rows); a new array in x's dtype and library."""
    half = rotary_cos.shape[1]
    cos = rotary_cos[at].astype(xp.float32)[:, :, None, :]  # (batch, rows, 1, half): one angle per head
    sin = rotary_sin[at].astype(xp.float32)[:, :, None, :]
    features = x[..., : 2 * half].astype(xp.float32)
    if interleaved:
        x1, x2 = features[..., 0::2], features[..., 1::2]
    else:
        x1, x2 = features[..., :half], features[..., half:]
    r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if interleaved:
        rotated = xp.stack([r1, r2], axis=-1).reshape(features.shape)
    else:
        rotated = xp.concatenate([r1, r2], axis=-1)
    return xp.concatenate([rotated.astype(x.dtype), x[..., 2 * half:]], axis=-1)
