"""The zero-GPU planner: memory per rank, communication, predicted step time, bubble, checkpoint interval and goodput, before submit.

`arith` holds the pure arithmetic (numbers and `ModelConfig` in, numbers out; in `params`, `memory` and
`comm`, re-exported by `arith`); `hardware` the
figures the step time uses and where they came from (calibrated or cited); `steptime` the predicted
step; `costs` the save and restart costs (the run's ledger, else the profile); `calibrate` measures a
machine (`python -m jobs.calibrate`) with `calibrate_ranks`, `probes`, `collectives`, `storage`, `timing`
and `fits`; `gate` runs the real `parallelize()` on a fake process group and
turns the figures into readiness checks; `search` ranks every feasible mesh (`plan.search=true`).
"""

__all__ = [
    "arith",
    "calibrate",
    "calibrate_ranks",
    "collectives",
    "comm",
    "costs",
    "fits",
    "gate",
    "hardware",
    "memory",
    "params",
    "probes",
    "search",
    "steptime",
    "storage",
    "timing",
]
