"""Fixtures of the multiproc tier: uninterrupted runs of `python -m jobs.train` shared by the tests that compare with them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TrainRun, run_train


def _fingerprint(run_dir: Path) -> list[tuple[str, int, int]]:
    """Every file under the run dir with its size and modification time (what a write into it would change)."""
    return sorted(
        (str(p.relative_to(run_dir)), p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()
    )


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory) -> Callable[..., TrainRun]:
    """overrides -> the finished run of exactly that config, trained on first use and shared by every test of the
    session that asks for the same override list (tests/multiproc/_references.py names the shared configs). The
    run must have succeeded. Its directory is read-only by contract (copy a checkpoint out to resume from it):
    each later use checks that no file in it changed, so a test that wrote into it fails the next one that reads it."""
    made: dict[tuple[str, ...], tuple[TrainRun, list[tuple[str, int, int]]]] = {}

    def get(overrides: list[str], *, timeout: float = 300) -> TrainRun:
        key = tuple(overrides)
        if key not in made:
            run = run_train(list(key), tmp_path_factory.mktemp("shared") / "run", timeout=timeout)
            assert run.returncode == 0, f"shared run {list(key)} failed: {run.stderr[-3000:]}"
            made[key] = run, _fingerprint(run.run_dir)
        run, files = made[key]
        assert _fingerprint(run.run_dir) == files, f"a test wrote into the shared run {run.run_dir} ({list(key)})"
        return run

    return get
