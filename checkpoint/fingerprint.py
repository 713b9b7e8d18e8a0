"""The environment fingerprint stored in every manifest, and its diff on resume (the OPT-175B lesson)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["env_fingerprint", "diff_fingerprint", "DRIFT_POLICIES", "ENV_PREFIXES"]

DRIFT_POLICIES = ("warn", "refuse", "allow")
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_")
# Facts that legitimately change between attempts of one job and never count as drift.
_INFO_ONLY = frozenset({"hosts"})


def env_fingerprint(*, hosts: list[str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What could change training numerics: interpreter, torch/CUDA/NCCL, installed distributions,
    NCCL_*/TORCH_*/CUDA_* variables, the code's git SHA and dirty flag; plus the host list (info only)."""
    import torch

    env = os.environ if environ is None else environ
    dists = _distributions()
    fp: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(torch),
        "distributions_sha256": hashlib.sha256(
            "\n".join(f"{k}=={v}" for k, v in sorted(dists.items())).encode()
        ).hexdigest(),
        "distributions": dists,
        "env": {k: env[k] for k in sorted(env) if k.startswith(ENV_PREFIXES)},
        "hosts": sorted(set(hosts)) if hosts else [platform.node()],
    }
    fp.update(_git_state(Path(__file__).resolve().parent.parent))
    return fp


def diff_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """{dotted key: [saved, current]} for every fact that differs, excluding info-only ones (hosts).

    Distribution and variable changes are listed one key each (`distributions.numpy`, `env.NCCL_ALGO`).
    """
    out: dict[str, Any] = {}
    for key in sorted(set(saved) | set(current)):
        if key in _INFO_ONLY or key == "distributions_sha256":
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, Mapping) or isinstance(b, Mapping):
            a, b = a or {}, b or {}
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    out[f"{key}.{sub}"] = [a.get(sub), b.get(sub)]
        elif a != b:
            out[key] = [a, b]
    return out


def _distributions() -> dict[str, str]:
    out: dict[str, str] = {}
    for d in importlib.metadata.distributions():
        name = d.metadata.get("Name")
        if name:
            out[name.lower().replace("_", "-")] = d.version
    return out


def _nccl_version(torch: Any) -> str | None:
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except (RuntimeError, AttributeError):
        pass
    return None


def _git_state(root: Path) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"git_sha": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha.strip(), "git_dirty": bool(status.strip()) if status is not None else None}
