"""The warp-specialized Hopper backward (cuda_src/kernels/fa3_backward.cu, cuflash/kernels/families/fa3_backward.py)
on the simulator targeting sm_90, and compiled by NVRTC for sm_90a.

* dq, dk, dv against the float64 reference with FlashAttention's rule (test_fa2._check_backward): float16 and
  bfloat16, head dims 64, 128 and 256 (its consumers sharing the head dim), causal and not, seqlen pairs with ragged Q
  and K/V blocks (1/1, 77/200, 128/128, 300/129), MHA, GQA and MQA in rotation; out and lse from the Hopper forward.
* Varlen through cuflash.attention_varlen_backward (the reference; a NaN sequence never reaches its neighbours).
* Sliding windows through cuflash.attention_backward: the reference, dq 0 on rows without a key, the traffic formula
  (only the band's Q blocks; K/V blocks no query sees are not read).
* Race mode clean on one case per head dim (mbarrier and named-barrier edges, wgmma in flight, async-proxy reads of
  the producer's and the consumers' stores).
* Compiled for sm_90a: HGMMA of the planned shapes, setmaxnreg, no spills, no wgmma serialized by ptxas.
* The producer's copies: TMA wherever the host could make the tensor maps (every call says which path it took: head
  dims whose rows are not whole 16 bytes take the load path), the same bits as the load path (forced, or by an
  address TMA cannot take); the profile counts the TMA loads; planted bugs: a wrong expect_tx byte count deadlocks
  naming the barrier, an arrival not ordered after the row statistics' stores races (race mode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash._paths import CUDA_SRC
from cuflash.backends.program import run_program
from cuflash.reference import attention_reference
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels import nvrtc, report
from cuflash.kernels.families import fa3, fa3_backward
from cuflash.kernels.program import KernelInstance
from cuflash.kernels.program import Problem
from cuflash.kernels.targets import target
from cuflash.mask import Mask
from cuflash.testing import rows_without_key
from test_fa2 import _check_backward, _inputs, _launch_traffic, _problem

SM90 = target("sm_90")
SEQLENS = ((1, 1), (77, 200), (128, 128), (300, 129))
HEADS = ((2, 2), (4, 2), (3, 1))  # MHA, GQA, MQA (nheads, nheads_k)


def _forward(q, k, v, causal):
    backend = SimulatorBackend()
    problem = _problem(q, k, causal)
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
    with sim.targeting("sm_90"):
        run_program(backend, fa3.forward_program(problem, SM90), problem, 1.0 / math.sqrt(problem.headdim),
                    {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    return out, lse


class _CopyPath(SimulatorBackend):
    """The simulator backend, noting the main kernel's AttentionParams.tma_loads (1: its producer copies with TMA);
    loads_only: every launch told to copy with loads (tma_loads 0), as a caller without maps."""

    def __init__(self, loads_only=False):
        super().__init__()
        self.loads_only = loads_only
        self.tma_loads = []

    def launch(self, plan, params, buffers):
        if "fa3_backward_kernel" in plan.kernel.name_expr:
            if self.loads_only:
                params["tma_loads"] = 0  # this call's params (a view of its own packed bytes)
            self.tma_loads.append(int(params["tma_loads"]))
        super().launch(plan, params, buffers)


def _backward(q, k, v, dout, out, lse, causal, deterministic=False, on=SM90, tma=True, loads_only=False,
              kernel=None, records_out=None):
    """fa3's backward on the simulator; tma: whether the main kernel must run on the TMA path (else on the load
    path); loads_only: the load path forced (tma_loads 0 where the maps were made); kernel: another build of the main
    kernel (a planted bug); records_out: a list that gets the launches' records."""
    backend = _CopyPath(loads_only)
    problem = _problem(q, k, causal, deterministic)
    grads = {name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **grads}
    program = fa3_backward.backward_program(problem, on)
    if kernel is not None:
        program = dataclasses.replace(program, launches=tuple(
            dataclasses.replace(plan, kernel=KernelInstance(kernel, plan.kernel.name_expr))
            if "fa3_backward_kernel" in plan.kernel.name_expr else plan for plan in program.launches))
    with sim.targeting("sm_90"), sim.record() as records:
        run_program(backend, program, problem, 1.0 / math.sqrt(problem.headdim), arrays)
    assert [r.kernel.split("<")[0] for r in records.launches] == [
        "cuflash::fa2_dout_dot_out_kernel", "cuflash::fa3_backward_kernel", "cuflash::fa2_convert_dq_kernel"]
    assert backend.tma_loads == [int(tma and not loads_only)]
    if records_out is not None:
        records_out.append(records)
    return grads["dq"], grads["dk"], grads["dv"]


def _cases():
    cases = []
    for n, d in enumerate((64, 128, 256)):
        for dtype in fa3.DTYPES:
            for causal in (False, True):
                for i, (seqlen_q, seqlen_k) in enumerate(SEQLENS):
                    nheads, nheads_k = HEADS[(i + causal + n) % len(HEADS)]
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


def _check_against(ref, grads, atol=1e-5):
    """dq, dk, dv against tol.backward_references' ``ref`` by FlashAttention's rule."""
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, got, getattr(ref, name), getattr(ref, f"{name}_lowp"), tol.BACKWARD_FACTOR, atol)


