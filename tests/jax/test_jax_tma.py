"""TMA tensor maps in the JAX handlers (cuda_src/ffi/program_call.h, cuflash/jax/_primitives.py's tma_attributes).

On the simulator targeting sm_90 the Hopper forward's producer copies with TMA wherever the CuPy / NumPy path's does
(the same TmaMaps decides and encodes, at trace time), the CPU handler patching each tensor's address into its twin
map per call:
* a jitted forward takes the TMA path (profile mode: the very TMA loads the NumPy path's launch counts) and is
  bitwise the NumPy path's; vmap (folded into heads) and grad lower with the maps and stay bitwise;
* where TMA cannot address the arrays (a head dim not a multiple of 8) the call has no maps and runs the load path,
  bitwise; where a call's address is not aligned as TMA needs (the alignment attribute raised) that call runs the
  load path; a twin without its address faults (the patch is what makes the maps work);
* attributes that contradict each other fail the compilation with the handler's message.
On a Hopper GPU (gpu mark) the CUDA handler's driver-encoded maps give the CuPy path's bits.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import sim  # noqa: E402
from cuflash.backends.program import TmaMaps, row_extents  # noqa: E402
from cuflash.jax import _ffi, _primitives  # noqa: E402
from cuflash.jax._ffi import record_launches  # noqa: E402
from cuflash.kernels.params import PARAMS_DTYPE  # noqa: E402
from cuflash.kernels.program import Problem  # noqa: E402
from cuflash.testing import gpu_count, random_qkv  # noqa: E402
from test_jax_ffi_stages import raw_forward  # noqa: E402  (the stages' hand-made call, one home)


def inputs(seed, b, sq, sk, h, hk, d, dtype="float16"):
    return random_qkv(np.random.default_rng(seed), b, sq, sk, h, hk, d, dtype)


def tma_loads(launch) -> int:
    """The TMA load instructions a profiled launch counted (its tma.load shared-memory sites)."""
    return sum(site.instructions for site in launch.shared_access_sites if site.kind == "tma.load")


def forward(q, k, v):
    return cfj.attention(q, k, v, causal=True, return_lse=True)


def lowered_tma_tensors(function, *args) -> list[str]:
    """The tma_tensors attribute of each cuflash custom call in the lowered module."""
    return re.findall(r'tma_tensors = "([^"]*)"', jax.jit(function).lower(*args).as_text())


@pytest.mark.parametrize("head_dim", [64, 60])
def test_jitted_forward_copies_with_tma_where_the_numpy_path_does(head_dim):
    """Head dim 64: q, k and v get maps, the kernel's TMA loads are counted, the same as the NumPy path's launch (same
    kernel, shape, traffic and shared-memory sites), the results bitwise. Head dim 60 (rows of 120 bytes: not whole 16
    bytes): TmaMaps refuses, as on the NumPy path, and both run the load path (no TMA load), bitwise."""
    q, k, v = inputs(17, 1, 70, 150, 4, 2, head_dim)
    with sim.targeting("sm_90"), sim.checking("profile"):
        assert lowered_tma_tensors(forward, q, k, v) == ["q,k,v" if head_dim % 8 == 0 else ""]
        with record_launches() as jax_launches:
            out, lse = jax.block_until_ready(jax.jit(forward)(q, k, v))
        with sim.record() as numpy_launches:
            out_np, lse_np = cuflash.attention(q, k, v, causal=True, return_lse=True)
    (launch,) = jax_launches
    assert launch.kernel.startswith("cuflash::fa3_forward_kernel")
    assert jax_launches == numpy_launches.launches
    assert (tma_loads(launch) > 0) == (head_dim % 8 == 0), launch.shared_access_sites
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), out_np.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), lse_np)


def test_the_maps_are_the_numpy_paths():
    """The attributes come from TmaMaps itself: its template laid over the params (tma_loads 1, the twins with
    address 0), its argument words; TmaMaps.usable False gives none (tma_loads 0)."""
    with sim.targeting("sm_90"):
        for head_dim in (64, 60):
            problem = Problem("float16", 1, 70, 150, 4, 2, head_dim)
            config = _primitives.CallConfig("fa2", problem, 0.125)
            program = _primitives.program_for("forward", config)
            attributes = _primitives.custom_call_attributes("forward", config, program, program.launches)
            params = np.frombuffer(attributes["params"].tobytes(), PARAMS_DTYPE)[0]
            shapes = {name: _primitives.tensor_shape(name, problem) for name in ("q", "k", "v")}
            maps = TmaMaps(program.tma_boxes, problem,
                           {name: _primitives.contiguous_strides(shape) for name, shape in shapes.items()},
                           {name: row_extents(shape) for name, shape in shapes.items()})
            assert maps.usable == (head_dim % 8 == 0)
            assert params["tma_loads"] == int(maps.usable)
            if maps.usable:
                at, block = maps.template()
                assert attributes["params"].tobytes()[at:] == block
                assert attributes["tma_tensors"] == "q,k,v"
                assert attributes["tma_arguments"].tolist() == maps.argument_words()
            else:
                assert attributes["tma_tensors"] == "" and attributes["tma_arguments"].size == 0


def test_the_handlers_read_the_argument_words_where_python_lays_them():
    """tensor_map.tiled_argument_words and program_call.h's TiledArguments (what the CUDA handler passes the driver)
    agree word by word: each argument, given a distinct value, is found where the handlers read it."""
    from cuflash.kernels import tensor_map

    words = tensor_map.tiled_argument_words(9, 4, [101, 102, 103, 104], [201, 202, 203], [31, 32, 33, 34],
                                            [5, 6, 7, 8], interleave=41, swizzle=42, l2_promotion=43, oob_fill=44)
    assert len(words) == tensor_map.TILED_ARGUMENT_WORDS
    expected = {"data_type": [9], "rank": [4], "global_dims": [101, 102, 103, 104, 1],
                "global_strides": [201, 202, 203, 0], "box_dims": [31, 32, 33, 34, 1],
                "element_strides": [5, 6, 7, 8, 1], "interleave": [41], "swizzle": [42], "l2_promotion": [43],
                "oob_fill": [44]}
    found = {}
    for name, values in expected.items():
        at = _ffi.tiled_argument_word(name)
        assert at >= 0, name
        found[name] = words[at: at + len(values)]
    assert found == expected
    assert sorted(_ffi.tiled_argument_word(name) for name in expected) == \
        [0, 1, 2, 7, 11, 16, 21, 22, 23, 24]  # every word read once, in order
    assert _ffi.tiled_argument_word("nonsense") == -1


def test_vmap_and_grad_keep_the_maps_and_the_bits():
    """vmap over q (shared k and v: folded into the query heads) and grad lower with the maps and give the NumPy
    path's bits: each mapped element's forward, and the backward of the NumPy forward's out and lse."""
    q, k, v = inputs(19, 1, 40, 90, 2, 1, 64)
    qs = np.stack([q, inputs(20, 1, 40, 90, 2, 1, 64)[0]])
    weights = np.random.default_rng(21).standard_normal(q.shape).astype(np.float16)

    def loss(q, k, v):
        return jnp.sum(cfj.attention(q, k, v, causal=True).astype(jnp.float32) * weights)

    batched = jax.vmap(lambda q: cfj.attention(q, k, v, causal=True))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    with sim.targeting("sm_90"):
        assert lowered_tma_tensors(batched, qs) == ["q,k,v"]
        assert lowered_tma_tensors(grad, q, k, v)[0] == "q,k,v"  # the forward's; the backward has no TMA copies
        outs = np.asarray(jax.jit(batched)(qs))
        for member, out in zip(qs, outs):
            np.testing.assert_array_equal(out.view(np.uint16),
                                          cuflash.attention(member, k, v, causal=True).view(np.uint16))
        grads = jax.jit(grad)(q, k, v)
        out_np, lse_np = cuflash.attention(q, k, v, causal=True, return_lse=True)
        want = cuflash.attention_backward(weights, q, k, v, out_np, lse_np, causal=True)
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, want):
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint16), theirs.view(np.uint16), err_msg=name)


