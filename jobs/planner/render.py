"""The readiness gate's plan as text tables (`python -m jobs.plan` without plan.json=true)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.planner import hardware as H
from jobs.planner import traffic as T
from jobs.planner.checks import INTERVAL_LOWER_BOUND, goodput_text, restart_text
from jobs.telemetry.flops import mfu_text

if TYPE_CHECKING:
    from jobs.planner.gate import Plan

__all__ = ["GiB", "render"]

GiB = 2**30


# -------------------------------------------------------------------------------------------- output


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def render(plan: Plan) -> str:
    """The plan as text tables."""
    L = []
    L.append(
        f"plan: {plan.mesh} on {plan.world_size} ranks | params {plan.params_total / 1e9:.2f} B total, "
        f"{plan.params_active / 1e9:.2f} B active | planned in {plan.seconds:.1f} s"
    )
    L.append(f"  meshes: {plan.meshes}")
    for n in plan.notes:
        L.append(f"  note: {n}")
    L.append("")
    L += _memory_lines(plan)
    L.append("")
    L += _comm_lines(plan)
    L.append("")
    L += _checkpoint_lines(plan)
    if plan.tiers:
        from jobs.planner.tiers import tier_lines

        L += tier_lines(plan.tiers)
    L.append("")
    L.append("readiness")
    for r in plan.readiness:
        L.append(f"  [{r['status']:7s}] {r['question']:32s} {r['answer']}")
    L.append("")
    L.append("checks")
    for c in plan.checks:
        L.append(f"  {'PASS' if c.ok else 'FAIL'}  {c.name:20s} {c.why}")
    return "\n".join(L)


def _memory_lines(plan: Plan) -> list[str]:
    """The memory table: per role, the fake-backend samples, and the activations of the peak role."""
    L = []
    L.append("memory per rank (GiB)         params   grads   optim  unshard    acts  pp_recv  logits    peak")
    for r in plan.roles:
        tag = "*" if r["measured"] else " "
        L.append(
            f"  {r['role'][:27]:27s}{tag}"
            + "".join(
                f"{r[k] / GiB:8.2f}"
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_bytes",
                    "unsharded_bytes",
                    "activation_bytes",
                    "p2p_bytes",
                    "logits_bytes",
                    "peak_bytes",
                )
            )
        )
    L.append(
        f"  (* params measured on the real sharded model) 16 B/param heuristic: {_gib(plan.heuristic_bytes_per_rank)} "
        f"for params+grads+optim"
    )
    if plan.per_rank.get("autocast_bytes"):
        L.append(
            f"  peak includes {_gib(plan.per_rank['autocast_bytes'])} of bf16 weight copies autocast keeps for backward "
            "(no FSDP on this mesh: one per microbatch in flight)"
        )
    if plan.measured:
        L.append(
            "  sampled ranks (fake backend):   rank   coords                       measured  analytic max   seconds"
        )
        for r in plan.measured:
            c = r["coords"]
            L.append(
                f"    {r['role'][:28]:28s} {r['rank']:6d}   pp{c['pp']} dp_shard{c['dp_shard']:<6d}           "
                f"{r['params_elems'] / 1e6:10.2f} M {r['analytic_elems'] / 1e6:10.2f} M  {r['seconds']:6.2f}"
            )
    a = plan.activation
    L.append(
        f"  activations ({plan.peak_role}): {a['layers_in_flight']:.0f} layer-microbatches in flight; "
        f"no AC {_gib(a['peak_no_ac_bytes'])}, full AC {_gib(a['peak_full_ac_bytes'])}; "
        f"train.activation_checkpointing={a['activation_checkpointing']}"
    )
    return L


def _comm_lines(plan: Plan) -> list[str]:
    """The communication table of the peak role, the bubble, the axes' link scopes and the predicted step."""
    L = []
    L.append(f"communication per step ({plan.peak_role})")
    L.append("  collective      axis          count        bytes   link        seconds   exposed  what")
    for c in plan.comm:
        secs = f"{c['seconds']:9.4g} {c['exposed_s']:9.4g}" if c["seconds"] is not None else "        -         -"
        L.append(
            f"  {c['collective']:15s} {c['axis']:12s} {c['count']:6d} {c['bytes'] / GiB:9.3g} GiB  {c['link']:9s} {secs}  {c['what']}"
        )
    sources = sorted({c["source"] for c in plan.comm if c.get("source")})
    for src in sources:
        L.append(f"  link figures: {src}")
    L.append(f"  pipeline bubble: {plan.bubble_fraction:.1%}")
    if plan.axes:
        L.append(
            "  axes (ranks one group spans -> link): "
            + "; ".join(
                f"{a['axis']}{a['size']} ours {a['ours_span']} -> {a['ours_scope']}, Llama 3 order {a['llama3_span']} -> "
                f"{a['llama3_scope']}"
                for a in plan.axes
            )
        )
    s = plan.step
    if "step_s" in s:
        L.append(
            f"  step ({s['slowest_role']}): compute {s['compute_s']:.3g} s + recompute {s['recompute_s']:.3g} s + "
            f"memory-bound ops {s['memory_bound_s']:.3g} s + interference {s['interference_s']:.3g} s + "
            f"host {s['host_s']:.3g} s + exposed comm {s['comm_exposed_s']:.3g} s + bubble {s['bubble_s']:.3g} s + dp tail "
            f"{s['dp_exposed_s']:.3g} s + optimizer {s['optimizer_s']:.3g} s = {s['step_s']:.3g} s predicted ({s['tokens_per_s']:.4g} tokens/s"
            + (f", {mfu_text(s['mfu'])})" if "mfu" in s else ")")
        )
        L.append(f"  matmul {s['matmul_tflops']:.4g} TFLOP/s {s['dtype']}: {s['matmul_source']}; {s['overlap']}")
        if s.get("gemm_sms"):
            L.append(f"  GEMM shapes at {s['gemm_efficiency']:.3f} of it: {H.GEMM_SHAPE_SOURCE} ({s['gemm_sms']} SMs)")
        if s.get("attention_tflops"):
            L.append(f"  attention at {s['attention_tflops']:.4g} TFLOP/s: {H.ATTENTION_SOURCE}")
        if s.get("sdpa_backend") == "math":
            L.append(f"  attention on torch's math backend (model.sdpa_backend=math): {T.SCORES_SOURCE}")
        if s.get("norm_kernel") == "fused":
            L.append(f"  norms fused (model.norm_kernel=fused): {T.FUSED_NORM_SOURCE}")
        if s.get("memory_bound_s") or s.get("interference_s"):
            L.append(
                f"  memory-bound ops at {s['hbm_GBps']:.4g} GB/s: {H.HBM_SOURCE}; interference: a hidden collective "
                f"takes {s['comm_sm_share']:.1%} of the compute beside it ({H.COMM_SMS_SOURCE})"
            )
    return L


def _checkpoint_lines(plan: Plan) -> list[str]:
    """The checkpoint lines: size, write and blocking time, interval, restart and expected goodput, with sources."""
    k = plan.checkpoint
    return [
        f"checkpoint: {k['bytes_per_rank'] / 1e9:.2f} GB per rank, {k['bytes_total'] / 1e12:.3f} TB total; write "
        f"{k['write_s']:.1f} s, blocking {k['blocking_s']:.3f} s; job MTBF {k['mtbf_s'] / 3600:.2f} h -> Daly "
        f"{k['daly_interval_s']:.0f} s (Young {k['young_interval_s']:.0f} s); interval used {k['interval_s']:.0f} s"
        + (f" = {k['interval_steps']} steps" if k["interval_steps"] else "")
        + ("" if k["save_known"] else f" ({INTERVAL_LOWER_BOUND})")
        + f"; restart {restart_text(k)}; expected goodput {goodput_text(plan.goodput_expected)}",
        f"  blocking save from: {k['blocking_source']}",
        f"  restart from: {k['restart_source']}",
    ]
