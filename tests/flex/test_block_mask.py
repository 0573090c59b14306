"""Block masks (cuflash/flex/block_mask.py) against brute force.

* create_block_mask's block states and every list (partial and full, forward and transposed) equal a brute-force
  reading of the dense mask, for causal, document, prefix-LM, sliding-window and per-head masks, block sizes that
  do and do not divide the lengths, Q_LEN != KV_LEN, and B / H broadcast. Pairs past the lengths, in the last
  (ragged) blocks, count for nothing. Many small chunks give the same mask as one; a chunk's size is bounded.
* tile_lists equals a brute-force reading of the mask blocks each kernel tile overlaps, for tiles smaller, larger
  and misaligned with the blocks; it never skips a tile with a visible pair, never calls full a tile with a
  hidden one, and is exact when tiles are whole blocks.
* A document mask over 8 equal documents visits 1/8 of the blocks; sparsity and the repr's picture.
* BlockMask checks itself, from_kv_blocks derives the transposed lists, bad arguments raise errors naming them.
* A BlockMask is a JAX pytree: it goes through jax.jit and jax.vmap.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuflash.flex import BlockMask, create_block_mask
from cuflash.flex import block_mask as block_mask_module
from cuflash.flex.block_mask import EMPTY, FULL, PARTIAL, UNUSED_SLOT

# Each mask: (B, H, mask_mod maker). A maker takes an array module (np or jnp) and the lengths and returns the
# mask_mod; with np, the mod runs on broadcast index grids to give the dense reference, independently of
# create_block_mask's vmapped, chunked evaluation.


def causal(xp, q_len, kv_len):
    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return causal_mod


def documents(xp, q_len, kv_len):
    # Documents of random lengths, different per batch entry; queries and keys split into the same number of them.
    rng = np.random.default_rng(q_len * 1000 + kv_len)
    def ids(length):
        cuts = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
        return np.searchsorted(cuts, np.arange(length), side="right")
    q_doc = xp.asarray(np.stack([ids(q_len) for _ in range(2)]))
    kv_doc = xp.asarray(np.stack([ids(kv_len) for _ in range(2)]))
    def same_document(b, h, q_idx, kv_idx):
        return q_doc[b, q_idx] == kv_doc[b, kv_idx]
    return same_document


def prefix_lm(xp, q_len, kv_len):
    prefix = xp.asarray(np.array([kv_len // 3, 5], dtype=np.int32))  # per batch entry
    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
    return prefix_lm_mod


def sliding_window(xp, q_len, kv_len):
    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)
    return sliding_window_mod


def per_head_window(xp, q_len, kv_len):
    window = xp.asarray(np.array([1, 50, 1000], dtype=np.int32))  # one window per query head
    def per_head_window_mod(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < window[h]
    return per_head_window_mod


MASKS = {"causal": (None, None, causal), "documents": (2, None, documents), "prefix_lm": (2, None, prefix_lm),
         "sliding_window": (None, None, sliding_window), "per_head_window": (None, 3, per_head_window)}
# (Q_LEN, KV_LEN, block_size): dividing, ragged, non-square, Q_LEN != KV_LEN both ways, one block, tiny blocks.
SHAPES = [(256, 256, 64), (300, 300, 64), (200, 333, (32, 48)), (333, 200, (48, 32)), (100, 90, 128), (67, 45, 8)]


def dense_mask(name, q_len, kv_len):
    """The (B, H, Q_LEN, KV_LEN) bool mask, the mod evaluated with NumPy on broadcast index grids."""
    batch, heads, maker = MASKS[name]
    batch, heads = batch or 1, heads or 1
    b, h, q, kv = np.ix_(np.arange(batch), np.arange(heads), np.arange(q_len), np.arange(kv_len))
    return np.broadcast_to(maker(np, q_len, kv_len)(b, h, q, kv), (batch, heads, q_len, kv_len))


def brute_block_states(dense, block_size):
    bq, bkv = block_size
    q_len, kv_len = dense.shape[2:]
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    states = np.zeros(dense.shape[:2] + (nq, nkv), dtype=int)
    for i in range(nq):
        for j in range(nkv):
            block = dense[:, :, i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv]  # slicing stops at the bounds
            states[:, :, i, j] = np.where(block.all(axis=(2, 3)), FULL,
                                          np.where(block.any(axis=(2, 3)), PARTIAL, EMPTY))
    return states


def brute_lists(member):
    """Counts and index lists, row by row: the members in increasing order, then UNUSED_SLOT."""
    counts = np.zeros(member.shape[:-1], dtype=int)
    indices = np.full(member.shape, UNUSED_SLOT, dtype=int)
    for row in np.ndindex(member.shape[:-1]):
        listed = np.flatnonzero(member[row])
        counts[row] = len(listed)
        indices[row][:len(listed)] = listed
    return counts, indices


def block_size_pair(block_size):
    return (block_size, block_size) if isinstance(block_size, int) else block_size


_created = {}


def created(name, q_len, kv_len, block_size):
    """create_block_mask of a MASKS entry (cached: several tests read the same masks)."""
    key = (name, q_len, kv_len, block_size)
    if key not in _created:
        batch, heads, maker = MASKS[name]
        _created[key] = create_block_mask(maker(jnp, q_len, kv_len), batch, heads, q_len, kv_len,
                                          block_size=block_size)
    return _created[key]


def assert_lists_match_states(mask, states):
    for prefix, state in (("", PARTIAL), ("full_", FULL)):
        for side, member in (("kv", states == state), ("q", (states == state).swapaxes(-1, -2))):
            counts, indices = brute_lists(member)
            np.testing.assert_array_equal(getattr(mask, f"{prefix}{side}_num_blocks"), counts,
                                          err_msg=f"{prefix}{side}_num_blocks")
            np.testing.assert_array_equal(getattr(mask, f"{prefix}{side}_indices"), indices,
                                          err_msg=f"{prefix}{side}_indices")


@pytest.mark.parametrize("q_len,kv_len,block_size", SHAPES)
@pytest.mark.parametrize("name", MASKS)
def test_block_lists_match_the_dense_mask(name, q_len, kv_len, block_size):
    mask = created(name, q_len, kv_len, block_size)
    batch, heads, _ = MASKS[name]
    assert mask.shape == (batch or 1, heads or 1, q_len, kv_len)
    assert mask.block_size == block_size_pair(block_size)
    states = brute_block_states(dense_mask(name, q_len, kv_len), mask.block_size)
    np.testing.assert_array_equal(mask.to_dense(), states)
    assert_lists_match_states(mask, states)
    for name_ in block_mask_module._ARRAY_FIELDS:
        array = getattr(mask, name_)
        assert array.dtype == np.int32 and not array.flags.writeable


def test_the_grid_meets_every_block_state_and_per_batch_and_per_head_differences():
    # The grid above would pass vacuously if its masks had no partial or full blocks, or B / H never mattered.
    seen = set()
    for name in MASKS:
        for q_len, kv_len, block_size in SHAPES:
            seen |= set(np.unique(created(name, q_len, kv_len, block_size).to_dense()).tolist())
    assert seen == {EMPTY, PARTIAL, FULL}
    documents_ = created("documents", 300, 300, 64).to_dense()
    assert not np.array_equal(documents_[0], documents_[1])
    heads = created("per_head_window", 300, 300, 64).to_dense()
    assert len({heads[0, h].tobytes() for h in range(3)}) == 3


@pytest.mark.parametrize("q_len,kv_len,block_size", [(100, 90, 64), (67, 45, (8, 16)), (333, 200, (48, 32))])
def test_ragged_blocks_count_only_pairs_within_the_lengths(q_len, kv_len, block_size):
    # A mod that hides exactly the pairs past the lengths: every block full, not partial. Its negation: every
    # block empty.
    def inside(b, h, q_idx, kv_idx):
        return (q_idx < q_len) & (kv_idx < kv_len)

    def outside(b, h, q_idx, kv_idx):
        return (q_idx >= q_len) | (kv_idx >= kv_len)

    assert (create_block_mask(inside, None, None, q_len, kv_len, block_size=block_size).to_dense() == FULL).all()
    empty = create_block_mask(outside, None, None, q_len, kv_len, block_size=block_size)
    assert (empty.to_dense() == EMPTY).all() and empty.sparsity() == 100.0


@pytest.mark.parametrize("scores_per_chunk", [1, 3 * 48 * 200])
def test_chunked_evaluation_gives_the_same_mask(monkeypatch, scores_per_chunk):
    # 1: one q block per chunk; 3 blocks of 48 rows (x 200 keys) per chunk: 7 blocks in 3 chunks, the last padded.
    whole = created("documents", 333, 200, (48, 32))
    monkeypatch.setattr(block_mask_module, "_MAX_SCORES_PER_CHUNK", scores_per_chunk * 2)  # B = 2
    batch, heads, maker = MASKS["documents"]
    chunked = create_block_mask(maker(jnp, 333, 200), batch, heads, 333, 200, block_size=(48, 32))
    np.testing.assert_array_equal(chunked.to_dense(), whole.to_dense())


@pytest.mark.parametrize("batch,heads,q_len,kv_len,block_size,blocks", [
    (1, 1, 4096, 4096, 128, 32),                 # 32 x 128 x 4096 = 2**24: the whole mask at once
    (1, 1, 131072, 131072, 128, 1),              # 128 x 131072 = 2**24 per block row: one at a time
    (8, 32, 131072, 131072, 128, 1),             # a block row alone is over the budget: still one, not zero
    (2, 4, 1 << 20, 1000, (64, 256), 32),        # 8 x 64 x 1024 (keys in whole kv blocks) = 2**19 per block row
])
def test_a_chunk_holds_a_bounded_number_of_mask_values(batch, heads, q_len, kv_len, block_size, blocks):
    # Memory per chunk is O(block rows x KV_LEN), not O(Q_LEN x KV_LEN).
    blocks_per_chunk = block_mask_module._q_blocks_per_chunk(batch, heads, (q_len, kv_len), block_size_pair(block_size))
    assert blocks_per_chunk == blocks


# -- kernel tiles -------------------------------------------------------------------------------------------------


def brute_tile_states(states, seq_lengths, block_size, tile):
    """Per kernel tile, the state of the mask blocks its in-bounds rows and keys fall in, row by row."""
    (q_len, kv_len), (bq, bkv), (tq, tkv) = seq_lengths, block_size, tile
    nqt, nkvt = -(-q_len // tq), -(-kv_len // tkv)
    out = np.zeros(states.shape[:2] + (nqt, nkvt), dtype=int)
    for i in range(nqt):
        q_blocks = sorted({row // bq for row in range(i * tq, min((i + 1) * tq, q_len))})
        for j in range(nkvt):
            kv_blocks = sorted({key // bkv for key in range(j * tkv, min((j + 1) * tkv, kv_len))})
            touched = states[:, :, q_blocks][:, :, :, kv_blocks]
            out[:, :, i, j] = np.where((touched == FULL).all(axis=(2, 3)), FULL,
                                       np.where((touched != EMPTY).any(axis=(2, 3)), PARTIAL, EMPTY))
    return out


def tile_states_of(visits, columns):
    """The (B, H, rows, columns) tile states a TileVisits lists."""
    states = np.zeros(visits.counts.shape + (columns,), dtype=int)
    for row in np.ndindex(visits.counts.shape):
        count = visits.counts[row]
        listed, full = visits.indices[row][:count], visits.full[row][:count]
        assert list(listed) == sorted(set(listed)), "visited tiles must be listed once each, in increasing order"
        assert (visits.indices[row][count:] == UNUSED_SLOT).all() and not visits.full[row][count:].any()
        states[row][listed] = np.where(full, FULL, PARTIAL)
    return states


# Mask blocks of 32 x 48 rows x keys; tiles smaller, larger, misaligned (straddling block edges), and mixed.
TILES = [(16, 16), (64, 96), (128, 192), (48, 40), (80, 100), (32, 48), (16, 200), (333, 7)]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("name", ["causal", "documents", "per_head_window"])
def test_tile_lists_match_the_blocks_each_tile_overlaps(name, tile):
    mask = created(name, 200, 333, (32, 48))
    lists = mask.tile_lists(*tile)
    assert lists.tile_size == tile
    expected = brute_tile_states(mask.to_dense(), mask.seq_lengths, mask.block_size, tile)
    nqt, nkvt = expected.shape[2:]
    np.testing.assert_array_equal(tile_states_of(lists.kv, nkvt), expected)
    np.testing.assert_array_equal(tile_states_of(lists.q, nqt), expected.swapaxes(-1, -2))
    # Conservative against the pairs themselves: no visible pair skipped, no hidden pair in a full tile.
    exact = brute_block_states(dense_mask(name, 200, 333), tile)  # each tile's own pairs, as if it were a block
    assert not ((exact != EMPTY) & (expected == EMPTY)).any()
    assert not ((exact != FULL) & (expected == FULL)).any()
    if tile[0] % 32 == 0 and tile[1] % 48 == 0:  # whole blocks: nothing to be conservative about
        np.testing.assert_array_equal(expected, exact)


def test_tile_lists_check_their_arguments():
    mask = created("causal", 256, 256, 64)
    with pytest.raises(ValueError, match="q_tile"):
        mask.tile_lists(0, 64)
    with pytest.raises(TypeError, match="kv_tile"):
        mask.tile_lists(64, 64.0)


# -- document masks, sparsity, repr -------------------------------------------------------------------------------


def eight_documents(length):
    doc = jnp.asarray(np.arange(length) * 8 // length)  # 8 equal documents (up to one row)
    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return same_document


@pytest.mark.parametrize("length,block_size,visited", [(1024, 128, 1 / 8), (1024, 64, 1 / 8), (2048, (128, 64), 1 / 8),
                                                        (1000, 128, 22 / 64)])
def test_a_document_mask_over_8_documents_visits_an_eighth_of_the_blocks(length, block_size, visited):
    mask = create_block_mask(eight_documents(length), None, None, length, length, block_size=block_size)
    states = mask.to_dense()
    assert np.mean(states != EMPTY) == pytest.approx(visited)
    assert mask.sparsity() == pytest.approx(100 * (1 - visited))
    # Every visited block of an aligned document mask is full: no mask to apply anywhere.
    if length % (8 * max(block_size_pair(block_size))) == 0:
        assert (states[states != EMPTY] == FULL).all()
        # Kernel tiles of 64 x 128 read an eighth of K / V too.
        lists = mask.tile_lists(64, 128)
        assert lists.kv.counts.sum() == pytest.approx(lists.kv.counts.size * lists.kv.indices.shape[-1] / 8)


def test_repr_shows_shape_block_sizes_sparsity_and_the_blocks():
    mask = create_block_mask(causal(jnp, 0, 0), None, None, 256, 200, block_size=64)
    text = repr(mask)
    assert "shape=(1, 1, 256, 200)" in text and "block_size=(64, 64)" in text and "causal_mod" in text
    assert f"sparsity={mask.sparsity():.2f}%" in text and mask.sparsity() == pytest.approx(100 * 6 / 16)
    assert text.splitlines()[2:6] == ["  +...", "  #+..", "  ##+.", "  ###+"]
    big = repr(create_block_mask(causal(jnp, 0, 0), None, None, 4096, 8192, block_size=(64, 32)))
    lines = big.splitlines()
    assert len(lines) == 2 + 32 + 2  # the header, 32 of 64 rows, a "more rows" line, ")"
    assert lines[2] == "  ++" + "." * 62 + " ... (192 more)" and lines[-2] == "  ... (32 more rows)"


# -- checks -------------------------------------------------------------------------------------------------------


def returns_int(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def returns_vector(b, h, q_idx, kv_idx):
    return jnp.stack([q_idx >= kv_idx, q_idx <= kv_idx])


def branches_in_python(b, h, q_idx, kv_idx):
    return True if q_idx >= kv_idx else False


DOCUMENT_IDS = np.arange(64) // 8


def indexes_numpy(b, h, q_idx, kv_idx):
    return DOCUMENT_IDS[q_idx] == DOCUMENT_IDS[kv_idx]  # a NumPy array cannot take a traced index: jnp.asarray it


def three_arguments(b, q_idx, kv_idx):
    return q_idx >= kv_idx


CAUSAL = causal(jnp, 0, 0)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((CAUSAL, None, None, 64, 64), {"block_size": 0}, ValueError, r"block_size\[0\] must be > 0"),
    ((CAUSAL, None, None, 64, 64), {"block_size": (64, -8)}, ValueError, r"block_size\[1\] must be > 0"),
    ((CAUSAL, None, None, 64, 64), {"block_size": (64,)}, TypeError, "block_size must be an int or a"),
    ((CAUSAL, None, None, 64, 64), {"block_size": 1.5}, TypeError, "block_size must be an int or a"),
    ((CAUSAL, None, None, 64, 64), {"block_size": (True, 64)}, TypeError, r"block_size\[0\] must be an int"),
    ((CAUSAL, None, None, 0, 64), {}, ValueError, "Q_LEN must be > 0"),
    ((CAUSAL, None, None, 64, -1), {}, ValueError, "KV_LEN must be > 0"),
    ((CAUSAL, None, None, "64", 64), {}, TypeError, "Q_LEN must be an int"),
    ((CAUSAL, 0, None, 64, 64), {}, ValueError, "B must be > 0"),
    ((CAUSAL, None, 2.0, 64, 64), {}, TypeError, "H must be an int"),
    ((returns_int, None, None, 64, 64), {}, TypeError, "mask_mod returns_int must return a bool scalar"),
    ((returns_vector, None, None, 64, 64), {}, TypeError, "mask_mod returns_vector must return a bool scalar"),
    ((three_arguments, None, None, 64, 64), {}, TypeError, r"mask_mod three_arguments must take 4 arguments"),
    ((branches_in_python, None, None, 64, 64), {}, TypeError, "mask_mod branches_in_python must be traceable"),
    ((indexes_numpy, None, None, 64, 64), {}, TypeError, "mask_mod indexes_numpy must be traceable .* jax arrays"),
    (("causal", None, None, 64, 64), {}, TypeError, "mask_mod must be callable"),
])
def test_create_block_mask_rejects_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        create_block_mask(*args, **kwargs)


def fields(mask):
    return {f.name: getattr(mask, f.name) for f in dataclasses.fields(mask)}


def with_element(array, index, value):
    array = np.array(array)
    array[index] = value
    return array


# A causal mask over 256 x 200 in 64 x 64 blocks: block row i lists kv block i as partial, the ones left of it full.
BROKEN = [
    ({"kv_num_blocks": lambda a: with_element(a, (0, 0, 0), 2),  # row 0 lists 1, then 0
      "kv_indices": lambda a: with_element(a, (0, 0, 0, slice(0, 2)), [1, 0])}, ValueError, "increasing order"),
    ({"kv_indices": lambda a: with_element(a, (0, 0, 0, 3), 1)}, ValueError, "0 past kv_num_blocks"),
    ({"kv_num_blocks": lambda a: with_element(a, (0, 0, 0), 5)}, ValueError, r"kv_num_blocks must lie in \[0, 4\]"),
    ({"kv_indices": lambda a: with_element(a, (0, 0, 1, 0), 4)}, ValueError, r"must list blocks in \[0, 4\)"),
    ({"full_kv_indices": lambda a: with_element(a, (0, 0, 1, 0), 1)}, ValueError, "must not both list"),
    ({"q_indices": lambda a: with_element(a, (0, 0, 0, 0), 1)}, ValueError,
     "q_indices must be the transpose of BlockMask.kv_indices"),
    ({"kv_num_blocks": lambda a: a[:, :, :3]}, ValueError, r"kv_num_blocks must have shape \(1, 1, 4\)"),
    ({"kv_indices": lambda a: a.astype(np.float32)}, TypeError, "kv_indices must hold integers"),
    ({"q_num_blocks": lambda a: a[0]}, ValueError, "q_num_blocks must have 3 dimensions"),
    ({"block_size": lambda a: (64, 0)}, ValueError, r"block_size\[1\] must be > 0"),
    ({"seq_lengths": lambda a: (256, 199)}, ValueError, "seq_lengths"),  # 4 kv blocks, still: the lists disagree
    ({"mask_mod": lambda a: "causal"}, TypeError, "mask_mod must be callable or None"),
]


@pytest.mark.parametrize("change,error,match", BROKEN)
def test_block_mask_checks_itself(change, error, match):
    good = fields(create_block_mask(CAUSAL, None, None, 256, 200, block_size=64))
    BlockMask(**good)  # the unchanged fields pass
    if match == "seq_lengths":  # same grid, so it still passes: the check is on the grid, not the lengths
        BlockMask(**{**good, "seq_lengths": (256, 199)})
        good["seq_lengths"] = (256, 129)  # 3 kv blocks: every kv-shaped array is wrong
        with pytest.raises(ValueError, match=r"kv_indices must have shape \(1, 1, 4, 3\)"):
            BlockMask(**good)
        return
    changed = {name: transform(good[name]) for name, transform in change.items()}
    with pytest.raises(error, match=match):
        BlockMask(**{**good, **changed})


def test_block_mask_is_frozen_and_owns_its_arrays():
    made = create_block_mask(CAUSAL, None, None, 256, 200, block_size=64)
    counts = np.array(made.kv_num_blocks)
    mask = BlockMask(**{**fields(made), "kv_num_blocks": counts})
    counts[...] = 0  # the caller's array, changed afterwards, is not the mask's
    assert mask.kv_num_blocks.sum() == made.kv_num_blocks.sum() > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        mask.block_size = (32, 32)
    with pytest.raises(ValueError):
        mask.kv_indices[0, 0, 0, 0] = 3


@pytest.mark.parametrize("name", MASKS)
def test_from_kv_blocks_derives_the_transposed_lists(name):
    made = created(name, 333, 200, (48, 32))
    again = BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                     made.full_kv_indices, seq_lengths=(333, 200), block_size=(48, 32))
    for field in block_mask_module._ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(again, field), getattr(made, field), err_msg=field)
    # Any order and a narrower index array (as wide as the longest list) are accepted.
    rng = np.random.default_rng(0)
    width = int(made.kv_num_blocks.max())
    shuffled = np.array(made.kv_indices[..., :width])
    for row in np.ndindex(shuffled.shape[:-1]):
        shuffled[row][:made.kv_num_blocks[row]] = rng.permutation(shuffled[row][:made.kv_num_blocks[row]])
    again = BlockMask.from_kv_blocks(made.kv_num_blocks, shuffled, made.full_kv_num_blocks, made.full_kv_indices,
                                     seq_lengths=(333, 200), block_size=(48, 32))
    np.testing.assert_array_equal(again.to_dense(), made.to_dense())


def test_from_kv_blocks_without_full_blocks_and_its_checks():
    counts, indices = np.array([[[2, 1]]]), np.array([[[[3, 0, 9], [1, 7, 7]]]])  # past the counts: ignored
    mask = BlockMask.from_kv_blocks(counts, indices, seq_lengths=(100, 250), block_size=(64, 50), mask_mod=CAUSAL)
    assert mask.to_dense().tolist() == [[[[1, 0, 0, 1, 0], [0, 1, 0, 0, 0]]]]
    assert mask.q_num_blocks.tolist() == [[[1, 1, 0, 1, 0]]] and mask.mask_mod is CAUSAL
    assert mask.q_indices[0, 0].tolist() == [[0, 0], [1, 0], [0, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="both be given or both be None"):
        BlockMask.from_kv_blocks(counts, indices, counts, seq_lengths=(100, 250), block_size=(64, 50))
    with pytest.raises(ValueError, match="lists a block twice"):
        BlockMask.from_kv_blocks(counts, np.array([[[[3, 3], [1, 0]]]]), seq_lengths=(100, 250), block_size=(64, 50))
    with pytest.raises(ValueError, match=r"kv_indices must have shape \(1, 1, 2, 'width'\) with width <= 5"):
        BlockMask.from_kv_blocks(counts, np.zeros((1, 1, 2, 6), int), seq_lengths=(100, 250), block_size=(64, 50))
    with pytest.raises(ValueError, match=r"kv_num_blocks must have shape \(1, 1, 3\)"):
        BlockMask.from_kv_blocks(counts, indices, seq_lengths=(129, 250), block_size=(64, 50))
    with pytest.raises(ValueError, match=r"full_kv_num_blocks must have shape \(1, 1, 2\)"):
        BlockMask.from_kv_blocks(counts, indices, np.zeros((2, 1, 2), int), np.zeros((2, 1, 2, 1), int),
                                 seq_lengths=(100, 250), block_size=(64, 50))
    with pytest.raises(ValueError, match="must not both list"):
        BlockMask.from_kv_blocks(counts, indices, np.array([[[1, 0]]]), np.array([[[[0], [0]]]]),
                                 seq_lengths=(100, 250), block_size=(64, 50))
    with pytest.raises(TypeError, match="seq_lengths must be a"):
        BlockMask.from_kv_blocks(counts, indices, seq_lengths=100)


# -- JAX ----------------------------------------------------------------------------------------------------------


def test_a_block_mask_is_a_pytree_through_jit_and_vmap():
    mask = created("documents", 300, 300, 64)
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    assert len(leaves) == 8 and all(isinstance(leaf, np.ndarray) for leaf in leaves)
    other_mod = create_block_mask(CAUSAL, 2, None, 300, 300, block_size=64)
    assert jax.tree_util.tree_structure(other_mod) != treedef  # mask_mod, lengths and block sizes are static

    @jax.jit
    def visited_blocks(m):
        assert m.block_size == (64, 64) and m.mask_mod is mask.mask_mod  # static, as Python values
        return m.kv_num_blocks.sum() + m.full_kv_num_blocks.sum(), m

    total, through = visited_blocks(mask)
    assert int(total) == int(np.sum(mask.to_dense() != EMPTY))
    assert isinstance(through, BlockMask) and through.seq_lengths == (300, 300)
    np.testing.assert_array_equal(through.to_dense(), mask.to_dense())  # host methods read jax arrays too
    assert "sparsity=" in repr(through)

    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), mask)
    per_mask = jax.vmap(lambda m: m.q_num_blocks.sum() + m.full_q_num_blocks.sum())(stacked)
    assert per_mask.tolist() == [int(total)] * 2
