"""The state a checkpoint holds: the objects bound to it (model parts, optimizers, schedulers, train state, RNG), the
save-side state dict (structure built once, cached) and the load into them. CheckpointManager holds one `BoundState`."""

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

from checkpoint.optim_init import init_optimizer_state
from checkpoint.state import capture_rng, restore_rng

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


class BoundState:
    """The objects a checkpoint saves and restores, on one rank; `stager`: the async saves' staging buffers (None
    for synchronous saves), made anew when the tensors behind the state change. No collective."""

    def __init__(self, *, rank: int, stager: Any | None) -> None:
        self.rank = rank
        self.stager = stager
        self.objects: dict[str, Any] | None = None  # bind() sets them
        self._cached: tuple[tuple, dict[str, Any], list[tuple[str, int, int, str]] | None] | None = None

    def bind(
        self,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[Any],
        train_state: Any | None,
    ) -> None:
        """Binds the objects later saves write; the state-dict structure and staging buffers are made anew."""
        self.objects = {
            "model_parts": list(model_parts),
            "optimizers": list(optimizers),
            "lr_schedulers": list(lr_schedulers),
            "train_state": train_state,
        }
        self._cached = None
        if self.stager is not None:
            self.stager.reset()

    def save_state_dict(self) -> dict[str, Any]:
        """The state to save. Model and optimizer tensors come from a structure built once and rebuilt
        only when the tensors behind it change; the optimizer's hyperparameters (lr), the scheduler, the
        train state and the RNG are read fresh each time."""
        sig = self._tensor_signature()
        if self._cached is None or self._cached[0] != sig:
            sd = self.state_dict()
            self._cached = (sig, sd, _param_group_refs(sd["optim"], self.objects["optimizers"]))
            if self.stager is not None:
                self.stager.reset()
            return sd
        _, sd, refs = self._cached
        if refs is None:  # hyperparameters not traceable to a param group: the optimizer part fresh each time
            b = self.objects
            sd["optim"] = {
                k: v
                for part, opt in zip(b["model_parts"], b["optimizers"])
                for k, v in get_optimizer_state_dict(part, opt, options=_OPTS).items()
            }
        else:
            opts = self.objects["optimizers"]
            for key, oi, gi, name in refs:
                sd["optim"][key] = opts[oi].param_groups[gi][name]
        sd.update(self._small_state())
        return sd

    def _tensor_signature(self) -> tuple:
        """Which tensors (and storages) the model and optimizer state consist of now; a change means
        the cached state-dict structure points at tensors no longer in use."""
        b = self.objects
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
        b = self.objects
        assert b is not None
        out: dict[str, Any] = {}
        if b["lr_schedulers"]:
            out["lr_scheduler"] = pickle.dumps(b["lr_schedulers"][0].state_dict())
        if b["train_state"] is not None:
            out["train_state"] = pickle.dumps(b["train_state"].state_dict())
        out["rng"] = {f"rank{self.rank}": pickle.dumps(capture_rng())}
        return out

    def state_dict(
        self, metadata_keys: set[str] | None = None, part_keys: list[list[str]] | None = None
    ) -> dict[str, Any]:
        b = self.objects
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

    def load(self, d: Path, *, resharded: bool) -> dict[str, Any]:
        """Reads checkpoint folder `d` into the bound objects (`resharded`: saved on another world size or mesh, so
        the RNG states stay as they are); no collective (DCP reads with no_dist)."""
        md_keys = set(FileSystemReader(str(d)).read_metadata().state_dict_metadata)
        part_keys: list[list[str]] = []
        sd = self.state_dict(md_keys, part_keys)
        if resharded:
            sd.pop("rng", None)
        with warnings.catch_warnings():  # no_dist: DCP warns that it assumes a single process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(d), no_dist=True)
        return self.apply_loaded(sd, part_keys, resharded=resharded)

    def apply_loaded(self, sd: dict[str, Any], part_keys: list[list[str]], *, resharded: bool) -> dict[str, Any]:
        """Puts a state dict read from a checkpoint (of `_state_dict`'s structure) into the bound objects."""
        b = self.objects
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
