"""Which code a GPU gets: the installed NVRTC, the driver's CUDA version and the device's arch, matched.

cuflash compiles its kernels at run time with the NVRTC installed beside it (the ``cuda12`` or ``cuda13`` extra
brings NVRTC and the CUDA headers of that major version). Three facts decide what a device can run:

- Code from NVRTC of CUDA major M needs a driver for CUDA M or newer (the driver reports the newest CUDA it runs:
  cuDriverGetVersion, what nvidia-smi prints as "CUDA Version"). Within a major, a CUBIN from a newer minor runs on
  an older driver (CUDA's minor-version compatibility); PTX does not, because the driver compiles it and must know
  its PTX ISA version.
- A CUBIN runs on the arch it was compiled for. NVRTC lists the archs it knows (nvrtcGetSupportedArchs).
- PTX for compute_XX runs on any GPU of arch XX or newer, compiled by the driver when the module loads.

So choose_code gives each device a CUBIN for its own arch when NVRTC knows the arch; else PTX for the newest arch
NVRTC knows below the device's (a GPU newer than the toolkit), when the driver is at least as new as NVRTC; else a
ToolchainError naming the driver's CUDA version, the device's arch and what to install. The choice is a pure
function of a DeviceDescription and a Toolchain, so it is tested on made-up devices; code_for_device applies it to
a real device. Both GPU paths (the CuPy backend and the JAX CUDA handler) call code_for_device before anything is
compiled or launched.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .nvrtc import cuda_wheels
from .targets import arch_name, arch_number, capability_of

# The oldest GPU cuflash's kernels run on: cp.async, ldmatrix and mma.sync.m16n8k16 are sm_80 instructions.
MIN_COMPUTE_CAPABILITY = (8, 0)
# The CUDA majors cuflash has an extra for (setup.cfg: cuda12, cuda13).
EXTRAS = (12, 13)
# Per major, the oldest NVRTC whose compile of every instance CI's report checks (spill-free, .ci/run) and the
# extras require. An older one still compiles and runs the kernels, but is not checked: NVRTC 13.0 (an H200 image's,
# 2026-11-26) spilled the sm_90 forward 20 to 544 bytes at head dims 96 to 256.
CHECKED_NVRTC = {12: (12, 9), 13: (13, 5)}


class ToolchainError(RuntimeError):
    """The installed NVRTC cannot produce code this device and driver can run."""


@dataclass(frozen=True)
class Toolchain:
    """The NVRTC cuflash compiles with."""

    nvrtc_version: tuple[int, int]
    supported_archs: tuple[int, ...]  # real archs NVRTC compiles for: 80 is sm_80, 120 is sm_120

    def describe(self) -> str:
        return f"NVRTC {self.nvrtc_version[0]}.{self.nvrtc_version[1]}"


@dataclass(frozen=True)
class DeviceDescription:
    """What the driver says about one GPU."""

    compute_capability: tuple[int, int]
    driver_version: tuple[int, int]  # the newest CUDA the driver runs (cuDriverGetVersion)

    @property
    def arch(self) -> str:
        return arch_name(*self.compute_capability)

    @property
    def arch_number(self) -> int:
        return arch_number(self.arch)


@dataclass(frozen=True)
class CodeChoice:
    """The code one device gets: compile_arch is what NVRTC compiles for, device_arch what it runs on."""

    device_arch: str  # "sm_90": also the key kernels are registered under for that device
    compile_arch: str  # "sm_90" (a CUBIN) or "compute_90" (PTX the driver compiles at load)

    @property
    def form(self) -> str:
        return "ptx" if self.compile_arch.startswith("compute_") else "cubin"


def _version(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def install_advice(driver_major: int) -> str:
    """What to install so that cuflash's NVRTC matches a driver of this CUDA major version."""
    if driver_major in EXTRAS:
        return f"pip install 'cuflash[cuda{driver_major}]' (NVRTC and CUDA headers {driver_major})"
    if driver_major > max(EXTRAS):
        return f"pip install 'cuflash[cuda{max(EXTRAS)}]' (NVRTC {max(EXTRAS)}, which this driver also runs)"
    return f"update the NVIDIA driver to one for CUDA {min(EXTRAS)} or newer (cuflash has no CUDA {driver_major} build)"


def choose_code(device: DeviceDescription, toolchain: Toolchain) -> CodeChoice:
    """The code ``device`` gets from ``toolchain``, or a ToolchainError saying why none and what to install."""
    nvrtc, driver = toolchain.nvrtc_version, device.driver_version
    seen = (f"(device {device.arch}, driver for CUDA {_version(driver)}, {toolchain.describe()} "
            f"knowing sm_{min(toolchain.supported_archs)}..sm_{max(toolchain.supported_archs)})")
    if device.compute_capability < MIN_COMPUTE_CAPABILITY:
        raise ToolchainError(
            f"cuflash's kernels need compute capability {_version(MIN_COMPUTE_CAPABILITY)} or newer (sm_80: A100, "
            f"RTX 30 series and later) {seen}"
        )
    if driver[0] < nvrtc[0]:
        raise ToolchainError(
            f"the NVIDIA driver runs CUDA up to {_version(driver)}, but code from the installed {toolchain.describe()} "
            f"needs a driver for CUDA {nvrtc[0]} {seen}: {install_advice(driver[0])}, or update the driver"
        )
    if device.arch_number in toolchain.supported_archs:
        return CodeChoice(device.arch, device.arch)
    older = [arch for arch in toolchain.supported_archs if 80 <= arch < device.arch_number]
    if not older:
        raise ToolchainError(f"{toolchain.describe()} compiles for no arch this device runs {seen}")
    if driver < nvrtc:
        raise ToolchainError(
            f"{toolchain.describe()} does not know {device.arch}, so cuflash would give it PTX to compile, but the "
            f"driver runs CUDA up to {_version(driver)} and cannot compile PTX from {toolchain.describe()} {seen}: "
            f"update the driver, or install an NVRTC that knows {device.arch} "
            f"(pip install -U {cuda_wheels(nvrtc[0])[0]})"
        )
    return CodeChoice(device.arch, f"compute_{max(older)}")


