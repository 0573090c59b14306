"""A V head dim of its own ([parity] item 3, MLA-style: DeepSeek's q/k 192 with v 128): v, and so out and dout,
may have a last dimension other than q's and k's, on every fa2 entry point (NumPy here; JAX in
tests/jax/test_jax_headdim_v.py).

* Forward and backward against the float64 reference under FA2's rule over both fa2 variants (float32 SIMT,
  float16/bfloat16 tensor cores), v narrower and wider than q/k, odd lengths, GQA/MQA, seqlen_q != seqlen_k, causal
  and windowed masks (rows that see no key), softcap; the instance is the one for the larger of the two dims.
* Global traffic of every launch byte for byte against the families' formulas (each tensor read at its own width),
  both variants race-free, and clean under AddressSanitizer (no store past v's columns of out or dv).
* Varlen, the KV cache (append, split-KV, paged), bad shapes refused naming the argument before anything is written,
  fa1 and standard refuse it naming fa2.
* V wider than the kernels (up to FA3's qk 64 / v 512): a launch per column chunk, forward and backward, with every
  option (sinks, ALiBi, dropout, softcap, varlen, the KV cache: appended, paged, split).
* On the simulator targeting sm_90: the Hopper forward and backward, race mode, ASan, the KV cache with and without
  split-KV.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.backends.program import run_program
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels import plans
from cuflash.kernels.families import fa2, fa2_tc, fa3, fa3_backward
from cuflash.kernels.program import MAX_HEADDIM_V, MAX_KERNEL_HEADDIM_V, Problem, value_column_chunks
from cuflash.kernels.targets import target
from cuflash.mask import Mask
from cuflash.reference import attention_with_kvcache_reference
from cuflash.testing import numpy_dtype, rows_without_key
from test_sinks import DTYPES, MASKS  # the same mask grid as the sinks tests

PAIRS = {"mla": (192, 128), "narrow-v": (40, 24), "wide-v": (24, 72)}  # (q/k head dim, v head dim)
SHAPES = {  # (batch, seqlen_q, seqlen_k, nheads, nheads_k)
    "gqa-tall": (2, 45, 30, 4, 2),
    "mqa-wide": (1, 19, 83, 3, 1),
    "mha-odd": (2, 33, 33, 2, 2),
}


def _inputs(shape, pair, dtype, seed):
    """q, k (q/k's head dim), v (its own) and dout (out's shape: v's head dim)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    d, dv = pair
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, seqlen_q, nheads, d)).astype(dt)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, d)).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, dv)).astype(dt)
    dout = rng.standard_normal((batch, seqlen_q, nheads, dv)).astype(dt)
    return q, k, v, dout


def _cases():
    cases = []
    for i, mask in enumerate(MASKS):
        for d, dtype in enumerate(DTYPES):
            pair = list(PAIRS)[(i + d) % len(PAIRS)]
            shape = list(SHAPES)[(i + 2 * d) % len(SHAPES)]
            cases.append(pytest.param(shape, pair, mask, dtype, id=f"{pair}-{mask}-{dtype}-{shape}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _cases()]
    for axis, expected in enumerate((SHAPES, PAIRS, MASKS, DTYPES)):
        assert {v[axis] for v in values} == set(expected)
    # Each pair meets each dtype (so the MLA pair runs on both variants).
    assert {(v[1], v[3]) for v in values} == {(p, dt) for p in PAIRS for dt in DTYPES}


def _compiled_head_dim(records, kernel):
    names = [r.kernel for r in records.launches if r.kernel.startswith(kernel + "<")]
    assert names, f"no {kernel} launch among {[r.kernel for r in records.launches]}"
    return {int(name.split("<")[1].split(",")[1]) for name in names}


def _check_forward(q, k, v, out, lse, options):
    """out and lse against the float64 reference by FA2's rule; rows that see no key: out 0, lse -inf. Returns those
    rows."""
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = rows_without_key(q.shape[1], k.shape[1], options.get("causal", False),
                             options.get("window_size", (-1, -1)))
    assert np.all(out[:, empty].astype(np.float32) == 0) and np.all(lse[:, :, empty] == -np.inf)
    return empty


@pytest.mark.parametrize("shape_name, pair_name, mask_name, dtype", _cases())
def test_matches_the_reference_forward_and_backward(shape_name, pair_name, mask_name, dtype):
    shape, (d, dv) = SHAPES[shape_name], PAIRS[pair_name]
    q, k, v, dout = _inputs(shape, (d, dv), dtype, seed=len(shape_name) + 7 * len(mask_name))
    options = MASKS[mask_name]
    with sim.record() as records:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    variant = "cuflash::fa2_forward_kernel" if dtype == "float32" else "cuflash::fa2_tc_forward_kernel"
    assert _compiled_head_dim(records, variant) == {fa2.compiled_head_dim(max(d, dv))}
    assert out.shape == (*q.shape[:3], dv) and out.dtype == q.dtype
    empty = _check_forward(q, k, v, out, lse, options)

    dq, dk, dv_grad = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    assert (dq.shape, dk.shape, dv_grad.shape) == (q.shape, k.shape, v.shape)
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv_grad)):
        assert got.dtype == q.dtype
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    assert np.all(dq[:, empty].astype(np.float32) == 0)


