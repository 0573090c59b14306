"""fa2's plans on sm_90 run the Hopper kernels (the catalog's ``hopper`` variant, cuflash/kernels/families/hopper.py:
fa3.py's forward, fa3_backward.py's backward) where each serves, and mma.sync (fa2_tc) everywhere else; the Hopper
instances compile for sm_90a wherever NVRTC is called, and their compile report rows carry HGMMA and the registers
per role after setmaxnreg.

* Plans: which variant each direction, arch and problem gets, and the explanation that says why.
* Through the public API on the simulator targeting sm_90: the fa3 forward and backward on a rotated grid (dtypes,
  head dims between compiled ones, causal, ragged seqlens, MHA/GQA/MQA) against the float64 reference
  (FlashAttention's tolerance rule), the bytes each launch moved as the traffic formulas say; the deterministic
  backward bitwise across reruns and copy-landing seeds; jax.grad through the same program, bit for bit.
* One home for the compile arch (catalog.compile_arch): the CuPy backend's and the JAX FFI's NVRTC calls use it.
* The compile report's rows for the fa3 instances on sm_90 (compiled as sm_90a) and sm_90a.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import sim
from cuflash.kernels import catalog, nvrtc, plans, report
from cuflash.kernels.families import fa2_tc, fa3, hopper
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


def test_sm90_runs_the_hopper_kernels_where_they_serve():
    # Both directions on the Hopper kernels.
    for problem in (_problem(), _problem(mask=Mask.causal(), dtype="float16", headdim=64),
                    _problem(deterministic=True, headdim=40)):
        assert plans.variant_for("fa2", problem, SM90).module is hopper
        assert _kernels(plans.forward_program("fa2", problem, SM90)) == ["cuflash::fa3_forward_kernel"]
        assert plans.variant_for("fa2", problem, SM90, "backward").module is hopper
        assert _kernels(plans.backward_program("fa2", problem, SM90)) == [
            "cuflash::fa2_dout_dot_out_kernel", "cuflash::fa3_backward_kernel", "cuflash::fa2_convert_dq_kernel"]
        for direction in ("forward", "backward"):
            assert plans.variant_for("fa2", problem, SM80, direction).module is fa2_tc
    # Windows, softcap, ALiBi: both directions on Hopper too.
    for problem in (_problem(softcap=5.0), _problem(mask=Mask(window_left=8, window_right=0), alibi="heads")):
        for direction in ("forward", "backward"):
            assert plans.variant_for("fa2", problem, SM90, direction).module is hopper, (problem, direction)
    # Head dims above 128, softcap with ALiBi at once: both on Hopper (the backward's d256 tile shares the head dim
    # between the consumers).
    for problem in (_problem(headdim=160), _problem(headdim=256, softcap=5.0, alibi="heads"),
                    _problem(softcap=5.0, alibi="heads")):
        for direction in ("forward", "backward"):
            assert plans.variant_for("fa2", problem, SM90, direction).module is hopper, (problem, direction)
        assert plans.variant_for("fa2", problem, SM80).module is fa2_tc
    # v's own head dim: both on Hopper (the tiles of the larger).
    for direction in ("forward", "backward"):
        assert plans.variant_for("fa2", _problem(headdim_v=64), SM90, direction).module is hopper
    # Both on mma.sync.
    for other in (_problem(softcap=5.0, dropout_p=0.1), _problem(dropout_p=0.1)):
        for direction in ("forward", "backward"):
            assert plans.variant_for("fa2", other, SM90, direction).module is fa2_tc, (other, direction)
    for direction in ("forward", "backward"):
        assert plans.variant_for("fa2", _problem(dtype="float32"), SM90, direction).name == "simt"


def test_the_hopper_backward_program_is_in_the_catalog():
    """Every launch of the Hopper backward program is an instance the plans for sm_90 list (the report and the
    GPU's warm-up compile them): the main kernel owned by the hopper variant and compiled for sm_90a, fa2's
    pre-pass and convert kernels by fa2_tc for sm_90."""
    listed = set(catalog.instances(SM90))
    for headdim in (1, 64, 100, 128):
        for dtype in fa3.DTYPES:
            program = plans.backward_program("fa2", _problem(headdim=headdim, dtype=dtype), SM90)
            pre, main, convert = (launch.kernel for launch in program.launches)
            assert {pre, main, convert} <= listed
            assert catalog.owner(main) is hopper and catalog.compile_arch(main, "sm_90") == "sm_90a"
            assert catalog.threads(main) == program.launches[1].block[0]
            assert catalog.dynamic_smem_bytes(main) == program.launches[1].dynamic_smem_bytes
            for row_kernel in (pre, convert):
                assert catalog.owner(row_kernel) is fa2_tc and catalog.compile_arch(row_kernel, "sm_90") == "sm_90"
    assert not any("fa3" in i.name_expr for i in catalog.instances(SM80))


def test_the_plan_says_which_kernel_runs_and_why():
    said = plans.explain("fa2", _problem(), SM90)
    assert said.startswith("fa2 forward on sm_90: hopper (")
    assert "fa3_forward_kernel<__nv_bfloat16, 128, 128, 176" in said
    said = plans.explain("fa2", _problem(), SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (")
    assert "fa3_backward_kernel<__nv_bfloat16, 128, 64, 128" in said
    # Softcap and ALiBi, alone or together: the forward's hooked instance, and the backward's.
    said = plans.explain("fa2", _problem(softcap=5.0, alibi="heads"), SM90)
    assert said.startswith("fa2 forward on sm_90: hopper (") and "128, 128, 128, 2, true>" in said
    said = plans.explain("fa2", _problem(softcap=5.0, alibi="heads", headdim=64), SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (") and "64, 64, 128, 2, true>" in said
    said = plans.explain("fa2", _problem(softcap=5.0), SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (") and "128, 64, 128, 2, true>" in said
    said = plans.explain("fa2", _problem(softcap=5.0, alibi="heads"), SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (") and "128, 64, 128, 2, true>" in said
    said = plans.explain("fa2", _problem(mask=Mask(window_left=8, window_right=0)), SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (")  # windows: both directions
    said = plans.explain("fa2", _problem(headdim=160), SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (") and "256, 64, 64, 2, false, true>" in said
    for direction in ("forward", "backward"):
        said = plans.explain("fa2", _problem(softcap=5.0, dropout_p=0.1), SM90, direction).splitlines()
        assert said[0].startswith(f"fa2 {direction} on sm_90: tensor_core") and said[1] == "  not hopper: no dropout"
        said = plans.explain("fa2", _problem(), SM80, direction).splitlines()
        assert said[1] == "  not hopper: wgmma needs sm_90, not sm_80"
    # One list of the options the forward serves: the catalog's, which fa3.refusal reads.
    (variant,) = [v for v in catalog.variants("fa2") if v.name == "hopper"]
    assert variant.options == fa3.SERVED_OPTIONS == {"softcap", "alibi", "varlen", "kvcache", "paged", "splitkv",
                                                     "sinks", "headdim_v", "flex"}
    # Flex mods: the forward's hooked instance, the backward's plain one (cuflash.flex gives each their Hook).
    flex = dataclasses.replace(_problem(), flex=True)
    said = plans.explain("fa2", flex, SM90)
    assert said.startswith("fa2 forward on sm_90: hopper (") and "128, 128, 128, 2, true>" in said
    said = plans.explain("fa2", flex, SM90, "backward")
    assert said.startswith("fa2 backward on sm_90: hopper (")
    assert "fa3_backward_kernel<__nv_bfloat16, 128, 64, 128, 2>" in said
    # Varlen, KV caches (contiguous, paged) and split-KV: the forward on Hopper (split-KV with fa2's combine
    # kernel), varlen's backward too (a KV cache has none); what stays refused says why.
    kvcache = dict(kvcache=True, seqlen_q=1, seqlen_k=1000, mask=Mask.causal())
    for problem, kernels in ((_problem(total_q=700, total_k=300), "fa3_forward_kernel<__nv_bfloat16, 128, 128, 176"),
                             (_problem(**kvcache), "fa3_forward_kernel<__nv_bfloat16, 128, 128, 128, 2>"),
                             (_problem(**kvcache, page_size=256, pages_per_sequence=4),
                              "fa3_forward_kernel<__nv_bfloat16, 128, 128, 128, 2>"),
                             (_problem(**kvcache, num_splits=3),
                              "fa3_forward_kernel<__nv_bfloat16, 128, 128, 128, 2>, "
                              "cuflash::fa2_split_kv_combine_kernel<__nv_bfloat16>")):
        said = plans.explain("fa2", problem, SM90)
        assert said.startswith("fa2 forward on sm_90: hopper (") and kernels in said, said
    for direction in ("forward", "backward"):  # sinks: the forward joins them, the backward takes them as they are
        for problem in (_problem(total_q=700, total_k=300), _problem(sinks=True)):
            said = plans.explain("fa2", problem, SM90, direction)
            assert said.startswith(f"fa2 {direction} on sm_90: hopper (") and f"fa3_{direction}_kernel<" in said, said
        said = plans.explain("fa2", _problem(total_q=700, total_k=300, dropout_p=0.1), SM90, direction).splitlines()
        assert said[0].startswith(f"fa2 {direction} on sm_90: tensor_core") and said[1] == "  not hopper: no dropout"


# The grid through the public API, rotated: each dtype, both compiled head dims and ones between them (40, 100: the
# columns past them zero-filled), causal and not (rows without a key where seqlen_q > seqlen_k), ragged Q and K/V
# blocks, MHA, GQA and MQA.
API_CASES = [
    pytest.param("bfloat16", False, (1, 150, 100, 4, 2, 128), id="bf16-full-d128-150x100-gqa"),
    pytest.param("float16", True, (1, 150, 100, 4, 2, 64), id="fp16-causal-d64-150x100-gqa"),
    pytest.param("float16", False, (2, 77, 200, 3, 1, 40), id="fp16-full-d40-77x200-mqa-b2"),
    pytest.param("bfloat16", True, (1, 129, 65, 2, 2, 100), id="bf16-causal-d100-129x65-mha"),
]


@pytest.mark.parametrize("dtype, causal, shape", API_CASES)
def test_hopper_forward_and_backward_through_the_api(dtype, causal, shape):
    q, k, v, dout = _inputs(shape, dtype, seed=35)
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    kernels = [r.kernel.split("<")[0] for r in records.launches]
    assert kernels == ["cuflash::fa3_forward_kernel", "cuflash::fa2_dout_dot_out_kernel",
                       "cuflash::fa3_backward_kernel", "cuflash::fa2_convert_dq_kernel"]
    _check_forward(q, k, v, out, lse, causal, None)
    _check_backward(dout, q, k, v, grads, causal, None)
    # Each backward launch moved the bytes fa2's formulas give for the Hopper tiles.
    problem = _problem_of(q, k, causal)
    moved = [(r.global_bytes_read, r.global_bytes_written) for r in records.launches[1:]]
    assert moved == [tuple(t) for t in hopper.backward_traffic(problem, SM90)]


def _problem_of(q, k, causal, deterministic=False):
    batch, seqlen_q, nheads, headdim = q.shape
    return Problem(dtype=np.dtype(q.dtype).name, batch=batch, seqlen_q=seqlen_q, seqlen_k=k.shape[1], nheads=nheads,
                   nheads_k=k.shape[2], headdim=headdim, mask=Mask.causal(causal), deterministic=deterministic)


@pytest.mark.parametrize("dtype, causal, shape", [("float16", True, (1, 200, 300, 4, 2, 64)),
                                                  ("bfloat16", False, (1, 100, 300, 2, 1, 128))])
def test_deterministic_backward_through_the_api_is_bitwise(dtype, causal, shape):
    """deterministic=True: a dq_accum slice per block of the main kernel (sm_90's 132 SMs: one per K/V block
    here), each element added by one thread in program order; the same bits on a rerun and whatever moment each
    copy lands (copy_landing seeds), within the tolerance rule."""
    q, k, v, dout = _inputs(shape, dtype, seed=36)
    runs = []
    for seed in (None, None, 1, 2):
        with sim.targeting("sm_90"), sim.record() as records:
            if seed is None:
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                runs.append(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True))
            else:
                with sim.copy_landing(seed):
                    runs.append(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                           deterministic=True))
        (main,) = [r for r in records.launches if "backward_kernel" in r.kernel]
        assert main.kernel.startswith("cuflash::fa3_backward_kernel")
        program = plans.backward_program("fa2", _problem_of(q, k, causal, True), SM90)
        assert program.num_dq_splits == -(-shape[2] // 128) >= 2 and main.grid == program.launches[1].grid
    _check_backward(dout, q, k, v, runs[0], causal, None)
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_jax_grad_runs_the_hopper_backward():
    """cuflash.jax's gradient (the FFI custom call, planned for the simulator's target) runs the same Hopper
    programs as the numpy API: same launches, the same gradient bits."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cfj
    from cuflash.jax._ffi import record_launches

    q, k, v, dout = _inputs((1, 70, 90, 4, 2, 64), "bfloat16", seed=37)
    with sim.targeting("sm_90"):
        with record_launches() as jax_launches:
            out, vjp = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, causal=True), q, k, v)
            grads = jax.block_until_ready(vjp(jnp.asarray(dout)))
        with sim.record() as numpy_launches:
            out_np, lse_np = cuflash.attention(q, k, v, causal=True, return_lse=True)
            expected = cuflash.attention_backward(dout, q, k, v, out_np, lse_np, causal=True)
    assert jax_launches == numpy_launches.launches
    assert [r.kernel.split("<")[0] for r in jax_launches][:3] == [
        "cuflash::fa3_forward_kernel", "cuflash::fa2_dout_dot_out_kernel", "cuflash::fa3_backward_kernel"]
    for ours, theirs in zip(grads, expected):
        assert np.array_equal(np.asarray(ours).view(np.uint16), theirs.view(np.uint16))


