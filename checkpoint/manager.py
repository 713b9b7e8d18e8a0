"""CheckpointManager: sharded DCP save/load with async writes, atomic commit, retention, fallback and the interval.

The manager is a small facade over parts, each built with exactly what it needs and holding its own state:
`Committer` (checkpoint/commit.py: the filesystem tier's write, commit, retention and folder housekeeping; its
docstring has the layout and the commit protocol), `FsRestore`
(checkpoint/fs_restore.py: the filesystem tier's listing, checks and load), `MemoryTier` (checkpoint/memory_tier.py:
the RAM tier: when it saves, its saves and loads of the bound state, with its `MemoryRestore` and capacity check),
`Restore` (checkpoint/restore.py: the choice between the tiers' candidates at a load, the newest step first, the RAM
tier's at a tie, skipping bad ones), `Cadence` (checkpoint/cadence.py: when each tier saves) and `BoundState`
(checkpoint/statedict.py: the objects saved and restored, the save's state-dict structure built once). The manager
builds and wires them, binds the state (and the optimizer pre-hooks that wait for the staging copies), starts the
filesystem tier's saves and hands the trainer's RAM-tier calls to `MemoryTier` unchanged.

Collectives run on gloo groups of the manager's own (checkpoint/group.py): `io` (the commit, possibly in a
background thread), `ctl` (everything on the caller's thread) and the RAM tier's, so none ever races the training
collectives. A load agrees on every candidate (checkpoint/restore.py): one rank's failure makes every rank skip it.
"""

from __future__ import annotations

import os
import platform
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.cadence import Cadence, check_auto
from checkpoint.commit import Committer
from checkpoint.config import CheckpointConfig
from checkpoint.errors import CheckpointSaveError
from checkpoint.fingerprint import env_fingerprint
from checkpoint.fs_restore import FsRestore
from checkpoint.group import Group
from checkpoint.memory_tier import FILESYSTEM, MemoryTier, place
from checkpoint.restore import Restore
from checkpoint.statedict import BoundState
from checkpoint.writer import ThreadStager

__all__ = ["CheckpointManager", "CheckpointSaveError"]

