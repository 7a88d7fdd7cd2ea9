"""Blosc1 frames, the one format of a compressed chunk (docs/format.md sections 5b-5c): writing one whose streams
are zstd frames (:func:`encode_zstd`, hsdata's encoder), what a frame holds (:func:`blosc_streams`, for decoders
other than blosc, a GPU's) and decoding one (:func:`decode_into`, blosc's own decoder)."""

from __future__ import annotations

import itertools
import struct
import threading
from dataclasses import dataclass

import numcodecs.blosc
import numpy as np
import zstandard

BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
BLOSC_VERSIONS = (1, 2)  # blosc1 frame formats (c-blosc 1.x writes 2; 1: before the split flag)
SHUFFLED, MEMCPYED, BITSHUFFLED, DELTA, DONT_SPLIT = 0x1, 0x2, 0x4, 0x8, 0x10  # header flags
ZSTD_FORMAT = 4  # flags >> 5: the codec of every stream of the frame
MAX_SPLITS, MIN_BUFFERSIZE = 16, 128  # blosc1: a block is split into typesize streams when neither flag forbids
ZSTD_VERSION_FORMAT = 1  # the versionlz c-blosc writes in a zstd frame's header
STREAM_SIZE = struct.Struct("<i")
# zstd for byte planes of states at clevel 1: literals Huffman-coded, matches found only where they are long (7 bytes)
# and in a tiny table; it stores bf16 states in a little less than blosc's zstd level 1 does, about twice as fast,
# and its frames decode faster (benchmarks/RESULTS.md, "hsdata's own zstd encoder").
FAST_PARAMETERS = dict(window_log=20, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
                       strategy=zstandard.STRATEGY_FAST)
UNSIGNED_ITEMS = {n: np.dtype(f"<u{n}") for n in (2, 4, 8)}  # items whose bytes a shift picks out
PROBE_BYTES = 16 << 10  # a stream whose first PROBE_BYTES save less than 1/32 when compressed is stored raw


class FrameError(ValueError):
    """A frame :func:`blosc_streams` cannot read, and why; ``frame`` is its index among the frames given."""

    def __init__(self, frame: int, why: str):
        super().__init__(why)
        self.frame = frame


@dataclass(frozen=True)
class BloscStreams:
    """Where the compressed streams of blosc frames lie and what each decodes to: what a decoder other than blosc
    (zstd on a GPU) needs to decode the frames (docs/format.md section 5c). Decoding each stream into its frame's
    ``targets`` (one as long as its decoded bytes is copied as it is) gives the frame's blocks, each still
    byte-shuffled when the frame is ``shuffled``: block ``k`` (``blocksize`` bytes, the last one shorter) holds its
    items' byte 0s, then their byte 1s, ... (``typesize`` bytes an item; a last block's trailing
    ``len % typesize`` bytes are not shuffled). A ``memcpyed`` frame holds its ``nbytes`` as they are after the
    header (one raw stream, never shuffled). Streams are in the order of their frames, then of their targets."""

    typesizes: np.ndarray  # int64 [f]: each frame's
    blocksizes: np.ndarray  # int64 [f]
    shuffled: np.ndarray  # bool [f]
    frames: np.ndarray  # int64 [s]: each stream's frame
    offsets: np.ndarray  # int64 [s]: its first byte in the buffer given
    sizes: np.ndarray  # int64 [s]: its bytes there
    targets: np.ndarray  # int64 [s]: where its decoded bytes go in its frame's (shuffled) blocks
    lengths: np.ndarray  # int64 [s]: its decoded bytes; a stream as long as that is stored as it is (raw)


