"""The ``hsdata`` command line: as a real process, and in-process through ``hsdata.cli.main``."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

import hsdata
from conftest import make_sample, write_store


def hsdata_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdata", *args], capture_output=True, text=True, timeout=120)


COMMANDS_WITHOUT_TORCH = [["--version"], ["--help"], ["info", "{store}"], ["info", "{fp8}", "--json"],
                          ["validate", "{store}"], ["validate", "{fp8}"], ["gc", "{store}"], ["show", "{store}", "s1"],
                          ["show", "{fp8}", "s1", "--json"], ["show", "{demo}", "0"], ["remove", "{store}", "s0"]]


def test_the_metadata_commands_load_neither_torch_nor_transformers(tmp_path, demo_store):
    """``hsdata`` starts in a fraction of torch's import time (benchmarks/cli_start_bench.py): the commands that
    only read a store (show too: its arrays, its tokenizer through ``tokenizers``) never import either."""
    samples = {f"s{i}": make_sample(10 * (i + 1), i) for i in range(3)}
    write_store(tmp_path / "store", samples)
    with hsdata.create(str(tmp_path / "fp8"), hidden_size=32, aux_layers=[1, 2, 3], dtype="float8_e4m3fn") as w:
        for sample_id, sample in samples.items():
            w.add(sample_id, **sample)
    paths = {"store": str(tmp_path / "store"), "fp8": str(tmp_path / "fp8"), "demo": str(demo_store)}
    probe = ("import sys, json\nfrom hsdata.cli import main\ntry:\n    code = main(json.loads(sys.argv[1]))\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print(json.dumps([code, [m for m in ('torch', 'transformers') if m in sys.modules]]))")
    for command in COMMANDS_WITHOUT_TORCH:
        args = [a.format(**paths) for a in command]
        run = subprocess.run([sys.executable, "-c", probe, json.dumps(args)], capture_output=True, text=True,
                             timeout=120)
        assert json.loads(run.stdout.splitlines()[-1]) == [0, []], (args, run.stdout[-500:], run.stderr[-2000:])


def test_info_text_and_json(store_path):
    write_store(store_path, {f"s{i}": make_sample(10 * (i + 1), i) for i in range(5)})
    text = hsdata_cli("info", str(store_path))
    assert text.returncode == 0, text.stderr
    assert "samples     5 in 1 part(s)" in text.stdout
    assert "tokens      150" in text.stdout
    assert "output of layer k = HF hidden_states[k+1]" in text.stdout
    assert "dtype       bfloat16  (computed in bfloat16)" in text.stdout
    result = hsdata_cli("info", str(store_path), "--json")
    summary = json.loads(result.stdout)
    assert summary["samples"] == 5 and summary["tokens"] == 150 and summary["aux_layers"] == [1, 4, 6]
    assert summary["length"]["min"] == 10 and summary["length"]["max"] == 50
    assert summary["payload_bytes"] == 150 * (4 + 1 + 2 * 32 * 4)
    assert summary["format_version"] == 2 and summary["dtype"] == summary["compute_dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype, compute_dtype, row_bytes", [("float32", None, 4), ("float16", "float32", 2)])
def test_info_shows_the_stored_and_the_compute_dtype(store_path, dtype, compute_dtype, row_bytes):
    write_store(store_path, {"s": make_sample(10, 0, dtype=getattr(torch, compute_dtype or dtype))}, dtype=dtype,
                compute_dtype=compute_dtype)
    text = hsdata_cli("info", str(store_path))
    assert f"dtype       {dtype}  (computed in {compute_dtype or dtype})" in text.stdout, text.stdout + text.stderr
    summary = json.loads(hsdata_cli("info", str(store_path), "--json").stdout)
    assert (summary["dtype"], summary["compute_dtype"]) == (dtype, compute_dtype or dtype)
    assert summary["payload_bytes"] == 10 * (4 + 1 + 4 * 32 * row_bytes)


def test_not_a_store_is_exit_code_2_with_one_line(tmp_path):
    result = hsdata_cli("info", str(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"hsdata info: error: {tmp_path} is not an hsdata store: it has no zarr.json"]


def test_bad_usage_is_exit_code_2(tmp_path):
    assert hsdata_cli("frobnicate").returncode == 2
    result = hsdata_cli("info", str(tmp_path), "--storage-option", "novalue")
    assert result.returncode == 2 and "expects KEY=VALUE" in result.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``hsdata.cli.main`` in this process: exit code, stdout, stderr."""
    from hsdata.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    assert run_main(capsys, "--version") == (0, "hsdata 0.1.0\n", "")


