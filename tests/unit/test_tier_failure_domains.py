"""The tier model and the partner ring against real failure domains: hot spares are finite per
allocation, and partner copies leave the physical host (and the leaf switch) where the nodes allow."""

from __future__ import annotations

import pytest

from checkpoint.partner import partner_ranks, shared_domains
from checkpoint.tiers import FILESYSTEM, MEMORY, PARTNER, plan_tiers, spare_coverage, tier_shares
from jobs.launch.domain import failure_domain, leaf_switch


def test_one_spare_covers_only_the_node_failures_it_can_absorb() -> None:
    # The defaults: process 0.15, node 0.77, job 0.08. Before, any spare sent every node failure to the partner
    # tier (filesystem share 0.08); with one spare an allocation survives its first node failure only: q =
    # 0.77 / 0.85 of the failures that end it are node failures, so 1 / (1 + q) = 0.525 of them are covered.
    q = 0.77 / 0.85
    assert spare_coverage(node_share=0.77, job_share=0.08, spare_nodes=1) == pytest.approx(1 / (1 + q))
    one = tier_shares(process_share=0.15, node_share=0.77, memory=True, partner=True, spare_nodes=1)
    assert one[MEMORY] == pytest.approx(0.15)
    assert one[FILESYSTEM] == pytest.approx(0.08 + 0.77 * q / (1 + q)) and one[FILESYSTEM] == pytest.approx(
        0.446, abs=1e-3
    )
    assert sum(one.values()) == pytest.approx(1.0)
    two = tier_shares(process_share=0.15, node_share=0.77, memory=True, partner=True, spare_nodes=2)
    assert 0.08 < two[FILESYSTEM] < one[FILESYSTEM]  # more spares, fewer requeues
    many = tier_shares(process_share=0.15, node_share=0.77, memory=True, partner=True, spare_nodes=1000)
    assert many[FILESYSTEM] == pytest.approx(0.08, abs=1e-6)
    assert spare_coverage(node_share=0.77, job_share=0.08, spare_nodes=0) == 0.0


def test_the_filesystem_interval_follows_the_node_failures_the_spares_leave_to_it() -> None:
    kw = dict(mtbf_s=3 * 3600.0, process_share=0.15, node_share=0.77)
    costs = {MEMORY: (0.5, 20.0), PARTNER: (2.0, 40.0), FILESYSTEM: (30.0, 300.0)}
    every = {r.tier: r for r in plan_tiers(costs=costs, **kw)}
    one = {r.tier: r for r in plan_tiers(costs=costs, spare_nodes=1, **kw)}
    # Daly's interval ~ sqrt(2 delta M / share): 0.08 -> 0.446 shortens it by sqrt(0.446 / 0.08) = 2.36x
    ratio = every[FILESYSTEM].interval_s / one[FILESYSTEM].interval_s
    assert ratio == pytest.approx((one[FILESYSTEM].share / 0.08) ** 0.5, rel=0.05) and ratio > 2.2
    assert one[FILESYSTEM].failures == ("node", "job") and every[FILESYSTEM].failures == ("job",)


def test_the_partner_ring_leaves_the_physical_host() -> None:
    # Two slurmd per physical host (A: n0, n1; B: n2, n3): the ring by node names paired n0 with n1 (one host).
    nodes, hosts = ["n0", "n1", "n2", "n3"], ["A", "A", "B", "B"]
    assert partner_ranks(nodes) == [1, 2, 3, 0]
    ring = partner_ranks(nodes, hosts)
    assert ring == [2, 3, 1, 0] and shared_domains(nodes, ring, hosts) == []
    # two ranks per node: the same local rank on the partner node
    two = [n for n in nodes for _ in range(2)]
    assert partner_ranks(two, [h for h in hosts for _ in range(2)]) == [4, 5, 6, 7, 2, 3, 0, 1]
    # one host for every node: nothing to part them, and said so
    same = partner_ranks(["n0", "n1"], ["A", "A"])
    assert shared_domains(["n0", "n1"], same, ["A", "A"]) == [("n0", "n1"), ("n1", "n0")]
    assert partner_ranks(nodes, ["A", "B", "C", "D"]) == [1, 2, 3, 0]  # domains apart already: unchanged


def test_a_nodes_domain_is_its_leaf_switch_else_its_physical_host(tmp_path) -> None:
    topo = tmp_path / "topology.conf"
    topo.write_text(
        "# leaf switches\nSwitchName=s0 Nodes=node[0-3]\nSwitchName=s1 Nodes=node[4-7],gpu01\nSwitchName=top Switches=s[0-1]\n"
    )
    assert leaf_switch("node5", topo.read_text()) == "s1" and leaf_switch("other", topo.read_text()) is None
    boot = tmp_path / "boot_id"
    boot.write_text("6f1c\n")
    assert failure_domain("gpu01", topology=topo, boot_id=boot) == "switch:s1"
    assert failure_domain("other", topology=topo, boot_id=boot) == "host:6f1c"
    assert failure_domain("node2", topology=tmp_path / "none", boot_id=boot) == "host:6f1c"
    assert failure_domain("node2", topology=None, boot_id=tmp_path / "missing") == "host:node2"


def test_nodes_all_of_one_domain_keep_their_ring() -> None:
    nodes = ["n0", "n1", "n2"]  # the local Slurm cluster: three slurmd on one machine
    assert partner_ranks(nodes, ["A", "A", "A"]) == partner_ranks(nodes) == [1, 2, 0]
