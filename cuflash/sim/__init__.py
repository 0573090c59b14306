"""The CPU simulator: runs the project's CUDA C++ kernels with g++, one fiber per CUDA thread.

Public API (other packages depend on these names):
    launch(kernel, grid, block, dynamic_smem_bytes, params, buffers) -> LaunchRecord
    record()              context manager collecting LaunchRecords
    checking(mode)        context manager: "normal", "race", "asan" or "profile" (default: $CUFLASH_SIM_MODE);
                          profile mode fills LaunchRecord.shared_access_sites (bank conflicts per site)
    copy_landing(seed)    context manager: the seed of the moments cp.async copies land at
    targeting(arch)       context manager: the GPU the simulator stands in for (default sm_80, $CUFLASH_SIM_TARGET):
                          plans are made for it, launches above its shared memory per block refused
    current_target()      that Target
    current_arch()        its arch name, unresolved (what a call's signature names)
    run_in_asan_subprocess(fn, *args, **kwargs)   run fn in a child Python with ASan preloaded
    precompile(instances) build ahead of time (warms the cache)
    params_layout()       AttentionParams layout as g++ computes it
    launch_entry_address(kernel)  C entry point for launching from native code (sim_abi.h)
    KernelError           raised for every kernel error and invalid launch
"""

from ._build import BuildError
from ._launch import (
    KernelError,
    LaunchRecord,
    Recorder,
    SharedAccessSite,
    checking,
    copy_landing,
    current_mode,
    on_mode_change,
    current_target,
    current_arch,
    launch,
    launch_entry_address,
    params_layout,
    precompile,
    record,
    targeting,
)
from ._asan import run_in_asan_subprocess

__all__ = [
    "BuildError",
    "KernelError",
    "LaunchRecord",
    "Recorder",
    "SharedAccessSite",
    "checking",
    "copy_landing",
    "current_mode",
    "on_mode_change",
    "current_target",
    "current_arch",
    "launch",
    "launch_entry_address",
    "params_layout",
    "precompile",
    "record",
    "run_in_asan_subprocess",
    "targeting",
]
