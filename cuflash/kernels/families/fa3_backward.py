"""The warp-specialized Hopper backward (FlashAttention-3's structure): the fa2 backward's wgmma twin for sm_90a.

Kernel: ``cuda_src/kernels/fa3_backward.cu`` (its opening comment gives the warp roles, the products, the pipeline
and the traffic); tiles in ``fa3_backward_traits.cuh``, layout and copies shared with the forward
(``fa3_forward_traits.cuh``).

Program: fa2's three-launch backward (``fa2.backward_program_for``): the pre-pass D = rowsum(dO * O), the main
kernel ``fa3_backward_kernel`` over (K/V blocks, nheads_k, batch) with 1 producer + block_n / 64 consumer
warpgroups, and fa2's convert kernel (dq = scale * the sum of the dq_accum slices), with fa2's dq_accum scratch, grid
and slice rules (atomic mode: one slice; deterministic: a block per slice over every num_dq_splits-th K/V block).
The main kernel's producer copies Q, dO, K and V with TMA where the host can make their tensor maps (the program's
``tma_boxes``; AttentionParams.tma_loads per call), else with 16-byte loads, as the forward's.

In the catalog as the backward of fa2's ``hopper`` variant (hopper.py; its forward is fa3.py): on a sm_90 target fa2's
backward runs it for the problems ``supports`` accepts: 16-bit inputs at head dims 1..256 (on 64, 128 or 256), any mask
(causal, sliding windows), softcap and ALiBi (the hooked instances, alone or together), varlen batches, attention sinks,
v with a head dim of its own (the tile of the larger; MLA's 192 / 128, and any v up to 128 beside a q of 129..256, on
the d256 tile with V, dO and dV at 128), GQA/MQA, any seqlens, dQ by atomics or in deterministic mode (fa2's slices),
and a user's flex mods (cuflash.flex builds the instance from the plain one of the tile, with the mods' FlexHook as its
Hook: ``traits_of`` knows it by its name up to the hook; a block mask's Q block lists are made for this tile);
``refusal`` says why everything else stays on the mma.sync backward (fa2_tc). Where the installed NVRTC is 12 it serves
nothing (``toolchain_refusal``): ptxas 12.9 spills it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

from .. import nvrtc
from ..program import KernelInstance, Problem, Program, TmaBox
from ..targets import Target
from . import fa2
from .fa3 import ARCHS, DTYPES, HOOK_OPTIONS, WarpgroupTraits, narrow_v_choice, traits_finder

SOURCE = "kernels/fa3_backward.cu"
_ELEMENT_BYTES = 2
_DQ_BUFFERS = 2  # fa3::BackwardTraits::kDqBuffers


def template_defaults(head_dim: str) -> tuple[str, ...]:
    """fa3_backward_kernel's defaults of Hooked, SplitHeadDim and HeadDimV (the head dim's), for an instance's
    head dim argument (cuflash.flex spells them out before the Hook)."""
    return ("false", "false", head_dim)


@dataclass(frozen=True)
class BackwardTraits(WarpgroupTraits):
    """fa3::BackwardTraits: a K/V block of ``block_n`` keys, Q blocks of ``block_m`` rows through a ring of
    ``stages``; the consumers share the keys (block_n / 64 warpgroups, 64 keys each) or, ``split_head_dim``, the head
    dim (two warpgroups, one 64-key block, each half of the queries of S^T and dP^T and half the columns of dV, dK and
    dQ: head dims past 128)."""

    KERNEL: ClassVar[str] = "fa3_backward_kernel"
    SOURCE: ClassVar[str] = SOURCE
    CONSUMER_SIDE: ClassVar[str] = "block_n"
    split_head_dim: bool = False  # the kernel's SplitHeadDim

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_m != 64:
            raise ValueError(f"{self}: block_m 64 (dQ's wgmma M, one 64-column dS^T panel)")
        if self.split_head_dim and (self.block_n != 64 or self.head_dim % 128 or self.v_head_dim % 128):
            raise ValueError(f"{self}: split_head_dim takes one 64-key block and halves of whole 64-column panels")

    @property
    def consumers(self) -> int:
        return 2 if self.split_head_dim else super().consumers

    @property
    def queries(self) -> int:
        """A consumer's queries of S^T and dP^T (their wgmma N; fa3::BackwardTraits::kQueries)."""
        return self.block_m // 2 if self.split_head_dim else self.block_m

    @property
    def out_cols(self) -> int:
        """A consumer's head-dim columns of dK (and dQ; their wgmma N; fa3::BackwardTraits::kOutCols)."""
        return self.head_dim // 2 if self.split_head_dim else self.head_dim

    @property
    def out_cols_v(self) -> int:
        """A consumer's columns of dV (fa3::BackwardTraits::kOutColsV)."""
        return self.v_head_dim // 2 if self.split_head_dim else self.v_head_dim

    @property
    def smem_bytes(self) -> int:
        # 16-bit K [block_n][D], V [block_n][Dv], Q [stages][block_m][D], dO [stages][block_m][Dv], dS^T
        # [block_n][block_m] (split_head_dim: and P^T); float32 dQ [2][block_m][D + 8] (fa3::BackwardTraits::kDqPitch;
        # split_head_dim: none); float32 lse, D [stages][block_m]; 2 + 2 stages + 2 x the dQ buffers' mbarriers.
        d, dv, m, n, s = self.head_dim, self.v_head_dim, self.block_m, self.block_n, self.stages
        dq_buffers = 0 if self.split_head_dim else _DQ_BUFFERS
        transposed_tiles = 2 if self.split_head_dim else 1
        tiles = (_ELEMENT_BYTES * (n * (d + dv) + s * m * (d + dv) + transposed_tiles * n * m)
                 + 4 * dq_buffers * m * (d + 8))
        return tiles + 2 * 4 * s * m + 8 * (2 + 2 * s + 2 * dq_buffers)

    def all_template_flags(self) -> tuple[str, ...]:
        """Hooked, SplitHeadDim, HeadDimV."""
        return ("true" if self.hooked else "false", "true" if self.split_head_dim else "false", str(self.v_head_dim))

    def template_flags(self) -> tuple[str, ...]:
        """Hooked, SplitHeadDim, HeadDimV, up to the last that is not its default."""
        flags = self.all_template_flags()
        defaults = template_defaults(str(self.head_dim))
        last = max((i for i, (f, default) in enumerate(zip(flags, defaults)) if f != default), default=-1)
        return flags[:last + 1]

    def convert_instance(self, dtype: str) -> KernelInstance:
        return fa2.convert_dq_instance(dtype, self.block_n)


