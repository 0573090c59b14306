"""first-gpu without a GPU: its step plan and time limits with a fake runner and clock, the parsers of what its steps
leave (JUnit XML, ncu's raw CSV), and the summary written from recorded step outcomes (a fixture with a failed and a
timed-out step)."""

from __future__ import annotations

import json
import time

import pytest

from cuflash.benchmarks import first_gpu
from cuflash.benchmarks.first_gpu import STEPS, Step
from cuflash.benchmarks.workloads import Workload


def _measurement(system, direction, seqlen, tflops, host_us, headdim=128, causal=False, dtype="float16"):
    w = Workload.fa2_setting(seqlen, headdim, causal, dtype)
    ms = w.flops(direction) / tflops / 1e9
    return {"system": system, "direction": direction, **w.as_dict(), "milliseconds": ms, "tflops": tflops,
            "host_microseconds": host_us, "runs_ms": [ms] * 3, "runs_host_us": [host_us] * 3, "uncovered_runs": 0}


# What first-gpu recorded on a (fictional) run: the tests failed, host timed out, ncu and speed passed.
RECORDED = json.loads(json.dumps({
    "device": "NVIDIA H100 80GB HBM3", "total_s": 540, "seconds": 512.3,
    "steps": [
        {"name": "toolchain", "status": "pass", "seconds": 2.1, "timeout_s": 20, "rc": 0,
         "command": "python3 -m cuflash.kernels toolchain", "detail": "sm_90: CUBIN", "data": {"lines": ["sm_90"]}},
        {"name": "tests", "status": "fail", "seconds": 131.0, "timeout_s": 157.9, "rc": 1, "command": "pytest -m gpu",
         "detail": "40 passed, 2 failed, 0 errors, 3 skipped",
         "data": {"passed": 40, "failed": 2, "skipped": 3, "errors": 0,
                  "failures": ["tests.test_cupy_gpu::test_fa2_bf16", "tests.test_cupy_gpu::test_varlen"]}},
        {"name": "validate", "status": "fail", "seconds": 88.0, "timeout_s": 127.0, "rc": 1,
         "command": "validate-gpu --skip tests speed", "detail": "see validate/summary.md",
         "data": {"steps": {"sanitizer": {"status": "fail", "detail": "memcheck ok; racecheck 3 hazards", "tools": {
             "memcheck": {"status": "pass", "detail": "ERROR SUMMARY: 0 errors; 1 cases ran; exit 0"},
             "racecheck": {"status": "fail", "detail": "RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)"},
         }}}}},
        {"name": "speed", "status": "pass", "seconds": 160.0, "timeout_s": 209.0, "rc": 0, "command": "speed ...",
         "detail": "6 timings, 1 skipped", "data": {"result": {
             "device": "NVIDIA H100 80GB HBM3", "timing": "busy start", "toolchain": "sm_90 CUBINs from NVRTC 13.0",
             "systems": ["cuflash-fa2", "torch-flash", "jax-xla"],
             "measurements": [
                 _measurement("cuflash-fa2", "forward", 512, 180.0, 210.0),
                 _measurement("torch-flash", "forward", 512, 200.0, 45.0),
                 _measurement("jax-xla", "forward", 512, 150.0, 30.0),
                 _measurement("cuflash-fa2", "forward+backward", 512, 120.0, 650.0),
                 _measurement("torch-flash", "forward+backward", 512, 100.0, 160.0),
                 _measurement("jax-xla", "forward+backward", 512, 80.0, 60.0),
             ],
             "checks": [], "skipped": [{"system": "cuflash-fa2", "workload": "b1 s16384 h16 d128 full float16",
                                        "reason": "over budget: expected 40 s, 12 s left"}]}}},
        {"name": "splitkv", "status": "pass", "seconds": 30.0, "timeout_s": 94.0, "rc": 0, "command": "splitkv ...",
         "detail": "1 shapes, 0 skipped; speedup 0/1 4.00x to 4.00x; checks pass", "data": {"result": {
             "device": "NVIDIA H100 80GB HBM3", "timing": "busy start", "counts": [1, 0, 16], "check_seqlen_k": 1999,
             "shapes": [{"label": "b1 q1 k32768 h32/8 d128 full bfloat16",
                         "check": "b1 q1 k1999 h32/8 d128 full bfloat16"}],
             "checks": {"b1 q1 k1999 h32/8 d128 full bfloat16": {"cuflash-fa2": {
                 n: {"passed": True, "detail": "max error 0.3 of the bound", "splits": s}
                 for n, s in (("1", 1), ("0", 4), ("16", 16))}, "seqlen_k": 1999}},
             "measurements": [{"shape": "b1 q1 k32768 h32/8 d128 full bfloat16", "system": "cuflash-fa2",
                               "num_splits": n, "splits": s, "milliseconds": ms, "kv_gb_per_s": 67.1 / ms}
                              for n, s, ms in ((1, 1, 0.48), (0, 4, 0.12), (16, 16, 0.06))],
             "skipped": [{"shape": "all", "system": "torch-flash", "reason": "unavailable: no PyTorch"}]}}},
        {"name": "ncu", "status": "pass", "seconds": 41.0, "timeout_s": 109.0, "rc": 0, "command": "ncu --csv ...",
         "detail": "2 kernels profiled", "data": {"kernels": [
             {"kernel": "fa2_tc_forward_kernel<128>", "tensor_pipe_pct": 61.5,
              "stalls": {"long_scoreboard": 1.9, "barrier": 0.8, "math_pipe_throttle": 0.5}},
             {"kernel": "fa2_tc_backward_kernel<128>", "tensor_pipe_pct": 42.25, "stalls": {"short_scoreboard": 2.5}},
         ]}},
        {"name": "host", "status": "timeout", "seconds": 80.0, "timeout_s": 80.0, "rc": None,
         "command": "python3 -m cuflash.benchmarks host --out DIR/host", "detail": "(timed out after 80 s)",
         "data": {"rows": [{"call": "attention", "shape": "decode", "backend": "simulator", "microseconds_per_call": 187.3}]}},
    ],
}))