# Sliding windows through cuflash.attention_backward on the simulator targeting sm_90 (the forward's too): the main
# kernel visits only the Q blocks the band reaches (mask.cuh's q_blocks: the traffic formula's), tiles crossing an
# edge take the element-wise mask; rows and whole Q blocks that see no key (dq 0 there), one side only, with causal,
# seqlen_q != seqlen_k both ways, GQA/MQA, head dims between compiled ones, deterministic in rotation; race mode on one.
# d256 (the consumers sharing the head dim): a causal window whose band leaves Q blocks half past the sequence.
WINDOW_CASES = {
    "d256-causal-window": ((1, 150, 200, 4, 2, 256), "bfloat16", (40, 3), True, True),
    "rows-without-key": ((2, 300, 129, 4, 2, 64), "float16", (3, 2), False, False),
    "causal": ((1, 77, 200, 3, 1, 128), "bfloat16", (21, -1), True, True),
    "left-only": ((1, 70, 700, 2, 2, 100), "float16", (0, -1), False, False),
    "right-only": ((2, 200, 300, 4, 2, 128), "bfloat16", (-1, 9), False, True),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_windows_match_reference(case):
    shape, dtype, window, causal, deterministic = WINDOW_CASES[case]
    q, k, v, dout = _inputs(shape, dtype, seed=len(case))
    race = sim.checking("race") if case == "rows-without-key" else contextlib.nullcontext()
    with sim.targeting("sm_90"), sim.record() as records, race:
        out, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, return_lse=True)
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=window,
                                                deterministic=deterministic)
    assert [r.kernel.split("<")[0] for r in records.launches] == [
        "cuflash::fa3_forward_kernel", "cuflash::fa2_dout_dot_out_kernel", "cuflash::fa3_backward_kernel",
        "cuflash::fa2_convert_dq_kernel"]
    _check_against(tol.backward_references(dout, q, k, v, causal=causal, window_size=window), (dq, dk, dv))
    empty = rows_without_key(q.shape[1], k.shape[1], causal, window)
    assert np.all(dq.astype(np.float32)[:, empty] == 0)
    if case == "rows-without-key":
        assert empty.sum() > 64  # a whole Q block sees no key
    problem = Problem(dtype=dtype, batch=shape[0], seqlen_q=shape[1], seqlen_k=shape[2], nheads=shape[3],
                      nheads_k=shape[4], headdim=shape[5], mask=Mask.of(causal, window), deterministic=deterministic)
    main = fa3_backward.backward_traffic(problem, SM90)[1]
    assert _launch_traffic(records)[2] == tuple(main)


# Softcap and ALiBi: the hooked instances, P from mask.cuh's ScoreHook scores and dS times its derivative (recovered
# from P); with a causal window, per-batch and per-head slopes, ragged and GQA, head dims 64, 40 (on 64), 128 and 100
# (on 128), 256 and 200 (on 256), deterministic in rotation, race mode on each instance. Softcap with ALiBi
# at once: the same hooked instances (the d128 one sharing the keys, whose step spilled with both until dS^T went to
# shared memory by stmatrix); a plain instance traps on either.
HOOK_CASES = {
    "softcap": ((1, 77, 200, 4, 2, 64), "float16", dict(softcap=2.5)),
    "alibi-per-batch": ((2, 128, 300, 3, 1, 64), "bfloat16", dict(alibi=(2, 3), deterministic=True)),
    "softcap-alibi-window-causal": ((1, 300, 129, 4, 2, 40), "bfloat16",
                                    dict(window_size=(30, 5), causal=True, softcap=4.0, alibi=(4,))),
    "softcap-d128-causal": ((1, 200, 130, 4, 2, 128), "float16", dict(softcap=6.0, causal=True, deterministic=True)),
    "alibi-d100-window": ((2, 130, 77, 3, 1, 100), "bfloat16", dict(alibi=(3,), window_size=(50, 10))),
    "softcap-alibi-d256-causal": ((1, 130, 77, 2, 1, 256), "float16", dict(softcap=3.0, alibi=(2,), causal=True)),
    "alibi-d200-window": ((2, 70, 150, 2, 2, 200), "bfloat16", dict(alibi=(2, 2), window_size=(40, 10),
                                                                    deterministic=True)),
    "softcap-alibi-d128": ((2, 77, 130, 2, 2, 128), "bfloat16", dict(softcap=4.0, alibi=(2, 2), deterministic=True)),
    "softcap-alibi-d100-causal": ((1, 200, 130, 4, 2, 100), "float16", dict(softcap=3.0, alibi=(4,), causal=True)),
}


def _hooked_inputs(case, cases=HOOK_CASES):
    """q, k, v, dout, the attention options and the deterministic flag of a case of ``cases``."""
    shape, dtype, _ = cases[case]
    return (*_inputs(shape, dtype, seed=len(case)), *_hooked_options(case, cases))


def _hooked_options(case, cases=HOOK_CASES):
    options = dict(cases[case][2])
    deterministic = options.pop("deterministic", False)
    slopes_shape = options.pop("alibi", None)
    if slopes_shape is not None:
        options["alibi_slopes"] = np.random.default_rng(len(case)).uniform(0.02, 0.6, slopes_shape).astype(np.float32)
    return options, deterministic


@pytest.mark.parametrize("case", list(HOOK_CASES))
def test_softcap_and_alibi_match_reference(case):
    shape, dtype, _ = HOOK_CASES[case]
    q, k, v, dout, options, deterministic = _hooked_inputs(case)
    # race mode on every hooked instance (d64, d128 and d256; softcap with ALiBi at d64 and d128)
    raced = ("softcap", "softcap-d128-causal", "softcap-alibi-d256-causal", "softcap-alibi-d100-causal")
    race = sim.checking("race") if case in raced else contextlib.nullcontext()
    with sim.targeting("sm_90"), sim.record() as records, race:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    main = records.launches[2].kernel
    traits = fa3_backward.backward_traits(shape[-1], SM90, hooked=True)
    assert main == traits.instance(dtype).name_expr, main
    _check_against(tol.backward_references(dout, q, k, v, **options), (dq, dk, dv))


