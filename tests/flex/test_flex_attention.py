"""cuflash.flex_attention / flex_attention_backward on the simulator: user mods compiled into the fa2 kernels.

Every result is judged by FlashAttention's rule (cuflash._tolerance): against the float64 reference evaluating the
same mods element by element (cuflash.reference's score_mod / mask_mod), within a small factor of the error the
same computation makes in the input precision. Each mod is a kernel instance of its own (a cold simulator build of
a tensor-core kernel costs seconds), so each test runs several checks on one instance pair (forward, backward).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.flex import create_block_mask, cuda_mod, trace_mask_mod
from cuflash.kernels.families import fa2, fa2_tc
from cuflash.kernels.program import Problem
from cuflash.reference import attention_backward_reference
from cuflash.testing import random_inputs


def _check_forward(q, k, v, **mods):
    out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
    ref = tol.forward_references(q, k, v, **mods)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    return out, lse


def _check_backward(dout, q, k, v, out, lse, **mods):
    grads = cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)
    ref = tol.backward_references(dout, q, k, v, **mods)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert got.dtype == q.dtype
        tol.check_close(name, got, getattr(ref, name), getattr(ref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    return grads


def test_document_mask_with_a_relative_bias_table_and_its_gradient_float32_gqa():
    """SIMT (float32), GQA 4:2, seqlen_q 37 != seqlen_k 45, head dim 40: packed documents of unequal lengths (query
    rows of a document the keys lack see no key, and odd heads are also causal) and a learned relative-position bias
    per head, whose gradient (return_aux_grads) matches the reference's d loss / d score summed per table entry.
    A block mask of the same mask_mod (blocks of 16, per head: the backward's lists are the union over each kv head's
    group) gives bitwise the same results."""
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 2, 37, 45, 4, 2, 40
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), "float32", seed=1)
    rng = np.random.default_rng(2)
    doc_q = np.sort(rng.integers(0, 5, (batch, seqlen_q))).astype(np.int32)
    doc_k = np.sort(rng.integers(0, 4, (batch, seqlen_k))).astype(np.int32)  # document 4: queries only
    doc_q_j, doc_k_j = jnp.asarray(doc_q), jnp.asarray(doc_k)
    span = seqlen_q + seqlen_k
    table = jnp.asarray(rng.standard_normal((heads, span)).astype(np.float32))

    def same_document(b, h, q_idx, kv_idx):
        return (doc_q_j[b, q_idx] == doc_k_j[b, kv_idx]) & ((h % 2 == 0) | (q_idx >= kv_idx))

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    mods = dict(score_mod=relative_bias, mask_mod=same_document)
    out, lse = _check_forward(q, k, v, **mods)
    empty = ~(doc_q[:, :, None] == doc_k[:, None, :]).any(-1)  # (batch, seqlen_q): no key in any head
    assert empty.any() and not empty.all()
    assert np.all(out[empty] == 0) and np.all(lse.transpose(0, 2, 1)[empty] == -np.inf)
    dq, dk, dv = _check_backward(dout, q, k, v, out, lse, **mods)
    assert np.all(dq[empty] == 0)

    block_mask = create_block_mask(same_document, batch, heads, seqlen_q, seqlen_k, block_size=16)
    sparse = dict(score_mod=relative_bias, block_mask=block_mask)
    sparse_out, sparse_lse = cuflash.flex_attention(q, k, v, return_lse=True, **sparse)
    np.testing.assert_array_equal(sparse_out, out)
    np.testing.assert_array_equal(sparse_lse, lse)
    for name, got, want in zip(("dq", "dk", "dv"), cuflash.flex_attention_backward(dout, q, k, v, out, lse, **sparse),
                               (dq, dk, dv)):
        np.testing.assert_array_equal(got, want, err_msg=f"{name} with the block mask")

    *grads, (dtable,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, return_aux_grads=True, **mods)
    for name, first, again in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        np.testing.assert_array_equal(first, again, err_msg=name)
    assert dtable.dtype == np.float32 and dtable.shape == table.shape
    tol.check_close("dtable", dtable, _relative_table_gradient(dout, q, k, v, np.float64, **mods),
                    _relative_table_gradient(dout, q, k, v, np.float32, **mods), tol.BACKWARD_FACTOR, atol=1e-5)


def _relative_table_gradient(dout, q, k, v, dtype, **mods):
    """The reference's gradient to a relative-position table of (heads, seqlen_q + seqlen_k) entries, entry
    q_idx - kv_idx + seqlen_k of head h read by score (q_idx, kv_idx): d loss / d score summed per entry, in
    ``dtype``."""
    seqlen_q, seqlen_k, heads = q.shape[1], k.shape[1], q.shape[2]
    score_grads = attention_backward_reference(dout, q, k, v, dtype=dtype, return_score_grads=True, **mods)[-1]
    per_head = score_grads.sum(axis=0).reshape(heads, -1)  # (heads, seqlen_q * seqlen_k)
    offsets = (np.arange(seqlen_q)[:, None] - np.arange(seqlen_k)[None, :] + seqlen_k).ravel()
    gradient = np.zeros((heads, seqlen_q + seqlen_k))
    for h in range(heads):
        np.add.at(gradient[h], offsets, per_head[h])
    return gradient


def test_score_mod_on_tiles_inside_and_across_the_sequence_float16_mqa():
    """Tensor cores (float16), MQA, seqlen_q 300 != seqlen_k 283: tiles wholly inside the sequence and tiles crossing
    its end. A score_mod without a mask_mod, fast-math tanh soft-capping of the score (score / cap folded into the
    softmax scale) plus a relative-position bias table, so the forward and the backward run the hook's form without
    the per-score sequence-bound test on the inner tiles (FlexHook::tests_bounds) and take the scaled score itself
    where they can (kScaledScores). Out, lse, dq, dk, dv and the table's gradient meet the rule."""
    cap, seqlen_q, seqlen_k, heads = 8.0, 300, 283, 2
    q, k, v, dout = random_inputs((1, seqlen_q, seqlen_k, heads, 1, 64), "float16", seed=17)
    table = jnp.asarray(np.random.default_rng(18).standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))

    def capped_bias(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap) + table[h, q_idx - kv_idx + seqlen_k]

    fast = cuflash.flex.trace_score_mod(capped_bias, fast_math=True, side_grads=True)
    assert f"kScoreFactor = {(np.float32(1) / np.float32(cap)).item().hex()}f;" in fast.source
    out, lse = cuflash.flex_attention(q, k, v, score_mod=fast, return_lse=True)
    ref = tol.forward_references(q, k, v, score_mod=capped_bias)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    *grads, (dtable,) = cuflash.flex_attention_backward(dout, q, k, v, out, lse, score_mod=fast,
                                                        return_aux_grads=True)
    bref = tol.backward_references(dout, q, k, v, score_mod=capped_bias)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    tol.check_close("dtable", dtable, _relative_table_gradient(dout, q, k, v, np.float64, score_mod=capped_bias),
                    _relative_table_gradient(dout, q, k, v, q.dtype, score_mod=capped_bias), tol.BACKWARD_FACTOR,
                    atol=1e-5)
    # deterministic=True with return_aux_grads: tests/flex/test_deterministic_side_grads.py.


