"""A per-(function, structure) cache of traced Python mods for eager flex calls.

Calling cuflash.flex_attention again with the same Python mod would trace it again (jax.make_jaxpr of the mod and of
its derivative, then C++ emission): tens of milliseconds a call, more than a small kernel runs. `traced_mod` keeps
the FlexMod of a function under a key of everything its trace can depend on, read anew at every call:

* the function's code, defaults, and what its code reaches: the closure's cells and the module globals its code
  (and nested code) names, followed into the plain Python functions it reaches;
* per value reached: a module or a jax / numpy / math / builtin function by identity; a Python scalar, string or
  None by type and value (a captured number is a constant of the emitted code); a NumPy array or a 0-d jax array
  by its bytes (NumPy arrays are converted to constants, 0-d jax arrays inlined); a jax array of one or more dims
  by its shape and dtype only (it is a side array: its value travels to the kernel); tuples element by element;
* the mod's kind, side_grads, and jax's x64 flag.

Anything else reached (an object whose attributes the mod reads, a list, a traced array under jit) gives no key and
the mod is traced at every call, as before. A hit takes the cached FlexMod (its compiled kernel, its structure) with
each side read from the captured jax array it came from (the current one: a replaced value gives the new result).

That a jax array's value does not change the trace is checked once, when the entry is made: the mod is traced a
second time with those arrays swapped for tracers of an outer trace (in their cells and globals, restored after).
Where that trace fails (the mod used a value in Python: int(table[0])) or differs from the first (the mod computed
from an array outside JAX's trace), or a side of the FlexMod is not a captured array and not a constant of the code,
the function is marked untraceable-by-key and traced at every call.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any

import jax
import numpy as np

from ._mod import FlexMod, trace_mask_mod, trace_score_mod

_KEPT = 64
_CACHE: "collections.OrderedDict[tuple, tuple[FlexMod, tuple]]" = collections.OrderedDict()
# Keys whose functions were found to depend on a captured array's value: traced at every call.
_UNKEYABLE: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()
_LIBRARIES = ("jax", "jaxlib", "numpy", "math", "builtins", "operator")


class _NoKey(Exception):
    """The mod reaches a value the key cannot describe: trace it at every call."""


class _Reach:
    """Walks what a function's trace can depend on, building the key and listing the slots of side arrays."""

    def __init__(self):
        self.slots: list[tuple] = []  # ("cell", cell) or ("global", dict, name): where a side array lives
        self.slot_ids: set = set()
        self.seen_functions: set = set()

    def value_key(self, value: Any, slot: tuple | None) -> tuple:
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return ("py", type(value).__name__, repr(value))
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__)
        if isinstance(value, jax.core.Tracer):
            raise _NoKey
        if isinstance(value, jax.Array):
            if value.ndim == 0 or slot is None:  # 0-d: inlined as a literal; no slot: cannot be swapped
                if value.ndim != 0:
                    raise _NoKey
                return ("jax0", str(value.dtype), np.asarray(value).tobytes())
            slot_id = (id(slot[1]), slot[2]) if slot[0] == "global" else id(slot[1])
            if slot_id not in self.slot_ids:
                self.slot_ids.add(slot_id)
                self.slots.append(slot)
            return ("jax", str(value.dtype), tuple(value.shape), bool(getattr(value, "weak_type", False)))
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            return ("numpy", array.dtype.str, array.shape, array.tobytes())
        if isinstance(value, tuple):
            return ("tuple", *(self.value_key(v, None) for v in value))
        if isinstance(value, types.FunctionType):
            if (value.__module__ or "").split(".")[0] in _LIBRARIES:
                return ("library", value)
            return self.function_key(value)
        if callable(value) and (getattr(value, "__module__", None) or "").split(".")[0] in _LIBRARIES:
            try:
                hash(value)
            except TypeError:
                raise _NoKey from None
            return ("library", value)
        raise _NoKey

    def function_key(self, fn: types.FunctionType) -> tuple:
        if id(fn) in self.seen_functions:
            return ("recursive", fn.__code__)
        self.seen_functions.add(id(fn))
        code = fn.__code__
        cells = tuple(self.value_key(_cell_value(cell), ("cell", cell)) for cell in (fn.__closure__ or ()))
        defaults = tuple(self.value_key(v, None) for v in (fn.__defaults__ or ()))
        kwdefaults = tuple(sorted((k, self.value_key(v, None)) for k, v in (fn.__kwdefaults__ or {}).items()))
        names = []
        for name in sorted(_global_names(code)):
            if name in fn.__globals__:
                names.append((name, self.value_key(fn.__globals__[name], ("global", fn.__globals__, name))))
        return ("function", code, cells, defaults, kwdefaults, tuple(names))


