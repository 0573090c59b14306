"""The public API: ``cuflash.attention`` and ``cuflash.attention_backward``.

Layout (batch, seqlen, nheads, headdim), the layout of FlashAttention and of
``jax.nn.dot_product_attention``. Where the arrays live picks where kernels run:

- NumPy arrays (and CPU arrays of other libraries, through DLPack) run on the
  CPU simulator: the same CUDA sources, every thread a fiber. Slow, exact to the
  CUDA programming model; this is how the library is tested without a GPU.
- CuPy arrays run on their GPU; other arrays with ``__dlpack__`` on a CUDA device
  (JAX, PyTorch) go through CuPy without a copy.

Results come back in the input's array type. Inputs whose last dimension is not
contiguous (or with negative strides) are copied once; everything else is used
in place through its strides.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Any, Callable, Hashable

import numpy as np

from . import _validation as V
from . import chunks, rotary
from .sinks import sink_gradient, sink_logits_by_row
from ._placement import Placement, ascontiguous, host_copy, place
from .backends.program import SPARE_SCRATCH_BYTES, PreparedProgram
from .dropout import check_dropout_seed, seed_words
from .kernels import catalog, plans
from .kernels.params import VALUE_WIDTH_TENSORS
from .kernels.program import Problem, decode_window_left, gqa_decode_fold, value_column_chunks
from .mask import Mask, MaskPolicy

# The host path. A call's checks and plan depend on its static signature only (call_key: the entry point, each
# array's type, shape, strides and dtype, the device or simulator target, every option value with its type), so a
# call repeating an earlier signature reuses that call's checked Prepared object: its plan and AttentionParams packed
# but for pointers. What can differ between calls of one signature is checked on every call: the values of
# cu_seqlens, cache_seqlens, block_table, max_seqlen_*, dropout_seed, read-only caches. Varlen and KV-cache plans
# also depend on lengths read from those values; a Prepared object keeps a plan per length.
PREPARED_CALLS = 512
PLANS_PER_CALL = 64


_NO_KEY = object()  # equal to no key


class BoundedCache:
    """A map of at most ``maxsize`` entries, dropping the least recently used; safe for concurrent callers."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        # The most recently used entry as (key, value), replaced whole: a reader never pairs one entry's key with
        # another's value. A decode loop, or a model's layers, repeat one signature call after call: a hit on it is
        # found by comparing the key, without hashing it (a call key: about half a microsecond), and needs no move
        # (the entry is the last already; a move hashes and compares the key once more).
        self._latest: tuple[Any, Any] = (_NO_KEY, None)

    def get(self, key: Hashable) -> Any:
        latest_key, latest = self._latest
        if key == latest_key:
            return latest
        # No lock (every call looks up two entries): each OrderedDict method is one atomic step under the GIL; a
        # put of another thread may drop the entry between the two, which leaves nothing to move. Concurrent
        # callers may leave _latest naming an entry another one moved past, or dropped: the order is then a little
        # off (a value is its key's all the same).
        entry = self._entries.get(key)
        if entry is not None:
            try:
                self._entries.move_to_end(key)
            except KeyError:
                pass
            self._latest = (key, entry)
        return entry

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            self._latest = (key, value)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._latest = (_NO_KEY, None)

    def __len__(self) -> int:
        return len(self._entries)


prepared_calls = BoundedCache(PREPARED_CALLS)


def call_key(entry: str, placement: Placement, window_size: Any, *options: Any) -> tuple:
    """The static signature of a call, the one rule for what a Prepared object may depend on: the entry point, the
    placement's signature (Placement.signature: names, types, shapes, strides and dtypes of the arrays, the GPU or
    the simulator's current target) and every option value with its type (True and 1, or a float and a NumPy
    float, are different calls: the checks tell them apart), window_size's items with theirs. A key holding an
    unhashable option value is never cached: _prepared checks such a call in full every time. A simulator target
    of unknown name (a bad CUFLASH_SIM_TARGET) keys its calls like any other and raises where planning resolves it,
    after the input checks, on every call (no plan of it is ever made)."""
    signature = placement.signature()
    window_type = type(window_size)
    if window_type in _PAIRS:
        window = (window_type, *map(type, window_size), *window_size)
    else:  # not a pair: the checks refuse it
        window = (window_type, window_size)
    # The options as one tuple with their types as another: a key built in a few C calls, every call. Types come
    # before values, here and in window: keys compared (BoundedCache.get) differ at a type before a value of
    # another type is compared (an array's == gives an array, whose truth raises).
    return entry, signature, window, tuple(map(type, options)), options


_PAIRS = (tuple, list)  # window_size values whose items call_key keys with their types


def _prepared(key: tuple, prepare: Callable[[], Prepared]) -> Prepared:
    """The Prepared object of ``key``, made by ``prepare`` (every check of the call, in the API's order) on a miss."""
    try:
        prepared = prepared_calls.get(key)
    except TypeError:  # an unhashable option value
        key = prepared = None
    if prepared is None:
        prepared = prepare()
        if key is not None:
            prepared_calls.put(key, prepared)
    return prepared


