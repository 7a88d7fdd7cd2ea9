"""Metadata at scale (issue 16): ids kept as one Arrow array, looked up through a hash index, removals applied
vectorized. Small stores; what the paths compute must equal what a list and a dict would."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pytest
from conftest import SPEC, assert_same, make_sample, write_store

import hsdata
from hsdata import ids as hsids
from hsdata import manifest
from hsdata.ids import IdIndex, SampleIds, hash_id, hash_ids, sorted_keys

LAYOUT = dict(shard_tokens=64, chunk_tokens=8)
AWKWARD = ["", "a", "ab", "abcdefg", "abcdefgh", "abcdefghi", "é", "日本語のid", "x" * 1024, "tab\there", "\x00nul",
           "sample-0001", "sample-0010", "a" * 16, "a" * 17, "emoji 🙂"]


@pytest.mark.parametrize("large", [False, True])
def test_vectorized_hash_agrees_with_the_scalar_one_for_every_length(large):
    ids = AWKWARD + [f"id{i:0{i % 40}d}" for i in range(200)]
    array = pa.array(ids, pa.large_string() if large else pa.string())
    vector = hash_ids(array)
    assert vector.dtype == np.uint64 and vector.tolist() == [hash_id(s) for s in ids]
    sliced = array.slice(3, 50)  # an array that does not start at offset 0
    assert hash_ids(sliced).tolist() == [hash_id(s) for s in ids[3:53]]
    chunked = pa.chunked_array([array.slice(0, 10), array.slice(10)])
    assert hash_ids(chunked).tolist() == vector.tolist()
    assert len(set(vector.tolist())) == len(set(ids))  # no collision among these
    assert hash_id("\ud800") is None  # a lone surrogate is no UTF-8: no id can be it


def test_the_index_finds_every_id_and_only_those_even_when_every_hash_collides(monkeypatch):
    ids = AWKWARD + [f"s{i}" for i in range(500)]
    index = IdIndex(pa.array(ids))
    assert [index.find(s) for s in ids] == list(range(len(ids)))
    for absent in ["nope", "s500", "ab ", "\ud800", 3, None, b"a", ("a",)]:
        assert index.find(absent) is None
    wanted = ["s7", "nope", "", "s499", "\ud800", "s7"]
    assert index.find_many(wanted).tolist() == [ids.index("s7"), -1, 0, ids.index("s499"), -1, ids.index("s7")]
    assert index.find_many([]).tolist() == []
    # all hashes equal: lookups still confirm on the id itself, only slower
    monkeypatch.setattr(hsids, "hash_id", lambda s, seed=None: 7 if isinstance(s, str) else None)
    flat = IdIndex(pa.array(ids), sorted_keys(np.full(len(ids), 7, np.uint64)))
    assert [flat.find(s) for s in ids[:40]] == list(range(40)) and flat.find("nope") is None
    monkeypatch.setattr(hsids, "hash_ids", lambda a, seed=None: np.full(len(a), 7, np.uint64))
    assert flat.find_many(["s3", "nope", "a"]).tolist() == [ids.index("s3"), -1, 1]


def test_duplicate_rule_matches_the_plain_one_on_random_tables():
    rng = np.random.default_rng(3)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for trial in range(30):
        n = int(rng.integers(1, 60))
        ids = [f"id{int(k)}" for k in rng.integers(0, max(1, n // 2 if trial % 2 else n * 4), n)]
        created = [start + timedelta(microseconds=int(t)) for t in rng.integers(0, 5, n)]  # many ties
        rows = pa.table({"sample_id": ids, "created": pa.array(created, pa.timestamp("us", tz="UTC"))})
        best: dict[str, int] = {}
        for k, (sid, t) in enumerate(zip(ids, created)):
            if sid not in best or t < created[best[sid]]:
                best[sid] = k
        assert manifest.winners(rows).tolist() == sorted(best.values())


def test_duplicate_rule_when_hashes_collide_but_ids_do_not(monkeypatch):
    monkeypatch.setattr(manifest, "hash_ids", lambda a, seed=None: np.zeros(len(a), np.uint64))
    created = pa.array([datetime(2026, 1, 1, tzinfo=timezone.utc)] * 4, pa.timestamp("us", tz="UTC"))
    distinct = pa.table({"sample_id": ["a", "b", "c", "d"], "created": created})
    keep, _, keys = manifest.winners_and_hashes(distinct)
    assert keep.tolist() == [0, 1, 2, 3] and keys is not None
    twice = pa.table({"sample_id": ["a", "b", "a", "d"], "created": created})
    assert manifest.winners(twice).tolist() == [0, 1, 3]


def test_sample_ids_behave_as_the_list_they_replace():
    ids = [f"s{i:03d}" for i in range(300)]
    seq = SampleIds(pa.chunked_array([pa.array(ids[:100]), pa.array(ids[100:])]))
    assert len(seq) == 300 and seq[0] == "s000" and seq[-1] == "s299" and seq[np.int64(5)] == "s005"
    assert seq[10:13] == ids[10:13] and seq[::-50] == ids[::-50] and seq[5:2] == [] and seq[-3:] == ids[-3:]
    assert list(seq) == ids and list(reversed(seq)) == ids[::-1] and sorted(seq) == ids
    assert seq == ids and seq == tuple(ids) and seq != ids[:-1] and seq != ids[::-1] and (seq == "s000") is False
    assert seq + ["x"] == ids + ["x"] and ["x"] + seq == ["x"] + ids and seq + seq == ids + ids
    assert "s150" in seq and "nope" not in seq and 5 not in seq
    assert seq.index("s150") == 150 and seq.count("s150") == 1 and seq.count("nope") == 0
    with pytest.raises(ValueError):
        seq.index("nope")
    with pytest.raises(ValueError):
        seq.index("s150", 0, 100)
    with pytest.raises(IndexError):
        seq[300]
    with pytest.raises(TypeError):
        seq["s000"]
    with pytest.raises(TypeError):
        seq[True]
    assert seq.take([3, -1, 3]) == ["s003", "s299", "s003"] and seq.take(np.array([], np.int64)) == []
    with pytest.raises(IndexError):
        seq.take([300])
    assert seq.tolist() == ids and ", ".join(seq[:2]) == "s000, s001"
    assert pickle.loads(pickle.dumps(seq)) == ids and "s000" in repr(seq) and "300 ids" in repr(seq)
    assert set(seq) == set(ids) and dict(zip(seq, range(300)))["s007"] == 7
    with pytest.raises(TypeError):
        hash(seq)
    empty = SampleIds(pa.array([], pa.string()))
    assert len(empty) == 0 and list(empty) == [] and empty == [] and empty[:] == [] and "a" not in empty


def test_a_store_looks_up_ids_positions_and_contents(tmp_path):
    samples = {f"id-{i:03d}-{'x' * (i % 11)}": make_sample(1 + i % 5, i) for i in range(120)}
    write_store(tmp_path / "s", samples, **LAYOUT)
    store = hsdata.open(str(tmp_path / "s"))
    assert len(store) == 120 and store.sample_ids == list(samples) and isinstance(store.sample_ids, SampleIds)
    assert store.num_tokens == sum(s["input_ids"].shape[0] for s in samples.values())
    assert store.lengths.tolist() == [s["input_ids"].shape[0] for s in samples.values()]
    for k, (sample_id, sample) in enumerate(samples.items()):
        assert store.index(sample_id) == k and sample_id in store
        if k % 10 == 0:
            assert_same(store.get(sample_id), sample)
    for absent in ["nope", "", "\ud800", 1, None]:
        assert absent not in store
        with pytest.raises(KeyError):
            store.index(absent)
    wanted = list(samples)[::-7][:9]
    assert store.indices(wanted).tolist() == [list(samples).index(s) for s in wanted]
    assert store.indices([]).tolist() == []
    with pytest.raises(KeyError, match="nope"):
        store.indices(["id-000-", "nope"])
    assert [item["sample_id"] for item in store.read_many([3, 4])] == list(samples)[3:5]


def test_duplicates_removals_and_recommits_through_the_open_path(tmp_path):
    url = str(tmp_path / "s")
    first, second = (hsdata.create(url, **SPEC, **LAYOUT) for _ in range(2))
    earliest = make_sample(3, 1)
    first.add("twice", **earliest)
    first.add("a", **make_sample(2, 2))
    first.flush()
    second.add("twice", **make_sample(4, 3))
    second.add("b", **make_sample(5, 4))
    first.close()
    second.close()
    with pytest.warns(UserWarning, match="1 duplicate sample rows ignored"):
        store = hsdata.open(url)
    assert sorted(store.sample_ids) == ["a", "b", "twice"] and store.location(store.index("twice"))[0] == first.part
    assert_same(store.get("twice"), earliest)
    hsdata.remove_samples(url, ["a"])
    with pytest.warns(UserWarning):
        store = hsdata.open(url)
    assert sorted(store.sample_ids) == ["b", "twice"] and "a" not in store and len(store) == 2
    hsdata.remove_samples(url, ["twice"])  # every row of the id, the duplicate too
    store = hsdata.open(url)
    assert store.sample_ids == ["b"] and store.index("b") == 0
    with hsdata.create(url, **SPEC, **LAYOUT) as again:
        again.add("a", **make_sample(6, 5))
    store = hsdata.open(url)
    assert sorted(store.sample_ids) == ["a", "b"] and store.get("a")["input_ids"].shape == (6,)