@pytest.mark.parametrize("dtype, pair", [("bfloat16", (40, 24)), ("float32", (24, 40)), ("float16", (192, 128))])
def test_with_every_other_option(dtype, pair):
    """Dropout (its instances with their own tiles), ALiBi, sinks and the deterministic backward with a v head dim
    of its own: D = rowsum(dO * O) and dsinks read out at v's width."""
    shape = (2, 29, 37, 4, 2)
    q, k, v, dout = _inputs(shape, pair, dtype, seed=41)
    rng = np.random.default_rng(42)
    slopes = rng.uniform(0.05, 0.5, (2, 4)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    options = dict(causal=True, window_size=(16, -1), alibi_slopes=slopes, sinks=sinks)
    dropping = dict(dropout_p=0.2, dropout_seed=2**33 + 5)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options, **dropping)
    keep = cuflash.dropout_mask(2**33 + 5, 2, 4, 29, 37, 0.2)
    ref = tol.forward_references(q, k, v, dropout_p=0.2, dropout_mask=keep, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, dropout_p=0.2, dropout_mask=keep, **options)
    runs = [cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options, **dropping)
            for _ in range(2)]
    for a, b in zip(*runs):  # bitwise reproducible
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    for name, got in zip(("dq", "dk", "dv"), runs[0][:3]):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    tol.check_close("dsinks", runs[0][3], bref.dsinks, bref.dsinks_lowp, tol.BACKWARD_FACTOR, atol=1e-5)


# ---------------------------------------------------------------------------
# Traffic, races and out-of-bounds accesses: the programs run directly on the simulator.


def _problem(q, k, v, causal, deterministic=False):
    batch, seqlen_q, nheads, headdim = q.shape
    return Problem(dtype=np.dtype(q.dtype).name, batch=batch, seqlen_q=seqlen_q, seqlen_k=k.shape[1], nheads=nheads,
                   nheads_k=k.shape[2], headdim=headdim, headdim_v=v.shape[-1], mask=Mask.causal(causal),
                   deterministic=deterministic)


def _family(dtype):
    return fa2 if dtype == "float32" else fa2_tc


