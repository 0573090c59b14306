"""The loop census (cuflash/kernels/loop_census.py): the walk on planted SASS listings whose counts are known,
then on the tensor-core kernels themselves."""

from __future__ import annotations

import datetime
import json

import pytest

from cuflash.kernels import loop_census as lc
from cuflash.kernels import nvrtc
from cuflash.kernels import targets
from cuflash.kernels.families import fa2_tc, fa3, fa3_backward


def listing(*lines: str) -> str:
    """A SASS listing as cuobjdump prints it, one instruction per 16 bytes from address 0."""
    return "\n".join(f"        /*{16 * n:04x}*/                   {text} ;" for n, text in enumerate(lines))


# A kernel whose main loop (0x30 .. 0x150) issues per iteration: 4 HMMA; a copy loop of 3 instructions with one
# LDGSTS, run twice (two copies); an optional block of 4 instructions (the "mask") that the plain path skips; a
# global write behind a test the plain path must pass; two exponentials. Plain path: head 3 (0x30..0x50)
# + copy loop 2 x 3 (0x60..0x80) + 2 (0x90, 0xa0: the test and the branch over the mask) + 2 MUFU (0xf0, 0x100)
# + 2 (0x110 test, 0x120 RED) + 3 (0x130..0x150: HMMA, HMMA, back branch) = 18 instructions, 4 HMMA.
PLANTED = listing(
    "S2R R0, SR_TID.X",                    # 0x00
    "IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28]",  # 0x10
    "MOV R2, RZ",                          # 0x20
    "HMMA.16816.F32 R4, R8, R12, R4",      # 0x30 loop head
    "HMMA.16816.F32 R4, R8, R14, R4",      # 0x40
    "IADD3 R3, RZ, 0x2, RZ",               # 0x50
    "LDGSTS.E.BYPASS.128 [R5], [R6.64]",   # 0x60 copy loop
    "IADD3 R3, R3, -0x1, RZ",              # 0x70
    "@P1 BRA 0x60",                        # 0x80 copy loop back edge
    "ISETP.NE.AND P2, PT, R7, RZ, PT",     # 0x90
    "@!P2 BRA 0xf0",                       # 0xa0 skip the mask
    "FSEL R20, R20, -INF , P3",            # 0xb0 mask
    "FSEL R21, R21, -INF , P3",            # 0xc0
    "FSEL R22, R22, -INF , P3",            # 0xd0
    "FSEL R23, R23, -INF , P3",            # 0xe0
    "MUFU.EX2 R20, R20",                   # 0xf0
    "MUFU.EX2 R21, R21",                   # 0x100
    "@P4 BRA 0x130",                       # 0x110 the plain path must not skip the write
    "RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R8.64], R9",  # 0x120
    "HMMA.16816.F32 R4, R16, R12, R4",     # 0x130
    "HMMA.16816.F32 R4, R16, R14, R4",     # 0x140
    "@P0 BRA 0x30",                        # 0x150 main loop back edge
    "EXIT",                                # 0x160
    "BRA 0x170",                           # 0x170
)
PLANTED_WORK = lc.IterationWork(hmma=4, ldgsts=2, exponentials=2, global_writes=1)


def test_planted_plain_path():
    (row,) = lc.census(PLANTED, PLANTED_WORK)
    assert row.path == "plain"
    assert row.instructions == 18
    assert row.hmma == 4 and row.classes["ldgsts"] == 2 and row.classes["memory"] == 1
    assert row.classes["fp32"] == 0  # the mask was skipped
    assert row.classes["mufu"] == 2 and row.exponentials == 2
    assert row.classes["branch"] == 2 * 1 + 3  # copy loop back edge twice (one taken, one not), 3 more
    assert row.instructions_per_hmma == 18 / 4
    assert row.loop_addresses == (0x30, 0x150)
    assert row.loop_static_instructions == 19
    assert sum(row.classes.values()) == row.instructions


def test_planted_marked_path_runs_its_source():
    # A path named by source it must run: marked at the mask's third FSEL, the walk takes the mask block (0xb0 ..
    # 0xe0, 4 FSEL, falling through to the exponentials) instead of the branch over it: 18 + 4 = 22 instructions
    # (the branch at 0xa0 is still issued, not taken).
    plain, masked = lc.census(PLANTED, PLANTED_WORK, {"masked": frozenset({0xd0}), "absent": frozenset({0x999})})
    assert (plain.path, plain.instructions, plain.classes["fp32"]) == ("plain", 18, 0)
    assert (masked.path, masked.instructions, masked.classes["fp32"]) == ("masked", 22, 4)
    assert masked.hmma == 4 and masked.classes["ldgsts"] == 2 and masked.classes["memory"] == 1
    # Marks outside the main loop name no path (0x10 is before it).
    assert [row.path for row in lc.census(PLANTED, PLANTED_WORK, {"prologue": frozenset({0x10})})] == ["plain"]


# A K/V step whose row arithmetic has two arms, as block_info.cuh's key_rows: a paged cache's (one instruction here,
# the cheaper) and the contiguous one (three). Unmarked, the cheapest walk takes the paged arm; marked, the plain walk
# must take the contiguous arm (a plain call runs no paged code), and the paged row takes the paged one.
TWO_ARMS = listing(
    "S2R R0, SR_TID.X",                    # 0x00
    "HMMA.16816.F32 R4, R8, R12, R4",      # 0x10 loop head
    "@P1 BRA 0x60",                        # 0x20 paged?
    "IMAD R2, R3, R4, R2",                 # 0x30 contiguous arm
    "IMAD R2, R3, R5, R2",                 # 0x40
    "BRA 0x70",                            # 0x50
    "LDG.E R2, [R6.64]",                   # 0x60 paged arm: the page lookup
    "HMMA.16816.F32 R4, R8, R14, R4",      # 0x70
    "@P0 BRA 0x10",                        # 0x80 back edge
    "EXIT",                                # 0x90
)
TWO_ARMS_WORK = lc.IterationWork(hmma=2, ldgsts=0, exponentials=0)


def test_plain_walk_runs_no_marked_source():
    (unmarked,) = lc.census(TWO_ARMS, TWO_ARMS_WORK)
    assert unmarked.instructions == 5 and unmarked.classes["memory"] == 1  # through the (unmarked) paged arm
    plain, paged = lc.census(TWO_ARMS, TWO_ARMS_WORK, {"paged": frozenset({0x60})})
    assert (plain.path, plain.instructions, plain.classes["memory"]) == ("plain", 7, 0)
    assert (paged.path, paged.instructions, paged.classes["memory"]) == ("paged", 5, 1)
    assert plain.loop_static_instructions == paged.loop_static_instructions == 8
    # The paged arm as the rest of the path's source (PATH_ONLY_SOURCE: paged_key_rows), the path named by code
    # elsewhere (its row lookups, here the loop head's HMMA block, which every walk runs): the plain walk avoids the
    # arm all the same, and the paged walk need not take it.
    plain, paged = lc.census(TWO_ARMS, TWO_ARMS_WORK, {"paged": frozenset({0x10})}, {"paged": frozenset({0x60})})
    assert [(r.path, r.instructions) for r in (plain, paged)] == [("plain", 7), ("paged", 5)]
    # Marks on both arms (as where the compiler predicates both into one block): no walk avoids them, so the plain
    # walk enters as few marked blocks as any walk can (one) and is the cheapest of those; each marked walk runs its
    # own arm, never the other's.
    plain, masked, paged = lc.census(TWO_ARMS, TWO_ARMS_WORK, {"masked": frozenset({0x40}),
                                                               "paged": frozenset({0x60})})
    assert [(r.path, r.instructions) for r in (plain, masked, paged)] == [("plain", 5), ("masked", 7), ("paged", 5)]
    assert masked.classes["memory"] == 0 and paged.classes["memory"] == 1


