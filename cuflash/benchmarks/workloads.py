"""What a speed benchmark runs: attention problems, their FLOP counts and the published sweeps.

FLOPs follow FlashAttention-2's benchmark: the forward does two matmuls of
2 * seqlen_q * seqlen_k * headdim each per (batch, head), halved when causal;
the backward does five, counted as 2.5x the forward; forward+backward is 3.5x.

Flex workloads (``Workload.flex``: cuflash.flex_attention with FlexAttention's common variants, FLEX_VARIANTS)
count the FLOPs of the scores their mask keeps, as FlexAttention's benchmark does: the dense count times
``visible_fraction`` (8 equal documents: 1/8; prefix-LM: the prefix's columns plus the causal rest; a relative
bias masks nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import numpy as np

DIRECTIONS = ("forward", "backward", "forward+backward")
_DIRECTION_FACTOR = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}

# FlashAttention-2's sweep: 16k tokens per batch, hidden size 2048.
TOKENS = 16384
HIDDEN = 2048
FA2_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_HEADDIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16", "float32")
# cuflash.flex variants of the speed sweep and the traffic benchmark: packed documents (DOCUMENTS equal ones, a
# mask_mod reading captured document ids, through a block mask), prefix-LM (the first PREFIX_FRACTION of the keys
# bidirectional, then causal) and a learned relative-position bias per head (a score_mod reading a captured table).
FLEX_VARIANTS = ("document", "prefix-lm", "relative-bias")
DOCUMENTS = 8
PREFIX_FRACTION = 4  # the prefix is seqlen // 4 keys


def attention_flops(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool, direction: str) -> float:
    if direction not in _DIRECTION_FACTOR:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    forward = 4.0 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    return forward * _DIRECTION_FACTOR[direction]


@dataclass(frozen=True)
class Workload:
    """One self-attention problem in cuflash's (batch, seqlen, nheads, headdim) layout."""

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    causal: bool
    dtype: str
    flex: str | None = None  # one of FLEX_VARIANTS: cuflash.flex_attention with that variant's mods (flex_mods)

    def __post_init__(self):
        for name in ("batch", "seqlen", "nheads", "headdim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Workload.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.flex is not None and self.flex not in FLEX_VARIANTS:
            raise ValueError(f"Workload.flex must be None or one of {FLEX_VARIANTS}, got {self.flex!r}")
        if self.flex is not None and self.causal:
            raise ValueError("a flex Workload has causal=False: its mask_mod says what each row sees")

    @classmethod
    def fa2_setting(cls, seqlen: int, headdim: int, causal: bool, dtype: str) -> Workload:
        """FA2's benchmark point: batch = 16384 / seqlen, nheads = 2048 / headdim."""
        return cls(max(1, TOKENS // seqlen), seqlen, max(1, HIDDEN // headdim), headdim, causal, dtype)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen, self.nheads, self.headdim)

    def flops(self, direction: str) -> float:
        dense = attention_flops(self.batch, self.nheads, self.seqlen, self.headdim, self.causal, direction)
        return dense * (visible_fraction(self.flex, self.seqlen) if self.flex else 1.0)

    def label(self) -> str:
        mask = self.flex if self.flex else ("causal" if self.causal else "full")
        return f"b{self.batch} s{self.seqlen} h{self.nheads} d{self.headdim} {mask} {self.dtype}"

    def as_dict(self) -> dict:
        return asdict(self)


def flex_sweep(variants=FLEX_VARIANTS, headdims=FA2_HEADDIMS, seqlens=FA2_SEQLENS, dtypes=("float16",)) -> list[Workload]:
    """FA2's setting (16k tokens, hidden 2048) per flex variant, non-causal (the variant's mask decides)."""
    return [dataclasses.replace(Workload.fa2_setting(s, d, False, t), flex=f)
            for t in dtypes for f in variants for d in headdims for s in seqlens]


def document_ids(seqlen: int) -> np.ndarray:
    """DOCUMENTS documents of equal length (the last one shorter where seqlen is no multiple): int32 (seqlen,)."""
    return (np.arange(seqlen) // -(-seqlen // DOCUMENTS)).astype(np.int32)


def visible_fraction(variant: str, seqlen: int) -> float:
    """The fraction of (query, key) pairs the variant's mask keeps (1 for a score_mod alone)."""
    if variant == "document":
        counts = np.bincount(document_ids(seqlen))
        return float((counts.astype(np.float64) ** 2).sum() / seqlen ** 2)
    if variant == "prefix-lm":
        prefix = seqlen // PREFIX_FRACTION
        rows = np.arange(seqlen)
        return float(np.maximum(prefix, rows + 1).sum() / seqlen ** 2)
    if variant == "relative-bias":
        return 1.0
    raise ValueError(f"flex variant must be one of {FLEX_VARIANTS}, got {variant!r}")


def flex_mods(variant: str, seqlen: int, nheads: int, seed: int = 0) -> dict:
    """The variant's mods as cuflash.flex_attention takes them (score_mod and / or mask_mod: Python functions over
    captured jax arrays; a call traces each once per structure). Needs JAX."""
    import jax.numpy as jnp

    if variant == "document":
        documents = jnp.asarray(document_ids(seqlen))

        def same_document(b, h, q_idx, kv_idx):
            return documents[q_idx] == documents[kv_idx]

        return {"mask_mod": same_document}
    if variant == "prefix-lm":
        prefix = seqlen // PREFIX_FRACTION

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return {"mask_mod": prefix_lm}
    if variant == "relative-bias":
        rng = np.random.default_rng(seed)
        table = jnp.asarray(rng.standard_normal((nheads, 2 * seqlen - 1)).astype(np.float32))

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + seqlen - 1]

        return {"score_mod": relative_bias}
    raise ValueError(f"flex variant must be one of {FLEX_VARIANTS}, got {variant!r}")


def fa2_sweep(headdims=FA2_HEADDIMS, seqlens=FA2_SEQLENS, causals=(False, True), dtypes=("float16",)) -> list[Workload]:
    """FA2's sweep in the order its figures read: panel (headdim, causal), then seqlen, per dtype."""
    return [Workload.fa2_setting(s, d, c, t) for t in dtypes for d in headdims for c in causals for s in seqlens]
