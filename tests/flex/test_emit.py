"""cuflash.flex's tracing and emission: emitted mods against JAX, element by element.

Every mod below is traced, emitted into one generated .cu (tmp dir), built once for the simulator, and run
on a grid of (score, b, h, q_idx, kv_idx) that includes indices outside the captured arrays (negative ones
too: JAX wraps and clamps them, and so must the emitted code) and special scores (+-0, +-inf, NaN, huge).
The reference is JAX evaluating the same mod eagerly under jax.vmap on CPU (eagerly: one primitive at a
time, so XLA fuses no product and sum into an FMA the jaxpr does not have). Arithmetic, comparisons,
selects and indexing must agree bit for bit; transcendental functions within a few ulp (glibc's here,
CUDA's on a GPU, XLA's in the reference). The same .cu is compiled by NVRTC for sm_80.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuflash.sim as sim
from cuflash import flex
from cuflash.flex import _emit as flex_emit
from cuflash.kernels.params import SIDE_GRADS_DTYPE
from cuflash.kernels.program import KernelInstance

B, H, S, L = 2, 3, 8, 8
RNG = np.random.RandomState(0)

BIAS = jnp.asarray(RNG.randn(H, 2 * L + 1).astype(np.float32))
BIAS_BF16 = jnp.asarray(RNG.randn(H, 2 * L + 1)).astype(jnp.bfloat16)
SLOPES = jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)
SCALE_F16 = jnp.asarray(RNG.randn(H) * 3, jnp.float16)
OFFSETS_I32 = jnp.asarray(RNG.randint(-50, 50, size=(B, S)), jnp.int32)
DOC_IDS = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 3, 3]], jnp.int32)
PREFIX = jnp.asarray([3, 5], jnp.int32)
ALLOWED = jnp.asarray(RNG.rand(H, S) > 0.3)
CODES_I8 = jnp.asarray(RNG.randint(-128, 128, size=S), jnp.int8)
CODES_U8 = jnp.asarray(RNG.randint(0, 256, size=S), jnp.uint8)
CAP = 20.0


# ---- the mods ---------------------------------------------------------------------------------

def relative_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + L]


def relative_bias_bf16(score, b, h, q_idx, kv_idx):
    return score + BIAS_BF16[h, q_idx - kv_idx + L]


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * jnp.tanh(score / CAP)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * jnp.abs(q_idx - kv_idx)


def floor_div_mod(score, b, h, q_idx, kv_idx):
    d = q_idx - kv_idx
    return score + (d // 3) * 100 + d % 3 + (q_idx - 5) // -2 + kv_idx % -3 + (d * 7) // (kv_idx - 2) + d % (q_idx - 3)


def narrow_dtypes(score, b, h, q_idx, kv_idx):
    f16 = SCALE_F16[h] * 3 + SCALE_F16[h]  # float16 arithmetic: each result rounds to float16
    return score * f16.astype(jnp.float32) + OFFSETS_I32[b, q_idx]


def arithmetic(score, b, h, q_idx, kv_idx):
    picked = jnp.where(q_idx >= kv_idx, jnp.maximum(score, -5.0), jnp.minimum(score, 5.0))
    saturated = (score * 1e8).astype(jnp.int32).astype(jnp.float32)
    return (picked + jnp.sign(score) + jnp.floor(score / 3) + jnp.ceil(score / 7) + jnp.round(score / 2)
            + score ** 2 + score ** 3 - jnp.square(score) * 0.5 + saturated * 1e-9 + jnp.abs(score) ** -2
            + jax.lax.clamp(-1.0, score, 1.0) + jnp.maximum(score, 0.0) * jnp.minimum(score, -0.0)
            + jax.nn.relu(score) + score % 2.5 + score // 1.5 + jnp.where(jnp.isfinite(score), 1.0, 0.5))


def gather_modes(score, b, h, q_idx, kv_idx):
    filled = BIAS.at[h, q_idx * 3].get(mode="fill", fill_value=-7.0)
    clipped = jnp.take(BIAS[h], q_idx + kv_idx * 2, mode="clip")
    return score + filled + clipped


def exp_mod(score, b, h, q_idx, kv_idx):
    return jnp.exp(score / 8)


def exp2_mod(score, b, h, q_idx, kv_idx):
    return jnp.exp2(score / 8)


def log1p_mod(score, b, h, q_idx, kv_idx):
    return jnp.log1p(jnp.abs(score))


def log_mod(score, b, h, q_idx, kv_idx):
    return jnp.log(jnp.abs(score))


def expm1_mod(score, b, h, q_idx, kv_idx):
    return jnp.expm1(score / 8)


def sqrt_mod(score, b, h, q_idx, kv_idx):
    return jnp.sqrt(jnp.abs(score)) + jax.lax.rsqrt(jnp.abs(score) + 1)


def sigmoid_mod(score, b, h, q_idx, kv_idx):
    return jax.nn.sigmoid(score)


def pow_mod(score, b, h, q_idx, kv_idx):
    return jnp.abs(score) ** 1.5


def sin_mod(score, b, h, q_idx, kv_idx):
    return jnp.sin(jnp.clip(score, -100.0, 100.0))


def cos_mod(score, b, h, q_idx, kv_idx):
    return jnp.cos(jnp.clip(score, -100.0, 100.0))


def cbrt_mod(score, b, h, q_idx, kv_idx):
    return jnp.cbrt(score)


def atan2_mod(score, b, h, q_idx, kv_idx):
    return jnp.arctan2(score, (q_idx - kv_idx).astype(jnp.float32))


def document_mask(b, h, q_idx, kv_idx):
    return DOC_IDS[b, q_idx] == DOC_IDS[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < PREFIX[b])


def sliding_window_with_sinks(b, h, q_idx, kv_idx):
    window = (q_idx - kv_idx >= 0) & (q_idx - kv_idx < 3)
    return window | (kv_idx < 2)


def narrow_sides_mask(b, h, q_idx, kv_idx):
    # bool, int8 (wrapping product) and uint8 (wrapping difference, bitwise not) sides
    return ALLOWED[h, kv_idx] & ~((CODES_U8[kv_idx] - 3) > 200) | (CODES_I8[q_idx] * 2 < 0) & (~CODES_U8[q_idx] > 100)


def bias_and_slopes(bias, slopes):
    def mod(score, b, h, q_idx, kv_idx):
        filled = bias.at[h, q_idx * 3].get(mode="fill", fill_value=-7.0)
        clipped = jnp.take(bias[h], q_idx + kv_idx * 2, mode="clip")
        return jnp.tanh(score * slopes[h]) + bias[h, q_idx - kv_idx + L] * slopes[h] + filled + clipped
    return mod


def scaled_within_documents(scale, doc_ids):
    def mod(score, b, h, q_idx, kv_idx):
        return score * scale[h] + jnp.where(doc_ids[b, q_idx] == doc_ids[b, kv_idx], 0.0, scale[0] ** 2)
    return mod


# (factory, its arrays: the float ones get gradients)
GRAD_MODS = {"bias_and_slopes": (bias_and_slopes, (BIAS, SLOPES)),
             "scaled_within_documents": (scaled_within_documents, (SLOPES, DOC_IDS))}
EXACT_SCORE_MODS = [relative_bias, relative_bias_bf16, alibi, floor_div_mod, narrow_dtypes, arithmetic, gather_modes]
# (mod, ulp allowed for the value, for the derivative, absolute tolerance of the derivative). XLA's CPU
# tanh and expm1 are a few ulp from glibc's; derivatives that cancel (softcap's 1 - tanh^2, expm1's y + 1
# near y = -1) turn those into many ulp of a small difference: they get an absolute tolerance.
ULP_SCORE_MODS = [(softcap, 4, 4, 1e-6), (exp_mod, 2, 2, 0), (exp2_mod, 2, 2, 0), (log1p_mod, 2, 2, 0),
                  (log_mod, 2, 2, 0), (expm1_mod, 3, 3, 1e-6), (sqrt_mod, 2, 2, 0), (sigmoid_mod, 2, 4, 0),
                  (pow_mod, 2, 2, 0), (sin_mod, 2, 2, 0), (cos_mod, 2, 2, 0), (cbrt_mod, 2, 2, 0),
                  (atan2_mod, 2, 2, 0)]


def quarter_tanh(score, b, h, q_idx, kv_idx):
    return jnp.tanh(score * 0.25) * 3.0


def negative_cap(score, b, h, q_idx, kv_idx):
    return -4.0 * jnp.tanh(score / -4.0)


def softcap_plus_score(score, b, h, q_idx, kv_idx):
    return CAP * jnp.tanh(score / CAP) + score


def affine_tanh(score, b, h, q_idx, kv_idx):  # factors 4 and 2 apart, summed: both products are kept
    return (score * 0.5 - 1.0) * 4.0 + jnp.tanh(score * 0.5) * 2.0


def scaled_square(score, b, h, q_idx, kv_idx):  # a product of factored values: 3 (s / 4)^2 as (s s) 3 / 16; s is
    return (score / 4.0) * (score / 4.0) * 3.0 - score / 4.0  # then read otherwise than as one product (no fold)


# trace_score_mod(fast_math=True): (mod, ulp for the value and the derivative, their absolute tolerances, the factor
# its functions take the score times: flex._emit.fold_score_factor, 1 where the score is read otherwise than as one
# product by a constant). tanh_by_exp2's error is a few float32 ulps of 1 (kernel_utils.cuh), absolute: c tanh
# carries c times that where tanh is small (up to 5e4 ulp of the value measured near 0), d/dx 1 - tanh^2 its own.
TANH_ATOL = 2.0 ** -21  # measured 2^-23 to 2^-22 (times the cap)
FAST_SCORE_MODS = [(softcap, 4, CAP * TANH_ATOL, 2 * TANH_ATOL, np.float32(1) / np.float32(CAP)),
                   (exp_mod, 4, 0, 0, 0.125), (quarter_tanh, 4, 3 * TANH_ATOL, 2 * TANH_ATOL, 0.25),
                   (negative_cap, 4, 4 * TANH_ATOL, 2 * TANH_ATOL, -0.25),
                   (softcap_plus_score, 4, CAP * TANH_ATOL, 2 * TANH_ATOL, 1.0),
                   (affine_tanh, 4, 4 * TANH_ATOL, 2 * TANH_ATOL, 0.5),
                   (scaled_square, 4, 2.0 ** -20, 0, 1.0)]  # its roots: the reassociated terms cancel
MASK_MODS = [document_mask, prefix_lm, sliding_window_with_sinks, narrow_sides_mask]
EXPERT_BIAS = jnp.asarray(RNG.randn(H, S).astype(np.float32))
EXPERT = flex.cuda_mod("return score * 2.f + bias(h, kv_idx < 0 ? 0 : (kv_idx > 7 ? 7 : kv_idx));",
                       {"bias": EXPERT_BIAS}, dscore="return 2.f;",
                       name="expert_bias")


def _grid():
    """Every (b, h, q_idx, kv_idx) with q_idx / kv_idx in [-2, S + 2), each with a score; scores cycle
    through special values and random ones."""
    b, h, q, kv = np.meshgrid(np.arange(B), np.arange(H), np.arange(-2, S + 2), np.arange(-2, S + 2), indexing="ij")
    idx = np.stack([a.reshape(-1) for a in (b, h, q, kv)], axis=1).astype(np.int32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-40, 2.5, -2.5, 0.5, -1.5], np.float32)
    scores = (RNG.randn(len(idx)) * 12).astype(np.float32)
    scores[: len(special) * 8 : 8] = special
    return scores, idx


SCORES, IDX = _grid()
N = len(IDX)
ARGS_DTYPE = np.dtype([("scores", np.uint64), ("idx", np.uint64), ("out", np.uint64), ("dout", np.uint64),
                       ("n", np.int32), ("pad", np.int32), ("sides", flex.SIDES_DTYPE),
                       ("grads", SIDE_GRADS_DTYPE)])

KERNELS = """
namespace flextest {
struct Args {
  const float* scores;
  const int* idx;
  float* out;
  float* dout;
  int n;
  int pad;
  cuflash::flex::Sides sides;
  cuflash::flex::SideGrads grads;
};
using cuflash::arch::load;
using cuflash::arch::store;

template <class Mod> __global__ void score_kernel(const Args a) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  const float s = load(a.scores + i) * Mod::kScoreFactor;  // flex_mod.cuh: the functions take score * kScoreFactor
  const int b = load(a.idx + 4 * i), h = load(a.idx + 4 * i + 1), q = load(a.idx + 4 * i + 2), kv = load(a.idx + 4 * i + 3);
  store(a.out + i, Mod::score(s, b, h, q, kv, a.sides));
  if constexpr (Mod::kHasDScore) store(a.dout + i, Mod::dscore(s, b, h, q, kv, a.sides));
}

