"""The save's commit: every rank's shard records gathered, rank 0 writes the manifest and renames
step_<N>.tmp to step_<N>, the outcome agreed on every rank (CheckpointManager's commit half)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointSaveError, describe_error
from checkpoint.manifest import file_record, fsync_dir, write_manifest
from checkpoint.retention import retain
from checkpoint.writer import RecordingWriter

log = logging.getLogger("meshjob.checkpoint")


class CommitMixin:
    """CheckpointManager's methods that prepare, commit and retire checkpoints (`self.folder`, `self.cfg`,
    `self.rank`, `self._io_pg`, `self._emit`, `self._all_gather`, `self._bcast`, `self._retain_pool`)."""

    def _prepare(self, tmp: Path) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
            self._emit("checkpoint_tmp_removed", path=str(tmp), reason="leftover of an interrupted save of this step")
        tmp.mkdir()
        n = self.cfg.lustre_stripe_count
        if n > 0:
            if shutil.which("lfs"):
                subprocess.run(["lfs", "setstripe", "-c", str(n), str(tmp)], check=True, capture_output=True)
            else:
                log.warning("checkpoint.lustre_stripe_count=%d but `lfs` is not on PATH; striping left alone", n)

    def _commit(
        self,
        step: int,
        tmp: Path,
        final: Path,
        fut: Future | None,
        err: BaseException | None,
        t0: float,
        blocking_s: float | None,
        writer: RecordingWriter,
    ) -> None:
        local_err, files = None, {}
        try:
            if err is not None:
                raise err
            if fut is not None:
                fut.result()
            files = _own_records(writer.records, self.rank, tmp)
        except BaseException as e:  # noqa: BLE001 - agreed on below, raised on every rank
            local_err = describe_error(e, self.folder)
        gathered = self._all_gather((local_err, files, blocking_s), self._io_pg)
        result: dict[str, Any] | None = None
        if self.rank == 0:
            result = self._commit_rank0(step, tmp, final, gathered)
            if result["ok"]:  # on disk: recorded before the outcome goes out, which fails if a peer died meanwhile
                total_s, blocking = time.perf_counter() - t0, [g[2] for g in gathered if g[2] is not None]
                self._emit(
                    "checkpoint_saved",
                    step=step,
                    tier="filesystem",
                    path=str(final),
                    bytes=result["bytes"],
                    files=result["files"],
                    blocking_s=round(max(blocking) if blocking else total_s, 4),
                    total_s=round(total_s, 4),
                    async_mode=self.cfg.async_mode,
                )
        result = self._bcast(result, self._io_pg)
        if not result["ok"]:
            total_s = time.perf_counter() - t0
            self._emit("checkpoint_failed", step=step, error=result["error"], total_s=round(total_s, 4))
            raise CheckpointSaveError(f"checkpoint step_{step} was not committed: {result['error']}")
        if self.rank == 0:  # deleting old checkpoints is no part of this one's commit: in a thread of its own
            self._retaining = self._retain_pool.submit(self._retain_logged, step)

    def _commit_rank0(self, step: int, tmp: Path, final: Path, gathered: list[Any]) -> dict[str, Any]:
        errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(gathered) if e]
        renamed = False
        if not errors:
            try:
                files: dict[str, Any] = {}
                for _, f, _ in gathered:
                    files.update(f)
                for p in sorted(tmp.iterdir()):
                    if p.name not in files:
                        files[p.name] = file_record(p)
                if ".metadata" not in files:
                    raise RuntimeError(f"DCP wrote no .metadata in {tmp}")
                nbytes = sum(f["size"] for f in files.values())
                write_manifest(
                    tmp,
                    {
                        "step": step,
                        "time": time.time(),
                        "world_size": self.world_size,
                        "files": files,
                        "bytes": nbytes,
                        "env": self.fingerprint,
                        "data_cursor": {"step": step},
                        "rng_keys": [f"rng.rank{r}" for r in range(self.world_size)],
                        "interval": self.cadence.manifest_entry(),
                        "async_mode": self.cfg.async_mode,
                        **self.manifest_extra,
                    },
                )  # fsyncs the manifest and the folder
                if final.exists():
                    aside = final.with_name(f"{final.name}.uncommitted-{self.attempt}")
                    if aside.exists():
                        aside = aside.with_name(f"{aside.name}.{time.time_ns()}")
                    os.rename(final, aside)
                    self._emit(
                        "checkpoint_moved_aside",
                        step=step,
                        path=str(aside),
                        reason="a folder of this step was in the way (uncommitted, or left by a rolled-back timeline)",
                    )
                os.rename(tmp, final)  # the commit
                renamed = True
                fsync_dir(self.folder)
                return {"ok": True, "bytes": nbytes, "files": len(files)}
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank 0 commit: {describe_error(e, self.folder)}")
        for p in (tmp, final if renamed else None):
            if p is not None and p.exists():
                shutil.rmtree(p, ignore_errors=True)
                self._emit("checkpoint_tmp_removed", path=str(p), reason="uncommitted save failed")
        return {"ok": False, "error": "; ".join(errors)[:2000]}

    def _retain_logged(self, newest: int) -> None:
        try:
            self._retain(newest)
        except Exception as e:  # noqa: BLE001 - retention failing costs disk space, not the run
            log.warning("retention under %s failed: %s", self.folder, describe_error(e, self.folder))

    def _retain(self, newest: int) -> None:
        retain(self.folder, keep=self.cfg.keep, emit=self._emit, newest=newest, damaged=self._damaged)


def _own_records(records: dict[str, dict[str, Any]], rank: int, tmp: Path) -> dict[str, dict[str, Any]]:
    """This rank's shard files with their size and crc32, from the writer's records; read back from disk
    only where the writer ran elsewhere (async_mode=process) and left none here."""
    mine = {n: r for n, r in records.items() if n.startswith(f"__{rank}_") or n == ".metadata"}
    if mine:
        return mine
    return {p.name: file_record(p) for p in sorted(tmp.glob(f"__{rank}_*"))}
