"""The CuPy path on a real GPU (tests marked gpu: skipped where CuPy finds no device).

Everything but the launch itself (validation, plans, parameter packing, scratch)
is shared with the simulator path and tested without a GPU; these tests check
the thin remainder: CuPy allocation, cubin loading and launch, results in CuPy
arrays, the device rules.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash.kernels import catalog
from cuflash.testing import numpy_dtype, random_qkv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("algorithm", catalog.algorithms())
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_reference(algorithm, dtype, causal):
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 113, 203, 6, 2, 59, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(gq, gk, gv, causal=causal, algorithm=algorithm, return_lse=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    grads = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=causal, algorithm=algorithm)
    ref = tol.forward_references(q, k, v, causal=causal)
    tol.check_close("out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", cupy.asnumpy(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, causal=causal)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, cupy.asnumpy(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                        tol.BACKWARD_FACTOR, atol=1e-5 if causal else 0.0)


def test_gpu_forward_is_bitwise_reproducible():
    cupy = pytest.importorskip("cupy")
    q, k, v = (cupy.asarray(x) for x in random_qkv(np.random.default_rng(1), 4, 257, 300, 8, 8, 64, "float16"))
    first = cupy.asnumpy(cuflash.attention(q, k, v, causal=True))
    for _ in range(5):
        assert np.array_equal(first.view(np.uint16), cupy.asnumpy(cuflash.attention(q, k, v, causal=True)).view(np.uint16))


def test_numpy_mixed_with_cupy_is_rejected():
    cupy = pytest.importorskip("cupy")
    q, k, v = random_qkv(np.random.default_rng(2), 1, 8, 8, 1, 1, 16)
    with pytest.raises(TypeError, match="q is a NumPy array but k is a CuPy array"):
        cuflash.attention(q, cupy.asarray(k), cupy.asarray(v))


def test_host_integer_inputs_are_read_without_waiting_for_the_device(monkeypatch):
    """A decode loop that keeps its lengths and block table on the host (NumPy) beside CuPy tensors: no integer
    input is copied back from the device (each such copy waits for the device), and the results are those of the
    same call with every input on the device, bit for bit; varlen's cu_seqlens likewise."""
    cupy = pytest.importorskip("cupy")
    from cuflash import api

    copy_to_host = api.host_copy
    device_copies = []

    def counted(array):
        if not isinstance(array, np.ndarray):
            device_copies.append(type(array))
        return copy_to_host(array)

    rng = np.random.default_rng(6)
    q = cupy.asarray(rng.standard_normal((2, 1, 8, 128)).astype(np.float16))
    k_pages, v_pages = (cupy.asarray(rng.standard_normal((20, 64, 2, 128)).astype(np.float16)) for _ in range(2))
    table = rng.permutation(20)[:16].astype(np.int32).reshape(2, 8)
    cu_q, cu_k = np.arange(3, dtype=np.int32), np.array([0, 300, 450], np.int32)
    packed_k, packed_v = (cupy.asarray(rng.standard_normal((450, 2, 128)).astype(np.float16)) for _ in range(2))
    on_device = []
    for used in (300, 301, 302):  # three decode steps
        lengths = np.array([used, 150], np.int32)
        on_device.append(cupy.asnumpy(cuflash.attention_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=cupy.asarray(lengths), block_table=cupy.asarray(table), causal=True)))
    on_device.append(cupy.asnumpy(cuflash.attention_varlen(q[:, 0], packed_k, packed_v, cupy.asarray(cu_q),
                                                           cupy.asarray(cu_k), causal=True)))
    monkeypatch.setattr(api, "host_copy", counted)
    on_host = []
    for used in (300, 301, 302):
        lengths = np.array([used, 150], np.int32)
        on_host.append(cupy.asnumpy(cuflash.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths,
                                                                   block_table=table, causal=True)))
    on_host.append(cupy.asnumpy(cuflash.attention_varlen(q[:, 0], packed_k, packed_v, cu_q, cu_k, causal=True)))
    assert device_copies == []
    for got, want in zip(on_host, on_device):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_arrays_on_different_gpus_are_rejected():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = random_qkv(np.random.default_rng(3), 1, 8, 8, 1, 1, 16)
    with cupy.cuda.Device(0):
        gq, gk = cupy.asarray(q), cupy.asarray(k)
    with cupy.cuda.Device(1):
        gv = cupy.asarray(v)
    with pytest.raises(ValueError, match="same GPU"):
        cuflash.attention(gq, gk, gv)


