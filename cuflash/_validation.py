"""Argument checks for the public API, run before any kernel (shared by CuPy, NumPy and JAX paths).

Every error names the argument and says what was expected. The checks use only
``shape``, ``dtype`` and ``strides``, so the same function validates NumPy,
CuPy and JAX arrays (abstract values at trace time included).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from .dropout import check_dropout_p  # dropout's checks live beside its rule
from .kernels.families.fa2 import MAX_KV_SPLITS
from .kernels.program import ELEMENT_DTYPES, MAX_HEADDIM_V, Problem
from .mask import Mask

MAX_HEADDIM = 256
# gridDim.y and gridDim.z are limited to 65535 on every CUDA GPU; plans put heads and batch there.
MAX_GRID_YZ = 65535
MAX_SEQLEN = 2**31 - 1


def dtype_name(array: Any) -> str:
    dtype = array.dtype
    try:
        return _dtype_names[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        name = str(getattr(dtype, "name", dtype))
    if len(_dtype_names) < 64:
        try:
            _dtype_names[dtype] = name
        except TypeError:
            pass
    return name


# NumPy computes dtype.name in Python on every access (a few microseconds): the names of the dtypes seen so far.
_dtype_names: dict[Any, str] = {}


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool,)) and type(value).__name__ != "bool_":
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_softmax_scale(softmax_scale: Any, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, (bool, str, bytes)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return scale


def _check_ndim(name: str, array: Any, layout: str) -> tuple[int, ...]:
    """The shape of ``array``, which must have one dimension per name in ``layout``."""
    shape = tuple(array.shape)
    ndim = layout.count(",") + 1
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {shape}")
    return shape


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_mask(causal: Any, window_size: Any, seqlen_q: int, seqlen_k: int) -> Mask:
    """The Mask of ``causal`` and ``window_size=(left, right)`` (-1: unbounded; causal sets right = 0).

    A bound that no row can reach (left >= seqlen_k, right >= seqlen_q) is the same as unbounded and becomes
    -1, so kernels never see values outside int32 and plans skip masking they do not need.
    """
    causal = check_bool("causal", causal)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    left, right = (_check_int(f"window_size[{i}]", w) for i, w in enumerate(window_size))
    for i, w in enumerate((left, right)):
        if w < -1:
            raise ValueError(f"window_size[{i}] must be >= -1 (-1: unbounded), got {w}")
    return mask_for_lengths(Mask.of(causal, (left, right)), seqlen_q, seqlen_k)


def check_attention_chunk(attention_chunk: Any) -> int:
    """FA3's attention_chunk: chunks of that many keys, 0 for none (cuflash/chunks.py runs them)."""
    chunk = _check_int("attention_chunk", attention_chunk)
    if not 0 <= chunk < 2**31:
        raise ValueError(f"attention_chunk must be >= 0 (0: no chunks) and below 2**31, got {chunk}")
    return chunk


def mask_for_lengths(mask: Mask, seqlen_q: int, seqlen_k: int) -> Mask:
    """``mask`` with the bounds no row of a (seqlen_q, seqlen_k) problem can reach made -1 (check_mask's rule; a
    prepared call applies it again when a varlen or KV-cache call's lengths change)."""
    left, right = mask.window_left, mask.window_right
    return Mask(-1 if left >= seqlen_k else left, -1 if right >= seqlen_q and right > 0 else right)


def check_softcap(softcap: Any) -> float:
    if isinstance(softcap, (bool, str, bytes)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap!r}")
    return value


def check_alibi_slopes(alibi_slopes: Any, batch: int, nheads: int) -> str | None:
    """The Problem.alibi layout of ``alibi_slopes``: None, "heads" (nheads,) or "batch_heads" (batch, nheads)."""
    if alibi_slopes is None:
        return None
    if not (hasattr(alibi_slopes, "shape") and hasattr(alibi_slopes, "dtype")):
        raise TypeError(f"alibi_slopes must be an array or None, got {type(alibi_slopes).__name__}")
    shape = tuple(alibi_slopes.shape)
    if dtype_name(alibi_slopes) != "float32":
        raise TypeError(f"alibi_slopes must have dtype float32, got {dtype_name(alibi_slopes)}")
    if shape == (nheads,):
        return "heads"
    if shape == (batch, nheads):
        return "batch_heads"
    raise ValueError(f"alibi_slopes must have shape (nheads,) = {(nheads,)} or (batch, nheads) = {(batch, nheads)}, "
                     f"got {shape}")


def check_sinks(sinks: Any, nheads: int) -> bool:
    """Whether the call has attention sinks: None, or a float32 (nheads,) array of sink logits (sink.cuh)."""
    if sinks is None:
        return False
    if not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        raise TypeError(f"sinks must be an array or None, got {type(sinks).__name__}")
    if dtype_name(sinks) != "float32":
        raise TypeError(f"sinks must have dtype float32, got {dtype_name(sinks)}")
    if tuple(sinks.shape) != (nheads,):
        raise ValueError(f"sinks must have shape (nheads,) = {(nheads,)}, one logit per query head, got "
                         f"{tuple(sinks.shape)}")
    return True


