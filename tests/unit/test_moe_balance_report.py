"""The report shows each MoE layer's balance from metrics.jsonl (tokens per expert max / mean, bias spread, balance
loss), labels a persistent imbalance as such, and says so beside the stragglers instead of leaving the busy experts'
ranks to be read as slow hardware."""

from __future__ import annotations

from jobs.telemetry.run_report import moe_balance, moe_balance_table, straggler_table


def _metrics(imbalance_1: list[float]) -> list[dict]:
    return [
        {
            "step": s + 1,
            "loss": 1.0,
            "moe_load_imbalance/1": v,
            "moe_bias_spread/1": 0.01 * (s + 1),
            "moe_aux_loss/1": 0.002,
            "moe_load_imbalance/2": 1.1,
            "moe_bias_spread/2": 0.0,
            "moe_aux_loss/2": 0.001,
        }
        for s, v in enumerate(imbalance_1)
    ]


def test_a_layer_imbalanced_in_most_logged_steps_is_labelled_persistent_and_the_others_ok() -> None:
    balance = moe_balance(_metrics([2.0, 1.9, 1.2, 2.5, 3.0]))  # >= 1.5 in 4 of 5 steps
    assert list(balance) == [1, 2]
    assert balance[1]["persistent"] and not balance[2]["persistent"]
    assert (balance[1]["imbalance"], balance[1]["median"], balance[1]["bias_spread"]) == (3.0, 2.0, 0.05)
    lines = moe_balance_table(balance).splitlines()
    assert lines[2].split()[:5] == ["1", "3.00", "2.00", "0.05", "0.002"] and "persistent imbalance" in lines[2]
    assert lines[3].split()[:3] == ["2", "1.10", "1.10"] and lines[3].endswith("ok")


def test_a_passing_imbalance_is_not_persistent() -> None:
    assert not moe_balance(_metrics([3.0, 1.1, 1.2, 1.0, 1.1]))[1]["persistent"]
    assert not moe_balance(_metrics([3.0, 3.0]))[1]["persistent"]  # too few logged steps to say
    assert moe_balance([{"step": 1, "loss": 1.0}]) == {}  # a dense model: no section


def test_stragglers_beside_a_persistent_imbalance_are_labelled_as_the_imbalance() -> None:
    events = [{"kind": "straggler", "step": 5, "check": "phase", "phase": "forward", "ranks": [1], "ratio": 1.8}]
    assert "persistent MoE imbalance" in straggler_table(events, persistent_imbalance=True).splitlines()[0]
    assert straggler_table(events).splitlines()[0] == "stragglers: 1"
