"""The planner's inter-node bandwidth priced by the group's ranks per node and the node's NICs, and its GEMM rate by
the GPU model: every figure from the profile's cited sources."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner import hardware as H
from jobs.planner.gate import build_plan


def _hw(cluster: str) -> H.Hardware:
    return H.hardware(compose([f"cluster={cluster}"]).cluster, dtype="bf16", tasks_per_node=8)


def test_a_group_with_every_rank_of_a_node_drives_every_nic_up_to_the_nvlink_figure():
    # a100_ib: 8 HDR NICs of 25 GB/s at 47/50 (nccl-tests#290) = 23.5 GB/s each; NCCL spreads a ring over the NICs of
    # the group's ranks on the node (nccl-tests#119: 8 x 100G -> 96 GB/s; nccl#1168: 45 GB/s at 4 GPUs per node, 90
    # at 8), capped by NVLink's 300 x 370/450 = 246.7 GB/s (nccl#412)
    hw = _hw("a100_ib")
    assert hw.link("all_gather", "inter").bus_GBps == pytest.approx(23.5)
    assert hw.link("all_gather", "inter", ranks_per_node=4).bus_GBps == pytest.approx(94.0)
    assert hw.link("reduce_scatter", "inter", ranks_per_node=8).bus_GBps == pytest.approx(188.0)
    # an all-to-all cannot aggregate NICs (nccl-tests#267), a send is one pair's: one NIC whatever the group
    assert hw.link("all_to_all", "inter", ranks_per_node=8).bus_GBps == pytest.approx(23.5)
    assert hw.link("send_recv", "inter", ranks_per_node=8).bus_GBps == pytest.approx(23.5)
    # h100_ib: 8 x NDR 47 GB/s = 376 GB/s would pass NVLink's 450 x 370/450 = 370: capped
    assert _hw("h100_ib").link("all_gather", "inter", ranks_per_node=8).bus_GBps == pytest.approx(370.0)
    # h800_ib cites no NIC count: one NIC's bandwidth for any group, as before
    assert _hw("h800_ib").link("all_gather", "inter", ranks_per_node=8).bus_GBps == pytest.approx(47.0)


def test_ranks_per_node_follow_the_row_major_mesh():
    shape = {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "cp": 1, "tp": 1}
    assert H.axis_ranks_per_node("dp_shard", shape, group=64, node_ranks=8) == 8  # FSDP over whole nodes
    tp8 = {**shape, "dp_shard": 8, "tp": 8}
    assert H.axis_ranks_per_node("dp_shard", tp8, group=8, node_ranks=8) == 1  # dp under tp8: one rank per node
    tp2 = {**shape, "dp_shard": 32, "tp": 2}
    assert H.axis_ranks_per_node("dp_shard", tp2, group=32, node_ranks=8) == 4
    assert H.axis_ranks_per_node("tp", tp2, group=2, node_ranks=8) == 2


def test_torchtitans_fsdp_rows_pay_node_bandwidth_not_one_nics():
    # Llama 3 8B on 64 A100, FSDP over 8 nodes (pytorch/torchtitan docs/performance.md): its gathers and
    # reductions run at 8 NICs' 188 GB/s, not one NIC's 23.5 (which made them 8x as long)
    plan = build_plan(compose(["+experiment=llama3_8b", "train.activation_checkpointing=selective"]), measure=False)
    rows = [c for c in plan.comm if c["axis"].startswith("dp_shard")]
    assert rows and all(c["bus_GBps"] == pytest.approx(188.0) for c in rows), rows
    assert all("ranks' NICs per node" in c["source"] for c in rows)


def test_each_gpu_model_gets_its_own_cited_gemm_efficiency():
    # Bekman, "ML Engineering", Maximum Achievable Matmul FLOPS table (BF16): A100 SXM 271.2 of 312 (86.9%),
    # H100 SXM 794.5 of 989 (80.3%); a profile without one gets the H100 line and says so
    assert _hw("a100_ib").matmul_tflops == pytest.approx(312 * 0.869)
    assert _hw("h100_ib").matmul_tflops == pytest.approx(989 * 0.803)
    assert "cluster.gpu_matmul_efficiency" in _hw("a100_ib").matmul_source
    bare = compose(["cluster=a100_ib", "cluster.gpu_matmul_efficiency=0"]).cluster
    assert H.hardware(bare, dtype="bf16", tasks_per_node=8).matmul_tflops == pytest.approx(312 * 794.5 / 989)
    assert "H100 SXM's" in H.hardware(bare, dtype="bf16", tasks_per_node=8).matmul_source
    assert H.matmul_efficiency("NVIDIA A100-SXM4-80GB") == pytest.approx(271.2 / 312)
    assert H.matmul_efficiency("NVIDIA H100 80GB HBM3") == pytest.approx(794.5 / 989)
    assert H.matmul_efficiency("NVIDIA A100 80GB PCIe") == pytest.approx(252.9 / 312)
    assert H.matmul_efficiency("NVIDIA L40S") == 0.0