def check_qkv(q: Any, k: Any, v: Any, *, causal: Any, window_size: Any = (-1, -1), softcap: Any = 0.0,
              alibi_slopes: Any = None, dropout_p: Any = 0.0, deterministic: Any = False,
              sinks: Any = None) -> Problem:
    """Validate q, k, v and the attention options, and return the Problem they describe."""
    batch, seqlen_q, nheads, headdim = _check_ndim("q", q, "(batch, seqlen_q, nheads, headdim)")
    kshape = _check_ndim("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    vshape = _check_ndim("v", v, "(batch, seqlen_k, nheads_k, headdim_v)")
    _check_v_shape(kshape, vshape)
    kbatch, seqlen_k, nheads_k, kheaddim = kshape
    if kbatch != batch:
        raise ValueError(f"k must have the batch size of q ({batch}), got {kbatch}")
    return _problem(q, k, v, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
                    headdim=headdim, kheaddim=kheaddim, headdim_v=vshape[-1], causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                    sinks=sinks)


def check_varlen_qkv(q: Any, k: Any, v: Any, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, *,
                     max_seqlen_q: Any, max_seqlen_k: Any, seqused_q: np.ndarray | None = None,
                     seqused_k: np.ndarray | None = None, **options: Any) -> Problem:
    """Validate packed q (total_q, nheads, d), k, v (total_k, nheads_k, d), the host copies of cu_seqlens_q/k
    (check_cu_seqlens) and of seqused_q/k where given (check_seqused), and the options; return the varlen Problem
    (batch = sequences, seqlen = max_seqlen). ``options``: causal, window_size, softcap, alibi_slopes, dropout_p,
    deterministic, sinks, as for check_qkv."""
    (total_q, _, _), (total_k, _, _), _ = _packed_shapes(q, k, v)
    batch, seqlen_q, seqlen_k = varlen_extents(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                                               max_seqlen_k, seqused_q, seqused_k)
    return varlen_problem(q, k, v, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
                          seqused_q=seqused_q is not None, seqused_k=seqused_k is not None, **options)


def check_paged_varlen(q: Any, k: Any, v: Any, block_table: np.ndarray, cu_seqlens_q: np.ndarray,
                       cu_seqlens_k: np.ndarray, *, max_seqlen_q: Any, max_seqlen_k: Any,
                       seqused_q: np.ndarray | None = None, seqused_k: np.ndarray | None = None,
                       **options: Any) -> Problem:
    """check_varlen_qkv for keys in a paged KV cache (FA2's varlen block_table): packed q (total_q, nheads, d); k, v
    paged (num_pages, page_size, nheads_k, d); a host copy of block_table (batch, pages_per_sequence), sequence b's
    keys the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages (so cu_seqlens_k's last entry counts
    keys, not rows of k). ``options`` as for paged_varlen_problem."""
    _paged_varlen_shapes(q, k, v, options.get("dropout_p", 0.0))
    batch, seqlen_q, seqlen_k = varlen_extents(cu_seqlens_q, cu_seqlens_k, q.shape[0], paged_key_total(cu_seqlens_k),
                                               max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    problem = paged_varlen_problem(q, k, v, block_table, batch=batch, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
                                   seqused_q=seqused_q is not None, seqused_k=seqused_k is not None, **options)
    check_paged_varlen_values(block_table, cu_seqlens_k, k.shape[0], k.shape[1])
    return problem


def paged_varlen_problem(q: Any, k: Any, v: Any, block_table: Any, *, batch: int, max_seqlen_q: int,
                         max_seqlen_k: int, seqused_q: bool, seqused_k: bool, causal: Any, window_size: Any = (-1, -1),
                         softcap: Any = 0.0, alibi_slopes: Any = None, dropout_p: Any = 0.0,
                         sinks: Any = None) -> Problem:
    """The Problem of a paged varlen call (varlen, and a paged KV cache's) from shapes alone (block_table's and the
    cu_seqlens' values unread: JAX calls this directly when they are traced). A forward (inference): no dropout."""
    (total_q, nheads, headdim), (num_pages, page_size, nheads_k, kheaddim) = _paged_varlen_shapes(q, k, v, dropout_p)
    pages_per_sequence = check_block_table_shape(block_table, batch, page_size, "k")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if _check_int(name, x) < 0:
            raise ValueError(f"{name} must be >= 0, got {x}")
    problem = _problem(q, k, v, batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, nheads=nheads,
                       nheads_k=nheads_k, headdim=headdim, kheaddim=kheaddim, headdim_v=v.shape[-1], total_q=total_q,
                       total_k=num_pages * page_size, seqused_q=seqused_q, seqused_k=seqused_k, causal=causal,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=0.0,
                       deterministic=False, sinks=sinks)
    return dataclasses.replace(problem, kvcache=True, page_size=page_size, pages_per_sequence=pages_per_sequence)


def _paged_varlen_shapes(q: Any, k: Any, v: Any, dropout_p: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a paged varlen call's packed q and paged k (v: k's but for its head dim); no dropout."""
    qshape = _check_ndim("q", q, "(total_q, nheads, headdim)")
    layout = "(num_pages, page_size, nheads_k, headdim)"
    kshape = _check_ndim("k", k, layout)
    _check_v_shape(kshape, _check_ndim("v", v, layout.replace("headdim", "headdim_v")))
    if check_dropout_p(dropout_p):
        raise ValueError("attention_varlen with block_table is a forward over a paged KV cache (inference): "
                         "dropout_p must be 0")
    return qshape, kshape


def key_offsets_from_used(seqused_k: Any, block_table: Any, xp: Any = np) -> Any:
    """cu_seqlens_k of a paged varlen call that gives none (FA3's, vLLM's: each sequence's keys are the first
    seqused_k[b] rows of its pages): 0 then the running sum of seqused_k, in ``xp`` (NumPy on host copies, jax.numpy
    on traced values). Only keys in pages have no packed rows for cu_seqlens_k to place."""
    if block_table is None or seqused_k is None:
        raise ValueError("cu_seqlens_k may be None only for keys in a paged KV cache (block_table) whose seqused_k "
                         "gives each sequence's keys")
    if dtype_name(seqused_k) != "int32" or len(seqused_k.shape) != 1:
        raise TypeError(f"seqused_k must be an int32 array of shape (batch,), got {dtype_name(seqused_k)} "
                        f"{tuple(seqused_k.shape)}")
    return xp.concatenate([xp.zeros(1, xp.int32), xp.cumsum(seqused_k, dtype=xp.int32)])


def one_row_per_sequence(cu_seqlens_q: np.ndarray) -> bool:
    """Whether a (checked host copy of) cu_seqlens_q gives every sequence exactly one query row: 0, 1, 2, ..."""
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1 or int(cu_seqlens_q[-1]) != batch:
        return False
    if batch < _SMALL_ARRAY:  # a decode's few sequences: a list's comparison, without NumPy's per-call overhead
        return cu_seqlens_q.tolist() == list(range(batch + 1))
    return bool((cu_seqlens_q[1:] - cu_seqlens_q[:-1] == 1).all())


def paged_key_total(cu_seqlens_k: np.ndarray) -> int:
    """The total varlen_extents checks a paged call's cu_seqlens_k against: its own last entry (paged keys are no
    rows of k; check_cu_seqlens still refuses a malformed array)."""
    return int(cu_seqlens_k[-1]) if len(cu_seqlens_k.shape) == 1 and cu_seqlens_k.shape[0] else 0


def check_paged_varlen_values(block_table: np.ndarray, cu_seqlens_k: np.ndarray, num_pages: int,
                              page_size: int) -> None:
    """A paged varlen call's values, checked on every call: the pages block_table names exist, and each sequence's
    keys fit in its pages."""
    check_block_table_values(block_table, num_pages)
    capacity = block_table.shape[1] * page_size
    wide = cu_seqlens_k.astype(np.int64)
    lengths = wide[1:] - wide[:-1]  # np.diff's, without its Python overhead per call
    if lengths.size and min_max(lengths)[1] > capacity:
        b = int(np.argmax(lengths))
        raise ValueError(f"sequence {b} has {int(lengths[b])} keys (cu_seqlens_k), more than its "
                         f"{block_table.shape[1]} pages of block_table hold ({capacity} rows)")


def varlen_extents(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, total_q: int, total_k: int, max_seqlen_q: Any,
                   max_seqlen_k: Any, seqused_q: np.ndarray | None = None,
                   seqused_k: np.ndarray | None = None) -> tuple[int, int, int]:
    """(sequences, max_seqlen_q, max_seqlen_k) of checked host copies of cu_seqlens_q/k (and of seqused_q/k where
    given) and the max_seqlen arguments: the checks of a varlen call that read values, run on every call (a
    prepared call's too)."""
    lengths_q, longest_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q (rows of q)")
    lengths_k, longest_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k (rows of k and v)")
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{len(lengths_q) + 1} and {len(lengths_k) + 1}")
    seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q, "cu_seqlens_q")
    seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k, "cu_seqlens_k")
    if seqused_q is not None:
        check_seqused("seqused_q", seqused_q, lengths_q, "cu_seqlens_q")
    if seqused_k is not None:
        check_seqused("seqused_k", seqused_k, lengths_k, "cu_seqlens_k")
    return len(lengths_q), seqlen_q, seqlen_k


