"""cuflash.jax.attention on the CPU: the whole XLA custom-call path, kernels run by the simulator.

Gradients are judged with the project's FlashAttention rule (cuflash._tolerance.check_close): the float64
reference (cuflash.reference) is the truth, and jax.nn.dot_product_attention run in the input precision, with
an explicit bottom-right causal mask, is the yardstick: our error must be within 3x (2x forward) of its error.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash import _tolerance as T  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.kernels import catalog, plans  # noqa: E402
from cuflash.kernels.program import Problem  # noqa: E402
from cuflash.kernels.targets import target  # noqa: E402

SM80 = target("sm_80")
from cuflash.kernels.params import PARAMS_DTYPE, POINTER_FIELDS, field_layout  # noqa: E402

from cuflash.testing import numpy_dtype, random_qkv  # noqa: E402
from cuflash.mask import Mask  # noqa: E402

JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def bottom_right_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """(1, 1, seqlen_q, seqlen_k): query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    return (cols <= rows + seqlen_k - seqlen_q)[None, None]


def jax_nn_attention(q, k, v, causal: bool):
    mask = bottom_right_mask(q.shape[1], k.shape[1]) if causal else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


def weighted_sum(out, weights):
    return jnp.sum(out.astype(jnp.float32) * weights)


def inputs(seed, b, sq, sk, h, hk, d, dtype):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, b, sq, sk, h, hk, d, dtype)
    weights = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    return q, k, v, weights


# ---------------------------------------------------------------------------
# jit(grad(loss)) against jax.nn.dot_product_attention


HEADS = {"gqa": (4, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("seqlens", [(9, 17), (13, 13)])
def test_jit_grad_matches_jax_nn(dtype, causal, heads, seqlens):
    nheads, nheads_k = HEADS[heads]
    sq, sk = seqlens
    seed = zlib.crc32(repr((dtype, causal, heads, seqlens)).encode())
    q, k, v, weights = inputs(seed, 2, sq, sk, nheads, nheads_k, 32, dtype)

    def loss(q, k, v):
        return weighted_sum(cfj.attention(q, k, v, causal=causal), weights)

    def loss_jax_nn(q, k, v):
        return weighted_sum(jax_nn_attention(q, k, v, causal), weights)

    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    yardstick = jax.jit(jax.grad(loss_jax_nn, argnums=(0, 1, 2)))(jq, jk, jv)
    truth = reference.attention_backward_reference(weights, q, k, v, causal=causal)
    for name, ours, theirs, exact in zip(("dq", "dk", "dv"), grads, yardstick, truth):
        assert ours.dtype == jnp.dtype(JAX_DTYPES[dtype])
        T.check_close(name, np.asarray(ours), exact, np.asarray(theirs), T.BACKWARD_FACTOR, atol=1e-5 if causal else 0)

    out64, _ = reference.attention_reference(q, k, v, causal=causal)
    out, out_jax_nn = jax.jit(lambda q, k, v: (cfj.attention(q, k, v, causal=causal), jax_nn_attention(q, k, v, causal)))(
        jq, jk, jv)
    T.check_close("out", np.asarray(out), out64, np.asarray(out_jax_nn), T.FORWARD_FACTOR)
    # value_and_grad's value is the loss of that very output.
    np.testing.assert_allclose(float(value), float(np.sum(np.asarray(out).astype(np.float64) * weights)), rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["standard", "fa1", "fa2"])
def test_every_algorithm_runs_through_the_custom_call(algorithm):
    if algorithm not in catalog.algorithms():
        pytest.skip(f"{algorithm} is not implemented in this build")
    q, k, v, weights = inputs(7, 1, 11, 11, 2, 1, 20, "float32")  # head dim 20 runs on a wider instance
    loss = lambda q, k, v: weighted_sum(cfj.attention(q, k, v, causal=True, algorithm=algorithm), weights)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    yardstick = jax.grad(lambda q, k, v: weighted_sum(jax_nn_attention(q, k, v, True), weights), argnums=(0, 1, 2))(
        q, k, v
    )
    truth = reference.attention_backward_reference(weights, q, k, v, causal=True)
    for name, ours, theirs, exact in zip(("dq", "dk", "dv"), grads, yardstick, truth):
        T.check_close(name, np.asarray(ours), exact, np.asarray(theirs), T.BACKWARD_FACTOR, atol=1e-5)


def test_matches_the_cupy_numpy_api_bitwise():
    """The FFI path and cuflash.attention run the same Program with the same params: same bits."""
    q, k, v, _ = inputs(3, 2, 10, 12, 4, 2, 32, "bfloat16")
    out, lse = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True, return_lse=True))(q, k, v)
    out_np, lse_np = cuflash.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), out_np.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), lse_np)


