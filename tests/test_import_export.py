"""``hsdata import`` / ``hsdata export``: real dumps on disk in each tool's layout (exact keys, shapes, dtypes),
broken files, resume, several processes, and bit-exact round trips source -> hsdata -> export."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

import hsdata
from hsdata.cli import main
from hsdata.errors import SpecMismatchError
from hsdata.formats import importer

H, K = 16, 3
AUX = ["--aux-layers", "1", "4", "6"]


def _states(g, t, width, dtype=torch.bfloat16):
    return torch.randn(t, width, generator=g).to(dtype)


def specforge_sample(seed: int, t: int | None = None, dtype=torch.bfloat16) -> dict:
    """What SpecForge's prepare_hidden_states saves, in its key order."""
    g = torch.Generator().manual_seed(seed)
    t = t or int(torch.randint(3, 40, (1,), generator=g))
    return {"input_ids": torch.randint(0, 50_000, (t,), generator=g),
            "loss_mask": torch.randint(0, 2, (t,), generator=g),
            "hidden_state": _states(g, t, H, dtype).unsqueeze(0),
            "aux_hidden_state": _states(g, t, K * H, dtype).unsqueeze(0)}


def make_specforge(root, n: int = 6) -> dict[str, dict]:
    samples = {}
    for idx in range(n):
        rel = f"rows_0-2000/data_{idx}.ckpt"
        samples[rel] = specforge_sample(idx)
        os.makedirs(root / "rows_0-2000", exist_ok=True)
        torch.save(samples[rel], root / rel)
    return samples


def make_modelopt(root, n: int = 4) -> dict[str, dict]:
    samples = {}
    root.mkdir(exist_ok=True)
    for idx in range(n):
        g = torch.Generator().manual_seed(100 + idx)
        t = 11 + idx
        data = {"input_ids": torch.randint(0, 50_000, (t,), generator=g),
                "hidden_states": _states(g, t, H), "aux_hidden_states": _states(g, t, K * H),
                "conversation_id": f"conv-{idx}"}
        if idx != 1:  # older ModelOpt versions save no loss mask
            data["loss_mask"] = torch.randint(0, 2, (t,), generator=g)
        samples[f"conv-{idx}.pt"] = data
        torch.save(data, root / f"conv-{idx}.pt")
    return samples