def check_seqused_type(name: str, seqused: Any, batch: int) -> None:
    """seqused_q / seqused_k's dtype and shape: int32 (batch,) (the part of the check a traced value allows)."""
    if dtype_name(seqused) != "int32":
        raise TypeError(f"{name} must have dtype int32, got {dtype_name(seqused)}")
    if tuple(seqused.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), one count per sequence, got "
                         f"{tuple(seqused.shape)}")


def check_seqused(name: str, seqused: np.ndarray, lengths: np.ndarray | list[int], cu_name: str) -> None:
    """A varlen call's used-prefix counts (a host copy): int32 (batch,), 0 <= seqused[b] <= the length of sequence b
    that ``cu_name`` gives (``lengths``)."""
    check_seqused_type(name, seqused, len(lengths))
    if not seqused.size:
        return
    over = seqused.astype(np.int64) > lengths
    if min_max(seqused)[0] < 0 or over.any():
        at = int(np.argmax((seqused < 0) | over))
        raise ValueError(f"{name}[{at}] must be in 0..{int(lengths[at])} (sequence {at}'s length in {cu_name}), got "
                         f"{int(seqused[at])}")


def unused_rows(cu_seqlens: Any, seqused: Any, total: int, xp: Any = np) -> Any:
    """The one rule for which packed rows a used prefix leaves out: row r of sequence b (cu_seqlens[b] <= r <
    cu_seqlens[b + 1]) is unused when r - cu_seqlens[b] >= seqused[b]. A boolean (total,) array in ``xp`` (NumPy, or
    jax.numpy on traced values); unused rows are neither read nor written by the kernels (block_info.cuh), and the
    API gives them out 0, lse -inf and zero gradients."""
    rows = xp.arange(total, dtype=xp.int32)
    sequence = xp.searchsorted(cu_seqlens, rows, side="right") - 1
    return rows - cu_seqlens[sequence] >= seqused[sequence]


