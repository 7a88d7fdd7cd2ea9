"""Hostile store files: symlinks out of the store, FIFOs, huge or deeply nested metadata, odd spec numbers and
table names. Each is refused with an hsdata error naming the file; nothing outside the store is touched, nothing
hangs, nothing is read whole. The cases that could hang or exhaust memory run in a subprocess, under a timeout
and an address-space limit."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import hsdata
import hsdata.validate
from conftest import SMALL_LAYOUT, SPEC, RangeFilesHandler, make_sample, range_answer, write_store
from hsdata.errors import UnsafePathError
from hsdata.layout import MAX_JSON_DEPTH, MAX_METADATA_BYTES
from hsdata.io.storage import Storage
from hsdata.tables import MAX_TABLE_BYTES

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def store(store_path):
    write_store(store_path, {f"s{i}": make_sample(20 + 7 * i, i) for i in range(3)})
    return store_path


@pytest.fixture
def outside(tmp_path):
    """A folder next to the store with a sentinel file in it; tests check it is left exactly as it was."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "sentinel.txt").write_text("nothing in a store may read, write or delete this\n")
    return folder


def tree_digest(folder) -> str:
    """A hash of every name and content under ``folder`` (symlinks by their target, not followed)."""
    h = hashlib.sha256()
    for directory, folders, files in sorted(os.walk(folder)):
        for name in sorted(folders + files):
            path = os.path.join(directory, name)
            h.update(os.path.relpath(path, folder).encode())
            if os.path.islink(path):
                h.update(os.readlink(path).encode())
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def one_shard(store) -> str:
    """A shard file of the store (the first part's input_ids shard 0)."""
    part = next(p for p in sorted(os.listdir(store / "parts")) if p != "zarr.json")
    return str(store / "parts" / part / "input_ids" / "c" / "0")


def root_attributes(store) -> dict:
    return json.loads((store / "zarr.json").read_text())


def write_root(store, document) -> None:
    (store / "zarr.json").write_text(json.dumps(document))


def run_isolated(body: str, *, memory_margin: int | None = None) -> dict:
    """Run ``body`` (which sets ``result``, a JSON-able dict) in a fresh interpreter, killed after 30 s. With
    ``memory_margin``, the address space is capped at what the interpreter uses once hsdata and torch are
    imported plus that many bytes."""
    script = textwrap.dedent("""
        import json, resource, sys
        sys.path.insert(0, {here!r})
        import torch, hsdata, hsdata.validate
        margin = {margin!r}
        if margin is not None:
            vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + margin, vm + margin))
        def outcome(call):
            try:
                value = call()
            except Exception as e:
                return {{"error": type(e).__name__, "message": str(e), "hsdata": isinstance(e, hsdata.HsdataError)}}
            return {{"value": repr(value)[:200]}}
        result = {{}}
    """).format(here=HERE, margin=memory_margin) + textwrap.dedent(body) + "\nprint(json.dumps(result))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# --- symlinks out of the store -------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["parts", "manifests"])
def test_a_store_folder_symlinked_outside_is_refused_by_reads_and_writers(store, outside, folder):
    """(Reads raise UnsafePathError, a CorruptDataError; the reader may wrap it in one naming the sample.)"""
    shutil.move(str(store / folder), str(outside / folder))
    os.symlink(outside / folder, store / folder)
    before = tree_digest(outside)
    leads_out = rf"store/{folder}(/.*)? leads out of the store \(to .*outside/{folder}"
    with pytest.raises(hsdata.CorruptDataError, match=leads_out):
        hsdata.open(str(store))[0]
    with pytest.raises(hsdata.HsdataError, match=rf"store/{folder}(/.*)? leads out of the store"):
        with hsdata.create(str(store), **SPEC, **SMALL_LAYOUT) as w:
            w.add("new", **make_sample(5, 9))
    assert tree_digest(outside) == before


def test_a_part_folder_symlinked_outside_is_refused(store, outside):
    part = next(p for p in os.listdir(store / "parts") if p != "zarr.json")
    shutil.move(str(store / "parts" / part), str(outside / part))
    os.symlink(outside / part, store / "parts" / part)
    before = tree_digest(outside)
    s = hsdata.open(str(store))
    with pytest.raises(hsdata.CorruptDataError, match=rf"parts/{part}/.* leads out of the store"):
        s[0]
    report = hsdata.validate.validate(str(store))
    assert not report.ok and any("leads out of the store" in p.message for p in report.problems)
    assert tree_digest(outside) == before


