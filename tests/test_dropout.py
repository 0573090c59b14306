"""Dropout ([variants]): the keep mask is one pure function of (seed, batch, head, i, j), and every kernel drops it.

* The NumPy Philox4x32-10 behind cuflash.dropout_mask gives Random123's published known answers.
* The kept fraction is within 3 standard deviations of 1 - p; the mask of a smaller problem is the corner of a
  larger one's (a function of indices, not of shapes or tiles); seeds that differ in either 32-bit word differ.
* The kernels drop exactly cuflash.dropout_mask's elements, bitwise: with q = 0 and V = I the forward's output is
  keep / ((1 - p) seqlen_k), and with dO = I the backward's dV is the dropped P transposed; shown for the SIMT fa2
  (float32) and the tensor-core fa2 (float16, bfloat16) on two simulated targets (different tiles), GQA, causal.
* Every tensor-core instance with dropout (the kernels' WithDropout flag, own tiles) any target plans: under the race
  detector in both dq modes and under ASan, against the reference fed the mask, bitwise across cp.async landings.
* Accuracy with dropout and every other option against the float64 reference is in tests/test_variants.py; here
  the reference's dropout gradients are checked against JAX autodiff of a plain jnp attention fed the same mask.
* On a GPU (marked gpu): the same exposed mask bitwise, and all options together against the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash.dropout import philox4x32_10
from cuflash.reference import attention_backward_reference, attention_reference
from cuflash.testing import numpy_dtype, random_inputs

# Random123's kat_vectors for philox4x32_10: (counter, key, expected words).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_gives_random123_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expected


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9])
def test_kept_fraction_is_within_three_sigma(p):
    mask = cuflash.dropout_mask(12345 + int(p * 100), 3, 4, 129, 257, p)
    n = mask.size
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(mask.mean() - (1 - p)) < 3 * sigma, (mask.mean(), 1 - p, sigma)
    # No structure along either index: every row and every column keeps about 1 - p.
    for axis in (2, 3):
        per_line = mask.mean(axis=tuple(a for a in range(4) if a != axis))
        line_sigma = np.sqrt(p * (1 - p) * per_line.size / n)
        assert np.all(np.abs(per_line - (1 - p)) < 5 * line_sigma)


def test_mask_is_a_function_of_indices_and_seed():
    big = cuflash.dropout_mask(2**33 + 7, 3, 5, 70, 90, 0.4)
    small = cuflash.dropout_mask(2**33 + 7, 2, 3, 33, 17, 0.4)
    assert np.array_equal(small, big[:2, :3, :33, :17])
    for other_seed in (2**33 + 8, 7, 2**34 + 7):  # either 32-bit word of the seed changes the mask
        other = cuflash.dropout_mask(other_seed, 3, 5, 70, 90, 0.4)
        assert 0.3 < np.mean(other != big) < 0.7
    assert cuflash.dropout_mask(None, 1, 1, 3, 4, 0.0).all()
    assert cuflash.dropout_mask(5, 1, 1, 3, 4, 0.0).all()
    assert not cuflash.dropout_mask(5, 1, 1, 3, 4, 0.0).size == 0
    with pytest.raises(ValueError, match="dropout_seed"):
        cuflash.dropout_mask(None, 1, 1, 3, 4, 0.5)
    with pytest.raises(ValueError, match="seqlen_k"):
        cuflash.dropout_mask(1, 1, 1, 3, -4, 0.5)


def _exposing_forward_inputs(shape, dtype):
    """q = 0 (every visible key has P = 1 / keys seen) and V = identity (out[i, c] = P_dropped[i, c])."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = shape
    dt = numpy_dtype(dtype)
    q = np.zeros((batch, seqlen_q, nheads, headdim), dt)
    k = np.random.default_rng(0).standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(dt)
    v = np.zeros((batch, seqlen_k, nheads_k, headdim), dt)
    v[:, np.arange(seqlen_k), :, np.arange(seqlen_k)] = 1
    return q, k, v


