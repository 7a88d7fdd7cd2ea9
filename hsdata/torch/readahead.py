"""Reading batches into place, now or ahead: a batch's samples are read on background threads straight into their
rows of the batch's block, and the batches of an announced order are read ahead up to a byte budget."""

from __future__ import annotations

import collections
import itertools
import os
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
from torch.utils.data import get_worker_info

from ..errors import CorruptDataError
from ..io import pinned as pinning
from ..io import segments
from ..io.ring import Ring
from ..io.threads import ProcessLocalPool
from ..spec import HIDDEN_TENSORS
from .batches import (BatchItems, Built, Hidden, Layout, collate, encoded_name, fill_row, finish_pack, flat,
                      hidden_rows, plan, views)
from .decoding import EncodedStates

GROUP_BYTES = 8 << 20  # neighbouring samples of a batch (of one store) read together, up to about this many bytes
GROUP_ITEMS = 64
LONG_SAMPLE_BYTES = 64 << 20  # a sample past this is read on the store's I/O threads, several ranges at once


class Pending:
    """A batch being read: its plan and tensors, and the reads filling them (each a group of its samples).
    ``encoded``: the hidden states are read as their compressed chunks, to be decoded on the device."""

    def __init__(self, source, positions: list[int], layout: Layout, take: Callable, pool: ProcessLocalPool,
                 spread: bool = False, stored: bool = False, encoded: bool = False):
        self._source, self._positions, self._layout, self._take = source, positions, layout, take
        located = source._locate(positions)
        lengths = source.lengths[positions]
        self._encoded = _encoded_places(located, lengths) if encoded else None
        sizes = None if self._encoded is None else {name: int(ends[-1]) for name, ends in self._encoded.items()}
        self._plan = plan(layout, Hidden.of_spec(source.spec, stored=stored), lengths, dense=stored or encoded,
                          encoded=sizes)
        self.nbytes = self._plan.nbytes
        self._block = take(self._plan.nbytes)
        self._tensors = views(self._plan, self._block)
        if layout.pack:
            finish_pack(self._plan, self._tensors)
        groups = _groups(located, source._sample_nbytes[positions])
        self._reads: list[Future] = [pool.submit(_read_group, dataset, indices, rows, self._plan, self._tensors, spread,
                                                 self._encoded)
                                     for dataset, indices, rows in groups]

    def result(self) -> Built:
        """The batch, once read; a sample failing verification raises, or with ``on_error="skip"`` is replaced
        (the batch is then collated from its items)."""
        try:
            parts = [read.result() for read in self._reads]
        except CorruptDataError:
            self.cancel()
            if not self._source._skips_corrupt(self._positions):
                raise
            items = self._source._items(self._positions)
            return collate(self._layout, items, self._take)
        finally:
            self._reads = []
        ids = [sample_id for part_ids, _, _ in parts for sample_id in part_ids]
        metas = [meta for _, part_metas, _ in parts for meta in part_metas] if parts[0][1] is not None else None
        encoded = None
        if self._encoded is not None:
            rows = [sample for _, _, part_rows in parts for sample in part_rows]
            tensors = [(self._plan.entries[encoded_name(name)].offset,
                        [(int(a), sample[name]) for a, sample in zip(starts, rows)])
                       for name, starts in self._encoded.items()]
            encoded = dict(zip(self._encoded, EncodedStates.of_tensors(self._block, tensors)))
        return Built(self._plan, self._tensors, ids, metas, encoded)

    def cancel(self) -> None:
        for read in self._reads:
            read.cancel()


def _groups(located: list[tuple[Any, int]], nbytes: Sequence[int]) -> Iterator[tuple[Any, list[int], list[int]]]:
    """Runs of consecutive rows whose samples lie in one dataset, up to ``GROUP_BYTES`` or ``GROUP_ITEMS``:
    ``(dataset, store indices, rows)``."""
    dataset, indices, rows, size = None, [], [], 0
    for row, ((owner, index), n) in enumerate(zip(located, nbytes)):
        if rows and (owner is not dataset or size + n > GROUP_BYTES or len(rows) == GROUP_ITEMS):
            yield dataset, indices, rows
            indices, rows, size = [], [], 0
        dataset = owner
        indices.append(index)
        rows.append(row)
        size += int(n)
    if rows:
        yield dataset, indices, rows


