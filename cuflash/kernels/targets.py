"""GPU targets: the architectures plans are made for and the limits a plan must respect.

A launch plan is made for a target, because what a block may have differs by architecture:
the opt-in dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin) is
163 KB on sm_80/sm_87, 99 KB on sm_86/sm_89/sm_120 (RTX 30/40/50, A10, A40, L4, L40S) and
227 KB on sm_90/sm_100; tile tables choose per limit, as FlashAttention-2 does for sm86/89.
The per-SM figures (CUDA C++ Programming Guide, technical specifications per compute
capability) give the compile report's occupancy bounds. The simulator runs plans for a target
too (default sm_80) and refuses launches above its limit.

``sm_count`` is the number of SMs the split-KV heuristic (fa2.py's num_kv_splits) and the deterministic
backward's dq slice count (fa2.py's num_dq_splits_for) plan for. A device's target
carries the device's own count (CuPy and JAX read multiProcessorCount); the table's counts are those of one
representative part per arch (A100 108, A40 84, Jetson AGX Orin 16, L40S 142, H100 SXM 132, B200 148, RTX 5090
170), which is what the simulator plans with, so a simulated decode splits as it would on that part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KB = 1024
DEFAULT_ARCH = "sm_80"


def arch_name(major: int, minor: int) -> str:
    """The real arch of a compute capability: (9, 0) is sm_90, (12, 0) sm_120."""
    return f"sm_{major}{minor}"


def capability_of(arch: str) -> tuple[int, int]:
    """(major, minor) of a real arch's name: sm_90a is (9, 0), sm_120 is (12, 0)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    if not arch.startswith("sm_") or not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"not a real GPU arch name: {arch!r} (expected one like 'sm_90')")
    return int(digits[:-1]), int(digits[-1])


def arch_number(arch: str) -> int:
    """The number NVRTC lists an arch by (nvrtcGetSupportedArchs): sm_90 is 90, sm_120 is 120."""
    major, minor = capability_of(arch)
    return 10 * major + minor


@dataclass(frozen=True)
class Target:
    """One real GPU architecture and its per-block and per-SM limits."""

    arch: str  # "sm_80"
    smem_per_block_bytes: int  # largest opt-in dynamic + static shared memory of one block
    smem_per_sm_bytes: int  # largest shared memory carveout of an SM
    max_warps_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int = 65536
    reserved_smem_per_block_bytes: int = 1 * KB  # the runtime keeps 1 KB per resident block
    register_alloc_unit: int = 256  # registers are given to a warp in units of 256
    sm_count: int = 108  # SMs of the device (the table: a representative part per arch, see above)

    @property
    def compute_capability(self) -> tuple[int, int]:
        return capability_of(self.arch)

    def blocks_per_sm(self, threads: int, registers: int, smem_bytes: int) -> int:
        """Resident blocks per SM of a kernel (0: it cannot launch here)."""
        if smem_bytes > self.smem_per_block_bytes or threads < 1:
            return 0
        warps = -(-threads // 32)
        per_warp = -(-registers * 32 // self.register_alloc_unit) * self.register_alloc_unit
        by_registers = self.registers_per_sm // max(per_warp * warps, 1)
        by_smem = self.smem_per_sm_bytes // (smem_bytes + self.reserved_smem_per_block_bytes)
        return max(0, min(self.max_blocks_per_sm, self.max_warps_per_sm // warps, by_registers, by_smem))


TARGETS = {
    t.arch: t
    for t in (
        Target("sm_80", 163 * KB, 164 * KB, max_warps_per_sm=64, max_blocks_per_sm=32, sm_count=108),
        Target("sm_86", 99 * KB, 100 * KB, max_warps_per_sm=48, max_blocks_per_sm=16, sm_count=84),
        Target("sm_87", 163 * KB, 164 * KB, max_warps_per_sm=48, max_blocks_per_sm=16, sm_count=16),
        Target("sm_89", 99 * KB, 100 * KB, max_warps_per_sm=48, max_blocks_per_sm=24, sm_count=142),
        Target("sm_90", 227 * KB, 228 * KB, max_warps_per_sm=64, max_blocks_per_sm=32, sm_count=132),
        Target("sm_90a", 227 * KB, 228 * KB, max_warps_per_sm=64, max_blocks_per_sm=32, sm_count=132),
        Target("sm_100", 227 * KB, 228 * KB, max_warps_per_sm=64, max_blocks_per_sm=32, sm_count=148),
        Target("sm_120", 99 * KB, 100 * KB, max_warps_per_sm=48, max_blocks_per_sm=32, sm_count=170),
    )
}


def target(arch: str) -> Target:
    """The Target of an arch name ("sm_86"); a clear error for an unknown one."""
    found = TARGETS.get(arch)
    if found is None:
        raise ValueError(f"unknown GPU arch {arch!r}; known: {', '.join(TARGETS)}")
    return found


def for_device(major: int, minor: int, smem_per_block_optin_bytes: int | None = None,
               sm_count: int | None = None) -> Target:
    """The Target of a device from its compute capability and (when the driver tells them) its opt-in
    shared memory per block, which wins over the table (plans never ask more than the device allows), and
    its SM count (the split-KV heuristic's)."""
    arch = arch_name(major, minor)
    known = TARGETS.get(arch)
    if known is None:
        # A newer GPU than this table: plan for the most conservative known limit, or the device's own.
        known = Target(arch, 99 * KB, 100 * KB, max_warps_per_sm=48, max_blocks_per_sm=16)
    if smem_per_block_optin_bytes is not None and smem_per_block_optin_bytes != known.smem_per_block_bytes:
        known = replace(known, smem_per_block_bytes=int(smem_per_block_optin_bytes))
    if sm_count is not None and int(sm_count) > 0:
        known = replace(known, sm_count=int(sm_count))
    return known
