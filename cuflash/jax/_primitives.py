"""Two JAX primitives, one per direction, lowered to the ``cuflash_program`` FFI custom call.

A primitive carries only static facts (algorithm, Problem, softmax scale). Its
lowering rule asks the kernel family for the launch-plan Program, the one source
of truth every backend uses, packs AttentionParams with
``cuflash.kernels.params.pack_params`` (pointer fields left zero), and emits one
custom call whose attributes are plain data: params bytes, buffer bindings,
kernel name expressions, grids, blocks, shared memory. Scratch buffers become
extra results of the custom call, so XLA allocates them and keeps them alive
until the kernels that use them have run; the lowering drops them afterwards.

Kernels are identified by name expression only. The lowering rule of each
platform makes sure this process can resolve those names at run time (CPU: the
simulator entry point of a library holding the kernel; CUDA: the CUBIN NVRTC
compiled for each local GPU's arch), which is what lets an executable loaded
from JAX's persistent compilation cache in another process find its kernels:
that process lowers the same function (JAX needs the module to compute the
cache key), and lowering is where the registry is filled.

Batching (vmap) folds the mapped axis into the batch axis, so one launch covers
every mapped element; when that would exceed CUDA's grid limit the mapped axis is
split into chunks that fit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from .. import _validation as V
from ..kernels import plans, targets, tensor_map
from ..kernels.targets import Target
from ..kernels.program import KernelInstance
from ..kernels.params import QUERY_SIDE_TENSORS, TENSOR_FIELDS, VALUE_WIDTH_TENSORS, pack_params
from ..kernels.program import LaunchPlan, Problem, Program, value_column_chunks
from . import _ffi, _partitioning


@dataclasses.dataclass(frozen=True)
class CallConfig:
    """The static part of one attention call (hashable: it is a primitive parameter)."""

    algorithm: str
    problem: Problem
    softmax_scale: float
    with_dlse: bool = False  # backward: the lse's cotangent is an operand (attention_params.cuh's dlse)
    # KV cache: the shape of the caches k and v bind (see tensor_shape), which the Problem does not hold.
    cache_shape: tuple[int, int, int, int] | None = None
    # flex_attention: the mods compiled into the kernels (_flex.FlexSpec); their side arrays and a block mask's tile
    # lists are extra operands, the side gradients extra results of the backward.
    flex: object = None


FORWARD_OPERANDS = ("q", "k", "v")
FORWARD_RESULTS = ("out", "lse")
BACKWARD_OPERANDS = ("dout", "q", "k", "v", "out", "lse")
BACKWARD_RESULTS = ("dq", "dk", "dv")


def operand_names(direction: str, config: CallConfig) -> tuple[str, ...]:
    """The AttentionParams fields a call's operands bind, in order: the fixed ones, then the optional inputs."""
    names = FORWARD_OPERANDS if direction == "forward" else BACKWARD_OPERANDS
    names += side_input_names(config.problem)
    if direction == "backward" and config.with_dlse:
        names += ("dlse",)
    if config.flex is not None:
        names += config.flex.operand_names(direction)
    return names


def result_names(direction: str, config: CallConfig) -> tuple[str, ...]:
    """The AttentionParams fields a call's results bind: out and lse, or dq, dk, dv (then flex side gradients)."""
    if direction == "forward":
        return FORWARD_RESULTS
    return BACKWARD_RESULTS + (config.flex.result_names() if config.flex is not None else ())


def side_input_names(problem: Problem) -> tuple[str, ...]:
    """The optional inputs both directions take, in operand order: ALiBi slopes, sinks, dropout's seed words, varlen's
    cu_seqlens (and used prefixes), a KV cache's keys in use per sequence, a paged one's block_table and a contiguous
    one's cache_batch_idx and cache_leftpad (int32 words as float32)."""
    names = ("alibi_slopes",) if problem.alibi is not None else ()
    names += ("sinks",) if problem.sinks else ()
    names += ("dropout_seed",) if problem.dropout_p > 0.0 else ()
    names += ("cu_seqlens_q", "cu_seqlens_k") if problem.varlen else ()
    names += ("seqused_q",) if problem.seqused_q else ()
    names += ("seqused_k",) if problem.kvcache or problem.seqused_k else ()
    names += ("block_table",) if problem.page_size else ()
    names += ("cache_batch_idx",) if problem.cache_batch_idx else ()
    return names + (("cache_leftpad",) if problem.cache_leftpad else ())