template <class Mod> __global__ void mask_kernel(const Args a) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  const int b = load(a.idx + 4 * i), h = load(a.idx + 4 * i + 1), q = load(a.idx + 4 * i + 2), kv = load(a.idx + 4 * i + 3);
  store(a.out + i, Mod::mask(b, h, q, kv, a.sides) ? 1.f : 0.f);
}

// out holds the upstream gradient g of each point.
template <class Mod> __global__ void side_grads_kernel(const Args a) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  const float s = load(a.scores + i) * Mod::kScoreFactor, g = load(a.out + i);
  const int b = load(a.idx + 4 * i), h = load(a.idx + 4 * i + 1), q = load(a.idx + 4 * i + 2), kv = load(a.idx + 4 * i + 3);
  Mod::side_grads(g, s, b, h, q, kv, a.sides, a.grads);
}
}  // namespace flextest
"""


def _nvrtc_kernel(mods) -> str:
    """One kernel calling every mod (NVRTC compiles one instance per call: one compile for all)."""
    calls = []
    for k, m in enumerate(mods):
        if m.kind == "score":
            x = f"s * {m.qualified_name}::kScoreFactor"
            calls.append(f"  out[{k}] = {m.qualified_name}::score({x}, b, h, q, kv, a.sides)"
                         + (f" + {m.qualified_name}::dscore({x}, b, h, q, kv, a.sides);" if m.has_dscore else ";"))
            if m.grad_sides:
                calls.append(f"  {m.qualified_name}::side_grads(s, {x}, b, h, q, kv, a.sides, a.grads);")
        else:
            calls.append(f"  out[{k}] = {m.qualified_name}::mask(b, h, q, kv, a.sides) ? 1.f : 0.f;")
    return ("namespace flextest {\n__global__ void all_mods_kernel(const Args a) {\n"
            "  const int i = threadIdx.x; const float s = a.scores[i]; float* out = a.out + i * 64;\n"
            "  const int b = a.idx[0], h = a.idx[1], q = a.idx[2], kv = a.idx[3];\n" + "\n".join(calls) + "\n}\n}\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    mods = {fn: flex.trace_score_mod(fn) for fn in [*EXACT_SCORE_MODS, *(m for m, *_ in ULP_SCORE_MODS)]}
    mods.update({("fast", fn): flex.trace_score_mod(fn, fast_math=True) for fn, *_ in FAST_SCORE_MODS})
    mods.update({fn: flex.trace_mask_mod(fn) for fn in MASK_MODS})
    mods["expert"] = EXPERT
    for key, (factory, arrays) in GRAD_MODS.items():
        mods[key] = flex.trace_score_mod(factory(*arrays), side_grads=True)
    unique = {m.struct_name: m for m in mods.values()}
    source = tmp_path_factory.mktemp("flex") / "flex_mods.cu"
    source.write_text('#include "arch/arch.cuh"\n#include "common/flex_mod.cuh"\n\n'
                      + "\n".join(m.source for m in unique.values()) + KERNELS + _nvrtc_kernel(list(unique.values())))
    instances = {k: KernelInstance(str(source), f"flextest::{m.kind}_kernel<{m.qualified_name}>") for k, m in mods.items()}
    instances.update({("grads", k): KernelInstance(str(source), f"flextest::side_grads_kernel<{mods[k].qualified_name}>")
                      for k in GRAD_MODS})
    sim.precompile(list(instances.values()), modes=("normal",))
    return source, mods, instances


def _run(built, key, grads=None, g=None):
    """Run mod `key`'s kernel on the grid: (out, dout); with `grads` (float32 buffers by side index), its
    side_grads kernel with upstream gradients `g` instead."""
    source, mods, instances = built
    mod = mods[key]
    values = [np.ascontiguousarray(np.asarray(v)) for v in mod.kernel_side_values()]
    descriptors = [(v.ctypes.data, v.shape, [s // v.itemsize for s in v.strides]) for v in values]
    scores, idx = SCORES.copy(), np.ascontiguousarray(IDX)
    out = np.full(N, np.nan, np.float32)
    dout = np.full(N, np.nan, np.float32)
    args = np.zeros((), ARGS_DTYPE)
    args["scores"], args["idx"], args["out"], args["dout"], args["n"] = (
        scores.ctypes.data, idx.ctypes.data, out.ctypes.data, dout.ctypes.data, N)
    args["sides"] = flex.sides_struct(descriptors)
    buffers = [scores, idx, out, dout, *values]
    if grads is not None:
        out[:] = g
        for side, buffer in grads.items():
            args["grads"]["arrays"][side] = buffer.ctypes.data
            buffers.append(buffer)
        key = ("grads", key)
    sim.launch(instances[key], (N + 127) // 128, 128, 0, args[()], buffers)
    return out, dout


@functools.cache
def _reference(fn, derivative=False):
    f = jax.grad(fn) if derivative else fn
    b, h, q, kv = (jnp.asarray(IDX[:, k]) for k in range(4))
    if fn in MASK_MODS:
        return np.asarray(jax.vmap(f)(b, h, q, kv)).astype(np.float32)
    return np.asarray(jax.vmap(f)(jnp.asarray(SCORES), b, h, q, kv))


def _where(mask):
    bad = np.flatnonzero(mask)[:8]
    return [(SCORES[i], *IDX[i]) for i in bad]


def assert_bits_equal(got, want, what):
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN at different points: {_where(np.isnan(got) != nan)}"
    differ = (got.view(np.uint32) != want.view(np.uint32)) & ~nan
    assert not differ.any(), (f"{what}: {differ.sum()} of {N} differ, e.g. at (score, b, h, q, kv) {_where(differ)}: "
                              f"{got[differ][:8]} vs {want[differ][:8]}")


def _ordered(x):
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def assert_within_ulp(got, want, ulp, atol, what):
    """Within `ulp` units in the last place or `atol`. XLA's CPU functions flush subnormal inputs and results
    to zero (glibc's do not): subnormal results count as zero, and points with a subnormal score are skipped."""
    got, want = (np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x) for x in (got, want))
    subnormal_score = (SCORES != 0) & (np.abs(SCORES) < np.finfo(np.float32).tiny)
    got, want = got[~subnormal_score], want[~subnormal_score]
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN at different points: {_where(np.isnan(got) != nan)}"
    distance = np.abs(_ordered(got) - _ordered(want))
    with np.errstate(invalid="ignore"):  # inf - inf
        far = (distance > ulp) & ~(np.abs(got - want) <= atol) & ~nan
    assert not far.any(), f"{what}: {far.sum()} beyond {ulp} ulp, up to {distance[~nan].max()}"