def test_one_home_for_the_compile_arch(monkeypatch):
    wgmma = hopper.instances()[-1]  # the backward's main kernel
    mma_sync = fa2_tc.instances(SM90)[0]
    assert catalog.compile_arch(wgmma, "sm_90") == "sm_90a"
    assert catalog.compile_arch(wgmma, "compute_90") == "compute_90a"
    assert catalog.compile_arch(mma_sync, "sm_90") == "sm_90"
    outside = fa3.ForwardTraits(64, 64, 64).instance("float16")  # no plan launches it: its arch as asked
    assert catalog.compile_arch(outside, "sm_90") == "sm_90"
    assert hopper.instances(SM80) == [] and set(hopper.instances(SM90)) <= set(catalog.instances(SM90))
    assert set(fa3.instances(SM90)) < set(hopper.instances(SM90))

    # Both GPU paths ask the catalog: the CuPy backend's loader and the JAX FFI registration.
    asked = []
    monkeypatch.setattr(nvrtc, "compile_instance", lambda instance, arch: asked.append(arch) or _Stop())
    from cuflash.backends import cupy_gpu

    monkeypatch.setattr(cupy_gpu, "load_function", lambda compiled, dynamic_smem_bytes=None: None)
    cupy_gpu.function.__wrapped__(wgmma, 0, "sm_90", 0)
    cupy_gpu.function.__wrapped__(mma_sync, 0, "sm_90", 0)
    from cuflash.jax import _primitives
    from cuflash.kernels import toolchain

    monkeypatch.setattr(toolchain, "code_for_device", lambda major, minor: toolchain.CodeChoice("sm_90", "sm_90"))
    with pytest.raises(_Stop):
        _primitives.register_device_code(wgmma, "sm_90")
    assert asked == ["sm_90a", "sm_90", "sm_90a"]


