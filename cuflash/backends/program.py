"""Running a launch-plan Program on any array backend.

This is the whole execution path shared by the simulator and the GPU: allocate
the program's scratch, pack one AttentionParams from the arrays' addresses and
strides, launch each plan in order. A backend supplies only allocation,
addresses and the launch itself, so what CI exercises on the simulator is what
runs on a GPU.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from ..kernels.params import STRIDED_TENSORS, pack_params
from ..kernels.program import LaunchPlan, Problem, Program


class ArrayBackend(Protocol):
    def device(self) -> Any:
        """Context manager making the backend's device current for allocation and launch."""

    def empty_scratch(self, shape: tuple[int, ...]) -> Any:
        """A float32 buffer whose contents the program must not rely on."""

    def zeros(self, shape: tuple[int, ...]) -> Any:
        """A zero-filled float32 buffer."""

    def upload(self, host: np.ndarray) -> Any:
        """A device copy of a small host array (side inputs made by the API, such as dropout's seed words)."""

    def address(self, array: Any) -> int: ...

    def launch(self, plan: LaunchPlan, params: np.void, buffers: Sequence[Any]) -> None: ...


def element_strides(array: Any) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a (batch, seqlen, heads, headdim) array, or of a packed varlen
    (total, heads, headdim) one, whose batch stride is 0 (block_info.cuh finds its sequences by cu_seqlens)."""
    itemsize = array.dtype.itemsize
    strides = tuple(int(s) // itemsize for s in array.strides[:-1])
    return strides if len(strides) == 3 else (0, *strides)  # type: ignore[return-value]


def run_program(
    backend: ArrayBackend,
    program: Program,
    problem: Problem,
    softmax_scale: float,
    arrays: Mapping[str, Any],
) -> dict[str, Any]:
    """Run ``program`` with ``arrays`` bound to the AttentionParams fields of the same names.

    Returns the scratch buffers it allocated (tests read them; callers normally drop them).
    """
    scratch = {
        s.name: backend.zeros(s.shape) if s.zero_init else backend.empty_scratch(s.shape)
        for s in program.scratch
    }
    bound = {**arrays, **scratch}
    params = pack_params(
        problem,
        softmax_scale=softmax_scale,
        pointers={name: backend.address(array) for name, array in bound.items()},
        strides={name: element_strides(arrays[name]) for name in STRIDED_TENSORS if name in arrays},
        num_dq_splits=program.num_dq_splits,
        num_kv_splits=program.num_kv_splits,
    )
    buffers = list(bound.values())
    for plan in program.launches:
        if not plan.is_empty:
            backend.launch(plan, params, buffers)
    return scratch
