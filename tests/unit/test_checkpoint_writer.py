"""The checkpoint writer's stream (checkpoint/writer.py): crc32 and size of what it writes, and a large write's
writeback started piece by piece, each before that piece is summed."""

from __future__ import annotations

import os
import zlib

import checkpoint.writer as writer_mod


def test_a_large_write_goes_in_pieces_whose_writeback_starts_before_each_is_summed(tmp_path, monkeypatch):
    calls: list[tuple] = []
    monkeypatch.setattr(writer_mod, "_start_writeback", lambda fd, off, n: calls.append(("writeback", off, n)))
    real_crc = zlib.crc32

    class _Zlib:
        @staticmethod
        def crc32(b, crc=0):
            calls.append(("crc32", memoryview(b).nbytes))
            return real_crc(b, crc)

    monkeypatch.setattr(writer_mod, "zlib", _Zlib)
    piece = writer_mod._PIECE
    big = os.urandom(2 * piece + 12345)
    with open(tmp_path / "f", "wb") as f:
        s = writer_mod._CrcStream(f)
        assert s.write(b"head") == 4 and s.write(b"") == 0
        assert s.write(memoryview(big)) == len(big)
        s.write(bytearray(b"tail"))
        f.flush()
    data = (tmp_path / "f").read_bytes()
    assert data == b"head" + big + b"tail" and s.size == len(data)
    assert f"{s.crc:08x}" == f"{real_crc(data):08x}"
    assert calls == [
        ("crc32", 4),
        ("writeback", 0, 4 + piece), ("crc32", piece),
        ("writeback", 4 + piece, piece), ("crc32", piece),
        ("crc32", 12345),  # under writeback's 1 MiB minimum: left to the final fsync
        ("crc32", 4),
    ]
