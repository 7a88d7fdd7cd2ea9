"""Blosc1 frames, the one format of a compressed chunk (docs/format.md sections 5b-5c), as readers see them:
what a frame holds (:func:`blosc_streams`, for decoders other than blosc, a GPU's) and decoding one
(:func:`decode_into`, blosc's own decoder). Writers encode with blosc (``Compression.codec``)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numcodecs.blosc
import numpy as np

BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
BLOSC_VERSIONS = (1, 2)  # blosc1 frame formats (c-blosc 1.x writes 2; 1: before the split flag)
SHUFFLED, MEMCPYED, BITSHUFFLED, DELTA, DONT_SPLIT = 0x1, 0x2, 0x4, 0x8, 0x10  # header flags
ZSTD_FORMAT = 4  # flags >> 5: the codec of every stream of the frame
MAX_SPLITS, MIN_BUFFERSIZE = 16, 128  # blosc1: a block is split into typesize streams when neither flag forbids


@dataclass(frozen=True)
class BloscStreams:
    """Where the compressed streams of one blosc frame lie and what each decodes to: what a decoder other than
    blosc (zstd on a GPU) needs to decode the frame (docs/format.md section 5c). Decoding each stream into
    ``targets`` (one as long as its decoded bytes is copied as it is) gives the frame's blocks, each still
    byte-shuffled when ``shuffled``: block ``k`` (``blocksize`` bytes, the last one shorter) holds its items' byte
    0s, then their byte 1s, ... (``typesize`` bytes an item; a last block's trailing ``len % typesize`` bytes are
    not shuffled). A ``memcpyed`` frame holds its ``nbytes`` as they are after the header (one raw stream, never
    shuffled)."""

    typesize: int
    nbytes: int
    blocksize: int
    shuffled: bool
    offsets: np.ndarray  # int64: each stream's first byte in the frame
    sizes: np.ndarray  # int64: its bytes in the frame
    targets: np.ndarray  # int64: where its decoded bytes go in the frame's (shuffled) blocks
    lengths: np.ndarray  # int64: its decoded bytes; a stream as long as that is stored as it is (raw)


def blosc_streams(frame: memoryview, nbytes: int, cname: str = "zstd") -> BloscStreams:
    """The streams of a blosc1 ``frame`` that decompresses to ``nbytes``, each compressed with ``cname`` (zstd:
    one standard zstd frame a stream) or stored raw; ``ValueError`` saying why if ``frame`` is not such a frame
    (every offset is checked to lie inside it). Mirrors c-blosc 1.x's ``blosc_d``."""
    if cname != "zstd":
        raise ValueError(f"streams of blosc {cname} frames are not supported, only zstd")
    if frame.nbytes < BLOSC_HEADER.size:
        raise ValueError(f"{frame.nbytes} bytes are too short for a blosc header ({BLOSC_HEADER.size})")
    version, _, flags, typesize, total, blocksize, cbytes = BLOSC_HEADER.unpack_from(frame)
    if cbytes != frame.nbytes or total != nbytes:
        raise ValueError(f"its blosc header says {cbytes} bytes decompressing to {total}, the frame holds "
                         f"{frame.nbytes} and should decompress to {nbytes}")
    if version not in BLOSC_VERSIONS or flags & (BITSHUFFLED | DELTA) or typesize < 1:
        raise ValueError(f"blosc frame version {version}, flags {flags:#04x}, typesize {typesize}: not a blosc1 "
                         "frame with byte shuffle or none")
    shuffled = bool(flags & SHUFFLED) and typesize > 1
    if flags & MEMCPYED:
        if cbytes != BLOSC_HEADER.size + total:
            raise ValueError(f"a copied blosc frame of {total} bytes must hold {BLOSC_HEADER.size + total}")
        one = np.array([total], np.int64)
        return BloscStreams(typesize, total, max(1, total), False, np.array([BLOSC_HEADER.size], np.int64), one,
                            np.zeros(1, np.int64), one)
    if flags >> 5 != ZSTD_FORMAT:
        raise ValueError(f"blosc frame of codec format {flags >> 5}, not zstd ({ZSTD_FORMAT})")
    if blocksize < 1 or (blocksize < total and blocksize % typesize):
        raise ValueError(f"blosc frame of block size {blocksize} (typesize {typesize})")
    blocks = -(-total // blocksize)
    if BLOSC_HEADER.size + 4 * blocks > cbytes:
        raise ValueError(f"blosc frame of {cbytes} bytes cannot hold the starts of its {blocks} blocks")
    starts = np.frombuffer(frame, "<i4", blocks, BLOSC_HEADER.size).astype(np.int64)
    offsets, sizes, targets, decoded = [], [], [], []
    for k, start in enumerate(starts.tolist()):
        block = min(blocksize, total - k * blocksize)
        splits = typesize if (not flags & DONT_SPLIT and typesize <= MAX_SPLITS and blocksize // typesize >=
                              MIN_BUFFERSIZE and block == blocksize) else 1
        position, size = start, block // splits
        for j in range(splits):
            if not 0 <= position <= cbytes - 4:
                raise ValueError(f"block {k} of the blosc frame starts outside it")
            (n,) = struct.unpack_from("<i", frame, position)
            if not 0 <= n <= cbytes - position - 4:
                raise ValueError(f"block {k} of the blosc frame runs past its end")
            offsets.append(position + 4)
            sizes.append(n)
            targets.append(k * blocksize + j * size)
            decoded.append(size)
            position += 4 + n
    return BloscStreams(typesize, total, blocksize, shuffled, *(np.array(v, np.int64) for v in (offsets, sizes,
                                                                                                targets, decoded)))


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
