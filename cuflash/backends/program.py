"""Running a launch-plan Program on any array backend.

This is the whole execution path shared by the simulator and the GPU: allocate
the program's scratch, pack one AttentionParams from the arrays' addresses and
strides, launch each plan in order. A backend supplies only allocation,
addresses and the launch itself, so what CI exercises on the simulator is what
runs on a GPU.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from ..kernels.params import SIDE_GRADS_DTYPE, STRIDED_TENSORS, PointerSlots, pack_params, sides_struct
from ..kernels.program import LaunchPlan, Problem, Program

# The most float32 scratch bytes a prepared program keeps between launches for reuse (PreparedProgram.launch): a
# decode step's split-KV partials (out_accum: splits x heads x headdim floats, a few hundred KB), whose allocation
# is a fair part of the step's host time. Larger scratch belongs to larger problems, where allocating is a small
# part of the call, and keeping it in every cached plan would hold memory for little gain.
SPARE_SCRATCH_BYTES = 1 << 22


class ArrayBackend(Protocol):
    xp: Any  # the array module of the backend's arrays (numpy, cupy)
    # Whether launch returns only once its kernels are done (the simulator): then no kernel reads a buffer after the
    # call that launched it, and a prepared program may reuse its scratch in a later call (PreparedProgram.launch).
    synchronous: bool

    def device(self) -> Any:
        """Context manager making the backend's device current for allocation and launch."""

    def empty_scratch(self, shape: tuple[int, ...]) -> Any:
        """A float32 buffer whose contents the program must not rely on."""

    def zeros(self, shape: tuple[int, ...]) -> Any:
        """A zero-filled float32 buffer."""

    def renewal(self, buffer: Any, zero: bool) -> Callable[[], None]:
        """A function giving ``buffer``, scratch to reuse, the contents a new one would have: zeros (``zero``), else
        what empty_scratch gives (synchronous backends only). Made once per buffer, called before each reuse."""

    def upload(self, host: np.ndarray) -> Any:
        """A small host array on the backend's device: side inputs the API made for this call (dropout's seed words,
        checked host copies of cu_seqlens ...), which nothing else holds or writes (the simulator, whose device is
        the host, takes them as they are)."""

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
        # Scratch of finished launches, (buffers, their addresses, their renewals) per set, which launch on a
        # synchronous backend takes instead of allocating: a set is popped for one launch and pushed back after it,
        # so concurrent calls never share one, and the list holds at most as many sets as calls ever ran at once.
        self._spare_scratch: list[tuple[list[Any], list[int], list[Callable[[], None]]]] = []
        self._reuses_scratch = 4 * sum(math.prod(shape) for shape, _ in self._scratch) <= SPARE_SCRATCH_BYTES

    def run(self, backend: ArrayBackend, arrays: Mapping[str, Any], sides: Sequence[Any] = (),
            side_grads: Sequence[Any] = (), tiles: Mapping[str, Any] | None = None,
            side_grad_slices: int = 0) -> list[Any]:
        """Launch on ``arrays`` (the ``inputs`` by name, with the strides given when prepared); returns the scratch
        buffers it allocated, in the program's order. ``sides``: the side arrays of a flex program's mods
        (AttentionParams.flex_sides, in order), ``side_grads``: their float32 gradient buffers (None where a side
        has none); ``tiles``: a block mask's tile lists by AttentionParams.flex_tiles member ("kv", "q"), each
        (counts, indices, full, batch_stride, head_stride) with int32 device arrays. All become launch buffers too
        (the simulator checks every access against those). ``side_grad_slices`` > 0: each side gradient buffer holds
        that many slices of its side's size, one per warp of the main kernel's grid (deterministic side gradients,
        flex_hook.cuh; SideGrads.per_warp_slices)."""
        scratch, addresses = self._allocate_scratch(backend)
        self._launch(backend, arrays, scratch, addresses, sides, side_grads, tiles, side_grad_slices)
        return scratch

    def launch(self, backend: ArrayBackend, arrays: Mapping[str, Any]) -> None:
        """``run`` for a caller that never reads the scratch (and passes no flex inputs). On a synchronous backend
        the scratch of an earlier launch, renewed (backend.renewal: the same contents as a new allocation), serves
        again: the kernels that used it are done, and no caller holds it. Elsewhere (CuPy) the scratch is allocated
        anew: a kernel queued by an earlier call may still use the old one, and CuPy's memory pool already hands its
        memory back in the launch stream's order."""
        if not (backend.synchronous and self._reuses_scratch):
            self._launch(backend, arrays, *self._allocate_scratch(backend))
            return
        try:
            scratch, addresses, renewals = self._spare_scratch.pop()
        except IndexError:
            scratch, addresses = self._allocate_scratch(backend)
            renewals = [backend.renewal(buffer, zero_init) for buffer, (_, zero_init) in zip(scratch, self._scratch)]
        else:
            for renew in renewals:
                renew()
        self._launch(backend, arrays, scratch, addresses)
        self._spare_scratch.append((scratch, addresses, renewals))

    def _allocate_scratch(self, backend: ArrayBackend) -> tuple[list[Any], list[int]]:
        scratch = [backend.zeros(shape) if zero_init else backend.empty_scratch(shape)
                   for shape, zero_init in self._scratch]
        address = backend.address
        return scratch, [address(b) for b in scratch]

    def _launch(self, backend: ArrayBackend, arrays: Mapping[str, Any], scratch: list[Any],
                scratch_addresses: list[int], sides: Sequence[Any] = (), side_grads: Sequence[Any] = (),
                tiles: Mapping[str, Any] | None = None, side_grad_slices: int = 0) -> None:
        # map over C-level callables: no comprehension frame per call.
        buffers = list(map(arrays.__getitem__, self.inputs))
        address = backend.address
        params = self._slots.pack(self._packed, [*map(address, buffers), *scratch_addresses])
        buffers += scratch
        if sides or side_grads:
            params["flex_sides"] = sides_struct(
                (address(s), tuple(s.shape), tuple(int(n) // s.dtype.itemsize for n in s.strides)) for s in sides)
            grads = np.zeros((), SIDE_GRADS_DTYPE)
            grads["arrays"][: len(side_grads)] = [0 if g is None else address(g) for g in side_grads]
            if side_grad_slices:
                grads["slice_elements"][: len(side_grads)] = [0 if g is None else g.size // side_grad_slices
                                                              for g in side_grads]
                grads["per_warp_slices"] = 1
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
