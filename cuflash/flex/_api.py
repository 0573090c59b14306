"""flex_attention and flex_attention_backward on NumPy (simulator) and CuPy (GPU) arrays.

The fa2 programs (tensor cores for float16 / bfloat16, SIMT for float32) with the call's mods compiled into their
main kernels (cuflash.flex._kernels). Everything a kernel needs of the mods travels in AttentionParams: the side
arrays' descriptors (flex_sides) and the side gradients' buffers (flex_side_grads), so the same programs can run
from the JAX FFI handler.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from typing import Any

import numpy as np

try:
    import jax
except ImportError:  # the NumPy / CuPy API without JAX: Python mods need it anyway
    jax = None

from .. import _validation as V
from .._placement import Placement, ascontiguous
from ..backends.program import PreparedProgram
from ..kernels import plans
from ..kernels.program import MAX_KERNEL_HEADDIM_V, Problem
from ._kernels import hooked_program
from ._mod import MAX_SIDES, FlexMod
from ._trace_cache import traced_mod
from .block_mask import BlockMask, create_block_mask

_ALGORITHM = "fa2"
# The most bytes deterministic side gradients may take in per-warp float32 slices (Call.side_grad_slices x each
# captured array's size): a small table's slices are kilobytes, a dense (B, H, L, L) bias's would be terabytes.
DETERMINISTIC_SIDE_GRAD_BYTES = 1 << 30


def contiguous_last_dim(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arrays with each whose last dimension the kernels cannot take as it is (V.needs_copy, the rule) copied to a
    contiguous one. Per call: a flex call is not cached by signature (api.Prepared works it out once per signature)."""
    return tuple([ascontiguous(a) if V.needs_copy(a) else a for a in arrays])


def flex_problem(q: Any, k: Any, v: Any, deterministic: Any = False) -> Problem:
    """The checked Problem of a flex call (NumPy, CuPy and JAX alike): marked ``flex``, so the plans pick only variants
    whose kernels take the mods (each variant's refusal says "no flex" where its kernels take none)."""
    return dataclasses.replace(V.check_qkv(q, k, v, causal=False, deterministic=deterministic), flex=True)


def _flex_mod(mod: Any, kind: str, side_grads: bool = False) -> FlexMod | None:
    """The FlexMod of a score_mod / mask_mod argument: None, a FlexMod of that kind, or a Python function (traced)."""
    if mod is None:
        return None
    if isinstance(mod, FlexMod):
        if mod.kind != kind:
            raise TypeError(f"{kind}_mod must be a {kind} mod; {mod.name} is a {mod.kind} mod")
        return mod
    if not callable(mod):
        raise TypeError(f"{kind}_mod must be a function or a cuflash.flex.FlexMod, got {type(mod).__name__}")
    return traced_mod(mod, kind, side_grads)  # traced once per function and structure (_trace_cache)


def _check_block_mask(block_mask: Any, problem: Problem) -> None:
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.flex.BlockMask (create_block_mask), got "
                        f"{type(block_mask).__name__}")
    batch, heads, q_len, kv_len = block_mask.shape
    if batch not in (1, problem.batch) or heads not in (1, problem.nheads) or \
            (q_len, kv_len) != (problem.seqlen_q, problem.seqlen_k):
        raise ValueError(f"block_mask has shape (B, H, Q_LEN, KV_LEN) = {block_mask.shape}; q and k need B in (1, "
                         f"{problem.batch}), H in (1, {problem.nheads}), Q_LEN = {problem.seqlen_q} and KV_LEN = "
                         f"{problem.seqlen_k}")


def tile_visits(block_mask: BlockMask, problem: Problem, target: Any, backward: bool) -> tuple[str, tuple]:
    """A block mask through the main kernel's tiles, as AttentionParams.flex_tiles takes it (the one packing rule of
    the NumPy / CuPy path and of the JAX custom call): the member ("kv": the forward's K/V tiles per Q tile, or "q":
    the backward's Q tiles per K/V tile and kv head) and its (counts, indices, full, batch_stride, head_stride),
    int32 host arrays and the row-tile strides (0 where B or H broadcast)."""
    direction = "backward" if backward else "forward"
    traits = plans.variant_for(_ALGORITHM, problem, target, direction).module.tile_traits(problem, target, direction)
    lists = block_mask.tile_lists(traits.block_m, traits.block_n, heads_per_kv_list=problem.group_size)
    visits = lists.q if backward else lists.kv
    counts, indices, full = (np.ascontiguousarray(x, dtype=np.int32) for x in (visits.counts, visits.indices, visits.full))
    batch, heads, rows = counts.shape
    return ("q" if backward else "kv"), (counts, indices, full, heads * rows if batch > 1 else 0,
                                         rows if heads > 1 else 0)


