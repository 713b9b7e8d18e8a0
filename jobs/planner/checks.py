"""The plan's readiness checks (each names the knob when it fails) and its six-question readiness table, from
the figures `jobs.planner.gate.build_plan` computed: memory, ranks per node, tp inside the NVLink domain, the
checkpoint's write and timeout, the expected goodput (or "unknown", with a labelled reference), where the step
time goes.

Plain functions of the config and the plan's numbers; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.config import JobConfig
from jobs.planner import arith as P
from jobs.telemetry.flops import mfu_text
from jobs.telemetry.stragglers import HISTORY_WINDOWS, WINDOW_STEPS

__all__ = [
    "Check",
    "analytic_checks",
    "readiness",
    "goodput_text",
    "restart_text",
    "GOODPUT_UNKNOWN",
    "INTERVAL_LOWER_BOUND",
]

GiB = 2**30


@dataclass(frozen=True, slots=True)
class Check:
    """One readiness check: its name, whether it passed, and why (naming the knob when it did not)."""

    name: str
    ok: bool
    why: str


def analytic_checks(
    cfg: JobConfig,
    d,
    mem: P.RankMemory,
    role: str,
    ckpt: dict,
    goodput: float | None,
    upper: float,
    *,
    in_flight: float = 0.0,
) -> list[Check]:
    dims = d.dims
    out = [
        Check(
            "config", True, f"valid: {dims.describe()} on {dims.world_size} ranks, {d.microbatches} microbatches/step"
        )
    ]
    out += _placement_checks(cfg, dims)
    out.append(_memory_check(cfg, mem, role, in_flight))
    out += _checkpoint_checks(cfg, ckpt)
    out += _goodput_checks(cfg, ckpt, goodput, upper)
    return out


def _placement_checks(cfg: JobConfig, dims) -> list[Check]:
    """Ranks per node within the node's GPUs, and tensor parallel inside one NVLink domain (GPU clusters only)."""
    cl, ln, out = cfg.cluster, cfg.launcher, []
    if cl.gpus_per_node > 0:
        ok = ln.tasks_per_node <= cl.gpus_per_node
        out.append(
            Check(
                "ranks_per_node",
                ok,
                f"launcher.tasks_per_node({ln.tasks_per_node}) <= cluster.gpus_per_node({cl.gpus_per_node})"
                if ok
                else f"launcher.tasks_per_node({ln.tasks_per_node}) > cluster.gpus_per_node({cl.gpus_per_node}): "
                f"set launcher.tasks_per_node={cl.gpus_per_node}",
            )
        )
        inner = dims.tp
        ok = inner <= cl.nvlink_domain
        out.append(
            Check(
                "tp_in_nvlink_domain",
                ok,
                f"mesh.tp({dims.tp}) <= cluster.nvlink_domain({cl.nvlink_domain})"
                if ok
                else f"mesh.tp({dims.tp}) > cluster.nvlink_domain({cl.nvlink_domain}): every tensor-parallel collective "
                f"(4 per block per microbatch) would cross nodes at cluster.inter_node_bw_GBps({cl.inter_node_bw_GBps}) "
                f"instead of {cl.intra_node_bw_GBps} GB/s; use mesh.tp<={cl.nvlink_domain} and more mesh.pp or mesh.dp_shard",
            )
        )
    return out


