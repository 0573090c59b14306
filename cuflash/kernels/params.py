"""Python mirror of ``cuflash::AttentionParams``, derived from its header (cuda_src/common/attention_params.cuh).

The header is the one source: its X-macro lists name the element tensors (with their side and access) and the
float32 side buffers, and its plain declarations give TensorStrides and the scalars. ``header_fields`` reads
them in declaration order; the NumPy layout, the field-name tuples and the simulator's layout probe
(cuflash/sim/_build.py) are built from that. Every backend (simulator, CuPy, JAX FFI) hands kernels the bytes
packed here; ``tests/test_params_layout.py`` compares the layout, field by field, with the one g++ computes.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Mapping, NamedTuple

import numpy as np

from .._paths import CUDA_SRC
from ..dropout import dropout_threshold

HEADER = CUDA_SRC / "common" / "attention_params.cuh"


class TensorField(NamedTuple):
    name: str
    side: str  # "Query" (batch, seqlen_q, nheads, width) or "Key" (batch, seqlen_k, nheads_k, width)
    width: str  # "QK" (width headdim) or "V" (headdim_v: v, out and their gradients)
    access: str  # "In" or "Out"


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)


def _macro_entries(text: str, macro: str) -> list[tuple[str, ...]]:
    """The X(...) entries of ``#define macro(X) X(a, b) X(c, d) ...`` (continued lines)."""
    m = re.search(rf"#define {macro}\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)
    if m is None:
        raise ValueError(f"{HEADER.name}: no #define {macro}(X)")
    return [tuple(a.strip() for a in args.split(",")) for args in re.findall(r"\bX\(([^)]*)\)", m.group(1))]


_SCALAR_TYPES = {"const void*": np.uint64, "void*": np.uint64, "float*": np.uint64, "const int*": np.uint64,
                 "long long": np.int64,
                 "int": np.int32, "unsigned": np.uint32, "float": np.float32}
_MEMBER = re.compile(r"(const void\*|void\*|float\*|const int\*|int|unsigned|float|long long|\w+)\s*(\w+)(?:\[(\w+)\])?;")


def _flex_structs(text: str) -> dict[str, np.dtype]:
    """The header's `namespace flex` structs (the side arrays of user mods) as aligned NumPy dtypes, by C name."""
    block = re.search(r"namespace flex\s*\{(.*?)\n\}(?!;)", text, re.S)  # up to its closing brace (not a struct's)
    if block is None:
        raise ValueError(f"{HEADER.name}: no namespace flex (the side arrays AttentionParams carries)")
    constants = {name: int(value) for name, value in re.findall(r"constexpr int (\w+) = (\d+);", block.group(1))}
    structs: dict[str, np.dtype] = {}
    for name, body in re.findall(r"struct (\w+)\s*\{(.*?)\};", block.group(1), re.S):
        members = []
        for statement in filter(None, (s.strip() for s in body.split("\n"))):
            m = _MEMBER.fullmatch(statement)
            if m is None:
                raise ValueError(f"{HEADER.name}: cannot read the flex::{name} member {statement!r}")
            ctype, member, count = m.groups()
            base = _SCALAR_TYPES.get(ctype) or structs.get(f"flex::{ctype}")
            if base is None:
                raise ValueError(f"{HEADER.name}: flex::{name}.{member} has the unknown type {ctype!r}")
            members.append((member, base, constants[count]) if count else (member, base))
        structs[f"flex::{name}"] = np.dtype(members, align=True)
    return structs


def _leaves(dtype: np.dtype, prefix: str, offset: int = 0):
    """(C path, offset, size) of every scalar in a (nested, possibly array-valued) struct dtype."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        for i in range(shape[0]):
            yield from _leaves(np.dtype((base, shape[1:])) if len(shape) > 1 else base, f"{prefix}[{i}]",
                               offset + i * base.itemsize * math.prod(shape[1:]))
    elif dtype.names:
        for name in dtype.names:
            sub, sub_offset = dtype.fields[name][:2]
            yield from _leaves(sub, f"{prefix}.{name}" if prefix else name, offset + sub_offset)
    else:
        yield prefix, offset, dtype.itemsize


# AttentionParams.tma (TmaMaps): a TMA tensor map (128 bytes, 16 words) for each of these tensors, 64-byte aligned.
TMA_TENSORS = ("q", "k", "v", "dout")
TENSOR_MAP_WORDS = 16
_TMA_ALIGN = 64
_TMA_DTYPE = np.dtype({"names": list(TMA_TENSORS), "formats": [(np.uint64, TENSOR_MAP_WORDS)] * len(TMA_TENSORS),
                       "offsets": [8 * TENSOR_MAP_WORDS * i for i in range(len(TMA_TENSORS))],
                       "itemsize": 8 * TENSOR_MAP_WORDS * len(TMA_TENSORS), "aligned": True})


def header_fields(text: str | None = None) -> tuple[list[tuple[str, str]], list[TensorField], list[str]]:
    """(leaf fields as (C path, C type) in declaration order, tensor fields, side-buffer fields) of the header.

    Struct members of the flex namespace (flex::Sides ...) appear as their scalars' paths ("flex_sides.arrays[0].data")
    with the struct's C type."""
    text = _strip_comments(HEADER.read_text() if text is None else text)
    tensors = [TensorField(*entry) for entry in _macro_entries(text, "CUFLASH_PARAMS_TENSORS")]
    side_buffers = [entry[0] for entry in _macro_entries(text, "CUFLASH_PARAMS_SIDE_BUFFERS")]
    strides = re.search(r"struct TensorStrides\s*\{(.*?)\};", text, re.S)
    body = re.search(r"struct AttentionParams\s*\{(.*?)\};", text, re.S)
    if strides is None or body is None:
        raise ValueError(f"{HEADER.name}: TensorStrides or AttentionParams not found")
    flex_structs = _flex_structs(text)
    stride_fields = re.findall(r"long long (\w+);", strides.group(1))
    expansions = {
        "CUFLASH_PARAMS_TENSORS(CUFLASH_PARAMS_DECLARE_TENSOR)":
            [(t.name, "const void*" if t.access == "In" else "void*") for t in tensors],
        "CUFLASH_PARAMS_SIDE_BUFFERS(CUFLASH_PARAMS_DECLARE_SIDE_BUFFER)": [(b, "float*") for b in side_buffers],
        "CUFLASH_PARAMS_TENSORS(CUFLASH_PARAMS_DECLARE_STRIDES)":
            [(f"{t.name}_stride.{f}", "long long") for t in tensors for f in stride_fields],
    }
    fields: list[tuple[str, str]] = []
    for statement in body.group(1).split("\n"):
        statement = statement.strip()
        if not statement:
            continue
        if statement in expansions:
            fields += expansions[statement]
            continue
        if statement == "TmaMaps tma;":  # 64-byte aligned (_params_dtype places it)
            fields += [(path, "TmaMaps") for path, _, _ in _leaves(_TMA_DTYPE, "tma")]
            continue
        m = re.fullmatch(r"(int|unsigned|float|long long|flex::\w+) (\w+);", statement)
        if m is None or (m.group(1).startswith("flex::") and m.group(1) not in flex_structs):
            raise ValueError(f"{HEADER.name}: cannot read the AttentionParams member {statement!r}")
        if m.group(1) in flex_structs:
            fields += [(path, m.group(1)) for path, _, _ in _leaves(flex_structs[m.group(1)], m.group(2))]
        else:
            fields.append((m.group(2), m.group(1)))
    return fields, tensors, side_buffers


_FIELDS, _TENSORS, _SIDE_BUFFERS = header_fields()
_FLEX_STRUCTS = _flex_structs(_strip_comments(HEADER.read_text()))
TENSOR_FIELDS = tuple(t.name for t in _TENSORS)
QUERY_SIDE_TENSORS = tuple(t.name for t in _TENSORS if t.side == "Query")
VALUE_WIDTH_TENSORS = tuple(t.name for t in _TENSORS if t.width == "V")
SIDE_BUFFER_FIELDS = tuple(_SIDE_BUFFERS)
POINTER_FIELDS = TENSOR_FIELDS + SIDE_BUFFER_FIELDS
STRIDED_TENSORS = TENSOR_FIELDS
SCALAR_FIELDS = tuple(path for path, ctype in _FIELDS
                      if "." not in path and path not in POINTER_FIELDS and not ctype.startswith("flex::"))
# The user mods' side-array descriptors (flex_mod.cuh): AttentionParams' flex_sides / flex_side_grads members.
SIDES_DTYPE = _FLEX_STRUCTS["flex::Sides"]
SIDE_GRADS_DTYPE = _FLEX_STRUCTS["flex::SideGrads"]
MAX_SIDES = SIDES_DTYPE["arrays"].shape[0]
MAX_SIDE_DIMS = SIDES_DTYPE["arrays"].base["shape"].shape[0]


def _params_dtype(fields: list[tuple[str, str]]) -> np.dtype:
    members: list[tuple[str, object]] = []
    for path, ctype in fields:
        if ctype == "TmaMaps":
            outer = path.split(".")[0]
            if members[-1][0] != outer:
                members.append((outer, _TMA_DTYPE))
        elif ctype in _FLEX_STRUCTS:
            outer = path.split(".")[0]
            if not members or members[-1][0] != outer:
                members.append((outer, _FLEX_STRUCTS[ctype]))
        elif "." in path:
            outer, inner = path.split(".")
            if not members or members[-1][0] != outer:
                members.append((outer, []))
            members[-1][1].append((inner, _SCALAR_TYPES[ctype]))
        else:
            members.append((path, _SCALAR_TYPES[ctype]))
    dtypes = [(name, np.dtype(t, align=True) if isinstance(t, list) else np.dtype(t)) for name, t in members]
    # np.dtype(align=True) aligns each member to at most 8 bytes here; alignas(64) members (TmaMaps) get their
    # offsets, and the struct its size (a multiple of its alignment), by hand.
    names, formats, offsets, at, align = [], [], [], 0, 1
    for name, dtype in dtypes:
        member_align = _TMA_ALIGN if dtype is _TMA_DTYPE else dtype.alignment
        at = -(-at // member_align) * member_align
        names.append(name), formats.append(dtype), offsets.append(at)
        at += dtype.itemsize
        align = max(align, member_align)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": -(-at // align) * align,
                     "aligned": True})