# The tiles (Q block x K/V block): 64 x 128 with two consumers at both head dims (FA3's d128 causal tile). What keeps
# FA3's d128 80 x 128 out for now: the kernel's dS^T tile holds BlockM columns as whole 64-column swizzled panels (80
# would take 128, padded), a Q block is dQ's wgmma M (the traits ask BlockM = 64); and the registers: S^T and dP^T
# (40 floats each at N = 80), dK and dV (64 each) and P^T's and dS^T's fragments (20 words each) come to about 250
# live beside the addresses, where two consumers get 224 after a 56-register producer (the block's 168 x 384
# registers at launch, all setmaxnreg can hand out; FA3's TMA producer keeps 24, its consumers 240).
# Past d128 dK and dV of 64 keys whole are more floats a thread than a consumer has (256 at d256, beside S^T's and
# dP^T's): d256 shares the head dim (split_head_dim, FA3's d256 backward's 64 x 64 tile with two consumers), each
# consumer 64 floats of dK and 64 of dV; d129..255 run it too (d192's halves, 96 columns, would start mid-panel).
BACKWARD_CHOICES = {
    64: BackwardTraits(64, block_m=64, block_n=128),
    128: BackwardTraits(128, block_m=64, block_n=128),
    256: BackwardTraits(256, block_m=64, block_n=64, split_head_dim=True),
}
# Problems with softcap or ALiBi (fa3.HOOK_OPTIONS) run the hooked instance of the same tile: P and dS through the
# score hook and its derivative (fa3_backward.cu's Hooked), softcap and ALiBi alone or together (the step tests once
# per tile which are on; with neither or ALiBi alone dS needs no derivative). Until P^T and dS^T went to shared memory
# by stmatrix, the keys-sharing d128 step spilled with both at the consumers' 224 registers (NVRTC 13.5; the dS^T
# tile's 16 hoisted store addresses among what did not fit), so that instance took one hook (a kernel flag, gone
# since: its step formed the derivative for every score, trapping on both) and the pair ran a d128 tile sharing the
# head dim. Now none spills, and the census's cheapest walks of the d128 hooked step (NVRTC 13.5, fp16) are 468
# instructions for 32 HGMMA (0.357 per 1000 MMA FLOPs per warp; 561 with one hook) and 694 on the softcap path (787),
# where the tile sharing the head dim issued 374 for 28 HGMMA (0.571): one hooked instance a head dim.
HOOKED_CHOICES = {d: dataclasses.replace(t, hooked=True) for d, t in BACKWARD_CHOICES.items()}
# v narrower than q and k, by (the compiled head dim, v's widest): MLA's 192 / 128 on the d256 tile with V, dO and dV
# at 128 (each consumer's half of dV 64 columns; dP^T sums over 128): per step 256 + 128 + 128 + 256 + 256 columns of
# the five products where the d256 tile takes 5 x 256, a fifth fewer FLOPs. Softcap and ALiBi keep the hooked d256
# tile (one instance fewer per dtype).
NARROW_V_CHOICES = {(256, 128): dataclasses.replace(BACKWARD_CHOICES[256], head_dim_v=128)}
# Every main-kernel instance's traits, each once.
TILES = tuple(dict.fromkeys((*BACKWARD_CHOICES.values(), *HOOKED_CHOICES.values(), *NARROW_V_CHOICES.values())))
# Sinks: nothing of the kernel's own (sink.cuh: the forward's out and lse include the sink, and the API forms the
# sinks' gradient from the row statistics). v's own head dim: the tile of the larger (fa2.tile_head_dim), V, dO and
# dV at v's width.
# Flex: the mods' FlexHook in the plain instance of the tile (a flex problem has no softcap or ALiBi, and no varlen).
SERVED_OPTIONS = HOOK_OPTIONS | {"varlen", "sinks", "headdim_v", "flex"}


