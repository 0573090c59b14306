"""Launch plans: the one place that decides grid, block, shared memory and scratch.

Every backend (the CPU simulator, CuPy on a GPU, the JAX FFI handlers) runs the
same ``Program``: an ordered list of kernel launches plus the float32 scratch
buffers they need. A kernel family (standard, fa1, fa2) turns a ``Problem``
(shapes, dtype, flags) into a Program; backends only allocate, pack
``AttentionParams`` and launch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

from .catalog import KernelInstance
from .params import SIDE_BUFFER_FIELDS

ELEMENT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Problem:
    """Everything a launch plan may depend on (never the data itself)."""

    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_DTYPES:
            raise ValueError(f"Problem.dtype must be one of {ELEMENT_DTYPES}, got {self.dtype!r}")
        for name in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim"):
            if getattr(self, name) < 0:
                raise ValueError(f"Problem.{name} must be >= 0, got {getattr(self, name)}")
        if self.nheads_k and self.nheads % self.nheads_k:
            raise ValueError("Problem.nheads must be a multiple of nheads_k")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for MHA, nheads for MQA)."""
        return self.nheads // self.nheads_k if self.nheads_k else 1


@dataclass(frozen=True)
class LaunchPlan:
    kernel: KernelInstance
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem_bytes: int

    @property
    def is_empty(self) -> bool:
        """A grid with a zero dimension launches nothing (CUDA would reject it; backends skip it)."""
        return 0 in self.grid


@dataclass(frozen=True)
class Scratch:
    """A float32 buffer a program needs besides its inputs and outputs, bound to the
    AttentionParams pointer field of the same name."""

    name: str
    shape: tuple[int, ...]
    zero_init: bool = False

    def __post_init__(self) -> None:
        if self.name not in SIDE_BUFFER_FIELDS:
            raise ValueError(f"scratch buffer {self.name!r} is not an AttentionParams side buffer")


@dataclass(frozen=True)
class Program:
    launches: tuple[LaunchPlan, ...]
    scratch: tuple[Scratch, ...] = field(default=())
    num_dq_splits: int = 1


class KernelFamily(Protocol):
    """What a module under cuflash/kernels/families/ provides."""

    NAME: str

    def instances(self) -> list[KernelInstance]: ...

    def dynamic_smem_bytes(self, instance: KernelInstance) -> int: ...

    def forward_program(self, problem: Problem) -> Program: ...

    def backward_program(self, problem: Problem) -> Program: ...


# Algorithm name -> module implementing KernelFamily. The order is the order of the report.
FAMILY_MODULES = {
    "standard": "cuflash.kernels.families.standard",
    "fa1": "cuflash.kernels.families.fa1",
    "fa2": "cuflash.kernels.families.fa2",
}


def available_algorithms() -> list[str]:
    """Algorithms whose kernel family is implemented in this build."""
    names = []
    for name, module in FAMILY_MODULES.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        names.append(name)
    return names


def family(algorithm: str) -> KernelFamily:
    available = available_algorithms()
    if algorithm not in available:
        raise ValueError(f"algorithm must be one of {available}, got {algorithm!r}")
    return importlib.import_module(FAMILY_MODULES[algorithm])  # type: ignore[return-value]


def all_instances() -> list[KernelInstance]:
    """Every instantiation of every implemented family, without duplicates, in a stable order."""
    seen: dict[KernelInstance, None] = {}
    for name in available_algorithms():
        for instance in family(name).instances():
            seen.setdefault(instance, None)
    return list(seen)


def dynamic_smem_bytes(instance: KernelInstance) -> int:
    """The dynamic shared memory the launch plan gives this instance (fixed per instance)."""
    for name in available_algorithms():
        fam = family(name)
        if instance in fam.instances():
            return fam.dynamic_smem_bytes(instance)
    raise KeyError(f"{instance} is not in the kernel catalog")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
