"""Sharding under plain ``jax.jit``: batch and heads split across devices with no collective.

Attention is independent per (batch, query head), and a kv head serves only its own group of query heads. So a
call on inputs sharded along batch and along kv heads (whole GQA groups per device) runs as the same call on each
device's shard: one custom call per device with the local batch and heads, outputs sharded like the inputs.

How: each primitive's lowering wraps the call in ``jax.experimental.custom_partitioning`` with a Shardy rule
(``b s (g r) d, b t g d, ... -> ...``: batch ``b`` and kv head ``g`` may be sharded, the query head is the compound
``(g r)`` of kv head and group member (``g`` for MHA, ``r`` for MQA), sequence and head dim must stay whole) and a
``partition`` callback that makes the per-device call: the Problem with the local batch and heads, lowered
straight to the FFI custom call.
On one device, or inside a fully manual ``shard_map``, custom_partitioning lowers the call directly.

A sequence axis that q, k and v share runs as ring attention over it (_ring.py: K/V blocks rotate, partial results
merge by lse; under causal a zig-zag order balances the work), forward and backward, when the problem allows it:
no ALiBi, no window but causal, and shards that split evenly (see ring_possible); with dropout, chunks of whole
16-row groups.

With dropout the keep mask is a function of the global batch, head, row and key (dropout.cuh), so each device
passes its shard's first global batch and head in the seed buffer (words 2 and 3, from its mesh position) and a
ring's block calls their first global row and key (words 4 and 5): the shards drop exactly what the whole call
drops, and the results are bitwise the unsharded ones (the ring's within float32 rounding: its merge).

Flex calls (_flex.py: user mods compiled into the kernels) split along batch and kv heads the same way, never along
the sequence (the mods read global positions). The mods' side arrays are replicated (small tables, which a mod may
index by anything); a block mask's tile lists split with the batch and heads where they have them (B or H > 1),
whole where broadcast; each device passes its shard's first global batch and query head to the kernels
("flex_shard_origin", attention_params.cuh's flex::Shard), so the mods see the whole call's b and h; the
gradients to side arrays, each device's partial sums over its shard, are summed across the split axes (psum).

Varlen calls split along kv heads (packed rows have no batch axis, and every device reads all of cu_seqlens), as
tensor-parallel training shards them. KV-cache calls split along kv heads, and a cache that is not paged along
batch too, as tensor-parallel serving shards its caches; a paged cache's page pool is shared by every sequence,
so its batch stays whole. Each device's split-KV heuristic (num_splits=0) sees its local problem.

What stays whole, and so is gathered by XLA when an input is sharded there: the head dims, a sequence the ring
cannot take, a head
sharding that does not divide the kv heads (it would split a group), a varlen call's packed rows and a KV cache's
rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from ..kernels.params import VALUE_WIDTH_TENSORS
from ..kernels.program import Problem
from ..mask import Mask
from ._ring import ring_backward, ring_dropout_misalignment, ring_forward, with_block_positions


def _einsum_term(name: str, problem: Problem) -> str:
    """The operand's factors: batch b, sequences s (queries) and t (keys), kv head g with group member r, head dims
    d (q, k and their gradients) and v (v, out and theirs: MLA-style calls give v its own); a varlen call's packed
    rows are s and t with no batch, its cu_seqlens c; the dropout seed's words w; a paged KV cache's pages p of y rows
    each, named by block_table's z columns; the batch rows e of caches that cache_batch_idx indexes."""
    rows = "" if problem.varlen else "b "
    heads = _query_heads(problem)
    if name in ("lse", "dlse"):
        return f"{heads} s" if problem.varlen else f"b {heads} s"
    if name == "alibi_slopes":
        return f"b {heads}" if problem.alibi == "batch_heads" else heads
    if name == "sinks":
        return heads  # a logit per query head: split with the heads
    if name == "dropout_seed":
        return "w"  # the seed's words: every device gets them all
    if name in ("cu_seqlens_q", "cu_seqlens_k"):
        return "c"  # every device reads every sequence's bounds
    if name in ("seqused_q", "seqused_k", "cache_batch_idx", "cache_leftpad"):
        return "b"
    if name == "block_table":
        return "b z"
    width = "v" if name in VALUE_WIDTH_TENSORS else "d"
    if name in ("q", "out", "dout", "dq"):
        return f"{rows}s {heads} {width}"
    if problem.page_size:  # k, v: the page pool
        return f"p y g {width}"
    if problem.cache_batch_idx:  # k, v: caches whose batch rows any sequence may read
        return f"e t g {width}"
    return f"{rows}t g {width}"  # k, v, dk, dv (a KV cache's rows: its capacity)


