"""``cuflash.jax.attention_with_kvcache``: KV-cache decoding on JAX arrays (forward only).

The append is plain JAX (one scatter per cache) before the custom call, which only reads the caches: under
``jax.jit(f, donate_argnums=...)`` with the caches donated, XLA scatters into their buffers in place and hands them
back as the updated caches, so a decoding step copies no cache.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .. import _validation as V
from .. import chunks, rotary
from ..kernels.program import decode_window_left, gqa_decode_fold
from ..mask import Mask, MaskPolicy
from ._attention import _call_operands, _concrete, _forward_only, _int32_words, attention_varlen


def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    k: Any = None,
    v: Any = None,
    cache_seqlens: Any = None,
    block_table: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    algorithm: str = "fa2",
    return_lse: bool = False,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    rotary_interleaved: bool = False,
    sinks: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    attention_chunk: int = 0,
) -> tuple[Any, ...]:
    """``cuflash.attention_with_kvcache`` on JAX arrays, functionally: returns ``(out, k_cache, v_cache)``, or
    ``(out, lse, k_cache, v_cache)`` with ``return_lse``, the caches with the new ``k``, ``v`` rows written at
    ``cache_seqlens``. Layouts, options and results are those of the NumPy function (same Problem, same kernels:
    bit for bit its results): contiguous caches (batch, seqlen_cache, nheads_k, headdim) or paged ones
    (num_pages, page_size, nheads_k, headdim) with an int32 ``block_table`` (batch, max_blocks_per_seq); q attends
    to keys [0, cache_seqlens[b] + seqlen_new) of its sequence. Shapes, dtypes and static options are checked
    when the call is traced, with the NumPy function's messages.

    ``cache_seqlens`` (an int, None or an int32 (batch,) array) and ``block_table`` may be traced. Concrete
    values are checked as the NumPy function checks them (capacity, page numbers). Traced values cannot be: they
    are taken on trust, as FlashAttention-2 takes them. New rows that fall outside a sequence's capacity (or on
    a page the table does not name) are dropped by the scatter, but the kernels read keys up to
    cache_seqlens[b] + seqlen_new through the table as given, so such values give garbage (on a GPU, reads out of
    bounds). With traced cache_seqlens the grid spans the caches' capacity (their values are unknown when the
    plan is made), so ``num_splits=0``'s heuristic may split differently from a call with concrete lengths.

    Donate the caches to update them in place: ``jax.jit(step, donate_argnums=(1, 2))`` (see the module
    docstring). Works under ``jit`` and ``vmap`` (one call per mapped element, each as the unmapped call: vmap
    equals a loop of calls, bit for bit; each element's slice of a mapped cache is copied for its call) and plain
    ``jit`` over caches sharded along kv heads (and batch, when not paged): one call per device on its shard. No
    derivative: it is an inference function, and differentiating it raises a TypeError. ``rotary_cos``,
    ``rotary_sin`` and ``rotary_interleaved`` as for the NumPy function (cuflash/rotary.py), at traced lengths
    too; ``sinks`` (float32 (nheads,)) as for ``cuflash.attention``. ``cache_batch_idx`` and ``cache_leftpad``
    as for the NumPy function (contiguous caches); traced values are taken on trust like cache_seqlens. With
    cache_batch_idx the new rows go in by one scatter into the whole caches, which sharded jit keeps whole.
    ``attention_chunk`` as for the NumPy function; with traced cache_seqlens or cache_leftpad, for one query row per
    sequence (a decode step, whose row always lies in one chunk). Rows that span chunks run as the NumPy function
    runs them (the chunked attention_varlen over the caches, contiguous ones reshaped to packed rows), which needs a
    concrete block_table and cache_batch_idx.
    """
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table,
             "rotary_cos": rotary_cos, "rotary_sin": rotary_sin, "sinks": sinks, "cache_batch_idx": cache_batch_idx,
             "cache_leftpad": cache_leftpad}
    for name, array in named.items():
        if array is not None and not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(array).__name__}")
    one_length = isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool)
    lengths_given_as_array = cache_seqlens is not None and not one_length
    if lengths_given_as_array and not (hasattr(cache_seqlens, "shape") and hasattr(cache_seqlens, "dtype")):
        raise TypeError(f"cache_seqlens must be an int, None or an int32 array, got {type(cache_seqlens).__name__}")

    chunk = chunks.check(attention_chunk, algorithm)
    if chunk and cache_leftpad is None and block_table is None:  # chunks start keys as left padding (chunks.py)
        cache_leftpad = np.zeros(q.shape[0], np.int32)
    # Checked on the caller's dtypes, before jnp.asarray could narrow e.g. float64 to float32.
    layout = V.check_kvcache_shapes(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad)
    # A one-row GQA decode under a window's left bound folds with its keys from the row's first visible one, as the
    # NumPy function runs it (decode_window_left): then as left padding, and the call has no mask.
    window_left = decode_window_left(dataclasses.replace(
        V.kvcache_problem(q, k_cache, v_cache, layout, seqlen_k=layout.capacity, causal=causal,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks),
        mask=Mask.of(bool(causal), (int(window_size[0]), int(window_size[1])))))
    call_causal, call_window = (causal, window_size) if window_left is None else (False, (-1, -1))
    if window_left is not None and block_table is not None:  # keys from inside a page (chunks.paged_keys_from)
        layout = dataclasses.replace(layout, cache_leftpad=True)
    elif window_left is not None and cache_leftpad is None:
        cache_leftpad = np.zeros(q.shape[0], np.int32)
        layout = V.check_kvcache_shapes(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad)
    if chunk and block_table is not None:
        chunks.check_pages(chunk, layout.page_size)
    table = None if block_table is None else _concrete(block_table)
    if table is not None:
        V.check_block_table_values(table, layout.num_pages)
    lengths = _concrete(cache_seqlens) if lengths_given_as_array else cache_seqlens
    lengths_known = not (lengths_given_as_array and lengths is None)
    if lengths_known:
        used = V.kvcache_used_rows(lengths, layout)
    else:  # traced: only the capacity bounds the keys in use
        V.check_cache_seqlens_array(cache_seqlens, layout.batch)
        used = jnp.asarray(cache_seqlens) + jnp.int32(layout.seqlen_new)
    # Concrete indexing values are checked as the NumPy function checks them; traced ones are taken on trust.
    index = None if cache_batch_idx is None else _concrete(cache_batch_idx)
    leftpad = None if cache_leftpad is None else _concrete(cache_leftpad)
    leftpad_known = cache_leftpad is None or leftpad is not None
    if lengths_known:
        V.check_kvcache_index_values(index, leftpad, used, layout)
    first_keys = 0  # chunks: each sequence's keys from its rows' chunk on
    spanning = False  # some sequence's rows span chunks: the call runs as varlen sequences (chunks.cache_as_varlen)
    if chunk and lengths_known and leftpad_known:
        first_keys, spanning = chunks.kvcache_chunks(chunk, q.shape[1], V.kvcache_keys(used, leftpad))
        traced_indexing = (block_table is not None and table is None) or (cache_batch_idx is not None and index is None)
        if spanning and traced_indexing:
            raise ValueError("attention_chunk with query rows that span chunks needs a concrete block_table and "
                             "cache_batch_idx (the call runs as varlen sequences over the caches)")
        if spanning:
            chunks.check_cache_rows_in_order(index)
    elif chunk:
        if q.shape[1] != 1:
            raise ValueError(f"attention_chunk with traced cache_seqlens or cache_leftpad needs one query row per "
                             f"sequence (a decode step: its chunk is its last key's), got {q.shape[1]}")
        first_keys = chunks.kvcache_chunks(chunk, 1, V.kvcache_keys(
            jnp.asarray(used), None if cache_leftpad is None else jnp.asarray(cache_leftpad)), jnp)[0]
    if window_left is not None:  # the folded windowed decode's keys: from the row's first visible one
        xp = np if lengths_known and leftpad_known else jnp
        given_leftpad = None if cache_leftpad is None else xp.asarray(leftpad if xp is np else cache_leftpad)
        window_first = MaskPolicy.decode_first_key(window_left, V.kvcache_keys(xp.asarray(used), given_leftpad), xp)
        first_keys = xp.maximum(first_keys, window_first)
    # The grid's extent: a bound on the longest sequence's keys where known (V.kvcache_key_extent: one static call
    # signature for many decode steps), else the capacity.
    if not lengths_known:
        seqlen_k = layout.capacity
    else:
        longest = int((V.kvcache_keys(used, leftpad) - first_keys if leftpad_known else used).max(initial=0))
        seqlen_k = V.kvcache_key_extent(longest, layout.capacity)
    problem = V.kvcache_problem(q, k_cache, v_cache, layout, seqlen_k=seqlen_k, causal=call_causal,
                                window_size=call_window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    problem = V.with_num_splits(problem, num_splits)
    with_rotary = rotary.check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k, layout.capacity)

    k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
    starts = jnp.asarray(used) - jnp.int32(layout.seqlen_new)  # cache rows of the new rows
    if with_rotary:  # at key positions: counted from the first key past the left padding
        cos, sin = jnp.asarray(rotary_cos), jnp.asarray(rotary_sin)
        q_rows_apart = rotary.query_rows_apart(causal, window_size, chunk)
        keys = V.kvcache_keys(jnp.asarray(used), None if cache_leftpad is None else jnp.asarray(cache_leftpad))
        first_new = keys - jnp.int32(layout.seqlen_new)
        q = rotary.rotate(jnp.asarray(q), cos, sin, rotary.positions(first_new, q.shape[1], q_rows_apart, jnp),
                          bool(rotary_interleaved), jnp)
        k = rotary.rotate(jnp.asarray(k), cos, sin, rotary.positions(first_new, k.shape[1], True, jnp),
                          bool(rotary_interleaved), jnp)
    if layout.seqlen_new:
        k_cache = _append(k_cache, jnp.asarray(k), starts, block_table, cache_batch_idx)
        v_cache = _append(v_cache, jnp.asarray(v), starts, block_table, cache_batch_idx)
    if spanning:
        out, lse = _as_varlen(q, k_cache, v_cache, used, leftpad, index, table, layout, chunk=chunk, causal=causal,
                              softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, algorithm=algorithm, sinks=sinks)
        return (out, lse, k_cache, v_cache) if V.check_bool("return_lse", return_lse) else (out, k_cache, v_cache)
    if (chunk or window_left is not None) and block_table is not None:  # pages before the first key's dropped
        block_table, used, in_page = chunks.paged_keys_from(jnp.asarray(block_table), jnp.asarray(used), first_keys,
                                                            layout.page_size, jnp)
        if window_left is not None:  # (else chunks alone: their first keys start pages)
            cache_leftpad = in_page
    elif chunk or window_left is not None:  # as left padding
        cache_leftpad = jnp.asarray(cache_leftpad) + first_keys
    words = (_int32_words(used),) + (() if block_table is None else (_int32_words(block_table),))
    words += tuple(_int32_words(x) for x in (cache_batch_idx, cache_leftpad) if x is not None)
    config, return_lse, (q_call, k_call, v_call, side) = _call_operands(
        problem, q, k_cache, v_cache, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes, dropout_rng=None,
        algorithm=algorithm, return_lse=return_lse, int_words=words, sinks=sinks)
    config = dataclasses.replace(config, cache_shape=tuple(k_cache.shape))
    out, lse = _decode(config, q_call, k_call, v_call, side)
    return (out, lse, k_cache, v_cache) if return_lse else (out, k_cache, v_cache)


def _as_varlen(q, k_cache, v_cache, used, leftpad, index, table, layout, *, chunk, alibi_slopes, **options):
    """A chunked call whose rows span chunks, after its append: the chunked attention_varlen over the caches (as the
    NumPy function runs it: chunks.cache_as_varlen; contiguous caches reshaped to packed rows); (out, lse) in the
    KV cache's layouts. ``options``: causal, softmax_scale, window_size, softcap, algorithm, sinks."""
    batch, seqlen_q, nheads = q.shape[:3]
    cu_q, cu_k, owner = chunks.cache_as_varlen(seqlen_q, used, leftpad, index, table is not None, layout.capacity,
                                               k_cache.shape[0])
    keys, values, paged = k_cache, v_cache, {"block_table": table}
    if table is None:
        keys, values = (jnp.reshape(c, (c.shape[0] * c.shape[1], *c.shape[2:])) for c in (k_cache, v_cache))
        paged = {}
    if owner is not None and alibi_slopes is not None:
        alibi_slopes = chunks.per_segment(jnp.asarray(alibi_slopes), owner)
    out, lse = attention_varlen(jnp.reshape(q, (batch * seqlen_q, *q.shape[2:])), keys, values, cu_q, cu_k,
                                attention_chunk=chunk, alibi_slopes=alibi_slopes, return_lse=True, **paged, **options)
    return (jnp.reshape(out, (batch, seqlen_q, nheads, out.shape[-1])),
            jnp.transpose(jnp.reshape(lse, (nheads, batch, seqlen_q)), (1, 0, 2)))


def _append(cache, new, starts, block_table, cache_batch_idx=None):
    """``cache`` with new[b, i] at cache row starts[b] + i of sequence b (its page and row in the page when paged;
    of the caches' batch row cache_batch_idx[b] when given): one scatter. Rows outside the sequence's capacity
    (only traced lengths can give them) are dropped, negative ones included (no Python-style wrapping), rather
    than written over another sequence's rows."""
    seqlen_new = new.shape[1]
    rows = starts[:, None] + jnp.arange(seqlen_new, dtype=jnp.int32)[None, :]  # (batch, seqlen_new)
    if cache_batch_idx is not None:  # any sequence may write any batch row of the caches: the rows whole
        outer = jnp.broadcast_to(jnp.asarray(cache_batch_idx)[:, None], rows.shape)
        return cache.at[outer, rows].set(_batch_whole(new), mode="drop", wrap_negative_indices=False)
    if block_table is None:
        # One scatter per sequence into its own cache, batched by vmap: XLA partitions it along a sharded batch
        # without gathering the caches (an index into the batch axis would make it gather them).
        return jax.vmap(lambda c, n, r: c.at[r].set(n, mode="drop", wrap_negative_indices=False))(
            cache, new, _batch_sharded_like(rows, cache))
    page_size = cache.shape[1]
    outer = jnp.take_along_axis(jnp.asarray(block_table), rows // page_size, axis=1, mode="fill",
                                fill_value=-1, wrap_negative_indices=False)
    return cache.at[outer, rows % page_size].set(new, mode="drop", wrap_negative_indices=False)


def _batch_whole(x):
    """``x`` with its first axis not sharded in an Explicit mesh (as it is otherwise): a scatter into caches whose
    batch rows stay whole needs its updates whole along that axis."""
    spec = getattr(jax.typeof(x).sharding, "spec", None) or ()
    if not spec or spec[0] is None:
        return x
    whole = jax.sharding.PartitionSpec(None, *spec[1:])
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(jax.typeof(x).sharding.mesh, whole))


