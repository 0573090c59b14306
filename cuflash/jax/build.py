"""Build (or find in the cache) the cuflash JAX FFI handler library: ``python -m cuflash.jax.build``.

Prints the library path, which platforms it serves and, per platform, the stages of its handler and the traits
XLA will read from it. Useful to pay the one-time C++ build at install or image-build time instead of at the
first traced call.
"""

from __future__ import annotations

from . import _ffi


def main() -> None:
    path = _ffi.library_path()
    _ffi.register_targets()
    platforms = [platform for platform in _ffi.PLATFORMS if _ffi.handler_bundle(platform) is not None]
    print(path)
    print("platforms:", ", ".join(platforms))
    for platform in platforms:
        compatible = _ffi.execute_handler_traits(platform) & _ffi.COMMAND_BUFFER_COMPATIBLE
        print(f"{platform} handler: instantiate + execute" + (", command-buffer compatible" if compatible else ""))
    status = _ffi.cuda_driver_status()
    print("CUDA driver:", status or "usable")


if __name__ == "__main__":
    main()
