"""Ring attention (``cuflash.jax.ring_attention`` and the sharding rule's sequence split): attention over a
sequence sharded along a mesh axis, run inside ``jax.shard_map`` or a custom_partitioning lowering.

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

Dropout (``per_chunk``): every call gets the global index of its first query row and first key (``positions``),
which dropout's keep mask needs (dropout.cuh); calls whose query or key rows are not contiguous in the sequence (a
zig-zag device's two chunks) are then made per chunk.

Backward: JAX's autodiff of the ring: each step's call is differentiable (out and lse, through cuflash's
backward kernels), and the cotangents of the travelling K/V blocks travel back through the transposed ppermutes,
so dK and dV return to the devices that own the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _merge(out, lse, part_out, part_lse):
    """Two partial attentions over disjoint key sets merged by their lse (-inf: that part saw no key)."""
    new = jnp.logaddexp(lse, part_lse)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)

    def weight(l):
        return jnp.swapaxes(jnp.exp(l - safe), 1, 2)[..., None]  # (batch, nheads, rows) -> (batch, rows, nheads, 1)

    merged = out.astype(jnp.float32) * weight(lse) + part_out.astype(jnp.float32) * weight(part_lse)
    return merged, new


def _empty(q, v):
    """The merge's start for q's rows: out 0 (with v's head dim) and lse -inf."""
    batch, rows, nheads, _ = q.shape
    return (jnp.zeros((batch, rows, nheads, v.shape[-1]), jnp.float32),
            jnp.full((batch, nheads, rows), -jnp.inf, jnp.float32))


def check_ring(q_rows: int, k_rows: int, causal: bool, layout: str) -> None:
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    if causal and (q_rows != k_rows or q_rows % 2):
        raise ValueError(f"causal ring attention needs seqlen_q == seqlen_k and an even local length (two chunks per "
                         f"device), got local q {q_rows} and k {k_rows} rows")


def ring_dropout_misalignment(q_rows: int, k_rows: int, causal: bool) -> str | None:
    """Why ring blocks of these local lengths cannot take dropout, or None. Dropout's Philox counters pair rows
    i, i + 8 and keys j, j + 1 (dropout.cuh): a block call's first global query row must be a multiple of 16 and
    its first key even."""
    rows = q_rows // 2 if causal else q_rows
    keys = k_rows // 2 if causal else k_rows
    if rows % 16 == 0 and keys % 2 == 0:
        return None
    what = "chunks (half the local length)" if causal else "lengths"
    return (f"ring attention with dropout needs local query {what} that are multiples of 16 and even key {what}, "
            f"got {rows} query and {keys} key rows")


def check_ring_dropout(q_rows: int, k_rows: int, causal: bool) -> None:
    problem = ring_dropout_misalignment(q_rows, k_rows, causal)
    if problem is not None:
        raise ValueError(problem)


def with_block_positions(seed, positions):
    """A dropout seed buffer (float32-typed words, cuflash.dropout.seed_words' layout) with words 4 and 5 set to a
    block call's first global query row and first key (traced ints)."""
    words = jax.lax.bitcast_convert_type(seed, jnp.uint32)
    words = words.at[4:6].set(jnp.stack([jnp.asarray(x) for x in positions]).astype(jnp.uint32))
    return jax.lax.bitcast_convert_type(words, jnp.float32)


def ring_forward(q, k, v, forward, *, axis_name: str, causal: bool, layout: str = "contiguous",
                 per_chunk: bool = False):
    """(out, lse) of the local queries against the whole ring's keys. ``forward(q, k, v, causal, positions)`` ->
    (out, lse) is one local call (public and differentiable for ring_attention, the primitive for the sharding
    rule); positions: the global index of its first query row and first key (traced). ``per_chunk``: every call's
    query rows and keys are contiguous in the sequence (dropout needs it)."""
    check_ring(q.shape[1], k.shape[1], causal, layout)
    n = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)

    def shifted(x):
        return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])

    if not causal:
        out, lse = _empty(q, v)
        for step in range(n):
            if step + 1 < n:
                k_next, v_next = shifted(k), shifted(v)  # issued before the local call: may overlap it
            source = (index - step) % n  # the device whose block this is
            out, lse = _merge(out, lse, *forward(q, k, v, False, (index * q.shape[1], source * k.shape[1])))
            if step + 1 < n:
                k, v = k_next, v_next
        return out.astype(q.dtype), lse

    if layout == "contiguous":
        q, k, v = (_to_zigzag(x, axis_name, n, index) for x in (q, k, v))
    chunk = q.shape[1] // 2
    q_first, q_second = q[:, :chunk], q[:, chunk:]
    first, second = _chunk_starts(index, n, chunk)  # of the local chunks

    # Step 0: own chunks (i, 2n-1-i) against themselves: causal on the diagonal, the second query chunk sees the
    # whole first key chunk, the first query chunk nothing of the second key chunk.
    out_first, lse_first = forward(q_first, k[:, :chunk], v[:, :chunk], True, (first, first))
    out_second, lse_second = _merge(*_as_f32(forward(q_second, k[:, chunk:], v[:, chunk:], True, (second, second))),
                                    *forward(q_second, k[:, :chunk], v[:, :chunk], False, (second, first)))
    out = jnp.concatenate([out_first.astype(jnp.float32), out_second], axis=1)
    lse = jnp.concatenate([lse_first, lse_second], axis=2)

    for step in range(1, n):
        k, v = shifted(k), shifted(v)
        source = (index - step) % n  # the device whose block arrived: it holds chunks source, 2n-1-source
        key_first, key_second = _chunk_starts(source, n, chunk)

        def earlier(k, v):  # source < index: all queries see the block's first chunk, none its second
            k, v = k[:, :chunk], v[:, :chunk]
            if not per_chunk:
                return _as_f32(forward(q, k, v, False, (first, key_first)))
            parts = [_as_f32(forward(rows, k, v, False, (start, key_first)))
                     for rows, start in ((q_first, first), (q_second, second))]
            return jnp.concatenate([parts[0][0], parts[1][0]], axis=1), jnp.concatenate([parts[0][1], parts[1][1]],
                                                                                        axis=2)

        def later(k, v):  # source > index: only the second query chunk sees the block, all of it
            if per_chunk:
                part_out, part_lse = _merge(
                    *_as_f32(forward(q_second, k[:, :chunk], v[:, :chunk], False, (second, key_first))),
                    *forward(q_second, k[:, chunk:], v[:, chunk:], False, (second, key_second)))
            else:
                part_out, part_lse = _as_f32(forward(q_second, k, v, False, (second, key_first)))
            none_out, none_lse = _empty(q_first, v)
            return jnp.concatenate([none_out, part_out], axis=1), jnp.concatenate([none_lse, part_lse], axis=2)

        out, lse = _merge(out, lse, *jax.lax.cond(source < index, earlier, later, k, v))

    out = out.astype(q.dtype)
    if layout == "contiguous":
        out = _from_zigzag(out, axis_name, n, index)
        lse = jnp.swapaxes(_from_zigzag(jnp.swapaxes(lse, 1, 2), axis_name, n, index), 1, 2)
    return out, lse


