"""Who sees whom: the mask description a Problem carries, and the NumPy twin of cuda_src/common/mask.cuh.

Rule (FlashAttention's, bottom-right aligned): with ``off = seqlen_k - seqlen_q``, query row ``i`` sees key ``j``
(``0 <= j < seqlen_k``) iff ``(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)``;
-1 is unbounded, ``causal`` is ``(-1, 0)``. ``MaskPolicy`` answers the same questions as the C++ ``MaskPolicy``
(method for method, with the same names; a simulator test compares them) for the reference, the test helpers and
every family's plan and traffic code. Nothing else in cuflash decides visibility.

Chunked attention (``chunk`` c > 0, FA3's ``attention_chunk``; Llama 4's local layers) adds
``(i + off) // c == j // c``: a row sees only the keys of its diagonal's chunk. The kernels take no chunks: a chunked
call runs as independent sequences, one per chunk (``MaskPolicy.chunk_segments``, vLLM's "virtual batches"), each
with the window alone and aligned to its own lengths, which is exact (the method says why). So a chunked policy
answers only the row-level questions (``key_begin``, ``key_end``, ``visible``, ``matrix``, ``rows_without_key``, its
segments); a Problem, whose policy the kernels' plans read, carries none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class IndexRange(NamedTuple):
    """Half-open ``[begin, end)``; empty when ``end <= begin``."""

    begin: int
    end: int

    @property
    def empty(self) -> bool:
        return self.end <= self.begin

    def __len__(self) -> int:
        return max(0, self.end - self.begin)


class TileEdges(NamedTuple):
    """The edges of the band a tile crosses (mask.cuh's TileEdges): a key left of a row's window, right of it, or
    past seqlen_k hides some score of the tile's rows."""

    left: bool
    right: bool
    end: bool

    @property
    def any(self) -> bool:
        return self.left or self.right or self.end


class LaneTileMask(NamedTuple):
    """One lane's limits in a tile (mask.cuh's LaneTileMask): from (row, key), the score at (row + dr, key + dc) is
    seen iff dc - dr >= left (with a left window), dc - dr < right (with a right window) and dc < end."""

    left: int
    right: int
    end: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Mask:
    """A frozen mask description: a local window ``(window_left, window_right)`` around the bottom-right diagonal,
    and chunks of ``chunk`` keys (0: none) that a row does not see out of."""

    window_left: int = -1
    window_right: int = -1
    chunk: int = 0

    def __post_init__(self):
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < -1:
                raise ValueError(f"Mask.{name} must be an int >= -1 (-1: unbounded), got {value!r}")
            object.__setattr__(self, name, int(value))
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, (int, np.integer)) or self.chunk < 0:
            raise ValueError(f"Mask.chunk must be an int >= 0 (0: no chunks), got {self.chunk!r}")
        object.__setattr__(self, "chunk", int(self.chunk))

    @classmethod
    def causal(cls, flag: bool = True) -> Mask:
        return cls(-1, 0) if flag else cls()

    @classmethod
    def of(cls, causal: bool, window_size: tuple[int, int], chunk: int = 0) -> Mask:
        """The mask of the API's ``causal``, ``window_size=(left, right)`` and ``attention_chunk``: causal sets
        right = 0."""
        left, right = window_size
        return cls(left, 0 if causal else right, chunk)

    @classmethod
    def top_left(cls, left: int | None, right: int | None, seqlen_q: int, seqlen_k: int) -> Mask | None:
        """The band i - left <= j <= i + right aligned to the top-left corner (jax.nn.dot_product_attention's
        local window and causal mask; None: unbounded) as this bottom-right Mask: shifted by seqlen_k - seqlen_q.
        None when a shifted bound falls below 0, which -1 (unbounded) cannot express."""
        offset = seqlen_k - seqlen_q
        bounds = []
        for bound, shift in ((left, offset), (right, -offset)):
            if bound is None:
                bounds.append(-1)
            elif bound + shift < 0:
                return None
            else:
                bounds.append(bound + shift)
        return cls(*bounds)

    @property
    def last_row_sees_every_key(self) -> bool:
        """Whether the last query row sees every key, whatever the lengths: its diagonal is the last key, so only a
        left bound (a window's or a chunk's) can hide keys from it. One query row under such a mask is unmasked
        attention."""
        return self.window_left < 0 and self.chunk == 0

    @property
    def is_causal(self) -> bool:
        return self.window_left < 0 and self.window_right == 0 and self.chunk == 0

    @property
    def is_full(self) -> bool:
        return self.window_left < 0 and self.window_right < 0 and self.chunk == 0

    @property
    def window(self) -> Mask:
        """This mask without its chunks: what each of its virtual batches runs (MaskPolicy.chunk_segments)."""
        return Mask(self.window_left, self.window_right)

    @property
    def without_window(self) -> bool:
        """No mask or causal: what kernels without sliding-window support (the Hopper kernels) serve."""
        return self.is_full or self.is_causal

    def policy(self, seqlen_q: int, seqlen_k: int) -> MaskPolicy:
        return MaskPolicy(seqlen_q, seqlen_k, self.window_left, self.window_right, self.chunk)