def test_path_lines_place_every_walked_instruction():
    # The plain walk of PLANTED by source line: the HMMA at one line, the rest at another or unplaced ("?", 0);
    # the copy loop's LDGSTS counts twice (walked twice); the sum is the path's count.
    from cuflash._paths import CUDA_SRC

    (row,) = lc.census(PLANTED, PLANTED_WORK)
    table = {a: (f"{CUDA_SRC}/arch/arch.cuh", 129) for a in (0x30, 0x40, 0x130, 0x140)}
    table.update({a: ("/elsewhere/copy.cuh", 7) for a in (0x60, 0x70, 0x80)})
    counts = lc.path_lines(PLANTED, row, table)
    assert sum(c.instructions for c in counts) == row.instructions == 18
    by_place = {(c.source, c.line): c for c in counts}
    assert by_place["arch/arch.cuh", 129].opcodes == {"HMMA": 4}
    assert by_place["/elsewhere/copy.cuh", 7].opcodes == {"BRA": 2, "IADD3": 2, "LDGSTS": 2}
    assert by_place["?", 0].instructions == 18 - 4 - 6
    assert [c.instructions for c in counts] == sorted((c.instructions for c in counts), reverse=True)
    text = lc.format_lines(lc.CensusRow("k", "sm_80", "1x1x1", PLANTED_WORK, row), counts)
    assert "arch/arch.cuh:129  [HMMA 4]" in text and text.count("\n") == len(counts)


def test_marked_paths_are_the_mask_test_lines():
    # MaskPolicy::visible's body and LaneTileMask::keeps's, found by their opening lines.
    from cuflash._paths import CUDA_SRC

    mask_lines = (CUDA_SRC / "common/mask.cuh").read_text().splitlines()
    visible, keeps = lc.MARKED_PATHS["masked"]
    (line,) = lc.function_body_lines(*visible)
    assert "return key >= key_begin(row) && key < key_end(row);" in mask_lines[line - 1]
    keeps_lines = sorted(lc.function_body_lines(*keeps))
    assert [mask_lines[n - 1].strip() for n in keeps_lines] == [
        "if constexpr (E == Edge::kLeft) return dc - dr >= left;",
        "else if constexpr (E == Edge::kRight) return dc - dr < right;", "else return dc < end;"]
    table = {0x10: ("/x/cuda_src/common/mask.cuh", line), 0x20: ("/x/cuda_src/common/mask.cuh", line + 1),
             0x30: ("/x/cuda_src/kernels/other/common/mask.cuh.bak", line),
             0x40: ("/x/cuda_src/common/mask.cuh", keeps_lines[1]),
             0x50: ("/x/cuda_src/common/mask.cuh", keeps_lines[-1] + 1)}
    assert lc.marked_addresses(table) == {"masked": frozenset({0x10, 0x40}), "paged": frozenset()}
    (paged,) = lc.MARKED_PATHS["paged"]
    paged_lines = sorted(lc.function_body_lines(*paged))
    block_info = (CUDA_SRC / "common/block_info.cuh").read_text().splitlines()
    # The page lookup (PageSlot::of, one home for where a paged row lives, inlined here) and the row's address.
    assert "PageSlot::of(pages, page_size, j)" in " ".join(block_info[n - 1] for n in paged_lines)
    assert lc.marked_addresses({0x60: ("/x/cuda_src/common/block_info.cuh", paged_lines[0])})["paged"] == {0x60}
    # key_rows' paged arm (the rows of a K/V block from the sequence's pages) and the sequence's row of block_table:
    # code only a paged call runs, which the plain walk must not borrow (test_plain_walk_runs_no_marked_source).
    block_rows, pages = lc.PATH_ONLY_SOURCE["paged"]
    arm = " ".join(block_info[n - 1] for n in sorted(lc.function_body_lines(*block_rows)))
    assert "pages(p), p.page_size" in arm and "first_key_row(p) + first_row" in arm
    (table_row,) = [block_info[n - 1] for n in lc.function_body_lines(*pages)]
    assert "p.block_table" in table_row and "block_table_stride" in table_row
    arm_line = min(lc.function_body_lines(*block_rows))
    assert lc.marked_addresses({0x70: ("/x/cuda_src/common/block_info.cuh", arm_line)}, lc.PATH_ONLY_SOURCE) == {
        "paged": frozenset({0x70})}
    with pytest.raises(ValueError, match="expected one"):
        lc.function_body_lines("common/mask.cuh", "__device__")


# Two copy loops, one per tile; the second behind a test (a step with nothing to prefetch skips it) and an extra
# instruction. Uncapped, the cheapest walk that issues 2 LDGSTS runs the first loop twice (8 instructions); each copy
# site capped at one tile's share, it must run each once (9).
TWO_COPY_SITES = listing(
    "S2R R0, SR_TID.X",                    # 0x00
    "HMMA.16816.F32 R4, R8, R12, R4",      # 0x10 loop head
    "LDGSTS.E.BYPASS.128 [R5], [R6.64]",   # 0x20 copy loop A
    "@P1 BRA 0x20",                        # 0x30
    "@P2 BRA 0x80",                        # 0x40 skip copy B
    "IADD3 R7, R7, 0x10, RZ",              # 0x50
    "LDGSTS.E.BYPASS.128 [R9], [R10.64]",  # 0x60 copy loop B
    "@P3 BRA 0x60",                        # 0x70
    "HMMA.16816.F32 R4, R8, R14, R4",      # 0x80
    "@P0 BRA 0x10",                        # 0x90 main loop back edge
    "EXIT",                                # 0xa0
)


def test_each_copy_site_issues_at_most_its_tiles_share():
    (uncapped,) = lc.census(TWO_COPY_SITES, lc.IterationWork(hmma=2, ldgsts=2, exponentials=0))
    assert uncapped.instructions == 8
    (capped,) = lc.census(TWO_COPY_SITES, lc.IterationWork(hmma=2, ldgsts=2, exponentials=0, tiles_copied=2))
    assert capped.instructions == 9 and capped.classes["ldgsts"] == 2 and capped.classes["integer"] == 1
    with pytest.raises(lc.NoPathError):  # three copies from two sites of at most one each
        lc.census(TWO_COPY_SITES, lc.IterationWork(hmma=2, ldgsts=3, exponentials=0, tiles_copied=3))


def test_planted_work_decides_what_the_walk_must_issue():
    # One copy only: the copy loop once, 3 instructions fewer.
    (row,) = lc.census(PLANTED, lc.IterationWork(hmma=4, ldgsts=1, exponentials=2, global_writes=1))
    assert row.instructions == 15
    # No global write: the walk takes the branch over it (the branch stays, the RED goes).
    (row,) = lc.census(PLANTED, lc.IterationWork(hmma=4, ldgsts=2, exponentials=2, global_writes=0))
    assert row.instructions == 17 and row.classes["memory"] == 0
    with pytest.raises(lc.NoPathError):  # more MMAs than the loop can issue in one iteration
        lc.census(PLANTED, lc.IterationWork(hmma=6, ldgsts=2, exponentials=2, global_writes=1))
    with pytest.raises(lc.NoPathError):  # no walk issues three exponentials
        lc.census(PLANTED, lc.IterationWork(hmma=4, ldgsts=2, exponentials=3, global_writes=1))


def _optional_exponentials(fillers: list[int]) -> str:
    """A main loop of an HMMA, then per entry f of ``fillers`` a branch over a block of f FADD and a MUFU.EX2 (a
    score's optional tanh, as the hooks' per-score branches), then the back edge."""
    lines = ["HMMA.16816.F32 R4, R8, R12, R4"]
    for f in fillers:
        after = 16 * (len(lines) + 2 + f)
        lines += [f"@P1 BRA {after:#x}", *["FADD R20, R20, R21"] * f, "MUFU.EX2 R20, R20"]
    return listing(*lines, "@P0 BRA 0x0", "EXIT")


@pytest.mark.parametrize("needed", [0, 1, 5, 12])
def test_the_walk_takes_the_cheapest_blocks_that_issue_the_exponentials(needed):
    # Twelve optional blocks of 2..6 instructions: the walk issuing `needed` exponentials runs the `needed` cheapest
    # (the A* bound of loop_census._rest_costs finds the same walk as Dijkstra alone, sooner).
    fillers = [(7 * i) % 5 + 1 for i in range(12)]
    (row,) = lc.census(_optional_exponentials(fillers), lc.IterationWork(hmma=1, ldgsts=0, exponentials=needed))
    # The HMMA, the 12 branches and the back edge, then the blocks run.
    assert row.instructions == 1 + 12 + 1 + sum(sorted(f + 1 for f in fillers)[:needed])
    assert row.exponentials == needed and row.classes["mufu"] == needed
    with pytest.raises(lc.NoPathError):
        lc.census(_optional_exponentials(fillers), lc.IterationWork(hmma=1, ldgsts=0, exponentials=13))


