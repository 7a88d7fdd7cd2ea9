"""Lossless compression of the hidden-state chunks: zarr v3's standard ``blosc`` codec (docs/format.md section 5a).

A store records one :class:`Compression` for its two hidden-state tensors (``input_ids`` and ``loss_mask`` are
~5 bytes a token and stay uncompressed). Each inner chunk is compressed on its own, so plain zarr-python and
tensorstore read the arrays through the ``blosc`` codec of their ``zarr.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable

import numcodecs

from . import blosc

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
        """blosc's encoder and decoder of single chunks; safe to share between threads."""
        return numcodecs.Blosc(self.cname, self.clevel, SHUFFLES[self.shuffle], self.blocksize, typesize)

    def encoder(self, typesize: int) -> Callable[[list], list[list]]:
        """What hsdata's writers compress chunks with, safe to share between threads: chunks (bytes-like) -> each
        one's blosc frame, as buffers to write in order. Frames of zstd streams (:func:`device_decodable`) are
        written by hsdata's own encoder (``blosc.encode_zstd``), the others by blosc's."""
        if device_decodable(self):
            return partial(blosc.encode_zstd, typesize=typesize, clevel=self.clevel,
                           shuffle=self.shuffle == "shuffle", blocksize=self.blocksize)
        codec = self.codec(typesize)
        return lambda chunks: [[codec.encode(chunk)] for chunk in chunks]

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
