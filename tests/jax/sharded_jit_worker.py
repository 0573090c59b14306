"""Run by test_jax_subprocesses.py in a fresh Python: cuflash.jax.attention under plain jax.jit on 8 host devices
with inputs sharded along batch, heads, or both, in both mesh axis types (Auto and Explicit).

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX initialises. Prints one JSON object: per
(axis type, case), whether each result (out, lse, dq, dk, dv) is bitwise the unsharded one, the collectives found
in the compiled HLO, and the shardings of the results.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash.jax._ffi import record_launches  # noqa: E402
from cuflash.sim import record as sim_record  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
# name: (spec of the (batch, seq, heads, d) tensors, spec of lse-shaped (batch, heads, seq) ones)
CASES = {
    "batch": (P("data"), P("data")),
    "heads": (P(None, None, "model"), P(None, "model")),
    "batch+heads": (P("data", None, "model"), P("data", "model")),
    # Not split (the sequence stays whole without ring attention): XLA gathers, the results are the same.
    "sequence": (P(None, "model"), P(None, None, "model")),
}


def compare_sharded(step, args, want) -> dict:
    """Run jit(step) on sharded args: whether each result is bitwise ``want``, the collectives and cuflash custom
    calls in the compiled HLO (with the shapes all-gathers give), and the results' shardings."""
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
    hlo = compiled.as_text()
    return {
        "bitwise": [bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(got, want)],
        "collectives": [c for c in COLLECTIVES if c in hlo],
        "custom_calls": hlo.count("cuflash_program"),
        "gathered": re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-gather\(", hlo),
        "shardings": [str(x.sharding.spec) for x in got],
    }


def compare_close(step, args, want) -> dict:
    """compare_sharded for results equal up to rounding (ring attention merges partial results): the largest
    difference from ``want`` and ``want``'s largest magnitude per result instead of bitwise equality."""
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
    hlo = compiled.as_text()
    return {
        "differences": [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)],
        "scale": [float(np.max(np.abs(np.asarray(b)))) for b in want],
        "collectives": [c for c in COLLECTIVES if c in hlo],
        "custom_calls": hlo.count("cuflash_program"),
        "gathered": re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-gather\(", hlo),
        "shardings": [str(x.sharding.spec) for x in got],
    }


def forward_splits(launches) -> list[int]:
    """The split counts the forward launches among ``launches`` ran: a forward's grid x is its Q blocks times its
    splits, and the short-query calls this is asked about have one Q block (a decode's GQA group folds into it)."""
    return sorted({launch.grid[0] for launch in launches if "forward_kernel" in launch.kernel})


def heuristic_splits(function, *args, **options) -> int:
    """The splits NumPy ``function`` (with one Q block, see forward_splits) runs with num_splits=0: what the heuristic
    picks for a problem of that shape (the whole one, or one device's shard: first_shard), without a jit compile."""
    with sim_record() as recorded:
        function(*args, num_splits=0, **options)
    (splits,) = forward_splits(recorded.launches)
    return splits


def first_shard(x) -> np.ndarray:
    """The part of sharded ``x`` the first device holds: the local problem its custom call sees."""
    return np.asarray(x.addressable_shards[0].data)


def compare_paged_varlen(mesh, nheads: int, nheads_k: int, headdim: int) -> dict:
    """attention_varlen over a paged KV cache (block_table, forward only) under jit, as tensor-parallel serving shards
    it: q's heads and the pages' kv heads split over "model" (GQA: whole groups), the pages' own axes and the block
    table (traced, like a server's) whole. A prefill (several query rows per sequence) and a decode step (one row
    each, which runs as attention_with_kvcache's folded GQA decode). Per case: compare_sharded against the unsharded
    call, whether that call is bitwise the NumPy cuflash.attention_varlen, and whether a split-KV combine ran.

    8 pages of 16 rows per sequence: the decode's split-KV heuristic then gives the whole call and each device's
    (with a quarter of its heads) the same 2 splits. On longer caches a device's smaller grid can take more splits,
    and its results are then the unsharded ones only up to rounding. The long-cache decode (up to 500 keys, where the
    heuristic gives the whole call 4 splits and a device 8) pins num_splits=3 in the jit step and the NumPy call
    alike, so every device splits as the whole call does; for the decodes, the splits the heuristic picks for the
    whole call and for one device's shard (NumPy) and those the sharded call ran are reported too."""
    rng = np.random.default_rng(9)
    batch, page_size, pages_per_sequence = 4, 16, 8
    heads = NamedSharding(mesh, P(None, "model"))
    pages = NamedSharding(mesh, P(None, None, "model"))

    def draw_cache(pages_per_sequence):
        num_pages = batch * pages_per_sequence + 3  # spare pages no sequence reads
        k_pages, v_pages = (rng.standard_normal((num_pages, page_size, nheads_k, headdim)).astype(np.float32)
                            for _ in range(2))
        table = rng.permutation(num_pages)[: batch * pages_per_sequence].astype(np.int32).reshape(batch, -1)
        return k_pages, v_pages, table

    def run(lengths_q, lengths_k, k_pages, v_pages, table, **split):
        cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
        q = rng.standard_normal((cu_q[-1], nheads, headdim)).astype(np.float32)
        options = dict(causal=True, softcap=4.0, return_lse=True)

        def step(q, k_pages, v_pages, table):
            return cfj.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, block_table=table,
                                        max_seqlen_q=max(lengths_q), max_seqlen_k=int(lengths_k.max()), **options,
                                        **split)

        plain = jax.jit(step)(q, k_pages, v_pages, table)
        numpy_results = cuflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, block_table=table, **options,
                                                 **split)
        args = [jax.device_put(q, heads), jax.device_put(k_pages, pages), jax.device_put(v_pages, pages),
                jax.device_put(table, NamedSharding(mesh, P()))]
        with record_launches() as launches:
            case = compare_sharded(step, args, plain)
        case["numpy_bitwise"] = [bool(np.array_equal(np.asarray(a), b)) for a, b in zip(plain, numpy_results)]
        case["split_kv"] = any("combine" in launch.kernel for launch in launches)
        if max(lengths_q) == 1:
            case["heuristic_splits"] = [
                heuristic_splits(cuflash.attention_varlen, *inputs, cu_q, cu_k, block_table=table, **options)
                for inputs in ((q, k_pages, v_pages), [first_shard(x) for x in args[:3]])]
            case["splits"] = forward_splits(launches)
        return case

    k_pages, v_pages, table = draw_cache(pages_per_sequence)
    lengths_k = np.array([80, 14, 122, 40], np.int32)
    results = {f"varlen paged {name}": run(lengths_q, lengths_k, k_pages, v_pages, table)
               for name, lengths_q in (("prefill", [5, 1, 26, 4]), ("decode", [1, 1, 1, 1]))}
    long_lengths_k = np.array([300, 40, 500, 170], np.int32)
    results["varlen paged long decode"] = run([1] * batch, long_lengths_k, *draw_cache(32), num_splits=3)
    return results


