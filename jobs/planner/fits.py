"""From the calibration ranks' raw timings to a profile's figures: the alpha-beta fit of each collective
(t = alpha + bytes / bus_bandwidth, bytes as nccl-tests counts them) and what the probes measured beyond the
compute and communication the planner already models (per FSDP2 unit, per pipeline action, per tp shard)."""

from __future__ import annotations

import statistics

from jobs.config import ClusterConfig, JobConfig
from jobs.planner import arith as P
from jobs.planner.collectives import sent_bytes
from jobs.planner.hardware import hardware, hops
from jobs.planner.probes import PP_PROBE_MICROBATCHES, one_stage_items
from jobs.planner.steptime import stage_flops

__all__ = ["fit_alpha_beta", "fit_op", "fsdp_unit_host_s", "pp_action_host_s", "tp_rate"]


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


def fsdp_unit_host_s(cfg: JobConfig, *, tp: int, host_s: float) -> float:
    """Seconds of one FSDP2 unit per microbatch beyond its collectives' own time: `fsdp_host_s` (the
    median over ranks) over the model's units (its blocks and the root). That is the hooks, the copies into and
    out of the buffers, and what the collectives cost inside a step beyond their time alone (gloo's thread
    competes with the compute for the cores; peers arrive apart): measured 2026-12-03 on the 2-core box, 2
    ranks, tiny, 2.3 ms per unit of which 1.6 ms with no bytes moving; at tp 2 on 4 ranks about 4x that (FSDP2
    over DTensor parameters). A figure <= 0 is refused (`_measured`)."""
    what = f"FSDP2 at tp {tp}: one microbatch under fully_shard less the same without it and less its collectives"
    return _measured(cfg, f"fsdp_unit_host_s.tp{tp}", host_s, what=what) / (cfg.model.n_layers + 1)


def pp_action_host_s(cfg: JobConfig, *, host_s: float) -> float:
    """Host seconds per pipeline action: `pp_host_s` (the median over the pairs' ranks) over its 2 x
    microbatches actions (each rank runs a forward and a backward per microbatch). A figure <= 0 is refused."""
    what = "the pipeline probe: one 1F1B step less its stage's compute and its sends"
    return _measured(cfg, "pp_action_host_s", host_s, what=what) / (2 * PP_PROBE_MICROBATCHES)


def _measured(cfg: JobConfig, key: str, host_s: float, *, what: str) -> float:
    """`host_s` when it is positive; else a RuntimeError naming the figure: the profile would read 0 as "not
    modelled" (and a negative time is no time), so nothing is written."""
    if host_s > 0:
        return host_s
    raise RuntimeError(
        f"{key}: {what}, all timed in the same repeats, came out {host_s * 1e3:.3f} ms (median over ranks) <= 0, "
        "so no profile is written (0 would read as 'not modelled'): the machine's speed moved under the probe. "
        f"Rerun on a quieter machine, or with more repeats: calibrate.seconds={2 * cfg.calibrate.seconds:g} "
        f"(now {cfg.calibrate.seconds:g})"
    )


def tp_rate(cfg: JobConfig, tp: int, seconds: float, collectives: dict) -> float:
    """TFLOP/s of one tp shard's compute under DTensor: the measured microbatch less its TP
    collectives as the fitted alpha-beta model times them (at least a quarter of it stays compute)."""
    m, t = cfg.model, cfg.train
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    hw = hardware(ClusterConfig(matmul_tflops={"x": 1.0}, collectives=collectives), dtype="x", tasks_per_node=tp)
    comm = 0.0
    for it in one_stage_items(cfg, fsdp=1, tp=tp):
        comm += hw.link(it.collective, "intra").seconds(calls=it.count, nbytes=it.bytes, op=it.collective, group=tp)
    _, train, _ = stage_flops(m, stages, tokens=t.micro_batch * t.seq_len, seq_len=t.seq_len, tp=tp, recomputed=[])
    return train / max(seconds - comm, seconds / 4) / 1e12
