"""Deterministic gradients to a score_mod's captured float arrays (issue 29 item 3).

flex_attention_backward(deterministic=True, return_aux_grads=True): each warp of the backward's main kernel adds
into a float32 slice of its own, its lanes one after another in lane order (flex_hook.cuh's side_grads), and the
slices are summed in slice order afterwards: no atomics race, so the gradients are the same bits whatever the
simulator's schedule (cp.async landing seeds, one or two worker threads running the blocks). The slices number
grid x warps of the main kernel, whose deterministic grid is (num_dq_splits, nheads_k, batch): at most (batch nheads_k
+ SMs) x warps slices of each array's size, whatever the sequence lengths. On sm_90 the main kernel is the Hopper
backward (fa3_backward.cu, its consumer warps adding; the producer's add nothing), on sm_80 the mma.sync one.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.reference import attention_backward_reference
from cuflash.testing import random_inputs

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): GQA 4:2, lengths no tile multiple, head dims not powers of 2.
CASES = {"float32": (2, 37, 75, 4, 2, 40), "float16": (1, 70, 150, 4, 2, 48), "bfloat16": (1, 150, 70, 4, 2, 48)}
# (dtype, the simulator's target: None its default, sm_80) -> the main backward kernel that runs.
RUNS = {("float32", None): "fa2_backward_kernel", ("float16", None): "fa2_tc_backward_kernel",
        ("bfloat16", "sm_90"): "fa3_backward_kernel"}
SCHEDULES = ((1, 1), (1, 2), (2, 1), (2, 3))  # (simulator worker threads, cp.async landing seed)


@pytest.mark.parametrize("dtype, arch", list(RUNS))
def test_deterministic_side_gradients_are_the_same_bits_under_every_schedule(dtype, arch, monkeypatch):
    with sim.targeting(arch) if arch is not None else contextlib.nullcontext():
        _check_deterministic_side_gradients(dtype, arch, monkeypatch)


def _check_deterministic_side_gradients(dtype, arch, monkeypatch):
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = CASES[dtype]
    q, k, v, dout = random_inputs(CASES[dtype], dtype, seed=31)
    rng = np.random.default_rng(32)
    import jax.numpy as jnp

    table = jnp.asarray(rng.standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    def near_past(b, h, q_idx, kv_idx):  # the first rows see no key in odd heads
        return (kv_idx <= q_idx + 40) & ((h % 2 == 0) | (kv_idx + 5 <= q_idx))

    mods = dict(score_mod=relative_bias, mask_mod=near_past)
    out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
    runs = []
    for threads, seed in SCHEDULES:
        monkeypatch.setenv("CUFLASH_SIM_THREADS", str(threads))
        with sim.copy_landing(seed), sim.record() as records:
            *grads, (dtable,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, deterministic=True,
                                                                return_aux_grads=True, **mods)
        runs.append((np.asarray(dtable), *grads))
        (main,) = [r for r in records.launches if "backward_kernel" in r.kernel]
        assert f"::{RUNS[dtype, arch]}<" in main.kernel, main.kernel
    for run in runs[1:]:
        for name, a, b in zip(("dtable", "dq", "dk", "dv"), runs[0], run):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name

    # The bound on the slices: the main kernel's grid x warps, grid.x at most enough blocks to fill the SMs.
    warps = main.block[0] // 32
    assert main.grid[1:] == (heads_k, batch)
    assert main.grid[0] * heads_k * batch <= batch * heads_k + sim.current_target().sm_count

    offsets = (np.arange(seqlen_q)[:, None] - np.arange(seqlen_k)[None, :] + seqlen_k).ravel()

    def table_gradient(precision):
        score_grads = attention_backward_reference(dout, q, k, v, dtype=precision, return_score_grads=True,
                                                   **mods)[-1]
        per_head = score_grads.sum(axis=0).reshape(heads, -1)
        gradient = np.zeros((heads, seqlen_q + seqlen_k))
        for h in range(heads):
            np.add.at(gradient[h], offsets, per_head[h])
        return gradient

    dtable = runs[0][0]
    assert dtable.dtype == np.float32 and dtable.shape == table.shape and warps >= 1
    # Low precision: the reference in the inputs' precision (float16: P and dS rounded as the tensor cores take them).
    tol.check_close("dtable", dtable, table_gradient(np.float64), table_gradient(q.dtype), tol.BACKWARD_FACTOR,
                    atol=1e-5)
    # The same gradients as the atomic adds' up to their order (and dq, dk, dv the deterministic ones).
    *_, (atomic,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, return_aux_grads=True, **mods)
    np.testing.assert_allclose(dtable, atomic, rtol=1e-4, atol=1e-5)


def test_deterministic_side_gradients_refuse_slices_past_the_memory_bound(monkeypatch):
    # A captured array whose per-warp slices would pass the bound: a clear ValueError naming the option, before any
    # kernel runs (nothing is launched).
    from cuflash.flex import _api

    q, k, v, dout = random_inputs((1, 33, 40, 2, 2, 16), "float32", seed=5)
    import jax.numpy as jnp

    bias = jnp.zeros((2, 33, 40), jnp.float32)

    def dense_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    out, lse = cuflash.flex_attention(q, k, v, return_lse=True, score_mod=dense_bias)
    monkeypatch.setattr(_api, "DETERMINISTIC_SIDE_GRAD_BYTES", 4 * bias.size)  # fewer than one slice per warp
    with sim.record() as records, pytest.raises(ValueError, match=r"deterministic=True: the side gradients"):
        cuflash.flex_attention_backward(dout, q, k, v, out, lse, deterministic=True, return_aux_grads=True,
                                        score_mod=dense_bias)
    assert records.launches == []
    # Atomic side gradients take no slices.
    *_, (dbias,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, return_aux_grads=True,
                                                   score_mod=dense_bias)
    assert dbias.shape == bias.shape
