"""CheckpointManager: sharded DCP save/load with async writes, atomic commit, retention, fallback and the interval.

Layout under `folder` (RUN_DIR/checkpoints):
    step_<N>.tmp/     a save in progress (DCP shards `__<rank>_<i>.distcp` + `.metadata`, then `manifest.json`)
    step_<N>/         committed by one atomic rename of the whole folder, manifest included
The commit, per save: every rank's shards written and fsync'ed once, their sizes and crc32 taken from the
bytes as they were written -> gathered on rank 0 -> manifest written and fsync'ed in the temporary folder
-> fsync of it -> rename to step_<N> -> fsync of the parent. Checkpoints of the older layout (manifest
written after the rename) load the same way; a step_<N> without a valid manifest never loads.

Async modes take the state off the blocking path: `save` hands the copy into the CPU staging buffers to
a thread and returns; the copy overlaps the next forward and backward and is waited for in a step
pre-hook on every bound optimizer, the first place those tensors change. The state-dict structure is
built once and rebuilt only when the tensors behind it change. Retention runs in a thread of its own.

Collectives run on two gloo groups of the manager's own: `io` (the commit, possibly in a background
thread) and `ctl` (everything on the caller's thread), so neither ever races the training collectives.
Load has no collective inside DCP (each rank reads with no_dist): each candidate is validated, then
loaded, and after each an all_gather that every rank reaches decides for all, so one rank's failure
makes every rank skip that checkpoint together.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint.config import CheckpointConfig
from checkpoint.fingerprint import diff_fingerprint, env_fingerprint
from checkpoint.interval import interval_steps, plan_interval
from checkpoint.manifest import (
    ManifestError,
    check_files,
    check_step_dir,
    file_record,
    fsync_dir,
    read_manifest,
    step_dirs,
    write_manifest,
)
from checkpoint.state import capture_rng, restore_rng
from checkpoint.writer import RecordingWriter, ThreadStager

__all__ = ["CheckpointManager", "CheckpointSaveError"]

log = logging.getLogger("meshjob.checkpoint")
Emit = Callable[..., Any]  # called as emit(kind, **fields), e.g. jobs.events.EventLog.emit
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; the previous committed checkpoint is untouched."""


