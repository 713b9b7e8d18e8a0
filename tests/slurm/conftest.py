"""Fixtures of the slurm tier: the real local cluster (started by scripts/slurm/start) and helpers that ask sacct/scontrol."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.slurm.slurm_helpers import REPO


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Starts the local cluster (idempotent); stops it afterwards only if this session started it."""
    if os.geteuid() != 0:
        pytest.fail("the slurm tier needs root: scripts/slurm/start writes /etc/slurm and starts daemons")
    was_up = subprocess.run([REPO / "scripts/slurm/status"], capture_output=True).returncode == 0
    subprocess.run([REPO / "scripts/slurm/start"], check=True, timeout=300)
    yield
    if not was_up and os.environ.get("MESHJOB_SLURM_KEEP") != "1":
        subprocess.run([REPO / "scripts/slurm/stop"], check=True, timeout=120)


@pytest.fixture
def run_root() -> Path:
    """A fresh directory under cluster.run_root (conf/cluster/local.yaml: runs/, relative to the repo)."""
    d = REPO / "runs" / f"test-slurm-{uuid.uuid4().hex[:8]}"
    return d