@pytest.mark.parametrize("algorithm", ["standard", "fa2"])
def test_same_launches_and_traffic_as_the_numpy_path(algorithm):
    """The custom call runs the very Program cuflash.attention runs: same kernels, shapes, counted bytes."""
    from cuflash import sim
    from cuflash.jax._ffi import record_launches

    q, k, v, weights = inputs(13, 2, 10, 19, 4, 2, 32, "float16")
    with record_launches() as jax_launches:
        out, vjp = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, causal=True, algorithm=algorithm), q, k, v)
        jax.block_until_ready(vjp(jnp.asarray(weights, jnp.float16)))
    with sim.record() as numpy_launches:
        out_np, lse_np = cuflash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
        cuflash.attention_backward(weights.astype(np.float16), q, k, v, out_np, lse_np, causal=True,
                                   algorithm=algorithm)
    assert jax_launches == numpy_launches.launches
    assert len(jax_launches) > 2 and all(r.global_bytes_read > 0 for r in jax_launches)


def test_gradient_through_lse_is_exact():
    """return_lse=True: d(loss)/d(q, k) through lse is exact: the backward takes the lse's cotangent into D."""
    q, k, v, weights = inputs(11, 2, 9, 14, 4, 2, 32, "float32")
    lse_weights = np.random.default_rng(12).standard_normal((2, 4, 9)).astype(np.float32)

    def loss(q, k, v):
        out, lse = cfj.attention(q, k, v, causal=True, return_lse=True)
        return weighted_sum(out, weights) + jnp.sum(lse * lse_weights)

    def loss_jax(q, k, v):
        g = q.shape[2] // k.shape[2]
        kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(q.shape[-1])
        scores = jnp.where(bottom_right_mask(q.shape[1], k.shape[1]), scores, -jnp.inf)
        lse = jax.nn.logsumexp(scores, axis=-1)
        return weighted_sum(jax_nn_attention(q, k, v, True), weights) + jnp.sum(lse * lse_weights)

    ours = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.grad(loss_jax, argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)
    # Only lse differentiated: the backward runs with a zero dout (symbolic zero cotangent for out), dv is zero.
    only_lse = jax.grad(lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True, return_lse=True)[1]), (0, 1, 2))
    assert not np.any(np.asarray(only_lse(q, k, v)[2]))


def test_rows_that_see_no_key_and_empty_keys():
    """Causal with seqlen_q > seqlen_k: leading rows see no key (out 0, lse -inf, zero gradients)."""
    q, k, v, weights = inputs(5, 1, 12, 5, 2, 2, 32, "float32")
    out, lse = cfj.attention(q, k, v, causal=True, return_lse=True)  # eager: no jit
    out64, lse64 = reference.attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out), out64, atol=2e-6)
    assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(lse64)) and np.isneginf(lse64).any()
    grads = jax.grad(lambda q, k, v: weighted_sum(cfj.attention(q, k, v, causal=True), weights), (0, 1, 2))(q, k, v)
    truth = reference.attention_backward_reference(weights, q, k, v, causal=True)
    for g, t in zip(grads, truth):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), t, atol=1e-5)

    empty_k = np.zeros((1, 0, 2, 32), np.float32)
    out, lse = jax.jit(lambda q, k, v: cfj.attention(q, k, v, return_lse=True))(q, empty_k, empty_k)
    assert not np.any(np.asarray(out)) and np.all(np.isneginf(np.asarray(lse)))
    dq = jax.grad(lambda q: jnp.sum(cfj.attention(q, empty_k, empty_k)))(jnp.asarray(q))
    assert dq.shape == q.shape and not np.any(np.asarray(dq))


