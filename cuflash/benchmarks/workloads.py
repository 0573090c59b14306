"""What a speed benchmark runs: attention problems, their FLOP counts and the published sweeps.

FLOPs follow FlashAttention-2's benchmark: the forward does two matmuls of
2 * seqlen_q * seqlen_k * headdim each per (batch, head), halved when causal;
the backward does five, counted as 2.5x the forward; forward+backward is 3.5x.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DIRECTIONS = ("forward", "backward", "forward+backward")
_DIRECTION_FACTOR = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}

# FlashAttention-2's sweep: 16k tokens per batch, hidden size 2048.
TOKENS = 16384
HIDDEN = 2048
FA2_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_HEADDIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16", "float32")


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

    def __post_init__(self):
        for name in ("batch", "seqlen", "nheads", "headdim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Workload.dtype must be one of {DTYPES}, got {self.dtype!r}")

    @classmethod
    def fa2_setting(cls, seqlen: int, headdim: int, causal: bool, dtype: str) -> Workload:
        """FA2's benchmark point: batch = 16384 / seqlen, nheads = 2048 / headdim."""
        return cls(max(1, TOKENS // seqlen), seqlen, max(1, HIDDEN // headdim), headdim, causal, dtype)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen, self.nheads, self.headdim)

    def flops(self, direction: str) -> float:
        return attention_flops(self.batch, self.nheads, self.seqlen, self.headdim, self.causal, direction)

    def label(self) -> str:
        return (f"b{self.batch} s{self.seqlen} h{self.nheads} d{self.headdim} "
                f"{'causal' if self.causal else 'full'} {self.dtype}")

    def as_dict(self) -> dict:
        return asdict(self)


def fa2_sweep(headdims=FA2_HEADDIMS, seqlens=FA2_SEQLENS, causals=(False, True), dtypes=("float16",)) -> list[Workload]:
    """FA2's sweep in the order its figures read: panel (headdim, causal), then seqlen, per dtype."""
    return [Workload.fa2_setting(s, d, c, t) for t in dtypes for d in headdims for c in causals for s in seqlens]