def _run(q, k, v, dout, causal, deterministic, arch):
    """Forward and backward programs of the family for q's dtype; (out, lse, grads, per-launch traffic of each)."""
    backend = SimulatorBackend()
    problem = _problem(q, k, v, causal, deterministic)
    family, scale = _family(problem.dtype), 1.0 / math.sqrt(problem.headdim)
    out = backend.empty((*q.shape[:3], v.shape[-1]), q.dtype)
    lse = backend.empty(problem.row_stats_shape, np.float32)
    with sim.targeting(arch), sim.record() as forward:
        run_program(backend, family.forward_program(problem, target(arch)), problem, scale,
                    {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    with sim.targeting(arch), sim.record() as backward:
        run_program(backend, family.backward_program(problem, target(arch)), problem, scale,
                    {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads})
    traffic = [[(r.global_bytes_read, r.global_bytes_written) for r in records.launches]
               for records in (forward, backward)]
    return out, lse, (grads["dq"], grads["dk"], grads["dv"]), traffic


# Both orders of the two dims, each variant; ragged blocks, GQA, causal with seqlen_q > seqlen_k.
PROGRAM_CASES = [
    pytest.param((1, 70, 53, 4, 2), (192, 128), "float16", "sm_90", id="mla-fp16-sm90"),
    pytest.param((1, 70, 53, 4, 2), (40, 72), "bfloat16", "sm_80", id="wide-v-bf16-sm80"),
    pytest.param((1, 70, 53, 4, 2), (72, 40), "float32", "sm_80", id="narrow-v-fp32-sm80"),
    pytest.param((1, 70, 53, 4, 2), (20, 52), "float32", "sm_86", id="wide-v-fp32-sm86"),
]


def _check_results(q, k, v, dout, out, lse, grads, causal):
    ref = tol.forward_references(q, k, v, causal=causal)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, causal=causal)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


@pytest.mark.parametrize("shape, pair, dtype, arch", PROGRAM_CASES)
def test_traffic_on_formula_and_race_free(shape, pair, dtype, arch):
    """Each tensor is read and written at its own width: q, k, dq, dk at q/k's head dim, v, out, dout, dv at v's."""
    q, k, v, dout = _inputs(shape, pair, dtype, seed=31)
    for deterministic in (False, True):
        problem = _problem(q, k, v, True, deterministic)
        family = _family(dtype)
        with sim.checking("race"):
            out, lse, grads, (forward, backward) = _run(q, k, v, dout, True, deterministic, arch)
        _check_results(q, k, v, dout, out, lse, grads, True)
        assert forward == [tuple(family.forward_traffic(problem, target(arch)))]
        assert backward == [tuple(t) for t in family.backward_traffic(problem, target(arch))]


# Under ASan: v narrower than q/k on both variants (out and dv narrower than q's width) and wider on the tensor cores
# (q, k, dq and dk narrower than the tiles).
ASAN_CASES = PROGRAM_CASES[:3]


def _programs_under_asan():
    results = []
    for case in ASAN_CASES:
        shape, pair, dtype, arch = case.values
        q, k, v, dout = _inputs(shape, pair, dtype, seed=31)
        results.append(_run(q, k, v, dout, True, True, arch)[:3])
    return results


def test_clean_under_asan():
    """out, dout and dv hold v's columns only: a store or load at q's width past them is reported."""
    results = sim.run_in_asan_subprocess(_programs_under_asan, timeout=1200)
    for case, (out, lse, grads) in zip(ASAN_CASES, results):
        shape, pair, dtype, _ = case.values
        q, k, v, dout = _inputs(shape, pair, dtype, seed=31)
        _check_results(q, k, v, dout, out, lse, grads, True)


def test_tiles_hold_the_larger_dim():
    for d, dv in ((192, 128), (64, 256), (128, 32), (33, 65)):
        problem = Problem("float16", 1, 64, 64, 2, 2, d, headdim_v=dv)
        assert fa2.tile_head_dim(problem) == max(d, dv) and problem.options == {"headdim_v"}
        name = fa2_tc.forward_program(problem, target("sm_80")).launches[0].kernel.name_expr
        assert int(name.split("<")[1].split(",")[1]) == fa2.compiled_head_dim(max(d, dv))
    assert Problem("float16", 1, 64, 64, 2, 2, 64) == Problem("float16", 1, 64, 64, 2, 2, 64, headdim_v=64)
    assert Problem("float16", 1, 64, 64, 2, 2, 64).options == frozenset()


# ---------------------------------------------------------------------------
# Varlen and the KV cache.


@pytest.mark.parametrize("dtype, pair", [("float32", (24, 40)), ("float16", (192, 128)), ("bfloat16", (40, 24)),
                                         ("float16", (64, 512))])  # the last: V in column chunks
def test_varlen_matches_the_reference(dtype, pair):
    d, dv = pair
    rng = np.random.default_rng(5)
    dt = numpy_dtype(dtype)
    cu_q, cu_k = np.array([0, 7, 7, 40], np.int32), np.array([0, 12, 20, 61], np.int32)
    q = rng.standard_normal((40, 4, d)).astype(dt)
    k = rng.standard_normal((61, 2, d)).astype(dt)
    v = rng.standard_normal((61, 2, dv)).astype(dt)
    dout = rng.standard_normal((40, 4, dv)).astype(dt)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert out.shape == (40, 4, dv)
    ref = tol.forward_references(q, k, v, cu_seqlens=(cu_q, cu_k), causal=True)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    bref = tol.backward_references(dout, q, k, v, cu_seqlens=(cu_q, cu_k), causal=True)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


def _caches(dtype, pair, page, seed):
    d, dv = pair
    batch, nheads, nheads_k, capacity, new = 3, 4, 2, 96, 2
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((batch, 1, nheads, d)).astype(dt)
    k_cache = rng.standard_normal((batch, capacity, nheads_k, d)).astype(dt)
    v_cache = rng.standard_normal((batch, capacity, nheads_k, dv)).astype(dt)
    k_new = rng.standard_normal((batch, new, nheads_k, d)).astype(dt)
    v_new = rng.standard_normal((batch, new, nheads_k, dv)).astype(dt)
    lengths = np.array([0, 70, 31], np.int32)
    if page is None:
        return q, k_cache, v_cache, k_new, v_new, lengths, None
    per_sequence = capacity // page
    table = rng.permutation(batch * per_sequence).reshape(batch, per_sequence).astype(np.int32)
    return q, _paged(k_cache, table, page), _paged(v_cache, table, page), k_new, v_new, lengths, table


def _paged(cache, table, page):
    """A contiguous cache (batch, capacity, ...) as a pool of pages: sequence b's page i at pool row table[b, i]."""
    batch, per_sequence = table.shape
    pool = np.zeros((batch * per_sequence, page, *cache.shape[2:]), cache.dtype)
    for b in range(batch):
        for i in range(per_sequence):
            pool[table[b, i]] = cache[b, i * page:(i + 1) * page]
    return pool


@pytest.mark.parametrize("dtype, pair, page", [("float32", (40, 24), None), ("bfloat16", (192, 128), 16),
                                               ("float16", (24, 72), None), ("bfloat16", (64, 512), 16),
                                               ("float16", (64, 512), None)])  # 64 / 512: V in column chunks
def test_kvcache_appends_and_splits(dtype, pair, page):
    """The new rows land in each cache at its own width; one split and three give the reference's result."""
    q, k_cache, v_cache, k_new, v_new, lengths, table = _caches(dtype, pair, page, seed=9)
    results = {}
    for splits in (1, 3):
        kc, vc = k_cache.copy(), v_cache.copy()
        out, lse = cuflash.attention_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lengths,
                                                  block_table=table, causal=True, num_splits=splits,
                                                  return_lse=True)
        assert out.shape == (*q.shape[:3], pair[1])
        used = lengths + 2
        ref, low = (attention_with_kvcache_reference(q, kc, vc, used, block_table=table, causal=True, dtype=dt)
                    for dt in (np.float64, q.dtype))
        tol.check_close(f"out ({splits} splits)", out, ref[0], low[0], tol.FORWARD_FACTOR)
        tol.check_close(f"lse ({splits} splits)", lse, ref[1], low[1], tol.FORWARD_FACTOR)
        results[splits] = (kc, vc)
    for b in range(3):  # the appended rows, each at its cache's width
        rows = slice(int(lengths[b]), int(lengths[b]) + 2)
        if table is None:
            assert np.array_equal(results[1][0][b, rows], k_new[b])
            assert np.array_equal(results[1][1][b, rows], v_new[b])
    if table is not None:
        from cuflash.reference import kvcache_keys
        for cache, new in ((results[1][0], k_new), (results[1][1], v_new)):
            for b, keys in enumerate(kvcache_keys(cache, lengths + 2, table)):
                assert np.array_equal(keys[lengths[b]:], new[b])


