"""What the first GPU run needs from the GPU-only code paths, checked here with stand-ins (issue [ready]).

- AttentionParams (488 bytes) reaches CuPy in a form every CuPy 14 passes by value: a stand-in for CuPy 14.0's
  kernel-argument rule refuses a numpy.void that large, as CuPy 14.0.x does (its scalar path asserts the item
  fits 64 bytes), and the launch must get past it with the packed bytes intact.
- CUDA arrays of other libraries are exported for cuflash's launch stream, and the DLPack READ_ONLY flag is read.
- KV caches that arrive read-only are refused by name before anything is written, on every backend alike.
- Imported arrays are held until the work queued on the launch stream is done.
- bfloat16 without ml_dtypes is an error naming the package.
The gpu-marked twins (JAX and PyTorch producers on their own streams) are at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _dlpack, _dtypes, sim
from cuflash.backends import cupy_gpu
from cuflash.kernels import plans
from cuflash.kernels.params import PARAMS_DTYPE, pack_params
from cuflash.kernels.program import LaunchPlan, Problem
from cuflash.testing import random_qkv

# CuPy 14.0.x's CScalar keeps a scalar in 2 x long double (32 bytes on x86-64... and asserts itemsize < 64).
_CUPY_14_0_SCALAR_LIMIT = 64


class Cupy140Kernel:
    """A stand-in for a CuPy 14.0.x RawKernel call: the argument rules of its launch path, recording the bytes each
    argument passes by value."""

    max_threads_per_block = 1024

    def __init__(self):
        self.passed: list[bytes] = []

    def __call__(self, grid, block, args, shared_mem=0):
        for arg in args:
            if isinstance(arg, np.ndarray):  # CNumpyArray: one element, passed by value, itemsize bytes
                if arg.size != 1:
                    raise TypeError("You are trying to pass a numpy.ndarray of more than one element")
                self.passed.append(arg.tobytes())
            elif isinstance(arg, np.generic):  # CScalar._store_c_value
                assert arg.dtype.itemsize < _CUPY_14_0_SCALAR_LIMIT
                self.passed.append(arg.tobytes())
            else:
                raise TypeError(f"Unsupported type {type(arg)}")


def _packed_params() -> np.void:
    problem = Problem("float16", 2, 100, 120, 8, 2, 64)
    return pack_params(problem, softmax_scale=0.125, pointers={"q": 0x1000, "k": 0x2000}, strides={"q": (1, 2, 3)})


def test_params_are_larger_than_cupy_14_0s_scalars():
    assert PARAMS_DTYPE.itemsize >= _CUPY_14_0_SCALAR_LIMIT  # why the form matters at all


def test_the_stand_in_refuses_what_cupy_14_0_refuses():
    with pytest.raises(AssertionError):
        Cupy140Kernel()((1, 1, 1), (32, 1, 1), (_packed_params(),))


def test_launch_passes_params_in_a_form_cupy_14_0_takes(monkeypatch):
    kernel = Cupy140Kernel()
    monkeypatch.setattr(cupy_gpu, "function", lambda *args: kernel)
    backend = object.__new__(cupy_gpu.CupyBackend)
    backend.device_id = 0
    backend.code = type("Code", (), {"compile_arch": "sm_90"})()
    params = _packed_params()
    problem = Problem("float16", 2, 100, 120, 8, 2, 64)
    plan = plans.forward_program("fa2", problem, sim.current_target()).launches[0]
    assert isinstance(plan, LaunchPlan)
    backend.launch(plan, params, [])
    assert kernel.passed == [params.tobytes()]
    assert len(kernel.passed[0]) == PARAMS_DTYPE.itemsize


class Producer:
    """A CUDA-looking DLPack producer backed by a NumPy array: records the stream it was asked to order for."""

    def __init__(self, array: np.ndarray):
        self._array = array
        self.streams: list = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *, stream=None, **options):
        self.streams.append(stream)
        return self._array.__dlpack__(**options)


@pytest.mark.parametrize("writeable", [True, False])
def test_export_names_cuflashs_stream_and_reads_the_read_only_flag(writeable):
    array = np.zeros(4, np.float32)
    array.flags.writeable = writeable
    producer = Producer(array)
    exported = cupy_gpu.OnStream(producer, stream=0xBEEF)
    # Whatever stream the importer (CuPy) names, the producer is asked for cuflash's.
    capsule = exported.__dlpack__(stream=7, max_version=(1, 0))
    assert producer.streams == [0xBEEF]
    assert exported.__dlpack_device__() == (2, 0)
    assert exported.read_only is (not writeable)
    assert np.from_dlpack(type("C", (), {"__dlpack__": lambda self, **kw: capsule,
                                         "__dlpack_device__": lambda self: (1, 0)})()).shape == (4,)


def test_read_only_flag_of_a_capsule():
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    assert _dlpack.dlpack_capsule_read_only(read_only.__dlpack__(max_version=(1, 0)))
    assert not _dlpack.dlpack_capsule_read_only(np.zeros(3).__dlpack__(max_version=(1, 0)))
    assert not _dlpack.dlpack_capsule_read_only(np.zeros(3).__dlpack__())  # unversioned: no flags to read


def test_jax_arrays_are_read_only_whatever_their_capsule_says():
    jax = pytest.importorskip("jax")
    # JAX exports unversioned capsules (no flags), yet its arrays are immutable.
    assert _dlpack.immutable_array_type(jax.numpy.zeros(3))
    assert not _dlpack.immutable_array_type(Producer(np.zeros(3)))


def _decode_case(rng, dtype="float16"):
    q = random_qkv(rng, 2, 1, 1, 4, 2, 32, dtype)[0]
    k_cache, v_cache = (rng.standard_normal((2, 64, 2, 32)).astype(q.dtype) for _ in range(2))
    k_new, v_new = (rng.standard_normal((2, 1, 2, 32)).astype(q.dtype) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new


@pytest.mark.parametrize("read_only", ["k_cache", "v_cache"])
def test_read_only_numpy_cache_is_refused_before_anything_is_written(read_only):
    q, k_cache, v_cache, k_new, v_new = _decode_case(np.random.default_rng(0))
    caches = {"k_cache": k_cache, "v_cache": v_cache}
    before = {name: c.copy() for name, c in caches.items()}
    caches[read_only].flags.writeable = False
    with pytest.raises(ValueError, match=f"{read_only} is read-only .*cuflash.jax.attention_with_kvcache"):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                       cache_seqlens=np.array([3, 5], np.int32))
    for name, cache in caches.items():
        assert np.array_equal(cache, before[name]), f"{name} was written"


def test_jax_caches_are_refused_and_point_to_the_jax_function():
    jax = pytest.importorskip("jax")
    q, k_cache, v_cache, k_new, v_new = _decode_case(np.random.default_rng(1), "float32")
    with pytest.raises(ValueError, match="k_cache is read-only .*cuflash.jax.attention_with_kvcache"):
        cuflash.attention_with_kvcache(jax.numpy.asarray(q), jax.numpy.asarray(k_cache), jax.numpy.asarray(v_cache),
                                       k=jax.numpy.asarray(k_new), v=jax.numpy.asarray(v_new),
                                       cache_seqlens=np.array([3, 5], np.int32))


class FakeEvent:
    def __init__(self):
        self.done = False


def test_in_flight_holds_until_done_and_drops_completed_entries():
    held = cupy_gpu.InFlight()
    first, second = FakeEvent(), FakeEvent()
    held.hold(first, ("a",))
    held.hold(second, ("b",))
    assert len(held) == 2
    first.done = True
    held.hold(FakeEvent(), ("c",))  # adding polls: the completed entry goes
    assert len(held) == 2
    second.done = True
    held.hold(FakeEvent(), ("d",))
    assert len(held) == 2


def test_bfloat16_without_ml_dtypes_names_the_package(monkeypatch):
    monkeypatch.setattr(_dtypes, "bfloat16_available", lambda: False)
    with pytest.raises(ImportError, match="ml_dtypes"):
        _dtypes.element_dtype("bfloat16")
    assert _dtypes.element_dtype("float16") == np.float16


def test_cuda_extras_bring_what_bfloat16_on_cupy_needs():
    import configparser
    from pathlib import Path

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    for extra in ("cuda12", "cuda13"):
        requirements = config["options.extras_require"][extra]
        assert "ml_dtypes>=" in requirements and "numpy>=2.1.2" in requirements, extra


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: producers on their own streams.


def _cupy_or_skip():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
def test_gpu_torch_producer_on_its_own_stream():
    cupy = _cupy_or_skip()
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 300, 300, 4, 2, 64, "float16")
    expected = cupy.asnumpy(cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Written on the producer's stream right before the call: the import must order cuflash's stream after it.
        tq, tk, tv = (torch.empty(x.shape, dtype=torch.float16, device="cuda") for x in (q, k, v))
        torch.cuda._sleep(10_000_000)
        for dst, src in zip((tq, tk, tv), (q, k, v)):
            dst.copy_(torch.from_numpy(src), non_blocking=False)
        out = cuflash.attention(tq, tk, tv, causal=True)
        del tq, tk, tv  # the producer drops its arrays while cuflash's kernels may still run
        torch.cuda.empty_cache()
    assert isinstance(out, torch.Tensor)
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy().view(np.uint16), expected.view(np.uint16))


@pytest.mark.gpu
def test_gpu_jax_producer_and_read_only_caches():
    _cupy_or_skip()
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 200, 260, 4, 4, 64, "float32")
    out = cuflash.attention(*(jax.device_put(x) for x in (q, k, v)))
    reference = cuflash.attention(q, k, v)  # the simulator
    np.testing.assert_allclose(np.asarray(out), reference, rtol=2e-5, atol=2e-6)
    q1, k_cache, v_cache, k_new, v_new = _decode_case(rng)
    before = k_cache.copy()
    jk = jax.device_put(k_cache)
    with pytest.raises(ValueError, match="k_cache is read-only"):
        cuflash.attention_with_kvcache(jax.device_put(q1), jk, jax.device_put(v_cache), k=jax.device_put(k_new),
                                       v=jax.device_put(v_new),
                                       cache_seqlens=jax.device_put(np.array([3, 5], np.int32)))
    assert np.array_equal(np.asarray(jk), before)
