"""The Hopper forward (fa3_forward.cu) on varlen batches, KV caches (contiguous and paged) and split-KV, through the
public API on the simulator targeting sm_90, against the float64 reference under FlashAttention's rule and against
fa2's mma.sync forward (the simulator's default target) on the same call.

* Varlen, a grid in rotation: packings with empty and one-row sequences, sequences of several Q and K/V blocks,
  seqlen_q above and below seqlen_k; MHA/GQA/MQA; no mask, causal, windows; both dtypes; head dims on the TMA path
  (the maps span the packed arrays: a box reads the next sequence's rows) and one on the load path (rows of 200
  bytes). Rows that see no key give out 0 and lse -inf.
* KV caches, a grid in rotation: contiguous and paged with pages that hold whole K/V blocks (TMA: one page lookup a
  block) and pages that do not (the load path, a lookup a row), cache_seqlens with 0, new K/V appended, masks; the
  cache rows past each sequence's keys and the spare pages hold NaN, which no result may see (a ragged last block
  is copied with loads, zero-filled, where the map would read them). cache_batch_idx and cache_leftpad.
* Split-KV: 2, 3 and more splits than K/V blocks (splits with no block of a sequence), contiguous and paged, lse
  checked; the split forward then fa2's combine kernel.
* Which copy path each call took (AttentionParams.tma_loads); plans.explain names the Hopper kernel for these.
* Race mode on a varlen and a paged instance; a planted bug (the ragged block left to the map) fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels.families import fa3
from cuflash.reference import attention_with_kvcache_reference
from test_kvcache import _caches
from test_varlen import _cu, _packed_inputs, _rows_without_key


@pytest.fixture
def launches(monkeypatch):
    """The (kernel, tma_loads) of every simulator launch of the test."""
    seen = []
    launch = SimulatorBackend.launch

    def spy(self, plan, params, buffers):
        seen.append((plan.kernel.name_expr, int(params["tma_loads"])))
        return launch(self, plan, params, buffers)

    monkeypatch.setattr(SimulatorBackend, "launch", spy)
    return seen


def _fa3_launch(launches, tma):
    """The call ran the Hopper forward first (then, with splits, the combine kernel), on the TMA path or not."""
    kernel, tma_loads = launches[0]
    assert kernel.startswith("cuflash::fa3_forward_kernel<"), launches
    assert tma_loads == int(tma), launches
    assert all("fa3_forward" not in k and "fa2_tc_forward" not in k for k, _ in launches[1:]), launches


# ---- varlen ----------------------------------------------------------------------------------------------------

PACKINGS = {
    "empty-and-ragged": ([5, 0, 70, 33], [9, 3, 140, 0]),
    "single-rows": ([1, 1, 1], [1, 300, 2]),
    "several-blocks": ([250, 130], [203, 7]),
    "q-longer-then-k-longer": ([200, 17], [17, 200]),
}
HEADS = [(2, 2, 64), (4, 2, 128), (3, 1, 64), (4, 2, 100)]  # d100: rows of 200 bytes, TMA cannot take them
MASKS = {"full": dict(), "causal": dict(causal=True), "window": dict(window_size=(11, 4)),
         "causal-window": dict(causal=True, window_size=(19, -1))}


def _varlen_cases():
    cases = []
    for i in range(6):
        packing, heads, mask = list(PACKINGS)[i % 4], HEADS[(i + i // 4) % 4], list(MASKS)[(i + 1) % 4]
        dtype = fa3.DTYPES[i % 2]
        cases.append(pytest.param(packing, heads, mask, dtype, id=f"{packing}-h{heads}-{mask}-{dtype}"))
    return cases


def test_varlen_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _varlen_cases()]
    for axis, expected in enumerate((list(PACKINGS), HEADS, list(MASKS), list(fa3.DTYPES))):
        assert {v[axis] for v in values} == set(expected)


def _check_varlen(lengths_q, lengths_k, q, k, v, options, out, lse):
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    ref = tol.forward_references(q, k, v, cu_seqlens=(cu_q, cu_k), **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = _rows_without_key(lengths_q, lengths_k, options)
    assert np.all(out[empty].astype(np.float32) == 0) and np.all(lse[:, empty] == -np.inf)
    return ref


@pytest.mark.parametrize("packing, heads, mask, dtype", _varlen_cases())
def test_varlen_matches_reference_and_fa2(packing, heads, mask, dtype, launches):
    lengths_q, lengths_k = PACKINGS[packing]
    nheads, nheads_k, headdim = heads
    q, k, v, _ = _packed_inputs(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, seed=len(packing))
    options = MASKS[mask]
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    with sim.targeting("sm_90"):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    _fa3_launch(launches, tma=headdim % 8 == 0)
    ref = _check_varlen(lengths_q, lengths_k, q, k, v, options, out, lse)
    fa2_out, fa2_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert "fa2_tc_forward_kernel" in launches[-1][0]
    tol.check_close("out vs fa2", out, fa2_out.astype(np.float64), ref.out_lowp, 2 * tol.FORWARD_FACTOR)
    tol.check_close("lse vs fa2", lse, fa2_lse.astype(np.float64), ref.lse_lowp, 2 * tol.FORWARD_FACTOR)


# ---- KV cache and split-KV --------------------------------------------------------------------------------------

# (batch, seqlen_q, nheads, nheads_k, headdim, capacity): the d64 and d128 tiles take 128 keys a block (a paged cache
# takes the masked tile), so 300 rows are 3 blocks, the last ragged; lengths 0, capacity - new, 37, 100.
SHAPES = {"decode-gqa": (4, 1, 4, 2, 64, 300), "prefill-mqa": (3, 9, 3, 1, 128, 300)}
PAGES = [None, 48, 128, 256]  # rows per page (None: contiguous); 48 is no multiple of 128: the load path
NEW_ROWS = [0, 3]
CACHE_MASKS = {"full": dict(), "causal": dict(causal=True), "window": dict(window_size=(30, 0))}


def _kvcache_cases():
    cases = []
    for i in range(6):
        page, new, shape = PAGES[i % 4], NEW_ROWS[i % 2 ^ (i // 4)], list(SHAPES)[(i // 2) % 2]
        mask, dtype = list(CACHE_MASKS)[i % 3], fa3.DTYPES[(i // 3) % 2]
        cases.append(pytest.param(page, new, shape, mask, dtype, id=f"page{page}-new{new}-{shape}-{mask}-{dtype}"))
    return cases


def test_kvcache_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _kvcache_cases()]
    for axis, expected in enumerate((PAGES, NEW_ROWS, list(SHAPES), list(CACHE_MASKS), list(fa3.DTYPES))):
        assert {v[axis] for v in values} == set(expected)


def _poisoned(shape, dtype, new, page, seed):
    """test_kvcache's caches with NaN in every row no sequence uses after the append (past cache_seqlens + new) and
    in the spare pages: a result that sees one is NaN."""
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _caches(shape, dtype, new, page, seed)
    used = lengths + new
    for cache in (k_cache, v_cache):
        for b, n in enumerate(used):
            cache[b, n:] = np.nan
    if paged is not None:
        k_paged, v_paged, table = paged
        spare = np.setdiff1d(np.arange(k_paged.shape[0]), table)
        for cache in (k_paged, v_paged):
            cache[spare] = np.nan
            for b, n in enumerate(used):
                for j in range(n, table.shape[1] * page):
                    cache[table[b, j // page], j % page] = np.nan
    return q, k_cache, v_cache, k_new, v_new, lengths, paged


def _kvcache_call(q, caches, k_new, v_new, lengths, table, **options):
    new = dict(k=k_new, v=v_new) if k_new.shape[1] else {}
    paged = dict(block_table=table) if table is not None else {}
    k_cache, v_cache = (c.copy() for c in caches)  # each call appends to its own copy
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_lse=True, **new,
                                              **paged, **options)
    return out, lse, k_cache, v_cache


def _check_kvcache(out, lse, q, caches, used, table, options):
    paged = dict(block_table=table) if table is not None else {}
    ref = attention_with_kvcache_reference(q, *caches, used, **paged, **options)
    low = attention_with_kvcache_reference(q, *caches, used, dtype=q.dtype, **paged, **options)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)
    empty = used == 0  # cache_seqlens 0 and nothing appended: no key
    assert np.all(out[empty].astype(np.float32) == 0) and np.all(lse[empty] == -np.inf)
    return low


@pytest.mark.parametrize("page, new, shape_name, mask, dtype", _kvcache_cases())
def test_kvcache_matches_reference_and_fa2(page, new, shape_name, mask, dtype, launches):
    shape = SHAPES[shape_name]
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _poisoned(shape, dtype, new, page, seed=3 + new)
    caches, table = ((paged[0], paged[1]), paged[2]) if paged else ((k_cache, v_cache), None)
    options = CACHE_MASKS[mask]
    with sim.targeting("sm_90"):
        out, lse, k_after, v_after = _kvcache_call(q, caches, k_new, v_new, lengths, table, num_splits=1, **options)
    tma = page is None or page % 128 == 0  # a paged cache takes the masked tile: 128 keys a block at d64 and d128
    _fa3_launch(launches, tma=tma)
    assert len(launches) == 1
    low = _check_kvcache(out, lse, q, (k_after, v_after), lengths + new, table, options)
    fa2_out, fa2_lse, _, _ = _kvcache_call(q, caches, k_new, v_new, lengths, table, num_splits=1, **options)
    assert "fa2_tc_forward_kernel" in launches[-1][0]
    tol.check_close("out vs fa2", out, fa2_out.astype(np.float64), low[0], 2 * tol.FORWARD_FACTOR)


SPLIT_CASES = [  # (num_splits, page, shape, mask, dtype): 50 is more than any sequence's K/V blocks
    (2, None, "decode-gqa", "causal", "float16"),
    (3, 128, "prefill-mqa", "full", "bfloat16"),
    (50, None, "prefill-mqa", "window", "bfloat16"),
    (50, 48, "decode-gqa", "full", "float16"),
]


@pytest.mark.parametrize("splits, page, shape_name, mask, dtype", SPLIT_CASES)
def test_splits_match_reference_and_one_split(splits, page, shape_name, mask, dtype, launches):
    shape = SHAPES[shape_name]
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _poisoned(shape, dtype, 2, page, seed=8 + splits)
    caches, table = ((paged[0], paged[1]), paged[2]) if paged else ((k_cache, v_cache), None)
    options = CACHE_MASKS[mask]
    with sim.targeting("sm_90"):
        out, lse, k_after, v_after = _kvcache_call(q, caches, k_new, v_new, lengths, table, num_splits=splits,
                                                   **options)
        assert [k.split("<")[0] for k, _ in launches] == ["cuflash::fa3_forward_kernel",
                                                           "cuflash::fa2_split_kv_combine_kernel"]
        one_out, one_lse, _, _ = _kvcache_call(q, caches, k_new, v_new, lengths, table, num_splits=1, **options)
    low = _check_kvcache(out, lse, q, (k_after, v_after), lengths + 2, table, options)
    tol.check_close("out vs num_splits=1", out, one_out.astype(np.float64), low[0], 2 * tol.FORWARD_FACTOR)
    tol.check_close("lse vs num_splits=1", lse, one_lse.astype(np.float64), low[1], 2 * tol.FORWARD_FACTOR)


def test_cache_batch_idx_and_leftpad(launches):
    """A contiguous cache read through cache_batch_idx (another cache row per sequence) from cache_leftpad on, on the
    TMA path (the map spans the whole cache: key_tma_coords), with splits."""
    rng = np.random.default_rng(21)
    batch, cache_batch, seqlen_q, nheads, nheads_k, headdim, capacity = 3, 5, 2, 4, 2, 64, 300
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((cache_batch, capacity, nheads_k, headdim)).astype(np.float16)
                        for _ in range(2))
    lengths = np.array([270, 5, 150], np.int32)
    index, leftpad = np.array([4, 0, 2], np.int32), np.array([10, 0, 33], np.int32)
    indexing = dict(cache_batch_idx=index, cache_leftpad=leftpad, causal=True)
    for b, i in enumerate(index):  # rows before and past each sequence's keys, and the unused cache rows, NaN
        k_cache[i, lengths[b]:] = v_cache[i, lengths[b]:] = np.nan
        k_cache[i, :leftpad[b]] = v_cache[i, :leftpad[b]] = np.nan
    k_cache[[1, 3]] = v_cache[[1, 3]] = np.nan
    for splits in (1, 3):
        launches.clear()
        with sim.targeting("sm_90"):
            out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits,
                                                      return_lse=True, **indexing)
        _fa3_launch(launches, tma=True)
        ref, low = (attention_with_kvcache_reference(q, k_cache, v_cache, lengths, dtype=d, **indexing)
                    for d in (np.float64, np.float16))
        tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
        tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)


# ---- race mode, a planted bug ---------------------------------------------------------------------------------


def test_race_free_on_varlen_and_paged(launches):
    """The TMA producer's warp copying a ragged block with loads (one arrival after __syncwarp), TMA boxes reading
    the next sequence's rows, a page lookup per block: race mode finds no unordered access."""
    lengths_q, lengths_k = [70, 0, 1], [150, 3, 40]
    q, k, v, _ = _packed_inputs(lengths_q, lengths_k, 4, 2, 64, "float16", seed=5)
    with sim.targeting("sm_90"), sim.checking("race"):
        out, lse = cuflash.attention_varlen(q, k, v, _cu(lengths_q), _cu(lengths_k), return_lse=True, causal=True)
    _check_varlen(lengths_q, lengths_k, q, k, v, dict(causal=True), out, lse)
    shape = (2, 3, 2, 1, 64, 200)
    q, k_cache, v_cache, k_new, v_new, lengths, paged = _poisoned(shape, "bfloat16", 1, 128, seed=6)
    with sim.targeting("sm_90"), sim.checking("race"):
        out, lse, k_after, v_after = _kvcache_call(q, paged[:2], k_new, v_new, lengths, paged[2], num_splits=2)
    _check_kvcache(out, lse, q, (k_after, v_after), lengths + 1, paged[2], {})
    assert [tma for kernel, tma in launches if "fa3_forward" in kernel] == [1, 1]


def test_planted_ragged_block_left_to_the_map_sees_the_poison(monkeypatch, tmp_path):
    """Planted: the ragged last K/V block copied by the map like the others (as a fixed-length batch's, whose map
    zero-fills past the keys): the cache's NaN rows past the keys reach P V (P's zeros do not keep them out)."""
    from test_fa3_forward import _planted

    kernel = _planted(tmp_path, "if (ragged_by_loads && keys < BlockN) {", "if (false) {  // planted")
    monkeypatch.setattr(fa3.ForwardTraits, "SOURCE", kernel)
    shape = (3, 1, 2, 2, 64, 200)  # a shape of its own: no plan of the unplanted kernel is cached for it
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _poisoned(shape, "float16", 0, None, seed=7)
    assert list(lengths) == [0, 200, 37]
    with sim.targeting("sm_90"):
        out, _, _, _ = _kvcache_call(q, (k_cache, v_cache), k_new, v_new, lengths, None, num_splits=1)
    assert not np.isnan(out[:2].astype(np.float32)).any()  # no keys; a last block that ends at the cache's end
    assert np.isnan(out[2].astype(np.float32)).all()  # 37 keys: rows 37 .. 127 of its one block are NaN
