"""Split-KV speed: short-query, long-key forwards with ``num_splits`` 1 (no split), 0 (the heuristic) and a fixed n.

A decode step (one query row) or a short chunk of queries over a long key sequence gives the unsplit forward only
batch x heads x Q-blocks thread blocks: 8 to 32 on a 132-SM GPU, each walking every key. Split-KV cuts the keys into
ranges computed by their own blocks and merged by the combine kernel (fa2.py's ``num_kv_splits``). This benchmark
times ``cuflash.attention(..., num_splits=n)`` at splitkv_shapes() (head dim 128, float16 and bfloat16, FA2's
bottom-right causal mask where seqlen_q < seqlen_k) for each n of SPLIT_COUNTS, with timing.py's timers, and reports
per shape: device ms and host us per call, the split count each plan took (read from the plan the call runs:
``planned_splits``), the heuristic's speedup over no split, and the bytes of K and V read per second. PyTorch SDPA's
flash backend is timed beside it where it runs the same problem (not causal: its ``is_causal`` aligns the diagonal
top-left when seqlen_q < seqlen_k).

Before a system's counts are timed they are checked once per (dtype, heads, seqlen_q, causal) on the shape with its
keys cut to CHECK_SEQLEN_K (the float64 reference and its low-precision twin cost host seconds at 32k keys): each
count's output against the float64 reference by FlashAttention's rule (cuflash._tolerance) and each split output
against the unsplit one (the rule of tests/test_kvcache.py); a count that fails is listed as skipped, not timed.

With ``budget_s`` a shape is started only while the time left exceeds what the latest shape took; the results are
written after every shape, so a run cut short keeps what it measured. ``run_splitkv`` takes the device transfer and
the timers as arguments: tests run it on the simulator (NumPy arrays) with a stand-in timer.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from cuflash._dtypes import element_dtype

from .speed import error_line, share_of_bound, wrong_result_line
from .timing import Sample, Timer, measure
from .workloads import DTYPES

SPLIT_COUNTS = (1, 0, 16)  # no split, FA2's heuristic, and a fixed count the heuristic takes for none of the shapes
CHECK_SEQLEN_K = 1999  # keys of the check problem: a ragged last K/V block, and enough blocks that the heuristic splits
HEADDIM = 128
TORCH_SYSTEM = "torch-flash"
CUFLASH_SYSTEM = "cuflash-fa2"


@dataclass(frozen=True)
class SplitShape:
    """One short-query, long-key forward in cuflash's (batch, seqlen, heads, headdim) layout."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    dtype: str

    def __post_init__(self):
        for name in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SplitShape.{name} must be a positive int, got {value!r}")
        if self.nheads % self.nheads_k:
            raise ValueError(f"SplitShape.nheads ({self.nheads}) must be a multiple of nheads_k ({self.nheads_k})")
        if self.dtype not in DTYPES:
            raise ValueError(f"SplitShape.dtype must be one of {DTYPES}, got {self.dtype!r}")

    def label(self) -> str:
        heads = f"h{self.nheads}" if self.nheads == self.nheads_k else f"h{self.nheads}/{self.nheads_k}"
        return (f"b{self.batch} q{self.seqlen_q} k{self.seqlen_k} {heads} d{self.headdim} "
                f"{'causal' if self.causal else 'full'} {self.dtype}")

    def kv_bytes(self) -> int:
        """Bytes of K and V one forward reads (every key: a bottom-right causal mask with seqlen_q <= seqlen_k hides
        only keys past the last row's, which no row of a short query block skips whole)."""
        return 2 * self.batch * self.seqlen_k * self.nheads_k * self.headdim * element_dtype(self.dtype).itemsize

    def checked_at(self) -> SplitShape:
        """The shape the correctness check runs: the same but its keys cut to CHECK_SEQLEN_K."""
        return replace(self, seqlen_k=min(self.seqlen_k, CHECK_SEQLEN_K))

    def torch_refusal(self) -> str | None:
        """Why PyTorch SDPA's flash backend does not run this problem as cuflash does, or None."""
        if self.causal and self.seqlen_q != self.seqlen_k:
            return "PyTorch's is_causal aligns the diagonal top-left when seqlen_q < seqlen_k (FA2: bottom-right)"
        return None