def varlen_problem(q: Any, k: Any, v: Any, *, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal: Any,
                   window_size: Any = (-1, -1), softcap: Any = 0.0, alibi_slopes: Any = None, dropout_p: Any = 0.0,
                   deterministic: Any = False, seqused_q: bool = False, seqused_k: bool = False,
                   sinks: Any = None) -> Problem:
    """The varlen Problem of packed q, k, v for ``batch`` sequences of at most max_seqlen_q / max_seqlen_k rows
    (seqused_q/k: whether used-prefix counts come with them), without looking at the cu_seqlens values
    (check_varlen_qkv does; JAX calls this directly when they are traced)."""
    (total_q, nheads, headdim), (total_k, nheads_k, kheaddim), headdim_v = _packed_shapes(q, k, v)
    seqlen_q, seqlen_k = (_check_int(name, x) for name, x in (("max_seqlen_q", max_seqlen_q),
                                                              ("max_seqlen_k", max_seqlen_k)))
    for name, x in (("max_seqlen_q", seqlen_q), ("max_seqlen_k", seqlen_k)):
        if x < 0:
            raise ValueError(f"{name} must be >= 0, got {x}")
    return _problem(q, k, v, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
                    headdim=headdim, kheaddim=kheaddim, headdim_v=headdim_v, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                    total_q=total_q,
                    total_k=total_k, seqused_q=seqused_q, seqused_k=seqused_k, sinks=sinks)


def _packed_shapes(q: Any, k: Any, v: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The shapes of packed varlen q and of k, (total, heads, headdim), and v's head dim (v: k's shape but for it)."""
    qshape = _check_ndim("q", q, "(total_q, nheads, headdim)")
    kshape = _check_ndim("k", k, "(total_k, nheads_k, headdim)")
    vshape = _check_ndim("v", v, "(total_k, nheads_k, headdim_v)")
    _check_v_shape(kshape, vshape)
    return qshape, kshape, vshape[-1]


def _check_v_shape(kshape: tuple[int, ...], vshape: tuple[int, ...], names: tuple[str, str] = ("k", "v")) -> None:
    """v has k's shape but for its head dim (the last dimension), which may be its own (MLA-style)."""
    if kshape[:-1] != vshape[:-1]:
        k_name, v_name = names
        raise ValueError(f"{v_name} must have {k_name}'s shape but for the head dim (the last dimension), got "
                         f"{k_name} {kshape} and {v_name} {vshape}")


def check_cu_seqlens(name: str, cu_seqlens: np.ndarray, total: int,
                     total_name: str) -> tuple[list[int] | np.ndarray, int]:
    """The sequence lengths of ``cu_seqlens`` (a host copy): int32, (batch + 1,), 0 first, nondecreasing, last =
    ``total``; and the longest (0 without a sequence). Zero-length sequences are allowed. Up to _SMALL_ARRAY offsets
    (a decode's few sequences) the lengths are a list of Python ints, worked out without NumPy's per-call overhead;
    beyond, an int64 array."""
    if dtype_name(cu_seqlens) != "int32":
        raise TypeError(f"{name} must have dtype int32, got {dtype_name(cu_seqlens)}")
    shape = cu_seqlens.shape
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(shape)}")
    if shape[0] - 1 > MAX_GRID_YZ:
        raise ValueError(f"{name} describes {shape[0] - 1} sequences, more than {MAX_GRID_YZ}")
    if shape[0] <= _SMALL_ARRAY:
        offsets = cu_seqlens.tolist()
        lengths = [end - start for start, end in zip(offsets, offsets[1:])]
        first, last = offsets[0], offsets[-1]
    else:
        wide = cu_seqlens.astype(np.int64)
        lengths = wide[1:] - wide[:-1]  # np.diff's, without its few microseconds of Python per call
        first, last = int(wide[0]), int(wide[-1])
    shortest, longest = min_max(lengths) if len(lengths) else (0, 0)
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if shortest < 0:
        at = int(np.argmax(np.asarray(lengths) < 0))
        raise ValueError(f"{name} must be nondecreasing, got {name}[{at + 1}] = {int(cu_seqlens[at + 1])} < "
                         f"{name}[{at}] = {int(cu_seqlens[at])}")
    if last != total:
        raise ValueError(f"{name}[-1] must equal {total_name} = {total}, got {last}")
    return lengths, longest


