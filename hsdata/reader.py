"""Reading a store: ``hsdata.open`` loads the spec and manifests only; ``Store`` reads samples by exact ranges."""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from . import manifest
from .errors import CorruptDataError
from .layout import load_spec, shard_key
from .shard import CRC_NBYTES, token_ranges
from .spec import TENSOR_NAMES, StoreSpec, TensorSpec
from .storage import Storage

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_TORCH_DTYPES = {"int32": torch.int32, "uint8": torch.uint8, "uint16": torch.bfloat16}


def open(url: str, *, storage_options: dict | None = None, verify: bool = True) -> Store:  # noqa: A001
    """Open the store at ``url`` (any fsspec URL) for reading. Reads metadata and manifests only.

    With ``verify`` (the default) every tensor read is checked against its per-sample xxh3 from the manifest,
    so a corrupt or misplaced byte raises :class:`CorruptDataError` instead of reaching training.
    """
    storage = Storage(url, storage_options)
    return Store(storage, load_spec(storage), manifest.load(storage), verify=verify)


class Store:
    """A read-only view of the samples committed when the store was opened."""

    def __init__(self, storage: Storage, spec: StoreSpec, rows: pa.Table, *, verify: bool = True):
        self.spec = spec
        self.verify = verify
        self._storage = storage
        self.manifest = _drop_duplicates(rows, storage.url)
        self._ids: list[str] = self.manifest.column("sample_id").to_pylist()
        self._index: dict[str, int] | None = None
        parts = self.manifest.column("part").combine_chunks().dictionary_encode()
        self._part_names: list[str] = parts.dictionary.to_pylist()
        self._part_of = parts.indices.to_numpy(zero_copy_only=False)
        self._offsets = self.manifest.column("token_offset").to_numpy()
        self.lengths: np.ndarray = self.manifest.column("num_tokens").to_numpy()
        self._hashes = manifest.row_hashes(self.manifest)

    @property
    def url(self) -> str:
        return self._storage.url

    @property
    def sample_ids(self) -> list[str]:
        return self._ids

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"<hsdata.Store {self.url!r}: {len(self)} samples, {self.num_tokens} tokens, {self.spec!r}>"

    def index(self, sample_id: str) -> int:
        """Position of ``sample_id`` in this store."""
        if self._index is None:
            self._index = {sid: i for i, sid in enumerate(self._ids)}
        try:
            return self._index[sample_id]
        except KeyError:
            raise KeyError(f"no sample {sample_id!r} in {self.url}") from None

    def __contains__(self, sample_id: object) -> bool:
        try:
            self.index(sample_id)  # type: ignore[arg-type]
        except KeyError:
            return False
        return True

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.read(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.read(i)

    def get(self, sample_id: str, fields: Iterable[str] | None = None) -> dict[str, Any]:
        return self.read(self.index(sample_id), fields)

    def read(self, i: int, fields: Iterable[str] | None = None) -> dict[str, Any]:
        """Sample ``i`` as a dict of torch tensors: ``input_ids`` int64 [T], ``loss_mask`` uint8 [T],
        ``aux_hidden_states`` bfloat16 [T, K*H], ``hidden_states`` bfloat16 [T, H]; ``fields`` picks a subset."""
        i = self._position(i)
        names = _check_fields(fields)
        buffers = {name: np.empty(int(self.lengths[i]) * self.spec.tensor(name).row_nbytes, np.uint8) for name in names}
        self._fill(i, buffers)
        out: dict[str, Any] = {"sample_id": self._ids[i]}
        for name, buf in buffers.items():
            tensor = self.spec.tensor(name)
            if self.verify:
                self._check_hash(i, tensor, buf)
            value = torch.from_numpy(buf).view(_TORCH_DTYPES[tensor.data_type])
            if tensor.width is not None:
                value = value.view(-1, tensor.width)
            out[name] = value.to(torch.int64) if name == "input_ids" else value
        return out

    def location(self, i: int) -> tuple[str, int, int]:
        """``(part, token_offset, num_tokens)`` of sample ``i`` in the part's arrays."""
        i = self._position(i)
        return self._part_names[self._part_of[i]], int(self._offsets[i]), int(self.lengths[i])

    def close(self) -> None:
        self._storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _position(self, i: int) -> int:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"sample index must be an int, got {type(i).__name__}; use store.get(sample_id) for ids")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a store of {n} samples")
        return int(i) % n

    def _fill(self, i: int, buffers: dict[str, np.ndarray]) -> None:
        """Read the exact byte ranges of sample ``i`` into ``buffers`` (one range per tensor and shard)."""
        part, offset, length = self.location(i)
        plan = []  # (key, file_start, file_end, [memoryview per piece])
        for name, buf in buffers.items():
            tensor = self.spec.tensor(name)
            view, pos = memoryview(buf), 0
            for r in token_ranges(self.spec, tensor, offset, length):
                pieces = []
                for size in r.pieces:
                    pieces.append(view[pos : pos + size])
                    pos += size
                plan.append((shard_key(part, tensor, r.shard), r.file_start, r.file_end, pieces))
        try:
            if self._storage.is_local:
                for key, start, end, pieces in plan:
                    self._pread(key, start, end, pieces)
            else:
                keys, starts, ends, _ = zip(*plan)
                for (key, start, end, pieces), data in zip(plan, self._storage.read_ranges(keys, starts, ends)):
                    _scatter(data, pieces, self._where(i, key, start, end))
        except FileNotFoundError as e:
            raise CorruptDataError(f"sample {self._ids[i]!r}: shard file missing: {e.filename or e}") from None

    def _pread(self, key: str, start: int, end: int, pieces: Sequence[memoryview]) -> None:
        crc = bytearray(CRC_NBYTES)  # checksums between chunks are skipped; validate checks them
        iov = [pieces[0]]
        for piece in pieces[1:]:
            iov += (crc, piece)
        position = start
        for batch_start in range(0, len(iov), IOV_MAX):
            batch = iov[batch_start : batch_start + IOV_MAX]
            want = sum(len(b) for b in batch)
            got = self._storage.pread_into(key, position, batch)
            if got != want:
                raise CorruptDataError(f"{self._storage.describe(key)}: truncated, read {got} of {want} bytes at "
                                       f"offset {position} (wanted bytes [{start}, {end}))")
            position += got

    def _check_hash(self, i: int, tensor: TensorSpec, buf: np.ndarray) -> None:
        stored = int(self._hashes[tensor.name][i])
        computed = manifest.content_hash(buf)
        if computed != stored:
            part, offset, length = self.location(i)
            raise CorruptDataError(
                f"sample {self._ids[i]!r}: {tensor.name} does not match its checksum (part {part}, tokens "
                f"[{offset}, {offset + length}), xxh3 stored {stored:016x}, computed {computed:016x}); "
                f"the store is corrupt: run `hsdata validate {self.url}`")

    def _where(self, i: int, key: str, start: int, end: int) -> str:
        return f"sample {self._ids[i]!r}: {self._storage.describe(key)} bytes [{start}, {end})"


