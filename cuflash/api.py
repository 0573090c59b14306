"""The public API: ``cuflash.attention`` and ``cuflash.attention_backward``.

Layout (batch, seqlen, nheads, headdim), the layout of FlashAttention and of
``jax.nn.dot_product_attention``. Where the arrays live picks where kernels run:

- NumPy arrays (and CPU arrays of other libraries, through DLPack) run on the
  CPU simulator: the same CUDA sources, every thread a fiber. Slow, exact to the
  CUDA programming model; this is how the library is tested without a GPU.
- CuPy arrays run on their GPU; other arrays with ``__dlpack__`` on a CUDA device
  (JAX, PyTorch) go through CuPy without a copy.

Results come back in the input's array type. Inputs whose last dimension is not
contiguous (or with negative strides) are copied once; everything else is used
in place through its strides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from . import _validation as V
from ._placement import Placement, ascontiguous, contiguous_last_dim, host_copy, place
from .backends.program import run_program
from .dropout import check_dropout_seed, seed_words
from .kernels import catalog, plans
from .kernels.program import gqa_decode_fold

def _side_inputs(backend: Any, alibi_slopes: Any, problem: plans.Problem, dropout_seed: int | None,
                 cu_seqlens: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    """The optional kernel inputs: ALiBi slopes, dropout's seed words and varlen's cu_seqlens on the backend's
    device (uploaded from the checked host copies; int32 words in float32-typed side buffers)."""
    inputs = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
    if problem.dropout_p > 0.0:
        inputs["dropout_seed"] = backend.upload(seed_words(dropout_seed))
    if cu_seqlens is not None:
        for name, host in zip(("cu_seqlens_q", "cu_seqlens_k"), cu_seqlens):
            inputs[name] = backend.upload(_int32_words(host))
    return inputs


def _int32_words(host: np.ndarray) -> np.ndarray:
    """An int32 side input (cu_seqlens, seqused_k, block_table) as the float32-typed words AttentionParams' side
    buffers hold (kernels read the bits)."""
    return np.ascontiguousarray(host, dtype=np.int32).view(np.float32)


def _forward(placement: Placement, problem: plans.Problem, q: Any, k: Any, v: Any, *, softmax_scale: Any,
             alibi_slopes: Any, dropout_seed: Any, algorithm: str, return_lse: Any,
             cu_seqlens: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
    """The forward every entry point runs once its arrays are placed and its Problem checked."""
    dropout_seed = check_dropout_seed(dropout_seed, problem.dropout_p)
    scale = V.check_softmax_scale(softmax_scale, problem.headdim)
    return_lse = V.check_bool("return_lse", return_lse)
    catalog.check_options(algorithm, problem)  # unknown algorithm or option: raises before anything is allocated
    q, k, v = contiguous_last_dim((q, k, v))
    out, lse = _run_forward(placement, problem, algorithm, scale, q, k, v,
                            lambda backend: _side_inputs(backend, alibi_slopes, problem, dropout_seed, cu_seqlens))
    return (out, lse) if return_lse else out


def _run_forward(placement: Placement, problem: plans.Problem, algorithm: str, scale: float, q: Any, k: Any, v: Any,
                 side_inputs: Callable[[Any], dict[str, Any]]) -> tuple[Any, Any]:
    """Allocate out and lse and run the forward program on checked arguments (``side_inputs(backend)`` gives the
    optional inputs on the backend's device); the results in the caller's array type. A one-row GQA decode runs
    folded (program.gqa_decode_fold): the same bytes, viewed with the group's query heads as rows."""
    backend = placement.backend()
    with backend.device():
        out = backend.empty(tuple(q.shape), q.dtype)
        lse = backend.empty(problem.row_stats_shape, np.float32)
        if problem.seqlen_k == 0:
            # No key at all: every row sees no key (the kernels' rule, without a launch).
            out[...] = 0
            lse[...] = -np.inf
        elif out.size:
            arrays = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
            folded = gqa_decode_fold(problem)
            if folded is not None:
                arrays.update(q=_group_rows(q, folded.seqlen_q), out=_group_rows(out, folded.seqlen_q),
                              lse=lse.reshape(folded.row_stats_shape))
                problem = folded
            program = plans.forward_program(algorithm, problem, backend.target)
            run_program(backend, program, problem, scale, {**arrays, **side_inputs(backend)})
    return placement.results(out, lse)


def _group_rows(x: Any, group: int) -> Any:
    """(batch, 1, nheads, d) viewed as (batch, group, nheads / group, d): query head kh * group + m at row m of kv
    head kh (no copy)."""
    batch, _, nheads, headdim = x.shape
    sb, _, sh, sd = x.strides
    shape, strides = (batch, group, nheads // group, headdim), (sb, sh, group * sh, sd)
    if isinstance(x, np.ndarray):
        return np.lib.stride_tricks.as_strided(x, shape, strides)
    import cupy

    return cupy.lib.stride_tricks.as_strided(x, shape, strides)


def _backward(placement: Placement, problem: plans.Problem, dout: Any, q: Any, k: Any, v: Any, out: Any,
              lse: Any, *, softmax_scale: Any, alibi_slopes: Any, dropout_seed: Any, algorithm: str,
              cu_seqlens: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[Any, Any, Any]:
    """The backward every entry point runs once its arrays are placed and its Problem checked."""
    dropout_seed = check_dropout_seed(dropout_seed, problem.dropout_p)
    V.check_like("dout", dout, "q", q)
    V.check_like("out", out, "q", q)
    V.check_lse(lse, problem)
    scale = V.check_softmax_scale(softmax_scale, problem.headdim)
    catalog.check_options(algorithm, problem)
    dout, q, k, v, out = contiguous_last_dim((dout, q, k, v, out))
    if not lse.flags.c_contiguous:
        lse = ascontiguous(lse)

    backend = placement.backend()
    with backend.device():
        dq = backend.empty(tuple(q.shape), q.dtype)
        dk = backend.empty(tuple(k.shape), k.dtype)
        dv = backend.empty(tuple(v.shape), v.dtype)
        if problem.seqlen_k == 0 or problem.seqlen_q == 0:
            # Nothing attends to anything: all gradients are zero.
            for grad in (dq, dk, dv):
                grad[...] = 0
        elif dq.size:
            program = plans.backward_program(algorithm, problem, backend.target)
            arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
                      **_side_inputs(backend, alibi_slopes, problem, dropout_seed, cu_seqlens)}
            run_program(backend, program, problem, scale, arrays)
        elif dk.size:
            # Varlen with no query row at all (total_q = 0): no key is seen.
            dk[...] = 0
            dv[...] = 0
    return placement.results(dq, dk, dv)


_OPTIONS_DOC = """
    Options (all algorithms take windows; softcap, ALiBi and dropout need algorithm="fa2"):

    - ``causal``: the mask's diagonal is aligned to the bottom-right corner: with
      off = seqlen_k - seqlen_q, query i sees key j iff j <= i + off.
    - ``window_size=(left, right)``: a local band, -1 unbounded: query i sees key j iff
      (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right);
      ``causal=True`` sets right = 0.
    - ``softcap=c > 0``: the score is c * tanh(scale * q.k / c) instead of scale * q.k.
    - ``alibi_slopes``: float32, (nheads,) or (batch, nheads); -slope * |i + off - j| is
      added to the (softcapped) score of query head h (the lse includes it).
    - ``dropout_p`` in [0, 1) with ``dropout_seed`` (an int, required when dropout_p > 0):
      after the softmax, P is multiplied by keep / (1 - dropout_p); the lse is unchanged.
      The keep mask is a pure function of (seed, batch, head, i, j), the same on every
      algorithm variant and backend; ``cuflash.dropout_mask`` returns it. The backward
      must get the forward's dropout_p and dropout_seed.

    A query row that sees no key gets output 0, lse -inf and zero gradients."""


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
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
) -> Any:
    placement, alibi_slopes = place(("q", "k", "v"), (q, k, v), alibi_slopes)
    q, k, v = placement.arrays[:3]
    problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    return _forward(placement, problem, q, k, v, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes,
                    dropout_seed=dropout_seed, algorithm=algorithm, return_lse=return_lse)


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    deterministic: bool = False,
) -> tuple[Any, Any, Any]:
    placement, alibi_slopes = place(("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse), alibi_slopes)
    dout, q, k, v, out, lse = placement.arrays[:6]
    problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic)
    return _backward(placement, problem, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                     alibi_slopes=alibi_slopes, dropout_seed=dropout_seed, algorithm=algorithm)


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
) -> Any:
    placement, alibi_slopes = place(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
                                     (q, k, v, cu_seqlens_q, cu_seqlens_k), alibi_slopes)
    q, k, v = placement.arrays[:3]
    cu_seqlens = (host_copy(placement.arrays[3]), host_copy(placement.arrays[4]))
    problem = V.check_varlen_qkv(q, k, v, *cu_seqlens, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 causal=causal, window_size=window_size, softcap=softcap,
                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    return _forward(placement, problem, q, k, v, softmax_scale=softmax_scale, alibi_slopes=alibi_slopes,
                    dropout_seed=dropout_seed, algorithm=algorithm, return_lse=return_lse, cu_seqlens=cu_seqlens)


def attention_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    deterministic: bool = False,
) -> tuple[Any, Any, Any]:
    names = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k")
    placement, alibi_slopes = place(names, (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), alibi_slopes)
    dout, q, k, v, out, lse = placement.arrays[:6]
    cu_seqlens = (host_copy(placement.arrays[6]), host_copy(placement.arrays[7]))
    problem = V.check_varlen_qkv(q, k, v, *cu_seqlens, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 causal=causal, window_size=window_size, softcap=softcap,
                                 alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic)
    return _backward(placement, problem, dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                     alibi_slopes=alibi_slopes, dropout_seed=dropout_seed, algorithm=algorithm,
                     cu_seqlens=cu_seqlens)


