"""Chunked attention (``attention_chunk``, FA3's option; Llama 4's local layers) as virtual batches.

Under chunks of c keys a query row sees only the keys of its diagonal's chunk, on top of the window and the causal
mask (cuflash/mask.py's rule). The kernels take no chunks: a chunked call runs as a varlen call over one sequence per
(sequence, chunk), each with the call's window and causal mask alone (``MaskPolicy.chunk_segments``, exact; vLLM runs
FA3's chunked layers as such "virtual batches" too). The segments tile every sequence's rows and keys, so the packed
tensors are the caller's own, reshaped (a fixed-length call's (batch, seqlen) axes as one: a view where they are
contiguous), and each segment's Q blocks visit only its own keys: block skipping is the varlen kernels'.

What a chunked call costs beyond that varlen call: its checks, the segments' cu_seqlens (made once per lengths, mask
and batch: ``virtual_batches``), their upload, and for a fixed-length call the lse between its layout
(batch, nheads, seqlen_q) and varlen's (nheads, total_q) (a transposed copy: 4 bytes per row and head). The kernels
were given chunks first, as a fourth tile edge: 12 instances then spilled (the closing note of 2026-11-29).

A KV-cache call runs with each sequence's keys shifted to its rows' chunk (kvcache_chunks) where its rows lie in one
chunk (a decode step's always do); a prefill whose rows span chunks runs, after its append, as the chunked varlen call
over the caches (cache_as_varlen): paged ones through the paged varlen call (segment_pages), contiguous ones viewed
as packed rows.

A varlen call's used prefixes (seqused_q / seqused_k) are chunked as its sequences would be alone, the rows and keys
past them one more virtual batch that uses none (virtual_batches). Not with dropout (FA3 has none; a virtual batch
would draw another mask than the call's sequence); ALiBi slopes per sequence are repeated per segment. Functions here
take the API's arguments; ``cuflash.api`` runs the varlen calls (its _chunked_* functions), ``cuflash.jax`` likewise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _validation as V
from .kernels import catalog
from .mask import Mask, MaskPolicy


@dataclass(frozen=True)
class VirtualBatches:
    """The sequences a chunked call runs as: cu_seqlens over the caller's packed rows and keys (int32, host), the
    caller's sequence of each (``owner``, for per-sequence inputs: ALiBi slopes), the longest, and where the caller
    gave used prefixes (seqused_q / seqused_k) each sequence's own (None otherwise)."""

    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    owner: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_q: np.ndarray | None = None
    seqused_k: np.ndarray | None = None


@functools.lru_cache(maxsize=256)
def virtual_batches(lengths: tuple[tuple[int, int], ...], mask: Mask,
                    used: tuple[tuple[int, int], ...] | None = None) -> VirtualBatches:
    """The virtual batches of sequences of (query rows, keys) ``lengths``, packed one after the other, under the
    chunked ``mask`` (cached: a signature's calls share them). ``used``: per sequence the (rows, keys) of its used
    prefixes (seqused_q / seqused_k, a whole length where one is not given), or None: the chunks then cut the
    prefixes, and the rows and keys past them make one more sequence that uses none of them (out 0, lse -inf, zero
    gradients: the varlen call's rule for unused rows)."""
    cu_q, cu_k, owner, used_q, used_k = [0], [0], [], [], []
    row0 = key0 = 0
    for sequence, (rows, keys) in enumerate(lengths):
        prefix_rows, prefix_keys = (rows, keys) if used is None else used[sequence]
        for segment_rows, segment_keys in mask.policy(prefix_rows, prefix_keys).chunk_segments():
            cu_q.append(row0 + segment_rows.end)
            cu_k.append(key0 + segment_keys.end)
            owner.append(sequence)
            used_q.append(len(segment_rows))
            used_k.append(len(segment_keys))
        if prefix_rows < rows or prefix_keys < keys:
            cu_q.append(row0 + rows)
            cu_k.append(key0 + keys)
            owner.append(sequence)
            used_q.append(0)
            used_k.append(0)
        row0, key0 = row0 + rows, key0 + keys
    arrays = tuple(np.array(x, np.int32) for x in (cu_q, cu_k, owner, used_q, used_k))
    for array in arrays:
        array.flags.writeable = False  # shared by every call of the key
    cu_q, cu_k, owner, used_q, used_k = arrays
    prefixes = (used_q, used_k) if used is not None else (None, None)
    return VirtualBatches(cu_q, cu_k, owner, int(np.diff(cu_q).max(initial=0)), int(np.diff(cu_k).max(initial=0)),
                          *prefixes)


