"""A mod instance of each fa2 kernel (SIMT and tensor-core, forward and backward) is clean under the simulator's race
detector and AddressSanitizer: a score_mod reading a captured table (and adding its gradient into a side-gradient
buffer with atomics) and a mask_mod through a block mask (lists with skipped, full and partial tiles), on a small
GQA problem with odd lengths and rows that see no key, checked against the float64 reference as well."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.flex import create_block_mask
from cuflash.testing import random_inputs

HOOKED = {"float32": ("fa2_forward_kernel", "fa2_backward_kernel"),
          "float16": ("fa2_tc_forward_kernel", "fa2_tc_backward_kernel")}


def _template(name_expr: str) -> str:
    return name_expr.split("<", 1)[0].split("::")[-1]


def run_mod_instances(dtype: str) -> list[str]:
    """Forward and backward (with the table's gradient) of one mod pair in `dtype`; returns the kernels launched.
    Module-level so run_in_asan_subprocess can call it in a child interpreter."""
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 1, 37, 45, 4, 2, 40
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), dtype, seed=31)
    rng = np.random.default_rng(32)
    doc_q = np.sort(rng.integers(0, 4, (batch, seqlen_q))).astype(np.int32)
    doc_k = np.sort(rng.integers(0, 3, (batch, seqlen_k))).astype(np.int32)  # document 3: queries only
    doc_q_j, doc_k_j = jnp.asarray(doc_q), jnp.asarray(doc_k)
    table = jnp.asarray(rng.standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))

    def same_document(b, h, q_idx, kv_idx):
        return doc_q_j[b, q_idx] == doc_k_j[b, kv_idx]

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    block_mask = create_block_mask(same_document, batch, None, seqlen_q, seqlen_k, block_size=16)
    mods = dict(score_mod=relative_bias, block_mask=block_mask)
    with sim.record() as records:
        out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
        dq, dk, dv, (dtable,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, return_aux_grads=True,
                                                                **mods)
    ref_mods = dict(score_mod=relative_bias, mask_mod=same_document)
    ref = tol.forward_references(q, k, v, **ref_mods)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    empty = ~(doc_q[:, :, None] == doc_k[:, None, :]).any(-1)
    assert empty.any() and np.all(out[empty] == 0) and np.all(lse.transpose(0, 2, 1)[empty] == -np.inf)
    bref = tol.backward_references(dout, q, k, v, **ref_mods)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
    assert np.all(dq[empty] == 0)
    assert dtable.shape == table.shape and np.isfinite(dtable).all() and np.abs(dtable).max() > 0
    return [r.kernel for r in records.launches]


def test_race_detector_clean_on_a_mod_instance_of_each_fa2_kernel():
    launched = set()
    with sim.checking("race"):
        for dtype in HOOKED:
            launched |= {_template(k) for k in run_mod_instances(dtype)}
    assert {kernel for kernels in HOOKED.values() for kernel in kernels} <= launched


def test_address_sanitizer_clean_on_a_mod_instance_of_each_fa2_kernel():
    launched = set()
    for dtype in HOOKED:
        launched |= {_template(k) for k in sim.run_in_asan_subprocess(run_mod_instances, dtype, timeout=1800)}
    assert {kernel for kernels in HOOKED.values() for kernel in kernels} <= launched