def test_softcap_and_alibi_alone_or_together_run_the_hooked_instance_of_the_head_dim():
    """Softcap, ALiBi or both: the hooked instance of the head dim's tile (at d65..128 the keys-sharing 64 x 128 one,
    which takes both since its step stopped spilling with them)."""
    problem = Problem(dtype="float16", batch=1, seqlen_q=64, seqlen_k=64, nheads=2, nheads_k=2, headdim=100,
                      softcap=3.0, alibi="heads")
    for one, name in ((problem, "128, 64, 128, 2, true>"),
                      (dataclasses.replace(problem, alibi=None), "128, 64, 128, 2, true>"),
                      (dataclasses.replace(problem, softcap=0.0), "128, 64, 128, 2, true>"),
                      (dataclasses.replace(problem, headdim=64, headdim_v=64), "64, 64, 128, 2, true>"),
                      (dataclasses.replace(problem, headdim=129, headdim_v=129), "256, 64, 64, 2, true, true>")):
        launched = fa3_backward.backward_program(one, SM90).launches[1].kernel.name_expr
        assert launched == f"cuflash::fa3_backward_kernel<__half, {name}", (one, launched)


def test_plain_instance_traps_on_softcap():
    """An instance without the hook would drop softcap (or ALiBi) silently: launched with one it traps."""
    q, k, v, dout = _inputs((1, 70, 90, 2, 2, 64), "float16", seed=37)
    out, lse = _forward(q, k, v, False)
    capped = dataclasses.replace(_problem(q, k, False), softcap=3.0)
    plain = fa3_backward.backward_program(_problem(q, k, False), SM90)
    backend = SimulatorBackend()
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse,
              **{name: backend.empty(x.shape, x.dtype) for name, x in (("dq", q), ("dk", k), ("dv", v))}}
    with sim.targeting("sm_90"), pytest.raises(sim.KernelError, match="fa3_backward_kernel"):
        run_program(backend, plain, capped, 0.125, arrays)


# Every hooked instance under ASan: d64, d128 (ALiBi alone and with softcap: the step's two forms) and the d256 one at
# d200 with whole Q blocks (192 rows: the dQ adds unguarded by row, consumer 1's columns past d).
ASAN_HOOK_CASES = {"softcap": HOOK_CASES["softcap"], "alibi-d100-window": HOOK_CASES["alibi-d100-window"],
                   "softcap-alibi-d128": HOOK_CASES["softcap-alibi-d128"],
                   "softcap-alibi-d200-causal": ((1, 192, 150, 2, 1, 200), "float16",
                                                 dict(softcap=3.0, alibi=(2,), causal=True))}




def _hooked_instances_under_asan():
    results = []
    for case in ASAN_HOOK_CASES:
        q, k, v, dout, options, deterministic = _hooked_inputs(case, ASAN_HOOK_CASES)
        # out and lse from the float64 reference (out rounded to q's type): no forward built under ASan here.
        out, lse = attention_reference(q, k, v, **options)
        out, lse = out.astype(q.dtype), lse.astype(np.float32)
        with sim.targeting("sm_90"), sim.record() as records:
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
        results.append((case, records.launches[1].kernel, grads))
    return results


def test_hooked_instances_clean_under_asan():
    """Each hooked step's form reads its slopes and writes dq_accum, dK and dV within their bytes on ragged blocks."""
    launched = set()
    for case, kernel, grads in sim.run_in_asan_subprocess(_hooked_instances_under_asan, timeout=900):
        shape, dtype, _ = ASAN_HOOK_CASES[case]
        q, k, v, dout, options, _ = _hooked_inputs(case, ASAN_HOOK_CASES)
        assert kernel == fa3_backward.backward_traits(shape[-1], SM90, True).instance(dtype).name_expr, kernel
        launched.add(kernel.split(",", 1)[1])  # the instance less its dtype
        _check_against(tol.backward_references(dout, q, k, v, **options), grads)
    assert len(launched) == 3, launched


# Varlen: packed sequences through cuflash.attention_varlen_backward on the simulator targeting sm_90 (the TMA maps
# span the packed arrays; a sequence's ragged last K/V and Q blocks are copied with loads, zero-filled): empty,
# single-row and multi-block sequences, seqlen_q < and > seqlen_k, GQA/MQA, masks, a head dim TMA cannot take (d100:
# the load path), deterministic in rotation.
VARLEN_CASES = {
    "empty-and-ragged": (([5, 0, 70, 33], [9, 3, 140, 0]), (2, 2, 64), dict(), "float16", False),
    "several-blocks-causal": (([250, 130], [203, 7]), (4, 2, 128), dict(causal=True), "bfloat16", True),
    "q-longer-then-k-longer-window": (([200, 17], [17, 200]), (3, 1, 64), dict(window_size=(11, 4)), "float16",
                                      True),
    "single-rows-d100": (([1, 1, 1], [1, 300, 2]), (4, 2, 100), dict(causal=True, window_size=(19, -1)),
                         "bfloat16", False),
    "d256-causal": (([130, 0, 64], [77, 5, 150]), (2, 1, 256), dict(causal=True), "bfloat16", True),
}


