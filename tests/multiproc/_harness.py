"""A small FSDP2 + TP + PP training loop (all imports at the top: forked ranks share them) that exercises CheckpointManager the way the trainer will.

Randomness that touches the bits, so an RNG not restored shows up: the local batch rows are permuted
with the torch RNG (seeded per dp rank), rolled by a NumPy draw, and the loss is scaled by
1 + 1e-6 * random.random(). The data itself is a pure function of (seed, step), as in the trainer.
"""

from __future__ import annotations

import json
import os
import random
import signal
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from checkpoint import CheckpointConfig, CheckpointManager, TrainState
from jobs.events import EventLog

VOCAB, DIM, FFN, LAYERS, SEQ, GLOBAL_BATCH = 64, 32, 64, 2, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, FFN)
        self.w2 = nn.Linear(FFN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(F.silu(self.w1(self.norm(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for blk in self.layers.values():
            h = blk(h)
        return self.output(h) if self.output is not None else h


def build_model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: a learnable sequence (next = 5*prev+3 mod V) with 10% noise."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    seq = [start]
    for _ in range(SEQ):
        nxt = (5 * seq[-1] + 3) % VOCAB
        noise = torch.rand(nxt.shape, generator=g) < 0.1
        seq.append(torch.where(noise, torch.randint(0, VOCAB, nxt.shape, generator=g), nxt))
    toks = torch.cat(seq, dim=1)
    return toks[:, :-1], toks[:, 1:]


@dataclass
class Mesh:
    pp: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_shard * self.tp


def _parallelize(model: Net, mesh_cfg: Mesh, rank: int):
    """PP split -> TP -> FSDP2 (the order of notes section 5); returns (model, mesh coords)."""
    if mesh_cfg.world == 1:
        return model, None, {"pp": 0, "dp_shard": 0, "tp": 0}
    mesh = init_device_mesh(
        "cpu", (mesh_cfg.pp, mesh_cfg.dp_shard, mesh_cfg.tp), mesh_dim_names=("pp", "dp_shard", "tp")
    )
    coords = {n: mesh[n].get_local_rank() for n in ("pp", "dp_shard", "tp")}
    if mesh_cfg.pp > 1:
        per = LAYERS // mesh_cfg.pp
        keep = {str(i) for i in range(coords["pp"] * per, (coords["pp"] + 1) * per)}
        for name in list(model.layers.keys()):
            if name not in keep:
                del model.layers[name]
        if coords["pp"] != 0:
            model.tok_embeddings = None
        if coords["pp"] != mesh_cfg.pp - 1:
            model.output = None
    if mesh_cfg.tp > 1:
        plan: dict[str, Any] = {}
        if model.tok_embeddings is not None:
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        for name in model.layers:
            plan[f"layers.{name}.w1"] = ColwiseParallel()
            plan[f"layers.{name}.w2"] = RowwiseParallel()
        if model.output is not None:
            plan["output"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh["tp"], plan)
    dp_mesh = mesh["dp_shard"]
    for blk in model.layers.values():
        fully_shard(blk, mesh=dp_mesh, reshard_after_forward=mesh_cfg.pp == 1)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=mesh_cfg.pp == 1)
    return model, mesh, coords


def train(
    rank: int,
    world: int,
    *,
    run_dir: str,
    mesh: dict[str, int],
    steps: int,
    ckpt: dict[str, Any],
    seed: int = 0,
    kill_at_step: int | None = None,
    patch: str | None = None,
) -> dict[str, Any]:
    """Trains `steps` steps (resuming from run_dir when it has checkpoints); returns losses and params.

    kill_at_step: every rank SIGKILLs itself at the start of that step, once earlier saves committed.
    patch: a fault to inject inside the manager (see _inject).
    """
    mcfg = Mesh(**mesh)
    assert mcfg.world == world, (mcfg, world)
    run = Path(run_dir)
    model, dmesh, coords = _parallelize(build_model(seed), mcfg, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    pp_sched = None
    if mcfg.pp > 1:
        scale_box = [1.0]
        stage = PipelineStage(model, coords["pp"], mcfg.pp, torch.device("cpu"), group=dmesh.get_group("pp"))
        pp_sched = ScheduleGPipe(
            stage,
            n_microbatches=2,
            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)) * scale_box[0],
        )
    events = EventLog(run / "events.jsonl", rank=rank)
    cfg = CheckpointConfig(**ckpt)
    manager = CheckpointManager(
        run / "checkpoints",
        cfg=cfg,
        rank=rank,
        world_size=world,
        emit=events.emit,
        manifest_extra={"mesh": asdict(mcfg), "config_hash": "harness"},
        total_steps=steps,
        mtbf_s=3600.0,
    )
    _inject(manager, patch)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed + 1000 * coords["dp_shard"])
    state = TrainState()
    start = manager.load_latest(model_parts=[model], optimizers=[opt], lr_schedulers=[sched], train_state=state)
    is_last = coords["pp"] == mcfg.pp - 1
    losses: dict[int, float] = {}
    local = GLOBAL_BATCH // mcfg.dp_shard
    for step in range(start + 1, steps + 1):
        if kill_at_step is not None and step == kill_at_step:
            manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(seed, step)
        lo = coords["dp_shard"] * local
        x, y = x[lo : lo + local], y[lo : lo + local]
        perm = torch.randperm(local)
        shift = int(np.random.randint(local))
        x, y = x[perm].roll(shift, 0), y[perm].roll(shift, 0)
        scale = 1.0 + 1e-6 * random.random()
        if pp_sched is None:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1)) * scale
            loss.backward()
            local_loss = loss.detach()
        else:
            scale_box[0] = scale
            mb: list[torch.Tensor] = []
            if coords["pp"] == 0:
                pp_sched.step(x)
            elif is_last:
                pp_sched.step(target=y, losses=mb)
            else:
                pp_sched.step()
            local_loss = torch.stack(mb).mean().detach() if is_last else torch.zeros(())
        opt.step()
        sched.step()
        opt.zero_grad()
        contrib = local_loss.float() / mcfg.dp_shard if (is_last and coords["tp"] == 0) else torch.zeros(())
        if world > 1:
            dist.all_reduce(contrib)
        losses[step] = float(contrib)
        state.record(step=step, loss=losses[step], tokens=GLOBAL_BATCH * SEQ)
        if rank == 0:
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": losses[step]}) + "\n")
        if manager.due(step, step_time_s=0.01):
            manager.save(step)
    manager.close()
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        params[name] = full.detach().clone()
    return {
        "losses": losses,
        "params": params,
        "start": start,
        "state": state.state_dict(),
        "interval_steps": manager.cadence.interval_steps,
    }


