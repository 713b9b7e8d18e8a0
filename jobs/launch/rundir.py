"""Run-directory ownership: a run directory holds one run (`RUN_DIR/owner.json`) and one live job at a time.

The first start of a run records its resolved config (flat, dotted keys), its config hash and who
started it (a Slurm job id, or a local launcher's host and pid). Every later start (a resume, a
resubmission, a sweep point, the batch step of a rendered script) is checked against that record
before it touches the directory (`claim_run_dir`; on the login node for a Slurm submission, in the
local launcher before any rank is forked):

- its config may differ only in the keys a resume may change (`RESUMABLE`; docs/quickstart.md "One run per
  directory"), else ValueError naming the directory, the keys with both values, and the fix;
- no other job may be live in it: neither the job that started it last (a Slurm job in an active
  state, a local launcher whose process still runs) nor any rank whose heartbeat
  (`RUN_DIR/heartbeats/<attempt>/rank<r>.json`) is fresh within a few `failure.heartbeat_s`, unless
  that rank's process is known to be dead or its Slurm job to have ended.

A requeue or a restart inside the allocation is not a new start (Slurm runs the same batch step
again); a check made from inside a job names that job (`job_id`) and its own attempts count as its own.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from checkpoint.config import memory_root as checkpoint_memory_root
from jobs.config import JobConfig, config_hash
from jobs.failure.heartbeat import process_state, read_beats
from jobs.launch.slurm_state import ACTIVE_STATES, job_state
from jobs.records import load_json, stamped

__all__ = [
    "OWNER_FILE",
    "RESUMABLE",
    "NOT_RESUMABLE",
    "flat_config",
    "config_changes",
    "read_owner",
    "check_run_dir",
    "claim_run_dir",
    "record_job",
    "run_id",
    "memory_root",
]

OWNER_FILE = "owner.json"

# The keys a later start of a run may change (fnmatch patterns over dotted keys); docs/quickstart.md,
# "One run per directory", says why for each. Everything else (model.*, data.*, optim.*, train.seed,
# train.seq_len, train.device, ...) defines the run and must stay as it was.
RESUMABLE = (
    "run.*",  # the directory itself: given relative or absolute, or moved
    "train.steps",  # train longer or shorter
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",  # what is measured, not what is trained
    "train.micro_batch",
    "train.activation_checkpointing",
    "train.ac_every",
    "train.compile",  # how a batch is computed
    "train.global_batch",  # a batch-size ramp: the data cursor goes on at the next unread sample (jobs/data/cursor.py)
    "data.accept_changed_files",  # the override that accepts a changed data file on resume
    "mesh.*",
    "launcher.*",
    "cluster.*",  # where and on which mesh it runs: a resume reshards (DESIGN 3.3)
    "checkpoint.*",
    "failure.*",
    "metrics.*",
    "plan.*",
    "calibrate.*",  # how it is saved, guarded and measured
)
NOT_RESUMABLE = (
    "checkpoint.enabled",  # false would start again from step 0 in a directory that holds the run's checkpoints
)
_FRESH_BEATS = 5  # a heartbeat younger than this many failure.heartbeat_s (+ _FRESH_SLACK_S) is live
_FRESH_SLACK_S = 5.0


def _resumable(key: str) -> bool:
    return not any(fnmatch(key, p) for p in NOT_RESUMABLE) and any(fnmatch(key, p) for p in RESUMABLE)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


def flat_config(cfg: JobConfig) -> dict[str, Any]:
    """The resolved config as {dotted key: JSON value}; data paths made absolute as `prepare_run` makes them."""
    tree = dataclasses.asdict(cfg)
    tree["data"]["path"] = str(Path(cfg.data.path).resolve())
    for source in tree["data"]["sources"]:
        source["path"] = str(Path(source["path"]).resolve())
    out: dict[str, Any] = {}
    _flatten(tree, "", out)
    return json.loads(json.dumps(out, default=str))


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The keys outside `RESUMABLE` whose values differ, as `key (old -> new)`. A key the first start did
    not record (added to the schema since) is no change."""
    return [
        f"{k} ({old[k]!r} -> {new.get(k)!r})"
        for k in sorted(old)
        if k in new and old[k] != new[k] and not _resumable(k)
    ]


def read_owner(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(run_dir) / OWNER_FILE
    try:
        return load_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"{path} is unreadable ({e}): it records which run owns {path.parent}; "
            "restore it, or move the directory aside"
        ) from None


def run_id(run_dir: str | os.PathLike[str]) -> str:
    """The run's identity, the same for every attempt, requeue and resume of it and different for another run
    (even in a directory of the same name): the directory's real path and its first start (`owner.json`)."""
    first = (read_owner(run_dir) or {}).get("first") or {}
    key = json.dumps([os.path.realpath(run_dir), first.get("host"), first.get("pid"), first.get("time")])
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def memory_root(cfg: JobConfig) -> Path:
    """This run's folder of the RAM checkpoint tier on this node: `checkpoint.memory_dir/meshjob-<run id>`."""
    return checkpoint_memory_root(cfg.checkpoint.memory_dir, run_id(cfg.run.dir))


def _pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid from a later reuse of it)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _starter(launcher: str, job_id: str | None) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "launcher": launcher,
        "job_id": job_id,
        "host": os.uname().nodename,
        "pid": pid,
        "pid_start": _pid_start(pid),
        "time": time.time(),
    }


