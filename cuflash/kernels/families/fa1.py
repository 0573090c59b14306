"""FlashAttention-1 (Algorithm 1 forward, Algorithm 4 backward of the FlashAttention paper).

Kernels: cuda_src/kernels/fa1_forward.cu, fa1_backward.cu (their opening comments give the
work partition and the exact global-memory traffic, which ``forward_traffic`` /
``backward_traffic`` below restate for the tests).

Tile sizes. The paper sizes its blocks from the on-chip memory M (in floats):
Bc = ceil(M / 4d), Br = min(Bc, d), and its IO analysis (Theta(N^2 d^2 / M) bytes)
rewards the largest M. We evaluate that rule per compiled head dim with M as large as one
thread block of the target may have (``BUDGETS``, largest first; a plan takes the first
whose tiles all fit the target's shared memory per block):
  163 KB targets (sm_80, sm_87; sm_90 and sm_100 run the same tiles):
    forward  M = 40960 floats (160 KiB): it keeps Q_i, K_j, V_j (3 d-wide tiles) + S
    backward M = 20480 floats  (80 KiB): it keeps Q_i, dO_i, K_j, V_j, dK_j, dV_j (6) + P, dS
  99 KB targets (sm_86, sm_89, sm_120): M = 24576 and 12288 floats.
The kernels hold tiles in float32, hence floats and not elements. The price is one
resident block (4 warps) per SM: these SIMT kernels exist to show FA1's memory traffic,
and a 48 KiB budget (3 blocks per SM) would triple its O, l, m round trips
(GPT-2 medium forward + backward: 56 GB instead of 18 GB at head dim 64).
tests/test_fa1.py checks the tables against the rule and each budget's bound.

Head dims. Compiled for 32, 64, ..., 256 (multiples of 32). Head dim d runs on the
smallest compiled one >= d: the kernels zero columns d..HeadDim-1 in shared memory and
never load or store them in global memory (so traffic scales with d, not HeadDim).

GQA/MQA backward: each query-head block writes float32 dK/dV partials (dk_accum,
dv_accum) and fa1_gqa_reduce_kernel sums each group in head order; MHA writes dk/dv
directly. The backward is deterministic either way (no atomics), so ``deterministic``
changes nothing here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..program import CXX_ELEMENT_TYPES, ELEMENT_DTYPES, KernelInstance, LaunchPlan, Problem, Program, Scratch, ceil_div
from ..targets import TARGETS, Target

NAME = "fa1"

FORWARD_SOURCE = "kernels/fa1_forward.cu"
BACKWARD_SOURCE = "kernels/fa1_backward.cu"

THREADS = 128  # fa1::kThreads
REDUCE_THREADS = 256  # fa1_gqa_reduce_kernel's block
# The paper's M (forward, backward), in floats, largest first: 163 KB blocks, then 99 KB ones.
BUDGETS = ((40960, 20480), (24576, 12288))
SMEM_LIMIT_BYTES = max(t.smem_per_block_bytes for t in TARGETS.values())  # the most any target allows
FLOAT_BYTES = 4
HEAD_DIMS = tuple(range(32, 257, 32))


def paper_block_sizes(head_dim: int, budget_floats: int) -> tuple[int, int]:
    """(Br, Bc) by the FlashAttention paper's rule: Bc = ceil(M / 4d), Br = min(Bc, d)."""
    block_cols = math.ceil(budget_floats / (4 * head_dim))
    return min(block_cols, head_dim), block_cols


@dataclass(frozen=True)
class Fa1Tile:
    """One kernel's tile shape: Br query rows x Bc keys over a compiled head dim."""

    head_dim: int  # compiled (padded) head dim
    block_rows: int  # Br
    block_cols: int  # Bc
    backward: bool

    def __post_init__(self) -> None:
        if self.head_dim % 32 or not 32 <= self.head_dim <= 256:
            raise ValueError(f"compiled head dims are multiples of 32 in 32..256, got {self.head_dim}")
        if not 1 <= self.block_rows <= THREADS:
            raise ValueError(f"Br must be in 1..{THREADS} (one thread per query row), got {self.block_rows}")
        if self.block_cols < 1:
            raise ValueError(f"Bc must be >= 1, got {self.block_cols}")
        if self.smem_bytes > SMEM_LIMIT_BYTES:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of shared memory > {SMEM_LIMIT_BYTES}")

    @property
    def smem_bytes(self) -> int:
        """Fa1ForwardTraits / Fa1BackwardTraits::kSmemBytes (the kernels trap on less)."""
        tile_stride = self.head_dim + 1
        score_stride = self.block_cols + 1
        br, bc, hd = self.block_rows, self.block_cols, self.head_dim
        if self.backward:
            floats = 2 * br * tile_stride + 2 * bc * tile_stride + 2 * bc * hd + 2 * br * score_stride + 2 * br
        else:
            floats = br * tile_stride + 2 * bc * tile_stride + br * score_stride + 2 * br
        return floats * FLOAT_BYTES