Emit = Callable[..., Any]  # called as emit(kind, **fields), e.g. jobs.events.EventLog.emit


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
        attempt: str = "",
        checkpoint_timeout_s: float | None = None,
        run_id: str = "",
        node: str = "",
        tier_shares: dict[str, float] | None = None,
        domain: str = "",
    ) -> None:
        check_auto(cfg, mtbf_s)
        self.folder, self.cfg, self.rank, self.world_size = Path(folder), cfg, rank, world_size
        self.total_steps = total_steps
        # The bound of every checkpoint collective: this manager's groups (`process_groups`, set by the trainer) and
        # DCP's background group (async_mode=process, RecordingWriter). A save on a slow filesystem waits in them for
        # the slowest rank's write, so they get the checkpoint's limit, not failure.collective_timeout_s.
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self._emit_fn = emit
        self.manifest_extra = dict(manifest_extra or {})
        self.run_id = run_id or f"dir-{zlib.crc32(os.path.realpath(self.folder).encode()):08x}"
        self.node = node or platform.node()
        if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"world_size={world_size} but torch.distributed is not initialized")
        self._io, self._ctl = Group.new(world_size), Group.new(world_size)
        # Async modes stage into CPU buffers allocated once and reused by every later save, in a thread
        # (see the module docstring). Safe to reuse: save() waits for the previous save to finish writing.
        self._stager = ThreadStager() if cfg.async_mode != "none" else None
        self._hooks: list[Any] = []
        self.state = BoundState(rank=rank, stager=self._stager)  # the objects saves write (load_latest binds them)
        self.cadence = self._cadence(mtbf_s, tier_shares)
        # Names this attempt's temporary and moved-aside folders (`<job id>.<restart>`, jobs.failure.ledger),
        # rank 0's for all: a later attempt's load removes them, never one a live writer of its own may use.
        self.attempt = self._ctl.bcast(attempt or f"pid{os.getpid()}")
        self.fingerprint = env_fingerprint(hosts=self._ctl.all_gather(platform.node()))
        self.committer = self._committer()
        self.fs_restore = self._fs_restore()
        self.memory = self._memory_tier(domain)
        self.restore = Restore(
            self.folder,
            rank=rank,
            ctl=self._ctl,
            fs=self.fs_restore,
            memory=self.memory,
            cadence=self.cadence,
            emit=self._emit,
        )

    def _cadence(self, mtbf_s: float | None, tier_shares: dict[str, float] | None) -> Cadence:
        """When each tier saves. Rank 0's MTBF for everyone: each rank may read the ledger at a slightly different
        moment, and the auto interval must come out the same on every rank."""
        self.mtbf_s = self._ctl.bcast(mtbf_s)
        # {tier: share of all failures it is read after} (checkpoint/tiers.py, from failure.process_share/node_share):
        # each tier's auto interval comes from its own save cost and the MTBF of those failures. None: the filesystem
        # tier covers every failure (the single-tier interval).
        self.tier_shares = dict(tier_shares or {FILESYSTEM: 1.0})
        return Cadence(
            cfg=self.cfg,
            mtbf_s=self.mtbf_s,
            tier_shares=self.tier_shares,
            rank=self.rank,
            agree_max=self._ctl.max,
            emit=self._emit,
        )

    def _committer(self) -> Committer:
        """The filesystem tier's commit and retention; its manifests record the interval as it is at each commit."""
        return Committer(
            self.folder,
            cfg=self.cfg,
            rank=self.rank,
            world_size=self.world_size,
            io=self._io,
            emit=self._emit,
            attempt=self.attempt,
            env=self.fingerprint,
            manifest_extra=self.manifest_extra,
            interval=self.cadence.manifest_entry,
            stager=self._stager,
            timeout_s=self.checkpoint_timeout_s,
        )

    def _fs_restore(self) -> FsRestore:
        """The filesystem tier's load side: it lists through the committer (which removes earlier attempts' leftovers,
        keeps the damaged steps out of retention and moves an abandoned timeline aside) and loads into the state."""
        return FsRestore(
            self.folder,
            cfg=self.cfg,
            rank=self.rank,
            world_size=self.world_size,
            ctl=self._ctl,
            state=self.state,
            committer=self.committer,
            env=self.fingerprint,
            mesh=self.manifest_extra.get("mesh"),
            emit=self._emit,
        )

    def _memory_tier(self, domain: str) -> MemoryTier:
        """The RAM tier: where its copies go (collective: the partner ring over every rank's node and failure
        `domain`, checkpoint/partner.py spread_ring), then its own gloo group for its background commit."""
        at = place(
            self.cfg,
            run_id=self.run_id,
            node=self.node,
            domain=domain,
            rank=self.rank,
            world_size=self.world_size,
            ctl=self._ctl,
        )
        on = self.cfg.enabled and self.cfg.memory_on
        self._mem = Group.new(self.world_size) if on else Group(None, world_size=self.world_size)
        return MemoryTier(
            self.cfg,
            at,
            run_id=self.run_id,
            world_size=self.world_size,
            manifest_extra=self.manifest_extra,
            attempt=self.attempt,
            ctl=self._ctl,
            mem=self._mem,
            emit=self._emit,
            state=self.state,
            cadence=self.cadence,
            total_steps=self.total_steps,
        )

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
        rollbacks = int(self._ctl.bcast(rollbacks))
        self.memory.check_capacity()  # the RAM tier's bytes per node against free memory, once per attempt
        step = self.restore.newest(before_step=before_step, rollbacks=rollbacks)
        if before_step is not None and step > 0:
            self.fs_restore.abandon_above(step)
        return step

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
        self.memory.wait()
        self.committer.wait_retention()
        self.state.bind(model_parts, optimizers, lr_schedulers, train_state)
        self._unhook()
        if self._stager is not None:
            wait = self._stager.wait
            self._hooks = [opt.register_step_pre_hook(lambda *_: wait()) for opt in optimizers]
        if self.cfg.memory_on:  # and for the RAM tier's staging copy (checkpoint/memory_tier.py)
            staged = self.memory.wait_staged
            self._hooks += [opt.register_step_pre_hook(lambda *_: staged()) for opt in optimizers]

    def due(self, step: int, *, step_time_s: float | None = None) -> bool:
        """Whether `step` (just finished) should be saved: the last step, every `every_steps`, or
        when the auto interval (Young/Daly) has elapsed. Identical on all ranks."""
        if step_time_s is not None and step_time_s > 0:
            self.cadence.record_step(float(step_time_s), save_in_flight=self.committer.in_flight())
        return self.cfg.enabled and self.cadence.due(step, total_steps=self.total_steps)

    def save(self, step: int) -> None:
        """Writes checkpoint `step`. Blocks for the whole save (`none`), else only to hand the state to
        the staging thread (the optimizer's next step waits for that copy); a previous save still in
        flight is waited for first (and its failure raised)."""
        if self.state.objects is None:
            raise RuntimeError("CheckpointManager.save before load_latest: call load_latest(...) to bind the state")
        t0 = time.perf_counter()
        self.wait()
        tmp = self.folder / f"step_{step}.{self.attempt}.tmp"
        if self.cfg.lustre_stripe_count > 0:  # striping is set on the empty folder, before any rank writes
            if self.rank == 0:
                self.committer.prepare(tmp)
            self._ctl.barrier()
        sd = self.state.save_state_dict()
        blocking = self.committer.save(step, sd, tmp=tmp, t0=t0, written=lambda: self.cadence.started(step))
        self.cadence.saved(step, blocking, overlapped=self.cfg.async_mode != "none")

    @property
    def last_plan(self) -> dict[str, Any] | None:
        """The filesystem tier's last auto interval plan (checkpoint.interval=auto; None before one)."""
        return self.cadence.last_plan

    def memory_interval_steps(self) -> int:
        """The RAM tier's interval in steps (Cadence.memory_interval_steps)."""
        return self.cadence.memory_interval_steps()

    # ------------------------------------------------------------------ the RAM tier (checkpoint/memory_tier.py)

    @property
    def memory_root(self) -> Path:
        """The RAM tier's folder on this node: `checkpoint.memory_dir/meshjob-<run id>/<node>/`."""
        return self.memory.at.root

    def memory_due(self, step: int) -> bool:
        """Whether `step` (just finished) goes to the RAM tier (MemoryTier.due). Identical on all ranks."""
        return self.memory.due(step)

    def save_memory(self, step: int) -> None:
        """Saves this rank's state of `step` to the RAM tier and its partner copy (MemoryTier.save)."""
        self.memory.save(step)

    def wait_memory(self) -> None:
        """Blocks until the RAM save in flight (if any) is committed or recorded as failed."""
        self.memory.wait()

    def drop_memory(self) -> None:
        """Deletes this rank's RAM copies and the node's and run's folders once empty (MemoryTier.drop)."""
        self.memory.drop()

    def memory_available(self) -> int:
        """Bytes this host's checkpoint.memory_dir offers the RAM tier (memory_capacity.memory_available)."""
        return self.memory.available()

    @property
    def process_groups(self) -> list[dist.ProcessGroup]:
        """This manager's own process groups (the filesystem save's, the control's, the RAM tier's): their
        timeout is `checkpoint_timeout_s`."""
        return [g.pg for g in (self._io, self._ctl, self._mem) if g.pg is not None]

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed; raises CheckpointSaveError if it failed."""
        self.committer.wait()

    def close(self) -> None:
        """Waits for the last save and the retention pass, then releases the manager's threads and process groups."""
        try:
            self.wait()
        finally:
            try:
                self.memory.close()
            finally:
                self._mem.destroy()
            self.committer.close()
            self._unhook()
            if self._stager is not None:
                self._stager.close()  # frees the staging buffers
            self._stager = None
            self._io.destroy()
            self._ctl.destroy()

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ plumbing

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.rank == 0 and self._emit_fn is not None:
            self._emit_fn(kind, **fields)
