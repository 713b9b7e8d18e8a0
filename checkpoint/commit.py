"""The filesystem tier's write, commit and retention: the state written with DCP (blocking, or handed to DCP's async
save), every rank's shard records gathered, rank 0 writes the manifest and renames step_<N>.tmp to step_<N>, the
outcome agreed on every rank; then older checkpoints retired in a thread of their own (a part of
CheckpointManager's, checkpoint/manager.py).

Layout under `folder` (RUN_DIR/checkpoints):
    step_<N>.tmp/     a save in progress (DCP shards `__<rank>_<i>.distcp` + `.metadata`, then `manifest.json`)
    step_<N>/         committed by one atomic rename of the whole folder, manifest included
The commit, per save: every rank's shards written and fsync'ed once, their sizes and crc32 taken from the
bytes as they were written -> gathered on rank 0 -> manifest written and fsync'ed in the temporary folder
-> fsync of it -> rename to step_<N> -> fsync of the parent. Checkpoints of the older layout (manifest
written after the rename) load the same way; a step_<N> without a valid manifest never loads.

Async modes take the state off the blocking path: `save` hands the copy into the CPU staging buffers to
a thread and returns; the copy overlaps the next forward and backward and is waited for in a step
pre-hook on every bound optimizer, the first place those tensors change. Retention runs in a thread of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpoint.errors import CheckpointSaveError, describe_error
from checkpoint.group import Group
from checkpoint.manifest import file_record, fsync_dir, step_dirs, write_manifest
from checkpoint.retention import abandon_above, manifest_crc, retain
from checkpoint.writer import RecordingWriter

__all__ = ["Committer"]

log = logging.getLogger("meshjob.checkpoint")


class Committer:
    """Commits the filesystem tier's saves under `folder` and retires the old ones; holds the save in flight and the
    retention pass. `io`: the group the commit agrees on (possibly from its own thread); `emit(kind, **fields)`: the
    ledger (rank 0's); `attempt`: names the folders moved aside; `env`, `manifest_extra` and `interval()` (the
    interval's entry at commit time): what each manifest records besides its files; `stager`: the async saves'
    staging buffers (None: checkpoint.async_mode=none); `timeout_s`: the bound of DCP's background group's
    collectives (async_mode=process)."""

    def __init__(
        self,
        folder: Path,
        *,
        cfg: Any,
        rank: int,
        world_size: int,
        io: Group,
        emit: Callable[..., None],
        attempt: str,
        env: dict[str, Any],
        manifest_extra: dict[str, Any],
        interval: Callable[[], dict[str, Any]],
        stager: Any | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.folder, self.cfg, self.rank, self.world_size = folder, cfg, rank, world_size
        self._stager, self._timeout_s = stager, timeout_s
        self._io, self._emit, self._attempt = io, emit, attempt
        self._env, self._manifest_extra, self._interval = env, manifest_extra, interval
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        self._retain_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retain")
        self._pending: Future | None = None
        self._retaining: Future | None = None
        self._damaged: set[tuple[int, str]] = set()  # (step, manifest crc32) the load skipped: retention counts none

    def save(self, step: int, sd: dict[str, Any], *, tmp: Path, t0: float, written: Callable[[], None]) -> float:
        """Writes the state dict `sd` of save `step` into `tmp` with DCP and commits it to step_<N>: blocking, the
        commit included (checkpoint.async_mode=none), else handed to DCP's async save and committed in the commit's
        thread; `written()` once the write is over or handed over, before the commit. Returns the seconds it blocked
        since `t0` (perf_counter when the save was asked for); call `wait` first."""
        final = self.folder / f"step_{step}"
        writer = RecordingWriter(
            tmp,
            thread_count=self.cfg.writer_threads,  # DCP makes the folder on each rank
            collective_timeout_s=self._timeout_s,
        )
        if self.cfg.async_mode == "none":
            err = None
            try:
                dcp.save(sd, storage_writer=writer, process_group=self._io.pg)
            except Exception as e:  # noqa: BLE001 - handed to the commit, which agrees on it
                err = e
            written()
            self.commit(step, tmp, final, None, err, t0, None, writer)
            return time.perf_counter() - t0
        kind = AsyncCheckpointerType.PROCESS if self.cfg.async_mode == "process" else AsyncCheckpointerType.THREAD
        resp = dcp.async_save(
            sd,
            storage_writer=writer,
            process_group=self._io.pg,
            async_checkpointer_type=kind,
            async_stager=self._stager,
        )
        blocking = time.perf_counter() - t0
        written()
        self.submit(step, tmp, final, resp.upload_completion, None, t0, blocking, writer)
        return blocking

    def submit(self, *args: Any) -> None:
        """Runs `commit(*args)` in the commit's thread (an async save); `wait` raises its failure."""
        self._pending = self._pool.submit(self.commit, *args)

    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed; raises CheckpointSaveError if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_retention(self) -> None:
        """Blocks until the retention pass in flight (if any) is over."""
        if self._retaining is not None:
            self._retaining.result()

    def mark_damaged(self, step: int, d: Path) -> None:
        """A checkpoint the load skipped as damaged: retention never counts it among those it keeps."""
        self._damaged.add((step, manifest_crc(d)))

    def close(self) -> None:
        """Releases the threads, once the commit and the retention pass in flight are over (no wait for failures)."""
        self._pool.shutdown(wait=True)
        self._retain_pool.shutdown(wait=True)

    def prepare(self, tmp: Path) -> None:
        """Rank 0: makes the empty temporary folder of a save (striped: checkpoint.lustre_stripe_count)."""
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

    def commit(
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
        """Commits save `step` (`tmp` -> `final`) once its write is over (`fut`, or failed with `err`); every rank
        agrees on the outcome and raises CheckpointSaveError alike when it was not committed."""
        local_err, files = None, {}
        try:
            if err is not None:
                raise err
            if fut is not None:
                fut.result()
            files = _own_records(writer.records, self.rank, tmp)
        except BaseException as e:  # noqa: BLE001 - agreed on below, raised on every rank
            local_err = describe_error(e, self.folder)
        gathered = self._io.all_gather((local_err, files, blocking_s))
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
        result = self._io.bcast(result)
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
                        "env": self._env,
                        "data_cursor": {"step": step},
                        "rng_keys": [f"rng.rank{r}" for r in range(self.world_size)],
                        "interval": self._interval(),
                        "async_mode": self.cfg.async_mode,
                        **self._manifest_extra,
                    },
                )  # fsyncs the manifest and the folder
                if final.exists():
                    aside = final.with_name(f"{final.name}.uncommitted-{self._attempt}")
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

    def list_steps(self) -> list[int] | str:
        """Rank 0: the committed steps under the folder, once the earlier attempts' leftovers are removed; or why the
        listing failed."""
        try:
            self._remove_stale_tmp()
            return [s for s, _ in step_dirs(self.folder)]
        except Exception as e:  # noqa: BLE001 - broadcast by the caller, so every rank raises it
            return f"listing {self.folder} failed on rank 0: {describe_error(e, self.folder)}"

    def _remove_stale_tmp(self) -> None:
        """Removes the temporary (`step_N.<attempt>.tmp`) and moved-aside (`step_N.uncommitted-<attempt>`)
        folders of earlier attempts; this attempt's are left alone (a save of its own may still write there)."""
        if not self.folder.is_dir():
            return
        for p in sorted([*self.folder.glob("step_*.tmp"), *self.folder.glob("step_*.uncommitted-*")]):
            tmp = p.name.endswith(".tmp")
            if p.name.endswith(f".{self._attempt}.tmp") or f".uncommitted-{self._attempt}" in p.name:
                continue
            shutil.rmtree(p, ignore_errors=True)
            self._emit(
                "checkpoint_tmp_removed",
                path=str(p),
                reason="uncommitted save interrupted by a crash"
                if tmp
                else "a folder an earlier attempt's commit moved aside (it was in a checkpoint's way)",
            )

    def abandon_above(self, step: int) -> str | None:
        """Rank 0: moves the checkpoints of a step > `step` aside (a rollback's abandoned timeline); why it failed,
        or None."""
        try:
            for s, d, aside in abandon_above(self.folder, step=step, attempt=self._attempt):
                self._emit(
                    "checkpoint_abandoned",
                    step=s,
                    path=str(aside),
                    from_path=str(d),
                    target_step=step,
                    reason=f"rolled back to step {step}: a checkpoint of the abandoned timeline",
                )
        except OSError as e:
            return describe_error(e, self.folder)
        return None

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
