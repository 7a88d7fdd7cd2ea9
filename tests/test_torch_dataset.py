"""The training side: shard-aware order, rank split, exact (elastic) resume, DataLoader workers, collate."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import hsdata
from conftest import SPEC, assert_same, make_sample
from hsdata import sampling
from hsdata.torch import Eagle3Dataset, ShardAwareSampler, TokenBudgetBatchSampler, collate_eagle3, pack_eagle3

LENGTHS = [5 + (i * 37) % 90 for i in range(200)]


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "store"
    with hsdata.create(str(path), **SPEC, shard_tokens=1024, chunk_tokens=16) as w:
        for i, n in enumerate(LENGTHS):
            w.add(f"s{i:04d}", **make_sample(n, seed=i))
    return str(path)


def test_order_is_a_deterministic_local_shuffle():
    storage = np.arange(64 * 16 * 10)  # ten windows of 16 blocks of 64 samples
    a = sampling.shard_aware_order(storage, seed=1, epoch=0, block_size=64, window=16)
    assert sorted(a.tolist()) == storage.tolist()
    assert np.array_equal(a, sampling.shard_aware_order(storage, seed=1, epoch=0, block_size=64, window=16))
    assert not np.array_equal(a, sampling.shard_aware_order(storage, seed=1, epoch=1, block_size=64, window=16))
    # well mixed inside a window, unlike storage order (1.0); a uniform permutation keeps ~2/n
    assert sampling.adjacency_kept(storage, a) < 0.01
    window_of = {s: k // (64 * 16) for k, s in enumerate(a)}  # every sample stays inside its window of blocks
    blocks_per_window = [len({s // 64 for s, w in window_of.items() if w == k}) for k in range(3)]
    assert blocks_per_window == [16, 16, 16]


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_cover_the_epoch_once_with_equal_counts(world_size, drop_last):
    order = sampling.shard_aware_order(np.arange(101), seed=0, epoch=0, block_size=4, window=3)
    shares = [sampling.rank_indices(order, rank=r, world_size=world_size, drop_last=drop_last)
              for r in range(world_size)]
    assert len({len(s) for s in shares}) == 1
    taken = np.concatenate(shares)
    if drop_last:
        assert len(set(taken.tolist())) == len(taken) == 101 - 101 % world_size
    else:
        assert set(taken.tolist()) == set(range(101)) and len(taken) == -(-101 // world_size) * world_size


def test_resume_mid_epoch_on_another_world_size(store_url):
    dataset = Eagle3Dataset(store_url)
    full = ShardAwareSampler(dataset, seed=5, rank=0, world_size=1)
    full.set_epoch(3)
    expected = list(full)
    two = [ShardAwareSampler(dataset, seed=5, rank=r, world_size=2) for r in range(2)]
    seen = []
    for sampler in two:
        sampler.set_epoch(3)
        it = iter(sampler)
        seen.append([next(it) for _ in range(30)])
    state = two[0].state_dict()
    assert state["consumed"] == 60
    assert sorted(seen[0] + seen[1]) == sorted(expected[:60])
    three = [ShardAwareSampler(dataset, rank=r, world_size=3) for r in range(3)]
    rest = []
    for sampler in three:
        sampler.load_state_dict(state)
        rest += list(sampler)
    assert sorted(set(rest)) == sorted(expected[60:])  # 140 left: 47 each, one repeated to even out
    assert len(rest) == 141 and len(set(rest)) == 140


def _ddp_worker(rank: int, world_size: int, init_file: str, store_url: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    sampler = ShardAwareSampler(Eagle3Dataset(store_url), seed=11, drop_last=True)
    sampler.set_epoch(2)
    mine = list(sampler)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        np.save(out, np.array([x for part in gathered for x in part]))
    dist.destroy_process_group()


def test_two_process_gloo_ranks_cover_the_epoch_exactly_once(store_url, tmp_path):
    out = str(tmp_path / "taken.npy")
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "init"), store_url, out), nprocs=2, join=True,
                       start_method="spawn")
    taken = np.load(out)
    assert len(taken) == len(set(taken.tolist())) == len(LENGTHS)  # 200 samples, 2 ranks: nothing dropped


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_return_what_the_store_holds(store_url, start_method):
    dataset = Eagle3Dataset(store_url, max_length=40)
    sampler = ShardAwareSampler(dataset, seed=1, rank=0, world_size=1)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=collate_eagle3, num_workers=2,
                        multiprocessing_context=start_method)
    store = hsdata.open(store_url)
    seen = []
    # The whole epoch: a spawn worker left with batches in flight (a `break`) can abort as it exits, inside
    # torch's queue feeder thread (docs/training.md), which pytest reports as a failure of this test.
    for batch in loader:
        for b, sample_id in enumerate(batch["sample_id"]):
            original = store.get(sample_id)
            n = min(40, len(original["input_ids"]))
            assert_same({k: v[b, :n] for k, v in batch.items() if k in ("input_ids", "aux_hidden_states",
                                                                         "hidden_states")},
                        {k: original[k][:n] for k in ("input_ids", "aux_hidden_states", "hidden_states")})
            assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
            seen.append(sample_id)
    assert sorted(seen) == sorted(f"s{i:04d}" for i in range(len(LENGTHS)))


def test_item_and_collate_shapes(store_url):
    dataset = Eagle3Dataset(store_url, max_length=50)
    items = [dataset[i] for i in (0, 1, 2)]
    assert [len(it["input_ids"]) for it in items] == [min(50, n) for n in LENGTHS[:3]]
    assert items[1]["position_ids"].tolist() == list(range(len(items[1]["input_ids"])))
    batch = collate_eagle3(items, pad_to_multiple_of=16)
    width = -(-max(min(50, n) for n in LENGTHS[:3]) // 16) * 16
    assert batch["input_ids"].shape == (3, width) and batch["aux_hidden_states"].shape == (3, width, 3 * 32)
    assert batch["hidden_states"].dtype == torch.bfloat16 and batch["loss_mask"].dtype == torch.int64
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        Eagle3Dataset(dataset.store, max_length=0)


def test_token_budget_batches_fit_the_budget_and_cover_the_order_once():
    lengths = np.random.default_rng(3).integers(1, 120, 500)
    order = sampling.shard_aware_order(np.arange(500), seed=2, epoch=0, block_size=8, window=4)
    for padded in (True, False):
        batches = sampling.token_budget_batches(order, lengths, max_tokens=300, padded=padded, sort_window=64,
                                                seed=2, epoch=0)
        assert sorted(np.concatenate(batches).tolist()) == list(range(500))
        costs = [len(b) * lengths[b].max() if padded else lengths[b].sum() for b in batches]
        assert max(costs) <= 300
        # grouped by length: far less padding than batches of the same sizes in plain order would have
        if padded:
            waste = sum(len(b) * lengths[b].max() - lengths[b].sum() for b in batches)
            assert waste < 0.2 * lengths.sum()
        again = sampling.token_budget_batches(order, lengths, max_tokens=300, padded=padded, sort_window=64,
                                              seed=2, epoch=0)
        assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    alone = sampling.token_budget_batches(np.arange(3), np.array([10, 500, 10]), max_tokens=100, padded=True,
                                          sort_window=8, seed=0, epoch=0)
    assert sorted(len(b) for b in alone) == [1, 2]  # the 500-token sample is a batch of its own


def test_token_budget_batch_sampler_splits_batches_evenly_and_resumes_elastically(store_url):
    dataset = Eagle3Dataset(store_url, max_length=64)

    def sampler(rank, world_size):
        return TokenBudgetBatchSampler(dataset, max_tokens=256, seed=4, sort_window=32, rank=rank,
                                       world_size=world_size)

    full = sampler(0, 1)
    full.set_epoch(1)
    expected = list(full)
    assert sorted(i for b in expected for i in b) == list(range(len(LENGTHS)))
    assert all(len(b) * max(min(64, LENGTHS[i]) for i in b) <= 256 for b in expected)
    ranks = [sampler(r, 3) for r in range(3)]
    taken = []
    for s in ranks:
        s.set_epoch(1)
        it = iter(s)
        taken.append([next(it) for _ in range(5)])
    assert len({len(s) for s in ranks}) == 1  # every rank runs the same number of steps
    state = ranks[1].state_dict()
    assert state["consumed"] == 15 and state["kind"] == "TokenBudgetBatchSampler"
    assert sorted(map(tuple, sum(taken, []))) == sorted(map(tuple, expected[:15]))
    two = [sampler(r, 2) for r in range(2)]
    rest = []
    for s in two:
        s.load_state_dict(state)
        rest += list(s)
    assert sorted(map(tuple, rest)) == sorted(map(tuple, expected[15:]))  # an even number left: none repeated
    with pytest.raises(ValueError, match="saved by a TokenBudgetBatchSampler"):
        ShardAwareSampler(dataset).load_state_dict(state)


def test_collate_conventions_lay_out_the_same_tensors(store_url):
    dataset = Eagle3Dataset(store_url)
    items = [dataset[i] for i in (3, 4, 5)]
    n = [len(it["input_ids"]) for it in items]
    ours = collate_eagle3(items)
    spec = collate_eagle3(items, convention="specforge")
    assert set(spec) == {"input_ids", "attention_mask", "loss_mask", "hidden_state", "target"}
    assert torch.equal(spec["hidden_state"], ours["aux_hidden_states"])
    assert torch.equal(spec["target"], ours["hidden_states"])
    for b, length in enumerate(n):  # the last token predicts past the sample's end: masked
        assert spec["loss_mask"][b, length - 1] == 0
        assert torch.equal(spec["loss_mask"][b, : length - 1], items[b]["loss_mask"][: length - 1])
    mo = collate_eagle3(items, convention="modelopt")
    assert set(mo) == {"input_ids", "attention_mask", "loss_mask", "labels", "base_model_outputs"}
    assert torch.equal(mo["base_model_outputs"]["aux_hidden_states"], ours["aux_hidden_states"])
    assert torch.equal(mo["base_model_outputs"]["base_model_hidden_states"], ours["hidden_states"])
    assert mo["base_model_outputs"]["base_hidden_prenorm"] is False
    assert torch.equal(mo["loss_mask"], ours["loss_mask"])
    for b, length in enumerate(n):
        assert mo["labels"][b, : length - 1].tolist() == items[b]["input_ids"][1:].tolist()
        assert set(mo["labels"][b, length - 1 :].tolist()) == {-100}
    with pytest.raises(ValueError, match="unknown convention 'eagle'"):
        collate_eagle3(items, convention="eagle")


def test_pack_puts_samples_end_to_end_with_document_and_position_ids(store_url):
    dataset = Eagle3Dataset(store_url)
    items = [dataset[i] for i in (0, 7, 9)]
    n = [len(it["input_ids"]) for it in items]
    packed = pack_eagle3(items)
    assert packed["aux_hidden_states"].shape == (1, sum(n), 3 * 32)
    assert packed["cu_seqlens"].tolist() == [0, n[0], n[0] + n[1], sum(n)]
    assert packed["cu_seqlens"].dtype == torch.int32
    for b, (start, length) in enumerate(zip(packed["cu_seqlens"][:-1].tolist(), n)):
        rows = slice(start, start + length)
        assert packed["position_ids"][0, rows].tolist() == list(range(length))
        assert set(packed["document_ids"][0, rows].tolist()) == {b}
        assert torch.equal(packed["hidden_states"][0, rows], items[b]["hidden_states"])
        assert torch.equal(packed["loss_mask"][0, rows], items[b]["loss_mask"])


def test_read_ahead_in_process_reads_the_coming_samples_and_returns_the_right_ones(store_url):
    store = hsdata.open(store_url)
    dataset = Eagle3Dataset(store_url, read_ahead_bytes=1 << 20)
    sampler = ShardAwareSampler(dataset, seed=8)
    loader = DataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=pack_eagle3, num_workers=0)
    order = list(sampler)
    batches = iter(loader)
    first = next(batches)
    assert first["sample_id"] == [store.read(i)["sample_id"] for i in order[:3]]
    pending = [i for positions, _ in dataset._ahead._pending for i in positions]
    assert pending == order[3 : 3 + len(pending)] and len(pending) > 3  # the next batches are already coming
    for k, batch in enumerate(batches, start=1):
        for b, i in enumerate(order[3 * k : 3 * k + 3]):
            want = store.read(i)
            assert batch["sample_id"][b] == want["sample_id"]
        if k == 10:
            break
    # an index out of the announced order is read directly, and ends the read-ahead
    assert_same({"aux_hidden_states": dataset[order[0]]["aux_hidden_states"]},
                {"aux_hidden_states": store.read(order[0])["aux_hidden_states"]})
    assert dataset._ahead is None


@pytest.fixture(scope="module", params=["bfloat16", "float16", "float32"])
def typed_store(tmp_path_factory, request):
    """A store of each hidden-state dtype, with the samples written into it."""
    dtype = getattr(torch, request.param)
    path = tmp_path_factory.mktemp(f"train-{request.param}") / "store"
    samples = {f"s{i:02d}": make_sample(5 + 7 * i, seed=i, dtype=dtype) for i in range(24)}
    with hsdata.create(str(path), **SPEC, dtype=dtype, shard_tokens=256, chunk_tokens=16) as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    return str(path), dtype, samples


def test_items_collate_and_pack_keep_the_stored_dtype(typed_store):
    url, dtype, samples = typed_store
    dataset = Eagle3Dataset(url, max_length=60)
    items = [dataset[i] for i in (2, 9, 11)]
    n = [len(it["input_ids"]) for it in items]
    for item, length in zip(items, n):
        original = samples[item["sample_id"]]
        assert_same(item, {k: original[k][:length] for k in ("aux_hidden_states", "hidden_states")})
    ours = collate_eagle3(items, pad_to_multiple_of=8)
    spec = collate_eagle3(items, convention="specforge")
    mo = collate_eagle3(items, convention="modelopt")["base_model_outputs"]
    packed = pack_eagle3(items)
    for name, aux, final in [("hsdata", ours["aux_hidden_states"], ours["hidden_states"]),
                             ("specforge", spec["hidden_state"], spec["target"]),
                             ("modelopt", mo["aux_hidden_states"], mo["base_model_hidden_states"]),
                             ("packed", packed["aux_hidden_states"], packed["hidden_states"])]:
        assert aux.dtype == final.dtype == dtype, name
    for b, length in enumerate(n):
        assert_same({"h": ours["hidden_states"][b, :length]}, {"h": items[b]["hidden_states"]})
        assert not ours["hidden_states"][b, length:].any()  # zero padding in the stored dtype
        start = sum(n[:b])
        assert_same({"a": packed["aux_hidden_states"][0, start : start + length]},
                    {"a": items[b]["aux_hidden_states"]})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_batches_keep_the_stored_dtype_in_workers_and_pinned_memory(typed_store, num_workers):
    url, dtype, samples = typed_store
    dataset = Eagle3Dataset(url)
    cuda = torch.cuda.is_available()
    loader = DataLoader(dataset, batch_size=4, sampler=ShardAwareSampler(dataset, seed=3), collate_fn=collate_eagle3,
                        num_workers=num_workers, multiprocessing_context="fork" if num_workers else None,
                        pin_memory=cuda)
    seen = set()
    for batch in loader:
        assert batch["aux_hidden_states"].dtype == batch["hidden_states"].dtype == dtype
        if cuda:
            assert batch["hidden_states"].is_pinned() and batch["aux_hidden_states"].is_pinned()
            on_gpu = batch["aux_hidden_states"].cuda(non_blocking=True)
            torch.cuda.synchronize()
            assert_same({"a": on_gpu.cpu()}, {"a": batch["aux_hidden_states"]})
        for b, sample_id in enumerate(batch["sample_id"]):
            n = len(samples[sample_id]["input_ids"])
            assert_same({k: batch[k][b, :n] for k in ("aux_hidden_states", "hidden_states")},
                        {k: samples[sample_id][k] for k in ("aux_hidden_states", "hidden_states")})
            seen.add(sample_id)
    assert seen == set(samples)