def _who(s: dict[str, Any]) -> str:
    if s.get("job_id"):
        return f"Slurm job {s['job_id']}"
    what = "submission" if s.get("launcher") == "slurm" else "local launch"
    return f"{what} by pid {s.get('pid')} on {s.get('host')}"


def _starter_live(s: dict[str, Any], *, me: str | None) -> str | None:
    """Why the job that started the run last still runs, or None (ended, ours, or cannot be told)."""
    if s.get("job_id"):
        if s["job_id"] == me:
            return None
        state = job_state(s["job_id"]).state
        return f"{_who(s)} is {state}" if state in ACTIVE_STATES else None
    if s.get("host") != os.uname().nodename or s.get("pid") == os.getpid():
        return None  # another machine's process cannot be looked at: its ranks' heartbeats tell
    alive = _pid_start(int(s["pid"])) == s.get("pid_start") and _proc_state(int(s["pid"])) not in ("Z", "X", None)
    return f"{_who(s)} is still running" if alive else None


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _live_beats(run_dir: Path, *, fresh_s: float, me: str | None) -> list[str]:
    """Ranks of other jobs whose heartbeat is fresh and whose process is not known to be dead."""
    root, now, ended, out = run_dir / "heartbeats", time.time(), {}, []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        job = folder.name.split(".")[0]  # attempts are `<job id>.<restart>[.<n>]` or `local.<n>[.<k>]`
        if job == me or now - folder.stat().st_mtime > fresh_s:  # each beat renames a file in its folder
            continue
        for beat in read_beats(run_dir, folder.name).values():
            age = now - beat.time
            if age > fresh_s or process_state(beat) == "dead":
                continue
            if job != "local":
                if job not in ended:
                    state = job_state(job).state
                    ended[job] = state != "UNKNOWN" and state not in ACTIVE_STATES
                if ended[job]:
                    continue
            out.append(
                f"rank {beat.rank} of attempt {folder.name} on {beat.node} (pid {beat.pid}, heartbeat {age:.0f} s ago)"
            )
    return out


def _live_users(run_dir: Path, owner: dict[str, Any] | None, cfg: JobConfig, *, me: str | None) -> list[str]:
    heartbeat_s = max(cfg.failure.heartbeat_s, float((owner or {}).get("config", {}).get("failure.heartbeat_s", 0)))
    live = []
    if owner and (why := _starter_live(owner.get("last") or owner["first"], me=me)):
        live.append(why)
    return live + _live_beats(run_dir, fresh_s=_FRESH_BEATS * heartbeat_s + _FRESH_SLACK_S, me=me)


def check_run_dir(cfg: JobConfig, *, job_id: str | None = None) -> None:
    """Raises ValueError when `cfg.run.dir` holds another run (a config that differs outside `RESUMABLE`) or
    another live job. Reads only. `job_id`: the Slurm job making the check from inside (its attempts are its own)."""
    run_dir = Path(cfg.run.dir).resolve()
    owner = read_owner(run_dir)
    problems = []
    live = _live_users(run_dir, owner, cfg, me=job_id)
    if live:
        shown = "; ".join(live[:3]) + (f"; and {len(live) - 3} more" if len(live) > 3 else "")
        problems.append(
            f"run.dir={run_dir} is in use by another live job ({shown}): two jobs never write one run "
            f"directory; wait until it ends (python -m jobs.status {run_dir}), stop it, or give this "
            "job another run.dir"
        )
    changes = config_changes(owner["config"], flat_config(cfg)) if owner else []
    if changes:
        first = owner["first"]
        problems.append(
            f"run.dir={run_dir} holds another run (started by {_who(first)}; {run_dir / OWNER_FILE}): this config "
            f"differs in {', '.join(changes)}; a resume may change only {', '.join(RESUMABLE)} but "
            f'{", ".join(NOT_RESUMABLE)} (docs/quickstart.md, "One run per directory"); '
            "set those keys back to resume the run, or give this config its own run.dir"
        )
    if problems:
        raise ValueError("\n".join(problems))


@contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    with open(run_dir / ".owner.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_owner(run_dir: Path, owner: dict[str, Any]) -> None:
    tmp = run_dir / f".{OWNER_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(stamped(owner), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / OWNER_FILE)


def claim_run_dir(cfg: JobConfig, *, launcher: str, job_id: str | None = None) -> Path:
    """Checks (`check_run_dir`), then records this start in `RUN_DIR/owner.json` (the first start also its config
    and hash). Re-checked under a lock once the directory exists, so of two starts racing only one is recorded.
    `launcher`: local | slurm; `job_id`: the Slurm job starting, None locally or before sbatch (see `record_job`)."""
    check_run_dir(cfg, job_id=job_id)
    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with _locked(run_dir):
        check_run_dir(cfg, job_id=job_id)
        owner = read_owner(run_dir)
        me = _starter(launcher, job_id)
        if owner is None:
            owner = {"config_hash": config_hash(cfg), "config": flat_config(cfg), "first": me, "starts": 0}
        owner["last"], owner["starts"] = me, owner.get("starts", 0) + 1
        _write_owner(run_dir, owner)
    return run_dir


def record_job(run_dir: str | os.PathLike[str], job_id: str) -> None:
    """After sbatch: the submission this process recorded by `claim_run_dir` is Slurm job `job_id`."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        owner = read_owner(run_dir)
        if owner is None:
            return
        for key in ("first", "last"):
            s = owner.get(key) or {}
            if s.get("pid") == os.getpid() and s.get("host") == os.uname().nodename and not s.get("job_id"):
                s["job_id"] = job_id
        _write_owner(run_dir, owner)
