"""fa2's plans on sm_90 run the Hopper forward (cuflash/kernels/families/fa3.py) where it serves, and mma.sync
(fa2_tc) everywhere else; the Hopper instances compile for sm_90a wherever NVRTC is called, and their compile
report rows carry HGMMA and the registers per role after setmaxnreg.

* Plans: which variant each direction, arch and problem gets, and the explanation that says why.
* Through the public API on the simulator targeting sm_90: the fa3 forward, then fa2_tc's backward on its out and
  lse unchanged, against the float64 reference (FlashAttention's tolerance rule).
* One home for the compile arch (catalog.compile_arch): the CuPy backend's and the JAX FFI's NVRTC calls use it.
* The compile report's rows for the fa3 instances on sm_90 (compiled as sm_90a) and sm_90a.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash.kernels import catalog, nvrtc, plans, report
from cuflash.kernels.families import fa2_tc, fa3
from cuflash.kernels.program import Problem
from cuflash.kernels.targets import target
from cuflash.mask import Mask
from test_fa2 import _check_backward, _check_forward, _inputs

SM90, SM80 = target("sm_90"), target("sm_80")


def _problem(**fields):
    base = dict(dtype="bfloat16", batch=1, seqlen_q=300, seqlen_k=129, nheads=4, nheads_k=2, headdim=100)
    return Problem(**{**base, **fields})


def _kernels(program):
    return [launch.kernel.name_expr.split("<")[0] for launch in program.launches]


def test_sm90_forward_runs_the_hopper_kernel_where_it_serves():
    for problem in (_problem(), _problem(mask=Mask.causal(), dtype="float16", headdim=64), _problem(headdim=160),
                    _problem(softcap=5.0), _problem(mask=Mask(window_left=8, window_right=0), alibi="heads")):
        assert plans.variant_for("fa2", problem, SM90).module is fa3
        assert _kernels(plans.forward_program("fa2", problem, SM90)) == ["cuflash::fa3_forward_kernel"]
        # The backward stays on mma.sync, on every arch.
        assert plans.variant_for("fa2", problem, SM90, "backward").module is fa2_tc
        assert "cuflash::fa2_tc_backward_kernel" in _kernels(plans.backward_program("fa2", problem, SM90))
        assert plans.variant_for("fa2", problem, SM80).module is fa2_tc
    for other in (_problem(headdim_v=64), _problem(softcap=5.0, dropout_p=0.1), _problem(dropout_p=0.1)):
        assert plans.variant_for("fa2", other, SM90).module is fa2_tc, other
    assert plans.variant_for("fa2", _problem(dtype="float32"), SM90).name == "simt"


def test_the_plan_says_which_kernel_runs_and_why():
    said = plans.explain("fa2", _problem(), SM90)
    assert said.startswith("fa2 forward on sm_90: hopper (") and "fa3_forward_kernel<__nv_bfloat16, 128, 128, 176" in said
    said = plans.explain("fa2", _problem(), SM90, "backward").splitlines()
    assert said[0].startswith("fa2 backward on sm_90: tensor_core") and said[1] == "  not hopper: no backward kernel"
    said = plans.explain("fa2", _problem(softcap=5.0, alibi="heads"), SM90)
    assert said.startswith("fa2 forward on sm_90: hopper (") and "128, 128, 128, 2, true>" in said
    said = plans.explain("fa2", _problem(softcap=5.0, dropout_p=0.1), SM90).splitlines()
    assert said[0].startswith("fa2 forward on sm_90: tensor_core") and said[1] == "  not hopper: no dropout"
    assert plans.explain("fa2", _problem(), SM80).splitlines()[1] == "  not hopper: wgmma needs sm_90, not sm_80"
    assert "not hopper: no headdim_v" in plans.explain("fa2", _problem(headdim_v=64), SM90)
    # One list of the options served: the catalog's, which fa3.refusal reads.
    (hopper,) = [v for v in catalog.variants("fa2") if v.name == "hopper"]
    assert hopper.options == fa3.SERVED_OPTIONS == {"softcap", "alibi"}


@pytest.mark.parametrize("dtype, causal, head_dim", [("bfloat16", False, 128), ("float16", True, 64)])
def test_hopper_forward_then_mma_sync_backward_through_the_api(dtype, causal, head_dim):
    """fa2_tc's backward reads the fa3 forward's out (for D = rowsum(dO * O)) and lse (to rebuild P) unchanged: the
    gradients match the reference. Ragged blocks, GQA; rows without a key under causal (lse -inf)."""
    q, k, v, dout = _inputs((1, 150, 100, 4, 2, head_dim), dtype, seed=35)
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    kernels = [r.kernel.split("<")[0] for r in records.launches]
    assert kernels[0] == "cuflash::fa3_forward_kernel" and "cuflash::fa2_tc_backward_kernel" in kernels[1:]
    _check_forward(q, k, v, out, lse, causal, None)
    _check_backward(dout, q, k, v, grads, causal, None)


def test_one_home_for_the_compile_arch(monkeypatch):
    hopper = fa3.instances()[0]
    mma_sync = fa2_tc.instances(SM90)[0]
    assert catalog.compile_arch(hopper, "sm_90") == "sm_90a"
    assert catalog.compile_arch(hopper, "compute_90") == "compute_90a"
    assert catalog.compile_arch(mma_sync, "sm_90") == "sm_90"
    outside = fa3.ForwardTraits(64, 64, 64).instance("float16")  # no plan launches it: its arch as asked
    assert catalog.compile_arch(outside, "sm_90") == "sm_90"
    assert fa3.instances(SM80) == [] and set(fa3.instances(SM90)) <= set(catalog.instances(SM90))

    # Both GPU paths ask the catalog: the CuPy backend's loader and the JAX FFI registration.
    asked = []
    monkeypatch.setattr(nvrtc, "compile_instance", lambda instance, arch: asked.append(arch) or _Stop())
    from cuflash.backends import cupy_gpu

    monkeypatch.setattr(cupy_gpu, "load_function", lambda compiled, dynamic_smem_bytes=None: None)
    cupy_gpu.function.__wrapped__(hopper, 0, "sm_90", 0)
    cupy_gpu.function.__wrapped__(mma_sync, 0, "sm_90", 0)
    from cuflash.jax import _primitives
    from cuflash.kernels import toolchain

    monkeypatch.setattr(toolchain, "code_for_device", lambda major, minor: toolchain.CodeChoice("sm_90", "sm_90"))
    with pytest.raises(_Stop):
        _primitives.register_device_code(hopper, "sm_90")
    assert asked == ["sm_90a", "sm_90", "sm_90a"]


class _Stop(Exception):
    """The JAX registration reads the compiled code's fields: stop it there."""

    @property
    def lowered_name(self):
        raise self


