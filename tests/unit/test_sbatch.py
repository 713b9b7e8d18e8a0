"""The sbatch renderer: golden scripts (which double as the sysadmin examples in sbatch/examples/), quoting, and refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.config import compose
from jobs.sbatch import render, render_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "sbatch" / "examples"
UPDATE = (
    os.environ.get("MESHJOB_UPDATE_GOLDEN") == "1"
)  # regenerate: MESHJOB_UPDATE_GOLDEN=1 pytest tests/unit/test_sbatch.py


def update_refusal(environ) -> str | None:
    """Why the golden files must not be rewritten here: under CI (CI=true), rewriting them would make the
    golden test compare the renderer with itself and pass whatever it renders."""
    if environ.get("MESHJOB_UPDATE_GOLDEN") == "1" and environ.get("CI", "").lower() in ("true", "1"):
        return "MESHJOB_UPDATE_GOLDEN=1 under CI=true: golden files are updated by hand after a deliberate change, never by CI"
    return None


H100 = [
    "launcher=slurm",
    "cluster=h100_ib",
    "model=llama3_8b",
    "launcher.nodes=4",
    "launcher.tasks_per_node=8",
    "mesh.pp=1",
    "mesh.tp=8",
    "mesh.dp_shard=4",
    "train.global_batch=64",
    "train.micro_batch=2",
    "train.seq_len=2048",
    "run.dir=/lustre/meshjob/runs/llama3_8b-tp8",
    "cluster.account=my-account",
    "cluster.setup=[module load cuda/12.4,source /lustre/meshjob/venv/bin/activate]",
]
LOCAL = ["launcher=slurm", "train.steps=4", "run.dir=/work/meshjob/runs/tiny-2x4"]
CASES = {
    "h100_ib-srun.sbatch": (H100, "srun"),
    "h100_ib-torchrun.sbatch": (H100, "torchrun"),
    "local-srun.sbatch": (LOCAL, "srun"),
    "local-srun-spares.sbatch": ([*LOCAL, "launcher.spare_nodes=1"], "srun"),  # + 1 idle node, --no-kill
}


def _rendered(overrides: list[str], style: str) -> str:
    cfg = compose(overrides)
    return render_for(cfg, overrides=overrides, style=style, python="python", workdir="/opt/meshjob")


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_script_matches_its_golden_example(name: str) -> None:
    overrides, style = CASES[name]
    text = _rendered(overrides, style)
    path = EXAMPLES / name
    refusal = update_refusal(os.environ)
    if refusal:
        pytest.fail(refusal)
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"{path} is stale: MESHJOB_UPDATE_GOLDEN=1 pytest {__file__}"
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_h100_script_carries_the_headers_sites_expect() -> None:
    text = _rendered(*CASES["h100_ib-srun.sbatch"])
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --time=04:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --open-mode=append",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=my-account",
        "srun --kill-on-bad-exit=0",
        "export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
        "module load cuda/12.4",
    ):
        assert line in text, line
    torchrun = _rendered(*CASES["h100_ib-torchrun.sbatch"])
    assert "#SBATCH --ntasks-per-node=1" in torchrun and "#SBATCH --cpus-per-task=96" in torchrun
    assert "--nproc-per-node=8" in torchrun


def test_values_are_shell_quoted_so_they_arrive_verbatim(tmp_path: Path) -> None:
    hostile = "a b'c\"$(touch " + str(tmp_path / "pwned") + ")`id`;"
    text = render(
        job_name="x y",
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=1,
        time_min=5,
        signal_delay_s=60,
        run_dir=str(tmp_path / "run dir"),
        workdir=str(tmp_path),
        python="python",
        overrides=[f"train.note={hostile}"],
        env={"WEIRD": hostile},
        partition="p q",
    )
    exports = [l for l in text.splitlines() if l.startswith(("export ", "RUN_DIR="))]
    out = subprocess.run(
        ["bash", "-c", "\n".join(exports) + '\nprintf "%s\\n%s" "$WEIRD" "$RUN_DIR"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == f"{hostile}\n{tmp_path / 'run dir'}"
    assert not (tmp_path / "pwned").exists()
    assert "#SBATCH --job-name='x y'" in text and "#SBATCH --partition='p q'" in text
    assert "'train.note=a b'\"'\"'c" in text


def test_unknown_style_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="sbatch.style=mpirun: not one of srun, torchrun"):
        render(
            style="mpirun",
            job_name="x",
            nodes=1,
            tasks_per_node=1,
            cpus_per_task=1,
            time_min=5,
            signal_delay_s=60,
            run_dir="/r",
            workdir="/w",
            python="python",
        )


def test_cli_refuses_an_invalid_config_naming_the_knob() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.sbatch",
            "launcher=slurm",
            "cluster=h100_ib",
            "run.dir=/lustre/meshjob/runs/x",
            "launcher.tasks_per_node=4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "launcher.tasks_per_node(4) != cluster.gpus_per_node(8)" in r.stderr


@pytest.mark.parametrize("style", ["srun", "torchrun"])
def test_every_step_a_rendered_script_runs_is_one_jobs_launch_slurm_accepts(style: str) -> None:
    # Found when the supervisor replaced --prepare/--rank: the torchrun style still ran them and got "usage".
    import re

    commands = "\n".join(l for l in _rendered(LOCAL, style).splitlines() if not l.lstrip().startswith("#"))
    modes = set(re.findall(r"-m jobs\.launch\.slurm (--[a-z-]+)", commands))
    assert modes == ({"--supervise"} if style == "srun" else {"--prepare", "--agent", "--rank", "--after-agents"})
    for mode in modes - {"--agent"}:  # the agent takes torchrun's arguments, not overrides
        r = subprocess.run(
            [sys.executable, "-m", "jobs.launch.slurm", mode, "no_such_group.key=1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "config error" in r.stderr and "usage" not in r.stderr, (mode, r.stderr[-500:])


def test_golden_files_are_never_rewritten_under_ci() -> None:
    assert "never by CI" in update_refusal({"MESHJOB_UPDATE_GOLDEN": "1", "CI": "true"})
    assert update_refusal({"MESHJOB_UPDATE_GOLDEN": "1"}) is None  # by hand, after a deliberate change
    assert update_refusal({"CI": "true"}) is None
    # and CI's own script clears the variable before pytest runs
    ci = (REPO / ".ci" / "run").read_text()
    assert "unset PYTEST_ADDOPTS MESHJOB_UPDATE_GOLDEN" in ci and "export CI=true" in ci