def splitkv_shapes(dtypes=("bfloat16", "float16")) -> list[SplitShape]:
    """The benchmark's shapes per dtype, the decode steps first: one query row of GQA (32 query heads over 8 KV
    heads) at 8k and 32k keys, then 64 query rows of 8 heads at 4k and 16k keys, then those at 16k causal."""
    shapes = []
    for dtype in dtypes:
        shapes += [SplitShape(1, 1, seqlen_k, 32, 8, HEADDIM, False, dtype) for seqlen_k in (8192, 32768)]
        shapes += [SplitShape(1, 64, seqlen_k, 8, 8, HEADDIM, False, dtype) for seqlen_k in (4096, 16384)]
        shapes.append(SplitShape(1, 64, 16384, 8, 8, HEADDIM, True, dtype))
    return shapes


def planned_splits(q, k, v, causal: bool, num_splits: int, algorithm: str = "fa2") -> tuple[int, str]:
    """(splits, variant) of the forward ``cuflash.attention(q, k, v, causal=causal, num_splits=num_splits)`` runs:
    its Problem made by the API's own checks and planned for the target its arrays run on (the device's SMs, or the
    target the simulator stands in for)."""
    from cuflash import _validation as V
    from cuflash._placement import Placement
    from cuflash.kernels import plans

    problem = V.with_num_splits(V.check_qkv(q, k, v, causal=causal), num_splits)
    target = Placement(("q", "k", "v"), (q, k, v)).backend().target
    program = plans.forward_program(algorithm, problem, target)
    return program.num_kv_splits, plans.variant_for(algorithm, problem, target).name


# ---- the run: every GPU binding is an argument (to_device, to_host, the timers, the PyTorch peer)


@dataclass
class TorchPeer:
    """PyTorch SDPA's flash backend (peers.TorchSdpa) on one shape: its output for the check, and its timed call."""

    system: object  # peers.TorchSdpa

    def call(self, q, k, v, causal: bool) -> Callable[[], object]:
        """The forward on (batch, seqlen, heads, dim) NumPy arrays, copied to the GPU in PyTorch's layout."""
        import torch

        attend, _ = self.system._sdpa(causal, enable_gqa=q.shape[2] != k.shape[2])
        tq, tk, tv = (t.detach() for t in self.system._tensors((q, k, v)))

        def forward():
            with torch.inference_mode():
                return attend(tq, tk, tv)

        return forward

    def compute(self, q, k, v, causal: bool) -> np.ndarray:
        return self.system._numpy(self.call(q, k, v, causal)(), q.dtype)

    def timer(self) -> Timer:
        from . import timing

        return timing.torch_timer()


def _inputs(shape: SplitShape, seed: int):
    from cuflash.testing import random_qkv

    rng = np.random.default_rng(seed)
    return random_qkv(rng, shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_k, shape.headdim,
                      shape.dtype)


