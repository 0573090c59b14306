"""Variable-length batches ([variants]): cuflash.attention_varlen and attention_varlen_backward.

* A grid over packings (zero-length and one-row sequences, a long one that is no block multiple, seqlen_q above and
  below seqlen_k per sequence), dtypes (so both fa2 variants), GQA/MQA, masks and every option, forward and
  backward, against the float64 reference of each sequence alone under FA2's rule.
* Sequences of equal length give, bit for bit, what the fixed-length kernels give on the same batch: varlen changes
  only where a sequence lives, never the math.
* No work or traffic for padding: the simulator's bytes written equal those of each sequence run alone, and the
  bytes read exceed theirs only by the cu_seqlens words.
* The race detector (cp.async in flight, both dq modes) on both variants.
* Bad cu_seqlens and max_seqlen are refused before any kernel runs, naming the argument; fa1 and standard refuse
  varlen naming fa2.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.testing import numpy_dtype

# Packings: (query lengths, key lengths) per sequence.
PACKINGS = {
    "zeros-and-ragged": ([5, 0, 70, 33], [9, 3, 40, 0]),
    "single-rows": ([1, 1, 1], [1, 64, 2]),
    "one-long": ([130], [203]),
    "q-longer-then-k-longer": ([90, 17], [17, 90]),
}
# (nheads, nheads_k, headdim): MHA, GQA, MQA; head dims that are not powers of two.
HEADS = [(2, 2, 40), (4, 2, 72), (3, 1, 24)]
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(11, 4)),
    "softcap-alibi": dict(softcap=3.0, alibi=True),
    "dropout": dict(dropout_p=0.2),
    "window-causal-softcap-alibi-dropout": dict(window_size=(19, -1), causal=True, softcap=5.0, alibi=True,
                                                dropout_p=0.25),
}
DTYPES = ["float32", "float16", "bfloat16"]


def _cases():
    """Every option set in every dtype; packings, head layouts and the dq mode in rotation."""
    cases = []
    for i, option_name in enumerate(OPTIONS):
        for d, dtype in enumerate(DTYPES):
            packing = list(PACKINGS)[(i + d) % len(PACKINGS)]
            heads = (i + 2 * d) % len(HEADS)
            deterministic = (i + d) % 2 == 1
            cases.append(pytest.param(packing, heads, option_name, dtype, deterministic,
                                      id=f"{option_name}-{dtype}-{packing}-h{heads}"))
    return cases


def test_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _cases()]
    assert {v[0] for v in values} == set(PACKINGS)
    assert {v[1] for v in values} == set(range(len(HEADS)))
    assert {v[2] for v in values} == set(OPTIONS)
    assert {v[3] for v in values} == set(DTYPES)
    assert {v[4] for v in values} == {False, True}


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _packed_inputs(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = rng.standard_normal((total_q, nheads, headdim)).astype(dt)
    k = rng.standard_normal((total_k, nheads_k, headdim)).astype(dt)
    v = rng.standard_normal((total_k, nheads_k, headdim)).astype(dt)
    dout = rng.standard_normal(q.shape).astype(dt)
    return q, k, v, dout


def _options(name: str, batch: int, nheads: int, seed: int) -> dict:
    options = dict(OPTIONS[name])
    rng = np.random.default_rng(seed)
    if options.pop("alibi", False):
        shape = (batch, nheads) if seed % 2 else (nheads,)
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, shape).astype(np.float32)
    if "dropout_p" in options:
        options["dropout_seed"] = 2**35 + 101 * seed
    return options


def _reference_options(options: dict, lengths_q, lengths_k, nheads: int) -> dict:
    """Dropout's seed becomes the mask: (batch, nheads, max_seqlen_q, max_seqlen_k), positions within sequences."""
    options = dict(options)
    seed = options.pop("dropout_seed", None)
    if seed is not None:
        options["dropout_mask"] = cuflash.dropout_mask(seed, len(lengths_q), nheads, max(lengths_q), max(lengths_k),
                                                       options["dropout_p"])
    return options


