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
from jobs.commands import COMMANDS, own_keys
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
        argv = [a for a in argv if not a.startswith("sbatch.out=")]  # to stdout: sbatch.out would create RUN_DIR/slurm
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
    assert p.returncode == 0 and p.stdout.startswith("usage: meshjob status [run.dir=]RUN_DIR"), p.stderr


def test_no_command_takes_a_flag_other_than_help_only_key_value_arguments() -> None:
    usages = {c.name: c.usage + " " + " ".join(c.keys) + " " + " ".join(c.examples) for c in COMMANDS}
    assert {name: [w for w in text.split() if w.startswith("-")] for name, text in usages.items()} == dict.fromkeys(
        NAMES, []
    )


@pytest.mark.parametrize(
    ("command", "argv", "keys", "rest"),
    [
        ("status", ["runs/a"], {"run.dir": "runs/a"}, []),
        ("status", ["run.dir=runs/a"], {"run.dir": "runs/a"}, []),
        (
            "report",
            ["run.dir=runs/a", "report.out=/tmp/r", "report.plan=FALSE"],
            {"run.dir": "runs/a", "report.out": "/tmp/r", "report.plan": False},
            [],
        ),
        (
            "sbatch",
            ["sbatch.style=torchrun", "launcher=slurm", "+experiment=llama3_8b", "sbatch.out=a.sbatch"],
            {"sbatch.style": "torchrun", "sbatch.out": "a.sbatch"},
            ["launcher=slurm", "+experiment=llama3_8b"],
        ),
    ],
)
def test_own_keys_are_typed_and_the_other_arguments_are_the_config_overrides(command, argv, keys, rest) -> None:
    assert own_keys(command, argv) == (keys, rest)


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        (
            "report",
            ["runs/a", "report.outt=x"],
            "unknown argument 'report.outt=x' for meshjob report: did you mean report.out?",
        ),
        ("report", ["runs/a", "report.plan=maybe"], "report.plan=maybe: 'maybe' is not a bool (true or false)"),
        ("status", ["runs/a", "runs/b"], "unknown argument 'runs/b' for meshjob status"),
        (
            "sbatch",
            ["sbatch.styl=srun"],
            "unknown argument 'sbatch.styl=srun' for meshjob sbatch: did you mean sbatch.style?",
        ),
        ("sbatch", ["--verbose", "launcher=slurm"], "unknown argument '--verbose' for meshjob sbatch"),
    ],
)
def test_an_unknown_or_mistyped_own_key_is_refused_naming_it_and_the_closest(command, argv, message) -> None:
    with pytest.raises(ValueError) as err:
        own_keys(command, argv)
    assert str(err.value).startswith(message)


def test_the_old_flags_still_work_and_say_what_to_write_instead(capsys) -> None:
    assert own_keys("report", ["runs/a", "--no-plan", "--out", "/tmp/r"]) == (
        {"run.dir": "runs/a", "report.plan": False, "report.out": "/tmp/r"},
        [],
    )
    assert own_keys("sbatch", ["--style=torchrun", "-o", "a.sbatch", "mesh=single"]) == (
        {"sbatch.style": "torchrun", "sbatch.out": "a.sbatch"},
        ["mesh=single"],
    )
    assert capsys.readouterr().err.splitlines() == [
        "warning: meshjob report --no-plan is deprecated: use report.plan=false",
        "warning: meshjob report --out is deprecated: use report.out=/tmp/r",
        "warning: meshjob sbatch --style is deprecated: use sbatch.style=torchrun",
        "warning: meshjob sbatch -o is deprecated: use sbatch.out=a.sbatch",
    ]


def test_status_and_report_exit_2_naming_a_mistyped_key(tmp_path, capsys) -> None:
    (tmp_path / "events.jsonl").write_text("")
    assert meshjob.main(["status", f"run.dirr={tmp_path}"]) == 2
    assert "did you mean run.dir?" in capsys.readouterr().err
    assert meshjob.main(["report", str(tmp_path), "report.plan=no"]) == 2
    assert "report.plan=no: 'no' is not a bool (true or false)" in capsys.readouterr().err


def test_sbatch_writes_the_torchrun_style_to_the_file_sbatch_out_names(tmp_path, capsys) -> None:
    out = tmp_path / "job.sbatch"
    argv = ["launcher=slurm", f"cluster.run_root={tmp_path}", f"run.dir={tmp_path / 'run'}", "sbatch.style=torchrun"]
    assert meshjob.main(["sbatch", *argv, f"sbatch.out={out}"]) == 0
    assert "torchrun" in out.read_text() and (tmp_path / "run" / "slurm").is_dir()
    assert meshjob.main(["sbatch", *argv[:-1], "sbatch.style=mpirun"]) == 2
    assert "sbatch.style=mpirun: not one of srun, torchrun" in capsys.readouterr().err
