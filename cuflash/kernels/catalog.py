"""The kernel catalog: the kernel families, their variants, and every instantiation they can launch.

A family is an algorithm users name (``standard``, ``fa1``, ``fa2``); it holds one or more
variants side by side (fa2: tensor cores for 16-bit inputs, SIMT for float32), each a
module under cuflash/kernels/families/ that turns a Problem into a Program for a Target and
lists the kernel instances its plans use on that target. The same instances are compiled by
NVRTC for real GPUs and by g++ for the simulator, so this registry is the single source of
truth for both and for the compile report. Plans (plans.py) import the catalog, never the
reverse.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Iterable, Protocol

from .program import ELEMENT_DTYPES, OPTIONS, KernelInstance, Problem, Program
from .targets import TARGETS, Target

DIRECTIONS = ("forward", "backward")


class KernelFamily(Protocol):
    """What a variant's module provides."""

    def instances(self, target: Target) -> list[KernelInstance]: ...

    def dynamic_smem_bytes(self, instance: KernelInstance) -> int: ...

    def threads(self, instance: KernelInstance) -> int: ...

    def forward_program(self, problem: Problem, target: Target) -> Program: ...

    def backward_program(self, problem: Problem, target: Target) -> Program: ...

    # Optional: ``refusal(problem, target, direction) -> str | None``, why the variant cannot serve a problem's
    # forward or backward that its dtypes and options allow (None: it serves it); ``compile_arch(arch) -> str``,
    # what NVRTC compiles its instances for on a device of ``arch`` (default: ``arch`` itself).


@dataclass(frozen=True)
class Variant:
    """One implementation of an algorithm, serving the element types in ``dtypes``."""

    algorithm: str
    name: str
    module_name: str
    dtypes: tuple[str, ...] = ELEMENT_DTYPES
    options: frozenset[str] = frozenset()  # of program.OPTIONS
    directions: tuple[str, ...] = DIRECTIONS  # the programs it has; the others fall to the next variant
    why: str = ""  # what it is for, in a plan's explanation (plans.explain)

    @property
    def module(self) -> KernelFamily | ModuleType:
        return importlib.import_module(self.module_name)

    def refusal(self, problem: Problem, target: Target, direction: str = "forward") -> str | None:
        """Why this variant does not serve ``problem``'s ``direction`` on ``target``; None when it does."""
        if direction not in self.directions:
            return f"no {direction} kernel"
        if problem.dtype not in self.dtypes:
            return f"takes {'/'.join(self.dtypes)}, not {problem.dtype}"
        missing = problem.options - self.options
        if missing:
            return f"no {', '.join(sorted(missing))}"
        refusal = getattr(self.module, "refusal", None)
        return refusal(problem, target, direction) if refusal is not None else None

    def serves(self, problem: Problem, target: Target, direction: str = "forward") -> bool:
        return self.refusal(problem, target, direction) is None


# Algorithm -> its variants, in the order plans try them. The order of the algorithms is the report's.
FAMILIES: dict[str, tuple[Variant, ...]] = {
    "standard": (Variant("standard", "simt", "cuflash.kernels.families.standard"),),
    "fa1": (Variant("fa1", "simt", "cuflash.kernels.families.fa1"),),
    "fa2": (
        # Hopper first: where it serves (sm_90, 16-bit; hopper.refusal says which problems in each direction: both
        # take softcap, ALiBi, varlen, sinks, v's own head dim and flex mods, the forward KV caches (contiguous,
        # paged) and split-KV too), its wgmma forward and backward run at FA3's structure; every other problem stays
        # on mma.sync.
        Variant("fa2", "hopper", "cuflash.kernels.families.hopper", dtypes=("float16", "bfloat16"),
                options=frozenset({"softcap", "alibi", "varlen", "kvcache", "paged", "splitkv", "sinks",
                                   "headdim_v", "flex"}),
                why="warp-specialized wgmma (sm_90a code)"),
        Variant("fa2", "tensor_core", "cuflash.kernels.families.fa2_tc", dtypes=("float16", "bfloat16"),
                options=frozenset(OPTIONS), why="mma.sync tensor cores (sm_80 and newer)"),
        Variant("fa2", "simt", "cuflash.kernels.families.fa2", dtypes=("float32",), options=frozenset(OPTIONS)),
    ),
}