def _inject(manager: CheckpointManager, patch: str | None) -> None:
    """Faults for the corruption tests, applied inside the forked rank only.

    kill_before_rename:<step>: SIGKILL every rank once the shards of <step> are written (tmp folder left);
    kill_before_manifest:<step>: SIGKILL every rank before the manifest of <step> is written;
    kill_after_manifest:<step>: SIGKILL every rank once the manifest of <step> is written, before the rename;
    stall_write:<step>: the last rank's writer stops after its first write of <step>'s shard, having
    written its pid to run_dir/stalled (for a test to kill it from outside).
    """
    if patch is None:
        return
    what, _, step_s = patch.partition(":")
    at = int(step_s)
    import checkpoint.commit as m

    if what == "kill_before_rename":
        orig = manager.committer.commit

        def commit(step, *a, **k):
            if step == at:
                fut = a[2]
                if fut is not None:
                    fut.result()
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(step, *a, **k)

        manager.committer.commit = commit
    elif what in ("kill_before_manifest", "kill_after_manifest"):
        orig_write = m.write_manifest

        def write(step_dir, body):
            if body["step"] == at and what == "kill_before_manifest":
                os.kill(os.getpid(), signal.SIGKILL)
            orig_write(step_dir, body)
            if body["step"] == at:
                os.kill(os.getpid(), signal.SIGKILL)

        m.write_manifest = write
    elif what == "stall_write":
        if manager.rank == manager.world_size - 1:
            _stall_writes(f"step_{at}.*.tmp")
    else:
        raise ValueError(patch)


def mesh_ckpt(**over: Any) -> dict[str, Any]:
    """Checkpoint config fields for the harness (plain dict, picklable across fork)."""
    return asdict(replace(CheckpointConfig(every_steps=0), **over))


def _stall_writes(folder_name: str) -> None:
    """Every file DCP opens for writing under a folder whose name matches the pattern `folder_name` stops after its first write,
    once this process's pid is in run_dir/stalled (the folder's grandparent)."""
    import contextlib
    import fnmatch
    import time

    from torch.distributed.checkpoint.filesystem import FileSystem

    orig = FileSystem.create_stream

    class Stalling:
        def __init__(self, f: Any, marker: Path) -> None:
            self.f, self.marker, self.name = f, marker, f.name

        def write(self, b: Any) -> int:
            n = self.f.write(b)
            self.f.flush()
            self.marker.write_text(str(os.getpid()))
            time.sleep(120)
            return n

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.f, attr)

    @contextlib.contextmanager
    def create_stream(fs, path, mode):
        with orig(fs, path, mode) as f:
            p = Path(path)
            yield Stalling(f, p.parent.parent.parent / "stalled") if fnmatch.fnmatch(p.parent.name, folder_name) else f

    FileSystem.create_stream = create_stream
