"""The write path's system-call layer: gathered small writes, writev with short writes, shard bytes unchanged."""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from crc32c import crc32c

import hsdata
import hsdata.writer as writer_module
from hsdata.io import storage as storage_module
from hsdata.shard import ShardEncoder, encode_index
from hsdata.spec import StoreSpec


def reference_shard(rows: bytes, chunk_nbytes: int, num_chunks: int) -> bytes:
    """The format of docs/format.md written the plain way: each chunk, its crc32c, zero padding, the index."""
    out = bytearray()
    chunks = 0
    for start in range(0, len(rows), chunk_nbytes):
        chunk = rows[start : start + chunk_nbytes].ljust(chunk_nbytes, b"\0")
        out += chunk + struct.pack("<I", crc32c(chunk))
        chunks += 1
    return bytes(out + encode_index([chunk_nbytes + 4] * chunks, num_chunks))


@pytest.mark.parametrize("seed", range(4))
def test_shard_bytes_match_the_plain_encoding_whatever_the_write_sizes(tmp_path, seed):
    rng = np.random.default_rng(seed)
    spec = StoreSpec.new(64, [1, 2, 3], "m", shard_tokens=4096, chunk_tokens=32)
    tensor = spec.tensor("aux_hidden_states")
    data = rng.integers(0, 256, tensor.row_nbytes * int(rng.integers(1, 4096)), dtype=np.uint8).tobytes()
    storage = storage_module.Storage(str(tmp_path))
    writer = storage.open_writer("shard")
    encoder = ShardEncoder(writer, spec, tensor)
    position = 0
    while position < len(data):  # sizes around the gathering threshold and the chunk size
        n = int(rng.choice([1, 7, 4096, tensor.chunk_nbytes, storage_module.SMALL_WRITE_BYTES - 1,
                            storage_module.SMALL_WRITE_BYTES, 3 * storage_module.SMALL_WRITE_BYTES + 5]))
        encoder.write(memoryview(data[position : position + n]))
        position += n
    encoder.finish()
    writer.commit()
    expected = reference_shard(data, tensor.chunk_nbytes, spec.shard_tokens // tensor.chunk_tokens)
    assert (tmp_path / "shard").read_bytes() == expected


def short_writes(monkeypatch):
    """Make every ``pwritev`` of the storage module write at most 1000 bytes, as a signal-interrupted write may."""
    real = os.pwritev

    def short(fd, buffers, offset):
        budget, pieces = 1000, []
        for b in buffers:
            piece = memoryview(b)[:budget]
            pieces.append(piece)
            budget -= piece.nbytes
            if not budget:
                break
        return real(fd, pieces, offset)

    monkeypatch.setattr(storage_module.os, "pwritev", short)


def test_short_writes_resume_where_they_stopped(tmp_path, monkeypatch):
    short_writes(monkeypatch)
    storage = storage_module.Storage(str(tmp_path))
    writer = storage.open_writer("f")
    parts = [os.urandom(n) for n in (3, storage_module.SMALL_WRITE_BYTES + 11, 5, 1 << 20, 2)]
    writer.writev(parts[:3])
    writer.write(parts[3])
    writer.writev(parts[4:])
    writer.commit()
    assert (tmp_path / "f").read_bytes() == b"".join(parts)


def test_positional_writes_from_threads_land_at_their_offsets(tmp_path, monkeypatch):
    """A compressed shard's frames are written side by side by the compress threads, each at the offset its
    predecessor's end gave it, in pieces (a short write resumes at its own offset), with writeback started on the
    way (every 64 KiB here)."""
    short_writes(monkeypatch)
    monkeypatch.setattr(storage_module, "WRITEBACK_BYTES", 64 << 10)
    started = []
    monkeypatch.setattr(storage_module, "_start_writeback", lambda fd, offset, nbytes: started.append((offset, nbytes)))
    rng = np.random.default_rng(3)
    frames = [[os.urandom(int(n)) for n in rng.integers(0, 20_000, 3)] for _ in range(64)]
    offsets = np.cumsum([0] + [sum(map(len, frame)) for frame in frames]).tolist()
    writer = storage_module.Storage(str(tmp_path)).open_writer("f")
    assert writer.positional
    with ThreadPoolExecutor(4) as pool:
        order = [k ^ 3 for k in range(len(frames))]  # out of order within each four
        list(pool.map(writer.write_at, [frames[k] for k in order], [offsets[k] for k in order]))
    writer.commit()
    assert (tmp_path / "f").read_bytes() == b"".join(b"".join(frame) for frame in frames)
    assert len(started) >= 8 and all(n > 0 and offset + n <= offsets[-1] for offset, n in started)
    assert [offset for offset, _ in started] == sorted(offset for offset, _ in started)  # each past the last


def test_small_writes_are_gathered(tmp_path, monkeypatch):
    calls = []
    real = os.pwritev
    monkeypatch.setattr(storage_module.os, "pwritev",
                        lambda fd, bufs, offset: calls.append(len(bufs)) or real(fd, bufs, offset))
    storage = storage_module.Storage(str(tmp_path))
    writer = storage.open_writer("f")
    for _ in range(1000):
        writer.write(b"0123456789abcdef")
    writer.commit()
    assert len(calls) == 1  # 16 KB of 16-byte writes: one system call, at commit
    assert (tmp_path / "f").read_bytes() == b"0123456789abcdef" * 1000


def test_an_aborted_file_leaves_nothing(tmp_path):
    storage = storage_module.Storage(str(tmp_path))
    writer = storage.open_writer("d/f")
    writer.write(os.urandom(1 << 20))
    writer.abort()
    assert os.listdir(tmp_path / "d") == []


def shard_files(root) -> list[tuple[str, bytes]]:
    """(tensor/c/..., bytes) of every shard file under ``root``, the part's name left out."""
    out = []
    for directory, _, names in os.walk(root):
        rel = os.path.relpath(directory, root).split(os.sep)
        if "c" in rel:
            for name in names:
                key = "/".join(rel[rel.index("c") - 1 :] + [name])
                with open(os.path.join(directory, name), "rb") as f:
                    out.append((key, f.read()))
    return sorted(out)


def test_inline_and_threaded_paths_write_identical_shards(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(40):
        n = int(rng.integers(1, 300))
        samples.append({"input_ids": rng.integers(0, 1000, n).astype(np.int32),
                        "loss_mask": rng.integers(0, 2, n).astype(np.uint8),
                        "aux_hidden_states": rng.standard_normal((n, 3 * 128)).astype(np.float16),
                        "hidden_states": rng.standard_normal((n, 128)).astype(np.float16)})
    stores = {}
    for inline in (0, 1 << 40):
        monkeypatch.setattr(writer_module, "INLINE_BYTES", inline)
        path = tmp_path / f"s{inline}"
        with hsdata.create(str(path), 128, [1, 2, 3], "m", dtype="float16", shard_tokens=2048, chunk_tokens=16) as w:
            for i, s in enumerate(samples):
                w.add(f"s{i}", **s)
        store = hsdata.open(str(path))
        for i, s in enumerate(samples):
            got = store.get(f"s{i}")
            assert np.array_equal(got["hidden_states"].view(torch.int16).numpy(), s["hidden_states"].view(np.int16))
        stores[inline] = shard_files(path)
    tokens = sum(len(s["input_ids"]) for s in samples)
    assert len(stores[0]) == 4 * -(-tokens // 2048)  # crossing shard boundaries, 4 tensors
    assert stores[0] == stores[1 << 40]