def raw_hopper_forward(q, k, v, **overrides):
    """jit of the Hopper forward's custom call with hand-made attributes (call under sim.targeting("sm_90"))."""
    return raw_forward(q, k, v, softmax_scale=0.125, **overrides)


def test_an_address_tma_cannot_take_runs_the_load_path_and_a_twin_without_its_address_faults():
    """Per call the handler checks each address against the alignment TMA needs (TmaMaps.block's rule): raised past
    any address, every call runs the load path (no TMA load counted), with the same bits. A twin map whose address
    is not patched in (the patch aimed elsewhere in the map) leaves the TMA reading address 0: the simulator
    refuses the copy."""
    q, k, v = inputs(23, 1, 70, 150, 4, 2, 64)
    with sim.targeting("sm_90"), sim.checking("profile"):
        with record_launches() as aligned:
            want = jax.block_until_ready(raw_hopper_forward(q, k, v)(q, k, v))
        with record_launches() as unaligned:
            got = jax.block_until_ready(raw_hopper_forward(q, k, v, tma_address_alignment=np.int64(1 << 40))(q, k, v))
    assert tma_loads(aligned[0]) > 0 and tma_loads(unaligned[0]) == 0
    assert aligned[0].global_bytes_read == unaligned[0].global_bytes_read
    for ours, theirs in zip(got, want):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    with sim.targeting("sm_90"):
        # offset 24: the twin's global dims; its address stays 0
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                           match=r"failed in the simulator: global load out of bounds \(TMA load source\)"):
            jax.block_until_ready(raw_hopper_forward(q, k, v, tma_twin_address_at=np.int64(24))(q, k, v))


