"""FlexMod: a score_mod / mask_mod as CUDA C++ a kernel takes as a template argument, with its side arrays.

Made by `trace_score_mod` / `trace_mask_mod` (a Python mod traced with JAX) or `cuda_mod` (the expert
form: C++ source and named side arrays). `sides_struct` packs side-array descriptors as
attention_params.cuh's `flex::Sides` (AttentionParams.flex_sides).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

# The side-array structs and their limits (attention_params.cuh's flex namespace, read by the params mirror).
from ..kernels.params import MAX_SIDE_DIMS, MAX_SIDES, SIDES_DTYPE, sides_struct
from ._emit import SIDE_C_TYPE, EmitError, dtype_name, fold_score_factor, literal
from ._trace import arg_names, check_result, describe, emit_body, emit_side_grads, side_grads_jaxpr, trace

# Side dtypes, and what each travels to the kernel as (1-byte types widened: global loads move >= 2 bytes).
SIDE_DTYPES = tuple(SIDE_C_TYPE)
_STORED = {"bool": "int32", "int8": "int32", "uint8": "int32"}
_FLOAT_SIDES = ("float32", "float16", "bfloat16")



@dataclass(frozen=True)
class SideSpec:
    """One side array as the emitted code reads it: its name in the C++ source (expert form) or its
    position, its dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def stored_dtype(self) -> str:
        """The dtype the kernel's buffer holds (bool, int8 and uint8 travel as int32)."""
        return _STORED.get(self.dtype, self.dtype)


@dataclass(frozen=True, eq=False)
class FlexMod:
    """A mod ready for a kernel: `source` defines `struct <struct_name>` (flex_mod.cuh's calling convention)
    in namespace cuflash::flex::mods; `side_values[i]` is read as sides.arrays[i] (`sides[i]` says how).
    `cache_key` depends on the source and the sides' dtypes and shapes, never on their values."""

    kind: str  # "score" or "mask"
    name: str  # the mod's __qualname__ (or the expert form's name), for messages
    struct_name: str
    source: str
    sides: tuple[SideSpec, ...]
    side_values: tuple
    has_dscore: bool
    cache_key: str
    grad_sides: tuple[int, ...] = ()  # sides whose gradients side_grads adds (trace_score_mod(side_grads=True))

    @property
    def qualified_name(self) -> str:
        return f"cuflash::flex::mods::{self.struct_name}"

    def kernel_side_values(self) -> tuple:
        """side_values converted to their stored dtypes (jax arrays and tracers stay jax, others NumPy)."""
        out = []
        for spec, value in zip(self.sides, self.side_values):
            if spec.stored_dtype != spec.dtype:
                value = value.astype(spec.stored_dtype) if hasattr(value, "astype") else np.asarray(value, np.int32)
            out.append(value)
        return tuple(out)


_GRADS_SIGNATURE = ("float g, float score, int b, int h, int q_idx, int kv_idx, const cuflash::flex::Sides& sides, "
                    "const cuflash::flex::SideGrads& grads")
_SCORE_SIGNATURE = "float score, int b, int h, int q_idx, int kv_idx, const cuflash::flex::Sides& sides"
_MASK_SIGNATURE = "int b, int h, int q_idx, int kv_idx, const cuflash::flex::Sides& sides"


def _function(ret: str, name: str, signature: str, params: tuple[str, ...], body: str) -> str:
    unused = " ".join(f"(void){p};" for p in (*params, "sides"))
    return (f"  static __device__ __forceinline__ {ret} {name}({signature}) {{\n    {unused}\n{body}\n  }}\n")


