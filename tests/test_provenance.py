"""Provenance recorded at creation (root metadata, a joining writer's part, `hsdata info`, `hsdata extract`, the
SGLang hook) and per-sample ``meta`` read back on request."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from datetime import datetime, timedelta, timezone

import pytest
import sglang
import torch
import transformers
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import hsdata
import hsdata.validate
from conftest import AUX, SMALL_LAYOUT, SPEC, make_sample, write_store
from hsdata.extract import demo
from hsdata.layout import MAX_PROVENANCE_BYTES, MAX_PROVENANCE_DEPTH
from server_hook.sglang import HookConfig
from test_cli import run_main
from test_hostile_audit import rewrite_manifest
from test_server_hook import forward, hooked_model

GIVEN = {"source": "sharegpt-v3", "tokenizer": {"name": "org/tok", "sha256": "ab" * 32}, "lr": 1e-4,
         "note": "two\nlines", "layers": (1, 2)}
STORED = {**GIVEN, "layers": [1, 2]}  # as JSON holds it


def root_document(path) -> dict:
    return json.loads((path / "zarr.json").read_text())


def part_attributes(path) -> dict[str, dict]:
    parts = sorted(p for p in os.listdir(path / "parts") if p != "zarr.json")
    return {p: json.loads((path / "parts" / p / "zarr.json").read_text())["attributes"]["hsdata_part"] for p in parts}


def test_provenance_round_trips_through_create_open_and_info(store_path, capsys):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT, provenance=GIVEN) as w:
        w.add("s", **make_sample(10, 0))
    attributes = root_document(store_path)["attributes"]
    assert list(attributes) == ["hsdata", "hsdata_provenance"] and attributes["hsdata_provenance"] == STORED
    assert hsdata.open(str(store_path)).provenance == STORED
    (part,) = part_attributes(store_path).values()
    assert part.keys() == {"created", "manifests"}  # the root holds it
    code, out, _ = run_main(capsys, "info", str(store_path))
    assert code == 0
    assert out.splitlines()[-6:] == ["provenance", "  source: sharegpt-v3",
                                     '  tokenizer: {"name":"org/tok","sha256":"' + "ab" * 32 + '"}',
                                     "  lr: 0.0001", '  note: "two\\nlines"', "  layers: [1,2]"]
    code, out, _ = run_main(capsys, "info", str(store_path), "--json")
    assert code == 0 and json.loads(out)["provenance"] == STORED  # as recorded: 1e-4 is not rounded


def test_a_store_without_provenance_opens_and_shows_none(store_path, capsys):
    write_store(store_path, {"s": make_sample(10, 0)})
    assert "hsdata_provenance" not in root_document(store_path)["attributes"]
    assert hsdata.open(str(store_path)).provenance == {}
    code, out, _ = run_main(capsys, "info", str(store_path))
    assert code == 0 and out.splitlines()[-1] == "provenance  none recorded"
    code, out, _ = run_main(capsys, "info", str(store_path), "--json")
    assert json.loads(out)["provenance"] == {}


def test_a_joining_writer_records_its_provenance_in_its_part_and_leaves_the_root_unchanged(store_path, capsys):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT, provenance={"run": 1}) as w:
        w.add("a", **make_sample(10, 0))
    root = (store_path / "zarr.json").read_bytes()
    with hsdata.create(str(store_path), **SPEC, provenance={"run": 2, "source": "more"}) as w:
        w.add("b", **make_sample(10, 1))
    with hsdata.create(str(store_path), **SPEC) as w:  # no provenance: none in its part
        w.add("c", **make_sample(10, 2))
    assert (store_path / "zarr.json").read_bytes() == root
    store = hsdata.open(str(store_path))
    assert store.provenance == {"run": 1} and len(store) == 3
    first, second, third = (part_attributes(store_path)[store.location(store.index(s))[0]] for s in "abc")
    assert "provenance" not in first and "provenance" not in third
    assert second["provenance"] == {"run": 2, "source": "more"}
    assert hsdata.validate.validate(str(store_path)).ok
    joined = store.location(store.index("b"))[0]
    assert store.part_provenance == {joined: {"run": 2, "source": "more"}}  # the creator's and no-provenance parts: not
    code, out, _ = run_main(capsys, "info", str(store_path))
    assert code == 0 and out.splitlines()[-5:] == ["provenance", "  run: 1", f"part {joined} provenance", "  run: 2",
                                                   "  source: more"]
    code, out, _ = run_main(capsys, "info", str(store_path), "--json")
    assert code == 0 and json.loads(out)["part_provenance"] == {joined: {"run": 2, "source": "more"}}


def test_a_part_whose_provenance_is_not_an_object_is_corrupt(store_path):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        w.add("a", **make_sample(10, 0))
    (part,) = part_attributes(store_path)
    document = json.loads((store_path / "parts" / part / "zarr.json").read_text())
    document["attributes"]["hsdata_part"]["provenance"] = ["not", "an", "object"]
    (store_path / "parts" / part / "zarr.json").write_text(json.dumps(document))
    store = hsdata.open(str(store_path))  # opening does not read parts' documents
    with pytest.raises(hsdata.CorruptDataError, match=f"parts/{part}/zarr.json: attributes.hsdata_part.provenance "
                                                      "must be a JSON object, got list"):
        store.part_provenance


def nested(depth: int) -> dict:
    value: object = 0
    for _ in range(depth - 1):
        value = [value]
    return {"x": value}


def circular() -> dict:
    value: dict = {}
    value["self"] = value
    return value


@pytest.mark.parametrize("provenance, message", [
    ([("source", "x")], "provenance must be a dict (a JSON object), got list"),
    ("source=x", "provenance must be a dict (a JSON object), got str"),
    ({1: "x"}, "provenance keys must be strings, got 1"),
    ({"a": [{"b": {None: 0}}]}, "provenance keys must be strings, got None"),
    ({"a": object()}, "provenance must be JSON-serializable: Object of type object is not JSON serializable"),
    ({"a": float("nan")}, "provenance must be JSON-serializable: Out of range float values"),
    ({"a": {1, 2}}, "provenance must be JSON-serializable: Object of type set"),
    (circular(), "provenance must be JSON-serializable: Circular reference detected"),
    ({"x": "a" * (MAX_PROVENANCE_BYTES - 12)}, "provenance is 65,537 bytes as JSON, more than the 65,536 allowed"),
    (nested(MAX_PROVENANCE_DEPTH + 1), f"provenance is nested deeper than {MAX_PROVENANCE_DEPTH} levels"),
    (nested(100_000), f"provenance is nested deeper than {MAX_PROVENANCE_DEPTH} levels"),
])
def test_bad_provenance_is_refused_before_anything_is_written(store_path, provenance, message):
    with pytest.raises(ValueError) as raised:
        hsdata.create(str(store_path), **SPEC, provenance=provenance)
    assert str(raised.value).startswith(message)
    assert not store_path.exists()


def test_provenance_at_its_bounds_is_recorded(store_path):
    deepest = nested(MAX_PROVENANCE_DEPTH)["x"]  # {"y": deepest} is MAX_PROVENANCE_DEPTH deep
    biggest = {"x": "a" * MAX_PROVENANCE_BYTES, "y": deepest}
    biggest["x"] = biggest["x"][: len(biggest["x"]) - (len(json.dumps(biggest, indent=2)) - MAX_PROVENANCE_BYTES)]
    assert len(json.dumps(biggest, indent=2)) == MAX_PROVENANCE_BYTES
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT, provenance=biggest) as w:
        w.add("s", **make_sample(10, 0))
    assert hsdata.open(str(store_path)).provenance == biggest
    with hsdata.create(str(store_path), **SPEC, provenance={"y": deepest}) as w:  # a part's is 1 level deeper
        w.add("t", **make_sample(10, 1))
    store = hsdata.open(str(store_path))
    assert part_attributes(store_path)[store.location(store.index("t"))[0]]["provenance"] == {"y": deepest}
    assert hsdata.validate.validate(str(store_path)).ok


@pytest.mark.parametrize("value, kind", [("sharegpt", "str"), ([1, 2], "list"), (None, "NoneType"), (3, "int")])
def test_a_root_whose_provenance_is_not_an_object_is_corrupt(store_path, capsys, value, kind):
    write_store(store_path, {"s": make_sample(10, 0)})
    document = root_document(store_path)
    document["attributes"]["hsdata_provenance"] = value
    (store_path / "zarr.json").write_text(json.dumps(document))
    message = f"{store_path}/zarr.json: attributes.hsdata_provenance must be a JSON object, got {kind}"
    for call in (lambda: hsdata.open(str(store_path)), lambda: hsdata.create(str(store_path), **SPEC),
                 lambda: hsdata.validate.validate(str(store_path))):
        with pytest.raises(hsdata.CorruptDataError) as raised:
            call()
        assert str(raised.value) == message
    code, _, err = run_main(capsys, "info", str(store_path))
    assert code == 2 and err == f"hsdata info: error: {message}\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_extract_records_how_the_store_was_made(tmp_path, capsys):
    out = str(tmp_path / "demo")
    args = ["extract", "--out", out, "--provenance", "source=sharegpt-v3", "--provenance", 'tags=["a", 1]',
            "--provenance", "host=build-box"]
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    code, stdout, _ = run_main(capsys, *args)
    assert code == 0 and stdout.startswith("OK: 24 samples")
    got = hsdata.open(out).provenance
    created = datetime.fromisoformat(got.pop("created"))
    assert before <= created <= datetime.now(timezone.utc) and created.utcoffset() == timedelta(0)
    tokenizer = demo.tokenizer()
    with open(demo.data_path(), "rb") as f:
        data = f.read()
    assert got == {
        "engine": "transformers", "engine_version": transformers.__version__, "torch_version": torch.__version__,
        "hsdata_version": hsdata.__version__, "host": "build-box",  # --provenance wins over the automatic entry
        "model": demo.MODEL_NAME, "device": "cpu", "dtype": "bfloat16", "tokenizer": demo.MODEL_NAME,
        "tokenizer_sha256": sha256(tokenizer.backend_tokenizer.to_str().encode()),
        "chat_template_sha256": sha256(demo.CHAT_TEMPLATE.encode()), "chat_template": demo.CHAT_TEMPLATE,
        "data": os.path.abspath(demo.data_path()), "data_sha256": sha256(data), "records": 24,
        "command": shlex.join(["hsdata", *args]), "source": "sharegpt-v3", "tags": ["a", 1],
    }


def test_extract_refuses_bad_provenance_before_loading_anything(tmp_path, capsys):
    code, _, err = run_main(capsys, "extract", "--out", str(tmp_path / "s"), "--provenance", "novalue")
    assert code == 2 and err == "hsdata extract: error: --provenance expects KEY=VALUE, got 'novalue'\n"
    code, _, err = run_main(capsys, "extract", "--out", str(tmp_path / "s"), "--provenance", f"x={'a' * 70_000}")
    assert code == 2 and "provenance is 70,013 bytes as JSON, more than the 65,536 allowed" in err
    code, _, err = run_main(capsys, "extract", "--server", "http://127.0.0.1:9", "--data", demo.data_path(),
                            "--out", str(tmp_path / "s"), "--provenance", "a=b")
    assert code == 2 and "--provenance is for --engine hf" in err
    assert not (tmp_path / "s").exists()


def test_the_server_hook_records_what_it_knows_and_its_configs_provenance(tmp_path):
    store = tmp_path / "store"
    model, hook = hooked_model(store, store_dtype="bfloat16", model="org/served",
                               provenance={"source": "sharegpt-v3", "host": "node-7"})
    prompts = {"a": make_sample(12, 0)}
    forward(model, ForwardMode.EXTEND, [("a", 0, 12)], prompts)
    hook.close()
    got = hsdata.open(str(store)).provenance
    assert datetime.fromisoformat(got.pop("created")).utcoffset() == timedelta(0)
    assert got == {"engine": "sglang", "engine_version": sglang.__version__, "torch_version": torch.__version__,
                   "hsdata_version": hsdata.__version__, "host": "node-7", "model": "org/served", "dtype": "bfloat16",
                   "device": "cpu", "store_dtype": "bfloat16", "aux_layers": AUX, "source": "sharegpt-v3"}
    with pytest.raises(ValueError, match="hsdata hook: provenance must be a dict"):
        HookConfig.parse({"store": "/x", "provenance": ["source"]})
    with pytest.raises(ValueError, match="hsdata hook: provenance keys must be strings"):
        HookConfig.parse({"store": "/x", "provenance": {"a": {1: 2}}})  # a JSON config cannot, a Python one can


META = {"s0": {"source": "a", "turns": [1, 2]}, "s2": {"source": "b"}}


def test_meta_is_read_when_asked_for_and_only_then(store_path):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        for i in range(3):
            w.add(f"s{i}", **make_sample(10 + i, i), meta=META.get(f"s{i}"))
        with pytest.raises(hsdata.InvalidSampleError, match=r"sample 'x': meta must be a dict \(a JSON object\), "
                                                            "got list"):
            w.add("x", **make_sample(5, 9), meta=[1, 2])
    store = hsdata.open(str(store_path))
    assert [store.meta(i) for i in range(3)] == [META["s0"], None, META["s2"]] and store.meta(-1) == META["s2"]
    assert set(store.read(0)) == {"sample_id", "input_ids", "loss_mask", "aux_hidden_states", "hidden_states"}
    both = store.read(2, ["input_ids", "meta"])
    assert set(both) == {"sample_id", "input_ids", "meta"} and both["meta"] == META["s2"]
    assert both["input_ids"].tolist() == make_sample(12, 2)["input_ids"].tolist()
    assert store.get("s1", "meta") == {"sample_id": "s1", "meta": None}
    with pytest.raises(ValueError, match="choose from input_ids, loss_mask, aux_hidden_states, hidden_states, meta"):
        store.read(0, ["metadata"])
    for folder, _, names in os.walk(store_path / "parts"):  # meta alone reads no tensor
        for name in names:
            if name != "zarr.json":
                os.remove(os.path.join(folder, name))
    assert store.read_many([0, 1, 2], ["meta"]) == [{"sample_id": f"s{i}", "meta": META.get(f"s{i}")}
                                                    for i in range(3)]


@pytest.mark.parametrize("text, why", [('{"source": "a"', "is not valid JSON"),
                                       ("[1, 2]", "must be a JSON object, got list"),
                                       ('"text"', "must be a JSON object, got str"),
                                       ("[" * 100_000, "is not valid JSON")])
def test_meta_that_is_not_a_json_object_is_corrupt(store_path, text, why):
    with hsdata.create(str(store_path), **SPEC, **SMALL_LAYOUT) as w:
        w.add("s0", **make_sample(10, 0), meta={"source": "a"})
        w.add("s1", **make_sample(10, 1), meta={"source": "b"})
    rewrite_manifest(str(store_path), lambda rows: rows[0].update(meta=text))
    store = hsdata.open(str(store_path))
    for call in (lambda: store.meta(0), lambda: store.read(0, ["meta"]),
                 lambda: store.get("s0", ["meta", "input_ids"])):
        with pytest.raises(hsdata.CorruptDataError, match=f"sample 's0': its meta {why}"):
            call()
    assert store.read(0)["input_ids"].shape == (10,) and store.meta(1) == {"source": "b"}  # not asked: not decoded