def _chunk_starts(device, n: int, chunk: int):
    """The global first rows of zig-zag device ``device``'s two chunks (device i holds chunks i and 2n-1-i)."""
    return device * chunk, (2 * n - 1 - device) * chunk


def ring_backward(dout, q, k, v, out, lse, dlse, backward, *, axis_name: str, causal: bool,
                  layout: str = "contiguous", per_chunk: bool = False):
    """(dq, dk, dv) of the local shards by the same ring: each step runs ``backward(dout, q, k, v, out, lse, dlse,
    causal, positions)`` -> (dq, dk, dv) on the local rows against the block it holds, with the final out and lse
    (so P and D are the whole attention's); dq accumulates locally, and dK, dV accumulate in float32 on the block's
    own travelling copy, which returns to the block's device after the last step. ``dlse``: the lse's cotangent or
    None; positions and ``per_chunk`` as in ring_forward."""
    check_ring(q.shape[1], k.shape[1], causal, layout)
    n = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)

    def shifted(*xs):
        return tuple(jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)]) for x in xs)

    def f32(*xs):
        return tuple(x.astype(jnp.float32) for x in xs)

    if not causal:
        dq = jnp.zeros(q.shape, jnp.float32)
        dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        for step in range(n):
            source = (index - step) % n
            positions = (index * q.shape[1], source * k.shape[1])
            part_dq, part_dk, part_dv = f32(*backward(dout, q, k, v, out, lse, dlse, False, positions))
            dq, dk, dv = dq + part_dq, dk + part_dk, dv + part_dv
            k, v, dk, dv = shifted(k, v, dk, dv)  # after n shifts each block and its gradients are home again
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    zig = layout == "contiguous"
    if zig:
        dout, q, k, v, out = (_to_zigzag(x, axis_name, n, index) for x in (dout, q, k, v, out))
        lse, dlse = (None if x is None else jnp.swapaxes(_to_zigzag(jnp.swapaxes(x, 1, 2), axis_name, n, index), 1, 2)
                     for x in (lse, dlse))
    chunk = q.shape[1] // 2
    starts = _chunk_starts(index, n, chunk)

    def rows(x, part):  # first or second query chunk of a (batch, rows, ...) or (batch, heads, rows) array
        if x is None:
            return None
        axis = 2 if x.ndim == 3 else 1
        return jax.lax.slice_in_dim(x, part * chunk, (part + 1) * chunk, axis=axis)

    def call(part, k, v, causal, key_start):  # the backward of query chunk `part` (None: both) against k, v
        if part is None:
            return f32(*backward(dout, q, k, v, out, lse, dlse, causal, (starts[0], key_start)))
        return f32(*backward(rows(dout, part), rows(q, part), k, v, rows(out, part), rows(lse, part),
                             rows(dlse, part), causal, (starts[part], key_start)))

    # Step 0, as in ring_forward: (first, first) causal, (second, second) causal, (second, first) full.
    dq0, dk0, dv0 = call(0, k[:, :chunk], v[:, :chunk], True, starts[0])
    dq1, dk1, dv1 = call(1, k[:, chunk:], v[:, chunk:], True, starts[1])
    dq1b, dk0b, dv0b = call(1, k[:, :chunk], v[:, :chunk], False, starts[0])
    dq = jnp.concatenate([dq0, dq1 + dq1b], axis=1)
    dk = jnp.concatenate([dk0 + dk0b, dk1], axis=1)
    dv = jnp.concatenate([dv0 + dv0b, dv1], axis=1)
    k, v, dk, dv = shifted(k, v, dk, dv)

    for step in range(1, n):
        source = (index - step) % n
        key_first, key_second = _chunk_starts(source, n, chunk)

        def earlier(k, v):  # all queries against the block's first chunk
            k, v = k[:, :chunk], v[:, :chunk]
            if per_chunk:
                (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = (call(part, k, v, False, key_first) for part in (0, 1))
                part_dq, part_dk, part_dv = jnp.concatenate([dq_a, dq_b], axis=1), dk_a + dk_b, dv_a + dv_b
            else:
                part_dq, part_dk, part_dv = call(None, k, v, False, key_first)
            zeros = [jnp.zeros((x.shape[0], chunk, *x.shape[2:]), jnp.float32) for x in (k, v)]
            return (part_dq, jnp.concatenate([part_dk, zeros[0]], axis=1),
                    jnp.concatenate([part_dv, zeros[1]], axis=1))

        def later(k, v):  # the second query chunk against the whole block
            if per_chunk:
                (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = (
                    call(1, k[:, :chunk], v[:, :chunk], False, key_first),
                    call(1, k[:, chunk:], v[:, chunk:], False, key_second))
                part_dq = dq_a + dq_b
                part_dk, part_dv = jnp.concatenate([dk_a, dk_b], axis=1), jnp.concatenate([dv_a, dv_b], axis=1)
            else:
                part_dq, part_dk, part_dv = call(1, k, v, False, key_first)
            return jnp.concatenate([jnp.zeros_like(part_dq), part_dq], axis=1), part_dk, part_dv

        part_dq, part_dk, part_dv = jax.lax.cond(source < index, earlier, later, k, v)
        dq, dk, dv = dq + part_dq, dk + part_dk, dv + part_dv
        k, v, dk, dv = shifted(k, v, dk, dv)

    if zig:
        dq, dk, dv = (_from_zigzag(x, axis_name, n, index) for x in (dq, dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


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