def test_prefix_lm_with_a_softcap_mod_float16_equals_the_built_in_softcap():
    """Tensor cores (float16), odd lengths: prefix-LM (the first 11 keys bidirectional, then causal) with tanh
    soft-capping as a score_mod. The same mod without the mask equals the built-in softcap: both meet the rule
    against one reference (their difference is then within twice the bound), and the deterministic backward is
    bitwise the same on a rerun."""
    cap, prefix = 5.0, 11
    q, k, v, dout = random_inputs((1, 53, 53, 2, 1, 64), "float16", seed=3)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    out, lse = _check_forward(q, k, v, score_mod=softcap, mask_mod=prefix_lm)
    _check_backward(dout, q, k, v, out, lse, score_mod=softcap, mask_mod=prefix_lm)

    # The mod alone against the built-in (same reference: the built-in softcap's).
    flex_out, flex_lse = cuflash.flex_attention(q, k, v, score_mod=softcap, return_lse=True)
    built_out, built_lse = cuflash.attention(q, k, v, softcap=cap, return_lse=True)
    ref = tol.forward_references(q, k, v, softcap=cap)
    for name, flex, built, exact, lowp in (("out", flex_out, built_out, ref.out, ref.out_lowp),
                                           ("lse", flex_lse, built_lse, ref.lse, ref.lse_lowp)):
        tol.check_close(f"{name} (softcap mod)", flex, exact, lowp, tol.FORWARD_FACTOR)
        tol.check_close(f"{name} (built-in softcap)", built, exact, lowp, tol.FORWARD_FACTOR)
    flex_grads = cuflash.flex_attention_backward(dout, q, k, v, flex_out, flex_lse, score_mod=softcap,
                                                 deterministic=True)
    again = cuflash.flex_attention_backward(dout, q, k, v, flex_out, flex_lse, score_mod=softcap, deterministic=True)
    built_grads = cuflash.attention_backward(dout, q, k, v, built_out, built_lse, softcap=cap)
    bref = tol.backward_references(dout, q, k, v, softcap=cap)
    for name, flex, rerun, built in zip(("dq", "dk", "dv"), flex_grads, again, built_grads):
        np.testing.assert_array_equal(flex, rerun, err_msg=f"{name}: deterministic rerun")
        for what, got in (("softcap mod", flex), ("built-in softcap", built)):
            tol.check_close(f"{name} ({what})", got, getattr(bref, name), getattr(bref, name + "_lowp"),
                            tol.BACKWARD_FACTOR, atol=1e-5)