def _query_heads(problem: Problem) -> str:
    """The query head's factors: kv head g and group member r; just g without groups (MHA) and just r with one kv
    head (MQA), since Shardy refuses a compound with a factor of size 1."""
    if problem.group_size == 1:
        return "g"
    return "r" if problem.nheads_k == 1 else "(g r)"


def _flex_term(name: str, shape: tuple[int, ...], problem: Problem) -> str:
    """A flex operand's factors: a side array's (and its gradient's) dims sideI_J, all its own; a tile list's
    batch and heads, b and the query heads (kv lists: per query head) or g (q lists: per kv head) where the list
    has them and its own factors where it broadcasts them (extent 1), then its row tiles and columns, its own."""
    if name.startswith("flex_side"):
        side = name.removeprefix("flex_side").removeprefix("_grad")
        return " ".join(f"side{side}_{d}" for d in range(len(shape)))
    _, _, member, _ = name.split("_")  # flex_tiles_<kv|q>_<list>
    batch = "b" if shape[0] == problem.batch > 1 else f"{member}_batch"
    heads = (_query_heads(problem), problem.nheads) if member == "kv" else ("g", problem.nheads_k)
    heads = heads[0] if shape[1] == heads[1] > 1 else f"{member}_heads"
    return " ".join([batch, heads, f"{member}_rows"] + ([f"{member}_columns"] if len(shape) == 4 else []))


def _terms(names: Sequence[str], problem: Problem, flex_shapes: dict | None) -> list[str]:
    return [_flex_term(n, flex_shapes[n], problem) if n.startswith("flex_") else _einsum_term(n, problem)
            for n in names]


def _whole_factors(operands: Sequence[str], problem: Problem, flex_shapes: dict | None = None) -> tuple[str, ...]:
    """The factors no device may split: the head dims; the seed's words; a varlen call's packed rows, its
    cu_seqlens and (with per-sequence ALiBi slopes or used prefixes) its batch, since the kernels find sequences by cu_seqlens; a
    KV cache's rows, and for a paged one its pages, their rows and the batch (block_table numbers pages of the whole
    pool); a flex call's sequences and its side arrays' and tile lists' own factors (_flex_term)."""
    whole = {"d", "v"} | ({"w"} if "dropout_seed" in operands else set())
    if problem.varlen:
        per_sequence = problem.alibi == "batch_heads" or problem.seqused_q or problem.seqused_k
        whole |= {"s", "t", "c"} | ({"b"} if per_sequence else set())
    if problem.kvcache:
        whole |= {"s"} | ({"b", "p", "y", "z"} if problem.page_size else {"t"})
        whole |= {"e"} if problem.cache_batch_idx else set()
    order = [f.strip("()") for term in _terms(operands, problem, flex_shapes) for f in term.split(" ") if f]
    if flex_shapes is not None:
        whole |= {"s", "t"} | {f for f in order if f not in ("b", "g", "r")}
    # In the order the rule first names them: Shardy wants its special factors' indices sorted.
    return tuple(sorted(whole & set(order), key=order.index))


def sharding_rule(operands: Sequence[str], results: Sequence[str], problem: Problem,
                  flex_shapes: dict | None = None) -> str:
    """The Shardy rule of a call binding ``operands`` and producing ``results`` (AttentionParams field names;
    ``flex_shapes``: the shapes of a flex call's side arrays, their gradients and its tile lists, by name)."""
    return (", ".join(_terms(operands, problem, flex_shapes)) + " -> " +
            ", ".join(_terms(results, problem, flex_shapes)))


def _axis_size(mesh, axis: Any) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[name] for name in names)