def _visible(seqlen_q, seqlen_k, causal):
    """Bottom-right causal visibility written from its definition (not through cuflash.mask)."""
    full = np.ones((seqlen_q, seqlen_k), bool)
    return np.tril(full, seqlen_k - seqlen_q) if causal else full


KERNEL_CASES = [
    # (dtype, target, shape (b, sq, sk, h, hk, d), causal); the backward is exposed where h == hk and d >= sq.
    ("float32", "sm_80", (2, 37, 50, 4, 2, 64), False),
    ("float16", "sm_80", (2, 61, 61, 3, 3, 64), True),
    ("bfloat16", "sm_86", (1, 90, 96, 2, 2, 96), False),
    ("float16", "sm_86", (1, 19, 120, 4, 1, 128), True),
    ("float32", "sm_86", (1, 40, 33, 2, 2, 40), True),
]


@pytest.mark.parametrize("dtype, arch, shape, causal", KERNEL_CASES)
def test_kernels_drop_exactly_dropout_mask(dtype, arch, shape, causal):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = shape
    p, seed = 0.35, 2**37 + 1234
    keep = cuflash.dropout_mask(seed, batch, nheads, seqlen_q, seqlen_k, p)
    q, k, v = _exposing_forward_inputs(shape, dtype)
    with sim.targeting(arch), sim.record() as records:
        out, lse = cuflash.attention(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed, return_lse=True)
    tc = dtype != "float32"
    assert any(r.kernel.startswith("cuflash::fa2_tc_forward" if tc else "cuflash::fa2_forward") for r in records.launches)
    visible = _visible(seqlen_q, seqlen_k, causal)
    seen = out.astype(np.float32)[..., :seqlen_k].transpose(0, 2, 1, 3) != 0  # (b, h, sq, sk)
    assert np.array_equal(seen, keep & visible), np.argwhere(seen != (keep & visible))[:5]
    # The kept values are 1 / ((1 - p) keys seen), to the output's precision; the lse ignores dropout.
    keys_seen = visible.sum(axis=1)
    rows = keys_seen > 0
    expected = (keep & visible)[:, :, rows] / ((1 - p) * keys_seen[rows, None])
    got = out.astype(np.float64)[..., :seqlen_k].transpose(0, 2, 1, 3)[:, :, rows]
    np.testing.assert_allclose(got, expected, rtol=1e-2 if tc else 1e-6)
    np.testing.assert_allclose(lse[:, :, rows], np.broadcast_to(np.log(keys_seen[rows]), lse[:, :, rows].shape),
                               rtol=1e-5)

    if nheads != nheads_k or headdim < seqlen_q:
        return
    # Backward: dO = identity over the rows makes dV[j, i] = P_dropped[i, j] (one query head per kv head).
    dout = np.zeros_like(q)
    dout[:, np.arange(seqlen_q), :, np.arange(seqlen_q)] = 1
    with sim.targeting(arch):
        _, _, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, dropout_p=p, dropout_seed=seed)
    dv_seen = dv.astype(np.float32)[..., :seqlen_q].transpose(0, 2, 3, 1) != 0  # (b, h, sq, sk)
    assert np.array_equal(dv_seen, keep & visible)


