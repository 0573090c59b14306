"""The loop census: what one steady-state iteration of a tensor-core kernel's main loop issues, read from SASS.

    python3 -m cuflash.kernels loop [--arch sm_80 sm_90 ...] [--json] [--kernels REGEX] [--lines]

FlashAttention-2's speed comes from main loops that issue little besides the MMAs, the softmax and the copies
(about 3-4.5 SASS instructions per HMMA.16816 at its default tiles). This module measures the same thing for
cuflash's kernels, per warp, from the instance's SASS (the bytes the compile report describes):

1. The SASS is cut into basic blocks (leaders: branch targets and the instruction after a branch or exit) joined
   by fall-through and branch edges. Every instruction counts, predicated-off ones included (a warp issues them).
2. A loop is a backward branch: its body is the address range from the branch target to the branch. The main
   loops are the innermost loops one iteration of which can issue the iteration's work (below; today one per
   kernel: the forward's K/V loop, the backward's loop over (head, Q block) steps).
3. The plain path through one iteration is the cheapest walk from the loop head back to it along the loop's back
   edge, staying inside the loop, that issues the iteration's whole work: exactly the HMMA and the LDGSTS one
   iteration must issue per warp (known from the tile: ``IterationWork``) and at least its exponentials (MUFU.EX2,
   one per score the lane owns). Inner loops are walked as often as the walk needs (a copy loop that is not
   unrolled counts once per trip). Branches the plain case skips (the element-wise mask, the score hook, ragged
   or paged copies, varlen re-reads behind tests) cost more, so the cheapest walk avoids them; work the plain
   case must do cannot be skipped, since the counts are fixed. Where the work sits behind a test the walk
   passes that test's instructions too: they are part of what the plain path issues.

Each path is reported as instruction counts by class (HMMA, LDSM, LDGSTS, other memory, FP32 arithmetic,
MUFU, SHFL, barriers, branches, integer/address, other) and instructions per HMMA. ``walk`` and ``census`` take
SASS text, so tests plant small listings whose counts are known; ``instance_census`` compiles through the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Sequence

# SASS lines as cuobjdump prints them: /*addr*/  [@P] OPCODE operands ;
_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", re.MULTILINE)
_GUARD = re.compile(r"^@(!?)(U?P\w+)\s+")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")

# Instruction classes, by base opcode (the opcode before its first '.').
CLASSES = ("hmma", "ldsm", "ldgsts", "memory", "fp32", "mufu", "shfl", "barrier", "branch", "integer", "other")
_CLASS_OF = {
    # The tensor-core class: mma.sync's HMMA, and wgmma's HGMMA (each warp of the warpgroup issues it, so a warp's
    # count is the warpgroup's wgmma count).
    "HMMA": "hmma",
    "HGMMA": "hmma",
    "LDSM": "ldsm",
    "LDGSTS": "ldgsts",
    **{op: "memory" for op in ("LDS", "STS", "LDG", "STG", "LD", "ST", "RED", "REDG", "ATOM", "ATOMS", "ATOMG",
                               "LDL", "STL", "LDC", "ULDC")},
    **{op: "fp32" for op in ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD")},
    "MUFU": "mufu",
    "SHFL": "shfl",
    **{op: "barrier" for op in ("BAR", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "BSSY", "BSYNC", "MEMBAR", "ERRBAR",
                                "CCTL", "FENCE", "WARPGROUP", "SYNCS")},  # wgmma's arrive and waits; mbarriers
    **{op: "branch" for op in ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BREAK", "BPT", "KILL")},
    **{op: "integer" for op in ("IMAD", "IADD3", "IADD", "LEA", "LOP3", "SHF", "ISETP", "MOV", "SEL", "PRMT",
                                "IABS", "IMNMX", "S2R", "CS2R", "S2UR", "PLOP3", "P2R", "R2P", "IMUL", "LOP",
                                "SHL", "SHR", "UMOV", "UIADD3", "UIMAD", "ULOP3", "USHF", "UISETP", "ULEA",
                                "USEL", "UPRMT", "R2UR", "POPC", "FLO", "BREV", "IDP", "VOTE", "VOTEU", "UFLO",
                                "UPOPC", "BMSK", "SGXT", "IMNMX", "UMNMX")},
}


def instruction_class(opcode: str) -> str:
    return _CLASS_OF.get(opcode.split(".")[0], "other")


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str  # as printed, guard included, without the ';'

    @property
    def guard(self) -> tuple[bool, str] | None:
        """(negated, predicate) of an ``@P`` guard, None when unguarded."""
        match = _GUARD.match(self.text)
        return (match.group(1) == "!", match.group(2)) if match else None

    @property
    def opcode(self) -> str:
        return _GUARD.sub("", self.text).split()[0]

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def never_runs(self) -> bool:
        return self.guard == (True, "PT")  # @!PT: padding ptxas places, issued but never executed

    @property
    def target(self) -> int | None:
        """The address a BRA, JMP or CALL names."""
        if self.base not in ("BRA", "JMP", "CALL") or self.never_runs:
            return None
        match = _BRANCH_TARGET.search(self.text)
        return int(match.group(1), 16) if match else None

    @property
    def conditional(self) -> bool:
        """Whether control may go either way here: a guarded instruction, or a BRA with a predicate operand."""
        guard = self.guard
        if guard is not None and guard != (False, "PT"):
            return True
        operands = _GUARD.sub("", self.text).split(None, 1)
        return self.base == "BRA" and len(operands) > 1 and re.match(r"!?U?P\d", operands[1]) is not None


def parse(sass: str) -> list[Instruction]:
    """The instructions of one function's SASS listing, in address order."""
    found = [Instruction(int(address, 16), text) for address, text in _LINE.findall(sass)]
    if not found:
        raise ValueError("no SASS instruction found (expected cuobjdump --dump-sass lines: /*addr*/ OPCODE ... ;)")
    return found


