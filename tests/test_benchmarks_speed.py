"""The speed benchmark's machinery without a GPU: a fake timer feeds known milliseconds, and they must come out in
the measurements, the table, the ratios, the JSON, the CSV and the plots' data. Checks against the reference run
on the simulator. Only the CUDA-event timer, the L2 flush and the peer adapters need a GPU (marked gpu below)."""

from __future__ import annotations

import csv
import io
import json
import statistics

import numpy as np
import pytest

import cuflash
from cuflash.benchmarks import peers, plots, speed, timing
from cuflash.benchmarks.workloads import DIRECTIONS, Workload, attention_flops, fa2_sweep
from cuflash.testing import gpu_count


class ScriptedTimer:
    """Returns the given milliseconds one per timed run (host us: 100 x the ms), and logs the order of events."""

    def __init__(self, milliseconds, log, clock=None):
        self.milliseconds, self.log, self.clock = list(milliseconds), log, clock

    def warm(self, fn):
        self.log.append("warm")
        fn()

    def run(self, fn):
        self.log.append("start")
        fn()
        self.log.append("stop")
        ms = self.milliseconds.pop(0)
        if self.clock is not None:
            self.clock.now += ms / 1e3
        return timing.Run(ms, 100 * ms, covered=ms < 4.5)


class FakeSystem(peers.System):
    """A system whose every call 'takes' ms(workload, direction) + small jitter, per a script."""

    def __init__(self, key, ms, *, is_cuflash=False, directions=DIRECTIONS, fail_prepare=None, unavailable=None):
        self.key = self.label = key
        self.is_cuflash = is_cuflash
        self.directions = directions
        self.ms, self.fail_prepare, self._unavailable = ms, fail_prepare, unavailable
        self.log, self.released = [], 0

    def unavailable(self):
        return self._unavailable

    def prepare(self, workload, seed=0):
        if self.fail_prepare:
            raise self.fail_prepare
        base = {d: self.ms(workload, d) for d in self.directions}
        # Five timed runs per direction, consumed in direction order: the median is the base value.
        script = [base[d] * f for d in self.directions for f in (1.3, 1.0, 0.9, 1.0, 1.1)]
        calls = {d: (lambda d=d: self.log.append(f"call {d}")) for d in self.directions}
        return peers.Prepared(calls, ScriptedTimer(script, self.log))

    def release(self):
        self.released += 1


def passing_check(system, dtype, headdim, causal):
    return speed.Check(system.key, dtype, headdim, causal, True, "fake: passed")


def _sweep(systems, workloads, **kw):
    return speed.run_sweep(systems, workloads, warmup=0, repeats=5, check=passing_check, progress_stream=None,
                           device="Fake GPU", timing="fake timer", **kw)


WORKLOADS = fa2_sweep(headdims=(64, 128), seqlens=(512, 2048), causals=(False, True))


def fa2_ms(w, d):
    return 0.25 * w.seqlen / 512 * (1 + w.headdim / 128) * {"forward": 1, "backward": 2.5, "forward+backward": 3.5}[d]


def peer_ms(w, d):
    return fa2_ms(w, d) / 4


def test_measure_warms_up_then_times_each_run_and_takes_the_medians():
    log = []
    timer = ScriptedTimer([5.0, 1.0, 3.0, 2.0, 4.0], log)
    sample = timing.measure(lambda: log.append("call"), timer, warmup=2, repeats=5)
    assert sample.milliseconds == (5.0, 1.0, 3.0, 2.0, 4.0) and sample.median == 3.0
    assert sample.host_microseconds == (500.0, 100.0, 300.0, 200.0, 400.0) and sample.host_median == 300.0
    assert sample.uncovered == 1  # the 5 ms run
    assert log[:4] == ["warm", "call", "warm", "call"]
    assert log[4:] == ["start", "call", "stop"] * 5
    with pytest.raises(ValueError, match="repeats >= 1"):
        timing.measure(lambda: None, timer, repeats=0)


