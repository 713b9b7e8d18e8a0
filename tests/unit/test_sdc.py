"""Silent data corruption at unit level: the verdict of a re-run, the replicas' majority, the test seam, the
guard's check on one process, and the policy's answer to an `sdc` incident (jobs/failure/sdc.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from jobs.config import FailureConfig, compose
from jobs.failure.policy import decide
from jobs.failure.sdc import (
    FLIP_VAR,
    SdcGuard,
    SilentCorruption,
    check_config,
    differs,
    parse_flip,
    pipeline_groups,
    replica_groups,
    replica_odd_ones,
    verdict,
)
from jobs.failure.spike import check_config as check_spike
from jobs.failure.spike import new_detector, observe, suspicious
from jobs.validate import validate

NAN, INF = float("nan"), float("inf")


def test_a_rerun_with_the_same_values_is_data_and_names_nobody():
    first = [[5.6, 0.15], [5.4, NAN]]
    assert verdict(first, copy.deepcopy(first), rtol=0.0) == ([], [], "same")  # NaN again is the same NaN


def test_the_rank_whose_gradient_differs_is_named():
    first = [[5.6, 0.15], [5.4, 1.6e72], [5.5, 0.2]]
    again = [[5.6, 0.15], [5.4, 0.14], [5.5, 0.2]]
    assert verdict(first, again, rtol=1e-3) == ([1], [1], "gradient")


def test_a_rank_whose_loss_differs_is_named_before_the_ranks_its_fault_spread_to():
    # rank 2's forward went wrong; the gradient reduction carried it into every rank's gradient shard
    first = [[5.6, 0.15], [5.4, 0.16], [9.9, 0.2]]
    again = [[5.6, 0.25], [5.4, 0.26], [5.5, 0.3]]
    assert verdict(first, again, rtol=1e-3) == ([0, 1, 2], [2], "loss")


def test_under_pipeline_parallel_a_forward_fault_is_placed_on_the_first_stage_that_sent_different_values():
    # Two pipelines of two stages: ranks [0, 1] and [2, 3] (stage 0 first). Rank 0's forward went wrong: what it
    # sent differs, so does the loss of rank 1, the last stage it fed (off the last stage the loss is 0); the
    # backward carried it into both stages' gradients.
    first = [[40.0, 0.15], [5.6, 0.16], [31.0, 0.2], [5.4, 0.21]]
    again = [[31.0, 0.25], [5.5, 0.26], [31.0, 0.2], [5.4, 0.21]]
    pipelines = [[0, 1], [2, 3]]
    assert verdict(first, again, rtol=1e-3, pipelines=pipelines)[:2] == ([0, 1], [0])
    assert verdict(first, again, rtol=1e-3)[:2] == ([0, 1], [0, 1])  # what the loss rule alone cannot tell apart
    # Before, only the loss was compared (0.0 on every stage but the last): the last stage was named.
    losses_only = [[0.0, a[1]] if r in (0, 2) else a for r, a in enumerate(first)]
    again_only = [[0.0, a[1]] if r in (0, 2) else a for r, a in enumerate(again)]
    assert verdict(losses_only, again_only, rtol=1e-3)[1] == [1]


def test_under_pipeline_parallel_a_backward_fault_is_placed_on_the_last_stage_whose_gradient_differs():
    # Rank 1 (the last stage of the first pipeline) computed a wrong gradient; the backward sent it on to rank 0.
    first = [[31.0, 0.15], [5.6, 0.96], [31.0, 0.2], [5.4, 0.21]]
    again = [[31.0, 0.25], [5.6, 0.16], [31.0, 0.2], [5.4, 0.21]]
    assert verdict(first, again, rtol=1e-3, pipelines=[[0, 1], [2, 3]]) == ([0, 1], [1], "gradient")


def test_pipelines_are_the_ranks_along_the_pp_axis_in_stage_order():
    mesh = _Mesh({"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2})
    assert pipeline_groups(mesh) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert pipeline_groups(_Mesh({"pp": 1, "dp_replicate": 1, "dp_shard": 4})) == []


def test_when_every_rank_differs_the_fault_is_not_placed_on_anyone():
    first, again = [[5.6, 0.15], [5.4, 0.16]], [[5.6, 0.25], [5.4, 0.26]]
    differ, named, by = verdict(first, again, rtol=1e-3)
    assert (differ, named) == ([0, 1], []) and "cannot be placed" in by


@pytest.mark.parametrize(
    "a,b,rtol,expected",
    [
        (1.0, 1.0 + 1e-6, 1e-3, False),  # a nondeterministic kernel's wobble
        (1.0, 1.01, 1e-3, True),
        (1.0, 1.0 + 1e-9, 0.0, True),  # rtol 0: bitwise
        (NAN, NAN, 0.0, False),
        (INF, INF, 0.0, False),
        (INF, 1.0, 1e-3, True),
        (NAN, 1.0, 1e-3, True),
    ],
)
def test_differs(a: float, b: float, rtol: float, expected: bool):
    assert differs(a, b, rtol=rtol) is expected


def test_the_replica_outside_the_majority_is_named_and_a_tie_names_nobody():
    groups3 = [[0, 2, 4], [1, 3, 5]]  # three replicas of two shards
    values = [7, 8, 7, 8, 9, 8]
    assert replica_odd_ones(values, groups3) == ([[0, 2, 4]], [4])
    assert replica_odd_ones([7, 8, 7, 8, 7, 8], groups3) == ([], [])
    assert replica_odd_ones([7, 7], [[0, 1]]) == ([], [])
    assert replica_odd_ones([7, 6], [[0, 1]]) == ([[0, 1]], [])  # two replicas: which one is wrong is unknown


class _Sub:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


class _Mesh:
    """What replica_groups reads of a DeviceMesh: the rank grid, the axis names, each axis' size."""

    def __init__(self, shape: dict[str, int]) -> None:
        self.mesh_dim_names = tuple(shape)
        self.mesh = torch.arange(math.prod(shape.values())).reshape(*shape.values())
        self.shape = shape

    def __getitem__(self, name: str) -> _Sub:
        return _Sub(self.shape[name])