def _memory_check(cfg: JobConfig, mem: P.RankMemory, role: str, in_flight: float) -> Check:
    """The busiest rank's peak against the usable GPU memory, with the fix when it does not fit."""
    cl, pcfg = cfg.cluster, cfg.plan
    if cl.gpu_mem_gib > 0:
        usable = cl.gpu_mem_gib * GiB * pcfg.usable_mem_fraction
        ok = mem.peak_bytes <= usable
        flight = (
            f"; {in_flight:.0f} layer-microbatches of activations in flight on {role} "
            f"(mesh.pp_schedule={cfg.mesh.pp_schedule}, torch's warm-up)"
        )
        why = (
            f"peak {mem.peak_bytes / GiB:.1f} GiB on {role} <= {usable / GiB:.1f} GiB "
            f"(cluster.gpu_mem_gib({cl.gpu_mem_gib}) * plan.usable_mem_fraction({pcfg.usable_mem_fraction}))" + flight
        )
        if not ok:
            fixes = []
            other = mem.peak_bytes - mem.activation_bytes + mem.activation_bytes_full_ac
            if cfg.train.activation_checkpointing != "full" and other <= usable:
                fixes.append(f"train.activation_checkpointing=full fits ({other / GiB:.1f} GiB)")
            fixes.append("raise mesh.pp / mesh.tp / mesh.dp_shard, or lower train.micro_batch")
            why = (
                f"peak {mem.peak_bytes / GiB:.1f} GiB on {role} > {usable / GiB:.1f} GiB usable "
                f"(cluster.gpu_mem_gib({cl.gpu_mem_gib}) * plan.usable_mem_fraction({pcfg.usable_mem_fraction}))"
                + flight
                + ": "
                + "; ".join(fixes)
            )
        return Check("memory", ok, why)
    return Check(
        "memory",
        True,
        f"cluster.gpu_mem_gib=0 ({cl.name}: CPU ranks); peak {mem.peak_bytes / GiB:.2f} GiB per rank, not checked",
    )


def _checkpoint_checks(cfg: JobConfig, ckpt: dict) -> list[Check]:
    """Checkpoints on; an async save shorter than the interval; the watchdog's checkpoint limit covering it."""
    cl, out = cfg.cluster, []
    ck = cfg.checkpoint
    if not ck.enabled:
        out.append(
            Check(
                "checkpoint",
                False,
                "checkpoint.enabled=false: a failure loses the whole run; set checkpoint.enabled=true",
            )
        )
    else:
        ok = ck.async_mode == "none" or ckpt["write_s"] <= ckpt["interval_s"]
        out.append(
            Check(
                "checkpoint",
                ok,
                f"{ckpt['bytes_total'] / 1e12:.3f} TB written in {ckpt['write_s']:.1f} s at cluster.fs_write_GBps({cl.fs_write_GBps}); "
                f"blocking {ckpt['blocking_s']:.2f} s; interval {ckpt['interval_s']:.0f} s"
                if ok
                else f"an async save takes {ckpt['write_s']:.0f} s, longer than the interval {ckpt['interval_s']:.0f} s: "
                "saves would queue; raise checkpoint.every_steps or cluster.fs_write_GBps",
            )
        )
        out.append(_checkpoint_timeout_check(cfg, ckpt))
    return out


def _goodput_checks(cfg: JobConfig, ckpt: dict, goodput: float | None, upper: float) -> list[Check]:
    """The expected goodput against plan.min_goodput (not checked when unknown and its upper bound passes)."""
    pcfg, out = cfg.plan, []
    if goodput is None and upper >= pcfg.min_goodput:
        out.append(Check("goodput", True, f"not checked: {GOODPUT_UNKNOWN}"))
        return out
    ok = goodput is not None and goodput >= pcfg.min_goodput
    out.append(
        Check(
            "goodput",
            ok,
            f"expected goodput {goodput:.3f} >= plan.min_goodput({pcfg.min_goodput}) at MTBF {ckpt['mtbf_s'] / 3600:.2f} h"
            if ok
            else f"expected goodput {f'at most {upper:.3f}' if goodput is None else f'{goodput:.3f}'} < "
            f"plan.min_goodput({pcfg.min_goodput}) at job MTBF {ckpt['mtbf_s'] / 3600:.2f} h "
            f"({ckpt['policy']}, restart {ckpt['restart_s']:.0f} s): use checkpoint.interval=auto, "
            f"checkpoint.async_mode=thread (restart: {ckpt['restart_source']})",
        )
    )
    return out