def _batch_sharded_like(x, like):
    """``x`` sharded along its first axis as ``like``'s batch axis is in an Explicit mesh (vmap wants every mapped
    operand sharded alike there); as it is otherwise."""
    (batch_axis,) = _explicit_axes(like, (0,))
    if batch_axis is None:
        return x
    batch = jax.sharding.PartitionSpec(batch_axis, *([None] * (x.ndim - 1)))
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(jax.typeof(like).sharding.mesh, batch))


def _decode(config, q, k_cache, v_cache, side):
    """The forward call, with a one-row GQA/MQA decode folded as the NumPy function folds it
    (program.gqa_decode_fold: each kv head's query heads become the rows of one Q block, so K and V are read once
    per kv head). JAX cannot view q with the fold's strides, so q and out are transposed (one row each: small)."""
    folded = gqa_decode_fold(config.problem)
    if folded is None:
        return _forward_only(config, q, k_cache, v_cache, side)
    batch, _, nheads, headdim = q.shape
    group = folded.seqlen_q
    # Query head kh * group + m becomes row m of kv head kh. In an Explicit mesh each reshape names its result's
    # sharding: batch and heads stay on their mesh axes.
    batch_axis, head_axis = _explicit_axes(q, (0, 2))
    q = _reshape(q, (batch, nheads // group, group, headdim), (batch_axis, head_axis, None, None)).swapaxes(1, 2)
    out, lse = _forward_only(dataclasses.replace(config, problem=folded), q, k_cache, v_cache, side)
    out = _reshape(out.swapaxes(1, 2), (batch, 1, nheads, v_cache.shape[-1]), (batch_axis, None, head_axis, None))
    # lse (batch, nheads_k, group): the same order as (batch, nheads, 1).
    return out, _reshape(lse, (batch, nheads, 1), (batch_axis, head_axis, None))


def _explicit_axes(x, dims):
    """The mesh axes ``x``'s dimensions ``dims`` are sharded along in an Explicit mesh (None each otherwise)."""
    spec = getattr(jax.typeof(x).sharding, "spec", None) or ()
    return tuple(spec[d] if d < len(spec) else None for d in dims)


def _reshape(x, shape, spec):
    """x.reshape(shape), naming the result's sharding ``spec`` where x's type carries one (Explicit mesh axes)."""
    sharding = jax.typeof(x).sharding
    if all(axis is None for axis in getattr(sharding, "spec", None) or ()):
        return x.reshape(shape)
    out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.lax.reshape(x, shape, out_sharding=out)