# Below this many elements a Python list's min and max cost less than NumPy's reductions (a call each of about a
# microsecond): the per-call value checks of a decode step read arrays of batch size.
_SMALL_ARRAY = 64


def min_max(values: np.ndarray | list[int]) -> tuple[int, int]:
    """(min, max) of a non-empty integer array (or list of ints), as Python ints."""
    if type(values) is list:
        return min(values), max(values)
    if values.size <= _SMALL_ARRAY:
        listed = values.ravel().tolist()
        return min(listed), max(listed)
    return int(values.min()), int(values.max())


def check_max_seqlen(name: str, max_seqlen: Any, longest: int, cu_name: str) -> int:
    """``max_seqlen`` (default: ``longest``, the longest sequence of ``cu_name``), at least the longest."""
    if max_seqlen is None:
        return longest
    value = _check_int(name, max_seqlen)
    if value < longest:
        raise ValueError(f"{name} must be at least the longest sequence of {cu_name} ({longest}), got {value}")
    if value > MAX_SEQLEN:
        raise ValueError(f"{name} must be below 2**31, got {value}")
    return value


def _problem(q: Any, k: Any, v: Any, *, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int,
             headdim: int, kheaddim: int, headdim_v: int, causal: Any, window_size: Any, softcap: Any,
             alibi_slopes: Any,
             dropout_p: Any, deterministic: Any, total_q: int | None = None, total_k: int | None = None,
             seqused_q: bool = False, seqused_k: bool = False, sinks: Any = None) -> Problem:
    """The checks fixed-length and varlen inputs share (heads, head dim, dtypes, options), then the Problem."""
    if kheaddim != headdim:
        raise ValueError(f"k must have the head dim of q ({headdim}), got {kheaddim}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dim (last dimension of q) must be in 1..{MAX_HEADDIM}, got {headdim}")
    if not 1 <= headdim_v <= MAX_HEADDIM_V:
        # Up to FA3's qk 64 / v 512 pair: above the kernels' 256 columns V runs in column chunks (value_column_chunks).
        raise ValueError(f"v's head dim (its last dimension) must be in 1..{MAX_HEADDIM_V}, got {headdim_v}")
    if nheads_k == 0 and nheads != 0:
        raise ValueError(f"k must have at least one head when q has {nheads}")
    if nheads_k and nheads % nheads_k:
        raise ValueError(
            f"nheads of q ({nheads}) must be a multiple of nheads_k of k and v ({nheads_k}) (GQA/MQA)"
        )
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(f"batch and nheads must be at most {MAX_GRID_YZ}, got {batch} and {nheads}")
    if seqlen_q > MAX_SEQLEN or seqlen_k > MAX_SEQLEN or (total_q or 0) > MAX_SEQLEN or (total_k or 0) > MAX_SEQLEN:
        raise ValueError(f"sequence lengths must be below 2**31, got {seqlen_q} and {seqlen_k}")
    dtypes = {name: dtype_name(a) for name, a in (("q", q), ("k", k), ("v", v))}
    for name, dt in dtypes.items():
        if dt not in ELEMENT_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {dt}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"q, k and v must have the same dtype, got {dtypes['q']}, {dtypes['k']}, {dtypes['v']}")
    return Problem(
        dtype=dtypes["q"],
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        headdim=headdim,
        headdim_v=headdim_v,
        mask=check_mask(causal, window_size, seqlen_q, seqlen_k),
        deterministic=check_bool("deterministic", deterministic),
        softcap=check_softcap(softcap),
        alibi=check_alibi_slopes(alibi_slopes, batch, nheads),
        dropout_p=check_dropout_p(dropout_p),
        total_q=total_q,
        total_k=total_k,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        sinks=check_sinks(sinks, nheads),
    )


# FA2's packed inputs: their parts and layouts.
PACKED_LAYOUTS = {"qkv": (3, "(batch, seqlen, 3, nheads, headdim)"),
                  "kv": (2, "(batch, seqlen_k, 2, nheads_k, headdim)")}


def packed_parts(name: str, packed: Any) -> tuple[Any, ...]:
    """The parts of packed ``qkv`` or ``kv`` (PACKED_LAYOUTS): views through its strides for NumPy and CuPy (no
    copy), slices for JAX."""
    parts, layout = PACKED_LAYOUTS[name]
    if len(packed.shape) != 5 or packed.shape[2] != parts:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return tuple(packed[:, :, i] for i in range(parts))


def check_out_like(name: str, array: Any, q: Any, headdim_v: int) -> None:
    """``array`` (out or dout) must have q's shape but for the head dim, which is v's (``headdim_v``), and q's
    dtype."""
    expected = (*q.shape[:-1], headdim_v)
    if tuple(array.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} (q's, with v's head dim {headdim_v}), got "
                         f"{tuple(array.shape)}")
    if dtype_name(array) != dtype_name(q):
        raise TypeError(f"{name} must have the dtype of q ({dtype_name(q)}), got {dtype_name(array)}")


