"""Measurements every run takes: model FLOPs and MFU, peak memory per rank; GPU health (NVML) in `health`."""

from jobs.telemetry.flops import achieved, model_flops_per_token
from jobs.telemetry.memory import LiveBytes, PeakMemory, live_tensors

__all__ = ["achieved", "model_flops_per_token", "LiveBytes", "PeakMemory", "live_tensors"]