def _encoded_places(located: list[tuple[Any, int]], lengths: Sequence[int]) -> dict[str, np.ndarray]:
    """Where each sample's compressed bytes of each hidden-state tensor start in the batch's block (and, last,
    where they end), by tensor name."""
    places = {}
    for name in HIDDEN_TENSORS:
        sizes = [sum(r.file_end - r.file_start for r in owner.store.encoded_runs(j, name, int(n)))
                 for (owner, j), n in zip(located, lengths)]
        places[name] = np.cumsum([0, *sizes])
    return places


def _read_group(dataset, indices: list[int], rows: list[int], p, tensors, spread: bool,
                encoded: dict[str, np.ndarray] | None = None) -> tuple[list[str], list | None, list]:
    """Read samples ``indices`` of ``dataset``'s store into batch rows ``rows``: the hidden states straight into
    place (``encoded``: their compressed bytes, into their places there, returned as read for the device's decoder),
    then the token tensors and padding. A group is read on this thread, unless ``spread`` (a batch read alone, not
    behind others) or it is one long sample: its ranges then go to the store's I/O threads together (read one
    after another, they would leave the disk idle or hold back the batches behind them)."""
    inline = not spread and (len(indices) > 1 or dataset._sample_bytes(indices[0]) <= LONG_SAMPLE_BYTES)
    if encoded is None:
        out, rows_read = [hidden_rows(p, tensors, b) for b in rows], None
    else:
        out = [{name: tensors[encoded_name(name)][int(ends[b]) : int(ends[b + 1])] for name, ends in encoded.items()}
               for b in rows]
        rows_read = [p.lengths[b] for b in rows]
    samples = dataset.store.read_many(indices, out=out, inline=inline, encoded=rows_read)
    flat_rows = flat(tensors)
    for b, sample in zip(rows, samples):
        fill_row(p, flat_rows, b, sample["input_ids"], dataset._loss_mask(sample))
    metas = [dataset.store.meta(j) for j in indices] if dataset.meta else None
    encoded_rows = [{name: sample[name] for name in encoded} for sample in samples] if encoded is not None else []
    return [sample["sample_id"] for sample in samples], metas, encoded_rows


class ReadAhead:
    """Batches of an announced order, started up to ``budget`` bytes ahead of the one taken; tied to one process."""

    def __init__(self, start: Callable[[list[int]], Pending], batches: Iterator[list[int]], budget: int):
        self._start, self._batches, self._budget = start, batches, budget
        self._pending: collections.deque[tuple[list[int], Pending]] = collections.deque()
        self._pending_bytes = 0
        self._pid = os.getpid()

    def next(self) -> Pending | None:
        """The next batch of the order (None once it is done), and more started behind it."""
        if self._pid != os.getpid():
            return None  # inherited through fork: the threads are not here
        self._fill()
        if not self._pending:
            return None
        _, pending = self._pending.popleft()
        self._pending_bytes -= pending.nbytes
        self._fill()
        return pending

    def take(self, positions: list[int]) -> Pending | None:
        """The batch of ``positions`` if it is the next one of the order, else None."""
        if self._pid != os.getpid():
            return None
        self._fill()
        if not self._pending or self._pending[0][0] != [int(i) for i in positions]:
            return None
        return self.next()

    def _fill(self) -> None:
        while not self._pending or self._pending_bytes < self._budget:
            positions = next(self._batches, None)
            if positions is None:
                return
            pending = self._start(positions)
            self._pending.append((positions, pending))
            self._pending_bytes += pending.nbytes

    def close(self) -> None:
        for _, pending in self._pending:
            pending.cancel()
        self._pending.clear()