def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v, weights = inputs(9, 1, 16, 150, 2, 1, 32, "float32")  # several K/V blocks accumulate into dq
    grad = jax.jit(jax.grad(lambda q, k, v: weighted_sum(
        cfj.attention(q, k, v, deterministic=True), weights), (0, 1, 2)))
    first, second = grad(q, k, v), grad(q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------
# vmap: the mapped axis is folded into batch, one launch per program


def test_vmap_folds_the_mapped_axis_into_batch():
    rng = np.random.default_rng(21)
    mapped, b, sq, sk, h, hk, d = 3, 2, 7, 9, 4, 2, 32
    q = rng.standard_normal((mapped, b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((mapped, b, sk, hk, d)).astype(np.float32)
    v = rng.standard_normal((mapped, b, sk, hk, d)).astype(np.float32)
    weights = rng.standard_normal((mapped, b, sq, h, d)).astype(np.float32)

    def loss(q, k, v, w):
        return weighted_sum(cfj.attention(q, k, v, causal=True), w)

    batched = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))
    values, grads = batched(q, k, v, weights)
    for i in range(mapped):
        value_i, grads_i = jax.value_and_grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i], weights[i])
        np.testing.assert_allclose(float(values[i]), float(value_i), rtol=1e-6)
        for g, g_i in zip(grads, grads_i):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(g_i), rtol=1e-6, atol=1e-6)

    # One custom call per direction, each launching over mapped * batch in grid.z.
    hlo = batched.lower(q, k, v, weights).as_text()
    calls = re.findall(r"stablehlo\.custom_call @cuflash_program\(.*", hlo)
    assert len(calls) == 2, calls
    for call in calls:
        grids = _grid_of(call)
        assert grids and all(z == mapped * b for z in grids[2::3]), (grids, call)

    # Executed: the forward program is one launch covering every mapped element.
    from cuflash.jax._ffi import record_launches

    with record_launches() as launches:
        jax.block_until_ready(jax.jit(jax.vmap(lambda q, k, v: cfj.attention(q, k, v, causal=True)))(q, k, v))
    assert len(launches) == 1 and launches[0].grid[2] == mapped * b, launches

    # Unmapped k, v (shared by every mapped element) are broadcast, then folded the same way.
    out = jax.vmap(lambda q: cfj.attention(q, k[0], v[0]))(q)
    for i in range(mapped):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(cfj.attention(q[i], k[0], v[0])))


def _grid_of(custom_call_line: str) -> list[int]:
    match = re.search(r"grid = dense<([^>]*)>", custom_call_line)
    assert match, custom_call_line
    text = match.group(1).strip("[]")
    return [int(x) for x in text.split(",")] if "," in text else [int(text)]


# ---------------------------------------------------------------------------
# The lowered HLO


def test_lowered_hlo_holds_the_custom_call_and_no_address():
    q, k, v, _ = inputs(1, 2, 8, 8, 2, 2, 32, "float16")
    lowered = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True, softmax_scale=0.25)).lower(q, k, v)
    hlo = lowered.as_text()
    (call,) = re.findall(r"stablehlo\.custom_call @cuflash_program\(.*", hlo)
    program = plans.forward_program(
        "fa2", Problem(dtype="float16", batch=2, seqlen_q=8, seqlen_k=8, nheads=2, nheads_k=2, headdim=32, mask=Mask.causal()),
        SM80,
    )
    assert f'kernels = "{";".join(p.kernel.name_expr for p in program.launches)}"' in call
    assert 'bindings = "q,k,v,out,lse' in call
    # The params attribute: AttentionParams bytes with every pointer field zero and the scale packed.
    match = re.search(r'params = dense<"0x([0-9A-F]+)">', call)
    assert match, call
    params = np.frombuffer(bytes.fromhex(match.group(1)), dtype=PARAMS_DTYPE)[0]
    assert all(int(params[name]) == 0 for name in POINTER_FIELDS)
    assert params["softmax_scale"] == np.float32(0.25) and (params["window_left"], params["window_right"]) == (-1, 0)
    assert tuple(params["q_stride"]) == (8 * 2 * 32, 2 * 32, 32)
    # And the compiled executable still holds it.
    assert "cuflash_program" in lowered.compile().as_text()


def test_handler_layout_matches_the_python_mirror():
    from cuflash.jax import _ffi

    assert _ffi.params_size() == PARAMS_DTYPE.itemsize
    layout = field_layout()
    for name in POINTER_FIELDS:
        assert _ffi.pointer_field_offset(name) == layout[name][0], name
    assert _ffi.pointer_field_offset("no_such_field") == -1


