"""The chaos tier runs on the same real local cluster as the slurm tier (its fixtures are shared), against
uninterrupted reference runs made once per session and step count, each alongside the first test that needs it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.chaos.chaos_helpers import SHORT_STEPS, STEPS, Reference
from tests.slurm.conftest import run_root, slurm_cluster  # noqa: F401 - fixtures


@pytest.fixture(scope="session")
def chaos_references(tmp_path_factory) -> Iterator[Callable[[int], Reference]]:
    """steps -> the chaos config run uninterrupted (one local 2-rank run per step count), started on first use and
    shared by every chaos test of the session; it trains while that first test's job waits for Slurm."""
    made: dict[int, Reference] = {}

    def get(steps: int = STEPS) -> Reference:
        if steps not in made:
            made[steps] = Reference(
                tmp_path_factory.mktemp(f"chaos_ref{steps}") / "run",
                tmp_path_factory.mktemp(f"chaos_ref{steps}_pt"),
                steps,
            )
        return made[steps]

    yield get
    for reference in made.values():
        reference.stop()


@pytest.fixture
def reference(chaos_references) -> Reference:
    """The STEPS-step reference (see chaos_references)."""
    return chaos_references(STEPS)


@pytest.fixture
def short_reference(chaos_references) -> Reference:
    """The SHORT_STEPS-step reference (see chaos_references)."""
    return chaos_references(SHORT_STEPS)
