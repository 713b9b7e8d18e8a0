"""From the calibration ranks' raw timings to a profile's figures: the alpha-beta fit of each collective
(t = alpha + bytes / bus_bandwidth, bytes as nccl-tests counts them) and what the probes measured beyond the
compute and communication the planner already models (per FSDP2 unit, per pipeline action, per tp shard)."""

from __future__ import annotations

import statistics

from jobs.config import ClusterConfig, JobConfig
from jobs.planner import arith as P
from jobs.planner.hardware import compute_bytes, hardware, hops
from jobs.planner.probes import PP_PROBE_MICROBATCHES
from jobs.planner.steptime import stage_flops

__all__ = ["fit_alpha_beta", "fit_op", "fsdp_unit_host_s", "pp_action_host_s", "sent_bytes", "tp_rate"]


def sent_bytes(op: str, size: int, n: int) -> float:
    """Bytes one rank sends for a collective over a `size`-byte buffer among n ranks (ring algorithms)."""
    ring = (n - 1) / n
    return {"all_reduce": 2 * ring * size, "send_recv": float(size)}.get(op, ring * size)


def fit_alpha_beta(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares t = alpha + x / (bus * 1e9) over (bytes sent, seconds)."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else 0.0
    alpha = max(mt - slope * mx, min(ts) * 0.01)
    bus = 1.0 / (slope * 1e9) if slope > 0 else float("inf")
    return {"alpha_s": round(alpha, 9), "bus_GBps": round(bus, 4)}


def fit_op(op: str, ranks: list[dict], n: int) -> dict[str, float]:
    """alpha and bus bandwidth on groups of n, and the latency per extra ring hop from groups of 2."""
    fits = {}
    for g in (n, 2):
        key = f"{op}.{g}"
        if key in ranks[0]["collectives"]:
            rows = [r["collectives"][key] for r in ranks if key in r["collectives"]]
            fits[g] = fit_alpha_beta(
                [(sent_bytes(op, size, g), max(r[i][1] for r in rows)) for i, (size, _) in enumerate(rows[0])]
            )
    out = {**fits[n], "ranks": float(n), "alpha_hop_s": 0.0}
    if 2 in fits and hops(op, n) > hops(op, 2):
        out["alpha_hop_s"] = round(max(0.0, (fits[n]["alpha_s"] - fits[2]["alpha_s"]) / (hops(op, n) - hops(op, 2))), 9)
    return out


def fsdp_unit_host_s(cfg: JobConfig, *, tp: int, extra_s: float, collectives: dict) -> float:
    """Seconds of one FSDP2 unit per microbatch beyond the alpha-beta time of its collectives: what
    `fsdp_extra_s` measured less the gathers and reductions of one microbatch over n / tp ranks as
    the fitted links time them, over the model's units (its blocks and the root). That is the hooks,
    the copies into and out of the buffers, and what the collectives cost inside a step beyond their
    time alone (gloo's thread competes with the compute for the cores; peers arrive apart): measured
    2026-12-03 on the 2-core box, 2 ranks, tiny, 2.3 ms per unit of which 1.6 ms with no bytes moving;
    at tp 2 on 4 ranks about 4x that (FSDP2 over DTensor parameters)."""
    m, t, n = cfg.model, cfg.train, cfg.launcher.tasks_per_node
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    hw = hardware(ClusterConfig(matmul_tflops={"x": 1.0}, collectives=collectives), dtype="x", tasks_per_node=n)
    comm = sum(
        hw.link(it.collective, "intra").seconds(calls=it.count, nbytes=it.bytes, op=it.collective, group=it.group)
        for it in P.comm_per_step(
            m,
            stages,
            pp=1,
            dp_replicate=1,
            fsdp=n // tp,
            tp=tp,
            cp=1,
            ep=1,
            microbatches=1,
            seq_len=t.seq_len,
            micro_batch=t.micro_batch,
            activation_checkpointing="none",
            sequence_parallel=cfg.mesh.sequence_parallel,
            compute_bytes=compute_bytes(cfg),
        )
        if it.axis == "dp_shard"
    )
    return max(0.0, extra_s - comm) / (m.n_layers + 1)


def pp_action_host_s(cfg: JobConfig, step_s: float, exchange_s: float, *, rate_tflops: float) -> float:
    """Host seconds per pipeline action: the probe's step less its linear layers' FLOPs at the
    measured rate and its sends (a microbatch's activation out and its gradient back: one exchange per
    microbatch), over its 2 x microbatches actions (each rank runs a forward and a backward per microbatch)."""
    m, t, mb = cfg.model, cfg.train, PP_PROBE_MICROBATCHES
    compute = 3 * 2.0 * mb * t.micro_batch * t.seq_len * m.dim * m.dim / (rate_tflops * 1e12)
    return max(0.0, step_s - compute - mb * exchange_s) / (2 * mb)


def tp_rate(cfg: JobConfig, tp: int, seconds: float, collectives: dict) -> float:
    """TFLOP/s of one tp shard's compute under DTensor: the measured microbatch less its TP
    collectives as the fitted alpha-beta model times them (at least a quarter of it stays compute)."""
    m, t = cfg.model, cfg.train
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    hw = hardware(ClusterConfig(matmul_tflops={"x": 1.0}, collectives=collectives), dtype="x", tasks_per_node=tp)
    comm = 0.0
    for it in P.comm_per_step(
        m,
        stages,
        pp=1,
        dp_replicate=1,
        fsdp=1,
        tp=tp,
        cp=1,
        ep=1,
        microbatches=1,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        activation_checkpointing="none",
        sequence_parallel=cfg.mesh.sequence_parallel,
        compute_bytes=compute_bytes(cfg),
    ):
        comm += hw.link(it.collective, "intra").seconds(calls=it.count, nbytes=it.bytes, op=it.collective, group=tp)
    _, train, _ = stage_flops(m, stages, tokens=t.micro_batch * t.seq_len, seq_len=t.seq_len, tp=tp, recomputed=[])
    return train / max(seconds - comm, seconds / 4) / 1e12