# ---------------------------------------------------------------------------
# V wider than the kernels take (FA3's qk 64 / v 512): column chunks (program.value_column_chunks).


def test_value_column_chunks_cover_every_width():
    for width in range(1, MAX_HEADDIM_V + 1):
        chunks = value_column_chunks(width)
        assert len(chunks) == math.ceil(width / MAX_KERNEL_HEADDIM_V), width
        assert chunks[0][0] == 0 and chunks[-1][1] == width
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # end to end, no gap, no overlap
        assert all(0 < stop - start <= MAX_KERNEL_HEADDIM_V and start % 8 == 0 for start, stop in chunks)
        assert len({stop - start for start, stop in chunks[:-1]}) <= 1  # equal widths but the last


WIDE_CASES = [  # (dtype, (q/k head dim, v head dim), shape (batch, seqlen_q, seqlen_k, nheads, nheads_k), options)
    pytest.param("float16", (64, 512), (2, 37, 45, 4, 2), dict(causal=True), id="qk64-v512-fp16-causal-gqa"),
    pytest.param("bfloat16", (64, 512), (1, 21, 70, 3, 1), dict(window_size=(9, 3), softcap=5.0),
                 id="qk64-v512-bf16-window-softcap-mqa"),
    pytest.param("float32", (40, 300), (2, 33, 19, 2, 2), dict(causal=True), id="qk40-v300-fp32-causal-no-key-rows"),
]