@pytest.mark.parametrize("fn", EXACT_SCORE_MODS, ids=lambda f: f.__name__)
def test_exact_score_mod_and_its_derivative_match_jax_bit_for_bit(built, fn):
    out, dout = _run(built, fn)
    assert_bits_equal(out, _reference(fn), fn.__name__)
    assert_bits_equal(dout, _reference(fn, True), f"d {fn.__name__} / d score")


@pytest.mark.parametrize("fn, ulp, dulp, datol", ULP_SCORE_MODS, ids=lambda f: getattr(f, "__name__", ""))
def test_transcendental_score_mod_and_its_derivative_match_jax_within_ulp(built, fn, ulp, dulp, datol):
    out, dout = _run(built, fn)
    assert_within_ulp(out, _reference(fn), ulp, 0, fn.__name__)
    assert_within_ulp(dout, _reference(fn, True), dulp, datol, f"d {fn.__name__} / d score")


@pytest.mark.parametrize("fn, ulp, atol, datol, factor", FAST_SCORE_MODS, ids=lambda f: getattr(f, "__name__", ""))
def test_fast_math_score_mod_folds_its_one_product_and_matches_jax(built, fn, ulp, atol, datol, factor):
    """A fast-math mod reading the score only as score * c or score / c takes score * f (kScoreFactor, f = c or
    1 / c; the kernels fold f into the softmax scale): the product is gone from its functions and the harness's
    score * f gives what JAX gives within the fast forms' error; one reading the score otherwise keeps f = 1."""
    mod = built[1][("fast", fn)]
    assert f"kScoreFactor = {flex_emit.literal(factor, 'float32')};" in mod.source, mod.source
    product = re.compile(r"(__fmul_rn\(score,|, score\)|__fdividef\(score,|\(score / |\(score \* )")
    assert (product.search(mod.source) is None) == (factor != 1.0), mod.source
    exact = flex.trace_score_mod(fn)
    assert "kScoreFactor = 0x1.0000000000000p+0f;" in exact.source and product.search(exact.source)
    out, dout = _run(built, ("fast", fn))
    assert_within_ulp(out, _reference(fn), ulp, atol, fn.__name__)
    assert_within_ulp(dout, _reference(fn, True), ulp, datol, f"d {fn.__name__} / d score")


