"""Hostile and damaged stores against reading, `validate` and `gc`: one winner rule, gc deletes only layout names
and refuses when what is committed is unclear, rows bounded before anything is allocated, value ranges, grouped
problems, JSON errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from crc32c import crc32c

import hsdata
from conftest import SPEC, RangeFilesHandler, assert_same, make_sample, write_store
from hsdata import manifest, masks, removals
from hsdata.io import storage
from hsdata.cli import main
from hsdata.layout import shard_key
from hsdata.shard import encoded_chunk_nbytes, token_ranges
from hsdata.io.storage import Storage
from hsdata.validate import validate

LAYOUT = dict(shard_tokens=256, chunk_tokens=16)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdata", *args], capture_output=True, text=True, timeout=timeout)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``hsdata.cli.main`` in this process: exit code, stdout, stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def files(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names}


def rewrite_manifest(store, edit) -> str:
    """Apply ``edit(rows: list[dict])`` to the store's only manifest; write it back under its new xxh3 name."""
    folder = os.path.join(store, "manifests")
    (name,) = os.listdir(folder)
    rows = pq.read_table(os.path.join(folder, name)).to_pylist()
    edit(rows)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=manifest.SCHEMA), sink, write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    os.remove(os.path.join(folder, name))
    new = f"{name.split('.')[0]}.{name.split('.')[1]}.{xxhash.xxh3_64_hexdigest(data)}.parquet"
    with open(os.path.join(folder, new), "wb") as f:
        f.write(data)
    return f"manifests/{new}"


def set_values(store, sample_id: str, tensor_name: str, values: np.ndarray) -> None:
    """Overwrite a committed sample's bytes of a 1-D tensor, with valid chunk crc32c and manifest xxh3."""
    opened = hsdata.open(str(store))
    part, offset, length = opened.location(opened.index(sample_id))
    tensor = opened.spec.tensor(tensor_name)
    data = values.astype(tensor.dtype.stored).tobytes()
    (r,) = token_ranges(opened.spec, tensor, offset, length)
    assert len(r.pieces) == 1
    path = os.path.join(store, shard_key(part, tensor, r.shard))
    chunk = r.file_start // encoded_chunk_nbytes(tensor) * encoded_chunk_nbytes(tensor)
    with open(path, "r+b") as f:
        f.seek(r.file_start)
        f.write(data)
        f.seek(chunk)
        payload = f.read(tensor.chunk_nbytes)
        f.write(crc32c(payload).to_bytes(4, "little"))
    rewrite_manifest(store, lambda rows: [row.update({f"xxh3_{tensor_name}": xxhash.xxh3_64_intdigest(data)})
                                          for row in rows if row["sample_id"] == sample_id])


def test_a_duplicate_id_is_served_validated_and_kept_alike(store_path, capsys):
    """The later-named manifest's row was committed first: the reader serves it, validate calls the other one the
    duplicate, and gc keeps both parts (the old rule made gc delete the served part)."""
    first_writer, second_writer = (hsdata.create(str(store_path), **SPEC, **LAYOUT) for _ in range(2))
    later, earlier = sorted([first_writer, second_writer], key=lambda w: w.part, reverse=True)
    served = make_sample(12, 1)
    later.add("twice", **served)
    later.flush()  # committed first, into the manifest whose name sorts last
    earlier.add("twice", **make_sample(12, 2))
    earlier.add("other", **make_sample(30, 3))
    later.close()
    earlier.close()
    with pytest.warns(UserWarning, match="1 duplicate sample rows ignored"):
        store = hsdata.open(str(store_path))
    assert store.location(store.index("twice"))[0] == later.part
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id, p.part) for p in report.problems] == [("duplicate", "twice", earlier.part)]
    assert f"also committed in part {later.part}" in report.problems[0].message
    before = files(store_path)
    assert cli(capsys, "gc", str(store_path), "--yes", "--older-than", "0") == (0, "nothing to delete\n", "")
    assert files(store_path) == before
    with pytest.warns(UserWarning):
        assert_same(hsdata.open(str(store_path)).get("twice"), served)