def compiled_head_dim(headdim: int) -> int:
    """The smallest head dim the backward is compiled for >= headdim (its own: 64, 128, 256; the forward has
    192 too)."""
    return min(d for d in BACKWARD_CHOICES if d >= headdim)


@functools.lru_cache(maxsize=None)
def toolchain_refusal() -> str | None:
    """Why the installed NVRTC does not get this kernel (None: it does, or there is none and only the simulator's g++
    builds it). NVRTC 12's ptxas (12.9) spilled it at the consumers' 232 registers (d128: 192 bytes stored, 260
    loaded; d64: 96 / 144) where NVRTC 13.5's keeps it in registers: with NVRTC 12 the plans keep the backward on
    mma.sync (fa2_tc), and its instances are not listed (the report's --no-spills gate holds under both)."""
    try:
        major, _ = nvrtc.nvrtc_version()
    except nvrtc.NvrtcError:
        return None
    return f"spills under NVRTC {major} (ptxas 12.9): needs NVRTC 13" if major < 13 else None


def refusal(problem: Problem, target: Target) -> str | None:
    """Why this kernel does not compute ``problem``'s backward on ``target`` (None: it does). It needs sm_90, 16-bit,
    head dims 1..256 (q's and k's, v's its own or the same), any mask (causal, sliding windows: mask.cuh's q_blocks
    visit the band's Q blocks, tiles crossing an edge take the element-wise mask), no option but varlen, sinks, v's
    own head dim, softcap and ALiBi (SERVED_OPTIONS; the latter two, alone or together, by the hooked instances) and
    flex mods; dQ by atomics or deterministic (fa2's slices) alike. Its own rule, not the
    forward's: the two kernels' options may differ."""
    if target.arch not in ARCHS:
        return f"wgmma needs sm_90, not {target.arch}"
    if problem.dtype not in DTYPES:
        return f"takes {'/'.join(DTYPES)}, not {problem.dtype}"
    toolchain = toolchain_refusal()
    if toolchain is not None:
        return toolchain
    if not 1 <= fa2.tile_head_dim(problem) <= max(BACKWARD_CHOICES):
        return f"head dims 1..{max(BACKWARD_CHOICES)} only, not {fa2.tile_head_dim(problem)}"
    unserved = problem.options - SERVED_OPTIONS
    if unserved:
        return f"no {', '.join(sorted(unserved))} yet"
    return None