class Plan:
    """The Problem of one set of lengths of a Prepared call, and its prepared program once a call launched it."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.folded = gqa_decode_fold(problem) if problem.kvcache else None
        self.programs: ChunkPrograms | None = None  # (start, stop, program) per column chunk of V
        self.row_stats_shape = problem.row_stats_shape
        # The lse of finished calls that did not return it, with its renewal (backend.renewal), for the next such
        # call on a synchronous backend (_run_forward), while it is no larger than the scratch a program keeps
        # (SPARE_SCRATCH_BYTES).
        small = 4 * math.prod(self.row_stats_shape) <= SPARE_SCRATCH_BYTES
        self.spare_lse: list[tuple[Any, Callable[[], None]]] | None = [] if small else None


class Prepared:
    """A checked call of one signature: the checked scalars, the Problem (with its mask before lengths clip it) and a
    Plan per (seqlen_q, seqlen_k), which varlen and KV-cache calls read from values. Holds no array."""

    def __init__(self, problem: Problem, mask: Mask, algorithm: str, scale: float, return_lse: bool = False):
        self.algorithm = algorithm
        self.scale = scale
        self.return_lse = return_lse
        self._problem = problem
        self._mask = mask
        self._plans = BoundedCache(PLANS_PER_CALL)
        self._plans.put((problem.seqlen_q, problem.seqlen_k), Plan(problem))
        self._copied: tuple[bool, ...] | None = None  # which arrays contiguous_last_dim copies: see there

    def contiguous_last_dim(self, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
        """The call's arrays (the same ones, in the same order, on every call of the signature) with each whose last
        dimension the kernels cannot take as it is (V.needs_copy) copied to a contiguous one. Which need a copy
        follows from their strides, shapes and dtypes, part of the signature: worked out on the first call only."""
        copied = self._copied
        if copied is None:
            copied = self._copied = tuple([V.needs_copy(a) for a in arrays])
        if True not in copied:
            return arrays
        return tuple([ascontiguous(a) if copy else a for a, copy in zip(arrays, copied)])

    @classmethod
    def checked(cls, problem: Problem, causal: Any, window_size: Any, *, algorithm: str, softmax_scale: Any,
                return_lse: Any = False) -> Prepared:
        """The checks of a call that follow its Problem's, in the API's order (a Problem was made, so causal and
        window_size are known good)."""
        scale = V.check_softmax_scale(softmax_scale, problem.headdim)
        return_lse = V.check_bool("return_lse", return_lse)
        catalog.check_options(algorithm, problem)  # unknown algorithm or option: raises before anything is allocated
        return cls(problem, Mask.of(bool(causal), (int(window_size[0]), int(window_size[1]))), algorithm, scale,
                   return_lse)

    def plan(self, seqlen_q: int, seqlen_k: int) -> Plan:
        """The plan for these lengths: the checked Problem with them (check_mask's clipping of the window redone)."""
        plan = self._plans.get((seqlen_q, seqlen_k))
        if plan is None:
            problem = dataclasses.replace(self._problem, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                          mask=V.mask_for_lengths(self._mask, seqlen_q, seqlen_k))
            plan = Plan(problem)
            self._plans.put((seqlen_q, seqlen_k), plan)
        return plan

    def run(self, backend: Any, plan: Plan, arrays: dict[str, Any], backward: bool = False) -> dict[str, Any] | None:
        """Run the plan's forward (or backward) program on ``arrays`` (tensors by AttentionParams field name); the
        program is made and packed on the plan's first run (its strides are those of every later call's arrays:
        they follow from the signature). Returns the backward's scratch, by name (the sinks' gradient reads it); a
        forward's is read by no caller, so it returns None and its programs may reuse their scratch
        (PreparedProgram.launch). A V wider than the kernels take runs as a program per column chunk
        (value_column_chunks), on views of the chunk's columns."""
        programs = plan.programs
        if programs is None:
            problem = plan.folded or plan.problem
            planner = plans.backward_program if backward else plans.forward_program
            programs = []
            for start, stop in value_column_chunks(problem.headdim_v):
                part = dataclasses.replace(problem, headdim_v=stop - start)
                programs.append((start, stop, PreparedProgram(planner(self.algorithm, part, backend.target), part,
                                                              self.scale, _value_columns(arrays, start, stop))))
            plan.programs = programs = tuple(programs)
        if not backward:  # each chunk writes its columns of out, and the same lse (the softmax does not depend on V)
            for start, stop, program in programs:
                program.launch(backend, arrays if len(programs) == 1 else _value_columns(arrays, start, stop))
            return None
        if len(programs) == 1:
            program = programs[0][2]
            return dict(zip(program.scratch_names, program.run(backend, arrays)))
        return _run_value_chunks_backward(backend, programs, arrays)


# The tensors of V's width (AttentionParams' "V" fields: v, out, dout, dv), which a column chunk views.
_VALUE_WIDTH = frozenset(VALUE_WIDTH_TENSORS)
# A plan's programs: (start, stop, program) per column chunk of V.
ChunkPrograms = tuple[tuple[int, int, PreparedProgram], ...]


def _value_columns(arrays: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """``arrays`` with the V-wide tensors viewed at columns start:stop (the same strides, the pointer moved)."""
    return {name: x[..., start:stop] if name in _VALUE_WIDTH else x for name, x in arrays.items()}


def _run_value_chunks_backward(backend: Any, programs: ChunkPrograms, arrays: dict[str, Any]) -> dict[str, Any]:
    """The backward chunk by chunk: each writes its columns of dv; dq and dk are the sums of the chunks' (the first
    chunk writes them, the others write partials added in float32 in chunk order: deterministic). Returns the
    first chunk's scratch with D = rowsum(dout * out) ("dout_dot_out", what the sinks' gradient reads) summed over
    the chunks."""
    xp = backend.xp
    scratch, partials = None, {"dq": [], "dk": []}
    for i, (start, stop, program) in enumerate(programs):
        part = _value_columns(arrays, start, stop)
        if i:
            for name in partials:
                part[name] = backend.empty(arrays[name].shape, arrays[name].dtype)
                partials[name].append(part[name])
        buffers = dict(zip(program.scratch_names, program.run(backend, part)))
        if scratch is None:
            scratch = buffers
        elif "dout_dot_out" in buffers:
            scratch["dout_dot_out"] = scratch["dout_dot_out"] + buffers["dout_dot_out"]
    for name, parts in partials.items():
        total = arrays[name].astype(xp.float32)
        for part in parts:
            total += part.astype(xp.float32)
        arrays[name][...] = total.astype(arrays[name].dtype)
    return scratch


class VarlenInputs:
    """A varlen call's integer inputs as checked host copies: cu_seqlens_q/k and the used-prefix counts given
    (seqused_q/k, None when absent). Read on every call (they are data), uploaded as the kernels' side inputs."""

    def __init__(self, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, seqused_q: np.ndarray | None,
                 seqused_k: np.ndarray | None, block_table: np.ndarray | None = None):
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.seqused_q, self.seqused_k = seqused_q, seqused_k
        self.block_table = block_table  # keys in a paged KV cache (V.check_paged_varlen)

    def key_total(self, k: Any) -> int:
        """What cu_seqlens_k must end at: k's rows, or for paged keys its own last entry (V.paged_key_total)."""
        return k.shape[0] if self.block_table is None else V.paged_key_total(self.cu_seqlens_k)

    def side_inputs(self, backend: Any) -> dict[str, Any]:
        # Checked host copies are int32 and C-contiguous: their words are a view (_int32_words without its checks).
        inputs = {"cu_seqlens_q": backend.upload(self.cu_seqlens_q.view(np.float32)),
                  "cu_seqlens_k": backend.upload(self.cu_seqlens_k.view(np.float32))}
        if self.seqused_q is not None:
            inputs["seqused_q"] = backend.upload(self.seqused_q.view(np.float32))
        if self.seqused_k is not None:
            inputs["seqused_k"] = backend.upload(self.seqused_k.view(np.float32))
        if self.block_table is not None:
            inputs["block_table"] = backend.upload(_int32_words(self.block_table))
        return inputs

    def unused_rows(self, side: str) -> np.ndarray | None:
        """The packed query ("q") or key ("k") rows past their sequence's used prefix (V.unused_rows), None when
        none is unused."""
        seqused = self.seqused_q if side == "q" else self.seqused_k
        if seqused is None:
            return None
        cu_seqlens = self.cu_seqlens_q if side == "q" else self.cu_seqlens_k
        unused = V.unused_rows(cu_seqlens, seqused, int(cu_seqlens[-1]))
        return unused if unused.any() else None


def _place_varlen(tensor_names: tuple[str, ...], tensors: tuple[Any, ...], cu_seqlens_q: Any, cu_seqlens_k: Any,
                  seqused_q: Any, seqused_k: Any, alibi_slopes: Any, sinks: Any,
                  block_table: Any = None) -> tuple[Placement, dict[str, Any], tuple, VarlenInputs]:
    """The placement of a varlen call (its tensors, cu_seqlens, the used-prefix counts and block table given, ALiBi
    slopes and sinks), the placed per-head inputs (place), the placed tensors and host copies of the integer
    inputs."""
    # Plain statements, no comprehension: this runs on every call of the host path.
    names, arrays = (*tensor_names, "cu_seqlens_q"), (*tensors, cu_seqlens_q)
    if cu_seqlens_k is not None:
        names, arrays = (*names, "cu_seqlens_k"), (*arrays, cu_seqlens_k)
    if seqused_q is not None:
        names, arrays = (*names, "seqused_q"), (*arrays, seqused_q)
    if seqused_k is not None:
        names, arrays = (*names, "seqused_k"), (*arrays, seqused_k)
    if block_table is not None:
        names, arrays = (*names, "block_table"), (*arrays, block_table)
    placement, per_head = place(names, arrays, alibi_slopes, sinks)
    placed, at = placement.arrays, len(tensor_names)
    optional = iter(placed[at + 1:])
    cu_k = None if cu_seqlens_k is None else host_copy(next(optional))
    used_q = None if seqused_q is None else host_copy(next(optional))
    used_k = None if seqused_k is None else host_copy(next(optional))
    table = None if block_table is None else host_copy(next(optional))
    if cu_k is None:
        cu_k = V.key_offsets_from_used(used_k, table)
    inputs = VarlenInputs(host_copy(placed[at]), cu_k, used_q, used_k, table)
    return placement, per_head, placed[:at], inputs


def _side_inputs(backend: Any, per_head: dict[str, Any], problem: plans.Problem, dropout_seed: int | None,
                 varlen: VarlenInputs | None = None) -> dict[str, Any]:
    """The optional kernel inputs: the per-head ones placed (ALiBi slopes, sinks), dropout's seed words and varlen's
    integer inputs on the backend's device (uploaded from the checked host copies; int32 words in float32-typed
    side buffers)."""
    inputs = dict(per_head)
    if problem.dropout_p > 0.0:
        inputs["dropout_seed"] = backend.upload(seed_words(dropout_seed))
    if varlen is not None:
        inputs.update(varlen.side_inputs(backend))
    return inputs


def _int32_words(host: np.ndarray) -> np.ndarray:
    """An int32 side input (cu_seqlens, seqused_k, block_table) as the float32-typed words AttentionParams' side
    buffers hold (kernels read the bits)."""
    return np.ascontiguousarray(host, dtype=np.int32).view(np.float32)


def _forward(placement: Placement, prepared: Prepared, plan: Plan, q: Any, k: Any, v: Any, *, per_head: dict[str, Any],
             dropout_seed: Any, varlen: VarlenInputs | None = None) -> Any:
    """The forward every entry point but the KV cache's runs once its Prepared object and Plan are known."""
    dropout_seed = check_dropout_seed(dropout_seed, plan.problem.dropout_p)
    q, k, v = prepared.contiguous_last_dim((q, k, v))
    out, lse = _run_forward(placement, prepared, plan, q, k, v,
                            lambda backend: _side_inputs(backend, per_head, plan.problem, dropout_seed, varlen),
                            None if varlen is None else varlen.unused_rows("q"), per_head.get("sinks"))
    return (out, lse) if prepared.return_lse else out


def _run_forward(placement: Placement, prepared: Prepared, plan: Plan, q: Any, k: Any, v: Any,
                 side_inputs: Callable[[Any], dict[str, Any]], unused_q: np.ndarray | None = None,
                 sinks: Any = None) -> tuple[Any, Any]:
    """Allocate out and lse and run the forward program on checked arguments (``side_inputs(backend)`` gives the
    optional inputs on the backend's device; ``unused_q``: packed query rows past a used prefix, which get out 0 and
    lse -inf; ``sinks``: the placed sinks, the lse of a row that sees no key); the results in the caller's array
    type. A one-row GQA decode runs folded (program.gqa_decode_fold):
    the same bytes, viewed with the group's query heads as rows."""
    backend = placement.backend()
    problem = plan.problem
    # A call that does not return its lse takes, on a synchronous backend, one an earlier such call of its plan
    # left, renewed as PreparedProgram.launch renews scratch: no caller holds it, no kernel still reads it. Popped
    # for the call and pushed back after it, so concurrent calls never share one.
    spare = plan.spare_lse if backend.synchronous and not prepared.return_lse else None
    with backend.device():
        out = backend.empty((*q.shape[:-1], v.shape[-1]), q.dtype)  # v's head dim
        lse = renew_lse = None
        if spare:
            try:
                lse, renew_lse = spare.pop()
            except IndexError:  # another thread took the last one since the test
                pass
        if lse is None:
            lse = backend.empty(plan.row_stats_shape, np.float32)
        else:
            renew_lse()
        if problem.seqlen_k == 0:
            # No key at all: every row sees no key (the kernels' rule, without a launch).
            out[...] = 0
            lse[...] = -np.inf if sinks is None else sink_logits_by_row(sinks)
        elif out.size:
            arrays = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
            folded = plan.folded
            if folded is not None and plan.programs is None:
                # The folded program's strides are the views' (packed once, when its plan is first run). A launch
                # reads only its arrays' addresses and extents, which the views share with q, out and lse: later
                # calls pass those as they are, without making views.
                arrays.update(q=_group_rows(q, folded.seqlen_q), out=_group_rows(out, folded.seqlen_q),
                              lse=lse.reshape(folded.row_stats_shape))
            arrays.update(side_inputs(backend))
            prepared.run(backend, plan, arrays)
            if unused_q is not None:
                rows = backend.upload(unused_q)
                out[rows] = 0
                lse[:, rows] = -np.inf
    if spare is not None:
        spare.append((lse, renew_lse or backend.renewal(lse, False)))
    return placement.results(out, lse)


def _group_rows(x: Any, group: int) -> Any:
    """(batch, 1, nheads, d) viewed as (batch, group, nheads / group, d): query head kh * group + m at row m of kv
    head kh, strides (batch, head, group * head). Splitting the heads axis is always a view (NumPy and CuPy)."""
    batch, _, nheads, headdim = x.shape
    return x[:, 0].reshape(batch, nheads // group, group, headdim).swapaxes(1, 2)


def _backward(placement: Placement, prepared: Prepared, plan: Plan, dout: Any, q: Any, k: Any, v: Any, out: Any,
              lse: Any, *, per_head: dict[str, Any], dropout_seed: Any, varlen: VarlenInputs | None = None,
              packed: Callable[[Any], tuple[tuple[Any, ...], tuple[Any, Any, Any]]] | None = None) -> tuple[Any, ...]:
    """The backward every entry point runs once its Prepared object and Plan are known. ``packed(backend)``, for
    the packed entry points, allocates the gradients to return and gives (them, views of them as dq, dk, dv) for
    the kernels to write through their strides. With sinks, d loss / d sinks follows the gradients."""
    problem = plan.problem
    dropout_seed = check_dropout_seed(dropout_seed, problem.dropout_p)
    dout, q, k, v, out = prepared.contiguous_last_dim((dout, q, k, v, out))
    if not lse.flags.c_contiguous:
        lse = ascontiguous(lse)

    backend = placement.backend()
    with backend.device():
        if packed is None:
            dq = backend.empty(q.shape, q.dtype)
            dk = backend.empty(k.shape, k.dtype)
            dv = backend.empty(v.shape, v.dtype)
            returned = (dq, dk, dv)
        else:
            returned, (dq, dk, dv) = packed(backend)
        sinks = per_head.get("sinks")
        if sinks is not None:  # out 0 wherever no kernel runs: no gradient reaches the sinks there
            dsinks = backend.empty(sinks.shape, np.float32)
            dsinks[...] = 0
            returned += (dsinks,)
        if problem.seqlen_k == 0 or problem.seqlen_q == 0:
            # Nothing attends to anything: all gradients are zero.
            for grad in (dq, dk, dv):
                grad[...] = 0
        elif dq.size:
            arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
                      **_side_inputs(backend, per_head, problem, dropout_seed, varlen)}
            scratch = prepared.run(backend, plan, arrays, backward=True)
            if sinks is not None:
                unused = None if varlen is None else varlen.unused_rows("q")
                dsinks[...] = sink_gradient(sinks, lse, scratch["dout_dot_out"], backend.xp,
                                            None if unused is None else backend.upload(unused))
            # Rows past a used prefix are neither read nor written by the kernels: their gradients are zero.
            for side, grads in (("q", (dq,)), ("k", (dk, dv))):
                unused = None if varlen is None else varlen.unused_rows(side)
                if unused is not None:
                    rows = backend.upload(unused)
                    for grad in grads:
                        grad[rows] = 0
        elif dk.size:
            # Varlen with no query row at all (total_q = 0): no key is seen.
            dk[...] = 0
            dv[...] = 0
    return placement.results(*returned)


def _check_backward(problem: Problem, dout: Any, q: Any, out: Any, lse: Any, dropout_seed: Any) -> None:
    """The backward's checks between its Problem's and the scalars', in the API's order."""
    check_dropout_seed(dropout_seed, problem.dropout_p)
    V.check_out_like("dout", dout, q, problem.headdim_v)
    V.check_out_like("out", out, q, problem.headdim_v)
    V.check_lse(lse, problem)


_OPTIONS_DOC = """
    Options (all algorithms take windows; softcap, ALiBi, dropout and sinks need algorithm="fa2"):

    - ``causal``: the mask's diagonal is aligned to the bottom-right corner: with
      off = seqlen_k - seqlen_q, query i sees key j iff j <= i + off.
    - ``window_size=(left, right)``: a local band, -1 unbounded: query i sees key j iff
      (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right);
      ``causal=True`` sets right = 0.
    - ``attention_chunk=c > 0`` (FA3's chunked attention, Llama 4's local layers; fa2): query
      i sees only the keys of its diagonal's chunk, (i + off) // c == j // c, on top of the
      window and causal mask. Runs as a varlen call over one sequence per chunk
      (cuflash/chunks.py); not with dropout.
    - ``softcap=c > 0``: the score is c * tanh(scale * q.k / c) instead of scale * q.k.
    - ``alibi_slopes``: float32, (nheads,) or (batch, nheads); -slope * |i + off - j| is
      added to the (softcapped) score of query head h (the lse includes it).
    - ``dropout_p`` in [0, 1) with ``dropout_seed`` (an int, required when dropout_p > 0):
      after the softmax, P is multiplied by keep / (1 - dropout_p); the lse is unchanged.
      The keep mask is a pure function of (seed, batch, head, i, j), the same on every
      algorithm variant and backend; ``cuflash.dropout_mask`` returns it. The backward
      must get the forward's dropout_p and dropout_seed.
    - ``sinks``: float32 (nheads,), learnable attention sinks (gpt-oss): head h's logit s_h
      joins the softmax denominator of each of its rows with no value, out = sum_j e^{x_j} v_j /
      (e^{s_h} + sum_j e^{x_j}); the lse includes it. The backward takes the forward's sinks and
      returns d loss / d sinks (float32 (nheads,)) after the other gradients.

    A query row that sees no key gets output 0, lse -inf (with sinks: its head's s_h) and zero
    gradients."""


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
    sinks: Any = None,
    attention_chunk: int = 0,
    num_splits: int = 1,
) -> Any:
    if attention_chunk.__class__ is not int or attention_chunk:  # an int 0 (no chunks) costs this test alone
        chunk = chunks.check(attention_chunk, algorithm, dropout_p)
        if chunk:
            return _chunked_forward(q, k, v, chunk=chunk, causal=causal, softmax_scale=softmax_scale,
                                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                    algorithm=algorithm, return_lse=return_lse, sinks=sinks, num_splits=num_splits)
    placement, per_head = place(("q", "k", "v"), (q, k, v), alibi_slopes, sinks)
    q, k, v = placement.arrays[:3]

    def prepare() -> Prepared:
        problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                              dropout_p=dropout_p, **per_head)
        check_dropout_seed(dropout_seed, problem.dropout_p)
        return Prepared.checked(V.with_num_splits(problem, num_splits), causal, window_size, algorithm=algorithm,
                                softmax_scale=softmax_scale, return_lse=return_lse)

    prepared = _prepared(call_key("attention", placement, window_size, causal, softmax_scale, softcap, dropout_p,
                                  algorithm, return_lse, num_splits), prepare)
    plan = prepared.plan(q.shape[1], k.shape[1])
    return _forward(placement, prepared, plan, q, k, v, per_head=per_head, dropout_seed=dropout_seed)


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    deterministic: bool = False,
    sinks: Any = None,
    attention_chunk: int = 0,
) -> tuple[Any, ...]:
    if attention_chunk.__class__ is not int or attention_chunk:
        chunk = chunks.check(attention_chunk, algorithm, dropout_p)
        if chunk:
            return _chunked_backward(dout, q, k, v, out, lse, chunk=chunk, causal=causal,
                                     softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                     alibi_slopes=alibi_slopes, algorithm=algorithm, deterministic=deterministic,
                                     sinks=sinks)
    placement, per_head = place(("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse), alibi_slopes, sinks)
    dout, q, k, v, out, lse = placement.arrays[:6]
    return _fixed_length_backward("attention_backward", placement, dout, q, k, v, out, lse, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                  per_head=per_head, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                  algorithm=algorithm, deterministic=deterministic)


def _fixed_length_backward(entry: str, placement: Placement, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                           *, causal: Any, softmax_scale: Any, window_size: Any, softcap: Any, per_head: dict[str, Any],
                           dropout_p: Any, dropout_seed: Any, algorithm: Any, deterministic: Any,
                           packed: Callable | None = None) -> tuple[Any, ...]:
    """A fixed-length backward on placed arrays: its checks (once per signature of ``entry``) and its run, for
    attention_backward and the packed entry points (``packed``: as _backward takes it)."""
    def prepare() -> Prepared:
        problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                              dropout_p=dropout_p, deterministic=deterministic, **per_head)
        _check_backward(problem, dout, q, out, lse, dropout_seed)
        return Prepared.checked(problem, causal, window_size, algorithm=algorithm, softmax_scale=softmax_scale)

    prepared = _prepared(call_key(entry, placement, window_size, causal, softmax_scale, softcap, dropout_p,
                                  algorithm, deterministic), prepare)
    return _backward(placement, prepared, prepared.plan(q.shape[1], k.shape[1]), dout, q, k, v, out, lse,
                     per_head=per_head, dropout_seed=dropout_seed, packed=packed)


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: Any = None,
    seqused_k: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    return_lse: bool = False,
    sinks: Any = None,
    attention_chunk: int = 0,
    block_table: Any = None,
    num_splits: int | None = None,
) -> Any:
    if attention_chunk.__class__ is not int or attention_chunk:
        chunk = chunks.check(attention_chunk, algorithm, dropout_p)
        if chunk:
            return _chunked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, chunk=chunk, seqused_q=seqused_q,
                                   seqused_k=seqused_k, causal=causal, window_size=window_size,
                                   alibi_slopes=alibi_slopes, sinks=sinks, max_seqlen_q=max_seqlen_q,
                                   max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, softcap=softcap,
                                   algorithm=algorithm, return_lse=return_lse, block_table=block_table,
                                   num_splits=num_splits)
    placement, per_head, (q, k, v), varlen = _place_varlen(("q", "k", "v"), (q, k, v), cu_seqlens_q, cu_seqlens_k,
                                                           seqused_q, seqused_k, alibi_slopes, sinks, block_table)

    def prepare() -> Prepared:
        check, paged = ((V.check_varlen_qkv, {}) if block_table is None else
                        (V.check_paged_varlen, {"block_table": varlen.block_table}))
        problem = check(q, k, v, cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=varlen.seqused_q,
                        seqused_k=varlen.seqused_k, causal=causal, window_size=window_size, softcap=softcap,
                        dropout_p=dropout_p, **paged, **per_head)
        check_dropout_seed(dropout_seed, problem.dropout_p)
        problem = V.with_num_splits(problem, V.varlen_num_splits(num_splits, decode_step=False))
        return Prepared.checked(problem, causal, window_size, algorithm=algorithm, softmax_scale=softmax_scale,
                                return_lse=return_lse)

    prepared = _prepared(call_key("attention_varlen", placement, window_size, causal, softmax_scale, softcap,
                                  dropout_p, algorithm, return_lse, num_splits), prepare)
    _, seqlen_q, seqlen_k = V.varlen_extents(varlen.cu_seqlens_q, varlen.cu_seqlens_k, q.shape[0], varlen.key_total(k),
                                             max_seqlen_q, max_seqlen_k, varlen.seqused_q, varlen.seqused_k)
    if block_table is not None:
        V.check_paged_varlen_values(varlen.block_table, varlen.cu_seqlens_k, k.shape[0], k.shape[1])
        if varlen.seqused_q is None and V.one_row_per_sequence(varlen.cu_seqlens_q):
            return _paged_decode(placement, q, k, v, varlen, prepared, causal=causal, window_size=window_size,
                                 softcap=softcap, algorithm=algorithm,
                                 num_splits=V.varlen_num_splits(num_splits, decode_step=True), **per_head)
    return _forward(placement, prepared, prepared.plan(seqlen_q, seqlen_k), q, k, v, per_head=per_head,
                    dropout_seed=dropout_seed, varlen=varlen)


