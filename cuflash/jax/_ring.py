"""``cuflash.jax.ring_attention``: attention over a sequence sharded along a mesh axis, inside ``jax.shard_map``.

Each device holds a shard of the queries and of the keys/values. K/V blocks travel around the ring (``ppermute``
to the next device) while each device attends its queries to the block it holds; the partial results merge by
their log-sum-exp (out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s), the same merge a split-KV
FlashAttention does. The ppermute of the next block is issued before the local call, so XLA may overlap them.

Causal: the sequence is cut into 2n chunks (n devices) and device i works on chunks i and 2n-1-i (zig-zag), so
every device does the same work: at the first step its two chunks against its own (causal, full, causal), at
every other step two chunk pairs (both query chunks against the arriving block's first chunk, or the second
query chunk against both of its chunks), the rest being above the diagonal. Contiguous shards (what a
sequence-sharded PartitionSpec gives) are reordered to zig-zag inside and back on the way out, two ppermutes
each way; ``layout="zigzag"`` skips that for callers whose shards are already in that order.

Backward: JAX's autodiff of the ring: each step's call is differentiable (out and lse, through cuflash's
backward kernels), and the cotangents of the travelling K/V blocks travel back through the transposed ppermutes,
so dK and dV return to the devices that own the blocks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._attention import attention


def _merge(out, lse, part_out, part_lse):
    """Two partial attentions over disjoint key sets merged by their lse (-inf: that part saw no key)."""
    new = jnp.logaddexp(lse, part_lse)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)

    def weight(l):
        return jnp.swapaxes(jnp.exp(l - safe), 1, 2)[..., None]  # (batch, nheads, rows) -> (batch, rows, nheads, 1)

    merged = out.astype(jnp.float32) * weight(lse) + part_out.astype(jnp.float32) * weight(part_lse)
    return merged, new


def _empty(q):
    batch, rows, nheads, _ = q.shape
    return jnp.zeros(q.shape, jnp.float32), jnp.full((batch, nheads, rows), -jnp.inf, jnp.float32)


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis_name: str,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
) -> Any:
    """Attention of a sequence sharded along mesh axis ``axis_name``; call inside ``jax.shard_map``.

    q: (batch, seqlen_q / n, nheads, headdim) and k, v: (batch, seqlen_k / n, nheads_k, headdim), the local shards
    of a sequence split over the n devices of ``axis_name`` (GQA/MQA as in ``attention``). ``layout``:
    "contiguous" (device i holds rows i L .. (i + 1) L - 1, what a sequence-sharded PartitionSpec gives) or
    "zigzag" (already reordered: device i holds chunks i and 2n-1-i of 2n). ``causal`` needs seqlen_q == seqlen_k
    and an even local length (two chunks per device). Returns the local shard of out (and of lse, (batch, nheads,
    local rows) float32), in q's layout. Differentiable; batch and heads may be sharded along other axes as usual.
    """
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    n = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def shifted(x):
        return jax.lax.ppermute(x, axis_name, ring)

    def call(q, k, v, causal=False):
        return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)

    if not causal:
        out, lse = _empty(q)
        for step in range(n):
            if step + 1 < n:
                k_next, v_next = shifted(k), shifted(v)  # issued before the local call: may overlap it
            out, lse = _merge(out, lse, *call(q, k, v))
            if step + 1 < n:
                k, v = k_next, v_next
        return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)

    if q.shape[1] != k.shape[1] or q.shape[1] % 2:
        raise ValueError(f"causal ring attention needs seqlen_q == seqlen_k and an even local length (two chunks per "
                         f"device), got local q {q.shape[1]} and k {k.shape[1]} rows")
    if layout == "contiguous":
        q, k, v = (_to_zigzag(x, axis_name, n, index) for x in (q, k, v))
    chunk = q.shape[1] // 2
    q_first, q_second = q[:, :chunk], q[:, chunk:]

    # Step 0: own chunks (i, 2n-1-i) against themselves: causal on the diagonal, the second query chunk sees the
    # whole first key chunk, the first query chunk nothing of the second key chunk.
    out_first, lse_first = call(q_first, k[:, :chunk], v[:, :chunk], causal=True)
    out_second, lse_second = _merge(*_as_f32(call(q_second, k[:, chunk:], v[:, chunk:], causal=True)),
                                    *call(q_second, k[:, :chunk], v[:, :chunk]))
    out = jnp.concatenate([out_first.astype(jnp.float32), out_second], axis=1)
    lse = jnp.concatenate([lse_first, lse_second], axis=2)

    for step in range(1, n):
        k, v = shifted(k), shifted(v)
        source = (index - step) % n  # the device whose block arrived: it holds chunks source, 2n-1-source

        def earlier(k, v):  # source < index: all queries see the block's first chunk, none its second
            return call(q, k[:, :chunk], v[:, :chunk])

        def later(k, v):  # source > index: only the second query chunk sees the block, all of it
            part_out, part_lse = call(q_second, k, v)
            none_out, none_lse = _empty(q_first)
            return (jnp.concatenate([none_out.astype(q.dtype), part_out], axis=1),
                    jnp.concatenate([none_lse, part_lse], axis=2))

        out, lse = _merge(out, lse, *jax.lax.cond(source < index, earlier, later, k, v))

    out = out.astype(q.dtype)
    if layout == "contiguous":
        out = _from_zigzag(out, axis_name, n, index)
        lse = jnp.swapaxes(_from_zigzag(jnp.swapaxes(lse, 1, 2), axis_name, n, index), 1, 2)
    return (out, lse) if return_lse else out


def _as_f32(pair):
    out, lse = pair
    return out.astype(jnp.float32), lse


def _zigzag_home(chunk: int, n: int) -> int:
    """The device that holds chunk ``chunk`` of 2n in the zig-zag layout: chunk c < n on device c, the others on
    device 2n-1-c."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _to_zigzag(x, axis_name, n, index):
    """Contiguous shards (device i: chunks 2i, 2i+1) to zig-zag ones (device j: chunks j, 2n-1-j). Chunks 2i go
    by one ppermute, chunks 2i+1 by another (each is a permutation); device j's chunk j came by the first when j
    is even."""
    half = x.shape[1] // 2
    even = jax.lax.ppermute(x[:, :half], axis_name, [(i, _zigzag_home(2 * i, n)) for i in range(n)])
    odd = jax.lax.ppermute(x[:, half:], axis_name, [(i, _zigzag_home(2 * i + 1, n)) for i in range(n)])
    first, second = (jnp.where(index % 2 == 0, a, b) for a, b in ((even, odd), (odd, even)))
    return jnp.concatenate([first, second], axis=1)


def _from_zigzag(x, axis_name, n, index):
    """The inverse of _to_zigzag."""
    half = x.shape[1] // 2
    first, second = x[:, :half], x[:, half:]
    even, odd = (jnp.where(index % 2 == 0, a, b) for a, b in ((first, second), (second, first)))
    back_even = jax.lax.ppermute(even, axis_name, [(_zigzag_home(2 * i, n), i) for i in range(n)])
    back_odd = jax.lax.ppermute(odd, axis_name, [(_zigzag_home(2 * i + 1, n), i) for i in range(n)])
    return jnp.concatenate([back_even, back_odd], axis=1)
