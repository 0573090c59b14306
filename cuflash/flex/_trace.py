"""Tracing a Python mod with JAX and emitting its jaxpr as the body of a C++ device function.

`trace(fn, kind)` runs `jax.make_jaxpr` on the mod with scalar float32 / int32 arguments (inside a jit
trace too: its captured arrays are then that trace's tracers), checks arity, result and control flow, and
returns the closed jaxpr whose constants are the captured arrays. `emit_body` walks a jaxpr, inlining
the bodies of call-like primitives (jit, closed_call, custom_jvp_call, custom_vjp_call, remat), and
hands every other primitive to cuflash.flex._emit.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from ._emit import _C_TYPE, EmitError, Emitter, _Tensor, dtype_name, literal

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
# Primitives whose body is a jaxpr evaluated in place of the call.
_INLINED = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "remat2", "checkpoint"}


def describe(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def arg_names(kind: str) -> tuple[str, ...]:
    return SCORE_ARGS if kind == "score" else MASK_ARGS


def _in_avals(kind: str):
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    ints = (i32,) * 4
    return (jax.ShapeDtypeStruct((), jnp.float32), *ints) if kind == "score" else ints


def _check_arity(fn, kind: str) -> None:
    label = f"{kind}_mod {describe(fn)}"
    if not callable(fn):
        raise TypeError(f"{label} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to check (a builtin): tracing finds out
    try:
        signature.bind(*arg_names(kind))
    except TypeError as e:
        raise TypeError(f"{label} must take ({', '.join(arg_names(kind))}) positionally: {e}") from None


def trace(fn, kind: str, *, derivative: bool = False) -> ClosedJaxpr:
    """The closed jaxpr of the mod (or of its derivative in score), checked for arity and for Python control
    flow on traced values (check_result checks what it returns)."""
    label = f"{kind}_mod {describe(fn)}"
    _check_arity(fn, kind)
    target = jax.grad(fn, argnums=0) if derivative else fn
    try:
        # Through a new function each time: make_jaxpr caches its trace per function object, so tracing `fn` itself
        # again would return the first trace's constants after the mod's captured array was replaced.
        closed = jax.make_jaxpr(lambda *args: target(*args))(*_in_avals(kind))
    except jax.errors.ConcretizationTypeError as e:  # TracerBoolConversionError and its kin among them
        raise TypeError(f"{label} uses Python control flow (if / while / bool() / int()) on a traced value; "
                        f"use jnp.where or lax.select instead ({type(e).__name__})") from None
    except (jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError) as e:
        raise TypeError(f"{label} converts a traced value to a Python or NumPy value ({type(e).__name__}); "
                        "mods must stay in jax.numpy") from None
    return closed


def check_result(closed: ClosedJaxpr, fn, kind: str) -> None:
    """One scalar result of the kind's dtype: float32 (score) or bool (mask)."""
    outs = closed.out_avals
    want = "float32" if kind == "score" else "bool"
    if len(outs) != 1 or tuple(outs[0].shape) != () or dtype_name(outs[0].dtype) != want:
        got = ", ".join(f"{dtype_name(a.dtype)}{list(a.shape)}" for a in outs) or "nothing"
        raise TypeError(f"{kind}_mod {describe(fn)} returns {got}; a {kind}_mod returns one {want} scalar")


def _check_dtype(var, primitive: str) -> None:
    name = dtype_name(var.aval.dtype)
    if name not in _C_TYPE:
        raise EmitError(primitive, f"makes a {name} value (supported: {', '.join(sorted(_C_TYPE))}; "
                                   "64-bit types under jax_enable_x64 are not)")


def _sub_jaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if isinstance(sub, (ClosedJaxpr, Jaxpr)):
            return sub
    raise EmitError(eqn.primitive.name, f"calls {eqn.primitive.name} without a jaxpr body to inline")


def _literal_tensor(value, aval) -> _Tensor:
    dtype = dtype_name(aval.dtype)
    if dtype not in _C_TYPE:
        raise EmitError("literal", f"has a {dtype} constant")
    return _Tensor(dtype, (), (literal(np.asarray(value).reshape(()), dtype),))