def supports(problem: Problem, target: Target) -> bool:
    """Whether this kernel computes ``problem``'s backward on ``target`` (``refusal`` says why not)."""
    return refusal(problem, target) is None


def backward_traits(headdim: int, target: Target, hooked: bool = False,
                    headdim_v: int | None = None) -> BackwardTraits:
    """The tile for ``headdim`` (1..256: the next compiled head dim's; q's, or v's where larger), as
    fa2_tc.backward_traits; ``hooked``: its instance with the score hook (softcap, ALiBi or both); ``headdim_v``,
    v's where narrower: the tile of NARROW_V_CHOICES with the narrowest v width that holds it, if any (not
    hooked)."""
    table = HOOKED_CHOICES if hooked else BACKWARD_CHOICES
    traits = table[compiled_head_dim(headdim)]
    if headdim_v is not None and headdim_v < headdim and not hooked:
        traits = narrow_v_choice(NARROW_V_CHOICES, traits.head_dim, headdim_v) or traits
    assert traits.smem_bytes <= target.smem_per_block_bytes
    return traits


def instances() -> list[KernelInstance]:
    """Every instance of the backward program: the main kernels, fa2's pre-pass and convert kernels."""
    return [i for dtype in DTYPES
            for i in fa2.backward_program_instances(list(TILES), dtype)]


# A backward instance of the catalog, or one with a user's mods built from a plain one.
traits_of = traits_finder(TILES, [traits for traits in TILES if not traits.hooked], "Hopper backward")


def problem_traits(problem: Problem, target: Target) -> BackwardTraits:
    """The tile of ``problem``'s backward (ValueError where this kernel does not serve it)."""
    why = refusal(problem, target)
    if why is not None:
        raise ValueError(f"the Hopper backward does not serve {problem} on {target.arch}: {why}")
    return backward_traits(fa2.tile_head_dim(problem), target, hooked=bool(problem.options & HOOK_OPTIONS),
                           headdim_v=problem.headdim_v)


def backward_program(problem: Problem, target: Target) -> Program:
    traits = problem_traits(problem, target)
    program = fa2.backward_program_for(problem, traits, target)
    # The main kernel's producer copies with TMA where the host can make the maps (AttentionParams.tma_loads): Q's
    # and dO's box the Q block, K's and V's the K/V block, 64 columns (one swizzled panel) each.
    boxes = (TmaBox("q", traits.block_m), TmaBox("dout", traits.block_m), TmaBox("k", traits.block_n),
             TmaBox("v", traits.block_n))
    return dataclasses.replace(program, tma_boxes=boxes)


def backward_traffic(problem: Problem, target: Target) -> tuple[fa2.Traffic, fa2.Traffic, fa2.Traffic]:
    """fa2's traffic for the same tiles (pre-pass, main kernel, convert): K/V once per block, Q, dO, lse, D once per
    visited (head, Q block), dq_accum's adds once per element per visited K/V block; a K/V block no query sees is not
    read (its dK and dV written as zeros)."""
    return fa2.backward_traffic_for(problem, problem_traits(problem, target), target, reads_unseen_kv=False)
