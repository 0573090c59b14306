"""Where cuflash finds its CUDA sources and keeps its build caches."""

from __future__ import annotations

import os
from pathlib import Path



def _find_cuda_src() -> Path:
    """$CUFLASH_CUDA_SRC if set; else the copy a wheel installs inside the package (cuflash/cuda_src, see
    setup.py); else the repository's cuda_src/ beside the package (an editable install or a checkout)."""
    if "CUFLASH_CUDA_SRC" in os.environ:
        return Path(os.environ["CUFLASH_CUDA_SRC"])
    package = Path(__file__).resolve().parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if (candidate / "arch" / "arch.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"cuflash's CUDA sources are missing: neither {package / 'cuda_src'} (installed package) nor "
        f"{package.parent / 'cuda_src'} (repository checkout) holds arch/arch.cuh; reinstall cuflash "
        "or set CUFLASH_CUDA_SRC to a cuda_src folder"
    )


CUDA_SRC = _find_cuda_src()


def cache_dir(kind: str) -> Path:
    """Per-kind cache folder: $CUFLASH_CACHE_DIR/<kind>, default ~/.cache/cuflash/<kind>."""
    root = Path(os.environ.get("CUFLASH_CACHE_DIR", Path.home() / ".cache" / "cuflash"))
    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
