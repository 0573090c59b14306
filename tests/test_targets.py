"""Plans per target: the simulator stands in for a chosen GPU, refuses launches above its shared memory per
block, and the 99 KB tile rows (sm_86, sm_89, sm_120) compute the same attention."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
import cuflash.sim as sim
from cuflash._tolerance import BACKWARD_FACTOR, FORWARD_FACTOR, backward_references, check_close, forward_references
from cuflash.kernels import catalog, plans, targets
from cuflash.kernels.program import Problem
from cuflash.testing import random_inputs


def test_the_simulator_stands_in_for_sm_80_by_default_and_for_what_it_is_told(monkeypatch):
    monkeypatch.delenv("CUFLASH_SIM_TARGET", raising=False)
    assert sim.current_target().arch == "sm_80"
    with sim.targeting("sm_86") as chosen:
        assert chosen.smem_per_block_bytes == 99 * 1024 and sim.current_target() is chosen
    assert sim.current_target().arch == "sm_80"
    monkeypatch.setenv("CUFLASH_SIM_TARGET", "sm_90")
    assert sim.current_target().smem_per_block_bytes == 227 * 1024
    with pytest.raises(ValueError, match="unknown GPU arch"):
        with sim.targeting("sm_42"):
            pass


def test_the_simulator_refuses_a_launch_above_its_targets_shared_memory():
    problem = Problem("float32", 1, 8, 8, 1, 1, 256)
    (plan,) = plans.forward_program("fa2", problem, targets.target("sm_80")).launches
    assert plan.dynamic_smem_bytes > 99 * 1024  # the sm_80 tile of head dim 256
    q, k, v = (np.zeros((1, 8, 1, 256), np.float32) for _ in range(3))
    with sim.targeting("sm_86"), pytest.raises(sim.KernelError) as caught:
        sim.launch(plan.kernel, plan.grid, plan.block, plan.dynamic_smem_bytes, b"", [q, k, v])
    message = str(caught.value)
    assert plan.kernel.name_expr in message and str(plan.dynamic_smem_bytes) in message
    assert str(99 * 1024) in message and "sm_86" in message


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"])
def test_every_plan_fits_its_target(arch):
    target = targets.target(arch)
    for instance in catalog.instances(target):
        assert catalog.dynamic_smem_bytes(instance) <= target.smem_per_block_bytes, instance


# Head dims whose 99 KB rows differ from the 163 KB ones: fa2 tensor cores (16-bit) forward 128/256, backward 256;
# fa2 SIMT (float32) forward 192/256, backward 128/192/256; every fa1 row.
@pytest.mark.parametrize("algorithm, headdim, dtype, causal", [
    ("fa2", 120, "float16", True),
    ("fa2", 256, "float32", False),
    ("fa2", 250, "bfloat16", False),
    ("fa1", 64, "float16", True),
    ("fa1", 200, "float32", False),
])
def test_99_kb_plans_match_the_reference(algorithm, headdim, dtype, causal):
    q, k, v, dout = random_inputs((1, 37, 45, 2, 1, headdim), dtype, seed=headdim)
    with sim.targeting("sm_86"), sim.record() as rec:
        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm)
    assert max(r.dynamic_smem_bytes for r in rec.launches) <= 99 * 1024
    sm86_kernels = {r.kernel for r in rec.launches}
    sm80 = {i.name_expr for i in catalog.instances(targets.target("sm_80"))}
    assert sm86_kernels - sm80, "the 99 KB plan should use a tile the 163 KB plan does not"
    ref = forward_references(q, k, v, causal=causal)
    check_close("out", out, ref.out, ref.out_lowp, FORWARD_FACTOR)
    bref = backward_references(dout, q, k, v, causal=causal)
    for name, got in zip(("dq", "dk", "dv"), grads):
        check_close(name, got, getattr(bref, name), getattr(bref, name + "_lowp"), BACKWARD_FACTOR,
                    atol=1e-5 if causal else 0.0)
