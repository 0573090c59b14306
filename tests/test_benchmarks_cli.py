"""The benchmarks CLI: the memory-traffic table anyone can rerun."""

from __future__ import annotations

import subprocess
import sys

from cuflash.benchmarks import traffic


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