def test_sliding_window_with_sinks_and_an_alibi_mod_bfloat16_equals_the_built_in_alibi():
    """Tensor cores (bfloat16), seqlen_q 29 < seqlen_k 70, MQA: a causal sliding window of 16 keys plus 4 sink keys
    every row sees, with ALiBi as a score_mod (bottom-right aligned like the built-in's). The ALiBi mod under a
    causal mask_mod equals the built-in causal ALiBi (both meet the rule against the built-in's reference); a block
    mask built from the window mask gives the same result as the mask_mod alone."""
    seqlen_q, seqlen_k, heads = 29, 70, 2
    q, k, v, dout = random_inputs((1, seqlen_q, seqlen_k, heads, 1, 64), "bfloat16", seed=5)
    offset = seqlen_k - seqlen_q
    slopes = np.array([0.25, 0.0625], np.float32)
    slopes_j = jnp.asarray(slopes)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes_j[h] * jnp.abs(q_idx + offset - kv_idx).astype(jnp.float32)

    def window_with_sinks(b, h, q_idx, kv_idx):
        diagonal = q_idx + offset
        return (kv_idx <= diagonal) & ((diagonal - kv_idx < 16) | (kv_idx < 4))

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    out, lse = _check_forward(q, k, v, score_mod=alibi, mask_mod=window_with_sinks)
    _check_backward(dout, q, k, v, out, lse, score_mod=alibi, mask_mod=window_with_sinks)
    block_mask = create_block_mask(window_with_sinks, None, None, seqlen_q, seqlen_k, block_size=16)
    np.testing.assert_array_equal(cuflash.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask), out)

    flex_out, flex_lse = cuflash.flex_attention(q, k, v, score_mod=alibi, mask_mod=causal, return_lse=True)
    built_out, built_lse = cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    ref = tol.forward_references(q, k, v, causal=True, alibi_slopes=slopes)
    for name, flex, built, exact, lowp in (("out", flex_out, built_out, ref.out, ref.out_lowp),
                                           ("lse", flex_lse, built_lse, ref.lse, ref.lse_lowp)):
        tol.check_close(f"{name} (ALiBi mod)", flex, exact, lowp, tol.FORWARD_FACTOR)
        tol.check_close(f"{name} (built-in ALiBi)", built, exact, lowp, tol.FORWARD_FACTOR)
    flex_grads = cuflash.flex_attention_backward(dout, q, k, v, flex_out, flex_lse, score_mod=alibi, mask_mod=causal)
    bref = tol.backward_references(dout, q, k, v, causal=True, alibi_slopes=slopes)
    for name, got in zip(("dq", "dk", "dv"), flex_grads):
        tol.check_close(f"{name} (ALiBi mod)", got, getattr(bref, name), getattr(bref, name + "_lowp"),
                        tol.BACKWARD_FACTOR, atol=1e-5)


