"""Block masks for flex attention: which (query block, key block) pairs a ``mask_mod`` leaves empty, partial or full.

    doc_ids = jnp.asarray(...)                                 # (B, Q_LEN), one document id per token
    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    mask = create_block_mask(same_document, B, None, Q_LEN, Q_LEN)  # H None: one mask for every head
    print(mask)                                                # shape, block sizes, sparsity, picture of blocks
    visits = mask.tile_lists(64, 128)                          # what a kernel with 64 x 128 tiles reads

``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query row ``q_idx`` of batch ``b`` and query head ``h`` sees
key ``kv_idx`` (int32 scalars; written with Python operators and jax.numpy, possibly indexing captured jax
arrays). ``create_block_mask`` evaluates it once per (q, kv) pair on the host and reduces each block of
``block_size = (q, kv)`` pairs to one of three states, counting only pairs inside ``(Q_LEN, KV_LEN)`` (the last
blocks are ragged when the lengths are not multiples of the block size):

- empty: no pair visible. Kernels skip the block without reading it.
- partial: some pairs visible, some hidden. Kernels read it and apply ``mask_mod`` per score.
- full: every pair visible. Kernels read it and apply no mask.

A BlockMask keeps, per (b, h, q block), the kv blocks that are partial and those that are full (the forward's
loop), and the transposed lists, per (b, h, kv block), its partial and full q blocks (the backward's loop over
key blocks). Kernel tiles need not match the mask's blocks: ``BlockMask.tile_lists`` derives, conservatively,
which kernel tiles to visit and which of those are full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
from typing import Any, Callable, NamedTuple

import numpy as np

try:
    import jax
except ImportError:  # the block lists and their host methods need only NumPy; create_block_mask needs JAX
    jax = None

# Block states, as BlockMask.to_dense reports them.
EMPTY, PARTIAL, FULL = 0, 1, 2
# What index lists hold past their count (every slot of kv_indices from kv_num_blocks on, and so on).
UNUSED_SLOT = 0

# The most (b, h, q, kv) mask values create_block_mask evaluates at once: 2**24 bools are 16 MB, and what
# mask_mod computes per value (a gathered document id: 4 bytes) a few times that, whatever the sequence lengths.
_MAX_SCORES_PER_CHUNK = 1 << 24

# __repr__ draws at most this many block rows and columns.
_PICTURE_ROWS, _PICTURE_COLUMNS = 32, 64
_PICTURE_CHARS = {EMPTY: ".", PARTIAL: "+", FULL: "#"}

# The per-(b, h) index arrays, in the order BlockMask declares them (they are the JAX pytree's leaves).
_ARRAY_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value)


def _positive_pair(name: str, value: Any, *, scalar_means_both: bool = False) -> tuple[int, int]:
    """``value`` as a (q, kv) pair of positive ints; with ``scalar_means_both`` one int stands for both."""
    if scalar_means_both and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value, value)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        expected = "an int or a (q, kv) pair of ints" if scalar_means_both else "a (q, kv) pair of ints"
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return _positive_int(f"{name}[0]", value[0]), _positive_int(f"{name}[1]", value[1])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _mod_name(mask_mod: Callable) -> str:
    return getattr(mask_mod, "__qualname__", None) or repr(mask_mod)


# ---------------------------------------------------------------------------------------------------------------
# Index lists <-> membership. One canonical form: the listed blocks first, increasing, then UNUSED_SLOT.


def _lists(member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts and canonical index lists of a (..., n) membership array."""
    counts = member.sum(axis=-1, dtype=np.int32)
    order = np.argsort(~member, axis=-1, kind="stable")  # members first, each group in increasing order
    used = np.arange(member.shape[-1]) < counts[..., None]
    return counts, np.where(used, order, UNUSED_SLOT).astype(np.int32)


