"""The RAM checkpoint tier: every `checkpoint.memory_every_steps` each rank writes its own state to node-local
memory, committed like the filesystem tier, and copies it to a partner rank on another node; a restart inside the
allocation reads it back when every rank holds the same step (`MemoryTier`, a part of CheckpointManager's).

Layout, one folder per node (`Placement.root` = `checkpoint.memory_dir/meshjob-<run id>/<node>/`, config.memory_root):
    rank_<r>/step_<N>.<attempt>.tmp/            a save in progress
    rank_<r>/step_<N>/                          committed by one rename: DCP files of rank r's local shards
                                                (`__0_0.distcp`, `.metadata`) and `manifest.json`, written last
    partner_of_rank_<s>/step_<N>/               rank s's committed folder of step N, copied here (another node)
                                                by rank s's partner, committed by its own rename, manifest last
Each rank's folder is self-contained: it is written with no_dist from the rank's local tensors (DTensors as
their local shards, nothing deduplicated across ranks), so rank r reloads it on the same mesh with nothing from
another rank or node, and it is the unit a partner copy sends to another node unchanged.

A save (async unless checkpoint.async_mode=none): the caller builds the state dict and hands it to a thread, which
first copies its tensors into CPU staging buffers (the next optimizer step waits for that copy in a step pre-hook,
as for the filesystem tier), then writes and fsyncs rank r's files (crc32 taken as written) -> its manifest (step,
rank, world size, mesh, run id, the saving attempt, sizes and crc32) -> rename to step_<N>; with
checkpoint.memory_replicas=1 every rank then sends its committed folder to its partner (the same local rank on the
next node, `partner.partner_ranks`) and commits the one it receives; then every rank reports both outcomes (one
all_gather, on a gloo group of the tier's own). Only when all committed does each rank delete its older steps
(own and partner copies), so two copies of each are held at most and some common step always survives a kill at
any point. A failed RAM save removes that step everywhere and training goes on: it is a cache, not the record.

Load: the lowest rank of each node lists the node's committed copies, own saves (`rank_<q>`) and partner copies
(`partner_of_rank_<q>`) of any rank q, whose manifest names this run, rank q, the world size and mesh; one
all_gather. Where each rank's copy is held does not depend on where the ranks run now: after a spare swap the
replaced ranks land on a node with no copy, the ring is recomputed over the new nodes, and ranks may move. A step
counts only when every rank can get a copy of its state from one and the same save (`partner.plan_memory_load`):
a copy on its own node is read in place (its own save first); else one rank of the holding node sends it (point
to point on the tier's group), checked by the holder and by the receiver, which commits it into its own folder
first (`tier: partner` when any rank read anything but its own save on its own node). A copy that fails its check
is left out and the step planned again; the restart weighs the step against the filesystem's newest
(checkpoint/restore.py). Copies in folders no rank of the node uses any more stay until the tier commits a step in the
new places (`Placement.stale_dirs`). The load's side is checkpoint/memory_restore.py (`MemoryRestore`).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from checkpoint.cadence import Cadence
from checkpoint.config import memory_root
from checkpoint.errors import describe_error
from checkpoint.flatread import read_into
from checkpoint.group import Group
from checkpoint.manifest import file_record, fsync_dir, step_dirs, write_manifest
from checkpoint.memory_capacity import check_capacity, memory_available, state_bytes
from checkpoint.memory_restore import MemoryRestore, complete_steps, local_steps
from checkpoint.partner import Placement, partner_ranks, replicas_for, shared_domains
from checkpoint.scavenge_commit import shard_geometry
from checkpoint.statedict import BoundState
from checkpoint.stream import stream_folder
from checkpoint.tiers import FILESYSTEM, MEMORY, PARTNER  # the `tier` of checkpoint_saved / checkpoint_loaded records
from checkpoint.writer import RecordingWriter

__all__ = [
    "MEMORY",
    "PARTNER",
    "FILESYSTEM",
    "MemoryTier",
    "complete_steps",
    "load_local",
    "local_steps",
    "place",
    "saved_keys",
]

log = logging.getLogger("meshjob.checkpoint")
# DCP warns on every no_dist save/load that it assumes one process: that is what the tier does, on any thread
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def place(cfg: Any, *, run_id: str, node: str, domain: str, rank: int, world_size: int, ctl: Group) -> Placement:
    """Where this rank's RAM copies go: the tier's folder on its node (the run's identity and the node in its path)
    and, when the tier is on, the partner ring over every rank's node and failure domain (`domain`: this node's
    leaf switch, else its physical host; "" unknown), checkpoint.memory_replicas. Collective on `ctl` when the tier
    is on; raises CheckpointConfigError alike on every rank."""
    root = memory_root(cfg.memory_dir, run_id) / node
    if not cfg.enabled or not cfg.memory_on:
        return Placement(root, rank=rank, node=node, nodes=[node])
    gathered = ctl.all_gather((node, domain))
    nodes, domains = [n for n, _ in gathered], [d for _, d in gathered]
    replicas = replicas_for(cfg.memory_replicas, nodes=len(set(nodes)), memory_on=cfg.memory_on)
    partners = partner_ranks(nodes, domains) if replicas else list(range(world_size))
    shared = shared_domains(nodes, partners, domains) if replicas else []
    if shared and rank == 0:
        log.warning(
            "partner copies stay in their failure domain (same physical host or leaf switch): %s; a failure "
            "there loses both copies (the filesystem tier covers it)",
            ", ".join(f"{a} -> {b}" for a, b in shared),
        )
    sources = [partners.index(r) for r in range(world_size)]
    return Placement(root, rank=rank, node=node, nodes=nodes, partners=partners, sources=sources, replicas=replicas)


class MemoryTier:
    """The RAM tier of one rank placed at `at`: when it saves, its saves of the bound state (in a thread of its own),
    their commit and retirement, the restart's read (a `MemoryRestore`) into the bound state, the capacity check and
    the cleanup. A copy's manifest names this run (`run_id`), the world size, `manifest_extra`'s mesh and config hash
    and the saving `attempt`. `ctl`: the group the ranks agree on at load; `mem`: the tier's own group (the background
    commit, the partner copies); `emit(kind, **fields)`: the ledger (rank 0's); `state`: the objects saved and loaded
    (BoundState, bound by the manager's load); `cadence`: the tier's interval (Cadence.memory_interval_steps, set anew
    from the saves' costs); `total_steps`: the run's last step (never a RAM save: the filesystem saves it). Holds its
    save in flight, staging buffers and last saved step."""

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
        emit: Callable[..., None],
        state: BoundState,
        cadence: Cadence,
        total_steps: int | None,
    ) -> None:
        self.cfg, self.at, self._run_id, self._world_size, self._attempt = cfg, at, run_id, world_size, attempt
        self._mesh, self._config_hash = manifest_extra.get("mesh"), manifest_extra.get("config_hash")
        self._ctl, self._mem, self._emit = ctl, mem, emit
        self._state, self._cadence, self._total_steps = state, cadence, total_steps
        self._capacity_checked = False
        self._restore = MemoryRestore(
            cfg,
            at,
            run_id=run_id,
            world_size=world_size,
            manifest_extra=manifest_extra,
            attempt=attempt,
            ctl=ctl,
            mem=mem,
        )
        self.last_step = 0  # the step of the last RAM save started (or the step loaded)
        self._cost: tuple[int, float] | None = None  # (step, agreed cost) of the last committed RAM save
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-memory")
        self._pending: Future | None = None
        self._staged: threading.Event | None = None  # set once the save in flight has copied its tensors
        self._buffers: dict[str, torch.Tensor] = {}  # CPU staging buffers, reused by every later save

    # ------------------------------------------------------------------ the load's side

    def candidates(self, *, rollbacks: int) -> list[int]:
        """The steps complete in the tier that know `rollbacks` rollbacks, newest first (MemoryRestore.candidates)."""
        return self._restore.candidates(rollbacks=rollbacks)

    def validate(self, step: int) -> tuple[Path, list[str], dict[str, Any] | None, str]:
        """This rank's folder of `step`, the problems (agreed), its manifest and the tier (MemoryRestore.validate)."""
        return self._restore.validate(step)

    @property
    def partner_used(self) -> list[int]:
        """The ranks that read a partner copy in the step validated last."""
        return self._restore.partner_used

    def load(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Reads this rank's RAM folder `d` (validated: `validate`) into the bound objects (same mesh only: the
        candidates are filtered so); no collective (the caller agrees on the outcome)."""
        part_keys: list[list[str]] = []
        sd = self._state.state_dict(saved_keys(d), part_keys)
        info = self._state.apply_loaded(load_local(d, sd), part_keys, resharded=False)
        used = self.partner_used
        return {**info, "partner_ranks": used} if used else info

    def check_capacity(self) -> None:
        """Collective, once per attempt (the first load): whether every host holds the tier with the bound state's
        bytes (memory_capacity.check_capacity)."""
        if self._capacity_checked:
            return
        assert self._state.objects is not None
        check_capacity(self.cfg, self.at, nbytes=state_bytes(self._state.objects), ctl=self._ctl)
        self._capacity_checked = True

    def available(self) -> int:
        """Bytes this host's checkpoint.memory_dir offers the tier (memory_capacity.memory_available)."""
        return memory_available(self.at.root)

    # ------------------------------------------------------------------ the save's side

    def due(self, step: int) -> bool:
        """Whether `step` (just finished) goes to the tier: every checkpoint.memory_every_steps, or once the tier's
        own interval (memory_interval=auto, Cadence.memory_interval_steps) has passed since its last save; never the
        last step (the filesystem tier always saves that one). Identical on all ranks."""
        if self.cfg.memory_interval == "auto" and self._cadence.memory_steps is None:
            self.wait()  # the measuring save, if in flight: its cost sets the interval (every rank alike)
            self._settle_interval()
        n, last = self._cadence.memory_interval_steps(), self.last_step
        if not self.cfg.enabled or n <= 0 or step <= last:
            return False
        fixed = self.cfg.memory_interval == "steps"
        if (step % n) if fixed else (step - last < n):
            return False
        return self._total_steps is None or step < self._total_steps

    def save(self, step: int) -> None:
        """Saves this rank's bound state of `step` and its partner copy. Blocks only to build the state dict and hand
        it to the tier's thread (checkpoint.async_mode=none: for the whole save); the next optimizer step waits for
        the staging copy. A failure is recorded (`checkpoint_failed`, tier memory) and the step removed on every
        rank; training goes on."""
        if self._state.objects is None:
            raise RuntimeError(
                "CheckpointManager.save_memory before load_latest: call load_latest(...) to bind the state"
            )
        t0 = time.perf_counter()
        self.wait()
        self._settle_interval()
        if self._state.stager is not None:  # the cached state dict is the filesystem save's too: its staging reads it
            self._state.stager.wait()
        # the structure built once (BoundState.save_state_dict), as the filesystem save's: only the staging copy left
        self.submit(step, self._state.save_state_dict, rollbacks=self._rollbacks_in_state(), t0=t0)
        if self.cfg.async_mode == "none":
            self._settle_interval()  # its cost sets the next gap at once (async: at the next RAM save)

    def _rollbacks_in_state(self) -> int:
        """The rollback records the bound train state holds (`TrainState.health["rollbacks"]`, jobs/failure/spike.py):
        the timeline a RAM step belongs to, in its manifest."""
        health = getattr((self._state.objects or {}).get("train_state"), "health", None) or {}
        return len(health.get("rollbacks", []))

    def _settle_interval(self) -> None:
        """memory_interval=auto: the interval from the last committed RAM save's cost, on the training thread and
        only right after `wait` (so at the same step on every rank: `Cadence.retune_memory` is a collective, and the
        background save may finish at different moments on different ranks)."""
        cost = self.take_cost()
        if cost is not None:
            self._cadence.retune_memory(*cost)

    def take_cost(self) -> tuple[int, float] | None:
        """(step, agreed cost in s) of the RAM save committed since the last call, once; None when none was. Call it
        right after `wait`, on the training thread (the same step on every rank)."""
        cost, self._cost = self._cost, None
        return cost

    def submit(self, step: int, state_dict: Callable[[], dict[str, Any]], *, rollbacks: int, t0: float) -> None:
        """Saves this rank's state of `step` (`state_dict()`, built here; `rollbacks`: the rollback records the state
        knows, `t0`: perf_counter when the save was asked for) and its partner copy, in the tier's thread (on the
        caller's with checkpoint.async_mode=none); call `wait` first. A failure is recorded (`checkpoint_failed`,
        tier memory) and the step removed on every rank; training goes on."""
        self.last_step = step
        sd = state_dict()
        tree, shards = _local_tree(sd), shard_geometry(sd)  # where the shards lie: for a flush (scavenge)
        if self.cfg.async_mode == "none":
            self._job(step, tree, shards, rollbacks, t0, None, None)
            return
        self._staged = threading.Event()
        self._pending = self._pool.submit(
            self._job, step, tree, shards, rollbacks, t0, time.perf_counter() - t0, self._staged
        )

    def wait(self) -> None:
        """Blocks until the RAM save in flight (if any) is committed or recorded as failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_staged(self) -> None:
        """For an optimizer step pre-hook: the RAM save in flight has copied the tensors this step changes."""
        staged = self._staged
        if staged is not None:
            staged.wait()

    def _job(
        self,
        step: int,
        tree: dict[str, Any],
        shards: dict[str, list[list[int]]],
        rollbacks: int,
        t0: float,
        blocking: float | None,
        staged: threading.Event | None,
    ) -> None:
        """One RAM save: stage, write and commit this rank's folder, exchange partner copies, agree, retire."""
        err, nbytes = None, 0
        try:
            if staged is not None:
                try:
                    tree = self._stage(tree)
                finally:
                    staged.set()
            nbytes = self._write(step, tree, shards=shards, rollbacks=rollbacks)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = describe_error(e, self.at.root)
        perr = self._copy_to_partner(step, sent=err is None) if self.at.replicas else None
        if blocking is None:
            blocking = time.perf_counter() - t0
        gathered = self._mem.all_gather((err, perr, nbytes, blocking))
        errors = [f"rank {r}: {e}" for r, (e, _, _, _) in enumerate(gathered) if e]
        errors += [f"rank {r}: partner copy: {p}" for r, (_, p, _, _) in enumerate(gathered) if p]
        if errors:
            self._failed(step, errors)
            return
        self._retire(keep=step)
        self._cost = (step, max(g[3] for g in gathered))  # agreed; memory_interval=auto applies it (main thread)
        self._emit(
            "checkpoint_saved",
            step=step,
            tier=MEMORY,
            path=str(self.at.root.parent),
            bytes=sum(g[2] for g in gathered),
            replicas=self.at.replicas,
            blocking_s=round(max(g[3] for g in gathered), 4),
            total_s=round(time.perf_counter() - t0, 4),
        )

    def _failed(self, step: int, errors: list[str]) -> None:
        """A RAM save some rank did not commit: removed on every rank (never a step some rank lacks), recorded."""
        shutil.rmtree(self.at.rank_dir / f"step_{step}", ignore_errors=True)
        if self.at.replicas:
            shutil.rmtree(self.at.held_dir / f"step_{step}", ignore_errors=True)
        self._emit("checkpoint_failed", step=step, tier=MEMORY, error="; ".join(errors)[:2000])
        if self.at.rank == 0:
            log.warning("RAM checkpoint of step %d not committed (training goes on): %s", step, errors[0])

    def _stage(self, tree: Any, path: str = "") -> Any:
        """`tree` with every tensor copied into this rank's CPU staging buffer of its place (made on first use)."""
        if isinstance(tree, dict):
            return {k: self._stage(v, f"{path}/{k}") for k, v in tree.items()}
        if not isinstance(tree, torch.Tensor):
            return tree
        buf = self._buffers.get(path)
        if buf is None or buf.shape != tree.shape or buf.dtype != tree.dtype:
            buf = self._buffers[path] = torch.empty(tree.shape, dtype=tree.dtype, device="cpu", pin_memory=tree.is_cuda)
        with torch.no_grad():
            buf.copy_(tree)
        return buf

    def _write(self, step: int, tree: dict[str, Any], *, shards: dict[str, list[list[int]]], rollbacks: int) -> int:
        """Writes and commits this rank's step folder (see the module docstring); returns its bytes. `shards`: the
        state's DTensor shards, `rollbacks`: the timeline the step belongs to (both in its manifest)."""
        d = self.at.rank_dir
        tmp, final = d / f"step_{step}.{self._attempt}.tmp", d / f"step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        d.mkdir(parents=True, exist_ok=True)
        writer = RecordingWriter(tmp, thread_count=1)
        with torch.no_grad():
            dcp.save(tree, storage_writer=writer, no_dist=True)
        files = dict(writer.records)
        for p in sorted(tmp.iterdir()):
            if p.name not in files:
                files[p.name] = file_record(p)
        nbytes = sum(f["size"] for f in files.values())
        write_manifest(
            tmp,
            {
                "step": step,
                "time": time.time(),
                "tier": MEMORY,
                "run_id": self._run_id,
                "rank": self.at.rank,
                "world_size": self._world_size,
                "attempt": self._attempt,
                "mesh": self._mesh,
                "config_hash": self._config_hash,
                "rollbacks": rollbacks,
                "shards": shards,  # {fqn: [global size, global offset]}: checkpoint/scavenge.py
                "node": self.at.node,
                "files": files,
                "bytes": nbytes,
            },
        )
        if final.exists():  # this rank's copy of the same step from an earlier attempt: the new save replaces it
            shutil.rmtree(final)
        tmp.rename(final)  # the commit of this rank's share
        fsync_dir(d)
        return nbytes

    def _copy_to_partner(self, step: int, *, sent: bool) -> str | None:
        """Sends this rank's committed folder of `step` to its partner and commits the one its source sends, file by
        file in chunks (checkpoint/stream.py: two chunk buffers of process memory, never the folder), point-to-point
        on the tier's group; every rank takes part, with nothing to send after a failed write. Returns what went
        wrong here, or None."""
        at = self.at
        src = at.sources[at.rank]
        try:
            got = stream_folder(
                at.rank_dir / f"step_{step}" if sent else None,
                send_to=at.partners[at.rank],
                recv_from=src,
                tmp=at.held_dir / f"step_{step}.{self._attempt}.tmp",
                final=at.held_dir / f"step_{step}",
                step=step,
                pg=self._mem.pg,
            )
        except Exception as e:  # noqa: BLE001 - agreed on by the caller
            return describe_error(e, at.root)
        return None if got is not None else f"rank {src} sent no copy of step {step}"

    # ------------------------------------------------------------------ cleanup

    def _retire(self, *, keep: int) -> None:
        """Deletes this rank's RAM steps (own and held partner copies) other than `keep`, and leftover temporary
        folders; the node's speaker also the folders no rank of the node uses now (every rank's copy of `keep` is
        committed where the ranks are placed now)."""
        for d in (self.at.rank_dir, *([self.at.held_dir] if self.at.replicas else [])):
            if d.is_dir():
                for p in d.iterdir():
                    if p.name != f"step_{keep}":
                        shutil.rmtree(p, ignore_errors=True)
        for d in self.at.stale_dirs():
            shutil.rmtree(d, ignore_errors=True)

    def after_load(self, step: int) -> None:
        """After any load: this rank's RAM steps newer than the loaded one (incomplete, or of an abandoned
        timeline) and leftover temporary folders are deleted, own and held partner copies (and on the node's
        speaker, those in the node's folders no rank uses now); older complete ones stay until the next commit."""
        self.last_step = step
        if not self.cfg.memory_on:
            return
        for d in (self.at.rank_dir, *([self.at.held_dir] if self.at.replicas else []), *self.at.stale_dirs()):
            for s, p in step_dirs(d):
                if s > step:
                    shutil.rmtree(p, ignore_errors=True)
            for p in d.glob("step_*.tmp") if d.is_dir() else []:
                shutil.rmtree(p, ignore_errors=True)

    def drop(self) -> None:
        """Deletes this rank's RAM copies (own and held partner copies, once the save in flight is over), and the
        node's and the run's folders once empty (the run finished or stopped with its state on the filesystem
        tier). Best effort: a failure is only logged."""
        if not self.cfg.memory_on:
            return
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - the copies go anyway
            log.warning("RAM save in flight failed on rank %d: %s", self.at.rank, e)
        shutil.rmtree(self.at.rank_dir, ignore_errors=True)
        if self.at.replicas:
            shutil.rmtree(self.at.held_dir, ignore_errors=True)
        for d in self.at.stale_dirs():
            shutil.rmtree(d, ignore_errors=True)
        for d in (self.at.root, self.at.root.parent):
            try:
                d.rmdir()
            except OSError:
                pass  # another rank of this node still has its folder there, or it is gone already

    def close(self) -> None:
        """Waits for the RAM save in flight, then releases the tier's thread and staging buffers (its groups are
        the caller's)."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._buffers = {}


def load_local(d: Path, sd: dict[str, Any]) -> dict[str, Any]:
    """Reads one rank's RAM folder `d` into the state dict `sd` (built from the bound objects for `d`'s keys, same
    mesh only) in place; returns the dict to apply (BoundState.apply_loaded). The folder is this rank's own no_dist
    save, so it is read without DCP's load: each tensor's bytes are copied from the mapped file into the tensor the
    state already holds (checkpoint/flatread.py)."""
    local = _local_tree(sd)  # DTensors as their local shards: views of the same storage, loaded in place
    return _keep_dtensors(sd, read_into(d, local))


def saved_keys(d: Path) -> set[str]:
    """The state-dict keys of one rank's RAM folder `d`."""
    return set(FileSystemReader(str(d)).read_metadata().state_dict_metadata)


def _local_tree(obj: Any) -> Any:
    """The same nested dict with every DTensor replaced by its local shard (detached, same storage)."""
    if isinstance(obj, dict):
        return {k: _local_tree(v) for k, v in obj.items()}
    if isinstance(obj, DTensor):
        return obj.to_local().detach()
    return obj


def _keep_dtensors(sd: Any, loaded: Any) -> Any:
    """`sd`'s tensors (filled in place through their local views) with `loaded`'s non-tensor values (DCP
    replaces those in the dict it loads into)."""
    if isinstance(sd, dict):
        return {k: _keep_dtensors(v, loaded[k]) for k, v in sd.items()}
    return sd if isinstance(sd, torch.Tensor) else loaded
