"""The rank's device, its process-group backend and compute dtype, and the environment NCCL reads.

`train.device=auto` means CUDA when torch sees a GPU, else CPU; `train.mixed_precision=auto` means
bf16 on CUDA, fp32 on CPU. Nothing here touches the GPU at import, and GPUs are counted with
`torch.cuda.device_count()`, which asks NVML and so does not initialise CUDA: the local launcher
forks its ranks after this check, and a parent that initialised CUDA would leave every forked rank
unable to use it. `jobs.plan` and sweep pruning never call any of it. On CUDA the world group is "cuda:nccl,cpu:gloo":
NCCL for the training collectives, gloo for the CPU tensors some collectives carry (the stop flag);
the checkpoint manager makes gloo groups of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported where a function needs it (the login node never does)
    import torch

__all__ = [
    "DEVICES",
    "MIXED_PRECISIONS",
    "visible_gpus",
    "resolve_device",
    "resolve_mixed_precision",
    "backend_for",
    "gpu_index",
    "rank_device",
    "export_environ",
    "set_determinism",
    "trace_dir",
    "dump_flight_recorder",
    "TRACE_PREFIX",
    "NCCL_DEFAULTS",
]

DEVICES = ("auto", "cpu", "cuda")
MIXED_PRECISIONS = ("auto", "bf16", "fp32")

# Set only where neither the user nor the cluster profile set them: a failed or timed-out NCCL
# collective aborts the communicator (the process exits and the failure path runs) instead of
# hanging, and the flight recorder keeps the last collectives and dumps them on a timeout.
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # 3 = SkipCleanUp: tear down the process without a hang-prone cleanup
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder entries per rank (0 = off)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # write the flight recorder when a collective times out
}


def visible_gpus() -> int:
    """GPUs this process may use (0 on a CPU build of torch); fork-safe where NVML is installed."""
    import torch  # lazy: called on the ranks' node only; the login node's jobs.validate needs no torch

    return torch.cuda.device_count()


def compile_backends() -> list[str]:
    """torch.compile's backends here: torch._dynamo.list_backends() and its debugging ones (eager, aot_eager: dynamo's
    capture without inductor's code generation); not the backends torch registers for its own tests."""
    import torch._dynamo  # lazy: a rank's function (see visible_gpus); importing dynamo takes seconds

    shown = set(torch._dynamo.list_backends())
    debug = set(torch._dynamo.list_backends(exclude_tags=())) - shown
    return sorted(shown | {b for b in debug if b.startswith(("eager", "aot_eager"))})


def resolve_device(name: str, *, gpus: int | None = None, gpus_per_node: int = 0, cluster: str = "") -> str:
    """ "cpu" or "cuda" for `train.device`, given `gpus` visible (default: counted here).
    ValueError for an unknown name, cuda without a GPU, or auto finding no GPU on a node whose
    profile (`cluster.gpus_per_node`) has GPUs: a CPU build of torch there would train on CPU unnoticed."""
    if name not in DEVICES:
        raise ValueError(f"train.device={name!r} is not one of {', '.join(DEVICES)}")
    has_cuda = (visible_gpus() if gpus is None else gpus) > 0
    if name == "auto" and not has_cuda and gpus_per_node > 0:
        import torch  # lazy: for the message only (see visible_gpus)

        build = "a CPU build" if torch.version.cuda is None else f"a CUDA {torch.version.cuda} build"
        raise ValueError(
            f"train.device=auto on a node of cluster={cluster or '?'} (cluster.gpus_per_node={gpus_per_node}) but torch "
            f"{torch.__version__} ({build}) sees no CUDA GPU: it would train on the CPU. Install a CUDA build of torch "
            "(or make the GPUs visible: CUDA_VISIBLE_DEVICES), or set train.device=cpu to train on CPUs on purpose"
        )
    if name == "auto":
        return "cuda" if has_cuda else "cpu"
    if name == "cuda" and not has_cuda:
        import torch  # lazy: for the message only (see visible_gpus)

        raise ValueError(
            f"train.device=cuda but torch {torch.__version__} sees no CUDA GPU here; set train.device=cpu "
            "(or auto), or run on a GPU node with a CUDA build of torch (docs/gpus.md)"
        )
    return name


def resolve_mixed_precision(name: str, *, device_type: str) -> str:
    """ "bf16" or "fp32" for `train.mixed_precision` on `device_type` (auto: bf16 on cuda, fp32 on cpu)."""
    if name not in MIXED_PRECISIONS:
        raise ValueError(f"train.mixed_precision={name!r} is not one of {', '.join(MIXED_PRECISIONS)}")
    if name == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return name


