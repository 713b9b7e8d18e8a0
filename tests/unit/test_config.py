"""Every option in conf/ composes, and bad overrides fail before anything runs, naming the override."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.cli import main_for
from jobs.config import CONF_DIR, compose
from jobs.launch.prepare import config_yaml
from jobs.validate import validate
from tests.conftest import run_train

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("experiment", "__pycache__"))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _yaml(path: Path) -> dict[str, Any]:
    body = yaml.safe_load(path.read_text()) or {}
    body.pop("defaults", None)
    return body


def _assert_holds(obj: Any, expected: dict[str, Any], where: str) -> None:
    """Every leaf of `expected` (a YAML body) is the composed value at the same place; interpolations
    (`${...}`, resolved from other groups) are skipped."""
    for key, want in expected.items():
        got = obj[key] if isinstance(obj, dict) else getattr(obj, key)
        if isinstance(want, dict):
            _assert_holds(got, want, f"{where}.{key}")
        elif not (isinstance(want, str) and "${" in want):
            got = list(got) if isinstance(got, tuple) else got
            assert got == want, f"{where}.{key}: composed {got!r}, the YAML says {want!r}"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_to_the_values_its_yaml_sets(group: str, option: str) -> None:
    cfg = compose([f"{group}={option}"])
    assert dataclasses.is_dataclass(getattr(cfg, group))
    _assert_holds(getattr(cfg, group), _yaml(CONF_DIR / group / f"{option}.yaml"), group)


@pytest.mark.parametrize("option", _options("experiment"))
def test_every_experiment_preset_composes_to_its_values_and_those_of_the_options_it_picks(option: str) -> None:
    path = CONF_DIR / "experiment" / f"{option}.yaml"
    cfg = compose([f"+experiment={option}"])
    preset = _yaml(path)
    for entry in yaml.safe_load(path.read_text()).get("defaults", []):
        for key, picked in entry.items() if isinstance(entry, dict) else []:
            group = key.removeprefix("override /")
            _assert_holds(
                getattr(cfg, group), {**_yaml(CONF_DIR / group / f"{picked}.yaml"), **preset.get(group, {})}, group
            )
    _assert_holds(cfg, preset, "experiment")


def test_default_is_tiny_on_8_local_ranks_pp2_dp_shard2_tp2() -> None:
    cfg = compose([])
    d = validate(cfg)
    assert (cfg.model.name, cfg.launcher.name, cfg.world_size) == ("tiny", "local", 8)
    assert (d.dims.pp, d.dims.dp_replicate, d.dims.dp_shard, d.dims.tp) == (2, 1, 2, 2)
    assert d.microbatches == 2 and d.tokens_per_step == 8 * 32


def test_dp_shard_minus_one_takes_the_remaining_ranks() -> None:
    d = validate(compose(["mesh.pp=1", "mesh.tp=2", "mesh.dp_shard=-1"]))
    assert d.dims.dp_shard == 4


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["mesh.tp=3"], "mesh.tp(3) = 12 != world size 8 (launcher.nodes(1) * launcher.tasks_per_node(8))"),
        (["mesh.tp=4", "mesh.pp=1", "mesh.dp_shard=2", "model.n_kv_heads=2"], "model.n_kv_heads(2) % mesh.tp(4)"),
        (
            ["mesh.tp=8", "mesh.pp=1", "mesh.dp_shard=1", "model.n_heads=4", "model.n_kv_heads=4"],
            "model.n_heads(4) % mesh.tp(8)",
        ),
        (["mesh.cp=2", "mesh.dp_shard=1", "train.seq_len=30"], "train.seq_len(30) % (2 * mesh.cp(2)) = 2 != 0"),
        (["mesh.ep=2"], "mesh.ep(2) > 1 but model.n_routed_experts(0) = 0: a dense model has no experts"),
        (["train.global_batch=6"], "train.global_batch(6) is not a multiple of dp(2) * train.micro_batch(2) = 4"),
        (["mesh.pp_microbatches=4"], "set mesh.pp_microbatches=2"),
        (
            ["mesh.pp=8", "mesh.dp_shard=1", "mesh.tp=1", "train.global_batch=16"],
            "model.n_layers(4) < pipeline stages mesh.pp(8)",
        ),
        (
            ["mesh.pp=4", "mesh.dp_shard=1", "mesh.tp=2", "mesh.pp_schedule=interleaved_1f1b", "train.global_batch=8"],
            "model.n_layers(4) < pipeline stages mesh.pp(4) * stages per rank(2) = 8",
        ),
        (
            ["train.global_batch=4", "train.micro_batch=1", "mesh.pp=4", "mesh.dp_shard=2", "mesh.tp=1"],
            "pipeline microbatches 2",
        ),
        (["mesh.pp_schedule=zigzag"], "mesh.pp_schedule='zigzag' is not one of"),
        (["checkpoint.keep=1"], "checkpoint.keep(1) must be >= 2"),
    ],
)
def test_invalid_config_names_the_override_and_the_arithmetic(overrides: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        validate(compose(overrides))
    assert needle in str(e.value)


def test_cli_refuses_bad_mesh_before_any_process_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = run_train(["mesh.tp=3"], run_dir, timeout=120)
    assert r.returncode == 2, r.stderr
    assert (
        "config error: mesh.pp(2) * mesh.dp_replicate(1) * mesh.dp_shard(2) * mesh.cp(1) * mesh.tp(3) = 12" in r.stderr
    )
    assert not run_dir.exists()  # nothing written on a config error
    assert "[rank" not in r.stdout + r.stderr  # no rank was started


@pytest.mark.parametrize(
    "override,needle",
    [
        ("mesh.tpp=2", "unknown key mesh.tpp: no such field in the config schema; did you mean mesh.tp?"),
        ("+mesh.tpp=2", "unknown key mesh.tpp: no such field in the config schema; did you mean mesh.tp?"),
        ("+train.stepz=5", "unknown key train.stepz: no such field in the config schema; did you mean train.steps?"),
        ("mesh.tp=two", "mesh.tp=two: Value 'two' of type 'str' could not be converted to Integer (key mesh.tp)"),
        ("model=gpt5", "gpt5"),
        ("checkpoint.keep=1", "checkpoint.keep(1) must be >= 2"),
    ],
)
def test_cli_refuses_unknown_keys_wrong_types_and_missing_options(tmp_path: Path, override: str, needle: str) -> None:
    run_dir = tmp_path / "run"
    r = run_train([override], run_dir, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("config error:") and needle in r.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("flags", [[], ["-m"], ["--cfg", "job"]])
def test_every_config_error_exits_2_with_its_cause_also_behind_a_hydra_flag(tmp_path: Path, flags: list[str]) -> None:
    cases = {
        "+mesh.tpp=2": "config error: unknown key mesh.tpp: no such field in the config schema; did you mean mesh.tp?",
        "mesh.tp=two": "Value 'two' of type 'str' could not be converted to Integer (key mesh.tp)",
        "model=gpt5": "Could not find 'model/gpt5'",
    }
    if flags == ["-m"]:
        cases["mesh.tp=1,two"] = "Value 'two' of type 'str' could not be converted to Integer (key mesh.tp)"
    for override, needle in cases.items():
        p = subprocess.run(
            [sys.executable, "-m", "jobs.plan", *flags, override],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (p.returncode, needle in p.stderr) == (2, True), (override, p.returncode, p.stderr[-2000:])


def test_the_command_line_and_each_sweep_points_overrides_are_recorded_in_the_config(monkeypatch, tmp_path) -> None:
    seen = []
    assert main_for(lambda cfg: seen.append(cfg) or 0, ["mesh=single", "train.steps=3"], command="plan") == 0
    assert seen[0].run.overrides == ["mesh=single", "train.steps=3"]
    assert seen[0].run.command == shlex.join(sys.orig_argv)
    assert "  overrides:\n  - mesh=single\n  - train.steps=3\n" in config_yaml(seen[0])
    argv = ["-m", "mesh=single", "train.steps=1,2", f"hydra.sweep.dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", ["plan", *argv])  # @hydra.main reads sys.argv
    monkeypatch.chdir(tmp_path)
    assert main_for(lambda cfg: seen.append(cfg) or 0, argv, command="plan") == 0
    assert [c.run.overrides for c in seen[1:]] == [["mesh=single", "train.steps=1"], ["mesh=single", "train.steps=2"]]


def test_the_schema_is_stored_once_per_process_not_at_every_compose(monkeypatch) -> None:
    from hydra.core.config_store import ConfigStore

    compose([])
    stored: list[str] = []
    store = ConfigStore.store
    monkeypatch.setattr(
        ConfigStore, "store", lambda self, *a, **k: stored.append(k.get("name")) or store(self, *a, **k)
    )
    cfg = compose(["mesh.tp=2"])  # OmegaConf.structured of the whole JobConfig tree took 40-50 ms of each
    assert stored == [] and cfg.mesh.tp == 2
