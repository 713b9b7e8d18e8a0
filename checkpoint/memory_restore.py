"""Where a restart reads each rank's RAM copy (the RAM tier's load side, a part of MemoryTier's): every node's
committed copies listed once, a plan shared by all ranks (checkpoint/partner.py: the newest step every rank can get
from one save, each rank's copy read in place on its own node or sent by a rank of the node that holds it), each
copy checked where it is held, and the copies on other nodes sent point to point (see checkpoint/memory_tier.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from checkpoint.errors import describe_error
from checkpoint.group import Group
from checkpoint.manifest import ManifestError, check_files, read_manifest, step_dirs
from checkpoint.partner import (
    MemoryLoad,
    Placement,
    folder_rank,
    plan_memory_load,
    plan_step,
    transfers,
)
from checkpoint.stream import SendError, stream_folder
from checkpoint.tiers import MEMORY, PARTNER

__all__ = ["MemoryRestore", "complete_steps", "local_steps"]

log = logging.getLogger("meshjob.checkpoint")


def local_steps(
    rank_dir: Path,
    *,
    run_id: str,
    rank: int,
    world_size: int,
    mesh: Any,
    config_hash: Any = None,
    rollbacks: int = 0,
) -> dict[int, str]:
    """{step: the attempt that saved it} of every committed step under `rank_dir` whose manifest reads and
    belongs to this run, rank, world size, mesh and config hash, and knows at least `rollbacks` rollbacks (a
    step saved before a rollback belongs to the abandoned timeline); files are not read here."""
    out: dict[int, str] = {}
    for step, d in step_dirs(rank_dir):
        try:
            m = read_manifest(d, step=step)
        except (ManifestError, OSError):
            continue
        ids = (m.get("run_id"), m.get("rank"), m.get("world_size"), m.get("mesh"), m.get("config_hash"))
        if ids == (run_id, rank, world_size, mesh, config_hash) and int(m.get("rollbacks", 0)) >= rollbacks:
            out[step] = str(m.get("attempt", ""))
    return out


def complete_steps(per_rank: list[dict[int, str]]) -> list[int]:
    """The steps every rank holds from one and the same save (the same saving attempt), newest first: a step
    one rank lacks, or holds from another attempt, is never one to load (never a mix of steps or of saves)."""
    if not per_rank:
        return []
    common = set(per_rank[0]).intersection(*per_rank[1:])
    return sorted((s for s in common if len({r[s] for r in per_rank}) == 1), reverse=True)


class MemoryRestore:
    """Finds and fetches the RAM copies a restart loads, for one rank placed at `at`; a copy belongs to this run
    (`run_id`), the world size and `manifest_extra`'s mesh and config hash. `ctl`: the group the ranks agree on;
    `mem`: the tier's group the copies are sent on; `attempt`: names the temporary folders. Holds the plan of the
    last listing and the ranks whose partner copies the last validated step reads."""

    def __init__(
        self,
        cfg: Any,
        at: Placement,
        *,
        run_id: str,
        world_size: int,
        manifest_extra: dict[str, Any],
        attempt: str,
        ctl: Group,
        mem: Group,
    ) -> None:
        self.cfg, self._at, self._run_id, self._world_size = cfg, at, run_id, world_size
        self._mesh, self._config_hash = manifest_extra.get("mesh"), manifest_extra.get("config_hash")
        self._attempt, self._ctl, self._mem = attempt, ctl, mem
        self._plan: dict[int, MemoryLoad] = {}
        self._held: dict[str, dict[str, dict[int, str]]] = {}  # every node's committed copies, as listed at load
        self.partner_used: list[int] = []  # the ranks that read a partner copy in the step validated last

    def candidates(self, *, rollbacks: int) -> list[int]:
        """The steps complete in the RAM tier (every rank can get a copy of its state from the same save, held on
        any node of the job) whose manifests know `rollbacks` rollbacks, newest first; agreed. Remembers where each
        rank reads."""
        self._plan = {}
        if not self.cfg.memory_on or not self.cfg.memory_load:
            return []
        at = self._at
        gathered = self._ctl.all_gather((at.node, self._list_node(rollbacks) if at.speaker else None))
        self._held = {n: listing for n, listing in gathered if listing is not None}
        plan = plan_memory_load(at.nodes, self._held)
        self._plan = {p.step: p for p in plan}
        return [p.step for p in plan]

    def _list_node(self, rollbacks: int) -> dict[str, dict[int, str]]:
        """{folder: {step: saving attempt}} of the committed copies in this node's folder (own saves and partner
        copies of any rank) whose manifest names this run, the folder's rank, the world size and the mesh."""
        ids = {
            "run_id": self._run_id,
            "world_size": self._world_size,
            "mesh": self._mesh,
            "config_hash": self._config_hash,
            "rollbacks": rollbacks,
        }
        root = self._at.root
        out: dict[str, dict[int, str]] = {}
        try:
            for d in sorted(root.iterdir()) if root.is_dir() else []:
                q = folder_rank(d.name)
                if q is not None and q < self._world_size:
                    out[d.name] = local_steps(d, rank=q, **ids)
        except OSError as e:
            log.warning("RAM tier %s unreadable on rank %d: %s", root, self._at.rank, e)
        return out

    def validate(self, step: int) -> tuple[Path, list[str], dict[str, Any] | None, str]:
        """This rank's folder of `step`, the problems found (agreed), its manifest, and the tier: every copy to be
        read checked where it is held, then those held on another node sent to their readers (PARTNER when any
        rank reads anything but its own save on its own node)."""
        at = self._at
        plan, problems, manifest = self._check_sources(step)
        self.partner_used = []
        if plan is None:
            return at.rank_dir / f"step_{step}", problems, None, MEMORY
        if problems and at.rank == 0:
            log.warning("RAM step %d: damaged copies left out, read elsewhere: %s", step, "; ".join(problems[:5]))
        node, folder = plan.sources[at.rank]
        d = at.root / folder / f"step_{step}" if node == at.node else at.rank_dir / f"step_{step}"
        copied = plan.copied(at.nodes)
        tier = PARTNER if copied else MEMORY
        problems, got = self._fetch_copies(step, plan)
        if problems:
            return d, problems, None, tier
        self.partner_used = copied
        return d, [], got or manifest, tier

    def _check_sources(self, step: int) -> tuple[MemoryLoad | None, list[str], dict[str, Any] | None]:
        """The plan of `step` whose copies all check out where they are held (by their reader on its own node, else
        by the rank that sends it), planned again without each copy that does not; the problems of those (agreed);
        and the manifest of the copy this rank reads in place (None when it is sent one)."""
        at = self._at
        plan: MemoryLoad | None = self._plan[step]
        bad: set[tuple[str, str]] = set()
        checked: set[tuple[str, str]] = set()
        problems: list[str] = []
        manifests: dict[tuple[str, str], dict[str, Any] | None] = {}
        while plan is not None:
            senders = {r: s for _, s, r in transfers(at.nodes, plan.sources)}
            mine = []
            for q, src in enumerate(plan.sources):
                if senders.get(q, q) == at.rank and src not in checked:
                    ps, manifests[src] = _check_copy(
                        at.root / src[1] / f"step_{step}", step, rank=q, checksum=self.cfg.verify == "checksum"
                    )
                    mine.append((src, [f"{src[0]}/{src[1]}: {p}" for p in ps]))
            found = [x for g in self._ctl.all_gather(mine) for x in g]
            checked |= {src for src, _ in found}
            new_bad = {src for src, ps in found if ps}
            problems += sorted(p for _, ps in found for p in ps)
            if not new_bad:
                break
            bad |= new_bad
            plan = plan_step(at.nodes, self._held, step, exclude=frozenset(bad))
        if plan is None:
            return None, problems, None
        here = plan.sources[at.rank]
        return plan, problems, manifests.get(here) if here[0] == at.node else None

    def _fetch_copies(self, step: int, plan: MemoryLoad) -> tuple[list[str], dict[str, Any] | None]:
        """Every rank whose copy of `step` is on another node gets it (`partner.transfers`: round by round, point to
        point on the tier's group) and commits it into its own folder as the RAM tier commits; returns the problems
        (agreed) and the manifest received here."""
        at = self._at
        moves = transfers(at.nodes, plan.sources)
        if not moves:
            return [], None
        mine: list[str] = []
        manifest = None
        for t in range(max(k for k, _, _ in moves) + 1):
            send_to = next((r for k, s, r in moves if k == t and s == at.rank), None)
            recv_from = next((s for k, s, r in moves if k == t and r == at.rank), None)
            src = at.root / plan.sources[send_to][1] / f"step_{step}" if send_to is not None else None
            try:  # file by file in chunks (checkpoint/stream.py), as the RAM saves send theirs
                got = stream_folder(
                    src,
                    send_to=send_to,
                    recv_from=recv_from,
                    tmp=at.rank_dir / f"step_{step}.{self._attempt}.tmp",
                    final=at.rank_dir / f"step_{step}",
                    step=step,
                    pg=self._mem.pg,
                )
                if recv_from is not None and got is None:
                    raise ValueError(f"rank {recv_from} sent no copy")
                manifest = got or manifest
            except SendError as e:
                mine.append(f"rank {at.rank}: the copy for rank {send_to}: {describe_error(e, at.root)}")
            except Exception as e:  # noqa: BLE001 - agreed on below
                mine.append(f"rank {at.rank}: the copy from rank {recv_from}: {describe_error(e, at.root)}")
        return sorted({p for ps in self._ctl.all_gather(mine) for p in ps}), manifest


def _check_copy(d: Path, step: int, *, rank: int, checksum: bool) -> tuple[list[str], dict[str, Any] | None]:
    """The problems of one committed copy (`d`, of rank `rank`'s state) against its manifest, and the manifest."""
    try:
        manifest = read_manifest(d, step=step)
        if manifest.get("rank") != rank:
            return [f"{d.name} holds rank {manifest.get('rank')}'s state, not rank {rank}'s"], None
        problems = check_files(d, manifest["files"], sorted(manifest["files"]), checksum=checksum)
    except ManifestError as e:
        return [f"rank {rank}: {e}"], None
    except Exception as e:  # noqa: BLE001 - agreed on by the caller like any problem
        return [f"rank {rank}: {describe_error(e, d)}"], None
    return [f"rank {rank}: {p}" for p in problems], (manifest if not problems else None)
