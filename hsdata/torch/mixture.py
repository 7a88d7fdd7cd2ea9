"""A mixture of stores: several datasets as one, each drawn a fixed number of times per epoch by weight (as
mosaicml-streaming's ``Stream``s are)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from torch.utils.data import Dataset

from .. import sampling
from .dataset import Eagle3Dataset
from .readahead import BatchReads

_SAME = ("hidden_size", "aux_layers", "dtype", "layer_convention", "final_hidden_state")


class Mixture(BatchReads, Dataset):
    """``datasets`` (over stores of one spec) as one dataset whose positions are theirs end to end.

    An epoch holds ``samples_per_epoch`` samples (default: all of every dataset), split among the datasets in
    proportion to ``weights`` (default: their sizes, i.e. each once) by largest remainder: ``counts[k]`` a dataset.
    Dataset ``k`` contributes positions ``[e * counts[k], (e + 1) * counts[k])`` of its endless stream of
    shard-aware passes in epoch ``e``, so it shows every sample before repeating one (weighted up) and different
    samples in later epochs (weighted down). The datasets' draws are interleaved uniformly at random (in
    order, one dataset after the other, without shuffle). Deterministic per (seed, epoch), like the samplers'
    orders, so it resumes and splits across ranks the same way.
    """

    def __init__(self, datasets: Sequence[Eagle3Dataset], weights: Sequence[float] | None = None, *,
                 samples_per_epoch: int | None = None):
        self.datasets = list(datasets)
        if not self.datasets or not all(isinstance(d, Eagle3Dataset) for d in self.datasets):
            raise TypeError("Mixture takes a non-empty list of Eagle3Datasets")
        _check_same_spec(self.datasets)
        sizes = [len(d) for d in self.datasets]
        if weights is not None and len(weights) != len(sizes):
            raise ValueError(f"{len(weights)} weights for {len(sizes)} datasets")
        total = sum(sizes) if samples_per_epoch is None else samples_per_epoch
        self.counts = sampling.mixture_counts(sizes if weights is None else weights, total)
        empty = [k for k, (n, c) in enumerate(zip(sizes, self.counts)) if c and not n]
        if empty:
            raise ValueError(f"datasets {empty} have no samples but a weight above 0")
        self.offsets = np.cumsum([0, *sizes])
        self.lengths = np.concatenate([d.lengths for d in self.datasets])
        self._sample_nbytes = np.concatenate([d._sample_nbytes for d in self.datasets])
        first = self.datasets[0]
        self._init_reads(first.read_ahead_bytes, first._pool.threads, first.pin_memory)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def samples_per_epoch(self) -> int:
        return int(self.counts.sum())

    def epoch_order(self, *, shuffle: bool, seed: int, epoch: int, block_size: int, window: int) -> np.ndarray:
        """The epoch's ``samples_per_epoch`` positions, in order."""
        if shuffle:
            sources = sampling.interleave(self.counts, seed=seed, epoch=epoch)
        else:
            sources = np.repeat(np.arange(len(self.counts)), self.counts)
        order = np.empty(len(sources), dtype=np.int64)
        for k, (dataset, count) in enumerate(zip(self.datasets, self.counts.tolist())):
            def one_pass(p: int, dataset=dataset, k=k) -> np.ndarray:
                return dataset.epoch_order(shuffle=shuffle, seed=sampling.source_seed(seed, k), epoch=p,
                                           block_size=block_size, window=window)
            order[sources == k] = sampling.stream_slice(one_pass, len(dataset), epoch * count, count) + self.offsets[k]
        return order

    # reading (the rest: readahead.BatchReads)

    @property
    def spec(self):
        return self.datasets[0].spec

    def __getstate__(self) -> dict:  # the thread pool pickles without its threads
        return {**self.__dict__, "_ahead": None, "_announced": None, "_buffers": None}

    def _locate(self, positions: list[int]) -> list[tuple[Eagle3Dataset, int]]:
        positions_ = np.asarray(positions, dtype=np.int64)
        sources = self._source(positions_)
        return [(self.datasets[k], int(self.datasets[k].indices[p - self.offsets[k]]))
                for k, p in zip(sources.tolist(), positions_.tolist())]

    def _skips_corrupt(self, positions: list[int]) -> bool:
        return any(self.datasets[k].on_error == "skip" for k in set(self._source(np.asarray(positions)).tolist()))

    def _items(self, positions: list[int]) -> list[dict[str, Any]]:
        """The items at ``positions`` read one by one by their datasets (which replace corrupt samples)."""
        positions_ = np.asarray(positions, dtype=np.int64)
        sources = self._source(positions_)
        items: list[Any] = [None] * len(positions)
        for k in np.unique(sources).tolist():
            places = np.flatnonzero(sources == k)
            for place, item in zip(places, self.datasets[k]._items((positions_[places] - self.offsets[k]).tolist())):
                items[place] = item
        return items

    def skipped(self) -> dict[str, str]:
        """Samples this process left out, of every dataset (``on_error="skip"``)."""
        return {sid: why for d in self.datasets for sid, why in d.skipped().items()}

    def _source(self, positions: np.ndarray) -> np.ndarray:
        if positions.ndim != 1 or ((positions < 0) | (positions >= len(self))).any():
            raise IndexError(f"positions out of range for a mixture of {len(self)} samples")
        return np.searchsorted(self.offsets, positions, side="right") - 1


def _check_same_spec(datasets: list[Eagle3Dataset]) -> None:
    """Every store's tensors mean the same: hidden size, aux layers, dtype and conventions (and model, where
    both record one)."""
    first = datasets[0].store.spec
    for d in datasets[1:]:
        spec = d.store.spec
        differ = [f for f in _SAME if getattr(spec, f) != getattr(first, f)]
        if first.model and spec.model and first.model != spec.model:
            differ.append("model")
        if differ:
            raise ValueError(f"{d.store.url} differs from {datasets[0].store.url} in "
                             + ", ".join(f"{f} ({getattr(spec, f)!r} vs {getattr(first, f)!r})" for f in differ)
                             + ": a Mixture needs stores of one spec")