@dataclass(frozen=True)
class Block:
    index: int
    start: int  # address of the first instruction
    end: int  # address of the last instruction
    instructions: tuple[Instruction, ...]
    successors: tuple[int, ...]  # block indices

    def count(self, cls: str) -> int:
        return sum(instruction_class(i.opcode) == cls for i in self.instructions)

    def count_opcode(self, opcode: str) -> int:
        return sum(i.opcode.startswith(opcode) for i in self.instructions)


def subroutines(instructions: Sequence[Instruction]) -> frozenset[int]:
    """Addresses CALLs name that start a subroutine: a RET is reachable from there along branches and
    fall-through (every CALL taken as falling through). The kernel's own code never reaches a RET that way: it
    ends in EXIT or in the branches of its loops."""
    index = {ins.address: n for n, ins in enumerate(instructions)}

    def reaches_ret(start: int) -> bool:
        seen, todo = {start}, [start]
        while todo:
            n = todo.pop()
            ins = instructions[n]
            if ins.base == "RET" and not ins.never_runs:
                return True
            nexts = []
            if ins.base in ("BRA", "JMP") and ins.target in index:
                nexts.append(index[ins.target])
            unconditional_end = ins.base in ("BRA", "JMP", "EXIT", "RET", "BRX", "JMX", "KILL") and not (
                ins.never_runs or ins.conditional)
            if not unconditional_end and n + 1 < len(instructions):
                nexts.append(n + 1)
            for m in nexts:
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return False

    targets = {ins.target for ins in instructions if ins.base == "CALL" and ins.target in index}
    return frozenset(t for t in targets if reaches_ret(index[t]))


def jump_target(ins: Instruction, called: frozenset[int]) -> int | None:
    """Where control may go besides falling through: a branch's target, or a CALL's that is not a subroutine.
    ptxas leaves divergent loops with ``CALL.REL.NOINC`` to an address in the kernel's body (a jump that keeps
    the call stack; no RET behind it); a CALL of a subroutine (a slow path, such as an IEEE division's, placed
    after the kernel's code and ending in RET) returns: it falls through and its body is not walked."""
    target = ins.target
    if target is None or (ins.base == "CALL" and target in called):
        return None
    return target


def ends_flow(ins: Instruction, called: frozenset[int]) -> bool:
    """Control never falls through: an unconditional branch, jump-like CALL, exit or return."""
    if ins.never_runs or ins.conditional:
        return False
    if ins.base == "CALL":
        return jump_target(ins, called) is not None
    return ins.base in ("BRA", "JMP", "EXIT", "RET", "BRX", "JMX", "KILL")


def blocks_of(instructions: Sequence[Instruction]) -> list[Block]:
    """Basic blocks with their successors (fall-through first, then the branch target)."""
    address_index = {ins.address: n for n, ins in enumerate(instructions)}
    called = subroutines(instructions)
    leaders = {0}
    for n, ins in enumerate(instructions):
        target = jump_target(ins, called)
        if target is not None and target in address_index:
            leaders.add(address_index[target])
        if (target is not None or ins.base in ("EXIT", "RET", "BRX", "JMX")) and n + 1 < len(instructions):
            leaders.add(n + 1)
    starts = sorted(leaders)
    block_of = {}
    spans = []
    for b, first in enumerate(starts):
        last = (starts[b + 1] if b + 1 < len(starts) else len(instructions)) - 1
        spans.append((first, last))
        block_of[instructions[first].address] = b
    blocks = []
    for b, (first, last) in enumerate(spans):
        tail = instructions[last]
        successors = []
        if not ends_flow(tail, called) and b + 1 < len(spans):
            successors.append(b + 1)
        target = jump_target(tail, called)
        if target is not None and target in block_of and block_of[target] not in successors:
            successors.append(block_of[target])
        blocks.append(Block(b, instructions[first].address, tail.address, tuple(instructions[first:last + 1]),
                            tuple(successors)))
    return blocks


@dataclass(frozen=True)
class Loop:
    head: int  # block index of the branch target
    latch: int  # block index of the backward branch
    blocks: frozenset[int]  # the address range head..latch

    def contains(self, other: Loop) -> bool:
        return other.blocks <= self.blocks and other != self


def loops_of(blocks: Sequence[Block]) -> list[Loop]:
    found = []
    for block in blocks:
        for successor in block.successors:
            if blocks[successor].start <= block.start:
                found.append(Loop(successor, block.index, frozenset(range(successor, block.index + 1))))
    return found


