"""The checkpoint tiers side by side for `jobs.plan`: each tier's save and restart cost (with its source), the failures
it is read after, its interval and its factor of the expected goodput, and the combination against the filesystem tier
alone. The arithmetic is checkpoint/tiers.py, the same functions the CheckpointManager sets its intervals with.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from checkpoint.tiers import (
    FILESYSTEM,
    MEMORY,
    PARTNER,
    combined_goodput,
    memory_mtbf_s,
    plan_tiers,
    tier_interval_s,
    tier_mtbf_s,
    tier_shares,
    tiers_on,
)
from jobs.config import JobConfig
from jobs.events import read_events

__all__ = ["tier_section", "tier_lines"]


def tier_section(cfg: JobConfig, *, ckpt: dict, step_s: float | None) -> dict:
    """The tiers of `cfg` planned with the filesystem tier's figures in `ckpt` (gate._checkpoint's dict): rows per tier,
    the combined expected goodput, the filesystem tier alone (every failure read from it, its single-tier interval),
    and whether every restart cost is known (else both goodputs are upper bounds)."""
    ck, f = cfg.checkpoint, cfg.failure
    memory, partner = tiers_on(ck, spare_nodes=getattr(cfg.launcher, "spare_nodes", 0), nodes=cfg.launcher.nodes)
    costs, sources, known = {FILESYSTEM: (ckpt["blocking_s"], ckpt["restart_s"])}, {}, ckpt["restart_known"]
    sources[FILESYSTEM] = f"save: {ckpt['blocking_source']}; restart: {ckpt['restart_source']}"
    intervals = {FILESYSTEM: ckpt["interval_s"]} if ck.interval == "steps" else {}
    spares = getattr(cfg.launcher, "spare_nodes", 0)
    shares = tier_shares(
        process_share=f.process_share, node_share=f.node_share, memory=memory, partner=partner, spare_nodes=spares
    )
    if ck.interval == "auto" and ck.async_mode != "none":  # as the single-tier plan: no sooner than a write ends
        tau = tier_interval_s(
            save_s=ckpt["blocking_s"], mtbf_s=tier_mtbf_s(mtbf_s=ckpt["mtbf_s"], share=shares[FILESYSTEM])
        )
        if tau is not None:
            intervals[FILESYSTEM] = max(tau, ckpt["write_s"])
    if memory:
        costs[MEMORY], sources[MEMORY], k = _memory_costs(cfg, bytes_per_rank=ckpt["bytes_per_rank"])
        known = known and k
        if ck.memory_interval == "steps" and step_s:
            intervals[MEMORY] = ck.memory_every_steps * step_s
    if partner:
        measured = _ledger_saves(cfg.run.dir, tier=MEMORY, copies=True)  # RAM saves that paid for their copies
        costs[PARTNER], sources[PARTNER], k = _partner_costs(
            cfg, bytes_per_rank=ckpt["bytes_per_rank"], measured=measured
        )
        known = known and k
    kw = dict(mtbf_s=ckpt["mtbf_s"], process_share=f.process_share, node_share=f.node_share, spare_nodes=spares)
    rows = plan_tiers(costs=costs, intervals=intervals, sources=sources, **kw)
    alone = plan_tiers(costs={FILESYSTEM: costs[FILESYSTEM]}, intervals={FILESYSTEM: ckpt["interval_s"]}, **kw)
    return {
        "tiers": [r.as_dict() for r in rows],
        "goodput": combined_goodput(rows),
        "filesystem_only_goodput": combined_goodput(alone),
        "restart_known": known,
        "process_share": f.process_share,
        "node_share": f.node_share,
        "cadence_mtbf_s": memory_mtbf_s(mtbf_s=ckpt["mtbf_s"], shares=shares) if memory else None,
        "interval_steps": {
            r.tier: max(1, round(r.interval_s / step_s)) if step_s and r.interval_s else None for r in rows
        },
    }


def _memory_costs(cfg: JobConfig, *, bytes_per_rank: float) -> tuple[tuple[float, float], str, bool]:
    """((save_s, restart_s), source, restart known) of the RAM tier: the run's own RAM saves when its ledger has
    them, else the state copied at cluster.host_copy_GBps; the restart is that read plus plan.restart_in_allocation_s."""
    cl = cfg.cluster
    move_s = bytes_per_rank / (cl.host_copy_GBps * 1e9)
    saves = _ledger_saves(cfg.run.dir, tier=MEMORY)
    if saves:
        save_s, src = (
            statistics.median(saves),
            f"median blocking_s of {len(saves)} RAM saves in {cfg.run.dir}/events.jsonl",
        )
    else:
        save_s, src = move_s, f"state per rank / cluster.host_copy_GBps({cl.host_copy_GBps:g})"
    restart_s, rsrc, known = _in_allocation(cfg, read_s=move_s, what="RAM read at cluster.host_copy_GBps")
    return (save_s, restart_s), f"save: {src}; restart: {rsrc}", known


def _partner_costs(
    cfg: JobConfig, *, bytes_per_rank: float, measured: list[float]
) -> tuple[tuple[float, float], str, bool]:
    """((save_s, restart_s), source, restart known) of the partner copies: the state sent to (read back from) another
    node at cluster.inter_node_bw_GBps (host_copy_GBps when the profile has no network figure). The copy rides on the
    RAM save: when the ledger's RAM saves (`measured`) sent copies their cost has it, so the copy adds 0 here."""
    cl = cfg.cluster
    bw, key = (
        (cl.inter_node_bw_GBps, "inter_node_bw_GBps")
        if cl.inter_node_bw_GBps > 0
        else (cl.host_copy_GBps, "host_copy_GBps")
    )
    move_s = bytes_per_rank / (bw * 1e9)
    restart_s, rsrc, known = _in_allocation(cfg, read_s=move_s, what=f"read from the partner at cluster.{key}")
    if measured:
        src = f"save: in the {len(measured)} RAM saves measured (they sent the copies); restart: {rsrc}"
        return (0.0, restart_s), src, known
    return (move_s, restart_s), f"save: state per rank / cluster.{key}({bw:g}); restart: {rsrc}", known


