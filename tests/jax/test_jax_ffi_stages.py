"""The handlers' XLA FFI stages: instantiate once per compiled call, execute per run.

instantiate decodes and checks the attributes and resolves every kernel (program_call.h, DecodeProgramPlan);
execute binds this run's buffers and launches (BindProgramBuffers). The CPU handler has the same two stages as
the CUDA one and shares that code, so the tests without a mark exercise the staging here on JAX's CPU platform.
Tests marked gpu run the CUDA handler inside XLA's command buffers (CUDA graphs); run as a script, this file is
their worker (it needs XLA_FLAGS set before JAX starts, so a fresh Python).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402
from cuflash.jax import _ffi, _primitives  # noqa: E402
from cuflash.kernels.program import Problem  # noqa: E402

TARGET = f'custom_call_target="{_ffi.TARGET_NAME}"'
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def custom_calls(compiled) -> int:
    return compiled.as_text().count(TARGET)


def qkv(seed: int, b: int, s: int, h: int, d: int, dtype=np.float32):
    """Each test uses shapes of its own, so no executable another test compiled is reused from JAX's caches."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(3))


def loss(q, k, v):
    return (cfj.attention(q, k, v, causal=True).astype(jnp.float32) ** 2).sum()


def forward_kernel_names(q, k) -> list[str]:
    problem = Problem("float32", q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])
    program = _primitives.program_for("forward", _primitives.CallConfig("fa2", problem, 0.5))
    return list(dict.fromkeys(plan.kernel.name_expr for plan in program.launches if not plan.is_empty))


def forget_sim_kernels(names) -> None:
    for name in names:
        _ffi.unregister_sim_kernel(name)
    _primitives._sim_registered.clear()


def test_instantiate_runs_once_per_compiled_call_not_per_execution():
    q, k, v = qkv(1, 1, 13, 2, 24)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    before = _ffi.instantiations("cpu")
    compiled = step.lower(q, k, v).compile()
    assert custom_calls(compiled) == 2  # the forward and the backward
    assert _ffi.instantiations("cpu") == before + 2

    first = jax.block_until_ready(compiled(q, k, v))
    for _ in range(3):
        again = jax.block_until_ready(compiled(q, k, v))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert _ffi.instantiations("cpu") == before + 2

    # Another shape is another executable, instantiated on its own.
    q2, k2, v2 = qkv(2, 1, 14, 2, 24)
    jax.block_until_ready(step(q2, k2, v2))
    assert _ffi.instantiations("cpu") == before + 4
    # The CUDA handler's counters (the command-buffer test's evidence on a GPU) are there, and untouched by CPU runs.
    assert _ffi.instantiations("CUDA") == 0 and _ffi.captured_executions() == 0


def test_kernels_are_resolved_when_the_call_is_instantiated():
    """Lowering registers the kernels; forget them before compiling and the instantiate stage asks the resolver
    for them while XLA builds the executable, before anything runs: how a deserialized executable finds its
    kernels."""
    q, k, v = qkv(3, 1, 15, 1, 32)
    lowered = jax.jit(lambda q, k, v: cfj.attention(q, k, v)).lower(q, k, v)
    names = forward_kernel_names(q, k)
    forget_sim_kernels(names)
    assert not any(_ffi.sim_kernel_registered(name) for name in names)

    compiled = lowered.compile()
    assert all(_ffi.sim_kernel_registered(name) for name in names)
    np.testing.assert_allclose(np.asarray(compiled(q, k, v)), cuflash.attention(q, k, v), rtol=1e-6)


def test_execution_follows_a_registry_change_without_instantiating_again():
    """A kernel replaced or removed after instantiation (what cuflash.sim.checking() does to every kernel) is
    resolved again by the next execution; the executable's state stays, and so does the instantiation count."""
    q, k, v = qkv(4, 1, 16, 1, 32)
    compiled = jax.jit(lambda q, k, v: cfj.attention(q, k, v)).lower(q, k, v).compile()
    want = np.asarray(compiled(q, k, v))
    names = forward_kernel_names(q, k)
    instantiated = _ffi.instantiations("cpu")

    forget_sim_kernels(names)
    assert np.array_equal(np.asarray(compiled(q, k, v)), want)
    assert all(_ffi.sim_kernel_registered(name) for name in names)

    forget_sim_kernels(names)
    _ffi.set_resolver(lambda name_expr, target: False)
    try:
        # JAX raises an execution error of a jitted call with the C++ fast path as ValueError.
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                           match=re.escape(f"no simulator kernel registered for {names[0]}")):
            jax.block_until_ready(compiled(q, k, v))
    finally:
        _ffi.set_resolver(_primitives.resolve_kernel)
    assert np.array_equal(np.asarray(compiled(q, k, v)), want)
    assert _ffi.instantiations("cpu") == instantiated


