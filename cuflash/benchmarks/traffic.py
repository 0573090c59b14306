"""Global-memory traffic of each algorithm, measured by the CPU simulator.

The simulator counts every byte kernels read and write through the arch layer's
global load/store/atomic helpers. This command measures forward + backward at
one (batch, head) of the FlashAttention paper's GPT-2 medium setting (seqlen
1024, head dim 64) and scales by batch x heads (64 x 16): every (batch, head)
does identical work, so the scaling is exact for the kernels' traffic. The
paper's figures (A100, fp16) are printed beside: standard attention 40.3 GB,
FlashAttention 4.4 GB of HBM reads + writes. These are byte counts, not times.

``flex_table`` (``traffic --flex``) counts the bytes cuflash.flex_attention reads for the flex variants of the
speed sweep (document mask, prefix-LM, relative bias) beside dense attention: with a block mask the kernels read
only the tiles it lists, so the bytes read fall with its sparsity.

``sweep`` (``traffic --out DIR``) records every launch of forward and backward
over a sweep of sequence lengths and head dims, each count beside the bytes its
family's formula predicts (``forward_traffic`` / ``backward_traffic`` of
kernels/families), and plots the totals against sequence length as the
FlashAttention paper's IO figure does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAPER_GB = {"standard": 40.3, "fa1": 4.4}
GPT2_MEDIUM = dict(batch=64, nheads=16, seqlen=1024, headdim=64)


@dataclass(frozen=True)
class Traffic:
    algorithm: str
    forward_read: int
    forward_written: int
    backward_read: int
    backward_written: int

    @property
    def total(self) -> int:
        return self.forward_read + self.forward_written + self.backward_read + self.backward_written


def measure(algorithm: str, *, seqlen: int, headdim: int, dtype: str = "float16", causal: bool = False) -> Traffic:
    """Bytes moved by forward and backward at batch 1, one head."""
    import cuflash
    from cuflash import sim

    if dtype == "bfloat16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, seqlen, 1, headdim)).astype(dt) for _ in range(4))
    with sim.record() as fwd:
        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
    with sim.record() as bwd:
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm)
    return Traffic(
        algorithm,
        sum(r.global_bytes_read for r in fwd.launches),
        sum(r.global_bytes_written for r in fwd.launches),
        sum(r.global_bytes_read for r in bwd.launches),
        sum(r.global_bytes_written for r in bwd.launches),
    )


def table(algorithms: list[str], *, dtype: str = "float16") -> str:
    scale = GPT2_MEDIUM["batch"] * GPT2_MEDIUM["nheads"]
    lines = [
        f"Global memory traffic, forward + backward, {dtype}, seqlen {GPT2_MEDIUM['seqlen']}, head dim "
        f"{GPT2_MEDIUM['headdim']}: measured by the CPU simulator at batch 1, 1 head, scaled x{scale} to "
        f"GPT-2 medium (batch {GPT2_MEDIUM['batch']}, {GPT2_MEDIUM['nheads']} heads)",
        f"{'algorithm':>10} {'fwd read':>10} {'fwd write':>10} {'bwd read':>10} {'bwd write':>10} {'total GB':>9}"
        f" {'paper GB':>9}",
    ]
    for name in algorithms:
        t = measure(name, seqlen=GPT2_MEDIUM["seqlen"], headdim=GPT2_MEDIUM["headdim"], dtype=dtype)
        gb = lambda n: n * scale / 1e9  # noqa: E731
        paper = PAPER_GB.get(name)
        lines.append(
            f"{name:>10} {gb(t.forward_read):10.2f} {gb(t.forward_written):10.2f} {gb(t.backward_read):10.2f} "
            f"{gb(t.backward_written):10.2f} {gb(t.total):9.2f} {paper if paper is not None else '-':>9}"
        )
    lines += [
        "paper: FlashAttention (Dao et al. 2022), A100, HBM reads + writes; the 'fa1' row compares with its",
        "FlashAttention figure. Why ours differ: standard keeps S and P in float32 (4 bytes, the paper's 2) and its",
        "backward recomputes S and P from q, k and lse (forward and backward are separate calls); fa1 follows",
        "Algorithm 1 literally, moving float32 O, l, m once per K/V block, where the paper's implementation used",
        "larger blocks; fa2 in 16 bits runs the tensor-core kernels with FA2's tiles (128-row Q blocks in the",
        "forward, 128-key K/V blocks in the backward at head dim 64); in float32 its SIMT kernels use 64-row Q",
        "blocks, so K and V are read twice as often.",
    ]
    return "\n".join(lines)


def formula(algorithm: str, direction: str, problem, target) -> list[tuple[int, int]]:
    """(read, written) bytes per launch as the family's traffic formula gives them, empty launches left out."""
    from cuflash.kernels import plans

    family = plans.variant_for(algorithm, problem, target, direction).module
    traffic = getattr(family, f"{direction}_traffic")(problem, target)
    per_launch = [traffic] if isinstance(traffic[0], int) else list(traffic)
    program = (plans.forward_program if direction == "forward" else plans.backward_program)(algorithm, problem, target)
    return [tuple(int(x) for x in t) for plan, t in zip(program.launches, per_launch) if not plan.is_empty]


