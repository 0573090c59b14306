"""Build (or find in the cache) the cuflash JAX FFI handler library: ``python -m cuflash.jax.build``.

Prints the library path and which platforms it serves. Useful to pay the one-time
C++ build at install or image-build time instead of at the first traced call.
"""

from __future__ import annotations

from . import _ffi


def main() -> None:
    path = _ffi.library_path()
    _ffi.register_targets()
    platforms = ["cpu"] + (["CUDA"] if _ffi.has_cuda_handler() else [])
    print(path)
    print("platforms:", ", ".join(platforms))
    status = _ffi.cuda_driver_status()
    print("CUDA driver:", status or "usable")


if __name__ == "__main__":
    main()
