"""Plain NumPy attention: the yardstick every cuflash kernel is measured against.

Two roles, one code path:

* ``dtype=np.float64`` (default) is the *reference*: exact-as-practical attention with float64 inputs,
  float64 accumulation and no intermediate rounding.
* ``dtype`` of float32, float16 or bfloat16 is an *emulation of a low-precision implementation*: the inputs
  and every intermediate a kernel has to materialise in that format (the scores S, the probabilities P, the
  output O; in the backward also dP, dS and the gradients) are rounded to ``dtype``, while sums run in the
  accumulator a GPU would use (float32 for float16/bfloat16 tensor-core MMAs, the dtype itself otherwise).
  FlashAttention's own test suite judges a kernel by how far this low-precision result strays from the
  reference (see ``cuflash._tolerance``), so the emulation is deliberately *as coarse as* a straightforward
  implementation in that precision, not finer: it rounds S, which a fused kernel keeps in float32 registers.

Conventions (the same as FlashAttention 2):

* q is (batch, seqlen_q, nheads, headdim); k and v are (batch, seqlen_k, nheads_k, headdim), v may have a head
  dim of its own (then so has out).
* Grouped/multi-query attention: ``nheads % nheads_k == 0`` and query head ``h`` reads kv head
  ``h // (nheads // nheads_k)``.
* ``causal=True`` aligns the mask to the bottom-right corner of the score matrix: query row ``i`` sees key
  ``j`` iff ``j <= i + seqlen_k - seqlen_q``. With ``seqlen_q > seqlen_k`` the first ``seqlen_q - seqlen_k``
  rows see no key at all.
* A query row that sees no key (those rows, or any row when ``seqlen_k == 0``) has output 0 and
  log-sum-exp ``-inf``: the empty sum of exponentials is 0 and its logarithm is ``-inf``. Its gradients are
  0. Nothing is ever NaN, which is the behaviour FlashAttention documents and users ask for.
* lse is the natural log-sum-exp of the *scaled* scores, shape (batch, nheads, seqlen_q), in the
  accumulator dtype (float64 for the reference, float32 for every low-precision emulation, matching the
  float32 LSE a kernel writes).

Memory: the score matrix is formed one block at a time - one batch entry, one kv head with the query heads
that read it, and as many query rows as fit ``_BLOCK_ELEMENTS`` scores - so long sequences cost time, not a
(batch, nheads, seqlen_q, seqlen_k) array. Every row sees all its keys within a block, so chunking changes
no result.
"""

from __future__ import annotations

import math

import numpy as np

from ._dtypes import BF16_PACKAGE_HINT
from .mask import Mask

try:  # ml_dtypes registers "bfloat16" with NumPy; it is needed only for bfloat16 emulation.
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a test extra
    _ml_dtypes = None

# Largest score block formed at once (values in the accumulator dtype): 2**22 float64 values are 32 MiB, so
# a long-sequence reference costs time, not memory.
_BLOCK_ELEMENTS = 1 << 22

__all__ = ["attention_reference", "attention_backward_reference", "resolve_dtype", "accumulator_dtype"]


def resolve_dtype(dtype) -> np.dtype:
    """Normalise a dtype spec (np.float16, "bfloat16", ml_dtypes.bfloat16, ...) to one the reference supports."""
    if isinstance(dtype, str) and dtype == "bfloat16" and _ml_dtypes is None:
        raise ValueError(f"bfloat16 emulation: {BF16_PACKAGE_HINT}")
    resolved = np.dtype(dtype)
    supported = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)]
    if _ml_dtypes is not None:
        supported.append(np.dtype(_ml_dtypes.bfloat16))
    if resolved not in supported:
        raise ValueError(f"unsupported dtype {resolved}; expected one of {[str(d) for d in supported]}")
    return resolved


def accumulator_dtype(dtype) -> np.dtype:
    """The format sums run in: float64 for the reference, float32 for everything narrower (tensor-core MMAs
    accumulate float16/bfloat16 products in float32)."""
    return np.dtype(np.float64) if resolve_dtype(dtype) == np.float64 else np.dtype(np.float32)


