"""Samplers: a deterministic shard-aware order per (seed, epoch), split across DDP ranks, with exact mid-epoch
resume; per sample, or as length-grouped batches under a token budget.

The position to resume from is (epoch, units consumed of the epoch's order), the same for every rank and world
size. ``state_dict`` / ``load_state_dict`` give and take it, which is also what ``torchdata``'s
``StatefulDataLoader`` calls: it saves the state as of the last batch the loop received.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from .. import sampling

STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)  # version 1 has no "units": its epoch length goes unchecked


class ShardAwareSampler(Sampler[int]):
    """Deterministic per (seed, epoch), shuffled in blocks of neighbouring samples, split across DDP ranks.

    ``dataset``: an :class:`Eagle3Dataset` (or a selection of one) or a :class:`Mixture`. ``state_dict()`` (by
    default counting what it handed out; ``consumed=k`` for the k units this rank's loop used) and
    ``load_state_dict`` resume mid-epoch exactly, also on another number of ranks; ``set_epoch`` with the epoch
    of a loaded state keeps its position. Iterating announces this rank's order to the dataset, for read-ahead.
    """

    def __init__(self, dataset, *, shuffle: bool = True, seed: int = 0, block_size: int = 64, window: int = 16,
                 drop_last: bool = False, rank: int | None = None, world_size: int | None = None):
        if not hasattr(dataset, "epoch_order"):
            raise TypeError(f"{type(self).__name__} needs an hsdata Eagle3Dataset or Mixture, got "
                            f"{type(dataset).__name__}: for a subset use Eagle3Dataset.select / filter / split, "
                            "for several datasets hsdata.torch.Mixture([a, b])")
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        self.dataset = dataset
        self.shuffle, self.seed, self.block_size, self.window, self.drop_last = shuffle, seed, block_size, window, drop_last
        self.epoch = 0
        self._resume_at = 0  # units of the epoch consumed before the next pass
        self._pass_start = 0  # ... before the current (or last) pass
        self._handed_out = 0  # units this rank handed out in the current pass
        self._cache: tuple[tuple, np.ndarray | list[np.ndarray]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``: from its start, or from a loaded state's position in it."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch, self._resume_at, self._pass_start, self._handed_out = epoch, 0, 0, 0

    def epoch_order(self) -> np.ndarray:
        """All sample positions of the epoch in order, the same on every rank."""
        return self.dataset.epoch_order(shuffle=self.shuffle, seed=self.seed, epoch=self.epoch,
                                        block_size=self.block_size, window=self.window)

    def _units(self) -> np.ndarray | list[np.ndarray]:
        """What one step of iteration yields, in epoch order (samples here), computed once per epoch."""
        key = (self.epoch, *(getattr(self, k) for k in self._state_keys()))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._make_units())
        return self._cache[1]

    def _make_units(self) -> np.ndarray | list[np.ndarray]:
        return self.epoch_order()

    def __iter__(self) -> Iterator:
        self._pass_start, self._handed_out = self._resume_at, 0
        units = self._units()[self._pass_start :]
        positions = sampling.rank_indices(np.arange(len(units)), rank=self.rank, world_size=self.world_size,
                                          drop_last=self.drop_last)
        if isinstance(units, np.ndarray):
            mine, samples = units[positions], units[positions]
        else:
            mine = [units[p] for p in positions]
            samples = np.concatenate(mine) if mine else np.zeros(0, dtype=np.int64)
        self.dataset.expect(iter(samples))
        for unit in mine:
            self._handed_out += 1
            yield unit.tolist()  # an int, or a batch's list of ints
        self._resume_at = 0  # the epoch is done: another pass over it starts from the beginning

    def __len__(self) -> int:
        n = len(self._units()) - self._resume_at
        return n // self.world_size if self.drop_last else -(-n // self.world_size)

    def state_dict(self, consumed: int | None = None) -> dict:
        """The position to resume from: ``epoch`` and ``consumed``, the units (samples; batches for a batch
        sampler) of the epoch's order used so far. ``consumed``: units this rank used since the current pass
        began (by default those it handed out; with DataLoader workers and a plain DataLoader, that runs ahead of
        the loop). A finished epoch is saved as the next epoch's start."""
        units = len(self._units())
        if consumed is None:
            consumed = self._handed_out
        else:
            mine = len(sampling.rank_indices(np.arange(units - self._pass_start), rank=self.rank,
                                             world_size=self.world_size, drop_last=self.drop_last))
            if not isinstance(consumed, int) or not 0 <= consumed <= mine:
                raise ValueError(f"consumed={consumed!r}, but this rank's pass of epoch {self.epoch} holds {mine} "
                                 f"{self._unit_name()}")
        position, epoch = self._pass_start + consumed * self.world_size, self.epoch
        if position >= units:
            position, epoch = 0, epoch + 1
        return {"version": STATE_VERSION, "kind": type(self).__name__, "epoch": epoch,
                **{key: getattr(self, key) for key in self._state_keys()}, "units": units, "consumed": position}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` (of any world size): the next pass continues its epoch where it stopped."""
        if state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(f"Unsupported sampler state version {state.get('version')!r}. "
                             f"Expected one of {list(READABLE_STATE_VERSIONS)}.")
        if state.get("kind", "ShardAwareSampler") != type(self).__name__:
            raise ValueError(f"this state was saved by a {state['kind']}, not a {type(self).__name__}")
        missing = [key for key in ("epoch", "consumed", *self._state_keys()) if key not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}")
        epoch, consumed = state["epoch"], state["consumed"]
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"sampler state has epoch {epoch!r} and consumed {consumed!r}: expected ints >= 0")
        for key in self._state_keys():
            setattr(self, key, state[key])
        self.epoch = epoch
        units = len(self._units())
        if "units" in state and state["units"] != units:
            raise ValueError(f"this state was saved over an epoch of {state['units']} {self._unit_name()}; with this "
                             f"dataset and these options an epoch has {units}: it is not the same order")
        if state["version"] >= 2 and consumed >= max(units, 1):
            raise ValueError(f"sampler state has consumed {consumed} of an epoch of {units} {self._unit_name()}")
        self._resume_at = self._pass_start = min(consumed, units)
        self._handed_out = 0

    def _state_keys(self) -> tuple[str, ...]:
        return ("seed", "shuffle", "block_size", "window")

    def _unit_name(self) -> str:
        return "samples"


class TokenBudgetBatchSampler(ShardAwareSampler):
    """Batches of similar-length samples under a token budget, for ``DataLoader(batch_sampler=...)``.

    The epoch's shard-aware order is cut by :func:`hsdata.sampling.token_budget_batches` (the same batches on
    every rank and world size), then whole batches are split across ranks like samples are, so every rank runs
    the same number of steps. ``padded`` counts a batch as ``count * longest`` tokens (for ``collate_eagle3``),
    otherwise as the sum of its lengths (for ``pack_eagle3``). Lengths are after ``max_length`` truncation.
    """

    def __init__(self, dataset, *, max_tokens: int, padded: bool = True, sort_window: int = 1024, **kwargs):
        if max_tokens < 1 or sort_window < 1:
            raise ValueError(f"max_tokens and sort_window must be >= 1, got {max_tokens} and {sort_window}")
        super().__init__(dataset, **kwargs)
        self.max_tokens, self.padded, self.sort_window = max_tokens, padded, sort_window
        self._lengths = dataset.lengths

    def _make_units(self) -> list[np.ndarray]:
        return sampling.token_budget_batches(self.epoch_order(), self._lengths, max_tokens=self.max_tokens,
                                             padded=self.padded, sort_window=self.sort_window, seed=self.seed,
                                             epoch=self.epoch)

    def _state_keys(self) -> tuple[str, ...]:
        return (*super()._state_keys(), "max_tokens", "padded", "sort_window")

    def _unit_name(self) -> str:
        return "batches"
