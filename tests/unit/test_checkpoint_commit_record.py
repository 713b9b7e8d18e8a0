"""A filesystem checkpoint that rank 0 committed is recorded (`checkpoint_saved`) even when sending the outcome to
the other ranks fails (a peer killed in between): the ledger never misses a checkpoint that a restart will load."""

from __future__ import annotations

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager


def test_a_commit_is_recorded_before_its_outcome_is_sent_to_the_ranks(tmp_path) -> None:
    # Seen with real ranks: rank 1 killed after it had sent its shard's record, rank 0 committed step 3, the send of
    # the outcome to rank 1 raised, and no `checkpoint_saved` of step 3 was written; the restart then loaded it.
    events: list[tuple[str, dict]] = []
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = CheckpointManager(
        tmp_path,
        cfg=CheckpointConfig(every_steps=1, async_mode="none"),
        emit=lambda kind, **f: events.append((kind, f)),
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])

    def peer_gone(obj):
        raise RuntimeError("Connection reset by peer")

    ck._io.bcast = peer_gone  # the outcome's broadcast from rank 0 on the commit's group, its last collective
    with pytest.raises(RuntimeError, match="Connection reset"):
        ck.save(3)
    assert (tmp_path / "step_3" / "manifest.json").exists()  # committed
    assert [(k, f["step"], f["tier"]) for k, f in events if k == "checkpoint_saved"] == [
        ("checkpoint_saved", 3, "filesystem")
    ]
