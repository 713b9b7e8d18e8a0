"""Measures this machine for the planner (`python -m jobs.calibrate` is its entry point): the achieved
matmul rate of the model's own shapes with every local rank busy at once, each collective's latency
and bus bandwidth over the real backend between the ranks of a small job, the host copy bandwidth,
and the run filesystem's write bandwidth and write+fsync cost. The figures go into a cluster profile
under the keys `jobs.config.ClusterConfig` names (`calibrated`, `matmul_tflops`, `collectives`,
`host_copy_GBps`, `fs_write_GBps`, `fs_fsync_s`).

The ranks are `launcher.tasks_per_node` processes forked on this machine (gloo on CPU, NCCL on
CUDA), as the local launcher starts them; all of them time the model at once, so on a CPU box where
8 ranks share 2 cores the rate is the one each rank gets when all are busy, as in training.
Collectives are timed over the whole job (scope "intra": one node) at a few sizes and fitted with
t = alpha + bytes / bus_bandwidth (bytes one rank sends: the nccl-tests bus-bandwidth convention).

This module assembles the profile and writes it; the parts are `calibrate_ranks` (the forked ranks),
`probes` (the model's), `collectives`, `storage` (host copy and filesystem), `timing` (repeats and medians,
together across ranks) and `fits` (from raw timings to the profile's figures).
"""

from __future__ import annotations

import copy
import os
import statistics
from datetime import UTC, datetime
from pathlib import Path

from jobs.config import JobConfig
from jobs.planner.calibrate_ranks import run_ranks
from jobs.planner.fits import fit_op, fsdp_unit_host_s, pp_action_host_s, tp_rate
from jobs.planner.hardware import OPS, compute_dtype
from jobs.planner.storage import fs_write_and_commit, host_copy_GBps

__all__ = ["calibrate", "write_profile"]


def calibrate(cfg: JobConfig, *, command: str) -> dict:
    """Measures and returns the profile keys (see the module docstring)."""
    ranks = run_ranks(cfg)
    n = cfg.launcher.tasks_per_node
    dtype = compute_dtype(cfg.train.mixed_precision, gpus_per_node=cfg.cluster.gpus_per_node)
    collectives = {f"{op}.intra": fit_op(op, ranks, n) for op in OPS}
    rates = {1: statistics.median(r["rates"][1] for r in ranks)}
    for tp in ranks[0]["tp_seconds"]:
        rates[tp] = tp_rate(cfg, tp, statistics.median(r["tp_seconds"][tp] for r in ranks), collectives)
    fs_bw, fsync = fs_write_and_commit(cfg.cluster.run_root, cfg.calibrate.seconds)
    pp = [r["pp_host_s"] for r in ranks if r["pp_host_s"] is not None]  # one rank alone has no pipeline probe
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    matmul = {dtype: round(rates[1], 6), **{f"{dtype}.tp{tp}": round(v, 6) for tp, v in rates.items() if tp > 1}}
    return {
        "calibrated": f"{when} `{command}` ({n} ranks busy on {os.cpu_count()} cores, model {cfg.model.name}, "
        f"micro_batch {cfg.train.micro_batch} x seq_len {cfg.train.seq_len})",
        "matmul_tflops": matmul,
        "collectives": collectives,
        "optimizer_ns_per_param": round(statistics.median(r["optimizer_ns"] for r in ranks), 4),
        "fsdp_unit_host_s": {
            f"tp{tp}": round(
                fsdp_unit_host_s(cfg, tp=tp, host_s=statistics.median(r["fsdp_host_s"][tp] for r in ranks)), 7
            )
            for tp in ranks[0]["fsdp_host_s"]
        },
        "pp_action_host_s": round(pp_action_host_s(cfg, host_s=statistics.median(pp)), 7) if pp else 0.0,
        "host_copy_GBps": round(host_copy_GBps(cfg.calibrate.seconds), 3),
        "fs_write_GBps": round(fs_bw, 3),
        "fs_fsync_s": round(fsync, 6),
    }


def write_profile(cfg: JobConfig, figures: dict, out: Path, *, conf_dir: Path) -> Path:
    """The profile `cfg.cluster` came from (its comments kept), with `figures` set; written to `out`."""
    import yaml

    src = conf_dir / "cluster" / f"{cfg.cluster.name}.yaml"
    base = out if out.exists() else src
    text = base.read_text() if base.exists() else ""
    ours = ("# Measured by python -m jobs.calibrate", "# fs_write_GBps, fs_fsync_s (see")
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#") and not line.startswith(ours))
    data = yaml.safe_load(text) or {} if text else {}
    data = {**data, **copy.deepcopy(figures)}
    if out.parent.resolve() == (conf_dir / "cluster").resolve():
        data["name"] = out.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        header + "# Measured by python -m jobs.calibrate: calibrated, matmul_tflops, collectives, host_copy_GBps,\n"
        "# fs_write_GBps, fs_fsync_s (see `calibrated` for when and how).\n"
        + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    )
    return out