def test_a_shard_symlinked_to_a_file_outside_is_refused_without_verification(store, outside):
    shard = one_shard(store)
    os.unlink(shard)
    os.symlink(outside / "sentinel.txt", shard)
    with pytest.raises(hsdata.CorruptDataError, match=r"input_ids/c/0 leads out of the store \(to .*sentinel.txt\)"):
        hsdata.open(str(store), verify=False)[0]


def test_a_symlink_that_stays_inside_the_store_is_followed(store):
    os.rename(store / "manifests", store / "manifests-real")
    os.symlink("manifests-real", store / "manifests")
    assert hsdata.open(str(store))[2]["input_ids"].shape == (34,)


def test_keys_that_could_name_something_outside_are_refused(store):
    storage = Storage(str(store))
    for key in ["/etc/hostname", "../outside/sentinel.txt", "parts/../../x", "parts//zarr.json", "./zarr.json",
                "zarr.json\0"]:
        with pytest.raises(UnsafePathError, match="not a key inside the store"):
            storage.read_bytes(key)


def test_storage_find_and_delete_never_follow_symlinks(store, outside):
    storage = Storage(str(store))
    shard = one_shard(store)
    assert os.path.relpath(shard, store) in storage.find("parts")
    assert storage.disk_usage() == sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs)
    os.symlink(outside / "sentinel.txt", store / "parts" / "link")
    with pytest.raises(UnsafePathError, match=r"parts/link is a symlink"):
        storage.find("parts")
    with pytest.raises(UnsafePathError, match="leads out of the store"):
        storage.delete("parts/link")
    os.symlink("zarr.json", store / "parts" / "inner-link")
    with pytest.raises(UnsafePathError, match=r"parts/inner-link is a symlink, not a regular file: not deleted"):
        storage.delete("parts/inner-link")
    assert (outside / "sentinel.txt").exists() and (store / "parts" / "zarr.json").exists()
    key = os.path.relpath(shard, store)
    assert abs(storage.modified(key) - os.path.getmtime(shard)) < 1e-6
    storage.delete(key)
    assert not os.path.exists(shard)
    assert storage.find("nothing-here") == []


# --- FIFOs: refused at once, never opened for a blocking read --------------------------------------------------


def test_fifos_as_zarr_json_and_as_a_shard_fail_fast(store):
    shard = one_shard(store)
    os.unlink(shard)
    os.mkfifo(shard)
    other = store.parent / "fifo-root"
    shutil.copytree(store, other, ignore=lambda d, names: [n for n in names if n == "0"])
    os.unlink(other / "zarr.json")
    os.mkfifo(other / "zarr.json")
    result = run_isolated(f"""
        result["shard_read"] = outcome(lambda: hsdata.open({str(store)!r})[0])
        report = hsdata.validate.validate({str(store)!r})
        result["shard_validate"] = [p.message for p in report.problems]
        result["root_open"] = outcome(lambda: hsdata.open({str(other)!r}))
        result["root_validate"] = outcome(lambda: hsdata.validate.validate({str(other)!r}))
    """)
    assert result["shard_read"]["error"] in ("UnsafePathError", "CorruptDataError")  # the reader may name the sample
    assert "input_ids/c/0 is a FIFO, not a regular file" in result["shard_read"]["message"]
    assert any("is a FIFO" in m for m in result["shard_validate"])
    for case in ("root_open", "root_validate"):
        assert result[case]["error"] == "UnsafePathError", result[case]
        assert "fifo-root/zarr.json is a FIFO, not a regular file" in result[case]["message"]


# --- sizes: refused before anything is read --------------------------------------------------------------------