def test_summary_holds_every_recorded_outcome_and_figure(tmp_path):
    written = first_gpu.write_summary(tmp_path, RECORDED)
    assert [p.name for p in written] == ["summary.md", "summary.json", "summary.png"]
    md = (tmp_path / "summary.md").read_text()
    assert "# cuflash first-gpu on NVIDIA H100 80GB HBM3" in md
    for name, status in [("toolchain", "pass"), ("tests", "fail"), ("validate", "fail"), ("speed", "pass"),
                         ("splitkv", "pass"), ("ncu", "pass"), ("host", "timeout")]:
        assert f"| {name} | {status} |" in md
    assert "- tests.test_cupy_gpu::test_fa2_bf16" in md and "- tests.test_cupy_gpu::test_varlen" in md
    assert "sanitizer memcheck: **pass**" in md and "sanitizer racecheck: **fail**" in md
    # speed: every system's TFLOP/s, the best peer and fa2's ratio to it, and host us per call
    rows = [line for line in md.splitlines() if line.startswith("| forward")]
    forward = next(r for r in rows if r.startswith("| forward | float16 | 128 | False | 512 |"))
    cells = [c.strip() for c in forward.strip("|").split("|")]
    assert cells[5:8] == ["180.0", "200.0", "150.0"] and cells[8:10] == ["torch-flash", f"{180 / 200:.3f}"]
    assert cells[10:13] == ["210", "45", "30"]
    both = next(r for r in rows if r.startswith("| forward+backward |"))
    assert [c.strip() for c in both.strip("|").split("|")][8:10] == ["torch-flash", f"{120 / 100:.3f}"]
    assert "over budget: expected 40 s, 12 s left" in md
    assert "| fa2_tc_forward_kernel<128> | 61.5 | long_scoreboard 1.90, barrier 0.80, math_pipe_throttle 0.50 |" in md
    assert "| fa2_tc_backward_kernel<128> | 42.2 | short_scoreboard 2.50 |" in md
    assert "| attention | decode | simulator | 187.3 | - |" in md
    assert "## Toolchain\n\n```\nsm_90\n```" in md
    # split-KV: ms and splits per count, the heuristic's speedup over no split, the skips
    assert "## Split-KV decode (splitkv.py)" in md
    assert ("| b1 q1 k32768 h32/8 d128 full bfloat16 | 0.480 (1) | 0.120 (4) | 0.060 (16) | 4.00 | - | 1118 | pass |"
            in md)
    assert "- torch-flash all: unavailable: no PyTorch" in md
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["steps"] == RECORDED["steps"]
    ratios = {(r["direction"], r["seqlen"]): r["ratio_to_best_peer"] for r in data["speed_rows"]}
    assert ratios == {("forward", 512): pytest.approx(0.9), ("forward+backward", 512): pytest.approx(1.2)}
    assert [(r["shape"], r["speedup"]) for r in data["splitkv_rows"]] == [
        ("b1 q1 k32768 h32/8 d128 full bfloat16", pytest.approx(4.0))]
    assert (tmp_path / "summary.png").stat().st_size > 10_000


