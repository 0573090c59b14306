"""The split-KV benchmark (cuflash/benchmarks/splitkv.py) without a GPU: its shapes and the plans they get on an H100's
132 SMs, the whole run on the simulator (NumPy arrays) with a stand-in timer whose device time follows the launches
the call made, the checks that keep a wrong count or peer from being timed, the time budget, and the table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cuflash import sim
from cuflash.benchmarks import splitkv
from cuflash.benchmarks.splitkv import CUFLASH_SYSTEM, TORCH_SYSTEM, SplitShape
from cuflash.benchmarks.timing import Run
from cuflash.reference import attention_reference
from cuflash.testing import numpy_dtype

COMBINE = "fa2_split_kv_combine_kernel"
# Ragged key counts of a few K/V blocks; GQA decode and a causal chunk with fewer query rows than keys.
TINY = [SplitShape(1, 1, 300, 4, 2, 32, False, "float16"), SplitShape(1, 3, 260, 2, 2, 32, True, "bfloat16"),
        SplitShape(1, 2, 200, 2, 1, 32, False, "float16")]


def test_shapes_are_short_queries_over_long_keys_that_the_heuristic_splits_on_an_h100():
    shapes = splitkv.splitkv_shapes()
    assert {s.dtype for s in shapes} == {"bfloat16", "float16"} and {s.headdim for s in shapes} == {128}
    assert all(s.seqlen_q <= 64 and s.seqlen_k >= 4096 and s.batch == 1 for s in shapes)
    assert {(s.seqlen_q, s.nheads, s.nheads_k) for s in shapes} == {(1, 32, 8), (64, 8, 8)}
    causal = [s for s in shapes if s.causal]
    assert len(causal) == 2 and all(s.seqlen_q < s.seqlen_k and s.torch_refusal() for s in causal)
    assert len({s.label() for s in shapes}) == len(shapes)
    # sm_90's table target has the H100's 132 SMs: every shape leaves SMs idle unsplit, and the heuristic splits it
    with sim.targeting("sm_90"):
        for s in shapes:
            q, k, v = (np.empty(shape, numpy_dtype(s.dtype)) for shape in
                       ((s.batch, s.seqlen_q, s.nheads, s.headdim), (s.batch, s.seqlen_k, s.nheads_k, s.headdim),
                        (s.batch, s.seqlen_k, s.nheads_k, s.headdim)))
            heuristic, variant = splitkv.planned_splits(q, k, v, s.causal, 0)
            assert heuristic > 1 and variant == "hopper", s
            assert splitkv.planned_splits(q, k, v, s.causal, 1)[0] == 1
            assert splitkv.planned_splits(q, k, v, s.causal, 16)[0] == 16 != heuristic
    for bad in (dict(nheads=3), dict(seqlen_k=0), dict(dtype="int8")):
        with pytest.raises(ValueError, match="SplitShape"):
            SplitShape(**{**TINY[0].__dict__, **bad})


class LaunchTimer:
    """A stand-in for timing.cupy_timer: runs the call on the simulator and 'takes' 8 ms over the split count its
    first launch ran (grid.x is the Q blocks x splits), so the heuristic's speedup is its split count; each timed
    run moves ``clock`` on by a second."""

    def __init__(self, clock=None):
        self.clock, self.grids, self.combined = clock, [], []

    def warm(self, fn):
        fn()

    def run(self, fn):
        with sim.record() as records:
            fn()
        kernels = [str(launch.kernel) for launch in records.launches]
        self.grids.append(records.launches[0].grid)
        self.combined.append(any(COMBINE in name for name in kernels))
        if self.clock is not None:
            self.clock.now += 1.0
        return Run(8.0 / records.launches[0].grid[0], 50.0)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def _run(shapes, clock=None, **options):
    """run_splitkv on the simulator (NumPy arrays), a LaunchTimer per shape; with ``clock``, the run's clock too."""
    timers = []

    def make_timer():
        timers.append(LaunchTimer(clock))
        return timers[-1]

    if clock is not None:
        options["clock"] = clock
    result = splitkv.run_splitkv(shapes, to_device=lambda x: x, to_host=np.asarray, cuflash_timer=make_timer,
                                 warmup=1, repeats=2, **options)
    return result, timers


