"""What `python -m jobs.report` shows of a run directory: its text tables, its plots, one HTML page.

Reads only the run dir, so it works on a run that is still going: `events.jsonl`, `metrics.jsonl`
(a torn last line is skipped), and `telemetry/rank<r>.h5` when per-rank phase timing exists: one
HDF5 file per rank, one 1-D float dataset of seconds per step for each phase name (`data`,
`forward`, ...); `step`, `attempt` and `time` datasets, if present, are not phases (the writer is
jobs/telemetry/phases.py). Without
`telemetry/` the phase table and heatmap are left out. Torch-free.
"""

from __future__ import annotations

import html
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jobs.events import read_events
from jobs.extras import require
from jobs.failure.heartbeat import read_beats
from jobs.failure.ledger import Attempt, attempts, render_summary
from jobs.records import load_json
from jobs.telemetry.goodput import KINDS, Closed, Goodput, close_dead, expected_goodput, measure_goodput
from jobs.telemetry.phases import META, committed_rows, in_step_order

__all__ = [
    "RunData",
    "collect",
    "dead_attempts",
    "queue_waits",
    "slurm_ends",
    "read_phases",
    "goodput_table",
    "phase_table",
    "straggler_table",
    "moe_balance",
    "moe_balance_table",
    "health_table",
    "render_text",
    "write_report",
]

# What each goodput kind holds, as the table says it (jobs/telemetry/goodput.py has the measurement).
_MEANS = {
    "productive": "steps the run kept",
    "startup": "attempt start -> first step (rendezvous, build, load)",
    "checkpoint_stall": "training blocked by saves (blocking_s)",
    "lost_work": "steps trained again or never saved (failure, rollback)",
    "failure_detection": "a failure's last step -> its decision",
    "restart_gap": "between attempts, outside the queue",
    "queue_wait": "Slurm Submit -> Start (sacct)",
    "other": "logging, eval, reload, final save, teardown",
}


@dataclass
class RunData:
    run_dir: Path
    events: list[dict]
    metrics: list[dict]
    attempts: list[Attempt]
    goodput: Goodput
    phases: dict[int, dict[str, float]]  # rank -> phase -> median seconds per step; {} without telemetry
    running: bool  # the newest attempt has no end yet
    sacct: bool  # queue wait came from sacct
    evals: list[dict] = field(default_factory=list)  # metrics.jsonl's {"record": "eval"} lines (held-out loss)
    expected_why: str = ""  # why there is no expected goodput (jobs.report.plan_costs: the planner's reason)


def collect(
    run_dir: Path,
    *,
    now: float | None = None,
    sacct_records: list[dict[str, str]] | None = None,
    expected: float | None = None,
    costs: dict[str, float] | None = None,
    expected_why: str = "",
) -> RunData:
    """Everything the report shows, read from `run_dir` as it is now. `sacct_records`: the run's
    Slurm records (JobID, State, Submit, Start, End), None when sacct is not available. `expected`:
    the expected goodput, else computed from `costs` (expected_goodput's keywords but solve_s) for
    the productive time measured; `expected_why`: why there is none, shown in its place."""
    now = time.time() if now is None else now
    events = read_events(run_dir / "events.jsonl")
    rows_all = read_events(run_dir / "metrics.jsonl")
    metrics = [m for m in rows_all if "step" in m and m.get("record") != "eval"]  # step lines; evals apart
    evals = [m for m in rows_all if m.get("record") == "eval"]
    rows = attempts(events)
    closed = dead_attempts(run_dir, rows, events, metrics, now=now, sacct_records=sacct_records)
    g = measure_goodput(
        events, metrics, now=now, queue=queue_waits(sacct_records or []), expected=expected, closed=closed
    )
    if g.expected is None and costs is not None:
        g.expected = expected_goodput(solve_s=g.seconds["productive"], **costs)
    return RunData(
        run_dir,
        events,
        metrics,
        rows,
        g,
        read_phases(run_dir / "telemetry"),
        running=bool(rows) and rows[-1].end is None and rows[-1].attempt not in closed,
        sacct=sacct_records is not None,
        evals=evals,
        expected_why=expected_why,
    )