def test_summary_without_speed_still_writes_three_files(tmp_path):
    record = {**RECORDED, "steps": [s for s in RECORDED["steps"] if s["name"] not in ("speed", "splitkv")]}
    first_gpu.write_summary(tmp_path, record)
    assert "## Speed" not in (tmp_path / "summary.md").read_text()
    assert "## Split-KV" not in (tmp_path / "summary.md").read_text()
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["speed_rows"] == [] and data["splitkv_rows"] == []
    assert (tmp_path / "summary.png").stat().st_size > 1_000


def test_parse_junit_counts_and_names_failures():
    xml = """<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="5">
      <testcase classname="tests.test_a" name="test_ok"/>
      <testcase classname="tests.test_a" name="test_ok2"/>
      <testcase classname="tests.test_b" name="test_bad[fp16]"><failure message="boom"/></testcase>
      <testcase classname="tests.test_b" name="test_broken"><error message="fixture"/></testcase>
      <testcase classname="tests.test_c" name="test_skip"><skipped message="no jax"/></testcase>
      <testcase time="0.000" />
    </testsuite></testsuites>"""  # the last: the test an interrupt stopped (pytest writes it without a name)
    assert first_gpu.parse_junit(xml) == {"passed": 2, "failed": 1, "skipped": 1, "errors": 1,
                                          "failures": ["tests.test_b::test_bad[fp16]", "tests.test_b::test_broken"]}


def test_parse_ncu_reads_tensor_pipe_and_stall_reasons():
    metric = first_gpu.TENSOR_PIPE_METRIC
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", metric, stall.format("barrier"), stall.format("long_scoreboard"),
              stall.format("barrier_not_issued"), "sm__throughput.avg.pct_of_peak_sustained_elapsed"]
    line = lambda cells: ",".join(f'"{c}"' for c in cells)  # noqa: E731
    text = "\n".join(["==PROF== Connected to process 1", line(header), line(["", "", "%", "ratio", "ratio", "ratio", "%"]),
                      line(["0", "void fa2_tc_forward_kernel<128>", "61.5", "0.8", "1,901.5", "0.1", "70"]),
                      line(["1", "void fa2_tc_backward_kernel<128>", "n/a", "2.0", "0.5", "0.2", "55"])])
    kernels = first_gpu.parse_ncu(text)
    assert kernels[0] == {"kernel": "void fa2_tc_forward_kernel<128>", "tensor_pipe_pct": 61.5,
                          "stalls": {"long_scoreboard": 1901.5, "barrier": 0.8}}
    assert list(kernels[0]["stalls"]) == ["long_scoreboard", "barrier"]  # largest first
    assert kernels[1]["tensor_pipe_pct"] is None and list(kernels[1]["stalls"]) == ["barrier", "long_scoreboard"]