def blosc_streams(data, nbytes: int | np.ndarray,
                  frames: tuple[np.ndarray, np.ndarray] | None = None) -> BloscStreams:
    """The streams of the blosc1 frames at ``frames`` (offsets, sizes; default: all of ``data`` is one frame) of
    ``data`` (bytes-like), each decompressing to ``nbytes`` (one for all, or each frame's) and each stream one
    standard zstd frame or stored raw.
    :class:`FrameError` naming the first frame found that is not such a frame, and why (every offset is checked
    to lie inside its frame). Mirrors c-blosc 1.x's ``blosc_d``, on all frames at once."""
    buffer = np.frombuffer(data, np.uint8)
    starts, cbytes = (np.zeros(1, np.int64), np.array([len(buffer)], np.int64)) if frames is None else (
        np.asarray(frames[0], np.int64), np.asarray(frames[1], np.int64))
    _refuse((starts < 0) | (starts + cbytes > len(buffer)), None,
            lambda i: f"a frame of {cbytes[i]} bytes at {starts[i]} lies outside the {len(buffer)} bytes given")
    _refuse(cbytes < BLOSC_HEADER.size, None,
            lambda i: f"{cbytes[i]} bytes are too short for a blosc header ({BLOSC_HEADER.size})")
    header = buffer[starts[:, None] + np.arange(BLOSC_HEADER.size)]
    version, flags, typesize = (header[:, k].astype(np.int64) for k in (0, 2, 3))
    total, blocksize, said = header[:, 4:].copy().view("<u4").T.astype(np.int64)
    expected = np.broadcast_to(np.asarray(nbytes, np.int64), starts.shape)
    _refuse((said != cbytes) | (total != expected), None, lambda i: f"its blosc header says {said[i]} bytes "
            f"decompressing to {total[i]}, the frame holds {cbytes[i]} and should decompress to {expected[i]}")
    _refuse((version < min(BLOSC_VERSIONS)) | (version > max(BLOSC_VERSIONS)) | (flags & (BITSHUFFLED | DELTA) != 0)
            | (typesize < 1), None,
            lambda i: f"blosc frame version {version[i]}, flags {flags[i]:#04x}, typesize {typesize[i]}: not a "
            "blosc1 frame with byte shuffle or none")
    copied = flags & MEMCPYED != 0
    _refuse(copied & (cbytes != BLOSC_HEADER.size + total), None,
            lambda i: f"a copied blosc frame of {total[i]} bytes must hold {BLOSC_HEADER.size + total[i]}")
    _refuse(~copied & (flags >> 5 != ZSTD_FORMAT), None,
            lambda i: f"blosc frame of codec format {flags[i] >> 5}, not zstd ({ZSTD_FORMAT})")
    _refuse(~copied & ((blocksize < 1) | (blocksize < total) & (blocksize % typesize != 0)), None,
            lambda i: f"blosc frame of block size {blocksize[i]} (typesize {typesize[i]})")
    blocks = np.where(copied, 0, -(-total // np.maximum(blocksize, 1)))
    _refuse(BLOSC_HEADER.size + 4 * blocks > cbytes, None,
            lambda i: f"blosc frame of {cbytes[i]} bytes cannot hold the starts of its {blocks[i]} blocks")
    streams = _coded_streams(buffer, starts, cbytes, flags, typesize, total, blocksize, blocks)
    if copied.any():  # a copied frame: one raw stream after the header
        raw = np.flatnonzero(copied)
        streams = [np.concatenate(v) for v in zip(streams, (raw, starts[raw] + BLOSC_HEADER.size, total[raw],
                                                            np.zeros(len(raw), np.int64), total[raw]))]
        order = np.argsort(streams[0], kind="stable")
        streams = [v[order] for v in streams]
    shuffled = (flags & SHUFFLED != 0) & (typesize > 1) & ~copied
    return BloscStreams(typesize, np.where(copied, np.maximum(total, 1), blocksize), shuffled, *streams)


def _coded_streams(buffer: np.ndarray, starts: np.ndarray, cbytes: np.ndarray, flags: np.ndarray,
                   typesize: np.ndarray, total: np.ndarray, blocksize: np.ndarray, blocks: np.ndarray) -> tuple:
    """(frames, offsets, sizes, targets, lengths) of the streams of the frames' ``blocks`` blocks, in order: a
    block's start is read from the table after its frame's header, then its ``splits`` streams one after the
    other (each a 4-byte length, then its bytes), all blocks at once."""
    frame = np.repeat(np.arange(len(starts)), blocks)
    k = np.arange(len(frame)) - np.repeat(np.cumsum(blocks) - blocks, blocks)  # the block's index in its frame
    base, limit, size, items = starts[frame], cbytes[frame], blocksize[frame], typesize[frame]
    block = np.minimum(size, total[frame] - k * size)
    splits = split_count(flags[frame], items, size, block)
    position = _int32s(buffer, base + BLOSC_HEADER.size + 4 * k)
    width = int(splits.max(initial=0))
    offsets, sizes = np.zeros((len(frame), width), np.int64), np.zeros((len(frame), width), np.int64)
    for j in range(width):
        at = np.flatnonzero(splits > j)
        p = position[at]
        _refuse((p < 0) | (p > limit[at] - 4), frame[at], lambda i: f"block {k[at][i]} of the blosc frame starts "
                "outside it")
        n = _int32s(buffer, base[at] + p)
        _refuse((n < 0) | (n > limit[at] - p - 4), frame[at], lambda i: f"block {k[at][i]} of the blosc frame runs "
                "past its end")
        offsets[at, j], sizes[at, j] = base[at] + p + 4, n
        position[at] = p + 4 + n
    each, length = np.arange(width) < splits[:, None], block // splits
    targets = (k * size)[:, None] + np.arange(width) * length[:, None]
    return np.repeat(frame, splits), offsets[each], sizes[each], targets[each], np.repeat(length, splits)


def split_count(flags, typesize, blocksize, block):
    """How many streams a block of ``block`` bytes is cut into, in a frame of ``flags``, ``typesize`` and
    ``blocksize`` (numbers or arrays of them): ``typesize`` where the frame allows it and the block is whole."""
    split = (flags & DONT_SPLIT == 0) & (typesize <= MAX_SPLITS) & (blocksize // typesize >= MIN_BUFFERSIZE) \
        & (block == blocksize)
    return 1 + (typesize - 1) * split  # no np.where: the encoder asks this of plain numbers, once a chunk


def _int32s(buffer: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian int32s at byte offsets ``at`` of ``buffer``, as int64."""
    return buffer[at[:, None] + np.arange(4)].view("<i4")[:, 0].astype(np.int64)


def _refuse(bad: np.ndarray, frames: np.ndarray | None, why) -> None:
    """:class:`FrameError` for the first of ``bad`` (frames, or items of ``frames``), saying ``why(its index)``."""
    if bad.any():
        i = int(np.argmax(bad))
        raise FrameError(i if frames is None else int(frames[i]), why(i))


def decode_into(data: memoryview, out: memoryview) -> None:
    """Decompress one blosc chunk (of any configuration: the frame says it) into ``out``, which it must fill
    exactly; ``ValueError`` saying why if ``data`` is not a blosc frame of that size (its header is read first,
    so a hostile one cannot overrun ``out``). Straight to numcodecs' decompressor: its codec's ``decode`` holds
    the GIL longer per chunk, which the read threads share."""
    if data.nbytes < BLOSC_HEADER.size:
        raise ValueError(f"{data.nbytes} bytes are too short for a blosc header ({BLOSC_HEADER.size})")
    *_, nbytes, _blocksize, cbytes = BLOSC_HEADER.unpack_from(data)
    if cbytes != data.nbytes:
        raise ValueError(f"its blosc header says {cbytes} compressed bytes, the chunk holds {data.nbytes}")
    if nbytes != out.nbytes:
        raise ValueError(f"its blosc header says it decompresses to {nbytes} bytes, expected {out.nbytes}")
    try:
        numcodecs.blosc.decompress(data, out)
    except RuntimeError as e:
        raise ValueError(f"blosc cannot decompress it: {e}") from None


def encode_zstd(chunks: list, typesize: int, clevel: int, shuffle: bool, blocksize: int) -> list[list]:
    """Each of ``chunks`` (bytes-like) as one blosc1 frame whose streams are standard zstd frames or raw
    (docs/format.md section 5c), as the buffers to write in order. A chunk is cut into the fewest blocks of about
    ``blocksize`` bytes or less (0: one block), whole items and of equal size where the chunk allows, so that every
    block is cut into one stream per byte plane when ``shuffle`` (blosc1 never cuts a last, shorter block). A
    stream is stored raw where zstd does not make it smaller, the whole frame copied where its streams would not.
    What c-blosc writes for zstd, except that c-blosc does not cut blocks into planes and codes with its own levels
    (:func:`zstd_compressor`). Every chunk's frame is what it would be alone; all chunks' streams go to zstd in two
    calls (:func:`_compress_streams`), each releasing the GIL once."""
    shuffled = shuffle and typesize > 1
    flags = (SHUFFLED if shuffled else DONT_SPLIT) | ZSTD_FORMAT << 5
    layouts, streams, probes = [], [], []  # per chunk: (data, block size, streams of each block)
    for chunk in chunks:
        data = np.frombuffer(chunk, np.uint8)
        nbytes = len(data)
        if 0 < blocksize < nbytes:
            size = -(-nbytes // (-(-nbytes // blocksize) * typesize)) * typesize
        else:  # one block of whole items (as c-blosc's): bytes past the last item, if any, are a last, shorter one
            size = nbytes - nbytes % typesize if nbytes > typesize else nbytes
        counts = []
        for k in range(-(-nbytes // size)):
            block = data[k * size : (k + 1) * size]
            splits = split_count(flags, typesize, size, len(block))
            cut = _block_streams(block, typesize, shuffled, splits)
            streams += cut
            probes += [splits > 1 or not shuffled] * len(cut)
            counts.append(len(cut))
        layouts.append((data, size, counts))
    coded = iter(_compress_streams(zstd_compressor(clevel), streams, probes))
    return [_frame_parts(data, typesize, flags, size, counts, coded) for data, size, counts in layouts]


def _frame_parts(data: np.ndarray, typesize: int, flags: int, size: int, counts: list[int], coded) -> list:
    """One chunk's frame as buffers: its blocks' streams, ``counts[k]`` of them for block ``k``, taken from ``coded``;
    the chunk copied as it is where they would not be smaller."""
    nbytes, blocks = len(data), len(counts)
    starts, parts, at = np.zeros(blocks, "<i4"), [], BLOSC_HEADER.size + 4 * blocks
    for k, count in enumerate(counts):
        starts[k] = at
        for stream in itertools.islice(coded, count):
            parts += [STREAM_SIZE.pack(len(stream)), stream]
            at += STREAM_SIZE.size + len(stream)
    if at >= BLOSC_HEADER.size + nbytes:
        return [BLOSC_HEADER.pack(2, ZSTD_VERSION_FORMAT, flags | MEMCPYED, typesize, nbytes, size,
                                  BLOSC_HEADER.size + nbytes), data]
    return [BLOSC_HEADER.pack(2, ZSTD_VERSION_FORMAT, flags, typesize, nbytes, size, at), starts, *parts]


_compressors = threading.local()  # a zstandard compressor serves one thread at a time


def zstd_compressor(clevel: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for blosc's ``clevel``: :data:`FAST_PARAMETERS` at 1, else c-blosc's own
    mapping (zstd level ``2 * clevel - 1``, the highest at 9)."""
    cache = _compressors.__dict__
    if clevel not in cache:
        parameters = (zstandard.ZstdCompressionParameters(**FAST_PARAMETERS) if clevel == 1 else
                      zstandard.ZstdCompressionParameters.from_level(2 * clevel - 1 if clevel < 9 else 22))
        cache[clevel] = zstandard.ZstdCompressor(compression_params=parameters)
    return cache[clevel]


def _block_streams(block: np.ndarray, typesize: int, shuffled: bool, splits: int) -> list[np.ndarray]:
    """A block's streams: its byte planes when it is cut into them, else the block (byte-shuffled when
    ``shuffled``: its items' byte 0s, then their byte 1s, ..., then the bytes left over past its last item)."""
    if not shuffled:
        return [block]
    items = len(block) // typesize
    planes = np.empty((typesize, items), np.uint8)
    if typesize in UNSIGNED_ITEMS:  # byte b of each item by shifts of whole items: ~4x a strided copy's speed
        values = block[: items * typesize].view(UNSIGNED_ITEMS[typesize])
        np.copyto(planes[0], values, casting="unsafe")  # the low byte
        for b in range(1, typesize):
            np.right_shift(values, 8 * b, out=planes[b], casting="unsafe")
    else:
        planes[:] = block[: items * typesize].reshape(items, typesize).T
    return list(planes) if splits > 1 else [np.concatenate([planes.reshape(-1), block[items * typesize :]])]


def _compress_streams(compressor: zstandard.ZstdCompressor, streams: list[np.ndarray], probes: list[bool]) -> list:
    """Each stream as one zstd frame, or the stream itself where that is not smaller (also, where its ``probes``
    entry says so: one byte plane or unshuffled bytes, where its first :data:`PROBE_BYTES` gain too little to try the
    rest). Two calls to zstd for all of them, the probes' and the streams', each releasing the GIL once: a compress
    thread takes it back after every call, and with many threads those hand-offs, not the cores, are the limit."""
    probed = [i for i, stream in enumerate(streams) if probes[i] and len(stream) >= 4 * PROBE_BYTES]
    raw = set()
    if probed:
        trials = compressor.multi_compress_to_buffer([streams[i][:PROBE_BYTES] for i in probed], threads=0)
        raw = {i for i, trial in zip(probed, trials) if len(trial) > PROBE_BYTES * 31 // 32}
    tried, out = [i for i in range(len(streams)) if i not in raw], list(streams)
    if tried:
        for i, frame in zip(tried, compressor.multi_compress_to_buffer([streams[i] for i in tried], threads=0)):
            if len(frame) < len(streams[i]):
                out[i] = frame
    return out
