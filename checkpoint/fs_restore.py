"""The filesystem tier's load side (a part of CheckpointManager's, checkpoint/manager.py): the committed steps listed
once (rank 0's listing for all), each candidate's manifest and shards checked on every rank (sizes, or crc32 of the
bytes read back), the environment compared with the one that saved it, the load into the bound objects, and after a
rollback the later steps moved aside. Every check is agreed: one rank's problem is every rank's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint.commit import Committer
from checkpoint.errors import describe_error
from checkpoint.fingerprint import diff_fingerprint
from checkpoint.group import Group
from checkpoint.manifest import ManifestError, check_files, read_manifest, verify_share
from checkpoint.statedict import BoundState

__all__ = ["FsRestore"]

log = logging.getLogger("meshjob.checkpoint")


class FsRestore:
    """Finds, checks and loads the filesystem tier's checkpoints under `folder` for one rank of `world_size`.
    `ctl`: the group the ranks agree on; `state`: the objects a load fills; `committer`: the tier's folder
    housekeeping (the listing, which removes earlier attempts' leftovers; the damaged steps retention passes over;
    moving an abandoned timeline aside); `env`: this run's environment fingerprint; `mesh`: this run's mesh (a
    checkpoint saved on another is resharded); `emit(kind, **fields)`: the ledger (rank 0's)."""

    def __init__(
        self,
        folder: Path,
        *,
        cfg: Any,
        rank: int,
        world_size: int,
        ctl: Group,
        state: BoundState,
        committer: Committer,
        env: dict[str, Any],
        mesh: Any,
        emit: Callable[..., None],
    ) -> None:
        self.folder, self.cfg, self.rank, self.world_size = folder, cfg, rank, world_size
        self._ctl, self._state, self._committer = ctl, state, committer
        self._env, self._mesh, self._emit = env, mesh, emit

    def candidates(self) -> list[int]:
        """The committed steps, newest first, as rank 0 lists them (agreed); raises on every rank if that failed."""
        listing = self._ctl.bcast(self._committer.list_steps() if self.rank == 0 else None)
        if isinstance(listing, str):
            raise RuntimeError(f"{listing}; make the folder readable (or fix run.dir) and restart")
        return listing

    def validate(self, step: int) -> tuple[Path, list[str], dict[str, Any] | None]:
        """Checkpoint `step`'s folder, the problems found on any rank (agreed: its manifest, and this rank's share of
        its files against it), and its manifest when there are none. A valid one is then compared with this run's
        environment (checkpoint.on_env_drift: refuse raises on every rank)."""
        d = self.folder / f"step_{step}"
        manifest = None
        try:
            manifest = read_manifest(d, step=step)
            mine = verify_share(list(manifest["files"]), rank=self.rank, world_size=self.world_size)
            problems = check_files(d, manifest["files"], mine, checksum=self.cfg.verify == "checksum")
        except ManifestError as e:
            problems = [str(e)]
        except Exception as e:  # noqa: BLE001 - e.g. EIO on this rank only: agreed on below like any problem
            problems = [f"rank {self.rank}: {describe_error(e, self.folder)}"]
        problems = sorted({p for ps in self._ctl.all_gather(problems) for p in ps})
        if problems:
            return d, problems, None
        self._check_drift(step, manifest)
        return d, [], manifest

    def _check_drift(self, step: int, manifest: dict[str, Any]) -> None:
        diff = diff_fingerprint(manifest.get("env", {}), self._env)
        diffs = self._ctl.all_gather(diff)
        merged = {k: v for d in diffs for k, v in d.items()}
        if not merged:
            return
        policy = self.cfg.on_env_drift
        self._emit(
            "checkpoint_env_drift", step=step, policy=policy, diff=merged, ranks=[r for r, d in enumerate(diffs) if d]
        )
        summary = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(merged.items())[:8])
        if policy == "refuse":
            raise RuntimeError(
                f"environment differs from checkpoint step_{step}'s ({summary}); restore the environment "
                "or set checkpoint.on_env_drift=warn (or allow) to resume anyway"
            )
        if policy == "warn" and self.rank == 0:
            log.warning("environment differs from checkpoint step_%d's: %s", step, summary)

    def load(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Reads checkpoint folder `d` into the bound objects, resharded when it was saved on another world size or
        mesh; no collective (the caller agrees on the outcome)."""
        same_mesh = manifest["world_size"] == self.world_size and manifest.get("mesh") == self._mesh
        return self._state.load(d, resharded=not same_mesh)

    def mark_damaged(self, step: int, d: Path) -> None:
        """A checkpoint the load skipped: retention never counts it among those it keeps (rank 0's retention)."""
        if self.rank == 0:
            self._committer.mark_damaged(step, d)

    def abandon_above(self, step: int) -> None:
        """Rank 0 moves the checkpoints of a step > `step` aside, once every rank has finished reading (the
        load's last all_gather); every rank waits for the outcome, so no save of the new timeline starts before."""
        err = self._ctl.bcast(self._committer.abandon_above(step) if self.rank == 0 else None)
        if err is not None:
            raise RuntimeError(
                f"rolled back to step {step} but moving the later checkpoints aside failed on rank 0 "
                f"({err}); move {self.folder}/step_N (N > {step}) aside by hand and restart"
            )