def check_lse(lse: Any, problem: Problem) -> None:
    expected = problem.row_stats_shape
    layout = "(nheads, total_q)" if problem.varlen else "(batch, nheads, seqlen_q)"
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape {layout} = {expected}, got {tuple(lse.shape)}")
    if dtype_name(lse) != "float32":
        raise TypeError(f"lse must have dtype float32, got {dtype_name(lse)}")


def needs_copy(array: Any) -> bool:
    """Kernels take (batch, row, head) strides and need the head-dim contiguous.

    Arrays whose last dimension is not contiguous, or with negative or
    non-element-multiple strides, are copied to a contiguous array (documented
    in the API): a copy costs one pass over the array, far less than attention.
    """
    itemsize = array.dtype.itemsize
    strides = tuple(array.strides)
    for stride in strides:
        if stride < 0 or stride % itemsize:
            return True
    return array.shape[-1] > 1 and strides[-1] != itemsize


def check_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, *,
                  causal: Any, window_size: Any, softcap: Any, alibi_slopes: Any = None, sinks: Any = None,
                  cache_batch_idx: np.ndarray | None = None,
                  cache_leftpad: np.ndarray | None = None) -> tuple[Problem, np.ndarray]:
    """Validate attention_with_kvcache's arguments (``cache_seqlens`` an int, None or a host copy; ``block_table``,
    ``cache_batch_idx`` and ``cache_leftpad`` None or host copies) and return the Problem and the cache rows in use
    per sequence after the new ones are appended (int32, (batch,): its keys are rows cache_leftpad[b] .. of them).
    Nothing is written before this returns."""
    layout = check_kvcache_shapes(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad)
    if block_table is not None:
        check_block_table_values(block_table, layout.num_pages)
    used = kvcache_used_rows(cache_seqlens, layout)
    check_kvcache_index_values(cache_batch_idx, cache_leftpad, used, layout)
    keys = kvcache_keys(used, cache_leftpad)
    problem = kvcache_problem(q, k_cache, v_cache, layout, seqlen_k=int(keys.max(initial=0)), causal=causal,
                              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return problem, used


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """What the shapes of attention_with_kvcache's arrays say, before any value is read."""

    batch: int
    seqlen_new: int  # rows appended per sequence (0: no k, v)
    capacity: int  # key rows a sequence can hold: the cache's rows, or its pages' rows when paged
    page_size: int  # rows per page; 0: contiguous caches
    pages_per_sequence: int  # block_table's columns (paged only)
    num_pages: int  # pages of the caches (paged only)
    cache_batch: int = 0  # rows of the caches' batch (contiguous only)
    cache_batch_idx: bool = False  # sequence b reads cache row cache_batch_idx[b] (contiguous only)
    # Sequence b's keys start at cache row cache_leftpad[b]: the user's, contiguous caches only; a paged cache's are
    # a folded windowed decode's (chunks.paged_keys_from).
    cache_leftpad: bool = False


def check_kvcache_shapes(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, block_table: Any,
                         cache_batch_idx: Any = None, cache_leftpad: Any = None) -> KVCacheLayout:
    """The checks of check_kvcache that read shapes and dtypes only, so they also serve a ``block_table``,
    ``cache_batch_idx`` or ``cache_leftpad`` whose values are unknown (traced under JAX)."""
    batch = _check_ndim("q", q, "(batch, seqlen_q, nheads, headdim)")[0]
    paged = block_table is not None
    for name, index in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if index is None:
            continue
        if paged:
            raise ValueError(f"{name} indexes contiguous caches; with a paged cache block_table names each "
                             f"sequence's pages (FA2 refuses the pair too)")
        if dtype_name(index) != "int32" or tuple(index.shape) != (batch,):
            raise ValueError(f"{name} must be an int32 array of shape (batch,) = ({batch},), got "
                             f"{dtype_name(index)} {tuple(index.shape)}")
    layout = "(num_pages, page_size, nheads_k, headdim)" if paged else "(batch, seqlen_cache, nheads_k, headdim)"
    cache_shape = _check_ndim("k_cache", k_cache, layout)
    _check_v_shape(cache_shape, _check_ndim("v_cache", v_cache, layout.replace("headdim", "headdim_v")),
                   ("k_cache", "v_cache"))
    cache_rows, nheads_k, kheaddim = cache_shape[1:]
    if paged:
        pages_per_sequence = check_block_table_shape(block_table, batch, cache_rows, "k_cache")
        capacity = pages_per_sequence * cache_rows
    else:
        if cache_shape[0] != batch and cache_batch_idx is None:
            raise ValueError(f"k_cache must have q's batch size ({batch}) unless cache_batch_idx maps each sequence "
                             f"to a row of it, got {cache_shape[0]}")
        pages_per_sequence, capacity = 0, cache_rows
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) are given together or not at all")
    seqlen_new = 0
    if k is not None:
        new_shape = _check_ndim("k", k, "(batch, seqlen_new, nheads_k, headdim)")
        if new_shape[0] != batch or new_shape[2:] != (nheads_k, kheaddim):
            raise ValueError(f"k must have shape (batch, seqlen_new, nheads_k, headdim) = ({batch}, seqlen_new, "
                             f"{nheads_k}, {kheaddim}), got {new_shape}")
        new_v_shape = _check_ndim("v", v, "(batch, seqlen_new, nheads_k, headdim_v)")
        if new_v_shape != (*new_shape[:3], v_cache.shape[-1]):
            raise ValueError(f"v must have shape (batch, seqlen_new, nheads_k, headdim_v) = {new_shape[:3]} + "
                             f"({v_cache.shape[-1]},) (v_cache's head dim), got {new_v_shape}")
        seqlen_new = new_shape[1]
        for name, x in (("k", k), ("v", v)):
            if dtype_name(x) != dtype_name(k_cache):
                raise TypeError(f"{name} must have the caches' dtype {dtype_name(k_cache)}, got {dtype_name(x)}")
    return KVCacheLayout(batch=batch, seqlen_new=seqlen_new, capacity=capacity,
                         page_size=cache_rows if paged else 0, pages_per_sequence=pages_per_sequence,
                         num_pages=cache_shape[0] if paged else 0, cache_batch=0 if paged else cache_shape[0],
                         cache_batch_idx=cache_batch_idx is not None, cache_leftpad=cache_leftpad is not None)