def test_contradicting_tma_attributes_fail_the_compilation():
    q, k, v = inputs(24, 1, 16, 16, 2, 2, 64)
    errors = {
        "params' tma_loads is 1 but tma_tensors names 0 maps": dict(tma_tensors="",
                                                                     tma_arguments=np.zeros(0, np.int64)),
        "tma_tensors names out, which has no map in AttentionParams.tma": dict(tma_tensors="q,k,out"),
        "tma_tensors names k twice": dict(tma_tensors="q,k,k"),
        "tma_arguments has 74 words for 3 maps of 25": dict(tma_arguments=np.zeros(74, np.int64)),
        "tma_address_alignment 12 is not a power of 2": dict(tma_address_alignment=np.int64(12)),
        "tma_twin_address_at 124 is not inside a map": dict(tma_twin_address_at=np.int64(124)),
    }
    with sim.targeting("sm_90"):
        for words, override in errors.items():
            lowered = raw_hopper_forward(q, k, v, **override).lower(q, k, v)
            with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(words)):
                lowered.compile()


@pytest.mark.gpu
def test_gpu_forward_with_driver_encoded_maps_is_the_cupy_paths():
    """On a Hopper GPU the CUDA handler encodes q's, k's and v's maps with cuTensorMapEncodeTiled per call: the
    jitted forward lowers with them and gives the CuPy path's bits (which encodes through cuda-bindings), on d64
    and d128 and on a head dim TMA cannot take (60: no maps, the load path)."""
    if not _primitives.local_cuda_capabilities() or _primitives.local_cuda_capabilities()[0][0] != 9:
        pytest.skip("needs JAX's CUDA backend on a Hopper GPU")
    import cupy

    assert gpu_count() and _ffi.has_cuda_handler() and _ffi.cuda_driver_status() == ""
    for head_dim in (64, 128, 60):
        q, k, v = inputs(25, 2, 300, 500, 4, 2, head_dim)
        assert lowered_tma_tensors(forward, q, k, v) == ["q,k,v" if head_dim % 8 == 0 else ""]
        device = jax.devices("cuda")[0]
        out, lse = jax.block_until_ready(jax.jit(forward)(*(jax.device_put(x, device) for x in (q, k, v))))
        out_cp, lse_cp = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
        np.testing.assert_array_equal(np.asarray(out).view(np.uint16), cupy.asnumpy(out_cp).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(lse), cupy.asnumpy(lse_cp))


