"""``cuflash.jax.attention``: the library's kernels as a differentiable JAX function."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .. import _validation as V
from .. import chunks
from ..dropout import SEED_ROW_WORDS, check_dropout_p
from ..kernels import catalog
from ..sinks import sink_gradient, sink_logits_by_row
from ._primitives import CallConfig, call, side_input_names, tensor_shape
from ._ring import check_ring_dropout, ring_forward, with_block_positions


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_rng: Any = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
    deterministic: bool = False,
    sinks: Any = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
) -> Any:
    """Scaled dot-product attention softmax(scale * q k^T) v on JAX arrays, through cuflash's kernels.

    The layout, dtypes, masking and return values are those of ``cuflash.attention``:
    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA); float16, bfloat16 or float32; head dim
    1..256; v's may be its own, 1..512 (MLA-style, fa2), then out's. ``causal`` aligns the mask to the
    bottom-right corner (query i sees key j iff j <= i + seqlen_k - seqlen_q); a row that sees no
    key gives 0 and lse -inf.
    ``softmax_scale`` (a Python number, static) defaults to 1/sqrt(headdim).
    ``window_size``, ``attention_chunk`` and ``softcap`` (static) and ``alibi_slopes`` (a float32 array,
    (nheads,) or (batch, nheads); no gradient flows to it) mean what they mean for
    ``cuflash.attention``. ``dropout_p`` (static) with ``dropout_rng``, a JAX PRNG key (required when
    dropout_p > 0; it may be traced): the kernels' 64-bit dropout seed is drawn from it
    (``dropout_seed(rng)`` gives it as an int, so ``cuflash.dropout_mask(dropout_seed(rng), ...)`` is the
    mask applied). Under vmap each mapped element drops what its own call would drop (with its own key, or the
    shared one), though one launch covers them all; under plain jit over sharded inputs each shard drops what the whole
    call drops (the kernels get its first global batch and head); under shard_map fold the shard's index into
    the key, or every shard drops the same pattern. Returns out, or (out, lse) with lse float32
    (batch, nheads, seqlen_q).

    Arguments are checked when the call is traced, with the same checks and messages
    as ``cuflash.attention``. Works under ``jit``, ``grad``/``vjp`` (the backward runs
    the library's backward kernels on saved q, k, v, out, lse; the gradient through
    lse is exact too), ``vmap`` (the mapped axis is folded into the batch so one
    launch covers it), ``shard_map`` (outputs vary along the inputs' mesh axes) and plain ``jit`` over inputs
    sharded along batch and heads (one call per device on its shard, no collective; see _partitioning.py for
    what stays whole).
    ``deterministic=True`` asks the backward for bitwise-reproducible gradients.
    ``sinks`` (float32 (nheads,), optional): learnable attention sinks as for ``cuflash.attention``; gradients
    flow to them (d loss / d s_h = sum over the head's rows of e^{s_h - lse} (dlse - rowsum(dout * out))).
    ``num_splits`` (static; no dropout, fa2) is ``cuflash.attention``'s split-KV: 1 (the default) no split, n (<= 128)
    n splits, 0 FA2's heuristic; the backward takes the split forward's out and lse. 1 keeps results independent of
    how a call is sharded; 0's heuristic sees each device's local problem under sharding (under vmap, each mapped
    element's own problem: those run as separate calls).

    Runs on the CPU (the simulator: every CUDA thread a fiber; slow, exact to the
    CUDA programming model) and on CUDA GPUs (CUBINs from NVRTC, launched on XLA's
    stream). The XLA FFI handlers are built (g++, no Python.h) at first use and cached under
    ``cuflash._paths.cache_dir("jax_ffi")``.
    """
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(array).__name__}")
    # Checked on the caller's dtypes, before jnp.asarray could narrow e.g. float64 to float32.
    problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic, sinks=sinks)
    problem = V.with_num_splits(problem, num_splits)
    chunk = chunks.check(attention_chunk, algorithm, dropout_p)
    if chunk:  # as cuflash.attention: a varlen call over one sequence per chunk (cuflash/chunks.py)
        batch, seqlen_q, nheads = q.shape[:3]
        batches = chunks.fixed_length_batches(batch, seqlen_q, k.shape[1], causal, window_size, chunk)
        result = attention_varlen(
            *(jnp.reshape(x, (x.shape[0] * x.shape[1], *x.shape[2:])) for x in (q, k, v)), batches.cu_seqlens_q,
            batches.cu_seqlens_k, max_seqlen_q=batches.max_seqlen_q, max_seqlen_k=batches.max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            alibi_slopes=chunks.per_segment(alibi_slopes, batches.owner), algorithm=algorithm, return_lse=True,
            deterministic=deterministic, sinks=sinks, num_splits=num_splits)
        out = jnp.reshape(result[0], (batch, seqlen_q, nheads, result[0].shape[-1]))
        if not return_lse:
            return out
        return out, jnp.transpose(jnp.reshape(result[1], (nheads, batch, seqlen_q)), (1, 0, 2))
    return _call(problem, q, k, v, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes, dropout_rng=dropout_rng,
                 algorithm=algorithm, return_lse=return_lse, sinks=sinks)


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: Any = None,
    seqused_k: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_rng: Any = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
    deterministic: bool = False,
    sinks: Any = None,
    attention_chunk: int = 0,
    block_table: Any = None,
    num_splits: int | None = None,
) -> Any:
    """``cuflash.attention_varlen`` on JAX arrays: packed q (total_q, nheads, headdim), k and v (total_k,
    nheads_k, headdim), int32 cu_seqlens_q and cu_seqlens_k (batch + 1,), optional int32 seqused_q / seqused_k
    (batch,) (used prefixes, as ``cuflash.attention_varlen`` takes them); returns out, or (out, lse) with lse
    float32 (nheads, total_q). Options, autodiff and platforms as for ``attention``.

    The grid's extent is static: when the cu_seqlens are traced (under ``jit``, or computed), ``max_seqlen_q`` and
    ``max_seqlen_k`` (Python ints) are required and must bound every sequence, and the cu_seqlens values are taken
    as they are (0 first, nondecreasing, last = total), as FlashAttention-2 takes them. Concrete cu_seqlens are
    checked like ``cuflash.attention_varlen``'s, and max_seqlen defaults to the longest sequence. vmap runs one
    call per mapped element. Under plain jit over inputs sharded along heads, each device runs the call on its
    kv heads (whole GQA groups); the packed rows stay whole. ``attention_chunk`` needs concrete cu_seqlens (its
    sequences' chunks become the call's sequences: cuflash/chunks.py; used prefixes concrete too).

    ``block_table`` as for the NumPy function (k and v paged caches, cu_seqlens_k None with seqused_k; a forward:
    differentiating it raises a TypeError); traced tables and cu_seqlens are taken on trust, as
    attention_with_kvcache takes them. A decode step (one query row per sequence, concrete cu_seqlens_q) runs as
    attention_with_kvcache's decode, as the NumPy function runs it.

    ``num_splits`` as for ``attention``; None (the default) is 0 (the heuristic) for such a decode step, as
    attention_with_kvcache splits, and 1 (no split) for every other call.
    """
    if cu_seqlens_k is None:  # keys in pages counted by seqused_k alone (FA3's, vLLM's call)
        used_k = None if seqused_k is None else _concrete(seqused_k)
        cu_seqlens_k = (V.key_offsets_from_used(seqused_k, block_table, jnp) if used_k is None else
                        V.key_offsets_from_used(used_k, block_table))
    counts = {name: x for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)) if x is not None}
    int_inputs = {} if block_table is None else {"block_table": block_table}
    for name, array in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                        *counts.items(), *int_inputs.items()):
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(array).__name__}")
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                   dropout_p=dropout_p, sinks=sinks)
    if block_table is None:
        options["deterministic"] = deterministic
    concrete = [_concrete(x) for x in (cu_seqlens_q, cu_seqlens_k, *counts.values())]
    table = None if block_table is None else _concrete(block_table)
    chunk = chunks.check(attention_chunk, algorithm, dropout_p)
    if chunk:
        if any(x is None for x in concrete) or (block_table is not None and table is None):
            raise ValueError("attention_chunk needs concrete cu_seqlens_q and cu_seqlens_k (and block_table, "
                             "seqused_q, seqused_k) (its sequences' chunks become the call's sequences), got traced "
                             "ones")
        used = dict(zip(counts, concrete[2:]))
        extents = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=used.get("seqused_q"),
                       seqused_k=used.get("seqused_k"), **options)
        if table is None:
            V.check_varlen_qkv(q, k, v, *concrete[:2], **extents)
        else:
            V.check_paged_varlen(q, k, v, table, *concrete[:2], **extents)
            chunks.check_pages(chunk, k.shape[1])
        batches = chunks.varlen_batches(*concrete[:2], causal, window_size, chunk, used.get("seqused_q"),
                                        used.get("seqused_k"))
        if table is not None:
            int_inputs["block_table"] = chunks.segment_pages(table, concrete[1], batches, k.shape[1])
        if batches.seqused_q is not None:
            int_inputs.update(seqused_q=batches.seqused_q, seqused_k=batches.seqused_k)
        return attention_varlen(q, k, v, batches.cu_seqlens_q, batches.cu_seqlens_k, max_seqlen_q=batches.max_seqlen_q,
                                max_seqlen_k=batches.max_seqlen_k, softmax_scale=softmax_scale,
                                dropout_rng=dropout_rng, algorithm=algorithm, return_lse=return_lse,
                                num_splits=num_splits,
                                **dict(options, alibi_slopes=chunks.per_segment(alibi_slopes, batches.owner)),
                                **int_inputs)
    if all(x is not None for x in concrete) and (block_table is None or table is not None):
        used = dict(zip(counts, concrete[2:]))
        extents = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=used.get("seqused_q"),
                       seqused_k=used.get("seqused_k"), **options)
        if table is None:
            problem = V.check_varlen_qkv(q, k, v, *concrete[:2], **extents)
        else:
            problem = V.check_paged_varlen(q, k, v, table, *concrete[:2], **extents)
    else:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if V.dtype_name(cu) != "int32" or len(cu.shape) != 1 or cu.shape[0] < 1:
                raise TypeError(f"{name} must be an int32 array of shape (batch + 1,), got {V.dtype_name(cu)} "
                                f"{tuple(cu.shape)}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                             f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is None:
                raise ValueError(f"{name} (a Python int) is required when the cu_seqlens are traced")
        for name, count in counts.items():  # values taken on trust, as FA2 takes them
            V.check_seqused_type(name, count, cu_seqlens_q.shape[0] - 1)
        make_problem = V.varlen_problem if block_table is None else functools.partial(V.paged_varlen_problem,
                                                                                      block_table=block_table)
        problem = make_problem(q, k, v, batch=cu_seqlens_q.shape[0] - 1, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, seqused_q="seqused_q" in counts,
                               seqused_k="seqused_k" in counts, **options)
    problem = V.with_num_splits(problem, V.varlen_num_splits(num_splits, decode_step=False))
    if block_table is not None and seqused_q is None and concrete[0] is not None and \
            V.one_row_per_sequence(concrete[0]):  # a decode step: as cuflash.attention_varlen runs it
        # The public function, looked up when called: _kvcache imports this module (its prefills across chunks run
        # attention_varlen), so the two call each other through the package, never import each other.
        from . import attention_with_kvcache

        if seqused_k is None:  # concrete lengths stay concrete: the call's plan is then the NumPy call's
            seqused_k = (np.diff(concrete[1]).astype(np.int32) if concrete[1] is not None else
                         jnp.asarray(cu_seqlens_k)[1:] - jnp.asarray(cu_seqlens_k)[:-1])
        out, lse, _, _ = attention_with_kvcache(
            q[:, None], k, v, cache_seqlens=seqused_k, block_table=block_table, causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            algorithm=algorithm, return_lse=True, sinks=sinks,
            num_splits=V.varlen_num_splits(num_splits, decode_step=True))
        return (out[:, 0], lse[:, :, 0].T) if return_lse else out[:, 0]
    if block_table is not None:
        return _paged_varlen(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                             softmax_scale=softmax_scale, alibi_slopes=alibi_slopes, algorithm=algorithm,
                             return_lse=return_lse, sinks=sinks)
    # In side_input_names' order: cu_seqlens_q, cu_seqlens_k, then seqused_q and seqused_k where given.
    cu_words = tuple(_int32_words(x) for x in (cu_seqlens_q, cu_seqlens_k, *counts.values()))
    return _call(problem, q, k, v, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes, dropout_rng=dropout_rng,
                 algorithm=algorithm, return_lse=return_lse, cu_words=cu_words, sinks=sinks)


def _paged_varlen(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, **options):
    """attention_varlen over a paged KV cache, once its Problem is checked: the forward-only call, its keys in use
    per sequence always given (side_input_names: a KV cache's seqused_k; cu_seqlens_k's lengths where the caller
    gives none), then the block table."""
    if seqused_k is None:
        cu_k = jnp.asarray(cu_seqlens_k)
        seqused_k = cu_k[1:] - cu_k[:-1]
    words = (cu_seqlens_q, cu_seqlens_k, *(() if seqused_q is None else (seqused_q,)), seqused_k, block_table)
    config, return_lse, (q, k, v, side) = _call_operands(problem, q, k, v, dropout_rng=None,
                                                         int_words=tuple(_int32_words(x) for x in words), **options)
    out, lse = _forward_only(dataclasses.replace(config, cache_shape=tuple(k.shape)), q, k, v, side)
    return (out, lse) if return_lse else out


def attention_qkvpacked(qkv: Any, **options: Any) -> Any:
    """``cuflash.attention_qkvpacked`` on JAX arrays: ``attention`` of the three parts of qkv (batch, seqlen, 3,
    nheads, headdim), options as for ``attention``. The parts are slices (XLA has no views: it copies them for the
    custom call); autodiff gives the gradient in qkv's packed layout."""
    return attention(*V.packed_parts("qkv", qkv), **options)


def attention_kvpacked(q: Any, kv: Any, **options: Any) -> Any:
    """``cuflash.attention_kvpacked`` on JAX arrays: ``attention`` of q over the two parts of kv (batch, seqlen_k,
    2, nheads_k, headdim), as ``attention_qkvpacked`` takes qkv."""
    return attention(q, *V.packed_parts("kv", kv), **options)


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis_name: str,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_rng: Any = None,
    layout: str = "contiguous",
    return_lse: bool = False,
) -> Any:
    """Attention of a sequence sharded along mesh axis ``axis_name``; call inside ``jax.shard_map``.

    q: (batch, seqlen_q / n, nheads, headdim) and k, v: (batch, seqlen_k / n, nheads_k, headdim), the local shards
    of a sequence split over the n devices of ``axis_name`` (GQA/MQA as in ``attention``). ``layout``:
    "contiguous" (device i holds rows i L .. (i + 1) L - 1, what a sequence-sharded PartitionSpec gives) or
    "zigzag" (already reordered: device i holds chunks i and 2n-1-i of 2n). ``causal`` needs seqlen_q == seqlen_k
    and an even local length (two chunks per device). ``dropout_p`` with ``dropout_rng`` as in ``attention``: every
    device drops what the unsharded call drops on its rows (each block call gets its global row and key offsets),
    which needs local query lengths (causal: chunks) that are multiples of 16 and even key lengths. Returns the
    local shard of out (and of lse, (batch, nheads, local rows) float32), in q's layout. Differentiable; batch and
    heads may be sharded along other axes as usual (with dropout, fold those shards' indices into the key).
    """
    dropout_p = check_dropout_p(dropout_p)
    if dropout_p > 0.0:
        check_ring_dropout(q.shape[1], k.shape[1], causal)

    def forward(q, k, v, causal, positions):
        problem = V.check_qkv(q, k, v, causal=causal, dropout_p=dropout_p)
        return _call(problem, q, k, v, softmax_scale=softmax_scale, alibi_slopes=None, dropout_rng=dropout_rng,
                     algorithm="fa2", return_lse=True, dropout_positions=positions)

    out, lse = ring_forward(q, k, v, forward, axis_name=axis_name, causal=causal, layout=layout,
                            per_chunk=dropout_p > 0.0)
    return (out, lse) if return_lse else out


def _concrete(array) -> np.ndarray | None:
    """A host copy of ``array`` when its values are known at trace time, else None."""
    try:
        return np.asarray(array)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _call(problem, q, k, v, *, return_lse, cu_words=(), dropout_positions=None, **options):
    """What attention and attention_varlen share once the Problem is checked: the call's operands (_call_operands,
    varlen's cu_seqlens words last) and the differentiable call. ``dropout_positions``: the global index of the
    call's first query row and first key (ring attention's blocks; dropout.cuh)."""
    config, return_lse, (q, k, v, side) = _call_operands(problem, q, k, v, return_lse=return_lse,
                                                         int_words=cu_words, dropout_positions=dropout_positions,
                                                         **options)
    out, lse = _attention(config, q, k, v, side)
    return (out, lse) if return_lse else out


def _call_operands(problem, q, k, v, *, softmax_scale, alibi_slopes, dropout_rng, algorithm, return_lse,
                   int_words=(), dropout_positions=None, sinks=None):
    """The checked static part of a call (CallConfig, return_lse) and its operands (q, k, v, side): the side inputs
    in _primitives.side_input_names order, ``int_words`` (int32 side inputs as float32 words) last, all marked
    varying along the same shard_map axes."""
    scale = V.check_softmax_scale(softmax_scale, problem.headdim)
    return_lse = V.check_bool("return_lse", return_lse)
    catalog.check_options(algorithm, problem)  # unknown algorithm or option
    side = () if alibi_slopes is None else (jnp.asarray(alibi_slopes),)
    side += () if sinks is None else (jnp.asarray(sinks),)
    if problem.dropout_p > 0.0:
        seed = dropout_seed_operand(_seed_bits(_check_rng(dropout_rng)))
        side += (seed if dropout_positions is None else with_block_positions(seed, dropout_positions),)
    side += tuple(int_words)
    q, k, v, *side = _share_varying_axes(*(jnp.asarray(x) for x in (q, k, v)), *side)
    return CallConfig(algorithm, problem, scale), return_lse, (q, k, v, tuple(side))


def _int32_words(x):
    """An int32 side input as the float32-typed words AttentionParams' side buffers hold (kernels read the bits)."""
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.float32)


def _check_rng(rng):
    if rng is None:
        raise ValueError("dropout_rng (a JAX PRNG key) is required when dropout_p > 0")
    typed = hasattr(rng, "dtype") and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    raw = hasattr(rng, "dtype") and str(rng.dtype) == "uint32" and tuple(rng.shape) == (2,)
    if not ((typed and tuple(rng.shape) == ()) or raw):
        raise TypeError("dropout_rng must be one JAX PRNG key (jax.random.key(...) or jax.random.PRNGKey(...)), "
                        f"got {getattr(rng, 'dtype', type(rng).__name__)} {tuple(getattr(rng, 'shape', ()))}")
    return rng


def dropout_seed_operand(seed_bits):
    """The kernels' dropout_seed side input (cuflash.dropout.seed_words) of traced seed words: the seed's two words,
    then the call's first global batch, head, query row and key, 0 (a shard's partition advances the first two:
    _partitioning.py; a ring block sets the last two: _ring.with_block_positions), as float32-typed bits."""
    # Padded rather than concatenated with zeros: under vmap of keys sharded in an Explicit mesh, concatenate would
    # broadcast the zeros to the keys' sharding, which needs a mesh in context.
    return jax.lax.bitcast_convert_type(jnp.pad(seed_bits, (0, SEED_ROW_WORDS - 2)), jnp.float32)


def _seed_bits(rng):
    """The dropout seed's two 32-bit words (low first) drawn from a PRNG key."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def dropout_seed(dropout_rng) -> int:
    """The 64-bit dropout seed ``attention`` uses for a concrete ``dropout_rng``: ``cuflash.dropout_mask`` of it is
    the mask the kernels apply."""
    low, high = (int(w) for w in np.asarray(_seed_bits(_check_rng(dropout_rng))))
    return low | high << 32


# ---------------------------------------------------------------------------
# shard_map: values carry the mesh axes they vary along. The custom calls'
# outputs are derived from all inputs, so they vary along the union of the
# inputs' axes; inputs are first cast to that union (outside the custom_vjp, so
# autodiff transposes the cast into the psum a replicated input's gradient needs).


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # older JAX spelling
    if vma is None:
        manual = getattr(aval, "manual_axis_type", None)
        vma = getattr(manual, "varying", frozenset()) if manual is not None else frozenset()
    return frozenset(vma)


def _mark_varying(x, axes: frozenset):
    missing = tuple(sorted(axes - _varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _share_varying_axes(*arrays):
    axes = frozenset().union(*(_varying_axes(x) for x in arrays))
    return tuple(_mark_varying(x, axes) for x in arrays)


# ---------------------------------------------------------------------------
# The two directions, with the no-launch cases of cuflash.attention handled at trace time.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _forward_only(config, q, k_cache, v_cache, side):
    """The forward of a call over a KV cache (attention_with_kvcache, a paged attention_varlen): inference, with no
    derivative."""
    return _forward(config, q, k_cache, v_cache, side)


@_forward_only.defjvp
def _no_derivative(config, primals, tangents):
    raise TypeError("cuflash.jax.attention_with_kvcache has no derivative, nor has attention_varlen over a paged "
                    "cache (KV-cache attention is inference, forward only): differentiate cuflash.jax.attention "
                    "instead")


def _forward(config: CallConfig, q, k, v, side=()):
    problem = config.problem
    axes = _varying_axes(q)
    out_shape = tensor_shape("out", problem)
    if problem.seqlen_k == 0 or 0 in out_shape:
        # No key at all: every row sees no key (the kernels' rule, without a launch): out 0, lse -inf or the sink.
        out = jnp.zeros(out_shape, q.dtype)
        lse = jnp.full(tensor_shape("lse", problem), -np.inf, jnp.float32)
        if problem.sinks:
            lse = jnp.broadcast_to(sink_logits_by_row(_side_input(problem, side, "sinks")), lse.shape)
    else:
        out, lse = call("forward", config, q, k, v, *side)
        unused = _unused_rows(problem, side, "q")
        if unused is not None:  # rows past a used prefix: not written by the kernels
            out = jnp.where(unused[:, None, None], jnp.zeros((), out.dtype), out)
            lse = jnp.where(unused[None, :], -jnp.inf, lse)
    return _mark_varying(out, axes), _mark_varying(lse, axes)


def _side_input(problem, side, name: str):
    return side[side_input_names(problem).index(name)]


def _unused_rows(problem, side, rows: str):
    """The packed query ("q") or key ("k") rows past their sequence's used prefix (_validation.unused_rows on the
    traced cu_seqlens and seqused operands), or None without such a prefix."""
    if not (problem.seqused_q if rows == "q" else problem.seqused_k):
        return None
    named = dict(zip(side_input_names(problem), side))
    words = [jax.lax.bitcast_convert_type(named[name], jnp.int32) for name in (f"cu_seqlens_{rows}", f"seqused_{rows}")]
    return V.unused_rows(*words, problem.total_q if rows == "q" else problem.total_k, xp=jnp)


def _backward(config: CallConfig, dout, q, k, v, out, lse, side=(), dlse=None):
    # num_splits is the forward's: the backward takes no split, and the out and lse of any split count serve it.
    problem = dataclasses.replace(config.problem, num_splits=1)
    config = dataclasses.replace(config, problem=problem)
    axes = _varying_axes(q)
    if problem.seqlen_k == 0 or problem.seqlen_q == 0 or 0 in tensor_shape("out", problem):
        grads = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype))
    else:
        extra = (*side,) if dlse is None else (*side, dlse.astype(jnp.float32))
        config = dataclasses.replace(config, with_dlse=dlse is not None)
        grads = call("backward", config, dout.astype(q.dtype), q, k, v, out, lse, *extra)
        unused_q, unused_k = _unused_rows(problem, side, "q"), _unused_rows(problem, side, "k")
        grads = tuple(g if unused is None else jnp.where(unused[:, None, None], jnp.zeros((), g.dtype), g)
                      for g, unused in zip(grads, (unused_q, unused_k, unused_k)))
    return tuple(_mark_varying(g, axes) for g in grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: CallConfig, q, k, v, side):
    return _forward(config, q, k, v, side)


def _attention_fwd(config: CallConfig, q, k, v, side):
    """side: the optional inputs (ALiBi slopes, sinks, dropout's seed words, integer words): residuals; of them only
    the sinks get a gradient."""
    q, k, v = q.value, k.value, v.value  # CustomVJPPrimal (symbolic_zeros=True)
    side = tuple(s.value for s in side)
    out, lse = _forward(config, q, k, v, side)
    return (out, lse), (q, k, v, side, out, lse)


def _is_zero(cotangent) -> bool:
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _attention_bwd(config: CallConfig, residuals, cotangents):
    """The backward kernels with the lse's cotangent folded into D (attention_params.cuh's dlse): exact for every
    option, softcap included, at no extra launch."""
    q, k, v, side, out, lse = residuals
    dout, dlse = cotangents
    def zeros(x):  # varying along the mesh axes x varies along (a ring block's seed words vary with its position)
        return _mark_varying(jnp.zeros(x.shape, x.dtype), _varying_axes(x))

    no_side_gradient = tuple(zeros(s) for s in side)
    if _is_zero(dout) and _is_zero(dlse):
        return (*(zeros(x) for x in (q, k, v)), no_side_gradient)
    dout = jnp.zeros(q.shape, q.dtype) if _is_zero(dout) else dout
    dlse = None if _is_zero(dlse) else dlse
    dq, dk, dv = _backward(config, dout, q, k, v, out, lse, side, dlse)
    side_gradient = no_side_gradient
    if config.problem.sinks:
        at = side_input_names(config.problem).index("sinks")
        dsinks = _mark_varying(_sink_gradient(config.problem, side, dout, out, lse, dlse), _varying_axes(side[at]))
        side_gradient = (*no_side_gradient[:at], dsinks, *no_side_gradient[at + 1:])
    return dq, dk, dv, side_gradient


def _sink_gradient(problem, side, dout, out, lse, dlse):
    """d loss / d sinks (cuflash/sinks.py) from D = rowsum(dout * out) in float32, laid out as the lse."""
    dot = jnp.einsum("...hd,...hd->...h", dout.astype(jnp.float32), out.astype(jnp.float32))
    dot = jnp.moveaxis(dot, -1, -2)  # (batch, seqlen_q, nheads) -> (batch, nheads, seqlen_q); varlen (nheads, total_q)
    if dlse is not None:
        dot = dot - dlse.astype(jnp.float32)
    return sink_gradient(_side_input(problem, side, "sinks"), lse, dot, jnp, _unused_rows(problem, side, "q"))


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