# ---------------------------------------------------------------------------
# Validation: the checks and messages of cuflash.attention, at trace time


def _error_of(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "mutate, kwargs",
    [
        (lambda q, k, v: (q[0], k, v), {}),
        (lambda q, k, v: (q, k[:, :3], v), {}),
        (lambda q, k, v: (q, k[:1], v[:1]), {}),
        (lambda q, k, v: (q[..., :8], k, v), {}),
        (lambda q, k, v: (q[:, :, :3], k, v), {}),
        (lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), {}),
        (lambda q, k, v: (q, k.astype(np.float16), v.astype(np.float16)), {}),
        (lambda q, k, v: (q, k, v), {"softmax_scale": -1.0}),
        (lambda q, k, v: (q, k, v), {"softmax_scale": "big"}),
        (lambda q, k, v: (q, k, v), {"causal": 1}),
        (lambda q, k, v: (q, k, v), {"return_lse": None}),
        (lambda q, k, v: (q, k, v), {"algorithm": "fa3"}),
    ],
)
def test_validation_matches_cuflash_attention(mutate, kwargs):
    q, k, v = (np.zeros(s, np.float32) for s in ((2, 5, 4, 16), (2, 7, 2, 16), (2, 7, 2, 16)))
    q, k, v = mutate(q, k, v)
    expected = _error_of(lambda: cuflash.attention(q, k, v, **kwargs))
    # Eager on JAX arrays, and at trace time on abstract values inside jit: same type, same message.
    jq, jk, jv = (jnp.asarray(x) if x.dtype != np.float64 else x for x in (q, k, v))
    assert _error_of(lambda: cfj.attention(jq, jk, jv, **kwargs)) == expected
    if all(x.dtype != np.float64 for x in (q, k, v)):
        assert _error_of(lambda: jax.jit(lambda q, k, v: cfj.attention(q, k, v, **kwargs))(jq, jk, jv)) == expected


def test_non_array_argument():
    with pytest.raises(TypeError, match="k must be a JAX or NumPy array, got list"):
        cfj.attention(jnp.zeros((1, 2, 1, 8)), [[0.0]], jnp.zeros((1, 2, 1, 8)))


# ---------------------------------------------------------------------------
# Handler errors: an ffi::Error with a clear message, raised as JaxRuntimeError


def _raw_program_call(q, k, v, **overrides):
    """The forward custom call with hand-made attributes, to reach the handler's checks directly."""
    from cuflash.jax import _ffi, _primitives

    problem = Problem(dtype="float32", batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                            nheads=q.shape[2], nheads_k=k.shape[2], headdim=q.shape[3])
    config = _primitives.CallConfig("fa2", problem, 0.5)
    program = _primitives.program_for("forward", config)
    launches = [p for p in program.launches if not p.is_empty]
    _ffi.register_targets()
    _primitives.register_cpu_kernels([p.kernel for p in launches])
    attributes = _primitives.custom_call_attributes("forward", config, program, launches)
    attributes.update(overrides)
    lse_shape = (problem.batch, problem.nheads, problem.seqlen_q)
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, np.float32)]
    results += [jax.ShapeDtypeStruct(s.shape, np.float32) for s in program.scratch]
    return jax.ffi.ffi_call(_ffi.TARGET_NAME, results)(q, k, v, **attributes)


def test_handler_reports_errors_clearly():
    from cuflash.jax import _ffi

    q, k, v, _ = inputs(2, 1, 8, 8, 2, 2, 32, "float32")
    good = _raw_program_call(q, k, v)
    np.testing.assert_allclose(np.asarray(good[0]), cuflash.attention(q, k, v, softmax_scale=0.5), rtol=1e-6)

    cases = {
        "params attribute has 8 bytes": dict(params=np.zeros(8, np.uint8)),
        "binding 'nonsense' is not an AttentionParams pointer field": dict(bindings="q,k,nonsense,out,lse"),
        "bindings name 4 buffers": dict(bindings="q,k,v,out"),
        "addresses must not be baked into the HLO": dict(
            params=np.frombuffer(_with_pointer(good_params(q, k, v), "q", 0x1000).tobytes(), np.uint8).copy()),
        "has a grid or block dimension <= 0": dict(grid=np.zeros(3, np.int32)),
    }
    for words, override in cases.items():
        with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(words)):
            jax.block_until_ready(_raw_program_call(q, k, v, **override))

    # A kernel the registry does not know: the error names it.
    name = plans.forward_program("fa2", Problem("float32", 1, 8, 8, 2, 2, 32), SM80).launches[0].kernel.name_expr
    attrs = dict(kernels="cuflash::not_a_kernel<float>")
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("no simulator kernel registered for "
                                                                    "cuflash::not_a_kernel<float>")):
        jax.block_until_ready(_raw_program_call(q, k, v, **attrs))
    assert _ffi.sim_kernel_registered(name)

    # A kernel error inside the simulator (too little shared memory: the kernel traps) becomes the message.
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(name)) as info:
        jax.block_until_ready(_raw_program_call(q, k, v, smem=np.asarray([16], np.int32)))
    assert "simulator" in str(info.value)

    # The extent check: params describing a bigger q than the buffer XLA passes.
    bigger = _raw_params(q, k, v, seqlen_q=9)
    with pytest.raises(jax.errors.JaxRuntimeError, match="q needs .* bytes .* but its buffer has"):
        jax.block_until_ready(_raw_program_call(q, k, v, params=bigger))


