"""cuflash.jax.attention_with_kvcache: KV-cache decoding under jit and vmap, on the CPU simulator.

* jit: out, lse and the updated caches are bit for bit what cuflash.attention_with_kvcache gives on NumPy arrays
  (the same Problem, the same kernels), over float32 and float16, contiguous caches and pages of 16 and 32 rows,
  0, 1 and 3 new rows, MHA, GQA (the one-row decode fold included, windowed too) and MQA, causal or not, a window
  with softcap,
  and cache_seqlens as an int, None, a concrete array and a traced array (with a traced block_table);
* the custom call solves the NumPy call's Problem (folded for a one-row GQA decode as NumPy folds it; traced
  lengths widen seqlen_k to the capacity), and traced lengths below the capacity still give NumPy's results;
* num_splits reaches the program: 1 launches no combine kernel, 3 does, and both equal NumPy's;
* donated caches are updated in place (compiled HLO: inputs aliased to outputs, no cache-sized copy, which the
  undonated call does make), with the undonated call's results;
* vmap equals a Python loop of calls, bit for bit;
* bad input raises at trace time (jax.eval_shape runs nothing); differentiating raises a TypeError;
* the handler's extent check knows paged caches: pages shared by two sequences pass, params claiming bigger
  pages than the buffer holds are refused;
* on CUDA the plan's target carries the devices' SM count (JAX's core_count).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash.jax import _primitives  # noqa: E402
from cuflash.kernels import targets  # noqa: E402
from cuflash.kernels.program import gqa_decode_fold  # noqa: E402

BATCH, HEADDIM, CAPACITY = 2, 32, 64


def _inputs(dtype, *, page=None, new=1, seqlen_q=1, nheads=4, nheads_k=2, capacity=CAPACITY, seed=0):
    """q, contiguous or paged caches (pages shuffled, two spare), new rows (a dict of k, v; empty for new=None) and
    the block table (None when contiguous)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, seqlen_q, nheads, HEADDIM)).astype(dtype)
    if page is None:
        cache_shape, table = (BATCH, capacity, nheads_k, HEADDIM), None
    else:
        per_sequence = capacity // page
        table = rng.permutation(BATCH * per_sequence + 2)[:BATCH * per_sequence].reshape(BATCH, per_sequence)
        table = table.astype(np.int32)
        cache_shape = (BATCH * per_sequence + 2, page, nheads_k, HEADDIM)
    k_cache, v_cache = (rng.standard_normal(cache_shape).astype(dtype) for _ in range(2))
    rows = {} if new is None else {name: rng.standard_normal((BATCH, new, nheads_k, HEADDIM)).astype(dtype)
                                   for name in ("k", "v")}
    return q, k_cache, v_cache, rows, table


def _jax_call(q, k_cache, v_cache, rows, lengths, table, *, traced, **options):
    """The JAX function under jit: cache_seqlens and block_table as jit arguments (traced) or closed over
    (concrete)."""
    def step(q, k_cache, v_cache, rows, lengths, table):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, **rows, cache_seqlens=lengths, block_table=table,
                                          return_lse=True, **options)
    if traced:
        return jax.jit(step)(q, k_cache, v_cache, rows, lengths, table)
    return jax.jit(lambda q, k_cache, v_cache, rows: step(q, k_cache, v_cache, rows, lengths, table))(
        q, k_cache, v_cache, rows)


def _numpy_call(q, k_cache, v_cache, rows, lengths, table, **options):
    """cuflash.attention_with_kvcache on copies of the caches: (out, lse, k_cache, v_cache) as it leaves them."""
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, **rows, cache_seqlens=lengths, block_table=table,
                                              return_lse=True, **options)
    return out, lse, k_cache, v_cache