def backend_for(device_type: str) -> str:
    """The world group's backend: NCCL for CUDA tensors plus gloo for CPU ones, or plain gloo."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def gpu_index(*, local_rank: int, gpus: int) -> int:
    """The GPU of this rank: its local rank, or 0 when Slurm bound one GPU to each task."""
    if gpus == 1:
        return 0
    if local_rank >= gpus:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: {gpus} visible; one rank per GPU, "
            "set launcher.tasks_per_node to the GPUs per node"
        )
    return local_rank


def rank_device(device_type: str, *, local_rank: int) -> torch.device:
    """This rank's device; on CUDA it becomes the current device (call before anything touches the GPU)."""
    import torch  # lazy: a rank's function (see visible_gpus)

    if device_type != "cuda":
        return torch.device("cpu")
    index = gpu_index(local_rank=local_rank, gpus=visible_gpus())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_determinism(deterministic: bool, *, device_type: str) -> str:
    """Deterministic CUDA kernels for `train.deterministic=true` (what bitwise resume on CUDA needs),
    without torch's NaN-fill of every uninitialised tensor (`fill_uninitialized_memory`, which writes
    each torch.empty / FSDP buffer once more and buys nothing here: every buffer is written before it
    is read); returns the line the rank logs at start: what was chosen, what it costs, the knob."""
    if device_type != "cuda":
        return (
            f"train.deterministic={str(deterministic).lower()}: CPU ranks over gloo run the same kernels "
            "in the same order every time; nothing to set, nothing it costs"
        )
    if not deterministic:
        return (
            "train.deterministic=false: CUDA may pick nondeterministic kernels (faster; resume is not bitwise, "
            "losses after a resume drift in the last bits)"
        )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it (or :16:8) to be deterministic
    import torch  # lazy: a rank's function (see visible_gpus)

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    return (
        "train.deterministic=true: deterministic CUDA kernels (torch.use_deterministic_algorithms; cuBLAS "
        "workspace :4096:8, deterministic attention backward and scatter/index ops) so a resume is bitwise; "
        "they cost step time (scripts/gpu_check measures how much: its determinism_cost); "
        "train.deterministic=false turns them off (torchtitan's default)"
    )


def export_environ(
    cluster_env: Mapping[str, str],
    *,
    device_type: str,
    trace_dir: str | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Exports `cluster.env` (the profile wins, as in the sbatch script), then the NCCL defaults with
    setdefault on CUDA, the flight-recorder dumps going to `trace_dir/nccl_trace_rank_<r>`; returns
    what was set. Must run before init_process_group (NCCL reads it then)."""
    env = os.environ if environ is None else environ
    done = {str(k): str(v) for k, v in cluster_env.items()}
    env.update(done)
    if device_type == "cuda":
        defaults = dict(NCCL_DEFAULTS)
        if trace_dir is not None:
            defaults["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(trace_dir, "nccl_trace_rank_")
        for k, v in defaults.items():
            if k not in env:
                env[k] = v
                done[k] = v
    return done


TRACE_PREFIX = "nccl_trace_rank_"  # torch's dump file prefix (TORCH_NCCL_DEBUG_INFO_TEMP_FILE); fr_trace reads it


def trace_dir(run_dir: str, attempt: str) -> Path:
    """Where this attempt's flight-recorder dumps go: RUN_DIR/nccl_traces/<attempt>/."""
    return Path(run_dir) / "nccl_traces" / attempt


def dump_flight_recorder(directory: Path, *, rank: int, timeout_s: float = 10.0) -> Path | None:
    """Writes this process's flight recorder (the last collectives of every process group, NCCL's and
    gloo's, with their state: scheduled / started / completed) to `directory/nccl_trace_rank_<rank>`,
    the file and pickle format torch writes on an NCCL timeout, so
    `python -m torch.distributed.flight_recorder.fr_trace DIR` reads both. The watchdog calls it
    before it ends a hung rank: it acts `failure.hang_timeout_s` after the last step, before NCCL's
    own timeout would dump. Never raises and never waits past `timeout_s` (a dying rank must still
    exit); None when nothing was written (a torch without the API, a full disk, a dump that hung).
    Records only with TORCH_FR_BUFFER_SIZE (or the older TORCH_NCCL_TRACE_BUFFER_SIZE, set on CUDA by
    `export_environ`) > 0; otherwise the dump holds no entries."""
    import torch  # lazy: a rank's function (see visible_gpus)

    c10d = getattr(torch._C, "_distributed_c10d", None)
    # _dump_nccl_trace: CUDA builds (NCCL's recorder, with the communicators' state); _dump_fr_trace: the
    # generic recorder every build has (torch >= 2.8; gloo's collectives on CPU).
    fn = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if fn is None:
        return None
    path = directory / f"{TRACE_PREFIX}{rank}"
    written: list[Path] = []

    def write() -> None:
        try:
            data = fn()
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            written.append(path)
        except Exception:  # noqa: BLE001 - a rank on its way out: no dump is better than no exit
            pass

    t = threading.Thread(target=write, name="meshjob-fr-dump", daemon=True)
    t.start()
    t.join(timeout_s)
    return written[0] if written else None