def good_params(q, k, v):
    from cuflash.jax import _primitives

    problem = Problem("float32", q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])
    config = _primitives.CallConfig("fa2", problem, 0.5)
    program = _primitives.program_for("forward", config)
    attrs = _primitives.custom_call_attributes("forward", config, program, list(program.launches))
    return np.frombuffer(attrs["params"].tobytes(), dtype=PARAMS_DTYPE)[0].copy()


def _with_pointer(params, name, address):
    params = params.copy()
    params[name] = address
    return params


def _raw_params(q, k, v, **fields):
    params = good_params(q, k, v)
    for name, value in fields.items():
        params[name] = value
    return np.frombuffer(params.tobytes(), np.uint8).copy()


def test_unregistered_kernel_at_run_time_is_resolved_or_named():
    """A process running an executable it did not lower (a cached or deserialized one): the handler asks the
    resolver cuflash.jax installed at import, which registers the kernel; when nothing can, a clear error naming
    the kernel, not a crash."""
    from cuflash.jax import _ffi, _primitives

    q, k, v, _ = inputs(4, 1, 6, 6, 1, 1, 32, "float32")
    f = jax.jit(lambda q, k, v: cfj.attention(q, k, v))
    compiled = f.lower(q, k, v).compile()  # lowering registers the kernel
    name = plans.forward_program("fa2", Problem("float32", 1, 6, 6, 1, 1, 32), SM80).launches[0].kernel.name_expr

    def forget():
        _ffi.unregister_sim_kernel(name)
        _primitives._sim_registered.clear()

    forget()
    np.testing.assert_allclose(np.asarray(compiled(q, k, v)), cuflash.attention(q, k, v), rtol=1e-6)
    assert _ffi.sim_kernel_registered(name)  # the resolver registered it on first execution

    forget()
    _ffi.set_resolver(lambda name_expr, target: False)
    try:
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                           match=re.escape(f"no simulator kernel registered for {name}")):
            jax.block_until_ready(compiled(q, k, v))
    finally:
        _ffi.set_resolver(_primitives.resolve_kernel)
    np.testing.assert_allclose(np.asarray(compiled(q, k, v)), cuflash.attention(q, k, v), rtol=1e-6)


def test_vmap_splits_the_mapped_axis_when_the_folded_batch_exceeds_the_grid_limit(monkeypatch):
    """grid.z holds the batch (<= 65535 on CUDA): a mapped axis folding past it is split into chunks that fit."""
    from cuflash import _validation

    monkeypatch.setattr(_validation, "MAX_GRID_YZ", 4)  # batch 2: chunks of 2 mapped elements
    rng = np.random.default_rng(31)
    q = rng.standard_normal((5, 2, 6, 2, 32)).astype(np.float32)
    k = rng.standard_normal((5, 2, 8, 1, 32)).astype(np.float32)
    f = jax.jit(jax.vmap(lambda q, k: cfj.attention(q, k, k)))
    calls = re.findall(r"stablehlo\.custom_call @cuflash_program\(.*", f.lower(q, k).as_text())
    assert sorted(_grid_of(c)[2] for c in calls) == [2, 4, 4]  # 2 + 2 + 1 mapped elements, times batch 2
    out = f(q, k)
    for i in range(5):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(cfj.attention(q[i], k[i], k[i])))