def test_predicated_off_padding_counts_and_a_subroutine_call_falls_through():
    sass = listing(
        "HMMA.16816.F32 R4, R8, R12, R4",      # 0x00 loop head
        "@!PT LDS RZ, [RZ]",                   # 0x10 ptxas' padding: issued, never runs
        "LDGSTS.E.BYPASS.128 [R5], [R6.64]",   # 0x20
        "CALL.REL.NOINC 0x80",                 # 0x30 a subroutine past the last EXIT: falls through
        "@P0 CALL.REL.NOINC 0x60",             # 0x40 ptxas' divergent loop exit: a jump out of the loop
        "BRA 0x0",                             # 0x50 back edge
        "EXIT",                                # 0x60
        "BRA 0x70",                            # 0x70
        "FFMA R1, R2, R3, R4",                 # 0x80 the subroutine
        "RET.REL.NODEC R10 0x0",               # 0x90
    )
    (row,) = lc.census(sass, lc.IterationWork(hmma=1, ldgsts=1, exponentials=0))
    assert row.instructions == 6
    assert row.classes["memory"] == 1 and row.classes["fp32"] == 0  # the padding LDS; the callee is not walked
    blocks = lc.blocks_of(lc.parse(sass))
    exit_jump = next(b for b in blocks if b.instructions[-1].text.startswith("@P0 CALL"))
    assert {blocks[s].start for s in exit_jump.successors} == {0x50, 0x60}


def test_main_loop_is_the_innermost_loop_that_issues_the_work():
    sass = listing(
        "IADD3 R1, R1, 0x1, RZ",               # 0x00 outer head
        "HMMA.16816.F32 R4, R8, R12, R4",      # 0x10 inner loop (an unroll-1 chunk loop)
        "@P1 BRA 0x10",                        # 0x20
        "LDSM.16.M88.4 R8, [R2]",              # 0x30
        "@P0 BRA 0x0",                         # 0x40 outer back edge
        "EXIT",                                # 0x50
    )
    # The inner loop cannot issue an LDSM (the outer loop's work), so the outer loop is the main one.
    (row,) = lc.census(sass, lc.IterationWork(hmma=3, ldgsts=0, exponentials=0))
    assert row.loop_addresses == (0x0, 0x40)
    assert row.instructions == 1 + 3 * 2 + 2  # the inner loop three times
    assert row.classes["ldsm"] == 1
    # A loop around the main loop (the deterministic backward's loop over K/V blocks) is not the main loop.
    wrapped = listing(
        "IADD3 R20, R20, 0x1, RZ",             # 0x00 the loop around
        "LDGSTS.E.BYPASS.128 [R5], [R6.64]",   # 0x10
        "HMMA.16816.F32 R4, R8, R12, R4",      # 0x20 main loop head
        "IADD3 R1, R1, 0x1, RZ",               # 0x30
        "@P0 BRA 0x20",                        # 0x40 main loop back edge
        "@P1 BRA 0x0",                         # 0x50
        "EXIT",                                # 0x60
    )
    (row,) = lc.census(wrapped, lc.IterationWork(hmma=1, ldgsts=0, exponentials=0))
    assert row.loop_addresses == (0x20, 0x40) and row.instructions == 3


def test_a_listing_without_instructions_or_mma_loop_is_refused():
    with pytest.raises(ValueError, match="no SASS instruction"):
        lc.parse("code for sm_80\n")
    with pytest.raises(lc.NoPathError, match="no loop holding HMMA"):
        lc.census(listing("IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x0", "EXIT"), lc.IterationWork(0, 0, 0))


def test_instruction_classes():
    assert lc.instruction_class("HMMA.16816.F32.BF16") == "hmma"
    assert lc.instruction_class("LDGSTS.E.BYPASS.LTC128B.128.ZFILL") == "ldgsts"
    assert lc.instruction_class("RED.E.ADD.F32.FTZ.RN.STRONG.GPU") == "memory"
    assert lc.instruction_class("REDG.E.ADD.F32.FTZ.RN.STRONG.GPU") == "memory"  # sm_90's spelling
    assert lc.instruction_class("MUFU.EX2") == "mufu"
    assert lc.instruction_class("BAR.SYNC.DEFER_BLOCKING") == "barrier"
    assert lc.instruction_class("IMAD.WIDE.U32") == "integer"
    assert lc.instruction_class("F2FP.F16.F32.PACK_AB") == "other"


def test_line_table_names_each_instructions_source():
    # nvdisasm's line table (lineinfo) for the compiled function, at cuobjdump's addresses: every HMMA comes from
    # arch.cuh's mma wrapper, the masked path's marks from mask.cuh, the paged path's from block_info.cuh.
    traits = fa2_tc.forward_traits(64, targets.target("sm_80"))
    compiled = nvrtc.compile_instance(traits.instance("float16"), "sm_80")
    instructions = lc.parse(nvrtc.dump_sass(compiled))
    table = nvrtc.dump_line_table(compiled)
    assert set(table) <= {ins.address for ins in instructions} and len(table) > 0.9 * len(instructions)
    hmma_sources = {table[ins.address][0].replace("\\", "/").rsplit("/", 2)[-2:] == ["arch", "arch.cuh"]
                    for ins in instructions if ins.base == "HMMA"}
    assert hmma_sources == {True}
    marks = lc.marked_addresses(table)
    assert set(marks) == {"masked", "paged"}
    assert marks["masked"] and all(table[a][0].endswith("mask.cuh") for a in marks["masked"])
    assert marks["paged"] and all(table[a][0].endswith("block_info.cuh") for a in marks["paged"])


def test_report_json_carries_the_census_of_tensor_core_instances():
    from cuflash.kernels import report
    from cuflash.kernels.families import fa2

    traits = fa2_tc.forward_traits(64, targets.target("sm_80"))
    simt = fa2.forward_traits(64, targets.target("sm_80")).instance("float32")
    rows, errors = report.build_report(["sm_80"], instances=[traits.instance("bfloat16"), simt])
    assert not errors
    by_kernel = {row.compiled.instance: report.loop_census_json(row) for row in rows}
    assert by_kernel[simt] == {}  # SIMT kernels have no HMMA loop to census
    plain, masked, paged = by_kernel[traits.instance("bfloat16")]["main_loop"]
    assert plain["path"] == "plain" and plain["hmma"] == lc.iteration_work(traits).hmma
    assert masked["path"] == "masked" and masked["hmma"] == plain["hmma"]
    assert masked["instructions"] > plain["instructions"] and masked["fp32"] > plain["fp32"]
    assert paged["path"] == "paged" and paged["hmma"] == plain["hmma"] and paged["memory"] > plain["memory"]


def test_iteration_work_of_the_tiles():
    # FA2's counts at its tiles (../shared/notes/anchors.md, issue [lean]): forward d128 128x32x4 128 HMMA per
    # warp and 8 copies per thread; backward d128 64x64x8 160 HMMA.
    forward = fa2_tc.ForwardTraits(128, block_m=128, block_n=32, warps=4)
    assert lc.iteration_work(forward) == lc.IterationWork(hmma=128, ldgsts=8, exponentials=32, global_writes=0,
                                                          tiles_copied=2, mma_flops=128 * 4096)
    backward = fa2_tc.BackwardTraits(128, block_m=64, block_n=64, warps=8)
    assert lc.iteration_work(backward) == lc.IterationWork(hmma=160, ldgsts=8, exponentials=16, global_writes=32,
                                                           tiles_copied=2, mma_flops=160 * 4096)
    # The Hopper forward, per consumer warp: FA3's d128 128 x 176 step issues 19 HGMMA (issue 31); 2 x 2 x 64 x 176
    # x 128 FLOPs over the warpgroup's 4 warps.
    hopper = fa3.ForwardTraits(128, block_m=128, block_n=176)
    assert lc.iteration_work(hopper) == lc.IterationWork(hmma=19, ldgsts=0, exponentials=88,
                                                         mma_flops=64 * 176 * 128)


# ---------------------------------------------------------------------------------------------------------------
# The tensor-core kernels (compiled through the cache; cuobjdump and nvdisasm come with the test extra).

