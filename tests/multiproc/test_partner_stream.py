"""Partner copies stream file by file: the process memory a copy takes stays at a few chunk
buffers, where the whole-folder payload (pickled dict, bytearray, tobytes, pickle.loads) took several times the
folder. Two gloo ranks on this machine, each sending its folder to the other; peak RSS measured (VmHWM)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from checkpoint.manifest import file_record, write_manifest
from checkpoint.partner import commit_folder, exchange, pack_folder
from checkpoint.stream import CHUNK, SendError, stream_folder
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

MIB = 2**20
S = 96 * MIB  # one rank's folder


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _folder(d: Path, rank: int) -> None:
    """A committed step folder of about S bytes, written in 1 MiB blocks (no big buffer in this process)."""
    d.mkdir(parents=True)
    block = os.urandom(MIB)
    with open(d / "__0_0.distcp", "wb") as f:
        for i in range(S // MIB):
            f.write(bytes([rank, i % 256]) + block[2:])
        f.write(b"tail" * 1000)  # not a multiple of a chunk
    (d / ".metadata").write_bytes(b"m" * 5000)
    (d / "empty").write_bytes(b"")
    write_manifest(d, {"step": 3, "rank": rank, "files": {p.name: file_record(p) for p in sorted(d.iterdir())}})


def _copy(rank: int, world: int, root: str, mode: str) -> dict:
    root_p = Path(root)
    mine = root_p / f"r{rank}" / "step_3"
    _folder(mine, rank)
    other = 1 - rank
    held = root_p / f"held{rank}"
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets this process's peak RSS (VmHWM) to its RSS now
    before = _status("VmRSS")
    if mode == "stream":
        got = stream_folder(
            mine, send_to=other, recv_from=other, tmp=held / "t.tmp", final=held / "step_3", step=3, pg=None
        )
    else:
        got = commit_folder(
            exchange(pack_folder(mine), send_to=other, recv_from=other, pg=None),
            tmp=held / "t.tmp",
            final=held / "step_3",
            step=3,
        )
    peak = _status("VmHWM") - before
    dist.barrier()
    src = root_p / f"r{other}" / "step_3"
    same = all((held / "step_3" / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())
    return {"peak": peak, "same": same, "rank": got["rank"]}


def test_a_partner_copy_streams_with_a_few_chunks_of_process_memory(tmp_path) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    new = run_ranks(_copy, 2, str(tmp_path / "new"), "stream").results
    old = run_ranks(_copy, 2, str(tmp_path / "old"), "payload").results
    for r in (0, 1):
        assert new[r]["same"] and new[r]["rank"] == 1 - r and old[r]["same"]
        # measured here: the whole-folder payload ~ 4-6 S of RSS; the stream two chunk buffers and their pages
        assert old[r]["peak"] > 3 * S, old[r]["peak"] / MIB
        assert new[r]["peak"] <= 2 * CHUNK + 16 * MIB, new[r]["peak"] / MIB


def test_a_damaged_file_fails_the_copy_on_the_receiver_and_leaves_no_folder(tmp_path) -> None:
    def damaged(rank: int, world: int, root: str) -> str:
        d = Path(root) / f"r{rank}" / "step_3"
        _folder(d, rank)
        if rank == 0:
            with open(d / "__0_0.distcp", "r+b") as f:
                f.seek(12345)
                f.write(b"\x00\x01\x02")
        held = Path(root) / f"held{rank}"
        try:
            stream_folder(
                d, send_to=1 - rank, recv_from=1 - rank, tmp=held / "t.tmp", final=held / "step_3", step=3, pg=None
            )
        except ValueError as e:
            return f"{e} | {sorted(p.name for p in held.iterdir())}"
        return f"ok | {sorted(p.name for p in held.iterdir())}"

    res = run_ranks(damaged, 2, str(tmp_path)).results
    assert res[1] == "__0_0.distcp of the copy does not match its manifest (size or crc32) | []"
    assert res[0] == "ok | ['step_3']"


def _unreadable(rank: int, world: int, root: str) -> str:
    d = Path(root) / f"r{rank}" / "step_3"
    _folder(d, rank)
    if rank == 0:
        (d / "manifest.json").write_text("{not json")
    held = Path(root) / f"held{rank}"
    try:
        got = stream_folder(
            d, send_to=1 - rank, recv_from=1 - rank, tmp=held / "t.tmp", final=held / "step_3", step=3, pg=None
        )
    except SendError as e:
        return f"SendError {'manifest.json' in str(e) or 'Expecting' in str(e)}"
    return f"received {got}"


def test_a_side_whose_folder_cannot_be_read_sends_nothing_and_neither_side_waits(tmp_path) -> None:
    res = run_ranks(_unreadable, 2, str(tmp_path), timeout=120).results
    assert res == {0: "SendError True", 1: "received None"}
