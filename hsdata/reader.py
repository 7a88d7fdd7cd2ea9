"""Reading a store: ``hsdata.open`` loads the spec and manifests only; ``Store`` reads samples by exact ranges."""

from __future__ import annotations

import functools
import json
import os
import warnings
from contextlib import closing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import manifest, masks, removals, sampling
from .codecs import quantize
from .io.buffers import BufferPool, shared_bytes
from .io.cache import RangeCache
from .errors import CorruptDataError
from .arrow import arrow_of, numpy_of
from .ids import IdIndex, SampleIds, sorted_keys
from .layout import (MAX_METADATA_BYTES, array_node, load_part_provenance, load_root, metadata_key, parse_document,
                     read_document, shard_key)
from .io.threads import ProcessLocalPool
from .shard import (CRC_NBYTES, ChunkRun, ShardRange, check_run, chunk_runs, chunks_per_shard, decode_index,
                    decode_run, encoded_chunk_nbytes, index_nbytes, index_spans, token_ranges)
from .spec import TENSOR_NAMES, StoreSpec, TensorSpec
from .io.storage import MAX_REQUESTS, Storage

if TYPE_CHECKING:
    import torch

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
LOCAL_CONCURRENCY = 4  # I/O threads reading a local store
REMOTE_CONCURRENCY = MAX_REQUESTS  # requests in flight to a remote store
DEFAULT_RANGE_BYTES = 8 << 20  # within S3's guidance of 8-16 MB per ranged GET
DEFAULT_CACHE_BYTES = 64 << 30
IDLE_BUFFER_BYTES = 1 << 30  # sample buffers kept for reuse once their tensors are gone
INLINE_READ_BYTES = 1 << 20  # smaller samples are read on the calling thread
FIELD_NAMES = (*TENSOR_NAMES, "meta")  # what ``fields`` of Store.read may name