def _checkpoint_timeout_check(cfg: JobConfig, ckpt: dict) -> Check:
    """failure.checkpoint_timeout_s (the watchdog's limit on a checkpoint write) covers the predicted write."""
    from jobs.validate import check_checkpoint_timeout

    try:
        check_checkpoint_timeout(cfg.failure, write_s=ckpt["write_s"], async_mode=cfg.checkpoint.async_mode)
    except ValueError as e:
        return Check("checkpoint_timeout", False, str(e))
    return Check(
        "checkpoint_timeout",
        True,
        f"failure.checkpoint_timeout_s({cfg.failure.checkpoint_timeout_s:g}) covers "
        f"the predicted write ({ckpt['write_s']:.1f} s, checkpoint.async_mode={cfg.checkpoint.async_mode})",
    )


# Without a ledger or plan.restart_overhead_s the restart cost is unknown: the plan says so rather than print a
# goodput that looks measured. The published reference it cites is context, not this job's figure.
GOODPUT_UNKNOWN = (
    "expected goodput unknown: the restart cost (requeue, start-up, rendezvous, load) is not known; "
    "plan with run.dir=<a run with a ledger> or set plan.restart_overhead_s. Published reference, not "
    "this job's: Llama 3 405B kept > 90% effective training time at a 3.1 h job MTBF on 16,384 "
    'H100 ("The Llama 3 Herd of Models" §3.3.4)'
)
INTERVAL_LOWER_BOUND = (
    "a lower bound: the save cost counts only the bytes moved, set plan.save_fixed_s or plan from a ledger"
)


def goodput_text(goodput: float | None) -> str:
    return f"{goodput:.3f}" if goodput is not None else "unknown (see the goodput check)"


def restart_text(ckpt: dict) -> str:
    return f"{ckpt['restart_s']:.0f} s" if ckpt["restart_known"] else f"unknown (>= {ckpt['restart_s']:.0f} s load)"


def _where_time_goes(cfg: JobConfig, step: dict, bubble: float, comm: list[dict]) -> dict:
    """The predicted step, part by part; "warn" when exposed communication and the bubble outweigh compute."""
    if "step_s" not in step:
        return {
            "question": "where does the step time go?",
            "status": "info",
            "answer": f"{step['model_tflop_per_rank']:.4f} TFLOP per rank per step, bubble {bubble:.1%}; "
            f"cluster={cfg.cluster.name} has no calibrated or cited figures: run python -m jobs.calibrate",
        }
    s = step
    lost = s["comm_exposed_s"] + s["dp_exposed_s"] + s["bubble_s"]
    top = sorted(comm, key=lambda c: -(c.get("exposed_s") or 0))[:2]
    comm_txt = ", ".join(f"{c['collective']}/{c['axis']} {c['exposed_s']:.3g} s exposed ({c['link']})" for c in top)
    mfu = f", {mfu_text(s['mfu'])}" if "mfu" in s else ""
    a2a = sum(c["exposed_s"] or 0 for c in comm if c["axis"].startswith("ep"))
    if a2a:  # which schedule the verdict is about (DeepSeek-V3 report §3.2.1: DualPipe overlaps the all-to-all)
        device = s["compute_s"] + s["recompute_s"] + s.get("memory_bound_s", 0.0)
        comm_txt += (
            f"; the all-to-all ({a2a:.3g} s) is exposed under our mesh.pp_schedule={cfg.mesh.pp_schedule}, "
            f"which overlaps none of it; under DualPipe, which pairs it with another chunk's compute, "
            f"at most max(0, all-to-all - compute) = {max(0.0, a2a - device):.3g} s would be"
        )
    return {
        "question": "where does the step time go?",
        "status": "ok" if lost <= s["compute_s"] else "warn",
        "answer": f"predicted {s['step_s']:.3g} s/step ({s['slowest_role']}): compute {s['compute_s']:.3g} s + "
        f"recompute {s['recompute_s']:.3g} s + memory-bound ops {s['memory_bound_s']:.3g} s + interference "
        f"{s['interference_s']:.3g} s + host {s['host_s']:.3g} s + exposed comm {s['comm_exposed_s']:.3g} s + bubble "
        f"{s['bubble_s']:.3g} s ({bubble:.1%}) + data-parallel tail {s['dp_exposed_s']:.3g} s + optimizer "
        f"{s['optimizer_s']:.3g} s "
        f"(top: {comm_txt}); {s['tokens_per_s']:.4g} tokens/s{mfu}",
    }


