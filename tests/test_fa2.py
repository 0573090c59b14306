"""FlashAttention-2 (algorithm="fa2") on the CPU simulator.

* Forward and backward against the float64 reference with FlashAttention's tolerance rule (factor 2 forward, 3
  gradients, +1e-5 absolute for causal gradients), over float32 / float16 / bfloat16, FA2's odd sequence-length
  pairs, every compiled head dim and head dims between them (1 .. 256, run on the next compiled one), MHA / GQA /
  MQA, causal with seqlen_q < and > seqlen_k (rows that see no key: out 0, lse -inf, zero dq), both backward modes.
* Large logits (|q.k| * scale up to 1e4 in float32): finite and within tolerance.
* Zero-length sequences through the launch plans directly (the public API short-circuits them).
* Global traffic of every launch, byte for byte, against the kernels' formulas (fa2.forward_traffic /
  backward_traffic), against FA2's closed form (Q once, K and V once per Q block, O and lse once), and the causal
  block skip (blocks above the diagonal are not read).
* Forward bitwise identical across reruns; deterministic backward bitwise identical across reruns, with what each
  of its dq slices holds (K/V blocks s, s + S, ... of a block looping over them) and how the convert kernel sums
  them (tests/test_deterministic_backward.py has the rest).
* Launch-shape guards (too little shared memory, wrong block size trap), traits validation, and NVRTC builds for
  sm_80 / sm_90 without spills.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import cuflash
from cuflash.testing import numpy_dtype, random_qkv, rows_without_key
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
from cuflash.kernels import plans
from cuflash.kernels.families import fa2
from cuflash.kernels.program import LaunchPlan, Problem, Program
from cuflash.kernels.targets import target
from cuflash.mask import Mask

SM80 = target("sm_80")

DTYPES = ("float32", "float16", "bfloat16")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): lengths from FA2's own sweep (113/203, 128/217,
# 108/256, 1/239, ...), none a tile multiple unless said, and head dims on and between the compiled sizes.
SHAPES = {
    "gqa_113_203_d40": (1, 113, 203, 4, 2, 40),  # GQA 2:1, head dim 40 runs on the 64 kernel
    "mqa_tall_d72": (1, 150, 77, 3, 1, 72),  # MQA, seqlen_q > seqlen_k: causal leaves 73 rows without a key
    "mha_aligned_d64": (2, 128, 128, 2, 2, 64),  # every length a tile multiple
    "one_query_d128": (1, 1, 239, 2, 1, 128),  # decoding-like single row
    "mha_108_256_d96": (1, 108, 256, 2, 2, 96),
    "d160_on_192": (1, 47, 90, 2, 1, 160),  # head dim between compiled sizes
    "wide_head_d256": (1, 37, 70, 2, 2, 256),  # the largest head dim
    "head_dim_1": (1, 17, 9, 2, 2, 1),  # the smallest head dim, seqlen_q > seqlen_k
    "d33_128_217": (1, 128, 217, 1, 1, 33),  # ragged head dim: element-wise tail loads
}


def _cases():
    """Every shape causal and not; dtypes rotate so every dtype meets every kind of shape across the tests; the
    scale is non-default on some cases."""
    cases = []
    for i, (name, shape) in enumerate(SHAPES.items()):
        for causal in (False, True):
            dtype = DTYPES[(i + causal) % 3]
            scale = 0.3 if i % 2 else None
            cases.append(pytest.param(shape, dtype, causal, scale, id=f"{name}-{dtype}-{'causal' if causal else 'full'}"))
    return cases


CASES = _cases()


def _inputs(shape, dtype, seed, magnitude=1.0):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, *shape, dtype="float32")
    dout = rng.standard_normal(q.shape)
    dt = numpy_dtype(dtype)
    return (q * magnitude).astype(dt), (k * magnitude).astype(dt), v.astype(dt), dout.astype(dt)


def _check_forward(q, k, v, out, lse, causal, scale):
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    ref = forward_references(q, k, v, causal=causal, softmax_scale=scale)
    check_close("out", out, ref.out, ref.out_lowp, FORWARD_FACTOR)
    check_close("lse", lse, ref.lse, ref.lse_lowp, FORWARD_FACTOR)
    empty = rows_without_key(q.shape[1], k.shape[1], causal)
    assert np.all(out.astype(np.float32)[:, empty] == 0)
    assert np.all(lse[:, :, empty] == -np.inf)


def _check_backward(dout, q, k, v, grads, causal, scale):
    dq, dk, dv = grads
    assert (dq.dtype, dk.dtype, dv.dtype) == (q.dtype, k.dtype, v.dtype)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    ref = backward_references(dout, q, k, v, causal=causal, softmax_scale=scale)
    atol = 1e-5 if causal else 0.0
    check_close("dq", dq, ref.dq, ref.dq_lowp, BACKWARD_FACTOR, atol)
    check_close("dk", dk, ref.dk, ref.dk_lowp, BACKWARD_FACTOR, atol)
    check_close("dv", dv, ref.dv, ref.dv_lowp, BACKWARD_FACTOR, atol)
    empty = rows_without_key(q.shape[1], k.shape[1], causal)
    assert np.all(dq.astype(np.float32)[:, empty] == 0)


@pytest.mark.parametrize("shape, dtype, causal, scale", CASES)
def test_forward_matches_reference(shape, dtype, causal, scale):
    q, k, v, _ = _inputs(shape, dtype, seed=1)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="fa2", return_lse=True)
    _check_forward(q, k, v, out, lse, causal, scale)


@pytest.mark.parametrize("shape, dtype, causal, scale", CASES)
def test_backward_matches_reference(shape, dtype, causal, scale):
    q, k, v, dout = _inputs(shape, dtype, seed=2)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="fa2", return_lse=True)
    # Both dq modes on every case: atomics into one slice, and the deterministic mode's slice per block along x.
    for deterministic in (False, True):
        grads = cuflash.attention_backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, algorithm="fa2", deterministic=deterministic
        )
        _check_backward(dout, q, k, v, grads, causal, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_stay_finite_and_accurate(dtype, causal):
    """|q.k| * scale reaches about 1e4: the online softmax must neither overflow nor lose the maximum, and the
    backward must not turn exp2(s * scale_log2 - lse * log2 e) into inf or NaN.

    The forward meets the usual rule. The backward recomputes P from the saved float32 lse (FA2 saves nothing
    else), and a float32 number of magnitude L is only known to L * 2^-24: P carries that much relative error
    whatever the kernel does. The float32 yardstick never forms an lse (it keeps P from the forward), so for
    float32 inputs the gradients get that inherent term as an absolute allowance on top of the rule:
    max|lse| * 2^-23 * max|gradient|. For bfloat16 the input rounding dwarfs it and the plain rule applies."""
    shape = (1, 70, 90, 2, 1, 64)
    q, k, v, dout = _inputs(shape, dtype, seed=3, magnitude=50.0)
    scale = 1.0 / math.sqrt(shape[-1])
    logits = np.einsum("bihd,bjd->bhij", q.astype(np.float64), k.astype(np.float64)[:, :, 0]) * scale
    assert 5e3 < np.abs(logits).max() < 2e4
    out, lse = cuflash.attention(q, k, v, causal=causal, algorithm="fa2", return_lse=True)
    _check_forward(q, k, v, out, lse, causal, None)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm="fa2", deterministic=True)
    for grad in grads:
        assert np.all(np.isfinite(grad.astype(np.float32)))
    if dtype != "float32":
        _check_backward(dout, q, k, v, grads, causal, None)
        return
    ref = backward_references(dout, q, k, v, causal=causal)
    lse_resolution = float(np.abs(lse[np.isfinite(lse)]).max()) * 2.0**-23
    assert lse_resolution > 1e-4  # the regime this test is about
    for name, grad, ref64, lowp in zip(("dq", "dk", "dv"), grads, ref[:3], ref[3:]):
        allowance = lse_resolution * float(np.abs(ref64).max()) + (1e-5 if causal else 0.0)
        check_close(name, grad, ref64, lowp, BACKWARD_FACTOR, allowance)


def test_packed_qkv_views_with_odd_strides():
    """q, k, v as views into one packed (batch, seqlen, 3, heads, headdim) array: row strides are 3 * heads *
    headdim elements, and with headdim 37 no row start is 8/16-byte aligned past the first, so every access takes
    the element-wise path of the chunk loads/stores."""
    rng = np.random.default_rng(4)
    packed = rng.standard_normal((2, 61, 3, 2, 37)).astype(np.float16)
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    out, lse = cuflash.attention(q, k, v, causal=True, algorithm="fa2", return_lse=True)
    _check_forward(q, k, v, out, lse, True, None)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="fa2")
    _check_backward(dout, q, k, v, grads, True, None)


# ---------------------------------------------------------------------------------------------------
# Running programs directly: zero lengths, scratch, traffic.


def _problem(q, k, causal, deterministic=False):
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
        deterministic=deterministic,
    )


def _variant(problem):
    """The fa2 variant the plans pick for this problem (tensor cores for 16-bit inputs, SIMT for float32)."""
    return plans.variant_for("fa2", problem, SM80).module


def _run_forward(q, k, v, causal, scale, program=None):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
    program = program or _variant(problem).forward_program(problem, SM80)
    run_program(backend, program, problem, scale, {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    return out, lse


def _run_backward(dout, q, k, v, out, lse, causal, scale, deterministic=False, program=None):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal, deterministic)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads}
    program = program or _variant(problem).backward_program(problem, SM80)
    scratch = run_program(backend, program, problem, scale, arrays)
    return grads["dq"], grads["dk"], grads["dv"], scratch


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 19), (23, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_sequences(seqlen_q, seqlen_k, causal):
    """out = 0 and lse = -inf when there is no key (the forward still runs its Q blocks, reading nothing); zero
    dk/dv when there is no query (the backward still runs its K/V blocks); empty grids launch nothing."""
    q, k, v, dout = _inputs((2, seqlen_q, seqlen_k, 2, 1, 33), "float16", seed=5)
    with sim.record() as records:
        out, lse = _run_forward(q, k, v, causal, 0.2)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert sum(r.global_bytes_read for r in records.launches) == 0
    for deterministic in (False, True):
        dq, dk, dv, _ = _run_backward(dout, q, k, v, out, lse, causal, 0.2, deterministic)
        for grad in (dq, dk, dv):
            assert np.all(grad == 0)


def test_dout_dot_out_and_deterministic_slices():
    """D = rowsum(dO * O) lands in dout_dot_out; in deterministic mode on a 2-SM device dq_accum has 2 zero-filled
    slices for 3 K/V blocks, block s of the main kernel loops over K/V blocks s, s + 2, and slice s holds exactly
    their unscaled dQ; the convert kernel sums the slices in order, for the rows that see a key."""
    causal, scale = True, 0.25
    shape = (1, 70, 150, 2, 1, 24)
    q, k, v, dout = _inputs(shape, "float32", seed=6)
    out, lse = _run_forward(q, k, v, causal, scale)
    problem = _problem(q, k, causal, deterministic=True)
    block_n = fa2.backward_traits(24, SM80).block_n
    two_sms = dataclasses.replace(SM80, sm_count=2)
    program = fa2.backward_program(problem, two_sms)
    assert math.ceil(150 / block_n) == 3 and program.num_dq_splits == 2
    assert program.launches[1].grid == (2, 1, 1)
    assert [s.zero_init for s in program.scratch if s.name == "dq_accum"] == [True]
    dq, _, _, scratch = _run_backward(dout, q, k, v, out, lse, causal, scale, deterministic=True, program=program)

    d = np.einsum("bihd,bihd->bhi", dout.astype(np.float64), out.astype(np.float64))
    np.testing.assert_allclose(scratch["dout_dot_out"], d, rtol=1e-5, atol=1e-5)

    # float64 dS from the kernel's own lse and D, then each K/V block's share of dS K.
    group = shape[3] // shape[4]
    k64 = np.repeat(k.astype(np.float64), group, axis=2)
    v64 = np.repeat(v.astype(np.float64), group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k64) * scale
    rows, keys = np.arange(shape[1])[:, None], np.arange(shape[2])[None, :]
    visible = keys <= rows + shape[2] - shape[1]
    p = np.where(visible, np.exp(s - lse[..., None].astype(np.float64)), 0.0)
    dp = np.einsum("bihd,bjhd->bhij", dout.astype(np.float64), v64)
    ds = p * (dp - scratch["dout_dot_out"][..., None])
    accum = scratch["dq_accum"].reshape(program.num_dq_splits, *dq.shape)  # (splits, rows, heads, d) by batch
    for split in range(program.num_dq_splits):
        keys = np.arange(shape[2]) // block_n % program.num_dq_splits == split  # K/V blocks split, split + 2, ...
        part = np.einsum("bhij,bjhd->bihd", ds[..., keys], k64[:, keys])
        np.testing.assert_allclose(accum[split], part, rtol=1e-4, atol=1e-5)
    # The convert kernel: the slices summed in slice order in float32, then scaled, for the rows that see a key;
    # bit for bit.
    expected = np.zeros(dq.shape, np.float32)
    sees_key = visible.any(axis=1)
    for split in range(program.num_dq_splits):
        expected[:, sees_key] += accum[split][:, sees_key]
    assert np.array_equal(dq, expected * np.float32(scale))


def _launch_traffic(records):
    return [(r.global_bytes_read, r.global_bytes_written) for r in records.launches]


def _expected(program, traffic):
    """Per-launch traffic of the launches the runner actually issues (it skips empty grids)."""
    assert len(program.launches) == len(traffic)
    return [tuple(t) for plan, t in zip(program.launches, traffic) if not plan.is_empty]


TRAFFIC_CASES = [
    pytest.param((2, 100, 130, 4, 2, 48), "float16", False, id="gqa-half-full"),
    pytest.param((1, 150, 77, 3, 1, 40), "bfloat16", True, id="mqa-bf16-causal-tall"),
    pytest.param((1, 77, 150, 2, 2, 72), "float32", True, id="mha-f32-causal-wide"),
    pytest.param((1, 130, 300, 2, 1, 128), "float16", True, id="gqa-half-causal-d128"),
]


@pytest.mark.parametrize("shape, dtype, causal", TRAFFIC_CASES)
def test_global_traffic_is_exactly_the_formula(shape, dtype, causal):
    q, k, v, dout = _inputs(shape, dtype, seed=7)
    problem = _problem(q, k, causal)
    with sim.record() as forward_records:
        out, lse = _run_forward(q, k, v, causal, 0.125)
    variant = _variant(problem)
    assert _launch_traffic(forward_records) == _expected(
        variant.forward_program(problem, SM80), [variant.forward_traffic(problem, SM80)]
    )
    for deterministic in (False, True):
        det_problem = _problem(q, k, causal, deterministic)
        with sim.record() as backward_records:
            _run_backward(dout, q, k, v, out, lse, causal, 0.125, deterministic)
        assert _launch_traffic(backward_records) == _expected(
            variant.backward_program(det_problem, SM80), variant.backward_traffic(det_problem, SM80)
        )


@pytest.mark.parametrize("dtype, headdim", [("float16", 64), ("float32", 100), ("bfloat16", 256)])
def test_forward_traffic_is_fa2s_closed_form(dtype, headdim):
    """Non-causal: Q read once, K and V once per Q block, O and lse written once; nothing else."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k = 2, 150, 97, 4, 2
    q, k, v, _ = _inputs((batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), dtype, seed=8)
    with sim.record() as records:
        _run_forward(q, k, v, False, 0.1)
    es, block_m = ELEMENT_BYTES[dtype], _variant(_problem(q, k, False)).forward_traits(headdim, SM80).block_m
    q_blocks = math.ceil(seqlen_q / block_m)
    reads = batch * nheads * (seqlen_q * headdim * es + 2 * q_blocks * seqlen_k * headdim * es)
    writes = batch * nheads * seqlen_q * (headdim * es + 4)
    assert _launch_traffic(records) == [(reads, writes)]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_causal_forward_skips_blocks_above_the_diagonal(dtype):
    """Causal, seqlen_q = seqlen_k = 256: Q block i (rows i M .. i M + M - 1) reads the K/V blocks up to the one
    holding its last row's diagonal, whole blocks (the block crossing the diagonal is masked, not loaded in part):
    with the SIMT tiles (64 x 64) 1 + 2 + 3 + 4 = 10 of 16 blocks, with the tensor-core ones (128 x 64) 2 + 4 = 6
    of 8 (the Q block pairs cover the same keys)."""
    batch, seqlen, nheads, headdim = 1, 256, 2, 64
    q, k, v, _ = _inputs((batch, seqlen, seqlen, nheads, nheads, headdim), dtype, seed=9)
    traits = _variant(_problem(q, k, True)).forward_traits(headdim, SM80)
    assert seqlen % traits.block_m == 0 and traits.block_m % traits.block_n == 0
    with sim.record() as causal_records:
        _run_forward(q, k, v, True, 0.1)
    with sim.record() as full_records:
        _run_forward(q, k, v, False, 0.1)
    es = ELEMENT_BYTES[dtype]
    tile = traits.block_n * headdim * es  # bytes of one K (or V) block
    q_blocks, kv_blocks = seqlen // traits.block_m, seqlen // traits.block_n
    visited = sum((i + 1) * traits.block_m // traits.block_n for i in range(q_blocks))
    assert visited == {64: 10, 128: 6}[traits.block_m]
    q_bytes = batch * nheads * seqlen * headdim * es
    assert full_records.launches[0].global_bytes_read == q_bytes + batch * nheads * q_blocks * kv_blocks * 2 * tile
    assert causal_records.launches[0].global_bytes_read == q_bytes + batch * nheads * visited * 2 * tile
    assert causal_records.launches[0].global_bytes_written == full_records.launches[0].global_bytes_written


# ---------------------------------------------------------------------------------------------------
# Reproducibility.


def test_forward_is_bitwise_reproducible():
    q, k, v, _ = _inputs((4, 130, 150, 4, 2, 64), "bfloat16", seed=10)
    first = cuflash.attention(q, k, v, causal=True, algorithm="fa2", return_lse=True)
    for _ in range(2):
        again = cuflash.attention(q, k, v, causal=True, algorithm="fa2", return_lse=True)
        assert np.array_equal(first[0].view(np.uint16), again[0].view(np.uint16))
        assert np.array_equal(first[1].view(np.uint32), again[1].view(np.uint32))


def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v, dout = _inputs((3, 97, 300, 4, 1, 40), "float16", seed=11)
    out, lse = cuflash.attention(q, k, v, causal=False, algorithm="fa2", return_lse=True)
    runs = [
        cuflash.attention_backward(dout, q, k, v, out, lse, algorithm="fa2", deterministic=True) for _ in range(3)
    ]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("deterministic", [False, True])
def test_no_data_races(deterministic):
    """The simulator's race detector (shared memory and global buffers, CUDA's ordering rules) over a causal GQA
    forward and backward with partial and several Q and K/V blocks: K/V tiles reloaded per iteration, each warp's P
    slab written and read between __syncwarp()s, the backward's P/dS tiles, dq_accum by atomics (several K/V
    blocks, same elements) or by plain stores into per-block slices (one writer each)."""
    q, k, v, dout = _inputs((1, 70, 100, 4, 2, 40), "float16", seed=14)
    with sim.checking("race"):
        out, lse = cuflash.attention(q, k, v, causal=True, algorithm="fa2", return_lse=True)
        grads = cuflash.attention_backward(
            dout, q, k, v, out, lse, causal=True, algorithm="fa2", deterministic=deterministic
        )
    _check_forward(q, k, v, out, lse, True, None)
    _check_backward(dout, q, k, v, grads, True, None)


def _forward_backward_for_asan(shape, dtype, causal, deterministic):
    q, k, v, dout = _inputs(shape, dtype, seed=15)
    out, lse = cuflash.attention(q, k, v, causal=causal, algorithm="fa2", return_lse=True)
    grads = cuflash.attention_backward(
        dout, q, k, v, out, lse, causal=causal, algorithm="fa2", deterministic=deterministic
    )
    return out, lse, grads


def test_no_out_of_bounds_access_under_asan():
    """AddressSanitizer build in a child process: shared memory is allocated with exactly the planned bytes, so
    an access past the traits' layout (or past a partial tile's global rows / a ragged head dim) is reported."""
    shape = (1, 45, 83, 2, 1, 37)
    out, lse, grads = sim.run_in_asan_subprocess(_forward_backward_for_asan, shape, "bfloat16", True, True)
    q, k, v, dout = _inputs(shape, "bfloat16", seed=15)
    _check_forward(q, k, v, out, lse, True, None)
    _check_backward(dout, q, k, v, grads, True, None)


# ---------------------------------------------------------------------------------------------------
# Launch guards, traits and compilation.


def test_kernels_trap_on_a_launch_shape_their_traits_do_not_fit():
    q, k, v, dout = _inputs((1, 40, 50, 1, 1, 64), "float32", seed=12)
    problem = _problem(q, k, False)
    (plan,) = fa2.forward_program(problem, SM80).launches
    short = LaunchPlan(plan.kernel, plan.grid, plan.block, plan.dynamic_smem_bytes - 4)
    with pytest.raises(sim.KernelError, match="fa2_forward_kernel"):
        _run_forward(q, k, v, False, 0.1, program=Program(launches=(short,)))
    wrong_block = LaunchPlan(plan.kernel, plan.grid, (plan.block[0] // 2, 1, 1), plan.dynamic_smem_bytes)
    with pytest.raises(sim.KernelError, match="fa2_forward_kernel"):
        _run_forward(q, k, v, False, 0.1, program=Program(launches=(wrong_block,)))
    # The exact plan runs: the Python shared-memory formula is exactly the kernel's need.
    _run_forward(q, k, v, False, 0.1)


def test_backward_traps_with_too_little_shared_memory():
    q, k, v, dout = _inputs((1, 40, 50, 1, 1, 128), "float32", seed=13)
    problem = _problem(q, k, False)
    program = fa2.backward_program(problem, SM80)
    pre, main, convert = program.launches
    short = LaunchPlan(main.kernel, main.grid, main.block, main.dynamic_smem_bytes - 4)
    out, lse = _run_forward(q, k, v, False, 0.1)
    backend = SimulatorBackend()
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads}
    with pytest.raises(sim.KernelError, match="fa2_backward_kernel"):
        run_program(backend, Program((pre, short, convert), program.scratch, program.num_dq_splits), problem, 0.1, arrays)


def test_traits_table_and_catalog():
    assert fa2.HEAD_DIMS == (32, 64, 96, 128, 192, 256)
    assert [fa2.compiled_head_dim(h) for h in (1, 32, 33, 64, 65, 96, 97, 128, 129, 192, 193, 256)] == [
        32, 32, 64, 64, 96, 96, 128, 128, 192, 192, 256, 256
    ]
    for bad in (0, 257):
        with pytest.raises(ValueError):
            fa2.compiled_head_dim(bad)
    # FA2's head-dim-64 forward keeps 4 warps; head dim 256 needs 8 warps to keep a thread's O slice small.
    assert fa2.forward_traits(64, SM80).warps == fa2.forward_traits(128, SM80).warps == 4
    for arch in ("sm_80", "sm_86", "sm_90", "sm_120"):
        # The SIMT variant serves float32 (16-bit inputs run on tensor cores, test_fa2_tc.py).
        assert fa2.DTYPES == ("float32",)
        names = [i.name_expr for i in fa2.instances(target(arch))]
        assert len(names) == len(set(names)) == 6 + 1 + 6 + 1 + 2  # forward, split-KV combine, backward program
        for instance in fa2.instances(target(arch)):
            smem = fa2.dynamic_smem_bytes(instance)
            assert smem <= target(arch).smem_per_block_bytes
            row_kernels = ("dout_dot_out", "convert_dq", "split_kv_combine")
            assert (smem == 0) == any(kernel in instance.name_expr for kernel in row_kernels)
    # The 99 KB targets take the second rows where the first do not fit; the others keep the first rows.
    small = target("sm_86")
    for head_dim in fa2.HEAD_DIMS:
        for choices, pick in ((fa2.FORWARD_CHOICES, fa2.forward_traits), (fa2.BACKWARD_CHOICES, fa2.backward_traits)):
            assert pick(head_dim, SM80) == choices[head_dim][0]
            fits = [t for t in choices[head_dim] if t.smem_bytes <= small.smem_per_block_bytes]
            assert pick(head_dim, small) == fits[0]
    with pytest.raises(ValueError):
        fa2.ForwardTraits(64, block_m=64, block_n=48, warps=4)  # block_n not a multiple of 32
    with pytest.raises(ValueError):
        fa2.ForwardTraits(256, block_m=128, block_n=64, warps=4)  # beyond any target's shared memory
    with pytest.raises(ValueError):
        fa2.BackwardTraits(96, block_m=32, block_n=64, warps=8)  # dK/dV tiles do not divide over 256 threads
    with pytest.raises(KeyError):
        fa2.dynamic_smem_bytes(fa2.ForwardTraits(64, 32, 32, 4).instance("float16"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_every_instance_compiles_without_spills(arch):
    from cuflash.kernels.nvrtc import compile_instance

    for instance in fa2.instances(target(arch)):
        resources = compile_instance(instance, arch).resources
        assert resources.spill_store_bytes == resources.spill_load_bytes == 0, (instance, arch, resources)
        assert resources.static_smem_bytes == 0, "shared memory is dynamic only"
