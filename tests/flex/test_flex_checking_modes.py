"""A mod instance of each fa2 kernel (SIMT and tensor-core, forward and backward, and the Hopper forward and
backward on the simulator targeting sm_90) is clean under the simulator's race detector and AddressSanitizer: a
score_mod reading a captured table (and adding its gradient into a side-gradient buffer with atomics) and a mask_mod
through a block mask (lists with skipped, full and partial tiles), on a small GQA problem with odd lengths and rows
that see no key, checked against the float64 reference as well.

JAX cannot run under the ASan runtime (its C++ exceptions meet ASan's __cxa_throw interceptor unresolved), so the
mods are traced here and the child gets them traced (FlexMods with NumPy side values, the block mask without its
Python mask_mod): it runs the kernels only, and the results are judged here."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.flex import create_block_mask, trace_mask_mod, trace_score_mod
from cuflash.testing import random_inputs

# (dtype, the simulator's target) -> the main kernels that run the mods.
HOOKED = {("float32", "sm_80"): ("fa2_forward_kernel", "fa2_backward_kernel"),
          ("float16", "sm_80"): ("fa2_tc_forward_kernel", "fa2_tc_backward_kernel"),
          ("bfloat16", "sm_90"): ("fa3_forward_kernel", "fa3_backward_kernel")}
SHAPE = (1, 37, 45, 4, 2, 40)  # batch, seqlen_q, seqlen_k, heads, heads_k, headdim


def _template(name_expr: str) -> str:
    return name_expr.split("<", 1)[0].split("::")[-1]


def _case(dtype: str):
    """Inputs, the Python mods (for the reference), and what the kernels take: traced FlexMods with NumPy side
    values and the block mask without its Python mask_mod (all picklable)."""
    batch, seqlen_q, seqlen_k, heads, _, _ = SHAPE
    q, k, v, dout = random_inputs(SHAPE, dtype, seed=31)
    rng = np.random.default_rng(32)
    doc_q = np.sort(rng.integers(0, 4, (batch, seqlen_q))).astype(np.int32)
    doc_k = np.sort(rng.integers(0, 3, (batch, seqlen_k))).astype(np.int32)  # document 3: queries only
    doc_q_j, doc_k_j = jnp.asarray(doc_q), jnp.asarray(doc_k)
    table = jnp.asarray(rng.standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))

    def same_document(b, h, q_idx, kv_idx):
        return doc_q_j[b, q_idx] == doc_k_j[b, kv_idx]

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    def on_host(mod):
        return dataclasses.replace(mod, side_values=tuple(np.asarray(x) for x in mod.side_values))

    block_mask = create_block_mask(same_document, batch, None, seqlen_q, seqlen_k, block_size=16)
    kernels = dict(score_mod=on_host(trace_score_mod(relative_bias, side_grads=True)),
                   mask_mod=on_host(trace_mask_mod(same_document)),
                   block_mask=dataclasses.replace(block_mask, mask_mod=None))
    empty = ~(doc_q[:, :, None] == doc_k[:, None, :]).any(-1)
    return (q, k, v, dout), dict(score_mod=relative_bias, mask_mod=same_document), kernels, empty, table.shape


def run_kernels(inputs, kernels, arch) -> tuple:
    """Forward and backward (with the table's gradient) on the traced mods, the simulator targeting ``arch``;
    (results, kernels launched). Module-level so run_in_asan_subprocess can call it in a child interpreter (which
    needs no JAX for it)."""
    q, k, v, dout = inputs
    with sim.targeting(arch), sim.record() as records:
        out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **kernels)
        dq, dk, dv, (dtable,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, return_aux_grads=True,
                                                                **kernels)
    return (out, lse, dq, dk, dv, dtable), [r.kernel for r in records.launches]


def _check(inputs, mods, results, empty, table_shape) -> None:
    q, k, v, dout = inputs
    out, lse, dq, dk, dv, dtable = results
    ref = tol.forward_references(q, k, v, **mods)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    assert empty.any() and np.all(out[empty] == 0) and np.all(lse.transpose(0, 2, 1)[empty] == -np.inf)
    bref = tol.backward_references(dout, q, k, v, **mods)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
    assert np.all(dq[empty] == 0)
    assert dtable.shape == table_shape and np.isfinite(dtable).all() and np.abs(dtable).max() > 0


def test_race_detector_clean_on_a_mod_instance_of_each_fa2_kernel():
    launched = set()
    for dtype, arch in HOOKED:
        inputs, mods, kernels, empty, table_shape = _case(dtype)
        with sim.checking("race"):
            results, kernel_names = run_kernels(inputs, kernels, arch)
        _check(inputs, mods, results, empty, table_shape)
        launched |= {_template(name) for name in kernel_names}
    assert {kernel for kernels in HOOKED.values() for kernel in kernels} <= launched


def test_address_sanitizer_clean_on_a_mod_instance_of_each_fa2_kernel():
    launched = set()
    for dtype, arch in HOOKED:
        inputs, mods, kernels, empty, table_shape = _case(dtype)
        results, kernel_names = sim.run_in_asan_subprocess(run_kernels, inputs, kernels, arch, timeout=1800)
        _check(inputs, mods, results, empty, table_shape)
        launched |= {_template(name) for name in kernel_names}
    assert {kernel for kernels in HOOKED.values() for kernel in kernels} <= launched