def sweep(algorithms: list[str], *, seqlens, headdims, dtype: str = "float16", causals=(False, True)) -> list[dict]:
    """One record per (algorithm, shape, direction, launch): the simulator's counts beside the formula's."""
    import cuflash
    from cuflash import sim
    from cuflash.kernels.program import Problem
    from cuflash.mask import Mask
    from cuflash.testing import numpy_dtype

    target = sim.current_target()
    records = []
    for algorithm in algorithms:
        for headdim in headdims:
            for seqlen in seqlens:
                for causal in causals:
                    rng = np.random.default_rng(0)
                    q, k, v, dout = (rng.standard_normal((1, seqlen, 1, headdim)).astype(numpy_dtype(dtype))
                                     for _ in range(4))
                    problem = Problem(dtype, 1, seqlen, seqlen, 1, 1, headdim, mask=Mask.causal(causal))
                    with sim.record() as fwd:
                        out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
                    with sim.record() as bwd:
                        cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm)
                    for direction, rec in (("forward", fwd), ("backward", bwd)):
                        expected = formula(algorithm, direction, problem, target)
                        if len(expected) != len(rec.launches):
                            raise AssertionError(f"{algorithm} {direction}: {len(rec.launches)} launches ran, "
                                                 f"the formula has {len(expected)}")
                        for launch, (f_read, f_written) in zip(rec.launches, expected):
                            records.append({
                                "algorithm": algorithm, "direction": direction, "kernel": launch.kernel,
                                "batch": 1, "nheads": 1, "seqlen": seqlen, "headdim": headdim, "causal": causal,
                                "dtype": dtype, "grid": list(launch.grid), "block": list(launch.block),
                                "bytes_read": launch.global_bytes_read, "bytes_written": launch.global_bytes_written,
                                "formula_read": f_read, "formula_written": f_written,
                            })
    return records


def sweep_outputs(algorithms: list[str], out_dir, *, seqlens, headdims, dtype: str = "float16") -> list[Path]:
    """traffic.json (every launch's counts and formula) and traffic.png (totals against seqlen)."""
    from . import plots
    from cuflash import sim

    records = sweep(algorithms, seqlens=seqlens, headdims=headdims, dtype=dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"what": "global-memory bytes counted by the CPU simulator (counts, not times), batch 1, 1 head",
            "target": sim.current_target().arch, "records": records}
    json_path, png_path = out_dir / "traffic.json", out_dir / "traffic.png"
    json_path.write_text(json.dumps(data, indent=1))
    plots.plot_traffic(records, png_path, f"Global memory traffic, forward + backward, {dtype} "
                                          f"(simulator counts, batch 1, 1 head)")
    return [json_path, png_path]


