"""GPU health (jobs/telemetry/health.py) behind a fake NVML: what fails, what warns, what is skipped, and the
incident a failing GPU becomes. The pynvml calls themselves need a GPU (not run here)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig, compose
from jobs.events import EventLog, read_events
from jobs.failure import quarantine, respond
from jobs.failure.incident import write_incident
from jobs.failure.respond import AttemptContext, conclude
from jobs.telemetry import health
from jobs.telemetry.health import GpuHealth, GpuId, NotSupported, Sample, assess, open_nvml

CFG = FailureConfig()
SW_THERMAL, SW_POWER_CAP, GPU_IDLE = 0x20, 0x4, 0x1
GPU0 = GpuId(uuid="GPU-aaaa0000-0000-0000-0000-000000000000", pci_bus_id="00000000:18:00.0", cuda_index=0)
GPU1 = GpuId(uuid="GPU-bbbb1111-1111-1111-1111-111111111111", pci_bus_id="00000000:3B:00.0", cuda_index=1)


class FakeNvml:
    """Two GPUs found by UUID or PCI bus id; per GPU a reading, None for a query NVML does not support."""

    def __init__(self, **gpus: dict) -> None:
        self.gpus = gpus  # handle -> {"uuid", "pci", field: value}
        self.pending_xids: dict[str, list[int]] = {h: [] for h in gpus}

    def handle_by_uuid(self, uuid: str) -> str:
        return next(h for h, g in self.gpus.items() if g["uuid"] == uuid)

    def handle_by_pci_bus_id(self, pci_bus_id: str) -> str:
        return next(h for h, g in self.gpus.items() if g["pci"] == pci_bus_id)

    def _get(self, handle: str, name: str):
        value = self.gpus[handle].get(name)
        if value is None:
            raise NotSupported(name)
        return value

    def temperature_c(self, handle):
        return self._get(handle, "temperature_c")

    def clock_events(self, handle):
        return self._get(handle, "clock_events")

    def ecc_uncorrected(self, handle):
        return self._get(handle, "ecc_uncorrected")

    def remapped_rows(self, handle):
        return self._get(handle, "remapped_rows")

    def retired_pages_pending(self, handle):
        return self._get(handle, "retired_pages_pending")

    def watch_xids(self, handle) -> None:
        pass

    def xids(self, handle):
        out, self.pending_xids[handle] = self.pending_xids[handle], []
        return out


def healthy(gpu: GpuId, **over) -> dict:
    return {
        "uuid": gpu.uuid,
        "pci": gpu.pci_bus_id,
        "temperature_c": 55,
        "clock_events": GPU_IDLE,
        "ecc_uncorrected": 0,
        "remapped_rows": (0, 0, False, False),
        "retired_pages_pending": None,
        **over,
    }


def monitor(nvml, gpu: GpuId | None, tmp_path: Path, *, rank: int, node: str, incidents: list, cfg=CFG) -> GpuHealth:
    events = EventLog(tmp_path / "events.jsonl", rank=rank, attempt="7.0")
    return GpuHealth(
        nvml,
        gpu=gpu,
        cfg=cfg,
        rank=rank,
        node=node,
        attempt="7.0",
        emit=events.emit,
        on_failing=incidents.append,
        skipped="no GPU: skipped (NVML did not start)",
    )


def test_a_thermally_throttled_gpu_is_an_incident_naming_it_and_its_node_and_the_healthy_one_is_not(
    tmp_path: Path,
) -> None:
    nvml = FakeNvml(h0=healthy(GPU0), h1=healthy(GPU1, temperature_c=91, clock_events=SW_THERMAL))
    incidents: list = []
    ok = monitor(nvml, GPU0, tmp_path, rank=0, node="node1", incidents=incidents).start()
    hot = monitor(nvml, GPU1, tmp_path, rank=1, node="node2", incidents=incidents).start()
    ok.stop(), hot.stop()
    (inc,) = incidents
    assert inc.cls == "unhealthy_gpu" and inc.reported_by == 1
    assert inc.summary == (
        f"GPU {GPU1.uuid} (PCI 00000000:3B:00.0, cuda:1) of rank 1 on node node2: "
        "clock event sw_thermal_slowdown at 91 C"
    )
    (s,) = inc.suspects
    assert (s["node"], s["gpu"], s["pci_bus_id"], s["checks"]) == (
        "node2",
        GPU1.uuid,
        GPU1.pci_bus_id,
        ["clock_events"],
    )
    write_incident(tmp_path, inc)
    assert json.loads((tmp_path / "incidents/7.0/incident.json").read_text())["suspects"][0]["gpu"] == GPU1.uuid
    levels = {e["rank"]: (e["level"], e["gpu"]) for e in read_events(tmp_path / "events.jsonl", "gpu_health")}
    assert levels == {0: ("ok", GPU0.uuid), 1: ("failing", GPU1.uuid)}


@pytest.mark.parametrize("known", [dict(uuid="MIG-parent-not-known"), dict(pci="00000000:99:00.0")])
def test_the_gpu_is_found_by_uuid_or_else_by_pci_bus_id(known: dict) -> None:
    nvml = FakeNvml(h1=healthy(GPU1, clock_events=0x8, **known), h0=healthy(GPU0, uuid="GPU-other", pci="other"))
    m = GpuHealth(
        nvml, gpu=GPU1, cfg=CFG, rank=0, node="n", attempt="a", emit=lambda *a, **k: None, on_failing=lambda inc: None
    )
    m.check(), m.check()  # a clock event counts from its third sample in a row
    assert [f.detail for f in m.check()] == ["clock event hw_slowdown at 55 C"]


def test_without_nvml_the_check_is_skipped_with_one_event_from_rank_0(tmp_path: Path) -> None:
    incidents: list = []
    for rank in (0, 1):
        m = monitor(None, None, tmp_path, rank=rank, node="node1", incidents=incidents).start()
        assert m.check() == [] and m.check() == []
    (e,) = read_events(tmp_path / "events.jsonl", "gpu_health")
    assert (e["rank"], e["level"], e["reason"]) == (0, "skipped", "no GPU: skipped (NVML did not start)")
    assert incidents == []


def test_on_a_machine_without_an_nvidia_driver_nvml_does_not_open_and_says_why() -> None:
    nvml, why = open_nvml()
    if nvml is not None:
        pytest.skip("NVML starts on this machine")
    assert why.startswith(("NVML did not start", "nvidia-ml-py is not installed")), why


@pytest.mark.parametrize(
    ("sample", "failing", "warning"),
    [
        (dict(clock_events=0x40 | 0x1), ["clock_events"], []),  # HW thermal slowdown
        (dict(clock_events=0x80), ["clock_events"], []),  # HW power brake
        (dict(clock_events=SW_POWER_CAP), [], ["clock_events"]),  # at the power limit: normal under load
        (dict(temperature_c=88), [], ["temperature"]),  # hot, not throttled yet
        (dict(temperature_c=92, clock_events=SW_THERMAL), ["clock_events"], []),  # the throttle says it all
        (dict(ecc_uncorrected=2), ["ecc"], []),
        (dict(remapped_rows=(3, 1, True, False)), ["remapped_rows"], []),
        (dict(remapped_rows=(3, 1, False, False)), [], []),  # remapped and done: the GPU is fine
        (dict(retired_pages_pending=True), ["retired_pages"], []),
        (dict(xids=(79, 13)), ["xid"], ["xid"]),  # fallen off the bus; an illegal address (the program's own)
        (dict(), [], []),
    ],
)
def test_what_fails_and_what_warns(sample: dict, failing: list, warning: list) -> None:
    base = dict(
        temperature_c=60, clock_events=0, ecc_uncorrected=0, remapped_rows=None, retired_pages_pending=None, xids=()
    )
    found = assess(Sample(**{**base, **sample}), temp_warn_c=85, failing_xids=CFG.health_failing_xids)
    assert [f.check for f in found if f.failing] == failing
    assert [f.check for f in found if not f.failing] == warning


def test_a_warning_is_an_event_when_it_appears_not_on_every_check(tmp_path: Path) -> None:
    nvml = FakeNvml(h0=healthy(GPU0))
    incidents: list = []
    m = monitor(nvml, GPU0, tmp_path, rank=0, node="node1", incidents=incidents)
    m.check()
    nvml.gpus["h0"]["temperature_c"] = 87
    m.check(), m.check()
    nvml.pending_xids["h0"] = [13]
    m.check()
    got = [(e["level"], [f["check"] for f in e["findings"]]) for e in read_events(tmp_path / "events.jsonl")]
    assert got == [("ok", []), ("warning", ["temperature"]), ("warning", ["temperature", "xid"])]
    assert incidents == []


def test_a_failing_gpu_reports_one_incident_and_none_after_stop(tmp_path: Path) -> None:
    nvml = FakeNvml(h0=healthy(GPU0, ecc_uncorrected=1))
    incidents: list = []
    m = monitor(nvml, GPU0, tmp_path, rank=0, node="node1", incidents=incidents)
    m.check(), m.check()
    assert [i.cls for i in incidents] == ["unhealthy_gpu"]
    finished = monitor(nvml, GPU0, tmp_path, rank=0, node="node1", incidents=(late := []))
    finished.stop()
    finished.check()
    assert late == []


def test_the_periodic_thread_finds_a_gpu_that_throttles_after_the_start(tmp_path: Path) -> None:
    nvml = FakeNvml(h0=healthy(GPU0))
    incidents: list = []
    found = threading.Event()
    cfg = FailureConfig(health_every_s=0.05)  # below validate's 1 s floor: only to keep the test short
    m = GpuHealth(
        nvml,
        gpu=GPU0,
        cfg=cfg,
        rank=0,
        node="node1",
        attempt="7.0",
        emit=lambda *a, **k: None,
        on_failing=lambda inc: (incidents.append(inc), found.set()),
    ).start()
    assert incidents == []
    nvml.gpus["h0"]["clock_events"] = 0x40
    assert found.wait(10)
    m.stop()
    assert [i.suspects[0]["gpu"] for i in incidents] == [GPU0.uuid]


def test_an_unhealthy_gpu_requeues_the_job_with_its_node_quarantined_without_probing_it(
    tmp_path: Path, monkeypatch
) -> None:
    calls: list = []
    monkeypatch.setattr(respond, "slurm_intent", lambda job, restart_count: None)
    monkeypatch.setattr(respond, "probe_nodes", lambda job, nodes, timeout_s: calls.append(f"probe {nodes}") or {})
    monkeypatch.setattr(respond, "requeue_excluding", lambda job, nodes: calls.append(nodes) or (True, ""))
    monkeypatch.setattr(respond, "usable_nodes", lambda partition, excluded: ["node1", "node3"])
    incidents: list = []
    throttled = monitor(
        FakeNvml(h1=healthy(GPU1, clock_events=0x40)), GPU1, tmp_path, rank=1, node="node2", incidents=incidents
    )
    throttled.check(), throttled.check(), throttled.check()  # a clock event counts from its third sample in a row
    events = EventLog(tmp_path / "events.jsonl", rank=1, attempt="7.0")
    ctx = AttemptContext(
        run_dir=str(tmp_path),
        attempt="7.0",
        rank=1,
        world_size=2,
        job_id="7",
        restart_count=0,
        cfg=CFG,
        events=events,
        supervised=True,
        nodes_needed=2,
    )
    assert conclude(ctx, cause="unhealthy_gpu", step=3, incident=incidents[0]) == exitcodes.REQUEUE
    assert calls == [["node2"]] and [e["node"] for e in quarantine.quarantined(tmp_path)] == ["node2"]
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "requeue"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("failure.health_every_s=0.5", "failure.health_every_s(0.5) must be 0"),
        ("failure.health_temp_warn_c=0", "failure.health_temp_warn_c(0.0) is not a GPU temperature"),
        ("failure.health_failing_xids=[48,-1]", "failure.health_failing_xids has [-1]"),
    ],
)
def test_health_settings_out_of_range_are_refused_naming_the_override(override: str, says: str) -> None:
    from jobs.validate import validate

    with pytest.raises(ValueError, match=re.escape(says)):
        validate(compose(["run.dir=/nonexistent", override]))


def test_the_default_settings_check_every_minute_and_fail_the_listed_xids() -> None:
    f = compose(["run.dir=/nonexistent"]).failure
    assert (f.health_every_s, f.health_temp_warn_c) == (60.0, 85.0) and 79 in f.health_failing_xids
    assert health.CLOCK_EVENTS[0x4] == ("sw_power_cap", False)


def test_every_pynvml_name_the_real_seam_uses_exists_in_the_installed_nvidia_ml_py() -> None:
    pynvml = pytest.importorskip("pynvml")
    source = Path(health.__file__).read_text()
    names = set(re.findall(r"\blib\.(\w+)", source)) - {"nvmlDeviceGetCurrentClocksEventReasons"}  # has a fallback
    assert len(names) >= 15, names
    assert sorted(n for n in names if not hasattr(pynvml, n)) == []


def test_a_gpu_nvml_has_lost_is_failing_even_before_it_has_a_handle(tmp_path: Path) -> None:
    class LostNvml(FakeNvml):
        def handle_by_uuid(self, uuid: str):
            raise health.GpuLost("GPU is lost")

    incidents: list = []
    monitor(LostNvml(h0=healthy(GPU0)), GPU0, tmp_path, rank=0, node="node1", incidents=incidents).start()
    assert [(i.cls, i.suspects[0]["checks"]) for i in incidents] == [("unhealthy_gpu", ["gpu_lost"])]


def test_one_sample_of_a_clock_event_is_a_warning_and_only_consecutive_samples_fail_the_gpu(tmp_path: Path) -> None:
    """NVML's clock-event reasons are a moment's state: a brief HW slowdown in one sample must not end a job;
    CLOCK_EVENT_SAMPLES in a row do."""
    from jobs.telemetry.health import CLOCK_EVENT_SAMPLES

    nvml = FakeNvml(h0=healthy(GPU0))
    incidents: list = []
    m = monitor(nvml, GPU0, tmp_path, rank=0, node="node1", incidents=incidents)
    m.check()
    for blip in (0x8, 0, 0x40, 0x40, 0, 0x8):  # throttled now and then, never three samples in a row
        nvml.gpus["h0"]["clock_events"] = blip
        found = m.check()
        assert not any(f.failing for f in found), found
    assert incidents == [] and CLOCK_EVENT_SAMPLES == 3
    warned = [e for e in read_events(tmp_path / "events.jsonl", "gpu_health") if e["level"] == "warning"]
    assert "(sample 1 of 3 in a row before the GPU counts as failing)" in warned[0]["findings"][0]["detail"]
    nvml.gpus["h0"]["clock_events"] = 0x40
    m.check(), m.check()  # HW thermal slowdown in samples 1 and 2 of a row (the last blip was another event)
    assert incidents == []
    nvml.gpus["h0"]["temperature_c"] = 93  # the temperature in the text changes; the event is the same one
    assert [f.failing for f in m.check()] == [True]
    assert [i.summary.split(": ", 1)[1] for i in incidents] == ["clock event hw_thermal_slowdown at 93 C"]


def test_a_gpu_throttled_at_start_is_confirmed_before_training_and_a_blip_at_start_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs.telemetry import health

    class Blip(FakeNvml):  # HW slowdown in the first sample only
        def clock_events(self, handle):
            self.gpus[handle]["clock_events"], was = 0, super().clock_events(handle)
            return was

    monkeypatch.setattr(health, "CONFIRM_S", 0.01)
    cfg = FailureConfig(health_every_s=0)  # at start only: the confirming samples are taken there
    incidents: list = []
    monitor(
        FakeNvml(h0=healthy(GPU0, clock_events=0x8)), GPU0, tmp_path, rank=0, node="node1", incidents=incidents, cfg=cfg
    ).start()
    assert [i.suspects[0]["checks"] for i in incidents] == [["clock_events"]]
    monitor(
        Blip(h0=healthy(GPU0, clock_events=0x8)), GPU0, tmp_path, rank=0, node="node1", incidents=(late := []), cfg=cfg
    ).start()
    assert late == []
