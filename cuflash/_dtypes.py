"""Element dtypes by name, the one place a name becomes a NumPy dtype.

bfloat16 is not a NumPy type: NumPy, and CuPy (which makes and imports bfloat16 arrays through NumPy's dtype),
take it from the ``ml_dtypes`` package. The cuda12/cuda13 extras install it; without it, the error names it.
"""

from __future__ import annotations

import importlib.util

import numpy as np

BF16_PACKAGE_HINT = ("bfloat16 arrays need the ml_dtypes package (and NumPy >= 2.1.2 for CuPy to use it): "
                     "pip install 'ml_dtypes>=0.5', or install cuflash with its cuda12 or cuda13 extra")


def bfloat16_available() -> bool:
    return importlib.util.find_spec("ml_dtypes") is not None


def element_dtype(name: str) -> np.dtype:
    """The NumPy dtype of an element type name (float16, bfloat16, float32, ...); ImportError naming ml_dtypes when
    bfloat16 cannot be made."""
    if name == "bfloat16":
        if not bfloat16_available():
            raise ImportError(BF16_PACKAGE_HINT)
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
