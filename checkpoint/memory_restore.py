"""Where a restart reads each rank's RAM copy (CheckpointManager's memory half, the load's side): every node's
committed copies listed once, a plan shared by all ranks (checkpoint/partner.py: the newest step every rank can get
from one save, each rank's copy read in place on its own node or sent by a rank of the node that holds it), each
copy checked where it is held, and the copies on other nodes sent point to point (see checkpoint/memory_tier.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from checkpoint.errors import describe_error
from checkpoint.manifest import ManifestError, check_files, read_manifest
from checkpoint.memory_tier import local_steps
from checkpoint.partner import (
    MemoryLoad,
    folder_rank,
    plan_memory_load,
    plan_step,
    transfers,
)
from checkpoint.stream import SendError, stream_folder
from checkpoint.tiers import MEMORY, PARTNER

__all__ = ["MemoryRestoreMixin"]

log = logging.getLogger("meshjob.checkpoint")


class MemoryRestoreMixin:
    """CheckpointManager's methods that find and fetch the RAM copies a restart loads (`self.cfg`, `self.memory_root`,
    `self.node`, `self._nodes`, `self._speaker`, `self._rank_dir`, `self._mem_pg`, `self._ctl_pg`, `self._all_gather`,
    and the RAM tier's identity: `self.run_id`, `self.rank`, `self.world_size`, `self.manifest_extra`,
    `self.attempt`)."""

    def _memory_candidates(self) -> list[int]:
        """The steps complete in the RAM tier (every rank can get a copy of its state from the same save, held on
        any node of the job), newest first; agreed. Remembers where each rank reads (`self._memory_plan`)."""
        self._memory_plan = {}
        if not self.cfg.memory_on or not self.cfg.memory_load:
            return []
        gathered = self._all_gather((self.node, self._list_node() if self._speaker else None), self._ctl_pg)
        self._held = {n: listing for n, listing in gathered if listing is not None}
        plan = plan_memory_load(self._nodes, self._held)
        self._memory_plan = {p.step: p for p in plan}
        return [p.step for p in plan]

    def _list_node(self) -> dict[str, dict[int, str]]:
        """{folder: {step: saving attempt}} of the committed copies in this node's folder (own saves and partner
        copies of any rank) whose manifest names this run, the folder's rank, the world size and the mesh."""
        ids = {
            "run_id": self.run_id,
            "world_size": self.world_size,
            "mesh": self.manifest_extra.get("mesh"),
            "config_hash": self.manifest_extra.get("config_hash"),
            "rollbacks": self._known_rollbacks,
        }
        out: dict[str, dict[int, str]] = {}
        try:
            for d in sorted(self.memory_root.iterdir()) if self.memory_root.is_dir() else []:
                q = folder_rank(d.name)
                if q is not None and q < self.world_size:
                    out[d.name] = local_steps(d, rank=q, **ids)
        except OSError as e:
            log.warning("RAM tier %s unreadable on rank %d: %s", self.memory_root, self.rank, e)
        return out

    def _validate_memory(self, step: int) -> tuple[Path, list[str], dict[str, Any] | None, str]:
        """This rank's folder of `step`, the problems found (agreed), its manifest, and the tier: every copy to be
        read checked where it is held, then those held on another node sent to their readers (PARTNER when any
        rank reads anything but its own save on its own node)."""
        plan, problems, manifest = self._check_sources(step)
        self._partner_used = []
        if plan is None:
            return self._rank_dir / f"step_{step}", problems, None, MEMORY
        if problems and self.rank == 0:
            log.warning("RAM step %d: damaged copies left out, read elsewhere: %s", step, "; ".join(problems[:5]))
        node, folder = plan.sources[self.rank]
        d = self.memory_root / folder / f"step_{step}" if node == self.node else self._rank_dir / f"step_{step}"
        copied = plan.copied(self._nodes)
        tier = PARTNER if copied else MEMORY
        problems, got = self._fetch_copies(step, plan)
        if problems:
            return d, problems, None, tier
        self._partner_used = copied
        return d, [], got or manifest, tier

    def _check_sources(self, step: int) -> tuple[MemoryLoad | None, list[str], dict[str, Any] | None]:
        """The plan of `step` whose copies all check out where they are held (by their reader on its own node, else
        by the rank that sends it), planned again without each copy that does not; the problems of those (agreed);
        and the manifest of the copy this rank reads in place (None when it is sent one)."""
        plan: MemoryLoad | None = self._memory_plan[step]
        bad: set[tuple[str, str]] = set()
        checked: set[tuple[str, str]] = set()
        problems: list[str] = []
        manifests: dict[tuple[str, str], dict[str, Any] | None] = {}
        while plan is not None:
            senders = {r: s for _, s, r in transfers(self._nodes, plan.sources)}
            mine = []
            for q, src in enumerate(plan.sources):
                if senders.get(q, q) == self.rank and src not in checked:
                    ps, manifests[src] = _check_copy(
                        self.memory_root / src[1] / f"step_{step}", step, rank=q, checksum=self.cfg.verify == "checksum"
                    )
                    mine.append((src, [f"{src[0]}/{src[1]}: {p}" for p in ps]))
            found = [x for g in self._all_gather(mine, self._ctl_pg) for x in g]
            checked |= {src for src, _ in found}
            new_bad = {src for src, ps in found if ps}
            problems += sorted(p for _, ps in found for p in ps)
            if not new_bad:
                break
            bad |= new_bad
            plan = plan_step(self._nodes, self._held, step, exclude=frozenset(bad))
        if plan is None:
            return None, problems, None
        here = plan.sources[self.rank]
        return plan, problems, manifests.get(here) if here[0] == self.node else None

    def _fetch_copies(self, step: int, plan: MemoryLoad) -> tuple[list[str], dict[str, Any] | None]:
        """Every rank whose copy of `step` is on another node gets it (`partner.transfers`: round by round, point to
        point on the tier's group) and commits it into its own folder as the RAM tier commits; returns the problems
        (agreed) and the manifest received here."""
        moves = transfers(self._nodes, plan.sources)
        if not moves:
            return [], None
        mine: list[str] = []
        manifest = None
        for t in range(max(k for k, _, _ in moves) + 1):
            send_to = next((r for k, s, r in moves if k == t and s == self.rank), None)
            recv_from = next((s for k, s, r in moves if k == t and r == self.rank), None)
            src = self.memory_root / plan.sources[send_to][1] / f"step_{step}" if send_to is not None else None
            try:  # file by file in chunks (checkpoint/stream.py), as the RAM saves send theirs
                got = stream_folder(
                    src,
                    send_to=send_to,
                    recv_from=recv_from,
                    tmp=self._rank_dir / f"step_{step}.{self.attempt}.tmp",
                    final=self._rank_dir / f"step_{step}",
                    step=step,
                    pg=self._mem_pg,
                )
                if recv_from is not None and got is None:
                    raise ValueError(f"rank {recv_from} sent no copy")
                manifest = got or manifest
            except SendError as e:
                mine.append(f"rank {self.rank}: the copy for rank {send_to}: {describe_error(e, self.memory_root)}")
            except Exception as e:  # noqa: BLE001 - agreed on below
                mine.append(f"rank {self.rank}: the copy from rank {recv_from}: {describe_error(e, self.memory_root)}")
        return sorted({p for ps in self._all_gather(mine, self._ctl_pg) for p in ps}), manifest


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