def _assert_bitwise(got, want):
    for name, g, w in zip(("out", "lse", "k_cache", "v_cache"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.array_equal(np.asarray(g), w), f"{name} differs from the NumPy call's"


# (dtype, page, new rows (None: no k, v), seqlen_q, nheads, nheads_k, lengths, options). Traced lengths fill one
# sequence to the capacity, so the grid (which then spans the capacity) is the NumPy call's.
CASES = {
    "f32-contiguous-decode-mha-causal-array": (
        np.float32, None, 1, 1, 4, 4, np.array([5, 40], np.int32), dict(causal=True)),
    "f16-page16-prefill-gqa-traced": (
        np.float16, 16, 3, 3, 4, 2, ("traced", [CAPACITY - 3, 17]), dict()),
    "f32-page32-decode-gqa-fold-int-no-new": (
        np.float32, 32, None, 1, 4, 2, 50, dict(causal=True)),
    "f16-contiguous-mqa-zero-new-rows-window-softcap-traced": (
        np.float16, None, 0, 2, 4, 1, ("traced", [CAPACITY, 9]), dict(window_size=(8, 0), softcap=3.0)),
    "f32-page16-decode-window-softcap-array": (
        np.float32, 16, 2, 1, 4, 2, np.array([0, 30], np.int32), dict(window_size=(20, -1), softcap=2.0)),
    "f16-contiguous-decode-gqa-full-none": (
        np.float16, None, 1, 1, 4, 2, None, dict(causal=True)),
    # A windowed one-row GQA decode folds on contiguous caches, its keys from the window's first (left padding).
    "f16-contiguous-decode-gqa-window-fold-array": (
        np.float16, None, 1, 1, 4, 2, np.array([50, 3], np.int32), dict(causal=True, window_size=(20, 0))),
    "f32-contiguous-decode-gqa-window-fold-traced": (
        np.float32, None, 1, 1, 4, 2, ("traced", [CAPACITY - 1, 30]), dict(window_size=(9, -1), num_splits=1)),
    # Paged too: the pages before the first visible key's dropped, its row in its page the kernels' left padding.
    "f16-page16-decode-gqa-window-fold-array": (
        np.float16, 16, 1, 1, 4, 2, np.array([50, 3], np.int32), dict(causal=True, window_size=(20, 0))),
    "f32-page32-decode-gqa-window-fold-traced": (
        np.float32, 32, None, 1, 4, 2, ("traced", [CAPACITY, 45]), dict(window_size=(9, -1), num_splits=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_jit_equals_numpy_bit_for_bit(case):
    dtype, page, new, seqlen_q, nheads, nheads_k, lengths, options = CASES[case]
    q, k_cache, v_cache, rows, table = _inputs(dtype, page=page, new=new, seqlen_q=seqlen_q, nheads=nheads,
                                               nheads_k=nheads_k)
    traced = isinstance(lengths, tuple)
    if traced:
        lengths = np.array(lengths[1], np.int32)
    got = _jax_call(q, k_cache, v_cache, rows, lengths, table, traced=traced, **options)
    _assert_bitwise(got, _numpy_call(q, k_cache, v_cache, rows, lengths, table, **options))


def _forward_problems(function, *args):
    """The Problem of every forward custom call in ``function``'s jaxpr (sub-jaxprs included)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is _primitives.attention_forward_p:
                yield eqn.params["config"].problem
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from walk(inner)
    return list(walk(jax.make_jaxpr(function)(*args).jaxpr))


@pytest.mark.parametrize("page, nheads, seqlen_q, traced", [(16, 4, 1, False), (None, 2, 3, False), (32, 4, 1, True)])
def test_the_call_solves_the_numpy_problem(page, nheads, seqlen_q, traced):
    """The custom call's Problem is the NumPy call's (check_kvcache's, with num_splits), folded for a one-row GQA
    decode as the NumPy call folds it; traced lengths only widen seqlen_k to the capacity."""
    q, k_cache, v_cache, rows, table = _inputs(np.float32, page=page, new=2, seqlen_q=seqlen_q, nheads=nheads)
    lengths = np.array([4, 21], np.int32)
    options = dict(causal=True, num_splits=2)

    def step(q, k_cache, v_cache, rows, lengths):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, **rows, cache_seqlens=lengths, block_table=table,
                                          **options)
    args = (q, k_cache, v_cache, rows) + ((lengths,) if traced else ())
    problems = _forward_problems(step if traced else lambda *a: step(*a, lengths), *args)
    want, _ = cuflash._validation.check_kvcache(q, k_cache, v_cache, rows["k"], rows["v"], lengths, table,
                                                causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    # Concrete lengths plan for a bound on the longest sequence's keys, as the NumPy call does (its plans).
    want = dataclasses.replace(want, num_splits=2, seqlen_k=CAPACITY if traced
                               else cuflash._validation.kvcache_key_extent(want.seqlen_k, CAPACITY))
    folded = gqa_decode_fold(want)
    assert (folded is not None) == (seqlen_q == 1 and nheads > 2)
    assert problems == [folded or want]


def test_a_growing_decode_keeps_its_call_signature():
    """Concrete lengths growing a row per call (a decode loop outside jit) lower to one Problem per eighth of the
    longest length (V.kvcache_key_extent), not one per call: each new static signature is a new lowering."""
    q, k_cache, v_cache, rows, table = _inputs(np.float32, new=1, capacity=512)
    problems = set()
    for used in range(300, 400):
        lengths = np.array([7, used], np.int32)
        problems.update(_forward_problems(lambda q, k_cache, v_cache, rows: cfj.attention_with_kvcache(
            q, k_cache, v_cache, **rows, cache_seqlens=lengths, causal=True), q, k_cache, v_cache, rows))
    # Keys 301 .. 400: extents 320, 352, 384, 416 (steps of 32 in [256, 512)).
    assert sorted(p.seqlen_k for p in problems) == [320, 352, 384, 416]


def test_traced_lengths_below_capacity_equal_numpy():
    """The grid spans the capacity when the lengths are traced; with one split each sequence still computes what
    the NumPy call (whose grid spans the longest sequence) computes."""
    q, k_cache, v_cache, rows, table = _inputs(np.float32, page=16, new=2, seqlen_q=2)
    lengths = np.array([3, 20], np.int32)
    options = dict(causal=True, num_splits=1)
    got = _jax_call(q, k_cache, v_cache, rows, lengths, table, traced=True, **options)
    _assert_bitwise(got, _numpy_call(q, k_cache, v_cache, rows, lengths, table, **options))


@pytest.mark.parametrize("num_splits, combined", [(1, False), (3, True)])
def test_num_splits_reaches_the_program(num_splits, combined):
    q, k_cache, v_cache, rows, table = _inputs(np.float32, new=1, nheads=2, nheads_k=2, capacity=192)
    lengths = np.array([190, 100], np.int32)  # 3 K/V blocks of 64 keys: room for 3 splits

    def step(q, k_cache, v_cache, rows):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, **rows, cache_seqlens=lengths, num_splits=num_splits,
                                          return_lse=True)
    hlo = jax.jit(step).lower(q, k_cache, v_cache, rows).as_text()
    assert ("fa2_split_kv_combine_kernel" in hlo) == combined
    got = _jax_call(q, k_cache, v_cache, rows, lengths, table, traced=False, num_splits=num_splits)
    _assert_bitwise(got, _numpy_call(q, k_cache, v_cache, rows, lengths, table, num_splits=num_splits))


# ---------------------------------------------------------------------------
# Donation: the scatter writes into the donated caches' buffers.

_INSTRUCTION = re.compile(r"%(\S+) = (\w+\[[\d,]*\])\{[^}]*\} ([\w-]+)\(")


def _cache_copies(hlo: str, cache_shape: str) -> list[str]:
    """The instructions of a compiled module that copy a buffer of the cache's shape."""
    return [name for name, shape, op in _INSTRUCTION.findall(hlo)
            if shape == cache_shape and (op == "copy" or "copy" in name)]


@pytest.mark.parametrize("page", [None, 16])
def test_donated_caches_are_updated_in_place(page):
    q, k_cache, v_cache, rows, table = _inputs(np.float32, page=page, new=3, seqlen_q=1)
    lengths = np.array([7, 33], np.int32)

    def step(q, k_cache, v_cache, k, v, lengths):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, block_table=table,
                                          causal=True)
    args = (q, k_cache, v_cache, rows["k"], rows["v"], lengths)
    cache_shape = "f32[" + ",".join(map(str, k_cache.shape)) + "]"
    donated = jax.jit(step, donate_argnums=(1, 2))
    hlo = donated.lower(*args).compile().as_text()
    # Outputs 1 and 2 (the updated caches) live in parameters 1 and 2 (the caches passed in).
    assert re.search(r"input_output_alias=\{ \{1\}: \(1, \{\}, (may|must)-alias\), \{2\}: \(2, \{\}, "
                     r"(may|must)-alias\) \}", hlo), hlo.splitlines()[0]
    assert _cache_copies(hlo, cache_shape) == []
    undonated = jax.jit(step)
    assert len(_cache_copies(undonated.lower(*args).compile().as_text(), cache_shape)) == 2  # what donation saves

    want = undonated(*args)
    got = donated(q, jnp.array(k_cache), jnp.array(v_cache), rows["k"], rows["v"], lengths)
    for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w))


# ---------------------------------------------------------------------------
# vmap, errors, autodiff.

@pytest.mark.parametrize("page", [None, 16])
def test_vmap_equals_a_loop(page):
    members = 3
    parts = [_inputs(np.float16, page=page, new=2, seqlen_q=2, seed=m) for m in range(members)]
    q, k_cache, v_cache = (np.stack([p[i] for p in parts]) for i in range(3))
    k, v = (np.stack([p[3][name] for p in parts]) for name in ("k", "v"))
    table = parts[0][4]  # shared by every member (unmapped)
    lengths = np.array([[5, 40], [0, 17], [CAPACITY - 2, 3]], np.int32)

    def step(q, k_cache, v_cache, k, v, lengths, table):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, block_table=table,
                                          causal=True, return_lse=True)
    mapped = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, 0, 0, 0, None)))(q, k_cache, v_cache, k, v, lengths, table)
    single = jax.jit(step)
    for m in range(members):
        one = single(q[m], k_cache[m], v_cache[m], k[m], v[m], lengths[m], table)
        for got, want in zip(mapped, one):
            assert np.array_equal(np.asarray(got[m]), np.asarray(want))