def test_the_run_on_the_simulator_checks_plans_and_times_every_count(tmp_path):
    written = []
    result, timers = _run(TINY[:2], counts=(0, 3),
                          on_shape=lambda so_far: written.append(splitkv.write_outputs(so_far, tmp_path)))
    assert result["counts"] == [1, 0, 3]  # the unsplit baseline always runs, first
    assert len(written) == 2 and json.loads((tmp_path / "splitkv.json").read_text()) == json.loads(json.dumps(result))
    for shape, timer in zip(TINY[:2], timers):
        mine = {m["num_splits"]: m for m in result["measurements"] if m["shape"] == shape.label()}
        assert set(mine) == {1, 0, 3}
        # the split count recorded is the one the call's launches ran: grid.x, and the combine kernel when split
        ran = [grid[0] for grid in timer.grids]
        assert ran == [mine[n]["splits"] for n in (1, 0, 3) for _ in range(2)]
        assert timer.combined == [mine[n]["splits"] > 1 for n in (1, 0, 3) for _ in range(2)]
        assert mine[1]["splits"] == 1 and mine[3]["splits"] == 3 and mine[0]["splits"] > 1
        assert mine[0]["milliseconds"] == pytest.approx(8.0 / mine[0]["splits"])
        assert mine[0]["kv_gb_per_s"] == pytest.approx(shape.kv_bytes() / mine[0]["milliseconds"] / 1e6)
    for check in result["checks"].values():
        assert {n: v["passed"] for n, v in check[CUFLASH_SYSTEM].items()} == {"1": True, "0": True, "3": True}
    rows = splitkv.splitkv_rows(result)
    assert [r["speedup"] for r in rows] == [pytest.approx(r["splits"][0]) for r in rows]
    assert all(r["check"] == "pass" and r["torch_milliseconds"] is None for r in rows)
    assert result["skipped"] == []


def test_a_count_or_peer_that_fails_its_check_is_listed_not_timed(monkeypatch):
    real_call = splitkv._cuflash_call

    def wrong_when_split_in_three(q, k, v, causal, num_splits):
        call = real_call(q, k, v, causal, num_splits)
        return (lambda: call() * 1.25) if num_splits == 3 else call

    monkeypatch.setattr(splitkv, "_cuflash_call", wrong_when_split_in_three)

    class Peer:  # PyTorch's adapter as run_splitkv sees it: right on the plain shape
        def __init__(self):
            self.timed = []

        def compute(self, q, k, v, causal):
            return attention_reference(q, k, v, causal=causal)[0].astype(q.dtype)

        def call(self, q, k, v, causal):
            self.timed.append((q.shape, k.shape))
            return lambda: None

        def timer(self):
            return type("T", (), {"warm": lambda self, fn: fn(), "run": lambda self, fn: (fn(), Run(0.5, 9.0))[1]})()

    peer = Peer()
    result, _ = _run(TINY[:2], counts=(0, 3), torch_peer=peer)
    skipped = {(s["shape"], s["system"]): s["reason"] for s in result["skipped"]}
    for shape in TINY[:2]:
        assert skipped[(shape.label(), f"{CUFLASH_SYSTEM} num_splits=3")].startswith("failed its check: wrong result: "
                                                                                     "out (num_splits=3)")
        assert {m["num_splits"] for m in result["measurements"] if m["system"] == CUFLASH_SYSTEM
                and m["shape"] == shape.label()} == {1, 0}
    # the causal shape with fewer query rows than keys is not PyTorch's problem (top-left is_causal): not timed
    assert skipped[(TINY[1].label(), TORCH_SYSTEM)].startswith("PyTorch's is_causal aligns the diagonal top-left")
    assert peer.timed == [((1, 1, 4, 32), (1, 300, 2, 32))]  # the timed shape's arrays, GQA heads as they are
    assert result["checks"][TINY[0].checked_at().label()][TORCH_SYSTEM]["passed"]
    rows = {r["shape"]: r for r in splitkv.splitkv_rows(result)}
    assert rows[TINY[0].label()]["torch_milliseconds"] == 0.5
    assert rows[TINY[0].label()]["check"].startswith("num_splits=3: wrong result")
    assert "2 shapes failed a check" in splitkv.summary_detail(result)


def test_a_shape_starts_only_while_the_time_left_covers_the_latest_one():
    clock = Clock()
    # each shape: 3 counts x 2 timed runs, a second each; the third shape would start with 1 s left of 13
    result, _ = _run(TINY, counts=(0, 3), budget_s=13, clock=clock)
    assert [s["label"] for s in result["shapes"]] == [TINY[0].label(), TINY[1].label()]
    assert result["skipped"] == [{"shape": TINY[2].label(), "system": "all",
                                  "reason": "over budget: 1 s left, the latest shape took 6 s"}]


