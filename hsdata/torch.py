"""PyTorch training side: a map-style EAGLE-3 dataset over a store, a shard-aware distributed sampler with exact
mid-epoch resume, and a padding collate function."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler, get_worker_info

from . import sampling
from .reader import Store, open as open_store

STATE_VERSION = 1


class Eagle3Dataset(Dataset):
    """Samples of a store as EAGLE-3 training items, truncated to ``max_length`` tokens.

    Each item: ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``aux_hidden_states`` bf16 [T, K*H],
    ``hidden_states`` bf16 [T, H], ``attention_mask`` int64 [T] (ones), ``position_ids`` int64 [T]. It pickles
    as its URL and options, so DataLoader workers (fork, spawn or forkserver) open their own store.
    """

    def __init__(self, store: Store | str, *, max_length: int | None = None, storage_options: dict | None = None,
                 verify: bool = True):
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self._store = store if isinstance(store, Store) else open_store(store, storage_options=storage_options,
                                                                        verify=verify)
        self._url, self._options, self._verify = self._store.url, storage_options, verify
        self.max_length = max_length
        self.lengths = self._store.lengths if max_length is None else self._store.lengths.clip(max=max_length)

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self._url, storage_options=self._options, verify=self._verify)
        return self._store

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = self.store.read(int(i), shared=get_worker_info() is not None)  # no copy to send it back
        n = len(sample["input_ids"]) if self.max_length is None else min(self.max_length, len(sample["input_ids"]))
        mask = sample["loss_mask"]
        if mask is None:
            raise ValueError(f"sample {sample['sample_id']!r} has no loss mask; add it with hsdata.add_loss_masks")
        return {
            "sample_id": sample["sample_id"],
            "input_ids": sample["input_ids"][:n],
            "loss_mask": mask[:n].to(torch.int64),
            "aux_hidden_states": sample["aux_hidden_states"][:n],
            "hidden_states": sample["hidden_states"][:n],
            "attention_mask": torch.ones(n, dtype=torch.int64),
            "position_ids": torch.arange(n, dtype=torch.int64),
        }


class ShardAwareSampler(Sampler[int]):
    """Deterministic per (seed, epoch), shuffled in blocks of neighbouring samples, split across DDP ranks.

    ``state_dict(consumed=k)`` (k = samples this rank's training loop used in the epoch; by default those it
    handed out) and ``load_state_dict`` resume mid-epoch exactly, also on another number of ranks.
    """

    def __init__(self, dataset: Eagle3Dataset, *, shuffle: bool = True, seed: int = 0, block_size: int = 64,
                 window: int = 16, drop_last: bool = False, rank: int | None = None, world_size: int | None = None):
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        self._storage = dataset.store.storage_order()
        self.shuffle, self.seed, self.block_size, self.window, self.drop_last = shuffle, seed, block_size, window, drop_last
        self.epoch = 0
        self._start = 0  # global position in the epoch's order where this pass begins
        self._handed_out = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._start = 0

    def epoch_order(self) -> Any:
        if not self.shuffle:
            return self._storage
        return sampling.shard_aware_order(self._storage, seed=self.seed, epoch=self.epoch,
                                          block_size=self.block_size, window=self.window)

    def __iter__(self) -> Iterator[int]:
        remaining = self.epoch_order()[self._start :]
        indices = sampling.rank_indices(remaining, rank=self.rank, world_size=self.world_size,
                                        drop_last=self.drop_last)
        self._handed_out = 0
        for index in indices:
            self._handed_out += 1
            yield int(index)

    def __len__(self) -> int:
        n = len(self._storage) - self._start
        return n // self.world_size if self.drop_last else -(-n // self.world_size)

    def state_dict(self, consumed: int | None = None) -> dict:
        """The position to resume from. ``consumed``: samples this rank used since the pass began (with
        DataLoader prefetching, the sampler hands out more than the loop has used)."""
        used = self._handed_out if consumed is None else consumed
        return {"version": STATE_VERSION, "seed": self.seed, "epoch": self.epoch, "shuffle": self.shuffle,
                "block_size": self.block_size, "window": self.window,
                "consumed": self._start + used * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Unsupported sampler state version {state.get('version')!r}. Expected {STATE_VERSION}.")
        for key in ("seed", "shuffle", "block_size", "window"):
            setattr(self, key, state[key])
        self.epoch = state["epoch"]
        self._start = min(state["consumed"], len(self._storage))
        self._handed_out = 0


def collate_eagle3(items: list[dict[str, Any]], *, pad_to_multiple_of: int = 1) -> dict[str, Any]:
    """Pad every per-token tensor to the batch's longest sample (rounded up to ``pad_to_multiple_of``)."""
    longest = max(len(item["input_ids"]) for item in items)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, Any] = {"sample_id": [item["sample_id"] for item in items]}
    for name in ("input_ids", "loss_mask", "attention_mask", "position_ids", "aux_hidden_states", "hidden_states"):
        first = items[0][name]
        out = first.new_zeros((len(items), width, *first.shape[1:]))
        for b, item in enumerate(items):
            out[b, : len(item[name])] = item[name]
        batch[name] = out
    return batch
