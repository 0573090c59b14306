"""The warp-specialized Hopper forward (FlashAttention-3's structure): the fa2 forward's wgmma twin for sm_90a.

Kernel: ``cuda_src/kernels/fa3_forward.cu`` (its opening comment gives the warp roles, the pipeline and the traffic,
which is the FA2 forward's for the same tiles: ``fa2.forward_traffic_of_tiles``); tiles, shared-memory layout and the
producer's copy in ``fa3_forward_traits.cuh``.

Program: one launch, ``fa3_forward_kernel`` over (Q blocks, nheads, batch), 1 producer + block_m / 64 consumer
warpgroups; writes out and lse. With split-KV (a call's num_splits) grid.x holds the splits too and fa2's
combine kernel follows (fa2.forward_program_of_tiles: the same program shape and scratch as fa2's). TMA boxes for q,
k and v unless a paged cache's pages do not hold whole K/V blocks (then the load path, a page lookup per row).

In the catalog as the forward of fa2's first variant, ``hopper`` (hopper.py; its backward is fa3_backward.py, with its
own rule): on a sm_90 target (a device, or the simulator under ``sim.targeting("sm_90")``) fa2's forward runs it for
the problems ``supports`` accepts: 16-bit inputs at head dims 1..256 (on 64, 128, 192 or 256), any mask (none, causal,
sliding windows), softcap and ALiBi (the hooked instances), GQA/MQA, any seqlens, varlen batches, KV caches
(contiguous, indexed, paged), split-KV, attention sinks (joined in the epilogue) and v with a head dim of its own (the
tile holds the larger; out's columns past v's are not written; MLA's 192 / 128 has a tile of its own,
``NARROW_V_CHOICES``) and a user's flex mods (cuflash.flex builds them into the hooked instance of the head dim's
tile: its Hook template argument, with or without a block mask); ``refusal`` says why any other problem (dropout)
stays on the mma.sync kernels (fa2_tc). Either backward (the Hopper one or fa2_tc's) takes this forward's out and
lse as they are (lse: float32 [batch][nheads][seqlen_q], natural log, the same AttentionParams fields).

Compiled for sm_90a (``compile_arch``): wgmma and setmaxnreg exist only in the arch-specific code, and a sm_90a CUBIN
runs on the sm_90 devices it is for (same major.minor); the report and the census compile it so on sm_90 too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from .. import catalog
from ..program import CXX_ELEMENT_TYPES, KernelInstance, Problem, Program, TmaBox
from ..targets import Target
from . import fa2

SOURCE = "kernels/fa3_forward.cu"
DTYPES = ("float16", "bfloat16")
ARCHS = ("sm_90", "sm_90a")  # wgmma and setmaxnreg exist only in sm_90a code
_ELEMENT_BYTES = 2
_WARPGROUP_THREADS = 128


@dataclass(frozen=True)
class WarpgroupTraits:
    """What the Hopper kernels' traits share: a (block_m x block_n) tile at ``head_dim`` in whole 64-column panels,
    ring buffers of ``stages``, one producer warpgroup and 1 to 3 consumer warpgroups of 64 each along the tile side
    ``CONSUMER_SIDE`` names, v's tensors (V and O, or V, dO and dV) at ``head_dim_v`` columns where the tile gives v
    a narrower width of its own (MLA; the kernels' HeadDimV). A subclass names its kernel, that side, and checks and
    sizes the rest."""

    head_dim: int
    block_m: int
    block_n: int
    stages: int = 2
    hooked: bool = False  # the instance applies the score hook (softcap, ALiBi): the kernels' Hooked flag
    head_dim_v: int = 0  # 0: head_dim's

    KERNEL: ClassVar[str]
    SOURCE: ClassVar[str]
    CONSUMER_SIDE: ClassVar[str]  # "block_m" (the forward's query rows) or "block_n" (the backward's keys)

    def __post_init__(self) -> None:
        if self.head_dim % 64 or not 64 <= self.head_dim <= 256:
            raise ValueError(f"{self}: head dims of whole 64-column panels up to 256")
        side = getattr(self, self.CONSUMER_SIDE)
        if side % 64 or not 1 <= side // 64 <= 3:
            raise ValueError(f"{self}: 1 to 3 consumer warpgroups of 64 ({self.CONSUMER_SIDE})")
        if self.stages < 2:
            raise ValueError(f"{self}: at least 2 stages")
        if self.head_dim_v and (self.head_dim_v % 64 or not 64 <= self.head_dim_v < self.head_dim):
            raise ValueError(f"{self}: head_dim_v whole 64-column panels, narrower than head_dim (0: the same)")

    @property
    def v_head_dim(self) -> int:
        """v's tensors' columns in the tile."""
        return self.head_dim_v or self.head_dim

    @property
    def consumers(self) -> int:
        return getattr(self, self.CONSUMER_SIDE) // 64

    @property
    def threads(self) -> int:
        return (1 + self.consumers) * _WARPGROUP_THREADS

    def instance(self, dtype: str) -> KernelInstance:
        if dtype not in DTYPES:
            raise ValueError(f"{self.KERNEL} takes {DTYPES}, got {dtype!r}")
        return KernelInstance(
            self.SOURCE,
            f"cuflash::{self.KERNEL}<{CXX_ELEMENT_TYPES[dtype]}, {self.head_dim}, {self.block_m}, {self.block_n}, "
            f"{', '.join((str(self.stages), *self.template_flags()))}>",
        )

    def template_flags(self) -> tuple[str, ...]:
        """The kernel's trailing bool template arguments past their defaults: Hooked."""
        return ("true",) if self.hooked else ()

    def all_template_flags(self) -> tuple[str, ...]:
        """Every template argument past Stages and before the kernel's Hook (template_flags: those past their
        defaults)."""
        raise NotImplementedError

    def flex_prefix(self, dtype: str) -> str:
        """The name of this tile's instance with a user's mods up to its Hook (KernelInstance.flex_prefix): every
        template argument before the Hook spelled out."""
        spelled = self.all_template_flags()[len(self.template_flags()):]
        return self.instance(dtype).name_expr[:-1] + "".join(f", {flag}" for flag in spelled)


@dataclass(frozen=True)
class ForwardTraits(WarpgroupTraits):
    """fa3::ForwardTraits: block_m / 64 consumer warpgroups of query rows, K/V in a ring of ``stages`` buffers."""

    KERNEL: ClassVar[str] = "fa3_forward_kernel"
    SOURCE: ClassVar[str] = SOURCE
    CONSUMER_SIDE: ClassVar[str] = "block_m"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"{self}: block_n a multiple of 16 up to 256 (wgmma N)")

    @property
    def smem_bytes(self) -> int:
        # 16-bit Q [block_m][D], K [stages][block_n][D] and V [stages][block_n][Dv], then 1 + 4 stages mbarriers of 8
        # bytes.
        tiles = (self.block_m * self.head_dim + self.stages * self.block_n * (self.head_dim + self.v_head_dim))
        return tiles * _ELEMENT_BYTES + 8 * (1 + 4 * self.stages)

    def template_flags(self) -> tuple[str, ...]:
        """Hooked past its default, then HeadDimV where v's width is its own."""
        if not self.head_dim_v:
            return super().template_flags()
        return self.all_template_flags()

    def all_template_flags(self) -> tuple[str, ...]:
        """Hooked, HeadDimV."""
        return ("true" if self.hooked else "false", str(self.v_head_dim))


