"""FlashAttention-2 on tensor cores: the fa2 variant for float16 and bfloat16 inputs (sm_80 and newer).

Kernels: ``cuda_src/kernels/fa2_tc_forward.cu`` and ``fa2_tc_backward.cu`` (their opening comments give the work
partition, the pipelining and the traffic formulas); shared pieces (swizzled tiles, cp.async loads, ldmatrix
fragments, warp products) in ``fa2_tc_tiles.cuh``.

Programs
  forward:  one launch, ``fa2_tc_forward_kernel`` over (Q blocks, nheads, batch); writes out and lse.
  backward: the fa2 three-launch program (fa2.py) with ``fa2_tc_backward_kernel`` as its main kernel: the SIMT
            pre-pass D = rowsum(dO * O), the tensor-core main kernel over (K/V blocks, nheads_k, batch) (dK, dV on
            chip, dQ into float32 ``dq_accum`` by atomics; deterministic: over (dq slices, nheads_k, batch), each
            block looping over K/V blocks and adding into its own slice), the SIMT convert kernel (dq = scale * sum
            of slices). Same grid, scratch, slice rules and traffic formula as the SIMT backward with these tiles.

Head dims: instances for 32, 64, 96, 128, 192, 256 (as the SIMT fa2); a head dim 1..256 runs on the next compiled
one, the extra columns zero-filled in shared memory and never read from global memory.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..program import KernelInstance, Problem, Program
from ..targets import Target
from . import fa2

NAME = "fa2"
DTYPES = ("float16", "bfloat16")
FORWARD_SOURCE = "kernels/fa2_tc_forward.cu"
BACKWARD_SOURCE = "kernels/fa2_tc_backward.cu"
HEAD_DIMS = fa2.HEAD_DIMS
_ELEMENT_BYTES = 2


def _with_dropout(instance: KernelInstance, dropout: bool) -> KernelInstance:
    """The kernels' last template flag, WithDropout (default false, so instances without it keep their names)."""
    return KernelInstance(instance.source, instance.name_expr[:-1] + ", true>") if dropout else instance


@dataclass(frozen=True)
class ForwardTraits(fa2.TileTraits):
    """fa2tc::ForwardTraits: a (block_m x block_n) tile, ``warps`` warps each owning block_m / warps query rows;
    ``dropout``: the instance with dropout (the kernel's WithDropout flag)."""

    element_types = DTYPES
    dropout: bool = False

    def _check_tiles(self) -> None:
        if self.block_m % (16 * self.warps):
            raise ValueError(f"{self}: each warp owns whole 16-row MMA strips (block_m % (16 * warps) == 0)")
        if self.block_n % 16:
            raise ValueError(f"{self}: block_n must be a multiple of 16 (k16 steps of P V)")

    @property
    def smem_bytes(self) -> int:
        # 16-bit Q [block_m][D], K and V [block_n][D], swizzled without padding.
        return (self.block_m + 2 * self.block_n) * self.head_dim * _ELEMENT_BYTES

    def instance(self, dtype: str) -> KernelInstance:
        return _with_dropout(self._instance(FORWARD_SOURCE, "fa2_tc_forward_kernel", dtype), self.dropout)