def _assemble(kind: str, name: str, bodies: dict[str, str], specs: list[SideSpec], values: list,
              grad_sides: tuple[int, ...] = (), score_factor: float = 1.0) -> FlexMod:
    params = arg_names(kind)
    if kind == "score":
        members = _function("float", "score", _SCORE_SIGNATURE, params, bodies["score"])
        if "dscore" in bodies:
            members += _function("float", "dscore", _SCORE_SIGNATURE, params, bodies["dscore"])
        if "side_grads" in bodies:
            members += _function("void", "side_grads", _GRADS_SIGNATURE, ("g", *params, "grads"), bodies["side_grads"])
    else:
        members = _function("bool", "mask", _MASK_SIGNATURE, params, bodies["mask"])
    consts = f"  static constexpr int kSides = {len(specs)};\n"
    if kind == "score":
        consts += f"  static constexpr bool kHasDScore = {'true' if 'dscore' in bodies else 'false'};\n"
        consts += f"  static constexpr bool kHasSideGrads = {'true' if 'side_grads' in bodies else 'false'};\n"
        consts += f"  static constexpr float kScoreFactor = {literal(score_factor, 'float32')};\n"
    template = ("namespace cuflash::flex::mods {\nstruct @NAME@ {\n" + consts + members
                + "};\n}  // namespace cuflash::flex::mods\n")
    struct_name = "FlexMod_" + hashlib.sha256(template.encode()).hexdigest()[:16]
    source = template.replace("@NAME@", struct_name)
    key_text = source + "".join(f"|{s.name}:{s.dtype}:{s.shape}" for s in specs)
    return FlexMod(kind, name, struct_name, source, tuple(specs), tuple(values), "dscore" in bodies,
                   hashlib.sha256(key_text.encode()).hexdigest()[:32], tuple(grad_sides))


def _side_spec(label: str, what: str, name: str, value) -> SideSpec:
    dtype = dtype_name(value.dtype)
    shape = tuple(int(n) for n in value.shape)
    if dtype not in SIDE_DTYPES:
        raise TypeError(f"{label}: {what} is {dtype}{list(shape)}; side arrays are "
                        f"{', '.join(SIDE_DTYPES)} (64-bit types under jax_enable_x64 are not)")
    if len(shape) > MAX_SIDE_DIMS:
        raise TypeError(f"{label}: {what} has {len(shape)} dims; side arrays have at most {MAX_SIDE_DIMS}")
    return SideSpec(name, dtype, shape)


def _traced(fn, kind: str, side_grads: bool = False, fast_math: bool = False) -> FlexMod:
    label = f"{kind}_mod {describe(fn)}"
    values, specs, index_of = [], [], {}
    jaxprs, side_of_const = {}, {}

    def collect(which: str, closed) -> None:
        """The jaxpr's constants as side arrays (one side per captured array, whichever jaxprs hold it)."""
        jaxprs[which], side_of_const[which] = closed, []
        for value, var in zip(closed.consts, closed.jaxpr.constvars):
            if id(value) not in index_of:
                k = len(values)
                spec = _side_spec(label, f"captured array #{k}", f"side{k}", var.aval)
                index_of[id(value)] = k
                values.append(value)
                specs.append(spec)
            side_of_const[which].append(index_of[id(value)])

    collect(kind, trace(fn, kind))
    check_result(jaxprs[kind], fn, kind)  # after the sides: a float64 capture would first show as a float64 result
    if kind == "score":
        collect("dscore", trace(fn, kind, derivative=True))
    if len(values) > MAX_SIDES:
        raise TypeError(f"{label} captures {len(values)} arrays; a mod reads at most {MAX_SIDES}")
    sides = [(s.dtype, s.shape) for s in specs]
    bodies = {}
    for which, closed in jaxprs.items():
        try:
            bodies[which] = emit_body(closed, side_of_const[which], sides, kind, fast_math)
        except EmitError as e:
            what = "its derivative in score" if which == "dscore" else "it"
            raise TypeError(f"{label}: {e.primitive} {e} (in {what})") from None
    grad_sides = ()
    if side_grads:
        closed = jaxprs[kind]
        positions = [i for i, k in enumerate(side_of_const[kind]) if specs[k].dtype in _FLOAT_SIDES]
        grad_sides = tuple(side_of_const[kind][i] for i in positions)
        try:
            bodies["side_grads"] = emit_side_grads(side_grads_jaxpr(closed, positions), side_of_const[kind],
                                                   positions, sides, fast_math)
        except EmitError as e:
            raise TypeError(f"{label}: {e.primitive} {e} (in its gradient to captured arrays)") from None
    score_factor = 1.0
    if kind == "score" and fast_math:
        bodies, score_factor = fold_score_factor(bodies)
    return _assemble(kind, describe(fn), bodies, specs, values, grad_sides, score_factor)


