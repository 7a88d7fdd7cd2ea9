"""`hsdata validate` and `hsdata gc`: every flipped, truncated or missing byte is found; leftovers are listed."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

import hsdata
from conftest import SPEC, assert_same, make_sample, write_store
from hsdata import masks
from hsdata.errors import CorruptDataError
from hsdata.io.storage import Storage
from hsdata.layout import shard_key
from hsdata.shard import encoded_chunk_nbytes, index_nbytes, chunks_per_shard
from hsdata.validate import validate


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdata", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "store"
    write_store(path, {f"s{i}": make_sample(20 + 37 * i, i) for i in range(12)})
    return path


@pytest.fixture
def store(pristine, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(pristine, copy)
    return copy


def _files(store, kind):
    files = []
    for root, _, names in os.walk(store):
        for name in names:
            path = os.path.join(root, name)
            if (kind == "manifest") == path.endswith(".parquet") and not name.endswith(".json"):
                files.append(path)
    return sorted(files)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << random.randrange(8))]))


def test_clean_store_validates(store):
    report = validate(str(store))
    assert report.ok and report.samples == report.samples_checked == 12 and not report.leftovers
    result = run_cli("validate", str(store))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK: 12 of 12 samples")


def _shards(store):
    """``(path, part, tensor name, shard index)`` of every shard file."""
    out = []
    for path in _files(store, "shard"):
        parts = os.path.relpath(path, store).split(os.sep)  # parts/<part>/<tensor>/c/<s>[/0]
        out.append((path, parts[1], parts[2], int(parts[4])))
    return out


def _sample_at(store, part, tensor, shard, offset):
    """The sample whose bytes hold file byte ``offset`` of a shard, or None (crc, padding)."""
    chunk, within = divmod(offset, encoded_chunk_nbytes(tensor))
    if within >= tensor.chunk_nbytes:
        return None
    token = shard * store.spec.shard_tokens + chunk * tensor.chunk_tokens + within // tensor.row_nbytes
    for i in range(len(store)):
        p, first, length = store.location(i)
        if p == part and first <= token < first + length:
            return store.sample_ids[i]
    return None


@pytest.mark.parametrize("region", ["payload", "index"])
def test_every_flipped_shard_byte_is_found(store, region, tmp_path):
    random.seed(region)
    spec = hsdata.open(str(store)).spec
    for trial in range(25):
        trial_store = tmp_path / f"t{trial}"
        shutil.copytree(store, trial_store)
        path, part, name, shard = random.choice(_shards(trial_store))
        tensor, size = spec.tensor(name), os.path.getsize(path)
        index_start = size - index_nbytes(chunks_per_shard(spec, tensor))
        offset = random.randrange(index_start) if region == "payload" else random.randrange(index_start, size)
        _flip(path, offset)
        report = validate(str(trial_store))
        assert not report.ok or report.notes, (trial, path, offset)  # damage no sample's bytes hold: a note
        assert {p.kind for p in report.problems} <= {"checksum" if region == "payload" else "index"}
        if region == "payload":
            assert any(p.byte_range[0] <= offset < p.byte_range[1] for p in report.problems if p.byte_range) or \
                report.notes
            opened = hsdata.open(str(trial_store))
            hit = _sample_at(opened, part, tensor, shard, offset)
            # exactly the sample holding the byte is named, and reading it raises; a crc or padding byte is a note
            assert {s for p in report.problems for s in p.samples} == ({hit} if hit is not None else set())
            if hit is not None:
                with pytest.raises(hsdata.CorruptDataError, match=f"sample '{hit}'"):
                    opened.get(hit)
            else:
                assert "no committed sample's bytes are damaged" in " ".join(report.notes)
        shutil.rmtree(trial_store)


def test_every_flipped_manifest_byte_is_found(store, tmp_path):
    random.seed(3)
    for trial in range(25):
        trial_store = tmp_path / f"m{trial}"
        shutil.copytree(store, trial_store)
        path = random.choice(_files(trial_store, "manifest"))
        _flip(path, random.randrange(os.path.getsize(path)))
        report = validate(str(trial_store))
        assert [p.kind for p in report.problems] == ["manifest"], trial
        with pytest.raises(hsdata.CorruptDataError, match="manifest"):
            hsdata.open(str(trial_store))
        shutil.rmtree(trial_store)


def test_truncated_and_deleted_shards_are_found(store):
    aux = [p for p in _files(store, "shard") if "aux_hidden_states" in p]
    os.truncate(aux[0], os.path.getsize(aux[0]) // 2)
    os.remove(aux[1])
    report = validate(str(store))
    kinds = {p.kind for p in report.problems}
    assert "index" in kinds and "missing" in kinds
    assert any(p.samples for p in report.problems if p.kind == "missing")
    result = run_cli("validate", str(store), "--json")
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert not document["ok"] and document["problems"] and all("line" in p for p in document["problems"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_check_finite_flags_nan_samples(store_path, dtype):
    bad = make_sample(30, 1, dtype=dtype)
    bad["hidden_states"][3, 5] = float("nan")
    inf = make_sample(30, 2, dtype=dtype)
    inf["aux_hidden_states"][7, 0] = -float("inf")
    fine = make_sample(30, 0, dtype=dtype)
    fine["hidden_states"][0, :3] = torch.tensor([torch.finfo(dtype).max, -0.0, torch.finfo(dtype).tiny / 2])
    write_store(store_path, {"fine": fine, "nan": bad, "inf": inf}, dtype=dtype, shard_tokens=256, chunk_tokens=16)
    assert validate(str(store_path), check_finite=False).ok
    report = validate(str(store_path))  # checked by default: they would poison a training run
    assert sorted((p.sample_id, p.tensor) for p in report.problems) == [("inf", "aux_hidden_states"),
                                                                         ("nan", "hidden_states")]
    assert all(p.kind == "non_finite" for p in report.problems)
    assert run_cli("validate", str(store_path)).returncode == 1
    assert run_cli("validate", str(store_path), "--no-check-finite").returncode == 0


def test_duplicate_ids_across_parts_are_reported(store_path):
    with hsdata.create(str(store_path), **SPEC) as a, hsdata.create(str(store_path), **SPEC) as b:
        a.add("twice", **make_sample(5, 1))
        b.add("twice", **make_sample(5, 2))
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id) for p in report.problems] == [("duplicate", "twice")]


def test_sample_subset(store):
    report = validate(str(store), sample=3)
    assert report.ok and report.samples_checked == 3
    assert validate(str(store), sample=0.5).samples_checked == 6


DIE_WHILE_WRITING = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
import hsdata
from conftest import SPEC, make_sample
w = hsdata.create({store!r}, **SPEC)
w.add("lost-1", **make_sample(300, 90))  # crosses the 256-token shard boundary: shard 0 gets finished
w.add("lost-2", **make_sample(10, 91))
time.sleep(1.0)  # let the writer thread finish shard 0 (its commit needs shard 1 too)
print(w.part, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_leftovers_are_reported_and_gc_deletes_only_them(store):
    tests = os.path.dirname(__file__)
    died = subprocess.run([sys.executable, "-c", DIE_WHILE_WRITING.format(tests=tests, store=str(store))],
                          capture_output=True, text=True, timeout=120)
    assert died.returncode == -9
    part = died.stdout.strip()
    report = validate(str(store))
    assert report.ok and report.leftovers and report.samples == 12
    assert all(key.startswith(f"parts/{part}/") for key in report.leftovers)
    assert any(".partial" in key for key in report.leftovers) and any(key.endswith("/c/0/0") for key in report.leftovers)
    listed = run_cli("gc", str(store), "--older-than", "0")
    assert listed.returncode == 0 and "run again with --yes" in listed.stdout
    kept = run_cli("gc", str(store), "--yes")  # by default only files older than an hour: a writer may be alive
    assert "kept" in kept.stdout and validate(str(store)).leftovers
    deleted = run_cli("gc", str(store), "--yes", "--older-than", "0")
    assert deleted.returncode == 0 and deleted.stdout.count("deleting ") == len(report.leftovers)
    after = validate(str(store))
    assert after.ok and not after.leftovers and after.samples == 12
    assert run_cli("validate", str(store)).returncode == 0


def test_cli_errors_are_exit_code_2(tmp_path, store):
    not_store = run_cli("validate", str(tmp_path / "nothing"))
    assert not_store.returncode == 2
    assert not_store.stderr.strip().count("\n") == 0 and "is not an hsdata store" in not_store.stderr
    assert "Traceback" not in not_store.stderr
    assert run_cli("validate", str(store), "--sample", "1.5").returncode == 2
    assert run_cli("validate", str(store), "--workers", "0").returncode == 2
    assert run_cli("validate").returncode == 2


def test_bytes_changed_with_a_valid_crc_are_caught_by_the_sample_hash(store):
    """A chunk rewritten with a matching crc32c (misplaced data, not bit rot) still fails the per-sample xxh3."""
    from crc32c import crc32c

    opened = hsdata.open(str(store))
    part, offset, length = opened.location(5)
    tensor = opened.spec.tensor("hidden_states")
    path = os.path.join(str(store), shard_key(part, tensor, offset // opened.spec.shard_tokens))
    chunk = (offset % opened.spec.shard_tokens) // tensor.chunk_tokens + 1
    start = chunk * encoded_chunk_nbytes(tensor)
    with open(path, "r+b") as f:
        f.seek(start)
        data = bytearray(f.read(tensor.chunk_nbytes))
        data[:2] = bytes([data[0] ^ 0xFF, data[1]])
        f.seek(start)
        f.write(bytes(data) + crc32c(bytes(data)).to_bytes(4, "little"))
    report = validate(str(store))
    assert [(p.kind, p.tensor) for p in report.problems] == [("checksum", "hidden_states")]
    assert report.problems[0].sample_id == "s5" and "xxh3" in report.problems[0].message
    assert report.problems[0].byte_range is not None
    with pytest.raises(hsdata.CorruptDataError, match="sample 's5': hidden_states does not match its checksum"):
        hsdata.open(str(store)).get("s5")


def test_added_loss_masks_are_checked(store_path):
    with hsdata.create(str(store_path), **SPEC) as w:
        w.add("x", **{**make_sample(8, 1), "loss_mask": None})
    masks.write(Storage(str(store_path)), {"x": b"\x01\x00\x01"})  # the raw format: add_loss_masks refuses it
    report = validate(str(store_path))
    assert [(p.kind, p.sample_id) for p in report.problems] == [("bounds", "x")]
    assert not report.leftovers


def _edit_json(path, edit) -> None:
    with open(path) as f:
        document = json.load(f)
    edit(document)
    with open(path, "w") as f:
        json.dump(document, f)


def test_an_array_whose_data_type_differs_from_the_spec_is_reported(store):
    part = hsdata.open(str(store)).location(0)[0]
    key = f"parts/{part}/hidden_states/zarr.json"
    _edit_json(os.path.join(store, key), lambda d: d.update(data_type="float32"))
    report = validate(str(store))
    assert [(p.kind, p.tensor, p.key) for p in report.problems] == [("metadata", "hidden_states", key)]
    assert report.problems[0].message == ("data_type is 'float32', the store's spec stores this tensor as "
                                          "'uint16' (bfloat16)")
    result = run_cli("validate", str(store))
    assert result.returncode == 1 and "data_type is 'float32'" in result.stdout
    assert_same(hsdata.open(str(store)).get("s0"), make_sample(20, 0))  # hsdata reads by its spec


def test_a_root_claiming_another_dtype_than_the_files_hold_is_reported_not_crashed_on(store):
    def as_float32(root):
        spec = root["attributes"]["hsdata"]
        spec.update(dtype="float32", compute_dtype="float32")
        for name in ("aux_hidden_states", "hidden_states"):
            spec["tensors"][name].update(data_type="float32", logical_dtype="float32")

    _edit_json(os.path.join(store, "zarr.json"), as_float32)
    report = validate(str(store))
    kinds = {p.kind for p in report.problems}
    assert "metadata" in kinds and kinds & {"index", "missing", "checksum"}, report.problems
    assert any("data_type is 'uint16'" in p.message for p in report.problems)
    with pytest.raises(hsdata.CorruptDataError):
        hsdata.open(str(store)).get("s0")
    _edit_json(os.path.join(store, "zarr.json"), lambda root: root["attributes"]["hsdata"].update(dtype="int4"))
    result = run_cli("validate", str(store))
    assert result.returncode == 2 and "dtype must be one of" in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_damaged_chunk_names_only_the_samples_it_hits(tmp_path, capsys, compression):
    """24 samples share a chunk; a byte flipped in one of them is reported as that sample alone, so the repair
    (hsdata remove) keeps the other 23; a compressed chunk failing its crc32c loses all it holds (readers refuse
    it whole, whether or not it still decompresses), and says so."""
    from hsdata.cli import main

    path = tmp_path / "s"
    with hsdata.create(str(path), **SPEC, shard_tokens=1024, chunk_tokens=256, compression=compression) as w:
        for i in range(24):
            w.add(f"demo-{i:03d}", **make_sample(10, seed=i))
    store = hsdata.open(str(path))
    part, offset, _ = store.location(store.index("demo-016"))
    tensor = store.spec.tensor("hidden_states")
    shard_path = path / shard_key(part, tensor, 0)
    data = bytearray(shard_path.read_bytes())
    if compression is None:
        data[(offset + 3) * tensor.row_nbytes + 5] ^= 0x10  # inside demo-016's rows
    else:
        data[40:48] = bytes(8)  # the compressed chunk's own bytes: it no longer decodes (or decodes wrong)
    shard_path.write_bytes(bytes(data))
    report = validate(str(path))
    (problem,) = report.problems
    if compression is None:
        assert problem.samples == ("demo-016",)
        assert problem.message == ("crc32c mismatch in chunk 0: damages sample 'demo-016' (23 other samples in it "
                                   "intact)")
        assert main(["remove", str(path), *problem.samples]) == 0
        capsys.readouterr()
        assert validate(str(path)).ok and len(hsdata.open(str(path))) == 23
    else:
        assert problem.kind == "checksum" and problem.message.startswith("crc32c mismatch in chunk 0: damages")
        assert problem.message.endswith("readers refuse a compressed chunk that fails its crc32c, so all samples of "
                                        "it are lost")
        assert set(problem.samples) == {f"demo-{i:03d}" for i in range(24)}
        with pytest.raises(CorruptDataError, match="fails its crc32c"):
            hsdata.open(str(path)).get("demo-000")
        assert main(["remove", str(path), *problem.samples]) == 0
        capsys.readouterr()
        assert validate(str(path)).ok and len(hsdata.open(str(path))) == 0
    assert main(["validate", str(path), "--json"]) == 0
