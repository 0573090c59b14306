"""Run by test_jax_flex.py in a fresh Python: cuflash.jax.flex_attention under plain jax.jit on 4 host devices (a 2 x 2
mesh, "data" x "model") with q, k, v sharded along batch, heads (whole GQA groups) or both. Prints one JSON object:
per case, the collectives and cuflash custom calls in the compiled HLO (with the shapes all-gathers give), the
results' shardings, the largest difference of out, lse and the gradients (q, k, v and the captured bias table) from
the unsharded call, and the checks of the sharded results against the float64 reference.

The mods read b and h: a relative-position bias table per query head (h), a document mask per batch row (b), a
reach per head (h). Two block masks: one per (batch, head) (its tile lists split with both), one per batch row with
its heads broadcast (its lists' head dim stays whole). The case "no origin" plants the bug the shard origin prevents:
every shard's mods see local b and h (its origin forced to 0), so the results must differ.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cuflash.jax as cfj  # noqa: E402
from cuflash import _tolerance as T  # noqa: E402
from cuflash.jax import _partitioning  # noqa: E402
from cuflash.reference import attention_backward_reference  # noqa: E402
from cuflash.testing import random_inputs  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
B, LQ, LK, H, HK, D = 4, 13, 19, 4, 2, 12  # GQA: groups of 2 query heads per kv head
q, k, v, dout = random_inputs((B, LQ, LK, H, HK, D), "float32", seed=3)
rng = np.random.default_rng(3)
table = rng.standard_normal((H, LQ + LK)).astype(np.float32)
# Documents differ per batch row; document 3 of row 0 has queries but no key (rows that see no key).
doc_q = np.sort(rng.integers(0, 3, (B, LQ)), axis=1).astype(np.int32)
doc_q[0, -2:] = 3
doc_k = np.sort(rng.integers(0, 3, (B, LK)), axis=1).astype(np.int32)
reach = np.asarray([2, 5, 9, LK], np.int32)
DOC_Q, DOC_K, REACH = jnp.asarray(doc_q), jnp.asarray(doc_k), jnp.asarray(reach)


def bias_of(table):
    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + LK]
    return bias


def same_document(b, h, q_idx, kv_idx):
    return DOC_Q[b, q_idx] == DOC_K[b, kv_idx]


def document_within_reach(b, h, q_idx, kv_idx):
    return (DOC_Q[b, q_idx] == DOC_K[b, kv_idx]) & (jnp.abs(q_idx - kv_idx) <= REACH[h])


BLOCK_MASKS = {  # name: (mask_mod, block mask)
    "per batch and head": (document_within_reach,
                           cfj.create_block_mask(document_within_reach, B, H, LQ, LK, block_size=4)),
    "heads broadcast": (same_document, cfj.create_block_mask(same_document, B, None, LQ, LK, block_size=8)),
}


def step_of(block_mask):
    def step(q, k, v, table, dout):
        def attention(q, k, v, table):
            return cfj.flex_attention(q, k, v, score_mod=bias_of(table), block_mask=block_mask, return_lse=True)
        (out, lse), pull = jax.vjp(attention, q, k, v, table)
        return (out, lse, *pull((dout, jnp.zeros_like(lse))))  # the loss sum(out * dout)
    return step


def references(mask_mod, q, k, v, dout) -> tuple[list, list]:
    """The float64 results (out, lse, dq, dk, dv, dtable) and their float32 twins (the rule's yardstick)."""
    mods = dict(score_mod=bias_of(jnp.asarray(table)), mask_mod=mask_mod)
    fwd = T.forward_references(q, k, v, **mods)
    exact, twin = [fwd.out, fwd.lse], [fwd.out_lowp, fwd.lse_lowp]
    for dtype, into in ((np.float64, exact), (np.float32, twin)):
        *grads, score_grads = attention_backward_reference(dout, q, k, v, dtype=dtype, return_score_grads=True,
                                                           **mods)
        # d score / d table[h, q_idx - kv_idx + LK] is 1: the table's gradient sums the scores' gradients
        dtable = np.zeros(table.shape, np.float64)
        offsets = np.arange(LQ)[:, None] - np.arange(LK)[None, :] + LK
        for h in range(H):
            np.add.at(dtable[h], offsets, score_grads[:, h].sum(axis=0))
        into += [*grads, dtable]
    return exact, twin


def compiled_case(step, args, want, exact, twin) -> dict:
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
    hlo = compiled.as_text()
    result = {
        "collectives": [c for c in COLLECTIVES if c in hlo],
        "gathered": re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-gather\(", hlo),
        "reduced": re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-reduce\(", hlo),
        "custom_calls": hlo.count("cuflash_program"),
        "shardings": [str(getattr(x.sharding, "spec", "single device")) for x in got],
        "differences": [float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0,
                                  where=np.isfinite(np.asarray(b)))) for a, b in zip(got, want)],
        "same_special": [bool(np.array_equal(np.isfinite(np.asarray(a)), np.isfinite(np.asarray(b))))
                         for a, b in zip(got, want)],
        "checks": {},
    }
    names = ("out", "lse", "dq", "dk", "dv", "dtable")
    for name, actual, ref, yard in zip(names, got, exact, twin):
        factor = T.FORWARD_FACTOR if name in ("out", "lse") else T.BACKWARD_FACTOR
        try:
            measured = T.check_close(name, np.asarray(actual), ref, yard, factor, atol=1e-5 if factor > 2 else 0.0)
            result["checks"][name] = {"ok": True, "max_error": measured.max_error, "bound": measured.bound}
        except AssertionError as err:
            result["checks"][name] = {"ok": False, "message": str(err)[:500]}
    return result


def drop_in_case(mesh) -> dict:
    """cuflash.jax.dot_product_attention with a dense bias sharded like the scores (batch, heads) and a NumPy mask:
    the bias is a side array, so it is gathered (replicated) and its gradient all-reduced; the results are the
    unsharded call's."""
    bias = rng.standard_normal((B, H, LQ, LK)).astype(np.float32)
    mask = np.random.default_rng(5).random((B, 1, LQ, LK)) > 0.3

    def step(q, k, v, bias, dout):
        out, pull = jax.vjp(lambda q, k, v, bias: cfj.dot_product_attention(q, k, v, bias=bias, mask=mask), q, k, v,
                            bias)
        return (out, *pull(dout))

    want = jax.jit(step)(q, k, v, bias, dout)
    tensor = NamedSharding(mesh, P("data", None, "model"))
    args = [jax.device_put(x, tensor) for x in (q, k, v)]
    args += [jax.device_put(bias, NamedSharding(mesh, P("data", "model"))), jax.device_put(dout, tensor)]
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
    hlo = compiled.as_text()
    return {"differences": [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)],
            "gathered": re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-gather\(", hlo),
            "custom_calls": hlo.count("cuflash_program")}


def main() -> None:
    splits = {"batch": P("data"), "heads": P(None, None, "model"), "batch+heads": P("data", None, "model")}
    results = {}
    for mask_name, (mask_mod, block_mask) in BLOCK_MASKS.items():
        step = step_of(block_mask)
        exact, twin = references(mask_mod, q, k, v, dout)
        want = jax.jit(step)(q, k, v, table, dout)
        results[f"{mask_name}:unsharded"] = compiled_case(step, (q, k, v, table, dout), want, exact, twin)
        # Both mesh axis types (an Explicit mesh's replicated table makes jax.grad reshard the derivative's seed);
        # the broadcast block mask in the default one only.
        for axis_type in (AxisType.Explicit, AxisType.Auto)[:2 if mask_name == "per batch and head" else 1]:
            mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2)
            whole = jax.device_put(table, NamedSharding(mesh, P()))
            for split, spec in splits.items():
                tensor = NamedSharding(mesh, spec)
                args = [jax.device_put(x, tensor) for x in (q, k, v)] + [whole, jax.device_put(dout, tensor)]
                results[f"{axis_type.name}:{mask_name}:{split}"] = compiled_case(step, args, want, exact, twin)
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    mask_mod, block_mask = BLOCK_MASKS["per batch and head"]
    step = step_of(block_mask)
    want = jax.jit(step)(q, k, v, table, dout)
    tensor = NamedSharding(mesh, splits["batch+heads"])
    # The forward alone: no collective at all.
    forward = jax.jit(lambda q, k, v, t: cfj.flex_attention(q, k, v, score_mod=bias_of(t), block_mask=block_mask))
    args = [jax.device_put(x, tensor) for x in (q, k, v)] + [table]
    hlo = forward.lower(*args).compile().as_text()
    out = forward(*args)
    results["forward only"] = {"collectives": [c for c in COLLECTIVES if c in hlo],
                               "custom_calls": hlo.count("cuflash_program"),
                               "out": float(np.max(np.abs(np.asarray(out) - np.asarray(want[0])))),
                               "sharding": str(out.sharding.spec)}
    # The planted bug: shards whose origin is 0 (mods read local b and h) must give other results.
    real = _partitioning._shard_origin
    _partitioning._shard_origin = lambda split, local, dtype: jnp.zeros((2,), dtype)
    try:
        jax.clear_caches()
        args = [jax.device_put(x, tensor) for x in (q, k, v)] + [table, jax.device_put(dout, tensor)]
        got = jax.jit(step)(*args)
        results["no origin"] = {"differences": [
            float(np.max(np.abs(np.nan_to_num(np.asarray(a) - np.asarray(b))))) for a, b in zip(got, want)]}
    finally:
        _partitioning._shard_origin = real
        jax.clear_caches()
    # MHA (one kv head per query head: the query heads' factor is the kv heads' own) split along batch and heads.
    inputs = random_inputs((B, LQ, LK, H, H, D), "float32", seed=4)
    exact, twin = references(mask_mod, *inputs)
    want = jax.jit(step)(*inputs[:3], table, inputs[3])
    args = [jax.device_put(x, tensor) for x in inputs[:3]] + [table, jax.device_put(inputs[3], tensor)]
    results["mha:batch+heads"] = compiled_case(step, args, want, exact, twin)
    # vmap over a leading axis of q, k, v (each element's own call), sharded along batch and heads inside it.
    forward = jax.jit(jax.vmap(lambda q, k, v: cfj.flex_attention(q, k, v, score_mod=bias_of(jnp.asarray(table)),
                                                                  block_mask=block_mask)))
    stacked = [np.stack([x, x[::-1]]) for x in (q, k, v)]
    want = forward(*stacked)
    inner = NamedSharding(mesh, P(None, "data", None, "model"))
    args = [jax.device_put(x, inner) for x in stacked]
    compiled = forward.lower(*args).compile()
    got = compiled(*args)
    hlo = compiled.as_text()
    results["vmap"] = {"bitwise": bool(np.array_equal(np.asarray(got), np.asarray(want))),
                       "collectives": [c for c in COLLECTIVES if c in hlo],
                       "custom_calls": hlo.count("cuflash_program"), "sharding": str(got.sharding.spec)}
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        results[f"{axis_type.name}:drop-in"] = drop_in_case(
            jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