class _Stop(Exception):
    """The JAX registration reads the compiled code's fields: stop it there."""

    @property
    def lowered_name(self):
        raise self


def _rows(arch):
    rows, errors = report.build_report([arch], jobs=2, instances=hopper.instances())
    assert not errors, errors
    return rows


def test_report_rows_of_the_hopper_instances():
    """sm_90's rows compile as sm_90a (what the device gets); HGMMA, no HMMA; the producer's and consumers' registers
    after setmaxnreg within the block's launch allocation, the consumers' above the launch count; no spills; one block
    per SM."""
    tools = nvrtc.cuda_tool("cuobjdump") is not None and nvrtc.cuda_tool("nvdisasm") is not None
    for arch in ("sm_90", "sm_90a"):
        for row in _rows(arch):
            data = row.as_json()
            traits = hopper.traits_of(row.compiled.instance)
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
            # The forward's producer keeps 40, the backward's 56 (its dQ writer warp: fa3_backward_traits.cuh).
            assert producer <= 56 < data["registers"] < consumer
            assert 128 * (producer + traits.consumers * consumer) <= data["registers"] * row.threads, data
            assert not row.exceeds_launch_registers


@pytest.mark.parametrize("producer, consumer", [(40, 256), (48, 232)])
def test_report_fails_when_the_roles_overcommit_the_block(monkeypatch, capsys, producer, consumer):
    """(48, 232): the split that fits the SM's 65536 registers but not the block's 168 x 384, and hung on an H200."""
    row = next(row for row in _rows("sm_90a") if row.threads == 384)  # two consumers
    if row.hgmma is None:
        pytest.skip("no cuobjdump/nvdisasm")
    assert row.compiled.resources.registers == 168
    greedy = {"producer": {**row.roles["producer"], "registers": producer},
              "consumer": {**row.roles["consumer"], "registers": consumer}}
    monkeypatch.setattr(report, "build_report", lambda archs, jobs=None: (
        [type(row)(row.compiled, row.dynamic_smem_bytes, row.threads, row.hmma, row.hgmma, greedy)], []))
    assert report.main(["--arch", "sm_90a"]) == 1
    assert "exceed the block's 168 x 384 registers at launch" in capsys.readouterr().err
    monkeypatch.setattr(report, "build_report", lambda archs, jobs=None: ([row], []))
    assert report.main(["--arch", "sm_90a", "--no-spills"]) == 0


