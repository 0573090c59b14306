"""Varlen attention over a paged KV cache (FA2's ``flash_attn_varlen_func(..., block_table=...)``, vLLM's prefill
path): packed query rows, each sequence's keys in the pages its block_table row names.

* Every fa2 variant against the float64 reference under FlashAttention's rule: the SIMT kernels (float32), mma.sync
  (sm_80) and the Hopper forward (the simulator targeting sm_90) with pages that hold whole K/V blocks (TMA boxes)
  and pages that do not (the load path); causal, windows, softcap with ALiBi per sequence, sinks, seqused_k, GQA/MQA,
  head dims not a power of two, v's own head dim, zero-length sequences, rows that see no key.
* A decode step (one query row per sequence) runs as attention_with_kvcache's decode over the same pages (GQA fold,
  split-KV), NumPy and JAX alike; the varlen kernels themselves never fold (packed rows are not (batch, 1)).
* The paged call gives the unpaged varlen call's result over the same keys.
* Chunks (attention_chunk, a multiple of the page size) over pages: each virtual batch's table row starts at its
  chunk's first page.
* Refusals name the argument, before any kernel runs: dropout, a malformed block table, pages outside the cache,
  sequences longer than their pages, a page size that is not a multiple of 16.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import _validation as V
from cuflash import sim
from cuflash.kernels.program import gqa_decode_fold
from cuflash.reference import attention_varlen_reference
from cuflash.testing import numpy_dtype

# name: (query rows per sequence, keys per sequence, nheads, nheads_k, headdim, headdim_v)
SHAPES = {
    "gqa": ([5, 70, 0, 33], [40, 100, 17, 64], 4, 2, 64, 64),
    "mqa-d40": ([17, 1, 64], [17, 130, 64], 3, 1, 40, 40),
    "mha-d96-v64": ([90, 12], [61, 150], 2, 2, 96, 64),
}
OPTIONS = {
    "causal": dict(causal=True),
    "window": dict(window_size=(10, 3)),
    "full": dict(),
    "softcap-alibi-causal": dict(causal=True, softcap=5.0, alibi=True),
    "sinks-window-causal": dict(causal=True, window_size=(24, -1), sinks=True),
    "seqused-causal": dict(causal=True, seqused=True),
}
# (dtype, simulator target, page size): SIMT, mma.sync, Hopper over pages of whole K/V blocks (TMA) and of partial
# ones (loads).
KERNELS = [("float32", None, 32), ("float16", None, 16), ("bfloat16", None, 48), ("float16", "sm_90", 128),
           ("bfloat16", "sm_90", 64)]
EXPECTED_FORWARD = {(None, "float32"): "fa2_forward_kernel", (None, "float16"): "fa2_tc_forward_kernel",
                    (None, "bfloat16"): "fa2_tc_forward_kernel", ("sm_90", "float16"): "fa3_forward_kernel",
                    ("sm_90", "bfloat16"): "fa3_forward_kernel"}


def _cases():
    cases = []
    for i, name in enumerate(OPTIONS):
        for j, (dtype, arch, page) in enumerate(KERNELS):
            if (i + j) % 2:  # every option and every kernel, half the pairs
                continue
            shape_name = list(SHAPES)[(i + 2 * j) % len(SHAPES)]
            cases.append(pytest.param(name, dtype, arch, page, shape_name,
                                      id=f"{name}-{dtype}-{arch or 'sm_80'}-p{page}-{shape_name}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    cases = [c.values for c in _cases()]
    assert {c[0] for c in cases} == set(OPTIONS)
    assert {(c[1], c[2], c[3]) for c in cases} == set(KERNELS)
    assert {c[4] for c in cases} == set(SHAPES)


def _targeting(arch):
    return sim.targeting(arch) if arch else contextlib.nullcontext()


def paged_copy(packed, cu_seqlens_k, page_size, rng, spare_pages=3):
    """Packed keys (total_k, heads, d) laid into pages of ``page_size`` rows in a shuffled order (random data in the
    rows no sequence uses), and the block table: sequence b's key j at row j % page_size of page table[b, j //
    page_size]."""
    lengths = np.diff(cu_seqlens_k)
    per_sequence = max(1, -(-int(lengths.max(initial=1)) // page_size))
    batch = len(lengths)
    num_pages = batch * per_sequence + spare_pages
    table = rng.permutation(num_pages)[:batch * per_sequence].reshape(batch, per_sequence).astype(np.int32)
    return _laid_out(packed, cu_seqlens_k, table, num_pages, page_size, rng), table


def _laid_out(packed, cu_seqlens_k, table, num_pages, page_size, rng):
    cache = rng.standard_normal((num_pages, page_size, *packed.shape[1:])).astype(packed.dtype)
    for b, length in enumerate(np.diff(cu_seqlens_k)):
        for j in range(length):
            cache[table[b, j // page_size], j % page_size] = packed[cu_seqlens_k[b] + j]
    return cache


def _inputs(shape_name, dtype, page_size, seed):
    lengths_q, lengths_k, nheads, nheads_k, headdim, headdim_v = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], nheads, headdim)).astype(dt)
    k = rng.standard_normal((cu_k[-1], nheads_k, headdim)).astype(dt)
    v = rng.standard_normal((cu_k[-1], nheads_k, headdim_v)).astype(dt)
    k_cache, table = paged_copy(k, cu_k, page_size, rng)
    v_cache = _laid_out(v, cu_k, table, k_cache.shape[0], page_size, rng)
    return q, k, v, cu_q, cu_k, k_cache, v_cache, table


def _options(name, batch, nheads, seed=3):
    options = dict(OPTIONS[name])
    rng = np.random.default_rng(seed)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, (batch, nheads)).astype(np.float32)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(nheads).astype(np.float32)
    return options


@pytest.mark.parametrize("option_name, dtype, arch, page_size, shape_name", _cases())
def test_paged_varlen_matches_reference(option_name, dtype, arch, page_size, shape_name):
    q, k, v, cu_q, cu_k, k_cache, v_cache, table = _inputs(shape_name, dtype, page_size, seed=page_size)
    options = _options(option_name, len(cu_q) - 1, q.shape[1])
    seqused = options.pop("seqused", False)
    cu_k_ref, k_ref, v_ref = cu_k, k, v
    if seqused:  # each sequence's first keys only: the reference sees those prefixes packed
        used = np.maximum(np.diff(cu_k) - np.array([3, 50, 0, 9][:len(cu_q) - 1]), 0).astype(np.int32)
        options["seqused_k"] = used
        keep = np.concatenate([np.arange(cu_k[b], cu_k[b] + used[b]) for b in range(len(used))]).astype(np.int64)
        cu_k_ref = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
        k_ref, v_ref = k[keep], v[keep]
    with _targeting(arch), sim.record() as records:
        out, lse = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, return_lse=True,
                                            **options)
    kernels = {r.kernel.split("<")[0].split("::")[-1] for r in records.launches}
    assert EXPECTED_FORWARD[(arch, dtype)] in kernels, kernels
    options.pop("seqused_k", None)
    ref = attention_varlen_reference(q, k_ref, v_ref, cu_q, cu_k_ref, **options)
    low = attention_varlen_reference(q, k_ref, v_ref, cu_q, cu_k_ref, dtype=q.dtype, **options)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)


@pytest.mark.parametrize("dtype, arch", [("float16", None), ("bfloat16", "sm_90")])
def test_paged_gives_the_unpaged_result(dtype, arch):
    q, k, v, cu_q, cu_k, k_cache, v_cache, table = _inputs("gqa", dtype, 64, seed=1)
    with _targeting(arch):
        paged = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, causal=True)
        packed = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(paged.astype(np.float32), packed.astype(np.float32), rtol=0, atol=2e-3)


@pytest.mark.parametrize("dtype, arch, page_size, chunk, window_size", [
    ("float16", None, 16, 32, (-1, -1)),
    ("bfloat16", "sm_90", 64, 64, (20, -1)),
    ("float32", None, 32, 96, (-1, -1)),
])
def test_chunks_over_pages(dtype, arch, page_size, chunk, window_size):
    """attention_chunk with paged keys: each virtual batch's block table row starts at its chunk's first page."""
    q, k, v, cu_q, cu_k, k_cache, v_cache, table = _inputs("gqa", dtype, page_size, seed=7)
    options = dict(causal=True, window_size=window_size, attention_chunk=chunk)
    with _targeting(arch):
        out, lse = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, return_lse=True,
                                            **options)
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    low = attention_varlen_reference(q, k, v, cu_q, cu_k, dtype=q.dtype, **options)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)
    unchunked = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, window_size=window_size)[0]
    assert np.abs(unchunked - ref[0]).max() > 0.05  # the chunks hide keys the call without them sees
    with pytest.raises(ValueError, match=r"multiple of its page size"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, attention_chunk=page_size + 8)


def test_the_varlen_kernels_never_fold_gqa_rows():
    """Packed rows are not (batch, 1): a varlen Problem never takes the KV cache's GQA fold, so a one-row-per-sequence
    call that stays on the varlen kernels (here through seqused_q) keeps its query heads in the grid."""
    rng = np.random.default_rng(2)
    cu_q = np.arange(4, dtype=np.int32)
    cu_k = np.array([0, 50, 51, 180], np.int32)
    q = rng.standard_normal((3, 8, 64)).astype(np.float16)
    k = rng.standard_normal((180, 2, 64)).astype(np.float16)
    v = rng.standard_normal((180, 2, 64)).astype(np.float16)
    k_cache, table = paged_copy(k, cu_k, 32, rng)
    v_cache = _laid_out(v, cu_k, table, k_cache.shape[0], 32, rng)
    problem = V.check_paged_varlen(q, k_cache, v_cache, table, cu_q, cu_k, max_seqlen_q=None, max_seqlen_k=None,
                                   causal=True)
    assert problem.varlen and problem.kvcache and gqa_decode_fold(problem) is None
    assert gqa_decode_fold(dataclasses.replace(problem, total_q=None, total_k=None)) is not None
    with sim.record() as records:
        out, lse = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, causal=True,
                                            seqused_q=np.ones(3, np.int32), return_lse=True)
    assert records.launches[0].grid[1] == 8, records.launches[0].grid
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True)
    low = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, dtype=q.dtype)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)


def _bad_call(change):
    q, k, v, cu_q, cu_k, k_cache, v_cache, table = _inputs("gqa", "float16", 32, seed=4)
    args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=table)
    change(args)
    return args


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(dropout_p=0.1), ValueError, "block_table is a forward over a paged KV cache .* dropout_p"),
    (lambda a: a.update(block_table=a["block_table"][:2]), ValueError, r"block_table must be int32 \(batch, "),
    (lambda a: a.update(block_table=a["block_table"].astype(np.int64)), ValueError, "block_table must be int32"),
    (lambda a: a["block_table"].__setitem__((1, 0), 10**6), ValueError, "block_table names pages outside the cache"),
    (lambda a: a.update(block_table=a["block_table"][:, :2]), ValueError, "sequence 1 has 100 keys .* 2 pages"),
    (lambda a: a.update(k=a["k"][:, :24], v=a["v"][:, :24]), ValueError, r"page size \(k.shape\[1\]\) must be a "),
    (lambda a: a.update(k=a["k"][0]), ValueError, r"k must have 4 dimensions \(num_pages, page_size, nheads_k, "),
])
def test_bad_paged_varlen_calls_are_refused_naming_the_argument(change, error, match):
    args = _bad_call(change)
    with sim.record() as records, pytest.raises(error, match=match):
        cuflash.attention_varlen(**args)
    assert not records.launches


def test_the_backward_takes_no_block_table():
    args = _bad_call(lambda a: None)
    with pytest.raises(TypeError, match="block_table"):
        cuflash.attention_varlen_backward(args["q"], args["q"], args["k"], args["v"], args["q"], None,
                                          args["cu_seqlens_q"], args["cu_seqlens_k"], block_table=args["block_table"])


def test_cu_seqlens_k_may_be_none_when_seqused_k_counts_the_keys():
    """FA3's and vLLM's call: no cu_seqlens_k, each sequence's keys the first seqused_k[b] rows of its pages (NumPy
    and JAX, chunks too); without a block table or seqused_k it is refused by name."""
    q, k, v, cu_q, cu_k, k_cache, v_cache, table = _inputs("gqa", "float16", 32, seed=8)
    used = np.diff(cu_k).astype(np.int32)
    for options in (dict(causal=True), dict(causal=True, attention_chunk=64)):
        expected = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, **options)
        got = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, None, seqused_k=used, block_table=table, **options)
        assert np.array_equal(got, expected)
    jax = pytest.importorskip("jax")
    import cuflash.jax as cfj

    step = jax.jit(lambda q, a, b, u: cfj.attention_varlen(q, a, b, cu_q, None, seqused_k=u, block_table=table,
                                                           causal=True, max_seqlen_q=70, max_seqlen_k=100))
    assert np.array_equal(np.asarray(step(q, k_cache, v_cache, used)),
                          cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, causal=True))
    with pytest.raises(ValueError, match=r"cu_seqlens_k may be None only for keys in a paged KV cache \(block_table\)"):
        cuflash.attention_varlen(q, k, v, cu_q, None, seqused_k=used)
    with pytest.raises(ValueError, match="cu_seqlens_k may be None only"):
        cuflash.attention_varlen(q, k_cache, v_cache, cu_q, None, block_table=table)


@pytest.mark.parametrize("dtype, arch, options", [
    ("float16", None, dict(causal=True)),
    ("bfloat16", "sm_90", dict(softcap=4.0, window_size=(50, 0))),
    ("float32", None, dict(alibi=True)),
])
def test_one_row_per_sequence_runs_as_a_kvcache_decode(dtype, arch, options):
    """A decode step through the paged varlen call (vLLM's: one query row per sequence, cu_seqlens_q 0, 1, 2, ...)
    runs as attention_with_kvcache's decode over the same pages (its GQA fold where exact, its split-KV), its out and
    lse laid out as varlen's; JAX's call runs the same, bit for bit. Read-only caches are fine: nothing is written."""
    rng = np.random.default_rng(12)
    dt = numpy_dtype(dtype)
    lengths_k = [50, 1, 181, 0, 77]
    cu_q, cu_k = np.arange(6, dtype=np.int32), np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((5, 8, 64)).astype(dt)
    k, v = (rng.standard_normal((cu_k[-1], 2, 64)).astype(dt) for _ in range(2))
    k_cache, table = paged_copy(k, cu_k, 64, rng)
    v_cache = _laid_out(v, cu_k, table, k_cache.shape[0], 64, rng)
    k_cache.flags.writeable = v_cache.flags.writeable = False
    options = _options("softcap-alibi-causal" if options.pop("alibi", False) else "full", 5, 8) | options
    with _targeting(arch), sim.record() as records:
        out, lse = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, return_lse=True,
                                            **options)
    folded = "alibi_slopes" not in options  # a window folds too, from the row's first visible key
    assert records.launches[0].grid[1] == (2 if folded else 8), records.launches[0].grid
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, **options)
    low = attention_varlen_reference(q, k, v, cu_q, cu_k, dtype=q.dtype, **options)
    atol = 4 * options.get("softcap", 0.0) * 2.0**-23  # the kernels' tanh (see test_varlen.py)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR, atol=atol)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR, atol=atol)
    jax = pytest.importorskip("jax")
    import cuflash.jax as cfj

    with _targeting(arch):
        got = jax.jit(lambda q: cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table,
                                                     return_lse=True, **options))(q)
    assert np.array_equal(np.asarray(got[0]), out) and np.array_equal(np.asarray(got[1]), lse)