def check_block_table_shape(block_table: Any, batch: int, page_size: int, cache_name: str) -> int:
    """A block_table's dtype and shape, int32 (batch, pages_per_sequence) with a page at least, and the page size
    (``cache_name``.shape[1]) a positive multiple of 16; returns pages_per_sequence."""
    if (dtype_name(block_table) != "int32" or len(block_table.shape) != 2 or block_table.shape[0] != batch
            or block_table.shape[1] == 0):
        raise ValueError(f"block_table must be int32 (batch, max_blocks_per_seq) with batch = {batch} and at "
                         f"least one page per sequence, got {dtype_name(block_table)} {tuple(block_table.shape)}")
    if page_size % 16 or page_size == 0:
        raise ValueError(f"the page size ({cache_name}.shape[1]) must be a positive multiple of 16, got {page_size}")
    return block_table.shape[1]


def check_kvcache_index_values(cache_batch_idx: np.ndarray | None, cache_leftpad: np.ndarray | None,
                               used: np.ndarray, layout: KVCacheLayout) -> None:
    """Host copies of cache_batch_idx and cache_leftpad against the caches and the rows in use (``used``, after the
    append): each sequence's cache row exists, and is its own when new rows are appended to it; each sequence's
    left padding ends at or before its cached rows do (0 <= cache_leftpad[b] <= cache_seqlens[b])."""
    if cache_batch_idx is not None and cache_batch_idx.size:
        low, high = min_max(cache_batch_idx)
        if low < 0 or high >= layout.cache_batch:
            b = int(np.argmax((cache_batch_idx < 0) | (cache_batch_idx >= layout.cache_batch)))
            raise ValueError(f"cache_batch_idx[{b}] must be in [0, {layout.cache_batch}) (the caches' batch), got "
                             f"{int(cache_batch_idx[b])}")
        if layout.seqlen_new and len(set(cache_batch_idx.tolist())) < cache_batch_idx.size:
            raise ValueError("cache_batch_idx must name distinct cache rows when k and v are appended: two sequences "
                             "would write the same rows")
    if cache_leftpad is not None and cache_leftpad.size:
        cached = used.astype(np.int64) - layout.seqlen_new
        wrong = (cache_leftpad < 0) | (cache_leftpad > cached)
        if wrong.any():
            b = int(np.argmax(wrong))
            raise ValueError(f"cache_leftpad[{b}] must be in 0..cache_seqlens[{b}] = {int(cached[b])}, got "
                             f"{int(cache_leftpad[b])}")


def kvcache_keys(used: Any, cache_leftpad: Any) -> Any:
    """The keys of each sequence (the kernels' seqlen_k): its cache rows in use less its left padding."""
    return used if cache_leftpad is None else used - cache_leftpad


