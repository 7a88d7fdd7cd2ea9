"""PyTorch training side: a map-style EAGLE-3 dataset over a store (with read-ahead), shard-aware samplers with
exact mid-epoch resume (per sample, or length-grouped batches under a token budget), and collate functions that
pad (in hsdata's, SpecForge's or ModelOpt's batch layout) or pack."""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler, get_worker_info

from . import sampling
from .pool import ProcessLocalPool
from .reader import Store, open as open_store

STATE_VERSION = 1
READ_AHEAD_THREADS = 4
GROUP_BYTES = 8 << 20  # neighbouring items read together, up to about this many bytes
GROUP_ITEMS = 64
CONVENTIONS = ("hsdata", "specforge", "modelopt")
IGNORE_INDEX = -100  # labels of positions that predict nothing (ModelOpt's IGNORE_TOKEN_ID)
_PER_TOKEN = ("input_ids", "loss_mask", "attention_mask", "position_ids", "aux_hidden_states", "hidden_states")


class Eagle3Dataset(Dataset):
    """Samples of a store as EAGLE-3 training items, truncated to ``max_length`` tokens.

    Each item: ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``aux_hidden_states`` [T, K*H] and
    ``hidden_states`` [T, H] (the final post-norm state) in the store's dtype (bf16, fp16 or fp32),
    ``attention_mask`` int64 [T] (ones), ``position_ids`` int64 [T], ``sample_id``; nothing is shifted (see
    docs/training.md). It pickles as its URL and options, so DataLoader workers (fork, spawn or forkserver) open
    their own store.

    Read-ahead: once told the coming order (:meth:`expect`; the samplers here do it), the process that fetches
    items reads up to ``read_ahead_bytes`` of the next samples on background threads. A batch fetched through
    ``__getitems__`` (a DataLoader with a batch size) is read concurrently in any case.
    """

    def __init__(self, store: Store | str, *, max_length: int | None = None, storage_options: dict | None = None,
                 verify: bool = True, read_ahead_bytes: int = 512 << 20, **open_options):
        """``open_options``: more arguments of :func:`hsdata.open` (``concurrency``, ``range_bytes``,
        ``cache_dir``, ``cache_max_bytes``) for a store given by URL, here and in each worker."""
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if read_ahead_bytes < 0:
            raise ValueError(f"read_ahead_bytes must be >= 0, got {read_ahead_bytes}")
        self._url = store.url if isinstance(store, Store) else store
        self._open_options = {"storage_options": storage_options, "verify": verify, **open_options}
        self._store = store if isinstance(store, Store) else open_store(store, **self._open_options)
        self.max_length = max_length
        self.read_ahead_bytes = read_ahead_bytes
        self.lengths = self._store.lengths if max_length is None else self._store.lengths.clip(max=max_length)
        self._sample_nbytes = self._store.lengths * self._store.spec.token_nbytes
        self._pool = ProcessLocalPool(READ_AHEAD_THREADS, "hsdata-read-ahead")
        self._ahead: _ReadAhead | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self._url, **self._open_options)
        return self._store

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None, "_ahead": None}  # the pool pickles without its threads

    def __len__(self) -> int:
        return len(self.lengths)

    def expect(self, indices: Iterable[int]) -> None:
        """Announce the order of the coming ``__getitem__`` calls; reading ahead starts with the first of them,
        in whichever process makes it. A call for another index than announced ends the read-ahead."""
        if self._ahead is not None:
            self._ahead.close()
        self._ahead = _ReadAhead(self._items, self._sample_nbytes, iter(indices), self.read_ahead_bytes, self._pool)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._ahead is not None:
            item = self._ahead.take(int(i))
            if item is not None:
                return item
            self._ahead.close()
            self._ahead = None
        return self._items([int(i)])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """A batch, its samples read concurrently (DataLoader calls this when it has a batch size)."""
        if self._ahead is None or not self._ahead.expects(indices):
            self.expect(list(indices))
        return [self[i] for i in indices]

    def _items(self, indices: list[int]) -> list[dict[str, Any]]:
        shared = get_worker_info() is not None  # read into shared memory: no copy to send it to the main process
        return [self._item(sample) for sample in self.store.read_many(indices, shared=shared)]

    def _item(self, sample: dict[str, Any]) -> dict[str, Any]:
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