def _as_int_array(name: str, value: Any, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    return array


def _membership(counts_name: str, counts: np.ndarray, indices_name: str, indices: np.ndarray,
                n: int) -> np.ndarray:
    """The (..., n) bool membership the first ``counts`` slots of each ``indices`` row list (any order, no repeats)."""
    width = indices.shape[-1]
    if counts.size and (counts.min() < 0 or counts.max() > min(width, n)):
        raise ValueError(f"{counts_name} must lie in [0, {min(width, n)}], got values in "
                         f"[{counts.min()}, {counts.max()}]")
    used = np.arange(width) < counts[..., None]
    listed = indices[used]
    if listed.size and (listed.min() < 0 or listed.max() >= n):
        raise ValueError(f"{indices_name} must list blocks in [0, {n}), got values in [{listed.min()}, {listed.max()}]")
    member = np.zeros(indices.shape[:-1] + (n + 1,), dtype=bool)  # column n collects the unused slots
    np.put_along_axis(member, np.where(used, indices, n).astype(np.intp), True, axis=-1)
    member = member[..., :n]
    if not np.array_equal(member.sum(axis=-1), counts):
        raise ValueError(f"{indices_name} lists a block twice in one row")
    return member


def _states(partial: np.ndarray, full: np.ndarray) -> np.ndarray:
    return np.where(full, FULL, np.where(partial, PARTIAL, EMPTY)).astype(np.int8)


# ---------------------------------------------------------------------------------------------------------------
# Kernel tiles.


class TileVisits(NamedTuple):
    """Per (b, h, row tile), the column tiles a kernel visits.

    ``counts (B, H, rows)``; ``indices (B, H, rows, columns)``: the visited tiles first, increasing, then
    UNUSED_SLOT; ``full (B, H, rows, columns)``: whether the tile in that slot is full (no mask to apply),
    False past the count.
    """

    counts: np.ndarray
    indices: np.ndarray
    full: np.ndarray


class TileLists(NamedTuple):
    """A BlockMask seen through a kernel's tiles: ``kv``, per q tile its kv tiles (the forward's loop); ``q``, per
    kv tile its q tiles (the backward's loop over key tiles)."""

    tile_size: tuple[int, int]
    kv: TileVisits
    q: TileVisits


def _visits(visit: np.ndarray, full: np.ndarray) -> TileVisits:
    counts, indices = _lists(visit)
    used = np.arange(visit.shape[-1]) < counts[..., None]
    return TileVisits(counts, indices, np.take_along_axis(full, indices, axis=-1) & used)


def _overlapped_blocks(length: int, tile: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile of ``tile`` rows over ``length`` rows, the half-open range of mask blocks its in-bounds rows touch."""
    starts = np.arange(0, length, tile)
    ends = np.minimum(starts + tile, length)
    return starts // block, (ends - 1) // block + 1


def _rectangle_sums(flags: np.ndarray, rows: tuple[np.ndarray, np.ndarray],
                    cols: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per (row range, column range) pair, how many of ``flags[..., rows, cols]`` are set (2-D prefix sums)."""
    prefix = np.zeros(flags.shape[:-2] + (flags.shape[-2] + 1, flags.shape[-1] + 1), dtype=np.int64)
    prefix[..., 1:, 1:] = flags.cumsum(axis=-2, dtype=np.int64).cumsum(axis=-1)
    (r0, r1), (c0, c1) = (rows[0][:, None], rows[1][:, None]), (cols[0][None, :], cols[1][None, :])
    return prefix[..., r1, c1] - prefix[..., r0, c1] - prefix[..., r1, c0] + prefix[..., r0, c0]


# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Per (b, h), the partial and full blocks of a mask over ``seq_lengths = (Q_LEN, KV_LEN)``, in blocks of
    ``block_size = (q, kv)`` rows and keys.

    With ``nq = ceil(Q_LEN / q)`` and ``nkv = ceil(KV_LEN / kv)`` block rows and columns, the arrays (int32,
    read-only) are

    - ``kv_num_blocks (B, H, nq)``, ``kv_indices (B, H, nq, nkv)``: per q block, its partial kv blocks;
    - ``full_kv_num_blocks``, ``full_kv_indices``: the same for its full kv blocks;
    - ``q_num_blocks (B, H, nkv)``, ``q_indices (B, H, nkv, nq)``, ``full_q_num_blocks``, ``full_q_indices``:
      the transposed lists, per kv block its partial and full q blocks.

    Every index list holds its blocks first, in increasing order, and UNUSED_SLOT (0) past its count. A block is
    in at most one of the partial and full lists; one in neither is empty. B or H is 1 where the mask is the
    same for every batch entry or head (broadcast). ``mask_mod`` is the function partial blocks apply per score
    (None: none, every listed pair is visible).

    The constructor checks all of this (ValueError or TypeError naming the field); ``create_block_mask`` and
    ``BlockMask.from_kv_blocks`` build one. Under JAX the arrays are pytree leaves, the rest static; host
    methods (``to_dense``, ``sparsity``, ``tile_lists``) need concrete arrays, not tracers.
    """

    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]
    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray
    full_kv_num_blocks: np.ndarray
    full_kv_indices: np.ndarray
    q_num_blocks: np.ndarray
    q_indices: np.ndarray
    full_q_num_blocks: np.ndarray
    full_q_indices: np.ndarray
    mask_mod: Callable | None = None

    def __post_init__(self):
        seq_lengths = _positive_pair("BlockMask.seq_lengths", self.seq_lengths)
        block_size = _positive_pair("BlockMask.block_size", self.block_size)
        object.__setattr__(self, "seq_lengths", seq_lengths)
        object.__setattr__(self, "block_size", block_size)
        if self.mask_mod is not None and not callable(self.mask_mod):
            raise TypeError(f"BlockMask.mask_mod must be callable or None, got {type(self.mask_mod).__name__}")
        nq, nkv = self.block_grid
        arrays = {name: _as_int_array(f"BlockMask.{name}", getattr(self, name), 3 if "num" in name else 4)
                  for name in _ARRAY_FIELDS}
        batch, heads = arrays["kv_num_blocks"].shape[:2]
        expected = {"kv_num_blocks": (nq,), "kv_indices": (nq, nkv), "q_num_blocks": (nkv,), "q_indices": (nkv, nq)}
        for name, array in arrays.items():
            shape = (batch, heads) + expected[name.removeprefix("full_")]
            if array.shape != shape:
                raise ValueError(f"BlockMask.{name} must have shape {shape} (B, H and the block grid {nq} x {nkv} "
                                 f"of seq_lengths {seq_lengths} in blocks of {block_size}), got {array.shape}")
        members = {}
        for prefix in ("", "full_"):
            for side, n in (("kv", nkv), ("q", nq)):
                counts, indices = f"{prefix}{side}_num_blocks", f"{prefix}{side}_indices"
                member = _membership(f"BlockMask.{counts}", arrays[counts], f"BlockMask.{indices}",
                                     arrays[indices], n)
                if not np.array_equal(_lists(member)[1], arrays[indices]):
                    raise ValueError(f"BlockMask.{indices} must list its blocks first, in increasing order, and "
                                     f"{UNUSED_SLOT} past {counts}")
                members[prefix + side] = member
        if (members["kv"] & members["full_kv"]).any():
            raise ValueError("BlockMask.kv_indices and BlockMask.full_kv_indices must not both list a block")
        for prefix in ("", "full_"):
            if not np.array_equal(members[prefix + "q"].swapaxes(-1, -2), members[prefix + "kv"]):
                raise ValueError(f"BlockMask.{prefix}q_indices must be the transpose of BlockMask.{prefix}kv_indices")
        for name, array in arrays.items():
            array = array.astype(np.int32)  # a copy: the caller's arrays stay theirs, these stay unchanged
            array.flags.writeable = False
            object.__setattr__(self, name, array)

    # -- constructors -------------------------------------------------------------------------------------------

    @classmethod
    def _from_states(cls, states: np.ndarray, seq_lengths: tuple[int, int], block_size: tuple[int, int],
                     mask_mod: Callable | None) -> BlockMask:
        """The BlockMask of a (B, H, nq, nkv) array of block states."""
        partial, full = states == PARTIAL, states == FULL
        lists = {}
        for prefix, member in (("", partial), ("full_", full)):
            lists[f"{prefix}kv_num_blocks"], lists[f"{prefix}kv_indices"] = _lists(member)
            lists[f"{prefix}q_num_blocks"], lists[f"{prefix}q_indices"] = _lists(member.swapaxes(-1, -2))
        return cls(seq_lengths=seq_lengths, block_size=block_size, mask_mod=mask_mod, **lists)

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any = None,
                       full_kv_indices: Any = None, *, seq_lengths: tuple[int, int], block_size: Any = 128,
                       mask_mod: Callable | None = None) -> BlockMask:
        """A BlockMask from its forward lists, per (b, h, q block) the partial kv blocks and (optionally) the full
        ones; the transposed lists are derived.

        ``kv_num_blocks (B, H, nq)``; ``kv_indices (B, H, nq, width)`` with ``width <= nkv``, the first count
        entries of a row naming its blocks in any order (no repeats; the rest is ignored). ``full_*`` as these,
        both given or both None (no full blocks). ``block_size``: an int or a (q, kv) pair.
        """
        seq_lengths = _positive_pair("seq_lengths", seq_lengths)
        block_size = _positive_pair("block_size", block_size, scalar_means_both=True)
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable or None, got {type(mask_mod).__name__}")
        nq, nkv = _ceil_div(seq_lengths[0], block_size[0]), _ceil_div(seq_lengths[1], block_size[1])
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices must both be given or both be None")
        members = []
        for counts_name, counts, indices_name, indices in (
                ("kv_num_blocks", kv_num_blocks, "kv_indices", kv_indices),
                ("full_kv_num_blocks", full_kv_num_blocks, "full_kv_indices", full_kv_indices)):
            if counts is None:
                members.append(np.zeros_like(members[0]))
                continue
            counts = _as_int_array(counts_name, counts, 3)
            indices = _as_int_array(indices_name, indices, 4)
            shape = (members[0].shape[:2] if members else counts.shape[:2]) + (nq,)
            if counts.shape != shape:
                raise ValueError(f"{counts_name} must have shape {shape} (B, H and the {nq} q blocks of "
                                 f"{block_size[0]} in Q_LEN {seq_lengths[0]}), got {counts.shape}")
            if indices.shape[:3] != shape or indices.shape[3] > nkv:
                raise ValueError(f"{indices_name} must have shape {shape + ('width',)} with width <= {nkv} "
                                 f"({nkv} kv blocks of {block_size[1]} in KV_LEN {seq_lengths[1]}), "
                                 f"got {indices.shape}")
            members.append(_membership(counts_name, counts, indices_name, indices, nkv))
        partial, full = members
        if (partial & full).any():
            raise ValueError("kv_indices and full_kv_indices must not both list a block")
        return cls._from_states(_states(partial, full), seq_lengths, block_size, mask_mod)

    # -- views --------------------------------------------------------------------------------------------------

    @property
    def block_grid(self) -> tuple[int, int]:
        """(nq, nkv): how many q blocks and kv blocks cover the sequences (the last ones ragged)."""
        (q_len, kv_len), (bq, bkv) = self.seq_lengths, self.block_size
        return _ceil_div(q_len, bq), _ceil_div(kv_len, bkv)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN), B and H 1 where broadcast."""
        batch, heads = np.shape(self.kv_num_blocks)[:2]
        return (int(batch), int(heads)) + self.seq_lengths

    def to_dense(self) -> np.ndarray:
        """The (B, H, nq, nkv) int8 block states: EMPTY (0), PARTIAL (1) or FULL (2)."""
        nkv = self.block_grid[1]
        lists = [np.asarray(getattr(self, name)) for name in _ARRAY_FIELDS[:4]]
        partial = _membership("kv_num_blocks", lists[0], "kv_indices", lists[1], nkv)
        full = _membership("full_kv_num_blocks", lists[2], "full_kv_indices", lists[3], nkv)
        return _states(partial, full)

    def sparsity(self) -> float:
        """The percentage of blocks, over every (b, h), that are empty (never read)."""
        return float(100.0 * np.mean(self.to_dense() == EMPTY))

    def tile_lists(self, q_tile: int, kv_tile: int, heads_per_kv_list: int = 1) -> TileLists:
        """What a kernel with ``q_tile x kv_tile`` tiles visits, derived from the mask's blocks.

        ``heads_per_kv_list`` g > 1 (GQA's backward, whose blocks loop over a kv head's g query heads): the ``q`` lists
        are per group of g consecutive heads (H / g of them; unchanged where H is 1), visiting a tile some head of the
        group visits, full where full for all.

        A kernel tile overlapping (within the sequence bounds) only empty mask blocks is skipped; one overlapping
        only full blocks is full; any other is partial (read, mask_mod applied). This is conservative: a tile that
        covers part of a partial block is partial even if that part happens to be all visible or all hidden.
        Tiles may be smaller or larger than the blocks and need not align with them.
        """
        q_tile, kv_tile = _positive_int("q_tile", q_tile), _positive_int("kv_tile", kv_tile)
        states = self.to_dense()
        (q_len, kv_len), (bq, bkv) = self.seq_lengths, self.block_size
        rows, cols = _overlapped_blocks(q_len, q_tile, bq), _overlapped_blocks(kv_len, kv_tile, bkv)
        touched = (rows[1] - rows[0])[:, None] * (cols[1] - cols[0])[None, :]
        visit = _rectangle_sums(states != EMPTY, rows, cols) > 0
        full = _rectangle_sums(states == FULL, rows, cols) == touched
        group = _positive_int("heads_per_kv_list", heads_per_kv_list)
        batch, heads = visit.shape[:2]
        q_visit, q_full = visit, full
        if group > 1 and heads > 1:
            if heads % group:
                raise ValueError(f"heads_per_kv_list {group} does not divide the mask's {heads} heads")
            q_visit = visit.reshape(batch, heads // group, group, *visit.shape[2:]).any(axis=2)
            q_full = full.reshape(batch, heads // group, group, *full.shape[2:]).all(axis=2)
        return TileLists((q_tile, kv_tile), kv=_visits(visit, full),
                         q=_visits(q_visit.swapaxes(-1, -2), q_full.swapaxes(-1, -2)))

    def __repr__(self) -> str:
        head = (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"mask_mod={None if self.mask_mod is None else _mod_name(self.mask_mod)}")
        try:
            states = self.to_dense()
        except Exception:  # tracers, or placeholders a pytree utility put in the leaves: no picture to draw
            return head + ")"
        lines = [f"{head}, sparsity={self.sparsity():.2f}%,",
                 f"  blocks of b=0, h=0 (rows: q blocks, columns: kv blocks; "
                 f"'{_PICTURE_CHARS[FULL]}' full, '{_PICTURE_CHARS[PARTIAL]}' partial, "
                 f"'{_PICTURE_CHARS[EMPTY]}' empty):"]
        nq, nkv = states.shape[2:]
        for row in states[0, 0, :_PICTURE_ROWS, :_PICTURE_COLUMNS]:
            more = f" ... ({nkv - _PICTURE_COLUMNS} more)" if nkv > _PICTURE_COLUMNS else ""
            lines.append("  " + "".join(_PICTURE_CHARS[int(s)] for s in row) + more)
        if nq > _PICTURE_ROWS:
            lines.append(f"  ... ({nq - _PICTURE_ROWS} more rows)")
        return "\n".join(lines) + "\n)"


# ---------------------------------------------------------------------------------------------------------------
# JAX


if jax is not None:
    def _flatten_with_keys(mask: BlockMask):
        leaves = [(jax.tree_util.GetAttrKey(name), getattr(mask, name)) for name in _ARRAY_FIELDS]
        return leaves, (mask.seq_lengths, mask.block_size, mask.mask_mod)

    def _unflatten(static: tuple, leaves) -> BlockMask:
        # No validation: JAX rebuilds masks with tracers, batched values or placeholders as leaves.
        mask = object.__new__(BlockMask)
        for name, value in zip(("seq_lengths", "block_size", "mask_mod"), static):
            object.__setattr__(mask, name, value)
        for name, leaf in zip(_ARRAY_FIELDS, leaves):
            object.__setattr__(mask, name, leaf)
        return mask

    jax.tree_util.register_pytree_with_keys(BlockMask, _flatten_with_keys, _unflatten)


def _check_mask_mod(mask_mod: Any) -> None:
    """Checks that mask_mod takes (b, h, q_idx, kv_idx) and returns one bool (TypeError naming it if not)."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    name = _mod_name(mask_mod)
    try:
        inspect.signature(mask_mod).bind(0, 0, 0, 0)
    except TypeError:
        raise TypeError(f"mask_mod {name} must take 4 arguments (b, h, q_idx, kv_idx), its signature is "
                        f"{inspect.signature(mask_mod)}") from None
    except ValueError:
        pass  # no signature to read (some builtins): the trace below still catches a wrong arity
    scalar = jax.ShapeDtypeStruct((), np.int32)
    try:
        out = jax.eval_shape(mask_mod, scalar, scalar, scalar, scalar)
    except jax.errors.JAXTypeError as error:
        raise TypeError(f"mask_mod {name} must be traceable by JAX: Python operators and jax.numpy on its int32 "
                        f"scalar arguments, no Python `if` on them, captured arrays as jax arrays ({error})") from error
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and out.dtype == np.bool_):
        raise TypeError(f"mask_mod {name} must return a bool scalar, got {out}")


def _on_the_host():
    """A context running JAX on the CPU where JAX has a CPU backend (JAX_PLATFORMS may leave it out)."""
    try:
        return jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:
        return contextlib.nullcontext()


def _q_blocks_per_chunk(batch: int, heads: int, seq_lengths: tuple[int, int], block_size: tuple[int, int]) -> int:
    """How many q blocks create_block_mask evaluates at once: as many as _MAX_SCORES_PER_CHUNK values allow (each
    block row is batch x heads x q x the keys rounded up to whole kv blocks), at least one, at most all."""
    (q_len, kv_len), (bq, bkv) = seq_lengths, block_size
    scores_per_block_row = batch * heads * bq * _ceil_div(kv_len, bkv) * bkv
    return max(1, min(_ceil_div(q_len, bq), _MAX_SCORES_PER_CHUNK // scores_per_block_row))


def _evaluate_block_states(mask_mod: Callable, batch: int, heads: int, seq_lengths: tuple[int, int],
                           block_size: tuple[int, int]) -> np.ndarray:
    """The (batch, heads, nq, nkv) block states of mask_mod, evaluated a chunk of whole q blocks at a time."""
    jnp = jax.numpy
    (q_len, kv_len), (bq, bkv) = seq_lengths, block_size
    nq, nkv = _ceil_div(q_len, bq), _ceil_div(kv_len, bkv)
    blocks_per_chunk = _q_blocks_per_chunk(batch, heads, seq_lengths, block_size)
    rows_per_chunk = blocks_per_chunk * bq
    # mask_mod sees scalars: vmap it over kv_idx, q_idx, h and b (innermost first).
    visible_of = mask_mod
    for axis in (3, 2, 1, 0):
        visible_of = jax.vmap(visible_of, in_axes=tuple(0 if a == axis else None for a in range(4)))
    grid = (batch, heads, blocks_per_chunk, bq, nkv, bkv)

    # Rows and keys past Q_LEN / KV_LEN repeat the last ones, which lie in the same (last) block: every block's
    # "some pair visible" and "every pair visible" are those of its in-bounds pairs. Rows of whole blocks past
    # the end (the last chunk's padding) are dropped below.
    kv_idx = np.minimum(np.arange(nkv * bkv, dtype=np.int32), kv_len - 1)

    @jax.jit
    def chunk_states(first_row):
        q_idx = jnp.minimum(first_row + jnp.arange(rows_per_chunk, dtype=jnp.int32), q_len - 1)
        visible = visible_of(jnp.arange(batch, dtype=jnp.int32), jnp.arange(heads, dtype=jnp.int32), q_idx, kv_idx)
        visible = jnp.broadcast_to(visible, (batch, heads, rows_per_chunk, nkv * bkv)).reshape(grid)
        some, every = visible.any(axis=(3, 5)), visible.all(axis=(3, 5))
        return jnp.where(every, FULL, jnp.where(some, PARTIAL, EMPTY)).astype(jnp.int8)

    # ensure_compile_time_eval: a mask_mod over concrete arrays evaluates eagerly even inside a jit trace (the JAX
    # APIs build a block mask for their call while tracing it)
    with _on_the_host(), jax.ensure_compile_time_eval():
        chunks = [np.asarray(chunk_states(np.int32(first))) for first in range(0, nq * bq, rows_per_chunk)]
    return np.concatenate(chunks, axis=2)[:, :, :nq]


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, *,
                      block_size: int | tuple[int, int] = 128) -> BlockMask:
    """The BlockMask of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over ``(B, H, Q_LEN, KV_LEN)``.

    ``B`` or ``H`` None: the mask is the same for every batch entry or head, evaluated with b = 0 or h = 0 and
    kept once (broadcast). ``block_size``: an int (square blocks) or a (q, kv) pair.

    mask_mod runs on the host with JAX on the CPU, vmapped over its four arguments and jitted, a chunk of whole
    q blocks at a time: a chunk holds at most about 2**24 mask values (at least one block row, B x H x q x
    KV_LEN), so memory stays bounded for long sequences instead of growing as Q_LEN x KV_LEN. It must be
    traceable by JAX (operators and jax.numpy, no Python ``if`` on its arguments; arrays it indexes captured as
    jax arrays) and return one bool, else TypeError naming it.
    """
    if jax is None:
        raise ImportError("create_block_mask evaluates mask_mod with JAX: install jax (pip install cuflash[jax])")
    batch = 1 if B is None else _positive_int("B", B)
    heads = 1 if H is None else _positive_int("H", H)
    seq_lengths = _positive_int("Q_LEN", Q_LEN), _positive_int("KV_LEN", KV_LEN)
    block_size = _positive_pair("block_size", block_size, scalar_means_both=True)
    _check_mask_mod(mask_mod)
    states = _evaluate_block_states(mask_mod, batch, heads, seq_lengths, block_size)
    return BlockMask._from_states(states, seq_lengths, block_size, mask_mod)