PARAMS_DTYPE = _params_dtype(_FIELDS)


def field_layout() -> dict[str, tuple[int, int]]:
    """(offset, size) of every leaf field, by C path ("q_stride.batch", "seqlen_q", "flex_sides.arrays[0].data")."""
    return {path: (offset, size) for path, offset, size in _leaves(PARAMS_DTYPE, "")}


# The header declares the pointers first: they are one block of 8-byte words at the front of AttentionParams, which
# PointerSlots writes with one struct call.
_POINTER_WORD = {name: PARAMS_DTYPE.fields[name][1] // 8 for name in POINTER_FIELDS}
if sorted(PARAMS_DTYPE.fields[name][1] for name in POINTER_FIELDS) != [8 * i for i in range(len(POINTER_FIELDS))]:
    raise ValueError(f"{HEADER.name}: AttentionParams' pointers are no longer one block at its start (PointerSlots)")


# The TMA block at the end of AttentionParams, as one run of bytes a call lays over the packed ones: tma_loads, the
# padding up to the maps, the maps (q, k, v).
TMA_BLOCK_OFFSET = PARAMS_DTYPE.fields["tma_loads"][1]
TMA_MAPS_AT = PARAMS_DTYPE.fields["tma"][1] - TMA_BLOCK_OFFSET  # in the block
if PARAMS_DTYPE.itemsize != TMA_BLOCK_OFFSET + TMA_MAPS_AT + _TMA_DTYPE.itemsize:
    raise ValueError(f"{HEADER.name}: tma_loads and tma are no longer the last members of AttentionParams")


class PointerSlots:
    """Where the addresses of a fixed tuple of pointer fields go: a prepared program packs every other field once, its
    pointers null, and lays each call's addresses into a copy."""

    def __init__(self, names: tuple[str, ...]):
        for name in names:
            if name not in POINTER_FIELDS:
                raise KeyError(f"AttentionParams has no pointer field {name!r}")
        self.names = names
        words = [_POINTER_WORD[name] for name in names]
        # One struct call writes exactly these words, in word order (skipping the others: they keep the packed
        # bytes' nulls), from the addresses in names' order taken through _order.
        self._order = sorted(range(len(names)), key=words.__getitem__)
        layout, at = [], 0
        for i in self._order:
            layout.append(f"{8 * (words[i] - at)}xQ" if words[i] > at else "Q")
            at = words[i] + 1
        self._struct = struct.Struct("<" + "".join(layout))
        if self._order == list(range(len(names))):
            self._order = None  # names already in word order

    def pack(self, packed: bytes, addresses: list[int], tail: tuple[int, bytes] | None = None) -> np.void:
        """``packed`` (PARAMS_DTYPE's bytes, these pointers null) with ``addresses`` (in the order of ``names``) in
        their fields, and ``tail`` = (offset, bytes) laid over the rest (the TMA block: TMA_BLOCK_OFFSET)."""
        buffer = bytearray(packed)
        order = self._order
        self._struct.pack_into(buffer, 0, *(addresses if order is None else map(addresses.__getitem__, order)))
        if tail is not None:
            buffer[tail[0]: tail[0] + len(tail[1])] = tail[1]
        return np.frombuffer(buffer, PARAMS_DTYPE)[0]


def pack_params(
    problem,
    *,
    softmax_scale: float,
    pointers: Mapping[str, int],
    strides: Mapping[str, tuple[int, int, int]],
    num_dq_splits: int = 1,
    num_kv_splits: int = 1,
) -> np.void:
    """Pack one AttentionParams value.

    problem: a plans.Problem (sizes and the mask).
    pointers: device (or host, for the simulator) addresses by field name; absent fields are null.
    strides: (batch, row, head) element strides by tensor name; absent tensors get zeros.
    """
    params = np.zeros((), dtype=PARAMS_DTYPE)
    for name, address in pointers.items():
        if name not in POINTER_FIELDS:
            raise KeyError(f"AttentionParams has no pointer field {name!r}")
        params[name] = address
    for name, (b, r, h) in strides.items():
        params[f"{name}_stride"] = (b, r, h)
    for name in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim", "headdim_v"):
        params[name] = getattr(problem, name)
    params["total_q"] = problem.rows_q
    params["total_k"] = problem.rows_k
    params["softmax_scale"] = softmax_scale
    params["softmax_scale_log2"] = softmax_scale * math.log2(math.e)
    params["window_left"] = problem.mask.window_left
    params["window_right"] = problem.mask.window_right
    params["num_dq_splits"] = num_dq_splits
    params["num_kv_splits"] = num_kv_splits  # kernels divide by it: never 0
    if problem.softcap > 0.0:
        params["softcap_outer"] = problem.softcap / softmax_scale
        params["softcap_inner"] = softmax_scale / problem.softcap
    params["alibi_batch_stride"] = problem.nheads if problem.alibi == "batch_heads" else 0
    params["dropout_threshold"] = dropout_threshold(problem.dropout_p)
    params["dropout_rescale"] = 1.0 / (1.0 - problem.dropout_p)
    params["dropout_batches_per_seed"] = problem.dropout_batches_per_seed
    params["page_size"] = problem.page_size
    params["block_table_stride"] = problem.pages_per_sequence
    return params[()]


def sides_struct(descriptors) -> np.ndarray:
    """attention_params.cuh's flex::Sides (AttentionParams.flex_sides) from (data pointer, shape, element strides)
    per side array, in side order."""
    descriptors = list(descriptors)
    if len(descriptors) > MAX_SIDES:
        raise ValueError(f"{len(descriptors)} side arrays; a kernel takes at most {MAX_SIDES}")
    out = np.zeros((), SIDES_DTYPE)
    for i, (data, shape, strides) in enumerate(descriptors):
        if len(shape) != len(strides) or len(shape) > MAX_SIDE_DIMS:
            raise ValueError(f"side array {i}: shape {shape} and strides {strides} (at most {MAX_SIDE_DIMS} dims)")
        out["arrays"][i]["data"] = data
        out["arrays"][i]["shape"][: len(shape)] = shape
        out["arrays"][i]["strides"][: len(strides)] = strides
    return out
