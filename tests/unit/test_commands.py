"""One command per job: `meshjob <command>` (and `python -m jobs.<module>`), each with a short --help that says what
it does, its main keys and two examples that work."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import meshjob
from jobs.cli import split_hydra_argv
from jobs.commands import COMMANDS
from jobs.config import compose

NAMES = [c.name for c in COMMANDS]


def test_meshjob_offers_every_command_named_in_the_issue() -> None:
    assert NAMES == ["train", "plan", "status", "report", "calibrate", "prepare-data", "sbatch"]


@pytest.mark.parametrize("name", NAMES)
def test_each_commands_help_says_what_it_does_its_keys_and_two_examples(name: str, capsys) -> None:
    assert meshjob.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"usage: meshjob {name}") and lines[1].startswith("   or: python -m jobs.")
    examples = lines[lines.index("examples:") + 1 :][:2]
    assert [e.split()[:2] for e in examples] == [["meshjob", name]] * 2
    assert ("main keys:" in lines or "arguments:" in lines) and len(lines) < 30
    assert "Powered by Hydra" not in out and "== Config ==" not in out  # not Hydra's dump


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.name != "sbatch" and c.overrides], ids=lambda c: c.name)
def test_the_examples_in_each_help_compose(command) -> None:
    for example in command.examples:
        flags, overrides = split_hydra_argv(shlex.split(example)[1:])
        assert flags == [] and compose(overrides) is not None


def test_the_sbatch_examples_render(capsys) -> None:
    (command,) = [c for c in COMMANDS if c.name == "sbatch"]
    for example in command.examples:
        argv = shlex.split(example)[1:]
        argv = argv[: argv.index("-o")] if "-o" in argv else argv  # to stdout: -o would create RUN_DIR/slurm
        assert meshjob.main(["sbatch", *argv]) == 0
        assert "#SBATCH --nodes=" in capsys.readouterr().out


def test_the_console_script_runs_a_command_and_refuses_an_unknown_key(tmp_path) -> None:
    script = Path(sys.executable).parent / "meshjob"
    ok = subprocess.run(
        [str(script), "plan", "mesh=single", "launcher.tasks_per_node=1", "plan.json=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["world_size"] == 1
    bad = subprocess.run(
        [str(script), "plan", "+train.stepz=5"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "did you mean train.steps?" in bad.stderr
    unknown = subprocess.run([str(script), "teach"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown command 'teach'" in unknown.stderr


def test_python_m_jobs_status_help_prints_the_help_and_exits_0(tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "jobs.status", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and p.stdout.startswith("usage: meshjob status RUN_DIR"), p.stderr