def test_fast_math_gathers_the_chain_rules_constant_factors():
    """jax.grad of cap * tanh(score / cap) multiplies by cap and divides by it again (after the tanh 6 statements,
    5 instructions a score); fast_math gathers the constant factors: 1 - t and (1 - t) + (1 - t) t, an FADD and an
    FFMA, no cap left (the backward's loop census: Hopper d128 841 -> 745 instructions a step, sm_80 d64 2591 ->
    2395, NVRTC 13.5)."""
    def statements(mod):
        return re.findall(r"const float v\d+ = (.*);", mod.source.split(" dscore(")[1])

    fast, exact = flex.trace_score_mod(softcap, fast_math=True), flex.trace_score_mod(softcap)
    cap = flex_emit.literal(CAP, "float32")
    assert cap in "".join(statements(exact)) and cap not in "".join(statements(fast)), statements(fast)
    assert len(statements(fast)) == 5 and len(statements(exact)) == 8, (statements(fast), statements(exact))


@pytest.mark.parametrize("fn", MASK_MODS, ids=lambda f: f.__name__)
def test_mask_mod_matches_jax(built, fn):
    out, _ = _run(built, fn)
    want = _reference(fn)
    assert 0 < want.sum() < N, "the grid must keep some scores and mask others"
    assert_bits_equal(out, want, fn.__name__)