def test_gc_refuses_when_a_manifest_name_is_unknown(store_path, capsys):
    write_store(store_path, {"a": make_sample(20, 0)}, **LAYOUT)
    folder = store_path / "manifests"
    (name,) = os.listdir(folder)
    part, seq, digest, _ = name.split(".")
    os.rename(folder / name, folder / f"{part}.{seq}.{digest.upper()}.parquet")
    before = files(store_path)
    code, out, _ = cli(capsys, "validate", str(store_path))
    assert code == 1 and out.splitlines()[0] == (f"manifest: manifests/{part}.{seq}.{digest.upper()}.parquet: not a "
                                                 "manifest name (<part>.<seq>.<xxh3 in lowercase hex>.parquet): "
                                                 "readers refuse the store")
    code, out, err = cli(capsys, "gc", str(store_path), "--yes", "--older-than", "0")
    assert (code, out) == (2, "")
    assert err.startswith(f"hsdata gc: error: {store_path}: not cleaning up, what is committed is unclear: "
                          "manifest: ") and err.count("\n") == 1
    assert files(store_path) == before


def test_gc_deletes_only_layout_names_and_never_a_manifest_mask_or_removal(store_path, capsys):
    with hsdata.create(str(store_path), **SPEC, **LAYOUT) as keep:
        keep.add("keep", **{**make_sample(20, 0), "loss_mask": None})
    with hsdata.create(str(store_path), **SPEC, **LAYOUT) as gone:
        gone.add("gone", **make_sample(20, 1))
    storage = Storage(str(store_path))
    removal = removals.write(storage, rows=[("gone", gone.part, 0)], reason="test")
    mask = masks.write(storage, {"keep": bytes([0, 1] * 10)})
    stray = [f"parts/{gone.part}/notes.txt", f"parts/{gone.part}/hidden_states/c/01/0", "parts/.notes"]
    for key in stray:
        os.makedirs(os.path.dirname(store_path / key), exist_ok=True)
        (store_path / key).write_bytes(b"not hsdata's")
    before = files(store_path)
    code, out, _ = cli(capsys, "gc", str(store_path), "--yes", "--older-than", "0", "--json")
    deleted = json.loads(out)["deleted"]
    assert code == 0
    assert deleted == sorted(k for k in before if k.startswith(f"parts/{gone.part}/") and k not in stray)
    assert len(deleted) == 1 + 4 + 4  # the part's group, its 4 arrays' zarr.json, one shard each
    assert files(store_path) == before - set(deleted)
    assert {removal, mask, *stray} <= files(store_path)
    assert all(k in files(store_path) for k in before if k.startswith("manifests/"))
    store = hsdata.open(str(store_path))
    assert store.sample_ids == ["keep"] and store.get("keep")["loss_mask"].tolist() == [0, 1] * 10
    assert validate(str(store_path)).ok