def test_huge_metadata_and_tables_are_refused_before_reading_under_a_memory_limit(store, tmp_path):
    big_root, zero_root, big_table = (tmp_path / name for name in ("big-root", "zero-root", "big-table"))
    for copy in (big_root, zero_root, big_table):
        shutil.copytree(store, copy)
    os.truncate(big_root / "zarr.json", 1536 << 20)  # 1.5 GB, sparse
    os.unlink(zero_root / "zarr.json")
    os.symlink("/dev/zero", zero_root / "zarr.json")
    manifest = next((big_table / "manifests").iterdir())
    os.truncate(manifest, MAX_TABLE_BYTES + 1)
    result = run_isolated(f"""
        import time
        start = time.monotonic()
        result["big_root"] = outcome(lambda: hsdata.open({str(big_root)!r}))
        result["zero_root"] = outcome(lambda: hsdata.open({str(zero_root)!r}))
        result["big_table"] = outcome(lambda: hsdata.open({str(big_table)!r}))
        result["seconds"] = time.monotonic() - start
    """, memory_margin=512 << 20)
    assert result["big_root"]["error"] == "CorruptDataError"
    assert result["big_root"]["message"] == (f"{big_root}/zarr.json is 1,610,612,736 bytes, more than the "
                                             f"{MAX_METADATA_BYTES:,} allowed")
    assert result["zero_root"]["error"] == "UnsafePathError"
    assert result["zero_root"]["message"].startswith(f"{zero_root}/zarr.json leads out of the store (to /dev/zero)")
    assert result["big_table"]["error"] == "CorruptDataError"
    assert f"manifests/{manifest.name} is {MAX_TABLE_BYTES + 1:,} bytes, more than" in result["big_table"]["message"]
    assert result["seconds"] < 5


def test_a_huge_remote_zarr_json_is_refused_after_one_bounded_ranged_get(store, tmp_path):
    (store / "zarr.json").write_bytes(b" " * (8 << 20))
    sent = []

    class Handler(RangeFilesHandler):
        def serve_file(self, path: str, head: bool) -> None:
            if not os.path.exists(path):
                return self.send_error(404)
            status, headers, body = range_answer(path, self.headers.get("Range"))
            sent.append((os.path.basename(path), len(body)))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: Handler(*a, directory=str(tmp_path),
                                                                                      **k))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/store"
        with pytest.raises(hsdata.CorruptDataError, match=rf"store/zarr.json is more than the "
                                                          rf"{MAX_METADATA_BYTES:,} bytes allowed"):
            hsdata.open(url)
    finally:
        server.shutdown()
    assert [n for name, n in sent if name == "zarr.json"] == [MAX_METADATA_BYTES + 1]


def test_a_table_whose_footer_declares_more_than_the_cap_is_refused(monkeypatch):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import xxhash

    from hsdata import tables

    table = pa.table({"a": list(range(1000))})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    name = f"w.00000000.{xxhash.xxh3_64_hexdigest(data)}.parquet"
    monkeypatch.setattr(tables, "MAX_TABLE_BYTES", 100)  # the footer says ~8 KB: over this cap
    declared = r"t\.parquet: its footer declares [\d,]+ bytes of data; at most 100 are allowed"
    with pytest.raises(hsdata.CorruptDataError, match=declared):
        tables.decode(name, data, table.schema, "t.parquet")


# --- metadata documents ----------------------------------------------------------------------------------------


def test_json_nested_200000_deep_is_refused(store):
    (store / "zarr.json").write_text("[" * 200_000 + "]" * 200_000)
    deeper = rf"store/zarr.json is nested deeper than {MAX_JSON_DEPTH} levels"
    with pytest.raises(hsdata.CorruptDataError, match=deeper):
        hsdata.open(str(store))
    write_root(store, {"attributes": {"hsdata": json.loads("[" * 40 + "]" * 40)}})
    with pytest.raises(hsdata.CorruptDataError, match=rf"nested deeper than {MAX_JSON_DEPTH} levels"):
        hsdata.open(str(store))


@pytest.mark.parametrize("document, error, message", [
    ({"zarr_format": 3, "node_type": "group", "attributes": None}, hsdata.CorruptDataError,
     r"store/zarr.json: attributes must be a JSON object, got NoneType"),
    ([1, 2, 3], hsdata.CorruptDataError, r"store/zarr.json is not a JSON object \(got list\)"),
    ({"zarr_format": 3, "attributes": {"hsdata": None}}, hsdata.UnsupportedFormatError,
     r"store/zarr.json: hsdata attributes must be a JSON object, got NoneType"),
])
def test_malformed_root_documents_are_refused(store, document, error, message):
    write_root(store, document)
    with pytest.raises(error, match=message):
        hsdata.open(str(store))