@pytest.mark.parametrize("version, serves", [((12, 9), False), ((13, 5), True), (None, True)])
def test_the_hopper_backward_only_where_its_compiler_keeps_it_in_registers(monkeypatch, version, serves):
    """NVRTC 12.9's ptxas spills the Hopper backward (13.5's does not): with NVRTC 12 installed its backward stays on
    mma.sync and its instances are not listed (the report's --no-spills gate); without NVRTC (the simulator's g++
    alone) it serves."""
    from cuflash.kernels.families import fa3_backward

    def installed():
        if version is None:
            raise nvrtc.NvrtcError("cannot load NVRTC")
        return version

    monkeypatch.setattr(nvrtc, "nvrtc_version", installed)
    fa3_backward.toolchain_refusal.cache_clear()
    try:
        chosen = plans.variant_for("fa2", _problem(), SM90, "backward").module
        listed = [i for i in catalog.instances(SM90) if "fa3_backward_kernel" in i.name_expr]
        assert (chosen is hopper) == serves and bool(listed) == serves
        assert plans.variant_for("fa2", _problem(), SM90).module is hopper  # the forward either way
        if not serves:
            said = plans.explain("fa2", _problem(), SM90, "backward").splitlines()
            assert said[1] == "  not hopper: spills under NVRTC 12 (ptxas 12.9): needs NVRTC 13"
    finally:
        fa3_backward.toolchain_refusal.cache_clear()
