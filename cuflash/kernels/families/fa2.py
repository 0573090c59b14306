"""FlashAttention-2 (Dao 2023) as a kernel family: SIMT forward and backward.

Kernels: ``cuda_src/kernels/fa2_forward.cu`` and ``cuda_src/kernels/fa2_backward.cu`` (their opening comments give
the work partition, the traffic formulas and the masking rules); shared pieces in ``fa2_tiles.cuh``.

Programs
  forward:  one launch, ``fa2_forward_kernel`` over (Q blocks, nheads, batch); writes out and lse.
            Split-KV (num_kv_splits > 1: KV-cache decoding, or a fixed-length or varlen call's num_splits;
            ``forward_program_of_tiles``, both variants): the
            forward over (Q blocks x splits, nheads, batch) writes float32 partial results (``out_accum``,
            ``lse_accum``), then ``fa2_split_kv_combine_kernel`` merges them into out and lse.
  backward: ``fa2_dout_dot_out_kernel`` (D = rowsum(dO * O) into ``dout_dot_out``), ``fa2_backward_kernel`` over
            (K/V blocks, nheads_k, batch) (dK, dV on chip, dQ into float32 ``dq_accum``), then
            ``fa2_convert_dq_kernel`` (dq = scale * sum of dq_accum slices, in the element type).

Deterministic backward (FA2's rule): ``deterministic=True`` runs the main kernel over ``num_dq_splits`` blocks per
(kv head, batch) instead of one per K/V block; block x loops over K/V blocks x, x + S, x + 2S, ... (S =
``num_dq_splits``, ``num_dq_splits_for``: enough blocks to fill the target's SMs, at most one per K/V block, at
least 1) and adds its dQ parts into slice x of ``dq_accum`` (zero-filled), each element by the one thread that
owns it, in program order; the convert kernel sums each row's S slices in index order. So dq_accum is S x the
atomic mode's (linear in seqlen_q, independent of seqlen_k, and S * batch * nheads_k is about the SM count), the
main kernel moves the same bytes as the atomic mode, and the convert kernel reads S slices per row that sees a key
instead of one. The atomic mode is the same code with S = 1 and one block per K/V block (its loop runs once).

GQA/MQA backward: a block loops over the query heads of its kv head, so dK/dV of a group are summed on chip in a
fixed order (no per-query-head float32 dk/dv scratch, no reduction kernel, K/V read once per kv head); the cost is
nheads / nheads_k fewer blocks in flight.

Head dims: instances are compiled for FA2's head dims 32, 64, 96, 128, 192, 256; a head dim 1..256 runs on the
smallest compiled one >= it. The kernels read and write only the first ``headdim`` columns (tails are predicated
and zero-filled in shared memory), so their traffic is exact in the real head dim; the reductions over the head dim
stop at headdim rounded up to 4, the other products run over the padded width.

Besides the KernelFamily protocol this module exports the kernels' exact global traffic (``forward_traffic`` and
``backward_traffic``), which the tests compare with the simulator's byte counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from ..program import (CXX_ELEMENT_TYPES, MAX_KERNEL_HEADDIM_V, KernelInstance, LaunchPlan, Problem, Program,
                       Scratch, ceil_div)
from ..targets import TARGETS, Target

NAME = "fa2"
FORWARD_SOURCE = "kernels/fa2_forward.cu"
BACKWARD_SOURCE = "kernels/fa2_backward.cu"
SPLIT_KV_COMBINE_SOURCE = "kernels/fa2_split_kv_combine.cu"
# The most splits the combine kernel merges (fa2::SplitKvCombine::kMaxSplits), FA2's limit too.
MAX_KV_SPLITS = 128

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEADDIM = HEAD_DIMS[-1]
assert MAX_HEADDIM == MAX_KERNEL_HEADDIM_V  # the V column chunks (program.value_column_chunks) fit the tiles

# The most shared memory any target's block may have (sm_90: 227 KB); each plan checks its own target.
MAX_DYNAMIC_SMEM = max(t.smem_per_block_bytes for t in TARGETS.values())
# CUDA's limits on gridDim.x and on gridDim.y / gridDim.z.
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_F32 = 4

# The pre-pass and convert kernels: 128 threads over 16 rows (fa2::RowKernel in fa2_backward.cu).
ROW_KERNEL_THREADS = 128
ROW_KERNEL_ROWS = 16


def _pick_threads_n(m_granules: int, n_granules: int, threads: int) -> int:
    """Mirror of fa2::pick_threads_n (fa2_tiles.cuh): the widest thread-column count <= 32 that tiles evenly."""
    tn = 32
    while tn >= 1:
        if n_granules % tn == 0 and threads % tn == 0 and m_granules % (threads // tn) == 0:
            return tn
        tn //= 2
    return 0


@dataclass(frozen=True)
class TileTraits:
    """What forward and backward traits share (SIMT and tensor-core alike): sizes, thread count, the element types
    their kernels take, and the checks every tile must pass."""

    element_types: ClassVar[tuple[str, ...]] = tuple(CXX_ELEMENT_TYPES)

    head_dim: int
    block_m: int
    block_n: int
    warps: int

    def __post_init__(self) -> None:
        if self.head_dim % 32 or not 32 <= self.head_dim <= MAX_HEADDIM:
            raise ValueError(f"compiled head dims are multiples of 32 up to {MAX_HEADDIM}, got {self.head_dim}")
        self._check_tiles()
        if self.threads > 1024:
            raise ValueError("CUDA blocks hold at most 1024 threads")
        if self.smem_bytes > MAX_DYNAMIC_SMEM:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of shared memory, more than any target allows")

    def _check_tiles(self) -> None:
        raise NotImplementedError

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        raise NotImplementedError

    def _instance(self, source: str, kernel: str, dtype: str) -> KernelInstance:
        if dtype not in self.element_types:
            raise ValueError(f"{kernel} takes {self.element_types}, got {dtype!r}")
        return KernelInstance(
            source,
            f"cuflash::{kernel}<{CXX_ELEMENT_TYPES[dtype]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
            f"{self.warps}>",
        )


@dataclass(frozen=True)
class ForwardTraits(TileTraits):
    """fa2::ForwardTraits: tile sizes and warps of the forward kernel (rows per warp = block_m / warps)."""

    def _check_tiles(self) -> None:
        if self.block_m % self.warps:
            raise ValueError("each warp owns block_m / warps query rows")
        rows_per_warp = self.block_m // self.warps
        if rows_per_warp % 4:
            raise ValueError("a warp's lanes are 4 row groups x 8 columns: rows per warp must be a multiple of 4")
        if self.block_n % 32:
            raise ValueError("block_n must be a multiple of 32 (8 lane columns, float4 P rows)")

    @property
    def smem_bytes(self) -> int:
        # float32 Q [block_m][D+4], K and V [block_n][D+4], per-warp P slabs [block_m][block_n+4].
        row = self.head_dim + 4
        return _F32 * (self.block_m * row + 2 * self.block_n * row + self.block_m * (self.block_n + 4))

    def instance(self, dtype: str) -> KernelInstance:
        return self._instance(FORWARD_SOURCE, "fa2_forward_kernel", dtype)


@dataclass(frozen=True)
class BackwardTraits(TileTraits):
    """fa2::BackwardTraits: the K/V block (block_n keys) a thread block owns, the Q step (block_m rows), warps."""

    def _check_tiles(self) -> None:
        if self.block_m % 4 or self.block_n % 32 or self.block_m > self.threads:
            raise ValueError("block_m must be a multiple of 4 and at most the thread count; block_n of 32")
        # The three thread tilings of the .cu (S/dP, dK/dV, dQ) must divide evenly.
        for name, m, n in (
            ("S/dP", self.block_m, self.block_n),
            ("dK/dV", self.block_n // 4, self.head_dim // 4),
            ("dQ", self.block_m, self.head_dim // 4),
        ):
            if not _pick_threads_n(m, n, self.threads):
                raise ValueError(f"{self}: no even {name} thread tiling with {self.threads} threads")

    @property
    def smem_bytes(self) -> int:
        # float32 K, V [block_n][D+4]; Q, dO [block_m][D+4]; P, dS [block_m][block_n+4]; lse, D [block_m].
        row = self.head_dim + 4
        return _F32 * (
            2 * self.block_n * row + 2 * self.block_m * row + 2 * self.block_m * (self.block_n + 4) + 2 * self.block_m
        )

    def instance(self, dtype: str) -> KernelInstance:
        return self._instance(BACKWARD_SOURCE, "fa2_backward_kernel", dtype)

    def convert_instance(self, dtype: str) -> KernelInstance:
        return convert_dq_instance(dtype, self.block_n)


# The launch choice per compiled head dim (the why is in the .cu opening comments): FA2's tiles halved where a
# SIMT thread would otherwise hold too many float32 registers or the float32 tiles too much shared memory. The
# first row of a head dim that fits the target's shared memory per block is used: the second rows are for targets
# whose blocks may have 99 KB (sm_86, sm_89, sm_120), as FA2 keeps separate tiles for sm86/89.
FORWARD_CHOICES = {
    32: (ForwardTraits(32, block_m=64, block_n=64, warps=4),),
    64: (ForwardTraits(64, block_m=64, block_n=64, warps=4),),
    96: (ForwardTraits(96, block_m=64, block_n=32, warps=4),),
    128: (ForwardTraits(128, block_m=64, block_n=32, warps=4),),
    192: (ForwardTraits(192, block_m=64, block_n=32, warps=4), ForwardTraits(192, block_m=32, block_n=32, warps=4)),
    256: (ForwardTraits(256, block_m=64, block_n=32, warps=8), ForwardTraits(256, block_m=16, block_n=32, warps=4)),
}
BACKWARD_CHOICES = {
    32: (BackwardTraits(32, block_m=32, block_n=64, warps=4),),
    64: (BackwardTraits(64, block_m=32, block_n=64, warps=8),),
    96: (BackwardTraits(96, block_m=32, block_n=64, warps=4),),
    128: (BackwardTraits(128, block_m=32, block_n=64, warps=8), BackwardTraits(128, block_m=16, block_n=64, warps=8)),
    192: (BackwardTraits(192, block_m=16, block_n=64, warps=8), BackwardTraits(192, block_m=16, block_n=32, warps=4)),
    256: (BackwardTraits(256, block_m=32, block_n=32, warps=8), BackwardTraits(256, block_m=8, block_n=32, warps=8)),
}
assert tuple(FORWARD_CHOICES) == HEAD_DIMS and tuple(BACKWARD_CHOICES) == HEAD_DIMS


def compiled_head_dim(headdim: int) -> int:
    """The smallest compiled head dim >= headdim (the kernel predicates the rest)."""
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"fa2 supports head dims 1..{MAX_HEADDIM}, got {headdim}")
    return next(h for h in HEAD_DIMS if h >= headdim)


def tile_head_dim(problem: Problem) -> int:
    """The head dim a problem's tiles must hold: q's and k's, or v's where it is larger (MLA-style calls give v its
    own). The kernels read and write each tensor's own columns (attention_params.cuh's headdim, headdim_v)."""
    return max(problem.headdim, problem.headdim_v)


def fitting(choices: tuple[TileTraits, ...], target: Target) -> TileTraits:
    """The first tile of ``choices`` whose shared memory fits the target's block."""
    for traits in choices:
        if traits.smem_bytes <= target.smem_per_block_bytes:
            return traits
    raise ValueError(f"no fa2 tile of head dim {choices[0].head_dim} fits {target.arch}'s shared memory")