def _paged_decode(placement: Placement, q: Any, k_cache: Any, v_cache: Any, varlen: VarlenInputs,
                  prepared: Prepared, *, causal: Any, window_size: Any, softcap: Any, algorithm: Any,
                  num_splits: int, **per_head: Any) -> Any:
    """A checked paged varlen call with one query row per sequence (a decode step, vLLM's): attention_with_kvcache's
    call over the same pages, (batch, 1, nheads, d), so that it runs as a KV-cache decode does (FA2's GQA fold, FA3's
    pack_gqa: K and V read once per kv head; split-KV, by the device's SMs unless the call says ``num_splits``), its out
    and lse laid out as varlen's.
    The KV-cache body takes the varlen call's host copies of the keys in use and of the block table (no upload, no
    copy back: on a GPU neither waits for the device), keyed by the varlen call's placement under an entry of its
    own. ``per_head``: the placed alibi_slopes and sinks."""
    keys = varlen.seqused_k if varlen.seqused_k is not None else np.diff(varlen.cu_seqlens_k).astype(np.int32)
    out, lse = _kvcache_forward(
        "attention_varlen decode step", placement.unexported(), per_head, q[:, None], k_cache, v_cache, None, None,
        keys, varlen.block_table, None, None, None, None, seqlens_type=np.ndarray, causal=causal,
        softmax_scale=prepared.scale, window_size=window_size, softcap=softcap, num_splits=num_splits,
        algorithm=algorithm, return_lse=True, rotary_interleaved=False, chunk=0)
    out = out[:, 0]
    if not prepared.return_lse:
        return placement.results(out)[0]
    return placement.results(out, ascontiguous(lse[:, :, 0].T))  # (batch, nheads, 1) as varlen's (nheads, batch)