def check(attention_chunk: Any, algorithm: Any, dropout_p: Any = 0.0) -> int:
    """The checked chunk (0: none) of a call with ``algorithm`` and ``dropout_p`` (already checked themselves, or
    checked by the call after this): chunks run as varlen batches, which not every algorithm takes, and not with
    dropout."""
    chunk = V.check_attention_chunk(attention_chunk)
    if chunk:
        dropout_p = V.check_dropout_p(dropout_p)
        catalog.check_option_of(algorithm, "varlen", "attention_chunk (run as varlen batches)")
        if dropout_p:
            raise ValueError("attention_chunk does not combine with dropout_p > 0 (FlashAttention-3 has no dropout; "
                             "a chunk's virtual batch would draw another dropout mask than the call's sequence)")
    return chunk


def fixed_length_batches(batch: int, seqlen_q: int, seqlen_k: int, causal: Any, window_size: Any,
                         chunk: int) -> VirtualBatches:
    """The virtual batches of a fixed-length call, over its (batch * seqlen) packed rows and keys."""
    return virtual_batches(((seqlen_q, seqlen_k),) * batch, _mask(causal, window_size, chunk))


def varlen_batches(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, causal: Any, window_size: Any,
                   chunk: int, seqused_q: np.ndarray | None = None,
                   seqused_k: np.ndarray | None = None) -> VirtualBatches:
    """The virtual batches of a varlen call (host copies of its checked cu_seqlens and used prefixes), over the same
    packed rows."""
    lengths = tuple(zip(np.diff(cu_seqlens_q).tolist(), np.diff(cu_seqlens_k).tolist()))
    used = None
    if seqused_q is not None or seqused_k is not None:
        rows, keys = zip(*lengths) if lengths else ((), ())
        used = tuple(zip(rows if seqused_q is None else seqused_q.tolist(),
                         keys if seqused_k is None else seqused_k.tolist()))
    return virtual_batches(lengths, _mask(causal, window_size, chunk), used)


def kvcache_chunks(chunk: int, seqlen_q: int, keys: Any, xp: Any = np) -> tuple[Any, Any]:
    """A KV-cache call's chunks: per sequence of ``keys`` keys (its cache rows in use past any left padding), the
    first key of its last row's chunk (MaskPolicy.rows_chunk), from which on the call with the window alone is the
    chunked one where the rows lie in that chunk; and whether some sequence's rows span chunks (a prefill crossing a
    chunk's end: the call then runs as varlen sequences, cache_as_varlen). ``xp`` jax.numpy for traced keys (then
    the second result is traced too: callers with traced keys take one query row, which never spans)."""
    first, single = MaskPolicy.rows_chunk(chunk, seqlen_q, keys, xp)
    return first, ~xp.all(single)