def _eval(em: Emitter, jaxpr: Jaxpr, consts: list, args: list) -> list:
    env = {}
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value

    def read(atom):
        return _literal_tensor(atom.val, atom.aval) if isinstance(atom, Literal) else env[atom]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        for var in (*eqn.invars, *eqn.outvars):
            _check_dtype(var, name)
        args_in = [read(a) for a in eqn.invars]
        if name in _INLINED:
            sub = _sub_jaxpr(eqn)
            if isinstance(sub, ClosedJaxpr):
                inner = [_inner_const(c, v, name) for c, v in zip(sub.consts, sub.jaxpr.constvars)]
                outs = _eval(em, sub.jaxpr, inner, args_in)
            else:
                outs = _eval(em, sub, [], args_in)
        else:
            if len(eqn.outvars) != 1:
                raise EmitError(name, f"({len(eqn.outvars)} results) is not a primitive cuflash.flex can emit")
            try:
                outs = em.apply(name, eqn.params, args_in, [v.aval for v in eqn.outvars])
            except EmitError as e:
                if e.primitive == "?":
                    raise EmitError(name, str(e)) from None
                raise
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _inner_const(value, var, primitive: str) -> _Tensor:
    if np.ndim(value) != 0:
        raise EmitError(primitive, "holds an array constant inside a nested function (capture arrays at the top "
                                   "level of the mod)")
    return _literal_tensor(value, var.aval)


def side_grads_jaxpr(closed: ClosedJaxpr, positions: list[int]) -> ClosedJaxpr:
    """The jaxpr of (g, score, b, h, q_idx, kv_idx, *constants) -> the vjp of the score mod `closed` with
    cotangent g, in the constants at `positions` (its float captured arrays), as jax.vjp transposes it."""
    jaxpr = closed.jaxpr
    opened = jaxpr_as_fun(ClosedJaxpr(jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars]), []))

    def grads(g, score, b, h, q_idx, kv_idx, *consts):
        def of_floats(*floats):
            full = list(consts)
            for position, value in zip(positions, floats):
                full[position] = value
            return opened(*full, score, b, h, q_idx, kv_idx)[0]

        _, vjp = jax.vjp(of_floats, *(consts[p] for p in positions))
        return vjp(g)

    consts = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.constvars]
    return jax.make_jaxpr(grads)(jax.ShapeDtypeStruct((), jnp.float32), *_in_avals("score"), *consts)


def emit_side_grads(closed: ClosedJaxpr, side_of_const: list[int], positions: list[int],
                    sides: list[tuple[str, tuple[int, ...]]], fast_math: bool = False) -> str:
    """Statements adding g * d score_mod / d side into grads.arrays[side] (float32, contiguous) with atomic
    adds, for the sides of the constants at `positions`; `closed` is side_grads_jaxpr's."""
    em = Emitter(sides, fast_math=fast_math)
    args = [_Tensor(dtype_name(a.aval.dtype), (), (name,)) for a, name in zip(closed.jaxpr.invars, ("g", *SCORE_ARGS))]
    windows = [em.side_window(k) for k in side_of_const]
    inner = [_inner_const(c, v, "vjp") for c, v in zip(closed.consts, closed.jaxpr.constvars)]
    outs = _eval(em, closed.jaxpr, inner, [*args, *windows])
    for position, cotangent in zip(positions, outs):
        side = side_of_const[position]
        em.add_into(cotangent, f"grads.arrays[{side}]", sides[side][1], "side gradient")
    return em.body(None)


def emit_body(closed: ClosedJaxpr, side_of_const: list[int], sides: list[tuple[str, tuple[int, ...]]],
              kind: str, fast_math: bool = False) -> str:
    """The C++ statements (ending in `return`) evaluating `closed` on the C parameters of `kind`.
    side_of_const[i]: the side index of the jaxpr's i-th constant."""
    em = Emitter(sides, fast_math=fast_math)
    args = [_Tensor(dtype_name(a.aval.dtype), (), (name,)) for a, name in zip(closed.jaxpr.invars, arg_names(kind))]
    consts = [em.side_window(k) for k in side_of_const]
    (out,) = _eval(em, closed.jaxpr, consts, args)
    result = em.read(out, "result")
    return em.body(result.elems[0])
