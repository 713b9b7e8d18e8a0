"""Each point of a `-m` sweep trains in its own run directory, decided from the overrides.

The sweeps run in-process through Hydra's multirun with the real launcher plugins; the clock Hydra's
`${now:...}` reads advances one second per call, so composing the points always crosses a second
boundary (the condition under which the default `runs/${now:...}` once resolved to shared dirs).
Slurm submission is replaced by a fake that hands out array element ids.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from jobs.launch import sweep
from jobs.launch.sweep import point_run_dirs, run_dir_swept

SLURM = [
    "launcher=slurm",
    "launcher.nodes=1",
    "launcher.tasks_per_node=2",
    "mesh.pp=1",
    "mesh.dp_shard=-1",
    "train.steps=2",
    "mesh.tp=1,2,3",
]  # tp3 does not divide 2 ranks: pruned, but composed too


class _TickingClock(dt.datetime):
    """datetime whose now() is one second later at every call."""

    calls = 0

    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206 - datetime's own signature
        cls.calls += 1
        return dt.datetime(2026, 12, 4, 21, 14, 17) + dt.timedelta(seconds=cls.calls)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The repo's relative defaults (run.dir runs/${now:...}, cluster.run_root runs) land under tmp_path."""
    import hydra.core.utils

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hydra.core.utils, "datetime", _TickingClock)
    return tmp_path


@pytest.fixture
def fake_sbatch(monkeypatch: pytest.MonkeyPatch) -> list[sweep.SweepPoint]:
    submitted: list[sweep.SweepPoint] = []

    def submit(group: list[sweep.SweepPoint], *, sweep_dir: Path) -> str:
        for p in group:
            p.job_id = f"900_{len(submitted)}"
            submitted.append(p)
        return "900"

    monkeypatch.setattr(sweep, "_submit_array", submit)
    monkeypatch.setattr(sweep, "require_slurm", lambda: None)
    return submitted


def _multirun(overrides: list[str], task=lambda cfg: 0, *, trains: bool = True) -> None:  # noqa: ANN001
    """`python -m jobs.train -m OVERRIDES` in-process through `jobs.cli.main_for` (`trains=False`: as
    `jobs.plan -m`), with `task` instead of training."""
    import sys

    from jobs.cli import main_for

    argv = sys.argv
    sys.argv = ["jobs.train", "-m", *overrides]  # @hydra.main reads the command line
    try:
        main_for(task, sys.argv[1:], command="train" if trains else "plan", point_run_dirs=trains)
    finally:
        sys.argv = argv


def _table(sweep_dir: Path) -> dict[int, dict]:
    return {t["idx"]: t for t in map(json.loads, (sweep_dir / "sweep.jsonl").read_text().splitlines())}


def test_run_dir_is_swept_only_when_the_points_overrides_give_it_different_values() -> None:
    assert not run_dir_swept([["mesh.tp=1"], ["mesh.tp=2"]])  # the default: runs/${now:...} for all
    assert not run_dir_swept([["mesh.tp=1", "run.dir=runs/x"], ["mesh.tp=2", "run.dir=runs/x"]])
    assert not run_dir_swept([["run.dir=runs/${now:%H%M%S}"], ["run.dir=runs/${now:%H%M%S}"]])  # one string
    assert run_dir_swept([["run.dir=runs/a"], ["run.dir=runs/b"]])
    assert run_dir_swept([["++run.dir=runs/a"], ["mesh.tp=2"]])  # given to one point only
    assert point_run_dirs([["a=1"], ["a=2"]], sweep_dir=Path("/s"), first_idx=3) == [Path("/s/3"), Path("/s/4")]
    assert point_run_dirs([["run.dir=/a"], ["run.dir=/b"]], sweep_dir=Path("/s"), first_idx=0) == [None, None]


