"""The chaos tier runs on the same real local cluster as the slurm tier (its fixtures are shared), against
uninterrupted reference runs made once per session and step count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.chaos_helpers import SHORT_STEPS, STEPS, reference_run
from tests.slurm.conftest import run_root, slurm_cluster  # noqa: F401 - fixtures


@pytest.fixture(scope="session")
def chaos_references(tmp_path_factory) -> Callable[[int], tuple[dict, Path]]:
    """steps -> (losses, final state) of the chaos config run uninterrupted, made on first use and shared by
    every chaos test of the session (one local 2-rank run per step count)."""
    made: dict[int, tuple[dict, Path]] = {}

    def get(steps: int = STEPS) -> tuple[dict, Path]:
        if steps not in made:
            made[steps] = reference_run(
                tmp_path_factory.mktemp(f"chaos_ref{steps}") / "run",
                tmp_path_factory.mktemp(f"chaos_ref{steps}_pt"),
                steps,
            )
        return made[steps]

    return get


@pytest.fixture
def reference(chaos_references) -> tuple[dict, Path]:
    """The STEPS-step reference (see chaos_references)."""
    return chaos_references(STEPS)


@pytest.fixture
def short_reference(chaos_references) -> tuple[dict, Path]:
    """The SHORT_STEPS-step reference (see chaos_references)."""
    return chaos_references(SHORT_STEPS)