@pytest.mark.parametrize("alibi", [None, "heads", "batch_heads-mapped"])
def test_vmap_over_q_with_shared_k_v_folds_into_heads_without_copying_k_v(alibi):
    """vmap over q alone (k and v shared): the mapped axis joins the query heads (whole GQA groups), so the forward
    is one call on k and v as they are: no broadcast of k or v in the HLO, and bitwise a loop of calls."""
    rng = np.random.default_rng(41)
    mapped, b, sq, sk, h, hk, d = 3, 2, 9, 14, 4, 2, 24
    q = rng.standard_normal((mapped, b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    slopes = {None: None, "heads": rng.uniform(0.1, 0.5, (h,)).astype(np.float32),
              "batch_heads-mapped": rng.uniform(0.1, 0.5, (mapped, b, h)).astype(np.float32)}[alibi]
    slopes_axis = 0 if alibi == "batch_heads-mapped" else None

    def attend(q, slopes, k, v):
        return cfj.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)

    f = jax.jit(jax.vmap(attend, in_axes=(0, slopes_axis, None, None)))
    out, lse = f(q, slopes, k, v)
    for i in range(mapped):
        out_i, lse_i = attend(q[i], None if slopes is None else slopes[i] if slopes_axis == 0 else slopes, k, v)
        assert np.array_equal(np.asarray(out[i]), np.asarray(out_i))
        assert np.array_equal(np.asarray(lse[i]), np.asarray(lse_i))
    hlo = f.lower(q, slopes, k, v).as_text()
    calls = re.findall(r"stablehlo\.custom_call @cuflash_program\(.*", hlo)
    assert len(calls) == 1 and all(y == h * mapped for y in _grid_of(calls[0])[1::3]), calls
    kv_batched = f"tensor<{mapped}x{b}x{sk}x{hk}x{d}xf32>"
    assert kv_batched not in hlo, "k or v was broadcast over the mapped axis"


def test_checking_mode_reaches_an_already_compiled_function():
    """[jax-scale] 4: sim.checking() switches the kernels an already-jitted function runs (the handler forgets
    its registrations on every mode change and resolves them again in the current mode)."""
    from cuflash import sim
    from cuflash.jax import _primitives

    q = np.random.default_rng(7).standard_normal((1, 21, 2, 24)).astype(np.float32)
    f = jax.jit(lambda q: cfj.attention(q, q, q, causal=True))
    want = np.asarray(f(q))
    outside = sim.current_mode()
    problem = Problem("float32", 1, 21, 21, 2, 2, 24, mask=Mask(-1, 0))
    instance = plans.forward_program("fa2", problem, SM80).launches[0].kernel
    assert (outside, instance) in _primitives._sim_registered
    with sim.checking("race"):
        got = np.asarray(f(q))
        assert set(_primitives._sim_registered) == {("race", instance)}
    assert np.array_equal(got, want)
    assert np.array_equal(np.asarray(f(q)), want)
    assert set(_primitives._sim_registered) == {(outside, instance)}


def test_packed_twins_equal_the_numpy_packed_calls():
    """cuflash.jax.attention_qkvpacked / attention_kvpacked: out and the gradient in the packed layout, bit for bit
    the NumPy packed functions' (deterministic dq)."""
    rng = np.random.default_rng(9)
    qkv = rng.standard_normal((1, 19, 3, 2, 24)).astype(np.float32)
    dout = rng.standard_normal((1, 19, 2, 24)).astype(np.float32)
    options = dict(causal=True, deterministic=True)

    def loss(qkv):
        out = cfj.attention_qkvpacked(qkv, **options)
        return jnp.sum(out * dout), out

    (_, out), dqkv = jax.jit(jax.value_and_grad(loss, has_aux=True))(qkv)
    want_out, want_lse = cuflash.attention_qkvpacked(qkv, causal=True, return_lse=True)
    assert np.array_equal(np.asarray(out), want_out)
    assert np.array_equal(np.asarray(dqkv), cuflash.attention_qkvpacked_backward(dout, qkv, want_out, want_lse,
                                                                                **options))
    q, kv = qkv[:, :, 0], qkv[:, :, 1:]
    assert np.array_equal(np.asarray(cfj.attention_kvpacked(q, kv, causal=True)), want_out)
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        cfj.attention_kvpacked(q, qkv)
