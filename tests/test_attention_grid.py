"""standard, fa1 and fa2 on the FlashAttention test grid, forward and backward.

Every value of every axis of FA2's own sweep appears for every algorithm: the
odd sequence-length pairs (not block multiples, seqlen_q above and below
seqlen_k), head dims that are not powers of two, MHA/GQA/MQA, causal on and
off, float32/float16/bfloat16. The full product (4,752 cases) does not fit CI,
so each algorithm runs every head dim with two seqlen pairs, the other axes
cycling so that combinations differ between algorithms. Judged with FA2's rule
against the float64 reference (cuflash._tolerance), plus the exact conventions
for rows that see no key, and bitwise reruns.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash.kernels import catalog
from cuflash.testing import random_qkv, rows_without_key

SEQLENS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1, 239), (3, 799), (1023, 1024)]
HEAD_DIMS = [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256]
HEADS = {"mha": (2, 2), "gqa": (6, 2), "mqa": (3, 1)}
DTYPES = ["float16", "bfloat16", "float32"]
ALGORITHMS = ["standard", "fa1", "fa2"]


def _cases():
    cases = []
    for a, algorithm in enumerate(ALGORITHMS):
        for i, headdim in enumerate(HEAD_DIMS):
            for j in range(2):
                seqlen_q, seqlen_k = SEQLENS[(2 * i + j + a) % len(SEQLENS)]
                heads = list(HEADS)[(i + j + a) % len(HEADS)]
                dtype = DTYPES[(i + 2 * j + a) % len(DTYPES)]
                causal = (i + j + a) % 2 == 1
                # Small problems also get batch 2, so batch strides are exercised.
                batch = 2 if seqlen_q * seqlen_k <= 60_000 else 1
                case_id = f"{algorithm}-d{headdim}-{seqlen_q}x{seqlen_k}-{heads}-{dtype}-{'causal' if causal else 'full'}"
                cases.append(pytest.param(algorithm, batch, seqlen_q, seqlen_k, heads, headdim, dtype, causal,
                                          id=case_id))
    return cases


CASES = _cases()


def test_grid_keeps_every_value_of_every_axis():
    for a in ALGORITHMS:
        mine = [c.values for c in CASES if c.values[0] == a]
        assert {(v[2], v[3]) for v in mine} == set(SEQLENS)
        assert {v[5] for v in mine} == set(HEAD_DIMS)
        assert {v[4] for v in mine} == set(HEADS)
        assert {v[6] for v in mine} == set(DTYPES)
        assert {v[7] for v in mine} == {False, True}


@pytest.mark.parametrize("algorithm, batch, seqlen_q, seqlen_k, heads, headdim, dtype, causal", CASES)
def test_matches_reference(algorithm, batch, seqlen_q, seqlen_k, heads, headdim, dtype, causal):
    if algorithm not in catalog.algorithms():
        pytest.fail(f"{algorithm} is not available")
    nheads, nheads_k = HEADS[heads]
    rng = np.random.default_rng(headdim * 1009 + seqlen_q)
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    dout = rng.standard_normal(q.shape).astype(q.dtype)

    out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
    ref = tol.forward_references(q, k, v, causal=causal)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = rows_without_key(seqlen_q, seqlen_k, causal)
    assert np.all(out[:, empty].astype(np.float32) == 0) and np.all(lse[:, :, empty] == -np.inf)

    deterministic = bool(seqlen_q % 2)
    grads = cuflash.attention_backward(
        dout, q, k, v, out, lse, causal=causal, algorithm=algorithm, deterministic=deterministic
    )
    bref = tol.backward_references(dout, q, k, v, causal=causal)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert got.dtype == q.dtype
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5 if causal else 0.0)
    assert np.all(grads[0][:, empty].astype(np.float32) == 0)

    # Reruns are bitwise identical: always for the forward, for the backward when deterministic.
    again = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip((out, lse), again))
    if deterministic:
        grads_again = cuflash.attention_backward(
            dout, q, k, v, out, lse, causal=causal, algorithm=algorithm, deterministic=True
        )
        assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(grads, grads_again))