class _ReadAhead:
    """Items of an announced order, read on background threads up to a byte budget; tied to one process.

    Neighbouring items in the order are read together, up to ``GROUP_BYTES`` or ``GROUP_ITEMS`` at a time (so a
    remote store can merge their ranges into fewer requests)."""

    def __init__(self, read_many, sample_nbytes: np.ndarray, indices: Iterator[int], budget: int,
                 pool: ProcessLocalPool):
        self._read_many, self._nbytes, self._indices, self._budget, self._pool = (read_many, sample_nbytes, indices,
                                                                                  budget, pool)
        self._pending: collections.deque[tuple[int, Future, int]] = collections.deque()  # item, its group, place
        self._pending_bytes = 0
        self._pid = os.getpid()

    def expects(self, indices: list[int]) -> bool:
        """Whether ``indices`` come next in the announced order (as far as it has been read ahead)."""
        if self._pid != os.getpid():
            return False
        self._fill()
        ahead = [i for i, _, _ in list(self._pending)[: len(indices)]]
        return bool(ahead) and ahead == [int(i) for i in indices[: len(ahead)]]

    def take(self, i: int) -> dict[str, Any] | None:
        """Item ``i`` if it is the next announced one, else None."""
        if self._pid != os.getpid():
            return None  # inherited through fork: the threads are not here
        self._fill()
        if not self._pending or self._pending[0][0] != i:
            return None
        _, group, place = self._pending.popleft()
        self._pending_bytes -= int(self._nbytes[i])
        self._fill()
        return group.result()[place]

    def _fill(self) -> None:
        while not self._pending or self._pending_bytes < self._budget:
            group, nbytes = [], 0
            while len(group) < GROUP_ITEMS and nbytes < GROUP_BYTES:
                i = next(self._indices, None)
                if i is None:
                    break
                group.append(int(i))
                nbytes += int(self._nbytes[int(i)])
            if not group:
                return
            future = self._pool.submit(self._read_many, group)
            self._pending.extend((i, future, place) for place, i in enumerate(group))
            self._pending_bytes += nbytes

    def close(self) -> None:
        for _, future, _ in self._pending:
            future.cancel()
        self._pending.clear()


