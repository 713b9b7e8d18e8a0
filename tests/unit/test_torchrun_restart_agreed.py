"""Under torchrun, every rank of a restarted worker group names the same attempt, whatever each agent's
TORCHELASTIC_RESTART_COUNT says (the agent that restarts its healthy ranks on a membership change counts
nothing): the ranks count their own starts in the agents' store. Seen in CI: rank 0 waited in the PrefixStore of
attempt 367.0, rank 1 in 367.0.1, until the watchdog requeued the job."""

from __future__ import annotations

import torch.distributed as dist

from jobs.launch.env import DistEnv
from jobs.launch.rendezvous import agreed_torchrun_restart


def _rank_env(rank: int, port: int, agent_restarts: int) -> DistEnv:
    return DistEnv.from_environ(
        {
            "TORCHELASTIC_RUN_ID": "367",
            "TORCHELASTIC_RESTART_COUNT": str(agent_restarts),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SLURM_JOB_ID": "367",
            "SLURM_RESTART_COUNT": "0",
        }
    )


def test_ranks_whose_agents_counted_the_restart_differently_name_one_attempt(monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    agents = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # outlives the ranks
    first = [agreed_torchrun_restart(_rank_env(r, agents.port, 0), timeout_s=10) for r in (0, 1)]
    assert [e.attempt for e in first] == ["367.0", "367.0"]
    # Rank 1 was killed: node2's agent counts a restart; node1's restarts rank 0 on the new round, counting none.
    raw = [_rank_env(0, agents.port, 0), _rank_env(1, agents.port, 1)]
    assert [e.attempt for e in raw] == ["367.0", "367.0.1"]  # what the ranks named before: never meeting
    second = [agreed_torchrun_restart(e, timeout_s=10) for e in raw]
    assert [e.attempt for e in second] == ["367.0.1", "367.0.1"]


def test_without_the_agents_store_the_env_is_left_as_it_is(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    env = _rank_env(1, 1, 2)  # no store there: a connection attempt would fail
    assert agreed_torchrun_restart(env, timeout_s=1) is env
