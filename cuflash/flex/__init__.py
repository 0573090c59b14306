"""User-defined score and mask modifications (FlexAttention's score_mod / mask_mod) as CUDA C++.

    score_mod(score, b, h, q_idx, kv_idx) -> score   # score: the scaled float32 score before softmax
    mask_mod(b, h, q_idx, kv_idx) -> bool             # True: the score is kept
    (indices are int32 scalars; h is the query head; q_idx / kv_idx positions in the sequence)

`trace_score_mod(fn)` / `trace_mask_mod(fn)` trace a Python mod with `jax.make_jaxpr` and emit its jaxpr as
C++, one device function per mod (score mods also get `dscore`, d score_mod / d score, emitted from the
jaxpr of jax.grad in score, for the backward's dS). Mods use Python operators and jax.numpy / lax
functions: arithmetic, comparisons, &, |, ~, jnp.where, integer // and %, casts, abs, maximum, minimum,
exp, exp2, log, log1p, expm1, tanh, sqrt, rsqrt, logistic, pow, sign, floor, ceil, round, sin, cos. Arrays
they capture (also traced ones, inside jax.jit) become side arrays the kernel reads through its params, and
may be indexed with the scalar arguments (`bias[h, q_idx - kv_idx + L]`, `doc_ids[b, q_idx]`): jnp's
index wrapping, dynamic_slice's clamping and gather's modes (clip, fill) behave as JAX evaluates them.
Python numbers a mod captures, and concrete 0-d jax arrays (JAX inlines those), are constants of its code:
a new value compiles anew; arrays of one or more dims (and any traced array) are sides.
Each primitive is emitted with XLA's float32 / int32 semantics, one rounding per primitive (no FMA the
jaxpr does not have). Side dtypes: float32, float16, bfloat16, int32, bool, int8, uint8 (at most
MAX_SIDES arrays of at most MAX_SIDE_DIMS dims). A primitive with no emission, Python control flow on a
traced value, a wrong arity or a result that is not one float32 (score) / bool (mask) scalar raise a
TypeError naming the mod (its __qualname__) and the primitive or argument, before any kernel runs.

`trace_score_mod(fn, side_grads=True)` also emits `side_grads`, adding g * d score_mod / d side (g the upstream
gradient of the modded score) into float32 gradient buffers of the float side arrays with atomic adds, from
the jaxpr of jax.vjp (a gather's transpose is a scatter-add: an add at the clamped index, or none where
fill mode drops it).

`cuda_mod(source, sides, kind=...)` is the expert form: the function body in C++, side arrays by name.

Calling convention (cuda_src/common/flex_mod.cuh): a FlexMod's `source` defines
`cuflash::flex::mods::<struct_name>` with static __device__ functions
`float score(float score, int b, int h, int q_idx, int kv_idx, const cuflash::flex::Sides& sides)`,
`float dscore(...)` (same parameters), `void side_grads(float g, <score's parameters>, const SideGrads& grads)`
or `bool mask(int b, int h, int q_idx, int kv_idx, const Sides&)`;
a kernel takes the struct as a template argument and its params carry a `Sides` (`sides_struct` packs one)
whose arrays[i] describes `FlexMod.kernel_side_values()[i]`. `FlexMod.cache_key` depends on the emitted
source and the sides' dtypes and shapes only: a new bias value reuses the compiled kernel.

`create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, block_size=...)` turns a mask_mod into a `BlockMask`: per
(b, h, q block) the kv blocks it leaves partially and fully visible, and the transposed lists per kv block
(cuflash.flex.block_mask); `BlockMask.tile_lists` maps them onto a kernel's tiles.

`flex_attention(q, k, v, score_mod=, mask_mod=, block_mask=, ...)` and `flex_attention_backward(...)` (also
`cuflash.flex_attention`) run the mods in the fa2 kernels on NumPy (simulator) or CuPy (GPU) arrays: the kernels
take `cuflash::flex::FlexHook<ScoreMod, MaskMod, BlockSparse>` (cuda_src/common/flex_hook.cuh) as their score hook,
compiled on demand from a generated translation unit per mod structure (cuflash.flex._kernels); the side arrays,
their gradient buffers and a block mask's tile lists travel in AttentionParams (flex_sides, flex_side_grads,
flex_tiles), so nothing but the params describes a call.
"""

try:
    import jax  # noqa: F401  (mods are traced with JAX, for NumPy and CuPy calls too)
except ImportError as error:
    raise ImportError("cuflash.flex (flex_attention, create_block_mask) traces score_mod / mask_mod with JAX, which is "
                      "not installed: pip install 'cuflash[jax]'") from error

from ._api import flex_attention, flex_attention_backward
from .block_mask import BlockMask, TileLists, TileVisits, create_block_mask
from ._mod import (
    MAX_SIDE_DIMS,
    MAX_SIDES,
    SIDE_DTYPES,
    SIDES_DTYPE,
    FlexMod,
    SideSpec,
    cuda_mod,
    sides_struct,
    trace_mask_mod,
    trace_score_mod,
)

__all__ = [
    "MAX_SIDES",
    "MAX_SIDE_DIMS",
    "SIDES_DTYPE",
    "SIDE_DTYPES",
    "BlockMask",
    "FlexMod",
    "SideSpec",
    "TileLists",
    "TileVisits",
    "create_block_mask",
    "cuda_mod",
    "flex_attention",
    "flex_attention_backward",
    "sides_struct",
    "trace_mask_mod",
    "trace_score_mod",
]
