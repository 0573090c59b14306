"""Chunked attention (``attention_chunk``, FA3's option; Llama 4's local layers), run as virtual batches
(cuflash/chunks.py: one varlen sequence per chunk; tests/test_mask.py checks the segments rebuild the mask).

* Every variant of fa2 against the float64 reference under FlashAttention's rule, forward and backward: the SIMT
  kernels (float32), the mma.sync ones (sm_80) and the Hopper ones (the simulator targeting sm_90); chunks narrower
  than a block, wider, not dividing anything; causal, windows, softcap, ALiBi (per batch too) and sinks with them;
  GQA/MQA; seqlen_q above and below seqlen_k (rows before key 0's chunk see no key: 0, -inf, zero gradients; keys
  before the first row's chunk get zero gradients).
* Varlen (each sequence's chunks from its own key 0), the packed functions, KV caches (contiguous, paged, split-KV,
  left padding, a decode step's GQA fold; keys from the rows' chunk on), and cuflash.jax under jit and grad.
* The blocks outside a row's chunk are not read: a chunked causal call reads a fraction of what the causal one does.
* Used prefixes (seqused_q / seqused_k): the chunks cut the prefixes; rows past them give 0, -inf, zero gradients.
* What chunks do not take is refused naming the argument: bad values, dropout, algorithms without varlen
  kernels, traced cu_seqlens in JAX.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import chunks, sim
from cuflash.mask import Mask
from cuflash.reference import attention_with_kvcache_reference
from cuflash.testing import numpy_dtype, random_inputs, rows_without_key

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SHAPES = {
    "gqa-wide": (1, 97, 161, 4, 2, 64),
    "mqa-tall": (2, 83, 40, 3, 1, 40),
    "mha-square": (2, 130, 130, 2, 2, 96),
}
OPTIONS = {
    "chunk": dict(attention_chunk=48),
    "chunk-causal": dict(attention_chunk=64, causal=True),
    "narrow-chunk": dict(attention_chunk=7),
    "chunk-window-causal": dict(attention_chunk=100, window_size=(30, -1), causal=True),
    "chunk-window": dict(attention_chunk=37, window_size=(9, 5)),
    "chunk-softcap-alibi-causal": dict(attention_chunk=56, causal=True, softcap=4.0, alibi=True),
    "chunk-sinks-causal": dict(attention_chunk=33, causal=True, sinks=True),
}
# (dtype, simulator target): fa2's SIMT, mma.sync and Hopper kernels.
KERNELS = [("float32", None), ("float16", None), ("bfloat16", "sm_90"), ("float16", "sm_90"), ("bfloat16", None)]
EXPECTED_FORWARD = {("float32", None): "fa2_forward_kernel", ("float16", None): "fa2_tc_forward_kernel",
                    ("bfloat16", None): "fa2_tc_forward_kernel", ("bfloat16", "sm_90"): "fa3_forward_kernel",
                    ("float16", "sm_90"): "fa3_forward_kernel"}


def _cases():
    cases = []
    for i, name in enumerate(OPTIONS):
        for j, (dtype, arch) in enumerate(KERNELS):
            shape_name = list(SHAPES)[(i + j) % len(SHAPES)]
            cases.append(pytest.param(name, dtype, arch, shape_name, (i + j) % 2 == 1,
                                      id=f"{name}-{dtype}-{arch or 'sm_80'}-{shape_name}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _cases()]
    assert {v[0] for v in values} == set(OPTIONS)
    assert {(v[1], v[2]) for v in values} == set(KERNELS)
    for kernel in KERNELS:
        assert {v[3] for v in values if (v[1], v[2]) == kernel} == set(SHAPES), kernel
    assert {v[4] for v in values} == {False, True}


def _targeting(arch):
    return sim.targeting(arch) if arch else contextlib.nullcontext()


def _options(name, shape, per_batch, seed=5):
    options = dict(OPTIONS[name])
    rng = np.random.default_rng(seed)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, (shape[0], shape[3]) if per_batch else shape[3]).astype(
            np.float32)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(shape[3]).astype(np.float32)
    return options


def _check(q, k, v, dout, options, deterministic=False):
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    empty = rows_without_key(q.shape[1], k.shape[1], options.get("causal", False), options.get("window_size", (-1, -1)),
                             options["attention_chunk"])
    if "sinks" not in options:
        assert np.all(out[:, empty].astype(np.float32) == 0) and np.all(lse[:, :, empty] == -np.inf)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    assert len(grads) == (4 if "sinks" in options else 3)
    assert np.all(grads[0][:, empty].astype(np.float32) == 0)
    return out, empty


@pytest.mark.parametrize("option_name, dtype, arch, shape_name, per_batch", _cases())
def test_chunked_attention_matches_reference(option_name, dtype, arch, shape_name, per_batch):
    shape = SHAPES[shape_name]
    q, k, v, dout = random_inputs(shape, dtype, seed=len(option_name) + len(shape_name))
    options = _options(option_name, shape, per_batch)
    with _targeting(arch), sim.record() as records:
        out, _ = _check(q, k, v, dout, options, deterministic=per_batch)
    kernels = {r.kernel.split("<")[0].split("::")[-1] for r in records.launches}
    assert EXPECTED_FORWARD[(dtype, arch)] in kernels, kernels
    # Where the chunks hide keys the window alone shows, the result without them is another one.
    mask = Mask.of(options.get("causal", False), options.get("window_size", (-1, -1)), options["attention_chunk"])
    if not np.array_equal(mask.policy(shape[1], shape[2]).matrix(), mask.window.policy(shape[1], shape[2]).matrix()):
        with _targeting(arch):
            unchunked = cuflash.attention(q, k, v, **dict(options, attention_chunk=0))
        assert not np.allclose(unchunked.astype(np.float32), out.astype(np.float32), atol=1e-2)


@pytest.mark.parametrize("dtype, arch", [("float16", None), ("bfloat16", "sm_90"), ("float32", None)])
def test_rows_and_keys_outside_every_chunk(dtype, arch):
    """seqlen_q > seqlen_k without a causal mask: rows whose diagonal is negative lie before key 0's chunk (out 0,
    lse -inf, dq 0); seqlen_q < seqlen_k by more than a chunk: keys before the first row's chunk are seen by no row
    (dk, dv 0)."""
    q, k, v, dout = random_inputs((1, 90, 25, 2, 1, 32), dtype, seed=9)
    with _targeting(arch):
        _, empty = _check(q, k, v, dout, dict(attention_chunk=16))
    assert empty.sum() == 90 - 25 and not empty[90 - 25:].any()
    q, k, v, dout = random_inputs((2, 20, 150, 2, 1, 32), dtype, seed=10)
    with _targeting(arch):
        out, lse = cuflash.attention(q, k, v, return_lse=True, attention_chunk=40, causal=True)
        _, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, attention_chunk=40, causal=True)
    _check(q, k, v, dout, dict(attention_chunk=40, causal=True))
    assert np.all(dk[:, :120].astype(np.float32) == 0) and np.all(dv[:, :120].astype(np.float32) == 0)


@pytest.mark.parametrize("dtype, arch", [("float16", None), ("bfloat16", "sm_90")])
def test_varlen_chunks_count_from_each_sequences_first_key(dtype, arch):
    rng = np.random.default_rng(4)
    lengths_q, lengths_k = [37, 0, 90, 5], [70, 12, 90, 133]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    dt = numpy_dtype(dtype)
    q, dout = (rng.standard_normal((int(cu_q[-1]), 4, 64)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, 64)).astype(dt) for _ in range(2))
    slopes = rng.uniform(0.05, 0.5, (4, 4)).astype(np.float32)
    options = dict(attention_chunk=40, causal=True, alibi_slopes=slopes)
    with _targeting(arch):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    ref = tol.forward_references(q, k, v, cu_seqlens=(cu_q, cu_k), **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, cu_seqlens=(cu_q, cu_k), **options)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


def test_packed_functions_take_chunks():
    q, k, v, dout = random_inputs((2, 75, 75, 4, 4, 32), "float16", seed=2)
    options = dict(attention_chunk=24, causal=True)
    qkv = np.stack([q, k, v], axis=2)
    out, lse = cuflash.attention_qkvpacked(qkv, return_lse=True, **options)
    want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    dqkv = cuflash.attention_qkvpacked_backward(dout, qkv, out, lse, **options)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    assert np.array_equal(dqkv, np.stack(want, axis=2))
    dq, dkv = cuflash.attention_kvpacked_backward(dout, q, qkv[:, :, 1:], out, lse, **options)
    assert np.array_equal(dq, want[0]) and np.array_equal(dkv, np.stack(want[1:], axis=2))


def test_blocks_outside_the_chunks_are_not_read():
    """Chunks of 128 keys over 640, causal: each Q block reads its own chunk's keys up to its diagonal, 5 K/V blocks of
    128 keys in all per head where causal attention reads 15: 0.43x the bytes (with Q's), and 0.61x as the simulator
    counts a varlen kernel's reads of cu_seqlens (each one, where a GPU's L1 holds them); 1.0x if the chunks were
    masked but not skipped. The virtual batches are made once per signature."""
    q, k, v, _ = random_inputs((1, 640, 640, 2, 1, 64), "float16", seed=5)

    def read_bytes(**options):
        with sim.record() as records:
            cuflash.attention(q, k, v, causal=True, **options)
        return sum(r.global_bytes_read for r in records.launches)

    assert read_bytes(attention_chunk=128) < 0.65 * read_bytes()
    first = chunks.fixed_length_batches(1, 640, 640, True, (-1, -1), 128)
    assert chunks.fixed_length_batches(1, 640, 640, True, (-1, -1), 128) is first
    assert first.cu_seqlens_q.tolist() == list(range(0, 641, 128)) and first.max_seqlen_k == 128


def _caches(dtype, seqlen_q, seed, paged):
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    batch, nheads, nheads_k, headdim, capacity, page = 3, 4, 2, 64, 256, 64
    k_cache, v_cache = (rng.standard_normal((batch, capacity, nheads_k, headdim)).astype(dt) for _ in range(2))
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dt)
    table = paged_caches = None
    if paged:
        pages = capacity // page
        table = rng.permutation(batch * pages + 3)[:batch * pages].astype(np.int32).reshape(batch, pages)
        paged_caches = [np.zeros((batch * pages + 3, page, nheads_k, headdim), dt) for _ in range(2)]
        for b in range(batch):
            for i in range(pages):
                for cache, whole in zip(paged_caches, (k_cache, v_cache)):
                    cache[table[b, i]] = whole[b, i * page:(i + 1) * page]
    return q, k_cache, v_cache, table, paged_caches


@pytest.mark.parametrize("dtype, arch, seqlen_q, splits, paged, leftpad", [
    ("float16", None, 1, 1, False, False),      # a decode step: GQA folded, keys from the row's chunk on
    ("bfloat16", None, 5, 3, True, False),      # split-KV over a paged cache: pages dropped from the table
    ("float16", "sm_90", 9, 0, False, True),    # the Hopper forward, keys past left padding
    ("float32", None, 4, 2, False, True),
])
def test_kvcache_chunks(dtype, arch, seqlen_q, splits, paged, leftpad):
    q, k_cache, v_cache, table, paged_caches = _caches(dtype, seqlen_q, seqlen_q + splits, paged)
    # Each sequence's rows within one chunk: its last key's offset in its chunk at least seqlen_q - 1.
    lengths = np.array([200, 77, 120] if seqlen_q < 9 else [100, 90, 130], np.int32)
    pads = np.array([3, 0, 50], np.int32) if leftpad else None
    options = dict(attention_chunk=64, causal=True)
    kwargs = dict(cache_seqlens=lengths, num_splits=splits, return_lse=True, **options)
    if leftpad:
        kwargs["cache_leftpad"] = pads
    with _targeting(arch), sim.record() as records:
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, **kwargs)
    if seqlen_q == 1:  # the decode step's 4 query heads folded into rows of its 2 kv heads: 2 heads in the grid
        assert records.launches[0].grid[1] == 2, records.launches[0].grid
    with _targeting(arch):
        if paged:
            out_paged, lse_paged = cuflash.attention_with_kvcache(q, *paged_caches, block_table=table, **kwargs)
            assert np.array_equal(out_paged, out) and np.array_equal(lse_paged, lse)
    ref = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, cache_leftpad=pads, **options)
    low = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, cache_leftpad=pads, dtype=q.dtype, **options)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)


@pytest.mark.parametrize("dtype, arch, layout, seqlen_q", [
    ("float16", None, "contiguous", 70),          # rows over two chunks
    ("bfloat16", "sm_90", "paged", 150),          # the Hopper forward over pages, rows over three chunks
    ("float32", None, "leftpad-index", 40),       # keys past left padding, cache rows named by cache_batch_idx
    ("float16", "sm_90", "contiguous-alibi-sinks", 100),
])
def test_kvcache_prefill_across_chunks(dtype, arch, layout, seqlen_q):
    """A KV-cache call whose rows span chunks (a prefill crossing a chunk's end) runs as a chunked varlen call over
    the caches (paged, or contiguous viewed packed): new rows appended first, then every chunk of rows a virtual
    batch; rotary at the rows' positions."""
    paged = layout == "paged"
    q, k_cache, v_cache, table, paged_caches = _caches(dtype, seqlen_q, seqlen_q, paged)
    rng = np.random.default_rng(seqlen_q)
    batch, _, nheads, headdim = q.shape
    lengths = np.array([30, 0, 100 - (seqlen_q > 100) * 96], np.int32)  # cached rows before the append
    new_k, new_v = (rng.standard_normal((batch, seqlen_q, 2, headdim)).astype(q.dtype) for _ in range(2))
    options = dict(attention_chunk=64, causal=True)
    kwargs = dict(k=new_k, v=new_v, cache_seqlens=lengths, return_lse=True, **options)
    index = pads = None
    if layout == "leftpad-index":
        big_k, big_v = (np.concatenate([c, c[:1]]) for c in (k_cache, v_cache))  # a spare cache row (row 3)
        k_cache, v_cache, index = big_k, big_v, np.array([0, 1, 3], np.int32)
        pads = np.array([7, 0, 64], np.int32)
        kwargs.update(cache_batch_idx=index, cache_leftpad=pads)
    if layout.endswith("alibi-sinks"):
        kwargs.update(alibi_slopes=rng.uniform(0.05, 0.5, (batch, nheads)).astype(np.float32),
                      sinks=rng.standard_normal(nheads).astype(np.float32))
    caches = paged_caches if paged else [k_cache, v_cache]
    before = [c.copy() for c in caches]
    with _targeting(arch), sim.record() as records:
        out, lse = cuflash.attention_with_kvcache(q, *caches, block_table=table, **kwargs)
    kernels = {r.kernel.split("<")[0].split("::")[-1] for r in records.launches}
    assert kernels == {EXPECTED_FORWARD[(dtype, arch)]}, kernels
    # The reference over the caches as the call left them, after checking the append wrote just the new rows.
    rows = lengths[:, None] + np.arange(seqlen_q)[None, :]
    for b in range(batch):
        for cache, old, new in zip(caches, before, (new_k, new_v)):
            if paged:
                old[table[b, rows[b] // 64], rows[b] % 64] = new[b]
            else:
                old[b if index is None else index[b], rows[b]] = new[b]
    for cache, expected in zip(caches, before):
        assert np.array_equal(cache, expected)
    reference_options = dict(options, block_table=table, cache_batch_idx=index, cache_leftpad=pads,
                             alibi_slopes=kwargs.get("alibi_slopes"), sinks=kwargs.get("sinks"))
    ref = attention_with_kvcache_reference(q, *caches, lengths + seqlen_q, **reference_options)
    low = attention_with_kvcache_reference(q, *caches, lengths + seqlen_q, dtype=q.dtype, **reference_options)
    tol.check_close("out", out, ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref[1], low[1], tol.FORWARD_FACTOR)
    unchunked = attention_with_kvcache_reference(q, *caches, lengths + seqlen_q, **dict(reference_options,
                                                                                        attention_chunk=0))
    assert np.abs(unchunked[0] - ref[0]).max() > 0.05  # the chunks hide keys the call without them sees


def test_kvcache_chunks_refused_where_caches_cannot_run_packed_or_pages_split_them():
    q, k_cache, v_cache, table, paged_caches = _caches("float16", 4, 0, True)
    new = np.ones((3, 4, 2, 64), np.float16)
    spanning = dict(k=new, v=new, attention_chunk=64, causal=True, cache_seqlens=np.array([60, 62, 10], np.int32))
    wide = np.zeros((3, 300, 2, 64), np.float16)
    before = wide.copy()
    with pytest.raises(ValueError, match="runs over k_cache viewed as one packed array of rows: its batch stride"):
        cuflash.attention_with_kvcache(q, wide[:, :256], v_cache, **spanning)
    assert np.array_equal(wide, before)  # refused before anything is written
    big = np.zeros((4, 256, 2, 64), np.float16)
    with pytest.raises(ValueError, match="cache_batch_idx must be increasing"):
        cuflash.attention_with_kvcache(q, big, big.copy(), cache_batch_idx=np.array([2, 0, 3], np.int32), **spanning)
    assert not big.any()
    with pytest.raises(ValueError, match=r"multiple of its page size \(64\), got 96"):
        cuflash.attention_with_kvcache(q, *paged_caches, block_table=table, cache_seqlens=100, attention_chunk=96)


@pytest.mark.parametrize("bad, error, match", [
    (-1, ValueError, "attention_chunk must be >= 0"),
    (2**31, ValueError, r"attention_chunk must be >= 0 .* below 2\*\*31"),
    (1.5, TypeError, "attention_chunk must be an int"),
    (True, TypeError, "attention_chunk must be an int"),
    (0.0, TypeError, "attention_chunk must be an int"),
])
def test_bad_chunks_are_refused_naming_the_argument(bad, error, match):
    q, k, v, dout = random_inputs((1, 8, 8, 2, 2, 16), "float16", seed=0)
    with pytest.raises(error, match=match):
        cuflash.attention(q, k, v, attention_chunk=bad)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(error, match=match):
        cuflash.attention_backward(dout, q, k, v, out, lse, attention_chunk=bad)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(error, match=match):
        cuflash.attention_varlen(q[0], k[0], v[0], cu, cu, attention_chunk=bad)


def test_what_chunks_do_not_take_is_refused():
    q, k, v, _ = random_inputs((1, 8, 8, 2, 2, 16), "float16", seed=0)
    with pytest.raises(ValueError, match="attention_chunk does not combine with dropout_p"):
        cuflash.attention(q, k, v, attention_chunk=4, dropout_p=0.1, dropout_seed=1)
    with pytest.raises(ValueError, match=r"attention_chunk \(run as varlen batches\) is supported by "
                                         r"algorithm='fa2' only, got algorithm='fa1'"):
        cuflash.attention(q, k, v, attention_chunk=4, algorithm="fa1")
    # A chunk of 0 is no chunk: the plain call, bitwise.
    assert np.array_equal(cuflash.attention(q, k, v, attention_chunk=np.int32(0)), cuflash.attention(q, k, v))


def _prefixes(x, cu, used):
    """The used prefix of each packed sequence, packed (the reference's input), and its cu_seqlens."""
    rows = np.concatenate([np.arange(cu[b], cu[b] + used[b]) for b in range(len(used))]).astype(np.int64)
    return x[rows], np.concatenate([[0], np.cumsum(used)]).astype(np.int32), rows


@pytest.mark.parametrize("dtype, arch, which", [("float16", None, "both"), ("bfloat16", "sm_90", "q"),
                                                ("float32", None, "k")])
def test_chunks_cut_used_prefixes(dtype, arch, which):
    """seqused_q / seqused_k with chunks: each sequence's used prefixes are chunked as if packed alone; the rows
    past them get out 0, lse -inf and zero gradients, the keys past them zero gradients (the varlen call's rule)."""
    lengths_q, lengths_k = [40, 70, 9, 0], [50, 130, 30, 12]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    used_q = np.array([33, 70, 0, 0], np.int32) if which != "k" else np.array(lengths_q, np.int32)
    used_k = np.array([41, 90, 30, 5], np.int32) if which != "q" else np.array(lengths_k, np.int32)
    rng = np.random.default_rng(4)
    dt = numpy_dtype(dtype)
    q, dout = (rng.standard_normal((cu_q[-1], 4, 32)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], 2, 32)).astype(dt) for _ in range(2))
    options = dict(attention_chunk=32, causal=True)
    counts = {"seqused_q": used_q} if which != "k" else {}
    counts.update({"seqused_k": used_k} if which != "q" else {})
    with _targeting(arch):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **counts, **options)
        dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **counts, **options)
    (q_used, cu_q_used, rows), (k_used, cu_k_used, keys) = _prefixes(q, cu_q, used_q), _prefixes(k, cu_k, used_k)
    v_used, dout_used = v[keys], dout[rows]
    ref = tol.forward_references(q_used, k_used, v_used, cu_seqlens=(cu_q_used, cu_k_used), **options)
    tol.check_close("out", out[rows], ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse[:, rows], ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout_used, q_used, k_used, v_used, cu_seqlens=(cu_q_used, cu_k_used), **options)
    for name, got, at in (("dq", dq, rows), ("dk", dk, keys), ("dv", dv, keys)):
        tol.check_close(name, got[at], getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
    unused_rows, unused_keys = np.setdiff1d(np.arange(cu_q[-1]), rows), np.setdiff1d(np.arange(cu_k[-1]), keys)
    assert not out[unused_rows].any() and np.all(lse[:, unused_rows] == -np.inf) and not dq[unused_rows].any()
    assert not dk[unused_keys].any() and not dv[unused_keys].any()
    assert unused_rows.size or unused_keys.size


def test_jax_chunks_under_jit_and_grad():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    q, k, v, dout = random_inputs((2, 70, 90, 4, 2, 40), "float16", seed=1)
    slopes = np.random.default_rng(3).uniform(0.05, 0.5, (2, 4)).astype(np.float32)
    options = dict(attention_chunk=32, causal=True, alibi_slopes=slopes)
    out, lse = jax.jit(lambda q, k, v: cj.attention(q, k, v, return_lse=True, **options))(q, k, v)
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", np.asarray(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", np.asarray(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)

    def loss(q, k, v):
        return jnp.sum(cj.attention(q, k, v, **options).astype(jnp.float32) * dout.astype(np.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, np.asarray(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                        tol.BACKWARD_FACTOR, atol=1e-5)
    cu_q, cu_k = np.array([0, 30, 70], np.int32), np.array([0, 50, 90], np.int32)
    packed = [x[0] for x in (q, k, v)]
    varlen = dict(attention_chunk=32, causal=True)
    out = jax.jit(lambda q, k, v: cj.attention_varlen(q, k, v, cu_q, cu_k, **varlen))(*packed)
    ref = tol.forward_references(*packed, cu_seqlens=(cu_q, cu_k), **varlen)
    tol.check_close("out", np.asarray(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    with pytest.raises(ValueError, match="attention_chunk needs concrete cu_seqlens_q and cu_seqlens_k"):
        jax.jit(lambda q, k, v, a, b: cj.attention_varlen(q, k, v, a, b, max_seqlen_q=40, max_seqlen_k=50,
                                                          **varlen))(*packed, cu_q, cu_k)


def test_jax_kvcache_chunks_traced_lengths():
    jax = pytest.importorskip("jax")

    import cuflash.jax as cj

    q, k_cache, v_cache, table, paged_caches = _caches("bfloat16", 1, 3, True)
    lengths = np.array([200, 77, 130], np.int32)
    options = dict(attention_chunk=64, causal=True)
    ref = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, **options)
    low = attention_with_kvcache_reference(q, k_cache, v_cache, lengths, dtype=q.dtype, **options)
    step = jax.jit(lambda q, a, b, n: cj.attention_with_kvcache(q, a, b, cache_seqlens=n, **options))
    tol.check_close("out", np.asarray(step(q, k_cache, v_cache, lengths)[0]), ref[0], low[0], tol.FORWARD_FACTOR)
    paged_step = jax.jit(lambda q, a, b, n, t: cj.attention_with_kvcache(q, a, b, cache_seqlens=n, block_table=t,
                                                                         **options))
    tol.check_close("out", np.asarray(paged_step(q, *paged_caches, lengths, table)[0]), ref[0], low[0],
                    tol.FORWARD_FACTOR)
    q2 = np.concatenate([q, q], axis=1)
    with pytest.raises(ValueError, match="with traced cache_seqlens or cache_leftpad needs one query row"):
        step(q2, k_cache, v_cache, lengths)


@pytest.mark.parametrize("paged", [False, True])
def test_jax_kvcache_prefill_across_chunks_equals_the_numpy_call(paged):
    """cuflash.jax.attention_with_kvcache with concrete lengths whose rows span chunks: the same chunked varlen call
    over the caches (contiguous ones reshaped to packed rows), bit for bit the NumPy function's, caches included."""
    jax = pytest.importorskip("jax")

    import cuflash.jax as cj

    q, k_cache, v_cache, table, paged_caches = _caches("float16", 50, 11, paged)
    caches = paged_caches if paged else [k_cache, v_cache]
    rng = np.random.default_rng(2)
    new_k, new_v = (rng.standard_normal((3, 50, 2, 64)).astype(np.float16) for _ in range(2))
    slopes = rng.uniform(0.05, 0.5, (3, 4)).astype(np.float32)
    kwargs = dict(k=new_k, v=new_v, cache_seqlens=np.array([40, 0, 100], np.int32), block_table=table,
                  attention_chunk=64, causal=True, alibi_slopes=slopes, return_lse=True)
    out, lse, k_done, v_done = jax.jit(lambda q, a, b: cj.attention_with_kvcache(q, a, b, **kwargs))(q, *caches)
    numpy_caches = [c.copy() for c in caches]
    expected = cuflash.attention_with_kvcache(q, *numpy_caches, **kwargs)
    for got, want in zip((out, lse, k_done, v_done), (*expected, *numpy_caches)):
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    with pytest.raises(ValueError, match="cache_batch_idx must be increasing"):
        cj.attention_with_kvcache(q, np.concatenate([k_cache, k_cache]), np.concatenate([v_cache, v_cache]),
                                  **dict(kwargs, block_table=None, cache_batch_idx=np.array([3, 1, 2], np.int32)))
    if paged:
        with pytest.raises(ValueError, match="rows that span chunks needs a concrete block_table"):
            jax.jit(lambda t: cj.attention_with_kvcache(q, *caches, **dict(kwargs, block_table=t)))(table)


def test_jax_chunks_with_used_prefixes_equal_the_numpy_call():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    q, k, v, dout = (x[0] for x in random_inputs((1, 70, 90, 4, 2, 40), "float16", seed=6))
    cu_q, cu_k = np.array([0, 30, 70], np.int32), np.array([0, 50, 90], np.int32)
    counts = dict(seqused_q=np.array([25, 40], np.int32), seqused_k=np.array([50, 33], np.int32))
    options = dict(attention_chunk=16, causal=True, **counts)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)

    def loss(q, k, v):
        return jnp.sum(cj.attention_varlen(q, k, v, cu_q, cu_k, **options).astype(jnp.float32)
                       * dout.astype(np.float32))

    got = jax.jit(lambda q, k, v: cj.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options))(q, k, v)
    assert np.array_equal(np.asarray(got[0]), out) and np.array_equal(np.asarray(got[1]), lse)
    got_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got_grads, grads):
        assert np.array_equal(np.asarray(a), b)
    with pytest.raises(ValueError, match=r"needs concrete cu_seqlens_q and cu_seqlens_k \(and block_table, seqused"):
        jax.jit(lambda u: cj.attention_varlen(q, k, v, cu_q, cu_k, **dict(options, seqused_k=u)))(counts["seqused_k"])
