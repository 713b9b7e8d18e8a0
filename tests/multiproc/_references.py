"""The multiproc tier's shared uninterrupted runs: configs that several tests compare with, each trained once per session.

A test that needs an uninterrupted run of one of these configs asks the `shared_run` fixture
(tests/multiproc/conftest.py) for it instead of training its own; the run is keyed by its exact override
list, so two tests share a run only when they would have trained the very same config. A shared run's
directory is read-only by contract: tests read its metrics, events and checkpoints, or copy a checkpoint
out (shutil.copytree) to resume from; they never train in it or write into it (the fixture checks).
"""

from __future__ import annotations

# Two ranks (FSDP over dp_shard2), 24 steps, a thread-async save every 4 steps: the reference of the local
# kill / restart / stop tests (test_launcher, test_failure_local, test_kill_during_async_save).
DP2_STEPS = 24
DP2_RUN = [
    "mesh=single",
    "launcher.tasks_per_node=2",
    "mesh.dp_shard=2",
    f"train.steps={DP2_STEPS}",
    "checkpoint.every_steps=4",
    "checkpoint.async_mode=thread",
]

# The default mesh (pp2 * dp_shard2 * tp2, 8 ranks, train.mixed_precision=auto: fp32 on CPU), 8 steps, saves at 4
# and 8, a held-out evaluation at 4 and 8: tests/multiproc/test_parity.py's MESHES["pp2_dp_shard2_tp2"] (mesh_run),
# the reference of test_parity, test_activation_checkpointing, test_mixed_precision and test_resume_e2e.

# One process, 6 steps, no checkpoint: test_compile's eager run and the reference of test_pp_split's cases.
SINGLE_STEPS = 6
SINGLE_RUN = [f"train.steps={SINGLE_STEPS}", "checkpoint.enabled=false", "mesh=single", "launcher.tasks_per_node=1"]
