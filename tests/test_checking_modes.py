"""Every kernel the library launches is clean under the simulator's race detector and AddressSanitizer.

Small shapes chosen to reach every code path that moves data: tails of blocks
(lengths and a head dim that are no block multiples), causal with seqlen_q >
seqlen_k (rows that see no key) and < (tiles above the diagonal), GQA/MQA (the
reductions over query heads) and the deterministic fa2 backward, once per
variant of each algorithm (fa2: tensor cores in float16, SIMT in float32). The runs
record which kernels launched, and the test demands that together they cover
every kernel template of the catalog, so a kernel added later without a
checked run fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.kernels import catalog, targets
from cuflash.testing import random_qkv

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
CASES = [
    (1, 37, 21, 2, 1, 24, True),   # MQA, rows that see no key
    (2, 19, 45, 2, 2, 40, False),  # MHA, head dim not a power of two
    (1, 21, 50, 4, 2, 33, True),   # GQA, causal with tiles above the diagonal
]


def _template(name_expr: str) -> str:
    return name_expr.split("<", 1)[0]


def run_every_path(algorithm: str, dtype: str = "float16") -> list[str]:
    """Forward + backward (and deterministic backward) over CASES, checked against the reference.

    Module-level so run_in_asan_subprocess can call it in a child interpreter.
    Returns the kernels launched.
    """
    rng = np.random.default_rng(1)
    launched: list[str] = []
    for b, sq, sk, h, hk, d, causal in CASES:
        q, k, v = random_qkv(rng, b, sq, sk, h, hk, d, dtype)
        dout = rng.standard_normal(q.shape).astype(q.dtype)
        with sim.record() as rec:
            out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
            backwards = [
                cuflash.attention_backward(
                    dout, q, k, v, out, lse, causal=causal, algorithm=algorithm, deterministic=deterministic
                )
                for deterministic in ((False, True) if algorithm == "fa2" else (False,))
            ]
        launched += [r.kernel for r in rec.launches]
        ref = tol.forward_references(q, k, v, causal=causal)
        tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
        bref = tol.backward_references(dout, q, k, v, causal=causal)
        for grads in backwards:
            for name, got in zip(("dq", "dk", "dv"), grads):
                tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"),
                                tol.BACKWARD_FACTOR, atol=1e-5 if causal else 0.0)
    if algorithm == "fa2":
        launched += _split_kv_decode(rng, dtype)
    return launched


def _split_kv_decode(rng, dtype: str) -> list[str]:
    """fa2's split-KV path: a GQA decode over a paged cache in three splits (the split forward and the combine)."""
    q, k, v = random_qkv(rng, 2, 1, 80, 4, 2, 40, dtype)  # k, v (2, 80, 2, 40) become 10 pages of 16 rows
    table = rng.permutation(10).astype(np.int32).reshape(2, 5)
    k_pages, v_pages = (np.empty((10, 16, 2, 40), x.dtype) for x in (k, v))
    k_pages[table.ravel()], v_pages[table.ravel()] = (x.reshape(10, 16, 2, 40) for x in (k, v))
    lengths = np.array([80, 33], np.int32)
    with sim.record() as rec:
        out = cuflash.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table,
                                             num_splits=3)
    for b, used in enumerate(lengths):
        ref = tol.forward_references(q[b:b + 1], k[b:b + 1, :used], v[b:b + 1, :used])
        tol.check_close("out", out[b:b + 1], ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    return [r.kernel for r in rec.launches]


def run_every_variant(algorithm: str) -> list[str]:
    """run_every_path once per variant of the algorithm, in an element type it serves (float16 where it can)."""
    launched: list[str] = []
    for variant in catalog.variants(algorithm):
        launched += run_every_path(algorithm, "float16" if "float16" in variant.dtypes else variant.dtypes[0])
    return launched


def _catalog_templates(algorithm: str) -> set[str]:
    sm80 = targets.target("sm_80")
    return {_template(i.name_expr) for variant in catalog.variants(algorithm) for i in variant.module.instances(sm80)}


@pytest.mark.parametrize("algorithm", catalog.algorithms())
def test_race_detector_clean_on_every_kernel(algorithm):
    with sim.checking("race"):
        launched = run_every_variant(algorithm)
    assert {_template(k) for k in launched} == _catalog_templates(algorithm)


@pytest.mark.parametrize("algorithm", catalog.algorithms())
def test_address_sanitizer_clean_on_every_kernel(algorithm):
    launched = sim.run_in_asan_subprocess(run_every_variant, algorithm, timeout=1200)
    assert {_template(k) for k in launched} == _catalog_templates(algorithm)