def forward_traits(headdim: int, target: Target) -> ForwardTraits:
    return fitting(FORWARD_CHOICES[compiled_head_dim(headdim)], target)


def backward_traits(headdim: int, target: Target) -> BackwardTraits:
    return fitting(BACKWARD_CHOICES[compiled_head_dim(headdim)], target)


def dout_dot_out_instance(dtype: str) -> KernelInstance:
    return KernelInstance(BACKWARD_SOURCE, f"cuflash::fa2_dout_dot_out_kernel<{CXX_ELEMENT_TYPES[dtype]}>")


def split_kv_combine_instance(dtype: str) -> KernelInstance:
    return KernelInstance(SPLIT_KV_COMBINE_SOURCE, f"cuflash::fa2_split_kv_combine_kernel<{CXX_ELEMENT_TYPES[dtype]}>")


def convert_dq_instance(dtype: str, block_n: int) -> KernelInstance:
    # Templated on block_n only: in split mode slice j is K/V block j, whatever the head dim.
    return KernelInstance(BACKWARD_SOURCE, f"cuflash::fa2_convert_dq_kernel<{CXX_ELEMENT_TYPES[dtype]}, {block_n}>")


# The element types the catalog sends to this SIMT variant; 16-bit inputs go to the tensor-core one (fa2_tc.py).
DTYPES = ("float32",)