def test_step_limits_give_each_step_its_budget_plus_what_earlier_steps_left():
    assert sum(s.budget_s for s in STEPS) + first_gpu.SUMMARY_RESERVE_S <= first_gpu.TOTAL_S
    assert first_gpu.step_timeout(STEPS, 0, 0.0) == STEPS[0].budget_s
    # the first step took 5 s of its 20: the second may use its own budget and the 15 s left
    assert first_gpu.step_timeout(STEPS, 1, 5.0) == STEPS[1].budget_s + STEPS[0].budget_s - 5
    # never the time reserved for the steps after it
    assert first_gpu.step_timeout(STEPS, 2, 600.0) == 0.0


def test_splitkv_runs_after_speed_on_time_taken_from_it():
    """The split-KV step follows the speed sweep (whose d128 forward kernels it runs split) with 35 s that were the
    sweep's: the steps still fit the 9 minutes."""
    names = [s.name for s in STEPS]
    assert names == ["toolchain", "smoke", "tests", "validate", "speed", "splitkv", "ncu", "host"]
    budgets = {s.name: s.budget_s for s in STEPS}
    assert (budgets["speed"], budgets["splitkv"]) == (135, 35) and first_gpu.TOTAL_S == 540
    assert sum(budgets.values()) + first_gpu.SUMMARY_RESERVE_S == first_gpu.TOTAL_S
    assert budgets["splitkv"] - first_gpu.SPLITKV_OUTPUT_S >= 25  # start-up and output leave the shapes 25 s


class FakeRun:
    """Scripted steps on a fake clock: each command 'takes' its seconds, or runs into its limit (rc None)."""

    def __init__(self, script):
        self.script, self.now, self.calls = script, 0.0, []

    def clock(self):
        return self.now

    def runner(self, cmd, timeout):
        name = cmd[0]
        self.calls.append((name, timeout))
        seconds, rc, text = self.script[name]
        if seconds >= timeout:
            self.now += timeout + 2  # killing the process group takes a moment
            return None, text + f"\n(timed out after {timeout:.0f} s)"
        self.now += seconds
        return rc, text


def test_run_steps_records_every_outcome_and_runs_on_after_failures_and_timeouts(tmp_path):
    steps = (Step("toolchain", 10, ""), Step("tests", 50, ""), Step("speed", 30, ""), Step("ncu", 20, ""),
             Step("host", 20, ""))
    fake = FakeRun({"toolchain": (4, 0, "sm_90: CUBIN"), "tests": (200, 1, "running"), "speed": (25, 0, "swept"),
                    "host": (1, 3, "error: host.py is missing")})

    def commands_for(out, timeout):
        return {"toolchain": ["toolchain"], "tests": ["tests"], "speed": ["speed", f"--budget-s {timeout - 5:.0f}"],
                "ncu": "ncu not found", "host": ["host"]}

    total = sum(s.budget_s for s in steps) + first_gpu.SUMMARY_RESERVE_S
    records = first_gpu.run_steps(tmp_path, runner=fake.runner, clock=fake.clock, steps=steps, total_s=total,
                                  commands_for=commands_for, progress=None)
    by_name = {r["name"]: r for r in records}
    assert [r["name"] for r in records] == ["toolchain", "tests", "speed", "ncu", "host"]
    assert {n: r["status"] for n, r in by_name.items()} == {
        "toolchain": "pass", "tests": "timeout", "speed": "pass", "ncu": "skipped", "host": "fail"}
    # tests had its 50 s and the 6 s toolchain left; it overran by the kill's 2 s, which the next step pays
    assert fake.calls[1] == ("tests", 56) and fake.calls[2] == ("speed", 28)
    assert by_name["ncu"]["detail"] == "ncu not found"
    assert by_name["toolchain"]["data"] == {"lines": ["sm_90: CUBIN"]}
    # host gets its 20 s, plus the 3 s speed left and the 20 s ncu did not use
    assert fake.calls[3] == ("host", 43) and by_name["host"]["detail"] == "error: host.py is missing"
    assert (tmp_path / "tests" / "log.txt").read_text().endswith("(timed out after 56 s)")
    assert fake.now <= total
    # the summary takes these records as they are
    first_gpu.write_summary(tmp_path, {"device": "fake", "seconds": fake.now, "steps": records})
    assert "| tests | timeout | 58 (56) |" in (tmp_path / "summary.md").read_text()