@pytest.mark.parametrize("dtype, pair, shape, options", WIDE_CASES)
def test_wide_v_runs_in_column_chunks_and_matches_the_reference(dtype, pair, shape, options):
    """Each chunk is a launch of the instance for its own width; out, lse and the gradients (dq and dk the
    chunks' sums, dv their columns) within FA2's rule, rows without keys 0, the deterministic backward bitwise."""
    q, k, v, dout = _inputs(shape, pair, dtype, seed=sum(pair) + shape[1])
    chunks = value_column_chunks(pair[1])
    with sim.record() as records:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    variant = "cuflash::fa2_forward_kernel" if dtype == "float32" else "cuflash::fa2_tc_forward_kernel"
    launched = [r.kernel for r in records.launches if r.kernel.startswith(variant + "<")]
    assert len(launched) == len(chunks) == 2
    assert _compiled_head_dim(records, variant) == {fa2.compiled_head_dim(max(pair[0], stop - start))
                                                   for start, stop in chunks}
    assert out.shape == (*q.shape[:3], pair[1]) and out.dtype == q.dtype
    _check_forward(q, k, v, out, lse, options)

    bref = tol.backward_references(dout, q, k, v, **options)
    runs = [cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
            for deterministic in (False, True, True)]
    for a, b in zip(runs[1], runs[2]):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    for grads in runs[:2]:
        for name, got in zip(("dq", "dk", "dv"), grads):
            assert got.dtype == q.dtype and got.shape == getattr(bref, name).shape
            tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                            atol=1e-5)


def test_wide_v_with_sinks_alibi_and_dropout():
    """D = rowsum(dO * O) summed over the chunks for the sinks' gradient; each chunk drops the same entries."""
    shape, pair = (2, 29, 37, 4, 2), (64, 512)
    q, k, v, dout = _inputs(shape, pair, "float16", seed=43)
    rng = np.random.default_rng(44)
    options = dict(causal=True, alibi_slopes=rng.uniform(0.05, 0.5, 4).astype(np.float32),
                   sinks=rng.standard_normal(4).astype(np.float32))
    dropping = dict(dropout_p=0.2, dropout_seed=7)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options, **dropping)
    keep = cuflash.dropout_mask(7, 2, 4, 29, 37, 0.2)
    ref = tol.forward_references(q, k, v, dropout_p=0.2, dropout_mask=keep, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options, **dropping)
    bref = tol.backward_references(dout, q, k, v, dropout_p=0.2, dropout_mask=keep, **options)
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


# ---------------------------------------------------------------------------
# Bad input: refused naming the argument, before anything is written.