def algorithms() -> list[str]:
    return list(FAMILIES)


def variants(algorithm: str) -> tuple[Variant, ...]:
    found = FAMILIES.get(algorithm)
    if found is None:
        raise ValueError(f"algorithm must be one of {algorithms()}, got {algorithm!r}")
    return found


def check_options(algorithm: str, problem: Problem) -> None:
    """Raise ValueError, naming the algorithms that have it, for an option no variant of ``algorithm`` supports.

    Also raises for an unknown algorithm; the API calls it before anything is allocated."""
    supported = frozenset().union(*(v.options for v in variants(algorithm)))
    for option in sorted(problem.options - supported):
        check_option_of(algorithm, option, _ASKED_BY.get(option, option))


# The argument that asks for an option, where its name is not the option's.
_ASKED_BY = {"splitkv": "num_splits other than 1 (split-KV)"}


def check_option_of(algorithm: str, option: str, what: str) -> None:
    """check_options for one option that a call needs of ``algorithm`` for ``what`` (which the message names): a
    ValueError naming the algorithms that have it. Also raises for an unknown algorithm."""
    if not any(option in v.options for v in variants(algorithm)):
        having = [name for name, family in FAMILIES.items() if any(option in v.options for v in family)]
        raise ValueError(f"{what} is supported by algorithm={' or '.join(map(repr, having))} only, "
                         f"got algorithm={algorithm!r}")


def instances(target: Target) -> list[KernelInstance]:
    """Every instantiation some plan may launch on ``target``, without duplicates, in a stable order."""
    seen: dict[KernelInstance, None] = {}
    for family in FAMILIES.values():
        for variant in family:
            for instance in variant.module.instances(target):
                seen.setdefault(instance, None)
    return list(seen)


def all_instances(targets: Iterable[Target] | None = None) -> list[KernelInstance]:
    """Every instantiation any plan may launch on any of ``targets`` (default: every known target)."""
    seen: dict[KernelInstance, None] = {}
    for target in TARGETS.values() if targets is None else targets:
        for instance in instances(target):
            seen.setdefault(instance, None)
    return list(seen)


def owner(instance: KernelInstance) -> KernelFamily:
    """The variant module whose plans launch ``instance`` (KeyError: none)."""
    for family in FAMILIES.values():
        for variant in family:
            try:
                variant.module.dynamic_smem_bytes(instance)
            except KeyError:
                continue
            return variant.module
    raise KeyError(f"{instance} is not in the kernel catalog")


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    """The dynamic shared memory the plans give this instance (fixed per instance)."""
    return owner(instance).dynamic_smem_bytes(instance)


def threads(instance: KernelInstance) -> int:
    """The block size the plans give this instance (fixed per instance)."""
    return owner(instance).threads(instance)


def compile_arch(instance: KernelInstance, arch: str) -> str:
    """What NVRTC compiles ``instance`` for where a device of ``arch`` gets ``arch`` code (toolchain.choose_code):
    the owning family's ``compile_arch`` (the Hopper kernels: sm_90a, whose CUBINs run on sm_90 devices), else
    ``arch``. Every NVRTC caller (the CuPy backend, the JAX FFI registration, the report, the loop census) asks
    here. An instance outside the catalog (a test's kernel) compiles for ``arch``."""
    try:
        family = owner(instance)
    except KeyError:
        return arch
    owned = getattr(family, "compile_arch", None)
    return owned(arch) if owned is not None else arch
