"""Writing and reading back real stores on disk: bit-exact, ragged, across shards, parts and edge cases."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
import torch

import hsdata
from conftest import SMALL_LAYOUT, SPEC, assert_same, make_sample, write_store
from hsdata import masks
from hsdata.io.storage import Storage


def test_ragged_round_trip(store_path, ragged_samples):
    write_store(store_path, ragged_samples)
    store = hsdata.open(str(store_path))
    assert len(store) == len(ragged_samples)
    assert store.sample_ids == list(ragged_samples)
    assert store.num_tokens == sum(len(s["input_ids"]) for s in ragged_samples.values())
    assert store.spec.hidden_size == SPEC["hidden_size"] and list(store.spec.aux_layers) == SPEC["aux_layers"]
    for i, (sample_id, sample) in enumerate(ragged_samples.items()):
        got = store[i]
        assert got["sample_id"] == sample_id
        assert_same(got, sample)
        assert_same(store.get(sample_id), sample)


def test_read_many_gives_what_read_gives(store_path, ragged_samples):
    write_store(store_path, ragged_samples)
    store = hsdata.open(str(store_path))
    order = [7, 0, 48, 7, -1, 21]  # repeats and a negative index too
    for i, got in zip(order, store.read_many(order)):
        assert got["sample_id"] == store.sample_ids[i]
        assert_same(got, ragged_samples[store.sample_ids[i]])
    only = store.read_many([3, 4], fields=["input_ids"])
    assert [set(s) for s in only] == [{"sample_id", "input_ids"}] * 2
    with pytest.raises(IndexError, match="out of range"):
        store.read_many([0, len(store)])


def test_sample_longer_than_a_shard(store_path):
    samples = {"small": make_sample(3, 1), "huge": make_sample(3 * 256 + 100, 2), "after": make_sample(5, 3)}
    write_store(store_path, samples)
    store = hsdata.open(str(store_path))
    for sample_id, sample in samples.items():
        assert_same(store.get(sample_id), sample)
    assert store.location(1)[1:] == (3, 3 * 256 + 100)


def test_one_token_samples_and_thousands_of_tiny_ones(store_path):
    samples = {f"t{i}": make_sample(1 + i % 3, seed=i) for i in range(3000)}
    write_store(store_path, samples, shard_tokens=1024, chunk_tokens=8)
    store = hsdata.open(str(store_path))
    assert len(store) == 3000
    for i in [0, 1, 2, 999, 1500, 2999]:
        assert_same(store[i], samples[f"t{i}"])
    assert_same(store[-1], samples["t2999"])


def test_empty_store(store_path):
    with hsdata.create(str(store_path), **SPEC):
        pass
    store = hsdata.open(str(store_path))
    assert len(store) == 0 and store.num_tokens == 0 and store.sample_ids == []
    with pytest.raises(IndexError):
        store[0]


def test_bfloat16_special_values_are_bit_exact(store_path):
    specials = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x7F7F],
                            dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # +-0, +-inf, NaNs, subnormals
    sample = make_sample(20, 0)
    sample["aux_hidden_states"].view(-1)[: len(specials)] = specials
    sample["hidden_states"].view(-1)[-len(specials) :] = specials
    write_store(store_path, {"special": sample})
    assert_same(hsdata.open(str(store_path))[0], sample)


def test_numpy_inputs_and_three_dimensional_aux(store_path):
    t = make_sample(40, 7)
    aux = t["aux_hidden_states"].view(torch.uint16).numpy().view(ml_dtypes.bfloat16).reshape(40, 3, SPEC["hidden_size"])
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        w.add("np", input_ids=t["input_ids"].numpy().astype(np.int32), loss_mask=t["loss_mask"].numpy().astype(bool),
              aux_hidden_states=aux, hidden_states=t["hidden_states"].view(torch.uint16).numpy().view(ml_dtypes.bfloat16),
              meta={"source": "numpy"})
    store = hsdata.open(str(store_path))
    assert_same(store.get("np"), t)
    assert store.manifest.column("meta").to_pylist() == ['{"source": "numpy"}']


def test_field_subsets(store_path, ragged_samples):
    write_store(store_path, ragged_samples)
    store = hsdata.open(str(store_path))
    got = store.get("sample-000008", fields=["hidden_states"])
    assert set(got) == {"sample_id", "hidden_states"}
    assert_same(got, {"hidden_states": ragged_samples["sample-000008"]["hidden_states"]})
    with pytest.raises(ValueError, match="unknown fields"):
        store.get("sample-000008", fields=["logits"])


def test_flush_commits_and_later_samples_start_a_new_shard(store_path):
    a, b = make_sample(10, 1), make_sample(10, 2)
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        w.add("a", **a)
        assert len(hsdata.open(str(store_path))) == 0  # not committed yet: the shard is still open
        w.flush()
        mid = hsdata.open(str(store_path))
        assert mid.sample_ids == ["a"]
        w.add("b", **b)
    store = hsdata.open(str(store_path))
    assert store.location(1)[1] == 256  # flushed shard 0 is closed; b opens shard 1
    assert_same(store.get("a"), a)
    assert_same(store.get("b"), b)


def test_commits_happen_at_shard_boundaries_without_flush(store_path):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        for i in range(6):
            w.add(f"s{i}", **make_sample(100, i))  # 600 tokens: shards 0 and 1 fill up
        deadline = time.monotonic() + 10
        while w.num_committed < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.num_committed == 5  # s0..s4 end by token 512; s5 lies in the open shard 2
        assert len(hsdata.open(str(store_path))) == 5
    assert len(hsdata.open(str(store_path))) == 6


def test_joining_writers_add_parts_and_resume(store_path):
    first = {f"a{i}": make_sample(30 + i, i) for i in range(5)}
    write_store(store_path, first)
    second = {f"b{i}": make_sample(20 + i, 100 + i) for i in range(5)}
    with hsdata.create(str(store_path), **SPEC) as w:  # layout taken from the store
        assert "a3" in w and "b0" not in w
        for sample_id, sample in second.items():
            w.add(sample_id, **sample)
    store = hsdata.open(str(store_path))
    assert len(store) == 10
    assert len(set(store.manifest.column("part").to_pylist())) == 2
    for sample_id, sample in {**first, **second}.items():
        assert_same(store.get(sample_id), sample)


def test_exception_in_with_block_commits_nothing_pending(store_path):
    with pytest.raises(RuntimeError, match="boom"):
        with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
            w.add("x", **make_sample(10, 0))
            raise RuntimeError("boom")
    assert len(hsdata.open(str(store_path))) == 0


def test_open_time_reads_no_payload(store_path, ragged_samples, monkeypatch):
    write_store(store_path, ragged_samples)
    opened = []
    real_open = open

    def tracking_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", tracking_open)
    hsdata.open(str(store_path))
    assert any("/manifests/" in f for f in opened)
    assert not [f for f in opened if "/c/" in f]


def test_racing_writers_adding_one_id_keep_the_first_commit(store_path):
    a, b = make_sample(10, 1), make_sample(12, 2)
    with hsdata.create(str(store_path), **SPEC) as first, hsdata.create(str(store_path), **SPEC) as second:
        first.add("same", **a)
        first.flush()
        second.add("same", **b)  # joined before the first commit, so it cannot know: both commit
    with pytest.warns(UserWarning, match="1 duplicate sample rows ignored"):
        store = hsdata.open(str(store_path))
    assert store.sample_ids == ["same"]
    assert store.location(0)[0] == first.part
    assert_same(store[0], a)


def test_samples_without_a_loss_mask(store_path):
    sample = make_sample(40, 3)
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        w.add("no-mask", **{**sample, "loss_mask": None})
        w.add("mask", **sample)
    store = hsdata.open(str(store_path))
    got = store.get("no-mask")
    assert got["loss_mask"] is None
    assert_same(got, {k: v for k, v in sample.items() if k != "loss_mask"})
    assert_same(store.get("mask"), sample)
    assert set(store.get("no-mask", fields=["loss_mask", "input_ids"])) == {"sample_id", "loss_mask", "input_ids"}
    from hsdata.validate import validate

    assert validate(str(store_path)).ok


def test_loss_masks_added_later_fill_in_samples_written_without(store_path):
    a, b = make_sample(30, 1), make_sample(12, 2)
    with hsdata.create(str(store_path), **SPEC) as w:
        w.add("a", **{**a, "loss_mask": None})
        w.add("b", **{**b, "loss_mask": None})
    assert hsdata.open(str(store_path)).get("a")["loss_mask"] is None
    hsdata.add_loss_masks(str(store_path), {"a": a["loss_mask"]})
    store = hsdata.open(str(store_path))
    assert_same(store.get("a"), a)
    assert store.get("b")["loss_mask"] is None
    assert "loss_mask" not in store.get("b", fields=["input_ids"])
    hsdata.add_loss_masks(str(store_path), {"b": b["loss_mask"]})
    assert_same(hsdata.open(str(store_path)).get("b"), b)
    with pytest.raises(hsdata.InvalidSampleError, match="sample 'c': a loss mask must be"):
        hsdata.add_loss_masks(str(store_path), {"c": [0, 2]})
    with hsdata.create(str(store_path), **SPEC) as w:
        w.add("short", **{**make_sample(5, 3), "loss_mask": None})
    masks.write(Storage(str(store_path)), {"short": b"\x01"})  # the raw format: add_loss_masks refuses it
    with pytest.raises(hsdata.CorruptDataError, match="added loss mask has 1 tokens, the sample 5"):
        hsdata.open(str(store_path)).get("short")