def _spec_of(name: str, problem: Problem, split: "Split", flex_shapes: dict | None = None) -> PartitionSpec:
    axes = {"b": split.batch, "g": split.heads, "(g": split.heads, "s": split.sequence, "t": split.sequence}
    term = _terms([name], problem, flex_shapes)[0]
    return PartitionSpec(*(axes.get(factor) for factor in term.split(" ") if factor and factor != "r)"))


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes a call is split along: batch, kv heads (with their groups) and, by ring attention, the
    sequence (None: not split along it)."""

    batch: Any = None
    heads: Any = None
    sequence: Any = None


def ring_possible(problem: Problem, parts: int) -> bool:
    """Whether the sharding rule may run ``problem`` as ring attention over ``parts`` sequence shards: no ALiBi
    or window but causal (the kernels' positions are the shard's), no sinks (they join a row once, where its
    keys are complete, which no ring step sees), and shards that split evenly (two chunks per
    device under causal, of equal queries and keys); with dropout, shards (chunks) dropout's offsets allow
    (_ring.ring_dropout_misalignment)."""
    if problem.alibi is not None or problem.sinks or problem.mask not in (Mask(), Mask(-1, 0)):
        return False
    causal = problem.mask == Mask(-1, 0)
    if causal:
        even = problem.seqlen_q == problem.seqlen_k and problem.seqlen_q % (2 * parts) == 0
    else:
        even = problem.seqlen_q % parts == 0 and problem.seqlen_k % parts == 0
    return even and (problem.dropout_p == 0.0 or
                     ring_dropout_misalignment(problem.seqlen_q // parts, problem.seqlen_k // parts, causal) is None)


def local_split(mesh, q_sharding: Any, k_sharding: Any, problem: Problem, flex: bool = False) -> Split:
    """How a call is split: along q's batch and head axes where they divide the batch and the kv heads, and along
    the sequence axis q and k share where ring attention can run the problem (never a flex call's)."""
    def spec(sharding):
        found = getattr(sharding, "spec", None)
        if not isinstance(sharding, NamedSharding) or found is None:
            return (None,) * 4
        return tuple(found) + (None,) * (4 - len(found))

    q_spec, k_spec = spec(q_sharding), spec(k_sharding)
    if problem.varlen:  # (total, heads, d): only the heads may split
        head_axis = q_spec[1] if problem.nheads_k % _axis_size(mesh, q_spec[1]) == 0 else None
        return Split(heads=head_axis)
    batch_axis, sequence_axis, head_axis = q_spec[0], q_spec[1], q_spec[2]
    if problem.kvcache:  # no ring over a cache; a paged cache's pages serve every sequence
        sequence_axis = None
        if problem.page_size:
            batch_axis = None
    if problem.batch % _axis_size(mesh, batch_axis):
        batch_axis = None
    if problem.nheads_k % _axis_size(mesh, head_axis):
        head_axis = None  # it would split a GQA group
    if flex or sequence_axis != k_spec[1] or not ring_possible(problem, _axis_size(mesh, sequence_axis)):
        sequence_axis = None
    used = [a for axis in (batch_axis, head_axis) if axis is not None for a in (axis if isinstance(axis, tuple)
                                                                                else (axis,))]
    if sequence_axis is not None and any(a in used for a in (sequence_axis if isinstance(sequence_axis, tuple)
                                                               else (sequence_axis,))):
        sequence_axis = None
    return Split(batch_axis, head_axis, sequence_axis)


def local_problem(mesh, problem: Problem, split: Split) -> Problem:
    batch_parts, head_parts = _axis_size(mesh, split.batch), _axis_size(mesh, split.heads)
    return dataclasses.replace(problem, batch=problem.batch // batch_parts, nheads=problem.nheads // head_parts,
                               nheads_k=problem.nheads_k // head_parts)


def _shard_origin(split: Split, local: Problem, dtype):
    """The global index of this device's shard's first batch and first query head, from its position along the
    split mesh axes: (2,) ``dtype``."""
    first = [jnp.zeros((), dtype) if axis is None else jax.lax.axis_index(axis).astype(dtype) * dtype(rows)
             for axis, rows in ((split.batch, local.batch), (split.heads, local.nheads))]
    return jnp.stack(first)


def _with_shard_offsets(seed, split: Split, local: Problem):
    """The dropout seed buffer of this device's shard: words 2 and 3 (of its first row) advanced by the global
    index of the shard's first batch and first query head (dropout.cuh)."""
    words = jax.lax.bitcast_convert_type(seed, jnp.uint32)
    return jax.lax.bitcast_convert_type(words.at[2:4].add(_shard_origin(split, local, jnp.uint32)), jnp.float32)


def _split_axes(split: Split) -> tuple:
    """The mesh axis names the batch and the heads are split along."""
    return tuple(a for axis in (split.batch, split.heads) if axis is not None
                 for a in (axis if isinstance(axis, tuple) else (axis,)))


def partitioned_call(direction: str, bind, operands: Sequence[str], results: Sequence[str], problem: Problem,
                     flex_shapes: dict | None = None):
    """A custom_partitioning function of the operands that runs the call per device on its shard.

    ``bind(problem, *arrays, shard_origin=None)`` binds the primitive for ``problem`` lowered straight to the custom
    call (a flex call's shard_origin: its first global batch and query head). Split along batch and heads, each
    device makes the call once with its local batch and heads; split along the sequence, it runs the ring
    (_ring.py) of such calls over that mesh axis. ``flex_shapes``: a flex call's side arrays, their gradients and
    tile lists, by name (None: not a flex call)."""
    flex = flex_shapes is not None

    def call(*arrays):
        return tuple(bind(problem, *arrays))

    wrapped = custom_partitioning(call)

    def shardings(mesh, arg_shapes):
        split = local_split(mesh, arg_shapes[operands.index("q")].sharding, arg_shapes[operands.index("k")].sharding,
                            problem, flex)
        arg_shardings = tuple(NamedSharding(mesh, _spec_of(n, problem, split, flex_shapes)) for n in operands)
        result_shardings = tuple(NamedSharding(mesh, _spec_of(n, problem, split, flex_shapes)) for n in results)
        return split, arg_shardings, result_shardings

    def partition(mesh, arg_shapes, result_shape):
        split, arg_shardings, result_shardings = shardings(mesh, arg_shapes)
        local = local_problem(mesh, problem, split)
        if flex and _split_axes(split):
            def lower_fn(*arrays):
                found = bind(local, *arrays, shard_origin=_shard_origin(split, local, jnp.int32))
                # Side gradients: each device's sums over its shard's scores, summed across the shards.
                return tuple(jax.lax.psum(x, _split_axes(split)) if name.startswith("flex_side_grad") else x
                             for name, x in zip(results, found))
        elif split.sequence is None:
            def lower_fn(*arrays):
                if "dropout_seed" in operands:
                    arrays = list(arrays)
                    i = operands.index("dropout_seed")
                    arrays[i] = _with_shard_offsets(arrays[i], split, local)
                return tuple(bind(local, *arrays))
        else:
            lower_fn = _ring_lowering(direction, bind, operands, local, split)
        return mesh, lower_fn, result_shardings, arg_shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[2]

    rule = sharding_rule(operands, results, problem, flex_shapes)
    wrapped.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                          sharding_rule=rule, need_replication_factors=_whole_factors(operands, problem, flex_shapes),
                          **({"r": problem.group_size} if _query_heads(problem) == "(g r)" else {}))
    return wrapped


def _ring_lowering(direction: str, bind, operands: Sequence[str], local: Problem, split: Split):
    """The per-device function of a sequence-split call: ring_forward or ring_backward of per-block calls. With
    dropout each block call's seed words carry the shard's first global batch and head and the block's first
    global query row and key."""
    causal = local.mask == Mask(-1, 0)
    axis = split.sequence

    def block(q_rows: int, k_rows: int, causal: bool) -> Problem:
        return dataclasses.replace(local, seqlen_q=q_rows, seqlen_k=k_rows, mask=Mask(-1, 0) if causal else Mask())

    def block_seeds(named):  # positions -> the block call's seed operand (none without dropout)
        if "dropout_seed" not in named:
            return lambda positions: ()
        shard_seed = _with_shard_offsets(named["dropout_seed"], split, local)  # once per device, not per block
        return lambda positions: (with_block_positions(shard_seed, positions),)

    per_chunk = local.dropout_p > 0.0
    if direction == "forward":
        def lower_fn(*arrays):
            named = dict(zip(operands, arrays))
            seed_of = block_seeds(named)

            def forward(q, k, v, causal, positions):
                return tuple(bind(block(q.shape[1], k.shape[1], causal), q, k, v, *seed_of(positions)))

            return ring_forward(named["q"], named["k"], named["v"], forward, axis_name=axis, causal=causal,
                                per_chunk=per_chunk)
        return lower_fn

    def lower_fn(*arrays):
        named = dict(zip(operands, arrays))
        seed_of = block_seeds(named)

        def backward(dout, q, k, v, out, lse, dlse, causal, positions):
            extra = seed_of(positions) + (() if dlse is None else (dlse,))
            return tuple(bind(block(q.shape[1], k.shape[1], causal), dout, q, k, v, out, lse, *extra))

        return ring_backward(named["dout"], named["q"], named["k"], named["v"], named["out"], named["lse"],
                             named.get("dlse"), backward, axis_name=axis, causal=causal, per_chunk=per_chunk)
    return lower_fn