BOUNDED = textwrap.dedent("""
    import json, resource, sys
    import hsdata
    from hsdata.validate import validate
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    out = {{}}
    store = hsdata.open({store!r})
    out["open"] = len(store)
    try:
        store[0]
    except hsdata.CorruptDataError as e:
        out["read"] = str(e)
    report = validate({store!r})
    out["problems"] = [p.line() for p in report.problems]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("shape_too", [False, True])
def test_a_row_of_2_40_tokens_fails_fast_in_bounded_memory(store_path, shape_too, capsys):
    """num_tokens = 2**40 (and, with ``shape_too``, arrays claiming as many): reads and validate fail at once."""
    write_store(store_path, {"huge": make_sample(20, 0), "fine": make_sample(20, 1)}, **LAYOUT)
    rewrite_manifest(store_path, lambda rows: rows[0].update(num_tokens=2**40))
    part = hsdata.open(str(store_path)).location(0)[0]
    if shape_too:
        for tensor in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states"):
            path = store_path / "parts" / part / tensor / "zarr.json"
            document = json.loads(path.read_text())
            document["shape"][0] = 2**40
            path.write_text(json.dumps(document))
    result = subprocess.run([sys.executable, "-c", BOUNDED.format(store=str(store_path))], capture_output=True,
                            text=True, timeout=60, cwd=os.path.dirname(__file__))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["open"] == 2
    if shape_too:
        assert out["read"].startswith("sample 'huge': shard file missing: ") and out["read"].endswith("/c/1")
        whole = [line for line in out["problems"] if f"shard files 1 to {2**40 // 256 - 1} missing" in line]
        assert len(whole) == 4 and all(line.startswith("missing: sample 'huge'") for line in whole)
    else:
        assert out["read"] == (f"sample 'huge': tokens [0, {2**40}) lie beyond the 40 tokens of its array "
                               f"({store_path}/parts/{part}/input_ids/zarr.json)")
        assert [line.split(":")[0] for line in out["problems"]] == ["bounds"] * 5
        assert out["problems"][0].endswith(f"tokens [20, 40) overlap sample 'huge' [0, {2**40})")
        assert all(f"array holds 40 tokens, committed samples need {2**40}" in line for line in out["problems"][1:])
    assert cli(capsys, "gc", str(store_path), "--yes", "--older-than", "0")[0] == 2


def test_rows_of_2_62_tokens_are_bounds_problems_not_overflows(store_path, capsys):
    write_store(store_path, {"a": make_sample(20, 0), "b": make_sample(20, 1)}, **LAYOUT)
    key = rewrite_manifest(store_path, lambda rows: [row.update(num_tokens=2**62) for row in rows])
    with pytest.raises(hsdata.CorruptDataError) as raised:
        hsdata.open(str(store_path))
    assert str(raised.value) == (f"{store_path}/{key}: row 0 (sample 'a'): token_offset 0, num_tokens {2**62}: a "
                                 "row needs token_offset >= 0, num_tokens >= 1 and token_offset + num_tokens <= 2**48 "
                                 "(and 1 more row(s))")
    assert main(["info", str(store_path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"type": "CorruptDataError", "message": str(raised.value)}}
    assert err == f"hsdata info: error: {raised.value}\n"
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id) for p in report.problems] == [("bounds", "a"), ("bounds", "b")]
    assert main(["gc", str(store_path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "CorruptDataError"


@pytest.mark.parametrize("value", [2, 255])
def test_stored_and_added_loss_mask_values_other_than_0_1_are_found(store_path, value):
    with hsdata.create(str(store_path), **SPEC, **LAYOUT) as w:
        w.add("stored", **make_sample(10, 0))
        w.add("added", **{**make_sample(10, 1), "loss_mask": None})
    set_values(store_path, "stored", "loss_mask", np.array([1, 0, value] + [1] * 7))
    masks.write(Storage(str(store_path)), {"added": bytes([0, value] + [1] * 8)})
    report = validate(str(store_path))
    assert sorted((p.kind, p.sample_id, p.message) for p in report.problems) == [
        ("values", "added", f"added loss mask holds {value}; a mask holds only 0 and 1"),
        ("values", "stored", f"loss_mask holds {value}, outside [0, 2)")]
    store = hsdata.open(str(store_path))
    with pytest.raises(hsdata.CorruptDataError, match="sample 'added': its added loss mask holds values other than"):
        store.get("added")


def test_an_added_mask_of_the_wrong_length_is_found_and_never_served(store_path):
    with hsdata.create(str(store_path), **SPEC, **LAYOUT) as w:
        w.add("x", **{**make_sample(8, 1), "loss_mask": None})
    key = masks.write(Storage(str(store_path)), {"x": bytes([1, 0, 1])})
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id, p.key, p.message) for p in report.problems] == [
        ("bounds", "x", key, "added loss mask has 3 tokens, the sample 8")]
    with pytest.raises(hsdata.CorruptDataError, match="sample 'x': its added loss mask has 3 tokens, the sample 8"):
        hsdata.open(str(store_path)).get("x")


def test_a_folder_among_the_manifests_is_a_problem_and_gc_refuses(store_path, capsys):
    write_store(store_path, {"a": make_sample(20, 0)}, **LAYOUT)
    (store_path / "manifests" / "sub").mkdir()
    before = files(store_path)
    report = validate(str(store_path))
    assert [(p.kind, p.message) for p in report.problems] == [
        ("manifest", f"cannot list the manifests: {store_path}/manifests/sub is a folder, not a regular file")]
    assert report.samples == 0 and not report.ok
    assert cli(capsys, "gc", str(store_path), "--yes", "--older-than", "0")[0] == 2
    assert files(store_path) == before


@pytest.mark.parametrize("value", [-1, 1000])
def test_input_ids_outside_the_vocabulary_are_found(store_path, value):
    sample = make_sample(10, 0)
    sample["input_ids"] %= 1000
    with hsdata.create(str(store_path), **SPEC, **LAYOUT, vocab_size=1000) as w:
        w.add("s", **sample)
        w.add("t", **{**sample, "input_ids": sample["input_ids"].flip(0)})
    set_values(store_path, "s", "input_ids", np.array([5, value] + [7] * 8))
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id, p.tensor, p.message) for p in report.problems] == [
        ("values", "s", "input_ids", f"input_ids holds {value}, outside [0, 1000)")]


def test_one_missing_shard_is_one_line_with_its_sample_count(store_path, capsys):
    write_store(store_path, {f"s{i}": make_sample(20, i) for i in range(5)}, **LAYOUT)
    part = hsdata.open(str(store_path)).location(0)[0]
    os.remove(store_path / "parts" / part / "hidden_states" / "c" / "0" / "0")
    code, out, _ = cli(capsys, "validate", str(store_path))
    assert code == 1 and out.splitlines()[:-1] == [
        f"missing: part {part}, tensor hidden_states, {store_path}/parts/{part}/hidden_states/c/0/0: shard file "
        "missing (5 samples)"]
    assert out.splitlines()[-1].startswith("1 PROBLEM(S): 5 of 5 samples")
    code, out, _ = cli(capsys, "validate", str(store_path), "--verbose")
    assert out.splitlines()[1:6] == [f"    sample 's{i}'" for i in range(5)]
    code, out, _ = cli(capsys, "validate", str(store_path), "--json")
    document = json.loads(out)
    assert [p["samples"] for p in document["problems"]] == [[f"s{i}" for i in range(5)]]


def test_json_errors_are_json_documents(tmp_path, capsys):
    error = {"error": {"type": "NotAStoreError", "message": f"{tmp_path / 'x'} is not an hsdata store: no such path"}}
    result = run_cli("info", str(tmp_path / "x"), "--json")
    assert (result.returncode, json.loads(result.stdout)) == (2, error)
    assert result.stderr == f"hsdata info: error: {error['error']['message']}\n"
    for command in ("validate", "gc", "show"):
        code, out, err = cli(capsys, command, str(tmp_path / "x"), *(["0"] if command == "show" else []), "--json")
        assert (code, json.loads(out), err) == (2, error, f"hsdata {command}: error: {error['error']['message']}\n")


class _NoRangeHandler(RangeFilesHandler):
    """A static file server that ignores the Range header: every GET gets the whole file (200)."""

    def serve_file(self, path: str, head: bool) -> None:
        if not os.path.isfile(path):
            return self.send_error(404)
        with open(path, "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)


def test_validate_says_plainly_that_the_server_ignored_the_range_header(tmp_path, monkeypatch):
    import http.server

    monkeypatch.setattr(storage, "RETRY_BASE_S", 0.001)  # whether or not such answers are retried: quickly

    write_store(tmp_path / "store", {f"s{i}": make_sample(20, i) for i in range(3)}, **LAYOUT)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_NoRangeHandler,
                                                                                  directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        report = validate(f"http://127.0.0.1:{server.server_address[1]}/store")
    finally:
        server.shutdown()
    assert report.problems and all(p.kind == "unreadable" and "the server ignored the Range header" in p.message
                                   and len(p.samples) == 3 for p in report.problems)
    assert len(report.problems) == 4  # one per shard file


def test_a_negative_input_id_is_found_without_a_recorded_vocab_size(store_path):
    sample = make_sample(10, 0)
    with hsdata.create(str(store_path), **SPEC, **LAYOUT) as w:  # no vocab_size
        w.add("s", **sample)
        w.add("t", **sample)
    set_values(store_path, "s", "input_ids", np.array([5, -7] + [7] * 8))
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id, p.tensor, p.message) for p in report.problems] == [
        ("values", "s", "input_ids", f"input_ids holds -7, outside [0, {2**31})")]
