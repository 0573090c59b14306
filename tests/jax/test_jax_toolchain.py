"""The JAX CUDA path registers the code kernels.toolchain chooses for each device arch: a CUBIN, PTX for a GPU
newer than NVRTC, or a ToolchainError before anything runs. The registration is tested here on made-up devices;
the gpu-marked test runs a PTX fallback under jit and grad in a fresh process (its registry holds no CUBIN yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

from cuflash.jax import _ffi, _primitives  # noqa: E402
from cuflash.kernels import catalog, toolchain  # noqa: E402
from cuflash.kernels.toolchain import Toolchain, ToolchainError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NVRTC_13_5 = Toolchain((13, 5), (75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121))


@pytest.fixture
def combine_kernel():
    return next(i for i in catalog.all_instances() if i.name_expr.startswith("cuflash::fa2_split_kv_combine"))


@pytest.fixture
def registered(monkeypatch):
    calls = []
    monkeypatch.setattr(_ffi, "register_module_image", lambda *args: calls.append(args))
    monkeypatch.setattr(toolchain, "installed", lambda: NVRTC_13_5)
    return calls


def test_a_known_arch_gets_its_cubin(monkeypatch, registered, combine_kernel):
    monkeypatch.setattr(toolchain, "driver_version", lambda: (13, 0))
    _primitives.register_device_code(combine_kernel, "sm_90")
    ((name, arch, lowered, image),) = registered
    assert (name, arch) == (combine_kernel.name_expr, "sm_90") and image[:4] == b"\x7fELF"


def test_a_newer_arch_gets_ptx(monkeypatch, registered, combine_kernel):
    monkeypatch.setattr(toolchain, "driver_version", lambda: (13, 6))
    _primitives.register_device_code(combine_kernel, "sm_130")
    ((name, arch, lowered, image),) = registered
    assert arch == "sm_130" and image.endswith(b"\0") and b".target sm_121" in image
    assert f".entry {lowered}(".encode() in image


def test_a_driver_older_than_nvrtc_is_refused_before_anything_is_registered(monkeypatch, registered,
                                                                              combine_kernel):
    monkeypatch.setattr(toolchain, "driver_version", lambda: (12, 8))
    with pytest.raises(ToolchainError, match=r"12\.8.*sm_89.*cuflash\[cuda12\]"):
        _primitives.register_device_code(combine_kernel, "sm_89")
    assert registered == []


def test_the_handler_library_keeps_a_ptx_image(monkeypatch, combine_kernel):
    """The real registry: the PTX image (NUL included) is what the CUDA handler's cuModuleLoadData will read."""
    monkeypatch.setattr(toolchain, "driver_version", lambda: (13, 6))
    monkeypatch.setattr(toolchain, "installed", lambda: NVRTC_13_5)
    assert not _ffi.module_image_registered(combine_kernel.name_expr, "sm_131")
    _primitives.register_device_code(combine_kernel, "sm_131")
    assert _ffi.module_image_registered(combine_kernel.name_expr, "sm_131")


def _jax_gpu_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


WORKER = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from cuflash.kernels import targets, toolchain
from cuflash.kernels.toolchain import Toolchain
import cuflash.jax as cfj
from cuflash import _tolerance as tol

device_arch = "sm_" + jax.devices("cuda")[0].compute_capability.replace(".", "")
real = toolchain.installed()
older = tuple(a for a in real.supported_archs if 80 <= a < targets.arch_number(device_arch))
toolchain.installed = lambda: Toolchain(real.nvrtc_version, older)
rng = np.random.default_rng(7)
q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((2, 70, 4, 80), (2, 90, 2, 80), (2, 90, 2, 80)))
weights = rng.standard_normal(q.shape).astype(np.float32)
def loss(q, k, v):
    return jnp.sum(cfj.attention(q, k, v, causal=True).astype(jnp.float32) * weights)
out = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True))(q, k, v)
grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
ref = tol.forward_references(q, k, v, causal=True)
tol.check_close("out", np.asarray(out), ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
bref = tol.backward_references(weights.astype(np.float16), q, k, v, causal=True)
for name, got in zip(("dq", "dk", "dv"), grads):
    tol.check_close(name, np.asarray(got), getattr(bref, name), getattr(bref, name + "_lowp"), tol.BACKWARD_FACTOR,
                    atol=1e-5)
print(json.dumps({"code": toolchain.code_for_device(*targets.capability_of(device_arch)).compile_arch,
                  "older": list(older)}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_gpu_devices(), reason="needs a CUDA build of JAX with a GPU")
def test_the_ptx_fallback_under_jit_and_grad_on_the_gpu():
    device_number = int(_jax_gpu_devices()[0].compute_capability.replace(".", ""))
    if not [a for a in toolchain.installed().supported_archs if 80 <= a < device_number]:
        pytest.skip("no arch of 8.0 or newer older than the device to fall back to")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["code"] == f"compute_{max(result['older'])}"
