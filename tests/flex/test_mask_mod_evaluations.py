"""How often the kernels run a mask_mod under a block mask, counted on the simulator (issue 29 item 2).

With a block mask the kernels visit its listed tiles only, and run the mask_mod on partial tiles only: a full tile's
scores are all visible (FlexAttention's full blocks), so its hook skips the mask_mod (flex_hook.cuh's check_mask, one
block-uniform flag per visited tile, forward and backward). The count: a mask_mod that reads one int32 of
a side table per evaluation against one that reads nothing, over the same block mask. The simulator counts every
global load (LaunchRecord.global_bytes_read), so the difference is 4 bytes per evaluation, exactly: each score of a
partial tile within seqlen_q x seqlen_k, once per query head (the backward's lists are per kv head, visited by each of
its group's heads). Were full tiles to run the mask_mod, their scores would add to the count and the test fail.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash.flex import create_block_mask
from cuflash.flex._api import flex_problem
from cuflash.kernels import plans
from cuflash.kernels.families import fa2
from cuflash.testing import random_inputs


def _expected_evaluations(block_mask, problem, backward: bool) -> tuple[int, int, int]:
    """(mask_mod evaluations, partial tile visits, full tile visits) the main kernel makes for the block mask, from
    the tile lists it is given (the call's own rule, BlockMask.tile_lists at the kernel's tiles)."""
    target = sim.current_target()
    module = plans.variant_for("fa2", problem, target, "backward" if backward else "forward").module
    traits = (module.backward_traits if backward else module.forward_traits)(fa2.tile_head_dim(problem), target)
    lists = block_mask.tile_lists(traits.block_m, traits.block_n, heads_per_kv_list=problem.group_size)
    visits = lists.q if backward else lists.kv
    counts, indices, full = (np.asarray(x) for x in (visits.counts, visits.indices, visits.full))
    row_tile, col_tile = (traits.block_n, traits.block_m) if backward else (traits.block_m, traits.block_n)
    row_len, col_len = ((problem.seqlen_k, problem.seqlen_q) if backward else (problem.seqlen_q, problem.seqlen_k))
    list_heads = problem.nheads_k if backward else problem.nheads
    heads_per_list = problem.group_size if backward else 1
    evaluations = partial_visits = full_visits = 0
    for b in range(problem.batch):
        for h in range(list_heads):
            lb = b if counts.shape[0] > 1 else 0
            lh = h if counts.shape[1] > 1 else 0
            for tile in range(counts.shape[2]):
                rows = min(row_tile, row_len - tile * row_tile)
                for i in range(counts[lb, lh, tile]):
                    other = indices[lb, lh, tile, i]
                    cols = min(col_tile, col_len - other * col_tile)
                    if full[lb, lh, tile, i]:
                        full_visits += 1
                    else:
                        partial_visits += 1
                        evaluations += heads_per_list * rows * cols
    return evaluations, partial_visits, full_visits


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_full_tiles_never_run_the_mask_mod(dtype):
    """Causal with holes in a band of keys (blocks of 32 over 150 x 170, GQA 2:1): the kernels' tiles are full
    (below the diagonal, outside the band), partial (the diagonal, the band, the sequence's ends) or skipped; the mask_mod reading a side
    table is evaluated exactly on the partial tiles' scores within the sequence, forward and backward, and both
    mask_mods give the results of the block mask's visibility."""
    batch, seqlen_q, seqlen_k, heads, heads_k, headdim = 1, 150, 170, 2, 1, 32
    q, k, v, dout = random_inputs((batch, seqlen_q, seqlen_k, heads, heads_k, headdim), dtype, seed=21)
    rows, cols = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    holes = (cols >= 96) & (cols < 120) & ((rows * 7 + cols * 3) % 5 == 0)
    allowed = (cols <= rows + 20) & ~holes
    table = jnp.asarray(allowed)

    def from_the_table(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    def causal_band(b, h, q_idx, kv_idx):  # reads nothing; the same on every full tile
        return kv_idx <= q_idx + 20

    block_mask = create_block_mask(from_the_table, None, None, seqlen_q, seqlen_k, block_size=32)
    problem = flex_problem(q, k, v)
    bytes_read, results = {}, {}
    for name, mask_mod in (("table", from_the_table), ("formula", causal_band)):
        with sim.record() as forward:
            out, lse = cuflash.flex_attention(q, k, v, block_mask=block_mask, mask_mod=mask_mod, return_lse=True)
        with sim.record() as backward:
            grads = cuflash.flex_attention_backward(dout, q, k, v, out, lse, block_mask=block_mask,
                                                    mask_mod=mask_mod)
        main = [r for r in backward.launches if "backward_kernel" in r.kernel]
        assert len(forward.launches) == 1 and len(main) == 1, [r.kernel for r in backward.launches]
        bytes_read[name] = (forward.launches[0].global_bytes_read, main[0].global_bytes_read)
        results[name] = (out, lse, *grads)

    for backward, direction in ((False, "forward"), (True, "backward")):
        evaluations, partial_visits, full_visits = _expected_evaluations(block_mask, problem, backward)
        # (The tensor-core backward's 128-wide tiles at these lengths are all partial: its count is all partial.)
        assert partial_visits > 0 and (full_visits > 0) == (direction == "forward" or dtype == "float32"), (
            direction, partial_visits, full_visits)
        counted = bytes_read["table"][backward] - bytes_read["formula"][backward]
        assert counted == 4 * evaluations, (direction, counted / 4, evaluations)

    # The formula differs from the table only on the band's holes, all in partial tiles: hidden there by the table.
    reference = cuflash.flex_attention(q, k, v, mask_mod=from_the_table)
    np.testing.assert_array_equal(results["table"][0], reference)
