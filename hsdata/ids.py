"""Sample ids kept as one Arrow string array: hashed, checked for duplicates and looked up with numpy, without a
Python object per id (a store of a million samples opens without building a million ``str``).

:func:`hash_ids` gives every id a 64-bit hash, vectorized (ids of one byte length at a time, their bytes viewed
as a matrix of 8-byte words). The hash is keyed by a random per-process seed, so ids crafted to collide cannot be
made in advance; collisions only cost time, never correctness: every match is confirmed on the id itself.
:class:`IdIndex` sorts the hashes once and finds an id by binary search. :class:`SampleIds` is the read-only
sequence that ``Store.sample_ids`` returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .arrow import array_of, arrow_of, numpy_of

_SEED = int.from_bytes(os.urandom(8), "little")
_M1, _M2, _MASK = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, (1 << 64) - 1
ITER_BATCH = 65536  # ids converted to str at a time when a SampleIds is iterated


def as_array(ids: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """``ids`` as a chunked string (or large_string) array without nulls; chunks are kept, not copied."""
    if not isinstance(ids, pa.ChunkedArray):
        ids = pa.chunked_array([ids], ids.type)
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        raise TypeError(f"sample ids must be strings, got {ids.type}")
    if ids.null_count:
        raise ValueError("sample ids hold nulls")
    return ids


def _offsets_and_data(ids: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    width = np.int64 if pa.types.is_large_string(ids.type) else np.int32
    buffers = ids.buffers()
    offsets = np.frombuffer(buffers[1], width, len(ids) + 1, ids.offset * np.dtype(width).itemsize)
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    return offsets, data


def hash_ids(ids: pa.Array | pa.ChunkedArray, seed: int | None = None) -> np.ndarray:
    """A 64-bit hash of each id (uint64, in order): equal ids hash equal; :func:`hash_id` of one id agrees."""
    seed = _SEED if seed is None else seed
    chunks = [c for c in as_array(ids).chunks if len(c)]
    if len(chunks) != 1:
        return np.concatenate([_hash_chunk(c, seed) for c in chunks]) if chunks else np.empty(0, np.uint64)
    return _hash_chunk(chunks[0], seed)


def _hash_chunk(ids: pa.Array, seed: int) -> np.ndarray:
    out = np.empty(len(ids), np.uint64)
    offsets, _ = _offsets_and_data(ids)
    lengths = np.diff(offsets)
    if lengths.min() == lengths.max():
        groups = [(int(lengths[0]), None)]
    else:
        distinct, which = np.unique(lengths, return_inverse=True)
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(distinct) + 1))
        groups = [(int(n), order[a:b]) for n, a, b in zip(distinct.tolist(), bounds[:-1], bounds[1:])]
    m1, m2, s29, s32 = np.uint64(_M1), np.uint64(_M2), np.uint64(29), np.uint64(32)
    with np.errstate(over="ignore"):
        for length, rows in groups:
            same = ids if rows is None else ids.take(arrow_of(rows))  # one contiguous run of equal-length ids
            offsets, data = _offsets_and_data(same)
            matrix = data[offsets[0]: offsets[-1]].reshape(len(same), length)
            if length % 8 or not length:
                padded = np.zeros((len(same), max(8, -(-length // 8) * 8)), np.uint8)
                padded[:, :length] = matrix
                matrix = padded
            words = matrix.view("<u8")
            h = np.full(len(same), (seed ^ length) & _MASK, np.uint64)
            for j in range(words.shape[1]):
                h ^= words[:, j]
                h *= m1
                h ^= h >> s29
            h *= m2
            h ^= h >> s32
            if rows is None:
                out[:] = h
            else:
                out[rows] = h
    return out


def hash_id(sample_id: str, seed: int | None = None) -> int | None:
    """The hash of one id, as :func:`hash_ids` gives it; None for a str that is not UTF-8 (no id can be it)."""
    seed = _SEED if seed is None else seed
    try:
        raw = sample_id.encode()
    except UnicodeEncodeError:
        return None
    length = len(raw)
    if length % 8 or not length:
        raw += bytes(max(8, -(-length // 8) * 8) - length)
    h = (seed ^ length) & _MASK
    for j in range(0, len(raw), 8):
        h ^= int.from_bytes(raw[j: j + 8], "little")
        h = (h * _M1) & _MASK
        h ^= h >> 29
    h = (h * _M2) & _MASK
    return h ^ (h >> 32)


def position_bits(n: int) -> int:
    return max(1, (max(n, 1) - 1).bit_length())


def sorted_keys(hashes: np.ndarray) -> np.ndarray:
    """Each position's hash with its low bits replaced by the position (:func:`position_bits` of them), sorted:
    ordered by hash prefix, then position, in one ``np.sort`` of 8 bytes per id (no argsort)."""
    bits = np.uint64(position_bits(len(hashes)))
    keys = (hashes >> bits) << bits
    keys |= np.arange(len(hashes), dtype=np.uint64)
    keys.sort()
    return keys


def collision_candidates(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, candidates)``: :func:`sorted_keys` of ``hashes``, and the positions (ascending) whose hash prefix
    another position shares; every id that occurs more than once is among them."""
    keys = sorted_keys(hashes)
    bits = np.uint64(position_bits(len(hashes)))
    prefixes = keys >> bits
    same = np.flatnonzero(prefixes[1:] == prefixes[:-1])
    if not len(same):
        return keys, same
    mask = np.uint64((1 << int(bits)) - 1)
    return keys, np.unique(np.concatenate([keys[same], keys[same + 1]]) & mask).astype(np.int64)


