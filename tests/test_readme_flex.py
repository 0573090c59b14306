"""The README's FlexAttention tour runs as written: its python blocks, executed in order in one namespace, and
their results checked here (the tour's gradients the same between the NumPy and JAX APIs up to float32 atomics' order, the block mask
sparse)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

README = Path(__file__).resolve().parent.parent / "README.md"


def _tour_blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## FlexAttention: attention variants you write"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_flexattention_tour_runs():
    blocks = _tour_blocks()
    assert len(blocks) == 2
    namespace: dict = {}
    exec(compile(blocks[0], "README.md (flex, NumPy)", "exec"), namespace)
    numpy_grads = [namespace[name] for name in ("dq", "dk", "dv", "dtable")]
    assert namespace["block_mask"].sparsity() > 50
    exec(compile(blocks[1], "README.md (flex, JAX)", "exec"), namespace)
    # the same kernels; the table's gradient is summed with float32 atomics, in no fixed order
    for name, want in zip(("dq", "dk", "dv", "dtable"), numpy_grads):
        np.testing.assert_allclose(np.asarray(namespace[name]), want, rtol=1e-5, atol=1e-5, err_msg=name)
