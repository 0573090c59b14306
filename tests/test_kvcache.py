"""KV-cache decoding ([variants]): cuflash.attention_with_kvcache, contiguous and paged caches.

* A grid over dtypes (so both fa2 variants), seqlen_new 0, 1 and several, decode (seqlen_q 1) and chunked
  prefill (seqlen_q > 1), cache lengths including 0, contiguous caches and pages of 16, 48 and 64 rows, GQA/MQA,
  masks, softcap and ALiBi: out and lse against the float64 reference (an explicit loop over sequences) under
  FA2's rule; the new rows land in the caches in place and nothing else in them changes.
* A paged cache gives the contiguous cache's result bit for bit, and num_splits=1 gives, per sequence, what
  cuflash.attention gives on that sequence's keys, bit for bit (the GQA decode fold included).
* Split-KV: every dtype, split counts 2, 3, the heuristic (0) and more splits than K/V blocks, contiguous and
  paged, with masks, softcap and ALiBi, within FA2's rule of the reference and of num_splits=1; the program
  (a split forward and the combine kernel, grid and scratch) and the heuristic's choices; splits read every key
  once; the GQA decode fold reads K and V once per kv head.
* The race detector on both variants with a paged cache and with splits; AddressSanitizer on the split path.
* Bad input is refused before anything is written (the caches stay as they were), naming the argument.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.kernels import plans, targets
from cuflash.kernels.families import fa2, fa2_tc
from cuflash.kernels.program import Problem, gqa_decode_fold
from cuflash.mask import Mask
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
    with sim.record() as contiguous_records:
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
        with sim.record() as paged_records:
            out_paged, lse_paged = cuflash.attention_with_kvcache(q, k_paged, v_paged, cache_seqlens=lengths,
                                                                  block_table=table, return_lse=True, **new_kwargs,
                                                                  **options)
        grids = {records.launches[0].grid[1] for records in (contiguous_records, paged_records)}
        if len(grids) == 1:  # the same launch over the same keys: bit for bit
            assert np.array_equal(out_paged, out) and np.array_equal(lse_paged, lse)
        else:  # a windowed GQA decode folds on contiguous caches only (their keys start at the window): rounding
            assert grids == {shape[3], shape[2]} and "window_size" in options and shape[1] == 1
            tol.check_close("out (paged)", out_paged, ref[0], low[0], tol.FORWARD_FACTOR, atol=atol)
            tol.check_close("lse (paged)", lse_paged, ref[1], low[1], tol.FORWARD_FACTOR, atol=atol)
        for got, want in zip(kvcache_keys(k_paged, used, table), kvcache_keys(k_cache, used)):
            assert np.array_equal(got, want)


def _check_one_split_is_attention_per_sequence(shape_name, dtype, new, seed):
    """num_splits=1 over the caches gives, bit for bit, cuflash.attention on each sequence's keys in use."""
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _caches(SHAPES[shape_name], dtype, new, None, seed=seed)
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                              causal=True, num_splits=1, return_lse=True)
    used = lengths + new
    for b, (keys, values) in enumerate(zip(kvcache_keys(k_cache, used), kvcache_keys(v_cache, used))):
        want_out, want_lse = cuflash.attention(q[b:b + 1], keys[None], values[None], causal=True, return_lse=True)
        assert np.array_equal(out[b:b + 1], want_out) and np.array_equal(lse[b:b + 1], want_lse)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_split_is_attention_on_each_sequences_keys(dtype):
    _check_one_split_is_attention_per_sequence("prefill-mqa", dtype, new=3, seed=4)


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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gqa_decode_fold_is_attention_on_each_sequences_keys(dtype):
    """One query row over GQA heads runs folded (the group's heads as rows): bit for bit the unfolded attention."""
    q, k_cache = _caches(SHAPES["decode-gqa"], dtype, 1, None, seed=7)[:2]
    assert gqa_decode_fold(_kvcache_problem(q, k_cache, causal=True)) is not None
    _check_one_split_is_attention_per_sequence("decode-gqa", dtype, new=1, seed=7)


def _kvcache_problem(q, k_cache, **options):
    batch, seqlen_q, nheads, headdim = q.shape
    return Problem(dtype=q.dtype.name, batch=batch, seqlen_q=seqlen_q,
                   seqlen_k=k_cache.shape[1], nheads=nheads, nheads_k=k_cache.shape[2], headdim=headdim,
                   mask=Mask.of(options.get("causal", False), options.get("window_size", (-1, -1))), kvcache=True)