class IdIndex:
    """Finds ids in one string array: :func:`sorted_keys` (8 bytes per id, hash prefix and position), a binary
    search per lookup, each hit confirmed on the id itself. Of equal ids, the first position is found."""

    def __init__(self, ids: pa.Array | pa.ChunkedArray, keys: np.ndarray | None = None):
        self._ids = as_array(ids)
        self._keys = sorted_keys(hash_ids(self._ids)) if keys is None else keys
        self._bits = position_bits(len(self._ids))
        self._mask = (1 << self._bits) - 1

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes

    def find(self, sample_id: Any) -> int | None:
        """Position of ``sample_id``, or None."""
        if not isinstance(sample_id, str):
            return None
        h = hash_id(sample_id)
        if h is None:
            return None
        prefix, keys, bits = h >> self._bits, self._keys, self._bits
        j = int(np.searchsorted(keys, np.uint64(prefix << bits)))
        while j < len(keys):
            key = int(keys[j])
            if key >> bits != prefix:
                break
            position = key & self._mask
            if self._ids[position].as_py() == sample_id:
                return position
            j += 1
        return None

    def find_many(self, sample_ids: Iterable[str]) -> np.ndarray:
        """Positions of ``sample_ids`` (int64, in order), -1 for each that is not here; vectorized."""
        wanted = list(sample_ids)
        bad = {k for k, s in enumerate(wanted) if not isinstance(s, str) or hash_id(s, 0) is None}
        clean = [("" if k in bad else s) for k, s in enumerate(wanted)] if bad else wanted
        out = np.full(len(wanted), -1, np.int64)
        keys = self._keys
        if not len(wanted) or not len(keys):
            return out
        needles = array_of(clean, self._ids.type)
        bits = np.uint64(self._bits)
        prefixes = hash_ids(needles) >> bits
        j = np.searchsorted(keys, prefixes << bits)
        pending = np.arange(len(wanted))
        while len(pending):  # round r tries each needle's r-th entry of equal hash prefix
            pending = pending[j[pending] < len(keys)]
            pending = pending[(keys[j[pending]] >> bits) == prefixes[pending]]
            if not len(pending):
                break
            positions = (keys[j[pending]] & np.uint64(self._mask)).astype(np.int64)
            equal = numpy_of(pc.equal(self._ids.take(arrow_of(positions)), needles.take(arrow_of(pending))))
            out[pending[equal]] = positions[equal]
            pending = pending[~equal]
            j[pending] += 1
        if bad:
            out[sorted(bad)] = -1
        return out