def test_a_summary_is_written_after_every_step_so_a_run_cut_short_leaves_one(tmp_path):
    """main hands run_steps a callback writing the summary (without its plot) after every step, marked partial: a
    lent machine's time limit that kills the command mid-run leaves the summary of the steps that finished."""
    steps = (Step("toolchain", 10, ""), Step("smoke", 20, ""), Step("tests", 30, ""))
    fake = FakeRun({"toolchain": (4, 0, "sm_90"), "smoke": (9, 0, "smoke: fa2 float16 causal=True shape=(1,) forward: "
                                                               "ok in 9.0 s"), "tests": (20, 1, "1 failed")})
    seen = []

    def summary_so_far(records):
        paths = first_gpu.write_summary(tmp_path, {"device": "fake", "seconds": fake.now, "steps": records,
                                                   "partial": True}, plot=False)
        seen.append(((tmp_path / "summary.md").read_text(), [p.name for p in paths]))

    records = first_gpu.run_steps(tmp_path, runner=fake.runner, clock=fake.clock, steps=steps, total_s=70,
                                  commands_for=lambda out, t: {n: [n] for n in ("toolchain", "smoke", "tests")},
                                  progress=None, on_record=summary_so_far)
    assert len(seen) == 3 and all(names == ["summary.md", "summary.json"] for _, names in seen)
    after_smoke = seen[1][0]
    assert "**Partial**: written after the smoke step" in after_smoke and "| smoke | pass |" in after_smoke
    assert "| tests |" not in after_smoke and not (tmp_path / "summary.png").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["partial"] is True
    final = first_gpu.write_summary(tmp_path, {"device": "fake", "seconds": fake.now, "steps": records})
    assert [p.name for p in final] == ["summary.md", "summary.json", "summary.png"]
    assert "Partial" not in (tmp_path / "summary.md").read_text() and (tmp_path / "summary.png").exists()


def test_a_step_with_no_time_left_is_skipped_and_recorded(tmp_path):
    steps = (Step("toolchain", 10, ""), Step("tests", 10, ""))
    fake = FakeRun({"toolchain": (5, 0, "")})

    def slow_clock():  # something outside the steps (an import) ate the whole budget before tests
        return fake.now + (30 if fake.calls else 0)

    records = first_gpu.run_steps(tmp_path, runner=fake.runner, clock=slow_clock, steps=steps, total_s=30,
                                  commands_for=lambda out, t: {"toolchain": ["toolchain"], "tests": ["tests"]},
                                  progress=None)
    assert records[1]["status"] == "skipped" and records[1]["detail"].startswith("no time left")
    assert [c[0] for c in fake.calls] == ["toolchain"]


