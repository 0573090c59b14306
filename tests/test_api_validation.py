"""Bad input raises a clear ValueError/TypeError naming the argument, before any kernel runs.

The simulator's launch is replaced by a function that fails the test, so any
check that lets bad input reach a kernel shows up here.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.backends import simulator
from cuflash.kernels import catalog

from cuflash.testing import numpy_dtype


@pytest.fixture(autouse=True)
def no_kernel_may_run(monkeypatch):
    def forbidden(self, plan, params, buffers):
        raise AssertionError(f"a kernel ({plan.kernel}) was launched for invalid input")

    monkeypatch.setattr(simulator.SimulatorBackend, "launch", forbidden)


def arrays(b=2, sq=5, sk=7, h=4, hk=2, d=16, dtype="float32"):
    dt = numpy_dtype(dtype)
    return (
        np.zeros((b, sq, h, d), dt),
        np.zeros((b, sk, hk, d), dt),
        np.zeros((b, sk, hk, d), dt),
    )


ALGORITHM = "standard"


def call(q, k, v, **kw):
    kw.setdefault("algorithm", ALGORITHM)
    return cuflash.attention(q, k, v, **kw)


@pytest.mark.parametrize(
    "mutate, error, words",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, ["q", "4 dimensions"]),
        (lambda q, k, v: (q, k[..., None], v), ValueError, ["k", "4 dimensions"]),
        (lambda q, k, v: (q, k, v[:, :3]), ValueError, ["v must have k's shape", "but for the head dim"]),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, ["batch"]),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, ["head dim"]),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, ["multiple of nheads_k"]),
        (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), ValueError, ["1..256"]),
        (
            lambda q, k, v: tuple(np.zeros(a.shape[:3] + (264,), np.float32) for a in (q, k, v)),
            ValueError,
            ["1..256", "264"],
        ),
        (lambda q, k, v: (q.astype(np.float64), k, v), TypeError, ["q", "float16, bfloat16 or float32", "float64"]),
        (lambda q, k, v: (q, k.astype(np.float16), v), TypeError, ["same dtype"]),
        (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, ["q", "int32"]),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, ["q", "NumPy or CuPy", "list"]),
    ],
)
def test_forward_rejects(mutate, error, words):
    q, k, v = mutate(*arrays())
    with pytest.raises(error) as info:
        call(q, k, v)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_softmax_scale_must_be_finite_positive(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        call(*arrays(), softmax_scale=scale)


def test_softmax_scale_type():
    with pytest.raises(TypeError, match="softmax_scale"):
        call(*arrays(), softmax_scale="0.1")


def test_flags_must_be_bool():
    with pytest.raises(TypeError, match="causal"):
        call(*arrays(), causal="yes")
    with pytest.raises(TypeError, match="return_lse"):
        call(*arrays(), return_lse=1)


def test_unknown_algorithm_names_the_available_ones():
    with pytest.raises(ValueError) as info:
        call(*arrays(), algorithm="fa9")
    assert "fa9" in str(info.value)
    for name in catalog.algorithms():
        assert name in str(info.value)


def backward_args(**kw):
    q, k, v = arrays(**kw)
    out = np.zeros_like(q)
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    return dict(dout=np.zeros_like(q), q=q, k=k, v=v, out=out, lse=lse)


@pytest.mark.parametrize(
    "name, bad, error, words",
    [
        ("dout", lambda a: a["dout"][:, :2], ValueError, ["dout", "must have shape (2, 5, 4, 16) (q's, with v's"]),
        ("dout", lambda a: a["dout"].astype(np.float16), TypeError, ["dout", "dtype of q"]),
        ("out", lambda a: a["out"][..., :4], ValueError, ["out", "must have shape (2, 5, 4, 16)", "got (2, 5, 4, 4)"]),
        ("lse", lambda a: a["lse"][:, :, :2], ValueError, ["lse", "(batch, nheads, seqlen_q)"]),
        ("lse", lambda a: a["lse"].astype(np.float16), TypeError, ["lse", "float32"]),
        ("lse", lambda a: a["lse"][0], ValueError, ["lse"]),
    ],
)
def test_backward_rejects(name, bad, error, words):
    args = backward_args()
    args[name] = bad(args)
    with pytest.raises(error) as info:
        cuflash.attention_backward(**args, algorithm=ALGORITHM)
    for word in words:
        assert word in str(info.value)


def test_deterministic_must_be_bool():
    with pytest.raises(TypeError, match="deterministic"):
        cuflash.attention_backward(**backward_args(), algorithm=ALGORITHM, deterministic=None)


def test_numpy_mixed_with_other_arrays():
    q, k, v = arrays()

    class NotAnArray:
        shape = q.shape

    with pytest.raises(TypeError, match="k must be a NumPy or CuPy array"):
        call(q, NotAnArray(), v)


def test_empty_sequences_need_no_kernel():
    # seqlen_q = 0: empty outputs; seqlen_k = 0: every row sees no key -> out 0, lse -inf.
    q, k, v = arrays(sq=0)
    out, lse = call(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 0)
    q, k, v = arrays(sk=0)
    out, lse = call(q, k, v, return_lse=True)
    assert out.shape == q.shape and np.all(out == 0) and np.all(lse == -np.inf)
    args = backward_args(sk=0)
    dq, dk, dv = cuflash.attention_backward(**args, algorithm=ALGORITHM)
    assert np.all(dq == 0) and dk.shape == args["k"].shape and dv.shape == args["v"].shape


def test_non_contiguous_last_dimension_is_copied(monkeypatch):
    # Undo the no-kernel fixture: this input is valid and must run.
    monkeypatch.undo()
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((1, 9, 2, 32)).astype(np.float32)
    k = rng.standard_normal((1, 11, 2, 16)).astype(np.float32)
    q = wide[..., ::2]  # last-dimension stride of 2 elements
    reversed_k = k[:, ::-1]  # negative row stride
    v = np.ascontiguousarray(k)
    expected = cuflash.attention(np.ascontiguousarray(q), np.ascontiguousarray(reversed_k), v, algorithm=ALGORITHM)
    got = cuflash.attention(q, reversed_k, v, algorithm=ALGORITHM)
    assert np.array_equal(got, expected)


OPTION_ERRORS = [
    (dict(window_size=(-2, 0)), ValueError, ["window_size[0]", ">= -1"]),
    (dict(window_size=(3, -5)), ValueError, ["window_size[1]", ">= -1"]),
    (dict(window_size=(1.5, 0)), TypeError, ["window_size[0]", "int"]),
    (dict(window_size=(True, 0)), TypeError, ["window_size[0]", "int"]),
    (dict(window_size=3), TypeError, ["window_size", "pair"]),
    (dict(window_size=(1, 2, 3)), TypeError, ["window_size", "pair"]),
    (dict(softcap=-1.0), ValueError, ["softcap", ">= 0"]),
    (dict(softcap=float("nan")), ValueError, ["softcap", "finite"]),
    (dict(softcap=float("inf")), ValueError, ["softcap", "finite"]),
    (dict(softcap="2"), TypeError, ["softcap", "real number"]),
    (dict(alibi_slopes=np.zeros(4, np.float64)), TypeError, ["alibi_slopes", "float32", "float64"]),
    (dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, ["alibi_slopes", "(nheads,)", "(batch, nheads)", "(3,)"]),
    (dict(alibi_slopes=np.zeros((2, 4, 1), np.float32)), ValueError, ["alibi_slopes", "shape"]),
    (dict(alibi_slopes=[0.1] * 4), TypeError, ["alibi_slopes", "list"]),
    (dict(softcap=1.0, algorithm="fa1"), ValueError, ["softcap", "algorithm='fa2'", "'fa1'"]),
    (dict(alibi_slopes=np.zeros(4, np.float32), algorithm="standard"), ValueError, ["alibi", "'fa2'", "'standard'"]),
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, ["dropout_p", "[0, 1)"]),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, ["dropout_p", "[0, 1)"]),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, ["dropout_p", "[0, 1)"]),
    (dict(dropout_p="0.1", dropout_seed=1), TypeError, ["dropout_p", "real number"]),
    (dict(dropout_p=0.1), ValueError, ["dropout_seed", "required"]),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, ["dropout_seed", "int"]),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, ["dropout_seed", "2**64"]),
    (dict(dropout_p=0.1, dropout_seed=2**64), ValueError, ["dropout_seed", "2**64"]),
    (dict(dropout_p=0.1, dropout_seed=3, algorithm="fa1"), ValueError, ["dropout", "'fa2'", "'fa1'"]),
]


@pytest.mark.parametrize("options, error, words", OPTION_ERRORS)
def test_options_are_checked_before_any_kernel(options, error, words):
    for run in (lambda: call(*arrays(), **options), lambda: cuflash.attention_backward(**backward_args(), **options)):
        options.setdefault("algorithm", "fa2")
        with pytest.raises(error) as info:
            run()
        for word in words:
            assert word in str(info.value), str(info.value)
