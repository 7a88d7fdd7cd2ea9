"""A map-style EAGLE-3 dataset over a store: items, read-ahead, selections and held-out splits, and the opt-in
policy that skips samples failing verification."""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import sampling
from ..errors import CorruptDataError
from ..reader import Store, open as open_store
from .readahead import BatchReads

ON_ERROR = ("raise", "skip")
log = logging.getLogger("hsdata")


class Eagle3Dataset(BatchReads, Dataset):
    """Samples of a store as EAGLE-3 training items, truncated to ``max_length`` tokens.

    Each item: ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``aux_hidden_states`` [T, K*H] and
    ``hidden_states`` [T, H] (the final post-norm state) in the store's dtype (bf16, fp16 or fp32),
    ``attention_mask`` int64 [T] (ones), ``position_ids`` int64 [T], ``sample_id``, and with ``meta=True`` the
    sample's ``meta`` (a dict, or None); nothing is shifted (see docs/training.md). It pickles as its URL, options
    and selection, so DataLoader workers (fork, spawn or forkserver) open their own store.

    ``select``, ``filter`` and ``split`` give datasets over some of the samples (reads stay shard-aware).
    ``on_error="skip"`` leaves out a sample that fails verification instead of raising (see :meth:`skipped`).

    Reading: a batch fetched through ``__getitems__`` (a DataLoader with a batch size) is read on ``threads``
    background threads straight into the rows of one padded batch, which ``collate_eagle3`` then returns without
    copying; once told the coming order (:meth:`expect`; the samplers here do it), the process that fetches reads
    up to ``read_ahead_bytes`` of the next batches ahead. In the training process those batches lie in recycled
    memory, pinned where CUDA is present (``pin_memory=None``; ``False`` turns it off); in a DataLoader worker, in
    shared memory. :class:`hsdata.torch.Loader` does all of it and more for a whole training loop.
    """

    def __init__(self, store: Store | str, *, max_length: int | None = None, storage_options: dict | None = None,
                 verify: bool = True, read_ahead_bytes: int = 512 << 20, on_error: str = "raise",
                 meta: bool = False, threads: int | None = None, pin_memory: bool | None = None, **open_options):
        """``open_options``: more arguments of :func:`hsdata.open` (``concurrency``, ``range_bytes``,
        ``cache_dir``, ``cache_max_bytes``) for a store given by URL, here and in each worker. ``threads``: the
        read threads (default: the cores, at most 16, shared among the node's ranks, at least 4)."""
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        self._url = store.url if isinstance(store, Store) else store
        self._open_options = {"storage_options": storage_options, "verify": verify, **open_options}
        self._store = store if isinstance(store, Store) else open_store(store, **self._open_options)
        if not self._store.dequantize and self._store.spec.tensor("hidden_states").quantized:
            raise ValueError(f"{self._url} is an fp8 store opened with dequantize=False: Eagle3Dataset reads fp8 "
                             "states as bfloat16 (open it with dequantize=True)")
        self._store_size = len(self._store)
        self.max_length, self.on_error, self.meta = max_length, on_error, meta
        self._init_reads(read_ahead_bytes, threads, pin_memory)
        self._select(np.arange(len(self._store), dtype=np.int64))

    def _select(self, indices: np.ndarray) -> None:
        """Make this dataset's items the store's samples at ``indices``, in that order."""
        self.indices = indices
        stored = self.store.lengths[indices]
        self.lengths = stored if self.max_length is None else stored.clip(max=self.max_length)
        self._sample_nbytes = stored * self.store.spec.token_nbytes
        self._storage: np.ndarray | None = None
        self._ahead, self._announced = None, None
        self._skipped: dict[str, str] = {}
        self._logged: set[tuple[str, int]] = set()

    @property
    def store(self) -> Store:
        if self._store is None:
            store = open_store(self._url, **self._open_options)
            if len(store) != self._store_size:
                raise CorruptDataError(f"{self._url} holds {len(store)} samples now, {self._store_size} when this "
                                       "dataset was made: positions would not name the same samples; make the "
                                       "dataset again once writers are done")
            self._store = store
        return self._store

    @property
    def spec(self):
        return self.store.spec

    def __getstate__(self) -> dict:  # the thread pool pickles without its threads
        return {**self.__dict__, "_store": None, "_ahead": None, "_announced": None, "_buffers": None}

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def sample_ids(self) -> list[str]:
        return self.store.sample_ids.take(self.indices)

    # selections: datasets over some of this one's samples, sharing its open store

    def select(self, positions: Iterable[int] | None = None, *, sample_ids: Iterable[str] | None = None,
               ) -> Eagle3Dataset:
        """The samples at ``positions`` of this dataset, or those named by ``sample_ids``, in the order given."""
        if (positions is None) == (sample_ids is None):
            raise ValueError("select takes positions or sample_ids, one of them")
        if sample_ids is not None:
            sample_ids = list(sample_ids)
            found = self.store.indices(sample_ids)  # KeyError names ids the store lacks
            rank = np.full(len(self.store), -1, dtype=np.int64)
            rank[self.indices] = np.arange(len(self))
            positions = rank[found]
            if (positions < 0).any():
                missing = [sample_ids[k] for k in np.flatnonzero(positions < 0)[:3].tolist()]
                raise KeyError(f"{int((positions < 0).sum())} ids are not in this dataset, e.g. {missing}")
        chosen = np.asarray(list(positions), dtype=np.int64)
        if chosen.ndim != 1 or ((chosen < 0) | (chosen >= len(self))).any():
            raise IndexError(f"positions must lie in [0, {len(self)}) of this dataset")
        if len(np.unique(chosen)) != len(chosen):
            raise ValueError("positions repeat a sample; to draw samples more often, weight a Mixture")
        return self._view(self.indices[chosen])

    def filter(self, predicate: Callable[[dict[str, Any]], bool]) -> Eagle3Dataset:
        """The samples for which ``predicate(row)`` is true; ``row`` holds the manifest's ``sample_id``,
        ``length`` (tokens stored, before ``max_length``) and ``meta`` (a dict, or None)."""
        store, lengths = self.store, self.store.lengths
        ids = store.sample_ids.take(self.indices)
        keep = [j for j, sample_id in zip(self.indices.tolist(), ids)
                if predicate({"sample_id": sample_id, "length": int(lengths[j]), "meta": store.meta(j)})]
        return self._view(np.asarray(keep, dtype=np.int64))

    def split(self, held_out: float, *, seed: int = 0) -> tuple[Eagle3Dataset, Eagle3Dataset]:
        """``(train, held_out)``: about a ``held_out`` fraction of the samples, chosen by a seeded hash of each
        id, so a sample stays on its side when the store grows."""
        out = sampling.held_out(self.sample_ids, held_out, seed=seed)
        return self._view(self.indices[~out]), self._view(self.indices[out])

    def _view(self, indices: np.ndarray) -> Eagle3Dataset:
        view = copy.copy(self)  # through __getstate__: share this process's open store explicitly
        view._store = self._store
        view._select(indices)
        return view

    # orders, for the samplers

    def storage_order(self) -> np.ndarray:
        """This dataset's positions in the order their bytes lie in the store."""
        if self._storage is None:
            rank = np.empty(len(self.store), dtype=np.int64)
            rank[self.store.storage_order()] = np.arange(len(self.store))
            self._storage = np.argsort(rank[self.indices], kind="stable")
        return self._storage

    def epoch_order(self, *, shuffle: bool, seed: int, epoch: int, block_size: int, window: int) -> np.ndarray:
        """Every position once, in the epoch's order (:func:`hsdata.sampling.shard_aware_order`)."""
        if not shuffle:
            return self.storage_order()
        return sampling.shard_aware_order(self.storage_order(), seed=seed, epoch=epoch, block_size=block_size,
                                          window=window)

    # reading (the rest: readahead.BatchReads)

    def skipped(self) -> dict[str, str]:
        """Samples this process left out (``on_error="skip"``): id -> why. Each DataLoader worker keeps its own."""
        return dict(self._skipped)

    def _locate(self, positions: list[int]) -> list[tuple[Eagle3Dataset, int]]:
        """Each position's dataset (this one) and store index."""
        for i in positions:
            if not -len(self) <= i < len(self):
                raise IndexError(f"position {i} out of range for a dataset of {len(self)} samples")
        return [(self, j) for j in self.indices[positions].tolist()]

    def _sample_bytes(self, j: int) -> int:
        """Bytes of store sample ``j``'s tensors."""
        return int(self.store.lengths[j]) * self.store.spec.token_nbytes

    def _skips_corrupt(self, positions: list[int]) -> bool:
        return self.on_error == "skip"

    def _loss_mask(self, sample: dict[str, Any]) -> torch.Tensor:
        mask = sample["loss_mask"]
        if mask is None:
            raise ValueError(f"sample {sample['sample_id']!r} has no loss mask; add it with hsdata.add_loss_masks")
        return mask

    def _items(self, positions: list[int]) -> list[dict[str, Any]]:
        """The items at ``positions`` read one by one, a sample failing verification replaced (``on_error``)."""
        indices = [j for _, j in self._locate(positions)]
        try:
            read = list(zip(indices, self.store.read_many(indices)))
        except CorruptDataError:
            if self.on_error == "raise":
                raise
            read = [self._read_or_replace(p) for p in positions]
        return [self._item(j, sample) for j, sample in read]

    def _read_or_replace(self, position: int) -> tuple[int, dict[str, Any]]:
        """Sample ``position`` (its store index and contents), or if it fails verification, the next sample in
        storage order that reads."""
        storage = self.storage_order()
        start = int(np.flatnonzero(storage == position % len(self))[0])
        for step in range(len(storage)):
            j = int(self.indices[storage[(start + step) % len(storage)]])
            sample_id = self.store.sample_ids[j]
            if sample_id in self._skipped:
                continue
            try:
                return j, self.store.read(j)
            except CorruptDataError as e:
                self._skip(j, sample_id, e)
        raise CorruptDataError(f"every sample of this dataset of {self._url} fails verification; "
                               f"run `hsdata validate {self._url}`")

    def _skip(self, j: int, sample_id: str, error: CorruptDataError) -> None:
        self._skipped[sample_id] = str(error)
        part, offset, _ = self.store.location(j)
        shard = (part, offset // self.store.spec.shard_tokens)
        if shard not in self._logged:
            self._logged.add(shard)
            log.warning("hsdata: skipping sample %r, it fails verification: %s. Later failures in part %s, shard "
                        "%d are not logged; Eagle3Dataset.skipped() lists them all", sample_id, error, *shard)

    def _item(self, j: int, sample: dict[str, Any]) -> dict[str, Any]:
        n = len(sample["input_ids"]) if self.max_length is None else min(self.max_length, len(sample["input_ids"]))
        mask = self._loss_mask(sample)
        item = {
            "sample_id": sample["sample_id"],
            "input_ids": sample["input_ids"][:n],
            "loss_mask": mask[:n].to(torch.int64),
            "aux_hidden_states": sample["aux_hidden_states"][:n],
            "hidden_states": sample["hidden_states"][:n],
            "attention_mask": torch.ones(n, dtype=torch.int64),
            "position_ids": torch.arange(n, dtype=torch.int64),
        }
        if self.meta:
            item["meta"] = self.store.meta(j)
        return item
