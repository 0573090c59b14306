"""What a launch program is made of: kernel instances, the problem they solve, launches and scratch.

Every backend (the CPU simulator, CuPy on a GPU, the JAX FFI handlers) runs the same
``Program``: an ordered list of kernel launches plus the float32 scratch buffers they need.
A kernel family (cuflash/kernels/families/) turns a ``Problem`` into a Program for a target
(cuflash/kernels/targets.py); backends only allocate, pack ``AttentionParams`` and launch.
This module depends on nothing else of cuflash.kernels but the params layout, so the catalog,
the plans and the families can all import it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

from .._paths import CUDA_SRC
from ..mask import Mask, MaskPolicy
from .params import SIDE_BUFFER_FIELDS, TMA_TENSORS

ELEMENT_DTYPES = ("float32", "float16", "bfloat16")
ALIBI_LAYOUTS = (None, "heads", "batch_heads")
# Options a Problem may use beyond plain masked attention; catalog variants say which they support.
OPTIONS = ("softcap", "alibi", "dropout", "varlen", "kvcache", "paged", "splitkv", "sinks", "headdim_v", "flex")
# The Hook template argument of a kernel instance with a user's mods (flex_hook.cuh; cuflash.flex._kernels).
FLEX_HOOK = "cuflash::flex::FlexHook"
# Element type names as spelled in kernel template arguments, by NumPy dtype name.
CXX_ELEMENT_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelInstance:
    """One template instantiation of one kernel source file: compiled by NVRTC for GPUs and by
    g++ for the simulator from the same (source, name expression)."""

    source: str  # path relative to cuda_src/ (or absolute, for test kernels)
    name_expr: str  # e.g. "cuflash::standard_scores_kernel<__half>"

    @property
    def source_path(self) -> Path:
        path = Path(self.source)
        return path if path.is_absolute() else CUDA_SRC / path

    def __str__(self) -> str:
        return self.name_expr

    @property
    def flex_prefix(self) -> str | None:
        """An instance with a user's mods (cuflash.flex._kernels: a kernel's template arguments up to its Hook, then
        a FlexHook): its name expression up to the FlexHook, e.g. "cuflash::fa3_forward_kernel<__half, 128, 128,
        128, 2, true, 128"; None for any other."""
        cut = self.name_expr.find(f", {FLEX_HOOK}<")
        return None if cut < 0 else self.name_expr[:cut]


