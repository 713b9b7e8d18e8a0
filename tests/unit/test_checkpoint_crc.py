"""The crc32 a checkpoint check takes of a file: in ranges on several threads, combined into the file's one sum."""

from __future__ import annotations

import os
import random
import zlib

import checkpoint.manifest as manifest_mod
from checkpoint.manifest import check_files, crc32_combine, file_record


def test_combining_the_crc32_of_two_pieces_gives_the_crc32_of_the_whole() -> None:
    rng = random.Random(0)
    for n1, n2 in [(0, 0), (0, 7), (7, 0), (1, 1), (1000, 3), (4096, 65537)] + [
        (rng.randrange(5000), rng.randrange(5000)) for _ in range(50)
    ]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (n1, n2)


def test_a_file_summed_in_ranges_on_threads_has_the_crc32_of_its_bytes_and_passes_its_check(
    tmp_path, monkeypatch
) -> None:
    data = random.Random(1).randbytes(3 * 1000 + 17)
    path = tmp_path / "shard"
    path.write_bytes(data)
    monkeypatch.setattr(manifest_mod, "_MIN_RANGE", 1000)  # 3 ranges on 3 threads where the cores allow
    monkeypatch.setattr(manifest_mod, "_CHUNK", 64)  # several reads per range
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    rec = file_record(path)
    assert rec == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert check_files(tmp_path, {"shard": rec}, ["shard"], checksum=True) == []
    path.write_bytes(data[:2500] + bytes([data[2500] ^ 1]) + data[2501:])  # one bit in the third range
    assert check_files(tmp_path, {"shard": rec}, ["shard"], checksum=True) == [
        f"shard crc32 {zlib.crc32(path.read_bytes()):08x} != manifest {rec['crc32']}"
    ]