@dataclass(frozen=True)
class FlexTraffic:
    """Bytes one flex variant moves beside plain dense attention of the same shape (batch 1, one head)."""

    variant: str  # "dense" for plain attention (cuflash.attention, fa2)
    sparsity: float  # percent of the block mask's blocks that are empty (0 for dense and score_mod-only variants)
    forward_read: int
    backward_read: int
    kv_read: int  # the forward's reads less q's bytes: K, V, the block mask's lists and the side arrays


def flex_measure(variants, *, seqlen: int, headdim: int, dtype: str = "float16",
                 block_size: int | None = None) -> list[FlexTraffic]:
    """The forward's and backward's global bytes read of each flex variant (workloads.flex_mods; a mask_mod through
    a block mask of ``block_size``, default seqlen // DOCUMENTS: a document's rows) and of dense attention first.
    With a block mask the kernels read only the K/V tiles it lists, so the bytes fall with its sparsity: 8 equal
    documents read about 1/8 of dense K/V where a document is a whole number of the kernel's tiles."""
    import cuflash
    from cuflash import sim
    from cuflash.flex import create_block_mask
    from cuflash.testing import numpy_dtype

    from .workloads import DOCUMENTS, flex_mods

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, seqlen, 1, headdim)).astype(numpy_dtype(dtype)) for _ in range(4))
    q_bytes = q.nbytes
    rows = []
    with sim.record() as fwd:
        out, lse = cuflash.attention(q, k, v, algorithm="fa2", return_lse=True)
    with sim.record() as bwd:
        cuflash.attention_backward(dout, q, k, v, out, lse, algorithm="fa2")
    forward = sum(r.global_bytes_read for r in fwd.launches)
    rows.append(FlexTraffic("dense", 0.0, forward, sum(r.global_bytes_read for r in bwd.launches), forward - q_bytes))
    for variant in variants:
        mods = flex_mods(variant, seqlen, 1)
        sparsity = 0.0
        mask_mod = mods.pop("mask_mod", None)
        if mask_mod is not None:
            mods["block_mask"] = create_block_mask(mask_mod, None, None, seqlen, seqlen,
                                                   block_size=block_size or max(1, seqlen // DOCUMENTS))
            sparsity = mods["block_mask"].sparsity()
        with sim.record() as fwd:
            out, lse = cuflash.flex_attention(q, k, v, return_lse=True, **mods)
        with sim.record() as bwd:
            cuflash.flex_attention_backward(dout, q, k, v, out, lse, **mods)
        forward = sum(r.global_bytes_read for r in fwd.launches)
        rows.append(FlexTraffic(variant, sparsity, forward, sum(r.global_bytes_read for r in bwd.launches),
                                forward - q_bytes))
    return rows


def flex_table(variants, *, seqlen: int = 1024, headdim: int = 64, dtype: str = "float16") -> str:
    """flex_measure as a table: bytes read per direction and the forward's K/V bytes as a fraction of dense."""
    rows = flex_measure(variants, seqlen=seqlen, headdim=headdim, dtype=dtype)
    dense = rows[0]
    lines = [f"Global bytes read by flex variants beside dense attention (fa2), {dtype}, seqlen {seqlen}, head dim "
             f"{headdim}, batch 1, 1 head: counted by the CPU simulator (byte counts, not times)",
             f"{'variant':>14} {'sparsity %':>10} {'fwd read':>12} {'bwd read':>12} {'fwd K/V':>12} {'K/V / dense':>11}"]
    for row in rows:
        lines.append(f"{row.variant:>14} {row.sparsity:10.1f} {row.forward_read:12d} {row.backward_read:12d} "
                     f"{row.kv_read:12d} {row.kv_read / dense.kv_read:11.3f}")
    lines.append("fwd K/V: the forward's reads less q's bytes (K and V per Q tile, plus the block mask's lists and "
                 "side arrays a flex variant reads)")
    return "\n".join(lines)
