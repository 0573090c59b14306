"""Where cuflash finds its CUDA sources and keeps its build caches."""

from __future__ import annotations

import os
from pathlib import Path

# cuda_src/ sits beside the package in the repository (installs are editable:
# `pip install -e .`); CUFLASH_CUDA_SRC points elsewhere when needed.
CUDA_SRC = Path(os.environ.get("CUFLASH_CUDA_SRC", Path(__file__).resolve().parent.parent / "cuda_src"))


def cache_dir(kind: str) -> Path:
    """Per-kind cache folder: $CUFLASH_CACHE_DIR/<kind>, default ~/.cache/cuflash/<kind>."""
    root = Path(os.environ.get("CUFLASH_CACHE_DIR", Path.home() / ".cache" / "cuflash"))
    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