def test_gqa_decode_fold_applies_only_where_exact():
    q = np.zeros((2, 1, 8, 32), np.float16)
    k_cache = np.zeros((2, 64, 2, 32), np.float16)
    base = _kvcache_problem(q, k_cache)
    folded = gqa_decode_fold(base)
    assert (folded.seqlen_q, folded.nheads, folded.nheads_k, folded.mask) == (4, 2, 2, Mask())
    assert gqa_decode_fold(dataclasses.replace(base, mask=Mask(-1, 0))) is not None  # causal: the row sees all keys
    assert gqa_decode_fold(dataclasses.replace(base, mask=Mask(-1, 5))) is not None
    for unfoldable in (dataclasses.replace(base, mask=Mask(16, 0)),  # the left bound moves with the row
                       dataclasses.replace(base, alibi="heads"),  # slopes per query head, distances per row
                       dataclasses.replace(base, seqlen_q=2),
                       dataclasses.replace(base, nheads=2),  # MHA: nothing to fold
                       dataclasses.replace(base, kvcache=False)):
        assert gqa_decode_fold(unfoldable) is None


SPLITS = [2, 3, 0, 128]  # 0: the heuristic; 128: more splits than K/V blocks (one per block)


def _split_cases():
    cases = []
    for i in range(8):
        dtype, splits, page = DTYPES[i % 3], SPLITS[i % 4], PAGES[(i // 2) % 4]
        shape, option = list(SHAPES)[i % 2], list(OPTIONS)[(i // 2) % 4]
        cases.append(pytest.param(dtype, splits, page, shape, option,
                                  id=f"{dtype}-splits{splits}-page{page}-{shape}-{option}"))
    return cases


def test_split_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _split_cases()]
    for axis, expected in enumerate((DTYPES, SPLITS, PAGES, list(SHAPES), list(OPTIONS))):
        assert {v[axis] for v in values} == set(expected)


@pytest.mark.parametrize("dtype, splits, page, shape_name, option_name", _split_cases())
def test_splits_match_reference_and_one_split(dtype, splits, page, shape_name, option_name):
    shape = SHAPES[shape_name]
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _caches(shape, dtype, 2, page, seed=8 + splits)
    options = _options(option_name, shape[0], shape[2], seed=9)
    caches = (paged[0], paged[1]) if paged else (k_cache, v_cache)
    table = dict(block_table=paged[2]) if paged else {}
    results = {}
    for n in (1, splits):
        k_copy, v_copy = (c.copy() for c in caches)  # each call appends the same rows to its own copy
        with sim.record() as records:
            results[n] = cuflash.attention_with_kvcache(q, k_copy, v_copy, k=k_new, v=v_new, cache_seqlens=lengths,
                                                        num_splits=n, return_lse=True, **table, **options)
        kernels = [str(launch.kernel) for launch in records.launches]
        assert any("fa2_split_kv_combine_kernel" in name for name in kernels) == (n != 1 and len(kernels) > 1)
    used = lengths + 2
    ref = attention_with_kvcache_reference(q, k_copy, v_copy, used, **table, **options)
    low = attention_with_kvcache_reference(q, k_copy, v_copy, used, dtype=q.dtype, **table, **options)
    atol = 4 * options.get("softcap", 0.0) * 2.0**-23  # the kernels' tanh (see test_varlen.py)
    for n, (out, lse) in results.items():
        tol.check_close(f"out (num_splits={n})", out, ref[0], low[0], tol.FORWARD_FACTOR, atol=atol)
        tol.check_close(f"lse (num_splits={n})", lse, ref[1], low[1], tol.FORWARD_FACTOR, atol=atol)
    # The split result against the unsplit one: the same rule, with num_splits=1 as the reference.
    tol.check_close("out vs num_splits=1", results[splits][0], results[1][0].astype(np.float64), low[0],
                    2 * tol.FORWARD_FACTOR, atol=atol)


def test_split_program_and_heuristic():
    target = targets.target("sm_80")
    problem = Problem(dtype="float16", batch=2, seqlen_q=1, seqlen_k=1000, nheads=4, nheads_k=4, headdim=128,
                      kvcache=True, num_splits=0)
    traits = fa2_tc.forward_traits(128, target)
    program = plans.forward_program("fa2", problem, target)
    splits = program.num_kv_splits
    kv_blocks = -(-1000 // traits.block_n)
    assert 1 < splits <= kv_blocks and splits == fa2.split_heuristic(8, target.sm_count, kv_blocks)
    forward, combine = program.launches
    assert forward.grid == (splits, 4, 2) and str(combine.kernel) == "cuflash::fa2_split_kv_combine_kernel<__half>"
    assert {s.name: s.shape for s in program.scratch} == {"out_accum": (splits, 2, 4, 128),
                                                         "lse_accum": (splits, 2, 4, 1)}
    # Asked counts are kept up to one split per K/V block; 1 is the one-launch program.
    assert plans.forward_program("fa2", dataclasses.replace(problem, num_splits=5), target).num_kv_splits == 5
    assert plans.forward_program("fa2", dataclasses.replace(problem, num_splits=100), target).num_kv_splits == kv_blocks
    assert len(plans.forward_program("fa2", dataclasses.replace(problem, num_splits=1), target).launches) == 1
    # The heuristic: no split once the grid fills 80% of the SMs, or with one K/V block; otherwise the fewest splits
    # whose last wave is >= 85% as full as the best count's.
    assert fa2.split_heuristic(blocks=100, sm_count=108, kv_blocks=64) == 1
    assert fa2.split_heuristic(blocks=8, sm_count=108, kv_blocks=1) == 1
    assert fa2.split_heuristic(blocks=8, sm_count=108, kv_blocks=4) == 4  # every K/V block its own split
    # 8 splits fill 128 of 132 SMs (97%); 7 fill 112 (85%), within 85% of that, and fewer splits win.
    assert fa2.split_heuristic(blocks=16, sm_count=132, kv_blocks=128) == 7
    assert fa2.split_heuristic(blocks=27, sm_count=108, kv_blocks=64) == 4  # 27 x 4 = 108: exactly one wave
    # The device's SM count reaches the plan: a larger GPU splits more.
    small, large = (dataclasses.replace(target, sm_count=n) for n in (16, 132))
    assert plans.forward_program("fa2", problem, small).num_kv_splits < splits < \
        plans.forward_program("fa2", problem, large).num_kv_splits


def _decode_rows_read(lengths, nheads, nheads_k, capacity=192, page=None, **options):
    """The Q, K and V rows a one-row decode's forward launch reads over caches of ``capacity`` rows (contiguous, or
    in pages of ``page`` rows), from its traffic at head dims 56 and 40 (see the test below; paged, the block table
    lookups grow with the head dim too, one per 16-byte chunk of a row: see the windowed fold's traffic test)."""
    def forward_bytes(headdim):
        rng = np.random.default_rng(10)
        q = rng.standard_normal((len(lengths), 1, nheads, headdim)).astype(np.float16)
        k_cache, v_cache = (rng.standard_normal((len(lengths), capacity, nheads_k, headdim)).astype(np.float16)
                            for _ in range(2))
        if page is not None:
            table = np.arange(len(lengths) * capacity // page, dtype=np.int32).reshape(len(lengths), -1)
            k_cache, v_cache = (_paged(c, table, page) for c in (k_cache, v_cache))
            options["block_table"] = table
        with sim.record() as records:
            cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, **options)
        return records.launches[0].global_bytes_read

    return (forward_bytes(56) - forward_bytes(40)) // ((56 - 40) * 2)


def test_splits_read_every_key_once_and_the_fold_reads_kv_once_per_kv_head():
    """Exact K/V and Q traffic of the forward launch. The simulator also counts every thread's reads of the cache
    lengths, so the test takes the difference between head dims 56 and 40, which share tiles, loop structure and copy
    paths (both run on the d64 instance below its compiled head dim, so neither takes the whole-tile K/V copies,
    which read no length): only the bytes of Q, K and V rows grow, by (56 - 40) * 2 bytes per row read."""
    batch, nheads, nheads_k = 3, 4, 2
    lengths = np.array([192, 150, 64], np.int32)  # 3, 3 and 1 K/V blocks of 64 keys (the d64 tile)

    def rows_read(**options):
        return _decode_rows_read(lengths, nheads, nheads_k, **options)

    keys = int(lengths.sum())
    # Folded: every kv head's keys once, and each query head's row once (its group's rows in one Q block).
    assert rows_read(num_splits=1) == 2 * keys * nheads_k + batch * nheads
    # Three splits: still every key once; Q is loaded by each split that has keys (3 + 3 + 1 per head group).
    assert rows_read(num_splits=3) == 2 * keys * nheads_k + (3 + 3 + 1) * nheads
    # Unfolded (zero ALiBi slopes change no score but keep each query head its own Q block): keys once per query head.
    assert rows_read(num_splits=1, alibi_slopes=np.zeros(nheads, np.float32)) == 2 * keys * nheads + batch * nheads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splits_race_free(dtype):
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _caches(SHAPES["prefill-mqa"], dtype, 2, 48, seed=11)
    k_paged, v_paged, table = paged
    with sim.checking("race"):
        out, lse = cuflash.attention_with_kvcache(q, k_paged, v_paged, k=k_new, v=v_new, cache_seqlens=lengths,
                                                  block_table=table, causal=True, num_splits=3, return_lse=True)
    ref, low = (attention_with_kvcache_reference(q, k_paged, v_paged, lengths + 2, block_table=table, causal=True,
                                                 dtype=dt) for dt in (np.float64, q.dtype))
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)


def _split_decode_under_asan(dtype):
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _caches(SHAPES["decode-gqa"], dtype, 1, None, seed=12)
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                              num_splits=3, return_lse=True)
    ref = attention_with_kvcache_reference(q, k_cache, v_cache, lengths + 1)
    low = attention_with_kvcache_reference(q, k_cache, v_cache, lengths + 1, dtype=q.dtype)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)
    return True


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_splits_clean_under_asan(dtype):
    assert sim.run_in_asan_subprocess(_split_decode_under_asan, dtype) is True


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
        "table-no-pages": (dict(paged_base, block_table=table[:, :0], k=None, v=None, cache_seqlens=0),
                           "block_table must be int32 .* at least one page per sequence"),
        "table-outside": (dict(paged_base, block_table=outside), "block_table names pages outside the cache"),
        "page-size": (dict(paged_base, k_cache=k_paged[:, :8], v_cache=v_paged[:, :8]), "page size .* multiple of 16"),
        "splits-over-limit": (dict(base, num_splits=129), r"num_splits must be in \[0, 128\]"),
        "splits-negative": (dict(base, num_splits=-1), r"num_splits must be in \[0, 128\]"),
        "splits-type": (dict(base, num_splits=2.0), "num_splits must be an int"),
        "dropout-algorithm": (dict(base, algorithm="fa1"), "kvcache is supported by algorithm='fa2' only"),
        "cache-not-contiguous": (dict(base, k_cache=np.asfortranarray(k_cache)), "updated in place"),
        "cache-batch-without-index": (dict(base, k_cache=k_cache[:2], v_cache=v_cache[:2]),
                                      "k_cache must have q's batch size .* unless cache_batch_idx"),
        "index-outside": (dict(base, cache_batch_idx=np.array([0, 3, 1], np.int32)),
                          r"cache_batch_idx\[1\] must be in \[0, 3\)"),
        "index-negative": (dict(base, cache_batch_idx=np.array([0, -1, 1], np.int32)),
                           r"cache_batch_idx\[1\] must be in \[0, 3\)"),
        "index-repeated-with-new-rows": (dict(base, cache_batch_idx=np.array([2, 0, 2], np.int32)),
                                         "cache_batch_idx must name distinct cache rows"),
        "index-dtype": (dict(base, cache_batch_idx=np.array([0, 1, 2], np.int64)), "cache_batch_idx must be an int32"),
        "index-paged": (dict(paged_base, cache_batch_idx=np.array([0, 1, 2], np.int32)),
                        "cache_batch_idx indexes contiguous caches"),
        "leftpad-past-cached-rows": (dict(base, cache_leftpad=np.array([0, 5, 38], np.int32)),
                                     r"cache_leftpad\[2\] must be in 0..cache_seqlens\[2\] = 37, got 38"),
        "leftpad-negative": (dict(base, cache_leftpad=np.array([0, -2, 0], np.int32)), r"cache_leftpad\[1\]"),
        "leftpad-shape": (dict(base, cache_leftpad=np.zeros(2, np.int32)), r"cache_leftpad must be an int32 array "
                                                                          r"of shape \(batch,\) = \(3,\)"),
        "leftpad-paged": (dict(paged_base, cache_leftpad=np.zeros(3, np.int32)), "cache_leftpad indexes contiguous"),
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


# ---- rotary embedding (rotary_cos / rotary_sin / rotary_interleaved) --------------------------------------------


def _rotary_tables(rows, rotary_dim, dtype, seed):
    angles = np.random.default_rng(seed).uniform(-np.pi, np.pi, (rows, rotary_dim // 2))
    return np.cos(angles).astype(numpy_dtype(dtype)), np.sin(angles).astype(numpy_dtype(dtype))


def _rotate_by_pairs(x, cos, sin, positions, interleaved):
    """The test's own rotation: each pair (a, b) of rotary features as the 2x2 rotation [[c, -s], [s, c]] applied
    in float32 (batch, rows, heads, d), pair indices spelled out."""
    half = cos.shape[1]
    first = np.arange(0, 2 * half, 2) if interleaved else np.arange(half)
    second = first + 1 if interleaved else first + half
    out = x.copy()
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            c = cos[positions[b, i]].astype(np.float32)
            s = sin[positions[b, i]].astype(np.float32)
            a, bb = x[b, i][:, first].astype(np.float32), x[b, i][:, second].astype(np.float32)
            out[b, i][:, first] = (a * c - bb * s).astype(x.dtype)
            out[b, i][:, second] = (a * s + bb * c).astype(x.dtype)
    return out


ROTARY_CASES = [  # (dtype, interleaved, options, paged, rotary_dim): causal and not, windowed, paged and not
    ("float16", False, dict(causal=True), False, 32),
    ("bfloat16", True, dict(), True, 40),
    ("float32", False, dict(window_size=(20, 3)), True, 16),
    ("float16", True, dict(causal=True), True, 40),
    ("bfloat16", False, dict(attention_chunk=64), True, 32),  # chunked: local, so q's rows apart (FA3's rule)
]


@pytest.mark.parametrize("dtype, interleaved, options, paged, rotary_dim", ROTARY_CASES)
def test_rotary_equals_rotating_q_and_k_first(dtype, interleaved, options, paged, rotary_dim):
    """FA2's rotary: q and the new rows rotated at their positions (q's rows apart when causal, windowed or chunked,
    else all at cache_seqlens), then the plain call; bit for bit, caches included, and the cached rows untouched."""
    shape = (3, 3, 4, 2, 40, 192)  # chunked prefill of 3 rows, GQA, head dim 40
    q, k_cache, v_cache, k_new, v_new, lengths, pages = _caches(shape, dtype, 3, 16 if paged else None, seed=11)
    cos, sin = _rotary_tables(192, rotary_dim, dtype, seed=12)
    rows_apart = (bool(options.get("causal")) or options.get("window_size", (-1, -1)) != (-1, -1)
                  or options.get("attention_chunk", 0) > 0)
    q_at = lengths[:, None] + np.arange(q.shape[1])[None, :] * rows_apart
    k_at = lengths[:, None] + np.arange(3)[None, :]
    caches = dict(k_cache=pages[0], v_cache=pages[1], block_table=pages[2]) if paged else \
        dict(k_cache=k_cache, v_cache=v_cache)
    plain = {name: x.copy() for name, x in caches.items()}
    out, lse = cuflash.attention_with_kvcache(q, **caches, k=k_new, v=v_new, cache_seqlens=lengths, rotary_cos=cos,
                                              rotary_sin=sin, rotary_interleaved=interleaved, return_lse=True,
                                              **options)
    want_out, want_lse = cuflash.attention_with_kvcache(
        _rotate_by_pairs(q, cos, sin, q_at, interleaved), **plain, k=_rotate_by_pairs(k_new, cos, sin, k_at,
                                                                                       interleaved),
        v=v_new, cache_seqlens=lengths, return_lse=True, **options)
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    for name in caches:
        assert np.array_equal(caches[name], plain[name]), name
    if not paged:  # the new rows rotated, the features past rotary_dim and every cached row as they were
        for b in range(shape[0]):
            new_rows = k_cache[b, lengths[b]:lengths[b] + 3]
            assert np.array_equal(new_rows[..., rotary_dim:], k_new[b, ..., rotary_dim:])
            assert not np.array_equal(new_rows, k_new[b])


def test_bad_rotary_is_refused_before_anything_is_written():
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _caches(SHAPES["decode-gqa"], "float16", 2, None, seed=7)
    cos, sin = _rotary_tables(192, 16, "float16", seed=8)
    base = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=lengths, rotary_cos=cos,
                rotary_sin=sin)
    cases = {
        "only cos": (dict(base, rotary_sin=None), ValueError, "rotary_cos needs rotary_sin"),
        "no new rows": (dict(base, k=None, v=None), ValueError, "pass k and v"),
        "dtype": (dict(base, rotary_cos=cos.astype(np.float32)), TypeError, "rotary_cos must have q's dtype float16"),
        "short table": (dict(base, rotary_cos=cos[:100], rotary_sin=sin[:100]), ValueError,
                        r"at least 192 \(the caches' capacity per sequence\), got 100"),
        "too wide": (dict(base, rotary_cos=np.ones((192, 24), np.float16), rotary_sin=np.ones((192, 24), np.float16)),
                     ValueError, "rotates 48 features, more than the head dim 40"),
        "shapes differ": (dict(base, rotary_sin=sin[:, :4]), ValueError, "rotary_sin must have rotary_cos's shape"),
        "interleaved type": (dict(base, rotary_interleaved=1), TypeError, "rotary_interleaved must be a bool"),
    }
    for name, (arguments, error, message) in cases.items():
        before = (k_cache.copy(), v_cache.copy())
        with sim.record() as records, pytest.raises(error, match=message):
            cuflash.attention_with_kvcache(**arguments)
        assert records.launches == [], name
        assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1]), name


