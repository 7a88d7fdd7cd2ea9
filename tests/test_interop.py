"""The same store read by plain zarr-python, tensorstore's zarr3 driver and pyarrow gives identical values, for
every stored dtype (bfloat16 as its uint16 bits, float16 and float32 natively)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorstore as ts
import torch
import zarr

import hsdata
from conftest import SMALL_LAYOUT, SPEC, make_sample, write_store
from hsdata import manifest
from hsdata.layout import array_node, shard_key
from hsdata.shard import chunks_per_shard, decode_index, encoded_chunk_nbytes, index_nbytes


@pytest.fixture(params=["bfloat16", "float16", "float32"])
def store(store_path, request):
    dtype = getattr(torch, request.param)
    samples = {f"s{i}": make_sample(n, i, dtype=dtype) for i, n in enumerate([1, 17, 300, 5, 620, 33])}
    samples["s1"]["hidden_states"][0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    write_store(store_path, samples, dtype=dtype, **SMALL_LAYOUT)
    with hsdata.create(str(store_path), **SPEC, dtype=dtype, **SMALL_LAYOUT) as w:  # a second part, after a flush gap
        w.add("p2-a", **make_sample(20, 50, dtype=dtype))
        w.flush()
        w.add("p2-b", **make_sample(30, 51, dtype=dtype))
    return hsdata.open(str(store_path))


def _stored(value: torch.Tensor) -> np.ndarray:
    return value.view(torch.uint16).numpy() if value.dtype == torch.bfloat16 else value.numpy()


def test_plain_zarr_reads_identical_values(store):
    root = zarr.open_group(store.url, mode="r")
    assert root.attrs["hsdata"] == store.spec.to_dict()
    for i in range(len(store)):
        part, offset, length = store.location(i)
        ours = store[i]
        for tensor in store.spec.tensors:
            array = root[array_node(part, tensor)]
            assert array.dtype == np.dtype(tensor.data_type)
            values = array[offset : offset + length]
            expected = _stored(ours[tensor.name]).astype(tensor.data_type)
            np.testing.assert_array_equal(values, expected)
    part, _, _ = store.location(store.index("p2-b"))
    gap = root[array_node(part, store.spec.tensor("hidden_states"))][32:256]  # chunks the flush left unwritten
    assert gap.dtype == np.dtype(store.spec.tensor("hidden_states").data_type) and not gap.any()


def test_tensorstore_reads_identical_values(store):
    for i in range(len(store)):
        part, offset, length = store.location(i)
        ours = store[i]
        for tensor in store.spec.tensors:
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{store.url}/{array_node(part, tensor)}"}}
            array = ts.open(spec, read=True).result()
            values = array[offset : offset + length].read().result()
            np.testing.assert_array_equal(values, _stored(ours[tensor.name]).astype(tensor.data_type))


def test_manifests_read_with_plain_pyarrow(store):
    table = pq.read_table(f"{store.url}/manifests")
    assert table.schema.equals(manifest.SCHEMA, check_metadata=False)
    assert sorted(table.column("sample_id").to_pylist()) == sorted(store.sample_ids)
    assert table.column("num_tokens").to_numpy().sum() == store.num_tokens


def test_shard_files_follow_the_dense_layout(store):
    part, _, _ = store.location(4)
    tensor = store.spec.tensor("aux_hidden_states")
    path = f"{store.url}/{shard_key(part, tensor, 0)}"
    data = open(path, "rb").read()
    n = chunks_per_shard(store.spec, tensor)
    index = decode_index(data[-index_nbytes(n) :], n, where=path)
    written = int((index[:, 0] != 2**64 - 1).sum())
    assert written == n  # shard 0 of the first part is full
    np.testing.assert_array_equal(index[:, 0], np.arange(n) * encoded_chunk_nbytes(tensor))
    assert len(data) == n * encoded_chunk_nbytes(tensor) + index_nbytes(n)