def _round(x: np.ndarray, dtype: np.dtype, acc: np.dtype) -> np.ndarray:
    """Round ``x`` to ``dtype`` (round-to-nearest-even, as a GPU conversion does) and hand it back in ``acc``."""
    if dtype == acc:
        return x.astype(acc, copy=False)
    return x.astype(dtype).astype(acc)


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "expected q (batch, seqlen_q, nheads, headdim) and k, v (batch, seqlen_k, nheads_k, headdim); "
            f"got ndims {q.ndim}, {k.ndim}, {v.ndim}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"v must have k's shape but for the head dim, got {k.shape} and {v.shape}")
    batch, seqlen_q, nheads, headdim = q.shape
    batch_k, seqlen_k, nheads_k, headdim_k = k.shape
    if batch_k != batch:
        raise ValueError(f"batch mismatch: q has {batch}, k/v have {batch_k}")
    if headdim_k != headdim:
        raise ValueError(f"head dim mismatch: q has {headdim}, k/v have {headdim_k}")
    if headdim == 0:
        raise ValueError("headdim must be at least 1")
    if nheads_k == 0:
        if nheads != 0:
            raise ValueError(f"nheads_k is 0 but nheads is {nheads}")
    elif nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    return batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim


def _visible_keys(rows: range, seqlen_q: int, seqlen_k: int, mask: Mask) -> np.ndarray:
    """(len(rows), seqlen_k) bool: which keys the query rows ``rows`` attend to (cuflash.mask decides)."""
    policy = mask.policy(seqlen_q, seqlen_k)
    return policy.visible(np.arange(rows.start, rows.stop)[:, None], np.arange(seqlen_k)[None, :])


class _Scores:
    """The score transforms of one call: softcap and ALiBi on top of scale * q.k.

    ``__call__`` maps a block of q.k (group, rows, seqlen_k) to (score, d score / d (scale q.k)), both in the
    accumulator; the low-precision emulation rounds the score once, as a kernel forming it in that format would.
    """

    def __init__(self, scale, softcap, alibi_slopes, batch, nheads, seqlen_q, seqlen_k, acc):
        self.scale, self.acc = acc.type(scale), acc
        self.softcap = acc.type(softcap or 0.0)
        self.slopes = None
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=np.float64)
            if slopes.shape not in ((nheads,), (batch, nheads)):
                raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {slopes.shape}")
            self.slopes = np.broadcast_to(slopes, (batch, nheads)).astype(acc)
        self.policy = Mask().policy(seqlen_q, seqlen_k)

    def __call__(self, qk, b, heads, rows):
        scaled = qk * self.scale
        dscore = np.ones_like(scaled)
        if self.softcap > 0:
            tanh = np.tanh(scaled / self.softcap)
            scaled, dscore = self.softcap * tanh, 1 - tanh * tanh
        if self.slopes is not None:
            distance = np.abs(self.policy.diagonal(np.arange(rows.start, rows.stop))[:, None]
                              - np.arange(self.policy.seqlen_k)[None, :]).astype(self.acc)
            scaled = scaled - self.slopes[b, heads][:, None, None] * distance
        return scaled, dscore