def test_replica_groups_are_the_ranks_that_hold_the_same_shards():
    # axes as parallel/dims.py orders them: pp, dp_replicate, dp_shard, cp, tp (rank = row-major index)
    mesh = _Mesh({"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2})
    assert replica_groups(mesh) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups(_Mesh({"pp": 2, "dp_replicate": 1, "dp_shard": 4})) == []


def test_parse_flip():
    assert parse_flip("") is None
    f = parse_flip("1:13")
    assert (f.rank, f.step, f.once) == (1, 13, False)
    assert parse_flip("0:4:once").once
    f = parse_flip("1:6:bit23:once")
    assert (f.bit, f.once) == (23, True)
    with pytest.raises(ValueError, match=FLIP_VAR):
        parse_flip("1:13:twice")


def test_config_errors_name_the_override_and_are_checked_with_the_spike_keys():
    with pytest.raises(ValueError, match=r"failure\.sdc_rtol"):
        check_config(FailureConfig(sdc_rtol=-1.0))
    with pytest.raises(ValueError, match=r"failure\.replica_hash_every"):
        check_spike(FailureConfig(replica_hash_every=-1))  # jobs/validate.py calls it on the login node


def test_nondeterministic_kernels_with_a_zero_sdc_tolerance_are_refused_with_the_fix_in_the_message():
    """Every real spike's re-run would differ a little and read as silent data corruption (a node sent away)."""
    with pytest.raises(
        ValueError, match=r"failure\.sdc_rtol\(0\.0\) with train\.deterministic=false.*failure\.sdc_rtol=1e-3"
    ):
        validate(compose(["run.dir=/nonexistent", "train.deterministic=false"]))
    validate(compose(["run.dir=/nonexistent", "train.deterministic=false", "failure.sdc_rtol=1e-3"]))
    validate(compose(["run.dir=/nonexistent", "train.deterministic=false", "failure.sdc_rerun=false"]))
    validate(compose(["run.dir=/nonexistent", "train.deterministic=true"]))


def test_suspicious_agrees_with_observe_and_changes_nothing():
    cfg = FailureConfig(spike_factor=2.0, spike_window=3, spike_grad_norm=10.0, spike_patience=2)
    det = new_detector()
    for i, loss in enumerate([3.0, 3.1, 2.9]):
        assert observe(det, step=i, loss=loss, grad_norm=1.0, cfg=cfg) is None
    before = copy.deepcopy(det)
    assert not suspicious(det, loss=3.0, grad_norm=1.0, cfg=cfg)
    assert suspicious(det, loss=7.0, grad_norm=1.0, cfg=cfg)  # above 2 x the median 3.0
    assert suspicious(det, loss=3.0, grad_norm=11.0, cfg=cfg)
    assert suspicious(det, loss=NAN, grad_norm=1.0, cfg=cfg)
    assert det == before
    assert observe(det, step=3, loss=7.0, grad_norm=1.0, cfg=cfg) is None and det["streak"]  # counted there


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    m(torch.randn(5, 4)).square().mean().backward()
    return m


def _guard(monkeypatch, flip: str | None, *, first_attempt: bool = True, **cfg) -> tuple[SdcGuard, list]:
    if flip is not None:
        monkeypatch.setenv(FLIP_VAR, flip)
    events: list = []
    guard = SdcGuard(
        FailureConfig(**cfg),
        rank=0,
        world_size=1,
        hostname="node7",
        attempt="local.0",
        first_attempt=first_attempt,
        emit=lambda kind, **f: events.append((kind, f)),
        groups=[],
    )
    return guard, events


def test_the_seam_flips_the_top_exponent_bit_of_the_largest_gradient_element_once(monkeypatch):
    m = _model()
    clean = m.weight.grad.clone()
    guard, _ = _guard(monkeypatch, "0:3")
    guard.inject(1, [m])  # step 2 (0-based 1): not the one
    assert torch.equal(m.weight.grad, clean)
    guard.inject(2, [m])
    i = int(clean.abs().argmax())
    changed = (m.weight.grad != clean).view(-1).nonzero().view(-1).tolist()
    assert changed == [i]
    assert float(m.weight.grad.view(-1)[i]) == float(clean.view(-1)[i]) * 2.0**128  # |x| < 2: exponent + 128
    m.weight.grad.copy_(clean)
    guard.inject(2, [m])  # the re-run of the step computes it clean
    assert torch.equal(m.weight.grad, clean)


def test_bit23_doubles_or_halves_the_element(monkeypatch):
    m = _model()
    clean = m.weight.grad.clone()
    _guard(monkeypatch, "0:1:bit23")[0].inject(0, [m])
    i = int(clean.abs().argmax())
    assert float(m.weight.grad.view(-1)[i]) / float(clean.view(-1)[i]) in (2.0, 0.5)


def test_once_flips_only_in_the_first_attempt_and_other_ranks_never(monkeypatch):
    m = _model()
    clean = m.weight.grad.clone()
    _guard(monkeypatch, "0:3:once", first_attempt=False)[0].inject(2, [m])
    _guard(monkeypatch, "1:3")[0].inject(2, [m])  # rank 1's seam on rank 0
    assert torch.equal(m.weight.grad, clean)


def test_a_step_that_differs_on_its_rerun_commits_the_save_in_flight_and_raises_an_sdc_incident(monkeypatch):
    m = _model()
    guard, events = _guard(monkeypatch, "0:3")
    guard.inject(2, [m])
    saved = []

    def recompute() -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        m(torch.randn(5, 4, generator=torch.Generator().manual_seed(0))).square().mean().backward()
        return torch.tensor(2.5)

    with pytest.raises(SilentCorruption) as e:
        guard.check(
            step=2,
            suspicious=True,
            forward_value=torch.tensor(2.5),
            parts=[m],
            recompute=recompute,
            wait_for_saves=lambda: saved.append("waited"),
        )
    inc = e.value.incident
    assert inc.cls == "sdc" and saved == ["waited"]  # the save in flight, and nothing of the faulty GPU's state
    assert [(s["rank"], s["node"], s["step"]) for s in inc.suspects] == [(0, "node7", 3)]
    assert inc.evidence["differ"] == [0] and inc.evidence["named_by"] == "gradient"
    assert [(k, f["verdict"], f["step"]) for k, f in events] == [("sdc_check", "sdc", 3)]


def test_a_step_that_repeats_on_its_rerun_is_data_and_goes_on(monkeypatch):
    m = _model()
    guard, events = _guard(monkeypatch, None)
    grad = m.weight.grad.clone()

    def recompute() -> torch.Tensor:
        m.weight.grad = grad.clone()
        return torch.tensor(2.5)

    guard.check(
        step=4,
        suspicious=True,
        forward_value=torch.tensor(2.5),
        parts=[m],
        recompute=recompute,
        wait_for_saves=lambda: pytest.fail("saved"),
    )
    assert [(k, f["verdict"]) for k, f in events] == [("sdc_check", "data")]


def test_a_healthy_step_is_not_rerun_and_sdc_rerun_false_turns_it_off(monkeypatch):
    m = _model()
    for suspicious_, sdc_rerun in ((False, True), (True, False)):
        guard, events = _guard(monkeypatch, None, sdc_rerun=sdc_rerun)
        guard.check(
            step=4,
            suspicious=suspicious_,
            forward_value=torch.tensor(2.5),
            parts=[m],
            recompute=lambda: pytest.fail("re-run"),
            wait_for_saves=lambda: pytest.fail("saved"),
        )
        assert events == []


def test_an_sdc_requeues_the_job_it_is_not_stopped():
    d = decide([], cause="sdc", cfg=FailureConfig(), restart_count=0)
    assert (d.action, d.exit_code) == ("requeue", 75)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_any_single_flipped_bit_changes_the_replica_hash(dtype: torch.dtype):
    from jobs.failure.sdc import bits_sum

    torch.manual_seed(0)
    ts = [torch.randn(64, dtype=dtype), torch.randn(3, 5, dtype=dtype)]
    base = int(bits_sum(ts))
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[ts[1].element_size()]
    for bit in range(8 * ts[1].element_size()):
        flipped = [ts[0], ts[1].clone()]
        flipped[1].view(-1)[7:8].view(ints).bitwise_xor_(torch.tensor(1, dtype=ints) << bit)
        assert int(bits_sum(flipped)) != base, bit
