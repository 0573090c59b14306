"""python -m cuflash.kernels flex: cold NVRTC seconds per flex kernel instance, in a cache of its own."""

from __future__ import annotations

import json
import os

from cuflash.flex import _compile_report
from cuflash.kernels.__main__ import main as kernels_main


def test_flex_command_reports_cold_nvrtc_seconds_per_instance(tmp_path, monkeypatch, capsys):
    """One example (softcap, float32 SIMT forward, sm_80): one hooked instance, compiled by NVRTC in a temporary
    cache (the caller's cache gains nothing and its setting is restored), its seconds, registers and spills printed,
    as a table and as JSON."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    args = ["flex", "--arch", "sm_80", "--mods", "softcap", "--dtypes", "float32", "--directions", "forward"]
    assert kernels_main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    (row,) = json.loads(captured.out)
    assert (row["mod"], row["dtype"], row["direction"], row["kernel"], row["arch"]) == \
        ("softcap", "float32", "forward", "fa2_forward_kernel", "sm_80")
    assert row["seconds"] > 0.1 and row["registers"] > 0 and row["error"] is None
    assert "1 flex instances compiled cold, 0 failed" in captured.err
    assert os.environ["CUFLASH_CACHE_DIR"] == str(tmp_path)
    assert not (tmp_path / "nvrtc").exists() or not any((tmp_path / "nvrtc").iterdir())
    table = _compile_report.format_rows([_compile_report.Row(**row)])
    assert "fa2_forward_kernel" in table and "NVRTC s" in table and f"{row['seconds']:.2f}" in table


def test_flex_instances_are_the_main_kernels_with_the_hook():
    """The backward's hooked instances are its main kernel only (the pre-pass and dq conversion are the catalog's)."""
    (instance,) = _compile_report.flex_instances("document", "float16", "backward", "sm_80", 64)
    assert "fa2_tc_backward_kernel<" in instance.name_expr
    assert "FlexHook<cuflash::flex::NoScoreMod, cuflash::flex::mods::FlexMod_" in instance.name_expr
    assert instance.name_expr.endswith("true>>")