def attention_varlen_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: Any = None,
    seqused_k: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    algorithm: str = "fa2",
    deterministic: bool = False,
    sinks: Any = None,
    attention_chunk: int = 0,
) -> tuple[Any, ...]:
    if attention_chunk.__class__ is not int or attention_chunk:
        chunk = chunks.check(attention_chunk, algorithm, dropout_p)
        if chunk:
            return _chunked_varlen_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, chunk=chunk, seqused_q=seqused_q,
                seqused_k=seqused_k, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, softcap=softcap,
                algorithm=algorithm, deterministic=deterministic)
    placement, per_head, (dout, q, k, v, out, lse), varlen = _place_varlen(
        ("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse), cu_seqlens_q, cu_seqlens_k, seqused_q,
        seqused_k, alibi_slopes, sinks)

    def prepare() -> Prepared:
        problem = V.check_varlen_qkv(q, k, v, varlen.cu_seqlens_q, varlen.cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                     max_seqlen_k=max_seqlen_k, seqused_q=varlen.seqused_q,
                                     seqused_k=varlen.seqused_k, causal=causal, window_size=window_size,
                                     softcap=softcap, dropout_p=dropout_p, deterministic=deterministic,
                                     **per_head)
        _check_backward(problem, dout, q, out, lse, dropout_seed)
        return Prepared.checked(problem, causal, window_size, algorithm=algorithm, softmax_scale=softmax_scale)

    prepared = _prepared(call_key("attention_varlen_backward", placement, window_size, causal, softmax_scale,
                                  softcap, dropout_p, algorithm, deterministic), prepare)
    _, seqlen_q, seqlen_k = V.varlen_extents(varlen.cu_seqlens_q, varlen.cu_seqlens_k, q.shape[0], k.shape[0],
                                             max_seqlen_q, max_seqlen_k, varlen.seqused_q, varlen.seqused_k)
    return _backward(placement, prepared, prepared.plan(seqlen_q, seqlen_k), dout, q, k, v, out, lse,
                     per_head=per_head, dropout_seed=dropout_seed, varlen=varlen)


def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    k: Any = None,
    v: Any = None,
    cache_seqlens: Any = None,
    block_table: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    algorithm: str = "fa2",
    return_lse: bool = False,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    rotary_interleaved: bool = False,
    sinks: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    attention_chunk: int = 0,
) -> Any:
    chunk = 0
    if attention_chunk.__class__ is not int or attention_chunk:
        chunk = chunks.check(attention_chunk, algorithm)
    # The optional arrays given, by name (an int cache_seqlens is a value, not an array), placed with q and the
    # caches.
    seqlens_array = None if cache_seqlens is None or isinstance(cache_seqlens, int) else cache_seqlens
    optional = {name: x for name, x in (("k", k), ("v", v), ("block_table", block_table), ("rotary_cos", rotary_cos),
                                        ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                                        ("cache_leftpad", cache_leftpad), ("cache_seqlens", seqlens_array))
                if x is not None}
    names = ("q", "k_cache", "v_cache", *optional)
    placement, per_head = place(names, (q, k_cache, v_cache, *optional.values()), alibi_slopes, sinks)
    # New rows are written into the caches in place: then refuse read-only ones (a JAX array, a NumPy array with
    # writeable=False) before anything is read or written, on every backend alike. Without new rows the caches are
    # only read.
    if k is not None:
        placement.check_writable(("k_cache", "v_cache"), "attention_with_kvcache",
                                 "for JAX arrays cuflash.jax.attention_with_kvcache, which returns the updated caches")
    if placement.foreign_type is not None:  # arrays imported through DLPack: the placed ones are others
        placed = dict(zip(names, placement.arrays))
        q, k_cache, v_cache = placed["q"], placed["k_cache"], placed["v_cache"]
        optional = {name: placed[name] for name in optional}
    table = host_copy(optional["block_table"]) if "block_table" in optional else None
    lengths = host_copy(optional["cache_seqlens"]) if "cache_seqlens" in optional else cache_seqlens
    index = host_copy(optional["cache_batch_idx"]) if "cache_batch_idx" in optional else None
    leftpad = host_copy(optional["cache_leftpad"]) if "cache_leftpad" in optional else None
    return _kvcache_forward(
        "attention_with_kvcache", placement, per_head, q, k_cache, v_cache, optional.get("k"), optional.get("v"),
        lengths, table, index, leftpad, optional.get("rotary_cos"), optional.get("rotary_sin"),
        seqlens_type=type(cache_seqlens), causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, num_splits=num_splits, algorithm=algorithm, return_lse=return_lse,
        rotary_interleaved=rotary_interleaved, chunk=chunk)