@dataclass(frozen=True)
class MaskPolicy:
    """The NumPy twin of the C++ ``MaskPolicy`` for one (seqlen_q, seqlen_k)."""

    seqlen_q: int
    seqlen_k: int
    window_left: int = -1
    window_right: int = -1
    chunk: int = 0

    def diagonal(self, row):
        return np.asarray(row) + (self.seqlen_k - self.seqlen_q)

    def chunk_begin(self, row):
        """The first key of the chunk of ``row``'s diagonal (chunked attention only)."""
        return self.diagonal(row) // self.chunk * self.chunk

    def key_begin(self, row):
        row = np.asarray(row)
        begin = np.zeros_like(row) if self.window_left < 0 else np.maximum(0, self.diagonal(row) - self.window_left)
        return np.maximum(begin, self.chunk_begin(row)) if self.chunk > 0 else begin

    def key_end(self, row):
        row = np.asarray(row)
        if self.window_right < 0:
            end = np.full_like(row, self.seqlen_k)
        else:
            end = np.minimum(self.seqlen_k, self.diagonal(row) + self.window_right + 1)
        return np.minimum(end, self.chunk_begin(row) + self.chunk) if self.chunk > 0 else end

    def visible(self, row, key):
        """Whether row sees key (broadcasting); ``visible(rows[:, None], keys[None, :])`` is the whole mask."""
        key = np.asarray(key)
        return (key >= self.key_begin(row)) & (key < self.key_end(row))

    def matrix(self) -> np.ndarray:
        """The (seqlen_q, seqlen_k) boolean mask."""
        return self.visible(np.arange(self.seqlen_q)[:, None], np.arange(self.seqlen_k)[None, :])

    def chunk_segments(self) -> list[tuple[IndexRange, IndexRange]]:
        """Chunked attention as independent sequences (vLLM's "virtual batches"): (query rows, keys) per segment, in
        order, the rows tiling 0 .. seqlen_q and the keys tiling 0 .. seqlen_k. A segment holds the rows whose
        diagonal lies in one chunk and that chunk's keys (the last clipped to seqlen_k); rows before key 0's chunk
        (negative diagonals) come first with no key, and the chunks of keys before the first row's chunk (and of every
        key when there is no row) are segments with no row: no segment holds more than a chunk of keys.
        Run as its own sequence with this policy's window and no chunks, bottom-right aligned to its own lengths, a
        segment sees exactly what its rows see here: row i's diagonal within it, (i - row_begin) + (keys - rows),
        equals i + seqlen_k - seqlen_q - key_begin, whether its rows start at its chunk's first diagonal or at row 0
        and whether its keys end at the chunk's end or at seqlen_k (tests/test_mask.py checks it element by element)."""
        if self.chunk <= 0:
            raise ValueError("chunk_segments needs a chunked policy (chunk > 0)")
        off = self.seqlen_k - self.seqlen_q
        segments = []
        row = min(max(0, -off), self.seqlen_q)
        if row:  # rows whose diagonal is negative
            segments.append((IndexRange(0, row), IndexRange(0, 0)))
        key = 0

        def without_rows(end: int) -> None:  # keys no row's chunk holds, a sequence per chunk
            nonlocal key
            while key < end:
                segments.append((IndexRange(row, row), IndexRange(key, min(end, key + self.chunk))))
                key = segments[-1][1].end

        while row < self.seqlen_q:
            first_key = (row + off) // self.chunk * self.chunk
            without_rows(first_key)
            end_row = min(self.seqlen_q, first_key + self.chunk - off)
            key = min(self.seqlen_k, first_key + self.chunk)
            segments.append((IndexRange(row, end_row), IndexRange(first_key, key)))
            row = end_row
        without_rows(self.seqlen_k)
        return segments

    @staticmethod
    def lone_row_left_bound(mask: Mask) -> int | None:
        """What hides keys from a lone last query row (a decode step): only a window's left bound (its right bound and
        the causal mask end at the row's own key, the last); None without one."""
        return mask.window_left if mask.window_left >= 0 and mask.chunk == 0 else None

    @staticmethod
    def decode_first_key(window_left: int, keys: Any, xp: Any = np) -> Any:
        """The first key a lone query row sees under a window's left bound, per sequence of ``keys`` keys (an int
        array, NumPy's or jax.numpy's): its diagonal is the last key, keys - 1 (0 without a bound or a key)."""
        return xp.maximum(keys - 1 - window_left, 0) if window_left >= 0 else xp.zeros_like(keys)

    @staticmethod
    def rows_chunk(chunk: int, seqlen_q: int, keys: Any, xp: Any = np) -> tuple[Any, Any]:
        """chunk_segments for sequences of ``keys`` keys each (an int array, NumPy's or jax.numpy's: a KV cache's
        sequences) whose seqlen_q rows all lie in one chunk: per sequence, the first key of the chunk of its last
        row's diagonal (0 without keys), and whether every row lies in that chunk (then its one segment with rows is
        rows 0 .. seqlen_q with keys from there to the end: a call whose keys start there, with the window alone,
        is the chunked one; a decode step's single row always does)."""
        last = keys - 1  # the last row's diagonal
        first_key = xp.where(keys > 0, last // chunk * chunk, 0)
        return first_key, (keys <= 0) | (keys - seqlen_q >= first_key)

    def rows_without_key(self) -> np.ndarray:
        """Boolean (seqlen_q,): rows whose visible interval is empty."""
        rows = np.arange(self.seqlen_q)
        return self.key_end(rows) <= self.key_begin(rows)

    def keys_of_rows(self, row_begin: int, row_end: int) -> IndexRange:
        if row_end <= row_begin:
            return IndexRange(0, 0)
        keys = IndexRange(int(self.key_begin(row_begin)), int(self.key_end(row_end - 1)))
        return IndexRange(0, 0) if keys.empty else keys

    def rows_of_keys(self, key_begin: int, key_end: int) -> IndexRange:
        if key_end <= key_begin:
            return IndexRange(0, 0)
        off = self.seqlen_k - self.seqlen_q
        rows = IndexRange(0 if self.window_right < 0 else max(0, key_begin - self.window_right - off),
                          self.seqlen_q if self.window_left < 0 else min(self.seqlen_q, key_end + self.window_left - off))
        return IndexRange(0, 0) if rows.empty else rows

    def kv_blocks(self, block_n: int, row_begin: int, row_end: int) -> IndexRange:
        keys = self.keys_of_rows(row_begin, row_end)
        return IndexRange(keys.begin // block_n, _ceil_div(keys.end, block_n))

    def q_blocks(self, block_m: int, key_begin: int, key_end: int) -> IndexRange:
        rows = self.rows_of_keys(key_begin, key_end)
        return IndexRange(rows.begin // block_m, _ceil_div(rows.end, block_m))

    def tile_edges(self, row0: int, rows: int, key0: int, keys: int) -> TileEdges:
        return TileEdges(self.window_left >= 0 and key0 < int(self.diagonal(row0 + rows - 1)) - self.window_left,
                         self.window_right >= 0 and key0 + keys - 1 > int(self.diagonal(row0)) + self.window_right,
                         key0 + keys > self.seqlen_k)

    def tile_needs_mask(self, row0: int, rows: int, key0: int, keys: int) -> bool:
        return self.tile_edges(row0, rows, key0, keys).any

    def lane_tile(self, row: int, key: int) -> LaneTileMask:
        diagonal = int(self.diagonal(row))
        return LaneTileMask(diagonal - self.window_left - key, diagonal + self.window_right + 1 - key,
                            self.seqlen_k - key)

    def visible_from(self, limits: LaneTileMask, dr, dc):
        """visible(row + dr, key + dc) as a tile's mask tests it, from lane_tile(row, key)'s limits (broadcasting)."""
        dr, dc = np.broadcast_arrays(dr, dc)
        seen = dc < limits.end
        if self.window_left >= 0:
            seen = seen & (dc - dr >= limits.left)
        if self.window_right >= 0:
            seen = seen & (dc - dr < limits.right)
        return seen
