"""What the entry points import: the login node's checks, sbatch rendering and jobs.status run without torch.

`import torch` costs about 1 s of CPU, and torch.distributed.pipelining (it pulls torch._dynamo) about 1 s
more; CI starts these commands hundreds of times. Each check runs in a fresh interpreter (this one has torch).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

# The login node's path of `python -m jobs.train launcher=slurm` up to sbatch (jobs.launch.slurm.submit:
# login_checks, the data package prepare_inputs imports, the sbatch script), and jobs.status's imports.
_LOGIN_NODE = """
import json, sys
from jobs.config import compose
from jobs.launch.slurm import login_checks
from jobs.sbatch import render_for
import jobs.data, jobs.status, jobs.report
cfg = compose(["launcher=slurm", "run.dir=runs/import-cost"])
login_checks(cfg)
render_for(cfg, overrides=[])
print(json.dumps([m for m in ("torch", "torch._dynamo", "torch.distributed.pipelining", "matplotlib")
                  if m in sys.modules]))
"""


def _imported(code: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_login_node_checks_sbatch_and_status_import_no_torch() -> None:
    assert _imported(_LOGIN_NODE) == []


def test_jobs_status_imports_neither_numpy_nor_h5py() -> None:
    code = (
        "import json, sys; import jobs.status; "
        "print(json.dumps([m for m in ('numpy', 'h5py', 'torch') if m in sys.modules]))"
    )
    assert _imported(code) == []


# A Slurm rank's modules (`python -m jobs.launch.slurm --rank-config PATH`: rank_main, run_rank, the checks and the
# trainer it imports late), in a fresh interpreter as srun starts it.
_SLURM_RANK = """
import json, sys
import jobs.launch.slurm, jobs.launch.supervise, jobs.launch.rank, jobs.validate, jobs.trainer, parallel.recipe
print(json.dumps([m for m in ("torch._dynamo", "torch._inductor", "torch.distributed.pipelining") if m in sys.modules]))
"""


def test_a_slurm_ranks_modules_import_neither_dynamo_nor_pipelining() -> None:
    # Imports only: torch itself imports torch._dynamo (with torch._inductor) at the first optimizer, FSDP2's
    # fully_shard and a meta-device init, so a training rank pays it there; what imports the trainer without
    # training does not (parallel.cp's causal bias pulled it in: ~0.5 s; the pipeline schedules ~1 s more).
    assert _imported(_SLURM_RANK) == []