def test_help_has_no_markup_and_names_the_exit_codes(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and "``" not in out and "exit codes: 0 success" in " ".join(out.split())


@pytest.mark.parametrize("args, message", [
    (["info", "STORE", "--bogus"], "hsdata info: error: unrecognized arguments: --bogus"),
    (["gc", "STORE", "--older-than", "-5"], "hsdata gc: error: argument --older-than: must be >= 0, got -5"),
    (["extract", "--out", "OUT", "--model", "/no/such/dir"],
     "hsdata extract: error: argument --model: no such path: /no/such/dir"),
    (["extract", "--out", "OUT", "--tokenizer", "/no/such/dir"],
     "hsdata extract: error: argument --tokenizer: no such path: /no/such/dir"),
    (["extract", "--out", "OUT", "--data", "/no/such.jsonl"],
     "hsdata extract: error: argument --data: no such file: /no/such.jsonl"),
    (["extract", "--out", "OUT", "--device", "cdua"],
     "hsdata extract: error: argument --device: not a torch device: 'cdua' (cpu, cuda, cuda:1, mps, ...)"),
])
def test_bad_arguments_are_one_line_with_the_subcommands_usage_and_exit_2(capsys, tmp_path, args, message):
    args = [str(tmp_path / a) if a in ("STORE", "OUT") else a for a in args]
    code, out, err = run_main(capsys, *args)
    assert (code, out) == (2, "")
    assert err.startswith(f"usage: hsdata {args[0]} ") and err.strip().splitlines()[-1] == message


def test_cuda_without_cuda_is_a_bad_argument(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_main(capsys, "extract", "--out", str(tmp_path / "out"), "--device", "cuda")
    assert code == 2 and "argument --device: cuda: CUDA is not available on this machine" in err


@pytest.mark.parametrize("make, why", [
    (lambda p: None, "no such path"),
    (lambda p: p.write_text("x"), "it is a file, not a directory"),
    (lambda p: p.mkdir(), "it has no zarr.json"),
])
def test_a_path_that_is_not_a_store_says_why(capsys, tmp_path, make, why):
    path = tmp_path / "store"
    make(path)
    for command in ("info", "validate", "gc"):
        code, out, err = run_main(capsys, command, str(path))
        assert (code, out) == (2, "")
        assert err.splitlines() == [f"hsdata {command}: error: {path} is not an hsdata store: {why}"], command


def test_info_json_is_rounded_and_sizes_show_payload_and_disk_bytes(capsys, store_path):
    write_store(store_path, {f"s{i}": make_sample(10 + i, i) for i in range(4)})  # lengths 10..13: p90 is 12.7
    code, out, _ = run_main(capsys, "info", str(store_path), "--json")
    summary = json.loads(out)
    assert code == 0 and summary["length"]["p90"] == 12.7 and summary["length"]["min"] == 10
    assert all(len(repr(v).split(".")[-1]) <= 3 for v in summary["length"].values() if isinstance(v, float))
    disk = sum(f.stat().st_size for f in store_path.rglob("*") if f.is_file())
    assert summary["disk_bytes"] == disk > summary["payload_bytes"]
    code, out, _ = run_main(capsys, "info", str(store_path))
    assert "of hidden states and ids" in out and "on disk" in out


def test_gc_names_what_it_keeps_and_has_json(capsys, store_path):
    write_store(store_path, {"s": make_sample(10, 0)})
    leftover = store_path / "parts" / ".x.partial"
    leftover.write_bytes(b"x")
    code, out, _ = run_main(capsys, "gc", str(store_path))
    assert code == 0 and "kept parts/.x.partial (younger than 3600 s: a writer may be running)" in out
    code, out, _ = run_main(capsys, "gc", str(store_path), "--json", "--older-than", "0", "--yes")
    assert code == 0 and json.loads(out) == {"deleted": ["parts/.x.partial"], "kept": [], "older_than": 0}
    assert not leftover.exists()


def test_extract_says_what_it_does_and_shows_totals(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    code, out, _ = run_main(capsys, "extract", "--out", str(tmp_path / "demo"))
    assert code == 0 and out.startswith("OK: 24 samples")
    lines = sys.stderr.getvalue().replace("\r", "\n").splitlines()
    assert lines[:4] == ["training the demo tokenizer ...",
                         "building the demo model (hsdata/demo-llama, random weights) ...",
                         f"reading data {__import__('hsdata.extract.demo').extract.demo.data_path()} ...",
                         "tokenizing 24 records ..."]
    assert "1.64ktok/1.64ktok" in lines[-1] and "24/24 samples" in lines[-1] and "/s written" in lines[-1]


def test_progress_bars_use_the_summaries_binary_units_and_show_totals_rates_and_eta(monkeypatch):
    from hsdata import progress

    monkeypatch.setattr(sys, "stderr", _Terminal())
    with progress.Progress("validate", unit="B", total=3 << 20) as bar:
        bar.update(1 << 20)
    assert "1.00MiB/3.00MiB" in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with progress.Progress("extract", unit="tok", total=2000, samples=4, unit_bytes=1 << 20) as bar:
        bar.update(1000, samples=2)
    shown = sys.stderr.getvalue()
    assert "1.00ktok/2.00ktok" in shown and "tok/s" in shown and "2/4 samples" in shown and "/s written" in shown
    assert "<" in shown  # tqdm's elapsed<remaining (ETA)


def test_remove_takes_samples_or_their_added_masks_out_and_refuses_unknown_ids(capsys, store_path):
    a, b = make_sample(6, 1), make_sample(4, 2)
    write_store(store_path, {"a": a, "b": {**b, "loss_mask": None}})
    hsdata.add_loss_masks(str(store_path), {"b": [1, 0, 0, 1]})
    code, out, _ = run_main(capsys, "remove", str(store_path), "a", "--reason", "leaked")
    assert code == 0 and out.startswith("removed the rows of 1 sample(s): removals/")
    code, out, _ = run_main(capsys, "remove", str(store_path), "b", "--loss-masks", "--json")
    assert code == 0 and json.loads(out)["loss_masks_only"] is True
    store = hsdata.open(str(store_path))
    assert store.sample_ids == ["b"] and store.get("b")["loss_mask"] is None
    removals = sorted(p.name for p in (store_path / "removals").iterdir())
    code, _, err = run_main(capsys, "remove", str(store_path), "a", "nope")
    assert code == 2 and err.count("\n") == 1
    assert "2 of 2 sample removals refused, nothing written: sample 'a': not a committed sample" in err
    assert sorted(p.name for p in (store_path / "removals").iterdir()) == removals


@pytest.mark.parametrize("command", [["info"], ["validate", "--verbose"], ["show", "s0", "--json"]])
def test_a_closed_pipe_ends_the_command_quietly_as_the_shell_expects(store_path, command):
    """``hsdata info STORE | head``: the reader goes away; no error line, exit status 128 + SIGPIPE (or 0 when
    everything was written before it went)."""
    write_store(store_path, {"s0": make_sample(40, seed=0)})
    args = [sys.executable, "-m", "hsdata", command[0], str(store_path), *command[1:]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before it writes: its first write finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and err == ""


@pytest.mark.parametrize("option, value", [("--model", "gpt2"), ("--model", "meta-llama/Llama-3.1-8B"),
                                           ("--tokenizer", "org/name")])
def test_a_hub_id_is_refused_up_front_naming_the_option_and_how_to_download_it(capsys, tmp_path, option, value):
    from hsdata.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["extract", option, value, "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument {option}: {value!r} is not a local folder or file" in err
    assert f"huggingface-cli download {value} --local-dir" in err and not (tmp_path / "s").exists()