@pytest.mark.parametrize("dtype, arch", [("float32", "sm_80"), ("float16", "sm_90"), ("bfloat16", "sm_86")])
def test_a_block_with_its_row_and_key_offsets_drops_the_whole_calls_elements(monkeypatch, dtype, arch):
    """The seed buffer's words 4 and 5 (a ring attention block's first global query row and key; a multiple of 16
    and an even number): a call on rows 32..80 and keys 10..52 of a larger problem, given them, drops exactly that
    block of the whole call's mask (q = 0, V = I expose the dropped P), forward and backward (dO = I exposes it
    through dV)."""
    from cuflash import api
    from cuflash.dropout import seed_words

    p, seed, first_row, first_key = 0.3, 2**35 + 77, 32, 10
    shape = (2, 49, 43, 2, 2, 64)  # the block: 49 rows (ragged), 43 keys
    keep = cuflash.dropout_mask(seed, 2, 2, first_row + 49, first_key + 43, p)[:, :, first_row:, first_key:]
    q, k, v = _exposing_forward_inputs(shape, dtype)
    monkeypatch.setattr(api, "seed_words", lambda seed: seed_words(seed, first_row=first_row, first_key=first_key))
    with sim.targeting(arch):
        out, lse = cuflash.attention(q, k, v, dropout_p=p, dropout_seed=seed, return_lse=True)
        dout = np.zeros_like(q)
        dout[:, np.arange(49), :, np.arange(49)] = 1
        _, _, dv = cuflash.attention_backward(dout, q, k, v, out, lse, dropout_p=p, dropout_seed=seed)
    assert np.array_equal(out.astype(np.float32)[..., :43].transpose(0, 2, 1, 3) != 0, keep)
    assert np.array_equal(dv.astype(np.float32)[..., :49].transpose(0, 2, 3, 1) != 0, keep)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_seed_reruns_bitwise_and_another_seed_differs(dtype):
    shape = (1, 45, 70, 2, 1, 32)
    q, k, v, dout = random_inputs(shape, dtype, seed=2)
    first = cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=77, return_lse=True)
    again = cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=77, return_lse=True)
    other = cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=78, return_lse=True)
    plain = cuflash.attention(q, k, v, return_lse=True)
    zero = cuflash.attention(q, k, v, dropout_p=0.0, dropout_seed=78, return_lse=True)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], other[0])
    assert np.array_equal(first[1], other[1]) and np.array_equal(first[1], plain[1])  # lse ignores dropout
    assert all(np.array_equal(a, b) for a, b in zip(zero, plain))  # p = 0 is plain attention, bitwise
    grads = [cuflash.attention_backward(dout, q, k, v, *first, dropout_p=0.2, dropout_seed=77, deterministic=True)
             for _ in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_shard_with_its_offsets_drops_what_the_whole_call_drops(monkeypatch, dtype):
    """The seed buffer's words 2 and 3 (the call's first global batch and head): a call on batches 1..2 and query
    heads 4..7 of a larger GQA problem, given those offsets, computes bitwise the whole call's slice, forward and
    backward (what a device's shard does under sharded jit); without them it drops another mask."""
    from cuflash import api
    from cuflash.dropout import seed_words

    q, k, v, dout = random_inputs((3, 37, 53, 8, 4, 40), dtype, seed=12)
    options = dict(causal=True, dropout_p=0.3, dropout_seed=2**36 + 5)
    whole = cuflash.attention(q, k, v, return_lse=True, **options)
    whole_grads = cuflash.attention_backward(dout, q, k, v, *whole, deterministic=True, **options)
    rows, heads, kv_heads = slice(1, 3), slice(4, 8), slice(2, 4)  # query heads 4..7 are kv heads 2..3's groups
    part = [x[rows, :, h] for x, h in ((q, heads), (k, kv_heads), (v, kv_heads), (dout, heads))]
    unshifted = cuflash.attention(*part[:3], return_lse=True, **options)
    assert not np.array_equal(unshifted[0], whole[0][rows, :, heads])
    monkeypatch.setattr(api, "seed_words", lambda seed: seed_words(seed, 1, 4))
    out, lse = cuflash.attention(*part[:3], return_lse=True, **options)
    assert np.array_equal(out, whole[0][rows, :, heads]) and np.array_equal(lse, whole[1][rows, heads])
    grads = cuflash.attention_backward(part[3], *part[:3], out, lse, deterministic=True, **options)
    for got, want, h in zip(grads, whole_grads, (heads, kv_heads, kv_heads)):
        assert np.array_equal(got, want[rows, :, h])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_call_with_a_seed_per_batches_drops_what_each_seeds_call_drops(monkeypatch, dtype):
    """Problem.dropout_batches_per_seed (vmap's fold of calls with their own seeds): three calls of batch 2 with
    seeds s0, s1, s2 folded into batch 6, of which a shard holds global batches 1..4 (first row's word 2 = 1). Its
    batch 0 is call 0's batch 1, batches 1..2 are call 1's and batch 3 is call 2's batch 0, forward and backward,
    bitwise."""
    import functools

    from cuflash import _validation, api
    from cuflash.dropout import seed_words
    from cuflash.kernels.program import Problem

    shape = (2, 37, 53, 4, 2, 40)
    seeds = (2**40 + 3, 17, 2**63 + 11)
    options = dict(causal=True, dropout_p=0.3)
    calls = [random_inputs(shape, dtype, seed=20 + i) for i in range(3)]
    expected = []
    for seed, (q, k, v, dout) in zip(seeds, calls):
        out, lse = cuflash.attention(q, k, v, return_lse=True, dropout_seed=seed, **options)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, dropout_seed=seed, **options)
        expected.append((out, lse, *grads))
    pieces = [(0, 1), (1, 0), (1, 1), (2, 0)]  # (call, batch) of the shard's batches
    q, k, v, dout = (np.stack([calls[c][i][b] for c, b in pieces]) for i in range(4))

    table = np.concatenate([seed_words(seeds[0], first_batch=1)] + [seed_words(s) for s in seeds[1:]])
    monkeypatch.setattr(api, "seed_words", lambda seed: table)
    monkeypatch.setattr(_validation, "Problem", functools.partial(Problem, dropout_batches_per_seed=2))
    out, lse = cuflash.attention(q, k, v, return_lse=True, dropout_seed=0, **options)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, dropout_seed=0, **options)
    for i, (c, b) in enumerate(pieces):
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected[c]):
            assert np.array_equal(got[i], want[b]), (name, c, b)


