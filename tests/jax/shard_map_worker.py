"""Run by test_jax_shard_map.py in a fresh Python: cuflash.jax.attention inside jax.shard_map on 4 host devices.

XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX initialises, hence the separate
process. Prints one JSON object: per case, the errors of the sharded results against the unsharded call and the
checks against the float64 reference (FlashAttention rule, jax.nn.dot_product_attention as the yardstick), and
the mesh axes the outputs vary along inside shard_map.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cuflash.jax as cfj  # noqa: E402
from cuflash import _tolerance as T  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.jax._attention import _varying_axes  # noqa: E402

# name: (batch, seqlen_q, seqlen_k, nheads, nheads_k, specs of q, k, v and out)
CASES = {
    "batch": ((4, 9, 13, 4, 2), (P("x"), P("x"), P("x"))),
    "heads": ((2, 9, 13, 8, 4), (P(None, None, "x"), P(None, None, "x"), P(None, None, "x"))),
    # MQA with the single kv head replicated: k and v are invariant inputs, their gradients need a psum.
    "heads_replicated_kv": ((2, 9, 13, 8, 1), (P(None, None, "x"), P(), P())),
}


def run_case(mesh, shapes, specs, seed):
    batch, sq, sk, nheads, nheads_k = shapes
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, sq, nheads, 32)).astype(np.float32)
    k = rng.standard_normal((batch, sk, nheads_k, 32)).astype(np.float32)
    v = rng.standard_normal((batch, sk, nheads_k, 32)).astype(np.float32)
    weights = rng.standard_normal(q.shape).astype(np.float32)
    out_spec = specs[0]
    lse_spec = P(out_spec[0] if len(out_spec) > 0 else None, out_spec[2] if len(out_spec) > 2 else None)
    seen_axes = {}

    def local(q, k, v):
        out, lse = cfj.attention(q, k, v, causal=True, return_lse=True)
        seen_axes["out"] = sorted(map(str, _varying_axes(out)))
        seen_axes["lse"] = sorted(map(str, _varying_axes(lse)))
        return out, lse

    # check_vma is left at its default (True).
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(out_spec, lse_spec))
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k, v), specs)]
    out, lse = jax.jit(sharded)(*placed)
    out_plain, lse_plain = jax.jit(lambda q, k, v: cfj.attention(q, k, v, causal=True, return_lse=True))(q, k, v)

    def loss(q, k, v):
        out, _ = sharded(q, k, v)
        return jnp.sum(out * weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*placed)
    grads_plain = jax.jit(jax.grad(lambda q, k, v: jnp.sum(cfj.attention(q, k, v, causal=True) * weights),
                                   argnums=(0, 1, 2)))(q, k, v)

    mask = (np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq)[None, None]
    yard_loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=mask) * weights)
    yardstick = jax.jit(jax.grad(yard_loss, argnums=(0, 1, 2)))(q, k, v)
    out_yardstick = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask))(q, k, v)
    out64, _ = reference.attention_reference(q, k, v, causal=True)
    truth = reference.attention_backward_reference(weights, q, k, v, causal=True)

    result = {
        "varying_axes": seen_axes,
        "out_vs_unsharded": float(np.max(np.abs(np.asarray(out) - np.asarray(out_plain)))),
        "lse_vs_unsharded": float(np.max(np.abs(np.asarray(lse) - np.asarray(lse_plain)))),
        "grads_vs_unsharded": [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(grads, grads_plain)],
        "out_sharding": str(out.sharding.spec),
        "checks": {},
    }
    checks = [("out", out, out64, out_yardstick, T.FORWARD_FACTOR, 0.0)]
    checks += [(n, g, t, y, T.BACKWARD_FACTOR, 1e-5) for n, g, t, y in zip(("dq", "dk", "dv"), grads, truth, yardstick)]
    for name, actual, exact, yard, factor, atol in checks:
        try:
            measured = T.check_close(name, np.asarray(actual), exact, np.asarray(yard), factor, atol=atol)
            result["checks"][name] = {"ok": True, "max_error": measured.max_error, "bound": measured.bound}
        except AssertionError as err:
            result["checks"][name] = {"ok": False, "message": str(err)}
    return result


def main() -> None:
    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("x",))
    results = {name: run_case(mesh, shapes, specs, seed) for seed, (name, (shapes, specs)) in enumerate(CASES.items())}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