def check_packed_view(k_cache: Any, v_cache: Any) -> None:
    """That contiguous NumPy or CuPy caches can be viewed as the packed keys of a varlen call (cache_as_varlen): as
    (cache batch * rows, heads, d), their batch stride their rows' (a JAX array reshapes whatever its layout)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.shape[0] > 1 and cache.strides[0] != cache.shape[1] * cache.strides[1]:
            raise ValueError(f"attention_chunk with query rows that span chunks runs over {name} viewed as one packed "
                             f"array of rows: its batch stride must be its rows' (seqlen_cache x row stride), got "
                             f"strides {tuple(cache.strides)} for shape {tuple(cache.shape)}")


def check_cache_rows_in_order(cache_batch_idx: np.ndarray | None) -> None:
    """Contiguous caches run as packed keys in the order of their batch rows (cache_as_varlen): the sequences'
    rows, cache_batch_idx where given, must increase."""
    rows = cache_batch_idx
    if rows is not None and rows.size > 1 and (np.diff(rows.astype(np.int64)) <= 0).any():
        raise ValueError("attention_chunk with query rows that span chunks runs over the caches' rows in order: "
                         "cache_batch_idx must be increasing")


def cache_as_varlen(seqlen_q: int, used: np.ndarray, leftpad: np.ndarray | None, cache_batch_idx: np.ndarray | None,
                    paged: bool, capacity: int, cache_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A KV-cache call (host values: the rows in use after the append, left padding, cache_batch_idx) as varlen
    sequences with seqlen_q query rows each: cu_seqlens_q, cu_seqlens_k (int32) and, where sequences were added,
    each one's caller sequence (``owner``: per-sequence ALiBi slopes; else None).
    Paged caches: sequence b's keys are the first used[b] rows of its pages (a paged varlen call, its block table
    the call's). Contiguous caches viewed packed, (cache_batch * capacity) rows: sequence b's keys are packed rows
    cache_batch_idx[b] * capacity + leftpad[b] .. + used[b], and the rows no sequence reads are sequences of their
    own with no query row (nothing reads them; owner 0)."""
    batch = len(used)
    if paged:
        cu_k = np.concatenate([[0], np.cumsum(used, dtype=np.int64)]).astype(np.int32)
        return np.arange(batch + 1, dtype=np.int32) * seqlen_q, cu_k, None
    if cache_batch * capacity > V.MAX_SEQLEN:
        raise ValueError(f"attention_chunk with query rows that span chunks runs over the caches as one packed array "
                         f"of rows: {cache_batch} x {capacity} rows is more than a varlen call takes (2**31 - 1)")
    cache_rows = range(batch) if cache_batch_idx is None else cache_batch_idx.tolist()
    cu_q, cu_k, owner = [0], [0], []

    def rowless(end: int) -> None:
        if end > cu_k[-1]:
            cu_q.append(cu_q[-1])
            cu_k.append(end)
            owner.append(0)

    for b, (row, in_use) in enumerate(zip(cache_rows, used.tolist())):
        rowless(row * capacity + (0 if leftpad is None else int(leftpad[b])))
        cu_q.append(cu_q[-1] + seqlen_q)
        cu_k.append(row * capacity + in_use)
        owner.append(b)
    rowless(cache_batch * capacity)
    return np.array(cu_q, np.int32), np.array(cu_k, np.int32), np.array(owner, np.int32)


def check_pages(chunk: int, page_size: int) -> None:
    """A paged cache's chunks are whole pages: its keys then start at a page of the block table."""
    if chunk % page_size:
        raise ValueError(f"attention_chunk with a paged KV cache must be a multiple of its page size ({page_size}), "
                         f"got {chunk}")


def pages_from(table: Any, first_keys: Any, page_size: int, xp: Any = np) -> Any:
    """The block table whose sequence b starts at its key first_keys[b] (a page boundary: check_pages): its row
    moved left by that many pages (the pages past its end repeat its last one, never read)."""
    pages = table.shape[1]
    columns = xp.minimum(xp.arange(pages)[None, :] + (first_keys // page_size)[:, None], pages - 1)
    return xp.take_along_axis(table, columns.astype(table.dtype), axis=1)


def paged_keys_from(table: Any, used: Any, first_keys: Any, page_size: int, xp: Any = np) -> tuple[Any, Any, Any]:
    """A paged cache's sequences from their key first_keys[b] on, any row (a folded windowed decode's first visible
    key; a chunk's first key, a page boundary): (block table, keys in use, left padding) with the pages before that
    key's page dropped (pages_from), the keys in use counted from the new first page, and that key's row in it as
    the left padding (block_info.cuh: a paged cache's cache_leftpad), 0 where first_keys are page boundaries."""
    dropped = first_keys // page_size * page_size
    return pages_from(table, dropped, page_size, xp), used - dropped, first_keys - dropped


def segment_pages(table: np.ndarray, cu_seqlens_k: np.ndarray, batches: VirtualBatches, page_size: int) -> np.ndarray:
    """A paged varlen call's block table for its virtual batches (host copies): each segment's row is its sequence's,
    moved to the page of the segment's first key (a chunk's first key: a page boundary, check_pages)."""
    owner = batches.owner.astype(np.int64)
    first_keys = batches.cu_seqlens_k[:-1].astype(np.int64) - cu_seqlens_k[owner]
    return pages_from(table[owner], first_keys, page_size).astype(np.int32)


def per_segment(slopes: Any, owner: Any) -> Any:
    """ALiBi slopes for the virtual batches: (batch, nheads) repeated per segment, by ``owner`` in the slopes' array
    module (NumPy, CuPy or jax.numpy); (nheads,) as given."""
    return slopes if slopes is None or slopes.ndim == 1 else slopes[owner]


def _mask(causal: Any, window_size: Any, chunk: int) -> Mask:
    return Mask.of(bool(causal), (int(window_size[0]), int(window_size[1])), chunk)