@pytest.mark.parametrize("dtype, seqlen", [("float32", 512), ("float16", 1024)])
def test_a_block_mask_of_8_documents_reads_an_eighth_of_k_and_v(dtype, seqlen):
    """8 equal documents whose length is a multiple of the kernel's tiles: with the block mask each Q tile reads the
    K/V tiles of its own document only (1/8 of the keys; the lists themselves add a few int32 reads per visit), and
    every visited tile is full, so the mask_mod never runs (it would read the document ids). Without the block mask
    the kernel reads every K/V tile and evaluates mask_mod per score. The results are bitwise the same (a skipped
    tile's scores are all hidden: it changes no maximum and adds no term), and the backward reads Q and dO of one
    document's tiles per K/V tile."""
    q, k, v, dout = random_inputs((1, seqlen, seqlen, 1, 1, 32), dtype, seed=11)
    document = jnp.asarray(np.arange(seqlen, dtype=np.int32) // (seqlen // 8))

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    block_mask = create_block_mask(same_document, None, None, seqlen, seqlen, block_size=seqlen // 8)
    assert block_mask.sparsity() == pytest.approx(100 * 7 / 8)  # percent of the blocks empty
    bytes_read, results = {}, {}
    # A FlexMod mask_mod is run densely (a call builds a block mask only from a Python function, _api's
    # block_mask_for_call); the Python function builds one of 128-blocks (2 documents of 64 per block at 512).
    cases = (("dense", dict(mask_mod=trace_mask_mod(same_document))), ("sparse", dict(block_mask=block_mask)),
             ("built", dict(mask_mod=same_document)))
    for name, mods in cases:
        with sim.record() as forward:
            out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
        with sim.record() as backward:
            grads = cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)
        bytes_read[name] = (forward.launches[0].global_bytes_read, backward.launches[1].global_bytes_read)
        results[name] = (out, lse, *grads)
    for name, sparse, built, dense in zip(("out", "lse", "dq", "dk", "dv"), results["sparse"], results["built"],
                                          results["dense"]):
        np.testing.assert_array_equal(sparse, dense, err_msg=name)
        np.testing.assert_array_equal(built, dense, err_msg=f"{name} with the block mask built for the call")
    assert bytes_read["built"][0] < bytes_read["dense"][0] / 2

    itemsize = np.dtype(q.dtype).itemsize
    q_bytes = seqlen * 32 * itemsize
    plain = Problem(dtype, 1, seqlen, seqlen, 1, 1, 32)
    dense_kv = fa2_family(dtype).forward_traffic(plain, sim.current_target()).read - q_bytes
    sparse_kv = bytes_read["sparse"][0] - q_bytes
    assert dense_kv / 8 <= sparse_kv <= 1.3 * dense_kv / 8, (sparse_kv, dense_kv)
    assert bytes_read["dense"][0] > dense_kv  # every tile, and the document ids per score
    assert bytes_read["sparse"][1] < bytes_read["dense"][1] / 8


def test_block_mask_lists_with_gaps_float16_gqa():
    """Tensor cores (float16), GQA 4:2, odd lengths: interleaved documents (chunks of 128 rows, document = chunk % 2)
    and per-head causality, through a block mask of 32-row blocks: the kernels' lists skip tiles in the middle (the
    backward's Q tiles per K/V tile too, its next step then found anew) and mix full and partial tiles. Bitwise the
    results of the mask_mod alone, which meet the rule against the reference."""
    seqlen_q, seqlen_k, heads = 301, 283, 4
    q, k, v, dout = random_inputs((1, seqlen_q, seqlen_k, heads, 2, 32), "float16", seed=13)

    def interleaved(b, h, q_idx, kv_idx):
        return ((q_idx // 128) % 2 == (kv_idx // 128) % 2) & ((h < 2) | (kv_idx <= q_idx))

    out, lse = _check_forward(q, k, v, mask_mod=interleaved)
    grads = _check_backward(dout, q, k, v, out, lse, mask_mod=interleaved)
    block_mask = create_block_mask(interleaved, None, heads, seqlen_q, seqlen_k, block_size=32)
    sparse_out, sparse_lse = cuflash.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    np.testing.assert_array_equal(sparse_out, out)
    np.testing.assert_array_equal(sparse_lse, lse)
    for name, got, want in zip(("dq", "dk", "dv"), cuflash.flex_attention_backward(dout, q, k, v, out, lse,
                                                                                  block_mask=block_mask), grads):
        np.testing.assert_array_equal(got, want, err_msg=f"{name} with the block mask")


def fa2_family(dtype):
    return fa2 if dtype == "float32" else fa2_tc


def test_bad_inputs_raise_before_any_kernel():
    q, k, v, dout = random_inputs((1, 20, 24, 2, 1, 32), "float32", seed=7)
    out = np.zeros(q.shape, np.float32)
    lse = np.zeros((1, 2, 20), np.float32)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with sim.record() as records:
        wrong = create_block_mask(causal, None, None, 20, 20, block_size=8)
        with pytest.raises(ValueError, match=r"block_mask has shape .* KV_LEN = 24"):
            cuflash.flex_attention(q, k, v, block_mask=wrong)
        with pytest.raises(ValueError, match=r"block_mask has shape .* H in \(1, 2\)"):
            cuflash.flex_attention(q, k, v, block_mask=create_block_mask(causal, None, 3, 20, 24, block_size=8))
        with pytest.raises(TypeError, match="block_mask must be a cuflash.flex.BlockMask"):
            cuflash.flex_attention(q, k, v, block_mask=np.ones((20, 24), bool))
        with pytest.raises(TypeError, match=r"score_mod bias_of: side array 'bias' is uint32"):
            cuflash.flex_attention(q, k, v, score_mod=cuda_mod("return score + bias(h);",
                                                               {"bias": np.zeros(2, np.uint32)}, name="bias_of"))

        def arctangent(score, b, h, q_idx, kv_idx):
            return jnp.arctan(score)

        with pytest.raises(TypeError, match="score_mod .*arctangent.*atan"):
            cuflash.flex_attention(q, k, v, score_mod=arctangent)
        with pytest.raises(TypeError, match="mask_mod must be a mask mod"):
            cuflash.flex_attention(q, k, v, mask_mod=cuda_mod("return score;"))
        with pytest.raises(ValueError, match="no derivative in score"):
            cuflash.flex_attention_backward(dout, q, k, v, out, lse, score_mod=cuda_mod("return 2.f * score;"))
        with pytest.raises(ValueError, match="lse"):
            cuflash.flex_attention_backward(dout, q, k, v, out, lse[:, :1], mask_mod=causal)
        with pytest.raises(ValueError, match="return_aux_grads needs a score_mod"):
            cuflash.flex_attention_backward(dout, q, k, v, out, lse, mask_mod=causal, return_aux_grads=True)
    assert records.launches == []


def test_fast_math_softcap_mod_meets_the_rule_and_emits_the_built_ins_forms():
    """trace_score_mod(fast_math=True): tanh as kernel_utils.cuh's tanh_by_exp2 (the built-in
    softcap's forms, what the loop census compares against), approximate but within FlashAttention's rule against
    the float64 reference on tensor cores (float16), forward and backward; the default emission stays exact (IEEE
    division, tanhf)."""
    cap = 5.0
    q, k, v, dout = random_inputs((1, 45, 45, 2, 1, 64), "float16", seed=4)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    fast = cuflash.flex.trace_score_mod(softcap, fast_math=True)
    exact = cuflash.flex.trace_score_mod(softcap)
    # score / cap is folded into the softmax scale and the derivative's cap / cap gathered (kScoreFactor 1 / cap):
    # no division is left in the fast form
    assert "tanh_by_exp2" in fast.source and "tanhf" not in fast.source and " / " not in fast.source
    assert f"kScoreFactor = {(np.float32(1) / np.float32(cap)).item().hex()}f;" in fast.source
    assert "__fdividef" not in exact.source and "tanhf(" in exact.source and "(score / " in exact.source
    out, lse = cuflash.flex_attention(q, k, v, score_mod=fast, return_lse=True)
    ref = tol.forward_references(q, k, v, softcap=cap)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    grads = cuflash.flex_attention_backward(dout, q, k, v, out, lse, score_mod=fast)
    bref = tol.backward_references(dout, q, k, v, softcap=cap)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


def test_a_flex_problem_never_runs_a_kernel_without_the_mods():
    """On sm_90 fa2's 16-bit forward and backward run the Hopper kernels, whose flex instances take the mods (the
    forward's hooked one, the backward's plain one: tests/flex/test_flex_hopper.py); a program whose main kernel takes
    no Hook is refused rather than run without the mods (which once gave plain attention on sm_90, silently), and so
    is a Hopper backward instance whose hook is softcap's and ALiBi's."""
    from cuflash.flex._api import flex_problem
    from cuflash.flex._kernels import hooked_instance
    from cuflash.kernels import plans, targets
    from cuflash.kernels.families import fa1, fa3_backward

    q, k, v, dout = random_inputs((1, 70, 90, 2, 2, 64), np.float16, seed=3)
    hopper = targets.target("sm_90")
    for direction in ("forward", "backward"):
        plain, flex = (plans.variant_for("fa2", problem, hopper, direction).name
                       for problem in (Problem("float16", 1, 70, 90, 2, 2, 64), flex_problem(q, k, v)))
        assert (plain, flex) == ("hopper", "hopper"), direction
    with pytest.raises(ValueError, match="takes no flex Hook"):
        hooked_instance(fa1.instances(hopper)[0], None, None)
    with pytest.raises(ValueError, match="is a hooked instance"):
        hooked_instance(fa3_backward.HOOKED_CHOICES[64].instance("float16"), None, None)
    cap = 20.0
    with sim.targeting("sm_90"):
        out, lse = _check_forward(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: cap * jnp.tanh(s / cap))
        _check_backward(dout, q, k, v, out, lse, score_mod=lambda s, b, h, q_idx, kv_idx: cap * jnp.tanh(s / cap))