def write_arrow_dataset(root, rows: list[dict]) -> None:
    """What ``datasets.Dataset.save_to_disk`` writes: an Arrow stream file and state.json naming it."""
    table = pa.table({"input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int64())),
                      "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int64())),
                      "seq_len": pa.array([len(r["input_ids"]) for r in rows], pa.int64())})
    with pa.OSFile(str(root / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (root / "dataset_info.json").write_text("{}")


def make_speculators(root, n: int = 4) -> dict[str, dict]:
    samples, rows = {}, []
    (root / "hidden_states").mkdir(parents=True)
    for idx in range(n):
        g = torch.Generator().manual_seed(200 + idx)
        t = 5 + 3 * idx
        data = {"hidden_states": torch.randn(t, K + 1, H, generator=g).to(torch.bfloat16),
                "token_ids": torch.randint(0, 50_000, (t,), generator=g)}
        mask = torch.randint(0, 2, (t,), generator=g)
        save_file(data, root / f"hidden_states/hs_{idx}.safetensors")
        samples[f"hidden_states/hs_{idx}.safetensors"] = {**data, "loss_mask": mask}
        rows.append({"input_ids": data["token_ids"].tolist(), "loss_mask": mask.tolist()})
    write_arrow_dataset(root, rows)
    return samples


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def run_cli(capsys, *argv) -> tuple[int, dict]:
    code = main([*map(str, argv), "--json"])
    captured = capsys.readouterr()
    assert code != 2 or "error" in captured.out, captured.err
    return code, json.loads(captured.out)


def test_specforge_round_trip_is_bit_exact(tmp_path, capsys):
    src, store, out = tmp_path / "sf", tmp_path / "store", tmp_path / "out"
    samples = make_specforge(src)
    samples["rows_0-2000/data_2.ckpt"]["hidden_state"][0, 1, 3] = float("nan")  # NaN is data, not damage
    torch.save(samples["rows_0-2000/data_2.ckpt"], src / "rows_0-2000/data_2.ckpt")
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX, "--model", "test/model")
    assert code == 0 and report["imported"] == 6 and report["bad"] == []
    with hsdata.open(str(store)) as s:
        assert s.spec.final_hidden_state == "post_norm" and s.spec.aux_layers == (1, 4, 6)
        assert s.spec.dtype == "bfloat16" and s.spec.hidden_size == H and len(s) == 6
        got = s.get("rows_0-2000/data_3.ckpt")
        assert same_bits(got["aux_hidden_states"], samples["rows_0-2000/data_3.ckpt"]["aux_hidden_state"][0])
    code, report = run_cli(capsys, "export", "--to", "specforge", store, out)
    assert code == 0 and report["written"] == 6
    for rel, want in samples.items():
        got = torch.load(out / rel, weights_only=True)
        assert list(got) == list(want)  # the same keys, in SpecForge's order
        for key in want:
            assert same_bits(got[key], want[key]), (rel, key)
    code, report = run_cli(capsys, "export", "--to", "specforge", store, out)  # resume: nothing left to do
    assert code == 0 and report["written"] == 0 and report["skipped"] == 6


def test_an_import_into_a_compressed_store_exports_back_bit_exact(tmp_path, capsys):
    src, store, out = tmp_path / "sf", tmp_path / "store", tmp_path / "out"
    samples = make_specforge(src)
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX, "--compression", "zstd")
    assert code == 0 and report["imported"] == 6
    with hsdata.open(str(store)) as s:
        assert s.spec.format_version == 3 and s.spec.compression.cname == "zstd"
    assert run_cli(capsys, "export", "--to", "specforge", store, out)[0] == 0
    for rel, want in samples.items():
        got = torch.load(out / rel, weights_only=True)
        assert all(same_bits(got[key], want[key]) for key in want), rel


@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
def test_exports_are_byte_identical_run_to_run_and_to_torch_save_of_the_final_name(tmp_path, capsys, fmt):
    src, store = tmp_path / "sf", tmp_path / "store"
    make_specforge(src)
    assert run_cli(capsys, "import", "--from", "specforge", src, store, *AUX)[0] == 0
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert run_cli(capsys, "export", "--to", fmt, store, out)[0] == 0
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    assert files and all((outs[0] / f).read_bytes() == (outs[1] / f).read_bytes() for f in files)
    ckpt = next(f for f in files if f.suffix in (".ckpt", ".pt"))
    again = tmp_path / "again" / ckpt.name  # torch.save straight to a file of that name: its zip root is the name
    again.parent.mkdir()
    torch.save(torch.load(outs[0] / ckpt, weights_only=True), again)
    assert again.read_bytes() == (outs[0] / ckpt).read_bytes()
    assert not [p for p in outs[0].rglob(".*")]  # no staging left behind


def test_specforge_gz_and_float32(tmp_path, capsys):
    src, store = tmp_path / "sf", tmp_path / "store"
    (src / "rows_0-2000").mkdir(parents=True)
    want = {f"rows_0-2000/data_{i}.ckpt.gz": specforge_sample(i, dtype=torch.float32) for i in range(2)}
    for rel, data in want.items():
        with gzip.open(src / rel, "wb") as f:
            torch.save(data, f)
    whole = (src / "rows_0-2000/data_1.ckpt.gz").read_bytes()
    (src / "rows_0-2000/data_7.ckpt.gz").write_bytes(whole[: len(whole) - 100])  # a cut gzip stream
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX, "--skip-bad")
    assert code == 0 and report["imported"] == 2
    assert [b["file"] for b in report["bad"]] == ["rows_0-2000/data_7.ckpt.gz"]
    with hsdata.open(str(store)) as s:
        assert s.spec.dtype == "float32"
        got = s.get("rows_0-2000/data_1.ckpt.gz")
        assert same_bits(got["hidden_states"], want["rows_0-2000/data_1.ckpt.gz"]["hidden_state"][0])


