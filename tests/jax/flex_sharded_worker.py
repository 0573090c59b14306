"""Run by test_jax_flex.py in a fresh Python: cuflash.jax.flex_attention under plain jax.jit on 4 host devices with
q, k, v sharded along batch or heads. Prints one JSON object: per case, the largest difference of out and of the
gradients (q, k, v and the captured table) from the unsharded call, and the results' shardings.

Flex calls are not partitioned yet: XLA gathers their operands and runs each call whole, so the results equal the
unsharded ones (the gradients up to the order of float32 atomics)."""

from __future__ import annotations

import json
import os

import numpy as np

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cuflash.jax as cfj  # noqa: E402
from cuflash.testing import random_inputs  # noqa: E402

B, L, H, D = 4, 16, 4, 16
q, k, v, dout = (jnp.asarray(x) for x in random_inputs((B, L, L, H, H, D), "float32", seed=3))
table = jnp.asarray(np.random.default_rng(3).standard_normal((H, 2 * L)).astype(np.float32))
doc = jnp.asarray(np.arange(L, dtype=np.int32) // 5)


def step(q, k, v, table):
    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L]

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def loss(q, k, v, table):
        return jnp.sum(cfj.flex_attention(q, k, v, score_mod=bias, mask_mod=same_document) * dout)

    out = cfj.flex_attention(q, k, v, score_mod=bias, mask_mod=same_document)
    return out, jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, table)


want = jax.jit(step)(q, k, v, table)
mesh = jax.make_mesh((4,), ("x",))
results = {}
for name, spec in (("batch", P("x")), ("heads", P(None, None, "x"))):
    sharding = NamedSharding(mesh, spec)
    args = [jax.device_put(x, sharding) for x in (q, k, v)] + [table]
    out, grads = jax.jit(step)(*args)
    results[name] = {
        "out": float(jnp.abs(out - want[0]).max()),
        "grads": [float(jnp.abs(g - w).max()) for g, w in zip(grads, want[1])],
        "out_sharding": str(out.sharding.spec),
    }
print(json.dumps(results))
