"""cuflash for JAX: the library's kernels as an XLA FFI custom call.

    import cuflash.jax
    out = cuflash.jax.attention(q, k, v, causal=True)          # jit, grad, vmap, shard_map

One custom call per launch-plan Program (the forward, or the backward), handled
by C++ FFI handlers (cuda_src/ffi/): on CUDA they launch the NVRTC CUBINs with
the driver API on XLA's stream; on the CPU they run the same kernels in the
simulator. The handler library (plain C++, loaded with cffi's ABI mode) is built at first use and cached under
``cuflash._paths.cache_dir("jax_ffi")`` ($CUFLASH_CACHE_DIR/jax_ffi, default
~/.cache/cuflash/jax_ffi); ``python -m cuflash.jax.build`` builds it ahead of time.

Importing this module registers the ``cuflash_program`` targets with JAX and a resolver with the handlers, so
an executable exported with ``jax.export`` (pass
``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("cuflash_program")]``) runs after
``jax.export.deserialize`` in a process that never lowered it: its kernels are built and registered on first
execution. A call lowered by another cuflash version is refused.
"""

from ._attention import (attention, attention_kvpacked, attention_qkvpacked, attention_varlen, dropout_seed,
                         ring_attention)
from ._dot_product import dot_product_attention
from ._flex import flex_attention
from ..flex import create_block_mask
from ._kvcache import attention_with_kvcache
from ._ffi import FfiBuildError as _FfiBuildError
from ._primitives import install as _install

try:
    _install()
except _FfiBuildError:
    pass  # raised again, with the compiler's output, when a call is first lowered

__all__ = ["create_block_mask", "flex_attention", "attention", "attention_kvpacked", "attention_qkvpacked", "attention_varlen", "attention_with_kvcache",
           "dot_product_attention", "dropout_seed", "ring_attention"]
