"""Helpers for the simulator tests: the Args mirror of tests/sim/kernels/sim_checks.cu."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import cuflash.sim as sim
from cuflash.kernels.program import KernelInstance

KERNELS = Path(__file__).resolve().parent / "kernels"
CHECKS = KERNELS / "sim_checks.cu"

# The layout of kernels/simkit_args.cuh's Args (the test kernels' one by-value argument).
ARGS_DTYPE = np.dtype(
    [
        ("in0", np.uint64),
        ("in1", np.uint64),
        ("out0", np.uint64),
        ("out1", np.uint64),
        ("n", np.int32),
        ("mode", np.int32),
        ("width", np.int32),
        ("mask", np.uint32),
        ("extra", np.int32),
        ("pad", np.int32),
    ]
)


# Template kernels are listed with the instantiations the tests use.
_TEMPLATE_INSTANCES = {
    "shuffle_kernel": ("shuffle_kernel<int>", "shuffle_kernel<float>"),
    "paired_kernel": ("paired_kernel<__half2>", "paired_kernel<__nv_bfloat162>"),
}


def all_kernels() -> list[KernelInstance]:
    """Every kernel instance of sim_checks.cu the tests launch (to precompile them together)."""
    names = []
    for name in re.findall(r"__global__ void (\w+)\(", CHECKS.read_text()):
        names += _TEMPLATE_INSTANCES.get(name, (name,))
    return [kernel(n) for n in names]


def kernel(name: str) -> KernelInstance:
    return KernelInstance(str(CHECKS), f"simtest::{name}")


def args(in0=None, in1=None, out0=None, out1=None, **ints) -> np.void:
    a = np.zeros((), ARGS_DTYPE)
    for field, arr in (("in0", in0), ("in1", in1), ("out0", out0), ("out1", out1)):
        if arr is not None:
            a[field] = arr.ctypes.data
    for field, value in ints.items():
        a[field] = value
    return a[()]


def run(name: str, grid, block, *, smem: int = 0, in0=None, in1=None, out0=None, out1=None, **ints):
    """Launch simtest::<name> with every given array registered as a buffer."""
    buffers = [b for b in (in0, in1, out0, out1) if b is not None]
    return sim.launch(kernel(name), grid, block, smem, args(in0, in1, out0, out1, **ints), buffers)


def swizzled_address(address: int, swizzle: int) -> int:
    """The shared-memory swizzle (32, 64 or 128 bytes; 0: none) of a shared-window byte address, as wgmma reads
    and TMA writes: the 16-byte unit bits [4, 4 + b) XOR bits [7, 7 + b), b = log2(swizzle / 16)."""
    units = swizzle // 16
    return address ^ (((address >> 7) & (units - 1)) << 4) if units > 1 else address