def test_bad_shapes_are_refused_before_anything_runs():
    q, k, v, dout = _inputs((1, 8, 8, 2, 2), (32, 16), "float32", seed=1)
    with pytest.raises(ValueError, match=r"v's head dim \(its last dimension\) must be in 1..512, got 513"):
        cuflash.attention(q[..., :16], k[..., :16], np.zeros((1, 8, 2, 513), np.float32))
    with pytest.raises(ValueError, match="v must have k's shape but for the head dim"):
        cuflash.attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="k must have the head dim of q"):
        cuflash.attention(q, k[..., :16], v)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 8, 2, 16\) \(q's, with v's head dim 16\)"):
        cuflash.attention_backward(np.zeros(q.shape, np.float32), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"out must have shape \(1, 8, 2, 16\)"):
        cuflash.attention_backward(dout, q, k, v, np.zeros(q.shape, np.float32), lse)
    for algorithm in ("fa1", "standard"):
        with pytest.raises(ValueError, match=f"headdim_v is supported by algorithm='fa2' only, got "
                                             f"algorithm='{algorithm}'"):
            cuflash.attention(q, k, v, algorithm=algorithm)
    with pytest.raises(ValueError, match="v must have k's shape but for the head dim"):
        cuflash.attention_varlen(q[0], k[0], v[0, :5], np.array([0, 8], np.int32), np.array([0, 8], np.int32))


def test_bad_kvcache_shapes_write_nothing():
    q, k_cache, v_cache, k_new, v_new, lengths, _ = _caches("float32", (40, 24), None, seed=2)
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match=r"v must have shape \(batch, seqlen_new, nheads_k, headdim_v\)"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=k_new, cache_seqlens=lengths)
    with pytest.raises(ValueError, match="v_cache must have k_cache's shape but for the head dim"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache[:, :50], k=k_new, v=v_new, cache_seqlens=lengths)
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


def test_plans_name_the_larger_dims_instance_and_other_algorithms_refuse():
    problem = Problem("bfloat16", 2, 100, 100, 4, 4, 192, headdim_v=128)
    for program in (plans.forward_program("fa2", problem, target("sm_80")),
                    plans.backward_program("fa2", problem, target("sm_80")),
                    plans.forward_program("fa2", problem, target("sm_90"))):
        assert any(", 192," in launch.kernel.name_expr for launch in program.launches)
    # The Hopper backward's compiled head dims are 64, 128 and 256.
    assert any("fa3_backward_kernel<__nv_bfloat16, 256," in launch.kernel.name_expr
               for launch in plans.backward_program("fa2", problem, target("sm_90")).launches)
    for algorithm in ("fa1", "standard"):
        with pytest.raises(ValueError, match="headdim_v"):
            plans.forward_program(algorithm, problem, target("sm_90"))


# ---------------------------------------------------------------------------
# On Hopper (the simulator targeting sm_90): the wgmma kernels' tiles hold the larger head dim (v's and dout's columns
# past v's own zero-filled by the producers, TMA or loads; out's and dv's columns past v's computed and not written).
# MLA's 192 / 128 (the forward's tile of its own, V and O at 128: fa3.NARROW_V_CHOICES; the backward's d256 tile, its
# consumers sharing the head dim), v wider (64 / 128: the d128 tiles, 128 x 176 forward without a mask), narrower on
# the load path (100 / 40; 150 / 100 on MLA's tile), the hooked tiles (softcap), v in column chunks (64 / 512: the
# d256 tiles per chunk), GQA/MQA, windows, rows that see no key, deterministic on one.
HOPPER_CASES = {
    "mla-causal": ((2, 150, 130, 4, 2), (192, 128), "bfloat16", dict(causal=True)),
    "mla-window-mqa": ((1, 200, 333, 3, 1), (192, 128), "float16", dict(window_size=(60, 20), deterministic=True)),
    "mla-tile-loads": ((2, 97, 140, 2, 2), (150, 100), "bfloat16", dict()),
    "wide-v-full": ((1, 77, 200, 3, 1), (64, 128), "float16", dict(deterministic=True)),
    "narrow-v-window-loads": ((1, 130, 77, 2, 2), (100, 40), "float16", dict(window_size=(20, 0))),
    "wide-v-softcap": ((1, 90, 90, 2, 1), (24, 72), "bfloat16", dict(causal=True, softcap=4.0)),
    "v-512-chunks": ((1, 70, 100, 2, 2), (64, 512), "float16", dict(causal=True)),
}


