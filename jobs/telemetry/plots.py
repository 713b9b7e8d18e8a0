"""The report's PNG plots (matplotlib, headless Agg backend): loss curve, goodput timeline, rank x phase heatmap."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display on a login or compute node
import matplotlib.pyplot as plt  # noqa: E402

from jobs.failure.ledger import Attempt  # noqa: E402
from jobs.telemetry.goodput import KINDS, Goodput  # noqa: E402
from jobs.telemetry.phases import in_step_order  # noqa: E402

__all__ = ["loss_plot", "goodput_plot", "phase_heatmap", "COLORS"]

COLORS = {"productive": "#2ca02c", "startup": "#1f77b4", "checkpoint_stall": "#ff7f0e", "lost_work": "#d62728",
          "failure_detection": "#9467bd", "restart_gap": "#7f7f7f", "queue_wait": "#bcbd22", "other": "#c7c7c7"}


def loss_plot(metrics: list[dict], rows: list[Attempt], events: list[dict], path: Path) -> Path:
    """Loss by step, one line per attempt (redone steps show as overlap); a dashed line where each
    later attempt resumed, labelled with how the one before ended; a tick per committed checkpoint."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, a in enumerate(rows):  # an earlier attempt drawn wider, so that its redone steps show under the later one
        pts = [(m["step"], m["loss"]) for m in metrics if m.get("attempt") == a.attempt and "loss" in m]
        if pts:
            ax.plot(*zip(*pts), lw=1.2 + 1.5 * (len(rows) - 1 - i), label=a.attempt)
    for prev, a in zip(rows, rows[1:]):
        at = a.start_step or 0
        ax.axvline(at, color="#d62728", ls="--", lw=1)
        ax.annotate(f"{a.attempt} after {prev.cause or '?'}", (at, 1), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=8, color="#d62728")
    saved = sorted({e["step"] for e in events if e.get("kind") == "checkpoint_saved" and "step" in e})
    if saved:
        ax.plot(saved, [0.0] * len(saved), "^", color="#ff7f0e", ms=7, transform=ax.get_xaxis_transform(),
                clip_on=False, label="checkpoint saved")
    ax.set(xlabel="step", ylabel="loss", title="loss, restarts and checkpoints")
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def goodput_plot(g: Goodput, path: Path) -> Path:
    """Top: the run's wall time as coloured segments by kind. Bottom: goodput so far (productive
    time / elapsed time) against the goodput jobs.plan expected."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.5), sharex=True, height_ratios=[1, 2])
    scale, unit = (60.0, "min") if g.wall_s < 3 * 3600 else (3600.0, "h")
    for kind in KINDS:
        bars = [((s.start - g.start) / scale, (s.end - s.start) / scale) for s in g.segments if s.kind == kind]
        if bars:
            top.broken_barh(bars, (0, 1), facecolors=COLORS[kind], label=f"{kind} {g.seconds[kind] / g.wall_s:.0%}")
    top.set_yticks([])
    top.legend(fontsize=7, ncols=4, loc="lower left", bbox_to_anchor=(0, 1.02))
    xs, ys, done = [0.0], [0.0], 0.0
    for s in g.segments:
        done += (s.end - s.start) if s.kind == "productive" else 0.0
        if s.end > g.start:
            xs.append((s.end - g.start) / scale)
            ys.append(done / (s.end - g.start))
    bottom.plot(xs, ys, color=COLORS["productive"], label=f"measured (now {g.goodput:.3f})")
    if g.expected is not None:
        bottom.axhline(g.expected, color="black", ls=":", label=f"expected by jobs.plan {g.expected:.3f}")
    bottom.set(xlabel=f"wall time since start ({unit})", ylabel="goodput so far", ylim=(0, 1.05))
    bottom.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def phase_heatmap(phases: dict[int, dict[str, float]], path: Path) -> Path:
    """Median ms per step, ranks down, phases across; each column coloured by its own max."""
    names = in_step_order(phases)
    ranks = list(phases)
    ms = np.array([[1e3 * phases[r].get(n, np.nan) for n in names] for r in ranks])
    norm = ms / np.maximum(np.nanmax(ms, axis=0), 1e-12)
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 0.35 * len(ranks) + 1.5))
    im = ax.imshow(norm, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    if len(ranks) * len(names) <= 400:
        for i, row in enumerate(ms):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(im, ax=ax, label="share of the phase's slowest rank")
    ax.set_title("median ms per step by rank and phase")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