def check_counts(shape: SplitShape, counts, to_device, to_host, torch_peer: TorchPeer | None = None,
                 seed: int = 0) -> dict:
    """Verdicts by system and count at ``shape.checked_at()``: {"cuflash-fa2": {str(n): {passed, detail, splits}},
    "torch-flash": {passed, detail}, "seqlen_k": keys} (torch only when given and the shape is one it runs; counts
    keyed by their text, as JSON keeps them)."""
    from cuflash import _tolerance as tol

    checked = shape.checked_at()
    q, k, v = _inputs(checked, seed)
    ref = tol.forward_references(q, k, v, causal=checked.causal)
    dq, dk, dv = (to_device(x) for x in (q, k, v))
    outs, verdicts = {}, {}
    for n in counts:
        splits = None
        try:
            splits, _ = planned_splits(dq, dk, dv, checked.causal, n)
            outs[n] = to_host(_cuflash_call(dq, dk, dv, checked.causal, n)())
            measured = tol.check_close(f"out (num_splits={n})", outs[n], ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
            if n != 1 and 1 in outs:  # the split output against the unsplit one (tests/test_kvcache.py's rule)
                tol.check_close(f"out (num_splits={n}) vs num_splits=1", outs[n], outs[1].astype(np.float64),
                                ref.out_lowp, 2 * tol.FORWARD_FACTOR)
            verdict = {"passed": True, "detail": share_of_bound([measured])}
        except AssertionError as err:
            verdict = {"passed": False, "detail": wrong_result_line(err)}
        except Exception as err:  # the call cannot run at all
            verdict = {"passed": False, "detail": error_line(err)}
        verdicts[str(n)] = {**verdict, "splits": splits}
    result = {CUFLASH_SYSTEM: verdicts, "seqlen_k": checked.seqlen_k}
    if torch_peer is not None and shape.torch_refusal() is None:
        try:
            measured = tol.check_close("torch out", torch_peer.compute(q, k, v, checked.causal), ref.out,
                                       ref.out_lowp, tol.FORWARD_FACTOR)
            result[TORCH_SYSTEM] = {"passed": True, "detail": share_of_bound([measured])}
        except Exception as err:
            result[TORCH_SYSTEM] = {"passed": False, "detail": error_line(err)}
    return result


def _cuflash_call(q, k, v, causal: bool, num_splits: int) -> Callable[[], object]:
    import cuflash

    return lambda: cuflash.attention(q, k, v, causal=causal, num_splits=num_splits)


def _record(shape: SplitShape, system: str, sample: Sample, num_splits: int | None = None, splits: int | None = None,
            variant: str = "") -> dict:
    return {"shape": shape.label(), "system": system, "num_splits": num_splits, "splits": splits, "variant": variant,
            "milliseconds": sample.median, "host_microseconds": sample.host_median,
            "kv_gb_per_s": shape.kv_bytes() / sample.median / 1e6, "runs_ms": list(sample.milliseconds),
            "uncovered_runs": sample.uncovered}


def run_splitkv(shapes, *, to_device: Callable, to_host: Callable, cuflash_timer: Callable[[], Timer],
                counts=SPLIT_COUNTS, torch_peer: TorchPeer | None = None, warmup: int = 3, repeats: int = 10,
                budget_s: float | None = None, clock: Callable[[], float] = time.monotonic, device: str = "",
                timing: str = "", on_shape: Callable[[dict], None] | None = None) -> dict:
    """Check, then time, every count of ``counts`` (1, the baseline of the speedup and of the check, always first)
    and the PyTorch peer on every shape, in order; with ``budget_s`` a shape starts only while the time left exceeds
    what the latest shape took. ``on_shape`` gets the result so far after each shape. Shapes, checks, measurements
    and skips, as JSON-ready dicts."""
    counts = tuple(dict.fromkeys((1, *counts)))
    result = {"device": device, "timing": timing, "counts": list(counts), "check_seqlen_k": CHECK_SEQLEN_K,
              "shapes": [], "checks": {}, "measurements": [], "skipped": []}
    deadline = None if budget_s is None else clock() + budget_s
    latest = 0.0  # seconds the latest shape took: what the next is expected to take
    for shape in shapes:
        if deadline is not None and deadline - clock() < latest:
            result["skipped"].append({"shape": shape.label(), "system": "all",
                                      "reason": f"over budget: {max(deadline - clock(), 0):.0f} s left, the latest "
                                                f"shape took {latest:.0f} s"})
            continue
        began = clock()
        check_key = shape.checked_at().label()
        result["shapes"].append({"label": shape.label(), **asdict(shape), "check": check_key})
        if check_key not in result["checks"]:
            result["checks"][check_key] = check_counts(shape, counts, to_device, to_host, torch_peer)
        check = result["checks"][check_key]
        host = _inputs(shape, seed=1)
        q, k, v = (to_device(x) for x in host)
        timer = cuflash_timer()
        for n in counts:
            verdict = check[CUFLASH_SYSTEM][str(n)]
            if not verdict["passed"]:
                result["skipped"].append({"shape": shape.label(), "system": f"{CUFLASH_SYSTEM} num_splits={n}",
                                          "reason": f"failed its check: {verdict['detail']}"})
                continue
            try:
                splits, variant = planned_splits(q, k, v, shape.causal, n)
                sample = measure(_cuflash_call(q, k, v, shape.causal, n), timer, warmup=warmup, repeats=repeats)
                result["measurements"].append(_record(shape, CUFLASH_SYSTEM, sample, n, splits, variant))
            except Exception as err:  # out of memory, an unsupported shape: say so and go on
                result["skipped"].append({"shape": shape.label(), "system": f"{CUFLASH_SYSTEM} num_splits={n}",
                                          "reason": error_line(err)})
        if torch_peer is not None:
            reason = shape.torch_refusal()
            if reason is None and not check.get(TORCH_SYSTEM, {}).get("passed"):
                reason = f"failed its check: {check.get(TORCH_SYSTEM, {}).get('detail')}"
            if reason is None:
                try:
                    sample = measure(torch_peer.call(*host, shape.causal), torch_peer.timer(), warmup=warmup,
                                     repeats=repeats)
                    result["measurements"].append(_record(shape, TORCH_SYSTEM, sample))
                except Exception as err:
                    reason = error_line(err)
            if reason is not None:
                result["skipped"].append({"shape": shape.label(), "system": TORCH_SYSTEM, "reason": reason})
        latest = clock() - began
        if on_shape is not None:
            on_shape(result)
    return result


# ---- the summary: pure functions of the result


def splitkv_rows(result: dict) -> list[dict]:
    """Per shape: ms per count (and PyTorch's), the splits each count's plan took, the heuristic's speedup over no
    split, K/V GB/s of the fastest cuflash count, and the check's verdict."""
    rows = []
    for shape in result.get("shapes", []):
        label = shape["label"]
        mine = {m["num_splits"]: m for m in result.get("measurements", [])
                if m["shape"] == label and m["system"] == CUFLASH_SYSTEM}
        peer = next((m for m in result.get("measurements", []) if m["shape"] == label and m["system"] == TORCH_SYSTEM),
                     None)
        check = result.get("checks", {}).get(shape.get("check"), {})
        verdicts = check.get(CUFLASH_SYSTEM, {})
        failed = [f"num_splits={n}: {v['detail']}" for n, v in verdicts.items() if not v.get("passed")]
        unsplit, heuristic = mine.get(1), mine.get(0)
        fastest = min(mine.values(), key=lambda m: m["milliseconds"]) if mine else None
        rows.append({
            "shape": label,
            "milliseconds": {n: m["milliseconds"] for n, m in mine.items()},
            "splits": {n: m["splits"] for n, m in mine.items()},
            "torch_milliseconds": peer["milliseconds"] if peer else None,
            "speedup": unsplit["milliseconds"] / heuristic["milliseconds"] if unsplit and heuristic else None,
            "best_kv_gb_per_s": fastest["kv_gb_per_s"] if fastest else None,
            "check": "; ".join(failed) if failed else ("pass" if verdicts else "-"),
        })
    return rows


def _cell(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_lines(result: dict) -> list[str]:
    """The table of splitkv_rows: ms per count with the splits its plan took, the speedup of the heuristic (0) over
    no split (1), PyTorch flash's ms, K/V GB/s of the fastest count and the check; then the skips."""
    counts = list(result.get("counts", SPLIT_COUNTS))
    names = {1: "1 (no split)", 0: "0 (heuristic)"}
    lines = [f"Device {result.get('device') or '?'}; {result.get('timing', '')}".rstrip("; "), "",
             "ms per call (device time, timing.py) with the splits the plan took; each count checked against the "
             "float64 reference and num_splits=1 on the shape with its keys cut to "
             f"{result.get('check_seqlen_k', CHECK_SEQLEN_K)}; K/V GB/s: K and V bytes over the fastest count's ms.",
             "",
             "| shape | " + " | ".join(f"num_splits {names.get(n, n)} ms (splits)" for n in counts)
             + " | speedup 0 / 1 | torch-flash ms | K/V GB/s | check |",
             "|" + "---|" * (len(counts) + 5)]
    for r in splitkv_rows(result):
        cells = [f"{_cell(r['milliseconds'].get(n), '.3f')} ({_cell(r['splits'].get(n), 'd')})"
                 if n in r["milliseconds"] else "-" for n in counts]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {_cell(r['speedup'], '.2f')} | "
                     f"{_cell(r['torch_milliseconds'], '.3f')} | {_cell(r['best_kv_gb_per_s'], '.0f')} | "
                     f"{r['check'].replace('|', '/')} |")
    skipped = result.get("skipped", [])
    if skipped:
        lines += ["", f"Skipped ({len(skipped)}):"] + [f"- {s['system']} {s['shape']}: {s['reason']}" for s in skipped]
    return lines


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """splitkv.json (everything) and splitkv.md (the table)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "splitkv.json", out_dir / "splitkv.md"]
    written[0].write_text(json.dumps(result, indent=1))
    written[1].write_text("\n".join(markdown_lines(result)) + "\n")
    return written


def main(out: Path, *, dtypes=("bfloat16", "float16"), counts=SPLIT_COUNTS, warmup: int = 3, repeats: int = 10,
         budget_s: float | None = None) -> int:
    """Run on the current GPU (NoGpuError without one): CuPy arrays, cuflash's and PyTorch's busy-start timers."""
    from . import peers, timing
    from .speed import device_name

    cupy = timing.cupy_or_refuse()
    torch_system = peers.TorchSdpa("flash")
    unavailable = torch_system.unavailable()
    torch_peer = TorchPeer(torch_system) if unavailable is None else None
    result = run_splitkv(splitkv_shapes(dtypes), to_device=cupy.asarray, to_host=cupy.asnumpy,
                         cuflash_timer=timing.cupy_timer, counts=counts, torch_peer=torch_peer, warmup=warmup,
                         repeats=repeats, budget_s=budget_s, device=device_name(),
                         timing=timing.describe(repeats, warmup, timing.l2_flush_bytes(cupy)),
                         on_shape=lambda so_far: write_outputs(so_far, out))
    if unavailable is not None:
        result["skipped"].append({"shape": "all", "system": TORCH_SYSTEM, "reason": f"unavailable: {unavailable}"})
    print("\n".join(markdown_lines(result)))
    for path in write_outputs(result, out):
        print(f"wrote {path}")
    return 0 if all(v["passed"] for c in result["checks"].values() for v in c[CUFLASH_SYSTEM].values()) else 1


def summary_detail(result: dict) -> str:
    """One line for first-gpu's step table: shapes timed, skips, the heuristic's speedups over no split, checks."""
    rows = splitkv_rows(result)
    speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
    failed = sum(r["check"] not in ("pass", "-") for r in rows)
    spread = f"speedup 0/1 {min(speedups):.2f}x to {max(speedups):.2f}x" if speedups else "no speedup measured"
    return (f"{len(rows)} shapes, {len(result.get('skipped', []))} skipped; {spread}; "
            f"{'checks pass' if not failed else f'{failed} shapes failed a check'}")
