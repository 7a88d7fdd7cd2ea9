"""Reading a store: ``hsdata.open`` loads the spec and manifests only; ``Store`` reads samples by exact ranges."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from . import manifest, masks, sampling
from .errors import CorruptDataError
from .layout import load_spec, shard_key
from .shard import CRC_NBYTES, ShardRange, token_ranges
from .spec import TENSOR_NAMES, StoreSpec, TensorSpec
from .storage import Storage

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
DEFAULT_IO_THREADS = 2
DEFAULT_RANGE_BYTES = 8 << 20
INLINE_READ_BYTES = 1 << 20  # smaller samples are read on the calling thread
_TORCH_DTYPES = {"int32": torch.int32, "uint8": torch.uint8, "uint16": torch.bfloat16}


def open(url: str, *, storage_options: dict | None = None, verify: bool = True, io_threads: int = DEFAULT_IO_THREADS,
         range_bytes: int = DEFAULT_RANGE_BYTES) -> Store:  # noqa: A001
    """Open the store at ``url`` (any fsspec URL) for reading. Reads metadata and manifests only.

    With ``verify`` (the default) every tensor read is checked against its per-sample xxh3 from the manifest,
    so a corrupt or misplaced byte raises :class:`CorruptDataError` instead of reaching training. A sample's
    bytes are read as ranges of about ``range_bytes``, up to ``io_threads`` at a time.
    """
    storage = Storage(url, storage_options)
    return Store(storage, load_spec(storage), manifest.load(storage), masks.load(storage), verify=verify,
                 io_threads=io_threads, range_bytes=range_bytes)


class Store:
    """A read-only view of the samples committed when the store was opened."""

    def __init__(self, storage: Storage, spec: StoreSpec, rows: pa.Table, added_masks: dict[str, bytes], *,
                 verify: bool = True,
                 io_threads: int = DEFAULT_IO_THREADS, range_bytes: int = DEFAULT_RANGE_BYTES):
        if io_threads < 1 or range_bytes < 1:
            raise ValueError(f"io_threads and range_bytes must be positive, got {io_threads} and {range_bytes}")
        self.spec = spec
        self.verify = verify
        self._storage = storage
        self._pool = _ThreadPool(io_threads)
        self._range_bytes = range_bytes
        self.manifest = _drop_duplicates(rows, storage.url)
        self._ids: list[str] = self.manifest.column("sample_id").to_pylist()
        self._index: dict[str, int] | None = None
        parts = self.manifest.column("part").combine_chunks().dictionary_encode()
        self._part_names: list[str] = parts.dictionary.to_pylist()
        self._part_of = parts.indices.to_numpy(zero_copy_only=False)
        self._offsets = self.manifest.column("token_offset").to_numpy()
        self.lengths: np.ndarray = self.manifest.column("num_tokens").to_numpy()
        self._hashes = manifest.row_hashes(self.manifest)
        self._has_loss_mask = manifest.has_loss_mask(self.manifest)
        self._added_masks = added_masks

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

    def read(self, i: int, fields: Iterable[str] | None = None, *, shared: bool = False) -> dict[str, Any]:
        """Sample ``i`` as a dict of torch tensors: ``input_ids`` int64 [T], ``loss_mask`` uint8 [T],
        ``aux_hidden_states`` bfloat16 [T, K*H], ``hidden_states`` bfloat16 [T, H]; ``fields`` picks a subset.
        ``loss_mask`` comes from the sample, else from masks added later (``hsdata.add_loss_masks``), else is None.
        With ``shared``, tensors are read straight into shared memory, so a DataLoader worker sends them to the
        main process without copying."""
        i = self._position(i)
        part, offset, length = self.location(i)
        names = _check_fields(fields)
        added = self._added_masks.get(self._ids[i]) if "loss_mask" in names and not self._has_loss_mask[i] else None
        tensors = [self.spec.tensor(n) for n in names if n != "loss_mask" or self._has_loss_mask[i]]
        outputs = [torch.empty(length * t.row_nbytes, dtype=torch.uint8) for t in tensors]
        if shared:
            outputs = [o.share_memory_() for o in outputs]
        buffers = [o.numpy() for o in outputs]
        reads = []  # (tensor position, key, range, destination), in byte order of each tensor
        for k, (tensor, buf) in enumerate(zip(tensors, buffers)):
            start = 0
            for whole in token_ranges(self.spec, tensor, offset, length):
                for r in whole.split(self._range_bytes):
                    reads.append((k, shard_key(part, tensor, r.shard), r, memoryview(buf)[start : start + r.nbytes]))
                    start += r.nbytes
        hashers = [manifest.content_hasher() for _ in tensors]
        try:
            for (k, _, _, destination), _ in zip(reads, self._fetch(reads)):
                if self.verify:  # overlaps with the reads still in flight
                    hashers[k].update(destination)
        except FileNotFoundError as e:
            raise CorruptDataError(f"sample {self._ids[i]!r}: shard file missing: {e.filename or e}") from None
        except CorruptDataError as e:
            raise CorruptDataError(f"sample {self._ids[i]!r}: {e}") from None
        out: dict[str, Any] = {"sample_id": self._ids[i]}
        if "loss_mask" in names and not self._has_loss_mask[i]:
            if added is not None and len(added) != length:
                raise CorruptDataError(f"sample {self._ids[i]!r}: its added loss mask has {len(added)} tokens, "
                                       f"the sample {length}")
            out["loss_mask"] = None if added is None else torch.frombuffer(bytearray(added), dtype=torch.uint8)
        for tensor, output, hasher in zip(tensors, outputs, hashers):
            if self.verify:
                self._check_hash(i, tensor, hasher.intdigest())
            value = output.view(_TORCH_DTYPES[tensor.data_type])
            if tensor.width is not None:
                value = value.view(-1, tensor.width)
            out[tensor.name] = value.to(torch.int64) if tensor.name == "input_ids" else value
        return out

    def storage_order(self) -> np.ndarray:
        """Sample positions in the order their bytes lie on disk (part, then token offset)."""
        return sampling.storage_order(self._part_of, self._offsets)

    def location(self, i: int) -> tuple[str, int, int]:
        """``(part, token_offset, num_tokens)`` of sample ``i`` in the part's arrays."""
        i = self._position(i)
        return self._part_names[self._part_of[i]], int(self._offsets[i]), int(self.lengths[i])

    def close(self) -> None:
        self._pool.shutdown()
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

    def _fetch(self, reads: list) -> Iterator[None]:
        """Fill the destinations of ``reads``, yielding once per read as each completes, in order.

        Locally each range is one ``preadv`` on the I/O threads (small samples on the caller's thread);
        elsewhere all ranges are fetched concurrently by fsspec.
        """
        if not self._storage.is_local:
            keys = [key for _, key, _, _ in reads]
            starts, ends = [r.file_start for _, _, r, _ in reads], [r.file_end for _, _, r, _ in reads]
            for (_, key, r, destination), data in zip(reads, self._storage.read_ranges(keys, starts, ends)):
                _scatter(data, r, destination, self._where(key, r))
                yield
        elif len(reads) == 1 or sum(r.nbytes for _, _, r, _ in reads) < INLINE_READ_BYTES:
            for _, key, r, destination in reads:
                self._pread(key, r, destination)
                yield
        else:
            futures = [self._pool.submit(self._pread, key, r, destination) for _, key, r, destination in reads]
            try:
                for future in futures:
                    future.result()
                    yield
            finally:
                for future in futures:
                    future.cancel()

    def _pread(self, key: str, r: ShardRange, destination: memoryview) -> None:
        crc = bytearray(CRC_NBYTES)  # checksums between chunks are skipped; validate checks them
        iov = []
        for piece in _pieces(r, destination):
            iov += (crc, piece) if iov else (piece,)
        position = r.file_start
        for first in range(0, len(iov), IOV_MAX):
            batch = iov[first : first + IOV_MAX]
            want = sum(len(b) for b in batch)
            got = self._storage.pread_into(key, position, batch)
            if got != want:
                raise CorruptDataError(f"{self._where(key, r)}: truncated, read {got} of {want} bytes at {position}")
            position += got

    def _check_hash(self, i: int, tensor: TensorSpec, computed: int) -> None:
        stored = int(self._hashes[tensor.name][i])
        if computed != stored:
            part, offset, length = self.location(i)
            raise CorruptDataError(
                f"sample {self._ids[i]!r}: {tensor.name} does not match its checksum (part {part}, tokens "
                f"[{offset}, {offset + length}), xxh3 stored {stored:016x}, computed {computed:016x}); "
                f"the store is corrupt: run `hsdata validate {self.url}`")

    def _where(self, key: str, r: ShardRange) -> str:
        return f"{self._storage.describe(key)} bytes [{r.file_start}, {r.file_end})"


class _ThreadPool:
    """I/O threads, created on first use and again in a forked child."""

    def __init__(self, threads: int):
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def submit(self, fn: Callable, *args) -> Future:
        if self._executor is None or self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="hsdata-read")
            self._pid = os.getpid()
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        if self._executor is not None and self._pid == os.getpid():
            self._executor.shutdown()
        self._executor = None


def _pieces(r: ShardRange, destination: memoryview) -> Iterator[memoryview]:
    """Split a range's destination into the payload piece of each chunk it touches."""
    for size in r.pieces:
        yield destination[:size]
        destination = destination[size:]


def _scatter(data: bytes, r: ShardRange, destination: memoryview, where: str) -> None:
    if len(data) != r.file_end - r.file_start:
        raise CorruptDataError(f"{where}: got {len(data)} bytes, expected {r.file_end - r.file_start} (truncated?)")
    source = memoryview(data)
    for piece in _pieces(r, destination):
        piece[:] = source[: len(piece)]
        source = source[len(piece) + CRC_NBYTES :]


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
