"""GPU speed of forward and backward, in TFLOPs/s, timed with CUDA events.

Runs only on a CUDA GPU through CuPy. The CPU simulator executes the same
kernels but its times say nothing about a GPU, so without a device this refuses
instead of printing a number. The sweep follows FlashAttention-2's benchmark:
16k tokens per batch (batch = 16384 / seqlen), hidden size 2048 (nheads =
2048 / headdim), FLOPs = 4 * batch * nheads * seqlen^2 * headdim for the forward
(halved when causal) and 2.5x that for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKENS = 16384
HIDDEN = 2048


class NoGpuError(RuntimeError):
    """Raised when no CUDA device is visible: GPU speed cannot be measured here."""


@dataclass(frozen=True)
class Timing:
    algorithm: str
    headdim: int
    seqlen: int
    causal: bool
    direction: str
    milliseconds: float
    tflops: float


def attention_flops(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool, direction: str) -> float:
    forward = 4.0 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    return forward * (2.5 if direction == "backward" else 1.0)


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # CuPy missing, no driver, no device
        pass
    raise NoGpuError(
        "GPU speed needs a CUDA GPU visible to CuPy (pip install 'cuflash[cuda13]'); none was found. "
        "The CPU simulator runs the same kernels, but its timings are not GPU speed."
    )


def time_call(fn, *, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of fn() on the current stream, measured with CUDA events."""
    cupy = _cupy()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def measure(algorithm: str, *, headdim: int, seqlen: int, causal: bool, dtype: str = "float16",
            repeats: int = 10) -> list[Timing]:
    import cuflash
    from cuflash.testing import numpy_dtype

    cupy = _cupy()
    batch, nheads = max(1, TOKENS // seqlen), max(1, HIDDEN // headdim)
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((batch, seqlen, nheads, headdim), dtype=cupy.float32).astype(numpy_dtype(dtype))
                     for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
    results = []
    for direction, fn in (
        ("forward", lambda: cuflash.attention(q, k, v, causal=causal, algorithm=algorithm)),
        ("backward", lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm)),
    ):
        ms = time_call(fn, repeats=repeats)
        flops = attention_flops(batch, nheads, seqlen, headdim, causal, direction)
        results.append(Timing(algorithm, headdim, seqlen, causal, direction, ms, flops / ms / 1e9))
    return results


def table(algorithms, headdims, seqlens, causal: bool, dtype: str, repeats: int) -> str:
    cupy = _cupy()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    lines = [f"{name}, {dtype}, causal={causal}, {TOKENS} tokens, hidden {HIDDEN}: median of {repeats} runs",
             f"{'algorithm':>9} {'headdim':>7} {'seqlen':>6} {'fwd ms':>8} {'fwd TFLOPs/s':>12} "
             f"{'bwd ms':>8} {'bwd TFLOPs/s':>12}"]
    for algorithm in algorithms:
        for headdim in headdims:
            for seqlen in seqlens:
                fwd, bwd = measure(algorithm, headdim=headdim, seqlen=seqlen, causal=causal, dtype=dtype,
                                   repeats=repeats)
                lines.append(f"{algorithm:>9} {headdim:7d} {seqlen:6d} {fwd.milliseconds:8.3f} {fwd.tflops:12.1f} "
                             f"{bwd.milliseconds:8.3f} {bwd.tflops:12.1f}")
    lines.append("For scale, published FA2 forward on H100 SXM5 (non-causal, head dim 128): 309 -> 370 TFLOPs/s "
                 "from seqlen 512 to 16k.")
    return "\n".join(lines)