def test_dropout_batches_per_seed_is_checked():
    from cuflash.kernels.program import Problem

    base = dict(dtype="float32", batch=4, seqlen_q=8, seqlen_k=8, nheads=2, nheads_k=2, headdim=16)
    with pytest.raises(ValueError, match="dropout_batches_per_seed must be an int >= 0"):
        Problem(**base, dropout_p=0.1, dropout_batches_per_seed=-1)
    with pytest.raises(ValueError, match="needs dropout_p > 0 and a fixed-length batch"):
        Problem(**base, dropout_batches_per_seed=2)
    with pytest.raises(ValueError, match="needs dropout_p > 0 and a fixed-length batch"):
        Problem(**base, dropout_p=0.1, dropout_batches_per_seed=2, total_q=9, total_k=9)


jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def test_reference_dropout_equals_jax_autodiff_of_plain_attention():
    """The reference's dropout forward and hand-derived gradients (dV = (P Z)^T dO, dP = dO V^T Z, D unchanged)
    equal a plain jnp attention that multiplies softmax by the mask / (1 - p), differentiated by JAX."""
    shape = (2, 21, 27, 4, 2, 8)
    q, k, v, dout = random_inputs(shape, "float32", seed=6)
    p = 0.25
    keep = cuflash.dropout_mask(99, 2, 4, 21, 27, p)
    options = dict(causal=True, dropout_p=p, dropout_mask=keep, softmax_scale=0.6)

    def attention(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.6
        s = jnp.where(np.tril(np.ones((21, 27), bool), 6), s, -jnp.inf)
        probs = jax.nn.softmax(s, axis=-1) * keep / (1 - p)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

    out, vjp = jax.vjp(attention, q, k, v)
    out_ref, _ = attention_reference(q, k, v, **options)
    np.testing.assert_allclose(out_ref, np.asarray(out), rtol=2e-5, atol=2e-6)
    for got, want in zip(attention_backward_reference(dout, q, k, v, **options), vjp(dout)):
        np.testing.assert_allclose(got, np.asarray(want), rtol=5e-5, atol=5e-6)


# ---------------------------------------------------------------------------
# The tensor-core instances with dropout (the kernels' WithDropout flag; their own tiles, fa2_tc.py).

from cuflash import _tolerance as tol  # noqa: E402
from cuflash.kernels.families import fa2_tc  # noqa: E402
from cuflash.kernels.targets import target  # noqa: E402

from test_fa2_tc import (INSTANCE_SHAPES, PLANNED_ARCHS, assert_asan_rotation_covers,  # noqa: E402 (per-instance
                         one_dtype_per_tile)  # shapes, targets, ASan's rotation)
# Small enough to keep 14 instance pairs under race mode and ASan cheap: ragged Q and K/V blocks, several blocks
# per loop in every tile, GQA, causal with seqlen_q > seqlen_k (rows that see no key).
INSTANCE_PROBLEM = (1, 100, 90, 2, 1)


def _dropout_instance_cases():
    """Each distinct (forward, backward) pair of dropout instances any target plans, with the first arch planning it."""
    cases = {}
    for arch in PLANNED_ARCHS:
        for head_dim in fa2_tc.HEAD_DIMS:
            for dtype in fa2_tc.DTYPES:
                pair = (fa2_tc.forward_traits(head_dim, target(arch), True).instance(dtype),
                        fa2_tc.backward_traits(head_dim, target(arch), True).instance(dtype))
                cases.setdefault(pair, (arch, head_dim, dtype))
    return list(cases.values())


DROPOUT_INSTANCE_CASES = _dropout_instance_cases()
ASAN_DROPOUT_CASES = one_dtype_per_tile(DROPOUT_INSTANCE_CASES)


def test_dropout_instance_cases_cover_every_planned_dropout_instance():
    covered = set()
    for arch, head_dim, dtype in DROPOUT_INSTANCE_CASES:
        covered |= {fa2_tc.forward_traits(head_dim, target(arch), True).instance(dtype),
                    fa2_tc.backward_traits(head_dim, target(arch), True).instance(dtype)}
    planned = {i for arch in PLANNED_ARCHS for i in fa2_tc.instances(target(arch)) if i.name_expr.endswith(", true>")}
    # Per dtype, head dim and direction, and d96's backward twice: 64 x 128 (sm_80, sm_90), 64 x 64 (the 99 KB targets).
    assert covered == planned and len(planned) == 2 * (2 * len(fa2_tc.HEAD_DIMS) + 1)


def _dropout_instance_run(arch, head_dim, dtype, deterministic=True):
    """Forward and backward of one dropout instance pair: causal GQA with rows that see no key, ragged blocks."""
    q, k, v, dout = random_inputs((*INSTANCE_PROBLEM, INSTANCE_SHAPES[head_dim]), dtype, seed=31)
    options = dict(causal=True, dropout_p=0.2, dropout_seed=2**35 + head_dim)
    with sim.targeting(arch), sim.record() as records:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    kernels = {r.kernel for r in records.launches}
    assert {fa2_tc.forward_traits(head_dim, target(arch), True).instance(dtype).name_expr,
            fa2_tc.backward_traits(head_dim, target(arch), True).instance(dtype).name_expr} <= kernels
    return out, lse, grads


def _check_dropout_instance(head_dim, dtype, out, lse, grads):
    q, k, v, dout = random_inputs((*INSTANCE_PROBLEM, INSTANCE_SHAPES[head_dim]), dtype, seed=31)
    batch, seqlen_q, seqlen_k, nheads, _ = INSTANCE_PROBLEM
    keep = cuflash.dropout_mask(2**35 + head_dim, batch, nheads, seqlen_q, seqlen_k, 0.2)
    options = dict(causal=True, dropout_p=0.2, dropout_mask=keep)
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, **options)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)