def tensor_shape(name: str, problem: Problem, cache_shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """(batch, seqlen, heads, d) tensors and (batch, nheads, seqlen_q) row stats, or for varlen the packed
    (total, heads, d) tensors and (nheads, total_q) row stats. A KV cache's k and v are the caches themselves,
    ``cache_shape``: (batch, seqlen_cache, nheads_k, d), whose rows the Problem's seqlen_k (the longest sequence in
    use) need not fill, or paged (num_pages, page_size, nheads_k, d), whose page count is no part of the Problem."""
    if name in ("lse", "dlse"):
        return problem.row_stats_shape
    if problem.kvcache and name in ("k", "v"):
        if cache_shape is None:
            raise ValueError("a KV cache's k and v have the caches' shape, which the Problem does not hold: pass "
                             "cache_shape")
        width = problem.headdim_v if name == "v" else problem.headdim  # the caches share all but the head dim
        return (*cache_shape[:3], width)
    query_side = name in QUERY_SIDE_TENSORS  # q, out, dout, dq; the others use seqlen_k, nheads_k
    heads = problem.nheads if query_side else problem.nheads_k
    width = problem.headdim_v if name in VALUE_WIDTH_TENSORS else problem.headdim  # v, out, dout, dv: v's
    if problem.varlen:
        return (problem.total_q if query_side else problem.total_k, heads, width)
    return (problem.batch, problem.seqlen_q if query_side else problem.seqlen_k, heads, width)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, row, head) element strides of a row-major (batch, seqlen, heads, headdim) array, or of a packed
    (total, heads, headdim) one (batch stride 0, as backends.program.element_strides)."""
    *outer, heads, headdim = shape
    rows = outer[-1]
    return (rows * heads * headdim if len(outer) == 2 else 0, heads * headdim, headdim)


def target_for(platform: str) -> Target:
    """The target a plan lowered for ``platform`` is made for: the simulator's on the CPU; on CUDA the
    local devices' (the smallest shared-memory limit among them, so the plan launches on each), with the smallest
    SM count among them (the split-KV heuristic's: each device's own where JAX tells it, its arch's otherwise)."""
    if platform == "cpu":
        from .. import sim

        return sim.current_target()
    found = [targets.for_device(*capability, sm_count=sm_count) for capability, sm_count in _local_cuda_devices()]
    if not found:
        return targets.target(targets.DEFAULT_ARCH)
    smallest = min(found, key=lambda t: t.smem_per_block_bytes)
    return dataclasses.replace(smallest, sm_count=min(t.sm_count for t in found))


def program_for(direction: str, config: CallConfig, platform: str = "cpu") -> Program:
    planner = plans.forward_program if direction == "forward" else plans.backward_program
    program = planner(config.algorithm, config.problem, target_for(platform))
    return program if config.flex is None else config.flex.program(program)


def custom_call_attributes(
    direction: str, config: CallConfig, program: Program, launches: Sequence[LaunchPlan],
    operand_shapes: Sequence[tuple[int, ...]] = (),
) -> dict[str, object]:
    """The custom call's attributes: plain data, nothing process-specific."""
    problem = config.problem
    operands = operand_names(direction, config)
    results = result_names(direction, config)
    tensors = [name for name in operands + results if name in TENSOR_FIELDS]
    params = pack_params(
        problem,
        softmax_scale=config.softmax_scale,
        pointers={},
        strides={name: contiguous_strides(tensor_shape(name, problem, config.cache_shape)) for name in tensors},
        num_dq_splits=program.num_dq_splits,
        num_kv_splits=program.num_kv_splits,
    )
    if config.flex is not None:  # the descriptors of the flex operands (their addresses stay null: bound per run)
        config.flex.pack(params, dict(zip(operands, operand_shapes)))
    params = bytearray(params.tobytes())
    tma = tma_attributes(program, problem, shape_of=lambda name: tensor_shape(name, problem, config.cache_shape))
    tma_block = tma.pop("tma_block")
    if tma_block is not None:  # tma_loads 1 and the maps with their addresses 0: the handlers patch them per call
        at, block = tma_block
        params[at: at + len(block)] = block
    bindings = list(operands) + list(results) + [scratch.name for scratch in program.scratch]
    # flex side gradients are accumulated with atomic adds: XLA's buffer starts cleared
    zero_init = [int(name.startswith("flex_side_grad")) for name in results] + \
        [int(scratch.zero_init) for scratch in program.scratch]
    return dict(
        params=np.frombuffer(bytes(params), dtype=np.uint8).copy(),
        bindings=",".join(bindings),
        zero_init=np.asarray(zero_init, dtype=np.uint8),
        kernels=";".join(plan.kernel.name_expr for plan in launches),
        grid=np.asarray([d for plan in launches for d in plan.grid], dtype=np.int32),
        block=np.asarray([d for plan in launches for d in plan.block], dtype=np.int32),
        smem=np.asarray([plan.dynamic_smem_bytes for plan in launches], dtype=np.int32),
        version=_ffi.call_abi(),  # the handler refuses a call lowered by another cuflash version or layout
        **tma,
    )


def tma_attributes(program: Program, problem: Problem, shape_of) -> dict[str, object]:
    """The TMA part of a custom call: the tensor maps of the program's TMA copies (Program.tma_boxes), decided and
    encoded by the CuPy / NumPy path's own TmaMaps (the same arrays TMA cannot take there fall back here) for the
    contiguous arrays a call binds (``shape_of(name)``: each bound tensor's shape), everything but the addresses.

    ``tma_block``: (offset, bytes) to lay over the params (tma_loads 1, the maps' twin encodings with address 0),
    None with no maps (tma_loads stays 0: the kernels copy with loads). The attributes: ``tma_tensors`` the bound
    tensor of each map ("q,k,v"), ``tma_arguments`` cuTensorMapEncodeTiled's arguments but the address per map
    (tensor_map.tiled_argument_words: the CUDA handler encodes with the driver per call), ``tma_twin_address_at``
    where a twin map holds its address (the CPU handler patches it in), ``tma_address_alignment`` what an address
    needs (a call whose tensor is not so aligned runs with tma_loads 0, as TmaMaps.block)."""
    from ..backends.program import TmaMaps, row_extents


    tensors = [box.tensor for box in program.tma_boxes]
    maps = TmaMaps(program.tma_boxes, problem, {t: contiguous_strides(shape_of(t)) for t in tensors},
                   {t: row_extents(shape_of(t)) for t in tensors}) if tensors else None
    block = maps.template() if maps is not None else None
    return dict(
        tma_block=block,
        tma_tensors=",".join(maps.tensors) if block is not None else "",
        tma_arguments=np.asarray(maps.argument_words() if block is not None else [], dtype=np.int64),
        tma_twin_address_at=np.int64(tensor_map.TWIN_ADDRESS_OFFSET),
        tma_address_alignment=np.int64(TmaMaps.address_alignment),
    )


# ---------------------------------------------------------------------------
# Kernel registries, filled while lowering.

_sim_registered: dict[tuple[str, KernelInstance], int] = {}


def register_cpu_kernels(instances: Sequence[KernelInstance]) -> None:
    """Point the CPU handler's registry at simulator libraries holding these kernels (current sim mode)."""
    from .. import sim

    mode = sim.current_mode()
    for instance in instances:
        key = (mode, instance)
        address = sim.launch_entry_address(instance, mode)
        if _sim_registered.get(key) != address or not _ffi.sim_kernel_registered(instance.name_expr):
            _ffi.register_sim_kernel(instance.name_expr, address)
            _sim_registered[key] = address


def _local_cuda_devices() -> list[tuple[tuple[int, int], int | None]]:
    """((major, minor), SM count or None where JAX does not tell it) of every local CUDA device JAX sees (none
    when JAX has no CUDA backend). JAX's GPU devices report their SMs as ``core_count``."""
    try:
        devices = jax.local_devices(backend="cuda")
    except RuntimeError:
        return []
    found = []
    for device in devices:
        capability = getattr(device, "compute_capability", None)
        if capability:
            major, minor = str(capability).split(".")
            found.append(((int(major), int(minor)), getattr(device, "core_count", None)))
    return found


def local_cuda_capabilities() -> list[tuple[int, int]]:
    """(major, minor) of every local CUDA device JAX sees (none when JAX has no CUDA backend)."""
    return sorted({capability for capability, _ in _local_cuda_devices()})


def local_cuda_archs() -> list[str]:
    """"sm_XY" of every local CUDA device JAX sees."""
    return [targets.arch_name(major, minor) for major, minor in local_cuda_capabilities()]


def register_device_code(instance: KernelInstance, device_arch: str) -> None:
    """Compile (through NVRTC's disk cache) the code kernels.toolchain chooses for devices of ``device_arch``
    (their CUBIN, or PTX for a GPU newer than NVRTC; a ToolchainError naming the driver, the arch and what to
    install when there is none) and register it for them."""
    from ..kernels import catalog, nvrtc, toolchain

    code = toolchain.code_for_device(*targets.capability_of(device_arch))
    # The catalog may specialize the device's code (sm_90a for the Hopper kernels on a sm_90 device).
    compiled = nvrtc.compile_instance(instance, catalog.compile_arch(instance, code.compile_arch))
    _ffi.register_module_image(instance.name_expr, device_arch, compiled.lowered_name, compiled.code)


def register_cuda_kernels(instances: Sequence[KernelInstance]) -> None:
    """Register the code of these kernels for every local GPU arch (while lowering: before anything runs)."""
    for arch in local_cuda_archs():
        for instance in instances:
            if not _ffi.module_image_registered(instance.name_expr, arch):
                register_device_code(instance, arch)


_REGISTER_KERNELS = {"cpu": register_cpu_kernels, "cuda": register_cuda_kernels}


@functools.lru_cache(maxsize=1)
def _instances_by_name() -> dict[str, KernelInstance]:
    from ..kernels import catalog

    return {instance.name_expr: instance for instance in catalog.all_instances()}


def resolve_kernel(name_expr: str, target: str) -> bool:
    """Register a kernel the handlers met without this process having lowered a call to it (an executable from
    jax.export or another process's cache): "sim" registers the simulator library's entry in the current checking
    mode, "sm_XY" the code NVRTC compiles for devices of that arch. False for a name the catalog does not know."""
    instance = _instances_by_name().get(name_expr)
    if instance is None:
        return False
    if target == "sim":
        register_cpu_kernels([instance])
        return True
    register_device_code(instance, target)
    return True


def _forget_sim_kernels() -> None:
    """Unregister every simulator kernel: the next execution resolves each again in the current checking mode."""
    for _, instance in list(_sim_registered):
        _ffi.unregister_sim_kernel(instance.name_expr)
    _sim_registered.clear()


def install() -> None:
    """Register the custom-call targets with JAX and the kernel resolver with the handlers: what a process that
    runs a deserialized (jax.export) executable needs before its first call. Done when cuflash.jax is imported.
    Also makes the simulator's checking mode reach already-compiled executables (sim.on_mode_change)."""
    from .. import sim

    _ffi.register_targets()
    _ffi.set_resolver(resolve_kernel)
    sim.on_mode_change(_forget_sim_kernels)


# ---------------------------------------------------------------------------
# Primitives.

attention_forward_p = Primitive("cuflash_attention_forward")
attention_forward_p.multiple_results = True
attention_backward_p = Primitive("cuflash_attention_backward")
attention_backward_p.multiple_results = True

_PRIMITIVES = {"forward": attention_forward_p, "backward": attention_backward_p}


def _abstract_eval(direction: str, *avals, config: CallConfig):
    problem = config.problem
    names = FORWARD_RESULTS if direction == "forward" else BACKWARD_RESULTS
    element = avals[FORWARD_OPERANDS.index("q") if direction == "forward" else BACKWARD_OPERANDS.index("q")].dtype
    results = [
        jax.core.ShapedArray(tensor_shape(name, problem), np.float32 if name == "lse" else element)
        for name in names
    ]
    if config.flex is not None and direction == "backward":
        results += [jax.core.ShapedArray(shape, np.float32) for shape in config.flex.grad_shapes()]
    return results


def _lowering(ctx, *operands, config: CallConfig, direction: str, platform: str):
    program = program_for(direction, config, platform)
    launches = [plan for plan in program.launches if not plan.is_empty]
    _ffi.register_targets()
    _REGISTER_KERNELS[platform](list(dict.fromkeys(plan.kernel for plan in launches)))
    scratch_avals = [jax.core.ShapedArray(scratch.shape, np.float32) for scratch in program.scratch]
    call_ctx = ctx.replace(avals_out=[*ctx.avals_out, *scratch_avals])
    attributes = custom_call_attributes(direction, config, program, launches,
                                        [tuple(aval.shape) for aval in ctx.avals_in])
    results = jax.ffi.ffi_lowering(_ffi.TARGET_NAME)(call_ctx, *operands, **attributes)
    return results[: len(ctx.avals_out)]


def _move_to_front(x, dim, size):
    if dim is None:  # unmapped operand: every mapped element shares it
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _batching(direction: str, args, dims, *, config: CallConfig):
    return batched_call(direction, config, args, dims, _PRIMITIVES[direction].bind)


def batched_call(direction: str, config: CallConfig, args, dims, bind):
    """vmap of one call (``bind(*arrays, config=...)`` makes the unbatched calls): fold the mapped axis into batch (one launch), chunked to respect the grid limit.

    A forward whose k and v are not mapped folds the mapped axis into the query heads instead, so k and v are not
    broadcast (_forward_folded_into_heads).
    ALiBi slopes shared by every mapped element with one slope per head stay as they are; otherwise they are
    broadcast to (mapped, batch, nheads) and fold like the rest, as per-(batch, head) slopes.
    With dropout, the keep mask depends on the batch index and the seed (dropout.cuh): the seed rows fold with the
    batch too, each mapped element's batches taking its own seed as its own batches (Problem's
    dropout_batches_per_seed), so the fold drops what each element's call drops.
    Varlen tensors are packed along their only outer axis, which has no batch to fold into; a KV cache's split-KV
    heuristic (and any call's, num_splits=0) depends on the batch and heads, and a paged cache's block_table numbers
    the pages of one cache: in these cases each mapped element runs its own call (on its slice of each mapped
    operand), so vmap equals a loop of per-element calls, bitwise. Sinks shared by every mapped element stay as they
    are; mapped ones (a logit per element and head) fold into the query heads with them, or else take the
    per-element calls too."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    names = operand_names(direction, config)
    problem = config.problem
    batch = problem.batch
    heads_fold = (direction == "forward" and dims[names.index("k")] is None and dims[names.index("v")] is None
                  and problem.dropout_p == 0.0 and problem.nheads * size <= V.MAX_GRID_YZ)
    mapped_sinks = problem.sinks and dims[names.index("sinks")] is not None
    # flex: the mods read b and h (and the sides and tile lists are per batch), so no fold keeps their meaning
    if problem.varlen or problem.kvcache or problem.num_splits == 0 or (mapped_sinks and not heads_fold) or \
            config.flex is not None:
        members = [bind(*(x if d is None else jnp.take(x, m, axis=d) for x, d in zip(args, dims)), config=config)
                   for m in range(size)]
        return [jnp.stack(parts) for parts in zip(*members)], [0] * len(members[0])
    if heads_fold:
        return _forward_folded_into_heads(config, args, dims, size, bind)
    if problem.dropout_p > 0.0:  # seed rows fold like the batch (a nested vmap's call already has its rows)
        per_seed = problem.dropout_batches_per_seed or batch
        config = dataclasses.replace(config, problem=dataclasses.replace(problem, dropout_batches_per_seed=per_seed))
    args, dims = list(args), list(dims)
    shared = set()  # operands every mapped element shares as they are: indices into args
    if problem.sinks:  # not mapped here (mapped sinks took the per-element calls above)
        shared.add(names.index("sinks"))
    if "alibi_slopes" in names:
        i = names.index("alibi_slopes")
        if dims[i] is None and problem.alibi == "heads":
            shared.add(i)
        else:
            slopes = _move_to_front(args[i], dims[i], size)
            args[i] = jnp.broadcast_to(slopes.reshape((size, -1, problem.nheads)), (size, batch, problem.nheads))
            dims[i] = 0
            config = dataclasses.replace(config, problem=dataclasses.replace(problem, alibi="batch_heads"))
    args = [x if i in shared else _move_to_front(x, d, size) for i, (x, d) in enumerate(zip(args, dims))]
    chunk = max(1, V.MAX_GRID_YZ // max(batch, 1))
    pieces = []
    for start in range(0, size, chunk):
        members = min(chunk, size - start)
        part = args if members == size else [x if i in shared else x[start : start + members]
                                             for i, x in enumerate(args)]
        # (members, batch, ...) -> (members * batch, ...); dropout's (members, seed words) -> one table of rows
        folded = [x if i in shared else x.reshape((members * x.shape[1],) + x.shape[2:]) for i, x in enumerate(part)]
        problem = dataclasses.replace(config.problem, batch=members * batch)
        outs = bind(*folded, config=dataclasses.replace(config, problem=problem))
        pieces.append([o.reshape((members, batch) + o.shape[1:]) for o in outs])
    if len(pieces) == 1:
        results = pieces[0]
    else:
        results = [jnp.concatenate(parts, axis=0) for parts in zip(*pieces)]
    return results, [0] * len(results)


def _forward_folded_into_heads(config: CallConfig, args, dims, size: int, bind):
    """vmap of a forward call whose k and v are shared by every mapped element: the mapped axis becomes part of the
    query heads (query head h of element m is head h * size + m, so each kv head's group grows by size and keeps
    its query heads together). One launch, and k and v are read as they are, never broadcast or copied.

    Each (batch, head, row) computes exactly what it computes unbatched: the results are bitwise a loop's."""
    problem = config.problem
    names = operand_names("forward", config)
    nheads, batch = problem.nheads, problem.batch
    inputs = {name: (x, d) for name, x, d in zip(names, args, dims)}
    q = _move_to_front(*inputs["q"], size)  # (size, batch, seqlen_q, nheads, d)
    q = jnp.moveaxis(q, 0, 3).reshape(batch, problem.seqlen_q, nheads * size, problem.headdim)
    folded = {"q": q, "k": inputs["k"][0], "v": inputs["v"][0]}
    alibi = problem.alibi
    if alibi is not None:
        slopes, slopes_dim = inputs["alibi_slopes"]
        slopes = _move_to_front(slopes, slopes_dim, size).reshape(size, -1, nheads)
        slopes = jnp.broadcast_to(slopes, (size, batch, nheads))  # (size, batch, nheads)
        folded["alibi_slopes"] = jnp.moveaxis(slopes, 0, 2).reshape(batch, nheads * size)
        alibi = "batch_heads"
    if problem.sinks:  # query head h of element m is head h * size + m
        sinks, sinks_dim = inputs["sinks"]
        folded["sinks"] = jnp.moveaxis(_move_to_front(sinks, sinks_dim, size), 0, 1).reshape(nheads * size)
    local = dataclasses.replace(problem, nheads=nheads * size, alibi=alibi)
    out, lse = bind(*(folded[name] for name in names), config=dataclasses.replace(config, problem=local))
    out = jnp.moveaxis(out.reshape(batch, problem.seqlen_q, nheads, size, problem.headdim_v), 3, 0)
    lse = jnp.moveaxis(lse.reshape(batch, nheads, size, problem.seqlen_q), 2, 0)
    return [out, lse], [0, 0]


@functools.lru_cache(maxsize=256)
def _eager(direction: str, config: CallConfig):
    primitive = _PRIMITIVES[direction]
    return jax.jit(lambda *args: primitive.bind(*args, config=config))


def _impl(direction: str, *args, config: CallConfig):
    """Eager calls run the primitive as a one-op jitted computation (cached per direction and config)."""
    return _eager(direction, config)(*args)


for _direction, _primitive in _PRIMITIVES.items():
    _primitive.def_impl(functools.partial(_impl, _direction))
    _primitive.def_abstract_eval(functools.partial(_abstract_eval, _direction))
    batching.primitive_batchers[_primitive] = functools.partial(_batching, _direction)
    for _platform in _REGISTER_KERNELS:
        mlir.register_lowering(
            _primitive, functools.partial(_lowering, direction=_direction, platform=_platform), platform=_platform
        )


# ---------------------------------------------------------------------------
# The call the differentiable functions make: partitioned under sharded jit where the problem allows it.


def call(direction: str, config: CallConfig, *arrays):
    """One forward or backward call on ``arrays`` (operand_names order), through custom_partitioning
    (_partitioning.py: split along batch and kv heads where the problem allows), wrapped in custom_vmap because
    custom_partitioning has no batching rule of its own: vmap folds into the batch as the primitive's rule does.
    A V wider than the kernels take runs as a call per column chunk (value_column_chunks)."""
    if config.flex is not None:  # the rule also needs the shapes of the side arrays and tile lists (flex_shapes)
        shapes = tuple((name, tuple(np.shape(x))) for name, x in zip(operand_names(direction, config), arrays)
                       if name.startswith("flex_"))
        return _partitioned(direction, config, shapes)(*arrays)
    chunks = value_column_chunks(config.problem.headdim_v)
    if len(chunks) > 1:
        return _call_in_value_chunks(direction, config, chunks, arrays)
    return _partitioned(direction, config)(*arrays)


def _call_in_value_chunks(direction: str, config: CallConfig, chunks: Sequence[tuple[int, int]], arrays):
    """``call`` chunk by chunk over V's columns, as the NumPy API runs them (api.Prepared.run): the forward's out is
    the chunks' laid side by side (their lse is the same: the first one's is returned); the backward's dv too, its
    dq and dk the chunks' summed in float32 in chunk order. The lse's cotangent joins D once: in the first chunk."""
    names = operand_names(direction, config)
    results = []
    for i, (start, stop) in enumerate(chunks):
        part = dataclasses.replace(config, problem=dataclasses.replace(config.problem, headdim_v=stop - start),
                                   with_dlse=config.with_dlse and i == 0)
        operands = [x[..., start:stop] if name in VALUE_WIDTH_TENSORS else x for name, x in zip(names, arrays)
                    if name != "dlse" or part.with_dlse]
        results.append(call(direction, part, *operands))
    if direction == "forward":
        return jnp.concatenate([out for out, _ in results], axis=-1), results[0][1]
    dq, dk = (sum((r[at].astype(jnp.float32) for r in results[1:]), results[0][at].astype(jnp.float32))
              .astype(results[0][at].dtype) for at in (0, 1))
    return dq, dk, jnp.concatenate([r[2] for r in results], axis=-1)


@functools.lru_cache(maxsize=256)
def _partitioned(direction: str, config: CallConfig, flex_shapes: tuple = ()):
    """``flex_shapes``: ((name, shape), ...) of a flex call's side arrays and tile lists (its rule names their
    dims)."""
    primitive = _PRIMITIVES[direction]
    results = result_names(direction, config)
    names = operand_names(direction, config)
    if config.flex is not None:
        flex_shapes = dict(flex_shapes)
        flex_shapes.update(zip(config.flex.result_names(), config.flex.grad_shapes()))

    def bind(problem: Problem, *arrays, shard_origin=None):
        """The call for ``problem``; a flex call on a device's shard passes the shard's origin (_flex.FlexSpec)."""
        local = dataclasses.replace(config, problem=problem)
        if config.cache_shape is not None:  # a device's shard of the caches (strides come from their shape)
            local = dataclasses.replace(local, cache_shape=tuple(arrays[names.index("k")].shape))
        if shard_origin is not None:
            local = dataclasses.replace(local, flex=dataclasses.replace(config.flex, shard_origin=True))
            arrays = (*arrays, shard_origin)
        return primitive.bind(*arrays, config=local)

    partitioned = _partitioning.partitioned_call(direction, bind, names, results, config.problem,
                                                 flex_shapes=flex_shapes if config.flex is not None else None)

    @custom_vmap
    def run(*arrays):
        return partitioned(*arrays)

    @run.def_vmap
    def run_batched(axis_size, in_batched, *arrays):
        dims = [0 if batched else None for batched in in_batched]
        outs, out_dims = batched_call(direction, config, arrays, dims,
                                      lambda *a, config: call(direction, config, *a))
        return tuple(outs), tuple(d == 0 for d in out_dims)

    return run
