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

import logging
import os
import platform
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpoint.cadence import Cadence
from checkpoint.commit import CommitMixin
from checkpoint.config import CheckpointConfig
from checkpoint.errors import CheckpointSaveError, describe_error
from checkpoint.fingerprint import diff_fingerprint, env_fingerprint
from checkpoint.manifest import ManifestError, check_files, read_manifest, step_dirs, verify_share
from checkpoint.memory_capacity import MemoryCapacityMixin
from checkpoint.memory_restore import MemoryRestoreMixin
from checkpoint.memory_tier import FILESYSTEM, MEMORY, MemoryTierMixin
from checkpoint.retention import abandon_above, manifest_crc
from checkpoint.statedict import BoundState
from checkpoint.writer import RecordingWriter, ThreadStager

__all__ = ["CheckpointManager", "CheckpointSaveError"]

log = logging.getLogger("meshjob.checkpoint")
Emit = Callable[..., Any]  # called as emit(kind, **fields), e.g. jobs.events.EventLog.emit


class CheckpointManager(CommitMixin, MemoryTierMixin, MemoryRestoreMixin, MemoryCapacityMixin):
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
        attempt: str = "",
        checkpoint_timeout_s: float | None = None,
        run_id: str = "",
        node: str = "",
        tier_shares: dict[str, float] | None = None,
        domain: str = "",
    ) -> None:
        for key, mode in (("interval", cfg.interval), ("memory_interval", cfg.memory_interval)):
            if mode == "auto" and (mtbf_s is None or mtbf_s <= 0):
                raise ValueError(
                    f"checkpoint.{key}=auto needs the job MTBF (got {mtbf_s}); set failure.mtbf_job_hours "
                    f"or failure.mtbf_node_hours, or use checkpoint.{key}=steps"
                )
        # {tier: share of all failures it is read after} (checkpoint/tiers.py, from failure.process_share/node_share):
        # each tier's auto interval comes from its own save cost and the MTBF of those failures. None: the filesystem
        # tier covers every failure (the single-tier interval).
        self.tier_shares = dict(tier_shares or {FILESYSTEM: 1.0})
        self.folder = Path(folder)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.total_steps = total_steps
        self.mtbf_s = mtbf_s
        # The bound of every checkpoint collective: this manager's groups (`process_groups`, set by the trainer) and
        # DCP's background group (async_mode=process, RecordingWriter). A save on a slow filesystem waits in them for
        # the slowest rank's write, so they get the checkpoint's limit, not failure.collective_timeout_s.
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self._emit_fn = emit
        # `domain`: this node's failure domain (its leaf switch, else its physical host; "" unknown): partner
        # copies go to a node of another one where the nodes allow (checkpoint/partner.py, spread_ring)
        self._init_memory_tier(run_id or f"dir-{zlib.crc32(os.path.realpath(self.folder).encode()):08x}", node)
        self.domain = domain
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
        self._damaged: set[tuple[int, str]] = set()  # (step, manifest crc32) the load skipped: retention counts none
        # Async modes stage into CPU buffers allocated once and reused by every later save, in a thread
        # (see the module docstring). Safe to reuse: save() waits for the previous save to finish writing.
        self._stager = ThreadStager() if cfg.async_mode != "none" else None
        self._hooks: list[Any] = []
        self.state = BoundState(rank=rank, stager=self._stager)  # the objects saves write (load_latest binds them)
        # Rank 0's MTBF for everyone: each rank may read the ledger at a slightly different moment,
        # and the auto interval must come out the same on every rank.
        self.mtbf_s = self._bcast(mtbf_s, self._ctl_pg)
        self.cadence = Cadence(
            cfg=cfg,
            mtbf_s=self.mtbf_s,
            tier_shares=self.tier_shares,
            rank=rank,
            agree_max=self._agree_max,
            emit=self._emit,
        )
        # Names this attempt's temporary and moved-aside folders (`<job id>.<restart>`, jobs.failure.ledger),
        # rank 0's for all: a later attempt's load removes them, never one a live writer of its own may use.
        self.attempt = self._bcast(attempt or f"pid{os.getpid()}", self._ctl_pg)
        hosts = self._all_gather(platform.node(), self._ctl_pg)
        self.fingerprint = env_fingerprint(hosts=hosts)
        self._init_partners()  # the RAM tier's partner ring and group (checkpoint/memory_tier.py)

    # ------------------------------------------------------------------ public API

    def load_latest(
        self,
        *,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[Any] = (),
        train_state: Any | None = None,
        before_step: int | None = None,
        rollbacks: int = 0,
    ) -> int:
        """Restores the newest valid checkpoint into the given objects and returns its step (0 when
        none). Damaged ones are reported (`checkpoint_skipped`) and passed over, never deleted. Binds
        the objects that later `save` calls write. Every rank skips, loads or raises together: a
        candidate that fails to validate or load on any one rank is skipped by all. `before_step`:
        only checkpoints of a step < before_step are candidates (a rollback past a loss spike); the
        checkpoints above the step loaded then belong to the abandoned timeline and are moved aside to
        `abandoned/` (`checkpoint_abandoned`), so that neither retention nor a later load counts them.
        `rollbacks`: the rollbacks the run has recorded (rank 0's count for all): a RAM step whose manifest
        knows fewer was saved on an abandoned timeline and is never loaded (checkpoint.memory_load=false: none is)."""
        if len(model_parts) != len(optimizers):
            raise ValueError(
                f"{len(model_parts)} model parts but {len(optimizers)} optimizers: pass one optimizer per part"
            )
        self._bind(model_parts, optimizers, lr_schedulers, train_state)
        if not self.cfg.enabled:
            return 0
        self._known_rollbacks = int(self._bcast(rollbacks, self._ctl_pg))
        if not self._capacity_checked:  # the RAM tier's bytes per node against free memory, once per attempt
            self.check_memory_capacity(self.local_state_bytes())
            self._capacity_checked = True
        step = self._restore_newest(before_step)
        if before_step is not None and step > 0:
            self._abandon_above(step)
        return step

    def _abandon_above(self, step: int) -> None:
        """Rank 0 moves the checkpoints of a step > `step` aside, once every rank has finished reading (the
        load's last all_gather); every rank waits for the outcome, so no save of the new timeline starts before."""
        err = None
        if self.rank == 0:
            try:
                for s, d, aside in abandon_above(self.folder, step=step, attempt=self.attempt):
                    self._emit(
                        "checkpoint_abandoned",
                        step=s,
                        path=str(aside),
                        from_path=str(d),
                        target_step=step,
                        reason=f"rolled back to step {step}: a checkpoint of the abandoned timeline",
                    )
            except OSError as e:
                err = describe_error(e, self.folder)
        err = self._bcast(err, self._ctl_pg)
        if err is not None:
            raise RuntimeError(
                f"rolled back to step {step} but moving the later checkpoints aside failed on rank 0 "
                f"({err}); move {self.folder}/step_N (N > {step}) aside by hand and restart"
            )

    def _bind(
        self,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[Any],
        train_state: Any | None,
    ) -> None:
        """Binds the objects later saves write, once any save in flight and any retention pass are over."""
        # A save in flight is committed (or its failure raised) and a retention pass is over before the
        # folder is listed: a later load (a rollback) must neither delete that save's tmp nor race a deletion.
        self.wait()
        self.wait_memory()
        if self._retaining is not None:
            self._retaining.result()
        self.state.bind(model_parts, optimizers, lr_schedulers, train_state)
        self._unhook()
        if self._stager is not None:
            wait = self._stager.wait
            self._hooks = [opt.register_step_pre_hook(lambda *_: wait()) for opt in optimizers]
        if self.cfg.memory_on:  # and for the RAM tier's staging copy (checkpoint/memory_tier.py)
            self._hooks += [opt.register_step_pre_hook(lambda *_: self._wait_memory_staged()) for opt in optimizers]

    def _restore_newest(self, before_step: int | None) -> int:
        """Loads the newest candidate of any tier that validates and loads on every rank and returns its step
        (0 when none); at the same step the RAM tier comes first (the cheaper read; own copies, or partner copies
        where a rank's own is missing or damaged). Raises once a candidate
        was partly read and none after it loaded: the bound objects may then hold a mix of checkpoints."""
        t0 = time.perf_counter()
        steps = [(s, FILESYSTEM) for s in self._candidate_steps()] + [(s, MEMORY) for s in self._memory_candidates()]
        steps = sorted(
            [c for c in steps if before_step is None or c[0] < before_step], key=lambda c: (-c[0], c[1] != MEMORY)
        )  # a RAM candidate's tier may turn PARTNER below
        touched = False
        for step, tier in steps:
            if tier == MEMORY:
                d, problems, manifest, tier = self._validate_memory(step)
            else:
                d = self.folder / f"step_{step}"
                problems, manifest = self._validate(step, d)
            if problems:
                self._skip(
                    step,
                    d,
                    "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""),
                    tier=tier,
                )
                continue
            if tier == FILESYSTEM:
                self._check_drift(step, manifest)
            touched = True
            info, failed = self._load_agreed(d, manifest, load=self._load if tier == FILESYSTEM else self._load_memory)
            if info is None:
                self._skip(step, d, f"load failed on {failed}", tier=tier)
                continue
            self._loaded(step, d, manifest, info, t0, tier=tier)
            self._after_load_memory(step)
            return step
        if touched:
            raise RuntimeError(
                f"every checkpoint under {self.folder} failed to load after one was partly read, so the "
                "model state is undefined; see checkpoint_skipped in events.jsonl, move the damaged ones aside"
            )
        self._after_load_memory(0)
        self._emit("checkpoint_none", folder=str(self.folder), skipped=len(steps), before_step=before_step)
        return 0

    def _loaded(
        self, step: int, d: Path, manifest: dict[str, Any], info: dict[str, Any], t0: float, *, tier: str = FILESYSTEM
    ) -> None:
        """Records a successful load (started at perf_counter `t0`) from `tier`: the save cadence resumes from
        it, and it is reported."""
        self.cadence.restore(step, manifest)
        load_s = time.perf_counter() - t0
        self._emit(
            "checkpoint_loaded",
            step=step,
            tier=tier,
            path=str(d),
            load_s=round(load_s, 4),
            bytes=manifest["bytes"],
            saved_world_size=manifest["world_size"],
            **info,
        )
        log.info("resumed from %s (%s tier, %.2f s, resharded=%s)", d, tier, load_s, info["resharded"])

    def due(self, step: int, *, step_time_s: float | None = None) -> bool:
        """Whether `step` (just finished) should be saved: the last step, every `every_steps`, or
        when the auto interval (Young/Daly) has elapsed. Identical on all ranks."""
        if step_time_s is not None and step_time_s > 0:
            in_flight = self._pending is not None and not self._pending.done()
            self.cadence.record_step(float(step_time_s), save_in_flight=in_flight)
        return self.cfg.enabled and self.cadence.due(step, total_steps=self.total_steps)

    def save(self, step: int) -> None:
        """Writes checkpoint `step`. Blocks for the whole save (`none`), else only to hand the state to
        the staging thread (the optimizer's next step waits for that copy); a previous save still in
        flight is waited for first (and its failure raised)."""
        if self.state.objects is None:
            raise RuntimeError("CheckpointManager.save before load_latest: call load_latest(...) to bind the state")
        t0 = time.perf_counter()
        self.wait()
        tmp, final = self.folder / f"step_{step}.{self.attempt}.tmp", self.folder / f"step_{step}"
        if self.cfg.lustre_stripe_count > 0:  # striping is set on the empty folder, before any rank writes
            if self.rank == 0:
                self._prepare(tmp)
            self._barrier(self._ctl_pg)
        sd = self.state.save_state_dict()
        writer = RecordingWriter(
            tmp,
            thread_count=self.cfg.writer_threads,  # DCP makes the folder on each rank
            collective_timeout_s=self.checkpoint_timeout_s,
        )
        if self.cfg.async_mode == "none":
            err = None
            try:
                dcp.save(sd, storage_writer=writer, process_group=self._io_pg)
            except Exception as e:  # noqa: BLE001 - handed to the commit, which agrees on it
                err = e
            self.cadence.last_save_step = step
            self._commit(step, tmp, final, None, err, t0, None, writer)
            blocking = time.perf_counter() - t0
        else:
            kind = AsyncCheckpointerType.PROCESS if self.cfg.async_mode == "process" else AsyncCheckpointerType.THREAD
            resp = dcp.async_save(
                sd,
                storage_writer=writer,
                process_group=self._io_pg,
                async_checkpointer_type=kind,
                async_stager=self._stager,
            )
            blocking = time.perf_counter() - t0
            self.cadence.last_save_step = step
            self._pending = self._pool.submit(
                self._commit, step, tmp, final, resp.upload_completion, None, t0, blocking, writer
            )
        self.cadence.saved(step, blocking, overlapped=self.cfg.async_mode != "none")

    @property
    def last_plan(self) -> dict[str, Any] | None:
        """The filesystem tier's last auto interval plan (checkpoint.interval=auto; None before one)."""
        return self.cadence.last_plan

    def memory_interval_steps(self) -> int:
        """The RAM tier's interval in steps (Cadence.memory_interval_steps)."""
        return self.cadence.memory_interval_steps()

    @property
    def process_groups(self) -> list[dist.ProcessGroup]:
        """This manager's own process groups (the filesystem save's, the control's, the RAM tier's): their
        timeout is `checkpoint_timeout_s`."""
        return [pg for pg in (self._io_pg, self._ctl_pg, self._mem_pg) if pg is not None]

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
            self._close_memory()
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

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ load helpers

    def _validate(self, step: int, d: Path) -> tuple[list[str], dict[str, Any] | None]:
        manifest = None
        try:
            manifest = read_manifest(d, step=step)
            mine = verify_share(list(manifest["files"]), rank=self.rank, world_size=self.world_size)
            problems = check_files(d, manifest["files"], mine, checksum=self.cfg.verify == "checksum")
        except ManifestError as e:
            problems = [str(e)]
        except Exception as e:  # noqa: BLE001 - e.g. EIO on this rank only: agreed on below like any problem
            problems = [f"rank {self.rank}: {describe_error(e, self.folder)}"]
        problems = sorted({p for ps in self._all_gather(problems, self._ctl_pg) for p in ps})
        return problems, (manifest if not problems else None)

    def _load_agreed(self, d: Path, manifest: dict[str, Any], *, load: Any = None) -> tuple[dict[str, Any] | None, str]:
        # _load runs no collective (DCP reads with no_dist, set_*_state_dict are local on FSDP2/TP/PP),
        # so a rank failing anywhere in it cannot leave another blocked inside it; one all_gather
        # afterwards, reached by every rank, decides for all.
        err = info = None
        try:
            info = (load or self._load)(d, manifest)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = describe_error(e, self.folder)
        failed = [f"rank {r}: {e}" for r, e in enumerate(self._all_gather(err, self._ctl_pg)) if e]
        return (None, "; ".join(failed)[:2000]) if failed else (info, "")

    def _load(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        same_world = manifest["world_size"] == self.world_size
        same_mesh = same_world and manifest.get("mesh") == self.manifest_extra.get("mesh")
        return self.state.load(d, resharded=not same_mesh)

    def _candidate_steps(self) -> list[int]:
        listing: list[int] | str | None = None
        if self.rank == 0:
            try:
                self._remove_stale_tmp()
                listing = [s for s, _ in step_dirs(self.folder)]
            except Exception as e:  # noqa: BLE001 - broadcast, so every rank raises it
                listing = f"listing {self.folder} failed on rank 0: {describe_error(e, self.folder)}"
        listing = self._bcast(listing, self._ctl_pg)
        if isinstance(listing, str):
            raise RuntimeError(f"{listing}; make the folder readable (or fix run.dir) and restart")
        return listing

    def _skip(self, step: int, d: Path, reason: str, *, tier: str = FILESYSTEM) -> None:
        if tier == FILESYSTEM and self.rank == 0:  # the rank that runs the filesystem's retention
            self._damaged.add((step, manifest_crc(d)))
        self._emit("checkpoint_skipped", step=step, tier=tier, path=str(d), reason=reason)
        if self.rank == 0:
            log.warning("skipping checkpoint %s: %s", d, reason)

    def _remove_stale_tmp(self) -> None:
        """Removes the temporary (`step_N.<attempt>.tmp`) and moved-aside (`step_N.uncommitted-<attempt>`)
        folders of earlier attempts; this attempt's are left alone (a save of its own may still write there)."""
        if not self.folder.is_dir():
            return
        for p in sorted([*self.folder.glob("step_*.tmp"), *self.folder.glob("step_*.uncommitted-*")]):
            tmp = p.name.endswith(".tmp")
            if p.name.endswith(f".{self.attempt}.tmp") or f".uncommitted-{self.attempt}" in p.name:
                continue
            shutil.rmtree(p, ignore_errors=True)
            self._emit(
                "checkpoint_tmp_removed",
                path=str(p),
                reason="uncommitted save interrupted by a crash"
                if tmp
                else "a folder an earlier attempt's commit moved aside (it was in a checkpoint's way)",
            )

    def _check_drift(self, step: int, manifest: dict[str, Any]) -> None:
        diff = diff_fingerprint(manifest.get("env", {}), self.fingerprint)
        diffs = self._all_gather(diff, self._ctl_pg)
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

    def _agree_max(self, values: list[float]) -> list[float]:
        """The element-wise max of `values` over the ranks (on the control group)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self._dist:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        return [float(x) for x in t]

    def _bcast(self, obj: Any, pg: Any) -> Any:
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=pg)
        return box[0]

    def _barrier(self, pg: Any) -> None:
        if self._dist:
            dist.barrier(group=pg)
