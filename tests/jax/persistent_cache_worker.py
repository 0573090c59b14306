"""Run by test_jax_persistent_cache.py, twice, in fresh Pythons sharing one JAX persistent compilation cache.

Compiles jit(value_and_grad(loss)) through cuflash.jax.attention with the cache in argv[1] and prints one JSON
object: the cache events JAX reported while compiling that function (the first process misses and writes, the
second hits and loads the executable), and the errors of its results against the float64 reference.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

import cuflash.jax as cfj
from cuflash import reference

CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")


def main() -> None:
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda name, **kwargs: events.append(name))

    rng = np.random.default_rng(2024)
    q = rng.standard_normal((2, 11, 4, 32)).astype(np.float32)
    k = rng.standard_normal((2, 16, 2, 32)).astype(np.float32)
    v = rng.standard_normal((2, 16, 2, 32)).astype(np.float32)
    weights = rng.standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v):
        return jnp.sum(cfj.attention(q, k, v, causal=True, deterministic=True) * weights)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    events.clear()
    value, grads = step(q, k, v)
    jax.block_until_ready(grads)
    seen = {name.rsplit("/", 1)[-1]: events.count(name) for name in CACHE_EVENTS}

    out64, _ = reference.attention_reference(q, k, v, causal=True)
    truth = reference.attention_backward_reference(weights, q, k, v, causal=True)
    json.dump(
        {
            "cache_events": seen,
            "value_error": abs(float(value) - float(np.sum(out64 * weights))),
            "grad_errors": [float(np.max(np.abs(np.asarray(g) - t))) for g, t in zip(grads, truth)],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
