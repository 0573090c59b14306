"""Run by test_jax_subprocesses.py in fresh Pythons: ``export PATH`` exports a jitted cuflash.jax function (forward
and grad) with jax.export and writes the serialized blob and the expected results; ``call PATH`` deserializes it in
a process that never lowered cuflash and runs it. Prints JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import jax  # noqa: E402

import cuflash.jax as cfj  # noqa: E402


def inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 19, 4, 40)).astype(np.float32)
    k = rng.standard_normal((2, 23, 2, 40)).astype(np.float32)
    return q, k, k * 0.5


def function(q, k, v):
    out = cfj.attention(q, k, v, causal=True, softcap=5.0)
    grads = jax.grad(lambda q, k, v: (cfj.attention(q, k, v, causal=True, softcap=5.0) ** 2).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    return (out, *grads)


def main() -> None:
    mode, path = sys.argv[1], Path(sys.argv[2])
    q, k, v = inputs()
    if mode == "export":
        checks = [jax.export.DisabledSafetyCheck.custom_call("cuflash_program")]
        exported = jax.export.export(jax.jit(function), disabled_checks=checks)(q, k, v)
        path.write_bytes(exported.serialize())
        expected = [np.asarray(x) for x in jax.jit(function)(q, k, v)]
        np.savez(path.with_suffix(".npz"), *expected)
        print(json.dumps({"custom_calls": exported.mlir_module().count("custom_call @cuflash_program(")}))
        return
    results = jax.export.deserialize(path.read_bytes()).call(q, k, v)
    expected = np.load(path.with_suffix(".npz"))
    print(json.dumps({"bitwise": [bool(np.array_equal(np.asarray(a), expected[f"arr_{i}"]))
                                  for i, a in enumerate(results)]}))


if __name__ == "__main__":
    main()