# The forward tiles, from FA2's table for sm80/sm90 without dropout (../shared/notes/anchors.md), with 128-row Q
# blocks at every head dim but the largest (so K and V are read ceil(seqlen_q / 128) times per head). Where FA2's
# own tile makes ptxas spill here (d32 and d64 at 128 x 128, d128 at 128 x 64 with 4 warps: 16 to 84 bytes on
# sm_90), the table takes FA2's next tile (its dropout / sm86 rows): a narrower K/V block keeps the two 16-row
# strips per warp that let each K and V fragment feed two MMAs. Targets whose blocks may have 99 KB (sm_86,
# sm_89, sm_120) have their own rows, as in FA2: at d128, ptxas for sm_120 spills the 4-warp 128 x 32 tile, so
# those targets take 8 warps of one strip each, and at d96 too (128 x 64 with 4 warps spilled 28 bytes on sm_120
# once the K/V loads learned paged caches). Where a head dim lists two tiles, forward_traits picks the one
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
    96: (ForwardTraits(96, block_m=128, block_n=64, warps=8),),
    128: (ForwardTraits(128, block_m=128, block_n=64, warps=8),),
    256: (ForwardTraits(256, block_m=64, block_n=64, warps=4),),
}
# With dropout (FA2 also compiles it as a template flag, with its own tile rows): FA2's rows, 128 x 64 at d64 and
# d96 and 128 x 32 at d128, on 4 warps of two 16-row strips (each K and V fragment feeds two MMAs). They spilled
# here until the loads stepped their rows and the score hook left the per-score loop (this table then held
# 128 x 32 at d64 and one strip per warp, 8 warps, at d96 and d128: 1.15, 1.74 and 1.52 times the shared-memory
# wavefronts of a 256 x 256 launch on the simulator); now 214 to 254 registers, no spills, under NVRTC 13.5 and
# 12.9 on every target. d192 keeps 128 x 64 on 8 warps (FA2's 64 x 64 would read K and V twice as often), d256
# 64 x 64 with 4 warps. One table for every target: all fit 99 KB.
FORWARD_CHOICES_DROPOUT = {
    32: (ForwardTraits(32, block_m=128, block_n=64, warps=4, dropout=True),),
    64: (ForwardTraits(64, block_m=128, block_n=64, warps=4, dropout=True),),
    96: (ForwardTraits(96, block_m=128, block_n=64, warps=4, dropout=True),),
    128: (ForwardTraits(128, block_m=128, block_n=32, warps=4, dropout=True),),
    192: (ForwardTraits(192, block_m=128, block_n=64, warps=8, dropout=True),),
    256: (ForwardTraits(256, block_m=64, block_n=64, warps=4, dropout=True),),
}
# The per-block shared-memory limit up to which a target takes the 99 KB rows.
SMALL_SMEM_LIMIT = 99 * 1024
assert tuple(FORWARD_CHOICES) == HEAD_DIMS and tuple(FORWARD_CHOICES_99KB) == HEAD_DIMS
assert tuple(FORWARD_CHOICES_DROPOUT) == HEAD_DIMS


def _resident_rows(traits: ForwardTraits, target: Target) -> int:
    blocks = target.smem_per_sm_bytes // (traits.smem_bytes + target.reserved_smem_per_block_bytes)
    return blocks * traits.block_m


def forward_traits(headdim: int, target: Target, dropout: bool = False) -> ForwardTraits:
    if dropout:
        table = FORWARD_CHOICES_DROPOUT
    else:
        table = FORWARD_CHOICES_99KB if target.smem_per_block_bytes <= SMALL_SMEM_LIMIT else FORWARD_CHOICES
    fitting = [t for t in table[fa2.compiled_head_dim(headdim)] if t.smem_bytes <= target.smem_per_block_bytes]
    if not fitting:
        raise ValueError(f"no tensor-core fa2 tile of head dim {headdim} fits {target.arch}'s shared memory")
    # max() keeps the first of equals: scan from the smallest block so ties go to it.
    return max(reversed(fitting), key=lambda t: _resident_rows(t, target))