def _cell_value(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later in the enclosing function)
        raise _NoKey from None


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _read(slot: tuple) -> Any:
    return slot[1].cell_contents if slot[0] == "cell" else slot[1][slot[2]]


def _write(slot: tuple, value: Any) -> None:
    if slot[0] == "cell":
        slot[1].cell_contents = value
    else:
        slot[1][slot[2]] = value


def _trace_fn(fn, kind: str, side_grads: bool) -> FlexMod:
    return trace_score_mod(fn, side_grads=side_grads) if kind == "score" else trace_mask_mod(fn)


def _abstract_args(kind: str) -> tuple:
    i32 = jax.ShapeDtypeStruct((), np.int32)
    return ((jax.ShapeDtypeStruct((), np.float32),) if kind == "score" else ()) + (i32,) * 4


def _structure_with_tracers(fn, kind: str, slots: list[tuple], values: list) -> tuple[str, list[int | None]] | None:
    """The mod's jaxpr text traced with the side arrays in `slots` swapped for tracers of an outer trace, and per
    constant of that jaxpr the slot it reads (None: a constant of the code); None where that trace fails."""
    found = {}

    def outer(*tracers):
        for slot, tracer in zip(slots, tracers):
            _write(slot, tracer)
        try:
            closed = jax.make_jaxpr(lambda *args: fn(*args))(*_abstract_args(kind))
        finally:
            for slot, value in zip(slots, values):
                _write(slot, value)
        positions = []
        for const in closed.consts:
            matches = [i for i, t in enumerate(tracers) if const is t]
            positions.append(matches[0] if matches else None)
        found["structure"] = (str(closed.jaxpr), positions)
        return 0

    try:
        jax.make_jaxpr(outer)(*(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values))
    except Exception:  # the mod needs a value in Python (a concretization error), or anything else: no cache
        return None
    return found.get("structure")


def _side_sources(mod: FlexMod, fn, kind: str, slots: list[tuple], values: list) -> tuple[int | None, ...] | None:
    """Per side of `mod`, the index of the slot it is read from (None: a constant of the code, kept), or None where
    the trace may depend on a side array's value (then no entry is made)."""
    closed = jax.make_jaxpr(lambda *args: fn(*args))(*_abstract_args(kind))
    real = []
    for const in closed.consts:
        matches = [i for i, v in enumerate(values) if const is v]
        real.append(matches[0] if matches else None)
    probed = _structure_with_tracers(fn, kind, slots, values) if slots else (str(closed.jaxpr), real)
    if probed is None or probed != (str(closed.jaxpr), real):
        return None
    # A side is a captured array (by identity: the trace read it from its slot) or a constant of the code (the
    # structure check above leaves no third kind: a value computed from a captured array outside JAX's trace
    # would have shown as a constant where the probe has a tracer).
    return tuple(next((i for i, v in enumerate(values) if side is v), None) for side in mod.side_values)


def traced_mod(fn, kind: str, side_grads: bool = False) -> FlexMod:
    """The FlexMod of the Python mod `fn` (trace_score_mod / trace_mask_mod), from the cache where its key (the
    module docstring) was seen, with its sides read from the current captured arrays."""
    if not isinstance(fn, types.FunctionType):
        return _trace_fn(fn, kind, side_grads)
    reach = _Reach()
    try:
        key = (kind, bool(side_grads), bool(jax.config.jax_enable_x64), reach.function_key(fn))
        hash(key)
    except (_NoKey, TypeError):
        return _trace_fn(fn, kind, side_grads)
    if key in _UNKEYABLE:
        return _trace_fn(fn, kind, side_grads)
    slots = reach.slots
    values = [_read(slot) for slot in slots]
    entry = _CACHE.get(key)
    if entry is not None:
        _CACHE.move_to_end(key)
        mod, sources = entry
        sides = tuple(values[source] if source is not None else cached
                      for source, cached in zip(sources, mod.side_values))
        return dataclasses.replace(mod, side_values=sides)
    mod = _trace_fn(fn, kind, side_grads)
    sources = _side_sources(mod, fn, kind, slots, values)
    if sources is None:
        _UNKEYABLE[key] = None
        while len(_UNKEYABLE) > _KEPT:
            _UNKEYABLE.popitem(last=False)
        return mod
    _CACHE[key] = (mod, sources)
    while len(_CACHE) > _KEPT:
        _CACHE.popitem(last=False)
    return mod


def clear() -> None:
    """Forget every cached trace (tests; a mod's code changed in place by a debugger)."""
    _CACHE.clear()
    _UNKEYABLE.clear()

