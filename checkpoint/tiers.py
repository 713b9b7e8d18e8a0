"""One interval per checkpoint tier: which failures each tier is read after, its Young/Daly interval from its own save
cost and those failures' rate, and the expected goodput of the tiers together against the filesystem tier alone.

The multi-level scheme is LLNL's SCR (Moody, Bronevetsky, Mohror, de Supinski, "Design, Modeling, and Evaluation of
a Scalable Multi-level Checkpointing System", SC10): cheap levels saved often cover the common failures, the parallel
filesystem saved rarely covers the rest. A failure is recovered from the cheapest tier that survives it:

    failure class   what is lost                               tier read after it   (when that tier is off)
    process         a rank died or hung; its node answers      memory (RAM)         -> filesystem
    node            a node is dead or quarantined              partner (needs a     -> filesystem (requeue)
                                                               hot spare to run on)
    job             the allocation (several nodes, a switch)   filesystem

SCR searches its Markov model numerically for the best intervals; this module uses the first-order closed form instead:
each tier's interval is Daly's optimum (checkpoint.interval.daly_interval) for its own save cost δ_k and the MTBF of the
failures it covers, M_k = M_job / share_k, and the tiers' expected goodputs multiply (their wastes add, to first order:
each failure class costs its tier's restart and half its interval, each tier's saves cost δ_k / (τ_k + δ_k)). A lower
tier's saves are not counted as recovery points for a higher tier's failures (a fresher filesystem step only helps):
the combination's goodput is a lower bound in that respect. With one tier the formula is Daly's for the job MTBF, the
single-tier figure `jobs.plan` has always printed. The planner (jobs/planner/tiers.py) and the CheckpointManager call
the same functions here, so the interval planned is the interval used.

Partner copies are not saved on their own: every RAM save also sends its partner copy (checkpoint/memory_tier.py). So
the RAM and partner tiers are one cadence (memory_interval_s): Daly's optimum for the save that makes both (RAM save +
partner copy) and the MTBF of every failure read from either (process + node when a spare lets partners be read);
its goodput factor is counted once, in the memory row, with each failure class's restart weighted by its share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from checkpoint.interval import daly_interval, expected_wall_time

__all__ = [
    "MEMORY",
    "PARTNER",
    "FILESYSTEM",
    "TIERS",
    "FAILURE_CLASSES",
    "failure_split",
    "tiers_on",
    "covering_tier",
    "tier_shares",
    "spare_coverage",
    "tier_mtbf_s",
    "tier_interval_s",
    "cadence_share",
    "memory_mtbf_s",
    "memory_interval_s",
    "tier_goodput",
    "TierPlan",
    "plan_tiers",
    "combined_goodput",
]

MEMORY, PARTNER, FILESYSTEM = "memory", "partner", "filesystem"  # one name each: the plan's rows, the ledger's `tier`
TIERS = (MEMORY, PARTNER, FILESYSTEM)  # cheapest first
FAILURE_CLASSES = ("process", "node", "job")


def failure_split(*, process_share: float, node_share: float) -> dict[str, float]:
    """{failure class: its share of all failures}; the job share is what is left. ValueError naming the override."""
    for key, v in (("failure.process_share", process_share), ("failure.node_share", node_share)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{key}({v}) must be in [0, 1]: the share of all failures of that class")
    if process_share + node_share > 1.0 + 1e-9:
        raise ValueError(
            f"failure.process_share({process_share}) + failure.node_share({node_share}) > 1: the rest "
            "is the job share (whole-allocation losses); lower one of them"
        )
    return {"process": process_share, "node": node_share, "job": max(0.0, 1.0 - process_share - node_share)}


def tiers_on(ckpt: object, *, spare_nodes: int, nodes: int) -> tuple[bool, bool]:
    """(RAM tier on, partner copies cover node failures) for a CheckpointConfig: partner copies
    (checkpoint.memory_replicas > 0, a RAM-tier feature) are only read after a node failure when a hot spare
    (launcher.spare_nodes > 0) lets the run go on inside its allocation, where the replaced ranks read them from the
    nodes that hold them (checkpoint/memory_tier.py); without one the run is requeued and reads the filesystem tier.
    memory_replicas null: one copy when the job has more than one node (replicas_for)."""
    memory = bool(getattr(ckpt, "memory_on", False))
    replicas = getattr(ckpt, "memory_replicas", 0)
    replicas = (1 if nodes > 1 else 0) if replicas is None else replicas
    return memory, memory and replicas > 0 and spare_nodes > 0


def covering_tier(failure: str, *, memory: bool, partner: bool) -> str:
    """The cheapest tier that survives `failure` (a class of FAILURE_CLASSES) among those on. A partner copy is
    another node's RAM: it survives a process failure too, but the rank's own RAM copy is cheaper to read."""
    if failure == "process" and memory:
        return MEMORY
    if failure in ("process", "node") and partner:
        return PARTNER
    return FILESYSTEM


def spare_coverage(*, node_share: float, job_share: float, spare_nodes: int | None) -> float:
    """The fraction of node failures a run survives inside its allocation on its `spare_nodes` hot spares (None: as
    many as it needs). Spares are finite per allocation: an allocation ends at a job failure or at the node failure
    that finds no spare left (a requeue brings fresh spares), and process failures use none. With q = node /
    (node + job), the chance that the next of those two is a node failure, an allocation sees k node failures
    before its end with chance q^k (1 - q), so the spares cover sum_{k=1..s} q^k node failures per allocation and
    q^(s+1) more are read from the filesystem: 1 spare covers 1 / (1 + q) of them (0.52 at the default 0.77 / 0.08),
    not all."""
    if spare_nodes is None:
        return 1.0
    if spare_nodes <= 0 or node_share <= 0:
        return 0.0
    q = node_share / (node_share + job_share)
    covered = sum(q**k for k in range(1, spare_nodes + 1))
    return covered / (covered + q ** (spare_nodes + 1))


def tier_shares(
    *, process_share: float, node_share: float, memory: bool, partner: bool, spare_nodes: int | None = None
) -> dict[str, float]:
    """{tier: the share of all failures it is read after}, over TIERS (a tier off, or covering none, has 0). With
    partner copies, the node failures that `spare_nodes` hot spares absorb (`spare_coverage`; None: all) are read
    from the partner tier, the rest from the filesystem (a requeue)."""
    out = dict.fromkeys(TIERS, 0.0)
    split = failure_split(process_share=process_share, node_share=node_share)
    for failure, share in split.items():
        out[covering_tier(failure, memory=memory, partner=partner and memory)] += share
    if out[PARTNER] > 0:
        lost = split["node"] * (
            1.0 - spare_coverage(node_share=node_share, job_share=split["job"], spare_nodes=spare_nodes)
        )
        out[PARTNER] -= lost
        out[FILESYSTEM] += lost
    return out


def tier_mtbf_s(*, mtbf_s: float, share: float) -> float | None:
    """The mean time between the failures a tier covers: the job MTBF / its share; None when it covers none."""
    return mtbf_s / share if share > 0 else None


def tier_interval_s(*, save_s: float, mtbf_s: float | None) -> float | None:
    """The tier's interval (compute seconds between its saves): Daly's optimum for its save cost and the MTBF of the
    failures it covers; None when it covers none (it never needs to save)."""
    if mtbf_s is None:
        return None
    return daly_interval(max(save_s, 1e-9), mtbf_s)


def cadence_share(shares: dict[str, float]) -> float:
    """The share of all failures read from a copy the RAM saves make: the RAM tier's plus the partner tier's (partner
    copies ride on every RAM save, so both tiers save at one interval)."""
    return shares.get(MEMORY, 0.0) + shares.get(PARTNER, 0.0)


def memory_mtbf_s(*, mtbf_s: float, shares: dict[str, float]) -> float | None:
    """The mean time between the failures read from a copy the RAM saves make (the RAM or the partner tier: one
    cadence); None when they cover none."""
    return tier_mtbf_s(mtbf_s=mtbf_s, share=cadence_share(shares))


def memory_interval_s(*, mtbf_s: float, shares: dict[str, float], save_s: float) -> float | None:
    """The RAM saves' interval, partner copies included: Daly's optimum for `save_s` (one RAM save with its partner
    copy, when the tier makes one) and `memory_mtbf_s`; None when they cover none.
    The CheckpointManager (checkpoint/cadence.py) and plan_tiers both call this."""
    return tier_interval_s(save_s=save_s, mtbf_s=memory_mtbf_s(mtbf_s=mtbf_s, shares=shares))


def tier_goodput(*, interval_s: float | None, save_s: float, mtbf_s: float | None, restart_s: float) -> float:
    """The tier's factor of the expected goodput: Daly's T_s / T_w for its saves and the failures it covers; with no
    failure covered only its saves cost (1 when it does not save)."""
    if interval_s is None:
        return 1.0
    if mtbf_s is None:
        return interval_s / (interval_s + save_s)
    return 1.0 / expected_wall_time(1.0, tau=interval_s, delta=max(save_s, 1e-9), mtbf=mtbf_s, restart=restart_s)


@dataclass(frozen=True, slots=True)
class TierPlan:
    tier: str
    failures: tuple[str, ...]  # the failure classes it is read after
    share: float  # their share of all failures
    mtbf_s: float | None  # mean time between them (None: none)
    save_s: float  # what one save costs training (blocking plus what it takes from overlapped steps)
    interval_s: float | None  # compute seconds between its saves (None: it never saves)
    restart_s: float  # failure to training again from this tier
    goodput: float  # its factor of the combined expected goodput
    source: str = ""  # where save_s and restart_s came from
    rides_on: str = ""  # the tier whose saves carry this one's (partner: memory); its interval and goodput are there

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def plan_tiers(
    *,
    mtbf_s: float,
    process_share: float,
    node_share: float,
    costs: dict[str, tuple[float, float]],
    intervals: dict[str, float] | None = None,
    sources: dict[str, str] | None = None,
    spare_nodes: int | None = None,
) -> list[TierPlan]:
    """One TierPlan per tier that is on (`costs`: {tier: (save_s, restart_s)}; the filesystem tier is always on).
    `intervals` fixes a tier's interval (seconds, e.g. every_steps x step time); otherwise it is the tier's optimum.
    `spare_nodes`: the hot spares per allocation (`spare_coverage`; None: as many as the node failures need).
    The partner tier rides on the RAM tier (rides_on): the memory row carries the cadence's interval and goodput."""
    if FILESYSTEM not in costs:
        raise ValueError("the filesystem tier is always on: give its (save_s, restart_s)")
    if PARTNER in costs and MEMORY not in costs:
        raise ValueError("partner copies ride on RAM saves: give the memory tier's (save_s, restart_s) too")
    memory, partner = MEMORY in costs, PARTNER in costs
    shares = tier_shares(
        process_share=process_share, node_share=node_share, memory=memory, partner=partner, spare_nodes=spare_nodes
    )
    split = failure_split(process_share=process_share, node_share=node_share)
    fixed = intervals or {}
    out = []
    for tier in TIERS:
        if tier not in costs:
            continue
        save_s, restart_s = costs[tier]
        m = tier_mtbf_s(mtbf_s=mtbf_s, share=shares[tier])
        if tier == FILESYSTEM:
            tau = fixed.get(tier) or tier_interval_s(save_s=save_s, mtbf_s=m)
            goodput = tier_goodput(interval_s=tau, save_s=save_s, mtbf_s=m, restart_s=restart_s)
        else:
            tau, goodput = _memory_cadence(mtbf_s=mtbf_s, shares=shares, costs=costs, interval_s=fixed.get(MEMORY))
            goodput = 1.0 if tier == PARTNER else goodput  # counted once, in the memory row
        out.append(
            TierPlan(
                tier=tier,
                failures=_tier_failures(tier, split=split, shares=shares, memory=memory, partner=partner),
                share=shares[tier],
                mtbf_s=m,
                save_s=save_s,
                interval_s=tau,
                restart_s=restart_s,
                goodput=goodput,
                source=(sources or {}).get(tier, ""),
                rides_on=MEMORY if tier == PARTNER else "",
            )
        )
    return out