_CALL_BLOCK_MASKS: "collections.OrderedDict[tuple, BlockMask]" = collections.OrderedDict()
_CALL_BLOCK_MASKS_KEPT = 32
CALL_BLOCK_SIZE = 128  # create_block_mask's default, FlexAttention's


def block_mask_for_call(mask_mod: Any, traced: FlexMod, problem: Problem) -> BlockMask | None:
    """The block mask a call without one builds from its mask_mod (so the kernels skip the tiles it hides), or None
    where the call runs the mask_mod densely on every score instead: an expert-form mod (no Python function to
    evaluate on the host) or one capturing a traced array (its values are unknown while tracing).

    Built per (mod structure, captured values, shapes, block size) and kept (the last _CALL_BLOCK_MASKS_KEPT): a
    step that calls again with the same mask builds it once. The values of captured arrays are part of the key, so
    a new document layout builds anew. One home for the NumPy / CuPy API and cuflash.jax.flex_attention."""
    if isinstance(mask_mod, FlexMod) or not callable(mask_mod):
        return None
    values = []
    for value in traced.side_values:
        if isinstance(value, jax.core.Tracer):
            return None
        array = np.asarray(value)  # a CuPy array's values come to the host for the key and the evaluation
        values.append((array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest()))
    key = (traced.cache_key, tuple(values), problem.batch, problem.nheads, problem.seqlen_q, problem.seqlen_k,
           CALL_BLOCK_SIZE)
    found = _CALL_BLOCK_MASKS.get(key)
    if found is None:
        found = create_block_mask(mask_mod, problem.batch, problem.nheads, problem.seqlen_q, problem.seqlen_k,
                                  block_size=CALL_BLOCK_SIZE)
        _CALL_BLOCK_MASKS[key] = found
        while len(_CALL_BLOCK_MASKS) > _CALL_BLOCK_MASKS_KEPT:
            _CALL_BLOCK_MASKS.popitem(last=False)
    _CALL_BLOCK_MASKS.move_to_end(key)
    return found