def _scatter(data: bytes, pieces: Sequence[memoryview], where: str) -> None:
    expected = sum(len(p) for p in pieces) + CRC_NBYTES * (len(pieces) - 1)
    if len(data) != expected:
        raise CorruptDataError(f"{where}: got {len(data)} bytes, expected {expected} (truncated shard?)")
    src, pos = memoryview(data), 0
    for piece in pieces:
        piece[:] = src[pos : pos + len(piece)]
        pos += len(piece) + CRC_NBYTES


def _check_fields(fields: Iterable[str] | None) -> tuple[str, ...]:
    if fields is None:
        return TENSOR_NAMES
    names = tuple([fields] if isinstance(fields, str) else fields)
    unknown = [n for n in names if n not in TENSOR_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown fields {unknown}; choose from {', '.join(TENSOR_NAMES)}")
    return names


def _drop_duplicates(rows: pa.Table, url: str) -> pa.Table:
    """Keep one row per sample id, the earliest committed; duplicates come from writers racing on one id."""
    ids = rows.column("sample_id")
    if pc.count_distinct(ids).as_py() == len(ids):
        return rows
    created = rows.column("created").cast(pa.int64()).to_numpy()
    by_time = np.lexsort((np.arange(len(ids)), created))
    _, first = np.unique(ids.to_numpy(zero_copy_only=False)[by_time], return_index=True)
    keep = np.sort(by_time[first])
    warnings.warn(f"{url}: {len(ids) - len(keep)} duplicate sample rows ignored (the earliest commit of each id "
                  "wins); run `hsdata validate` for details", stacklevel=3)
    return rows.take(keep)
