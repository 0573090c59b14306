"""fa2's Hopper variant (the catalog's ``hopper``): the warp-specialized wgmma kernels, compiled for sm_90a.

The forward is fa3.py (``fa3_forward.cu``), the backward fa3_backward.py (``fa3_backward.cu``); this module is the
variant the catalog and the plans see, answering for each direction from the module that owns it: whether it serves
a problem (``refusal``: each kernel's own rule), its Program, and the instances both launch (``instances``,
``traits_of`` and what the catalog asks of an instance: shared memory, threads, warpgroups per role, compile arch).
On a sm_90 target fa2's 16-bit forward and backward run here where each serves; every other problem, and every other
arch, stays on the mma.sync kernels (fa2_tc).
"""

from __future__ import annotations

from ..program import KernelInstance, Problem, Program
from ..targets import Target
from . import fa2, fa3, fa3_backward
from .fa3 import ARCHS, DTYPES, WarpgroupTraits, compile_arch  # noqa: F401  (the catalog asks compile_arch here)


def refusal(problem: Problem, target: Target, direction: str = "forward") -> str | None:
    """Why the Hopper kernel of ``direction`` does not compute ``problem`` on ``target`` (None: it does)."""
    return (fa3 if direction == "forward" else fa3_backward).refusal(problem, target)


def forward_program(problem: Problem, target: Target) -> Program:
    return fa3.forward_program(problem, target)


def forward_traffic(problem: Problem, target: Target) -> fa2.Traffic:
    return fa3.forward_traffic(problem, target)


def backward_program(problem: Problem, target: Target) -> Program:
    return fa3_backward.backward_program(problem, target)


def tile_traits(problem: Problem, target: Target, direction: str) -> WarpgroupTraits:
    """The traits of the main kernel of ``problem``'s ``direction`` (its tiles: a block mask's lists are made for
    them)."""
    if direction == "backward":
        return fa3_backward.problem_traits(problem, target)
    return fa3.forward_traits(problem, target)


def backward_traits(headdim: int, target: Target) -> fa3_backward.BackwardTraits:
    return fa3_backward.backward_traits(headdim, target)


def backward_traffic(problem: Problem, target: Target) -> tuple[fa2.Traffic, fa2.Traffic, fa2.Traffic]:
    return fa3_backward.backward_traffic(problem, target)


def _backward_instances() -> list[KernelInstance]:
    """The backward's main kernels (its pre-pass and convert kernels are fa2's: fa2_tc lists them and owns them,
    compiled for sm_90)."""
    return [traits.instance(dtype) for dtype in DTYPES for traits in fa3_backward.TILES]


def instances(target: Target | None = None) -> list[KernelInstance]:
    """The Hopper kernels the plans for ``target`` may launch (none off sm_90), forward then backward (none where the
    installed NVRTC spills it: fa3_backward.toolchain_refusal); every one without a target."""
    if target is not None and target.arch not in ARCHS:
        return []
    backward = _backward_instances() if fa3_backward.toolchain_refusal() is None else []
    return fa3.instances(target) + backward


def traits_of(instance: KernelInstance) -> WarpgroupTraits:
    """The forward's or the backward's traits of a Hopper kernel (KeyError: not one)."""
    try:
        return fa3_backward.traits_of(instance)
    except KeyError:
        return fa3.traits_of(instance)  # KeyError for any other kernel


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    return traits_of(instance).smem_bytes


def threads(instance: KernelInstance) -> int:
    return traits_of(instance).threads


def warpgroups(instance: KernelInstance) -> dict[str, int]:
    """Warpgroups per role (the compile report's registers per role after setmaxnreg): the producer gives registers
    back (setmaxnreg.dec), the consumers take them (setmaxnreg.inc)."""
    return {"producer": 1, "consumer": traits_of(instance).consumers}
