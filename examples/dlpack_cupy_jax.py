"""Moving arrays between CuPy, JAX and NumPy without copies (DLPack), around cuflash calls.

    python examples/dlpack_cupy_jax.py

On a machine with a GPU (CuPy and a CUDA build of JAX): CuPy arrays become JAX
arrays and back without a copy, and ``cuflash.attention`` takes the JAX GPU
arrays directly (it imports them through ``cupy.from_dlpack`` and hands its
results back as JAX arrays, again through DLPack). Without a GPU the same is
shown on the CPU with NumPy <-> JAX, where cuflash runs in its simulator.

Rules of thumb, all checked below by comparing buffer addresses:
  - producer -> consumer through DLPack shares the buffer; nothing is copied.
  - JAX arrays are immutable: a view of one in CuPy/NumPy must not be written
    (NumPy views come back read-only; cuflash never writes its inputs).
  - JAX adopts a NumPy buffer only if it is 64-byte aligned; otherwise
    ``jnp.from_dlpack`` silently copies. ``aligned_numpy`` allocates so it adopts.
  - On a GPU, ``__dlpack__(stream=...)`` lets the consumer's stream wait for the
    producer's work, so no explicit synchronization is needed in between.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------
# The conversions (each one zero-copy).


def cupy_to_jax(array):
    import jax.dlpack

    return jax.dlpack.from_dlpack(array)


def jax_to_cupy(array):
    import cupy

    return cupy.from_dlpack(array)


def numpy_to_jax(array: np.ndarray):
    import jax.numpy as jnp

    return jnp.from_dlpack(array)


def jax_to_numpy(array) -> np.ndarray:
    return np.from_dlpack(array)


def aligned_numpy(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised NumPy array whose buffer starts on an ``alignment``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def jax_address(array) -> int:
    return array.unsafe_buffer_pointer()


# ---------------------------------------------------------------------------
# The two demonstrations.


def cpu_round_trip(seed: int = 0) -> dict[str, bool]:
    """NumPy -> JAX -> cuflash (simulator) -> NumPy; returns which hops shared their buffer."""
    import cuflash
    import cuflash.jax

    rng = np.random.default_rng(seed)
    q = aligned_numpy((1, 16, 2, 32), np.float32)
    q[...] = rng.standard_normal(q.shape)
    q_jax = numpy_to_jax(q)
    shared = {"numpy->jax": jax_address(q_jax) == q.ctypes.data}

    out_jax = cuflash.jax.attention(q_jax, q_jax, q_jax, causal=True)  # the XLA custom call
    out_np = jax_to_numpy(out_jax)
    shared["jax->numpy"] = out_np.ctypes.data == jax_address(out_jax)

    # cuflash.attention accepts the JAX arrays too (through DLPack) and answers in JAX arrays.
    again = cuflash.attention(q_jax, q_jax, q_jax, causal=True)
    np.testing.assert_allclose(np.asarray(again), out_np, rtol=1e-6, atol=1e-6)
    return shared


def gpu_round_trip(seed: int = 0) -> dict[str, bool]:
    """CuPy -> JAX (GPU) -> cuflash -> CuPy; returns which hops shared their buffer."""
    import cupy

    import cuflash

    rng = cupy.random.default_rng(seed)
    q = rng.standard_normal((2, 128, 4, 64), dtype=cupy.float32).astype(cupy.float16)
    q_jax = cupy_to_jax(q)
    shared = {"cupy->jax": jax_address(q_jax) == q.data.ptr}
    out_jax = cuflash.attention(q_jax, q_jax, q_jax, causal=True)  # JAX GPU arrays in, JAX array out
    out = jax_to_cupy(out_jax)
    shared["jax->cupy"] = out.data.ptr == jax_address(out_jax)
    expected = cuflash.attention(q, q, q, causal=True)
    cupy.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-3)
    return shared


def _gpu_available() -> bool:
    try:
        import cupy
        import jax

        return cupy.cuda.runtime.getDeviceCount() > 0 and bool(jax.devices("cuda"))
    except Exception:  # no CuPy, no driver, or a CPU-only JAX
        return False


def main() -> None:
    if _gpu_available():
        print("GPU:", gpu_round_trip())
    else:
        print("no GPU with CuPy and CUDA JAX here; CPU:", cpu_round_trip())


if __name__ == "__main__":
    main()