def _in_allocation(cfg: JobConfig, *, read_s: float, what: str) -> tuple[float, str, bool]:
    """A restart inside the allocation: the read plus plan.restart_in_allocation_s (a user assumption), else the read
    alone, marked unknown."""
    extra = cfg.plan.restart_in_allocation_s
    if extra is None:
        return read_s, f"{what} only (unknown: set plan.restart_in_allocation_s)", False
    return read_s + extra, f"{what} + plan.restart_in_allocation_s={extra:g} (user assumption)", True


def _ledger_saves(run_dir: str, *, tier: str, copies: bool = False) -> list[float]:
    """blocking_s of the run's saves of `tier` (copies: only RAM saves that sent partner copies)."""
    events = read_events(Path(run_dir) / "events.jsonl")
    return [
        float(e["blocking_s"])
        for e in events
        if e.get("kind") == "checkpoint_saved"
        and e.get("tier") == tier
        and "blocking_s" in e
        and (not copies or e.get("replicas", 0) > 0)
    ]


def tier_lines(section: dict) -> list[str]:
    """The tiers side by side, then the combined expected goodput against the filesystem tier alone."""
    s = section
    job = max(0.0, 1.0 - s["process_share"] - s["node_share"])
    L = [
        f"checkpoint tiers (failure.process_share={s['process_share']:g}, failure.node_share={s['node_share']:g}, "
        f"job {job:.2f}: assumed shares, conf/failure/default.yaml)",
        "  tier           save s  read after (share of failures)       MTBF h   interval s    steps  restart s  goodput",
    ]
    for r in s["tiers"]:
        covers = f"{', '.join(r['failures']) or 'none'} ({r['share']:.0%})"
        mtbf = f"{r['mtbf_s'] / 3600:8.2f}" if r["mtbf_s"] else "       -"
        tau = f"{r['interval_s']:12.1f}" if r["interval_s"] else "           -"
        steps = s["interval_steps"].get(r["tier"])
        tau_steps, goodput = f"{tau} {steps if steps else '-':>8}", f"{r['goodput']:.4f}"
        if r.get("rides_on"):  # one cadence: its interval and goodput factor are the other tier's row
            tau_steps, goodput = f"{'= ' + r['rides_on'] + ' interval':>21}", f"in {r['rides_on']}"
        L.append(
            f"  {r['tier']:12s} {r['save_s']:8.3f}  {covers:34s} {mtbf} {tau_steps} {r['restart_s']:10.1f}  {goodput}"
        )
    L += _cadence_lines(s["tiers"], mtbf_s=s["cadence_mtbf_s"])
    bound = "" if s["restart_known"] else " (upper bounds: a restart cost is unknown, see below)"
    L.append(
        f"  combined expected goodput {s['goodput']:.4f} vs filesystem tier alone {s['filesystem_only_goodput']:.4f}"
        f" ({100 * (s['goodput'] - s['filesystem_only_goodput']):+.2f} points){bound}"
    )
    for r in s["tiers"]:
        L.append(f"  {r['tier']}: {r['source']}")
    return L


def _cadence_lines(rows: list[dict], *, mtbf_s: float | None) -> list[str]:
    """The note under the table when partner copies ride on the RAM saves: what their one interval is made of
    (`mtbf_s`: the failures read from either, checkpoint.tiers.memory_mtbf_s)."""
    by = {r["tier"]: r for r in rows}
    riders = [r for r in rows if r.get("rides_on")]
    if not riders:
        return []
    base = by[riders[0]["rides_on"]]
    group = [base, *riders]
    save = sum(r["save_s"] for r in group)
    mtbf = f"{mtbf_s / 3600:.2f} h" if mtbf_s else "- (none)"
    parts = " + ".join(f"{r['tier']} {r['save_s']:.3f}" for r in group)
    return [
        f"  {', '.join(r['tier'] for r in riders)} copies ride on every {base['tier']} save: one interval, Daly for"
        f" save {save:.3f} s ({parts})",
        f"    and the failures read from either (MTBF {mtbf}); one goodput factor, in the {base['tier']} row"
        " (restarts weighted by share)",
    ]