def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    k: Any = None,
    v: Any = None,
    cache_seqlens: Any = None,
    block_table: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    algorithm: str = "fa2",
    return_lse: bool = False,
) -> Any:
    optional = {name: x for name, x in (("k", k), ("v", v), ("block_table", block_table)) if x is not None}
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        optional["cache_seqlens"] = cache_seqlens
    names = ("q", "k_cache", "v_cache", *optional)
    placement, alibi_slopes = place(names, (q, k_cache, v_cache, *optional.values()), alibi_slopes)
    placed = dict(zip(names, placement.arrays))
    # The caches are written in place: refuse read-only ones (a JAX array, a NumPy array with writeable=False)
    # before anything is read or written, on every backend alike.
    placement.check_writable(("k_cache", "v_cache"), "attention_with_kvcache",
                             "for JAX arrays cuflash.jax.attention_with_kvcache, which returns the updated caches")
    q, k_cache, v_cache = placed["q"], placed["k_cache"], placed["v_cache"]
    k, v = placed.get("k"), placed.get("v")
    table = host_copy(placed["block_table"]) if "block_table" in placed else None
    lengths = host_copy(placed["cache_seqlens"]) if "cache_seqlens" in placed else cache_seqlens
    problem, used = V.check_kvcache(q, k_cache, v_cache, k, v, lengths, table, causal=causal,
                                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    problem = dataclasses.replace(problem, num_splits=V.check_num_splits(num_splits))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if V.needs_copy(cache):
            raise ValueError(f"{name} is updated in place, so its last dimension must be contiguous (and its strides "
                             f"non-negative)")
    scale = V.check_softmax_scale(softmax_scale, problem.headdim)
    return_lse = V.check_bool("return_lse", return_lse)
    catalog.check_options(algorithm, problem)
    if k is not None and k.shape[1]:
        _append(k_cache, v_cache, k, v, used - k.shape[1], table)  # every check is behind us: now write
    (q,) = contiguous_last_dim((q,))

    def side_inputs(backend: Any) -> dict[str, Any]:
        inputs = {"seqused_k": backend.upload(_int32_words(used))}
        if table is not None:
            inputs["block_table"] = backend.upload(_int32_words(table))
        return {**_side_inputs(backend, alibi_slopes, problem, None), **inputs}

    out, lse = _run_forward(placement, problem, algorithm, scale, q, k_cache, v_cache, side_inputs)
    return (out, lse) if return_lse else out


def _append(k_cache: Any, v_cache: Any, k: Any, v: Any, starts: np.ndarray, table: np.ndarray | None) -> None:
    """Write the new rows into the caches in place: k[b, i] to key row starts[b] + i of sequence b (its page and
    row in the page when paged). One scatter per cache, in the caches' own array library."""
    batch, seqlen_new = k.shape[:2]
    rows = starts.astype(np.int64)[:, None] + np.arange(seqlen_new)[None, :]  # (batch, seqlen_new)
    if table is None:
        outer = np.broadcast_to(np.arange(batch)[:, None], rows.shape)
    else:
        page_size = k_cache.shape[1]
        outer = np.take_along_axis(table.astype(np.int64), rows // page_size, axis=1)
        rows = rows % page_size
    if not isinstance(k_cache, np.ndarray):
        import cupy

        outer, rows = cupy.asarray(outer), cupy.asarray(rows)
    k_cache[outer, rows] = k
    v_cache[outer, rows] = v


attention.__doc__ = """Scaled dot-product attention softmax(score) v, score = scale * q k^T (see options).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)
    with nheads a multiple of nheads_k (GQA/MQA); dtype float16, bfloat16 or float32
    (all equal), head dim 1..256. ``softmax_scale`` defaults to 1/sqrt(headdim).
    ``algorithm``: "fa2" (default), "fa1" or "standard".

    Returns out (like q), or (out, lse) with lse float32 (batch, nheads, seqlen_q),
    the log-sum-exp of the scores of each query row.
""" + _OPTIONS_DOC

attention_backward.__doc__ = """Gradients (dq, dk, dv) of ``attention`` given dout = dL/dout.

    ``out`` and ``lse`` are what ``attention(..., return_lse=True)`` returned for the same
    q, k, v and options. dq is like q; dk, dv are like k, v (for GQA/MQA they sum over the
    query heads of a group). ``deterministic=True`` asks for bitwise-reproducible
    gradients (the fa2 backward otherwise accumulates dq with float32 atomics, whose order
    varies between runs on a GPU). No gradient flows to alibi_slopes.
""" + _OPTIONS_DOC

attention_varlen.__doc__ = """Attention over a batch of variable-length sequences packed without padding.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim). cu_seqlens_q and
    cu_seqlens_k: int32 (batch + 1,), from 0 to total_q (total_k), nondecreasing: sequence b
    is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q attending to rows cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] of k and v, exactly as ``attention`` on that sequence alone (the mask's
    off = seqlen_k - seqlen_q is the sequence's own). Zero-length sequences are allowed.
    The cu_seqlens are read on the host before any kernel runs (a CuPy array is copied, which
    waits for the device). ``max_seqlen_q`` / ``max_seqlen_k`` default to the longest sequence;
    a larger value only enlarges the grid, a smaller one is an error. ``alibi_slopes`` may be
    (batch, nheads) per sequence. algorithm="fa2" only; no work or traffic for padding.

    Returns out (total_q, nheads, headdim), or (out, lse) with lse float32 (nheads, total_q).
""" + _OPTIONS_DOC

attention_varlen_backward.__doc__ = """Gradients (dq, dk, dv) of ``attention_varlen`` given dout = dL/dout.

    Arguments as for ``attention_varlen`` (out and lse as it returned them); dq is like q,
    dk and dv like k and v. ``deterministic=True`` as in ``attention_backward``.
""" + _OPTIONS_DOC

attention_with_kvcache.__doc__ = """Attention of q over a KV cache, appending new keys and values first (inference).

    q: (batch, seqlen_q, nheads, headdim). Caches: k_cache, v_cache (batch, seqlen_cache, nheads_k,
    headdim), or paged (num_pages, page_size, nheads_k, headdim) with ``block_table`` int32 (batch,
    max_blocks_per_seq) naming each sequence's pages in order (any page size that is a multiple of 16).
    ``cache_seqlens``: int32 (batch,), an int, or None (the cache is full but for the new rows): the rows
    already in use per sequence. New ``k``, ``v`` (batch, seqlen_new, nheads_k, headdim) are written into
    the caches in place at rows cache_seqlens[b] .. + seqlen_new; then q attends to keys
    [0, cache_seqlens[b] + seqlen_new) of its sequence, the mask's diagonal aligned bottom-right to that
    length (off = cache_seqlens[b] + seqlen_new - seqlen_q). Window, softcap and ALiBi as for ``attention``;
    no dropout, no backward. ``num_splits``: split-KV ("flash-decoding"): each sequence's keys are cut into
    that many ranges computed by separate thread blocks, merged by their lse in a combine kernel (float32
    partial results). 1: no split; n (<= 128): n splits, at most one per K/V block; 0: FA2's heuristic, which
    splits only when the unsplit grid leaves SMs idle (the device's SM count; on the simulator the count of
    its target's representative part, cuflash/kernels/targets.py). A one-row decode over GQA/MQA heads runs
    with each group's query heads as rows (K and V read once per kv head) when no window's left bound and no
    ALiBi depend on the row. cache_seqlens and block_table are read on the host and
    checked (capacity, page numbers) before anything is written: a rejected call leaves the caches as they
    were. Returns out (like q), or (out, lse) with lse float32 (batch, nheads, seqlen_q).
"""
