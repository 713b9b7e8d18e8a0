"""One validator: the planner's verdict on a config is the trainer's (`jobs.validate.validate`), the same message
for the same refusal; it accepts only what is planned but not trained (`training=False`: MLA with tp or cp)."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner.gate import validate_for_planning
from jobs.validate import validate

CP2 = ["mesh.cp=2", "mesh.tp=1", "mesh.dp_shard=2"]  # pp2 * dp_shard2 * cp2 = the 8 local ranks
CONFIGS = [
    [],
    CP2,
    [*CP2, "train.compile=true"],  # the planner used to accept it (it validated a copy with cp=1)
    [*CP2, "train.seq_len=100"],  # 2*cp chunks per sample
    [*CP2, "model.sdpa_backend=math"],  # cp runs its own attention kernels
    ["model.sdpa_backend=flash"],
    ["model.norm_kernel=apex"],
    ["model.norm_kernel=fused"],
    ["mesh.tp=3"],
    ["train.compile=true"],  # tp2
    ["model=tiny_moe", "mesh.ep=2"],
    ["model=tiny_moe", "mesh.ep=3"],
    ["mesh.ep=2"],  # a dense model
    ["train.global_batch=3"],
]


def _verdict(check, overrides: list[str]) -> str:
    try:
        check(compose(overrides))
    except ValueError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: " ".join(o) or "default")
def test_the_planner_and_the_trainer_give_every_config_the_same_verdict(overrides: list[str]) -> None:
    assert _verdict(validate_for_planning, overrides) == _verdict(validate, overrides)


def test_the_verdicts_include_refusals_and_cp_with_compile_is_refused_by_both() -> None:
    verdicts = {" ".join(o): _verdict(validate, o) for o in CONFIGS}
    assert sum(v == "ok" for v in verdicts.values()) >= 2 and sum(v != "ok" for v in verdicts.values()) >= 5
    assert verdicts[" ".join([*CP2, "train.compile=true"])].startswith("train.compile=true with mesh.cp(2) > 1")


def test_only_what_is_planned_but_not_trained_is_accepted_by_the_planner_alone() -> None:
    mla_tp = ["model=tiny_mla_moe", "mesh.tp=2"]
    assert _verdict(validate, mla_tp).startswith("mesh.tp(2) > 1 with model.attention=mla")
    assert _verdict(validate_for_planning, mla_tp) == "ok"
