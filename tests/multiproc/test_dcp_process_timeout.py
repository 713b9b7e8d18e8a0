"""The checkpoint's process groups are bounded by failure.checkpoint_timeout_s: the manager's own groups once the
collective timeout applies to the others, and, with checkpoint.async_mode=process, the gloo group of DCP's background
process (RecordingWriter sets it there, not gloo's 30-minute default, read back inside that process)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from checkpoint.writer import RecordingWriter
from tests.multiproc._ranks import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # slow: DCP spawns a fresh interpreter (~10 s)


class _ProbeWriter(RecordingWriter):
    """RecordingWriter that, after its set-up, writes its process's pid and default group's timeout beside the
    checkpoint (DCP pickles it into the background process, where it runs)."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        group = torch.distributed.distributed_c10d._get_default_group()
        timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        Path(self.path).mkdir(parents=True, exist_ok=True)
        (Path(self.path) / "probe.txt").write_text(f"{os.getpid()} {timeout}")


def _two_saves(rank: int, world_size: int, folder: str) -> list[tuple[int, float]]:
    """A save without, then one with collective_timeout_s=7, both in DCP's background process; what each saw."""
    out = []
    for name, timeout_s in (("without", None), ("with", 7.0)):
        path = Path(folder) / name
        dcp.async_save(
            {"w": torch.arange(4.0)},
            storage_writer=_ProbeWriter(path, thread_count=1, collective_timeout_s=timeout_s),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()
        pid, seen = (path / "probe.txt").read_text().split()
        out.append((int(pid), float(seen)))
    return out


def test_the_background_process_group_of_an_async_process_save_gets_the_collective_timeout(tmp_path: Path) -> None:
    res = run_ranks(_two_saves, 1, str(tmp_path), timeout=120.0)
    (without, with_), parent = res.results[0], os.getpid()
    assert without[0] == with_[0] != parent  # the same background process, not this one nor the rank's
    assert without[1] == 1800.0  # gloo's default: what the group kept before RecordingWriter set it
    assert with_[1] == 7.0


def _timeouts_after_the_first_step(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """A real CheckpointManager's groups, then the trainer's failure hooks at the end of the first step."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from checkpoint import CheckpointConfig, CheckpointManager
    from jobs.config import FailureConfig
    from jobs.events import EventLog
    from jobs.failure.resilience import Resilience
    from jobs.launch.env import DistEnv

    manager = CheckpointManager(
        Path(folder), cfg=CheckpointConfig(), rank=rank, world_size=world_size, checkpoint_timeout_s=1234.0
    )
    env = DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        node_rank=0,
        nodes=1,
        master_addr="",
        master_port=0,
    )
    resilience = Resilience(
        FailureConfig(collective_timeout_s=42.0, checkpoint_timeout_s=1234.0),
        env,
        mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",)),
        events=EventLog(Path(folder) / "events.jsonl", rank=rank),
        run_dir=folder,
        vocab_size=16,
    )
    resilience.attach(
        parts=[],
        data=SimpleNamespace(),  # a rollback's data skip is not what is tested
        load=lambda before_step=None: 0,
        schedulers=[],
        agree=lambda x: x,
        wait_for_saves=lambda: None,
        checkpoint_groups=lambda: manager.process_groups,
    )
    resilience.progress(1, first=True)
    seconds = {"world": _timeout_s(torch.distributed.group.WORLD)}
    seconds.update({f"checkpoint{i}": _timeout_s(pg) for i, pg in enumerate(manager.process_groups)})
    manager.close()
    return seconds


def _timeout_s(pg) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_the_checkpoint_groups_keep_the_checkpoint_timeout_once_the_collective_timeout_applies(tmp_path: Path) -> None:
    """A save on a slow filesystem waits in the checkpoint's groups for the slowest rank's write: they are bounded by
    failure.checkpoint_timeout_s (the watchdog's limit of a save), the other groups by failure.collective_timeout_s."""
    res = run_ranks(_timeouts_after_the_first_step, 2, str(tmp_path), timeout=120.0)
    assert res.results[0] == res.results[1] == {"world": 42.0, "checkpoint0": 1234.0, "checkpoint1": 1234.0}