# The tests below walk one 16-bit type a day, in turn (each type every other day): a walk of a large tile costs up to
# two minutes of the suite's 30, and the two types' loops differ only in the MMA's and the conversions' types. A
# failure names the type in its row (the kernel's name).
CENSUS_DTYPE = fa2_tc.DTYPES[datetime.date.today().toordinal() % len(fa2_tc.DTYPES)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_census_of_the_tensor_core_main_loops(arch, head_dim, direction):
    target = targets.target(arch)
    traits = (fa2_tc.forward_traits if direction == "forward" else fa2_tc.backward_traits)(head_dim, target)
    work = lc.iteration_work(traits)
    rows = {dtype: lc.instance_census(traits, dtype, arch) for dtype in (CENSUS_DTYPE,)}
    sass = nvrtc.dump_sass(nvrtc.compile_instance(traits.instance(CENSUS_DTYPE), arch))
    blocks = lc.blocks_of(lc.parse(sass))
    walked = [ins.opcode for b in rows[CENSUS_DTYPE][0].path.blocks for ins in blocks[b].instructions]
    # The walk is the Q-block step (the backward's dQ adds, RED on sm_80 and REDG on sm_90), never a loop around
    # it whose dK/dV stores could stand in for them.
    assert not [op for op in walked if op.startswith("STG")]
    assert sum(op.startswith("RED") for op in walked) == work.global_writes
    for dtype, (row, *others) in rows.items():
        assert row.path.path == "plain" and row.work == work
        assert row.path.hmma == work.hmma and row.path.classes["ldgsts"] == work.ldgsts
        # A sanity band, not the bound (below): FA2's own d128 backward issues 2.84 per HMMA (sm_80), this one 2.89.
        assert 2.5 < row.path.instructions_per_hmma < 20.0, row.as_json()
        json.dumps(row.as_json())
        assert {"kernel", "arch", "path", "instructions", "hmma", "instructions_per_hmma"} <= set(row.as_json())


# The tensor-core main loops' plain iteration, issue [lean] item 2: instructions per HMMA measured at the planned
# tiles (NVRTC 13; fp16 and bf16 issue the same counts). A ratchet: a change may not lose more than 3% of it.
# Forward: lane ldmatrix bases made once, whole K/V tiles copied by unrolled cp.async from one pointer, the mask's
# blocks found before the loop. Backward (the Q-block step): dQ added unconditionally from one address per lane in
# whole Q blocks, no division (by the number of Q blocks or the group size), the thread index unsigned, every ldmatrix
# address a lane base plus an immediate, the bases held through a K/V block's steps up to d128, the step's rows in
# q, dout, the statistics and dq_accum carried from step to step (StepRows), P and dS stored from one base per lane
# (AccPairOffsets), Q's buffers flipped by an XOR, P's exponent one FMA (the scale folded as FA2 folds it). FA2's own
# figures (../shared/notes/anchors.md): forward d128 128x32x4 4.3, 128x64x4 3.7, d64 128x128x4 4.6; backward d128
# 64x64x8 3.3, 64x128x8 2.8; and, counted here the same way (nvcc 13.5 at FA2's flags and CUTLASS pin, sm_80, this
# census's walk over FA2's SASS), backward d64 128x128x8 1054 / 320 = 3.29, forward d256 128x64x8 758 / 256 = 2.96
# and 64x64x4 774 / 256 = 3.02. The same walk over FA2's d128 64x128x8 backward gives 909 / 320 (2.84) against the
# table's 891 (2.8): within 2% of the issue's counting.
LEAN_PER_HMMA = {
    ("forward", "sm_80", 64): 5.148,    # 128x64x4: 659 / 128 (833 before)
    ("forward", "sm_80", 128): 4.695,   # 128x32x4: 601 / 128 (775 before)
    ("forward", "sm_80", 256): 3.156,   # 128x64x8: 808 / 256 (1055 before)
    ("forward", "sm_90", 64): 5.156,    # 128x64x4: 660 / 128 (856 before)
    ("forward", "sm_90", 128): 4.719,   # 128x32x4: 604 / 128 (796 before)
    ("forward", "sm_90", 256): 3.375,   # 64x64x4: 864 / 256 (1910 before)
    # The backward since its square warp tiles (fa2_tc_backward.cu's pick_warps_m; "strips" below: before them).
    ("backward", "sm_80", 64): 3.509,   # 128x128x8 (FA2's tile, NVRTC 13): 1123 / 320; at 64x128x8 635 / 160 = 3.97
                                        # (strips 651; 681 before the folded scale; 951 before held lane bases,
                                        # step rows, pair stores)
    ("backward", "sm_80", 128): 2.9,    # 64x128x8: 928 / 320 (strips 966; 995 before the folded scale)
    ("backward", "sm_90", 64): 3.575,   # 128x128x8: 1144 / 320 (strips 1174; 1236 before the folded scale)
    ("backward", "sm_90", 128): 2.953,  # 64x128x8: 945 / 320 (strips 991; 1021 before the folded scale)
    ("backward", "sm_80", 256): 3.938,  # 32x64x8: 630 / 160 (strips 636; 971 before whole Q, dO)
    ("backward", "sm_90", 256): 4.15,   # 32x64x8: 664 / 160 (strips 666; 1008 before whole Q, dO)
    # d96 and d192 since whole blocks copy in two column parts (fa2_tc_tiles.cuh's WholeTileCopy: 8 + 4 and 16 + 8
    # chunks a row); before, load_tile's general loop for every block, the forward holding its key rows
    # (ForwardTraits::kHoldKeyRows; sm_80 d96 1161, d192 1013, sm_90 1169, 1019; 1251, 1103, 1273, 1123 before that).
    ("forward", "sm_80", 96): 4.271,    # 128x64x4: 820 / 192
    ("forward", "sm_90", 96): 4.286,    # 128x64x4: 823 / 192
    ("forward", "sm_80", 192): 3.563,   # 128x64x8: 684 / 192
    ("forward", "sm_90", 192): 3.583,   # 128x64x8: 688 / 192
    ("backward", "sm_80", 96): 3.367,   # 64x128x8 (FA2's tile): 808 / 240 (64x64x8: 546 / 120; 727 before)
    ("backward", "sm_90", 96): 3.425,   # 64x128x8: 822 / 240 (64x64x8: 563 / 120; 752 before)
    ("backward", "sm_80", 192): 4.575,  # 32x64x8: 549 / 120 (729 before)
    ("backward", "sm_90", 192): 4.858,  # 32x64x8: 583 / 120 (771 before)
}


# The masked path (loop_census.MARKED_PATHS: a tile that runs the element-wise mask) at the same tiles. FA2's plain
# figures x 1.3 (the issue's bound for masked paths): forward d64 5.98, d128 at 128x32 5.59; backward d128 at 64x128
# 3.64. The forward's mask is one pass per crossed edge of the band, a compare per diagonal and a select per score
# (mask.cuh's LaneTileMask), with the mask policy held through the K/V loop; before, MaskPolicy::visible per score.
# The backward's masked step without a score hook the same since BackwardTraits::kMaskByEdges (before: visible per
# score in P's loop, the figures in parentheses as "per score").
LEAN_MASKED_PER_HMMA = {
    ("forward", "sm_80", 64): 5.891,    # 754 / 128 (plain 659; 919 before)
    ("forward", "sm_80", 128): 5.117,   # 655 / 128 (plain 601; 756 before)
    ("forward", "sm_80", 256): 3.402,   # 871 / 256 (plain 808; 960 before)
    ("forward", "sm_90", 64): 5.914,    # 757 / 128 (928 before)
    ("forward", "sm_90", 128): 5.156,   # 660 / 128 (765 before)
    ("forward", "sm_90", 256): 3.629,   # 929 / 256 (1026 before)
    ("backward", "sm_80", 64): 3.834,   # 128x128x8: 1227 / 320 (per score 1369; at 64x128x8 775 / 160)
    ("backward", "sm_80", 128): 3.131,  # 1002 / 320 (per score 1070; strips 1101)
    ("backward", "sm_80", 256): 4.2,    # 672 / 160 (per score 682; strips 685)
    ("backward", "sm_90", 64): 3.909,   # 1251 / 320 (per score 1389; strips 1422)
    ("backward", "sm_90", 128): 3.194,  # 1022 / 320 (per score 1092; strips 1126)
    ("backward", "sm_90", 256): 4.438,  # 710 / 160 (per score 716; strips 715)
    ("forward", "sm_80", 96): 4.76,     # 914 / 192 (1255 before the two-part whole copies)
    ("forward", "sm_90", 96): 4.786,    # 919 / 192 (1265 before)
    ("forward", "sm_80", 192): 3.891,   # 747 / 192 (1076 before)
    ("forward", "sm_90", 192): 3.922,   # 753 / 192 (1084 before)
    ("backward", "sm_80", 96): 3.638,   # 64x128x8: 873 / 240 (64x64x8: 595 / 120; 776 before)
    ("backward", "sm_90", 96): 3.713,   # 64x128x8: 891 / 240 (64x64x8: 616 / 120; 805 before)
    ("backward", "sm_80", 192): 4.883,  # 586 / 120 (766 before)
    ("backward", "sm_90", 192): 5.208,  # 625 / 120 (812 before)
}
assert set(LEAN_MASKED_PER_HMMA) == set(LEAN_PER_HMMA)

# The paged path (KeyRows::paged_row: K/V rows found through a paged cache's block table), forward only (the KV-cache
# call). Pages a multiple of the K/V block take the whole-tile copies, each block's source looked up in its page;
# before, every paged block went through load_tile's general loop (sm_80: d64 6.61, d128 6.16 per HMMA).
LEAN_PAGED_PER_HMMA = {
    ("forward", "sm_80", 64): 5.484,    # 702 / 128 (846 before)
    ("forward", "sm_80", 128): 5.031,   # 644 / 128 (789 before)
    ("forward", "sm_80", 256): 3.324,   # 851 / 256
    ("forward", "sm_90", 64): 5.531,    # 708 / 128
    ("forward", "sm_90", 128): 5.094,   # 652 / 128
    ("forward", "sm_90", 256): 3.563,   # 912 / 256
    ("forward", "sm_80", 96): 4.542,    # 872 / 192 (1204 before the two-part whole copies)
    ("forward", "sm_90", 96): 4.589,    # 881 / 192 (1169 before: its lookups predicated into the plain walk)
    ("forward", "sm_80", 192): 3.833,   # 736 / 192 (1056 before)
    ("forward", "sm_90", 192): 3.885,   # 746 / 192 (1019 before, as d96)
}


@pytest.mark.parametrize("direction, arch, head_dim", sorted(LEAN_PER_HMMA))
def test_main_loop_stays_lean(direction, arch, head_dim):
    traits = (fa2_tc.forward_traits if direction == "forward" else fa2_tc.backward_traits)(head_dim,
                                                                                          targets.target(arch))
    for dtype in (CENSUS_DTYPE,):
        plain, masked, *others = lc.instance_census(traits, dtype, arch)
        assert (plain.path.path, masked.path.path) == ("plain", "masked")
        assert plain.path.instructions_per_hmma <= LEAN_PER_HMMA[direction, arch, head_dim] * 1.03, plain.as_json()
        # The masked walk issues the same work and more besides (the mask's compares and selects).
        assert masked.path.hmma == plain.path.hmma and masked.path.instructions > plain.path.instructions
        assert (masked.path.instructions_per_hmma <= LEAN_MASKED_PER_HMMA[direction, arch, head_dim] * 1.03
                ), masked.as_json()
        assert [row.path.path for row in others] == (["paged"] if direction == "forward" else [])
        for paged in others:  # the page lookups besides the plain path's work
            assert paged.path.hmma == plain.path.hmma and paged.path.instructions > plain.path.instructions
            assert (paged.path.instructions_per_hmma <= LEAN_PAGED_PER_HMMA[direction, arch, head_dim] * 1.03
                    ), paged.as_json()


# Issue [lean]'s bounds: the plain path at most 1.15x FA2's instructions per HMMA at the same tile (FA2's default
# tile for the head dim where cuflash's is one FA2 does not use), the masked and paged paths at most 1.3x. FA2's
# figures (the issue's table, counted from FA2's own SASS): forward d64 4.6 (its 128x128x4; cuflash runs 128x64x4),
# d128 4.3 at 128x32x4, backward d128 2.8 at 64x128x8; counted here (see LEAN_PER_HMMA): backward d64 3.29 at
# 128x128x8, forward d256 2.96 at 128x64x8 and 3.02 at 64x64x4 (FA2's H100 tile; its sm_80 SASS, as the issue's
# table counts sm_80). Every case holds since the backward's d64 runs FA2's 128x128x8 on sm_80 too (under NVRTC 13:
# 3.51 per HMMA, 1.07x; at 64x128x8 it was 3.97, 1.21x) and its masked steps apply the mask by the tile's edges
# (d64 sm_90 3.91, 1.19x; per score it was 4.34, 1.32x). The sets below name cases that do not hold (strict xfails:
# they run, and the day one holds the test says so); empty now.
FA2_PER_HMMA = {("forward", 64): 4.6, ("forward", 128): 4.3, ("backward", 128): 2.8, ("backward", 64): 3.29,
                # FA2's d256 forward tile per target, counted here: 128x64x8 (A100) 758 / 256, 64x64x4 (H100) 774 / 256
                ("forward", 256): {"sm_80": 2.96, "sm_90": 3.02}}
PLAIN_NOT_YET_WITHIN_FA2: set[tuple[str, int, str]] = set()
MASKED_NOT_YET_WITHIN_FA2: set[tuple[str, int, str]] = set()


def _bound_cases(not_yet):
    return [pytest.param(direction, head_dim, arch,
                         marks=[pytest.mark.xfail(strict=True, reason="not yet within FA2's bound")]
                         if (direction, head_dim, arch) in not_yet else [])
            for direction, head_dim in sorted(FA2_PER_HMMA) for arch in ("sm_80", "sm_90")]


def _fa2(direction, head_dim, arch):
    figure = FA2_PER_HMMA[direction, head_dim]
    return figure[arch] if isinstance(figure, dict) else figure


def _planned_census(direction, head_dim, arch, dtype):
    traits = (fa2_tc.forward_traits if direction == "forward" else fa2_tc.backward_traits)(head_dim,
                                                                                          targets.target(arch))
    return traits, lc.instance_census(traits, dtype, arch)


@pytest.mark.parametrize("direction, head_dim, arch", _bound_cases(PLAIN_NOT_YET_WITHIN_FA2))
def test_main_loop_within_the_bound_of_fa2(direction, head_dim, arch):
    for dtype in (CENSUS_DTYPE,):
        traits, (plain, *_) = _planned_census(direction, head_dim, arch, dtype)
        assert plain.path.instructions_per_hmma <= 1.15 * _fa2(direction, head_dim, arch), plain.as_json()
        if direction == "backward":  # FA2's tile for the figure
            assert (traits.block_m, traits.block_n, traits.warps) == ((64, 128, 8) if head_dim == 128
                                                                      else (128, 128, 8))


@pytest.mark.parametrize("direction, head_dim, arch", _bound_cases(MASKED_NOT_YET_WITHIN_FA2))
def test_masked_and_paged_loops_within_the_bound_of_fa2(direction, head_dim, arch):
    for dtype in (CENSUS_DTYPE,):
        _, (_, masked, *others) = _planned_census(direction, head_dim, arch, dtype)
        assert masked.path.instructions_per_hmma <= 1.3 * _fa2(direction, head_dim, arch), masked.as_json()
        for paged in others:
            assert paged.path.instructions_per_hmma <= 1.3 * _fa2(direction, head_dim, arch), paged.as_json()



def _mod_traits(direction, head_dim, arch):
    """The tile a flex instance of ``direction`` runs on ``arch``: the Hopper forward's hooked one or the Hopper
    backward's plain one on sm_90a, else fa2_tc's."""
    if arch == "sm_90a":
        return fa3.HOOKED_CHOICES[head_dim] if direction == "forward" else fa3_backward.BACKWARD_CHOICES[head_dim]
    return (fa2_tc.forward_traits if direction == "forward" else fa2_tc.backward_traits)(head_dim, targets.target(arch))


# Issue 29 item 6: a kernel whose score_mod is softcap issues at most the built-in softcap's main loop plus 10%
# (loop_census.softcap_census: every score through its tanh). Measured (sm_80 fp16 d64 forward, instructions per
# iteration): plain 659, built-in 1289; the fast-math mod (trace_score_mod(fast_math=True): __fdividef,
# tanh_by_exp2) 1238 (0.96x), 1649 (+28%) while the hook tested every score against seqlen_q / seqlen_k (about 300
# instructions; now only tiles crossing the sequence's end do: flex_hook.cuh's on_tile). The exact mod (IEEE
# division's slow-path test and call, tanhf's polynomial) 2644 (2.05x; 2954 with the per-score test): the bound is
# the fast-math one's, as issue 29 asks of a mod in the built-in's forms.
# The Hopper forward (sm_90a: its hooked tile, fa3.HOOKED_CHOICES, with the mod's FlexHook): d128 128 x 128 plain 497,
# built-in 947, the fast-math mod 1027 (1.08x) since the kernel takes score' itself from a score_mod
# (FlexHook::kScaledScores: exponent factor log2 e); 1090 (1.15x) while it took score' / scale (a product per score).
# Since the Hopper kernels keep their descriptors' high words in registers (fa3::desc_unfolded) the built-in's step
# is 932, the mod's 1019 (1.093x: its S loop still copies both high words before each HGMMA). The mod's score / cap
# is folded into the softmax scale now (flex._emit.fold_score_factor, FlexHook::mod_input: the product per score the
# built-in's softcap_inner never had): 956 (1.026x); sm_80 d64 1238 -> 1175 (0.91x), 1112 (0.86x) since the sm_80
# forward takes score' itself as well (kScaledScores). The sm_80 built-in's step since it tests softcap and ALiBi once
# a tile (ScoreHook::in_tile_cases): 1139 (the mod 0.976x of it).
#
# The backwards (the sm_80 one since it takes the hook per tile as the forwards do, FlexHook::tests_bounds, and the
# score' itself, kScaledScores): sm_80 d64 plain 1123, built-in 2056, the fast-math mod 1866 (0.91x; 2395, 1.16x,
# while every score tested the sequence bounds and took score' / scale); the built-in testing its parts once a tile
# 1808 (the mod 1.032x of it). The Hopper backward's built-in softcap runs
# in its hooked instance (fa3_backward.HOOKED_CHOICES), a mod in the plain tile's, both in one pass once dP^T has
# landed: d128 plain 385, built-in 733, the fast-math mod 745 (1.016x). (While the built-in formed P^T with dP^T in
# flight and recovered the tanh's derivative from P after the wait, its step was 981, the mod 0.76x of it; the
# cheapest walk issuing the tanh's exponentials skipped the derivative, behind a once-a-tile test: 664.)
@pytest.mark.parametrize("direction, head_dim, arch, bound", [("forward", 64, "sm_80", 1.1),
                                                               ("forward", 128, "sm_90a", 1.1),
                                                               ("backward", 64, "sm_80", 1.1),
                                                               ("backward", 128, "sm_90a", 1.1)])
def test_softcap_mod_loop_within_the_built_in_softcap(direction, head_dim, arch, bound):
    import jax.numpy as jnp

    from cuflash.flex import trace_score_mod
    from cuflash.flex._kernels import hooked_instance

    traits = _mod_traits(direction, head_dim, arch)
    plain = lc.instance_census(traits, CENSUS_DTYPE, arch)[0]
    built_in_traits = (fa3_backward.HOOKED_CHOICES[head_dim] if (direction, arch) == ("backward", "sm_90a")
                       else traits)
    built_in = lc.softcap_census(built_in_traits, CENSUS_DTYPE, arch)
    # The softcap path runs the tanh: more exponentials and instructions than the plain path, the same MMAs.
    assert built_in.path.hmma == plain.path.hmma and built_in.path.instructions > plain.path.instructions
    assert built_in.path.classes["mufu"] > plain.path.classes["mufu"]
    cap = 30.0
    fast = trace_score_mod(lambda score, b, h, q_idx, kv_idx: cap * jnp.tanh(score / cap), fast_math=True)
    modded = lc.softcap_census(traits, CENSUS_DTYPE, arch, hooked_instance(traits.instance(CENSUS_DTYPE), fast, None))
    assert modded.path.hmma == plain.path.hmma
    assert modded.path.instructions <= bound * built_in.path.instructions, (modded.as_json(), built_in.as_json())


# A block mask's full tiles run the hook's form with neither the mask_mod nor the bounds test (flex_hook.cuh's
# FullForm; the mma.sync forward gives it to mask_mod-only hooks), and the mma.sync backward its unhooked step there
# (FlexHook::idle_on): the cheapest walk of a block-sparse instance is that step, within a bound of the unmodded step.
# Measured (NVRTC 13.5, fp16): the Hopper forward at d128 (128 x 128) against its hooked instance with no hook part
# on, 497: document (a mask_mod reading two captured arrays) 541, prefix-LM 527 (1900 and 937 with the per-score
# tests on every tile: ptxas had predicated the mask_mod's loads into every step); the sm_80 mma.sync forward at d64
# against its plain step, 659: document 808, prefix-LM 806 (2003 and 1278 before, spilling 24 and 16 bytes); its
# backward at d64 against 1123: 1274 and 1263 (3047 and 2047 with the hook on every tile); the Hopper backward
# (fa3_backward.cu: its unhooked step on such tiles too) at d128 against its plain step, 459: 472 and 468 (the list's
# loads, the idle test, and reloads of values ptxas spilled around the hooked form; 489 and 481 while dS^T went to
# shared memory by 32-bit stores, whose 16 addresses were spilled and reloaded every step: fa3::store_fragment).
# Since the descriptors' high words stay in registers (fa3::desc_unfolded) the Hopper backward's plain step is 385
# and the flex ones 440 and 436 (1.14x, 1.13x): the plain step's A and B descriptors take two zeros, the d128 flex
# step one, its uniform registers short with two (document 466); bound 1.15 (1.1 before).
@pytest.mark.parametrize("direction, arch, head_dim, bound", [("forward", "sm_90a", 128, 1.15),
                                                               ("backward", "sm_90a", 128, 1.15),
                                                               ("forward", "sm_80", 64, 1.3),
                                                               ("backward", "sm_80", 64, 1.3)])
@pytest.mark.parametrize("variant", ["document", "prefix-lm"])
def test_flex_full_tiles_run_no_mask_mod(variant, direction, arch, head_dim, bound):
    from cuflash.benchmarks import workloads
    from cuflash.flex import trace_mask_mod
    from cuflash.flex._kernels import hooked_instance

    traits = _mod_traits(direction, head_dim, arch)
    unmodded = lc.instance_census(traits, CENSUS_DTYPE, arch)[0]
    mask = trace_mask_mod(workloads.flex_mods(variant, 1024, 2)["mask_mod"])
    instance = hooked_instance(traits.instance(CENSUS_DTYPE), None, mask, block_sparse=True)
    compiled = nvrtc.compile_instance(instance, arch)
    # The sm_80 forward's full form took its spills away (the backward's instances spill a little either way).
    assert compiled.resources.spill_store_bytes == 0 or arch == "sm_90a" or direction == "backward"
    (full, *_) = lc.census(nvrtc.dump_sass(compiled), lc.iteration_work(traits), {})
    assert full.hmma == unmodded.path.hmma and full.classes["mufu"] >= lc.iteration_work(traits).exponentials
    assert full.instructions <= bound * unmodded.path.instructions, (full, unmodded.as_json())


# ---------------------------------------------------------------------------------------------------------------
# The Hopper forward (fa3_forward.cu; issue 31, item 5): its consumer warpgroup's steady-state step, compiled for
# sm_90a, against FA3's figures counted from FA3's own SASS (nvcc 13.5, issue 31): forward d128 0.40 instructions
# per 1000 MMA FLOPs per warp at 128 x 176 (583 instructions, 19 HGMMA), d64 0.80 at 192 x 192 with 3 consumers.
# cuflash's d64 runs 192 x 128 (fa3.FORWARD_CHOICES: FA3's 192 x 192 spills at three consumers' 160 registers);
# per FLOP the two tiles compare fairly, since the softmax costs the same per score and a score is 4 d FLOPs at
# either width, while the narrower tile spreads the step's fixed cost (waits, barriers, the loop) over fewer FLOPs:
# the comparison is against cuflash. Bound: 1.15x (issue 31). Measured (NVRTC 13.5): d128 608 instructions, 19
# HGMMA, 0.422 (1.05x); d64 439, 12 HGMMA, 0.838 (1.05x); d128 128 x 128 (the masked tile, no FA3 figure) 491,
# 0.480. The masked steps run in a loop of their own (fa3_forward.cu: the steady step holds no mask branch), its
# walk through the mask's code the "masked" row (d128 756, 603; d64 551) and its cheapest walk a third row. (With
# the mask's branch inside one loop: 613, 444, 496, masked 760, 555, 607; before the step's descriptors were moved
# on by fa3::desc_advanced instead of made again per k16 step: 663, 476, 539.) Since the descriptors' high words
# stay in registers (fa3::desc_unfolded): d128 590 (0.409), d64 432 (0.824), 128 x 128 476, masked 737, 588, 544;
# d256 453 (470 before the tiles made their descriptors with the zero themselves, WgmmaTile::k_major_desc).
# Cases that do not hold would be strict xfails naming their figure; none now.
FA3_PER_KFLOP = {64: 0.80, 128: 0.40}
HOPPER_NOT_YET_WITHIN_FA3: set[int] = set()


def _hopper_census(head_dim):
    traits = fa3.FORWARD_CHOICES[head_dim][1]  # the tile without a mask (FA3's figures are of it)
    return traits, lc.instance_census(traits, CENSUS_DTYPE, "sm_90a")


@pytest.mark.parametrize("head_dim", [
    pytest.param(d, marks=[pytest.mark.xfail(strict=True, reason=f"not yet within 1.15x FA3's {FA3_PER_KFLOP[d]}")]
                 if d in HOPPER_NOT_YET_WITHIN_FA3 else []) for d in sorted(FA3_PER_KFLOP)])
def test_hopper_forward_step_within_the_bound_of_fa3(head_dim):
    traits, (plain, *others) = _hopper_census(head_dim)
    work = lc.iteration_work(traits)
    # The consumer's step: exactly its HGMMA (S: d / 16, P V: block_n / 16), no LDGSTS (TMA is the producer's), at
    # least an exponential per score a thread holds; the masked steps (causal's diagonal) in a loop of their own:
    # its walk through the mask's code and its cheapest walk are the second and third rows.
    assert plain.path.hmma == work.hmma == traits.head_dim // 16 + traits.block_n // 16
    assert plain.path.classes["ldgsts"] == 0 and plain.path.classes["mufu"] >= work.exponentials
    _assert_masked_loop_of_its_own(plain.path, [row.path for row in others])
    assert plain.instructions_per_kflop <= 1.15 * FA3_PER_KFLOP[head_dim], plain.as_json()


# The Hopper backward (fa3_backward.cu; issue 31, item 5): the consumer warpgroup's steady-state (head, Q block) step
# at d128, compiled for sm_90a, against FA3's backward d128 0.31 instructions per 1000 MMA FLOPs per warp (80 x 128,
# 508 instructions, 34 HGMMA; issue 31). cuflash's tile is 64 x 128 (fa3_backward.BACKWARD_CHOICES: FA3's causal
# one); per FLOP the comparison is fair as for the forward (the per-score work is the same, a step's fixed cost
# spreads over fewer FLOPs). Bound 1.15x: 0.3565, 467 instructions for the step's 32 HGMMA. Measured (NVRTC 13.5,
# fp16 and bf16 alike): 596 (0.455) at first; 462 (0.352) since dQ is dS K (M = the queries, FA3's form) added by 16
# vector REDs of two floats at compile-time offsets from two row pointers (it was dQ^T = K^T dS^T: 32 scalar REDs,
# 16 addresses), the step's (head, Q block) and dq_accum rows move on without a division, and the stage's
# descriptors come from stage 0's. What is left is mostly ptxas writing both words of each wgmma's descriptor pair
# before every SS wgmma (UIADD3 for the low words, UMOV of the constant high words: 4 per HGMMA, about 100 of the
# 462), 72 for dS = P (dP - D) and 41 for P's exponent. 453 (0.346) since the consumers store dQ to shared memory
# (16 8-byte stores at compile-time offsets) for the producer's dQ writer to add with bulk reduces (no RED in the
# step); 459 in later kernels; 444 (0.339) since dS^T goes to shared memory by 4 stmatrix (16 32-bit stores, each
# at an address of its own, before); 385 (0.294) since the descriptors' high words stay in registers
# (fa3::desc_unfolded, A's and B's apart; the test below). No case is outside the bound now.
BACKWARD_FA3_PER_KFLOP = 0.31


def test_hopper_backward_step_within_the_bound_of_fa3():
    traits = fa3_backward.BACKWARD_CHOICES[128]
    assert traits in lc.tensor_core_traits("sm_90") and traits not in lc.tensor_core_traits("sm_80")
    plain, *others = lc.instance_census(traits, CENSUS_DTYPE, "sm_90")  # what the plans launch: sm_90a code
    work = lc.iteration_work(traits)
    # Per consumer warpgroup 5 products of 2 x 64 x 64 x 128 FLOPs (its 64 keys x the 64 queries x d; dQ: the 64
    # queries x its 64 head-dim columns x 128 keys), a warp's quarter; S^T 8, dP^T 8, dV 4, dK 4, dQ 8 HGMMA; no
    # global writes (dQ goes to shared memory: the dQ writer's bulk reduces); no LDGSTS (the producer's copies); an
    # exponential per score.
    assert work == lc.IterationWork(hmma=32, ldgsts=0, exponentials=32, global_writes=0,
                                    mma_flops=5 * 2 * 64 * 64 * 128 // 4)
    assert plain.tile == "64x128x2wg" and plain.path.hmma == 32
    assert plain.path.classes["ldgsts"] == 0 and plain.path.classes["mufu"] >= work.exponentials
    assert [row.path.path for row in others] == ["masked"]  # causal's diagonal steps
    assert plain.instructions_per_kflop <= 1.15 * BACKWARD_FA3_PER_KFLOP, plain.as_json()


# Every descriptor of the Hopper kernels has one high word (stride byte offset 1024, 128-byte swizzle: 0x40000040).
# Knowing it at compile time, ptxas wrote it into both descriptors' registers before every SS wgmma (2 UMOV an
# HGMMA: 72 in the d128 backward, 64 of its step's 444 instructions); fa3::desc_unfolded hides it behind a zero read
# at run time (arch::opaque_zero), so ptxas keeps it in a register: no such UMOV is left (backward d128 385, forward
# d128 590, NVRTC 13.5). Planted by hand: without desc_unfolded the backward's SASS holds 72 again.
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_hopper_descriptors_high_word_is_not_rewritten_per_wgmma(kernel):
    traits = fa3.FORWARD_CHOICES[128][1] if kernel == "forward" else fa3_backward.BACKWARD_CHOICES[128]
    high_word = 1024 >> 4 | 1 << 30  # wgmma_desc_encode's bits 32-63: stride byte offset / 16, swizzle code 1
    sass = nvrtc.dump_sass(nvrtc.compile_instance(traits.instance(CENSUS_DTYPE), "sm_90a"))
    assert sass.count("HGMMA.") >= traits.head_dim // 16
    rewrites = [line for line in sass.splitlines() if "UMOV" in line and f", {high_word:#x} ;" in line]
    assert not rewrites, rewrites[:4]


# Softcap and ALiBi run in separate instances (fa3.HOOKED_CHOICES: the masked tile with Hooked = true) because a
# runtime test of the hook cost the plain step 2 to 5 instructions (d128 128 x 176: 663 -> 668, past the bound
# above). In the hooked instance the hook's parts are tested once per tile (fa3::hook_scores), not per score as
# ScoreHook's operator() alone compiled (2 branches a score: 132 in the d128 step). Measured (NVRTC 13.5, fp16,
# 128 x 128): the hooked step with neither part on 501 instructions (plain instance 495; per-score tests 627), with
# softcap 987 and 7 branches (per-score tests 1123 and 132). Since the descriptors' high words stay in registers
# (fa3::desc_unfolded): plain 476, hooked 482 (490 while A's and B's descriptors shared one zero: ptxas then copied
# the high word into both operands' registers before each of S's HGMMA in the hooked step, into one in the plain).
@pytest.mark.parametrize("head_dim", [128])
def test_hopper_hooked_forward_tests_the_hook_once_per_tile(head_dim):
    plain_traits, hooked_traits = fa3.FORWARD_CHOICES[head_dim][0], fa3.HOOKED_CHOICES[head_dim]
    plain = lc.instance_census(plain_traits, CENSUS_DTYPE, "sm_90a")[0]
    hooked = lc.instance_census(hooked_traits, CENSUS_DTYPE, "sm_90a")[0]
    softcap = lc.softcap_census(hooked_traits, CENSUS_DTYPE, "sm_90a")
    assert hooked.path.hmma == softcap.path.hmma == plain.path.hmma
    # The walk with neither part on: the plain step and the tile's two tests.
    assert hooked.path.instructions <= plain.path.instructions + 8, (hooked.as_json(), plain.as_json())
    # Softcap on every score, and no branch per score.
    assert softcap.path.classes["mufu"] >= 2 * lc.iteration_work(hooked_traits).exponentials
    assert softcap.path.classes["branch"] <= plain.path.classes["branch"] + 4, softcap.as_json()


def _assert_masked_loop_of_its_own(plain, others):
    """The Hopper forward's masked steps run in a loop apart from the steady one (fa3_forward.cu): the census's
    rows after the plain one are the walk through the mask's code, in that loop, and that loop's cheapest walk."""
    masked, other_loop = others
    assert masked.path == "masked" and other_loop.path.startswith("loop at "), (masked.path, other_loop.path)
    assert masked.loop_addresses == other_loop.loop_addresses != plain.loop_addresses
    assert masked.instructions > other_loop.instructions >= plain.instructions - 8


# The d256 tile (FA3's 128 x 80, two consumers; no FA3 figure of it counted here): its step issues exactly its HGMMA
# (16 of S, 5 of P V), no LDGSTS, an exponential per score, and stays within FA3's d128 figure per FLOP (a score
# carries twice the FLOPs at d256). Measured (NVRTC 13.5, fp16): 504 instructions, 21 HGMMA, 0.384; masked 579 (with
# the mask's branch in the steady step: 505 and 587; with a descriptor made per k16 step, 623: 0.475).
def test_hopper_forward_d256_step():
    traits, (plain, *others) = _hopper_census(256)
    work = lc.iteration_work(traits)
    assert (traits.block_m, traits.block_n, traits.consumers) == (128, 80, 2)
    assert plain.path.hmma == work.hmma == 256 // 16 + 80 // 16
    assert plain.path.classes["ldgsts"] == 0 and plain.path.classes["mufu"] >= work.exponentials
    _assert_masked_loop_of_its_own(plain.path, [row.path for row in others])
    assert plain.instructions_per_kflop <= FA3_PER_KFLOP[128], plain.as_json()


# MLA's 192 / 128 forward on its own tile (fa3.NARROW_V_CHOICES: FA3's 128 x 128 for it, V and O at 128) against
# the d192 tile it ran on before (128 x 112, P V at 192 with V's 64 zero columns): per FLOP of MLA's own products
# (2 x 64 keys x (192 + 128) a row, a warp's quarter), the step issues fewer instructions (NVRTC 13.5, fp16: 511 for
# 128 keys, 0.390; the d192 tile 507 for 112, 0.442), exactly its HGMMA (S: 12, P V: 8), and keeps the masked steps
# in a loop of their own.
def test_hopper_forward_mla_tile_step():
    mla = fa3.NARROW_V_CHOICES[(192, 128)]
    wide = fa3.FORWARD_CHOICES[192][1]
    (plain, *others), (wide_plain, *_) = (lc.instance_census(t, CENSUS_DTYPE, "sm_90a") for t in (mla, wide))
    work = lc.iteration_work(mla)
    assert plain.path.hmma == work.hmma == 192 // 16 + 128 // 16 and work.mma_flops == 32 * 128 * (192 + 128)
    assert plain.path.classes["ldgsts"] == 0 and plain.path.classes["mufu"] >= work.exponentials
    _assert_masked_loop_of_its_own(plain.path, [row.path for row in others])
    mla_flops_per_step = {t: 32 * t.block_n * (192 + 128) for t in (mla, wide)}
    per_mla_flop = {t: row.path.instructions / mla_flops_per_step[t] for t, row in ((mla, plain), (wide, wide_plain))}
    assert per_mla_flop[mla] < 0.95 * per_mla_flop[wide], (plain.as_json(), wide_plain.as_json())
    assert plain.instructions_per_kflop <= FA3_PER_KFLOP[128], plain.as_json()


# MLA's backward on the d256 tile with V, dO and dV at 128 (fa3_backward.NARROW_V_CHOICES): per consumer step 36
# HGMMA where the d256 tile issues 44 (dP^T's 8 k16 steps instead of 16), and fewer instructions (NVRTC 13.5, fp16:
# 424 against 459) for a fifth fewer tensor-core FLOPs.
def test_hopper_backward_mla_tile_step():
    mla, wide = fa3_backward.NARROW_V_CHOICES[(256, 128)], fa3_backward.BACKWARD_CHOICES[256]
    (plain, *_), (wide_plain, *_) = (lc.instance_census(t, CENSUS_DTYPE, "sm_90") for t in (mla, wide))
    work, wide_work = lc.iteration_work(mla), lc.iteration_work(wide)
    assert plain.path.hmma == work.hmma == 36 and wide_plain.path.hmma == wide_work.hmma == 44
    assert work.mma_flops == wide_work.mma_flops * 4 // 5
    assert plain.path.instructions < wide_plain.path.instructions, (plain.as_json(), wide_plain.as_json())


def _softmax_between_pv_issue_and_wait(sass):
    """Per step in the SASS whose P V issue the S wait follows closely, in address order: the softmax instructions
    (MUFU.EX2, FMNMX, SHFL) placed after the P V wgmma's issue and before the wait for it (WARPGROUP.DEPBAR.LE gsb0,
    0x0), the S wait (0x1) between them; and the step's softmax instructions in all (from the P V issue to the next
    step's wgmma)."""
    instructions = lc.parse(sass)
    opcodes = [ins.opcode for ins in instructions]
    texts = [ins.text for ins in instructions]

    def softmax(ops):
        return sum(op == "MUFU.EX2" or op.split(".")[0] in ("FMNMX", "SHFL") for op in ops)

    steps = []
    for issue, text in enumerate(texts):
        if not (".tnspB" in text and "gsb0" in text and "HGMMA" in text
                and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in " ".join(texts[issue + 1:issue + 4])):
            continue
        wait = next(i for i in range(issue, len(texts)) if texts[i].endswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
        end = next(i for i in range(wait, len(texts)) if opcodes[i] == "WARPGROUP.ARRIVE")
        steps.append((softmax(opcodes[issue:wait]), softmax(opcodes[issue:end])))
    return steps


# FA3 keeps its P V group in flight across about a third of the softmax (issue 31). The PTX has the whole softmax of
# S_{j+1} (its row max, 90 ex2, the shuffles) between wgmma.wait_group 1 and 0, as fa3_forward.cu orders it (FA3's
# order). With the mask's branch inside the step, NVRTC 13.5's ptxas put the WARPGROUP.DEPBAR of wait_group 0 at the
# join after it, ahead of the softmax: 1 softmax instruction of the step's 188 in flight (register pins, __syncwarp,
# FA3's release order, early K release and a branch-free correction moved nothing). fa3_forward.cu runs the steps
# whose next block needs the mask in a loop of their own (FA3 does too), and the steady step, with no branch, keeps
# P V in flight across 65 of its 188 (d128 128 x 176; 65 of 140 at 128 x 128).
def test_hopper_forward_keeps_pv_in_flight_across_a_third_of_the_softmax():
    instance = fa3.FORWARD_CHOICES[128][1].instance("float16")
    sass = nvrtc.dump_sass(nvrtc.compile_instance(instance, "sm_90a"))
    steps = _softmax_between_pv_issue_and_wait(sass)
    assert steps, "no P V issue followed by the S wait"
    in_flight, step = max(steps)
    assert step >= 90 + 88  # the step's exponentials and its row maxima at least
    assert in_flight >= step / 3, (in_flight, step)