class _Mods:
    """A call's user mods (FlexAttention's score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx),
    cuflash.flex_attention's), evaluated element by element on a block: every (query head, row, key) of it at once,
    the indices as int32 arrays broadcast to the block's shape. The mods are the user's Python functions (jax.numpy
    code), run with 64-bit JAX types on, so a float64 score stays float64 (captured float32 arrays are read as they
    are). d score_mod / d score comes from jax.jvp in score (the mods are element-wise)."""

    def __init__(self, score_mod, mask_mod, acc):
        self.score_mod, self.mask_mod, self.acc = score_mod, mask_mod, acc

    def __bool__(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    @staticmethod
    def _indices(b, heads: slice, rows: range, seqlen_k: int):
        return (np.int32(b), np.arange(heads.start, heads.stop, dtype=np.int32)[:, None, None],
                np.arange(rows.start, rows.stop, dtype=np.int32)[None, :, None],
                np.arange(seqlen_k, dtype=np.int32)[None, None, :])

    def scores(self, scaled, dscore, b, heads: slice, rows: range):
        """(score_mod(scaled), dscore times d score_mod / d score) of a (group, rows, seqlen_k) block."""
        if self.score_mod is None:
            return scaled, dscore
        import jax

        index = self._indices(b, heads, rows, scaled.shape[-1])
        with jax.enable_x64(True):
            value, slope = jax.jvp(lambda s: self.score_mod(s, *index), (jax.numpy.asarray(scaled),),
                                   (jax.numpy.ones_like(scaled),))
        shape = scaled.shape
        return (np.broadcast_to(np.asarray(value, dtype=self.acc), shape),
                dscore * np.broadcast_to(np.asarray(slope, dtype=self.acc), shape))

    def visible(self, visible, b, heads: slice, rows: range):
        """The block's visibility (rows, seqlen_k) narrowed by mask_mod to (group, rows, seqlen_k)."""
        if self.mask_mod is None:
            return visible
        import jax

        with jax.enable_x64(True):
            kept = np.asarray(self.mask_mod(*self._indices(b, heads, rows, visible.shape[-1])), dtype=bool)
        return visible & kept


def _blocks(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int):
    """Yield (b, kv_head, query heads slice, query rows range): the units the score matrix is formed in.

    Rows are chunked so that one block's scores stay under ``_BLOCK_ELEMENTS`` values.
    """
    group = nheads // nheads_k if nheads_k else 0
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, group * seqlen_k))
    for b in range(batch):
        for kv_head in range(nheads_k):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            for start in range(0, seqlen_q, rows_per_block):
                yield b, kv_head, heads, range(start, min(start + rows_per_block, seqlen_q))


