"""The report's PNG plots (matplotlib, headless Agg backend): training metrics, goodput timeline, rank x phase times.

Each plot is a `*_figure` function that builds the figure (what tests read: axes, series, markers) and a
`*_plot` function that saves it. They stay readable at 20 attempts (one legend entry per kind of marker,
attempt labels by number) and at 2,048 ranks (more than HEATMAP_RANKS ranks: the phase times are
drawn as percentiles over ranks with the slowest rank named, not one row per rank).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display on a login or compute node
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from jobs.failure.ledger import Attempt  # noqa: E402
from jobs.telemetry.goodput import KINDS, Goodput  # noqa: E402
from jobs.telemetry.phases import in_step_order  # noqa: E402

__all__ = [
    "loss_plot",
    "metrics_plot",
    "goodput_plot",
    "phase_heatmap",
    "loss_figure",
    "metrics_figure",
    "goodput_figure",
    "phase_figure",
    "COLORS",
    "HEATMAP_RANKS",
]

COLORS = {
    "productive": "#2ca02c",
    "startup": "#1f77b4",
    "checkpoint_stall": "#ff7f0e",
    "lost_work": "#d62728",
    "failure_detection": "#9467bd",
    "restart_gap": "#7f7f7f",
    "queue_wait": "#bcbd22",
    "other": "#c7c7c7",
}
HEATMAP_RANKS = 64  # more ranks than this: percentiles over ranks instead of one heatmap row per rank
_LABELLED = 8  # attempts up to this many get a legend entry / a restart label each


def loss_plot(metrics: list[dict], rows: list[Attempt], events: list[dict], path: Path, evals: list[dict] = ()) -> Path:
    return _save(loss_figure(metrics, rows, events, evals), path)


def loss_figure(metrics: list[dict], rows: list[Attempt], events: list[dict], evals: list[dict] = ()) -> Figure:
    """Training loss by step, one line per attempt (redone steps show as overlap), the held-out loss as
    points; a dashed line where each later attempt resumed; a tick per committed checkpoint."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, a in enumerate(rows):  # an earlier attempt drawn wider, so that its redone steps show under the later one
        pts = [(m["step"], m["loss"]) for m in metrics if m.get("attempt") == a.attempt and "loss" in m]
        if pts:
            ax.plot(
                *zip(*pts),
                lw=1.2 + 1.2 * min(len(rows) - 1 - i, 2),
                label=a.attempt if len(rows) <= _LABELLED else "_",
                color=plt.cm.viridis(i / max(1, len(rows) - 1)),
            )
    ev = [(e["step"], e["eval_loss"]) for e in evals if "eval_loss" in e]
    if ev:
        ax.plot(*zip(*ev), "o", color="black", ms=4, label="eval loss (held-out)")
    for n, (prev, a) in enumerate(zip(rows, rows[1:]), start=1):
        at = a.start_step or 0
        ax.axvline(at, color="#d62728", ls="--", lw=1, label="resumed" if n == 1 else "_")
        text = f"{a.attempt} after {prev.cause or '?'}" if len(rows) <= _LABELLED else f"{n}"
        ax.annotate(
            text,
            (at, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="#d62728",
        )
    saved = sorted({e["step"] for e in events if e.get("kind") == "checkpoint_saved" and "step" in e})
    if saved:
        ax.plot(
            saved,
            [0.0] * len(saved),
            "^",
            color="#ff7f0e",
            ms=6,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label="checkpoint saved",
        )
    title = "loss, restarts and checkpoints" + (f" ({len(rows)} attempts)" if len(rows) > _LABELLED else "")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def metrics_plot(metrics: list[dict], rows: list[Attempt], path: Path) -> Path:
    return _save(metrics_figure(metrics, rows), path)


def metrics_figure(metrics: list[dict], rows: list[Attempt]) -> Figure:
    """Throughput (tok/s), MFU (TFLOP/s per rank without a GPU peak), step time and peak memory by step:
    tok/s and MFU are the logged interval averages; step time is every step's (`trained_steps`); a
    dashed line where each later attempt resumed."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    tok, mfu, step, mem = axes.ravel()
    mfu_key = "mfu" if any("mfu" in m for m in metrics) else "tflops_per_rank"
    for ax, key, scale, label in (
        (tok, "tokens_per_s", 1.0, "tokens/s"),
        (
            mfu,
            mfu_key,
            100.0 if mfu_key == "mfu" else 1.0,
            "MFU (%)" if mfu_key == "mfu" else "TFLOP/s per rank (no GPU peak: no MFU)",
        ),
        (mem, "peak_mem_bytes", 2.0**-30, "peak memory (GiB)"),
    ):
        pts = [(m["step"], m[key] * scale) for m in metrics if isinstance(m.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), ".-", ms=3, lw=1, label=key)
        ax.set(ylabel=label)
    per_step = [(j, dt) for m in metrics for j, _, dt in m.get("trained_steps", ())]
    per_step = per_step or [(m["step"], m["step_time_s"]) for m in metrics if "step_time_s" in m]
    if per_step:
        step.plot(*zip(*per_step), ".", ms=2, label="step_time_s")
    step.set(ylabel="step time (s)", yscale="log" if per_step and _spread(per_step) > 20 else "linear")
    for ax in axes.ravel():
        for a in rows[1:]:
            ax.axvline(a.start_step or 0, color="#d62728", ls="--", lw=0.8)
    for ax in axes[1]:
        ax.set(xlabel="step")
    fig.suptitle("throughput, MFU, step time and peak memory")
    return fig


def _spread(pts: list[tuple[int, float]]) -> float:
    vals = [v for _, v in pts if v > 0]
    return max(vals) / min(vals) if vals else 1.0


def goodput_plot(g: Goodput, path: Path, events: list[dict] = ()) -> Path:
    return _save(goodput_figure(g, events), path)


def goodput_figure(g: Goodput, events: list[dict] = ()) -> Figure:
    """Top: the run's wall time as coloured segments by kind, each attempt's start (numbered), every
    failure and decision marked. Bottom: goodput so far (productive / elapsed allocated time) against the
    expected goodput."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True, height_ratios=[1.3, 2])
    scale, unit = (60.0, "min") if g.wall_s < 3 * 3600 else (3600.0, "h")
    x = lambda t: (t - g.start) / scale  # noqa: E731
    for kind in KINDS:
        bars = [(x(s.start), (s.end - s.start) / scale) for s in g.segments if s.kind == kind]
        if bars:
            share = g.seconds[kind] / g.wall_s if g.wall_s else 0.0
            top.broken_barh(bars, (0, 1), facecolors=COLORS[kind], label=f"{kind} {share:.0%}")
    starts = sorted({s.attempt: s.start for s in reversed(g.segments) if s.attempt}.items(), key=lambda kv: kv[1])
    if starts:
        top.vlines([x(t) for _, t in starts], 0, 1.25, color="black", lw=0.8, label="attempt start")
        for n, (_, t) in enumerate(starts):
            top.annotate(str(n), (x(t), 1.25), fontsize=6, ha="left", va="bottom", annotation_clip=False)
    for kind, marker, color in (("failure", "x", "#d62728"), ("decision", "v", "black")):
        ts = [x(e["time"]) for e in events if e.get("kind") == kind and g.start <= e["time"] <= g.end]
        if ts:
            top.plot(ts, [1.12] * len(ts), marker, color=color, ms=6, ls="none", label=kind)
    top.set(yticks=[], ylim=(0, 1.5))
    top.legend(fontsize=7, ncols=5, loc="lower left", bbox_to_anchor=(0, 1.02))
    xs, ys, done, queued = [0.0], [0.0], 0.0, 0.0
    for s in g.segments:
        done += (s.end - s.start) if s.kind == "productive" else 0.0
        queued += (s.end - s.start) if s.kind == "queue_wait" else 0.0
        if s.end - g.start - queued > 0:
            xs.append(x(s.end))
            ys.append(done / (s.end - g.start - queued))
    bottom.plot(xs, ys, color=COLORS["productive"], label=f"measured (now {g.goodput:.3f})")
    if g.expected is not None:
        bottom.axhline(g.expected, color="black", ls=":", label=f"expected {g.expected:.3f}")
    bottom.set(xlabel=f"wall time since start ({unit})", ylabel="productive / allocated", ylim=(0, 1.05))
    bottom.legend(fontsize=8, loc="lower right")
    return fig


def phase_heatmap(phases: dict[int, dict[str, float]], path: Path) -> Path:
    return _save(phase_figure(phases), path)


def phase_figure(phases: dict[int, dict[str, float]]) -> Figure:
    """Median ms per step by rank and phase: a heatmap (ranks down, phases across, each column coloured by
    its own max, the value written in a colour that reads on its cell) up to HEATMAP_RANKS ranks; beyond,
    per phase the median, p90 and max over ranks, with the slowest rank named."""
    names = in_step_order(phases)
    ranks = list(phases)
    ms = np.array([[1e3 * phases[r].get(n, np.nan) for n in names] for r in ranks])
    if len(ranks) > HEATMAP_RANKS:
        return _phase_percentiles(ms, names, ranks)
    norm = ms / np.maximum(np.nanmax(ms, axis=0), 1e-12)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 0.3 * len(ranks) + 1.8))
    im = ax.imshow(norm, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=7 if len(ranks) > 16 else 9)
    if len(ranks) * len(names) <= 400:
        for i, row in enumerate(ms):
            for j, v in enumerate(row):
                light = np.isfinite(norm[i, j]) and norm[i, j] > 0.6  # viridis turns yellow: dark text reads there
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7, color="black" if light else "white")
    fig.colorbar(im, ax=ax, label="share of the phase's slowest rank")
    ax.set_title("median ms per step by rank and phase")
    return fig


def _phase_percentiles(ms: np.ndarray, names: list[str], ranks: list[int]) -> Figure:
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 3, 4.5))
    xs = np.arange(len(names))
    for q, style, label in (
        (50, "o-", "median over ranks"),
        (90, "s--", "p90 over ranks"),
        (100, "^:", "slowest rank"),
    ):
        ax.plot(xs, np.nanpercentile(ms, q, axis=0), style, label=label)
    for j in range(len(names)):
        col = ms[:, j]
        if np.isfinite(col).any():
            r = ranks[int(np.nanargmax(col))]
            ax.annotate(f"rank {r}", (j, float(np.nanmax(col))), fontsize=7, ha="center", va="bottom")
    ax.set_xticks(xs, names, rotation=30, ha="right")
    ax.set(ylabel="ms per step", title=f"median ms per step over {len(ranks)} ranks (percentiles)")
    ax.legend(fontsize=8)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