class FakeGpu:
    """One stream's timeline beside a host clock, in microseconds: work queued at host time t starts when the host
    has queued it and the device has finished what was queued before; an event completes with the work before it."""

    L2_BYTES = 50 << 20
    FLUSH_US = 33.0  # twice the L2 written at about 3 TB/s

    def __init__(self):
        self.now = 0.0  # host
        self.free_at = 0.0  # device

    def queue(self, microseconds):
        self.free_at = max(self.now, self.free_at) + microseconds

    def sleep(self, microseconds):
        self.now += microseconds

    def wait(self, until):
        self.now = max(self.now, until)

    def perf_counter(self):
        return self.now / 1e6

    def cupy(self):
        """The parts of CuPy that timing.py's CUDA binding uses (today's and the former), on this timeline."""
        from types import SimpleNamespace

        gpu = self

        class Event:
            def record(self, stream=None):
                self.at = max(gpu.now, gpu.free_at)

            def synchronize(self):
                gpu.wait(self.at)

        class Buffer:
            def fill(self, value):
                gpu.queue(gpu.FLUSH_US)

        class Spin:  # cuflash_bench_spin(nanoseconds)
            def __call__(self, grid, block, args):
                gpu.queue(int(args[0]) / 1000)

        cuda = SimpleNamespace(
            Event=Event, get_elapsed_time=lambda start, end: (end.at - start.at) / 1e3,
            Device=lambda: SimpleNamespace(id=0, attributes={"L2CacheSize": self.L2_BYTES}),
            runtime=SimpleNamespace(getDeviceCount=lambda: 1, deviceSynchronize=lambda: gpu.wait(gpu.free_at)))
        return SimpleNamespace(cuda=cuda, uint8="uint8", empty=lambda n, dtype: Buffer(),
                               RawKernel=lambda source, name: Spin())


def test_host_time_before_the_first_launch_enters_the_host_figure_and_not_the_device_figure(monkeypatch):
    """A call that prepares on the host for 300 us, then launches a 100 us kernel: the device figure is 0.1 ms, the
    host figure 300 us. Timing that starts the event on an idle device (flush, then synchronize) reads 0.4 ms."""
    from types import SimpleNamespace

    gpu = FakeGpu()
    monkeypatch.setattr(timing, "cupy_or_refuse", gpu.cupy)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=gpu.perf_counter), raising=False)

    def call():
        gpu.sleep(300)  # validation, planning, packing, allocation
        gpu.queue(100)  # the kernel

    sample = timing.measure(call, timing.cupy_timer(), warmup=2, repeats=4)
    assert sample.milliseconds == pytest.approx((0.1,) * 4)
    assert sample.host_microseconds == pytest.approx((300.0,) * 4)
    assert sample.uncovered == 0


def test_busy_start_grows_the_spin_when_the_host_outlasts_it_and_counts_calls_it_cannot_cover():
    gpu = FakeGpu()

    class Stream:
        def flush(self):
            gpu.queue(gpu.FLUSH_US)

        def busy(self, microseconds):
            gpu.queue(microseconds)

        def event(self):
            return max(gpu.now, gpu.free_at)

        def elapsed_ms(self, start, end):
            gpu.wait(end)
            return (end - start) / 1e3

    host_us = [50.0]

    def call():
        gpu.sleep(host_us[0])
        gpu.queue(100)

    timer = timing.BusyStartTimer(Stream(), clock=gpu.perf_counter)
    timing.measure(call, timer, warmup=1, repeats=1)
    assert timer.busy_us == 2 * 50 + 50  # sized from the warm-up: twice its host time and a margin
    host_us[0] = 2000.0  # the host slows down after the warm-up: the first try leaves the device idle
    run = timer.run(call)
    assert run.covered and run.device_ms == pytest.approx(0.1) and run.host_us == pytest.approx(2000)
    assert timer.busy_us == pytest.approx(2 * 2000)  # doubled past what the host needed
    host_us[0] = 50.0  # and back: the spin shrinks with it
    assert timer.run(call).covered and timer.busy_us == pytest.approx(2 * 50 + 50)

    def synchronizing_call():  # waits for the device inside itself: no spin can hide its host time
        gpu.wait(gpu.free_at)
        gpu.sleep(300)
        gpu.queue(100)

    run = timer.run(synchronizing_call)
    assert not run.covered and run.device_ms == pytest.approx(0.4)


