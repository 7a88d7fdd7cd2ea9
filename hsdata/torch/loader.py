"""The training loop's batches: read on hsdata's threads (or in DataLoader workers) straight into their place in
recycled memory, pinned for CUDA, and moved to the GPU on a side stream ahead of the step."""

from __future__ import annotations

import collections
import itertools
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ..io import pinned as pinning
from ..io import segments
from ..io.ring import MIN_ARENA_BYTES, Ring
from ..io.segments import SharedBatch
from ..io.threads import ProcessLocalPool
from . import decoding
from .batches import Layout, on_device, on_device_many
from .device import to_device
from .readahead import BatchReads, ReadAhead, default_threads
from .samplers import ShardAwareSampler

PREFETCH_BYTES_PER_THREAD = 64 << 20  # batches read ahead: about two samples in flight per thread
# with decode="device", consecutive batches holding this many bytes of states are decoded together: nvCOMP's zstd
# call takes about 10 ms on an H200 whether it decodes 8 chunks or 500 (benchmarks/RESULTS.md, "GPU decoding")
DEVICE_DECODE_BYTES = 256 << 20


class Loader:
    """Batches of an :class:`Eagle3Dataset` or :class:`Mixture` for a training loop, in place of a DataLoader.

    Batches come from ``sampler`` (samples, cut into batches of ``batch_size``; default: a
    :class:`ShardAwareSampler` in storage order) or ``batch_sampler`` (e.g. :class:`TokenBudgetBatchSampler`), laid
    out as ``collate_eagle3(convention=, pad_to_multiple_of=)`` or, with ``pack``, ``pack_eagle3`` lays them out.
    Each batch's samples are read straight into their rows of one block: a batch of one is the sample's own
    tensors, a padded batch has each sample read into its place, and nothing is copied after the read.

    - ``num_workers=0`` (the default): ``threads`` threads of this process read up to ``prefetch_bytes`` of the
      coming batches, verifying and laying them out while the step runs, into recycled host memory.
    - ``num_workers > 0``: DataLoader worker processes (``multiprocessing_context``: fork, spawn or forkserver;
      ``persistent_workers`` keeps them between epochs) read batches into shared memory that they lend to this
      process and get back once no tensor of the batch is referenced any more; nothing is copied to hand a batch
      over, and the memory is reused all epoch.
    - ``device`` (e.g. ``"cuda"``): batches arrive on it, each copied on a side stream while the step before it
      runs (:func:`to_device`, holding ``ahead`` batches beyond the one in use). The host memory is then pinned
      (``pin_memory=None`` pins exactly when ``device`` is a CUDA device), so the copies are asynchronous. A batch
      crosses as the store holds its states, end to end (an fp8 store's at half of bf16's bytes, a padded batch
      without its padding), and is dequantized and padded on the GPU.
    - ``decode``: where a compressed store's states are decoded: ``"host"`` (the default), on the read threads
      (or in the workers); ``"device"``, on ``device``, the chunks crossing to it compressed, a third fewer
      bytes (:mod:`hsdata.torch.decoding`; on a GPU by nvCOMP: ``pip install "hsdata[nvcomp-cu12]"`` or
      ``[nvcomp-cu13]``, matching torch's CUDA). Consecutive batches holding 256 MiB of states cross and are
      decoded together (nvCOMP's call takes as long for one batch as for many), and ``ahead`` counts such
      bundles; a batch's decoded states are views of its bundle's, whose memory is reused once no batch of the
      bundle is referenced. The store's per-sample xxh3 is of the decoded rows, so with ``"device"`` only the
      chunks' crc32c are checked (every byte read is still covered by one).

    A batch's tensors stay valid for as long as they (or views of them) are referenced: memory is reused only
    after that. ``set_epoch``, ``state_dict`` and ``load_state_dict`` go to the sampler, counting the samples (or
    batches of a batch sampler) this loop received.
    """

    def __init__(self, dataset: BatchReads, *, batch_size: int = 1, sampler: Iterable[int] | None = None,
                 batch_sampler: Iterable[list[int]] | None = None, drop_last: bool = False,
                 convention: str = "hsdata", pad_to_multiple_of: int = 1, pack: bool = False,
                 num_workers: int = 0, multiprocessing_context: str | None = None, prefetch_factor: int = 2,
                 persistent_workers: bool = False, worker_init_fn: Callable[[int], None] | None = None,
                 timeout: float = 0,
                 threads: int | None = None, prefetch_bytes: int | None = None,
                 device: torch.device | str | None = None, ahead: int = 1, pin_memory: bool | None = None,
                 decode: str = "host"):
        if not isinstance(dataset, BatchReads):
            raise TypeError(f"Loader reads an hsdata Eagle3Dataset or Mixture, got {type(dataset).__name__}")
        if batch_sampler is not None and (sampler is not None or batch_size != 1 or drop_last):
            raise ValueError("batch_sampler is exclusive with sampler, batch_size and drop_last")
        for name, value, least in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0),
                                   ("prefetch_factor", prefetch_factor, 1), ("prefetch_bytes", prefetch_bytes or 0, 0),
                                   ("threads", threads or 1, 1), ("ahead", ahead, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.dataset, self.layout = dataset, Layout(convention, pad_to_multiple_of, pack)
        self.sampler = sampler if sampler is not None or batch_sampler is not None else ShardAwareSampler(
            dataset, shuffle=False)
        self.batch_sampler, self.batch_size, self.drop_last = batch_sampler, batch_size, drop_last
        self.num_workers, self.multiprocessing_context = num_workers, multiprocessing_context
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        self.worker_init_fn, self.timeout = worker_init_fn, timeout
        self.threads = threads or default_threads()
        self.prefetch_bytes = self.threads * PREFETCH_BYTES_PER_THREAD if prefetch_bytes is None else prefetch_bytes
        self.device = None if device is None else torch.device(device)
        self.ahead = ahead
        self.pin_memory = (self.device is not None and self.device.type == "cuda") if pin_memory is None else pin_memory
        _check_decode(decode, self.device, dataset.spec)
        self.decode = decode
        # states go to a CUDA device as stored, unpadded (an fp8 store's: half the bytes; compressed, decoded
        # there), finished there
        self._stored = self.device is not None and self.device.type == "cuda" or decode == "device"
        self._pool = ProcessLocalPool(self.threads, "hsdata-loader")
        self._buffers: Ring | None = None
        self._workers: DataLoader | None = None
        self._batches: _Batches | None = None
        self._consumed = 0

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        (self.batch_sampler or self.sampler).set_epoch(epoch)

    def state_dict(self) -> dict:
        """The sampler's position after what this loop received (:meth:`ShardAwareSampler.state_dict`)."""
        return (self.batch_sampler or self.sampler).state_dict(consumed=self._consumed)

    def load_state_dict(self, state: dict) -> None:
        (self.batch_sampler or self.sampler).load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        self._consumed = 0
        units: collections.deque[int] = collections.deque()  # what each batch in flight counts for the sampler
        host = self._read_here(units) if self.num_workers == 0 else self._read_in_workers(units)
        if self.decode == "device":  # to the device in bundles (``ahead`` counts bundles), each decoded at once
            bundles = to_device(_bundles(host, DEVICE_DECODE_BYTES), self.device, ahead=self.ahead,
                                transform=partial(on_device_many, spec=self.dataset.spec))
            batches = itertools.chain.from_iterable(bundles)
        else:
            transform = partial(on_device, spec=self.dataset.spec) if self._stored else None
            batches = host if self.device is None else to_device(host, self.device, ahead=self.ahead,
                                                                 transform=transform)
        for batch in batches:
            self._consumed += units.popleft()
            yield batch
        if self.decode == "device":
            decoding.raise_failures(wait=True)  # the last bundles' decoding, queued on the GPU, checked

    def _positions(self, units: collections.deque[int]) -> Iterator[list[int]]:
        """This pass's batches of dataset positions, each noting what it counts for the sampler."""
        if self.batch_sampler is not None:
            for batch in self.batch_sampler:
                units.append(1)
                yield list(batch)
            return
        batch: list[int] = []
        for i in self.sampler:
            batch.append(int(i))
            if len(batch) == self.batch_size:
                units.append(len(batch))
                yield batch
                batch = []
        if batch and not self.drop_last:
            units.append(len(batch))
            yield batch

    def _read_here(self, units: collections.deque[int]) -> Iterator[Any]:
        if self._buffers is None:
            self._buffers = Ring(pinned=self.pin_memory and pinning.available(),  # room for the read-ahead
                                 min_arena_bytes=self.prefetch_bytes + self.prefetch_bytes // 4 + MIN_ARENA_BYTES)
        start = partial(self.dataset.start_batch, layout=self.layout, take=self._buffers.take, pool=self._pool,
                        stored=self._stored, encoded=self.decode == "device")
        ahead = ReadAhead(start, self._positions(units), self.prefetch_bytes)
        try:
            while (pending := ahead.next()) is not None:
                built = pending.result()
                yield built.stored() if self._stored else built.batch()
        finally:
            ahead.close()
            self._buffers.trim()

    def _read_in_workers(self, units: collections.deque[int]) -> Iterator[Any]:
        if self._workers is None:
            lending = _WorkerBatches(self.dataset, self.layout, threads=max(2, self.threads // self.num_workers),
                                     pin=self.pin_memory, stored=self._stored, encoded=self.decode == "device")
            self._batches = _Batches()
            self._workers = DataLoader(lending, batch_sampler=self._batches, collate_fn=_unchanged,
                                       num_workers=self.num_workers, multiprocessing_context=self.multiprocessing_context,
                                       prefetch_factor=self.prefetch_factor, worker_init_fn=self.worker_init_fn,
                                       timeout=self.timeout, persistent_workers=self.persistent_workers)
        self._batches.start(self._positions(units))
        try:
            yield from self._workers
        finally:
            if not self.persistent_workers:
                self.close()

    def close(self) -> None:
        """Stop the worker processes (persistent ones included); their shared memory goes once unused."""
        self._workers = None  # the DataLoader's iterator stops its workers when it goes


def _check_decode(decode: str, device: torch.device | None, spec) -> None:
    """``Loader``'s ``decode``: ``ValueError`` saying why the states of a store of ``spec`` cannot be decoded where
    it says."""
    if decode not in ("host", "device"):
        raise ValueError(f"decode must be 'host' or 'device', got {decode!r}")
    if decode == "host":
        return
    if device is None:
        raise ValueError("decode='device' needs a device to decode on")
    why = decoding.decodable(spec)
    if why is None and device.type == "cuda" and not decoding.nvcomp_available():
        why = f"nvCOMP is not installed (pip install {decoding.NVCOMP_PACKAGES})"
    if why is not None:
        raise ValueError(f"decode='device': the states cannot be decoded on {device}: {why}")


class _Batches:
    """The batches of the pass being read, as a DataLoader's batch_sampler."""

    def __init__(self):
        self._batches: Iterator[list[int]] | None = None

    def start(self, batches: Iterator[list[int]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches if self._batches is not None else iter(())  # DataLoader asks twice: one generator


def _unchanged(value: Any) -> Any:
    return value


class _WorkerBatches(Dataset):
    """The dataset as a DataLoader worker reads it for :class:`Loader`: each batch in the Loader's layout, into
    shared memory lent to the training process (:mod:`hsdata.io.segments`)."""

    def __init__(self, dataset: BatchReads, layout: Layout, *, threads: int, pin: bool, stored: bool, encoded: bool):
        self.dataset, self.layout, self.pin, self.stored, self.encoded = dataset, layout, pin, stored, encoded
        self._pool = ProcessLocalPool(threads, "hsdata-worker-read")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, positions: list[int]) -> SharedBatch:
        built = self.dataset.start_batch(positions, self.layout, segments.take, self._pool, spread=True,
                                         stored=self.stored, encoded=self.encoded).result()
        return SharedBatch(built.stored() if self.stored else built.batch(), pin=self.pin)


def _bundles(batches: Iterator[dict[str, Any]], nbytes: int) -> Iterator[list[dict[str, Any]]]:
    """Consecutive batches (as they cross to a device, compressed) in lists of at least ``nbytes`` of decoded
    states each, the last of what is left."""
    bundle, held = [], 0
    for batch in batches:
        bundle.append(batch)
        held += sum(states.nbytes for states in (batch.get("encoded") or {}).values())
        if held >= nbytes:
            yield bundle
            bundle, held = [], 0
    if bundle:
        yield bundle