# ---- cache indexing (cache_batch_idx / cache_leftpad) ------------------------------------------------------------


def _relaid(cache, lengths, index, leftpad, capacity):
    """The caches as a plain call sees the indexed ones: sequence b's row cache_batch_idx[b] with its padding cut,
    its first key at row 0; the rest zero."""
    relaid = np.zeros((len(index), capacity) + cache.shape[2:], cache.dtype)
    for b in range(len(index)):
        rows = lengths[b] - leftpad[b]
        relaid[b, :rows] = cache[index[b], leftpad[b]:lengths[b]]
    return relaid


INDEXING_CASES = [  # (dtype, new rows, options, num_splits, rotary, head dim)
    ("float16", 1, dict(causal=True), 1, False, 40),
    ("bfloat16", 3, dict(window_size=(40, 2)), 2, True, 40),
    ("float32", 0, dict(), 0, False, 40),
    ("float16", 3, dict(causal=True, softcap=5.0), 3, True, 40),
    # At a compiled head dim the mma.sync forward copies whole K/V blocks from a base pointer of its own: from the
    # named cache row, past the padding (it once took batch b's row 0: a wrong result over more than one block).
    ("float16", 0, dict(causal=True), 1, False, 64),
    ("bfloat16", 2, dict(window_size=(40, 2)), 1, False, 128),
]