def test_second_gpu_allocates_and_launches_there():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = random_qkv(np.random.default_rng(4), 1, 33, 40, 2, 1, 32)
    with cupy.cuda.Device(1):
        gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
    with cupy.cuda.Device(0):
        out = cuflash.attention(gq, gk, gv)
    assert out.device.id == 1
    ref = tol.forward_references(q, k, v)
    tol.check_close("out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_kvcache_split_kv_and_decode_fold(dtype):
    """attention_with_kvcache on CuPy caches: the heuristic sees the device's SM count (a one-row GQA decode of
    two sequences leaves SMs idle, so it splits), the paged cache is updated in place, and every split count
    agrees with the float64 reference."""
    cupy = pytest.importorskip("cupy")
    from cuflash.backends.cupy_gpu import CupyBackend
    from cuflash.kernels import plans
    from cuflash.kernels.program import Problem
    from cuflash.reference import attention_with_kvcache_reference

    backend = CupyBackend(cupy.cuda.Device().id)
    assert backend.target.sm_count == cupy.cuda.Device().attributes["MultiProcessorCount"]
    problem = Problem(dtype, 2, 1, 4096, 8, 2, 128, kvcache=True, num_splits=0)
    assert plans.forward_program("fa2", problem, backend.target).num_kv_splits > 1

    rng = np.random.default_rng(3)
    dt = np.float16 if dtype == "float16" else np.float32
    q = rng.standard_normal((2, 1, 8, 128)).astype(dt)
    k_pages, v_pages = (rng.standard_normal((2 * 64 + 3, 64, 2, 128)).astype(dt) for _ in range(2))
    table = rng.permutation(2 * 64 + 3)[:128].astype(np.int32).reshape(2, 64)
    k_new, v_new = (rng.standard_normal((2, 1, 2, 128)).astype(dt) for _ in range(2))
    lengths = np.array([4000, 1234], np.int32)
    gk, gv = cupy.asarray(k_pages), cupy.asarray(v_pages)
    expected_k = k_pages.copy()
    for b in range(2):
        row = int(lengths[b])
        expected_k[table[b, row // 64], row % 64] = k_new[b, 0]
    results = {}
    for splits in (1, 0, 7):
        gk, gv = cupy.asarray(k_pages), cupy.asarray(v_pages)
        out = cuflash.attention_with_kvcache(cupy.asarray(q), gk, gv, k=cupy.asarray(k_new), v=cupy.asarray(v_new),
                                             cache_seqlens=cupy.asarray(lengths), block_table=cupy.asarray(table),
                                             num_splits=splits)
        results[splits] = cupy.asnumpy(out)
        assert np.array_equal(cupy.asnumpy(gk), expected_k)
    k_done, v_done = cupy.asnumpy(gk), cupy.asnumpy(gv)
    ref = attention_with_kvcache_reference(q, k_done, v_done, lengths + 1, block_table=table)
    low = attention_with_kvcache_reference(q, k_done, v_done, lengths + 1, block_table=table, dtype=dt)
    for splits, out in results.items():
        tol.check_close(f"out (num_splits={splits})", out, ref[0], low[0], tol.FORWARD_FACTOR)
    # A sliding-window decode step over the same pages folds from the row's first visible key, inside a page (the
    # kernels' cache_leftpad of a paged cache; on an H100 the 16-bit call takes the Hopper forward's load path).
    window = dict(causal=True, window_size=(700, 0))
    out = cuflash.attention_with_kvcache(cupy.asarray(q), gk, gv, cache_seqlens=cupy.asarray(lengths + 1),
                                         block_table=cupy.asarray(table), **window)
    ref = attention_with_kvcache_reference(q, k_done, v_done, lengths + 1, block_table=table, **window)
    low = attention_with_kvcache_reference(q, k_done, v_done, lengths + 1, block_table=table, dtype=dt, **window)
    tol.check_close("windowed out", cupy.asnumpy(out), ref[0], low[0], tol.FORWARD_FACTOR)


@pytest.mark.parametrize("dtype, page_size", [("float16", 128), ("bfloat16", 48), ("float32", 16)])
def test_gpu_varlen_over_a_paged_cache(dtype, page_size):
    """attention_varlen with block_table on CuPy arrays (packed rows, keys in shuffled pages), against the float64
    reference over the same keys packed; on an H100 the 16-bit calls run the Hopper forward (TMA boxes where the
    pages hold whole K/V blocks)."""
    cupy = pytest.importorskip("cupy")
    from cuflash.reference import attention_varlen_reference

    rng = np.random.default_rng(5)
    dt = numpy_dtype(dtype)
    lengths_q, lengths_k = [300, 1, 0, 77], [1000, 513, 64, 77]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    q = rng.standard_normal((cu_q[-1], 8, 128)).astype(dt)
    k, v = (rng.standard_normal((cu_k[-1], 2, 128)).astype(dt) for _ in range(2))
    per_sequence = -(-max(lengths_k) // page_size)
    table = rng.permutation(4 * per_sequence + 5)[:4 * per_sequence].astype(np.int32).reshape(4, per_sequence)
    caches = [np.zeros((4 * per_sequence + 5, page_size, 2, 128), dt) for _ in range(2)]
    for b in range(4):
        for j in range(lengths_k[b]):
            for cache, packed in zip(caches, (k, v)):
                cache[table[b, j // page_size], j % page_size] = packed[cu_k[b] + j]
    out, lse = cuflash.attention_varlen(*(cupy.asarray(x) for x in (q, *caches, cu_q, cu_k)), causal=True,
                                        block_table=cupy.asarray(table), return_lse=True)
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True)
    low = attention_varlen_reference(q, k, v, cu_q, cu_k, causal=True, dtype=dt)
    tol.check_close("out", cupy.asnumpy(out), ref[0], low[0], tol.FORWARD_FACTOR)
    tol.check_close("lse", cupy.asnumpy(lse), ref[1], low[1], tol.FORWARD_FACTOR)
    # A decode step (a row per sequence, seqused_k counting the keys, no cu_seqlens_k: vLLM's call) runs as the KV
    # cache's decode over the same pages.
    decode_q, cu_one = q[:4], np.arange(5, dtype=np.int32)
    out = cuflash.attention_varlen(cupy.asarray(decode_q), *(cupy.asarray(c) for c in caches), cupy.asarray(cu_one),
                                   None, seqused_k=cupy.asarray(np.array(lengths_k, np.int32)), causal=True,
                                   block_table=cupy.asarray(table))
    ref = attention_varlen_reference(decode_q, k, v, cu_one, cu_k, causal=True)
    low = attention_varlen_reference(decode_q, k, v, cu_one, cu_k, causal=True, dtype=dt)
    tol.check_close("decode out", cupy.asnumpy(out), ref[0], low[0], tol.FORWARD_FACTOR)


@pytest.mark.parametrize("dtype, pair", [("bfloat16", (192, 128)), ("float16", (160, 64)), ("float16", (64, 512)),
                                         ("float32", (40, 300))])
def test_gpu_v_with_a_head_dim_of_its_own(dtype, pair):
    """MLA's 192 / 128 and FA3's 64 / 512 (V in column chunks: program.value_column_chunks) on CuPy arrays: the
    chunks' views of v, out, dout and dv launch at their column offsets (CuPy's data.ptr of a view), dq and dk
    summed on the device; forward, backward and deterministic reruns against the reference. On an sm_90 device
    160 / 64 runs MLA's forward tile with V's second 64-column panel wholly past v's columns, and 192 / 128 the d256
    backward with Q's and K's fourth: panels for which the producers issue no TMA box (fa3::panels_holding), zeroed
    by the kernels once per block."""
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(4)
    d, dv = pair
    dt = np.dtype(numpy_dtype(dtype))
    q = rng.standard_normal((2, 77, 4, d)).astype(dt)
    k = rng.standard_normal((2, 90, 2, d)).astype(dt)
    v = rng.standard_normal((2, 90, 2, dv)).astype(dt)
    dout = rng.standard_normal((2, 77, 4, dv)).astype(dt)
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(gq, gk, gv, causal=True, return_lse=True)
    assert out.shape == (2, 77, 4, dv)
    ref = tol.forward_references(q, k, v, causal=True)
    tol.check_close("out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", cupy.asnumpy(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    runs = [cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=True, deterministic=True) for _ in range(2)]
    bref = tol.backward_references(dout, q, k, v, causal=True)
    for name, got, again in zip(("dq", "dk", "dv"), *runs):
        got, again = cupy.asnumpy(got), cupy.asnumpy(again)
        assert np.array_equal(got.view(np.uint8), again.view(np.uint8)), name
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 64), ("float16", 128)])
def test_gpu_sinks(dtype, head_dim):
    """gpt-oss's sinks with a sliding window on CuPy arrays (on an sm_90 device: the wgmma forward joins them in its
    epilogue, the wgmma backward takes them as they are): out, lse, dq, dk, dv and dsinks against the reference."""
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 150, 150, 8, 2, head_dim, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    sinks = rng.standard_normal(8).astype(np.float32)
    options = dict(causal=True, window_size=(64, 0), sinks=sinks)
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(gq, gk, gv, return_lse=True, **{**options, "sinks": cupy.asarray(sinks)})
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", cupy.asnumpy(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    grads = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, **{**options, "sinks": cupy.asarray(sinks)})
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv", "dsinks"), grads):
        tol.check_close(name, cupy.asnumpy(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                        tol.BACKWARD_FACTOR, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_split_kv_on_fixed_length_and_varlen_forwards(dtype):
    """num_splits on attention and attention_varlen (short queries over long keys, the grid FA2's heuristic splits):
    the split results within FA2's rule of the reference, and a backward from a split out and lse."""
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 2, 7, 3001, 8, 2, 128, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    ref = tol.forward_references(q, k, v, causal=True)
    for splits in (0, 5, 128):
        out, lse = cuflash.attention(gq, gk, gv, causal=True, num_splits=splits, return_lse=True)
        tol.check_close(f"out (num_splits={splits})", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
        tol.check_close(f"lse (num_splits={splits})", cupy.asnumpy(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    grads = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=True)
    bref = tol.backward_references(dout, q, k, v, causal=True)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, cupy.asnumpy(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                        tol.BACKWARD_FACTOR, atol=1e-5)
    cu_q = np.arange(0, 15, 7, dtype=np.int32)
    cu_k = np.arange(0, 6003, 3001, dtype=np.int32)
    packed = [cupy.asarray(x.reshape(-1, *x.shape[2:])) for x in (q, k, v)]
    out, lse = cuflash.attention_varlen(*packed, cupy.asarray(cu_q), cupy.asarray(cu_k), causal=True, num_splits=3,
                                        return_lse=True)
    ref = tol.forward_references(*(x.reshape(-1, *x.shape[2:]) for x in (q, k, v)), cu_seqlens=(cu_q, cu_k),
                                 causal=True)
    tol.check_close("varlen out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("varlen lse", cupy.asnumpy(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