def test_commands_fit_the_step_limits(monkeypatch, tmp_path):
    monkeypatch.setattr(first_gpu, "_tool", lambda name: None)
    cmds = first_gpu.commands(tmp_path, 160.0, python="python3")
    assert cmds["ncu"].startswith("ncu not found")
    speed = cmds["speed"]
    assert speed[speed.index("--budget-s") + 1] == str(160 - first_gpu.SPEED_OUTPUT_S)
    for flag, values in [("--headdims", ["128"]), ("--dtypes", ["bfloat16", "float16"]),
                         ("--seqlens", ["4096", "8192", "16384"]),
                         ("--flex", ["document", "prefix-lm", "relative-bias"])]:
        assert speed[speed.index(flag) + 1: speed.index(flag) + 1 + len(values)] == values
    validate = cmds["validate"]
    assert validate[validate.index("--step-timeout") + 1] == "50"  # memcheck, racecheck and ncu share 150 s
    assert "tensor-core" in validate and validate[validate.index("--skip") + 1:][:2] == ["tests", "speed"]
    splitkv = cmds["splitkv"]
    assert splitkv[-5:] == ["splitkv", "--out", str(tmp_path / "splitkv"), "--budget-s",
                            str(160 - first_gpu.SPLITKV_OUTPUT_S)]
    assert cmds["host"][-7:] == ["host", "--out", str(tmp_path / "host"), "--backend", "cupy", "--profile",
                                 str(first_gpu.HOST_PROFILE_CALLS)]
    monkeypatch.setattr(first_gpu, "_tool", lambda name: "/usr/local/cuda/bin/ncu")
    ncu = first_gpu.commands(tmp_path, 60.0, python="python3")["ncu"]
    assert ncu[0] == "/usr/local/cuda/bin/ncu" and ncu[-1] == "ncu-d128"
    assert {"WarpStateStats", "ComputeWorkloadAnalysis", first_gpu.TENSOR_PIPE_METRIC} <= set(ncu)


def test_step_data_reads_what_each_step_wrote(tmp_path):
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "host.json").write_text(json.dumps({"rows": [{"call": "attention"}]}))
    (tmp_path / "speed").mkdir()
    (tmp_path / "speed" / "speed.json").write_text(json.dumps({"measurements": [], "skipped": []}))
    assert first_gpu.step_data("host", tmp_path, "") == {"rows": [{"call": "attention"}], "profile": ""}
    (tmp_path / "host" / "profile.txt").write_text("own us ...\n")
    assert first_gpu.step_data("host", tmp_path, "")["profile"] == "own us ...\n"
    assert first_gpu.step_data("speed", tmp_path, "")["result"] == {"measurements": [], "skipped": []}
    assert first_gpu.step_data("tests", tmp_path, "") == {}  # no XML: pytest died before writing it
    assert first_gpu.step_data("ncu", tmp_path, "") == {"kernels": []}
    assert first_gpu.step_data("splitkv", tmp_path, "") == {"result": None}  # killed before its first shape
    (tmp_path / "splitkv").mkdir()
    splitkv = next(s for s in RECORDED["steps"] if s["name"] == "splitkv")["data"]["result"]
    (tmp_path / "splitkv" / "splitkv.json").write_text(json.dumps(splitkv))
    data = first_gpu.step_data("splitkv", tmp_path, "")
    assert data == {"result": splitkv}
    assert first_gpu._detail("splitkv", 0, data, "") == "1 shapes, 1 skipped; speedup 0/1 4.00x to 4.00x; checks pass"


def test_validate_step_reads_the_verdicts_validate_gpu_wrote(tmp_path):
    (tmp_path / "validate").mkdir()
    steps = {"toolchain": {"status": "pass", "detail": "sm_90"}, "sanitizer": {"status": "fail", "detail": "racecheck"}}
    (tmp_path / "validate" / "summary.json").write_text(json.dumps({"seconds": 80, "steps": steps}))
    data = first_gpu.step_data("validate", tmp_path, "wrote summary.md")
    assert data == {"steps": steps}
    assert first_gpu._detail("validate", 1, data, "wrote summary.md") == "toolchain: pass; sanitizer: fail"


