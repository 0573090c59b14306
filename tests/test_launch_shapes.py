"""Every kernel of the catalog traps on any launch shape but its traits' own.

The Python plans mirror each kernel's traits (its dynamic shared memory and block shape: the families'
dynamic_smem_bytes and threads); kernel_utils.cuh's launch_differs_from_traits is the kernels' side. Launching
each instance any target plans with 16 bytes more or less shared memory, half the threads, or the same threads
in two rows must end in the kernel's __trap() (not in some later fault), which holds only where the kernel's
constants equal the plan's exactly: together with every other test launching the planned shapes, this compares
the two sides for every instance.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import sim
from cuflash.kernels import catalog, targets
from cuflash.kernels.families import standard
from cuflash.kernels.params import pack_params
from cuflash.kernels.program import Problem

PLANNED_ARCHS = ("sm_80", "sm_86", "sm_90")


def _planned_instances():
    return catalog.all_instances([targets.target(arch) for arch in PLANNED_ARCHS])


def _wrong_shapes(smem: int, block: tuple[int, int, int]) -> list[tuple[int, tuple[int, int, int]]]:
    """16 bytes more (and less) shared memory; half the threads; the same threads in another block shape."""
    threads = block[0] * block[1]
    other_shape = (threads // 2, 2, 1) if block[1] == 1 else (threads, 1, 1)
    shapes = [(smem + 16, block), (smem, (threads // 2, 1, 1)), (smem, other_shape)]
    return shapes + ([(smem - 16, block)] if smem >= 16 else [])


def _planned_block(instance) -> tuple[int, int, int]:
    # The standard GEMM kernels take a 2-D block (families/standard.py); every other kernel a 1-D one.
    if instance.source == standard.SOURCE and standard._is_gemm(instance):
        return (standard.TRAITS.threads_x, standard.TRAITS.threads_y, 1)
    return (catalog.threads(instance), 1, 1)


def test_every_planned_instance_is_checked():
    names = {i.name_expr.split("<")[0] for i in _planned_instances()}
    assert {"cuflash::fa2_tc_forward_kernel", "cuflash::fa2_forward_kernel", "cuflash::fa2_split_kv_combine_kernel",
            "cuflash::fa1_gqa_reduce_kernel", "cuflash::standard_softmax_kernel"} <= names


@pytest.mark.parametrize("instance", _planned_instances(), ids=str)
def test_kernel_traps_on_any_launch_shape_but_its_own(instance):
    # Valid sizes for every instance (head dim 32 is at most every compiled one; two kv splits for the combine);
    # no buffers: the trap comes before any memory is touched, and anything else would fault differently.
    params = pack_params(Problem("float32", 1, 16, 16, 1, 1, 32), softmax_scale=1.0, pointers={}, strides={},
                         num_kv_splits=2)
    smem, block = catalog.dynamic_smem_bytes(instance), _planned_block(instance)
    for wrong_smem, wrong_block in _wrong_shapes(smem, block):
        with sim.targeting("sm_90"), pytest.raises(sim.KernelError, match=r"__trap") as error:
            sim.launch(instance, (1, 1, 1), wrong_block, wrong_smem, params, [np.zeros(1, np.float32)])
        assert instance.name_expr.split("<")[0].removeprefix("cuflash::") in str(error.value)
