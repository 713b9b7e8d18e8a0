"""`python -m checkpoint.convert STEP_DIR OUT.pt`: a committed sharded checkpoint as one `torch.save` file.

The output is {"step", "model": full tensors by FQN (loads with `model.load_state_dict`), "optim":
the flattened optimizer state, "lr_scheduler", "train_state", "manifest"}; `--model-only` writes the
model state dict alone. The checkpoint is validated against its manifest first (crc32 of every file).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["convert", "main"]


def convert(step_dir: str | Path, out: str | Path, *, model_only: bool = False) -> dict[str, Any]:
    """Writes `out` from `step_dir`; returns {"bytes", "tensors", "seconds"}. Raises ValueError when damaged."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from checkpoint.manifest import ManifestError, check_files, read_manifest

    t0 = time.perf_counter()
    d = Path(step_dir)
    try:
        manifest = read_manifest(d)
    except ManifestError as e:
        raise ValueError(f"{d} is not a committed checkpoint: {e}") from None
    problems = check_files(d, manifest["files"], sorted(manifest["files"]), checksum=True)
    if problems:
        raise ValueError(f"{d} is damaged: {'; '.join(problems[:5])}")
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(d)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    model = sd.get("model", {})
    if model_only:
        result: dict[str, Any] = model
    else:
        result = {
            "step": manifest["step"],
            "model": model,
            "optim": sd.get("optim", {}),
            "lr_scheduler": pickle.loads(sd["lr_scheduler"]) if "lr_scheduler" in sd else None,
            "train_state": pickle.loads(sd["train_state"]) if "train_state" in sd else None,
            "manifest": manifest,
        }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, out)
    return {"bytes": out.stat().st_size, "tensors": len(model), "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoint.convert", description=__doc__.splitlines()[0])
    p.add_argument("step_dir", help="RUN_DIR/checkpoints/step_<N>")
    p.add_argument("out", help="output .pt file")
    p.add_argument("--model-only", action="store_true", help="write only the model state dict")
    a = p.parse_args(argv)
    try:
        info = convert(a.step_dir, a.out, model_only=a.model_only)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {info['tensors']} model tensors, {info['bytes']} bytes in {info['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
