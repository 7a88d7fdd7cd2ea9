"""Compressed hidden states decoded on the device their batch goes to.

A batch read for a GPU keeps its compressed tensors as stored: the chunks' blosc frames (checked against their
crc32c on the host) cross to the device as they are, a third fewer bytes than decoded. There, each frame's zstd
streams are decoded by nvCOMP in one batched call (docs/format.md section 5c: blosc frames of byte-shuffled
blocks, each block one standard zstd frame), the blocks are unshuffled and each sample's rows are cut out of its
chunks, all as tensor operations. On any other device the streams are decoded by the CPU's zstd instead, the
rest being the same code (that is how the tests check it without a GPU).

:class:`EncodedStates` is the host's part: where every stream lies and where every sample's rows are, made from
the frames' headers once the batch is read. :func:`decode` is the device's part.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..codecs.blosc import FrameError, blosc_streams
from ..codecs.compression import device_decodable
from ..errors import CorruptDataError
from ..reader import EncodedRows
from ..shard import CRC_NBYTES
from ..spec import StoreSpec

NVCOMP_PACKAGES = "'hsdata[nvcomp-cu12]' or 'hsdata[nvcomp-cu13]' (nvCOMP 6's library, matching torch.version.cuda)"


@dataclass
class EncodedStates:
    """A batch's compressed rows of one tensor, as its ``data`` (the samples' :class:`EncodedRows` bytes back to
    back) crosses to a device: every zstd stream of its chunks (where it lies in ``data``, its length, where it
    decodes to among the chunks' decoded bytes, and to how many bytes), each chunk's shuffling, and each run of
    rows (where it starts among the decoded bytes, and its length), in the order the rows are laid out."""

    chunk_nbytes: int
    typesize: int
    stream_offsets: np.ndarray  # int64 [s]
    stream_sizes: np.ndarray  # int64 [s]
    stream_targets: np.ndarray  # int64 [s]: chunk k's decoded bytes are [k * chunk_nbytes, (k + 1) * chunk_nbytes)
    stream_lengths: np.ndarray  # int64 [s]; a stream whose size is its length is stored raw
    blocksizes: np.ndarray  # int64 [c]: each chunk's blosc block size, 0 for a chunk not shuffled
    runs: np.ndarray  # int64 [r, 2]: (first byte among the decoded bytes, bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded rows."""
        return int(self.runs[:, 1].sum())

    @classmethod
    def of_samples(cls, data: torch.Tensor, samples: Sequence[tuple[int, EncodedRows]]) -> EncodedStates:
        """The streams and runs of several samples' encoded rows of one tensor in ``data`` (uint8), each ``(where
        its bytes start in data, its rows)``, in that order: :meth:`of_tensors` of the one tensor."""
        return cls.of_tensors(data, [(0, samples)])[0]

    @classmethod
    def of_tensors(cls, data: torch.Tensor,
                   tensors: Sequence[tuple[int, Sequence[tuple[int, EncodedRows]]]]) -> list[EncodedStates]:
        """Each tensor's :meth:`of_samples`, given as ``(base, samples)``: of its bytes from ``base`` in ``data`` on
        (its samples' starts and its streams' offsets count from there). The frames' headers of all of them are
        parsed at once (``CorruptDataError`` naming the tensor, run and chunk of a frame that is not blosc zstd
        with byte shuffle or none, or not of the tensor's chunk and item size)."""
        specs, runs, offsets, sizes, firsts = [], [], [], [], []
        for base, samples in tensors:
            tensor = samples[0][1].tensor
            tensor_runs = [run for _, rows in samples for run in rows.runs]
            frame_sizes = np.fromiter((size for run in tensor_runs for size in run.sizes), np.int64)
            counts = np.array([sum(len(run.sizes) for run in rows.runs) for _, rows in samples])
            before = np.cumsum(frame_sizes) - frame_sizes  # a frame's start: its sample's, then its chunks before it
            sample_starts = base + np.array([start for start, _ in samples])
            offsets.append(before + np.repeat(sample_starts - before[np.cumsum(counts) - counts], counts))
            specs.append(tensor)
            runs.append(tensor_runs)
            sizes.append(frame_sizes)
            firsts.append(np.cumsum([0] + [len(run.sizes) for run in tensor_runs]))  # each run's first chunk
        frame_counts = [len(s) for s in sizes]
        bounds = np.cumsum([0, *frame_counts])  # each tensor's first frame among all
        chunk_nbytes, itemsizes = (np.repeat([getattr(t, key) for t in specs], frame_counts)
                                   for key in ("chunk_nbytes", "itemsize"))
        try:
            streams = blosc_streams(data.numpy(), chunk_nbytes, (np.concatenate(offsets),
                                                                 np.concatenate(sizes) - CRC_NBYTES))
            wrong = np.flatnonzero(streams.shuffled & (streams.typesizes != itemsizes))
            if len(wrong):
                raise FrameError(int(wrong[0]), f"shuffled in items of {streams.typesizes[wrong[0]]} bytes, the "
                                 f"tensor's are {itemsizes[wrong[0]]}")
        except FrameError as e:
            t = int(np.searchsorted(bounds, e.frame, side="right")) - 1
            frame = e.frame - bounds[t]
            k = int(np.searchsorted(firsts[t], frame, side="right")) - 1
            raise CorruptDataError(f"{specs[t].name}: chunk {frame - firsts[t][k]} of a run at byte "
                                   f"{runs[t][k].file_start} of shard {runs[t][k].shard}: {e}") from None
        cuts = np.searchsorted(streams.frames, bounds)  # streams are in the order of their frames
        out = []
        for t, tensor in enumerate(specs):
            s, lo, hi = slice(cuts[t], cuts[t + 1]), bounds[t], bounds[t + 1]
            out.append(cls(tensor.chunk_nbytes, tensor.itemsize, streams.offsets[s] - tensors[t][0], streams.sizes[s],
                           streams.targets[s] + (streams.frames[s] - lo) * tensor.chunk_nbytes, streams.lengths[s],
                           np.where(streams.shuffled[lo:hi], streams.blocksizes[lo:hi], 0),
                           np.array([(first * tensor.chunk_nbytes + run.skip, run.nbytes) for first, run in
                                     zip(firsts[t].tolist(), runs[t])], np.int64).reshape(-1, 2)))
        return out


def decode(states: EncodedStates, data: torch.Tensor) -> torch.Tensor:
    """The rows ``states`` describe, decoded from ``data`` (uint8, on any device) on its device, end to end in
    one uint8 tensor there."""
    return decode_many([(states, data)])[0]


def decode_many(parts: Sequence[tuple[EncodedStates, torch.Tensor]]) -> list[torch.Tensor]:
    """Each part's rows, as :func:`decode` makes them, with one zstd call for the streams of all of them: nvCOMP's
    batched zstd takes about as long for 8 chunks as for 500 (about 10 ms on an H200), so it pays only when it is
    given many (benchmarks/RESULTS.md, "GPU decoding"). The chunks of the parts of one tensor (one chunk size and
    item size) are decoded next to each other and unshuffled together, so a bundle costs a few tensor operations
    for each tensor, not for each part; each part's rows are views of them (or one copy of its runs)."""
    data = parts[0][1] if len(parts) == 1 else torch.cat([d for _, d in parts])
    data_starts = np.cumsum([0] + [len(d) for _, d in parts])[:-1]
    nbytes = [len(s.blocksizes) * s.chunk_nbytes for s, _ in parts]
    groups = collections.defaultdict(list)  # the parts of each tensor, by (chunk size, item size)
    for k, (states, _) in enumerate(parts):
        groups[states.chunk_nbytes, states.typesize].append(k)
    order = [k for members in groups.values() for k in members]
    out_starts = np.zeros(len(parts), np.int64)
    out_starts[order] = np.cumsum([0] + [nbytes[k] for k in order])[:-1]
    shuffled = torch.empty(sum(nbytes), dtype=torch.uint8, device=data.device)
    offsets, sizes, targets, lengths = (np.concatenate(v) for v in zip(*(
        (s.stream_offsets + d, s.stream_sizes, s.stream_targets + o, s.stream_lengths)
        for (s, _), d, o in zip(parts, data_starts, out_starts))))
    raw = sizes == lengths
    coded = ~raw
    if coded.any():
        decode_zstd(data, (offsets[coded], sizes[coded]), shuffled, (targets[coded], lengths[coded]))
    copy_pieces(data, offsets[raw], shuffled, targets[raw], lengths[raw])
    rows: list[torch.Tensor | None] = [None] * len(parts)
    for (chunk_nbytes, typesize), members in groups.items():
        start = int(out_starts[members[0]])
        chunks = shuffled[start : start + sum(nbytes[k] for k in members)].view(-1, chunk_nbytes)
        blocksizes = np.concatenate([parts[k][0].blocksizes for k in members])
        flat = _unshuffled(chunks, blocksizes, typesize).view(-1)
        for k in members:
            base = int(out_starts[k]) - start
            runs = [flat[base + first : base + first + length] for first, length in parts[k][0].runs.tolist()]
            rows[k] = runs[0] if len(runs) == 1 else torch.cat(runs or [flat[:0]])  # one run: a view, no copy
    return rows


def _unshuffled(chunks: torch.Tensor, blocksizes: np.ndarray, typesize: int) -> torch.Tensor:
    """``chunks`` ([c, chunk_nbytes] uint8) with the blocks of each shuffled chunk (block size > 0) unshuffled:
    a block of n bytes holds its n // typesize items' byte 0s, then their byte 1s, ...; its last n % typesize
    bytes are as they are."""
    if not blocksizes.any():
        return chunks
    sizes = np.unique(blocksizes)
    if len(sizes) == 1:  # every chunk shuffled in blocks of one size (what hsdata writes)
        return _unshuffle(chunks, int(sizes[0]), typesize)
    out = chunks.clone()
    for blocksize in sizes[sizes > 0].tolist():
        rows = torch.as_tensor(np.flatnonzero(blocksizes == blocksize), device=chunks.device)
        out[rows] = _unshuffle(chunks[rows], blocksize, typesize)
    return out


def _unshuffle(chunks: torch.Tensor, blocksize: int, typesize: int) -> torch.Tensor:
    """``chunks`` ([c, n] uint8) with every block of ``blocksize`` bytes (the last one shorter) unshuffled."""
    out = torch.empty_like(chunks)
    count, nbytes = chunks.shape
    full, left = divmod(nbytes, blocksize)
    if full:  # [c, blocks, typesize, items] -> [c, blocks, items, typesize]
        out[:, : full * blocksize].view(count, full, -1, typesize).copy_(
            chunks[:, : full * blocksize].view(count, full, typesize, -1).transpose(2, 3))
    start, items = full * blocksize, left // typesize
    if items:
        out[:, start : start + items * typesize].view(count, items, typesize).copy_(
            chunks[:, start : start + items * typesize].view(count, typesize, items).transpose(1, 2))
    if left % typesize:
        out[:, start + items * typesize :] = chunks[:, start + items * typesize :]
    return out



Streams = tuple[np.ndarray, np.ndarray]  # (offsets, sizes) of pieces of a buffer


def decode_zstd(data: torch.Tensor, frames: Streams, out: torch.Tensor, spots: Streams) -> None:
    """Decode the zstd frames at ``frames`` (offsets, sizes) of ``data`` into ``spots`` (offsets, lengths) of
    ``out``: by nvCOMP in one batched call queued on the current stream on a CUDA device (a failure is raised by
    a later call or :func:`raise_failures`), by the CPU's zstd elsewhere."""
    if data.device.type == "cuda":
        nvcomp = _nvcomp()
        raise_failures()
        on_alignment(data, frames, out, spots, nvcomp.alignment,
                     lambda *buffers: _check_later(nvcomp.decode(*buffers)))
    else:
        cpu_zstd(data, frames, out, spots)


def cpu_zstd(data: torch.Tensor, frames: Streams, out: torch.Tensor, spots: Streams) -> None:
    """The zstd frames at ``frames`` of ``data`` decoded by the CPU into ``spots`` of ``out`` (CPU tensors)."""
    import numcodecs

    source, destination, zstd = data.numpy(), out.numpy(), numcodecs.Zstd()
    for offset, size, target, length in zip(*(a.tolist() for a in (*frames, *spots))):
        decoded = np.frombuffer(zstd.decode(source[offset : offset + size]), np.uint8)
        if len(decoded) != length:
            raise CorruptDataError(f"a zstd stream decoded to {len(decoded)} bytes, its blosc frame says {length}")
        destination[target : target + length] = decoded


def on_alignment(data: torch.Tensor, frames: Streams, out: torch.Tensor, spots: Streams, align: int,
                 batched: Callable[[torch.Tensor, Streams, torch.Tensor, Streams], None]) -> None:
    """``batched(source, frames, decoded, spots)`` (a decoder that needs every piece of its buffers to start on
    ``align`` bytes) run on ``frames`` of ``data`` into ``spots`` of ``out``: frames not on that alignment (a
    blosc frame's streams start anywhere) are first copied to places that are, and outputs that are not are
    decoded to such places, then copied where they go (on the buffers' device)."""
    source, places = _aligned(data, frames, align)
    if source is not data:
        copy_pieces(data, frames[0], source, places, frames[1])
    decoded, at = _aligned(out, spots, align)
    batched(source, (places, frames[1]), decoded, (at, spots[1]))
    if decoded is not out:
        copy_pieces(decoded, at, out, spots[0], spots[1])


def copy_pieces(source: torch.Tensor, offsets: np.ndarray, out: torch.Tensor, targets: np.ndarray,
                lengths: np.ndarray) -> None:
    """``out[targets[i] : targets[i] + lengths[i]] = source[offsets[i] : offsets[i] + lengths[i]]`` for every
    ``i`` (1-d uint8 tensors on one device; the pieces of ``out`` do not overlap). On a GPU, where each copy is a
    kernel launch and some microseconds of the calling thread (a bundle's raw planes are one piece a chunk,
    hundreds of them), as one gather and one scatter for all the pieces of each length; on the CPU a piece's
    copy is a memcpy, faster than torch's gather of byte windows, so each is copied alone."""
    if source.device.type == "cpu":
        _copy_each(source, offsets, out, targets, lengths)
    else:
        _copy_by_length(source, offsets, out, targets, lengths)


def _copy_each(source: torch.Tensor, offsets: np.ndarray, out: torch.Tensor, targets: np.ndarray,
               lengths: np.ndarray) -> None:
    for offset, target, length in zip(offsets.tolist(), targets.tolist(), lengths.tolist()):
        out[target : target + length] = source[offset : offset + length]


def _copy_by_length(source: torch.Tensor, offsets: np.ndarray, out: torch.Tensor, targets: np.ndarray,
                    lengths: np.ndarray) -> None:
    order = np.argsort(lengths, kind="stable")
    distinct, firsts, counts = np.unique(lengths[order], return_index=True, return_counts=True)
    places = None
    if (counts > 1).any():  # every piece's offset and target, crossing to the device in one copy
        places = _to_device(np.stack([offsets[order], targets[order]]).astype(np.int64), source.device)
    for length, first, count in zip(distinct.tolist(), firsts.tolist(), counts.tolist()):
        if count == 1:
            offset, target = int(offsets[order[first]]), int(targets[order[first]])
            out[target : target + length] = source[offset : offset + length]
        elif length:  # rows of the views of every window of ``length`` bytes, one per piece
            at = places[:, first : first + count]
            out.unfold(0, length, 1)[at[1]] = source.unfold(0, length, 1)[at[0]]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``, copied there without waiting for the device (through pinned memory)."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _aligned(buffer: torch.Tensor, pieces: Streams, align: int) -> tuple[torch.Tensor, np.ndarray]:
    """``(buffer, offsets)`` if every piece starts on ``align`` bytes, else a new buffer with room for each piece
    on that alignment (not filled) and where each goes in it."""
    offsets, sizes = pieces
    if not (offsets % align).any() and buffer.data_ptr() % align == 0:
        return buffer, offsets
    room = -(-sizes // align) * align
    return torch.empty(int(room.sum()), dtype=torch.uint8, device=buffer.device), np.cumsum(room) - room


def nvcomp_available() -> bool:
    """Whether nvCOMP's library is installed (the ``nvidia-libnvcomp`` wheel) and loads."""
    try:
        _nvcomp()
    except (ImportError, OSError):
        return False
    return True


@functools.cache
def _nvcomp() -> NvcompZstd:
    return NvcompZstd()


class _Options(ctypes.Structure):  # nvcompBatchedZstdDecompressOpts_t: the default backend, the rest zeroed
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class _Alignments(ctypes.Structure):  # nvcompAlignmentRequirements_t
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


class NvcompZstd:
    """nvCOMP's batched zstd decompression through its C API (``nvcomp/zstd.h``, nvCOMP 6), loaded from the
    ``nvidia-libnvcomp`` wheel. A call queues its work on the current stream and returns, and ctypes lets go of
    the GIL meanwhile: nvCOMP's Python binding waits for its stream with the GIL held, which stalled every thread
    of the process for about 10 ms a call (benchmarks/RESULTS.md, "Compression on the read path")."""

    def __init__(self):
        from nvidia import libnvcomp

        library = libnvcomp.load_library()
        if library is None:
            raise ImportError("the nvidia-libnvcomp package did not load libnvcomp")
        size, pointer = ctypes.c_size_t, ctypes.c_void_p
        self._temp_size = library.nvcompBatchedZstdDecompressGetTempSize
        self._temp_size.argtypes = [size, size, _Options, ctypes.POINTER(size), size, pointer]
        self._decompress = library.nvcompBatchedZstdDecompressAsync
        self._decompress.argtypes = [pointer, pointer, pointer, pointer, size, pointer, size, pointer, _Options,
                                     pointer, pointer]
        alignments = library.nvcompBatchedZstdDecompressGetRequiredAlignments
        alignments.argtypes = [_Options, ctypes.POINTER(_Alignments)]
        for function in (self._temp_size, self._decompress, alignments):
            function.restype = ctypes.c_int
        required = _Alignments()
        _succeeded(alignments(_Options(), ctypes.byref(required)), "nvcompBatchedZstdDecompressGetRequiredAlignments")
        self.alignment = max(1, required.input, required.output)  # (the scratch memory is torch's: 512-aligned)

    def decode(self, data: torch.Tensor, frames: Streams, out: torch.Tensor, spots: Streams) -> torch.Tensor:
        """Queue the decoding of the frames at ``frames`` of ``data`` into ``spots`` of ``out`` (each piece on
        :attr:`alignment`) on the current stream; returns a bool on the device: whether any frame failed, or
        decoded to another length."""
        (offsets, sizes), (targets, lengths) = frames, spots
        count, device = len(sizes), data.device
        stream = torch.cuda.current_stream(device).cuda_stream
        table = np.stack([data.data_ptr() + offsets, sizes, lengths, out.data_ptr() + targets]).astype(np.int64)
        arrays = _to_device(table, device)  # pointers and sizes
        temp_bytes = ctypes.c_size_t()
        _succeeded(self._temp_size(count, int(lengths.max()), _Options(), ctypes.byref(temp_bytes), int(lengths.sum()),
                                   stream), "nvcompBatchedZstdDecompressGetTempSize")
        temp = torch.empty(max(1, temp_bytes.value), dtype=torch.uint8, device=device)
        decoded = torch.empty(count, dtype=torch.int64, device=device)
        statuses = torch.empty(count, dtype=torch.int32, device=device)
        sources, sizes_at, lengths_at, targets_at = (row.data_ptr() for row in arrays)
        _succeeded(self._decompress(sources, sizes_at, lengths_at, decoded.data_ptr(), count, temp.data_ptr(),
                                    temp_bytes.value, targets_at, _Options(), statuses.data_ptr(), stream),
                   "nvcompBatchedZstdDecompressAsync")
        return statuses.ne(0).any() | decoded.ne(arrays[2]).any()


def _succeeded(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} returned nvCOMP status {status}")


_UNCHECKED: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = collections.deque()  # (done, failed)
_UNCHECKED_LOCK = threading.Lock()


def _check_later(failed: torch.Tensor) -> None:
    """Note ``failed`` (a bool on the device, of work queued on the current stream) for :func:`raise_failures`."""
    host = torch.empty(1, dtype=torch.bool, pin_memory=True)
    host.copy_(failed.view(1), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    with _UNCHECKED_LOCK:
        _UNCHECKED.append((done, host))


def raise_failures(wait: bool = False) -> None:
    """``CorruptDataError`` if a GPU decoding queued before failed: of those done, or (``wait``) of all of them."""
    with _UNCHECKED_LOCK:
        while _UNCHECKED and (wait or _UNCHECKED[0][0].query()):
            done, failed = _UNCHECKED.popleft()
            done.synchronize()
            if failed.item():
                _UNCHECKED.clear()
                raise CorruptDataError("nvCOMP could not decode a zstd stream of a chunk that passed its crc32c, or "
                                       "decoded it to another length than its blosc frame says")


def decodable(spec: StoreSpec) -> str | None:
    """Why the hidden states of a store of ``spec`` cannot be decoded on a device (None: they can): only blosc
    zstd frames with byte shuffle or none are."""
    if spec.compression is None:
        return "its hidden states are not compressed"
    if not device_decodable(spec.compression):
        return (f"it is compressed with {spec.compression}, and only blosc zstd with byte shuffle or none decodes "
                "on a device")
    return None
