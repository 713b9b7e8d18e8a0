"""Installed, not run from the checkout: a wheel in a fresh venv, and the editable install, from a directory outside the tree.

The wheel's venv is fresh (no `--system-site-packages`, no PYTHONPATH) and gets the wheel with `--no-deps`; its
dependencies (torch 2.13, Hydra, h5py, ...) come from this venv's site-packages through one `.pth` line. Installing
torch again would unpack ~700 MB per run on CI's two cores; what the test checks is that the wheel carries
everything of meshjob itself (conf/, sbatch/ templates, both Hydra launchers), which the `.pth` cannot supply:
`jobs` must import from the fresh venv, not from here (asserted).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # a wheel build, two 1-rank trainings, a plan: ~2 min

# What a wheel is built from: everything else in the checkout (tests, scripts, runs) stays out.
_SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "jobs",
    "parallel",
    "checkpoint",
    "hydra_plugins",
    "conf",
    "sbatch",
)
_ONE_RANK = ["mesh=single", "launcher.tasks_per_node=1", "train.steps=1"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _run(program: Path | str, args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(program), *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory) -> Path:
    """The python of a fresh venv holding only the wheel built from this tree (dependencies through a .pth)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in _SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("meshjob-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "_meshjob_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return python


def test_a_wheel_in_a_fresh_venv_trains_plans_for_slurm_and_sweeps_from_an_empty_directory(
    wheel_python, tmp_path
) -> None:
    where = _run(wheel_python, ["-c", "import jobs, jobs._conf, jobs._sbatch; print(jobs.__file__)"], tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(wheel_python.parent.parent), where.stdout  # not this checkout

    train = _run(wheel_python, ["-m", "jobs.train", *_ONE_RANK, "run.dir=one"], tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert [json.loads(l)["step"] for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()] == [1]

    slurm = ["launcher=slurm", "cluster=h100_ib", "+experiment=llama3_8b"]
    plan = _run(wheel_python, ["-m", "jobs.plan", *slurm], tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "PASS  memory" in plan.stdout and "PASS  parallelize" in plan.stdout

    sbatch = _run(
        wheel_python, ["-m", "jobs.sbatch", *slurm, "run.dir=/lustre/meshjob/runs/w", "sbatch.out=job.sbatch"], tmp_path
    )
    assert sbatch.returncode == 0, sbatch.stderr[-3000:]
    assert "#SBATCH --nodes=" in (tmp_path / "job.sbatch").read_text()

    for override, needle in (("+train.stepz=5", "did you mean train.steps?"), ("mesh.tp=two", "(key mesh.tp)")):
        refused = _run(wheel_python, ["-m", "jobs.plan", override], tmp_path)
        assert refused.returncode == 2 and needle in refused.stderr, refused.stderr[-2000:]
    helped = _run(wheel_python.parent / "meshjob", ["train", "--help"], tmp_path)  # the console script
    assert helped.returncode == 0 and helped.stdout.startswith("usage: meshjob train"), helped.stderr[-2000:]

    # -m: the meshjob_local launcher (hydra_plugins) gives each point its own run dir
    sweep = _run(wheel_python, ["-m", "jobs.train", "-m", *_ONE_RANK, "train.seed=1,2", "run.dir=sweep"], tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert [json.loads(l)["run_dir"] for l in (tmp_path / "sweep" / "sweep.jsonl").read_text().splitlines()] == [
        str(tmp_path / "sweep" / "0"),
        str(tmp_path / "sweep" / "1"),
    ]
    assert all((tmp_path / "sweep" / p / "metrics.jsonl").exists() for p in ("0", "1"))


def test_the_editable_install_prepares_data_and_sweeps_from_a_data_directory_outside_the_checkout(tmp_path) -> None:
    with (tmp_path / "corpus.jsonl").open("w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document {i} says the river runs past {i % 7} old stone walls"}) + "\n")
    prep = _run(
        sys.executable,
        ["-m", "jobs.prepare_data", "data.inputs=[corpus.jsonl]", "data.path=corpus.h5", "model.vocab_size=384"],
        tmp_path,
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    assert (tmp_path / "corpus.h5").exists()
    sweep = _run(
        sys.executable,
        ["-m", "jobs.plan", "-m", "mesh=single", "launcher.tasks_per_node=1", "train.micro_batch=1,2"],
        tmp_path,
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]  # before: Could not find 'hydra/launcher/meshjob_local'
    assert sweep.stdout.count("PASS  memory") == 2
