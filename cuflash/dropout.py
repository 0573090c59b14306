"""Dropout's keep mask: the NumPy twin of cuda_src/common/dropout.cuh, and ``cuflash.dropout_mask``.

The mask is a pure function of (seed, batch, head, query row i, key j), so every kernel, the simulator and a
GPU drop the same elements bitwise, and a caller can rebuild it here (to feed a reference, or to check a
result). The rule is written out in dropout.cuh; this module computes the same Philox4x32-10 words in NumPy.
Kept probabilities are scaled by 1 / (1 - dropout_p); the lse is the undropped one.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW32 = np.uint64(0xFFFFFFFF)
MAX_SEED = 2**64 - 1


def philox4x32_10(counter: tuple[Any, Any, Any, Any], key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Random123's philox4x32_10) on broadcastable uint32 counter words; returns four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = int(key[0]), int(key[1])
    for round_ in range(10):
        if round_:
            k0 = (k0 + _W0) & 0xFFFFFFFF
            k1 = (k1 + _W1) & 0xFFFFFFFF
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & _LOW32,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & _LOW32)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def dropout_threshold(dropout_p: float) -> int:
    """dropout.cuh's threshold: an element is dropped iff its 32-bit Philox word is below floor(p 2^32)."""
    return min(int(math.floor(dropout_p * 2.0**32)), 2**32 - 1)


SEED_ROW_WORDS = 8  # words per row of the kernels' dropout_seed input (dropout.cuh's kSeedRowWords)


def seed_words(seed: int, first_batch: int = 0, first_head: int = 0, first_row: int = 0,
               first_key: int = 0) -> np.ndarray:
    """The kernels' dropout_seed side input (dropout.cuh) of a call with one seed: the 64-bit seed as two uint32
    words (low first), then the global index of the call's first batch, head, query row and key (nonzero only for
    a part of a larger call: a shard, a ring attention block), padded to a row of SEED_ROW_WORDS, viewed as
    float32 (AttentionParams' side buffers are float32-typed; kernels read the bits)."""
    words = [seed & 0xFFFFFFFF, seed >> 32, first_batch, first_head, first_row, first_key]
    return np.array(words + [0] * (SEED_ROW_WORDS - len(words)), dtype=np.uint32).view(np.float32)


def check_dropout_p(dropout_p: Any) -> float:
    """dropout_p validated: a real number in [0, 1)."""
    if isinstance(dropout_p, (bool, str, bytes)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def check_dropout_seed(dropout_seed: Any, dropout_p: float) -> int | None:
    """dropout_seed validated: an int in [0, 2**64), required when dropout_p > 0 (None otherwise allowed)."""
    if dropout_seed is None:
        if dropout_p > 0.0:
            raise ValueError("dropout_seed (an int) is required when dropout_p > 0")
        return None
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral):
        raise TypeError(f"dropout_seed must be an int, got {type(dropout_seed).__name__}")
    seed = int(dropout_seed)
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"dropout_seed must be in [0, 2**64), got {dropout_seed!r}")
    return seed


def keep_mask(seed: int, batch: Any, head: Any, rows: Any, keys: Any, dropout_p: float) -> np.ndarray:
    """Whether dropout keeps element (rows, keys) of (batch, head), on broadcastable integer arrays."""
    rows = np.asarray(rows, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.int64)
    words = philox4x32_10((keys >> 1, rows & ~8, np.asarray(head, dtype=np.int64), np.asarray(batch, dtype=np.int64)),
                          (seed & 0xFFFFFFFF, seed >> 32))
    which = 2 * ((rows >> 3) & 1) + (keys & 1)
    word = np.choose(np.broadcast_to(which, np.broadcast_shapes(which.shape, words[0].shape)), words)
    return word >= np.uint32(dropout_threshold(dropout_p))


def dropout_mask(seed: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float) -> np.ndarray:
    """The keep mask attention with ``dropout_p`` and ``dropout_seed=seed`` applies: bool (batch, nheads, seqlen_q,
    seqlen_k), True where the probability is kept (and scaled by 1 / (1 - dropout_p)). For varlen, batch is the
    sequence index and rows and keys are positions within the sequence."""
    p = check_dropout_p(dropout_p)
    seed = check_dropout_seed(seed, p)
    for name, value in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if seed is None:  # p == 0 without a seed: everything is kept
        return np.ones((batch, nheads, seqlen_q, seqlen_k), dtype=bool)
    b = np.arange(batch).reshape(-1, 1, 1, 1)
    h = np.arange(nheads).reshape(1, -1, 1, 1)
    i = np.arange(seqlen_q).reshape(1, 1, -1, 1)
    j = np.arange(seqlen_k).reshape(1, 1, 1, -1)
    return np.broadcast_to(keep_mask(seed, b, h, i, j, p), (batch, nheads, seqlen_q, seqlen_k)).copy()
