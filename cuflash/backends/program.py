"""Running a launch-plan Program on any array backend.

This is the whole execution path shared by the simulator and the GPU: allocate
the program's scratch, pack one AttentionParams from the arrays' addresses and
strides, launch each plan in order. A backend supplies only allocation,
addresses and the launch itself, so what CI exercises on the simulator is what
runs on a GPU.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from ..kernels import tensor_map
from ..kernels.params import (SIDE_GRADS_DTYPE, STRIDED_TENSORS, TMA_BLOCK_OFFSET, TMA_MAPS_AT, TMA_TENSORS,
                              PointerSlots, pack_params, sides_struct)
from ..kernels.program import LaunchPlan, Problem, Program, TmaBox

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

    # Whether this backend's kernels take tensor maps the CUDA driver encodes (a GPU), or the simulator twin's.
    tensor_maps_by_driver: bool

    def launch(self, plan: LaunchPlan, params: np.void, buffers: Sequence[Any]) -> None: ...


def element_strides(array: Any) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a (batch, seqlen, heads, headdim) array, or of a packed varlen
    (total, heads, headdim) one, whose batch stride is 0 (block_info.cuh finds its sequences by cu_seqlens)."""
    itemsize = array.dtype.itemsize
    strides = tuple(int(s) // itemsize for s in array.strides[:-1])
    return strides if len(strides) == 3 else (0, *strides)  # type: ignore[return-value]


def row_extents(array: Any) -> tuple[int, int]:
    """(batches, rows) of a (batch, seqlen, heads, headdim) array, or (1, total) of a packed varlen (total, heads,
    headdim) one: what a tensor map over the whole array spans (a KV cache's: its cache batch and capacity, or a paged
    one's pages and page size). ``array``: an array, or its shape (the JAX lowering has shapes only)."""
    shape = tuple(getattr(array, "shape", array))
    return (shape[0], shape[1]) if len(shape) == 4 else (1, shape[0])


_TMA_ELEMENT_TYPES = {"float16": tensor_map.FLOAT16, "bfloat16": tensor_map.BFLOAT16}


class TmaMaps:
    """The tensor maps of a program's TMA copies (Program.tma_boxes: a box per tensor, of AttentionParams.tma's
    members) for one problem and the strides of its arrays, laid into AttentionParams' TMA block per call: a map holds
    its tensor's address, so only that changes between calls.

    Each map is 4-D, innermost first: (head dim, rows, heads, batch) of the whole array (``extents``: row_extents of
    each) with the arrays' byte strides, the box (cols, rows, 1, 1), the 128-byte swizzle; elements outside the
    tensor are zero-filled (rows past a fixed-length sequence, columns past the head dim). A packed varlen array is
    one batch of all its rows (the kernel finds a sequence's rows by cu_seqlens, block_info.cuh's q_tma_coords), a
    KV cache the whole cache (key_tma_coords). Everything but the address is checked (tensor_map.check_tiled) once, here; where TMA cannot
    take the arrays (strides not whole 16 bytes, such as head dims not a multiple of 8, or 0 for a broadcast batch)
    ``usable`` is False, and where a call's address is not 16-byte aligned that call goes without: the kernels
    then copy with loads (AttentionParams.tma_loads 0).
    Per call: the simulator twin's bytes with the address patched in (it sits at a fixed place); a GPU's maps by
    the driver (its encoding is opaque). The JAX handlers do the same per call in C++ from what ``template`` and
    ``argument_words`` give at trace time (cuflash/jax/_primitives.py, cuda_src/ffi/program_call.h)."""

    address_alignment = tensor_map.address_alignment(tensor_map.INTERLEAVE_NONE)

    def __init__(self, boxes: Sequence[TmaBox], problem: Problem, strides: Mapping[str, tuple[int, int, int]],
                 extents: Mapping[str, tuple[int, int]]):
        self.tensors = tuple(box.tensor for box in boxes)  # the inputs whose addresses block() takes, in this order
        if len(set(self.tensors)) != len(self.tensors):
            raise ValueError(f"a program's tma_boxes name a tensor twice: {self.tensors}")
        self._encodings = []  # per box: the driver's arguments, address 0
        self._at = []  # per box: its map's place in the block
        self.usable = problem.dtype in _TMA_ELEMENT_TYPES
        for box in boxes:
            query_side = box.tensor in ("q", "dout")
            width = problem.headdim_v if box.tensor in ("v", "dout") else problem.headdim
            batches, rows = extents.get(box.tensor, (0, 0))
            dims = (width, rows, problem.nheads if query_side else problem.nheads_k, batches)
            batch_stride, row_stride, head_stride = strides.get(box.tensor, (0, 0, 0))
            if batches == 1 and batch_stride == 0:  # a packed varlen array: one batch, whose stride is never taken
                batch_stride = row_stride * max(rows, 1)
            args = (_TMA_ELEMENT_TYPES.get(problem.dtype, tensor_map.FLOAT16), 4, 0, dims,
                    [2 * row_stride, 2 * head_stride, 2 * batch_stride], (box.cols, box.rows, 1, 1), (1, 1, 1, 1))
            try:
                tensor_map.check_tiled(*args, swizzle=tensor_map.SWIZZLE_128B)
            except ValueError:
                self.usable = False
            self._encodings.append(args)
            self._at.append(TMA_MAPS_AT + TMA_TENSORS.index(box.tensor) * tensor_map.TENSOR_MAP_BYTES)
        self._last: tuple[Any, tuple[int, bytes] | None] = (None, None)  # the last call's addresses and block
        # The TMA block (params.TMA_BLOCK_OFFSET on): tma_loads = 1, then the maps, the twins' addresses still 0.
        self._block = bytearray(TMA_MAPS_AT + len(TMA_TENSORS) * tensor_map.TENSOR_MAP_BYTES)
        self._block[:4] = (1).to_bytes(4, "little")
        if self.usable:
            for args, at in zip(self._encodings, self._at):
                self._block[at: at + tensor_map.TENSOR_MAP_BYTES] = tensor_map.encode_tiled(
                    *args, swizzle=tensor_map.SWIZZLE_128B)
        self._twin_address_at = tuple(at + tensor_map.TWIN_ADDRESS_OFFSET for at in self._at)

    def block(self, addresses: tuple[int, ...], by_driver: bool) -> tuple[int, bytes] | None:
        """The TMA block of AttentionParams (PointerSlots.pack's tail) for the tensors at ``addresses`` (in the
        order of ``tensors``), or None where a base address is not 16-byte aligned (the only requirement left)."""
        last_addresses, last_block = self._last
        if addresses == last_addresses:  # the same arrays as the last call (a training loop's buffers)
            return last_block
        if not self.usable or any(a % self.address_alignment for a in addresses):
            return None
        block = bytearray(self._block)  # a copy: concurrent calls may share this object
        if by_driver:
            for args, at, address in zip(self._encodings, self._at, addresses):
                block[at: at + tensor_map.TENSOR_MAP_BYTES] = tensor_map.encode_with_driver(
                    args[0], args[1], address, *args[3:], swizzle=tensor_map.SWIZZLE_128B)
        else:
            pack_address = tensor_map.TWIN_ADDRESS.pack_into
            for at, address in zip(self._twin_address_at, addresses):
                pack_address(block, at, address)
        made = TMA_BLOCK_OFFSET, bytes(block)
        self._last = addresses, made  # one assignment: a concurrent call sees an old pair or a new one
        return made


    def template(self) -> tuple[int, bytes] | None:
        """The TMA block with every address 0 (tma_loads 1, the twins' encodings), for a caller that patches the
        addresses in itself (twin: at TWIN_ADDRESS_OFFSET in each map; a GPU's: re-encoded by the driver); None
        where TMA cannot take the arrays (``usable``)."""
        return (TMA_BLOCK_OFFSET, bytes(self._block)) if self.usable else None

    def argument_words(self) -> list[int]:
        """Per map, in the order of ``tensors``, cuTensorMapEncodeTiled's arguments but the address
        (tensor_map.tiled_argument_words): what a caller encoding the maps with the driver itself takes."""
        return [word for args in self._encodings
                for word in tensor_map.tiled_argument_words(args[0], args[1], *args[3:],
                                                            swizzle=tensor_map.SWIZZLE_128B)]


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
        # TMA copies: the maps of the tensors the boxes name (their places among the inputs), made per call.
        self._tma = None
        if program.tma_boxes:
            extents = {box.tensor: row_extents(arrays[box.tensor]) for box in program.tma_boxes}
            self._tma = TmaMaps(program.tma_boxes, problem, strides, extents)
        self._tma_inputs = None
        if self._tma is not None:
            getter = operator.itemgetter(*(self.inputs.index(name) for name in self._tma.tensors))
            # itemgetter of one index gives the item, of several a tuple: block() takes a tuple.
            self._tma_inputs = getter if len(self._tma.tensors) > 1 else (lambda found: (getter(found),))

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
        input_addresses = [*map(address, buffers)]
        tail = None if self._tma is None else self._tma.block(
            self._tma_inputs(input_addresses), backend.tensor_maps_by_driver)
        params = self._slots.pack(self._packed, [*input_addresses, *scratch_addresses], tail)
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