class BatchReads:
    """Reading for ``Eagle3Dataset`` and ``Mixture``: items and batches read into place, ahead once the order is
    announced. A subclass gives ``_locate(positions)`` (each position's dataset and store index), ``lengths`` (after
    truncation), ``_sample_nbytes`` (stored), ``spec`` (the stores' one :class:`~hsdata.spec.StoreSpec`), ``_items``
    (items read one by one, the path that replaces corrupt samples) and ``_skips_corrupt(positions)``."""

    def _init_reads(self, read_ahead_bytes: int, threads: int | None, pin_memory: bool | None) -> None:
        if read_ahead_bytes < 0:
            raise ValueError(f"read_ahead_bytes must be >= 0, got {read_ahead_bytes}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.read_ahead_bytes, self.pin_memory = read_ahead_bytes, pin_memory
        self._pool = ProcessLocalPool(threads or default_threads(), "hsdata-read-ahead")
        self._buffers: Ring | None = None
        self._announced: tuple[int, np.ndarray, Sequence[int] | None] | None = None
        self._ahead: ReadAhead | None = None

    def _reads_state(self) -> dict:
        """What pickles of the reading state: the options and the pool (without its threads)."""
        return {"_buffers": None, "_announced": None, "_ahead": None}

    def expect(self, positions: Iterable[int], batch_sizes: Sequence[int] | None = None) -> None:
        """Announce the order of the coming reads; reading ahead starts with the first of them, in whichever
        process makes it. ``batch_sizes``: how the order is cut into batches (default: batches of the size of the
        first ``__getitems__`` call, one sample for ``__getitem__``). A read of other positions than announced
        ends the read-ahead."""
        if self._ahead is not None:
            self._ahead.close()
        self._ahead = None
        self._announced = (os.getpid(), np.fromiter(positions, dtype=np.int64), batch_sizes)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._read_items([int(i)])[0]

    def __getitems__(self, positions: list[int]) -> list[dict[str, Any]]:
        """A batch's items, read together into the rows of one padded batch, which ``collate_eagle3`` then
        returns without copying (a DataLoader with a batch size calls this)."""
        return self._read_items([int(i) for i in positions])

    def start_batch(self, positions: list[int], layout: Layout, take: Callable[[int], Any],
                    pool: ProcessLocalPool | None = None, spread: bool = False, stored: bool = False,
                    encoded: bool = False) -> Pending:
        """Start reading the batch of ``positions`` in ``layout`` into a block from ``take(nbytes)`` on ``pool``'s
        threads (default: this dataset's); ``spread``: each sample's ranges on the store's I/O threads at once
        (for a batch read alone: a DataLoader worker's); ``stored``: the states as the store holds them (an fp8
        store's fp8 rows) and end to end, unpadded (``Built.stored``; dequantized and padded later, on a GPU);
        ``encoded``: compressed states as their chunks' bytes, decoded later too."""
        return Pending(self, positions, layout, take, pool or self._pool, spread, stored, encoded)


    def _read_items(self, positions: list[int]) -> BatchItems:
        pending = self._take_ahead(positions) or self.start_batch(positions, ITEMS_LAYOUT, self._take, spread=True)
        return BatchItems(pending.result(), pin=self.pin_memory)

    def _take_ahead(self, positions: list[int]) -> Pending | None:
        if self._ahead is None and self._announced is not None and self._announced[0] == os.getpid():
            _, order, sizes = self._announced
            self._announced = None
            batches = cut(order, sizes if sizes is not None else itertools.repeat(len(positions)))
            self._ahead = ReadAhead(partial(self.start_batch, layout=ITEMS_LAYOUT, take=self._take), batches,
                                    self.read_ahead_bytes)
        if self._ahead is None:
            return None
        pending = self._ahead.take(positions)
        if pending is None:
            self._ahead.close()
            self._ahead = None
        return pending

    def _take(self, nbytes: int) -> Any:
        """Memory for a batch of items: in a DataLoader worker, shared memory lent to the training process
        (:mod:`hsdata.io.segments`); else a recycled buffer, pinned where CUDA is present (``pin_memory=None``), so
        that ``pin_memory`` copies nothing."""
        if get_worker_info() is not None:
            return segments.take(nbytes)
        if self._buffers is None:
            self._buffers = Ring(pinned=pinning.available() if self.pin_memory is None else self.pin_memory)
        return self._buffers.take(nbytes)


ITEMS_LAYOUT = Layout()


def default_threads() -> int:
    """Read threads of a process: the cores (at most 16) shared among the node's ranks, and at least 4 (reads
    wait on the disk too)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(4, min(16, os.cpu_count() or 1) // max(1, ranks))


def cut(order: np.ndarray, sizes: Iterable[int]) -> Iterator[list[int]]:
    """``order`` cut into consecutive batches of ``sizes`` (the last one shorter if the order runs out)."""
    start = 0
    for size in sizes:
        if start >= len(order):
            return
        yield order[start : start + size].tolist()
        start += size