class SampleIds(Sequence):
    """A store's sample ids in position order: a read-only sequence of ``str`` backed by one Arrow string array,
    so that a store of millions of samples holds no Python object per id. Indexing gives a ``str``, a slice a
    ``list``; ``in``, ``index`` and ``count`` use the store's id index; it compares equal to a list or tuple of
    the same ids, and ``+`` with a list gives a list. :meth:`take` gives the ids at many positions at once,
    :meth:`tolist` all of them."""

    __slots__ = ("_array", "_find")

    def __init__(self, array: pa.Array, find: Callable[[str], int | None] | None = None):
        self._array = as_array(array)
        self._find = find if find is not None else IdIndex(self._array).find

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self._array))
            if step == 1:
                return self._array.slice(start, max(0, stop - start)).to_pylist()
            return self._array.take(arrow_of(np.arange(start, stop, step))).to_pylist()
        if not isinstance(i, (int, np.integer)) or isinstance(i, (bool, np.bool_)):
            raise TypeError(f"sample_ids indices must be integers or slices, not {type(i).__name__}")
        n = len(self._array)
        if not -n <= i < n:
            raise IndexError("sample_ids index out of range")
        return self._array[int(i) % n].as_py()

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self._array), ITER_BATCH):
            yield from self._array.slice(start, ITER_BATCH).to_pylist()

    def __reversed__(self) -> Iterator[str]:
        for stop in range(len(self._array), 0, -ITER_BATCH):
            start = max(0, stop - ITER_BATCH)
            yield from reversed(self._array.slice(start, stop - start).to_pylist())

    def __contains__(self, sample_id: object) -> bool:
        return self._find(sample_id) is not None  # type: ignore[arg-type]

    def index(self, sample_id: Any, start: int = 0, stop: int | None = None) -> int:
        position = self._find(sample_id)
        lo, hi, _ = slice(start, stop).indices(len(self._array))
        if position is None or not lo <= position < hi:
            raise ValueError(f"{sample_id!r} is not in sample_ids")
        return position

    def count(self, sample_id: Any) -> int:
        return int(sample_id in self)

    def take(self, positions: Iterable[int] | np.ndarray) -> list[str]:
        """The ids at ``positions`` (ints; negative count from the end), as a list, in one vectorized step."""
        chosen = np.asarray(positions if isinstance(positions, np.ndarray) else list(positions), dtype=np.int64)
        n = len(self._array)
        if chosen.ndim != 1 or ((chosen < -n) | (chosen >= n)).any():
            raise IndexError("sample_ids index out of range")
        return self._array.take(arrow_of(chosen % n if n else chosen)).to_pylist()

    def tolist(self) -> list[str]:
        return self._array.to_pylist()

    @property
    def arrow(self) -> pa.Array:
        """The ids as the Arrow string array itself (read-only, zero-copy)."""
        return self._array

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SampleIds):
            return len(self) == len(other) and (self._array.equals(other._array) or self.tolist() == other.tolist())
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like a list

    def __add__(self, other: object) -> list[str]:
        if isinstance(other, (list, SampleIds)):
            return self.tolist() + list(other)
        return NotImplemented

    def __radd__(self, other: object) -> list[str]:
        if isinstance(other, list):
            return other + self.tolist()
        return NotImplemented

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(s) for s in self[:3])
        return f"SampleIds([{head}{', ...' if n > 3 else ''}], {n} ids)"

    def __reduce__(self):  # pickles as a list: the lookup closure does not travel
        return (list, (self.tolist(),))