def tiles_for_budget(forward_floats: int, backward_floats: int) -> dict[int, tuple[Fa1Tile, Fa1Tile]]:
    """Compiled head dim -> (forward tile, backward tile): the paper's rule at these budgets."""
    return {
        hd: (Fa1Tile(hd, *paper_block_sizes(hd, forward_floats), False),
             Fa1Tile(hd, *paper_block_sizes(hd, backward_floats), True))
        for hd in HEAD_DIMS
    }


TILE_TABLES = tuple(tiles_for_budget(*budget) for budget in BUDGETS)


def tiles(target: Target) -> dict[int, tuple[Fa1Tile, Fa1Tile]]:
    """The largest-budget table whose every tile fits the target's shared memory per block."""
    for table in TILE_TABLES:
        if all(t.smem_bytes <= target.smem_per_block_bytes for pair in table.values() for t in pair):
            return table
    raise ValueError(f"no fa1 tile table fits {target.arch}'s {target.smem_per_block_bytes} bytes per block")


def compiled_head_dim(headdim: int) -> int:
    """The smallest compiled head dim >= headdim (the kernel predicates the tail)."""
    for hd in HEAD_DIMS:
        if headdim <= hd:
            if headdim < 1:
                raise ValueError(f"fa1: head dim must be >= 1, got {headdim}")
            return hd
    raise ValueError(f"fa1: head dim {headdim} > {HEAD_DIMS[-1]}, the largest compiled one")


def _kernel(source: str, name: str, dtype: str, tile: Fa1Tile) -> KernelInstance:
    cxx = CXX_ELEMENT_TYPES[dtype]
    return KernelInstance(
        source, f"cuflash::{name}<{cxx}, {tile.head_dim}, {tile.block_rows}, {tile.block_cols}>"
    )


def forward_kernel(dtype: str, tile: Fa1Tile) -> KernelInstance:
    return _kernel(FORWARD_SOURCE, "fa1_forward_kernel", dtype, tile)


def backward_kernel(dtype: str, tile: Fa1Tile) -> KernelInstance:
    return _kernel(BACKWARD_SOURCE, "fa1_backward_kernel", dtype, tile)


def gqa_reduce_kernel(dtype: str) -> KernelInstance:
    return KernelInstance(BACKWARD_SOURCE, f"cuflash::fa1_gqa_reduce_kernel<{CXX_ELEMENT_TYPES[dtype]}>")


# CUDA's limits on gridDim.x and on gridDim.y / gridDim.z.
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535


def _plan(kernel: KernelInstance, grid: tuple[int, int, int], threads: int, smem: int) -> LaunchPlan:
    if grid[0] > _MAX_GRID_X or grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"fa1 grid {grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
    return LaunchPlan(kernel, grid, (threads, 1, 1), smem)


def _smem_table() -> dict[KernelInstance, int]:
    table = {}
    for dtype in ELEMENT_DTYPES:
        for tile_table in TILE_TABLES:
            for fwd, bwd in tile_table.values():
                table[forward_kernel(dtype, fwd)] = fwd.smem_bytes
                table[backward_kernel(dtype, bwd)] = bwd.smem_bytes
        table[gqa_reduce_kernel(dtype)] = 0
    return table


_SMEM = _smem_table()


def instances(target: Target) -> list[KernelInstance]:
    """Every instance the plans for ``target`` may launch."""
    found = []
    for dtype in ELEMENT_DTYPES:
        for fwd, bwd in tiles(target).values():
            found += [forward_kernel(dtype, fwd), backward_kernel(dtype, bwd)]
        found.append(gqa_reduce_kernel(dtype))
    return found


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    return _SMEM[instance]


def threads(instance: KernelInstance) -> int:
    return REDUCE_THREADS if instance in (gqa_reduce_kernel(dtype) for dtype in ELEMENT_DTYPES) else THREADS


def forward_program(problem: Problem, target: Target) -> Program:
    kernel = forward_kernel(problem.dtype, tiles(target)[compiled_head_dim(problem.headdim)][0])
    # seqlen_q == 0: nothing to write, an empty grid. seqlen_k == 0 still launches:
    # every row then sees no key and the kernel writes out = 0, lse = -inf.
    grid = (problem.nheads, problem.batch, 1 if problem.seqlen_q else 0)
    rows = (problem.batch, problem.nheads, problem.seqlen_q)
    return Program(
        launches=(_plan(kernel, grid, THREADS, _SMEM[kernel]),),
        scratch=(
            # Algorithm 1, line 2: O = 0, l = 0 (m = 0 is read as -inf while l = 0).
            Scratch("out_accum", (problem.batch, problem.seqlen_q, problem.nheads, problem.headdim), zero_init=True),
            Scratch("row_sum", rows, zero_init=True),
            Scratch("row_max", rows, zero_init=True),
        ),
    )


