"""cuflash.jax in fresh processes: shard_map on 4 host devices, plain jit over sharded inputs on 8, ring attention
on 4 and 8, and JAX's persistent compilation cache.

Both need a Python of their own: the host device count is fixed when JAX initialises, and a persistent-cache
hit only means something in a process that never compiled the function. The workers beside this file print
JSON; the assertions are here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def run_worker(script: str, *args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout)


def test_shard_map_along_batch_and_heads_forward_and_grad():
    results = run_worker("shard_map_worker.py")
    assert set(results) == {"batch", "heads", "heads_replicated_kv"}
    for name, case in results.items():
        # Inside shard_map (check_vma on) the outputs vary along the mesh axis.
        assert case["varying_axes"] == {"out": ["x"], "lse": ["x"]}, name
        # Each shard runs the same kernels on its slice: forward results are bitwise those of one unsharded call.
        assert case["out_vs_unsharded"] == 0.0 and case["lse_vs_unsharded"] == 0.0, name
        for check, measured in case["checks"].items():
            assert measured["ok"], f"{name} {check}: {measured.get('message')}"
    assert results["batch"]["out_sharding"].startswith("P('x'")
    assert results["heads"]["out_sharding"].startswith("P(None, None, 'x'")
    # Sharded batch or heads (kv heads with their query heads): each gradient is computed whole on one shard, as
    # unsharded (up to the order of dq's float32 atomics). Replicated (invariant) k, v: dk, dv are psums over the
    # shards' partial sums, equal up to summation order.
    for name in results:
        assert max(results[name]["grads_vs_unsharded"]) < 1e-5, name


def test_plain_jit_over_batch_and_head_shards_runs_per_shard_without_collectives():
    """[jax-scale] 1: inputs sharded along batch, heads (whole GQA groups) or both, in Auto and Explicit meshes: one
    forward and one backward custom call per device on its shard, no collective in the compiled HLO, results
    sharded like the inputs and bitwise the unsharded ones (with a window, softcap, per-(batch, head) ALiBi and
    the lse's cotangent; with dropout, also under vmap; for MHA and MQA; varlen calls along heads (with used
    prefixes); KV-cache calls and varlen calls over a paged cache (a prefill, a decode step, and one over long
    caches with num_splits=3), forward only; split-KV with num_splits=3 on short queries over long keys, with the
    vjp, pinned where each device's heuristic would split its local problem otherwise). A sequence sharded with
    ALiBi and a window is gathered (the documented fallback) with the same results; a causal one without runs as
    ring attention."""
    results = run_worker("sharded_jit_worker.py")
    assert set(results) == {f"{mode}:{case}" for mode in ("Auto", "Explicit")
                            for case in ("batch", "heads", "batch+heads", "sequence", "ring", "dropout batch",
                                         "dropout heads", "dropout batch+heads", "varlen heads p=0.0",
                                         "varlen heads p=0.25", "mha batch+heads", "mqa batch",
                                         "kvcache contiguous rows=1", "kvcache contiguous rows=3",
                                         "kvcache paged rows=1", "kvcache paged rows=3", "vmap dropout",
                                         "ring dropout", "sinks batch", "sinks heads", "sinks batch+heads",
                                         "kvcache indexed", "headdim_v batch+heads",
                                         "headdim_v wide batch+heads", "varlen paged prefill",
                                         "varlen paged decode", "varlen paged long decode", "num_splits=3 batch",
                                         "num_splits=3 heads")}
    for mode in ("Auto", "Explicit"):
        # [jax-scale] 2 through the rule: a causal call on a sequence sharded over "model" (batch over "data") runs
        # as ring attention, forward and backward: collective-permutes only, results sharded like the inputs,
        # within float32 rounding of the unsharded call.
        ring = results.pop(f"{mode}:ring")
        assert ring["collectives"] == ["collective-permute"], ring
        assert ring["shardings"] == ["P('data', 'model')", "P('data', None, 'model')"] + ["P('data', 'model')"] * 3
        for difference, scale in zip(ring["differences"], ring["scale"]):
            assert difference <= 1e-5 * max(1.0, scale), ring
        # With dropout (chunks of 16 rows): the same ring, each block call given its shard's first batch and its
        # first global row and key, so it drops what the unsharded call drops.
        ring = results.pop(f"{mode}:ring dropout")
        assert ring["collectives"] == ["collective-permute"] and ring["gathered"] == [], ring
        assert ring["shardings"] == ["P('data', 'model')", "P('data', None, 'model')"] + ["P('data', 'model')"] * 3
        for difference, scale in zip(ring["differences"], ring["scale"]):
            assert difference <= 1e-5 * max(1.0, scale), ring
    expected_specs = {"batch": ("P('data',)", "P('data',)"), "heads": ("P(None, None, 'model')", "P(None, 'model')"),
                      "batch+heads": ("P('data', None, 'model')", "P('data', 'model')")}
    for mode in ("Auto", "Explicit"):
        # Sinks sharded with the heads: per-device calls, out, lse, dq, dk, dv bitwise; dsinks within float32
        # rounding, its (nheads,) sum all-reduced across batch shards (in an Auto mesh the only collective, and
        # only then). Known and not chased: with the batch split in an Explicit mesh the lse comes back without
        # its batch sharding, one lse-shaped float32 array gathered (seqlen_q floats per head and batch, no
        # tensor); the values are still the unsharded call's.
        for split in ("batch", "heads", "batch+heads"):
            case = results.pop(f"{mode}:sinks {split}")
            assert case["differences"][:5] == [0.0] * 5 and case["custom_calls"] == 2, (mode, split, case)
            assert case["differences"][5] <= 1e-5 * max(1.0, case["scale"][5]), (mode, split, case)
            batch_split = "batch" in split
            gathers = ["all-gather"] if batch_split and mode == "Explicit" else []
            assert case["collectives"] == gathers + (["all-reduce"] if batch_split else []), (mode, split, case)
            assert len(case["gathered"]) == len(gathers) and all(
                g.startswith("f32[4,") and g.endswith(",36]") for g in case["gathered"]), (mode, split, case)
            tensor, rows = expected_specs[split]
            if gathers:
                rows = rows.replace("'data'", "None") if "model" in rows else "P()"
            assert case["shardings"][:5] == [tensor, rows, tensor, tensor, tensor], (mode, split, case)
        # Dropout under sharding: each device's shard carries its first global batch and head, so the results are
        # bitwise the unsharded call's, with no collective (before: gathered).
        for split in ("batch", "heads", "batch+heads"):
            case = results.pop(f"{mode}:dropout {split}")
            assert case["bitwise"] == [True] * 4 and case["dropped"], (mode, split, case)
            assert case["collectives"] == [] and case["custom_calls"] == 2, (mode, split, case)
            assert case["shardings"] == [expected_specs[split][0]] * 4, (mode, split, case)
        # vmap with dropout over keys, sharded along the mapped axis and heads: bitwise each element's own call; the
        # only collective gathers the two elements' seed rows (2 x 8 words) for each direction's call.
        case = results.pop(f"{mode}:vmap dropout")
        assert case["unsharded_per_element"] and case["bitwise"] == [True] * 4, (mode, case)
        assert case["custom_calls"] == 2 and case["gathered"] == ["f32[16]"] * 2, (mode, case)
        # MHA and MQA heads, and v with its own head dim (with dropout): per-device calls, bitwise, no collective.
        for split, layout in (("batch+heads", "mha"), ("batch", "mqa"), ("batch+heads", "headdim_v")):
            case = results.pop(f"{mode}:{layout} {split}")
            assert case["bitwise"] == [True] * 4 and case["collectives"] == [], (mode, layout, case)
            assert case["custom_calls"] == 2 and case["shardings"] == [expected_specs[split][0]] * 4, (mode, layout)
        # v wider than the kernels take: a forward and a backward call per column chunk (two), each per device.
        case = results.pop(f"{mode}:headdim_v wide batch+heads")
        assert case["bitwise"] == [True] * 4 and case["collectives"] == [], (mode, case)
        assert case["custom_calls"] == 4 and case["shardings"] == [expected_specs["batch+heads"][0]] * 4, (mode, case)
        # KV caches split along kv heads (and batch when contiguous), a folded one-row GQA decode and a 3-row
        # prefill appending to the caches: one forward call per device, bitwise, no collective (was: gathered).
        for layout, split in (("contiguous", "batch+heads"), ("paged", "heads")):
            tensor, rows = expected_specs[split]
            for new_rows in (1, 3):
                case = results.pop(f"{mode}:kvcache {layout} rows={new_rows}")
                assert case["bitwise"] == [True] * 4 and case["collectives"] == [], (mode, layout, case)
                assert case["custom_calls"] == 1, (mode, layout, case)
                specs = [spec.replace(", None)", ")") for spec in case["shardings"]]
                assert specs == [tensor, rows, tensor, tensor], (mode, layout, case)
        # Caches indexed by cache_batch_idx, with left padding: their batch rows stay whole (any sequence may read
        # any), the call still one per device, the results the unsharded call's bit for bit.
        case = results.pop(f"{mode}:kvcache indexed")
        assert case["bitwise"] == [True] * 4 and case["custom_calls"] == 1, (mode, case)
        # Varlen over a paged KV cache, q's heads and the pages' kv heads split, the pages and the block table whole:
        # a prefill and a decode step (run as attention_with_kvcache's), each one forward call per device, no
        # collective (the pages never gathered), out and lse sharded along the heads and bitwise the unsharded call's,
        # itself bitwise the NumPy call's. The decode ran split-KV on the shards (its combine kernel launched), each
        # device splitting its keys as the whole call does at these cache lengths (see compare_paged_varlen). On the
        # long caches the heuristic would split a device's keys otherwise than the whole call's; num_splits=3 pins
        # every device's split count, so the results are still bitwise.
        for step in ("prefill", "decode", "long decode"):
            case = results.pop(f"{mode}:varlen paged {step}")
            assert case["bitwise"] == [True] * 2 and case["numpy_bitwise"] == [True] * 2, (mode, step, case)
            assert case["collectives"] == [] and case["custom_calls"] == 1, (mode, step, case)
            assert case["shardings"] == ["P(None, 'model')", "P('model',)"], (mode, step, case)
            assert case["split_kv"] == (step != "prefill"), (mode, step, case)
            if step == "decode":
                whole, device = case["heuristic_splits"]
                assert whole == device > 1 and case["splits"] == [whole], (mode, step, case)
            elif step == "long decode":
                whole, device = case["heuristic_splits"]
                assert whole != device and case["splits"] == [3], (mode, step, case)
        # Fixed-length short queries over long keys with num_splits=3, sharded along batch or heads, with the vjp
        # (deterministic): one forward and one backward call per device, no collective, out, lse and the gradients
        # bitwise the unsharded call's, whose out and lse are NumPy's; every device's forward ran the 3 splits
        # (combine launched) where the heuristic would have split its local problem otherwise than the whole one.
        for split in ("batch", "heads"):
            case = results.pop(f"{mode}:num_splits=3 {split}")
            assert case["bitwise"] == [True] * 5 and case["numpy_bitwise"] == [True] * 2, (mode, split, case)
            assert case["collectives"] == [] and case["custom_calls"] == 2, (mode, split, case)
            tensor, rows = expected_specs[split]
            assert case["shardings"] == [tensor, rows, tensor, tensor, tensor], (mode, split, case)
            whole, device = case["heuristic_splits"]
            assert case["split_kv"] and case["splits"] == [3] and whole != device, (mode, split, case)
        # Varlen with its heads sharded (tensor parallelism): per-device calls on the kv heads, no collective.
        for p in ("0.0", "0.25"):
            case = results.pop(f"{mode}:varlen heads p={p}")
            assert case["bitwise"] == [True] * 4 and case["custom_calls"] == 2, (mode, p, case)
            assert case["collectives"] == [] and case["shardings"] == ["P(None, 'model')"] * 4, (mode, p, case)
    for name, case in results.items():
        assert case["bitwise"] == [True] * 5, name
        assert case["custom_calls"] == 2, name
        split = name.split(":")[1]
        if split == "sequence":
            assert "all-gather" in case["collectives"], name
            continue
        assert case["collectives"] == [], name
        tensor, rows = expected_specs[split]
        assert case["shardings"] == [tensor, rows, tensor, tensor, tensor], name


@pytest.mark.parametrize("devices", [4, 8])
def test_ring_attention_over_a_sharded_sequence(devices):
    """[jax-scale] 2: the sequence sharded over 4 and 8 host devices, causal (contiguous shards reordered to zig-zag
    inside, and shards already in zig-zag order) and not (keys longer than queries), GQA and MQA, with dropout too:
    out, lse and the gradients within float32 rounding of one unsharded call (with dropout: the same key, so each
    block drops exactly the unsharded call's elements). Every device makes the same calls: 3 at the first causal
    step and one per later step, each over 2 chunk pairs (the cond picks one of two equal-work branches), so the
    recorded forward launches are exactly n (n + 2) causal and n * n without a mask; with dropout a causal later
    step makes its calls per chunk (2), so n (2 n + 1)."""
    results = run_worker("ring_worker.py", str(devices))
    assert set(results) == {"causal-gqa", "causal-mqa-zigzag", "full-longer-keys", "causal-gqa-dropout-zigzag",
                            "full-mqa-dropout"}
    for name, case in results.items():
        for difference, scale in zip(case["differences"], case["scale"]):
            assert difference <= 1e-5 * max(1.0, scale), (name, case)
        causal, dropout = name.startswith("causal"), "dropout" in name
        assert case["dropped"] == dropout, (name, case)
        per_device = (2 * devices + 1 if dropout else devices + 2) if causal else devices
        assert case["forward_launches"] == devices * per_device, (name, case)


def test_jax_export_round_trip_in_a_fresh_process(tmp_path):
    """[jax-scale] 4: a forward and grad exported with jax.export (the custom call allowed explicitly), serialized,
    then deserialized and run in a process that never lowered cuflash: importing cuflash.jax registers the target
    and the kernel resolver, the kernels register on first execution, and the results are bitwise the exporter's."""
    blob = tmp_path / "attention.jax_exported"
    exported = run_worker("export_worker.py", "export", str(blob))
    assert exported["custom_calls"] == 3  # the forward, and the grad's own forward and backward
    called = run_worker("export_worker.py", "call", str(blob))
    assert called["bitwise"] == [True] * 4


def test_a_call_lowered_by_another_cuflash_version_is_refused(monkeypatch):
    import jax
    import numpy as np

    import cuflash.jax as cfj
    from cuflash.jax import _primitives

    monkeypatch.setattr(_primitives._ffi, "call_abi", lambda: "0.0.0-another")
    q = np.ones((1, 4, 1, 8), np.float32)
    with pytest.raises(Exception, match="lowered by cuflash 0.0.0-another, but the handler library is"):
        jax.block_until_ready(jax.jit(lambda q: cfj.attention(q, q, q, softmax_scale=0.3))(q))


def test_two_processes_share_the_persistent_compilation_cache(tmp_path):
    cache = tmp_path / "jax_compilation_cache"
    first = run_worker("persistent_cache_worker.py", str(cache))
    assert first["cache_events"] == {"cache_hits": 0, "cache_misses": 1}
    assert any(cache.iterdir()), "the first process wrote no cache entry"
    second = run_worker("persistent_cache_worker.py", str(cache))
    # The second process loads the executable the first one compiled and still finds its kernels.
    assert second["cache_events"] == {"cache_hits": 1, "cache_misses": 0}
    for result in (first, second):
        assert result["value_error"] < 1e-4
        assert max(result["grad_errors"]) < 1e-5
    assert second["grad_errors"] == first["grad_errors"]
