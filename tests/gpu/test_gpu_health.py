"""On CUDA: the rank's GPU health check runs through the real NVML and names the GPU NVML knows.

Not yet run on a GPU (tests/unit/test_health.py covers the logic
behind a fake NVML)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.events import read_events
from jobs.telemetry.health import open_nvml
from tests.conftest import run_train

pytestmark = pytest.mark.gpu


def test_a_gpu_run_checks_its_gpu_through_nvml_and_names_it_by_the_uuid_and_bus_id_nvml_reports(
    data_path: str, tmp_path: Path
) -> None:
    run = run_train(
        [
            "mesh=single",
            "launcher.tasks_per_node=1",
            "train.device=cuda",
            "train.steps=2",
            "checkpoint.enabled=false",
            f"data.path={data_path}",
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (e,) = read_events(tmp_path / "events.jsonl", "gpu_health")
    assert e["level"] in ("ok", "warning"), e  # a failing GPU would have ended the run
    assert "temperature_c" not in e["unsupported"] and "clock_events" not in e["unsupported"], e
    nvml, why = open_nvml()
    assert nvml is not None, why
    # NVML's own answer for the UUID the rank derived from torch's device properties
    pci = nvml.lib.nvmlDeviceGetPciInfo(nvml.handle_by_uuid(e["gpu"])).busId
    assert (pci.decode() if isinstance(pci, bytes) else pci).upper() == e["pci_bus_id"].upper(), e
