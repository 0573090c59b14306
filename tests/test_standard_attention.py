"""Standard attention (algorithm="standard") on the CPU simulator.

* Forward and backward against the float64 reference with FlashAttention's tolerance rule, over float32 /
  float16 / bfloat16, odd sequence lengths, head dims that are not powers of two (1 .. 256), MHA / GQA / MQA,
  causal with seqlen_q < and > seqlen_k (rows that see no key), and a non-default softmax scale.
* The materialised matrices themselves: S (with -inf exactly where masked), P, dP/dS scratch.
* Zero-length sequences through the launch plans directly (the public API short-circuits them).
* Global memory traffic of every launch, byte for byte, against the kernels' own formula in
  cuflash/kernels/families/standard.py; and the standard-attention signature: S and P cost
  4 * batch * nheads * seqlen_q * seqlen_k bytes each to write and are read back.
* Bitwise-reproducible gradients (no atomics anywhere), and NVRTC builds without spills.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash._tolerance import (
    BACKWARD_FACTOR,
    FORWARD_FACTOR,
    backward_references,
    check_close,
    forward_references,
)
from cuflash.backends.program import run_program
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels.families import standard
from cuflash.kernels.params import pack_params
from cuflash.kernels.program import Problem
from cuflash.kernels.targets import target

SM80 = target("sm_80")
from cuflash.testing import random_inputs, rows_without_key
from cuflash.mask import Mask

DTYPES = ("float32", "float16", "bfloat16")

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SHAPES = {
    "gqa_odd": (1, 113, 203, 2, 1, 40),  # GQA 2:1, no length a tile multiple, seqlen_q < seqlen_k
    "mqa_tall": (1, 150, 77, 3, 1, 72),  # MQA, seqlen_q > seqlen_k: causal leaves 73 rows without a key
    "mha_aligned": (2, 64, 128, 2, 2, 64),  # every length a multiple of the 64 x 64 tile
    "one_query": (1, 1, 239, 2, 1, 128),  # decoding-like single row
    "wide_head": (1, 37, 70, 1, 1, 256),  # the largest head dim the API accepts
    "head_dim_1": (1, 17, 9, 2, 2, 1),  # the smallest head dim, seqlen_q > seqlen_k
    "long_keys": (1, 3, 1100, 2, 1, 16),  # rows longer than the softmax's register cache (1024 keys)
}

# Every shape runs causal and non-causal; dtypes rotate so each dtype meets every kind of shape at least once
# across the two tests while the grid stays small. The scale is non-default on some cases.
def _cases():
    cases = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        for causal in (False, True):
            dtype = DTYPES[(i + causal) % 3]
            scale = 0.3 if i % 2 else None
            case_id = f"{name}-{dtype}-{'causal' if causal else 'full'}"
            cases.append(pytest.param(shape, dtype, causal, scale, id=case_id))
    return cases


CASES = _cases()


@pytest.mark.parametrize("shape, dtype, causal, scale", CASES)
def test_forward_matches_reference(shape, dtype, causal, scale):
    q, k, v, _ = random_inputs(shape, dtype, seed=1)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="standard", return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (shape[0], shape[3], shape[1])
    ref = forward_references(q, k, v, causal=causal, softmax_scale=scale)
    check_close("out", out, ref.out, ref.out_lowp, FORWARD_FACTOR)
    check_close("lse", lse, ref.lse, ref.lse_lowp, FORWARD_FACTOR)
    empty = rows_without_key(shape[1], shape[2], causal)
    assert np.all(out.astype(np.float32)[:, empty] == 0)
    assert np.all(lse[:, :, empty] == -np.inf)


@pytest.mark.parametrize("shape, dtype, causal, scale", CASES)
def test_backward_matches_reference(shape, dtype, causal, scale):
    q, k, v, dout = random_inputs(shape, dtype, seed=2)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="standard", return_lse=True)
    dq, dk, dv = cuflash.attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, algorithm="standard"
    )
    assert (dq.dtype, dk.dtype, dv.dtype) == (q.dtype, k.dtype, v.dtype)
    ref = backward_references(dout, q, k, v, causal=causal, softmax_scale=scale)
    atol = 1e-5 if causal else 0.0
    check_close("dq", dq, ref.dq, ref.dq_lowp, BACKWARD_FACTOR, atol)
    check_close("dk", dk, ref.dk, ref.dk_lowp, BACKWARD_FACTOR, atol)
    check_close("dv", dv, ref.dv, ref.dv_lowp, BACKWARD_FACTOR, atol)
    empty = rows_without_key(shape[1], shape[2], causal)
    assert np.all(dq.astype(np.float32)[:, empty] == 0)


# ---------------------------------------------------------------------------------------------------
# Running programs directly: scratch contents, zero lengths, traffic.


def _problem(q, k, causal):
    batch, seqlen_q, nheads, headdim = q.shape
    return Problem(
        dtype=np.dtype(q.dtype).name,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=k.shape[1],
        nheads=nheads,
        nheads_k=k.shape[2],
        headdim=headdim,
        mask=Mask.causal(causal),
    )


def _run_forward(q, k, v, causal, scale):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
    scratch = run_program(
        backend, standard.forward_program(problem, SM80), problem, scale, {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    )
    return out, lse, scratch


def _run_backward(dout, q, k, v, out, lse, causal, scale):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads}
    scratch = run_program(backend, standard.backward_program(problem, SM80), problem, scale, arrays)
    return grads["dq"], grads["dk"], grads["dv"], scratch


def _dense_scores(q, k, scale, causal):
    """float64 scale * Q K^T as (batch, nheads, seqlen_q, seqlen_k), -inf where masked."""
    group = q.shape[2] // k.shape[2]
    k_per_head = np.repeat(k.astype(np.float64), group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k_per_head) * scale
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if causal:
        visible = np.arange(seqlen_k)[None, :] <= np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
        s = np.where(visible, s, -np.inf)
    return s


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scratch_holds_the_materialised_matrices(dtype):
    """S, P (forward), then P, dS (backward) are what Algorithm 0 says, masked entries exactly -inf / 0."""
    causal, scale = True, 0.25
    q, k, v, dout = random_inputs((1, 70, 45, 2, 1, 24), dtype, seed=3)
    out, lse, fwd = _run_forward(q, k, v, causal, scale)
    s_ref = _dense_scores(q, k, scale, causal)
    masked = np.isneginf(s_ref)
    assert np.array_equal(np.isneginf(fwd["scores"]), masked)
    np.testing.assert_allclose(np.where(masked, 0, fwd["scores"]), np.where(masked, 0, s_ref), rtol=1e-5, atol=1e-5)
    probs = fwd["probs"]
    assert np.all(probs[np.broadcast_to(masked, probs.shape)] == 0)
    row_sums = probs.sum(axis=-1)
    has_key = ~np.all(masked, axis=-1)
    np.testing.assert_allclose(row_sums, np.where(has_key, 1.0, 0.0), atol=1e-5)
    with np.errstate(divide="ignore"):  # rows without a key: log(0) = -inf, which the kernel must write
        lse_ref = np.log(np.exp(s_ref).sum(axis=-1))
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)

    dq, dk, dv, bwd = _run_backward(dout, q, k, v, out, lse, causal, scale)
    # P recomputed from the saved lse agrees with the forward's P.
    np.testing.assert_allclose(bwd["probs"], probs, rtol=1e-5, atol=1e-6)
    # dS = P * (dP - D), D = rowsum(dO * O), dP = dO V^T: here from the kernel's own P, O and float64 math.
    group = q.shape[2] // k.shape[2]
    v_per_head = np.repeat(v.astype(np.float64), group, axis=2)
    dp = np.einsum("bihd,bjhd->bhij", dout.astype(np.float64), v_per_head)
    d = np.einsum("bihd,bihd->bhi", dout.astype(np.float64), out.astype(np.float64))
    np.testing.assert_allclose(bwd["dout_dot_out"], d, rtol=1e-5, atol=1e-5)
    ds = probs * (dp - d[..., None])
    np.testing.assert_allclose(bwd["scores"], ds, rtol=1e-4, atol=1e-5)
    assert np.all(bwd["scores"][np.broadcast_to(masked, ds.shape)] == 0)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 19), (23, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_sequences(seqlen_q, seqlen_k, causal):
    """The family's own programs handle empty sequences (the API also short-circuits them): out = 0 and
    lse = -inf when no key exists, zero dk/dv when no query exists, no launch with an empty grid."""
    q, k, v, dout = random_inputs((2, seqlen_q, seqlen_k, 2, 1, 33), "float16", seed=4)
    out, lse, _ = _run_forward(q, k, v, causal, 0.2)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv, _ = _run_backward(dout, q, k, v, out, lse, causal, 0.2)
    for grad in (dq, dk, dv):
        assert np.all(grad == 0)


TRAFFIC_CASES = [
    pytest.param((2, 100, 130, 4, 2, 48), "float16", False, id="gqa-half-full"),
    pytest.param((1, 150, 77, 3, 1, 40), "bfloat16", True, id="mqa-bf16-causal-tall"),
    pytest.param((1, 77, 150, 2, 2, 72), "float32", True, id="mha-f32-causal-wide"),
]


def _launch_traffic(recorder):
    return [(r.global_bytes_read, r.global_bytes_written) for r in recorder.launches]


def _expected(program, traffic):
    """Per-launch traffic of the launches the runner actually issues (it skips empty grids)."""
    assert len(program.launches) == len(traffic)
    return [tuple(t) for plan, t in zip(program.launches, traffic) if not plan.is_empty]


@pytest.mark.parametrize("shape, dtype, causal", TRAFFIC_CASES)
def test_global_traffic_is_exactly_the_formula(shape, dtype, causal):
    q, k, v, dout = random_inputs(shape, dtype, seed=5)
    problem = _problem(q, k, causal)
    with sim.record() as forward_records:
        out, lse, _ = _run_forward(q, k, v, causal, 0.125)
    assert _launch_traffic(forward_records) == _expected(
        standard.forward_program(problem, SM80), standard.forward_traffic(problem, SM80)
    )
    with sim.record() as backward_records:
        _run_backward(dout, q, k, v, out, lse, causal, 0.125)
    assert _launch_traffic(backward_records) == _expected(
        standard.backward_program(problem, SM80), standard.backward_traffic(problem, SM80)
    )


def test_scores_and_probs_are_written_once_and_read_back():
    """The cost FlashAttention removes, in closed form (non-causal): the score launch writes S
    (4 b h sq sk bytes), the softmax reads it once (rows of <= 1024 keys) and writes P (4 b h sq sk) plus lse,
    and O = P V reads P once per 64-column tile of the head dim."""
    batch, seqlen_q, seqlen_k, nheads, headdim = 1, 90, 70, 2, 80
    q, k, v, _ = random_inputs((batch, seqlen_q, seqlen_k, nheads, nheads, headdim), "float16", seed=6)
    with sim.record() as records:
        _run_forward(q, k, v, False, 0.1)
    scores, softmax, out = _launch_traffic(records)
    matrix = 4 * batch * nheads * seqlen_q * seqlen_k
    e = 2
    tiles = lambda n: math.ceil(n / 64)  # noqa: E731
    assert scores == (
        batch * nheads * headdim * e * (tiles(seqlen_k) * seqlen_q + tiles(seqlen_q) * seqlen_k),
        matrix,
    )
    assert softmax == (matrix, matrix + 4 * batch * nheads * seqlen_q)
    assert out == (
        tiles(headdim) * matrix + batch * nheads * tiles(seqlen_q) * seqlen_k * headdim * e,
        batch * seqlen_q * nheads * headdim * e,
    )


@pytest.mark.parametrize("seqlen_k", [1024, 1025])
def test_forward_softmax_on_edge_rows(seqlen_k):
    """The forward softmax kernel alone, on both sides of its register-cache limit (1024 keys: one read of
    S; 1025: two), on rows with no visible key, one key, huge and tiny scores."""
    rng = np.random.default_rng(9)
    rows = 6
    scores = (rng.standard_normal((1, 1, rows, seqlen_k)) * 4).astype(np.float32)
    scores[0, 0, 0] = -np.inf  # no key
    scores[0, 0, 1, 1:] = -np.inf  # one key
    scores[0, 0, 2, ::3] = -np.inf  # strided mask
    scores[0, 0, 3] += 80.0  # exp overflows float32 without the max subtraction
    scores[0, 0, 4] -= 80.0  # ... or underflows
    scores[0, 0, 5, -1] = 50.0  # the maximum in the last lane's last slot
    probs = np.full_like(scores, np.nan)
    lse = np.full((1, 1, rows), np.nan, dtype=np.float32)
    problem = Problem("float32", 1, rows, seqlen_k, 1, 1, 8)
    params = pack_params(
        problem, softmax_scale=1.0, pointers={"scores": scores.ctypes.data, "probs": probs.ctypes.data, "lse": lse.ctypes.data},
        strides={},
    )
    plan = standard.forward_program(problem, SM80).launches[1]
    with sim.record() as rec:
        sim.launch(plan.kernel, plan.grid, plan.block, plan.dynamic_smem_bytes, params, [scores, probs, lse])
    assert _launch_traffic(rec) == [tuple(standard.softmax_traffic("kForward", problem))]

    s64 = scores.astype(np.float64)
    row_max = np.max(s64, axis=-1, keepdims=True)
    has_key = np.isfinite(row_max)
    e = np.exp(s64 - np.where(has_key, row_max, 0))
    total = e.sum(axis=-1, keepdims=True)
    expected = np.where(has_key, e / np.where(has_key, total, 1), 0)
    np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-7)
    assert np.all(probs[0, 0, 0] == 0) and lse[0, 0, 0] == -np.inf
    assert probs[0, 0, 1, 0] == 1 and np.all(probs[0, 0, 1, 1:] == 0)
    np.testing.assert_allclose(lse[0, 0, 1:], row_max[0, 0, 1:, 0] + np.log(total[0, 0, 1:, 0]), rtol=1e-6)


def test_backward_is_bitwise_reproducible():
    q, k, v, dout = random_inputs((2, 57, 83, 4, 1, 40), "bfloat16", seed=7)
    out, lse = cuflash.attention(q, k, v, causal=True, algorithm="standard", return_lse=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="standard")
    second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="standard")
    for a, b in zip(first, second):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_no_data_races():
    """The simulator's race detector (shared memory and global buffers, CUDA's ordering rules) over a causal
    GQA forward and backward: double-buffered staging, in-place dS, per-block dK/dV ownership."""
    q, k, v, dout = random_inputs((1, 70, 45, 4, 2, 24), "float16", seed=8)
    with sim.checking("race"):
        out, lse = cuflash.attention(q, k, v, causal=True, algorithm="standard", return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="standard")
    for x in (out, *grads):
        assert np.all(np.isfinite(x.astype(np.float32)))


# ---------------------------------------------------------------------------------------------------
# Catalog and compilation.


def test_catalog_and_shared_memory():
    names = [i.name_expr for i in standard.instances(SM80)]
    assert len(names) == len(set(names)) == 6 * 3 + 3 + 3
    for instance in standard.instances(SM80):
        is_row_kernel = "softmax" in instance.name_expr or "dout_dot_out" in instance.name_expr
        expected = 0 if is_row_kernel else standard.TRAITS.gemm_smem_bytes
        assert standard.dynamic_smem_bytes(instance) == expected
    assert standard.TRAITS.gemm_smem_bytes == 2 * 2 * 32 * 65 * 4
    with pytest.raises(ValueError):
        standard.StandardTraits(outputs_per_thread_n=2)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_instance_compiles_without_spills(arch):
    from cuflash.kernels.nvrtc import compile_instance

    for instance in standard.instances(SM80):
        resources = compile_instance(instance, arch).resources
        assert resources.spill_store_bytes == resources.spill_load_bytes == 0, (instance, resources)
        assert resources.static_smem_bytes == 0, "shared memory is dynamic only"
