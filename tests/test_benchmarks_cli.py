"""The benchmarks CLI's commands without a GPU: the traffic table, the traffic sweep, the profile, and the ``host``
command's wiring to host.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cuflash.benchmarks import __main__ as cli
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


def test_traffic_sweep_writes_one_record_per_launch_equal_to_the_formula(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cuflash.benchmarks", "traffic", "--out", str(tmp_path), "--seqlens", "48", "97",
         "--headdims", "40"], capture_output=True, text=True, check=True)
    assert "traffic.json" in result.stdout
    data = json.loads((tmp_path / "traffic.json").read_text())
    records = data["records"]
    keys = {(r["algorithm"], r["seqlen"], r["headdim"], r["causal"], r["direction"], r["kernel"]) for r in records}
    assert {r["algorithm"] for r in records} == {"standard", "fa1", "fa2"}
    assert {(r["seqlen"], r["causal"]) for r in records} == {(48, False), (48, True), (97, False), (97, True)}
    # fa2's backward is three launches (pre-pass, main, convert), each its own record
    assert len({k for k in keys if k[0] == "fa2" and k[4] == "backward" and k[1] == 97 and not k[3]}) == 3
    for r in records:
        assert r["bytes_read"] > 0 or r["bytes_written"] > 0
        assert (r["bytes_read"], r["bytes_written"]) == (r["formula_read"], r["formula_written"]), r
    assert (tmp_path / "traffic.png").stat().st_size > 10_000


def test_profile_writes_sites_and_the_compile_report_of_the_launched_kernels(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "cuflash.benchmarks", "profile", "--out", str(tmp_path), "--arch", "sm_80",
         "--seqlen", "40", "--headdims", "24"], capture_output=True, text=True, check=True)
    data = json.loads((tmp_path / "profile.json").read_text())
    launched = {r["kernel"] for r in data["launches"]}
    assert {r["kernel"] for r in data["compile_report"]} == launched
    assert all(r["arch"] == "sm_80" and r["blocks_per_sm"] >= 1 for r in data["compile_report"])
    for r in data["launches"]:
        assert r["shared_wavefronts"] == sum(s["wavefronts"] for s in r["sites"])
        assert all(s["wavefronts"] >= s["ideal"] >= 1 for s in r["sites"])
    fa2_forward = next(r for r in data["launches"] if r["algorithm"] == "fa2" and r["direction"] == "forward")
    assert fa2_forward["shared_wavefronts"] > 0 and any(s["kind"] == "store" for s in fa2_forward["sites"])
    assert (tmp_path / "profile.png").stat().st_size > 10_000


def test_host_command_hands_its_arguments_to_host_py(monkeypatch, tmp_path):
    from types import ModuleType

    seen = {}
    fake = ModuleType("cuflash.benchmarks.host")
    fake.add_arguments = lambda parser: parser.add_argument("--out", required=True)
    fake.main = lambda args: seen.setdefault("out", args.out) and 7
    monkeypatch.setitem(sys.modules, "cuflash.benchmarks.host", fake)
    import cuflash.benchmarks

    monkeypatch.setattr(cuflash.benchmarks, "host", fake, raising=False)
    assert cli.main(["host", "--out", str(tmp_path)]) == 7 and seen["out"] == str(tmp_path)


def test_host_command_without_host_py_refuses_in_one_line(monkeypatch, capsys):
    import cuflash.benchmarks

    monkeypatch.delattr(cuflash.benchmarks, "host", raising=False)
    monkeypatch.setitem(sys.modules, "cuflash.benchmarks.host", None)  # import raises ModuleNotFoundError
    assert cli.main(["host", "--out", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host.py is missing" in err[0]
    # the other commands do not import it
    with pytest.raises(SystemExit):
        cli.main(["first-gpu", "--help"])


def test_splitkv_command_hands_its_options_to_splitkv_py(monkeypatch, tmp_path):
    from cuflash.benchmarks import splitkv

    seen = {}
    monkeypatch.setattr(splitkv, "main", lambda out, **options: seen.update(out=out, **options) or 3)
    assert cli.main(["splitkv", "--out", str(tmp_path), "--dtypes", "float16", "--splits", "0", "8",
                     "--budget-s", "35"]) == 3
    assert seen == {"out": tmp_path, "dtypes": ("float16",), "counts": (0, 8), "warmup": 3, "repeats": 10,
                    "budget_s": 35.0}
    cli.main(["splitkv"])
    assert seen["counts"] == splitkv.SPLIT_COUNTS and seen["dtypes"] == ("bfloat16", "float16")
