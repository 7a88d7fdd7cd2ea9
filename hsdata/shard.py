"""The bytes of one shard file: zarr v3 ``sharding_indexed`` with ``[bytes, crc32c]`` inner codecs (``[bytes,
blosc, crc32c]`` for a compressed tensor) and ``[bytes, crc32c]`` index codecs.

hsdata writes every shard packed: inner chunks in order and back to back from byte 0, each its encoded bytes
followed by their crc32c, chunks that were never written come only after the written ones (index entry
``(2**64-1, 2**64-1)``), and the index (``n`` pairs of little-endian uint64 ``offset, nbytes`` plus its own
crc32c) ends the file. An uncompressed chunk is its raw little-endian bytes, so every chunk has the same size and
a reader can address any token without the index (the dense rule); a compressed tensor's reader needs the index.
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
from crc32c import crc32c

from .codecs.blosc import decode_into
from .errors import CorruptDataError
from .spec import StoreSpec, TensorSpec

if TYPE_CHECKING:
    from .io.storage import AtomicWriter

CRC_NBYTES = 4
CHUNKS_PER_TASK = 4  # whole chunks of the caller's rows compressed by one pool task: fewer GIL hand-offs a chunk
MISSING = 2**64 - 1


def chunks_per_shard(spec: StoreSpec, tensor: TensorSpec) -> int:
    return spec.shard_tokens // tensor.chunk_tokens


def encoded_chunk_nbytes(tensor: TensorSpec) -> int:
    return tensor.chunk_nbytes + CRC_NBYTES


def index_nbytes(num_chunks: int) -> int:
    return 16 * num_chunks + CRC_NBYTES


def encode_index(sizes: Sequence[int], num_chunks: int) -> bytes:
    """Index of a packed shard whose first ``len(sizes)`` chunks are present, of these encoded sizes."""
    entries = np.full((num_chunks, 2), MISSING, dtype="<u8")
    sizes = np.asarray(sizes, dtype="<u8")
    entries[: len(sizes), 1] = sizes
    entries[: len(sizes), 0] = np.cumsum(sizes) - sizes
    raw = entries.tobytes()
    return raw + struct.pack("<I", crc32c(raw))


def written_chunks(index: np.ndarray) -> int:
    """How many chunks an index records (those before the first missing entry)."""
    missing = np.flatnonzero(index[:, 0] == MISSING)
    return int(missing[0]) if len(missing) else len(index)


def index_spans(index: np.ndarray, file_size: int, tensor: TensorSpec) -> np.ndarray:
    """``(offset, nbytes)`` of each written chunk of a decoded index, once it is found to describe its file:
    dense (an uncompressed tensor, section 5) or packed (compressed, section 5b), ending where the index starts;
    else :class:`CorruptDataError` saying what is wrong."""
    written = written_chunks(index)
    present, absent = index[:written], index[written:]
    if tensor.compression is None:
        dense = [encoded_chunk_nbytes(tensor)] * written
        if encode_index(dense, len(index))[:-CRC_NBYTES] != index.tobytes():
            raise CorruptDataError("shard index does not describe a dense shard (docs/format.md section 5)")
    elif (absent != MISSING).any():
        raise CorruptDataError("shard index: a chunk is recorded after a missing one (docs/format.md section 5b)")
    elif written and ((present[:, 1] < CRC_NBYTES).any() or present[0, 0] != 0
                      or (present[1:, 0] != present[:-1, 0] + present[:-1, 1]).any()):
        raise CorruptDataError("shard index: its chunks do not lie back to back from byte 0 (docs/format.md "
                               "section 5b)")
    implied = (int(present[-1].sum()) if written else 0) + index_nbytes(len(index))
    if file_size != implied:
        raise CorruptDataError(f"file is {file_size} bytes, its index implies {implied} (truncated?)")
    return present


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

    def write(self, data: memoryview) -> list[Future]:
        """Append raw row bytes; they may start and end anywhere inside a chunk. Everything is handed to the
        file in one ``writev``: the row bytes as they are, the crc32c trailers between them; nothing reads
        ``data`` once this returns (no task returned, as :meth:`CompressedShardEncoder.write` may)."""
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
        return []

    def settle(self) -> None:
        """Nothing to wait for: every write happens on the caller's thread."""

    def finish(self) -> None:
        """Zero-pad the last partial chunk (zarr stores whole chunks) and append the index."""
        if self._filled:
            self.write(memoryview(bytes(self._chunk_nbytes - self._filled)))
        self._out.writev([encode_index([self._chunk_nbytes + CRC_NBYTES] * self._chunks, self._num_chunks)])

    def _end_chunk(self) -> bytes:
        if self._chunks == self._num_chunks:
            raise AssertionError("shard overflow: more chunks written than the shard holds")
        trailer = struct.pack("<I", self._crc)
        self._chunks += 1
        self._filled = 0
        self._crc = 0
        return trailer


