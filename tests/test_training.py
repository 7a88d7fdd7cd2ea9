"""Training the way it is done: resume loops (by hand and through torchdata's StatefulDataLoader, with workers),
selections, held-out splits and mixtures of stores under the samplers, and the opt-in skip of corrupt samples."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

import hsdata
from conftest import SPEC, assert_same, make_sample
from hsdata.layout import shard_key
from hsdata.shard import token_ranges
from hsdata.torch import Eagle3Dataset, Mixture, ShardAwareSampler, TokenBudgetBatchSampler, collate_eagle3

SOURCES = ("chat", "code", "math")


def _write(path, count: int, prefix: str, start: int = 0, **spec) -> str:
    with hsdata.create(str(path), **{**SPEC, **spec}, shard_tokens=512, chunk_tokens=16) as w:
        for i in range(start, start + count):
            w.add(f"{prefix}{i:04d}", **make_sample(4 + (i * 29) % 60, seed=i),
                  meta={"source": SOURCES[i % 3], "turns": 1 + i % 4})
    return str(path)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("training") / "store", 60, "s")


@pytest.fixture(scope="module")
def second_url(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("training") / "second", 10, "b")


# resume by hand


def test_the_usual_resume_loop_neither_repeats_nor_skips(store_url):
    dataset = Eagle3Dataset(store_url)
    sampler = ShardAwareSampler(dataset, seed=3)
    sampler.set_epoch(1)
    it = iter(sampler)
    first = [next(it) for _ in range(25)]
    state = sampler.state_dict(consumed=25)
    assert (state["epoch"], state["consumed"], state["units"]) == (1, 25, 60)

    resumed = ShardAwareSampler(Eagle3Dataset(store_url), seed=3)
    resumed.load_state_dict(state)
    seen = {}
    for epoch in range(state["epoch"], 3):
        resumed.set_epoch(epoch)  # the same epoch as the state's: its position is kept
        seen[epoch] = list(resumed)
    assert sorted(first + seen[1]) == list(range(60)) and len(seen[1]) == 35
    assert sorted(seen[2]) == list(range(60))  # the next epoch is whole


def test_consumed_out_of_range_and_states_of_another_order_are_refused(store_url, second_url):
    sampler = ShardAwareSampler(Eagle3Dataset(store_url), world_size=2, rank=0)
    with pytest.raises(ValueError, match="consumed=31, but this rank's pass of epoch 0 holds 30 samples"):
        sampler.state_dict(consumed=31)
    with pytest.raises(ValueError, match="consumed=-1"):
        sampler.state_dict(consumed=-1)
    done = sampler.state_dict(consumed=30)  # a finished epoch is the next one's start
    assert (done["epoch"], done["consumed"]) == (1, 0)
    state = sampler.state_dict(consumed=10)
    with pytest.raises(ValueError, match="consumed 60 of an epoch of 60 samples"):
        sampler.load_state_dict({**state, "consumed": 60})
    with pytest.raises(ValueError, match="an epoch of 60 samples; with this dataset and these options an epoch has 10"):
        ShardAwareSampler(Eagle3Dataset(second_url)).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch -1"):
        sampler.load_state_dict({**state, "epoch": -1})
    budget = TokenBudgetBatchSampler(Eagle3Dataset(store_url), max_tokens=200)
    with pytest.raises(ValueError, match="batches"):
        budget.state_dict(consumed=len(budget) + 1)


def test_a_version_1_state_still_loads(store_url):
    sampler = ShardAwareSampler(Eagle3Dataset(store_url), seed=0)
    sampler.load_state_dict({"version": 1, "kind": "ShardAwareSampler", "epoch": 2, "seed": 0, "shuffle": True,
                             "block_size": 64, "window": 16, "consumed": 50})
    sampler.set_epoch(2)
    assert len(list(sampler)) == 10


# resume through torchdata's StatefulDataLoader


def _loader(url: str, batch_sampler: bool, workers: int, state: dict | None = None):
    dataset = Eagle3Dataset(url, max_length=32)
    if batch_sampler:
        sampler = TokenBudgetBatchSampler(dataset, max_tokens=120, seed=7, sort_window=16)
        loader = StatefulDataLoader(dataset, batch_sampler=sampler, collate_fn=collate_eagle3, num_workers=workers)
    else:
        sampler = ShardAwareSampler(dataset, seed=7)
        loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=collate_eagle3,
                                    num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    return sampler, loader


@pytest.mark.parametrize("batch_sampler", [False, True], ids=["batch_size", "token_budget"])
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_an_interrupted_epoch_exactly(store_url, tmp_path, batch_sampler, workers):
    sampler, loader = _loader(store_url, batch_sampler, workers)
    sampler.set_epoch(2)
    before = []
    for step, batch in enumerate(loader):
        before += batch["sample_id"]
        if step == 4:
            torch.save(loader.state_dict(), tmp_path / "state.pt")  # a checkpoint, then the job dies
            break
    del loader
    sampler, loader = _loader(store_url, batch_sampler, workers, torch.load(tmp_path / "state.pt"))
    sampler.set_epoch(2)
    after = [sample_id for batch in loader for sample_id in batch["sample_id"]]
    assert len(before) + len(after) == 60
    assert sorted(before + after) == [f"s{i:04d}" for i in range(60)]
    sampler.set_epoch(3)
    assert len([s for batch in loader for s in batch["sample_id"]]) == 60  # the next epoch is whole again


# selections, splits, mixtures


def test_select_filter_and_split_are_shard_aware_views(store_url):
    dataset = Eagle3Dataset(store_url, meta=True)
    by_id = dataset.select(sample_ids=["s0007", "s0003"])
    assert by_id.sample_ids == ["s0007", "s0003"] and by_id[0]["sample_id"] == "s0007"
    assert by_id[1]["meta"] == {"source": "chat", "turns": 4}
    code = dataset.filter(lambda row: row["meta"]["source"] == "code" and row["length"] >= 20)
    expected = [f"s{i:04d}" for i in range(60) if i % 3 == 1 and 4 + (i * 29) % 60 >= 20]
    assert sorted(code.sample_ids) == expected and len(code) < 20
    store = hsdata.open(store_url)
    for i in range(len(code)):
        item, stored = code[i], store.get(code.sample_ids[i])
        assert item["sample_id"] == code.sample_ids[i]
        assert_same(item, {**{k: stored[k] for k in ("input_ids", "aux_hidden_states", "hidden_states")},
                           "loss_mask": stored["loss_mask"].to(torch.int64)})
    sampler = ShardAwareSampler(code, seed=1)
    assert sorted(list(sampler)) == list(range(len(code)))  # positions of the view, each once
    train, held = dataset.split(0.25, seed=5)
    assert len(train) + len(held) == 60 and not set(train.sample_ids) & set(held.sample_ids)
    assert 5 <= len(held) <= 25
    with pytest.raises(KeyError, match="not in this dataset"):
        code.select(sample_ids=["s0000"])
    with pytest.raises(ValueError, match="repeat a sample"):
        dataset.select([1, 1])
    with pytest.raises(IndexError):
        dataset.select([60])


def test_a_split_keeps_each_sample_on_its_side_when_the_store_grows(tmp_path):
    url = _write(tmp_path / "growing", 40, "g")
    train, held = Eagle3Dataset(url).split(0.3, seed=11)
    _write(tmp_path / "growing", 40, "g", start=40)  # a second writer joins and adds 40 more
    train2, held2 = Eagle3Dataset(url).split(0.3, seed=11)
    assert set(held.sample_ids) <= set(held2.sample_ids) and set(train.sample_ids) <= set(train2.sample_ids)
    assert set(held2.sample_ids) != set(Eagle3Dataset(url).split(0.3, seed=12)[1].sample_ids)


def test_views_reach_dataloader_workers_with_their_selection(store_url):
    code = Eagle3Dataset(store_url).filter(lambda row: row["meta"]["source"] == "code")
    loader = DataLoader(code, batch_size=3, sampler=ShardAwareSampler(code), collate_fn=collate_eagle3,
                        num_workers=2, multiprocessing_context="fork")
    seen = [s for batch in loader for s in batch["sample_id"]]
    assert sorted(seen) == sorted(code.sample_ids)


def test_mixture_draws_each_store_by_weight_deterministically(store_url, second_url):
    a, b = Eagle3Dataset(store_url), Eagle3Dataset(second_url)
    mixture = Mixture([a, b], weights=[0.5, 0.5], samples_per_epoch=40)  # 20 of 60 from a, 20 of 10 from b
    assert mixture.counts.tolist() == [20, 20] and len(mixture) == 70
    orders = {}
    for epoch in range(3):
        sampler = ShardAwareSampler(mixture, seed=2)
        sampler.set_epoch(epoch)
        orders[epoch] = list(sampler)
        assert len(orders[epoch]) == 40 and sum(i < 60 for i in orders[epoch]) == 20
    again = ShardAwareSampler(mixture, seed=2)
    again.set_epoch(1)
    assert list(again) == orders[1]
    from_a = [i for e in range(3) for i in orders[e] if i < 60]
    assert sorted(from_a) == list(range(60))  # three epochs of 20 cover the 60 samples of a once
    from_b = [i - 60 for i in orders[0] if i >= 60]
    assert sorted(from_b) == sorted(list(range(10)) * 2)  # b is drawn twice per epoch: every sample twice
    store_a, store_b = hsdata.open(store_url), hsdata.open(second_url)
    batch = mixture.__getitems__([3, 65, 4])
    assert [item["sample_id"] for item in batch] == [store_a.sample_ids[3], store_b.sample_ids[5],
                                                     store_a.sample_ids[4]]
    assert_same({k: batch[1][k] for k in ("input_ids", "hidden_states")},
                {k: store_b.get(batch[1]["sample_id"])[k] for k in ("input_ids", "hidden_states")})
    ranks = [ShardAwareSampler(mixture, seed=2, rank=r, world_size=3) for r in range(3)]
    taken = []
    for s in ranks:
        s.set_epoch(0)
        taken += list(s)
    assert sorted(taken) == sorted(orders[0] + orders[0][:2])  # 40 over 3 ranks: two repeated to even out
    loader = DataLoader(mixture, batch_size=8, sampler=ShardAwareSampler(mixture, seed=2),
                        collate_fn=collate_eagle3, num_workers=0)
    assert sum(len(batch["sample_id"]) for batch in loader) == 40


def test_a_mixture_resumes_mid_epoch(store_url, second_url):
    def mixture():
        return Mixture([Eagle3Dataset(store_url), Eagle3Dataset(second_url)], weights=[3, 1])
    full = ShardAwareSampler(mixture(), seed=9)
    full.set_epoch(4)
    expected = list(full)
    first = ShardAwareSampler(mixture(), seed=9)
    first.set_epoch(4)
    it = iter(first)
    head = [next(it) for _ in range(17)]
    resumed = ShardAwareSampler(mixture(), seed=9)
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(4)
    assert head + list(resumed) == expected


def test_a_mixture_resumes_through_a_stateful_dataloader_with_workers(store_url, second_url, tmp_path):
    def make():
        mixture = Mixture([Eagle3Dataset(store_url), Eagle3Dataset(second_url)], weights=[1, 1],
                          samples_per_epoch=30)
        sampler = ShardAwareSampler(mixture, seed=4)
        return sampler, StatefulDataLoader(mixture, batch_size=4, sampler=sampler, collate_fn=collate_eagle3,
                                           num_workers=2)
    sampler, loader = make()
    expected = sorted(ShardAwareSampler(loader.dataset, seed=4).epoch_order().tolist())
    before = []
    for step, batch in enumerate(loader):
        before += batch["sample_id"]
        if step == 3:
            state = loader.state_dict()
            break
    sampler, loader = make()
    loader.load_state_dict(state)
    after = [s for batch in loader for s in batch["sample_id"]]
    ids = hsdata.open(store_url).sample_ids + hsdata.open(second_url).sample_ids
    assert sorted(before + after) == sorted(ids[i] for i in expected)  # the epoch's draws, each exactly once


def test_mixtures_need_one_spec_and_torch_wrappers_get_a_clear_error(store_url, tmp_path):
    other = _write(tmp_path / "other", 4, "o", aux_layers=[0, 1, 2])
    with pytest.raises(ValueError, match=r"aux_layers \(\(0, 1, 2\) vs .*one spec"):
        Mixture([Eagle3Dataset(store_url), Eagle3Dataset(other)])
    dataset = Eagle3Dataset(store_url)
    with pytest.raises(TypeError, match=r"got Subset: for a subset use Eagle3Dataset.select"):
        ShardAwareSampler(Subset(dataset, [1, 2]))
    with pytest.raises(TypeError, match=r"got ConcatDataset.*Mixture"):
        TokenBudgetBatchSampler(ConcatDataset([dataset, dataset]), max_tokens=100)
    with pytest.raises(ValueError, match="weights"):
        Mixture([dataset], weights=[-1])


# bad samples during training


def _corrupt(url: str, sample_id: str) -> None:
    store = hsdata.open(url)
    part, offset, length = store.location(store.index(sample_id))
    tensor = store.spec.tensor("hidden_states")
    r = token_ranges(store.spec, tensor, offset, length)[0]
    with open(os.path.join(url, shard_key(part, tensor, r.shard)), "r+b") as f:
        f.seek(r.file_start)
        byte = f.read(1)
        f.seek(r.file_start)
        f.write(bytes([byte[0] ^ 0x01]))


def test_skip_leaves_corrupt_samples_out_counts_them_and_logs_once_per_file(tmp_path, caplog):
    url = _write(tmp_path / "store", 30, "c")
    store = hsdata.open(url)
    bad = {"c0004", "c0005"}  # neighbours: one shard file
    for sample_id in bad:
        _corrupt(url, sample_id)
    strict = Eagle3Dataset(url)
    with pytest.raises(hsdata.CorruptDataError, match="c0004"):
        [batch for batch in DataLoader(strict, batch_size=4, collate_fn=collate_eagle3)]
    tolerant = Eagle3Dataset(url, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="hsdata"):
        batches = list(DataLoader(tolerant, batch_size=4, sampler=ShardAwareSampler(tolerant),
                                  collate_fn=collate_eagle3))
    seen = [s for batch in batches for s in batch["sample_id"]]
    assert len(seen) == 30 and not bad & set(seen)  # every batch keeps its size; the corrupt ones never appear
    assert set(tolerant.skipped()) == bad and "does not match its checksum" in tolerant.skipped()["c0004"]
    assert len([r for r in caplog.records if "skipping sample" in r.message]) == 1
    for batch in batches:
        for b, sample_id in enumerate(batch["sample_id"]):
            n = len(store.get(sample_id)["input_ids"])
            assert torch.equal(batch["hidden_states"][b, :n], store.get(sample_id)["hidden_states"])