@dataclass(frozen=True)
class Problem:
    """Everything a launch plan may depend on (never the data itself)."""

    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    mask: Mask = Mask()
    deterministic: bool = False
    # Score transforms (mask.cuh's ScoreHook): softcap c > 0 (0: off), and where ALiBi slopes come from:
    # None, "heads" (nheads,) or "batch_heads" (batch, nheads).
    softcap: float = 0.0
    alibi: str | None = None
    # Dropout probability in [0, 1) (dropout.cuh; the seed is data, a side input). dropout_batches_per_seed n > 0:
    # the seed input holds a seed per n (global) batches, batch b dropping as batch b % n of a call with its seed
    # would (JAX's vmap folds mapped elements with their own seeds into one call); 0: one seed.
    dropout_p: float = 0.0
    dropout_batches_per_seed: int = 0
    # Varlen (block_info.cuh): query and key rows of the packed (total, heads, d) tensors, None for fixed-length
    # batches. Then batch counts sequences and seqlen_q / seqlen_k are the longest ones (the grid's extent); the
    # lengths themselves are data (cu_seqlens side inputs), so nothing here depends on them.
    total_q: int | None = None
    total_k: int | None = None
    # Varlen's used prefixes (FA2's seqused_k, FA3's seqused_q; block_info.cuh): sequence b computes only its first
    # seqused_q[b] query rows over its first seqused_k[b] keys, counts that are data (side inputs of those names).
    seqused_q: bool = False
    seqused_k: bool = False
    # KV cache (block_info.cuh): each sequence's keys in use come from a side input (seqused_k) and seqlen_k is the
    # largest; page_size > 0: k and v are paged, (num_pages, page_size, nheads_k, d), each sequence's pages named
    # by a row of pages_per_sequence entries of block_table.
    kvcache: bool = False
    page_size: int = 0
    pages_per_sequence: int = 0
    # Split-KV (any forward without dropout: a KV cache's decode, a fixed-length or varlen call): the keys of each
    # sequence are cut into num_splits ranges of whole K/V blocks, each computed by its own thread blocks into float32
    # partial results that a combine kernel merges by their lse. 1: no split; 0: the family's heuristic for the
    # target (its SM count) picks the number.
    num_splits: int = 1
    # Attention sinks (sink.cuh): a float32 logit per query head (a side input of that name, (nheads,)) joins every
    # row's softmax denominator.
    sinks: bool = False
    # A KV cache's indexing (block_info.cuh), values that are data (side inputs of these names): cache_batch_idx maps
    # sequence b to a row of a contiguous cache's batch, cache_leftpad[b] is its first key's cache row (of a paged
    # cache: its row in the sequence's pages, which the API sets only for a folded windowed decode; the user's
    # cache_leftpad indexes contiguous caches, as FA2's).
    cache_batch_idx: bool = False
    cache_leftpad: bool = False
    # V's head dim where it differs from q's and k's (MLA-style, attention_params.cuh): out and dout have it too.
    # None (the default) means headdim; __post_init__ stores the value, so equal dims give equal Problems.
    headdim_v: int | None = None
    # A user's mods (cuflash.flex: score_mod, mask_mod, block mask) compiled into the main kernels as their Hook
    # template argument: only variants whose kernels take a Hook may serve it.
    flex: bool = False

    def __post_init__(self) -> None:
        if self.headdim_v is None:
            object.__setattr__(self, "headdim_v", self.headdim)
        if self.dtype not in ELEMENT_DTYPES:
            raise ValueError(f"Problem.dtype must be one of {ELEMENT_DTYPES}, got {self.dtype!r}")
        for name in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim", "headdim_v"):
            if getattr(self, name) < 0:
                raise ValueError(f"Problem.{name} must be >= 0, got {getattr(self, name)}")
        if self.nheads_k and self.nheads % self.nheads_k:
            raise ValueError("Problem.nheads must be a multiple of nheads_k")
        if not isinstance(self.mask, Mask):
            raise TypeError(f"Problem.mask must be a cuflash.mask.Mask, got {self.mask!r}")
        if self.mask.chunk:
            raise ValueError("Problem.mask must have no chunks: the kernels take none, a chunked call runs as one "
                             "sequence per chunk (cuflash/chunks.py)")
        if not (isinstance(self.softcap, float) and self.softcap >= 0.0):
            raise ValueError(f"Problem.softcap must be a float >= 0, got {self.softcap!r}")
        if self.alibi not in ALIBI_LAYOUTS:
            raise ValueError(f"Problem.alibi must be one of {ALIBI_LAYOUTS}, got {self.alibi!r}")
        if not (isinstance(self.dropout_p, float) and 0.0 <= self.dropout_p < 1.0):
            raise ValueError(f"Problem.dropout_p must be a float in [0, 1), got {self.dropout_p!r}")
        if not (isinstance(self.dropout_batches_per_seed, int) and self.dropout_batches_per_seed >= 0):
            raise ValueError("Problem.dropout_batches_per_seed must be an int >= 0, got "
                             f"{self.dropout_batches_per_seed!r}")
        if self.dropout_batches_per_seed and (self.dropout_p == 0.0 or self.varlen):
            raise ValueError("Problem.dropout_batches_per_seed > 0 needs dropout_p > 0 and a fixed-length batch")
        if (self.total_q is None) != (self.total_k is None):
            raise ValueError("Problem.total_q and Problem.total_k are set together (varlen) or not at all")
        if (self.seqused_q or self.seqused_k) and not self.varlen:
            raise ValueError("Problem.seqused_q and seqused_k (used prefixes of packed sequences) need varlen; a KV "
                             "cache's keys in use are kvcache's")
        if self.varlen and not (0 <= self.total_q and 0 <= self.total_k):
            raise ValueError(f"Problem.total_q and total_k must be >= 0, got {self.total_q} and {self.total_k}")
        if self.page_size and not (self.kvcache and self.page_size % 16 == 0 and self.pages_per_sequence > 0):
            raise ValueError("Problem.page_size (a multiple of 16) needs kvcache and pages_per_sequence > 0")
        if not (isinstance(self.num_splits, int) and self.num_splits >= 0):
            raise ValueError(f"Problem.num_splits must be an int >= 0, got {self.num_splits!r}")
        if self.cache_batch_idx and not (self.kvcache and not self.page_size):
            raise ValueError("Problem.cache_batch_idx indexes a contiguous KV cache: it needs kvcache without pages")
        if self.cache_leftpad and not self.kvcache:
            raise ValueError("Problem.cache_leftpad indexes a KV cache: it needs kvcache")
        if not isinstance(self.sinks, bool):
            raise ValueError(f"Problem.sinks must be a bool, got {self.sinks!r}")
        if self.num_splits != 1 and self.dropout_p > 0.0:
            raise ValueError("Problem.num_splits other than 1 (split-KV) needs dropout_p == 0: the split kernels "
                             "write float32 partials and take no dropout (as FA2's)")

    @property
    def options(self) -> frozenset[str]:
        """The options beyond plain masked attention this problem uses (a variant must support each)."""
        used = set()
        if self.softcap > 0.0:
            used.add("softcap")
        if self.alibi is not None:
            used.add("alibi")
        if self.dropout_p > 0.0:
            used.add("dropout")
        if self.varlen:
            used.add("varlen")
        if self.kvcache:
            used.add("kvcache")
        if self.page_size:
            used.add("paged")
        if self.num_splits != 1:
            used.add("splitkv")
        if self.sinks:
            used.add("sinks")
        if self.headdim_v != self.headdim:
            used.add("headdim_v")
        if self.flex:
            used.add("flex")
        return frozenset(used)

    @property
    def varlen(self) -> bool:
        return self.total_q is not None

    @property
    def rows_q(self) -> int:
        """Query rows of the whole batch: the rows of the dense float32 buffers (dq_accum, out_accum)."""
        return self.total_q if self.total_q is not None else self.batch * self.seqlen_q

    @property
    def rows_k(self) -> int:
        """Key rows of the whole batch."""
        return self.total_k if self.total_k is not None else self.batch * self.seqlen_k

    @property
    def row_stats_shape(self) -> tuple[int, ...]:
        """Shape of the float32 per-row statistics (lse, D): (batch, nheads, seqlen_q), or (nheads, total_q)."""
        return (self.nheads, self.total_q) if self.total_q is not None else (self.batch, self.nheads, self.seqlen_q)

    @functools.cached_property
    def mask_policy(self) -> MaskPolicy:
        """The NumPy twin of mask.cuh for this problem (made once: traffic formulas ask per tile and per row)."""
        if self.varlen:
            raise ValueError("a varlen problem has one mask per sequence, of lengths that are data (cu_seqlens): "
                             "use Mask.policy(seqlen_q, seqlen_k) per sequence")
        return self.mask.policy(self.seqlen_q, self.seqlen_k)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for MHA, nheads for MQA)."""
        return self.nheads // self.nheads_k if self.nheads_k else 1


def gqa_decode_fold(problem: Problem) -> Problem | None:
    """The problem a one-row KV-cache decode over GQA/MQA heads becomes when each kv head's group of query heads
    is laid out as query rows (FA2's decode fold): seqlen_q = group size, nheads = nheads_k, no mask. K and V are
    then read once per kv head instead of once per query head, and a Q block holds the group instead of one row.
    Exact only when every folded row attends as the one row did: it sees every key (the mask hides none from a
    lone last row) and nothing depends on the row or head (no ALiBi, no dropout, no sinks), in a fixed-length batch
    (a varlen one's rows are packed, not (batch, 1)). None when it does not apply.

    The caller views q and out (batch, 1, nheads, d) as (batch, group, nheads_k, d) (query head kh * group + m at
    row m of kv head kh: strides (batch, head, group * head)) and the lse (batch, nheads, 1) as (batch, nheads_k,
    group), the same memory."""
    if not (problem.kvcache and not problem.varlen and problem.seqlen_q == 1 and problem.group_size > 1
            and problem.alibi is None and not problem.sinks and problem.dropout_p == 0.0
            and problem.mask.last_row_sees_every_key):
        return None
    return dataclasses.replace(problem, seqlen_q=problem.group_size, nheads=problem.nheads_k, mask=Mask())


def decode_window_left(problem: Problem) -> int | None:
    """The window's left bound of a one-row KV-cache decode that gqa_decode_fold refuses only for that bound (None
    otherwise): the lone row sees keys max(0, keys - 1 - bound) .. keys - 1, so a call whose keys start there (its
    cache_leftpad moved by the caller, MaskPolicy.decode_first_key; a paged cache's also its pages before that key
    dropped, chunks.paged_keys_from) and that has no mask sees the same keys, and folds."""
    bound = MaskPolicy.lone_row_left_bound(problem.mask)
    if bound is None or gqa_decode_fold(dataclasses.replace(problem, mask=Mask())) is None:
        return None
    return bound


# The widest V any kernel takes (the largest compiled head dim), and the widest the API takes: FA3's qk 64 / v 512
# pair. A wider V runs as column chunks (value_column_chunks).
MAX_KERNEL_HEADDIM_V = 256
MAX_HEADDIM_V = 2 * MAX_KERNEL_HEADDIM_V
# Chunks start at multiples of this many elements: v's, out's, dout's and dv's chunk pointers keep the 16-byte
# alignment of the arrays' rows (the kernels' whole-chunk copies need it).
_VALUE_CHUNK_ALIGN = 8


def value_column_chunks(headdim_v: int) -> tuple[tuple[int, int], ...]:
    """The one rule for a V wider than the kernels take: its columns cut into as few (start, stop) chunks as the
    kernels allow, of equal width (a multiple of 8 but the last), each run as a problem of its own width.

    Exact by linearity: out's columns are independent given the softmax, which each chunk recomputes; in the
    backward dS = P * (dP - D) with dP and D = rowsum(dO * O) sums over V's columns, so the chunks' dS add up to the
    whole one and so do their dQ and dK, while dV is each chunk's own columns. One chunk (0, headdim_v) otherwise.

    What it costs: Q K^T (and K's reads) once per chunk, and, as for every pair of unequal dims, at the tile's head
    dim (the larger of q's and the chunk's: fa2.tile_head_dim; the columns past q's are zeros). For FA3's qk 64 /
    v 512 pair the MMAs do 2 x (2 x 256 + 2 x 256) = 2048 FLOPs per score where 2 x 64 + 2 x 512 = 1152 are needed:
    a kernel with a Q K^T width of its own (FA3's) would issue 0.56x of them."""
    if headdim_v <= MAX_KERNEL_HEADDIM_V:
        return ((0, headdim_v),)
    count = ceil_div(headdim_v, MAX_KERNEL_HEADDIM_V)
    width = ceil_div(ceil_div(headdim_v, count), _VALUE_CHUNK_ALIGN) * _VALUE_CHUNK_ALIGN
    return tuple((start, min(start + width, headdim_v)) for start in range(0, headdim_v, width))


@dataclass(frozen=True)
class LaunchPlan:
    kernel: KernelInstance
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem_bytes: int

    @property
    def is_empty(self) -> bool:
        """A grid with a zero dimension launches nothing (CUDA would reject it; backends skip it)."""
        return 0 in self.grid


@dataclass(frozen=True)
class Scratch:
    """A float32 buffer a program needs besides its inputs and outputs, bound to the
    AttentionParams pointer field of the same name."""

    name: str
    shape: tuple[int, ...]
    zero_init: bool = False

    def __post_init__(self) -> None:
        if self.name not in SIDE_BUFFER_FIELDS:
            raise ValueError(f"scratch buffer {self.name!r} is not an AttentionParams side buffer")


@dataclass(frozen=True)
class TmaBox:
    """The box a kernel's TMA copies of one tensor move (AttentionParams.tma's member ``tensor``: q, k, v or dout):
    ``cols`` elements of the head dim (one 128-byte swizzled line of 16-bit elements) by ``rows`` rows, of one head
    of one batch. The host encodes the tensor's map per call (backends/program.py's TmaMaps)."""

    tensor: str
    rows: int
    cols: int = 64

    def __post_init__(self) -> None:
        if self.tensor not in TMA_TENSORS:
            raise ValueError(f"TmaBox.tensor must be one of {TMA_TENSORS}, got {self.tensor!r}")


@dataclass(frozen=True)
class Program:
    launches: tuple[LaunchPlan, ...]
    scratch: tuple[Scratch, ...] = field(default=())
    num_dq_splits: int = 1
    num_kv_splits: int = 1  # split-KV forward (attention_params.cuh): splits of each sequence's K/V blocks
    # The tensor maps the launches' TMA copies read (AttentionParams.tma), one box per tensor; none: no TMA.
    tma_boxes: tuple[TmaBox, ...] = field(default=())
