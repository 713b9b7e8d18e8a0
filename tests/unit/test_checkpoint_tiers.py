"""One interval per checkpoint tier (checkpoint/tiers.py): the formula by hand, the combination against the filesystem
tier alone, the manager's RAM-tier interval from the same rule, and `jobs.plan`'s side-by-side table."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager, interval_steps, plan_interval
from checkpoint.memory_capacity import capacity_error
from checkpoint.tiers import (
    FILESYSTEM,
    MEMORY,
    PARTNER,
    combined_goodput,
    memory_interval_s,
    plan_tiers,
    tier_interval_s,
    tier_shares,
    tiers_on,
)
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
    rows = {
        r.tier: r
        for r in plan_tiers(
            mtbf_s=10_000.0, process_share=0.6, node_share=0.3, costs={MEMORY: (2.0, 20.0), FILESYSTEM: (30.0, 300.0)}
        )
    }
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


def _ram_manager(
    tmp_path, *, mtbf_s: float, run_id: str, tier_shares: dict
) -> tuple[CheckpointManager, list[tuple[str, dict]]]:
    """A loaded manager of a tiny model with the RAM tier's interval on auto, and the list its events go to."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    events: list[tuple[str, dict]] = []
    cfg = CheckpointConfig(memory_interval="auto", memory_dir=str(tmp_path / "shm"), async_mode="none")
    ck = CheckpointManager(
        tmp_path / "ckpt",
        cfg=cfg,
        mtbf_s=mtbf_s,
        total_steps=10_000,
        run_id=run_id,
        tier_shares=tier_shares,
        emit=lambda k, **f: events.append((k, f)),
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    return ck, events


def test_the_manager_sets_the_ram_interval_from_its_measured_save_by_the_same_rule(tmp_path) -> None:
    # A short MTBF (2 s, half of it process failures) keeps the interval a few dozen 0.05 s steps whatever a save
    # costs on this machine: Daly's interval is at most the MTBF of the failures covered (4 s = 80 steps).
    ck, events = _ram_manager(tmp_path, mtbf_s=2.0, run_id="tiers", tier_shares={MEMORY: 0.5, FILESYSTEM: 0.5})
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
    args = [
        "+experiment=llama3_8b",
        "plan.fake_backend=false",
        "plan.save_fixed_s=5",
        "plan.restart_overhead_s=300",
        "plan.restart_in_allocation_s=30",
        "failure.process_share=0.4",
        "failure.node_share=0.5",
    ]
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
    # the node failures the spare absorbs are the partner tier's; one spare absorbs only the first node failure of
    # an allocation: 1 / (1 + q) of them, q = 0.5 / 0.6; the rest are read from the filesystem.
    args = [
        "+experiment=llama3_8b",
        "plan.fake_backend=false",
        "plan.save_fixed_s=5",
        "plan.restart_overhead_s=300",
        "plan.restart_in_allocation_s=30",
        "failure.process_share=0.4",
        "failure.node_share=0.5",
        "launcher=slurm",
        "checkpoint.memory_replicas=1",
        "plan.json=true",
    ]
    assert main([*args, "launcher.spare_nodes=1"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    rows = {r["tier"]: r for r in plan["tiers"]["tiers"]}
    assert {t: r["failures"] for t, r in rows.items()} == {
        MEMORY: ["process"],
        PARTNER: ["node"],
        FILESYSTEM: ["node", "job"],
    }
    q = 0.5 / 0.6
    assert rows[PARTNER]["share"] == pytest.approx(0.5 / (1 + q))
    assert rows[FILESYSTEM]["share"] == pytest.approx(0.1 + 0.5 * q / (1 + q))
    # The RAM saves' one cadence covers both: MTBF = job MTBF / (0.4 + the partner's share), printed under the table.
    cadence_h = plan["checkpoint"]["mtbf_s"] / (0.4 + 0.5 / (1 + q)) / 3600
    assert plan["tiers"]["cadence_mtbf_s"] / 3600 == pytest.approx(cadence_h)
    assert main([a for a in args if a != "plan.json=true"] + ["launcher.spare_nodes=1"]) in (0, 1)
    assert f"read from either (MTBF {cadence_h:.2f} h)" in capsys.readouterr().out
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


def test_partner_copies_ride_on_the_ram_interval_from_both_costs_and_both_failure_classes() -> None:
    # Every RAM save also sends the partner copy, so the two tiers are one cadence. Job MTBF 10,000 s; 60% process,
    # 30% node, 10% job failures; RAM save 2 s (restart 20 s), partner copy 6 s (restart 40 s), filesystem 30 s (300 s).
    # Without a spare node failures are requeues: RAM alone, d = 2 s, M = 10,000 / 0.6: 256.867 s (first test above).
    # With a spare, by hand (Daly 2006 eq. 37): d = 2 + 6 = 8 s, M = 10,000 / (0.6 + 0.3) = 11,111.1 s:
    #   sqrt(2 d M) = sqrt(177,777.8) = 421.637; x = d / (2M) = 3.6e-4; 421.637 x (1 + 0.0063246 + 0.00004) - 8 = 416.32
    #   filesystem: d = 30 s, M = 10,000 / 0.1 = 100,000 s: sqrt(6e6) = 2449.49 x 1.0040992 - 30 = 2429.53 s
    kw = dict(mtbf_s=10_000.0, process_share=0.6, node_share=0.3)
    no_spare = tier_shares(process_share=0.6, node_share=0.3, memory=True, partner=False)
    spare = tier_shares(process_share=0.6, node_share=0.3, memory=True, partner=True)
    assert memory_interval_s(mtbf_s=10_000.0, shares=no_spare, save_s=2.0) == pytest.approx(256.867, abs=1e-3)
    assert memory_interval_s(mtbf_s=10_000.0, shares=spare, save_s=8.0) == pytest.approx(416.32, abs=1e-2)
    rows = {
        r.tier: r
        for r in plan_tiers(costs={MEMORY: (2.0, 20.0), PARTNER: (6.0, 40.0), FILESYSTEM: (30.0, 300.0)}, **kw)
    }
    assert rows[MEMORY].interval_s == rows[PARTNER].interval_s == pytest.approx(416.32, abs=1e-2)
    assert rows[PARTNER].rides_on == MEMORY and rows[MEMORY].rides_on == ""
    assert rows[FILESYSTEM].interval_s == pytest.approx(2429.53, abs=1e-2)
    # One goodput factor for the cadence (Daly 2006 eq. 20, T_s / T_w = tau / (M e^{R/M} (e^{(tau+d)/M} - 1))), each
    # failure class once: M = 11,111.1 s, restart weighted by share R = (0.6 x 20 + 0.3 x 40) / 0.9 = 26.667 s:
    #   e^{R/M} = 1.0024029; e^{(416.32 + 8)/M} - 1 = 0.0389276; 416.32 / (11,111.1 x 1.0024029 x 0.0389276) = 0.96022
    assert rows[MEMORY].goodput == pytest.approx(0.96022, abs=1e-5) and rows[PARTNER].goodput == 1.0
    assert combined_goodput(list(rows.values())) == pytest.approx(0.96022 * rows[FILESYSTEM].goodput, rel=1e-5)
    with pytest.raises(ValueError, match="partner copies ride on RAM saves"):
        plan_tiers(costs={PARTNER: (6.0, 40.0), FILESYSTEM: (30.0, 300.0)}, **kw)


def test_the_managers_ram_interval_with_partner_copies_is_the_plans(tmp_path) -> None:
    # A hot spare and partner copies: process (30%) and node (50%) failures are both read from the RAM saves' copies.
    # A short MTBF (4 s) keeps the interval a few dozen 0.05 s steps whatever a save costs on this machine.
    shares = tier_shares(process_share=0.3, node_share=0.5, memory=True, partner=True)
    ck, events = _ram_manager(tmp_path, mtbf_s=4.0, run_id="ride", tier_shares=shares)
    for step in range(1, 1000):
        if ck.memory_due(step):
            ck.save_memory(step)
        ck.due(step, step_time_s=0.05)
        if sum(k == "checkpoint_interval" and f["tier"] == MEMORY for k, f in events) >= 2:
            break
    last = [f for k, f in events if k == "checkpoint_interval" and f["tier"] == MEMORY][-1]
    assert last["mtbf_s"] == pytest.approx(4.0 / 0.8) and last["share"] == pytest.approx(0.8)
    # The plan, given the save the manager measured (it includes the copy the save sent: the copy adds 0).
    rows = {
        r.tier: r
        for r in plan_tiers(
            mtbf_s=4.0,
            process_share=0.3,
            node_share=0.5,
            costs={MEMORY: (last["delta_s"], 1.0), PARTNER: (0.0, 1.0), FILESYSTEM: (1.0, 10.0)},
        )
    }
    assert rows[MEMORY].interval_s == rows[PARTNER].interval_s == pytest.approx(last["interval_s"], abs=1e-5)
    assert last["interval_steps"] == interval_steps(rows[MEMORY].interval_s, 0.05) == ck.memory_interval_steps() > 1
    ck.close()


def test_plan_prints_the_partner_row_riding_on_the_ram_interval(capsys, tmp_path) -> None:
    args = [
        "+experiment=llama3_8b",
        "plan.fake_backend=false",
        "plan.save_fixed_s=5",
        "plan.restart_overhead_s=300",
        "plan.restart_in_allocation_s=30",
        "failure.process_share=0.4",
        "failure.node_share=0.5",
        "launcher=slurm",
        "checkpoint.memory_replicas=1",
        "launcher.spare_nodes=1",
        f"run.dir={tmp_path}",
    ]
    assert main([*args, "plan.json=true"]) in (0, 1)
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    rows = {r["tier"]: r for r in tiers["tiers"]}
    mem, par, fs = rows[MEMORY], rows[PARTNER], rows[FILESYSTEM]
    assert par["rides_on"] == MEMORY and par["interval_s"] == mem["interval_s"] and par["goodput"] == 1.0
    assert mem["interval_s"] == pytest.approx(
        memory_interval_s(
            mtbf_s=mem["mtbf_s"] * 0.4,
            save_s=mem["save_s"] + par["save_s"],
            shares={MEMORY: 0.4, PARTNER: par["share"]},  # one spare: the first node failure per allocation
        )
    )
    assert tiers["goodput"] == pytest.approx(mem["goodput"] * fs["goodput"])  # the partner's factor is in memory's
    assert main(args) in (0, 1)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(f"  {PARTNER} ") and "%)" in ln)
    assert "= memory interval" in line and line.endswith("in memory") and f"{par['interval_s']:.1f}" not in line
    both = f"save {mem['save_s'] + par['save_s']:.3f} s (memory {mem['save_s']:.3f} + partner {par['save_s']:.3f})"
    assert both in out
    # RAM saves in the ledger that sent partner copies already paid for them: the copy adds no save cost of its own.
    (tmp_path / "events.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "kind": "checkpoint_saved",
                    "time": 1000.0 + s,
                    "tier": MEMORY,
                    "step": s,
                    "blocking_s": 0.25,
                    "replicas": 1,
                }
            )
            + "\n"
            for s in (1, 2, 3)
        )
    )
    assert main([*args, "plan.json=true"]) in (0, 1)
    rows = {r["tier"]: r for r in json.loads(capsys.readouterr().out)["tiers"]["tiers"]}
    assert rows[MEMORY]["save_s"] == 0.25 and rows[PARTNER]["save_s"] == 0.0
    assert rows[MEMORY]["interval_s"] == pytest.approx(
        memory_interval_s(
            mtbf_s=rows[MEMORY]["mtbf_s"] * 0.4, save_s=0.25, shares={MEMORY: 0.4, PARTNER: rows[PARTNER]["share"]}
        )
    )