def dead_attempts(
    run_dir: Path,
    rows: list[Attempt],
    events: list[dict],
    metrics: list[dict],
    *,
    now: float,
    sacct_records: list[dict[str, str]] | None,
) -> dict[str, Closed]:
    """The attempts without an end that are dead (jobs.telemetry.goodput.close_dead), judged by their Slurm
    records, their heartbeats under `run_dir` and the run's failure.heartbeat_s / failure.hang_timeout_s."""
    knobs = _failure_knobs(run_dir)
    beats = {
        a.attempt: max(b.time for b in got.values())
        for a in rows
        if a.end is None and (got := read_beats(run_dir, a.attempt))
    }
    return close_dead(
        rows,
        events,
        metrics,
        now=now,
        beats=beats,
        slurm=slurm_ends(rows, sacct_records or []),
        fresh_s=_FRESH_BEATS * knobs["heartbeat_s"] + _FRESH_SLACK_S,
        quiet_s=knobs["hang_timeout_s"],
    )


# A heartbeat younger than this many failure.heartbeat_s (+ slack) is live (the same rule as jobs/launch/rundir.py).
_FRESH_BEATS = 5
_FRESH_SLACK_S = 5.0


def _failure_knobs(run_dir: Path) -> dict[str, float]:
    """failure.heartbeat_s and failure.hang_timeout_s of the run (owner.json's flat config), else the defaults."""
    try:
        cfg = load_json(run_dir / "owner.json").get("config", {})
    except (OSError, ValueError):
        cfg = {}
    return {
        "heartbeat_s": float(cfg.get("failure.heartbeat_s") or 2.0),
        "hang_timeout_s": float(cfg.get("failure.hang_timeout_s") or 180.0),
    }


def slurm_ends(rows: list[Attempt], records: list[dict[str, str]]) -> dict[str, tuple[str, float | None]]:
    """(State, End as epoch seconds or None) of each Slurm attempt: record number <restart> of its job's
    `sacct --duplicates` records (attempt `<job id>.<restart>[.<n>]`), else the job's last record."""
    by_job: dict[str, list[dict[str, str]]] = {}
    for r in records:
        by_job.setdefault(r.get("JobID", ""), []).append(r)
    out = {}
    for a in rows:
        recs = by_job.get(a.job_id or "")
        if not recs:
            continue
        part = a.attempt.split(".")
        i = int(part[1]) if len(part) > 1 and part[1].isdigit() else len(recs) - 1
        r = recs[min(i, len(recs) - 1)]
        try:
            end = datetime.fromisoformat(r.get("End", "")).timestamp()
        except ValueError:  # "Unknown" while it runs
            end = None
        out[a.attempt] = (r.get("State", ""), end)
    return out


def queue_waits(records: list[dict[str, str]]) -> list[tuple[float, float]]:
    """(Submit, Start) of each sacct record that has started, as epoch seconds (sacct prints local time)."""
    out = []
    for r in records:
        try:
            out.append(
                (datetime.fromisoformat(r["Submit"]).timestamp(), datetime.fromisoformat(r["Start"]).timestamp())
            )
        except (KeyError, ValueError):  # "Unknown" / "None" while pending
            continue
    return out


def read_phases(folder: Path) -> dict[int, dict[str, float]]:
    """Median seconds per step of each phase of each rank, from `folder/rank<r>.h5`; a file being
    written or damaged is skipped. {} when the folder does not exist."""
    files = sorted(folder.glob("rank*.h5")) if folder.is_dir() else []
    if not files:
        return {}
    import h5py

    out = {}
    for path in files:
        m = re.fullmatch(r"rank(\d+)\.h5", path.name)
        if not m:
            continue
        try:
            with h5py.File(path, "r", locking=False) as f:
                n = committed_rows(f)  # a flush may be half done
                out[int(m[1])] = {
                    name: float(statistics.median(vals))
                    for name, ds in f.items()
                    if name not in META and getattr(ds, "ndim", 0) == 1 and (vals := [v for v in ds[:n] if v == v])
                }  # NaN: a row without that phase
        except OSError:
            continue
    return dict(sorted(out.items()))