def raw_forward(q, k, v, softmax_scale=0.5, **overrides):
    """jit of the forward custom call with hand-made attributes, reaching the handler's checks directly (the kernel
    the plans pick for q's dtype on the current target: under sim.targeting("sm_90") 16-bit q gets the Hopper one)."""
    problem = Problem(np.dtype(q.dtype).name, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])
    config = _primitives.CallConfig("fa2", problem, softmax_scale)
    program = _primitives.program_for("forward", config)
    launches = [plan for plan in program.launches if not plan.is_empty]
    _ffi.register_targets()
    _primitives.register_cpu_kernels([plan.kernel for plan in launches])
    attributes = _primitives.custom_call_attributes("forward", config, program, launches)
    attributes.update(overrides)
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((problem.batch, problem.nheads, problem.seqlen_q), np.float32)]
    results += [jax.ShapeDtypeStruct(scratch.shape, np.float32) for scratch in program.scratch]
    return jax.jit(lambda q, k, v: jax.ffi.ffi_call(_ffi.TARGET_NAME, results)(q, k, v, **attributes))


def test_attribute_errors_fail_the_compilation_and_buffer_errors_the_execution():
    """What the attributes alone decide is checked once, by instantiate, so the compilation fails with the
    handler's message and no state is made; what needs this run's buffers is checked by execute."""
    q, k, v = qkv(5, 1, 17, 2, 32)
    instantiated = _ffi.instantiations("cpu")
    compile_errors = {
        "this call was lowered by cuflash 0.0.0-another": dict(version="0.0.0-another"),
        "no simulator kernel registered for cuflash::not_a_kernel<float>": dict(kernels="cuflash::not_a_kernel<float>"),
        "binding 'nonsense' is not an AttentionParams pointer field": dict(bindings="q,k,nonsense,out,lse"),
        "has a grid or block dimension <= 0": dict(grid=np.zeros(3, np.int32)),
        "params attribute has 8 bytes": dict(params=np.zeros(8, np.uint8)),
    }
    for words, override in compile_errors.items():
        lowered = raw_forward(q, k, v, **override).lower(q, k, v)
        with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(words)):
            lowered.compile()
    assert _ffi.instantiations("cpu") == instantiated

    # Operand and result counts are not known to instantiate on XLA's CPU runtime: a mismatch compiles and then
    # fails when the buffers are bound.
    compiled = raw_forward(q, k, v, bindings="q,k,v,out").lower(q, k, v).compile()
    assert _ffi.instantiations("cpu") == instantiated + 1
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                       match=re.escape("bindings name 4 buffers but the call has 3")):
        jax.block_until_ready(compiled(q, k, v))

    good = raw_forward(q, k, v).lower(q, k, v).compile()
    np.testing.assert_allclose(np.asarray(good(q, k, v)[0]), cuflash.attention(q, k, v, softmax_scale=0.5),
                               rtol=1e-6)


def test_only_the_cuda_handler_reports_itself_command_buffer_compatible():
    """The traits XLA reads from each execute handler when registering it, by the same metadata query."""
    assert _ffi.execute_handler_traits("cpu") & _ffi.COMMAND_BUFFER_COMPATIBLE == 0
    if not _ffi.has_cuda_handler():
        pytest.skip("the handler library was built without cuda.h (nvidia-cuda-runtime)")
    assert _ffi.execute_handler_traits("CUDA") & _ffi.COMMAND_BUFFER_COMPATIBLE


# ---------------------------------------------------------------------------
# On a GPU: the CUDA handler inside XLA's command buffers.

COMMAND_BUFFERS_ON = "--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="
EXECUTIONS = 4