class Evil:
    """Unpickling this would create a file: torch.load(weights_only=True) must refuse it first."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_bad_files_are_listed_never_substituted(tmp_path, capsys):
    src, store = tmp_path / "sf", tmp_path / "store"
    make_specforge(src, 4)
    rows = src / "rows_0-2000"
    good = (rows / "data_0.ckpt").read_bytes()
    (rows / "data_10.ckpt").write_bytes(good[: len(good) // 2])  # truncated
    missing = specforge_sample(11)
    del missing["aux_hidden_state"]
    torch.save(missing, rows / "data_11.ckpt")  # wrong keys
    short = specforge_sample(12)
    short["hidden_state"] = short["hidden_state"][:, :-1]
    torch.save(short, rows / "data_12.ckpt")  # shapes disagree
    doubles = specforge_sample(13)
    doubles = {k: v.double() if v.is_floating_point() else v for k, v in doubles.items()}
    torch.save(doubles, rows / "data_13.ckpt")  # float64
    torch.save({**specforge_sample(14), "extra": Evil(str(tmp_path / "pwned"))}, rows / "data_14.ckpt")
    wide = specforge_sample(15)
    wide["hidden_state"] = torch.zeros(1, wide["input_ids"].shape[0], 2 * H, dtype=torch.bfloat16)
    wide["aux_hidden_state"] = torch.zeros(1, wide["input_ids"].shape[0], 2 * K * H, dtype=torch.bfloat16)
    torch.save(wide, rows / "data_15.ckpt")  # consistent in itself, another hidden size than the rest
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX)
    assert code == 1 and report["imported"] == 4 and not report["ok"]
    reasons = {b["file"]: b["reason"] for b in report["bad"]}
    assert set(reasons) == {f"rows_0-2000/data_{i}.ckpt" for i in range(10, 16)}
    assert "truncated" in reasons["rows_0-2000/data_10.ckpt"]
    assert "missing key 'aux_hidden_state'" in reasons["rows_0-2000/data_11.ckpt"]
    assert "shape" in reasons["rows_0-2000/data_12.ckpt"]
    assert "float64" in reasons["rows_0-2000/data_13.ckpt"]
    assert "weights_only" in reasons["rows_0-2000/data_14.ckpt"] and not (tmp_path / "pwned").exists()
    assert "hidden size 32" in reasons["rows_0-2000/data_15.ckpt"]
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX, "--skip-bad")
    assert code == 0 and report["ok"] and report["skipped"] == 4 and len(report["bad"]) == 6, report
    main(["import", "--from", "specforge", str(src), str(store), *AUX, "--skip-bad"])  # text report
    text = capsys.readouterr().out
    assert "bad: rows_0-2000/data_10.ckpt: not a readable torch.save file" in text
    with hsdata.open(str(store)) as s:
        assert len(s) == 4


def test_resume_reverifies_the_last_batch(tmp_path, capsys):
    src, store = tmp_path / "sf", tmp_path / "store"
    samples = make_specforge(src, 5)
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX, "--shard", "0/2")
    assert code == 0 and report["files"] == 3 and report["imported"] == 3
    # the last batch of that run may be unverified after a kill: a rerun checks it against the source again,
    # so a source that changed since (or bytes that went wrong) is taken out and imported anew
    changed = specforge_sample(99, t=samples["rows_0-2000/data_4.ckpt"]["input_ids"].shape[0])
    torch.save(changed, src / "rows_0-2000/data_4.ckpt")
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX)
    assert code == 0 and report["files"] == 5 and report["skipped"] == 2 and report["imported"] == 3
    with hsdata.open(str(store)) as s:
        assert len(s) == 5
        assert same_bits(s.get("rows_0-2000/data_4.ckpt")["hidden_states"], changed["hidden_state"][0])


def test_verification_failure_takes_the_sample_out(tmp_path, capsys, monkeypatch):
    src, store = tmp_path / "sf", tmp_path / "store"
    make_specforge(src, 3)
    real = importer.source_hashes
    calls = []

    def wrong_once(sample, dtype):
        hashes = real(sample, dtype)
        calls.append(1)
        return {**hashes, "hidden_states": hashes["hidden_states"] ^ 1} if len(calls) == 2 else hashes

    monkeypatch.setattr(importer, "source_hashes", wrong_once)
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX)
    assert code == 1 and report["imported"] == 2
    assert "hidden_states differ from the source" in report["bad"][0]["reason"]
    with hsdata.open(str(store)) as s:
        assert "rows_0-2000/data_1.ckpt" not in s and len(s) == 2
    monkeypatch.setattr(importer, "source_hashes", real)
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX)
    assert code == 0 and report["imported"] == 1


def test_several_processes_into_one_store(tmp_path):
    src, store = tmp_path / "sf", tmp_path / "store"
    make_specforge(src, 8)
    command = [sys.executable, "-m", "hsdata", "import", "--from", "specforge", str(src), str(store), *AUX,
               "--commit-bytes", "4096", "--json"]
    procs = [subprocess.Popen([*command, "--shard", f"{k}/3"], stdout=subprocess.PIPE, text=True) for k in range(3)]
    reports = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sorted(r["files"] for r in reports) == [2, 3, 3] and sum(r["imported"] for r in reports) == 8
    with hsdata.open(str(store)) as s:
        assert len(s) == 8 and len(set(s.manifest.column("part").to_pylist())) == 3
    assert hsdata.validate.validate(str(store)).ok


def test_modelopt_round_trip(tmp_path, capsys):
    src, store, out = tmp_path / "mo", tmp_path / "store", tmp_path / "out"
    samples = make_modelopt(src)
    code, report = run_cli(capsys, "import", "--from", "modelopt", src, store, *AUX)
    assert code == 0 and report["imported"] == 4
    with hsdata.open(str(store)) as s:
        assert s.get("conv-1.pt")["loss_mask"] is None
    code, report = run_cli(capsys, "export", "--to", "modelopt", store, out)
    assert code == 0 and report["written"] == 4
    for rel, want in samples.items():
        got = torch.load(out / rel, weights_only=True)
        assert sorted(got) == sorted(want) and got["conversation_id"] == want["conversation_id"]
        for key in want:
            if key != "conversation_id":
                assert same_bits(got[key], want[key]), (rel, key)
    code, report = run_cli(capsys, "export", "--to", "specforge", store, tmp_path / "sf")  # conv-1: no mask
    assert code == 1 and [f["sample_id"] for f in report["failed"]] == ["conv-1.pt"]


def test_speculators_round_trip_keeps_pre_norm(tmp_path, capsys):
    src, store, out = tmp_path / "sp", tmp_path / "store", tmp_path / "out"
    samples = make_speculators(src)
    (src / "hidden_states/hs_9.safetensors").write_bytes(
        (src / "hidden_states/hs_0.safetensors").read_bytes()[:100])  # truncated
    other = {"hidden_states": torch.zeros(4, K + 1, H, dtype=torch.bfloat16), "token_ids": torch.arange(4)}
    save_file(other, src / "hidden_states/hs_3.safetensors")  # token ids no longer match the dataset's row
    del samples["hidden_states/hs_3.safetensors"]
    code, report = run_cli(capsys, "import", "--from", "speculators", src, store, *AUX, "--skip-bad")
    reasons = {b["file"]: b["reason"] for b in report["bad"]}
    assert code == 0 and report["imported"] == 3, report
    assert "truncated" in reasons["hidden_states/hs_9.safetensors"]
    assert "differ from input_ids" in reasons["hidden_states/hs_3.safetensors"]
    with hsdata.open(str(store)) as s:
        assert s.spec.final_hidden_state == "pre_norm"
        got = s.get("hidden_states/hs_2.safetensors")
        want = samples["hidden_states/hs_2.safetensors"]
        assert same_bits(got["hidden_states"], want["hidden_states"][:, -1].contiguous())
        assert torch.equal(got["loss_mask"].long(), want["loss_mask"])
    code, info = run_cli(capsys, "info", store)
    assert code == 0 and info["final_hidden_state"] == "pre_norm"
    assert run_cli(capsys, "validate", store)[0] == 0
    with pytest.raises(SpecMismatchError, match="final_hidden_state"):  # a post-norm writer may not join
        hsdata.create(str(store), hidden_size=H, aux_layers=[1, 4, 6])
    code, report = run_cli(capsys, "export", "--to", "specforge", store, tmp_path / "sf")
    assert code == 2 and "pre_norm" in report["error"]["message"]
    code, report = run_cli(capsys, "export", "--to", "speculators", store, out)
    assert code == 0 and report["written"] == 3
    table = pa.ipc.open_stream(pa.memory_map(str(out / "data-00000-of-00001.arrow"))).read_all()
    for position, want in enumerate(samples.values()):
        got = load_file(out / f"hidden_states/hs_{position}.safetensors")
        assert sorted(got) == ["hidden_states", "token_ids"]
        assert same_bits(got["hidden_states"], want["hidden_states"]) and same_bits(got["token_ids"], want["token_ids"])
        assert table.column("loss_mask")[position].as_py() == want["loss_mask"].tolist()
        assert table.column("input_ids")[position].as_py() == want["token_ids"].tolist()
    code, report = run_cli(capsys, "import", "--from", "speculators", out, tmp_path / "again", *AUX)
    assert code == 0 and report["imported"] == 3  # what export writes, import reads


def test_import_needs_layer_ids(tmp_path, capsys):
    src = tmp_path / "sf"
    make_specforge(src, 1)
    code, report = run_cli(capsys, "import", "--from", "specforge", src, tmp_path / "store")
    assert code == 2 and "--aux-layers" in report["error"]["message"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 12, "vocab_size": 60_000}))
    code, report = run_cli(capsys, "import", "--from", "specforge", src, tmp_path / "store", "--model", config)
    assert code == 0
    with hsdata.open(str(tmp_path / "store")) as s:
        assert s.spec.aux_layers == (1, 5, 8) and s.spec.vocab_size == 60_000
    code, report = run_cli(capsys, "import", "--from", "specforge", src, tmp_path / "s2", "--aux-layers", "2", "6",
                           "9", "--layer-ids", "input")
    with hsdata.open(str(tmp_path / "s2")) as s:
        assert s.spec.aux_layers == (1, 5, 8)


def test_killed_between_commit_and_verification(tmp_path, capsys, monkeypatch):
    src, store = tmp_path / "sf", tmp_path / "store"
    make_specforge(src, 6)
    real = importer._Session.verify

    def killed(self):
        if self.pending:  # the first batch is committed, not yet verified
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(importer._Session, "verify", killed)
    with pytest.raises(KeyboardInterrupt):
        main(["import", "--from", "specforge", str(src), str(store), *AUX, "--commit-bytes", "1"])
    with hsdata.open(str(store)) as s:
        assert len(s) == 1  # committed, never counted
    monkeypatch.setattr(importer._Session, "verify", real)
    checked = []
    monkeypatch.setattr(importer._Session, "recheck", lambda self, rel, real=importer._Session.recheck: (
        checked.append(rel), real(self, rel)))
    code, report = run_cli(capsys, "import", "--from", "specforge", src, store, *AUX, "--commit-bytes", "1")
    assert code == 0 and checked == ["rows_0-2000/data_0.ckpt"]
    assert report["skipped"] == 1 and report["imported"] == 5