def readiness(cfg, d, mem, role, step, bubble, comm, ckpt, goodput, checks) -> list[dict]:
    by = {c.name: c for c in checks}
    fit_ok = by["memory"].ok and by.get("parallelize", Check("", True, "")).ok
    rows = [{"question": "does it fit?", "status": "ok" if fit_ok else "fail", "answer": by["memory"].why}]
    rows.append(_where_time_goes(cfg, step, bubble, comm))
    known = goodput is not None and ckpt["save_known"]
    rows.append(
        {
            "question": "what happens when a rank dies?",
            "status": ("ok" if known else "warn") if by["goodput"].ok else "fail",
            "answer": f"job MTBF {ckpt['mtbf_s'] / 3600:.2f} h; save every {ckpt['interval_s']:.0f} s "
            f"({ckpt['policy']}{'' if ckpt['save_known'] else '; ' + INTERVAL_LOWER_BOUND}); restart "
            f"{restart_text(ckpt)}; lose ~{ckpt['lost_work_per_failure_s']:.0f} s "
            f"of work per failure; expected goodput {goodput_text(goodput)}",
        }
    )
    det = cfg.train.deterministic
    rows.append(
        {
            "question": "will it resume bit-exactly?",
            "status": "ok" if det and cfg.checkpoint.enabled else "warn",
            "answer": f"train.deterministic={det}, train.seed={cfg.train.seed}; checkpoints restore every RNG "
            "and the data cursor: bitwise on the same mesh, fp32-close on another"
            + ("" if cfg.checkpoint.enabled else "; checkpoint.enabled=false: nothing to resume from"),
        }
    )
    f = cfg.failure
    rows.append(
        {
            "question": "will a straggler be seen?",
            "status": "ok" if cfg.metrics.phase_timing else "warn",
            "answer": (
                f"per-rank phase times judged on rank 0 in windows of >= {WINDOW_STEPS} steps (several log "
                f"intervals when train.log_every is shorter; a last, shorter one is not judged), after each "
                f"attempt's first window (warm-up): a rank {f.straggler_ratio}x and {f.straggler_min_diff_s} s "
                f"over its pipeline stage's median, or over its own history beyond its peers' growth (once it "
                f"has {HISTORY_WINDOWS} judged windows; host time on GPUs), for {f.straggler_intervals} consecutive windows is a "
                f"straggler event naming it"
                + ("; a peer-median straggler's node is quarantined" if f.exclude_stragglers else "")
                + f"; every rank's median {f.straggler_ratio}x the baseline under {f.straggler_baseline_root} "
                f"for as many windows is a slowdown event, naming no rank"
            )
            if cfg.metrics.phase_timing
            else "metrics.phase_timing=false: a slow rank shows only as a slower step for everyone",
        }
    )
    drift = cfg.checkpoint.on_env_drift
    rows.append(
        {
            "question": "is the environment pinned?",
            "status": {"refuse": "ok", "warn": "warn"}.get(drift, "fail"),
            "answer": f"checkpoint.on_env_drift={drift}: a resume with a different environment fingerprint is "
            + {"refuse": "refused", "warn": "logged, not refused", "allow": "accepted silently"}.get(drift, drift),
        }
    )
    return rows