def backward_instances(target: Target, dtype: str) -> list[KernelInstance]:
    """The backward program's instances for one element type on ``target``."""
    return backward_program_instances([backward_traits(hd, target) for hd in HEAD_DIMS], dtype)


def backward_program_instances(backward: list, dtype: str) -> list[KernelInstance]:
    """The instances of backward_program_for over the main-kernel tiles ``backward`` (SIMT or tensor-core): each
    main kernel, the pre-pass, and one convert kernel per block_n."""
    found = [traits.instance(dtype) for traits in backward]
    found.append(dout_dot_out_instance(dtype))
    found += [convert_dq_instance(dtype, n) for n in sorted({t.block_n for t in backward})]
    return found


def instances(target: Target) -> list[KernelInstance]:
    """Every instance the plans for ``target`` may launch with this variant's element types."""
    found: list[KernelInstance] = []
    for dtype in DTYPES:
        found += [forward_traits(hd, target).instance(dtype) for hd in HEAD_DIMS]
        found.append(split_kv_combine_instance(dtype))
        found += backward_instances(target, dtype)
    return found


def _shape_table() -> dict[KernelInstance, tuple[int, int]]:
    """(dynamic shared memory, threads) of every instance of every tile choice (the pre-pass and convert
    kernels use no shared memory)."""
    table: dict[KernelInstance, tuple[int, int]] = {}
    for dtype in CXX_ELEMENT_TYPES:
        for choices in FORWARD_CHOICES.values():
            table.update((traits.instance(dtype), (traits.smem_bytes, traits.threads)) for traits in choices)
        for choices in BACKWARD_CHOICES.values():
            for traits in choices:
                table[traits.instance(dtype)] = (traits.smem_bytes, traits.threads)
                table[traits.convert_instance(dtype)] = (0, ROW_KERNEL_THREADS)
        table[dout_dot_out_instance(dtype)] = (0, ROW_KERNEL_THREADS)
        table[split_kv_combine_instance(dtype)] = (0, ROW_KERNEL_THREADS)
    return table


