"""The RAM checkpoint tier: every `checkpoint.memory_every_steps` each rank writes its own state to node-local
memory, committed like the filesystem tier, and copies it to a partner rank on another node; a restart inside the
allocation reads it back when every rank holds the same step (CheckpointManager's memory half).

Layout, one folder per node (`self.memory_root` = `checkpoint.memory_dir/meshjob-<run id>/<node>/`, config.memory_root):
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
is left out and the step planned again; the manager weighs the step against the filesystem's newest
(`_restore_newest`). Copies in folders no rank of the node uses any more stay until the tier commits a step in the
new places (`_stale_dirs`). The load's side is checkpoint/memory_restore.py.
"""

from __future__ import annotations

import logging
import platform
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from checkpoint.config import memory_root
from checkpoint.errors import describe_error
from checkpoint.manifest import ManifestError, file_record, fsync_dir, read_manifest, step_dirs, write_manifest
from checkpoint.partner import (
    MemoryLoad,
    folder_rank,
    partner_ranks,
    replicas_for,
    shared_domains,
)
from checkpoint.scavenge_commit import shard_geometry
from checkpoint.stream import stream_folder
from checkpoint.tiers import FILESYSTEM, MEMORY, PARTNER  # the `tier` of checkpoint_saved / checkpoint_loaded records
from checkpoint.writer import RecordingWriter

__all__ = ["MEMORY", "PARTNER", "FILESYSTEM", "MemoryTierMixin", "complete_steps", "local_steps"]

log = logging.getLogger("meshjob.checkpoint")
# DCP warns on every no_dist save/load that it assumes one process: that is what the tier does, on any thread
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


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


