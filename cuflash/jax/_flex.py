"""cuflash.jax.flex_attention: the flex programs (cuflash.flex) as the JAX custom call, differentiable.

The call is the ``cuflash_program`` custom call of _primitives with a FlexSpec in its CallConfig: the mods' side
arrays are extra operands ("flex_side<i>"), a block mask's tile lists too ("flex_tiles_<member>_<list>"), and the
backward's gradients to the score_mod's float sides extra results ("flex_side_grad<i>", cleared by XLA). The FFI
handler writes their addresses into AttentionParams' flex fields (program_call.h); their descriptors (shapes,
strides, tile strides) are packed at lowering by the same rules PreparedProgram.run uses (params.sides_struct,
flex._api.tile_visits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .. import _validation as V
from ..flex._api import _ALGORITHM, _check_block_mask, _flex_mod, block_mask_for_call, flex_problem, tile_visits
from ..flex._kernels import hooked_program
from ..flex._mod import MAX_SIDES, FlexMod
from ..flex.block_mask import BlockMask
from ..kernels.params import sides_struct
from ..kernels.program import MAX_KERNEL_HEADDIM_V
from . import _primitives as P

_TILE_LISTS = ("counts", "indices", "full")
_FLOAT_SIDES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True, eq=False)
class FlexSpec:
    """The static part of a flex call (a primitive parameter: equal and hashed by the mods' structure, never by
    their side values, which are operands)."""

    score_mod: FlexMod | None
    mask_mod: FlexMod | None
    block_sparse: bool
    # A device's call on its shard of a sharded call (_partitioning.py): one more operand, "flex_shard_origin", the
    # shard's first global batch and query head (int32), so the mods see the whole call's b and h.
    shard_origin: bool = False

    @property
    def mods(self) -> tuple[FlexMod, ...]:
        return tuple(m for m in (self.score_mod, self.mask_mod) if m is not None)

    @property
    def grad_sides(self) -> tuple[int, ...]:
        return self.score_mod.grad_sides if self.score_mod is not None else ()

    def _key(self):
        return (tuple((m.kind, m.cache_key, m.grad_sides) for m in self.mods), self.block_sparse, self.shard_origin)

    def __eq__(self, other):
        return isinstance(other, FlexSpec) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def side_count(self) -> int:
        return sum(len(m.sides) for m in self.mods)

    def operand_names(self, direction: str) -> tuple[str, ...]:
        names = tuple(f"flex_side{i}" for i in range(self.side_count()))
        if self.block_sparse:
            member = "kv" if direction == "forward" else "q"
            names += tuple(f"flex_tiles_{member}_{name}" for name in _TILE_LISTS)
        return names + (("flex_shard_origin",) if self.shard_origin else ())

    def result_names(self) -> tuple[str, ...]:
        return tuple(f"flex_side_grad{i}" for i in self.grad_sides)

    def grad_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.score_mod.sides[i].shape for i in self.grad_sides)

    def program(self, program):
        return hooked_program(program, self.score_mod, self.mask_mod, block_sparse=self.block_sparse)

    def pack(self, params, shapes: dict[str, tuple[int, ...]]) -> None:
        """Write the flex descriptors into packed params (pointers null: the handler binds them per run)."""
        sides = [shapes[f"flex_side{i}"] for i in range(self.side_count())]
        params["flex_sides"] = sides_struct((0, shape, _contiguous(shape)) for shape in sides)
        for member in ("kv", "q"):
            key = f"flex_tiles_{member}_counts"
            if key in shapes:
                batch, heads, rows = shapes[key]
                lists = params["flex_tiles"][member]
                lists["batch_stride"] = heads * rows if batch > 1 else 0
                lists["head_stride"] = rows if heads > 1 else 0
                lists["columns"] = shapes[f"flex_tiles_{member}_indices"][-1]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _check_concrete_block_mask(block_mask: Any) -> None:
    leaves = jax.tree_util.tree_leaves(block_mask)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        raise TypeError("block_mask is traced (passed into a jitted function): cuflash.jax.flex_attention needs its "
                        "lists on the host to map them onto the kernels' tiles; create it outside jit (or close "
                        "over it)")


def _tiles(block_mask: BlockMask, problem, backward: bool) -> list:
    platform = jax.default_backend()
    target = P.target_for("cpu" if platform == "cpu" else "cuda")
    _, (counts, indices, full, _, _) = tile_visits(block_mask, problem, target, backward)
    # NumPy, not jnp: the backward's closure keeps them, and jnp.asarray inside a jit trace is a tracer of that trace
    # (it would outlive it in the cached custom_vjp); bound as operands, they become constants of whichever trace.
    return [counts, indices, full]


def flex_attention(q: Any, k: Any, v: Any, *, score_mod: Any = None, mask_mod: Any = None, block_mask: Any = None,
                   softmax_scale: float | None = None, return_lse: bool = False) -> Any:
    """cuflash.flex.flex_attention on JAX arrays, under jit, grad (to q, k, v and to the float arrays score_mod
    captures), vmap and sharded jit (split along batch and kv heads: _partitioning.py). score_mod / mask_mod: Python functions (traced at each call: under jit once per trace) or
    FlexMods; a traced array a mod captures (inside jit) becomes an operand. block_mask: a concrete
    cuflash.flex.BlockMask (its lists are mapped onto the kernels' tiles on the host)."""
    problem = flex_problem(q, k, v)
    if problem.headdim_v > MAX_KERNEL_HEADDIM_V:
        raise ValueError(f"flex_attention takes v's head dim up to {MAX_KERNEL_HEADDIM_V}, got {problem.headdim_v}")
    scale = V.check_softmax_scale(softmax_scale, problem.headdim)
    return_lse = V.check_bool("return_lse", return_lse)
    if block_mask is not None:
        _check_block_mask(block_mask, problem)
        _check_concrete_block_mask(block_mask)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    score = _flex_mod(score_mod, "score", side_grads=True)
    mask = _flex_mod(mask_mod, "mask")
    if block_mask is None and mask is not None:  # built for the call where the mod's captures are concrete
        block_mask = block_mask_for_call(mask_mod, mask, problem)
    mods = [m for m in (score, mask) if m is not None]
    if sum(len(m.sides) for m in mods) > MAX_SIDES:
        raise ValueError(f"score_mod and mask_mod capture {sum(len(m.sides) for m in mods)} arrays together; a "
                         f"kernel reads at most {MAX_SIDES}")
    sides = [jnp.asarray(value) for m in mods for value in m.kernel_side_values()]
    # The spec is a primitive parameter: it keeps the mods' structure, never their values (tracers under jit would
    # outlive their trace in JAX's caches); the values are the call's operands.
    spec = FlexSpec(*(None if m is None else dataclasses.replace(m, side_values=()) for m in (score, mask)),
                    block_mask is not None)
    for m in mods:  # the arrays as compiled for (bfloat16 stays bfloat16: the CPU handler reads the bits)
        for i, value in enumerate(m.kernel_side_values()):
            if tuple(np.shape(value)) != m.sides[i].shape:
                raise ValueError(f"{m.kind}_mod {m.name}: captured array {m.sides[i].name} has shape "
                                 f"{np.shape(value)}, compiled for {m.sides[i].shape}")
    tiles = ([_tiles(block_mask, problem, False), _tiles(block_mask, problem, True)] if block_mask is not None
             else [[], []])
    config = P.CallConfig(_ALGORITHM, problem, float(scale), flex=spec)
    out, lse = _differentiable(config, tuple(tiles[0]), tuple(tiles[1]), q, k, v, *sides)
    return (out, lse) if return_lse else out


def _differentiable(config: P.CallConfig, forward_tiles, backward_tiles, q, k, v, *sides):
    spec = config.flex

    @jax.custom_vjp
    def run(q, k, v, *sides):
        return tuple(P.call("forward", config, q, k, v, *sides, *forward_tiles))

    def forward(q, k, v, *sides):
        out, lse = run(q, k, v, *sides)
        return (out, lse), (q, k, v, out, lse, sides)

    def backward(residuals, cotangents):
        q, k, v, out, lse, sides = residuals
        dout, dlse = cotangents  # the lse's cotangent joins D (attention_params.cuh's dlse): a loss through lse
        if spec.score_mod is not None and not spec.score_mod.has_dscore:
            raise ValueError(f"score_mod {spec.score_mod.name} has no derivative in score: no backward")
        with_dlse = dataclasses.replace(config, with_dlse=True)
        dq, dk, dv, *grads = P.call("backward", with_dlse, dout.astype(q.dtype), q, k, v, out, lse,
                                    dlse.astype(jnp.float32), *sides, *backward_tiles)
        by_side = dict(zip(spec.grad_sides, grads))
        dsides = []
        for i, side in enumerate(sides):
            if i in by_side:
                dsides.append(by_side[i].astype(side.dtype))
            elif str(side.dtype) in _FLOAT_SIDES:
                dsides.append(jnp.zeros_like(side))
            else:
                dsides.append(np.zeros(side.shape, jax.dtypes.float0))
        return (dq, dk, dv, *dsides)

    run.defvjp(forward, backward)
    return run(q, k, v, *sides)
