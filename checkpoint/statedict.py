"""The state a checkpoint holds: the save-side state dict (structure built once, cached) and the load into
the bound model parts, optimizers, schedulers, train state and RNG (CheckpointManager's state half)."""

from __future__ import annotations

import itertools
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint.errors import describe_error
from checkpoint.optim_init import init_optimizer_state
from checkpoint.state import capture_rng, restore_rng

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


class StateDictMixin:
    """CheckpointManager's methods that build the state to save and load a checkpoint into the bound objects
    (`self._bound`, `self._cached`, `self._stager`, `self.rank`, `self.folder`, `self._all_gather`)."""

    def _save_state_dict(self) -> dict[str, Any]:
        """The state to save. Model and optimizer tensors come from a structure built once and rebuilt
        only when the tensors behind it change; the optimizer's hyperparameters (lr), the scheduler, the
        train state and the RNG are read fresh each time."""
        sig = self._tensor_signature()
        if self._cached is None or self._cached[0] != sig:
            sd = self._state_dict()
            self._cached = (sig, sd, _param_group_refs(sd["optim"], self._bound["optimizers"]))
            if self._stager is not None:
                self._stager.reset()
            return sd
        _, sd, refs = self._cached
        if refs is None:  # hyperparameters not traceable to a param group: the optimizer part fresh each time
            b = self._bound
            sd["optim"] = {
                k: v
                for part, opt in zip(b["model_parts"], b["optimizers"])
                for k, v in get_optimizer_state_dict(part, opt, options=_OPTS).items()
            }
        else:
            opts = self._bound["optimizers"]
            for key, oi, gi, name in refs:
                sd["optim"][key] = opts[oi].param_groups[gi][name]
        sd.update(self._small_state())
        return sd

    def _tensor_signature(self) -> tuple:
        """Which tensors (and storages) the model and optimizer state consist of now; a change means
        the cached state-dict structure points at tensors no longer in use."""
        b = self._bound
        assert b is not None
        sig: list[Any] = []
        for part in b["model_parts"]:
            sig += [(id(t), local_tensor(t).data_ptr()) for t in itertools.chain(part.parameters(), part.buffers())]
        for opt in b["optimizers"]:
            sig += [
                (id(t), local_tensor(t).data_ptr())
                for st in opt.state.values()
                for t in st.values()
                if isinstance(t, torch.Tensor)
            ]
        return tuple(sig)

    def _small_state(self) -> dict[str, Any]:
        """The non-tensor state of a save, pickled now: scheduler, train state, this rank's RNG."""
        b = self._bound
        assert b is not None
        out: dict[str, Any] = {}
        if b["lr_schedulers"]:
            out["lr_scheduler"] = pickle.dumps(b["lr_schedulers"][0].state_dict())
        if b["train_state"] is not None:
            out["train_state"] = pickle.dumps(b["train_state"].state_dict())
        out["rng"] = {f"rank{self.rank}": pickle.dumps(capture_rng())}
        return out

    def _state_dict(
        self, metadata_keys: set[str] | None = None, part_keys: list[list[str]] | None = None
    ) -> dict[str, Any]:
        b = self._bound
        assert b is not None
        model: dict[str, Any] = {}
        for part in b["model_parts"]:
            sd = get_model_state_dict(part, options=_OPTS)
            dup = model.keys() & sd.keys()
            assert not dup, f"model parts share keys {sorted(dup)[:3]}"
            model.update(sd)
            if part_keys is not None:
                part_keys.append(list(sd))
        optim: dict[str, Any] = {}
        for opt in b["optimizers"] if metadata_keys is not None else ():  # a load: the state it is read into
            init_optimizer_state(opt)
        for part, opt in zip(b["model_parts"], b["optimizers"]):
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTS))
        sd: dict[str, Any] = {"model": model, "optim": optim}
        loading = metadata_keys is not None
        if b["lr_schedulers"] and (not loading or "lr_scheduler" in metadata_keys):
            sd["lr_scheduler"] = b"" if loading else pickle.dumps(b["lr_schedulers"][0].state_dict())
        if b["train_state"] is not None and (not loading or "train_state" in metadata_keys):
            sd["train_state"] = b"" if loading else pickle.dumps(b["train_state"].state_dict())
        rng_key = f"rank{self.rank}"
        if not loading:
            sd["rng"] = {rng_key: pickle.dumps(capture_rng())}
        elif f"rng.{rng_key}" in metadata_keys:
            sd["rng"] = {rng_key: b""}
        return sd

    def _load_agreed(self, d: Path, manifest: dict[str, Any], *, load: Any = None) -> tuple[dict[str, Any] | None, str]:
        # _load runs no collective (DCP reads with no_dist, set_*_state_dict are local on FSDP2/TP/PP),
        # so a rank failing anywhere in it cannot leave another blocked inside it; one all_gather
        # afterwards, reached by every rank, decides for all.
        err = info = None
        try:
            info = (load or self._load)(d, manifest)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = describe_error(e, self.folder)
        failed = [f"rank {r}: {e}" for r, e in enumerate(self._all_gather(err, self._ctl_pg)) if e]
        return (None, "; ".join(failed)[:2000]) if failed else (info, "")

    def _load(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        b = self._bound
        assert b is not None
        md_keys = set(FileSystemReader(str(d)).read_metadata().state_dict_metadata)
        same_mesh = manifest["world_size"] == self.world_size and manifest.get("mesh") == self.manifest_extra.get(
            "mesh"
        )
        part_keys: list[list[str]] = []
        sd = self._state_dict(md_keys, part_keys)
        if not same_mesh:
            sd.pop("rng", None)
        with warnings.catch_warnings():  # no_dist: DCP warns that it assumes a single process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(d), no_dist=True)
        return self._apply_loaded(sd, part_keys, resharded=not same_mesh)

    def _apply_loaded(self, sd: dict[str, Any], part_keys: list[list[str]], *, resharded: bool) -> dict[str, Any]:
        """Puts a state dict read from a checkpoint (of `_state_dict`'s structure) into the bound objects."""
        b = self._bound
        assert b is not None
        for part, keys in zip(b["model_parts"], part_keys):
            set_model_state_dict(part, {k: sd["model"][k] for k in keys}, options=_OPTS)
        for part, opt in zip(b["model_parts"], b["optimizers"]):
            set_optimizer_state_dict(part, opt, sd["optim"], options=_OPTS)
        if "lr_scheduler" in sd:
            state = pickle.loads(sd["lr_scheduler"])
            for sched in b["lr_schedulers"]:
                sched.load_state_dict(state)
        if "train_state" in sd:
            b["train_state"].load_state_dict(pickle.loads(sd["train_state"]))
        rng = restore_rng(pickle.loads(sd["rng"][f"rank{self.rank}"])) if "rng" in sd else []
        return {"resharded": resharded, "rng_restored": rng}


def _param_group_refs(
    optim_sd: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> list[tuple[str, int, int, str]] | None:
    """(key, optimizer, param group, name) of every flattened `param_groups.<fqn>.<name>` entry, traced
    through the state tensors `state.<fqn>.*` that alias the optimizer's own; None when one is not traceable."""
    owner = {
        id(t): (oi, gi)
        for oi, opt in enumerate(optimizers)
        for gi, g in enumerate(opt.param_groups)
        for p in g["params"]
        for t in opt.state.get(p, {}).values()
    }
    fqn_owner = {}
    for key, v in optim_sd.items():
        if key.startswith("state.") and id(v) in owner:
            fqn_owner[key[len("state.") : key.rindex(".")]] = owner[id(v)]
    refs = []
    for key in optim_sd:
        if key.startswith("param_groups."):
            fqn, name = key[len("param_groups.") : key.rindex(".")], key[key.rindex(".") + 1 :]
            if fqn not in fqn_owner:
                return None
            refs.append((key, *fqn_owner[fqn], name))
    return refs


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t
