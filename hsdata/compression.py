"""Lossless compression of the hidden-state chunks: zarr v3's standard ``blosc`` codec (docs/format.md section 5a).

A store records one :class:`Compression` for its two hidden-state tensors (``input_ids`` and ``loss_mask`` are
~5 bytes a token and stay uncompressed). Each inner chunk is compressed on its own, so plain zarr-python and
tensorstore read the arrays through the ``blosc`` codec of their ``zarr.json``.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import Any

import numcodecs
import numcodecs.blosc
import numpy as np

CNAMES = ("zstd", "lz4", "lz4hc", "zlib", "blosclz")
SHUFFLES = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
            "bitshuffle": numcodecs.Blosc.BITSHUFFLE}
MAX_BLOCKSIZE = 1 << 30


@dataclass(frozen=True)
class Compression:
    """A blosc configuration as zarr's ``blosc`` codec records it (``typesize`` is the tensor's item size)."""

    cname: str
    clevel: int
    shuffle: str
    blocksize: int  # bytes per blosc block, 0: blosc's own choice

    def __post_init__(self):
        if self.cname not in CNAMES:
            raise ValueError(f"compression cname must be one of {', '.join(CNAMES)}, got {self.cname!r}")
        if type(self.clevel) is not int or not 1 <= self.clevel <= 9:
            raise ValueError(f"compression clevel must be an integer in [1, 9], got {self.clevel!r}")
        if self.shuffle not in SHUFFLES:
            raise ValueError(f"compression shuffle must be one of {', '.join(SHUFFLES)}, got {self.shuffle!r}")
        if type(self.blocksize) is not int or not 0 <= self.blocksize <= MAX_BLOCKSIZE:
            raise ValueError(f"compression blocksize must be an integer in [0, {MAX_BLOCKSIZE}], "
                             f"got {self.blocksize!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": "blosc", "configuration": asdict(self)}

    @classmethod
    def from_dict(cls, d: Any) -> Compression:
        """Parse the spec's ``compression`` strictly (``ValueError`` naming what is wrong)."""
        if not isinstance(d, dict) or set(d) != {"name", "configuration"} or d["name"] != "blosc":
            raise ValueError(f"compression must be {{'name': 'blosc', 'configuration': {{...}}}}, got {d!r}")
        config, fields = d["configuration"], {"cname", "clevel", "shuffle", "blocksize"}
        if not isinstance(config, dict) or set(config) != fields:
            raise ValueError(f"compression configuration must have exactly the keys {sorted(fields)}, got {config!r}")
        return cls(**config)

    def codec_document(self, typesize: int) -> dict[str, Any]:
        """The ``blosc`` entry of an array's inner codecs."""
        return {"name": "blosc", "configuration": {**asdict(self), "typesize": typesize}}

    def codec(self, typesize: int) -> numcodecs.Blosc:
        """An encoder and decoder of single chunks; safe to share between threads."""
        return numcodecs.Blosc(self.cname, self.clevel, SHUFFLES[self.shuffle], self.blocksize, typesize)

    def __str__(self) -> str:
        return f"blosc {self.cname} level {self.clevel}, {self.shuffle}, blocks of {self.blocksize or 'auto'}"


# Named choices (benchmarks/RESULTS.md, compression section): zstd stores 0.69 of bf16 states, lz4 0.75 and decodes faster.
PRESETS = {
    "zstd": Compression("zstd", 1, "shuffle", 1 << 20),
    "lz4": Compression("lz4", 5, "bitshuffle", 0),
}


def parse(value: Any) -> Compression | None:
    """``None`` or ``"none"``: no compression; a preset name (``PRESETS``); or a :class:`Compression`."""
    if value is None or value == "none":
        return None
    if isinstance(value, Compression):
        return value
    if isinstance(value, str) and value in PRESETS:
        return PRESETS[value]
    raise ValueError(f"compression must be None, 'none', {', '.join(map(repr, PRESETS))} or a "
                     f"hsdata.Compression, got {value!r}")


def device_decodable(compression: Compression) -> bool:
    """Whether frames of ``compression`` are zstd streams a decoder other than blosc reads (:func:`blosc_streams`):
    blosc zstd with byte shuffle or none."""
    return compression.cname == "zstd" and compression.shuffle != "bitshuffle"


BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes

BLOSC_VERSIONS = (1, 2)  # blosc1 frame formats (c-blosc 1.x writes 2; 1: before the split flag)
SHUFFLED, MEMCPYED, BITSHUFFLED, DELTA, DONT_SPLIT = 0x1, 0x2, 0x4, 0x8, 0x10  # header flags
ZSTD_FORMAT = 4  # flags >> 5: the codec of every stream of the frame
MAX_SPLITS, MIN_BUFFERSIZE = 16, 128  # blosc1: a block is split into typesize streams when neither flag forbids


@dataclass(frozen=True)
class BloscStreams:
    """Where the compressed streams of one blosc frame lie and what each decodes to: what a decoder other than
    blosc (zstd on a GPU) needs to decode the frame (docs/format.md section 5c). Decoding each stream into
    ``targets`` (one as long as its decoded bytes is copied as it is) gives the frame's blocks, each still byte-shuffled when
    ``shuffled``: block ``k`` (``blocksize`` bytes, the last one shorter) holds its items' byte 0s, then their
    byte 1s, ... (``typesize`` bytes an item; a last block's trailing ``len % typesize`` bytes are not shuffled).
    A ``memcpyed`` frame holds its ``nbytes`` as they are after the header (one raw stream, never shuffled)."""

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
