"""Measurements every run takes: model FLOPs and MFU, peak memory per rank, GPU health (NVML) in
`health`, per-rank phase timing in `phases` (built per rank by `rank_telemetry`), stragglers in
`stragglers`, TensorBoard scalars in `tensorboard`; and the run's goodput.

The names are imported on first use (PEP 562), so that `jobs.telemetry.goodput` and the report stay
torch-free on a login node: only `PeakMemory`, `LiveBytes` and `live_tensors` need torch.
"""

from importlib import import_module

__all__ = ["achieved", "model_flops_per_token", "LiveBytes", "PeakMemory", "live_tensors"]

_HOME = {
    "achieved": "flops",
    "model_flops_per_token": "flops",
    "LiveBytes": "memory",
    "PeakMemory": "memory",
    "live_tensors": "memory",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
