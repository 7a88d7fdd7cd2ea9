"""The bytes of one shard file: zarr v3 ``sharding_indexed`` with ``[bytes, crc32c]`` inner and index codecs.

hsdata writes every shard densely: inner chunk ``j`` is stored at byte ``j * (chunk_nbytes + 4)`` as its raw
little-endian bytes followed by their crc32c, chunks that were never written come only after the written ones
(index entry ``(2**64-1, 2**64-1)``), and the index (``n`` pairs of little-endian uint64 ``offset, nbytes`` plus
its own crc32c) ends the file. Because the layout is dense, a reader can address any token without the index.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from crc32c import crc32c

from .errors import CorruptDataError
from .spec import StoreSpec, TensorSpec

if TYPE_CHECKING:
    from .storage import AtomicWriter

CRC_NBYTES = 4
MISSING = 2**64 - 1


def chunks_per_shard(spec: StoreSpec, tensor: TensorSpec) -> int:
    return spec.shard_tokens // tensor.chunk_tokens


def encoded_chunk_nbytes(tensor: TensorSpec) -> int:
    return tensor.chunk_nbytes + CRC_NBYTES


def index_nbytes(num_chunks: int) -> int:
    return 16 * num_chunks + CRC_NBYTES


def encode_index(written_chunks: int, num_chunks: int, chunk_size: int) -> bytes:
    """Index of a dense shard whose first ``written_chunks`` chunks are present."""
    entries = np.full((num_chunks, 2), MISSING, dtype="<u8")
    entries[:written_chunks, 0] = np.arange(written_chunks, dtype="<u8") * chunk_size
    entries[:written_chunks, 1] = chunk_size
    raw = entries.tobytes()
    return raw + struct.pack("<I", crc32c(raw))


def decode_index(data: bytes, num_chunks: int, *, where: str) -> np.ndarray:
    """Parse and checksum a shard index; returns ``[num_chunks, 2]`` uint64 ``(offset, nbytes)``."""
    if len(data) != index_nbytes(num_chunks):
        raise CorruptDataError(f"{where}: shard index is {len(data)} bytes, expected {index_nbytes(num_chunks)}")
    raw, (stored,) = data[:-CRC_NBYTES], struct.unpack("<I", data[-CRC_NBYTES:])
    computed = crc32c(raw)
    if computed != stored:
        raise CorruptDataError(f"{where}: shard index crc32c mismatch (stored {stored:#010x}, computed {computed:#010x})")
    return np.frombuffer(raw, dtype="<u8").reshape(num_chunks, 2)


class ShardEncoder:
    """Streams one tensor's rows into a shard file: chunk bytes and their crc32c, then the index on ``finish``."""

    def __init__(self, out: AtomicWriter, spec: StoreSpec, tensor: TensorSpec):
        self._out = out
        self._chunk_nbytes = tensor.chunk_nbytes
        self._num_chunks = chunks_per_shard(spec, tensor)
        self._filled = 0  # bytes of the current chunk written so far
        self._crc = 0
        self._chunks = 0  # complete chunks written

    def write(self, data: memoryview) -> None:
        """Append raw row bytes; they may start and end anywhere inside a chunk. Everything is handed to the
        file in one ``writev``: the row bytes as they are, the crc32c trailers between them."""
        view = memoryview(data).cast("B")
        out = []
        while view.nbytes:
            piece = view[: self._chunk_nbytes - self._filled]
            out.append(piece)
            self._crc = crc32c(piece, self._crc)
            self._filled += piece.nbytes
            view = view[piece.nbytes :]
            if self._filled == self._chunk_nbytes:
                out.append(self._end_chunk())
        self._out.writev(out)

    def finish(self) -> None:
        """Zero-pad the last partial chunk (zarr stores whole chunks) and append the index."""
        if self._filled:
            self.write(memoryview(bytes(self._chunk_nbytes - self._filled)))
        self._out.writev([encode_index(self._chunks, self._num_chunks, self._chunk_nbytes + CRC_NBYTES)])

    def _end_chunk(self) -> bytes:
        if self._chunks == self._num_chunks:
            raise AssertionError("shard overflow: more chunks written than the shard holds")
        trailer = struct.pack("<I", self._crc)
        self._chunks += 1
        self._filled = 0
        self._crc = 0
        return trailer


@dataclass(frozen=True)
class ShardRange:
    """A token range inside one shard: one contiguous byte range of the file, crc32c trailers between pieces."""

    shard: int
    file_start: int
    pieces: tuple[int, ...]  # payload bytes of each chunk touched, in order

    @property
    def nbytes(self) -> int:
        return sum(self.pieces)

    @property
    def file_end(self) -> int:
        return self.file_start + self.nbytes + CRC_NBYTES * (len(self.pieces) - 1)

    def split(self, max_bytes: int) -> list[ShardRange]:
        """Cut at chunk boundaries into ranges of about ``max_bytes`` (one chunk more than that at most)."""
        out, start, first, size = [], self.file_start, 0, 0
        for k, piece in enumerate(self.pieces):
            size += piece
            if size >= max_bytes or k == len(self.pieces) - 1:
                out.append(ShardRange(self.shard, start, self.pieces[first : k + 1]))
                start += size + CRC_NBYTES * (k + 1 - first)
                first, size = k + 1, 0
        return out


def token_ranges(spec: StoreSpec, tensor: TensorSpec, token_offset: int, num_tokens: int) -> list[ShardRange]:
    """The byte ranges holding tokens ``[token_offset, token_offset + num_tokens)`` of one part's array."""
    ct, row, enc, per_shard = tensor.chunk_tokens, tensor.row_nbytes, encoded_chunk_nbytes(tensor), spec.shard_tokens
    ranges = []
    t, end = token_offset, token_offset + num_tokens
    while t < end:
        shard = t // per_shard
        local, local_end = t - shard * per_shard, min(end, (shard + 1) * per_shard) - shard * per_shard
        first_chunk = local // ct
        pieces = []
        a = local
        while a < local_end:
            b = min(local_end, (a // ct + 1) * ct)
            pieces.append((b - a) * row)
            a = b
        ranges.append(ShardRange(shard, first_chunk * enc + (local - first_chunk * ct) * row, tuple(pieces)))
        t = shard * per_shard + local_end
    return ranges