def _bad_inputs():
    q, k_cache, v_cache, rows, _ = _inputs(np.float32, new=2)
    _, k_paged, v_paged, _, table = _inputs(np.float32, page=16, new=2)
    base = dict(q=q, k_cache=k_cache, v_cache=v_cache, **rows, cache_seqlens=np.array([3, 9], np.int32))
    paged = dict(base, k_cache=k_paged, v_cache=v_paged, block_table=table)
    outside = table.copy()
    outside[1, 0] = k_paged.shape[0]
    return {
        "q-rank": (dict(base, q=q[0]), ValueError, "q must have 4 dimensions"),
        "v-cache-shape": (dict(base, v_cache=v_cache[:, :32]), ValueError, "v_cache must have k_cache's shape"),
        "new-shape": (dict(base, k=rows["k"][:, :, :1], v=rows["v"][:, :, :1]), ValueError, "k must have shape"),
        "k-without-v": (dict(base, v=None), ValueError, "k and v .* together"),
        "new-dtype": (dict(base, k=rows["k"].astype(np.float16), v=rows["v"].astype(np.float16)), TypeError,
                      "k must have the caches' dtype float32"),
        "cache-dtype": (dict(base, k_cache=k_cache.astype(np.int32), v_cache=v_cache.astype(np.int32),
                             k=rows["k"].astype(np.int32), v=rows["v"].astype(np.int32)), TypeError,
                        "k must have dtype float16, bfloat16 or float32"),
        "mixed-dtypes": (dict(base, k_cache=k_cache.astype(np.float16), v_cache=v_cache.astype(np.float16),
                              k=rows["k"].astype(np.float16), v=rows["v"].astype(np.float16)), TypeError,
                         "q, k and v must have the same dtype"),
        "over-capacity": (dict(base, cache_seqlens=np.array([0, CAPACITY - 1], np.int32)), ValueError,
                          "exceeds the cache's capacity of 64 rows"),
        "over-capacity-int": (dict(base, cache_seqlens=CAPACITY), ValueError, "exceeds the cache's capacity"),
        "negative-length": (dict(base, cache_seqlens=-1), ValueError, "cache_seqlens must be >= 0"),
        "seqlens-dtype": (dict(base, cache_seqlens=np.array([3, 9], np.int64)), ValueError,
                          "cache_seqlens must be an int or an int32 array"),
        "seqlens-float": (dict(base, cache_seqlens=3.0), TypeError, "cache_seqlens must be an int, None or"),
        "table-dtype": (dict(paged, block_table=table.astype(np.int64)), ValueError, "block_table must be int32"),
        "table-outside": (dict(paged, block_table=outside), ValueError, "block_table names pages outside the cache"),
        "page-size": (dict(paged, k_cache=k_paged[:, :8], v_cache=v_paged[:, :8]), ValueError,
                      "page size .* multiple of 16"),
        "splits": (dict(base, num_splits=129), ValueError, r"num_splits must be in \[0, 128\]"),
        "algorithm": (dict(base, algorithm="fa1"), ValueError, "kvcache is supported by algorithm='fa2' only"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_raises_at_trace_time(case):
    arguments, error, message = _bad_inputs()[case]
    arrays = {name: x for name, x in arguments.items() if name in ("q", "k_cache", "v_cache", "k", "v")}
    static = {name: x for name, x in arguments.items() if name not in arrays}
    with pytest.raises(error, match=message):  # eval_shape traces and runs nothing
        jax.eval_shape(lambda arrays: cfj.attention_with_kvcache(**arrays, **static), arrays)


def test_traced_values_are_not_checked_but_their_shapes_are():
    q, k_cache, v_cache, rows, table = _inputs(np.float32, page=16, new=1)
    call = jax.jit(lambda lengths, table: cfj.attention_with_kvcache(q, k_cache, v_cache, **rows,
                                                                     cache_seqlens=lengths, block_table=table))
    call.lower(np.array([CAPACITY, -5], np.int32), np.full_like(table, 99))  # values out of range: on trust
    with pytest.raises(ValueError, match="cache_seqlens must be an int or an int32 array of shape"):
        call.lower(np.array([1, 2, 3], np.int32), table)
    with pytest.raises(ValueError, match="block_table must be int32"):
        call.lower(np.array([1, 2], np.int32), table[:1])


def test_differentiating_raises_clearly():
    q, k_cache, v_cache, rows, _ = _inputs(np.float32, new=1)

    def out(q, k):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, k=k, v=rows["v"], cache_seqlens=3)[0]
    message = "attention_with_kvcache has no derivative"
    with pytest.raises(TypeError, match=message):
        jax.grad(lambda q: out(q, rows["k"]).sum())(q)
    with pytest.raises(TypeError, match=message):  # through the appended rows too
        jax.grad(lambda k: out(q, k).sum())(rows["k"])
    with pytest.raises(TypeError, match=message):
        jax.jvp(lambda q: out(q, rows["k"]), (q,), (q,))


# ---------------------------------------------------------------------------
# The handler's extent check on paged caches, and the CUDA target.

def test_pages_shared_by_sequences_pass_the_extent_check():
    """Both sequences read the same 4 pages (a shared prefix): k and v hold 64 rows, fewer than a (batch, seqlen_k)
    reading with the page stride as batch stride would reach, so the handler must size them by their pages."""
    q, k_cache, v_cache, _, _ = _inputs(np.float32, page=16, new=None)
    k_cache, v_cache = k_cache[:4], v_cache[:4]
    table = np.tile(np.arange(4, dtype=np.int32), (BATCH, 1))
    lengths = np.array([CAPACITY, 50], np.int32)
    got = _jax_call(q, k_cache, v_cache, {}, lengths, table, traced=True)
    _assert_bitwise(got, _numpy_call(q, k_cache, v_cache, {}, lengths, table))


def test_handler_refuses_pages_bigger_than_the_buffers():
    q, k_cache, v_cache, _, table = _inputs(np.float32, page=16, new=None, nheads=2, nheads_k=2)
    pages = k_cache.shape[0]
    problem = cuflash._validation.kvcache_problem(
        q, k_cache, v_cache, cuflash._validation.KVCacheLayout(BATCH, 0, 2 * CAPACITY, 32, table.shape[1], pages),
        seqlen_k=20, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    config = _primitives.CallConfig("fa2", dataclasses.replace(problem, num_splits=1), 0.5,
                                    cache_shape=(pages, 32) + k_cache.shape[2:])  # pages of 32 rows: too big
    words = [jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.float32)
             for x in (np.array([20, 20], np.int32), table)]
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"k needs \d+ bytes for shape \({pages}, 32, 2, 32\)"):
        jax.block_until_ready(_primitives.attention_forward_p.bind(q, k_cache, v_cache, *words, config=config))


