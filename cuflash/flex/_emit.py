"""Jaxpr -> CUDA C++: the body of one device function evaluating a traced mod's jaxpr, primitive by primitive.

Every value of the jaxpr is either a small tensor of C scalar expressions (`_Tensor`: a scalar, or the
few-element index vectors gathers take) or a window into a side array that has not been read yet
(`_Window`: jnp indexing slices, squeezes and gathers it before one element is read, so a
`bias[h, q_idx - kv_idx]` is one load, not a row of them), or, in a vjp, a side's cotangent (`_Scattered`:
zeros plus the windows a scatter-add / dynamic_update_slice / pad put values in, emitted as atomic adds
into a gradient buffer). Each primitive is emitted with XLA's semantics
in float32 / int32 (cuda_src/common/flex_mod.cuh has the helpers C operators lack); products use
__fmul_rn so no compiler contracts a product and a sum into an FMA the jaxpr does not have.

Errors are `EmitError(primitive, message)`; cuflash.flex._trace turns them into TypeErrors naming the mod.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace

import numpy as np

# Dtypes a jaxpr value may have, and the C type holding it (16-bit floats are floats holding a
# representable value; 8-bit ints are ints in range).
_C_TYPE = {"float32": "float", "float16": "float", "bfloat16": "float", "int32": "int", "int8": "int",
           "uint8": "int", "bool": "bool"}
_FLOATS = ("float32", "float16", "bfloat16")
_INTS = ("int32", "int8", "uint8")
# Rounding / wrapping after each result of a narrow dtype.
_NARROW = {"float16": "cuflash::flex::round_to_half", "bfloat16": "cuflash::flex::round_to_bfloat16",
           "int8": "cuflash::flex::wrap_int8", "uint8": "cuflash::flex::wrap_uint8"}
# The C type a side element is read as (flex_mod.cuh's side_read<T>).
SIDE_C_TYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int",
               "int8": "int", "uint8": "int", "bool": "bool"}
# Elements a tensor value (or a window read whole) may have: mods are scalar functions.
MAX_ELEMENTS = 64


class EmitError(Exception):
    def __init__(self, primitive: str, message: str):
        super().__init__(message)
        self.primitive = primitive


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


@dataclass(frozen=True)
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    elems: tuple[str, ...]  # row-major C expressions (variable names or literals)


@dataclass(frozen=True)
class _Window:
    """A window of side array `side` (not read yet): view axis i is side dim axes[i] (None: a unit axis)
    of size sizes[i]; side dim d starts at starts[d]. Out of `valid` (if set) it reads as `fill`."""

    side: int
    dtype: str
    side_shape: tuple[int, ...]
    starts: tuple[str, ...]
    axes: tuple[int | None, ...]
    sizes: tuple[int, ...]
    valid: str | None = None
    fill: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sizes


@dataclass(frozen=True)
class _Entry:
    """Values added into a window of a scattered array: window [starts, starts + sizes) per dim, `values`
    row-major over it; nothing is added where `valid` (if set) is false."""

    starts: tuple[str, ...]
    sizes: tuple[int, ...]
    values: tuple[str, ...]
    valid: str | None = None


@dataclass(frozen=True)
class _Scattered:
    """An array of zeros plus entries: the cotangent of a side array in a vjp (a gather's transpose is a
    scatter-add, a dynamic_slice's a dynamic_update_slice into zeros). Emitted as atomic adds."""

    dtype: str
    shape: tuple[int, ...]
    entries: tuple[_Entry, ...] = ()


def literal(value, dtype: str) -> str:
    """A C expression of exactly `value` in `dtype` (floats as hex literals: exact bits)."""
    if dtype == "bool":
        return "true" if bool(value) else "false"
    if dtype in _INTS:
        v = int(value)
        if v == -(2**31):
            return "(-2147483647 - 1)"
        return f"({v})" if v < 0 else str(v)
    f = np.float32(np.asarray(value).astype(np.float32 if dtype == "float32" else dtype).astype(np.float32))
    if not np.isfinite(f):
        bits = int(f.view(np.uint32))
        return f"__uint_as_float(0x{bits:08x}u)"
    text = float(f).hex() + "f"
    return f"({text})" if text.startswith("-") else text


@dataclass
class Emitter:
    """Emits one function body. `sides`: (dtype name, shape) of each side array, by side index."""

    sides: list[tuple[str, tuple[int, ...]]]
    statements: list[tuple[str, str, str]] = field(default_factory=list)  # (C type, name, expression)
    effects: list[str] = field(default_factory=list)  # statements with side effects, in order (atomic adds)
    _reads: dict = field(default_factory=dict)  # window -> its tensor: a window used twice is loaded once
    _count: itertools.count = field(default_factory=itertools.count)
    fast_math: bool = False  # _FAST_MATH's approximate forms for division, tanh and exp; factored products
    # fast_math: name -> (f, base) for a float32 value bound as `(base * f)`, f a constant: products and quotients by
    # constants gather into f, and sums of equal factors add their bases (_factored), so the statement `(base * f)`
    # is dropped as dead unless something else reads the value.
    factored: dict = field(default_factory=dict)

    # ---- statements -------------------------------------------------------------------------
    def bind(self, dtype: str, expr: str) -> str:
        name = f"v{next(self._count)}"
        self.statements.append((_C_TYPE[dtype], name, expr))
        return name

    def body(self, result: str | None, indent: str = "    ") -> str:
        """The statements the result and the effects depend on (dead ones dropped), the effects, then the
        return (none for a void function: result None)."""
        tail = [f"{indent}{e}" for e in self.effects] + ([f"{indent}return {result};"] if result is not None else [])
        live, needed = [], set(re.findall(r"\bv\d+\b", "\n".join(tail)))
        for ctype, name, expr in reversed(self.statements):
            if name in needed:
                live.append(f"{indent}const {ctype} {name} = {expr};")
                needed |= set(re.findall(r"\bv\d+\b", expr))
        return "\n".join([*reversed(live), *tail])

    def add_into(self, value, buffer: str, shape: tuple[int, ...], primitive: str) -> None:
        """Effects adding `value` (a cotangent of `shape`) into the contiguous float32 array `buffer`."""
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        if isinstance(value, _Scattered):
            for entry in value.entries:
                for k, index in enumerate(itertools.product(*(range(n) for n in entry.sizes))):
                    if _is_zero(entry.values[k]):
                        continue
                    terms = [f"static_cast<long long>({start}{f' + {i}' if i else ''}) * {stride}"
                             for start, i, stride in zip(entry.starts, index, strides)]
                    add = f"cuflash::arch::atomic_add({buffer} + ({' + '.join(terms) or '0'}), {entry.values[k]});"
                    self.effects.append(f"if ({entry.valid}) {add}" if entry.valid else add)
            return
        t = self.read(value, primitive)
        for k, e in enumerate(t.elems):
            if not _is_zero(e):
                self.effects.append(f"cuflash::arch::atomic_add({buffer} + {k}, {e});")

    # ---- values -------------------------------------------------------------------------------
    def side_window(self, side: int) -> _Window:
        dtype, shape = self.sides[side]
        return _Window(side, dtype, shape, ("0",) * len(shape), tuple(range(len(shape))), shape)

    def read(self, value, primitive: str) -> _Tensor:
        """The value as a tensor of scalars (a window's elements read from its side array)."""
        if isinstance(value, _Tensor):
            return value
        if isinstance(value, _Scattered):
            if value.entries or math.prod(value.shape) > MAX_ELEMENTS:
                raise EmitError(primitive, "uses a scattered array (a side's cotangent) as a value")
            return _Tensor(value.dtype, value.shape, (literal(0, value.dtype),) * math.prod(value.shape))
        w = value
        if w in self._reads:
            return self._reads[w]
        count = math.prod(w.sizes)
        if count > MAX_ELEMENTS:
            raise EmitError(primitive, f"reads {count} elements of a captured array at once (at most {MAX_ELEMENTS}: "
                                       "index it down to the elements the mod needs)")
        elems = []
        for index in itertools.product(*(range(n) for n in w.sizes)):
            at = list(w.starts)
            for i, axis in zip(index, w.axes):
                if axis is not None and i:
                    at[axis] = f"({at[axis]} + {i})"
            terms = [f"static_cast<long long>({a}) * sides.arrays[{w.side}].strides[{d}]" for d, a in enumerate(at)]
            offset = " + ".join(terms) if terms else "0"
            load = f"cuflash::flex::side_read<{SIDE_C_TYPE[w.dtype]}>(sides.arrays[{w.side}], {offset})"
            if w.valid is not None:
                load = f"({w.valid} ? {load} : {w.fill})"
            elems.append(self.bind(w.dtype, load))
        self._reads[w] = _Tensor(w.dtype, w.sizes, tuple(elems))
        return self._reads[w]

    # ---- the primitives --------------------------------------------------------------------------
    def apply(self, primitive: str, params: dict, args: list, out_avals: list) -> list:
        out_dtype = dtype_name(out_avals[0].dtype)
        out_shape = tuple(out_avals[0].shape)
        structural = _STRUCTURAL.get(primitive)
        if structural is not None:
            return [structural(self, params, args, out_shape, out_dtype)]
        if primitive in ("add", "add_any") and all(isinstance(a, _Scattered) for a in args):
            return [_Scattered(out_dtype, out_shape, args[0].entries + args[1].entries)]
        rule = (_FAST_MATH.get(primitive) if self.fast_math else None) or _ELEMENTWISE.get(primitive)
        if rule is None:
            raise EmitError(primitive, "is not a primitive cuflash.flex can emit")
        tensors = [self.read(a, primitive) for a in args]
        in_dtypes = [t.dtype for t in tensors]
        factoring = self.fast_math and primitive in _FACTORED and all(d == "float32" for d in (*in_dtypes, out_dtype))
        count = math.prod(out_shape)
        elems = []
        for i in range(count):
            operands = [t.elems[i] if len(t.elems) > 1 else t.elems[0] for t in tensors]
            factored = self._factored(primitive, *operands) if factoring else None
            if factored is not None:
                elems.append(factored)
                continue
            expr = rule(operands, in_dtypes, out_dtype, params)
            if primitive not in _EXACT_RESULT and out_dtype in _NARROW:
                expr = f"{_NARROW[out_dtype]}({expr})"
            elems.append(self.bind(out_dtype, expr))
        return [_Tensor(out_dtype, out_shape, tuple(elems))]

    def _factored(self, primitive: str, a: str, b: str) -> str | None:
        """fast_math's float32 a op b with constant factors gathered (``factored``), or None for the primitive's
        own rule: two constants fold here; a product or quotient by a constant multiplies the factor; a product of
        two values multiplies their bases and factors; a sum or difference of equal factors adds the bases. Products
        are written `a * b`, which the compiler may contract with a sum into an FMA."""
        ka, kb = _float_literal_value(a), _float_literal_value(b)
        if ka is not None and kb is not None:
            with np.errstate(all="ignore"):
                value = {"mul": ka * kb, "div": ka / kb, "add": ka + kb, "add_any": ka + kb, "sub": ka - kb}[primitive]
            return literal(value, "float32")
        (fa, ba), (fb, bb) = self.factored.get(a, (1.0, a)), self.factored.get(b, (1.0, b))
        if primitive == "mul" and (ka is not None or kb is not None):
            (f, base), k = ((fb, bb), ka) if ka is not None else ((fa, ba), kb)
            return self._scaled(float(np.float32(f) * k), base)
        if primitive == "div" and kb is not None:
            return self._scaled(float(np.float32(fa) / kb), ba) if kb != 0 else None
        if ka is not None or kb is not None:
            return None
        if primitive == "mul":
            return self._scaled(float(np.float32(fa) * np.float32(fb)), self.bind("float32", f"({ba} * {bb})"))
        if primitive in ("add", "add_any", "sub") and fa == fb:
            op = "-" if primitive == "sub" else "+"
            return self._scaled(fa, self.bind("float32", f"({ba} {op} {bb})"))
        return None

    def _scaled(self, factor: float, base: str) -> str | None:
        """The value factor * base: base itself for a factor of 1, else a name bound as `(base * factor)` and
        remembered as factored; None where the factor is no normal float32 (the primitive's own rule then)."""
        if factor == 1.0:
            return base
        if not (math.isfinite(factor) and abs(factor) >= np.finfo(np.float32).tiny):
            return None
        name = self.bind("float32", f"({base} * {literal(factor, 'float32')})")
        self.factored[name] = (factor, base)
        return name


# fast_math's primitives whose float32 constant factors the Emitter gathers (Emitter._factored).
_FACTORED = ("mul", "div", "add", "add_any", "sub")


def _float_literal_value(expr: str) -> np.float32 | None:
    """The value of a finite float32 literal as ``literal`` writes it, else None."""
    match = _FLOAT_LITERAL.match(expr)
    return np.float32(float.fromhex(match.group(1))) if match else None


# ---- elementwise rules: (operand expressions, operand dtypes, result dtype, params) -> C expression ----

def _float_or_int(float_expr, int_expr, bool_expr=None):
    def rule(ops, dtypes, out, params):
        kind = dtypes[0]
        if kind in _FLOATS:
            if float_expr is None:
                raise EmitError("?", f"takes {kind} operands, which it cannot (integers and bool only)")
            return float_expr(*ops)
        if kind == "bool":
            if bool_expr is None:
                raise EmitError("?", "takes bool operands, which it cannot")
            return bool_expr(*ops)
        if int_expr is None:
            raise EmitError("?", f"takes {kind} operands, which it cannot (float only)")
        return int_expr(*ops)
    return rule


def _float_only(fn):
    return _float_or_int(fn, None)


def _convert(ops, dtypes, out, params):
    (a,), src = ops, dtypes[0]
    if src == out:
        return a
    if out in _FLOATS:
        if src in _FLOATS:
            value = a
        elif src == "bool":
            value = f"({a} ? 1.f : 0.f)"
        else:
            value = f"static_cast<float>({a})"
        return f"{_NARROW[out]}({value})" if out in _NARROW else value
    if out == "bool":
        return f"({a} != 0)" if src != "bool" else a
    # integer results
    if src in _FLOATS:
        if out != "int32":
            raise EmitError("convert_element_type", f"converts {src} to {out} (float -> int goes to int32 only)")
        return f"cuflash::flex::float_to_int({a})"
    value = f"({a} ? 1 : 0)" if src == "bool" else a
    return f"{_NARROW[out]}({value})" if out in _NARROW else value


def _select_n(ops, dtypes, out, params):
    which, *cases = ops
    if dtypes[0] == "bool":
        return f"({which} ? {cases[1]} : {cases[0]})"
    expr = cases[-1]
    for i in range(len(cases) - 2, -1, -1):
        expr = f"({which} == {i} ? {cases[i]} : {expr})"
    return expr


def _integer_pow(ops, dtypes, out, params):
    (x,), y = ops, int(params["y"])
    mul = "__fmul_rn" if dtypes[0] in _FLOATS else "cuflash::flex::wrap_mul"
    if y == 0:
        return literal(1, out)
    if y < 0 and dtypes[0] not in _FLOATS:
        raise EmitError("integer_pow", "raises an integer to a negative power")
    # Square and multiply in the order jax's integer_pow lowering multiplies (each product rounded).
    acc, n = None, abs(y)
    while n > 0:
        if n & 1:
            acc = x if acc is None else f"{mul}({acc}, {x})"
        n >>= 1
        if n > 0:
            x = f"{mul}({x}, {x})"
    return f"(1.f / {acc})" if y < 0 else acc


def _round(ops, dtypes, out, params):
    method = int(params["rounding_method"])  # 0: half away from zero, 1: half to even
    return f"rintf({ops[0]})" if method == 1 else f"roundf({ops[0]})"


def _clamp(ops, dtypes, out, params):
    lo, x, hi = ops
    if out in _FLOATS:
        return f"cuflash::flex::float_min(cuflash::flex::float_max({x}, {lo}), {hi})"
    return f"({x} < {lo} ? {lo} : ({x} > {hi} ? {hi} : {x}))"


def _pow(ops, dtypes, out, params):
    if dtypes[1] not in _FLOATS:
        raise EmitError("pow", f"raises to a {dtypes[1]} power (use integer_pow or a float exponent)")
    return f"powf({ops[0]}, {ops[1]})"


def _compare(op):
    return lambda ops, dtypes, out, params: f"({ops[0]} {op} {ops[1]})"


def _unary(name):
    return _float_only(lambda a: f"{name}({a})")


_ELEMENTWISE = {
    "add": _float_or_int(lambda a, b: f"({a} + {b})", lambda a, b: f"cuflash::flex::wrap_add({a}, {b})"),
    "add_any": _float_or_int(lambda a, b: f"({a} + {b})", lambda a, b: f"cuflash::flex::wrap_add({a}, {b})"),
    "sub": _float_or_int(lambda a, b: f"({a} - {b})", lambda a, b: f"cuflash::flex::wrap_sub({a}, {b})"),
    "mul": _float_or_int(lambda a, b: f"__fmul_rn({a}, {b})", lambda a, b: f"cuflash::flex::wrap_mul({a}, {b})",
                         lambda a, b: f"({a} && {b})"),
    "div": _float_or_int(lambda a, b: f"({a} / {b})", lambda a, b: f"cuflash::flex::int_div({a}, {b})"),
    "rem": _float_or_int(lambda a, b: f"fmodf({a}, {b})", lambda a, b: f"cuflash::flex::int_rem({a}, {b})"),
    "neg": _float_or_int(lambda a: f"(-{a})", lambda a: f"cuflash::flex::wrap_neg({a})"),
    "abs": _float_or_int(lambda a: f"fabsf({a})", lambda a: f"cuflash::flex::int_abs({a})"),
    "sign": _float_or_int(lambda a: f"cuflash::flex::float_sign({a})", lambda a: f"cuflash::flex::int_sign({a})"),
    "square": _float_or_int(lambda a: f"__fmul_rn({a}, {a})", lambda a: f"cuflash::flex::wrap_mul({a}, {a})"),
    "max": _float_or_int(lambda a, b: f"cuflash::flex::float_max({a}, {b})", lambda a, b: f"({a} > {b} ? {a} : {b})",
                         lambda a, b: f"({a} || {b})"),
    "min": _float_or_int(lambda a, b: f"cuflash::flex::float_min({a}, {b})", lambda a, b: f"({a} < {b} ? {a} : {b})",
                         lambda a, b: f"({a} && {b})"),
    "and": _float_or_int(None, lambda a, b: f"({a} & {b})", lambda a, b: f"({a} && {b})"),
    "or": _float_or_int(None, lambda a, b: f"({a} | {b})", lambda a, b: f"({a} || {b})"),
    "xor": _float_or_int(None, lambda a, b: f"({a} ^ {b})", lambda a, b: f"({a} != {b})"),
    "not": _float_or_int(None, lambda a: f"(~{a})", lambda a: f"(!{a})"),
    "eq": _compare("=="), "ne": _compare("!="), "lt": _compare("<"), "le": _compare("<="),
    "gt": _compare(">"), "ge": _compare(">="),
    "exp": _unary("expf"), "exp2": _unary("exp2f"), "log": _unary("logf"), "log1p": _unary("log1pf"),
    "expm1": _unary("expm1f"), "tanh": _unary("tanhf"), "sqrt": _unary("sqrtf"), "rsqrt": _unary("rsqrtf"),
    "cbrt": _unary("cbrtf"), "sin": _unary("sinf"), "cos": _unary("cosf"), "tan": _unary("tanf"),
    "floor": _unary("floorf"), "ceil": _unary("ceilf"), "logistic": _unary("cuflash::flex::logistic"),
    "is_finite": _unary("cuflash::flex::float_is_finite"),
    "atan2": _float_only(lambda a, b: f"atan2f({a}, {b})"),
    "round": _round, "integer_pow": _integer_pow, "pow": _pow, "clamp": _clamp,
    "select_n": _select_n, "convert_element_type": _convert,
    "copy": lambda ops, dtypes, out, params: ops[0], "copy_p": lambda ops, dtypes, out, params: ops[0],
    # Sharding annotations change where a value lives, not its value: jax.grad under a mesh (sharded jit) seeds the
    # derivative in score with a resharded 1.0.
    "reshard": lambda ops, dtypes, out, params: ops[0],
    "sharding_constraint": lambda ops, dtypes, out, params: ops[0],
}
# trace_score_mod(fn, fast_math=True): the forms the built-in score hook (mask.cuh's ScoreHook) uses, for what a
# mod's arithmetic costs there. IEEE division and tanhf/expf each add a slow path or a long polynomial per score
# (the tensor-core loops run at the register limit); these are a few instructions, approximate (about 2 ulp for
# __fdividef within its range, tanh and exp to ex2.approx's relative 2^-22 plus the argument's rounding), so
# results no longer match eager JAX bitwise. Integer division is exact either way.
_FAST_MATH = {
    "div": _float_or_int(lambda a, b: f"__fdividef({a}, {b})", lambda a, b: f"cuflash::flex::int_div({a}, {b})"),
    "tanh": _unary("cuflash::tanh_by_exp2"),
    "exp": _float_only(lambda a: f"cuflash::arch::exp2_approx(__fmul_rn({a}, cuflash::kLog2e))"),
}

# A fast-math score_mod whose every function reads the score only as one product, `score * c` or `score / c` with the
# same constant factor f (c, or 1 / c), as softcap's `cap * tanh(score / cap)` does: its functions take score * f
# (flex_mod.cuh's kScoreFactor) and the kernels fold f into the softmax scale they multiply q.k by, one product per
# score fewer (score = q.k * scale, then score * f: two roundings; q.k * (scale * f): one). Exact mods keep both.
# In fast-math emission every such product is Emitter._scaled's statement `(score * f)`, f a normal float32 (a factor
# it cannot write leaves the primitive's own rule, which reads the score otherwise: no fold).
_SCORE_PRODUCT = re.compile(r"^(?P<head>\s*const float v\d+ = )\(score \* (?P<factor>[^()]+|\(-[^()]+\))\);$")
_FLOAT_LITERAL = re.compile(r"^\(?(-?0x[0-9a-f]+(?:\.[0-9a-f]*)?p[+-]\d+)f\)?$")


def fold_score_factor(bodies: dict[str, str]) -> tuple[dict[str, str], float]:
    """``bodies`` (a score_mod's emitted functions) with the score's one product taken out, and its factor; the
    bodies unchanged and 1.0 where any function reads the score otherwise, or two products differ."""
    factors, folded = set(), {}
    for which, body in bodies.items():
        lines = body.split("\n")
        for i, line in enumerate(lines):
            if not re.search(r"\bscore\b", line):
                continue
            product = _SCORE_PRODUCT.match(line)
            factor = _float_literal_value(product["factor"]) if product else None
            if factor is None:
                return bodies, 1.0
            factors.add(float(factor))
            lines[i] = f"{product['head']}score;"
        folded[which] = "\n".join(lines)
    if len(factors) != 1:
        return bodies, 1.0
    return folded, factors.pop()


# Primitives whose result needs no rounding / wrapping to its dtype: it is one of the operands, converted by
# the rule itself, bool, or a bitwise and / or / xor of in-range values (not ~: ~ of a uint8 is negative).
_EXACT_RESULT = {"select_n", "convert_element_type", "copy", "copy_p", "reshard", "sharding_constraint", "eq", "ne",
                 "lt", "le", "gt", "ge", "is_finite", "max", "min", "clamp", "and", "or", "xor"}


# ---- structural primitives: shapes, slicing, indexing ---------------------------------------------

def _scalar_index(em: Emitter, value, primitive: str) -> str:
    t = em.read(value, primitive)
    if t.shape != () and len(t.elems) != 1:
        raise EmitError(primitive, "takes a non-scalar start index")
    if t.dtype not in _INTS:
        raise EmitError(primitive, f"takes a {t.dtype} index")
    return t.elems[0]


def _window_slice(w: _Window, starts: list[str], sizes: tuple[int, ...], clamp: bool) -> _Window:
    new_starts = list(w.starts)
    for i, (start, size) in enumerate(zip(starts, sizes)):
        axis = w.axes[i]
        if clamp:
            start = f"cuflash::flex::clamp_index({start}, 0, {w.sizes[i] - size})"
        if axis is not None and start != "0":
            new_starts[axis] = start if new_starts[axis] == "0" else f"({new_starts[axis]} + {start})"
    return replace(w, starts=tuple(new_starts), sizes=tuple(sizes))


def _tensor_at(t: _Tensor, index: tuple[int, ...]) -> str:
    flat = 0
    for i, n in zip(index, t.shape):
        flat = flat * n + i
    return t.elems[flat]


def _tensor(t: _Tensor, dtype: str, shape: tuple[int, ...], fn) -> _Tensor:
    if math.prod(shape) > MAX_ELEMENTS:
        raise EmitError("broadcast_in_dim", f"makes a {shape} array (at most {MAX_ELEMENTS} elements)")
    return _Tensor(dtype, shape, tuple(fn(index) for index in itertools.product(*(range(n) for n in shape))))


def _dynamic_slice(em, params, args, out_shape, out_dtype):
    operand, *starts = args
    sizes = tuple(params["slice_sizes"])
    starts = [_scalar_index(em, s, "dynamic_slice") for s in starts]
    if isinstance(operand, _Window):
        return _window_slice(operand, starts, sizes, clamp=True)
    if not all(re.fullmatch(r"\(?-?\d+\)?", s) for s in starts):
        raise EmitError("dynamic_slice", "indexes a computed array with a traced index (index captured arrays only)")
    at = [min(max(int(s.strip("()")), 0), n - k) for s, n, k in zip(starts, operand.shape, sizes)]
    return _tensor(operand, out_dtype, sizes, lambda ix: _tensor_at(operand, tuple(a + i for a, i in zip(at, ix))))


def _slice(em, params, args, out_shape, out_dtype):
    (operand,) = args
    if params.get("strides") not in (None, (1,) * len(out_shape)) and any(s != 1 for s in params["strides"]):
        raise EmitError("slice", "slices with strides")
    starts = tuple(int(s) for s in params["start_indices"])
    if isinstance(operand, _Window):
        return _window_slice(operand, [str(s) for s in starts], out_shape, clamp=False)
    return _tensor(operand, out_dtype, out_shape,
                   lambda ix: _tensor_at(operand, tuple(a + i for a, i in zip(starts, ix))))


def _squeeze(em, params, args, out_shape, out_dtype):
    (operand,) = args
    if isinstance(operand, _Scattered):
        return _scattered_to(operand, out_shape, _unit_reshape_dims(operand.shape, out_shape))
    if isinstance(operand, _Window):
        drop = {d % len(operand.sizes) for d in params["dimensions"]}
        keep = [i for i in range(len(operand.sizes)) if i not in drop]
        return replace(operand, axes=tuple(operand.axes[i] for i in keep), sizes=tuple(operand.sizes[i] for i in keep))
    return _Tensor(operand.dtype, out_shape, operand.elems)


def _reshape_window(w: _Window, out_shape: tuple[int, ...]) -> _Window | None:
    """The window with unit axes added or removed, or None if the reshape moves elements."""
    kept = [(a, n) for a, n in zip(w.axes, w.sizes) if n != 1]
    if [n for _, n in kept] != [n for n in out_shape if n != 1]:
        return None
    it = iter(kept)
    axes = tuple(next(it)[0] if n != 1 else None for n in out_shape)
    return replace(w, axes=axes, sizes=tuple(out_shape))


def _reshape(em, params, args, out_shape, out_dtype):
    operand = args[0]
    if params.get("dimensions") not in (None, ()):
        raise EmitError("reshape", "reshapes with a transpose")
    if isinstance(operand, _Scattered) and (dims := _unit_reshape_dims(operand.shape, out_shape)) is not None:
        return _scattered_to(operand, out_shape, dims)
    if isinstance(operand, _Window):
        w = _reshape_window(operand, out_shape)
        if w is not None:
            return w
        operand = em.read(operand, "reshape")
    return _Tensor(operand.dtype, out_shape, operand.elems)


def _broadcast_in_dim(em, params, args, out_shape, out_dtype):
    operand = args[0]
    dims = tuple(params["broadcast_dimensions"])
    if isinstance(operand, _Tensor) and operand.shape == () and _is_zero(operand.elems[0]) and math.prod(out_shape) > 1:
        return _Scattered(out_dtype, out_shape)  # zeros: what a cotangent is scattered into
    if isinstance(operand, _Scattered) and math.prod(out_shape) == math.prod(operand.shape):
        return _scattered_to(operand, out_shape, list(dims))
    if isinstance(operand, _Window) and math.prod(out_shape) == math.prod(operand.sizes) and dims == tuple(sorted(dims)):
        w = _reshape_window(operand, out_shape)
        if w is not None:
            return w
    t = em.read(operand, "broadcast_in_dim")
    return _tensor(t, out_dtype, out_shape,
                   lambda ix: _tensor_at(t, tuple(ix[d] if t.shape[k] != 1 else 0 for k, d in enumerate(dims))))


def _concatenate(em, params, args, out_shape, out_dtype):
    dim = int(params["dimension"])
    parts = [em.read(a, "concatenate") for a in args]
    offsets = list(itertools.accumulate([p.shape[dim] for p in parts], initial=0))

    def element(ix):
        k = max(i for i, o in enumerate(offsets[:-1]) if ix[dim] >= o)
        local = list(ix)
        local[dim] -= offsets[k]
        return _tensor_at(parts[k], tuple(local))

    return _tensor(parts[0], out_dtype, out_shape, element)


def _gather_fill(dtype: str, fill_value) -> str:
    """jax's gather fill: the given value, else NaN (floats), the minimum (signed), the maximum (unsigned), true."""
    if fill_value is not None:
        return literal(fill_value, dtype)
    if dtype in _FLOATS:
        return literal(np.nan, dtype)
    if dtype == "bool":
        return "true"
    info = np.iinfo(dtype)
    return literal(info.min if dtype != "uint8" else info.max, dtype)


def _gather(em, params, args, out_shape, out_dtype):
    operand, indices = args
    dn = params["dimension_numbers"]
    if not isinstance(operand, _Window):
        raise EmitError("gather", "gathers from a computed array (gather from captured arrays only)")
    if tuple(dn.operand_batching_dims) or tuple(dn.start_indices_batching_dims):
        raise EmitError("gather", "gathers with batching dimensions")
    idx = em.read(indices, "gather")
    if math.prod(idx.shape[:-1]) != 1:
        raise EmitError("gather", f"gathers {math.prod(idx.shape[:-1])} windows at once (one per mod call only)")
    mode = str(params["mode"]).rsplit(".", 1)[-1].upper()
    sizes = tuple(params["slice_sizes"])
    starts = ["0"] * len(operand.sizes)
    for k, d in enumerate(dn.start_index_map):
        starts[d] = idx.elems[k]
    valid, fill = operand.valid, operand.fill
    if "FILL" in mode:  # FILL_OR_DROP: a window not wholly inside the operand reads as the fill value
        checks = [f"({starts[d]} >= 0 && {starts[d]} <= {operand.sizes[d] - sizes[d]})" for d in dn.start_index_map]
        if checks:
            cond = em.bind("bool", " && ".join(checks))
            valid = cond if valid is None else em.bind("bool", f"({valid} && {cond})")
            fill = _gather_fill(out_dtype, params.get("fill_value"))
        clamp = False
    else:  # CLIP, and PROMISE_IN_BOUNDS as XLA evaluates it: start indices clamped into the operand
        clamp = True
    w = _window_slice(operand, starts, sizes, clamp=clamp)
    w = replace(w, valid=valid, fill=fill)
    # Collapsed dims go; the remaining window dims are the output's offset dims, the rest unit batch dims.
    keep = [i for i in range(len(sizes)) if i not in set(dn.collapsed_slice_dims)]
    offset_dims = tuple(dn.offset_dims)
    axes, out_sizes, it = [], [], iter(keep)
    for pos in range(len(out_shape)):
        if pos in offset_dims:
            i = next(it)
            axes.append(w.axes[i])
            out_sizes.append(w.sizes[i])
        else:
            axes.append(None)
            out_sizes.append(1)
    return replace(w, axes=tuple(axes), sizes=tuple(out_sizes))


def _is_zero(expr: str) -> bool:
    return expr in ("0", "false") or bool(re.fullmatch(r"\(?-?0x0\.0+p\+0f\)?", expr))


def _scattered_to(sc: _Scattered, out_shape: tuple[int, ...], dims: list[int]) -> _Scattered:
    """`sc` with its dim i moved to out dim dims[i] and unit dims around them (no element moves)."""
    entries = []
    for e in sc.entries:
        starts, sizes = ["0"] * len(out_shape), [1] * len(out_shape)
        for i, d in enumerate(dims):
            if d is not None:
                starts[d], sizes[d] = e.starts[i], e.sizes[i]
        entries.append(replace(e, starts=tuple(starts), sizes=tuple(sizes)))
    return _Scattered(sc.dtype, out_shape, tuple(entries))


def _unit_reshape_dims(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int | None] | None:
    """For a reshape that only adds or drops unit dims: the out dim of each dim (None: a dropped unit dim)."""
    kept = [i for i, n in enumerate(shape) if n != 1]
    out_kept = [d for d, n in enumerate(out_shape) if n != 1]
    if [shape[i] for i in kept] != [out_shape[d] for d in out_kept]:
        return None
    dims: list[int | None] = [None] * len(shape)
    for i, d in zip(kept, out_kept):
        dims[i] = d
    return dims


def _dynamic_update_slice(em, params, args, out_shape, out_dtype):
    operand, update, *starts = args
    if not isinstance(operand, _Scattered) or operand.entries:
        raise EmitError("dynamic_update_slice", "updates an array other than zeros (only a cotangent's scatter)")
    starts = [f"cuflash::flex::clamp_index({_scalar_index(em, s, 'dynamic_update_slice')}, 0, {n - k})"
              for s, n, k in zip(starts, operand.shape, update.shape)]
    if isinstance(update, _Scattered):  # a cotangent scattered into a window, placed in the whole array
        return _Scattered(out_dtype, out_shape, tuple(
            replace(e, starts=tuple(f"({a} + {b})" if b != "0" else a for a, b in zip(starts, e.starts)))
            for e in update.entries))
    values = em.read(update, "dynamic_update_slice")
    return _Scattered(out_dtype, out_shape, (_Entry(tuple(starts), tuple(values.shape), values.elems),))


def _pad(em, params, args, out_shape, out_dtype):
    """Zero padding without interior padding: a static slice's transpose (a cotangent placed in zeros)."""
    operand, padding = args
    config = [tuple(int(x) for x in c) for c in params["padding_config"]]
    value = em.read(padding, "pad")
    if not _is_zero(value.elems[0]) or any(lo < 0 or hi < 0 or interior for lo, hi, interior in config):
        raise EmitError("pad", "pads with a value other than zero, negative or interior padding (only a static "
                               "slice's transpose)")
    starts = tuple(str(lo) for lo, _, _ in config)
    if isinstance(operand, _Scattered):
        return _Scattered(out_dtype, out_shape, tuple(
            replace(e, starts=tuple(f"({a} + {b})" if a != "0" else b for a, b in zip(starts, e.starts)))
            for e in operand.entries))
    t = em.read(operand, "pad")
    return _Scattered(out_dtype, out_shape, (_Entry(starts, tuple(t.shape), t.elems),))


def _scatter_add(em, params, args, out_shape, out_dtype):
    operand, indices, updates = args
    dn = params["dimension_numbers"]
    jaxpr = params.get("update_jaxpr")
    if jaxpr is not None and [e.primitive.name for e in jaxpr.eqns] not in (["add"], ["add_any"]):
        raise EmitError("scatter-add", "combines updates other than by adding")
    if not isinstance(operand, _Scattered):
        raise EmitError("scatter-add", "scatters into an array other than zeros (only a cotangent's scatter)")
    if tuple(dn.operand_batching_dims) or tuple(dn.scatter_indices_batching_dims):
        raise EmitError("scatter-add", "scatters with batching dimensions")
    idx = em.read(indices, "scatter-add")
    if math.prod(idx.shape[:-1]) != 1:
        raise EmitError("scatter-add", "scatters several windows at once")
    values = em.read(updates, "scatter-add")
    window = [d for d in range(len(out_shape)) if d not in set(dn.inserted_window_dims)]
    sizes = [1] * len(out_shape)
    for d, u in zip(window, dn.update_window_dims):
        sizes[d] = values.shape[u]
    starts = ["0"] * len(out_shape)
    for k, d in enumerate(dn.scatter_dims_to_operand_dims):
        starts[d] = idx.elems[k]
    valid = None
    if "FILL" in str(params["mode"]).upper():  # FILL_OR_DROP: a window not wholly inside is dropped
        checks = [f"({starts[d]} >= 0 && {starts[d]} <= {out_shape[d] - sizes[d]})"
                  for d in dn.scatter_dims_to_operand_dims]
        valid = em.bind("bool", " && ".join(checks)) if checks else None
    else:  # CLIP (and PROMISE_IN_BOUNDS as XLA evaluates it): clamped into the operand
        starts = [s if s == "0" else f"cuflash::flex::clamp_index({s}, 0, {n - k})"
                  for s, n, k in zip(starts, out_shape, sizes)]
    entry = _Entry(tuple(starts), tuple(sizes), values.elems, valid)
    return _Scattered(out_dtype, out_shape, operand.entries + (entry,))


_STRUCTURAL = {
    "pad": _pad, "dynamic_update_slice": _dynamic_update_slice, "scatter-add": _scatter_add, "scatter_add": _scatter_add,
    "dynamic_slice": _dynamic_slice, "slice": _slice, "squeeze": _squeeze, "reshape": _reshape,
    "broadcast_in_dim": _broadcast_in_dim, "concatenate": _concatenate, "gather": _gather,
}