def compare_pinned_splits(mesh) -> dict:
    """cuflash.jax.attention with num_splits=3 on short queries over long keys (4 rows, 440 keys, GQA) under jit,
    sharded along batch and along heads, with the vjp (whose backward runs unsplit): compare_sharded against the
    unsharded call, whether that call's out and lse are bitwise NumPy cuflash.attention(num_splits=3)'s, the splits
    the sharded forwards ran, and those the heuristic would pick for the whole call and for one device's shard
    (3 for the whole call, but 4 along batch and 7 along heads: unpinned, the devices would split otherwise).

    deterministic=True: in atomic mode dq's float32 atomics over several K/V blocks sum in no fixed order (two
    unsharded runs differ). Deterministic, each device's dq takes one slice per K/V block, as the whole call's, only
    while the 7 K/V blocks are at most ceil(SMs / (batch x kv heads)) = 7 on the simulator's default sm_80 (108 SMs);
    on 460 keys a device's smaller problem takes more slices than the whole call, its dq then the unsharded one only
    up to rounding."""
    rng = np.random.default_rng(13)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = 4, 4, 440, 8, 4, 24
    q, dout = (rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(np.float32) for _ in range(2))
    dlse = rng.standard_normal((batch, nheads, seqlen_q)).astype(np.float32)

    def step(q, k, v, dout, dlse):
        def attention(q, k, v):
            return cfj.attention(q, k, v, num_splits=3, deterministic=True, return_lse=True)
        (out, lse), pull = jax.vjp(attention, q, k, v)
        return (out, lse, *pull((dout, dlse)))

    plain = jax.jit(step)(q, k, v, dout, dlse)
    numpy_results = cuflash.attention(q, k, v, num_splits=3, return_lse=True)
    whole = heuristic_splits(cuflash.attention, q, k, v)
    results = {}
    for name in ("batch", "heads"):
        spec, lse_spec = CASES[name]
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, dout)]
        args.append(jax.device_put(dlse, NamedSharding(mesh, lse_spec)))
        with record_launches() as launches:
            case = compare_sharded(step, args, plain)
        case["numpy_bitwise"] = [bool(np.array_equal(np.asarray(a), b)) for a, b in zip(plain, numpy_results)]
        case["split_kv"] = any("combine" in launch.kernel for launch in launches)
        case["splits"] = forward_splits(launches)
        case["heuristic_splits"] = [whole, heuristic_splits(cuflash.attention, *map(first_shard, args[:3]))]
        results[f"num_splits=3 {name}"] = case
    return results