@pytest.mark.parametrize("dtype, new, options, splits, with_rotary, headdim", INDEXING_CASES)
def test_cache_indexing_equals_the_call_on_relaid_caches(dtype, new, options, splits, with_rotary, headdim):
    """cache_batch_idx and cache_leftpad: bit for bit the plain call on caches relaid so that each sequence's keys
    start at row 0 of its own batch row (its rotary positions counted from there too), with split-KV and rotary;
    the new rows land at cache_seqlens in the named cache rows, nothing else in the caches changes; and within
    FA2's rule of the float64 reference."""
    rng = np.random.default_rng(21)
    dt = numpy_dtype(dtype)
    batch, cache_batch, seqlen_q, nheads, nheads_k, capacity = 3, 5, 2, 4, 2, 160
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dt)
    k_cache, v_cache = (rng.standard_normal((cache_batch, capacity, nheads_k, headdim)).astype(dt) for _ in range(2))
    k_new, v_new = (rng.standard_normal((batch, new, nheads_k, headdim)).astype(dt) for _ in range(2))
    lengths = np.array([70, 5, 150], np.int32)
    index, leftpad = np.array([4, 0, 2], np.int32), np.array([10, 0, 33], np.int32)
    extra = dict(options, num_splits=splits, return_lse=True)
    if with_rotary:
        extra["rotary_cos"], extra["rotary_sin"] = _rotary_tables(capacity, 16, dtype, seed=22)
    if new:
        extra.update(k=k_new, v=v_new)
    relaid = [_relaid(c, lengths, index, leftpad, capacity) for c in (k_cache, v_cache)]
    before = k_cache.copy(), v_cache.copy()
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=index,
                                              cache_leftpad=leftpad, **extra)
    want_out, want_lse = cuflash.attention_with_kvcache(q, *relaid, cache_seqlens=lengths - leftpad, **extra)
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    for cache, old, plain in zip((k_cache, v_cache), before, relaid):
        for b in range(batch):  # the appended rows, as the plain call appended them; the rest as before
            appended = plain[b, lengths[b] - leftpad[b]:lengths[b] - leftpad[b] + new]
            assert np.array_equal(cache[index[b], lengths[b]:lengths[b] + new], appended)
            cache[index[b], lengths[b]:lengths[b] + new] = old[index[b], lengths[b]:lengths[b] + new]
        assert np.array_equal(cache, old)
    if not with_rotary:
        indexing = dict(cache_batch_idx=index, cache_leftpad=leftpad)
        appended = [c.copy() for c in before]
        for c, rows in zip(appended, (k_new, v_new)):
            for b in range(batch):
                c[index[b], lengths[b]:lengths[b] + new] = rows[b]
        reference = [attention_with_kvcache_reference(q, *appended, lengths + new, dtype=d, **indexing,
                                                      **{k: v for k, v in options.items()})
                     for d in (np.float64, dt)]
        tol.check_close("out", out, reference[0][0], reference[1][0], tol.FORWARD_FACTOR)
        tol.check_close("lse", lse, reference[0][1], reference[1][1], tol.FORWARD_FACTOR)


