"""Plots in the FlashAttention papers' style, from measured records only.

Speed: TFLOP/s against sequence length, one panel per (dtype, head dim, causal
setting), one series per system. Traffic: global-memory bytes against sequence
length, one series per algorithm (counts, labelled as such). Each figure is
built from a ``*_panels`` function whose data the tests compare with the numbers
that were fed in; matplotlib (the ``bench`` extra) draws them off-screen.
"""

from __future__ import annotations

import math
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("plots need matplotlib: pip install 'cuflash[bench]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speed_panels(result, direction: str) -> dict[tuple[str, int, bool], dict[str, list[tuple[int, float]]]]:
    """{(dtype, headdim, causal): {system: [(seqlen, TFLOP/s), ...] sorted by seqlen}} for one direction; a flex
    workload's panel has its variant's name (workloads.FLEX_VARIANTS) in causal's place."""
    panels: dict[tuple[str, int, bool], dict[str, list[tuple[int, float]]]] = {}
    for m in result.measurements:
        if m.direction != direction:
            continue
        w = m.workload
        panels.setdefault((w.dtype, w.headdim, w.flex or w.causal), {}).setdefault(m.system, []).append((w.seqlen, m.tflops))
    for series in panels.values():
        for points in series.values():
            points.sort()
    return dict(sorted(panels.items(), key=lambda item: (*item[0][:-1], str(item[0][-1]))))


def _panel_title(key) -> str:
    *direction, dtype, headdim, causal = key
    mask = f"flex {causal}" if isinstance(causal, str) else ("causal" if causal else "not causal")
    return ", ".join([*direction, dtype, f"head dim {headdim}", mask])


def _panel_figure(panels: dict, path: Path, title: str, ylabel: str, draw, cols: int = 3) -> Path:
    """One panel per ([direction,] dtype, headdim, causal) key, ``cols`` a row; draw(ax, series) plots its series."""
    plt = _pyplot()
    cols = min(len(panels), cols)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    fig.suptitle(title, fontsize=10)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, series) in zip(flat, panels.items()):
        draw(ax, series)
        ax.set_title(_panel_title(key), fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(plt, fig, path)
    return Path(path)


def save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_speed(ax, series):
    seqlens = sorted({p[0] for points in series.values() for p in points})
    position = {s: i for i, s in enumerate(seqlens)}  # evenly spaced, as the papers' figures
    for system, points in series.items():
        ax.plot([position[p[0]] for p in points], [p[1] for p in points], marker="o", label=system)
    ax.set_xticks(range(len(seqlens)), [f"{x // 1024}k" if x >= 1024 else str(x) for x in seqlens])
    ax.set_ylim(bottom=0)


def plot_speed(result, direction: str, path: Path) -> Path:
    panels = speed_panels(result, direction)
    if not panels:
        raise ValueError(f"no {direction} measurements to plot")
    # The timing method is in the table and JSON beside the plot; the title keeps to what the axes show.
    return _panel_figure(panels, path, f"Attention {direction} speed on {result.device} (TFLOP/s from device time)",
                         "TFLOP/s", _draw_speed)


def speed_direction_panels(result) -> dict[tuple, dict[str, list[tuple[int, float]]]]:
    """speed_panels of every direction measured, keyed (direction, dtype, headdim, causal), a row per direction."""
    from .workloads import DIRECTIONS

    return {(direction, *key): series for direction in DIRECTIONS
            for key, series in speed_panels(result, direction).items()}


def plot_speed_directions(result, path: Path) -> Path:
    """One figure of every direction (first-gpu's summary.png): a row of panels per direction."""
    panels = speed_direction_panels(result)
    if not panels:
        raise ValueError("no measurements to plot")
    per_direction = max(sum(1 for k in panels if k[0] == d) for d in {k[0] for k in panels})
    return _panel_figure(panels, path, f"Attention speed on {result.device} (TFLOP/s from device time)", "TFLOP/s",
                         _draw_speed, cols=min(per_direction, 4))


def plot_message(message: str, path: Path) -> Path:
    """A figure holding only ``message``: a summary's plot when there is nothing to plot, saying why."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    save(plt, fig, path)
    return Path(path)


def traffic_panels(records: list[dict]) -> dict[tuple[str, int, bool], dict[str, list[tuple[int, int]]]]:
    """{(dtype, headdim, causal): {algorithm: [(seqlen, bytes read + written, fwd + bwd), ...]}} from traffic records."""
    totals: dict[tuple, dict[str, dict[int, int]]] = {}
    for r in records:
        key = (r["dtype"], r["headdim"], r["causal"])
        per_seqlen = totals.setdefault(key, {}).setdefault(r["algorithm"], {})
        per_seqlen[r["seqlen"]] = per_seqlen.get(r["seqlen"], 0) + r["bytes_read"] + r["bytes_written"]
    return {key: {alg: sorted(points.items()) for alg, points in series.items()}
            for key, series in sorted(totals.items())}


def plot_traffic(records: list[dict], path: Path, title: str) -> Path:
    panels = traffic_panels(records)
    if not panels:
        raise ValueError("no traffic records to plot")

    def draw(ax, series):
        for algorithm, points in series.items():
            ax.plot([p[0] for p in points], [p[1] / 1e6 for p in points], marker="o", label=algorithm)
        seqlens = sorted({p[0] for points in series.values() for p in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [str(s) for s in seqlens])
        ax.set_yscale("log")

    return _panel_figure(panels, path, title, "global MB read + written (simulator count)", draw)