class MemoryTierMixin:
    """CheckpointManager's methods of the RAM tier (`self.memory_root`, `self.run_id`, `self.cfg`, `self.rank`,
    `self.world_size`, `self.attempt`, `self.manifest_extra`, `self._ctl_pg`, `self._emit`, `self._all_gather`,
    `self.state`: the bound objects)."""

    def _init_memory_tier(self, run_id: str, node: str) -> None:
        """The RAM tier's folder on this node (the run's identity and the node in its path); no collective."""
        self.run_id = run_id
        self.node = node or platform.node()
        self.memory_root = memory_root(self.cfg.memory_dir, run_id) / self.node
        self._last_memory_step = 0
        self._capacity_checked = False
        self._memory_cost: tuple[int, float] | None = None  # (step, agreed cost) of the last committed RAM save
        self._mem_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-memory")
        self._mem_pending: Future | None = None
        self._mem_staged: threading.Event | None = None  # set once the save in flight has copied its tensors
        self._mem_buffers: dict[str, torch.Tensor] = {}  # CPU staging buffers, reused by every later save
        self._memory_plan: dict[int, MemoryLoad] = {}
        self._held: dict[str, dict[str, dict[int, str]]] = {}  # every node's committed copies, as listed at load
        self._partner_used: list[int] = []
        self._nodes = [self.node]  # every rank's node (_init_partners)
        self._replicas, self._partners, self._sources, self._mem_pg = 0, [], [], None
        self._save_shards: dict[str, list[list[int]]] = {}  # the RAM save in flight's DTensor shards (its manifest)
        self._save_rollbacks = 0  # rollbacks the bound state knows at the RAM save in flight (its manifest)
        self._known_rollbacks = 0  # rollbacks the run knows at a load (load_latest): fewer = a stale RAM step

    def _rollbacks_in_state(self) -> int:
        """The rollback records the bound train state holds (`TrainState.health["rollbacks"]`, jobs/failure/spike.py)."""
        health = getattr((self.state.objects or {}).get("train_state"), "health", None) or {}
        return len(health.get("rollbacks", []))

    def _init_partners(self) -> None:
        """Collective: the nodes of all ranks -> the partner ring (checkpoint.memory_replicas), and the tier's own
        gloo group for its background commit. Raises CheckpointConfigError alike on every rank."""
        if not self.cfg.enabled or not self.cfg.memory_on:
            return
        gathered = self._all_gather((self.node, self.domain), self._ctl_pg)
        self._nodes = nodes = [n for n, _ in gathered]
        domains = [d for _, d in gathered]
        self._replicas = replicas_for(self.cfg.memory_replicas, nodes=len(set(nodes)), memory_on=self.cfg.memory_on)
        self._partners = partner_ranks(nodes, domains) if self._replicas else list(range(self.world_size))
        shared = shared_domains(nodes, self._partners, domains) if self._replicas else []
        if shared and self.rank == 0:
            log.warning(
                "partner copies stay in their failure domain (same physical host or leaf switch): %s; a failure "
                "there loses both copies (the filesystem tier covers it)",
                ", ".join(f"{a} -> {b}" for a, b in shared),
            )
        self._sources = [self._partners.index(r) for r in range(self.world_size)]
        self._mem_pg = dist.new_group(backend="gloo") if self._dist else None

    @property
    def _rank_dir(self) -> Path:
        return self.memory_root / f"rank_{self.rank}"

    @property
    def _held_dir(self) -> Path:
        """The partner copies this rank holds: those of the rank whose partner it is."""
        return self.memory_root / f"partner_of_rank_{self._sources[self.rank]}"

    @property
    def _speaker(self) -> bool:
        """Whether this rank lists and tidies its node's folder for the node: the node's lowest rank."""
        return self._nodes.index(self.node) == self.rank

    def _stale_dirs(self) -> list[Path]:
        """On the node's speaker: the node's folders that no rank there saves into or holds partner copies in now
        (copies from before the ranks were placed as they are: a spare swap); [] on the other ranks."""
        if not self._speaker or not self.memory_root.is_dir():
            return []
        here = [r for r, n in enumerate(self._nodes) if n == self.node]
        used = {f"rank_{r}" for r in here}
        if self._replicas:
            used |= {f"partner_of_rank_{self._sources[r]}" for r in here}
        return [p for p in sorted(self.memory_root.iterdir()) if folder_rank(p.name) is not None and p.name not in used]

    def memory_due(self, step: int) -> bool:
        """Whether `step` (just finished) goes to the RAM tier: every checkpoint.memory_every_steps, or once the tier's
        own interval (memory_interval=auto, CheckpointManager.memory_interval_steps) has passed since its last save;
        never the last step (the filesystem tier always saves that one). Identical on all ranks."""
        if self.cfg.memory_interval == "auto" and self.cadence.memory_steps is None:
            self.wait_memory()  # the measuring save, if in flight: its cost sets the interval (every rank alike)
            self._settle_memory_interval()
        n = self.cadence.memory_interval_steps()
        if not self.cfg.enabled or n <= 0 or step <= self._last_memory_step:
            return False
        fixed = self.cfg.memory_interval == "steps"
        if (step % n) if fixed else (step - self._last_memory_step < n):
            return False
        return self.total_steps is None or step < self.total_steps

    def save_memory(self, step: int) -> None:
        """Saves this rank's state of `step` to the RAM tier (and its partner copy). Blocks only to build the
        state dict and hand it to the tier's thread (checkpoint.async_mode=none: for the whole save); the next
        optimizer step waits for the staging copy. A failure is recorded (`checkpoint_failed`, tier memory) and
        the step removed on every rank; training goes on."""
        if self.state.objects is None:
            raise RuntimeError(
                "CheckpointManager.save_memory before load_latest: call load_latest(...) to bind the state"
            )
        t0 = time.perf_counter()
        self.wait_memory()
        self._settle_memory_interval()
        self._last_memory_step = step
        sd = self.state.state_dict()
        tree, self._save_shards = _local_tree(sd), shard_geometry(sd)  # where the shards lie: for a flush (scavenge)
        self._save_rollbacks = self._rollbacks_in_state()  # the timeline the step belongs to, in its manifest
        if self.cfg.async_mode == "none":
            self._memory_job(step, tree, t0, None, None)
            self._settle_memory_interval()  # its cost sets the next gap at once (async: at the next RAM save)
            return
        self._mem_staged = threading.Event()
        self._mem_pending = self._mem_pool.submit(
            self._memory_job, step, tree, t0, time.perf_counter() - t0, self._mem_staged
        )

    def _settle_memory_interval(self) -> None:
        """memory_interval=auto: the interval from the last committed RAM save's cost, on the training thread and
        only right after wait_memory (so at the same step on every rank: `Cadence.retune_memory` is a collective, and the
        background save may finish at different moments on different ranks)."""
        cost, self._memory_cost = self._memory_cost, None
        if cost is not None:
            self.cadence.retune_memory(*cost)

    def wait_memory(self) -> None:
        """Blocks until the RAM save in flight (if any) is committed or recorded as failed."""
        pending, self._mem_pending = self._mem_pending, None
        if pending is not None:
            pending.result()

    def _wait_memory_staged(self) -> None:
        """An optimizer step pre-hook: the RAM save in flight has copied the tensors this step changes."""
        staged = self._mem_staged
        if staged is not None:
            staged.wait()

    def _memory_job(
        self, step: int, tree: dict[str, Any], t0: float, blocking: float | None, staged: threading.Event | None
    ) -> None:
        """One RAM save: stage, write and commit this rank's folder, exchange partner copies, agree, retire."""
        err, nbytes = None, 0
        try:
            if staged is not None:
                try:
                    tree = self._stage(tree)
                finally:
                    staged.set()
            nbytes = self._write_memory(step, tree)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = describe_error(e, self.memory_root)
        perr = self._copy_to_partner(step, sent=err is None) if self._replicas else None
        if blocking is None:
            blocking = time.perf_counter() - t0
        gathered = self._all_gather((err, perr, nbytes, blocking), self._mem_pg)
        errors = [f"rank {r}: {e}" for r, (e, _, _, _) in enumerate(gathered) if e]
        errors += [f"rank {r}: partner copy: {p}" for r, (_, p, _, _) in enumerate(gathered) if p]
        if errors:  # never a step some rank lacks
            shutil.rmtree(self._rank_dir / f"step_{step}", ignore_errors=True)
            if self._replicas:
                shutil.rmtree(self._held_dir / f"step_{step}", ignore_errors=True)
            self._emit("checkpoint_failed", step=step, tier=MEMORY, error="; ".join(errors)[:2000])
            if self.rank == 0:
                log.warning("RAM checkpoint of step %d not committed (training goes on): %s", step, errors[0])
            return
        self._retire_memory(keep=step)
        self._memory_cost = (step, max(g[3] for g in gathered))  # agreed; memory_interval=auto applies it (main thread)
        self._emit(
            "checkpoint_saved",
            step=step,
            tier=MEMORY,
            path=str(self.memory_root.parent),
            bytes=sum(g[2] for g in gathered),
            replicas=self._replicas,
            blocking_s=round(max(g[3] for g in gathered), 4),
            total_s=round(time.perf_counter() - t0, 4),
        )

    def _stage(self, tree: Any, path: str = "") -> Any:
        """`tree` with every tensor copied into this rank's CPU staging buffer of its place (made on first use)."""
        if isinstance(tree, dict):
            return {k: self._stage(v, f"{path}/{k}") for k, v in tree.items()}
        if not isinstance(tree, torch.Tensor):
            return tree
        buf = self._mem_buffers.get(path)
        if buf is None or buf.shape != tree.shape or buf.dtype != tree.dtype:
            buf = self._mem_buffers[path] = torch.empty(
                tree.shape, dtype=tree.dtype, device="cpu", pin_memory=tree.is_cuda
            )
        with torch.no_grad():
            buf.copy_(tree)
        return buf

    def _write_memory(self, step: int, tree: dict[str, Any]) -> int:
        """Writes and commits this rank's step folder (see the module docstring); returns its bytes."""
        d = self._rank_dir
        tmp, final = d / f"step_{step}.{self.attempt}.tmp", d / f"step_{step}"
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
                "run_id": self.run_id,
                "rank": self.rank,
                "world_size": self.world_size,
                "attempt": self.attempt,
                "mesh": self.manifest_extra.get("mesh"),
                "config_hash": self.manifest_extra.get("config_hash"),
                "rollbacks": self._save_rollbacks,
                "shards": self._save_shards,  # {fqn: [global size, global offset]}: checkpoint/scavenge.py
                "node": self.node,
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
        src = self._sources[self.rank]
        try:
            got = stream_folder(
                self._rank_dir / f"step_{step}" if sent else None,
                send_to=self._partners[self.rank],
                recv_from=src,
                tmp=self._held_dir / f"step_{step}.{self.attempt}.tmp",
                final=self._held_dir / f"step_{step}",
                step=step,
                pg=self._mem_pg,
            )
        except Exception as e:  # noqa: BLE001 - agreed on by the caller
            return describe_error(e, self.memory_root)
        return None if got is not None else f"rank {src} sent no copy of step {step}"

    def _retire_memory(self, *, keep: int) -> None:
        """Deletes this rank's RAM steps (own and held partner copies) other than `keep`, and leftover temporary
        folders; the node's speaker also the folders no rank of the node uses now (every rank's copy of `keep` is
        committed where the ranks are placed now)."""
        for d in (self._rank_dir, *([self._held_dir] if self._replicas else [])):
            if d.is_dir():
                for p in d.iterdir():
                    if p.name != f"step_{keep}":
                        shutil.rmtree(p, ignore_errors=True)
        for d in self._stale_dirs():
            shutil.rmtree(d, ignore_errors=True)

    def _load_memory(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Reads this rank's RAM folder into the bound objects (same mesh only: the candidates are filtered so)."""
        md_keys = set(FileSystemReader(str(d)).read_metadata().state_dict_metadata)
        part_keys: list[list[str]] = []
        sd = self.state.state_dict(md_keys, part_keys)
        local = _local_tree(sd)  # DTensors as their local shards: views of the same storage, loaded in place
        with torch.no_grad():
            dcp.load(local, checkpoint_id=str(d), no_dist=True)
        info = self.state.apply_loaded(_keep_dtensors(sd, local), part_keys, resharded=False)
        return {**info, "partner_ranks": self._partner_used} if self._partner_used else info

    def _after_load_memory(self, step: int) -> None:
        """After any load: this rank's RAM steps newer than the loaded one (incomplete, or of an abandoned
        timeline) and leftover temporary folders are deleted, own and held partner copies (and on the node's
        speaker, those in the node's folders no rank uses now); older complete ones stay until the next commit."""
        self._last_memory_step = step
        if not self.cfg.memory_on:
            return
        for d in (self._rank_dir, *([self._held_dir] if self._replicas else []), *self._stale_dirs()):
            for s, p in step_dirs(d):
                if s > step:
                    shutil.rmtree(p, ignore_errors=True)
            for p in d.glob("step_*.tmp") if d.is_dir() else []:
                shutil.rmtree(p, ignore_errors=True)

    def drop_memory(self) -> None:
        """Deletes this rank's RAM copies (own and held partner copies, once the save in flight is over), and the
        node's and the run's folders once empty (the run finished or stopped with its state on the filesystem
        tier). Best effort: a failure is only logged."""
        if not self.cfg.memory_on:
            return
        try:
            self.wait_memory()
        except Exception as e:  # noqa: BLE001 - the copies go anyway
            log.warning("RAM save in flight failed on rank %d: %s", self.rank, e)
        shutil.rmtree(self._rank_dir, ignore_errors=True)
        if self._replicas:
            shutil.rmtree(self._held_dir, ignore_errors=True)
        for d in self._stale_dirs():
            shutil.rmtree(d, ignore_errors=True)
        for d in (self.memory_root, self.memory_root.parent):
            try:
                d.rmdir()
            except OSError:
                pass  # another rank of this node still has its folder there, or it is gone already

    def _close_memory(self) -> None:
        """Waits for the RAM save in flight, then releases the tier's thread, staging buffers and group."""
        try:
            self.wait_memory()
        finally:
            self._mem_pool.shutdown(wait=True)
            self._mem_buffers = {}
            if self._mem_pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._mem_pg)
            self._mem_pg = None


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