@pytest.mark.parametrize("case", list(HOPPER_CASES))
def test_hopper_kernels_with_v_of_its_own(case):
    shape, (d, dv), dtype, options = HOPPER_CASES[case]
    options = dict(options)
    deterministic = options.pop("deterministic", False)
    q, k, v, dout = _inputs(shape, (d, dv), dtype, seed=len(case))
    race = sim.checking("race") if case == "mla-causal" else contextlib.nullcontext()
    with sim.targeting("sm_90"), sim.record() as records, race:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    chunk = min(dv, MAX_KERNEL_HEADDIM_V)
    assert _compiled_head_dim(records, "cuflash::fa3_forward_kernel") == {fa3.compiled_head_dim(max(d, chunk))}
    # MLA's tiles (V and O, or V, dO and dV, at 128: the kernels' trailing HeadDimV) where q's compiled head dim is
    # 192 (the backward's: 256) and v fits 128, without softcap or ALiBi.
    narrow = case.startswith("mla") and "softcap" not in options
    for kernel in ("cuflash::fa3_forward_kernel<", "cuflash::fa3_backward_kernel<"):
        names = {r.kernel for r in records.launches if r.kernel.startswith(kernel)}
        assert all(name.endswith(", 128>") == narrow for name in names), names
    assert _compiled_head_dim(records, "cuflash::fa3_backward_kernel") == {
        fa3_backward.compiled_head_dim(max(d, chunk))}
    assert out.shape == (*q.shape[:3], dv)
    _check_forward(q, k, v, out, lse, options)
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


@pytest.mark.parametrize("pair, dtype", [((192, 128), "bfloat16"), ((64, 128), "float16"), ((100, 40), "float16")])
def test_hopper_traffic_at_each_tensors_width(pair, dtype):
    """The Hopper kernels read and write each tensor at its own width (q, k, dq, dk at q's; v, out, dout, dv at
    v's), on the families' formulas: TMA reads no column past a tensor's head dim, nor do the loads."""
    q, k, v, dout = _inputs((1, 150, 130, 4, 2), pair, dtype, seed=32)
    problem = _problem(q, k, v, True)
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    _check_results(q, k, v, dout, out, lse, grads, True)
    traffic = [(r.global_bytes_read, r.global_bytes_written) for r in records.launches]
    sm90 = target("sm_90")
    assert traffic == [tuple(fa3.forward_traffic(problem, sm90)),
                       *(tuple(t) for t in fa3_backward.backward_traffic(problem, sm90))]