def _kvcache_forward(entry: str, placement: Placement, per_head: dict[str, Any], q: Any, k_cache: Any, v_cache: Any,
                     k: Any, v: Any, lengths: Any, table: np.ndarray | None, index: np.ndarray | None,
                     leftpad: np.ndarray | None, rotary_cos: Any, rotary_sin: Any, *, seqlens_type: type, causal: Any,
                     softmax_scale: Any, window_size: Any, softcap: Any, num_splits: Any, algorithm: Any,
                     return_lse: Any, rotary_interleaved: Any, chunk: int) -> Any:
    """attention_with_kvcache's body, from its placed arrays and the host copies of its integer inputs (``lengths``:
    cache_seqlens, an int or an array; ``table``: block_table; ``index``: cache_batch_idx; ``leftpad``:
    cache_leftpad), unchecked: every check of the public call but the placement's runs here. ``entry`` and
    ``placement`` key the prepared call (call_key): a caller that already holds the host copies (the paged varlen
    call's decode step) passes its own entry name and placement, whose signature fixes every shape checked here, so
    the integer inputs are neither uploaded nor copied back again."""

    def prepare() -> KVCachePrepared:
        # Keys that start past row 0 for the call (as left padding on contiguous caches, which the plan then reads,
        # zero where none is given; as pages dropped from the block table): at each sequence's rows' chunk
        # (chunks.kvcache_chunks), and for a one-row decode folded under a window, at the row's first visible key
        # (decode_window_left: the call then has no mask).
        def checked(call_leftpad: np.ndarray | None, call_causal: Any, call_window: Any) -> Problem:
            return V.check_kvcache(q, k_cache, v_cache, k, v, lengths, table, causal=call_causal,
                                   window_size=call_window, softcap=softcap, cache_batch_idx=index,
                                   cache_leftpad=call_leftpad, **per_head)[0]

        moved_leftpad = np.zeros(q.shape[0], np.int32) if leftpad is None and table is None else leftpad
        problem = checked(moved_leftpad if chunk else leftpad, causal, window_size)
        # The window as given, not as clipped to this call's lengths: the plans of later calls clip it to theirs.
        window_left = decode_window_left(dataclasses.replace(problem, mask=Mask.of(
            bool(causal), (int(window_size[0]), int(window_size[1])))))
        call_causal, call_window = causal, window_size
        if window_left is not None:
            call_causal, call_window = False, (-1, -1)
            problem = checked(moved_leftpad, call_causal, call_window)
            if table is not None:  # a paged cache's keys from inside a page: its cache_leftpad (paged_keys_from)
                problem = dataclasses.replace(problem, cache_leftpad=True)
        problem = V.with_num_splits(problem, num_splits)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if V.needs_copy(cache):
                raise ValueError(f"{name} is updated in place, so its last dimension must be contiguous (and its "
                                 f"strides non-negative)")
        prepared = KVCachePrepared.checked(problem, call_causal, call_window, algorithm=algorithm,
                                           softmax_scale=softmax_scale, return_lse=return_lse)
        prepared.window_left = window_left
        prepared.layout = V.check_kvcache_shapes(q, k_cache, v_cache, k, v, table, index,
                                                 moved_leftpad if chunk or window_left is not None else leftpad)
        if chunk and table is not None:
            chunks.check_pages(chunk, prepared.layout.page_size)
        prepared.rotary = rotary.check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k,
                                              prepared.layout.capacity)
        return prepared

    # An int cache_seqlens is a value like an array's: only its type is part of the signature.
    prepared = _prepared(call_key(entry, placement, window_size, seqlens_type, causal, softmax_scale, softcap,
                                  num_splits, algorithm, return_lse, rotary_interleaved, chunk), prepare)
    layout = prepared.layout
    if table is not None:
        V.check_block_table_values(table, layout.num_pages)
    # The cache rows in use before and after the append, and the most after it; the keys start at cache_leftpad.
    starts, used, longest = V.kvcache_rows(lengths, layout)
    if index is not None or leftpad is not None:
        V.check_kvcache_index_values(index, leftpad, used, layout)
    spanning, first_keys = False, None  # where each sequence's keys start for the call, past any left padding
    if chunk:  # the keys from each sequence's rows' chunk on (checked before anything is written)
        first_keys, spanning = chunks.kvcache_chunks(chunk, q.shape[1], V.kvcache_keys(used, leftpad))
        if spanning and table is None:
            chunks.check_packed_view(k_cache, v_cache)
            chunks.check_cache_rows_in_order(index)
    if prepared.rotary:  # q and the new rows, at their key positions (rotary.py); every check is behind us
        first_new = V.kvcache_keys(used, leftpad) - k.shape[1]
        q, k = _rotated(placement.backend(), q, k, rotary_cos, rotary_sin, first_new, rotary_interleaved,
                        rotary.query_rows_apart(causal, window_size, chunk))
    if k is not None and k.shape[1]:
        _append(k_cache, v_cache, k, v, starts, table, index)  # every check is behind us: now write
    if spanning:
        out, lse = _kvcache_as_varlen(placement.backend(), q, k_cache, v_cache, used, leftpad, index, table, layout,
                                      chunk=chunk, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap, algorithm=algorithm, **per_head)
        return placement.results(out, lse) if prepared.return_lse else placement.results(out)[0]
    if prepared.window_left is not None:  # a folded windowed decode: from the row's first visible key
        window_first = MaskPolicy.decode_first_key(prepared.window_left, V.kvcache_keys(used, leftpad))
        first_keys = window_first if first_keys is None else np.maximum(first_keys, window_first)
    if first_keys is not None:
        if table is None:
            leftpad = (first_keys if leftpad is None else leftpad + first_keys).astype(np.int32)
        else:
            table, used, in_page = chunks.paged_keys_from(table, used, first_keys, layout.page_size)
            used = used.astype(np.int32)
            if prepared.window_left is not None:  # (else chunks alone: their first keys start pages)
                leftpad = in_page.astype(np.int32)
    if leftpad is not None or first_keys is not None:  # the keys start past row 0 (longest counts from it)
        keys = V.kvcache_keys(used, leftpad)
        longest = V.min_max(keys)[1] if keys.size else 0
    plan = prepared.plan(q.shape[1], V.kvcache_key_extent(longest, layout.capacity))
    (q,) = prepared.contiguous_last_dim((q,))

    def side_inputs(backend: Any) -> dict[str, Any]:
        inputs = _side_inputs(backend, per_head, plan.problem, None)
        inputs["seqused_k"] = backend.upload(_int32_words(used))
        if table is not None:
            inputs["block_table"] = backend.upload(_int32_words(table))
        if index is not None:
            inputs["cache_batch_idx"] = backend.upload(_int32_words(index))
        if leftpad is not None:
            inputs["cache_leftpad"] = backend.upload(_int32_words(leftpad))
        return inputs

    out, lse = _run_forward(placement, prepared, plan, q, k_cache, v_cache, side_inputs, sinks=per_head.get("sinks"))
    return (out, lse) if prepared.return_lse else out


def _kvcache_as_varlen(backend: Any, q: Any, k_cache: Any, v_cache: Any, used: np.ndarray, leftpad: np.ndarray | None,
                       index: np.ndarray | None, table: np.ndarray | None, layout: V.KVCacheLayout, *, chunk: int,
                       alibi_slopes: Any = None, **options: Any) -> tuple[Any, Any]:
    """A chunked KV-cache call whose rows span chunks (a prefill crossing a chunk's end), after its append: the
    chunked varlen call over its sequences (q's rows packed; keys a paged cache's pages, or contiguous caches viewed
    packed: chunks.cache_as_varlen), so every chunk of rows is a virtual batch of its own. Returns (out, lse) in
    the KV cache's layouts. ``options``: causal, softmax_scale, window_size, softcap, algorithm, sinks."""
    batch, seqlen_q, nheads = q.shape[:3]
    cu_q, cu_k, owner = chunks.cache_as_varlen(seqlen_q, used, leftpad, index, table is not None, layout.capacity,
                                               k_cache.shape[0])
    keys, values = k_cache, v_cache
    if table is None:  # views (chunks.check_packed_view)
        keys, values = (c.reshape(c.shape[0] * c.shape[1], *c.shape[2:]) for c in (k_cache, v_cache))
    if owner is not None and alibi_slopes is not None:
        alibi_slopes = chunks.per_segment(alibi_slopes, backend.upload(owner))
    with backend.device():
        out, lse = attention_varlen(_rows_packed(q), keys, values, backend.upload(cu_q), backend.upload(cu_k),
                                    block_table=None if table is None else backend.upload(table),
                                    attention_chunk=chunk, alibi_slopes=alibi_slopes, return_lse=True, **options)
    return out.reshape(batch, seqlen_q, nheads, out.shape[-1]), _fixed_length_lse(lse, batch, seqlen_q)