class ShardAwareSampler(Sampler[int]):
    """Deterministic per (seed, epoch), shuffled in blocks of neighbouring samples, split across DDP ranks.

    ``state_dict(consumed=k)`` (k = samples this rank's training loop used in the epoch; by default those it
    handed out) and ``load_state_dict`` resume mid-epoch exactly, also on another number of ranks. Iterating it
    announces this rank's order to the dataset, for read-ahead.
    """

    def __init__(self, dataset: Eagle3Dataset, *, shuffle: bool = True, seed: int = 0, block_size: int = 64,
                 window: int = 16, drop_last: bool = False, rank: int | None = None, world_size: int | None = None):
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        self.dataset = dataset
        self._storage = dataset.store.storage_order()
        self.shuffle, self.seed, self.block_size, self.window, self.drop_last = shuffle, seed, block_size, window, drop_last
        self.epoch = 0
        self._start = 0  # units of the epoch (samples here, batches in subclasses) consumed before this pass
        self._handed_out = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._start = 0

    def epoch_order(self) -> np.ndarray:
        """All sample indices of the epoch in order, the same on every rank."""
        if not self.shuffle:
            return self._storage
        return sampling.shard_aware_order(self._storage, seed=self.seed, epoch=self.epoch,
                                          block_size=self.block_size, window=self.window)

    def _units(self) -> np.ndarray | list[np.ndarray]:
        """What one step of iteration yields, in epoch order: sample indices here."""
        return self.epoch_order()

    def __iter__(self) -> Iterator:
        units = self._units()[self._start :]
        positions = sampling.rank_indices(np.arange(len(units)), rank=self.rank, world_size=self.world_size,
                                          drop_last=self.drop_last)
        if isinstance(units, np.ndarray):
            mine, samples = units[positions], units[positions]
        else:
            mine = [units[p] for p in positions]
            samples = np.concatenate(mine) if mine else np.zeros(0, dtype=np.int64)
        self.dataset.expect(iter(samples))
        self._handed_out = 0
        for unit in mine:
            self._handed_out += 1
            yield unit.tolist()  # an int, or a batch's list of ints

    def __len__(self) -> int:
        n = len(self._units()) - self._start
        return n // self.world_size if self.drop_last else -(-n // self.world_size)

    def state_dict(self, consumed: int | None = None) -> dict:
        """The position to resume from. ``consumed``: units (samples; batches for a batch sampler) this rank used
        since the pass began (with DataLoader prefetching, the sampler hands out more than the loop has used)."""
        used = self._handed_out if consumed is None else consumed
        return {"version": STATE_VERSION, "kind": type(self).__name__, "epoch": self.epoch,
                **{key: getattr(self, key) for key in self._state_keys()},
                "consumed": self._start + used * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Unsupported sampler state version {state.get('version')!r}. Expected {STATE_VERSION}.")
        if state.get("kind", "ShardAwareSampler") != type(self).__name__:
            raise ValueError(f"this state was saved by a {state['kind']}, not a {type(self).__name__}")
        for key in self._state_keys():
            setattr(self, key, state[key])
        self.epoch = state["epoch"]
        self._start = min(state["consumed"], len(self._units()))
        self._handed_out = 0

    def _state_keys(self) -> tuple[str, ...]:
        return ("seed", "shuffle", "block_size", "window")


class TokenBudgetBatchSampler(ShardAwareSampler):
    """Batches of similar-length samples under a token budget, for ``DataLoader(batch_sampler=...)``.

    The epoch's shard-aware order is cut by :func:`hsdata.sampling.token_budget_batches` (the same batches on
    every rank and world size), then whole batches are split across ranks like samples are, so every rank runs
    the same number of steps. ``padded`` counts a batch as ``count * longest`` tokens (for ``collate_eagle3``),
    otherwise as the sum of its lengths (for ``pack_eagle3``). Lengths are after ``max_length`` truncation.
    """

    def __init__(self, dataset: Eagle3Dataset, *, max_tokens: int, padded: bool = True, sort_window: int = 1024,
                 **kwargs):
        if max_tokens < 1 or sort_window < 1:
            raise ValueError(f"max_tokens and sort_window must be >= 1, got {max_tokens} and {sort_window}")
        super().__init__(dataset, **kwargs)
        self.max_tokens, self.padded, self.sort_window = max_tokens, padded, sort_window
        self._lengths = dataset.lengths
        self._cache: tuple[tuple, list] | None = None

    def _units(self) -> list[np.ndarray]:
        key = (self.seed, self.epoch, self.shuffle, self.block_size, self.window, self.max_tokens, self.padded,
               self.sort_window)
        if self._cache is None or self._cache[0] != key:
            batches = sampling.token_budget_batches(self.epoch_order(), self._lengths, max_tokens=self.max_tokens,
                                                    padded=self.padded, sort_window=self.sort_window,
                                                    seed=self.seed, epoch=self.epoch)
            self._cache = (key, batches)
        return self._cache[1]

    def _state_keys(self) -> tuple[str, ...]:
        return (*super()._state_keys(), "max_tokens", "padded", "sort_window")


def collate_eagle3(items: list[dict[str, Any]], *, pad_to_multiple_of: int = 1,
                   convention: str = "hsdata") -> dict[str, Any]:
    """Right-pad every per-token tensor with zeros to the batch's longest sample (rounded up to
    ``pad_to_multiple_of``) and lay the batch out as ``convention`` expects (docs/training.md):

    - ``"hsdata"``: the item keys, batched: ``input_ids``, ``loss_mask``, ``attention_mask``, ``position_ids``
      [B, N], ``aux_hidden_states`` [B, N, K*H], ``hidden_states`` [B, N, H], ``sample_id`` (a list);
    - ``"specforge"``: SpecForge's offline batch, ``input_ids``, ``attention_mask``, ``loss_mask`` (0 at each
      sample's last token, whose target is past its end), ``hidden_state`` (aux), ``target`` (final);
    - ``"modelopt"``: ModelOpt's offline EAGLE batch, ``input_ids``, ``attention_mask``, ``loss_mask``, ``labels``
      (input ids shifted left, -100 where nothing follows) and ``base_model_outputs`` holding
      ``base_model_hidden_states``, ``aux_hidden_states`` and ``base_hidden_prenorm`` (False: stores hold the
      post-norm state).

    No convention shifts a tensor: both trainers shift inside their training step.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown convention {convention!r}; expected one of {list(CONVENTIONS)}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    lengths = [len(item["input_ids"]) for item in items]
    width = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, Any] = {"sample_id": [item["sample_id"] for item in items]}
    for name in _PER_TOKEN:
        first = items[0][name]
        out = first.new_zeros((len(items), width, *first.shape[1:]))
        for b, item in enumerate(items):
            out[b, : lengths[b]] = item[name]
        batch[name] = out
    if convention == "specforge":
        loss_mask = batch["loss_mask"]
        loss_mask[torch.arange(len(items)), torch.tensor(lengths) - 1] = 0
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "loss_mask": loss_mask,
                "hidden_state": batch["aux_hidden_states"], "target": batch["hidden_states"]}
    if convention == "modelopt":
        labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        for b, n in enumerate(lengths):
            labels[b, : n - 1] = batch["input_ids"][b, 1:n]
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                "loss_mask": batch["loss_mask"], "labels": labels,
                "base_model_outputs": {"base_model_hidden_states": batch["hidden_states"],
                                       "aux_hidden_states": batch["aux_hidden_states"],
                                       "base_hidden_prenorm": False}}
    return batch


def pack_eagle3(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Pack the items into one row with no padding, for attention that keeps documents apart.

    Per-token tensors are concatenated into [1, S] / [1, S, D] (S = total tokens); ``position_ids`` restart at 0
    in each sample, ``document_ids`` [1, S] give each token's item number, and ``cu_seqlens`` int32 [B + 1] are
    the sample boundaries (flash-attention's varlen layout). ``sample_id`` lists the items in order.
    """
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    batch: dict[str, Any] = {"sample_id": [item["sample_id"] for item in items]}
    for name in _PER_TOKEN:
        batch[name] = torch.cat([item[name] for item in items]).unsqueeze(0)
    batch["document_ids"] = torch.repeat_interleave(torch.arange(len(items)), lengths).unsqueeze(0)
    batch["cu_seqlens"] = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return batch