class CheckpointManager:
    """Saves and restores everything a run needs to continue bit-exactly, on any mesh.

    Usage (the trainer's whole integration):
        ckpt = CheckpointManager(run_dir / "checkpoints", cfg=cfg.checkpoint, rank=r, world_size=w,
                                 emit=events.emit, manifest_extra={"mesh": ..., "config_hash": ...},
                                 total_steps=cfg.train.steps, mtbf_s=...)
        start = ckpt.load_latest(model_parts=parts, optimizers=opts, lr_schedulers=scheds,
                                 train_state=state)          # 0 when there is none; binds the state
        for step in range(start + 1, steps + 1):
            ...
            if ckpt.due(step, step_time_s=dt): ckpt.save(step)   # returns before the staging copy ends;
        ckpt.close()                                          # the next opt.step() waits for it (a hook)

    Every rank must call every method at the same point (they are collective). `train_state`,
    `lr_schedulers` and the interval inputs must be identical on all ranks; the RNG states are
    saved per rank under `rng.rank<r>` and restored only on the same world size and mesh.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        cfg: CheckpointConfig,
        rank: int = 0,
        world_size: int = 1,
        emit: Emit | None = None,
        manifest_extra: dict[str, Any] | None = None,
        total_steps: int | None = None,
        mtbf_s: float | None = None,
    ) -> None:
        if cfg.interval == "auto" and (mtbf_s is None or mtbf_s <= 0):
            raise ValueError(
                f"checkpoint.interval=auto needs the job MTBF (got {mtbf_s}); set failure.mtbf_job_hours "
                "or failure.mtbf_node_hours, or use checkpoint.interval=steps checkpoint.every_steps=N"
            )
        self.folder = Path(folder)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.total_steps = total_steps
        self.mtbf_s = mtbf_s
        self._emit_fn = emit
        self.manifest_extra = dict(manifest_extra or {})
        self._dist = world_size > 1
        if self._dist and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"world_size={world_size} but torch.distributed is not initialized")
        self._io_pg = dist.new_group(backend="gloo") if self._dist else None
        self._ctl_pg = dist.new_group(backend="gloo") if self._dist else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        self._retain_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-retain")
        self._pending: Future | None = None
        self._retaining: Future | None = None
        # Async modes stage into CPU buffers allocated once and reused by every later save, in a thread
        # (see the module docstring). Safe to reuse: save() waits for the previous save to finish writing.
        self._stager = ThreadStager() if cfg.async_mode != "none" else None
        self._hooks: list[Any] = []
        self._bound: dict[str, Any] | None = None
        self._cached: tuple[tuple, dict[str, Any], list[tuple[str, int, int, str]] | None] | None = None
        self._last_save_step = 0
        self._step_times: list[float] = []
        self._delta_s: float | None = None  # agreed cost of a save (blocking + what it took from overlapped steps)
        # What an async save costs the steps it overlaps (see _count_overlap): a save in flight, the
        # excess those steps took, the previous save's blocking time, recent steps no save overlapped.
        self._overlap, self._excess_s, self._prev_blocking = False, 0.0, None
        self._plain_times: list[float] = []
        self._interval_steps: int | None = None  # auto mode: the current interval in steps
        self.last_plan: dict[str, Any] | None = None
        # Rank 0's MTBF for everyone: each rank may read the ledger at a slightly different moment,
        # and the auto interval must come out the same on every rank.
        self.mtbf_s = self._bcast(mtbf_s, self._ctl_pg)
        hosts = self._all_gather(platform.node(), self._ctl_pg)
        self.fingerprint = env_fingerprint(hosts=hosts)

    # ------------------------------------------------------------------ public API

    def load_latest(
        self,
        *,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[Any] = (),
        train_state: Any | None = None,
        before_step: int | None = None,
    ) -> int:
        """Restores the newest valid checkpoint into the given objects and returns its step (0 when
        none). Damaged ones are reported (`checkpoint_skipped`) and passed over, never deleted. Binds
        the objects that later `save` calls write. Every rank skips, loads or raises together: a
        candidate that fails to validate or load on any one rank is skipped by all. `before_step`:
        only checkpoints of a step < before_step are candidates (a rollback past a loss spike)."""
        if len(model_parts) != len(optimizers):
            raise ValueError(f"{len(model_parts)} model parts but {len(optimizers)} optimizers: pass one optimizer per part")
        self._bind(model_parts, optimizers, lr_schedulers, train_state)
        if not self.cfg.enabled:
            return 0
        return self._restore_newest(before_step)

    def _bind(self, model_parts: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              lr_schedulers: Sequence[Any], train_state: Any | None) -> None:
        """Binds the objects later saves write, once any save in flight and any retention pass are over."""
        # A save in flight is committed (or its failure raised) and a retention pass is over before the
        # folder is listed: a later load (a rollback) must neither delete that save's tmp nor race a deletion.
        self.wait()
        if self._retaining is not None:
            self._retaining.result()
        self._bound = {
            "model_parts": list(model_parts),
            "optimizers": list(optimizers),
            "lr_schedulers": list(lr_schedulers),
            "train_state": train_state,
        }
        self._unhook()
        self._cached = None  # new objects bound: the state-dict structure and staging buffers are made anew
        if self._stager is not None:
            self._stager.reset()
            wait = self._stager.wait
            self._hooks = [opt.register_step_pre_hook(lambda *_: wait()) for opt in optimizers]

    def _restore_newest(self, before_step: int | None) -> int:
        """Loads the newest candidate that validates and loads on every rank and returns its step (0
        when none). Raises once a candidate was partly read and none after it loaded: the bound
        objects may then hold a mix of checkpoints."""
        t0 = time.perf_counter()
        steps = [s for s in self._candidate_steps() if before_step is None or s < before_step]
        touched = False
        for step in steps:
            d = self.folder / f"step_{step}"
            problems, manifest = self._validate(step, d)
            if problems:
                self._skip(step, d, "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
                continue
            self._check_drift(step, manifest)
            touched = True
            info, failed = self._load_agreed(d, manifest)
            if info is None:
                self._skip(step, d, f"load failed on {failed}")
                continue
            self._loaded(step, d, manifest, info, t0)
            return step
        if touched:
            raise RuntimeError(
                f"every checkpoint under {self.folder} failed to load after one was partly read, so the "
                "model state is undefined; see checkpoint_skipped in events.jsonl, move the damaged ones aside"
            )
        self._emit("checkpoint_none", folder=str(self.folder), skipped=len(steps), before_step=before_step)
        return 0

    def _loaded(self, step: int, d: Path, manifest: dict[str, Any], info: dict[str, Any], t0: float) -> None:
        """Records a successful load (started at perf_counter `t0`): the save cadence resumes from it,
        and it is reported."""
        self._last_save_step = step
        self._restore_interval(manifest)
        load_s = time.perf_counter() - t0
        self._emit("checkpoint_loaded", step=step, path=str(d), load_s=round(load_s, 4),
                   bytes=manifest["bytes"], saved_world_size=manifest["world_size"], **info)
        log.info("resumed from %s (%.2f s, resharded=%s)", d, load_s, info["resharded"])

    def due(self, step: int, *, step_time_s: float | None = None) -> bool:
        """Whether `step` (just finished) should be saved: the last step, every `every_steps`, or
        when the auto interval (Young/Daly) has elapsed. Identical on all ranks."""
        if step_time_s is not None and step_time_s > 0:
            self._step_times.append(float(step_time_s))
            del self._step_times[:-50]
            self._count_overlap(float(step_time_s))
        if not self.cfg.enabled or step <= self._last_save_step:
            return False
        if self.total_steps is not None and step >= self.total_steps:
            return True
        if self.cfg.interval == "steps":
            return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        if self._interval_steps is None:
            return True  # nothing measured yet: save once to measure the blocking cost
        return step - self._last_save_step >= self._interval_steps

    def save(self, step: int) -> None:
        """Writes checkpoint `step`. Blocks for the whole save (`none`), else only to hand the state to
        the staging thread (the optimizer's next step waits for that copy); a previous save still in
        flight is waited for first (and its failure raised)."""
        if self._bound is None:
            raise RuntimeError("CheckpointManager.save before load_latest: call load_latest(...) to bind the state")
        t0 = time.perf_counter()
        self.wait()
        tmp, final = self.folder / f"step_{step}.tmp", self.folder / f"step_{step}"
        if self.cfg.lustre_stripe_count > 0:  # striping is set on the empty folder, before any rank writes
            if self.rank == 0:
                self._prepare(tmp)
            self._barrier(self._ctl_pg)
        sd = self._save_state_dict()
        writer = RecordingWriter(tmp, thread_count=self.cfg.writer_threads)  # DCP makes the folder on each rank
        if self.cfg.async_mode == "none":
            err = None
            try:
                dcp.save(sd, storage_writer=writer, process_group=self._io_pg)
            except Exception as e:  # noqa: BLE001 - handed to the commit, which agrees on it
                err = e
            self._last_save_step = step
            self._commit(step, tmp, final, None, err, t0, None, writer)
            blocking = time.perf_counter() - t0
        else:
            kind = AsyncCheckpointerType.PROCESS if self.cfg.async_mode == "process" else AsyncCheckpointerType.THREAD
            resp = dcp.async_save(sd, storage_writer=writer, process_group=self._io_pg, async_checkpointer_type=kind,
                                  async_stager=self._stager)
            blocking = time.perf_counter() - t0
            self._last_save_step = step
            self._pending = self._pool.submit(self._commit, step, tmp, final, resp.upload_completion, None, t0,
                                              blocking, writer)
        # The interval's save cost: an async save's blocking part plus what it took from the steps it
        # overlapped, known once the next save begins (the first save: its blocking part only).
        cost = blocking if self._prev_blocking is None else self._prev_blocking + self._excess_s
        self._overlap, self._excess_s = self.cfg.async_mode != "none", 0.0
        self._prev_blocking = blocking if self._overlap else None
        self._retune(step, cost)

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed; raises CheckpointSaveError if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for the last save and the retention pass, then releases the manager's threads and process groups."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._retain_pool.shutdown(wait=True)
            self._unhook()
            if self._stager is not None:
                self._stager.close()  # frees the staging buffers
            self._stager = None
            for pg in (self._io_pg, self._ctl_pg):
                if pg is not None and dist.is_initialized():
                    dist.destroy_process_group(pg)
            self._io_pg = self._ctl_pg = None

    # ------------------------------------------------------------------ state

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _save_state_dict(self) -> dict[str, Any]:
        """The state to save. Model and optimizer tensors come from a structure built once and rebuilt
        only when the tensors behind it change; the optimizer's hyperparameters (lr), the scheduler, the
        train state and the RNG are read fresh each time."""
        sig = self._tensor_signature()
        if self._cached is None or self._cached[0] != sig:
            sd = self._state_dict()
            self._cached = (sig, sd, _param_group_refs(sd["optim"], self._bound["optimizers"]))
            if self._stager is not None:
                self._stager.reset()
            return sd
        _, sd, refs = self._cached
        if refs is None:  # hyperparameters not traceable to a param group: the optimizer part fresh each time
            b = self._bound
            sd["optim"] = {k: v for part, opt in zip(b["model_parts"], b["optimizers"])
                           for k, v in get_optimizer_state_dict(part, opt, options=_OPTS).items()}
        else:
            opts = self._bound["optimizers"]
            for key, oi, gi, name in refs:
                sd["optim"][key] = opts[oi].param_groups[gi][name]
        sd.update(self._small_state())
        return sd

    def _tensor_signature(self) -> tuple:
        """Which tensors (and storages) the model and optimizer state consist of now; a change means
        the cached state-dict structure points at tensors no longer in use."""
        b = self._bound
        assert b is not None
        sig: list[Any] = []
        for part in b["model_parts"]:
            sig += [(id(t), _local(t).data_ptr()) for t in itertools.chain(part.parameters(), part.buffers())]
        for opt in b["optimizers"]:
            sig += [(id(t), _local(t).data_ptr()) for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor)]
        return tuple(sig)

    def _small_state(self) -> dict[str, Any]:
        """The non-tensor state of a save, pickled now: scheduler, train state, this rank's RNG."""
        b = self._bound
        assert b is not None
        out: dict[str, Any] = {}
        if b["lr_schedulers"]:
            out["lr_scheduler"] = pickle.dumps(b["lr_schedulers"][0].state_dict())
        if b["train_state"] is not None:
            out["train_state"] = pickle.dumps(b["train_state"].state_dict())
        out["rng"] = {f"rank{self.rank}": pickle.dumps(capture_rng())}
        return out

    def _state_dict(self, metadata_keys: set[str] | None = None,
                    part_keys: list[list[str]] | None = None) -> dict[str, Any]:
        b = self._bound
        assert b is not None
        model: dict[str, Any] = {}
        for part in b["model_parts"]:
            sd = get_model_state_dict(part, options=_OPTS)
            dup = model.keys() & sd.keys()
            assert not dup, f"model parts share keys {sorted(dup)[:3]}"
            model.update(sd)
            if part_keys is not None:
                part_keys.append(list(sd))
        optim: dict[str, Any] = {}
        for part, opt in zip(b["model_parts"], b["optimizers"]):
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTS))
        sd: dict[str, Any] = {"model": model, "optim": optim}
        loading = metadata_keys is not None
        if b["lr_schedulers"] and (not loading or "lr_scheduler" in metadata_keys):
            sd["lr_scheduler"] = b"" if loading else pickle.dumps(b["lr_schedulers"][0].state_dict())
        if b["train_state"] is not None and (not loading or "train_state" in metadata_keys):
            sd["train_state"] = b"" if loading else pickle.dumps(b["train_state"].state_dict())
        rng_key = f"rank{self.rank}"
        if not loading:
            sd["rng"] = {rng_key: pickle.dumps(capture_rng())}
        elif f"rng.{rng_key}" in metadata_keys:
            sd["rng"] = {rng_key: b""}
        return sd

    def _load_agreed(self, d: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        # _load runs no collective (DCP reads with no_dist, set_*_state_dict are local on FSDP2/TP/PP),
        # so a rank failing anywhere in it cannot leave another blocked inside it; one all_gather
        # afterwards, reached by every rank, decides for all.
        err = info = None
        try:
            info = self._load(d, manifest)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = _describe(e, self.folder)
        failed = [f"rank {r}: {e}" for r, e in enumerate(self._all_gather(err, self._ctl_pg)) if e]
        return (None, "; ".join(failed)[:2000]) if failed else (info, "")

    def _load(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        b = self._bound
        assert b is not None
        md_keys = set(FileSystemReader(str(d)).read_metadata().state_dict_metadata)
        same_mesh = manifest["world_size"] == self.world_size and manifest.get("mesh") == self.manifest_extra.get("mesh")
        part_keys: list[list[str]] = []
        sd = self._state_dict(md_keys, part_keys)
        if not same_mesh:
            sd.pop("rng", None)
        with warnings.catch_warnings():  # no_dist: DCP warns that it assumes a single process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(d), no_dist=True)
        for part, keys in zip(b["model_parts"], part_keys):
            set_model_state_dict(part, {k: sd["model"][k] for k in keys}, options=_OPTS)
        for part, opt in zip(b["model_parts"], b["optimizers"]):
            set_optimizer_state_dict(part, opt, sd["optim"], options=_OPTS)
        if "lr_scheduler" in sd:
            state = pickle.loads(sd["lr_scheduler"])
            for sched in b["lr_schedulers"]:
                sched.load_state_dict(state)
        if "train_state" in sd:
            b["train_state"].load_state_dict(pickle.loads(sd["train_state"]))
        rng = restore_rng(pickle.loads(sd["rng"][f"rank{self.rank}"])) if "rng" in sd else []
        return {"resharded": not same_mesh, "rng_restored": rng}

    # ------------------------------------------------------------------ commit

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

    def _commit(self, step: int, tmp: Path, final: Path, fut: Future | None, err: BaseException | None,
                t0: float, blocking_s: float | None, writer: RecordingWriter) -> None:
        local_err, files = None, {}
        try:
            if err is not None:
                raise err
            if fut is not None:
                fut.result()
            files = _own_records(writer.records, self.rank, tmp)
        except BaseException as e:  # noqa: BLE001 - agreed on below, raised on every rank
            local_err = _describe(e, self.folder)
        gathered = self._all_gather((local_err, files, blocking_s), self._io_pg)
        result: dict[str, Any] | None = None
        if self.rank == 0:
            result = self._commit_rank0(step, tmp, final, gathered)
        result = self._bcast(result, self._io_pg)
        total_s = time.perf_counter() - t0
        if not result["ok"]:
            self._emit("checkpoint_failed", step=step, error=result["error"], total_s=round(total_s, 4))
            raise CheckpointSaveError(f"checkpoint step_{step} was not committed: {result['error']}")
        blocking = [g[2] for g in gathered if g[2] is not None]
        self._emit("checkpoint_saved", step=step, path=str(final), bytes=result["bytes"], files=result["files"],
                   blocking_s=round(max(blocking) if blocking else total_s, 4), total_s=round(total_s, 4),
                   async_mode=self.cfg.async_mode)
        if self.rank == 0:  # deleting old checkpoints is no part of this one's commit: in a thread of its own
            self._retaining = self._retain_pool.submit(self._retain_logged)

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
                write_manifest(tmp, {
                    "step": step,
                    "time": time.time(),
                    "world_size": self.world_size,
                    "files": files,
                    "bytes": nbytes,
                    "env": self.fingerprint,
                    "data_cursor": {"step": step},
                    "rng_keys": [f"rng.rank{r}" for r in range(self.world_size)],
                    "interval": {"delta_s": self._delta_s, "step_time_s": self._step_time()},
                    "async_mode": self.cfg.async_mode,
                    **self.manifest_extra,
                })  # fsyncs the manifest and the folder
                if final.exists():
                    aside = final.with_name(f"{final.name}.uncommitted-{time.time_ns()}")
                    os.rename(final, aside)
                    self._emit("checkpoint_moved_aside", step=step, path=str(aside),
                               reason="a folder of this step was in the way (uncommitted, or left by a rolled-back timeline)")
                os.rename(tmp, final)  # the commit
                renamed = True
                fsync_dir(self.folder)
                return {"ok": True, "bytes": nbytes, "files": len(files)}
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank 0 commit: {_describe(e, self.folder)}")
        for p in (tmp, final if renamed else None):
            if p is not None and p.exists():
                shutil.rmtree(p, ignore_errors=True)
                self._emit("checkpoint_tmp_removed", path=str(p), reason="uncommitted save failed")
        return {"ok": False, "error": "; ".join(errors)[:2000]}

    def _retain_logged(self) -> None:
        try:
            self._retain()
        except Exception as e:  # noqa: BLE001 - retention failing costs disk space, not the run
            log.warning("retention under %s failed: %s", self.folder, _describe(e, self.folder))

    def _retain(self) -> None:
        # Counts toward checkpoint.keep only what load would accept (checkpoint.verify), newest first; of
        # the older ones, only those whose manifest and sizes check out are deleted (the rest are left for
        # a human), and never the newest one that passes the checksum.
        dirs = step_dirs(self.folder)
        if len(dirs) <= self.cfg.keep:
            return  # nothing to delete: no need to read any checkpoint back
        checksum = self.cfg.verify == "checksum"
        kept: list[tuple[int, Path]] = []
        retired: list[tuple[int, Path]] = []
        for step, d in dirs:
            if len(kept) < self.cfg.keep:
                if not check_step_dir(d, step=step, checksum=checksum):
                    kept.append((step, d))
            elif not check_step_dir(d, step=step, checksum=False):
                retired.append((step, d))
        if retired and not checksum:  # kept by size only: the newest one that passes the checksum stays too
            sound = next((sd for sd in kept + retired if not check_step_dir(sd[1], step=sd[0], checksum=True)), None)
            retired = [sd for sd in retired if sd != sound]
        for step, d in retired:
            shutil.rmtree(d)
            self._emit("checkpoint_deleted", step=step, path=str(d), reason=f"retention: checkpoint.keep={self.cfg.keep}")

    # ------------------------------------------------------------------ load helpers

    def _validate(self, step: int, d: Path) -> tuple[list[str], dict[str, Any] | None]:
        manifest = None
        try:
            manifest = read_manifest(d, step=step)
            names = sorted(manifest["files"])
            problems = check_files(d, manifest["files"], names[self.rank :: self.world_size],
                                   checksum=self.cfg.verify == "checksum")
        except ManifestError as e:
            problems = [str(e)]
        except Exception as e:  # noqa: BLE001 - e.g. EIO on this rank only: agreed on below like any problem
            problems = [f"rank {self.rank}: {_describe(e, self.folder)}"]
        problems = sorted({p for ps in self._all_gather(problems, self._ctl_pg) for p in ps})
        return problems, (manifest if not problems else None)

    def _candidate_steps(self) -> list[int]:
        listing: list[int] | str | None = None
        if self.rank == 0:
            try:
                self._remove_stale_tmp()
                listing = [s for s, _ in step_dirs(self.folder)]
            except Exception as e:  # noqa: BLE001 - broadcast, so every rank raises it
                listing = f"listing {self.folder} failed on rank 0: {_describe(e, self.folder)}"
        listing = self._bcast(listing, self._ctl_pg)
        if isinstance(listing, str):
            raise RuntimeError(f"{listing}; make the folder readable (or fix run.dir) and restart")
        return listing

    def _skip(self, step: int, d: Path, reason: str) -> None:
        self._emit("checkpoint_skipped", step=step, path=str(d), reason=reason)
        if self.rank == 0:
            log.warning("skipping checkpoint %s: %s", d, reason)

    def _remove_stale_tmp(self) -> None:
        if not self.folder.is_dir():
            return
        for p in sorted(self.folder.glob("step_*.tmp")):
            shutil.rmtree(p, ignore_errors=True)
            self._emit("checkpoint_tmp_removed", path=str(p), reason="uncommitted save interrupted by a crash")

    def _check_drift(self, step: int, manifest: dict[str, Any]) -> None:
        diff = diff_fingerprint(manifest.get("env", {}), self.fingerprint)
        diffs = self._all_gather(diff, self._ctl_pg)
        merged = {k: v for d in diffs for k, v in d.items()}
        if not merged:
            return
        policy = self.cfg.on_env_drift
        self._emit("checkpoint_env_drift", step=step, policy=policy, diff=merged,
                   ranks=[r for r, d in enumerate(diffs) if d])
        summary = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(merged.items())[:8])
        if policy == "refuse":
            raise RuntimeError(
                f"environment differs from checkpoint step_{step}'s ({summary}); restore the environment "
                "or set checkpoint.on_env_drift=warn (or allow) to resume anyway"
            )
        if policy == "warn" and self.rank == 0:
            log.warning("environment differs from checkpoint step_%d's: %s", step, summary)

    # ------------------------------------------------------------------ interval

    def _step_time(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    def _count_overlap(self, step_time_s: float) -> None:
        """An async save's write competes with the steps it overlaps (CPU, memory bandwidth, the staging
        wait before the optimizer step): each such step's excess over the median of recent steps that
        no save overlapped is added to the save's cost. Measured on a 2-core machine it was ~30x the
        blocking part (0.65 s against 0.02 s), and an interval from the blocking part alone saved every
        8 steps where Young/Daly with the whole cost says 40."""
        if not self._overlap:
            self._plain_times.append(step_time_s)
            del self._plain_times[:-50]
            return
        if self._plain_times:
            self._excess_s += max(0.0, step_time_s - statistics.median(self._plain_times))
        if self._pending is None or self._pending.done():
            self._overlap = False

    def _retune(self, step: int, cost_s: float) -> None:
        if self.cfg.interval != "auto":
            return
        vals = torch.tensor([cost_s, self._step_time() or 0.0], dtype=torch.float64)
        if self._dist:
            dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        self._delta_s, step_time = float(vals[0]), float(vals[1])
        self._set_interval(step_time, step=step)

    def _restore_interval(self, manifest: dict[str, Any]) -> None:
        iv = manifest.get("interval") or {}
        if self.cfg.interval == "auto" and iv.get("delta_s") and iv.get("step_time_s"):
            self._delta_s = float(iv["delta_s"])
            self._set_interval(float(iv["step_time_s"]), step=manifest["step"])

    def _set_interval(self, step_time: float, *, step: int) -> None:
        assert self.mtbf_s is not None and self._delta_s is not None
        if step_time <= 0:
            self._interval_steps = 1
            return
        plan = plan_interval(delta=max(self._delta_s, 1e-6), mtbf=self.mtbf_s, restart=self.cfg.restart_s)
        self._interval_steps = interval_steps(plan.interval_s, step_time)
        self.last_plan = dict(plan.as_dict(), interval_steps=self._interval_steps, step_time_s=step_time)
        self._emit("checkpoint_interval", step=step, **{k: round(v, 6) if isinstance(v, float) else v
                                                         for k, v in self.last_plan.items()})
        if self.rank == 0:
            log.info(
                "checkpoint interval %d steps (Daly %.1f s, Young %.1f s; δ=%.3f s, MTBF=%.0f s, step %.3f s): "
                "overhead %.2f%%, expected lost work per failure %.1f s",
                self._interval_steps, plan.interval_s, plan.young_s, plan.delta_s, plan.mtbf_s, step_time,
                100 * plan.checkpoint_overhead, plan.expected_lost_work_s,
            )

    # ------------------------------------------------------------------ plumbing

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.rank == 0 and self._emit_fn is not None:
            self._emit_fn(kind, **fields)

    def _all_gather(self, obj: Any, pg: Any) -> list[Any]:
        if not self._dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=pg)
        return out

    def _bcast(self, obj: Any, pg: Any) -> Any:
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=pg)
        return box[0]

    def _barrier(self, pg: Any) -> None:
        if self._dist:
            dist.barrier(group=pg)