_SHAPES = _shape_table()


def _shape(instance: KernelInstance) -> tuple[int, int]:
    try:
        return _SHAPES[instance]
    except KeyError:
        raise KeyError(f"{instance} is not an fa2 kernel") from None


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    return _shape(instance)[0]


def threads(instance: KernelInstance) -> int:
    return _shape(instance)[1]


# ---------------------------------------------------------------------------------------------------
# Launch plans.


def check_grid(grid: tuple[int, int, int]) -> tuple[int, int, int]:
    if grid[0] > _MAX_GRID_X or grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"fa2 grid {grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
    return grid


def _row_kernel_launch(kernel: KernelInstance, problem: Problem) -> LaunchPlan:
    grid = (ceil_div(problem.seqlen_q, ROW_KERNEL_ROWS), problem.nheads, problem.batch)
    return LaunchPlan(kernel, check_grid(grid), (ROW_KERNEL_THREADS, 1, 1), 0)


def tile_traits(problem: Problem, target: Target, direction: str):
    """The traits of the main kernel of ``problem``'s ``direction``: the one choice its programs, its traffic and a
    block mask's lists (made for its tiles) take."""
    return (backward_traits if direction == "backward" else forward_traits)(tile_head_dim(problem), target)


def forward_program(problem: Problem, target: Target) -> Program:
    traits = tile_traits(problem, target, "forward")
    return forward_program_of_tiles(problem, target, traits, traits.instance(problem.dtype))


def forward_program_of_tiles(problem: Problem, target: Target, traits, instance: KernelInstance) -> Program:
    """The forward of ``traits`` (SIMT or tensor-core: block_m, block_n, threads, smem_bytes) running ``instance``:
    one launch, or with split-KV the split forward and the combine kernel, with their float32 scratch."""
    splits = num_kv_splits(problem, target, traits.block_m, traits.block_n)
    grid = (ceil_div(problem.seqlen_q, traits.block_m) * splits, problem.nheads, problem.batch)
    launch = LaunchPlan(instance, check_grid(grid), (traits.threads, 1, 1), traits.smem_bytes)
    if splits == 1:
        return Program(launches=(launch,))
    combine = _row_kernel_launch(split_kv_combine_instance(problem.dtype), problem)
    # Every split writes every row of its partial results (0 and -inf where it saw no key), so no fill is needed.
    scratch = (Scratch("out_accum", (splits, problem.rows_q, problem.nheads, problem.headdim_v)),
               Scratch("lse_accum", (splits, *problem.row_stats_shape)))
    return Program(launches=(launch, combine), scratch=scratch, num_kv_splits=splits)


