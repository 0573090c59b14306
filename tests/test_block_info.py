"""Where a (batch, head) lives is computed in one place: cuda_src/common/block_info.cuh.

Every kernel reaches its tensors and side buffers through BlockInfo (varlen and paged K/V will change only
that file); the kernels' own correctness and traffic tests check the offsets themselves. Here: no kernel
source forms a batch or head offset, or the kv head of a query head, by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOME = "cuda_src/common/block_info.cuh"
# batch * x.batch / head * x.head strides, the (batch * nheads + head) side-buffer index, the GQA head ratio.
HAND_OFFSETS = re.compile(r"_stride\.(batch|head)\b|\*\s*p\.nheads\s*\+\s*head\b|nheads\s*/\s*p\.nheads_k")


def _code(line: str) -> str:
    return line.split("//")[0]


def offenders(paths) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HAND_OFFSETS.search(_code(line)):
                found.append(f"{path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path}:{number}: "
                             f"{line.strip()}")
    return found


def test_kernels_reach_batch_and_head_only_through_block_info():
    sources = [p for p in sorted((REPO / "cuda_src" / "kernels").iterdir()) if p.suffix in (".cu", ".cuh")]
    assert sources
    found = offenders(sources)
    assert not found, f"per-(batch, head) offsets formed outside {HOME}:\n" + "\n".join(found)


def test_the_check_sees_a_hand_made_offset(tmp_path):
    planted = tmp_path / "planted.cu"
    planted.write_text("// p.q_stride.batch in a comment is fine\n"
                       "const T* q = base + batch * p.q_stride.batch;\n"
                       "const int kv = head / (p.nheads / p.nheads_k);\n")
    assert [line.split(":")[1] for line in offenders([planted])] == ["2", "3"]