@pytest.mark.parametrize("dtype, window_size, splits, indexing", [
    ("float16", (30, 0), 1, None),               # sliding-window decode (Mistral, Gemma's local layers)
    ("bfloat16", (100, -1), 3, "leftpad"),       # split-KV, keys past left padding
    ("float32", (0, 0), 0, "batch_idx"),         # the row sees its own key only; cache rows named by cache_batch_idx
    ("float16", (70, 0), 1, "chunk"),            # with chunks: keys from the later of the window's and the chunk's
])
def test_windowed_gqa_decode_folds_on_contiguous_caches(dtype, window_size, splits, indexing):
    """A one-row GQA decode under a window's left bound runs folded (the group's heads as rows) with its keys starting
    at the row's first visible key (cache_leftpad moved, no mask): the float64 reference's result, the K/V of each
    kv head read once and only the window's keys."""
    batch, nheads, nheads_k, headdim, capacity = 3, 8, 2, 64, 256
    rng = np.random.default_rng(4)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, 1, nheads, headdim)).astype(dt)
    k_cache, v_cache = (rng.standard_normal((batch + 1, capacity, nheads_k, headdim)).astype(dt) for _ in range(2))
    new_k, new_v = (rng.standard_normal((batch, 1, nheads_k, headdim)).astype(dt) for _ in range(2))
    lengths = np.array([200, 17, 255], np.int32)
    options = dict(window_size=window_size, causal=True, num_splits=splits)
    reference_options = dict(window_size=window_size, causal=True)
    if indexing == "leftpad":
        options["cache_leftpad"] = reference_options["cache_leftpad"] = np.array([5, 0, 150], np.int32)
    if indexing == "batch_idx":
        options["cache_batch_idx"] = reference_options["cache_batch_idx"] = np.array([3, 0, 1], np.int32)
    if indexing == "chunk":
        options["attention_chunk"] = reference_options["attention_chunk"] = 64
    if indexing != "batch_idx":
        k_cache, v_cache = k_cache[:batch].copy(), v_cache[:batch].copy()
    with sim.record() as records:
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=new_k, v=new_v, cache_seqlens=lengths,
                                                  return_lse=True, **options)
    assert records.launches[0].grid[1] == nheads_k  # folded: a Q block per kv head
    ref, low = (attention_with_kvcache_reference(q, k_cache, v_cache, lengths + 1, dtype=d, **reference_options)
                for d in (np.float64, q.dtype))
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)


