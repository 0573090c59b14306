"""The benchmarks CLI: the memory-traffic table anyone can rerun."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cuflash.benchmarks import traffic
from cuflash.testing import gpu_count


def test_traffic_table_command():
    result = subprocess.run(
        [sys.executable, "-m", "cuflash.benchmarks", "traffic"], capture_output=True, text=True, check=True
    )
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()[:1] in
            (["standard"], ["fa1"], ["fa2"])}
    assert set(rows) == {"standard", "fa1", "fa2"}
    totals = {name: float(row[5]) for name, row in rows.items()}
    # The IO-aware algorithms move several times fewer bytes than the materializing one.
    assert totals["fa1"] * 3 < totals["standard"] and totals["fa2"] * 3 < totals["standard"]
    assert rows["standard"][6] == "40.3" and rows["fa1"][6] == "4.4"


def test_measure_scales_per_head_and_counts_every_launch():
    small = traffic.measure("fa2", seqlen=96, headdim=40)
    assert small.forward_read > 0 and small.forward_written > 0 and small.backward_written > 0
    # O and lse are written once by the fa2 forward: the written bytes are exactly that.
    assert small.forward_written == 96 * 40 * 2 + 96 * 4


def test_speed_refuses_without_a_gpu():
    if gpu_count():
        pytest.skip("a GPU is present: the speed benchmark runs instead")
    result = subprocess.run([sys.executable, "-m", "cuflash.benchmarks", "speed"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "not GPU speed" in result.stderr
    assert "TFLOPs" not in result.stdout


@pytest.mark.gpu
def test_speed_on_a_gpu():
    from cuflash.benchmarks import speed

    for timing in speed.measure("fa2", headdim=64, seqlen=512, causal=True, repeats=2):
        assert timing.milliseconds > 0 and timing.tflops > 0


def test_flop_count_follows_fa2_benchmark():
    from cuflash.benchmarks import speed

    assert speed.attention_flops(2, 16, 1024, 64, False, "forward") == 4 * 2 * 16 * 1024 * 1024 * 64
    assert speed.attention_flops(2, 16, 1024, 64, True, "backward") == 2.5 * 2 * 2 * 16 * 1024 * 1024 * 64
