"""Eager flex calls trace a Python mod once per function and structure (cuflash.flex._trace_cache), read the arrays it
captures anew at every call, and trace again where the key cannot say what the trace depends on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash.flex import _mod, _trace_cache
from cuflash.flex._api import _flex_mod
from cuflash.testing import random_inputs


@pytest.fixture
def traces(monkeypatch):
    """The number of times a mod (or its derivative) is traced with jax.make_jaxpr through cuflash.flex._trace."""
    _trace_cache.clear()
    count = {"n": 0}
    real = _mod.trace

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_mod, "trace", counting)
    yield count
    _trace_cache.clear()


table = jnp.arange(8, dtype=jnp.float32)  # replaced by the tests below (a module global the mods read)


def global_bias(score, b, h, q_idx, kv_idx):
    return score + table[(q_idx - kv_idx) % 8]


def test_a_mod_is_traced_once_and_its_captured_arrays_are_read_anew(traces):
    global table
    first = _flex_mod(global_bias, "score")
    assert traces["n"] == 2  # the mod and its derivative in score
    make_jaxpr_calls = []
    real_make_jaxpr = jax.make_jaxpr
    jax.make_jaxpr = lambda *a, **k: make_jaxpr_calls.append(a) or real_make_jaxpr(*a, **k)
    try:
        again = _flex_mod(global_bias, "score")
    finally:
        jax.make_jaxpr = real_make_jaxpr
    assert make_jaxpr_calls == []  # a hit runs no JAX trace at all
    assert traces["n"] == 2 and again.source == first.source and again.side_values[0] is table
    old, table = table, jnp.ones(8, jnp.float32)
    try:
        replaced = _flex_mod(global_bias, "score")
        assert traces["n"] == 2 and replaced.side_values[0] is table and replaced.cache_key == first.cache_key
        table = jnp.ones(9, jnp.float32)  # a new shape: a new structure
        assert _flex_mod(global_bias, "score").sides[0].shape == (9,) and traces["n"] == 4
    finally:
        table = old

    scale = 2.0

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale

    first = _flex_mod(scaled, "score")
    assert _flex_mod(scaled, "score") is not None and traces["n"] == 6
    scale = 3.0  # a captured Python number is a constant of the code: traced anew, other source
    assert _flex_mod(scaled, "score").source != first.source and traces["n"] == 8


def test_a_numpy_array_changed_in_place_is_traced_anew_with_the_same_kernel(traces):
    """A NumPy array becomes a constant of the trace (jnp.asarray copies it): it is keyed by its bytes, so a change
    in place traces again, and the new FlexMod reads the new values under the same cache_key (the compiled kernel
    is reused)."""
    offsets = np.arange(6, dtype=np.float32)

    def numpy_bias(score, b, h, q_idx, kv_idx):
        return score + jnp.asarray(offsets)[h]

    first = _flex_mod(numpy_bias, "score")
    assert _flex_mod(numpy_bias, "score").cache_key == first.cache_key and traces["n"] == 2
    offsets[3] = 100.0
    changed = _flex_mod(numpy_bias, "score")
    assert traces["n"] == 4 and changed.cache_key == first.cache_key
    assert np.asarray(changed.side_values[0])[3] == 100.0


def test_mods_the_key_cannot_describe_are_traced_at_every_call(traces):
    class Holder:
        bias = jnp.zeros(4, jnp.float32)

    holder = Holder()

    def through_an_object(score, b, h, q_idx, kv_idx):
        return score + holder.bias[h]

    offsets = jnp.asarray([1, 2, 3], jnp.int32)

    def value_in_python(score, b, h, q_idx, kv_idx):  # reads a captured value in Python: part of the code
        return score + float(np.asarray(offsets)[0])

    def computed_outside_the_trace(score, b, h, q_idx, kv_idx):  # NumPy computes a new constant from offsets
        return score + jnp.asarray(np.asarray(offsets) * 2)[h].astype(jnp.float32)

    for fn in (through_an_object, value_in_python, computed_outside_the_trace):
        for call in range(3):
            before = traces["n"]
            _flex_mod(fn, "score")
            assert traces["n"] == before + 2, (fn.__name__, call)
    before = _flex_mod(value_in_python, "score").source
    offsets = jnp.asarray([5, 2, 3], jnp.int32)
    assert _flex_mod(value_in_python, "score").source != before


def test_a_cached_mod_gives_the_result_of_its_new_captured_value():
    """The kernel runs the cached trace with the new side array: each call matches the reference of the value
    captured at that call (float32, SIMT, odd lengths), and the mod is traced only at the first call."""
    q, k, v, _ = random_inputs((1, 19, 23, 2, 1, 24), "float32", seed=21)
    rng = np.random.default_rng(22)
    bias = jnp.asarray(rng.standard_normal((2, 19 + 23)).astype(np.float32))

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 23]

    _trace_cache.clear()
    counted = []
    real = _mod.trace

    def counting(*args, **kwargs):
        counted.append(args[0])
        return real(*args, **kwargs)

    _mod.trace = counting
    try:
        outs = []
        for step in range(3):
            out = cuflash.flex_attention(q, k, v, score_mod=relative_bias)
            ref = tol.forward_references(q, k, v, score_mod=relative_bias)
            tol.check_close(f"out at step {step}", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
            outs.append(out)
            bias = bias * 2.0 + 1.0  # a new value, captured by reference
    finally:
        _mod.trace = real
        _trace_cache.clear()
    assert len(counted) == 2
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