@pytest.mark.parametrize("dispatch_us, kernel_us, covered", [(30.0, 1000.0, True), (500.0, 100.0, False)])
def test_back_to_back_timing_reads_device_time_while_the_device_is_the_slower(dispatch_us, kernel_us, covered):
    gpu = FakeGpu()
    flushes = []

    def flush():
        gpu.queue(gpu.FLUSH_US)
        flushes.append(gpu.now)
        return "buffer"

    def call():  # JAX: an asynchronous dispatch
        gpu.sleep(dispatch_us)
        gpu.queue(kernel_us)
        return "result"

    timer = timing.BackToBackTimer(flush, lambda x: gpu.wait(gpu.free_at), clock=gpu.perf_counter, calls=10)
    sample = timing.measure(call, timer, warmup=1, repeats=3)
    assert len(flushes) == 3  # one untimed flush per timed run
    assert sample.host_microseconds == pytest.approx((dispatch_us,) * 3)
    # the first dispatch is the one host cost left in the figure, 1/10 of it per call
    expected = (max(dispatch_us, kernel_us) * 10 + dispatch_us * (1 if covered else 0)) / 10 / 1e3
    assert sample.milliseconds == pytest.approx((expected,) * 3, rel=0.05)
    assert sample.uncovered == (0 if covered else 3)
    # without calls= the count is sized from the warm-up so that the N calls last about TARGET_MS
    sized = timing.BackToBackTimer(flush, lambda x: gpu.wait(gpu.free_at), clock=gpu.perf_counter)
    sized.warm(call)
    assert sized._count() == max(3, min(sized.MAX_CALLS, -(-sized.TARGET_MS * 1e3 // (dispatch_us + kernel_us))))
    compiling = timing.BackToBackTimer(flush, lambda x: gpu.wait(gpu.free_at), clock=gpu.perf_counter)

    def compile_then_call():  # a first call that compiles for 2 s: N falls to its minimum, a timed run resizes it
        gpu.sleep(2e6)
        return call()

    compiling.warm(compile_then_call)
    assert compiling._count() == 3
    compiling.run(call)
    assert compiling._count() == max(3, min(compiling.MAX_CALLS, -(-5000 // max(dispatch_us, kernel_us))))


def test_flops_follow_fa2_benchmark():
    assert attention_flops(2, 16, 1024, 64, False, "forward") == 4 * 2 * 16 * 1024 * 1024 * 64
    assert attention_flops(2, 16, 1024, 64, True, "backward") == 2.5 * 2 * 2 * 16 * 1024 * 1024 * 64
    assert attention_flops(2, 16, 1024, 64, False, "forward+backward") == 3.5 * 4 * 2 * 16 * 1024 * 1024 * 64
    w = Workload.fa2_setting(2048, 128, True, "bfloat16")
    assert (w.batch, w.nheads) == (8, 16)
    with pytest.raises(ValueError, match="Workload.dtype"):
        Workload(1, 1, 1, 1, False, "int8")


def test_fed_milliseconds_come_out_in_measurements_table_json_csv_and_plot_data(tmp_path):
    fa2 = FakeSystem("cuflash-fa2", fa2_ms, is_cuflash=True)
    peer = FakeSystem("torch-flash", peer_ms)
    jax_like = FakeSystem("jax-xla", peer_ms, directions=("forward", "forward+backward"))
    result = _sweep([fa2, peer, jax_like], WORKLOADS)

    assert len(result.measurements) == len(WORKLOADS) * (3 + 3 + 2)
    for m in result.measurements:
        expected = {"cuflash-fa2": fa2_ms, "torch-flash": peer_ms, "jax-xla": peer_ms}[m.system](m.workload, m.direction)
        assert m.milliseconds == pytest.approx(expected)
        assert m.tflops == pytest.approx(m.workload.flops(m.direction) / expected / 1e9)
        assert statistics.median(m.sample.milliseconds) == m.milliseconds
    assert fa2.released == peer.released == len(WORKLOADS)

    table = speed.format_table(result)
    assert "cuflash ran" not in table  # no toolchain given
    code = "sm_90 CUBINs from NVRTC 13.5, driver for CUDA 13.0"
    recorded = _sweep([fa2], WORKLOADS[:1], toolchain=code)
    assert recorded.as_dict()["toolchain"] == code
    assert speed.format_table(recorded).splitlines()[1] == f"cuflash ran {code}"
    w = WORKLOADS[0]
    forward = next(m for m in result.measurements if m.system == "cuflash-fa2" and m.workload == w
                   and m.direction == "forward")
    assert f"{forward.tflops:.1f} ({forward.milliseconds:.3f} ms, {forward.host_us:.0f} us)" in table
    assert "fa2/torch-flash" in table and "fa2/jax-xla" in table
    # the scripted runs of 4.5 ms and more count as uncovered (the device idled): their cells carry a *
    slow = next(m for m in result.measurements if m.sample.uncovered)
    assert f"{slow.tflops:.1f} ({slow.milliseconds:.3f} ms, {slow.host_us:.0f} us)*" in table
    assert "* some runs of this call left the GPU idle" in table
    for direction in DIRECTIONS:
        rows = table.split(f"\n{direction}\n")[1].split("\n\n")[0].splitlines()[1:]
        assert len(rows) == len(WORKLOADS)
        # columns: 4 workload fields, 3 system cells of "TF (ms ms, us us)" or "-", then the two ratios
        ratios = [row.split()[-2:] for row in rows]
        if direction == "backward":  # jax-xla has no backward-only timing: a dash, and no ratio
            assert all(row.split()[14] == "-" for row in rows) and all(r[1] == "-" for r in ratios)
            assert all(r[0] == "0.250" for r in ratios)
        else:  # cuflash is 4x slower than the fake peers, in every row
            assert all(r == ["0.250", "0.250"] for r in ratios)

    written = speed.write_outputs(result, tmp_path)
    data = json.loads((tmp_path / "speed.json").read_text())
    assert data["device"] == "Fake GPU" and len(data["measurements"]) == len(result.measurements)
    for record, m in zip(data["measurements"], result.measurements):
        assert record["milliseconds"] == m.milliseconds and record["system"] == m.system
        assert record["runs_ms"] == list(m.sample.milliseconds)
        assert record["host_microseconds"] == m.host_us == 100 * m.milliseconds
    assert speed.SweepResult.from_dict(data).as_dict() == data
    rows = list(csv.DictReader((tmp_path / "speed.csv").open()))
    assert [float(r["tflops"]) for r in rows] == [pytest.approx(m.tflops) for m in result.measurements]
    assert [float(r["host_microseconds"]) for r in rows] == [pytest.approx(m.host_us) for m in result.measurements]

    panels = plots.speed_panels(result, "forward")
    assert set(panels) == {(w.dtype, w.headdim, w.causal) for w in WORKLOADS}
    for (dtype, headdim, causal), series in panels.items():
        assert set(series) == {"cuflash-fa2", "torch-flash", "jax-xla"}
        for system, points in series.items():
            ms = {"cuflash-fa2": fa2_ms, "torch-flash": peer_ms, "jax-xla": peer_ms}[system]
            for seqlen, tflops in points:
                work = Workload.fa2_setting(seqlen, headdim, causal, dtype)
                assert tflops == pytest.approx(work.flops("forward") / ms(work, "forward") / 1e9)
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 3 and all(p.stat().st_size > 10_000 for p in pngs)


def test_unavailable_systems_and_failing_prepares_are_skipped_with_their_reason():
    missing = FakeSystem("jax-cudnn", peer_ms, unavailable="JAX with CUDA is not available")
    oom = FakeSystem("cupy-standard", peer_ms, fail_prepare=MemoryError("out of memory allocating 34 GB"))
    fa2 = FakeSystem("cuflash-fa2", fa2_ms, is_cuflash=True)
    result = _sweep([fa2, missing, oom], WORKLOADS[:2])
    assert {m.system for m in result.measurements} == {"cuflash-fa2"}
    reasons = {(s.system, s.reason) for s in result.skipped}
    assert ("jax-cudnn", "unavailable: JAX with CUDA is not available") in reasons
    assert ("cupy-standard", "MemoryError: out of memory allocating 34 GB") in reasons
    assert "skipped:" in speed.format_table(result)


def test_a_budget_skips_the_points_expected_to_overrun_it_and_records_why():
    from types import SimpleNamespace

    clock = SimpleNamespace(now=0.0)

    class Costly(FakeSystem):  # each point costs 1 s per 512 of seqlen (FA2's sweep: FLOPs grow with seqlen)
        def prepare(self, workload, seed=0):
            clock.now += workload.seqlen / 512
            return super().prepare(workload, seed)

    workloads = fa2_sweep(headdims=(64,), seqlens=(512, 1024, 2048, 4096, 8192, 16384), causals=(False,))
    budget = speed.Budget(20.0, clock=lambda: clock.now, first_guess_s=1.0)
    result = _sweep([Costly("cuflash-fa2", fa2_ms, is_cuflash=True)], workloads, budget=budget)
    assert sorted({m.workload.seqlen for m in result.measurements}) == [512, 1024, 2048, 4096]
    over = {s.workload: s.reason for s in result.skipped}
    assert set(over) == {w.label() for w in workloads[4:]}
    assert over[workloads[4].label()] == "over budget: expected 16 s, 5 s left"
    assert clock.now == 15.0 <= 20.0
    # a system never seen is expected to cost first_guess_s; one seen only on bigger points, its dearest point
    fresh = speed.Budget(5.0, clock=lambda: 0.0, first_guess_s=7.0)
    assert fresh.expect("jax-xla", workloads[0]) == 7.0
    fresh.observe("jax-xla", workloads[2], 3.0)
    assert fresh.expect("jax-xla", workloads[0]) == 3.0 and fresh.expect("jax-xla", workloads[3]) == 6.0


class SimulatorSystem(peers.System):
    """cuflash's fa2 on NumPy arrays (the simulator), optionally perturbed: a peer whose results we control."""

    def __init__(self, key, perturb=1.0):
        self.key = self.label = key
        self.perturb = perturb

    def unavailable(self):
        return None

    def compute(self, q, k, v, dout, causal):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        return (out.astype(np.float32) * self.perturb).astype(out.dtype), grads


@pytest.mark.parametrize("dtype, causal", [("float16", True), ("bfloat16", False)])
def test_check_against_reference_accepts_right_and_rejects_wrong_results(dtype, causal):
    good = speed.check_against_reference(SimulatorSystem("good"), dtype, 40, causal)
    assert good.passed, good.detail
    bad = speed.check_against_reference(SimulatorSystem("bad", perturb=1.05), dtype, 40, causal)
    assert not bad.passed and "wrong result" in bad.detail and "out" in bad.detail


def test_a_system_that_fails_its_check_is_never_timed():
    wrong = FakeSystem("torch-cudnn", peer_ms)
    fa2 = FakeSystem("cuflash-fa2", fa2_ms, is_cuflash=True)

    def check(system, dtype, headdim, causal):
        return speed.Check(system.key, dtype, headdim, causal, system.key != "torch-cudnn", "scripted")

    result = speed.run_sweep([fa2, wrong], WORKLOADS, warmup=0, repeats=5, check=check, progress_stream=None)
    assert "call forward" not in wrong.log and {m.system for m in result.measurements} == {"cuflash-fa2"}
    assert all("failed its check" in s.reason for s in result.skipped)
    # one check per (system, dtype, head dim, causal), not one per workload
    assert len(result.checks) == 2 * len({(w.dtype, w.headdim, w.causal) for w in WORKLOADS})


def test_progress_bar_counts_every_system_and_workload():
    stream = io.StringIO()
    speed.run_sweep([FakeSystem("cuflash-fa2", fa2_ms, is_cuflash=True)], WORKLOADS[:3], warmup=0, repeats=5,
                    check=passing_check, progress_stream=stream)
    assert "3/3" in stream.getvalue() and stream.getvalue().endswith("\n")


def test_system_selection_names_the_known_systems():
    keys = peers.system_keys()
    assert keys[:3] == ["cuflash-standard", "cuflash-fa1", "cuflash-fa2"]
    assert {"cupy-standard", "jax-xla", "jax-cudnn", "torch-flash", "torch-cudnn"} <= set(keys)
    with pytest.raises(ValueError, match="unknown systems"):
        peers.select(["cuflash-fa3"])


# ---- GPU-only parts: the CUDA-event timer, the flush, and each peer adapter against the reference.


@pytest.mark.gpu
def test_busy_start_timer_times_a_real_call_without_its_host_delay():
    import time

    cupy = pytest.importorskip("cupy")
    x = cupy.ones((4096, 4096), dtype=cupy.float32)
    timer = timing.cupy_timer()
    assert timer.stream.bytes >= 2 * 1024 * 1024
    quick = timing.measure(lambda: x @ x, timer, warmup=2, repeats=3)

    def slow():  # 2 ms on the host before the same launch: the device figure must not grow by it
        time.sleep(0.002)
        return x @ x

    delayed = timing.measure(slow, timing.cupy_timer(), warmup=2, repeats=3)
    assert all(0 < ms < 1000 for ms in quick.milliseconds) and quick.uncovered == delayed.uncovered == 0
    assert delayed.median < quick.median + 0.5 and delayed.host_median >= 2000


@pytest.mark.gpu
def test_the_toolchain_line_names_the_code_the_gpu_runs():
    line = speed.toolchain_line()
    assert (" CUBINs from NVRTC " in line or " PTX from NVRTC " in line) and ", driver for CUDA " in line


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["cuflash-fa2", "cupy-standard", "jax-xla", "jax-cudnn", "torch-flash",
                                 "torch-cudnn"])
def test_each_peer_adapter_passes_its_check_and_times(key):
    (system,) = peers.select([key])
    reason = system.unavailable()
    if reason:
        pytest.skip(reason)
    check = speed.check_against_reference(system, "float16", 64, True)
    assert check.passed, check.detail
    result = speed.run_sweep([system], [Workload(2, 512, 4, 64, True, "float16")], warmup=1, repeats=3,
                             progress_stream=None)
    assert {m.direction for m in result.measurements} == set(system.directions), result.skipped
    assert all(m.tflops > 0 and m.host_us > 0 for m in result.measurements)


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is present: the speed benchmark runs instead")
@pytest.mark.parametrize("command", [["speed"], ["seeds"], ["validate-gpu", "--out", "{out}"],
                                     ["first-gpu", "--out", "{out}"], ["splitkv", "--out", "{out}"]])
def test_gpu_commands_refuse_without_a_gpu_and_write_nothing(command, tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "validate"
    argv = [c.format(out=out) for c in command]
    result = subprocess.run([sys.executable, "-m", "cuflash.benchmarks", *argv], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "not GPU speed" in lines[0]
    assert "TFLOP" not in result.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arch, dtype, causal, expected, flex_expected", [
    ("sm_90", "float16", False, "hopper+hopper", "hopper+hopper"),  # the wgmma forward and backward
    ("sm_90", "bfloat16", True, "hopper+hopper", "hopper+hopper"),  # causal too
    ("sm_80", "float16", False, "tensor_core+tensor_core", "tensor_core+tensor_core"),
    ("sm_90", "float32", False, "simt+simt", "simt+simt"),
])
def test_cuflash_figures_name_the_variant_the_plans_pick(arch, dtype, causal, expected, flex_expected, tmp_path):
    from cuflash.kernels import targets

    workload = Workload.fa2_setting(4096, 128, causal, dtype)
    target = targets.target(arch)
    system = peers.Cuflash("fa2")
    assert system.variant(workload, "forward+backward", target=target) == expected
    assert system.variant(workload, "forward", target=target) == expected.split("+")[0]
    # Flex workloads: the flex problem's plans (on sm_90 the Hopper forward and backward with the mods).
    flex = Workload(1, 256, 2, 64, False, dtype, flex="document")
    assert system.variant(flex, "forward+backward", target=target) == flex_expected


def test_the_variant_travels_through_json_and_csv(tmp_path):
    class Named(FakeSystem):
        def variant(self, workload, direction):
            return f"v-{direction}"

    result = _sweep([Named("cuflash-fa2", fa2_ms, is_cuflash=True)], WORKLOADS[:1])
    assert {m.variant for m in result.measurements} == {f"v-{d}" for d in DIRECTIONS}
    speed.write_outputs(result, tmp_path)
    data = json.loads((tmp_path / "speed.json").read_text())
    assert [r["variant"] for r in data["measurements"]] == [m.variant for m in result.measurements]
    assert speed.SweepResult.from_dict(data).as_dict() == data
    rows = list(csv.DictReader((tmp_path / "speed.csv").open()))
    assert [r["variant"] for r in rows] == [m.variant for m in result.measurements]
