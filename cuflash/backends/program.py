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

from ..kernels.params import SIDE_GRADS_DTYPE, STRIDED_TENSORS, PointerSlots, pack_params, sides_struct
from ..kernels.program import LaunchPlan, Problem, Program


class ArrayBackend(Protocol):
    xp: Any  # the array module of the backend's arrays (numpy, cupy)

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


class PreparedProgram:
    """A Program with AttentionParams packed for one problem, softmax scale and the strides of ``arrays`` (the
    inputs by field name), all but the pointers: running it allocates the scratch, lays the call's addresses into a
    copy of the packed bytes and launches. The API keeps one per checked call signature and lengths (api.Plan), so
    a repeated call, whose arrays have the same strides, packs only pointers."""

    def __init__(self, program: Program, problem: Problem, softmax_scale: float, arrays: Mapping[str, Any]):
        self.program = program
        self.inputs = tuple(arrays)
        strides = {name: element_strides(arrays[name]) for name in STRIDED_TENSORS if name in arrays}
        self._launches = tuple(plan for plan in program.launches if not plan.is_empty)
        self._scratch = tuple((s.shape, s.zero_init) for s in program.scratch)
        self.scratch_names = tuple(s.name for s in program.scratch)
        self._slots = PointerSlots(self.inputs + tuple(s.name for s in program.scratch))
        self._packed = pack_params(
            problem,
            softmax_scale=softmax_scale,
            pointers={},
            strides=strides,
            num_dq_splits=program.num_dq_splits,
            num_kv_splits=program.num_kv_splits,
        ).tobytes()

    def run(self, backend: ArrayBackend, arrays: Mapping[str, Any], sides: Sequence[Any] = (),
            side_grads: Sequence[Any] = (), tiles: Mapping[str, Any] | None = None) -> list[Any]:
        """Launch on ``arrays`` (the ``inputs`` by name, with the strides given when prepared); returns the scratch
        buffers it allocated, in the program's order. ``sides``: the side arrays of a flex program's mods
        (AttentionParams.flex_sides, in order), ``side_grads``: their float32 gradient buffers (None where a side
        has none); ``tiles``: a block mask's tile lists by AttentionParams.flex_tiles member ("kv", "q"), each
        (counts, indices, full, batch_stride, head_stride) with int32 device arrays. All become launch buffers too
        (the simulator checks every access against those)."""
        buffers = [arrays[name] for name in self.inputs]
        scratch = []
        for shape, zero_init in self._scratch:
            scratch.append(backend.zeros(shape) if zero_init else backend.empty_scratch(shape))
        buffers += scratch
        address = backend.address
        params = self._slots.pack(self._packed, [address(b) for b in buffers])
        if sides or side_grads:
            params["flex_sides"] = sides_struct(
                (address(s), tuple(s.shape), tuple(int(n) // s.dtype.itemsize for n in s.strides)) for s in sides)
            grads = np.zeros((), SIDE_GRADS_DTYPE)
            grads["arrays"][: len(side_grads)] = [0 if g is None else address(g) for g in side_grads]
            params["flex_side_grads"] = grads
            buffers += [*sides, *(g for g in side_grads if g is not None)]
        for member, (counts, indices, full, batch_stride, head_stride) in (tiles or {}).items():
            lists = params["flex_tiles"][member]
            lists["counts"], lists["indices"], lists["full"] = address(counts), address(indices), address(full)
            lists["batch_stride"], lists["head_stride"] = batch_stride, head_stride
            lists["columns"] = indices.shape[-1]
            buffers += [counts, indices, full]
        for plan in self._launches:
            backend.launch(plan, params, buffers)
        return scratch


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
    prepared = PreparedProgram(program, problem, softmax_scale, arrays)
    return dict(zip((s.name for s in program.scratch), prepared.run(backend, arrays)))
