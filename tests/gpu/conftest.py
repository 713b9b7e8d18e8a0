"""The gpu tier: tests marked `gpu` are skipped (reported, reason "no CUDA") where torch sees no GPU.

GPUs are counted with `torch.cuda.device_count()`, which asks NVML and leaves CUDA uninitialised in the
pytest process, so the multiproc tier's forked ranks stay usable in the same session. The tier is never
in MESHJOB_REQUIRE_TIERS (CI machines have no GPU), so its skips do not fail a session.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.device_count() > 0:
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="no CUDA"))