def _own_records(records: dict[str, dict[str, Any]], rank: int, tmp: Path) -> dict[str, dict[str, Any]]:
    """This rank's shard files with their size and crc32, from the writer's records; read back from disk
    only where the writer ran elsewhere (async_mode=process) and left none here."""
    mine = {n: r for n, r in records.items() if n.startswith(f"__{rank}_") or n == ".metadata"}
    if mine:
        return mine
    return {p.name: file_record(p) for p in sorted(tmp.glob(f"__{rank}_*"))}


def _param_group_refs(optim_sd: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer]
                      ) -> list[tuple[str, int, int, str]] | None:
    """(key, optimizer, param group, name) of every flattened `param_groups.<fqn>.<name>` entry, traced
    through the state tensors `state.<fqn>.*` that alias the optimizer's own; None when one is not traceable."""
    owner = {id(t): (oi, gi) for oi, opt in enumerate(optimizers) for gi, g in enumerate(opt.param_groups)
             for p in g["params"] for t in opt.state.get(p, {}).values()}
    fqn_owner = {}
    for key, v in optim_sd.items():
        if key.startswith("state.") and id(v) in owner:
            fqn_owner[key[len("state."):key.rindex(".")]] = owner[id(v)]
    refs = []
    for key in optim_sd:
        if key.startswith("param_groups."):
            fqn, name = key[len("param_groups."):key.rindex(".")], key[key.rindex(".") + 1:]
            if fqn not in fqn_owner:
                return None
            refs.append((key, *fqn_owner[fqn], name))
    return refs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _describe(e: BaseException, folder: Path) -> str:
    """A one-line cause; a full disk is named as such, with the free space and the fix."""
    text = f"{type(e).__name__}: {e}"
    enospc = "No space left on device" in text or any(
        getattr(x, "errno", None) == errno.ENOSPC for x in _chain(e)
    )
    if enospc:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = -1
        return (f"no space left on device under {folder} ({free} bytes free); free space or put run.dir on a "
                "larger filesystem")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    return first[:500]


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out