def open(url: str, *, storage_options: dict | None = None, verify: bool = True, concurrency: int | None = None,
         range_bytes: int = DEFAULT_RANGE_BYTES, cache_dir: str | None = None,
         cache_max_bytes: int = DEFAULT_CACHE_BYTES, dequantize: bool = True) -> Store:  # noqa: A001
    """Open the store at ``url`` (any fsspec URL) for reading. Reads metadata and manifests only.

    With ``verify`` (the default) every tensor read is checked against its per-sample xxh3 from the manifest,
    so a corrupt or misplaced byte raises :class:`CorruptDataError` instead of reaching training. A sample's
    bytes are read as ranges of about ``range_bytes``, ``concurrency`` at a time: I/O threads on a local disk
    (default 4), requests in flight on a remote store (default 32; ranges of one object less than 1 MiB apart
    are merged into requests of up to ``range_bytes``). ``cache_dir`` keeps the remote ranges read on a local
    disk for later epochs, at most ``cache_max_bytes`` of them. An fp8 store's states are read as bfloat16
    unless ``dequantize=False`` (then as fp8 values with their scales: :meth:`Store.read`).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    cache = RangeCache(cache_dir, cache_max_bytes) if cache_dir is not None else None
    storage = Storage(url, storage_options, max_requests=concurrency or REMOTE_CONCURRENCY, cache=cache)
    spec, provenance = load_root(storage)  # first: a path that holds no store says so before any table is read
    removed = removals.load(storage)
    rows = removed.drop_rows(manifest.load(storage))
    return Store(storage, spec, rows, masks.load_lookup(storage, removed.masks), verify=verify, concurrency=concurrency,
                 range_bytes=range_bytes, provenance=provenance, dequantize=dequantize)


class Store:
    """A read-only view of the samples committed when the store was opened."""

    def __init__(self, storage: Storage, spec: StoreSpec, rows: pa.Table, added_masks: Mapping[str, bytes], *,
                 verify: bool = True, concurrency: int | None = None, range_bytes: int = DEFAULT_RANGE_BYTES,
                 provenance: dict[str, Any] | None = None, dequantize: bool = True):
        """``concurrency``: I/O threads for a local store (a remote one's limit is ``storage.max_requests``);
        ``provenance``: the root metadata's (``layout.load_root``); ``added_masks``: anything with ``get(sample_id)``
        (a dict, or :class:`hsdata.masks.AddedMasks`)."""
        concurrency = LOCAL_CONCURRENCY if concurrency is None else concurrency
        if concurrency < 1 or range_bytes < 1:
            raise ValueError(f"concurrency and range_bytes must be positive, got {concurrency} and {range_bytes}")
        self.spec = spec
        self.provenance: dict[str, Any] = provenance or {}  # what the store's creator recorded (hsdata.create)
        self.verify = verify
        self.dequantize = dequantize  # fp8 states read as bfloat16 (no effect on other stores)
        self._storage = storage
        self._pool = ProcessLocalPool(concurrency, "hsdata-read")
        self._buffers = BufferPool(IDLE_BUFFER_BYTES)
        self._range_bytes = range_bytes
        self.manifest, hashes, keys = _winners(rows, storage.url)
        ids = self.manifest.column("sample_id")
        self._id_index = IdIndex(ids, keys if keys is not None else sorted_keys(hashes))  # 8 bytes per sample
        self._ids = SampleIds(ids, self._id_index.find)  # no str per sample: the Arrow column
        self._part_names, self._part_of = _encode_parts(self.manifest.column("part"))
        self._offsets = numpy_of(self.manifest.column("token_offset"))
        self.lengths: np.ndarray = numpy_of(self.manifest.column("num_tokens"))
        self._hashes = {t: self.manifest.column(manifest.hash_column(t)) for t in TENSOR_NAMES}  # read per sample
        self._meta = self.manifest.column("meta")
        self._has_loss_mask = manifest.has_loss_mask(self.manifest)
        self._added_masks = added_masks
        self._array_tokens = _array_tokens(storage, spec, self._part_names)  # read now: a later epoch may read
        # through the cache alone
        self._shard_sizes: dict[str, int] = {}  # shard key -> file size, read at first use (write-once files)
        self._spans: dict[str, np.ndarray] = {}  # compressed shard key -> its written chunks, read at first use

    @property
    def url(self) -> str:
        return self._storage.url

    @functools.cached_property
    def part_provenance(self) -> dict[str, dict[str, Any]]:
        """What writers that joined the store recorded (``hsdata.create(..., provenance=)`` on an existing store),
        by part: only parts with committed samples that recorded one; the creator's is :attr:`provenance`. Read at
        first use (one small document per part)."""
        return load_part_provenance(self._storage, self._part_names)

    @property
    def sample_ids(self) -> SampleIds:
        """The ids in position order: a read-only sequence of ``str`` (:class:`hsdata.ids.SampleIds`) backed by
        the manifest's Arrow column; an item or slice is converted when read (a slice is a list)."""
        return self._ids

    @property
    def num_tokens(self) -> int:
        lengths = self.lengths
        if not len(lengths) or int(lengths.max()) < (2**63 - 1) // len(lengths):
            return int(lengths.sum())
        return sum(lengths.tolist())  # Python ints: exact however many rows

    def __len__(self) -> int:
        return self.manifest.num_rows

    def __repr__(self) -> str:
        return f"<hsdata.Store {self.url!r}: {len(self)} samples, {self.num_tokens} tokens, {self.spec!r}>"

    def index(self, sample_id: str) -> int:
        """Position of ``sample_id`` in this store."""
        position = self._id_index.find(sample_id)
        if position is None:
            raise KeyError(f"no sample {sample_id!r} in {self.url}")
        return position

    def indices(self, sample_ids: Iterable[str]) -> np.ndarray:
        """Positions of ``sample_ids`` (int64, in the order given), found together (vectorized); ``KeyError``
        naming up to five ids that are not in this store."""
        wanted = [sample_ids] if isinstance(sample_ids, str) else list(sample_ids)
        positions = self._id_index.find_many(wanted)
        missing = np.flatnonzero(positions < 0)
        if len(missing):
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise KeyError(f"no samples {[wanted[k] for k in missing[:5].tolist()]}{more} in {self.url}")
        return positions

    def __contains__(self, sample_id: object) -> bool:
        return self._id_index.find(sample_id) is not None

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.read(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.read(i)

    def get(self, sample_id: str, fields: Iterable[str] | None = None) -> dict[str, Any]:
        return self.read(self.index(sample_id), fields)

    def meta(self, i: int) -> dict[str, Any] | None:
        """The ``meta`` dict sample ``i`` was added with; None if it had none."""
        i = self._position(i)
        text = self._meta[i].as_py()
        if text is None:
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CorruptDataError(f"sample {self._ids[i]!r}: its meta is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise CorruptDataError(f"sample {self._ids[i]!r}: its meta must be a JSON object, got "
                                   f"{type(value).__name__}")
        return value

    def read(self, i: int, fields: Iterable[str] | None = None, *, shared: bool = False) -> dict[str, Any]:
        """Sample ``i`` as a dict of torch tensors: ``input_ids`` int64 [T], ``loss_mask`` uint8 [T],
        ``aux_hidden_states`` [T, K*H] and ``hidden_states`` [T, H] in the stored dtype (``spec.dtype``: bfloat16,
        float16 or float32; an fp8 store's as bfloat16, or, opened with ``dequantize=False``, as fp8 with
        ``aux_hidden_states_scale`` [T, K] and ``hidden_states_scale`` [T, 1], float32: value x scale of its
        layer); ``fields`` picks a subset, and may name ``meta`` (:meth:`meta`) too.
        ``loss_mask`` comes from the sample, else from masks added later (``hsdata.add_loss_masks``), else is None.
        With ``shared``, tensors are read straight into shared memory, so a DataLoader worker sends them to the
        main process without copying."""
        return self.read_many([i], fields, shared=shared)[0]

    def read_arrays(self, i: int, fields: Iterable[str] | None = None) -> dict[str, Any]:
        """Sample ``i`` as numpy arrays exactly as stored, checked as :meth:`read` checks it, without loading
        torch (the command line's ``show``): ``input_ids`` int32, ``loss_mask`` uint8, the hidden states as the
        stored dtype's bit patterns (``uint16`` for bfloat16) or, for fp8, the stored rows of values and scales
        (``[T, layers * (H + 4)]`` uint8: :mod:`hsdata.codecs.quantize`)."""
        plan = self._plan(self._position(i), _check_fields(fields), False, None, arrays=True)
        self._fill([plan], inline=True)
        return self._finish(plan)

    def read_many(self, indices: Sequence[int], fields: Iterable[str] | None = None, *, shared: bool = False,
                  out: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
                  inline: bool = False, encoded: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Several samples as :meth:`read` gives them, their reads issued together: on a remote store, ranges
        of samples that lie next to each other share requests.

        ``out``: for each sample, tensors to read some of its tensors into, by name (each contiguous, of the
        dtype read, or for an fp8 tensor uint8 to take its stored rows, holding the sample's first rows: its rows
        of a padded batch, say); the sample's rows beyond
        them are read only to check its checksum (not at all with ``verify`` off), and the sample's dict holds
        the given tensor. ``inline``: read a local store on the calling thread (for callers that read several
        samples at once on threads of their own), instead of on the store's I/O threads.

        ``encoded``: for each sample, how many of its first rows to read of its compressed tensors, which are then
        not decoded: the sample's dict holds an :class:`EncodedRows` (the chunks' bytes, each checked against
        its crc32c, to be decoded elsewhere: a GPU), read into ``out``'s uint8 tensor of
        :meth:`encoded_runs`' bytes if given. Their per-sample xxh3 is not checked (it is of the decoded rows).
        """
        names = _check_fields(fields)
        for given, what in ((out, "out"), (encoded, "encoded")):
            if given is not None and len(given) != len(indices):
                raise ValueError(f"{what} has {len(given)} entries for {len(indices)} samples")
        plans = [self._plan(self._position(i), names, shared, out[k] if out is not None else None,
                            encoded_rows=None if encoded is None else int(encoded[k]))
                 for k, i in enumerate(indices)]
        self._fill(plans, inline)
        return [self._finish(plan) for plan in plans]

    def encoded_runs(self, i: int, name: str, rows: int | None = None) -> tuple[ChunkRun, ...]:
        """The compressed chunks holding the first ``rows`` rows (default: all) of sample ``i``'s tensor
        ``name``, as runs of whole chunks back to back in their shard files (one per shard touched): what
        :meth:`read_many` with ``encoded`` reads of it (each run's ``file_end - file_start`` bytes, in order)."""
        tensor = self.spec.tensor(name)
        if tensor.compression is None:
            raise ValueError(f"{name} is not compressed in {self.url}")
        i = self._position(i)
        part, offset, length = self.location(i)
        rows = length if rows is None else rows
        if not 0 < rows <= length:
            raise ValueError(f"sample {self._ids[i]!r}: rows must be in [1, {length}], got {rows}")
        self._check_extent(self._ids[i], part, offset, length, tensor)
        return tuple(self._chunk_runs(self._ids[i], part, tensor, offset, rows))

    def _fill(self, plans: list[_Plan], inline: bool) -> None:
        """Run the reads of ``plans``, hashing each range as it arrives."""
        reads = [read for plan in plans for read in plan.reads]
        done = 0
        try:
            for read, _ in zip(reads, self._fetch(reads, inline)):
                if self.verify and read.hasher is not None:  # overlaps with the reads still in flight
                    read.hasher.update(read.destination)
                done += 1
        except FileNotFoundError as e:
            raise CorruptDataError(f"sample {reads[done].sample_id!r}: shard file missing: "
                                   f"{e.filename or e}") from None
        except CorruptDataError as e:
            raise CorruptDataError(f"sample {reads[done].sample_id!r}: {e}") from None

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

    def _plan(self, i: int, names: tuple[str, ...], shared: bool,
              destinations: Mapping[str, torch.Tensor] | None, arrays: bool = False,
              encoded_rows: int | None = None) -> _Plan:
        """The output buffers of sample ``i`` and the ranges to read into them, in byte order of each tensor;
        ``arrays``: numpy buffers (:meth:`read_arrays`), else torch tensors; ``encoded_rows``: its first rows of
        the compressed tensors as their chunks' bytes (:meth:`read_many`)."""
        take = _new_bytes if arrays else self._buffers.take

        part, offset, length = self.location(i)
        with_mask = self._has_loss_mask[i]
        tensors = [self.spec.tensor(n) for n in names if n in TENSOR_NAMES and (n != "loss_mask" or with_mask)]
        sample_id = self._ids[i]
        for tensor in tensors:
            self._check_extent(sample_id, part, offset, length, tensor)
        encoded = [] if encoded_rows is None else [t.name for t in tensors if t.compression is not None]
        given = [self._destination(sample_id, t, destinations.get(t.name), length)
                 if destinations and t.name not in encoded else None for t in tensors]
        outputs = []
        for tensor, destination in zip(tensors, given):
            if tensor.name in encoded:
                outputs.append(None)  # planned below
            elif destination is not None and not (tensor.quantized and not _is_rows(destination)):
                outputs.append(_flat_bytes(destination))
            elif shared and not tensor.quantized:  # (dequantized from a buffer, into shared memory)
                outputs.append(shared_bytes(length * tensor.row_nbytes))
            else:
                outputs.append(take(length * tensor.row_nbytes))
        plan = _Plan(i, sample_id, tensors, outputs, given, [manifest.content_hasher() for _ in tensors],
                     with_meta="meta" in names, shared=shared, arrays=arrays)
        if "loss_mask" in names and not with_mask:
            plan.mask_added_later, plan.added_mask = True, self._added_masks.get(sample_id)
        for k, (tensor, output) in enumerate(zip(tensors, outputs)):
            if tensor.name in encoded:
                given_bytes = (destinations or {}).get(tensor.name)
                outputs[k] = self._plan_encoded(plan, k, part, offset, encoded_rows, given_bytes, take)
                continue
            rows = len(output) // tensor.row_nbytes
            spans = [(offset, rows, _bytes_view(output))]
            if rows < length and self.verify:  # the rest only feeds the checksum
                tail = take((length - rows) * tensor.row_nbytes)
                spans.append((offset + rows, length - rows, _bytes_view(tail)))
            for first, count, buffer in spans:
                if count:
                    self._plan_reads(plan, k, part, tensor, first, count, buffer, take)
        return plan

    def _plan_encoded(self, plan: _Plan, k: int, part: str, offset: int, rows: int, given: torch.Tensor | None,
                      take) -> EncodedRows:
        """The reads of a compressed tensor's first ``rows`` rows of a sample as its chunks' bytes, into ``given``
        (uint8, exactly their size) or a new buffer."""
        tensor, length = plan.tensors[k], int(self.lengths[plan.position])
        if not 0 < rows <= length:
            raise ValueError(f"sample {plan.sample_id!r}: encoded rows must be in [1, {length}], got {rows}")
        runs = tuple(self._chunk_runs(plan.sample_id, part, tensor, offset, rows))
        nbytes = sum(r.file_end - r.file_start for r in runs)
        if given is None:
            given = take(nbytes)
        elif given.dtype.itemsize != 1 or given.numel() != nbytes or not given.is_contiguous():
            raise ValueError(f"sample {plan.sample_id!r}: out[{tensor.name!r}] must be {nbytes} contiguous bytes "
                             f"(its encoded rows), got {given.dtype} of shape {tuple(given.shape)}")
        data, start = _bytes_view(given), 0
        for whole in runs:
            for r in whole.split(self._range_bytes, tensor.chunk_nbytes):
                size = r.file_end - r.file_start
                plan.reads.append(_Read(plan.sample_id, None, shard_key(part, tensor, r.shard), r, None, tensor,
                                        data[start : start + size]))
                start += size
        return EncodedRows(given, runs, tensor)

    def _plan_reads(self, plan: _Plan, k: int, part: str, tensor: TensorSpec, offset: int, count: int,
                    buffer: memoryview, take) -> None:
        """The reads that fill ``buffer`` with rows ``[offset, offset + count)`` of ``tensor`` in ``part``."""
        compressed, start = tensor.compression is not None, 0
        if not compressed:
            ranges = [r for whole in token_ranges(self.spec, tensor, offset, count)
                      for r in whole.split(self._range_bytes)]
        else:
            ranges = [r for whole in self._chunk_runs(plan.sample_id, part, tensor, offset, count)
                      for r in whole.split(self._range_bytes, tensor.chunk_nbytes)]
        for r in ranges:
            read = _Read(plan.sample_id, plan.hashers[k], shard_key(part, tensor, r.shard), r,
                         buffer[start : start + r.nbytes])
            if compressed:
                read.tensor = tensor
                read.encoded = _bytes_view(take(r.file_end - r.file_start))
            plan.reads.append(read)
            start += r.nbytes

    def _chunk_runs(self, sample_id: str, part: str, tensor: TensorSpec, offset: int, length: int) -> list[ChunkRun]:
        """The compressed chunks holding a sample's rows of one tensor, from the indexes of the shards they lie in."""
        def key(shard: int) -> str:
            return shard_key(part, tensor, shard)

        return chunk_runs(self.spec, tensor, lambda shard: self._chunk_spans(sample_id, key(shard), tensor), offset,
                          length, lambda shard: self._storage.describe(key(shard)))

    def _chunk_spans(self, sample_id: str, key: str, tensor: TensorSpec) -> np.ndarray:
        """A compressed shard's written chunks from its index, checked against the file (read once)."""
        spans = self._spans.get(key)
        if spans is not None:
            return spans
        where, per_shard = self._storage.describe(key), chunks_per_shard(self.spec, tensor)
        size, index_size = self._shard_size(sample_id, key), index_nbytes(per_shard)
        if size < index_size:
            raise CorruptDataError(f"{where} is {size} bytes, shorter than its shard index ({index_size}; truncated?)")
        index = decode_index(self._storage.read_exact(key, size - index_size, size), per_shard, where=where)
        try:
            spans = self._spans[key] = index_spans(index, size, tensor)
        except CorruptDataError as e:
            raise CorruptDataError(f"{where}: {e}") from None
        return spans

    def _shard_size(self, sample_id: str, key: str) -> int:
        size = self._shard_sizes.get(key)
        if size is None:
            try:
                size = self._shard_sizes[key] = self._storage.size(key)
            except FileNotFoundError:
                raise CorruptDataError(f"sample {sample_id!r}: shard file missing: {self._storage.describe(key)}") \
                    from None
        return size

    def _finish(self, plan: _Plan) -> dict[str, Any]:
        """Check the read sample's hashes and shape its tensors (or arrays)."""
        if not plan.arrays:
            import torch
        i, sample_id = plan.position, plan.sample_id
        out: dict[str, Any] = {"sample_id": sample_id}
        if plan.with_meta:
            out["meta"] = self.meta(i)
        if plan.mask_added_later:
            added = plan.added_mask
            if added is not None and len(added) != self.lengths[i]:
                raise CorruptDataError(f"sample {sample_id!r}: its added loss mask has {len(added)} tokens, "
                                       f"the sample {self.lengths[i]}")
            if added is not None and np.frombuffer(added, np.uint8).max() > 1:
                raise CorruptDataError(f"sample {sample_id!r}: its added loss mask holds values other than 0 and 1")
            mask = None if added is None else np.frombuffer(bytearray(added), np.uint8)
            out["loss_mask"] = mask if mask is None or plan.arrays else torch.from_numpy(mask)
        for tensor, output, given, hasher in zip(plan.tensors, plan.outputs, plan.given, plan.hashers):
            if isinstance(output, EncodedRows):
                out[tensor.name] = output
                continue
            if self.verify:
                self._check_hash(i, tensor, hasher.intdigest())
            if plan.arrays:
                out[tensor.name] = output.view(tensor.dtype.stored).reshape(-1, *(() if tensor.width is None else
                                                                                   (tensor.width,)))
                continue
            if tensor.quantized and not _is_rows(given):
                out.update(self._dequantized(tensor, output, given, plan.shared))
                continue
            if given is not None:
                out[tensor.name] = given
                continue
            value = output.view(tensor.dtype.torch)
            if tensor.width is not None:
                value = value.view(-1, tensor.width)
            out[tensor.name] = value.to(torch.int64) if tensor.name == "input_ids" else value
        return out

    def _fetch(self, reads: list[_Read], inline: bool = False) -> Iterator[None]:
        """Fill the destinations of ``reads``, yielding once per read as each completes, in order.

        Locally each range is one ``preadv`` on the I/O threads (small reads, and all with ``inline``, on the
        caller's thread); from a remote store all ranges are fetched together (neighbours merged, a bounded
        number in flight).
        """
        if not self._storage.is_local:
            requests = [(read.key, read.range.file_start, _iov(read)) for read in reads]
            with closing(self._storage.read_into(requests, merge_up_to=self._range_bytes)) as arriving:
                for read, _ in zip(reads, arriving):
                    self._decode(read)
                    yield
        elif inline or len(reads) == 1 or sum(read.range.nbytes for read in reads) < INLINE_READ_BYTES:
            for read in reads:
                self._pread(read)
                yield
        else:
            futures = [self._pool.submit(self._pread, read) for read in reads]
            try:
                for future in futures:
                    future.result()
                    yield
            finally:
                for future in futures:
                    future.cancel()

    def _destination(self, sample_id: str, tensor: TensorSpec, given: torch.Tensor | None,
                     length: int) -> torch.Tensor | None:
        """``given`` checked as a place for the first rows of ``tensor`` of a sample of ``length`` tokens."""
        if given is None:
            return None
        import torch  # a given tensor: torch is loaded

        if tensor.quantized and not self.dequantize and not _is_rows(given):
            raise ValueError(f"sample {sample_id!r}: out[{tensor.name!r}] must be uint8 rows as stored: the store "
                             "was opened with dequantize off")
        dtype, width = tensor.read_dtype.torch, tensor.values_width
        if tensor.quantized and _is_rows(given):  # the stored rows, as they are
            dtype, width = torch.uint8, tensor.width
        if given.dtype != dtype or not given.is_contiguous() or given.device.type != "cpu":
            raise ValueError(f"sample {sample_id!r}: out[{tensor.name!r}] must be a contiguous CPU tensor of "
                             f"{dtype}, got {given.dtype} on {given.device}"
                             f"{'' if given.is_contiguous() else ', not contiguous'}")
        rows, extra = divmod(given.numel(), width or 1)
        if extra or rows > length or (given.dim() > 1 and given.shape[-1] != width):
            raise ValueError(f"sample {sample_id!r}: out[{tensor.name!r}] has shape {tuple(given.shape)}; it must "
                             f"hold at most {length} rows of {width or 1}")
        return given

    def _dequantized(self, tensor: TensorSpec, output: torch.Tensor, given: torch.Tensor | None,
                     shared: bool) -> dict[str, torch.Tensor]:
        """An fp8 tensor's entries of a sample's dict, from its stored rows ``output``: bfloat16 states (into
        ``given`` when there is one), or with ``dequantize`` off the fp8 values and their scales."""
        import torch

        layers, hidden = tensor.layers, self.spec.hidden_size
        tokens = len(output) // tensor.row_nbytes
        if not self.dequantize:
            values, scales = quantize.split(output, layers, hidden, tensor.logical_dtype)
            return {tensor.name: values.reshape(tokens, layers * hidden), f"{tensor.name}_scale": scales}
        if given is None:
            nbytes = tokens * tensor.values_width * quantize.DEQUANTIZED.itemsize
            given = (shared_bytes(nbytes) if shared else torch.empty(nbytes, dtype=torch.uint8)).view(
                quantize.DEQUANTIZED.torch).view(tokens, tensor.values_width)
        rows = output[: len(given.view(-1)) // tensor.values_width * tensor.row_nbytes]
        return {tensor.name: quantize.dequantize(rows, layers, hidden, tensor.logical_dtype, out=given)}

    def _check_extent(self, sample_id: str, part: str, offset: int, length: int, tensor: TensorSpec) -> None:
        """Before anything is allocated: the sample's rows lie within its part's array (its ``zarr.json``
        ``shape[0]``), and (locally) each shard file they touch exists and is long enough to hold them."""
        end, storage = offset + length, self._storage
        array_key = metadata_key(array_node(part, tensor))
        tokens = self._array_tokens[array_key]
        if isinstance(tokens, str):
            raise CorruptDataError(f"sample {sample_id!r}: {tokens}")
        if end > tokens:
            raise CorruptDataError(f"sample {sample_id!r}: tokens [{offset}, {end}) lie beyond the {tokens} tokens "
                                   f"of its array ({storage.describe(array_key)})")
        if not storage.is_local or tensor.compression is not None:  # a compressed shard's index is checked instead
            return
        st, ct = self.spec.shard_tokens, tensor.chunk_tokens
        for shard in range(offset // st, (end - 1) // st + 1):  # stops at the first missing or short file
            key = shard_key(part, tensor, shard)
            local_end = min(end, (shard + 1) * st) - shard * st
            need = -(-local_end // ct) * encoded_chunk_nbytes(tensor) + index_nbytes(chunks_per_shard(self.spec, tensor))
            size = self._shard_size(sample_id, key)
            if size < need:
                raise CorruptDataError(f"sample {sample_id!r}: {storage.describe(key)} is {size} bytes, the sample "
                                       f"needs {need} (truncated?)")

    def _pread(self, read: _Read) -> None:
        iov, position = _iov(read), read.range.file_start
        for first in range(0, len(iov), IOV_MAX):
            batch = iov[first : first + IOV_MAX]
            want = sum(len(b) for b in batch)
            got = self._storage.pread_into(read.key, position, batch)
            if got != want:
                raise CorruptDataError(f"{self._where(read.key, read.range)}: truncated, read {got} of {want} "
                                       f"bytes at {position}")
            position += got
        self._decode(read)

    def _decode(self, read: _Read) -> None:
        """A compressed read's chunks, checked and decompressed into its destination (else nothing to do; with
        no destination, only checked: they are decoded elsewhere)."""
        if read.tensor is None:
            return
        where = functools.partial(self._where, read.key, read.range)
        if read.destination is None:
            check_run(read.encoded, read.range, where=where)
        else:
            decode_run(read.encoded, read.range, read.tensor, read.destination, where=where)
        read.encoded = None

    def _check_hash(self, i: int, tensor: TensorSpec, computed: int) -> None:
        stored = self._hashes[tensor.name][i].as_py() or 0  # null: no mask stored (never checked then)
        if computed != stored:
            part, offset, length = self.location(i)
            raise CorruptDataError(
                f"sample {self._ids[i]!r}: {tensor.name} does not match its checksum (part {part}, tokens "
                f"[{offset}, {offset + length}), xxh3 stored {stored:016x}, computed {computed:016x}); "
                f"the store is corrupt: run `hsdata validate {self.url}`")

    def _where(self, key: str, r: ShardRange | ChunkRun) -> str:
        return f"{self._storage.describe(key)} bytes [{r.file_start}, {r.file_end})"


@dataclass
class _Plan:
    """One sample being read: its output tensors, their hashers, and the reads that fill them."""

    position: int
    sample_id: str
    tensors: list[TensorSpec]
    outputs: list[Any]  # uint8 tensors (numpy arrays with ``arrays``), flat: what the reads fill (the first rows,
    # where a tensor was given)
    given: list[torch.Tensor | None]  # the caller's tensor to return, or None
    hashers: list
    with_meta: bool = False
    shared: bool = False  # tensors made after the read (dequantized) go in shared memory
    arrays: bool = False  # numpy arrays as stored, not tensors (Store.read_arrays)
    reads: list[_Read] = field(default_factory=list)
    mask_added_later: bool = False  # loss_mask wanted, from hsdata.add_loss_masks (added_mask; None: none added)
    added_mask: bytes | None = None


@dataclass(frozen=True)
class EncodedRows:
    """A compressed tensor's first rows of one sample as stored (:meth:`Store.read_many` with ``encoded``): the
    bytes of the chunks holding them (each chunk's blosc frame, then its crc32c) and the runs they form, back to
    back in ``data`` in order (:class:`hsdata.shard.ChunkRun`: a run's rows start ``skip`` bytes into its first
    chunk's decoded bytes and are ``nbytes`` long)."""

    data: Any  # a uint8 tensor
    runs: tuple[ChunkRun, ...]
    tensor: TensorSpec


@dataclass
class _Read:
    """One byte range of a shard file, where its payload goes, and the hasher of its tensor (no reference back
    to the plan: a cycle would keep the sample's buffers alive, out of the pool, until the garbage collector ran)."""

    sample_id: str
    hasher: Any  # None: nothing to hash (chunks read to be decoded elsewhere)
    key: str
    range: ShardRange | ChunkRun
    destination: memoryview | None  # None: a compressed range's chunks, only checked (``encoded`` is the output)
    tensor: TensorSpec | None = None  # of a compressed range: its chunks are read into ``encoded``, then decoded
    encoded: memoryview | None = None  # a pooled buffer, back in the pool once decoded (read.encoded = None)


def _iov(read: _Read) -> list:
    """Buffers that take a read's range as it lies in the file: each chunk's payload piece into its place in the
    destination, the crc32c between two pieces into a throwaway buffer (validate checks those); a compressed
    range's bytes as they are, to be decoded."""
    if read.encoded is not None:
        return [read.encoded]
    crc, iov, destination = bytearray(CRC_NBYTES), [], read.destination
    for size in read.range.pieces:
        iov += (crc, destination[:size]) if iov else (destination[:size],)
        destination = destination[size:]
    return iov


def _new_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


def _bytes_view(buffer: Any) -> memoryview:
    """The bytes of a uint8 numpy array or CPU tensor."""
    return memoryview(buffer if isinstance(buffer, np.ndarray) else buffer.numpy())


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch  # a given tensor: torch is loaded

    return tensor.view(torch.uint8).reshape(-1)


def _is_rows(given: torch.Tensor | None) -> bool:
    """Whether a destination of an fp8 tensor takes its stored rows (uint8) rather than dequantized states."""
    if given is None:
        return False
    import torch  # a given tensor: torch is loaded

    return given.dtype == torch.uint8


def _check_fields(fields: Iterable[str] | None) -> tuple[str, ...]:
    if fields is None:
        return TENSOR_NAMES
    names = tuple([fields] if isinstance(fields, str) else fields)
    unknown = [n for n in names if n not in FIELD_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown fields {unknown}; choose from {', '.join(FIELD_NAMES)}")
    return names


def _winners(rows: pa.Table, url: str) -> tuple[pa.Table, np.ndarray, np.ndarray | None]:
    """One row per sample id (:func:`manifest.winners`), the id hashes of those rows and their sorted keys (None:
    not computed); duplicates come from writers racing on one id."""
    keep, hashes, order = manifest.winners_and_hashes(rows)
    if len(keep) == len(rows):
        return rows, hashes, order
    warnings.warn(f"{url}: {len(rows) - len(keep)} duplicate sample rows ignored (the earliest commit of each id "
                  "wins); run `hsdata validate` for details", stacklevel=3)
    return rows.take(arrow_of(keep)), hashes[keep], None


def _encode_parts(parts: pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """``(names, index of each row's name)``, in order of first appearance. A chunk of one manifest names one
    part (``manifest.check_part``): such a chunk is compared against its first value (no hashing of each row)."""
    names: dict[str, int] = {}
    pieces = []
    for chunk in parts.chunks:
        if not len(chunk):
            continue
        first = chunk[0].as_py()
        if pc.all(pc.equal(chunk, chunk[0])).as_py():  # an Arrow scalar: a str would go through pa.scalar
            pieces.append(np.full(len(chunk), names.setdefault(first, len(names)), np.int32))
            continue
        encoded = chunk.dictionary_encode()
        local = np.array([names.setdefault(n, len(names)) for n in encoded.dictionary.to_pylist()], np.int32)
        pieces.append(local[numpy_of(encoded.indices)])
    return list(names), np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


def _array_tokens(storage: Storage, spec: StoreSpec, parts: list[str]) -> dict[str, int | str]:
    """``shape[0]`` of each array's ``zarr.json`` (the tokens its part holds) by key; what is wrong with it instead
    where it cannot be read (raised when a sample of that part is read). Remotely, the documents are fetched at
    once; one that fails sends them all through one at a time, so that each failure stays with its key."""
    keys = [metadata_key(array_node(part, tensor)) for part in parts for tensor in spec.tensors]
    try:
        documents = [parse_document(raw, storage.describe(key))
                     for key, raw in zip(keys, storage.read_many(keys, max_bytes=MAX_METADATA_BYTES))]
    except OSError:  # CorruptDataError included
        documents = [_document_or_error(storage, key) for key in keys]
    return {key: _token_count(storage, key, document) for key, document in zip(keys, documents)}


def _document_or_error(storage: Storage, key: str) -> dict[str, Any] | str:
    try:
        return read_document(storage, key)
    except FileNotFoundError:
        return f"{storage.describe(key)}: array metadata missing"
    except CorruptDataError as e:
        return str(e)


def _token_count(storage: Storage, key: str, document: dict[str, Any] | str) -> int | str:
    if isinstance(document, str):
        return document
    shape = document.get("shape")
    valid = isinstance(shape, list) and shape and type(shape[0]) is int and shape[0] >= 0
    return shape[0] if valid else f"{storage.describe(key)}: shape {shape!r} does not start with a token count"
