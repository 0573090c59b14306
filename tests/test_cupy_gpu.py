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
from cuflash.testing import random_qkv

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
