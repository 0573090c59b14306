"""Warp shuffles and votes against the PTX ISA's shfl.sync / vote.sync definitions."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash.sim as sim
from simkit import run

MODES = {"idx": 0, "up": 1, "down": 2, "xor": 3}
WIDTHS = (1, 2, 4, 8, 16, 32)
MASKS = (0xFFFFFFFF, 0x0000FFFF, 0xF00F5A5A, 0x00000001)


def ptx_source_lane(mode: str, lane: int, b: int, width: int) -> int:
    """Source lane per the PTX ISA pseudo-code of shfl.sync, with CUDA's c operand.

    CUDA passes c = ((32 - width) << 8) | (0 for up, 0x1f otherwise); the PTX text
    then computes mask = c[12:8], maxLane/minLane, and j from b[4:0].
    """
    seg_mask = (32 - width) & 0x1F
    cval = 0 if mode == "up" else 0x1F
    bval = b & 0x1F
    max_lane = (lane & seg_mask) | (cval & ~seg_mask & 0x1F)
    min_lane = lane & seg_mask
    if mode == "up":
        j, valid = lane - bval, lane - bval >= max_lane
    elif mode == "down":
        j, valid = lane + bval, lane + bval <= max_lane
    elif mode == "xor":
        j, valid = lane ^ bval, (lane ^ bval) <= max_lane
    else:
        j = min_lane | (bval & ~seg_mask & 0x1F)
        valid = j <= max_lane
    return j if valid else lane


def guide_source_lane(mode: str, lane: int, b: int, width: int) -> int:
    """The CUDA programming guide's description (valid for 0 <= b < 32)."""
    seg = lane & ~(width - 1)
    if mode == "idx":
        return seg + b % width
    if mode == "up":
        return lane - b if lane - b >= seg else lane
    if mode == "down":
        return lane + b if lane + b < seg + width else lane
    return lane ^ b if (lane ^ b) < seg + width else lane


def test_guide_and_ptx_formulas_agree():
    for mode in MODES:
        for width in WIDTHS:
            for lane in range(32):
                for b in range(32):
                    assert ptx_source_lane(mode, lane, b, width) == guide_source_lane(mode, lane, b, width)


@pytest.mark.parametrize("dtype", ["int32", "float32"])
@pytest.mark.parametrize("mode", list(MODES))
def test_shuffle_matches_ptx(mode, dtype):
    rng = np.random.default_rng(MODES[mode])
    threads = 64  # two warps: lanes are per warp
    if dtype == "int32":
        values = rng.integers(-1000, 1000, threads).astype(np.int32)
        kernel = "shuffle_kernel<int>"
    else:
        values = rng.standard_normal(threads).astype(np.float32)
        kernel = "shuffle_kernel<float>"
    for width in WIDTHS:
        for mask in MASKS:
            # Operands vary per lane; include b >= 32 (only b[4:0] counts).
            b = rng.integers(0, 40, threads).astype(np.int32)
            out = np.full(threads, 12345, dtype=values.dtype)
            run(kernel, 1, threads, in0=values, in1=b, out0=out, mode=MODES[mode], width=width, mask=mask)
            expected = out.copy()
            for t in range(threads):
                lane, base = t % 32, t - t % 32
                if not mask >> lane & 1:
                    continue  # did not call: keeps the sentinel
                j = ptx_source_lane(mode, lane, int(b[t]), width)
                if mask >> j & 1:
                    expected[t] = values[base + j]
                else:
                    # Source lane outside the mask: undefined on a GPU, all-one bits here.
                    expected[t] = np.array(0xFFFFFFFF, np.uint32).view(values.dtype)
            assert out.view(np.uint32).tolist() == expected.view(np.uint32).tolist(), (mode, width, hex(mask))


def test_half_warp_groups_with_disjoint_masks():
    values = np.arange(64, dtype=np.int32) * 3 + 1
    out = np.zeros(64, np.int32)
    run("half_warp_groups_kernel", 1, 64, in0=values, out0=out)
    expected = values.reshape(4, 16).sum(axis=1).repeat(16)
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("mask", MASKS)
def test_votes(mask):
    rng = np.random.default_rng(mask & 0xFFFF)
    for trial in range(4):
        pred = (rng.random(64) < [0.0, 1.0, 0.5, 0.1][trial]).astype(np.int32)
        ballot = np.zeros(64, np.uint32)
        anyall = np.full(64, -1, np.int32)
        run("vote_kernel", 1, 64, in0=pred, out0=ballot, out1=anyall, mask=mask)
        for warp in range(2):
            members = [lane for lane in range(32) if mask >> lane & 1]
            bits = sum(1 << lane for lane in members if pred[warp * 32 + lane])
            full = sum(1 << lane for lane in members)
            for lane in members:
                t = warp * 32 + lane
                assert ballot[t] == bits
                assert anyall[t] == int(bits != 0) | (int(bits == full) << 1)


def test_width_must_be_power_of_two():
    values = np.zeros(32, np.int32)
    b = np.zeros(32, np.int32)
    out = np.zeros(32, np.int32)
    with pytest.raises(sim.KernelError, match="power of two"):
        run("shuffle_kernel<int>", 1, 32, in0=values, in1=b, out0=out, mode=0, width=12, mask=0xFFFFFFFF)


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("caller_not_in_mask_kernel", "lane 0 is not in mask 0xfffffffe"),
        ("mismatched_masks_kernel", "warp collective mismatch"),
        ("mismatched_sites_kernel", "warp collective mismatch"),
        ("named_lane_exited_kernel", r"lane 31 exited while lane\(s\) 0-30 wait"),
    ],
)
def test_collective_errors(name, pattern):
    out = np.zeros(64, np.float32)
    with pytest.raises(sim.KernelError, match=pattern) as info:
        run(name, 1, 64, out0=out)
    assert info.value.kernel == f"simtest::{name}"
    assert f"kernel simtest::{name}" in info.value.message
    assert "thread (" in info.value.message


def test_partial_last_warp_cannot_name_missing_lanes():
    # 48 threads: warp 1 has lanes 0-15 only; a full-mask shuffle names lanes that do not exist.
    values = np.zeros(48, np.int32)
    b = np.ones(48, np.int32)
    out = np.zeros(48, np.int32)
    with pytest.raises(sim.KernelError, match="exited or do not exist"):
        run("shuffle_kernel<int>", 1, 48, in0=values, in1=b, out0=out, mode=3, width=32, mask=0xFFFFFFFF)
    # The same with a mask of the existing lanes works.
    run("shuffle_kernel<int>", 1, 48, in0=values, in1=b, out0=out, mode=3, width=16, mask=0x0000FFFF)
