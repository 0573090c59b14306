"""Sharding under plain ``jax.jit``: batch and heads split across devices with no collective.

Attention is independent per (batch, query head), and a kv head serves only its own group of query heads. So a
call on inputs sharded along batch and along kv heads (whole GQA groups per device) runs as the same call on each
device's shard: one custom call per device with the local batch and heads, outputs sharded like the inputs.

How: each primitive's lowering wraps the call in ``jax.experimental.custom_partitioning`` with a Shardy rule
(``b s (g r) d, b t g d, ... -> ...``: batch ``b`` and kv head ``g`` may be sharded, the query head is the compound
``(g r)`` of kv head and group member, sequence and head dim must stay whole) and a ``partition`` callback that
makes the per-device call: the Problem with the local batch and heads, lowered straight to the FFI custom call.
On one device, or inside a fully manual ``shard_map``, custom_partitioning lowers the call directly.

What stays whole, and so is gathered by XLA when an input is sharded there: the sequence axes (ring attention is
the way to shard them), the head dim, a head sharding that does not divide the kv heads (it would split a group),
and calls with dropout (its keep mask is a function of the global batch and head index) or varlen (packed rows
have no batch axis).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from ..kernels.program import Problem


def partitionable(problem: Problem) -> bool:
    """Whether a call may be split along batch and kv heads (see the module docstring)."""
    return problem.dropout_p == 0.0 and not problem.varlen


def _einsum_term(name: str, problem: Problem) -> str:
    if name in ("lse", "dlse"):
        return "b (g r) s"
    if name == "alibi_slopes":
        return "b (g r)" if problem.alibi == "batch_heads" else "(g r)"
    if name in ("q", "out", "dout", "dq"):
        return "b s (g r) d"
    return "b t g d"  # k, v, dk, dv


def sharding_rule(operands: Sequence[str], results: Sequence[str], problem: Problem) -> str:
    """The Shardy rule of a call binding ``operands`` and producing ``results`` (AttentionParams field names)."""
    return (", ".join(_einsum_term(n, problem) for n in operands) + " -> " +
            ", ".join(_einsum_term(n, problem) for n in results))


def _axis_size(mesh, axis: Any) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[name] for name in names)


def _spec_of(name: str, problem: Problem, batch_axis: Any, head_axis: Any) -> PartitionSpec:
    term = _einsum_term(name, problem).split(" ")
    axes = {"b": batch_axis, "g": head_axis, "(g": head_axis}
    return PartitionSpec(*(axes.get(factor) for factor in term if factor != "r)"))


def local_split(mesh, q_sharding: Any, problem: Problem) -> tuple[Any, Any]:
    """(batch mesh axis, head mesh axis) a call is split along: q's, where they divide the batch and the kv heads."""
    spec = getattr(q_sharding, "spec", None)
    if not isinstance(q_sharding, NamedSharding) or spec is None:
        return None, None
    spec = tuple(spec) + (None,) * (4 - len(spec))
    batch_axis, head_axis = spec[0], spec[2]
    if problem.batch % _axis_size(mesh, batch_axis):
        batch_axis = None
    if problem.nheads_k % _axis_size(mesh, head_axis):
        head_axis = None  # it would split a GQA group
    return batch_axis, head_axis


def local_problem(mesh, problem: Problem, batch_axis: Any, head_axis: Any) -> Problem:
    batch_parts, head_parts = _axis_size(mesh, batch_axis), _axis_size(mesh, head_axis)
    return dataclasses.replace(problem, batch=problem.batch // batch_parts, nheads=problem.nheads // head_parts,
                               nheads_k=problem.nheads_k // head_parts)


def partitioned_call(bind, operands: Sequence[str], results: Sequence[str], problem: Problem):
    """A custom_partitioning function of the operands that calls ``bind(local_problem, *operands)`` per device.

    ``bind(problem, *arrays)`` binds the primitive for ``problem`` lowered straight to the custom call."""

    def call(*arrays):
        return tuple(bind(problem, *arrays))

    wrapped = custom_partitioning(call)

    def shardings(mesh, arg_shapes):
        batch_axis, head_axis = local_split(mesh, arg_shapes[operands.index("q")].sharding, problem)
        arg_shardings = tuple(NamedSharding(mesh, _spec_of(n, problem, batch_axis, head_axis)) for n in operands)
        result_shardings = tuple(NamedSharding(mesh, _spec_of(n, problem, batch_axis, head_axis)) for n in results)
        return batch_axis, head_axis, arg_shardings, result_shardings

    def partition(mesh, arg_shapes, result_shape):
        batch_axis, head_axis, arg_shardings, result_shardings = shardings(mesh, arg_shapes)
        local = local_problem(mesh, problem, batch_axis, head_axis)

        def lower_fn(*arrays):
            return tuple(bind(local, *arrays))

        return mesh, lower_fn, result_shardings, arg_shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[3]

    rule = sharding_rule(operands, results, problem)
    wrapped.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                          sharding_rule=rule, need_replication_factors=("s", "d", "t"),  # in order of appearance
                          r=problem.group_size)
    return wrapped