def pick_warps_m(rows: int, cols: int, warps: int, square: bool = True) -> int:
    """Mirror of fa2tc::pick_warps_m (fa2_tc_backward.cu): how many warps split the rows of a product so each warp
    owns whole 16-row strips and an even number of n8 tiles: with ``square`` the squarest such warp tile (fewest
    ldmatrix per k16 step, rows / 16 + cols / 16 per warp; ties to more warps along the rows), else the most warps
    along the rows; 0 if none does."""
    best, best_loads = 0, 0
    for wm in range(warps, 0, -1):
        if warps % wm or rows % (16 * wm) or cols % (16 * (warps // wm)):
            continue
        loads = rows // wm // 16 + cols // (warps // wm) // 16
        if not best or (square and loads < best_loads):
            best, best_loads = wm, loads
    return best


@dataclass(frozen=True)
class BackwardTraits(fa2.TileTraits):
    """fa2tc::BackwardTraits: the K/V block (block_n keys) a thread block owns, the Q step (block_m rows), warps;
    ``dropout``: the instance with dropout (the kernel's WithDropout flag); ``spills_on``: targets whose ptxas spills
    this tile (the evidence in the table's comments), which take the table's next choice; ``spills_under_cuda12_on``:
    the same where the installed NVRTC is CUDA 12's."""

    element_types = DTYPES
    dropout: bool = False
    spills_on: tuple[str, ...] = ()
    spills_under_cuda12_on: tuple[str, ...] = ()

    def _check_tiles(self) -> None:
        if self.block_m % 16 or self.block_n % 32 or self.block_m > self.threads:
            raise ValueError(f"{self}: block_m must be a multiple of 16 and at most the thread count, block_n of 32")
        for name, rows, cols in (("S/dP", self.block_m, self.block_n), ("dK/dV", self.block_n, self.head_dim),
                                 ("dQ", self.block_m, self.head_dim)):
            if not pick_warps_m(rows, cols, self.warps):
                raise ValueError(f"{self}: no {name} warp tiling of whole strips and n8-tile pairs")

    @property
    def smem_bytes(self) -> int:
        # 16-bit K, V [block_n][D]; two Q buffers (double-buffered) and dO [block_m][D]; P, dS [block_m][block_n];
        # float32 lse, D [block_m].
        d, m, n = self.head_dim, self.block_m, self.block_n
        return _ELEMENT_BYTES * (2 * n * d + 3 * m * d + 2 * m * n) + 2 * 4 * m

    def instance(self, dtype: str) -> KernelInstance:
        return _with_dropout(self._instance(BACKWARD_SOURCE, "fa2_tc_backward_kernel", dtype), self.dropout)

    def convert_instance(self, dtype: str) -> KernelInstance:
        return fa2.convert_dq_instance(dtype, self.block_n)


# The backward tiles (Q step x K/V block), 8 warps, from FA2's table (anchors.md) for blocks of at most 99 KB:
# 64 x 128 up to head dim 64, 64 x 64 at 96 and 128; at 96 and 128, FA2's 64 x 128 where a block may take its 116.5
# and 144.5 KB. At 192 and 256 FA2's 64 x 64 makes ptxas spill here (16 to 24 bytes on sm_80 / sm_90: dK + dV
# alone are 96 / 128 floats per thread), so the Q step halves instead (32 x 64,
# keeping the K/V block and so the number of dQ updates and Q/dO re-reads); at 256 the 99 KB targets take 32 x 32
# with 4 warps (32 x 64 needs 120 KB with Q double-buffered). The same tiles with dropout, but at d256 only 32 x 32
# on 4 warps (32 x 64 on 8 spills 4 to 8 bytes on sm_80 / sm_90 with dropout's ring offsets; d192's fits since the
# Q/dO pipeline flattened the head and Q-block loops: before, it took 32 x 32 too, reading Q and dO and updating dQ
# twice as often).
BACKWARD_CHOICES = {
    32: (BackwardTraits(32, block_m=64, block_n=128, warps=8),),
    # d64 takes FA2's 128-key K/V block since the lean step (issue [lean] 3): 64x128x8 issued 951 instructions per
    # step for 160 HMMA (5.94 per HMMA on sm_80, 6.11 on sm_90) where 64x64x8 issued 660 for 80 (8.25, 8.58), at
    # 224-232 registers without spills (it spilled 4 bytes on sm_90 before the step lost its LaneOffsets), in
    # 90.6 KB of shared memory, which every target's block has; one block per SM either way (registers). With the
    # lane bases held and the step's rows carried (StepRows): 744 (4.65) and 766 (4.79), 245 registers.
    # FA2's own d64 tile, 128 x 128 (a 128-row Q step: the same K/V block, Q/dO reads and dQ adds, twice the MMAs
    # per step), where a block may take its 145 KB and ptxas fits it: NVRTC 13, sm_90, 1236 instructions per step
    # for 320 HMMA (3.86 per HMMA, against 4.39 at 64 x 128; masked 4.64 against 5.23), 255 registers, no spills
    # under NVRTC 13 and 12.9. At the register limit the fit is ptxas's: sm_80 spills 12 bytes under 12.9 (clean
    # under 13: 3.79), sm_87 8 (12.9) and sm_100 16 (12.9), and every variant tried (dQ chunks of 2, lane bases
    # rebuilt, Q rows not stepped) spilled on another of them; so only sm_90 takes it. Not with dropout (60 to 624
    # bytes spilled).
    # With the square warp tiles and the copies' whole-chunk test as a bit (fa2_tc_tiles.cuh), 12.9 spilled sm_90's
    # too (8 bytes): under CUDA 12 every target takes 64 x 128. Under CUDA 13 every target whose block has 145 KB
    # takes 128 x 128 since then (NVRTC 13.5: 254-255 registers, no spills on sm_80, sm_87, sm_90 and sm_100; sm_80
    # 1123 instructions per step for 320 HMMA, 3.51 per HMMA against 3.97 at 64 x 128, masked 1227).
    64: (BackwardTraits(64, block_m=128, block_n=128, warps=8,
                        spills_under_cuda12_on=("sm_80", "sm_87", "sm_90", "sm_90a", "sm_100")),
         BackwardTraits(64, block_m=64, block_n=128, warps=8)),
    # d96: FA2's 64 x 128 where a block has its 116.5 KB (the 99 KB targets keep 64 x 64), with or without dropout:
    # the loop census's step (NVRTC 13.5, sm_80, plain) 808 instructions for 240 HMMA (3.37 per HMMA; sm_90 822)
    # where 64 x 64 issues 546 for 120 (4.55; 563), and each Q and dO block read and dQ block added half as often
    # per FLOP; 237-255 registers without spills under NVRTC 13.5 and 12.9 on sm_80, sm_87, sm_90 and sm_100 (64 x
    # 64: 178-188); one block of 8 warps per SM either way (registers).
    96: (BackwardTraits(96, block_m=64, block_n=128, warps=8), BackwardTraits(96, block_m=64, block_n=64, warps=8)),
    # d128: FA2's 64 x 128 (NVRTC 13, fp16 and bf16 alike) issues 1059 instructions per step for 320 HMMA on sm_80
    # (3.31 per HMMA) and 1081 on sm_90 (3.38), where 64 x 64 issues 662 for 160 (4.14) and 678 (4.24); it reads
    # each Q and dO block and adds each dQ block half as often per FLOP. 254-255 registers without spills under
    # NVRTC 13 and 12.9 on sm_80, sm_87 and sm_90 with dQ in column chunks of 4 n8 tiles (of 8, sm_90 spilled 8
    # bytes); sm_100's ptxas (13) spills 8 bytes, so it keeps 64 x 64, as do the 99 KB targets (sm_86, sm_89,
    # sm_120). One block of 8 warps per SM either way (registers), 144.5 KB of shared memory against 82 KB.
    128: (BackwardTraits(128, block_m=64, block_n=128, warps=8, spills_on=("sm_100",)),
          BackwardTraits(128, block_m=64, block_n=64, warps=8)),
    192: (BackwardTraits(192, block_m=32, block_n=64, warps=8),),
    256: (BackwardTraits(256, block_m=32, block_n=64, warps=8), BackwardTraits(256, block_m=32, block_n=32, warps=4)),
}
assert tuple(BACKWARD_CHOICES) == HEAD_DIMS
BACKWARD_CHOICES_DROPOUT = {
    **{hd: tuple(dataclasses.replace(t, dropout=True) for t in choices) for hd, choices in BACKWARD_CHOICES.items()},
    # d64 keeps 64 x 128 and d128 64 x 64 with dropout: the larger steps run at the register limit without
    # dropout's keep bits.
    64: (BackwardTraits(64, block_m=64, block_n=128, warps=8, dropout=True),),
    128: (BackwardTraits(128, block_m=64, block_n=64, warps=8, dropout=True),),
    256: (BackwardTraits(256, block_m=32, block_n=32, warps=4, dropout=True),),
}


def backward_traits(headdim: int, target: Target, dropout: bool = False) -> BackwardTraits:
    table = BACKWARD_CHOICES_DROPOUT if dropout else BACKWARD_CHOICES
    cuda12 = _nvrtc_major() == 12
    choices = tuple(t for t in table[fa2.compiled_head_dim(headdim)]
                    if target.arch not in t.spills_on and not (cuda12 and target.arch in t.spills_under_cuda12_on))
    return fa2.fitting(choices, target)


@functools.lru_cache(maxsize=1)
def _nvrtc_major() -> int | None:
    """The installed NVRTC's CUDA major version (the compiler the plans' instances are built with); None without
    one (the simulator alone: the plans of CUDA 13). Once per process: planning asks at every backward plan."""
    from .. import nvrtc

    try:
        return nvrtc.nvrtc_version()[0]
    except nvrtc.NvrtcError:
        return None


def instances(target: Target) -> list[KernelInstance]:
    """Every instance the plans for ``target`` may launch."""
    found: list[KernelInstance] = []
    for dtype in DTYPES:
        backward = []
        for dropout in (False, True):
            found += [forward_traits(hd, target, dropout).instance(dtype) for hd in HEAD_DIMS]
            backward += [backward_traits(hd, target, dropout) for hd in HEAD_DIMS]
        found.append(fa2.split_kv_combine_instance(dtype))
        found += fa2.backward_program_instances(backward, dtype)
    return found


_SHAPES = {
    traits.instance(dtype): (traits.smem_bytes, traits.threads)
    for dtype in DTYPES
    for table in (FORWARD_CHOICES, FORWARD_CHOICES_99KB, FORWARD_CHOICES_DROPOUT, BACKWARD_CHOICES,
                  BACKWARD_CHOICES_DROPOUT)
    for choices in table.values()
    for traits in choices
}
# The SIMT pre-pass and convert kernels of the backward program (no shared memory).
_SHAPES.update(
    (instance, (0, fa2.ROW_KERNEL_THREADS))
    for dtype in DTYPES
    for instance in (
        fa2.dout_dot_out_instance(dtype),
        fa2.split_kv_combine_instance(dtype),
        *(fa2.convert_dq_instance(dtype, t.block_n) for table in (BACKWARD_CHOICES, BACKWARD_CHOICES_DROPOUT)
          for choices in table.values() for t in choices),
    )
)


def _shape(instance: KernelInstance) -> tuple[int, int]:
    found = _SHAPES.get(instance)
    if found is None:
        raise KeyError(f"{instance} is not a tensor-core fa2 kernel")
    return found


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    return _shape(instance)[0]


def threads(instance: KernelInstance) -> int:
    return _shape(instance)[1]


def _dropout(problem: Problem) -> bool:
    return problem.dropout_p > 0.0


def tile_traits(problem: Problem, target: Target, direction: str):
    """The traits of the main kernel of ``problem``'s ``direction``: the one choice its programs, its traffic and a
    block mask's lists (made for its tiles) take."""
    traits_for = backward_traits if direction == "backward" else forward_traits
    return traits_for(fa2.tile_head_dim(problem), target, _dropout(problem))


def forward_program(problem: Problem, target: Target) -> Program:
    traits = tile_traits(problem, target, "forward")
    return fa2.forward_program_of_tiles(problem, target, traits, traits.instance(problem.dtype))


def backward_program(problem: Problem, target: Target) -> Program:
    traits = tile_traits(problem, target, "backward")
    return fa2.backward_program_for(problem, traits, target)


def forward_traffic(problem: Problem, target: Target) -> fa2.Traffic:
    traits = tile_traits(problem, target, "forward")
    return fa2.forward_traffic_of_tiles(problem, traits.block_m, traits.block_n)


def backward_traffic(problem: Problem, target: Target) -> tuple[fa2.Traffic, fa2.Traffic, fa2.Traffic]:
    traits = tile_traits(problem, target, "backward")
    return fa2.backward_traffic_for(problem, traits, target)