def _rows_without_key(lengths_q, lengths_k, options) -> np.ndarray:
    from cuflash.mask import Mask

    mask = Mask.of(options.get("causal", False), options.get("window_size", (-1, -1)))
    return np.concatenate([mask.policy(sq, sk).rows_without_key() for sq, sk in zip(lengths_q, lengths_k)])


def _check(lengths_q, lengths_k, q, k, v, dout, options, deterministic=False):
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    ref_options = _reference_options(options, lengths_q, lengths_k, q.shape[1])
    ref = tol.forward_references(q, k, v, cu_seqlens=(cu_q, cu_k), **ref_options)
    # The kernels' tanh (mask.cuh's tanh_by_exp2) is within a few float32 ulps of 1, so a softcapped score carries
    # up to softcap times that; it shows where a row sees one key (its lse is that score), as single rows do here.
    atol = 4 * options.get("softcap", 0.0) * 2.0**-23
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR, atol=atol)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR, atol=atol)
    empty = _rows_without_key(lengths_q, lengths_k, options)
    assert np.all(out[empty].astype(np.float32) == 0) and np.all(lse[:, empty] == -np.inf)

    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, deterministic=deterministic,
                                              **options)
    bref = tol.backward_references(dout, q, k, v, cu_seqlens=(cu_q, cu_k), **ref_options)
    for name, got, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype
        tol.check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR, atol=1e-5)
    assert np.all(grads[0][empty].astype(np.float32) == 0)
    return out, lse, grads