def _varlen_backward(q, k, v, dout, lengths, options, deterministic):
    from test_varlen import _cu

    cu_q, cu_k = _cu(lengths[0]), _cu(lengths[1])
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, deterministic=deterministic,
                                                  **options)
    assert records.launches[2].kernel.startswith("cuflash::fa3_backward_kernel<"), records.launches[2].kernel
    return grads, (cu_q, cu_k)


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_reference(case):
    from test_varlen import _packed_inputs

    lengths, (nheads, nheads_k, headdim), options, dtype, deterministic = VARLEN_CASES[case]
    q, k, v, dout = _packed_inputs(*lengths, nheads, nheads_k, headdim, dtype, seed=len(case))
    (dq, dk, dv), cu_seqlens = _varlen_backward(q, k, v, dout, lengths, options, deterministic)
    _check_against(tol.backward_references(dout, q, k, v, cu_seqlens=cu_seqlens, **options), (dq, dk, dv))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_varlen_sequences_do_not_see_their_neighbours_nan(head_dim):
    """The middle sequence's q and v are NaN: its neighbours' gradients are bitwise those of a clean run (their
    ragged last blocks are copied with loads: a map would read the NaN rows into their tiles, and P's and dS's zeros
    would not keep them out of dV and dQ; d256: the consumers' own dQ adds skip the rows past the sequence)."""
    from test_varlen import _packed_inputs

    lengths = ([70, 90, 33], [140, 100, 60])
    q, k, v, dout = _packed_inputs(*lengths, 4, 2, head_dim, "float16", seed=5)
    clean, _ = _varlen_backward(q, k, v, dout, lengths, {}, True)
    q[70:160] = np.nan
    v[140:240] = np.nan
    poisoned, _ = _varlen_backward(q, k, v, dout, lengths, {}, True)
    rows = {"dq": np.r_[0:70, 160:193], "dk": np.r_[0:140, 240:300], "dv": np.r_[0:140, 240:300]}
    for name, a, b in zip(("dq", "dk", "dv"), clean, poisoned):
        assert np.array_equal(a[rows[name]].view(np.uint16), b[rows[name]].view(np.uint16)), name
    assert np.isnan(poisoned[0][70:160].astype(np.float32)).any()  # the poisoned sequence's own


def test_varlen_used_prefixes_read_no_unused_row():
    """seqused_q / seqused_k: the rows past each sequence's used prefix hold NaN; the used rows' gradients are bitwise
    those of the prefixes packed alone (deterministic mode, both on the Hopper backward), the unused rows' 0."""
    from test_varlen import _cu, _packed_inputs, _prefixes

    lengths_q, lengths_k, used_q, used_k = [70, 5, 130], [140, 9, 203], [64, 0, 77], [100, 9, 150]
    q, k, v, dout = _packed_inputs(lengths_q, lengths_k, 4, 2, 64, "bfloat16", seed=9)
    q_used, dout_used = _prefixes(q, lengths_q, used_q), _prefixes(dout, lengths_q, used_q)
    k_used, v_used = _prefixes(k, lengths_k, used_k), _prefixes(v, lengths_k, used_k)
    rows_q = ~cuflash._validation.unused_rows(_cu(lengths_q), np.array(used_q, np.int32), len(q))
    rows_k = ~cuflash._validation.unused_rows(_cu(lengths_k), np.array(used_k, np.int32), len(k))
    for x, rows in ((q, rows_q), (dout, rows_q), (k, rows_k), (v, rows_k)):
        x[~rows] = np.nan
    counts = dict(seqused_q=np.array(used_q, np.int32), seqused_k=np.array(used_k, np.int32))
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention_varlen(q, k, v, _cu(lengths_q), _cu(lengths_k), return_lse=True, causal=True,
                                            **counts)
        grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, _cu(lengths_q), _cu(lengths_k),
                                                  causal=True, deterministic=True, **counts)
        out_used, lse_used = cuflash.attention_varlen(q_used, k_used, v_used, _cu(used_q), _cu(used_k),
                                                      return_lse=True, causal=True)
        want = cuflash.attention_varlen_backward(dout_used, q_used, k_used, v_used, out_used, lse_used, _cu(used_q),
                                                 _cu(used_k), causal=True, deterministic=True)
    assert sum(r.kernel.startswith("cuflash::fa3_backward_kernel<") for r in records.launches) == 2
    for name, got, wanted, rows in zip(("dq", "dk", "dv"), grads, want, (rows_q, rows_k, rows_k)):
        assert np.array_equal(got[rows].view(np.uint16), wanted.view(np.uint16)), name
        assert np.all(got[~rows].astype(np.float32) == 0), name


# Head dims between the compiled ones run on the next (64, 128 or 256): the columns past them zero-filled in shared
# memory (they add nothing to S^T or dP^T), dQ's atomics and dK/dV's stores guarded by column; whole chunks (40), a
# chunk the head dim cuts (100: element loads), a single column; past 128: 200 (the second consumer's columns cut), 255
# (odd: dQ's element adds, no pairs), 129 (the second consumer's columns all past the head dim).
@pytest.mark.parametrize("head_dim, dtype, causal, seqlens", [(40, "float16", True, (77, 200)),
                                                              (100, "bfloat16", False, (300, 129)),
                                                              (1, "float16", False, (128, 128)),
                                                              (200, "float16", True, (130, 77)),
                                                              (255, "bfloat16", False, (77, 130)),
                                                              (129, "float16", True, (64, 64))])
