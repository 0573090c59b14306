"""cuflash.flex on Hopper: a user's mods in the warp-specialized wgmma forward and backward (fa3_forward.cu's and
fa3_backward.cu's Hook), on the simulator targeting sm_90.

The plans give a flex problem's forward the hooked instance of the Hopper tile (fa3.HOOKED_CHOICES) with the mods'
FlexHook as its Hook, and its backward the plain instance of the Hopper backward's tile
(fa3_backward.BACKWARD_CHOICES) with the same Hook (a block mask's Q block lists made for that tile). Each case is judged by FlashAttention's rule against the float64
reference evaluating the same mods element by element, and asserts which kernels ran: a score_mod reading a captured
table, a mask_mod run densely on every score (an expert-form mod: no block mask is built for it), and block masks
(the forward's K/V block lists made for the Hopper tile, which the producer and the consumers walk alike), with rows
that see no key, GQA / MQA, seqlen_q != seqlen_k, lengths that are no multiple of a block, head dims that are not
powers of two.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.flex import create_block_mask, cuda_mod
from cuflash.flex._api import flex_problem, tile_visits
from cuflash.flex._kernels import hooked_instance
from cuflash.kernels import catalog, plans, targets
from cuflash.kernels.families import fa3, fa3_backward, hopper
from cuflash.testing import random_inputs

HOPPER = targets.target("sm_90")


def _run(q, k, v, dout, **mods):
    """Forward and backward on the simulator targeting sm_90, checked by the rule; (out, lse, the kernels run)."""
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
        grads = cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)
    reference_mods = {name: mod for name, mod in mods.items() if name != "block_mask"}
    if "block_mask" in mods and "mask_mod" not in mods:
        reference_mods["mask_mod"] = mods["block_mask"].mask_mod
    ref = tol.forward_references(q, k, v, **reference_mods)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, **reference_mods)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
    return out, lse, [r.kernel for r in records.launches]


def _assert_ran(kernels: list[str], head_dim: int, block_sparse: bool) -> None:
    """The forward ran the hooked Hopper tile of head_dim with a FlexHook, the backward the plain Hopper backward
    tile of head_dim (its compiled one) with one (block_sparse: both walking a block mask); no mma.sync kernel ran."""
    sparse = f", {'true' if block_sparse else 'false'}>>"
    forward = [name for name in kernels if "fa3_forward_kernel" in name]
    assert len(forward) == 1, kernels
    hooked = fa3.HOOKED_CHOICES[head_dim].instance("float16").name_expr.split(", ", 1)[1][:-1]
    assert hooked in forward[0] and "cuflash::flex::FlexHook<" in forward[0] and forward[0].endswith(sparse), forward
    backward = [name for name in kernels if "fa3_backward_kernel" in name]
    assert len(backward) == 1, kernels
    plain = fa3_backward.backward_traits(head_dim, HOPPER).flex_prefix("float16").split(", ", 1)[1]
    assert f", {plain}, cuflash::flex::FlexHook<" in backward[0] and backward[0].endswith(sparse), backward
    assert not any("fa2_tc" in name for name in kernels), kernels


def test_plans_and_instances_of_a_flex_problem_on_hopper():
    """Both directions on Hopper: the forward on the hooked tile, the backward on the plain one; each flex instance
    keeps its instance's traits, launch shape and sm_90a code; only a hooked Hopper forward and a plain Hopper
    backward take the mods; a block mask's lists are made for each direction's Hopper tile (the forward's d256: 80
    keys; the backward's 64 x 64)."""
    q, k, v, _ = random_inputs((1, 300, 260, 2, 1, 250), np.float16, seed=4)
    problem = flex_problem(q, k, v)
    assert plans.variant_for("fa2", problem, HOPPER).name == "hopper"
    assert plans.variant_for("fa2", problem, HOPPER, "backward").name == "hopper"
    assert fa3_backward.refusal(problem, HOPPER) is None
    traits = fa3.HOOKED_CHOICES[256]
    (launch,) = plans.forward_program("fa2", problem, HOPPER).launches
    assert launch.kernel == traits.instance("float16")
    score_mod = cuda_mod("return score * 0.5f;", dscore="return 0.5f;")
    modded = hooked_instance(launch.kernel, score_mod, None)
    assert modded.name_expr.startswith(launch.kernel.name_expr[:-1] + ", 256, cuflash::flex::FlexHook<")
    assert hopper.traits_of(modded) == traits and catalog.compile_arch(modded, "sm_90") == "sm_90a"
    assert catalog.dynamic_smem_bytes(modded) == traits.smem_bytes == launch.dynamic_smem_bytes
    with pytest.raises(ValueError, match="not a hooked instance"):
        hooked_instance(fa3.FORWARD_CHOICES[256][0].instance("float16"), None, None)
    # The backward: the plain d256 tile (64 x 64, sharing the head dim), its defaults spelled out before the Hook.
    backward_traits = fa3_backward.BACKWARD_CHOICES[256]
    main = [plan for plan in plans.backward_program("fa2", problem, HOPPER).launches
            if "fa3_backward_kernel" in plan.kernel.name_expr]
    assert [plan.kernel for plan in main] == [backward_traits.instance("float16")]
    modded = hooked_instance(main[0].kernel, score_mod, None)
    assert modded.name_expr == (backward_traits.instance("float16").name_expr[:-1] + ", 256, cuflash::flex::"
                                f"FlexHook<{score_mod.qualified_name}, cuflash::flex::NoMaskMod, false>>")
    assert modded.flex_prefix == backward_traits.flex_prefix("float16")
    assert hopper.traits_of(modded) == backward_traits and catalog.compile_arch(modded, "sm_90") == "sm_90a"
    assert catalog.dynamic_smem_bytes(modded) == backward_traits.smem_bytes == main[0].dynamic_smem_bytes
    assert catalog.threads(modded) == backward_traits.threads
    plain_d128 = hooked_instance(fa3_backward.BACKWARD_CHOICES[128].instance("bfloat16"), None, None)
    assert plain_d128.flex_prefix.endswith("128, 64, 128, 2, false, false, 128")
    with pytest.raises(ValueError, match="is a hooked instance"):
        hooked_instance(fa3_backward.HOOKED_CHOICES[128].instance("float16"), None, None)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 300, 260)
    member, (counts, indices, _, _, _) = tile_visits(block_mask, problem, HOPPER, backward=False)
    assert member == "kv" and counts.shape == (1, 1, -(-300 // traits.block_m))
    assert list(indices[0, 0, 0, :counts[0, 0, 0]]) == list(range(-(-128 // traits.block_n)))  # 80-key blocks
    member, (counts, indices, _, _, _) = tile_visits(block_mask, problem, HOPPER, backward=True)
    assert member == "q" and counts.shape == (1, 1, -(-260 // backward_traits.block_n))
    # K/V block 1 (keys 64 .. 127) lies in the mask's partial 128-block (0, 0), so Q block 0 visits it too: Q blocks
    # 0 .. 4 of 64 rows; K/V block 2 (keys 128 .. 191) Q blocks 2 .. 4.
    assert list(indices[0, 0, 1, :counts[0, 0, 1]]) == list(range(-(-300 // backward_traits.block_m)))
    assert list(indices[0, 0, 2, :counts[0, 0, 2]]) == [2, 3, 4]


def test_score_mod_with_a_captured_table_gqa_float16():
    """A learned relative-position bias per head (a float32 table read per score), GQA 4:2, 150 x 203, head dim 80
    (the d128 tile): forward and backward on the Hopper tiles (the backward's hook takes the raw scores once dP has
    landed: score', P, dS in one pass)."""
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 2, 150, 203, 4, 2, 80
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), "float16", seed=5)
    table = jnp.asarray(np.random.default_rng(6).standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    _, _, kernels = _run(q, k, v, dout, score_mod=relative_bias)
    _assert_ran(kernels, 128, block_sparse=False)


def test_document_block_mask_with_a_softcap_mod_mqa_bfloat16():
    """Packed documents of unequal lengths through a block mask (built for the call from the Python mask_mod) with a
    tanh softcap score_mod, MQA 4:1, seqlen_q 197 > seqlen_k 140, head dim 64 (the hooked 128 x 128 tile): query rows
    of a document the keys lack see no key (out 0, lse -inf); the lists skip, and mark full, whole blocks."""
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 2, 197, 140, 4, 1, 64
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), "bfloat16", seed=7)
    rng = np.random.default_rng(8)
    doc_q = np.repeat(np.arange(4), [40, 90, 30, 37])[None].repeat(batch, 0).astype(np.int32)
    doc_k = np.repeat(np.arange(3), [10, 120, 10])[None].repeat(batch, 0).astype(np.int32)  # document 3: queries
    doc_q[1] = np.sort(rng.integers(0, 4, seqlen_q))
    doc_q_j, doc_k_j = jnp.asarray(doc_q), jnp.asarray(doc_k)

    def same_document(b, h, q_idx, kv_idx):
        return doc_q_j[b, q_idx] == doc_k_j[b, kv_idx]

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * jnp.tanh(score / 20.0)

    out, lse, kernels = _run(q, k, v, dout, score_mod=softcap, mask_mod=same_document)
    _assert_ran(kernels, 64, block_sparse=True)
    empty = ~(doc_q[:, :, None] == doc_k[:, None, :]).any(-1)
    assert empty.any() and not empty.all()
    assert np.all(out[empty] == 0) and np.all(lse.transpose(0, 2, 1)[empty] == -np.inf)


def test_dense_mask_mod_sliding_window_float16_d192():
    """An expert-form mask_mod (a sliding window of 37 keys, bottom-right aligned, no block mask: run on every score)
    without a score_mod, 130 x 260, head dim 150 (the hooked d192 tile forward, the d256 one backward): the scores go
    to the kernels unscaled; the backward's hook hides them before P is formed."""
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 1, 130, 260, 2, 2, 150
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), "float16", seed=9)
    offset = seqlen_k - seqlen_q
    window = cuda_mod(f"int d = q_idx + {offset} - kv_idx; return d >= 0 && d < 37;", kind="mask", name="window")

    def reference_window(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & (distance < 37)

    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.flex_attention(q, k, v, mask_mod=window, return_lse=True)
        grads = cuflash.flex_attention_backward(dout, q, k, v, out, lse, mask_mod=window)
    ref = tol.forward_references(q, k, v, mask_mod=reference_window)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, mask_mod=reference_window)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
    # The forward on the hooked d192 tile, the backward on the d256 one (sharing the head dim), both with the mask_mod
    # alone on every tile (no block mask).
    launch, *backward = records.launches
    assert "cuflash::flex::FlexHook<cuflash::flex::NoScoreMod, " in launch.kernel, launch.kernel
    assert launch.kernel.endswith(", false>>"), launch.kernel  # no block mask
    assert fa3.HOOKED_CHOICES[192].instance("float16").name_expr[:-1] in launch.kernel
    (main,) = [r.kernel for r in backward if "fa3_backward_kernel" in r.kernel]
    assert main.startswith(fa3_backward.BACKWARD_CHOICES[256].flex_prefix("float16") + ", cuflash::flex::FlexHook<"
                           "cuflash::flex::NoScoreMod, ") and main.endswith(", false>>"), main
    # The same window built in: the same scores, so within the rule of the same reference.
    built_out = cuflash.attention(q, k, v, window_size=(36, 0))
    tol.check_close("out (built-in window)", built_out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)


def test_causal_block_mask_on_the_d256_tile_bfloat16():
    """A causal mask_mod through a block mask of 128-blocks on the d256 tile's 80-key blocks (the lists map one onto
    the other: partial blocks along the diagonal, full ones below it), 211 x 211, head dim 256, no score_mod: equals
    the built-in causal mask within the rule of one reference."""
    batch, seqlen, heads, headdim = 1, 211, 2, 256
    q, k, v, dout = random_inputs((batch, seqlen, seqlen, heads, heads, headdim), "bfloat16", seed=10)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, batch, heads, seqlen, seqlen)
    out, lse, kernels = _run(q, k, v, dout, block_mask=block_mask)
    _assert_ran(kernels, 256, block_sparse=True)
    with sim.targeting("sm_90"):
        built_out = cuflash.attention(q, k, v, causal=True)
    ref = tol.forward_references(q, k, v, causal=True)
    tol.check_close("out (built-in causal)", built_out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("out (causal block mask)", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)


def test_jax_jit_and_grad_run_the_same_kernels_bitwise():
    """cuflash.jax.flex_attention under jit and grad on the simulator targeting sm_90: the custom call's forward
    runs the Hopper flex instance, its backward the Hopper backward's, and out, lse and the gradients to q, k, v are
    bitwise the NumPy path's (a relative bias table, a document block mask, GQA 4:2, 90 x 77, head dim 64)."""
    import jax

    import cuflash.jax as cfj
    from cuflash.jax._ffi import record_launches

    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 1, 90, 77, 4, 2, 64
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), "float16", seed=11)
    table = jnp.asarray(np.random.default_rng(12).standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))
    doc_q = jnp.asarray(np.repeat(np.arange(3), [20, 50, 20])[None].astype(np.int32))
    doc_k = jnp.asarray(np.repeat(np.arange(3), [30, 7, 40])[None].astype(np.int32))

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    def same_document(b, h, q_idx, kv_idx):
        return doc_q[b, q_idx] == doc_k[b, kv_idx]

    block_mask = create_block_mask(same_document, batch, None, seqlen_q, seqlen_k)
    mods = dict(score_mod=relative_bias, block_mask=block_mask)

    def loss(q, k, v):
        out, lse = cfj.flex_attention(q, k, v, return_lse=True, **mods)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), (out, lse)

    with sim.targeting("sm_90"):
        with record_launches() as launches:
            (_, (out, lse)), grads = jax.block_until_ready(
                jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v))
        numpy_out, numpy_lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
        numpy_grads = cuflash.flex_attention_backward(dout, q, k, v, numpy_out, numpy_lse, **mods)
    kernels = [launch.kernel for launch in launches]
    _assert_ran(kernels, 64, block_sparse=True)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), numpy_out.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), numpy_lse)
    for name, got, want in zip(("dq", "dk", "dv"), grads, numpy_grads):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16), err_msg=name)


