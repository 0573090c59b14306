"""DLPack: cuflash.attention on JAX (and PyTorch) arrays without copies, and the examples/ round trip.

What "without copies" means is checked by address: the arrays run_program binds to the kernels' pointer
fields must be the caller's buffers (inputs) and the buffers the caller gets back (outputs). The CPU half runs
here; the GPU half is marked ``gpu`` (it also needs a CUDA build of JAX, or PyTorch with CUDA).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api  # noqa: E402
from cuflash.mask import Mask  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dlpack_cupy_jax.py"


def load_example():
    spec = importlib.util.spec_from_file_location("dlpack_cupy_jax", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bound_addresses(monkeypatch):
    """Records the address of every array a prepared program binds to a kernel argument, by field name."""
    seen: dict[str, int] = {}
    for method in ("run", "launch"):  # launch: a forward's (its scratch reusable), run: a backward's
        original = getattr(api.PreparedProgram, method)

        def recording(self, backend, arrays, _original=original):
            seen.update({name: backend.address(array) for name, array in arrays.items()})
            return _original(self, backend, arrays)

        monkeypatch.setattr(api.PreparedProgram, method, recording)
    return seen


def test_example_cpu_round_trip_shares_buffers():
    shared = load_example().cpu_round_trip()
    assert shared == {"numpy->jax": True, "jax->numpy": True}


def test_example_aligned_numpy_is_what_jax_adopts():
    example = load_example()
    aligned = example.aligned_numpy((3, 5), np.float32)
    assert aligned.ctypes.data % 64 == 0 and aligned.shape == (3, 5)
    assert example.jax_address(example.numpy_to_jax(aligned)) == aligned.ctypes.data
    # The rule the helper exists for: a misaligned NumPy buffer is silently copied by JAX.
    misaligned = np.zeros(17, np.float32)[1:]
    if misaligned.ctypes.data % 64:
        assert example.jax_address(example.numpy_to_jax(misaligned)) != misaligned.ctypes.data


def test_jax_cpu_arrays_reach_the_kernels_without_a_copy(bound_addresses):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 8, 2, 32), (1, 9, 1, 32), (1, 9, 1, 32)))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    for name, array in (("q", q), ("k", k), ("v", v)):
        assert bound_addresses[name] == array.unsafe_buffer_pointer(), name
    # Outputs are allocated 64-byte aligned, so JAX adopts them instead of copying.
    for name, array in (("out", out), ("lse", lse)):
        assert bound_addresses[name] == array.unsafe_buffer_pointer(), name
    np.testing.assert_allclose(np.asarray(out), cuflash.attention(*(np.asarray(x) for x in (q, k, v)), causal=True))


# ---------------------------------------------------------------------------
# GPU


def _jax_gpu_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


needs_jax_gpu = pytest.mark.skipif(not _jax_gpu_devices(), reason="needs a CUDA build of JAX with a GPU")


@pytest.mark.gpu
@needs_jax_gpu
def test_jax_gpu_arrays_in_and_out_without_a_copy(bound_addresses):
    device = _jax_gpu_devices()[0]
    rng = np.random.default_rng(1)
    q, k, v = (
        jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.bfloat16), device)
        for s in ((2, 64, 4, 64), (2, 80, 2, 64), (2, 80, 2, 64))
    )
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and out.devices() == {device}
    for name, array in (("q", q), ("k", k), ("v", v)):
        assert bound_addresses[name] == array.unsafe_buffer_pointer(), name
    assert out.unsafe_buffer_pointer() == bound_addresses["out"]
    assert lse.unsafe_buffer_pointer() == bound_addresses["lse"]
    expected = cuflash.attention(*(np.asarray(x) for x in (q, k, v)), causal=True)  # the simulator
    np.testing.assert_allclose(np.asarray(out, np.float32), expected.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_torch_cuda_tensors_in_and_out_without_a_copy(bound_addresses):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    generator = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (
        torch.randn(s, device="cuda", dtype=torch.float16, generator=generator)
        for s in ((2, 64, 4, 64), (2, 80, 2, 64), (2, 80, 2, 64))
    )
    dq, dk, dv = cuflash.attention_backward(q, q, k, v, *cuflash.attention(q, k, v, return_lse=True))
    out = cuflash.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        assert bound_addresses[name] == tensor.data_ptr(), name
    assert out.data_ptr() == bound_addresses["out"]
    assert isinstance(dq, torch.Tensor) and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.gpu
@needs_jax_gpu
def test_example_gpu_round_trip_shares_buffers():
    pytest.importorskip("cupy")
    shared = load_example().gpu_round_trip()
    assert shared == {"cupy->jax": True, "jax->cupy": True}


@pytest.mark.gpu
@needs_jax_gpu
def test_cuflash_jax_on_a_gpu_matches_the_simulator():
    """The CUDA FFI handler: NVRTC CUBINs launched on XLA's stream; registry filled while lowering."""
    from cuflash.jax import _ffi, _primitives
    from cuflash.kernels import plans
    from cuflash.kernels.program import Problem

    import cuflash.jax as cfj

    device = _jax_gpu_devices()[0]
    rng = np.random.default_rng(3)
    shapes = ((2, 33, 4, 64), (2, 47, 2, 64), (2, 47, 2, 64))
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    weights = rng.standard_normal(shapes[0]).astype(np.float32)
    q, k, v = (jax.device_put(jnp.asarray(x, jnp.float16), device) for x in host)

    def loss(q, k, v):
        return jnp.sum(cfj.attention(q, k, v, causal=True).astype(jnp.float32) * weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    arch = _primitives.local_cuda_archs()[0]
    problem = Problem("float16", 2, 33, 47, 4, 2, 64, mask=Mask.causal())
    for plan in plans.backward_program("fa2", problem, _primitives.target_for("cuda")).launches:
        assert _ffi.module_image_registered(plan.kernel.name_expr, arch)
    host16 = [np.asarray(x) for x in (q, k, v)]
    out, lse = cuflash.attention(*host16, causal=True, return_lse=True)
    expected = cuflash.attention_backward(weights.astype(np.float16), *host16, out, lse, causal=True)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(g, np.float32), e.astype(np.float32), rtol=2e-2, atol=2e-2)
