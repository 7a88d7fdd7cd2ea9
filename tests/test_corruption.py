"""Reading never returns wrong numbers: corrupt, truncated or missing bytes raise CorruptDataError."""

from __future__ import annotations

import os

import pytest

import hsdata
from conftest import assert_same, make_sample, write_store
from hsdata.layout import shard_key
from hsdata.shard import token_ranges


@pytest.fixture
def store(store_path):
    write_store(store_path, {f"s{i}": make_sample(40 + 30 * i, i) for i in range(8)})
    return hsdata.open(str(store_path))


def _file_of(store, i, tensor_name):
    part, offset, length = store.location(i)
    tensor = store.spec.tensor(tensor_name)
    r = token_ranges(store.spec, tensor, offset, length)[0]
    return os.path.join(store.url, shard_key(part, tensor, r.shard)), r


@pytest.mark.parametrize("tensor", ["input_ids", "loss_mask", "aux_hidden_states", "hidden_states"])
def test_flipped_payload_byte_raises_naming_the_sample(store, tensor):
    path, r = _file_of(store, 3, tensor)
    with open(path, "r+b") as f:
        f.seek(r.file_start + 1)
        byte = f.read(1)
        f.seek(r.file_start + 1)
        f.write(bytes([byte[0] ^ 0x10]))
    reopened = hsdata.open(store.url)
    with pytest.raises(hsdata.CorruptDataError, match=rf"sample 's3': {tensor} does not match its checksum"):
        reopened[3]
    reopened.get("s4")  # others still read
    unchecked = hsdata.open(store.url, verify=False)
    assert unchecked.get("s3", fields=[tensor])[tensor] is not None


def test_truncated_shard_raises(store):
    path, _ = _file_of(store, 7, "aux_hidden_states")
    os.truncate(path, 100)
    with pytest.raises(hsdata.CorruptDataError, match="truncated"):
        hsdata.open(store.url)[7]


def test_missing_shard_raises(store):
    path, _ = _file_of(store, 2, "hidden_states")
    os.remove(path)
    with pytest.raises(hsdata.CorruptDataError, match="sample 's2': shard file missing"):
        hsdata.open(store.url).get("s2")


def test_corrupt_manifest_is_refused_at_open(store):
    manifests = os.path.join(store.url, "manifests")
    name = sorted(os.listdir(manifests))[0]
    with open(os.path.join(manifests, name), "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(hsdata.CorruptDataError, match="manifests/.*checksum mismatch"):
        hsdata.open(store.url)


def test_uncommitted_leftovers_are_invisible(store_path):
    samples = {"a": make_sample(30, 1)}
    write_store(store_path, samples)
    w = hsdata.create(str(store_path), **{"hidden_size": 32, "aux_layers": [1, 4, 6], "model": "test/tiny-llama"})
    w.add("never-committed", **make_sample(30, 2))
    w.abort()  # like a crash: shard files may exist, no manifest names them
    store = hsdata.open(str(store_path))
    assert store.sample_ids == ["a"]
    assert_same(store[0], samples["a"])
