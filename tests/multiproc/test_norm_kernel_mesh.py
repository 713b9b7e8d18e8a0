"""`model.norm_kernel=fused` on the default mesh (pp2 * dp_shard2 * tp2: sequence-parallel norms as DTensors, FSDP2,
a pipeline split) trains exactly like eager on CPU, where F.rms_norm decomposes into eager's ops."""

from __future__ import annotations

import pytest

from tests.conftest import run_train
from tests.multiproc.test_parity import STEPS, mesh_run

pytestmark = pytest.mark.multiproc


def test_fused_trains_the_default_mesh_with_eagers_losses_bitwise(data_path: str, tmp_path, shared_run) -> None:
    common = mesh_run("pp2_dp_shard2_tp2", data_path)  # test_parity's run, eager (the default), fp32 on CPU
    eager = shared_run(common).losses()
    fused = run_train([*common, "model.norm_kernel=fused"], tmp_path / "fused")
    assert fused.returncode == 0, fused.stderr[-3000:]
    assert len(fused.losses()) == len(eager) == STEPS
    assert fused.losses() == eager
