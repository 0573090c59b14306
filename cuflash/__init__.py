"""cuflash: FlashAttention-1/2 kernels in raw CUDA C++ for CuPy and JAX.

    import cuflash
    out = cuflash.attention(q, k, v, causal=True)                 # fa2 by default
    out, lse = cuflash.attention(q, k, v, return_lse=True, algorithm="fa1")
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse)
    out = cuflash.attention_varlen(q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k)

NumPy arrays run on the CPU simulator, CuPy arrays (and CUDA arrays of other
libraries, via DLPack) on the GPU. JAX users: ``cuflash.jax.attention``.

User-defined attention variants (FlexAttention's score_mod / mask_mod, compiled into the fa2 kernels):
``cuflash.flex_attention``, ``cuflash.flex_attention_backward``, ``cuflash.create_block_mask`` (cuflash.flex;
tracing a Python mod needs JAX, so these load on first use).
"""

from .api import (attention, attention_backward, attention_kvpacked, attention_kvpacked_backward,
                  attention_qkvpacked, attention_qkvpacked_backward, attention_varlen, attention_varlen_backward,
                  attention_with_kvcache)
from .dropout import dropout_mask
from .kernels.catalog import algorithms as available_algorithms

__all__ = ["attention", "attention_backward", "attention_kvpacked", "attention_kvpacked_backward",
           "attention_qkvpacked", "attention_qkvpacked_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache", "available_algorithms", "create_block_mask", "dropout_mask", "flex_attention",
           "flex_attention_backward"]
_FLEX = ("create_block_mask", "flex_attention", "flex_attention_backward")


def __getattr__(name: str):
    """The flex entry points, imported on first use (cuflash.flex traces mods with JAX)."""
    if name in _FLEX:
        from . import flex

        return getattr(flex, name)
    raise AttributeError(f"module 'cuflash' has no attribute {name!r}")
__version__ = "0.1.0"
