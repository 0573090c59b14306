"""Standard attention (the FlashAttention paper's Algorithm 0 and its standard backward) as a kernel family.

Every seqlen_q x seqlen_k matrix (S, P, dP, dS) is materialised in float32 scratch; the kernels are in
``cuda_src/kernels/standard_attention.cu``, whose opening comment describes the work partition.

Head dims: the matrix products treat the head dim as an ordinary runtime GEMM dimension (predicated tile
edges), so one instance per (kernel, dtype) runs every head dim; no head-dim specialisation is compiled and
``StandardTraits`` is the one launch choice for all of them.

Besides the KernelFamily protocol this module exports the kernels' exact global-memory traffic
(``forward_traffic`` / ``backward_traffic``), which the tests compare with the simulator's byte counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..program import CXX_ELEMENT_TYPES, KernelInstance
from ..program import LaunchPlan, Problem, Program, Scratch, ceil_div
from ..targets import Target

NAME = "standard"
SOURCE = "kernels/standard_attention.cu"

# CUDA's limit on gridDim.y and gridDim.z (heads and batch go there; tiles go in x, limit 2^31 - 1).
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 2**31 - 1
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class StandardTraits:
    """Tile shapes of the GEMM and row kernels; mirrors StandardGemmTraits / StandardRowTraits in the .cu."""

    threads_x: int = 16
    threads_y: int = 16
    outputs_per_thread_m: int = 4
    outputs_per_thread_n: int = 4
    block_k: int = 32
    stages: int = 2
    row_warps: int = 8
    row_cached_keys_per_lane: int = 32  # forward softmax rows up to 32 x this many keys stay in registers

    def __post_init__(self) -> None:
        if self.block_m != self.block_n:
            raise ValueError("the GEMM stages A and B through one square-tile layout: block_m must equal block_n")
        if self.block_k != 32:
            raise ValueError("k-contiguous staging maps one lane to one k: block_k must be the warp size")
        if self.gemm_threads % self.block_k or self.gemm_threads % self.block_m:
            raise ValueError("the staging maps must tile the thread block")
        if (self.block_m * self.block_k) % self.gemm_threads:
            raise ValueError("each thread must stage the same number of elements")
        if self.gemm_threads > 1024 or self.row_threads > 1024:
            raise ValueError("CUDA blocks hold at most 1024 threads")
        if self.stages != 2:
            raise ValueError("the GEMM main loop is written for double buffering")

    @property
    def gemm_threads(self) -> int:
        return self.threads_x * self.threads_y

    @property
    def block_m(self) -> int:
        return self.threads_y * self.outputs_per_thread_m

    @property
    def block_n(self) -> int:
        return self.threads_x * self.outputs_per_thread_n

    @property
    def gemm_smem_bytes(self) -> int:
        # stages x {A, B} x block_k rows of (block + 1) floats: the +1 avoids bank conflicts.
        return self.stages * 2 * self.block_k * (self.block_m + 1) * _FLOAT32_BYTES

    @property
    def row_threads(self) -> int:
        return self.row_warps * 32

    @property
    def rows_per_block(self) -> int:
        return self.row_warps

    @property
    def row_cached_keys(self) -> int:
        return 32 * self.row_cached_keys_per_lane


TRAITS = StandardTraits()


class _Product(NamedTuple):
    """One of the six matrix products: its kernel and how its M x N x K problem maps onto the attention shape."""

    kernel: str  # template name, instantiated per element type
    mask_skip: str  # "masked_tiles" | "keys" | "queries": MaskSkip in the .cu (see its file comment)
    a_is_matrix: bool  # A is a float32 seqlen_q x seqlen_k matrix (else an element tensor)
    b_is_matrix: bool
    c_is_matrix: bool  # C goes to scores (float32) rather than an element tensor
    over_kv_heads: bool  # grid.y runs over kv heads and K spans the group's query heads


_SCORES = _Product("standard_scores_kernel", "masked_tiles", False, False, True, False)
_OUT = _Product("standard_out_kernel", "keys", True, False, False, False)
_DP = _Product("standard_dp_kernel", "masked_tiles", False, False, True, False)
_DQ = _Product("standard_dq_kernel", "keys", True, False, False, False)
_DV = _Product("standard_dv_kernel", "queries", True, False, False, True)
_DK = _Product("standard_dk_kernel", "queries", True, False, False, True)
_PRODUCTS = (_SCORES, _OUT, _DP, _DQ, _DV, _DK)

_SOFTMAX_PASSES = ("kForward", "kRecompute", "kBackward")
_DOUT_DOT_OUT = "standard_dout_dot_out_kernel"


def _gemm_instance(product: _Product, dtype: str) -> KernelInstance:
    return KernelInstance(SOURCE, f"cuflash::{product.kernel}<{CXX_ELEMENT_TYPES[dtype]}>")


def _softmax_instance(softmax_pass: str) -> KernelInstance:
    # The softmax passes touch only float32 scratch, so they are not instantiated per element type.
    return KernelInstance(SOURCE, f"cuflash::standard_softmax_kernel<cuflash::SoftmaxPass::{softmax_pass}>")


def _dout_dot_out_instance(dtype: str) -> KernelInstance:
    return KernelInstance(SOURCE, f"cuflash::{_DOUT_DOT_OUT}<{CXX_ELEMENT_TYPES[dtype]}>")


def _instances() -> list[KernelInstance]:
    found = [_gemm_instance(product, dtype) for product in _PRODUCTS for dtype in CXX_ELEMENT_TYPES]
    found += [_dout_dot_out_instance(dtype) for dtype in CXX_ELEMENT_TYPES]
    found += [_softmax_instance(softmax_pass) for softmax_pass in _SOFTMAX_PASSES]
    return found


def instances(target: Target) -> list[KernelInstance]:
    """Every instance: the same on every target (the GEMM tiles need little shared memory)."""
    return _instances()


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    if instance not in _instances():
        raise KeyError(f"{instance} is not a standard-attention kernel")
    return TRAITS.gemm_smem_bytes if _is_gemm(instance) else 0


def threads(instance: KernelInstance) -> int:
    if instance not in _instances():
        raise KeyError(f"{instance} is not a standard-attention kernel")
    return TRAITS.gemm_threads if _is_gemm(instance) else TRAITS.row_threads


def _is_gemm(instance: KernelInstance) -> bool:
    return any(instance.name_expr.startswith(f"cuflash::{p.kernel}<") for p in _PRODUCTS)


# ---------------------------------------------------------------------------------------------------
# Launch plans.


def _gemm_mnk(product: _Product, problem: Problem) -> tuple[int, int, int]:
    """(M, N, K per group member) of a product."""
    sq, sk, d = problem.seqlen_q, problem.seqlen_k, problem.headdim
    if product in (_SCORES, _DP):
        return sq, sk, d
    if product in (_OUT, _DQ):
        return sq, d, sk
    return sk, d, sq  # dV, dK


def _check_grid(grid: tuple[int, int, int]) -> tuple[int, int, int]:
    if grid[0] > _MAX_GRID_X or grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"standard attention grid {grid} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
    return grid


def _gemm_launch(product: _Product, problem: Problem) -> LaunchPlan:
    m, n, _ = _gemm_mnk(product, problem)
    heads = problem.nheads_k if product.over_kv_heads else problem.nheads
    tiles = ceil_div(m, TRAITS.block_m) * ceil_div(n, TRAITS.block_n)
    return LaunchPlan(
        kernel=_gemm_instance(product, problem.dtype),
        grid=_check_grid((tiles, heads, problem.batch)),
        block=(TRAITS.threads_x, TRAITS.threads_y, 1),
        dynamic_smem_bytes=TRAITS.gemm_smem_bytes,
    )


def _row_launch(kernel: KernelInstance, problem: Problem) -> LaunchPlan:
    return LaunchPlan(
        kernel=kernel,
        grid=_check_grid((ceil_div(problem.seqlen_q, TRAITS.rows_per_block), problem.nheads, problem.batch)),
        block=(TRAITS.row_threads, 1, 1),
        dynamic_smem_bytes=0,
    )


def _matrix_scratch(problem: Problem, name: str) -> Scratch:
    return Scratch(name, (problem.batch, problem.nheads, problem.seqlen_q, problem.seqlen_k))


def forward_program(problem: Problem, target: Target) -> Program:
    """S = scale Q K^T -> scores; P = softmax(S), lse -> probs, lse; O = P V -> out."""
    return Program(
        launches=(
            _gemm_launch(_SCORES, problem),
            _row_launch(_softmax_instance("kForward"), problem),
            _gemm_launch(_OUT, problem),
        ),
        scratch=(_matrix_scratch(problem, "scores"), _matrix_scratch(problem, "probs")),
    )


def backward_program(problem: Problem, target: Target) -> Program:
    """Recompute S and P = exp(S - lse); dV = P^T dO; D = rowsum(dO O); dP = dO V^T; dS = P (dP - D);
    dQ = scale dS K; dK = scale dS^T Q. Always deterministic: no atomics (GQA sums run inside dV/dK blocks)."""
    return Program(
        launches=(
            _gemm_launch(_SCORES, problem),
            _row_launch(_softmax_instance("kRecompute"), problem),
            _gemm_launch(_DV, problem),
            _row_launch(_dout_dot_out_instance(problem.dtype), problem),
            _gemm_launch(_DP, problem),
            _row_launch(_softmax_instance("kBackward"), problem),
            _gemm_launch(_DQ, problem),
            _gemm_launch(_DK, problem),
        ),
        scratch=(
            _matrix_scratch(problem, "scores"),
            _matrix_scratch(problem, "probs"),
            Scratch("dout_dot_out", (problem.batch, problem.nheads, problem.seqlen_q)),
        ),
    )


# ---------------------------------------------------------------------------------------------------
# Exact global-memory traffic, launch by launch, as the kernels issue it.


class Traffic(NamedTuple):
    bytes_read: int
    bytes_written: int


def _k_range(product: _Product, problem: Problem, m0: int, n0: int) -> tuple[int, int]:
    """[begin, end) of the reduction for the tile at (m0, n0); mirrors tile_k_range in the .cu."""
    m, n, k = _gemm_mnk(product, problem)
    mask = problem.mask_policy
    m_end = min(m0 + TRAITS.block_m, m)
    if product.mask_skip == "masked_tiles":
        keys = mask.keys_of_rows(m0, m_end)
        return (0, k) if max(keys.begin, n0) < min(keys.end, n0 + TRAITS.block_n, n) else (0, 0)
    span = mask.keys_of_rows(m0, m_end) if product.mask_skip == "keys" else mask.rows_of_keys(m0, m_end)
    if span.empty:
        return 0, 0
    return span.begin // TRAITS.block_k * TRAITS.block_k, span.end


def gemm_traffic(product: _Product, problem: Problem) -> Traffic:
    """Bytes one product's launch reads and writes: every tile loads, per group member, its valid rows of A and
    columns of B over its reduction range, and stores its valid outputs once."""
    m, n, _ = _gemm_mnk(product, problem)
    element = _ELEMENT_BYTES[problem.dtype]
    a_bytes = _FLOAT32_BYTES if product.a_is_matrix else element
    b_bytes = _FLOAT32_BYTES if product.b_is_matrix else element
    c_bytes = _FLOAT32_BYTES if product.c_is_matrix else element
    group = problem.group_size if product.over_kv_heads else 1
    heads = problem.nheads_k if product.over_kv_heads else problem.nheads

    read_per_head = 0
    for m0 in range(0, m, TRAITS.block_m):
        rows = min(TRAITS.block_m, m - m0)
        for n0 in range(0, n, TRAITS.block_n):
            cols = min(TRAITS.block_n, n - n0)
            begin, end = _k_range(product, problem, m0, n0)
            depth = max(0, end - begin)
            read_per_head += group * depth * (rows * a_bytes + cols * b_bytes)
    instances = problem.batch * heads
    return Traffic(instances * read_per_head, instances * m * n * c_bytes)


def softmax_traffic(softmax_pass: str, problem: Problem) -> Traffic:
    rows = problem.batch * problem.nheads * problem.seqlen_q
    row_matrix = problem.seqlen_k * _FLOAT32_BYTES  # one row of scores or probs
    side = _FLOAT32_BYTES  # one lse or dout_dot_out value per row
    if softmax_pass == "kForward":  # S once if the row fits in registers, else twice; P and lse once
        reads_of_s = 1 if problem.seqlen_k <= TRAITS.row_cached_keys else 2
        return Traffic(rows * reads_of_s * row_matrix, rows * (row_matrix + side))
    if softmax_pass == "kRecompute":  # S and lse; P
        return Traffic(rows * (row_matrix + side), rows * row_matrix)
    if softmax_pass == "kBackward":  # P, dP and D; dS
        return Traffic(rows * (2 * row_matrix + side), rows * row_matrix)
    raise ValueError(f"unknown softmax pass {softmax_pass!r}")


def dout_dot_out_traffic(problem: Problem) -> Traffic:
    rows = problem.batch * problem.nheads * problem.seqlen_q
    return Traffic(rows * 2 * problem.headdim * _ELEMENT_BYTES[problem.dtype], rows * _FLOAT32_BYTES)


def forward_traffic(problem: Problem, target: Target) -> list[Traffic]:
    """One entry per launch of ``forward_program(problem)``, in order."""
    return [gemm_traffic(_SCORES, problem), softmax_traffic("kForward", problem), gemm_traffic(_OUT, problem)]


def backward_traffic(problem: Problem, target: Target) -> list[Traffic]:
    """One entry per launch of ``backward_program(problem)``, in order."""
    return [
        gemm_traffic(_SCORES, problem),
        softmax_traffic("kRecompute", problem),
        gemm_traffic(_DV, problem),
        dout_dot_out_traffic(problem),
        gemm_traffic(_DP, problem),
        softmax_traffic("kBackward", problem),
        gemm_traffic(_DQ, problem),
        gemm_traffic(_DK, problem),
    ]

