"""cuflash.jax.attention_varlen over a paged KV cache (block_table), on the CPU simulator.

* Concrete and traced (jit) cu_seqlens and block table give bit for bit what cuflash.attention_varlen gives on NumPy
  arrays (the same kernels): fa2's SIMT, mma.sync and (targeting sm_90) Hopper forwards; seqused_k; chunks.
* vmap runs one call per mapped element; differentiating raises (inference, forward only).
* Concrete values are checked as the NumPy function checks them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import sim  # noqa: E402

LENGTHS_Q, LENGTHS_K = [7, 0, 30, 1], [10, 4, 80, 33]
PAGE = 16


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(dtype, seed=0, nheads=4, nheads_k=2, headdim=32):
    rng = np.random.default_rng(seed)
    per_sequence = -(-max(LENGTHS_K) // PAGE)
    num_pages = len(LENGTHS_K) * per_sequence + 2
    q = rng.standard_normal((sum(LENGTHS_Q), nheads, headdim)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((num_pages, PAGE, nheads_k, headdim)).astype(dtype) for _ in range(2))
    table = rng.permutation(num_pages)[:len(LENGTHS_K) * per_sequence].astype(np.int32).reshape(len(LENGTHS_K), -1)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("dtype, arch", [(np.float32, None), (jnp.bfloat16, None), (np.float16, "sm_90")])
def test_jit_with_traced_lengths_and_table_equals_the_numpy_call(dtype, arch):
    q, k_cache, v_cache, table = _inputs(dtype)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    used = np.array([10, 0, 61, 20], np.int32)
    with sim.targeting(arch) if arch else contextlib.nullcontext():
        for extra in ({}, {"seqused_k": used}):
            expected = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, causal=True,
                                                return_lse=True, **extra)
            concrete = cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, causal=True,
                                            return_lse=True, **extra)
            step = jax.jit(lambda q, a, b, cq, ck, t, u: cfj.attention_varlen(
                q, a, b, cq, ck, block_table=t, causal=True, return_lse=True, max_seqlen_q=30, max_seqlen_k=80,
                **({} if u is None else {"seqused_k": u})))
            traced = step(q, k_cache, v_cache, cu_q, cu_k, table, extra.get("seqused_k"))
            for got in (concrete, traced):
                for a, b in zip(got, expected):
                    assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_chunks_over_pages_equal_the_numpy_call():
    q, k_cache, v_cache, table = _inputs(np.float16, seed=3)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    options = dict(block_table=table, causal=True, attention_chunk=32, window_size=(40, -1))
    expected = cuflash.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, **options)
    got = jax.jit(lambda q, a, b: cfj.attention_varlen(q, a, b, cu_q, cu_k, **options))(q, k_cache, v_cache)
    assert np.array_equal(np.asarray(got), expected)
    with pytest.raises(ValueError, match="needs concrete cu_seqlens_q and cu_seqlens_k \\(and block_table"):
        jax.jit(lambda t: cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, **dict(options, block_table=t)))(
            table)


def test_vmap_runs_one_call_per_element_and_grad_raises():
    q, k_cache, v_cache, table = _inputs(np.float32, seed=1)
    q2 = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    batched = jax.vmap(lambda q: cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table))(
        np.stack([q, q2]))
    for i, x in enumerate((q, q2)):
        assert np.array_equal(np.asarray(batched[i]),
                              cuflash.attention_varlen(x, k_cache, v_cache, cu_q, cu_k, block_table=table))
    with pytest.raises(TypeError, match="nor has attention_varlen over a paged cache"):
        jax.grad(lambda q: cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table).sum())(q)


def test_concrete_values_are_checked():
    q, k_cache, v_cache, table = _inputs(np.float32)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    bad = table.copy()
    bad[2, 1] = 10**6
    with pytest.raises(ValueError, match="block_table names pages outside the cache"):
        cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=bad)
    with pytest.raises(ValueError, match="sequence 2 has 80 keys"):
        cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table[:, :2])
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        cfj.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, dropout_p=0.1,
                             dropout_rng=jax.random.key(0))