def goodput_table(g: Goodput, *, sacct: bool, expected_why: str = "") -> str:
    """The headline (productive / allocated, the queue apart), the breakdown of the wall time by kind,
    then expected goodput (or `expected_why` there is none), MTBF and MTTR."""
    lines = [
        f"goodput: {g.goodput:.4f} measured (productive {g.seconds['productive']:.1f} s / allocated "
        f"{g.allocated_s:.1f} s; queue {g.seconds['queue_wait']:.1f} s apart"
        + ("" if sacct else ": sacct not available")
        + f"; {g.wall_goodput:.4f} of the wall time)"
        + (
            f", {g.expected:.4f} expected (jobs.plan's costs, start-up and restarts included)"
            if g.expected is not None
            else f", expected: n/a ({expected_why or 'not planned'})"
        ),
        f"  {'kind':<17} {'seconds':>10} {'share':>7}  what",
    ]
    for k in KINDS:
        s = g.seconds[k]
        note = _MEANS[k] if k != "queue_wait" or sacct else "n/a: sacct not available"
        lines.append(f"  {k:<17} {s:>10.1f} {s / g.wall_s if g.wall_s else 0:>7.1%}  {note}")
    lines.append(f"  {'wall':<17} {g.wall_s:>10.1f} {1:>7.1%}  first submit/start -> last end (or now)")
    lines.append(
        f"  {g.attempts_s:.1f} s inside {len({s.attempt for s in g.segments if s.attempt})} "
        f"attempt(s); steps kept {g.steps_productive}, redone {g.steps_lost}"
    )
    for attempt, c in g.closed.items():
        lines.append(
            f"  attempt {attempt} wrote no end: closed at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(c.end))}"
            f" ({c.by}) as {c.cause}"
        )
    mtbf = f"{g.mtbf_s:.1f} s" if g.mtbf_s is not None else "n/a (no failure)"
    mttr = f"{g.mttr_s:.1f} s" if g.mttr_s is not None else "n/a (no recovery)"
    lines.append(f"  failures {g.failures}; observed job MTBF {mtbf}; MTTR {mttr} (last progress -> next step)")
    return "\n".join(lines)


def phase_table(phases: dict[int, dict[str, float]]) -> str:
    """Median ms per step, rank by phase, and each phase's slowest rank over the ranks' median; beyond
    PHASE_TABLE_RANKS ranks, the median, p90 and max over ranks and the slowest rank instead of one row each."""
    names = in_step_order(phases)
    w = 10 if len(phases) > PHASE_TABLE_RANKS else 4
    head = "  " + f"{'rank':>{w}} " + " ".join(f"{n:>12}" for n in names)
    cols = {n: [p[n] for p in phases.values() if n in p] for n in names}
    if len(phases) > PHASE_TABLE_RANKS:
        import numpy as np  # lazy: jobs.status imports this file and never aggregates phases

        lines = [f"phases (median ms per step, {len(phases)} ranks aggregated):", head]
        for label, q in (("median", 50), ("p90", 90), ("max", 100)):
            lines.append(
                "  " + f"{label:>10} " + " ".join(f"{1e3 * float(np.percentile(cols[n], q)):>12.2f}" for n in names)
            )
        slowest = [max((p[n], r) for r, p in phases.items() if n in p)[1] for n in names]
        lines.append("  " + f"{'max rank':>10} " + " ".join(f"{r:>12}" for r in slowest))
    else:
        lines = ["phases (median ms per step):", head]
        for r, p in phases.items():
            lines.append(
                "  " + f"{r:>4} " + " ".join(f"{1e3 * p[n]:>12.2f}" if n in p else f"{'-':>12}" for n in names)
            )
    ratio = []
    for n in names:
        med = statistics.median(cols[n])
        ratio.append(f"{max(cols[n]) / med:>12.2f}" if med > 0 else f"{'-':>12}")
    lines.append("  " + f"{'max/median':>{w}} " + " ".join(ratio))
    return "\n".join(lines)


PHASE_TABLE_RANKS = 32  # more ranks than this: the phase table shows percentiles over ranks


