"""The benchmarks' flex workloads (document mask of 8 documents, prefix-LM, relative-position bias): their FLOPs, the
speed sweep with them (fake timers; the check against the reference on the simulator), the traffic benchmark's
bytes falling with the block mask's sparsity (simulator counts), and the GPU path (gpu marker)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

import cuflash
from cuflash.benchmarks import __main__ as bench_main
from cuflash.benchmarks import peers, plots, speed, traffic
from cuflash.benchmarks.workloads import (
    FLEX_VARIANTS,
    Workload,
    attention_flops,
    document_ids,
    flex_mods,
    flex_sweep,
    visible_fraction,
)
from test_benchmarks_speed import FakeSystem, fa2_ms  # the fake timer's system


@pytest.mark.parametrize("seqlen", [512, 77])
def test_flex_workloads_count_the_flops_of_the_scores_they_keep(seqlen):
    ids = document_ids(seqlen)
    assert ids.dtype == np.int32 and ids[0] == 0 and ids[-1] == 7 and np.all(np.diff(ids) >= 0)
    q_idx, kv_idx = np.meshgrid(np.arange(seqlen), np.arange(seqlen), indexing="ij")
    kept = {"document": ids[q_idx] == ids[kv_idx],
            "prefix-lm": (kv_idx < seqlen // 4) | (q_idx >= kv_idx),
            "relative-bias": np.ones((seqlen, seqlen), bool)}
    for variant in FLEX_VARIANTS:
        assert visible_fraction(variant, seqlen) == pytest.approx(kept[variant].mean())
        w = Workload(2, seqlen, 4, 64, False, "float16", flex=variant)
        assert w.flops("backward") == pytest.approx(attention_flops(2, 4, seqlen, 64, False, "backward")
                                                    * kept[variant].mean())
        assert w.label() == f"b2 s{seqlen} h4 d64 {variant} float16"
    assert visible_fraction("document", 512) == 1 / 8
    with pytest.raises(ValueError, match="Workload.flex must be None or one of"):
        Workload(1, 64, 1, 64, False, "float16", flex="alibi")
    with pytest.raises(ValueError, match="causal=False"):
        Workload(1, 64, 1, 64, True, "float16", flex="document")
    sweep = flex_sweep(("document",), headdims=(64,), seqlens=(512, 1024))
    assert [(w.batch, w.seqlen, w.nheads, w.flex, w.causal) for w in sweep] == \
        [(32, 512, 32, "document", False), (16, 1024, 32, "document", False)]


def test_the_sweep_times_flex_workloads_on_the_systems_that_take_them(tmp_path):
    """Only a system naming the variant in flex_variants is checked (with the variant) and timed; the others are
    skipped with the reason. The table names the variant, the CSV and JSON keep it, the plots get a panel of it."""
    fa2 = FakeSystem("cuflash-fa2", fa2_ms, is_cuflash=True)
    fa2.flex_variants = FLEX_VARIANTS
    peer = FakeSystem("torch-flash", fa2_ms)
    checked = []

    def check(system, dtype, headdim, causal, flex=None):
        checked.append((system.key, flex))
        return speed.Check(system.key, dtype, headdim, causal, True, "fake: passed", flex)

    workloads = [Workload(2, 512, 4, 64, False, "float16"), Workload(2, 512, 4, 64, False, "float16", flex="document"),
                 Workload(2, 512, 4, 64, False, "float16", flex="relative-bias")]
    result = speed.run_sweep([fa2, peer], workloads, warmup=0, repeats=5, check=check, progress_stream=None)
    assert checked == [("cuflash-fa2", None), ("torch-flash", None), ("cuflash-fa2", "document"),
                       ("cuflash-fa2", "relative-bias")]
    assert {(m.system, m.workload.flex) for m in result.measurements} == {
        ("cuflash-fa2", None), ("torch-flash", None), ("cuflash-fa2", "document"), ("cuflash-fa2", "relative-bias")}
    assert [(s.system, s.reason) for s in result.skipped] == [("torch-flash", "takes no flex mods")] * 2
    document = next(m for m in result.measurements if m.workload.flex == "document" and m.direction == "forward")
    assert document.tflops == pytest.approx(workloads[1].flops("forward") / document.milliseconds / 1e9)
    table = speed.format_table(result)
    assert "relative-bias" in table and " document " in table
    written = speed.write_outputs(result, tmp_path)
    rows = list(csv.DictReader(written[1].open()))
    assert {r["flex"] for r in rows} == {"", "document", "relative-bias"}
    again = speed.SweepResult.from_dict(json.loads(written[0].read_text()))
    assert {m.workload for m in again.measurements} == set(workloads)
    panels = plots.speed_panels(result, "forward")
    assert set(panels) == {("float16", 64, False), ("float16", 64, "document"), ("float16", 64, "relative-bias")}


class SimulatorFlex(peers.System):
    """cuflash's flex_attention on NumPy arrays (the simulator), or a wrong one that ignores the mask."""

    check_seqlen = 67
    flex_variants = FLEX_VARIANTS

    def __init__(self, key, ignore_mask=False):
        self.key = self.label = key
        self.ignore_mask = ignore_mask

    def unavailable(self):
        return None

    def compute(self, q, k, v, dout, causal, flex=None):
        mods = peers._flex_options(flex, q.shape[1], q.shape[2])
        if self.ignore_mask:
            mods.pop("block_mask", None)
        out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
        return out, cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)