@pytest.mark.parametrize("field, value, message", [
    ("format_version", True, r"Unsupported hsdata format version True"),
    ("format_version", 1.0, r"Unsupported hsdata format version 1.0"),
    ("hidden_size", 1e30, r"hidden_size must be a positive integer, got 1e\+30"),
    ("hidden_size", 2**21, r"hidden_size must be at most 1048576, got 2097152"),
    ("aux_layers", [1, 4, 4096], r"layer ids in \[0, 4095\]"),
    ("aux_layers", list(range(65)), r"at most 64 layer ids"),
    ("shard_tokens", 10**30, r"shard_tokens must be at most 1048576"),
    ("shard_tokens", 384, r"shard_tokens must be a power of two, got 384"),
    ("vocab_size", 2**31 + 1, r"vocab_size 2147483649 does not fit int32 token ids"),
    ("vocab_size", 0, r"vocab_size must be a positive integer, got 0"),
])
def test_out_of_range_spec_numbers_are_refused(store, field, value, message):
    document = root_attributes(store)
    document["attributes"]["hsdata"][field] = value
    write_root(store, document)
    with pytest.raises(hsdata.UnsupportedFormatError, match=rf"store/zarr.json: .*{message}"):
        hsdata.open(str(store))


def test_a_consistent_but_huge_hidden_size_is_refused(store):
    """Widths that agree with hidden_size 10**30 (so only the range check can refuse it)."""
    document = root_attributes(store)
    spec = document["attributes"]["hsdata"]
    spec["hidden_size"] = 10**30
    spec["tensors"]["aux_hidden_states"]["width"] = 3 * 10**30
    spec["tensors"]["hidden_states"]["width"] = 10**30
    write_root(store, document)
    with pytest.raises(hsdata.UnsupportedFormatError, match=r"hidden_size must be at most 1048576"):
        hsdata.open(str(store))


def test_chunk_tokens_must_divide_shard_tokens_as_a_power_of_two(store):
    document = root_attributes(store)
    document["attributes"]["hsdata"]["tensors"]["input_ids"]["chunk_tokens"] = 512
    write_root(store, document)
    with pytest.raises(hsdata.UnsupportedFormatError, match=r"tensors.input_ids.chunk_tokens must be at most 256"):
        hsdata.open(str(store))


# --- table folders: nothing that belongs there is skipped ------------------------------------------------------


@pytest.mark.parametrize("rename", [
    lambda n: n.rsplit(".", 2)[0] + "." + n.rsplit(".", 2)[1].upper() + ".parquet",  # upper-case hash
    lambda n: n.replace(".00000000.", ".0000000."),  # seven digits
    lambda n: n + ".bak",
])
def test_a_misnamed_manifest_makes_the_store_unreadable_not_empty(store, rename):
    manifests = store / "manifests"
    name = min(os.listdir(manifests))
    bad = rename(name)
    os.rename(manifests / name, manifests / bad)
    with pytest.raises(hsdata.CorruptDataError, match=rf"manifests/{bad.replace('.', '[.]')}: not a table file name"):
        hsdata.open(str(store))


def test_dot_hidden_files_in_table_folders_are_writes_in_progress(store):
    (store / "manifests" / ".w.00000001.0123456789abcdef.parquet.1a2b3c.partial").write_bytes(b"half")
    assert len(hsdata.open(str(store))) == 3


def test_a_folder_or_a_fifo_named_like_a_manifest_is_refused(store):
    manifests = store / "manifests"
    name = min(os.listdir(manifests))
    os.rename(manifests / name, store / name)
    os.mkdir(manifests / name)
    with pytest.raises(UnsafePathError, match=rf"manifests/{name.replace('.', '[.]')} is a folder, not a regular file"):
        hsdata.open(str(store))
    os.rmdir(manifests / name)
    os.mkfifo(manifests / name)
    result = run_isolated(f"""
        result["open"] = outcome(lambda: hsdata.open({str(store)!r}))
        result["validate"] = [p.message for p in hsdata.validate.validate({str(store)!r}).problems]
    """)
    assert result["open"]["error"] == "UnsafePathError"
    assert f"manifests/{name} is a FIFO, not a regular file" in result["open"]["message"]
    assert any(f"manifests/{name} is a FIFO, not a regular file" in m for m in result["validate"])


def test_a_table_folder_replaced_by_a_file_is_refused(store):
    shutil.rmtree(store / "manifests")
    (store / "manifests").write_bytes(b"not a folder")
    with pytest.raises(UnsafePathError, match=r"store/manifests is a regular file, not a folder"):
        hsdata.open(str(store))