@pytest.mark.parametrize("arch, head_dim, dtype", DROPOUT_INSTANCE_CASES)
def test_every_dropout_instance_race_free_and_reproducible(arch, head_dim, dtype):
    """Under the race detector (dq by red.add; the split-slice mode's stores are the dropout-free instances' code,
    raced in test_fa2_tc.py), against the reference fed dropout_mask; the deterministic mode bitwise equal when the
    cp.async copies land at other moments."""
    with sim.checking("race"):
        _, _, atomic_grads = _dropout_instance_run(arch, head_dim, dtype, deterministic=False)
    out, lse, grads = _dropout_instance_run(arch, head_dim, dtype)
    _check_dropout_instance(head_dim, dtype, out, lse, grads)
    _check_dropout_instance(head_dim, dtype, out, lse, atomic_grads)
    with sim.copy_landing(1):
        again = _dropout_instance_run(arch, head_dim, dtype)
    for a, b in zip((out, lse, *grads), (again[0], again[1], *again[2])):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _every_dropout_instance_under_asan():
    return [_dropout_instance_run(arch, head_dim, dtype) for arch, head_dim, dtype in ASAN_DROPOUT_CASES]


def test_every_dropout_instance_clean_under_asan():
    """The dropout tiles under ASan, half of them a day (one_dtype_per_tile: every tile in both dtypes every four
    days; each instance is raced above every day)."""
    assert_asan_rotation_covers(DROPOUT_INSTANCE_CASES)
    results = sim.run_in_asan_subprocess(_every_dropout_instance_under_asan, timeout=1200)
    for (arch, head_dim, dtype), (out, lse, grads) in zip(ASAN_DROPOUT_CASES, results):
        _check_dropout_instance(head_dim, dtype, out, lse, grads)


