"""Run by test_jax_subprocesses.py in a fresh Python: cuflash.jax.ring_attention inside jax.shard_map with the
sequence sharded over N host devices (N from argv). Prints one JSON object: per case, the largest differences of
out, lse and the gradients from one unsharded cuflash.jax.attention call (with dropout: the same key, and whether
the unsharded call dropped anything), and the forward launches recorded."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cuflash.jax as cfj  # noqa: E402
from cuflash.jax._ffi import record_launches  # noqa: E402

# name: (batch, seqlen_q, seqlen_k, nheads, nheads_k, causal, layout, dropout_p)
CASES = {
    "causal-gqa": (2, 16 * DEVICES, 16 * DEVICES, 4, 2, True, "contiguous", 0.0),
    "causal-mqa-zigzag": (1, 6 * DEVICES, 6 * DEVICES, 3, 1, True, "zigzag", 0.0),
    "full-longer-keys": (2, 5 * DEVICES, 9 * DEVICES, 2, 2, False, "contiguous", 0.0),
    # Dropout: chunks of 16 query rows (causal) and 16 query / 10 key rows per device (not causal).
    "causal-gqa-dropout-zigzag": (1, 32 * DEVICES, 32 * DEVICES, 4, 2, True, "zigzag", 0.25),
    "full-mqa-dropout": (1, 16 * DEVICES, 10 * DEVICES, 2, 1, False, "contiguous", 0.3),
}


def zigzag(x, n):
    """The zig-zag order of a (batch, seq, ...) array's 2n chunks: device j's shard is chunks j, 2n-1-j."""
    chunks = np.split(x, 2 * n, axis=1)
    return np.concatenate([c for j in range(n) for c in (chunks[j], chunks[2 * n - 1 - j])], axis=1)


def run_case(mesh, shape, causal, layout, dropout_p, seed):
    batch, sq, sk, nheads, nheads_k = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, sq, nheads, 32)).astype(np.float32)
    k = rng.standard_normal((batch, sk, nheads_k, 32)).astype(np.float32)
    v = rng.standard_normal((batch, sk, nheads_k, 32)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal((batch, nheads, sq)).astype(np.float32)

    dropout = dict(dropout_p=dropout_p, dropout_rng=jax.random.key(seed)) if dropout_p else {}

    def plain(q, k, v):
        return cfj.attention(q, k, v, causal=causal, return_lse=True, **dropout)

    def ring(q, k, v):
        return cfj.ring_attention(q, k, v, axis_name="seq", causal=causal, layout=layout, return_lse=True, **dropout)

    spec, lse_spec = P(None, "seq"), P(None, None, "seq")
    sharded = jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, lse_spec))

    def step(f):
        def run(q, k, v, dout, dlse):
            (out, lse), pull = jax.vjp(f, q, k, v)
            return (out, lse, *pull((dout, dlse)))
        return jax.jit(run)

    arrays = (q, k, v, dout)
    if layout == "zigzag":  # the caller holds zig-zag shards: feed them and map the results back
        arrays = tuple(zigzag(x, DEVICES) for x in arrays)
        dlse_in = np.swapaxes(zigzag(np.swapaxes(dlse, 1, 2), DEVICES), 1, 2)
    else:
        dlse_in = dlse
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]
    placed.append(jax.device_put(dlse_in, NamedSharding(mesh, lse_spec)))
    with record_launches() as launches:
        got = [np.asarray(x) for x in step(sharded)(*placed)]
    if layout == "zigzag":
        order = zigzag(np.arange(sq)[None, :, None], DEVICES)[0, :, 0]
        inverse = np.argsort(order)
        got[0], got[2] = got[0][:, inverse], got[2][:, inverse]  # out, dq
        got[1] = got[1][:, :, inverse]  # lse
        korder = np.argsort(zigzag(np.arange(sk)[None, :, None], DEVICES)[0, :, 0])
        got[3], got[4] = got[3][:, korder], got[4][:, korder]  # dk, dv
    want = [np.asarray(x) for x in step(plain)(q, k, v, dout, dlse)]
    forward = [r for r in launches if "forward" in r.kernel]
    undropped = np.asarray(cfj.attention(q, k, v, causal=causal))
    return {
        "dropped": bool(not np.allclose(want[0], undropped, atol=1e-3)),
        "differences": [float(np.max(np.abs(a - b))) for a, b in zip(got, want)],
        "scale": [float(np.max(np.abs(b))) for b in want],
        "forward_launches": len(forward),
        "forward_query_blocks": sorted({r.grid[0] for r in forward}),
    }


def main() -> None:
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("seq",))
    results = {name: run_case(mesh, shape[:5], *shape[5:], seed)
               for seed, (name, shape) in enumerate(CASES.items())}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