@pytest.mark.parametrize("case", ["varlen", "paged-128", "paged-48", "contiguous-cache"])
def test_varlen_and_kv_cache_calls_take_the_numpy_paths_copies(case):
    """The Hopper forward's varlen and KV-cache calls through JAX: maps over the whole packed array, cache or page
    pool (TmaMaps' extents from the traced shapes), the same launch (TMA loads counted alike; a page of 48 keys, which
    no 128-key tile divides, has no maps on either path) and the NumPy path's bits."""
    rng = np.random.default_rng(5)
    h, hk, d = 4, 2, 64
    with sim.targeting("sm_90"), sim.checking("profile"):
        if case == "varlen":
            lengths_q, lengths_k = [5, 0, 70, 1], [33, 9, 150, 2]
            cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
            cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
            q = rng.standard_normal((cu_q[-1], h, d)).astype(np.float16)
            k, v = (rng.standard_normal((cu_k[-1], hk, d)).astype(np.float16) for _ in range(2))
            sizes = dict(max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), causal=True, return_lse=True)
            call_np = lambda: cuflash.attention_varlen(q, k, v, cu_q, cu_k, **sizes)  # noqa: E731
            call_jax = jax.jit(lambda q, k, v: cfj.attention_varlen(q, k, v, cu_q, cu_k, **sizes))
            args = (q, k, v)
            expect_tma = True
        else:
            page = {"paged-128": 128, "paged-48": 48, "contiguous-cache": None}[case]
            batch, capacity = 2, 384
            q = rng.standard_normal((batch, 3, h, d)).astype(np.float16)
            if page is None:
                shape, table = (batch, capacity, hk, d), None
            else:
                per = capacity // page
                table = rng.permutation(batch * per + 1)[:batch * per].reshape(batch, per).astype(np.int32)
                shape = (batch * per + 1, page, hk, d)
            k_cache, v_cache = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
            lengths = np.array([200, 0], np.int32)
            call_np = lambda: cuflash.attention_with_kvcache(  # noqa: E731
                q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, return_lse=True)
            call_jax = jax.jit(lambda q, kc, vc: cfj.attention_with_kvcache(
                q, kc, vc, cache_seqlens=lengths, block_table=table, return_lse=True))
            args = (q, k_cache, v_cache)
            expect_tma = page != 48
        with record_launches() as jax_launches:
            out, lse = jax.block_until_ready(call_jax(*args))[:2]  # a cache call also gives the caches
        with sim.record() as numpy_launches:
            out_np, lse_np = call_np()
    forwards = [launch for launch in jax_launches if launch.kernel.startswith("cuflash::fa3_forward_kernel")]
    assert forwards, [launch.kernel for launch in jax_launches]
    assert jax_launches == numpy_launches.launches
    assert all((tma_loads(launch) > 0) == expect_tma for launch in forwards)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), out_np.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), lse_np)


def test_varlen_grad_runs_the_hopper_backward_with_the_numpy_paths_bits():
    """jax.grad of a varlen call: the Hopper backward (its maps over the packed q, k, v and dout; ragged last blocks
    by loads), the NumPy path's launches and bits."""
    rng = np.random.default_rng(8)
    lengths_q, lengths_k = [70, 0, 33], [140, 9, 60]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 2, 64)).astype(np.float16) for _ in range(2))
    weights = rng.standard_normal(q.shape).astype(np.float16)
    sizes = dict(max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), causal=True)

    def loss(q, k, v):
        return jnp.sum(cfj.attention_varlen(q, k, v, cu_q, cu_k, **sizes).astype(jnp.float32) * weights)

    with sim.targeting("sm_90"):
        with record_launches() as jax_launches:
            grads = jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
        with sim.record() as numpy_launches:
            out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **sizes)
            want = cuflash.attention_varlen_backward(weights, q, k, v, out, lse, cu_q, cu_k, **sizes)
    assert any(launch.kernel.startswith("cuflash::fa3_backward_kernel") for launch in jax_launches)
    assert [launch.kernel for launch in jax_launches] == [launch.kernel for launch in numpy_launches.launches]
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, want):
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint16), theirs.view(np.uint16), err_msg=name)