@pytest.mark.parametrize("packing, heads, option_name, dtype, deterministic", _cases())
def test_varlen_matches_reference_per_sequence(packing, heads, option_name, dtype, deterministic):
    lengths_q, lengths_k = PACKINGS[packing]
    nheads, nheads_k, headdim = HEADS[heads]
    seed = 13 * heads + len(option_name)
    q, k, v, dout = _packed_inputs(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, seed)
    options = _options(option_name, len(lengths_q), nheads, seed)
    with sim.record() as records:
        _check(lengths_q, lengths_k, q, k, v, dout, options, deterministic)
    kernels = {r.kernel.split("<")[0] for r in records.launches}
    expected = "cuflash::fa2_forward_kernel" if dtype == "float32" else "cuflash::fa2_tc_forward_kernel"
    assert expected in kernels, kernels


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equal_lengths_give_the_fixed_length_bits(dtype):
    """Every sequence 45 queries x 77 keys: the packed call and attention() on the (batch, s, h, d) view agree bit
    for bit (forward, lse and the deterministic backward), with a causal window and ALiBi per sequence."""
    batch, sq, sk, nheads, nheads_k, d = 3, 45, 77, 4, 2, 48
    q, k, v, dout = _packed_inputs([sq] * batch, [sk] * batch, nheads, nheads_k, d, dtype, seed=5)
    slopes = np.random.default_rng(1).uniform(0.05, 0.5, (batch, nheads)).astype(np.float32)
    options = dict(causal=True, window_size=(30, -1), alibi_slopes=slopes)
    cu_q, cu_k = _cu([sq] * batch), _cu([sk] * batch)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, deterministic=True, **options)

    def view(x, s):
        return x.reshape(batch, s, *x.shape[1:])

    fixed_out, fixed_lse = cuflash.attention(view(q, sq), view(k, sk), view(v, sk), return_lse=True, **options)
    fixed_grads = cuflash.attention_backward(view(dout, sq), view(q, sq), view(k, sk), view(v, sk), fixed_out,
                                             fixed_lse, deterministic=True, **options)
    assert np.array_equal(view(out, sq), fixed_out)
    assert np.array_equal(lse.reshape(nheads, batch, sq).transpose(1, 0, 2), fixed_lse)
    for got, want, s in zip(grads, fixed_grads, (sq, sk, sk)):
        assert np.array_equal(view(got, s), want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_no_traffic_for_padding(dtype):
    """One long and three short sequences: bytes written equal the sum over the sequences run alone (fixed-length
    calls) and are less than half those of the batch padded to the longest sequences; bytes read are at least the
    sum over the sequences and below the padded batch's (the excess over the sum: the cu_seqlens words, which the
    simulator counts per thread and use, where a GPU serves a warp's identical words from L1)."""
    lengths_q, lengths_k = [200, 3, 9, 1], [180, 5, 2, 1]
    q, k, v, dout = _packed_inputs(lengths_q, lengths_k, 2, 1, 64, dtype, seed=9)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    with sim.record() as packed:
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    alone_read = alone_written = 0
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        with sim.record() as alone:
            o, l = cuflash.attention(q[None, rows], k[None, keys], v[None, keys], causal=True, return_lse=True)
            cuflash.attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], o, l,
                                       causal=True)
        alone_read += sum(r.global_bytes_read for r in alone.launches)
        alone_written += sum(r.global_bytes_written for r in alone.launches)
    packed_read = sum(r.global_bytes_read for r in packed.launches)
    packed_written = sum(r.global_bytes_written for r in packed.launches)
    assert packed_written == alone_written
    assert alone_read <= packed_read

    def padded(x, cu, length):
        return np.stack([np.pad(x[cu[b]:cu[b + 1]], ((0, length - (cu[b + 1] - cu[b])), (0, 0), (0, 0)))
                         for b in range(len(cu) - 1)])

    sq, sk = max(lengths_q), max(lengths_k)
    qp, kp, vp, dp = padded(q, cu_q, sq), padded(k, cu_k, sk), padded(v, cu_k, sk), padded(dout, cu_q, sq)
    with sim.record() as full:
        o, l = cuflash.attention(qp, kp, vp, causal=True, return_lse=True)
        cuflash.attention_backward(dp, qp, kp, vp, o, l, causal=True)
    assert packed_written < 0.5 * sum(r.global_bytes_written for r in full.launches)
    assert packed_read < sum(r.global_bytes_read for r in full.launches)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_race_free_in_both_dq_modes(dtype):
    lengths_q, lengths_k = [70, 0, 33], [40, 9, 65]
    q, k, v, dout = _packed_inputs(lengths_q, lengths_k, 4, 2, 64, dtype, seed=2)
    options = dict(causal=True, softcap=4.0)
    for deterministic in (False, True):
        with sim.checking("race"):
            _check(lengths_q, lengths_k, q, k, v, dout, options, deterministic)


# ---------------------------------------------------------------------------
# Bad input: a clear error before any kernel runs.

def _valid():
    q, k, v, dout = _packed_inputs([3, 4], [5, 2], 2, 1, 16, "float32", seed=0)
    return q, k, v, _cu([3, 4]), _cu([5, 2])