# What a splitkv step recorded on a (fictional) H100: two shapes, one count failing its check on the second.
RECORDED = {
    "device": "NVIDIA H100 80GB HBM3", "timing": "busy start", "counts": [1, 0, 16], "check_seqlen_k": 1999,
    "shapes": [{"label": "b1 q1 k32768 h32/8 d128 full bfloat16", "check": "b1 q1 k1999 h32/8 d128 full bfloat16"},
               {"label": "b1 q64 k16384 h8 d128 causal float16", "check": "b1 q64 k1999 h8 d128 causal float16"}],
    "checks": {"b1 q1 k1999 h32/8 d128 full bfloat16": {
                   CUFLASH_SYSTEM: {n: {"passed": True, "detail": "max error 0.31 of the bound", "splits": s}
                                    for n, s in (("1", 1), ("0", 4), ("16", 16))},
                   TORCH_SYSTEM: {"passed": True, "detail": "max error 0.40 of the bound"}, "seqlen_k": 1999},
               "b1 q64 k1999 h8 d128 causal float16": {CUFLASH_SYSTEM: {
                   "1": {"passed": True, "detail": "max error 0.2 of the bound", "splits": 1},
                   "0": {"passed": True, "detail": "max error 0.2 of the bound", "splits": 15},
                   "16": {"passed": False, "detail": "wrong result: out (num_splits=16): max error 3 > bound 0.01",
                          "splits": 16}}, "seqlen_k": 1999}},
    "measurements": [
        {"shape": "b1 q1 k32768 h32/8 d128 full bfloat16", "system": CUFLASH_SYSTEM, "num_splits": 1, "splits": 1,
         "milliseconds": 0.480, "kv_gb_per_s": 280.0},
        {"shape": "b1 q1 k32768 h32/8 d128 full bfloat16", "system": CUFLASH_SYSTEM, "num_splits": 0, "splits": 4,
         "milliseconds": 0.120, "kv_gb_per_s": 1118.0},
        {"shape": "b1 q1 k32768 h32/8 d128 full bfloat16", "system": CUFLASH_SYSTEM, "num_splits": 16, "splits": 16,
         "milliseconds": 0.060, "kv_gb_per_s": 2237.0},
        {"shape": "b1 q1 k32768 h32/8 d128 full bfloat16", "system": TORCH_SYSTEM, "num_splits": None,
         "splits": None, "milliseconds": 0.050, "kv_gb_per_s": 2684.0},
        {"shape": "b1 q64 k16384 h8 d128 causal float16", "system": CUFLASH_SYSTEM, "num_splits": 1, "splits": 1,
         "milliseconds": 0.900, "kv_gb_per_s": 74.6},
        {"shape": "b1 q64 k16384 h8 d128 causal float16", "system": CUFLASH_SYSTEM, "num_splits": 0, "splits": 15,
         "milliseconds": 0.100, "kv_gb_per_s": 671.0},
    ],
    "skipped": [{"shape": "b1 q64 k16384 h8 d128 causal float16", "system": f"{CUFLASH_SYSTEM} num_splits=16",
                 "reason": "failed its check: wrong result: out (num_splits=16): max error 3 > bound 0.01"}],
}


def test_the_table_of_a_recorded_result():
    lines = splitkv.markdown_lines(RECORDED)
    assert lines[0] == "Device NVIDIA H100 80GB HBM3; busy start"
    header = next(line for line in lines if line.startswith("| shape |"))
    assert header.count("|") - 1 == len(next(line for line in lines if line.startswith("|---")).split("|")) - 2
    decode = next(line for line in lines if line.startswith("| b1 q1 k32768"))
    cells = [c.strip() for c in decode.strip("|").split("|")]
    assert cells[1:] == ["0.480 (1)", "0.120 (4)", "0.060 (16)", "4.00", "0.050", "2237", "pass"]
    chunk = [c.strip() for c in next(line for line in lines if line.startswith("| b1 q64")).strip("|").split("|")]
    assert chunk[1:7] == ["0.900 (1)", "0.100 (15)", "-", "9.00", "-", "671"]
    assert chunk[7].startswith("num_splits=16: wrong result")
    assert lines[-1].startswith("- cuflash-fa2 num_splits=16 b1 q64 k16384 h8 d128 causal float16: failed its check")
    assert splitkv.summary_detail(RECORDED) == ("2 shapes, 1 skipped; speedup 0/1 4.00x to 9.00x; "
                                                "1 shapes failed a check")
    assert math.isclose(splitkv.splitkv_rows(RECORDED)[1]["speedup"], 9.0)