def test_hopper_plans_take_v_of_its_own():
    sm90 = target("sm_90")
    problem = Problem("bfloat16", 2, 100, 100, 4, 4, 192, headdim_v=128)
    assert fa3.supports(problem, sm90) and fa3_backward.supports(problem, sm90)
    said = plans.explain("fa2", problem, sm90)
    assert said.startswith("fa2 forward on sm_90: hopper (")
    assert "fa3_forward_kernel<__nv_bfloat16, 192, 128, 128, 2, false, 128>" in said
    # MLA's tile takes any v up to 128 beside a q that compiles to 192, masked or not, paged or not; softcap and ALiBi
    # the hooked d192 tile; other pairs the tile of the larger head dim.
    paged = dict(mask=Mask.causal(), kvcache=True, page_size=256, pages_per_sequence=2)
    for pair, options, expected in (((150, 64), {}, (192, 128, 128, 128, False)),
                                    ((192, 128), paged, (192, 128, 128, 128, False)),
                                    ((192, 128), dict(softcap=30.0), (192, 128, 112, 192, True)),
                                    ((192, 160), {}, (192, 128, 112, 192, False)),
                                    ((256, 128), {}, (256, 128, 80, 256, False)),
                                    ((64, 128), {}, (128, 128, 176, 128, False))):
        case = Problem("float16", 1, 300, 300, 2, 2, pair[0], headdim_v=pair[1], **options)
        traits = fa3.forward_traits(case, sm90)
        assert (traits.head_dim, traits.block_m, traits.block_n, traits.v_head_dim, traits.hooked) == expected, pair
        assert traits.smem_bytes <= sm90.smem_per_block_bytes
    said = plans.explain("fa2", problem, sm90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (")
    assert "fa3_backward_kernel<__nv_bfloat16, 256, 64, 64, 2, false, true, 128>" in said
    for pair, options, expected in (((150, 64), {}, (256, 128, False)),
                                    ((192, 128), dict(softcap=30.0), (256, 256, True)),
                                    ((192, 160), {}, (256, 256, False)), ((128, 64), {}, (128, 128, False))):
        case = Problem("float16", 1, 300, 300, 2, 2, pair[0], headdim_v=pair[1], **options)
        traits = fa3_backward.problem_traits(case, sm90)
        assert (traits.head_dim, traits.v_head_dim, traits.hooked) == expected, pair
        assert traits.smem_bytes <= sm90.smem_per_block_bytes
    wide = Problem("float16", 1, 64, 64, 2, 2, 64, headdim_v=128)
    assert fa3.forward_traits(wide, sm90).head_dim == 128
    assert "fa3_backward_kernel<__half, 128," in fa3_backward.backward_program(wide, sm90).launches[1].kernel.name_expr
    for too_wide in (Problem("float16", 1, 64, 64, 2, 2, 257, headdim_v=64),):
        assert not fa3.supports(too_wide, sm90) and not fa3_backward.supports(too_wide, sm90)


def _hopper_mla_under_asan():
    shape, pair, dtype, options = HOPPER_CASES["mla-causal"]
    q, k, v, dout = _inputs(shape, pair, dtype, seed=3)
    with sim.targeting("sm_90"):
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        return q, k, v, dout, out, lse, cuflash.attention_backward(dout, q, k, v, out, lse, **options)


def test_hopper_kernels_with_v_of_its_own_clean_under_asan():
    """out, dout, v and dv hold v's columns only: a load or store at the tile's (or q's) width past them is
    reported."""
    q, k, v, dout, out, lse, grads = sim.run_in_asan_subprocess(_hopper_mla_under_asan, timeout=900)
    _check_results(q, k, v, dout, out, lse, grads, True)


@pytest.mark.parametrize("num_splits, page", [(1, None), (3, None), (2, 128)])
def test_hopper_kvcache_with_v_of_its_own(num_splits, page):
    """A decode step over MLA-shaped caches (one empty) through the Hopper forward (MLA's tile), split-KV's out_accum
    at v's width; paged with pages of whole K/V blocks (TMA boxes per page)."""
    rng = np.random.default_rng(10)
    q = rng.standard_normal((3, 1, 4, 192)).astype(np.float16)
    k_cache = rng.standard_normal((3, 640, 2, 192)).astype(np.float16)
    v_cache = rng.standard_normal((3, 640, 2, 128)).astype(np.float16)
    lengths = np.array([0, 500, 260], np.int32)
    table = None
    if page is not None:  # each sequence's pages scattered over one pool
        per_sequence = k_cache.shape[1] // page
        table = rng.permutation(3 * per_sequence).reshape(3, per_sequence).astype(np.int32)
        k_cache, v_cache = _paged(k_cache, table, page), _paged(v_cache, table, page)
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=num_splits,
                                                  block_table=table, return_lse=True)
    kernels = [r.kernel for r in records.launches]
    assert kernels[0].endswith(", 192, 128, 128, 2, false, 128>") and len(kernels) == 1 + (num_splits > 1), kernels
    ref, low = (attention_with_kvcache_reference(q, k_cache, v_cache, lengths, block_table=table, dtype=dt)
                for dt in (np.float64, q.dtype))
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)