def test_slurm_sweep_with_the_default_timestamp_run_dir_gives_every_point_its_own_dir_under_one_sweep_dir(
    in_tmp: Path, fake_sbatch: list
) -> None:
    _multirun(SLURM)
    (sweep_dir,) = (in_tmp / "runs").iterdir()  # one timestamp dir: the sweep's, however many seconds passed
    table = _table(sweep_dir)
    assert [p.idx for p in fake_sbatch] == [0, 1]
    assert {i: t["run_dir"] for i, t in table.items()} == {0: str(sweep_dir / "0"), 1: str(sweep_dir / "1"), 2: None}
    assert "mesh.tp(3)" in table[2]["pruned"]
    for p in fake_sbatch:
        assert p.cfg.run.dir == str(sweep_dir / str(p.idx))
        owner = json.loads((sweep_dir / str(p.idx) / "owner.json").read_text())
        assert owner["config"]["mesh.tp"] == p.idx + 1 and owner["config"]["run.dir"] == p.cfg.run.dir


def test_slurm_sweep_honours_hydra_sweep_dir_given_on_the_command_line(in_tmp: Path, fake_sbatch: list) -> None:
    mine = in_tmp / "runs" / "mine"
    _multirun([*SLURM, f"hydra.sweep.dir={mine}"])
    assert sorted(p.name for p in (in_tmp / "runs").iterdir()) == ["mine"]
    assert [(t["run_dir"], t["job_id"]) for t in _table(mine).values()] == [
        (str(mine / "0"), "900_0"),
        (str(mine / "1"), "900_1"),
        (None, None),
    ]


def test_slurm_sweep_over_run_dir_itself_trains_each_point_where_its_override_says(
    in_tmp: Path, fake_sbatch: list
) -> None:
    a, b = in_tmp / "runs" / "a", in_tmp / "runs" / "b"
    _multirun([*SLURM[:-1], "mesh.tp=2", f"run.dir={a},{b}"])
    assert [p.cfg.run.dir for p in fake_sbatch] == [str(a), str(b)]
    assert (a / "owner.json").exists() and (b / "owner.json").exists()


def test_slurm_sweep_prunes_a_point_whose_run_dir_another_point_already_has(in_tmp: Path, fake_sbatch: list) -> None:
    a, b = in_tmp / "runs" / "a", in_tmp / "runs" / "b"
    _multirun([*SLURM[:-1], "mesh.tp=1,2", f"run.dir={a},{b}"])  # 4 points, 2 dirs
    assert [(p.idx, p.cfg.run.dir) for p in fake_sbatch] == [(0, str(a)), (1, str(b))]
    sweep_dir = next(d for d in (in_tmp / "runs").iterdir() if d.name not in ("a", "b"))
    pruned = {i: t["pruned"] for i, t in _table(sweep_dir).items() if t["pruned"]}
    assert sorted(pruned) == [2, 3] and f"run.dir={a} is point 0's run dir too" in pruned[2]


def test_local_sweep_gives_every_point_its_own_dir_under_the_sweep_dir(in_tmp: Path) -> None:
    seen: list[str] = []
    _multirun(["launcher=local", "mesh.tp=1,2", "train.steps=1"], task=lambda cfg: seen.append(cfg.run.dir))
    (sweep_dir,) = (in_tmp / "runs").iterdir()
    assert seen == [str(sweep_dir / "0"), str(sweep_dir / "1")]
    assert [t["run_dir"] for t in _table(sweep_dir).values()] == seen


def test_local_sweep_honours_hydra_sweep_dir_and_refuses_points_sharing_a_run_dir(
    in_tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    seen: list[str] = []
    _multirun(["mesh.tp=1,2", f"hydra.sweep.dir={in_tmp / 'mine'}"], task=lambda cfg: seen.append(cfg.run.dir))
    assert seen == [str(in_tmp / "mine" / "0"), str(in_tmp / "mine" / "1")]
    with pytest.raises(SystemExit):
        _multirun(["mesh.tp=1,2", f"run.dir={in_tmp / 'a'},{in_tmp / 'b'}"], task=lambda cfg: seen.append(1))
    assert f"sweep points 0 and 2 would both train in run.dir={in_tmp / 'a'}" in capsys.readouterr().err
    assert len(seen) == 2  # refused before any point ran


def test_a_local_sweep_of_another_command_keeps_the_run_dir_each_point_composes_to(in_tmp: Path) -> None:
    seen: list[str] = []
    _multirun(["mesh.tp=1,2", f"run.dir={in_tmp / 'a run'}"], task=lambda cfg: seen.append(cfg.run.dir), trains=False)
    assert seen == [str(in_tmp / "a run")] * 2
    assert sorted(p.name for p in (in_tmp / "a run").iterdir()) == ["multirun.yaml"]