def test_the_flex_check_accepts_the_variant_and_rejects_a_result_without_its_mask():
    good = speed.check_against_reference(SimulatorFlex("good"), "float32", 32, False, flex="prefix-lm")
    assert good.passed and good.flex == "prefix-lm", good.detail
    bad = speed.check_against_reference(SimulatorFlex("bad", ignore_mask=True), "float32", 32, False,
                                        flex="prefix-lm")
    assert not bad.passed and "wrong result" in bad.detail


def test_the_document_mask_reads_an_eighth_of_dense_k_and_v():
    """8 equal documents of 64 rows (a whole number of the SIMT kernel's tiles) through a block mask of one block per
    document: the forward's K/V bytes are 1/8 of dense attention's, plus the lists' few int32 reads; the backward's
    launches together read less than a third of dense's (its pre-pass and dq conversion read every row whatever the
    mask; its main kernel reads Q and dO of one document per K/V tile)."""
    dense, document = traffic.flex_measure(["document"], seqlen=512, headdim=32, dtype="float32")
    assert (dense.variant, document.variant) == ("dense", "document")
    assert document.sparsity == pytest.approx(100 * 7 / 8) and dense.sparsity == 0
    assert dense.kv_read / 8 <= document.kv_read <= 1.3 * dense.kv_read / 8, (document.kv_read, dense.kv_read)
    assert document.backward_read < dense.backward_read / 3


def test_the_flex_traffic_table_and_command(monkeypatch, capsys):
    rows = [traffic.FlexTraffic("dense", 0.0, 1000, 3000, 800), traffic.FlexTraffic("document", 87.5, 300, 500, 100)]
    seen = {}

    def fake_measure(variants, **kw):
        seen.update(kw, variants=list(variants))
        return rows

    monkeypatch.setattr(traffic, "flex_measure", fake_measure)
    assert bench_main.main(["traffic", "--flex", "document", "--seqlens", "256", "--headdims", "40",
                            "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert seen == {"variants": ["document"], "seqlen": 256, "headdim": 40, "dtype": "float32"}
    line = next(line for line in out.splitlines() if line.split() and line.split()[0] == "document")
    assert line.split() == ["document", "87.5", "300", "500", "100", "0.125"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", FLEX_VARIANTS)
def test_cuflash_fa2_checks_and_times_each_flex_variant_on_the_gpu(variant):
    (system,) = peers.select(["cuflash-fa2"])
    reason = system.unavailable()
    if reason:
        pytest.skip(reason)
    check = speed.check_against_reference(system, "float16", 64, False, flex=variant)
    assert check.passed, check.detail
    workload = Workload(2, 1024, 4, 64, False, "float16", flex=variant)
    result = speed.run_sweep([system], [workload], warmup=1, repeats=3, progress_stream=None)
    assert {m.direction for m in result.measurements} == set(system.directions), result.skipped
    assert all(m.tflops > 0 and m.host_us > 0 for m in result.measurements)