def _fixed_length_lse(lse: Any, batch: int, seqlen_q: int) -> Any:
    """A varlen call's lse, (nheads, batch * seqlen_q) over rows packed from a (batch, seqlen_q) layout, as a
    fixed-length call's (batch, nheads, seqlen_q): one transposed copy."""
    return ascontiguous(lse.reshape(lse.shape[0], batch, seqlen_q).transpose(1, 0, 2))


def _packed_gradients(like: tuple[Any, ...], parts: tuple[int, ...]) -> Callable:
    """The ``packed`` argument of _backward: gradients shaped like ``like`` (the packed arrays and q as given), the
    kernels writing dq, dk, dv into views of them (``parts``: how many of dq, dk, dv each holds)."""
    def allocate(backend: Any) -> tuple[tuple[Any, ...], tuple[Any, Any, Any]]:
        grads = tuple(backend.empty(x.shape, x.dtype) for x in like)
        views = [g if n == 1 else g[:, :, i] for g, n in zip(grads, parts) for i in range(n)]
        return grads, tuple(views)
    return allocate


def _stacked(arrays: tuple[Any, ...], axis: int) -> Any:
    """A chunked packed backward's gradients stacked into the packed layout (NumPy or CuPy, as placed)."""
    if isinstance(arrays[0], np.ndarray):
        return np.stack(arrays, axis=axis)
    import cupy

    return cupy.stack(arrays, axis=axis)


def _in_callers_type(placement: Placement, result: Any) -> Any:
    """``attention``'s result (out, or (out, lse)) on placed views, handed back as the packed call's caller passed
    its arrays."""
    results = placement.results(*(result if isinstance(result, tuple) else (result,)))
    return results if isinstance(result, tuple) else results[0]


def attention_qkvpacked(qkv: Any, **options: Any) -> Any:
    placement, _ = place(("qkv",), (qkv,))
    return _in_callers_type(placement, attention(*V.packed_parts("qkv", placement.arrays[0]), **options))


def attention_qkvpacked_backward(dout: Any, qkv: Any, out: Any, lse: Any, *, causal: bool = False,
                                 softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                                 softcap: float = 0.0, alibi_slopes: Any = None, dropout_p: float = 0.0,
                                 dropout_seed: int | None = None, algorithm: str = "fa2",
                                 deterministic: bool = False, sinks: Any = None, attention_chunk: int = 0) -> Any:
    placement, per_head = place(("dout", "qkv", "out", "lse"), (dout, qkv, out, lse), alibi_slopes, sinks)
    dout, qkv, out, lse = placement.arrays[:4]
    if attention_chunk.__class__ is not int or attention_chunk:
        chunk = chunks.check(attention_chunk, algorithm, dropout_p)
        if chunk:
            grads = _chunked_backward(
                dout, *V.packed_parts("qkv", qkv), out, lse, chunk=chunk, causal=causal, softmax_scale=softmax_scale,
                window_size=window_size, softcap=softcap, alibi_slopes=per_head.get("alibi_slopes"),
                algorithm=algorithm, deterministic=deterministic, sinks=per_head.get("sinks"))
            gradients = placement.results(_stacked(grads[:3], axis=2), *grads[3:])
            return gradients if sinks is not None else gradients[0]
    gradients = _fixed_length_backward(
        "attention_qkvpacked_backward", placement, dout, *V.packed_parts("qkv", qkv), out, lse, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, per_head=per_head,
        dropout_p=dropout_p, dropout_seed=dropout_seed, algorithm=algorithm, deterministic=deterministic,
        packed=_packed_gradients((qkv,), (3,)))
    return gradients if sinks is not None else gradients[0]  # dqkv, and dsinks with sinks


def attention_kvpacked(q: Any, kv: Any, **options: Any) -> Any:
    placement, _ = place(("q", "kv"), (q, kv))
    q, kv = placement.arrays
    return _in_callers_type(placement, attention(q, *V.packed_parts("kv", kv), **options))


def attention_kvpacked_backward(dout: Any, q: Any, kv: Any, out: Any, lse: Any, *, causal: bool = False,
                                softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                                softcap: float = 0.0, alibi_slopes: Any = None, dropout_p: float = 0.0,
                                dropout_seed: int | None = None, algorithm: str = "fa2",
                                deterministic: bool = False, sinks: Any = None,
                                attention_chunk: int = 0) -> tuple[Any, ...]:
    placement, per_head = place(("dout", "q", "kv", "out", "lse"), (dout, q, kv, out, lse), alibi_slopes, sinks)
    dout, q, kv, out, lse = placement.arrays[:5]
    if attention_chunk.__class__ is not int or attention_chunk:
        chunk = chunks.check(attention_chunk, algorithm, dropout_p)
        if chunk:
            grads = _chunked_backward(
                dout, q, *V.packed_parts("kv", kv), out, lse, chunk=chunk, causal=causal, softmax_scale=softmax_scale,
                window_size=window_size, softcap=softcap, alibi_slopes=per_head.get("alibi_slopes"),
                algorithm=algorithm, deterministic=deterministic, sinks=per_head.get("sinks"))
            return placement.results(grads[0], _stacked(grads[1:3], axis=2), *grads[3:])
    return _fixed_length_backward(
        "attention_kvpacked_backward", placement, dout, q, *V.packed_parts("kv", kv), out, lse, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, per_head=per_head,
        dropout_p=dropout_p, dropout_seed=dropout_seed, algorithm=algorithm, deterministic=deterministic,
        packed=_packed_gradients((q, kv), (1, 2)))


# ---- chunked attention (attention_chunk): a varlen call over one sequence per chunk (cuflash/chunks.py)