# The tiles, (masked, no mask) per head dim, from FA3's table (hopper.md): d128 128 x 128 causal and local, 128 x 176
# without a mask (208 KB of shared memory with two stages), two consumers; d64 192 x 128 causal, three consumers;
# d256 128 x 80 both ways (two consumers, 224 KB: O alone is 128 floats a thread); d192 128 x 112 (FA3's 128 x 128
# needs 240 KB with two stages, past the 227 KB a block may have: 112 is the widest that fits, 216 KB).
# FA3's d64 192 x 192 without a mask holds S (96 floats), P (48) and O (32) per thread where three consumers get 160
# registers: NVRTC 13.5 spills 400 bytes and serializes the wgmma (C7512), so d64 takes 192 x 128 both ways.
FORWARD_CHOICES = {
    64: (ForwardTraits(64, block_m=192, block_n=128), ForwardTraits(64, block_m=192, block_n=128)),
    128: (ForwardTraits(128, block_m=128, block_n=128), ForwardTraits(128, block_m=128, block_n=176)),
    192: (ForwardTraits(192, block_m=128, block_n=112), ForwardTraits(192, block_m=128, block_n=112)),
    256: (ForwardTraits(256, block_m=128, block_n=80), ForwardTraits(256, block_m=128, block_n=80)),
}
HEAD_DIMS = tuple(FORWARD_CHOICES)
# Problems with softcap or ALiBi run the hooked instance of the masked tile, masked or not: one more instance per
# head dim and dtype, not two (each costs NVRTC seconds), and the narrower tile leaves the hook's registers room.
# d64 takes two consumers (128 x 128, 232 registers each): at three (160) the hook's step spilled 68 bytes.
HOOKED_CHOICES = {d: replace(masked, hooked=True) for d, (masked, _) in FORWARD_CHOICES.items()}
HOOKED_CHOICES[64] = ForwardTraits(64, block_m=128, block_n=128, hooked=True)
# v narrower than q and k, by (q's compiled head dim, v's widest): MLA's 192 / 128 (DeepSeek's prefill) on FA3's
# 128 x 128 for it, masked or not (208 KB with two stages: V takes a third less than at 192). On the d192 tile P V
# would multiply 64 columns of zeros (a fifth of the FLOPs) and O hold 96 floats a thread where 64 do. Softcap and
# ALiBi keep the hooked d192 tile (one instance fewer per dtype).
NARROW_V_CHOICES = {(192, 128): ForwardTraits(192, block_m=128, block_n=128, head_dim_v=128)}