def parse_cuda_version(encoded: int) -> tuple[int, int]:
    """(major, minor) of a CUDA version as the driver API encodes it (1000 * major + 10 * minor: 12040 is 12.4)."""
    return encoded // 1000, encoded % 1000 // 10


# ---------------------------------------------------------------------------------------------------------------
# The real machine.


@functools.lru_cache(maxsize=None)
def installed() -> Toolchain:
    """The NVRTC this process compiles with (an NvrtcError, with what to install, when there is none)."""
    from .nvrtc import nvrtc_version, supported_archs

    return Toolchain(nvrtc_version(), supported_archs())


@functools.lru_cache(maxsize=None)
def driver_version() -> tuple[int, int]:
    """The newest CUDA the installed NVIDIA driver runs, read with the driver API (cuDriverGetVersion)."""
    try:
        from cuda.bindings import driver

        result, encoded = driver.cuDriverGetVersion()
    except (ImportError, RuntimeError) as err:  # pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise ToolchainError(
            f"cannot read the CUDA driver's version ({err}): is the NVIDIA driver installed? If it is one for CUDA 12 "
            f"(nvidia-smi shows 'CUDA Version'), {install_advice(12)}"
        ) from err
    if result != driver.CUresult.CUDA_SUCCESS:
        raise ToolchainError(f"cuDriverGetVersion failed: {result.name}")
    return parse_cuda_version(int(encoded))


def code_for_device(major: int, minor: int) -> CodeChoice:
    """The code a device of compute capability major.minor gets on this machine (see choose_code)."""
    return choose_code(DeviceDescription((major, minor), driver_version()), installed())


def capability_of_cupy(compute_capability: str) -> tuple[int, int]:
    """(major, minor) of CuPy's spelling of a compute capability ("90", "120")."""
    return capability_of("sm_" + compute_capability)


def describe_code(choice: CodeChoice) -> str:
    """What a device runs, for reports: "sm_90 CUBINs from NVRTC 13.5, driver for CUDA 13.0"."""
    driver = driver_version()
    return (f"{choice.compile_arch} {'CUBINs' if choice.form == 'cubin' else 'PTX'} from {installed().describe()}, "
            f"driver for CUDA {_version(driver)}")


def local_capabilities() -> list[tuple[int, int]]:
    """(major, minor) of every CUDA device the driver sees, by the driver API (a ToolchainError without a driver)."""
    try:
        from cuda.bindings import driver

        (result,) = driver.cuInit(0)
    except (ImportError, RuntimeError) as err:  # pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise ToolchainError(f"cannot reach the CUDA driver ({err})") from err
    if result == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return []
    if result != driver.CUresult.CUDA_SUCCESS:
        raise ToolchainError(f"cuInit failed: {result.name}")
    attribute = driver.CUdevice_attribute
    found = []
    for ordinal in range(driver.cuDeviceGetCount()[1]):
        device = driver.cuDeviceGet(ordinal)[1]
        found.append(tuple(int(driver.cuDeviceGetAttribute(which, device)[1]) for which in (
            attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)))
    return found


def unchecked_nvrtc_warning(version: tuple[int, int]) -> list[str]:
    """A line saying that this NVRTC is older than the one CI's compile report checks for its major (none if not)."""
    checked = CHECKED_NVRTC.get(version[0])
    if checked is None or version >= checked:
        return []
    wheel = cuda_wheels(version[0])[0]
    return [f"warning: NVRTC {_version(version)} is older than {_version(checked)}, the oldest whose compile CI checks "
            f"(registers, spills): its kernels may spill or miscompile; pip install '{wheel}>={_version(checked)}'"]


def machine_report(capabilities: list[tuple[int, int]] | None = None) -> tuple[list[str], bool]:
    """``python -m cuflash.kernels toolchain``: lines saying what this machine's NVRTC, CUDA headers and driver are
    and the code each local device gets (``capabilities``: the driver's devices unless given); and whether every
    device gets code (True without a driver or devices: the simulator still runs everything)."""
    from .nvrtc import cuda_headers_version, cuda_include_dir

    tools = installed()
    headers = cuda_include_dir()
    lines = [f"{tools.describe()}: compiles for " + " ".join(f"sm_{a}" for a in tools.supported_archs),
             "CUDA headers {}.{}: {}".format(*cuda_headers_version(headers), headers)]
    lines += unchecked_nvrtc_warning(tools.nvrtc_version)
    try:
        driver = driver_version()
        capabilities = local_capabilities() if capabilities is None else capabilities
    except ToolchainError as err:
        return lines + [f"no CUDA driver: {err}", "kernels run on the CPU simulator only"], True
    lines.append(f"driver: runs CUDA up to {_version(driver)}; {len(capabilities)} device(s)")
    ok = True
    for ordinal, (major, minor) in enumerate(capabilities):
        try:
            choice = choose_code(DeviceDescription((major, minor), driver), tools)
            lines.append(f"device {ordinal} ({choice.device_arch}): {choice.form} for {choice.compile_arch}")
        except ToolchainError as err:
            ok = False
            lines.append(f"device {ordinal} ({arch_name(major, minor)}): no code: {err}")
    return lines, ok
