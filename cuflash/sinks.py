"""Attention sinks on the host side: the rows' lse where no kernel runs and the sinks' gradient.

The rule itself (head h's logit s_h joins every row's softmax denominator, with no value) lives in
cuda_src/common/sink.cuh, which the forward kernels apply. The backward kernels need nothing more (the lse and out
they get include the sink), so the one quantity left to the host is the sinks' gradient, formed here from the
row statistics in NumPy, CuPy or jax.numpy alike:

    d loss / d s_h = sum_rows p_sink (dlse - D),   p_sink = exp(s_h - lse),   D = rowsum(dO * O),

since d out / d s_h = -p_sink out and d lse / d s_h = p_sink. Row statistics (lse, D) are (batch, nheads, seqlen_q)
or, for varlen, (nheads, total_q): the heads are always the second-to-last axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sink_logits_by_row(sinks: Any) -> Any:
    """The lse of rows that see no key: their head's sink logit, shaped to broadcast over the row statistics."""
    return sinks[:, None]


def sink_gradient(sinks: Any, lse: Any, dot: Any, xp: Any = np, unused_rows: Any = None) -> Any:
    """d loss / d sinks (nheads,), in float32 or the inputs' wider type: ``dot`` is D - dlse per row (the backward's
    D = rowsum(dO * O), less the lse's cotangent where it has one), ``lse`` the forward's (sink included: finite on
    every row a kernel computed). ``unused_rows`` (a boolean mask over the last axis: varlen rows past a used prefix,
    which no kernel computed) contribute nothing, whatever ``lse`` and ``dot`` hold there. Without them the sum is
    masked by nothing at all (a sharded JAX call then needs no more than the sum's all-reduce)."""
    dtype = xp.result_type(lse.dtype, dot.dtype, sinks.dtype, xp.float32)
    weight = xp.exp(sinks.astype(dtype)[:, None] - lse.astype(dtype))
    dot = dot.astype(dtype)
    if unused_rows is not None:
        weight = xp.where(unused_rows, 0.0, weight)
        dot = xp.where(unused_rows, 0.0, dot)
    terms = weight * dot
    axes = tuple(a for a in range(terms.ndim) if a != terms.ndim - 2)
    return -terms.sum(axis=axes).astype(dtype)
