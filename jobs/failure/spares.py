"""Hot spares: which nodes of the allocation run the ranks, which wait idle, and which spare replaces a failed node.

A job with `launcher.spare_nodes=N` holds `launcher.nodes + N` nodes (sbatch `--no-kill`: a failed node does
not end the allocation). Every attempt's srun step runs on the first `launcher.nodes` nodes of the allocation,
in Slurm's order, that are not on the run's quarantine list (`place`); the rest wait. When a failure names
nodes that must go (a node that does not answer, an unhealthy GPU, silent data corruption) and enough spares
are left, the decider quarantines them and restarts inside the allocation: the next placement leaves them out
and takes the first spares in their place (`swap` names the pairs for the ledger's `spare_swap` record).
The supervisor records each attempt's placement in its `attempt_start` (`step_nodes`, `spares`), which is
where the decider, a rank, reads the spares from (`spares_of`).
"""

from __future__ import annotations

__all__ = ["place", "swap", "spares_of"]


def place(allocation: list[str], *, excluded: set[str] | list[str], nodes: int) -> tuple[list[str], list[str]]:
    """(the nodes the ranks run on, the spares): the allocation's nodes not `excluded`, in its order, the first
    `nodes` of them for the ranks; fewer than `nodes` when too few are left (the caller requeues)."""
    excluded = set(excluded)
    healthy = [n for n in dict.fromkeys(allocation) if n not in excluded]
    return healthy[:nodes], healthy[nodes:]


def swap(failed: list[str], spares: list[str] | None) -> dict[str, str] | None:
    """failed node -> the spare that takes its place, spares taken in order (as `place` takes them once the
    failed nodes are excluded); None when there are not spares enough for all of them (or none at all)."""
    failed = list(dict.fromkeys(failed))
    if spares is None or len(failed) > len(spares):
        return None
    return dict(zip(failed, spares))


def spares_of(events: list[dict], attempt: str) -> list[str] | None:
    """The idle spares that the supervisor recorded for `attempt` in its `attempt_start`; None when it recorded
    none (launcher.spare_nodes=0, torchrun's agents, the local launcher)."""
    for e in reversed(events):
        if e.get("kind") == "attempt_start" and e.get("attempt") == attempt and "spares" in e:
            return list(e["spares"] or [])
    return None