# ---------------------------------------------------------------------------
# On a GPU: the same mask, bitwise, and every option against the reference.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, arch, shape, causal", KERNEL_CASES)
def test_gpu_drops_exactly_dropout_mask(dtype, arch, shape, causal):
    """The GPU's Philox words equal the NumPy twin's: the exposed keep pattern is cuflash.dropout_mask's."""
    cupy = pytest.importorskip("cupy")
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = shape
    p, seed = 0.35, 2**37 + 1234
    keep = cuflash.dropout_mask(seed, batch, nheads, seqlen_q, seqlen_k, p)
    q, k, v = (cupy.asarray(x) for x in _exposing_forward_inputs(shape, dtype))
    out = cupy.asnumpy(cuflash.attention(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed))
    visible = _visible(seqlen_q, seqlen_k, causal)
    seen = out.astype(np.float32)[..., :seqlen_k].transpose(0, 2, 1, 3) != 0
    assert np.array_equal(seen, keep & visible)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_every_option_matches_reference(dtype):
    """Windows, softcap, ALiBi and dropout together on the GPU, forward and backward (both dq modes), against the
    float64 reference fed the same dropout mask; deterministic reruns bitwise."""
    cupy = pytest.importorskip("cupy")
    shape = (2, 333, 517, 6, 2, 96)
    q, k, v, dout = random_inputs(shape, dtype, seed=40)
    slopes = np.random.default_rng(1).uniform(0.01, 0.3, (2, 6)).astype(np.float32)
    options = dict(window_size=(200, 30), causal=True, softcap=8.0, dropout_p=0.15, dropout_seed=2**40 + 3)
    keep = cuflash.dropout_mask(2**40 + 3, 2, 6, 333, 517, 0.15)
    ref_options = dict(window_size=(200, 30), causal=True, softcap=8.0, alibi_slopes=slopes, dropout_p=0.15,
                       dropout_mask=keep)
    g = [cupy.asarray(x) for x in (q, k, v, dout, slopes)]
    out, lse = cuflash.attention(g[0], g[1], g[2], alibi_slopes=g[4], return_lse=True, **options)
    ref = tol.forward_references(q, k, v, **ref_options)
    tol.check_close("out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", cupy.asnumpy(lse), ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, **ref_options)
    for deterministic in (False, True):
        grads = cuflash.attention_backward(g[3], g[0], g[1], g[2], out, lse, alibi_slopes=g[4],
                                           deterministic=deterministic, **options)
        for name, got in zip(("dq", "dk", "dv"), grads):
            tol.check_close(name, cupy.asnumpy(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                            tol.BACKWARD_FACTOR, atol=1e-5)
    again = cuflash.attention_backward(g[3], g[0], g[1], g[2], out, lse, alibi_slopes=g[4], deterministic=True,
                                       **options)
    for a, b in zip(grads, again):
        assert bool(cupy.all(a.view(cupy.uint8) == b.view(cupy.uint8)))
