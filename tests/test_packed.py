"""Packed inputs ([parity]): attention_qkvpacked / attention_kvpacked and their backwards, FA2's
flash_attn_qkvpacked_func and flash_attn_kvpacked_func.

* The packed calls are ``attention`` on views of the packed arrays: bit for bit the unpacked calls' results, with
  no copy of any input (the views go to the kernels through their strides);
* the gradients come back in the packed layout, the kernels writing dq, dk, dv straight into its parts: bit for
  bit the unpacked backward's (deterministic dq, so both runs add in one order), in both fa2 variants, GQA and
  seqlen_q != seqlen_k, and against the float64 reference with float32 atomics;
* a packed array of the wrong shape is refused by name before any kernel runs.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _placement
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.testing import numpy_dtype


def _no_copies(monkeypatch):
    def refuse(array):
        raise AssertionError("a packed input was copied")

    monkeypatch.setattr(_placement, "ascontiguous", refuse)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qkvpacked_equals_the_unpacked_calls_without_copies(dtype, monkeypatch):
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((2, 37, 3, 3, 40)).astype(numpy_dtype(dtype))
    dout = rng.standard_normal((2, 37, 3, 40)).astype(qkv.dtype)
    options = dict(causal=True, softcap=4.0)
    q, k, v = (np.ascontiguousarray(qkv[:, :, i]) for i in range(3))
    want_out, want_lse = cuflash.attention(q, k, v, return_lse=True, **options)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, deterministic=True, **options)

    _no_copies(monkeypatch)
    out, lse = cuflash.attention_qkvpacked(qkv, return_lse=True, **options)
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    dqkv = cuflash.attention_qkvpacked_backward(dout, qkv, out, lse, deterministic=True, **options)
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype
    for i in range(3):
        assert np.array_equal(dqkv[:, :, i], want[i]), "dq dk dv".split()[i]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_kvpacked_with_gqa_matches_the_reference(dtype, monkeypatch):
    rng = np.random.default_rng(2)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((2, 21, 4, 24)).astype(dt)
    kv = rng.standard_normal((2, 45, 2, 2, 24)).astype(dt)
    dout = rng.standard_normal(q.shape).astype(dt)
    options = dict(window_size=(9, 3))
    _no_copies(monkeypatch)
    with sim.record() as records:
        out, lse = cuflash.attention_kvpacked(q, kv, return_lse=True, **options)
        dq, dkv = cuflash.attention_kvpacked_backward(dout, q, kv, out, lse, **options)
    expected = "cuflash::fa2_forward_kernel" if dtype == "float32" else "cuflash::fa2_tc_forward_kernel"
    assert expected in {r.kernel.split("<")[0] for r in records.launches}
    k, v = kv[:, :, 0], kv[:, :, 1]
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dkv.dtype == kv.dtype
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in (("dq", dq), ("dk", dkv[:, :, 0]), ("dv", dkv[:, :, 1])):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


def test_packed_arrays_of_the_wrong_shape_are_refused_by_name():
    qkv = np.zeros((1, 8, 2, 2, 16), np.float32)
    with sim.record() as records:
        with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\), got "
                                             r"\(1, 8, 2, 2, 16\)"):
            cuflash.attention_qkvpacked(qkv)
        with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen_k, 2, nheads_k, headdim\)"):
            cuflash.attention_kvpacked(np.zeros((1, 8, 2, 16), np.float32), np.zeros((1, 8, 2, 16), np.float32))
        with pytest.raises(ValueError, match=r"qkv must have shape"):
            cuflash.attention_qkvpacked_backward(*(np.zeros((1, 8, 2, 16), np.float32),) * 2,
                                                 np.zeros((1, 8, 2, 16), np.float32), np.zeros((1, 2, 8), np.float32))
    assert records.launches == []
