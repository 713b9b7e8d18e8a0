"""Where `python -m jobs.calibrate` writes its profile by default (the user's config folder, not the package's conf/,
which is site-packages once installed), and that `cluster=<name>_calibrated` composes it from there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jobs import calibrate
from jobs.cli import main_for
from jobs.config import CONF_DIR, compose, user_conf_dir

FIGURES = {"calibrated": "2026-12-06T00:00:00Z `python -m jobs.calibrate` (test)", "fs_fsync_s": 0.004}


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    """A user whose XDG_CONFIG_HOME is tmp_path/xdg, working in another directory (tmp_path/elsewhere)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def test_the_user_config_folder_honours_an_absolute_xdg_config_home_only(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert user_conf_dir() == tmp_path / "meshjob"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/dir")  # the XDG spec: a relative path is ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_conf_dir() == tmp_path / "home" / ".config" / "meshjob"


def test_the_default_profile_goes_to_the_user_config_folder_and_composes_from_any_directory(home: Path) -> None:
    out = calibrate.write(compose([]), FIGURES)
    assert out == home / "xdg" / "meshjob" / "cluster" / "local_calibrated.yaml"
    assert not out.resolve().is_relative_to(CONF_DIR.resolve())
    assert out.read_text().startswith("# This machine: CPU ranks over gloo")  # the local profile's comments kept
    cfg = compose(["cluster=local_calibrated"])
    assert (cfg.cluster.name, cfg.cluster.fs_fsync_s, cfg.cluster.calibrated) == (
        "local_calibrated",
        0.004,
        FIGURES["calibrated"],
    )
    assert cfg.cluster.node_mtbf_hours == 50000.0  # the rest from conf/cluster/local.yaml


def test_a_user_profile_composes_behind_hydras_flags_too(home: Path, monkeypatch) -> None:
    # `-m` and `--cfg` go through @hydra.main, which reads the primary config's hydra.searchpath itself
    calibrate.write(compose([]), FIGURES)
    seen = []
    argv = ["-m", "cluster=local_calibrated", f"hydra.sweep.dir={home / 'sweep'}"]
    monkeypatch.setattr(sys, "argv", ["plan", *argv])  # @hydra.main reads sys.argv
    assert main_for(lambda cfg: seen.append(cfg) or 0, argv, command="plan") == 0
    assert [(c.cluster.name, c.cluster.fs_fsync_s) for c in seen] == [("local_calibrated", 0.004)]


def test_a_calibration_of_a_users_own_profile_starts_from_it(home: Path) -> None:
    mine = home / "xdg" / "meshjob" / "cluster" / "mine.yaml"
    mine.parent.mkdir(parents=True)
    local = (CONF_DIR / "cluster" / "local.yaml").read_text()
    mine.write_text(
        "# my cluster\n" + local.replace("name: local", "name: mine").replace("time_min: 30", "time_min: 7")
    )
    out = calibrate.write(compose(["cluster=mine"]), FIGURES)
    assert out == mine.parent / "mine_calibrated.yaml" and out.read_text().startswith("# my cluster\n")
    cfg = compose(["cluster=mine_calibrated"])
    assert (cfg.cluster.name, cfg.cluster.time_min, cfg.cluster.fs_fsync_s) == ("mine_calibrated", 7, 0.004)


def test_an_explicit_calibrate_out_is_written_where_it_says(home: Path) -> None:
    out = calibrate.write(compose([f"calibrate.out={home / 'p.yaml'}"]), FIGURES)
    assert out == home / "p.yaml" and "fs_fsync_s: 0.004" in out.read_text()
    assert not (home / "xdg").exists()