def trace_score_mod(fn, *, side_grads: bool = False, fast_math: bool = False) -> FlexMod:
    """Trace `fn(score, b, h, q_idx, kv_idx) -> float32 score` (and its derivative in score) into C++.
    side_grads: also emit `side_grads(g, score, b, h, q_idx, kv_idx, sides, grads)`, adding g * d fn / d side
    into float32 gradient buffers (flex_mod.cuh's SideGrads) of every float side (FlexMod.grad_sides).
    fast_math: float division, tanh and exp in the approximate forms the built-in softcap uses (__fdividef,
    mask.cuh's tanh_by_exp2, ex2.approx): a few instructions each instead of IEEE division's slow path and
    tanhf's polynomial, at a few ulp (results no longer equal eager JAX's bitwise); products and quotients by
    constants gathered into one factor, sums of equal factors added first (c a + c b as c (a + b): what jax.grad's
    chain rule multiplies in and divides out again), products written so the compiler may fuse them with sums into
    FMAs; and where every function reads the score only as one product by a constant (`score / cap`), that constant
    folded into the softmax scale (_emit.fold_score_factor: a product per score fewer). Default: exact."""
    return _traced(fn, "score", side_grads, fast_math)


def trace_mask_mod(fn) -> FlexMod:
    """Trace `fn(b, h, q_idx, kv_idx) -> bool` (True: the score is kept) into C++."""
    return _traced(fn, "mask")


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED = {"score", "b", "h", "q_idx", "kv_idx", "sides", "cuflash", "auto", "bool", "break", "case", "char",
             "const", "continue", "default", "do", "double", "else", "float", "for", "if", "int", "long", "return",
             "short", "signed", "sizeof", "static", "struct", "switch", "unsigned", "void", "while", "true", "false"}


def cuda_mod(source: str, sides: dict | None = None, *, kind: str = "score", dscore: str | None = None,
             name: str = "cuda_mod") -> FlexMod:
    """The expert form: `source` is the C++ body of the mod's function (it ends in a `return`), over the
    parameters (score,) b, h, q_idx, kv_idx and, for each side array, `name(i, j, ...)` reading its element
    (float for float dtypes, int for integers, bool for bool; indices must be in bounds). `dscore`: the
    body of d score_mod / d score (score mods; without it the mod has no backward)."""
    label = f"{kind}_mod {name}"
    if kind not in ("score", "mask"):
        raise ValueError(f"cuda_mod: kind is 'score' or 'mask', not {kind!r}")
    if dscore is not None and kind != "score":
        raise ValueError(f"{label}: dscore is for score mods only")
    for what, text in (("source", source), ("dscore", dscore)):
        if text is None and what == "dscore":
            continue
        if not isinstance(text, str) or not text.strip():
            raise TypeError(f"{label}: {what} must be a non-empty C++ function body, not {text!r}")
        depth = 0
        for ch in text:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth < 0:
                break
        if depth != 0:
            raise ValueError(f"{label}: {what} has unbalanced braces (it is the body of one function)")
    sides = dict(sides or {})
    if len(sides) > MAX_SIDES:
        raise ValueError(f"{label}: {len(sides)} side arrays; a mod reads at most {MAX_SIDES}")
    specs, values, prelude = [], [], []
    for k, (side_name, value) in enumerate(sides.items()):
        if not isinstance(side_name, str) or not _IDENTIFIER.fullmatch(side_name) or side_name in _RESERVED \
                or side_name.startswith("__"):
            raise ValueError(f"{label}: side array name {side_name!r} is not a free C++ identifier "
                             f"(not one of {', '.join(arg_names(kind))}, sides, or a keyword)")
        if not (hasattr(value, "dtype") and hasattr(value, "shape")):
            raise TypeError(f"{label}: side array {side_name!r} is a {type(value).__name__}, not an array")
        spec = _side_spec(label, f"side array {side_name!r}", side_name, value)
        specs.append(spec)
        values.append(value)
        prelude.append(f"    const cuflash::flex::SideView<{SIDE_C_TYPE[spec.dtype]}, {len(spec.shape)}> "
                       f"{side_name}{{sides.arrays[{k}]}};")
    header = "\n".join(prelude)
    bodies = {kind: (header + "\n" if header else "") + source.rstrip()}
    if dscore is not None:
        bodies["dscore"] = (header + "\n" if header else "") + dscore.rstrip()
    return _assemble(kind, name, bodies, specs, values)
