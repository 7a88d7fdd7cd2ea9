"""The output buffer pool: a buffer is filled again only once no tensor (or view) refers to it."""

from __future__ import annotations

import multiprocessing

import torch

import hsdata
from conftest import assert_same, make_sample, write_store
from hsdata.io.buffers import MIN_POOLED_BYTES, BufferPool


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone():
    pool = BufferPool(64 << 20)
    first = pool.take(3 * MIN_POOLED_BYTES)
    first.fill_(7)
    view = first.view(torch.bfloat16)[:5]
    del first
    second = pool.take(3 * MIN_POOLED_BYTES)  # the first is still referenced through the view
    second.fill_(9)
    assert torch.equal(view.view(torch.uint8), torch.full((10,), 7, dtype=torch.uint8))
    pointer = view.data_ptr()
    del view
    third = pool.take(2 * MIN_POOLED_BYTES)  # smaller fits in a free one: recycled
    assert third.data_ptr() == pointer and len(third) == 2 * MIN_POOLED_BYTES


def test_idle_buffers_beyond_the_limit_are_dropped_and_small_ones_never_pooled():
    pool = BufferPool(4 * MIN_POOLED_BYTES)
    for _ in range(3):
        pool.take(3 * MIN_POOLED_BYTES)
        pool.take(3 * MIN_POOLED_BYTES + 1)  # does not fit the idle one: a new one, the idle one dropped
    assert len(pool._buffers) <= 2
    small = pool.take(100)
    assert len(small) == 100 and len(pool._buffers) <= 2


def _child_writes(pool):
    pool.take(MIN_POOLED_BYTES).numpy().fill(1)  # recycles the parent's buffer (numpy: no OpenMP after fork)


def test_a_forked_child_writing_a_pooled_buffer_leaves_the_parent_s_alone():
    pool = BufferPool(64 << 20)
    pool.take(MIN_POOLED_BYTES).numpy().fill(5)  # freed at once: idle in the pool
    child = multiprocessing.get_context("fork").Process(target=_child_writes, args=(pool,))
    child.start()
    child.join()
    assert child.exitcode == 0
    again = pool.take(MIN_POOLED_BYTES)
    assert int(again[0]) == 5 and int(again[-1]) == 5


def test_a_store_recycles_the_buffers_of_samples_no_longer_referenced(tmp_path):
    sample = make_sample(6000, seed=1)  # aux_hidden_states: 6000 * 192 bytes, pooled
    write_store(tmp_path / "store", {"big": sample})
    store = hsdata.open(str(tmp_path / "store"))
    for _ in range(4):
        assert_same(store.read(0), sample)  # dropped at once: its buffer is free for the next read
    assert len(store._buffers._buffers) == 1
    kept = [store.read(0) for _ in range(2)]
    assert len(store._buffers._buffers) == 2 and all(torch.equal(k["aux_hidden_states"].view(torch.int16),
                                                                 sample["aux_hidden_states"].view(torch.int16))
                                                     for k in kept)


class _StoreItems(torch.utils.data.Dataset):
    """A user's own dataset returning ``store[i]`` as is: pooled buffers cross to the main process."""

    def __init__(self, url: str, count: int):
        self.url, self.count, self.store = url, count, None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        if self.store is None:
            self.store = hsdata.open(self.url)
        return self.store[i]


def test_pooled_tensors_cross_dataloader_workers_intact(tmp_path):
    samples = {f"s{i}": make_sample(6000, seed=i) for i in range(4)}  # pooled: over a MiB each
    write_store(tmp_path / "store", samples)
    for context in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(_StoreItems(str(tmp_path / "store"), 4), batch_size=None,
                                             num_workers=2, multiprocessing_context=context)
        seen = [item["sample_id"] for item in loader if assert_same(item, samples[item["sample_id"]]) is None]
        assert sorted(seen) == sorted(samples), context
