"""Matching NVRTC to the driver and the device (kernels.toolchain), the PTX fallback it can choose, and the
CuPy backend's use of both: the choice tested on made-up devices here, the real device in the gpu-marked tests."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from cuflash.kernels import catalog, nvrtc, report, targets, toolchain
from cuflash.kernels.program import KernelInstance
from cuflash.kernels.toolchain import CodeChoice, DeviceDescription, Toolchain, ToolchainError
from cuflash.testing import gpu_count

PROBES = Path(__file__).resolve().parent / "compile_kernels" / "probe_kernels.cu"

# What nvrtcGetSupportedArchs lists for three real NVRTC releases.
NVRTC_13_5 = Toolchain((13, 5), (75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121))
NVRTC_12_9 = Toolchain((12, 9), (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121))
NVRTC_12_4 = Toolchain((12, 4), (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90))


@pytest.mark.parametrize("capability, driver, tools, expected", [
    ((9, 0), (13, 5), NVRTC_13_5, "sm_90"),  # H100, matching driver: its CUBIN
    ((9, 0), (13, 0), NVRTC_13_5, "sm_90"),  # older minor: CUBINs keep minor-version compatibility
    ((8, 9), (12, 8), NVRTC_12_9, "sm_89"),  # the cuda12 extra on a CUDA 12 driver
    ((8, 0), (13, 5), NVRTC_12_9, "sm_80"),  # a newer driver runs NVRTC 12's code
    ((8, 0), (14, 0), NVRTC_13_5, "sm_80"),
    ((12, 0), (12, 8), NVRTC_12_4, "compute_90"),  # RTX 5090 newer than NVRTC 12.4: PTX the driver compiles
    ((12, 0), (12, 8), NVRTC_12_9, "sm_120"),
    ((13, 0), (13, 6), NVRTC_13_5, "compute_121"),  # a GPU newer than NVRTC 13.5
    ((10, 1), (13, 5), NVRTC_13_5, "compute_100"),  # an arch NVRTC 13 dropped (it calls it sm_110)
])
def test_the_code_a_device_gets(capability, driver, tools, expected):
    choice = toolchain.choose_code(DeviceDescription(capability, driver), tools)
    assert choice == CodeChoice("sm_{}{}".format(*capability), expected)
    assert choice.form == ("ptx" if expected.startswith("compute_") else "cubin")


@pytest.mark.parametrize("capability, driver, tools, says", [
    # NVRTC 13 on a CUDA 12 driver: install the cuda12 extra.
    ((8, 9), (12, 8), NVRTC_13_5, ["12.8", "sm_89", "NVRTC 13.5", "cuflash[cuda12]", "update the driver"]),
    ((9, 0), (12, 2), NVRTC_13_5, ["12.2", "sm_90", "cuflash[cuda12]"]),
    # A CUDA 11 driver: no extra fits.
    ((8, 0), (11, 8), NVRTC_12_9, ["11.8", "sm_80", "CUDA 12 or newer"]),
    # PTX needs a driver at least as new as NVRTC.
    ((13, 0), (13, 4), NVRTC_13_5, ["13.4", "sm_130", "PTX", "update the driver", "nvidia-cuda-nvrtc"]),
    ((12, 0), (12, 3), NVRTC_12_4, ["12.3", "sm_120", "PTX", "nvidia-cuda-nvrtc-cu12"]),
    # Older than the kernels' instructions.
    ((7, 5), (13, 5), NVRTC_13_5, ["8.0 or newer", "sm_75"]),
])
def test_no_code_is_a_clear_error(capability, driver, tools, says):
    with pytest.raises(ToolchainError) as caught:
        toolchain.choose_code(DeviceDescription(capability, driver), tools)
    message = str(caught.value)
    for fragment in says:
        assert fragment in message, (fragment, message)


def test_install_advice_names_the_extra_of_the_drivers_major():
    assert "cuflash[cuda12]" in toolchain.install_advice(12)
    assert "cuflash[cuda13]" in toolchain.install_advice(13)
    assert "cuflash[cuda13]" in toolchain.install_advice(14)
    assert "update the NVIDIA driver" in toolchain.install_advice(11)


def test_cuda_versions_as_the_driver_api_encodes_them():
    assert toolchain.parse_cuda_version(12040) == (12, 4)
    assert toolchain.parse_cuda_version(13050) == (13, 5)
    assert toolchain.parse_cuda_version(11080) == (11, 8)


def test_arch_names_and_numbers():
    assert targets.capability_of("sm_90a") == (9, 0) and targets.capability_of("sm_120") == (12, 0)
    assert targets.arch_number("sm_86") == 86 and targets.arch_number("sm_100") == 100
    with pytest.raises(ValueError, match="not a real GPU arch"):
        targets.capability_of("compute_90")


def test_the_driver_version_is_read_with_the_driver_api(monkeypatch):
    from cuda import bindings
    from cuda.bindings import driver

    toolchain.driver_version.cache_clear()
    try:
        fake = types.SimpleNamespace(CUresult=driver.CUresult,
                                     cuDriverGetVersion=lambda: (driver.CUresult.CUDA_SUCCESS, 12080))
        monkeypatch.setattr(bindings, "driver", fake)
        assert toolchain.driver_version() == (12, 8)
        toolchain.driver_version.cache_clear()
        failing = types.SimpleNamespace(CUresult=driver.CUresult,
                                        cuDriverGetVersion=lambda: (driver.CUresult.CUDA_ERROR_UNKNOWN, 0))
        monkeypatch.setattr(bindings, "driver", failing)
        with pytest.raises(ToolchainError, match="cuDriverGetVersion failed: CUDA_ERROR_UNKNOWN"):
            toolchain.driver_version()
    finally:
        toolchain.driver_version.cache_clear()


def test_the_real_driver_version_or_a_clear_error():
    toolchain.driver_version.cache_clear()
    if gpu_count():
        assert toolchain.driver_version() >= (12, 0)
    else:
        with pytest.raises(ToolchainError, match="driver"):
            toolchain.driver_version()
    toolchain.driver_version.cache_clear()


def test_the_installed_toolchain_is_nvrtcs_own_report():
    installed = toolchain.installed()
    assert installed.nvrtc_version == nvrtc.nvrtc_version()
    assert installed.supported_archs == tuple(sorted(installed.supported_archs))
    assert {80, 86, 89, 90} <= set(installed.supported_archs)


def test_the_machine_report_names_each_devices_code(monkeypatch, capsys):
    from cuflash.kernels.__main__ import main

    monkeypatch.setattr(toolchain, "installed", lambda: NVRTC_13_5)
    monkeypatch.setattr(toolchain, "driver_version", lambda: (13, 6))
    lines, ok = toolchain.machine_report([(9, 0), (13, 0)])
    assert ok and lines[0].startswith("NVRTC 13.5: compiles for sm_75 sm_80") and "CUDA headers" in lines[1]
    assert lines[2:] == ["driver: runs CUDA up to 13.6; 2 device(s)", "device 0 (sm_90): cubin for sm_90",
                         "device 1 (sm_130): ptx for compute_121"]
    monkeypatch.setattr(toolchain, "driver_version", lambda: (12, 8))
    monkeypatch.setattr(toolchain, "local_capabilities", lambda: [(8, 9)])
    assert main(["toolchain"]) == 1
    out = capsys.readouterr().out
    assert "device 0 (sm_89): no code:" in out and "cuflash[cuda12]" in out

    def no_driver():
        raise ToolchainError("cannot read the CUDA driver's version (no libcuda)")

    monkeypatch.setattr(toolchain, "driver_version", no_driver)
    lines, ok = toolchain.machine_report()
    assert ok and lines[-2:] == ["no CUDA driver: cannot read the CUDA driver's version (no libcuda)",
                                 "kernels run on the CPU simulator only"]
    assert not any(line.startswith("warning:") for line in lines)


def test_an_nvrtc_older_than_the_checked_one_is_named():
    """NVRTC 13.0 (an H200 image's) is older than the 13.5 CI's compile report checks: the toolchain report says
    so and names the wheel; 13.5, 13.6 and 12.9 pass without a word."""
    (warning,) = toolchain.unchecked_nvrtc_warning((13, 0))
    assert warning.startswith("warning: NVRTC 13.0 is older than 13.5") and "'nvidia-cuda-nvrtc>=13.5'" in warning
    assert "nvidia-cuda-nvrtc-cu12>=12.9" in toolchain.unchecked_nvrtc_warning((12, 8))[0]
    assert [toolchain.unchecked_nvrtc_warning(v) for v in ((13, 5), (13, 6), (12, 9), (14, 0))] == [[]] * 4


# ---- the CUDA headers match NVRTC -----------------------------------------------------------------------------


def test_headers_of_another_cuda_major_are_refused(tmp_path, monkeypatch):
    (tmp_path / "cuda.h").write_text("#pragma once\n#define CUDA_VERSION 12090\n")
    assert nvrtc.cuda_headers_version(tmp_path) == (12, 9)
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 5))
    monkeypatch.setattr(nvrtc, "find_cuda_include_dir", lambda: tmp_path)
    nvrtc.cuda_include_dir.cache_clear()
    try:
        with pytest.raises(nvrtc.NvrtcError) as caught:
            nvrtc.cuda_include_dir()
        message = str(caught.value)
        assert "CUDA 12.9" in message and "NVRTC is 13.5" in message and "nvidia-cuda-runtime" in message
        monkeypatch.setattr(nvrtc, "find_cuda_include_dir", lambda: None)
        nvrtc.cuda_include_dir.cache_clear()
        with pytest.raises(nvrtc.NvrtcError, match="not found: install the nvidia-cuda-runtime wheel"):
            nvrtc.cuda_include_dir()
    finally:
        nvrtc.cuda_include_dir.cache_clear()


def test_the_installed_headers_are_nvrtcs_major():
    assert nvrtc.cuda_headers_version(nvrtc.cuda_include_dir())[0] == nvrtc.nvrtc_version()[0]


# ---- PTX: the fallback's code ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nvrtc"


def test_ptx_for_a_virtual_arch(fresh_cache):
    instance = KernelInstance(str(PROBES), "mma_probe<0>")
    compiled = nvrtc.compile_instance(instance, "compute_80")
    assert compiled.form == "ptx" and compiled.resources is None
    text = compiled.code.decode()
    assert compiled.code.endswith(b"\0") and text.count("\0") == 1  # what cuModuleLoadData reads as PTX
    assert ".target sm_80" in text and f".entry {compiled.lowered_name}(" in text and "mma.sync" in text
    assert compiled.code_path.endswith(".ptx") and Path(compiled.code_path).read_bytes() == compiled.code
    assert [p.suffix for p in fresh_cache.glob("*.ptx")] == [".ptx"]
    cubin = nvrtc.compile_instance(instance, "sm_80")  # another entry: the form is part of the key
    assert cubin.form == "cubin" and cubin.code[:4] == b"\x7fELF" and cubin.lowered_name == compiled.lowered_name
    count = nvrtc.nvrtc_compile_count()
    assert nvrtc.compile_instance(instance, "compute_80") == compiled and nvrtc.nvrtc_compile_count() == count
    with pytest.raises(nvrtc.SassError, match="PTX"):
        nvrtc.dump_sass(compiled)


def test_ptx_compile_errors_carry_the_log(fresh_cache):
    instance = KernelInstance(str(PROBES), "float_only_probe<double>")
    with pytest.raises(nvrtc.CompileError) as caught:
        nvrtc.compile_instance(instance, "compute_80")
    assert "float_only_probe" in caught.value.log and caught.value.arch == "compute_80"


def test_a_real_kernel_compiles_to_ptx(fresh_cache):
    (instance,) = [i for i in catalog.all_instances() if i.name_expr.startswith("cuflash::fa2_split_kv_combine")][:1]
    compiled = nvrtc.compile_instance(instance, "compute_90")
    assert f".entry {compiled.lowered_name}(" in compiled.code.decode() and ".target sm_90" in compiled.code.decode()


# ---- the report compiles with whichever NVRTC is installed -----------------------------------------------------


def test_report_archs_follow_the_installed_nvrtc(monkeypatch, capsys):
    assert report.archs_to_report(None, NVRTC_12_4.supported_archs) == (
        ["sm_80", "sm_86", "sm_89", "sm_90"], ["sm_120"])
    assert report.archs_to_report(None, NVRTC_13_5.supported_archs) == (list(report.DEFAULT_ARCHS), [])
    monkeypatch.setattr(report, "supported_archs", lambda: NVRTC_12_4.supported_archs)
    monkeypatch.setattr(report, "nvrtc_version", lambda: (12, 4))
    assert report.main(["--arch", "sm_80", "sm_120"]) == 2
    err = capsys.readouterr().err
    assert "NVRTC 12.4 cannot compile for sm_120" in err and "sm_90" in err


# ---- the CuPy backend asks before compiling --------------------------------------------------------------------


def _fake_cupy_device(capability: str):
    device = types.SimpleNamespace(compute_capability=capability,
                                   attributes={"MaxSharedMemoryPerBlockOptin": 227 * 1024, "MultiProcessorCount": 7})
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda device_id: device))


@pytest.mark.parametrize("capability, driver, expected", [
    ("90", (13, 5), "sm_90"), ("130", (13, 6), "compute_121"), ("90", (12, 8), None),
])
def test_the_cupy_backend_chooses_its_code_when_made(monkeypatch, capability, driver, expected):
    from cuflash.backends.cupy_gpu import CupyBackend

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_device(capability))
    monkeypatch.setattr(toolchain, "driver_version", lambda: driver)
    monkeypatch.setattr(toolchain, "installed", lambda: NVRTC_13_5)
    if expected is None:
        with pytest.raises(ToolchainError, match="cuflash\\[cuda12\\]"):
            CupyBackend(0)
        return
    backend = CupyBackend(0)
    assert backend.code.compile_arch == expected and backend.target.sm_count == 7
    assert backend.target.arch == "sm_" + capability


# ---- on a real GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_real_device_gets_its_cubin_and_plans_for_its_limits():
    import cupy

    from cuflash.backends.cupy_gpu import CupyBackend

    device = cupy.cuda.Device()
    capability = device.compute_capability
    choice = toolchain.code_for_device(int(capability[:-1]), int(capability[-1]))
    assert choice.device_arch == "sm_" + capability
    if targets.arch_number(choice.device_arch) in toolchain.installed().supported_archs:
        assert choice.compile_arch == choice.device_arch
    assert toolchain.driver_version()[0] >= toolchain.installed().nvrtc_version[0]
    backend = CupyBackend(device.id)
    assert backend.code == choice and backend.target.arch == choice.device_arch
    assert backend.target.smem_per_block_bytes == device.attributes["MaxSharedMemoryPerBlockOptin"]
    assert backend.target.sm_count == device.attributes["MultiProcessorCount"]
    lines, ok = toolchain.machine_report()
    assert ok and f"device {device.id} ({choice.device_arch}): {choice.form} for {choice.compile_arch}" in lines


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_ptx_fallback_runs_on_the_gpu(monkeypatch, dtype):
    """Pretend NVRTC knows no arch as new as the device: the backend gets PTX for an older arch, which the driver
    compiles; forward and backward still match the reference."""
    import cupy

    import cuflash
    from cuflash import _tolerance as tol
    from cuflash.testing import random_inputs

    capability = cupy.cuda.Device().compute_capability
    device_number = targets.arch_number("sm_" + capability)
    real = toolchain.installed()
    older = tuple(arch for arch in real.supported_archs if 80 <= arch < device_number)
    if not older:
        pytest.skip(f"sm_{device_number} has no older arch of 8.0 or newer to fall back to")
    monkeypatch.setattr(toolchain, "installed", lambda: Toolchain(real.nvrtc_version, older))
    from cuflash.backends.cupy_gpu import CupyBackend

    assert CupyBackend(cupy.cuda.Device().id).code.compile_arch == f"compute_{max(older)}"
    q, k, v, dout = random_inputs((2, 130, 190, 4, 2, 96), dtype, seed=5)
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(gq, gk, gv, causal=True, return_lse=True)
    grads = cuflash.attention_backward(gdout, gq, gk, gv, out, lse, causal=True)
    ref = tol.forward_references(q, k, v, causal=True)
    tol.check_close("out", cupy.asnumpy(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    bref = tol.backward_references(dout, q, k, v, causal=True)
    for name, got in zip(("dq", "dk", "dv"), grads):
        tol.check_close(name, cupy.asnumpy(got), getattr(bref, name), getattr(bref, name + "_lowp"),
                        tol.BACKWARD_FACTOR, atol=1e-5)