def _rows_packed(x: Any) -> Any:
    """A fixed-length (batch, seqlen, heads, d) array as varlen's (batch * seqlen, heads, d): a view where the two
    axes are contiguous, else a copy."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _chunked_forward(q: Any, k: Any, v: Any, *, chunk: int, causal: Any, softmax_scale: Any, window_size: Any,
                     softcap: Any, alibi_slopes: Any, algorithm: Any, return_lse: Any, sinks: Any,
                     num_splits: Any) -> Any:
    """attention with chunks: the varlen forward of its virtual batches, out and lse in the fixed-length layouts."""
    placement, per_head = place(("q", "k", "v"), (q, k, v), alibi_slopes, sinks)
    q, k, v = placement.arrays[:3]
    V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap, **per_head)
    return_lse = V.check_bool("return_lse", return_lse)
    batch, seqlen_q, nheads = q.shape[:3]
    batches = chunks.fixed_length_batches(batch, seqlen_q, k.shape[1], causal, window_size, chunk)
    backend = placement.backend()
    out, lse = attention_varlen(
        _rows_packed(q), _rows_packed(k), _rows_packed(v), backend.upload(batches.cu_seqlens_q),
        backend.upload(batches.cu_seqlens_k), max_seqlen_q=batches.max_seqlen_q, max_seqlen_k=batches.max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        alibi_slopes=chunks.per_segment(per_head.get("alibi_slopes"), backend.upload(batches.owner)),
        algorithm=algorithm, return_lse=True, sinks=per_head.get("sinks"), num_splits=num_splits)
    out = out.reshape(batch, seqlen_q, nheads, out.shape[-1])
    if not return_lse:
        return placement.results(out)[0]
    lse = _fixed_length_lse(lse, batch, seqlen_q)
    return placement.results(out, lse)


def _chunked_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, chunk: int, causal: Any,
                      softmax_scale: Any, window_size: Any, softcap: Any, alibi_slopes: Any, algorithm: Any,
                      deterministic: Any, sinks: Any) -> tuple[Any, ...]:
    """attention_backward with chunks: the varlen backward of its virtual batches; (dq, dk, dv), and dsinks with
    sinks."""
    placement, per_head = place(("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse), alibi_slopes, sinks)
    dout, q, k, v, out, lse = placement.arrays[:6]
    problem = V.check_qkv(q, k, v, causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic,
                          **per_head)
    _check_backward(problem, dout, q, out, lse, None)
    batch, seqlen_q, nheads = q.shape[:3]
    batches = chunks.fixed_length_batches(batch, seqlen_q, k.shape[1], causal, window_size, chunk)
    backend = placement.backend()
    grads = attention_varlen_backward(
        _rows_packed(dout), _rows_packed(q), _rows_packed(k), _rows_packed(v), _rows_packed(out),
        ascontiguous(lse.transpose(1, 0, 2)).reshape(nheads, batch * seqlen_q),
        backend.upload(batches.cu_seqlens_q), backend.upload(batches.cu_seqlens_k),
        max_seqlen_q=batches.max_seqlen_q, max_seqlen_k=batches.max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        alibi_slopes=chunks.per_segment(per_head.get("alibi_slopes"), backend.upload(batches.owner)),
        algorithm=algorithm, deterministic=deterministic, sinks=per_head.get("sinks"))
    shaped = tuple(g.reshape(x.shape) for g, x in zip(grads[:3], (q, k, v)))
    return placement.results(*shaped, *grads[3:])


def _chunked_varlen_call(names: tuple[str, ...], tensors: tuple[Any, ...], cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                         chunk: int, seqused_q: Any, seqused_k: Any, causal: Any, window_size: Any, alibi_slopes: Any,
                         sinks: Any, options: dict[str, Any]) -> tuple[Placement, tuple[Any, ...], dict[str, Any]]:
    """A chunked varlen call's placement, its placed tensors, and the arguments of the varlen call over its virtual
    batches (after the call's checks; ``options`` loses max_seqlen_q/k, which the virtual batches replace, and a
    forward's block_table, which becomes theirs: each starts at its first key's page, chunks.segment_pages). Used
    prefixes (seqused_q / seqused_k) become the virtual batches' own (chunks.virtual_batches)."""
    given = {name: x for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                                     ("seqused_q", seqused_q), ("seqused_k", seqused_k),
                                     ("block_table", options.pop("block_table", None))) if x is not None}
    placement, per_head = place((*names, *given), (*tensors, *given.values()), alibi_slopes, sinks)
    placed, at = placement.arrays, len(names)
    host = {name: host_copy(x) for name, x in zip(given, placed[at:])}
    cu_q, table = host["cu_seqlens_q"], host.get("block_table")
    cu_k = host["cu_seqlens_k"] if "cu_seqlens_k" in host else V.key_offsets_from_used(host.get("seqused_k"), table)
    named = dict(zip(names, placed))
    q, k, v = named["q"], named["k"], named["v"]
    checked = dict(max_seqlen_q=options.pop("max_seqlen_q"), max_seqlen_k=options.pop("max_seqlen_k"),
                   seqused_q=host.get("seqused_q"), seqused_k=host.get("seqused_k"), causal=causal,
                   window_size=window_size, softcap=options["softcap"], **per_head)
    if table is None:
        V.check_varlen_qkv(q, k, v, cu_q, cu_k, **checked)
    else:
        V.check_paged_varlen(q, k, v, table, cu_q, cu_k, **checked)
        chunks.check_pages(chunk, k.shape[1])
    batches = chunks.varlen_batches(cu_q, cu_k, causal, window_size, chunk, host.get("seqused_q"),
                                    host.get("seqused_k"))
    backend = placement.backend()
    call = dict(cu_seqlens_q=backend.upload(batches.cu_seqlens_q), cu_seqlens_k=backend.upload(batches.cu_seqlens_k),
                max_seqlen_q=batches.max_seqlen_q, max_seqlen_k=batches.max_seqlen_k, causal=causal,
                window_size=window_size, sinks=per_head.get("sinks"),
                alibi_slopes=chunks.per_segment(per_head.get("alibi_slopes"), backend.upload(batches.owner)), **options)
    if batches.seqused_q is not None:
        call.update(seqused_q=backend.upload(batches.seqused_q), seqused_k=backend.upload(batches.seqused_k))
    if table is not None:
        call["block_table"] = backend.upload(chunks.segment_pages(table, cu_k, batches, k.shape[1]))
    return placement, placed[:at], call


def _chunked_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, chunk: int, seqused_q: Any,
                    seqused_k: Any, causal: Any, window_size: Any, alibi_slopes: Any, sinks: Any,
                    **options: Any) -> Any:
    """attention_varlen with chunks: the same call over its virtual batches (rows and lse laid out alike).
    ``options``: max_seqlen_q/k, softmax_scale, softcap, algorithm, return_lse, num_splits."""
    placement, placed, call = _chunked_varlen_call(
        ("q", "k", "v"), (q, k, v), cu_seqlens_q, cu_seqlens_k, chunk=chunk, seqused_q=seqused_q, seqused_k=seqused_k,
        causal=causal, window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks, options=options)
    result = attention_varlen(*placed, **call)
    results = placement.results(*(result if isinstance(result, tuple) else (result,)))
    return results if isinstance(result, tuple) else results[0]


def _chunked_varlen_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_seqlens_q: Any,
                             cu_seqlens_k: Any, *, chunk: int, seqused_q: Any, seqused_k: Any, causal: Any,
                             window_size: Any, alibi_slopes: Any, sinks: Any, **options: Any) -> tuple[Any, ...]:
    """attention_varlen_backward with chunks. ``options``: max_seqlen_q/k, softmax_scale, softcap, algorithm,
    deterministic."""
    placement, placed, call = _chunked_varlen_call(
        ("dout", "q", "k", "v", "out", "lse"), (dout, q, k, v, out, lse), cu_seqlens_q, cu_seqlens_k, chunk=chunk,
        seqused_q=seqused_q, seqused_k=seqused_k, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
        sinks=sinks, options=options)
    return placement.results(*attention_varlen_backward(*placed, **call))


class KVCachePrepared(Prepared):
    """A checked attention_with_kvcache call: a Prepared one with the layout its shapes describe (capacity, pages),
    against which each call's cache_seqlens and block_table values are checked, and whether it applies rotary."""

    layout: V.KVCacheLayout
    rotary: bool
    window_left: int | None  # a one-row decode folded under its window's left bound (decode_window_left)


def _rotated(backend: Any, q: Any, k: Any, cos: Any, sin: Any, starts: np.ndarray, interleaved: bool,
             query_rows_apart: bool) -> tuple[Any, Any]:
    """q and the new k rows rotated at their positions (rotary.py), in the arrays' library."""
    xp = backend.xp
    with backend.device():
        at_q = backend.upload(rotary.positions(starts, q.shape[1], query_rows_apart, np))
        at_k = backend.upload(rotary.positions(starts, k.shape[1], True, np))
        return rotary.rotate(q, cos, sin, at_q, interleaved, xp), rotary.rotate(k, cos, sin, at_k, interleaved, xp)


# Up to this many sequences (and new rows per sequence) the new rows are written with a slice assignment per
# sequence and page: a few cost less than one scatter, whose index arrays NumPy builds and CuPy uploads.
_SLICED_APPEND_MAX = 8


