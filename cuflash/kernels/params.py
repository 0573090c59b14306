"""Python mirror of ``cuflash::AttentionParams`` (cuda_src/common/attention_params.cuh).

Every backend (simulator, CuPy, JAX FFI) hands kernels the same bytes, packed
here. ``tests/test_params_layout.py`` compares this layout, field by field,
with the one g++ computes for the C++ struct.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

# Pointer fields, in declaration order. Element tensors first, then float32 side buffers.
TENSOR_FIELDS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")
SIDE_BUFFER_FIELDS = (
    "lse",
    "scores",
    "probs",
    "row_max",
    "row_sum",
    "out_accum",
    "dout_dot_out",
    "dq_accum",
    "dk_accum",
    "dv_accum",
)
POINTER_FIELDS = TENSOR_FIELDS + SIDE_BUFFER_FIELDS
STRIDED_TENSORS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")

_STRIDES_DTYPE = np.dtype([("batch", np.int64), ("row", np.int64), ("head", np.int64)], align=True)

PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in POINTER_FIELDS]
    + [(f"{name}_stride", _STRIDES_DTYPE) for name in STRIDED_TENSORS]
    + [
        ("batch", np.int32),
        ("seqlen_q", np.int32),
        ("seqlen_k", np.int32),
        ("nheads", np.int32),
        ("nheads_k", np.int32),
        ("headdim", np.int32),
        ("softmax_scale", np.float32),
        ("softmax_scale_log2", np.float32),
        ("window_left", np.int32),
        ("window_right", np.int32),
        ("num_dq_splits", np.int32),
    ],
    align=True,
)


def field_layout() -> dict[str, tuple[int, int]]:
    """(offset, size) of every leaf field, by C path ("q_stride.batch", "seqlen_q", ...)."""
    layout: dict[str, tuple[int, int]] = {}
    for name in PARAMS_DTYPE.names:
        sub, offset = PARAMS_DTYPE.fields[name][:2]
        if sub.names:
            for inner in sub.names:
                inner_dtype, inner_offset = sub.fields[inner][:2]
                layout[f"{name}.{inner}"] = (offset + inner_offset, inner_dtype.itemsize)
        else:
            layout[name] = (offset, sub.itemsize)
    return layout


def pack_params(
    problem,
    *,
    softmax_scale: float,
    pointers: Mapping[str, int],
    strides: Mapping[str, tuple[int, int, int]],
    num_dq_splits: int = 1,
) -> np.void:
    """Pack one AttentionParams value.

    problem: a plans.Problem (sizes and the mask).
    pointers: device (or host, for the simulator) addresses by field name; absent fields are null.
    strides: (batch, row, head) element strides by tensor name; absent tensors get zeros.
    """
    params = np.zeros((), dtype=PARAMS_DTYPE)
    for name, address in pointers.items():
        if name not in POINTER_FIELDS:
            raise KeyError(f"AttentionParams has no pointer field {name!r}")
        params[name] = address
    for name, (b, r, h) in strides.items():
        params[f"{name}_stride"] = (b, r, h)
    for name in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim"):
        params[name] = getattr(problem, name)
    params["softmax_scale"] = softmax_scale
    params["softmax_scale_log2"] = softmax_scale * math.log2(math.e)
    params["window_left"] = problem.mask.window_left
    params["window_right"] = problem.mask.window_right
    params["num_dq_splits"] = num_dq_splits
    return params[()]
