"""The kernel catalog: every kernel instantiation the library can launch.

A kernel instantiation is (source file, C++ template name expression). The same
instance is compiled by NVRTC for real GPUs and by g++ for the CPU simulator,
so this list is the single source of truth for both, and for the compile report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .._paths import CUDA_SRC

# Element type names as spelled in kernel template arguments, by NumPy dtype name.
CXX_ELEMENT_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


@dataclass(frozen=True)
class KernelInstance:
    """One template instantiation of one kernel source file."""

    source: str  # path relative to cuda_src/ (or absolute, for test kernels)
    name_expr: str  # e.g. "cuflash::standard_scores_kernel<__half>"

    @property
    def source_path(self) -> Path:
        path = Path(self.source)
        return path if path.is_absolute() else CUDA_SRC / path

    def __str__(self) -> str:
        return self.name_expr


def all_instances() -> list[KernelInstance]:
    """Every instantiation any launch plan can ask for."""
    from . import plans

    return plans.all_instances()