def test_head_dims_between_compiled_ones(head_dim, dtype, causal, seqlens):
    q, k, v, dout = _inputs((1, *seqlens, 4, 2, head_dim), dtype, seed=43)
    out, lse = _forward(q, k, v, causal)
    # TMA where the rows are whole 16 bytes (40: its map's columns past 40 zero-filled); else the load path.
    grads = _backward(q, k, v, dout, out, lse, causal, tma=head_dim % 8 == 0)
    _check_backward(dout, q, k, v, grads, causal, None)


@pytest.mark.parametrize("head_dim, dtype, causal, loads_only", [(64, "float16", True, False),
                                                                (128, "bfloat16", False, True),
                                                                (256, "bfloat16", True, False)])
def test_race_free(head_dim, dtype, causal, loads_only):
    """Ragged Q and K/V blocks with GQA: 2 K/V blocks of each kv head (5 at d256), 2 heads x 4 Q blocks through the
    2-stage ring (every stage refilled), both consumers (d256: both writing and reading the P^T and dS^T tiles);
    rows without a key where causal. d64 and d256 with TMA, d128 on the load path (the deterministic test below runs
    d64 and d128 with TMA in race mode)."""
    q, k, v, dout = _inputs((1, 200, 300, 4, 2, head_dim), dtype, seed=42)
    out, lse = _forward(q, k, v, causal)
    with sim.checking("race"):
        grads = _backward(q, k, v, dout, out, lse, causal, loads_only=loads_only)
    _check_backward(dout, q, k, v, grads, causal, None)