def main() -> None:
    rng = np.random.default_rng(0)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = 4, 36, 44, 8, 4, 24  # GQA: groups of 2 per kv head
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(np.float32)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(np.float32)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal((batch, nheads, seqlen_q)).astype(np.float32)
    slopes = rng.uniform(0.1, 0.5, (batch, nheads)).astype(np.float32)

    def step(q, k, v, dout, dlse, slopes):
        def attention(q, k, v):
            return cfj.attention(q, k, v, causal=True, window_size=(20, -1), softcap=4.0, alibi_slopes=slopes,
                                 return_lse=True)
        (out, lse), pull = jax.vjp(attention, q, k, v)
        return (out, lse, *pull((dout, dlse)))

    want = jax.jit(step)(q, k, v, dout, dlse, slopes)
    results = {}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
        for name, (spec, lse_spec) in CASES.items():
            tensor, rows = NamedSharding(mesh, spec), NamedSharding(mesh, lse_spec)
            slopes_spec = NamedSharding(mesh, P(*tuple(lse_spec)[:2]))
            args = [jax.device_put(x, tensor) for x in (q, k, v, dout)]
            args += [jax.device_put(dlse, rows), jax.device_put(slopes, slopes_spec)]
            results[f"{axis_type.name}:{name}"] = compare_sharded(step, args, want)
        # Sinks (one logit per query head, sharded with the heads): per-device calls; dsinks sums over the batch and
        # rows in jnp, so a batch split adds the all-reduce of that (nheads,) sum and the order of its terms.
        def sinks_step(q, k, v, dout, dlse, sinks):
            def attention(q, k, v, sinks):
                return cfj.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
            (out, lse), pull = jax.vjp(attention, q, k, v, sinks)
            return (out, lse, *pull((dout, dlse)))

        sinks = rng.standard_normal(nheads).astype(np.float32)
        plain = jax.jit(sinks_step)(q, k, v, dout, dlse, sinks)
        for name in ("batch", "heads", "batch+heads"):
            spec, lse_spec = CASES[name]
            heads_spec = NamedSharding(mesh, P(lse_spec[1] if len(lse_spec) > 1 else None))
            args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, dout)]
            args += [jax.device_put(dlse, NamedSharding(mesh, lse_spec)), jax.device_put(sinks, heads_spec)]
            results[f"{axis_type.name}:sinks {name}"] = compare_close(sinks_step, args, plain)
        # Dropout: each shard passes its first global batch and head to the kernels, so it drops what the whole
        # call drops (bitwise the unsharded results, no collective).
        def dropout_step(q, k, v, dout, key):
            out, pull = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, causal=True, dropout_p=0.3, dropout_rng=key),
                                q, k, v)
            return (out, *pull(dout))

        key = jax.random.key(11)
        plain = jax.jit(dropout_step)(q, k, v, dout, key)
        for name in ("batch", "heads", "batch+heads"):
            tensor = NamedSharding(mesh, CASES[name][0])
            args = [jax.device_put(x, tensor) for x in (q, k, v, dout)] + [key]
            results[f"{axis_type.name}:dropout {name}"] = {
                **compare_sharded(dropout_step, args, plain),
                "dropped": bool(not np.array_equal(np.asarray(plain[0]), np.asarray(want[0]))),
            }
        # vmap of the dropout step over two elements with their own keys, sharded along the mapped axis and heads:
        # the fold gives each element's batches its seed row, each device's shard its first global batch and head.
        mapped = jax.vmap(dropout_step, in_axes=(0, None, None, 0, 0))
        stacked = (np.stack([q, -q]), k, v, np.stack([dout, 2 * dout]), jax.random.split(key, 2))
        plain = jax.jit(mapped)(*stacked)
        elements = [jax.jit(dropout_step)(stacked[0][m], k, v, stacked[3][m], stacked[4][m]) for m in range(2)]
        per_element = all(np.array_equal(np.asarray(a[m]), np.asarray(b)) for m, e in enumerate(elements)
                          for a, b in zip(plain, e))
        both = NamedSharding(mesh, P("data", None, None, "model"))
        args = [jax.device_put(stacked[0], both), jax.device_put(k, NamedSharding(mesh, P(None, None, "model"))),
                jax.device_put(v, NamedSharding(mesh, P(None, None, "model"))), jax.device_put(stacked[3], both),
                jax.device_put(stacked[4], NamedSharding(mesh, P("data")))]
        results[f"{axis_type.name}:vmap dropout"] = {**compare_sharded(mapped, args, plain),
                                                     "unsharded_per_element": per_element}
        # Varlen (packed rows, cu_seqlens) with its heads sharded, as tensor parallelism shards them: one call per
        # device on its kv heads, with dropout too (each shard passes its first global head).
        cu_q, cu_k = np.array([0, 5, 31, 36], np.int32), np.array([0, 17, 20, 44], np.int32)
        packed = [x.reshape((-1,) + x.shape[2:])[: cu[-1]] for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k), (dout, cu_q))]
        # With dropout, used prefixes too (seqused_q / seqused_k: per-sequence operands every device reads whole).
        for dropout_p in (0.0, 0.25):
            counts = dict(seqused_q=np.array([4, 26, 0], np.int32), seqused_k=np.array([17, 1, 20], np.int32))

            def varlen_step(q, k, v, dout, dropout_p=dropout_p, counts=counts if dropout_p else {}):
                def attention(q, k, v):
                    return cfj.attention_varlen(q, k, v, cu_q, cu_k, causal=True, softcap=4.0, dropout_p=dropout_p,
                                                dropout_rng=jax.random.key(3) if dropout_p else None, **counts)
                out, pull = jax.vjp(attention, q, k, v)
                return (out, *pull(dout))

            plain = jax.jit(varlen_step)(*packed)
            heads = NamedSharding(mesh, P(None, "model"))
            args = [jax.device_put(x, heads) for x in packed]
            results[f"{axis_type.name}:varlen heads p={dropout_p}"] = compare_sharded(varlen_step, args, plain)
        # MHA (no groups) and MQA (one kv head): the rule names their query heads g and r alone.
        for layout, kv_heads, split_name in (("mha", nheads, "batch+heads"), ("mqa", 1, "batch")):
            k1, v1 = (x[:, :, :1].repeat(kv_heads, axis=2) + 0.5 * np.arange(kv_heads, dtype=np.float32)[:, None]
                      for x in (k, v))
            plain = jax.jit(dropout_step)(q, k1, v1, dout, key)
            tensor = NamedSharding(mesh, CASES[split_name][0])
            args = [jax.device_put(x, tensor) for x in (q, k1, v1, dout)] + [key]
            results[f"{axis_type.name}:{layout} {split_name}"] = compare_sharded(dropout_step, args, plain)
        # v with a head dim of its own (MLA-style: 16 against q's and k's 24): the rule names it apart (factor v).
        v_narrow, dout_narrow = v[..., :16] * 1.5, dout[..., :16]
        plain = jax.jit(dropout_step)(q, k, v_narrow, dout_narrow, key)
        tensor = NamedSharding(mesh, CASES["batch+heads"][0])
        args = [jax.device_put(x, tensor) for x in (q, k, v_narrow, dout_narrow)] + [key]
        results[f"{axis_type.name}:headdim_v batch+heads"] = compare_sharded(dropout_step, args, plain)
        # v wider than the kernels take (300 columns, two chunks of value_column_chunks): each chunk's call sharded.
        v_wide, dout_wide = (np.concatenate([x] * 13, axis=-1)[..., :300] for x in (v, dout))
        plain = jax.jit(dropout_step)(q, k, v_wide, dout_wide, key)
        args = [jax.device_put(x, tensor) for x in (q, k, v_wide, dout_wide)] + [key]
        results[f"{axis_type.name}:headdim_v wide batch+heads"] = compare_sharded(dropout_step, args, plain)
        # KV caches sharded along kv heads (and batch when not paged), as tensor-parallel serving shards them: a
        # one-row GQA decode (folded) and a 3-row prefill appending to the caches, contiguous and paged, num_splits=1
        # (the heuristic would see each device's smaller problem and may split differently).
        kv_rng = np.random.default_rng(5)
        contiguous = [kv_rng.standard_normal((batch, 64, nheads_k, headdim)).astype(np.float32) for _ in range(2)]
        pages = [kv_rng.standard_normal((4 * batch + 1, 16, nheads_k, headdim)).astype(np.float32) for _ in range(2)]
        table = kv_rng.permutation(4 * batch + 1)[: 4 * batch].astype(np.int32).reshape(batch, 4)
        lengths = np.array([40, 7, 61, 0], np.int32)
        for layout, caches, split_name in (("contiguous", contiguous, "batch+heads"), ("paged", pages, "heads")):
            for rows in (1, 3):
                q_new = kv_rng.standard_normal((batch, rows, nheads, headdim)).astype(np.float32)
                k_new, v_new = (kv_rng.standard_normal((batch, rows, nheads_k, headdim)).astype(np.float32)
                                for _ in range(2))

                def decode(q, k_cache, v_cache, k, v, lengths=lengths - rows + 1 if rows == 1 else lengths,
                           paged=layout == "paged"):
                    return cfj.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                                      cache_seqlens=np.maximum(lengths, 0),
                                                      block_table=table if paged else None, causal=True,
                                                      num_splits=1, return_lse=True)

                plain = jax.jit(decode)(q_new, *caches, k_new, v_new)
                spec = CASES[split_name][0] if layout == "contiguous" else P(None, None, "model")
                tensor = NamedSharding(mesh, spec)
                args = [jax.device_put(x, tensor) for x in (q_new, k_new, v_new)]
                args = [args[0]] + [jax.device_put(c, NamedSharding(mesh, P(None, None, "model"))
                                                   if layout == "paged" else tensor) for c in caches] + args[1:]
                results[f"{axis_type.name}:kvcache {layout} rows={rows}"] = compare_sharded(decode, args, plain)
        # Caches indexed by cache_batch_idx (more batch rows than q) with left padding: q split along batch and
        # heads, the caches along kv heads only (any sequence may read any of their batch rows).
        indexed = [kv_rng.standard_normal((batch + 2, 64, nheads_k, headdim)).astype(np.float32) for _ in range(2)]
        q_new = kv_rng.standard_normal((batch, 1, nheads, headdim)).astype(np.float32)
        k_new, v_new = (kv_rng.standard_normal((batch, 1, nheads_k, headdim)).astype(np.float32) for _ in range(2))

        def indexed_decode(q, k_cache, v_cache, k, v):
            return cfj.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=np.array([40, 7, 61, 3],
                                                                                                    np.int32),
                                              cache_batch_idx=np.array([5, 0, 2, 3], np.int32),
                                              cache_leftpad=np.array([4, 0, 30, 3], np.int32), causal=True,
                                              num_splits=1, return_lse=True)

        plain = jax.jit(indexed_decode)(q_new, *indexed, k_new, v_new)
        tensor = NamedSharding(mesh, CASES["batch+heads"][0])
        heads = NamedSharding(mesh, P(None, None, "model"))
        args = [jax.device_put(q_new, tensor)] + [jax.device_put(c, heads) for c in indexed]
        args += [jax.device_put(x, tensor) for x in (k_new, v_new)]
        results[f"{axis_type.name}:kvcache indexed"] = compare_sharded(indexed_decode, args, plain)
        results.update({f"{axis_type.name}:{name}": case
                        for name, case in compare_paged_varlen(mesh, nheads, nheads_k, headdim).items()})
        results.update({f"{axis_type.name}:{name}": case for name, case in compare_pinned_splits(mesh).items()})
        # The sequence sharded, causal, no ALiBi or window: the sharding rule runs ring attention over "model"
        # (and splits batch over "data"), forward and backward.
        def ring_step(q, k, v, dout, dlse):
            (out, lse), pull = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, causal=True, return_lse=True), q, k, v)
            return (out, lse, *pull((dout, dlse)))

        ring_inputs = [rng.standard_normal((batch, 40) + x.shape[2:]).astype(np.float32) for x in (q, k, v, dout)]
        ring_inputs.append(rng.standard_normal((batch, nheads, 40)).astype(np.float32))  # 2 chunks of 5 per device
        plain = jax.jit(ring_step)(*ring_inputs)
        tensor, rows = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("data", None, "model"))
        args = [jax.device_put(x, tensor) for x in ring_inputs[:4]] + [jax.device_put(ring_inputs[4], rows)]
        results[f"{axis_type.name}:ring"] = compare_close(ring_step, args, plain)
        # The same with dropout, on 128 rows (chunks of 16 per device, as dropout's offsets need): each block call
        # gets its shard's first batch and its first global row and key.
        def ring_dropout_step(q, k, v, dout, dlse):
            def attention(q, k, v):
                return cfj.attention(q, k, v, causal=True, dropout_p=0.2, dropout_rng=jax.random.key(5),
                                     return_lse=True)
            (out, lse), pull = jax.vjp(attention, q, k, v)
            return (out, lse, *pull((dout, dlse)))

        long_inputs = [rng.standard_normal((batch, 128) + x.shape[2:]).astype(np.float32) for x in (q, k, v, dout)]
        long_inputs.append(rng.standard_normal((batch, nheads, 128)).astype(np.float32))
        plain = jax.jit(ring_dropout_step)(*long_inputs)
        args = [jax.device_put(x, tensor) for x in long_inputs[:4]] + [jax.device_put(long_inputs[4], rows)]
        results[f"{axis_type.name}:ring dropout"] = compare_close(ring_dropout_step, args, plain)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