def _paged(cache, table, page, spare_pages=2, seed=9):
    """Contiguous caches' rows laid into shuffled pages of ``page`` rows (table: sequence b's pages)."""
    batch, capacity = cache.shape[:2]
    pages = np.random.default_rng(seed).standard_normal((table.size + spare_pages, page, *cache.shape[2:]))
    pages = pages.astype(cache.dtype)
    for b in range(batch):
        for i in range(table.shape[1]):
            rows = cache[b, i * page:(i + 1) * page]
            pages[table[b, i], :len(rows)] = rows
    return pages


@pytest.mark.parametrize("dtype, window_size, splits, page, target, chunk", [
    ("float16", (150, 0), 1, 128, None, 0),     # mma.sync: pages of whole K/V blocks, keys from inside a page
    ("bfloat16", (100, -1), 3, 16, None, 0),    # split-KV over pages smaller than a block
    ("float32", (0, 0), 0, 48, None, 0),        # SIMT; the row sees its own key only
    ("float16", (200, 0), 2, 128, "sm_90", 0),  # the Hopper forward: the load path (a TMA box reads one page)
    ("bfloat16", (30, 0), 1, 32, None, 64),     # chunks too: keys from the later of the window's and the chunk's
])
def test_windowed_gqa_decode_folds_on_paged_caches(dtype, window_size, splits, page, target, chunk):
    """A paged cache's windowed GQA decode folds too: the pages before the row's first visible key are dropped from
    the table and its row in its page is the call's cache_leftpad (chunks.paged_keys_from). The float64 reference's
    result, each kv head's pages read once, and bit for bit the contiguous caches' folded call."""
    batch, nheads, nheads_k, headdim, capacity = 3, 8, 2, 64, 256
    rng = np.random.default_rng(5)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, 1, nheads, headdim)).astype(dt)
    k_cache, v_cache = (rng.standard_normal((batch, capacity, nheads_k, headdim)).astype(dt) for _ in range(2))
    new_k, new_v = (rng.standard_normal((batch, 1, nheads_k, headdim)).astype(dt) for _ in range(2))
    lengths = np.array([200, 17, 255], np.int32)
    per_sequence = -(-capacity // page)
    table = rng.permutation(batch * per_sequence + 2)[:batch * per_sequence].reshape(batch, per_sequence)
    table = table.astype(np.int32)
    k_pages, v_pages = _paged(k_cache, table, page), _paged(v_cache, table, page)
    options = dict(window_size=window_size, causal=True, num_splits=splits, return_lse=True, attention_chunk=chunk)
    with sim.targeting(target or "sm_80"):
        with sim.record() as records:
            out, lse = cuflash.attention_with_kvcache(q, k_pages, v_pages, k=new_k, v=new_v, cache_seqlens=lengths,
                                                      block_table=table, **options)
        contiguous = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=new_k, v=new_v, cache_seqlens=lengths,
                                                    **options)
    assert records.launches[0].grid[1] == nheads_k  # folded: a Q block per kv head
    assert np.array_equal(out, contiguous[0]) and np.array_equal(lse, contiguous[1])
    ref, low = (attention_with_kvcache_reference(q, k_pages, v_pages, lengths + 1, block_table=table, dtype=d,
                                                 window_size=window_size, causal=True, attention_chunk=chunk)
                for d in (np.float64, q.dtype))
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)


def test_windowed_decode_fold_reads_the_window_once_per_kv_head():
    """Exact Q, K and V rows the folded windowed decode reads (head dims 56 and 40 apart, as in the split test
    above): each kv head's window of keys once, where the unfolded decode read it once per query head."""
    batch, nheads, nheads_k, window = 3, 4, 2, 40
    lengths = np.array([192, 150, 30], np.int32)

    def rows_read(**options):
        return _decode_rows_read(lengths, nheads, nheads_k, num_splits=1, window_size=(window, 0), **options)

    keys = int(np.minimum(lengths, window + 1).sum())
    assert rows_read() == 2 * keys * nheads_k + batch * nheads
    # Paged, from inside a page: the same rows, plus the block table entry the copies look up per 16-byte chunk of a
    # K/V row (5 chunks at head dim 40, 7 at 56: 8 bytes more per row, a quarter of the 32 its data grows by).
    assert rows_read(page=16) == 2 * keys * nheads_k * 5 // 4 + batch * nheads
    # Unfolded (zero ALiBi slopes keep each query head its own Q block): the window once per query head.
    unfolded = rows_read(alibi_slopes=np.zeros(nheads, np.float32))
    assert unfolded >= 2 * keys * nheads + batch * nheads, unfolded