def test_compiles_for_sm90a_with_hgmma_and_no_spills():
    main = [i for i in fa3_backward.instances() if "fa3_backward_kernel" in i.name_expr]
    compiled = nvrtc.compile_many(main, ["sm_90a"], jobs=1, return_errors=True)
    for result in compiled:
        assert not isinstance(result, nvrtc.CompileError), str(result)
        name = result.instance.name_expr
        (traits,) = [t for t in fa3_backward.TILES for dtype in fa3.DTYPES if t.instance(dtype).name_expr == name]
        res = result.resources
        assert res.registers <= 65536 // traits.threads // 8 * 8, (name, res)
        assert res.spill_store_bytes == res.spill_load_bytes == 0, (name, res)
        assert traits.smem_bytes <= SM90.smem_per_block_bytes
        sass = nvrtc.dump_sass(result)
        assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra"
        bf16 = r"\.BF16" if "bfloat16" in name else ""
        m, d = traits.block_m, traits.head_dim
        if traits.split_head_dim:
            # Each consumer: S^T and dP^T of its m / 2 queries, K-major; dK and dV of its d / 2 and dv / 2 columns
            # (v's own width: MLA's tile) with dS^T and P^T from shared memory (A K-major, B N-major); dQ of its d / 2
            # columns (dS^T M-major, K N-major).
            assert re.search(rf"\bHGMMA\.64x{m // 2}x16\.F32{bf16} R\d+, gdesc\[UR\d+\], ", sass), name
            for cols in (traits.out_cols, traits.out_cols_v):
                assert re.search(rf"\bHGMMA\.64x{cols}x16\.F32{bf16} R\d+, gdesc\[UR\d+\]\.tnspB, ", sass), name
            assert re.search(rf"\bHGMMA\.64x{d // 2}x16\.F32{bf16} R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass), name
            assert not re.search(r"\bHGMMA\.\S+ R\d+, R\d+, ", sass), name  # no A from registers
        else:
            # S^T = K Q^T and dP^T = V dO^T: both operands from descriptors, K-major.
            assert re.search(rf"\bHGMMA\.64x{m}x16\.F32{bf16} R\d+, gdesc\[UR\d+\], ", sass), name
            # dV += P^T dO, dK += dS^T Q: A from registers, B (dO, Q) N-major.
            assert re.search(rf"\bHGMMA\.64x{d}x16\.F32{bf16} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass), name
            # dQ += dS K in 64-column chunks: dS^T read M-major, K N-major.
            assert re.search(rf"\bHGMMA\.64x64x16\.F32{bf16} R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass), name
        (consumer,) = {int(n, 16) for n in re.findall(r"\bUSETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d+, (0x[0-9a-f]+)\b", sass)}
        (producer,) = {int(n, 16) for n in re.findall(r"\bUSETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)\b", sass)}
        roles = {"producer": {"warpgroups": 1, "registers": producer},
                 "consumer": {"warpgroups": traits.consumers, "registers": consumer}}
        assert producer <= 56 and not report.roles_exceed_launch_allocation(roles, res.registers, traits.threads), (
            name, roles, res)
        assert "C7519" not in result.log and "C7517" not in result.log and "C7512" not in result.log, result.log


def test_serves_only_its_problems():
    from cuflash.kernels.program import Problem
    from cuflash.mask import Mask

    def problem(**kw):
        fields = dict(dtype="float16", batch=1, seqlen_q=100, seqlen_k=100, nheads=4, nheads_k=2, headdim=128)
        return Problem(**{**fields, **kw})

    for served in (problem(), problem(deterministic=True), problem(mask=Mask.causal(), dtype="bfloat16"),
                   problem(mask=Mask(window_left=8, window_right=0)), problem(softcap=5.0), problem(alibi="heads"),
                   problem(softcap=5.0, alibi="heads", headdim=64), problem(total_q=300, total_k=200),
                   problem(headdim=160), problem(headdim=256, softcap=5.0, alibi="heads", mask=Mask.causal()),
                   problem(softcap=5.0, alibi="heads"), problem(sinks=True, mask=Mask.causal()),
                   problem(headdim=192, headdim_v=128), problem(headdim=64, headdim_v=256)):
        assert fa3_backward.supports(served, SM90), served
    for other in (problem(dtype="float32"),
                  problem(dropout_p=0.1), problem(headdim=64, headdim_v=257)):
        assert not fa3_backward.supports(other, SM90), other
    assert not fa3_backward.supports(problem(), target("sm_80"))


# The consumers' steady-state step (loop_census's cheapest walk of the Q-block loop that issues a step's work), per
# consumer warp, NVRTC 13.5 for sm_90a: d128 453 instructions for 32 HGMMA (S^T 8, dP^T 8, dV 4, dK 4, dQ 8) and no
# global writes (dQ stored to shared memory, 16 8-byte stores, for the dQ writer's bulk reduces); d64, where the
# consumers take turns at dQ, 408 for 24 HGMMA, 340 for 16. With 16 vector REDs of dQ per thread in the step: d128
# 462, d64 414 and 337; before the step's integer work was cut (dQ^T = K^T dS^T, 32 scalar REDs, a division per
# step): d128 596, d64 540 and 416. tests/test_loop_census.py holds d128 to 1.15x FA3's figure. Bounds a little above
# today's counts, so a regression shows; no global write in the step (a RED back in the consumers fails the walk).
# d256 (the consumers sharing the head dim): 463 for 44 HGMMA (S^T 16 and dP^T 16 of 32 queries, dV 4, dK 4, dQ 4)
# and its dQ's 32 paired REDs (a whole Q block, unguarded); 498 with the REDs' address made from the step's BlockInfo
# (params and cu_seqlens read again after each asm RED); with each add predicated on its row and column: 751 (a
# branch and a BSSY/BSYNC pair per add: ptxas does not if-convert them), with the element guards in C++: 878.
STEP_INSTRUCTIONS = {64: ((24, 0, 418), (16, 0, 348)), 128: ((32, 0, 462),), 256: ((44, 32, 472),)}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_census_of_the_consumer_step(head_dim):
    from cuflash.kernels import loop_census as lc

    traits = fa3_backward.BACKWARD_CHOICES[head_dim]
    (result,) = nvrtc.compile_many([traits.instance("float16")], ["sm_90a"], jobs=1)
    sass = nvrtc.dump_sass(result)
    # The census knows mma.sync's HMMA; the wgmma step's work is HGMMA.
    hgmma = "".join(line.replace("HGMMA", "HMMA") if "HGMMA" in line else line for line in sass.splitlines(True))
    exponentials = 64 * traits.queries // 128  # S^T's scores per thread
    for hmma, dq_adds, most in STEP_INSTRUCTIONS[head_dim]:
        (plain, *_) = lc.census(hgmma, lc.IterationWork(hmma=hmma, ldgsts=0, exponentials=exponentials,
                                                       global_writes=dq_adds))
        assert plain.hmma == hmma and plain.instructions <= most, plain


@pytest.mark.parametrize("head_dim, dtype, causal", [(64, "bfloat16", True), (128, "float16", False),
                                                     (256, "float16", True)])
def test_deterministic_mode_is_bitwise_reproducible(head_dim, dtype, causal):
    """fa2's deterministic mode: a block per dq_accum slice, looping over every num_dq_splits-th K/V block (a target
    of 4 SMs gives 2 slices for 3 K/V blocks per kv head: one block runs two, reloading K and V through the kv_empty
    barrier) and adding only into its slice, each element by the one thread that owns it (head-dim tile t of the
    rows of (head, Q block) is always consumer (t + Q block + head) % consumers'; d256: consumer c's columns, added by
    its own REDs in program order); the same bits whatever moment each copy lands."""
    q, k, v, dout = _inputs((1, 200, 300, 4, 2, head_dim), dtype, seed=46)
    out, lse = _forward(q, k, v, causal)
    two_sms = dataclasses.replace(SM90, sm_count=4)  # 2 slices for 2 kv heads
    assert fa3_backward.backward_program(_problem(q, k, causal, True), two_sms).num_dq_splits == 2
    with sim.checking("race"):
        grads = _backward(q, k, v, dout, out, lse, causal, True, two_sms)
    _check_backward(dout, q, k, v, grads, causal, None)
    for seed in (1, 2):
        with sim.copy_landing(seed):
            again = _backward(q, k, v, dout, out, lse, causal, True, two_sms)
        for a, b in zip(grads, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def _every_tile_under_asan():
    results = []
    # d200 on the d256 tile: whole Q blocks (192 rows), where the consumers' dQ adds go unguarded by row, and the
    # second consumer's columns past the head dim would run past dq_accum's last row.
    for head_dim, causal, seqlen_q in ((64, True, 200), (128, False, 200), (200, True, 192)):
        q, k, v, dout = _inputs((1, seqlen_q, 300, 4, 2, head_dim), "bfloat16", seed=44)
        # out and lse from the float64 reference (out rounded to q's type): no forward built under ASan here.
        out, lse = attention_reference(q, k, v, causal=causal)
        out, lse = out.astype(q.dtype), lse.astype(np.float32)
        results.append((q, k, v, dout, causal, _backward(q, k, v, dout, out, lse, causal)))
    return results


def test_every_tile_clean_under_asan():
    """Shared memory is allocated with exactly the planned bytes: a tile, descriptor, row statistic or mbarrier past
    the layout, or a global access past a ragged block (dq_accum's atomics, dK/dV's stores), is reported."""
    for q, k, v, dout, causal, grads in sim.run_in_asan_subprocess(_every_tile_under_asan, timeout=600):
        _check_backward(dout, q, k, v, grads, causal, None)


def test_no_bank_conflicts():
    """The producer's TMA loads (one per 64-column panel: a 128-byte swizzled line a wavefront) and row statistics or,
    on the load path (d60: rows of 120 bytes, no map), its 16-byte stores (8 lanes a 128-byte swizzled line); the
    consumers' dS^T stores (stmatrix rows, 8 rows of 16 bytes a phase, each at its own chunk position; d256: P^T's
    too, each consumer its 32 queries), dQ stores (8-byte pairs, rows kDqPitch = d + 8 floats apart) and
    row-statistic reads, the dQ writer's bulk reads, and the consumers' wgmma operand reads (every one counted), at
    their ideal wavefront counts on every head dim's tile. Every TMA copy counted: K and V once per K/V block, Q and
    dO per (head, Q block) it visits."""
    for head_dim, causal in ((64, True), (128, False), (60, True), (256, False)):
        tma = head_dim % 8 == 0
        q, k, v, dout = _inputs((1, 200, 300, 2, 2, head_dim), "float16", seed=45)
        out, lse = _forward(q, k, v, causal)
        with sim.checking("profile"), sim.record() as records:
            _backward(q, k, v, dout, out, lse, causal, tma=tma)
        (launch,) = [r for r in records.launches if r.kernel.startswith("cuflash::fa3_backward_kernel")]
        # tma.store: the dQ writer's bulk reduce-adds reading the dQ tile's rows (16-byte units in order); d256 has
        # no dQ writer (its consumers add their dQ with REDs).
        traits = fa3_backward.backward_traits(head_dim, SM90)
        writer = set() if traits.split_head_dim else {"tma.store"}
        kinds = {"store", "load", "wgmma.read"} | writer | ({"tma.load"} if tma else set())
        assert {site.kind for site in launch.shared_access_sites} == kinds
        for site in launch.shared_access_sites:
            assert site.excess == 0, (launch.kernel, site)
        problem = _problem(q, k, causal)
        steps = [problem.mask_policy.q_blocks(traits.block_m, key0, min(key0 + traits.block_n, 300))
                 for key0 in range(0, 300, traits.block_n)]
        # The wgmma operand reads of a step (a core matrix a wavefront: 64 rows x 16 are 16, N x 16 N / 4), all
        # consumers: by keys, each S^T and dP^T (d / 16 wgmma reading 64 keys and m queries), dV and dK (m / 16
        # reading dO or Q, N = d; P^T and dS^T from registers), and the step's d / 64 dQ tiles (n / 16 reading dS^T
        # and 64 columns of K); by head dim, each S^T and dP^T of m / 2 queries, dV and dK with P^T and dS^T read
        # too (N = d / 2), dQ (n / 16 reading dS^T and d / 2 columns of K).
        d, m, n = traits.head_dim, traits.block_m, traits.block_n
        if traits.split_head_dim:
            per_step = 2 * (2 * d // 16 * (16 + m // 8) + 2 * m // 16 * (16 + d // 8) + n // 16 * (16 + d // 8))
        else:
            per_step = (traits.consumers * (2 * d // 16 * (16 + m // 4) + 2 * m // 16 * d // 4)
                        + d // 64 * n // 16 * 32)
        visits = sum(max(s.end - s.begin, 0) for s in steps) * 2  # two heads
        assert sum(s.ideal for s in launch.shared_access_sites if s.kind == "wgmma.read") == visits * per_step
        if tma:
            tiles = sum(2 + 2 * (m.end - m.begin) for m in steps if m.end > m.begin)  # per head (MHA)
            (tma_site,) = [site for site in launch.shared_access_sites if site.kind == "tma.load"]
            assert tma_site.instructions == 2 * tiles * (traits.head_dim // 64), tma_site


# ---- the producer's copies: TMA, or loads where TMA cannot address the arrays --------------------------------


@pytest.mark.parametrize("head_dim, dtype, causal", [(64, "float16", False), (128, "bfloat16", True),
                                                     (256, "bfloat16", False)])
def test_tma_and_load_paths_give_the_same_bits(head_dim, dtype, causal):
    """The same tiles in shared memory whichever way they came (TMA's zero fill past the rows and the head dim, the
    load path's explicit zeros): dq, dk and dv bit for bit in deterministic mode (ragged blocks, GQA, 2 slices),
    the load path forced by tma_loads 0 as a caller without maps, and by a dout 8 bytes off a 16-byte boundary (the
    maps are made per call: that call goes without)."""
    q, k, v, dout = _inputs((1, 200, 300, 4, 2, head_dim), dtype, seed=47)
    out, lse = _forward(q, k, v, causal)
    two_sms = dataclasses.replace(SM90, sm_count=4)
    with_tma = _backward(q, k, v, dout, out, lse, causal, True, two_sms)
    _check_backward(dout, q, k, v, with_tma, causal, None)
    raw = np.empty(dout.size + 8, dout.dtype)
    skew = (-raw.ctypes.data // 2 + 4) % 8  # dout's base 8 bytes past a 16-byte boundary
    shifted = raw[skew: skew + dout.size].reshape(dout.shape)
    shifted[...] = dout
    assert shifted.ctypes.data % 16 == 8
    for loads in (_backward(q, k, v, dout, out, lse, causal, True, two_sms, loads_only=True),
                  _backward(q, k, v, shifted, out, lse, causal, True, two_sms, tma=False)):
        for a, b in zip(with_tma, loads):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def _planted(tmp_path, old, new):
    """fa3_backward.cu with `old` replaced by `new` (a planted bug), as a kernel source of its own."""
    text = (CUDA_SRC / fa3_backward.SOURCE).read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "fa3_backward_planted.cu"
    path.write_text(text.replace(old, new))
    return str(path)


# d64's tile (64 x 128, 2 stages): K's and V's 16 KB each, Q's and dO's 2 x 8 KB each, dS^T's 16 KB, the row
# statistics' 1 KB, then the mbarriers: kv_full, kv_empty, full[2] ...
# fa3_backward_traits.cuh's layout at d64: K, V, Q and dO stages, dS^T, the two float32 dQ buffers (pitch 64 + 8),
# the row statistics, then kv_full, kv_empty and full[0].
_D64_FULL_0 = 2 * 128 * 64 * 2 + 2 * 2 * 64 * 64 * 2 + 128 * 64 * 2 + 2 * 64 * (64 + 8) * 4 + 2 * 2 * 64 * 4 + 2 * 8
_TMA_ISSUE = "          } else if (issuer) {\n            fa3::produce_tile_tma<QTile>"


def test_planted_wrong_expect_tx_deadlocks_naming_the_barrier(tmp_path):
    """The producer expects 16 bytes more for a stage than Q's and dO's copies bring: its full phase never
    completes, and the consumers' wait on it is reported as a deadlock naming the barrier, its phase and the
    missing bytes."""
    kernel = _planted(tmp_path, _TMA_ISSUE, "          } else if (issuer) {\n"
                                            "            arch::mbarrier_expect_tx(full + stage, 16);  // planted\n"
                                            "            fa3::produce_tile_tma<QTile>")
    q, k, v, dout = _inputs((1, 70, 200, 2, 2, 64), "float16", seed=48)
    out, lse = _forward(q, k, v, False)
    with pytest.raises(sim.KernelError, match=rf"(?s)deadlock: .*fa3_backward_planted\.cu:\d+.* for parity 0 of the "
                                              rf"mbarrier at shared byte offset {_D64_FULL_0} .*tx-count of 16 bytes"):
        _backward(q, k, v, dout, out, lse, False, kernel=kernel)


_D64_DS = 2 * 128 * 64 * 2 + 2 * 2 * 64 * 64 * 2  # d64: the dS^T tile past K, V and Q's and dO's two stages
_DS_STORES = ("          arch::named_barrier_sync(kDsBarrier, Tr::kConsumers * fa3::kWarpgroupThreads);\n"
              "#pragma unroll\n"
              "          for (int kk = 0; kk < BlockM / 16; ++kk) "
              "fa3::store_fragment<Tr::kQueries / 16>(ds_row, ds_frag[kk], kk);\n"
              "          arch::fence_proxy_async();\n")


@pytest.mark.parametrize("planted, error", [
    ("barrier", r"data race on shared memory byte offset \d+"),
    ("fence", r"async-proxy read of shared byte offset \d+ \(a wgmma or TMA operand\) without a "
              r"fence\.proxy\.async"),
])
def test_planted_ds_tile_stores_out_of_order(tmp_path, planted, error):
    """The consumers' dS^T stores (arch::stmatrix: each row its address lane's 16-byte store) without the barrier
    that orders them after every consumer's wait for the previous step's dQ (whose wgmma read the whole tile) race
    with those reads; without their fence.proxy.async, this step's dQ wgmma reads them through the async proxy
    unfenced. Race mode names each (the kernel as written is clean under it: test_race_free)."""
    old = _DS_STORES
    new = old.replace("          arch::named_barrier_sync(kDsBarrier, Tr::kConsumers * fa3::kWarpgroupThreads);\n", "")
    if planted == "fence":
        new = old.replace("          arch::fence_proxy_async();\n", "")
    kernel = _planted(tmp_path, old, new)
    q, k, v, dout = _inputs((1, 130, 200, 2, 2, 64), "float16", seed=49)
    out, lse = _forward(q, k, v, False)
    with sim.checking("race"), pytest.raises(sim.KernelError, match=error) as raised:
        _backward(q, k, v, dout, out, lse, False, kernel=kernel)
    offset = int(re.search(r"byte offset (\d+)", str(raised.value)).group(1))
    assert _D64_DS <= offset < _D64_DS + 128 * 64 * 2, str(raised.value)  # a byte of the dS^T tile


def test_planted_arrival_before_the_statistics_is_a_race(tmp_path):
    """The issuing lane arrives (and copies) without the warp's __syncwarp after the row statistics' stores: the
    consumers' reads of another lane's lse or D are then unordered with its store, a race-mode error in the
    statistics' bytes (without race mode the same build runs and is right: the check finds what results miss)."""
    # The statistics' __syncwarp, before the TMA issue (no ragged Q block here) is removed.
    after_stores = "          if (ragged_rows_by_loads && rows < BlockM) {"
    kernel = _planted(tmp_path, "          __syncwarp();\n" + after_stores, after_stores)
    q, k, v, dout = _inputs((1, 70, 200, 2, 2, 64), "float16", seed=48)
    out, lse = _forward(q, k, v, False)
    with sim.checking("race"), pytest.raises(sim.KernelError, match=r"data race on shared memory byte offset (\d+): "
                                                                    r"this thread reads it, thread \(\d+,0,0\) "
                                                                    r"wrote it") as raised:
        _backward(q, k, v, dout, out, lse, False, kernel=kernel)
    offset = int(re.search(r"byte offset (\d+)", str(raised.value)).group(1))
    statistics = _D64_FULL_0 - 2 * 8 - 2 * 2 * 64 * 4
    assert statistics <= offset < statistics + 2 * 2 * 64 * 4, str(raised.value)