def render_text(d: RunData) -> str:
    """The report's text: the run's state, the attempts and their causes, goodput, phases."""
    last = d.metrics[-1] if d.metrics else {}
    steps = next((e.get("steps") for e in reversed(d.events) if e.get("kind") == "train_start"), None)
    head = (
        f"run {d.run_dir}: {'running' if d.running else 'ended'}; step {last.get('step', 0)} of {steps or '?'}"
        + (f", loss {last['loss']:.4f}" if "loss" in last else "")
        + (
            f", held-out loss {d.evals[-1]['eval_loss']:.4f} (ppl {d.evals[-1]['eval_ppl']:.2f}) at step "
            f"{d.evals[-1]['step']}"
            if d.evals
            else ""
        )
    )
    parts = [
        head + _throughput(last),
        render_summary(d.events),
        _causes(d.attempts),
        goodput_table(d.goodput, sacct=d.sacct, expected_why=d.expected_why),
    ]
    parts.append(phase_table(d.phases) if d.phases else "phases: no telemetry/ in this run dir")
    balance = moe_balance(d.metrics)
    if balance:
        parts.append(moe_balance_table(balance))
    parts.append(straggler_table(d.events, persistent_imbalance=any(b["persistent"] for b in balance.values())))
    parts.append(health_table(d.events))
    return "\n\n".join(parts)


def _throughput(last: dict) -> str:
    """The last logged interval's tok/s, MFU (TFLOP/s per rank without a GPU peak), step time and peak memory."""
    parts = [
        f"{last['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in last else "",
        f"MFU {100 * last['mfu']:.1f}%"
        if "mfu" in last
        else f"{last['tflops_per_rank']:.3g} TFLOP/s per rank"
        if "tflops_per_rank" in last
        else "",
        f"{last['step_time_s']:.3f} s/step" if "step_time_s" in last else "",
        f"peak memory {last['peak_mem_bytes'] / 2**30:.2f} GiB" if "peak_mem_bytes" in last else "",
    ]
    shown = " | ".join(p for p in parts if p)
    return f"\n  last interval: {shown}" if shown else ""


def health_table(events: list[dict]) -> str:
    """The run's GPU-health findings (`gpu_health` events that are not ok): when, node, GPU, level, what."""
    found = [e for e in events if e.get("kind") == "gpu_health" and e.get("level") not in ("ok", "skipped")]
    skipped = any(e.get("kind") == "gpu_health" and e.get("level") == "skipped" for e in events)
    if not found:
        return "GPU health: " + ("not checked (no GPU)" if skipped else "no finding")
    lines = [f"GPU health: {len(found)} finding(s)", f"  {'attempt':<12} {'node':<10} {'level':<8} {'gpu':<14} what"]
    for e in found:
        what = "; ".join(f.get("detail", "") for f in e.get("findings", [])) or e.get("reason", "")
        lines.append(
            f"  {e.get('attempt', ''):<12} {e.get('node', ''):<10} {e.get('level', ''):<8} "
            f"{str(e.get('gpu', ''))[:14]:<14} {what}"
        )
    return "\n".join(lines)


# A MoE layer whose busiest expert takes this many times the mean tokens in PERSISTENT_SHARE of the logged steps is
# persistently imbalanced: the ranks holding its busy experts are slow every step, by routing, not by their hardware.
PERSISTENT_IMBALANCE = 1.5
PERSISTENT_SHARE = 0.8