def compiled_head_dim(headdim: int) -> int:
    """The smallest compiled head dim >= headdim (the kernel zero-fills the columns past it)."""
    return min(d for d in HEAD_DIMS if d >= headdim)


def compile_arch(arch: str) -> str:
    """What NVRTC compiles these instances for where a device of ``arch`` gets ``arch`` code: the arch-specific
    sm_90a (compute_90a for PTX), the only code with wgmma and setmaxnreg."""
    return {"sm_90": "sm_90a", "compute_90": "compute_90a"}.get(arch, arch)


# The options beyond masked attention the forward serves, as the catalog's hopper variant lists them: the score
# hook's (mask.cuh's ScoreHook: softcap, ALiBi), run by the hooked instances, and where the rows are (varlen, KV
# caches contiguous and paged: block_info.cuh) and which keys a block takes (split-KV: mask.cuh's split_kv_blocks,
# then fa2's combine kernel), runtime fields of every instance, and a user's flex mods (the Hook of an instance
# cuflash.flex builds from the hooked one). The backward's own rule (fa3_backward.refusal) says which it takes.
SERVED_OPTIONS = next(v for v in catalog.variants("fa2") if v.module_name == "cuflash.kernels.families.hopper").options
HOOK_OPTIONS = frozenset({"softcap", "alibi"})
# The options run on the hooked tile: the score hook's, and flex mods (a FlexHook in place of the ScoreHook: their
# scores take the registers the hook's do).
HOOKED_TILE_OPTIONS = HOOK_OPTIONS | {"flex"}


def refusal(problem: Problem, target: Target) -> str | None:
    """Why this kernel does not compute ``problem``'s forward on ``target`` (None: it does). It needs sm_90, 16-bit,
    head dims 1..256 (q's and k's, v's its own or the same), and no option but SERVED_OPTIONS (dropout stays on
    mma.sync); any mask."""
    if target.arch not in ARCHS:
        return f"wgmma needs sm_90, not {target.arch}"
    if problem.dtype not in DTYPES:
        return f"takes {'/'.join(DTYPES)}, not {problem.dtype}"
    if not 1 <= fa2.tile_head_dim(problem) <= HEAD_DIMS[-1]:
        return f"head dims 1..{HEAD_DIMS[-1]} only, not {fa2.tile_head_dim(problem)}"
    unserved = problem.options - SERVED_OPTIONS
    if unserved:
        return f"no {', '.join(sorted(unserved))} yet"
    return None


def supports(problem: Problem, target: Target) -> bool:
    """Whether this kernel computes ``problem``'s forward on ``target`` (``refusal`` says why not)."""
    return refusal(problem, target) is None