class CompressedShardEncoder:
    """Streams one tensor's rows into a shard file of compressed chunks: chunks are compressed on ``pool``
    (straight from the rows where they hold them whole, up to ``CHUNKS_PER_TASK`` a task, else gathered first and
    one a task), up to ``in_flight`` chunks at once;
    the index on ``finish`` records their sizes. A chunk's place in the file is its predecessor's end, known once
    that one is compressed: the thread that compresses the chunk completing the run of compressed chunks since
    the last one placed places that run, so no thread waits for another. Where the file takes positional writes
    each thread writes the frames it placed, side by side with the others; else one thread at a time writes
    every frame placed, in order. The caller's thread does little under the GIL and never waits for a chunk
    unless ``in_flight`` are."""

    def __init__(self, out: AtomicWriter, spec: StoreSpec, tensor: TensorSpec, pool: Executor, in_flight: int):
        self._out = out
        self._pool = pool
        self._in_flight_max = in_flight
        self._frame = tensor.compression.encoder(tensor.itemsize)
        self._chunk_nbytes = tensor.chunk_nbytes
        self._num_chunks = chunks_per_shard(spec, tensor)
        self._chunk = bytearray(self._chunk_nbytes)
        self._filled = 0
        self._chunks = 0  # chunks handed to the pool
        self._in_flight: deque[tuple[Future, int]] = deque()  # each task's compression and write, and its chunks
        self._in_flight_chunks = 0
        self._spare: deque[bytearray] = deque()  # chunk buffers written already, reused (fresh memory faults pages in)
        self._lock = threading.Lock()  # guards what follows: placing frames in the file
        self._compressed: dict[int, tuple] = {}  # chunk number -> (frame, chunk) compressed, not yet placed
        self._sizes: list[int] = []  # encoded bytes of every chunk placed, in order
        self._end = 0  # where the chunks placed end in the file
        self._unwritten: deque[tuple] = deque()  # (frame, chunk) placed, not yet written (sequential files only)
        self._writing = False  # whether a thread is writing ``_unwritten`` (sequential files only)

    def write(self, data: memoryview) -> list[Future]:
        """Append raw row bytes; they may start and end anywhere inside a chunk. The whole chunks in ``data`` are
        compressed straight from it (no copy under the GIL), the rest is gathered into a chunk buffer. Returns
        the compressions still reading ``data``: it must stay as it is until they are done."""
        view, direct = memoryview(data).cast("B"), []
        try:
            while view.nbytes:
                whole = min(view.nbytes // self._chunk_nbytes, CHUNKS_PER_TASK) if not self._filled else 0
                if whole:
                    size = self._chunk_nbytes
                    direct.append(self._end_chunks([view[k * size : (k + 1) * size] for k in range(whole)]))
                    view = view[whole * size :]
                    continue
                n = min(view.nbytes, self._chunk_nbytes - self._filled)
                self._chunk[self._filled : self._filled + n] = view[:n]
                self._filled += n
                view = view[n:]
                if self._filled == self._chunk_nbytes:
                    self._end_chunks([self._chunk])
                    self._chunk = self._spare.popleft() if self._spare else bytearray(self._chunk_nbytes)
                    self._filled = 0
        except BaseException:
            wait(direct)  # the rows are not read once this raises
            raise
        return direct

    def finish(self) -> None:
        """Compress the last partial chunk zero-padded, wait for every chunk's write, then write the index."""
        if self._filled:
            self._chunk[self._filled :] = bytes(self._chunk_nbytes - self._filled)
            self._end_chunks([self._chunk])
        self.settle()
        index = encode_index(self._sizes, self._num_chunks)
        if self._out.positional:
            self._out.write_at([index], self._end)
        else:
            self._out.writev([index])

    def settle(self) -> None:
        """Wait until no chunk is in flight (none touches the file after this), then raise the first failure."""
        in_flight, self._in_flight, self._in_flight_chunks = [task for task, _ in self._in_flight], deque(), 0
        wait(in_flight)
        for task in in_flight:
            task.result()

    def _end_chunks(self, chunks: list) -> Future:
        """Hand whole consecutive chunks (this encoder's buffer, or views of the caller's rows) to the pool as one
        task; return their compression (done once the chunks are no longer read)."""
        if self._chunks + len(chunks) > self._num_chunks:
            raise AssertionError("shard overflow: more chunks written than the shard holds")
        compressed: Future = Future()
        task = self._pool.submit(self._encode_and_write, self._chunks, chunks, compressed)
        self._in_flight.append((task, len(chunks)))
        self._chunks += len(chunks)
        self._in_flight_chunks += len(chunks)
        while self._in_flight and (self._in_flight_chunks > self._in_flight_max or self._in_flight[0][0].done()):
            task, count = self._in_flight.popleft()
            self._in_flight_chunks -= count
            task.result()
        return compressed

    def _encode_and_write(self, number: int, chunks: list, compressed: Future) -> None:
        """Compress chunks ``number, number + 1, ...``, place every compressed chunk whose predecessors are placed,
        and write them (a pool thread). A chunk that fails is never placed, nor is any after it: the shard is not
        committed."""
        try:
            frames = self._encode(chunks)
        except BaseException as e:
            compressed.set_exception(e)
            raise
        compressed.set_result(None)
        with self._lock:
            for k, (frame, chunk) in enumerate(zip(frames, chunks)):
                self._compressed[number + k] = frame, chunk
            placed = []  # (frame, chunk, offset) of each chunk this thread places, back to back in the file
            while len(self._sizes) in self._compressed:
                ready, source = self._compressed.pop(len(self._sizes))
                size = sum(memoryview(part).nbytes for part in ready)
                placed.append((ready, source, self._end))
                self._sizes.append(size)
                self._end += size
            if not self._out.positional:
                self._unwritten.extend(placed)
                writes = not self._writing  # else the thread writing writes these after those before them
                self._writing = True
        if self._out.positional:
            if placed:
                self._out.write_at([part for ready, _, _ in placed for part in ready], placed[0][2])
            for _, source, _ in placed:
                self._reuse(source)
        elif writes:
            self._write_in_order()

    def _write_in_order(self) -> None:
        """Write every frame placed until none is left unwritten (one thread at a time, for a sequential file)."""
        while True:
            with self._lock:
                if not self._unwritten:
                    self._writing = False
                    return
                frame, chunk, _ = self._unwritten.popleft()
            self._out.writev(frame)  # a failure leaves ``_writing`` set: nothing more is written
            self._reuse(chunk)

    def _reuse(self, chunk) -> None:
        if isinstance(chunk, bytearray):
            self._spare.append(chunk)  # reused only once its frame is written

    def _encode(self, chunks: list) -> list[list]:
        """Each chunk's frame followed by its crc32c. A frame of the caller's rows is copied where it lies in them (a
        copied frame, raw unshuffled bytes): the rows are not read once its compression is done."""
        out = []
        for chunk, frame in zip(chunks, self._frame(chunks)):
            if not isinstance(chunk, bytearray):
                frame = [bytes(part) if np.may_share_memory(part, chunk) else part for part in frame]
            crc = 0
            for part in frame:
                crc = crc32c(part, crc)
            out.append([*frame, struct.pack("<I", crc)])
        return out


@dataclass(frozen=True)
class ChunkRun:
    """Whole chunks of one compressed shard, back to back in the file, holding a token range: their encoded
    sizes, and where the range's payload starts in the first chunk's decoded bytes."""

    shard: int
    file_start: int
    sizes: tuple[int, ...]  # encoded bytes of each chunk (compressed bytes + crc32c)
    skip: int  # decoded bytes of the first chunk before the range
    nbytes: int  # payload bytes of the range

    @property
    def file_end(self) -> int:
        return self.file_start + sum(self.sizes)

    def split(self, max_bytes: int, chunk_nbytes: int) -> list[ChunkRun]:
        """Cut at chunk boundaries into runs of about ``max_bytes`` in the file."""
        out, start, first, size, skip, left = [], self.file_start, 0, 0, self.skip, self.nbytes
        for k, encoded in enumerate(self.sizes):
            size += encoded
            if size >= max_bytes or k == len(self.sizes) - 1:
                payload = min(left, (k + 1 - first) * chunk_nbytes - skip)
                out.append(ChunkRun(self.shard, start, self.sizes[first : k + 1], skip, payload))
                start, first, size, skip, left = start + size, k + 1, 0, 0, left - payload
        return out


def chunk_runs(spec: StoreSpec, tensor: TensorSpec, spans: Callable[[int], np.ndarray], token_offset: int,
               num_tokens: int, describe: Callable[[int], str]) -> list[ChunkRun]:
    """The chunks holding tokens ``[token_offset, token_offset + num_tokens)`` of a compressed array, one run per
    shard touched; ``spans(shard)`` gives a shard's written chunks (:func:`index_spans`), ``describe(shard)`` names
    its file for errors."""
    ct, row, per_shard = tensor.chunk_tokens, tensor.row_nbytes, spec.shard_tokens
    runs, t, end = [], token_offset, token_offset + num_tokens
    while t < end:
        shard = t // per_shard
        local, local_end = t - shard * per_shard, min(end, (shard + 1) * per_shard) - shard * per_shard
        first, last = local // ct, (local_end - 1) // ct
        present = spans(shard)
        if last >= len(present):
            raise CorruptDataError(f"{describe(shard)}: chunk {last} is not in the shard's index (it records "
                                   f"{len(present)} chunks)")
        sizes = tuple(int(n) for n in present[first : last + 1, 1])
        runs.append(ChunkRun(shard, int(present[first, 0]), sizes, (local - first * ct) * row, (local_end - local) * row))
        t = shard * per_shard + local_end
    return runs


def decode_run(data: memoryview, run: ChunkRun, tensor: TensorSpec, destination: memoryview, *,
               where: Callable[[], str]) -> None:
    """Check each chunk's crc32c in ``data`` (the run's bytes as they lie in the file), decompress it and copy
    the range's payload into ``destination``; ``where()`` names the range in errors. The GIL is held only
    between the checks, decoding and copies (the read threads decode side by side)."""
    chunk_nbytes, skip, out, position = tensor.chunk_nbytes, run.skip, destination, 0
    for k, encoded in enumerate(run.sizes):
        piece = _checked_chunk(data, position, encoded, k, where)
        take = min(out.nbytes, chunk_nbytes - skip)
        whole = skip == 0 and take == chunk_nbytes
        scratch = None if whole else _scratch(chunk_nbytes)
        try:
            decode_into(piece, out[:take] if whole else scratch)
        except ValueError as e:
            raise CorruptDataError(f"{where()}: chunk {k} of the range: {e}") from None
        if not whole:  # numpy copies without the GIL, a memoryview assignment with it
            np.copyto(np.frombuffer(out[:take], np.uint8), np.frombuffer(scratch[skip : skip + take], np.uint8))
        out, skip, position = out[take:], 0, position + encoded


def check_run(data: memoryview, run: ChunkRun, *, where: Callable[[], str]) -> None:
    """Check the crc32c of each chunk in ``data`` (the run's bytes as they lie in the file), decoding nothing:
    the chunks are decoded elsewhere (on a GPU)."""
    position = 0
    for k, encoded in enumerate(run.sizes):
        _checked_chunk(data, position, encoded, k, where)
        position += encoded


def _checked_chunk(data: memoryview, position: int, encoded: int, k: int, where: Callable[[], str]) -> memoryview:
    """Chunk ``k`` of a run (``encoded`` bytes at ``position``: its frame, then its crc32c), once its crc32c
    matches."""
    piece = data[position : position + encoded - CRC_NBYTES]
    (stored,) = struct.unpack_from("<I", data, position + encoded - CRC_NBYTES)
    computed = crc32c(piece)
    if computed != stored:
        raise CorruptDataError(f"{where()}: chunk {k} of the range fails its crc32c (stored {stored:#010x}, "
                               f"computed {computed:#010x})")
    return piece


_SCRATCH = threading.local()  # each reading thread's buffer for the chunks a range covers only in part


def _scratch(nbytes: int) -> memoryview:
    """This thread's scratch buffer of ``nbytes`` (kept and reused: a fresh one pays its page faults per read)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _SCRATCH.buffer = bytearray(nbytes)
    return memoryview(buffer)[:nbytes]


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