def moe_balance(metrics: list[dict]) -> dict[int, dict]:
    """Per MoE layer (block index), from metrics.jsonl's `moe_load_imbalance/<block>` fields (jobs.models.moe.BALANCE_FIELDS):
    the last logged step's values, the median imbalance, and whether the imbalance is persistent."""
    out = {}
    layers = sorted({int(k.split("/")[1]) for m in metrics for k in m if k.startswith("moe_load_imbalance/")})
    for layer in layers:
        rows = [m for m in metrics if f"moe_load_imbalance/{layer}" in m]
        seen = sorted(m[f"moe_load_imbalance/{layer}"] for m in rows)
        high = sum(v >= PERSISTENT_IMBALANCE for v in seen)
        out[layer] = {
            "imbalance": rows[-1][f"moe_load_imbalance/{layer}"],
            "median": seen[len(seen) // 2],
            "bias_spread": rows[-1].get(f"moe_bias_spread/{layer}", 0.0),
            "aux_loss": rows[-1].get(f"moe_aux_loss/{layer}", 0.0),
            "persistent": len(seen) >= 3 and high >= PERSISTENT_SHARE * len(seen),
        }
    return out


def moe_balance_table(balance: dict[int, dict]) -> str:
    """Tokens per expert (max / mean) per MoE layer, last and median over the logged steps, the router biases'
    spread and the balance loss; a persistent imbalance is labelled as such."""
    lines = [
        "MoE balance (tokens per expert max / mean; 1.00 = even)",
        f"  {'block':>5} {'last':>6} {'median':>7} {'bias spread':>12} {'aux loss':>10}  verdict",
    ]
    for layer, b in balance.items():
        verdict = f"persistent imbalance (>= {PERSISTENT_IMBALANCE} in {PERSISTENT_SHARE:.0%} of steps)"
        lines.append(
            f"  {layer:>5} {b['imbalance']:>6.2f} {b['median']:>7.2f} {b['bias_spread']:>12.3g} {b['aux_loss']:>10.3g}  "
            + (verdict if b["persistent"] else "ok")
        )
    return "\n".join(lines)


def straggler_table(events: list[dict], *, persistent_imbalance: bool = False) -> str:
    """The run's `straggler` events: when, which check, phase, ranks and nodes, how much slower than what
    (ms per step on the check's clock: work time on CPU ranks; compute kernel or CUDA event time on GPUs for the
    relative check, host time for the individual one); then its `slowdown` events (the whole job slower than
    its baseline), one line each with its cause.
    With a persistent MoE imbalance, the compute phases' findings are labelled as that, not as slow ranks."""
    found = [e for e in events if e.get("kind") == "straggler"]
    slowdowns = [
        f"slowdown at step {e.get('step', 0)} ({e.get('attempt', '')}): {e.get('cause', '')}"
        for e in events
        if e.get("kind") == "slowdown"
    ]
    if not found:
        return "\n".join(["stragglers: none found", *slowdowns])
    lines = [
        f"stragglers: {len(found)}"
        + (
            " (a persistent MoE imbalance, see MoE balance: ranks slow in forward/backward may be the busy experts')"
            if persistent_imbalance
            else ""
        ),
        f"  {'attempt':<12} {'step':>5} {'check':<9} {'phase':<10} {'ranks':<8} "
        f"{'ratio':>6} {'ms':>9} {'vs ms':>9} {'clock':<7}  nodes",
    ]
    for e in found:
        ranks = e["ranks"] if isinstance(e.get("ranks"), str) else ",".join(map(str, e.get("ranks", [])))
        lines.append(
            f"  {e.get('attempt', ''):<12} {e.get('step', 0):>5} {e.get('check', ''):<9} {e.get('phase', ''):<10} "
            f"{ranks:<8} {e.get('ratio', 0):>6.2f} {1e3 * e.get('seconds', 0):>9.2f} "
            f"{1e3 * e.get('reference_s', 0):>9.2f} {e.get('clock', ''):<7}  {','.join(e.get('nodes', []))}"
        )
    return "\n".join([*lines, *slowdowns])


def _causes(rows: list[Attempt]) -> str:
    counts = Counter(f"{a.cause or 'running'} -> {a.action or '-'}" for a in rows)
    return "attempt ends: " + ", ".join(f"{k} x{n}" for k, n in counts.items())


def write_report(d: RunData, out: Path) -> list[Path]:
    """Writes the plots (PNG) and `report.html` into `out`; returns what it wrote."""
    require("matplotlib", needed_by="jobs.report's plots")  # names the extra when it is missing
    from jobs.telemetry import plots

    out.mkdir(parents=True, exist_ok=True)
    written = [
        plots.loss_plot(d.metrics, d.attempts, d.events, out / "loss.png", evals=d.evals),
        plots.metrics_plot(d.metrics, d.attempts, out / "metrics.png"),
        plots.goodput_plot(d.goodput, out / "goodput.png", events=d.events),
    ]
    if d.phases:
        written.append(plots.phase_heatmap(d.phases, out / "phases.png"))
    page = out / "report.html"
    page.write_text(_html(d, [p.name for p in written]))
    return [*written, page]


def _html(d: RunData, images: list[str]) -> str:
    figs = "\n".join(f'<figure><img src="{n}" alt="{n}"></figure>' for n in images)
    title = html.escape(f"meshjob report: {d.run_dir}")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title>'
        "<style>body{font-family:sans-serif;margin:2em} pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
        " img{max-width:100%}</style></head>\n"
        f"<body><h1>{title}</h1><p>written {stamp}{' while the run was going' if d.running else ''}</p>\n"
        f"<pre>{html.escape(render_text(d))}</pre>\n{figs}\n</body></html>\n"
    )