def _append(k_cache: Any, v_cache: Any, k: Any, v: Any, starts: np.ndarray, table: np.ndarray | None,
            cache_rows: np.ndarray | None = None) -> None:
    """Write the new rows into the caches in place: k[b, i] to cache row starts[b] + i of sequence b (its page and
    row in the page when paged; of the caches' batch row cache_rows[b] when given), in the caches' own array
    library."""
    batch, seqlen_new = k.shape[:2]
    if batch <= _SLICED_APPEND_MAX and seqlen_new <= _SLICED_APPEND_MAX:
        if table is None:  # a sequence's rows are one slice of its cache row
            for b, start in enumerate(starts.tolist()):
                outer = b if cache_rows is None else int(cache_rows[b])
                k_cache[outer, start:start + seqlen_new] = k[b]
                v_cache[outer, start:start + seqlen_new] = v[b]
            return
        page_size = k_cache.shape[1]
        for b, start in enumerate(starts.tolist()):
            i = 0
            while i < seqlen_new:  # a slice per page the rows reach
                row = start + i
                outer, row = int(table[b, row // page_size]), row % page_size
                count = min(page_size - row, seqlen_new - i)
                k_cache[outer, row:row + count] = k[b, i:i + count]
                v_cache[outer, row:row + count] = v[b, i:i + count]
                i += count
        return
    rows = starts.astype(np.int64)[:, None] + np.arange(seqlen_new)[None, :]  # (batch, seqlen_new)
    if table is None:
        batch_rows = np.arange(batch) if cache_rows is None else cache_rows.astype(np.int64)
        outer = np.broadcast_to(batch_rows[:, None], rows.shape)
    else:
        page_size = k_cache.shape[1]
        outer = np.take_along_axis(table.astype(np.int64), rows // page_size, axis=1)
        rows = rows % page_size
    if not isinstance(k_cache, np.ndarray):
        import cupy

        outer, rows = cupy.asarray(outer), cupy.asarray(rows)
    k_cache[outer, rows] = k
    v_cache[outer, rows] = v


attention.__doc__ = """Scaled dot-product attention softmax(score) v, score = scale * q k^T (see options).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)
    with nheads a multiple of nheads_k (GQA/MQA); dtype float16, bfloat16 or float32
    (all equal), head dim 1..256. ``softmax_scale`` defaults to 1/sqrt(headdim).
    v may have a head dim of its own, headdim_v in 1..512 (MLA-style; fa2 only): out then has it
    (above 256, V runs in column chunks: README).
    ``algorithm``: "fa2" (default), "fa1" or "standard".

    Returns out (like q, with v's head dim), or (out, lse) with lse float32 (batch, nheads, seqlen_q),
    the log-sum-exp of the scores of each query row.

    ``num_splits`` (forward only, fa2, no dropout; FA3's): split-KV ("flash-decoding"): each sequence's keys are
    cut into ranges of whole K/V blocks computed by separate thread blocks into float32 partial results, which a
    combine kernel merges by their lse. 1 (the default, FA3's): no split, and the result does not depend on the
    device (nor under JAX on how a call is sharded); n (<= 128): n splits, at most one per K/V block; 0: FA2's
    heuristic, which splits only when the unsplit grid leaves SMs idle (short queries over long keys: few batch
    x heads x Q blocks). The backward takes the out and lse of any split count.
""" + _OPTIONS_DOC

attention_backward.__doc__ = """Gradients (dq, dk, dv) of ``attention`` given dout = dL/dout.

    ``out`` and ``lse`` are what ``attention(..., return_lse=True)`` returned for the same
    q, k, v and options; dout has out's shape. dq is like q; dk, dv are like k, v (for GQA/MQA they sum over the
    query heads of a group). ``deterministic=True`` asks for bitwise-reproducible
    gradients (the fa2 backward otherwise accumulates dq with float32 atomics, whose order
    varies between runs on a GPU). With ``deterministic=True`` fa2 gives each of a fixed number of thread
    blocks per kv head (about SMs / (batch * nheads_k)) its own float32 dq slice and sums the slices in
    order: scratch linear in seqlen_q, independent of seqlen_k. No gradient flows to alibi_slopes.
    With ``sinks``: (dq, dk, dv, dsinks).
""" + _OPTIONS_DOC

attention_varlen.__doc__ = """Attention over a batch of variable-length sequences packed without padding.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), v's head dim may be its own
    (then out's, as for ``attention``). cu_seqlens_q and
    cu_seqlens_k: int32 (batch + 1,), from 0 to total_q (total_k), nondecreasing: sequence b
    is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q attending to rows cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] of k and v, exactly as ``attention`` on that sequence alone (the mask's
    off = seqlen_k - seqlen_q is the sequence's own). Zero-length sequences are allowed.
    The cu_seqlens are read on the host before any kernel runs (a CuPy array is copied, which
    waits for the device). ``max_seqlen_q`` / ``max_seqlen_k`` default to the longest sequence;
    a larger value only enlarges the grid, a smaller one is an error. ``alibi_slopes`` may be
    (batch, nheads) per sequence. algorithm="fa2" only; no work or traffic for padding.

    ``seqused_q`` / ``seqused_k`` (int32 (batch,), optional; FA2's seqused_k, FA3's seqused_q): sequence b
    uses only its first seqused_q[b] query rows and first seqused_k[b] keys of its packed rows (0 <= each <= the
    sequence's length): exactly ``attention_varlen`` on those prefixes alone, the mask aligned to the used
    lengths (off = seqused_k[b] - seqused_q[b]). Rows past a prefix are never read; their out is 0, their lse
    -inf and their gradients 0. Read on the host and checked like the cu_seqlens.

    ``block_table`` (int32 (batch, pages_per_sequence), forward only; FA2's varlen paged KV cache): k and v are then
    paged caches (num_pages, page_size, nheads_k, headdim), page_size a multiple of 16, and sequence b's keys are the
    first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows (seqused_k[b] where given) of the pages its row names, in
    order: cu_seqlens_k counts keys, not rows of k, and may be None when seqused_k gives them (FA3's and vLLM's
    call). No dropout. The table and each sequence's key count against its pages are checked on the host on every
    call. A decode step (one query row per sequence, no seqused_q) runs as attention_with_kvcache's decode over the
    same pages: its GQA fold (K and V read once per kv head) and split-KV.

    ``num_splits`` as for ``attention``; None (the default) is 0 (the heuristic) for a decode step over pages, as
    ``attention_with_kvcache`` splits, and 1 (no split) for every other call.

    Returns out (total_q, nheads, headdim), or (out, lse) with lse float32 (nheads, total_q).
""" + _OPTIONS_DOC

attention_varlen_backward.__doc__ = """Gradients (dq, dk, dv) of ``attention_varlen`` given dout = dL/dout.

    Arguments as for ``attention_varlen`` (out and lse as it returned them); dq is like q,
    dk and dv like k and v. ``deterministic=True`` as in ``attention_backward``. With ``sinks``:
    (dq, dk, dv, dsinks).
""" + _OPTIONS_DOC

attention_with_kvcache.__doc__ = """Attention of q over a KV cache, appending new keys and values first (inference).

    q: (batch, seqlen_q, nheads, headdim). Caches: k_cache, v_cache (batch, seqlen_cache, nheads_k,
    headdim), or paged (num_pages, page_size, nheads_k, headdim) with ``block_table`` int32 (batch,
    max_blocks_per_seq) naming each sequence's pages in order (any page size that is a multiple of 16).
    ``cache_seqlens``: int32 (batch,), an int, or None (the cache is full but for the new rows): the rows
    already in use per sequence (v_cache, and so v and out, may have a head dim of its own, as for
    ``attention``). New ``k``, ``v`` (batch, seqlen_new, nheads_k, headdim) are written into
    the caches in place at rows cache_seqlens[b] .. + seqlen_new; then q attends to keys
    [0, cache_seqlens[b] + seqlen_new) of its sequence, the mask's diagonal aligned bottom-right to that
    length (off = cache_seqlens[b] + seqlen_new - seqlen_q). Window, softcap, ALiBi and sinks as for ``attention``;
    no dropout, no backward. ``num_splits``: split-KV ("flash-decoding"): each sequence's keys are cut into
    that many ranges computed by separate thread blocks, merged by their lse in a combine kernel (float32
    partial results). 1: no split; n (<= 128): n splits, at most one per K/V block; 0: FA2's heuristic, which
    splits only when the unsplit grid leaves SMs idle (the device's SM count; on the simulator the count of
    its target's representative part, cuflash/kernels/targets.py). A one-row decode over GQA/MQA heads runs
    with each group's query heads as rows (K and V read once per kv head) when no ALiBi and no sinks depend on the
    row or head; under a window's left bound with its keys from the row's first visible key (as left padding, or
    pages dropped and the rest of a page skipped: program.decode_window_left). cache_seqlens and block_table are
    read on the host and checked (capacity, page numbers) before anything is written: a rejected call leaves the
    caches as they were. Returns out (like q), or (out, lse) with lse float32 (batch, nheads, seqlen_q).

    Rotary embedding (FA2's): ``rotary_cos`` and ``rotary_sin`` (q's dtype, (seqlen_ro, rotary_dim / 2) with
    rotary_dim <= headdim and seqlen_ro at least the caches' capacity per sequence) rotate the first rotary_dim
    features of q and of the new k rows (k and v required) before the append: new key i of sequence b at
    position cache_seqlens[b] + i, q's rows at the same positions when causal or windowed, else all at
    cache_seqlens[b]. ``rotary_interleaved``: pairs (2i, 2i + 1) (GPT-J) instead of the two halves (GPT-NeoX).
    Computed in float32 in one small pass over q and the new rows (cuflash/rotary.py); cached rows untouched.

    Cache indexing (FA2's, contiguous caches only): ``cache_batch_idx`` (int32 (batch,)) makes sequence b use row
    cache_batch_idx[b] of the caches' batch, which may hold more rows than q (distinct rows when k and v are
    appended); ``cache_leftpad`` (int32 (batch,)) starts sequence b's keys at cache row cache_leftpad[b] (0 <= it
    <= cache_seqlens[b]; the rows before it are padding, never read): its keys are rows cache_leftpad[b] ..
    cache_seqlens[b] + seqlen_new, the mask aligned to their count and rotary positions counted from the first.
    Checked on the host like cache_seqlens.

    ``attention_chunk`` (as for ``attention``): each sequence's keys start at its rows' chunk (as left padding, or
    pages dropped from the block table: chunks a multiple of the page size), which keeps a decode step's GQA fold and
    split-KV. A call whose rows span chunks (a prefill crossing a chunk's end) appends first and then runs as the
    chunked ``attention_varlen`` over the caches (paged, or contiguous caches viewed as packed rows: their batch
    stride their rows', cache_batch_idx increasing), unsplit.
"""

attention_qkvpacked.__doc__ = """``attention`` of q, k, v packed in one array: qkv (batch, seqlen, 3, nheads,
    headdim), FA2's ``flash_attn_qkvpacked_func``. q, k and v are views of qkv through its strides (no copy);
    options and results as for ``attention``.
"""

attention_qkvpacked_backward.__doc__ = """The gradient of ``attention_qkvpacked``: dqkv, shaped like qkv (the kernels
    write dq, dk and dv straight into its three parts). Options as for ``attention_backward``; with ``sinks``,
    (dqkv, dsinks).
"""

attention_kvpacked.__doc__ = """``attention`` with k and v packed in one array: kv (batch, seqlen_k, 2, nheads_k,
    headdim), FA2's ``flash_attn_kvpacked_func`` (GQA/MQA as for ``attention``). k and v are views of kv (no copy).
"""

attention_kvpacked_backward.__doc__ = """The gradients of ``attention_kvpacked``: (dq, dkv), dkv shaped like kv (the
    kernels write dk and dv straight into its two parts). Options as for ``attention_backward``; with ``sinks``,
    (dq, dkv, dsinks).
"""
