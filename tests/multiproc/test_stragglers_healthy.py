"""Healthy runs at the default straggler settings name nobody.

Before the checks judged windows of at least WINDOW_STEPS steps, `train.log_every=1` (the default) made
every step a judged interval: per-step CPU-time noise on a shared 2-core box named healthy ranks (9
straggler events in 6 of 9 healthy run directories; one 4-rank run named one rank three times at
1.57-1.66x in backward). Two clean 4-rank runs here, at the defaults (log_every 1, straggler_ratio 1.1,
straggler_intervals 3): 100 steps are 5 windows, 1 warm-up and 4 judged, and no straggler event.
"""

from __future__ import annotations

import pytest

from jobs.events import read_events
from tests.conftest import run_train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

STEPS = 100  # 5 windows of jobs.telemetry.stragglers.WINDOW_STEPS (20)


@pytest.mark.parametrize("run", [1, 2])
def test_a_healthy_four_rank_run_at_the_default_settings_names_no_straggler(tmp_path, data_path, run: int) -> None:
    r = run_train(
        [
            "mesh=single",
            "mesh.dp_shard=4",
            "launcher.tasks_per_node=4",
            f"train.steps={STEPS}",
            "checkpoint.enabled=false",
            f"data.path={data_path}",
            f"cluster.run_root={tmp_path}",
        ],
        tmp_path / "run",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.metrics()) == STEPS
    assert read_events(tmp_path / "run" / "events.jsonl", "straggler") == []