def _flex_on_arrays(dtype, headdim, device, host):
    """A relative bias table and a document block mask, GQA 4:2, 300 x 257, on arrays ``device`` makes (``host``
    brings results back): out, lse, dq, dk and dv against the reference."""
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 300, 257, 4, 2
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), dtype, seed=13)
    rng = np.random.default_rng(14)
    table = jnp.asarray(rng.standard_normal((heads, seqlen_q + seqlen_k)).astype(np.float32))
    doc_q = jnp.asarray(np.sort(rng.integers(0, 4, (batch, seqlen_q))).astype(np.int32))
    doc_k = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seqlen_k))).astype(np.int32))  # document 3: queries

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + seqlen_k]

    def same_document(b, h, q_idx, kv_idx):
        return doc_q[b, q_idx] == doc_k[b, kv_idx]

    mods = dict(score_mod=relative_bias, mask_mod=same_document)
    dq_, dk_, dv_, ddout = (device(x) for x in (q, k, v, dout))
    out, lse = cuflash.flex_attention(dq_, dk_, dv_, return_lse=True, **mods)
    grads = cuflash.flex_attention_backward(ddout, dq_, dk_, dv_, out, lse, **mods)
    ref = tol.forward_references(q, k, v, **mods)
    tol.check_close("out", host(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", host(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, **mods)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, host(got), getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, headdim", [("bfloat16", 128), ("float16", 64)])
def test_gpu_flex_forward_and_backward_on_cupy_arrays(dtype, headdim):
    """On a GPU (on an sm_90 device: the Hopper forward and backward with the mods) on CuPy arrays."""
    cupy = pytest.importorskip("cupy")
    _flex_on_arrays(dtype, headdim, cupy.asarray, cupy.asnumpy)


def test_the_gpu_case_on_the_simulator_targeting_sm_90():
    """The GPU test's body, here on NumPy arrays (the simulator targeting sm_90), running the kernels it names."""
    with sim.targeting("sm_90"), sim.record() as records:
        _flex_on_arrays("float16", 64, np.asarray, np.asarray)
    _assert_ran([r.kernel for r in records.launches], 64, block_sparse=True)
