"""One interval per checkpoint tier (checkpoint/tiers.py): the formula by hand, the combination against the filesystem
tier alone, the manager's RAM-tier interval from the same rule, and `jobs.plan`'s side-by-side table."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager, interval_steps, plan_interval
from checkpoint.tiers import (FILESYSTEM, MEMORY, PARTNER, combined_goodput, plan_tiers, tier_interval_s,
                              tier_shares, tiers_on)
from checkpoint.memory_capacity import capacity_error
from jobs.config import compose
from jobs.plan import main
from jobs.validate import validate


def test_each_tier_interval_is_daly_for_its_own_save_cost_and_the_failures_it_covers() -> None:
    # Job MTBF 10,000 s; 60% process failures (read from RAM), 30% node + 10% job (read from the filesystem: no
    # partner tier). By hand, Daly 2006 eq. 37, tau = sqrt(2 d M) (1 + sqrt(x)/3 + x/9) - d with x = d / (2M):
    #   RAM:        d = 2 s,  M = 10,000 / 0.6 = 16,666.7 s: sqrt(66,666.7) = 258.199; x = 6e-5;
    #               258.199 x 1.0025887 - 2 = 256.867 s
    #   filesystem: d = 30 s, M = 10,000 / 0.4 = 25,000 s:   sqrt(1.5e6) = 1224.745; x = 6e-4;
    #               1224.745 x 1.0082316 - 30 = 1204.83 s
    rows = {r.tier: r for r in plan_tiers(mtbf_s=10_000.0, process_share=0.6, node_share=0.3,
                                          costs={MEMORY: (2.0, 20.0), FILESYSTEM: (30.0, 300.0)})}
    assert rows[MEMORY].failures == ("process",) and rows[MEMORY].share == pytest.approx(0.6)
    assert rows[MEMORY].mtbf_s == pytest.approx(16_666.67, abs=0.01)
    assert rows[MEMORY].interval_s == pytest.approx(256.867, abs=1e-3)
    assert rows[FILESYSTEM].failures == ("node", "job") and rows[FILESYSTEM].mtbf_s == pytest.approx(25_000.0)
    assert rows[FILESYSTEM].interval_s == pytest.approx(1204.83, abs=1e-2)
    assert tier_interval_s(save_s=2.0, mtbf_s=None) is None  # a tier that covers no failure never needs to save


def test_the_filesystem_tier_alone_is_the_single_tier_daly_plan() -> None:
    # One rule: with only the filesystem tier every failure is read from it, at the job MTBF (checkpoint.interval).
    (row,) = plan_tiers(mtbf_s=3 * 3600.0, process_share=0.15, node_share=0.77, costs={FILESYSTEM: (5.0, 300.0)})
    single = plan_interval(delta=5.0, mtbf=3 * 3600.0, restart=300.0)
    assert row.share == 1.0 and row.interval_s == pytest.approx(single.interval_s)
    assert combined_goodput([row]) == pytest.approx(single.goodput)


def test_cheap_ram_saves_and_many_process_failures_beat_the_filesystem_tier_alone() -> None:
    # RAM save 0.5 s and a 20 s restart in the allocation against a 30 s filesystem save and a 300 s requeue; 60% of
    # the failures (one every 3 h) are process failures.
    kw = dict(mtbf_s=3 * 3600.0, process_share=0.6, node_share=0.3)
    both = plan_tiers(costs={MEMORY: (0.5, 20.0), FILESYSTEM: (30.0, 300.0)}, **kw)
    alone = plan_tiers(costs={FILESYSTEM: (30.0, 300.0)}, **kw)
    assert combined_goodput(both) > combined_goodput(alone) + 0.01
    assert combined_goodput(alone) == pytest.approx(plan_interval(delta=30.0, mtbf=3 * 3600.0, restart=300.0).goodput)
    # The filesystem tier saves less often once RAM covers the process failures.
    assert {r.tier: r for r in both}[FILESYSTEM].interval_s > alone[0].interval_s * 1.5


def test_partner_copies_cover_node_failures_only_with_a_hot_spare() -> None:
    ck = SimpleNamespace(memory_on=True, memory_replicas=1)
    assert tiers_on(ck, spare_nodes=0, nodes=2) == (True, False)  # no spare: a lost node means a requeue (filesystem)
    assert tiers_on(ck, spare_nodes=1, nodes=2) == (True, True)
    assert tiers_on(SimpleNamespace(memory_on=False, memory_replicas=1), spare_nodes=1, nodes=2) == (False, False)
    # memory_replicas null: a copy when the job has another node to hold it
    assert tiers_on(SimpleNamespace(memory_on=True, memory_replicas=None), spare_nodes=1, nodes=2) == (True, True)
    assert tiers_on(SimpleNamespace(memory_on=True, memory_replicas=None), spare_nodes=1, nodes=1) == (True, False)
    shares = tier_shares(process_share=0.15, node_share=0.77, memory=True, partner=True)
    assert shares == pytest.approx({MEMORY: 0.15, PARTNER: 0.77, FILESYSTEM: 0.08})
    assert tier_shares(process_share=0.15, node_share=0.77, memory=False, partner=False)[FILESYSTEM] == 1.0
    with pytest.raises(ValueError, match=r"failure.process_share\(0.5\) \+ failure.node_share\(0.7\) > 1"):
        validate(compose(["failure.process_share=0.5", "failure.node_share=0.7"]), training=False)  # before submit


def test_the_manager_sets_the_ram_interval_from_its_measured_save_by_the_same_rule(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    events: list[tuple[str, dict]] = []
    cfg = CheckpointConfig(memory_interval="auto", memory_dir=str(tmp_path / "shm"), async_mode="none")
    # A short MTBF (2 s, half of it process failures) keeps the interval a few dozen 0.05 s steps whatever a save
    # costs on this machine: Daly's interval is at most the MTBF of the failures covered (4 s = 80 steps).
    ck = CheckpointManager(tmp_path / "ckpt", cfg=cfg, mtbf_s=2.0, total_steps=10_000, run_id="tiers",
                           tier_shares={MEMORY: 0.5, FILESYSTEM: 0.5}, emit=lambda k, **f: events.append((k, f)))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    assert ck.memory_interval_steps() == 1  # nothing measured yet: the next step saves, to measure
    saved = []
    for step in range(1, 1000):
        if ck.memory_due(step):
            ck.save_memory(step)
            saved.append(step)
        ck.due(step, step_time_s=0.05)
        if len(saved) == 4:
            break
    last = [f for k, f in events if k == "checkpoint_interval" and f["tier"] == MEMORY][-1]
    # The process failures' MTBF is 2 s / 0.5 = 4 s; the interval is Daly's for the save cost measured.
    assert last["mtbf_s"] == pytest.approx(4.0)
    want = interval_steps(tier_interval_s(save_s=last["delta_s"], mtbf_s=4.0), 0.05)
    assert last["interval_steps"] == want == ck.memory_interval_steps() and want > 1
    set_at = {f["step"]: f["interval_steps"] for k, f in events if k == "checkpoint_interval" and f["tier"] == MEMORY}
    assert len(saved) == 4 and all(b - a == set_at[a] for a, b in zip(saved, saved[1:]))  # each save sets the next gap
    ck.close()


def test_plan_prints_the_tiers_side_by_side_with_the_combined_goodput(capsys) -> None:
    args = ["+experiment=llama3_8b", "plan.fake_backend=false", "plan.save_fixed_s=5", "plan.restart_overhead_s=300",
            "plan.restart_in_allocation_s=30", "failure.process_share=0.4", "failure.node_share=0.5"]
    assert main(args + ["plan.json=true"]) in (0, 1)
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    assert main(args) in (0, 1)
    out = capsys.readouterr().out
    rows = {r["tier"]: r for r in tiers["tiers"]}
    assert set(rows) == {MEMORY, FILESYSTEM}  # no partner copies without checkpoint.memory_replicas and a spare
    assert rows[MEMORY]["failures"] == ["process"] and rows[FILESYSTEM]["failures"] == ["node", "job"]
    for tier, r in rows.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"  {tier} ") and "%)" in ln)
        assert f"{r['interval_s']:.1f}" in line and f"{r['goodput']:.4f}" in line and f"{r['restart_s']:.1f}" in line
    m = re.search(r"combined expected goodput (\d\.\d{4}) vs filesystem tier alone (\d\.\d{4})", out)
    assert m and float(m[1]) == pytest.approx(tiers["goodput"], abs=1e-4)
    assert float(m[2]) == pytest.approx(tiers["filesystem_only_goodput"], abs=1e-4)
    assert tiers["goodput"] == pytest.approx(rows[MEMORY]["goodput"] * rows[FILESYSTEM]["goodput"])
    assert tiers["goodput"] > tiers["filesystem_only_goodput"]


def test_plan_credits_node_failures_to_the_partner_tier_with_a_hot_spare(capsys) -> None:
    # A spare's ranks read the lost node's state from the nodes that hold its copies (checkpoint/memory_tier.py), so
    # node failures are the partner tier's and the filesystem tier is read after job losses only.
    args = ["+experiment=llama3_8b", "plan.fake_backend=false", "plan.save_fixed_s=5", "plan.restart_overhead_s=300",
            "plan.restart_in_allocation_s=30", "failure.process_share=0.4", "failure.node_share=0.5", "launcher=slurm",
            "checkpoint.memory_replicas=1", "plan.json=true"]
    assert main([*args, "launcher.spare_nodes=1"]) in (0, 1)
    rows = {r["tier"]: r for r in json.loads(capsys.readouterr().out)["tiers"]["tiers"]}
    assert {t: r["failures"] for t, r in rows.items()} == {MEMORY: ["process"], PARTNER: ["node"], FILESYSTEM: ["job"]}
    assert rows[FILESYSTEM]["share"] == pytest.approx(0.1)
    assert main([*args, "launcher.spare_nodes=0"]) in (0, 1)  # no spare: a lost node is a requeue (filesystem)
    rows = {r["tier"]: r for r in json.loads(capsys.readouterr().out)["tiers"]["tiers"]}
    assert set(rows) == {MEMORY, FILESYSTEM} and rows[FILESYSTEM]["failures"] == ["node", "job"]


def test_a_ram_tier_on_through_auto_that_does_not_fit_names_the_auto_override() -> None:
    why = capacity_error([("n1", 3 << 30, 4 << 30)], memory_dir="/dev/shm", every=0, auto=True)
    assert why.startswith("checkpoint.memory_interval=auto: the RAM tier needs 6144.0 MiB on node n1")
    assert why.endswith("or set checkpoint.memory_interval=steps checkpoint.memory_every_steps=0")


def test_the_filesystem_tiers_auto_interval_counts_only_the_failures_it_is_read_after(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg = CheckpointConfig(interval="auto", async_mode="none", memory_interval="auto", memory_dir=str(tmp_path / "shm"))
    shares = tier_shares(process_share=0.6, node_share=0.3, memory=True, partner=False)  # filesystem: 0.4
    ck = CheckpointManager(tmp_path / "ckpt", cfg=cfg, mtbf_s=3600.0, total_steps=100, run_id="fs", tier_shares=shares)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    ck.due(1, step_time_s=0.01)
    ck.save(1)
    assert ck.last_plan["mtbf_s"] == pytest.approx(3600.0 / 0.4)
    assert ck.last_plan["interval_s"] == pytest.approx(tier_interval_s(save_s=ck.last_plan["delta_s"], mtbf_s=9000.0))
    ck.close()