def _scale(softmax_scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _group_rows(x: np.ndarray, b: int, heads: slice, rows: range) -> np.ndarray:
    """Query-side tensor (batch, seqlen_q, nheads, d) -> (group, len(rows), d) for one block."""
    return x[b, rows.start:rows.stop, heads, :].transpose(1, 0, 2)


def _softmax_block(scores: np.ndarray, visible: np.ndarray, dtype: np.dtype, acc: np.dtype, sink=None):
    """Masked softmax of one (group, seqlen_q, seqlen_k) block of already-scaled scores (in ``acc``).

    Returns (P rounded to ``dtype``, lse in ``acc``). Rows without a visible key get P = 0 and lse = -inf;
    the row maximum of such a row is replaced by 0 before subtracting so no inf - inf NaN ever forms.
    ``sink``: the group's sink logits (group,) in ``acc``, a term e^{s_h} in each row's denominator with no value
    (a row without a visible key then gets lse s_h).
    """
    masked = np.where(visible, scores, -np.inf)
    row_max = np.max(masked, axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:
        row_max = np.maximum(row_max, sink[:, None, None])
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0).astype(acc)
    unnormalised = np.exp(masked - safe_max)  # exp(-inf) = 0 on masked entries
    row_sum = np.sum(unnormalised, axis=-1, keepdims=True)
    if sink is not None:
        row_sum = row_sum + np.exp(sink[:, None, None] - safe_max)
    has_key = row_sum > 0
    probabilities = unnormalised / np.where(has_key, row_sum, 1.0).astype(acc)
    with np.errstate(divide="ignore"):
        lse = np.where(has_key, safe_max + np.log(np.where(has_key, row_sum, 1.0)), -np.inf).astype(acc)
    return _round(probabilities, dtype, acc), lse[..., 0]


def _forward_block(qg, kb, vb, visible, scores_of, dropout, dtype, acc, sink=None):
    """One block: qg (group, rows, d), kb/vb (seqlen_k, d), all already rounded and in ``acc``; ``scores_of``
    maps q.k to (score, d score / d (scale q.k)); ``dropout`` is None or the block's factor keep / (1 - p);
    ``sink`` None or the group's sink logits. Returns (P, the P that multiplies V (P times the dropout factor),
    out, lse, d score / d (scale q.k))."""
    scores, dscore = scores_of(qg @ kb.T)
    probabilities, lse = _softmax_block(_round(scores, dtype, acc), visible, dtype, acc, sink)
    dropped = probabilities if dropout is None else _round(probabilities * dropout, dtype, acc)
    out = _round(dropped @ vb, dtype, acc)
    return probabilities, dropped, out, lse, dscore


class _Dropout:
    """Dropout of one call: per block, the factor keep / (1 - dropout_p) of ``dropout_mask`` (None: no dropout)."""

    def __init__(self, dropout_p, dropout_mask, batch, nheads, seqlen_q, seqlen_k, acc):
        self.mask = None
        if not dropout_p:
            return
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs dropout_mask (cuflash.dropout_mask gives the kernels' mask)")
        mask = np.asarray(dropout_mask)
        if mask.shape != (batch, nheads, seqlen_q, seqlen_k) or mask.dtype != np.bool_:
            raise ValueError(f"dropout_mask must be bool {(batch, nheads, seqlen_q, seqlen_k)}, "
                             f"got {mask.dtype} {mask.shape}")
        self.mask, self.rescale = mask, acc.type(1.0 / (1.0 - dropout_p))

    def __call__(self, b, heads, rows):
        if self.mask is None:
            return None
        return self.mask[b, heads, rows.start:rows.stop, :] * self.rescale


def _sinks(sinks, nheads: int, acc: np.dtype):
    """The sink logits (nheads,) in the accumulator, or None."""
    if sinks is None:
        return None
    sinks = np.asarray(sinks, dtype=np.float64)
    if sinks.shape != (nheads,):
        raise ValueError(f"sinks must have shape ({nheads},), got {sinks.shape}")
    return sinks.astype(acc)


def _prepare(arrays, dtype: np.dtype, acc: np.dtype):
    """Inputs rounded to ``dtype`` (a no-op for data already in it), held in the accumulator format."""
    return [_round(np.asarray(a), dtype, acc) for a in arrays]


def attention_reference(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                        window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                        dropout_mask=None, dtype=np.float64, sinks=None, score_mod=None, mask_mod=None,
                        attention_chunk: int = 0):
    """Attention forward. Returns ``(out, lse)``.

    out has q's shape in ``dtype``; lse is (batch, nheads, seqlen_q) in ``accumulator_dtype(dtype)``.
    ``softmax_scale`` defaults to 1/sqrt(headdim); ``window_size``, ``attention_chunk``, ``softcap`` and
    ``alibi_slopes`` mean what they mean for ``cuflash.attention``. With ``dropout_p`` > 0, ``dropout_mask`` (bool,
    (batch, nheads, seqlen_q, seqlen_k), True = kept; ``cuflash.dropout_mask`` makes the kernels' one) multiplies P by
    keep / (1 - dropout_p) before P V; the lse is unchanged. ``sinks`` (nheads,): head h's logit s_h joins each
    row's softmax denominator with no value (the lse includes it; a row that sees no key gets lse s_h).
    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``: cuflash.flex_attention's mods
    (Python functions; score_mod applies after softcap and ALiBi, mask_mod hides scores besides the mask). See the
    module docstring for masking, GQA and the low-precision emulation that ``dtype`` selects.
    """
    dtype = resolve_dtype(dtype)
    acc = accumulator_dtype(dtype)
    q, k, v = _prepare((q, k, v), dtype, acc)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = _check_shapes(q, k, v)
    scale = _scale(softmax_scale, headdim)
    mask = Mask.of(causal, window_size, attention_chunk)
    scores_of = _Scores(scale, softcap, alibi_slopes, batch, nheads, seqlen_q, seqlen_k, acc)
    dropout_of = _Dropout(dropout_p, dropout_mask, batch, nheads, seqlen_q, seqlen_k, acc)
    sinks = _sinks(sinks, nheads, acc)
    mods = _Mods(score_mod, mask_mod, acc)
    out = np.zeros((batch, seqlen_q, nheads, v.shape[-1]), dtype=acc)  # v's head dim
    lse = np.full((batch, nheads, seqlen_q), -np.inf, dtype=acc)
    for b, kv_head, heads, rows in _blocks(batch, seqlen_q, seqlen_k, nheads, nheads_k):
        visible = mods.visible(_visible_keys(rows, seqlen_q, seqlen_k, mask), b, heads, rows)
        qg = _group_rows(q, b, heads, rows)
        _, _, out_g, lse_g, _ = _forward_block(qg, k[b, :, kv_head, :], v[b, :, kv_head, :], visible,
                                            lambda qk: mods.scores(*scores_of(qk, b, heads, rows), b, heads, rows),
                                            dropout_of(b, heads, rows), dtype, acc,
                                            None if sinks is None else sinks[heads])
        out[b, rows.start:rows.stop, heads, :] = out_g.transpose(1, 0, 2)
        lse[b, heads, rows.start:rows.stop] = lse_g
    return out.astype(dtype), lse


def attention_backward_reference(
    dout, q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
    softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, dropout_mask=None, dtype=np.float64, sinks=None,
    score_mod=None, mask_mod=None, return_score_grads: bool = False, attention_chunk: int = 0
):
    """Gradients of ``sum(out * dout)`` with respect to q, k and v. Returns ``(dq, dk, dv)`` in ``dtype``, and with
    ``sinks`` also d / d sinks, -sum_rows e^{s_h - lse} D (in the accumulator: (dq, dk, dv, dsinks)).

    With grouped heads, dk and dv of a kv head are the sums over the query heads that read it. Rows that see no
    key contribute nothing and receive zero dq. The math is FlashAttention 2's: P recomputed from q and k,
    dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D) * score', dQ = scale dS K, dK = scale dS^T Q
    (score' = d score / d (scale q.k): 1 - tanh^2 with softcap, else 1). With dropout (factor Z = keep / (1 - p)):
    dV = (P Z)^T dO and dP = (dO V^T) Z; D = rowsum(dO * O) is unchanged (O is the dropped output).
    In the low-precision emulation P, O, dP and dS are rounded to ``dtype`` as a kernel feeding them to MMAs
    would, D and the group sums stay in the accumulator, and each gradient is rounded once at the end.
    ``score_mod`` / ``mask_mod`` as for attention_reference (score' then includes d score_mod / d score).
    ``return_score_grads``: also return P * (dP - D), d loss / d score per (batch, head, row, key) in the
    accumulator (what flows into the arrays a score_mod reads), after the other results.
    """
    dtype = resolve_dtype(dtype)
    acc = accumulator_dtype(dtype)
    dout, q, k, v = _prepare((dout, q, k, v), dtype, acc)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = _check_shapes(q, k, v)
    if dout.shape != (*q.shape[:3], v.shape[-1]):
        raise ValueError(f"dout must have q's shape with v's head dim, {(*q.shape[:3], v.shape[-1])}, got "
                         f"{dout.shape}")
    scale = _scale(softmax_scale, headdim)
    mask = Mask.of(causal, window_size, attention_chunk)
    scores_of = _Scores(scale, softcap, alibi_slopes, batch, nheads, seqlen_q, seqlen_k, acc)
    dropout_of = _Dropout(dropout_p, dropout_mask, batch, nheads, seqlen_q, seqlen_k, acc)
    sinks = _sinks(sinks, nheads, acc)
    dsinks = None if sinks is None else np.zeros(nheads, dtype=acc)
    dq = np.zeros(q.shape, dtype=acc)
    dk = np.zeros(k.shape, dtype=acc)
    dv = np.zeros(v.shape, dtype=acc)
    mods = _Mods(score_mod, mask_mod, acc)
    score_grads = np.zeros((batch, nheads, seqlen_q, seqlen_k), dtype=acc) if return_score_grads else None
    for b, kv_head, heads, rows in _blocks(batch, seqlen_q, seqlen_k, nheads, nheads_k):
        visible = mods.visible(_visible_keys(rows, seqlen_q, seqlen_k, mask), b, heads, rows)
        qg = _group_rows(q, b, heads, rows)
        dog = _group_rows(dout, b, heads, rows)
        kb, vb = k[b, :, kv_head, :], v[b, :, kv_head, :]
        dropout = dropout_of(b, heads, rows)
        sink = None if sinks is None else sinks[heads]
        probabilities, dropped, out_g, lse_g, dscore = _forward_block(
            qg, kb, vb, visible, lambda qk: mods.scores(*scores_of(qk, b, heads, rows), b, heads, rows), dropout,
            dtype, acc, sink)
        if mods:  # a mod's derivative where it hides the score (or where the mod is undefined) is no gradient
            dscore = np.where(visible, dscore, 0.0).astype(acc)
        # (group, sk, d) per query head, summed over the group and the row blocks in the accumulator; the
        # gradients are rounded to ``dtype`` once, at the end.
        dv[b, :, kv_head, :] += (dropped.transpose(0, 2, 1) @ dog).sum(axis=0)
        dprobabilities = _round(dog @ vb.T, dtype, acc)
        if dropout is not None:
            dprobabilities = dprobabilities * dropout
        delta = np.sum(dog * out_g, axis=-1, keepdims=True)
        if sink is not None:  # d out / d s_h = -p_sink out, p_sink = e^{s_h - lse}
            dsinks[heads] -= np.sum(np.exp(sink[:, None] - lse_g) * delta[..., 0], axis=-1)
        if score_grads is not None:
            score_grads[b, heads, rows.start:rows.stop, :] = probabilities * (dprobabilities - delta)
        dscores = _round(probabilities * (dprobabilities - delta) * dscore, dtype, acc)
        dq[b, rows.start:rows.stop, heads, :] = ((dscores @ kb) * acc.type(scale)).transpose(1, 0, 2)
        dk[b, :, kv_head, :] += (dscores.transpose(0, 2, 1) @ qg).sum(axis=0) * acc.type(scale)
    grads = dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)
    grads = grads if dsinks is None else (*grads, dsinks)
    return grads if score_grads is None else (*grads, score_grads)


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(b, query rows, key rows) of each sequence of a varlen batch, as slices of the packed tensors."""
    cu_q, cu_k = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be (batch + 1,) arrays, got {cu_q.shape} and "
                         f"{cu_k.shape}")
    for b in range(len(cu_q) - 1):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def _sequence_options(b: int, rows: slice, keys: slice, alibi_slopes, dropout_mask) -> dict:
    """The per-sequence options of a varlen batch: its ALiBi slopes row and the corner of the dropout mask its
    positions index ((batch, nheads, max_seqlen_q, max_seqlen_k), as ``cuflash.dropout_mask`` makes it)."""
    slopes = np.asarray(alibi_slopes) if alibi_slopes is not None else None
    return {
        "alibi_slopes": slopes[b:b + 1] if slopes is not None and slopes.ndim == 2 else slopes,
        "dropout_mask": None if dropout_mask is None
        else dropout_mask[b:b + 1, :, :rows.stop - rows.start, :keys.stop - keys.start],
    }


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False,
                               softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                               alibi_slopes=None, dropout_p: float = 0.0, dropout_mask=None, dtype=np.float64,
                               sinks=None, attention_chunk: int = 0):
    """Varlen attention forward: ``attention_reference`` of each sequence alone. Returns ``(out, lse)``.

    q (total_q, nheads, d), k and v (total_k, nheads_k, d), cu_seqlens as for ``cuflash.attention_varlen``;
    out (total_q, nheads, d) in ``dtype``, lse (nheads, total_q). ``alibi_slopes`` (nheads,) or (batch, nheads);
    ``dropout_mask`` (batch, nheads, max_seqlen_q, max_seqlen_k) indexed by positions within each sequence.
    """
    dtype = resolve_dtype(dtype)
    acc = accumulator_dtype(dtype)
    q, k, v = (np.asarray(a) for a in (q, k, v))
    scale = _scale(softmax_scale, q.shape[-1])
    out = np.zeros((*q.shape[:2], v.shape[-1]), dtype=dtype)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, dtype=acc)
    for b, rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        out_b, lse_b = attention_reference(q[None, rows], k[None, keys], v[None, keys], causal=causal,
                                           softmax_scale=scale, window_size=window_size, softcap=softcap,
                                           dropout_p=dropout_p, dtype=dtype, sinks=sinks,
                                           attention_chunk=attention_chunk,
                                           **_sequence_options(b, rows, keys, alibi_slopes, dropout_mask))
        out[rows] = out_b[0]
        lse[:, rows] = lse_b[0]
    return out, lse


def attention_varlen_backward_reference(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False,
                                        softmax_scale: float | None = None, window_size=(-1, -1),
                                        softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0,
                                        dropout_mask=None, dtype=np.float64, sinks=None,
                                        attention_chunk: int = 0):
    """Gradients of ``attention_varlen_reference``: ``attention_backward_reference`` of each sequence alone.
    Returns ``(dq, dk, dv)`` shaped like q, k, v, in ``dtype`` (with ``sinks``, and dsinks summed over the
    sequences)."""
    dtype = resolve_dtype(dtype)
    dout, q, k, v = (np.asarray(a) for a in (dout, q, k, v))
    scale = _scale(softmax_scale, q.shape[-1])
    dq = np.zeros(q.shape, dtype=dtype)
    dk = np.zeros(k.shape, dtype=dtype)
    dv = np.zeros(v.shape, dtype=dtype)
    dsinks = None if sinks is None else np.zeros(q.shape[1], dtype=accumulator_dtype(dtype))
    for b, rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
        grads = attention_backward_reference(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                             causal=causal, softmax_scale=scale, window_size=window_size,
                                             softcap=softcap, dropout_p=dropout_p, dtype=dtype, sinks=sinks,
                                             attention_chunk=attention_chunk,
                                             **_sequence_options(b, rows, keys, alibi_slopes, dropout_mask))
        dq[rows], dk[keys], dv[keys] = (g[0] for g in grads[:3])
        if dsinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def kvcache_keys(cache, lengths, block_table=None, cache_batch_idx=None, cache_leftpad=None):
    """Each sequence's keys in use, as a list of (keys, nheads_k, headdim) arrays: rows [leftpad[b], lengths[b]) of
    cache[cache_batch_idx[b]] (leftpad 0 and row b without them), or for a paged cache (num_pages, page_size, ...)
    row j < lengths[b] of page block_table[b][j // page_size]."""
    cache = np.asarray(cache)
    keys = []
    for b, length in enumerate(np.asarray(lengths, dtype=np.int64)):
        rows = np.arange(0 if cache_leftpad is None else int(cache_leftpad[b]), length)
        if block_table is None:
            keys.append(cache[b if cache_batch_idx is None else int(cache_batch_idx[b]), rows])
        else:
            page_size = cache.shape[1]
            pages = np.asarray(block_table)[b, rows // page_size]
            keys.append(cache[pages, rows % page_size])
    return keys


def attention_with_kvcache_reference(q, k_cache, v_cache, lengths, *, block_table=None, causal: bool = False,
                                     softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                                     alibi_slopes=None, dtype=np.float64, sinks=None, cache_batch_idx=None,
                                     cache_leftpad=None, attention_chunk: int = 0):
    """Attention of q over the cache rows [cache_leftpad[b], lengths[b]) of each sequence's cache row
    cache_batch_idx[b] (after any append; leftpad 0 and row b without them): an explicit loop of
    ``attention_reference`` per sequence, causal aligned bottom-right to its keys. Returns (out, lse)."""
    dtype = resolve_dtype(dtype)
    acc = accumulator_dtype(dtype)
    q = np.asarray(q)
    scale = _scale(softmax_scale, q.shape[-1])
    out = np.zeros((*q.shape[:3], np.shape(v_cache)[-1]), dtype=dtype)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf, dtype=acc)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
    indexing = dict(block_table=block_table, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
    for b, (keys, values) in enumerate(zip(kvcache_keys(k_cache, lengths, **indexing),
                                           kvcache_keys(v_cache, lengths, **indexing))):
        row_slopes = slopes[b:b + 1] if slopes is not None and slopes.ndim == 2 else slopes
        out_b, lse_b = attention_reference(q[b:b + 1], keys[None], values[None], causal=causal, softmax_scale=scale,
                                           window_size=window_size, softcap=softcap, alibi_slopes=row_slopes,
                                           dtype=dtype, sinks=sinks, attention_chunk=attention_chunk)
        out[b], lse[b] = out_b[0], lse_b[0]
    return out, lse