def num_kv_splits(problem: Problem, target: Target, block_m: int, block_n: int) -> int:
    """How many splits a forward over (block_m x block_n) tiles runs: 1 when asked; the asked number (at most one
    split per K/V block); or for num_splits = 0 FA2's heuristic on the target's SMs (a varlen batch's grid: its
    sequences x the longest's Q blocks, its K/V blocks the longest's)."""
    if problem.num_splits == 1:
        return 1
    kv_blocks = ceil_div(problem.seqlen_k, block_n)
    if problem.num_splits > 0:
        return max(1, min(problem.num_splits, kv_blocks, MAX_KV_SPLITS))
    blocks = problem.batch * problem.nheads * ceil_div(problem.seqlen_q, block_m)
    return split_heuristic(blocks, target.sm_count, kv_blocks)


def split_heuristic(blocks: int, sm_count: int, kv_blocks: int, max_splits: int = MAX_KV_SPLITS) -> int:
    """FA2's split count (as its paper's flash-decoding heuristic describes it): none when the unsplit grid
    already fills 80% of the SMs; otherwise the fewest splits whose last wave is nearly as full as the best
    choice's (efficiency >= 85% of the best, efficiency = waves / ceil(waves)), among the counts that change how
    many K/V blocks a split gets (ceil(kv_blocks / s) differs from s - 1's)."""
    if blocks <= 0 or kv_blocks <= 1 or blocks >= 0.8 * sm_count:
        return 1
    max_splits = min(max_splits, sm_count, kv_blocks)

    def useful(s: int) -> bool:
        return s == 1 or ceil_div(kv_blocks, s) != ceil_div(kv_blocks, s - 1)

    def efficiency(s: int) -> float:
        waves = blocks * s / sm_count
        return waves / math.ceil(waves)

    candidates = [s for s in range(1, max_splits + 1) if useful(s)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


def num_dq_splits(problem: Problem, target: Target) -> int:
    return num_dq_splits_for(problem, tile_traits(problem, target, "backward"), target)


def num_dq_splits_for(problem: Problem, traits, target: Target) -> int:
    """dq_accum slices, one per main-kernel block along grid.x: 1 in atomic mode; when deterministic, FA2's count,
    enough blocks to fill the target's SMs (the grid's y and z are nheads_k and batch) but at most one per K/V
    block, so the scratch never grows with seqlen_k."""
    if not problem.deterministic:
        return 1
    kv_blocks = ceil_div(problem.seqlen_k, traits.block_n)
    heads = problem.batch * problem.nheads_k
    return max(1, min(kv_blocks, ceil_div(target.sm_count, max(heads, 1))))


def backward_main_grid(problem: Problem, traits, target: Target) -> tuple[int, int, int]:
    """The main kernel's grid: a block per K/V block (atomic mode) or per dq_accum slice (deterministic: each
    block loops over every num_dq_splits-th K/V block), per kv head and batch."""
    blocks_x = ceil_div(problem.seqlen_k, traits.block_n)
    if problem.deterministic:
        blocks_x = min(blocks_x, num_dq_splits_for(problem, traits, target))
    return check_grid((blocks_x, problem.nheads_k, problem.batch))


def backward_program(problem: Problem, target: Target) -> Program:
    return backward_program_for(problem, tile_traits(problem, target, "backward"), target)


def backward_program_for(problem: Problem, traits, target: Target) -> Program:
    """The three-launch backward (pre-pass, the main kernel of ``traits``, convert) and its scratch; ``traits`` is
    a SIMT BackwardTraits or a tensor-core one (fa2_tc.py): anything with instance(dtype), convert_instance(dtype),
    threads, smem_bytes, block_m and block_n."""
    if problem.kvcache:
        raise ValueError("a KV cache is for the forward only (attention_with_kvcache has no backward)")
    splits = num_dq_splits_for(problem, traits, target)
    main_grid = backward_main_grid(problem, traits, target)
    launches = (
        _row_kernel_launch(dout_dot_out_instance(problem.dtype), problem),
        LaunchPlan(traits.instance(problem.dtype), main_grid, (traits.threads, 1, 1), traits.smem_bytes),
        _row_kernel_launch(traits.convert_instance(problem.dtype), problem),
    )
    scratch = (
        Scratch("dout_dot_out", problem.row_stats_shape),
        # Every slice is accumulated into (by atomics or by its one block's adds) and so starts at 0; the convert
        # kernel reads all of a row's slices, including those no visited K/V block added to.
        Scratch("dq_accum", (splits, problem.rows_q, problem.nheads, problem.headdim), zero_init=True),
    )
    return Program(launches=launches, scratch=scratch, num_dq_splits=splits)


# ---------------------------------------------------------------------------------------------------
# Exact global traffic of each launch (what the simulator's counters must show), from the formulas in the
# kernels' opening comments.


class Traffic(NamedTuple):
    read: int
    written: int


def _rows(total: int, block: int, index: int) -> int:
    return min(block, total - index * block)


def forward_traffic(problem: Problem, target: Target) -> Traffic:
    traits = tile_traits(problem, target, "forward")
    return forward_traffic_of_tiles(problem, traits.block_m, traits.block_n)


def forward_traffic_of_tiles(problem: Problem, block_m: int, block_n: int) -> Traffic:
    """The traffic of an FA2 forward with (block_m x block_n) tiles: each Q block that sees a key reads its rows
    of Q and the keys of its visible K/V blocks once; out and lse are written once (SIMT and tensor-core alike)."""
    es, d, dv = _ELEMENT_BYTES[problem.dtype], problem.headdim, problem.headdim_v
    mask = problem.mask_policy
    read = 0
    for i in range(ceil_div(problem.seqlen_q, block_m)):
        rows = _rows(problem.seqlen_q, block_m, i)
        blocks = mask.kv_blocks(block_n, i * block_m, i * block_m + rows)
        if not blocks.empty:
            # K/V blocks are whole blocks of the range, clipped at seqlen_k.
            keys_read = min(problem.seqlen_k, blocks.end * block_n) - blocks.begin * block_n
            read += rows * d * es + keys_read * (d + dv) * es
    heads = problem.batch * problem.nheads
    written = heads * problem.seqlen_q * (dv * es + _F32)
    return Traffic(read * heads, written)


def backward_traffic(problem: Problem, target: Target) -> tuple[Traffic, Traffic, Traffic]:
    return backward_traffic_for(problem, tile_traits(problem, target, "backward"), target)


def backward_traffic_for(problem: Problem, traits, target: Target,
                         reads_unseen_kv: bool = True) -> tuple[Traffic, Traffic, Traffic]:
    """(pre-pass, main kernel, convert kernel) of backward_program_for(problem, traits, target): the SIMT and
    tensor-core main kernels move the same bytes for the same tiles, in either dq mode. reads_unseen_kv=False: the
    main kernel reads no K/V block that no query sees (the Hopper backward's producer skips it; its dK and dV are
    still written, zeros)."""
    es, d, dv = _ELEMENT_BYTES[problem.dtype], problem.headdim, problem.headdim_v
    sq, sk = problem.seqlen_q, problem.seqlen_k
    bh = problem.batch * problem.nheads
    splits = num_dq_splits_for(problem, traits, target)
    pre = Traffic(2 * bh * sq * dv * es, bh * sq * _F32)  # dO and O

    read = written = 0
    for j in range(ceil_div(sk, traits.block_n)):
        keys = _rows(sk, traits.block_n, j)
        q_blocks = problem.mask_policy.q_blocks(traits.block_m, j * traits.block_n, j * traits.block_n + keys)
        rows = sum(_rows(sq, traits.block_m, i) for i in range(*q_blocks))
        kv_read = keys * (d + dv) * es if rows or reads_unseen_kv else 0
        read += kv_read + rows * ((d + dv) * es + 2 * _F32) * problem.group_size  # K, V; Q, dO
        dq_bytes = rows * d * _F32 * problem.group_size
        read += dq_bytes  # red.add reads what it adds to
        written += dq_bytes + keys * (d + dv) * es  # dK, dV
    main = Traffic(read * problem.batch * problem.nheads_k, written * problem.batch * problem.nheads_k)

    # dq_slices_of_row in the .cu: every slice for a row that sees a key, none for one that sees none.
    rows_seeing_keys = sum(1 for row in range(sq) if not problem.mask_policy.kv_blocks(traits.block_n, row,
                                                                                       row + 1).empty)
    convert = Traffic(bh * rows_seeing_keys * splits * d * _F32, bh * sq * d * es)
    return pre, main, convert
