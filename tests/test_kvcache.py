"""KV-cache decoding ([variants]): cuflash.attention_with_kvcache, contiguous and paged caches.

* A grid over dtypes (so both fa2 variants), seqlen_new 0, 1 and several, decode (seqlen_q 1) and chunked
  prefill (seqlen_q > 1), cache lengths including 0, contiguous caches and pages of 16, 48 and 64 rows, GQA/MQA,
  masks, softcap and ALiBi: out and lse against the float64 reference (an explicit loop over sequences) under
  FA2's rule; the new rows land in the caches in place and nothing else in them changes.
* A paged cache gives the contiguous cache's result bit for bit, and num_splits=1 gives, per sequence, what
  cuflash.attention gives on that sequence's keys, bit for bit.
* The race detector on both variants with a paged cache.
* Bad input is refused before anything is written (the caches stay as they were), naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.reference import attention_with_kvcache_reference, kvcache_keys
from cuflash.testing import numpy_dtype

DTYPES = ["float32", "float16", "bfloat16"]
NEW_ROWS = [0, 1, 5]
PAGES = [None, 16, 48, 64]  # rows per page; None: contiguous
# (batch, seqlen_q, nheads, nheads_k, headdim, capacity)
SHAPES = {"decode-gqa": (3, 1, 4, 2, 40, 192), "prefill-mqa": (2, 7, 3, 1, 64, 192)}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window-softcap": dict(window_size=(30, 0), softcap=4.0),
    "alibi-causal": dict(causal=True, alibi=True),
}


def _cases():
    """Every dtype, new-row count, page size, shape and option set, in rotation."""
    cases = []
    for i in range(12):
        dtype, new, page = DTYPES[i % 3], NEW_ROWS[(i // 3) % 3], PAGES[i % 4]
        shape, option = list(SHAPES)[(i // 2) % 2], list(OPTIONS)[(i + i // 4) % 4]
        cases.append(pytest.param(dtype, new, page, shape, option, id=f"{dtype}-new{new}-page{page}-{shape}-{option}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _cases()]
    for axis, expected in enumerate((DTYPES, NEW_ROWS, PAGES, list(SHAPES), list(OPTIONS))):
        assert {v[axis] for v in values} == set(expected)


def _caches(shape, dtype, new, page, seed):
    """Contiguous caches, their paged copy (pages shuffled, spare pages), new rows and cache lengths (incl. 0)."""
    batch, seqlen_q, nheads, nheads_k, headdim, capacity = shape
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    k_cache, v_cache = (rng.standard_normal((batch, capacity, nheads_k, headdim)).astype(dt) for _ in range(2))
    k_new, v_new = (rng.standard_normal((batch, new, nheads_k, headdim)).astype(dt) for _ in range(2))
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dt)
    lengths = np.array([0, capacity - new, 37, 100][:batch], np.int32)
    paged = None
    if page is not None:
        per_sequence = -(-capacity // page)
        pages = rng.permutation(batch * per_sequence + 2)[:batch * per_sequence].reshape(batch, per_sequence)
        table = pages.astype(np.int32)
        shape_paged = (batch * per_sequence + 2, page, nheads_k, headdim)
        k_paged, v_paged = np.zeros(shape_paged, dt), np.zeros(shape_paged, dt)
        for b in range(batch):
            for i in range(per_sequence):
                rows = slice(i * page, min((i + 1) * page, capacity))
                n = rows.stop - rows.start
                k_paged[table[b, i], :n], v_paged[table[b, i], :n] = k_cache[b, rows], v_cache[b, rows]
        paged = (k_paged, v_paged, table)
    return q, k_cache, v_cache, k_new, v_new, lengths, paged


def _options(name, batch, nheads, seed):
    options = dict(OPTIONS[name])
    if options.pop("alibi", False):
        options["alibi_slopes"] = np.random.default_rng(seed).uniform(0.05, 0.5, (batch, nheads)).astype(np.float32)
    return options


@pytest.mark.parametrize("dtype, new, page, shape_name, option_name", _cases())
def test_kvcache_matches_reference_and_appends_in_place(dtype, new, page, shape_name, option_name):
    shape = SHAPES[shape_name]
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _caches(shape, dtype, new, page, seed=len(option_name) + new)
    options = _options(option_name, shape[0], shape[2], seed=3)
    before = k_cache.copy()
    new_kwargs = dict(k=k_new, v=v_new) if new else {}
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_lse=True,
                                              **new_kwargs, **options)
    used = lengths + new
    for b in range(shape[0]):  # the new rows, in place; the rest unchanged
        assert np.array_equal(k_cache[b, lengths[b]:used[b]], k_new[b])
        assert np.array_equal(np.delete(k_cache[b], np.arange(lengths[b], used[b]), axis=0),
                              np.delete(before[b], np.arange(lengths[b], used[b]), axis=0))
    ref = attention_with_kvcache_reference(q, k_cache, v_cache, used, **options)
    low = attention_with_kvcache_reference(q, k_cache, v_cache, used, dtype=q.dtype, **options)
    atol = 4 * options.get("softcap", 0.0) * 2.0**-23  # the kernels' tanh (see test_varlen.py)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR, atol=atol)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR, atol=atol)
    if paged is not None:
        k_paged, v_paged, table = paged
        out_paged, lse_paged = cuflash.attention_with_kvcache(q, k_paged, v_paged, cache_seqlens=lengths,
                                                              block_table=table, return_lse=True, **new_kwargs,
                                                              **options)
        assert np.array_equal(out_paged, out) and np.array_equal(lse_paged, lse)
        for got, want in zip(kvcache_keys(k_paged, used, table), kvcache_keys(k_cache, used)):
            assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_split_is_attention_on_each_sequences_keys(dtype):
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _caches(SHAPES["prefill-mqa"], dtype, 3, None, seed=4)
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                              causal=True, num_splits=1, return_lse=True)
    used = lengths + 3
    for b, (keys, values) in enumerate(zip(kvcache_keys(k_cache, used), kvcache_keys(v_cache, used))):
        want_out, want_lse = cuflash.attention(q[b:b + 1], keys[None], values[None], causal=True, return_lse=True)
        assert np.array_equal(out[b:b + 1], want_out) and np.array_equal(lse[b:b + 1], want_lse)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_race_free_with_a_paged_cache(dtype):
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _caches(SHAPES["decode-gqa"], dtype, 2, 16, seed=5)
    k_paged, v_paged, table = paged
    with sim.checking("race"):
        out = cuflash.attention_with_kvcache(q, k_paged, v_paged, k=k_new, v=v_new, cache_seqlens=lengths,
                                             block_table=table, causal=True)
    ref, low = (attention_with_kvcache_reference(q, k_paged, v_paged, lengths + 2, block_table=table, causal=True,
                                                 dtype=dt)[0] for dt in (np.float64, q.dtype))
    tol.check_close("out", out, ref, low, tol.FORWARD_FACTOR)


# ---------------------------------------------------------------------------
# Bad input: refused before anything is written.

def _bad_inputs():
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _caches(SHAPES["decode-gqa"], "float32", 2, 16, seed=6)
    k_paged, v_paged, table = paged
    base = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=lengths)
    paged_base = dict(base, k_cache=k_paged, v_cache=v_paged, block_table=table)
    outside = table.copy()
    outside[1, 2] = k_paged.shape[0]
    return {
        "k-without-v": (dict(base, v=None), "k and v .* together"),
        "new-shape": (dict(base, k=k_new[:, :, :1], v=v_new[:, :, :1]), "k must have shape"),
        "over-capacity": (dict(base, cache_seqlens=np.array([0, 191, 3], np.int32)), "exceeds the cache's capacity"),
        "seqlens-dtype": (dict(base, cache_seqlens=lengths.astype(np.int64)), "cache_seqlens must be an int or an "
                                                                             "int32 array"),
        "negative-length": (dict(base, cache_seqlens=-1), "cache_seqlens must be >= 0"),
        "table-dtype": (dict(paged_base, block_table=table.astype(np.int64)), "block_table must be int32"),
        "table-outside": (dict(paged_base, block_table=outside), "block_table names pages outside the cache"),
        "page-size": (dict(paged_base, k_cache=k_paged[:, :8], v_cache=v_paged[:, :8]), "page size .* multiple of 16"),
        "splits": (dict(base, num_splits=4), "split-KV is not implemented yet"),
        "dropout-algorithm": (dict(base, algorithm="fa1"), "kvcache is supported by algorithm='fa2' only"),
        "cache-not-contiguous": (dict(base, k_cache=np.asfortranarray(k_cache)), "updated in place"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_is_refused_before_anything_is_written(case):
    arguments, message = _bad_inputs()[case]
    caches = {name: arguments[name].copy() for name in ("k_cache", "v_cache")}
    with sim.record() as records, pytest.raises((ValueError, TypeError), match=message):
        cuflash.attention_with_kvcache(**arguments)
    assert records.launches == []
    for name, copy in caches.items():
        assert np.array_equal(arguments[name], copy), f"{name} changed by a rejected call"