def test_cuda_target_carries_the_devices_sm_count(monkeypatch):
    class Device:
        def __init__(self, capability, core_count):
            self.compute_capability, self.core_count = capability, core_count

    def local_devices(backend=None):
        assert backend == "cuda"
        return [Device("8.6", 84), Device("8.0", 108), Device("8.6", 28)]

    monkeypatch.setattr(jax, "local_devices", local_devices)
    target = _primitives.target_for("cuda")
    # The smallest shared-memory limit (sm_86's) and the smallest SM count: the plan fits and plans for every device.
    assert (target.arch, target.sm_count) == ("sm_86", 28)
    assert target.smem_per_block_bytes == targets.target("sm_86").smem_per_block_bytes
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [Device("9.0", None)])
    assert _primitives.target_for("cuda").sm_count == targets.target("sm_90").sm_count  # JAX did not tell it


@pytest.mark.parametrize("page, traced, interleaved, causal", [(None, True, False, True), (16, False, True, False)])
def test_rotary_equals_numpy_bit_for_bit(page, traced, interleaved, causal):
    """rotary_cos / rotary_sin (cuflash/rotary.py) under jit, lengths traced or concrete: out, lse and both caches
    bit for bit the NumPy function's."""
    q, k_cache, v_cache, rows, table = _inputs(np.float16, page=page, new=3, seqlen_q=3, seed=5)
    angles = np.random.default_rng(6).uniform(-np.pi, np.pi, (CAPACITY, 8))
    tables = dict(rotary_cos=np.cos(angles).astype(np.float16), rotary_sin=np.sin(angles).astype(np.float16),
                  rotary_interleaved=interleaved, causal=causal)
    lengths = np.array([CAPACITY - 3, 11], np.int32)
    got = _jax_call(q, k_cache, v_cache, rows, lengths, table, traced=traced, **tables)
    _assert_bitwise(got, _numpy_call(q, k_cache, v_cache, rows, lengths, table, **tables))


