"""FlashAttention-2 on tensor cores: the fa2 variant for float16 and bfloat16 inputs (sm_80 and newer).

Kernels: ``cuda_src/kernels/fa2_tc_forward.cu`` (its opening comment gives the work partition, the pipelining and
the traffic formula); shared pieces (swizzled tiles, cp.async loads, ldmatrix fragments, warp products) in
``fa2_tc_tiles.cuh``.

Programs
  forward:  one launch, ``fa2_tc_forward_kernel`` over (Q blocks, nheads, batch); writes out and lse.
  backward: the SIMT fa2 backward program (fa2.py) for now; it needs only q, k, v, out, dout and lse, which the
            tensor-core forward writes exactly as the SIMT one does.

Head dims: instances for 32, 64, 96, 128, 192, 256 (as the SIMT fa2); a head dim 1..256 runs on the next compiled
one, the extra columns zero-filled in shared memory and never read from global memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..program import CXX_ELEMENT_TYPES, KernelInstance, LaunchPlan, Problem, Program, ceil_div
from ..targets import TARGETS, Target
from . import fa2

NAME = "fa2"
DTYPES = ("float16", "bfloat16")
FORWARD_SOURCE = "kernels/fa2_tc_forward.cu"
HEAD_DIMS = fa2.HEAD_DIMS
MAX_DYNAMIC_SMEM = max(t.smem_per_block_bytes for t in TARGETS.values())
_ELEMENT_BYTES = 2


@dataclass(frozen=True)
class ForwardTraits:
    """fa2tc::ForwardTraits: a (block_m x block_n) tile, ``warps`` warps each owning block_m / warps query rows."""

    head_dim: int
    block_m: int
    block_n: int
    warps: int

    def __post_init__(self) -> None:
        if self.head_dim % 32 or not 32 <= self.head_dim <= fa2.MAX_HEADDIM:
            raise ValueError(f"compiled head dims are multiples of 32 up to {fa2.MAX_HEADDIM}, got {self.head_dim}")
        if self.block_m % (16 * self.warps):
            raise ValueError(f"{self}: each warp owns whole 16-row MMA strips (block_m % (16 * warps) == 0)")
        if self.block_n % 16:
            raise ValueError(f"{self}: block_n must be a multiple of 16 (k16 steps of P V)")
        if self.smem_bytes > MAX_DYNAMIC_SMEM:
            raise ValueError(f"{self} needs {self.smem_bytes} bytes of shared memory, more than any target allows")

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        # 16-bit Q [block_m][D], K and V [block_n][D], swizzled without padding.
        return (self.block_m + 2 * self.block_n) * self.head_dim * _ELEMENT_BYTES

    def instance(self, dtype: str) -> KernelInstance:
        if dtype not in DTYPES:
            raise ValueError(f"the tensor-core fa2 takes {DTYPES}, got {dtype!r}")
        return KernelInstance(
            FORWARD_SOURCE,
            f"cuflash::fa2_tc_forward_kernel<{CXX_ELEMENT_TYPES[dtype]}, {self.head_dim}, {self.block_m}, "
            f"{self.block_n}, {self.warps}>",
        )


# The forward tiles, from FA2's table for sm80/sm90 without dropout (../shared/notes/anchors.md), with 128-row Q
# blocks at every head dim but the largest (so K and V are read ceil(seqlen_q / 128) times per head). Where FA2's
# own tile makes ptxas spill here (d32 and d64 at 128 x 128, d128 at 128 x 64 with 4 warps: 16 to 84 bytes on
# sm_90), the table takes FA2's next tile (its dropout / sm86 rows): a narrower K/V block keeps the two 16-row
# strips per warp that let each K and V fragment feed two MMAs. Targets whose blocks may have 99 KB (sm_86,
# sm_89, sm_120) have their own rows, as in FA2: at d128, ptxas for sm_120 spills the 4-warp 128 x 32 tile, so
# those targets take 8 warps of one strip each. Where a head dim lists two tiles, forward_traits picks the one
# with more query rows resident per SM (by shared memory), ties to the smaller block: FA2's d256 choice
# (128 x 64 with 8 warps on A100, 64 x 64 with 4 warps and two blocks per SM on H100).
FORWARD_CHOICES = {
    32: (ForwardTraits(32, block_m=128, block_n=64, warps=4),),
    64: (ForwardTraits(64, block_m=128, block_n=64, warps=4),),
    96: (ForwardTraits(96, block_m=128, block_n=64, warps=4),),
    128: (ForwardTraits(128, block_m=128, block_n=32, warps=4),),
    192: (ForwardTraits(192, block_m=128, block_n=64, warps=8),),
    256: (ForwardTraits(256, block_m=128, block_n=64, warps=8), ForwardTraits(256, block_m=64, block_n=64, warps=4)),
}
FORWARD_CHOICES_99KB = {
    **FORWARD_CHOICES,
    128: (ForwardTraits(128, block_m=128, block_n=64, warps=8),),
    256: (ForwardTraits(256, block_m=64, block_n=64, warps=4),),
}
# The per-block shared-memory limit up to which a target takes the 99 KB rows.
SMALL_SMEM_LIMIT = 99 * 1024
assert tuple(FORWARD_CHOICES) == HEAD_DIMS and tuple(FORWARD_CHOICES_99KB) == HEAD_DIMS


def _resident_rows(traits: ForwardTraits, target: Target) -> int:
    blocks = target.smem_per_sm_bytes // (traits.smem_bytes + target.reserved_smem_per_block_bytes)
    return blocks * traits.block_m


def forward_traits(headdim: int, target: Target) -> ForwardTraits:
    table = FORWARD_CHOICES_99KB if target.smem_per_block_bytes <= SMALL_SMEM_LIMIT else FORWARD_CHOICES
    fitting = [t for t in table[fa2.compiled_head_dim(headdim)] if t.smem_bytes <= target.smem_per_block_bytes]
    if not fitting:
        raise ValueError(f"no tensor-core fa2 tile of head dim {headdim} fits {target.arch}'s shared memory")
    # max() keeps the first of equals: scan from the smallest block so ties go to it.
    return max(reversed(fitting), key=lambda t: _resident_rows(t, target))


def instances(target: Target) -> list[KernelInstance]:
    """Every instance the plans for ``target`` may launch (the backward's are the SIMT fa2 ones)."""
    found: list[KernelInstance] = []
    for dtype in DTYPES:
        found += [forward_traits(hd, target).instance(dtype) for hd in HEAD_DIMS]
        found += fa2.backward_instances(target, dtype)
    return found


_SHAPES = {
    traits.instance(dtype): (traits.smem_bytes, traits.threads)
    for dtype in DTYPES
    for table in (FORWARD_CHOICES, FORWARD_CHOICES_99KB)
    for choices in table.values()
    for traits in choices
}


def _shape(instance: KernelInstance) -> tuple[int, int]:
    found = _SHAPES.get(instance)
    if found is None:
        raise KeyError(f"{instance} is not a tensor-core fa2 kernel")
    return found


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    return _shape(instance)[0]


def threads(instance: KernelInstance) -> int:
    return _shape(instance)[1]


def forward_program(problem: Problem, target: Target) -> Program:
    traits = forward_traits(problem.headdim, target)
    grid = (ceil_div(problem.seqlen_q, traits.block_m), problem.nheads, problem.batch)
    launch = LaunchPlan(traits.instance(problem.dtype), fa2.check_grid(grid), (traits.threads, 1, 1), traits.smem_bytes)
    return Program(launches=(launch,))


def backward_program(problem: Problem, target: Target) -> Program:
    return fa2.backward_program(problem, target)


def forward_traffic(problem: Problem, target: Target) -> fa2.Traffic:
    traits = forward_traits(problem.headdim, target)
    return fa2.forward_traffic_of_tiles(problem, traits.block_m, traits.block_n)


def backward_traffic(problem: Problem, target: Target) -> tuple[fa2.Traffic, fa2.Traffic, fa2.Traffic]:
    return fa2.backward_traffic(problem, target)