class _Call:
    """One checked flex call: its Problem, scale, mods and their side arrays placed on the call's backend."""

    def __init__(self, placement: Placement, q: Any, k: Any, v: Any, *, score_mod: Any, mask_mod: Any,
                 block_mask: Any, softmax_scale: Any, deterministic: Any, side_grads: bool = False):
        self.placement = placement
        self.problem = flex_problem(q, k, v, deterministic)
        if self.problem.headdim_v > MAX_KERNEL_HEADDIM_V:
            raise ValueError(f"flex_attention takes v's head dim up to {MAX_KERNEL_HEADDIM_V}, got "
                             f"{self.problem.headdim_v}")
        self.scale = V.check_softmax_scale(softmax_scale, self.problem.headdim)
        _check_block_mask(block_mask, self.problem)
        self.block_mask = block_mask
        if mask_mod is None and block_mask is not None:
            mask_mod = block_mask.mask_mod
        self.score_mod = _flex_mod(score_mod, "score", side_grads)
        self.mask_mod = _flex_mod(mask_mod, "mask")
        if self.block_mask is None and self.mask_mod is not None:
            self.block_mask = block_mask_for_call(mask_mod, self.mask_mod, self.problem)
        mods = [m for m in (self.score_mod, self.mask_mod) if m is not None]
        count = sum(len(m.sides) for m in mods)
        if count > MAX_SIDES:
            raise ValueError(f"score_mod and mask_mod capture {count} arrays together; a kernel reads at most "
                             f"{MAX_SIDES}")
        self.backend = placement.backend()
        with self.backend.device():
            self.sides = [self._placed(m, i, value) for m in mods for i, value in enumerate(m.kernel_side_values())]

    def _placed(self, mod: FlexMod, index: int, value: Any) -> Any:
        """A side array on the call's device, C-contiguous, of the dtype and shape the mod was compiled for (a
        bfloat16 one travels to a GPU as its 16-bit words: CuPy has no bfloat16; the kernel reads the bits)."""
        spec = mod.sides[index]
        if self.placement.on_gpu and type(value).__module__.startswith("cupy"):
            array, host = ascontiguous(value), None
        else:
            try:
                array = host = np.ascontiguousarray(value)
            except Exception as e:  # a tracer: flex_attention on NumPy / CuPy takes concrete arrays
                raise TypeError(f"{mod.kind}_mod {mod.name}: captured array {spec.name} is not concrete "
                                f"({type(value).__name__}): {e}") from None
        if tuple(array.shape) != spec.shape or str(array.dtype) != spec.stored_dtype:
            raise ValueError(f"{mod.kind}_mod {mod.name}: captured array {spec.name} is {array.dtype}"
                             f"{list(array.shape)}, compiled for {spec.stored_dtype}{list(spec.shape)}")
        if host is None:
            return array
        if self.placement.on_gpu and spec.stored_dtype == "bfloat16":
            host = host.view(np.uint16)
        return self.backend.upload(host)

    def program(self, backward: bool) -> Any:
        planner = plans.backward_program if backward else plans.forward_program
        return hooked_program(planner(_ALGORITHM, self.problem, self.backend.target), self.score_mod, self.mask_mod,
                              block_sparse=self.block_mask is not None)

    def tiles(self, backward: bool) -> dict[str, Any] | None:
        """The block mask's tile lists for the main kernel (tile_visits), on the call's device."""
        if self.block_mask is None:
            return None
        member, (counts, indices, full, batch_stride, head_stride) = tile_visits(
            self.block_mask, self.problem, self.backend.target, backward)
        upload = self.backend.upload
        return {member: (upload(counts), upload(indices), upload(full), batch_stride, head_stride)}

    def side_grad_slices(self) -> int:
        """Deterministic side gradients: the warps of the backward's main kernel, one float32 slice of each side
        gradient apiece (flex_hook.cuh's side_grads). Deterministic, that grid is (num_dq_splits, nheads_k, batch)
        with num_dq_splits at most enough blocks to fill the SMs (fa2.num_dq_splits_for), so the slices number at
        most (batch nheads_k + SMs) x warps per block: bounded by the device, not by the sequence lengths."""
        hooked = [plan for plan in self.program(True).launches if "FlexHook<" in plan.kernel.name_expr]
        if len(hooked) != 1:
            raise AssertionError(f"expected one main backward kernel with the mods, got {len(hooked)}")
        (plan,) = hooked
        return math.prod(plan.grid) * (math.prod(plan.block) // 32)

    def run(self, arrays: dict[str, Any], backward: bool = False, side_grads: tuple = (),
            side_grad_slices: int = 0) -> dict[str, Any]:
        prepared = PreparedProgram(self.program(backward), self.problem, self.scale, arrays)
        scratch = prepared.run(self.backend, arrays, sides=self.sides, side_grads=side_grads,
                               tiles=self.tiles(backward), side_grad_slices=side_grad_slices)
        return dict(zip(prepared.scratch_names, scratch))


def flex_attention(q: Any, k: Any, v: Any, *, score_mod: Any = None, mask_mod: Any = None, block_mask: Any = None,
                   softmax_scale: float | None = None, return_lse: bool = False, deterministic: bool = False) -> Any:
    """Attention with a user's score_mod and mask_mod (FlexAttention's signatures) compiled into the fa2 kernels.

    q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim), v (batch, seqlen_k, nheads_k,
    headdim_v): float16 / bfloat16 (tensor cores) or float32 (SIMT), NumPy (simulator) or CuPy (GPU); nheads a
    multiple of nheads_k (GQA / MQA), head dims 1..256, any lengths. The score of query row i and key j of query
    head h in batch b is

        score_mod(scale * q_i . k_j, b, h, i, j)   if mask_mod(b, h, i, j)   else -inf

    (scale = softmax_scale, default 1 / sqrt(headdim)); out = softmax(scores) v per row, and lse = logsumexp of the
    scores (float32 (batch, nheads, seqlen_q)) with return_lse. A row that sees no key gets out 0 and lse -inf.

    score_mod / mask_mod: Python functions (traced with cuflash.flex.trace_score_mod / trace_mask_mod, once per
    function and what its trace depends on: cuflash.flex._trace_cache; the jax arrays they capture are read anew at
    every call) or FlexMods (traced once; their captured values as traced).
    A kernel instance is compiled per mod structure and kernel tiles (cached on disk: new captured values reuse it).
    block_mask: a cuflash.flex.BlockMask of shape (B, H, seqlen_q, seqlen_k), B and H 1 or q's; its mask_mod is the
    call's when mask_mod is None. With a block mask the kernels read only the tiles it lists (BlockMask.tile_lists for
    their tile sizes: a tile it leaves empty is skipped unread, its scores hidden) and run mask_mod on its partial
    tiles only; without one, a block mask is built for the call from a Python mask_mod whose captured arrays are
    concrete (block_mask_for_call: kept per structure, values and shapes), and otherwise (a FlexMod, or a traced
    capture) mask_mod runs on every score. Errors (bad shapes or dtypes, an unsupported primitive in a mod) are raised before
    any kernel runs."""
    placement = Placement(("q", "k", "v"), (q, k, v))
    q, k, v = contiguous_last_dim(placement.arrays[:3])
    call = _Call(placement, q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                 softmax_scale=softmax_scale, deterministic=deterministic)
    return_lse = V.check_bool("return_lse", return_lse)
    backend, problem = call.backend, call.problem
    with backend.device():
        out = backend.empty((*q.shape[:-1], v.shape[-1]), q.dtype)
        lse = backend.empty(problem.row_stats_shape, np.float32)
        if problem.seqlen_k == 0:
            out[...] = 0
            lse[...] = -np.inf
        elif out.size:
            call.run({"q": q, "k": k, "v": v, "out": out, "lse": lse})
    out, lse = placement.results(out, lse)
    return (out, lse) if return_lse else out


def flex_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, score_mod: Any = None,
                            mask_mod: Any = None, block_mask: Any = None, softmax_scale: float | None = None,
                            deterministic: bool = False, return_aux_grads: bool = False) -> tuple[Any, ...]:
    """Gradients of flex_attention: (dq, dk, dv) for d loss / d out = dout, given the forward's out and lse (and its
    mods and options). score_mod's derivative in the score (FlexMod.has_dscore) is needed.

    return_aux_grads: also return the gradients to the float arrays score_mod captures, as a tuple with one entry
    per captured array of score_mod (float32 arrays of their shapes; None for integer and bool arrays): a Python
    score_mod is traced with side_grads=True, a FlexMod must have been. They are accumulated with float32 atomic
    adds, in no fixed order; with deterministic=True each warp of the backward adds into a float32 slice of its own,
    one lane at a time, and the slices are summed in order afterwards: bitwise reproducible, at (batch nheads_k +
    SMs) x warps slices of each array's size at most (Call.side_grad_slices), whatever the sequence lengths."""
    placement = Placement(("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse))
    dout, q, k, v, out = contiguous_last_dim(placement.arrays[:5])
    lse = placement.arrays[5]
    return_aux_grads = V.check_bool("return_aux_grads", return_aux_grads)
    call = _Call(placement, q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                 softmax_scale=softmax_scale, deterministic=deterministic, side_grads=return_aux_grads)
    problem, backend, mod = call.problem, call.backend, call.score_mod
    V.check_out_like("dout", dout, q, problem.headdim_v)
    V.check_out_like("out", out, q, problem.headdim_v)
    V.check_lse(lse, problem)
    if mod is not None and not mod.has_dscore:
        raise ValueError(f"score_mod {mod.name} has no derivative in score (cuda_mod without dscore): no backward")
    grad_sides = mod.grad_sides if mod is not None else ()
    if return_aux_grads:
        if mod is None:
            raise ValueError("return_aux_grads needs a score_mod (gradients go to the arrays it captures)")
        if not grad_sides and any(s.dtype in ("float32", "float16", "bfloat16") for s in mod.sides):
            raise ValueError(f"return_aux_grads: score_mod {mod.name} was traced without side_grads "
                             "(cuflash.flex.trace_score_mod(fn, side_grads=True))")
    if not lse.flags.c_contiguous:
        lse = ascontiguous(lse)
    slices = call.side_grad_slices() if problem.deterministic and grad_sides and return_aux_grads else 0
    if slices:
        slice_bytes = 4 * slices * sum(math.prod(mod.sides[i].shape) for i in grad_sides)
        if slice_bytes > DETERMINISTIC_SIDE_GRAD_BYTES:
            raise ValueError(
                f"deterministic=True: the side gradients of score_mod {mod.name} would take {slice_bytes / 2**30:.1f} "
                f"GiB of float32 slices ({slices} warps x each captured array's size; at most "
                f"{DETERMINISTIC_SIDE_GRAD_BYTES / 2**30:.0f} GiB); pass deterministic=False (float32 atomics) or "
                "capture a smaller array (a table indexed by position, not a dense bias)")
    with backend.device():
        dq = backend.empty(q.shape, q.dtype)
        dk = backend.empty(k.shape, k.dtype)
        dv = backend.empty(v.shape, v.dtype)
        side_grads = tuple(backend.zeros(((slices,) if slices else ()) + spec.shape)
                           if i in grad_sides and return_aux_grads else None
                           for i, spec in enumerate(mod.sides)) if mod is not None else ()
        if problem.seqlen_k == 0 or problem.seqlen_q == 0:
            for grad in (dq, dk, dv):
                grad[...] = 0
        elif dq.size:
            call.run({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv},
                     backward=True, side_grads=side_grads, side_grad_slices=slices)
        elif dk.size:
            dk[...] = 0
            dv[...] = 0
        if slices:  # the warps' slices summed in slice order (a fixed order: no atomics)
            side_grads = tuple(g if g is None else g.sum(axis=0) for g in side_grads)
    if not return_aux_grads:
        return placement.results(dq, dk, dv)
    present = [g for g in side_grads if g is not None]
    results = placement.results(dq, dk, dv, *present)
    aux = iter(results[3:])
    return (*results[:3], tuple(next(aux) if g is not None else None for g in side_grads))