@pytest.mark.parametrize("traced, with_rotary", [(False, False), (True, True)])
def test_cache_indexing_equals_numpy_bit_for_bit(traced, with_rotary):
    """cache_batch_idx (caches with more batch rows than q) and cache_leftpad, concrete or traced (lengths too),
    with rotary: out, lse and the updated caches bit for bit the NumPy function's."""
    rng = np.random.default_rng(31)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((4, 96, 2, 32)).astype(np.float16) for _ in range(2))
    k_new, v_new = (rng.standard_normal((2, 2, 2, 32)).astype(np.float16) for _ in range(2))
    lengths, index, leftpad = (np.array(x, np.int32) for x in ([50, 9], [3, 1], [7, 9]))
    options = dict(causal=True, return_lse=True)
    if with_rotary:
        angles = rng.uniform(-np.pi, np.pi, (96, 8))
        options.update(rotary_cos=np.cos(angles).astype(np.float16), rotary_sin=np.sin(angles).astype(np.float16))

    def call(q, k_cache, v_cache, k, v, lengths, index, leftpad):
        return cfj.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, cache_batch_idx=index,
                                          cache_leftpad=leftpad, **options)

    arguments = (q, k_cache, v_cache, k_new, v_new, lengths, index, leftpad)
    if traced:
        got = jax.jit(call)(*arguments)
    else:
        got = jax.jit(lambda *a: call(*a, lengths, index, leftpad))(*arguments[:5])
    caches = k_cache.copy(), v_cache.copy()
    want_out, want_lse = cuflash.attention_with_kvcache(q, *caches, k=k_new, v=v_new, cache_seqlens=lengths,
                                                        cache_batch_idx=index, cache_leftpad=leftpad, **options)
    for a, b in zip(got, (want_out, want_lse, *caches)):
        assert np.array_equal(np.asarray(a), b)


def test_bad_cache_indexing_raises_at_trace_time():
    q = np.zeros((2, 1, 4, 32), np.float16)
    k_cache = np.zeros((3, 64, 2, 32), np.float16)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] must be in \[0, 3\)"):
        cfj.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=4, cache_batch_idx=np.array([3, 0], np.int32))
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] must be in 0..cache_seqlens\[1\] = 4, got 5"):
        cfj.attention_with_kvcache(q, k_cache[:2], k_cache[:2], cache_seqlens=4, cache_leftpad=np.array([0, 5],
                                                                                                       np.int32))