def backward_program(problem: Problem, target: Target) -> Program:
    kernel = backward_kernel(problem.dtype, tiles(target)[compiled_head_dim(problem.headdim)][1])
    grouped = problem.nheads != problem.nheads_k
    anything = problem.seqlen_q > 0 or problem.seqlen_k > 0
    launches = [_plan(kernel, (problem.nheads, problem.batch, 1 if anything else 0), THREADS, _SMEM[kernel])]
    scratch = [
        # Algorithm 4, line 6: dQ = 0 in global memory.
        Scratch("dq_accum", (1, problem.batch, problem.seqlen_q, problem.nheads, problem.headdim), zero_init=True),
    ]
    if grouped:
        partial = (problem.batch, problem.seqlen_k, problem.nheads, problem.headdim)
        # Every element is written by its query head's block before the reduction reads it.
        scratch += [Scratch("dk_accum", partial), Scratch("dv_accum", partial)]
        per_batch = problem.seqlen_k * problem.nheads_k * problem.headdim
        reduce = gqa_reduce_kernel(problem.dtype)
        launches.append(_plan(reduce, (ceil_div(per_batch, REDUCE_THREADS), problem.batch, 1), REDUCE_THREADS, 0))
    return Program(launches=tuple(launches), scratch=tuple(scratch))


# ---------------------------------------------------------------------------
# The kernels' global-memory traffic (their opening comments), for tests and benchmarks.


def _visits(problem: Problem, block_rows: int, block_cols: int) -> list[tuple[int, int]]:
    """(rows_i, n_i) per Q block: its row count and how many K/V blocks it visits (mask policy)."""
    sq = problem.seqlen_q
    mask = problem.mask_policy
    result = []
    for q_block in range(ceil_div(sq, block_rows)):
        row0 = q_block * block_rows
        rows = min(block_rows, sq - row0)
        result.append((rows, len(mask.kv_blocks(block_cols, row0, row0 + rows))))
    return result


def _keys_loaded(problem: Problem, block_cols: int) -> int:
    """Keys whose K and V rows the kernel loads: those of the K/V blocks any row visits, clipped at seqlen_k."""
    seen = problem.mask_policy.kv_blocks(block_cols, 0, problem.seqlen_q)
    return 0 if seen.empty else min(problem.seqlen_k, seen.end * block_cols) - seen.begin * block_cols


def _element_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def forward_traffic(problem: Problem, target: Target) -> tuple[int, int]:
    """(bytes read, bytes written) by the forward launch, per fa1_forward.cu's formula."""
    if problem.seqlen_q == 0:
        return 0, 0
    tile = tiles(target)[compiled_head_dim(problem.headdim)][0]
    e, d = _element_bytes(problem.dtype), problem.headdim
    visits = _visits(problem, tile.block_rows, tile.block_cols)
    row_visits = sum(rows * seen for rows, seen in visits)
    row_revisits = sum(rows * max(seen - 1, 0) for rows, seen in visits)
    heads = problem.batch * problem.nheads
    read = heads * (2 * _keys_loaded(problem, tile.block_cols) * d * e + row_visits * (d * e + 4 * (d + 2)))
    written = heads * (row_revisits * 4 * (d + 2) + problem.seqlen_q * (d * e + 4))
    return read, written


def backward_traffic(problem: Problem, target: Target) -> list[tuple[int, int]]:
    """(bytes read, bytes written) per backward launch, per fa1_backward.cu's formulas."""
    tile = tiles(target)[compiled_head_dim(problem.headdim)][1]
    e, d = _element_bytes(problem.dtype), problem.headdim
    grouped = problem.nheads != problem.nheads_k
    visits = _visits(problem, tile.block_rows, tile.block_cols)
    row_visits = sum(rows * seen for rows, seen in visits)
    row_revisits = sum(rows * max(seen - 1, 0) for rows, seen in visits)
    heads = problem.batch * problem.nheads
    kv_bytes = 2 * _keys_loaded(problem, tile.block_cols) * d * e
    dkv_element = 4 if grouped else e
    read = heads * (kv_bytes + row_visits * (3 * d * e + 4 + 4 * d))
    written = heads * (row_revisits * 4 * d + problem.seqlen_q * d * e + 2 * problem.seqlen_k * d * dkv_element)
    result = [(read, written)]
    if grouped and problem.batch * problem.seqlen_k * problem.headdim:  # else its grid is empty: no launch
        result.append(
            (heads * problem.seqlen_k * d * 8, problem.batch * problem.nheads_k * problem.seqlen_k * d * 2 * e)
        )
    return result
