"""The Python mirror of AttentionParams (cuflash/kernels/params.py) has the C++ layout.

Two compilers lay the struct out: g++ for the simulator (probed from the built
library) and NVRTC for the GPU (checked by compiling static_asserts generated
from the mirror). Both must agree with the bytes Python packs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuflash import sim
from cuflash.kernels import params
from cuflash.kernels.program import KernelInstance
from cuflash.kernels.program import Problem
from cuflash.mask import Mask


def test_mirror_matches_gxx_layout():
    cxx = sim.params_layout()
    py = params.field_layout()
    assert cxx.pop("sizeof") == (0, params.PARAMS_DTYPE.itemsize)
    assert cxx == py


def test_mirror_matches_nvrtc_layout(tmp_path):
    nvrtc = pytest.importorskip("cuflash.kernels.nvrtc")
    checks = "\n".join(
        f"static_assert(__builtin_offsetof(cuflash::AttentionParams, {path}) == {offset}, \"{path} offset\");"
        for path, (offset, _) in params.field_layout().items()
    )
    source = tmp_path / "params_layout_probe.cu"
    source.write_text(
        '#include "common/attention_params.cuh"\n'
        f"static_assert(sizeof(cuflash::AttentionParams) == {params.PARAMS_DTYPE.itemsize}, \"sizeof\");\n"
        f"{checks}\n"
        "namespace probe { template <int N> __global__ void layout_probe(const cuflash::AttentionParams p) {} }\n"
    )
    compiled = nvrtc.compile_instance(KernelInstance(str(source), "probe::layout_probe<0>"), "sm_80")
    assert compiled.code


def test_pack_params_round_trip():
    problem = Problem("float16", batch=2, seqlen_q=3, seqlen_k=5, nheads=4, nheads_k=2, headdim=7, mask=Mask.causal())
    packed = params.pack_params(
        problem, softmax_scale=0.5, pointers={"q": 0x1000, "lse": 0x2000}, strides={"q": (84, 28, 7)}, num_dq_splits=3,
    )
    assert packed["q"] == 0x1000 and packed["lse"] == 0x2000 and packed["k"] == 0
    assert tuple(packed["q_stride"]) == (84, 28, 7)
    assert (packed["batch"], packed["seqlen_q"], packed["seqlen_k"]) == (2, 3, 5)
    assert (packed["nheads"], packed["nheads_k"], packed["headdim"]) == (4, 2, 7)
    assert (packed["window_left"], packed["window_right"]) == (-1, 0) and packed["num_dq_splits"] == 3
    assert (packed["dropout_threshold"], packed["dropout_rescale"]) == (0, 1.0)
    dropping = params.pack_params(dataclasses.replace(problem, dropout_p=0.25), softmax_scale=0.5, pointers={},
                                  strides={})
    assert dropping["dropout_threshold"] == 2**30 and dropping["dropout_rescale"] == np.float32(1 / 0.75)
    assert packed["softmax_scale_log2"] == pytest.approx(0.5 * 1.4426950408889634)
    with pytest.raises(KeyError, match="no pointer field"):
        params.pack_params(problem, softmax_scale=1.0, pointers={"bogus": 1}, strides={})


def test_the_mirror_is_derived_from_the_header_not_copied():
    text = params.HEADER.read_text()
    assert "X(cache_leftpad)\n" in text and "int num_kv_splits;" in text  # the last side buffer and scalar
    grown = text.replace("X(cache_leftpad)\n", "X(cache_leftpad) \\\n  X(extra_buffer)\n").replace(
        "int num_kv_splits;", "int num_kv_splits;\n  float new_scalar;").replace(
        "X(dv, Key, V, Out)", "X(dv, Key, V, Out) \\\n  X(dbias, Query, QK, Out)")
    fields, tensors, side_buffers = params.header_fields(grown)
    assert side_buffers[-1] == "extra_buffer"
    assert fields[fields.index(("num_kv_splits", "int")) + 1] == ("new_scalar", "float")
    # The mods' side arrays (attention_params.cuh's flex structs) come from the header's structs too.
    tail = fields.index(("flex_tiles.q.columns", "flex::TileLists"))
    assert fields[tail + 1] == ("flex_shard.origin", "flex::Shard")
    # Then the TMA block, last: the flag and the tensor maps (64-byte aligned, 16 words each).
    assert fields[tail + 2] == ("tma_loads", "int") and fields[tail + 3] == ("tma.q[0]", "TmaMaps")
    assert fields[-1] == ("tma.dout[15]", "TmaMaps") and len(fields) == tail + 3 + 64
    grown_sides = text.replace("int shape[kMaxSideDims];", "int shape[kMaxSideDims];\n  int extra;")
    assert ("flex_sides.arrays[0].extra", "flex::Sides") in params.header_fields(grown_sides)[0]
    assert tensors[-1] == params.TensorField("dbias", "Query", "QK", "Out")
    assert ("dbias", "void*") in fields and ("dbias_stride.head", "long long") in fields
    with pytest.raises(ValueError, match="cannot read the AttentionParams member 'double oops;'"):
        params.header_fields(text.replace("int num_dq_splits;", "int num_dq_splits;\n  double oops;"))
