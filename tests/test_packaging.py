"""A non-editable install works from anywhere: the wheel carries the CUDA sources (setup.py) and the demo runs
from a directory outside the source tree, importing cuflash from the environment it was installed into."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{cmd} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_wheel_carries_every_cuda_source_and_runs_the_demo_outside_the_tree(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)])
    (wheel,) = wheels.glob("cuflash-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("cuflash/cuda_src/")}
    sources = {f"cuflash/cuda_src/{p.relative_to(REPO / 'cuda_src').as_posix()}"
               for p in (REPO / "cuda_src").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert sources and shipped == sources

    # A fresh environment (its dependencies, numpy and cffi, come from the interpreter running the tests).
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUFLASH_CUDA_SRC")}
    where = _run([str(python), "-c", "import cuflash, cuflash._paths as p; print(cuflash.__file__); print(p.CUDA_SRC)"],
                 cwd=outside, env=env).stdout.split()
    site = venv.resolve()
    assert Path(where[0]).resolve().is_relative_to(site), f"cuflash imported from {where[0]}, not the wheel"
    assert Path(where[1]).resolve().is_relative_to(site), f"CUDA sources read from {where[1]}, not the wheel"

    demo = _run([str(python), "-m", "cuflash.demo"], cwd=outside, env=env)
    for algorithm in ("standard", "fa1", "fa2"):
        assert f"{algorithm}: ok" in demo.stdout, demo.stdout