def _rows(arch):
    rows, errors = report.build_report([arch], jobs=2, instances=fa3.instances())
    assert not errors, errors
    return rows


def test_report_rows_of_the_hopper_instances():
    """sm_90's rows compile as sm_90a (what the device gets); HGMMA, no HMMA; the producer's and consumers' registers
    after setmaxnreg within the SM's, the consumers' above the launch count; no spills; one block per SM."""
    tools = nvrtc.cuda_tool("cuobjdump") is not None and nvrtc.cuda_tool("nvdisasm") is not None
    for arch in ("sm_90", "sm_90a"):
        for row in _rows(arch):
            data = row.as_json()
            traits = fa3.traits_of(row.compiled.instance)
            assert data["arch"] == "sm_90a" and data["dynamic_smem_bytes"] == traits.smem_bytes
            assert data["spill_store_bytes"] == data["spill_load_bytes"] == 0 and data["blocks_per_sm"] == 1
            roles = data["roles"]
            assert {name: r["warpgroups"] for name, r in roles.items()} == {"producer": 1,
                                                                              "consumer": traits.consumers}
            if not tools:
                assert data["hgmma"] is None
                continue
            assert data["hgmma"] is True and data["hmma"] is False
            producer, consumer = roles["producer"]["registers"], roles["consumer"]["registers"]
            assert producer <= 40 < data["registers"] < consumer
            assert 128 * (producer + traits.consumers * consumer) <= 65536 and not row.exceeds_sm_registers


def test_report_fails_when_the_roles_overcommit_the_sm(monkeypatch, capsys):
    (row, *_) = _rows("sm_90a")
    if row.hgmma is None:
        pytest.skip("no cuobjdump/nvdisasm")
    greedy = {**row.roles, "consumer": {**row.roles["consumer"], "registers": 256}}
    monkeypatch.setattr(report, "build_report", lambda archs, jobs=None: (
        [type(row)(row.compiled, row.dynamic_smem_bytes, row.threads, row.hmma, row.hgmma, greedy)], []))
    assert report.main(["--arch", "sm_90a"]) == 1
    assert "exceed the SM's 65536 registers" in capsys.readouterr().err
    monkeypatch.setattr(report, "build_report", lambda archs, jobs=None: ([row], []))
    assert report.main(["--arch", "sm_90a", "--no-spills"]) == 0