def run_command_buffer_worker(xla_flags: str, out: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run([sys.executable, __file__, "command-buffer-worker", str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_command_buffers_record_the_custom_calls_with_results_bitwise_those_without(tmp_path):
    """A jitted forward and backward with command buffers taking custom calls: XLA records both cuflash calls into
    a command buffer (stream capture; it leaves out custom calls whose handler lacks the trait), each is
    instantiated once however often the graph is replayed, and every execution's results are bitwise those of the
    same function run without command buffers (deterministic backward). XLA up to JAX 0.10 outlined the recorded
    calls into command_buffer computations of the compiled HLO; JAX 0.11.2 converts after the HLO (an H200 run
    showed both calls in main), so the handler's count of executions under capture is what shows the recording."""
    graph = run_command_buffer_worker(COMMAND_BUFFERS_ON, tmp_path / "graph.npz")
    plain = run_command_buffer_worker(COMMAND_BUFFERS_OFF, tmp_path / "plain.npz")
    assert graph["custom_calls"] == plain["custom_calls"] == 2
    assert graph["captured_executions"] >= 2 or graph["in_command_buffers"] == 2, graph
    assert plain["captured_executions"] == 0 and plain["in_command_buffers"] == 0, plain
    for run in (graph, plain):
        assert run["instantiations_after_compile"] == run["custom_calls"], run
        assert run["instantiations_after_executions"] == run["custom_calls"], run
        assert run["executions_bitwise_equal"], run
    with np.load(tmp_path / "graph.npz") as with_graphs, np.load(tmp_path / "plain.npz") as without:
        assert sorted(with_graphs.files) == sorted(without.files)
        for name in with_graphs.files:
            assert np.array_equal(with_graphs[name], without[name]), name


def computations_calling_cuflash(hlo: str) -> dict[str, int]:
    """The custom calls to cuflash in each computation of the HLO text, by computation name (what a failure of
    the test below prints: where XLA put them)."""
    counts, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header:
            name = header.group(1)
        elif line.startswith("}"):
            name = None
        elif name is not None and TARGET in line:
            counts[name] = counts.get(name, 0) + line.count(TARGET)
    return counts


def custom_calls_in_command_buffers(hlo: str) -> int:
    """Custom calls to cuflash inside the computations XLA's command-buffer scheduling outlined (named
    command_buffer, command_buffer.1, ...)."""
    return sum(n for name, n in computations_calling_cuflash(hlo).items() if name.startswith("command_buffer"))


def command_buffer_worker(out: Path) -> None:
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 4, 64)), jnp.bfloat16) for _ in range(3))

    def forward_and_backward(q, k, v):
        # The output is its own cotangent: no XLA reduction (whose atomics could reorder sums between runs)
        # stands between the two custom calls and the results, and the backward is the deterministic one.
        out, vjp = jax.vjp(lambda q, k, v: cfj.attention(q, k, v, causal=True, deterministic=True), q, k, v)
        return (out, *vjp(out))

    lowered = jax.jit(forward_and_backward).lower(q, k, v)
    before = _ffi.instantiations("CUDA")
    compiled = lowered.compile()
    after_compile = _ffi.instantiations("CUDA") - before
    runs = [jax.tree.leaves(jax.block_until_ready(compiled(q, k, v))) for _ in range(EXECUTIONS)]
    after_executions = _ffi.instantiations("CUDA") - before
    first = [np.asarray(x.astype(jnp.float32)) for x in runs[0]]
    bitwise = all(np.array_equal(np.asarray(x.astype(jnp.float32)), f) for run in runs[1:] for x, f in zip(run, first))
    np.savez(out, **{f"result_{i}": x for i, x in enumerate(first)})
    hlo = compiled.as_text()
    out.with_suffix(".hlo.txt").write_text(hlo)  # beside the results, for reading after a failure
    print(json.dumps({
        "custom_calls": hlo.count(TARGET),
        "in_command_buffers": custom_calls_in_command_buffers(hlo),
        "captured_executions": _ffi.captured_executions(),
        "computations": computations_calling_cuflash(hlo),
        "instantiations_after_compile": after_compile,
        "instantiations_after_executions": after_executions,
        "executions_bitwise_equal": bitwise,
    }))


if __name__ == "__main__":
    if sys.argv[1:2] == ["command-buffer-worker"]:
        command_buffer_worker(Path(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} command-buffer-worker OUT.npz")