def forward_traits(problem: Problem, target: Target) -> ForwardTraits:
    if not supports(problem, target):
        raise ValueError(f"the Hopper forward does not serve {problem} on {target.arch}")
    head_dim = compiled_head_dim(fa2.tile_head_dim(problem))  # v's own head dim (MLA) too: the larger
    masked_choice, full_choice = FORWARD_CHOICES[head_dim]
    narrow_v = narrow_v_tile(problem)
    if problem.options & HOOKED_TILE_OPTIONS:
        traits = HOOKED_CHOICES[head_dim]
    elif narrow_v is not None:
        traits = narrow_v
    elif problem.page_size:
        # A paged cache's blocks go by TMA where each lies in one page (forward_program): the masked tile's 128 keys
        # divide the usual page sizes (FA2's 256 among them) where the unmasked 176 divides none.
        traits = masked_choice
    else:
        traits = full_choice if problem.mask.is_full else masked_choice
    assert traits.smem_bytes <= target.smem_per_block_bytes
    return traits


def narrow_v_choice(choices: dict, head_dim: int, headdim_v: int):
    """The traits of ``choices`` (a NARROW_V_CHOICES table, the forward's or the backward's: keyed by the compiled
    head dim and v's width) at ``head_dim`` with the narrowest v width that holds ``headdim_v``; None where none
    does (then the tile of the larger head dim)."""
    fitting_v = [dv for d, dv in choices if d == head_dim and dv >= headdim_v]
    return choices[(head_dim, min(fitting_v))] if fitting_v else None


def narrow_v_tile(problem: Problem) -> ForwardTraits | None:
    """The forward's tile of NARROW_V_CHOICES for a problem whose v is narrower than q, at q's compiled head dim
    (narrow_v_choice); None otherwise."""
    if problem.headdim_v >= problem.headdim:
        return None
    return narrow_v_choice(NARROW_V_CHOICES, compiled_head_dim(problem.headdim), problem.headdim_v)


_TILES = tuple(dict.fromkeys([*(t for choices in FORWARD_CHOICES.values() for t in choices),
                              *HOOKED_CHOICES.values(), *NARROW_V_CHOICES.values()]))  # distinct, in order


def instances(target: Target | None = None) -> list[KernelInstance]:
    """The forward's instances the plans for ``target`` may launch (none off sm_90); every one without a target."""
    if target is not None and target.arch not in ARCHS:
        return []
    return [traits.instance(dtype) for dtype in DTYPES for traits in _TILES]


def traits_finder(tiles, flex_tiles, kernel: str) -> Callable[[KernelInstance], WarpgroupTraits]:
    """A ``traits_of`` for one Hopper kernel: the traits of an instance of ``tiles``, or of one cuflash.flex built
    from an instance of ``flex_tiles`` (known by its name up to the FlexHook, KernelInstance.flex_prefix: same tile,
    launch shape and compile arch); KeyError for any other kernel."""
    by_instance = {traits.instance(dtype): traits for dtype in DTYPES for traits in tiles}
    by_flex_prefix = {traits.flex_prefix(dtype): traits for dtype in DTYPES for traits in flex_tiles}

    def traits_of(instance: KernelInstance) -> WarpgroupTraits:
        found = by_instance.get(instance) or by_flex_prefix.get(instance.flex_prefix)
        if found is None:
            raise KeyError(f"{instance} is not a {kernel} kernel")
        return found

    return traits_of


# A forward instance of the catalog, or one with a user's mods built from a hooked one.
traits_of = traits_finder(_TILES, HOOKED_CHOICES.values(), "Hopper forward")


def forward_program(problem: Problem, target: Target) -> Program:
    """One launch over (Q blocks x splits, nheads, batch); with split-KV (a call's num_splits, fa2's count) the
    split forward and fa2's combine kernel, with their float32 scratch (fa2.forward_program_of_tiles)."""
    traits = forward_traits(problem, target)
    program = fa2.forward_program_of_tiles(problem, target, traits, traits.instance(problem.dtype))
    if problem.page_size % traits.block_n or (problem.page_size and problem.cache_leftpad):
        # A K/V block would straddle pages (pages that do not hold whole blocks, or keys from past a page's row 0),
        # which one box cannot read: q, k and v on the load path (one page lookup per row).
        return program
    # Q's box is the Q block, K's and V's the K/V block: 64 columns (one swizzled panel) each.
    boxes = (TmaBox("q", traits.block_m), TmaBox("k", traits.block_n), TmaBox("v", traits.block_n))
    return dataclasses.replace(program, tma_boxes=boxes)


def forward_traffic(problem: Problem, target: Target) -> fa2.Traffic:
    traits = forward_traits(problem, target)
    return fa2.forward_traffic_of_tiles(problem, traits.block_m, traits.block_n)
