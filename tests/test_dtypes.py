"""Stores of each hidden-state dtype (bf16, fp16, fp32, fp32 converted to bf16/fp16), and version 1 stores."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch

import hsdata
from conftest import SMALL_LAYOUT, SPEC, assert_same, make_sample
from hsdata import inputs
from hsdata.spec import CHUNK_TARGET_BYTES, StoreSpec
from hsdata.validate import validate

NATIVE = ["bfloat16", "float16", "float32"]
PAIRS = [(d, d) for d in NATIVE] + [("bfloat16", "float32"), ("float16", "float32")]  # (stored, computed)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, info.tiny / 4, info.max, info.eps],
                        dtype=dtype)


@pytest.mark.parametrize("stored, computed", PAIRS)
def test_each_dtype_reads_back_as_stored(store_path, stored, computed):
    computed_dtype, stored_dtype = getattr(torch, computed), getattr(torch, stored)
    given = {f"s{i}": make_sample(n, i, dtype=computed_dtype) for i, n in enumerate([1, 17, 300, 40])}
    given["s1"]["hidden_states"][0, :7] = special_values(computed_dtype)
    with hsdata.create(str(store_path), **SPEC, dtype=stored, compute_dtype=computed_dtype, **SMALL_LAYOUT) as w:
        for sample_id, sample in given.items():
            w.add(sample_id, **sample)
    store = hsdata.open(str(store_path))
    assert (store.spec.dtype, store.spec.compute_dtype) == (stored, computed)
    want = {sid: {k: v.to(stored_dtype) if v.is_floating_point() else v for k, v in s.items()}
            for sid, s in given.items()}
    for i, sample_id in enumerate(store.sample_ids):
        assert_same(store[i], want[sample_id])
        assert_same(store.get(sample_id), want[sample_id])
    for got in store.read_many([3, 0, 2]):
        assert_same(got, want[got["sample_id"]])
    assert validate(str(store_path), check_finite=False).ok  # the special values are stored as given...
    assert [p.sample_id for p in validate(str(store_path)).problems] == ["s1"]  # ...and flagged by default


def test_conversion_rounds_to_nearest_even_and_overflows_to_inf(store_path):
    # halfway between two bf16 values: to the even one; fp16 saturates to inf beyond 65504
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e5, 3.0e38, 1e-45], dtype=torch.float32)
    final = values.repeat(6)[: SPEC["hidden_size"]].reshape(1, -1)
    sample = {"input_ids": [7], "loss_mask": [1], "aux_hidden_states": final.repeat(1, 3), "hidden_states": final}
    expected = {"bfloat16": [1.0, 1 + 2**-6, -1.0], "float16": [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), float("inf")]}
    for stored, head in expected.items():
        path = str(store_path) + stored
        with hsdata.create(path, **SPEC, dtype=stored, compute_dtype="float32") as w:
            w.add("a", **sample)
        got = hsdata.open(path)[0]["hidden_states"]
        assert_same({"h": got}, {"h": final.to(getattr(torch, stored))})
        assert got[0, : len(head)].float().tolist() == head


@pytest.mark.parametrize("stored, computed", PAIRS)
def test_numpy_inputs(store_path, stored, computed):
    rng = np.random.default_rng(0)
    k, h, t = len(SPEC["aux_layers"]), SPEC["hidden_size"], 9
    numpy_dtype = ml_dtypes.bfloat16 if computed == "bfloat16" else np.dtype(computed)
    aux = rng.standard_normal((t, k, h)).astype(numpy_dtype)  # [T, K, H] is accepted too
    final = rng.standard_normal((t, h)).astype(numpy_dtype)
    final.flags.writeable = False  # a read-only array converts as well
    big_endian = final.astype(final.dtype.newbyteorder(">")) if computed != "bfloat16" else final
    with hsdata.create(str(store_path), **SPEC, dtype=stored, compute_dtype=computed) as w:
        w.add("a", input_ids=np.arange(t), loss_mask=np.ones(t, np.int8), aux_hidden_states=aux, hidden_states=final)
        w.add("b", input_ids=np.arange(t), loss_mask=None, aux_hidden_states=aux, hidden_states=big_endian)
    store = hsdata.open(str(store_path))

    def as_torch(a: np.ndarray) -> torch.Tensor:
        a = np.array(a, dtype=a.dtype.newbyteorder("="))  # a writable copy in native byte order
        bf16 = a.dtype == ml_dtypes.bfloat16
        return (torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if bf16 else torch.from_numpy(a)).to(
            getattr(torch, stored))

    for sample_id in ("a", "b"):
        assert_same(store.get(sample_id), {"aux_hidden_states": as_torch(aux.reshape(t, k * h)),
                                           "hidden_states": as_torch(final)})


@pytest.mark.parametrize("stored", NATIVE)
def test_hidden_states_in_the_stored_dtype_are_not_copied(stored):
    spec = StoreSpec.new(SPEC["hidden_size"], SPEC["aux_layers"], dtype=stored)
    sample = make_sample(10, 0, dtype=getattr(torch, stored))
    prepared = inputs.prepare(spec, "a", **sample)
    for name in ("aux_hidden_states", "hidden_states"):
        assert prepared.arrays[name].ctypes.data == sample[name].data_ptr(), name
        assert prepared.arrays[name].dtype == spec.tensor(name).dtype.stored


def test_chunk_and_shard_sizes_follow_the_byte_targets():
    specs = {d: StoreSpec.new(7168, [1, 29, 57], dtype=d) for d in NATIVE}
    for name in ("aux_hidden_states", "hidden_states"):
        bf16, fp16, fp32 = (specs[d].tensor(name) for d in NATIVE)
        assert bf16.chunk_tokens == fp16.chunk_tokens == 2 * fp32.chunk_tokens
        assert fp32.row_nbytes == 2 * bf16.row_nbytes and fp32.data_type == "float32"
        assert max(t.chunk_nbytes for t in (bf16, fp16, fp32)) <= CHUNK_TARGET_BYTES
    assert specs["bfloat16"].shard_tokens == 65536 and specs["float32"].shard_tokens == 32768
    assert specs["float32"].token_nbytes == 4 + 1 + 4 * 4 * 7168
    converted = StoreSpec.new(7168, [1, 29, 57], dtype="bfloat16", compute_dtype=torch.float32)
    assert converted.tensors == specs["bfloat16"].tensors  # the layout follows the stored dtype only


def _root(path) -> dict:
    return json.loads((path / "zarr.json").read_text())


def _write_root(path, attributes: dict) -> None:
    root = _root(path)
    root["attributes"]["hsdata"] = attributes
    (path / "zarr.json").write_text(json.dumps(root, indent=2))


def as_version_1(path) -> None:
    """Rewrite a bfloat16 store's root as hsdata's format version 1 wrote it (everything else is identical)."""
    attributes = _root(path)["attributes"]["hsdata"]
    assert attributes.pop("compute_dtype") == attributes["dtype"] == "bfloat16"
    _write_root(path, {**attributes, "format_version": 1})


def test_version_1_stores_open_read_validate_and_take_new_writers(store_path):
    first = {f"s{i}": make_sample(20 + i, i) for i in range(3)}
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        for sample_id, sample in first.items():
            w.add(sample_id, **sample)
    as_version_1(store_path)
    root_before = (store_path / "zarr.json").read_bytes()
    store = hsdata.open(str(store_path))
    assert (store.spec.format_version, store.spec.dtype, store.spec.compute_dtype) == (1, "bfloat16", None)
    for sample_id, sample in first.items():
        assert_same(store.get(sample_id), sample)
    assert validate(str(store_path)).ok
    with pytest.raises(hsdata.SpecMismatchError, match="compute_dtype: store has None, requested 'float32'"):
        hsdata.create(str(store_path), **SPEC, compute_dtype="float32")
    with hsdata.create(str(store_path), **SPEC) as w:  # bfloat16, as version 1 stored
        w.add("new", **make_sample(30, 9))
    assert (store_path / "zarr.json").read_bytes() == root_before  # the store stays version 1
    store = hsdata.open(str(store_path))
    assert len(store) == 4 and store.spec.format_version == 1
    assert_same(store.get("new"), make_sample(30, 9))
    assert validate(str(store_path)).ok


@pytest.fixture
def attributes(store_path):
    with hsdata.create(str(store_path), **SPEC, dtype="bfloat16", compute_dtype="float32"):
        pass
    return _root(store_path)["attributes"]["hsdata"]


def _v1(attributes: dict) -> dict:
    return {**{k: v for k, v in attributes.items() if k != "compute_dtype"}, "format_version": 1}


def _retyped(attributes: dict, dtype: str, data_type: str) -> dict:
    tensors = {name: {**t, "data_type": data_type, "logical_dtype": dtype} if name.endswith("hidden_states") else t
               for name, t in attributes["tensors"].items()}
    return {**attributes, "dtype": dtype, "compute_dtype": dtype, "tensors": tensors}


@pytest.mark.parametrize("change, message", [
    (lambda a: {**_v1(a), "compute_dtype": "bfloat16"}, r"unknown keys \['compute_dtype'\]"),
    (lambda a: {k: v for k, v in a.items() if k != "compute_dtype"}, r"missing keys \['compute_dtype'\]"),
    (lambda a: {**_v1(_retyped(a, "float32", "float32"))}, r"dtype is 'float32', expected 'bfloat16'"),
    (lambda a: {**a, "dtype": "float64"}, r"dtype must be one of bfloat16, float16, float32, float8_e4m3fn, float8_e5m2 .*got 'float64'"),
    (lambda a: {**a, "compute_dtype": "int8"}, r"compute_dtype must be one of .*got 'int8'"),
    (lambda a: {**a, "compute_dtype": "float16"}, r"cannot store float16 hidden states as bfloat16"),
    (lambda a: {**a, "dtype": "float32", "compute_dtype": "float32"}, r"inconsistent"),  # tensors still say uint16
    (lambda a: _retyped(a, "float16", "uint16"), r"inconsistent"),
    (lambda a: {**a, "format_version": True}, r"Unsupported hsdata format version True"),
    (lambda a: {**a, "format_version": 99}, r"Unsupported hsdata format version 99. Expected one of 1, 2, 3, 4."),
])
def test_root_attributes_are_parsed_strictly_per_version(store_path, attributes, change, message):
    _write_root(store_path, change(attributes))
    with pytest.raises(hsdata.UnsupportedFormatError, match=message):
        hsdata.open(str(store_path))
    with pytest.raises(hsdata.UnsupportedFormatError, match=message):
        hsdata.create(str(store_path), **SPEC)


def test_an_unknown_compute_dtype_is_allowed_in_version_2(store_path, attributes):
    _write_root(store_path, {**attributes, "compute_dtype": None})
    assert hsdata.open(str(store_path)).spec.compute_dtype is None
    _write_root(store_path, _retyped(attributes, "float32", "float32"))
    assert hsdata.open(str(store_path)).spec.tensor("hidden_states").dtype.torch == torch.float32