def mma_loops(blocks: Sequence[Block]) -> list[Loop]:
    """Loops holding HMMA, innermost (fewest blocks) first."""
    found = {loop for loop in loops_of(blocks) if any(blocks[b].count("hmma") for b in loop.blocks)}
    return sorted(found, key=lambda loop: (len(loop.blocks), blocks[loop.head].start))


@dataclass(frozen=True)
class IterationWork:
    """What one iteration of a main loop must issue per warp: HMMA, LDGSTS and global writes (RED, ATOM, STG)
    exactly, MUFU.EX2 at least."""

    hmma: int
    ldgsts: int
    exponentials: int
    global_writes: int = 0
    # The tiles the LDGSTS copy (0: not said). Each tile is one copy site's share, so a walk may issue at most
    # ceil(ldgsts / tiles_copied) from any one LDGSTS: without the cap the cheapest walk could run one copy loop for
    # both tiles and skip the other copy (the backward's last step, with no prefetch), under-reading the step.
    tiles_copied: int = 0
    # The multiply-add FLOPs of the iteration's MMAs per warp (2 per multiply-add; 0: not said): the measure across
    # MMA shapes (an m16n8k16 HMMA is 4096, a warp's share of a 64 x N x 16 HGMMA 512 N), hence the census's
    # instructions per 1000 MMA FLOPs.
    mma_flops: int = 0


@dataclass(frozen=True)
class PathCensus:
    path: str
    instructions: int
    classes: dict[str, int]
    exponentials: int
    loop_static_instructions: int  # every instruction of the loop's address range, each counted once
    loop_addresses: tuple[int, int]
    blocks: tuple[int, ...] = field(repr=False)  # the walk, block by block

    @property
    def hmma(self) -> int:
        return self.classes["hmma"]

    @property
    def instructions_per_hmma(self) -> float:
        return self.instructions / self.hmma if self.hmma else float("inf")


class NoPathError(ValueError):
    """No walk through the loop issues the iteration's work (the work is wrong for this kernel, or the loop)."""


# sm_90's SASS spells red.global REDG (sm_80's RED): without it no walk of the backward's Q-block loop on sm_90
# issued the dQ adds, and the walk settled on the loop around it (whose dK/dV epilogue stores counted instead).
_GLOBAL_WRITES = ("RED", "REDG", "ATOM", "ATOMG", "STG")


_AVOIDED = 10**9  # walk's cost of entering a block it avoids


