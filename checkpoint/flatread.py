"""Reads one rank's RAM folder straight into the tensors already built: the folder is a no_dist DCP save of the rank's
local state (checkpoint/memory_tier.py), so its `.metadata` says where each item's bytes lie and nothing needs DCP's
load planner, its per-item read buffers or a resharding step. Each shard file is mapped once (private, read-only use)
and opened once; each tensor item (a torch.save record at an offset of the file) is located in place as a view of the
map, and its bytes are read from the file straight into its target (preadv; a target that is not a contiguous CPU
tensor is copied from the map); the other items (pickled values, a few bytes) are unpickled from the map.

Only for a folder saved on the same mesh from the same structure (the RAM tier's candidates are filtered so): a key,
shape or dtype that differs raises ValueError, and the caller treats it as any failed load (the step is skipped on
every rank). The bytes are the manifest's: the RAM tier checks sizes and crc32 before the load (`MemoryRestore`).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

__all__ = ["read_into"]


def read_into(d: Path, tree: dict[str, Any]) -> dict[str, Any]:
    """Fills `tree`'s tensors (plain local tensors: DTensors already replaced by their local shards) in place from the
    no_dist DCP folder `d`, and replaces its other values with the saved ones; returns `tree`. Every key of `tree`
    must be in `d` with the same shape and dtype (ValueError otherwise); keys only `d` has are left out."""
    md = FileSystemReader(str(d)).read_metadata()
    flat, mapping = flatten_state_dict(tree)
    missing = sorted(set(flat) - set(md.state_dict_metadata))
    if missing:
        raise ValueError(f"{d} lacks {len(missing)} keys of the state to load, e.g. {missing[:3]}")
    maps: dict[str, _Map] = {}
    try:
        for key, target in flat.items():
            info = _where(md, key)
            m = maps.get(info.relative_path)
            if m is None:
                m = maps[info.relative_path] = _Map(d / info.relative_path)
            value = m.load(info.offset, info.length)
            if isinstance(target, torch.Tensor):
                m.copy_into(key, target, value)
            else:
                set_element(tree, mapping[key], value)
    finally:
        for m in maps.values():
            m.close()
    return tree


def _where(md: Any, key: str) -> Any:
    """Where `key`'s bytes lie (file, offset, length): a tensor saved with no_dist is one chunk at offset 0, anything
    else one item; an item a writer extension transformed (compressed) is not read here."""
    entry = md.state_dict_metadata[key]
    if not isinstance(entry, TensorStorageMetadata):
        index = MetadataIndex(key)
    elif len(entry.chunks) != 1 or any(entry.chunks[0].offsets):
        raise ValueError(f"{key} is saved in {len(entry.chunks)} chunks, not as one rank's local tensor")
    else:
        index = MetadataIndex(key, entry.chunks[0].offsets, 0)
    info = md.storage_data[index]
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"{key} is stored transformed ({info.transform_descriptors}), not as torch.save wrote it")
    return info


class _Map:
    """One shard file mapped privately (pages are read from the file, nothing is written back), and open for reads."""

    def __init__(self, path: Path) -> None:
        size = os.path.getsize(path)
        self.storage = torch.UntypedStorage.from_file(str(path), False, size)
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(self.storage).numpy()  # the same memory
        self.path, self.fd = path, os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def copy_into(self, key: str, target: torch.Tensor, value: Any) -> None:
        """`value` (a view of the map) copied into `target`; a shape or dtype the target does not have raises. A
        contiguous CPU target is read from the file straight into its memory (one kernel copy, no page faults on the
        map); any other through the map."""
        if not isinstance(value, torch.Tensor) or value.shape != target.shape or value.dtype != target.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{key}: the RAM copy holds {got}, the state {tuple(target.shape)} {target.dtype}")
        if target.numel() == 0:
            return
        if target.device.type != "cpu" or not target.is_contiguous() or not value.is_contiguous():
            with torch.no_grad():
                target.copy_(value)
            return
        offset = value.data_ptr() - self.storage.data_ptr()
        dst = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(dst):  # one read returns at most ~2 GiB on Linux
            n = os.preadv(self.fd, [dst[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{key}: {done} of its {len(dst)} bytes in {self.path.name}")
            done += n

    def load(self, offset: int, length: int) -> Any:
        """The torch.save'd object at [offset, offset + length): its tensors are views of the map."""
        if offset + length > len(self.bytes):
            raise ValueError(f"an item at {offset}+{length} ends past the file's {len(self.bytes)} bytes")
        reader = torch._C.PyTorchFileReader(_ViewFile(memoryview(self.bytes[offset : offset + length])))
        # torch.load's own reader of a zip record, given the record's storage as the mapped bytes (as torch.load
        # does with mmap=True for a whole file): the tensor's storage is the map itself, not a copy
        return torch.serialization._load(reader, "cpu", pickle, overall_storage=self.storage[offset : offset + length])


class _ViewFile(io.RawIOBase):
    """A read-only file over a memoryview, for the zip reader (it reads the headers and the pickle only)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: len(self._view) + pos}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos
