"""Checkpoint benchmark: B2 training time lost per async save / sync save, B3 checkpoint/raw-disk write throughput, B4 resume/(load + step), in one run.

    python scripts/bench/checkpoint.py [--ranks 2] [--dim 1024] [--layers 4] [--dir /tmp/ckbench] [--out bench.jsonl]
    python scripts/bench/checkpoint.py --only b3 --dim 4096 --layers 10     # B3 alone at ~1 GB per rank (2 ranks)
    python scripts/bench/checkpoint.py --only b2 --ranks 1 --threads 1      # B2 with a core free beside the rank

Every rank holds an FSDP2 shard of an MLP stack trained by AdamW (state = 3x params). Baselines are
measured in the same run on the same filesystem: a synchronous `async_mode=none` save (B2's denominator
and B3's numerator), the same bytes written with os.write + fsync per rank in parallel (B3), and, in a
fresh launch of its own like the resume's, the bare DCP resume (get_state_dict + dcp.load +
set_state_dict) of the same checkpoint plus the first step (B4). B2's numerator: in the same ranks,
rounds of two blocks of --b2-steps training steps each, one plain and one that starts with an async
(`thread`) save and ends once that save is committed (the order alternates by round); the median over
rounds of (save block - plain block). The manager runs with the default config (verify=checksum).
B2 is labelled with the cores left free beside the ranks (`--threads` torch threads per rank): a GPU
node's rank leaves host cores idle for the async writer; on a CPU-bound box every core is busy.
B3 also prints the fixed cost per save: where a synchronous save's time goes on each rank (planning
with its collective, serialisation and write, crc32, fsync, DCP's finish and .metadata, our commit),
timed by wrappers installed in this process only; fixed = planning + finish + commit (what does not
grow with the bytes). Prints the ratios and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Everything is imported once here, before forking the ranks (a lazy import per rank costs seconds).
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from _fork import gather_forked_ranks  # noqa: E402 - scripts/bench is on sys.path when run as a script
from _models import mlp_stack  # noqa: E402
from _slowfs import add_bench_args, run_in_bench_dir  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402

import checkpoint.commit as commit_mod  # noqa: E402
import checkpoint.writer as writer_mod  # noqa: E402
from checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402

# Where a synchronous save's time goes, per rank: wrappers around the writer, the crc32, fsync and the commit
# (this process only; the manager is unchanged). Seconds, summed over the saves made while `_PROFILE["on"]`.
_PROFILE: dict = {"on": False}
_fsync = os.fsync
_PHASES = ("plan", "write", "crc32", "fsync", "finish", "commit")


def _timed(fn, key):
    def wrapper(*args, **kwargs):
        if not _PROFILE["on"]:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _PROFILE[key] = _PROFILE.get(key, 0.0) + time.perf_counter() - t0

    return wrapper


class _TimedZlib:
    crc32 = staticmethod(_timed(__import__("zlib").crc32, "crc32"))


def _install_profile() -> None:
    W = writer_mod.RecordingWriter
    W.write_data = _timed(W.write_data, "write")  # serialisation, write, crc32, fsync of the shard
    W.finish = _timed(W.finish, "finish")  # the coordinator's .metadata, written and fsync'ed
    writer_mod.zlib = _TimedZlib
    fsync = _timed(os.fsync, "fsync")  # the shards' (inside write_data; the others are finish's and commit's)
    os.fsync = lambda fd: fsync(fd) if _PROFILE.get("in_write") else _fsync(fd)
    commit_mod.Committer.commit = _timed(commit_mod.Committer.commit, "commit")
    orig_save = dcp.save

    def save(*args, **kwargs):  # planning = the time before write_data starts (state dict, plans, their collective)
        if not _PROFILE["on"]:
            return orig_save(*args, **kwargs)
        writer = kwargs["storage_writer"]
        t0, box = time.perf_counter(), {}
        inner = writer.write_data

        def write_data(*a, **k):
            box["t"] = time.perf_counter()
            _PROFILE["in_write"] = True
            try:
                return inner(*a, **k)
            finally:
                _PROFILE["in_write"] = False

        writer.write_data = write_data
        try:
            return orig_save(*args, **kwargs)
        finally:
            _PROFILE["plan"] = _PROFILE.get("plan", 0.0) + box.get("t", t0) - t0

    dcp.save = save


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
        for arm in ("plain", "save") if r % 2 == 0 else ("save", "plain"):
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
    model, opt = mlp_stack(a.dim, a.layers, world)
    if a.phase == "bare":
        return _bare_resume(model, opt, a, Path(a.dir), world)
    if a.phase == "resume":
        return _manager_resume(model, opt, a, Path(a.dir), rank=rank, world=world, t_launch=t_launch)
    return _save_figures(model, opt, a, Path(a.dir), rank=rank, world=world)


def _bare_resume(model, opt, a: argparse.Namespace, root: Path, world: int) -> dict:
    """B4 baseline, in a fresh launch like the resume: the documented bare DCP resume (get_state_dict,
    dcp.load, set_state_dict; notes section 6) of the same checkpoint, then the first step."""
    out: dict = {}
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


def _manager_resume(model, opt, a: argparse.Namespace, root: Path, *, rank: int, world: int, t_launch: float) -> dict:
    """B4: a fresh start that resumes through the manager, from its construction to the end of the first step."""
    t_start = a.t_child_start
    out: dict = {}
    dist.barrier() if world > 1 else None
    t_model = time.time()
    ck = _manager(root / "none", "none", rank, world, 10**6)
    t_mgr = time.time()
    step = ck.load_latest(model_parts=[model], optimizers=[opt])
    t_load = time.time()
    _step(model, opt, a.dim)
    out["resume_to_first_step_s"] = time.time() - t_launch
    out["resume_s"] = time.time() - t_model
    out["resume_breakdown"] = {
        "rank_start": t_start - t_launch,
        "pg_and_model": t_model - t_start,
        "manager_init": t_mgr - t_model,
        "load_latest": t_load - t_mgr,
        "first_step": time.time() - t_load,
    }
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


def _save_figures(model, opt, a: argparse.Namespace, root: Path, *, rank: int, world: int) -> dict:
    """The sync and async saves (B3's numerator, B2's denominator), then B2's blocks and B3's raw writes."""
    out: dict = {}
    for _ in range(1 if a.only == "b3" else 2):  # B3 alone: one step makes the optimizer state, the saves need no more
        _step(model, opt, a.dim)
    out.update(_saves(model, opt, a, root, rank, world))  # the sync save: B3's numerator, B2's denominator
    if a.only in ("all", "b2"):
        b2 = _b2_blocks(model, opt, a, root, rank, world)
        out["b2_lost_per_save_s"] = statistics.median(s - p for s, p in zip(b2["save"], b2["plain"]))
        out["b2_plain_block_s"] = statistics.median(b2["plain"])
        out["b2_lost_total_s"] = (sum(b2["save"]) - sum(b2["plain"])) / len(b2["save"])
    if a.only in ("all", "b3"):
        raw = out["raw_each_s"] = _raw_write(a, root, rank, world)
        out["raw_write_s"] = statistics.median(raw)
        # Steady state: the saves (and raw writes) after the first deletion, which write into freed pages.
        out["none_steady_s"] = statistics.median(out["none_each_s"][3:] or out["none_each_s"])
        out["raw_steady_s"] = statistics.median(raw[3:] or raw)
        out["none_first_s"], out["raw_first_s"] = out["none_each_s"][0], raw[0]
    out["t_start"] = a.t_child_start
    return out


def _saves(model, opt, a: argparse.Namespace, root: Path, rank: int, world: int) -> dict:
    """--saves synchronous saves (profiled: where the time goes) and --saves async (thread) saves, each
    timed from save() to its commit; medians, and the sync saves' phases per save."""
    res: dict[str, list[float]] = {}
    modes = ("none", "thread") if a.only == "all" else ("none",)
    for mode in modes:
        ck = _manager(root / mode, mode, rank, world, 10**6)
        ck.load_latest(model_parts=[model], optimizers=[opt])
        blocking, total = [], []
        for i in range(1, a.saves + 1):
            if a.only != "b3":
                _step(model, opt, a.dim)
            if world > 1:
                dist.barrier()
            _PROFILE["on"] = mode == "none"
            t0 = time.perf_counter()
            ck.save(i)
            blocking.append(time.perf_counter() - t0)
            ck.wait()
            total.append(time.perf_counter() - t0)
            _PROFILE["on"] = False
        ck.close()
        res[f"{mode}_blocking_s"], res[f"{mode}_total_s"] = blocking, total
    out: dict = {k: statistics.median(v) for k, v in res.items()}
    out["none_each_s"] = res["none_total_s"]
    out["phases_s"] = {k: _PROFILE.get(k, 0.0) / a.saves for k in _PHASES}
    step_dir = root / "none" / f"step_{a.saves}"
    out["mine"] = sum(p.stat().st_size for p in step_dir.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        out["mine"] += (step_dir / ".metadata").stat().st_size
    out["bytes"] = sum(f.stat().st_size for f in step_dir.iterdir() if f.name != "manifest.json")
    return out


def _raw_write(a: argparse.Namespace, root: Path, rank: int, world: int) -> float:
    """B3 baseline: this rank's share of the same bytes, one file per rank, os.write + fsync, all ranks at
    once, then the folder's fsync; each of --saves times. Like retention (keep=2) the files stay and the one
    two writes back is deleted after each write: on this VM a write into memory the kernel has not used
    lately costs ~3x one into pages a deletion just freed, and a baseline that deleted each file at once
    always got the latter while the checkpoints' first saves got the former."""
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
        (root / f"raw_{rank}_{i - 2}.bin").unlink(missing_ok=True)
    for p in root.glob(f"raw_{rank}_*.bin"):
        p.unlink()
    return raw


def _launch(a: argparse.Namespace) -> list[dict]:
    t_launch = time.time()

    def rank_result(rank: int, started: float) -> dict:
        a.t_child_start = started
        torch.set_num_threads(a.threads)
        return _rank(rank, a.ranks, a, t_launch)

    return gather_forked_ranks(a.ranks, rank_result, timeout_s=600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap, folder="/tmp/meshjob-ckbench", what="--dir")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--saves", type=int, default=5, help="sync saves (and raw writes): 4+ are steady state")
    ap.add_argument("--only", choices=("all", "b2", "b3"), default="all", help="b2 or b3 alone (no B4)")
    ap.add_argument("--b2-rounds", type=int, default=10, help="B2: rounds of one plain and one saving block")
    ap.add_argument("--b2-steps", type=int, default=8, help="B2: training steps per block")
    return run_in_bench_dir(ap.parse_args(), _main)


def _main(a: argparse.Namespace) -> int:
    cores = os.cpu_count() or 1
    a.threads = a.threads or max(1, cores // a.ranks)
    shutil.rmtree(a.dir, ignore_errors=True)
    Path(a.dir).mkdir(parents=True)
    _install_profile()
    a.phase = "save"
    save = _launch(a)
    row: dict = {
        "bench": "checkpoint",
        "only": a.only,
        "ranks": a.ranks,
        "threads_per_rank": a.threads,
        "cores": cores,
        "cores_free": max(0, cores - a.ranks * a.threads),
        "dim": a.dim,
        "layers": a.layers,
        "slow_fs_MBps_per_rank": a.slow_fs,
    }
    worst = {k: max(o[k] for o in save) for k in save[0] if k.endswith("_s") and isinstance(save[0][k], float)}
    row.update({k: round(v, 4) for k, v in worst.items()})
    if a.only in ("all", "b3"):
        _b3(row, save, worst)
    if a.only in ("all", "b2"):
        _b2(row, worst, a)
    if a.only == "all":
        _b4(row, a)
    shutil.rmtree(a.dir, ignore_errors=True)
    line = json.dumps(row)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


def _b3(row: dict, save: list[dict], worst: dict) -> None:
    nbytes = row["bytes"] = save[0]["bytes"]
    row["bytes_per_rank_max"] = max(o["mine"] for o in save)
    row["ckpt_write_GBps"] = nbytes / worst["none_total_s"] / 1e9
    row["raw_write_GBps"] = nbytes / worst["raw_write_s"] / 1e9
    row["B3_ckpt_over_raw_throughput"] = worst["raw_write_s"] / worst["none_total_s"]
    row["B3_first"] = worst["raw_first_s"] / worst["none_first_s"]  # both into memory not used lately
    row["B3_steady"] = worst["raw_steady_s"] / worst["none_steady_s"]  # both into pages a deletion freed
    row["none_each_s"] = [round(max(o["none_each_s"][i] for o in save), 3) for i in range(len(save[0]["none_each_s"]))]
    row["raw_each_s"] = [round(max(o["raw_each_s"][i] for o in save), 3) for i in range(len(save[0]["raw_each_s"]))]
    # Per rank, per save: the sync save's time by phase; fixed = what does not grow with the bytes.
    phases = [dict(o["phases_s"], total=o["none_total_s"]) for o in save]
    for ph in phases:
        ph["serialise+write"] = ph["write"] - ph["crc32"] - ph["fsync"]
        ph["fixed"] = ph["plan"] + ph["finish"] + ph["commit"]
        ph["other"] = ph["total"] - ph["plan"] - ph["write"] - ph["finish"] - ph["commit"]
    row["phases_ms"] = [{k: round(1e3 * v, 1) for k, v in ph.items()} for ph in phases]
    row["fixed_ms"] = round(1e3 * max(ph["fixed"] for ph in phases), 1)
    print(
        f"checkpoint {nbytes / 1e6:.1f} MB on {row['ranks']} ranks ({row['bytes_per_rank_max'] / 1e6:.1f} MB "
        f"per rank at most); {row['cores']} cores, {row['threads_per_rank']} torch threads per rank"
    )
    print(
        f"B3 ckpt / raw write tput     = {row['B3_ckpt_over_raw_throughput']:.3f}  (goal >= 0.8)  "
        f"[{row['ckpt_write_GBps']:.3f} vs {row['raw_write_GBps']:.3f} GB/s; sync save {worst['none_total_s']:.3f} s "
        f"vs raw write+fsync {worst['raw_write_s']:.3f} s]"
    )
    print(
        f"   first save {row['B3_first']:.3f}, steady state (saves 4+, after retention's first deletion) "
        f"{row['B3_steady']:.3f}; per save, slowest rank: sync {row['none_each_s']} s, raw {row['raw_each_s']} s"
    )
    print(f"   fixed cost per save {row['fixed_ms']:.1f} ms (planning + DCP finish + commit, the slowest rank)")
    keys = ("plan", "serialise+write", "crc32", "fsync", "finish", "commit", "other", "total")
    for r, ph in enumerate(row["phases_ms"]):
        print(f"   rank {r} ms per save: " + ", ".join(f"{k} {ph[k]:.1f}" for k in keys))


def _b2(row: dict, worst: dict, a: argparse.Namespace) -> None:
    sync = worst["none_total_s"]
    row["B2_lost_over_sync"] = worst["b2_lost_per_save_s"] / sync
    label = (f"{row['cores_free']} core(s) free beside the ranks" if row["cores_free"] else "every core busy") + (
        f": {row['ranks']} rank(s) x {row['threads_per_rank']} torch thread(s) on {row['cores']} cores"
    )
    row["b2_label"] = label
    print(
        f"B2 lost per save / sync save = {row['B2_lost_over_sync']:.3f}  (goal <= 0.01)  [{label}; "
        f"{worst['b2_lost_per_save_s']:.4f} s lost per save over {a.b2_steps} steps "
        f"(plain block {worst['b2_plain_block_s']:.3f} s; from totals {worst['b2_lost_total_s']:.4f} s) "
        f"vs sync save {sync:.3f} s"
        + (f"; save() itself blocked {worst['thread_blocking_s']:.4f} s]" if "thread_blocking_s" in worst else "]")
    )


def _b4(row: dict, a: argparse.Namespace) -> None:
    a.phase, a.resume_step = "bare", a.saves
    bare = _launch(a)
    a.phase = "resume"
    resume = _launch(a)
    rworst = {k: max(o[k] for o in grp) for grp in (resume, bare) for k in grp[0] if k.endswith("_s")}
    row.update({k: round(v, 4) for k, v in rworst.items()})
    # B4: from the manager's construction to the end of the first resumed step, over the bare DCP
    # resume (get_state_dict + dcp.load + set_state_dict) plus the first step, both in a fresh launch
    # (process start, rendezvous and model build are the launcher's and the same on both sides).
    row["B4_resume_over_load_plus_step"] = rworst["resume_s"] / rworst["bare_s"]
    row["blocking_over_sync"] = row["thread_blocking_s"] / row["none_total_s"]
    row["resume_breakdown_s"] = {k: round(v, 3) for k, v in resume[0]["resume_breakdown"].items()}
    print(
        f"B4 resume / (load + 1 step)  = {row['B4_resume_over_load_plus_step']:.3f}  (goal <= 1.5)  "
        f"[{rworst['resume_s']:.3f} s vs {rworst['bare_load_s']:.3f} + {rworst['bare_first_step_s']:.3f} s "
        f"(steady step {rworst['steady_step_s']:.3f} s, warm bare load {rworst['warm_bare_load_s']:.3f} s); "
        f"launch to first step {rworst['resume_to_first_step_s']:.3f} s; rank 0 {row['resume_breakdown_s']}]"
    )


if __name__ == "__main__":
    sys.exit(main())