def walk(blocks: Sequence[Block], loop: Loop, work: IterationWork, path: str = "plain",
         through: frozenset[int] = frozenset(), avoid: frozenset[int] = frozenset()) -> PathCensus:
    """The cheapest walk from the loop's head back to it through its back edge that issues ``work`` (Dijkstra over
    (block, HMMA, LDGSTS and global writes so far, exponentials so far capped at the required number, and with
    ``work.tiles_copied`` the copies of each LDGSTS so far, each at most a tile's share); costs are instruction
    counts, so the walk is the path issuing the fewest instructions). With ``through`` (block indices), the walk
    must visit one of those blocks (a path named by the source it runs: ``marked_paths``). Blocks of ``avoid`` (the
    source of other paths) it enters as rarely as it can, before counting instructions: where a branch leads round
    them the walk takes it, however much it costs, and where the compiler made one block of both arms (predicated
    instructions, issued either way) the walk passes through, as every iteration does."""
    sites = sorted({i.address for b in loop.blocks for i in blocks[b].instructions if i.base == "LDGSTS"})
    site_cap = -(-work.ldgsts // work.tiles_copied) if work.tiles_copied else work.ldgsts
    # Per-site counts join the state only where a cap can bind (several sites, a cap below the step's copies).
    capped = sites if len(sites) > 1 and site_cap < work.ldgsts else []
    need = (work.hmma, work.ldgsts, work.global_writes, work.exponentials, *([site_cap] * len(capped)))
    # A block's cost: its instructions, plus _AVOIDED for a block of ``avoid`` (more than any walk issues, so one
    # such block fewer always wins).
    per_block = {b: (len(blocks[b].instructions) + _AVOIDED * (b in avoid), blocks[b].count("hmma"),
                     blocks[b].count("ldgsts"), sum(i.base in _GLOBAL_WRITES for i in blocks[b].instructions),
                     blocks[b].count_opcode("MUFU.EX2"),
                     *(sum(i.address == a for i in blocks[b].instructions) for a in capped)) for b in loop.blocks}
    first = _add((0, 0, 0, 0, *([0] * len(capped))), per_block[loop.head][1:], need)
    if first is None:
        raise NoPathError(f"the loop head alone issues more than {need}")
    # A* (the same cheapest walk, found sooner): a state is queued at its cost plus the least the rest of a walk
    # costs that issues the exponentials still missing (_rest_costs: a bound that never overestimates, and consistent,
    # so states leave the queue at their least cost as in Dijkstra). Without it a walk needing twice the exponentials
    # (softcap_census) of a loop with per-score branches (the sm_80 backward's hook) took minutes: every cheaper walk
    # that skipped the branches was carried on to the loop's end, at every count of exponentials.
    rest = _rest_costs(blocks, loop, {b: (c[0], c[4]) for b, c in per_block.items()}, need[3])

    def bound(state: tuple) -> float:
        return rest[state[0]][need[3] - state[4]]

    # The state's last count: whether the walk has visited a block of ``through`` (always 1 without one).
    start = (loop.head, *first, int(not through or loop.head in through))
    queue = [(per_block[loop.head][0] + bound(start), per_block[loop.head][0], *start)]
    best: dict[tuple, int] = {start: per_block[loop.head][0]}
    previous: dict[tuple, tuple] = {}
    while queue:
        _, cost, *state = heapq.heappop(queue)
        state = tuple(state)
        block, counts = state[0], state[1:]
        if best.get(state, cost) < cost:
            continue
        for successor in blocks[block].successors:
            if successor not in loop.blocks:
                continue
            if block == loop.latch and successor == loop.head:
                if tuple(counts[:3]) == need[:3] and counts[3] >= need[3] and counts[-1]:
                    walked = [block]
                    while state in previous:
                        state = previous[state]
                        walked.append(state[0])
                    walked.reverse()
                    return _census(blocks, loop, walked, path, counts[3])
                continue
            added = _add(counts[:-1], per_block[successor][1:], need)
            if added is None:
                continue
            next_state = (successor, *added, int(counts[-1] or successor in through))
            next_cost = cost + per_block[successor][0]
            if next_cost < best.get(next_state, next_cost + 1) and bound(next_state) < math.inf:
                best[next_state] = next_cost
                previous[next_state] = state
                heapq.heappush(queue, (next_cost + bound(next_state), next_cost, *next_state))
    raise NoPathError(f"no walk through the loop at {blocks[loop.head].start:#x}..{blocks[loop.latch].end:#x} "
                      f"issues {work.hmma} HMMA, {work.ldgsts} LDGSTS and {work.global_writes} global writes with "
                      f">= {work.exponentials} MUFU.EX2" + (f" through blocks {sorted(through)}" if through else ""))


def _rest_costs(blocks: Sequence[Block], loop: Loop, per_block: dict[int, tuple[int, int]],
                needed: int) -> dict[int, list[float]]:
    """For each block b of ``loop`` and k in 0..needed, the fewest instructions a walk from b (b's own not counted)
    to the loop's latch (its own counted) issues while issuing at least k MUFU.EX2 (``per_block``: a block's
    instructions and exponentials), inf where none does: Dijkstra backwards from (latch, 0) over (block, k)."""
    predecessors: dict[int, list[int]] = {b: [] for b in loop.blocks}
    for b in loop.blocks:
        for successor in blocks[b].successors:
            if successor in loop.blocks and not (b == loop.latch and successor == loop.head):
                predecessors[successor].append(b)
    rest = {b: [math.inf] * (needed + 1) for b in loop.blocks}
    rest[loop.latch][0] = 0
    queue = [(0, loop.latch, 0)]
    while queue:
        cost, block, k = heapq.heappop(queue)
        if rest[block][k] < cost:
            continue
        instructions, exponentials = per_block[block]
        # A walk from a predecessor into this block issues this block's exponentials first: it needs k more after
        # them, or any number up to them where k is 0.
        ks = range(0, min(exponentials, needed) + 1) if k == 0 else [min(k + exponentials, needed)]
        for predecessor in predecessors[block]:
            for before in ks:
                if cost + instructions < rest[predecessor][before]:
                    rest[predecessor][before] = cost + instructions
                    heapq.heappush(queue, (cost + instructions, predecessor, before))
    # Issuing more than k also issues k: make each row non-increasing in k from the top.
    for row in rest.values():
        for k in range(needed - 1, -1, -1):
            row[k] = min(row[k], row[k + 1])
    return rest


def _add(counts: tuple[int, ...], block: tuple[int, ...], need: tuple[int, ...]) -> tuple[int, ...] | None:
    """Counts after a block: None past an exact need or a copy site's cap; the exponentials capped at theirs."""
    h, l, w, e, *per_site = (c + b for c, b in zip(counts, block))
    if h > need[0] or l > need[1] or w > need[2] or any(s > cap for s, cap in zip(per_site, need[4:])):
        return None
    return (h, l, w, min(e, need[3]), *per_site)


def _census(blocks: Sequence[Block], loop: Loop, walked: list[int], path: str, exponentials: int) -> PathCensus:
    classes = dict.fromkeys(CLASSES, 0)
    for b in walked:
        for ins in blocks[b].instructions:
            classes[instruction_class(ins.opcode)] += 1
    static = sum(len(blocks[b].instructions) for b in loop.blocks)
    return PathCensus(path, sum(classes.values()), classes, exponentials, static,
                      (blocks[loop.head].start, blocks[loop.latch].end), tuple(walked))


def census(sass: str, work: IterationWork, marks: dict[str, frozenset[int]] | None = None,
           path_only: dict[str, frozenset[int]] | None = None) -> list[PathCensus]:
    """The main loops of a function's SASS and the plain path of each, then the marked paths: for each name in
    ``marks`` (instruction addresses, marked_paths) the cheapest walk through a block holding one of them, of the
    plain row's loop where it holds one, else of the first other main loop that does (a kernel whose masked steps
    run in a loop of their own), a row named by it (none where no main loop holds a marked instruction). Each walk
    avoids the other paths' source (``walk``'s avoid): their marks and ``path_only`` (addresses by path name, the
    rest of a path's source: PATH_ONLY_SOURCE); the plain walk every such block, a marked walk the blocks that hold
    another's source and none of its own. So a plain row never borrows an arm of a paged cache's code that happens
    to be cheaper than its own: a walk's choices at separate branches are independent, a kernel's are not
    (key_rows' paged arm goes with paged_row's lookups).

    A main loop is a loop one of whose iterations can issue ``work`` (a walk exists) and that encloses no other
    such loop: an inner loop holding only part of the MMAs (the backward's dQ column chunks) cannot, and a loop
    around the main loop (over K/V blocks or heads) encloses it. Loops are tried innermost first. The cheapest of
    them is the ``plain`` row; a kernel whose masked iterations run in a loop of their own gets that loop as a
    second row, named by its address."""
    blocks = blocks_of(parse(sass))
    candidates = mma_loops(blocks)
    if not candidates:
        raise NoPathError("no loop holding HMMA")
    marks, path_only = marks or {}, path_only or {}

    def marked_blocks(loop: Loop, names: Iterable[str], whole_source: bool = True) -> frozenset[int]:
        """The loop's blocks that hold an instruction of one of the ``names``d paths' marks (and, with
        ``whole_source``, of the rest of their source)."""
        addresses = frozenset().union(*(marks[name] | (path_only.get(name, frozenset()) if whole_source else
                                                       frozenset()) for name in names))
        return frozenset(b for b in loop.blocks if any(i.address in addresses for i in blocks[b].instructions))

    found: list[tuple[Loop, PathCensus]] = []
    failure = None
    for loop in candidates:
        if any(loop.contains(inner) for inner, _ in found):
            continue
        try:
            found.append((loop, walk(blocks, loop, work, avoid=marked_blocks(loop, marks))))
        except NoPathError as error:
            failure = error
    if not found:
        raise failure
    found.sort(key=lambda pair: pair[1].instructions)
    (plain_loop, plain), rest = found[0], [row for _, row in found[1:]]
    marked = []
    for name in marks:
        for loop in (plain_loop, *(loop for loop, _ in found[1:])):
            through = marked_blocks(loop, [name], whole_source=False)
            if through:
                others = marked_blocks(loop, [other for other in marks if other != name]) - through
                marked.append(walk(blocks, loop, work, name, through, avoid=others))
                break
    return [plain, *marked] + [dataclasses.replace(row, path=f"loop at {row.loop_addresses[0]:#x}") for row in rest]


# ---------------------------------------------------------------------------------------------------------------
# cuflash's tensor-core kernels.


def iteration_work(traits) -> IterationWork:
    """Per warp, one iteration: the forward's K/V block (S = Q K^T and O += P V; K and V copied), the backward's
    Q block step (S, dP, dV, dK, dQ; Q and dO copied). m16n8k16 MMAs; 16-byte copies spread over the block."""
    from .families import fa2_tc, fa3, fa3_backward

    if isinstance(traits, fa3_backward.BackwardTraits):
        # One consumer warpgroup's (head, Q block) step that issues dQ (at d64 the consumers take turns at it: the step
        # of the one whose turn it is), per warp: S^T and dP^T as d / 16 wgmma of 64 x block_m x 16 each (dP^T: dv / 16,
        # v's own width), and dV and dK as block_m / 16 of 64 x dv (d) x 16 each, dQ as block_n / 16 of 64 x 64 x 16 per
        # head-dim tile of 64 it owns (M: the block_m = 64 queries); no global writes (dQ goes to shared memory, 16
        # 8-byte stores per tile, and the producer's dQ writer adds it into dq_accum with bulk reduces); no copies (the
        # producer's); an exponential per score (64 keys x block_m over 128 threads). FLOPs: a warp's share (1/4) of
        # each.
        m, n, d, consumers = traits.block_m, traits.block_n, traits.head_dim, traits.consumers
        dv = traits.v_head_dim  # dP^T's reduction and dV's columns (v's own width: MLA's tile)
        if traits.split_head_dim:
            # Sharing the head dim (one 64-key block, two consumers), per consumer: S^T and dP^T of its queries
            # (traits.queries, block_m / 2: d / 16 and dv / 16 wgmma of 64 x queries x 16), dV and dK of its out_cols_v
            # and out_cols (dv / 2, d / 2: m / 16 of 64 x cols x 16 each, P^T and dS^T from shared memory), dQ of its
            # out_cols (n / 16 of 64 x out_cols x 16); its dQ added into dq_accum by its own paired REDs (64 queries x
            # out_cols over 128 threads, two floats each); an exponential per score (64 keys x queries over 128
            # threads).
            q, cols, cols_v = traits.queries, traits.out_cols, traits.out_cols_v
            hmma = d // 16 + dv // 16 + 2 * (m // 16) + n // 16
            flops = 2 * 64 * q * (d + dv) + 2 * 64 * (cols + cols_v) * m + 2 * m * cols * n
            return IterationWork(hmma=hmma, ldgsts=0, exponentials=64 * q // 128,
                                 global_writes=m * cols // 128 // 2, mma_flops=flops // 4)
        dq_tiles = -(-(d // 64) // consumers)  # the most head-dim tiles one consumer takes in a step
        hmma = d // 16 + dv // 16 + 2 * (m // 16) + dq_tiles * (n // 16)
        flops = 2 * 2 * 64 * m * (d + dv) + dq_tiles * 2 * m * 64 * n
        return IterationWork(hmma=hmma, ldgsts=0, exponentials=64 * m // 128, global_writes=0, mma_flops=flops // 4)
    if isinstance(traits, fa3.ForwardTraits):
        # One consumer warpgroup's K/V block: S = Q K^T as head_dim / 16 wgmma of 64 x block_n x 16, O += P V as
        # block_n / 16 of 64 x v_head_dim x 16; no copies (the producer's TMA); one exponential per score a thread
        # holds (64 rows x block_n over 128 threads). A warp's share of both products: 2 x 64 n (d + dv) / 4.
        n, d, dv = traits.block_n, traits.head_dim, traits.v_head_dim
        return IterationWork(hmma=d // 16 + n // 16, ldgsts=0, exponentials=64 * n // 128,
                             mma_flops=32 * n * (d + dv))
    m, n, d, warps = traits.block_m, traits.block_n, traits.head_dim, traits.warps
    mma_per_product = m * n * d // (16 * 8 * 16)
    copied_rows = n if isinstance(traits, fa2_tc.ForwardTraits) else m
    copies = -(-2 * copied_rows * d * 2 // 16 // traits.threads)
    forward = isinstance(traits, fa2_tc.ForwardTraits)
    return IterationWork(hmma=(2 if forward else 5) * mma_per_product // warps, ldgsts=copies,
                         exponentials=m * n // traits.threads,
                         # The backward adds its dQ_i part (rows x d floats) into dq_accum, one RED per element.
                         global_writes=0 if forward else m * d // traits.threads,
                         tiles_copied=2,  # K and V, or Q and dO
                         mma_flops=(2 if forward else 5) * mma_per_product // warps * 4096)


@dataclass(frozen=True)
class CensusRow:
    kernel: str
    arch: str
    tile: str
    work: IterationWork
    path: PathCensus

    @property
    def instructions_per_kflop(self) -> float:
        """Instructions per 1000 MMA FLOPs, per warp: comparable across HMMA and HGMMA loops (issue 31's figures)."""
        return 1000 * self.path.instructions / self.work.mma_flops if self.work.mma_flops else float("inf")

    def as_json(self) -> dict:
        return {
            "kernel": self.kernel,
            "arch": self.arch,
            "tile": self.tile,
            "path": self.path.path,
            "instructions": self.path.instructions,
            "hmma": self.path.hmma,
            "instructions_per_hmma": round(self.path.instructions_per_hmma, 3),
            "instructions_per_kflop": round(self.instructions_per_kflop, 3),
            **{name: count for name, count in self.path.classes.items() if name != "hmma"},
            "exponentials": self.path.exponentials,
            "expected_ldgsts": self.work.ldgsts,
            "loop_static_instructions": self.path.loop_static_instructions,
            "loop_addresses": [f"{a:#x}" for a in self.path.loop_addresses],
        }


def tensor_core_traits(arch: str) -> list:
    """Every tensor-core tile (forward and backward, dropout or not; the Hopper forward's and backward's on sm_90)
    the plans for ``arch`` launch."""
    from . import targets
    from .families import fa2_tc, hopper

    target = targets.target(arch)
    found = []
    for head_dim in fa2_tc.HEAD_DIMS:
        for dropout in (False, True):
            found.append(fa2_tc.forward_traits(head_dim, target, dropout=dropout))
            found.append(fa2_tc.backward_traits(head_dim, target, dropout=dropout))
    found += [hopper.traits_of(instance) for instance in hopper.instances(target)]
    return list(dict.fromkeys(found))


def traits_by_instance(arch: str) -> dict:
    """The tensor-core tiles of ``arch``'s plans by the instance each compiles to (fp16 and bf16)."""
    return {traits.instance(dtype): traits for traits in tensor_core_traits(arch) for dtype in ("float16", "bfloat16")}


# The paths through a main loop besides the plain one, each named by the source it must run (issue [lean]: the
# masked path): pairs of (a file under cuda_src, a line opening a function whose body marks the path); an iteration
# that runs any of them takes the path. ``masked``: the element-wise mask's tests, which only the masked copy of a
# tile's softmax runs: the tensor-core forward's per-lane form (LaneTileMask::keeps), the backward's per-score one
# (MaskPolicy::visible). ``paged``: a K/V row found through a paged KV cache's block table (KeyRows::paged_row).
MARKED_PATHS = {"masked": (("common/mask.cuh", "bool visible(int row, int key) const {"),
                           ("common/mask.cuh", "bool keeps(int dr, int dc) const {")),
                "paged": (("common/block_info.cuh", "T* paged_row(int j) const {"),)}
# The rest of a marked path's source: code that only the path's calls run but that does not name the path (its walk
# need not run it), which every other walk avoids as it avoids the path's marks. ``paged``: the rows of a K/V block
# set up from the sequence's pages (BlockInfo::paged_key_rows, pages): key_rows' paged arm is cheaper than its
# contiguous one, so a plain walk that may take it counts a combination no call runs.
PATH_ONLY_SOURCE = {"paged": (("common/block_info.cuh", "KeyRows<T> paged_key_rows(const AttentionParams& p"),
                              ("common/block_info.cuh", "const int* pages(const AttentionParams& p) const {"))}


def function_body_lines(source: str, opening: str) -> frozenset[int]:
    """The 1-based line numbers of the body of the function whose opening line (signature and brace) in
    ``source`` (a file under cuda_src) contains ``opening``: the lines after it up to its closing brace, found by
    indentation (cuflash's style: the brace alone at the signature's indentation)."""
    from .._paths import CUDA_SRC

    lines = (CUDA_SRC / source).read_text().splitlines()
    starts = [n for n, text in enumerate(lines) if opening in text]
    if len(starts) != 1:
        raise ValueError(f"{source}: {len(starts)} lines open {opening!r}, expected one")
    start = starts[0]
    indent = len(lines[start]) - len(lines[start].lstrip())
    for n in range(start + 1, len(lines)):
        if lines[n].strip() == "}" and len(lines[n]) - len(lines[n].lstrip()) <= indent:
            return frozenset(range(start + 2, n + 1))  # 1-based: the lines between the opening and the brace
    raise ValueError(f"{source}: no closing brace for {opening!r}")


def marked_addresses(line_table: dict[int, tuple[str, int]], paths: dict | None = None) -> dict[str, frozenset[int]]:
    """For each of ``paths`` (default MARKED_PATHS; or PATH_ONLY_SOURCE), the SASS addresses whose source line is in
    the body of one of its functions."""
    found = {}
    for name, openings in (MARKED_PATHS if paths is None else paths).items():
        bodies = [(source, function_body_lines(source, opening)) for source, opening in openings]
        found[name] = frozenset(address for address, (path, line) in line_table.items()
                                if any(path.replace("\\", "/").endswith("/" + source) and line in body
                                       for source, body in bodies))
    return found


# Censuses made in this process, by (traits, dtype, arch, the compiled code's cache file): a walk costs up to minutes
# (d256's forward on sm_80) and the report and several tests ask for the same instance.
_censuses: dict[tuple, tuple[CensusRow, ...]] = {}


def instance_census(traits, dtype: str, arch: str, compiled=None) -> list[CensusRow]:
    """The census of ``traits``' instance for ``dtype`` on ``arch`` (compiled through the cache unless given): the
    plain row, then the marked paths' (MARKED_PATHS) where the main loop runs their source. Made once per process
    for each compiled code (the cache file names its bytes)."""
    compiled = compiled or _compiled(traits, dtype, arch)
    key = (traits, dtype, arch, compiled.code_path)
    if key not in _censuses:
        _censuses[key] = tuple(_instance_census(traits, dtype, arch, compiled))
    return list(_censuses[key])


def _compiled(traits, dtype: str, arch: str):
    """The instance compiled (through the cache) for what the catalog says it takes on ``arch`` (sm_90a for the
    Hopper kernels)."""
    from . import catalog, nvrtc

    instance = traits.instance(dtype)
    return nvrtc.compile_instance(instance, catalog.compile_arch(instance, arch))


def _tile(traits) -> str:
    """block_m x block_n x warps; the Hopper kernels' consumer warpgroups instead of warps (``2wg``)."""
    warps = getattr(traits, "warps", None)
    return f"{traits.block_m}x{traits.block_n}x" + (f"{warps}" if warps is not None else f"{traits.consumers}wg")


def _instance_census(traits, dtype: str, arch: str, compiled) -> list[CensusRow]:
    from . import nvrtc

    sass = nvrtc.dump_sass(compiled)
    if sass is None:
        raise RuntimeError("cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)")
    work = iteration_work(traits)
    tile = _tile(traits)
    line_table = nvrtc.dump_line_table(compiled)
    marks, path_only = marked_addresses(line_table), marked_addresses(line_table, PATH_ONLY_SOURCE)
    return [CensusRow(traits.instance(dtype).name_expr, arch, tile, work, path)
            for path in census(sass, work, marks, path_only)]


def softcap_work(work: IterationWork) -> IterationWork:
    """The iteration's work when every score is soft-capped: one more MUFU.EX2 per score, its tanh's (mask.cuh's
    tanh_by_exp2, and tanhf's polynomial, both take one). The built-in softcap sits behind a block-uniform test the
    plain walk skips, and a flex hook's mod behind per-score tests (the sequence bounds) whose early return is the
    cheapest walk; requiring the exponentials makes the walk run the tanh for every score but those few the
    walk's cap leaves (the counts compare like for like: both kernels' rows get the same requirement)."""
    return dataclasses.replace(work, exponentials=2 * work.exponentials)


def softcap_census(traits, dtype: str, arch: str, instance=None) -> CensusRow:
    """The softcap path of ``traits``' main loop: the cheapest walk issuing softcap_work. ``instance``: the kernel
    to compile (default: the plain instance, whose softcap is the built-in ScoreHook's; a cuflash.flex instance with
    a softcap score_mod for the comparison issue 29 item 6 bounds)."""
    from . import nvrtc

    instance = instance or traits.instance(dtype)
    compiled = nvrtc.compile_instance(instance, arch)
    key = ("softcap", traits, dtype, arch, compiled.code_path)
    if key not in _censuses:
        work = softcap_work(iteration_work(traits))
        path = census(nvrtc.dump_sass(compiled), work, {})[0]
        _censuses[key] = (CensusRow(instance.name_expr, arch, _tile(traits), work,
                                    dataclasses.replace(path, path="softcap")),)
    return _censuses[key][0]


@dataclass(frozen=True)
class LineCount:
    """The instructions one walked path issues from one source line (the innermost line of inlined code)."""

    source: str  # the path under cuda_src where it lies there, else as the line table gives it
    line: int
    instructions: int
    opcodes: dict[str, int]  # by opcode without modifiers, most issued first


def path_lines(sass: str, path: PathCensus, line_table: dict[int, tuple[str, int]]) -> list[LineCount]:
    """Where ``path``'s instructions come from: its walk (blocks as often as walked) by source line, most issued
    first; instructions the line table does not place count under source "?" line 0. The sum is the path's
    instruction count."""
    from .._paths import CUDA_SRC

    blocks = blocks_of(parse(sass))
    root = str(CUDA_SRC).replace("\\", "/").rstrip("/") + "/"
    by_line: dict[tuple[str, int], dict[str, int]] = {}
    for b in path.blocks:
        for ins in blocks[b].instructions:
            source, line = line_table.get(ins.address, ("?", 0))
            source = source.replace("\\", "/")
            key = (source[len(root):] if source.startswith(root) else source, line)
            opcodes = by_line.setdefault(key, {})
            opcodes[ins.base] = opcodes.get(ins.base, 0) + 1
    counts = [LineCount(source, line, sum(ops.values()), dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))))
              for (source, line), ops in by_line.items()]
    return sorted(counts, key=lambda c: (-c.instructions, c.source, c.line))


def format_lines(row: CensusRow, counts: Sequence[LineCount]) -> str:
    """One row's path by source line: count, file:line, the opcodes, and the line's text."""
    from .._paths import CUDA_SRC

    out = [f"{row.kernel} {row.arch} {row.tile} {row.path.path}: {row.path.instructions} instructions, "
           f"{row.path.hmma} HMMA"]
    texts: dict[str, list[str]] = {}
    for count in counts:
        if count.source not in texts:
            file = CUDA_SRC / count.source
            texts[count.source] = file.read_text().splitlines() if file.is_file() else []
        lines = texts[count.source]
        text = lines[count.line - 1].strip() if 0 < count.line <= len(lines) else ""
        ops = " ".join(f"{op} {n}" for op, n in list(count.opcodes.items())[:4])
        out.append(f"{count.instructions:6d}  {count.source}:{count.line}  [{ops}]  {text[:70]}")
    return "\n".join(out)


def _lines_of(traits, dtype: str, arch: str, row: CensusRow) -> list[LineCount]:
    from . import nvrtc

    compiled = _compiled(traits, dtype, arch)  # the cache's copy: instance_census compiled it
    return path_lines(nvrtc.dump_sass(compiled), row.path, nvrtc.dump_line_table(compiled))


def format_table(rows: Iterable[CensusRow]) -> str:
    headers = ("kernel", "arch", "tile", "path", "instr", "hmma", "instr/hmma", "instr/kflop", "ldsm", "ldgsts", "mem",
               "fp32", "mufu", "shfl", "bar", "branch", "int", "other", "loop static")
    table = [headers]
    for row in rows:
        c = row.path.classes
        table.append((row.kernel, row.arch, row.tile, row.path.path, str(row.path.instructions), str(row.path.hmma),
                      f"{row.path.instructions_per_hmma:.2f}", f"{row.instructions_per_kflop:.3f}", str(c["ldsm"]),
                      str(c["ldgsts"]), str(c["memory"]), str(c["fp32"]), str(c["mufu"]), str(c["shfl"]),
                      str(c["barrier"]), str(c["branch"]), str(c["integer"]), str(c["other"]),
                      str(row.path.loop_static_instructions)))
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    from . import targets

    parser = argparse.ArgumentParser(prog="python -m cuflash.kernels loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], choices=list(targets.TARGETS))
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    parser.add_argument("--kernels", default=None, help="only kernels whose name matches this regular expression")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--lines", action="store_true",
                        help="after the table, each row's path by source line (where its instructions come from)")
    args = parser.parse_args(argv)
    rows, failures, by_lines = [], [], []
    for arch in args.arch:
        for traits in tensor_core_traits(arch):
            for dtype in args.dtypes:
                name = traits.instance(dtype).name_expr
                if args.kernels and not re.search(args.kernels, name):
                    continue
                try:
                    found = instance_census(traits, dtype, arch)
                except (NoPathError, ValueError) as error:
                    failures.append(f"{name} ({arch}): {error}")
                    continue
                rows += found
                if args.lines:
                    by_lines += [(row, _lines_of(traits, dtype, arch, row)) for row in found]
    print(json.dumps([row.as_json() for row in rows], indent=1) if args.json else format_table(rows))
    for row, counts in by_lines:
        print()
        print(format_lines(row, counts))
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0
