"""The chaos tier runs on the same real local cluster as the slurm tier (its fixtures are shared)."""

from tests.slurm.conftest import run_root, slurm_cluster  # noqa: F401 - fixtures
