"""Every bad input gets a clear error naming the sample and the problem, and leaves nothing half-written."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import hsdata
from conftest import HIDDEN, SMALL_LAYOUT, SPEC, assert_same, make_sample


def _with(sample: dict, **changes) -> dict:
    return {**sample, **changes}


T = 12
GOOD = make_sample(T, 0)
BAD_SAMPLES = {
    "wrong hidden size": (_with(GOOD, hidden_states=torch.zeros(T, HIDDEN + 1, dtype=torch.bfloat16)),
                          rf"hidden_states must have shape \[{T}, {HIDDEN}\], got \[{T}, {HIDDEN + 1}\]"),
    "wrong layer count": (_with(GOOD, aux_hidden_states=torch.zeros(T, 2 * HIDDEN, dtype=torch.bfloat16)),
                          rf"aux_hidden_states must have shape \[{T}, {3 * HIDDEN}\] \(3 layers"),
    "unequal lengths": (_with(GOOD, hidden_states=torch.zeros(T - 1, HIDDEN, dtype=torch.bfloat16)),
                        rf"hidden_states must have shape \[{T}, {HIDDEN}\], got \[{T - 1}, {HIDDEN}\]"),
    "mask length": (_with(GOOD, loss_mask=torch.ones(T + 1, dtype=torch.int64)),
                    rf"loss_mask must have shape \[{T}\] like input_ids, got \[{T + 1}\]"),
    "float32 states": (_with(GOOD, hidden_states=torch.zeros(T, HIDDEN)),
                       r"hidden_states is float32, this store takes bfloat16$"),
    "float16 numpy aux": (_with(GOOD, aux_hidden_states=np.zeros((T, 3 * HIDDEN), np.float16)),
                          r"aux_hidden_states is float16, this store takes bfloat16$"),
    "float64 numpy states": (_with(GOOD, hidden_states=np.zeros((T, HIDDEN))),
                             r"hidden_states is float64, this store takes bfloat16$"),
    "negative id": (_with(GOOD, input_ids=torch.full((T,), -1)), r"input_ids holds -1, outside \[0, 2147483647\]"),
    "id too large": (_with(GOOD, input_ids=torch.full((T,), 2**31)),
                     r"input_ids holds 2147483648, outside \[0, 2147483647\]"),
    "float ids": (_with(GOOD, input_ids=torch.zeros(T)), r"input_ids must hold integers, got dtype torch.float32"),
    "2-D ids": (_with(GOOD, input_ids=torch.zeros(1, T, dtype=torch.int64)), r"input_ids must have shape \[T\]"),
    "mask not 0/1": (_with(GOOD, loss_mask=torch.full((T,), 2)), r"loss_mask must hold only 0 and 1"),
    "empty sample": ({"input_ids": torch.zeros(0, dtype=torch.int64), "loss_mask": torch.zeros(0),
                      "aux_hidden_states": torch.zeros(0, 3 * HIDDEN, dtype=torch.bfloat16),
                      "hidden_states": torch.zeros(0, HIDDEN, dtype=torch.bfloat16)}, r"empty sample \(0 tokens\)"),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLES))
def test_bad_sample_is_rejected_and_nothing_is_written(store_path, case):
    sample, message = BAD_SAMPLES[case]
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        with pytest.raises(hsdata.InvalidSampleError, match=rf"^sample 'bad': {message}"):
            w.add("bad", **sample)
        w.add("good", **GOOD)  # the writer is still usable
    store = hsdata.open(str(store_path))
    assert store.sample_ids == ["good"]
    assert_same(store[0], GOOD)


@pytest.mark.parametrize("dtype, compute_dtype, given, takes", [
    ("float32", None, torch.bfloat16, "float32"),
    ("float16", None, torch.bfloat16, "float16"),
    ("bfloat16", "float32", torch.float16, r"bfloat16, or float32 \(converted\)"),
    ("float16", "float32", torch.float64, r"float16, or float32 \(converted\)"),
])
def test_hidden_states_of_another_dtype_are_rejected(store_path, dtype, compute_dtype, given, takes):
    with hsdata.create(str(store_path), **SPEC, dtype=dtype, compute_dtype=compute_dtype) as w:
        good = make_sample(T, 0, dtype=getattr(torch, compute_dtype or dtype))
        for name in ("aux_hidden_states", "hidden_states"):
            bad = _with(good, **{name: good[name].to(given)})
            given_name = str(given).removeprefix("torch.")
            with pytest.raises(hsdata.InvalidSampleError, match=rf"^sample 'bad': {name} is {given_name}, "
                                                                 rf"this store takes {takes}$"):
                w.add("bad", **bad)
        w.add("good", **good)
    assert hsdata.open(str(store_path)).sample_ids == ["good"]


def test_ids_beyond_vocab_size(store_path):
    with hsdata.create(str(store_path), **SPEC, vocab_size=1000) as w:
        with pytest.raises(hsdata.InvalidSampleError, match=r"input_ids holds \d+, outside \[0, 999\] \(vocab_size\)"):
            w.add("big-ids", **GOOD)


def test_sample_id_and_meta_are_checked(store_path):
    with hsdata.create(str(store_path), **SPEC) as w:
        with pytest.raises(hsdata.InvalidSampleError, match="sample_id must be a non-empty string, got 7"):
            w.add(7, **GOOD)
        with pytest.raises(hsdata.InvalidSampleError, match="sample 'm': meta must be JSON-serializable"):
            w.add("m", **GOOD, meta={"x": object()})
    assert len(hsdata.open(str(store_path))) == 0


def test_duplicate_ids_in_one_writer_and_against_committed_samples(store_path):
    with hsdata.create(str(store_path), **SPEC) as w:
        w.add("dup", **GOOD)
        with pytest.raises(hsdata.DuplicateSampleError, match="sample 'dup': already in this store"):
            w.add("dup", **GOOD)
    with hsdata.create(str(store_path), **SPEC) as w:
        with pytest.raises(hsdata.DuplicateSampleError, match="sample 'dup'"):
            w.add("dup", **GOOD)
    assert hsdata.open(str(store_path)).sample_ids == ["dup"]


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=HIDDEN * 2), rf"hidden_size: store has {HIDDEN}, requested {HIDDEN * 2}"),
    (dict(aux_layers=[1, 2, 3]), r"aux_layers: store has \(1, 4, 6\), requested \(1, 2, 3\)"),
    (dict(model="other/model"), r"model: store has 'test/tiny-llama', requested 'other/model'"),
    (dict(shard_tokens=512), r"shard_tokens: store has 256, requested 512"),
    (dict(dtype="float32"), r"dtype: store has 'bfloat16', requested 'float32'; compute_dtype: store has "
                            r"'bfloat16', requested 'float32'"),
    (dict(compute_dtype=torch.float32), r"differs: compute_dtype: store has 'bfloat16', requested 'float32'$"),
])
def test_joining_with_a_different_spec_is_an_error(store_path, change, message):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        w.add("a", **GOOD)
    with pytest.raises(hsdata.SpecMismatchError, match=message):
        hsdata.create(str(store_path), **{**SPEC, **change})


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=0), "hidden_size must be a positive integer, got 0"),
    (dict(aux_layers=[]), "aux_layers must be a non-empty list"),
    (dict(aux_layers=[1, 1, 2]), "aux_layers has repeated ids"),
    (dict(shard_tokens=100, chunk_tokens=16), r"shard_tokens \(100\) must be a multiple of chunk_tokens \(16\)"),
    (dict(dtype="float64"), r"dtype must be one of bfloat16, float16, float32, float8_e4m3fn, float8_e5m2 \(a name or torch "
                            r"dtype\), "
                            r"got 'float64'"),
    (dict(dtype=torch.int8), r"dtype must be one of .*, got torch.int8"),
    (dict(compute_dtype="fp32"), r"compute_dtype must be one of .*, got 'fp32'"),
    (dict(dtype="float32", compute_dtype="bfloat16"),
     r"cannot store bfloat16 hidden states as float32: the stored dtype must be the compute dtype, float32 "
     r"stored as bfloat16 or float16, or any of them as fp8"),
    (dict(dtype="bfloat16", compute_dtype="float16"), r"cannot store float16 hidden states as bfloat16"),
])
def test_bad_create_arguments(store_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        hsdata.create(str(store_path), **{**SPEC, **kwargs})
    assert not store_path.exists()


def test_not_a_store(tmp_path):
    with pytest.raises(hsdata.NotAStoreError, match="is not an hsdata store: it has no zarr.json"):
        hsdata.open(str(tmp_path))
    (tmp_path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(hsdata.NotAStoreError, match="has no attributes.hsdata"):
        hsdata.open(str(tmp_path))


@pytest.mark.parametrize("options, message", [
    ({"concurrency": 0}, "concurrency must be >= 1, got 0"),
    ({"range_bytes": 0}, "concurrency and range_bytes must be positive"),
    ({"cache_dir": "unused", "cache_max_bytes": 0}, "cache max_bytes must be >= 1, got 0"),
])
def test_bad_open_arguments(store_path, options, message):
    with hsdata.create(str(store_path), **SPEC) as w:
        w.add("a", **GOOD)
    with pytest.raises(ValueError, match=message):
        hsdata.open(str(store_path), **options)


@pytest.mark.parametrize("version, message", [
    (5, r"Unsupported hsdata format version 5. Expected one of 1, 2, 3, 4."),
    (3, r"hsdata attributes: missing keys \['compression'\]"),  # version 3 is version 2 plus compression
    (4, r"dtype bfloat16 in a version 4 store"),  # version 4 is fp8's
])
def test_unsupported_format_version(store_path, version, message):
    with hsdata.create(str(store_path), **SPEC):
        pass
    root = json.loads((store_path / "zarr.json").read_text())
    root["attributes"]["hsdata"]["format_version"] = version
    (store_path / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(hsdata.UnsupportedFormatError, match=message):
        hsdata.open(str(store_path))


def test_background_io_failure_surfaces_and_commits_nothing(store_path):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT):
        pass
    (store_path / "parts").mkdir(exist_ok=True)
    w = hsdata.create(str(store_path), **SPEC)
    (store_path / "parts" / w.part).write_text("a file where the part's folder must go")
    w.add("a", **GOOD)
    with pytest.raises(hsdata.WriterError, match=f"writing part {w.part} .* failed"):
        w.flush()
    with pytest.raises(hsdata.WriterError):
        w.add("b", **GOOD)
    w.abort()
    assert len(hsdata.open(str(store_path))) == 0


@pytest.mark.parametrize("url, extra", [("http://127.0.0.1:9/store", "http"), ("s3://bucket/store", "s3")])
def test_a_url_whose_filesystem_is_not_installed_names_the_extra(monkeypatch, url, extra):
    import fsspec

    def missing(*args, **kwargs):
        raise ImportError("Install the filesystem's package")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(hsdata.MissingExtraError, match=re.escape(f"pip install 'hsdata[{extra}]'")):
        hsdata.open(url)