def _tier_failures(
    tier: str, *, split: dict[str, float], shares: dict[str, float], memory: bool, partner: bool
) -> tuple[str, ...]:
    """The failure classes `tier` is read after: those it covers (covering_tier), and for the filesystem tier the node
    failures the partner tier leaves over (more than the spares cover)."""
    return tuple(
        f
        for f in FAILURE_CLASSES
        if split[f] > 0
        and (
            covering_tier(f, memory=memory, partner=partner) == tier
            or (f, tier) == ("node", FILESYSTEM)
            and partner
            and shares[PARTNER] < split["node"] - 1e-12
        )
    )


def _memory_cadence(
    *, mtbf_s: float, shares: dict[str, float], costs: dict[str, tuple[float, float]], interval_s: float | None
) -> tuple[float | None, float]:
    """(interval, goodput factor) of the RAM saves and the partner copies they carry: one save (both costs), the
    failures read from either (their MTBF), each class's restart weighted by its share (no failure counted twice)."""
    tiers = [t for t in (MEMORY, PARTNER) if t in costs]
    save_s = sum(costs[t][0] for t in tiers)
    share = cadence_share(shares)
    tau = interval_s or memory_interval_s(mtbf_s=mtbf_s, shares=shares, save_s=save_s)
    if share <= 0:
        return tau, tier_goodput(interval_s=tau, save_s=save_s, mtbf_s=None, restart_s=0.0)
    restart_s = sum(shares[t] * costs[t][1] for t in tiers) / share
    return tau, tier_goodput(
        interval_s=tau, save_s=save_s, mtbf_s=memory_mtbf_s(mtbf_s=mtbf_s, shares=shares), restart_s=restart_s
    )


def combined_goodput(plans: list[TierPlan]) -> float:
    """The expected goodput of the tiers together: the product of their factors (see the module docstring)."""
    return math.prod(p.goodput for p in plans)
