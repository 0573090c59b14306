"""flex_attention at head dims below 32 and above 64 (24 on SIMT, 100 and 256 on tensor cores: mma.sync on the
simulator's default sm_80, the wgmma kernels targeting sm_90), GQA / MQA, odd lengths with seqlen_q != seqlen_k, and
rows that see no key: out 0, lse -inf, zero dq, and zero dk / dv for keys no query sees. Against the float64 reference
evaluating the same mods element by element (cuflash._tolerance's rule). One instance pair (forward, backward) per
case."""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.testing import random_inputs

# (dtype, batch, seqlen_q, seqlen_k, heads, heads_k, headdim, the simulator's target: None its default)
CASES = [
    ("float32", 2, 29, 41, 4, 2, 24, None),      # SIMT, GQA 4:2, head dim below 32
    ("float16", 1, 45, 37, 3, 1, 100, None),     # tensor cores, MQA, head dim between 64 and 128, seqlen_q > seqlen_k
    ("bfloat16", 1, 33, 50, 2, 2, 256, None),    # tensor cores, the largest head dim
    ("float16", 1, 150, 77, 3, 1, 100, "sm_90"),  # the Hopper kernels: the backward's keys-sharing d128 tile
    ("bfloat16", 1, 70, 90, 4, 2, 200, "sm_90"),  # its d256 tile sharing the head dim
]


@pytest.mark.parametrize("dtype, batch, seqlen_q, seqlen_k, heads, heads_k, headdim, arch", CASES,
                         ids=[f"{c[0]}-d{c[6]}{'-' + c[7] if c[7] else ''}" for c in CASES])
def test_head_dims_gqa_odd_lengths_and_rows_that_see_no_key(dtype, batch, seqlen_q, seqlen_k, heads, heads_k, headdim,
                                                             arch):
    with sim.targeting(arch) if arch else contextlib.nullcontext(), sim.record() as records:
        _check_head_dim(dtype, batch, seqlen_q, seqlen_k, heads, heads_k, headdim)
    kernels = {r.kernel.split("<", 1)[0] for r in records.launches}
    wgmma = {"cuflash::fa3_forward_kernel", "cuflash::fa3_backward_kernel"}
    assert kernels >= wgmma if arch == "sm_90" else not kernels & wgmma, kernels


def _check_head_dim(dtype, batch, seqlen_q, seqlen_k, heads, heads_k, headdim):
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), dtype, seed=headdim)
    slopes = jnp.asarray(np.linspace(0.1, 0.4, heads).astype(np.float32))
    lag = 4  # query row i sees keys j <= i - lag (per head, one more for odd heads): the first rows see none

    def per_head_slope(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).astype(jnp.float32)

    def lagged(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - lag - h % 2

    mods = dict(score_mod=per_head_slope, mask_mod=lagged)
    out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
    assert out.shape == (batch, seqlen_q, heads, headdim) and out.dtype == q.dtype
    ref = tol.forward_references(q, k, v, **mods)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)

    rows = np.arange(seqlen_q)
    for h in range(heads):
        blind = rows < lag + h % 2  # these rows see no key in head h
        assert np.all(out[:, blind, h] == 0) and np.all(lse[:, h, blind] == -np.inf)
        assert np.all(lse[:, h, ~blind] > -np.inf)

    dq, dk, dv = cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)
    bref = tol.backward_references(dout, q, k, v, **mods)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.dtype == q.dtype
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
    for h in range(heads):
        blind = rows < lag + h % 2
        assert np.all(dq[:, blind, h] == 0)
    unseen = np.arange(seqlen_k) > seqlen_q - 1 - lag  # no query row reaches these keys in any head
    if unseen.any():
        assert np.all(dk[:, unseen] == 0) and np.all(dv[:, unseen] == 0)