def test_a_hang_seen_by_smoke_skips_every_later_step(tmp_path):
    """The smoke step names a hung kernel: the steps after it are skipped, not run into their limits."""
    steps = (Step("toolchain", 10, ""), Step("smoke", 20, ""), Step("tests", 50, ""), Step("host", 20, ""))
    hung = "cuflash::fa3_backward_kernel<__half, 128, 64, 128, 2> grid (2, 2, 1) block (384, 1, 1)"
    fake = FakeRun({"toolchain": (4, 0, "sm_90"), "smoke": (17, 3, "smoke: fa2 float16 causal=True shape=(1,) "
                                                                  f"forward: ok in 9.0 s\nsmoke: HANG: {hung} still "
                                                                  "running 15 s after its launch\n")})
    records = first_gpu.run_steps(tmp_path, runner=fake.runner, clock=fake.clock, steps=steps, total_s=110,
                                  commands_for=lambda out, t: {n: [n] for n in ("toolchain", "smoke", "tests", "host")},
                                  progress=None)
    assert [c[0] for c in fake.calls] == ["toolchain", "smoke"]
    smoke = records[1]
    assert smoke["status"] == "fail" and smoke["data"]["hang"] == f"{hung} still running 15 s after its launch"
    assert smoke["detail"].startswith("HANG: cuflash::fa3_backward_kernel") and len(smoke["data"]["ran"]) == 1
    for later in records[2:]:
        assert later["status"] == "skipped" and "the smoke step saw a kernel hang" in later["detail"], later
    # a smoke step that only ran out of time (a cold compile) stops nothing
    fake = FakeRun({"toolchain": (4, 0, ""), "smoke": (99, 0, "compiling"), "tests": (5, 0, ""), "host": (1, 0, "")})
    records = first_gpu.run_steps(tmp_path, runner=fake.runner, clock=fake.clock, steps=steps, total_s=110,
                                  commands_for=lambda out, t: {n: [n] for n in ("toolchain", "smoke", "tests", "host")},
                                  progress=None)
    assert [r["status"] for r in records] == ["pass", "timeout", "pass", "pass"]


def test_launch_watch_names_a_kernel_still_running_past_its_limit():
    import threading

    from cuflash.benchmarks.gpu_workloads import LaunchWatch

    hangs, released = [], threading.Event()

    def on_hang(name, seconds):
        hangs.append((name, seconds))
        released.set()  # a real hang never returns: os._exit ends the process

    launched = []
    watch = LaunchWatch(lambda: time.sleep(0.01), limit_s=0.2, on_hang=on_hang, poll_s=0.01)
    for name in ("forward", "backward"):  # quick kernels: synchronized, never reported
        watch.run(name, lambda n=name: launched.append(n))
    assert launched == ["forward", "backward"] and hangs == []
    watch.synchronize = lambda: released.wait(5)  # a kernel that never finishes until the watchdog fires
    watch.run("fa3_backward_kernel", lambda: None)
    assert [name for name, _ in hangs] == ["fa3_backward_kernel"] and hangs[0][1] > 0.2
    watch.close()


@pytest.mark.gpu
def test_gpu_smoke_runs_each_direction_watched():
    import subprocess
    import sys

    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    done = subprocess.run([sys.executable, "-m", "cuflash.benchmarks.gpu_workloads", "smoke"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line for line in done.stdout.splitlines() if ": ok in " in line]
    assert [line.split(": ok in ")[0].rsplit(" ", 2)[-2:] for line in ran][-1] == ["deterministic", "backward"]
    assert len(ran) == 3 and "HANG" not in done.stdout


def test_a_step_out_of_time_is_interrupted_first_then_killed(tmp_path, monkeypatch):
    """run_subprocess on timeout: SIGINT to the group (pytest then writes its JUnit XML of what ran), SIGKILL after
    INTERRUPT_GRACE_S for a process that does not stop (one waiting on a hung kernel)."""
    import sys

    monkeypatch.setattr(first_gpu, "INTERRUPT_GRACE_S", 1)
    written = tmp_path / "written"
    polite = ("import time, pathlib\n"
              "try:\n    print('started', flush=True); time.sleep(60)\n"
              f"except KeyboardInterrupt:\n    pathlib.Path({str(written)!r}).write_text('junit')\n")
    began = time.monotonic()
    rc, text = first_gpu.run_subprocess([sys.executable, "-c", polite], 2)
    assert rc is None and "started" in text and text.endswith("(timed out after 2 s)")
    assert written.read_text() == "junit" and time.monotonic() - began < 10
    stubborn = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                "print('started', flush=True)\ntime.sleep(60)\n")
    began = time.monotonic()
    rc, text = first_gpu.run_subprocess([sys.executable, "-c", stubborn], 2)
    assert rc is None and "started" in text and time.monotonic() - began < 10
