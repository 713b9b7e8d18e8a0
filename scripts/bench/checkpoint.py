"""Checkpoint benchmark: B2 training time lost per async save / sync save, B3 checkpoint/raw-disk write throughput, B4 resume/(load + step), in one run.

    python scripts/bench/checkpoint.py [--ranks 2] [--dim 1024] [--layers 4] [--dir /tmp/ckbench] [--out bench.jsonl]

Every rank holds an FSDP2 shard of an MLP stack trained by AdamW (state = 3x params). Baselines are
measured in the same run on the same filesystem: a synchronous `async_mode=none` save (B2's denominator
and B3's numerator), the same bytes written with os.write + fsync per rank in parallel (B3), and, in a
fresh launch of its own like the resume's, the bare DCP resume (get_state_dict + dcp.load +
set_state_dict) of the same checkpoint plus the first step (B4). B2's numerator: in the same ranks,
rounds of two blocks of --b2-steps training steps each, one plain and one that starts with an async
(`thread`) save and ends once that save is committed (the order alternates by round); the median over
rounds of (save block - plain block). The manager runs with the default config (verify=checksum).
Prints the ratios and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Everything is imported once here, before forking the ranks (a lazy import per rank costs seconds).
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402


def _model(dim: int, layers: int, world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for lin in model:
            fully_shard(lin, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, dim: int) -> float:
    t0 = time.perf_counter()
    x = torch.randn(16, dim)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _b2_blocks(model, opt, a: argparse.Namespace, root: Path, rank: int, world: int) -> dict[str, list[float]]:
    """Per round, the time of --b2-steps steps with no save and of --b2-steps steps that begin with an
    async save and end with it committed (wait() included, so a write the steps did not hide counts)."""
    ck = _manager(root / "b2", "thread", rank, world, 10**6)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    out: dict[str, list[float]] = {"plain": [], "save": []}
    step = 0
    for r in range(a.b2_rounds):
        for arm in (("plain", "save") if r % 2 == 0 else ("save", "plain")):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            if arm == "save":
                step += 1
                ck.save(step)
            for _ in range(a.b2_steps):
                _step(model, opt, a.dim)
            if arm == "save":
                ck.wait()
            out[arm].append(time.perf_counter() - t0)
    ck.close()
    return out


def _manager(root: Path, mode: str, rank: int, world: int, steps: int):
    # The defaults a run gets (verify=checksum), so the figures are what a user pays.
    cfg = CheckpointConfig(async_mode=mode, every_steps=1, keep=2)
    return CheckpointManager(root, cfg=cfg, rank=rank, world_size=world, total_steps=steps)


def _rank(rank: int, world: int, a: argparse.Namespace, t_launch: float) -> dict:
    t_start = a.t_child_start
    root = Path(a.dir)
    out: dict = {}
    model, opt = _model(a.dim, a.layers, world)
    if a.phase == "bare":
        # B4 baseline, in a fresh launch like the resume: the documented bare DCP resume (get_state_dict,
        # dcp.load, set_state_dict; notes section 6) of the same checkpoint, then the first step.
        path = root / "none" / f"step_{a.resume_step}"
        dist.barrier() if world > 1 else None
        t0 = time.perf_counter()
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd = get_state_dict(model, opt, options=opts)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=FileSystemReader(str(path)))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=opts)
        out["bare_load_s"] = time.perf_counter() - t0
        out["bare_first_step_s"] = _step(model, opt, a.dim)
        out["bare_s"] = time.perf_counter() - t0
        out["steady_step_s"] = statistics.median(_step(model, opt, a.dim) for _ in range(3))
        return out
    if a.phase == "resume":
        # B4: a fresh start that resumes through the manager, from its construction to the end of the first step.
        dist.barrier() if world > 1 else None
        t_model = time.time()
        ck = _manager(root / "none", "none", rank, world, 10**6)
        t_mgr = time.time()
        step = ck.load_latest(model_parts=[model], optimizers=[opt])
        t_load = time.time()
        _step(model, opt, a.dim)
        out["resume_to_first_step_s"] = time.time() - t_launch
        out["resume_s"] = time.time() - t_model
        out["resume_breakdown"] = {"rank_start": t_start - t_launch, "pg_and_model": t_model - t_start,
                                   "manager_init": t_mgr - t_model, "load_latest": t_load - t_mgr,
                                   "first_step": time.time() - t_load}
        out["resumed_step"] = step
        # For reference only: a bare dcp.load in this now warm process (optimizer state already built).
        path = root / "none" / f"step_{step}"
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dist.barrier() if world > 1 else None
        t0 = time.perf_counter()
        dcp.load({"model": msd, "optim": osd}, storage_reader=FileSystemReader(str(path)))
        out["warm_bare_load_s"] = time.perf_counter() - t0
        ck.close()
        return out
    for _ in range(2):
        _step(model, opt, a.dim)
    res: dict[str, list[float]] = {}
    for mode in ("none", "thread"):
        ck = _manager(root / mode, mode, rank, world, 10**6)
        ck.load_latest(model_parts=[model], optimizers=[opt])
        blocking, total = [], []
        for i in range(1, a.saves + 1):
            _step(model, opt, a.dim)
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            ck.save(i)
            blocking.append(time.perf_counter() - t0)
            ck.wait()
            total.append(time.perf_counter() - t0)
        ck.close()
        res[f"{mode}_blocking_s"], res[f"{mode}_total_s"] = blocking, total
    out.update({k: statistics.median(v) for k, v in res.items()})
    b2 = _b2_blocks(model, opt, a, root, rank, world)
    out["b2_lost_per_save_s"] = statistics.median(s - p for s, p in zip(b2["save"], b2["plain"]))
    out["b2_plain_block_s"] = statistics.median(b2["plain"])
    out["b2_lost_total_s"] = (sum(b2["save"]) - sum(b2["plain"])) / len(b2["save"])
    # B3 baseline: this rank's share of the same bytes, one file per rank, os.write + fsync, all ranks at once.
    step_dir = root / "none" / f"step_{a.saves}"
    mine = sum(p.stat().st_size for p in step_dir.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += (step_dir / ".metadata").stat().st_size
    buf = os.urandom(min(mine, 64 << 20))
    raw = []
    for i in range(a.saves):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        p = root / f"raw_{rank}_{i}.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = mine
        while left > 0:
            left -= os.write(fd, memoryview(buf)[: min(left, len(buf))])
        os.fsync(fd)
        os.close(fd)
        dfd = os.open(root, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        if world > 1:
            dist.barrier()
        raw.append(time.perf_counter() - t0)
        p.unlink()
    out["raw_write_s"] = statistics.median(raw)
    out["bytes"] = sum(f.stat().st_size for f in step_dir.iterdir() if f.name != "manifest.json")
    out["t_start"] = t_start
    return out


def _child(q, rank, world, port, a, t_launch):
    a.t_child_start = time.time()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
        q.put((rank, pickle.dumps(_rank(rank, world, a, t_launch))))
    except BaseException as e:  # noqa: BLE001
        import traceback

        q.put((rank, pickle.dumps(RuntimeError(traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        q.close()
        q.join_thread()
        os._exit(0)


def _launch(a: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t_launch = time.time()
    procs = [ctx.Process(target=_child, args=(q, r, a.ranks, port, a, t_launch)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    out = [pickle.loads(got[r]) for r in range(a.ranks)]
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--b2-rounds", type=int, default=10, help="B2: rounds of one plain and one saving block")
    ap.add_argument("--b2-steps", type=int, default=8, help="B2: training steps per block")
    ap.add_argument("--dir", default="/tmp/meshjob-ckbench")
    ap.add_argument("--out", default=None, help="append the JSON line here too")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    Path(a.dir).mkdir(parents=True)
    a.phase = "save"
    save = _launch(a)
    a.phase, a.resume_step = "bare", a.saves
    bare = _launch(a)
    a.phase = "resume"
    resume = _launch(a)
    worst = {k: max(o[k] for o in save) for k in save[0] if k.endswith("_s")}
    rworst = {k: max(o[k] for o in grp) for grp in (resume, bare) for k in grp[0] if k.endswith("_s")}
    nbytes = save[0]["bytes"]
    row = {
        "bench": "checkpoint",
        "ranks": a.ranks, "dim": a.dim, "layers": a.layers, "bytes": nbytes,
        **{k: round(v, 4) for k, v in {**worst, **rworst}.items()},
        "ckpt_write_GBps": nbytes / worst["none_total_s"] / 1e9,
        "raw_write_GBps": nbytes / worst["raw_write_s"] / 1e9,
        "blocking_over_sync": worst["thread_blocking_s"] / worst["none_total_s"],
        "B2_lost_over_sync": worst["b2_lost_per_save_s"] / worst["none_total_s"],
        "B3_ckpt_over_raw_throughput": worst["raw_write_s"] / worst["none_total_s"],
        # B4: from the manager's construction to the end of the first resumed step, over the bare DCP
        # resume (get_state_dict + dcp.load + set_state_dict) plus the first step, both in a fresh launch
        # (process start, rendezvous and model build are the launcher's and the same on both sides).
        "B4_resume_over_load_plus_step": rworst["resume_s"] / rworst["bare_s"],
    }
    row["resume_breakdown_s"] = {k: round(v, 3) for k, v in resume[0]["resume_breakdown"].items()}
    print(f"checkpoint {nbytes / 1e6:.1f} MB on {a.ranks} ranks; resume breakdown (rank 0) {row['resume_breakdown_s']}")
    print(f"B2 lost per save / sync save = {row['B2_lost_over_sync']:.3f}  (goal <= 0.01)  "
          f"[{worst['b2_lost_per_save_s']:.4f} s lost per save over {a.b2_steps} steps "
          f"(plain block {worst['b2_plain_block_s']:.3f} s; from totals {worst['b2_lost_total_s']:.4f} s) "
          f"vs sync save {worst['none_total_s']:.3f} s; save() itself blocked {worst['thread_blocking_s']:.4f} s]")
    print(f"B3 ckpt / raw write tput     = {row['B3_ckpt_over_raw_throughput']:.3f}  (goal >= 0.8)  "
          f"[{row['ckpt_write_GBps']:.3f} vs {row['raw_write_GBps']:.3f} GB/s]")
    print(f"B4 resume / (load + 1 step)  = {row['B4_resume_over_load_plus_step']:.3f}  (goal <= 1.5)  "
          f"[{rworst['resume_s']:.3f} s vs {rworst['bare_load_s']:.3f} + {rworst['bare_first_step_s']:.3f} s "
          f"(steady step {rworst['steady_step_s']:.3f} s, warm bare load {rworst['warm_bare_load_s']:.3f} s); "
          f"launch to first step {rworst['resume_to_first_step_s']:.3f} s]")
    line = json.dumps(row)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
