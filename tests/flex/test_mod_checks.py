"""cuflash.flex's checks and cache keys, without compiling: what a FlexMod is keyed by, where its side
arrays come from (jit tracers too), and every error a mod raises before any kernel runs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuflash import flex

BIAS = jnp.arange(3 * 17, dtype=jnp.float32).reshape(3, 17)


def _bias_mod(bias):
    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 8]
    return mod


# ---- cache keys and side arrays ----------------------------------------------------------------

def test_cache_key_ignores_captured_values_and_the_function_name():
    one, two = flex.trace_score_mod(_bias_mod(BIAS)), flex.trace_score_mod(_bias_mod(BIAS * 2 + 1))

    def renamed(s, b, h, q, kv):
        return s + BIAS[h, q - kv + 8]

    three = flex.trace_score_mod(renamed)
    assert one.cache_key == two.cache_key == three.cache_key
    assert one.source == two.source and one.struct_name in one.source
    assert one.side_values[0] is BIAS and two.side_values[0] is not BIAS


@pytest.mark.parametrize("other", [
    BIAS[:, :16],                     # another shape
    BIAS.astype(jnp.bfloat16),        # another dtype
])
def test_cache_key_changes_with_side_shape_and_dtype(other):
    assert flex.trace_score_mod(_bias_mod(BIAS)).cache_key != flex.trace_score_mod(_bias_mod(other)).cache_key


def test_cache_key_changes_with_structure():
    def doubled(score, b, h, q_idx, kv_idx):
        return score + 2 * BIAS[h, q_idx - kv_idx + 8]

    assert flex.trace_score_mod(_bias_mod(BIAS)).cache_key != flex.trace_score_mod(doubled).cache_key


def test_mod_traced_under_jit_takes_the_traced_array_as_its_side():
    seen = {}

    @jax.jit
    def step(bias):
        mod = flex.trace_score_mod(_bias_mod(bias))
        seen["key"], seen["side"] = mod.cache_key, mod.side_values[0]
        return bias

    step(BIAS)
    assert seen["key"] == flex.trace_score_mod(_bias_mod(BIAS)).cache_key
    assert isinstance(seen["side"], jax.core.Tracer)


def test_an_array_captured_twice_is_one_side_and_narrow_sides_travel_as_int32():
    allowed = jnp.asarray(np.random.RandomState(0).rand(4, 8) > 0.5)

    def mask(b, h, q_idx, kv_idx):
        return allowed[h, q_idx] & allowed[h, kv_idx]

    mod = flex.trace_mask_mod(mask)
    assert [(s.dtype, s.shape, s.stored_dtype) for s in mod.sides] == [("bool", (4, 8), "int32")]
    (stored,) = mod.kernel_side_values()
    assert stored.dtype == jnp.int32 and np.array_equal(np.asarray(stored), np.asarray(allowed).astype(np.int32))


def test_sides_struct_packs_descriptors_in_order():
    packed = flex.sides_struct([(1234, (3, 17), (17, 1)), (99, (5,), (2,))])
    assert packed.dtype.itemsize == 4 * 56  # flex_mod.cuh's Sides: 4 x (pointer, 4 strides, 4 extents)
    assert packed["arrays"][0]["data"] == 1234 and list(packed["arrays"][0]["strides"]) == [17, 1, 0, 0]
    assert list(packed["arrays"][1]["shape"]) == [5, 0, 0, 0]
    with pytest.raises(ValueError, match="at most 4"):
        flex.sides_struct([(0, (1,), (1,))] * 5)


# ---- errors: TypeErrors naming the mod and the primitive / argument --------------------------------

def arctan_mod(score, b, h, q_idx, kv_idx):
    return jnp.arctan(score)


def branching_mod(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score
    return score * 0


def int_index_mod(score, b, h, q_idx, kv_idx):
    return score + [1.0, 2.0][int(h)]


def int_result_mod(score, b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def vector_result_mod(score, b, h, q_idx, kv_idx):
    return jnp.stack([score, score])


def float_mask(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).astype(jnp.float32)


def four_argument_score_mod(score, b, h, q_idx):
    return score


def five_argument_mask(score, b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


INT16 = jnp.arange(8, dtype=jnp.int16)


def int16_side_mod(score, b, h, q_idx, kv_idx):
    return score + INT16[q_idx].astype(jnp.float32)


FIVE = [jnp.arange(4, dtype=jnp.float32) + k for k in range(5)]


def five_sides_mod(score, b, h, q_idx, kv_idx):
    return score + sum(a[h] for a in FIVE)


FIVE_DIMS = jnp.zeros((1, 1, 1, 1, 2), jnp.float32)


def five_dims_mod(score, b, h, q_idx, kv_idx):
    return score + FIVE_DIMS[0, 0, 0, 0, q_idx]


def row_sum_mod(score, b, h, q_idx, kv_idx):
    return score + BIAS[h].sum()


def computed_index_mod(score, b, h, q_idx, kv_idx):
    return score + (jnp.zeros(4) + score)[q_idx]


@pytest.mark.parametrize("trace, fn, words", [
    (flex.trace_score_mod, arctan_mod, ["atan", "not a primitive"]),
    (flex.trace_score_mod, branching_mod, ["control flow"]),
    (flex.trace_score_mod, int_index_mod, ["control flow", "int()"]),
    (flex.trace_score_mod, int_result_mod, ["returns int32[]", "float32 scalar"]),
    (flex.trace_score_mod, vector_result_mod, ["returns float32[2]"]),
    (flex.trace_mask_mod, float_mask, ["returns float32[]", "bool scalar"]),
    (flex.trace_score_mod, four_argument_score_mod, ["must take (score, b, h, q_idx, kv_idx)"]),
    (flex.trace_mask_mod, five_argument_mask, ["must take (b, h, q_idx, kv_idx)"]),
    (flex.trace_score_mod, int16_side_mod, ["captured array #0", "int16[8]"]),
    (flex.trace_score_mod, five_sides_mod, ["captures 5 arrays", "at most 4"]),
    (flex.trace_score_mod, five_dims_mod, ["captured array #0", "5 dims"]),
    (flex.trace_score_mod, row_sum_mod, ["reduce_sum", "not a primitive"]),
    (flex.trace_score_mod, computed_index_mod, ["dynamic_slice", "computed array"]),
], ids=lambda x: getattr(x, "__name__", None))
def test_mod_errors_name_the_mod_and_what_is_wrong(trace, fn, words):
    with pytest.raises(TypeError) as info:
        trace(fn)
    message = str(info.value)
    for word in [fn.__qualname__, *words]:
        assert word in message, f"{word!r} not in: {message}"


def test_float64_capture_under_x64_names_the_array():
    with jax.enable_x64(True):
        wide = jnp.asarray(np.arange(4.0))

        def wide_mod(score, b, h, q_idx, kv_idx):
            return score + wide[h]

        with pytest.raises(TypeError, match=r"wide_mod: captured array #0 is float64\[4\]"):
            flex.trace_score_mod(wide_mod)


def test_not_callable():
    with pytest.raises(TypeError, match="not callable"):
        flex.trace_mask_mod(3)


# ---- the expert form ---------------------------------------------------------------------------

def test_cuda_mod_declares_each_side_by_name():
    mod = flex.cuda_mod("return bias(h, kv_idx) > 0.f && doc(b, q_idx);",
                        {"bias": BIAS, "doc": jnp.ones((2, 8), bool)}, kind="mask", name="expert")
    assert "SideView<float, 2> bias{sides.arrays[0]}" in mod.source
    assert "SideView<bool, 2> doc{sides.arrays[1]}" in mod.source
    assert [s.name for s in mod.sides] == ["bias", "doc"] and not mod.has_dscore
    again = flex.cuda_mod("return bias(h, kv_idx) > 0.f && doc(b, q_idx);",
                          {"bias": BIAS + 1, "doc": jnp.zeros((2, 8), bool)}, kind="mask", name="other")
    assert again.cache_key == mod.cache_key


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(source="return score;", kind="both"), ValueError, "kind is 'score' or 'mask'"),
    (dict(source="", kind="score"), TypeError, "non-empty C++ function body"),
    (dict(source="return score; }", kind="score"), ValueError, "unbalanced braces"),
    (dict(source="return score;", dscore="return 1.f;", kind="mask"), ValueError, "dscore is for score mods"),
    (dict(source="return score;", sides={"q_idx": BIAS}), ValueError, "not a free C++ identifier"),
    (dict(source="return score;", sides={"for": BIAS}), ValueError, "not a free C++ identifier"),
    (dict(source="return score;", sides={"2x": BIAS}), ValueError, "not a free C++ identifier"),
    (dict(source="return score;", sides={"bias": [1.0, 2.0]}), TypeError, "is a list, not an array"),
    (dict(source="return score;", sides={"bias": INT16}), TypeError, "side array 'bias' is int16"),
    (dict(source="return score;", sides={f"s{k}": BIAS for k in range(5)}), ValueError, "at most 4"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_cuda_mod_validates_its_arguments(kwargs, error, words):
    source = kwargs.pop("source")
    with pytest.raises(error, match=re.escape(words)):
        flex.cuda_mod(source, **kwargs)


def test_flex_without_jax_says_what_to_install():
    import subprocess
    import sys

    code = ("import sys; sys.modules['jax'] = None\n"
            "import cuflash\n"
            "try:\n    cuflash.flex_attention\nexcept ImportError as e:\n    print('refused:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused: cuflash.flex" in result.stdout and "pip install 'cuflash[jax]'" in result.stdout, result