def kvcache_key_extent(longest: int, capacity: int) -> int:
    """The seqlen_k a KV-cache call is planned for, given the keys of its longest sequence: ``longest`` rounded up to
    one of eight steps per power of two (a multiple of 16 at least), at most the caches' capacity.

    The kernels read each sequence's own key count (its seqused_k side input); a KV-cache Problem's seqlen_k only
    bounds the grid's K/V extent (kvcache_problem: any bound up to the capacity is as exact as the longest length;
    the mask's clipping, mask_for_lengths, clips less for a larger bound, and a windowed decode may then run
    unfolded). What it changes is the split-KV heuristic's input, by at most an eighth (or 16 keys). What it saves:
    a decode whose caches gain a row per call reaches a new seqlen_k every call, and each new one was a new plan (the
    NumPy API's prepared programs: a growing decode cost 156 us per call on this project's CPU host benchmark, a
    fixed one 48) or, in JAX, a new static call signature (a new lowering and compilation); with the bound a plan
    serves the next eighth of the length."""
    if longest <= 0:
        return 0
    step = 1 << max(4, longest.bit_length() - 4)  # longest in [2^(b-1), 2^b): steps of 2^(b-4) <= longest / 8
    return min(capacity, -(-longest // step) * step)


def check_block_table_values(block_table: np.ndarray, num_pages: int) -> None:
    """Every page a (host copy of a) block_table names exists."""
    if not block_table.size:
        return
    low, high = min_max(block_table)
    if low < 0 or high >= num_pages:
        raise ValueError(f"block_table names pages outside the cache: entries must be in [0, {num_pages}), got "
                         f"[{low}, {high}]")


def check_cache_seqlens_array(cache_seqlens: Any, batch: int) -> None:
    """The dtype and shape an array cache_seqlens must have (its values unread: they may be traced under JAX)."""
    if dtype_name(cache_seqlens) != "int32" or tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must be an int or an int32 array of shape (batch,) = ({batch},), got "
                         f"{dtype_name(cache_seqlens)} {tuple(cache_seqlens.shape)}")


def kvcache_used_rows(cache_seqlens: Any, layout: KVCacheLayout) -> np.ndarray:
    """The key rows in use per sequence once the new ones are appended (int32, (batch,)), from ``cache_seqlens``:
    None (the cache is full but for the new rows), an int or a host copy; checked against the capacity."""
    return kvcache_rows(cache_seqlens, layout)[1]


def kvcache_rows(cache_seqlens: Any, layout: KVCacheLayout) -> tuple[np.ndarray, np.ndarray, int]:
    """kvcache_used_rows with what a call reads beside it, worked out on the way: (the rows in use before the append
    per sequence, where its new rows go: cache_seqlens as an array; the rows in use after it, int32; the most rows
    in use after it, an int, 0 for no sequence)."""
    seqlen_new, capacity = layout.seqlen_new, layout.capacity
    if cache_seqlens is None:
        lengths = np.full(layout.batch, capacity - seqlen_new, np.int64)
    elif (type(cache_seqlens) is not np.ndarray and isinstance(cache_seqlens, numbers.Integral)
          and not isinstance(cache_seqlens, bool)):
        lengths = np.full(layout.batch, int(cache_seqlens), np.int64)
    else:
        check_cache_seqlens_array(cache_seqlens, layout.batch)
        lengths = cache_seqlens
    if not lengths.size:
        return lengths, np.zeros(0, np.int32), 0
    shortest, longest = min_max(lengths)  # Python ints: no int32 overflow below
    if shortest < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {shortest}")
    if longest + seqlen_new > capacity:
        b = int(np.argmax(lengths))
        raise ValueError(f"cache_seqlens[{b}] + seqlen_new = {longest} + {seqlen_new} exceeds the cache's "
                         f"capacity of {capacity} rows")
    # Every sum is at most the capacity, below 2**31; an int32 array plus a Python int that fits stays int32.
    used = lengths + seqlen_new if lengths.dtype == np.int32 else lengths.astype(np.int32) + seqlen_new
    return lengths, used, longest + seqlen_new


def kvcache_problem(q: Any, k_cache: Any, v_cache: Any, layout: KVCacheLayout, *, seqlen_k: int, causal: Any,
                    window_size: Any, softcap: Any, alibi_slopes: Any = None, sinks: Any = None) -> Problem:
    """The KV-cache Problem of checked shapes whose longest sequence uses ``seqlen_k`` key rows (the grid's
    extent: the true longest, or any bound up to the capacity when the lengths are unknown)."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_k, kheaddim = k_cache.shape[2:]
    problem = _problem(q, k_cache, v_cache, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads,
                       nheads_k=nheads_k, headdim=headdim, kheaddim=kheaddim, headdim_v=v_cache.shape[-1],
                       causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       dropout_p=0.0, deterministic=False, sinks=sinks)
    return dataclasses.replace(problem, kvcache=True, page_size=layout.page_size,
                               pages_per_sequence=layout.pages_per_sequence, cache_batch_idx=layout.cache_batch_idx,
                               cache_leftpad=layout.cache_leftpad)


def check_num_splits(num_splits: Any) -> int:
    """A forward's num_splits (split-KV): 0 (the heuristic), 1 (no split) or up to the combine kernel's limit."""
    value = _check_int("num_splits", num_splits)
    if not 0 <= value <= MAX_KV_SPLITS:
        raise ValueError(f"num_splits must be in [0, {MAX_KV_SPLITS}] (0: heuristic, 1: no split), got {value}")
    return value


def varlen_num_splits(num_splits: Any, decode_step: bool) -> Any:
    """attention_varlen's num_splits as the call runs it: None (its default) is 0, the heuristic, for a decode step
    over pages (which runs as attention_with_kvcache's decode, whose default that is) and 1 for any other call."""
    if num_splits is not None:
        return num_splits
    return 0 if decode_step else 1


def with_num_splits(problem: Problem, num_splits: Any) -> Problem:
    """A checked forward Problem with the call's num_splits (check_num_splits), which split-KV takes without dropout
    only (FA2's rule: the split kernels write float32 partials and draw no dropout mask)."""
    value = check_num_splits(num_splits)
    if value != 1 and problem.dropout_p > 0.0:
        raise ValueError(f"num_splits must be 1 when dropout_p > 0 (split-KV takes no dropout, as FA2's), got "
                         f"num_splits={value} with dropout_p={problem.dropout_p}")
    return problem if value == problem.num_splits else dataclasses.replace(problem, num_splits=value)