def test_expert_mod_runs_its_source(built):
    out, dout = _run(built, "expert")
    with np.errstate(over="ignore"):
        want = SCORES * np.float32(2) + np.asarray(EXPERT_BIAS)[IDX[:, 1], np.clip(IDX[:, 3], 0, S - 1)]
    assert_bits_equal(out, want, "expert_bias")
    assert_bits_equal(dout, np.full(N, 2, np.float32), "expert_bias's dscore")


@pytest.mark.parametrize("key", GRAD_MODS)
def test_side_grads_add_what_jax_grad_gives_the_captured_float_arrays(built, key):
    factory, arrays = GRAD_MODS[key]
    mod = built[1][key]
    floats = [k for k, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert mod.grad_sides == tuple(floats)
    g = RNG.randn(N).astype(np.float32)
    grads = {k: np.zeros(arrays[k].shape, np.float32) for k in floats}
    _run(built, key, grads=grads, g=g)

    def loss(*floats_in):
        full = list(arrays)
        for k, value in zip(floats, floats_in):
            full[k] = value
        b, h, q, kv = (jnp.asarray(IDX[:, c]) for c in range(4))
        return jnp.sum(jnp.asarray(g) * jax.vmap(factory(*full))(jnp.asarray(SCORES), b, h, q, kv))

    want = jax.grad(loss, argnums=tuple(range(len(floats))))(*(arrays[k] for k in floats))
    for k, w in zip(floats, want):
        assert np.any(grads[k] != 0)
        np.testing.assert_allclose(grads[k], np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=f"{key}: side {k}")


def test_emitted_code_compiles_with_nvrtc_for_sm_80(built):
    from cuflash.kernels import nvrtc

    source, _, _ = built
    compiled = nvrtc.compile_instance(KernelInstance(str(source), "flextest::all_mods_kernel"), "sm_80")
    assert compiled is not None