BAD_INPUTS = {
    "cu-dtype": (dict(cu_seqlens_q=np.array([0, 3, 7], np.int64)), TypeError, "cu_seqlens_q must have dtype int32"),
    "cu-shape": (dict(cu_seqlens_k=np.array([[0, 5, 7]], np.int32)), ValueError,
                 r"cu_seqlens_k must have shape \(batch \+ 1,\)"),
    "cu-start": (dict(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    "cu-order": (dict(cu_seqlens_k=np.array([0, 6, 5, 7], np.int32)), ValueError,
                 "cu_seqlens_k must be nondecreasing"),
    "cu-total": (dict(cu_seqlens_q=np.array([0, 3, 6], np.int32)), ValueError,
                 r"cu_seqlens_q\[-1\] must equal total_q"),
    "cu-batch": (dict(cu_seqlens_k=np.array([0, 7], np.int32)), ValueError, "the same length"),
    "max-short": (dict(max_seqlen_q=3), ValueError,
                  r"max_seqlen_q must be at least the longest sequence of cu_seqlens_q \(4\)"),
    "max-type": (dict(max_seqlen_k=2.5), TypeError, "max_seqlen_k must be an int"),
    "q-ndim": (dict(q=np.zeros((1, 7, 2, 16), np.float32)), ValueError,
               r"q must have 3 dimensions \(total_q, nheads, headdim\)"),
    "fa1": (dict(algorithm="fa1"), ValueError, "varlen is supported by algorithm='fa2' only, got algorithm='fa1'"),
    "alibi": (dict(alibi_slopes=np.ones((3, 2), np.float32)), ValueError, "alibi_slopes must have shape"),
}


@pytest.mark.parametrize("change, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_varlen_input_is_refused_before_any_kernel(change, error, message):
    q, k, v, cu_q, cu_k = _valid()
    args = {**dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), **change}
    with sim.record() as records, pytest.raises(error, match=message):
        cuflash.attention_varlen(**args)
    assert records.launches == []


def test_backward_checks_the_varlen_lse_layout():
    q, k, v, cu_q, cu_k = _valid()
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(nheads, total_q\) = \(2, 7\)"):
        cuflash.attention_varlen_backward(q, q, k, v, out, lse.T.copy(), cu_q, cu_k)


def test_empty_batches_and_no_keys():
    """No query row at all, and sequences with no key: zeros and -inf without a launch where nothing is seen."""
    _, k, v, _, _ = _valid()
    q = np.zeros((0, 2, 16), np.float32)
    out, lse = cuflash.attention_varlen(q, k, v, np.zeros(3, np.int32), _cu([5, 2]), return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    grads = cuflash.attention_varlen_backward(q, q, k, v, out, lse, np.zeros(3, np.int32), _cu([5, 2]))
    assert all(np.all(g == 0) for g in grads[1:]) and grads[0].shape == q.shape
    q = np.ones((4, 2, 16), np.float32)
    no_keys = np.zeros((0, 1, 16), np.float32)
    out, lse = cuflash.attention_varlen(q, no_keys, no_keys, _cu([1, 3]), np.zeros(3, np.int32), return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)


# ---- used prefixes: seqused_q / seqused_k --------------------------------------------------------------------

# (lengths_q, lengths_k, seqused_q, seqused_k): empty, whole and partial prefixes, a prefix of no key, one of no row.
SEQUSED_PACKINGS = {
    "ragged": ([5, 0, 70, 33], [9, 3, 40, 0], [3, 0, 70, 20], [9, 1, 17, 0]),
    "one-long": ([130], [203], [77], [150]),
    "single-rows": ([1, 1, 1], [1, 64, 2], [1, 0, 1], [0, 50, 2]),
}
SEQUSED_GIVEN = ("q", "k", "both")
SEQUSED_OPTIONS = ("plain", "causal", "window", "window-causal-softcap-alibi-dropout")


def _seqused_cases():
    """Every option set and packing in rotation, every dtype with every choice of counts given (nine cases)."""
    cases = []
    for i in range(9):
        option_name, dtype = SEQUSED_OPTIONS[i % 4], DTYPES[i % 3]
        packing, given = list(SEQUSED_PACKINGS)[(i + 1) % 3], SEQUSED_GIVEN[(i + i // 3) % 3]
        cases.append(pytest.param(packing, given, option_name, dtype, id=f"{option_name}-{dtype}-{packing}-{given}"))
    return cases


def test_seqused_grid_keeps_every_value_of_every_axis():
    values = [c.values for c in _seqused_cases()]
    for axis, expected in enumerate((set(SEQUSED_PACKINGS), set(SEQUSED_GIVEN), set(SEQUSED_OPTIONS), set(DTYPES))):
        assert {v[axis] for v in values} == expected


def _prefixes(x, lengths, used):
    """The rows of packed ``x`` in the used prefix of each sequence, packed again."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.concatenate([x[s:s + u] for s, u in zip(starts, used)])


@pytest.mark.parametrize("packing, given, option_name, dtype", _seqused_cases())
def test_seqused_is_attention_of_the_used_prefixes_alone(packing, given, option_name, dtype):
    """Against the float64 reference of the prefixes packed alone (FA2's rule: the mask at the used lengths), and
    bit for bit what cuflash gives on those prefixes; the unused rows: out 0, lse -inf, zero gradients."""
    lengths_q, lengths_k, used_q, used_k = SEQUSED_PACKINGS[packing]
    used_q = used_q if given in ("q", "both") else lengths_q
    used_k = used_k if given in ("k", "both") else lengths_k
    counts = {name: np.array(used, np.int32) for name, used, on in (("seqused_q", used_q, given != "k"),
                                                                    ("seqused_k", used_k, given != "q")) if on}
    nheads, nheads_k, headdim = HEADS[len(option_name) % len(HEADS)]
    seed = len(packing) + len(option_name)
    q, k, v, dout = _packed_inputs(lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, seed)
    options = _options(option_name, len(lengths_q), nheads, seed)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)

    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **counts, **options)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **counts, **options)

    # The used prefixes packed alone: what the used rows must hold.
    q_used, dout_used = _prefixes(q, lengths_q, used_q), _prefixes(dout, lengths_q, used_q)
    k_used, v_used = _prefixes(k, lengths_k, used_k), _prefixes(v, lengths_k, used_k)
    cu_used = (_cu(used_q), _cu(used_k))
    want_out, want_lse = cuflash.attention_varlen(q_used, k_used, v_used, *cu_used, return_lse=True, **options)
    rows_q = ~cuflash._validation.unused_rows(cu_q, np.array(used_q, np.int32), len(q))
    rows_k = ~cuflash._validation.unused_rows(cu_k, np.array(used_k, np.int32), len(k))
    assert np.array_equal(out[rows_q], want_out) and np.array_equal(lse[:, rows_q], want_lse)
    assert np.all(out[~rows_q].astype(np.float32) == 0) and np.all(lse[:, ~rows_q] == -np.inf)

    ref_options = _reference_options(options, used_q, used_k, nheads)
    ref = tol.forward_references(q_used, k_used, v_used, cu_seqlens=cu_used, **ref_options)
    atol = 4 * options.get("softcap", 0.0) * 2.0**-23
    tol.check_close("out", out[rows_q], ref.out, ref.out_lowp, tol.FORWARD_FACTOR, atol=atol)
    tol.check_close("lse", lse[:, rows_q], ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR, atol=atol)
    bref = tol.backward_references(dout_used, q_used, k_used, v_used, cu_seqlens=cu_used, **ref_options)
    for name, got, rows in zip(("dq", "dk", "dv"), grads, (rows_q, rows_k, rows_k)):
        tol.check_close(name, got[rows], getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                        atol=1e-5)
        assert np.all(got[~rows].astype(np.float32) == 0), name


SEQUSED_BAD = {
    "above-length": (dict(seqused_k=np.array([5, 3], np.int32)), ValueError,
                     r"seqused_k\[1\] must be in 0..2 \(sequence 1's length in cu_seqlens_k\), got 3"),
    "negative": (dict(seqused_q=np.array([-1, 4], np.int32)), ValueError, r"seqused_q\[0\] must be in 0..3"),
    "dtype": (dict(seqused_q=np.array([1, 1], np.int64)), TypeError, "seqused_q must have dtype int32"),
    "shape": (dict(seqused_k=np.array([1, 1, 1], np.int32)), ValueError,
              r"seqused_k must have shape \(batch,\) = \(2,\)"),
}


@pytest.mark.parametrize("change, error, message", SEQUSED_BAD.values(), ids=SEQUSED_BAD.keys())
def test_bad_seqused_is_refused_before_any_kernel(change, error, message):
    q, k, v, cu_q, cu_k = _valid()
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True)
    with sim.record() as records:
        with pytest.raises(error, match=message):
            cuflash.attention_varlen(q, k, v, cu_q, cu_k, **change)
        with pytest.raises(error, match=message):
            cuflash.attention_varlen_backward(q, q, k, v, out, lse, cu_q, cu_k, **change)
    assert records.launches == []
