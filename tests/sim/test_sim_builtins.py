"""The simulator's CUDA built-ins against their CUDA definitions: paired 16-bit math and conversions, integer
bit intrinsics, fast-math intrinsics, __ldg, __threadfence_block and clock64 (tests/sim/kernels/sim_checks.cu)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from simkit import run

N = 64
RNG = np.random.default_rng(11)
EDGE_WORDS = np.array([0, 1, 0x80000000, 0xFFFFFFFF, 0x00010000, 0x7FFFFFFF, 0xF0F0F0F0, 0x12345678], np.uint32)


def words():
    return np.concatenate([EDGE_WORDS, RNG.integers(0, 2**32, N - EDGE_WORDS.size, dtype=np.uint64).astype(np.uint32)])


def _popc(v):
    return bin(int(v)).count("1")


def _ffs(v, bits):
    v = int(v) & ((1 << bits) - 1)
    return (v & -v).bit_length()


def _clz(v, bits):
    v = int(v) & ((1 << bits) - 1)
    return bits - v.bit_length()


def _byte_perm(x, y, s):
    b = (int(y) << 32) | int(x)
    return sum(((b >> (8 * ((int(s) >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _funnel(x, y, z, left, clamp):
    v = (int(y) << 32) | int(x)
    shift = min(int(z), 32) if clamp else int(z) & 31
    return ((v << shift) >> 32) & 0xFFFFFFFF if left else (v >> shift) & 0xFFFFFFFF


INT_CASES = {
    0: lambda x, y, z: _popc(x),
    1: lambda x, y, z: _ffs(x, 32),
    2: lambda x, y, z: _clz(x, 32),
    3: _byte_perm,
    4: lambda x, y, z: _funnel(x, y, z, True, False),
    5: lambda x, y, z: _funnel(x, y, z, False, False),
    6: lambda x, y, z: _funnel(x, y, z, True, True),
    7: lambda x, y, z: _funnel(x, y, z, False, True),
    8: lambda x, y, z: _popc((int(y) << 32) | int(x)),
    9: lambda x, y, z: _ffs((int(y) << 32) | int(x), 64),
    10: lambda x, y, z: _clz((int(y) << 32) | int(x), 64),
}
INT_NAMES = ["popc", "ffs", "clz", "byte_perm", "funnelshift_l", "funnelshift_r", "funnelshift_lc", "funnelshift_rc",
             "popcll", "ffsll", "clzll"]


@pytest.mark.parametrize("mode", list(INT_CASES), ids=INT_NAMES)
def test_integer_builtins(mode):
    x, y = words(), words()[::-1].copy()
    z = np.concatenate([np.arange(0, 40, dtype=np.uint32), RNG.integers(0, 2**16, N - 40).astype(np.uint32)])
    out = np.zeros(N, np.uint32)
    run("int_builtin_kernel", (1, 1, 1), (N, 1, 1), in0=np.concatenate([x, z]), in1=y, out0=out, mode=mode, n=N)
    expected = [INT_CASES[mode](a, b, c) & 0xFFFFFFFF for a, b, c in zip(x, y, z)]
    assert out.tolist() == expected


def _float_run(mode, x, y):
    out = np.zeros(x.size, np.float32)
    run("float_builtin_kernel", (1, 1, 1), (x.size, 1, 1), in0=x, in1=y, out0=out, mode=mode)
    return out


def test_fdividef_is_division_except_for_huge_divisors():
    x = np.array([1.0, -3.0, 6.0, np.inf, 1.0, 5.0, 0.0, 2.0], np.float32)
    y = np.array([3.0, 7.0, 2.0**127, 2.0**127, -2.0**127, 2.0**126, 1.0, np.inf], np.float32)
    out = _float_run(0, x, y)
    assert out[0] == np.float32(1) / np.float32(3) and out[1] == np.float32(-3) / np.float32(7)
    assert out[2] == 0.0 and math.isnan(out[3]) and out[4] == 0.0  # 2^126 < |y| < 2^128: 0 (NaN for inf / y)
    assert out[5] == np.float32(5.0 / 2.0**126) and out[6] == 0.0 and out[7] == 0.0


def test_expf_is_ex2_approx_of_the_rounded_product_and_rsqrtf_within_2_ulp():
    x = np.concatenate([np.linspace(-90, 88, 30, dtype=np.float32), np.array([-np.inf, 0.0], np.float32)])
    got = _float_run(1, x, np.zeros_like(x))
    exact = np.exp2((x * np.float32(1.4426950408889634)).astype(np.float64))
    exact[np.abs(exact) < np.finfo(np.float32).tiny] = 0.0
    np.testing.assert_allclose(got, exact.astype(np.float32), rtol=2**-21)
    y = np.concatenate([RNG.uniform(1e-6, 1e6, 31).astype(np.float32), np.array([4.0], np.float32)])
    got = _float_run(2, y, np.zeros_like(y))
    np.testing.assert_allclose(got, (1.0 / np.sqrt(y.astype(np.float64))).astype(np.float32), rtol=2**-22)
    assert got[-1] == 0.5


def test_ldg_is_a_counted_global_load():
    x = RNG.standard_normal(32).astype(np.float32)
    out = np.zeros(32, np.float32)
    rec = run("float_builtin_kernel", (1, 1, 1), (32, 1, 1), in0=x, in1=x, out0=out, mode=3)
    assert out.tolist() == x.tolist()
    assert rec.global_bytes_read == 32 * 4 * 3  # x, y and the __ldg of each thread


def _pairs(values, np16):
    return values.astype(np16).view(np.uint16).reshape(-1, 2).view(np.uint32).ravel()


def _unpairs(words_, np16):
    return words_.view(np.uint16).view(np16).astype(np.float64)


@pytest.mark.parametrize("h2, np16", [("__half2", np.float16), ("__nv_bfloat162", ml_dtypes.bfloat16)])
@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=["hfma2", "hmul2", "hmax2", "h2exp2"])
def test_paired_16_bit_math(h2, np16, mode):
    vals = [RNG.standard_normal(2 * N) * 4 for _ in range(3)]
    vals[0][:8] = [0.0, -0.0, np.nan, 1.0, np.nan, 3.0, -0.0, 0.0]
    vals[1][:8] = [-0.0, 0.0, 2.0, np.nan, np.nan, 3.0, 0.0, -0.0]
    a, b, c = (v.astype(np16) for v in vals)
    out = np.zeros(N, np.uint32)
    run(f"paired_kernel<{h2}>", (1, 1, 1), (N, 1, 1), in0=np.concatenate([_pairs(a, np16), _pairs(b, np16),
                                                                          _pairs(c, np16)]), out0=out, mode=mode, n=N)
    got = out.view(np.uint16).view(np16)
    A, B, C = (x.astype(np.float64) for x in (a, b, c))
    if mode == 0:
        expected = (A * B + C).astype(np16)  # exact in float64 for these magnitudes, then one rounding
    elif mode == 1:
        expected = (A * B).astype(np16)
    elif mode == 3:
        expected = np.exp2(A).astype(np16)
    else:
        expected = np.where(np.isnan(A), B, np.where(np.isnan(B), A, np.maximum(A, B))).astype(np16)
        both_zero = (A == 0) & (B == 0)
        expected[both_zero] = np.where(np.signbit(A[both_zero]), B[both_zero], A[both_zero]).astype(np16)
    if mode == 3:  # the GPU computes it with ex2.approx: within one 16-bit unit
        np.testing.assert_allclose(got.astype(np.float64)[8:], expected.astype(np.float64)[8:], rtol=2**-7)
    else:
        nan = np.isnan(expected.astype(np.float64))
        assert (np.isnan(got.astype(np.float64)) == nan).all()
        assert (got.view(np.uint16)[~nan] == expected.view(np.uint16)[~nan]).all()


@pytest.mark.parametrize("mode, np16", [(0, np.float16), (1, ml_dtypes.bfloat16)])
def test_pair_conversions_round_to_nearest_even(mode, np16):
    pair_values = RNG.standard_normal(2 * N).astype(np16)
    floats = np.concatenate([RNG.standard_normal(2 * N - 4) * 1000, [65519.0, 65520.0, 1e-8, -2.5]]).astype(np.float32)
    out0 = np.zeros(2 * N, np.float32)
    out1 = np.zeros(N, np.uint32)
    run("pair_conversion_kernel", (1, 1, 1), (N, 1, 1), in0=_pairs(pair_values, np16), in1=floats, out0=out0,
        out1=out1, mode=mode)
    assert out0.tolist() == pair_values.astype(np.float32).tolist()
    with np.errstate(over="ignore"):
        assert (out1 == _pairs(floats, np16)).all()


def test_clock64_never_runs_backwards():
    out = np.zeros(2 * 64, np.int64)
    run("clock_kernel", (1, 1, 1), (64, 1, 1), out0=out)
    first, second = out[0::2], out[1::2]
    assert (second >= first).all() and (second > first).any() and (first > 0).all()


def _reduce_expected(mode, values):
    u = [int(v) for v in values]
    i = [v - 2**32 if v >= 2**31 else v for v in u]
    import functools
    import operator
    return {1: sum(u) & 0xFFFFFFFF, 2: min(u), 3: max(u), 4: functools.reduce(operator.and_, u),
            5: functools.reduce(operator.or_, u), 6: functools.reduce(operator.xor, u),
            7: sum(i) & 0xFFFFFFFF, 8: min(i) & 0xFFFFFFFF, 9: max(i) & 0xFFFFFFFF}[mode]


@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0x0F0F00F1])
@pytest.mark.parametrize("mode", range(10), ids=["match_any", "add", "min", "max", "and", "or", "xor", "add_int",
                                                  "min_int", "max_int"])
def test_match_any_and_reduce_sync(mode, mask):
    values = np.concatenate([RNG.integers(0, 4, 16), RNG.integers(0, 2**32, 48, dtype=np.uint64)]).astype(np.uint32)
    values[:8] = [5, 5, 0xFFFFFFFF, 0x80000000, 5, 1, 0, 7]
    out = np.zeros(64, np.uint32)
    run("warp_reduce_kernel", (1, 1, 1), (64, 1, 1), in0=values, out0=out, mode=mode, mask=mask)
    for warp in range(2):
        lanes = [l for l in range(32) if mask >> l & 1]
        vals = values[32 * warp:32 * warp + 32]
        for l in range(32):
            got = int(out[32 * warp + l])
            if l not in lanes:
                assert got == 0
            elif mode == 0:
                assert got == sum(1 << o for o in lanes if vals[o] == vals[l]), (warp, l)
            else:
                assert got == _reduce_expected(mode, [vals[o] for o in lanes]), (warp, l)


@pytest.mark.parametrize("live, pattern", [(64, "random"), (64, "all"), (64, "none"), (40, "random")])
def test_syncthreads_count_and_or_over_the_live_threads(live, pattern):
    preds = {"random": RNG.integers(0, 3, 64), "all": np.full(64, 7), "none": np.zeros(64)}[pattern].astype(np.int32)
    out0 = np.full(3 * 64, -1, np.int32)
    run("block_vote_kernel", (1, 1, 1), (64, 1, 1), in0=preds, out0=out0, n=live)
    passed = int(np.count_nonzero(preds[:live]))
    got = out0.reshape(64, 3)[:live]
    assert (got[:, 0] == passed).all()
    assert (got[:, 1] == int(passed == live)).all() and (got[:, 2] == int(passed > 0)).all()
