"""FlashAttention-1 (algorithm="fa1") on the CPU simulator.

* Forward and backward against the float64 reference with FlashAttention's tolerance rule (factor 2 forward,
  3 gradients), over float32 / float16 / bfloat16, every compiled head dim plus head dims between them
  (1 .. 256), odd sequence-length pairs, MHA / GQA / MQA, causal with seqlen_q < and > seqlen_k, a
  non-default softmax scale and inputs with non-standard strides.
* Numerics: logits with |scale q.k| up to 1e4, rows that see no key (out 0, lse -inf, zero gradients),
  zero-length sequences through the launch plans directly (the public API short-circuits them).
* Global memory traffic of every launch, byte for byte, against the kernels' formulas (fa1.forward_traffic /
  backward_traffic), plus one case spelled out from Algorithm 1's terms by hand.
* Bitwise-reproducible forward and backward; the tile table follows the paper's rule; the kernels trap on
  too little shared memory; NVRTC builds for sm_80 / sm_90 without spills.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash._tolerance import BACKWARD_FACTOR, FORWARD_FACTOR, backward_references, check_close, forward_references
from cuflash.backends.program import run_program
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels.families import fa1
from cuflash.kernels.program import Problem
from cuflash.kernels.targets import target

SM80 = target("sm_80")
TILES = fa1.tiles(SM80)
from cuflash.reference import attention_reference
from cuflash.testing import numpy_dtype, random_inputs, random_qkv, rows_without_key
from cuflash.mask import Mask

DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture(scope="module", autouse=True)
def _built_kernels():
    # One simulator library for every fa1 instance (parallel TUs) instead of one build per first use.
    sim.precompile(fa1.instances(SM80))


# (seqlen_q, seqlen_k): pairs that are not tile multiples and span several K/V blocks even for the widest
# tiles (forward Bc = 320 at head dim 32), one row, seqlen_q > seqlen_k (causal leaves rows without a key),
# a single tile, and exact tile multiples for head dim 64 (forward 64 x 160, backward 64 x 80).
SEQLENS = [(113, 703), (128, 517), (1, 739), (603, 213), (37, 37), (128, 320), (108, 256)]
# (batch, nheads, nheads_k)
HEADS = [(1, 2, 2), (2, 4, 2), (1, 3, 1)]
# Every compiled head dim and head dims that run on the next compiled one (predicated tail).
HEAD_DIMS = [1, 32, 40, 64, 96, 128, 150, 192, 224, 256]


def _cases():
    """Every head dim x dtype x causal once (each dtype meets each head dim in one causal setting, and every
    head dim is run both causal and not); sequence lengths and head layouts rotate so every value of those
    axes meets every dtype and both causal settings."""
    cases = []
    for i, headdim in enumerate(HEAD_DIMS):
        for j, dtype in enumerate(DTYPES):
            causal = (i + j) % 2 == 1
            seqlens = SEQLENS[(i + 2 * j) % len(SEQLENS)]
            batch, nheads, nheads_k = HEADS[(i + j) % len(HEADS)]
            scale = 0.3 if (i + j) % 4 == 0 else None
            shape = (batch, *seqlens, nheads, nheads_k, headdim)
            case_id = f"d{headdim}-{dtype}-{'causal' if causal else 'full'}-{seqlens[0]}x{seqlens[1]}-h{nheads}k{nheads_k}"
            cases.append(pytest.param(shape, dtype, causal, scale, id=case_id))
    return cases


CASES = _cases()


def _check_forward(q, k, v, out, lse, causal, scale):
    ref = forward_references(q, k, v, causal=causal, softmax_scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_close("out", out, ref.out, ref.out_lowp, FORWARD_FACTOR)
    check_close("lse", lse, ref.lse, ref.lse_lowp, FORWARD_FACTOR)


def _check_backward(dout, q, k, v, grads, causal, scale):
    ref = backward_references(dout, q, k, v, causal=causal, softmax_scale=scale)
    atol = 1e-5 if causal else 0.0
    for name, actual, expected, lowp, like in zip(
        ("dq", "dk", "dv"), grads, ref[:3], ref[3:], (q, k, v)
    ):
        assert actual.dtype == like.dtype and actual.shape == like.shape, name
        check_close(name, actual, expected, lowp, BACKWARD_FACTOR, atol=atol)


@pytest.mark.parametrize("shape, dtype, causal, scale", CASES)
def test_forward_matches_reference(shape, dtype, causal, scale):
    q, k, v, _ = random_inputs(shape, dtype, seed=1)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="fa1", return_lse=True)
    _check_forward(q, k, v, out, lse, causal, scale)
    no_key = rows_without_key(shape[1], shape[2], causal)
    assert np.all(out[:, no_key].astype(np.float32) == 0)
    assert np.all(lse[:, :, no_key] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, ~no_key]))


@pytest.mark.parametrize("shape, dtype, causal, scale", CASES)
def test_backward_matches_reference(shape, dtype, causal, scale):
    q, k, v, dout = random_inputs(shape, dtype, seed=2)
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale, algorithm="fa1", return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, algorithm="fa1")
    _check_backward(dout, q, k, v, grads, causal, scale)
    no_key = rows_without_key(shape[1], shape[2], causal)
    assert np.all(grads[0][:, no_key].astype(np.float32) == 0)


def test_stridedrandom_inputs():
    """q, k, v, dout as (batch, heads, seqlen, headdim) arrays transposed to the API layout: row and head strides
    are not the dense ones, and the kernels must follow them."""
    rng = np.random.default_rng(3)
    b, sq, sk, h, hk, d = 2, 50, 70, 4, 2, 48
    q = rng.standard_normal((b, h, sq, d)).astype(np.float16).transpose(0, 2, 1, 3)
    k = rng.standard_normal((b, hk, sk, d)).astype(np.float16).transpose(0, 2, 1, 3)
    v = rng.standard_normal((b, hk, sk, d)).astype(np.float16).transpose(0, 2, 1, 3)
    dout = rng.standard_normal((b, h, sq, d)).astype(np.float16).transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous
    out, lse = cuflash.attention(q, k, v, causal=True, algorithm="fa1", return_lse=True)
    _check_forward(q, k, v, out, lse, True, None)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="fa1")
    _check_backward(dout, q, k, v, grads, True, None)


def _saved_lse_allowance(dout, q, k, v, causal, scale):
    """First-order bound on what storing lse in float32 does to the gradients (MHA only).

    The forward stores lse_r = fl(m_r + log l_r) (m_r the row max, l_r = sum_j exp(s_rj - m_r) >= 1). The
    backward's P_r = exp(s_r - lse_r) then sums to exp(eps_r) with |eps_r| <= min(ulp(lse_r) / 2, log l_r)
    (+ a few float32 ulps of log l_r): a row dominated by one key (log l_r below half an ulp of m_r) keeps
    lse_r = m_r and loses nothing. Scaling row r of P and of dS = P o (dP - D) by 1 + eps_r moves
    dV by P^T (eps |dO|), dQ by scale (eps |dS|) |K|, dK by scale (eps |dS|)^T |Q|; evaluated in float64
    with the exact P, dS. Returns the max of each, for (dq, dk, dv)."""
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    dout, q, k, v, ref_out = (x.astype(np.float64) for x in (dout, q, k, v, ref_out))
    sq, sk = q.shape[1], k.shape[1]
    visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq if causal else np.ones((sq, sk), bool)
    allowance = np.zeros(3)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            qh, kh, vh, doh, oh = q[b, :, h], k[b, :, h], v[b, :, h], dout[b, :, h], ref_out[b, :, h]
            exact = ref_lse[b, h][:, None]
            scores = np.where(visible, scale * qh @ kh.T, -np.inf)
            seen = np.isfinite(exact)[:, 0]
            log_l = np.where(seen, exact[:, 0] - np.max(scores, axis=1, initial=-np.inf), 0.0)
            half_ulp = np.spacing(np.abs(np.where(seen, exact[:, 0], 0.0)).astype(np.float32)).astype(np.float64) / 2
            eps = (np.minimum(half_ulp, log_l) + 4 * np.finfo(np.float32).eps * (1 + log_l))[:, None]
            probs = np.where(visible & seen[:, None], np.exp(scores - np.where(seen[:, None], exact, 0.0)), 0.0)
            dscores = np.abs(probs * (doh @ vh.T - np.sum(doh * oh, axis=1, keepdims=True)))
            allowance = np.maximum(allowance, [
                scale * np.max((eps * dscores) @ np.abs(kh)),
                scale * np.max((eps * dscores).T @ np.abs(qh)),
                np.max(probs.T @ (eps * np.abs(doh))),
            ])
    return allowance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_stay_finite(dtype, causal):
    """|scale q.k| up to about 1e4: exp of unshifted scores would overflow float32 by thousands of orders of
    magnitude; the running max keeps every exponent <= 0.

    The backward recomputes P = exp(S - lse) from the saved float32 lse, whose spacing at |lse| ~ 1e4 is ~1e-3:
    that alone moves P by up to ~5e-4 relatively in rows where several keys matter, an error the
    low-precision yardstick (which normalises by the row sum) never sees. So the gradient bound adds a
    first-order bound of what the saved lse's error does (_saved_lse_allowance); the forward is held to the
    plain rule."""
    rng = np.random.default_rng(4)
    b, sq, sk, h, d = 1, 70, 100, 2, 64
    dt = numpy_dtype(dtype)
    q = (rng.standard_normal((b, sq, h, d)) * 40).astype(dt)
    k = (rng.standard_normal((b, sk, h, d)) * 40).astype(dt)
    v = rng.standard_normal((b, sk, h, d)).astype(dt)
    dout = rng.standard_normal((b, sq, h, d)).astype(dt)
    scale = 1.0 / math.sqrt(d)
    logits = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
    assert 5e3 < np.abs(logits).max() < 2e4
    out, lse = cuflash.attention(q, k, v, causal=causal, algorithm="fa1", return_lse=True)
    assert np.all(np.isfinite(out.astype(np.float32))) and np.all(np.isfinite(lse))
    _check_forward(q, k, v, out, lse, causal, None)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm="fa1")
    assert all(np.all(np.isfinite(g.astype(np.float32))) for g in grads)
    ref = backward_references(dout, q, k, v, causal=causal)
    allowance = _saved_lse_allowance(dout, q, k, v, causal, scale)
    for name, actual, expected, lowp, lse_term in zip(("dq", "dk", "dv"), grads, ref[:3], ref[3:], allowance):
        assert lse_term < 1e-3 * float(np.max(np.abs(expected)))  # the allowance stays small
        check_close(name, actual, expected, lowp, BACKWARD_FACTOR, atol=lse_term + (1e-5 if causal else 0.0))


def _run(program_kind, problem, arrays, scale=0.5):
    family_program = fa1.forward_program if program_kind == "forward" else fa1.backward_program
    return run_program(SimulatorBackend(), family_program(problem, SM80), problem, scale, arrays)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 19), (23, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_length_sequences(seqlen_q, seqlen_k, causal):
    """Through the launch plans directly (the API never launches for these): seqlen_k = 0 writes out = 0,
    lse = -inf and dq = 0; seqlen_q = 0 writes dk = dv = 0 (GQA, so through the reduction too)."""
    backend = SimulatorBackend()
    b, h, hk, d = 2, 4, 2, 24
    problem = Problem("float16", b, seqlen_q, seqlen_k, h, hk, d, Mask.causal(causal))
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, b, seqlen_q, seqlen_k, h, hk, d, dtype="float16")
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((b, h, seqlen_q), np.float32)
    _run("forward", problem, {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    _run("backward", problem, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads})
    for name, grad in grads.items():
        assert np.all(grad == 0), name


def test_rows_without_key_inside_a_visited_block():
    """seqlen_q > seqlen_k, causal: the first Q block (Br = 64 at head dim 64) holds rows that see no key and
    rows that do, so the no-key rows go through the online softmax with l = 0 at every visit."""
    assert TILES[64][0].block_rows >= 60 and TILES[64][1].block_rows >= 60
    q, k, v, dout = random_inputs((1, 60, 30, 2, 2, 64), "float32", seed=6)
    out, lse = cuflash.attention(q, k, v, causal=True, algorithm="fa1", return_lse=True)
    assert np.all(out[:, :30] == 0) and np.all(lse[:, :, :30] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 30:]))
    _check_forward(q, k, v, out, lse, True, None)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="fa1")
    assert np.all(grads[0][:, :30] == 0)
    _check_backward(dout, q, k, v, grads, True, None)


TRAFFIC_CASES = [
    pytest.param((1, 113, 703, 2, 1, 40), "float16", False, id="gqa-odd-f16"),
    pytest.param((2, 603, 213, 3, 1, 64), "bfloat16", True, id="mqa-tall-causal-bf16"),
    pytest.param((1, 200, 517, 2, 2, 128), "float32", True, id="mha-causal-f32"),
    pytest.param((1, 1, 239, 2, 2, 256), "float16", False, id="one-query-d256"),
    pytest.param((1, 37, 0, 2, 1, 32), "float32", True, id="no-keys"),
    pytest.param((1, 0, 37, 2, 1, 32), "float32", False, id="no-queries"),
]


@pytest.mark.parametrize("shape, dtype, causal", TRAFFIC_CASES)
def test_global_traffic_is_exactly_the_formula(shape, dtype, causal):
    problem = Problem(dtype, *shape, mask=Mask.causal(causal))
    backend = SimulatorBackend()
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, *shape, dtype=dtype)
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((shape[0], shape[3], shape[1]), np.float32)
    with sim.record() as fwd:
        _run("forward", problem, {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    measured = [(r.global_bytes_read, r.global_bytes_written) for r in fwd.launches]
    assert measured == ([fa1.forward_traffic(problem, SM80)] if problem.seqlen_q else [])
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    with sim.record() as bwd:
        _run("backward", problem, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads})
    assert [(r.global_bytes_read, r.global_bytes_written) for r in bwd.launches] == fa1.backward_traffic(problem, SM80)


def test_traffic_follows_algorithm_1_by_hand():
    """One case from the paper's terms, independent of fa1.forward_traffic: N = 320, d = 64, float16, one head.
    Forward Br = 64, Bc = 160: Tc = 2 K/V blocks, and every Q block visits both.
      read:    K, V once (2 N d 2 bytes) + per K/V block, Q (N d 2) and O, l, m (N (d + 2) 4)
      written: O, l, m after the first K/V block; out (N d 2) and lse (N 4) after the last."""
    n, d = 320, 64
    assert (TILES[d][0].block_rows, TILES[d][0].block_cols) == (64, 160)
    tc = 2
    expected_read = 2 * n * d * 2 + tc * (n * d * 2 + n * (d + 2) * 4)
    expected_written = (tc - 1) * n * (d + 2) * 4 + n * d * 2 + n * 4
    q, k, v, dout = random_inputs((1, n, n, 1, 1, d), "float16", seed=8)
    with sim.record() as rec:
        out, lse = cuflash.attention(q, k, v, algorithm="fa1", return_lse=True)
    assert [(r.global_bytes_read, r.global_bytes_written) for r in rec.launches] == [(expected_read, expected_written)]
    # Backward, Br = 64, Bc = 80: Tc = 4. K, V once; per K/V block Q, O, dO (3 N d 2), lse (N 4), dQ (N d 4) read
    # and dQ written (float32 but the last time, as dq); dK, dV written once.
    assert (TILES[d][1].block_rows, TILES[d][1].block_cols) == (64, 80)
    tc = 4
    expected_read = 2 * n * d * 2 + tc * (3 * n * d * 2 + n * 4 + n * d * 4)
    expected_written = (tc - 1) * n * d * 4 + n * d * 2 + 2 * n * d * 2
    with sim.record() as rec:
        cuflash.attention_backward(dout, q, k, v, out, lse, algorithm="fa1")
    assert [(r.global_bytes_read, r.global_bytes_written) for r in rec.launches] == [(expected_read, expected_written)]


def test_output_statistics_traffic_grows_with_kv_blocks():
    """FA1's signature, measured: O, l, m are read and written once per K/V block, so at fixed seqlen_q the
    forward's traffic beyond reading Q (once per K/V block), K and V grows by a read and a write of O, l, m
    (2 N (d + 2) 4 bytes) with every K/V block added. (FA2 keeps them on chip and stays flat.)"""
    n, d = 64, 64
    block_cols = TILES[d][0].block_cols
    extra = []
    for tc in (1, 2, 3):
        q, k, v, _ = random_inputs((1, n, tc * block_cols, 1, 1, d), "float16", seed=11)
        with sim.record() as rec:
            cuflash.attention(q, k, v, algorithm="fa1")
        (launch,) = rec.launches
        q_k_v = tc * n * d * 2 + 2 * tc * block_cols * d * 2
        extra.append(launch.global_bytes_read + launch.global_bytes_written - q_k_v)
    assert extra[1] - extra[0] == extra[2] - extra[1] == 2 * n * (d + 2) * 4


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def test_forward_and_backward_are_bitwise_reproducible():
    q, k, v, dout = random_inputs((2, 130, 350, 4, 2, 64), "bfloat16", seed=9)
    first = cuflash.attention(q, k, v, causal=True, algorithm="fa1", return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, *first, causal=True, algorithm="fa1")
    for _ in range(2):
        again = cuflash.attention(q, k, v, causal=True, algorithm="fa1", return_lse=True)
        assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(first, again))
        grads_again = cuflash.attention_backward(dout, q, k, v, *first, causal=True, algorithm="fa1")
        assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(grads, grads_again))


def test_no_data_races():
    """The simulator's race detector (shared and global memory, CUDA's ordering rules) over a causal GQA forward
    and backward whose Q and K/V blocks are all partial and several: the K/V tiles reused across the inner loop,
    O_i parked in the Q_i tile for D_i, dK~/dV~ accumulators with one owner per element, the GQA reduction."""
    q, k, v, dout = random_inputs((1, 150, 190, 4, 2, 48), "float16", seed=12)
    with sim.checking("race"):
        out, lse = cuflash.attention(q, k, v, causal=True, algorithm="fa1", return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, algorithm="fa1")
    _check_forward(q, k, v, out, lse, True, None)
    _check_backward(dout, q, k, v, grads, True, None)


@pytest.mark.parametrize("arch, budget", [("sm_80", (40960, 20480)), ("sm_90", (40960, 20480)),
                                           ("sm_86", (24576, 12288)), ("sm_120", (24576, 12288))])
def test_tiles_follow_the_paper_rule_at_the_largest_budget_the_target_fits(arch, budget):
    tiles = fa1.tiles(target(arch))
    assert tuple(tiles) == fa1.HEAD_DIMS
    for head_dim, (forward, backward) in tiles.items():
        assert (forward.block_rows, forward.block_cols) == fa1.paper_block_sizes(head_dim, budget[0])
        assert (backward.block_rows, backward.block_cols) == fa1.paper_block_sizes(head_dim, budget[1])
        limit = target(arch).smem_per_block_bytes
        assert forward.smem_bytes <= limit and backward.smem_bytes <= limit


def test_tile_shapes_are_checked():
    with pytest.raises(ValueError):
        fa1.Fa1Tile(64, 64, 600, backward=False)  # past what any target allows
    with pytest.raises(ValueError):
        fa1.Fa1Tile(64, 129, 8, backward=False)  # more rows than threads
    assert [fa1.compiled_head_dim(x) for x in (1, 32, 33, 150, 256)] == [32, 32, 64, 160, 256]
    with pytest.raises(ValueError):
        fa1.compiled_head_dim(257)


def test_catalog_and_shared_memory():
    instances = fa1.instances(SM80)
    assert len(instances) == len(set(instances)) == 3 * (2 * len(fa1.HEAD_DIMS) + 1)
    problem = Problem("float16", 1, 10, 10, 2, 2, 100)
    plan = fa1.forward_program(problem, SM80).launches[0]
    assert plan.kernel == fa1.forward_kernel("float16", TILES[128][0])
    assert plan.dynamic_smem_bytes == fa1.dynamic_smem_bytes(plan.kernel) == TILES[128][0].smem_bytes


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_kernels_trap_on_too_little_shared_memory(which):
    problem = Problem("float32", 1, 8, 8, 1, 1, 64)
    program = fa1.forward_program(problem, SM80) if which == "forward" else fa1.backward_program(problem, SM80)
    plan = program.launches[0]
    short = type(program)(
        launches=(type(plan)(plan.kernel, plan.grid, plan.block, plan.dynamic_smem_bytes - 4),),
        scratch=program.scratch,
    )
    backend = SimulatorBackend()
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, 1, 8, 8, 1, 1, 64)
    arrays = {"q": q, "k": k, "v": v, "out": np.zeros_like(q), "lse": np.zeros((1, 1, 8), np.float32)}
    if which == "backward":
        arrays.update(dout=q.copy(), dq=np.zeros_like(q), dk=np.zeros_like(k), dv=np.zeros_like(v))
    with pytest.raises(sim.KernelError, match="trap"):
        run_program(backend, short, problem, 0.125, arrays)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_every_instance_compiles_without_spills(arch):
    from cuflash.kernels import nvrtc

    for instance in fa1.instances(target(arch)):
        resources = nvrtc.compile_instance(instance, arch).resources
        assert resources.spill_store_bytes == resources.spill_load_bytes == 0, (instance, resources)
        assert resources.static_smem_bytes == 0, instance  # shared memory is only dynamic
